"""Teacher forcing (harness.teacher_forcing) and the numerics robustness report (harness.robustness): the
metrics on synthetic logits, the teacher-forced run and the free-run divergence on the xla variant, one tiny
report of the megakernel in exact and hardware-like numerics, and the command's bad input. No figure of the
report itself is asserted (a benchmark, not a test)."""

from __future__ import annotations

import pytest
import torch

from harness import bench, robustness
from harness.speculative import generate, make_decoder
from harness.teacher_forcing import first_divergence, forced_run, head_weight, host_logits, reference_run
from model.params import random_params
from model.reference import ReferenceModel
from model.state import DecodeState

PROMPT = [5, 17, 99, 3]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


def test_logit_metrics_known_values():
    ref = torch.tensor([[5.0, 1.0, 0.0], [2.0, 1.9, 0.0], [0.0, 3.0, 1.0], [1.0, 0.0, 4.0]])
    dev = ref.clone()
    dev[0, 2] += 0.1                     # error 0.1, no flip (margin 4)
    dev[1, 1] += 0.2                     # flips the near tie (margin 0.1 < 2 x 0.2)
    ids = torch.tensor([0, 1, 1, 0])     # position 3: the kernel id is wrong outside any near tie
    m = robustness.logit_metrics(ref, dev, ids)
    assert m["positions"] == 4
    assert m["max_abs"] == pytest.approx(0.2) and m["median_abs"] == pytest.approx(0.0)
    assert m["p99_abs"] == pytest.approx(torch.quantile(torch.tensor([0.1, 0.2, 0.0, 0.0]), 0.99).item())
    assert m["top1_agreement"] == 0.75                # host logits: position 1 flipped
    assert m["kernel_top1_agreement"] == 0.5          # ids 1 (near tie) and 0 (position 3) differ
    assert m["near_tie_fraction"] == 0.25             # only position 1: margin 0.1 < 2 x its error 0.2
    assert m["near_tie_fraction_p99"] == 0.25
    assert m["unexplained"] == 1                      # position 3
    assert m["min_margin"] == pytest.approx(0.1) and m["logit_scale"] == 5.0
    assert m["per_position_max_abs"] == pytest.approx([0.1, 0.2, 0.0, 0.0])


def test_logit_metrics_refuses_shape_mismatch():
    with pytest.raises(ValueError, match="do not match"):
        robustness.logit_metrics(torch.zeros(3, 4), torch.zeros(3, 5), torch.zeros(3, dtype=torch.long))


def test_divergence_summary():
    s = robustness.divergence_summary([None, 4, 1, None, 7], tokens=8)
    assert s == {"prompts": 5, "diverged": 3, "tokens": 8, "first_divergent": [None, 4, 1, None, 7],
                 "median_first": 4.0, "earliest": 1}
    assert robustness.divergence_summary([None], 8)["median_first"] is None


@pytest.mark.parametrize("rounds", [True, False])
def test_forced_run_on_its_own_tokens_is_greedy_decoding(tiny, rounds):
    """Teacher-forced through its own greedy continuation, a variant predicts exactly that continuation, and its
    host logits are the reference's logits of the same hiddens."""
    cfg, params = tiny
    v = make_decoder("xla", cfg, params, tp=1)
    cont = generate(v, PROMPT, 7, spec=False).tokens
    f = forced_run(v, PROMPT, cont, rounds=rounds)
    assert f.targets == cont
    assert f.hidden.shape == (7, cfg.hidden_size) and torch.isfinite(f.hidden).all() and f.hidden.abs().max() > 0.1
    logits = f.logits(head_weight(cfg, params))
    torch.testing.assert_close(logits, ReferenceModel(cfg, params).logits(f.hidden), rtol=0, atol=1e-5)
    assert torch.equal(logits.argmax(dim=1), torch.tensor(cont))


