"""nkisim implementation of ``nki.language`` (NKI 0.6.0; SDK-NL)."""
import builtins
import contextlib

import numpy as np

from . import dtypes as _dt, hw
from .errors import NkiValidationError
from .memory import MemoryRegion, PSUM, SBUF, PRIVATE_HBM, SHARED_HBM
from .ops import OPS as _OPS, Op
from .registers import VirtualRegister
from .runtime import call_site, current as _current
from .tensor import NkiTensor, ds

# ---- dtypes (strings, ref §3.1) --------------------------------------------------------------
DType = str
for _n in _dt.ALL:
    globals()[_n] = _n
del _n

# ---- buffers ---------------------------------------------------------------------------------
sbuf, psum, private_hbm, shared_hbm = SBUF, PSUM, PRIVATE_HBM, SHARED_HBM
hbm = PRIVATE_HBM          # nl.hbm is an alias of private_hbm (SDK-NL)


def is_hbm(buffer):
    return buffer in (PRIVATE_HBM, SHARED_HBM)


def is_on_chip(buffer):
    return buffer in (SBUF, PSUM)


def is_psum(buffer):
    return buffer == PSUM


def is_sbuf(buffer):
    return buffer == SBUF


# ---- operators (ref §6) ----------------------------------------------------------------------
for _n, _o in _OPS.items():
    globals()[_n] = _o
del _n, _o


class NKIObject:
    """Base for user classes passed to kernels (SDK-LG "Class Support")."""

    def __init__(self, **kwargs):
        for k, v in kwargs.items():
            setattr(self, k, v)


# ---- tile sizes (SDK-TILE) -------------------------------------------------------------------
class _TileSize:
    pmax = hw.PMAX
    psum_fmax = hw.PSUM_BANK_FMAX             # deprecated alias
    psum_bank_fmax = hw.PSUM_BANK_FMAX
    psum_bank_fmax_bytes = hw.PSUM_BANK_BYTES
    gemm_stationary_fmax = hw.GEMM_STATIONARY_FMAX
    gemm_moving_fmax = hw.GEMM_MOVING_FMAX
    bn_stats_fmax = hw.BN_STATS_FMAX
    psum_min_align = hw.PSUM_MIN_ALIGN
    sbuf_min_align = hw.SBUF_MIN_ALIGN
    psum_num_banks = hw.PSUM_NUM_BANKS
    sbuf_fmax_bytes = hw.SBUF_PARTITION_BYTES
    sbuf_fmax = hw.SBUF_PARTITION_BYTES // 4
    total_available_sbuf_size = hw.SBUF_PARTITION_BYTES    # per partition despite the name (ref §4)
    sbuf_size_bytes = hw.PMAX * hw.SBUF_PARTITION_BYTES_PHYSICAL   # "Total SBUF capacity in bytes (all partitions
                                                                  # combined)" (SDK-TILE 0.4.0+): 28 MiB on trn2


tile_size = _TileSize()


# ---- tensor creation -------------------------------------------------------------------------
def _buffer(buffer, op):
    if not isinstance(buffer, MemoryRegion):
        raise NkiValidationError(f"{op}: buffer must be nl.sbuf, nl.psum, nl.shared_hbm or nl.private_hbm/nl.hbm "
                                 f"(string buffer names are rejected since NKI 0.3.0), got {buffer!r}")
    return buffer


def ndarray(shape, dtype, buffer=sbuf, name="", address=None):
    if type(shape) is not tuple:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    if type(dtype) is not str or dtype not in _DTYPE_NAMES:
        dtype = _dt.normalize(dtype, "nl.ndarray")
    if type(buffer) is not MemoryRegion:
        _buffer(buffer, "nl.ndarray")
    return _current("nl.ndarray").allocate(shape, dtype, buffer, name or "", address)


_DTYPE_NAMES = frozenset(_dt.ALL)


def zeros(shape, dtype, buffer=sbuf, name=""):
    return full(shape, 0, dtype, buffer, name)


def ones(shape, dtype, buffer=sbuf, name=""):
    return full(shape, 1, dtype, buffer, name)


def full(shape, fill_value, dtype, buffer=sbuf, name=""):
    from . import isa
    t = ndarray(shape, dtype, buffer, name)
    v = int(fill_value) if _dt.is_int(t.dtype) else float(fill_value)
    if not is_on_chip(t.buffer):
        # SDK-NL full/zeros/ones: "buffer: sbuf, psum, hbm"; memset cannot reach HBM -> SBUF memset + DMA
        from .experimental import fill_hbm
        return fill_hbm(t, v)
    isa.memset(dst=t, value=v)
    return t


