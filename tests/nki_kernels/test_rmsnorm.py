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

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from compare import assert_close
from model.config import preset
from model.functional import rms_norm
from model.tp.norm import rmsnorm_rank
from nki_kernels.host import as_torch, feature_major
from nki_kernels.common import P, program_sharding
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


# ---- residual_rmsnorm_body: the residual update and the next norm from the all-reduce's two lanes ---------------

@nki.jit
def _residual_norm_kernel(y, x, w1, eps, S, rg, tp):
    """y: HBM [lnc, S*T, H/S] float32 this rank's per-core partials; x: [S*T, H/S] the residual (same on every
    core) -> per core (fused xT, two-step xT, two-step x'): ``residual_rmsnorm_body(x, lanes)`` against
    ``x' = x + combine_lanes(lanes)`` then ``rmsnorm_body(x')``."""
    from nki_kernels import collectives as cc
    from nki_kernels.rmsnorm import residual_rmsnorm_body, rmsnorm_body
    lnc, pid = program_sharding()
    R, W = x.shape
    T, H = R // S, W * S
    a_out = nl.ndarray((lnc, P, H // P, T), x.dtype, buffer=nl.shared_hbm, name="fused_xT")
    b_out = nl.ndarray((lnc, P, H // P, T), x.dtype, buffer=nl.shared_hbm, name="two_step_xT")
    x_out = nl.ndarray((lnc, R, W), x.dtype, buffer=nl.shared_hbm, name="two_step_x")
    y_sb = nl.ndarray((R, W), nl.float32, buffer=nl.sbuf, name="y")
    nisa.dma_copy(dst=y_sb, src=y[pid])
    x_sb = nl.ndarray((R, W), x.dtype, buffer=nl.sbuf, name="x")
    nisa.dma_copy(dst=x_sb, src=x)
    lanes = cc.allreduce_lanes(y_sb, rg)
    nisa.dma_copy(dst=a_out[pid], src=residual_rmsnorm_body(x_sb, lanes, w1, eps, stack=S))
    x_new = nl.ndarray((R, W), x.dtype, buffer=nl.sbuf, name="x_new")
    nisa.tensor_tensor(dst=x_new, data1=x_sb, data2=cc.combine_lanes(lanes), op=nl.add)
    nisa.dma_copy(dst=x_out[pid], src=x_new)
    nisa.dma_copy(dst=b_out[pid], src=rmsnorm_body(x_new, w1, eps, stack=S))
    return a_out, b_out, x_out


@pytest.mark.parametrize("tp, lnc, S, T", [(4, 2, 4, 2), (4, 2, 4, 1), (2, 2, 1, 3), (1, 2, 4, 4), (1, 1, 4, 2),
                                           (2, 1, 1, 1)])
def test_residual_norm_equals_add_then_norm(tp, lnc, S, T):
    """Bit for bit, on every core: the fused body (feature-major adds of the transposed lanes) and the residual's
    own adds followed by rmsnorm_body. Residual values of mixed magnitude so the bf16 rounding of x' matters."""
    from nki_kernels import collectives as cc
    H = 512
    rng = np.random.default_rng(100 * tp + 10 * lnc + S * T)
    g = torch.Generator().manual_seed(S * 10 + T)
    x = (3.0 * torch.randn(S * T, H // S, generator=g)).to(torch.bfloat16)
    w1 = rmsnorm_weight_layout(0.1 * torch.randn(H, generator=g))
    ys = [(rng.standard_normal((lnc, S * T, H // S)) * 10.0 ** rng.integers(-2, 1)).astype(np.float32)
          for _ in range(tp)]
    rg = cc.tp_group(tp)
    outs = nkisim.launch(_residual_norm_kernel, [(y, x, w1, 1e-6, S, rg, tp) for y in ys], tp=tp, lnc=lnc)
    first = None
    for r in range(tp):
        a, b, xn = (as_torch(o) for o in outs[r])
        assert torch.isfinite(a.float()).all() and a.float().abs().max() > 0.1
        assert not torch.equal(xn[0], x)                       # the partials moved the residual
        for c in range(lnc):
            assert torch.equal(a[c].view(torch.int16), b[c].view(torch.int16)), f"rank {r} core {c}"
            first = a[c] if first is None else first
            assert torch.equal(a[c].view(torch.int16), first.view(torch.int16))   # same bits on every core
