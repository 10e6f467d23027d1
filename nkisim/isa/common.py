"""Shared machinery of the ISA instructions: operand validation, fp32 reads, round-on-write,
written-tracking and trace records."""
import numbers
import sys

import numpy as np

from .. import dtypes, frontend, hw, int32
from ..errors import NkiValidationError
from ..memory import HBM, ON_CHIP, PSUM, SBUF, mm_array
from ..registers import VirtualRegister
from ..site import _local as _rt_local, call_site, current, current_or_none, kernel_stack
from ..tensor import _STORE, NkiTensor, _extent, check_written, covers, mask, raw
from .enums import engine as E, reduce_cmd


_INT32_MAX = hw.INT32_MAX
ENGINE_NAME = {E.tensor: "PE", E.scalar: "ACT", E.vector: "DVE", E.gpsimd: "POOL", E.dma: "DMA", E.sync: "SP"}
# which memories each engine reaches (ref §5.0 "Memory reachability", SDK-ARCH)
REACH = {"PE": (SBUF, PSUM), "ACT": (SBUF, PSUM), "DVE": (SBUF, PSUM), "POOL": (SBUF,), "DMA": (SBUF,) + HBM}


def _mems(ms):
    return "/".join(m.value for m in ms)


# Raw integers for enum parameters are documented as rejected since NKI 0.3.0 (SDK migration guide 0.3.0 "Integer enum
# constants no longer supported"), but AWS's nki-library passes dge_mode=3 (= dge_mode.none) in the production paths
# of core/qkv/qkv_tkg.py and core/subkernels/norm_tkg_utils.py (rmsnorm/layernorm_tkg loads) and core/mlp/mlp_tkg in
# every release since 2.28, 2.29 (= NKI 0.3.0, compiled and run on hardware) included: accepted for dge_mode only,
# converted to the member, with a NkiFidelityWarning. Every other raw enum value stays refused.
_RAW_ENUM_ACCEPTED = ("dge_mode",)
_raw_warned = set()


def check_enum(op, name, value, enum_cls):
    """The enum member ``value`` (returned); see _RAW_ENUM_ACCEPTED for the one raw-integer exception."""
    if isinstance(value, enum_cls):
        return value
    if enum_cls.__name__ in _RAW_ENUM_ACCEPTED and type(value) is int and value in {m.value for m in enum_cls}:
        member = enum_cls(value)
        key = (op, enum_cls.__name__, value, call_site())
        if key not in _raw_warned:
            _raw_warned.add(key)
            import warnings
            from ..errors import NkiFidelityWarning
            warnings.warn(f"{op} at {key[3]}: {name}={value} is a raw integer; NKI 0.3.0 documents raw enum values as "
                          f"rejected (migration guide 'Integer enum constants no longer supported'), but AWS's "
                          f"hardware-tested nki-library passes dge_mode=3 in qkv_tkg / rmsnorm_tkg / mlp_tkg, so nkisim "
                          f"accepts it as nki.isa.{enum_cls.__name__}.{member.name}: write the member instead",
                          NkiFidelityWarning, stacklevel=4)
        return member
    raise NkiValidationError(f"{op}: {name} must be a nki.isa.{enum_cls.__name__} member (raw values are "
                             f"rejected since NKI 0.3.0), got {value!r}")


def tensor(op, name, t, mems=ON_CHIP, eng=None, allow_indirect=False):
    if type(t) is not NkiTensor and not isinstance(t, NkiTensor):
        raise TypeError(f"{op}: {name} must be a tensor (NkiTensor), got {type(t).__name__}")
    if t.storage.kind not in mems:
        who = f" ({eng} cannot access {t.buffer.value})" if eng else ""
        raise NkiValidationError(f"{op}: {name} is in {t.buffer.value} ({t.describe()}), expected "
                                 f"{_mems(mems)}{who}")
    if t.indirect is not None and not allow_indirect:
        ind = t.indirect
        if ind.kind != "scalar" or t.buffer not in ON_CHIP:
            raise NkiValidationError(f"{op}: {name} uses vector_offset (gather/scatter) or a dynamic HBM view; only "
                                     f"the DMA instructions accept those (SDK-ISA dma_copy)")
        if ind.dim == 0:
            raise NkiValidationError(f"{op}: {name} has a dynamic offset on the partition dim; an on-chip dynamic "
                                     f"select cannot target dim 0 (ref §3.2)")
    if t.storage.nelems > _INT32_MAX:       # only such tensors can be addressed beyond int32 (nkisim/int32.py)
        int32.check_view(op, name, t)
    return t


