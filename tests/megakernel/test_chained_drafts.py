"""Rounds of K = 2, 3 chained MTP drafts in the kernel variants under nkisim (K = 1: tests/megakernel/test_round.py).

* Tokens: megakernel (and layerwise) decoding with forced drafts whose accepted prefix runs through every length
  0..K equals plain greedy decoding of the single-device reference model; one launch per round.
* One round: drafts, the K + 1 targets, the hiddens, every GDN checkpoint slot 0..K and the KV rows (trunk rows
  p..p+K, MTP rows p-1..p+K-1) match the reference model's round (tests/decoding.py ReferenceDecoder). Tolerance
  as test_round.py: 1e-4 absolute on O(1) float32 values (kernels accumulate in another order than torch).
* The decode-state invariant after rounds with accept lengths 0..K.

nkisim interprets every instruction, so these run TP=1 x LNC=2 with few tokens (one TP=4 round); the longer sweep
over every variant and K is marked slow.
"""

from __future__ import annotations

import pytest
import torch

from decoding import ReferenceDecoder, alternating, forced_rounds, reference_decode_state, reference_greedy
from harness.speculative import generate, make_decoder
from model.params import random_params

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


@pytest.mark.parametrize("drafts", [2, 3])
def test_megakernel_tokens_equal_plain_greedy(tiny, drafts):
    cfg, params = tiny
    n = 2 * drafts + 4
    plain = reference_greedy(cfg, params, PROMPT, n)
    v = make_decoder("megakernel", cfg, params, tp=1, drafts=drafts)
    res = generate(v, PROMPT, n, draft_source=alternating(PROMPT, plain, cfg.vocab_size, drafts))
    assert res.tokens == plain
    assert res.accepted_per_round[:drafts + 1] == [drafts + 1, 1, drafts, 2][:drafts + 1]
    assert v.launches == res.rounds          # one launch per round whatever K; prefill on the host


def test_round_matches_the_reference_round(tiny):
    cfg, params = tiny
    K, p = 3, len(PROMPT)
    ref, mk = ReferenceDecoder(cfg, params, drafts=K), make_decoder("megakernel", cfg, params, tp=4, drafts=K)
    plain = reference_greedy(cfg, params, PROMPT, K + 2)
    forced = [plain[1], plain[2], (plain[3] + 1) % cfg.vocab_size]     # accept 2 of 3: every stage matters
    outs = []
    for v in (ref, mk):
        first, h = v.prefill(PROMPT, max_len=24)
        outs.append((first, v.round(first, h, p, forced[:2])))          # draft 3 from the MTP chain
    (f0, r0), (f1, r1) = outs
    assert f0 == f1 and r0.drafts == r1.drafts and r0.drafts[:2] == forced[:2] and r0.targets == r1.targets
    assert len(r1.targets) == K + 1 and r1.hidden.shape[0] == K + 1
    assert torch.isfinite(r1.hidden).all() and r1.hidden.abs().max() > 0.1
    torch.testing.assert_close(r1.hidden.float(), r0.hidden.float(), rtol=0, atol=1e-4)
    for slot in range(K + 1):  # every checkpoint slot; KV rows p..p+slot and MTP rows p-1..p+slot-1
        ref.commit(slot + 1)
        mk.commit(slot + 1)
        want, got = ref.committed(p + 1 + slot), mk.committed(p + 1 + slot)
        for name in want:
            assert got[name].abs().max() > 0 or want[name].abs().max() == 0, name
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


def test_state_invariant_after_forced_rounds(tiny):
    cfg, params = tiny
    K, pattern = 3, [3, 0, 2, 1]
    plain = reference_greedy(cfg, params, PROMPT, (K + 1) * len(pattern) + 2)
    v = make_decoder("megakernel", cfg, params, tp=1, drafts=K)
    seq, pos = forced_rounds(v, PROMPT, plain, pattern, cfg.vocab_size)
    assert seq[len(PROMPT):] == plain[:len(seq) - len(PROMPT)]
    want, got = reference_decode_state(cfg, params, seq[:-1]), v.committed(pos)
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("drafts", [1, 2, 3])
def test_every_variant_tokens_equal_plain_greedy(tiny, drafts):
    cfg, params = tiny
    plain = reference_greedy(cfg, params, PROMPT, 24)
    for name in ("xla", "layerwise", "megakernel"):
        v = make_decoder(name, cfg, params, tp=4, drafts=drafts)
        res = generate(v, PROMPT, 24, draft_source=alternating(PROMPT, plain, cfg.vocab_size, drafts))
        assert res.tokens == plain, name
        assert set(res.accepted_per_round) == set(range(1, drafts + 2)), name
