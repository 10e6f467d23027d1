"""The host loop: prefill, then rounds of draft / verify / replay with greedy accept, over any engine.

Greedy speculative decoding is lossless: the committed tokens equal plain greedy decoding of the same model. With
one draft token per round, a round emits the target y1 (always right: it is the trunk's own greedy choice after
x_{t+1}) and, when the draft equalled y1, also y2.

:class:`Decoder` is the one host side of every variant: the slot bookkeeping (:class:`SlotBook`), the accept rule
(:func:`accepted_count`), the run-time inputs of each launch (``megakernel.plan.round_inputs`` / ``step_inputs``)
and the prefill: on the host with the reference model when the engine takes a state (``load_state``), otherwise
teacher-forced through the decode launches (``megakernel.plan.teacher_forced_launches``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.engines import LaunchResult
from megakernel import plan as rp
from model.reference import ReferenceModel
from model.state import DecodeState

# A test draft source: given every token so far (prompt + generated), propose the draft for the round instead of
# the MTP head.
DraftSource = Callable[[list[int]], int]


def accepted_count(draft: int, targets: list[int]) -> int:
    """Greedy acceptance of one draft token: 2 when the draft equals the first target, else 1."""
    return 2 if draft == targets[0] else 1


class SlotBook:
    """Which GDN checkpoint slot holds the committed state. A verify of T tokens writes slot j with the state after
    token j; committing n accepted tokens makes slot n-1 the one the next launch reads. Nothing is copied."""

    def __init__(self, slots: int = rp.SLOTS):
        self.slots = slots
        self.read_slot = 0

    def commit(self, accepted: int) -> int:
        if not 1 <= accepted <= self.slots:
            raise ValueError(f"commit: accepted must be in 1..{self.slots}, found {accepted}")
        self.read_slot = accepted - 1
        return self.read_slot

    def reset(self) -> None:
        self.read_slot = 0


class Decoder:
    """The host side of a variant over an engine (``harness.engines.Engine``).

    Positions: after prefill of p prompt tokens the pending token x_p sits at position p and ``hidden`` is
    h_{p-1}. ``round(pending, hidden, pos)`` takes pos = the position of the pending token. ``reference``: the
    host model for the prefill (None: teacher-forced prefill through the engine's decode launches)."""

    def __init__(self, engine, reference: ReferenceModel | None = None):
        self.engine = engine
        self.cfg = engine.cfg
        self.name = engine.name
        self.reference = reference if hasattr(engine, "load_state") else None
        self.slots = SlotBook()

    @property
    def launches(self) -> int:
        return self.engine.launches

    def prefill(self, prompt: list[int], max_len: int) -> tuple[int, torch.Tensor]:
        """Encode the prompt; returns (first generated token, h at the last prompt position). Also fills the MTP KV
        cache for positions 0..p-2 (the MTP at p uses token p+1)."""
        if not prompt:
            raise ValueError("prefill: the prompt is empty")
        self.engine.start(max_len)
        self.slots.reset()
        if self.reference is None:
            return self._teacher_forced(prompt)
        ref, cfg = self.reference, self.cfg
        state = DecodeState.empty(cfg, max_len, slots=rp.SLOTS, dtype=ref.dtype)
        ids = torch.tensor(prompt, dtype=torch.long)
        h = ref.trunk(ids, state, 0, chunked=True)
        first = int(torch.argmax(ref.logits(h[-1:]), dim=-1))
        if cfg.mtp_num_hidden_layers and len(prompt) > 1:
            ref.mtp(ids[1:], h[:-1], state, 0)
        self.engine.load_state(state)
        return first, h[-1]

    def _teacher_forced(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        hidden, out, last = None, None, None
        for launch in rp.teacher_forced_launches(len(prompt)):
            if launch.mode == "step":
                out = self._launch_step(prompt[launch.pos], launch.pos)
            else:
                forced = None if launch.forced is None else prompt[launch.forced]
                out = self.round(prompt[launch.pos], hidden, launch.pos, forced)
            self.slots.commit(launch.accepted)
            hidden, last = out.hidden[launch.accepted - 1], launch.accepted
        return out.targets[last - 1], hidden

    def round(self, pending: int, hidden: torch.Tensor, pos: int, forced_draft: int | None = None) -> LaunchResult:
        """One speculative round; the host then commits 1 or 2 tokens (:meth:`commit`)."""
        return self.engine.run("round", rp.round_inputs(self.cfg, self.engine.dtype, pending, hidden, pos,
                                                        self.slots.read_slot, forced_draft))

    def _launch_step(self, token: int, pos: int) -> LaunchResult:
        return self.engine.run("step", rp.step_inputs(self.cfg, token, pos, self.slots.read_slot))

    def step(self, token: int, pos: int) -> tuple[int, torch.Tensor]:
        """Plain greedy decode of one token at ``pos``: (next token, its hidden [H])."""
        out = self._launch_step(token, pos)
        self.slots.commit(1)
        return out.targets[0], out.hidden[0]

    def commit(self, accepted: int) -> None:
        """Keep the first ``accepted`` (1 or 2) verified tokens' state."""
        self.slots.commit(accepted)

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        """The committed decode state after ``length`` trunk tokens in the reference layout (for the decode-state
        invariant: it must equal plain token-by-token decoding's), when the engine can read its state back."""
        read_back = getattr(self.engine, "reference_state", None)
        if read_back is None:
            raise NotImplementedError(f"{type(self.engine).__name__} cannot read its decode state back")
        return read_back(self.slots.read_slot).committed(length)


def make_decoder(name: str, cfg, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2) -> Decoder:
    """A variant by name (``harness.engines.ENGINE_NAMES``): its in-process engine, prefilled on the host."""
    from harness.engines import make_engine
    return Decoder(make_engine(name, cfg, params, tp=tp, lnc=lnc), ReferenceModel(cfg, params))


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


def generate(decoder: Decoder, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = (),
             spec: bool = True, draft_source: DraftSource | None = None,
             on_tokens: Callable[[list[int]], None] | None = None) -> DecodeResult:
    """Greedy decode of up to max_new_tokens after prompt; stops after an EOS token.

    spec=False: plain decoding, one trunk step per token. on_tokens, if given, is called with each batch of newly
    emitted tokens (for progress display).
    """
    if not prompt:
        raise ValueError("generate: the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, found {max_new_tokens}")
    # The verify of the last round may write one position past the last emitted token.
    pending, hidden = decoder.prefill(prompt, max_len=len(prompt) + max_new_tokens + 1)
    result = DecodeResult(tokens=[pending])
    if on_tokens:
        on_tokens([pending])
    pos = len(prompt)  # position of the pending token

    def finished() -> bool:
        return len(result.tokens) >= max_new_tokens or result.tokens[-1] in eos_ids

    while not finished():
        if not spec:
            pending, hidden = decoder.step(pending, pos)
            pos += 1
            emitted = [pending]
        else:
            forced = draft_source(prompt + result.tokens) if draft_source else None
            r = decoder.round(pending, hidden, pos, forced)
            accepted = accepted_count(r.draft, r.targets)
            decoder.commit(accepted)
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
