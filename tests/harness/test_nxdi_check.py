"""The bring-up check (harness.nxdi.check, ``python -m harness.nxdi.run check``): its rules on synthetic logits,
the report, and the CPU engine against itself with injected noise -- passes at tolerance, fails beyond it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from harness.engines import make_engine
from harness.nxdi import check
from harness.nxdi import run as cli
from harness.speculative import Decoder
from model.params import random_params

EMBEDDED = Path(__file__).resolve().parents[2] / "model" / "embedded" / "tiny"
PROMPTS = [[5, 17, 99, 3], [100, 101, 58, 10, 32]]


def _pos(ref, dev, ids, **kw):
    return check.check_positions(torch.tensor(ref, dtype=torch.float64), torch.tensor(dev, dtype=torch.float64), ids,
                                 **kw)


def test_rules_within_tolerance_pass():
    ref = [[10.0, 2.0, 0.0]]
    (p,) = _pos(ref, [[10.05, 1.95, 0.02]], [0], rtol=0.01)     # tol = 1e-5 + 0.1
    assert not p.problems and not p.near_tie
    assert p.max_abs == pytest.approx(0.05) and p.tolerance == pytest.approx(0.10001)


def test_rules_logit_error_fails():
    (p,) = _pos([[10.0, 2.0, 0.0]], [[10.0, 2.3, 0.0]], [0], rtol=0.01)
    assert p.problems == ["logit of id 1 off by 0.3 (tolerance 0.1)"]


def test_rules_top1_outside_near_tie_fails():
    (p,) = _pos([[10.0, 9.0, 0.0]], [[10.0, 9.0, 0.0]], [1], rtol=0.01)
    assert not p.near_tie
    assert any("top-1 1 != reference 0" in s for s in p.problems)


def test_rules_near_tie_flip_passes_but_not_to_a_far_token():
    ref = [[10.0, 9.95, 0.0]]                                  # margin 0.05 <= 2 x 0.1: a near tie
    (ok,) = _pos(ref, [[9.96, 9.99, 0.0]], [1], rtol=0.01)
    assert ok.near_tie and not ok.problems
    (far,) = _pos(ref, [[10.0, 9.95, 0.0]], [2], rtol=0.01)
    assert any("below the reference's best" in s for s in far.problems)


def test_rules_device_id_must_be_its_own_argmax():
    """The kernel's id against the device's own logits: a broken on-chip argmax is caught even at a near tie."""
    (p,) = _pos([[10.0, 9.9, 0.0]], [[10.0, 9.7, 0.0]], [1], rtol=0.01)
    assert any("below the best of the device's own logits" in s for s in p.problems)


def test_rules_bad_id_and_shapes():
    (p,) = _pos([[1.0, 0.0]], [[1.0, 0.0]], [7])
    assert any("outside the vocabulary" in s for s in p.problems)
    with pytest.raises(ValueError, match="do not match"):
        _pos([[1.0, 0.0]], [[1.0, 0.0, 0.0]], [0])


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=5, dtype=torch.float32)


class WrongIds:
    """A device whose greedy id is wrong (+1) at every round's second token: a broken argmax."""

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def round(self, *args, **kwargs):
        r = self.inner.round(*args, **kwargs)
        return dataclasses.replace(r, targets=[r.targets[0], (r.targets[1] + 1) % self.inner.cfg.vocab_size])


def test_run_check_self_noise_and_wrong_ids(tiny):
    """A CPU engine (xla, TP=2, teacher-forced prefill as on the chip) against the reference: passes clean and with
    small noise on its hiddens, fails with large noise and with a broken argmax."""
    cfg, params = tiny

    def device():
        return Decoder(make_engine("xla", cfg, params, tp=2))
    same = check.run_check(cfg, params, device(), PROMPTS, tokens=5)
    assert same.passed and same.summary()["max_abs"] < 1e-4 and len(same.positions) == 10
    small = check.run_check(cfg, params, check.NoisyDecoder(device(), 1e-4), PROMPTS, tokens=5)
    assert small.passed and small.summary()["max_abs"] > same.summary()["max_abs"]     # the noise arrived
    big = check.run_check(cfg, params, check.NoisyDecoder(device(), 1.0), PROMPTS, tokens=5)
    assert not big.passed and all("off by" in f.problems[0] for f in big.failures)
    text = big.report()
    assert "FAIL:" in text and "tolerance" in text and "max|dlogit|" in text
    wrong = check.run_check(cfg, params, WrongIds(device()), PROMPTS, tokens=5)
    assert not wrong.passed
    assert any("!= reference" in s or "below the reference's best" in s for f in wrong.failures for s in f.problems)
    d = wrong.to_dict()
    assert d["passed"] is False and d["failures"] == len(wrong.failures) and d["failing_positions"]


