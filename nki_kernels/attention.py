"""Gated GQA attention of the Qwen3.6 full-attention layers, decode / verify of T = 1..4 tokens, one rank.

Math (shared/docs/qwen36.md §4.2; twin: ``model.tp.attention.attention_rank``): for the rank's Hq_r query
heads (4 at TP=4) sharing ONE KV head, head dim D (256), rotary dims R (64):
q|gate = x Wq (per head: D query then D gate columns), k = x Wk, v = x Wv, all rounded to the activation
dtype; q, k <- zero-centred RMSNorm over D with weight (1 + w); rotate-half RoPE on dims [0, R); the T new K/V
rows are written into the caches at positions p..p+T-1; causal softmax(q k^T / sqrt(D)) v over the cache rows
0..p-1 and the new rows (fp32 softmax); o <- o * sigmoid(gate); y = o Wo (the rank's o_proj partial, fp32).

Layouts
-------
Activations (nki_kernels/README.md): ``xT`` SBUF ``[P, KT, T]`` (feature-major, element (p, j, t) =
x[t, j*P + p], KT = H/128); the body returns ``y`` SBUF ``[T, H]`` float32, this core's partial.

Weights in HBM (contraction-major, built once by :func:`attention_layout` from the rank's PyTorch slice
``model.tp.attention.shard_attention``; LNC-agnostic -- each core DMAs its heads' slice):

* ``wqg``    ``[H, 2, Hq_r, D]`` act dtype: ``wqg[i, 0, h, d]`` = query weight, ``wqg[i, 1, h, d]`` = gate weight
  of the rank's head h (the checkpoint interleaves [q_h; g_h] per head in q_proj's rows; the helper
  de-interleaves it). A core's heads [h0, h0+Hc) are one DMA with 2*KT runs of Hc*D elements per partition.
* ``wk``, ``wv`` ``[H, D]`` act dtype (the rank's KV head).
* ``wo``     ``[Hq_r*D, H]`` act dtype (o_proj transposed: row h*D + d is head h's dim d).
* ``norm_w`` ``[2, D]`` float32: ``(1 + q_norm, 1 + k_norm)`` (the zero-centred offsets resolved on the host).

Inputs by token position (host side, :func:`rope_tables` == ``model.functional.rope_cos_sin``): ``cos``,
``sin`` ``[T, R]`` float32, row t = position p + t (the tables repeat the R/2 frequencies twice). ``pos``:
``[1, 1]`` int32 HBM tensor holding p -- a RUN-TIME value: it becomes DMA offsets (``.ap(scalar_offset=reg)``)
and loop bounds (``nl.fori_loop`` with register bounds); nothing branches on it in Python.

KV caches: ``k_cache``, ``v_cache`` HBM ``[1, L, D]`` act dtype (the rank's KV head, row = position); written
in place at rows p..p+T-1 and also returned. ``L >= kv_tile`` is required (see the head tile below).

On-chip layout of the work (per core, nq = T*Hc query rows, row r = t*Hc + h):

* projections: the stationary operand is a zero-padded replica of xT per head (``xrep[:, h, j, r]`` =
  xT[:, j, t] iff r = t*Hc + h) so that ONE matmul per (j, head) streams that head's [query | gate] weight
  (N = 2D = 512 columns, one PSUM bank) straight into row layout ``[(t, h), D]``; the K projection lands in
  rows nq..nq+T-1 of the same PSUM tile (core 0). Every weight column is streamed exactly once, whatever T.
* q and k rows share one tile ``qk [KP + T, D]`` (query rows 0..nq-1, key rows at partitions KP = 32.. so
  that compute engines may address them: start partitions are 0/32/64/96; rows between are zero) for RMSNorm
  (free-axis reduce) and RoPE (free-axis slices), and are transposed together (PE, matmul against an identity)
  into ``qT [dp, DT, KP + T]`` (d on partitions, DT = D/128 d-tiles): the query columns are the QK^T
  stationary, the key columns the new keys.
* KV tiles of B = ``kv_tile`` keys (512): ``kv [P, B/P, 2, D]``, partition p holds rows 4p..4p+3 (one 2 KiB
  contiguous run per partition and cache); K chunks are transposed on the PE (identity matmul) into
  ``kT [dp, DT, B/P, P]``; **QK^T is split-K over the DT d-tiles, accumulated in one PSUM bank**
  ``S [nq, B]`` (kernel-algorithms §4.3); PV uses P^T chunks as the stationary and V rows as the moving operand
  (``[nq, D]`` in PSUM, no split needed).
* online softmax (fp32): running negated max ``nm``, sum ``l``, output ``O [nq, D]``; the scale 1/sqrt(D) is
  folded into the exp (``exp(scale*S - m)`` on ScalarE, which also emits the row sums).

LNC split
---------
Core c of ``n_cores`` takes query heads [c*Hc, (c+1)*Hc) (Hc = Hq_r / n_cores: 2 of 4) and returns its own
o_proj partial. The KV head is needed by both cores but projected ONCE: core 0 computes k (norm + RoPE) and
writes the K rows, core n_cores-1 computes v and writes the V rows -- each cache row is written exactly once
per call. With LNC=2 the cores then swap their new rows with one ``nisa.sendrecv`` (SBUF<->SBUF, [T, D] each),
so neither core reads a row the other core writes: no core_barrier is needed (the new block is attended from
SBUF; the cache is read only below row p, apart from the masked head tile below). The exchanged tiles are whole
``[T, D]`` tiles on both sides (trn2-costs pitfall: sendrecv into a partial view silently delivers nothing).

KV tiling and how p is applied
------------------------------
Keys are the cache rows 0..p-1 plus the T new rows. With r = p mod B (computed on-chip, ``bitwise_and``):

* main tiles: rows [i, i+B) for i = r, r+B, ..., p-B -- a runtime ``nl.fori_loop(r, p, step=B)`` whose register
  induction variable is the DMA row offset; no masking (every row < p is valid for every query).
* head tile: rows [0, B) with keys >= r masked, run only when r > 0 (a fori_loop with a 0/1 trip count).
  When p < B this tile necessarily reads rows >= p (the cache's first B rows; ``L >= kv_tile``): those rows
  are zeroed in SBUF with a predicated copy (NaN-safe) and masked in the scores. This is the ONLY read of rows
  outside the valid prefix, and only for contexts shorter than one tile.
* new block: the T new keys from SBUF with a static causal mask (key t' visible to query t iff t' <= t).
Masks add NEG = -1e30 (finite: exp underflows to exactly 0, no inf arithmetic).

Shape-only tracing (``max_context``)
------------------------------------
nkisim's shape-only mode reads registers as 0, so the runtime loops above run 0 times. Passing the
compile-time ``max_context = N`` specialises the loop structure to a context of N tokens: the head tile runs
iff N mod B > 0 and the main loop is unrolled into N // B static tiles (DMA offsets still come from the
run-time r). The instruction stream then equals that of a launch at p = N, so a shape-only trace costs
context N. The specialised kernel is correct for every p with p // B == N // B and (p mod B > 0) ==
(N mod B > 0) (tested); leave ``max_context=None`` for the general kernel.
"""