def geom(op, name, t, start_rule=True):
    """(absolute start partition, partition count, free elements per partition) of an on-chip view."""
    g = t._geom
    if g is not None and (g[3] or not start_rule):
        return g[:3]
    st = t.storage
    shape = t.shape
    n = shape[0]
    if n > hw.PMAX:
        raise NkiValidationError(f"{op}: {name} has {n} partitions, the partition dim is at most {hw.PMAX}")
    R = st.row_bytes
    bstr = t.bstrides
    if n > 1 and bstr[0] != R:
        raise NkiValidationError(f"{op}: {name} view {t.describe()} does not step one partition per index of its "
                                 f"first dim (byte stride {t.bstrides[0]}, partition row is {R} B)")
    p0 = t.boffset // R if R else 0
    if len(shape) == 2 and bstr[1] >= 0:             # common case of _extent, inlined
        lo = t.boffset - p0 * R
        hi = lo + bstr[1] * (shape[1] - 1) + t.itemsize if shape[1] else lo
    else:
        lo, hi = _extent(t.boffset - p0 * R, shape[1:], bstr[1:], t.itemsize)
    if t.size and (lo < 0 or hi > R):
        raise NkiValidationError(f"{op}: {name} view {t.describe()} crosses a partition boundary in its free dims")
    start = st.address[0] + p0
    if start_rule and hw.ENFORCE_START_PARTITION and n and start and start not in hw.legal_start_partitions(n):
        raise NkiValidationError(
            f"{op}: {name} starts at partition {start} with {n} partitions; compute engines require start "
            f"partition in {hw.legal_start_partitions(n)} for {n} partitions (SDK-ARCH start-partition rule; "
            f"switch: nkisim.hw.ENFORCE_START_PARTITION)")
    free = t.size // n if n else 0
    t._geom = (start, n, free, start_rule and hw.ENFORCE_START_PARTITION)
    return start, n, free


def match(op, a_name, a, b_name, b):
    """Same partition count and same elements per partition (ref §3.5)."""
    if a.shape[0] != b.shape[0]:
        raise NkiValidationError(f"{op}: {a_name} has {a.shape[0]} partitions but {b_name} has {b.shape[0]}; "
                                 f"they must occupy the same number of partitions")
    fa, fb = a.size // a.shape[0], b.size // b.shape[0]
    if fa != fb:
        raise NkiValidationError(f"{op}: {a_name} {list(a.shape)} has {fa} elements per partition but {b_name} "
                                 f"{list(b.shape)} has {fb}; they must match")


def not_both_psum(op, a_name, a, b_name, b):
    if isinstance(a, NkiTensor) and isinstance(b, NkiTensor) and a.buffer == PSUM and b.buffer == PSUM:
        raise NkiValidationError(f"{op}: {a_name} and {b_name} are both in psum; at most one tensor input may "
                                 f"be in PSUM (ref §5.0)")


def is_scalar(x):
    tx = type(x)
    if tx is float or tx is int or tx is bool:
        return True
    return isinstance(x, numbers.Number) and not isinstance(x, bool) or isinstance(x, (bool, np.bool_))


# ---- data access ------------------------------------------------------------------------------
def read_raw(op, name, t, flat=True):
    st = t.storage
    if st.data is None:
        return None
    if not st.full:
        check_written(t, op, name)
    a = raw(t)
    return a.reshape(t.shape[0], -1) if flat and st.onchip and len(t.shape) != 2 else a


def read(op, name, t, flat=True):
    """Engine input: storage values converted to fp32 (ref §8); always a fresh array."""
    a = read_raw(op, name, t, flat)
    return None if a is None else a.astype(np.float32)