def _cli(capsys, *extra):
    rc = cli.main(["check", "--executor", "cpu", "--backend", "xla", "--model-path", str(EMBEDDED),
                   "--dtype", "float32", "--tokens", "4", "--prompt-ids", "100,101,102,32", *extra])
    return rc, capsys.readouterr()


def test_cli_cpu_engine_against_itself(capsys):
    """The NxDI CPU engine (xla backend, TP=4 threads) vs the CPU reference: passes clean and with small injected
    noise, fails with large noise, printing where and by how much."""
    rc, out = _cli(capsys)
    assert rc == 0 and "PASS" in out.out and "4 teacher-forced positions" in out.out
    rc, out = _cli(capsys, "--inject-noise", "1e-2")
    assert rc == 0 and "PASS" in out.out
    rc, out = _cli(capsys, "--inject-noise", "0.5")
    assert rc == 1 and "FAIL:" in out.out and "off by" in out.out
    lines = out.out.splitlines()
    header = next(i for i, s in enumerate(lines) if s.lstrip().startswith("prompt"))
    assert len(lines) > header + 1 and lines[header + 1].split()[0] == "0"     # the failing rows follow


@pytest.mark.parametrize("extra,msg", [(["--inject-noise", "0.1", "--executor", "neuron"], "--executor cpu"),
                                       (["--hardware-like"], "--backend megakernel"),
                                       (["--tokens", "0"], "--tokens"), (["--prompt-ids", "1,x"], "--prompt-ids"),
                                       (["--prompt-ids", "999"], "outside the vocabulary")])
def test_cli_bad_input(extra, msg, capsys):
    rc, out = _cli(capsys, *extra)
    assert rc == 2 and msg in out.err and out.err.count("\n") == 1


@pytest.mark.slow
def test_cli_megakernel_hardware_like_passes(capsys):
    """The megakernel backend under nkisim's hardware-like numerics passes the check on the embedded model."""
    rc, out = _cli(capsys, "--backend", "megakernel", "--hardware-like")
    assert rc == 0 and "PASS" in out.out


@pytest.mark.parametrize("K", [2, 3])
def test_run_check_forces_k_drafts_per_round(tiny, K, monkeypatch):
    """A device with rounds of K drafts is teacher-forced K + 1 tokens per round (every draft forced to the
    reference's token, all committed: the K-token accept), and its logits equal the CPU reference's."""
    cfg, params = tiny
    device = Decoder(make_engine("xla", cfg, params, tp=2, drafts=K))
    rounds = []
    real = Decoder.round
    n = len(PROMPTS[0])                 # rounds after the prefill (the teacher-forced prefill has its own)
    monkeypatch.setattr(Decoder, "round",
                        lambda self, *a, **kw: (a[2] >= n and rounds.append(a[3])) or real(self, *a, **kw))
    commits = []
    real_commit = Decoder.commit
    monkeypatch.setattr(Decoder, "commit", lambda self, n: commits.append(n) or real_commit(self, n))
    res = check.run_check(cfg, params, device, PROMPTS[:1], tokens=2 * K + 4)
    assert res.passed and res.summary()["max_abs"] < 1e-4 and len(res.positions) == 2 * K + 4
    assert [len(f) for f in rounds] == [K, K] and commits == [K + 1, K + 1]     # then a step
    assert rounds[0] == res.continuations[0][1:K + 1]                           # forced to the reference's tokens


def test_cli_check_with_k_drafts(capsys):
    rc, out = _cli(capsys, "--num-draft-tokens", "3", "--tokens", "8", "--json")
    d = __import__("json").loads(out.out)
    assert rc == 0 and d["passed"] and d["num_draft_tokens"] == 3 and d["positions"] == 8
