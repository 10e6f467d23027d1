"""``nki.jit`` / ``nki.simulate`` and the launcher: argument conversion, LNC instances, outputs.

Conventions (see README): tensor arguments may be numpy arrays (incl. ml_dtypes bfloat16/fp8),
torch tensors (bf16 -> ml_dtypes.bfloat16) or :class:`ShapeDtype`; they become shared-HBM tensors.
Returned tensors (must be ``nl.shared_hbm``) come back as numpy arrays -- or torch tensors when any
argument was a torch tensor -- or as ShapeDtype in shape-only mode. In-place writes to argument
tensors are copied back into the caller's arrays when the launch finishes.
"""
import contextlib
import functools
import gc
import inspect
import os
import threading
import warnings

import numpy as np

from . import dtypes, frontend, hw, runtime, site
from .errors import LaunchAborted, NkiFidelityWarning, NkiValidationError
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
    """Within this block every launch runs in shape-only mode (float array arguments are used for their
    shape and dtype only; integer arrays keep their values, see :func:`_convert`)."""
    prev = getattr(_flags, "shape_only", False)
    _flags.shape_only = True
    try:
        yield
    finally:
        _flags.shape_only = prev


@contextlib.contextmanager
def register_values(provider):
    """Within this block every launch asks ``provider(q)`` at each ``register_load`` (``q``: a
    :class:`nkisim.registers.RegisterLoad`). When the loaded value is known (an executing launch, or a
    shape-only launch reading a real integer input) ``q.value`` holds it and the provider only observes;
    otherwise (shape-only, data computed on-chip) a number it returns becomes the register's value and
    None keeps the placeholder 0. See nkisim/README.md "Shape-only mode"."""
    if not callable(provider):
        raise TypeError(f"nkisim.register_values: provider must be callable, got {type(provider).__name__}")
    prev = getattr(_flags, "register_values", None)
    _flags.register_values = provider
    try:
        yield
    finally:
        _flags.register_values = prev


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
        if shape_only and (arr is None or arr.dtype.kind not in "iu"):
            arr = None          # shape-only: integer inputs (positions, token ids, slots) keep their values
        st = Storage(SHARED_HBM, shape, name, f"arg{len(args_out)}", with_data=arr is not None, owner=None, fill=False)
        st.is_input = True
        if arr is not None:
            st.data[...] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
            st.written[...] = True
            st.full = True
        launch.shared_hbm.allocate(st.nbytes, st.name)
        a.array, a.storage = arr, st
        args_out.append(a)
        return NkiTensor.whole(st)
    if isinstance(x, list):
        raise NkiValidationError("kernel arguments may not be lists (NKI 0.3.0); pass a tuple")
    if isinstance(x, tuple):
        return tuple(_convert(v, launch, args_out, shape_only) for v in x)
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise NkiValidationError(f"kernel argument dict has non-string key(s) {bad!r}; NKI dict keys must be "
                                     f"strings (NKI 0.3.0)")
        return {k: _convert(v, launch, args_out, shape_only) for k, v in x.items()}
    return x


def _lint(fn):
    sig = inspect.signature(fn)
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.KEYWORD_ONLY, p.VAR_KEYWORD):
            raise NkiValidationError(f"nki.jit: kernel {fn.__name__} uses '*'/'**' in its signature (parameter "
                                     f"'{p.name}'), which the NKI compiler rejects (NKI 0.3.0)")


# Front-end lint of the kernel body (ref §2.1, SDK-MIG 0.3.0 "NKI language restrictions"): the NKI compiler
# rejects `is` / `is not` and dicts with non-string keys (errors); comprehensions, generator expressions/functions
# and lambdas are reported as NkiFrontendWarning (see nkisim/frontend.py for the evidence). The helpers the
# kernel runs are linted on their first ISA call (frontend.check_stack). Switch: nkisim.jit.FRONTEND_LINT = False.
FRONTEND_LINT = True

# Calling an @nki.jit kernel from inside a kernel: documented as an error (SDK migration guide 0.2.0 "Remove nki.jit
# decorator on sub-kernels"). Contrary evidence, not from AWS's documentation: AWS's nki-library calls its @nki.jit
# output_projection_tkg from the @nki.jit experimental/transformer/attention_block_tkg (releases 2.28 onwards), and
# the seed megakernel's hardware-measured DeltaNet layer calls it from its own kernel. "error" (default) refuses;
# "warn" runs the inner kernel inline with a NkiFidelityWarning (used to trace such third-party code, saying so).
NESTED_JIT = os.environ.get("NKISIM_NESTED_JIT", "error")
_nested_warned = set()
_linted = {}


