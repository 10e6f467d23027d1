"""Sparse MoE decode subkernel (``moe_tkg``): router, routed experts and the sigmoid-gated shared
expert of one layer for T = 1..4 tokens, on one TP rank (its LNC cores split the work).

Math (shared/docs/qwen36.md §4.4; twin: ``model/tp/moe.py``, ``moe_rank``)::

    logits = x Wr^T (rounded to the activation dtype, as F.linear)      [T, E]
    p      = softmax(logits) in fp32; top-k; w = p_top / sum(p_top)      ties -> LOWER expert index
    y      = sum_e w_e.to(dtype) * down_e(silu(gate_e x) * up_e x)     on the rank's intermediate slice
           + sigmoid(w_seg . x) * shared(x)                              (w_seg . x rounded like F.linear)

SBUF layouts (nki_kernels/README.md): input ``xT [P, H/P, T]`` (feature-major), output the core's
partial ``y [T, H]`` float32. P = 128 partitions.

Design
------
**Router.** Under LNC = 2 each core reads half of the router rows (512 KiB of the 1 MiB bf16 at the
real shapes) and computes those logits, and the halves are swapped with ``sendrecv``; every later
routing step runs on both cores on identical data, so both cores agree. The shared-expert gate
weight rides as an extra column of each core's router block (one accumulation over the H/P
contraction blocks gives logits and gate logit). Logits are rounded to the activation dtype, and
softmax runs in fp32 (``exp`` with the per-token max as bias, ``reciprocal`` of the sum). The top-k
SET is exact with lower-index ties and needs nothing but ``max8`` values (documented: the 8 largest
values, descending): with ``v`` = max8(p) and ``vk = v[k-1]``, every expert with ``p > vk`` is
selected, and among the experts with ``p == vk`` the ``need = k - #{p > vk}`` lowest indices are:
a key ``(p == vk) * (E - e)`` is unique per tied expert, ``max8`` of it lists them lowest index
first, and its ``need``-th value is the key threshold. No instruction's handling of equal values
is relied on (``nc_find_index8`` is not used: its docstring says "first occurrence" and leaves
duplicated ``vals`` unspecified). The renormalised weights (sum of the top-k values = sum of
``v[:k]``) are rounded to the activation dtype like the twin's ``weights.to(x.dtype)``.

**Dedup of the T*k choices.** The union of the tokens' selections (a ones-vector matmul counts the
tokens choosing each expert) is turned into a list of distinct expert ids, ascending, by repeated
``max8`` over the key ``(count > 0) * (E - e)`` (unique per expert, so again no tie semantics); at
most ``S = min(T*k, E)`` slots, of which the first k are always valid (one token alone selects k
distinct experts) and the rest valid iff their key is non-zero. A one-hot matmul gathers, per slot,
the column of per-token weights ``Wsel[t, s] = w[t, id_s]`` (0 for a token that did not choose it).
Slot s then reads expert ``id_s`` ONCE and runs it on all T tokens as a T-wide matmul, each token's
activation scaled by its own weight (0 when it did not choose the expert).

**Run-time addressing.** ``id_s`` goes to a register (``register_load``) that is the
``scalar_offset`` of the expert block's DMA (``experts.ap(..., scalar_offset=reg, indirect_dim=0)``,
HWDGE). Slots k..S-1 are wrapped in ``nl.fori_loop(0, flag_s, body)`` with ``flag_s`` in {0, 1}: a
run-time conditional (the nki-library "conditional iteration" pattern), so an invalid slot moves no
byte and computes nothing, and the nkisim trace of an executing run shows exactly the distinct
experts' DMAs. Nothing branches in Python on data. No PSUM value is live across a device loop (loop
state is carried in SBUF, SDK-NL fori_loop; neuronx-cc rejects PSUM written inside a device loop but
allocated outside it, NCC_IBIR092): the shared expert and the always-valid slots accumulate in PSUM in
straight-line code with no loop inside the accumulation group, which is evicted to an SBUF fold before
the first conditional slot; each conditional slot computes into a PSUM bank allocated inside its loop
body and adds it into that SBUF fold. A table argument's every element offset fits int32 (SDK-LG "NKI
Values"); stacked tables are therefore split into groups of layers (``megakernel.sharded``).

**Weight stream.** Host-side, each expert's slice for (rank, core) is one contiguous
``[P, F]`` block, partition-major (a 6 KiB run per partition at the real bf16 shapes, one DMA of
768 KiB per expert per core): the gate|up columns contraction-major ``[P, H/P, 2*ic]`` and the down
rows folded over the partitions, ``R = P / ic`` row groups each holding ``H / R`` columns. The ring
of ``D = min(prefetch, S, SBUF budget)`` buffers takes the first D slots' DMAs before any expert compute
(software pipelined in program order: slot s + D reuses slot s's buffer once slot s has run; a
conditional slot's fetch that would fall inside the PSUM accumulation group of the always-valid slots
is issued right after that group is evicted, so with D < S some conditional DMAs start later); the
shared expert and router weights are issued first, before the routing is known.

**Expert compute** (per slot, per core, ``ic`` = intermediate columns of the core):
``gu[T, 2ic] = sum_j xT[:, j, :]^T W_gu[j]`` (H/P matmuls, weights moving, PSUM), ``silu`` on ACT,
``a = silu(g) * w_tok * u`` on DVE (fp32), one PE transpose to ``a^T``, masked into a block-diagonal
stationary ``Z [P, R*T]`` (``Z[g*ic+i, g*T+t] = a[t, i]``) so that ONE matmul per 512-column bank
with the folded down block (K = 128) yields the folded output ``[R*T, H/R]``: ``y[t, g*H/R + c] =
out[g*T + t, c]``. At the real shapes (ic = 64, R = 2) this halves the down matmuls and the
free-size of the per-slot accumulation. The folded sum is unfolded into ``y [T, H]`` at the end by
R SBUF->SBUF DMAs.

**LNC = 2.** The two cores split the rank's intermediate columns (64 + 64 of 128), so each core
reads exactly half of every selected expert: the DMA split is balanced whatever the number of
distinct experts, and both cores run identical control flow (required for device loops under
LNC = 2). Each core returns its own partial; the wrapper writes ``out[core]``.

ACT table use: ``exp`` (softmax, and the gate as ``1 / (1 + exp(-z))``) then ``silu`` for every
expert: two table loads, no thrash.

**Traces.** An executing nkisim run traces exactly the slots that ran: k + (distinct experts - k)
routed-expert DMAs of one block each (``routed_expert_bytes``). In shape-only mode the registers read
0: the k always-valid slots fetch expert 0 and the conditional slots run zero times, i.e. the trace
shows the minimum traffic (all tokens agreeing on k experts); every further distinct expert adds one
identical block (``expert_block_bytes``) and one slot's instructions.
"""

