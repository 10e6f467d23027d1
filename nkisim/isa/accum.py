"""VectorE scans, cumulative ops, reductions through the DVE accumulator registers and batch-norm
statistics (SDK-ISA 0.6: tensor_tensor_scan, tensor_scalar_cumulative, tensor_scalar_reduce,
range_select, bn_stats, bn_aggr; ref §5.4, §5.5, §5.0).

All math is fp32 with one rounding per ALU operation (numpy float32), results rounded to the dst
dtype on write (ref §8). The DVE accumulator registers (one fp32 per lane, ``Instance.dve_regs``) are
shared by range_select, select_reduce, tensor_scalar_reduce and tensor_scalar_cumulative, exactly as
SDK-ISA notes on each of them.
"""
import numpy as np

from ..runtime import QUIET

from .. import dtypes, hw, ops
from ..errors import NkiValidationError
from ..memory import ON_CHIP
from ..tensor import NkiTensor
from .common import (Instruction, accumulate, check_enum, column_values, geom, is_scalar, match, not_both_psum,
                     read, record, scalar_or_column, tensor, write)
from .dve import _alu
from .enums import reduce_cmd as RC

F32 = np.float32
FP32_MIN = float(np.finfo(np.float32).min)          # -3.4028235e38 (SDK-ISA range_select)
_IDENT = {"add": 0.0, "subtract": 0.0, "multiply": 1.0, "maximum": -np.inf, "minimum": np.inf}


def _dve(w, *named):
    for nm, t in named:
        tensor(w, nm, t, ON_CHIP, "DVE")
        geom(w, nm, t)


def _apply2(o, a, b):
    with QUIET:
        return np.asarray(o.fn(a, b), dtype=F32)


def _operand(w, name, x, P, eng="DVE"):
    """fp32 compile-time scalar or (P, 1) fp32 tile -> (kind, obj, reads)."""
    k, v = scalar_or_column(w, name, x, P, need_f32=True, eng=eng)
    return k, v, ([(name, v)] if k == "tile" else [])


# ---- tensor_tensor_scan ----------------------------------------------------------------------
def tensor_tensor_scan(dst, data0, data1, initial, op0, op1, reverse0=False, reverse1=False, name=None):
    """Per partition, over the flattened free elements: ``r[i] = op1(op0(data0[i], r[i-1]), data1[i])`` with
    ``r[-1] = initial`` (SDK-ISA; ``reverse0``: data0 is the rhs of op0, ``reverse1``: data1 is the lhs of op1)."""
    w = "tensor_tensor_scan"
    o0 = _alu(w, op0, "op0", allow=("arith",))
    o1 = _alu(w, op1, "op1", allow=("arith",))
    _dve(w, ("dst", dst), ("data0", data0), ("data1", data1))
    match(w, "dst", dst, "data0", data0)
    match(w, "dst", dst, "data1", data1)
    not_both_psum(w, "data0", data0, "data1", data1)
    P = data0.shape[0]
    k, v, extra = _operand(w, "initial", initial, P)
    inst = record(w, "DVE", reads=[("data0", data0), ("data1", data1)] + extra, writes=[("dst", dst)],
                  alu=[o0.name, o1.name])
    if inst.shape_only:
        return Instruction(w)
    a, b = read(w, "data0", data0), read(w, "data1", data1)
    r = np.broadcast_to(column_values(w, "initial", k, v), (P, 1)).reshape(P).astype(F32)
    out = np.empty_like(a)
    for i in range(a.shape[1]):          # sequential by definition; fp32 rounding after each op
        t = _apply2(o0, r, a[:, i]) if reverse0 else _apply2(o0, a[:, i], r)
        r = _apply2(o1, b[:, i], t) if reverse1 else _apply2(o1, t, b[:, i])
        out[:, i] = r
    write(dst, out)
    return Instruction(w)


# ---- tensor_scalar_cumulative ----------------------------------------------------------------
_CUM_OPS = ("add", "subtract", "multiply", "maximum", "minimum")


