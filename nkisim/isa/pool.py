"""GpSimd instructions: iota, affine_select, tensor_partition_reduce (ref §5.5, §5.7)."""
import numpy as np

from .. import dtypes, ops
from ..errors import NkiValidationError
from ..memory import SBUF
from .common import Instruction, geom, read, read_raw, record, reg_value, tensor, write

F32 = np.float32


def _pattern_values(w, pattern, P, F, offset, cm):
    try:
        pat = [[int(s), int(n)] for s, n in pattern]
    except (TypeError, ValueError):
        raise TypeError(f"{w}: pattern must be a list of [step, num] pairs, got {pattern!r}") from None
    if not 1 <= len(pat) <= 4:
        raise NkiValidationError(f"{w}: pattern has {len(pat)} dims, expected 1..4")
    n = int(np.prod([p[1] for p in pat]))
    if n != F:
        raise NkiValidationError(f"{w}: pattern {pat} produces {n} elements per partition but dst has {F}")
    v = np.zeros([p[1] for p in pat], np.int64) + offset
    for d, (s, cnt) in enumerate(pat):
        shp = [1] * len(pat)
        shp[d] = cnt
        v = v + (np.arange(cnt, dtype=np.int64) * s).reshape(shp)
    v = v.reshape(1, -1) + (np.arange(P, dtype=np.int64) * cm).reshape(P, 1)
    return v


def iota(dst, pattern, offset=0, channel_multiplier=0, name=None):
    w = "iota"
    tensor(w, "dst", dst, (SBUF,), "POOL")
    _, P, F = geom(w, "dst", dst)
    off = reg_value(offset, w, "offset")
    cm = reg_value(channel_multiplier, w, "channel_multiplier")
    vals = _pattern_values(w, pattern, P, F, off, cm)
    inst = record(w, "POOL", writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    vals = ((vals + 2 ** 31) % 2 ** 32) - 2 ** 31          # int32 arithmetic
    write(dst, vals if dtypes.is_int(dst.dtype) else vals.astype(F32))
    return Instruction(w)


def affine_select(dst, pattern, channel_multiplier, on_true_tile, on_false_value, cmp_op=ops.OPS["equal"],
                  offset=0, name=None):
    w = "affine_select"
    tensor(w, "dst", dst, (SBUF,), "POOL")
    tensor(w, "on_true_tile", on_true_tile, (SBUF,), "POOL")
    _, P, F = geom(w, "dst", dst)
    geom(w, "on_true_tile", on_true_tile)
    if on_true_tile.shape[0] != P or on_true_tile.size != dst.size:
        raise NkiValidationError(f"{w}: on_true_tile {list(on_true_tile.shape)} must match dst {list(dst.shape)} in "
                                 f"partitions and elements per partition")
    c = ops.get(cmp_op, w, "cmp_op")
    if c.kind != "cmp":
        raise NkiValidationError(f"{w}: cmp_op must be a comparison operator (nl.equal, nl.greater_equal, ...), got {c!r}")
    if not isinstance(on_false_value, (int, float, np.number)):
        raise TypeError(f"{w}: on_false_value must be a scalar, got {type(on_false_value).__name__}")
    off = reg_value(offset, w, "offset")
    vals = _pattern_values(w, pattern, P, F, off, int(channel_multiplier))
    inst = record(w, "POOL", reads=[("on_true_tile", on_true_tile)], writes=[("dst", dst)], cmp=c.name)
    if inst.shape_only:
        return Instruction(w)
    keep = c.fn(vals.astype(np.float64), 0.0) != 0
    if on_true_tile.dtype == dst.dtype:
        t = read_raw(w, "on_true_tile", on_true_tile)
        f = dtypes.cast(np.float32(on_false_value), dst.dtype)
        write(dst, np.where(keep, t, f), exact=True)
    else:
        t = read(w, "on_true_tile", on_true_tile)
        write(dst, np.where(keep, t, F32(on_false_value)))
    return Instruction(w)


def tensor_partition_reduce(dst, op, data, name=None):
    """Reduce across partitions; result is a single partition row ``(1, F)`` (shape rule from
    aws-neuron/nki-synthesizer semantics; placement otherwise undocumented, ref §11)."""
    w = "tensor_partition_reduce"
    o = ops.get(op, w)
    if o.name not in ("add", "maximum", "bitwise_or", "bitwise_and", "average"):
        raise NkiValidationError(f"{w}: op must be nl.add, nl.maximum, nl.average, nl.bitwise_or or nl.bitwise_and, "
                                 f"got {o!r}")
    tensor(w, "data", data, (SBUF,), "POOL")
    tensor(w, "dst", dst, (SBUF,), "POOL")
    _, P, F = geom(w, "data", data)
    geom(w, "dst", dst)
    if dst.shape[0] != 1 or dst.size != F:
        raise NkiValidationError(f"{w}: dst {list(dst.shape)} must be one partition with {F} elements "
                                 f"(data {list(data.shape)} reduced over partitions)")
    inst = record(w, "POOL", reads=[("data", data)], writes=[("dst", dst)], alu=o.name)
    if inst.shape_only:
        return Instruction(w)
    if o.kind == "bitvec":
        x = read_raw(w, "data", data).astype(np.int64)
        r = (np.bitwise_or if o.name == "bitwise_or" else np.bitwise_and).reduce(x, axis=0)
        write(dst, r.reshape(1, F))
        return Instruction(w)
    x = read(w, "data", data)
    r = {"add": lambda a: a.sum(0, dtype=F32), "maximum": lambda a: a.max(0),
         "average": lambda a: a.mean(0, dtype=F32)}[o.name](x)
    write(dst, r.reshape(1, F))
    return Instruction(w)
