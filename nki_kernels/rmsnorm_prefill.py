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
  partitions by ONE DMA with a stride-0 partition pattern (element (t, j, p) <- w1[p, j]).
* ``rows``  HBM ``[N, H]`` activation dtype (output): the normed rows, token-major -- the MoE prefill's input
  (``nki_kernels.moe_prefill.token_rows`` is a free reshape of it) and the post-final-norm hidden.
* ``xT``    HBM ``[P, J, N]`` activation dtype (output): the normed chunk feature-major, element (p, j, t) =
  y[t, j*P + p] -- the GDN and attention prefill kernels' input (the decode ``xT`` layout with T = N).

Per 128-token tile (tiles split round-robin over the LNC cores: core c normalises tiles c, c + n, ...; the
outputs are disjoint, so no core waits for the other): one DMA in; ACT ``square`` (fp32) and a DVE free-axis sum
(the compiler rejects ``square`` with ``reduce_op``, NCC_IXCG864); ACT ``rsqrt(ss / H + eps)`` (same table group {copy, square, rsqrt} as the
decode norm: no table switch); DVE ``x * rstd`` (per-partition scalar) and ``* (1 + w)`` rounding to the
activation dtype; one DMA of the rows out; J PE transposes (matmul of each [tokens, 128] slice against the
identity: one non-zero product per output, so exact) into fp32 PSUM, four 128-column transposes per bank, one
eviction per bank to the activation dtype, one DMA of the tile's xT columns out.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import P, kernel_assert, program_sharding

F32 = nl.float32
BANK_COLS = 512        # fp32 columns of one PSUM bank: four 128-column transposes


def broadcast_weight(w1, H):
    """The norm weight ``w1 [P, J]`` (HBM float32) as an SBUF ``[P, H]`` float32 tile, every partition holding
    ``1 + w`` in hidden order (one DMA, stride-0 over the partitions)."""
    J = H // P
    kernel_assert(tuple(w1.shape) == (P, J) and w1.dtype == F32,
                  f"rmsnorm_prefill: weight must be float32 [{P}, {J}] (rmsnorm_weight_layout), got "
                  f"{w1.dtype}{list(w1.shape)}")
    wb = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_w")
    nisa.dma_copy(dst=wb, src=w1.ap(pattern=[[0, P], [1, J], [J, P]]))   # offset: the view's (a norms row)
    return wb


def rmsnorm_rows_tile(xs, wb, nt, eps):
    """Residual rows ``xs [P, H]`` SBUF (rows 0..nt-1 valid, activation dtype) -> normed rows ``[P, H]`` SBUF,
    same dtype (rows 0..nt-1 written)."""
    H = xs.shape[1]
    sq = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_sq")
    ss = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_ss")
    nisa.activation(dst=sq[0:nt, :], op=nl.square, data=xs[0:nt, :])
    nisa.tensor_reduce(dst=ss[0:nt, :], op=nl.add, data=sq[0:nt, :], axis=1)
    rstd = nl.ndarray((P, 1), F32, buffer=nl.sbuf, name="rmsp_rstd")
    nisa.activation(dst=rstd[0:nt, :], op=nl.rsqrt, data=ss[0:nt, :], scale=1.0 / H, bias=float(eps))
    y = nl.ndarray((P, H), F32, buffer=nl.sbuf, name="rmsp_y")
    nisa.tensor_scalar(dst=y[0:nt, :], data=xs[0:nt, :], op0=nl.multiply, operand0=rstd[0:nt, :])
    out = nl.ndarray((P, H), xs.dtype, buffer=nl.sbuf, name="rmsp_rows")
    nisa.tensor_tensor(dst=out[0:nt, :], data1=y[0:nt, :], data2=wb[0:nt, :], op=nl.multiply)
    return out


def feature_major_tile(rows, nt, ident):
    """Normed rows ``rows [P, H]`` SBUF (rows 0..nt-1) -> ``xT [P, J, P]`` SBUF, same dtype, columns 0..nt-1 =
    the tile's tokens (exact PE transposes against ``ident`` [P, P])."""
    H = rows.shape[1]
    J = H // P
    per_bank = BANK_COLS // P
    xt = nl.ndarray((P, J, P), rows.dtype, buffer=nl.sbuf, name="rmsp_xT")
    for j0 in range(0, J, per_bank):
        j1 = min(J, j0 + per_bank)
        ps = nl.ndarray((P, j1 - j0, P), F32, buffer=nl.psum, name="rmsp_tp")
        for j in range(j0, j1):
            nisa.nc_matmul(dst=ps[:, j - j0, 0:nt], stationary=rows[0:nt, j * P:(j + 1) * P],
                           moving=ident[0:nt, 0:nt], accumulate=False)
        nisa.tensor_copy(dst=xt[:, j0:j1, 0:nt], src=ps[:, :, 0:nt])
    return xt


def rmsnorm_prefill_body(x, w1, eps, rows_out=None, xT_out=None):
    """Body: residual chunk ``x [N, H]`` (HBM) -> normed ``rows_out [N, H]`` and/or ``xT_out [P, H/P, N]`` (HBM,
    activation dtype; module docstring). This core normalises the 128-token tiles c, c + n_cores, ...; both
    outputs are written by the tile's core only."""
    N, H = x.shape
    kernel_assert(H % P == 0, f"rmsnorm_prefill: hidden size {H} is not a multiple of {P}")
    kernel_assert(N * H < 2 ** 31, f"rmsnorm_prefill: x [{N}, {H}] has element offsets beyond int32")
    if rows_out != None:
        kernel_assert(tuple(rows_out.shape) == (N, H), f"rmsnorm_prefill: rows_out has shape "
                                                      f"{list(rows_out.shape)}, expected [{N}, {H}]")
    if xT_out != None:
        kernel_assert(tuple(xT_out.shape) == (P, H // P, N), f"rmsnorm_prefill: xT_out has shape "
                                                            f"{list(xT_out.shape)}, expected [{P}, {H // P}, {N}]")
    n_cores, core = program_sharding()
    wb = broadcast_weight(w1, H)
    ident = nl.shared_identity_matrix(n=P, dtype=x.dtype)
    for t0 in range(core * P, N, n_cores * P):
        nt = min(P, N - t0)
        xs = nl.ndarray((P, H), x.dtype, buffer=nl.sbuf, name="rmsp_x")
        nisa.dma_copy(dst=xs[0:nt, :], src=x[t0:t0 + nt, :])
        rows = rmsnorm_rows_tile(xs, wb, nt, eps)
        if rows_out != None:
            nisa.dma_copy(dst=rows_out[t0:t0 + nt, :], src=rows[0:nt, :])
        if xT_out != None:
            xt = feature_major_tile(rows, nt, ident)
            nisa.dma_copy(dst=xT_out[:, :, t0:t0 + nt], src=xt[:, :, 0:nt])


@nki.jit
def rmsnorm_prefill_kernel(x, w1, eps):
    """HBM wrapper: ``x [N, H]`` activation dtype, ``w1 [P, H/P]`` float32 (one row of ``norms``) -> (``rows
    [N, H]``, ``xT [P, H/P, N]``), both activation dtype (each tile written by the core that normalised it)."""
    N, H = x.shape
    rows = nl.ndarray((N, H), x.dtype, buffer=nl.shared_hbm, name="rmsp_rows_out")
    xT = nl.ndarray((P, H // P, N), x.dtype, buffer=nl.shared_hbm, name="rmsp_xT_out")
    rmsnorm_prefill_body(x, w1, eps, rows_out=rows, xT_out=xT)
    return rows, xT
