"""Documented rules that AWS's hardware-tested nki-library (or a hardware-run third-party kernel) breaks: nkisim
accepts the construct with a NkiFidelityWarning, or behind a switch, and keeps refusing its neighbours.

* raw ``dge_mode`` integers (nki-library passes ``dge_mode=3`` in qkv_tkg / norm_tkg_utils / mlp_tkg);
* an ``@nki.jit`` kernel called inside a kernel (refused by default; ``nkisim.jit.NESTED_JIT = "warn"`` runs it inline);
* the undocumented-attribute rule judges a variable by its type only when it is bound once in the function."""
import importlib
import re

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim.errors import NkiFidelityWarning

F32 = np.float32


def _copy_kernel(**dma_kw):
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x, **dma_kw)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def test_raw_dge_mode_is_warned_and_means_the_member():
    x = np.arange(32, dtype=F32).reshape(4, 8)
    with pytest.warns(NkiFidelityWarning, match=r"dge_mode=3 is a raw integer.*nki.isa.dge_mode.none"):
        with nkisim.trace.capture() as tr:
            out = _copy_kernel(dge_mode=3)(x)
    np.testing.assert_array_equal(out, x)
    assert tr.instructions[0]["dge_mode"] == "none"          # the member it names
    # other raw enum values stay refused, and so do integers that name no member
    with pytest.raises(nkisim.NkiValidationError, match=r"oob_mode must be a nki.isa.oob_mode member"):
        _copy_kernel(oob_mode=0)(x)
    with pytest.raises(nkisim.NkiValidationError, match=r"dge_mode must be a nki.isa.dge_mode member"):
        _copy_kernel(dge_mode=7)(x)
    np.testing.assert_array_equal(_copy_kernel(dge_mode=nisa.dge_mode.none)(x), x)   # the member: no warning


@nki.jit
def _inner(x):
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def _outer(x):
    return _inner(x)


def test_nested_jit_refused_by_default_and_inline_when_switched():
    jit = importlib.import_module("nkisim.jit")        # the module (nkisim.jit the attribute is the decorator)
    x = np.arange(32, dtype=F32).reshape(4, 8)
    assert jit.NESTED_JIT == "error"
    with pytest.raises(nkisim.NkiValidationError, match=r"_inner: calling an @nki.jit kernel from inside a kernel is "
                                                        r"not supported \(nested jit; SDK migration guide 0.2.0"):
        _outer(x)
    jit.NESTED_JIT = "warn"
    try:
        with pytest.warns(NkiFidelityWarning, match=r"_inner: an @nki.jit kernel called from inside a kernel runs "
                                                    r"inline"):
            out = _outer(x)
    finally:
        jit.NESTED_JIT = "error"
    np.testing.assert_array_equal(out, 2 * x)


class _Wrap(nl.NKIObject):
    def __init__(self, t):
        self.t = t

    def view_of(self):
        return self.t


def _load(x, wrap):
    """``t`` is first an NkiTensor, then rebinds to a wrapper (as nki-library's qkv_tkg wraps a tile in a TensorView):
    ``t.view_of`` is not judged by t's type at the first ISA call (the read happens after the rebind)."""
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    if wrap:
        t = _Wrap(t)
        t = t.view_of()
    return t


def _kernel_with(wrap):
    @nki.jit
    def k(x):
        t = _load(x, wrap)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    return k


def _reads_storage(x):
    t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    return t.storage                      # bound once: an NkiTensor, and .storage is not public


def test_attribute_rule_judges_only_variables_bound_once():
    x = np.arange(32, dtype=F32).reshape(4, 8)
    np.testing.assert_array_equal(_kernel_with(True)(x), x)

    @nki.jit
    def bad(x):
        _reads_storage(x)
        return x
    with pytest.raises(nkisim.NkiValidationError) as e:
        bad(x)
    assert re.search(r"undocumented API: _reads_storage \(test_library_evidence.py:\d+\) reads t.storage", str(e.value))