def tensor_scalar_cumulative(dst, src, op0, op1, imm0, imm1=None, reduce_cmd=RC.reset_reduce, name=None):
    """Per partition, sequentially: ``reg = op1(op0(x[i], imm0), reg); dst[i] = reg`` (SDK-ISA pseudo code).
    ``reset_reduce`` starts from op1's identity, ``load_reduce`` from ``imm1``, ``reduce`` from the current
    DVE accumulator. The final ``reg`` stays in the accumulator registers."""
    w = "tensor_scalar_cumulative"
    o0 = _alu(w, op0, "op0", allow=("arith",))
    o1 = _alu(w, op1, "op1", allow=("arith",))
    if o1.name not in _CUM_OPS:
        raise NkiValidationError(f"{w}: op1={o1!r} is not supported; the cumulative operator is one of nl.add, "
                                 f"nl.subtract, nl.multiply, nl.maximum, nl.minimum (SDK-ISA)")
    check_enum(w, "reduce_cmd", reduce_cmd, RC)
    if reduce_cmd not in (RC.reset_reduce, RC.reduce, RC.load_reduce):
        raise NkiValidationError(f"{w}: reduce_cmd={reduce_cmd.name} is not supported; expected reset_reduce, "
                                 f"reduce or load_reduce (SDK-ISA)")
    _dve(w, ("dst", dst), ("src", src))
    match(w, "dst", dst, "src", src)
    for nm, t in (("src", src), ("dst", dst)):
        if t.dtype in ("int32", "uint32", "tfloat32") or t.dtype in dtypes.PACKED:
            raise NkiValidationError(f"{w}: {nm} dtype {t.dtype} is not supported; input/output dtypes are BF16, "
                                     f"FP16, FP32, FP8, UINT8, UINT16, INT8, INT16 (INT32/UINT32 are an ISA "
                                     f"limitation, SDK-ISA)")
    start, P, F = geom(w, "src", src)
    k0, v0, reads = _operand(w, "imm0", imm0, P)
    k1 = v1 = None
    if reduce_cmd == RC.load_reduce:
        if imm1 is None:
            raise NkiValidationError(f"{w}: reduce_cmd=load_reduce needs imm1 (the initial accumulator value)")
        k1, v1, r1 = _operand(w, "imm1", imm1, P)
        reads += r1
    elif imm1 is not None:
        raise NkiValidationError(f"{w}: imm1 is only used with reduce_cmd=load_reduce, got reduce_cmd="
                                 f"{reduce_cmd.name}")
    inst = record(w, "DVE", reads=[("src", src)] + reads, writes=[("dst", dst)], alu=[o0.name, o1.name],
                  reduce=reduce_cmd.name)
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "src", src)
    lanes = slice(start, start + P)
    if reduce_cmd == RC.reset_reduce:
        reg = np.full(P, _IDENT[o1.name], F32)
    elif reduce_cmd == RC.load_reduce:
        reg = np.broadcast_to(column_values(w, "imm1", k1, v1), (P, 1)).reshape(P).astype(F32)
    else:
        reg = inst.dve_regs[lanes].copy()
    t = _apply2(o0, x, column_values(w, "imm0", k0, v0))
    out = np.empty_like(x)
    for i in range(F):
        reg = _apply2(o1, t[:, i], reg)
        out[:, i] = reg
    inst.dve_regs[lanes] = reg
    write(dst, out)
    return Instruction(w)


# ---- tensor_scalar_reduce --------------------------------------------------------------------
_RED_OPS = ("add", "multiply", "maximum", "minimum")


def _row_reduce(o, x):
    if o.name == "add":
        return np.sum(x, axis=1, dtype=F32)
    if o.name == "multiply":
        return np.prod(x, axis=1, dtype=F32)
    return (np.max if o.name == "maximum" else np.min)(x, axis=1).astype(F32)


