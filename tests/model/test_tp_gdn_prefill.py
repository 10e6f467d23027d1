"""Prefill twin (model/tp/gdn_prefill.py) vs the reference model's own prefill (``gdn_mixer(chunked=True)``).

The sum over ranks of ``gdn_prefill_rank``'s fp32 partials must equal the reference output, the per-rank
final states and windows must reassemble into the reference's, and the chunked twin must agree with the
token-by-token decode twin over the same tokens (prefill and decode leave the same state).

Tolerances: the rank twins run the reference's per-head math with the same casts; windows are raw
projections of the rank's rows (bit-identical); the states differ by the BLAS rounding of a row-subset
projection (~1 ulp, atol 1e-5 on O(1) states after 130 tokens). Outputs: as in test_tp_gdn.py (fp32:
summation order, 1e-5; bf16: the reference rounds its output, the twin's fp32 partial does not, 1e-2).
Chunked vs recurrent: fp32 (the reference's own chunked-vs-recurrent bound, tests/model/test_gdn_forms.py:
2e-4 absolute on O(1) values).
"""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from model.config import preset
from model.params import random_params
from model.reference import ReferenceModel
from model.tp.gdn import GdnDims, gather_windows, gdn_rank, shard_gdn, split_window
from model.tp.gdn_prefill import gdn_prefill_rank

PREFIX = "model.layers.0"


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def model(request):
    dtype = getattr(torch, request.param)
    cfg = preset("tiny")
    return cfg, ReferenceModel(cfg, random_params(cfg, seed=3, dtype=dtype, include_mtp=False)), dtype


def _inputs(cfg, dtype, L, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(L, cfg.hidden_size, generator=g).to(dtype)
    window = torch.randn(cfg.conv_window, cfg.conv_dim, generator=g).to(dtype)
    state = 0.5 * torch.randn(cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                              generator=g)
    return x, window, state


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("L", [1, 65, 130])
def test_sum_of_rank_partials_is_the_prefill(model, tp, L):
    cfg, ref, dtype = model
    x, window, state = _inputs(cfg, dtype, L, seed=tp + L)
    out, wins, finals = ref.gdn_mixer(PREFIX, x, window, state, chunked=True)
    dims = GdnDims.of(cfg, tp)
    parts, ws, sts = [], [], []
    for r in range(tp):
        w = shard_gdn(ref.p, PREFIX, cfg, r, tp)
        h0 = r * dims.hv
        p, wr, sr = gdn_prefill_rank(dims, w, x, split_window(window, dims, r), state[h0:h0 + dims.hv])
        assert p.dtype == torch.float32 and p.shape == (L, cfg.hidden_size)
        assert wr.shape == (cfg.conv_window, dims.conv_dim) and sr.shape == (dims.hv, dims.dk, dims.dv)
        parts.append(p)
        ws.append(wr)
        sts.append(sr)
    assert out.abs().max() > 1e-3
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(sum(parts), out, rtol=tol, atol=tol, name="sum of rank partials vs reference")
    torch.testing.assert_close(gather_windows(ws, dims), wins[0], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat(sts), finals[0], rtol=0, atol=1e-5)


def test_prefill_state_equals_decode_state():
    """The chunked prefill twin and the token-by-token decode twin leave the same window and state."""
    cfg = preset("tiny")
    p = random_params(cfg, seed=5, dtype=torch.float32, include_mtp=False)
    dims = GdnDims.of(cfg, 2)
    w = shard_gdn(p, PREFIX, cfg, 1, 2)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(70, cfg.hidden_size, generator=g)
    window = torch.randn(cfg.conv_window, dims.conv_dim, generator=g)
    state = 0.5 * torch.randn(dims.hv, dims.dk, dims.dv, generator=g)
    part, win, st = gdn_prefill_rank(dims, w, x, window, state)
    part_d, wins_d, sts_d = gdn_rank(dims, w, x, window, state)
    assert st.abs().max() > 1e-3
    torch.testing.assert_close(win, wins_d[-1], rtol=0, atol=0)
    torch.testing.assert_close(st, sts_d[-1], rtol=0, atol=2e-4)
    torch.testing.assert_close(part, part_d, rtol=0, atol=2e-4)


def test_neg_eigval_doubles_beta():
    """allow_neg_eigval (beta = 2 sigmoid(b)) is the chunked delta rule with the doubled beta."""
    cfg = preset("tiny")
    p = random_params(cfg, seed=6, dtype=torch.float32, include_mtp=False)
    dims = GdnDims.of(cfg, 1)
    w = shard_gdn(p, PREFIX, cfg, 0, 1)
    x = torch.randn(20, cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    window = torch.zeros(cfg.conv_window, dims.conv_dim)
    state = torch.zeros(dims.hv, dims.dk, dims.dv)
    _, _, st1 = gdn_prefill_rank(dims, w, x, window, state)
    _, _, st2 = gdn_prefill_rank(dims, w, x, window, state, allow_neg_eigval=True)
    assert not torch.allclose(st1, st2)
    # with zero start state and no decay between writes, the first token's write doubles exactly
    _, _, s1 = gdn_prefill_rank(dims, w, x[:1], window, state)
    _, _, s2 = gdn_prefill_rank(dims, w, x[:1], window, state, allow_neg_eigval=True)
    torch.testing.assert_close(s2, 2 * s1, rtol=1e-6, atol=0)