_DIRECT_FLOAT = frozenset(dtypes.FLOAT - dtypes.PACKED - {"tfloat32"})


def write(t, values, exact=False, mm=False):
    """Round values to t.dtype (RNE, saturating ints) and store; mark written."""
    st = t.storage
    if st.data is None:
        return
    v = values if type(values) is np.ndarray else np.asarray(values)
    if not (exact or v.dtype == _STORE[t.dtype] or (v.dtype.kind == "f" and t.dtype in _DIRECT_FLOAT)):
        v = dtypes.cast(v, t.dtype)
    # (a float -> float assignment rounds exactly like dtypes.cast: numpy/ml_dtypes use one cast kernel)
    if v.shape != t.shape:
        v = v.reshape(t.shape)
    if st.fresh and covers(t):
        st.fresh = False            # overwritten entirely below: no sentinel fill needed (mark sets written)
    raw(t)[...] = v
    mark(t, mm)


def out_view(t):
    """Writable numpy view of a whole destination that the caller overwrites entirely (fast paths that compute
    straight into the storage with ``out=``); the caller must call mark(t) afterwards."""
    st = t.storage
    if st.fresh and covers(t):
        st.fresh = False            # overwritten entirely: no sentinel fill needed
    return raw(t)


def ufunc_into(t, fn, *args):
    """t = fn(*args) computed by the numpy ufunc ``fn`` directly into a float32 destination (same values as
    computing a temporary and writing it: fp32 in, fp32 out, no second rounding)."""
    fn(*args, out=out_view(t))
    mark(t)


F32_UFUNC_ARITH = frozenset(("add", "subtract", "multiply", "maximum", "minimum", "divide"))


def write_where(t, cond, values):
    """Masked write: only where cond (shape (P,F) or t.shape) is true; those elements become written."""
    st = t.storage
    if st.data is None:
        return
    out = raw(t)
    cond = np.asarray(cond).reshape(t.shape)
    vals = dtypes.cast(values, t.dtype).reshape(t.shape) if values.dtype != out.dtype else values.reshape(t.shape)
    np.copyto(out, vals, where=cond)
    if not st.full:
        m = mask(t)
        m[cond] = True
    st.dirty = True
    if st.psum and st.mm_state is not False:
        mask(t, mm_array(st))[cond] = False
        st.mm_state = None


def mark(t, mm=False):
    """Mark the bytes of view t written (and, in PSUM, whether by a matmul). Whole-storage writes also set
    ``storage.full`` (every byte written, never reverts) and ``storage.mm_state`` (uniform mm flag), which
    let later reads skip the per-byte mask."""
    st = t.storage
    if not st.full:
        if covers(t):
            if st.written is not None:
                st.written.fill(True)
            st.full = True
        else:
            mask(t)[...] = True
    st.dirty = True
    if st.psum:
        # the mm array is meaningful only while mm_state is None (mixed); uniform states live in mm_state
        mm = bool(mm)
        if covers(t):
            st.mm_state = mm
        elif st.mm_state is not mm:
            mask(t, mm_array(st))[...] = mm
            st.mm_state = None


def scalar_or_column(op, name, x, P, need_f32=True, eng=None):
    """An operand that is a compile-time scalar or a (P, 1) tile; returns (kind, value_or_tensor)."""
    if isinstance(x, NkiTensor):
        tensor(op, name, x, REACH.get(eng, ON_CHIP), eng)
        if x.shape[0] != P or x.size != x.shape[0]:
            raise NkiValidationError(f"{op}: {name} tile has shape {list(x.shape)}, expected ({P}, 1): one value per "
                                     f"partition, broadcast along the free dims")
        geom(op, name, x)
        if need_f32 and x.dtype != "float32":
            raise NkiValidationError(f"{op}: {name} tile must be float32 for arithmetic operators, got {x.dtype}")
        return "tile", x
    if is_scalar(x):
        int32.check_scalar(x, f"{op}: {name}")
        return "scalar", x
    raise TypeError(f"{op}: {name} must be a Python scalar or a ({P}, 1) tile, got {type(x).__name__}")


