"""Sparse MoE prefill (context encoding) for a chunk of N tokens on one TP rank split over its LNC cores.

Same math as the decode subkernel (``nki_kernels/moe.py``, ``moe_tkg``; twin ``model.tp.moe.moe_rank``), reading
the SAME per-rank weight layout (:func:`nki_kernels.moe.moe_hbm_layout`: router block, expert blocks, shared
expert; whole tensors, or a stacked group with ``layer=`` as ``megakernel.sharded`` builds them)::

    logits = x Wr^T (rounded to the activation dtype)       p = softmax(logits) in fp32
    top-k set with ties to the LOWER expert index, w = p_top / sum(p_top) rounded to the activation dtype
    y = sum_e w_e * down_e(silu(gate_e x) * up_e x)  +  sigmoid(w_seg . x) * shared(x)

Layouts
-------
* input ``x [N*H/128, 128]`` HBM, activation dtype: the chunk's normed hidden states TOKEN-major, each token's
  H features as H/128 consecutive rows of 128 (row t*H/128 + j = x[t, j*128:(j+1)*128]): a free reshape of the
  [N, H] output of the composition's post-attention RMSNorm, which makes it without any transpose. 128-element
  rows are what the gather-transpose DMA moves (its indices address rows of the base tensor).
  :func:`token_rows` converts on the host. N is a compile-time shape (one specialisation per chunk length).
* output ``y [N, H]`` HBM float32: the RANK's partial of the MoE output (the sum over the TP ranks is the block
  output before its cast). Core c writes the full rows of token tiles c, c + L, ... (128 tokens each, L = LNC
  degree), so the rows are disjoint between the cores: the composition all-reduces y over the ranks only.
* output ``finite [L, 1]`` float32: 1.0 when every router logit of the chunk (and every softmax row sum) is
  finite. A NaN or Inf anywhere in a token's hidden state reaches all of its router logits (x . w over all of
  H), so a non-finite input is reported here instead of propagating silently; :func:`check_finite` raises.

Work split over the LNC cores
-----------------------------
Core c owns the contraction rows ``h in [c*H/L, (c+1)*H/L)`` of every projection and the output columns
``[c*H/L, (c+1)*H/L)`` of every expert's down projection. It reads the gate|up rows of ITS h-half of BOTH
cores' expert blocks and the down rows of ITS output half of both blocks (the decode layout folds the down
projection into R = 128/ic row groups, group g holding output columns g*H/R..: core c's groups are contiguous
partitions), so every element of every used expert is read exactly once per rank per chunk and the cores' DMA
halves are equal whatever the routing. The fp32 partial gate/up sums are swapped with ``sendrecv`` and added on
both cores, which then hold the full intermediate and contract the down projection over all of it (K = 128 at
the real shapes: the full PE array). Both cores route the same data, so every register, trip count and loop is
the same on both (the LNC rule); the cores differ only in static addresses.

Algorithm (static code over compile-time shapes; data enters only through DMA offsets, gather indices,
register values and one runtime loop)
-------------------------------------------------------------------------------------------------------
0. x^T of the core's h-rows is made resident in SBUF (``xr [128, N, jc]``, token-major within a partition) by
   DMA transposes (bfloat16, SDK-TRN2: up to 90 % of the DMA rate; float32: PE transposes). The router and the
   shared expert read it.
1. **Router** per 128-token tile: partial logits over the core's h-rows (stationary x^T tile, moving the
   router columns of both router blocks), added to the other core's partial, rounded; softmax, exact top-k set
   and renormalised weights by the decode kernel's method (``max8`` values only and the unique key
   ``(p == vk) * (E - e)`` for tied experts: no instruction's tie behaviour is relied on). A token's k experts
   ascending come from ``max8`` of ``sel * (E - e)``; ``nc_n_gather`` picks the weight of the k chosen experts.
   At LNC=2 the tiles are paired and each core routes one tile of every pair (one sendrecv per pair brings it
   the other core's partial logits; the per-pair counts are swapped at the end for the totals; a second
   sendrecv swaps the compact results of all full-tile pairs in one packed transfer), which halves the
   DVE-bound routing.
   **Placement** (pass 1 of the index table, issued while routing: the scatters queue on POOL, idle under the
   DVE-bound routing): each choice's position among THIS core's tokens of its expert (ascending token order) from
   a strict-lower-triangular ones matmul plus ones matmuls over the core's earlier tiles (PE, exact in fp32);
   the index table holds ``cap`` rows per expert (expert e's at e*cap), core 0's tokens filling them from the
   front and core 1's from the back (row e*cap + cap - 1 - position), so the two never meet while the expert
   is regular and neither core needs the other's counts. One scatter DMA per (tile, choice) writes the token's
   row index of x into that row of a table of its own per core and choice (a scatter's written region is its
   whole table: separate tables keep the scatters independent); positions >= cap are skipped (out of bounds).
2. **Grouping**: per-expert counts c_e. An expert is *regular* if 0 < c_e <= ``capacity`` (compile-time,
   :func:`default_capacity`: mean + 3.5 sigma + 8 of uniform routing, a multiple of 16) and *heavy* above. The
   regular experts, ascending, take static slots 0..S-1 (S = min(E, N k)), slot s owning scratch rows
   ``[s*cap, (s+1)*cap)``; heavy experts get whole 128-row windows after the E*cap table rows (the same rows in
   the table and the scratch). After a ``core_barrier`` on each of the L*k tables, ``dma_compute`` sums per row
   chunk merge them into the index table (one word per row; unwritten rows read as token 0, whose outputs are never
   read). A heavy expert's rows are placed by a runtime loop of min(heavy windows, 1) trips (0 for realistic
   routing; the same on both cores): its rank = core 0's position, or core 0's count + core 1's, scattered into
   the heavy windows and merged again. Every (token, choice)'s scratch row is ``base(e) + position`` (heavy:
   the window base + that rank), kept for the combine.
3. **Regular slots** (static loop over S; the slot's expert id and first table row e*cap are registers; its
   weight DMAs -- two per slot and core, 2 KB runs -- are ``scalar_offset`` reads on the expert axis with
   ``oob_mode=skip``, so an unused slot moves no byte, and an unused slot gathers zeroed spare rows): one
   gather-transpose DMA (SW-DGE) brings the x^T columns of the slot's cap tokens straight
   from HBM (bfloat16; float32 gathers rows and transposes on the PE); gate|up with the weights stationary and
   the tokens moving (one matmul per h-block and gate/up, gate and up in one PSUM bank), the fp32 partials
   swapped and added, rounded, ``h = silu(g) * u`` rounded (the twin's casts), and the down projection per
   window of <= 128 rows with h^T stationary, evicted rounded to the activation dtype (the twin rounds each
   rank's down projection the same way) and written to the slot's scratch rows. The loop is software-pipelined
   in program order (engines and DMA trigger queues execute in program order): weights up to RING slots ahead
   (the ring filled two slots per slot at the start), x gathers GATHER_AHEAD ahead, gate|up UP_AHEAD ahead of
   the down projection, every per-slot tile in a ring. The **shared expert** runs as one job per 128-token tile
   on the resident x^T, its jobs spread among the slots' (its rows, rounded like the twin's, go to the scratch
   rows after the heavy windows').
4. **Heavy experts** (only if ``capacity < N``): ONE runtime loop over their 128-row windows (trip count = the
   number of heavy windows, 0 for realistic routing); a window's weight DMAs are skipped (out-of-bounds id)
   unless it is its expert's first window, so a heavy expert is also read once. Loop state in SBUF only; no
   PSUM tensor lives across the loop.
5. **Combine** (after a ``core_barrier``: the other core wrote the other half of the columns) per token tile
   of this core: k full-row gathers from the scratch and the shared rows, summed on the PE against ``diag(w)``
   stationaries (the routing weights in the activation dtype, as the twin's ``weights.to(x.dtype)``; fp32 PSUM)
   and the shared rows times their fp32 sigmoid gate on the eviction, into the fp32 output.
6. **Fused next step** (optional, ``moe_prefill(residual=..., tp=, norm_w=, norm_out=)``, what the composition
   runs on trn2): the combine takes groups of 2 consecutive token tiles per core instead, all-reduces a group's
   fp32 rows over the TP ranks (one SBUF collective), adds the block's residual and writes the new residual and
   the next RMSNorm's rows or xT (``rmsnorm_prefill.residual_norm_tile``): the math of
   ``megakernel.prefill.residual_allreduce_stage`` on y, bit for bit, without y's HBM round trip or a launch.
   4K: 2,082 us (1,866 - 2,604) central (2,145 before the placement moved into the routing,
   ``bench/prefill_moe.md``; against 2,058 + 245 + 13 unfused at the fusion's commit, ``bench/prefill_speed.md``).

Read bound: a regular expert is read once in step 3, a heavy one once in step 4 (at its first window), an
unused slot or a continuation window not at all; :func:`routed_expert_bytes` counts the reads of an executing
trace (nkisim records a skipped transfer with its bytes but an unresolved offset, which the counter drops; the
cost model still charges those bytes, so a prediction with unused slots -- N k < E -- is pessimistic).

ACT runs only ``exp`` (routing) then ``silu`` (experts): one table switch; every PSUM eviction is on DVE.

Predicted, the fused form the composition runs (``harness.prefill.Costs(cfg).moe_fused(N, "xT")``: real
per-rank shapes, TP=4, LNC=2, bf16, traced on 4 ranks; the registers of a shape-only launch read 0, which is
the realistic routing at N k >= E -- all 256 slots used, no heavy expert): N = 1024: 1,193 us central
(1,061 - 1,586), 605 MB HBM per rank; N = 4096: 2,082 us (1,866 - 2,604), 1,026 MB (roofline 1,615 us). The
weight floor is 404 MB per rank per layer (256 experts x 1.5 MiB + router + shared) = 637 us at 635 GB/s; the
compute floor (15.2 MFLOP per token and rank at 132 TFLOP/s per rank) 118 / 472 us. Beyond the weights the
kernel moves every assignment's x rows in and its output rows out and back (4 KB each per rank), plus the
slots' padding (capacity 64 / 176 against mean counts 32 / 128); at 4K its timeline is routing with the
placements ~10-210 us (DVE), grouping, the 16 table barriers and the merge ~70 us, the slots and the shared expert ~1.5 ms at
the HBM and DMA-engine bounds together (weights, x gathers, output rows), the fused combine ~300 us. Levers
tried and their measured effect: ``bench/prefill_moe.md``.
"""

from __future__ import annotations

import math

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import INT32_MAX, P, PSUM_BANK, own_identity, program_sharding
from nki_kernels.moe import MAX8, block_width, geometry as _geometry, layers_per_table
from nki_kernels.rmsnorm_prefill import broadcast_weight, norm_output, residual_norm_tile, token_group_ap

BANK = PSUM_BANK    # fp32 elements per PSUM bank (nl.tile_size.psum_bank_fmax)
WIN = 128           # rows of one down-projection window (token-major output rows on partitions)
RING = 8            # expert weight buffers in flight (6 KB per partition each at the real shapes) ...
RING_BUDGET = 112 * 1024    # ... within this many SBUF bytes per partition together with the resident x^T
XR_BUDGET = 64 * 1024       # SBUF bytes per partition the resident x^T may take (4,096 bf16 tokens at LNC=2)
XCH = 256           # tokens per x^T transpose DMA
PSUM_POOL = 7       # PSUM banks handed out round-robin to the slot and combine phases
UP_AHEAD = 2        # slots whose gate|up is issued before the down projection of the current slot
GATHER_AHEAD = 6    # slots whose x^T gather is issued ahead
FUSE_TILES = 2      # 128-token tiles per collective of the fused combine (16 KB fp32 per partition)
F32 = nl.float32
I32 = nl.int32
U32 = nl.uint32
POOL_ENG = nisa.engine.gpsimd


# ---------------------------------------------------------------------------------------------
# geometry (traced and host): the one home of the prefill's split and table sizes
# ---------------------------------------------------------------------------------------------

