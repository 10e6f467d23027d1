"""Greedy speculative decoding is lossless, and the decode state stays that of plain decoding.

Draft sources stand in for the MTP head: always right (the plain greedy token),
always wrong, random; a hypothesis property drives arbitrary accept/reject sequences
and compares the full decode state (KV rows, committed GDN conv window and recurrent
state, MTP KV rows) of the xla variant (the tensor-parallel twins, harness.xla) with
token-by-token decoding of the committed tokens by the single-device reference model.
Tolerance: fp32, 1e-5 absolute -- the two paths run the same math but batch projections
differently (T=2 verify vs T=1 steps) and sum the TP partials in fp32 (measured ~1e-6).
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decoding import forced_rounds, reference_decode_state, reference_greedy
from harness.speculative import SlotBook, accepted_count, generate, make_decoder
from model.params import random_params

N_NEW = 24


@pytest.fixture(scope="module")
def setup(small_cfg):
    params = random_params(small_cfg, seed=2, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    plain = reference_greedy(small_cfg, params, prompt, N_NEW)
    return small_cfg, params, prompt, plain


def xla(cfg, params, tp=2):
    return make_decoder("xla", cfg, params, tp=tp)


def next_greedy(prompt, plain):
    """Draft source that proposes the plain greedy token for the draft position (t+2)."""
    def source(seq):
        i = len(seq) - len(prompt) + 0  # index in `plain` of the token after the pending one
        return plain[i] if i < len(plain) else 0
    return source


@pytest.mark.parametrize("kind", ["right", "wrong", "random", "mtp"])
def test_lossless(setup, kind):
    cfg, params, prompt, plain = setup
    rng = random.Random(0)
    right = next_greedy(prompt, plain)
    source = {
        "right": right,
        "wrong": lambda seq: (right(seq) + 1) % cfg.vocab_size,
        "random": lambda seq: rng.randrange(cfg.vocab_size),
        "mtp": None,
    }[kind]
    res = generate(xla(cfg, params), prompt, N_NEW, spec=True, draft_source=source)
    assert res.tokens == plain
    assert all(a in (1, 2) for a in res.accepted_per_round)
    if kind == "right":
        assert res.acceptance_rate == 1.0 and res.tokens_per_round > 1.9
    if kind == "wrong":
        assert res.acceptance_rate == 0.0 and res.rounds == N_NEW - 1


def test_eos_stops_inside_a_round(setup):
    cfg, params, prompt, plain = setup
    eos = plain[5]
    first = plain.index(eos)
    res = generate(xla(cfg, params), prompt, N_NEW, eos_ids=(eos,), spec=True,
                   draft_source=next_greedy(prompt, plain))
    assert res.tokens == plain[:first + 1]


def test_plain_decoding_is_the_reference(setup):
    cfg, params, prompt, plain = setup
    assert generate(xla(cfg, params), prompt, N_NEW, spec=False).tokens == plain


def test_slot_book_and_accept_rule():
    book = SlotBook()
    assert [book.commit(a) for a in (2, 1, 1, 2, 2, 1)] == [1, 0, 0, 1, 1, 0]
    for bad in (0, 3):
        with pytest.raises(ValueError, match="1..2"):
            book.commit(bad)
    book.reset()
    assert book.read_slot == 0
    assert accepted_count(5, [5, 9]) == 2 and accepted_count(4, [5, 9]) == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(accepts=st.lists(st.booleans(), min_size=1, max_size=8))
def test_state_after_rounds_equals_plain_decoding(setup, accepts):
    cfg, params, prompt, plain = setup
    v = xla(cfg, params, tp=1)
    seq, pos = forced_rounds(v, prompt, plain, accepts, cfg.vocab_size)
    assert seq[len(prompt):] == plain[:len(seq) - len(prompt)]
    got = v.committed(pos)
    want = reference_decode_state(cfg, params, seq[:-1])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)
