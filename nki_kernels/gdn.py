"""Gated DeltaNet mixer for T = 1..4 decode/verify tokens, one TP rank split over its LNC cores.

Math (``shared/docs/qwen36.md`` §4.3, ``model.reference.ReferenceModel.gdn_mixer``; PyTorch twin
``model.tp.gdn.gdn_rank``): projections u = W_qkv x, z, b, a; depthwise causal conv (K taps) + SiLU over
``[window ‖ u]``; l2norm(q), l2norm(k) (eps 1e-6 inside the sqrt), q *= Dk^-0.5; beta = sigmoid(b),
g = -exp(A_log) * softplus(a + dt_bias); per token and value head h (key head h // g_va):
``S <- exp(g) S; m = S^T k; delta = beta (v - m); S <- S + k delta^T; o = S^T q``;
gated RMSNorm ``w * o * rsqrt(mean(o^2) + eps) * silu(z)``; out_proj -> this core's partial ``y``.
Casts follow the reference: u, z, b, a, the conv output and o are rounded to the activation dtype;
l2norm, gates, recurrence and norm run in fp32; the state is fp32.

Sharding (nki_kernels/README.md): the rank holds Hk_r key heads and Hv_r value heads (4 and 8 for
Qwen3.6 at TP=4). Core c of n = LNC owns value heads ``[c*Hv_c, (c+1)*Hv_c)``, Hv_c = Hv_r / n, and the
key heads they use (GVA: value head h uses key head h // g_va). It computes its heads' projections,
conv, recurrence and norm and the out_proj partial over its heads' columns. When a key head is
shared by both cores (tiny configs: 1 key head per rank), both compute it, the core owning the key
head's first value head writes its window columns, and a ``core_barrier`` separates every read of
the window/state from every checkpoint write.

Host layouts (:func:`gdn_weight_layout`, converted once per checkpoint; D = Dk = Dv, J = H / 128)
---------------------------------------------------------------------------------------------
* ``w_in``   ``[n, 128, J, N]`` activation dtype: core c's input projections, contraction-major and
  partition-contiguous: ``w_in[c, p, j, col] = W_c[col, j*128 + p]`` with the core's columns
  ``N = q (Hk_c*D) ‖ k (Hk_c*D) ‖ v (Hv_c*D) ‖ z (Hv_c*D) ‖ b (Hv_c) ‖ a (Hv_c)``.
* ``conv_w`` ``[n, D, 2*Hk_c + Hv_c, K]`` activation dtype: the core's conv taps, channel-major per head.
* ``A_log``, ``dt_bias`` ``[Hv_r]`` float32 (the rank's, unchanged); ``norm_w`` ``[D, 1]`` float32.
* ``w_out``  ``[n, D, Hv_c, H]`` activation dtype: ``w_out[c, d, i, :] = out_proj[:, (c*Hv_c + i)*D + d]``.
* decode state (README "Decode state in HBM"): ``window [slots, K-1, C_rank]`` (activation dtype, the
  rank's channels q_r ‖ k_r ‖ v_r), ``state [slots, Hv_r, D, D]`` float32, ``read_slot [1, 1]`` int32.

SBUF layouts and algorithm (per core)
-------------------------------------
1. ``read_slot`` is loaded into a register and used as the ``scalar_offset`` of the dynamic DMAs that
   read the starting window (token-major rows into ``full_tok[0:K-1]``) and state (``S [D, Hv_c, D]``,
   dk on partitions). No Python branch looks at it. Every checkpoint write is made to depend on these
   reads (data flow plus explicit ``depends_on``), so reading slot n-1 and writing slots 0..T-1 in one
   launch is safe.
2. Projections: weights are the moving operand (``nc_matmul(stationary=xT[:, j, :] [128, T],
   moving=w[:, j, cols] [128, <=512])``), accumulated over the J hidden tiles in one PSUM bank per
   512-column chunk (``accumulate=(j > 0)``). Weights stream in groups of hidden tiles, each DMA
   partition-contiguous; every weight byte is read once, independent of T. Evicted (rounded) to
   ``proj [T, N]`` token-major. With the weights resident (prefetched), the chunks are issued in the order of their
   consumers: the gate chunk (b, a), the conv chunks (q, k, v; under the gates' chain), and z's chunk last, in
   four pieces in the PE's idle time of the conv / l2norm / recurrence chain (``Z_PIECES``); z is read only by step 7.
3. Gates: the rows ``(b_t, a_t)`` of the T tokens and one row ``(A_log, dt_bias)`` (loaded once, DMA'd
   into partition T) are broadcast to all D partitions by T+1 matmuls against one-hot stationaries;
   then in fp32 on ``[D, T, Hv_c]``: softplus (ACT), exp (ACT) for exp(A_log), alpha = exp(g) and
   exp(-b); beta = 1 / (1 + exp(-b)) on DVE (sigmoid without a sigmoid table); ``alpha*beta``.
4. Channel-major conv input ``full [D, heads, K-1+T]`` in PSUM: PE transposes (matmul with an identity)
   of the window rows and of u, per head. Conv = one DVE multiply of a windowed access pattern
   ``[D, heads, T, K]`` (overlapping, stride 1 in t and k) by the broadcast taps + one add-reduce over
   K. SiLU of the conv output is ``x / (1 + exp(-x))`` (one ACT exp in the gates' table, DVE add/reciprocal/
   multiply) -- no separate silu table load. z is transposed the same way and gets the same SiLU operations, but
   after recurrence round 0 (its exp on ACT, which runs only table-free work in the recurrence).
5. l2norm in the channel-major layout: square (DVE), cross-partition sum AND broadcast by one matmul
   with a ones[D, D] stationary, rsqrt(+eps) (ACT), multiply (DVE). q, k are stored interleaved
   ``QK [D, Hk_c, 2T]`` (column 2t = k_t, 2t+1 = q_t) so ``[q_{t-1} | k_t]`` is one [D, 2] moving tile.
6. Recurrence, T+1 read rounds: round t issues per value head one matmul with the state as stationary
   and ``[q_{t-1} | k_t]`` as moving: column 0 is ``o_{t-1} = S_{t-1}^T q_{t-1}`` (the output after the
   update, read exactly), column 1 is ``S_{t-1}^T k_t``; then (fp32)
   ``delta = beta v - (alpha beta) (S^T k)`` (2 DVE ops on [D, Hv_c]); delta is broadcast along the dk
   partitions by a matmul (stationary = delta column with a stride-0 free pattern, moving = identity);
   ACT decays ``S_t = alpha S_{t-1}`` (``tensor_scalar`` by the per-head alpha column: no activation table) off
   the delta chain; the outputs o are copied out of PSUM by table-free copies; one DVE
   ``scalar_tensor_tensor`` per key head adds ``k (x) delta`` (k as the per-partition scalar):
   ``S_t = delta_bcast * k + S_t``. S_t is DMA'd to checkpoint slot t. All state arithmetic is on
   ACT/DVE in fp32; the PE only reads the state.
7. Gated RMSNorm in channel-major ``[D, Hv_c, T]`` (DVE square, same ones-matmul partition sum, ACT rsqrt, DVE),
   result rounded to the activation dtype = the stationary of out_proj (contraction over the core's
   value dims on partitions, ``accumulate=(i > 0)`` over its Hv_c head tiles) -> ``y [T, H]`` fp32.
8. Windows: u rows are DMA'd behind the old window rows (``full_tok [K-1+T, C_core]`` token-major), so
   the window after token j is the partition range ``full_tok[j+1 : j+K]``: one DMA per slot and column
   group (q‖k, v).

Trace at the real per-rank shapes (nkisim, LNC=2, bf16, per core; T = 1 / 2 / 4): PE 132 / 141 / 159,
DVE 32 / 36 / 44, ACT 21 / 26 / 36, DMA 18 / 21 / 27, POOL 7 (identity constants, table warm-ups), SP 1 (register load);
HBM reads 8.70 MB (8.43 MB of weights, one 256 KiB state slot, one window slot, x), writes T x (256 KiB
state + 6 KiB window) + y; peak SBUF 74 KB per partition (of 208 KB), PSUM 12 KB (6 of 8 banks).

ACT table groups used, in program order: {copy} (the gate chunk's eviction, the table the preceding RMSNorm left
loaded), softplus, exp (exp(A_log), alpha, sigmoid(b), the conv's SiLU), {copy, square, rsqrt} (l2norm's rsqrt),
exp (z's SiLU), {copy, square, rsqrt} (gated norm's rsqrt): five table switches inside the mixer. The softplus,
both {copy, square, rsqrt} and the second exp loads are warmed (``_warm_act``) while ScalarE waits for PE / VectorE
or has only table-free work (``tensor_copy``, ``tensor_scalar``); the first exp load stays on the gate chain (warming
it as well, with exp(A_log) and exp(-b) before the softplus, was predicted slower: ScalarE is not idle long enough
there).
"""

