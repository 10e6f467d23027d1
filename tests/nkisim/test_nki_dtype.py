"""``nki.dtype``: not in the NKI 0.6 public interface (../shared/docs/nki-api-0.6.json), but AWS's hardware-tested
nki-library annotates dtype parameters with it (e.g. core/subkernels/find_nonzero_indices.py
``index_dtype: nki.dtype = nl.int32``), so nkisim provides it -- as nki.language.DType -- with a NkiFidelityWarning
(nkisim/public_api.py UNDOCUMENTED). Other undocumented ``nki.X`` names stay AttributeErrors."""
import importlib.util
import os
import tempfile

import numpy as np
import pytest

import nki
import nki.language as nl
from nkisim import public_api
from nkisim.errors import NkiFidelityWarning

MODULE = '''
import nki
import nki.isa as nisa
import nki.language as nl


def _fill(t, dtype: nki.dtype = nl.float32) -> nki.dtype:
    nisa.memset(dst=t, value=1.0 if isinstance(dtype, nki.dtype) else -1.0)
    return dtype


@nki.jit
def kernel(x, out_dtype: nki.dtype = nl.float32):
    t = nl.ndarray((1, 4), out_dtype, buffer=nl.sbuf)
    _fill(t, out_dtype)
    out = nl.ndarray((1, 4), out_dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out
'''


def test_nki_dtype_is_provided_with_a_fidelity_warning():
    public_api._warned.discard("nki.dtype")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "annotated_kernel.py")
        with open(path, "w") as f:
            f.write(MODULE)
        spec = importlib.util.spec_from_file_location("annotated_kernel", path)
        mod = importlib.util.module_from_spec(spec)
        with pytest.warns(NkiFidelityWarning, match=r"nki.dtype is not in the NKI 0.6 public interface .* AWS's "
                                                    r"nki-library annotates dtype parameters"):
            spec.loader.exec_module(mod)          # annotations are evaluated here, at import
        assert mod.kernel.fn.__annotations__["out_dtype"] is nl.DType
        np.testing.assert_array_equal(mod.kernel(np.zeros((1, 1), np.float32)), np.ones((1, 4)))


def test_other_undocumented_nki_names_are_attribute_errors():
    with pytest.raises(AttributeError, match=r"module 'nki' has no attribute 'tensor' \(not in the NKI 0.6 public"):
        nki.tensor
