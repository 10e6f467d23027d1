"""nc_matmul PSUM accumulation rules (ref §5.2)."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkisim import UninitializedReadError

F32 = np.float32


def _kernel(mode):
    @nki.jit
    def k(a, b):
        out = nl.ndarray((64, 32), nl.float32, buffer=nl.shared_hbm)
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        p = nl.ndarray((64, 32), nl.float32, buffer=nl.psum)
        if mode == "auto_twice":          # first write overwrites, second accumulates
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
        elif mode == "explicit":
            for k_ in range(3):
                nisa.nc_matmul(dst=p, stationary=sa, moving=sb, accumulate=(k_ > 0))
        elif mode == "reset":
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb, accumulate=False)
        elif mode == "zeros_then_auto":
            nisa.memset(dst=p, value=0.0)
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
        elif mode == "true_uninit":
            nisa.nc_matmul(dst=p, stationary=sa, moving=sb, accumulate=True)
        o = nl.ndarray((64, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        nisa.dma_copy(dst=out, src=o)
        return out
    return k


@pytest.fixture
def ab(rng):
    return (rng.standard_normal((128, 64)).astype(ml_dtypes.bfloat16),
            rng.standard_normal((128, 32)).astype(ml_dtypes.bfloat16))


@pytest.mark.parametrize("mode,mult", [("auto_twice", 2), ("explicit", 3), ("reset", 1), ("zeros_then_auto", 2)])
def test_accumulation_modes(ab, mode, mult):
    a, b = ab
    ref = a.astype(F32).T @ b.astype(F32)
    np.testing.assert_allclose(_kernel(mode)(a, b), mult * ref, rtol=1e-5, atol=1e-4)


def test_accumulate_true_on_uninitialized_psum(ab):
    with pytest.raises(UninitializedReadError, match="accumulate=True into never-written PSUM"):
        _kernel("true_uninit")(*ab)


def test_psum_reallocated_per_group_restarts(ab):
    a, b = ab

    @nki.jit
    def k(a, b):
        out = nl.ndarray((2, 64, 32), nl.float32, buffer=nl.shared_hbm)
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        for g in range(2):
            p = nl.ndarray((64, 32), nl.float32, buffer=nl.psum)   # fresh accumulator per group
            for _ in range(g + 1):
                nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
            o = nl.ndarray((64, 32), nl.float32, buffer=nl.sbuf)
            nisa.tensor_copy(dst=o, src=p)
            nisa.dma_copy(dst=out[g], src=o)
        return out
    ref = a.astype(F32).T @ b.astype(F32)
    out = k(a, b)
    np.testing.assert_allclose(out[0], ref, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(out[1], 2 * ref, rtol=1e-5, atol=1e-4)
