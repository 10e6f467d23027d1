"""Sampling inside the kernel variants (layerwise, megakernel): shared Gumbel noise per position
(harness.sampling.GumbelNoise), the LM heads' Gumbel-max (nki_kernels/lm_head.py ``noise``), the greedy accept rule.

The claim under test is exact: the committed tokens equal NON-speculative Gumbel-max sampling with the same noise
table, x_n = argmax(logits(x_<n) + T g_n) -- here computed by the single-device reference model on the host
(fp32 weights: kernel and reference logits agree to ~1e-5, far below the gaps between noisy scores at T >= 0.7).
Drafts from the real MTP head and forced always-right / always-wrong / alternating drafts; K = 1, 2, 3; the
megakernel at TP=1 in the default tier (one TP=4 round, with an FR-Spec draft vocabulary, checks the per-rank noise
layouts and each draft's position), every kernel variant at TP=4 in the slow tier. Also: the same seed gives the
same tokens; plain (non-speculative) kernel sampling; decode.py's sampling flags and refusals.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from decoding import ReferenceDecoder, alternating, reference_greedy, right_draft
from harness import decode
from harness.sampling import GumbelNoise, Sampling, gumbel_max
from harness.speculative import generate, make_decoder
from model.params import random_params

PROMPT = [5, 17, 99, 3, 250, 41]
N_NEW = 8
S = Sampling(1.0, seed=4)


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


def reference_gumbel(cfg, params, prompt, n, s: Sampling, sample: int = 0) -> list[int]:
    """Plain Gumbel-max sampling with the reference model: token at position p = argmax(logits + T g_p)."""
    ref = ReferenceDecoder(cfg, params)
    noise = GumbelNoise(s.seed + sample, cfg.vocab_size, s.temperature)
    h = ref.prefill(prompt, len(prompt) + n + 1)[1]
    out = []
    while len(out) < n:
        pos = len(prompt) + len(out)                 # the position of the token drawn now
        out.append(int(gumbel_max(ref.ref.logits(h[None]), noise.scaled(pos, 1))[0]))
        if len(out) < n:
            h = ref.step(out[-1], pos)[1]
    return out


@pytest.fixture(scope="module")
def plain(tiny):
    cfg, params = tiny
    return reference_gumbel(cfg, params, PROMPT, 3 * N_NEW, S)


def test_reference_is_a_sample_not_greedy(tiny, plain):
    cfg, params = tiny
    assert plain[:N_NEW] != reference_greedy(cfg, params, PROMPT, N_NEW)
    assert reference_gumbel(cfg, params, PROMPT, N_NEW, S) == plain[:N_NEW]      # deterministic


@pytest.mark.parametrize("drafts", [pytest.param(1, marks=pytest.mark.slow), 2, 3])
def test_megakernel_sampled_tokens_equal_plain_gumbel_sampling(tiny, plain, drafts):
    cfg, params = tiny
    v = make_decoder("megakernel", cfg, params, tp=1, drafts=drafts)
    res = generate(v, PROMPT, N_NEW, sampling=S)
    assert res.tokens == plain[:N_NEW]
    assert v.launches == res.rounds and 1 <= min(res.accepted_per_round) <= max(res.accepted_per_round) <= drafts + 1


@pytest.mark.parametrize("kind", [pytest.param("right", marks=pytest.mark.slow),
                                  pytest.param("wrong", marks=pytest.mark.slow), "alternating"])
def test_megakernel_forced_drafts_k2(tiny, plain, kind):
    cfg, params = tiny
    K = 2
    right = right_draft(PROMPT, plain, K)
    source = {"right": right, "wrong": lambda seq: [(t + 1) % cfg.vocab_size for t in right(seq)],
              "alternating": alternating(PROMPT, plain, cfg.vocab_size, K)}[kind]
    v = make_decoder("megakernel", cfg, params, tp=1, drafts=K)
    res = generate(v, PROMPT, N_NEW, sampling=S, draft_source=source)
    assert res.tokens == plain[:N_NEW]
    if kind == "right":
        assert res.acceptance_rate == 1.0
    if kind == "wrong":
        assert res.acceptance_rate == 0.0
    if kind == "alternating":
        assert set(res.accepted_per_round) == {1, 2, 3}


def test_megakernel_plain_sampling_and_seeds(tiny, plain):
    """--no-spec: the step kernel samples with the noise of its position; same seed -> same tokens, another seed
    -> other tokens (both equal to the reference of their seed)."""
    cfg, params = tiny
    v = make_decoder("megakernel", cfg, params, tp=1, drafts=1)
    assert generate(v, PROMPT, 3, spec=False, sampling=S).tokens == plain[:3]
    a = generate(v, PROMPT, 3, sampling=S, sample=1).tokens
    assert a == generate(v, PROMPT, 3, sampling=S, sample=1).tokens
    assert a == reference_gumbel(cfg, params, PROMPT, 3, S, sample=1) and a != plain[:3]
    assert generate(v, PROMPT, 2).tokens == reference_greedy(cfg, params, PROMPT, 2)     # greedy again: no noise


def test_tp4_round_drafts_and_targets_are_gumbel_max_with_a_draft_vocabulary(tiny):
    """One K = 2 round at TP=4 x LNC=2 with an FR-Spec draft vocabulary: draft i is the Gumbel-max over the subset's
    rows of the chained MTP logits with the noise of position p + 1 + i (the position its verified token predicts),
    and every target the Gumbel-max of the reference verify's logits with the noise of its position."""
    cfg, params = tiny
    K, p = 2, len(PROMPT)
    subset = np.arange(0, cfg.vocab_size, 2, dtype=np.int32)[:128]
    sub = torch.as_tensor(subset, dtype=torch.long)
    s = Sampling(0.8, seed=9)
    noise = GumbelNoise(s.seed, cfg.vocab_size, s.temperature)
    v = make_decoder("megakernel", cfg, params, tp=4, drafts=K, draft_ids=subset)
    v.set_sampling(s)
    first, h = v.prefill(PROMPT, max_len=24)
    r = v.round(first, h, p)
    ref = ReferenceDecoder(cfg, params, drafts=K)
    f, hr = ref.prefill(PROMPT, max_len=24)
    assert f == first
    drafts, token, hm = [], first, hr[None]
    for i in range(K):                                  # the reference chain, sampled over the subset
        hm = ref.ref.mtp(torch.tensor([token]), hm, ref.state, p - 1 + i)
        token = int(sub[gumbel_max(ref.ref.logits(hm)[:, sub], noise.scaled(p + 1 + i, 1)[:, sub])[0]])
        drafts.append(token)
    assert r.drafts == drafts
    want = ref.round(first, hr, p, forced_draft=drafts)     # the reference verify of the same tokens
    ref_logits = ref.ref.logits(want.hidden)
    assert r.targets == gumbel_max(ref_logits, noise.scaled(p + 1, K + 1)).tolist()
    assert torch.isfinite(r.hidden).all() and r.hidden.abs().max() > 0.1


