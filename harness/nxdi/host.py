"""The host side of the NxDI adapter: slot bookkeeping, the teacher-forced prefill schedule, and a
``harness.variants.Variant`` over any *engine* that launches the round/step graphs.

An engine owns the device-side weights and decode state and runs one launch at a time:
``engine.run(mode, runtime) -> assembly.LaunchResult`` with ``runtime`` from ``assembly.round_inputs`` /
``step_inputs``, and ``engine.reset()`` zeroes the decode state. Engines:
``harness.nxdi.cpu.CpuEngine`` (both backends on CPU: the xla backend over a thread per rank, the
megakernel under nkisim) and ``harness.nxdi.modeling.NeuronEngine`` (trn2 only, never executed here).

Prefill without a prefill graph
-------------------------------
The NxDI application has no context-encoding graph: a prompt x_0..x_{n-1} is fed through the same
graphs that decode, teacher-forced (:func:`prefill_plan`):

* a step at position 0 on x_0 (no MTP: nothing precedes x_0);
* then rounds at p = 1, 3, 5, ...: pending x_p, the draft FORCED to x_{p+1}, both committed. The round's
  D1 writes the MTP KV row p-1 = MTP(x_p, h_{p-1}), its verify the trunk state of x_p, x_{p+1}, its D2
  the MTP row p = MTP(x_{p+1}, h_p): exactly the rows a prefill writes (MTP at p uses token p+1).
* if one prompt token is left over (n even), a last round on it commits only that token; its D2 row is
  overwritten by the next round's D1 before anything reads it.

The first generated token is the last launch's target of the last prompt token, its hidden the hidden
there: what ``Variant.prefill`` returns. 1 + ceil((n-1)/2) launches. Why no prefill graph: its weights
would have to be in PyTorch layout next to the kernels' layout, and two copies of the 35B-parameter
model (~70 GB each in bf16) do not fit the 96 GiB of one trn2 chip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from harness.nxdi.assembly import SLOTS, LaunchResult, round_inputs, step_inputs
from harness.variants import RoundOutput, Variant
from model.config import ModelConfig


class Engine(Protocol):
    cfg: ModelConfig
    dtype: torch.dtype
    max_len: int     # positions the decode state holds (KV rows)
    launches: int

    def reset(self) -> None: ...

    def run(self, mode: str, runtime: dict) -> LaunchResult: ...


class SlotBook:
    """Which GDN checkpoint slot holds the committed state. A verify of T tokens writes slot j with the
    state after token j; committing n accepted tokens makes slot n-1 the one the next launch reads.
    Nothing is copied."""

    def __init__(self, slots: int = SLOTS):
        self.slots = slots
        self.read_slot = 0

    def commit(self, accepted: int) -> int:
        if not 1 <= accepted <= self.slots:
            raise ValueError(f"commit: accepted must be in 1..{self.slots}, found {accepted}")
        self.read_slot = accepted - 1
        return self.read_slot

    def reset(self) -> None:
        self.read_slot = 0


def accepted_count(draft: int, targets: list[int]) -> int:
    """Greedy acceptance of one draft token: 2 when the draft equals the first target, else 1."""
    return 2 if draft == targets[0] else 1


@dataclass(frozen=True)
class PrefillLaunch:
    """One launch of the teacher-forced prefill (indices are prompt positions)."""

    mode: str            # "step" or "round"
    pos: int             # position of the pending token (= its prompt index)
    forced: int | None   # prompt index of the forced draft (None: no forcing, the draft is not committed)
    accepted: int        # tokens of this launch committed (1 or 2)


def prefill_plan(n: int) -> list[PrefillLaunch]:
    """The launches that feed an n-token prompt (module docstring)."""
    if n < 1:
        raise ValueError(f"prefill: the prompt is empty")
    plan = [PrefillLaunch("step", 0, None, 1)]
    for p in range(1, n, 2):
        plan.append(PrefillLaunch("round", p, p + 1, 2) if p + 1 < n else PrefillLaunch("round", p, None, 1))
    return plan


class NxdiVariant(Variant):
    """``harness.variants.Variant`` over an engine: the same host loop (``harness.speculative.generate``)
    drives the NxDI graphs. Prefill is teacher-forced through the decode graphs (module docstring)."""

    def __init__(self, engine: Engine, name: str = "nxdi"):
        self.cfg = engine.cfg
        self.engine = engine
        self.name = name
        self.slots = SlotBook()
        self.ref = None     # no host-side model: everything runs on the engine
        self.state = None

    @property
    def launches(self) -> int:
        return self.engine.launches

    def _check_len(self, max_len: int):
        if max_len > self.engine.max_len:
            raise ValueError(f"{self.name}: the sequence needs {max_len} positions, the engine's decode state "
                             f"holds {self.engine.max_len} (compile with a larger --max-len)")

    def _round(self, pending: int, hidden: torch.Tensor, pos: int, forced: int | None) -> LaunchResult:
        self._check_len(pos + 2)
        return self.engine.run("round", round_inputs(self.cfg, self.engine.dtype, pending, hidden, pos,
                                                     self.slots.read_slot, forced))

    def _step(self, token: int, pos: int) -> LaunchResult:
        self._check_len(pos + 1)
        return self.engine.run("step", step_inputs(self.cfg, token, pos, self.slots.read_slot))

    def prefill(self, prompt: list[int], max_len: int) -> tuple[int, torch.Tensor]:
        self._check_len(max_len)
        self.engine.reset()
        self.slots.reset()
        hidden = None
        out = None
        for launch in prefill_plan(len(prompt)):
            if launch.mode == "step":
                out = self._step(prompt[launch.pos], launch.pos)
            else:
                forced = None if launch.forced is None else prompt[launch.forced]
                out = self._round(prompt[launch.pos], hidden, launch.pos, forced)
            self.slots.commit(launch.accepted)
            hidden = out.hidden[launch.accepted - 1]
        last = prefill_plan(len(prompt))[-1].accepted
        return out.targets[last - 1], hidden

    def round(self, pending: int, hidden: torch.Tensor, pos: int, forced_draft: int | None = None) -> RoundOutput:
        out = self._round(pending, hidden, pos, forced_draft)
        return RoundOutput(out.draft, (out.targets[0], out.targets[1]), out.hidden)

    def step(self, token: int, pos: int) -> tuple[int, torch.Tensor]:
        out = self._step(token, pos)
        self.slots.commit(1)
        return out.targets[0], out.hidden[0]

    def commit(self, accepted: int) -> None:
        self.slots.commit(accepted)

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        """The committed state in the reference layout, when the engine can read its state back."""
        read_back = getattr(self.engine, "reference_state", None)
        if read_back is None:
            raise NotImplementedError(f"{type(self.engine).__name__} cannot read its decode state back")
        return read_back(self.slots.read_slot).committed(length)
