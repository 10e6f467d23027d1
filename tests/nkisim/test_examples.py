"""Example kernels (tiled matmul, RMSNorm, softmax) against numpy, incl. LNC=2 and torch I/O."""
import ml_dtypes
import numpy as np
import pytest
import torch

import nkisim
from compare import assert_close
from nkisim_example_kernels import rmsnorm, softmax, tiled_matmul

BF16 = ml_dtypes.bfloat16


def _bf(a):
    return a.astype(BF16)


def test_tiled_matmul_bf16(rng):
    K, M, N = 256, 256, 1024
    a, b = _bf(rng.standard_normal((K, M))), _bf(rng.standard_normal((K, N)))
    out = tiled_matmul(a, b)
    ref = a.astype(np.float32).T @ b.astype(np.float32)
    assert out.dtype == BF16 and out.shape == (M, N)
    # fp32 accumulation then one RNE rounding to bf16: within 1 bf16 ulp (2^-8 relative)
    assert_close(out.astype(np.float32), ref, rtol=2 ** -8, atol=1e-2)
    assert np.abs(out.astype(np.float32)).max() > 1


def test_rmsnorm_bf16(rng):
    T, H = 4, 2048
    x, w = _bf(rng.standard_normal((T, H))), _bf(rng.standard_normal(H))
    out = rmsnorm(x, w, 1e-6).astype(np.float32)
    xf = x.astype(np.float32)
    ref = xf / np.sqrt((xf ** 2).mean(-1, keepdims=True) + 1e-6) * w.astype(np.float32)
    assert_close(out, ref, rtol=1e-2, atol=1e-2)   # bf16 output (8-bit mantissa)
    assert np.abs(out).max() > 0.5


@pytest.mark.parametrize("lnc", [1, 2])
def test_softmax_lnc(rng, lnc):
    x = rng.standard_normal((256, 300)).astype(np.float32) * 4
    k = softmax if lnc == 1 else softmax[2]
    out = k(x)
    e = np.exp(x - x.max(-1, keepdims=True))
    assert_close(out, e / e.sum(-1, keepdims=True), rtol=1e-5, atol=1e-7)


def test_torch_io_bf16(rng):
    x = torch.randn(128, 64, dtype=torch.bfloat16)
    out = softmax(x)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.bfloat16
    ref = torch.softmax(x.float(), -1)
    torch.testing.assert_close(out.float(), ref, rtol=1e-2, atol=1e-3)
