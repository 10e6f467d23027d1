"""Host-side tensor conversions shared by the layout helpers (plain torch/numpy, never traced).

Layout helpers build the kernels' HBM layouts with torch ops, so they also run on ``meta`` tensors:
that is how the full-size model's per-rank argument shapes are derived without allocating weights
(``megakernel.round.demo_args``).
"""

from __future__ import annotations

import numpy as np
import torch


def as_torch(x) -> torch.Tensor:
    """A torch tensor of x: torch as is; numpy (including ml_dtypes bfloat16) without a copy when contiguous."""
    if isinstance(x, torch.Tensor):
        return x
    a = np.ascontiguousarray(x)
    if a.dtype.name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def to_numpy(x) -> np.ndarray:
    """A numpy array of x (torch bfloat16 becomes ml_dtypes.bfloat16)."""
    if isinstance(x, torch.Tensor):
        t = x.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    return np.asarray(x)