from __future__ import annotations

import numpy as np
import torch

import nki
import nki.isa as nisa
import nki.language as nl

from nki_kernels.common import INT32_MAX, PSUM_BANK, P, layer_of, layer_offset, program_sharding
MAX8 = 8           # values per max8 (SDK-ISA max8)
RING_BUDGET = 120 * 1024   # SBUF bytes per partition the expert ring may take


# ---------------------------------------------------------------------------------------------
# geometry: the one home of the HBM block layout, shared by the host helpers and the kernel
# ---------------------------------------------------------------------------------------------

def fold_groups(inter_core: int) -> int:
    """R: row groups of the down block folded over the 128 partitions (R * inter_core = 128)."""
    if inter_core < 1 or P % inter_core:
        raise ValueError(f"moe: {inter_core} intermediate columns per core; the kernel needs a divisor of {P} "
                         f"(the down block is folded over the {P} partitions)")
    return P // inter_core


def block_width(inter_core: int, hidden: int) -> int:
    """Free size F of one expert block [P, F]: gate|up [P, (H/P)*2*ic] then folded down [P, H/R]."""
    return (hidden // P) * 2 * inter_core + hidden // fold_groups(inter_core)


def _geometry(width, hidden, what):
    """(ic, R, H/R, down offset, chunks) of a block of free size ``width`` (the unique ic that fits)."""
    hits = []
    for ic in range(1, P + 1):
        if P % ic == 0 and block_width(ic, hidden) == width:
            hits.append(ic)
    if len(hits) != 1:
        raise ValueError(f"moe_tkg: {what} block has free size {width}, which is not the layout of "
                         f"block_width(ic, H={hidden}) for exactly one ic dividing {P} (got {hits})")
    ic = hits[0]
    R = P // ic
    HR = hidden // R
    chunks = []
    c0 = 0
    while c0 < HR:
        chunks.append((c0, min(PSUM_BANK, HR - c0)))
        c0 += PSUM_BANK
    return {"ic": ic, "R": R, "HR": HR, "off_d": (hidden // P) * 2 * ic, "F": width, "chunks": chunks}


# ---------------------------------------------------------------------------------------------
# host-side layout helpers (torch; run once per checkpoint)
# ---------------------------------------------------------------------------------------------

def layers_per_table(layer_elems: int) -> int:
    """How many layers' expert tables of ``layer_elems`` elements each may be stacked into one HBM tensor so
    that every element offset (and the end offset) fits int32: the stacking group size of the megakernel."""
    if not 0 < layer_elems <= INT32_MAX:
        raise ValueError(f"moe: one layer's expert table of {layer_elems} elements does not fit int32 offsets")
    return INT32_MAX // layer_elems


def expert_blocks(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, n_cores: int) -> torch.Tensor:
    """One rank's expert slices in PyTorch layout -> the kernel's HBM blocks.

    gate, up: [E, I_r, H]; down: [E, H, I_r] (``model.tp.moe.shard_moe``). Core c takes intermediate
    columns ``c*ic .. (c+1)*ic - 1``, ``ic = I_r / n_cores``. Returns ``[E, n_cores, P, F]`` (same
    dtype, contiguous), F = ``block_width(ic, H)``: block[e, c, p, j*2ic + n] = gate|up[e, c*ic + n, j*P + p]
    (n < ic gate, else up), and block[e, c, g*ic + i, off_d + col] = down[e, g*(H/R) + col, c*ic + i].
    """
    E, inter, H = gate.shape
    if up.shape != gate.shape or down.shape != (E, H, inter):
        raise ValueError(f"expert_blocks: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)}: "
                         f"expected [E, I, H], [E, I, H], [E, H, I]")
    if H % P:
        raise ValueError(f"expert_blocks: hidden size {H} is not a multiple of {P}")
    if inter % n_cores:
        raise ValueError(f"expert_blocks: {inter} intermediate columns do not split over {n_cores} cores")
    ic = inter // n_cores
    R = fold_groups(ic)
    J, HR = H // P, H // R
    gu = torch.cat([gate.reshape(E, n_cores, ic, H), up.reshape(E, n_cores, ic, H)], dim=2)
    gu = gu.reshape(E, n_cores, 2 * ic, J, P).permute(0, 1, 4, 3, 2).reshape(E, n_cores, P, J * 2 * ic)
    d = down.reshape(E, H, n_cores, ic).permute(0, 2, 3, 1)                      # [E, C, ic, H]
    d = d.reshape(E, n_cores, ic, R, HR).permute(0, 1, 3, 2, 4).reshape(E, n_cores, P, HR)
    return torch.cat([gu, d], dim=3).contiguous()


def router_block(router: torch.Tensor, shared_expert_gate: torch.Tensor, n_cores: int = 2) -> torch.Tensor:
    """[E, H] router and [1, H] shared-expert gate -> [n_cores, P, H/P, E/n_cores + 1]: core c's block
    holds experts c*E/n_cores .. (c+1)*E/n_cores - 1 and, in its last column, the gate (both cores
    need it); element (c, p, j, n) = W_c[n, j*P + p], partition-major (one contiguous run per partition)."""
    E, H = router.shape
    if shared_expert_gate.shape != (1, H):
        raise ValueError(f"router_block: shared_expert_gate {list(shared_expert_gate.shape)}, expected [1, {H}]")
    if H % P:
        raise ValueError(f"router_block: hidden size {H} is not a multiple of {P}")
    if E % n_cores:
        raise ValueError(f"router_block: {E} experts do not split over {n_cores} cores")
    Eh = E // n_cores
    w = router.reshape(n_cores, Eh, H)
    w = torch.cat([w, shared_expert_gate.to(router.dtype).expand(n_cores, 1, H)], 1)      # [C, Eh+1, H]
    return w.transpose(1, 2).reshape(n_cores, H // P, P, Eh + 1).permute(0, 2, 1, 3).contiguous()


def moe_hbm_layout(shard: dict[str, torch.Tensor], n_cores: int = 2) -> dict[str, torch.Tensor]:
    """A rank's shard (``model.tp.moe.shard_moe``) -> the kernel's HBM tensors:
    ``router`` [n_cores, P, H/P, E/n_cores + 1], ``experts`` [E, n_cores, P, F], ``shared`` [n_cores, P, Fs]."""
    return {
        "router": router_block(shard["router"], shard["shared_expert_gate"], n_cores),
        "experts": expert_blocks(shard["gate"], shard["up"], shard["down"], n_cores),
        "shared": expert_blocks(shard["shared_gate"][None], shard["shared_up"][None], shard["shared_down"][None],
                                n_cores)[0],
    }


# ---------------------------------------------------------------------------------------------
# kernel body
# ---------------------------------------------------------------------------------------------

def _route(xT, r_sb, top_k, S, lnc, pid):
    """Router on SBUF: returns (gate [T, 1] f32, wsel [T, S] f32, ids [1, S] int32, flags [1, S] int32).

    r_sb [P, H/P, E/lnc + 1] holds this core's experts and the gate column; the halves of the logits
    are exchanged between the cores (sendrecv) so that both see all E logits.
    ids[s] is the s-th distinct selected expert (ascending), E when slot s is unused (flags[s] = 0).
    wsel[t, s] is token t's renormalised weight (rounded to the activation dtype) for expert ids[s].
    """
    _, J, T = xT.shape
    Eh = r_sb.shape[2] - 1
    E = Eh * lnc
    adt = xT.dtype
    f32 = nl.float32
    k = top_k

    # this core's logits | the gate logit, rounded to the activation dtype like F.linear
    lg_ps = nl.ndarray((T, Eh + 1), dtype=f32, buffer=nl.psum)
    for j in range(J):
        nisa.nc_matmul(dst=lg_ps, stationary=xT[:, j, :], moving=r_sb[:, j, :], accumulate=j > 0)
    lg = nl.ndarray((T, E + 1), dtype=adt, buffer=nl.sbuf)        # [all E logits | gate logit]
    if lnc == 1:
        nisa.tensor_copy(dst=lg, src=lg_ps)
    else:                   # whole tiles through sendrecv (a strided part of a tile is not delivered)
        mine = nl.ndarray((T, Eh), dtype=adt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=mine, src=lg_ps[:, 0:Eh])
        theirs = nl.ndarray((T, Eh), dtype=adt, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=theirs, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        nisa.tensor_copy(dst=lg[:, E:E + 1], src=lg_ps[:, Eh:Eh + 1])
        nisa.tensor_copy(dst=lg[:, pid * Eh:(pid + 1) * Eh], src=mine)
        nisa.tensor_copy(dst=lg[:, (1 - pid) * Eh:(2 - pid) * Eh], src=theirs)

    # softmax (fp32): p = exp(l - max) / sum
    nmx = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=nmx, op=nl.maximum, data=lg[:, 0:E], axis=1, negate=True)
    ex = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    ssum = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=ex, op=nl.exp, data=lg[:, 0:E], bias=nmx, reduce_op=nl.add, reduce_res=ssum,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    rsum = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rsum, data=ssum)
    p = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=p, data=ex, op0=nl.multiply, operand0=rsum)

    # shared-expert gate sigmoid(z) = 1 / (1 + exp(-z)): exp keeps ACT on one table
    ez = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=ez, op=nl.exp, data=lg[:, E:E + 1], scale=-1.0)
    ez1 = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ez1, data=ez, op0=nl.add, operand0=1.0)
    gate = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.reciprocal(dst=gate, data=ez1)

    # constants: rev[e] = E - e (keys), jj = 0..7
    rev = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.iota(dst=rev, pattern=[[-1, E]], offset=E)
    jj = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.iota(dst=jj, pattern=[[1, MAX8]], offset=0)

    # exact top-k set, ties to the lower index
    v8 = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.max8(dst=v8, src=p)
    vk = v8[:, k - 1:k]
    gt = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=gt, data=p, op0=nl.greater, operand0=vk)
    c8 = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=c8, data=v8, op0=nl.greater, operand0=vk)
    ngt = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=ngt, op=nl.add, data=c8, axis=1)
    last = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)          # need - 1 = k - 1 - #(p > vk)
    nisa.tensor_scalar(dst=last, data=ngt, op0=nl.multiply, operand0=-1.0, op1=nl.add, operand1=float(k - 1))
    key = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)           # (p == vk) * (E - e): unique per tied expert
    nisa.scalar_tensor_tensor(dst=key, data=p, op0=nl.equal, operand0=vk, op1=nl.multiply, operand1=rev)
    kt8 = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.max8(dst=kt8, src=key)
    pick = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=pick, data=jj, op0=nl.equal, operand0=last, op1=nl.multiply, operand1=kt8)
    thr = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)           # key of the last tied expert admitted
    nisa.tensor_reduce(dst=thr, op=nl.add, data=pick, axis=1)
    sel = nl.ndarray((T, E), dtype=adt, buffer=nl.sbuf)           # 0/1 selection mask
    nisa.scalar_tensor_tensor(dst=sel, data=key, op0=nl.greater_equal, operand0=thr, op1=nl.add, operand1=gt)

    # renormalised weights, rounded to the activation dtype: w = sel * p / sum(v8[:k])
    vsum = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=vsum, op=nl.add, data=v8[:, 0:k], axis=1)
    rv = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rv, data=vsum)
    w = nl.ndarray((T, E), dtype=adt, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=w, data=sel, op0=nl.multiply, operand0=rv, op1=nl.multiply, operand1=p)

    # union over tokens -> distinct expert ids, ascending (key (count > 0) * (E - e), max8 rounds)
    ones_t = nl.ndarray((T, 1), dtype=adt, buffer=nl.sbuf)
    nisa.memset(dst=ones_t, value=1.0)
    cnt_ps = nl.ndarray((1, E), dtype=f32, buffer=nl.psum)
    nisa.nc_matmul(dst=cnt_ps, stationary=ones_t, moving=sel, accumulate=False)
    ukey = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=ukey, data=cnt_ps, op0=nl.greater, operand0=0.0, op1=nl.multiply,
                              operand1=rev[0:1, :])
    rounds = -(-S // MAX8)
    keys = nl.ndarray((1, rounds * MAX8), dtype=f32, buffer=nl.sbuf)
    for r in range(rounds):
        nisa.max8(dst=keys[:, r * MAX8:(r + 1) * MAX8], src=ukey)
        if r + 1 < rounds:
            nxt = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)
            nisa.scalar_tensor_tensor(dst=nxt, data=ukey, op0=nl.less,
                                      operand0=keys[:, (r + 1) * MAX8 - 1:(r + 1) * MAX8],
                                      op1=nl.multiply, operand1=ukey)
            ukey = nxt
    ids_f = nl.ndarray((1, S), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ids_f, data=keys[:, 0:S], op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=float(E))
    ids = nl.ndarray((1, S), dtype=nl.int32, buffer=nl.sbuf, name="moe_expert_ids")
    nisa.tensor_copy(dst=ids, src=ids_f)
    flags = nl.ndarray((1, S), dtype=nl.int32, buffer=nl.sbuf, name="moe_slot_flags")
    nisa.tensor_scalar(dst=flags, data=keys[:, 0:S], op0=nl.greater, operand0=0.0)

    # per-slot token weights wsel[t, s] = w[t, ids[s]] = sum_e w[t, e] * (e == ids[s]) (one-hot matmul)
    ones_r = nl.ndarray((1, P), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=ones_r, value=1.0)
    idb = nl.ndarray((P, S), dtype=f32, buffer=nl.psum)           # ids broadcast to every partition
    nisa.nc_matmul(dst=idb, stationary=ones_r, moving=ids_f, accumulate=False)
    ident = nl.shared_identity_matrix(T, dtype=adt)
    ws_ps = nl.ndarray((T, S), dtype=f32, buffer=nl.psum)
    n_chunks = -(-E // P)
    for c in range(n_chunks):
        pc = min(P, E - c * P)
        ecol = nl.ndarray((pc, 1), dtype=f32, buffer=nl.sbuf)
        nisa.iota(dst=ecol, pattern=[[0, 1]], offset=c * P, channel_multiplier=1)
        onehot = nl.ndarray((pc, S), dtype=adt, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=onehot, data=idb[0:pc, :], op0=nl.equal, operand0=ecol)
        wt_ps = nl.ndarray((pc, T), dtype=f32, buffer=nl.psum)    # w[:, chunk]^T via the identity
        nisa.nc_matmul(dst=wt_ps, stationary=w[:, c * P:c * P + pc], moving=ident, accumulate=False)
        wt = nl.ndarray((pc, T), dtype=adt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wt, src=wt_ps)
        nisa.nc_matmul(dst=ws_ps, stationary=wt, moving=onehot, accumulate=c > 0)
    wsel = nl.ndarray((T, S), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wsel, src=ws_ps)
    return gate, wsel, ids, flags


def _fold_mask(ic, T):
    """[P, R*T] f32: mask[q, g*T + t] = 1 iff partition q belongs to row group g (q // ic == g)."""
    R = P // ic
    v = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=v, pattern=[[-ic, R], [0, T]], offset=0, channel_multiplier=1)     # q - g*ic
    lo = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lo, data=v, op0=nl.greater_equal, operand0=0.0)
    mask = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=mask, data=v, op0=nl.less, operand0=float(ic), op1=nl.multiply, operand1=lo)
    return mask