from __future__ import annotations

import math

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import MOVING_MAX, P, layer_offset, layer_of, own_identity, program_sharding
from nki_kernels.stacked import bank_block, broadcast_banks, check_stack, diagonal

MAX_T = 4
Z_PIECES = (4, 8, 3, 16)  # z's deferred matmuls, counts in 16ths: 4 before the v heads' transposes (the PE waits for
                        # their eviction), 8 after round 0's reads, 3 after round 0's delta broadcast, the rest after
                        # round 1's reads: the PE's idle time there (sized by the 4-layer A/B round at the real shapes,
                        # T = 2; bench/decode_speed.md lever 52)
CONV_SPLIT = (5, 13, 16)  # the q/k heads' transposes after 5/16 of the v conv chunk's matmuls, the l2norm's sum after
                          # 13/16: the q/k conv, SiLU and l2norm run under the rest
L2_EPS = 1e-6           # l2norm of q and k: x * rsqrt(sum(x^2) + 1e-6) (FLA convention)
WEIGHT_PREFETCH_BYTES = 96 * 1024   # per partition: issue every in_proj weight DMA up front below this
WEIGHT_GROUP_BYTES = 16 * 1024      # per partition and DMA: in_proj weights stream in groups of hidden tiles


# ---------------------------------------------------------------------------------------------
# core split (compile time)
# ---------------------------------------------------------------------------------------------

def core_split(hk_r, hv_r, n_cores, core):
    """Which heads core ``core`` of ``n_cores`` owns (compile time; also used by the host layout). Returns
    a dict: hv_c (value heads per core), vh0 (first value head, rank-local), kh0 / hk_c (key heads it
    uses), g (value heads per key head), key_of (local key head of each local value head), runs
    ([key head, first, end) of consecutive local value heads sharing a key head), own ((o0, o1): local key
    heads whose window columns this core writes), shared (a key head is used by both cores).

    Written in the Python subset the NKI front end traces (loops, lists, explicit checks that raise; no comprehensions).
    """
    if hv_r % hk_r:
        raise ValueError(f"gdn: {hv_r} value heads are not a multiple of {hk_r} key heads")
    if hv_r % n_cores:
        raise ValueError(f"gdn: {hv_r} value heads do not split over {n_cores} cores")
    g = hv_r // hk_r
    hv_c = hv_r // n_cores
    for c in range(n_cores):
        v0 = c * hv_c
        count = (v0 + hv_c - 1) // g - v0 // g + 1
        if c == core:
            vh0, kh0, hk_c = v0, v0 // g, count
    for c in range(n_cores):
        v0 = c * hv_c
        if (v0 + hv_c - 1) // g - v0 // g + 1 != hk_c:
            raise ValueError(f"gdn: {hv_r} value heads over {hk_r} key heads cannot be split evenly over "
                             f"{n_cores} cores")
    key_of = []
    runs = []
    for i in range(hv_c):
        kk = (vh0 + i) // g - kh0
        key_of.append(kk)
        if len(runs) > 0 and runs[len(runs) - 1][0] == kk:
            runs[len(runs) - 1][2] = i + 1
        else:
            runs.append([kk, i, i + 1])
    o0 = -1
    o1 = -1
    for i in range(hk_c):
        if ((kh0 + i) * g) // hv_c == core:
            if o0 < 0:
                o0 = i
            o1 = i + 1
    if o0 < 0:
        o0 = 0
        o1 = 0
    return {"hv_c": hv_c, "vh0": vh0, "kh0": kh0, "hk_c": hk_c, "g": g, "key_of": key_of, "runs": runs,
            "own": (o0, o1), "shared": hk_c * n_cores > hk_r}


# ---------------------------------------------------------------------------------------------
# host-side layout helpers (plain torch, run once per checkpoint)
# ---------------------------------------------------------------------------------------------

def gdn_weight_layout(w, lnc=2):
    """A rank's GDN weights in PyTorch layout (``model.tp.gdn.shard_gdn``: in_proj_qkv [C_r, H],
    in_proj_z [Vd_r, H], in_proj_b / in_proj_a [Hv_r, H], conv1d [C_r, K] (or [C_r, 1, K]), A_log /
    dt_bias [Hv_r], norm [Dv], out_proj [H, Vd_r]) -> the kernel's HBM layout for ``lnc`` cores.

    Returns ``{"w_in", "conv_w", "A_log", "dt_bias", "norm_w", "w_out"}`` (torch tensors; see the
    module docstring for shapes). Weights keep their dtype; A_log/dt_bias/norm_w become float32.
    """
    import torch
    qkv, wz, wb, wa = w["in_proj_qkv"], w["in_proj_z"], w["in_proj_b"], w["in_proj_a"]
    conv = w["conv1d"].reshape(w["conv1d"].shape[0], -1)
    out_proj = w["out_proj"]
    H = qkv.shape[1]
    hv_r = w["A_log"].shape[0]
    D = w["norm"].shape[0]
    vd_r = wz.shape[0]
    if vd_r != hv_r * D:
        raise ValueError(f"gdn_weight_layout: in_proj_z has {vd_r} rows, expected Hv_r*Dv = {hv_r * D}")
    kd_r = (qkv.shape[0] - vd_r) // 2
    if kd_r % D:
        raise ValueError(f"gdn_weight_layout: key dim {kd_r} is not a multiple of the value head dim {D}; "
                         f"the kernel needs Dk == Dv")
    hk_r = kd_r // D
    if H % P:
        raise ValueError(f"gdn_weight_layout: hidden size {H} is not a multiple of {P}")
    if D > P:
        raise ValueError(f"gdn_weight_layout: head dim {D} exceeds {P} partitions")
    J = H // P
    w_in, conv_w, w_out = [], [], []
    for c in range(lnc):
        s = core_split(hk_r, hv_r, lnc, c)
        kq = slice(s["kh0"] * D, (s["kh0"] + s["hk_c"]) * D)
        kk = slice(kd_r + kq.start, kd_r + kq.stop)
        vv = slice(2 * kd_r + s["vh0"] * D, 2 * kd_r + (s["vh0"] + s["hv_c"]) * D)
        zz = slice(s["vh0"] * D, (s["vh0"] + s["hv_c"]) * D)
        hh = slice(s["vh0"], s["vh0"] + s["hv_c"])
        rows = torch.cat([qkv[kq], qkv[kk], qkv[vv], wz[zz], wb[hh], wa[hh]])      # [N, H]
        w_in.append(rows.t().reshape(J, P, -1).permute(1, 0, 2))                 # [P, J, N]
        taps = torch.cat([conv[kq], conv[kk], conv[vv]])                          # [NH*D, K]
        conv_w.append(taps.reshape(-1, D, taps.shape[1]).permute(1, 0, 2))       # [D, NH, K]
        w_out.append(out_proj[:, zz].t().reshape(s["hv_c"], D, H).permute(1, 0, 2))   # [D, Hv_c, H]
    return {
        "w_in": torch.stack(w_in).contiguous(),
        "conv_w": torch.stack(conv_w).contiguous(),
        "A_log": w["A_log"].float().contiguous(),
        "dt_bias": w["dt_bias"].float().contiguous(),
        "norm_w": w["norm"].float().reshape(D, 1).contiguous(),
        "w_out": torch.stack(w_out).contiguous(),
    }