from __future__ import annotations

import numpy as np

import nki
import nki.isa as nisa
import nki.language as nl

P = 128                 # partitions (nkisim.hw.PMAX); a Python int is needed for shapes
KV_TILE = 512           # keys per KV tile: one PSUM bank of fp32 scores (gemm_moving_fmax)
PSUM_COLS = 512         # fp32 columns of one PSUM bank (psum_bank_fmax)
KP = 32                 # partition of the first key row in the q|k tile (a legal compute-engine start)
NEG = -1.0e30           # additive mask: finite, exp(scale*NEG - m) == 0 exactly
M_INIT = 1.0e30         # initial negated running max ("-inf"), finite
F32 = nl.float32
ACT_ENG = nisa.engine.scalar
DVE_ENG = nisa.engine.vector
POOL_ENG = nisa.engine.gpsimd


# ---- geometry ------------------------------------------------------------------------------------
def _geometry(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, n_cores, kv_tile):
    """Validate the arguments; return the dimensions (plain ints) as a dict."""
    Pp, KT, T = xT.shape
    if Pp != P:
        raise ValueError(f"attention: xT has {Pp} partitions, expected {P} (feature-major [P, H/P, T])")
    if not 1 <= T <= 4:
        raise ValueError(f"attention: {T} tokens, this decode/verify kernel takes 1..4")
    H = KT * P
    if len(wqg.shape) != 4 or wqg.shape[0] != H or wqg.shape[1] != 2:
        raise ValueError(f"attention: wqg has shape {list(wqg.shape)}, expected [H={H}, 2, Hq_r, D] "
                         f"(attention_layout)")
    _, _, Hq, D = wqg.shape
    if D > P and D % P:
        raise ValueError(f"attention: head dim {D} must be <= {P} or a multiple of {P} (d-tiles on partitions)")
    if n_cores not in (1, 2) or Hq % n_cores:
        raise ValueError(f"attention: {Hq} query heads do not split over {n_cores} cores")
    Hc = Hq // n_cores
    for nm, w in (("wk", wk), ("wv", wv)):
        if tuple(w.shape) != (H, D):
            raise ValueError(f"attention: {nm} has shape {list(w.shape)}, expected [H={H}, D={D}]")
    if tuple(wo.shape) != (Hq * D, H):
        raise ValueError(f"attention: wo has shape {list(wo.shape)}, expected [Hq_r*D={Hq * D}, H={H}]")
    if tuple(norm_w.shape) != (2, D) or norm_w.dtype != F32:
        raise ValueError(f"attention: norm_w must be float32 [2, D={D}] (1 + q_norm, 1 + k_norm), got "
                         f"{norm_w.dtype}{list(norm_w.shape)}")
    R = cos.shape[1]
    for nm, t in (("cos", cos), ("sin", sin)):
        if len(t.shape) != 2 or t.shape[0] != T or t.shape[1] != R or t.dtype != F32:
            raise ValueError(f"attention: {nm} must be float32 [T={T}, R] (rope tables by position), got "
                             f"{t.dtype}{list(t.shape)}")
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"attention: rotary dims {R} must be even and <= head dim {D}")
    for nm, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if len(c.shape) != 3 or c.shape[0] != 1 or c.shape[2] != D:
            raise ValueError(f"attention: {nm} has shape {list(c.shape)}, expected [1, L, D={D}] (one KV head "
                             f"per rank)")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"attention: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    act = xT.dtype
    for nm, t in (("wqg", wqg), ("wk", wk), ("wv", wv), ("wo", wo), ("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != act:
            raise TypeError(f"attention: {nm} dtype {t.dtype} differs from the activation dtype {act}")
    if act not in (nl.bfloat16, F32):
        raise TypeError(f"attention: activation dtype must be bfloat16 or float32, got {act}")
    if tuple(pos.shape) not in ((1, 1), (1,)) or pos.dtype != nl.int32:
        raise ValueError(f"attention: pos must be an int32 [1, 1] tensor, got {pos.dtype}{list(pos.shape)}")
    B = kv_tile
    if B < P or B > PSUM_COLS or B % P or B & (B - 1):
        raise ValueError(f"attention: kv_tile {B} must be a power of two in [{P}, {PSUM_COLS}]")
    L = k_cache.shape[1]
    if L < B:
        raise ValueError(f"attention: cache length {L} is shorter than one KV tile ({B}); use a smaller kv_tile")
    nq = T * Hc
    if nq > KP:
        raise ValueError(f"attention: {nq} query rows per core exceed {KP} (T * heads per core)")
    dp = min(D, P)
    return dict(T=T, KT=KT, H=H, Hq=Hq, Hc=Hc, D=D, dp=dp, DT=D // dp, R=R, L=L, B=B, NC=B // P,
                nq=nq, nr=KP + T, act=act, sc=float(D) ** -0.5)


# ---- body ----------------------------------------------------------------------------------------
def attention_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=1e-6,
                   core=0, n_cores=1, kv_tile=KV_TILE, max_context=None):
    """Body: this core's gated-attention partial for T tokens (see the module docstring for every layout).

    xT: SBUF ``[P, KT, T]`` act dtype (normed hidden, feature-major). wqg, wk, wv, wo, norm_w: HBM, the rank's
    weights (:func:`attention_layout`). cos, sin: HBM ``[T, R]`` float32. k_cache, v_cache: HBM ``[1, L, D]``
    (rows p..p+T-1 written in place). pos: HBM ``[1, 1]`` int32 (p, run time). eps: rms_norm_eps.
    core / n_cores: this core and the LNC degree (compile time). kv_tile: keys per KV tile. max_context:
    compile-time context specialisation for shape-only traces (module docstring), None = general.
    Returns ``y`` SBUF ``[T, H]`` float32: the o_proj partial over this core's query heads.
    """
    g = _geometry(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, n_cores, kv_tile)
    if not 0 <= core < n_cores:
        raise ValueError(f"attention: core {core} outside 0..{n_cores - 1}")
    g["core"], g["do_k"], g["do_v"] = core, core == 0, core == n_cores - 1
    act, T, nq, nr, D = g["act"], g["T"], g["nq"], g["nr"], g["D"]

    w = _load_weights(g, wqg, wk, wv, wo, norm_w, cos, sin)
    rt = _runtime_scalars(g, pos)
    ident = nl.shared_identity_matrix(P, dtype=act)

    qg, vnew = _project(g, xT, w)                      # qg [nr, 2, D] act (rounded), vnew [T, D] act
    sg = nl.ndarray((nq, D), F32, buffer=nl.sbuf, name="att_sig_gate")
    nisa.activation(dst=sg, op=nl.sigmoid, data=qg[0:nq, 1, :])
    qk = _norm_rope(g, qg, w, eps)                      # [nr, D] act: q rows 0..nq-1, k rows KP..KP+T-1

    # ---- the T new K/V rows: written once (core 0: K, last core: V), swapped between the cores in SBUF
    p_reg = rt["p_reg"]
    rows = [[D, T], [1, D]]
    if g["do_k"]:
        nisa.dma_copy(dst=k_cache.ap(pattern=rows, offset=0, scalar_offset=p_reg, indirect_dim=1), src=qk[KP:nr, :])
    if g["do_v"]:
        nisa.dma_copy(dst=v_cache.ap(pattern=rows, offset=0, scalar_offset=p_reg, indirect_dim=1), src=vnew)
    if n_cores == 2:     # whole [T, D] tiles on both sides
        knew = nl.ndarray((T, D), act, buffer=nl.sbuf, name="att_knew")
        if core == 0:
            nisa.tensor_copy(dst=knew, src=qk[KP:nr, :], engine=DVE_ENG)
            nisa.sendrecv(src=knew, dst=vnew, send_to_rank=1, recv_from_rank=1, pipe_id=0)
        else:
            nisa.sendrecv(src=vnew, dst=knew, send_to_rank=0, recv_from_rank=0, pipe_id=0)
            nisa.tensor_copy(dst=qk[KP:nr, :], src=knew, engine=DVE_ENG)

    qT = _transpose_rows(g, qk, nr, ident, "att_qT")    # [dp, DT, nr] act
    o = _attend(g, qT, vnew, k_cache, v_cache, rt, ident, max_context)   # [nq, D] fp32, normalised

    # ---- gate, back to d-on-partitions, o_proj
    og = nl.ndarray((nq, D), act, buffer=nl.sbuf, name="att_gated")
    nisa.tensor_tensor(dst=og, data1=o, data2=sg, op=nl.multiply)
    return _o_proj(g, og, w["wo"], ident)


# ---- stages --------------------------------------------------------------------------------------
def _load_weights(g, wqg, wk, wv, wo, norm_w, cos, sin):
    """Issue every weight / table DMA up front (the projections consume them in order; o_proj's arrive
    meanwhile). Each core reads only its heads' columns: over the LNC pair every weight byte is read once."""
    act, KT, Hq, Hc, D, dp, DT, H = g["act"], g["KT"], g["Hq"], g["Hc"], g["D"], g["dp"], g["DT"], g["H"]
    T, nq, nr, R = g["T"], g["nq"], g["nr"], g["R"]
    h0 = g["core"] * Hc
    w = {}
    wq = nl.ndarray((P, KT, 2, Hc, D), act, buffer=nl.sbuf, name="att_wqg")
    row = 2 * Hq * D                                   # elements of one wqg row (input feature)
    jg = max(1, KT // 4)                               # 4 DMAs so the first matmuls start early
    for j0 in range(0, KT, jg):
        nj = min(jg, KT - j0)
        nisa.dma_copy(dst=wq[:, j0:j0 + nj],
                      src=wqg.ap(pattern=[[row, P], [P * row, nj], [Hq * D, 2], [1, Hc * D]],
                                 offset=j0 * P * row + h0 * D))
    w["wqg"] = wq
    for nm, src, on in (("wk", wk, g["do_k"]), ("wv", wv, g["do_v"])):
        if on:
            t = nl.ndarray((P, KT, D), act, buffer=nl.sbuf, name=f"att_{nm}")
            nisa.dma_copy(dst=t, src=src.ap(pattern=[[D, P], [P * D, KT], [1, D]], offset=0))
            w[nm] = t
    wo_sb = nl.ndarray((dp, Hc * DT, H), act, buffer=nl.sbuf, name="att_wo")
    nisa.dma_copy(dst=wo_sb, src=wo.ap(pattern=[[H, dp], [dp * H, Hc * DT], [1, H]], offset=h0 * D * H))
    w["wo"] = wo_sb
    # norm weights and rope tables per row of the q|k tile (padding rows between nq and KP are zero)
    nw = nl.ndarray((nr, D), F32, buffer=nl.sbuf, name="att_norm_w")
    cs = nl.ndarray((nr, 2, R), F32, buffer=nl.sbuf, name="att_cos_sin")
    nisa.memset(dst=nw, value=0.0, engine=POOL_ENG)
    nisa.memset(dst=cs, value=0.0, engine=POOL_ENG)
    nisa.dma_copy(dst=nw[0:nq, :], src=norm_w.ap(pattern=[[0, nq], [1, D]], offset=0))
    for s, tab in ((0, cos), (1, sin)):                # row t*Hc + h <- table row t
        nisa.dma_copy(dst=cs[0:nq, s, :], src=tab.ap(pattern=[[R, T], [0, Hc], [1, R]], offset=0))
    if g["do_k"]:
        nisa.dma_copy(dst=nw[KP:nr, :], src=norm_w.ap(pattern=[[0, T], [1, D]], offset=D))
        for s, tab in ((0, cos), (1, sin)):
            nisa.dma_copy(dst=cs[KP:nr, s, :], src=tab)
    w["norm_w"], w["cos_sin"] = nw, cs
    return w


def _runtime_scalars(g, pos):
    """p on every partition (int32 DMA broadcast), r = p mod B (fp32 column for the masks) and the
    registers: p, r and the head-tile trip count (r > 0)."""
    B = g["B"]
    pos_i = nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf, name="att_pos")
    nisa.dma_copy(dst=pos_i, src=pos.ap(pattern=[[0, P], [1, 1]], offset=0))
    rem_i = nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf, name="att_rem")
    nisa.tensor_scalar(dst=rem_i, data=pos_i, op0=nl.bitwise_and, operand0=B - 1)
    rem_f = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="att_rem_f")
    nisa.tensor_copy(dst=rem_f, src=rem_i)
    rt = {"rem_f": rem_f}
    rt["p_reg"] = nisa.register_alloc()
    nisa.register_load(rt["p_reg"], pos_i[0:1, :])
    rt["rem_reg"] = nisa.register_alloc()
    nisa.register_load(rt["rem_reg"], rem_i[0:1, :])
    # head-tile trip count (also computed when max_context fixes the loops, so that a shape-only trace has
    # exactly the instruction mix of a data launch)
    head_i = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="att_has_head")
    nisa.tensor_scalar(dst=head_i, data=rem_i[0:1, :], op0=nl.greater, operand0=0.0)
    rt["head_reg"] = nisa.register_alloc()
    nisa.register_load(rt["head_reg"], head_i)
    return rt


