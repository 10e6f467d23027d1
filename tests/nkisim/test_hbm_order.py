"""Cross-core ordering of shared HBM (nkisim.hbm_order): under LNC=2 a core reads bytes the other core wrote only
across a core_barrier on that tensor (SDK nki.isa.core_barrier: the ordering is per tensor)."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import NkiValidationError
from nkisim.errors import NkiFidelityWarning

RULE = r"no core_barrier\(data=\) on that tensor.*CORE_BARRIER_ORDER"


@nki.jit
def exchange(x, barrier):
    """Core 0 writes row 0 of a shared scratch, core 1 reads it; row 1 both write (the same values) and read."""
    pid = nl.program_id(0)
    scratch = nl.ndarray((2, 8), x.dtype, buffer=nl.shared_hbm, name="scratch")
    other = nl.ndarray((2, 8), x.dtype, buffer=nl.shared_hbm, name="other")
    out = nl.ndarray((2, 8), x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 8), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[0:1, :])
    nisa.dma_copy(dst=scratch[1:2, :], src=t)
    if pid == 0:
        nisa.dma_copy(dst=scratch[0:1, :], src=t)
        nisa.dma_copy(dst=other[0:1, :], src=t)
    if barrier != "none":
        nisa.core_barrier(data=scratch if barrier == "scratch" else other, cores=(0, 1))
    if pid == 1:
        nisa.dma_copy(dst=t, src=scratch[0:1, :])
    nisa.dma_copy(dst=t, src=scratch[1:2, :])
    nisa.dma_copy(dst=out[pid:pid + 1, :], src=t)
    return out


@nki.jit
def overwrite(state, barrier):
    """In-place state: core 1 reads row 0, then core 0 overwrites it (a write after the other core's read)."""
    pid = nl.program_id(0)
    out = nl.ndarray((1, 8), state.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 8), state.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=state[1:2, :])
    if pid == 1:
        nisa.dma_copy(dst=t, src=state[0:1, :])
        nisa.dma_copy(dst=out, src=t)
    if barrier:
        nisa.core_barrier(data=state, cores=(0, 1))
    if pid == 0:
        nisa.dma_copy(dst=state[0:1, :], src=t)
    return out


def _run(barrier):
    x = np.arange(16, dtype=np.float32).reshape(2, 8)
    return nkisim.launch(exchange, [(x, barrier)], tp=1, lnc=2)


def test_read_of_the_other_cores_write_needs_a_barrier_on_that_tensor():
    with pytest.raises(NkiValidationError, match=RULE):
        _run("none")
    with pytest.raises(NkiValidationError, match=RULE):
        _run("other")                       # a barrier on another tensor does not order this one
    out = _run("scratch")[0]
    assert np.isfinite(out).all() and out.any()


def test_a_race_on_a_kernel_argument_warns_and_can_be_refused(monkeypatch):
    """In-place state (a kernel argument): core 1 reads row 0 and core 0 overwrites it with no barrier on it. A core
    may read old contents on purpose and discard them, so by default this warns; strict, it is refused."""
    state = np.arange(16, dtype=np.float32).reshape(2, 8)
    with pytest.warns(NkiFidelityWarning, match=r"CORE_BARRIER_ORDER_ARGUMENTS"):
        nkisim.launch(overwrite, [(state.copy(), False)], tp=1, lnc=2)
    monkeypatch.setattr(nkisim.hw, "CORE_BARRIER_ORDER_ARGUMENTS", "error")
    with pytest.raises(NkiValidationError, match=r"no core_barrier\(data=\) on that tensor"):
        nkisim.launch(overwrite, [(state.copy(), False)], tp=1, lnc=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiFidelityWarning)
        out = nkisim.launch(overwrite, [(state.copy(), True)], tp=1, lnc=2)[0]
    np.testing.assert_array_equal(out, state[0:1])
