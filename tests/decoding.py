"""Test-only decoding helpers: plain greedy tokens and the decode state of token-by-token decoding with the
single-device reference model (the truth every variant is compared with), and rounds with forced drafts."""

from __future__ import annotations

import torch

from harness.engines import LaunchResult
from harness.speculative import Decoder, accepted_count
from megakernel.plan import DEFAULT_DRAFTS, forced_drafts
from model.reference import ReferenceModel
from model.state import DecodeState


class ReferenceDecoder:
    """The single-device reference model behind the decoder interface (``prefill`` / ``round`` / ``step`` /
    ``commit`` / ``committed``): the truth the variants' rounds and states are compared with. Prefill is chunked,
    a round of K drafts is D1 on (pending, h) at pos - 1, then on (d_i, the MTP's own hidden) at pos - 1 + i, the
    verify of [pending, d_1 .. d_K] and D2 on ([d_1 .. d_K], [h_pos .. h_{pos+K-1}]) at pos .. pos + K - 1
    (``megakernel.plan``)."""

    def __init__(self, cfg, params, drafts: int = DEFAULT_DRAFTS):
        self.cfg, self.ref, self.drafts = cfg, ReferenceModel(cfg, params), drafts
        self.state = None

    def prefill(self, prompt: list[int], max_len: int):
        ref = self.ref
        self.state = DecodeState.empty(self.cfg, max_len, slots=self.drafts + 1, dtype=ref.dtype)
        ids = torch.tensor(prompt, dtype=torch.long)
        h = ref.trunk(ids, self.state, 0, chunked=True)
        if self.cfg.mtp_num_hidden_layers and len(prompt) > 1:
            ref.mtp(ids[1:], h[:-1], self.state, 0)
        return int(torch.argmax(ref.logits(h[-1:]), dim=-1)), h[-1]

    def step(self, token: int, pos: int):
        h = self.ref.trunk(torch.tensor([token]), self.state, pos, chunked=False)
        self.state.commit(1)
        return int(torch.argmax(self.ref.logits(h), dim=-1)), h[0]

    def round(self, pending: int, hidden, pos: int, forced_draft=None) -> LaunchResult:
        ref, st, K = self.ref, self.state, self.drafts
        forced = forced_drafts(forced_draft, K)
        drafts, token, h = [], pending, hidden[None]
        for i in range(K):
            h = ref.mtp(torch.tensor([token]), h, st, pos - 1 + i)
            token = forced[i] if i < len(forced) else int(torch.argmax(ref.logits(h), dim=-1))
            drafts.append(token)
        hv = ref.trunk(torch.tensor([pending] + drafts), st, pos, chunked=False)
        targets = torch.argmax(ref.logits(hv), dim=-1)
        ref.mtp(torch.tensor(drafts), hv[:K], st, pos)
        return LaunchResult(drafts, [int(t) for t in targets], hv)

    def commit(self, accepted: int) -> None:
        self.state.commit(accepted)

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        return self.state.committed(length)


def reference_greedy(cfg, params, prompt: list[int], n: int) -> list[int]:
    """The first ``n`` plain greedy tokens after ``prompt`` (reference model, chunked prefill, then steps)."""
    ref = ReferenceDecoder(cfg, params)
    out = [ref.prefill(prompt, len(prompt) + n + 1)[0]]
    while len(out) < n:
        out.append(ref.step(out[-1], len(prompt) + len(out) - 1)[0])
    return out


def reference_decode_state(cfg, params, tokens: list[int]) -> dict[str, torch.Tensor]:
    """The committed state after plain decoding of ``tokens`` (prefill of the first, then one trunk step each),
    with the MTP cache filled the way speculative decoding fills it (rows 0..len-2), reference layout."""
    ref = ReferenceDecoder(cfg, params)
    hiddens = [ref.prefill(tokens[:1], len(tokens) + 2)[1]]
    for pos, tok in enumerate(tokens[1:], start=1):
        hiddens.append(ref.step(tok, pos)[1])
    if cfg.mtp_num_hidden_layers and len(tokens) > 1:
        ref.ref.mtp(torch.tensor(tokens[1:]), torch.stack(hiddens[:-1]), ref.state, 0)
    return ref.state.committed(len(tokens))


