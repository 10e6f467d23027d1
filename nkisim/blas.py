"""Per-thread BLAS thread count for the interpreter's small matmuls.

Every ``nc_matmul`` is at most 128 x 128 x 512, where a multi-threaded OpenBLAS only adds spin-wait
overhead -- on a loaded 2-core machine 100x slower (measured: 50 ms vs 0.15-0.5 ms for one
128x128x512 sgemm). numpy's bundled OpenBLAS (>= 0.3.27) has ``openblas_set_num_threads_local``,
which changes the count for the calling thread only, so the rest of the process is unaffected. When
the symbol is not found this is a no-op.

The thread-local count alone does not make results reproducible: with numpy's scipy-openblas 0.3.31 two
instance threads inside ``single_thread`` still got two different (last-bit) results for the same
128x128x512 sgemm across runs, while ``OPENBLAS_NUM_THREADS=1`` or the global
``openblas_set_num_threads(1)`` gave one. So while any thread is inside ``single_thread`` the global
count is 1 too (reference-counted; the previous global count comes back when the last one leaves).
"""
import contextlib
import ctypes
import glob
import os
import threading

import numpy as np

_fn = None
_global = None            # (set, get) of the global thread count, or False
_lock = threading.Lock()
_users = 0
_saved = 0


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
            _load_global(ctypes.CDLL(path))
            return f
    return None


def _load_global(lib):
    """The library's global set / get thread-count functions (symbol names differ between builds)."""
    global _global
    _global = False
    for set_name, get_name in (("openblas_set_num_threads", "openblas_get_num_threads"),
                               ("scipy_openblas_set_num_threads64_", "scipy_openblas_get_num_threads64_"),
                               ("scipy_openblas_set_num_threads", "scipy_openblas_get_num_threads")):
        try:
            s, g = getattr(lib, set_name), getattr(lib, get_name)
        except AttributeError:
            continue
        s.restype, s.argtypes = None, [ctypes.c_int]
        g.restype, g.argtypes = ctypes.c_int, []
        _global = (s, g)
        return


@contextlib.contextmanager
def single_thread():
    """BLAS calls made by this thread inside the block use one thread."""
    f = _load()
    if f is None:
        yield
        return
    global _users, _saved
    with _lock:
        if _global and _users == 0:
            _saved = _global[1]()
            _global[0](1)
        _users += 1
    old = f(1)
    try:
        yield
    finally:
        f(old if old > 0 else 0)
        with _lock:
            _users -= 1
            if _global and _users == 0:
                _global[0](_saved)
