"""fp8 draft head in a round (``draft_fp8``, ``nki_kernels.lm_head`` "fp8 draft head"): the drafts argmax the MTP
head's logits against the e4m3 codes of the head (one scale per core shard), the verify keeps the bf16 head, so the
decoded tokens equal plain greedy decoding whatever the drafts propose. bfloat16 tiny model (fp8 needs bf16
activations)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding import ReferenceDecoder, reference_greedy
from harness.sampling import Sampling
from harness.speculative import generate, make_decoder
from megakernel import plan as rp
from megakernel.sharded import rank_weights
from model.params import random_params
from model.tp import embed_head as eh
from nki_kernels.lm_head import quantize_head

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.bfloat16)


def test_round_with_the_fp8_draft_head_keeps_the_verify(tiny):
    """One round: the draft is some token, the targets are the reference round's with that draft forced."""
    cfg, params = tiny
    v = make_decoder("megakernel", cfg, params, tp=4, draft_fp8=True)
    first, h = v.prefill(PROMPT, max_len=24)
    r = v.round(first, h, len(PROMPT))
    assert len(r.drafts) == 1 and 0 <= r.drafts[0] < cfg.vocab_size
    ref = ReferenceDecoder(cfg, params)
    f, hr = ref.prefill(PROMPT, max_len=24)
    want = ref.round(f, hr, len(PROMPT), forced_draft=r.drafts[0])
    assert r.targets == want.targets and torch.isfinite(r.hidden).all() and r.hidden.abs().max() > 0.1


@pytest.mark.parametrize("subset", [None, pytest.param(np.arange(0, 256, 4, dtype=np.int32), marks=pytest.mark.slow)],
                         ids=["full", "fr-spec"])       # the combination with FR-Spec (~7 s) in the slow tier
def test_tokens_equal_plain_greedy_with_the_fp8_draft_head(tiny, subset):
    """Real MTP drafts through the fp8 head (alone and on an FR-Spec subset): the output is plain greedy decoding."""
    cfg, params = tiny
    n = 4
    plain = reference_greedy(cfg, params, PROMPT, n)
    v = make_decoder("megakernel", cfg, params, tp=4, draft_fp8=True, draft_ids=subset)
    res = generate(v, PROMPT, n, spec=True)
    assert res.tokens == plain and v.launches == res.rounds


def test_fp8_draft_head_weights(tiny):
    """rank_weights: draft_head holds each core shard's codes, draft_scale its scale in every row."""
    cfg, params = tiny
    w = rank_weights(cfg, params, 1, 4, 2, draft_fp8=True)
    assert w["draft_head"].dtype == torch.float8_e4m3fn and w["draft_head"].shape == w["lm_head"].shape
    assert "draft_ids" not in w and w["draft_scale"].shape == (2, 128, 1)
    codes, s = quantize_head(eh.shard_lm_head(params, cfg, 3, 8))
    assert torch.equal(w["draft_scale"][1, :, 0], s.expand(128)) and float(s) > 0
    assert rp.draft_weights(rp.round_plan(cfg, tp=4, draft_fp8=True)) == ("draft_head", "draft_scale")
    assert rp.draft_weights(rp.round_plan(cfg, tp=4, draft_vocab=64, draft_fp8=True)) == rp.DRAFT_VOCAB + (
        "draft_scale",)


def test_fp8_draft_head_bad_inputs(tiny_cfg, tiny):
    cfg, _ = tiny
    with pytest.raises(ValueError, match="fp8 draft head runs against bfloat16 activations; the checkpoint is "
                                         "torch.float32"):
        rank_weights(cfg, random_params(cfg, seed=3, dtype=torch.float32), 0, 4, 2, draft_fp8=True)
    with pytest.raises(ValueError, match="an fp8 draft head is a round's"):
        rp.plan_for(cfg, "step", tp=4, draft_fp8=True)
    with pytest.raises(ValueError, match="fp8 draft head runs in the megakernel variant only"):
        make_decoder("xla", cfg, tiny[1], tp=4, draft_fp8=True)


def test_sampled_tokens_do_not_depend_on_the_fp8_draft_head(tiny):
    """Gumbel-max sampling (shared noise per position): the fp8 head draws the drafts from its own logits plus the
    noise in the original units (``lm_head_argmax_body(w_scale=)``), the bf16 verify decides, so the sampled tokens
    equal those of the same run with the bf16 draft head; only the drafts (and so the acceptance) may differ."""
    cfg, params = tiny
    s = Sampling(1.0, seed=4)
    runs = []
    for fp8 in (False, True):
        v = make_decoder("megakernel", cfg, params, tp=1, draft_fp8=fp8)
        runs.append(generate(v, PROMPT, 8, spec=True, sampling=s))
    assert runs[1].tokens == runs[0].tokens and len(runs[0].tokens) == 8
    assert runs[0].tokens != reference_greedy(cfg, params, PROMPT, 8)        # a sample, not the greedy output
    acc = runs[1].accepted_per_round
    assert 1 <= min(acc) and max(acc) <= 2
    # the drafts are samples too: a draft that ignored the noise would rarely equal the sampled target
    assert sum(a - 1 for a in acc) >= len(acc) // 2