def tensor_scalar_reduce(dst, data, op0, operand0, reduce_op, reduce_res=None, reverse0=False,
                         reduce_cmd=RC.reset_reduce, reduce_init=None, reduce_res_negate=False, name=None):
    """``dst = op0(data, operand0)`` and ``reduce_op`` of every free element of that result folded into the
    DVE accumulator registers; ``reduce_res`` (P, 1), if given, reads the registers out (negated with
    ``reduce_res_negate``). SDK-ISA tensor_scalar_reduce; ref §5.4."""
    w = "tensor_scalar_reduce"
    o0 = _alu(w, op0, "op0", allow=("arith", "unary"))
    ro = ops.get(reduce_op, w, "reduce_op", reduction=True)
    if ro.name not in _RED_OPS:
        raise NkiValidationError(f"{w}: reduce_op must be nl.add, nl.multiply, nl.maximum or nl.minimum, got {ro!r}")
    if reverse0:
        raise NkiValidationError(f"{w}: reverse0=True is documented as not supported yet (SDK-ISA)")
    check_enum(w, "reduce_cmd", reduce_cmd, RC)
    if reduce_cmd not in (RC.reset_reduce, RC.reduce, RC.load_reduce):
        raise NkiValidationError(f"{w}: reduce_cmd={reduce_cmd.name} is not supported; expected reset_reduce, "
                                 f"reduce or load_reduce (SDK-ISA)")
    if (reduce_cmd == RC.load_reduce) != (reduce_init is not None):
        raise NkiValidationError(f"{w}: reduce_init must be given exactly when reduce_cmd=load_reduce (got "
                                 f"reduce_cmd={reduce_cmd.name}, reduce_init={reduce_init!r})")
    _dve(w, ("dst", dst), ("data", data))
    match(w, "dst", dst, "data", data)
    start, P, F = geom(w, "data", data)
    reads = [("data", data)]
    if o0.kind == "unary":
        if operand0 not in (None, 0, 0.0):
            raise NkiValidationError(f"{w}: unary operator {o0!r} takes operand0=None or 0, got {operand0!r}")
        k0 = v0 = None
    else:
        k0, v0, r0 = _operand(w, "operand0", operand0, P)
        reads += r0
    ki = vi = None
    if reduce_init is not None:
        ki, vi, ri = _operand(w, "reduce_init", reduce_init, P)
        reads += ri
    writes = [("dst", dst)]
    if reduce_res is not None:
        _dve(w, ("reduce_res", reduce_res))
        if reduce_res.shape[0] != P or reduce_res.size != P:
            raise NkiValidationError(f"{w}: reduce_res has shape {list(reduce_res.shape)}, expected ({P}, 1)")
        writes.append(("reduce_res", reduce_res))
    inst = record(w, "DVE", reads=reads, writes=writes, alu=o0.name, reduce_op=ro.name, reduce=reduce_cmd.name)
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "data", data)
    y = np.asarray(o0.fn(x), dtype=F32) if o0.kind == "unary" else _apply2(o0, x, column_values(w, "operand0", k0, v0))
    lanes = slice(start, start + P)
    load = None if vi is None else np.broadcast_to(column_values(w, "reduce_init", ki, vi), (P, 1)).reshape(P)
    regs = inst.dve_regs
    s = _row_reduce(ro, y)
    if reduce_cmd == RC.reset_reduce:
        regs[lanes] = s
    elif reduce_cmd == RC.reduce:
        regs[lanes] = _apply2(ro, regs[lanes], s)
    else:
        regs[lanes] = _apply2(ro, load.astype(F32), s)
    write(dst, y)
    if reduce_res is not None:
        r = regs[lanes].reshape(P, 1)
        write(reduce_res, -r if reduce_res_negate else r)
    return Instruction(w)


# ---- range_select ----------------------------------------------------------------------------
_CMP = ("equal", "less", "less_equal", "greater", "greater_equal")


def range_select(dst, on_true_tile, comp_op0, comp_op1, bound0, bound1, reduce_cmd=RC.reset_reduce, reduce_res=None,
                 reduce_op=ops.OPS["maximum"], range_start=0, on_false_value=FP32_MIN, name=None):
    """``idx = range_start + free index`` (fp32); ``dst = on_true if comp_op0(idx, bound0) and comp_op1(idx, bound1)
    else on_false_value``; row max folded into the DVE accumulators (SDK-ISA range_select, v3+)."""
    w = "range_select"
    c0, c1 = ops.get(comp_op0, w, "comp_op0"), ops.get(comp_op1, w, "comp_op1")
    for nm, c in (("comp_op0", c0), ("comp_op1", c1)):
        if c.name not in _CMP:
            raise NkiValidationError(f"{w}: {nm} must be one of nl.equal, nl.less, nl.less_equal, nl.greater, "
                                     f"nl.greater_equal, got {c!r}")
    if ops.get(reduce_op, w, "reduce_op", reduction=True).name != "maximum":
        raise NkiValidationError(f"{w}: reduce_op must be nl.maximum (the only supported reduction), got {reduce_op!r}")
    check_enum(w, "reduce_cmd", reduce_cmd, RC)
    if not isinstance(range_start, (int, np.integer)) or isinstance(range_start, bool):
        raise NkiValidationError(f"{w}: range_start must be a compile-time integer, got {range_start!r}")
    if not is_scalar(on_false_value) or F32(on_false_value) != F32(FP32_MIN):
        raise NkiValidationError(f"{w}: on_false_value must be FP32_MIN ({FP32_MIN!r}) due to hardware constraints "
                                 f"(SDK-ISA), got {on_false_value!r}")
    _dve(w, ("dst", dst), ("on_true_tile", on_true_tile))
    match(w, "dst", dst, "on_true_tile", on_true_tile)
    if not dtypes.is_float(on_true_tile.dtype):
        raise NkiValidationError(f"{w}: on_true_tile must have a float dtype, got {on_true_tile.dtype}")
    start, P, F = geom(w, "on_true_tile", on_true_tile)
    if int(range_start) + F > 2 ** 24:
        raise NkiValidationError(f"{w}: range_start + free index reaches {int(range_start) + F}; the fp32 index "
                                 f"comparison is exact only below 2^24 (SDK-ISA)")
    reads = [("on_true_tile", on_true_tile)]
    for nm, b in (("bound0", bound0), ("bound1", bound1)):
        if not isinstance(b, NkiTensor):
            raise NkiValidationError(f"{w}: {nm} must be a ({P}, 1) float32 tile, got {type(b).__name__}")
        scalar_or_column(w, nm, b, P, need_f32=True, eng="DVE")
        reads.append((nm, b))
    writes = [("dst", dst)]
    if reduce_res is not None:
        _dve(w, ("reduce_res", reduce_res))
        if reduce_res.shape[0] != P or reduce_res.size != P:
            raise NkiValidationError(f"{w}: reduce_res has shape {list(reduce_res.shape)}, expected ({P}, 1)")
        writes.append(("reduce_res", reduce_res))
    inst = record(w, "DVE", reads=reads, writes=writes, cmp=[c0.name, c1.name], reduce=reduce_cmd.name,
                  range_start=int(range_start))
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "on_true_tile", on_true_tile)
    idx = (np.arange(F, dtype=np.float64) + int(range_start)).astype(F32).reshape(1, F)
    m = (c0.fn(idx, column_values(w, "bound0", "tile", bound0)) != 0) & \
        (c1.fn(idx, column_values(w, "bound1", "tile", bound1)) != 0)
    out = np.where(m, x, F32(FP32_MIN)).astype(F32)
    lanes = slice(start, start + P)
    accumulate(inst.dve_regs, lanes, reduce_cmd, out.max(axis=1), np.maximum, -np.inf, w)
    write(dst, out)
    if reduce_res is not None:
        write(reduce_res, inst.dve_regs[lanes].reshape(P, 1))
    return Instruction(w)


