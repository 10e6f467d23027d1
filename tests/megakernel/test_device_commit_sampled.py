"""Sampled device-committed rounds (shared Gumbel noise, issue 15; the contract is in the ``megakernel.plan`` module
docstring): the round takes its noise rows from a noise window by the device's position, the host only keeps the
window ahead (``harness.speculative.NoiseBook``).

* Tokens: chained sampled rounds give the host-driven sampled rounds' tokens for the same seed, bit for bit: with
  the MTP head's own drafts (a reject and an accept), and, in the slow tier, with forced drafts cycling through every
  accept length at K = 1 and 2 (the committed tokens do not depend on the drafts); EOS and max tokens inside a
  2-token round.
* The window: 4 entries (the smallest at K = 1 that keeps the next two rounds' entries): the rounds start on slot
  3 = W - 1, then 0 (wrapped), then 2, and the window is refreshed at its end; a round reads its position's entry:
  given its neighbour's entry it samples differently (the check can fail), and with every other entry poisoned its
  tokens stay (slow tier).
* State: after the chained rounds the decode state and the control state equal the host-driven path's, bit for
  bit; the control state is int32, in range and equal on every rank and core.
* ``NoiseBook``: which start positions it writes when, the refresh at the window's end, bad windows refused.

TP=1 x LNC=2, three rounds or fewer per run, keep these a few seconds each.
"""

from __future__ import annotations

import pytest
import torch

from decoding import alternating, right_draft
from harness.sampling import GumbelNoise, Sampling
from harness.speculative import NoiseBook, generate, make_decoder
from megakernel import plan as rp
from model.params import random_params
from test_device_commit import check_control

PROMPT = [5, 17, 99, 3, 250, 41, 8]    # 7 tokens: the first round starts on slot 3 = W - 1 of a 4-entry window
S = Sampling(1.0, seed=4)
N = 5


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def host_run(tiny):
    """The host-driven sampled rounds, K = 1, the MTP head's drafts: (decoder, result); rounds commit 1, 2, 1."""
    cfg, params = tiny
    host = make_decoder("megakernel", cfg, params, tp=1)
    return host, generate(host, PROMPT, N, sampling=S)


def chained(cfg, params, drafts=1, window=4, tp=1):
    return make_decoder("megakernel", cfg, params, tp=tp, drafts=drafts, device_commit=True, noise_window=window)


def recorded(v):
    """Wrap a chained decoder so that it records each round's start position and the entries written (lists)."""
    starts, written = [], []
    run, write = v.chained_round, v.engine.write_noise

    def round_(forced=None):
        starts.append(v.chain_pos)
        return run(forced)

    def write_(noise, due):
        written.extend(due)
        write(noise, due)
    v.chained_round, v.engine.write_noise = round_, write_
    return starts, written


