"""RMSNorm twin (``nki_kernels/rmsnorm.py``): the norm is replicated on every rank and core, so the rank's
math is the full ``model.functional.rms_norm`` (the kernel's feature-major output: ``nki_kernels.host.feature_major``)."""

from __future__ import annotations

import torch

from model import functional as fn


def rmsnorm_rank(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm of the residual x [T, H] (every rank computes all of it). Returns [T, H] in x's dtype."""
    return fn.rms_norm(x, weight, eps)