def zeros_like(x, dtype=None, buffer=None, name=""):
    return zeros(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def empty_like(x, dtype=None, buffer=None, name=""):
    return ndarray(x.shape, dtype or x.dtype, buffer or x.buffer, name)


def shared_constant(constant):
    inst = _current("nl.shared_constant")
    arr = np.load(constant) if isinstance(constant, str) else np.asarray(constant)
    t = ndarray(arr.shape, _dt.normalize(arr.dtype), shared_hbm, "shared_constant")
    st = t.storage
    if st.data is not None:
        st.fresh = False
        st.data[...] = np.ascontiguousarray(arr).view(np.uint8).reshape(-1)
        if st.written is not None:
            st.written[...] = True
        st.full = True
    return t


def shared_identity_matrix(n, dtype=uint8, dst=None):
    """An n x n identity in SBUF. SDK-NL: "same behavior as nki.language.shared_constant ... The compiler will reuse
    all the identity matrices of the same dtype in the graph": one constant, loaded once. So per program instance
    (core) and launch, the first call for an (n, dtype) allocates the SBUF tensor and traces one DMA of the NEFF
    constant (``constant: True``; bytes under the memory kind "const"), later calls return that same tensor and
    trace nothing. With ``dst=`` the constant is loaded into ``dst`` on every call."""
    from .isa.common import record, write
    inst = _current("nl.shared_identity_matrix")
    dt = _dt.normalize(dtype, "nl.shared_identity_matrix")
    if dst is None:
        key = (int(n), dt)
        t = inst.identities.get(key)
        if t is not None:
            return t
        t = inst.identities[key] = ndarray((n, n), dt, sbuf, "identity")
    else:
        t = dst
    nbytes = t.size * t.itemsize
    record("shared_identity_matrix", "DMA", writes=[("dst", t)], constant=True)
    if inst.launch.traces and inst.last_recs:
        for _, r in inst.last_recs:
            r["bytes"]["const"] = {"read": nbytes, "write": 0}
    if t.storage.data is not None:
        write(t, np.eye(n, dtype=np.float32))
    return t


def load(src, dtype=None):
    from . import isa
    t = ndarray(src.shape, dtype or src.dtype, sbuf)
    isa.dma_copy(dst=t, src=src)
    return t


def store(dst, value):
    from . import isa
    isa.dma_copy(dst=dst, src=value)


def device_print(print_prefix, tensor):
    if isinstance(tensor, NkiTensor) and tensor.storage.data is not None:
        from .tensor import raw
        print(print_prefix, np.array(raw(tensor)))


# ---- SPMD ------------------------------------------------------------------------------------
def program_id(axis=0):
    inst = _current("nl.program_id")
    if axis != 0:
        raise NkiValidationError(f"nl.program_id: only axis 0 exists (grid is [lnc]), got {axis}")
    return inst.pid if inst.launch.ndim else 0


def num_programs(axes=0):
    inst = _current("nl.num_programs")
    if axes not in (0, None):
        raise NkiValidationError(f"nl.num_programs: only axis 0 exists, got {axes}")
    return inst.launch.lnc


def program_ndim():
    return _current("nl.program_ndim").launch.ndim


# ---- loops (ref §2.4) ------------------------------------------------------------------------
def affine_range(start, stop=None, step=1):
    """Deprecated alias of range() in NKI 0.6.0."""
    return builtins.range(start, stop, step) if stop is not None else builtins.range(start)


sequential_range = static_range = affine_range


def _bound(x, op):
    if isinstance(x, VirtualRegister):
        return int(x.value)
    if isinstance(x, (int, np.integer)):
        return int(x)
    raise TypeError(f"{op}: bounds must be ints or VirtualRegisters, got {type(x).__name__}")


@contextlib.contextmanager
def _runtime_loop(op, *bounds):
    """Marks the instructions issued inside a runtime loop: its id joins ``inst.loops`` (depends_on placement
    rule) and its register bounds ``inst.loop_regs`` (traced as ``reg_reads`` of every body instruction: the
    loop cannot start before the registers are written). When tracing, the loop is appended to ``Trace.loops``
    on exit (also when it ran 0 times); the loops call :func:`_iteration` at every iteration."""
    inst = _current(op)
    inst.n_loops += 1
    saved = inst.loops, inst.loop_regs
    inst.loops = saved[0] + (inst.n_loops,)
    inst.loop_regs = saved[1] + tuple(b for b in bounds if isinstance(b, VirtualRegister))
    iters = inst.loop_iters
    before = _last_seqs(inst)
    site = call_site() if inst.launch.traces else None
    try:
        yield inst
    finally:
        lid = inst.loops[-1]
        last = inst.loop_iters[-1] if len(inst.loop_iters) > len(iters) else None
        inst.loops, inst.loop_regs = saved
        inst.loop_iters = iters
        if inst.launch.traces:
            _trace_loop(inst, op, lid, 0 if last is None else last[1] + 1, iters, before, site)


def _iteration(inst, k):
    """Iteration k of the innermost runtime loop starts: records carry ``loop`` = ((id, iteration), ...)."""
    d = len(inst.loops) - 1
    inst.loop_iters = inst.loop_iters[:d] + ((inst.loops[-1], k),)


def _last_seqs(inst):
    return {id(t): r["seq"] for t, r in inst.traced} if inst.traced else {}


def _trace_loop(inst, op, lid, trips, outer, before, site):
    """Append the loop to every capturing trace (``Trace.loops``, see trace.py), also when it ran 0 times."""
    after = _last_seqs(inst)
    for t, li in inst.launch.world.trace_slots:
        t._loop({"op": op.split(".")[-1], "id": lid, "rank": inst.launch.rank, "inst": inst.pid, "launch": li,
                 "loc": site, "trips": trips, "outer": [x[0] for x in outer],
                 "before": before.get(id(t), -1), "last": after.get(id(t), -1)})


def dynamic_range(start, stop=None, step=1):
    """Deprecated (0.6.0) runtime loop; yields read-only registers."""
    if stop is None:
        start, stop = 0, start
    if not isinstance(step, int) or step <= 0:
        raise NkiValidationError(f"nl.dynamic_range: step must be a positive compile-time int, got {step!r}")
    with _runtime_loop("nl.dynamic_range", start, stop) as inst:
        for k, i in enumerate(builtins.range(_bound(start, "nl.dynamic_range"), _bound(stop, "nl.dynamic_range"),
                                             step)):
            _iteration(inst, k)
            yield VirtualRegister(i, frozen=True)


def fori_loop(lower, upper, body_fun, step=1):
    """Runtime counted loop: body_fun(i) for i in range(lower, upper, step); i is a read-only register."""
    if not isinstance(step, int) or step == 0:
        raise NkiValidationError(f"nl.fori_loop: step must be a non-zero compile-time int, got {step!r}")
    with _runtime_loop("nl.fori_loop", lower, upper) as inst:
        for k, i in enumerate(builtins.range(_bound(lower, "nl.fori_loop"), _bound(upper, "nl.fori_loop"), step)):
            _iteration(inst, k)
            body_fun(VirtualRegister(i, frozen=True))


def while_loop(init, body_fun):
    """r = init; while r != 0: r = body_fun(r)."""
    if not isinstance(init, VirtualRegister):
        raise TypeError("nl.while_loop: init must be a VirtualRegister")
    r = init
    with _runtime_loop("nl.while_loop", init) as inst:
        base = inst.loop_regs[:-1]
        k = 0
        while r.value != 0:
            _iteration(inst, k)
            k += 1
            inst.loop_regs = base + (r,)      # the body runs on the current condition register
            r = body_fun(r)
            if not isinstance(r, VirtualRegister):
                raise TypeError("nl.while_loop: body_fun must return a VirtualRegister")


@contextlib.contextmanager
def no_reorder():
    """Scheduling constraint only; no effect in an in-order interpreter."""
    yield


# The experimental random-number wrappers (nkisim/language_random.py, built from nkisim/isa/rng.py).
from .language_random import dropout, rand, random_seed  # noqa: E402

# The other experimental tile-level wrappers (nkisim/experimental.py). Element-wise ones (nl.add, nl.exp, ...) are
# the operator constants above, made callable by ops.Op.__call__; these are the ones that are not operators.
from .experimental import (sum, max, min, mean, prod, var, all, softmax, rms_norm, where, expand_dims,  # noqa: E402
                           broadcast_to, transpose, matmul, load_transpose2d, gather_flattened)


def __getattr__(name):
    raise AttributeError(f"nki.language.{name} is not provided by nkisim (not in the NKI 0.6.0 API, or not "
                         f"implemented: see nkisim/README.md)")
