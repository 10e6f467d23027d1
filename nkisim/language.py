"""nkisim implementation of ``nki.language`` (NKI 0.6.0; SDK-NL)."""
import builtins
import contextlib
import hashlib
import sys
import warnings
import weakref

import numpy as np

from . import controlflow, dtypes as _dt, frontend, hw
from . import int32 as _int32
from .errors import NkiValidationError
from .memory import MemoryRegion, PSUM, SBUF, PRIVATE_HBM, SHARED_HBM
from .ops import OPS as _OPS, Op
from .registers import WHILE_CONDITION as _WHILE_CONDITION, VirtualRegister, _refuse as _reg_refuse, _where as _reg_where
from .site import call_site, current as _current, current_or_none as _current_or_none
from .tensor import NkiTensor, ds

# ---- dtypes (strings, ref §3.1) --------------------------------------------------------------
DType = _dt.DType
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
    # SDK-NL shared_constant: "With LNC=2, both cores share the same constant; the data must not diverge across cores"
    digest = hashlib.sha1(np.ascontiguousarray(arr).view(np.uint8).tobytes()).hexdigest()
    first = inst.launch.constants.setdefault(st.id, (digest, inst.pid, call_site()))
    if first[0] != digest:
        raise NkiValidationError(f"nl.shared_constant at {call_site()}: core {inst.pid} passes other data than core "
                                 f"{first[1]} did at {first[2]} for the same shared constant; with LNC=2 'the data must "
                                 f"not diverge across cores' (SDK-NL shared_constant)")
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
        t.storage.loops = ()       # a constant of the whole launch, wherever it is first asked for
        t.storage.shared = True    # NkiTensor.ap refuses it: its storage may be the compiler's shared identity
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
    if not isinstance(print_prefix, str):
        raise NkiValidationError(f"nl.device_print: print_prefix must be a constant string (SDK-NL device_print), got "
                                 f"{type(print_prefix).__name__}")
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


def _bound(x, op, name):
    """A runtime-loop bound: a Python int (32-bit, SDK-LG "NKI Values") or a VirtualRegister."""
    if isinstance(x, VirtualRegister):
        return int(x.value)
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return _int32.check(int(x), f"{op}: {name}")
    raise TypeError(f"{op}: bounds must be ints or VirtualRegisters, got {type(x).__name__}")


def _step(step, op):
    """SDK-NL dynamic_range / fori_loop: "step size, must be a compile-time positive integer (not VirtualRegister)"
    (SDK deep-dives/nki-dynamic-loops.rst "Parameter Constraints": the hardware loop encodes it as an immediate)."""
    if type(step) is not int or step <= 0:
        raise NkiValidationError(f"runtime loops: {op}: step must be a compile-time positive int (SDK-NL {op}; "
                                 f"nki-dynamic-loops.rst 'Parameter Constraints'), got {step!r} at {call_site()}")
    return _int32.check(step, f"{op}: step")


