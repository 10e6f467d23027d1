"""ScalarE instructions: activation, activation_reduce (ref §5.3, §6.2, SDK-ISA activation)."""
import warnings

import numpy as np

from ..runtime import QUIET

from .. import hw, ops
from ..errors import NkiValidationError
from ..memory import ON_CHIP
from ..numerics import act_output, act_perturbed
from ..tensor import NkiTensor
from .common import (Instruction, accumulate, check_enum, column_values, geom, is_scalar, mark, match, out_view,
                     read, record, scalar_or_column, tensor, write)
from .enums import reduce_cmd as RC

ACT_TABLE = sorted(n for n, o in ops.OPS.items() if o.act is not None and not o.v4)


def activation(dst, op, data, bias=None, scale=1.0, reduce_op=None, reduce_res=None, reduce_cmd=RC.idle, name=None):
    opn = "activation"
    o = ops.get(op, opn)
    if o.act is None or o.v4:
        raise NkiValidationError(f"{opn}: op {o!r} is not an activation function on trn2; expected one of "
                                 f"{', '.join('nl.' + n for n in ACT_TABLE)}")
    tensor(opn, "data", data, ON_CHIP, "ACT")
    tensor(opn, "dst", dst, ON_CHIP, "ACT")
    check_enum(opn, "reduce_cmd", reduce_cmd, RC)
    start, P, F = geom(opn, "data", data)
    geom(opn, "dst", dst)
    match(opn, "dst", dst, "data", data)
    reads = [("data", data)]
    bkind = None
    if bias is not None:
        if isinstance(bias, NkiTensor) and bias.dtype == "tfloat32":
            raise NkiValidationError(f"{opn}: bias may not be tfloat32")
        bkind, bias = scalar_or_column(opn, "bias", bias, P, need_f32=False, eng="ACT")
        if bkind == "tile":
            reads.append(("bias", bias))
    skind, scale = scalar_or_column(opn, "scale", scale, P, need_f32=True, eng="ACT")
    if skind == "tile":
        reads.append(("scale", scale))
    if reduce_op is not None and ops.get(reduce_op, opn, "reduce_op", reduction=True) is not ops.OPS["add"]:
        raise NkiValidationError(f"{opn}: reduce_op must be nl.add on ScalarE (trn2), got {reduce_op!r}")
    if reduce_op is not None and o.name == "square":
        # MK common-pitfalls.md: activation_reduce(op=nl.square, reduce_op=nl.add) -> NCC_IXCG864 ISA check failed
        raise NkiValidationError(f"{opn}: op=nl.square with reduce_op is rejected by the compiler (NCC_IXCG864); "
                                 f"square with activation, then nisa.tensor_reduce(op=nl.add)")
    if reduce_cmd != RC.idle and reduce_op is None:
        raise NkiValidationError(f"{opn}: reduce_cmd={reduce_cmd.name} needs reduce_op=nl.add")
    writes = [("dst", dst)]
    if reduce_res is not None:
        tensor(opn, "reduce_res", reduce_res, ON_CHIP, "ACT")
        if reduce_res.shape[0] != P or reduce_res.size != P:
            raise NkiValidationError(f"{opn}: reduce_res has shape {list(reduce_res.shape)}, expected ({P}, 1)")
        geom(opn, "reduce_res", reduce_res)
        if reduce_op is None:
            raise NkiValidationError(f"{opn}: reduce_res needs reduce_op=nl.add")
        if reduce_cmd == RC.idle:
            warnings.warn(f"{opn}: reduce_res with reduce_cmd=idle reads the ACT accumulator registers without "
                          f"updating them (stale values); use reduce_cmd=reduce_cmd.reset_reduce", stacklevel=2)
        writes.append(("reduce_res", reduce_res))
    inst = record(opn, "ACT", reads=reads, writes=writes, func=o.name,
                  reduce=None if reduce_op is None else reduce_cmd.name)
    if inst.shape_only:
        return Instruction(opn)
    x = read(opn, "data", data)
    if skind != "scalar" or scale != 1.0:
        x = x * column_values(opn, "scale", skind, scale)        # (x * 1.0 == x exactly: skipped)
    if bkind is not None:
        x = x + column_values(opn, "bias", bkind, bias)
    approx = act_perturbed(o.name)         # hardware-like numerics (nkisim/numerics.py); False by default
    if (not approx and type(o.act) is np.ufunc and reduce_op is None and dst.dtype == "float32"
            and len(dst.shape) == 2 and dst.shape == x.shape):
        o.act(x, out=out_view(dst))            # fp32 result straight into dst (identical values)
        mark(dst)
        return Instruction(opn)
    with QUIET:
        out = np.asarray(o.act(x), dtype=np.float32)
    if approx:
        out = act_output(o.name, x, out)
    lanes = slice(start, start + P)
    if reduce_op is not None:
        accumulate(inst.act_regs, lanes, reduce_cmd, out.sum(axis=1, dtype=np.float32), np.add, 0.0, opn)
    write(dst, out)
    if reduce_res is not None:
        write(reduce_res, inst.act_regs[lanes].reshape(P, 1))
    return Instruction(opn)


def activation_reduce(dst, op, data, reduce_op, reduce_res, bias=None, scale=1.0, name=None):
    return activation(dst, op, data, bias=bias, scale=scale, reduce_op=reduce_op, reduce_res=reduce_res,
                      reduce_cmd=RC.reset_reduce, name=name)