def _expert_mlp(xT, wbuf, geo, wcol, mask, acc_ps, acc_sb, first):
    """One expert block (SBUF [P, F]) on all T tokens, scaled per token by wcol [T, 1] f32.

    Adds the folded output [R*T, H/R] into acc_ps (PSUM, static code: ``first`` overwrites) or, when
    acc_ps == None (inside a device loop), through a local PSUM bank into acc_sb (SBUF f32)."""
    _, J, T = xT.shape
    adt = xT.dtype
    f32 = nl.float32
    ic, R, off_d = geo["ic"], geo["R"], geo["off_d"]
    gu = nl.ndarray((T, 2 * ic), dtype=f32, buffer=nl.psum)
    for j in range(J):
        nisa.nc_matmul(dst=gu, stationary=xT[:, j, :], moving=wbuf[:, j * 2 * ic:(j + 1) * 2 * ic],
                       accumulate=j > 0)
    h = nl.ndarray((T, ic), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.silu, data=gu[:, 0:ic])
    a = nl.ndarray((T, R * ic), dtype=f32, buffer=nl.sbuf)          # silu(g) * w_tok * u, repeated R times
    nisa.scalar_tensor_tensor(dst=a, data=h.ap(pattern=[[ic, T], [0, R], [1, ic]], offset=0),
                              op0=nl.multiply, operand0=wcol, op1=nl.multiply,
                              operand1=gu.ap(pattern=[[2 * ic, T], [0, R], [1, ic]], offset=ic))
    aT = nl.ndarray((P, T), dtype=f32, buffer=nl.psum)
    nisa.nc_transpose(dst=aT, data=a, engine=nisa.engine.tensor)
    z = nl.ndarray((P, R * T), dtype=adt, buffer=nl.sbuf)           # block-diagonal stationary
    if R == 1:
        nisa.tensor_copy(dst=z, src=aT)
    else:
        nisa.tensor_tensor(dst=z, data1=aT.ap(pattern=[[T, P], [0, R], [1, T]], offset=0), data2=mask,
                           op=nl.multiply)
    for c0, n in geo["chunks"]:
        mov = wbuf[:, off_d + c0:off_d + c0 + n]
        if acc_ps != None:
            nisa.nc_matmul(dst=acc_ps[:, c0:c0 + n], stationary=z, moving=mov, accumulate=not first)
        else:
            loc = nl.ndarray((R * T, n), dtype=f32, buffer=nl.psum)
            nisa.nc_matmul(dst=loc, stationary=z, moving=mov, accumulate=False)
            nisa.tensor_tensor(dst=acc_sb[:, c0:c0 + n], data1=acc_sb[:, c0:c0 + n], data2=loc, op=nl.add)


