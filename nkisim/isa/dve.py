"""VectorE (and engine-selectable) element-wise, reduction, selection and top-k instructions
(ref §5.4-§5.6, §5.8; SDK-ISA)."""
import numpy as np

from ..runtime import QUIET

from .. import dtypes, hw, int32, ops
from ..errors import NkiValidationError, by_switch
from ..memory import ON_CHIP, PSUM, SBUF
from ..tensor import NkiTensor, raw
from .common import (F32_UFUNC_ARITH, REACH, Instruction, accumulate, check_enum, column_values, geom, is_scalar,
                     mark, match, not_both_psum, out_view, read, read_raw, record, scalar_or_column, tensor,
                     ufunc_into, write, write_where)
from .common import _DIRECT_FLOAT
from .enums import engine as E, reduce_cmd as RC

F32 = np.float32
_INT32 = ("int32", "uint32")


_ALU_OK = {}       # (op, where, arg, allow) -> op, for operators that passed the checks below


def _alu(where, op, arg="op", allow=("arith", "cmp", "logical", "bitvec", "other", "unary"), reduction=False):
    key = (op, where, arg, allow, reduction)
    o = _ALU_OK.get(key) if type(op) is ops.Op else None
    if o is not None:
        return o
    o = _alu_check(where, op, arg, allow, reduction)
    _ALU_OK[key] = o
    return o


def _alu_check(where, op, arg, allow, reduction=False):
    o = ops.get(op, where, arg, reduction=reduction)
    if not o.is_alu or o.kind not in allow:
        raise NkiValidationError(f"{where}: {arg}={o!r} is not a valid ALU operator here (allowed kinds: "
                                 f"{', '.join(allow)}; see ref §6.1)")
    if o.v4 or o.alu_v4:
        raise NkiValidationError(f"{where}: {arg}={o!r} is NeuronCore-v4 only, not available on trn2")
    if o.name in ("mod", "fmod"):
        raise NkiValidationError(f"{where}: {arg}={o!r} is documented as not supported on hardware")
    return o


def _bits(a, name):
    """Integer bit patterns (unsigned, width of the dtype) as int64."""
    w = dtypes.itemsize(name) * 8
    return a.view(np.dtype(f"u{w // 8}")).astype(np.int64), w


def _from_bits(v, dst):
    w = dst.itemsize
    u = (v & ((1 << (8 * w)) - 1)).astype(np.dtype(f"u{w}"))
    return u.view(dtypes.storage(dst.dtype))


def _engine_of(where, engine, default, allowed):
    check_enum(where, "engine", engine, E)
    if engine == E.unknown:
        return default
    eng = "DVE" if engine is E.vector else "POOL" if engine is E.gpsimd else "ACT" if engine is E.scalar else None
    if eng not in allowed:
        raise NkiValidationError(f"{where}: engine={engine} not supported; expected one of "
                                 f"{', '.join(a for a in allowed)} engines")
    return eng


def _pool_float(where):
    by_switch(hw.POOL_FLOAT_TENSOR_TENSOR,
              f"{where}: engine=gpsimd with floating-point operands: GpSimd runs tensor_tensor only on int32/uint32 "
              f"operands or op=nl.power (ref §5.0 engine map; trn2-costs 'Pitfalls met on real hardware': "
              f"'tensor_tensor cannot run on Pool'); use VectorE (switch: nkisim.hw.POOL_FLOAT_TENSOR_TENSOR)")


def _pool_bitvec(where, op):
    by_switch(hw.POOL_BITVEC_TENSOR_TENSOR,
              f"{where}: engine=gpsimd with bitvec op {op!r}: the SDK-ISA documents bitvec operators on VectorE only "
              f"(int32 tensor_tensor goes to GpSimd for arithmetic operators); use VectorE "
              f"(switch: nkisim.hw.POOL_BITVEC_TENSOR_TENSOR)")


def _operands(where, eng, *named):
    for nm, t in named:
        if isinstance(t, NkiTensor):
            tensor(where, nm, t, REACH[eng], eng)
            geom(where, nm, t)


