"""Tensor-parallel GDN twin (model/tp/gdn.py) vs the full reference mixer.

The sum over ranks of ``gdn_rank``'s fp32 partials must equal ``ReferenceModel.gdn_mixer``'s output,
and the per-rank checkpoints (states, windows) must reassemble into the full ones.

Tolerances: the rank twins run exactly the reference's per-head math (same ops, same casts). The
windows are raw projections and come out **bit-identical** (asserted with rtol=atol=0); the fp32 states
are identical up to the BLAS rounding of a row-subset projection (an fp32 matmul of [C_rank, H] rows may
block its sums differently from the full [conv_dim, H] one: ~1 ulp, measured 1.8e-7 on O(1) states,
bound atol 1e-6). The output differs only in how
the out_proj contraction is summed: per rank in fp32, then across ranks in fp32, versus one fp32-
accumulated matmul over all value dims that the reference rounds to its dtype. float32: a different
summation order of ~4k O(0.01) products, bound 1e-5 absolute on O(0.1..1) outputs. bfloat16: the
reference output is bf16-rounded (relative half-ulp 2^-9 = 0.2 %), the twin's sum is not, so
atol = rtol = 1e-2 (measured max 7.5e-3 on outputs of magnitude 2.7: one bf16 half-ulp).
"""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from model.config import preset
from model.params import random_params
from model.reference import ReferenceModel
from model.tp.gdn import GdnDims, WEIGHT_NAMES, gather_windows, gdn_rank, shard_gdn, split_window

PREFIX = "model.layers.0"


def _layer_inputs(cfg, dtype, T, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    window = torch.randn(cfg.conv_window, cfg.conv_dim, generator=g).to(dtype)
    state = 0.5 * torch.randn(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                              generator=g)
    return x, window, state


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    dtype = getattr(torch, request.param)
    cfg = preset("tiny")
    return cfg, ReferenceModel(cfg, random_params(cfg, seed=3, dtype=dtype, include_mtp=False)), dtype


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_sum_of_rank_partials_is_the_mixer(model, tp, T):
    cfg, ref, dtype = model
    x, window, state = _layer_inputs(cfg, dtype, T, seed=10 * tp + T)
    out, windows, states = ref.gdn_mixer(PREFIX, x, window, state, chunked=False)
    dims = GdnDims.of(cfg, tp)
    parts, wins, sts = [], [], []
    for r in range(tp):
        w = shard_gdn(ref.p, PREFIX, cfg, r, tp)
        assert set(w) == set(WEIGHT_NAMES)
        h0 = r * dims.hv
        p, wr, sr = gdn_rank(dims, w, x, split_window(window, dims, r), state[h0:h0 + dims.hv])
        assert p.dtype == torch.float32 and p.shape == (T, cfg.hidden_size)
        assert wr.shape == (T, cfg.conv_window, dims.conv_dim) and sr.shape == (T, dims.hv, dims.dk, dims.dv)
        parts.append(p)
        wins.append(wr)
        sts.append(sr)
    total = torch.stack(parts).sum(0)
    assert total.abs().max() > 1e-2
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(total, out, rtol=tol, atol=tol, name="sum of rank partials vs reference")
    torch.testing.assert_close(torch.cat(sts, dim=1), states, rtol=0, atol=1e-6)
    torch.testing.assert_close(gather_windows(wins, dims), windows, rtol=0, atol=0)


def test_split_and_gather_windows_are_inverse():
    cfg = preset("tiny")
    dims = GdnDims.of(cfg, 4)
    w = torch.randn(3, cfg.conv_window, cfg.conv_dim)
    assert torch.equal(gather_windows([split_window(w, dims, r) for r in range(4)], dims), w)


def test_bad_tp_is_refused():
    with pytest.raises(ValueError, match="does not divide"):
        GdnDims.of(preset("tiny"), 3)
