"""The tensor-parallel attention twin (model/tp/attention.py) against the reference mixer.

The sum over ranks of ``attention_rank`` partials must equal ``ReferenceModel.attention_mixer``, and
every rank's cache rows must equal the reference cache rows of the KV heads it holds.

Tolerances: float32 -- the only difference is the order of the o_proj sum (per-rank partials, then
a sum over ranks, vs one fp32 dot product): |err| <= 1e-5 * max|y| is ~100 x the fp32 rounding of a
128..4096-term dot product. bfloat16 -- the reference rounds the o_proj output to bf16 (half an ulp:
2^-9 relative) while the partials are summed in fp32; everything before o_proj is bit-identical
(same ops on the same bf16 tensors), so |err| <= 2^-8 * |y| + 1e-6 elementwise.
"""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from model.config import preset
from model.params import random_params
from model.reference import ReferenceModel
from model.tp.attention import attention_rank, kv_heads_of_rank, rank_cache, shard_attention


def _layer(cfg):
    return f"model.layers.{cfg.full_layers[0]}"


def _run(cfg, dtype, tp, start, T, seed=0, L=None):
    params = random_params(cfg, seed=seed, dtype=dtype, include_mtp=False)
    ref = ReferenceModel(cfg, params)
    g = torch.Generator().manual_seed(seed + 1)
    L = L or max(64, start + T + 3)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    shape = (cfg.num_key_value_heads, L, cfg.head_dim)
    k0 = torch.randn(shape, generator=g).to(dtype)
    v0 = torch.randn(shape, generator=g).to(dtype)
    kr, vr = k0.clone(), v0.clone()
    want = ref.attention_mixer(_layer(cfg), x, (kr, vr), start)
    total = torch.zeros(T, cfg.hidden_size)
    for r in range(tp):
        sh = shard_attention(params, _layer(cfg), cfg, r, tp)
        kc, vc = rank_cache(k0, sh), rank_cache(v0, sh)
        part, kc, vc = attention_rank(sh, x, kc, vc, start, cfg)
        total += part
        h0, nk = sh["kv_head"], sh["num_kv_heads"]
        assert torch.equal(kc, kr[h0:h0 + nk]), f"rank {r}: K cache differs from the reference"
        assert torch.equal(vc, vr[h0:h0 + nk]), f"rank {r}: V cache differs from the reference"
    return want, total


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("start,T", [(0, 1), (5, 2), (30, 4)])
def test_sum_of_ranks_equals_reference(tp, dtype, start, T):
    cfg = preset("tiny")
    want, got = _run(cfg, dtype, tp, start, T)
    if dtype == torch.float32:
        assert_close(got, want, rel=1e-5)
    else:
        assert_close(got, want, rtol=2 ** -8, atol=1e-6)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_other_small_config(small_cfg, tp):
    """One KV head, partial rotary 0.5, head dim 32: the KV head is replicated on every rank."""
    want, got = _run(small_cfg, torch.float32, tp, 7, 3)
    assert_close(got, want, rel=1e-5)


def test_kv_head_assignment():
    real = preset("qwen3.6-35b-a3b")
    assert [kv_heads_of_rank(real, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert kv_heads_of_rank(real, 0, 1) == (0, 2)
    tiny = preset("tiny")
    assert [kv_heads_of_rank(tiny, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    assert [kv_heads_of_rank(tiny, r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    with pytest.raises(ValueError, match="does not divide"):
        kv_heads_of_rank(tiny, 0, 3)


def test_shard_shapes_real():
    cfg = preset("qwen3.6-35b-a3b")
    from model.params import expected_shapes
    shapes = expected_shapes(cfg, include_mtp=False)
    pre = _layer(cfg)     # only one layer's attention tensors
    params = {k: torch.zeros(v, dtype=torch.bfloat16) for k, v in shapes.items() if k.startswith(pre + ".self_attn")}
    sh = shard_attention(params, pre, cfg, 3, 4)
    assert sh["q_proj"].shape == (4 * 2 * 256, 2048)
    assert sh["k_proj"].shape == sh["v_proj"].shape == (256, 2048)
    assert sh["o_proj"].shape == (2048, 4 * 256)
    assert (sh["num_heads"], sh["kv_head"], sh["num_kv_heads"]) == (4, 1, 1)