def _lint_source(fn):
    code = getattr(fn, "__code__", None)
    if not FRONTEND_LINT or code is None or code in _linted:
        return
    import ast
    import textwrap
    from . import frontend
    try:
        src = textwrap.dedent(inspect.getsource(fn))
        first = inspect.getsourcelines(fn)[1]
        tree = ast.parse(src)
    except (OSError, TypeError, SyntaxError):
        return                                   # no source (REPL, exec): nothing to check
    frontend._state[code] = 0                    # the helper walk need not lint the kernel again
    node = tree.body[0] if tree.body else tree
    frontend.lint_node(node, fn.__name__, code.co_filename, first - 1, helper=False)
    _linted[code] = True     # only a clean kernel is cached: a refused one is refused again at every launch


def _output(x, launch, want_torch, names_seen):
    if isinstance(x, NkiTensor):
        st = x.storage
        if st.kind != SHARED_HBM:
            raise NkiValidationError(f"kernel {launch.kernel_name}: returned tensor {x.describe()} is in "
                                     f"{st.kind.value}; kernel outputs must be allocated in nl.shared_hbm (NKI 0.3.0)")
        if st.cc:
            # aws-neuron/nki-library test_collectives.py: "dma_copy required: Collective instruction cannot
            # read/write IO tensors"; vllm-neuron all_gather_v: "NEFF I/O cannot also be collective I/O".
            raise NkiValidationError(f"kernel {launch.kernel_name}: returned tensor {x.describe()} is an operand of "
                                     f"a collective; collective instructions cannot read/write kernel I/O tensors: "
                                     f"dma_copy the result into a separate output tensor")
        if st.data is None:
            return ShapeDtype(x.shape, x.dtype)
        from .tensor import mask
        if not mask(x).all():
            warnings.warn(f"kernel {launch.kernel_name}: output {x.describe()} has elements no instruction wrote "
                          f"(they hold the NaN/4 sentinel)", stacklevel=4)
        a = np.array(raw(x))
        return _numpy_to_torch(a, x.dtype) if want_torch else a
    if isinstance(x, tuple):
        return tuple(_output(v, launch, want_torch, names_seen) for v in x)
    if isinstance(x, list):
        return [_output(v, launch, want_torch, names_seen) for v in x]
    if isinstance(x, dict):
        bad = [k for k in x if not isinstance(k, str)]
        if bad:
            raise NkiValidationError(f"kernel {launch.kernel_name} returns a dict with non-string key(s) {bad!r}; "
                                     f"{frontend.DICT_KEYS_DOC}")
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


def _has(x, pred):
    if pred(x):
        return True
    if isinstance(x, (tuple, list)):
        return any(_has(v, pred) for v in x)
    if isinstance(x, dict):
        return any(_has(v, pred) for v in x.values())
    return False


def run_world(fn, per_rank_args, per_rank_kwargs, tp, lnc, ndim, comms, name=None, timeout=None):
    """Launch ``tp`` ranks x ``lnc`` instances; returns the converted outputs of every rank."""
    _lint_source(fn)
    so = getattr(_flags, "shape_only", False)
    flat = [v for a in per_rank_args for v in a] + [v for k in per_rank_kwargs for v in k.values()]
    so = so or any(_has(x, lambda v: isinstance(v, ShapeDtype)) for x in flat)
    want_torch = any(_has(x, _is_torch) for x in flat)
    W = runtime.World(name or fn.__name__, tp, lnc, ndim, so, comms, timeout)
    lint = frontend.launch_begin(getattr(fn, "__code__", None))
    W.lint = lint[0] and FRONTEND_LINT
    W.register_values = getattr(_flags, "register_values", None)
    convs, cargs, ckws = [], [], []
    for r in range(tp):
        conv = []
        cargs.append(tuple(_convert(a, W.ranks[r], conv, so) for a in per_rank_args[r]))
        ckws.append({k: _convert(v, W.ranks[r], conv, so) for k, v in per_rank_kwargs[r].items()})
        convs.append(conv)
    # The objects that exist before the launch (model weights, test fixtures, earlier traces, ...) are frozen
    # out of the cyclic GC for its duration and unfrozen after (gc.freeze/unfreeze: a list splice each way), so
    # the collections the launch triggers scan only what it creates; with a trace capturing 10^4-10^5 records
    # the full collections otherwise cost ~1/3 of the launch. Reference counting (tile lifetimes) is unchanged.
    # While a trace captures, the full (oldest-generation) collections would rescan every record of the launch
    # a few times; they are deferred to the end of the launch (young cycles are still collected as usual).
    freeze = gc.get_freeze_count() == 0
    if freeze:
        gc.freeze()
    thresholds = gc.get_threshold()
    if W.traces:
        gc.set_threshold(thresholds[0], thresholds[1], max(thresholds[2], 1000))
    try:
        results = runtime.run(W, fn, cargs, ckws)
    finally:
        if W.traces:
            gc.set_threshold(*thresholds)
        if freeze:
            gc.unfreeze()
    frontend.launch_end(getattr(fn, "__code__", None), lint)
    outs = [_output(res, W.ranks[r], want_torch, set()) for r, res in enumerate(results)]
    for conv in convs:
        _write_back(conv)
    return outs