@contextlib.contextmanager
def _runtime_loop(op, bounds, trips):
    """Marks the instructions issued inside a runtime loop: its id joins ``inst.loops`` (depends_on placement and
    PSUM loop-state rules) and its register bounds ``inst.loop_regs`` (traced as ``reg_reads`` of every body
    instruction: the loop cannot start before the registers are written). Refuses a runtime loop inside
    ``nl.no_reorder()`` and logs it for the LNC-uniformity check (nkisim/controlflow.py). Yields (inst, log entry)."""
    inst = _current(op)
    if inst.no_reorder:
        raise NkiValidationError(
            f"runtime loops: {op} at {call_site()}: runtime loops are not supported inside an nl.no_reorder() block "
            f"(opened at {inst.no_reorder[-1]}): SDK-NL no_reorder 'Register-based dynamic loops (nl.fori_loop, nl.while_loop) "
            f"are not supported inside a no_reorder block'; nki-dynamic-loops.rst 'Interaction with no_reorder': "
            f"'This is NOT supported and will error'. Put the no_reorder block inside the loop body instead")
    entry = controlflow.enter(inst, op.split(".")[-1], trips)
    inst.n_loops += 1
    inst.loop_events += 1
    saved = inst.loops, inst.loop_regs
    inst.loops = saved[0] + (inst.n_loops,)
    inst.loop_regs = saved[1] + tuple(b for b in bounds if isinstance(b, VirtualRegister))
    iters = inst.loop_iters
    before = _last_seqs(inst)
    site = call_site() if inst.launch.traces else None
    try:
        yield inst, entry
    finally:
        lid = inst.loops[-1]
        last = inst.loop_iters[-1] if len(inst.loop_iters) > len(iters) else None
        inst.loops, inst.loop_regs = saved
        inst.loop_iters = iters
        inst.loop_events += 1
        if inst.launch.traces:
            _trace_loop(inst, op, lid, 0 if last is None else last[1] + 1, iters, before, site)


def _iteration(inst, k):
    """Iteration k of the innermost runtime loop starts: records carry ``loop`` = ((id, iteration), ...)."""
    d = len(inst.loops) - 1
    inst.loop_iters = inst.loop_iters[:d] + ((inst.loops[-1], k),)


# ---- the deprecated ``while reg:`` loop ------------------------------------------------------------------------
_WHILE_LOOPS = weakref.WeakKeyDictionary()     # program instance -> {(id(frame), while site): _WhileLoop}


class _WhileLoop:
    """One running ``while reg:`` loop: its runtime-loop context (_runtime_loop), log entry, body runs."""
    __slots__ = ("cm", "inst", "entry", "n", "base")


def _while_condition(reg, frame):
    """``bool(reg)``: legal only as the condition of a ``while reg:`` statement, which it runs as a runtime loop.

    The first evaluation at a site opens the loop (a ``while reg`` runtime loop: _runtime_loop), each later
    one ends the previous iteration; the loop closes when the register reads 0 (trip count = body runs, as
    nl.while_loop). The site is found from the bytecode position of the truth test (frontend.truth_test)."""
    site, construct = frontend.truth_test(frame)
    if site is None:
        _reg_refuse(f"uses it as a Python truth value ({construct})", frame)
    inst = _current_or_none()
    if inst is None:
        _reg_refuse("tests it in a while statement outside a kernel launch", frame)
    loops = _WHILE_LOOPS.get(inst)
    if loops is None:
        loops = _WHILE_LOOPS[inst] = {}
    key = (id(frame), site)
    w = loops.get(key)
    if w is None:
        w = loops[key] = _open_while(inst, frame, site)
    else:
        w.n += 1                           # the previous iteration's body ran
    if reg.value != 0:
        _iteration(inst, w.n)
        inst.loop_regs = w.base + (reg,)   # the body runs on the current condition register
        return True
    del loops[key]
    w.cm.__exit__(None, None, None)
    controlflow.finish(inst, w.entry, w.n)
    return False


def _open_while(inst, frame, site):
    bad = frontend.while_body_exit(frame.f_code, site)
    if bad is not None:
        raise NkiValidationError(
            f"runtime loops: {_reg_where(frame)}: the 'while reg:' loop at line {site[0]} has {bad}; a dynamic while loop "
            f"ends only when its condition register holds 0 (nki-language-guide.rst 'Dynamic Control Flow'; "
            f"nki-dynamic-loops.rst 'Using while with a VirtualRegister'): set the register to 0 with register_load "
            f"/ register_move instead")
    key = (frame.f_code.co_filename, site[0])
    if key not in _WHILE_WARNED:
        _WHILE_WARNED.add(key)
        warnings.warn(f"{_reg_where(frame)}: 'while reg:' loops are deprecated since NKI 0.6.0 and will be removed; use "
                      f"nl.while_loop(reg, body) (SDK-RN 0.6.0 'Deprecated and Removed APIs'; migration guide 0.6.0 "
                      f"'Pattern 2')", DeprecationWarning, stacklevel=4)
    w = _WhileLoop()
    w.cm = _runtime_loop("while reg", (), None)
    w.inst, w.entry = w.cm.__enter__()
    w.n = 0
    w.base = inst.loop_regs
    return w


