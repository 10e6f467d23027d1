"""``nki.jit`` / ``nki.simulate`` and the launcher: argument conversion, LNC instances, outputs.

Conventions (see README): tensor arguments may be numpy arrays (incl. ml_dtypes bfloat16/fp8),
torch tensors (bf16 -> ml_dtypes.bfloat16) or :class:`ShapeDtype`; they become shared-HBM tensors.
Returned tensors (must be ``nl.shared_hbm``) come back as numpy arrays -- or torch tensors when any
argument was a torch tensor -- or as ShapeDtype in shape-only mode. In-place writes to argument
tensors are copied back into the caller's arrays when the launch finishes.
"""
import contextlib
import functools
import inspect
import threading
import warnings

import numpy as np

from . import dtypes, hw, runtime
from .errors import LaunchAborted, NkiValidationError
from .memory import SHARED_HBM, Storage
from .tensor import NkiTensor, raw

_flags = threading.local()


class ShapeDtype:
    """A tensor argument without data, for shape-only tracing."""
    __slots__ = ("shape", "dtype")

    def __init__(self, shape, dtype):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtypes.normalize(dtype, "ShapeDtype")

    def __repr__(self):
        return f"ShapeDtype({self.shape}, {self.dtype})"

    def __eq__(self, other):
        return isinstance(other, ShapeDtype) and (self.shape, self.dtype) == (other.shape, other.dtype)

    def __hash__(self):
        return hash((self.shape, self.dtype))


@contextlib.contextmanager
def shape_only():
    """Within this block every launch runs in shape-only mode (array arguments are used for their
    shape and dtype only)."""
    prev = getattr(_flags, "shape_only", False)
    _flags.shape_only = True
    try:
        yield
    finally:
        _flags.shape_only = prev


def _is_torch(x):
    return type(x).__module__.startswith("torch") and type(x).__name__ in ("Tensor", "Parameter")


def _torch_to_numpy(t):
    import torch
    t = t.detach().cpu().contiguous()
    name = dtypes.normalize(t.dtype)
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(dtypes.storage("bfloat16"))
    if name.startswith("float8"):
        return t.view(torch.uint8).numpy().view(dtypes.storage(name))
    return t.numpy()


def _numpy_to_torch(a, name):
    import torch
    if name == "bfloat16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    if name.startswith("float8") and hasattr(torch, name):
        return torch.from_numpy(a.view(np.uint8)).view(getattr(torch, name))
    return torch.from_numpy(a)


class _Arg:
    __slots__ = ("orig", "array", "storage", "torch")


def _convert(x, launch, args_out, shape_only):
    if isinstance(x, NkiTensor):
        return x
    if isinstance(x, ShapeDtype) or isinstance(x, np.ndarray) or _is_torch(x):
        a = _Arg()
        a.orig, a.torch = x, _is_torch(x)
        if isinstance(x, ShapeDtype):
            shape, name, arr = x.shape, x.dtype, None
        else:
            arr = _torch_to_numpy(x) if a.torch else x
            name = dtypes.normalize(arr.dtype, "kernel argument")
            shape = arr.shape
        if shape_only:
            arr = None
        st = Storage(SHARED_HBM, shape, name, f"arg{len(args_out)}", with_data=arr is not None, owner=None, fill=False)
        st.is_input = True
        if arr is not None:
            st.data[...] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            st.written[...] = True
        launch.shared_hbm.allocate(st.nbytes, st.name)
        a.array, a.storage = arr, st
        args_out.append(a)
        return NkiTensor.whole(st)
    if isinstance(x, list):
        raise NkiValidationError("kernel arguments may not be lists (NKI 0.3.0); pass a tuple")
    if isinstance(x, tuple):
        return tuple(_convert(v, launch, args_out, shape_only) for v in x)
    if isinstance(x, dict):
        return {k: _convert(v, launch, args_out, shape_only) for k, v in x.items()}
    return x


def _lint(fn):
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY, p.VAR_KEYWORD):
            raise NkiValidationError(f"nki.jit: kernel {fn.__name__} uses '*'/'**' in its signature (parameter "
                                     f"'{p.name}'), which the NKI compiler rejects (NKI 0.3.0)")


def _output(x, launch, want_torch, names_seen):
    if isinstance(x, NkiTensor):
        st = x.storage
        if st.kind != SHARED_HBM:
            raise NkiValidationError(f"kernel {launch.kernel_name}: returned tensor {x.describe()} is in "
                                     f"{st.kind.value}; kernel outputs must be allocated in nl.shared_hbm (NKI 0.3.0)")
        if st.data is None:
            return ShapeDtype(x.shape, x.dtype)
        from .tensor import mask
        if not mask(x).all():
            warnings.warn(f"kernel {launch.kernel_name}: output {x.describe()} has elements no instruction wrote "
                          f"(they hold the NaN/4 sentinel)", stacklevel=3)
        a = np.array(raw(x))
        return _numpy_to_torch(a, x.dtype) if want_torch else a
    if isinstance(x, tuple):
        return tuple(_output(v, launch, want_torch, names_seen) for v in x)
    if isinstance(x, list):
        return [_output(v, launch, want_torch, names_seen) for v in x]
    if isinstance(x, dict):
        return {k: _output(v, launch, want_torch, names_seen) for k, v in x.items()}
    return x


