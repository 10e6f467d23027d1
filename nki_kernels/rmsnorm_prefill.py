"""Zero-centred RMSNorm of a prompt chunk (N tokens, prefill): token-major rows and the feature-major ``xT``.

Math (``model.functional.rms_norm``, the decode ``nki_kernels.rmsnorm``): ``y[t] = (x[t] * rsqrt(mean(x[t]^2) +
eps)) * (1 + w)`` over the hidden axis in fp32, rounded once to the activation dtype. The decode body normalises
at most 4 tokens in the feature-major layout; a chunk has up to thousands, so here the tokens sit on the
partitions (128 per tile) and the hidden axis on the free axis -- the natural layout of the residual rows.

Layouts (P = 128, J = H / P)
----------------------------
* ``x``     HBM ``[N, H]`` activation dtype: the residual of the chunk, token-major.
* ``w1``    HBM ``[P, J]`` float32, the decode layout (``nki_kernels.rmsnorm.rmsnorm_weight_layout``: element
  (p, j) = 1 + w[j*P + p]); a row of the stacked ``norms`` tensor. It is broadcast over the 128 token
  partitions on chip (:func:`broadcast_weight`).
* ``rows``  HBM ``[N, H]`` activation dtype (output): the normed rows, token-major -- the MoE prefill's input
  (``nki_kernels.moe_prefill.token_rows`` is a free reshape of it) and the post-final-norm hidden.
* ``xT``    HBM ``[P, J, N]`` activation dtype (output): the normed chunk feature-major, element (p, j, t) =
  y[t, j*P + p] -- the GDN and attention prefill kernels' input (the decode ``xT`` layout with T = N).

Per 128-token tile (tiles split round-robin over the LNC cores: core c normalises tiles c, c + n, ...; the
outputs are disjoint, so no core waits for the other): one DMA in; ACT ``square`` (fp32), then an ACT copy
with its free-axis sum (the compiler rejects ``square`` with ``reduce_op``, NCC_IXCG864), ACT ``rsqrt(ss / H +
eps)`` and ACT ``x * rstd`` (the per-partition scale operand) -- one table group {copy, square, rsqrt}, as the
decode norm: no table switch; DVE ``* (1 + w)`` rounding to the activation dtype (ScalarE and VectorE share
the element work: the DVE-only version was DVE-bound, 337 us at 4K tokens); one DMA of the rows out; J PE transposes (matmul of each [tokens, 128] slice against the
identity: one non-zero product per output, so exact) into fp32 PSUM, four 128-column transposes per bank, one
eviction per bank to the activation dtype, one DMA of the tile's xT columns out.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import INT32_MAX, P, kernel_assert, program_sharding

F32 = nl.float32
BANK_COLS = 512        # fp32 columns of one PSUM bank: four 128-column transposes
GROUP = 4              # 128-token tiles per xT write (runs of 512 tokens = 1 KB bf16 per partition and hidden tile)
RING = 2               # depth of every work-tile ring


def broadcast_weight(w1, H):
    """The norm weight ``w1 [P, J]`` (HBM float32) as an SBUF ``[P, H]`` float32 tile, every partition holding
    ``1 + w`` in hidden order: one DMA of the H weights into one partition in hidden order (element h = j*P + p
    <- w1[p, j]), then a ones-stationary fp32 matmul per 512 columns broadcasts the row over the partitions
    (products by 1.0: exact, the assumption ``nki_kernels.gdn_prefill`` states). A stride-0 partition DMA of the
    whole [P, H] tile would move H 4-byte runs per partition (predicted 83 us at H = 2048, vs ~1 us here)."""
    J = H // P
    kernel_assert(tuple(w1.shape) == (P, J) and w1.dtype == F32,
                  f"rmsnorm_prefill: weight must be float32 [{P}, {J}] (rmsnorm_weight_layout), got "
                  f"{w1.dtype}{list(w1.shape)}")
    row = nl.ndarray((1, H), F32, buffer=nl.sbuf, name="rmsp_w_row")
    nisa.dma_copy(dst=row, src=w1.ap(pattern=[[0, 1], [1, J], [J, P]]))   # offset: the view's (a norms row)
    ones = nl.ndarray((1, P), F32, buffer=nl.sbuf, name="rmsp_ones")
    nisa.memset(dst=ones, value=1.0)
    wb = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_w")
    for n0 in range(0, H, BANK_COLS):
        n1 = min(H, n0 + BANK_COLS)
        ps = nl.ndarray((P, n1 - n0), F32, buffer=nl.psum, name="rmsp_w_ps")
        nisa.nc_matmul(dst=ps, stationary=ones, moving=row[:, n0:n1], accumulate=False)
        nisa.tensor_copy(dst=wb[:, n0:n1], src=ps)
    return wb


def _ring(shape, dtype, name, depth=RING):
    out = []
    for i in range(depth):
        out.append(nl.ndarray(shape, dtype, buffer=nl.sbuf, name=name))
    return out


def rmsnorm_rows_tile(xs, wb, nt, eps, sq=None, y=None, out=None):
    """Residual rows ``xs [P, H]`` SBUF (rows 0..nt-1 valid, activation dtype) -> normed rows ``[P, H]`` SBUF,
    same dtype (rows 0..nt-1 written). ``sq``, ``y`` ([P, H] float32) and ``out`` ([P, H] activation dtype) are
    the work tiles (allocated when not given: a caller pipelining tiles passes ring buffers; ``sq`` and ``y`` may
    be one tile). The ScalarE and VectorE parts are :func:`rmsnorm_scale_tile` and :func:`rmsnorm_weight_tile`."""
    H = xs.shape[1]
    if sq == None:
        sq = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_sq")
    if y == None:
        y = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_y")
    if out == None:
        out = nl.ndarray((P, H), xs.dtype, buffer=nl.sbuf, name="rmsp_rows")
    # the statistics' tiles live until this function returns (the SBUF placement, and so the physical-address
    # dependencies the cost model keys on, of every caller's tiles stay those of the unsplit norm)
    ss = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_ss")
    rstd = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_rstd")
    rmsnorm_scale_tile(xs, nt, eps, sq, y, ss, rstd)
    return rmsnorm_weight_tile(y, wb, nt, xs.dtype, out)


def rmsnorm_scale_tile(xs, nt, eps, sq, y, ss=None, rstd=None):
    """ScalarE's part of :func:`rmsnorm_rows_tile`: ``y = xs * rsqrt(mean(xs^2) + eps)`` float32 (rows 0..nt-1;
    ``sq`` the square's float32 work tile, which may be ``y`` itself; ``ss`` / ``rstd`` [P, 1] float32 the sum of
    squares and the scale, allocated when not given). Returns ``y``."""
    H = xs.shape[1]
    if ss == None:
        ss = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_ss")
    if rstd == None:
        rstd = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_rstd")
    nisa.activation(dst=sq[0:nt, :], op=nl.square, data=xs[0:nt, :])
    nisa.activation_reduce(dst=sq[0:nt, :], op=nl.copy, data=sq[0:nt, :], reduce_op=nl.add, reduce_res=ss[0:nt, :])
    nisa.activation(dst=rstd[0:nt, :], op=nl.rsqrt, data=ss[0:nt, :], scale=1.0 / H, bias=float(eps))
    nisa.activation(dst=y[0:nt, :], op=nl.copy, data=xs[0:nt, :], scale=rstd[0:nt, :])
    return y


def rmsnorm_weight_tile(y, wb, nt, dtype, out=None):
    """VectorE's part of :func:`rmsnorm_rows_tile`: ``out = y * (1 + w)`` rounded to ``dtype`` (rows 0..nt-1;
    ``out`` allocated [P, H] when not given). Returns ``out``."""
    if out == None:
        out = nl.ndarray((P, y.shape[1]), dtype, buffer=nl.sbuf, name="rmsp_rows")
    nisa.tensor_tensor(dst=out[0:nt, :], data1=y[0:nt, :], data2=wb[0:nt, :], op=nl.multiply)
    return out


def feature_major_tile(rows, nt, ident, xt=None, col=0):
    """Normed rows ``rows [P, H]`` SBUF (rows 0..nt-1) -> their feature-major columns ``col .. col+nt-1`` of
    ``xt [P, J, C]`` SBUF, same dtype (allocated ``[P, J, P]`` when not given); exact PE transposes against
    ``ident`` [P, P], four per PSUM bank, one eviction per bank. Returns ``xt``."""
    H = rows.shape[1]
    J = H // P
    per_bank = BANK_COLS // P
    if xt == None:
        xt = nl.ndarray((P, J, P), rows.dtype, buffer=nl.sbuf, name="rmsp_xT")
    for j0 in range(0, J, per_bank):
        j1 = min(J, j0 + per_bank)
        ps = nl.ndarray((P, j1 - j0, P), F32, buffer=nl.psum, name="rmsp_tp")
        for j in range(j0, j1):
            nisa.nc_matmul(dst=ps[:, j - j0, 0:nt], stationary=rows[0:nt, j * P:(j + 1) * P],
                           moving=ident[0:nt, 0:nt], accumulate=False)
        nisa.tensor_copy(dst=xt[:, j0:j1, col:col + nt], src=ps[:, :, 0:nt])
    return xt


def token_group_ap(t, base, rows, kk, H):
    """The rows of a group of ``kk`` 128-token sub-tiles of a token-major ``[.., H]`` HBM tensor as a ``[rows, kk *
    H]`` access pattern: partition p, sub-tile s = token row base / H + 128 s + p (base: an element offset)."""
    return t.ap(pattern=[[H, rows], [P * H, kk], [1, H]], offset=base)


AR_TILE_BYTES = 16 * 1024   # bytes per partition of one all-reduce collective's fp32 operand (2 tokens x H 2048)


def allreduce_groups(N, H):
    """The token groups of the on-chip residual all-reduce of an N-token chunk (``megakernel.prefill.
    residual_allreduce_stage`` and the fused epilogues of ``attention_prefill`` / ``moe_prefill``): a list of
    ``(t0, rows, kk)`` -- ``kk`` 128-token sub-tiles from token t0, ``rows`` partitions used (sub-tile s holds tokens
    t0 + 128 s + p on partition p, :func:`token_group_ap`). Groups of k = AR_TILE_BYTES / (4 H) sub-tiles (2 at H =
    2048: one collective per 16 KB fp32 per partition) while k whole sub-tiles remain, then single sub-tiles. Group g
    belongs to core g % n_cores."""
    k = max(1, min(AR_TILE_BYTES // (4 * H), N // P))
    groups = []
    t0 = 0
    while t0 < N:
        kk = k if N - t0 >= P * k else 1
        rows = min(P, N - t0)
        groups.append((t0, rows, kk))
        t0 = t0 + rows * kk
    return groups


def norm_output(N, H, dtype, norm_out, prefix):
    """The shared-HBM output of a fused next RMSNorm: "rows" ``[N, H]``, "xT" ``[P, H/P, N]`` (feature-major), or
    None for "none"; named ``prefix`` + "_rows" / "_xT"."""
    if norm_out == "rows":
        return nl.ndarray((N, H), dtype, buffer=nl.shared_hbm, name=prefix + "_rows")
    if norm_out == "xT":
        return nl.ndarray((P, H // P, N), dtype, buffer=nl.shared_hbm, name=prefix + "_xT")
    return None


def residual_norm_tile(xs, total, rows, kk, H, out_rows, norm_t, norm_out, t0, wb, ident, eps, sq=None, y=None):
    """The step after a cross-core / cross-rank sum: ``xs[0:rows, 0:kk H] += total`` (the new residual, rounded to
    the activation dtype; ``xs`` SBUF residual rows, ``total`` their float32 sum, both [P, >= kk H] in sub-tile
    groups: column block s holds tokens t0 + 128 s + p on partition p) written to ``out_rows`` (the HBM access
    pattern of those rows), and with ``norm_out`` "rows" / "xT" its RMSNorm per sub-tile (``wb``
    :func:`broadcast_weight`, ``ident`` the identity for the transposes) into ``norm_t`` (HBM rows ``[N, H]`` or
    xT ``[P, H/P, N]``). ``sq`` / ``y``: optional float32 ``[P, H]`` work tiles of the norm (:func:`rmsnorm_rows_tile`;
    a caller short of SBUF passes tiles that are dead by then). The three steps are :func:`residual_add_rows`,
    :func:`residual_norm_sub_tile` per sub-tile and :func:`residual_norm_store`; a caller may interleave them
    with other work (same instructions), or split the norm itself (:func:`rmsnorm_scale_tile`,
    :func:`rmsnorm_weight_tile`, :func:`residual_norm_emit`)."""
    residual_add_rows(xs, total, rows, kk, H, out_rows)
    if norm_out == "none":
        return
    xt = residual_norm_xT(xs, kk, H, norm_out)
    normed = None     # each sub-tile's normed rows stay live until the next ones exist (their DMA out may lag)
    for s in range(kk):
        normed = residual_norm_sub_tile(xs, s, rows, H, norm_t, norm_out, t0, wb, ident, eps, xt, sq, y)
    residual_norm_store(xt, rows, kk, norm_t, norm_out, t0)


def residual_add_rows(xs, total, rows, kk, H, out_rows):
    """``xs[0:rows, 0:kk H] += total`` (rounded to the activation dtype) and one DMA of the rows to ``out_rows``."""
    F = kk * H
    nisa.tensor_tensor(dst=xs[0:rows, 0:F], data1=xs[0:rows, 0:F], data2=total[0:rows, 0:F], op=nl.add)
    nisa.dma_copy(dst=out_rows, src=xs[0:rows, 0:F])


def residual_norm_xT(xs, kk, H, norm_out):
    """The group's feature-major SBUF tile ``[P, H/P, kk P]`` for ``norm_out`` "xT" (else None)."""
    if norm_out != "xT":
        return None
    return nl.ndarray((P, H // P, kk * P), xs.dtype, buffer=nl.sbuf, name="rmsp_res_xT")


def residual_norm_sub_tile(xs, s, rows, H, norm_t, norm_out, t0, wb, ident, eps, xt, sq=None, y=None):
    """RMSNorm of sub-tile s of a group's residual rows ``xs`` (tokens t0 + 128 s + p), emitted by
    :func:`residual_norm_emit`. Returns the normed rows' SBUF tile."""
    normed = rmsnorm_rows_tile(xs[:, s * H:(s + 1) * H], wb, rows, eps, sq, y)
    residual_norm_emit(normed, s, rows, norm_t, norm_out, t0, ident, xt)
    return normed


def residual_norm_emit(normed, s, rows, norm_t, norm_out, t0, ident, xt):
    """Sub-tile s of a group's normed rows ``normed [P, H]`` SBUF: "rows" stored to ``norm_t`` at once, "xT"
    transposed into the group's tile ``xt`` (:func:`residual_norm_store` writes it)."""
    if norm_out == "rows":
        nisa.dma_copy(dst=norm_t[t0 + s * P:t0 + s * P + rows, :], src=normed[0:rows, :])
    else:
        feature_major_tile(normed, rows, ident, xt, s * P)


def residual_norm_store(xt, rows, kk, norm_t, norm_out, t0):
    """One DMA of a group's xT columns (``norm_out`` "xT"; nothing otherwise)."""
    if norm_out == "xT":
        nisa.dma_copy(dst=norm_t[:, :, t0:t0 + kk * rows], src=xt[:, :, 0:kk * rows])


def rmsnorm_prefill_body(x, w1, eps, rows_out=None, xT_out=None):
    """Body: residual chunk ``x [N, H]`` (HBM) -> normed ``rows_out [N, H]`` and/or ``xT_out [P, H/P, N]`` (HBM,
    activation dtype; module docstring). This core normalises the groups of :data:`GROUP` 128-token tiles c,
    c + n_cores, ... (so each xT write moves runs of GROUP x 128 tokens per partition and hidden tile); every
    work tile is a :data:`RING`-deep ring, so the DMA, ACT, DVE and PE work of consecutive tiles overlaps."""
    N, H = x.shape
    J = H // P
    kernel_assert(H % P == 0, f"rmsnorm_prefill: hidden size {H} is not a multiple of {P}")
    kernel_assert(N * H <= INT32_MAX, f"rmsnorm_prefill: x [{N}, {H}] has element offsets beyond int32")
    if rows_out != None:
        kernel_assert(tuple(rows_out.shape) == (N, H), f"rmsnorm_prefill: rows_out has shape "
                                                      f"{list(rows_out.shape)}, expected [{N}, {H}]")
    if xT_out != None:
        kernel_assert(tuple(xT_out.shape) == (P, J, N), f"rmsnorm_prefill: xT_out has shape "
                                                       f"{list(xT_out.shape)}, expected [{P}, {J}, {N}]")
    n_cores, core = program_sharding()
    adt = x.dtype
    wb = broadcast_weight(w1, H)
    ident = nl.shared_identity_matrix(n=P, dtype=adt)
    xs_r, sq_r = _ring((P, H), adt, "rmsp_x"), _ring((P, H), F32, "rmsp_sq")
    y_r, out_r = _ring((P, H), F32, "rmsp_y"), _ring((P, H), adt, "rmsp_rows")
    xt_r = _ring((P, J, GROUP * P), adt, "rmsp_xT")
    k = 0
    gi = 0
    for g0 in range(core * GROUP * P, N, n_cores * GROUP * P):
        gn = min(GROUP * P, N - g0)
        xt = xt_r[gi % RING]
        gi = gi + 1
        for t0 in range(g0, g0 + gn, P):
            nt = min(P, N - t0)
            xs = xs_r[k % RING]
            nisa.dma_copy(dst=xs[0:nt, :], src=x[t0:t0 + nt, :])
            rows = rmsnorm_rows_tile(xs, wb, nt, eps, sq_r[k % RING], y_r[k % RING], out_r[k % RING])
            k = k + 1
            if rows_out != None:
                nisa.dma_copy(dst=rows_out[t0:t0 + nt, :], src=rows[0:nt, :])
            if xT_out != None:
                feature_major_tile(rows, nt, ident, xt, t0 - g0)
        if xT_out != None:
            nisa.dma_copy(dst=xT_out[:, :, g0:g0 + gn], src=xt[:, :, 0:gn])


@nki.jit
def rmsnorm_prefill_kernel(x, w1, eps, rows=True, xT=True):
    """HBM wrapper: ``x [N, H]`` activation dtype, ``w1 [P, H/P]`` float32 (one row of ``norms``) -> the requested
    outputs in this order: ``rows [N, H]`` (``rows``), ``xT [P, H/P, N]`` (``xT``), both activation dtype (each
    tile written by the core that normalised it). The mixers read xT only, the MoE and the MTP head rows only."""
    N, H = x.shape
    kernel_assert(rows or xT, "rmsnorm_prefill: ask for rows, xT or both")
    outs = ()
    rows_out = None
    xT_out = None
    if rows:
        rows_out = nl.ndarray((N, H), x.dtype, buffer=nl.shared_hbm, name="rmsp_rows_out")
        outs = outs + (rows_out,)
    if xT:
        xT_out = nl.ndarray((P, H // P, N), x.dtype, buffer=nl.shared_hbm, name="rmsp_xT_out")
        outs = outs + (xT_out,)
    rmsnorm_prefill_body(x, w1, eps, rows_out=rows_out, xT_out=xT_out)
    return outs