def _project(g, xT, w):
    """q|gate (+ k on core 0) in row layout [(t, h), 2, D] and v [T, D], rounded to the activation dtype."""
    act, KT, Hc, D, T, nq, nr = g["act"], g["KT"], g["Hc"], g["D"], g["T"], g["nq"], g["nr"]
    nx = Hc + (1 if g["do_k"] else 0)
    xrep = nl.ndarray((P, nx, KT, nr), act, buffer=nl.sbuf, name="att_xrep")
    nisa.memset(dst=xrep, value=0.0, engine=POOL_ENG)
    for h in range(Hc):
        nisa.tensor_copy(dst=xrep[:, h, :, h:nq:Hc], src=xT, engine=POOL_ENG)
    if g["do_k"]:
        nisa.tensor_copy(dst=xrep[:, Hc, :, KP:nr], src=xT, engine=POOL_ENG)
    ps = nl.ndarray((nr, 2, D), F32, buffer=nl.psum, name="att_qg_psum")
    first = True
    for j in range(KT):
        for h in range(Hc):
            nisa.nc_matmul(dst=ps, stationary=xrep[:, h, j, :], moving=w["wqg"][:, j, :, h, :],
                           accumulate=not first)
            first = False
        if g["do_k"]:
            nisa.nc_matmul(dst=ps[:, 0, :], stationary=xrep[:, Hc, j, :], moving=w["wk"][:, j, :], accumulate=True)
    qg = nl.ndarray((nr, 2, D), act, buffer=nl.sbuf, name="att_qg")
    nisa.tensor_copy(dst=qg, src=ps, engine=ACT_ENG)
    vnew = nl.ndarray((T, D), act, buffer=nl.sbuf, name="att_vnew")
    if g["do_v"]:
        vps = nl.ndarray((T, D), F32, buffer=nl.psum, name="att_v_psum")
        for j in range(KT):
            nisa.nc_matmul(dst=vps, stationary=xT[:, j, :], moving=w["wv"][:, j, :], accumulate=j > 0)
        nisa.tensor_copy(dst=vnew, src=vps, engine=DVE_ENG)
    return qg, vnew


