"""Dense projections that are not part of a larger family, and the feature- to token-major transpose.

* :func:`columns_body` -- this core's slice of output columns of ``y = x W^T``. Used for the MTP
  head's ``fc`` ([H, 2H]): core g of the TP x LNC cores owns output columns ``[g*Nc, (g+1)*Nc)`` and
  reads only their weights; ``collectives.allgather_cores`` assembles the full output in global core
  order, so the kernel code is the same on every rank (the rank is in the data, not the code).
* :func:`token_major` -- feature-major ``xT [P, J, T]`` back to token-major ``[T, J*P]`` (the trunk's
  post-norm hidden, returned to the host and fed to the next round's MTP head).

Layouts (nki_kernels/README.md): ``xT [P, J, T]`` SBUF, element (p, j, t) = x[t, j*P + p]; weights
contraction-major in HBM: ``w [P, J, Nc]`` with ``w[p, j, n] = W[col0 + n, j*P + p]``
(:func:`column_layout`).
"""

from __future__ import annotations

import torch

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import MOVING_MAX, P, dma_on, program_sharding
from nki_kernels.host import as_torch


def columns_weight(w, engine=None):
    """The SBUF copy ``[P, J, Nc]`` of a :func:`column_layout` weight (one DMA, issued here): for a caller that loads
    it ahead of :func:`columns_body` (``w_sb=``). ``engine``: the hardware-DGE queue to trigger it from (e.g.
    ``nisa.engine.scalar``, so it does not sit in the default queue ahead of other DMAs), None: the default."""
    w_sb = nl.ndarray(tuple(w.shape), w.dtype, buffer=nl.sbuf, name="lin_w")
    dma_on(w_sb, w, engine)
    return w_sb


def columns_body(xT, w, w_sb=None):
    """y [T, Nc] float32 SBUF = x W_c^T for this core's Nc output columns.

    xT: SBUF ``[P, J, T]`` activation dtype; w: HBM ``[P, J, Nc]`` (:func:`column_layout`), same dtype.
    Weights are the moving operand, accumulated over the J contraction tiles in one PSUM bank per
    512-column chunk; one weight DMA (``w_sb``: its :func:`columns_weight`, loaded by the caller, else issued here).
    """
    _, J, T = xT.shape
    wp, wj, nc = w.shape
    if wp != P or wj != J:
        raise ValueError(f"columns_body: weight is {list(w.shape)}, expected [{P}, {J}, Nc]")
    if w_sb == None:
        w_sb = columns_weight(w)
    y = nl.ndarray((T, nc), nl.float32, buffer=nl.sbuf, name="lin_y")
    for n0 in range(0, nc, MOVING_MAX):
        n1 = min(nc, n0 + MOVING_MAX)
        ps = nl.ndarray((T, n1 - n0), nl.float32, buffer=nl.psum, name="lin_ps")
        for j in range(J):
            nisa.nc_matmul(dst=ps, stationary=xT[:, j, :], moving=w_sb[:, j, n0:n1], accumulate=j > 0)
        nisa.tensor_copy(dst=y[:, n0:n1], src=ps)
    return y


def token_major(xT):
    """Feature-major ``xT [P, J, T]`` -> token-major ``[T, J*P]`` SBUF, same dtype, bit-exact.

    J PE transposes (matmul of each ``[P, T]`` tile against a ``[P, P]`` identity: one non-zero product
    per output, so exact) into fp32 PSUM, 512 columns per bank, then one copy per bank.
    """
    _, J, T = xT.shape
    H = J * P
    ident = nl.shared_identity_matrix(n=P, dtype=xT.dtype)
    x = nl.ndarray((T, H), xT.dtype, buffer=nl.sbuf, name="tok_x")
    for n0 in range(0, H, MOVING_MAX):
        n1 = min(H, n0 + MOVING_MAX)
        ps = nl.ndarray((T, n1 - n0), nl.float32, buffer=nl.psum, name="tok_ps")
        for j in range(n0 // P, n1 // P):
            nisa.nc_matmul(dst=ps[:, j * P - n0:(j + 1) * P - n0], stationary=xT[:, j, :], moving=ident,
                           accumulate=False)
        nisa.tensor_copy(dst=x[:, n0:n1], src=ps)
    return x


@nki.jit
def columns_kernel(xT, w):
    """Wrapper: xT HBM ``[P, J, T]``, w HBM ``[n_cores, P, J, Nc]`` (core c's columns ``[c*Nc, (c+1)*Nc)``)
    -> ``[n_cores, T, Nc]`` float32; concatenated over cores it is the full ``x W^T``."""
    n, c = program_sharding()
    _, J, T = xT.shape
    out = nl.ndarray((n, T, w.shape[3]), nl.float32, buffer=nl.shared_hbm, name="lin_cols")
    xs = nl.ndarray((P, J, T), xT.dtype, buffer=nl.sbuf, name="lin_xT")
    nisa.dma_copy(dst=xs, src=xT)
    y = columns_body(xs, w[c])
    nisa.dma_copy(dst=out[c], src=y)
    return out


def column_layout(weight, col0: int, n_cols: int) -> torch.Tensor:
    """Host: rows ``[col0, col0 + n_cols)`` of a PyTorch-layout weight ``[N_out, K]`` (torch or numpy)
    -> contraction-major ``[P, K/P, n_cols]`` (torch, same dtype)."""
    w = as_torch(weight)
    n_out, k = w.shape
    if k % P:
        raise ValueError(f"column_layout: contraction size {k} is not a multiple of {P}")
    if not (0 <= col0 and col0 + n_cols <= n_out):
        raise ValueError(f"column_layout: rows {col0}..{col0 + n_cols} outside the weight's {n_out}")
    return w[col0:col0 + n_cols].t().reshape(k // P, P, n_cols).permute(1, 0, 2).contiguous()