def check_same_state(host, dev, res, drafts):
    """Decode state and control state of the chained decoder equal the host-driven one's after ``res``."""
    cfg = dev.cfg
    pos = len(PROMPT) + sum(res.accepted_per_round)
    ctl = dev.engine.control()
    assert (ctl["pos"], ctl["read_slot"]) == (pos, host.slots.read_slot)
    check_control(dev.engine, pos, drafts + 1, cfg.vocab_size)
    a, b = host.committed(pos), dev.committed(pos)
    assert set(a) == set(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_chained_sampled_rounds_equal_host_driven(tiny, host_run):
    """The MTP head's drafts (rounds commit 1, 2, 1: a reject and an accept), a 4-entry window: same tokens, accepts,
    decode state and control state as the host-driven sampled rounds; the rounds start on slots 3 (= W - 1), 0
    (wrapped) and 2, and the window is refreshed when the position read reaches its end."""
    cfg, params = tiny
    host, want = host_run
    dev = chained(cfg, params)
    starts, written = recorded(dev)
    got = generate(dev, PROMPT, N, sampling=S)
    assert got.tokens == want.tokens and len(set(got.tokens)) > 1
    assert got.accepted_per_round == want.accepted_per_round == [1, 2, 1]
    assert dev.launches == got.rounds
    assert [rp.noise_slot(p, 4) for p in starts] == [3, 0, 2]
    assert written == list(range(7, 14)) and dev.noise_book.refreshes == 2     # 7 .. 10, then 11 .. 13 at p = 10
    check_same_state(host, dev, got, 1)


@pytest.mark.slow
@pytest.mark.parametrize("drafts", [1, 2])
def test_forced_accepts_and_rejects(tiny, host_run, drafts):
    """Forced drafts cycling through every accept length 0..K: the chained sampled rounds commit what the host-driven
    ones commit (the sampled tokens, whatever the drafts), with the same state."""
    cfg, params = tiny
    plain = host_run[1].tokens if drafts == 1 else None
    n = N if drafts == 1 else 6
    if plain is None:
        plain = generate(make_decoder("megakernel", cfg, params, tp=1, drafts=drafts), PROMPT, n + drafts,
                         sampling=S).tokens
    host = make_decoder("megakernel", cfg, params, tp=1, drafts=drafts)
    want = generate(host, PROMPT, n, sampling=S, draft_source=alternating(PROMPT, plain, cfg.vocab_size, drafts))
    dev = chained(cfg, params, drafts, window=8)
    got = generate(dev, PROMPT, n, sampling=S, draft_source=alternating(PROMPT, plain, cfg.vocab_size, drafts))
    assert got.tokens == want.tokens == plain[:n]
    assert got.accepted_per_round == want.accepted_per_round
    assert set(got.accepted_per_round) == set(range(1, drafts + 2))
    check_same_state(host, dev, got, drafts)


def _poison(engine, keep: int, like: int):
    """Every window entry but slot ``keep`` set to huge noise, slot ``keep`` to slot ``like``'s entry."""
    g = torch.Generator().manual_seed(keep)
    for window in engine.noise:
        for t in window.values():
            saved = t[:, like].clone()
            t.copy_(1e30 * torch.randn(t.shape, generator=g))
            t[:, keep] = saved


@pytest.mark.parametrize("shift", [pytest.param(0, marks=pytest.mark.slow), 1])
def test_a_round_reads_its_positions_entry_only(tiny, host_run, monkeypatch, shift):
    """Before every launch the whole window is written, then every entry but that of the round's position p
    poisoned (huge noise): the tokens stay the host-driven ones. With p's entry replaced by p + 1's (``shift``),
    they are not: the check can fail."""
    cfg, params = tiny
    W = 4
    monkeypatch.setattr(NoiseBook, "due", lambda self, pos: range(pos, pos + self.window))
    v = chained(cfg, params, window=W)
    run = v.engine.run

    def poisoned(mode, inputs):
        p = v.chain_pos
        _poison(v.engine, rp.noise_slot(p, W), rp.noise_slot(p + shift, W))
        return run(mode, inputs)
    v.engine.run = poisoned
    sampled = host_run[1].tokens
    res = generate(v, PROMPT, 3, sampling=S, draft_source=right_draft(PROMPT, sampled))
    assert (res.tokens == sampled[:3]) == (shift == 0)


def test_eos_and_max_tokens_inside_a_two_token_sampled_round(tiny, host_run):
    """Right drafts: the first round commits 2 tokens; max tokens 2 keeps the first of them, and so does an EOS that
    is the first of them."""
    cfg, params = tiny
    sampled = host_run[1].tokens
    right = right_draft(PROMPT, sampled)
    res = generate(chained(cfg, params), PROMPT, 2, sampling=S, draft_source=right)
    assert res.tokens == sampled[:2] and res.accepted_per_round == [2]
    res = generate(chained(cfg, params), PROMPT, 6, eos_ids=(sampled[1],), sampling=S, draft_source=right)
    assert res.tokens == sampled[:2] and res.accepted_per_round == [2]


def test_noise_book_refreshes_at_the_window_end():
    """K = 1, W = 4: the first launch writes p .. p + 3; nothing is due while p + 2 < hi; a round at the position
    that makes p + 2 reach the end writes the start positions up to p + 3 (slots of positions below p only)."""
    book = NoiseBook(4, 1)
    assert list(book.due(6)) == [6, 7, 8, 9] and book.hi == 10
    assert list(book.due(7)) == []                  # 7 + 2 < 10: rounds at 7 and at <= 9 are covered
    assert list(book.due(8)) == [10, 11]            # 8 + 2 = 10: the round after next could start at 10
    assert {rp.noise_slot(n, 4) for n in (10, 11)} == {rp.noise_slot(n, 4) for n in (6, 7)}    # slots below p
    assert list(book.due(9)) == [] and list(book.due(10)) == [12, 13] and book.refreshes == 3
    with pytest.raises(ValueError, match="past the written entries"):
        book.due(20)
    for bad in (3, 6, 0, True):
        with pytest.raises(ValueError, match="power of two >= K \\+ 2"):
            NoiseBook(bad, 2)
    assert rp.noise_window(1) == 8 and rp.noise_window(2) == 16 and rp.noise_window(3) == 16


def test_window_entry_is_the_host_driven_rounds_noise(tiny_cfg):
    """A window entry is the host-driven round's noise input of its start position; the specs add the entry axis."""
    cfg = tiny_cfg
    noise = GumbelNoise(7, cfg.vocab_size, 0.8)
    entry = rp.noise_window_entry(noise, 11, 0, 1, 2, 2)
    want = rp.noise_inputs("round", noise.scaled(12, 3), 0, 1, 2, 2)
    assert set(entry) == set(want) == {"noise_v", "noise_d1"}
    for k in entry:
        assert torch.equal(entry[k], want[k]) and torch.isfinite(entry[k]).all() and entry[k].abs().max() > 0
    specs = {s.name: s for s in rp.noise_window_specs(cfg, 1, 2, 2, window=8)}
    for s in rp.noise_specs(cfg, "round", 1, 2, 2):
        assert specs[s.name].shape == (s.shape[0], 8) + s.shape[1:] and specs[s.name].dtype == "float32"


def test_refusals(tiny):
    cfg, params = tiny
    with pytest.raises(ValueError, match="device-committed sampled rounds"):
        make_decoder("megakernel", cfg, params, tp=1, noise_window=8)
    v = chained(cfg, params)
    v.prefill(PROMPT, 16)
    with pytest.raises(ValueError, match="not per launch"):
        v.engine.run("chain", {"force": rp.force_input(cfg, None, 1), "noise": torch.zeros(2, cfg.vocab_size)})
    v.set_sampling(S)
    v.engine.start(16)
    v.engine.seed_control(1, torch.ones(cfg.hidden_size), len(PROMPT), 0)
    with pytest.raises(ValueError, match="needs the noise window"):
        v.engine.run("chain", {"force": rp.force_input(cfg, None, 1)})
    with pytest.raises(ValueError, match="top-k"):
        generate(v, PROMPT, 4, sampling=Sampling(1.0, top_k=3))


@pytest.mark.slow
def test_tp4_with_an_fr_spec_draft_vocabulary(tiny):
    """TP = 4 x LNC = 2 (each rank's and core's entry of the window) and an FR-Spec draft head (the drafts' window
    over the draft ids' columns): the host-driven sampled rounds' tokens, accepts and state."""
    import numpy as np
    cfg, params = tiny
    subset = np.sort(np.random.default_rng(0).choice(cfg.vocab_size, 64, replace=False)).astype(np.int32)
    host = make_decoder("megakernel", cfg, params, tp=4, draft_ids=subset)
    want = generate(host, PROMPT, 4, sampling=S)
    dev = make_decoder("megakernel", cfg, params, tp=4, draft_ids=subset, device_commit=True, noise_window=4)
    got = generate(dev, PROMPT, 4, sampling=S)
    assert got.tokens == want.tokens and got.accepted_per_round == want.accepted_per_round
    check_same_state(host, dev, got, 1)


def window_reads(tr, rank=0, core=0) -> tuple:
    """(instructions of the window's slot, DMAs moved by its register) of one core in a trace: the VectorE bitwise and
    of the position (at the launch top), the register load of its result (before the first LM head), and every
    instruction reading that register."""
    mine = [r for r in tr.instructions if r.get("rank", 0) == rank and r["inst"] == core]
    ands = [r for r in mine if r["op"] == "tensor_scalar" and r["loc"].startswith("round.py")
            and "bitwise_and" in r["alu"]]
    loads = [r for r in mine if r["op"] == "register_load" and any(x.get("name") == "noise_entry" for x in r["reads"])]
    assert len(ands) == 1 and len(loads) == 1, "one bitwise and of the position and one load of it per core"
    reg = loads[0]["reg_writes"][0]
    users = [r for r in mine if reg in (r.get("reg_reads") or ())]
    return (ands[0], loads[0]), users


@pytest.mark.slow
def test_full_size_sampled_device_committed_round_traces():
    """The sampled device-committed round at full size (TP=4 x LNC=2, ctx 2048, shape-only, strict rules): the noise
    window's entry offsets fit int32 and the noise DMAs move their window views within the tensor; per core the window
    costs two instructions (the bitwise and, the register load) and its register moves exactly the K + 1 noise DMAs
    (draft, verify), all in the LM heads."""
    import nkisim
    from harness.kernel_cases import round_case
    from model.config import preset
    cfg = preset("qwen3.6-35b-a3b")
    case = round_case(cfg, context=2048, device_commit=True)
    W = rp.noise_window(1)
    specs = rp.noise_window_specs(cfg, 4, 2, 1, window=W)
    assert {s.name: s.shape for s in specs} == {"noise_v": (2, W, 128, 243 * 2), "noise_d1": (2, W, 1, 128, 243)}
    for args in case.per_rank:
        args.update({s.name: nkisim.ShapeDtype(s.shape, "float32") for s in specs})
    tr = case.trace()
    for rank, core in ((0, 0), (3, 1)):
        (_, load), users = window_reads(tr, rank, core)
        assert load["engine"] == "SP" and [(u["op"], u["loc"].split(":")[0]) for u in users] == \
            [("dma_copy", "lm_head.py")] * 2, (rank, core)
