"""Test-only decoding helpers: plain greedy tokens and the decode state of token-by-token decoding with the
single-device reference model (the truth every variant is compared with), and rounds with forced drafts."""

from __future__ import annotations

import torch

from harness.engines import LaunchResult
from harness.speculative import Decoder, accepted_count
from megakernel.plan import SLOTS
from model.reference import ReferenceModel
from model.state import DecodeState


class ReferenceDecoder:
    """The single-device reference model behind the decoder interface (``prefill`` / ``round`` / ``step`` /
    ``commit`` / ``committed``): the truth the variants' rounds and states are compared with. Prefill is chunked,
    a round is D1 on (pending, h) at pos - 1, the verify of [pending, draft] and D2 at pos, as DESIGN.md §1."""

    def __init__(self, cfg, params):
        self.cfg, self.ref = cfg, ReferenceModel(cfg, params)
        self.state = None

    def prefill(self, prompt: list[int], max_len: int):
        ref = self.ref
        self.state = DecodeState.empty(self.cfg, max_len, slots=SLOTS, dtype=ref.dtype)
        ids = torch.tensor(prompt, dtype=torch.long)
        h = ref.trunk(ids, self.state, 0, chunked=True)
        if self.cfg.mtp_num_hidden_layers and len(prompt) > 1:
            ref.mtp(ids[1:], h[:-1], self.state, 0)
        return int(torch.argmax(ref.logits(h[-1:]), dim=-1)), h[-1]

    def step(self, token: int, pos: int):
        h = self.ref.trunk(torch.tensor([token]), self.state, pos, chunked=False)
        self.state.commit(1)
        return int(torch.argmax(self.ref.logits(h), dim=-1)), h[0]

    def round(self, pending: int, hidden, pos: int, forced_draft: int | None = None) -> LaunchResult:
        ref, st = self.ref, self.state
        h_mtp = ref.mtp(torch.tensor([pending]), hidden[None], st, pos - 1)
        draft = int(torch.argmax(ref.logits(h_mtp), dim=-1)) if forced_draft is None else forced_draft
        hv = ref.trunk(torch.tensor([pending, draft]), st, pos, chunked=False)
        targets = torch.argmax(ref.logits(hv), dim=-1)
        ref.mtp(torch.tensor([draft]), hv[:1], st, pos)
        return LaunchResult(draft, [int(t) for t in targets], hv)

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


def forced_rounds(decoder: Decoder, prompt: list[int], plain: list[int], accepts: list[bool],
                  vocab_size: int) -> tuple[list[int], int]:
    """Prefill, then one round per entry of ``accepts`` with the draft forced to be right (the plain greedy token
    ``plain`` predicts) or wrong (that token + 1). Checks each round accepted exactly as forced and returns
    (prompt + committed tokens including the pending one, position of the pending token)."""
    pending, hidden = decoder.prefill(prompt, max_len=len(prompt) + 2 * len(accepts) + 3)
    seq, pos = prompt + [pending], len(prompt)
    for accept in accepts:
        truth = plain[len(seq) - len(prompt)]
        r = decoder.round(pending, hidden, pos, truth if accept else (truth + 1) % vocab_size)
        n = accepted_count(r.draft, r.targets)
        if n != (2 if accept else 1):
            raise AssertionError(f"round at position {pos}: forced {'accept' if accept else 'reject'}, got {n} tokens")
        decoder.commit(n)
        seq += list(r.targets[:n])
        pending, hidden, pos = seq[-1], r.hidden[n - 1], pos + n
    return seq, pos


def right_draft(prompt: list[int], plain: list[int]):
    """Draft source proposing the plain greedy token for the draft position (0 past the end of ``plain``)."""
    return lambda seq: plain[len(seq) - len(prompt)] if len(seq) - len(prompt) < len(plain) else 0


def alternating(prompt: list[int], plain: list[int], vocab: int):
    """Right, wrong, right, ... drafts: both accept paths run."""
    right, calls = right_draft(prompt, plain), []

    def source(seq):
        calls.append(1)
        return right(seq) if len(calls) % 2 else (right(seq) + 1) % vocab
    return source
