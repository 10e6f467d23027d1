"""FR-Spec draft vocabulary in a round (``--draft-vocab``): the draft is the argmax of the MTP head's logits over
the subset only (lowest id on ties), the verify is the full-vocabulary one, so the decoded tokens equal plain
greedy decoding whatever the subset. Checked against the reference model for the megakernel and the xla variant."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from decoding import ReferenceDecoder, reference_greedy
from harness.speculative import generate, make_decoder
from model.params import random_params

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    params = random_params(tiny_cfg, seed=3, dtype=torch.float32)
    return tiny_cfg, params


def _mtp_logits(cfg, params):
    """(pending token, hidden, the MTP head's D1 logits [V]) of the prompt, from the reference model."""
    ref = ReferenceDecoder(cfg, params)
    first, h = ref.prefill(PROMPT, max_len=24)
    hm = ref.ref.mtp(torch.tensor([first]), h[None], ref.state, len(PROMPT) - 1)
    return first, h, ref.ref.logits(hm).reshape(-1).float()


def _subset_without_the_full_argmax(logits, n):
    """n ids (ascending) of high logits that exclude the full-vocabulary argmax: the subset's argmax differs."""
    order = torch.argsort(logits, descending=True, stable=True).tolist()
    return np.sort(np.array(order[1:n + 1], np.int32)), order[0], order[1]


@pytest.mark.parametrize("name", ["megakernel", "xla"])
def test_draft_is_the_argmax_over_the_subset_and_the_verify_is_unchanged(tiny, name):
    cfg, params = tiny
    first, h, logits = _mtp_logits(cfg, params)
    subset, full_best, sub_best = _subset_without_the_full_argmax(logits, 64)
    assert full_best not in subset and sub_best == int(subset[torch.argmax(logits[subset]).item()])
    v = make_decoder(name, cfg, params, tp=4, draft_ids=subset)
    first_v, h_v = v.prefill(PROMPT, max_len=24)
    assert first_v == first
    r = v.round(first_v, h_v, len(PROMPT))
    assert r.drafts == [sub_best]
    ref = ReferenceDecoder(cfg, params)
    f, hr = ref.prefill(PROMPT, max_len=24)
    want = ref.round(f, hr, len(PROMPT), forced_draft=sub_best)
    assert r.targets == want.targets and torch.isfinite(r.hidden).all() and r.hidden.abs().max() > 0.1


@pytest.mark.slow  # ~18 s: a 10-token flow; the default tier keeps the per-round check above
def test_tokens_equal_plain_greedy_with_a_small_draft_vocabulary(tiny):
    """Real MTP drafts over 32 ids of the 272: mostly rejected, yet the output is plain greedy decoding."""
    cfg, params = tiny
    n = 8
    plain = reference_greedy(cfg, params, PROMPT, n)
    subset = np.arange(0, 256, 8, dtype=np.int32)
    v = make_decoder("megakernel", cfg, params, tp=4, draft_ids=subset)
    res = generate(v, PROMPT, n, spec=True)
    assert res.tokens == plain and v.launches == res.rounds


def test_plan_refuses_an_uneven_draft_vocabulary(tiny):
    from megakernel import plan as rp
    cfg, _ = tiny
    with pytest.raises(ValueError, match="split evenly"):
        rp.round_plan(cfg, tp=4, draft_vocab=60)
    assert rp.round_plan(cfg, tp=4, draft_vocab=64).draft_vocab_per_core == 8
    assert rp.step_plan(cfg, tp=4).draft_vocab_per_core == 0