# ---- tensor_tensor ---------------------------------------------------------------------------
def tensor_tensor(dst, data1, data2, op, engine=E.unknown, name=None):
    w = "tensor_tensor"
    o = _alu(w, op, allow=("arith", "cmp", "logical", "bitvec", "other"))
    if o.name == "invert":
        raise NkiValidationError(f"{w}: op=nl.invert is unary; use tensor_scalar")
    for nm, t in (("dst", dst), ("data1", data1), ("data2", data2)):
        tensor(w, nm, t, ON_CHIP)
    ints = dst.dtype in _INT32 and data1.dtype in _INT32 and data2.dtype in _INT32
    anypsum = dst.storage.psum or data1.storage.psum or data2.storage.psum
    default = "POOL" if (o.name == "power" or (ints and not anypsum and o.kind != "bitvec")) else "DVE"
    eng = _engine_of(w, engine, default, ("DVE", "POOL"))
    if o.name == "power" and eng != "POOL":
        raise NkiValidationError(f"{w}: op=nl.power runs on GpSimd only")
    if eng == "POOL" and not ints and o.name != "power":
        _pool_float(w)
    if eng == "POOL" and o.kind == "bitvec":
        _pool_bitvec(w, o.name)
    _operands(w, eng, ("dst", dst), ("data1", data1), ("data2", data2))
    match(w, "dst", dst, "data1", data1)
    match(w, "dst", dst, "data2", data2)
    not_both_psum(w, "data1", data1, "data2", data2)
    if o.kind == "bitvec":
        for nm, t in (("dst", dst), ("data1", data1), ("data2", data2)):
            if not dtypes.is_int(t.dtype):
                raise NkiValidationError(f"{w}: bitvec op {o!r} needs integer dtypes, {nm} is {t.dtype}")
    inst = record(w, eng, reads=[("data1", data1), ("data2", data2)], writes=[("dst", dst)], alu=o.name)
    if inst.shape_only:
        return Instruction(w)
    if (dst.dtype == "float32" and data1.dtype == "float32" and data2.dtype == "float32" and
            o.name in F32_UFUNC_ARITH and dst.shape == data1.shape == data2.shape):
        # fast path: fp32 everywhere, same shapes -> compute straight into dst (identical values)
        a, b = read_raw(w, "data1", data1, flat=False), read_raw(w, "data2", data2, flat=False)
        ufunc_into(dst, o.fn, a, b)
        return Instruction(w)
    a, b = read_raw(w, "data1", data1), read_raw(w, "data2", data2)
    if o.kind == "bitvec":
        ab, _ = _bits(a, data1.dtype)
        if o.name in ("left_shift", "right_shift"):
            bb = b.astype(np.int64)
        else:
            bb, _ = _bits(b, data2.dtype)
        write(dst, _from_bits(o.fn(ab, bb), dst).reshape(dst.shape), exact=True)
    elif eng == "POOL" and ints and o.kind == "arith" and o.name != "divide":
        write(dst, o.fn(a.astype(np.int64), b.astype(np.int64)))      # GpSimd native int32 (ref §8)
    else:
        with QUIET:
            write(dst, np.asarray(o.fn(a.astype(F32), b.astype(F32)), dtype=F32))
    return Instruction(w)


# ---- tensor_scalar ---------------------------------------------------------------------------
def _apply(o, x, operand, reverse):
    if o.kind == "unary":
        return o.fn(x)
    return o.fn(operand, x) if reverse else o.fn(x, operand)


