"""columns_body (MTP fc) and token_major against torch.

Tolerances: float32 weights/activations -> 1e-5 relative to the output scale (only the summation
order differs from torch's); bfloat16 -> both sides accumulate bf16 products in fp32, so the same
bound holds up to fp32 summation order (1e-4 relative). token_major is bit-exact.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
from compare import assert_close
from nki_kernels.common import P
from nki_kernels.host import feature_major
from nki_kernels.linear import column_layout, columns_kernel, token_major


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lnc,T,K,N", [(1, 1, 256, 128), (2, 2, 256, 128), (2, 4, 4096, 2048)])
def test_columns_concatenate_to_linear(dtype, lnc, T, K, N):
    rng = np.random.default_rng(K + T)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = (rng.standard_normal((N, K)) / np.sqrt(K)).astype(np.float32)
    npdt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
    x, w = x.astype(npdt), w.astype(npdt)
    nc = N // lnc
    wl = torch.stack([column_layout(w, c * nc, nc) for c in range(lnc)])
    kern = columns_kernel[lnc] if lnc > 1 else columns_kernel
    cols = np.asarray(kern(feature_major(x), wl))
    assert cols.shape == (lnc, T, nc)
    got = np.concatenate(list(cols), axis=1)
    want = (torch.from_numpy(x.astype(np.float32)) @ torch.from_numpy(w.astype(np.float32)).T).numpy()
    assert np.abs(got).max() > 0.1
    assert_close(got, want, rel=1e-5 if dtype == "float32" else 1e-4, name="columns vs x @ w.T")


@nki.jit
def _roundtrip(xT):
    _, J, T = xT.shape
    xs = nl.ndarray(xT.shape, xT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    x = token_major(xs)
    out = nl.ndarray((T, J * P), xT.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=x)
    return out


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize("T,H", [(1, 128), (2, 2048), (4, 640)])
def test_token_major_is_exact(dtype, T, H):
    x = np.random.default_rng(T).standard_normal((T, H)).astype(np.float32).astype(dtype)
    got = np.asarray(_roundtrip(feature_major(x)))
    assert got.dtype == x.dtype and np.array_equal(got.view(np.uint8), x.view(np.uint8))
