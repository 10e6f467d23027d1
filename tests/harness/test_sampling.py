"""Lossless sampling with speculation (harness.sampling, the sampled path of harness.speculative).

* Distribution: a toy engine (an order-1 Markov "model" over 6 tokens: target logits A[prev], draft logits B[prev],
  chained drafts drawn from the launch's Gumbel noise exactly as harness.xla draws them) decodes 3 tokens many
  times through the real Decoder / generate / accept path, K = 2 and 3, at temperature 1 and at 0.7 with top-k 4
  and top-p 0.9. The exact plain-sampling distribution of each of the 3 positions' marginals and of the first two
  tokens' joint is known in closed form; chi-square against it, N = 8000 seeded sequences (deterministic: fixed
  seeds), threshold p > 1e-3. Power: moving 2% of the mass between two cells of probability ~0.2 adds
  ~2 * 8000 * 0.02^2 / 0.2 = 32 to the statistic, above the 5-dof threshold of 20.5 -- a 2% bias fails.
  The same check on plain (non-speculative) sampling, and a biased sampler (accept every draft) that must fail.
* Shared Gumbel noise (the kernel variants' scheme, sampler "gumbel"): the same toy model with draft and target
  taking argmax(logits + T g_n) from ``harness.sampling.GumbelNoise`` and the greedy accept rule, through the same
  Decoder / generate path, K = 2 and 3, temperature 1 and 0.7 (no top-k / top-p: the kernels have none), the same
  chi-square test and threshold; the noise generator alone (one token per position, and pairs of positions) against
  softmax(l / T); a noise table that ignores the position (reused noise) must fail the joint test.
* The real model (xla, tiny config): top-k 1 sampling equals greedy decoding for K = 1..3 (the whole sampled path,
  drafts included, collapses to argmax); identical seeds give identical tokens, other seeds other tokens; the
  kernel variants refuse top-k / top-p.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from scipy.stats import chi2

from decoding import reference_greedy
from harness.engines import LaunchResult
from harness.sampling import GumbelNoise, Sampling, accept, gumbel_max, probabilities
from harness.speculative import Decoder, generate, make_decoder
from model.params import random_params

V, N, NEW = 6, 8000, 3
SETTINGS = [Sampling(1.0, seed=11), Sampling(0.7, top_k=4, top_p=0.9, seed=12)]


class MarkovEngine:
    """Engine protocol over an order-1 Markov model: no state, target logits A[prev], draft logits B[prev]."""

    name = "markov"
    dtype = torch.float32
    sampling = None

    def __init__(self, cfg, drafts: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.cfg, self.drafts, self.launches = cfg, drafts, 0
        self.A = 1.5 * torch.randn(V, V, generator=g)
        self.B = self.A + 1.0 * torch.randn(V, V, generator=g)     # a decent but imperfect draft

    def start(self, max_len):
        pass

    def run(self, mode, inputs):
        self.launches += 1
        tokens = [int(inputs["pending"].reshape(-1)[0])]
        drafts, q = [], []
        if mode == "round":
            force = np.asarray(inputs["force"])
            for i in range(self.drafts):
                if force[i, 0]:
                    d = int(force[i, 1])
                    q.append(torch.zeros(V, dtype=torch.float64))
                else:
                    qi = probabilities(self.B[tokens[-1]][None], self.sampling)[0]
                    d = int(torch.argmax(torch.log(qi) + inputs["draft_noise"][i]))
                    q.append(qi)
                drafts.append(d)
                tokens.append(d)
        logits = self.A[tokens]
        hidden = torch.zeros(len(tokens), self.cfg.hidden_size)
        return LaunchResult(drafts or tokens[:1], [int(t) for t in torch.argmax(logits, dim=-1)], hidden,
                            torch.stack(q) if q else None, logits)


@pytest.fixture(scope="module")
def cfg(tiny_cfg):
    return dataclasses.replace(tiny_cfg, vocab_size=V, eos_token_id=())


def exact(engine, s: Sampling, prompt_last: int):
    """Plain sampling's exact distribution of the first NEW tokens: per-position marginals [NEW, V] and the joint
    of the first two [V, V]."""
    P = probabilities(engine.A, s)              # P[prev] = next-token distribution
    first = P[prompt_last]
    joint = first[:, None] * P
    marg = [first]
    for _ in range(NEW - 1):
        marg.append(marg[-1] @ P)
    return torch.stack(marg), joint


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    keep = probs > 0
    if counts[~keep].sum():
        return 0.0                          # a sample outside the support
    n = counts.sum()
    stat = float(((counts[keep] - n * probs[keep]) ** 2 / (n * probs[keep])).sum())
    return float(chi2.sf(stat, keep.sum() - 1))


def sample_counts(engine, s: Sampling, spec: bool, prompt: list[int]):
    dec = Decoder(engine)
    marg, joint = np.zeros((NEW, V)), np.zeros((V, V))
    for i in range(N):
        toks = generate(dec, prompt, NEW, spec=spec, sampling=s, sample=i).tokens
        for j, t in enumerate(toks):
            marg[j, t] += 1
        joint[toks[0], toks[1]] += 1
    return marg, joint


def p_values(engine, s, spec, prompt):
    marg, joint = sample_counts(engine, s, spec, prompt)
    want_m, want_j = exact(engine, s, prompt[-1])
    return [chi_square_p(marg[j], want_m[j].numpy()) for j in range(NEW)] + [
        chi_square_p(joint.ravel(), want_j.numpy().ravel())]


@pytest.mark.parametrize("drafts,s", [pytest.param(2, SETTINGS[0], marks=pytest.mark.slow), (2, SETTINGS[1]),
                                      pytest.param(3, SETTINGS[0], marks=pytest.mark.slow),
                                      pytest.param(3, SETTINGS[1], marks=pytest.mark.slow)],
                         ids=["K2-T1", "K2-T0.7-k4-p0.9", "K3-T1", "K3-T0.7-k4-p0.9"])
# default tier: K = 2 with temperature, top-k and top-p (the Gumbel rule at K2-T1 stays in the default tier too)
def test_speculative_sampling_equals_plain_sampling(cfg, s, drafts):
    engine = MarkovEngine(cfg, drafts)
    ps = p_values(engine, s, True, [2])
    assert min(ps) > 1e-3, ps


@pytest.mark.slow
def test_plain_sampling_matches_the_exact_distribution(cfg):
    ps = p_values(MarkovEngine(cfg, 2), SETTINGS[1], False, [2])
    assert min(ps) > 1e-3, ps


def test_a_biased_rule_is_detected(cfg, monkeypatch):
    """Accepting every draft samples from the draft, not the target: the same test must reject it."""
    import harness.speculative as spec

    def accept_all(drafts, q, p, gen):
        return list(drafts) + [int(torch.multinomial(p[-1], 1, generator=gen))]
    monkeypatch.setattr(spec, "accept", accept_all)
    ps = p_values(MarkovEngine(cfg, 2), SETTINGS[0], True, [2])
    assert min(ps) < 1e-6, ps


def test_accept_rule_edge_cases():
    g = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    q = torch.tensor([[0.0, 1.0, 0.0]], dtype=torch.float64)
    assert accept([1], q, p, g)[0] == 1                                  # p = q: always accepted, then a bonus
    q_bad = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    assert accept([0], q_bad, p, g) == [1]                              # p(d) = 0: rejected, residual = p
    with pytest.raises(ValueError, match="2 drafts need"):
        accept([0, 1], q, p, g)
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-1)):
        with pytest.raises(ValueError):
            Sampling(**bad)


def test_processed_distribution():
    logits = torch.tensor([[2.0, 1.0, 1.0, 0.0, -1.0]])
    p = probabilities(logits, Sampling(1.0, top_k=3))
    assert (p[0, 3:] == 0).all() and abs(float(p.sum()) - 1) < 1e-12 and p[0, 1] == p[0, 2]
    p = probabilities(logits, Sampling(1.0, top_p=0.5))
    assert p[0, 0] == 1.0                                               # the top token alone reaches 0.5
    t = probabilities(logits, Sampling(0.5))
    assert t[0, 0] > probabilities(logits, Sampling(1.0))[0, 0]         # colder: more peaked


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_top_k_1_sampling_is_greedy_on_the_model(tiny, drafts):
    cfg, params = tiny
    prompt = [5, 17, 99, 3, 250, 41]
    plain = reference_greedy(cfg, params, prompt, 8)
    v = make_decoder("xla", cfg, params, tp=2, drafts=drafts)
    assert generate(v, prompt, 8, sampling=Sampling(1.0, top_k=1, seed=3)).tokens == plain
    assert generate(v, prompt, 8).tokens == plain                       # greedy again after sampling


def test_seeds_reproduce_on_the_model(tiny):
    cfg, params = tiny
    prompt = [5, 17, 99, 3, 250, 41]
    v = make_decoder("xla", cfg, params, tp=1, drafts=2)
    s = Sampling(0.7, top_k=20, top_p=0.9, seed=5)
    a, b = (generate(v, prompt, 8, sampling=s).tokens for _ in range(2))
    c = generate(v, prompt, 8, sampling=dataclasses.replace(s, seed=6)).tokens
    assert a == b and a != c


def test_kernel_variants_refuse_top_k_and_top_p(tiny):
    cfg, params = tiny
    v = make_decoder("megakernel", cfg, params, tp=1)
    for s in (Sampling(1.0, top_k=5), Sampling(1.0, top_p=0.9)):
        with pytest.raises(ValueError, match="temperature only"):
            generate(v, [1, 2, 3], 4, sampling=s)
    assert v.launches == 0                                              # refused before anything ran


# ---- shared Gumbel noise (the kernel variants' sampler) ----------------------------------------------------------
GUMBEL_SETTINGS = [Sampling(1.0, seed=21), Sampling(0.7, seed=22)]


class GumbelMarkovEngine(MarkovEngine):
    """The toy model sampled the kernels' way: the launch's ``noise`` rows [T, V] (pre-scaled T * g_n of the
    positions its verified tokens predict); draft i and target i take argmax(logits + noise row i)."""

    sampler = "gumbel"

    def run(self, mode, inputs):
        self.launches += 1
        tokens = [int(inputs["pending"].reshape(-1)[0])]
        noise = inputs.get("noise")
        drafts = []
        if mode == "round":
            force = np.asarray(inputs["force"])
            for i in range(self.drafts):
                d = int(force[i, 1]) if force[i, 0] else int(gumbel_max(self.B[tokens[-1]][None], noise[i:i + 1])[0])
                drafts.append(d)
                tokens.append(d)
        logits = self.A[tokens]
        targets = gumbel_max(logits, noise) if noise is not None else torch.argmax(logits, dim=-1)
        return LaunchResult(drafts or tokens[:1], [int(t) for t in targets], torch.zeros(len(tokens), self.cfg.hidden_size))


@pytest.mark.parametrize("drafts,s", [(2, GUMBEL_SETTINGS[0]),
                                      pytest.param(3, GUMBEL_SETTINGS[1], marks=pytest.mark.slow),
                                      pytest.param(3, GUMBEL_SETTINGS[0], marks=pytest.mark.slow),
                                      pytest.param(2, GUMBEL_SETTINGS[1], marks=pytest.mark.slow)],
                         ids=["K2-T1", "K3-T0.7", "K3-T1", "K2-T0.7"])
def test_gumbel_speculative_sampling_equals_plain_sampling(cfg, s, drafts):
    engine = GumbelMarkovEngine(cfg, drafts)
    ps = p_values(engine, s, True, [2])
    assert min(ps) > 1e-3, ps
    dec = Decoder(engine)
    res = generate(dec, [2], 12, sampling=s, sample=3)
    assert 1 < res.tokens_per_round < drafts + 1                       # drafts are both accepted and rejected
    assert generate(dec, [2], 12, spec=False, sampling=s, sample=3).tokens == res.tokens   # sample for sample


@pytest.mark.parametrize("s", GUMBEL_SETTINGS, ids=["T1", "T0.7"])
def test_gumbel_noise_samples_the_softmax(s):
    """One token per position n = 0 .. N-1 of one seed, and across seeds at one position: chi-square against
    softmax(l / T); pairs (n, n + 1) against the product (the positions' noise is independent)."""
    logits = torch.tensor([[1.2, 0.3, -0.4, 0.9, -1.5, 0.0]])
    want = torch.softmax(logits.double() / s.temperature, dim=-1)[0].numpy()
    noise = GumbelNoise(s.seed, V, s.temperature)
    by_pos = [int(gumbel_max(logits, noise.scaled(n, 1))[0]) for n in range(N)]
    by_seed = [int(gumbel_max(logits, GumbelNoise(s.seed + i, V, s.temperature).scaled(7, 1))[0]) for i in range(N)]
    for toks in (by_pos, by_seed):
        assert chi_square_p(np.bincount(toks, minlength=V), want) > 1e-3
    pairs = np.zeros((V, V))
    for a, b in zip(by_pos[0::2], by_pos[1::2]):
        pairs[a, b] += 1
    assert chi_square_p(pairs.ravel(), np.outer(want, want).ravel()) > 1e-3
    assert GumbelNoise(s.seed, V, s.temperature).at(5).tolist() == noise.at(5).tolist()   # deterministic
    assert torch.isfinite(noise.at(0)).all() and noise.at(0).std() > 0.5


@pytest.mark.slow
def test_reused_gumbel_noise_is_detected(cfg, monkeypatch):
    """Noise that ignores the position (the same g at every position) keeps each marginal of a Gumbel-max draw
    right but correlates the tokens: the joint test must reject it."""
    at = GumbelNoise.at
    monkeypatch.setattr(GumbelNoise, "at", lambda self, n: at(self, 0))
    ps = p_values(GumbelMarkovEngine(cfg, 2), GUMBEL_SETTINGS[0], True, [2])
    assert min(ps) < 1e-6, ps
