"""Gated GQA attention of the Qwen3.6 full-attention layers, PREFILL (context encoding) of an N-token chunk,
one rank split over its LNC cores, with a static-anchor softmax.

Math (shared/docs/qwen36.md §4.2; twin: ``model.tp.attention.attention_rank`` with T = N): for the rank's Hq_r
query heads (4 at TP=4) sharing ONE KV head, head dim D (256), rotary dims R (64): q|gate = x Wq, k = x Wk,
v = x Wv (rounded to the activation dtype); q, k <- zero-centred RMSNorm over D (weight 1 + w); rotate-half RoPE
on dims [0, R); the N new K/V rows are written into the decode caches at positions start..start+N-1; every query
attends causally over the cache rows 0..start-1 (earlier chunks) and the chunk's own keys; o <- o * sigmoid(gate);
y = o Wo (this core's o_proj partial, fp32, to be all-reduced by the composition).

Interface
---------
Weights: the decode kernel's per-rank layout (``nki_kernels.attention.attention_layout``; no second copy):
``wqg [H, 2, Hq_r, D]``, ``wk``/``wv [H, D]``, ``wo [Hq_r*D, H]``, ``norm_w [2, D]`` float32.

* ``xT`` HBM ``[P, H/P, N]`` act dtype: the chunk's NORMED hidden states, feature-major -- element (p, j, t) =
  x[t, j*P + p], the decode ``xT`` layout with T = N (``attention.xT_layout``). The composition's norm produces it
  per 128-token tile (norm over the free axis, then PE transposes) and writes each tile's columns; a tile is read
  here as one DMA of H/P runs of 128 tokens per partition.
* ``cos``, ``sin`` HBM ``[N, R]`` float32: rows = positions start..start+N-1 (``attention.rope_tables``).
* ``k_cache``, ``v_cache`` HBM ``[1, L, D]`` act dtype: the decode caches (same layout the decode kernel reads);
  rows start..start+N-1 are written in place, rows 0..start-1 (earlier chunks) are read. ``L >= key_block``.
* ``start`` HBM ``[1, 1]`` int32: a RUN-TIME value (one compiled kernel per chunk length N serves every chunk of
  a prompt): it becomes DMA offsets (``.ap(scalar_offset=register)``) and runtime loop bounds; nothing branches
  on it in Python.
* Output: ``out`` HBM ``[N, H]`` float32, this core's o_proj partial (the rank's output is the sum over cores;
  the fused form below writes the all-reduced residual and its norm instead);
  the body also returns ``stats`` SBUF ``[1, 3]`` float32: (rows this core froze in the static pass, 1.0 if the
  replay ran on the rank, non-finite output rows of this core).

The body takes and returns HBM (not SBUF like the decode bodies): an N-token chunk (N up to ~4K) does not fit in
SBUF next to the chunk's q / gate / K / V / softmax state, so the composition hands chunks over through HBM.

Fused next step (``attention_prefill_kernel(..., residual, tp, next_norm_w, norm_out)``, what the prefill
composition launches): instead of the partials, the kernel writes the new residual ``residual + all-reduce over
the rank's cores and the tp ranks (partials)`` and the next RMSNorm's rows / xT -- bit for bit what
``megakernel.prefill.residual_allreduce_stage`` makes of the partials, in its row groups
(``rmsnorm_prefill.allreduce_groups``: group q on core q % n_cores). The head split stays for the attention; for
the o_proj the cores swap the gated output o^T of each other's rows (one ``sendrecv`` of a [128, Hc*D] bf16 tile
per 128 tokens, 1 KB per partition), so each core projects its own groups' rows over all the rank's heads (its own
heads' blocks in one PSUM bank, the other core's in a second, added in fp32: the stage's ``mine + peer``), then
one SBUF collective per group over the ranks, the residual add, the stores and the norm (:func:`_finish_fused`).
The fp32 partials (2 x 32 MB per rank at 4K) never reach HBM, and the launch of the stage goes. The o_proj weight
is read by both cores (4 MB more per rank). Swapping the fp32 partial tiles instead (8 KB per partition per 128
tokens, each core keeping its own heads' Wo) would move 8x the bytes and need four 8 KB swap tiles in place of the
other heads' Wo (16 KB) and three og^T tiles: ~13 KB more SBUF than this form, which peaks at 195.7 of nkisim's
208 KiB per partition at 4K (the planner's bound, :func:`sbuf_bytes`, 197).

Work split (LNC)
----------------
Core c of ``n_cores`` owns query heads [c*Hc, (c+1)*Hc) (Hc = Hq_r / n_cores: 2 of 4) for EVERY token. With
heads split, both cores walk exactly the same (query tile, key block) grid, so their runtime control flow is
identical by construction and the causal work is balanced without any pairing of query tiles (a query-tile
split would give the two cores different key-loop trip counts). The KV head is projected once: core 0 computes
k (norm + RoPE) and writes the K rows, the last core computes v and writes the V rows; per 128-token tile the
cores swap k and v (token-major ``[128, D]`` tiles, one ``sendrecv``), so each core holds the chunk's K^T and V.
Each core reads the earlier chunks' cache rows itself (2x per rank; the kernel is PE-bound, not HBM-bound).

Tiling
------
Tokens on partitions in 128-row query tiles (the last tile zero-padded; pad rows are computed and discarded),
head dim as DT = D/128 contraction tiles: QK^T is split-K over the d-tiles into one PSUM bank, PV uses P^T
(keys on partitions) stationary against V rows with an extra ones column (PV also yields the row sums l).
Keys come in KEY BLOCKS of ``key_block`` (KB, default 1024) keys, each made of score segments of <= 512 keys (one
PSUM bank of fp32 scores); PV accumulates over the block's 128-key tiles in one PSUM bank, and the softmax state
(``[O | l]`` fp32 in SBUF) is updated once per block. Per query tile g (chunk keys 0..128g+127):

1. the DIAGONAL block: chunk keys [KB*floor(128g/KB), 128(g+1)) -- its last 128 keys are the tile's own
   (static causal mask), so every row has a visible key in it: its own;
2. the CONTEXT blocks (cache rows 0..start-1, runtime loop): with r = start mod KB, a head block of rows [0, KB)
   masked at >= r (iff r > 0; rows >= r zeroed in SBUF, NaN-safe), then full blocks [r + jKB, r + (j+1)KB) ending
   at start. Each block is loaded and transposed ONCE and attended by every query tile of the chunk (context
   loop outside, query tiles inside), so earlier chunks are read once per core per chunk;
3. the chunk blocks [jKB, (j+1)KB) before the diagonal block (static, from SBUF).

Static anchor (kernel-algorithms §3.4, §5.1)
--------------------------------------------
Each row's anchor m0 is the scaled max of its first block, the diagonal block. That block always holds the row's
own key, so the anchor is a real score and a fully masked first block (kernel-algorithms §3.4: sliding windows,
left padding) cannot occur; masked keys of the block (NEG added) never reach the max. Afterwards
P = exp(scale*s - m0) straight out of PSUM -- no running max, no per-block rescale of O. After each block, per
row: ``ok = (l + l_block <= e^tau) and live``; the block is committed (O, l += PV) only where ok
(``tensor_copy_predicated``: an overflowing block's inf/NaN never reaches the state), and a row that fails
FREEZES: its state stays the saved (l, o) before the failing block, ``cnt`` (committed blocks) marks where. NaN
fails the check (``not (l <= e^tau)``). tau = 88.7 - ln L - ln Vmax - delta (Vmax = 2^12, delta = 2 nats, L the
cache length, an upper bound on the keys of any row; tau < 20 is refused): while l <= e^tau, P <= e^tau and
|O| <= l * Vmax stay far from the fp32 (and bf16) range.

Replay: after the static pass the frozen rows are counted on-chip (PE ones-matmul), summed over both cores
(``sendrecv``) and loaded into a register; a 0/1-trip ``nl.fori_loop`` on that register runs the REPLAY on both
cores (identical control flow). The replay walks the same blocks in the same order with standard online
rescaling (block max, m' = max(m, m_block), alpha = exp(m - m'), O = alpha*O + PV) and commits only where
``frozen and block >= cnt``: each frozen row resumes exactly from its saved (l, o) at its failing block; all
other rows are untouched (bit for bit). One uniform branch per call, after the static pass, keeps the static
pass free of runtime branches (a branch stalls every in-order engine queue until its register is known); the
per-block checks themselves are branch-free DVE ops.

Non-finite input (NaN/Inf in x, the weights or the visible cache rows) reaches O or l; after the replay every
row's sum of [O | l] is tested finite (|sum| <= FLT_MAX, false for NaN) and the count of non-finite rows is in
``stats[2]``; the host helper raises ``FloatingPointError`` when it is non-zero (the output is not sanitised).
A NaN in one token's hidden state spreads over its whole 128-token tile (the PE transposes are identity matmuls
and NaN * 0 = NaN) and, through its key, to every later row: all of them are reported, earlier tiles stay clean.

Chunk-by-chunk prefill
----------------------
A prompt may be prefilled in several calls (the second at start = N1, and so on); what is tested: the rows
before the split are always bit-identical to one call (they never see later keys; masked keys add exact zeros).
At a split that is a multiple of 128 the KV rows are bit-identical too (every token sits at the same row of the
same-shaped tile). At a multiple of KB every output is bit-identical as well: the second call's context blocks
are then exactly the single call's chunk blocks (same keys, 128-key tiles and order -- diagonal, then ascending),
the anchor is the same diagonal block, and every instruction sees identical operands. Elsewhere the later
chunk's block boundaries differ from one call's and its outputs agree to fp32 summation-order rounding (bf16:
the kernel's bf16 tolerance; P is rounded per block).

Shape-only tracing (``static_start``)
-------------------------------------
nkisim's shape-only mode reads registers as 0, so runtime loops run 0 times. ``static_start = S`` unrolls the
context loop for S (the head block iff S mod KB > 0, S // KB full blocks; offsets still from the run-time r), so
a shape-only trace costs a chunk at start S; the kernel is then valid for every start with the same S // KB and
(S mod KB > 0). The replay is not traced in shape-only mode (its flag register reads 0): the prediction is the
no-replay path, which is what realistic inputs take (kernel-algorithms §3.5).
"""

from __future__ import annotations

import math

import numpy as np

import nki
import nki.isa as nisa
import nki.language as nl
import nki.collectives as ncc
from nki_kernels.common import INT32_MAX, MOVING_MAX, P, PSUM_BANK, program_sharding
from nki_kernels.rmsnorm_prefill import (allreduce_groups, broadcast_weight, norm_output, residual_add_rows,
                                         residual_norm_emit, residual_norm_store, residual_norm_xT, rmsnorm_scale_tile,
                                         rmsnorm_weight_tile, token_group_ap)
from nki_kernels.attention import attention_layout, rope_tables, xT_layout  # noqa: F401  (the shared layout)

SEG = MOVING_MAX        # keys per score segment: one PSUM bank of fp32 scores (gemm_moving_fmax)
PSUM_COLS = PSUM_BANK   # fp32 columns of one PSUM bank
KEY_BLOCK = 1024        # keys per softmax-state update (and per context-loop iteration)
NEG = -1.0e30           # additive mask: finite, exp(scale*NEG - m) == 0 exactly
LN_FP32_MAX = 88.7      # ln(fp32 max) = 88.72
V_MAX = 4096.0          # |V| bound of the tau analysis (2^12)
TAU_DELTA = 2.0         # safety margin (nats)
TAU_MIN = 20.0          # configurations with less headroom are refused
FP32_FINITE = 3.0e38    # |x| <= this: finite (fp32 max 3.4028e38)
SBUF_BUDGET = 200 * 1024    # bytes per partition the kernel plans for (nkisim.hw: 212,984 usable)
REGISTER_NAMES = ("start", "rem", "head", "replay")
PREFILL_REGISTERS = len(REGISTER_NAMES)
F32 = nl.float32
U8 = nl.uint8
U32 = nl.uint32
I32 = nl.int32
ACT_ENG = nisa.engine.scalar
DVE_ENG = nisa.engine.vector
POOL_ENG = nisa.engine.gpsimd


# ---- geometry ------------------------------------------------------------------------------------
def static_tau(cache_len: int) -> float:
    """tau (nats) for a cache of ``cache_len`` rows: 88.7 - ln L - ln Vmax - delta (kernel-algorithms §3.4)."""
    return LN_FP32_MAX - math.log(cache_len) - math.log(V_MAX) - TAU_DELTA


