"""Per-thread BLAS thread count for the interpreter's small matmuls.

Every ``nc_matmul`` is at most 128 x 128 x 512, where a multi-threaded OpenBLAS only adds spin-wait
overhead -- on a loaded 2-core machine 100x slower (measured: 50 ms vs 0.15-0.5 ms for one
128x128x512 sgemm). numpy's bundled OpenBLAS (>= 0.3.27) has ``openblas_set_num_threads_local``,
which changes the count for the calling thread only, so the rest of the process is unaffected. When
the symbol is not found this is a no-op.
"""
import contextlib
import ctypes
import glob
import os

import numpy as np

_fn = None


def _load():
    global _fn
    if _fn is not None:
        return _fn or None
    _fn = False
    here = os.path.dirname(np.__file__)
    for pat in ("../numpy.libs/libscipy_openblas*.so*", ".libs/libscipy_openblas*.so*",
                "../numpy.libs/libopenblas*.so*", ".libs/libopenblas*.so*"):
        for path in glob.glob(os.path.join(here, pat)):
            try:
                f = ctypes.CDLL(path).openblas_set_num_threads_local
            except (OSError, AttributeError):
                continue
            f.restype, f.argtypes = ctypes.c_int, [ctypes.c_int]
            _fn = f
            return f
    return None


@contextlib.contextmanager
def single_thread():
    """BLAS calls made by this thread inside the block use one thread."""
    f = _load()
    if f is None:
        yield
        return
    old = f(1)
    try:
        yield
    finally:
        f(old if old > 0 else 0)
