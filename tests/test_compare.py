"""tests/compare.py fails where a parity test must: non-finite or all-zero output, out of tolerance, no tolerance."""
import numpy as np
import pytest
import torch

from compare import assert_close, assert_finite_nonzero


def test_passes_within_tolerance_and_returns_the_error():
    want = torch.tensor([1.0, -2.0, 4.0])
    assert assert_close(want + 1e-3, want, rel=1e-3) == pytest.approx(1e-3 / 4, rel=1e-3)   # fp32 inputs
    assert_close(want.to(torch.bfloat16), want.numpy(), rtol=2 ** -8)


@pytest.mark.parametrize("got, match", [
    (torch.tensor([1.0, float("nan"), 4.0]), "non-finite"),
    (torch.zeros(3), "all zero"),
    (torch.tensor([1.0, -2.0, 4.1]), "max \\|got - ref\\|"),
])
def test_fails_on_what_a_parity_test_must_catch(got, match):
    with pytest.raises(AssertionError, match=match):
        assert_close(got, torch.tensor([1.0, -2.0, 4.0]), rel=1e-3)


def test_elementwise_mean_shape_and_missing_tolerance():
    want = np.array([1e-6, 1.0])
    with pytest.raises(AssertionError, match="elements beyond"):
        assert_close(np.array([2e-6, 1.0]), want, rtol=1e-3)          # tiny element, large relative error
    assert_close(np.array([2e-6, 1.0]), want, rel=1e-3)                 # fine against the output's scale
    with pytest.raises(AssertionError, match="mean"):
        assert_close(np.array([1.5, 2.5]), np.array([1.0, 2.0]), rel=0.3, mean_rel=0.2)
    with pytest.raises(AssertionError, match="shape"):
        assert_close(np.ones(3), np.ones(4), rel=1)
    with pytest.raises(ValueError):
        assert_close(np.ones(3), np.ones(3))
    with pytest.raises(AssertionError, match="all zero"):
        assert_finite_nonzero(np.zeros(2), "x")
