"""The embedding / vocabulary-parallel LM head twins (model/tp/embed_head.py) against the reference model."""

from __future__ import annotations

import pytest
import torch

from compare import assert_finite_nonzero
from model.config import preset
from model.params import random_params
from model.reference import ReferenceModel
from model.tp import embed_head as eh

N_CORES = 8  # TP=4 ranks x LNC=2 physical cores


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    cfg = preset("tiny")
    return cfg, random_params(cfg, seed=3, dtype=request.param, include_mtp=False)


def _hidden(cfg, T, dtype, seed=0):
    return torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_split_argmax_equals_torch_argmax(tiny, T):
    cfg, p = tiny
    dtype = p["model.embed_tokens.weight"].dtype
    for seed in range(4):
        h = _hidden(cfg, T, dtype, seed)
        logits = ReferenceModel(cfg, p).logits(h)
        val, idx = eh.lm_head_argmax(p, cfg, h, N_CORES)
        assert torch.equal(idx, torch.argmax(logits, dim=-1))
        assert torch.equal(val, logits.max(dim=-1).values)
        assert_finite_nonzero(val, "max logit")


def test_small_config_other_splits(small_cfg):
    p = random_params(small_cfg, seed=1, dtype=torch.bfloat16, include_mtp=False)
    h = _hidden(small_cfg, 3, torch.bfloat16)
    ref = torch.argmax(ReferenceModel(small_cfg, p).logits(h), dim=-1)
    for n in (1, 2, 4):                       # vocab 300 splits over 1, 2 and 4 cores, not 8
        assert torch.equal(eh.lm_head_argmax(p, small_cfg, h, n)[1], ref)
    with pytest.raises(ValueError, match="does not split evenly over 8 cores"):
        eh.shard_lm_head(p, small_cfg, 0, 8)


def test_shards_tile_the_vocabulary(tiny):
    cfg, p = tiny
    shards = [eh.shard_lm_head(p, cfg, c, N_CORES) for c in range(N_CORES)]
    assert all(s.shape == (cfg.vocab_size // N_CORES, cfg.hidden_size) for s in shards)
    assert torch.equal(torch.cat(shards), p["lm_head.weight"])
    with pytest.raises(ValueError, match="core 8 outside"):
        eh.shard_lm_head(p, cfg, N_CORES, N_CORES)


def test_tied_embeddings_use_the_table():
    cfg = preset("tiny").replace(tie_word_embeddings=True)
    p = random_params(cfg, seed=2, dtype=torch.float32, include_mtp=False)
    assert "lm_head.weight" not in p
    h = _hidden(cfg, 2, torch.float32)
    ref = torch.argmax(ReferenceModel(cfg, p).logits(h), dim=-1)
    assert torch.equal(eh.lm_head_argmax(p, cfg, h)[1], ref)


def test_ties_lowest_index_wins_within_and_across_cores():
    """Equal maximal logits at several indices (same core and different cores): the lowest index wins,
    as torch.argmax does. Integer-valued data keeps every logit exact in both dtypes."""
    cfg = preset("tiny")
    vc = cfg.vocab_size // N_CORES
    for dtype in (torch.float32, torch.bfloat16):
        w = torch.zeros(cfg.vocab_size, cfg.hidden_size)
        w[:, 0] = torch.arange(cfg.vocab_size) % 5          # background logits 0..4 (h[0] = 1)
        top = 9.0
        cases = [
            (0, [3 * vc + 7, 3 * vc + 20]),                 # within one core
            (1, [6 * vc + 1, 2 * vc + 33, 5 * vc]),         # across cores: core 2 holds the lowest
            (2, [vc - 1, vc]),                              # last row of core 0 vs first of core 1
        ]
        h = torch.zeros(len(cases), cfg.hidden_size)
        for t, rows in cases:
            h[t, 0] = 1.0
            h[t, 1 + t] = 1.0
            w[rows, 1 + t] = top - w[rows, 0]               # those rows reach exactly `top` for token t
        p = {"lm_head.weight": w.to(dtype), "model.embed_tokens.weight": w.to(dtype)}
        logits = ReferenceModel(cfg, p).logits(h.to(dtype))
        val, idx = eh.lm_head_argmax(p, cfg, h.to(dtype))
        assert idx.tolist() == [min(rows) for _, rows in cases]
        assert torch.equal(idx, torch.argmax(logits, dim=-1))
        assert val.tolist() == [top] * len(cases)


def test_combine_argmax_order_and_offsets():
    vals = torch.tensor([[1.0, 5.0], [3.0, 5.0], [3.0, 2.0]])    # 3 cores x 2 tokens
    loc = torch.tensor([[4, 9], [0, 1], [7, 3]])
    v, i = eh.combine_argmax(vals, loc, vc=10)
    assert v.tolist() == [3.0, 5.0] and i.tolist() == [10, 9]


def test_embed_twin_and_id_refusal(tiny):
    cfg, p = tiny
    ids = torch.tensor([0, cfg.vocab_size - 1, 17])
    assert torch.equal(eh.embed(p, ids), ReferenceModel(cfg, p).embed(ids))
    for bad, pos in (([1, cfg.vocab_size], 1), ([-1], 0)):
        with pytest.raises(ValueError, match=rf"token id {bad[pos]} at position {pos} is outside"):
            eh.embed(p, torch.tensor(bad))
    with pytest.raises(TypeError, match="must be integers"):
        eh.embed(p, torch.tensor([1.0]))
