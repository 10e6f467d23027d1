"""Variants: the device-side half of speculative decoding behind one interface.

A variant owns the model and its DecodeState. The host loop (harness.speculative)
owns the tokens and the accept logic. One decode *round* (DESIGN.md §1):

* D1 draft:   MTP at position t on (x_{t+1}, h_t) -> draft d for position t+2
* V verify:   trunk on [x_{t+1}, d] at positions t+1, t+2 -> targets y1, y2, hiddens
* D2 replay:  MTP at position t+1 on (d, h_{t+1}) -> its KV row (kept if d is accepted)

Prefill (context encoding) is the PyTorch reference for every variant; it leaves
the state in the layout the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig
from model.reference import ReferenceModel
from model.state import DecodeState


@dataclass
class RoundOutput:
    """What one round returns to the host."""

    draft: int
    targets: tuple[int, int]  # greedy tokens predicted at positions t+1 and t+2
    hidden: torch.Tensor  # [2, H] post-final-norm trunk hidden at t+1 and t+2


class Variant:
    """Base class: prefill on the reference model; subclasses implement the round.

    Positions: after prefill of p prompt tokens the pending token x_p sits at position
    p and ``hidden`` is h_{p-1}. ``round(pending, hidden, pos)`` takes pos = position
    of the pending token.
    """

    name = "base"

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.ref = ReferenceModel(cfg, params)
        self.state: DecodeState | None = None

    def prefill(self, prompt: list[int], max_len: int) -> tuple[int, torch.Tensor]:
        """Encode the prompt; returns (first generated token, h at the last prompt position).

        Also fills the MTP KV cache for positions 0..p-2 (MTP at p uses token p+1).
        """
        self.state = DecodeState.empty(self.cfg, max_len, slots=2, dtype=self.ref.dtype)
        ids = torch.tensor(prompt, dtype=torch.long)
        h = self.ref.trunk(ids, self.state, 0, chunked=True)
        first = int(torch.argmax(self.ref.logits(h[-1:]), dim=-1))
        if self.cfg.mtp_num_hidden_layers and len(prompt) > 1:
            self.ref.mtp(ids[1:], h[:-1], self.state, 0)
        return first, h[-1]

    def step(self, token: int, pos: int) -> tuple[int, torch.Tensor]:
        """Plain greedy decode of one token at `pos`: (next token, its hidden [H])."""
        h = self.ref.trunk(torch.tensor([token]), self.state, pos, chunked=False)
        self.state.commit(1)
        return int(torch.argmax(self.ref.logits(h), dim=-1)), h[0]

    def round(self, pending: int, hidden: torch.Tensor, pos: int, forced_draft: int | None = None) -> RoundOutput:
        raise NotImplementedError(f"variant {self.name!r} does not implement speculative rounds")

    def commit(self, accepted: int) -> None:
        """Keep the first `accepted` (1 or 2) verified tokens' state."""
        self.state.commit(accepted)

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        """The committed decode state after `length` trunk tokens, in the reference layout (for the
        decode-state invariant: it must equal plain token-by-token decoding's)."""
        return self.state.committed(length)


class XlaVariant(Variant):
    """The plain model: every round is the PyTorch reference, no custom kernels."""

    name = "xla"

    def round(self, pending: int, hidden: torch.Tensor, pos: int, forced_draft: int | None = None) -> RoundOutput:
        ref, st = self.ref, self.state
        h_mtp = ref.mtp(torch.tensor([pending]), hidden[None], st, pos - 1)
        draft = int(torch.argmax(ref.logits(h_mtp), dim=-1))
        if forced_draft is not None:
            draft = forced_draft
        hv = ref.trunk(torch.tensor([pending, draft]), st, pos, chunked=False)
        targets = torch.argmax(ref.logits(hv), dim=-1)
        ref.mtp(torch.tensor([draft]), hv[:1], st, pos)
        return RoundOutput(draft, (int(targets[0]), int(targets[1])), hv)


VARIANT_NAMES = ("xla", "layerwise", "megakernel")


def make_variant(name: str, cfg: ModelConfig, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2) -> Variant:
    """A variant by name; the kernel variants (run under nkisim) shard over ``tp`` ranks x ``lnc`` cores."""
    if name == "xla":
        return XlaVariant(cfg, params)
    from harness.kernel_variants import LayerwiseVariant, MegakernelVariant
    kinds = {"layerwise": LayerwiseVariant, "megakernel": MegakernelVariant}
    if name not in kinds:
        raise ValueError(f"unknown variant {name!r}; expected one of {VARIANT_NAMES}")
    return kinds[name](cfg, params, tp=tp, lnc=lnc)