def tensor_scalar(dst, data, op0, operand0, reverse0=False, op1=None, operand1=None, reverse1=False,
                  engine=E.unknown, name=None):
    w = "tensor_scalar"
    o0 = _alu(w, op0, "op0")
    o1 = None if op1 is None else _alu(w, op1, "op1")
    tensor(w, "dst", dst, ON_CHIP)
    tensor(w, "data", data, ON_CHIP)
    eng = _engine_of(w, engine, "DVE", ("DVE", "ACT", "POOL"))
    if eng == "ACT":
        combo = (o0.name, None if o1 is None else o1.name)
        if combo not in (("multiply", "add"), ("multiply", None), ("add", None)):
            raise NkiValidationError(f"{w}: engine=scalar supports only (multiply, add), (multiply,) or (add,) on "
                                     f"trn2, got {combo}")
    if eng == "POOL" and o0.name != "rsqrt":
        raise NkiValidationError(f"{w}: engine=gpsimd is only for op0=nl.rsqrt, got {o0!r}")
    bit = [o.kind == "bitvec" for o in (o0, o1) if o is not None]
    if any(bit) and not all(bit):
        raise NkiValidationError(f"{w}: op0 and op1 must both be bitvec or both arithmetic, got {o0!r}, {o1!r}")
    if any(bit) and eng != "DVE":
        raise NkiValidationError(f"{w}: bitvec operators run only on the Vector engine")
    _operands(w, eng, ("dst", dst), ("data", data))
    match(w, "dst", dst, "data", data)
    P = data.shape[0]
    reads = [("data", data)]
    kinds = []
    for o, x, nm in ((o0, operand0, "operand0"), (o1, operand1, "operand1")):
        if o is None:
            if x is not None:
                raise NkiValidationError(f"{w}: {nm} given without an operator")
            kinds.append((None, None))
            continue
        if o.kind == "unary":
            if x not in (None, 0, 0.0):
                raise NkiValidationError(f"{w}: unary operator {o!r} takes {nm}=None or 0, got {x!r}")
            kinds.append(("none", None))
            continue
        if x is None:
            raise NkiValidationError(f"{w}: {nm} is required for {o!r}")
        k, v = scalar_or_column(w, nm, x, P, need_f32=(o.kind != "bitvec"), eng=eng)
        if k == "tile":
            reads.append((nm, v))
        kinds.append((k, v))
    if any(bit):
        for nm, t in (("dst", dst), ("data", data)):
            if not dtypes.is_int(t.dtype):
                raise NkiValidationError(f"{w}: bitvec ops need integer dtypes, {nm} is {t.dtype}")
    inst = record(w, eng, reads=reads, writes=[("dst", dst)], alu=[o0.name, None if o1 is None else o1.name])
    if inst.shape_only:
        return Instruction(w)
    if any(bit):
        x, _ = _bits(read_raw(w, "data", data), data.dtype)
        for o, (k, v), rev in ((o0, kinds[0], reverse0), (o1, kinds[1], reverse1)):
            if o is None:
                continue
            operand = None if k == "none" else (int(v) if k == "scalar" else read_raw(w, "operand", v).astype(np.int64))
            x = _apply(o, x, operand, rev)
        write(dst, _from_bits(x, dst).reshape(dst.shape), exact=True)
        return Instruction(w)
    if (dst.dtype == "float32" and data.dtype == "float32" and dst.shape == data.shape and len(dst.shape) == 2
            and o0.name in F32_UFUNC_ARITH and (o1 is None or o1.name in F32_UFUNC_ARITH)):
        # fast path: fp32 in and out, 2-D, binary arithmetic -> compute straight into dst (identical values)
        x = read_raw(w, "data", data)
        vals = [None if o is None else column_values(w, "operand", k, v)
                for o, (k, v) in ((o0, kinds[0]), (o1, kinds[1]))]
        out = out_view(dst)
        for o, val, rev in ((o0, vals[0], reverse0), (o1, vals[1], reverse1)):
            if o is not None:
                if rev:
                    o.fn(val, x, out=out)
                else:
                    o.fn(x, val, out=out)
                x = out
        mark(dst)
        return Instruction(w)
    x = read(w, "data", data)
    with QUIET:
        for o, (k, v), rev in ((o0, kinds[0], reverse0), (o1, kinds[1], reverse1)):
            if o is None:
                continue
            operand = None if k == "none" else column_values(w, "operand", k, v)
            x = np.asarray(_apply(o, x, operand, rev), dtype=F32)
    write(dst, x)
    return Instruction(w)