def column_values(op, name, kind, x):
    if kind == "scalar":
        return np.float32(x)
    v = read(op, name, x)
    return None if v is None else v.reshape(-1, 1)


# ---- trace -------------------------------------------------------------------------------------
_MEMNAME = {k: k.value for k in (SBUF, PSUM) + HBM}     # enum .value is a slow descriptor
def _span(t, boffset, r):
    """part/bytes of a direct access at byte offset ``boffset`` (see trace.py for the region format)."""
    st = t.storage
    if st.onchip:
        R = st.row_bytes
        p0 = boffset // R if R else 0
        lo2, hi2 = _extent(boffset - p0 * R, t.shape[1:], t.bstrides[1:], t.itemsize)
        r["part"] = [st.address[0] + p0, t.shape[0]]
        r["bytes"] = [st.address[1] + lo2, st.address[1] + hi2]
    else:
        r["bytes"] = list(_extent(boffset, t.shape, t.bstrides, t.itemsize))
    return r


def _resolved_offset(t):
    """Byte offset a scalar dynamic offset resolves to right now, or None when it is not known (placeholder
    register, an index tile without data, unwritten index) or out of bounds (the instruction itself reports /
    skips that). A register with a real value (executing, a real integer input or a register-value provider in
    shape-only mode, a loop induction register) resolves even when the accessed tensor holds no data."""
    from ..tensor import dyn_offset
    idx = t.indirect.index
    if getattr(idx, "placeholder", False):
        return None
    if isinstance(idx, NkiTensor) and (idx.storage.data is None or not (idx.storage.full or mask(idx).all())):
        return None
    try:
        return dyn_offset(t)
    except NkiValidationError:
        return None


def region(t, name):
    st = t.storage
    mem = _MEMNAME[st.kind]
    r = {"arg": name, "buf": st.id, "mem": mem, "name": st.name, "inst": st.owner if mem != "shared_hbm" else None}
    if t.indirect is not None:
        # data-independent extent: the whole indexed tensor (what shape-only mode records) ...
        r["indirect"] = t.indirect.kind
        if st.onchip:
            r["part"] = [st.address[0], st.partitions]
            r["bytes"] = [st.address[1], st.address[1] + st.row_bytes]
        else:
            r["bytes"] = [0, st.nbytes]
        # ... and, executing a scalar dynamic offset, the region actually accessed ("extent" keeps the former)
        off = _resolved_offset(t) if t.indirect.kind == "scalar" else None
        r["resolved"] = off is not None
        if off is not None:
            r["extent"] = {k: r[k] for k in ("part", "bytes") if k in r}
            _span(t, off, r)
        return r
    return _span(t, t.boffset, r)


def reg_id(inst, reg):
    """Trace name of a register: a per-instance number given at its first traced use (deterministic)."""
    if not reg.id:
        inst.reg_ids += 1
        reg.id = inst.reg_ids
    return reg.id


_FREE_LIMITED = ("ACT", "DVE", "POOL")


def _free_limits(op, eng, reads, writes):
    """Per-instruction free size of a VectorE / ScalarE / GpSimd operand (hw.ENGINE_SBUF_FMAX / ENGINE_PSUM_FMAX)."""
    for lst in (reads, writes):
        for nm, t in lst:
            if type(t) is NkiTensor and t.shape and t.shape[0]:
                free = t.size // t.shape[0]
                cap = hw.ENGINE_PSUM_FMAX if t.storage.psum else hw.ENGINE_SBUF_FMAX
                if free > cap:
                    raise NkiValidationError(
                        f"{op}: {nm} has {free} elements per partition; one {eng} instruction accesses at most "
                        f"{cap} in {'PSUM' if t.storage.psum else 'SBUF'} (SDK trainium_inferentia2_arch.rst, "
                        f"'Layout & Tile Size')")


