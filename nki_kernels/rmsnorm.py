"""Zero-centred RMSNorm of the residual, emitting the feature-major ``xT`` every projection consumes.

Math (``model.functional.rms_norm``): ``y[t] = x[t] * rsqrt(mean(x[t]^2) + eps) * (1 + w)`` over the
hidden axis, computed in fp32 and rounded once to the activation dtype.

Layouts (``nki_kernels/README.md``; P = 128 partitions, J = H / P hidden tiles, T = 1..4 tokens)
----------------------------------------------------------------------------------------------
* ``x``    SBUF ``[T, H]`` activation dtype, token-major (token t on partition t) -- the residual.
* ``w1``   HBM ``[P, J]`` float32, **host layout** (:func:`rmsnorm_weight_layout`): element (p, j) is
  ``1 + w[j*P + p]`` computed in fp32 exactly like the reference (so the kernel never adds the 1).
* ``xT``   SBUF ``[P, J, T]`` activation dtype, feature-major: ``xT[p, j, t] = y[t, j*P + p]``.

Algorithm (transpose first, then normalise in the feature-major layout)
----------------------------------------------------------------------
1. PE: J transposes ``x[:, jP:(j+1)P] -> [P, T]`` as matmuls against a ``[T, T]`` identity
   (stationary = the x slice, moving = identity), all into ONE fp32 PSUM tile ``[P, J, T]``. A 0/1
   identity makes this bit-exact (one non-zero product per output), it never writes a 2-byte PSUM
   element (the bf16 ``nc_transpose`` T=1 verifier pitfall, shared/docs/trn2-costs.md) and it slices
   the stationary's free axis only, like any projection.
2. ACT ``square`` of that tile -> fp32 ``[P, J, T]`` (J*T <= 64 elements per partition, not H).
3. DVE: sum over j of a ``[P, T, J]`` (permuted) view -> ``[P, T]`` partial sums.
4. PE: ``ones[P, P]^T @ partial`` -> every partition holds ``sum_h x[t, h]^2`` (cross-partition sum and
   broadcast in one fp32 matmul).
5. ACT ``rsqrt(ss / H + eps)`` (scale/bias of the same instruction) -> ``rstd [P, T]``. ``square`` and
   ``rsqrt`` share the ACT table group {copy, square, rsqrt}, loaded at the start of the body by a warm-up
   ``rsqrt`` of a constant tile (step 0). It depends on nothing the norm computes, so the 1.28 us table load
   (after the mixer's or MoE's SILU / SIGMOID / EXP) overlaps whatever precedes the norm -- in the megakernel the
   all-reduce that produces x -- instead of sitting on the norm's chain (a GpSimd memset feeds it: VectorE's
   queue is busy with the residual add then).
6. DVE: ``xT = (x * rstd) * (1 + w)`` as two tensor_tensor ops with stride-0 broadcast views (rstd
   along j, the weight along t), reading the transposes straight from PSUM; the second rounds to the
   activation dtype. Same operation order as the reference, all fp32.

Per core (H = 2048, any T): 17 PE, 3 ACT (one the table warm-up), 3 DVE, 1 GpSimd instructions, 1 weight DMA of
8 KiB.

:func:`residual_rmsnorm_body` is the same norm of ``x + (lane + peer)`` taken straight from an all-reduce's two
lane sums (``collectives.allreduce_lanes``): the adds run in the feature-major layout after the PE transposes
(J*T elements per partition instead of the residual's H/S), so the chain from the sendrecv to the norm's first
ScalarE op is 4 transposes and two small DVE adds instead of two full-width adds, a hand-off and 4 transposes
(bench/decode_speed.md, the post-collective chain row).
Under LNC=2 both physical cores normalise the same residual (each needs the whole ``xT``).
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import P, kernel_assert, program_sharding
from nki_kernels.stacked import check_stack

MAX_T = 4


def rmsnorm_weight_layout(w):
    """Host helper: norm weight ``w [H]`` (zero-centred, any float dtype; torch or numpy) -> the kernel's
    ``w1 [P, H // P]`` float32 with ``w1[p, j] = 1 + w[j*P + p]`` (computed in fp32 like the reference)."""
    import torch
    t = torch.as_tensor(w).float()
    if t.ndim != 1 or t.shape[0] % P:
        raise ValueError(f"rmsnorm_weight_layout: weight has shape {list(t.shape)}, expected [H] with H a "
                         f"multiple of {P}")
    return (1.0 + t).reshape(-1, P).t().contiguous()


def _check_x(x_sb, stack):
    rows, W = x_sb.shape
    T, H = rows // stack, W * stack
    check_stack(stack, T, H, "rmsnorm")
    if rows % stack:
        raise ValueError(f"rmsnorm: {rows} stacked rows are not {stack} banks of T token rows")
    if not (1 <= T and T <= MAX_T):
        raise ValueError(f"rmsnorm: x has {T} token rows, expected 1..{MAX_T}")
    if H % P:
        raise ValueError(f"rmsnorm: hidden size {H} is not a multiple of {P} (the partition count)")
    return T, H


def rmsnorm_body(x_sb, w1, eps, stack=1):
    """Body: residual ``x_sb [T, H]`` (SBUF, activation dtype) -> normed ``xT [P, H/P, T]`` (SBUF, same dtype).

    w1: ``[P, H/P]`` float32 (:func:`rmsnorm_weight_layout`), in HBM or already in SBUF (a caller that loads it
    early); eps: compile-time float.
    stack: S > 1: ``x_sb`` is the bank-stacked residual ``[S*T, H/S]`` (``nki_kernels.stacked``); step 1 then
    takes (H/S)/P transposes of ``[S*T, P]`` against an ``[S*T, S*T]`` identity, each writing the S feature tiles
    j = block(s)*(H/S)/P + c of its column tile c (a strided PSUM destination). Every later step, and ``xT``,
    are the same instructions and bits as for the token-major x.
    """
    T, H = _check_x(x_sb, stack)
    w_sb, ident, ones = _prologue(w1, H, stack * T, x_sb.dtype)
    # 1. feature-major copy of x (exact) in PSUM
    xt_ps = nl.ndarray((P, H // P, T), nl.float32, buffer=nl.psum, name="rms_xt_ps")
    _feature_major(xt_ps, x_sb, ident, stack, False)
    return _normalise(xt_ps, w_sb, ones, eps, x_sb.dtype)


def residual_rmsnorm_body(x_sb, lanes, w1, eps, stack=1):
    """The next norm of a residual update: ``rmsnorm_body(x + (lane + peer))`` without waiting for that update.

    x_sb:  the residual before the update (SBUF, activation dtype), token-major ``[T, H]`` or bank-stacked
    ``[S*T, H/S]``.
    lanes: ``collectives.allreduce_lanes(y, rg)`` of a partial in x's layout: ``(lane, peer)`` float32 (peer None
    at LNC = 1). w1, eps, stack: as :func:`rmsnorm_body`.
    Returns ``xT [P, H/P, T]``, the same bits as ``rmsnorm_body(x')`` with ``x' = x + combine_lanes(lanes)`` (the
    residual's own update, which the caller still issues: ``megakernel.round`` emits it where VectorE is idle).

    Why: the two-step form puts two full-width DVE adds (0.68 us each in the stacked layout) and a PE hand-off
    between the intra-rank sendrecv and the norm's first ScalarE op, on every reduction of a round. Here the norm
    works from the pieces in its feature-major layout, where an elementwise op has J*T <= 64 elements per
    partition: x^T by matmuls against a bf16 identity (exact, as step 1), lane^T and peer^T by fp32 transpose-mode
    matmuls (SDK nc_transpose: "Starting NeuronCore-v3, all Tensor Engine transpose is bit-accurate"), then
    ``total = lane^T + peer^T`` and ``x'^T = x^T + total`` (rounded once to x's dtype) on DVE: the same fp32
    operations on the same operands as the residual's adds (elementwise, so layout-free; the lane add is
    commutative, so both cores agree). Only the peer's 4 transposes and the two small adds follow the sendrecv;
    x's and the lane's transposes (and their ScalarE copies to SBUF: a DVE op reads at most one PSUM operand) run
    while it is in flight. Steps 2-6 are rmsnorm_body's on ``x'^T``, with the squares on VectorE (x'^T is in SBUF:
    ``x * x``: nkisim's ScalarE ``square`` is that exact fp32 product; the SDK does not say whether the hardware's
    is, so on a trn2 the last bit may differ from the layerwise norm's), two hand-offs fewer. One difference: an
    exactly-zero element of x' keeps its sign here, where rmsnorm_body's identity-matmul transpose can turn -0.0 into
    +0.0.
    """
    T, H = _check_x(x_sb, stack)
    J = H // P
    lane = lanes[0]
    peer = lanes[1]
    for part in lanes:
        if part != None and (tuple(part.shape) != tuple(x_sb.shape) or part.dtype != nl.float32):
            raise ValueError(f"residual_rmsnorm: lanes must be float32 {list(x_sb.shape)} like the residual, got "
                             f"{part.dtype}{list(part.shape)}")
    w_sb, ident, ones = _prologue(w1, H, stack * T, x_sb.dtype)
    ident32 = nl.shared_identity_matrix(n=stack * T, dtype=nl.float32)
    # x^T (x is ready long before the collective ends): PSUM, then an SBUF copy on ScalarE (table-free copy)
    xo_ps = nl.ndarray((P, J, T), nl.float32, buffer=nl.psum, name="rms_xo_ps")
    _feature_major(xo_ps, x_sb, ident, stack, False)
    xo = nl.ndarray((P, J, T), nl.float32, buffer=nl.sbuf, name="rms_xo")
    nisa.tensor_copy(dst=xo, src=xo_ps, engine=nisa.engine.scalar)
    lane_ps = nl.ndarray((P, J, T), nl.float32, buffer=nl.psum, name="rms_lane_ps")
    _feature_major(lane_ps, lane, ident32, stack, True)
    xn = nl.ndarray((P, J, T), x_sb.dtype, buffer=nl.sbuf, name="rms_xn")
    if peer == None:
        nisa.tensor_tensor(dst=xn, data1=xo, data2=lane_ps, op=nl.add)
    else:
        lane_t = nl.ndarray((P, J, T), nl.float32, buffer=nl.sbuf, name="rms_lane_t")
        nisa.tensor_copy(dst=lane_t, src=lane_ps, engine=nisa.engine.scalar)
        peer_ps = nl.ndarray((P, J, T), nl.float32, buffer=nl.psum, name="rms_peer_ps")
        _feature_major(peer_ps, peer, ident32, stack, True)
        total = nl.ndarray((P, J, T), nl.float32, buffer=nl.sbuf, name="rms_total")
        nisa.tensor_tensor(dst=total, data1=lane_t, data2=peer_ps, op=nl.add)
        nisa.tensor_tensor(dst=xn, data1=xo, data2=total, op=nl.add)
    return _normalise(xn, w_sb, ones, eps, x_sb.dtype)


def _prologue(w1, H, K, dtype):
    """The norm's weight in SBUF, the ScalarE table warm-up (step 0), the ``[K, K]`` identity of step 1 in x's
    dtype and the ``ones [P, P]`` float32 of step 4 -> ``(w_sb, ident, ones)``."""
    J = H // P
    if not (w1.shape[0] == P and w1.shape[1] == J and w1.dtype == nl.float32):
        raise ValueError(f"rmsnorm: weight must be float32 [{P}, {J}] (rmsnorm_weight_layout), got "
                         f"{w1.dtype}{w1.shape}")
    w_sb = w1
    if w1.buffer != nl.sbuf:
        w_sb = nl.ndarray((P, J), nl.float32, buffer=nl.sbuf, name="rms_w1")
        nisa.dma_copy(dst=w_sb, src=w1)
    # 0. warm ScalarE's {copy, square, rsqrt} table now (module doc, step 5; trn2-costs: ACT_TABLE_LOAD
    # 1,283 ns on any group switch): depends only on a GpSimd memset, so it runs while x is still produced
    warm = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf, name="rms_act_warm")
    nisa.memset(dst=warm, value=1.0, engine=nisa.engine.gpsimd)
    nisa.activation(dst=warm, op=nl.rsqrt, data=warm)
    ident = nl.shared_identity_matrix(n=K, dtype=dtype)
    ones = nl.ndarray((P, P), nl.float32, buffer=nl.sbuf, name="rms_ones")
    nisa.memset(dst=ones, value=1.0)
    return w_sb, ident, ones


def _feature_major(dst_ps, x, ident, stack, transpose_mode):
    """Step 1: ``dst_ps [P, J, T]`` (PSUM fp32) = x^T, from token-major ``x [T, H]`` or stacked ``[S*T, H/S]``.
    transpose_mode False: matmuls against ``ident`` (x's dtype; fp32 out, exact: one non-zero product per output);
    True: PE transpose-mode matmuls (x and ``ident`` fp32, bit-accurate, dst keeps fp32)."""
    J, T = dst_ps.shape[1], dst_ps.shape[2]
    if stack == 1:
        for j in range(J):
            nisa.nc_matmul(dst=dst_ps[:, j, :], stationary=x[:, j * P:(j + 1) * P], moving=ident,
                           is_transpose=transpose_mode, accumulate=False)
    else:
        # output column s*T + t = bank s = 2u + v holds block v*S/2 + u (stacked.bank_block): feature tile
        # j = (v*S/2 + u)*JW + c, iterated (u, v, t)
        JW = J // stack
        half = stack // 2
        for c in range(JW):
            dst = dst_ps.ap(pattern=[[J * T, P], [JW * T, half], [half * JW * T, 2], [1, T]], offset=c * T)
            nisa.nc_matmul(dst=dst, stationary=x[:, c * P:(c + 1) * P], moving=ident, is_transpose=transpose_mode,
                           accumulate=False)


def _normalise(xf, w_sb, ones, eps, dtype):
    """Steps 2-6 on the feature-major ``xf [P, J, T]`` (fp32 PSUM, or SBUF of x's values) -> ``xT`` in dtype.
    An SBUF ``xf`` is squared on VectorE (``xf * xf``: in nkisim the same fp32 product as ScalarE's ``square``, whose
    hardware accuracy the SDK does not state), so the norm's chain stays on VectorE up to the PE sum; a PSUM one on
    ScalarE (a DVE op reads at most one PSUM operand)."""
    J, T = xf.shape[1], xf.shape[2]
    H = J * P
    # 2-3. squares and per-partition partial sums over j
    sq = nl.ndarray((P, J, T), nl.float32, buffer=nl.sbuf, name="rms_sq")
    if xf.buffer == nl.psum:
        nisa.activation(dst=sq, op=nl.square, data=xf)
    else:
        nisa.tensor_tensor(dst=sq, data1=xf, data2=xf, op=nl.multiply)
    part = nl.ndarray((P, T), nl.float32, buffer=nl.sbuf, name="rms_part")
    nisa.tensor_reduce(dst=part, op=nl.add, data=sq.permute((0, 2, 1)), axis=2)
    # 4. cross-partition sum, broadcast to every partition
    ss_ps = nl.ndarray((P, T), nl.float32, buffer=nl.psum, name="rms_ss_ps")
    nisa.nc_matmul(dst=ss_ps, stationary=ones, moving=part, accumulate=False)
    # 5. rstd = rsqrt(mean + eps)
    rstd = nl.ndarray((P, T), nl.float32, buffer=nl.sbuf, name="rms_rstd")
    nisa.activation(dst=rstd, op=nl.rsqrt, data=ss_ps, scale=1.0 / H, bias=float(eps))
    # 6. (x * rstd) * (1 + w)
    y = nl.ndarray((P, J, T), nl.float32, buffer=nl.sbuf, name="rms_y")
    nisa.tensor_tensor(dst=y, data1=xf, data2=rstd.ap(pattern=[[T, P], [0, J], [1, T]], offset=0),
                       op=nl.multiply)
    xT = nl.ndarray((P, J, T), dtype, buffer=nl.sbuf, name="xT")
    nisa.tensor_tensor(dst=xT, data1=y, data2=w_sb.ap(pattern=[[J, P], [1, J], [0, T]], offset=0),
                       op=nl.multiply)
    return xT


@nki.jit
def rmsnorm_kernel(x, w1, eps):
    """HBM wrapper: ``x [T, H]`` (activation dtype) and ``w1 [P, H/P]`` float32 -> ``xT [n_cores, P, H/P, T]``.

    Core c writes row c (under LNC=2 both cores compute the same values; the test checks both copies).
    """
    T, H = x.shape
    n, c = program_sharding()
    out = nl.ndarray((n, P, H // P, T), x.dtype, buffer=nl.shared_hbm, name="xT_out")
    x_sb = nl.ndarray((T, H), x.dtype, buffer=nl.sbuf, name="x")
    nisa.dma_copy(dst=x_sb, src=x)
    xT = rmsnorm_body(x_sb, w1, eps)
    nisa.dma_copy(dst=out[c], src=xT)
    return out
