"""The kernel variants (megakernel, layerwise) against the PyTorch reference, run under nkisim.

* Tokens: the megakernel and the layerwise variant produce the tokens of plain greedy decoding (the reference
  model), float32 and bfloat16 (the shipped default dtype).
* One round: draft, both targets, the next hidden, every GDN checkpoint slot and the KV rows written match the
  single-device reference model's round (tests/decoding.py). Tolerances (float32 weights): the kernels
  accumulate in fp32 in another order than torch (PSUM, fixed collective order) -> 1e-4 absolute on O(1)
  hiddens, states and KV rows (measured ~1e-6).
* The decode-state invariant after many rounds with forced accepts and rejects.
* The megakernel runs exactly one launch per round.

The tiny preset runs at TP=4 x LNC=2 (one simulated trn2 chip) and TP=1 x LNC=2. nkisim interprets every
instruction of 8 cores, so these tests keep the number of rounds small; the longer sweeps are marked slow.
"""

from __future__ import annotations

import pytest
import torch

from decoding import (alternating, assert_round_matches_reference, forced_rounds, reference_decode_state,
                      reference_greedy)
from harness.speculative import generate, make_decoder
from model.params import random_params

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    params = random_params(tiny_cfg, seed=3, dtype=torch.float32)
    return tiny_cfg, params


# the megakernel at TP=4 is in the slow tier (its tokens: test_bf16_megakernel_tokens_equal_plain_greedy, the forced-round
# state invariant and the NxDI flow in the default tier; TP=1: the device-commit tests); the layerwise variant stays
@pytest.mark.parametrize("name,tp", [pytest.param("megakernel", 4, marks=pytest.mark.slow), ("layerwise", 4),
                                     pytest.param("megakernel", 1, marks=pytest.mark.slow)])
def test_tokens_equal_plain_greedy(tiny, name, tp):
    cfg, params = tiny
    n = 10
    plain = reference_greedy(cfg, params, PROMPT, n)
    v = make_decoder(name, cfg, params, tp=tp)
    res = generate(v, PROMPT, n, spec=True, draft_source=alternating(PROMPT, plain, cfg.vocab_size))
    assert res.tokens == plain
    assert 1 in res.accepted_per_round and 2 in res.accepted_per_round
    if name == "megakernel":
        assert v.launches == res.rounds  # one launch per round, prefill on the host


def test_bf16_megakernel_tokens_equal_plain_greedy():
    """The shipped default end to end: the embedded tiny checkpoint in bf16 (weights and activations) on TP=4 x
    LNC=2, both accept paths, against plain greedy decoding of the single-device reference model. (Random bf16
    weights are not used: their logits tie within bf16 rounding so often that any two correct implementations
    part ways after a few tokens; the trained checkpoint's margins are the realistic case.)"""
    from harness.decode import EMBEDDED_MODEL
    from model.weights import load_checkpoint
    cfg, params = load_checkpoint(EMBEDDED_MODEL, dtype=torch.bfloat16)
    prompt = list(b"class Stack:\n    def __init__(self):\n        ")     # the byte-level vocabulary: ids = bytes
    plain = reference_greedy(cfg, params, prompt, 10)
    assert len(set(plain)) > 3                              # a non-trivial continuation
    v = make_decoder("megakernel", cfg, params, tp=4)
    res = generate(v, prompt, 10, draft_source=alternating(prompt, plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == res.rounds


def test_round_matches_the_reference_round(tiny):
    cfg, params = tiny
    assert_round_matches_reference(cfg, params, PROMPT)


def test_state_invariant_after_forced_rounds(tiny):
    """Rounds with a fixed pattern of accepts (draft right) and rejects (draft wrong): afterwards the
    committed kernel state equals token-by-token decoding of the committed tokens."""
    cfg, params = tiny
    pattern = [True, False, False, True, True, False]
    plain = reference_greedy(cfg, params, PROMPT, 2 * len(pattern) + 2)
    v = make_decoder("megakernel", cfg, params, tp=4)
    seq, pos = forced_rounds(v, PROMPT, plain, pattern, cfg.vocab_size)
    assert seq[len(PROMPT):] == plain[:len(seq) - len(PROMPT)]
    want = reference_decode_state(cfg, params, seq[:-1])
    got = v.committed(pos)
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("prompt", [PROMPT, [1, 2, 3], [200, 100, 50, 25, 12, 6, 3, 1, 0, 271]])
def test_three_variants_identical_48_tokens(tiny, tp, prompt):
    cfg, params = tiny
    plain = reference_greedy(cfg, params, prompt, 48)
    for name in ("xla", "layerwise", "megakernel"):
        assert generate(make_decoder(name, cfg, params, tp=tp), prompt, 48).tokens == plain, name


@pytest.mark.slow
def test_state_invariant_after_20_rounds(tiny):
    cfg, params = tiny
    plain = reference_greedy(cfg, params, PROMPT, 44)
    for name in ("layerwise", "megakernel"):
        v = make_decoder(name, cfg, params, tp=4)
        seq, pos = forced_rounds(v, PROMPT, plain, [i % 3 > 0 for i in range(20)], cfg.vocab_size)
        want = reference_decode_state(cfg, params, seq[:-1])
        got = v.committed(pos)
        for key in want:
            torch.testing.assert_close(got[key].float(), want[key].float(), rtol=0, atol=1e-4, msg=f"{name} {key}")