# ---- engine access patterns: free dims and steps (hw.AP_*) ------------------------------------------
# An engine operand's free-dim pattern is the view's [step, num] pairs after the merges that change neither which
# elements are visited nor their order: size-1 dims are dropped (they add nothing to the address), and an outer dim
# whose step equals inner step * inner num is folded into the inner one (the two walk one arithmetic run; stride-0
# broadcast dims fold into each other). Dims are never reordered. That the compiler makes these merges is nkisim's
# assumption (the docs do not say it; a view has up to 5 dims, SDK-LG "Tensor Values", so a contiguous [P, a, b, c, d]
# tile would otherwise be a four-free-dim pattern for every instruction that reads it whole). The counts and steps
# that remain are what the instruction must encode: SDK-AP "Hardware Capability" (up to four free dims, "most
# instructions only support 1D/2D/3D in the free dimension due to instruction length limitations"); SDK-ARCH
# "Accessing SBUF/PSUM tensors using compute engines" ("up to four-dimensional tensorized access pattern", "a stride
# expressed in int16, measured in data elements"). DMA instructions are not limited here: their patterns become DMA
# descriptors, and the docs give no dimension limit for those (SDK-ISA dma_copy; SDK-DGE). The hardware's four free
# dims bound every on-chip view whatever consumes it: at most hw.VIEW_MAX_DIMS dims (nl.ndarray, reshape, ...) and
# four free [step, num] pairs in a raw .ap() pattern (tensor.py).
AP_ENGINES = ("PE", "ACT", "DVE", "POOL")
# (instruction, operand) pairs documented to take four free dims: tensor_reduce's data (SDK-NL sum / max / ...: "axis
# ... can only be the last contiguous dim(s) of the tile: [1], [1,2], [1,2,3], [1,2,3,4]", and the SDK average_pool2d
# tutorial reduces a [P, H/2, W/2, 2, 2] view: "requires a 4D memory access pattern in the F dimension").
_AP_FOUR_FREE = frozenset({("tensor_reduce", "data")})
_ap_warned = set()


def engine_free_pattern(t, split=None):
    """[[step, num], ...] (elements, outermost first) of on-chip view t's free dims after the merges above; ``split``
    (a dim index of t) keeps the dims before it and from it on apart (tensor_reduce: kept vs reduced axes)."""
    isz = t.itemsize
    out = []
    for d in range(1, len(t.shape)):
        n = t.shape[d]
        if n == 1:
            continue
        s = t.bstrides[d] // isz
        if out and out[-1][0] == s * n and not (split is not None and out[-1][2] < split <= d):
            out[-1] = [s, out[-1][1] * n, out[-1][2]]
        else:
            out.append([s, n, d])
    return [[s, n] for s, n, _ in out]


def _ap_limits(op, reads, writes, split):
    """hw.AP_COMMON_FREE_DIMS / AP_MAX_STRIDE for every operand of a compute-engine instruction (more than
    AP_MAX_FREE_DIMS cannot arrive: on-chip views have at most hw.VIEW_MAX_DIMS dims, tensor.py / runtime.py)."""
    for lst in (reads, writes):
        for nm, t in lst:
            if type(t) is not NkiTensor or not t.storage.onchip:
                continue
            # cheap filter: <= 3 free dims, and a partition row too short for a step beyond int16
            if len(t.shape) <= 1 + hw.AP_COMMON_FREE_DIMS and t.storage.row_bytes <= hw.AP_MAX_STRIDE * t.itemsize:
                continue
            pat = engine_free_pattern(t, split if op == "tensor_reduce" and nm == "data" else None)
            where = (f"{op}: {nm} {t.describe()} has the free-dim access pattern {pat} ([step, num] in {t.dtype} "
                     f"elements, after dropping size-1 dims and merging dims that walk one contiguous run)")
            for s, n in pat:
                if abs(s) > hw.AP_MAX_STRIDE:
                    raise NkiValidationError(
                        f"{where}: step {s} does not fit the int16 stride of an engine access pattern (|step| <= "
                        f"{hw.AP_MAX_STRIDE} elements; SDK-ARCH 'Accessing SBUF/PSUM tensors using compute "
                        f"engines', ref §3.3): split the instruction along that dim or re-lay the tile")
            if len(pat) > hw.AP_COMMON_FREE_DIMS and (op, nm) not in _AP_FOUR_FREE and hw.AP_FOUR_FREE_DIMS != "off":
                site = call_site()
                msg = (f"{where} at {site}: {len(pat)} free dims; \"most instructions only support 1D/2D/3D in the "
                       f"free dimension due to instruction length limitations\" (SDK-AP nki-aps.rst 'Hardware "
                       f"Capability', ref §3.3; the docs give four only to tensor_reduce's data): split the "
                       f"instruction along an outer dim (switch: nkisim.hw.AP_FOUR_FREE_DIMS)")
                if hw.AP_FOUR_FREE_DIMS == "error":
                    raise NkiValidationError(msg)
                key = (site, op, nm)
                if key not in _ap_warned:
                    _ap_warned.add(key)
                    import warnings
                    from ..errors import NkiFidelityWarning
                    warnings.warn(msg, NkiFidelityWarning, stacklevel=4)