def _norm_rope(g, qg, w, eps):
    """Zero-centred RMSNorm (fp32, weight 1 + w) then rotate-half RoPE on dims [0, R) of every row of the q|k
    tile (zero padding rows stay zero; on the cores without k the key rows are zero until the exchange);
    each step rounds to the activation dtype like model.functional."""
    act, D, R, nn = g["act"], g["D"], g["R"], g["nr"]
    x = qg[0:nn, 0, :]
    sq = nl.ndarray((nn, D), F32, buffer=nl.sbuf, name="att_sq")
    nisa.tensor_tensor(dst=sq, data1=x, data2=x, op=nl.multiply)
    ss = nl.ndarray((nn, 1), F32, buffer=nl.sbuf, name="att_sumsq")
    nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=1)
    rstd = nl.ndarray((nn, 1), F32, buffer=nl.sbuf, name="att_rstd")
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / D, bias=float(eps))
    qk = nl.ndarray((nn, D), act, buffer=nl.sbuf, name="att_qk")
    nisa.scalar_tensor_tensor(dst=qk[0:nn, :], data=x, op0=nl.multiply, operand0=rstd,
                              op1=nl.multiply, operand1=w["norm_w"])
    # RoPE: out = x*cos + [-x2, x1]*sin on the first R dims (pairs (i, i + R/2))
    h = R // 2
    cs = w["cos_sin"]
    c = nl.ndarray((nn, R), F32, buffer=nl.sbuf, name="att_rope_c")
    nisa.tensor_tensor(dst=c, data1=qk[0:nn, 0:R], data2=cs[:, 0, :], op=nl.multiply)
    u = nl.ndarray((nn, R), F32, buffer=nl.sbuf, name="att_rope_u")
    nisa.tensor_tensor(dst=u[:, 0:h], data1=qk[0:nn, h:R], data2=cs[:, 1, 0:h], op=nl.multiply)
    nisa.tensor_tensor(dst=u[:, h:R], data1=qk[0:nn, 0:h], data2=cs[:, 1, h:R], op=nl.multiply)
    nisa.tensor_tensor(dst=qk[0:nn, 0:h], data1=c[:, 0:h], data2=u[:, 0:h], op=nl.subtract)
    nisa.tensor_tensor(dst=qk[0:nn, h:R], data1=c[:, h:R], data2=u[:, h:R], op=nl.add)
    return qk


