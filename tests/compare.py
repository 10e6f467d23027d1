"""The one comparison every parity test uses: the output is finite, not all zero, and close to its reference.

``assert_close(got, want, rel=...)`` checks ``max |got - want| <= rel * max |want|`` (the scale-relative norm
of the kernel tests: the error is judged against the output's magnitude, not element by element, so tiny
elements near zero do not dominate); ``rtol`` / ``atol`` check element-wise ``|got - want| <= atol + rtol *
|want|`` instead; ``mean_rel`` also bounds ``mean |got - want|`` relative to ``max |want|``. Both sides may be
torch tensors or numpy arrays of any float dtype (compared in float64). Returns the observed scale-relative
error so a test can report or bound it further.
"""

from __future__ import annotations

import numpy as np
import torch


def as_float64(x) -> np.ndarray:
    """A torch tensor (any dtype, bf16 included) or array-like as a float64 numpy array."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64).cpu().numpy()
    return np.asarray(x, dtype=np.float64)


def assert_finite_nonzero(got, name: str = "output") -> None:
    g = as_float64(got)
    assert np.isfinite(g).all(), f"{name} has non-finite values"
    assert g.size and np.abs(g).max() > 0, f"{name} is all zero"


def assert_close(got, want, *, rel: float | None = None, rtol: float | None = None, atol: float = 0.0,
                 mean_rel: float | None = None, name: str = "output") -> float:
    """Assert ``got`` is finite, not all zero and within tolerance of ``want`` (same shape); returns
    max |got - want| / max |want|. Give ``rel`` (scale-relative max error), ``rtol`` (element-wise, with
    ``atol``), or both."""
    if rel is None and rtol is None:
        raise ValueError("assert_close needs a tolerance: rel= or rtol=")
    g, w = as_float64(got), as_float64(want)
    assert g.shape == w.shape, f"{name}: shape {g.shape} vs reference {w.shape}"
    assert_finite_nonzero(g, name)
    assert np.isfinite(w).all(), f"{name}: the reference has non-finite values"
    scale = float(np.abs(w).max())
    assert scale > 0, f"{name}: the reference is all zero"
    diff = np.abs(g - w)
    err = float(diff.max()) / scale
    if rel is not None:
        assert err <= rel, f"{name}: max |got - ref| = {err:.3g} of max |ref| (tolerance {rel:g})"
    if rtol is not None:
        bad = diff > atol + rtol * np.abs(w)
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.size} elements beyond atol {atol:g} + rtol "
                               f"{rtol:g} (worst |got - ref| {float(diff.max()):.3g})")
    if mean_rel is not None:
        mean = float(diff.mean()) / scale
        assert mean <= mean_rel, f"{name}: mean |got - ref| = {mean:.3g} of max |ref| (tolerance {mean_rel:g})"
    return err
