"""The tensor-parallel MoE twin (model/tp/moe.py): the sum over ranks of the partials is the
reference MoE block (ReferenceModel.moe), for tp = 1, 2, 4."""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from model import functional as fn
from model.params import random_params
from model.reference import ReferenceModel
from model.tp.moe import distinct_experts, intermediate_slice, moe_rank, shard_moe

PREFIX = "model.layers.1"


def _rank_sum(params, cfg, x, tp):
    return sum(moe_rank(shard_moe(params, PREFIX, cfg, r, tp), x, cfg.num_experts_per_tok) for r in range(tp))


def _x(cfg, T, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(T, cfg.hidden_size, generator=g).to(dtype)


@pytest.mark.parametrize("cfg_name", ["tiny_cfg", "small_cfg"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 3])
def test_rank_sum_equals_reference_fp32(request, cfg_name, tp, T):
    """float32: the rank split only reorders fp32 sums (the down projection's contraction is cut
    into tp pieces), so the sum matches to ~1e-6 relative; 1e-5 of the output scale allows it."""
    cfg = request.getfixturevalue(cfg_name)
    params = random_params(cfg, seed=3, dtype=torch.float32)
    x = _x(cfg, T, torch.float32)
    ref = ReferenceModel(cfg, params).moe(PREFIX, x)
    got = _rank_sum(params, cfg, x, tp)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert_close(got, ref, rel=1e-5)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_rank_sum_equals_reference_bf16(tiny_cfg, tp):
    """bfloat16: each rank rounds its slice of every expert's down projection to bf16 (the reference
    rounds the whole one once), so partial sums differ by a few bf16 roundings of each expert output:
    bound 2^-9 (bf16 unit roundoff) x (tp + 1) roundings x the sum of |contributions|; with <= 5
    experts of weight <= 1 per token plus the shared one we allow 2e-2 of the output scale, and the
    final bf16 cast of the reference adds 2^-9 relative."""
    cfg = tiny_cfg
    params = random_params(cfg, seed=5, dtype=torch.bfloat16)
    x = _x(cfg, 4, torch.bfloat16)
    ref = ReferenceModel(cfg, params).moe(PREFIX, x).float()
    got = _rank_sum(params, cfg, x, tp)
    assert_close(got, ref, rtol=2 ** -8, atol=2e-2 * float(ref.abs().max()))


def test_shard_slices_cover_the_intermediate(tiny_cfg):
    """Every intermediate column belongs to exactly one rank; router and gate are replicated."""
    cfg = tiny_cfg
    params = random_params(cfg, seed=0, dtype=torch.float32)
    tp = 4
    shards = [shard_moe(params, PREFIX, cfg, r, tp) for r in range(tp)]
    m = f"{PREFIX}.mlp"
    gu = params[f"{m}.experts.gate_up_proj"]
    inter = cfg.moe_intermediate_size
    torch.testing.assert_close(torch.cat([s["gate"] for s in shards], 1), gu[:, :inter], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s["up"] for s in shards], 1), gu[:, inter:], rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s["down"] for s in shards], 2), params[f"{m}.experts.down_proj"],
                               rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([s["shared_down"] for s in shards], 1),
                               params[f"{m}.shared_expert.down_proj.weight"], rtol=0, atol=0)
    for s in shards:
        assert s["router"] is params[f"{m}.gate.weight"]
        assert s["shared_expert_gate"] is params[f"{m}.shared_expert_gate.weight"]


def test_uneven_split_refused():
    with pytest.raises(ValueError, match="does not split evenly"):
        intermediate_slice(48, 0, 5)
    with pytest.raises(ValueError, match="outside"):
        intermediate_slice(48, 4, 4)


def test_router_ties_go_to_the_lower_index(tiny_cfg):
    """Two experts with identical router rows tie exactly; the lower index wins the last top-k seat,
    and the twin (route_tokens) agrees with functional.route."""
    cfg = tiny_cfg
    params = random_params(cfg, seed=2, dtype=torch.float32)
    x = _x(cfg, 2, torch.float32)
    w = params[f"{PREFIX}.mlp.gate.weight"]
    k = cfg.num_experts_per_tok
    order = torch.argsort(torch.nn.functional.linear(x[0], w), descending=True)
    a, b = int(order[k - 1]), int(order[k])           # the last seat and the first expert left out
    lo, hi = min(a, b), max(a, b)
    w = w.clone()
    w[hi] = w[lo]                                      # make them tie exactly at the boundary
    params = dict(params, **{f"{PREFIX}.mlp.gate.weight": w})
    shard = shard_moe(params, PREFIX, cfg, 0, 1)
    logits = torch.nn.functional.linear(x, w)
    assert logits[0, lo] == logits[0, hi]
    chosen = set(fn.route(logits, k)[1][0].tolist())
    assert lo in chosen and hi not in chosen
    assert set(distinct_experts(shard, x[:1], k)) == chosen
