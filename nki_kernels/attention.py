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
  de-interleaves it). A core's heads [h0, h0+Hc) of one input tile are contiguous runs of Hc*D elements.
* ``wk``, ``wv`` ``[H, D]`` act dtype (the rank's KV head).
* ``wo``     ``[Hq_r*D, H]`` act dtype (o_proj transposed: row h*D + d is head h's dim d).
* ``norm_w`` ``[2, D]`` float32: ``(1 + q_norm, 1 + k_norm)`` (the zero-centred offsets resolved on the host).

Inputs by token position (host side, :func:`rope_tables` == ``model.functional.rope_cos_sin``): ``cos``,
``sin`` ``[T, R]`` float32, row t = position p + t (the tables repeat the R/2 frequencies twice). ``pos``:
``[1, 1]`` int32 HBM tensor holding p -- a RUN-TIME value: it becomes DMA offsets (``.ap(scalar_offset=reg)``)
and loop bounds (``nl.fori_loop`` with register bounds); nothing branches on it in Python.

KV caches: ``k_cache``, ``v_cache`` HBM ``[1, L, D]`` act dtype (the rank's KV head, row = position); written
in place at rows p..p+T-1 and also returned. ``L >= n_cores * kv_tile`` is required (see the head tiles below).

On-chip layout of the work (per core, nq = T*Hc query rows of its own heads, row r = t*Hc + h):

* projections: the weights stream through a 3-slot SBUF ring in chunks of 2 input tiles (chunk c+3's DMA
  reuses chunk c's slot), so the matmuls overlap the transfer. The stationary operand is a zero-padded replica
  of xT per head (``xrep[:, h, j, r]`` = xT[:, j, t] iff r = t*Hc + h) so that ONE matmul per (j, head) streams
  that head's [query | gate] weight (N = 2D = 512 columns, one PSUM bank) straight into row layout
  ``[(t, h), 2, D]``; the K projection lands in rows KP..KP+T-1 of the same PSUM tile (core 0). Every weight
  column is streamed exactly once, whatever T.
* q and k rows share one tile ``qk [KP + T, D]`` (query rows 0..nq-1, key rows at partition KP = 32 so that
  compute engines may address them -- start partitions are 0/32/64/96; rows between are zero) for RMSNorm
  (free-axis reduce) and RoPE (free-axis slices); they are transposed together on the PE (matmul against an
  identity) into d-on-partitions columns (dp = min(D, 128) partitions, DT = D/dp d-tiles).
* attention queries ``qa [dp, DT, QA]``: LNC=1: the nq rows; LNC=2: this core's rows at columns 0..nq-1 and the
  other core's at KP..KP+nq-1 (QA = KP + nq; zero between), so each core attends with ALL the rank's heads.
* KV tiles of B = ``kv_tile`` keys (512): ``k [P, B/P, D]`` / ``v [P, B/P, D+1]``, partition p holds rows
  4p..4p+3 (one 2 KiB contiguous run per partition and cache); v's extra column is 1, so PV also yields the
  softmax row sums. K chunks are transposed on the PE into ``kT [dp, DT, B/P, P]``; **QK^T is split-K over the
  DT d-tiles, accumulated in one PSUM bank** ``S [QA, B]`` (kernel-algorithms §4.3); PV uses P^T chunks as the
  stationary and V rows (+ the ones column) as the moving operand (``[QA, D+1]`` in PSUM, no split needed).
* online softmax (fp32): running negated max ``nm`` and ``[O | l]`` ``[QA, D+1]``; the scale 1/sqrt(D) is
  folded into the exp (``exp(scale*S - m)`` on ScalarE); P is rounded to the activation dtype for PV.
* software pipeline: tiles alternate between two buffer sets and tile j's load / K^T / scores / softmax
  statistics are emitted interleaved with tile j-1's P^T / PV / update, in the order that keeps each in-order
  engine queue busy (PE: K^T(j), P^T(j-1), QK(j), PV(j-1)).

LNC split
---------
Core c of ``n_cores`` projects query heads [c*Hc, (c+1)*Hc) (Hc = Hq_r / n_cores: 2 of 4) and returns the
o_proj partial over those heads' columns. The KV head is projected ONCE: core 0 computes k (norm + RoPE) and
writes the K rows, core n_cores-1 computes v and writes the V rows -- each cache row is written exactly once
per call. With LNC=2 the cores then swap their transposed queries (core 0 adds the new keys^T) in ONE
``nisa.sendrecv`` of whole tiles, and split the KEYS instead of the heads: each core attends with all 4 heads
over its half of every rank tile (below), so the KV cache is read once per rank and each core streams half of
it; the last core also takes the new block. A second sendrecv swaps the partial softmax states
``[O | l | nm]`` of the other core's heads, merged with the usual max-rescaling. The exchanged tiles are whole
tiles on both sides (trn2-costs pitfall: a sendrecv into a partial view silently delivers nothing).

Both cores run the SAME runtime loops with the same trip counts at every position (SDK lnc.rst "Final
Notes": the cores of an LNC=2 kernel must run the same dynamic control flow): every loop bound and trip count
below is a function of p alone, and the cores differ only in static code (the row offset c*B of their DMAs,
the head-tile mask threshold, which core writes K / V and attends the new block). Alternatives considered:
splitting the query heads between the cores reads the whole cache on both cores (2x the KV traffic of the
DMA-bound tile loop); interleaving tiles over the cores (the previous design) gives the cores different trip
counts whenever the tile count is odd and runs the head tile on one core only; giving each core ceil(n/2)
interleaved tiles needs a neutral (fully masked) extra tile on one core and still a head tile on both: the
same masked work as the rank tiles here, with two masked tile kinds.
The rank-tile split has one tile kind per core, one masked (head) tile per core, and ONE pipeline shared by
both cores. Its price: a masked head tile on both cores (2B rows read for the r < 2B head rows, where the
previous design read B rows for r < B). The cost model (``harness.costmodel.predict`` of the shape-only
trace, T=2, bf16, real shapes; B = 512) gives the same 58.5 us as before at context 4096, within 1.5 us of
the previous design at 700..32700 except 1100 / 1536 (+2 / +7 us: two tiles per core instead of a 2+1
split); kv_tile = 256 would be 2-8 us faster below 6K but 4-18 us slower from 8K (32700: 159 vs 141 us).

The rows a core reads are the rows the OTHER core writes in this call only inside masked head tiles (rows
>= p, zeroed in SBUF whatever they hold), so no core_barrier is needed (the new rows are attended from SBUF).

KV tiling and how p is applied
------------------------------
Keys are the cache rows 0..p-1 plus the T new rows. A rank tile is S = n_cores * B rows (B = ``kv_tile``
keys per core, 512); core c takes rows [c*B, (c+1)*B) of each. With r = p mod S and n = p // S computed
on-chip (``bitwise_and`` / ``right_shift`` on int32, then ``register_load``; the same values on both cores):

* head tiles: rows [c*B, (c+1)*B) of the cache start with keys >= r masked (key k of core c's tile is row
  c*B + k: masked iff k >= r - c*B, so core 1's tile is entirely masked when r <= B), run only when r > 0 (two
  fori_loops with 0/1 trip counts: n = 0 and n >= 1). With n >= 1 every head row is < p (a valid, finite cache
  row), so the mask alone suffices (a masked score q.k + NEG rounds to NEG exactly, its P is exactly 0: the same
  bits as with zeroed rows); with n = 0 (p < S) they may read rows >= p (``L >= n_cores * kv_tile``): those rows
  are zeroed in SBUF with a predicated copy (NaN-safe) and masked in the scores. This is the ONLY read of rows
  outside the valid prefix. Tile 0's K / V DMAs are issued before these loops (at row r, or 0 when n = 0).
* full tiles: rank tile j covers rows [r + jS, r + (j+1)S) for j < n (they end exactly at row p), no
  masking: a runtime ``nl.fori_loop`` over pairs of rank tiles whose register induction variable (the same on
  both cores) plus the core's static c*B is the DMA row offset (``.ap(scalar_offset=reg, indirect_dim=1)``),
  plus 0/1-trip loops for a lone tile (n = 1), the pipeline's first two tiles (n >= 2: one body, so that tile
  1's load is not fenced behind tile 0's work by a loop boundary) and its odd / even epilogue.
* new block: the T new keys from SBUF with a static causal mask (key t' visible to query t iff t' <= t).
Masks add NEG = -1e30 (finite: exp underflows to exactly 0, no inf arithmetic). The running negated max
starts at M_INIT = 1e20 (a running max of -1e20): below every real scaled score and far above every masked
one (-1e30 / sqrt(D)), so a fully masked tile leaves the softmax state exactly unchanged (its exp is 0 and the
rescale factor exp(0) = 1) and a core that saw no key at all merges with weight exactly 0.

Shape-only tracing (``max_context``)
------------------------------------
nkisim's shape-only mode reads registers as 0, so the runtime loops above run 0 times. Passing the
compile-time ``max_context = N`` specialises the loop structure to a context of N tokens: the head tiles run
iff N mod S > 0 and the full tiles are unrolled statically (DMA offsets still come from the run-time r). The
instruction stream then equals that of a launch at p = N (tested), so a shape-only trace costs context N.
The specialised kernel is correct for every p with p // S == N // S and (p mod S > 0) == (N mod S > 0)
(tested); leave ``max_context=None`` for the general kernel.
"""

from __future__ import annotations

import numpy as np
import torch

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import MOVING_MAX, PSUM_BANK, P, dma_on, layer_offset, layer_of, program_sharding
from nki_kernels.host import as_torch, feature_major
from nki_kernels.stacked import bank_block, check_stack
xT_layout = feature_major     # the name nki_kernels/attention_prefill.py imports

KV_TILE = PSUM_BANK     # keys per KV tile: one PSUM bank of fp32 scores
KP = 32                 # partition of the first key row in the q|k tile (a legal compute-engine start)
NEG = -1.0e30           # additive mask: finite, exp(scale*NEG - m) == 0 exactly
M_INIT = 1.0e20         # initial negated running max: below every real scaled score, above every masked one
REGISTER_NAMES = ("p", "head_prefix", "head", "start", "pre", "one", "two", "pair_end", "odd", "even")
ATTENTION_REGISTERS = len(REGISTER_NAMES)   # registers one body call loads (pass ``regs`` to reuse them)
F32 = nl.float32
ACT_ENG = nisa.engine.scalar
DVE_ENG = nisa.engine.vector
POOL_ENG = nisa.engine.gpsimd


# ---- geometry ------------------------------------------------------------------------------------
class AttentionGeometry(nl.NKIObject):
    """The compile-time dimensions of one body call (plain ints and bools; module docstring for the names):
    T tokens, KT = H/P input tiles, Hq / Hc query heads of the rank / core, D head dim on dp partitions in DT
    d-tiles, R rotary dims, L cache rows, B keys per KV tile (NC = B/P rows per partition), nq / nr / QA query,
    q|k and attention-query rows, act the activation dtype, sc = 1/sqrt(D); core / n_cores and what this core
    does (do_k: writes the K rows, do_v: the V rows, new: attends the new block); the element offsets of the
    layer in stacked weights (wqg_off, wk_off, wv_off, norm_off) and caches (cache_off), 0 when unstacked."""

    def __init__(self, T, KT, Hq, D, R, L, B, act, core, n_cores, wqg_off, wk_off, wv_off, norm_off, cache_off):
        self.T = T
        self.KT = KT
        self.H = KT * P
        self.Hq = Hq
        self.Hc = Hq // n_cores
        self.D = D
        self.dp = min(D, P)
        self.R = R
        self.L = L
        self.B = B
        self.DT = D // self.dp
        self.NC = B // P
        self.nq = T * self.Hc
        self.nr = KP + T
        self.QA = self.nq if n_cores == 1 else KP + self.nq
        self.act = act
        self.sc = float(D) ** -0.5
        self.core = core
        self.n_cores = n_cores
        self.do_k = core == 0                   # K rows: core 0; V rows + new block: last core
        self.do_v = core == n_cores - 1
        self.new = core == n_cores - 1
        self.wqg_off = wqg_off
        self.wk_off = wk_off
        self.wv_off = wv_off
        self.norm_off = norm_off
        self.cache_off = cache_off


def _geometry(xshape, act, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, n_cores, kv_tile, core,
              offsets):
    """Validate the arguments (the layer's views of stacked tensors; ``xshape`` / ``act``: the shape and dtype of
    the input xT); return the :class:`AttentionGeometry`."""
    Pp, KT, T = xshape
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
    for nm_w in (("wk", wk), ("wv", wv)):
        nm, w = nm_w
        if tuple(w.shape) != (H, D):
            raise ValueError(f"attention: {nm} has shape {list(w.shape)}, expected [H={H}, D={D}]")
    if tuple(wo.shape) != (Hq * D, H):
        raise ValueError(f"attention: wo has shape {list(wo.shape)}, expected [Hq_r*D={Hq * D}, H={H}]")
    if tuple(norm_w.shape) != (2, D) or norm_w.dtype != F32:
        raise ValueError(f"attention: norm_w must be float32 [2, D={D}] (1 + q_norm, 1 + k_norm), got "
                         f"{norm_w.dtype}{list(norm_w.shape)}")
    R = cos.shape[1]
    for nm_t in (("cos", cos), ("sin", sin)):
        nm, t = nm_t
        if len(t.shape) != 2 or t.shape[0] != T or t.shape[1] != R or t.dtype != F32:
            raise ValueError(f"attention: {nm} must be float32 [T={T}, R] (rope tables by position), got "
                             f"{t.dtype}{list(t.shape)}")
    if R % 2 or not 0 < R <= D:
        raise ValueError(f"attention: rotary dims {R} must be even and <= head dim {D}")
    for nm_c in (("k_cache", k_cache), ("v_cache", v_cache)):
        nm, c = nm_c
        if len(c.shape) != 3 or c.shape[0] != 1 or c.shape[2] != D:
            raise ValueError(f"attention: {nm} has shape {list(c.shape)}, expected [1, L, D={D}] (one KV head "
                             f"per rank)")
    if tuple(k_cache.shape) != tuple(v_cache.shape):
        raise ValueError(f"attention: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} differ")
    for nm_t in (("wqg", wqg), ("wk", wk), ("wv", wv), ("wo", wo), ("k_cache", k_cache), ("v_cache", v_cache)):
        nm, t = nm_t
        if t.dtype != act:
            raise TypeError(f"attention: {nm} dtype {t.dtype} differs from the activation dtype {act}")
    if act not in (nl.bfloat16, F32):
        raise TypeError(f"attention: activation dtype must be bfloat16 or float32, got {act}")
    if tuple(pos.shape) not in ((1, 1), (1,)) or pos.dtype != nl.int32:
        raise ValueError(f"attention: pos must be an int32 [1, 1] tensor, got {pos.dtype}{list(pos.shape)}")
    B = kv_tile
    if B < P or B > PSUM_BANK or B % P or B & (B - 1):
        raise ValueError(f"attention: kv_tile {B} must be a power of two in [{P}, {PSUM_BANK}]")
    L = k_cache.shape[1]
    if L < n_cores * B:
        raise ValueError(f"attention: cache length {L} is shorter than one KV tile per core ({n_cores} x {B} rows: "
                         f"the head tiles read rows 0..{n_cores * B - 1}); use a longer cache or a smaller kv_tile")
    nq = T * Hc
    if nq > KP:
        raise ValueError(f"attention: {nq} query rows per core exceed {KP} (T * heads per core)")
    if not 0 <= core < n_cores:
        raise ValueError(f"attention: core {core} outside 0..{n_cores - 1}")
    return AttentionGeometry(T, KT, Hq, D, R, L, B, act, core, n_cores, offsets[0], offsets[1], offsets[2],
                             offsets[3], offsets[4])


def _layer_geometry(xshape, act, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, n_cores, kv_tile, core,
                    layer):
    """The views of layer ``layer`` of stacked tensors (None: one layer's tensors) and their validated
    :class:`AttentionGeometry` -> (g, wqg, wk, wv, wo, norm_w, k_cache, v_cache), the caches as [1, L, D] views."""
    offsets = (layer_offset(wqg, layer), layer_offset(wk, layer), layer_offset(wv, layer),
               layer_offset(norm_w, layer), layer_offset(k_cache, layer))
    if layer != None:
        wqg, wk, wv, wo = layer_of(wqg, layer), layer_of(wk, layer), layer_of(wv, layer), layer_of(wo, layer)
        norm_w = layer_of(norm_w, layer)
        k_cache, v_cache = k_cache[layer:layer + 1], v_cache[layer:layer + 1]
    g = _geometry(xshape, act, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, n_cores, kv_tile, core,
                  offsets)
    return g, wqg, wk, wv, wo, norm_w, k_cache, v_cache


# ---- body ----------------------------------------------------------------------------------------
def attention_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=1e-6,
                   core=0, n_cores=1, kv_tile=KV_TILE, max_context=None, regs=None, layer=None, ring=None, stack=1):
    """Body: this core's gated-attention partial for T tokens (see the module docstring for every layout).

    xT: SBUF ``[P, KT, T]`` act dtype (normed hidden, feature-major). wqg, wk, wv, wo, norm_w: HBM, the rank's
    weights (:func:`attention_layout`). cos, sin: HBM ``[T, R]`` float32. k_cache, v_cache: HBM ``[1, L, D]``
    (rows p..p+T-1 written in place). pos: HBM ``[1, 1]`` int32 (p, run time). eps: rms_norm_eps.
    core / n_cores: this core and the LNC degree (compile time). kv_tile: keys per KV tile. max_context:
    compile-time context specialisation for shape-only traces (module docstring), None = general.
    regs: optional tuple of ``ATTENTION_REGISTERS`` VirtualRegisters to reuse (a megakernel composing many
    layers passes the same ones to every call; each call reloads them), else they are allocated here.
    layer: with stacked tensors (``megakernel.plan``: weights ``[N, ...]``, caches ``[N, L, D]``), the index of
    this layer's KV-head group in the stack (nki_kernels/common.py "Stacked tensors"); None: one layer's tensors.
    ring: :func:`attention_ring` of the same tensors / core / layer (its first chunks' DMAs issued earlier by the
    caller), or None: allocated and filled here.
    stack: S > 1: the partial comes bank-stacked, SBUF ``[S*T, H/S]`` (``nki_kernels.stacked``).
    Returns ``y`` SBUF ``[T, H]`` float32: the o_proj partial over this core's query heads.
    """
    g, wqg, wk, wv, wo, norm_w, k_cache, v_cache = _layer_geometry(xT.shape, xT.dtype, wqg, wk, wv, wo, norm_w, cos,
                                                                   sin, k_cache, v_cache, pos, n_cores, kv_tile,
                                                                   core, layer)
    act, T, nq, nr, D = g.act, g.T, g.nq, g.nr, g.D

    # ScalarE runs only exp (and table-free copies) in this kernel: load the exp table now, while the weights
    # stream, instead of on the critical path (ACT table switches cost ~1.3 us, trn2-costs)
    warm = nl.ndarray((1, 1), F32, buffer=nl.sbuf, name="att_act_warm")
    nisa.memset(dst=warm, value=0.0, engine=POOL_ENG)
    nisa.activation(dst=warm, op=nl.exp, data=warm)
    w = {"wqg": wqg, "wk": wk, "wv": wv, "wo_hbm": wo, "ring": ring}
    # qg [nr, 2, D] act (rounded), vnew [T, D+1] act, and the set-up of everything else
    qg, vnew, rt, ident, at = _project_and_setup(g, xT, w, norm_w, cos, sin, pos, regs)
    qk = _norm_rope(g, qg, w, eps)                      # [nr, D] act: q rows 0..nq-1, k rows KP..KP+T-1
    qa, knT = _queries(g, qk, ident)                    # all query columns [dp, DT, QA]; new keys^T (new-block core)
    # sigmoid(gate) = 1 / (1 + exp(-gate)): exp keeps ScalarE on one activation table
    sg = nl.ndarray((nq, D), F32, buffer=nl.sbuf, name="att_sig_gate")
    nisa.activation(dst=sg, op=nl.exp, data=qg[0:nq, 1, :], scale=-1.0)
    nisa.tensor_scalar(dst=sg, data=sg, op0=nl.add, operand0=1.0)
    o = _attend(g, at, qa, knT, vnew, k_cache, v_cache, rt, ident, max_context, sg)   # [nq, D] act

    # ---- the T new K/V rows: each written exactly once (core 0: K, last core: V). Issued after this core's
    # cache reads: a dynamic-offset write and dynamic-offset reads of one tensor cannot be proven disjoint, so
    # an earlier write would hold the reads back (the new rows themselves are attended from SBUF).
    rows = [[D, T], [1, D]]
    if g.do_k:
        nisa.dma_copy(dst=k_cache.ap(pattern=rows, offset=g.cache_off, scalar_offset=rt["p_reg"], indirect_dim=1),
                      src=qk[KP:nr, :])
    if g.do_v:
        nisa.dma_copy(dst=v_cache.ap(pattern=rows, offset=g.cache_off, scalar_offset=rt["p_reg"], indirect_dim=1),
                      src=vnew[:, 0:D])

    # ---- gate, back to d-on-partitions, o_proj
    og = nl.ndarray((nq, D), act, buffer=nl.sbuf, name="att_gated")
    nisa.tensor_tensor(dst=og, data1=o, data2=sg, op=nl.multiply)
    if stack > 1:
        return _o_proj_stacked(g, og, w["wo"], ident, stack)
    return _o_proj(g, og, w["wo"], ident)


def attention_kv_rows(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=1e-6, core=0, n_cores=1,
                      kv_tile=KV_TILE, layer=None, reg=None):
    """Only the T new K/V rows of :func:`attention_body`: for a caller that reads nothing else of the layer (the
    round's MTP replay, which exists to leave the MTP KV rows of the verified positions; issue 15). No query, no
    cache read, no o_proj: core 0 streams wk (1 MiB per rank at the real shapes) and writes the K rows, the last
    core streams wv and writes the V rows, at rows p..p+T-1 of the caches.

    The rows equal the body's bit for bit: the same matmuls on the same operands (the key rows at partition KP of
    a zero-padded [P, KP + T] stationary, accumulated over the input tiles in order), the same eviction, and the
    body's own :func:`_norm_rope` on the same q|k tile (its query rows are zero here; every step is per row).
    Arguments as for the body (wqg / wo only for the shape checks); ``reg``: a VirtualRegister to reuse for p
    (else allocated). Returns nothing: the caches are written in place. In three steps for a caller that spreads
    them out (the round's D2 inside the verify's LM head): :func:`kv_rows_inputs` (the DMAs of everything but
    xT), :func:`kv_rows_project`, :func:`kv_rows_write`."""
    kin = kv_rows_inputs(xT.shape, xT.dtype, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, core, n_cores,
                         kv_tile, layer, reg)
    kv_rows_write(kin, kv_rows_project(xT, kin, eps))


class KVRowsInputs(nl.NKIObject):
    """What :func:`kv_rows_project` / :func:`kv_rows_write` use: the geometry ``g``, the SBUF weights and tables
    ``w`` (wk / wv as [P, KT, D] where this core projects them), p (SBUF [1, 1] int32) and the register the writes
    load it into, the layer's cache views."""

    def __init__(self, g, w, pos_sb, p_reg, k_cache, v_cache):
        self.g = g
        self.w = w
        self.pos_sb = pos_sb
        self.p_reg = p_reg
        self.k_cache = k_cache
        self.v_cache = v_cache


def kv_rows_inputs(xshape, act, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, core=0, n_cores=1,
                   kv_tile=KV_TILE, layer=None, reg=None, engine=None):
    """Step 1 of :func:`attention_kv_rows` for an input xT of shape ``xshape`` and dtype ``act``: validate, issue the
    DMAs of this core's K or V weight, the norm / RoPE tables and p (loaded into ``reg`` or a new register by
    :func:`kv_rows_write`) -> :class:`KVRowsInputs`. ``engine``: the hardware-DGE queue the weight, the tables and p
    are triggered from (None: the default queue)."""
    g, wqg, wk, wv, wo, norm_w, k_cache, v_cache = _layer_geometry(xshape, act, wqg, wk, wv, wo, norm_w, cos, sin,
                                                                   k_cache, v_cache, pos, n_cores, kv_tile, core,
                                                                   layer)
    pos_sb = _one("kv_rows_pos")
    dma_on(pos_sb, pos.ap(pattern=[[0, 1], [1, 1]], offset=0), engine)
    w = {"wk": wk, "wv": wv}
    for nm_on_off in (("wk", g.do_k, g.wk_off), ("wv", g.do_v, g.wv_off)):
        nm, on, off = nm_on_off
        if on:
            w[nm + "_sb"] = nl.ndarray((P, g.KT, g.D), act, buffer=nl.sbuf, name=f"kv_rows_{nm}")
            dma_on(w[nm + "_sb"], w[nm].ap(pattern=[[g.D, P], [P * g.D, g.KT], [1, g.D]], offset=off), engine)
    if g.do_k:
        _load_tables(g, w, norm_w, cos, sin, engine, negate=False)
    return KVRowsInputs(g, w, pos_sb, nisa.register_alloc() if reg == None else reg, k_cache, v_cache)


def kv_rows_project(xT, kin, eps=1e-6):
    """Step 2 of :func:`attention_kv_rows`: xT SBUF ``[P, KT, T]`` -> (the q|k tile [KP + T, D] act with the normed,
    rotated key rows at KP (None on a core without K), the value rows [T, D] act (None on a core without V))."""
    g, w = kin.g, kin.w
    act, T, KT, D, nr = g.act, g.T, g.KT, g.D, g.nr
    qk = vnew = None
    if g.do_k:
        _negate_sin_half(w)          # the tables were loaded without it (kv_rows_inputs)
        xk = nl.ndarray((P, KT, nr), act, buffer=nl.sbuf, name="kv_rows_xk")
        nisa.memset(dst=xk, value=0.0, engine=POOL_ENG)
        nisa.tensor_copy(dst=xk[:, :, KP:nr], src=xT, engine=POOL_ENG)
        ps = nl.ndarray((nr, D), F32, buffer=nl.psum, name="kv_rows_k_psum")
        for j in range(KT):
            nisa.nc_matmul(dst=ps, stationary=xk[:, j, :], moving=w["wk_sb"][:, j, :], accumulate=j > 0)
        qg = nl.ndarray((nr, 1, D), act, buffer=nl.sbuf, name="kv_rows_k")
        nisa.tensor_copy(dst=qg[:, 0, :], src=ps, engine=ACT_ENG)
        qk = _norm_rope(g, qg, w, eps)
    if g.do_v:
        vps = nl.ndarray((T, D), F32, buffer=nl.psum, name="kv_rows_v_psum")
        for j in range(KT):
            nisa.nc_matmul(dst=vps, stationary=xT[:, j, :], moving=w["wv_sb"][:, j, :], accumulate=j > 0)
        vnew = nl.ndarray((T, D), act, buffer=nl.sbuf, name="kv_rows_v")
        nisa.tensor_copy(dst=vnew, src=vps, engine=DVE_ENG)
    return qk, vnew


def kv_rows_write(kin, rows):
    """Step 3 of :func:`attention_kv_rows`: write ``rows`` (:func:`kv_rows_project`) at cache rows p..p+T-1 (p loaded
    into the register here: the register load waits for p's DMA on its engine, so not in step 1)."""
    g = kin.g
    qk, vnew = rows
    nisa.register_load(kin.p_reg, kin.pos_sb)
    pattern = [[g.D, g.T], [1, g.D]]
    if g.do_k:
        nisa.dma_copy(dst=kin.k_cache.ap(pattern=pattern, offset=g.cache_off, scalar_offset=kin.p_reg, indirect_dim=1),
                      src=qk[KP:g.nr, :])
    if g.do_v:
        nisa.dma_copy(dst=kin.v_cache.ap(pattern=pattern, offset=g.cache_off, scalar_offset=kin.p_reg, indirect_dim=1),
                      src=vnew)


# ---- stages --------------------------------------------------------------------------------------
def _project_and_setup(g, xT, w, norm_w, cos, sin, pos, regs):
    """The set-up that does not need the projections, then the projections (PE-bound once xT lands), then their
    evictions (their PSUM tiles die with this scope, leaving the banks to the KV tiles). Emitted in the order each
    in-order engine queue wants it (issue 15): xT's replica tile zeroed first on GpSimd (the tables' memsets can
    wait for the previous layer through their placement); the tables and p on SP's DMA queue ahead of the ring
    refills, so the runtime scalars, masks and KV buffers are ready long before the tiles; the register loads
    after the refills' triggers in SP's stream (a register load waits there for its value); the o_proj weight
    on ScalarE's DMA queue after the eviction, so the KV tiles (SP's queue) do not move behind its 2 MiB. Without a
    caller's ring (the first draft's MTP layer, the layerwise launch) the body's own ring (``OWN_RING`` slots) is
    allocated and its first chunks issued before the tables: the tables' small tiles can land in holes the input
    norm just freed and wait for it (first-fit placement), and in SP's queue the ring's DMAs would wait behind theirs
    (bench/decode_speed.md lever 33); the tables then go on ScalarE's DMA queue, so the ring's refills, bandwidth-bound
    from the layer's top, do not queue behind them either (issue 15)."""
    xrep = _replica_tile(g)
    table_queue = None
    if w["ring"] == None:
        w["ring"] = _fill_ring(g, w, g.act, _kv_names(g.do_k, g.do_v), OWN_RING)
        table_queue = ACT_ENG
    _load_tables(g, w, norm_w, cos, sin, engine=table_queue)
    _replicate_x(g, xT, xrep)
    rt, vals = _runtime_scalars(g, pos)
    ident = nl.shared_identity_matrix(P, dtype=g.act)
    at = _attend_setup(g, rt)                          # softmax state, masks, KV tile buffers
    ps = _project(g, xT, xrep, w)
    _load_registers(rt, vals, regs)
    qg, vnew = _project_out(g, ps)
    _load_wo(g, w)
    return qg, vnew, rt, ident, at


def _load_tables(g, w, norm_w, cos, sin, engine=None, negate=True):
    """The small per-row tables (the projection weights are streamed by :func:`_project`, the o_proj weight is
    loaded by :func:`_load_wo`). Each core reads only its heads' columns: over the LNC pair every weight byte is
    read once. ``engine``: the hardware-DGE queue of the DMAs (None: the default queue). ``negate=False``: the
    caller negates the sin half (:func:`_negate_sin_half`) once it needs the table, e.g. when the loads are issued
    long before: VectorE runs in program order, so the negation waiting here for the DMAs would hold back
    everything VectorE is given after it."""
    act, Hc, D, dp, DT, H = g.act, g.Hc, g.D, g.dp, g.DT, g.H
    T, nq, nr, R = g.T, g.nq, g.nr, g.R
    h0 = g.core * Hc
    # norm weights and rope tables per row of the q|k tile (padding rows between nq and KP are zero)
    nw = nl.ndarray((nr, D), F32, buffer=nl.sbuf, name="att_norm_w")
    cs = nl.ndarray((nr, 2, R), F32, buffer=nl.sbuf, name="att_cos_sin")
    nisa.memset(dst=nw, value=0.0, engine=POOL_ENG)
    nisa.memset(dst=cs, value=0.0, engine=POOL_ENG)
    dma_on(nw[0:nq, :], norm_w.ap(pattern=[[0, nq], [1, D]], offset=g.norm_off), engine)
    for s_tab in ((0, cos), (1, sin)):                # row t*Hc + h <- table row t
        s, tab = s_tab
        dma_on(cs[0:nq, s, :], tab.ap(pattern=[[R, T], [0, Hc], [1, R]], offset=0), engine)
    if g.do_k:
        dma_on(nw[KP:nr, :], norm_w.ap(pattern=[[0, T], [1, D]], offset=g.norm_off + D), engine)
        for s_tab in ((0, cos), (1, sin)):
            s, tab = s_tab
            dma_on(cs[KP:nr, s, :], tab, engine)
    w["norm_w"] = nw
    w["cos_sin"] = cs
    if negate:
        _negate_sin_half(w)


def _negate_sin_half(w):
    """The first half of the sin rows negated in place (``rotate_half``'s sign, folded into the table)."""
    cs = w["cos_sin"]
    R = cs.shape[2]
    nisa.tensor_scalar(dst=cs[:, 1, 0:R // 2], data=cs[:, 1, 0:R // 2], op0=nl.multiply, operand0=-1.0)


def _load_wo(g, w):
    """o_proj weight rows of this core's heads -> SBUF [dp, Hc*DT, H]: one DMA per (head, d-tile) block on
    ScalarE's hardware-DGE queue (the DMAs of one queue move in order, SDK nki-dma-overview.rst "DMA Queues": on
    SP's default queue the KV tiles queued behind its 2 MiB), triggered after the projections' eviction in
    ScalarE's stream, so it does not share the bandwidth with the projection ring."""
    act, Hc, D, dp, DT, H = g.act, g.Hc, g.D, g.dp, g.DT, g.H
    wo_sb = nl.ndarray((dp, Hc * DT, H), act, buffer=nl.sbuf, name="att_wo")
    r0 = g.core * Hc * D
    for bk in range(Hc * DT):
        nisa.dma_copy(dst=wo_sb[:, bk, :], src=w["wo_hbm"][r0 + bk * dp:r0 + (bk + 1) * dp, :],
                      dge_mode=nisa.dge_mode.hwdge, engine=ACT_ENG)
    w["wo"] = wo_sb


def _int_op(dst, data, op0, operand0, op1=None, operand1=None):
    nisa.tensor_scalar(dst=dst, data=data, op0=op0, operand0=operand0, op1=op1, operand1=operand1)
    return dst


def _one(name, dtype=nl.int32):
    """A [1, 1] SBUF scalar tile."""
    return nl.ndarray((1, 1), dtype, buffer=nl.sbuf, name=name)


def _runtime_scalars(g, pos):
    """Run-time values derived from p on-chip (int32 on VectorE / GpSimd; exact below 2^24) and loaded into
    registers (the loop bounds and DMA offsets of :func:`_tiles`).

    With S = n_cores * B (one rank tile: B rows per core): p_reg: p (cache write offset). r = p mod S (head
    rows; head_prefix_reg = (r > 0 and n == 0), head_reg = (r > 0 and n >= 1), pre_reg = r if n >= 1 else 0 (tile 0's
    prefetch row); this core's head-tile threshold r - c*B as an fp32 column, rem_f). The n = p // S
    full rank tiles start at rows r + j*S (start_reg = r; core c adds the static c*B). Pipeline registers:
    one = (n == 1); two = (n >= 2: tiles 0 and 1); pairs of tiles 2.. run from r to pair_end = r + 2S *
    (max(n - 2, 0) // 2); odd = (n odd, >= 3; the last tile is then at pair_end + 2S) = (n & 1) - one; even =
    (n even, >= 2) = two - odd. Every register value is the same on both cores.
    ``ATTENTION_REGISTERS`` registers in all (``regs`` reuses the caller's)."""
    B, c, nc = g.B, g.core, g.n_cores
    S = nc * B                                          # rows of one rank tile (B per core)
    i32 = nl.int32
    pos_i = nl.ndarray((P, 1), i32, buffer=nl.sbuf, name="att_pos")
    nisa.dma_copy(dst=pos_i, src=pos.ap(pattern=[[0, P], [1, 1]], offset=0))
    rem_i = _int_op(nl.ndarray((P, 1), i32, buffer=nl.sbuf, name="att_rem"), pos_i, nl.bitwise_and, S - 1)
    r_f = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="att_rem_f")
    nisa.tensor_copy(dst=r_f, src=rem_i)
    rem_f = r_f
    if c > 0:                                           # this core's head tile starts at row c*B
        rem_f = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="att_rem_core_f")
        nisa.tensor_scalar(dst=rem_f, data=r_f, op0=nl.add, operand0=float(-c * B))
    rt = {"rem_f": rem_f}
    vals = {"p": pos_i[0:1, :], "start": rem_i[0:1, :]}
    has_head = _int_op(_one("att_has_head"), rem_i[0:1, :], nl.greater, 0.0)
    # (computed also with max_context, so that a shape-only trace has exactly a data launch's instructions)
    n = _int_op(_one("att_nfull"), pos_i[0:1, :], nl.right_shift, S.bit_length() - 1)
    any_full = _int_op(_one("att_any_full"), n, nl.greater_equal, 1.0)
    vals["head"] = _one("att_head_valid")       # r > 0 and n >= 1: the head rows are all < p
    nisa.tensor_tensor(dst=vals["head"], data1=has_head, data2=any_full, op=nl.multiply)
    vals["pre"] = _one("att_prefetch_row")      # tile 0's first row: r if n >= 1, else 0
    nisa.tensor_tensor(dst=vals["pre"], data1=rem_i[0:1, :], data2=any_full, op=nl.multiply)
    vals["head_prefix"] = _one("att_head_prefix")   # r > 0 and n == 0
    nisa.tensor_tensor(dst=vals["head_prefix"], data1=has_head, data2=vals["head"], op=nl.subtract)
    vals["one"] = _int_op(_one("att_one"), n, nl.equal, 1.0)
    vals["two"] = _int_op(_one("att_two"), n, nl.greater_equal, 2.0)
    m = _int_op(_one("att_m_pre"), n, nl.add, -2.0, nl.maximum, 0.0)
    m = _int_op(_one("att_pairs"), m, nl.right_shift, 1)
    vals["pair_end"] = _int_op(_one("att_pair_end"), m, nl.multiply, float(2 * S), nl.add, r_f[0:1, :])
    bit = _int_op(_one("att_n_odd"), n, nl.bitwise_and, 1)
    vals["odd"] = _one("att_odd")
    nisa.tensor_tensor(dst=vals["odd"], data1=bit, data2=vals["one"], op=nl.subtract)
    vals["even"] = _one("att_even")
    nisa.tensor_tensor(dst=vals["even"], data1=vals["two"], data2=vals["odd"], op=nl.subtract)
    return rt, vals


def _load_registers(rt, vals, regs=None):
    """Load the :func:`_runtime_scalars` values into registers ``rt[name + "_reg"]`` (``regs``: the caller's, else
    allocated). Issued after the projections' ring refills: a register load waits in SP's instruction stream for
    its value, and the refills' DMA triggers sit in the same stream."""
    if regs != None and len(regs) < len(REGISTER_NAMES):
        raise ValueError(f"attention: {len(regs)} registers given, the body needs {len(REGISTER_NAMES)}")
    for i in range(len(REGISTER_NAMES)):
        k = REGISTER_NAMES[i]
        rt[k + "_reg"] = nisa.register_alloc() if regs == None else regs[i]
        nisa.register_load(rt[k + "_reg"], vals[k])


def _replica_tile(g):
    """The zeroed SBUF tile of :func:`_replicate_x`: ``xrep [P, Hc (+1 on the K core), KT, nr]`` (its memset is the
    first GpSimd work of the body: it does not wait for xT)."""
    nx = g.Hc + (1 if g.do_k else 0)
    xrep = nl.ndarray((P, nx, g.KT, g.nr), g.act, buffer=nl.sbuf, name="att_xrep")
    nisa.memset(dst=xrep, value=0.0, engine=POOL_ENG)
    return xrep


def _replicate_x(g, xT, xrep):
    """The zero-padded stationary replicas of xT of :func:`_project` (GpSimd) into :func:`_replica_tile`'s xrep:
    ``xrep[:, h, j, r]`` = xT[:, j, t] iff r = t*Hc + h (the K replica, h = Hc: iff r = KP + t)."""
    Hc, nq, nr = g.Hc, g.nq, g.nr
    for h in range(Hc):
        nisa.tensor_copy(dst=xrep[:, h, :, h:nq:Hc], src=xT, engine=POOL_ENG)
    if g.do_k:
        nisa.tensor_copy(dst=xrep[:, Hc, :, KP:nr], src=xT, engine=POOL_ENG)


def _project(g, xT, xrep, w):
    """q|gate (+ k on core 0) in row layout [(t, h), 2, D] and v [T, D], accumulated in PSUM (fp32);
    returns (qg_psum [nr, 2, D], v_psum [T, D] or None) for :func:`_project_out`.

    The weights stream through a ring of WR SBUF slots of JG input-feature tiles each (this core's heads of
    wqg, and wk / wv where this core projects them; the body's own ``OWN_RING`` slots, or those of a caller's
    :func:`attention_ring`; the first WR chunks' DMAs are issued before the projections): the DMA of chunk c + WR
    is issued after chunk c's matmuls (it reuses that slot), so the chunks arrive in order and the matmuls of chunk
    c overlap the transfer of the later ones instead of waiting for every weight byte."""
    act, KT, Hc, D, T, nq, nr = g.act, g.KT, g.Hc, g.D, g.T, g.nq, g.nr
    JG, NK, WR = _ring_shape(KT)
    kv_names = _kv_names(g.do_k, g.do_v)
    ring = w["ring"]                                   # the body's own ring (_project_and_setup) or the caller's
    if not WR <= len(ring) <= NK or tuple(ring[0]["wqg"].shape) != (P, JG, 2, Hc, D):
        raise ValueError(f"attention: a ring of {len(ring)} slots {list(ring[0]['wqg'].shape)} was passed, expected "
                         f"{WR}..{NK} of [{P}, {JG}, 2, {Hc}, {D}] (attention_ring of the same tensors and core)")
    WR = len(ring)
    ps = nl.ndarray((nr, 2, D), F32, buffer=nl.psum, name="att_qg_psum")
    vps = nl.ndarray((T, D), F32, buffer=nl.psum, name="att_v_psum") if g.do_v else None
    first = True
    for ck in range(NK):
        slot = ring[ck % WR]
        for jj in range(JG):
            j = ck * JG + jj
            for h in range(Hc):
                nisa.nc_matmul(dst=ps, stationary=xrep[:, h, j, :], moving=slot["wqg"][:, jj, :, h, :],
                               accumulate=not first)
                first = False
            if g.do_k:
                nisa.nc_matmul(dst=ps[:, 0, :], stationary=xrep[:, Hc, j, :], moving=slot["wk"][:, jj, :],
                               accumulate=True)
            if g.do_v:
                nisa.nc_matmul(dst=vps, stationary=xT[:, j, :], moving=slot["wv"][:, jj, :], accumulate=j > 0)
        if ck + WR < NK:
            _load_chunk(g, w, ring[(ck + WR) % WR], (ck + WR) * JG, JG, kv_names)
    return ps, vps


EARLY_RING = 6     # ring slots of attention_ring: 6 of the 8 chunks at the real shapes (30 KiB per partition); with
# the slots as separate tiles the megakernel could not place 7 or 8 (nkisim AllocationError), and a 3-slot ring
# issued early gained ~1 us per layer only (bench/decode_speed.md row 19). As one tile, 8 slots place, but gain
# nothing: the projections are PE-bound once xT lands (4-layer round 1,631.9 us central either way; issue 15)


OWN_RING = 4       # ring slots of the body's own ring (no caller's ring: the first draft's MTP layer, the layerwise
# launch): the 8 chunks' DMAs are bandwidth-bound from the layer's top, and with the body's 3 slots the 4th chunk's
# DMA waited for chunk 0's matmuls (xT's replicas) while the queue sat idle. 4-layer A/B round (context 2,048,
# expected routing) 1,490.1 (1,344.7 - 3,005.2) -> 1,487.5 (1,345.6 - 3,005.2) us with 4 slots and the tables on
# ScalarE's queue (4 slots alone 1,488.1; 5 or 6: 1,487.6; 8: 1,490.5,
# placement); bench/decode_speed.md lever 33 had measured 4 / 6 / 8 before the tables moved (issue 15)


def _ring_shape(KT):
    """(JG input tiles per ring chunk, NK chunks, WR ring slots) of the projection weight ring."""
    JG = 2 if KT % 2 == 0 else 1
    return JG, KT // JG, min(3, KT // JG)


def _kv_names(do_k, do_v):
    out = []
    for nm_on in (("wk", do_k), ("wv", do_v)):
        nm, on = nm_on
        if on:
            out.append(nm)
    return out


def _fill_ring(g, w, act, kv_names, WR=None):
    """Allocate the WR ring slots of :func:`_project` (default: ``_ring_shape``'s; a given WR is clamped to
    ``_ring_shape``'s WR .. NK) and issue the DMAs of its first WR chunks."""
    JG, NK, WR0 = _ring_shape(g.KT)
    WR = WR0 if WR == None else max(WR0, min(WR, NK))
    # ONE tile for every slot (slots are views): first-fit placement then needs one hole of the whole ring, so its
    # slots do not land in the small holes the previous layer's residual and all-reduce buffers leave, whose reuse
    # waits for that layer's last add (a WAR that held the early ring's DMAs behind it; issue 15)
    nq, nk = JG * 2 * g.Hc * g.D, JG * g.D
    buf = nl.ndarray((P, WR, nq + len(kv_names) * nk), act, buffer=nl.sbuf, name="att_w_ring")
    ring = []
    for i in range(WR):
        slot = {"wqg": buf[:, i, 0:nq].reshape((P, JG, 2, g.Hc, g.D))}
        for k in range(len(kv_names)):
            nm = kv_names[k]
            slot[nm] = buf[:, i, nq + k * nk:nq + (k + 1) * nk].reshape((P, JG, g.D))
        ring.append(slot)
    for ck in range(WR):
        _load_chunk(g, w, ring[ck], ck * JG, JG, kv_names)
    return ring


class _RingGeometry(nl.NKIObject):
    """What :func:`_fill_ring` / :func:`_load_chunk` read of an :class:`AttentionGeometry`, from the weights alone."""

    def __init__(self, KT, Hq, D, core, n_cores, offsets):
        self.KT = KT
        self.Hq = Hq
        self.Hc = Hq // n_cores
        self.D = D
        self.core = core
        self.wqg_off = offsets[0]
        self.wk_off = offsets[1]
        self.wv_off = offsets[2]


def attention_ring(wqg, wk, wv, core=0, n_cores=1, layer=None, slots=EARLY_RING):
    """Allocate the projection weight ring of :func:`attention_body` with ``slots`` chunk slots (at least the
    body's own 3, at most all chunks) and issue the DMAs of its first chunks (those the body would issue, in the
    same order) for ``attention_body(..., ring=)``: a caller issues them early, e.g. before the layer's input norm,
    so they stream under the previous all-reduce and the norm instead of after them (issue 15). Arguments as for
    the body."""
    offs = (layer_offset(wqg, layer), layer_offset(wk, layer), layer_offset(wv, layer))
    if layer != None:
        wqg, wk, wv = layer_of(wqg, layer), layer_of(wk, layer), layer_of(wv, layer)
    H, _, Hq, D = wqg.shape
    g = _RingGeometry(H // P, Hq, D, core, n_cores, offs)
    JG, NK, WR = _ring_shape(H // P)
    return _fill_ring(g, {"wqg": wqg, "wk": wk, "wv": wv}, wqg.dtype, _kv_names(core == 0, core == n_cores - 1),
                      max(WR, min(slots, NK)))


def _load_chunk(g, w, slot, j0, JG, kv_names):
    """DMA input-feature tiles j0..j0+JG-1 of this core's heads of wqg (and of wk / wv in ``kv_names``) into
    one ring slot of :func:`_project`."""
    Hc, Hq, D = g.Hc, g.Hq, g.D
    row = 2 * Hq * D                                   # elements of one wqg row (input feature)
    h0 = g.core * Hc
    nisa.dma_copy(dst=slot["wqg"], src=w["wqg"].ap(pattern=[[row, P], [P * row, JG], [Hq * D, 2], [1, Hc * D]],
                                                   offset=g.wqg_off + j0 * P * row + h0 * D))
    for nm in kv_names:
        off = g.wk_off if nm == "wk" else g.wv_off
        nisa.dma_copy(dst=slot[nm], src=w[nm].ap(pattern=[[D, P], [P * D, JG], [1, D]], offset=off + j0 * P * D))


def _project_out(g, psums):
    """Evict the projections rounded to the activation dtype: qg [nr, 2, D], vnew [T, D+1] (last column 1,
    so that PV of the new block also sums its P) on the V core, else None."""
    act, D, T, nr = g.act, g.D, g.T, g.nr
    ps, vps = psums
    qg = nl.ndarray((nr, 2, D), act, buffer=nl.sbuf, name="att_qg")
    for half in range(2):       # the q|k half first: the norm waits for it, the gate is read much later
        nisa.tensor_copy(dst=qg[:, half, :], src=ps[:, half, :], engine=ACT_ENG)
    vnew = None
    if g.do_v:
        vnew = nl.ndarray((T, D + 1), act, buffer=nl.sbuf, name="att_vnew")   # last column 1: PV also sums P
        nisa.memset(dst=vnew[:, D:D + 1], value=1.0, engine=POOL_ENG)
        nisa.tensor_copy(dst=vnew[:, 0:D], src=vps, engine=DVE_ENG)
    return qg, vnew


def _norm_rope(g, qg, w, eps):
    """Zero-centred RMSNorm (fp32, weight 1 + w) then rotate-half RoPE on dims [0, R) of every row of the q|k
    tile (zero padding rows stay zero; on the cores without k the key rows are zero); each step rounds to the
    activation dtype like model.functional."""
    act, D, R, nn = g.act, g.D, g.R, g.nr
    x = qg[0:nn, 0, :]
    sq = nl.ndarray((nn, D), F32, buffer=nl.sbuf, name="att_sq")
    nisa.tensor_tensor(dst=sq, data1=x, data2=x, op=nl.multiply)
    ss = nl.ndarray((nn, 1), F32, buffer=nl.sbuf, name="att_sumsq")
    nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=1)
    rstd = nl.ndarray((nn, 1), F32, buffer=nl.sbuf, name="att_rstd")       # rsqrt(mean + eps) on GpSimd (precise,
    nisa.tensor_scalar(dst=rstd, data=ss, op0=nl.multiply, operand0=1.0 / D, op1=nl.add, operand1=float(eps))
    nisa.tensor_scalar(dst=rstd, data=rstd, op0=nl.rsqrt, operand0=None, engine=POOL_ENG)   # no ACT table)
    qk = nl.ndarray((nn, D), act, buffer=nl.sbuf, name="att_qk")
    nisa.scalar_tensor_tensor(dst=qk, data=x, op0=nl.multiply, operand0=rstd, op1=nl.multiply,
                              operand1=w["norm_w"])
    # RoPE on the first R dims: out = x*cos + [x2, x1]*[-sin_lo, sin_hi] (the sin table's first half was negated
    # at load time); [x2, x1] is a view of x with the two halves swapped (a negative-stride access pattern)
    h = R // 2
    cs = w["cos_sin"]
    c = nl.ndarray((nn, R), F32, buffer=nl.sbuf, name="att_rope_c")
    nisa.tensor_tensor(dst=c, data1=qk[:, 0:R], data2=cs[:, 0, :], op=nl.multiply)
    u = nl.ndarray((nn, R), F32, buffer=nl.sbuf, name="att_rope_u")
    swapped = qk.ap(pattern=[[D, nn], [-h, 2], [1, h]], offset=h)
    nisa.tensor_tensor(dst=u, data1=swapped, data2=cs[:, 1, :], op=nl.multiply)
    nisa.tensor_tensor(dst=qk[:, 0:R], data1=c, data2=u, op=nl.add)
    return qk


def _queries(g, qk, ident):
    """Transpose the q|k tile (PE, matmul against an identity: exact for bf16; fp32 PSUM, so no 2-byte
    sub-word PSUM writes -- trn2-costs pitfalls) and assemble the attention queries.

    Returns (qa [dp, DT, QA] act, knT [dp, DT, T] act or None). LNC=1: QA = nq (all heads). LNC=2: the two
    cores swap their transposed queries (and core 0's new keys) with ONE sendrecv of whole tiles, so each core
    attends with ALL the rank's heads over its share of the KV tiles: columns 0..nq-1 = this core's heads,
    KP..KP+nq-1 = the other core's (zero between); knT (the new keys, d-major) goes to the last core, which
    attends the new block."""
    act, dp, DT, nq, nr, T = g.act, g.dp, g.DT, g.nq, g.nr, g.T
    ps = nl.ndarray((dp, DT, nr), F32, buffer=nl.psum, name="att_qkT_psum")
    for dh in range(DT):
        nisa.nc_matmul(dst=ps[:, dh, :], stationary=qk[:, dh * dp:(dh + 1) * dp], moving=ident[0:nr, 0:nr],
                       accumulate=False)
    if g.n_cores == 1:
        qa = nl.ndarray((dp, DT, nq), act, buffer=nl.sbuf, name="att_qT")
        nisa.tensor_copy(dst=qa, src=ps[:, :, 0:nq], engine=DVE_ENG)
        knT = nl.ndarray((dp, DT, T), act, buffer=nl.sbuf, name="att_knewT")
        nisa.tensor_copy(dst=knT, src=ps[:, :, KP:nr], engine=ACT_ENG)
        return qa, knT
    send = nl.ndarray((dp, DT, nq + T), act, buffer=nl.sbuf, name="att_xchg_q_send")
    nisa.tensor_copy(dst=send[:, :, 0:nq], src=ps[:, :, 0:nq], engine=DVE_ENG)
    nisa.tensor_copy(dst=send[:, :, nq:nq + T], src=ps[:, :, KP:nr], engine=ACT_ENG)
    recv = nl.ndarray((dp, DT, nq + T), act, buffer=nl.sbuf, name="att_xchg_q_recv")
    c = g.core
    nisa.sendrecv(src=send, dst=recv, send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=0)
    qa = nl.ndarray((dp, DT, KP + nq), act, buffer=nl.sbuf, name="att_qT")
    nisa.memset(dst=qa[:, :, nq:KP], value=0.0, engine=POOL_ENG)
    nisa.tensor_copy(dst=qa[:, :, 0:nq], src=send[:, :, 0:nq], engine=POOL_ENG)
    nisa.tensor_copy(dst=qa[:, :, KP:KP + nq], src=recv[:, :, 0:nq], engine=POOL_ENG)
    knT = recv[:, :, nq:nq + T] if g.new else None
    return qa, knT


def _tile_buffers(g, name):
    """One set of per-tile buffers (two sets alternate: tile i+1's DMA / transposes overlap tile i's softmax).
    k: [P, NC, D], v: [P, NC, D+1] act, partition p holds rows NC*p..NC*p+NC-1 (separate tiles: the two DMAs
    stay independent); v's last column is 1 so that PV also produces the row sums l. The SBUF part is
    allocated early (:func:`_attend_setup`); the PSUM part (kT per d-tile: 1 bank each, scores: 1 bank, P^T
    and PV sharing one bank -- 4 banks per set) by :func:`_tile_psum` once the projections' PSUM is free."""
    act, dp, DT, NC, QA, D = g.act, g.dp, g.DT, g.NC, g.QA, g.D
    b = {}
    b["k"] = nl.ndarray((P, NC, D), act, buffer=nl.sbuf, name=f"att_k_{name}")
    b["v"] = nl.ndarray((P, NC, D + 1), act, buffer=nl.sbuf, name=f"att_v_{name}")
    nisa.memset(dst=b["v"][:, :, D:D + 1], value=1.0, engine=POOL_ENG)
    b["kT"] = nl.ndarray((dp, DT, NC, P), act, buffer=nl.sbuf, name=f"att_kT_{name}")
    b["pT"] = nl.ndarray((P, NC, QA), act, buffer=nl.sbuf, name=f"att_pT_{name}")
    b["p"] = nl.ndarray((QA, NC * P), act, buffer=nl.sbuf, name=f"att_probs_{name}")
    b["s_m"] = nl.ndarray((QA, NC * P), F32, buffer=nl.sbuf, name=f"att_scores_masked_{name}")
    for nm in ("nmx", "b", "alpha"):
        b[nm] = nl.ndarray((QA, 1), F32, buffer=nl.sbuf, name=f"att_{nm}_{name}")
    b["name"] = name
    return b


def _tile_psum(g, b):
    """The PSUM tiles of a buffer set (see :func:`_tile_buffers`)."""
    dp, DT, NC, QA, D, name = g.dp, g.DT, g.NC, g.QA, g.D, b["name"]
    b["kT_ps"] = []
    for dh in range(DT):
        b["kT_ps"].append(nl.ndarray((dp, NC, P), F32, buffer=nl.psum, name=f"att_kT_psum{dh}_{name}"))
    b["s_ps"] = nl.ndarray((QA, NC * P), F32, buffer=nl.psum, name=f"att_scores_{name}")
    aux = nl.ndarray((P, PSUM_BANK), F32, buffer=nl.psum, name=f"att_pT_pv_{name}")
    b["pT_ps"] = aux[:, 0:NC * QA].reshape((P, NC, QA))
    b["pv"] = aux[0:QA, NC * QA:NC * QA + D + 1]


def _attend_setup(g, rt):
    """Everything of the attention that does not depend on the projections (emitted early so that it runs
    while the weights stream): the softmax state, the head-tile masks and the two KV tile buffer sets."""
    D, NC, QA = g.D, g.NC, g.QA
    st = {}
    st["ol"] = nl.ndarray((QA, D + 1), F32, buffer=nl.sbuf, name="att_acc")     # [O | l]
    nisa.memset(dst=st["ol"], value=0.0)
    st["nm"] = nl.ndarray((QA, 1), F32, buffer=nl.sbuf, name="att_negmax")       # -(running max), scaled
    nisa.memset(dst=st["nm"], value=M_INIT)

    # head-tile masks (static iotas vs this core's run-time threshold r - c*B); score column (c, p) is key
    # NC*p + c of the tile
    key_s = nl.ndarray((QA, NC, P), F32, buffer=nl.sbuf, name="att_key_cols")
    nisa.iota(dst=key_s, pattern=[[1, NC], [NC, P]], offset=0, channel_multiplier=0)
    mask_s = nl.ndarray((QA, NC * P), F32, buffer=nl.sbuf, name="att_head_mask")
    nisa.tensor_scalar(dst=mask_s, data=key_s, op0=nl.greater_equal, operand0=rt["rem_f"][0:QA, :],
                       op1=nl.multiply, operand1=NEG)
    key_r = nl.ndarray((P, NC), F32, buffer=nl.sbuf, name="att_key_rows")
    nisa.iota(dst=key_r, pattern=[[1, NC]], offset=0, channel_multiplier=NC)
    dead = nl.ndarray((P, NC), nl.uint8, buffer=nl.sbuf, name="att_dead_rows")
    nisa.tensor_scalar(dst=dead, data=key_r, op0=nl.greater_equal, operand0=rt["rem_f"])
    masks = {"score": mask_s, "dead": dead}
    if g.new:    # the new block's static causal mask (row t*Hc + h sees key t' iff t' <= t; see _attend)
        T, Hc, nq = g.T, g.Hc, g.nq
        zero = nl.ndarray((QA, T), F32, buffer=nl.sbuf, name="att_zero")
        nisa.memset(dst=zero, value=0.0, engine=POOL_ENG)
        causal = nl.ndarray((QA, T), F32, buffer=nl.sbuf, name="att_causal")
        nisa.memset(dst=causal, value=0.0, engine=POOL_ENG)     # (zero padding rows between the blocks)
        for r0 in range(0, QA, KP):      # each core's block of rows has the same (t, h) order
            n = min(nq, QA - r0)
            nisa.affine_select(dst=causal[r0:r0 + n], pattern=[[-Hc, T]], channel_multiplier=1,
                               on_true_tile=zero[r0:r0 + n], on_false_value=NEG, cmp_op=nl.greater_equal, offset=0)
        masks["causal"] = causal
    bufs = [_tile_buffers(g, "a"), _tile_buffers(g, "b")]
    return {"st": st, "masks": masks, "bufs": bufs}


def _attend(g, at, qa, knT, vnew, k_cache, v_cache, rt, ident, max_context, sg):
    """Causal online-softmax attention of the QA query rows over this core's share of the cache rows 0..p-1
    (and the new block on the last core); with LNC=2 the two partial softmax states are merged.
    Returns O / l for this core's nq rows as an SBUF [nq, D] act-dtype tile (rounded like the reference).
    ``sg`` [nq, D] fp32 holds 1 + exp(-gate); it is inverted in place (the gate's sigmoid) where VectorE waits
    anyway, in column pieces (elementwise, so the same bits; sized to the waits): on the new-block core 5/8 while
    ScalarE / PE compute the new block's P and PV, 1/4 during the state exchange and 1/8 while ScalarE computes
    the merge weights; on the other core after the KV tiles (VectorE's reciprocal is 8x per element, ~2.3 us
    for the whole tile: before the tiles it delayed the first K^T eviction)."""
    act, nq, D, B, T, Hc, NC = g.act, g.nq, g.D, g.B, g.T, g.Hc, g.NC
    QA, c, nc = g.QA, g.core, g.n_cores
    st = at["st"]
    _run_tiles(g, st, at, qa, k_cache, v_cache, rt, ident, max_context)
    cuts = (0, 5 * D // 8, 7 * D // 8, D) if g.new and nc == 2 else ((0, D // 2, D, D) if g.new else (0, D, D, D))
    if not g.new:
        _invert(sg, cuts[0], cuts[1])

    if g.new:    # the new block: T keys from SBUF, static causal mask (row t*Hc + h sees key t' iff t' <= t)
        s_ps = nl.ndarray((QA, T), F32, buffer=nl.psum, name="att_new_scores")
        for dh in range(g.DT):
            nisa.nc_matmul(dst=s_ps, stationary=qa[:, dh, :], moving=knT[:, dh, :], accumulate=dh > 0)
        s = nl.ndarray((QA, T), F32, buffer=nl.sbuf, name="att_new_scores_masked")
        nisa.tensor_tensor(dst=s, data1=s_ps, data2=at["masks"]["causal"], op=nl.add)
        tmp = {}
        for nm in ("nmx", "b", "alpha"):
            tmp[nm] = nl.ndarray((QA, 1), F32, buffer=nl.sbuf, name=f"att_new_{nm}")
        p_t = nl.ndarray((QA, T), act, buffer=nl.sbuf, name="att_new_probs")
        _softmax_stats(g, st, tmp, s=s)
        _invert(sg, cuts[0], cuts[1])
        _softmax_exp(g, st, tmp, s=s, p_t=p_t)
        pT_ps = nl.ndarray((T, QA), F32, buffer=nl.psum, name="att_new_pT_psum")
        nisa.nc_matmul(dst=pT_ps, stationary=p_t, moving=ident[0:QA, 0:QA], accumulate=False)
        pT = nl.ndarray((T, QA), act, buffer=nl.sbuf, name="att_new_pT")
        nisa.tensor_copy(dst=pT, src=pT_ps, engine=ACT_ENG)
        pv = nl.ndarray((QA, D + 1), F32, buffer=nl.psum, name="att_new_pv")
        nisa.nc_matmul(dst=pv, stationary=pT, moving=vnew, accumulate=False)
        nisa.scalar_tensor_tensor(dst=st["ol"], data=st["ol"], op0=nl.multiply, operand0=tmp["alpha"],
                                  op1=nl.add, operand1=pv)
    if nc == 1:
        _invert(sg, cuts[1], D)

    ol, nm = st["ol"], st["nm"]
    if nc == 2:     # merge with the other core's partial state for this core's heads (rows KP.. over there)
        send = nl.ndarray((nq, D + 2), F32, buffer=nl.sbuf, name="att_xchg_state_send")
        nisa.tensor_copy(dst=send[:, 0:D + 1], src=ol[KP:KP + nq, :], engine=DVE_ENG)
        nisa.tensor_copy(dst=send[:, D + 1:D + 2], src=nm[KP:KP + nq, :], engine=POOL_ENG)
        recv = nl.ndarray((nq, D + 2), F32, buffer=nl.sbuf, name="att_xchg_state_recv")
        nisa.sendrecv(src=send, dst=recv, send_to_rank=1 - c, recv_from_rank=1 - c, pipe_id=1)
        _invert(sg, cuts[1], cuts[2])
        bm = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_merge_negmax")
        nisa.tensor_tensor(dst=bm, data1=nm[0:nq, :], data2=recv[:, D + 1:D + 2], op=nl.minimum)
        _invert(sg, cuts[2], cuts[3])
        a_oth = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_merge_alpha_other")   # first: oth needs it
        nisa.activation(dst=a_oth, op=nl.exp, data=recv[:, D + 1:D + 2], scale=-1.0, bias=bm)
        a_own = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_merge_alpha_own")
        nisa.activation(dst=a_own, op=nl.exp, data=nm[0:nq, :], scale=-1.0, bias=bm)
        oth = nl.ndarray((nq, D + 1), F32, buffer=nl.sbuf, name="att_merge_other")
        nisa.tensor_scalar(dst=oth, data=recv[:, 0:D + 1], op0=nl.multiply, operand0=a_oth)
        nisa.scalar_tensor_tensor(dst=ol[0:nq, :], data=ol[0:nq, :], op0=nl.multiply, operand0=a_own,
                                  op1=nl.add, operand1=oth)
    rl = nl.ndarray((nq, 1), F32, buffer=nl.sbuf, name="att_inv_rowsum")
    nisa.reciprocal(dst=rl, data=ol[0:nq, D:D + 1])
    o = nl.ndarray((nq, D), act, buffer=nl.sbuf, name="att_out")
    nisa.tensor_scalar(dst=o, data=ol[0:nq, 0:D], op0=nl.multiply, operand0=rl)
    return o


def _invert(sg, c0, c1):
    """sg[:, c0:c1] <- 1 / sg[:, c0:c1] (VectorE; nothing when the range is empty)."""
    if c1 > c0:
        nisa.reciprocal(dst=sg[:, c0:c1], data=sg[:, c0:c1])


def _run_tiles(g, st, at, qa, k_cache, v_cache, rt, ident, max_context):
    """The KV tiles; see :func:`_tiles`."""
    _tiles(g, st, at["bufs"], qa, k_cache, v_cache, rt, ident, at["masks"], max_context)


def _with_psum(g, bufs):
    """Copies of the two buffer sets that also hold freshly allocated PSUM tiles (:func:`_tile_psum`). Called
    at the top of every loop body: PSUM only lives within one pipeline stage (each stage's matmul results are
    evicted or consumed before the stage ends), so nothing in PSUM is carried across iterations -- all
    loop-carried state is in SBUF, as SDK-NL fori_loop asks -- and no PE instruction inside a runtime loop
    writes PSUM allocated outside it (rejected by neuronx-cc, NCC_IBIR092; nkisim refuses it). The tiles die
    with the body's scope, so every iteration gets the same 8 banks back."""
    sets = []
    for b in bufs:
        c = dict(b)
        _tile_psum(g, c)
        sets.append(c)
    return sets


def _first(kx, b, row0, reg, masked=False, zero=False, dma=True):
    """Stage 1 of a tile: load, K^T, scores, softmax statistics and exp. ``kx``: the tile context of
    :func:`_tiles`; row0 / reg: the tile's first cache row (static part, run-time register or None); masked: the
    head-tile score mask, zero: also zero its dead rows' data, dma: issue its DMAs (:func:`_tile_load`)."""
    g, st = kx["g"], kx["st"]
    _tile_load(g, kx["qa"], kx["k_cache"], kx["v_cache"], kx["ident"], kx["masks"], b, row0, reg, zero, dma)
    _tile_evict(g, b)
    _tile_scores(g, kx["qa"], kx["masks"], b, masked)
    _softmax_stats(g, st, b)
    _softmax_exp(g, st, b)


def _first_two(kx, a, b, reg):
    """Stage 1 of rank tiles 0 (buffers a) and 1 (b) and stage 2 of tile 0: :func:`_first` then :func:`_step`, in an
    order for a body that starts with both tiles to load: PE transposes both K tiles before tile 0's scores (it waits
    for their eviction anyway) and ScalarE evicts tile 1's K^T before tile 0's exp, so tile 1's scores do not wait
    behind tile 0's softmax on ScalarE (the same instructions on the same data as the two calls)."""
    g, st = kx["g"], kx["st"]
    c0, S = g.core * g.B, g.n_cores * g.B
    for t_row0_dma in ((a, c0, False), (b, c0 + S, True)):      # tile 0's DMAs: the prefetch (_tiles)
        t, row0, dma = t_row0_dma
        _tile_load(g, kx["qa"], kx["k_cache"], kx["v_cache"], kx["ident"], kx["masks"], t, row0, reg, False, dma)
    _tile_evict(g, a)
    _tile_evict(g, b, (ACT_ENG,))
    _tile_scores(g, kx["qa"], kx["masks"], a, False)
    _softmax_stats(g, st, a)
    _tile_evict(g, b, (DVE_ENG,))
    _softmax_exp(g, st, a)
    _tile_scores(g, kx["qa"], kx["masks"], b, False)
    _tile_pT(g, kx["ident"], a)
    _softmax_stats(g, st, b, nm=a["b"])
    _tile_pv(g, st, a)
    _softmax_exp(g, st, b, nm=a["b"])


def _step(kx, b, row0, reg, prev):
    """Stage 1 of tile j interleaved with stage 2 (P^T, PV, [O | l] update) of tile j-1 (buffer set prev), in
    the order that keeps every in-order engine queue busy: PE T(j) P^T(j-1) QK(j) PV(j-1); ACT evict(j)
    evictP^T(j-1) exp(j); DVE evict(j) stats(j) update(j-1)."""
    g, st = kx["g"], kx["st"]
    _tile_load(g, kx["qa"], kx["k_cache"], kx["v_cache"], kx["ident"], kx["masks"], b, row0, reg, False)
    _tile_evict(g, b)
    _tile_pT(g, kx["ident"], prev)
    _tile_scores(g, kx["qa"], kx["masks"], b, False)
    _softmax_stats(g, st, b, nm=prev["b"])
    _tile_pv(g, st, prev)
    _softmax_exp(g, st, b, nm=prev["b"])


def _last(kx, prev):
    """Stage 2 of the final tile."""
    _tile_pT(kx["g"], kx["ident"], prev)
    _tile_pv(kx["g"], kx["st"], prev)


def _head_tile(kx, bufs, zero):
    """This core's part of the head: rows [c*B, (c+1)*B), keys >= r - c*B masked (module docstring); ``zero``:
    the dead rows may lie beyond the valid prefix (p < S), zero their data."""
    A_, B_ = _with_psum(kx["g"], bufs)
    _first(kx, B_, kx["g"].core * kx["g"].B, None, True, zero)
    _last(kx, B_)


def _unrolled_tile(kx, bufs, j):
    """Full tile j of this core (max_context): rows r + j*S + c*B (r from the start register); each tile's PSUM
    lives in this function's scope."""
    g = kx["g"]
    sets = _with_psum(g, bufs)
    row0 = g.core * g.B + j * g.n_cores * g.B
    if j == 0:
        _first(kx, sets[0], row0, kx["rt"]["start_reg"], dma=False)
    else:
        _step(kx, sets[j % 2], row0, kx["rt"]["start_reg"], sets[(j - 1) % 2])


def _unrolled_first_two(kx, bufs):
    """Full tiles 0 and 1 of this core (max_context), as the runtime ``two`` body emits them."""
    sets = _with_psum(kx["g"], bufs)
    _first_two(kx, sets[0], sets[1], kx["rt"]["start_reg"])


def _unrolled_last(kx, bufs, j):
    """Stage 2 of the last full tile j (max_context)."""
    _last(kx, _with_psum(kx["g"], bufs)[j % 2])


def _tiles(g, st, bufs, qa, k_cache, v_cache, rt, ident, masks, max_context):
    """This core's KV tiles, software-pipelined two deep (tile j's load / K^T / scores overlap tile j-1's
    softmax / P^T / PV; tiles alternate between two buffer sets): the head tile (iff r > 0), a lone tile (n = 1)
    or the first two tiles in one body (n >= 2: a runtime loop boundary would fence tile 1's load behind tile 0's
    work), a runtime loop over pairs of steps, and a 0/1-trip epilogue for an odd or even tile count. Every trip count
    and every loop bound is a function of p alone, so both cores of a rank run the same runtime loops; the
    cores differ only in the static row offset c*B of their DMAs (module docstring, LNC split). With
    max_context the same sequence is emitted unrolled (shape-only costing)."""
    B, c = g.B, g.core
    S = g.n_cores * B
    c0 = c * B                                      # this core's static row offset inside every rank tile
    kx = {"g": g, "st": st, "qa": qa, "k_cache": k_cache, "v_cache": v_cache, "ident": ident, "masks": masks,
          "rt": rt}

    # tile 0's K / V DMAs (buffer set A; the head tile uses B) before the runtime loops, so that they are not
    # issued behind the head loop's exit fence; at rows pre + c*B, pre = r if n >= 1, else 0 (then unused, and
    # in bounds: L >= S)
    _tile_dma(g, k_cache, v_cache, bufs[0], c0, rt["pre_reg"])
    if max_context != None:     # the same stages unrolled; each tile's PSUM lives in its own function scope
        if max_context % S:
            _head_tile(kx, bufs, max_context < S)
        n = max_context // S
        if n >= 2:
            _unrolled_first_two(kx, bufs)
        for j in range(0 if n < 2 else 2, n):
            _unrolled_tile(kx, bufs, j)
        if n > 0:
            _unrolled_last(kx, bufs, n - 1)
        return

    def head_prefix_body(i):                       # r > 0, n == 0: the head rows >= p hold anything: zeroed
        _head_tile(kx, bufs, True)
    nl.fori_loop(0, rt["head_prefix_reg"], head_prefix_body)

    def head_body(i):                              # r > 0, n >= 1: every head row is < p (a valid cache row)
        _head_tile(kx, bufs, False)
    nl.fori_loop(0, rt["head_reg"], head_body)

    def one_body(i):                               # n == 1: rank tile 0 at r, alone
        A_, B_ = _with_psum(g, bufs)
        _first(kx, A_, c0, rt["start_reg"], dma=False)
        _last(kx, A_)
    nl.fori_loop(0, rt["one_reg"], one_body)

    def two_body(i):                               # n >= 2: rank tiles 0 (A) and 1 (B) in ONE body, so that tile
        A_, B_ = _with_psum(g, bufs)               # 1's load is issued with tile 0's, not behind a loop boundary
        _first_two(kx, A_, B_, rt["start_reg"])
    nl.fori_loop(0, rt["two_reg"], two_body)

    def pair_body(i):                              # i = r + 2m*S: rank tiles 2m+2 (A) and 2m+3 (B)
        A_, B_ = _with_psum(g, bufs)
        _step(kx, A_, c0 + 2 * S, i, B_)
        _step(kx, B_, c0 + 3 * S, i, A_)
    nl.fori_loop(rt["start_reg"], rt["pair_end_reg"], pair_body, step=2 * S)

    def odd_tail(i):                               # n odd, >= 3: load the last tile (A, at pair_end + 2S), finish both
        A_, B_ = _with_psum(g, bufs)
        _step(kx, A_, c0 + 2 * S, rt["pair_end_reg"], B_)
        _last(kx, A_)
    nl.fori_loop(0, rt["odd_reg"], odd_tail)

    def even_tail(i):                              # n even, >= 2: the last tile (B) is loaded, finish it
        A_, B_ = _with_psum(g, bufs)
        _last(kx, B_)
    nl.fori_loop(0, rt["even_reg"], even_tail)


def _tile_dma(g, k_cache, v_cache, b, row0, reg):
    """DMA B cache rows starting at row0 (+ the run-time register ``reg`` when given) into buffers b."""
    D, NC = g.D, g.NC
    pattern = [[NC * D, P], [D, NC], [1, D]]           # partition p <- rows NC*p .. NC*p + NC-1
    for dst_cache in ((b["k"], k_cache), (b["v"][:, :, 0:D], v_cache)):
        dst, cache = dst_cache
        if reg == None:
            src = cache.ap(pattern=pattern, offset=g.cache_off + row0 * D)
        else:
            src = cache.ap(pattern=pattern, offset=g.cache_off + row0 * D, scalar_offset=reg, indirect_dim=1)
        nisa.dma_copy(dst=dst, src=src)


def _tile_load(g, qa, k_cache, v_cache, ident, masks, b, row0, reg, zero, dma=True):
    """:func:`_tile_dma` (``dma=False``: its DMAs were issued earlier, :func:`_tiles`' tile-0 prefetch) into buffers
    b (``zero``: the head tile's dead rows zeroed) and transpose the K chunks on the PE: [P keys, dp] -> [dp, P keys]
    per (d-tile, chunk)."""
    D, dp, DT, NC = g.D, g.dp, g.DT, g.NC
    kt, vt = b["k"], b["v"]
    if dma:
        _tile_dma(g, k_cache, v_cache, b, row0, reg)
    if zero:     # rows >= r: possibly beyond the valid prefix -> zero their data (NaN-safe select; v's
        # ones column stays: the buffer set is reused by unmasked tiles)
        dead = masks["dead"].ap(pattern=[[NC, P], [1, NC], [0, D]], offset=0)
        nisa.tensor_copy_predicated(dst=kt, src=0.0, predicate=dead)
        nisa.tensor_copy_predicated(dst=vt[:, :, 0:D], src=0.0, predicate=dead)
    for dh in range(DT):
        for ci in range(NC):
            nisa.nc_matmul(dst=b["kT_ps"][dh][:, ci, :], stationary=kt[:, ci, dh * dp:(dh + 1) * dp],
                           moving=ident, accumulate=False)


def _tile_evict(g, b, engines=(ACT_ENG, DVE_ENG)):
    """K^T PSUM -> SBUF (activation dtype), d-tiles alternating between ScalarE and VectorE (the ``engines`` of
    :func:`_first_two`: only the d-tiles of those engines)."""
    for dh in range(g.DT):
        eng = ACT_ENG if dh % 2 == 0 else DVE_ENG
        if eng in engines:
            nisa.tensor_copy(dst=b["kT"][:, dh], src=b["kT_ps"][dh], engine=eng)


def _tile_scores(g, qa, masks, b, masked):
    """S = sum over d-tiles of q_dh^T k_dh (split-K accumulated in one PSUM bank); the raw scores [QA, B]
    are left in b["s"] (PSUM; SBUF with the head mask added)."""
    DT = g.DT
    for dh in range(DT):
        nisa.nc_matmul(dst=b["s_ps"], stationary=qa[:, dh, :], moving=b["kT"][:, dh], accumulate=dh > 0)
    b["s"] = b["s_ps"]
    if masked:
        b["s"] = b["s_m"]
        nisa.tensor_tensor(dst=b["s_m"], data1=b["s_ps"], data2=masks["score"], op=nl.add)


def _tile_pT(g, ident, b):
    """P^T chunks (keys on partitions) of one tile, after its softmax step."""
    QA, NC = g.QA, g.NC
    for ci in range(NC):
        nisa.nc_matmul(dst=b["pT_ps"][:, ci, :], stationary=b["p"][:, ci * P:(ci + 1) * P],
                       moving=ident[0:QA, 0:QA], accumulate=False)
    nisa.tensor_copy(dst=b["pT"], src=b["pT_ps"], engine=ACT_ENG)


def _tile_pv(g, st, b):
    """PV of one tile (its last column, V's ones, is the row sum of P) into the running [O | l]."""
    for ci in range(g.NC):
        nisa.nc_matmul(dst=b["pv"], stationary=b["pT"][:, ci, :], moving=b["v"][:, ci, :], accumulate=ci > 0)
    nisa.scalar_tensor_tensor(dst=st["ol"], data=st["ol"], op0=nl.multiply, operand0=b["alpha"], op1=nl.add,
                              operand1=b["pv"])


def _softmax_stats(g, st, b, s=None, nm=None):
    """Online-softmax statistics (VectorE) of raw scores s [QA, w] (default b["s"]; PSUM or SBUF fp32, the
    1/sqrt(D) scale not yet applied): b["b"] = -max(running max, scale * rowmax(s)). ``nm``: the running negated
    max (default st["nm"]; in a pipeline step the previous tile's b, which st["nm"] is a copy of: reading it
    directly spares the wait for GpSimd's copy)."""
    s = b["s"] if s == None else s
    nm = st["nm"] if nm == None else nm
    nisa.tensor_reduce(dst=b["nmx"], op=nl.maximum, data=s, axis=1, negate=True)
    nisa.scalar_tensor_tensor(dst=b["b"], data=b["nmx"], op0=nl.multiply, operand0=g.sc, op1=nl.minimum,
                              operand1=nm)


def _softmax_exp(g, st, b, s=None, p_t=None, nm=None):
    """ScalarE half of the step: alpha = exp(b - nm) (rescales the old [O | l] at this tile's update; ``nm`` as for
    :func:`_softmax_stats`), P = exp(scale*s + b) into p_t (default b["p"], activation dtype; its row sum comes out
    of the PV matmul); then nm <- b."""
    s = b["s"] if s == None else s
    p_t = b["p"] if p_t == None else p_t
    nm = st["nm"] if nm == None else nm
    nisa.activation(dst=b["alpha"], op=nl.exp, data=nm, scale=-1.0, bias=b["b"])
    nisa.activation(dst=p_t, op=nl.exp, data=s, scale=g.sc, bias=b["b"])
    nisa.tensor_copy(dst=st["nm"], src=b["b"], engine=POOL_ENG)


def _o_proj(g, og, wo, ident):
    """og [nq = (t, h), D] act -> og^T per (head, d-tile) -> y [T, H] fp32 = sum over blocks og^T . Wo."""
    act, T, H, Hc, dp, DT, nq = g.act, g.T, g.H, g.Hc, g.dp, g.DT, g.nq
    ps = nl.ndarray((dp, DT, nq), F32, buffer=nl.psum, name="att_ogT_psum")
    for dh in range(DT):
        nisa.nc_matmul(dst=ps[:, dh, :], stationary=og[:, dh * dp:(dh + 1) * dp], moving=ident[0:nq, 0:nq],
                       accumulate=False)
    ogT = nl.ndarray((dp, DT, Hc, T), act, buffer=nl.sbuf, name="att_ogT")   # columns regrouped per head
    nisa.tensor_copy(dst=ogT.permute((0, 1, 3, 2)), src=ps.reshape((dp, DT, T, Hc)), engine=DVE_ENG)
    y_ps = nl.ndarray((T, H), F32, buffer=nl.psum, name="att_y_psum")
    nblk = Hc * DT
    for n0 in range(0, H, MOVING_MAX):
        n1 = min(H, n0 + MOVING_MAX)
        for b in range(nblk):
            h, dh = divmod(b, DT)
            nisa.nc_matmul(dst=y_ps[:, n0:n1], stationary=ogT[:, dh, h, :], moving=wo[:, b, n0:n1],
                           accumulate=b > 0)
    y = nl.ndarray((T, H), F32, buffer=nl.sbuf, name="att_y")
    half = (H // 2 // MOVING_MAX) * MOVING_MAX or H
    nisa.tensor_copy(dst=y[:, 0:half], src=y_ps[:, 0:half], engine=ACT_ENG)
    if half < H:
        nisa.tensor_copy(dst=y[:, half:H], src=y_ps[:, half:H], engine=DVE_ENG)
    return y


def _o_proj_stacked(g, og, wo, ident, S):
    """:func:`_o_proj` into the bank-stacked layout: og^T goes straight from PSUM into the bank diagonals of
    zero-padded stationaries ``Z [dp, DT, Hc, S, S*T]`` (Z[:, dh, h, s, s*T + t] = og^T of head h, d-tile dh,
    token t; ``nki_kernels.stacked``), then every block accumulates into ONE PSUM bank ``[S*T, H/S]`` (bank s
    from the wo columns of block ``bank_block(s)``) and one copy evicts it: y SBUF ``[S*T, H/S]`` float32."""
    act, T, H, Hc, dp, DT, nq = g.act, g.T, g.H, g.Hc, g.dp, g.DT, g.nq
    W = H // S
    check_stack(S, T, H, "attention")
    if W > MOVING_MAX:
        raise ValueError(f"attention: bank width {W} exceeds one PSUM bank ({MOVING_MAX} fp32); stack more banks")
    z = nl.ndarray((dp, DT, Hc, S, S * T), act, buffer=nl.sbuf, name="att_ogT_banks")
    nisa.memset(dst=z, value=0.0, engine=POOL_ENG)
    ps = nl.ndarray((dp, DT, nq), F32, buffer=nl.psum, name="att_ogT_psum")
    for dh in range(DT):
        nisa.nc_matmul(dst=ps[:, dh, :], stationary=og[:, dh * dp:(dh + 1) * dp], moving=ident[0:nq, 0:nq],
                       accumulate=False)
    # per d-tile dh (at most 3 free dims per operand: SDK nki-aps.rst "most instructions only support 1D/2D/3D in
    # the free dimension"): h iterates in z, ps column t*Hc + h, broadcast over the banks
    for dh in range(DT):
        nisa.tensor_copy(dst=z.ap(pattern=[[DT * Hc * S * S * T, dp], [S * S * T, Hc], [(S + 1) * T, S], [1, T]],
                                  offset=dh * Hc * S * S * T),
                         src=ps.ap(pattern=[[DT * nq, dp], [1, Hc], [0, S], [Hc, T]], offset=dh * nq),
                         engine=DVE_ENG)
    y_ps = nl.ndarray((S * T, W), F32, buffer=nl.psum, name="att_y_psum_banks")
    nblk = Hc * DT
    for s in range(S):
        n0 = bank_block(s, S) * W
        for b in range(nblk):
            h, dh = divmod(b, DT)
            nisa.nc_matmul(dst=y_ps, stationary=z[:, dh, h, s, :], moving=wo[:, b, n0:n0 + W],
                           accumulate=s > 0 or b > 0)
    y = nl.ndarray((S * T, W), F32, buffer=nl.sbuf, name="att_y")
    h = W // 2                  # evicted in two column halves at once (ScalarE, VectorE): the all-reduce waits for it
    nisa.tensor_copy(dst=y[:, 0:h], src=y_ps[:, 0:h], engine=ACT_ENG)
    nisa.tensor_copy(dst=y[:, h:W], src=y_ps[:, h:W], engine=DVE_ENG)
    return y


# ---- wrapper -------------------------------------------------------------------------------------
@nki.jit
def attention_kernel(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=1e-6,
                     kv_tile=KV_TILE, max_context=None, ring_slots=0):
    """Wrapper: HBM in, HBM out. xT ``[P, KT, T]``; weights from :func:`attention_layout`; cos/sin
    ``[T, R]`` float32; caches ``[1, L, D]``; pos ``[1, 1]`` int32.

    Launch ``attention_kernel(...)`` (LNC=1: one core does all heads, K and V) or ``attention_kernel[2](...)``
    (LNC=2). Returns ``(partials [n_cores, T, H] float32, k_cache, v_cache)``: core c's o_proj partial in
    row c (the rank's output is their sum) and the caches, mutated in place at rows p..p+T-1. ``ring_slots`` > 0:
    the projection ring comes from :func:`attention_ring` with that many slots, issued before the input DMA (the
    megakernel's early issue), else the body fills its own.
    """
    n_cores, core = program_sharding()
    ring = None
    if ring_slots > 0:
        ring = attention_ring(wqg, wk, wv, core, n_cores, slots=ring_slots)
    Pp, KT, T = xT.shape
    out = nl.ndarray((n_cores, T, KT * P), F32, buffer=nl.shared_hbm, name="attention_partials")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf, name="att_xT_in")
    nisa.dma_copy(dst=xs, src=xT)
    y = attention_body(xs, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=core,
                       n_cores=n_cores, kv_tile=kv_tile, max_context=max_context, ring=ring)
    nisa.dma_copy(dst=out[core], src=y)
    return out, k_cache, v_cache


# ---- host-side helpers (plain numpy / torch, run once per checkpoint or per launch) ----------------
def attention_layout(shard) -> dict:
    """A rank's attention weights in PyTorch layout (``model.tp.attention.shard_attention``: q_proj
    ``[Hq_r*2*D, H]`` interleaved [q_h; g_h] per head, k_proj/v_proj ``[D, H]``, o_proj ``[H, Hq_r*D]``,
    q_norm/k_norm ``[D]``) -> the kernel's HBM tensors ``{wqg, wk, wv, wo, norm_w}`` (torch; module
    docstring). Torch ops only, so it also runs on ``meta`` tensors."""
    if shard.get("num_kv_heads", 1) != 1:
        raise ValueError(f"attention_layout: the kernel takes one KV head per rank, the shard has "
                         f"{shard['num_kv_heads']}")
    q = as_torch(shard["q_proj"])
    hq = shard["num_heads"]
    D = q.shape[0] // (2 * hq)
    H = q.shape[1]
    wqg = q.reshape(hq, 2, D, H).permute(3, 1, 0, 2).contiguous()        # [H, 2, Hq_r, D]
    wk = as_torch(shard["k_proj"]).t().contiguous()
    wv = as_torch(shard["v_proj"]).t().contiguous()
    wo = as_torch(shard["o_proj"]).t().contiguous()
    norm = torch.stack([1.0 + as_torch(shard["q_norm"]).float(), 1.0 + as_torch(shard["k_norm"]).float()])
    return {"wqg": wqg, "wk": wk, "wv": wv, "wo": wo, "norm_w": norm.contiguous()}


def tile_loop_trips(p: int, n_cores: int = 2, kv_tile: int = KV_TILE) -> tuple[int, int, int, int, int, int, int]:
    """Trip counts of the body's seven runtime loops at position p, in program order (head tiles with zeroed rows
    (n = 0), head tiles (n >= 1), lone tile, first two tiles, pairs, odd tail, even tail; module docstring "KV
    tiling"), the same on every core: the host-side statement of what :func:`_runtime_scalars` computes on chip."""
    S = n_cores * kv_tile
    r, n = p % S, p // S
    odd = int(n >= 3 and n % 2 == 1)
    return (int(r > 0 and n == 0), int(r > 0 and n >= 1), int(n == 1), int(n >= 2), max(n - 2, 0) // 2, odd,
            int(n >= 2 and n % 2 == 0))


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
    return (feature_major(x), layout["wqg"], layout["wk"], layout["wv"], layout["wo"], layout["norm_w"], cos, sin,
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