# ---------------------------------------------------------------------------------------------
# body
# ---------------------------------------------------------------------------------------------

def _bcast_col(t, col, rows, width):
    """[rows, width] view of column ``col`` of a 2-D on-chip tensor ``t``, repeated along the free axis."""
    return t.ap(pattern=[[t.shape[1], rows], [0, width]], offset=col)


def _warm_act(op, one):
    """Load ScalarE's activation table of ``op`` now, with a one-element activation of ``one`` (a [1, 1] view of a
    constant tile set at the layer's top). It depends on nothing the layer computes, so the table load (trn2-costs:
    ACT_TABLE_LOAD 1,283 ns on any group switch) runs while ScalarE would wait for VectorE / PE, instead of on the
    chain of the activation that needs it (as ``rmsnorm_body``'s step 0); with no memset of its own, a warm soon after
    another one does not wait for that one's read of a reused address."""
    warm = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf, name="gdn_act_warm")
    nisa.activation(dst=warm, op=op, data=one)


class GdnWeights(nl.NKIObject):
    """A core's GDN weights in SBUF: ``w_in_tiles`` (in_proj groups of ``jg`` hidden tiles, each ``[P, jg, N]``;
    empty when they do not fit ``WEIGHT_PREFETCH_BYTES`` per partition and :func:`gdn_body` streams them), ``wo``
    ``[D, Hv_c, H]`` (out_proj), the small per-layer parameters ``wc`` ``[D, NH, K]`` (conv taps), ``wn`` ``[D, 1]``
    float32 (gated-norm weight), ``ab`` ``[1, 2, Hv_c]`` float32 (A_log ‖ dt_bias of the core's value heads), and the
    gates' one-hot source ``ident_g``, a ``[MAX_T + 1, MAX_T + 1]`` float32 identity (a constant: loaded when the
    tiles are allocated). ``big``: the whole tiles holding the projections (the in_proj tile ``[P, J, N]`` whose
    views ``w_in_tiles`` are, and ``wo``), for a caller that lends an arena's bytes out between GDN layers."""

    def __init__(self, w_in_tiles, jg, wo, wc, wn, ab, ident_g, big):
        self.big = big
        self.w_in_tiles = w_in_tiles
        self.jg = jg
        self.wo = wo
        self.wc = wc
        self.wn = wn
        self.ab = ab
        self.ident_g = ident_g


def gdn_weight_tiles(w_in, conv_w, w_out):
    """Allocate the SBUF tiles of :class:`GdnWeights` for one layer of ``w_in`` / ``conv_w`` / ``w_out`` (HBM, host
    layout, stacked or not: only the trailing shapes matter); no weight DMA (only the constant identity's). A caller
    that keeps them for the whole launch has an arena: every layer's weights land at the same addresses, so a layer's
    weight DMA waits only for the previous GDN layer's reads of them, not for whatever transient tile last held those
    addresses (first-fit reuse)."""
    J, N = w_in.shape[-2], w_in.shape[-1]
    D, hv_c, H = w_out.shape[-3], w_out.shape[-2], w_out.shape[-1]
    NH, K = conv_w.shape[-2], conv_w.shape[-1]
    adt = w_in.dtype
    isz = 2 if adt == nl.bfloat16 else 4
    n_groups = (J * N * isz + WEIGHT_GROUP_BYTES - 1) // WEIGHT_GROUP_BYTES
    jg = (J + n_groups - 1) // n_groups         # hidden tiles per weight DMA
    n_groups = (J + jg - 1) // jg
    tiles = []
    big = []
    if J * N * isz <= WEIGHT_PREFETCH_BYTES:
        # ONE tile, the groups its views: the arena's in_proj bytes are contiguous, so a caller may lend them out
        # whole between GDN layers (the verify's LM head ring after the last one, ``megakernel.round``)
        w_in = nl.ndarray((P, J, N), adt, buffer=nl.sbuf, name="w_in")
        big.append(w_in)
        for gi in range(n_groups):
            j0 = gi * jg
            tiles.append(w_in[:, j0:min(J, j0 + jg), :])
    wo = nl.ndarray((D, hv_c, H), adt, buffer=nl.sbuf, name="w_out")
    wc = nl.ndarray((D, NH, K), conv_w.dtype, buffer=nl.sbuf, name="conv_taps")
    wn = nl.ndarray((D, 1), nl.float32, buffer=nl.sbuf, name="norm_w")
    ab = nl.ndarray((1, 2, hv_c), nl.float32, buffer=nl.sbuf, name="A_log_dt_bias")
    ident_g = own_identity(MAX_T + 1, nl.float32, "gate_ident")    # the gates' one-hot stationaries: .ap() on it
    big.append(wo)
    return GdnWeights(tuple(tiles), jg, wo, wc, wn, ab, ident_g, tuple(big))


def gdn_weights(w_in, conv_w, A_log, dt_bias, norm_w, w_out, layer=None, arena=None, out_proj=True):
    """Issue the DMAs of this core's weights of layer ``layer`` (HBM, host layout; None: unstacked tensors) into
    ``arena`` (:func:`gdn_weight_tiles`) or fresh tiles -> :class:`GdnWeights`, to pass to :func:`gdn_body` (a
    caller may issue them early: prefetch). They are triggered from ScalarE's DMA queue: the DMAs of one queue move
    in order (SDK nki-dma-overview.rst "DMA Queues"), so this 8 MiB stream must not sit in the queue of the small
    DMAs the next steps wait for (norm weights, router, the routed experts), which the compiler's default queue
    carries (bench/decode_speed.md lever 23); the layer's small parameters go first in it (the projections need
    the big ones only group by group; bench/decode_speed.md lever 29). ``out_proj=False``: all but the out_proj
    weight, which the caller issues later with :func:`gdn_out_proj` (it is read only at the mixer's end)."""
    w_in, w_out, conv_w = layer_of(w_in, layer), layer_of(w_out, layer), layer_of(conv_w, layer)
    A_log, dt_bias, norm_w = layer_of(A_log, layer), layer_of(dt_bias, layer), layer_of(norm_w, layer)
    small = (("A_log", A_log), ("dt_bias", dt_bias), ("norm_w", norm_w))
    for i in range(len(small)):
        nm, t = small[i]
        if t.dtype != nl.float32:      # hardware-DGE DMAs move raw bytes: no cast (SDK-MIG 0.3.0)
            raise TypeError(f"gdn: {nm} must be float32 (loaded by a hardware-DGE DMA), got {t.dtype}")
    _, core = program_sharding()
    wts = arena if arena != None else gdn_weight_tiles(w_in, conv_w, w_out)
    hv_c = wts.ab.shape[2]
    v0 = core * hv_c                # the core's first value head (core_split)
    act = nisa.engine.scalar
    hw = nisa.dge_mode.hwdge
    nisa.dma_copy(dst=wts.wc, src=conv_w[core], dge_mode=hw, engine=act)
    nisa.dma_copy(dst=wts.wn, src=norm_w, dge_mode=hw, engine=act)
    nisa.dma_copy(dst=wts.ab[:, 0, :], src=A_log[v0:v0 + hv_c], dge_mode=hw, engine=act)
    nisa.dma_copy(dst=wts.ab[:, 1, :], src=dt_bias[v0:v0 + hv_c], dge_mode=hw, engine=act)
    for gi in range(len(wts.w_in_tiles)):
        j0 = gi * wts.jg
        wt = wts.w_in_tiles[gi]
        nisa.dma_copy(dst=wt, src=w_in[core, :, j0:j0 + wt.shape[1], :], dge_mode=nisa.dge_mode.hwdge,
                      engine=nisa.engine.scalar)
    if out_proj:
        gdn_out_proj(w_out, None, wts)
    return wts


