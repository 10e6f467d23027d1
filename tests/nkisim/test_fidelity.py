"""Fidelity rules from hardware / compiler evidence: PE nc_transpose of a slice of a wider tile (warned), no tensor-engine write
(any engine) into PSUM allocated outside a runtime loop, nc_find_index8 duplicates, and the front-end lint of helpers."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import frontend, hw
from nkisim.errors import NkiFidelityWarning
from nkisim.frontend import NkiFrontendWarning

F32 = np.float32


# ---- (a) PE nc_transpose: partition stride == free size ------------------------------------------
def _transpose(src_cols, view_cols):
    @nki.jit
    def k(x):
        t = nl.ndarray((32, src_cols), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        p = nl.ndarray((view_cols, 32), nl.float32, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=t[:, 0:view_cols], engine=nisa.engine.tensor)
        o = nl.ndarray((view_cols, 32), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        out = nl.ndarray((view_cols, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    return k


def test_pe_transpose_of_a_column_slice_is_warned():
    """The whole tile is the safe form; a column slice of a wider tile (partition stride = the row, as the pitfall
    asks) runs with a fidelity warning: the seed's hardware-run DeltaNet layer and nki-library transpose such slices."""
    x = np.arange(32 * 64, dtype=F32).reshape(32, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("error", nkisim.NkiFidelityWarning)
        np.testing.assert_array_equal(_transpose(64, 64)(x), x.T)      # the whole tile: no warning
    with pytest.warns(nkisim.NkiFidelityWarning, match=r"transposes .* 32 elements of each 64-element partition row"):
        out = _transpose(64, 32)(x)                                      # a column slice of a wider tile
    np.testing.assert_array_equal(out, x[:, 0:32].T)

    @nki.jit
    def dve(x):
        t = nl.ndarray((32, 64), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        o = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
        nisa.nc_transpose(dst=o, data=t[:, 0:32], engine=nisa.engine.vector)   # DVE form: not affected
        out = nl.ndarray((32, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    np.testing.assert_array_equal(dve(x), x[:, 0:32].T)


# ---- (b) tensor-engine writes into loop-external PSUM ----------------------------------------------
def _loop_kernel(psum_inside, engine="pe"):
    @nki.jit
    def k(a, n):
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=n_sb, src=n)
        r = nisa.register_alloc()
        nisa.register_load(r, n_sb)
        acc = nl.ndarray((32, 32), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        outside = nl.ndarray((32, 32), nl.float32, buffer=nl.psum)

        def body(i):
            p = nl.ndarray((32, 32), nl.float32, buffer=nl.psum) if psum_inside else outside
            if engine == "pe":
                nisa.nc_matmul(dst=p, stationary=sa, moving=sa, accumulate=False)
            else:
                nisa.activation(dst=p, op=nl.copy, data=sa)              # the scalar engine: compiles
            nisa.tensor_tensor(dst=acc, data1=acc, data2=p, op=nl.add)
        nl.fori_loop(0, r, body)
        out = nl.ndarray((32, 32), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out
    return k


def test_write_into_loop_external_psum_any_engine():
    """Loop state lives in SBUF/HBM (SDK-NL fori_loop): a PE or an ACT write into PSUM allocated outside the runtime
    loop is refused; PSUM allocated inside the body is fine."""
    a = (np.arange(32 * 32, dtype=F32).reshape(32, 32) % 7) / 7
    n = np.array([[2]], np.int32)
    with warnings.catch_warnings():
        warnings.simplefilter("error", NkiFidelityWarning)
        np.testing.assert_allclose(_loop_kernel(True)(a, n), 2 * (a.T @ a), rtol=1e-5)       # PSUM inside: fine
        np.testing.assert_allclose(_loop_kernel(True, "act")(a, n), 2 * a, rtol=1e-6)
    for engine in ("pe", "act"):
        with pytest.raises(nkisim.NkiValidationError, match="runtime loops: .* at test_fidelity.py:7[02].*allocated "
                                                            "outside.*carry any other loop state through SBUF/HBM"):
            _loop_kernel(False, engine)(a, n)
    old = hw.LOOP_PSUM_CHECK
    hw.LOOP_PSUM_CHECK = "warn"
    try:
        with pytest.warns(NkiFidelityWarning, match="NCC_IBIR092"):
            np.testing.assert_allclose(_loop_kernel(False)(a, n), 2 * (a.T @ a), rtol=1e-5)
    finally:
        hw.LOOP_PSUM_CHECK = old


# ---- (c) nc_find_index8 duplicates --------------------------------------------------------------
def test_find_index8_duplicate_vals_take_successive_occurrences():
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        m = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
        nisa.max8(dst=m, src=t)
        i = nl.ndarray((1, 8), nl.uint32, buffer=nl.sbuf)
        nisa.nc_find_index8(dst=i, data=t, vals=m)
        out = nl.ndarray((1, 8), nl.uint32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=i)
        return out
    x = np.array([[5, 9, 9, 1, 9, 7, 7, 3, 2, 8, 0, 6]], F32)             # ties: three 9s, two 7s
    idx = k(x)[0]
    assert list(idx) == [1, 2, 4, 9, 5, 6, 11, 0]                        # distinct indices for the ties


# ---- (d) front-end lint -------------------------------------------------------------------------
def _helper_with_comprehension(t):
    cols = [c for c in range(2)]
    for c in cols:
        nisa.memset(dst=t[:, c:c + 1], value=float(c))


def _helper_is(t, flag):
    if flag is None:
        nisa.memset(dst=t, value=0.0)


def _outer_helper(t):
    _helper_with_comprehension(t)


def test_frontend_lint_kernel_and_helpers():
    @nki.jit
    def k(x):
        t = nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf)
        _outer_helper(t)
        squares = (v * v for v in range(2))
        out = nl.ndarray((2, 2), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out, tuple(squares)
    with pytest.warns(NkiFrontendWarning) as rec:
        out, _ = k(np.zeros((1, 1), F32))
    msgs = [str(w.message) for w in rec]
    assert any("kernel k uses a generator expression at test_fidelity.py:" in m for m in msgs)
    assert any("helper _helper_with_comprehension uses a list comprehension at test_fidelity.py:" in m for m in msgs)
    np.testing.assert_array_equal(out, [[0, 1], [0, 1]])

    @nki.jit
    def helper_is(x):
        t = nl.ndarray((2, 2), nl.float32, buffer=nl.sbuf)
        _helper_is(t, None)
        return x
    with pytest.warns(NkiFrontendWarning, match="NKI Python subset: helper _helper_is uses 'is' at test_fidelity.py:"):
        helper_is(np.zeros((1, 1), F32))
    old = frontend.HELPER_ERRORS
    frontend.HELPER_ERRORS = True
    frontend._state.clear()
    frontend._reached.clear()
    try:
        with pytest.raises(nkisim.NkiValidationError, match="helper _helper_is uses 'is' at test_fidelity.py:"):
            helper_is(np.zeros((1, 1), F32))
    finally:
        frontend.HELPER_ERRORS = old
        frontend._reached.clear()
