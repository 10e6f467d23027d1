"""RMSNorm twin (``nki_kernels/rmsnorm.py``): the norm is replicated on every rank and core, so the rank's
math is the full ``model.functional.rms_norm``; :func:`feature_major` gives the kernel's output layout."""

from __future__ import annotations

import torch

from model import functional as fn

P = 128


def rmsnorm_rank(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of the residual x [T, H] (every rank computes all of it). Returns [T, H] in x's dtype."""
    return fn.rms_norm(x, weight, eps)


def feature_major(y: torch.Tensor) -> torch.Tensor:
    """Token-major [T, H] -> the shared feature-major layout [128, H/128, T]: element (p, j, t) = y[t, j*128 + p]."""
    t, h = y.shape
    if h % P:
        raise ValueError(f"feature_major: hidden size {h} is not a multiple of {P}")
    return y.reshape(t, h // P, P).permute(2, 1, 0).contiguous()