_WHILE_WARNED = set()
_WHILE_CONDITION[0] = _while_condition    # VirtualRegister.__bool__ (nkisim/registers.py)


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
    op = "nl.dynamic_range"
    if stop is None:
        start, stop = 0, start
    step = _step(step, op)
    r = builtins.range(_bound(start, op, "start"), _bound(stop, op, "stop"), step)
    with _runtime_loop(op, (start, stop), len(r)) as (inst, _):
        for k, i in enumerate(r):
            _iteration(inst, k)
            yield VirtualRegister(i, frozen=True)


def fori_loop(lower, upper, body_fun, step=1):
    """Runtime counted loop: body_fun(i) for i in range(lower, upper, step); i is a read-only register."""
    op = "nl.fori_loop"
    step = _step(step, op)
    r = builtins.range(_bound(lower, op, "lower"), _bound(upper, op, "upper"), step)
    with _runtime_loop(op, (lower, upper), len(r)) as (inst, _):
        for k, i in enumerate(r):
            _iteration(inst, k)
            if body_fun(VirtualRegister(i, frozen=True)) is not None:
                raise NkiValidationError(f"runtime loops: nl.fori_loop at {call_site()}: body_fun returned a value; "
                                         f"'The fori_loop body function cannot return a value' (SDK migration guide "
                                         f"0.6.0 'Rules for migrated loops'): carry state in SBUF/HBM")


def while_loop(init, body_fun):
    """r = init; while r != 0: r = body_fun(r)."""
    if not isinstance(init, VirtualRegister):
        raise TypeError("nl.while_loop: init must be a VirtualRegister")
    r = init
    n = 0
    with _runtime_loop("nl.while_loop", (init,), None) as (inst, entry):
        base = inst.loop_regs[:-1]
        while r.value != 0:
            _iteration(inst, n)
            inst.loop_regs = base + (r,)      # the body runs on the current condition register
            r = body_fun(r)
            n += 1
            if not isinstance(r, VirtualRegister):
                raise TypeError("nl.while_loop: body_fun must return a VirtualRegister")
    controlflow.finish(inst, entry, n)


@contextlib.contextmanager
def no_reorder():
    """Scheduling constraint only (no effect in an in-order interpreter); runtime loops inside it are refused
    (see _runtime_loop). The block is dynamic: functions called under it are under it too (SDK how-to-scheduling)."""
    inst = _current("nl.no_reorder")
    inst.no_reorder.append(call_site())
    try:
        yield
    finally:
        inst.no_reorder.pop()


# The experimental random-number wrappers (nkisim/language_random.py, built from nkisim/isa/rng.py).
from .language_random import dropout, rand, random_seed  # noqa: E402

# The other experimental tile-level wrappers (nkisim/experimental.py). Element-wise ones (nl.add, nl.exp, ...) are
# the operator constants above, made callable by ops.Op.__call__; these are the ones that are not operators.
from .experimental import (sum, max, min, mean, prod, var, all, softmax, rms_norm, where, expand_dims,  # noqa: E402
                           broadcast_to, transpose, matmul, load_transpose2d, gather_flattened)


def __getattr__(name):
    raise AttributeError(f"nki.language.{name} is not provided by nkisim (not in the NKI 0.6.0 API, or not "
                         f"implemented: see nkisim/README.md)")


frontend.register_api_module(sys.modules[__name__], "nki.language")
frontend.register_api_class(NKIObject, "nki.language.NKIObject")
frontend.register_api_class(_TileSize, "nki.language._TileSize")