def default_capacity(n_tokens, n_experts, top_k):
    """Static tokens per regular expert slot: mean + 3.5 sigma + 8 of uniformly random routing (mean = N k / E,
    sigma = sqrt(mean)), rounded up to a multiple of 16, at most N rounded up to 16 (then no expert can be
    heavy). At the real shapes (E 256, k 8): N = 512 -> 48, 1024 -> 64, 2048 -> 112, 4096 -> 176 (an expert
    above it -- uniform routing: P ~ 1e-5 per expert -- takes the exact but serial heavy path)."""
    mean = n_tokens * top_k / n_experts
    cap = int(math.ceil((mean + 3.5 * math.sqrt(mean) + 8.0) / 16.0)) * 16
    return min(-(-n_tokens // 16) * 16, cap)


def core_split(J, lnc, pid):
    """(first h-block, h-blocks, first partition, partitions) of core ``pid``'s contraction rows: whole 128-row
    blocks when J splits over the cores, else (J = 1, LNC = 2) the two 64-partition halves of the one block."""
    if J % lnc == 0:
        return J // lnc * pid, J // lnc, 0, P
    if J == 1 and lnc == 2:
        return 0, 1, pid * (P // 2), P // 2
    raise ValueError(f"moe_prefill: {J} hidden blocks of {P} do not split over {lnc} cores")


def table_rows(n_tokens, n_experts, top_k, cap):
    """(S, heavy-window bound, first heavy row, rows) of the index table and the scratch rows: S = min(E, N k)
    regular slots; the index table holds ``cap`` rows per EXPERT (E cap, rounded up to 128: expert e's at
    e*cap, placed while routing), the scratch ``cap`` rows per slot; both then at most N k // 128 + N k // (cap
    + 1) heavy windows of 128 rows (none when cap >= N) from the same first heavy row."""
    A = n_tokens * top_k
    S = min(n_experts, A)
    hb = -(-n_experts * cap // WIN) * WIN
    nhw = 0 if cap >= n_tokens else A // WIN + A // (cap + 1)
    return S, nhw, hb, hb + nhw * WIN


def chunks(n, size):
    """[(start, length)] of n split into pieces of at most ``size``."""
    out = []
    r = 0
    while r < n:
        out.append((r, min(size, n - r)))
        r += size
    return out


# ---------------------------------------------------------------------------------------------
# host-side helpers (plain torch / numpy, never traced)
# ---------------------------------------------------------------------------------------------

def token_rows(x):
    """Token-major normed input ``x [N, H]`` -> the kernel's ``x [N*H/128, 128]`` (a reshape, same dtype)."""
    from nki_kernels.host import as_torch
    x = as_torch(x)
    N, H = x.shape
    if H % P:
        raise ValueError(f"token_rows: hidden size {H} is not a multiple of {P}")
    return x.reshape(N * H // P, P).contiguous()


def check_finite(finite, what="moe_prefill"):
    """Raise ``FloatingPointError`` when a launch's ``finite`` flags report a non-finite router logit."""
    from nki_kernels.host import as_torch
    f = as_torch(finite).float().reshape(-1)
    if not bool((f == 1.0).all()):
        raise FloatingPointError(f"{what}: non-finite router logits: NaN or Inf in the hidden states of the chunk "
                                 f"(flags per core {f.tolist()})")


# ---------------------------------------------------------------------------------------------
# traced helpers: pools
# ---------------------------------------------------------------------------------------------

def _psum_pool(n_banks=PSUM_POOL):
    """``n_banks`` one-bank fp32 tiles handed out round-robin (a bank is reused n_banks requests later)."""
    banks = []
    for b in range(n_banks):
        banks.append(nl.ndarray((P, BANK), dtype=F32, buffer=nl.psum, name="moe_pf_psum" + str(b)))
    return {"banks": banks, "next": 0}


def _ps(c, parts, cols, name):
    """A [parts, cols] fp32 PSUM tile: the pool's next bank, or (no pool: inside the runtime loop) a fresh one."""
    pool = c["psum"]
    if pool == None:
        return nl.ndarray((parts, cols), dtype=F32, buffer=nl.psum, name=name)
    b = pool["banks"][pool["next"] % len(pool["banks"])]
    pool["next"] = pool["next"] + 1
    return b[0:parts, 0:cols]


def _tile(c, key, shape, dtype, depth):
    """The next SBUF tile of the ring ``key`` (``depth`` buffers, made on first use), or a fresh tile when
    c["rings"] is None (inside the runtime loop)."""
    rings = c["rings"]
    if rings == None:
        return nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf, name=key)
    for d in shape:
        key = key + "_" + str(d)
    if key not in rings:
        bufs = []
        for i in range(depth):
            bufs.append(nl.ndarray(shape, dtype=dtype, buffer=nl.sbuf, name=key + str(i)))
        rings[key] = [bufs, 0]
    r = rings[key]
    t = r[0][r[1] % len(r[0])]
    r[1] = r[1] + 1
    return t


# ---------------------------------------------------------------------------------------------
# traced helpers: constants, x^T, router
# ---------------------------------------------------------------------------------------------

def _consts(g):
    adt, E = g["adt"], g["E"]
    c = {"psum": None, "rings": None}
    v = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf, name="moe_pf_iota_tri")
    nisa.iota(dst=v, pattern=[[1, P]], offset=0, channel_multiplier=-1)          # column - partition
    tri = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf, name="moe_pf_tri")       # tri[a, b] = 1 iff a < b
    nisa.tensor_scalar(dst=tri, data=v, op0=nl.greater, operand0=0.0)
    c["tri"] = tri
    tri_a = nl.ndarray((P, P), dtype=adt, buffer=nl.sbuf, name="moe_pf_tri_a")
    nisa.tensor_copy(dst=tri_a, src=tri)
    c["tri_a"] = tri_a
    ones = nl.ndarray((P, P), dtype=F32, buffer=nl.sbuf, name="moe_pf_ones")
    nisa.memset(dst=ones, value=1.0)
    c["ones"] = ones
    ones_a = nl.ndarray((P, P), dtype=adt, buffer=nl.sbuf, name="moe_pf_ones_a")
    nisa.memset(dst=ones_a, value=1.0)
    c["ones_a"] = ones_a
    rev = nl.ndarray((P, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_rev")      # E - e
    nisa.iota(dst=rev, pattern=[[-1, E]], offset=E)
    c["rev"] = rev
    j8 = nl.ndarray((P, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_j8")
    nisa.iota(dst=j8, pattern=[[1, MAX8]], offset=0)
    c["j8"] = j8
    c["ident"] = nl.shared_identity_matrix(P, dtype=F32)
    c["ident_a"] = own_identity(P, adt, "moe_pf_ident_a")    # the combine addresses it by a raw access pattern
    # (jb0 + p % jc) of the gather-transpose index tiles: flat index m*128 + p is (row, h-block p % jc)
    if g["adt"] == nl.bfloat16:
        jt = nl.ndarray((P, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_jcol")
        nisa.iota(dst=jt, pattern=[[0, 1]], offset=0, channel_multiplier=1)
        nisa.tensor_scalar(dst=jt, data=jt, op0=nl.bitwise_and, operand0=g["jc"] - 1)
        nisa.tensor_scalar(dst=jt, data=jt, op0=nl.add, operand0=g["jb0"])
        c["jcol"] = jt
    return c


def _load_x(g, x):
    """xr [128, N, jc]: x^T of this core's contraction rows, token-major within each partition; the loads are
    issued chunk by chunk by :func:`_x_upto` (the routing of the first tiles need not wait for all of x)."""
    xr = nl.ndarray((P, g["N"], g["jc"]), dtype=g["adt"], buffer=nl.sbuf, name="moe_pf_xr")
    return {"xr": xr, "x": x, "chunks": chunks(g["N"], XCH), "next": 0}


def _x_upto(g, xl, t_end):
    """Issue the x^T chunk loads of :func:`_load_x` up to the one holding token t_end - 1 and one more."""
    while xl["next"] < len(xl["chunks"]) and (xl["next"] == 0 or xl["chunks"][xl["next"] - 1][0] < t_end):
        t0, n = xl["chunks"][xl["next"]]
        _load_x_chunk(g, xl["x"], xl["xr"], t0, n)
        xl["next"] = xl["next"] + 1


def _load_x_chunk(g, x, xr, t0, n):
    """Tokens t0..t0+n-1 of xr (DMA transposes in bfloat16, row loads + PE transposes in float32)."""
    J, jc, p0, npart, jb0, adt = g["J"], g["jc"], g["p0"], g["np"], g["jb0"], g["adt"]
    if adt == nl.bfloat16:          # DMA transpose [jc, n, np] -> [np, n, jc] (SDK-TRN2: up to 90 % of DMA rate)
        nisa.dma_transpose(dst=xr[p0:p0 + npart, t0:t0 + n, :],
                           src=x.ap(pattern=[[P, jc], [J * P, n], [1, npart]], offset=(t0 * J + jb0) * P + p0))
    else:                           # float32: rows to SBUF, PE transposes
        for s0_m in chunks(n, P):
            s0, m = s0_m
            for jj in range(jc):
                rows = nl.ndarray((m, npart), dtype=adt, buffer=nl.sbuf, name="moe_pf_xrows")
                nisa.dma_copy(dst=rows, src=x.ap(pattern=[[J * P, m], [1, npart]],
                                                 offset=((t0 + s0) * J + jb0 + jj) * P + p0))
                ps = nl.ndarray((npart, m), dtype=F32, buffer=nl.psum, name="moe_pf_xT_ps")
                nisa.nc_transpose(dst=ps, data=rows, engine=nisa.engine.tensor)
                nisa.tensor_copy(dst=xr[p0:p0 + npart, t0 + s0:t0 + s0 + m, jj], src=ps)


def _load_router(g, router):
    """rr [128, jc, L*(E/L + 1)]: the columns of every router block (experts b*E/L.. and the gate) for this
    core's contraction rows."""
    L, jc, p0, npart, jb0, Eh = g["L"], g["jc"], g["p0"], g["np"], g["jb0"], g["Eh"]
    rr = nl.ndarray((P, jc, L * (Eh + 1)), dtype=g["adt"], buffer=nl.sbuf, name="moe_pf_router")
    for b in range(L):
        nisa.dma_copy(dst=rr[p0:p0 + npart, :, b * (Eh + 1):(b + 1) * (Eh + 1)],
                      src=router[b, p0:p0 + npart, jb0:jb0 + jc, :], dge_mode=nisa.dge_mode.hwdge)
    return rr


def _x_cols(g, xr, t0, n, jj):
    """x^T of tokens t0..t0+n-1, h-block jj of this core: [np, n] view of the resident xr."""
    N, jc = g["N"], g["jc"]
    return xr.ap(pattern=[[N * jc, g["np"]], [jc, n]], offset=g["p0"] * N * jc + t0 * jc + jj)


def _swap_add(g, c, ps, dst, tag):
    """dst (SBUF) = ps (PSUM, this core's partial) + the other core's partial, rounded to dst's dtype (at LNC=1
    just the rounding copy)."""
    if g["L"] == 1:
        nisa.tensor_copy(dst=dst, src=ps)
        return
    shape = tuple(ps.shape)
    mine = _tile(c, tag + "_mine", shape, F32, UP_AHEAD + 1)
    nisa.tensor_copy(dst=mine, src=ps)
    theirs = _tile(c, tag + "_theirs", shape, F32, UP_AHEAD + 1)
    nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - g["pid"], recv_from_rank=1 - g["pid"], pipe_id=0)
    nisa.tensor_tensor(dst=dst, data1=ps, data2=theirs, op=nl.add)


# ---------------------------------------------------------------------------------------------
# 1. routing
# ---------------------------------------------------------------------------------------------

def _partial_logits(g, xr, rr, t0, n):
    """[n, L*(E/L + 1)] fp32 PSUM: this core's partial router logits (its h-rows) of tokens t0..t0+n-1."""
    jc, p0, npart = g["jc"], g["p0"], g["np"]
    lg_ps = nl.ndarray((n, g["L"] * (g["Eh"] + 1)), dtype=F32, buffer=nl.psum, name="moe_pf_logits_ps")
    for jj in range(jc):
        nisa.nc_matmul(dst=lg_ps, stationary=_x_cols(g, xr, t0, n, jj), moving=rr[p0:p0 + npart, jj, :],
                       accumulate=jj > 0)
    return lg_ps


def _route_math(g, c, full, n, ti, st):
    """Routing of tile ti from its full logits ``full [n, L*(E/L + 1)]`` (activation dtype): writes the tile's
    rows of E8 (chosen experts ascending, uint32), W8 (renormalised weights, activation dtype) and GATE (the
    shared-expert gate, fp32), adds its logit check into ``st["fin"]`` (``st["nfin"]`` counts the terms) and
    returns sel [n, E] (0/1, activation dtype)."""
    L, Eh, E, k, adt, T = g["L"], g["Eh"], g["E"], g["k"], g["adt"], g["T"]
    Wc = L * (Eh + 1)
    # the E expert logits of full (expert b*Eh + i is column b*(Eh+1) + i), in the activation dtype
    lg = full.ap(pattern=[[Wc, n], [Eh + 1, L], [1, Eh]], offset=0)
    lsum = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_logit_sum")
    nisa.tensor_reduce(dst=lsum, op=nl.add, data=full, axis=1)

    # softmax (fp32)
    nmx = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_nmax")
    nisa.tensor_reduce(dst=nmx, op=nl.maximum, data=lg, axis=(1, 2), negate=True)
    ex = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_exp")
    ssum = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_ssum")
    nisa.activation(dst=ex, op=nl.exp, data=lg, bias=nmx, reduce_op=nl.add, reduce_res=ssum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rsum = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_rsum")
    nisa.reciprocal(dst=rsum, data=ssum)
    p = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_p")
    nisa.tensor_scalar(dst=p, data=ex, op0=nl.multiply, operand0=rsum)
    # finite check: softmax sum + 0 * (sum of all logits) is finite iff every logit is
    chk = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_check")
    nisa.scalar_tensor_tensor(dst=chk, data=lsum, op0=nl.multiply, operand0=0.0, op1=nl.add, operand1=ssum)
    nisa.nc_matmul(dst=st["fin"], stationary=c["ones"][0:n, 0:1], moving=chk, accumulate=st["nfin"] > 0)
    st["nfin"] = st["nfin"] + 1

    # shared-expert gate sigmoid(z) = 1 / (1 + exp(-z)) (stays on the exp table)
    ez = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_ez")
    nisa.activation(dst=ez, op=nl.exp, data=full[:, Eh:Eh + 1], scale=-1.0)
    nisa.tensor_scalar(dst=ez, data=ez, op0=nl.add, operand0=1.0)
    nisa.reciprocal(dst=st["GATE"][0:n, ti:ti + 1], data=ez)

    # exact top-k set, ties to the lower index (the decode kernel's method)
    v8 = nl.ndarray((n, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_v8")
    nisa.max8(dst=v8, src=p)
    vk = v8[:, k - 1:k]
    gt = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_gt")
    nisa.tensor_scalar(dst=gt, data=p, op0=nl.greater, operand0=vk)
    c8 = nl.ndarray((n, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_c8")
    nisa.tensor_scalar(dst=c8, data=v8, op0=nl.greater, operand0=vk)
    ngt = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_ngt")
    nisa.tensor_reduce(dst=ngt, op=nl.add, data=c8, axis=1)
    last = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_last")      # need - 1
    nisa.tensor_scalar(dst=last, data=ngt, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(k - 1))
    key = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_tiekey")       # (p == vk) * (E - e)
    nisa.scalar_tensor_tensor(dst=key, data=p, op0=nl.equal, operand0=vk, op1=nl.multiply, operand1=c["rev"][0:n])
    kt8 = nl.ndarray((n, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_kt8")
    nisa.max8(dst=kt8, src=key)
    pick = nl.ndarray((n, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_pick")
    nisa.scalar_tensor_tensor(dst=pick, data=c["j8"][0:n], op0=nl.equal, operand0=last, op1=nl.multiply,
                              operand1=kt8)
    thr = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_thr")
    nisa.tensor_reduce(dst=thr, op=nl.add, data=pick, axis=1)
    sel = nl.ndarray((n, E), dtype=adt, buffer=nl.sbuf, name="moe_pf_sel")
    nisa.scalar_tensor_tensor(dst=sel, data=key, op0=nl.greater_equal, operand0=thr, op1=nl.add, operand1=gt)
    vsum = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_vsum")
    nisa.tensor_reduce(dst=vsum, op=nl.add, data=v8[:, 0:k], axis=1)
    rv = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_rv")
    nisa.reciprocal(dst=rv, data=vsum)
    w = nl.ndarray((n, E), dtype=adt, buffer=nl.sbuf, name="moe_pf_w")
    nisa.scalar_tensor_tensor(dst=w, data=sel, op0=nl.multiply, operand0=rv, op1=nl.multiply, operand1=p)

    # the k chosen experts ascending: max8 of sel * (E - e) lists E - e for them, largest first
    sk = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_selkey")
    nisa.tensor_tensor(dst=sk, data1=sel, data2=c["rev"][0:n], op=nl.multiply)
    s8 = nl.ndarray((n, MAX8), dtype=F32, buffer=nl.sbuf, name="moe_pf_s8")
    nisa.max8(dst=s8, src=sk)
    e8 = st["E8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
    nisa.tensor_scalar(dst=e8, data=s8[:, 0:k], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(E))

    nisa.nc_n_gather(dst=st["W8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k), data=w, indices=e8)
    _keep(st, w)
    return sel


def _place(g, c, st, ti, sel, prior):
    """Pass 1 of the index table for tile ti, routed by this core, stage 1 (its stage 2 is :func:`_scatter`):
    each choice's position among THIS core's tokens of its expert -> RK8 (``prior``: (stationary, moving) matmul
    terms summing the counts of this core's earlier tiles on the n rows, plus the strict-lower-triangular ones
    matmul of this tile). Core 0's tokens fill the expert's table rows e*cap.. from the front, core 1's from the
    back (row e*cap + cap - 1 - position), so the two never meet while the expert is regular (count <= cap) and
    no core needs the other's counts."""
    T, k, E = g["T"], g["k"], g["E"]
    n = g["tiles"][ti][1]
    rk_ps = nl.ndarray((n, E), dtype=F32, buffer=nl.psum, name="moe_pf_rank_ps")
    nisa.nc_matmul(dst=rk_ps, stationary=c["tri_a"][0:n, 0:n], moving=sel, accumulate=False)
    for stat_mov in prior:
        stat, mov = stat_mov
        nisa.nc_matmul(dst=rk_ps, stationary=stat, moving=mov, accumulate=True)
    rk = nl.ndarray((n, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_rank")
    nisa.tensor_copy(dst=rk, src=rk_ps)
    nisa.nc_n_gather(dst=st["RK8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k), data=rk,
                     indices=st["E8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k))
    _keep(st, rk)


def _scatter(g, st, ti, tabs, flip):
    """Stage 2 of :func:`_place`: each choice j scatters the token's x row index t*J into row e*cap + RK8 of this
    core's choice table ``tabs[j]`` (``flip``: core 1's orientation, RK8 <- cap - 1 - RK8); a position >= cap
    (the expert is heavy) targets a row past the table's end (skipped; :func:`_heavy_places` places those)."""
    T, k, cap, J = g["T"], g["k"], g["cap"], g["J"]
    t0, n = g["tiles"][ti]
    e8 = st["E8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
    r8 = st["RK8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
    over = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_rank_over")
    nisa.tensor_scalar(dst=over, data=r8, op0=nl.greater_equal, operand0=float(cap), op1=nl.multiply,
                       operand1=float(g["BIG"]))
    if flip:
        nisa.tensor_scalar(dst=r8, data=r8, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(cap - 1))
    d = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_place_f")
    nisa.scalar_tensor_tensor(dst=d, data=e8, op0=nl.multiply, operand0=float(cap), op1=nl.add, operand1=r8)
    di = nl.ndarray((n, k), dtype=I32, buffer=nl.sbuf, name="moe_pf_place")
    nisa.tensor_tensor(dst=di, data1=d, data2=over, op=nl.add)
    pay = _scatter_choices(tabs, di, J, t0, "moe_pf_payload")
    _keep(st, over)
    _keep(st, d)
    _keep(st, di)
    _keep(st, pay)
    for i in range(2):              # weight-ring clears, two per placed tile
        if len(st["clears"]) > 0:
            _clear(st, st["clears"].pop(0))


def _clear(st, t):
    """Zero the weight-ring tile t by a DMA from the zeroed tile st["zero"] (the DMA queues are idle while the
    routing runs; POOL issues the placements' scatters)."""
    nisa.dma_copy(dst=t, src=st["zero"][0:t.shape[0], 0:t.size // t.shape[0]])


KEEP = 24           # routing temporaries held alive (their SBUF not reused while POOL / DMA may still read them)


def _keep(st, t):
    """Hold tile t for the next KEEP calls: a freed tile's address would be reused by the next tile of the same
    shape, whose writer then waits for the old tile's last reader (here POOL gathers and scatters queued behind
    the index scatters)."""
    st["keep"].append(t)
    if len(st["keep"]) > KEEP:
        st["keep"].pop(0)


def _placements(g, c, st, placed, tabs, final):
    """The placements due after this core routed another tile (appended to ``placed`` [(tile, sel)]): stage 1
    of the previous tile and stage 2 of the one before it (its RK8 gather was issued a tile earlier, so VectorE
    does not wait on POOL); ``final``: also the rest (after the last tile)."""
    q = len(placed) - 1
    flip = g["pid"] == 1
    if final:
        q = q + 1
        if q >= 1:
            ti, sel = placed[q - 1]
            _place(g, c, st, ti, sel, _own_prior(c, placed[0:q - 1], g["tiles"][ti][1]))
        if q >= 2:
            _scatter(g, st, placed[q - 2][0], tabs, flip)
        if q >= 1:
            _scatter(g, st, placed[q - 1][0], tabs, flip)
        return
    if q >= 1:
        ti, sel = placed[q - 1]
        _place(g, c, st, ti, sel, _own_prior(c, placed[0:q - 1], g["tiles"][ti][1]))
    if q >= 2:
        _scatter(g, st, placed[q - 2][0], tabs, flip)


def _own_prior(c, own, n):
    """Matmul terms of :func:`_place` summing the counts of the tiles in ``own`` [(tile, sel)] on n rows."""
    terms = []
    for ti_sl in own:
        ti, sl = ti_sl
        terms.append((c["ones_a"][0:sl.shape[0], 0:n], sl))
    return terms


def _tile_counts(g, c, sel, n):
    """[1, E] fp32 PSUM: how many of the tile's tokens chose each expert."""
    cs_ps = nl.ndarray((1, g["E"]), dtype=F32, buffer=nl.psum, name="moe_pf_count_ps")
    nisa.nc_matmul(dst=cs_ps, stationary=c["ones_a"][0:n, 0:1], moving=sel, accumulate=False)
    return cs_ps


def _route(g, c, xl, rr, st, tabs):
    """Routing of every token tile -> st (E8, RK8, W8, GATE, fin), pass 1 of the index table (:func:`_place`,
    into this core's choice tables ``tabs``) and the per-expert counts ``run [1, E]``. Returns (run, sels, cnt0):
    sels [(tile, sel)] of the tiles this core placed, cnt0 [(stationary, moving)] matmul terms of the counts of
    core 0's tiles (for the heavy pass; None at LNC=1).

    LNC=1: tile by tile. LNC=2: the tiles are paired (2i, 2i+1) and core c routes and places tile 2i + c of every
    pair (the DVE-bound part halves): both cores compute their partial logits of both tiles, and ONE symmetric
    sendrecv per pair hands each core the other's partial of the tile it routes. An unpaired last tile is routed
    by both cores (the symmetric partial swap) and placed by core 0 after the loop. The per-pair counts are
    swapped at the end (the totals), and a second sendrecv swaps the compact results (experts, positions,
    weights, gate). A tile's placement is issued after the next tile's routing math (its scatters then queue on
    POOL while VectorE routes)."""
    L, T, E, k, adt = g["L"], g["T"], g["E"], g["k"], g["adt"]
    tiles = g["tiles"]
    xr = xl["xr"]
    Wc = L * (g["Eh"] + 1)
    pid = g["pid"]
    run = nl.ndarray((1, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_counts")
    placed = []                                 # (tile, sel) of the tiles this core placed, in order
    if L == 1:
        nisa.memset(dst=run, value=0.0)
        for ti in range(T):
            t0, n = tiles[ti]
            _x_upto(g, xl, t0 + n)
            ps = _partial_logits(g, xr, rr, t0, n)
            full = nl.ndarray((n, Wc), dtype=adt, buffer=nl.sbuf, name="moe_pf_logits_all")
            nisa.tensor_copy(dst=full, src=ps)
            sel = _route_math(g, c, full, n, ti, st)
            if ti == min(1, T - 1):
                _zero_tables(g, tabs)
            nisa.tensor_tensor(dst=run, data1=run, data2=_tile_counts(g, c, sel, n), op=nl.add)
            placed.append((ti, sel))
            _placements(g, c, st, placed, tabs, False)
        _placements(g, c, st, placed, tabs, True)
        return run, placed, None
    Tp = T // 2
    if Tp > 0:
        # pick[t, i, i'] = (i' == i): column i of pick[:, i, :] gathers a tile's counts into row i (PSUM rows)
        pv = nl.ndarray((P, Tp, Tp), dtype=F32, buffer=nl.sbuf, name="moe_pf_pair_pick_iota")
        nisa.iota(dst=pv, pattern=[[-1, Tp], [1, Tp]], offset=0)
        pick = nl.ndarray((P, Tp, Tp), dtype=adt, buffer=nl.sbuf, name="moe_pf_pair_pick")
        nisa.tensor_scalar(dst=pick, data=pv, op0=nl.equal, operand0=0.0)
        cnt_ps = nl.ndarray((Tp, E), dtype=F32, buffer=nl.psum, name="moe_pf_pair_counts_ps")
    for i in range(Tp):
        mine = None
        for half in range(2):
            ti = 2 * i + half
            t0, n = tiles[ti]
            _x_upto(g, xl, t0 + n)
            ps = _partial_logits(g, xr, rr, t0, n)
            if half == pid:
                mine = ps
            else:
                send = nl.ndarray((P, Wc), dtype=F32, buffer=nl.sbuf, name="moe_pf_logits_send")
                if n < P:
                    nisa.memset(dst=send, value=0.0)
                nisa.tensor_copy(dst=send[0:n, :], src=ps)
        ti = 2 * i + pid
        n = tiles[ti][1]
        recv = nl.ndarray((P, Wc), dtype=F32, buffer=nl.sbuf, name="moe_pf_logits_recv")
        nisa.sendrecv(src=send, dst=recv, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        full = nl.ndarray((n, Wc), dtype=adt, buffer=nl.sbuf, name="moe_pf_logits_all")
        nisa.tensor_tensor(dst=full, data1=mine, data2=recv[0:n, :], op=nl.add)
        sel = _route_math(g, c, full, n, ti, st)
        nisa.nc_matmul(dst=cnt_ps, stationary=pick[0:n, i, :], moving=sel, accumulate=i > 0)
        if i == min(1, Tp - 1):
            _zero_tables(g, tabs)
        placed.append((ti, sel))
        _placements(g, c, st, placed, tabs, False)
    if Tp > 0:
        _placements(g, c, st, placed, tabs, True)
    last = None
    if Tp == 0:
        _zero_tables(g, tabs)
    if T % 2:
        ti = T - 1
        t0, n = tiles[ti]
        full = nl.ndarray((n, Wc), dtype=adt, buffer=nl.sbuf, name="moe_pf_logits_all")
        _x_upto(g, xl, t0 + n)
        _swap_add(g, c, _partial_logits(g, xr, rr, t0, n), full, "moe_pf_logits")
        last = (ti, _route_math(g, c, full, n, ti, st))
    # counts of every tile: mine (tile 2i + pid) and the other core's (tile 2i + 1 - pid) of every pair
    cnt0 = []
    if Tp > 0:
        cnt_own = nl.ndarray((Tp, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_pair_counts")
        nisa.tensor_copy(dst=cnt_own, src=cnt_ps)
        cnt_peer = nl.ndarray((Tp, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_pair_counts_peer")
        nisa.sendrecv(src=cnt_own, dst=cnt_peer, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        pair = nl.ndarray((Tp, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_pair_sums")
        nisa.tensor_tensor(dst=pair, data1=cnt_own, data2=cnt_peer, op=nl.add)
        tot_ps = nl.ndarray((1, E), dtype=F32, buffer=nl.psum, name="moe_pf_total_ps")
        nisa.nc_matmul(dst=tot_ps, stationary=c["ones"][0:Tp, 0:1], moving=pair, accumulate=False)
        nisa.tensor_copy(dst=run, src=tot_ps)
        cnt0.append((c["ones"][0:Tp, :], cnt_own if pid == 0 else cnt_peer))    # core 0's pair tiles
    else:
        nisa.memset(dst=run, value=0.0)
    if last != None:
        ti, sel = last
        n = tiles[ti][1]
        nisa.tensor_tensor(dst=run, data1=run, data2=_tile_counts(g, c, sel, n), op=nl.add)
        prior = []
        for stat_mov in cnt0:
            stat, mov = stat_mov
            prior.append((stat[:, 0:n], mov))
        _place(g, c, st, ti, sel, prior)   # both cores: the compact swap does not carry it
        if pid == 0:                        # core 0 scatters it
            _scatter(g, st, ti, tabs, False)
            placed.append(last)
        cnt0.append((c["ones_a"][0:n, :], sel))
    _swap_compact(g, st, Tp)
    return run, placed, cnt0


def _swap_compact(g, st, Tp):
    """Swap the compact results of the pairs' tiles between the cores: experts, positions, weights (exact in
    fp32), gate -- ONE packed sendrecv for the leading pairs of full tiles, then one per remaining pair (a
    partial last tile)."""
    T, k, pid, tiles = g["T"], g["k"], g["pid"], g["tiles"]
    F = 0
    while F < Tp and tiles[2 * F][1] == P and tiles[2 * F + 1][1] == P:
        F = F + 1
    if F > 0:
        W = 3 * k + 1
        pk = nl.ndarray((P, F, W), dtype=F32, buffer=nl.sbuf, name="moe_pf_route_packs")
        got = nl.ndarray((P, F, W), dtype=F32, buffer=nl.sbuf, name="moe_pf_route_packs_peer")
        for side in range(2):           # 0: pack this core's tiles 2i + pid; 1: unpack the other's 2i + 1 - pid
            tsel = pid if side == 0 else 1 - pid
            buf = pk if side == 0 else got
            for q_key in ((0, "E8"), (1, "RK8"), (2, "W8")):
                q, key = q_key
                mine = st[key].ap(pattern=[[T * k, P], [2 * k, F], [1, k]], offset=tsel * k)
                pack = buf.ap(pattern=[[F * W, P], [W, F], [1, k]], offset=q * k)
                if side == 0:
                    nisa.tensor_copy(dst=pack, src=mine)
                else:
                    nisa.tensor_copy(dst=mine, src=pack)
            gate = st["GATE"].ap(pattern=[[T, P], [2, F], [1, 1]], offset=tsel)
            pack = buf.ap(pattern=[[F * W, P], [W, F], [1, 1]], offset=3 * k)
            if side == 0:
                nisa.tensor_copy(dst=pack, src=gate)
                nisa.sendrecv(src=pk, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
            else:
                nisa.tensor_copy(dst=gate, src=pack)
    for i in range(F, Tp):
        pk = nl.ndarray((P, 3 * k + 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_route_pack")
        ti = 2 * i + pid
        n = tiles[ti][1]
        if n < P:
            nisa.memset(dst=pk, value=0.0)
        for q_key in ((0, "E8"), (1, "RK8"), (2, "W8")):
            q, key = q_key
            nisa.tensor_copy(dst=pk[0:n, q * k:(q + 1) * k], src=st[key].ap(pattern=[[T * k, n], [1, k]],
                                                                            offset=ti * k))
        nisa.tensor_copy(dst=pk[0:n, 3 * k:3 * k + 1], src=st["GATE"][0:n, ti:ti + 1])
        got = nl.ndarray((P, 3 * k + 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_route_pack_peer")
        nisa.sendrecv(src=pk, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        tp = 2 * i + 1 - pid
        n = tiles[tp][1]
        for q_key in ((0, "E8"), (1, "RK8"), (2, "W8")):
            q, key = q_key
            nisa.tensor_copy(dst=st[key].ap(pattern=[[T * k, n], [1, k]], offset=tp * k),
                             src=got[0:n, q * k:(q + 1) * k])
        nisa.tensor_copy(dst=st["GATE"][0:n, tp:tp + 1], src=got[0:n, 3 * k:3 * k + 1])


# ---------------------------------------------------------------------------------------------
# 2. grouping and the index table
# ---------------------------------------------------------------------------------------------

def _id_tables(g):
    """(ids_h HBM [S, 1] int32, every row out of bounds (unused slot); rows_h HBM [S, 1] int32, every row ROWS (an
    unused slot gathers the zeroed spare rows after the heavy windows: token 0, its outputs are never read; a
    heavy expert's own rows may hold two tokens' sum); hid HBM [NHW, 1] or None int32,
    every row out of bounds (continuation window)): made before the routing (they do not depend on it), filled in
    by :func:`_group`."""
    S, NHW, oob = g["S"], g["NHW"], g["oob"]
    m = max(1, -(-max(S, NHW) // P))
    fill = nl.ndarray((P, m), dtype=I32, buffer=nl.sbuf, name="moe_pf_oob_fill")
    nisa.memset(dst=fill, value=oob)
    ids_h = nl.ndarray((S, 1), dtype=I32, buffer=nl.private_hbm, name="moe_pf_slot_ids_hbm")
    _fill_rows(ids_h, fill, S)
    spare = nl.ndarray((P, m), dtype=I32, buffer=nl.sbuf, name="moe_pf_spare_fill")
    nisa.memset(dst=spare, value=g["ROWS"])
    rows_h = nl.ndarray((S, 1), dtype=I32, buffer=nl.private_hbm, name="moe_pf_slot_rows_hbm")
    _fill_rows(rows_h, spare, S)
    hid = None
    if NHW > 0:
        hid = nl.ndarray((NHW, 1), dtype=I32, buffer=nl.private_hbm, name="moe_pf_heavy_ids_hbm")
        _fill_rows(hid, fill, NHW)
    return ids_h, rows_h, hid


def _group(g, c, run, ids_h, rows_h, hid):
    """Per-expert counts -> regular slots, heavy windows and every expert's base row in the scratch, scattered
    into the id tables of :func:`_id_tables`. Returns (BB [128, E] fp32: scratch base row of expert e on every
    partition, ids [1, S] int32: slot expert ids (out of bounds = unused), rows [1, S] int32: the slot's first
    index-table row e*cap (ROWS = unused), nhw [1, 1] int32: heavy windows used, hid HBM [NHW, 1] int32: expert id
    of a heavy expert's first window, out of bounds for the others (None without heavy windows), V: per chunk of
    128 experts [ec, 3] fp32 flags (regular | windows | heavy))."""
    E, cap, S, NHW, HB, N = g["E"], g["cap"], g["S"], g["NHW"], g["HB"], g["N"]
    echunks = chunks(E, P)
    nth = -(-N // WIN)
    thr = nl.ndarray((P, nth), dtype=F32, buffer=nl.sbuf, name="moe_pf_win_thr")
    nisa.iota(dst=thr, pattern=[[WIN, nth]], offset=0)                  # 0, 128, 256, ...
    V = []
    for e0_ec in echunks:
        e0, ec = e0_ec
        cc_ps = nl.ndarray((ec, 1), dtype=F32, buffer=nl.psum, name="moe_pf_cnt_ps")
        nisa.nc_matmul(dst=cc_ps, stationary=run[0:1, e0:e0 + ec], moving=c["ones"][0:1, 0:1], accumulate=False)
        cnt = nl.ndarray((ec, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_cnt")
        nisa.tensor_copy(dst=cnt, src=cc_ps)
        v = nl.ndarray((ec, 3), dtype=F32, buffer=nl.sbuf, name="moe_pf_expert_flags")   # regular | windows | heavy
        nisa.tensor_scalar(dst=v[:, 2:3], data=cnt, op0=nl.greater, operand0=float(cap))
        nisa.scalar_tensor_tensor(dst=v[:, 0:1], data=cnt, op0=nl.greater, operand0=0.0, op1=nl.subtract,
                                  operand1=v[:, 2:3])
        above = nl.ndarray((ec, nth), dtype=F32, buffer=nl.sbuf, name="moe_pf_above")
        nisa.tensor_scalar(dst=above, data=thr[0:ec], op0=nl.less, operand0=cnt)          # 128 m < count
        nw = nl.ndarray((ec, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_nwin")
        nisa.tensor_reduce(dst=nw, op=nl.add, data=above, axis=1)                          # ceil(count / 128)
        nisa.tensor_tensor(dst=v[:, 1:2], data1=nw, data2=v[:, 2:3], op=nl.multiply)
        V.append(v)
    tot_ps = nl.ndarray((1, 3), dtype=F32, buffer=nl.psum, name="moe_pf_tot_ps")
    for i in range(len(echunks)):
        nisa.nc_matmul(dst=tot_ps, stationary=c["ones"][0:echunks[i][1], 0:1], moving=V[i], accumulate=i > 0)
    nhw = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_nhw")
    nisa.tensor_copy(dst=nhw, src=tot_ps[:, 1:2])

    bb_ps = nl.ndarray((P, E), dtype=F32, buffer=nl.psum, name="moe_pf_base_ps")
    held = []
    for i in range(len(echunks)):
        e0, ec = echunks[i]
        v = V[i]
        pre_ps = nl.ndarray((ec, 3), dtype=F32, buffer=nl.psum, name="moe_pf_prefix_ps")   # exclusive prefix
        nisa.nc_matmul(dst=pre_ps, stationary=c["tri"][0:ec, 0:ec], moving=v, accumulate=False)
        for i2 in range(i):
            nisa.nc_matmul(dst=pre_ps, stationary=c["ones"][0:echunks[i2][1], 0:ec], moving=V[i2], accumulate=True)
        pre = nl.ndarray((ec, 3), dtype=F32, buffer=nl.sbuf, name="moe_pf_prefix")
        nisa.tensor_copy(dst=pre, src=pre_ps)
        # base row: regular -> slot * cap; heavy -> HB + 128 * first window
        hb = nl.ndarray((ec, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_base")
        nisa.tensor_scalar(dst=hb, data=pre[:, 1:2], op0=nl.multiply, operand0=float(WIN), op1=nl.add,
                           operand1=float(HB))
        nisa.tensor_tensor(dst=hb, data1=hb, data2=v[:, 2:3], op=nl.multiply)
        base = nl.ndarray((ec, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_base")
        nisa.scalar_tensor_tensor(dst=base, data=pre[:, 0:1], op0=nl.multiply, operand0=float(cap), op1=nl.multiply,
                                  operand1=v[:, 0:1])
        nisa.tensor_tensor(dst=base, data1=base, data2=hb, op=nl.add)
        nisa.nc_matmul(dst=bb_ps[:, e0:e0 + ec], stationary=base.ap(pattern=[[1, ec], [0, P]], offset=0),
                       moving=c["ident"][0:ec, 0:ec], accumulate=False)
        eid = nl.ndarray((ec, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_eid")
        nisa.iota(dst=eid, pattern=[[0, 1]], offset=e0, channel_multiplier=1)
        ri = _scatter_index(ids_h, pre[:, 0:1], v[:, 0:1], S, eid, "moe_pf_slot_row")
        erow = nl.ndarray((ec, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_erow")
        nisa.iota(dst=erow, pattern=[[0, 1]], offset=e0 * cap, channel_multiplier=cap)
        _scatter_rows(rows_h, ri, erow)
        held.append((pre, eid, erow, ri))           # not reused while their scatters may still read them
        if NHW > 0:
            held.append(_scatter_index(hid, pre[:, 1:2], v[:, 2:3], NHW, eid, "moe_pf_heavy_row"))
    BB = nl.ndarray((P, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_bases")
    nisa.tensor_copy(dst=BB, src=bb_ps)
    ids = nl.ndarray((1, S), dtype=I32, buffer=nl.sbuf, name="moe_pf_slot_ids")
    nisa.dma_copy(dst=ids, src=ids_h.ap(pattern=[[S, 1], [1, S]], offset=0))
    rows = nl.ndarray((1, S), dtype=I32, buffer=nl.sbuf, name="moe_pf_slot_rows")
    nisa.dma_copy(dst=rows, src=rows_h.ap(pattern=[[S, 1], [1, S]], offset=0))
    return BB, ids, rows, nhw, hid, V


def _fill_rows(t, fill, rows):
    """t [rows, 1] HBM int32 <- the value held by ``fill`` [128, m] (e.g. a zeroed tile; DMAs of up to 128 x m
    rows)."""
    m = fill.shape[1]
    for r0_nr in chunks(rows, P * m):
        r0, nr = r0_nr
        full = nr // m
        if full > 0:
            nisa.dma_copy(dst=t.ap(pattern=[[m, full], [1, m]], offset=r0), src=fill[0:full, :])
        rest = nr - full * m
        if rest > 0:
            nisa.dma_copy(dst=t.ap(pattern=[[rest, 1], [1, rest]], offset=r0 + full * m), src=fill[0:1, 0:rest])


def _scatter_choices(tabs, di, J, t0, name):
    """Choice j of the n tokens t0.. (partitions): ``tabs[j][di[t, j]] = J * (t0 + t)`` (the token's payload), one
    scatter per choice; a row index past the table's end is skipped (``oob_mode.skip``). di: SBUF [n, k] int32.
    Returns the payload tile (the scatters read it; a caller may keep it alive, see :func:`_keep`)."""
    n, k = di.shape
    pay = nl.ndarray((n, 1), dtype=I32, buffer=nl.sbuf, name=name)
    nisa.iota(dst=pay, pattern=[[0, 1]], offset=J * t0, channel_multiplier=J)
    for j in range(k):
        nisa.dma_copy(dst=tabs[j].ap(pattern=[[1, n], [1, 1]], offset=0,
                                     vector_offset=di.ap(pattern=[[k, n], [1, 1]], offset=j), indirect_dim=0),
                      src=pay, oob_mode=nisa.oob_mode.skip)
    return pay


def _scatter_index(table, row_f, flag, rows, payload, name):
    """table[row] = payload on the partitions whose flag is 1; the others target row ``rows`` (out of bounds,
    skipped). Returns the row-index tile (:func:`_scatter_rows` reuses it for another table of ``rows`` rows)."""
    n = row_f.shape[0]
    r = nl.ndarray((n, 1), dtype=F32, buffer=nl.sbuf, name=name + "_f")
    nisa.tensor_scalar(dst=r, data=row_f, op0=nl.subtract, operand0=float(rows))
    nisa.tensor_tensor(dst=r, data1=r, data2=flag, op=nl.multiply)
    nisa.tensor_scalar(dst=r, data=r, op0=nl.add, operand0=float(rows))      # flag ? row : rows
    ri = nl.ndarray((n, 1), dtype=I32, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=ri, src=r)
    _scatter_rows(table, ri, payload)
    return ri


def _scatter_rows(table, ri, payload):
    """table[ri[p]] = payload[p] (an out-of-bounds row is skipped)."""
    nisa.dma_copy(dst=table.ap(pattern=[[1, ri.shape[0]], [1, 1]], offset=0, vector_offset=ri, indirect_dim=0),
                  src=payload, oob_mode=nisa.oob_mode.skip)


def _choice_tables(g):
    """The L*k choice tables [TR, 1] int32 HBM of :func:`_place` (table c*k + j: core c's choice j), this core's
    zeroed (unwritten rows read as token 0) by :func:`_zero_tables`: made before the routing, whose placements
    scatter into them. One table
    per core and choice keeps the scatters independent (a scatter's written region is its whole table, so
    scatters into one table are ordered) and the cores' writes disjoint. Returns (all tables, this core's k)."""
    TR, k, pid = g["TR"], g["k"], g["pid"]
    tabs = []
    for j in range(g["L"] * k):
        tabs.append(nl.ndarray((TR, 1), dtype=I32, buffer=nl.shared_hbm, name="moe_pf_choice_table" + str(j)))
    return tabs, tabs[pid * k:(pid + 1) * k]


def _zero_tables(g, mine):
    """Zero this core's choice tables (issued by :func:`_route` after its first tile: the first x^T chunks do not
    share the DMA engines with them)."""
    z = nl.ndarray((P, 256), dtype=I32, buffer=nl.sbuf, name="moe_pf_zero_rows")    # one source: the DMAs overlap
    nisa.memset(dst=z, value=0)
    for t in mine:
        _fill_rows(t, z, g["TR"])


def _dest_rows(g, BB, st, DH):
    """st["DEST"] [P, T, k] int32: every (token, choice)'s scratch row base(e) + RK8 (+ DH, the heavy pass's
    correction; 0 for a regular expert), what the combine gathers."""
    T, k = g["T"], g["k"]
    for ti in range(T):
        n = g["tiles"][ti][1]
        e8 = st["E8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
        d8 = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_dest_base")
        nisa.nc_n_gather(dst=d8, data=BB[0:n, :], indices=e8)
        nisa.tensor_tensor(dst=d8, data1=d8, data2=DH.ap(pattern=[[T * k, n], [1, k]], offset=ti * k), op=nl.add)
        nisa.tensor_tensor(dst=st["DEST"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k), data1=d8,
                           data2=st["RK8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k), op=nl.add)


def _owner(g, ti):
    """The core that placed tile ti (:func:`_route`): 2i + c is core c's, an unpaired last tile core 0's."""
    if g["L"] == 1 or ti == g["T"] - 1 and g["T"] % 2:
        return 0
    return ti % 2


def _heavy_places(g, c, st, BB, V, nhw, tabs, tab, mine, cnt0):
    """The heavy experts' index-table rows, in a runtime loop of min(nhw, 1) trips (0 for realistic routing; the
    same on both cores): a heavy expert's choices get the rows base(e) + rank of its heavy windows, rank = the
    position among core 0's tokens, or core 0's count + the position among core 1's (RK8 holds cap - 1 - it),
    scattered into this core's tables ``mine`` for the tiles it placed, then those rows of ``tab`` merged again
    (:func:`_merge_tables`). Returns DH [P, T, k] fp32: the heavy rank -
    RK8 on a heavy expert's choices, 0 elsewhere (DEST = base + RK8 + DH, :func:`_dest_rows`)."""
    T, k, E, cap, J, L, pid = g["T"], g["k"], g["E"], g["cap"], g["J"], g["L"], g["pid"]
    DH = nl.ndarray((P, T, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_dest")
    nisa.memset(dst=DH, value=0.0)
    one = nl.ndarray((1, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_any_heavy")
    nisa.tensor_scalar(dst=one, data=nhw, op0=nl.minimum, operand0=1)
    reg = nisa.register_alloc()
    nisa.register_load(reg, one)
    echunks = chunks(E, P)

    def body(it):
        if L == 2:      # the other core's merge has read the tables and tab before this core writes them again
            for t in tabs:
                nisa.core_barrier(data=t, cores=(0, 1))
            nisa.core_barrier(data=tab, cores=(0, 1))
        hf_ps = nl.ndarray((P, E), dtype=F32, buffer=nl.psum, name="moe_pf_heavy_flags_ps")
        for i in range(len(echunks)):
            e0, ec = echunks[i]
            nisa.nc_matmul(dst=hf_ps[:, e0:e0 + ec], stationary=V[i].ap(pattern=[[3, ec], [0, P]], offset=2),
                           moving=c["ident"][0:ec, 0:ec], accumulate=False)
        HF = nl.ndarray((P, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_flags")
        nisa.tensor_copy(dst=HF, src=hf_ps)
        C0 = None
        if L == 2:
            c0_ps = nl.ndarray((P, E), dtype=F32, buffer=nl.psum, name="moe_pf_core0_counts_ps")
            for q in range(len(cnt0)):
                nisa.nc_matmul(dst=c0_ps, stationary=cnt0[q][0], moving=cnt0[q][1], accumulate=q > 0)
            C0 = nl.ndarray((P, E), dtype=F32, buffer=nl.sbuf, name="moe_pf_core0_counts")
            if len(cnt0) > 0:
                nisa.tensor_copy(dst=C0, src=c0_ps)
            else:
                nisa.memset(dst=C0, value=0.0)
        for ti in range(T):
            t0, n = g["tiles"][ti]
            own = _owner(g, ti)
            if own != pid and own == 0:
                continue            # nothing to do: core 0's tiles keep DH = 0 and are scattered by core 0
            e8 = st["E8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
            r8 = st["RK8"].ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
            hf8 = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_hf8")
            nisa.nc_n_gather(dst=hf8, data=HF[0:n, :], indices=e8)
            hr = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_rank")
            if own == 1:        # core 0's count + (cap - 1 - RK8)
                nisa.nc_n_gather(dst=hr, data=C0[0:n, :], indices=e8)
                nisa.scalar_tensor_tensor(dst=hr, data=r8, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=hr)
                nisa.tensor_scalar(dst=hr, data=hr, op0=nl.add, operand0=float(cap - 1))
                dh = DH.ap(pattern=[[T * k, n], [1, k]], offset=ti * k)
                nisa.scalar_tensor_tensor(dst=dh, data=r8, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=hr)
                nisa.tensor_tensor(dst=dh, data1=dh, data2=hf8, op=nl.multiply)
            else:
                nisa.tensor_copy(dst=hr, src=r8)
            if own != pid:
                continue
            b8 = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_base8")
            nisa.nc_n_gather(dst=b8, data=BB[0:n, :], indices=e8)
            nisa.tensor_tensor(dst=b8, data1=b8, data2=hr, op=nl.add)
            skip = nl.ndarray((n, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_heavy_skip")   # regular: past the end
            nisa.tensor_scalar(dst=skip, data=hf8, op0=nl.multiply, operand0=-float(g["BIG"]), op1=nl.add,
                               operand1=float(g["BIG"]))
            di = nl.ndarray((n, k), dtype=I32, buffer=nl.sbuf, name="moe_pf_heavy_place")
            nisa.tensor_tensor(dst=di, data1=b8, data2=skip, op=nl.add)
            pay = _scatter_choices(mine, di, J, t0, "moe_pf_heavy_payload")   # alive until the merge
        _merge_tables(g, tabs, tab, g["HB"], g["ROWS"])

    nl.fori_loop(0, reg, body)
    return DH


def _merge_tables(g, tabs, tab, lo, hi):
    """Rows lo..hi-1 of the index table ``tab`` [TR, 1] (this core's half of the table) = the sum of the L*k choice
    tables (each row of a regular expert or a heavy window is written in at most one of them; a heavy expert's
    rows e*cap.., never read, may sum two tokens), after a ``core_barrier`` on each table (the other core wrote
    half of them; a barrier orders only its own tensor). Contiguous runs in and out (the gather index tiles repeat
    each word in their own access pattern)."""
    L, pid, TR = g["L"], g["pid"], g["TR"]
    if L == 2:
        for t in tabs:
            nisa.core_barrier(data=t, cores=(0, 1))
    half = -(-TR // L)
    _sum_rows(tabs, tab, max(lo, pid * half), min(hi, (pid + 1) * half))


def _sum_rows(srcs, dst, lo, hi):
    """dst[lo:hi] = the sum of the tables ``srcs`` over those rows ([R, 1] int32 HBM; one dma_compute per 8,192
    rows)."""
    for r0_nr in chunks(max(0, hi - lo), 8192):
        r0, nr = r0_nr
        aps = []
        for t in srcs:
            aps.append(t.ap(pattern=[[1, nr]], offset=lo + r0))
        nisa.dma_compute(dst=dst.ap(pattern=[[1, nr]], offset=lo + r0), srcs=aps, reduce_op=nl.add)


# ---------------------------------------------------------------------------------------------
# expert weights and the expert MLP
# ---------------------------------------------------------------------------------------------

def _weight_buffers(g, geo, tag, clear):
    """SBUF buffers of one expert's per-core weights: gate|up [128, L, jc, 2 ic] (this core's h-rows of every
    block, block-major so that each partition's run of a block is one contiguous 2 KB DMA run) and down
    [I, H/L] (this core's output columns, the full intermediate)."""
    wgu = nl.ndarray((P, g["L"], g["jc"], 2 * geo["ic"]), dtype=g["adt"], buffer=nl.sbuf, name=tag + "_gu")
    wd = nl.ndarray((g["L"] * geo["ic"], g["HL"]), dtype=g["adt"], buffer=nl.sbuf, name=tag + "_down")
    if clear:       # a buffer whose DMA may be skipped (unused slot) is still computed on: zeros, never garbage
        nisa.memset(dst=wgu, value=0.0, engine=POOL_ENG)
        nisa.memset(dst=wd, value=0.0, engine=POOL_ENG)
    return wgu, wd


def _weight_dmas(g, geo, table, base, edim, rid, wgu, wd):
    """Two DMAs: one expert's per-core gate|up rows and down rows of every block into wgu / wd, from ``table`` at
    element offset ``base`` (the layer's [E, L, P, F] expert table, or the shared [L, P, Fs] block when rid is
    None). With a register ``rid`` the expert is a run-time scalar offset on axis ``edim``; an out-of-bounds id
    skips the transfers."""
    L, jc, jb0, p0, npart, HL, pid = g["L"], g["jc"], g["jb0"], g["p0"], g["np"], g["HL"], g["pid"]
    ic, R, HR, F, off_d = geo["ic"], geo["R"], geo["HR"], geo["F"], geo["off_d"]
    gpc = R // L
    src = [[F, npart], [P * F, L], [1, jc * 2 * ic]]                    # (h-row, block, (h-block, column))
    dsrc = [[P * F, L], [F, ic], [ic * F, gpc], [1, HR]]               # (block, i, row group, column)
    o_gu = base + p0 * F + jb0 * 2 * ic
    o_d = base + pid * gpc * ic * F + off_d
    dst_gu = wgu.ap(pattern=[[L * jc * 2 * ic, npart], [jc * 2 * ic, L], [1, jc * 2 * ic]],
                    offset=p0 * L * jc * 2 * ic)
    dst_d = wd.ap(pattern=[[HL, L * ic], [HR, gpc], [1, HR]], offset=0)
    if rid == None:
        nisa.dma_copy(dst=dst_gu, src=table.ap(pattern=src, offset=o_gu), dge_mode=nisa.dge_mode.hwdge)
        nisa.dma_copy(dst=dst_d, src=table.ap(pattern=dsrc, offset=o_d), dge_mode=nisa.dge_mode.hwdge)
    else:
        nisa.dma_copy(dst=dst_gu, src=table.ap(pattern=src, offset=o_gu, scalar_offset=rid, indirect_dim=edim),
                      dge_mode=nisa.dge_mode.hwdge, oob_mode=nisa.oob_mode.skip)
        nisa.dma_copy(dst=dst_d, src=table.ap(pattern=dsrc, offset=o_d, scalar_offset=rid, indirect_dim=edim),
                      dge_mode=nisa.dge_mode.hwdge, oob_mode=nisa.oob_mode.skip)


def _xsrc(g, t, rows, t0):
    """x^T column source of :func:`_gate_up`: tokens t0.. of a [128, rows, jc] tile (xr or a gather)."""
    jc = g["jc"]
    return {"t": t, "row": rows * jc, "base": g["p0"] * rows * jc + t0 * jc}


def _gate_up(g, c, geo, wgu, xs, ncols, tag):
    """h^T [I, ncols] (activation dtype) = silu(g) * u of ncols tokens whose x^T columns ``xs`` describes
    (:func:`_xsrc`), with the twin's casts (g, u and h rounded): the three stages in program order."""
    up = _up_issue(g, c, geo, wgu, xs, ncols, tag)
    _up_act(g, c, up, tag)
    return _up_mul(up)


def _up_issue(g, c, geo, wgu, xs, ncols, tag):
    """Stage A of gate|up: the matmuls (gate and up of a chunk of <= 256 tokens share one PSUM bank) and, at
    LNC=2, this core's partial sums copied out and swapped with the other core's (one sendrecv per chunk)."""
    jc, npart, adt, L = g["jc"], g["np"], g["adt"], g["L"]
    ic = geo["ic"]
    I = L * ic
    row = L * jc * 2 * ic
    up = {"h": _tile(c, tag + "_h", (I, ncols), adt, UP_AHEAD + 1), "parts": []}
    for k0_kw in chunks(ncols, BANK // 2):
        k0, kw = k0_kw
        acc = _ps(c, I, 2 * kw, tag + "_gu_ps")
        for half in range(2):          # 0: gate, 1: up
            for jj in range(jc):
                stat = wgu.ap(pattern=[[row, npart], [jc * 2 * ic, L], [1, ic]],
                              offset=g["p0"] * row + jj * 2 * ic + half * ic)
                mov = xs["t"].ap(pattern=[[xs["row"], npart], [jc, kw]], offset=xs["base"] + k0 * jc + jj)
                nisa.nc_matmul(dst=acc[:, half * kw:(half + 1) * kw], stationary=stat, moving=mov,
                               accumulate=jj > 0)
        theirs = None
        if L == 2:
            mine = _tile(c, tag + "_mine", (I, 2 * kw), F32, UP_AHEAD + 1)
            nisa.tensor_copy(dst=mine, src=acc)
            theirs = _tile(c, tag + "_theirs", (I, 2 * kw), F32, UP_AHEAD + 1)
            nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - g["pid"], recv_from_rank=1 - g["pid"], pipe_id=0)
        up["parts"].append([k0, kw, acc, theirs, None, None])
    return up


def _up_act(g, c, up, tag):
    """Stage B: g|u = partial + the other core's (rounded to the activation dtype), silu(g) in fp32."""
    I = up["h"].shape[0]
    for part in up["parts"]:
        k0, kw, acc, theirs = part[0], part[1], part[2], part[3]
        gr = _tile(c, tag + "_gu", (I, 2 * kw), g["adt"], UP_AHEAD + 1)
        if theirs == None:
            nisa.tensor_copy(dst=gr, src=acc)
        else:
            nisa.tensor_tensor(dst=gr, data1=acc, data2=theirs, op=nl.add)
        sg = _tile(c, tag + "_silu", (I, kw), F32, UP_AHEAD + 1)
        nisa.activation(dst=sg, op=nl.silu, data=gr[:, 0:kw])
        part[4] = gr
        part[5] = sg


def _up_mul(up):
    """Stage M: h = silu(g) * u, rounded; returns h^T."""
    h = up["h"]
    for part in up["parts"]:
        k0, kw, gr, sg = part[0], part[1], part[4], part[5]
        nisa.tensor_tensor(dst=h[:, k0:k0 + kw], data1=sg, data2=gr[:, kw:2 * kw], op=nl.multiply)
    return h


def _down_rows(g, c, geo, wd, h, w0, wr, tag):
    """Rows w0..w0+wr-1 of the expert output on this core's columns: [wr, H/L], activation dtype."""
    I = g["L"] * geo["ic"]
    ya = _tile(c, tag + "_ya", (wr, g["HL"]), g["adt"], 2 * -(-g["cap"] // WIN) + 1)
    for c0_cw in chunks(g["HL"], BANK):
        c0, cw = c0_cw
        ps = _ps(c, wr, cw, tag + "_down_ps")
        nisa.nc_matmul(dst=ps, stationary=h[0:I, w0:w0 + wr], moving=wd[0:I, c0:c0 + cw], accumulate=False)
        nisa.tensor_copy(dst=ya[:, c0:c0 + cw], src=ps)
    return ya


def _gather_x(g, c, x, tab, row0, rows, rreg, tag):
    """xg [128, rows, jc]: x^T of the tokens in ``tab`` rows row0.. (static) or at the register ``rreg``, on
    this core's partitions. bfloat16: one gather-transpose DMA (SW-DGE; flat index m*128 + p = (row, h-block
    p % jc), the index tile [128, m] holds at (p, i) table row row0 + p // jc + i * 128 / jc -- each row read jc
    times by the load's access pattern -- plus jb0 + p % jc); float32: row gathers of <= 128 tokens, then PE
    transposes."""
    J, jc, p0, npart, adt = g["J"], g["jc"], g["p0"], g["np"], g["adt"]
    xg = _tile(c, tag + "_xg", (P, rows, jc), adt, GATHER_AHEAD + 1)
    if adt == nl.bfloat16:
        m = -(-rows * jc // P)
        idx = _tile(c, tag + "_idx", (P, m), I32, GATHER_AHEAD + 1)
        rep = [[1, P // jc], [0, jc], [P // jc, m]]            # (p // jc, p % jc, i) -> row p // jc + i * 128 / jc
        if rreg == None:
            src = tab.ap(pattern=rep, offset=row0)
        else:
            src = tab.ap(pattern=rep, offset=0, scalar_offset=rreg, indirect_dim=0)
        nisa.dma_copy(dst=idx, src=src, dge_mode=nisa.dge_mode.hwdge)
        nisa.tensor_tensor(dst=idx, data1=idx, data2=c["jcol"].ap(pattern=[[1, P], [0, m]], offset=0), op=nl.add,
                           engine=POOL_ENG)
        nisa.dma_transpose(dst=xg.ap(pattern=[[rows * jc, npart], [1, rows * jc]], offset=p0 * rows * jc),
                           src=x.ap(pattern=[[P, rows * jc], [1, npart]], offset=p0,
                                    vector_offset=idx.ap(pattern=[[m, P], [1, m]], offset=0, dtype=U32),
                                    indirect_dim=0))
        return xg
    for w0_wr in chunks(rows, P):
        w0, wr = w0_wr
        col = nl.ndarray((wr, 1), dtype=I32, buffer=nl.sbuf, name=tag + "_rowidx")
        if rreg == None:
            src = tab.ap(pattern=[[1, wr], [1, 1]], offset=row0 + w0)
        else:
            src = tab.ap(pattern=[[1, wr], [1, 1]], offset=w0, scalar_offset=rreg, indirect_dim=0)
        nisa.dma_copy(dst=col, src=src, dge_mode=nisa.dge_mode.hwdge)
        for jj in range(jc):
            cj = nl.ndarray((wr, 1), dtype=I32, buffer=nl.sbuf, name=tag + "_rowidx_j")
            nisa.tensor_scalar(dst=cj, data=col, op0=nl.add, operand0=g["jb0"] + jj)
            rws = nl.ndarray((wr, npart), dtype=adt, buffer=nl.sbuf, name=tag + "_rows")
            nisa.dma_copy(dst=rws, src=x.ap(pattern=[[P, wr], [1, npart]], offset=p0, vector_offset=cj,
                                            indirect_dim=0))
            ps = _ps(c, npart, wr, tag + "_xT_ps")
            nisa.nc_transpose(dst=ps, data=rws, engine=nisa.engine.tensor)
            nisa.tensor_copy(dst=xg[p0:p0 + npart, w0:w0 + wr, jj], src=ps)
    return xg


# ---------------------------------------------------------------------------------------------
# 3.-5. the expert phases
# ---------------------------------------------------------------------------------------------

def _slot_weights(g, geo, experts_w, ids, s, reg, buf):
    """Slot s's expert id into ``reg`` and its weight DMAs into ``buf`` (skipped when the slot is unused)."""
    table, base, edim = experts_w
    nisa.register_load(reg, ids[0:1, s:s + 1])
    _weight_dmas(g, geo, table, base, edim, reg, buf[0], buf[1])


def _slot_compute(g, c, geo, buf, xs, rows, tag):
    """The expert MLP of ``rows`` tokens (x^T columns ``xs``) -> [(first row, rows, ya)] (all stages in order)."""
    h = _gate_up(g, c, geo, buf[0], xs, rows, tag)
    return _slot_down(g, c, geo, buf, h, tag)


def _slot_down(g, c, geo, buf, h, tag):
    """Stage E: the down projection of h^T per window of <= 128 rows -> [(first row, rows, ya)]."""
    out = []
    for w0_wr in chunks(h.shape[1], WIN):
        w0, wr = w0_wr
        out.append((w0, wr, _down_rows(g, c, geo, buf[1], h, w0, wr, tag)))
    return out


def _slot_writes(g, scratch, row0, rows):
    """The output rows of a job to scratch rows row0.. (this core's columns)."""
    col0, HL = g["col0"], g["HL"]
    for w0_wr_ya in rows:
        w0, wr, ya = w0_wr_ya
        nisa.dma_copy(dst=scratch[row0 + w0:row0 + w0 + wr, col0:col0 + HL], src=ya)


def _run_jobs(g, c, jobs, scratch, weights):
    """Software-pipelined expert MLPs in program order (every engine and every DMA trigger queue runs in program
    order): iteration i issues the gate|up matmuls and partial swap of job i + 2 (its weights first if they are
    not yet issued), the down projection of job i, the swap-add and silu of job i + 2, the silu * up of job i + 1,
    the x gather of job i + GATHER_AHEAD, the output rows of job i - 1 and the weight refill after slot i - 1
    (:func:`_refill`).

    A job is {"buf": (wgu, wd), "rows": tokens, "row0": first scratch row, "xs": x^T column source (None until
    gathered), "gather": None or (tab, rows, registers, slot) to gather its x^T columns from, "geo": its
    geometry, "slot": its slot or None (shared expert)}; ``weights``: None, or the weight ring of
    :func:`_regular_slots`."""
    n = len(jobs)
    tag = "moe_pf_job"
    ups = []
    for i in range(n):
        ups.append(None)
    for i in range(min(GATHER_AHEAD, n)):
        _job_gather(g, c, jobs[i], tag)
    for i in range(min(UP_AHEAD, n)):
        if weights != None and jobs[i]["slot"] != None:
            _issue_upto(g, jobs[i]["geo"], weights, jobs[i]["slot"])
        ups[i] = _up_issue(g, c, jobs[i]["geo"], jobs[i]["buf"][0], jobs[i]["xs"], jobs[i]["rows"], tag)
        _up_act(g, c, ups[i], tag)
    if n > 0:
        _up_mul(ups[0])
    prev = None
    for i in range(n):
        a = i + UP_AHEAD
        if a < n:
            if weights != None and jobs[a]["slot"] != None:
                _issue_upto(g, jobs[a]["geo"], weights, jobs[a]["slot"])
            ups[a] = _up_issue(g, c, jobs[a]["geo"], jobs[a]["buf"][0], jobs[a]["xs"], jobs[a]["rows"], tag)
        rows = _slot_down(g, c, jobs[i]["geo"], jobs[i]["buf"], ups[i]["h"], tag)
        if a < n:
            _up_act(g, c, ups[a], tag)
        if i + 1 < n:
            _up_mul(ups[i + 1])
        if i + GATHER_AHEAD < n:
            _job_gather(g, c, jobs[i + GATHER_AHEAD], tag)
        if prev != None:
            _slot_writes(g, scratch, jobs[i - 1]["row0"], prev)
        if weights != None and i >= 1 and jobs[i - 1]["slot"] != None:
            _refill(g, jobs[i - 1]["geo"], weights, jobs[i - 1]["slot"])
        ups[i] = None
        jobs[i]["xs"] = None
        prev = rows
    if prev != None:
        _slot_writes(g, scratch, jobs[n - 1]["row0"], prev)


def _job_gather(g, c, job, tag):
    """Issue the x^T gather of a routed job (a shared-expert job reads the resident x^T: nothing to do): slot s
    reads the index-table rows from rows[s] (a register of the ring ``regs``)."""
    if job["gather"] != None:
        tab, rows, regs, s = job["gather"]
        reg = regs[s % len(regs)]
        nisa.register_load(reg, rows[0:1, s:s + 1])
        xg = _gather_x(g, c, g["x"], tab, 0, job["rows"], reg, tag)
        job["xs"] = _xsrc(g, xg, job["rows"], 0)


def _refill(g, geo, w, i):
    """After slot i: DMA the weights of the next slots not yet issued, at most two and up to slot i + D (whose
    buffer slot i freed): the ring fills two slots per slot at the start, so the first slots' weights do not
    share the DMA bandwidth with all D prefetches."""
    for q in range(2):
        if w["next"] <= i + w["D"]:
            _issue_upto(g, geo, w, w["next"])


def _issue_upto(g, geo, w, s):
    """Issue the weight DMAs of every slot up to s not yet issued (called before a slot's gate|up, which reads its
    buffer: with D >= UP_AHEAD + 2 the buffer's previous slot is done by then)."""
    D = w["D"]
    while w["next"] <= s and w["next"] < g["S"]:
        q = w["next"]
        _slot_weights(g, geo, w["experts"], w["ids"], q, w["regs"][q % D], w["bufs"][q % D])
        w["next"] = q + 1


def _weight_ring(g, geo, experts_w):
    """The regular slots' weight ring: D buffers (within RING_BUDGET beside the resident x^T) and their id
    registers, made before the routing (they do not depend on it). A buffer whose DMA may be skipped (unused slot)
    is still computed on: w["clears"] lists the tiles to zero (the routing's placements clear them by DMA from a
    zeroed tile, the rest :func:`moe_prefill_body` before the first weight DMA)."""
    S, isz = g["S"], (2 if g["adt"] == nl.bfloat16 else 4)
    per = (g["L"] * g["jc"] * 2 * geo["ic"] + g["HL"]) * isz           # bytes per partition of one buffer
    room = RING_BUDGET - g["N"] * g["jc"] * isz                          # beside the resident x^T
    D = max(2, min(RING, S, room // per))
    w = {"D": D, "experts": experts_w, "ids": None, "bufs": [], "regs": [], "clears": []}
    for i in range(D):
        buf = _weight_buffers(g, geo, "moe_pf_w" + str(i), False)
        w["bufs"].append(buf)
        w["clears"].append(buf[0])
        w["clears"].append(buf[1])
        w["regs"].append(nisa.register_alloc())
    return w


def _regular_slots(g, geo, ids, w):
    """Static slots 0..S-1: expert ids[s] (out of bounds: unused slot, no weight bytes), scratch rows s*cap..;
    weights in the ring ``w`` of :func:`_weight_ring` (D buffers), slot s + D refilled once slot s is done. The
    jobs' gathers are set once the index table is merged (:func:`moe_prefill_body`)."""
    S, cap, D, experts_w = g["S"], g["cap"], w["D"], w["experts"]
    w["ids"] = ids
    w["next"] = min(D, S, UP_AHEAD)          # the first gate|up jobs' weights first; the rest by _refill
    for s in range(w["next"]):
        _slot_weights(g, geo, experts_w, ids, s, w["regs"][s], w["bufs"][s])
    jobs = []
    for s in range(S):
        jobs.append({"buf": w["bufs"][s % D], "rows": cap, "row0": s * cap, "xs": None, "gather": None,
                     "geo": geo, "slot": s})
    return jobs, w


def _shared_jobs(g, geo, shw, xr):
    """The shared expert as one job per 128-token tile, on the resident x^T, output rows SHB + t."""
    jobs = []
    for t0_n in g["tiles"]:
        t0, n = t0_n
        jobs.append({"buf": shw, "rows": n, "row0": g["SHB"] + t0, "xs": _xsrc(g, xr, g["N"], t0), "gather": None,
                     "geo": geo, "slot": None})
    return jobs


def _interleave(slots, shared):
    """The slot jobs with the shared-expert jobs spread evenly among them (one after every len(slots) /
    len(shared) slots): the shared expert's compute fills the slot phase's engine gaps instead of running alone
    before it."""
    out = []
    n, m = len(slots), len(shared)
    q = 0
    for i in range(n):
        out.append(slots[i])
        while q < m and (q + 1) * n <= (i + 1) * m:
            out.append(shared[q])
            q = q + 1
    while q < m:
        out.append(shared[q])
        q = q + 1
    return out


def _heavy_rows(g):
    """HBM [NHW, 1] int32: first table row of heavy window i (HB + 128 i)."""
    NHW, HB = g["NHW"], g["HB"]
    t = nl.ndarray((NHW, 1), dtype=I32, buffer=nl.private_hbm, name="moe_pf_heavy_rows_hbm")
    for r0_nr in chunks(NHW, P):
        r0, nr = r0_nr
        v = nl.ndarray((nr, 1), dtype=I32, buffer=nl.sbuf, name="moe_pf_heavy_rows")
        nisa.iota(dst=v, pattern=[[0, 1]], offset=HB + WIN * r0, channel_multiplier=WIN)
        nisa.dma_copy(dst=t[r0:r0 + nr, :], src=v)
    return t


def _heavy_windows(g, geo, tab, scratch, nhw, hid, experts_w):
    """One runtime loop over the heavy experts' 128-row windows (trip count nhw, the same on both cores): a
    window's weights are DMA'd only at its expert's first window (other ids are out of bounds, skipped)."""
    table, base, edim = experts_w
    col0, HL, H = g["col0"], g["HL"], g["H"]
    hrow = _heavy_rows(g)
    wgu, wd = _weight_buffers(g, geo, "moe_pf_heavy_w", False)
    n_reg = nisa.register_alloc()
    nisa.register_load(n_reg, nhw)
    c = {"psum": None, "rings": None, "jcol": g["jcol"]}

    def window(i):
        rec = nl.ndarray((1, 2), dtype=I32, buffer=nl.sbuf, name="moe_pf_heavy_rec")
        nisa.dma_copy(dst=rec[0:1, 0:1], src=hid.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=i,
                                                    indirect_dim=0), dge_mode=nisa.dge_mode.hwdge)
        nisa.dma_copy(dst=rec[0:1, 1:2], src=hrow.ap(pattern=[[1, 1], [1, 1]], offset=0, scalar_offset=i,
                                                     indirect_dim=0), dge_mode=nisa.dge_mode.hwdge)
        rid = nisa.register_alloc()
        nisa.register_load(rid, rec[0:1, 0:1])
        rrow = nisa.register_alloc()
        nisa.register_load(rrow, rec[0:1, 1:2])
        _weight_dmas(g, geo, table, base, edim, rid, wgu, wd)
        xg = _gather_x(g, c, g["x"], tab, 0, WIN, rrow, "moe_pf_heavy")
        ya = _slot_compute(g, c, geo, (wgu, wd), _xsrc(g, xg, WIN, 0), WIN, "moe_pf_heavy")[0][2]
        nisa.dma_copy(dst=scratch.ap(pattern=[[H, WIN], [1, HL]], offset=col0, scalar_offset=rrow, indirect_dim=0),
                      src=ya, dge_mode=nisa.dge_mode.hwdge)

    nl.fori_loop(0, n_reg, window)


def _combine_loads(g, c, scratch, st, ti):
    """Token tile ti's gathers for :func:`_combine`: its k expert rows (``DEST``) and its shared-expert rows.
    Returns (G [P, k, H], sh [P, H]), activation dtype."""
    T, k, H, adt, SHB = g["T"], g["k"], g["H"], g["adt"], g["SHB"]
    t0, n = g["tiles"][ti]
    depth = 2 if adt == nl.bfloat16 else 1          # 32 KB per partition per tile of gathered bf16 rows
    G = _tile(c, "moe_pf_rows", (P, k, H), adt, depth)
    for j in range(k):
        nisa.dma_copy(dst=G[0:n, j, :], src=scratch.ap(pattern=[[H, n], [1, H]], offset=0,
                                                       vector_offset=st["DEST"].ap(pattern=[[T * k, n], [1, 1]],
                                                                                   offset=ti * k + j),
                                                       indirect_dim=0))
    sh = _tile(c, "moe_pf_shared_rows", (P, H), adt, 2)
    nisa.dma_copy(dst=sh[0:n, :], src=scratch[SHB + t0:SHB + t0 + n, :], dge_mode=nisa.dge_mode.hwdge)
    return G, sh


def _combine_math(g, c, st, ti, G, sh, yt, col):
    """Token tile ti of :func:`_combine`: sum_j w_tj G[:, j] (PE against diag(w), fp32 PSUM) + gate_t * sh ->
    ``yt[0:n, col:col + H]`` (float32 SBUF)."""
    T, k, H, adt = g["T"], g["k"], g["H"], g["adt"]
    t0, n = g["tiles"][ti]
    dg = _tile(c, "moe_pf_diag", (P, k, P), adt, 2)
    nisa.tensor_tensor(dst=dg[0:n, :, 0:n], data1=c["ident_a"].ap(pattern=[[P, n], [0, k], [1, n]], offset=0),
                       data2=st["W8"].ap(pattern=[[T * k, n], [1, k], [0, n]], offset=ti * k), op=nl.multiply)
    for c0_cw in chunks(H, BANK):
        c0, cw = c0_cw
        rp = _ps(c, n, cw, "moe_pf_routed_ps")
        for j in range(k):
            nisa.nc_matmul(dst=rp, stationary=dg[0:n, j, 0:n], moving=G[0:n, j, c0:c0 + cw], accumulate=j > 0)
        nisa.scalar_tensor_tensor(dst=yt[0:n, col + c0:col + c0 + cw], data=sh[0:n, c0:c0 + cw], op0=nl.multiply,
                                  operand0=st["GATE"][0:n, ti:ti + 1], op1=nl.add, operand1=rp)


def _fused_groups(g):
    """This core's token groups for the fused combine: (first tile, tiles) of FUSE_TILES consecutive full tiles
    (a partial last tile alone), dealt round-robin over the cores."""
    T, L, pid = g["T"], g["L"], g["pid"]
    out = []
    ti = 0
    gid = 0
    while ti < T:
        kk = FUSE_TILES
        if ti + kk > T or g["tiles"][ti + kk - 1][1] != P:
            kk = 1
        if gid % L == pid:
            out.append((ti, kk))
        gid = gid + 1
        ti = ti + kk
    return out


def _combine(g, c, scratch, st, y, fuse=None):
    """Token tiles ti = pid, pid + L, ..: y[tile, :] = sum_j w_tj * scratch[dest_tj] (PE against diag(w), fp32
    PSUM) + gate_t * scratch[SHB + t] (the shared expert's rows), full rows, written to y.

    With ``fuse`` (the composition's next step fused, :func:`moe_prefill`) the core takes groups of FUSE_TILES
    consecutive tiles instead (:func:`_fused_groups`): a group's rows are all-reduced over the TP ranks (one SBUF
    collective per group), added to the residual, written as the new residual and normalised
    (``rmsnorm_prefill.residual_norm_tile``) -- the math of ``megakernel.prefill.residual_allreduce_stage`` on
    y, which never reaches HBM. Software-pipelined in program order: the gathers of the next tile before this
    tile's sums; a group's collective issued after its last tile, its residual / stores / norm after the next
    group's collective."""
    L, pid, H = g["L"], g["pid"], g["H"]
    if fuse == None:
        for ti in range(pid, g["T"], L):
            t0, n = g["tiles"][ti]
            G, sh = _combine_loads(g, c, scratch, st, ti)
            yt = _tile(c, "moe_pf_y", (P, H), F32, 2)
            _combine_math(g, c, st, ti, G, sh, yt, 0)
            nisa.dma_copy(dst=y[t0:t0 + n, :], src=yt[0:n, :])
        return
    seq = []                  # (group, sub-tile, tile) in order
    groups = _fused_groups(g)
    for q in range(len(groups)):
        for s in range(groups[q][1]):
            seq.append((q, s, groups[q][0] + s))
    ld = None
    if len(seq) > 0:
        ld = _combine_loads(g, c, scratch, st, seq[0][2])
    prev = None
    yt = None
    xs = None
    for i in range(len(seq)):
        q, s, ti = seq[i]
        t0, n = g["tiles"][groups[q][0]]
        kk = groups[q][1]
        if s == 0:
            yt = _tile(c, "moe_pf_y", (P, kk * H), F32, 2)
            xs = _tile(c, "moe_pf_residual", (P, kk * H), g["adt"], 2)
            nisa.dma_copy(dst=xs[0:n, :], src=token_group_ap(fuse["x"], t0 * H, n, kk, H))
        nxt = None
        if i + 1 < len(seq):
            nxt = _combine_loads(g, c, scratch, st, seq[i + 1][2])
        _combine_math(g, c, st, ti, ld[0], ld[1], yt, s * H)
        ld = nxt
        if s < kk - 1:
            continue
        total = yt
        if fuse["rg"] != None:
            total = _tile(c, "moe_pf_total", (P, kk * H), F32, 2)
            ncc.all_reduce(srcs=[yt[0:n, :]], dsts=[total[0:n, :]], replica_group=fuse["rg"], op=nl.add)
        if prev != None:
            _fused_finish(fuse, prev, H)
        prev = (t0, n, kk, total, xs)
    if prev != None:
        _fused_finish(fuse, prev, H)


def _fused_finish(fuse, item, H):
    t0, n, kk, total, xs = item
    out_rows = token_group_ap(fuse["out"], t0 * H, n, kk, H)
    residual_norm_tile(xs, total, n, kk, H, out_rows, fuse["norm_t"], fuse["norm_out"], t0, fuse["wb"], fuse["ident"],
                       fuse["eps"])


# ---------------------------------------------------------------------------------------------
# body and wrapper
# ---------------------------------------------------------------------------------------------

def moe_prefill_body(x, router, experts, shared, top_k, y, capacity=None, layer=None, fuse=None):
    """MoE of the chunk on one core: x [N*H/128, 128] HBM (token-major, activation dtype, :func:`token_rows`)
    -> this core's columns of the rank's partial written to ``y [N, H]`` (HBM float32). Weights from
    :func:`nki_kernels.moe.moe_hbm_layout` for this launch's LNC (whole, or stacked [G, ...] with ``layer``).
    capacity: static tokens per regular expert slot (default :func:`default_capacity`, rounded up to 16).
    fuse: None, or the fused next step (:func:`moe_prefill` builds it; ``y`` is then None): dict with the
    residual ``x [N, H]`` HBM, ``rg`` (the TP ReplicaGroup or None), ``out`` / ``norm_t`` / ``norm_out`` / ``w``
    (norm weight row or None) / ``eps``.
    Returns ``finite [1, 1]`` float32 SBUF (1.0 when every router logit was finite)."""
    adt = x.dtype
    N, H = (y if fuse == None else fuse["x"]).shape
    J = H // P
    base = 0
    sh_base = 0
    stacked = experts
    shared_t = shared
    Ltab = 1
    if layer != None:
        if len(experts.shape) != 5 or not 0 <= layer < experts.shape[0]:
            raise ValueError(f"moe_prefill: layer {layer} of stacked experts {list(experts.shape)}: expected "
                             f"[G, E, n_cores, {P}, F] with 0 <= layer < G")
        Ltab = experts.shape[0]
        base = layer * experts.shape[1] * experts.shape[2] * experts.shape[3] * experts.shape[4]
        sh_base = layer * shared.shape[1] * shared.shape[2] * shared.shape[3]
        experts, router, shared = experts[layer], router[layer], shared[layer]
    elif len(experts.shape) != 4:
        raise ValueError(f"moe_prefill: experts {list(experts.shape)}: expected [E, n_cores, {P}, F], or stacked "
                         f"[G, E, n_cores, {P}, F] with layer=")
    n_elems = 1
    for d in stacked.shape:
        n_elems = n_elems * d
    E, n_cores = experts.shape[0], experts.shape[1]
    unit = n_elems // (Ltab * E)
    if n_elems + unit > INT32_MAX:
        raise ValueError(f"moe_prefill: the experts table {list(stacked.shape)} holds {n_elems} elements; its element "
                         f"offsets (and one expert past its end, the skip offset) must fit int32 (SDK-LG 'NKI "
                         f"Values'): stack fewer layers per table (layers_per_table: "
                         f"{layers_per_table(n_elems // Ltab)})")
    if H % P or tuple(x.shape) != (N * J, P):
        raise ValueError(f"moe_prefill: x is {list(x.shape)}, expected [N*H/{P}, {P}] = [{N * J}, {P}] for y "
                         f"[{N}, {H}] (token_rows)")
    if adt not in (nl.bfloat16, nl.float32):
        raise ValueError(f"moe_prefill: activation dtype {adt} is not bfloat16 or float32")
    for nm_t in (("router", router), ("experts", experts), ("shared", shared)):
        nm, t = nm_t
        if t.dtype != adt:
            raise ValueError(f"moe_prefill: {nm} is {t.dtype} but the activations are {adt}; weights must match")
    L, pid = program_sharding()
    if n_cores != L or experts.shape[2] != P or E % L or tuple(router.shape) != (L, P, J, E // L + 1) \
            or tuple(shared.shape[0:2]) != (L, P):
        raise ValueError(f"moe_prefill: experts {list(experts.shape)} / router {list(router.shape)} / shared "
                         f"{list(shared.shape)} do not match H={H} and the launch's LNC={L} (expected [E, {L}, {P}, "
                         f"F], [{L}, {P}, {J}, E/{L} + 1], [{L}, {P}, Fs])")
    if not 1 <= top_k <= MAX8 or E < MAX8 or E + 1 > BANK:
        raise ValueError(f"moe_prefill: top_k={top_k}, E={E}: need 1 <= top_k <= {MAX8} and {MAX8} <= E < {BANK}")
    if fuse == None and y.dtype != F32:
        raise ValueError(f"moe_prefill: y is {y.dtype}, expected float32")
    if fuse != None and fuse["x"].dtype != adt:
        raise ValueError(f"moe_prefill: the residual is {fuse['x'].dtype} but the activations are {adt}")
    geo = _geometry(experts.shape[3], H, "expert")
    geo_s = _geometry(shared.shape[2], H, "shared-expert")
    for gg in (geo, geo_s):
        if gg["R"] % L:
            raise ValueError(f"moe_prefill: {gg['R']} down-row groups do not split over {L} cores")
    cap = default_capacity(N, E, top_k) if capacity == None else -(-capacity // 16) * 16
    if not 16 <= cap <= max(16, -(-N // 16) * 16):
        raise ValueError(f"moe_prefill: capacity {capacity} outside [1, N={N}]")
    jb0, jc, p0, npart = core_split(J, L, pid)
    if adt == nl.bfloat16 and P % jc:
        raise ValueError(f"moe_prefill: {jc} hidden blocks per core must divide {P} (gather-transpose index tiles)")
    isz = 2 if adt == nl.bfloat16 else 4
    if N * jc * isz > XR_BUDGET:
        raise ValueError(f"moe_prefill: the resident x^T of {N} tokens x {jc} h-blocks ({N * jc * isz // 1024} KB per "
                         f"partition) exceeds {XR_BUDGET // 1024} KB of SBUF: use LNC=2, bfloat16 or chunks of at most "
                         f"{XR_BUDGET // (jc * isz)} tokens")
    S, NHW, HB, ROWS = table_rows(N, E, top_k, cap)
    TR = ROWS + -(-(cap + P) // WIN) * WIN       # index-table rows: + zeroed spare rows (unused slots read them)
    if ROWS * H > INT32_MAX or 2 * TR + N >= 2 ** 24 or N * J >= 2 ** 24:
        raise ValueError(f"moe_prefill: {ROWS} assignment rows x H={H} exceed the int32 / exact-fp32 index range")
    tiles = chunks(N, P)
    g = {"x": x, "SHB": ROWS, "N": N, "H": H, "J": J, "E": E, "Eh": E // L, "k": top_k, "L": L, "pid": pid, "adt": adt, "jb0": jb0,
         "jc": jc, "p0": p0, "np": npart, "HL": H // L, "col0": pid * (H // L), "cap": cap, "S": S, "NHW": NHW,
         "HB": HB, "ROWS": ROWS, "tiles": tiles, "T": len(tiles),
         "oob": E * (Ltab - (0 if layer == None else layer)), "TR": TR, "BIG": TR + N}
    experts_w = (stacked, base, 0 if layer == None else 1)

    c = _consts(g)
    g["jcol"] = c.get("jcol")
    # weights that do not depend on the routing: router rows, the shared expert; x^T resident
    rr = _load_router(g, router)
    xl = _load_x(g, x)
    _x_upto(g, xl, 1)

    # routing-independent setup, off the grouping's critical path: id tables, weight ring; the choice tables
    # (the routing's placements scatter into them)
    ids_h, rows_h, hid = _id_tables(g)
    ring = _weight_ring(g, geo, experts_w)
    tabs, mine = _choice_tables(g)

    # 1. routing and the placements (pass 1 of the index table)
    T, k = g["T"], top_k
    st = {"E8": nl.ndarray((P, T, k), dtype=U32, buffer=nl.sbuf, name="moe_pf_e8"),
          "RK8": nl.ndarray((P, T, k), dtype=F32, buffer=nl.sbuf, name="moe_pf_rank8"),
          "W8": nl.ndarray((P, T, k), dtype=adt, buffer=nl.sbuf, name="moe_pf_w8"),
          "GATE": nl.ndarray((P, T), dtype=F32, buffer=nl.sbuf, name="moe_pf_gate"),
          "DEST": nl.ndarray((P, T, k), dtype=I32, buffer=nl.sbuf, name="moe_pf_dest"),
          "fin": nl.ndarray((1, 1), dtype=F32, buffer=nl.psum, name="moe_pf_finite_ps")}
    st["nfin"] = 0
    st["keep"] = []
    st["clears"] = ring["clears"]
    zf = 0
    for t in st["clears"]:
        zf = max(zf, t.size // t.shape[0])
    st["zero"] = nl.ndarray((P, zf), dtype=adt, buffer=nl.sbuf, name="moe_pf_zero_weights")
    nisa.memset(dst=st["zero"], value=0.0, engine=POOL_ENG)
    run, placed, cnt0 = _route(g, c, xl, rr, st, mine)
    for t in st["clears"]:
        _clear(st, t)
    st["clears"] = []
    st["keep"] = []
    st["zero"] = None
    rr = None           # the router rows are dead
    xr = xl["xr"]
    fin = nl.ndarray((1, 1), dtype=F32, buffer=nl.sbuf, name="moe_pf_finite")
    nisa.tensor_scalar(dst=fin, data=st["fin"], op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0)
    st["fin"] = None
    tab = nl.ndarray((TR, 1), dtype=I32, buffer=nl.shared_hbm, name="moe_pf_index_table")
    _merge_tables(g, tabs, tab, 0, TR)
    shw = _weight_buffers(g, geo_s, "moe_pf_shared_w", False)      # the shared expert runs among the slots
    _weight_dmas(g, geo_s, shared_t, sh_base, 0, None, shw[0], shw[1])

    # 2. grouping: slots, heavy windows, every expert's scratch base; the heavy experts' rows (a runtime loop
    # that runs only when one is heavy); the shared expert meanwhile
    scratch = nl.ndarray((g["SHB"] + N, H), dtype=adt, buffer=nl.shared_hbm, name="moe_pf_expert_rows")
    BB, ids, rows, nhw, hid, V = _group(g, c, run, ids_h, rows_h, hid)
    jobs, w = _regular_slots(g, geo, ids, ring)      # weight prefetch of slots 0..D-1
    ring = None
    DH = _heavy_places(g, c, st, BB, V, nhw, tabs, tab, mine, cnt0)
    placed, cnt0, V = None, None, None
    c["psum"] = _psum_pool()
    c["rings"] = {}
    if L == 2:
        nisa.core_barrier(data=tab, cores=(0, 1))

    # 3. regular slots, 4. heavy windows
    rregs = []
    for i in range(GATHER_AHEAD + 1):
        rregs.append(nisa.register_alloc())
    for s in range(len(jobs)):
        jobs[s]["gather"] = (tab, rows, rregs, s)
    _run_jobs(g, c, _interleave(jobs, _shared_jobs(g, geo_s, shw, xr)), scratch, w)
    jobs, w = None, None            # the weight ring's SBUF is released
    shw = None          # the shared expert's weights are dead
    xr = None
    xl = None           # (it holds x^T too: released with it)
    if NHW > 0:
        c["psum"] = None            # no PSUM tensor lives across the runtime loop
        _heavy_windows(g, geo, tab, scratch, nhw, hid, experts_w)
        c["psum"] = _psum_pool()
    _dest_rows(g, BB, st, DH)

    # 5. combine (full rows; the other core wrote the other half of the columns); the routing and grouping
    # tables it does not read are released (SBUF for the fused epilogue's tiles)
    run, BB, ids, rows, nhw, hid, DH = None, None, None, None, None, None, None
    st["E8"] = None
    st["RK8"] = None
    c["rev"] = None
    c["rings"] = {}
    if fuse != None:
        fuse["wb"] = None
        fuse["ident"] = None
        if fuse["norm_out"] != "none":
            c["psum"] = None            # the weight broadcast's PSUM bank, then the pool: 6 of the 8 banks (the
            fuse["wb"] = broadcast_weight(fuse["w"], H)      # norm's transposes take two)
            fuse["ident"] = nl.shared_identity_matrix(n=P, dtype=adt)
            c["psum"] = _psum_pool(PSUM_POOL - 1)
    if L == 2:
        nisa.core_barrier(data=scratch, cores=(0, 1))
    _combine(g, c, scratch, st, y, fuse)
    return fin


@nki.jit
def moe_prefill(x, router, experts, shared, top_k, capacity=None, residual=None, tp=1, norm_w=None, eps=1e-6,
                norm_out="none"):
    """HBM wrapper of :func:`moe_prefill_body`: x [N*H/128, 128] (:func:`token_rows`) -> (y [N, H] float32, the
    rank's partial; finite [n_cores, 1] float32). Weights from :func:`nki_kernels.moe.moe_hbm_layout` for the
    launch's LNC; top_k: experts per token; capacity: static tokens per regular expert slot.

    With ``residual`` (``[N, H]`` activation dtype, the block's residual) the composition's next step is fused
    into the combine: the new residual ``residual + all-reduce over tp ranks(y)`` and, with ``norm_w`` (a ``[P,
    H/P]`` row of ``norms``) and ``norm_out`` "rows" / "xT", its RMSNorm (the same math and instruction sequence
    per tile as ``megakernel.prefill.residual_allreduce_stage`` on y) -> (residual [N, H], [normed,] finite);
    y never reaches HBM."""
    H = router.shape[2] * P
    N = x.shape[0] * P // H
    L, pid = program_sharding()
    fin_out = nl.ndarray((L, 1), dtype=F32, buffer=nl.shared_hbm, name="moe_pf_finite_out")
    if residual == None:
        y = nl.ndarray((N, H), dtype=F32, buffer=nl.shared_hbm, name="moe_pf_out")
        fin = moe_prefill_body(x, router, experts, shared, top_k, y, capacity)
        nisa.dma_copy(dst=fin_out[pid:pid + 1, :], src=fin)
        return y, fin_out
    if tuple(residual.shape) != (N, H) or norm_out not in ("none", "rows", "xT") or \
            (norm_out != "none" and norm_w == None):
        raise ValueError(f"moe_prefill: residual {list(residual.shape)} (expected [{N}, {H}]), norm_out {norm_out!r} "
                         f"(none | rows | xT; rows / xT need norm_w)")
    out = nl.ndarray((N, H), dtype=residual.dtype, buffer=nl.shared_hbm, name="moe_pf_residual_out")
    norm_t = norm_output(N, H, residual.dtype, norm_out, "moe_pf_out")
    rg = ncc.ReplicaGroup([list(range(tp))]) if tp > 1 else None
    fuse = {"x": residual, "rg": rg, "out": out, "norm_t": norm_t, "norm_out": norm_out, "w": norm_w, "eps": eps}
    fin = moe_prefill_body(x, router, experts, shared, top_k, None, capacity, fuse=fuse)
    nisa.dma_copy(dst=fin_out[pid:pid + 1, :], src=fin)
    if norm_t != None:
        return out, norm_t, fin_out
    return out, fin_out


# ---------------------------------------------------------------------------------------------
# trace helpers and the demo launch (host)
# ---------------------------------------------------------------------------------------------

def routed_expert_bytes(trace, table="arg2"):
    """HBM bytes the routed-expert weight DMAs of an EXECUTING nkisim trace actually moved: the scalar-offset
    reads of the experts table (kernel argument ``table``; ``arg2`` is moe_prefill's ``experts``) whose offset
    resolved inside the table. A transfer skipped by ``oob_mode=skip`` (unused slot, heavy continuation window)
    is traced with its bytes but an unresolved offset and is not counted."""
    total = 0
    for r in trace.instructions:
        if r["op"] != "dma_copy":
            continue
        src = [g for g in r["reads"] if g["arg"] == "src"]
        if src and src[0].get("indirect") == "scalar" and src[0].get("name") == table and src[0].get("resolved"):
            total += r["bytes"].get(src[0]["mem"], {}).get("read", 0)
    return total


def kernel_shapes(cfg, tp=4, N=1024, lnc=2, dtype="bfloat16"):
    """Name -> shape of moe_prefill's tensor arguments for one rank of ``cfg`` (ModelConfig-like)."""
    H, E = cfg.hidden_size, cfg.num_experts
    ir, isr = cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp
    return {"x": (N * H // P, P), "router": (lnc, P, H // P, E // lnc + 1),
            "experts": (E, lnc, P, block_width(ir // lnc, H)), "shared": (lnc, P, block_width(isr // lnc, H))}