@pytest.mark.slow
@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_every_kernel_variant_tp4(tiny, plain, drafts):
    cfg, params = tiny
    n = 12
    for name in ("layerwise", "megakernel"):
        for source in (None, alternating(PROMPT, plain, cfg.vocab_size, drafts)):
            v = make_decoder(name, cfg, params, tp=4, drafts=drafts)
            res = generate(v, PROMPT, n, sampling=S, draft_source=source)
            assert res.tokens == plain[:n], (name, source)


@pytest.mark.slow
def test_embedded_model_sampled_cli_samples(capsys):
    """decode.py on the embedded (bf16) model: the megakernel's samples at TP=1; --num-samples 2 gives two
    sequences, the first of them reproduced by a second run."""
    argv = ["--variant", "megakernel", "--tp", "1", "--temperature", "0.7", "--seed", "3", "--num-samples", "2",
            "--max-new-tokens", "6", "--prompt-ids", "1,2,3,4", "--json"]
    outs = []
    for _ in range(2):
        assert decode.main(argv) == 0
        outs.append(json.loads(capsys.readouterr().out))
    a, b = outs
    assert a["samples"] == b["samples"] and len(a["samples"]) == 2 and a["samples"][0] != a["samples"][1]
    assert a["sampling"]["temperature"] == 0.7 and a["tokens"] == a["samples"][0]


@pytest.mark.parametrize("argv, msg", [
    (["--variant", "megakernel", "--temperature", "1", "--top-k", "5"], "temperature only"),
    (["--variant", "layerwise", "--temperature", "1", "--top-p", "0.9"], "temperature only"),
    (["--temperature", "1"], "one --variant at a time"),
    (["--variant", "megakernel", "--temperature", "1", "--prefill", "nki"], "--prefill nki"),
    (["--variant", "megakernel", "--temperature", "-1"], "--temperature must be >= 0"),
])
def test_cli_refuses_unsupported_sampling_flags(capsys, argv, msg):
    assert decode.main(argv) == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_bench_draft1_figures(tiny):
    """``bench spec``'s draft-1 figures for a Gumbel variant: round 0's optimum is 1 - TV of the reference's target
    and MTP distributions after the prompt; the coupling's expected acceptance never exceeds the optimum (beyond
    its Monte Carlo error, 3 sigma of 4,096 draws)."""
    from harness.sampling import probabilities
    from harness.spec_bench import COUPLING_DRAWS, draft1_figures
    from model.reference import ReferenceModel
    cfg, params = tiny
    tokens = reference_gumbel(cfg, params, PROMPT, 6, S)
    opt, coup = draft1_figures(ReferenceModel(cfg, params), PROMPT, tokens, [2, 1, 2], S.temperature)
    assert len(opt) == len(coup) == 3
    ref = ReferenceDecoder(cfg, params)
    h = ref.prefill(PROMPT, 16)[1]                      # h_{n-1}, n = len(PROMPT): the pending token x_n's position
    hm = ref.ref.mtp(torch.tensor([tokens[0]]), h[None], ref.state, len(PROMPT) - 1)
    p = probabilities(ref.ref.logits(ref.step(tokens[0], len(PROMPT))[1][None]), S)[0]    # the target at n + 1
    q = probabilities(ref.ref.logits(hm), S)[0]
    assert abs(opt[0] - float(torch.minimum(p, q).sum())) < 1e-5      # chunked vs step trunk: fp32 order
    for o, c in zip(opt, coup):
        assert 0 < c <= o + 3 * (0.25 / COUPLING_DRAWS) ** 0.5 and o <= 1