def test_reference_run_is_greedy_and_matches_the_prefill(tiny):
    """Token-by-token reference: its hiddens predict its own tokens, its prompt positions equal the chunked
    prefill's, and the xla decoder teacher-forced through its tokens reproduces its logits (parity)."""
    cfg, params = tiny
    head = head_weight(cfg, params)
    cont, hidden = reference_run(cfg, params, PROMPT, 6)
    assert len(cont) == 6 and hidden.shape == (len(PROMPT) + 5, cfg.hidden_size)
    assert host_logits(hidden[len(PROMPT) - 1:], head).argmax(dim=1).tolist() == cont
    ref = ReferenceModel(cfg, params)
    chunked = ref.trunk(torch.tensor(PROMPT), DecodeState.empty(cfg, 16, slots=2, dtype=ref.dtype), 0, chunked=True)
    torch.testing.assert_close(hidden[:len(PROMPT)], chunked.float(), rtol=0, atol=1e-4)
    f = forced_run(make_decoder("xla", cfg, params, tp=4), PROMPT, cont)
    torch.testing.assert_close(f.logits(head), host_logits(hidden[len(PROMPT) - 1:], head), rtol=0, atol=1e-4)
    with pytest.raises(ValueError, match="non-empty"):
        reference_run(cfg, params, [], 3)


def test_forced_run_rounds_and_steps_agree(tiny):
    cfg, params = tiny
    head = head_weight(cfg, params)
    cont = [7, 250, 3, 3, 40, 9]                      # not the greedy tokens: forcing must hold anyway
    a = forced_run(make_decoder("xla", cfg, params, tp=1), PROMPT, cont, rounds=True).logits(head)
    b = forced_run(make_decoder("xla", cfg, params, tp=1), PROMPT, cont, rounds=False).logits(head)
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)
    assert a.shape == (6, cfg.vocab_size)


def test_forced_run_refuses_empty():
    with pytest.raises(ValueError, match="non-empty"):
        forced_run(None, [], [1])


def test_first_divergence(tiny):
    cfg, params = tiny
    v = make_decoder("xla", cfg, params, tp=1)
    greedy = generate(v, PROMPT, 8, spec=False).tokens
    assert first_divergence(v, PROMPT, greedy) is None            # speculative decoding is lossless
    assert first_divergence(v, PROMPT, greedy, spec=False) is None
    changed = greedy[:5] + [(greedy[5] + 1) % cfg.vocab_size] + greedy[6:]
    assert first_divergence(v, PROMPT, changed) == 5


def test_host_logits_shape():
    assert host_logits(torch.ones(2, 3), torch.ones(5, 3)).shape == (2, 5)


def test_report_megakernel_exact_and_hardware_like(tiny_cfg):
    """One prompt, 3 tokens, TP=1: exact numerics reproduce the reference (parity), hardware-like ones move the
    logits by more and the report keeps its contract."""
    params = random_params(tiny_cfg, seed=3, dtype=torch.float32)
    m = robustness.Model("random", tiny_cfg, params, [PROMPT])
    out = {}
    for mode in ("exact", "hardware-like"):
        rep = robustness.run([m], ["megakernel"], 3, {"mode": mode}, tp=1)
        r = rep["random"]["variants"]["megakernel"]
        assert r["positions"] == 5          # 3 prompt + 3 continuation predictions, but the host prefill's
        assert r["free_running"]["prompts"] == 1
        out[mode] = r
    ex, hw = out["exact"], out["hardware-like"]
    assert ex["max_abs"] < 1e-4 and ex["kernel_top1_agreement"] == 1.0 and ex["unexplained"] == 0
    assert ex["free_running"]["diverged"] == 0
    assert hw["max_abs"] > 10 * ex["max_abs"]
    assert "| random | megakernel | 5 |" in robustness.table(rep)
    assert set(hw["check"]) == {"rtol", "failing_positions", "worst_ratio_to_tolerance"}


def test_load_models_prompts():
    (emb, rnd) = robustness.load_models(["embedded", "random"], 3)
    assert emb.prompts[0] == list(robustness.TEXT_PROMPTS[0].encode())
    assert len(rnd.prompts) == 3 and all(3 <= len(p) <= 10 for p in rnd.prompts)
    assert all(0 <= t < rnd.cfg.vocab_size for p in rnd.prompts for t in p)
    assert rnd.prompts == robustness.load_models(["random"], 3)[0].prompts      # seeded


@pytest.mark.parametrize("argv,msg", [(["--prompts", "0"], "--prompts"), (["--tokens", "1"], "--tokens"),
                                      (["--models", "gpt"], "--models"), (["--variants", "xla"], "--variants"),
                                      (["--act-rel-error", "0.7"], "act_rel_error"), (["--tp", "3"], "--tp")])
def test_command_bad_input(argv, msg, capsys):
    assert bench.main(["robustness", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert msg in err and "\n" not in err