# ---- scalar_tensor_tensor --------------------------------------------------------------------
def scalar_tensor_tensor(dst, data, op0, operand0, op1, operand1, reverse0=False, reverse1=False, name=None):
    w = "scalar_tensor_tensor"
    o0 = _alu(w, op0, "op0", allow=("arith", "cmp", "logical"))
    o1 = _alu(w, op1, "op1", allow=("arith", "cmp", "logical"))
    for nm, t in (("dst", dst), ("data", data), ("operand1", operand1)):
        tensor(w, nm, t, ON_CHIP, "DVE")
        geom(w, nm, t)
    match(w, "dst", dst, "data", data)
    match(w, "dst", dst, "operand1", operand1)
    not_both_psum(w, "data", data, "operand1", operand1)
    P = data.shape[0]
    k0, v0 = scalar_or_column(w, "operand0", operand0, P, eng="DVE")
    reads = [("data", data), ("operand1", operand1)] + ([("operand0", v0)] if k0 == "tile" else [])
    inst = record(w, "DVE", reads=reads, writes=[("dst", dst)], alu=[o0.name, o1.name])
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "data", data)
    y = read(w, "operand1", operand1)
    with QUIET:
        t = np.asarray(_apply(o0, x, column_values(w, "operand0", k0, v0), reverse0), dtype=F32)
        r = np.asarray(_apply(o1, t, y, reverse1), dtype=F32)
    write(dst, r)
    return Instruction(w)


# ---- tensor_reduce ---------------------------------------------------------------------------
def _reduce(o, x, axes):
    if o.name == "add":
        return np.sum(x, axis=axes, dtype=F32)
    if o.name == "multiply":
        return np.prod(x, axis=axes, dtype=F32)
    if o.name == "maximum":
        return np.max(x, axis=axes)
    if o.name == "minimum":
        return np.min(x, axis=axes)
    if o.name == "subtract":     # left fold: x0 - x1 - x2 ... (inference; ref §6.1 lists it as reducible)
        flat = x.reshape(x.shape[:min(axes)] + (-1,))
        return (flat[..., 0] - np.sum(flat[..., 1:], axis=-1, dtype=F32)).astype(F32)
    if o.kind == "logical":
        b = x != 0
        r = {"logical_and": np.all, "logical_or": np.any}.get(o.name)
        if r is not None:
            return r(b, axis=axes).astype(F32)
        return (np.sum(b, axis=axes) % 2).astype(F32)
    if o.kind == "bitvec":
        f = {"bitwise_and": np.bitwise_and, "bitwise_or": np.bitwise_or, "bitwise_xor": np.bitwise_xor}[o.name]
        return f.reduce(x, axis=axes)
    raise AssertionError(o)


def tensor_reduce(dst, op, data, axis, negate=False, keepdims=False, name=None):
    w = "tensor_reduce"
    o = _alu(w, op, allow=("arith", "logical", "bitvec"), reduction=True)
    if not o.reducible or o.name == "divide":
        raise NkiValidationError(f"{w}: {o!r} is not a reduction operator (ref §6.1)")
    tensor(w, "data", data, ON_CHIP, "DVE")
    tensor(w, "dst", dst, ON_CHIP, "DVE")
    _, P, _ = geom(w, "data", data)
    geom(w, "dst", dst)
    nd = data.ndim
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    try:
        axes = tuple(sorted(int(a) % nd if int(a) < 0 else int(a) for a in axes))
    except TypeError:
        raise TypeError(f"{w}: axis must be an int or a tuple of ints, got {axis!r}") from None
    if not axes or 0 in axes or axes != tuple(range(axes[0], nd)) or axes[-1] >= nd:
        raise NkiValidationError(f"{w}: axis {axis!r} for data of rank {nd}: must name the trailing contiguous free "
                                 f"axes ending at the last dim (e.g. {nd - 1}, or ({', '.join(map(str, range(1, nd)))})); "
                                 f"the partition axis 0 cannot be reduced"
                                 + (f"; since NKI 0.3.0 axis=1 no longer means the last dim of a {nd}-D tensor "
                                    f"(update guide, 'tensor_reduce - Axis Handling Fix')" if axes == (1,) and nd > 2
                                    else ""))
    if len(axes) > 4:
        raise NkiValidationError(f"{w}: at most 4 free axes can be reduced")
    kept = 1
    for d in range(1, axes[0]):
        kept *= data.shape[d]
    if dst.shape[0] != P or dst.size // max(dst.shape[0], 1) != kept:
        raise NkiValidationError(f"{w}: dst {list(dst.shape)} must have {P} partitions and {kept} elements per "
                                 f"partition for data {list(data.shape)} reduced over axes {axes}")
    if negate and o.kind != "arith":
        raise NkiValidationError(f"{w}: negate applies only to arithmetic operators, got {o!r}")
    if o.kind == "bitvec" and not (dtypes.is_int(data.dtype) and dtypes.is_int(dst.dtype)):
        raise NkiValidationError(f"{w}: bitvec reduction needs integer dtypes")
    inst = record(w, "DVE", reads=[("data", data)], writes=[("dst", dst)], alu=o.name, axis=list(axes))
    if inst.shape_only:
        return Instruction(w)
    x = read_raw(w, "data", data, flat=False)
    if o.kind == "bitvec":
        xb, _ = _bits(x, data.dtype)
        write(dst, _from_bits(_reduce(o, xb, axes), dst).reshape(dst.shape), exact=True)
        return Instruction(w)
    r = _reduce(o, x.astype(F32), axes)
    if negate:
        r = -r
    write(dst, r)
    return Instruction(w)