def sbuf_bytes(N: int, D: int, H: int, heads: int, act_bytes: int, key_block: int = KEY_BLOCK,
               k_and_v: bool = False, fused: str | None = None) -> int:
    """Planned SBUF bytes per partition of one core: the chunk-resident q^T, K^T, V (and, after the
    projections, the softmax state) grow with N; on top of them the larger of the projection phase (weights,
    xT ring, norm temporaries) and the attention + o_proj phase (work ring, context block, o_proj weight and
    buffers). ``k_and_v``: this core projects both k and v (LNC=1). ``fused``: None, or the ``norm_out`` of the
    epilogue fused with the all-reduce (:func:`_finish_fused`; q^T / K^T / V are released before it). Checked
    against nkisim's allocator peaks (tests/nki_kernels/test_attention_prefill.py): an upper bound within ~10%."""
    NT = -(-N // P)
    KT = H // P
    dp = min(D, P)
    DT = D // dp
    ab = act_bytes
    nb = key_block // P
    nh = heads + 1
    resident = NT * (heads * DT * P * ab + DT * P * ab + (D + 1) * ab)
    state = NT * heads * ((D + 1) * 4 + 12)
    proj = (KT * (2 * heads * D + (2 if k_and_v else 1) * D) * ab + 3 * KT * P * ab
            + nh * D * (2 * ab + 8) + heads * D * ab + 2 * D * ab + 4 * 64 * 4 + P * 4 * 2)
    ring = 2 * (key_block * ab + nb * P * ab + SEG * 4 + (D + 1) * 4 + 32)
    context = nb * (2 * D + 1) * ab + DT * key_block * ab + key_block * 4 + nb * 5
    wo = heads * DT * H * ab
    final = 2 * H * 4 + 2 * heads * D * (2 * ab + 4) + 3 * heads * D * ab + 2 * heads * DT * P * ab
    extra = 2 * P * 4 + 5 * 1024 + (2048 if k_and_v else 0)
    if fused == None:
        return resident + max(proj, state + ring + context + wo, state + wo + final) + extra
    cores = 1 if k_and_v else 2
    F = allreduce_groups(N, H)[0][2] * H                 # one group's columns
    fin = (cores * wo + 3 * F * 4 + 2 * F * ab + H * 4                     # o_proj weights, 2 y + total, 2 residual,
           + (F * ab if fused == "xT" else 0)                              # norm weight; the group's xT
           + (cores * F // H + 2) * heads * D * ab + 2 * heads * D * (ab + 4)  # og, o, sg
           + (3 * F // H + 1) * heads * DT * P * ab + 3 * heads * D * ab)     # og^T, received og^T; gate ring
    return max(resident + max(proj, state + ring + context + wo), state + fin) + extra


def _geometry(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, n_cores, key_block, fused=None):
    """Validate the arguments; return the dimensions (plain ints / floats) as a dict."""
    nm = "attention_prefill"
    if len(xT.shape) != 3 or xT.shape[0] != P:
        raise ValueError(f"{nm}: xT has shape {list(xT.shape)}, expected feature-major [P={P}, H/P, N]")
    _, KT, N = xT.shape
    H = KT * P
    if N < 1:
        raise ValueError(f"{nm}: the chunk has {N} tokens")
    if len(wqg.shape) != 4 or wqg.shape[0] != H or wqg.shape[1] != 2:
        raise ValueError(f"{nm}: wqg has shape {list(wqg.shape)}, expected [H={H}, 2, Hq_r, D] (attention_layout)")
    _, _, Hq, D = wqg.shape
    if D > 2 * P or (D > P and D % P):
        raise ValueError(f"{nm}: head dim {D} must be <= {P} or {2 * P} (d-tiles on partitions; query|gate of a "
                         f"head in one PSUM bank)")
    if n_cores not in (1, 2) or Hq % n_cores:
        raise ValueError(f"{nm}: {Hq} query heads do not split over {n_cores} cores")
    for nmw_t in (("wk", wk), ("wv", wv)):
        nmw, t = nmw_t
        if tuple(t.shape) != (H, D):
            raise ValueError(f"{nm}: {nmw} has shape {list(t.shape)}, expected [H={H}, D={D}]")
    if tuple(wo.shape) != (Hq * D, H):
        raise ValueError(f"{nm}: wo has shape {list(wo.shape)}, expected [Hq_r*D={Hq * D}, H={H}]")
    if tuple(norm_w.shape) != (2, D) or norm_w.dtype != F32:
        raise ValueError(f"{nm}: norm_w must be float32 [2, D={D}] (1 + q_norm, 1 + k_norm), got "
                         f"{norm_w.dtype}{list(norm_w.shape)}")
    if len(cos.shape) != 2:
        raise ValueError(f"{nm}: cos has shape {list(cos.shape)}, expected [N={N}, R]")
    R = cos.shape[1]
    for nmt_t in (("cos", cos), ("sin", sin)):
        nmt, t = nmt_t
        if tuple(t.shape) != (N, R) or t.dtype != F32:
            raise ValueError(f"{nm}: {nmt} must be float32 [N={N}, R] (rope tables by position), got "
                             f"{t.dtype}{list(t.shape)}")
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"{nm}: rotary dims {R} must be even and <= head dim {D}")
    for nmc_c in (("k_cache", k_cache), ("v_cache", v_cache)):
        nmc, c = nmc_c
        if len(c.shape) != 3 or c.shape[0] != 1 or c.shape[2] != D:
            raise ValueError(f"{nm}: {nmc} has shape {list(c.shape)}, expected [1, L, D={D}] (one KV head per rank)")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"{nm}: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    act = xT.dtype
    if act not in (nl.bfloat16, F32):
        raise TypeError(f"{nm}: activation dtype must be bfloat16 or float32, got {act}")
    for nmt_t in (("wqg", wqg), ("wk", wk), ("wv", wv), ("wo", wo), ("k_cache", k_cache), ("v_cache", v_cache)):
        nmt, t = nmt_t
        if t.dtype != act:
            raise TypeError(f"{nm}: {nmt} dtype {t.dtype} differs from the activation dtype {act}")
    if tuple(start.shape) not in ((1, 1), (1,)) or start.dtype != I32:
        raise ValueError(f"{nm}: start must be an int32 [1, 1] tensor, got {start.dtype}{list(start.shape)}")
    KB = key_block
    if KB < P or KB & (KB - 1) or KB > 4 * SEG:
        raise ValueError(f"{nm}: key_block {KB} must be a power of two in [{P}, {4 * SEG}]")
    L = k_cache.shape[1]
    if L < KB:
        raise ValueError(f"{nm}: cache length {L} is shorter than one key block ({KB}); use a smaller key_block")
    if L < N:
        raise ValueError(f"{nm}: a chunk of {N} tokens does not fit a cache of {L} rows")
    if L * D > INT32_MAX:
        raise ValueError(f"{nm}: cache of {L} x {D} elements: element offsets exceed int32")
    tau = static_tau(L)
    if tau < TAU_MIN:
        raise ValueError(f"{nm}: tau = {tau:.1f} nats for a cache of {L} rows is below {TAU_MIN}: the static anchor "
                         f"has too little headroom")
    Hc = Hq // n_cores
    abytes = 2 if act == nl.bfloat16 else 4
    kv2 = n_cores == 1
    need = sbuf_bytes(N, D, H, Hc, abytes, KB, kv2, fused)
    if need > SBUF_BUDGET:
        if sbuf_bytes(P, D, H, Hc, abytes, KB, kv2, fused) > SBUF_BUDGET:
            raise ValueError(f"{nm}: {Hc} query heads of dim {D} in {act} do not fit SBUF on one core even for a "
                             f"128-token chunk (~{sbuf_bytes(P, D, H, Hc, abytes, KB, kv2, fused) // 1024} KiB per "
                             f"partition, budget {SBUF_BUDGET // 1024} KiB): launch with LNC=2 or in bfloat16")
        n_max = P
        while sbuf_bytes(n_max + P, D, H, Hc, abytes, KB, kv2, fused) <= SBUF_BUDGET:
            n_max += P
        raise ValueError(f"{nm}: a chunk of {N} tokens needs ~{need // 1024} KiB of SBUF per partition on each of "
                         f"{n_cores} core(s) (budget {SBUF_BUDGET // 1024} KiB); prefill in chunks of at most "
                         f"{n_max} tokens")
    dp = min(D, P)
    NT = -(-N // P)
    return dict(N=N, NT=NT, Npad=NT * P, KT=KT, H=H, Hq=Hq, Hc=Hc, D=D, dp=dp, DT=D // dp, R=R, L=L, KB=KB,
                NB=KB // P, NI=NT * Hc, act=act, sc=float(D) ** -0.5, e_tau=float(math.exp(tau)), tau=tau)


def _segments(width, mask=None, mask0=0):
    """Score segments (col, width, mask view or None) covering ``width`` keys of a block, <= SEG each;
    ``mask`` (act [P, >= width], 0 or NEG) is sliced per segment from column mask0."""
    segs = []
    c = 0
    while c < width:
        w = min(SEG, width - c)
        m = None if mask == None else mask[:, mask0 + c:mask0 + c + w]
        segs.append((c, w, m))
        c += w
    return segs


# ---- body ----------------------------------------------------------------------------------------
def attention_prefill_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, out, eps=1e-6,
                           core=0, n_cores=1, key_block=KEY_BLOCK, static_start=None, regs=None, fuse=None):
    """Body: this core's gated-attention partial for an N-token chunk (module docstring for every layout).

    xT: HBM ``[P, H/P, N]`` act (normed hidden, feature-major). wqg, wk, wv, wo, norm_w: HBM, the rank's weights
    (``attention_layout``). cos, sin: HBM ``[N, R]`` float32 (positions start..start+N-1). k_cache, v_cache: HBM
    ``[1, L, D]`` (rows start..start+N-1 written in place, rows 0..start-1 read). start: HBM ``[1, 1]`` int32
    (run time). out: HBM ``[N, H]`` float32, written with this core's o_proj partial. eps: rms_norm_eps.
    core / n_cores: this core and the LNC degree (compile time). key_block: keys per softmax-state update.
    static_start: compile-time specialisation of the context loop for shape-only traces (None = general).
    regs: optional tuple of ``PREFILL_REGISTERS`` VirtualRegisters to reuse (each call reloads them).
    fuse: None, or the fused next step (:func:`attention_prefill_kernel` builds it; ``out`` is then None): dict
    with the residual ``x [N, H]`` HBM, ``rg`` (the TP ReplicaGroup or None), ``out`` (new residual, HBM) /
    ``norm_t`` / ``norm_out`` / ``w`` (next norm's weight row or None) / ``eps`` (:func:`_finish_fused`).
    Returns ``stats`` SBUF ``[1, 3]`` float32: (rows frozen in the static pass, replay ran, non-finite rows).
    """
    g = _geometry(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, n_cores, key_block,
                  None if fuse == None else fuse["norm_out"])
    if not 0 <= core < n_cores:
        raise ValueError(f"attention_prefill: core {core} outside 0..{n_cores - 1}")
    if fuse == None and (tuple(out.shape) != (g["N"], g["H"]) or out.dtype != F32):
        raise ValueError(f"attention_prefill: out must be float32 [N={g['N']}, H={g['H']}], got "
                         f"{out.dtype}{list(out.shape)}")
    g["core"] = core
    g["n_cores"] = n_cores
    g["do_k"] = core == 0
    g["do_v"] = core == n_cores - 1
    act = g["act"]

    # ScalarE runs only exp and table-free copies here: load the exp table while the weights stream
    warm = nl.ndarray((1, 1), F32, buffer=nl.sbuf, name="pf_act_warm")
    nisa.memset(dst=warm, value=0.0, engine=POOL_ENG)
    nisa.activation(dst=warm, op=nl.exp, data=warm)
    ident = nl.shared_identity_matrix(P, dtype=act)
    rt = _runtime_scalars(g, start, regs)
    st = _resident_state(g)
    st["ident"] = ident
    g["ident"] = ident
    _project_tiles(g, st, xT, wqg, wk, wv, norm_w, cos, sin, k_cache, v_cache, rt, eps)
    _softmax_state(g, st)
    wo_sb = _load_wo(g, wo, "own")
    _attend(g, st, k_cache, v_cache, rt, "static", static_start)
    stats = nl.ndarray((1, 3), F32, buffer=nl.sbuf, name="pf_stats")
    _replay_if_needed(g, st, k_cache, v_cache, rt, stats, static_start)
    # the attention work tiles and the chunk's q^T / K^T / V are dead: their SBUF goes to the o_proj phase
    st["ring"] = None
    st["qT"] = None
    st["kT"] = None
    st["v"] = None
    if fuse == None:
        _finish(g, st, wo_sb, out, stats)
    else:
        _finish_fused(g, st, wo_sb, wo, fuse, stats)
    return stats


# ---- run-time scalars ------------------------------------------------------------------------------
def _runtime_scalars(g, start, regs):
    """start on-chip (int32, every partition), r = start mod KB (``rem_f`` fp32 column for the head-block
    masks), has_head = (r > 0), nctx = has_head + start // KB (context blocks, fp32 column, for the replay's
    block numbering), and the registers: start (cache write offset, full-loop end), rem (full-loop start),
    head (0/1 trips), replay (set later)."""
    KB = g["KB"]
    s_i = nl.ndarray((P, 1), I32, buffer=nl.sbuf, name="pf_start")
    nisa.dma_copy(dst=s_i, src=start.ap(pattern=[[0, P], [1, 1]], offset=0))
    rem_i = nl.ndarray((P, 1), I32, buffer=nl.sbuf, name="pf_rem")
    nisa.tensor_scalar(dst=rem_i, data=s_i, op0=nl.bitwise_and, operand0=KB - 1)
    rem_f = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_rem_f")
    nisa.tensor_copy(dst=rem_f, src=rem_i)
    head_f = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_has_head_f")
    nisa.tensor_scalar(dst=head_f, data=rem_f, op0=nl.greater, operand0=0.0)
    head_i = nl.ndarray((1, 1), I32, buffer=nl.sbuf, name="pf_has_head")
    nisa.tensor_copy(dst=head_i, src=head_f[0:1, :])
    full_i = nl.ndarray((P, 1), I32, buffer=nl.sbuf, name="pf_nfull")
    nisa.tensor_scalar(dst=full_i, data=s_i, op0=nl.right_shift, operand0=KB.bit_length() - 1)
    nctx = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_nctx")
    nisa.tensor_tensor(dst=nctx, data1=full_i, data2=head_f, op=nl.add, engine=DVE_ENG)
    if regs != None and len(regs) < len(REGISTER_NAMES):
        raise ValueError(f"attention_prefill: {len(regs)} registers given, the body needs {len(REGISTER_NAMES)}")
    rt = {"rem_f": rem_f, "nctx": nctx}
    vals = {"start": s_i[0:1, :], "rem": rem_i[0:1, :], "head": head_i}
    for i in range(len(REGISTER_NAMES)):
        k = REGISTER_NAMES[i]
        rt[k] = nisa.register_alloc() if regs == None else regs[i]
        if k in vals:
            nisa.register_load(rt[k], vals[k])
    return rt


# ---- chunk-resident state ----------------------------------------------------------------------------
def _resident_state(g):
    """Tensors that live for the whole call: q^T ``[dp, NI, DT, P]`` act (item i = tile*Hc + head), the chunk's
    K^T ``[dp, DT, Npad]`` and V ``[P, NT, D+1]`` act (last column 1), the causal mask of a diagonal tile, and
    the raw gate ``[NT, P, Hc, D]`` act parked in private HBM until the o_proj phase."""
    act, D, dp, DT, NI, NT, Npad = g["act"], g["D"], g["dp"], g["DT"], g["NI"], g["NT"], g["Npad"]
    st = {}
    st["qT"] = nl.ndarray((dp, NI, DT, P), act, buffer=nl.sbuf, name="pf_qT")
    st["gate"] = nl.ndarray((NT, P, g["Hc"], D), act, buffer=nl.hbm, name="pf_gate_scratch")   # private HBM
    st["kT"] = nl.ndarray((dp, DT, Npad), act, buffer=nl.sbuf, name="pf_kT")
    st["v"] = nl.ndarray((P, NT, D + 1), act, buffer=nl.sbuf, name="pf_v")
    nisa.memset(dst=st["v"][:, :, D:D + 1], value=1.0, engine=POOL_ENG)
    tri = nl.ndarray((P, P), act, buffer=nl.sbuf, name="pf_causal")     # key k visible to row t iff k <= t
    zero = nl.ndarray((P, P), act, buffer=nl.sbuf, name="pf_zero")
    nisa.memset(dst=zero, value=0.0, engine=POOL_ENG)
    nisa.affine_select(dst=tri, pattern=[[-1, P]], channel_multiplier=1, on_true_tile=zero, on_false_value=NEG,
                       cmp_op=nl.greater_equal, offset=0)
    st["tri"] = tri
    return st


def _softmax_state(g, st):
    """The softmax state, allocated after the projections (their weights' SBUF is free by then): ``[O | l]``
    ``[P, NI, D+1]`` fp32, nm (-anchor, scaled) fp32, live (1 = not frozen) / cnt (committed blocks) int32
    ``[P, NI]``; and the unit pipeline's work tiles."""
    D, NI = g["D"], g["NI"]
    st["ol"] = nl.ndarray((P, NI, D + 1), F32, buffer=nl.sbuf, name="pf_ol")
    Hc = g["Hc"]
    for t in range(g["NT"]):     # per tile, so the first tiles' updates need not wait for the whole memset
        nisa.memset(dst=st["ol"][:, t * Hc:(t + 1) * Hc, :], value=0.0, engine=POOL_ENG)
    st["nm"] = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_negmax")
    st["live"] = nl.ndarray((P, NI), I32, buffer=nl.sbuf, name="pf_live")
    nisa.memset(dst=st["live"], value=1, engine=POOL_ENG)
    st["cnt"] = nl.ndarray((P, NI), I32, buffer=nl.sbuf, name="pf_committed")
    nisa.memset(dst=st["cnt"], value=0, engine=POOL_ENG)
    st["ring"] = _sbuf_ring(g)


# ---- phase 1: projections, norms, RoPE, K/V rows -----------------------------------------------------
def _project_tiles(g, st, xT, wqg, wk, wv, norm_w, cos, sin, k_cache, v_cache, rt, eps):
    """Per 128-token tile: q|gate (this core's heads) and k or v projections (tokens on PSUM partitions,
    weights moving), RMSNorm + RoPE of q (and k), q^T into st, gate into st, the k/v swap between the cores,
    K^T / V into st and the K / V cache rows. The weights are SBUF-resident for this phase only (freed on
    return); the projection of tile t+1 is issued before tile t's post-processing so the PE stays busy."""
    act, KT, Hc, Hq, D, NT = g["act"], g["KT"], g["Hc"], g["Hq"], g["D"], g["NT"]
    h0 = g["core"] * Hc
    row = 2 * Hq * D
    w = {}
    w["q"] = nl.ndarray((P, KT, 2, Hc, D), act, buffer=nl.sbuf, name="pf_wqg")
    kv = []
    for nmw_on_src in (("k", g["do_k"], wk), ("v", g["do_v"], wv)):
        nmw, on, src = nmw_on_src
        if on:
            w[nmw] = nl.ndarray((P, KT, D), act, buffer=nl.sbuf, name=f"pf_w{nmw}")
            kv.append((w[nmw], src))
    for j in range(KT):       # per input tile, in the order the matmuls consume them
        nisa.dma_copy(dst=w["q"][:, j], src=wqg.ap(pattern=[[row, P], [Hq * D, 2], [1, Hc * D]],
                                                    offset=j * P * row + h0 * D))
        for dst_src in kv:
            dst, src = dst_src
            nisa.dma_copy(dst=dst[:, j], src=src[j * P:(j + 1) * P, :])
    nh = Hc + (1 if g["do_k"] else 0)           # rows of the norm tile: this core's heads (+ k on core 0)
    nw = nl.ndarray((P, nh, D), F32, buffer=nl.sbuf, name="pf_norm_w")
    nisa.dma_copy(dst=nw[:, 0:Hc, :], src=norm_w.ap(pattern=[[0, P], [0, Hc], [1, D]], offset=0))
    if g["do_k"]:
        nisa.dma_copy(dst=nw[:, Hc, :], src=norm_w.ap(pattern=[[0, P], [1, D]], offset=D))
    w["norm"] = nw
    _transpose_psum(g, w)
    XR = 3                                       # xT tiles in flight: a load is issued 3 tiles ahead
    xs = []
    for i in range(min(XR, NT)):
        xs.append(nl.ndarray((P, KT, P), act, buffer=nl.sbuf, name=f"pf_xT_tile{i}"))
        _load_x(g, xs, xT, i)
    # two tiles' projections in flight (+ 2 banks of transposes) must fit the 8 PSUM banks; else one at a time
    banks = Hc + (1 if g["do_k"] else 0) + (1 if g["do_v"] else 0)
    ahead = 2 * banks + 2 <= 8
    ps = _project(g, w, xs[0])
    for t in range(NT):
        nxt = None
        if ahead and t + 1 < NT:
            nxt = _project(g, w, xs[(t + 1) % XR])
        if t + XR < NT:                          # tile t's slot is free once its projection is issued
            _load_x(g, xs, xT, t + XR)
        _post_projection(g, st, w, ps, t, cos, sin, k_cache, v_cache, rt, eps)
        ps = None                                # tile t's banks are free (evicted)
        if not ahead and t + 1 < NT:
            nxt = _project(g, w, xs[(t + 1) % XR])
        ps = nxt


def _load_x(g, xs, xT, t):
    """Tile t's columns of xT into ring slot t % len(xs) (the pad columns of a partial last tile zeroed first)."""
    nt = min(P, g["N"] - t * P)
    x = xs[t % len(xs)]
    if nt < P:
        nisa.memset(dst=x[:, :, nt:P], value=0.0, engine=POOL_ENG)
    nisa.dma_copy(dst=x[:, :, 0:nt], src=xT[:, :, t * P:t * P + nt])


def _project(g, w, x):
    """One tile's projections into PSUM (fp32): per head [P tokens, 2, D] (query | gate), and k / v [P, D]
    where this core projects them. Returns the PSUM tiles (dict)."""
    KT, Hc, D = g["KT"], g["Hc"], g["D"]
    ps = {"qg": []}
    for h in range(Hc):             # one bank each (2D <= 512 fp32 columns)
        bank = nl.ndarray((P, 2, PSUM_COLS // 2), F32, buffer=nl.psum, name=f"pf_qg_psum{h}")
        ps["qg"].append(bank[:, :, 0:D])
    for nmw_on in (("k", g["do_k"]), ("v", g["do_v"])):
        nmw, on = nmw_on
        if on:
            bank = nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name=f"pf_{nmw}_psum")
            ps[nmw] = bank[:, 0:D]
    for j in range(KT):
        for h in range(Hc):
            nisa.nc_matmul(dst=ps["qg"][h], stationary=x[:, j, :], moving=w["q"][:, j, :, h, :], accumulate=j > 0)
        for nmw in ("k", "v"):
            if nmw in ps:
                nisa.nc_matmul(dst=ps[nmw], stationary=x[:, j, :], moving=w[nmw][:, j, :], accumulate=j > 0)
    return ps


def _post_projection(g, st, w, ps, t, cos, sin, k_cache, v_cache, rt, eps):
    """Evict tile t's projections (rounded to the activation dtype), RMSNorm + RoPE, transposes, k/v swap,
    cache rows."""
    act, Hc, D, N, c = g["act"], g["Hc"], g["D"], g["N"], g["core"]
    nt = min(P, N - t * P)
    nh = Hc + (1 if g["do_k"] else 0)
    qk = nl.ndarray((P, nh, D), act, buffer=nl.sbuf, name="pf_qk_raw")
    gt = nl.ndarray((P, Hc, D), act, buffer=nl.sbuf, name="pf_gate_tile")
    for h in range(Hc):
        nisa.tensor_copy(dst=qk[:, h, :], src=ps["qg"][h][:, 0, :], engine=ACT_ENG)
        nisa.tensor_copy(dst=gt[:, h, :], src=ps["qg"][h][:, 1, :], engine=DVE_ENG)
    nisa.dma_copy(dst=st["gate"][t], src=gt)     # parked in HBM until the o_proj phase (saves SBUF)
    if g["do_k"]:
        nisa.tensor_copy(dst=qk[:, Hc, :], src=ps["k"], engine=ACT_ENG)
    vt = None
    if g["do_v"]:
        vt = nl.ndarray((P, D), act, buffer=nl.sbuf, name="pf_v_tok")
        nisa.tensor_copy(dst=vt, src=ps["v"], engine=DVE_ENG)
    qn = _norm_rope(g, w, qk, nh, t, cos, sin, eps)

    # q^T per (head, d-tile): PE transposes (matmul against the identity; exact), fp32 PSUM
    for h in range(Hc):
        _transpose_rows(g, qn[:, h, :], st["qT"][:, t * Hc + h], _next_tp(w), ACT_ENG if h % 2 else DVE_ENG)

    # the KV head's token-major rows: core 0 has k, the last core v; with LNC=2 swap them (whole tiles)
    ktok = None
    if g["do_k"]:
        ktok = nl.ndarray((P, D), act, buffer=nl.sbuf, name="pf_k_tok")
        nisa.tensor_copy(dst=ktok, src=qn[:, Hc, :], engine=POOL_ENG)
    if g["n_cores"] == 2:
        recv = nl.ndarray((P, D), act, buffer=nl.sbuf, name="pf_kv_recv")
        send = ktok if c == 0 else vt
        nisa.sendrecv(src=send, dst=recv, send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=0)
        if c == 0:
            vt = recv
        else:
            ktok = recv
    _transpose_rows(g, ktok, st["kT"][:, :, t * P:(t + 1) * P], _next_tp(w), ACT_ENG)
    nisa.tensor_copy(dst=st["v"][:, t, 0:D], src=vt, engine=POOL_ENG)

    # cache rows start + tP .. start + tP + nt - 1 (each written once per rank: K by core 0, V by the last core)
    rows = [[D, nt], [1, D]]
    if g["do_k"]:
        nisa.dma_copy(dst=k_cache.ap(pattern=rows, offset=t * P * D, scalar_offset=rt["start"], indirect_dim=1),
                      src=ktok[0:nt, :])
    if g["do_v"]:
        nisa.dma_copy(dst=v_cache.ap(pattern=rows, offset=t * P * D, scalar_offset=rt["start"], indirect_dim=1),
                      src=vt[0:nt, :])


def _transpose_psum(g, owner):
    """Two fp32 PSUM tiles [dp, DT, P] for :func:`_transpose_rows`, used alternately (owner["tp"])."""
    owner["tp"] = []
    owner["ntp"] = 0
    for k in range(2):
        owner["tp"].append(nl.ndarray((g["dp"], g["DT"], P), F32, buffer=nl.psum, name=f"pf_rowsT_psum{k}"))


def _next_tp(owner):
    n = owner["ntp"]
    owner["ntp"] = n + 1
    return owner["tp"][n % 2]


def _transpose_rows(g, x, dst, ps, engine):
    """x [P tokens, D] act -> dst [dp, DT, P tokens] act (d on partitions): DT PE transposes (matmul against
    the identity, exact) into the fp32 PSUM tile ps [dp, DT, P] (<= 1 KiB per partition), one eviction."""
    dp, DT, ident = g["dp"], g["DT"], g["ident"]
    for dt in range(DT):
        nisa.nc_matmul(dst=ps[:, dt, :], stationary=x[:, dt * dp:(dt + 1) * dp], moving=ident, accumulate=False)
    nisa.tensor_copy(dst=dst, src=ps, engine=engine)


def _norm_rope(g, w, qk, nh, t, cos, sin, eps):
    """Zero-centred RMSNorm (fp32, weight 1 + w) then rotate-half RoPE on dims [0, R) of the nh rows per token
    (heads on the free axis); each step rounds to the activation dtype like model.functional."""
    act, D, R, N = g["act"], g["D"], g["R"], g["N"]
    nt = min(P, N - t * P)
    sq = nl.ndarray((P, nh, D), F32, buffer=nl.sbuf, name="pf_sq")
    nisa.tensor_tensor(dst=sq, data1=qk, data2=qk, op=nl.multiply)
    ss = nl.ndarray((P, nh), F32, buffer=nl.sbuf, name="pf_sumsq")
    nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=2)
    rstd = nl.ndarray((P, nh), F32, buffer=nl.sbuf, name="pf_rstd")
    nisa.tensor_scalar(dst=rstd, data=ss, op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=float(eps))
    nisa.tensor_scalar(dst=rstd, data=rstd, op0=nl.rsqrt, operand0=None, engine=POOL_ENG)   # precise, no ACT table
    y = nl.ndarray((P, nh, D), F32, buffer=nl.sbuf, name="pf_normed_f32")
    nisa.tensor_tensor(dst=y, data1=qk, data2=rstd.ap(pattern=[[nh, P], [1, nh], [0, D]], offset=0), op=nl.multiply)
    qn = nl.ndarray((P, nh, D), act, buffer=nl.sbuf, name="pf_qk")
    nisa.tensor_tensor(dst=qn, data1=y, data2=w["norm"], op=nl.multiply)
    # rope tables of the tile's positions (pad rows zero); the sin table's first half negated:
    # out = x*cos + [x2, x1]*[-sin_lo, sin_hi], [x2, x1] a view of x with its two halves swapped
    cs = nl.ndarray((P, 2, R), F32, buffer=nl.sbuf, name="pf_cos_sin")
    if nt < P:
        nisa.memset(dst=cs, value=0.0, engine=POOL_ENG)
    nisa.dma_copy(dst=cs[0:nt, 0, :], src=cos[t * P:t * P + nt, :])
    nisa.dma_copy(dst=cs[0:nt, 1, :], src=sin[t * P:t * P + nt, :])
    hr = R // 2
    nisa.tensor_scalar(dst=cs[:, 1, 0:hr], data=cs[:, 1, 0:hr], op0=nl.multiply, operand0=-1.0)
    cvw = cs.ap(pattern=[[2 * R, P], [0, nh], [1, R]], offset=0)
    svw = cs.ap(pattern=[[2 * R, P], [0, nh], [1, R]], offset=R)
    cpart = nl.ndarray((P, nh, R), F32, buffer=nl.sbuf, name="pf_rope_c")
    nisa.tensor_tensor(dst=cpart, data1=qn[:, :, 0:R], data2=cvw, op=nl.multiply)
    upart = nl.ndarray((P, nh, R), F32, buffer=nl.sbuf, name="pf_rope_u")
    swapped = qn.ap(pattern=[[nh * D, P], [D, nh], [-hr, 2], [1, hr]], offset=hr)
    nisa.tensor_tensor(dst=upart, data1=swapped, data2=svw, op=nl.multiply)
    nisa.tensor_tensor(dst=qn[:, :, 0:R], data1=cpart, data2=upart, op=nl.add)
    return qn


# ---- phase 2: attention (static pass, or the replay) ----------------------------------------------------
def _diag_units(g, st):
    """One unit per (query tile, head): the diagonal block (block index 0)."""
    KB, Hc, NT = g["KB"], g["Hc"], g["NT"]
    units = []
    for t in range(NT):
        k0 = (t * P // KB) * KB
        segs = _segments(t * P - k0)
        segs.append((t * P - k0, P, st["tri"]))      # the tile's own keys, causal
        for h in range(Hc):
            units.append({"i": t * Hc + h, "kT": st["kT"], "kc": k0, "v": st["v"], "vt": k0 // P, "segs": segs,
                          "width": (t + 1) * P - k0, "b": 0.0})
    return units


def _chunk_units(g, st, bt):
    """Units of the chunk blocks before each tile's diagonal block (block index bt[j] tile + 0 for chunk
    block j in the replay: bt is a list of fp32 [P, 1] tiles, or None in the static pass)."""
    KB, Hc, NT = g["KB"], g["Hc"], g["NT"]
    units = []
    for t in range(NT):
        for j in range(t * P // KB):
            for h in range(Hc):
                units.append({"i": t * Hc + h, "kT": st["kT"], "kc": j * KB, "v": st["v"], "vt": j * KB // P,
                              "segs": _segments(KB), "width": KB, "b": None if bt == None else bt[j]})
    return units


def _context_units(g, buf, mask, b):
    """Units of one context block (every query tile and head): buf holds its K^T / V."""
    units = []
    segs = _segments(g["KB"], mask, 0)
    for i in range(g["NI"]):
        units.append({"i": i, "kT": buf["kT"], "kc": 0, "v": buf["v"], "vt": 0, "segs": segs, "width": g["KB"],
                      "b": b})
    return units


def _attend(g, st, k_cache, v_cache, rt, mode, static_start, bctr=None):
    """All blocks of every (tile, head) in the fixed order diagonal, context (head block, full blocks), chunk.
    mode "static": the diagonal block sets the anchor, blocks are committed while the l-check passes.
    mode "replay": online rescaling, committed where frozen and block >= cnt (bctr: the replay's block
    counter, fp32 [P, 1], 1 at the first context block)."""
    _run_units(g, st, _ring(st), _diag_units(g, st), "anchor" if mode == "static" else mode)
    _context(g, st, k_cache, v_cache, rt, mode, static_start, bctr)
    bt = None
    if mode == "replay":
        bt = []
        for j in range(max(0, (g["NT"] - 1) * P // g["KB"])):
            b = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name=f"pf_replay_chunk_block{j}")
            nisa.tensor_scalar(dst=b, data=bctr, op0=nl.add, operand0=float(j))
            bt.append(b)
    _run_units(g, st, _ring(st), _chunk_units(g, st, bt), mode)


def _context(g, st, k_cache, v_cache, rt, mode, static_start, bctr):
    """The cache rows 0..start-1 in key blocks (module docstring): a 0/1-trip head block, then a runtime loop
    over full blocks whose induction variable is the block's first row (DMA offset); with static_start the
    same blocks unrolled. One buffer set is loaded per block and attended by every unit."""
    D, KB, NB, act = g["D"], g["KB"], g["NB"], g["act"]
    buf = {"k": nl.ndarray((P, NB, D), act, buffer=nl.sbuf, name="pf_ctx_k"),
           "v": nl.ndarray((P, NB, D + 1), act, buffer=nl.sbuf, name="pf_ctx_v"),
           "kT": nl.ndarray((g["dp"], g["DT"], KB), act, buffer=nl.sbuf, name="pf_ctx_kT")}
    nisa.memset(dst=buf["v"][:, :, D:D + 1], value=1.0, engine=POOL_ENG)
    dead, mask = _head_masks(g, rt)
    b = None if mode == "static" else bctr

    if static_start != None:
        if static_start % KB:
            _context_block(g, st, buf, k_cache, v_cache, 0, None, dead, mask, mode, b)
        for j in range(static_start // KB):
            _context_block(g, st, buf, k_cache, v_cache, j * KB, rt["rem"], None, None, mode, b)
        return

    def head_body(i):
        _context_block(g, st, buf, k_cache, v_cache, 0, None, dead, mask, mode, b)
    nl.fori_loop(0, rt["head"], head_body)

    def full_body(i):                       # i: the block's first cache row (r + jKB)
        _context_block(g, st, buf, k_cache, v_cache, 0, i, None, None, mode, b)
    nl.fori_loop(rt["rem"], rt["start"], full_body, step=KB)


def _head_masks(g, rt):
    """Head-block masks from the run-time r: score column k (key k) masked (NEG) iff k >= r, act [P, KB];
    row 128c + p dead iff >= r, uint8 [P, KB/128]."""
    KB, NB = g["KB"], g["NB"]
    cols = nl.ndarray((P, KB), F32, buffer=nl.sbuf, name="pf_head_cols")
    nisa.iota(dst=cols, pattern=[[1, KB]], offset=0, channel_multiplier=0)
    mask = nl.ndarray((P, KB), g["act"], buffer=nl.sbuf, name="pf_head_mask")
    nisa.tensor_scalar(dst=mask, data=cols, op0=nl.greater_equal, operand0=rt["rem_f"], op1=nl.multiply,
                       operand1=NEG)
    rows = nl.ndarray((P, NB), F32, buffer=nl.sbuf, name="pf_head_rows")
    nisa.iota(dst=rows, pattern=[[P, NB]], offset=0, channel_multiplier=1)
    dead = nl.ndarray((P, NB), U8, buffer=nl.sbuf, name="pf_head_dead")
    nisa.tensor_scalar(dst=dead, data=rows, op0=nl.greater_equal, operand0=rt["rem_f"])
    return dead, mask


def _context_block(g, st, buf, k_cache, v_cache, row0, reg, dead, mask, mode, b):
    """Load one context block (rows row0 (+ reg) .. + KB; 128-key tile c on partitions, row 128c + p), zero
    the dead rows of a head block, transpose K on the PE, attend every unit; the replay counter advances."""
    D, NB, DT = g["D"], g["NB"], g["DT"]
    pattern = [[D, P], [P * D, NB], [1, D]]
    for dst_cache in ((buf["k"], k_cache), (buf["v"][:, :, 0:D], v_cache)):
        dst, cache = dst_cache
        if reg == None:
            src = cache.ap(pattern=pattern, offset=row0 * D)
        else:
            src = cache.ap(pattern=pattern, offset=row0 * D, scalar_offset=reg, indirect_dim=1)
        nisa.dma_copy(dst=dst, src=src)
    if dead != None:    # rows >= r: beyond this block's keys, maybe uninitialised -> zero (NaN-safe select)
        dv = dead.ap(pattern=[[NB, P], [1, NB], [0, D]], offset=0)
        nisa.tensor_copy_predicated(dst=buf["k"], src=0.0, predicate=dv)
        nisa.tensor_copy_predicated(dst=buf["v"][:, :, 0:D], src=0.0, predicate=dv)
    ring = _ring(st)
    for dt in range(DT):
        for c0 in range(0, NB, 4):
            _transpose_keys(g, st, buf, ring, dt, c0, min(4, NB - c0))
    _run_units(g, st, ring, _context_units(g, buf, mask, b), mode)
    if mode == "replay":
        nisa.tensor_scalar(dst=b, data=b, op0=nl.add, operand0=1.0)


def _transpose_keys(g, st, buf, ring, dt, c0, n):
    """K^T of key tiles c0..c0+n-1, d-tile dt (one PSUM bank of the ring, evicted on ACT / DVE alternately)."""
    dp = g["dp"]
    ps = _next(ring, "t").reshape((P, 4, P))[0:dp]
    for c in range(n):
        nisa.nc_matmul(dst=ps[:, c, :], stationary=buf["k"][:, c0 + c, dt * dp:(dt + 1) * dp], moving=st["ident"],
                       accumulate=False)
    nisa.tensor_copy(dst=buf["kT"][:, dt, c0 * P:(c0 + n) * P], src=ps[:, 0:n, :],
                     engine=ACT_ENG if (c0 // 4 + dt) % 2 == 0 else DVE_ENG)


def _sbuf_ring(g):
    """SBUF work tiles of the unit pipeline, two of each (unit k uses slot k % 2, so unit k+1's stage A never
    waits for unit k's stage B to release a tile): P [P, KB] act, P^T [P, KB/128, P] act, the next [O | l]
    [P, D+1] fp32, the commit predicate, and the replay's per-row scalars. Allocated once per call (SBUF state
    may live across runtime loops)."""
    act, D, KB, NB = g["act"], g["D"], g["KB"], g["NB"]
    r = {}
    for nmr_shape_dt in (("p", (P, KB), act), ("pT", (P, NB, P), act),
                         ("tmp", (P, D + 1), F32), ("ok", (P, 1), U32), ("mx", (P, 4), F32),
                         ("nmx", (P, 1), F32), ("nmn", (P, 1), F32), ("alpha", (P, 1), F32)):
        nmr, shape, dt = nmr_shape_dt
        r[nmr] = []
        for k in range(2):
            r[nmr].append(nl.ndarray(shape, dt, buffer=nl.sbuf, name=f"pf_{nmr}{k}"))
    return r


def _ring(st):
    """The unit pipeline's buffers for one region (the diagonal blocks, one context block, the chunk blocks):
    the call's SBUF ring plus PSUM banks allocated here -- inside the runtime loop body for a context block, as
    PSUM must not carry state across runtime loops -- 3 score banks, 2 P^T (and K^T) banks, 2 PV banks, used
    round-robin; the counters restart with every region (every loop iteration traces the same code)."""
    ring = {"sb": st["ring"], "n": {"u": 0, "s": 0, "t": 0, "pv": 0}}
    for nmr_k in (("s", 3), ("t", 2), ("pv", 2)):
        nmr, k = nmr_k
        ring[nmr] = []
        for i in range(k):
            ring[nmr].append(nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name=f"pf_{nmr}_bank{i}"))
    return ring


def _next(ring, kind):
    """The next PSUM bank of a kind (round-robin)."""
    n = ring["n"][kind]
    ring["n"][kind] = n + 1
    banks = ring[kind]
    return banks[n % len(banks)]


def _run_units(g, st, ring, units, mode):
    """Software pipeline over units, in the order that keeps the in-order engine queues busy: P^T of unit k
    (PE transposes; ScalarE evicts), then unit k+1's scores and exp (PE: QK(k+1) while ScalarE evicts P^T(k)),
    then unit k's PV and state update (PE: PV(k) while ScalarE exponentiates unit k+1; VectorE updates)."""
    n = len(units)
    slots = []
    for k in range(n):
        slots.append(ring["n"]["u"] % 2)
        ring["n"]["u"] += 1
    if n:
        _stage_a(g, st, ring, units[0], slots[0], mode)
    for k in range(n):
        _stage_pT(st, ring, units[k], slots[k])
        if k + 1 < n:
            _stage_a(g, st, ring, units[k + 1], slots[k + 1], mode)
        _stage_pv(g, st, ring, units[k], slots[k], mode)


def _stage_a(g, st, ring, u, slot, mode):
    """Scores of one unit per segment (split-K over the d-tiles into one PSUM bank), masks, and
    P = exp(scale*s - m) into the slot's P tile (act). mode "anchor": m = the block's row max, stored in nm;
    "static": the stored anchor; "replay": m' = max(m, block max) into the slot's nmn, alpha = exp(m - m')."""
    DT, sc, i = g["DT"], g["sc"], u["i"]
    sb = ring["sb"]
    segs = u["segs"]
    p = sb["p"][slot]
    srcs = []
    for col_w_m in segs:
        col, w, m = col_w_m
        s_ps = _next(ring, "s")[:, 0:w]
        for dt in range(DT):
            nisa.nc_matmul(dst=s_ps, stationary=st["qT"][:, i, dt, :],
                           moving=u["kT"][:, dt, u["kc"] + col:u["kc"] + col + w], accumulate=dt > 0)
        if m != None:   # the additive mask joins the accumulation (identity stationary): no VectorE pass
            nisa.nc_matmul(dst=s_ps, stationary=st["ident"], moving=m, accumulate=True)
        srcs.append(s_ps)
    nm = st["nm"][:, i:i + 1]
    bias = nm
    if mode != "static":        # the block's row max (negated), over its segments
        mx = sb["mx"][slot]
        for k in range(len(segs)):
            nisa.tensor_reduce(dst=mx[:, k:k + 1], op=nl.maximum, data=srcs[k], axis=1, negate=True)
        nmx = mx[:, 0:1]
        if len(segs) > 1:
            nmx = sb["nmx"][slot]
            nisa.tensor_reduce(dst=nmx, op=nl.minimum, data=mx[:, 0:len(segs)], axis=1)
        if mode == "anchor":    # -m0 = -scale * max
            nisa.tensor_scalar(dst=nm, data=nmx, op0=nl.multiply, operand0=sc)
        else:                   # replay: -m' = min(-scale * max, -m); alpha = exp(m - m') = exp(-nm + nm')
            nmn = sb["nmn"][slot]
            nisa.scalar_tensor_tensor(dst=nmn, data=nmx, op0=nl.multiply, operand0=sc, op1=nl.minimum,
                                      operand1=nm)
            nisa.activation(dst=sb["alpha"][slot], op=nl.exp, data=nm, scale=-1.0, bias=nmn)
            bias = nmn
    for k in range(len(segs)):
        col, w, _ = segs[k]
        nisa.activation(dst=p[:, col:col + w], op=nl.exp, data=srcs[k], scale=sc, bias=bias)


def _stage_pT(st, ring, u, slot):
    """P^T of a unit: PE transposes per 128-key tile into a PSUM bank per segment, evicted on ScalarE (VectorE
    carries the state updates)."""
    sb = ring["sb"]
    p, pT = sb["p"][slot], sb["pT"][slot]
    for col_w in u["segs"]:
        col, w, _ = col_w
        n = w // P
        tps = _next(ring, "t").reshape((P, 4, P))
        for c in range(n):
            nisa.nc_matmul(dst=tps[:, c, :], stationary=p[:, col + c * P:col + (c + 1) * P], moving=st["ident"],
                           accumulate=False)
        nisa.tensor_copy(dst=pT[:, col // P:col // P + n, :], src=tps[:, 0:n, :], engine=ACT_ENG)


def _stage_pv(g, st, ring, u, slot, mode):
    """PV over the unit's key tiles accumulated in one PSUM bank ([O | l] of the block), then the state update
    of the mode."""
    D, i = g["D"], u["i"]
    sb = ring["sb"]
    nk = u["width"] // P
    pT = sb["pT"][slot]
    pv = _next(ring, "pv")[:, 0:D + 1]
    for c in range(nk):
        nisa.nc_matmul(dst=pv, stationary=pT[:, c, :], moving=u["v"][:, u["vt"] + c, :], accumulate=c > 0)
    ol = st["ol"][:, i, :]
    tmp, ok = sb["tmp"][slot], sb["ok"][slot]
    if mode == "replay":
        nisa.scalar_tensor_tensor(dst=tmp, data=ol, op0=nl.multiply, operand0=sb["alpha"][slot], op1=nl.add,
                                  operand1=pv)
        frz = st["frz"][:, i:i + 1]     # commit where frozen and this block >= the row's first failing block
        nisa.scalar_tensor_tensor(dst=ok, data=st["cnt"][:, i:i + 1], op0=nl.less_equal, operand0=u["b"],
                                  op1=nl.multiply, operand1=frz)
        nisa.tensor_copy_predicated(dst=st["nm"][:, i:i + 1], src=sb["nmn"][slot], predicate=ok)
    else:
        nisa.tensor_tensor(dst=tmp, data1=ol, data2=pv, op=nl.add)
        live = st["live"][:, i:i + 1]   # ok = (l_new <= e^tau) and live; NaN compares false
        nisa.scalar_tensor_tensor(dst=ok, data=tmp[:, D:D + 1], op0=nl.less_equal, operand0=g["e_tau"],
                                  op1=nl.multiply, operand1=live)
    nisa.tensor_copy_predicated(dst=ol, src=tmp, predicate=ok.ap(pattern=[[1, P], [0, D + 1]], offset=0))
    if mode != "replay":       # integer bookkeeping on GpSimd (exact int32 adds), off the VectorE queue
        cnt = st["cnt"][:, i:i + 1]
        nisa.tensor_tensor(dst=cnt, data1=cnt, data2=ok, op=nl.add, engine=POOL_ENG)
        nisa.tensor_copy(dst=st["live"][:, i:i + 1], src=ok, engine=POOL_ENG)


# ---- the replay branch -----------------------------------------------------------------------------
def _replay_if_needed(g, st, k_cache, v_cache, rt, stats, static_start):
    """Count this core's frozen rows (PE ones-matmul over partitions), sum the 0/1 flags of both cores, load
    the register, and run the replay (a 0/1-trip runtime loop, identical on both cores). stats[0] = frozen
    rows of this core, stats[1] = 1.0 if the replay ran."""
    NI, c = g["NI"], g["core"]
    ones = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_ones")
    nisa.memset(dst=ones, value=1.0, engine=POOL_ENG)
    st["ones"] = ones
    live_rows = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_live_rows")
    nisa.tensor_reduce(dst=live_rows, op=nl.add, data=st["live"], axis=1)
    ps = nl.ndarray((1, 1), F32, buffer=nl.psum, name="pf_live_total_psum")
    nisa.nc_matmul(dst=ps, stationary=live_rows, moving=ones, accumulate=False)
    nisa.tensor_scalar(dst=stats[:, 0:1], data=ps, op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=float(P * NI))
    flag = nl.ndarray((1, 1), I32, buffer=nl.sbuf, name="pf_replay_flag")
    nisa.tensor_scalar(dst=flag, data=stats[:, 0:1], op0=nl.greater, operand0=0.5)
    if g["n_cores"] == 2:
        other = nl.ndarray((1, 1), I32, buffer=nl.sbuf, name="pf_replay_flag_other")
        nisa.sendrecv(src=flag, dst=other, send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=1)
        both = nl.ndarray((1, 1), I32, buffer=nl.sbuf, name="pf_replay_flags")
        nisa.tensor_tensor(dst=both, data1=flag, data2=other, op=nl.add)
        flag = nl.ndarray((1, 1), I32, buffer=nl.sbuf, name="pf_replay_any")
        nisa.tensor_scalar(dst=flag, data=both, op0=nl.greater, operand0=0.5, engine=DVE_ENG)
    nisa.tensor_copy(dst=stats[:, 1:2], src=flag)
    nisa.register_load(rt["replay"], flag)

    def replay(i):
        frz = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_frozen")
        nisa.tensor_scalar(dst=frz, data=st["live"], op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=1.0)
        st["frz"] = frz
        bctr = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_replay_block")
        nisa.memset(dst=bctr, value=1.0, engine=POOL_ENG)
        _attend(g, st, k_cache, v_cache, rt, "replay", static_start, bctr)
    nl.fori_loop(0, rt["replay"], replay)


# ---- phase 3: normalise, gate, o_proj ------------------------------------------------------------------
def _load_wo(g, wo, heads):
    """o_proj rows of this core's heads (``heads`` "own") or of the other core's ("peer", the fused epilogue) ->
    SBUF [dp, Hc*DT, H] (one DMA per (head, d-tile) block); this core's are issued before the attention so the
    weight is resident when the first tile finishes."""
    act, D, dp, DT, Hc, H = g["act"], g["D"], g["dp"], g["DT"], g["Hc"], g["H"]
    wo_sb = nl.ndarray((dp, Hc * DT, H), act, buffer=nl.sbuf, name=f"pf_wo_{heads}")
    c = g["core"] if heads == "own" else 1 - g["core"]
    r0 = c * Hc * D
    for bk in range(Hc * DT):
        nisa.dma_copy(dst=wo_sb[:, bk, :], src=wo[r0 + bk * dp:r0 + (bk + 1) * dp, :])
    return wo_sb


def _finish_tiles(g, st, og_depth):
    """The work tiles of phase 3 shared by both epilogues: two PSUM banks for the own heads' o_proj, the
    transposes' PSUM, o / sigmoid(gate) (2 each), ``og_depth`` og tiles, 1 / l, and the raw gate's 3-deep ring
    (its first loads issued here)."""
    act, D, Hc, NT = g["act"], g["D"], g["Hc"], g["NT"]
    fr = {"y_ps": [], "n": 0}
    _transpose_psum(g, fr)
    for k in range(2):
        fr["y_ps"].append(nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name=f"pf_y_psum{k}"))
    for nmr_dt_depth in (("o", act, 2), ("sg", F32, 2), ("og", act, og_depth)):
        nmr, dt, depth = nmr_dt_depth
        fr[nmr] = []
        for k in range(depth):
            fr[nmr].append(nl.ndarray((P, Hc, D), dt, buffer=nl.sbuf, name=f"pf_{nmr}{k}"))
    fr["rl"] = []
    for k in range(2):
        fr["rl"].append(nl.ndarray((P, Hc), F32, buffer=nl.sbuf, name=f"pf_inv_rowsum{k}"))
    fr["gate"] = []
    for k in range(3):           # the raw gate comes back from HBM 3 tiles ahead of its use
        fr["gate"].append(nl.ndarray((P, Hc, D), act, buffer=nl.sbuf, name=f"pf_gate{k}"))
        if k < NT:
            nisa.dma_copy(dst=fr["gate"][k], src=st["gate"][k])
    return fr


def _finish(g, st, wo_sb, out, stats):
    """Per tile: o = O / l (rounded), og = o * sigmoid(gate) (rounded), og^T, y = og Wo (fp32) -> out rows,
    software-pipelined (tile t+1's o / gate / og^T are issued before tile t's o_proj); then stats[2] = this
    core's valid rows whose [O | l] is not finite."""
    act, dp, DT, Hc, H, NT = g["act"], g["dp"], g["DT"], g["Hc"], g["H"], g["NT"]
    fr = _finish_tiles(g, st, 2)
    fr["y"] = []
    fr["ogT"] = []
    for k in range(2):
        fr["y"].append(nl.ndarray((P, H), F32, buffer=nl.sbuf, name=f"pf_y{k}"))
        fr["ogT"].append(nl.ndarray((dp, Hc * DT, P), act, buffer=nl.sbuf, name=f"pf_ogT{k}"))
    _gate_tile(g, st, fr, 0)
    _gated_T(g, fr, 0)
    for t in range(NT):          # VectorE / ScalarE prepare tile t+1 while the PE runs tile t's o_proj
        if t + 1 < NT:
            _gate_tile(g, st, fr, t + 1)
        _o_proj_tile(g, wo_sb, fr, out, t)
        if t + 1 < NT:
            _gated_T(g, fr, t + 1)
    _count_nonfinite(g, st, stats)


def _gate_tile(g, st, fr, t, og=None):
    """Tile t: o = O / l (rounded to act), og = o * sigmoid(gate) (rounded) into ``og`` (default slot t % 2)."""
    D, Hc = g["D"], g["Hc"]
    i0 = t * Hc
    k = t % 2
    rl, o, sg = fr["rl"][k], fr["o"][k], fr["sg"][k]
    if og == None:
        og = fr["og"][k]
    nisa.reciprocal(dst=rl, data=st["ol"][:, i0:i0 + Hc, D])
    nisa.tensor_tensor(dst=o, data1=st["ol"][:, i0:i0 + Hc, 0:D],
                       data2=rl.ap(pattern=[[Hc, P], [1, Hc], [0, D]], offset=0), op=nl.multiply)
    # ScalarE's sigmoid table: one table switch per call (nothing after this phase needs exp)
    gt = fr["gate"][t % 3]
    nisa.activation(dst=sg, op=nl.sigmoid, data=gt)
    if t + 3 < g["NT"]:
        nisa.dma_copy(dst=gt, src=st["gate"][t + 3])
    nisa.tensor_tensor(dst=og, data1=o, data2=sg, op=nl.multiply)


def _gated_T(g, fr, t, og=None, ogT=None):
    """og^T of tile t (d on partitions, per head and d-tile): the stationary operand of its o_proj (``og`` /
    ``ogT`` default: slot t % 2)."""
    DT = g["DT"]
    if og == None:
        og, ogT = fr["og"][t % 2], fr["ogT"][t % 2]
    for h in range(g["Hc"]):
        _transpose_rows(g, og[:, h, :], ogT[:, h * DT:(h + 1) * DT, :], _next_tp(fr),
                        ACT_ENG if h % 2 == 0 else DVE_ENG)


def _o_proj_tile(g, wo_sb, fr, out, t):
    """y = og Wo for tile t (one PSUM bank per 512 output columns, evicted ACT / DVE alternately), then one DMA
    of whole rows into out."""
    H, N = g["H"], g["N"]
    nt = min(P, N - t * P)
    ogT, y = fr["ogT"][t % 2], fr["y"][t % 2]
    nblk = g["Hc"] * g["DT"]
    for n0 in range(0, H, PSUM_COLS):
        n1 = min(H, n0 + PSUM_COLS)
        n = fr["n"]
        fr["n"] = n + 1
        y_ps = fr["y_ps"][n % 2][:, 0:n1 - n0]
        for b in range(nblk):
            nisa.nc_matmul(dst=y_ps, stationary=ogT[:, b, :], moving=wo_sb[:, b, n0:n1], accumulate=b > 0)
        nisa.tensor_copy(dst=y[:, n0:n1], src=y_ps, engine=ACT_ENG if n % 2 == 0 else DVE_ENG)
    nisa.dma_copy(dst=out[t * P:t * P + nt, :], src=y[0:nt, :])      # one DMA of whole rows per tile


# ---- phase 3, fused with the residual all-reduce and the next RMSNorm ---------------------------------------------
def _fused_steps(g):
    """The all-reduce groups (``rmsnorm_prefill.allreduce_groups``: group q belongs to core q % n_cores) taken
    n_cores at a time: step i = groups n i .. n i + n - 1 (the last step may lack the last cores' groups). Every
    core gates every tile of a step (its heads), keeps its own group's og^T and sends the other's."""
    groups = allreduce_groups(g["N"], g["H"])
    n = g["n_cores"]
    steps = []
    for i in range(0, len(groups), n):
        steps.append(groups[i:i + n])
    return steps


def _step_tiles(step):
    """The 128-token tiles of a step's groups, in order, as (group index in the step, sub-tile, tile)."""
    out = []
    for q in range(len(step)):
        t0, _, kk = step[q]
        for s in range(kk):
            out.append((q, s, t0 // P + s))
    return out


def _fused_prepare(g, st, fr, tiles, rs, a, b):
    """VectorE / ScalarE part of a step's tiles a..b-1: og (this core's heads) into the og ring, and the row sums
    of their [O | l] into ``rs`` (:func:`_count_nonfinite`'s, taken here off the kernel's tail)."""
    for k in range(a, b):
        _gate_tile(g, st, fr, tiles[k][2], fr["og"][k])
    i0, i1 = tiles[a][2] * g["Hc"], (tiles[b - 1][2] + 1) * g["Hc"]
    nisa.tensor_reduce(dst=rs[:, i0:i1], op=nl.add, data=st["ol"][:, i0:i1, :], axis=2)


def _fused_exchange(g, fr, step, tiles, ogT, recv):
    """PE transposes of the step's og into ``ogT`` (one tile each), then the og^T swap: per sub-tile j one
    ``sendrecv`` (same shape on both cores) hands each core the other core's og^T of its own group's sub-tile j
    (into ``recv[j]``); a core whose group is shorter than the other's receives into the last ``recv`` tile
    (scratch) and sends its own tile j (a dummy the other core discards)."""
    for k in range(len(tiles)):
        _gated_T(g, fr, tiles[k][2], fr["og"][k], ogT[k])
    c, n = g["core"], g["n_cores"]
    if n == 1:
        return
    first = [0, 0]                  # per core: the step-tile index of its group's first sub-tile
    kk = [0, 0]                     # per core: its group's sub-tiles (0: no group in this step)
    for k in range(len(tiles)):
        if tiles[k][1] == 0:
            first[tiles[k][0]] = k
    for q in range(len(step)):
        kk[q] = step[q][2]
    for j in range(max(kk[0], kk[1])):
        peer, mine = 1 - c, c
        src = ogT[first[peer] + j] if j < kk[peer] else ogT[first[mine] + j]
        dst = recv[j] if j < kk[mine] else recv[len(recv) - 1]
        nisa.sendrecv(src=src, dst=dst, send_to_rank=peer, recv_from_rank=peer, pipe_id=0)


def _fused_o_proj(g, wo_own, wo_peer, fr, own, recv, s, yg):
    """The o_proj of sub-tile s of this core's group, all of the rank's heads: per 512 columns, the own heads'
    blocks accumulated in one PSUM bank (og^T ``own``) and evicted to ``yg`` (float32), then the other core's
    heads' blocks (its og^T ``recv``) in a second bank, added on VectorE (``yg = yg + bank``: this core's partial +
    the other's, the operand order of ``residual_allreduce_stage``). LNC=1: one accumulation over every head."""
    H = g["H"]
    nblk = g["Hc"] * g["DT"]
    for n0 in range(0, H, PSUM_COLS):
        n1 = min(H, n0 + PSUM_COLS)
        n = fr["n"]
        fr["n"] = n + 1
        dst = yg[:, s * H + n0:s * H + n1]
        y_ps = fr["y_ps"][n % 2][:, 0:n1 - n0]
        for b in range(nblk):
            nisa.nc_matmul(dst=y_ps, stationary=own[:, b, :], moving=wo_own[:, b, n0:n1], accumulate=b > 0)
        nisa.tensor_copy(dst=dst, src=y_ps, engine=ACT_ENG if n % 2 == 0 else DVE_ENG)
        if wo_peer != None:
            z_ps = fr["z_ps"][n % 2][:, 0:n1 - n0]
            for b in range(nblk):
                nisa.nc_matmul(dst=z_ps, stationary=recv[:, b, :], moving=wo_peer[:, b, n0:n1], accumulate=b > 0)
            nisa.tensor_tensor(dst=dst, data1=dst, data2=z_ps, op=nl.add, engine=DVE_ENG)


def _dense(ring_tile, F, dtype, name):
    """``ring_tile`` when it is F columns wide, else a tile of its own (collective operands are dense)."""
    if ring_tile.shape[1] == F:
        return ring_tile
    return nl.ndarray((P, F), dtype, buffer=nl.sbuf, name=name)


def _finish_fused(g, st, wo_own, wo, fuse, stats):
    """Phase 3 fused with the composition's next step (:func:`attention_prefill_kernel` with ``residual``): the
    rank's o_proj output is summed over its cores and ranks, added to the residual and normalised per
    all-reduce group, on the group's core -- the math of ``megakernel.prefill.residual_allreduce_stage`` (per
    core) on the unfused kernel's partials, bit for bit, without the fp32 partials' HBM round trip or a launch.

    A software pipeline over this core's groups (one per step, :func:`_fused_steps`), three groups in flight.
    Iteration i in program order: og of step i+1's tiles (:func:`_fused_prepare`; one ScalarE table switch to
    sigmoid and back per step); per sub-tile s ScalarE's part of group i-2's RMSNorm, the o_proj of group i's
    sub-tile s (:func:`_fused_o_proj`), VectorE's part of the norm and its stores; step i+1's og^T and swap
    (:func:`_fused_exchange`); the residual add and store of group i-1 (its collective has had a whole iteration
    to finish); the collective of group i over the ranks (one SBUF all-reduce of [rows, kk H] fp32; one
    destination tile, so it follows that add) and the load of group i's residual rows (two residual tiles: the
    norm of group i-2 read the other). No in-order engine queue waits on a collective with other work behind it.
    4K at the real shapes: 1,257.5 us central (the unfused kernel 1,113.4 + the stage 269.0 + a launch;
    orderings tried: bench/prefill_speed.md)."""
    act, dp, DT, Hc, H = g["act"], g["dp"], g["DT"], g["Hc"], g["H"]
    c, n = g["core"], g["n_cores"]
    steps = _fused_steps(g)
    kmax = steps[0][0][2]
    F = kmax * H
    fr = _finish_tiles(g, st, n * kmax)
    wo_peer = _load_wo(g, wo, "peer") if n == 2 else None
    if n == 2:
        fr["z_ps"] = []
        for k in range(2):
            fr["z_ps"].append(nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name=f"pf_z_psum{k}"))
    wb = None
    if fuse["norm_out"] != "none":
        wb = broadcast_weight(fuse["w"], H)
    ogT = []
    for k in range(n * kmax):
        ogT.append(nl.ndarray((dp, Hc * DT, P), act, buffer=nl.sbuf, name=f"pf_ogT{k}"))
    recv = []
    for k in range(kmax + 1):       # the last one: the scratch of a shorter group's swap
        recv.append(nl.ndarray((dp, Hc * DT, P), act, buffer=nl.sbuf, name=f"pf_ogT_recv{k}"))
    yg = []
    xs = []
    for k in range(2):
        yg.append(nl.ndarray((P, F), F32, buffer=nl.sbuf, name=f"pf_fused_y{k}"))
        xs.append(nl.ndarray((P, F), act, buffer=nl.sbuf, name=f"pf_fused_residual{k}"))
    total = nl.ndarray((P, F), F32, buffer=nl.sbuf, name="pf_fused_total")
    rs = nl.ndarray((P, g["NI"]), F32, buffer=nl.sbuf, name="pf_row_sums")

    S = len(steps)
    tiles = []
    for i in range(S):
        tiles.append(_step_tiles(steps[i]))
    _fused_prepare(g, st, fr, tiles[0], rs, 0, len(tiles[0]))
    _fused_exchange(g, fr, steps[0], tiles[0], ogT, recv)
    items = []                       # this core's groups: ((t0, rows, kk), sum, y tile, residual tile, xT tile)
    # (the xT tile of the norm's "xT" output is allocated when the group's norm is due)
    for i in range(S + 2):
        cur = None
        if i < S and c < len(steps[i]):
            t0, rows, kk = steps[i][c]
            y = _dense(yg[i % 2], kk * H, F32, "pf_fused_y_tail")
            cur = ((t0, rows, kk), None, y, xs[i % 2], None)
        items.append(cur)
        p1 = items[i - 1] if i >= 1 else None       # its residual add is due
        p2 = items[i - 2] if i >= 2 else None       # its RMSNorm is due
        if p2 != None:
            p2 = (p2[0], p2[1], p2[2], p2[3], residual_norm_xT(p2[3], p2[0][2], H, fuse["norm_out"]))
        kk_cur = cur[0][2] if cur != None else 0
        kk_p2 = p2[0][2] if p2 != None else 0
        nxt = tiles[i + 1] if i + 1 < S else []
        own = []
        if cur != None:
            for k in range(len(tiles[i])):
                if tiles[i][k][0] == c:
                    own.append(ogT[k])
        if len(nxt) > 0:
            _fused_prepare(g, st, fr, nxt, rs, 0, len(nxt))
        for s in range(max(kk_cur, kk_p2)):
            normed = None
            if s < kk_p2:
                normed = _fused_norm_act(g, fuse, p2, s)
            if s < kk_cur:
                _fused_o_proj(g, wo_own, wo_peer, fr, own[s], recv[s], s, cur[2])
            if s < kk_p2:
                _fused_norm_dve(g, fuse, wb, p2, s, normed)
        if p2 != None:
            residual_norm_store(p2[4], p2[0][1], p2[0][2], fuse["norm_t"], fuse["norm_out"], p2[0][0])
        if len(nxt) > 0:
            _fused_exchange(g, fr, steps[i + 1], nxt, ogT, recv)
        if p1 != None:
            t0, rows, kk = p1[0]
            residual_add_rows(p1[3], p1[1], rows, kk, H, token_group_ap(fuse["out"], t0 * H, rows, kk, H))
        if cur != None:
            t0, rows, kk = cur[0]
            tot = cur[2]
            if fuse["rg"] != None:
                tot = _dense(total, kk * H, F32, "pf_fused_total_tail")
                ncc.all_reduce(srcs=[cur[2][0:rows, :]], dsts=[tot[0:rows, :]], replica_group=fuse["rg"],
                               op=nl.add)
            nisa.dma_copy(dst=cur[3][0:rows, 0:kk * H], src=token_group_ap(fuse["x"], t0 * H, rows, kk, H))
            items[i] = (cur[0], tot, cur[2], cur[3], cur[4])
        if i >= 2:
            items[i - 2] = None
    _count_nonfinite(g, st, stats, rs)


def _fused_norm_act(g, fuse, item, s):
    """ScalarE's part of the next RMSNorm of sub-tile s of a group's new residual rows
    (``rmsnorm_prefill.rmsnorm_scale_tile``: x * rstd, float32) into the group's o_proj tile (dead after its
    collective and the residual add; sub-tile s's columns serve as its square's work tile too). Returns that
    float32 tile (None without a norm)."""
    if fuse["norm_out"] == "none":
        return None
    (t0, rows, kk), _, y, xs, _ = item
    H = g["H"]
    w = y[:, s * H:(s + 1) * H]
    return rmsnorm_scale_tile(xs[:, s * H:(s + 1) * H], rows, fuse["eps"], w, w)


def _fused_norm_dve(g, fuse, wb, item, s, normed):
    """VectorE's part of sub-tile s of the group's RMSNorm (``* (1 + w)``, rounded, written over the sub-tile's
    residual rows: stored already, and the norm's last reader) and its store / transposes
    (``rmsnorm_prefill.rmsnorm_weight_tile``, ``residual_norm_emit``)."""
    if fuse["norm_out"] == "none":
        return
    (t0, rows, kk), _, _, xs, xt = item
    H = g["H"]
    rows_out = rmsnorm_weight_tile(normed, wb, rows, g["act"], xs[:, s * H:(s + 1) * H])
    residual_norm_emit(rows_out, s, rows, fuse["norm_t"], fuse["norm_out"], t0, g["ident"], xt)


def _count_nonfinite(g, st, stats, rs=None):
    """stats[2] = valid rows (pad rows of a partial last tile excluded) whose [O | l] sums to a non-finite
    value (|sum| <= FLT_MAX is false for NaN and +-Inf; a sum that overflows fp32 also counts). ``rs``: the row
    sums ``[P, NI]`` when the caller took them already (the fused epilogue, per step)."""
    Hc, NT, NI, N = g["Hc"], g["NT"], g["NI"], g["N"]
    if rs == None:
        rs = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_row_sums")
        nisa.tensor_reduce(dst=rs, op=nl.add, data=st["ol"], axis=2)
    fin = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_row_finite")
    nisa.tensor_scalar(dst=fin, data=rs, op0=nl.abs, operand0=None, op1=nl.less_equal, operand1=FP32_FINITE)
    valid = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_row_valid")
    nisa.memset(dst=valid, value=1.0, engine=POOL_ENG)
    nt_last = N - (NT - 1) * P
    if nt_last < P:
        pidx = nl.ndarray((P, Hc), F32, buffer=nl.sbuf, name="pf_row_index")
        nisa.iota(dst=pidx, pattern=[[0, Hc]], offset=0, channel_multiplier=1)
        nisa.tensor_scalar(dst=valid[:, NI - Hc:NI], data=pidx, op0=nl.less, operand0=float(nt_last))
    bad = nl.ndarray((P, NI), F32, buffer=nl.sbuf, name="pf_row_bad")      # (fin - 1) * valid = -bad rows
    nisa.scalar_tensor_tensor(dst=bad, data=fin, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=valid)
    bad_rows = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_bad_rows")
    nisa.tensor_reduce(dst=bad_rows, op=nl.add, data=bad, axis=1)
    ps = nl.ndarray((1, 1), F32, buffer=nl.psum, name="pf_bad_total_psum")
    nisa.nc_matmul(dst=ps, stationary=bad_rows, moving=st["ones"], accumulate=False)
    nisa.tensor_scalar(dst=stats[:, 2:3], data=ps, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=0.0)


# ---- wrapper -------------------------------------------------------------------------------------
@nki.jit
def attention_prefill_kernel(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, eps=1e-6,
                             key_block=KEY_BLOCK, static_start=None, residual=None, tp=1, next_norm_w=None,
                             norm_out="none"):
    """Wrapper: HBM in, HBM out. xT ``[P, H/P, N]``; weights from ``attention_layout``; cos/sin ``[N, R]``
    float32; caches ``[1, L, D]``; start ``[1, 1]`` int32.

    Launch ``attention_prefill_kernel(...)`` (LNC=1) or ``attention_prefill_kernel[2](...)`` (LNC=2). Returns
    ``(partials [n_cores, N, H] float32, stats [n_cores, 3] float32, k_cache, v_cache)``: core c's o_proj
    partial in row c (the rank's output is their sum), core c's stats (frozen rows, replay ran, non-finite
    rows) and the caches, mutated in place at rows start..start+N-1.

    With ``residual`` (``[N, H]`` activation dtype, the block's residual) the composition's next step is fused
    into the o_proj (:func:`_finish_fused`): the new residual ``residual + all-reduce over the cores and tp
    ranks(partials)`` and, with ``next_norm_w`` (a ``[P, H/P]`` row of ``norms``) and ``norm_out`` "rows" / "xT",
    its RMSNorm -- bit for bit what ``megakernel.prefill.residual_allreduce_stage(residual, partials, tp, True,
    next_norm_w, eps, norm_out)`` makes of the partials -> ``(residual [N, H], [normed,] stats, k_cache,
    v_cache)``; the partials never reach HBM. A launch on every rank of the ``tp`` ranks (its collectives).
    """
    n_cores, core = program_sharding()
    _, KT, N = xT.shape
    H = KT * P
    stats_out = nl.ndarray((n_cores, 3), F32, buffer=nl.shared_hbm, name="attention_prefill_stats")
    if residual == None:
        out = nl.ndarray((n_cores, N, H), F32, buffer=nl.shared_hbm, name="attention_prefill_partials")
        stats = attention_prefill_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, out[core],
                                       eps, core, n_cores, key_block, static_start)
        nisa.dma_copy(dst=stats_out[core:core + 1, :], src=stats)
        return out, stats_out, k_cache, v_cache
    if tuple(residual.shape) != (N, H) or residual.dtype != xT.dtype or norm_out not in ("none", "rows", "xT") \
            or (norm_out != "none" and next_norm_w == None):
        raise ValueError(f"attention_prefill: residual {residual.dtype}{list(residual.shape)} (expected {xT.dtype}"
                         f"[{N}, {H}]), norm_out {norm_out!r} (none | rows | xT; rows / xT need next_norm_w)")
    new = nl.ndarray((N, H), residual.dtype, buffer=nl.shared_hbm, name="attention_prefill_residual_out")
    norm_t = norm_output(N, H, residual.dtype, norm_out, "attention_prefill_out")
    rg = ncc.ReplicaGroup([list(range(tp))]) if tp > 1 else None
    fuse = {"x": residual, "rg": rg, "out": new, "norm_t": norm_t, "norm_out": norm_out, "w": next_norm_w,
            "eps": eps}
    stats = attention_prefill_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start, None,
                                   eps, core, n_cores, key_block, static_start, None, fuse)
    nisa.dma_copy(dst=stats_out[core:core + 1, :], src=stats)
    if norm_t != None:
        return new, norm_t, stats_out, k_cache, v_cache
    return new, stats_out, k_cache, v_cache



# ---- K/V rows only (the MTP head over the prompt) ----------------------------------------------------------------
def kv_rows_body(xT, wk, wv, norm_w, cos, sin, k_cache, v_cache, start, eps, core, n_cores):
    """Body: the K and V cache rows start..start+N-1 of an N-token chunk and nothing else (no queries, no softmax,
    no o_proj): what a layer whose attention OUTPUT is not needed must still write -- the MTP layer over the
    prompt, whose first draft runs the MTP head at the last position from the returned hidden. Same arguments
    and layouts as :func:`attention_prefill_body` (``norm_w`` row 1: 1 + k_norm); core 0 projects k (RMSNorm +
    RoPE, :func:`_norm_rope`), the last core v, each writes its own cache rows, with the same instruction
    sequence per row as the full kernel, so the rows are bit-identical to what it writes. Returns ``bad`` SBUF
    ``[1, 1]`` float32: rows of this core's K or V tile whose sum is not finite (NaN or Inf in the input)."""
    nm = "attention_prefill_kv"
    if len(xT.shape) != 3 or xT.shape[0] != P:
        raise ValueError(f"{nm}: xT has shape {list(xT.shape)}, expected feature-major [P={P}, H/P, N]")
    _, KT, N = xT.shape
    H = KT * P
    D = wk.shape[1]
    act = xT.dtype
    for nmw_t in (("wk", wk), ("wv", wv)):
        nmw, t = nmw_t
        if tuple(t.shape) != (H, D) or t.dtype != act:
            raise ValueError(f"{nm}: {nmw} is {t.dtype}{list(t.shape)}, expected {act}[H={H}, D={D}]")
    if tuple(norm_w.shape) != (2, D) or norm_w.dtype != F32:
        raise ValueError(f"{nm}: norm_w must be float32 [2, D={D}], got {norm_w.dtype}{list(norm_w.shape)}")
    R = cos.shape[1]
    for nmt_t in (("cos", cos), ("sin", sin)):
        nmt, t = nmt_t
        if tuple(t.shape) != (N, R) or t.dtype != F32:
            raise ValueError(f"{nm}: {nmt} must be float32 [N={N}, R], got {t.dtype}{list(t.shape)}")
    for nmc_c in (("k_cache", k_cache), ("v_cache", v_cache)):
        nmc, c = nmc_c
        if len(c.shape) != 3 or c.shape[0] != 1 or c.shape[2] != D or c.dtype != act or c.shape[1] < N:
            raise ValueError(f"{nm}: {nmc} is {c.dtype}{list(c.shape)}, expected {act}[1, L >= {N}, D={D}]")
    if k_cache.shape[1] * D > INT32_MAX:
        raise ValueError(f"{nm}: cache of {k_cache.shape[1]} x {D} elements: element offsets exceed int32")
    if tuple(start.shape) not in ((1, 1), (1,)) or start.dtype != I32:
        raise ValueError(f"{nm}: start must be an int32 [1, 1] tensor, got {start.dtype}{list(start.shape)}")
    do_k, do_v = core == 0, core == n_cores - 1
    NT = -(-N // P)
    g = {"act": act, "D": D, "R": R, "N": N}
    s_i = nl.ndarray((P, 1), I32, buffer=nl.sbuf, name="pf_kv_start")
    nisa.dma_copy(dst=s_i, src=start.ap(pattern=[[0, P], [1, 1]], offset=0))
    reg = nisa.register_alloc()
    nisa.register_load(reg, s_i[0:1, :])
    w = {}
    kv = []
    for nmw_on_src in (("k", do_k, wk), ("v", do_v, wv)):
        nmw, on, src = nmw_on_src
        if on:
            w[nmw] = nl.ndarray((P, KT, D), act, buffer=nl.sbuf, name=f"pf_kv_w{nmw}")
            kv.append((w[nmw], src))
    for j in range(KT):
        for dst_src in kv:
            dst, src = dst_src
            nisa.dma_copy(dst=dst[:, j], src=src[j * P:(j + 1) * P, :])
    if do_k:
        nw = nl.ndarray((P, 1, D), F32, buffer=nl.sbuf, name="pf_kv_norm_w")
        nisa.dma_copy(dst=nw[:, 0, :], src=norm_w.ap(pattern=[[0, P], [1, D]], offset=D))
        w["norm"] = nw
    XR = 3                                       # xT tiles in flight
    xs = []
    for i in range(min(XR, NT)):
        xs.append(nl.ndarray((P, KT, P), act, buffer=nl.sbuf, name=f"pf_kv_xT_tile{i}"))
        _load_x(g, xs, xT, i)
    sums = nl.ndarray((P, NT), F32, buffer=nl.sbuf, name="pf_kv_row_sums")
    rows = None
    for t in range(NT):
        x = xs[t % XR]
        ps = {}
        for nmw in ("k", "v"):
            if nmw in w:
                bank = nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name=f"pf_kv_{nmw}_psum")
                ps[nmw] = bank[:, 0:D]
        for j in range(KT):
            for nmw in ("k", "v"):
                if nmw in ps:
                    nisa.nc_matmul(dst=ps[nmw], stationary=x[:, j, :], moving=w[nmw][:, j, :], accumulate=j > 0)
        if t + XR < NT:                          # tile t's slot is free once its projections are issued
            _load_x(g, xs, xT, t + XR)
        nt = min(P, N - t * P)
        rows = [[D, nt], [1, D]]
        if do_k:
            qk = nl.ndarray((P, 1, D), act, buffer=nl.sbuf, name="pf_kv_k_raw")
            nisa.tensor_copy(dst=qk[:, 0, :], src=ps["k"], engine=ACT_ENG)
            kn = _norm_rope(g, w, qk, 1, t, cos, sin, eps)
            nisa.dma_copy(dst=k_cache.ap(pattern=rows, offset=t * P * D, scalar_offset=reg, indirect_dim=1),
                          src=kn[0:nt, 0, :])
            nisa.tensor_reduce(dst=sums[:, t:t + 1], op=nl.add, data=kn[:, 0, :], axis=1)
        else:
            vt = nl.ndarray((P, D), act, buffer=nl.sbuf, name="pf_kv_v_tok")
            nisa.tensor_copy(dst=vt, src=ps["v"], engine=DVE_ENG)
            nisa.dma_copy(dst=v_cache.ap(pattern=rows, offset=t * P * D, scalar_offset=reg, indirect_dim=1),
                          src=vt[0:nt, :])
            nisa.tensor_reduce(dst=sums[:, t:t + 1], op=nl.add, data=vt, axis=1)
        if do_k and do_v:                        # LNC=1: this core writes V too
            vt = nl.ndarray((P, D), act, buffer=nl.sbuf, name="pf_kv_v_tok")
            nisa.tensor_copy(dst=vt, src=ps["v"], engine=DVE_ENG)
            nisa.dma_copy(dst=v_cache.ap(pattern=rows, offset=t * P * D, scalar_offset=reg, indirect_dim=1),
                          src=vt[0:nt, :])
            vs = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_kv_v_sum")
            nisa.tensor_reduce(dst=vs, op=nl.add, data=vt, axis=1)
            nisa.tensor_tensor(dst=sums[:, t:t + 1], data1=sums[:, t:t + 1], data2=vs, op=nl.add)
    # pad rows of a partial last tile project zero columns (finite): no mask needed
    # (|sum| <= FLT_MAX is false for NaN and +-Inf); bad = P NT - finite rows (exact in fp32)
    fin = nl.ndarray((P, NT), F32, buffer=nl.sbuf, name="pf_kv_row_finite")
    nisa.tensor_scalar(dst=fin, data=sums, op0=nl.abs, operand0=None, op1=nl.less_equal, operand1=FP32_FINITE)
    fin_rows = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_kv_finite_rows")
    nisa.tensor_reduce(dst=fin_rows, op=nl.add, data=fin, axis=1)
    ones = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="pf_kv_ones")
    nisa.memset(dst=ones, value=1.0, engine=POOL_ENG)
    tot = nl.ndarray((1, 1), F32, buffer=nl.psum, name="pf_kv_finite_psum")
    nisa.nc_matmul(dst=tot, stationary=fin_rows, moving=ones, accumulate=False)
    bad = nl.ndarray((1, 1), F32, buffer=nl.sbuf, name="pf_kv_bad")
    nisa.tensor_scalar(dst=bad, data=tot, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(P * NT))
    return bad


@nki.jit
def attention_prefill_kv_kernel(xT, wk, wv, norm_w, cos, sin, k_cache, v_cache, start, eps=1e-6):
    """Wrapper of :func:`kv_rows_body`: HBM in, HBM out (``attention_prefill_kernel``'s argument layouts without
    wqg / wo). Launch ``[2]`` (core 0 writes K, core 1 V) or without a grid. Returns ``(bad [n_cores, 1]
    float32, k_cache, v_cache)``: core c's count of non-finite rows and the caches, mutated at rows
    start..start+N-1."""
    n_cores, core = program_sharding()
    bad_out = nl.ndarray((n_cores, 1), F32, buffer=nl.shared_hbm, name="attention_prefill_kv_bad")
    bad = kv_rows_body(xT, wk, wv, norm_w, cos, sin, k_cache, v_cache, start, eps, core, n_cores)
    nisa.dma_copy(dst=bad_out[core:core + 1, :], src=bad)
    return bad_out, k_cache, v_cache


# ---- host-side helpers ----------------------------------------------------------------------------------
def kernel_args(layout: dict, x, k_cache, v_cache, start: int, cfg, key_block: int = KEY_BLOCK,
                static_start=None):
    """The positional arguments of :func:`attention_prefill_kernel` for normed x ``[N, H]`` at positions
    start..start+N-1 (caches passed through: numpy arrays are updated in place by the launch)."""
    N = x.shape[0]
    cos, sin = rope_tables(start, N, cfg.rotary_dim, cfg.rope_theta)
    return (xT_layout(x), layout["wqg"], layout["wk"], layout["wv"], layout["wo"], layout["norm_w"], cos, sin,
            k_cache, v_cache, np.array([[start]], np.int32), float(cfg.rms_norm_eps), key_block, static_start)


def run_attention_prefill(layout: dict, x, k_cache, v_cache, start: int, cfg, lnc: int = 2,
                          key_block: int = KEY_BLOCK, check_finite: bool = True, return_stats: bool = False):
    """Host convenience: launch :func:`attention_prefill_kernel` (``[lnc]``) on the normed chunk x ``[N, H]`` at
    positions start..start+N-1; the caches (numpy or torch ``[1, L, D]``) are updated in place. Returns the
    per-core partials ``[lnc, N, H]`` float32 (and the stats ``[lnc, 3]`` with ``return_stats``). Raises
    ``FloatingPointError`` when the kernel reports non-finite output rows (``check_finite``)."""
    args = kernel_args(layout, x, k_cache, v_cache, start, cfg, key_block=key_block)
    kernel = attention_prefill_kernel if lnc == 1 else attention_prefill_kernel[lnc]
    out, stats, _, _ = kernel(*args)
    bad = float(np.asarray(stats)[:, 2].sum())
    if check_finite and bad > 0:
        raise FloatingPointError(f"attention_prefill: {int(bad)} output rows are not finite (NaN or Inf in the "
                                 f"hidden states, the weights or the cache rows 0..{start + x.shape[0] - 1})")
    return (out, stats) if return_stats else out
