"""Host-side tensor conversions shared by the layout helpers (plain torch/numpy, never traced).

Layout helpers build the kernels' HBM layouts with torch ops, so they also run on ``meta`` tensors:
that is how the full-size model's per-rank argument shapes are derived without allocating weights
(``harness.kernel_cases.rank_tensors``).
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


def feature_major(x) -> np.ndarray:
    """Token-major ``[T, H]`` (torch or numpy) -> the kernels' feature-major layout ``[P, H/P, T]`` (numpy, same
    dtype): element (p, j, t) = x[t, j*P + p] (nki_kernels/README.md "Shared SBUF layouts")."""
    from nki_kernels.common import P
    a = to_numpy(x)
    T, H = a.shape
    if H % P:
        raise ValueError(f"feature_major: hidden size {H} is not a multiple of {P}")
    return np.ascontiguousarray(a.T.reshape(H // P, P, T).transpose(1, 0, 2))


def from_feature_major(xT) -> np.ndarray:
    """The inverse of :func:`feature_major`: ``[..., P, H/P, T]`` -> ``[..., T, H]`` (numpy, same dtype)."""
    a = to_numpy(xT)
    p, j, t = a.shape[-3:]
    return np.ascontiguousarray(np.swapaxes(a, -1, -3).reshape(*a.shape[:-3], t, j * p))