def record(op, eng, reads=(), writes=(), reg_reads=(), reg_writes=(), **extra):
    """Check the launch is alive and, when tracing, append one instruction record (see trace.py / README)."""
    inst = current(op)
    launch = inst.launch
    if eng in _FREE_LIMITED:
        _free_limits(op, eng, reads, writes)
    if eng in AP_ENGINES:
        _ap_limits(op, reads, writes, extra["axis"][0] if op == "tensor_reduce" else None)
    if launch.world.aborted is not None:
        from ..errors import LaunchAborted
        raise LaunchAborted(f"{op}: the launch was aborted by another instance")
    if inst.shape_only:                 # a shape-only write forgets the values a DMA carried (dma.carry_known)
        for _, t in writes:
            if type(t) is NkiTensor and t.storage.known is not None:
                t.storage.known = None
    if inst.loop_events:                # a runtime loop has started: the loop rules (see _loop_rules)
        for lst in (writes, reads):
            for _, t in lst:
                if type(t) is NkiTensor:
                    st = t.storage
                    if st.psum or st.loops:
                        _loop_rules(op, inst, reads, writes, extra.get("accumulate", None))
                        break
            else:
                continue
            break
    else:                               # before any runtime loop: only note which PSUM values exist (epoch 0)
        for lst in (writes, reads):
            for _, t in lst:
                if type(t) is NkiTensor and t.storage.psum:
                    t.storage.epoch = 0
    if launch.world.lint:
        f = sys._getframe(2)            # the code that called the ISA op
        b = f.f_back
        key = (id(f), f.f_code, id(b), b.f_code if b is not None else None)
        if key != inst.lint_last:       # else: same frame and caller as the last ISA call, nothing new
            inst.lint_last = key
            frontend.check_stack(f, inst.lint_seen)
    if not launch.traces:
        return inst
    shapes, dts, moved = {}, {}, {}
    regs_r, regs_w = [], []
    rr = [r for r in reg_reads if isinstance(r, VirtualRegister)]
    index_reads = []
    for lst, out, key in ((reads, regs_r, "read"), (writes, regs_w, "write")):
        for name, t in lst:
            if not isinstance(t, NkiTensor):
                continue
            shapes[name] = list(t.shape)
            dts[name] = t.dtype
            m = moved.setdefault(_MEMNAME[t.storage.kind], {"read": 0, "write": 0})
            m[key] += t.size * t.itemsize
            out.append(region(t, name))
            ind = t.indirect
            if ind is not None:     # the offset source is read too: an index tile or a register
                if isinstance(ind.index, NkiTensor):
                    index_reads.append((f"{name}.{ind.kind}_offset", ind.index))
                elif isinstance(ind.index, VirtualRegister):
                    rr.append(ind.index)
    for name, t in index_reads:
        shapes[name] = list(t.shape)
        dts[name] = t.dtype
        m = moved.setdefault(_MEMNAME[t.storage.kind], {"read": 0, "write": 0})
        m["read"] += t.size * t.itemsize
        regs_r.append(region(t, name))
    loc, stack = kernel_stack()
    rec = {"inst": inst.pid, "engine": eng, "op": op, "loc": loc, "stack": stack, "shapes": shapes, "dtypes": dts,
           "bytes": moved, "reads": regs_r, "writes": regs_w}
    rr.extend(inst.loop_regs)           # registers bounding the enclosing runtime loops
    if inst.loop_iters:
        rec["loop"] = inst.loop_iters   # ((loop id, iteration), ...) of the enclosing runtime loops
    if rr:
        ids = []
        for r in rr:
            i = reg_id(inst, r)
            if i not in ids:
                ids.append(i)
        rec["reg_reads"] = ids
    if reg_writes:
        rec["reg_writes"] = [reg_id(inst, r) for r in reg_writes]
    rec.update(extra)
    inst.last_recs = inst.traced = launch.record(rec)
    return inst