def forced_rounds(decoder: Decoder, prompt: list[int], plain: list[int], accepts: list, vocab_size: int
                  ) -> tuple[list[int], int]:
    """Prefill, then one round per entry of ``accepts``: the number of drafts forced to be right (the plain greedy
    tokens ``plain`` predicts; a bool: True = all K, False = 0), the next one forced wrong (that token + 1, if
    any), the rest left to the MTP head. Checks each round accepted exactly as forced and returns (prompt +
    committed tokens including the pending one, position of the pending token)."""
    K = getattr(decoder, "drafts", DEFAULT_DRAFTS)
    pending, hidden = decoder.prefill(prompt, max_len=len(prompt) + (K + 1) * len(accepts) + K + 2)
    seq, pos = prompt + [pending], len(prompt)
    for accept in accepts:
        right, forced = forced_accept(accept, K, plain, len(seq) - len(prompt), vocab_size)
        r = decoder.round(pending, hidden, pos, forced)
        n = accepted_count(r.drafts, r.targets)
        if n != right + 1:
            raise AssertionError(f"round at position {pos}: forced {right} right drafts, got {n} tokens")
        decoder.commit(n)
        seq += list(r.targets[:n])
        pending, hidden, pos = seq[-1], r.hidden[n - 1], pos + n
    return seq, pos


def forced_accept(accept, drafts: int, plain: list[int], base: int, vocab_size: int) -> tuple[int, list[int]]:
    """(right, forced drafts) of a round whose first ``right`` drafts are forced right and the next one wrong:
    ``accept`` an int, or a bool (True = all K, False = 0); ``base``: the index in ``plain`` of the round's first
    draft."""
    right = (drafts if accept else 0) if isinstance(accept, bool) else int(accept)
    forced = [plain[base + i] for i in range(right)]
    if right < drafts:
        forced.append((plain[base + right] + 1) % vocab_size)
    return right, forced


def right_draft(prompt: list[int], plain: list[int], drafts: int = 1):
    """Draft source proposing the plain greedy tokens for the ``drafts`` draft positions (0 past the end of
    ``plain``)."""
    def source(seq):
        i = len(seq) - len(prompt)
        return [plain[j] if j < len(plain) else 0 for j in range(i, i + drafts)]
    return source


def alternating(prompt: list[int], plain: list[int], vocab: int, drafts: int = 1):
    """Rounds whose accepted prefix cycles through K, 0, K-1, 1, ... right drafts (then one wrong one): every
    accept length 0..K runs. K = 1: right, wrong, right, ..."""
    right, calls = right_draft(prompt, plain, drafts), []
    cycle = [n for pair in zip(range(drafts, -1, -1), range(drafts + 1)) for n in pair][:drafts + 1]

    def source(seq):
        n = cycle[len(calls) % len(cycle)]
        calls.append(1)
        want = right(seq)
        return want[:n] + ([(want[n] + 1) % vocab] if n < drafts else [])
    return source



def assert_round_matches_reference(cfg, params, prompt, tp: int = 4):
    """One megakernel round after the prompt's prefill against the reference round (:func:`assert_same_round`)."""
    from harness.speculative import make_decoder
    ref, mk = ReferenceDecoder(cfg, params), make_decoder("megakernel", cfg, params, tp=tp)
    outs = []
    for v in (ref, mk):
        first, h = v.prefill(prompt, max_len=24)
        outs.append((first, v.round(first, h, len(prompt))))
    (f0, r0), (f1, r1) = outs
    assert f0 == f1
    assert_same_round(ref, mk, r0, r1, len(prompt))


def assert_same_round(ref, v, r0, r1, p: int):
    """Round r1 of decoder v equals the reference decoder's round r0 (both after a prefill of p tokens): drafts and
    targets equal; the hidden (finite, not all zero), every checkpoint slot and the KV rows p, p+1 (and the MTP
    rows p-1, p) within 1e-4 (fp32 weights, another summation order). Commits both decoders' slots."""
    from compare import assert_close
    assert (r1.drafts, r1.targets) == (r0.drafts, r0.targets)
    assert torch.isfinite(r1.hidden).all() and r1.hidden.abs().max() > 0.1
    assert_close(r1.hidden, r0.hidden, rtol=0, atol=1e-4, name="round hidden vs reference")
    for slot in (0, 1):
        ref.commit(slot + 1)
        v.commit(slot + 1)
        want, got = ref.committed(p + 1 + slot), v.committed(p + 1 + slot)
        for name in want:
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)
