"""Zero-centred RMSNorm kernel (nki_kernels/rmsnorm.py) vs ``model.functional.rms_norm`` (its twin,
``model.tp.norm``), in the feature-major output layout ``xT [128, H/128, T]``.

Tolerances. Kernel and reference compute the same fp32 expression ``(x * rsqrt(mean(x^2) + eps)) * (1 + w)``;
only the order of the H-term sum of squares differs (kernel: per-partition partial sums, then a PE sum
over partitions; torch: pairwise). float32: a few ulps, bound |k - r| <= 1e-5 |r| + 1e-6 (measured
<= 1e-6 absolute on O(1) outputs). bfloat16: the fp32 results agree to ~1e-7 relative and are rounded
once to bf16, so they are equal or, at a rounding boundary, one bf16 ulp apart: |k - r| <= 2^-7 |r|
(measured: all equal on the default cases).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nkisim
from compare import assert_close
from model.config import preset
from model.functional import rms_norm
from model.tp.norm import rmsnorm_rank
from nki_kernels.host import as_torch, feature_major
from nki_kernels.common import P
from nki_kernels.rmsnorm import rmsnorm_kernel, rmsnorm_weight_layout

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _tol(dtype):
    return (1e-5, 1e-6) if dtype == torch.float32 else (2.0 ** -7, 0.0)


def _run(x, w, eps, lnc):
    k = rmsnorm_kernel[2] if lnc == 2 else rmsnorm_kernel
    return k(x, rmsnorm_weight_layout(w), eps)


def _check(out, x, w, eps, lnc):
    ref = as_torch(feature_major(rmsnorm_rank(x, w, eps))).float()
    assert out.shape == (lnc,) + tuple(ref.shape) and out.dtype == x.dtype
    rtol, atol = _tol(x.dtype)
    for c in range(lnc):
        assert_close(out[c].float(), ref, rtol=rtol, atol=atol, name=f"core {c} vs twin")
    return ref


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("size", ["tiny", "real"])
def test_rmsnorm_matches_reference(size, T, lnc, dtype):
    cfg = preset("tiny" if size == "tiny" else "qwen3.6-35b-a3b")
    dt = DTYPES[dtype]
    g = torch.Generator().manual_seed(T * 10 + lnc)
    x = (3.0 * torch.randn(T, cfg.hidden_size, generator=g)).to(dt)
    w = (0.1 * torch.randn(cfg.hidden_size, generator=g)).to(dt)
    ref = _check(_run(x, w, cfg.rms_norm_eps, lnc), x, w, cfg.rms_norm_eps, lnc)
    assert ref.abs().max() > 0.1


@pytest.mark.parametrize("case", ["large", "tiny_values", "zero_row", "constant_row"])
def test_rmsnorm_stress(case):
    """Magnitudes far from 1 (the norm is scale-invariant up to eps), an all-zero token (output 0, no NaN:
    rsqrt(eps)) and a constant token."""
    cfg = preset("qwen3.6-35b-a3b")
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, cfg.hidden_size, generator=g)
    if case == "large":
        x = x * 1e4
    elif case == "tiny_values":
        x = x * 1e-2
    elif case == "zero_row":
        x[1] = 0.0
    else:
        x[0] = 2.5
    w = 0.1 * torch.randn(cfg.hidden_size, generator=g)
    out = _run(x, w, cfg.rms_norm_eps, 2)
    _check(out, x, w, cfg.rms_norm_eps, 2)
    if case == "zero_row":
        assert (out[:, :, :, 1] == 0).all()


def test_weight_is_one_plus_w():
    """w = 0 must be the identity norm (1 + w convention), not a zero output."""
    x = torch.randn(2, 128)
    out = _run(x, torch.zeros(128), 1e-6, 1)[0]
    expect = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out, as_torch(feature_major(expect)), rtol=1e-5, atol=1e-6)


def test_layout_helper_and_refusals():
    w = torch.arange(256, dtype=torch.float32)
    w1 = rmsnorm_weight_layout(w)
    assert w1.shape == (128, 2) and w1[5, 1] == 1 + w[128 + 5]
    with pytest.raises(ValueError, match="multiple of 128"):
        rmsnorm_weight_layout(torch.zeros(100))
    with pytest.raises(ValueError, match="token rows"):
        _run(torch.zeros(5, 128), torch.zeros(128), 1e-6, 1)


def shape_only_launch(cfg, T=2, dtype="bfloat16"):
    """(kernel, args) of one rank's input RMSNorm at the config's shapes, LNC=2, ``nkisim.ShapeDtype`` tensors
    (the norm is replicated on every rank and core: TP does not change the shapes)."""
    H = cfg.hidden_size
    return rmsnorm_kernel[2], (nkisim.ShapeDtype((T, H), dtype), nkisim.ShapeDtype((P, H // P), "float32"),
                               float(cfg.rms_norm_eps))


def test_trace_real_shapes():
    """Per core at H=2048: 17 PE (16 transposes + 1 partition sum), 3 ACT in one table group (the first warms
    the table from a GpSimd memset, independent of x), 3 DVE compute ops; HBM: x read (the wrapper's), 8 KiB of weight, xT written -- independent of T except x/xT."""
    cfg = preset("qwen3.6-35b-a3b")
    for T in (1, 4):
        kern, args = shape_only_launch(cfg, T=T)
        with nkisim.trace.capture() as tr:
            kern(*args)
        core0 = [r for r in tr.instructions if r["inst"] == 0]
        count = lambda e, op: sum(1 for r in core0 if r["engine"] == e and r["op"] == op)  # noqa: E731
        assert count("PE", "nc_matmul") == 17
        acts = [r["func"] for r in core0 if r["engine"] == "ACT"]
        assert acts == ["rsqrt", "square", "rsqrt"]
        warm = [r for r in core0 if r["engine"] == "ACT"][0]
        assert [r["name"] for r in warm["reads"]] == ["rms_act_warm"]     # reads nothing derived from x
        assert count("POOL", "memset") == 1
        assert count("DVE", "tensor_tensor") == 2 and count("DVE", "tensor_reduce") == 1
        w_bytes = sum(r["bytes"]["shared_hbm"]["read"] for r in core0
                      if r["op"] == "dma_copy" and r["reads"][0]["name"] == "arg1")
        assert w_bytes == 128 * 16 * 4