def _acc_of(accs, R):
    """The accumulator entry ``[R, psum, sbuf fold, written]`` of fold factor R in ``accs``, or None."""
    for a in accs:
        if a[0] == R:
            return a
    return None


def _issue(stream, s):
    """Issue the expert DMA of slot s into its ring buffer (``stream``: the table, ring and registers of
    :func:`moe_tkg_body`). Slots below top_k always run (a single token selects top_k distinct experts);
    slot s >= top_k is a 0/1-trip runtime loop on its flag, so an unused slot moves no byte."""
    if s >= stream["S"]:
        return
    D = len(stream["ring"])
    buf, rid = stream["ring"][s % D], stream["id_regs"][s % D]
    nisa.register_load(rid, stream["ids"][0:1, s:s + 1])
    if s < stream["top_k"]:
        _expert_dma(stream, buf, rid)
        return
    rf = stream["flag_regs"][s % D]
    nisa.register_load(rf, stream["flags"][0:1, s:s + 1])

    def fetch(i):
        _expert_dma(stream, buf, rid)

    nl.fori_loop(0, rf, fetch)


def _conditional_slot(xT, buf, geo, wcol, mask, acc_sb, flag):
    """Slot of ring buffer buf iff the register ``flag`` is 1: :func:`_expert_mlp` into the SBUF fold acc_sb."""
    def compute(i):
        _expert_mlp(xT, buf, geo, wcol, mask, None, acc_sb, False)

    nl.fori_loop(0, flag, compute)


