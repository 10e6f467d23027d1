"""Device-side accept and commit (``plan.device_commit``, issue 15): rounds launched back to back, the host reading
only the emitted tokens, against the host-driven rounds of the same kernel and plain greedy decoding.

* Tokens: chained rounds give plain greedy's tokens, with forced accepts and rejects (the ``force`` input) and
  with the MTP head's own drafts; EOS and max tokens inside a 2-token round; a prompt of one token.
* State: after N chained rounds the decode state (GDN state and window at the read slot, trunk KV rows up to the
  position, MTP KV rows) and the control state (pending, read slot, position, hidden) equal the host-driven
  path's after the same rounds -- bit for bit: the same kernel instructions compute them, the RoPE rows come from
  a table of the same values (``nki_kernels.attention.rope_tables`` is elementwise in the position). The control
  state is int32 and in range on every rank and core; the hidden row is finite and not all zero.
* Refusals: mixed plans, other variants, bad control values (sampled chains: test_device_commit_sampled.py).

TP=1 x LNC=2 keeps these a few seconds each (nkisim interprets every core); the slow tier adds K = 2, the MTP
head's own drafts, a TP=4 x LNC=2 state check and the full-size trace.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl

from decoding import alternating, forced_accept, reference_greedy, right_draft
from harness.speculative import accepted_count, generate, make_decoder
from megakernel import plan as rp
from model.params import random_params

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


def chained(cfg, params, tp=1, drafts=1):
    return make_decoder("megakernel", cfg, params, tp=tp, drafts=drafts, device_commit=True)


def forced_rounds(decoder, prompt, plain, accepts, vocab_size, chain):
    """Prefill, then one round per entry of ``accepts`` (as ``decoding.forced_rounds``: that many drafts forced
    right, the next one forced wrong), host-driven (``chain`` False: the host accepts, commits and builds the next
    inputs) or device-committed (the host passes ``force`` only). Returns (prompt + committed tokens, position of
    the pending token, the host's h_{pos-1} (None when chained))."""
    K = decoder.drafts
    pending, hidden = decoder.prefill(prompt, max_len=len(prompt) + (K + 1) * len(accepts) + 2 * K + 2)
    seq, pos = prompt + [pending], len(prompt)
    if chain:
        decoder.start_chain(pending, hidden, pos)
        hidden = None
    for accept in accepts:
        right, forced = forced_accept(accept, K, plain, len(seq) - len(prompt), vocab_size)
        if chain:
            out = decoder.chained_round(forced).emitted
        else:
            r = decoder.round(seq[-1], hidden, pos, forced)
            n = accepted_count(r.drafts, r.targets)
            decoder.commit(n)
            out, hidden = r.targets[:n], r.hidden[n - 1]
        assert len(out) == right + 1, f"forced {right} right drafts, {len(out)} tokens committed"
        seq += out
        pos += len(out)
    return seq, pos, hidden


def check_control(engine, pos, slots, vocab_size):
    """Every rank's and core's control entry: int32, equal, in range; the hiddens finite, not all zero, equal."""
    rows = torch.stack([c["control"] for c in engine.controls])
    assert rows.dtype == torch.int32 and rows.shape == (engine.tp, engine.lnc, 3)
    assert (rows == rows[0, 0]).all()
    pending, slot, p = (int(v) for v in rows[0, 0])
    assert 0 <= pending < vocab_size and 0 <= slot < slots and p == pos
    hid = torch.stack([c["control_hidden"] for c in engine.controls])
    assert torch.isfinite(hid).all() and hid.abs().max() > 0.1 and (hid == hid[0, 0]).all()


@pytest.mark.parametrize("drafts", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_chained_tokens_equal_plain_greedy(tiny, drafts):
    """Forced drafts cycling through every accept length 0..K (the ``force`` input), the device deciding."""
    cfg, params = tiny
    n = 7
    plain = reference_greedy(cfg, params, PROMPT, n)
    v = chained(cfg, params, drafts=drafts)
    res = generate(v, PROMPT, n, draft_source=alternating(PROMPT, plain, cfg.vocab_size, drafts))
    assert res.tokens == plain
    assert set(res.accepted_per_round) == set(range(1, drafts + 2))
    assert v.launches == res.rounds                 # one launch per round, prefill on the host


@pytest.mark.slow
def test_chained_mtp_drafts_equal_host_driven(tiny):
    """The MTP head's own drafts: the chained rounds commit what the host-driven rounds commit."""
    cfg, params = tiny
    n = 8
    host = generate(make_decoder("megakernel", cfg, params, tp=1), PROMPT, n)
    dev = generate(chained(cfg, params), PROMPT, n)
    assert dev.tokens == host.tokens == reference_greedy(cfg, params, PROMPT, n)
    assert dev.accepted_per_round == host.accepted_per_round


@pytest.mark.parametrize("drafts,tp,pattern", [(1, 1, [True, False, True]),
                                               pytest.param(2, 1, [2, 0, 1, 2], marks=pytest.mark.slow),
                                               pytest.param(1, 4, [True, False, True], marks=pytest.mark.slow)])
def test_state_after_chained_rounds_equals_host_driven(tiny, drafts, tp, pattern):
    cfg, params = tiny
    plain = reference_greedy(cfg, params, PROMPT, (drafts + 1) * len(pattern) + 2)
    host = make_decoder("megakernel", cfg, params, tp=tp, drafts=drafts)
    seq_h, pos_h, hidden_h = forced_rounds(host, PROMPT, plain, pattern, cfg.vocab_size, chain=False)
    dev = chained(cfg, params, tp=tp, drafts=drafts)
    seq_d, pos_d, _ = forced_rounds(dev, PROMPT, plain, pattern, cfg.vocab_size, chain=True)
    assert seq_d == seq_h and pos_d == pos_h
    assert seq_d[len(PROMPT):] == plain[:len(seq_d) - len(PROMPT)]
    ctl = dev.engine.control()
    assert (ctl["pending"], ctl["read_slot"], ctl["pos"]) == (seq_h[-1], host.slots.read_slot, pos_h)
    assert torch.equal(ctl["hidden"], hidden_h.to(ctl["hidden"].dtype))
    check_control(dev.engine, pos_h, drafts + 1, cfg.vocab_size)
    want, got = host.committed(pos_h), dev.committed(pos_d)
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # and the next round (the MTP head's drafts) from either state
    nxt_h, nxt_d = host.round(seq_h[-1], hidden_h, pos_h), dev.chained_round()
    assert (nxt_d.drafts, nxt_d.targets) == (nxt_h.drafts, nxt_h.targets)
    assert torch.equal(nxt_d.hidden, nxt_h.hidden)
    assert nxt_d.emitted == nxt_h.targets[:accepted_count(nxt_h.drafts, nxt_h.targets)]


def test_eos_and_max_tokens_inside_a_two_token_round(tiny):
    cfg, params = tiny
    plain = reference_greedy(cfg, params, PROMPT, 6)
    right = right_draft(PROMPT, plain)
    # every round commits 2 tokens; max tokens 4 = the first token + one round + half of the next one
    res = generate(chained(cfg, params), PROMPT, 4, draft_source=right)
    assert res.tokens == plain[:4] and res.accepted_per_round == [2, 2]
    # EOS as the first token of the first round's two: the second is dropped
    res = generate(chained(cfg, params), PROMPT, 6, eos_ids=(plain[1],), draft_source=right)
    assert res.tokens == plain[:2] and res.accepted_per_round == [2]


@pytest.mark.parametrize("prefill", ["host", pytest.param("teacher-forced", marks=pytest.mark.slow)])
def test_prompt_of_one_token(tiny, prefill):
    """pos = 1: the first round's draft runs at position 0 (the MTP cache is empty), RoPE rows 0 .. K + 1; the
    prefill on the host (state handed over) or through the decode launches (one step launch)."""
    cfg, params = tiny
    prompt = [7]
    plain = reference_greedy(cfg, params, prompt, 6)
    v = chained(cfg, params)
    if prefill == "teacher-forced":
        v.reference = None
    res = generate(v, prompt, 6, draft_source=alternating(prompt, plain, cfg.vocab_size))
    assert res.tokens == plain and 2 in res.accepted_per_round and 1 in res.accepted_per_round


def test_refusals(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="megakernel variant only"):
        make_decoder("xla", cfg, params, tp=1, device_commit=True)
    with pytest.raises(ValueError, match="a round's"):
        rp.plan_for(cfg, "step", 1, 2, device_commit=True)
    h = torch.ones(cfg.hidden_size)
    for kw, msg in ((dict(pos=0), "position must be >= 1"), (dict(read_slot=2), "read_slot must be in 0..1"),
                    (dict(pending=cfg.vocab_size), "outside the vocabulary")):
        args = {"pending": 1, "pos": 3, "read_slot": 0, **kw}
        with pytest.raises(ValueError, match=msg):
            rp.control_state(cfg, torch.float32, args["pending"], h, args["pos"], args["read_slot"])
    st = rp.control_state(cfg, torch.bfloat16, 9, h, 3, 1, lnc=2)
    assert st["control"].dtype == np.int32 and st["control"].tolist() == [[9, 1, 3], [9, 1, 3]]
    assert st["control_hidden"].dtype == torch.bfloat16 and st["control_hidden"].shape == (2, 2, cfg.hidden_size)
    assert (st["control_hidden"] == 1).all()
    v = chained(cfg, params)
    with pytest.raises(ValueError, match="start_chain first"):
        v.chained_round()


def test_kernel_refuses_a_mixed_launch(tiny):
    """A device-committed plan without its control state (or with host inputs) is refused before any
    instruction."""
    import nkisim
    from megakernel.round import KERNELS
    cfg, params = tiny
    v = make_decoder("megakernel", cfg, params, tp=1)
    v.prefill(PROMPT, 16)
    e = v.engine
    plan = rp.plan_for(cfg, "round", 1, 2, device_commit=True)
    host_inputs = rp.round_inputs(cfg, e.dtype, 1, torch.zeros(cfg.hidden_size), len(PROMPT), 0)
    names = rp.kernel_weights("round") + rp.EXPERTS
    args = {"plan": plan, **{k: e.weights[0][k] for k in names if k in e.weights[0]}, **e.states[0], **host_inputs}
    with nkisim.trace.capture() as tr, pytest.raises(Exception, match="device-committed plan"):
        nkisim.launch(KERNELS["round"], [args], tp=1, lnc=2)
    assert not tr.instructions


class _Control(nl.NKIObject):
    """The two control tensors ``round.commit`` writes (the fields of ``round.LaunchTensors`` it reads)."""

    def __init__(self, control, control_hidden):
        self.control, self.control_hidden = control, control_hidden


@nki.jit
def _commit_kernel(plan, drafts, targets, hidden, pos, control, control_hidden):
    """``round.commit`` alone on one core: HBM drafts [K, 1], targets [T, 1] int32, hidden [T, H], pos [1, 1] ->
    (emitted [1, T + 1] int32, control, control_hidden)."""
    from megakernel.round import commit
    K, T = drafts.shape[0], targets.shape[0]
    d = nl.ndarray((K, 1), nl.int32, buffer=nl.sbuf, name="d")
    y = nl.ndarray((T, 1), nl.int32, buffer=nl.sbuf, name="y")
    h = nl.ndarray(hidden.shape, hidden.dtype, buffer=nl.sbuf, name="h")
    p = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="p")
    nisa.dma_copy(dst=d, src=drafts)
    nisa.dma_copy(dst=y, src=targets)
    nisa.dma_copy(dst=h, src=hidden)
    nisa.dma_copy(dst=p, src=pos)
    out = nl.ndarray((1, T + 1), nl.int32, buffer=nl.shared_hbm, name="emitted")
    nisa.dma_copy(dst=out, src=commit(plan, _Control(control, control_hidden), d, y, h, p, 0))
    return out, control, control_hidden


@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_commit_is_the_accept_rule_for_every_match_pattern(tiny_cfg, drafts):
    """Every pattern of draft == target matches (also a later match after a mismatch, which must not count), ids
    near the top of Qwen3.6's vocabulary (fp32 selection exact below 2^24): the control row is (y_n, n, pos + n + 1)
    with n = ``accepted_count`` - 1 -- the host's rule, which is also the accept of the shared-Gumbel sampled
    rounds (harness.sampling: drafts and targets are Gumbel-max tokens, accept stays this equality test) -- the
    hiddens (the next round reads row n), the emitted row (n + 1, y_0 .. y_K)."""
    K, T, H = drafts, drafts + 1, 256
    plan = rp.round_plan(tiny_cfg, tp=1, lnc=1, drafts=K, device_commit=True)
    rng = np.random.default_rng(K)
    for pattern in range(2 ** K):
        y = rng.integers(248_000, 248_320, size=T).astype(np.int32)
        d = np.array([y[j] if pattern >> j & 1 else y[j] + 1 for j in range(K)], np.int32)
        hidden = torch.randn(T, H, generator=torch.Generator().manual_seed(pattern))
        pos = 1000 + pattern
        control = np.full((1, 3), -7, np.int32)
        control_hidden = torch.zeros(1, T, H)
        emitted, _, _ = _commit_kernel(plan, d.reshape(K, 1), y.reshape(T, 1), hidden,
                                       np.array([[pos]], np.int32), control, control_hidden)
        n = accepted_count(d.tolist(), y.tolist()) - 1
        assert control.tolist() == [[int(y[n]), n, pos + n + 1]], pattern
        assert torch.equal(control_hidden[0], hidden)       # the next round reads row n (the read slot)
        assert np.asarray(emitted).tolist() == [[n + 1] + y.tolist()]


@pytest.mark.slow
def test_full_size_device_committed_round_traces_with_real_trip_counts():
    """The device-committed round at full size (TP=4 x LNC=2, ctx 2048, shape-only) under the strict rules, as
    tests/megakernel/test_round_full_size.py checks the host-driven one: the position reaches the stages from the
    control state (a real int32 input), so the attention loops run the same trip counts."""
    from harness.kernel_cases import round_case
    from model.config import preset
    from nki_kernels.attention import tile_loop_trips
    context = 2048
    case = round_case(preset("qwen3.6-35b-a3b"), context=context, device_commit=True)
    assert case.plan.device_commit and case.per_rank[0]["pos"] is None
    tr = case.trace()
    assert len(tr.instructions) > 200_000
    want = [tile_loop_trips(context - 1)] + [tile_loop_trips(context)] * 10     # D1, V (D2: K / V rows only)
    for rank in range(4):
        for core in range(2):
            att = [lp["trips"] for lp in tr.loops
                   if lp["rank"] == rank and lp["inst"] == core and lp["loc"].startswith("attention.py")]
            n = len(want[0])        # runtime loops per attention call
            assert [tuple(att[i:i + n]) for i in range(0, len(att), n)] == want, (rank, core)


def test_teacher_forced_prefill_hands_over_read_slot_1(tiny):
    """A 5-token prompt through the decode launches ends on a round committing 2 tokens: the chain starts from
    checkpoint slot 1 (seeded once by the host), and the tokens stay plain greedy's."""
    cfg, params = tiny
    prompt = [7, 8, 9, 10, 11]
    assert rp.teacher_forced_launches(len(prompt))[-1].accepted == 2
    plain = reference_greedy(cfg, params, prompt, 5)
    v = chained(cfg, params)
    v.reference = None
    res = generate(v, prompt, 5, draft_source=alternating(prompt, plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round


@pytest.mark.slow
def test_chained_rounds_with_an_fr_spec_draft_vocabulary(tiny):
    """FR-Spec draft head (``draft_ids``) in device-committed rounds: the drafts come from the subset, the verify
    and the device's accept from the full head, so the tokens stay plain greedy's."""
    cfg, params = tiny
    n = 8
    plain = reference_greedy(cfg, params, PROMPT, n)
    subset = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 64, replace=False)).astype(np.int32)
    v = make_decoder("megakernel", cfg, params, tp=1, draft_ids=subset, device_commit=True)
    assert v.engine.plans["chain"].draft_vocab_per_core > 0
    res = generate(v, PROMPT, n)
    assert res.tokens == plain and v.launches == res.rounds
