"""The TP collectives the twins use, injected by the executor (so one rank's math runs anywhere): on trn2 NxD's
``reduce_from_tensor_model_parallel_region`` / ``gather_from_tensor_model_parallel_region``
(neuronx-distributed ``parallel_layers/mappings.py``), on CPU a thread per rank (``harness.xla.ThreadWorld``),
for one rank the identity (:data:`SINGLE_RANK`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class Collectives:
    """TP collectives of one rank. all_reduce: elementwise sum over the ranks (the same tensor on every rank, in a
    fixed rank order); gather_last: concatenation over the ranks along the last dim, in rank order."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    gather_last: Callable[[torch.Tensor], torch.Tensor]

    def gather_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """[*s] on every rank -> [tp, *s]: rank r's tensor at index r."""
        return self.gather_last(t.unsqueeze(-1)).movedim(-1, 0)


def _same(t: torch.Tensor) -> torch.Tensor:
    return t


SINGLE_RANK = Collectives(all_reduce=_same, gather_last=_same)