# ---- bn_stats / bn_aggr ----------------------------------------------------------------------
def _stats(v):
    """(count, mean, variance*count) of the columns of v (P, n) in fp32."""
    n = v.shape[1]
    if n == 0:
        z = np.zeros(v.shape[0], F32)
        return z, z, z
    mean = np.mean(v, axis=1, dtype=F32)
    m2 = np.sum(np.square(v - mean[:, None], dtype=F32), axis=1, dtype=F32)
    return np.full(v.shape[0], n, F32), mean.astype(F32), m2


def bn_stats(dst, data, name=None):
    """Per partition: (count, mean, variance*count) of the even-indexed free elements, then of the odd-indexed
    ones -- 6 values (SDK-ISA bn_stats; at most 512 elements per partition, nl.tile_size.bn_stats_fmax)."""
    w = "bn_stats"
    _dve(w, ("dst", dst), ("data", data))
    _, P, F = geom(w, "data", data)
    if F > hw.BN_STATS_FMAX:
        raise NkiValidationError(f"{w}: data has {F} elements per partition, at most {hw.BN_STATS_FMAX} "
                                 f"(nl.tile_size.bn_stats_fmax); split the row and combine with one bn_aggr")
    if dst.shape[0] != P or dst.size != 6 * P:
        raise NkiValidationError(f"{w}: dst has shape {list(dst.shape)}, expected {P} partitions x 6 elements "
                                 f"(count, mean, var*count for even and odd elements)")
    inst = record(w, "DVE", reads=[("data", data)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    x = read(w, "data", data)
    out = np.stack(_stats(x[:, 0::2]) + _stats(x[:, 1::2]), axis=1)
    write(dst, out)
    return Instruction(w)


def bn_aggr(dst, data, name=None):
    """Combine (count, mean, variance*count) triples (one or more bn_stats outputs) into (mean, variance)
    per partition (SDK-ISA bn_aggr; population variance, Chan et al. parallel combination in fp32)."""
    w = "bn_aggr"
    _dve(w, ("dst", dst), ("data", data))
    _, P, F = geom(w, "data", data)
    if F % 3:
        raise NkiValidationError(f"{w}: data has {F} elements per partition, expected a multiple of 3 "
                                 f"((count, mean, variance*count) triples from bn_stats)")
    if dst.shape[0] != P or dst.size != 2 * P:
        raise NkiValidationError(f"{w}: dst has shape {list(dst.shape)}, expected {P} partitions x 2 elements "
                                 f"(mean, variance)")
    inst = record(w, "DVE", reads=[("data", data)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    t = read(w, "data", data).reshape(P, F // 3, 3)
    cnt, mean, m2 = t[..., 0], t[..., 1], t[..., 2]
    n = np.sum(cnt, axis=1, dtype=F32)
    with QUIET:
        mu = np.where(n > 0, np.sum(cnt * mean, axis=1, dtype=F32) / n, F32(0)).astype(F32)
        tot = np.sum(m2 + cnt * np.square(mean - mu[:, None]), axis=1, dtype=F32)
        var = np.where(n > 0, tot / n, F32(0)).astype(F32)
    write(dst, np.stack([mu, var], axis=1))
    return Instruction(w)