def _transpose_rows(g, rows, n, ident, name):
    """rows [n, D] (SBUF, act) -> [dp, DT, n] act with d on partitions: PE matmuls against an identity
    (exact for bf16; fp32 PSUM, so no 2-byte sub-word PSUM writes -- trn2-costs pitfalls)."""
    act, dp, DT = g["act"], g["dp"], g["DT"]
    ps = nl.ndarray((dp, DT, n), F32, buffer=nl.psum, name=name + "_psum")
    for dh in range(DT):
        nisa.nc_matmul(dst=ps[:, dh, :], stationary=rows[:, dh * dp:(dh + 1) * dp], moving=ident[0:n, 0:n],
                       accumulate=False)
    out = nl.ndarray((dp, DT, n), act, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=out, src=ps, engine=DVE_ENG)
    return out


def _attend(g, qT, vnew, k_cache, v_cache, rt, ident, max_context):
    """Causal online-softmax attention of the nq query rows over cache rows 0..p-1 and the new block.
    Returns O / l as an SBUF [nq, D] act-dtype tile (the attention output, rounded like the reference)."""
    act, nq, D, B, T, Hc = g["act"], g["nq"], g["D"], g["B"], g["T"], g["Hc"]
    st = {}
    st["nm"] = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_negmax")
    nisa.memset(dst=st["nm"], value=M_INIT)
    st["l"] = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_rowsum")
    nisa.memset(dst=st["l"], value=0.0)
    st["o"] = nl.ndarray((nq, D), F32, buffer=nl.sbuf, name="att_acc")
    nisa.memset(dst=st["o"], value=0.0)

    # head-tile masks (static iotas compared with the run-time r): score columns (c, p) hold key NC*p + c
    NC = g["NC"]
    key_s = nl.ndarray((nq, NC, P), F32, buffer=nl.sbuf, name="att_key_cols")
    nisa.iota(dst=key_s, pattern=[[1, NC], [NC, P]], offset=0, channel_multiplier=0)
    mask_s = nl.ndarray((nq, NC * P), F32, buffer=nl.sbuf, name="att_head_mask")
    nisa.tensor_scalar(dst=mask_s, data=key_s, op0=nl.greater_equal, operand0=rt["rem_f"][0:nq, :],
                       op1=nl.multiply, operand1=NEG)
    key_r = nl.ndarray((P, NC), F32, buffer=nl.sbuf, name="att_key_rows")
    nisa.iota(dst=key_r, pattern=[[1, NC]], offset=0, channel_multiplier=NC)
    dead = nl.ndarray((P, NC), nl.uint8, buffer=nl.sbuf, name="att_dead_rows")
    nisa.tensor_scalar(dst=dead, data=key_r, op0=nl.greater_equal, operand0=rt["rem_f"])
    masks = {"score": mask_s, "dead": dead}

    args = (g, st, qT, k_cache, v_cache, ident, masks)
    if max_context is None:
        def head_body(i):
            _kv_tile(*args, row0=0, reg=None, masked=True)
        nl.fori_loop(0, rt["head_reg"], head_body)

        def main_body(i):
            _kv_tile(*args, row0=0, reg=i, masked=False)
        nl.fori_loop(rt["rem_reg"], rt["p_reg"], main_body, step=B)
    else:
        if max_context % B:
            _kv_tile(*args, row0=0, reg=None, masked=True)
        for k in range(max_context // B):
            _kv_tile(*args, row0=k * B, reg=rt["rem_reg"], masked=False)

    # the new block: T keys from SBUF, static causal mask (row t*Hc + h sees key t' iff t' <= t)
    s_ps = nl.ndarray((nq, T), F32, buffer=nl.psum, name="att_new_scores")
    for dh in range(g["DT"]):
        nisa.nc_matmul(dst=s_ps, stationary=qT[:, dh, 0:nq], moving=qT[:, dh, KP:KP + T], accumulate=dh > 0)
    zero = nl.ndarray((nq, T), F32, buffer=nl.sbuf, name="att_zero")
    nisa.memset(dst=zero, value=0.0, engine=POOL_ENG)
    causal = nl.ndarray((nq, T), F32, buffer=nl.sbuf, name="att_causal")
    nisa.affine_select(dst=causal, pattern=[[-Hc, T]], channel_multiplier=1, on_true_tile=zero,
                       on_false_value=NEG, cmp_op=nl.greater_equal, offset=0)
    s = nl.ndarray((nq, T), F32, buffer=nl.sbuf, name="att_new_scores_masked")
    nisa.tensor_tensor(dst=s, data1=s_ps, data2=causal, op=nl.add)
    p_t, alpha = _softmax_update(g, st, s, T)
    pT_ps = nl.ndarray((T, nq), F32, buffer=nl.psum, name="att_new_pT_psum")
    nisa.nc_matmul(dst=pT_ps, stationary=p_t, moving=ident[0:nq, 0:nq], accumulate=False)
    pT = nl.ndarray((T, nq), act, buffer=nl.sbuf, name="att_new_pT")
    nisa.tensor_copy(dst=pT, src=pT_ps, engine=ACT_ENG)
    pv = nl.ndarray((nq, D), F32, buffer=nl.psum, name="att_new_pv")
    nisa.nc_matmul(dst=pv, stationary=pT, moving=vnew, accumulate=False)
    nisa.scalar_tensor_tensor(dst=st["o"], data=st["o"], op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv)

    rl = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_inv_rowsum")
    nisa.reciprocal(dst=rl, data=st["l"])
    o = nl.ndarray((nq, D), act, buffer=nl.sbuf, name="att_out")
    nisa.tensor_scalar(dst=o, data=st["o"], op0=nl.multiply, operand0=rl)
    return o


def _kv_tile(g, st, qT, k_cache, v_cache, ident, masks, row0, reg, masked):
    """One tile of B cache rows starting at row0 (+ the run-time register ``reg`` when given)."""
    act, nq, D, dp, DT, NC = g["act"], g["nq"], g["D"], g["dp"], g["DT"], g["NC"]
    kv = nl.ndarray((P, NC, 2, D), act, buffer=nl.sbuf, name="att_kv_tile")
    pattern = [[NC * D, P], [D, NC], [1, D]]           # partition p <- rows NC*p .. NC*p + NC-1
    for s, cache in ((0, k_cache), (1, v_cache)):
        if reg is None:
            src = cache.ap(pattern=pattern, offset=row0 * D)
        else:
            src = cache.ap(pattern=pattern, offset=row0 * D, scalar_offset=reg, indirect_dim=1)
        nisa.dma_copy(dst=kv[:, :, s, :], src=src)
    if masked:   # rows >= r: possibly beyond the valid prefix -> zero them (NaN-safe select)
        dead = masks["dead"]
        nisa.tensor_copy_predicated(dst=kv, src=0.0, predicate=dead.ap(pattern=[[NC, P], [1, NC], [0, 2 * D]],
                                                                        offset=0))
    # K^T chunks: [P keys, dp] -> [dp, P keys] per (chunk, d-tile)
    kT_ps = nl.ndarray((dp, DT, NC, P), F32, buffer=nl.psum, name="att_kT_psum")
    for c in range(NC):
        for dh in range(DT):
            nisa.nc_matmul(dst=kT_ps[:, dh, c, :], stationary=kv[:, c, 0, dh * dp:(dh + 1) * dp], moving=ident,
                           accumulate=False)
    kT = nl.ndarray((dp, DT, NC, P), act, buffer=nl.sbuf, name="att_kT")
    for dh in range(DT):
        nisa.tensor_copy(dst=kT[:, dh], src=kT_ps[:, dh], engine=ACT_ENG if dh % 2 == 0 else DVE_ENG)
    # S = sum over d-tiles of q_dh^T k_dh (split-K, one PSUM bank)
    s_ps = nl.ndarray((nq, NC * P), F32, buffer=nl.psum, name="att_scores")
    for dh in range(DT):
        nisa.nc_matmul(dst=s_ps, stationary=qT[:, dh, 0:nq], moving=kT[:, dh], accumulate=dh > 0)
    s = s_ps
    if masked:
        s = nl.ndarray((nq, NC * P), F32, buffer=nl.sbuf, name="att_scores_masked")
        nisa.tensor_tensor(dst=s, data1=s_ps, data2=masks["score"], op=nl.add)
    p_t, alpha = _softmax_update(g, st, s, NC * P)
    # P^T chunks (keys on partitions) -> PV
    pT_ps = nl.ndarray((P, NC, nq), F32, buffer=nl.psum, name="att_pT_psum")
    for c in range(NC):
        nisa.nc_matmul(dst=pT_ps[:, c, :], stationary=p_t[:, c * P:(c + 1) * P], moving=ident[0:nq, 0:nq],
                       accumulate=False)
    pT = nl.ndarray((P, NC, nq), act, buffer=nl.sbuf, name="att_pT")
    nisa.tensor_copy(dst=pT, src=pT_ps, engine=ACT_ENG)
    pv = nl.ndarray((nq, D), F32, buffer=nl.psum, name="att_pv")
    for c in range(NC):
        nisa.nc_matmul(dst=pv, stationary=pT[:, c, :], moving=kv[:, c, 1, :], accumulate=c > 0)
    nisa.scalar_tensor_tensor(dst=st["o"], data=st["o"], op0=nl.multiply, operand0=alpha, op1=nl.add, operand1=pv)


def _softmax_update(g, st, s, width):
    """Online-softmax step on raw scores s [nq, width] (PSUM or SBUF, fp32; scale not applied).

    b = -max(running max, scale*rowmax(s)); alpha = exp(b - nm) rescales the old sum/output;
    P = exp(scale*s + b) in the activation dtype with its fp32 row sum from the same ScalarE instruction.
    Returns (P [nq, width] act, alpha [nq, 1] fp32); updates nm and l in place."""
    nq = g["nq"]
    nmx = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_tile_negmax")
    nisa.tensor_reduce(dst=nmx, op=nl.maximum, data=s, axis=1, negate=True)
    b = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_new_negmax")
    nisa.scalar_tensor_tensor(dst=b, data=nmx, op0=nl.multiply, operand0=g["sc"], op1=nl.minimum,
                              operand1=st["nm"])
    alpha = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_alpha")
    nisa.activation(dst=alpha, op=nl.exp, data=st["nm"], scale=-1.0, bias=b)
    p_t = nl.ndarray((nq, width), g["act"], buffer=nl.sbuf, name="att_probs")
    rs = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_tile_rowsum")
    nisa.activation(dst=p_t, op=nl.exp, data=s, scale=g["sc"], bias=b, reduce_op=nl.add, reduce_res=rs,
                    reduce_cmd=nisa.reduce_cmd.reset_reduce)
    nisa.scalar_tensor_tensor(dst=st["l"], data=st["l"], op0=nl.multiply, operand0=alpha, op1=nl.add,
                              operand1=rs)
    nisa.tensor_copy(dst=st["nm"], src=b, engine=POOL_ENG)
    return p_t, alpha


def _o_proj(g, og, wo, ident):
    """og [nq = (t, h), D] act -> og^T per (head, d-tile) -> y [T, H] fp32 = sum over blocks og^T . Wo."""
    act, T, H, Hc, dp, DT, nq = g["act"], g["T"], g["H"], g["Hc"], g["dp"], g["DT"], g["nq"]
    ps = nl.ndarray((dp, DT, nq), F32, buffer=nl.psum, name="att_ogT_psum")
    for dh in range(DT):
        nisa.nc_matmul(dst=ps[:, dh, :], stationary=og[:, dh * dp:(dh + 1) * dp], moving=ident[0:nq, 0:nq],
                       accumulate=False)
    ogT = nl.ndarray((dp, DT, Hc, T), act, buffer=nl.sbuf, name="att_ogT")   # columns regrouped per head
    nisa.tensor_copy(dst=ogT.permute((0, 1, 3, 2)), src=ps.reshape((dp, DT, T, Hc)), engine=DVE_ENG)
    y_ps = nl.ndarray((T, H), F32, buffer=nl.psum, name="att_y_psum")
    nblk = Hc * DT
    for n0 in range(0, H, PSUM_COLS):
        n1 = min(H, n0 + PSUM_COLS)
        for b in range(nblk):
            h, dh = divmod(b, DT)
            nisa.nc_matmul(dst=y_ps[:, n0:n1], stationary=ogT[:, dh, h, :], moving=wo[:, b, n0:n1],
                           accumulate=b > 0)
    y = nl.ndarray((T, H), F32, buffer=nl.sbuf, name="att_y")
    half = (H // 2 // PSUM_COLS) * PSUM_COLS or H
    nisa.tensor_copy(dst=y[:, 0:half], src=y_ps[:, 0:half], engine=ACT_ENG)
    if half < H:
        nisa.tensor_copy(dst=y[:, half:H], src=y_ps[:, half:H], engine=DVE_ENG)
    return y


# ---- wrapper -------------------------------------------------------------------------------------
@nki.jit
def attention_kernel(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=1e-6,
                     kv_tile=KV_TILE, max_context=None):
    """Wrapper: HBM in, HBM out. xT ``[P, KT, T]``; weights from :func:`attention_layout`; cos/sin
    ``[T, R]`` float32; caches ``[1, L, D]``; pos ``[1, 1]`` int32.

    Launch ``attention_kernel(...)`` (LNC=1: one core does all heads, K and V) or ``attention_kernel[2](...)``
    (LNC=2). Returns ``(partials [n_cores, T, H] float32, k_cache, v_cache)``: core c's o_proj partial in
    row c (the rank's output is their sum) and the caches, mutated in place at rows p..p+T-1.
    """
    n_cores = nl.num_programs(0) if nl.program_ndim() != 0 else 1
    core = nl.program_id(0) if nl.program_ndim() != 0 else 0
    Pp, KT, T = xT.shape
    out = nl.ndarray((n_cores, T, KT * P), F32, buffer=nl.shared_hbm, name="attention_partials")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf, name="att_xT_in")
    nisa.dma_copy(dst=xs, src=xT)
    y = attention_body(xs, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=core,
                       n_cores=n_cores, kv_tile=kv_tile, max_context=max_context)
    nisa.dma_copy(dst=out[core], src=y)
    return out, k_cache, v_cache


# ---- host-side helpers (plain numpy / torch, run once per checkpoint or per launch) ----------------
def _to_numpy(w):
    if hasattr(w, "detach"):
        import torch
        t = w.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(w)


def attention_layout(shard) -> dict:
    """A rank's attention weights in PyTorch layout (``model.tp.attention.shard_attention``: q_proj
    ``[Hq_r*2*D, H]`` interleaved [q_h; g_h] per head, k_proj/v_proj ``[D, H]``, o_proj ``[H, Hq_r*D]``,
    q_norm/k_norm ``[D]``) -> the kernel's HBM arrays ``{wqg, wk, wv, wo, norm_w}`` (module docstring)."""
    if shard.get("num_kv_heads", 1) != 1:
        raise ValueError(f"attention_layout: the kernel takes one KV head per rank, the shard has "
                         f"{shard['num_kv_heads']}")
    q = _to_numpy(shard["q_proj"])
    hq = shard["num_heads"]
    D = q.shape[0] // (2 * hq)
    H = q.shape[1]
    wqg = np.ascontiguousarray(q.reshape(hq, 2, D, H).transpose(3, 1, 0, 2))      # [H, 2, Hq_r, D]
    wk = np.ascontiguousarray(_to_numpy(shard["k_proj"]).T)
    wv = np.ascontiguousarray(_to_numpy(shard["v_proj"]).T)
    wo = np.ascontiguousarray(_to_numpy(shard["o_proj"]).T)
    norm = np.stack([1.0 + _to_numpy(shard["q_norm"]).astype(np.float32),
                     1.0 + _to_numpy(shard["k_norm"]).astype(np.float32)]).astype(np.float32)
    return {"wqg": wqg, "wk": wk, "wv": wv, "wo": wo, "norm_w": norm}


def xT_layout(x) -> np.ndarray:
    """Normed hidden ``[T, H]`` -> feature-major ``[P, H/P, T]`` (host side, for tests / layerwise)."""
    a = _to_numpy(x)
    T, H = a.shape
    if H % P:
        raise ValueError(f"attention: hidden size {H} is not a multiple of {P}")
    return np.ascontiguousarray(a.T.reshape(H // P, P, T).transpose(1, 0, 2))


def rope_tables(start: int, T: int, rotary_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin ``[T, rotary_dim]`` float32 for positions start..start+T-1, as model.functional.rope_cos_sin
    computes them (inv_freq_j = 1 / theta^(2j/R), bit-identical; frequencies repeated twice for the rotate-half
    pairs); cos/sin themselves may differ from torch's in the last bit."""
    x = np.arange(0, rotary_dim, 2, dtype=np.float32) / np.float32(rotary_dim)
    inv = np.float32(1.0) / (np.float64(theta) ** x.astype(np.float64)).astype(np.float32)   # torch's rounding
    f = np.arange(start, start + T, dtype=np.float32)[:, None] * inv[None, :]
    emb = np.concatenate([f, f], axis=-1).astype(np.float32)
    return np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)


def kernel_args(layout: dict, x, k_cache, v_cache, start: int, cfg, kv_tile: int = KV_TILE, max_context=None):
    """The positional arguments of :func:`attention_kernel` for normed x ``[T, H]`` at positions
    start..start+T-1 (caches are passed through: numpy arrays are updated in place by the launch)."""
    T = x.shape[0]
    cos, sin = rope_tables(start, T, cfg.rotary_dim, cfg.rope_theta)
    return (xT_layout(x), layout["wqg"], layout["wk"], layout["wv"], layout["wo"], layout["norm_w"], cos, sin,
            k_cache, v_cache, np.array([[start]], np.int32), float(cfg.rms_norm_eps), kv_tile, max_context)


def run_attention(layout: dict, x, k_cache, v_cache, start: int, cfg, lnc: int = 2, kv_tile: int = KV_TILE,
                  max_context=None):
    """Host convenience: launch :func:`attention_kernel` (``[lnc]``) on normed x ``[T, H]`` at positions
    start..start+T-1. The caches (numpy or torch ``[1, L, D]``) are updated in place. Returns the per-core
    partials ``[lnc, T, H]`` float32 (torch if any argument is torch)."""
    args = kernel_args(layout, x, k_cache, v_cache, start, cfg, kv_tile=kv_tile, max_context=max_context)
    kernel = attention_kernel if lnc == 1 else attention_kernel[lnc]
    out, _, _ = kernel(*args)
    return out


def demo_args(cfg, tp: int = 4, T: int = 2, dtype: str = "bfloat16", shape_only: bool = False,
              context: int = 4096):
    """(kernel, args) for one rank at the config's shapes: ``attention_kernel[2]`` at position p = context.

    Data mode: deterministic random weights/caches, cache length ceil((context + T) / 512) * 512, the general
    kernel (run-time loops). Shape-only: ``nkisim.ShapeDtype`` arguments and ``max_context = context`` so the
    trace holds the tiles a launch at p = context runs."""
    import nkisim
    H, D, R = cfg.hidden_size, cfg.head_dim, cfg.rotary_dim
    if cfg.num_attention_heads % tp or tp % cfg.num_key_value_heads:
        raise ValueError(f"attention: tp={tp} must divide the {cfg.num_attention_heads} query heads and be a "
                         f"multiple of the {cfg.num_key_value_heads} KV heads (one KV head per rank)")
    hq = cfg.num_attention_heads // tp
    L = -(-(context + T) // KV_TILE) * KV_TILE
    shapes = {"xT": ((P, H // P, T), dtype), "wqg": ((H, 2, hq, D), dtype), "wk": ((H, D), dtype),
              "wv": ((H, D), dtype), "wo": ((hq * D, H), dtype), "norm_w": ((2, D), "float32"),
              "cos": ((T, R), "float32"), "sin": ((T, R), "float32"), "k_cache": ((1, L, D), dtype),
              "v_cache": ((1, L, D), dtype), "pos": ((1, 1), "int32")}
    eps = float(cfg.rms_norm_eps)
    if shape_only:
        args = tuple(nkisim.ShapeDtype(*shapes[k]) for k in shapes)
        return attention_kernel[2], args + (eps, KV_TILE, context)
    from nkisim import dtypes as _dt
    st = _dt.storage(dtype)
    rng = np.random.default_rng(0)
    arrs = {}
    for k, (shp, dt) in shapes.items():
        if k == "pos":
            arrs[k] = np.array([[context]], np.int32)
        elif k in ("cos", "sin"):
            arrs["cos"], arrs["sin"] = rope_tables(context, T, R, cfg.rope_theta)
        elif k == "norm_w":
            arrs[k] = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
        else:
            scale = 1.0 / np.sqrt(shp[0]) if k.startswith("w") else 1.0
            arrs[k] = (rng.standard_normal(shp, dtype=np.float32) * scale).astype(st)
    return attention_kernel[2], tuple(arrs[k] for k in shapes) + (eps, KV_TILE, None)