def launch(fn, lnc, ndim, args, kwargs, name=None):
    """A single-process launch (``kernel(...)`` / ``kernel[2](...)``): one rank, collectives unavailable."""
    return run_world(fn, [tuple(args)], [dict(kwargs)], 1, lnc, ndim, comms=False, name=name)[0]


def launch_ranks(kernel, per_rank_args, tp=None, lnc=2, per_rank_kwargs=None, timeout=None):
    """Run ``kernel`` on ``tp`` ranks (logical NeuronCores) of one trn2 chip, each with ``lnc`` program
    instances (physical cores), collectives initialised. ``per_rank_args[r]`` is the argument tuple of
    rank r (a dict is taken as keyword arguments). Returns ``[outputs of rank 0, outputs of rank 1, ...]``.
    Exported as ``nkisim.launch``; see nkisim/README.md "Multi-rank launch"."""
    if isinstance(kernel, Kernel):
        fn = kernel.fn
    elif callable(kernel):
        _lint(kernel)
        fn = kernel
    else:
        raise TypeError(f"nkisim.launch: kernel must be an @nki.jit kernel or a function, got {type(kernel).__name__}")
    if not isinstance(per_rank_args, (list, tuple)) or not per_rank_args:
        raise TypeError("nkisim.launch: per_rank_args must be a non-empty list with one argument tuple per rank")
    tp = len(per_rank_args) if tp is None else tp
    if not isinstance(tp, int) or tp < 1 or len(per_rank_args) != tp:
        raise ValueError(f"nkisim.launch: tp={tp!r} but {len(per_rank_args)} argument tuples were given (one per rank)")
    if lnc not in hw.LNC_DEGREES:
        raise NkiValidationError(f"nkisim.launch: lnc must be one of {hw.LNC_DEGREES} on trn2, got {lnc!r}")
    if tp * lnc > hw.PHYSICAL_CORES_PER_CHIP:
        raise NkiValidationError(f"nkisim.launch: tp={tp} x lnc={lnc} needs {tp * lnc} physical NeuronCores; one trn2 "
                                 f"chip has {hw.PHYSICAL_CORES_PER_CHIP} (multi-chip worlds are not modelled)")
    args, kws = [], []
    for r, a in enumerate(per_rank_args):
        if isinstance(a, dict):
            args.append(())
            kws.append(dict(a))
        elif isinstance(a, tuple):
            args.append(a)
            kws.append({})
        else:
            raise TypeError(f"nkisim.launch: per_rank_args[{r}] must be a tuple of arguments (or a dict of keyword "
                            f"arguments), got {type(a).__name__}")
    if per_rank_kwargs is not None:
        if len(per_rank_kwargs) != tp:
            raise ValueError(f"nkisim.launch: per_rank_kwargs has {len(per_rank_kwargs)} entries, expected tp={tp}")
        for r, k in enumerate(per_rank_kwargs):
            kws[r].update(k or {})
    return run_world(fn, args, kws, tp, lnc, 1, comms=True, timeout=timeout)


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
        if site.current_or_none() is not None:
            if NESTED_JIT != "warn":
                raise NkiValidationError(f"{self.fn.__name__}: calling an @nki.jit kernel from inside a kernel is not "
                                         f"supported (nested jit; SDK migration guide 0.2.0 'Remove nki.jit decorator "
                                         f"on sub-kernels'); decorate only the top-level kernel (switch: "
                                         f"nkisim.jit.NESTED_JIT / NKISIM_NESTED_JIT)")
            if self.fn not in _nested_warned:
                _nested_warned.add(self.fn)
                warnings.warn(f"{self.fn.__name__}: an @nki.jit kernel called from inside a kernel runs inline "
                              f"(nkisim.jit.NESTED_JIT='warn'); the SDK migration guide 0.2.0 documents this as an "
                              f"error, but AWS's nki-library and hardware-run third-party kernels do it",
                              NkiFidelityWarning, stacklevel=2)
            return self.fn(*args, **kwargs)
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