def _write_back(args):
    for a in args:
        st = a.storage
        if not st.dirty or st.data is None or isinstance(a.orig, ShapeDtype):
            continue
        new = st.data.view(dtypes.storage(st.dtype)).reshape(st.shape)
        if a.torch:
            import torch
            a.orig.data.copy_(_numpy_to_torch(new.copy(), st.dtype).reshape(a.orig.shape))
        else:
            if not a.orig.flags.writeable:
                raise NkiValidationError("kernel wrote into a read-only input array")
            np.copyto(a.orig, new.view(a.orig.dtype) if new.dtype != a.orig.dtype else new)


def launch(fn, lnc, ndim, args, kwargs, name=None):
    so = getattr(_flags, "shape_only", False)
    flat = list(args) + list(kwargs.values())

    def has_shape(x):
        if isinstance(x, ShapeDtype):
            return True
        if isinstance(x, (tuple, list)):
            return any(has_shape(v) for v in x)
        if isinstance(x, dict):
            return any(has_shape(v) for v in x.values())
        return False

    def has_torch(x):
        if _is_torch(x):
            return True
        if isinstance(x, (tuple, list)):
            return any(has_torch(v) for v in x)
        if isinstance(x, dict):
            return any(has_torch(v) for v in x.values())
        return False

    so = so or any(has_shape(x) for x in flat)
    want_torch = any(has_torch(x) for x in flat)
    L = runtime.Launch(name or fn.__name__, lnc, ndim, so)
    conv = []
    cargs = tuple(_convert(a, L, conv, so) for a in args)
    ckw = {k: _convert(v, L, conv, so) for k, v in kwargs.items()}
    if lnc == 1:
        result = runtime.run_single(L, fn, cargs, ckw)
    else:
        results = {}
        threads = [threading.Thread(target=runtime.run_instance, args=(L, inst, fn, cargs, ckw, results),
                                    name=f"nkisim-{L.kernel_name}-{inst.pid}", daemon=True)
                   for inst in L.instances]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        errs = [results[("exc", i)] for i in range(lnc) if ("exc", i) in results]
        if errs:
            raise errs[0]
        if L.aborted is not None:
            raise L.aborted
        result = results.get(0)
    out = _output(result, L, want_torch, set())
    _write_back(conv)
    return out


class Kernel:
    """Result of ``@nki.jit``. ``kernel(*args)`` runs one instance (program_ndim 0);
    ``kernel[2](*args)`` runs the two LNC instances."""

    def __init__(self, fn, lnc=None, **options):
        for bad in ("mode", "platform_target"):
            if bad in options:
                raise NkiValidationError(f"nki.jit: '{bad}=' was removed in NKI 0.3.0 (target trn2 via "
                                         f"NEURON_PLATFORM_TARGET_OVERRIDE)")
        _lint(fn)
        self.fn, self.lnc, self.options = fn, lnc, options
        functools.update_wrapper(self, fn)

    def __getitem__(self, grid):
        g = grid if isinstance(grid, tuple) else (grid,)
        if len(g) != 1 or not isinstance(g[0], int) or g[0] not in hw.LNC_DEGREES:
            raise NkiValidationError(f"kernel {self.fn.__name__}[{grid}]: the launch grid must be the LNC degree, "
                                     f"1 or 2 on trn2 (arbitrary SPMD grids are not part of the new NKI API)")
        return Kernel(self.fn, lnc=g[0], **self.options)

    def __call__(self, *args, **kwargs):
        if runtime.current_or_none() is not None:
            raise NkiValidationError(f"{self.fn.__name__}: calling an @nki.jit kernel from inside a kernel is not "
                                     f"supported (nested jit); decorate only the top-level kernel")
        lnc = self.lnc or 1
        return launch(self.fn, lnc, 0 if self.lnc is None else 1, args, kwargs)


def jit(fn=None, **kwargs):
    if fn is None:
        return lambda f: Kernel(f, **kwargs)
    if isinstance(fn, Kernel):
        return fn
    return Kernel(fn, **kwargs)


def simulate(kernel):
    """``nki.simulate(kernel)(*args)`` / ``nki.simulate(kernel[2])(*args)`` (SDK-NKI): under nkisim every
    launch is a simulation, so this returns the kernel itself."""
    return kernel if isinstance(kernel, Kernel) else Kernel(kernel)