# ---- copies / fills --------------------------------------------------------------------------
def tensor_copy(dst, src, engine=E.unknown, name=None):
    w = "tensor_copy"
    tensor(w, "dst", dst, ON_CHIP)
    tensor(w, "src", src, ON_CHIP)
    eng = _engine_of(w, engine, "DVE", ("DVE", "ACT", "POOL"))
    _operands(w, eng, ("dst", dst), ("src", src))
    match(w, "dst", dst, "src", src)
    inst = record(w, eng, reads=[("src", src)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    a = read_raw(w, "src", src)
    if src.dtype == dst.dtype:
        write(dst, a.reshape(dst.shape), exact=True)    # bit-accurate same-dtype copy (DVE/POOL; ACT on v3+)
    else:
        write(dst, a.astype(F32))
    return Instruction(w)


def memset(dst, value, engine=E.unknown, name=None):
    w = "memset"
    tensor(w, "dst", dst, ON_CHIP)
    eng = _engine_of(w, engine, "DVE", ("DVE", "POOL"))
    _operands(w, eng, ("dst", dst))
    if not is_scalar(value):
        raise NkiValidationError(f"{w}: value must be a compile-time Python scalar, got {type(value).__name__}")
    int32.check_scalar(value, f"{w}: value")
    if dtypes.is_int(dst.dtype) and not isinstance(value, (int, np.integer, bool)):
        raise NkiValidationError(f"{w}: value {value!r} is a {type(value).__name__} but dst is {dst.dtype}; the value "
                                 f"type must match the dst dtype (NKI 0.3.0)")
    if dst.dtype in dtypes.PACKED and value != 0:
        raise NkiValidationError(f"{w}: x4 packed dtypes support only value=0")
    inst = record(w, eng, writes=[("dst", dst)], value=float(value))
    if inst.shape_only:
        return Instruction(w)
    if dtypes.is_int(dst.dtype):
        write(dst, np.full(dst.shape, int(value), dtype=np.int64))
    elif dst.dtype in _DIRECT_FLOAT:
        out_view(dst)[...] = F32(value)     # the fp32 value rounded to dst (same cast as write())
        mark(dst)
    else:
        write(dst, np.full(dst.shape, value, dtype=F32))
    return Instruction(w)


def reciprocal(dst, data, name=None):
    w = "reciprocal"
    for nm, t in (("dst", dst), ("data", data)):
        tensor(w, nm, t, ON_CHIP, "DVE")
        geom(w, nm, t)
    match(w, "dst", dst, "data", data)
    inst = record(w, "DVE", reads=[("data", data)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    with QUIET:
        write(dst, F32(1) / read(w, "data", data))
    return Instruction(w)


def tensor_copy_predicated(dst, src, predicate, reverse_pred=False, name=None):
    w = "tensor_copy_predicated"
    tensor(w, "dst", dst, ON_CHIP, "DVE")
    tensor(w, "predicate", predicate, ON_CHIP, "DVE")
    geom(w, "dst", dst)
    geom(w, "predicate", predicate)
    match(w, "dst", dst, "predicate", predicate)
    if predicate.dtype not in ("uint8", "uint16", "uint32"):
        raise NkiValidationError(f"{w}: predicate must be uint8/uint16/uint32, got {predicate.dtype}")
    reads = [("predicate", predicate)]
    if isinstance(src, NkiTensor):
        tensor(w, "src", src, ON_CHIP, "DVE")
        geom(w, "src", src)
        match(w, "dst", dst, "src", src)
        not_both_psum(w, "src", src, "predicate", predicate)
        if src.dtype != dst.dtype:
            raise NkiValidationError(f"{w}: src dtype {src.dtype} must equal dst dtype {dst.dtype}")
        reads.append(("src", src))
    elif not is_scalar(src):
        raise TypeError(f"{w}: src must be a tile or a scalar")
    inst = record(w, "DVE", reads=reads, writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    p = read_raw(w, "predicate", predicate) != 0
    if reverse_pred:
        p = ~p
    if isinstance(src, NkiTensor):
        vals = read_raw(w, "src", src)
    else:
        vals = dtypes.cast(np.full(p.shape, src, dtype=F32), dst.dtype)
    write_where(dst, p, np.asarray(vals).reshape(p.shape))
    return Instruction(w)


# ---- selection with reduction ----------------------------------------------------------------
def select_reduce(dst, predicate, on_true, on_false, reduce_res=None, reduce_cmd=RC.idle, reduce_op=ops.OPS["maximum"],
                  reverse_pred=False, name=None):
    w = "select_reduce"
    check_enum(w, "reduce_cmd", reduce_cmd, RC)
    for nm, t in (("dst", dst), ("predicate", predicate), ("on_true", on_true)):
        tensor(w, nm, t, ON_CHIP, "DVE")
    start, P, _ = geom(w, "on_true", on_true)
    geom(w, "dst", dst)
    geom(w, "predicate", predicate)
    match(w, "dst", dst, "on_true", on_true)
    match(w, "dst", dst, "predicate", predicate)
    not_both_psum(w, "predicate", predicate, "on_true", on_true)
    if predicate.dtype not in ("int8", "uint8", "int16", "uint16"):
        raise NkiValidationError(f"{w}: predicate must be int8/uint8/int16/uint16, got {predicate.dtype}")
    if on_true.dtype in ("tfloat32", "int32", "uint32"):
        raise NkiValidationError(f"{w}: on_true may not be {on_true.dtype}")
    if ops.get(reduce_op, w, "reduce_op", reduction=True) is not ops.OPS["maximum"]:
        raise NkiValidationError(f"{w}: reduce_op must be nl.maximum, got {reduce_op!r}")
    fk, fv = scalar_or_column(w, "on_false", on_false, P, eng="DVE")
    reads = [("predicate", predicate), ("on_true", on_true)] + ([("on_false", fv)] if fk == "tile" else [])
    writes = [("dst", dst)]
    if reduce_res is not None:
        tensor(w, "reduce_res", reduce_res, ON_CHIP, "DVE")
        if reduce_res.shape[0] != P or reduce_res.size != P:
            raise NkiValidationError(f"{w}: reduce_res has shape {list(reduce_res.shape)}, expected ({P}, 1)")
        writes.append(("reduce_res", reduce_res))
    inst = record(w, "DVE", reads=reads, writes=writes, reduce=reduce_cmd.name)
    if inst.shape_only:
        return Instruction(w)
    p = read_raw(w, "predicate", predicate) != 0
    if reverse_pred:
        p = ~p
    out = np.where(p, read(w, "on_true", on_true), column_values(w, "on_false", fk, fv)).astype(F32)
    lanes = slice(start, start + P)
    accumulate(inst.dve_regs, lanes, reduce_cmd, out.max(axis=1), np.maximum, -np.inf, w)
    write(dst, out)
    if reduce_res is not None:
        write(reduce_res, inst.dve_regs[lanes].reshape(P, 1))
    return Instruction(w)


# ---- top-8 helpers (ref §5.6) ----------------------------------------------------------------
def _top8_src(w, src):
    tensor(w, "src", src, ON_CHIP, "DVE")
    _, P, F = geom(w, "src", src)
    if src.ndim > 3:
        raise NkiValidationError(f"{w}: src may have at most 3 dims, got {list(src.shape)}")
    if not hw.MAX8_MIN_ELEMS <= F <= hw.MAX8_MAX_ELEMS:
        raise NkiValidationError(f"{w}: src has {F} elements per partition, expected {hw.MAX8_MIN_ELEMS}.."
                                 f"{hw.MAX8_MAX_ELEMS}")
    return P, F


def _out8(w, nm, t, P, max_ndim=None):
    """An operand of 8 elements per partition; ``max_ndim``: its documented rank limit (SDK-ISA max8 "the output
    tile is always 2-dimensional", ":param dst: a 2D tile ... [par_dim, 8]"; nc_find_index8 dst "a 2D tile", "the
    vals tensor must be up to 3-dimensional")."""
    tensor(w, nm, t, ON_CHIP, "DVE")
    geom(w, nm, t)
    if t.shape[0] != P or t.size != P * 8:
        raise NkiValidationError(f"{w}: {nm} has shape {list(t.shape)}, expected ({P}, 8)")
    if max_ndim is not None and t.ndim > max_ndim:
        raise NkiValidationError(f"{w}: {nm} has shape {list(t.shape)}; it may have at most {max_ndim} dims (SDK-ISA "
                                 f"{w})")


def max8(dst, src, name=None):
    w = "max8"
    P, F = _top8_src(w, src)
    _out8(w, "dst", dst, P, 2)
    inst = record(w, "DVE", reads=[("src", src)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "src", src)
    write(dst, -np.sort(-x, axis=1, kind="stable")[:, :8])      # descending
    return Instruction(w)


def _find(x, vals, replace=None):
    """For each of the 8 vals per partition: index of its k-th occurrence (k = number of equal vals
    earlier in the list); not found -> -1."""
    P, F = x.shape
    out = np.full((P, 8), -1, np.int64)
    for i in range(8):
        v = vals[:, i:i + 1]
        k = (vals[:, :i] == v).sum(axis=1)                # duplicates map to successive occurrences
        eq = x == v
        c = np.cumsum(eq, axis=1)
        hit = eq & (c == (k + 1)[:, None])
        has = hit.any(axis=1)
        out[has, i] = np.argmax(hit[has], axis=1)
    return out


def nc_find_index8(dst, data, vals, name=None):
    """Indices of the 8 vals per partition. Duplicate vals map to successive occurrences (the 2nd copy of a value
    to its 2nd occurrence, ...), misses to all-ones. SDK-ISA says "the index of the first occurrence of each value",
    which is exact for distinct vals (and calls values not in data undefined); the NKI 0.4.0-0.6.0 release notes'
    simulator fixes list "nc_find_index8 all-ones for misses and successive duplicates" (ref §5.6, §9.2), i.e. the
    simulator was corrected to what the hardware does -- each data element matches at most one value slot, so the
    ties max8 returns get distinct indices (the max8 -> nc_find_index8 top-k idiom of the SDK/NKL routers relies on
    that). nkisim follows the release note."""
    w = "nc_find_index8"
    P, F = _top8_src(w, data)
    _out8(w, "vals", vals, P, 3)
    _out8(w, "dst", dst, P, 2)
    if dst.dtype not in ("uint32", "uint16"):
        raise NkiValidationError(f"{w}: dst must be uint32 or uint16, got {dst.dtype}")
    inst = record(w, "DVE", reads=[("data", data), ("vals", vals)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    idx = _find(read(w, "data", data), read(w, "vals", vals))
    allones = 0xFFFFFFFF if dst.dtype == "uint32" else 0xFFFF
    write(dst, np.where(idx < 0, allones, idx).astype(dtypes.storage(dst.dtype)), exact=True)
    return Instruction(w)


def nc_match_replace8(dst, data, vals, imm, dst_idx=None, name=None):
    w = "nc_match_replace8"
    P, F = _top8_src(w, data)
    _out8(w, "vals", vals, P)
    tensor(w, "dst", dst, ON_CHIP, "DVE")
    geom(w, "dst", dst)
    match(w, "dst", dst, "data", data)
    writes = [("dst", dst)]
    if dst_idx is not None:
        _out8(w, "dst_idx", dst_idx, P)
        writes.append(("dst_idx", dst_idx))
    inst = record(w, "DVE", reads=[("data", data), ("vals", vals)], writes=writes)
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "data", data).copy()
    v = read(w, "vals", vals)
    idx = np.full((P, 8), -1, np.int64)
    rows = np.arange(P)
    for i in range(7, -1, -1):          # duplicates processed in reverse order (ref §5.6)
        eq = x == v[:, i:i + 1]
        has = eq.any(axis=1)
        j = np.argmax(eq, axis=1)
        idx[has, i] = j[has]
        x[rows[has], j[has]] = F32(imm)
    write(dst, x)
    if dst_idx is not None:
        allones = 0xFFFFFFFF if dst_idx.dtype == "uint32" else np.iinfo(dtypes.storage(dst_idx.dtype)).max
        write(dst_idx, np.where(idx < 0, allones, idx))
    return Instruction(w)


# ---- nc_stream_shuffle (ref §5.7, SDK-ISA) ----------------------------------------------------
def nc_stream_shuffle(dst, src, shuffle_mask, name=None):
    """Cross-partition move inside each 32-partition quadrant: ``dst[q*32 + i] = src[q*32 + mask[i]]``;
    ``mask[i] == 255`` leaves dst partition i unchanged; the same 32-element mask serves every quadrant."""
    w = "nc_stream_shuffle"
    for nm, t in (("dst", dst), ("src", src)):
        tensor(w, nm, t, ON_CHIP, "DVE")
    if src.dtype != dst.dtype:
        raise NkiValidationError(f"{w}: dst dtype {dst.dtype} must equal src dtype {src.dtype}")
    s0, sp, sf = geom(w, "src", src, start_rule=False)
    d0, dp, df = geom(w, "dst", dst, start_rule=False)
    if sf != df:
        raise NkiValidationError(f"{w}: src has {sf} elements per partition but dst has {df}; they must match")
    active = -(-max(sp, dp) // 32) * 32
    legal = {128: (0,), 96: (0,), 64: (0, 64), 32: (0, 32, 64, 96)}[active]
    for nm, st in (("src", s0), ("dst", d0)):
        if st not in legal:
            raise NkiValidationError(f"{w}: {nm} starts at partition {st}; with {active} active partitions the start "
                                     f"partition must be one of {legal} (SDK-ISA nc_stream_shuffle)")
    try:
        mask_l = [int(m) for m in shuffle_mask]
    except (TypeError, ValueError):
        raise TypeError(f"{w}: shuffle_mask must be a list of 32 ints, got {shuffle_mask!r}") from None
    if len(mask_l) != 32 or any(not (0 <= m < 32 or m == 255) for m in mask_l):
        raise NkiValidationError(f"{w}: shuffle_mask must have 32 entries in 0..31 or 255 (keep), got {mask_l}")
    pairs = []            # (dst partition, src partition) relative to each tensor's first partition
    for q in range(active // 32):
        for i, m in enumerate(mask_l):
            di = q * 32 + i
            if m == 255 or di >= dp:
                continue
            si = q * 32 + m
            if si >= sp:
                raise NkiValidationError(f"{w}: shuffle_mask[{i}]={m} selects src partition {si} but src has only "
                                         f"{sp} partitions")
            pairs.append((di, si))
    inst = record(w, "DVE", reads=[("src", src)], writes=[("dst", dst)], mask=mask_l)
    if inst.shape_only or not pairs:
        return Instruction(w)
    x = [read_raw(w, "src", src[si:si + 1]).copy() for _, si in pairs]     # read all first (in-place allowed)
    for (d, _), vals in zip(pairs, x):
        row = dst[d:d + 1]
        write(row, vals.reshape(row.shape), exact=True)
    return Instruction(w)
