"""The host loop: prefill, then rounds of draft / verify / replay with greedy accept.

Greedy speculative decoding is lossless: the committed tokens equal plain greedy
decoding of the same model. With one draft token per round, a round emits the
target y1 (always right: it is the trunk's own greedy choice after x_{t+1}) and, when
the draft equalled y1, also y2.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.variants import Variant

# A test draft source: given every token so far (prompt + generated), propose the
# draft for the round instead of the MTP head.
DraftSource = Callable[[list[int]], int]


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accepted_per_round: list[int] = field(default_factory=list)  # tokens emitted by each round (1 or 2)

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of drafts accepted (0 when no round ran)."""
        return sum(a - 1 for a in self.accepted_per_round) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_round(self) -> float:
        return sum(self.accepted_per_round) / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "rounds": self.rounds,
            "accepted_per_round": self.accepted_per_round,
            "acceptance_rate": self.acceptance_rate,
            "tokens_per_round": self.tokens_per_round,
        }


def generate(variant: Variant, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = (),
             spec: bool = True, draft_source: DraftSource | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Greedy decode of up to max_new_tokens after prompt; stops after an EOS token.

    spec=False: plain decoding, one trunk step per token. on_tokens, if given, is
    called with each batch of newly emitted tokens (for progress display).
    """
    if not prompt:
        raise ValueError("generate: the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, found {max_new_tokens}")
    # The verify of the last round may write one position past the last emitted token.
    pending, hidden = variant.prefill(prompt, max_len=len(prompt) + max_new_tokens + 1)
    result = DecodeResult(tokens=[pending])
    if on_tokens:
        on_tokens([pending])
    pos = len(prompt)  # position of the pending token

    def finished() -> bool:
        return len(result.tokens) >= max_new_tokens or result.tokens[-1] in eos_ids

    while not finished():
        if not spec:
            pending, hidden = variant.step(pending, pos)
            pos += 1
            emitted = [pending]
        else:
            forced = draft_source(prompt + result.tokens) if draft_source else None
            r = variant.round(pending, hidden, pos, forced)
            accepted = 2 if r.draft == r.targets[0] else 1
            variant.commit(accepted)
            emitted = list(r.targets[:accepted])
            result.accepted_per_round.append(accepted)
            pending, hidden = emitted[-1], r.hidden[accepted - 1]
            pos += accepted
        for tok in emitted:  # honour max_new_tokens and EOS inside a 2-token round
            if finished():
                break
            result.tokens.append(tok)
        if on_tokens:
            on_tokens(emitted)
    return result


def forced_rounds(variant: Variant, prompt: list[int], plain: list[int], accepts: list[bool],
                  vocab_size: int) -> tuple[list[int], int]:
    """Prefill, then one round per entry of ``accepts`` with the draft forced to be right (the plain
    greedy token ``plain`` predicts) or wrong (that token + 1). Checks each round accepted exactly as
    forced and returns (prompt + committed tokens including the pending one, position of the pending
    token). For the decode-state invariant tests of every variant."""
    pending, hidden = variant.prefill(prompt, max_len=len(prompt) + 2 * len(accepts) + 3)
    seq, pos = prompt + [pending], len(prompt)
    for accept in accepts:
        truth = plain[len(seq) - len(prompt)]
        r = variant.round(pending, hidden, pos, truth if accept else (truth + 1) % vocab_size)
        n = 2 if r.draft == r.targets[0] else 1
        if n != (2 if accept else 1):
            raise AssertionError(f"round at position {pos}: forced {'accept' if accept else 'reject'}, "
                                 f"got {n} tokens")
        variant.commit(n)
        seq += list(r.targets[:n])
        pending, hidden, pos = seq[-1], r.hidden[n - 1], pos + n
    return seq, pos


def token_by_token_state(variant: Variant, tokens: list[int]) -> dict[str, torch.Tensor]:
    """State after plain decoding of `tokens` (prefill of the first, then one trunk step
    each), with the MTP cache filled the way speculative decoding fills it (rows
    0..len-2). For the decode-state invariant tests."""
    _, h0 = variant.prefill(tokens[:1], max_len=len(tokens) + 2)
    hiddens = [h0]
    for pos, tok in enumerate(tokens[1:], start=1):
        hiddens.append(variant.step(tok, pos)[1])
    if variant.cfg.mtp_num_hidden_layers and len(tokens) > 1:
        variant.ref.mtp(torch.tensor(tokens[1:]), torch.stack(hiddens[:-1]), variant.state, 0)
    return variant.state.committed(len(tokens))