# ---- PSUM and runtime loops ------------------------------------------------------------------------
# Loop state of a runtime loop lives in SBUF/HBM, never PSUM: SDK-NL fori_loop / while_loop "carry any other loop
# state through SBUF/HBM". (1) An instruction of ANY engine inside a runtime loop that writes a PSUM tensor allocated
# outside that loop is refused (hw.LOOP_PSUM_CHECK, default "error"): the write carries state across iterations or
# out of the loop. Corroborated for the tensor engine by a public NKI 0.6 project's compiler probe (neuronx-cc 2.27:
# NCC_IBIR092 "Live-in/Live-out MemoryLocation ... not allocated to MemoryType: DRAM"); the same probe saw an ACT
# write into such PSUM compile, but the documented rule names no engine, so nkisim refuses every engine.
# (2) A PSUM value live across a runtime-loop boundary -- accessed before a loop starts (or ends) and read or
# accumulated onto after that boundary (e.g. an nc_matmul accumulation group kept open across a loop, or PSUM
# written before a loop and read inside it) -- is a NkiFidelityWarning (hw.LOOP_PSUM_LIVE, default "warn"): the docs
# do not forbid it (nki-dynamic-loops.rst "Register Allocation Implications": live tensors stay in SBUF/PSUM for the
# loop's duration), but NCC_IBIR092 names live-in / live-out memory of a loop, so it is a likely rejection. A whole
# overwrite (not an accumulating matmul) starts a new value and is not a crossing.
# (3) A tensor allocated inside the body of a runtime loop is used after the loop: refused (SDK-MIG 0.6.0 "Rules for
# migrated loops": "Tensors (nl.ndarray) declared inside a body function cannot be referenced outside of the loop").
_psum_warned = set()


def _loop_rules(op, inst, reads, writes, accumulate):
    ev = inst.loop_events
    loops = inst.loops
    for is_write, lst in ((True, writes), (False, reads)):
        for name, t in lst:
            if type(t) is not NkiTensor:
                continue
            st = t.storage
            if st.loops and loops[:len(st.loops)] != st.loops:
                raise NkiValidationError(
                    f"runtime loops: {op} at {call_site()}: {name} is {t.describe()}, allocated inside the body of a "
                    f"runtime loop (nl.fori_loop / nl.while_loop / nl.dynamic_range) that has ended; tensors declared "
                    f"inside a loop body cannot be referenced outside of the loop (SDK migration guide 0.6.0 'Rules for "
                    f"migrated loops'): declare it before the loop")
            if not st.psum:
                continue
            if is_write and loops and loops[-1] not in st.loops:
                _loop_rule(hw.LOOP_PSUM_CHECK, op, name, t, "loop_write",
                           f"writes PSUM tensor {t.describe()} inside a runtime loop (nl.fori_loop / nl.while_loop / "
                           f"nl.dynamic_range) that it was allocated outside of; loop state lives in SBUF/HBM, never "
                           f"PSUM (SDK-NL fori_loop / while_loop: 'carry any other loop state through SBUF/HBM'; "
                           f"neuronx-cc 2.27 NCC_IBIR092 'Live-in/Live-out MemoryLocation'): allocate the PSUM tile "
                           f"inside the loop body and carry state in SBUF (switch: nkisim.hw.LOOP_PSUM_CHECK)")
            e = st.epoch
            if e is not None and e != ev and not (is_write and (op != "nc_matmul" or accumulate is False)
                                                  and covers(t)):    # (a whole overwrite starts a new value)
                _loop_rule(hw.LOOP_PSUM_LIVE, op, name, t, "live",
                           f"{'accumulates onto' if is_write else 'reads'} PSUM tensor {t.describe()} whose value was "
                           f"written before a runtime-loop boundary (the value is live across an nl.fori_loop / "
                           f"nl.while_loop / nl.dynamic_range); loop state belongs in SBUF/HBM (SDK-NL fori_loop: 'carry "
                           f"any other loop state through SBUF/HBM'; NCC_IBIR092 names loop live-in/live-out memory). "
                           f"Evict the PSUM value to SBUF before the loop, or keep the accumulation group on one side "
                           f"of it (switch: nkisim.hw.LOOP_PSUM_LIVE)")
            st.epoch = ev