def gdn_out_proj(w_out, layer, wts):
    """Issue the DMA of this core's out_proj weight of layer ``layer`` (HBM; None: an unstacked tensor) into ``wts``
    (:class:`GdnWeights`), from ScalarE's DMA queue like :func:`gdn_weights`. A prefetching caller issues it at the
    layer's own top: in the previous layer it was the tail of the 8 MiB prefetch, still in flight when that layer's
    routed-expert stream began, and moved beside it at half the rate (bench/decode_speed.md lever 46)."""
    _, core = program_sharding()
    nisa.dma_copy(dst=wts.wo, src=layer_of(w_out, layer)[core], dge_mode=nisa.dge_mode.hwdge,
                  engine=nisa.engine.scalar)


def _project_chunk(accs, xT, tiles, jg, k, N):
    """in_proj output chunk k (columns k*512 ..) into its PSUM accumulator ``accs[k]``: one matmul per input tile j
    (the group tiles ``tiles`` of jg input tiles each), accumulated in j order."""
    c0 = k * MOVING_MAX
    c1 = min(N, c0 + MOVING_MAX)
    J = xT.shape[1]
    for j in range(J):
        nisa.nc_matmul(dst=accs[k], stationary=xT[:, j, :], moving=tiles[j // jg][:, j % jg, c0:c1],
                       accumulate=j > 0)


def _project_steps(accs, xT, tiles, jg, chunks, q0, n, N):
    """Issue in_proj matmuls q0 .. q0 + n - 1 (clipped to the last) of the chunks ``chunks``, in order: matmul q
    is input tile ``q % J`` of chunk ``chunks[q // J]``, accumulated in j order into its PSUM accumulator
    ``accs[k]`` (the accumulation of :func:`_project_chunk`, issued in pieces). Returns the next q."""
    J = xT.shape[1]
    q1 = min(q0 + n, len(chunks) * J)
    for q in range(q0, q1):
        k = chunks[q // J]
        j = q % J
        c0 = k * MOVING_MAX
        c1 = min(N, c0 + MOVING_MAX)
        nisa.nc_matmul(dst=accs[k], stationary=xT[:, j, :], moving=tiles[j // jg][:, j % jg, c0:c1],
                       accumulate=j > 0)
    return max(q0, q1)


def _exp_neg_z(proj, accs, evict_ks, identA, cz, D, hv_c):
    """z's SiLU, first part: the chunks ``evict_ks`` (z's, when they were deferred) evicted (rounded) into ``proj``
    by table-free ScalarE copies; PE transposes of z to the channel-major ``zT [D, Hv_c, T]`` (PSUM, exact); and
    ``e = exp(-zT)`` on ScalarE, whose exp table is loaded first (``_warm_act``: while ScalarE waits for the
    transposes). Returns ``(zT, e)``; :func:`_silu_z` finishes it."""
    T, N = proj.shape
    for k in evict_ks:
        c0 = k * MOVING_MAX
        c1 = min(N, c0 + MOVING_MAX)
        nisa.tensor_copy(dst=proj[:, c0:c1], src=accs[k], engine=nisa.engine.scalar)
    zT = nl.ndarray((D, hv_c, T), nl.float32, buffer=nl.psum, name="z_ps")
    for i in range(hv_c):
        nisa.nc_matmul(dst=zT[:, i, :], stationary=proj[:, cz + i * D:cz + (i + 1) * D], moving=identA[0:T, 0:T],
                       accumulate=False)
    e = nl.ndarray((D, hv_c, T), nl.float32, buffer=nl.sbuf, name="exp_neg_z")
    nisa.activation(dst=e, op=nl.exp, data=zT, scale=-1.0)
    return (zT, e)


def _decay(S_prev, gb, t):
    """Round t's decays ``alpha_t S_{t-1}`` -> a new state tile ``[D, Hv_c, D]`` float32: one ScalarE ``tensor_scalar``
    per value head by its alpha column ``gb[:, t, 0, i]`` (``[D, T, 3, Hv_c]``); no activation table."""
    D, hv_c, _ = S_prev.shape
    S_new = nl.ndarray((D, hv_c, D), nl.float32, buffer=nl.sbuf, name=f"state_{t}")
    for i in range(hv_c):
        nisa.tensor_scalar(dst=S_new[:, i, :], data=S_prev[:, i, :], op0=nl.multiply, operand0=gb[:, t, 0, i:i + 1],
                           engine=nisa.engine.scalar)
    return S_new


def _silu_z(ze):
    """z's SiLU, second part (VectorE): ``silu(z) = z * 1/(1 + exp(-z))`` from :func:`_exp_neg_z`'s ``(zT, e)``
    -> ``[D, Hv_c, T]`` float32 (SBUF); the same operations per element as the conv's SiLU."""
    zT = ze[0]
    e = ze[1]
    nisa.tensor_scalar(dst=e, data=e, op0=nl.add, operand0=1.0)
    nisa.reciprocal(dst=e, data=e)
    sz = nl.ndarray(e.shape, nl.float32, buffer=nl.sbuf, name="silu_z")
    nisa.tensor_tensor(dst=sz, data1=zT, data2=e, op=nl.multiply)
    return sz


def _u_transposes(full_ps, proj, identA, h0, h1):
    """Channel-major u of heads h0 .. h1 - 1: PE transposes (exact) of their token-major columns of ``proj [T, N]``
    into columns K-1 .. of ``full_ps [D, NH, K-1+T]`` (PSUM; its first K-1 columns hold the window rows)."""
    D, NH, W = full_ps.shape
    T = proj.shape[0]
    for h in range(h0, h1):
        nisa.nc_matmul(dst=full_ps[:, h, W - T:W], stationary=proj[:, h * D:(h + 1) * D], moving=identA[0:T, 0:T],
                       accumulate=False)


def _conv_silu(full_ps, wc, cact, h0, h1):
    """Depthwise causal conv + SiLU of heads h0 .. h1 - 1: one VectorE multiply of the windowed access pattern
    ``[D, heads, T, K]`` of ``full_ps [D, NH, K-1+T]`` (PSUM, channel-major ``[window | u]``) by the broadcast taps
    ``wc [D, NH, K]`` + one add-reduce over K; SiLU as ``x * 1/(1 + exp(-x))`` (exp shares the gates' ACT table: no silu
    table load) -> ``cact[:, h0:h1, :]`` ``[D, heads, T]`` (activation dtype). The same operations per element for any
    head range."""
    D, NH, W = full_ps.shape
    K = wc.shape[2]
    T = W - (K - 1)
    nh = h1 - h0
    f32 = nl.float32
    prod = nl.ndarray((D, nh, T, K), f32, buffer=nl.sbuf, name=f"conv_prod_{h0}")
    nisa.tensor_tensor(dst=prod, data1=full_ps.ap(pattern=[[NH * W, D], [W, nh], [1, T], [1, K]], offset=h0 * W),
                       data2=wc.ap(pattern=[[NH * K, D], [K, nh], [0, T], [1, K]], offset=h0 * K), op=nl.multiply)
    sil = nl.ndarray((D, nh, T), f32, buffer=nl.sbuf, name=f"silu_in_{h0}")
    nisa.tensor_reduce(dst=sil, op=nl.add, data=prod, axis=3)
    sig = nl.ndarray((D, nh, T), f32, buffer=nl.sbuf, name=f"sigmoid_{h0}")
    nisa.activation(dst=sig, op=nl.exp, data=sil, scale=-1.0)
    nisa.tensor_scalar(dst=sig, data=sig, op0=nl.add, operand0=1.0)
    nisa.reciprocal(dst=sig, data=sig)
    nisa.tensor_tensor(dst=cact[:, h0:h1, :], data1=sil, data2=sig, op=nl.multiply)


def _evict_chunk(proj, accs, k, N, table_free=False):
    """Chunk k of the projections, rounded to the activation dtype into ``proj`` (odd chunks on ScalarE, even ones
    on VectorE, so neighbouring evictions run on both). ``table_free``: ScalarE's copy as a ``tensor_copy``, which
    needs no activation table (the evictions after the gates would otherwise switch ScalarE's exp table away)."""
    c0 = k * MOVING_MAX
    c1 = min(N, c0 + MOVING_MAX)
    if k % 2 == 1 and table_free:
        nisa.tensor_copy(dst=proj[:, c0:c1], src=accs[k], engine=nisa.engine.scalar)
    elif k % 2 == 1:
        nisa.activation(dst=proj[:, c0:c1], op=nl.copy, data=accs[k])
    else:
        nisa.tensor_copy(dst=proj[:, c0:c1], src=accs[k])


def gdn_body(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, eps, layer=None,
             weights=None, stack=1):
    """Body of one core: normed ``xT [128, H/128, T]`` (SBUF, activation dtype) + HBM weights (host layout)
    and decode state -> this core's partial ``y [T, H]`` float32 (SBUF).

    Writes checkpoint slots 0..T-1 of ``window`` and ``state`` (this core's heads / owned columns) in
    place; reads the starting slot given by the run-time ``read_slot [1, 1]`` int32 tensor. eps: the
    gated-norm epsilon (compile-time float). layer: with weights and state stacked over the GDN layers
    (``[G, ...]``, ``megakernel.plan``), the index of this layer (nki_kernels/common.py "Stacked tensors");
    None: one layer's tensors. weights: :func:`gdn_weights` of the same ``w_in`` / ``w_out`` / ``layer``, issued
    earlier by the caller (prefetch, e.g. into an arena), or None: loaded here. stack: S > 1: ``y`` is the
    bank-stacked partial SBUF ``[S*T, H/S]`` float32 (``nki_kernels.stacked``; the megakernel's residual layout).
    """
    w_off, s_off = layer_offset(window, layer), layer_offset(state, layer)
    slot_dim = 0 if layer == None else 1          # the dimension a run-time slot offset steps along
    w_in, conv_w, A_log, dt_bias = layer_of(w_in, layer), layer_of(conv_w, layer), layer_of(A_log, layer), \
        layer_of(dt_bias, layer)
    norm_w, w_out, window, state = layer_of(norm_w, layer), layer_of(w_out, layer), layer_of(window, layer), \
        layer_of(state, layer)
    pdim, J, T = xT.shape
    adt = xT.dtype
    n_cores, _, Jw, N = w_in.shape
    _, D, NH, K = conv_w.shape
    Km1 = K - 1
    hv_r = A_log.shape[0]
    slots, hv_r2, Dk, Dv = state.shape
    C_rank = window.shape[2]
    H = J * P
    n_launch, core = program_sharding()
    # ---- compile-time checks ------------------------------------------------------------------
    if pdim != P or not (1 <= T and T <= MAX_T):
        raise ValueError(f"gdn: xT has shape {xT.shape}, expected [{P}, H/{P}, T] with T in 1..{MAX_T}")
    if n_cores != n_launch:
        raise ValueError(f"gdn: weights are laid out for {n_cores} cores but the launch has {n_launch} "
                         f"(gdn_weight_layout(lnc=...) must match kernel[lnc])")
    if not (Jw == J and Dk == D and Dv == D and hv_r2 == hv_r and window.shape[0] == slots
            and window.shape[1] == Km1):
        raise ValueError(f"gdn: inconsistent shapes: xT {xT.shape}, w_in {w_in.shape}, conv_w {conv_w.shape}, "
                         f"state {state.shape}, window {window.shape}")
    if slots < T:
        raise ValueError(f"gdn: {slots} checkpoint slots cannot hold the {T} tokens of the launch")
    if not (T < D and D <= P):
        raise ValueError(f"gdn: head dim {D} must be in ({T}, {P}]")
    kd_r = (C_rank - hv_r * D) // 2
    hk_r = kd_r // D
    s = core_split(hk_r, hv_r, n_cores, core)
    hv_c, hk_c, vh0, kh0 = s["hv_c"], s["hk_c"], s["vh0"], s["kh0"]
    if NH != 2 * hk_c + hv_c or N != NH * D + hv_c * D + 2 * hv_c:
        raise ValueError(f"gdn: w_in/conv_w column counts {N}/{NH} do not match {hk_c} key and {hv_c} value heads "
                         f"of dim {D} per core")
    if not (w_out.shape[1] == D and w_out.shape[2] == hv_c and w_out.shape[3] == H and norm_w.shape[0] == D):
        raise ValueError(f"gdn: w_out {w_out.shape} / norm_w {norm_w.shape} do not match the heads of the core")
    if not (window.dtype == adt and w_in.dtype == adt and w_out.dtype == adt and state.dtype == nl.float32):
        raise ValueError(f"gdn: dtypes: activations {adt}, w_in {w_in.dtype}, w_out {w_out.dtype}, window "
                         f"{window.dtype} must agree; state must be float32 (got {state.dtype})")
    Cc = NH * D                        # conv channels of the core
    cz, cb, ca = Cc, Cc + hv_c * D, Cc + hv_c * D + hv_c
    f32 = nl.float32

    # ---- 1. run-time read slot, starting window and state --------------------------------------
    rs = nisa.register_alloc()
    nisa.register_load(rs, read_slot)            # one 32-bit load straight from HBM (SDK-ISA register_load)
    full_tok = nl.ndarray((Km1 + T, Cc), adt, buffer=nl.sbuf, name="conv_rows")    # token-major rows
    reads = [
        nisa.dma_copy(dst=full_tok[0:Km1, 0:2 * hk_c * D],
                      src=window.ap(pattern=[[C_rank, Km1], [kd_r, 2], [1, hk_c * D]], offset=w_off + kh0 * D,
                                    scalar_offset=rs, indirect_dim=slot_dim)),
        nisa.dma_copy(dst=full_tok[0:Km1, 2 * hk_c * D:Cc],
                      src=window.ap(pattern=[[C_rank, Km1], [1, hv_c * D]], offset=w_off + 2 * kd_r + vh0 * D,
                                    scalar_offset=rs, indirect_dim=slot_dim)),
    ]
    S_prev = nl.ndarray((D, hv_c, D), f32, buffer=nl.sbuf, name="state_in")
    reads.append(nisa.dma_copy(dst=S_prev, src=state.ap(pattern=[[D, D], [D * D, hv_c], [1, D]],
                                                        offset=s_off + vh0 * D * D, scalar_offset=rs,
                                                        indirect_dim=slot_dim)))
    if s["shared"]:
        # both cores read a shared key head's window columns; only its owner writes them
        nisa.core_barrier(data=window, cores=(0, 1))

    # ---- weights: in_proj groups (prefetched when they fit), out_proj and the small parameters (gdn_weights) ----
    wts = weights if weights != None else gdn_weights(w_in, conv_w, A_log, dt_bias, norm_w, w_out)   # layer views
    jg, w_tiles, wo, wc, wn, ident_g = wts.jg, wts.w_in_tiles, wts.wo, wts.wc, wts.wn, wts.ident_g
    # gate inputs: row t gets (b_t, a_t) after the projections; (A_log, dt_bias) are wts.ab
    gin = nl.ndarray((T, 2, hv_c), f32, buffer=nl.sbuf, name="gate_in")
    ab = wts.ab
    ones_row = nl.ndarray((1, D), f32, buffer=nl.sbuf, name="ones_row")     # broadcasts ab over the D partitions
    nisa.memset(dst=ones_row, value=1.0)
    one = ones_row[0:1, 0:1]        # the table warms' input (_warm_act)
    wts = None          # the tiles loaded here are freed after the projections (w_tiles = None below)
    G = ident_g.shape[0]
    identA = nl.shared_identity_matrix(n=T if T > Km1 else Km1, dtype=adt)
    identF = nl.shared_identity_matrix(n=D, dtype=f32)
    onesF = nl.ndarray((D, D), f32, buffer=nl.sbuf, name="ones")
    nisa.memset(dst=onesF, value=1.0)
    n_groups = (J + jg - 1) // jg
    prefetch = len(w_tiles) > 0

    # ---- 2. projections. With the weights resident (``weights``: the megakernel's arena), the chunks go in the
    # order their consumers need them: the gate chunk (the last one: it ends with the b, a columns) first, whose
    # broadcast and fp32 chain (3.) run on VectorE / ScalarE under the conv chunks' matmuls (bench/decode_speed.md
    # lever 28); then the chunks holding conv channels (q, k, v), evicted after the gates; the chunks of z alone
    # last, in pieces in the PE's idle time of the conv / l2norm / recurrence chain (z is read only by the gated
    # norm, 7.). Loaded here, group by group (they may not all fit at once), every chunk accumulates under each
    # group and all are evicted at once. Either way each chunk accumulates over the input tiles in j order: the
    # same bits.
    n_chunks = (N + MOVING_MAX - 1) // MOVING_MAX
    accs = []
    conv_ks = []                    # chunks with a conv column (but no gate column)
    z_ks = []                       # chunks of z columns only
    for k in range(n_chunks):
        c0 = k * MOVING_MAX
        c1 = min(N, c0 + MOVING_MAX)
        accs.append(nl.ndarray((T, c1 - c0), f32, buffer=nl.psum, name=f"proj_ps{k}"))
        if k < n_chunks - 1 and c0 >= cz:
            z_ks.append(k)
        elif k < n_chunks - 1:
            conv_ks.append(k)
    proj = nl.ndarray((T, N), adt, buffer=nl.sbuf, name="proj")
    zq = 0                          # z matmuls issued so far (resident weights)
    zq_all = len(z_ks) * J
    if prefetch:
        _project_chunk(accs, xT, w_tiles, jg, n_chunks - 1, N)
        _evict_chunk(proj, accs, n_chunks - 1, N)
    else:
        for gi in range(n_groups):
            j0 = gi * jg
            j1 = min(J, j0 + jg)
            wt = nl.ndarray((P, j1 - j0, N), adt, buffer=nl.sbuf, name=f"w_in_{j0}")
            nisa.dma_copy(dst=wt, src=w_in[core, :, j0:j1, :])
            for j in range(j0, j1):
                for k in range(n_chunks):
                    c0 = k * MOVING_MAX
                    c1 = min(N, c0 + MOVING_MAX)
                    nisa.nc_matmul(dst=accs[k], stationary=xT[:, j, :], moving=wt[:, j - j0, c0:c1], accumulate=j > 0)
        wt = None
        for kr in range(n_chunks):      # the gate columns (last chunk) first
            _evict_chunk(proj, accs, n_chunks - 1 - kr, N)
            accs[n_chunks - 1 - kr] = None
        zq = zq_all
    # warm ScalarE's softplus table while the gate inputs are broadcast (PE) and biased (DVE); see _warm_act
    _warm_act(nl.softplus, one)

    # ---- 4a. channel-major window rows (PE transposes; the window DMA had the projections' time) --
    W = Km1 + T
    full_ps = nl.ndarray((D, NH, W), f32, buffer=nl.psum, name="conv_in_ps")
    for h in range(NH):
        nisa.nc_matmul(dst=full_ps[:, h, 0:Km1], stationary=full_tok[0:Km1, h * D:(h + 1) * D],
                       moving=identA[0:Km1, 0:Km1], accumulate=False)

    # ---- 3. gates: (b, a | A_log, dt_bias) broadcast over the D partitions, then fp32 math -------
    nisa.tensor_copy(dst=gin, src=proj[:, cb:cb + 2 * hv_c])      # proj holds b ‖ a
    gr_ps = nl.ndarray((D, T + 1, 2, hv_c), f32, buffer=nl.psum, name="gate_in_ps")
    for t in range(T):              # one-hot stationary (column t of an identity, repeated D times)
        nisa.nc_matmul(dst=gr_ps[:, t, :, :], stationary=ident_g.ap(pattern=[[G, T], [0, D]], offset=t),
                       moving=gin, accumulate=False)
    nisa.nc_matmul(dst=gr_ps[:, T, :, :], stationary=ones_row, moving=ab, accumulate=False)    # row T: A_log, dt_bias
    # the conv chunks (2. above) under the gates' chain, in two parts around the q/k heads' transposes and l2norm sum:
    # q and k (the l2norm's input) come first in the conv columns, so their conv, SiLU and l2norm run under the v
    # columns' matmuls; only the v heads' conv and SiLU (-> beta v) follow the last conv matmul
    hqk = 2 * hk_c                  # q heads, k heads: the l2norm's input
    q_all = len(conv_ks) * J if prefetch else 0
    n_qk = min(len(conv_ks), (hqk * D - 1) // MOVING_MAX + 1)          # conv chunks holding q/k columns
    q_tr = min(q_all, n_qk * J + (J * CONV_SPLIT[0]) // CONV_SPLIT[2])   # conv matmuls before the q/k transposes
    q_ss = min(q_all, n_qk * J + (J * CONV_SPLIT[1]) // CONV_SPLIT[2])   # ... before the l2norm's sum
    cq = _project_steps(accs, xT, w_tiles, jg, conv_ks, 0, q_tr, N)
    gr = nl.ndarray((D, T + 1, 2, hv_c), f32, buffer=nl.sbuf, name="gate_in_b")
    nisa.tensor_copy(dst=gr, src=gr_ps)
    gr_ps = None
    bcast_t = (T + 1) * 2 * hv_c        # partition row of gr; a [D, T, Hv_c] view of row T (stride 0 over t)
    alog_b = gr.ap(pattern=[[bcast_t, D], [0, T], [1, hv_c]], offset=T * 2 * hv_c)
    dtb_b = gr.ap(pattern=[[bcast_t, D], [0, T], [1, hv_c]], offset=T * 2 * hv_c + hv_c)
    x1 = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="a_dt")
    nisa.tensor_tensor(dst=x1, data1=gr[:, 0:T, 1, :], data2=dtb_b, op=nl.add)
    sp = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="softplus")
    nisa.activation(dst=sp, op=nl.softplus, data=x1)
    ea = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="exp_A")
    nisa.activation(dst=ea, op=nl.exp, data=alog_b)
    gl = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="g")
    nisa.scalar_tensor_tensor(dst=gl, data=ea, op0=nl.multiply, operand0=-1.0, op1=nl.multiply, operand1=sp)
    gb = nl.ndarray((D, T, 3, hv_c), f32, buffer=nl.sbuf, name="gates")      # alpha, beta, alpha*beta
    nisa.activation(dst=gb[:, :, 0, :], op=nl.exp, data=gl)
    eb = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="exp_neg_b")
    nisa.activation(dst=eb, op=nl.exp, data=gr[:, 0:T, 0, :], scale=-1.0)
    nisa.tensor_scalar(dst=eb, data=eb, op0=nl.add, operand0=1.0)
    nisa.reciprocal(dst=gb[:, :, 1, :], data=eb)
    nisa.tensor_tensor(dst=gb[:, :, 2, :], data1=gb[:, :, 0, :], data2=gb[:, :, 1, :], op=nl.multiply)
    gr = x1 = sp = ea = gl = eb = None
    S_new = _decay(S_prev, gb, 0)   # round 0's decays, while ScalarE waits for the conv chunks (off the chain)
    if prefetch:
        for ki in range(n_qk):      # their evictions, after the gates'
            _evict_chunk(proj, accs, conv_ks[ki], N, table_free=True)
            accs[conv_ks[ki]] = None
        # the gate chunk's accumulator is freed only now: freed at its eviction, its bank went to the window
        # transposes' tile, whose writes then waited for that eviction (a false dependency on the chain)
        accs[n_chunks - 1] = None

    # ---- 4b + 5. q / k heads: channel-major u, conv + SiLU, l2norm(q), l2norm(k), q * Dk^-0.5 -> QK [D, Hk_c, 2T] ----
    # (k_t at column 2t, q_t at 2t+1)
    _u_transposes(full_ps, proj, identA, 0, hqk)
    cq = _project_steps(accs, xT, w_tiles, jg, conv_ks, cq, q_ss - cq, N)
    cact = nl.ndarray((D, NH, T), adt, buffer=nl.sbuf, name="conv_act")     # q heads, k heads, v heads
    _conv_silu(full_ps, wc, cact, 0, hqk)
    _warm_act(nl.square, one)        # the {copy, square, rsqrt} table (l2norm's rsqrt), while VectorE finishes the SiLU
    sq = nl.ndarray((D, hqk, T), f32, buffer=nl.sbuf, name="qk_sq")
    nisa.tensor_tensor(dst=sq, data1=cact[:, 0:hqk, :], data2=cact[:, 0:hqk, :], op=nl.multiply)
    ss_ps = nl.ndarray((D, hqk, T), f32, buffer=nl.psum, name="qk_ss_ps")
    nisa.nc_matmul(dst=ss_ps, stationary=onesF, moving=sq, accumulate=False)
    cq = _project_steps(accs, xT, w_tiles, jg, conv_ks, cq, q_all - cq, N)
    rr = nl.ndarray((D, hqk, T), f32, buffer=nl.sbuf, name="qk_rstd")
    nisa.activation(dst=rr, op=nl.rsqrt, data=ss_ps, bias=L2_EPS)
    _warm_act(nl.exp, one)               # back to the exp table (the v heads' SiLU, z's), only table-free work between
    QK = nl.ndarray((D, hk_c, 2 * T), f32, buffer=nl.sbuf, name="qk")
    nisa.tensor_tensor(dst=QK.ap(pattern=[[hk_c * 2 * T, D], [2 * T, hk_c], [2, T]], offset=0),
                       data1=cact[:, hk_c:hqk, :], data2=rr[:, hk_c:hqk, :], op=nl.multiply)
    nisa.scalar_tensor_tensor(dst=QK.ap(pattern=[[hk_c * 2 * T, D], [2 * T, hk_c], [2, T]], offset=1),
                              data=cact[:, 0:hk_c, :], op0=nl.multiply, operand0=1.0 / math.sqrt(D),
                              op1=nl.multiply, operand1=rr[:, 0:hk_c, :])
    sq = ss_ps = rr = None

    # ---- 4b. v heads: channel-major u, conv + SiLU; beta * v for every token [D, T, Hv_c] -------------------------
    if prefetch:
        for ki in range(n_qk, len(conv_ks)):    # on VectorE: ScalarE loads the exp table back meanwhile
            c0 = conv_ks[ki] * MOVING_MAX
            nisa.tensor_copy(dst=proj[:, c0:min(N, c0 + MOVING_MAX)], src=accs[conv_ks[ki]])
            accs[conv_ks[ki]] = None
    # z's matmuls, first piece: the PE waits for the v heads' eviction
    zq = _project_steps(accs, xT, w_tiles, jg, z_ks, zq, (zq_all * Z_PIECES[0]) // Z_PIECES[3], N)
    _u_transposes(full_ps, proj, identA, hqk, NH)
    _conv_silu(full_ps, wc, cact, hqk, NH)
    full_ps = None
    bv = nl.ndarray((D, T, hv_c), f32, buffer=nl.sbuf, name="beta_v")
    nisa.tensor_tensor(dst=bv, data1=gb[:, :, 1, :], data2=cact[:, hqk:NH, :].permute((0, 2, 1)), op=nl.multiply)

    # ---- 8. checkpoint windows: full_tok rows K-1.. <- u, slot j <- rows j+1 .. j+K-1 (after every conv eviction) ---
    nisa.dma_copy(dst=full_tok[Km1:W, :], src=proj[:, 0:Cc])
    o0, o1 = s["own"]
    for j in range(T):
        if o1 > o0:
            wr = nisa.dma_copy(
                dst=window.ap(pattern=[[C_rank, Km1], [kd_r, 2], [1, (o1 - o0) * D]],
                              offset=w_off + j * Km1 * C_rank + (kh0 + o0) * D),
                src=full_tok.ap(pattern=[[Cc, Km1], [hk_c * D, 2], [1, (o1 - o0) * D]], offset=(j + 1) * Cc + o0 * D))
            wr.depends_on(reads[0], reads[1], reads[2])
        wr = nisa.dma_copy(dst=window.ap(pattern=[[C_rank, Km1], [1, hv_c * D]],
                                         offset=w_off + j * Km1 * C_rank + 2 * kd_r + vh0 * D),
                           src=full_tok[j + 1:j + K, 2 * hk_c * D:Cc])
        wr.depends_on(reads[0], reads[1], reads[2])

    # ---- 6. recurrence -------------------------------------------------------------------------
    o_all = nl.ndarray((D, hv_c, T), adt, buffer=nl.sbuf, name="o")
    key_of = s["key_of"]
    t_z = 1 if T > 1 else 0         # the round after which z's SiLU is computed (z's matmuls end in round 0)
    for t in range(T + 1):
        lo = 0 if t == 0 else 2 * t - 1
        hi = 2 * T if t == T else 2 * t + 1
        n = hi - lo
        rd = nl.ndarray((D, hv_c, 2), f32, buffer=nl.psum, name="read_ps")
        for i in range(hv_c):
            nisa.nc_matmul(dst=rd[:, i, 0:n], stationary=S_prev[:, i, :], moving=QK[:, key_of[i], lo:hi],
                           accumulate=False)
        if t == 0:                  # z's second piece, while VectorE computes delta_0
            zq = _project_steps(accs, xT, w_tiles, jg, z_ks, zq, (zq_all * Z_PIECES[1]) // Z_PIECES[3], N)
        if t == t_z:                # the rest of z's matmuls
            zq = _project_steps(accs, xT, w_tiles, jg, z_ks, zq, zq_all, N)
        if t == T:                  # the last output on VectorE: ScalarE may still be loading its table (below)
            nisa.tensor_copy(dst=o_all[:, :, t - 1], src=rd[:, :, 0])
        if t < T:
            m = rd[:, :, n - 1]                               # S_{t-1}^T k_t
            tmp = nl.ndarray((D, hv_c), f32, buffer=nl.sbuf, name="ab_m")
            nisa.tensor_tensor(dst=tmp, data1=m, data2=gb[:, t, 2, :], op=nl.multiply)
            delta = nl.ndarray((D, hv_c), f32, buffer=nl.sbuf, name="delta")
            nisa.tensor_tensor(dst=delta, data1=bv[:, t, :], data2=tmp, op=nl.subtract)
            db = nl.ndarray((D, hv_c, D), f32, buffer=nl.psum, name="delta_b_ps")
            for i in range(hv_c):
                nisa.nc_matmul(dst=db[:, i, :], stationary=_bcast_col(delta, i, D, D), moving=identF, accumulate=False)
            if t == 0:              # z's third piece, while VectorE adds round 0's update
                zq = _project_steps(accs, xT, w_tiles, jg, z_ks, zq, (zq_all * Z_PIECES[2]) // Z_PIECES[3], N)
            if t > 0:
                S_new = _decay(S_prev, gb, t)
            for run in s["runs"]:
                kk = run[0]
                i0 = run[1]
                i1 = run[2]
                nisa.scalar_tensor_tensor(dst=S_new[:, i0:i1, :], data=db[:, i0:i1, :], op0=nl.multiply,
                                          operand0=QK[:, kk, 2 * t:2 * t + 1], op1=nl.add, operand1=S_new[:, i0:i1, :])
            wr = nisa.dma_copy(dst=state.ap(pattern=[[D, D], [D * D, hv_c], [1, D]],
                                            offset=s_off + (t * hv_r + vh0) * D * D),
                               src=S_new)
            wr.depends_on(reads[0], reads[1], reads[2])
            S_prev = S_new
            if t > 0 and t != t_z:  # o_{t-1}, after the decays (those are on the chain; o is read only by 7.)
                nisa.tensor_copy(dst=o_all[:, :, t - 1], src=rd[:, :, 0], engine=nisa.engine.scalar)
        if t == t_z:                # z's eviction (ScalarE, after this round's decays), transposes (PE, after this
            # round's delta broadcast, before the next round's reads), exp(-z), the gated norm's table back, z's SiLU
            ze = _exp_neg_z(proj, accs, z_ks if prefetch else [], identA, cz, D, hv_c)
            accs = w_tiles = None
            if t > 0 and t < T:     # o_{t-1}, after z's eviction and exp (those are on the chain)
                nisa.tensor_copy(dst=o_all[:, :, t - 1], src=rd[:, :, 0], engine=nisa.engine.scalar)
            _warm_act(nl.square, one)    # the gated norm's rsqrt table, back while ScalarE has only table-free work
            sz = _silu_z(ze)        # ze (z's PSUM tile) is kept to the loop's end: freed here, its bank went to
            #                         the next round's reads, which then waited for the SiLU's last read of it

    ze = None

    # ---- 7. gated RMSNorm (channel-major) and out_proj ------------------------------------------
    sq2 = nl.ndarray((D, hv_c, T), f32, buffer=nl.sbuf, name="o_sq")
    nisa.tensor_tensor(dst=sq2, data1=o_all, data2=o_all, op=nl.multiply)
    ss2 = nl.ndarray((D, hv_c, T), f32, buffer=nl.psum, name="o_ss_ps")
    nisa.nc_matmul(dst=ss2, stationary=onesF, moving=sq2, accumulate=False)
    rstd = nl.ndarray((D, hv_c, T), f32, buffer=nl.sbuf, name="o_rstd")
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ss2, scale=1.0 / D, bias=float(eps))
    yn = nl.ndarray((D, hv_c, T), f32, buffer=nl.sbuf, name="o_norm")
    nisa.tensor_tensor(dst=yn, data1=o_all, data2=rstd, op=nl.multiply)
    if stack > 1:
        return _out_proj_stacked(yn, wn, sz, wo, stack)
    yg = nl.ndarray((D, hv_c, T), adt, buffer=nl.sbuf, name="o_gated")
    nisa.scalar_tensor_tensor(dst=yg, data=yn, op0=nl.multiply, operand0=wn, op1=nl.multiply, operand1=sz)
    n_ochunks = (H + MOVING_MAX - 1) // MOVING_MAX
    y_ps = []
    for k in range(n_ochunks):
        y_ps.append(nl.ndarray((T, min(H, (k + 1) * MOVING_MAX) - k * MOVING_MAX), f32, buffer=nl.psum,
                               name=f"y_ps{k}"))
    for i in range(hv_c):
        for k in range(n_ochunks):
            n0 = k * MOVING_MAX
            nisa.nc_matmul(dst=y_ps[k], stationary=yg[:, i, :], moving=wo[:, i, n0:min(H, n0 + MOVING_MAX)],
                           accumulate=i > 0)
    y = nl.ndarray((T, H), f32, buffer=nl.sbuf, name="y")
    for k in range(n_ochunks):
        n0 = k * MOVING_MAX
        if k % 2 == 1:
            nisa.activation(dst=y[:, n0:min(H, n0 + MOVING_MAX)], op=nl.copy, data=y_ps[k])
        else:
            nisa.tensor_copy(dst=y[:, n0:min(H, n0 + MOVING_MAX)], src=y_ps[k])
    return y


def _out_proj_stacked(yn, wn, sz, wo, S):
    """The gated output ``yn * w * silu(z)`` [D, Hv_c, T] straight into the bank diagonals of a zero-padded
    stationary ``Z [D, Hv_c, S, S*T]`` (``nki_kernels.stacked``: Z[:, i, s, s*T + t] = the gated output of head i,
    token t), then out_proj as ONE PSUM accumulation ``[S*T, H/S]`` (bank s from the W_out columns of block
    ``bank_block(s)``) and one eviction: the bank-stacked partial ``y`` SBUF ``[S*T, H/S]`` float32."""
    D, hv_c, T = yn.shape
    H = wo.shape[2]
    W = H // S
    check_stack(S, T, H, "gdn")
    if W > MOVING_MAX:
        raise ValueError(f"gdn: bank width {W} exceeds one PSUM bank ({MOVING_MAX} fp32); stack more banks")
    z = nl.ndarray((D, hv_c, S, S * T), wo.dtype, buffer=nl.sbuf, name="o_gated_banks")
    nisa.memset(dst=z, value=0.0, engine=nisa.engine.gpsimd)
    nisa.scalar_tensor_tensor(dst=diagonal(z, S, T, hv_c), data=broadcast_banks(yn, T, hv_c, S), op0=nl.multiply,
                              operand0=wn, op1=nl.multiply, operand1=broadcast_banks(sz, T, hv_c, S))
    y_ps = nl.ndarray((S * T, W), nl.float32, buffer=nl.psum, name="y_ps_banks")
    for i in range(hv_c):
        for s in range(S):
            b = bank_block(s, S)
            nisa.nc_matmul(dst=y_ps, stationary=z[:, i, s, :], moving=wo[:, i, b * W:(b + 1) * W],
                           accumulate=i > 0 or s > 0)
    y = nl.ndarray((S * T, W), nl.float32, buffer=nl.sbuf, name="y")
    h = W // 2          # evicted in two halves, on ScalarE and VectorE at once (the collective reads y whole)
    nisa.activation(dst=y[:, 0:h], op=nl.copy, data=y_ps[:, 0:h])
    nisa.tensor_copy(dst=y[:, h:W], src=y_ps[:, h:W])
    return y


def load_feature_major(x):
    """HBM ``x [T, H]`` (token-major) -> SBUF ``xT [128, H/128, T]`` (same dtype) by exact PE transposes."""
    T, H = x.shape
    J = H // P
    if H % P:
        raise ValueError(f"gdn: hidden size {H} is not a multiple of {P}")
    x_sb = nl.ndarray((T, H), x.dtype, buffer=nl.sbuf, name="x_in")
    nisa.dma_copy(dst=x_sb, src=x)
    ident = nl.shared_identity_matrix(n=T, dtype=x.dtype)
    ps = nl.ndarray((P, J, T), nl.float32, buffer=nl.psum, name="xT_ps")
    for j in range(J):
        nisa.nc_matmul(dst=ps[:, j, :], stationary=x_sb[:, j * P:(j + 1) * P], moving=ident, accumulate=False)
    xT = nl.ndarray((P, J, T), x.dtype, buffer=nl.sbuf, name="xT")
    nisa.tensor_copy(dst=xT, src=ps)
    return xT


@nki.jit
def gdn_kernel(x, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, eps):
    """HBM wrapper. x: normed input ``[T, H]`` token-major (activation dtype); weights in the host layout of
    :func:`gdn_weight_layout` for this launch's LNC; window ``[slots, K-1, C_rank]``, state
    ``[slots, Hv_r, D, D]`` float32 (mutated in place: slot j <- after token j); read_slot ``[1, 1]`` int32;
    eps: gated-norm epsilon. Returns ``(y [n_cores, T, H] float32 per-core partials, state, window)``.
    """
    T, H = x.shape
    n = w_in.shape[0]
    y_out = nl.ndarray((n, T, H), nl.float32, buffer=nl.shared_hbm, name="y_partials")
    _, core = program_sharding()
    xT = load_feature_major(x)
    y = gdn_body(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, eps)
    nisa.dma_copy(dst=y_out[core], src=y)
    return y_out, state, window


# ---------------------------------------------------------------------------------------------
# demo arguments at real shapes (trace reports)
# ---------------------------------------------------------------------------------------------

def kernel_shapes(cfg, tp=4, T=2, lnc=2, dtype="bfloat16", slots=None):
    """Name -> (shape, dtype) of gdn_kernel's tensor arguments for one rank of ``cfg`` (ModelConfig-like)."""
    H, D, K = cfg.hidden_size, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    hk_r, hv_r = cfg.linear_num_key_heads // tp, cfg.linear_num_value_heads // tp
    s = core_split(hk_r, hv_r, lnc, 0)
    nh = 2 * s["hk_c"] + s["hv_c"]
    n_cols = nh * D + s["hv_c"] * D + 2 * s["hv_c"]
    c_rank = (2 * hk_r + hv_r) * D
    slots = slots or max(T, 2)
    return {
        "x": ((T, H), dtype),
        "w_in": ((lnc, P, H // P, n_cols), dtype),
        "conv_w": ((lnc, D, nh, K), dtype),
        "A_log": ((hv_r,), "float32"),
        "dt_bias": ((hv_r,), "float32"),
        "norm_w": ((D, 1), "float32"),
        "w_out": ((lnc, D, s["hv_c"], H), dtype),
        "window": ((slots, K - 1, c_rank), dtype),
        "state": ((slots, hv_r, D, D), "float32"),
        "read_slot": ((1, 1), "int32"),
    }
