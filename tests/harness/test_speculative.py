"""Greedy speculative decoding is lossless, and the decode state stays that of plain decoding.

Rounds of K = 1, 2, 3 chained drafts. Draft sources stand in for the MTP head: always
right (the plain greedy tokens), always wrong, random (each draft right with probability
1/2, else a random token); a hypothesis property drives arbitrary accept lengths 0..K
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

from decoding import forced_rounds, reference_decode_state, reference_greedy, right_draft
from harness.speculative import DecodeResult, SlotBook, accepted_count, generate, make_decoder
from megakernel.plan import MAX_DRAFTS
from model.params import random_params

N_NEW = 24


@pytest.fixture(scope="module")
def setup(small_cfg):
    params = random_params(small_cfg, seed=2, dtype=torch.float32)
    prompt = [5, 17, 99, 3, 250, 41, 8]
    plain = reference_greedy(small_cfg, params, prompt, N_NEW)
    return small_cfg, params, prompt, plain


def xla(cfg, params, tp=2, drafts=1):
    return make_decoder("xla", cfg, params, tp=tp, drafts=drafts)


@pytest.mark.parametrize("drafts", range(1, MAX_DRAFTS + 1))
@pytest.mark.parametrize("kind", ["right", "wrong", "random", "mtp"])
def test_lossless(setup, kind, drafts):
    cfg, params, prompt, plain = setup
    rng = random.Random(drafts)
    right = right_draft(prompt, plain, drafts)
    source = {
        "right": right,
        "wrong": lambda seq: [(t + 1) % cfg.vocab_size for t in right(seq)],
        "random": lambda seq: [t if rng.random() < 0.5 else rng.randrange(cfg.vocab_size) for t in right(seq)],
        "mtp": None,
    }[kind]
    res = generate(xla(cfg, params, drafts=drafts), prompt, N_NEW, spec=True, draft_source=source)
    assert res.tokens == plain
    assert all(1 <= a <= drafts + 1 for a in res.accepted_per_round)
    assert len(res.acceptance_per_position) == drafts
    if kind == "right":
        assert res.acceptance_rate == 1.0 and res.acceptance_per_position == [1.0] * drafts
        assert res.rounds == -(-(N_NEW - 1) // (drafts + 1))
    if kind == "wrong":
        assert res.acceptance_rate == 0.0 and res.rounds == N_NEW - 1
    if kind == "random":
        assert len(set(res.accepted_per_round)) > 1


def test_eos_stops_inside_a_round(setup):
    cfg, params, prompt, plain = setup
    eos = plain[5]
    first = plain.index(eos)
    for drafts in (1, MAX_DRAFTS):
        res = generate(xla(cfg, params, drafts=drafts), prompt, N_NEW, eos_ids=(eos,), spec=True,
                       draft_source=right_draft(prompt, plain, drafts))
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
    assert SlotBook(4).commit(4) == 3
    assert accepted_count([5], [5, 9]) == 2 and accepted_count([4], [5, 9]) == 1
    assert accepted_count([5, 9, 2], [5, 9, 2, 7]) == 4        # every draft right: K + 1 tokens
    assert accepted_count([5, 8, 2], [5, 9, 2, 7]) == 2        # the prefix stops at the first wrong draft
    assert accepted_count([4, 9, 2], [5, 9, 2, 7]) == 1
    with pytest.raises(ValueError, match="2 drafts need 3 targets"):
        accepted_count([1, 2], [1, 2])


def test_metrics():
    r = DecodeResult(tokens=[1] * 9, drafts=3, accepted_per_round=[4, 1, 2, 3], round_seconds=[0.004, 0.001, 0.002,
                                                                                               0.003])
    assert r.rounds == 4 and r.tokens_per_round == 2.5 and r.acceptance_rate == 6 / 12
    assert r.acceptance_per_position == [0.75, 0.5, 0.25]
    assert r.round_time_percentiles() == {"p50": 2.0, "p90": 4.0, "p99": 4.0}
    d = r.to_dict()
    assert d["acceptance_per_position"] == [0.75, 0.5, 0.25] and d["num_draft_tokens"] == 3


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), drafts=st.integers(1, MAX_DRAFTS))
def test_state_after_rounds_equals_plain_decoding(setup, data, drafts):
    """Any sequence of accept lengths 0..K: the committed state equals plain decoding's."""
    cfg, params, prompt, plain = setup
    accepts = data.draw(st.lists(st.integers(0, drafts), min_size=1, max_size=5))
    v = xla(cfg, params, tp=1, drafts=drafts)
    seq, pos = forced_rounds(v, prompt, plain, accepts, cfg.vocab_size)
    assert seq[len(prompt):] == plain[:len(seq) - len(prompt)]
    got = v.committed(pos)
    want = reference_decode_state(cfg, params, seq[:-1])
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


@pytest.mark.parametrize("drafts", range(1, MAX_DRAFTS + 1))
@pytest.mark.parametrize("n", range(1, 10))
def test_teacher_forced_launches_cover_the_prompt_once(n, drafts):
    """Rounds of K + 1 tokens: every prompt position verified once, the MTP rows 0..n-2 written exactly as a
    prefill writes them (D1 row pos-1 from (x_pos, h_{pos-1}); D2 rows pos..pos+m-1 from the forced drafts)."""
    from megakernel.plan import PrefillLaunch, teacher_forced_launches
    plan = teacher_forced_launches(n, drafts)
    assert plan[0] == PrefillLaunch("step", 0, None, 1)
    assert len(plan) == 1 + -(-(n - 1) // (drafts + 1))
    verified, mtp_rows = [0], []
    for launch in plan[1:]:
        assert launch.mode == "round" and 1 <= launch.accepted <= drafts + 1
        verified += range(launch.pos, launch.pos + launch.accepted)
        mtp_rows.append(launch.pos - 1)
        if launch.forced is not None:
            assert launch.forced == launch.pos + 1
        mtp_rows += range(launch.pos, launch.pos + launch.accepted - 1)
    assert verified == list(range(n)) and mtp_rows == list(range(n - 1))


@pytest.mark.parametrize("drafts", [2, MAX_DRAFTS])
def test_teacher_forced_prefill_then_rounds(setup, drafts):
    """An engine without a host prefill (reference=None): the prompt goes through rounds of K + 1 forced tokens."""
    from harness.engines import make_engine
    from harness.speculative import Decoder
    cfg, params, prompt, plain = setup
    v = Decoder(make_engine("xla", cfg, params, tp=2, drafts=drafts))
    assert v.reference is None
    res = generate(v, prompt, 12, draft_source=right_draft(prompt, plain, drafts))
    assert res.tokens == plain[:12]