def _loop_rule(mode, op, name, t, kind, msg):
    if mode == "off":
        return
    site = call_site()
    text = f"runtime loops: {op} at {site}: {name} {msg}"
    if mode == "error":
        raise NkiValidationError(text)
    key = (site, kind)
    if key not in _psum_warned:
        _psum_warned.add(key)
        import warnings
        from ..errors import NkiFidelityWarning
        warnings.warn(text, NkiFidelityWarning, stacklevel=4)


class Instruction:
    """Handle returned by every ISA call (SDK-ISA NkiInstruction). ``depends_on`` adds scheduling edges: they do
    not change what an in-order interpreter computes, but they are recorded in the trace (``depends_on``: the
    producers' ``seq``) and the documented placement rule is checked (SDK-ISA NkiInstruction.depends_on: "both
    instructions must sit at the same dynamic-loop nesting (or the producer in an enclosing scope). You cannot
    wire an edge into or out of a dynamic loop (nl.fori_loop / nl.while_loop)")."""
    __slots__ = ("op", "loops", "recs")

    def __init__(self, op):
        self.op = op
        inst = getattr(_rt_local, "inst", None)
        if inst is None:
            self.loops, self.recs = (), None
            return
        self.loops = inst.loops
        recs = inst.last_recs
        if recs is not None:
            inst.last_recs = None
            if recs[0][1]["op"] != op:
                recs = None
        self.recs = recs

    def depends_on(self, *producers):
        for p in producers:
            if not isinstance(p, Instruction):
                raise TypeError(f"{self.op}.depends_on: producers must be instruction handles returned by nki.isa "
                                f"calls, got {type(p).__name__}")
            if p.loops != self.loops[:len(p.loops)]:
                raise NkiValidationError(
                    f"{self.op}.depends_on({p.op}): the producer is inside a dynamic loop (nl.fori_loop / "
                    f"nl.while_loop / nl.dynamic_range) that does not enclose this instruction; an edge cannot be wired "
                    f"into or out of a dynamic loop (SDK-ISA NkiInstruction.depends_on)")
            if self.recs and p.recs:
                for t, r in self.recs:
                    for t2, r2 in p.recs:
                        if t is t2:
                            deps = r.setdefault("depends_on", [])
                            if r2["seq"] not in deps:
                                deps.append(r2["seq"])
        return self


def reg_value(x, op, name):
    if isinstance(x, VirtualRegister):
        return x.value
    if isinstance(x, (int, np.integer)):
        return int(x)
    raise TypeError(f"{op}: {name} must be an int or a VirtualRegister, got {type(x).__name__}")


def accumulate(regs, lanes, cmd, sums, op_fn, identity, op, load=None):
    """Engine accumulator registers (ref §5.0): idle / reset / reduce / reset_reduce / load_reduce."""
    if cmd == reduce_cmd.idle:
        return
    if cmd == reduce_cmd.reset:
        regs[lanes] = identity
        return
    if cmd == reduce_cmd.reset_reduce:
        regs[lanes] = sums
    elif cmd == reduce_cmd.reduce:
        regs[lanes] = op_fn(regs[lanes], sums)
    elif cmd == reduce_cmd.load_reduce:
        if load is None:
            raise NkiValidationError(f"{op}: reduce_cmd=load_reduce needs an initial value")
        regs[lanes] = op_fn(np.float32(load), sums)


frontend.register_api_class(Instruction, "nki.isa.NkiInstruction")