def _expert_dma(stream, buf, rid):
    """buf [P, F] <- the block of expert ``rid`` (a register) of this core: HWDGE, scalar offset on the
    expert axis of the base table."""
    F = stream["F"]
    nisa.dma_copy(dst=buf, src=stream["table"].ap(pattern=[[F, P], [1, F]], offset=stream["offset"],
                                                  scalar_offset=rid, indirect_dim=stream["edim"]),
                  dge_mode=nisa.dge_mode.hwdge)


def moe_tkg_body(xT, router, experts, shared, top_k, prefetch=8, regs=None, layer=None, experts_layer=None):
    """Sparse MoE of T tokens on one core: SBUF xT in, SBUF partial y out.

    xT:      SBUF [P, H/P, T] activation dtype (bfloat16 or float32), element (p, j, t) = x[t, j*P + p]
    router:  HBM [n_cores, P, H/P, E/n_cores + 1] (``router_block``): each core's router rows and the
             shared-expert gate
    experts: HBM [E, n_cores, P, F] (``expert_blocks``), n_cores = the launch's LNC degree -- a whole
             tensor, or with ``experts_layer`` a stacked table [G, E, n_cores, P, F] of G layers (the
             run-time-addressed DMA uses ``.ap()``, which addresses the base tensor, not a view)
    shared:  HBM [n_cores, P, Fs] (``expert_blocks`` of the shared expert)
    top_k:   experts per token (<= 8); prefetch: expert buffers in the ring (DMAs in flight + 1)
    regs:    optional tuple of 2 * ring-depth registers to reuse (a megakernel composing many layers
             passes one pool); allocated here when None.
    layer:   with stacked router [M, ...] and shared [M, ...] (``megakernel.plan``), this layer's index in them.
    experts_layer: with a stacked experts table, this layer's index in it (nki_kernels/common.py "Stacked
             tensors"). None / None: one layer's tensors.
    Returns y: SBUF [T, H] float32, this core's partial (sum over cores and ranks = MoE output).
    """
    _, J, T = xT.shape
    H = J * P
    adt = xT.dtype
    f32 = nl.float32
    stacked = experts
    if experts_layer != None:
        if len(experts.shape) != 5 or not 0 <= experts_layer < experts.shape[0]:
            raise ValueError(f"moe_tkg: layer {experts_layer} of stacked experts {list(experts.shape)}: expected "
                             f"[G, E, n_cores, {P}, F] with 0 <= layer < G")
    elif len(experts.shape) != 4:
        raise ValueError(f"moe_tkg: experts {list(experts.shape)}: expected [E, n_cores, {P}, F], or stacked "
                         f"[G, E, n_cores, {P}, F] with experts_layer=")
    router, shared = layer_of(router, layer), layer_of(shared, layer)
    n_elems = 1
    for d in stacked.shape:
        n_elems = n_elems * d
    if n_elems > INT32_MAX:
        raise ValueError(f"moe_tkg: the experts table {list(stacked.shape)} holds {n_elems} elements; its element "
                         f"offsets must fit int32 (SDK-LG 'NKI Values'): stack at most "
                         f"{layers_per_table(n_elems // stacked.shape[0])} layers per table (layers_per_table)")
    base = layer_offset(stacked, experts_layer)     # element offset of this layer's expert table in `stacked`
    experts = layer_of(stacked, experts_layer)
    if xT.shape[0] != P:
        raise ValueError(f"moe_tkg: xT has {xT.shape[0]} partitions, expected {P} (layout [P, H/P, T])")
    if adt not in (nl.bfloat16, nl.float32):
        raise ValueError(f"moe_tkg: activation dtype {adt} is not bfloat16 or float32")
    E, n_cores = experts.shape[0], experts.shape[1]
    if experts.shape[2] != P or E % n_cores or tuple(router.shape) != (n_cores, P, J, E // n_cores + 1):
        raise ValueError(f"moe_tkg: experts {list(experts.shape)} / router {list(router.shape)} do not match "
                         f"H={H}, E={E} (expected [E, n_cores, {P}, F] and [n_cores, {P}, {J}, E/n_cores + 1])")
    for nm, t in (("router", router), ("experts", experts), ("shared", shared)):
        if t.dtype != adt:
            raise ValueError(f"moe_tkg: {nm} is {t.dtype} but the activations are {adt}; weights must match")
    if not 1 <= top_k <= MAX8 or E < MAX8 or E + 1 > PSUM_BANK:
        raise ValueError(f"moe_tkg: top_k={top_k}, E={E}: need 1 <= top_k <= {MAX8} and {MAX8} <= E < {PSUM_BANK}")
    if not 1 <= T <= 16:
        raise ValueError(f"moe_tkg: {T} tokens; the decode kernel handles 1..16")
    lnc, pid = program_sharding()
    if n_cores != lnc or tuple(shared.shape[0:2]) != (lnc, P):
        raise ValueError(f"moe_tkg: weights laid out for {n_cores} cores (shared {list(shared.shape)}) but the "
                         f"launch has LNC={lnc}")
    geo = _geometry(experts.shape[3], H, "expert")
    geo_s = _geometry(shared.shape[2], H, "shared-expert")
    for g in (geo, geo_s):
        if g["R"] * T > P:
            raise ValueError(f"moe_tkg: {T} tokens x {g['R']} down-row groups exceed {P} output partitions")
    F, Fs = geo["F"], geo_s["F"]
    S = min(T * top_k, E)

    # 1. weights that do not depend on the routing: router (+gate) and the shared expert
    r_sb = nl.ndarray((P, J, E // lnc + 1), dtype=adt, buffer=nl.sbuf)
    nisa.dma_copy(dst=r_sb, src=router[pid], dge_mode=nisa.dge_mode.hwdge)
    sh = nl.ndarray((P, Fs), dtype=adt, buffer=nl.sbuf)
    nisa.dma_copy(dst=sh, src=shared[pid], dge_mode=nisa.dge_mode.hwdge)

    # 2. routing
    gate, wsel, ids, flags = _route(xT, r_sb, top_k, S, lnc, pid)

    # 3. the expert stream: a ring of D buffers; the first D slots' DMAs are issued before any compute
    D = max(2, min(prefetch, S, RING_BUDGET // (F * (2 if adt == nl.bfloat16 else 4))))
    ring = []
    for i in range(D):
        ring.append(nl.ndarray((P, F), dtype=adt, buffer=nl.sbuf, name=f"moe_expert_buf{i}"))
    if regs == None:
        pool = []
        for i in range(2 * D):
            pool.append(nisa.register_alloc())
        regs = tuple(pool)
    if len(regs) < 2 * D:
        raise ValueError(f"moe_tkg: {len(regs)} registers given, the ring of {D} needs {2 * D}")
    stream = {"table": stacked, "offset": base + pid * P * F, "edim": 0 if experts_layer == None else 1, "F": F,
              "ring": ring, "id_regs": regs[0:D], "flag_regs": regs[D:2 * D], "ids": ids, "flags": flags,
              "top_k": top_k, "S": S}
    for s in range(D):
        _issue(stream, s)

    # 4. the shared expert (weighted by its gate) and the always-valid slots 0..k-1 accumulate in PSUM: one
    # accumulation group per fold factor R, with no runtime loop inside it (a static slot's buffer reuse by a
    # later always-valid slot is a plain DMA; a conditional slot's fetch loop waits until the group is evicted)
    accs = []               # [R, PSUM accumulator, SBUF fold, written yet]
    for g in (geo_s, geo):
        if _acc_of(accs, g["R"]) == None:
            accs.append([g["R"], nl.ndarray((g["R"] * T, g["HR"]), dtype=f32, buffer=nl.psum), None, False])
    mask_s = _fold_mask(geo_s["ic"], T) if geo_s["R"] > 1 else None
    if geo["ic"] == geo_s["ic"]:
        mask = mask_s
    else:
        mask = _fold_mask(geo["ic"], T) if geo["R"] > 1 else None
    acc = _acc_of(accs, geo_s["R"])
    _expert_mlp(xT, sh, geo_s, gate, mask_s, acc[1], None, not acc[3])
    acc[3] = True
    acc = _acc_of(accs, geo["R"])
    for s in range(top_k):
        _expert_mlp(xT, ring[s % D], geo, wsel[:, s:s + 1], mask, acc[1], None, not acc[3])
        acc[3] = True
        if s + D < top_k:
            _issue(stream, s + D)
    for a in accs:          # evict every accumulator before the first runtime loop of the slots
        a[2] = nl.ndarray((a[0] * T, H // a[0]), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a[2], src=a[1])

    # 5. the conditional slots k..S-1: each runs iff its flag is 1 (a 0/1-trip runtime loop), adding into the
    # SBUF fold through a PSUM bank of its own (loop state stays in SBUF)
    for s in range(top_k):
        if s + D >= top_k and s + D < S:
            _issue(stream, s + D)
    acc_sb = _acc_of(accs, geo["R"])[2]
    for s in range(top_k, S):
        _conditional_slot(xT, ring[s % D], geo, wsel[:, s:s + 1], mask, acc_sb, stream["flag_regs"][s % D])
        if s + D < S:
            _issue(stream, s + D)

    # 6. fold back: y[t, g*H/R + c] = fold[g*T + t, c]
    parts = []
    for a in accs:
        R, fold = a[0], a[2]
        if R == 1:
            parts.append(fold)
            continue
        yR = nl.ndarray((T, H), dtype=f32, buffer=nl.sbuf)
        HR = H // R
        for g in range(R):
            nisa.dma_copy(dst=yR[:, g * HR:(g + 1) * HR], src=fold[g * T:(g + 1) * T, :])
        parts.append(yR)
    y = parts[0]
    for extra in parts[1:]:
        total = nl.ndarray((T, H), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=total, data1=y, data2=extra, op=nl.add)
        y = total
    return y


@nki.jit
def moe_tkg(x, router, experts, shared, top_k, prefetch=8):
    """HBM wrapper of :func:`moe_tkg_body`: x [T, H] (activation dtype) -> per-core partials
    [n_cores, T, H] float32 (core c writes row c; the rank's partial is their sum).
    Weights from :func:`moe_hbm_layout` for the launch's LNC degree."""
    T, H = x.shape
    if H % P:
        raise ValueError(f"moe_tkg: hidden size {H} is not a multiple of {P}")
    lnc, pid = program_sharding()
    out = nl.ndarray((lnc, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    xT = nl.ndarray((P, H // P, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, H // P], [H, T]], offset=0))
    y = moe_tkg_body(xT, router, experts, shared, top_k, prefetch)
    nisa.dma_copy(dst=out[pid], src=y)
    return out


# ---------------------------------------------------------------------------------------------
# trace helpers and the demo launch
# ---------------------------------------------------------------------------------------------

def routed_expert_bytes(trace, rank=None):
    """HBM bytes read by the routed-expert DMAs (the scalar-offset reads of the experts table) in an
    nkisim trace, summed over the cores (and ranks, unless ``rank`` is given)."""
    total = 0
    for r in trace.instructions:
        if r["op"] != "dma_copy" or (rank is not None and r.get("rank") != rank):
            continue
        src = [g for g in r["reads"] if g["arg"] == "src"]
        if src and src[0].get("indirect") == "scalar":
            total += r["bytes"].get(src[0]["mem"], {}).get("read", 0)
    return total


def expert_block_bytes(cfg, tp=4, dtype="bfloat16"):
    """Bytes one rank reads for one routed expert (all its cores): 3 * H * I/tp elements."""
    isz = 2 if dtype == "bfloat16" else 4
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp) * isz


def demo_args(cfg, tp=4, T=2, dtype="bfloat16", shape_only=False, lnc=2, seed=0):
    """(kernel, args) of one rank's MoE at the config's shapes, launched LNC=``lnc``: ``kernel(*args)``.

    With shape_only the tensors are ``nkisim.ShapeDtype``: the trace is then that of a launch where
    the register-loaded values read 0 -- every always-valid slot fetches expert 0 and the k..S-1
    conditional slots run zero times, i.e. the minimum traffic (T tokens agreeing on the same k
    experts: k blocks + the shared one). An executing run (shape_only=False, random weights, distinct
    per expert) shows the real data-dependent traffic: one block per DISTINCT selected expert.
    """
    H, E = cfg.hidden_size, cfg.num_experts
    ir, isr = cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp
    F, Fs = block_width(ir // lnc, H), block_width(isr // lnc, H)
    shapes = {"x": (T, H), "router": (lnc, P, H // P, E // lnc + 1), "experts": (E, lnc, P, F),
              "shared": (lnc, P, Fs)}
    if shape_only:
        import nkisim
        args = tuple(nkisim.ShapeDtype(s, dtype) for s in shapes.values())
    else:
        import ml_dtypes
        rng = np.random.default_rng(seed)
        np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        args = []
        for name, s in shapes.items():
            scale = 1.0 if name == "x" else (H ** -0.5)
            args.append((rng.standard_normal(s, dtype=np.float32) * np.float32(scale)).astype(np_dt))
        args = tuple(args)
    return moe_tkg[lnc], args + (cfg.num_experts_per_tok,)
