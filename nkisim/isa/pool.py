"""GpSimd instructions: iota, affine_select, tensor_partition_reduce, local_gather, nc_n_gather, topk,
nonzero_with_count, sequence_bounds (ref §5.5-§5.7, SDK-ISA)."""
import math

import numpy as np

from .. import dtypes, int32, ops
from ..errors import NkiValidationError, OutOfBoundsError
from ..memory import SBUF
from ..tensor import mask, raw
from .common import Instruction, geom, read, read_raw, record, reg_value, tensor, write

F32 = np.float32


_PATTERNS = {}        # (pattern, P, F, offset, channel multiplier) -> read-only int64 [P, F] values


def _pattern_values(w, pattern, P, F, offset, cm):
    try:
        pat = [[int(s), int(n)] for s, n in pattern]
    except (TypeError, ValueError):
        raise TypeError(f"{w}: pattern must be a list of [step, num] pairs, got {pattern!r}") from None
    key = (tuple(map(tuple, pat)), P, F, offset, cm)
    v = _PATTERNS.get(key)
    if v is None:
        # SDK-ISA iota / affine_select: "an int32 offset value", "an int32 multiplier" (nkisim/int32.py)
        int32.check_ints([offset, cm], f"{w}: [offset, channel_multiplier]")
        int32.check_ints([x for p in pat for x in p], f"{w}: pattern (flattened [step, num] pairs)")
        v = _PATTERNS[key] = _pattern_compute(w, pat, P, F, offset, cm)
        v.setflags(write=False)
        if len(_PATTERNS) > 1024:
            _PATTERNS.clear()
    return v


def _pattern_compute(w, pat, P, F, offset, cm):
    if not 1 <= len(pat) <= 4:
        raise NkiValidationError(f"{w}: pattern has {len(pat)} dims, expected 1..4")
    n = math.prod([p[1] for p in pat])
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
    inst = record(w, "POOL", writes=[("dst", dst)], reg_reads=(offset, channel_multiplier))
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
    if not isinstance(on_false_value, (float, np.floating)):
        # SDK-ISA affine_select: "The on_false_value must be float32, regardless of the input/output tile data types"
        raise NkiValidationError(f"{w}: on_false_value must be a float32 value (SDK-ISA: 'must be float32, regardless "
                                 f"of the input/output tile data types'), got the {type(on_false_value).__name__} "
                                 f"{on_false_value!r}: write {float(on_false_value)!r}")
    off = reg_value(offset, w, "offset")
    vals = _pattern_values(w, pattern, P, F, off, int(channel_multiplier))
    inst = record(w, "POOL", reads=[("on_true_tile", on_true_tile)], writes=[("dst", dst)], cmp=c.name,
                  reg_reads=(offset,))
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
    o = ops.get(op, w, reduction=True)
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


# ---- gathers (ref §5.7, SDK-ISA) -------------------------------------------------------------
GPSIMD_CORES, PARTS_PER_CORE = 8, 16            # 8 GpSimd cores x 16 SBUF partitions (SDK-ISA local_gather)
LOCAL_GATHER_ELEMS = (1, 2, 4, 8, 16, 32)
LOCAL_GATHER_MAX_INDICES = 4096


def local_gather(dst, src_buffer, index, num_elem_per_idx=1, num_valid_indices=None, name=None):
    """Each GpSimd core (16 partitions) flattens its slice of ``index`` partition-first and gathers, for every
    partition of the slice, ``num_elem_per_idx`` contiguous free elements starting at each index (element
    units): ``dst[p, j, :] = flat(src_buffer[p])[idx[j] : idx[j] + e]`` (SDK-ISA docstring and the numpy
    semantics of aws-neuron-sdk nki/test/test_nki_isa_local_gather.py). No dtype cast."""
    w = "local_gather"
    for nm, t in (("dst", dst), ("src_buffer", src_buffer), ("index", index)):
        tensor(w, nm, t, (SBUF,), "POOL")
        geom(w, nm, t)
    _, P, F = geom(w, "src_buffer", src_buffer)
    _, PI, FI = geom(w, "index", index)
    if P != PI or P % PARTS_PER_CORE:
        raise NkiValidationError(f"{w}: src_buffer has {P} partitions and index {PI}; they must be equal and a "
                                 f"multiple of {PARTS_PER_CORE} (one 16-partition slice per GpSimd core)")
    if index.dtype != "uint16":
        raise NkiValidationError(f"{w}: index must be uint16, got {index.dtype}")
    if dst.dtype != src_buffer.dtype:
        raise NkiValidationError(f"{w}: dst dtype {dst.dtype} must equal src_buffer dtype {src_buffer.dtype} "
                                 f"(local_gather does not cast)")
    e = num_elem_per_idx
    if not isinstance(e, (int, np.integer)) or int(e) not in LOCAL_GATHER_ELEMS:
        raise NkiValidationError(f"{w}: num_elem_per_idx must be one of {LOCAL_GATHER_ELEMS}, got {e!r}")
    e = int(e)
    per_core = PARTS_PER_CORE * FI
    nv = per_core if num_valid_indices is None else num_valid_indices
    if not isinstance(nv, (int, np.integer)) or not 1 <= int(nv) <= per_core:
        raise NkiValidationError(f"{w}: num_valid_indices={num_valid_indices!r} must be an int in 1..{per_core} "
                                 f"(the indices in one core's 16-partition slice of index)")
    nv = int(nv)
    if nv > LOCAL_GATHER_MAX_INDICES:
        raise NkiValidationError(f"{w}: {nv} indices per core, at most {LOCAL_GATHER_MAX_INDICES} (SDK-ISA)")
    if dst.shape[0] != P or dst.size // dst.shape[0] != nv * e:
        raise NkiValidationError(f"{w}: dst has shape {list(dst.shape)}, expected {P} partitions x {nv * e} elements "
                                 f"(num_valid_indices {nv} x num_elem_per_idx {e}; SDK-RN 0.6.0 known issue: size dst "
                                 f"exactly)")
    inst = record(w, "POOL", reads=[("src_buffer", src_buffer), ("index", index)], writes=[("dst", dst)],
                  num_elem_per_idx=e, num_valid_indices=nv)
    if inst.shape_only:
        return Instruction(w)
    src = read_raw(w, "src_buffer", src_buffer)
    idx = read_raw(w, "index", index).astype(np.int64)
    out = np.empty((P, nv * e), dtype=src.dtype)
    offs = np.arange(e)
    for c in range(P // PARTS_PER_CORE):
        sl = slice(c * PARTS_PER_CORE, (c + 1) * PARTS_PER_CORE)
        ids = idx[sl].flatten(order="F")[:nv]            # partition-first flattening
        cols = (ids[:, None] + offs[None, :]).reshape(-1)
        if cols.size and (cols.min() < 0 or cols.max() >= F):
            bad = int(ids[np.argmax((ids + e > F) | (ids < 0))])
            raise OutOfBoundsError(f"{w}: GpSimd core {c} index {bad} (+{e} elements) is outside the {F} elements per "
                                   f"partition of src_buffer {src_buffer.describe()} (out-of-bound access is undefined "
                                   f"on hardware)")
        out[sl] = src[sl][:, cols]
    write(dst, out.reshape(dst.shape), exact=True)
    return Instruction(w)


def nc_n_gather(dst, data, indices, name=None):
    """Per partition independently: ``dst[p, k] = flat(data[p])[indices[p, k]]`` (SDK-ISA nc_n_gather)."""
    w = "nc_n_gather"
    for nm, t in (("dst", dst), ("data", data), ("indices", indices)):
        tensor(w, nm, t, (SBUF,), "POOL")
        geom(w, nm, t)
    P, F = data.shape[0], data.size // data.shape[0]
    if indices.shape[0] != P or dst.shape[0] != P:
        raise NkiValidationError(f"{w}: data, indices and dst must have the same partition count, got {P}, "
                                 f"{indices.shape[0]}, {dst.shape[0]}")
    if indices.dtype != "uint32":
        raise NkiValidationError(f"{w}: indices must be uint32, got {indices.dtype}")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"{w}: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.size != indices.size:
        raise NkiValidationError(f"{w}: dst has {dst.size // P} elements per partition but indices has "
                                 f"{indices.size // P}; they must match")
    inst = record(w, "POOL", reads=[("data", data), ("indices", indices)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    x = read_raw(w, "data", data)
    idx = read_raw(w, "indices", indices).astype(np.int64)
    if idx.size and idx.max() >= F:
        p, k = np.argwhere(idx >= F)[0]
        raise OutOfBoundsError(f"{w}: indices[{p}, {k}] = {idx[p, k]} is outside [0, {F}) (elements per partition "
                               f"of data {data.describe()})")
    write(dst, np.take_along_axis(x, idx, axis=1).reshape(dst.shape), exact=True)
    return Instruction(w)


# ---- topk (NKI 0.6.0) ------------------------------------------------------------------------
def topk(val_dst, idx_dst, src, n, name=None):
    """Per 16-partition group, the K largest of the ``n`` bf16 values of its snake (element i at partition
    ``16g + i % 16``, column ``i // 16``), K = free size of val_dst, in ascending order, written back in the
    snake layout: result j at partition ``16g + j % 16``, column ``j // 16`` (SDK-ISA 0.6 "K largest values in
    ascending order"; snake output per NKL deepseek/gpsimd_topk kernels). Slots past K stay unwritten (NKL
    gpsimd_topk.py: "positions [k, k_pad) are unwritten and carry garbage"). Ties: lower snake index first
    (hardware order is not specified)."""
    w = "topk"
    for nm, t in (("val_dst", val_dst), ("idx_dst", idx_dst), ("src", src)):
        tensor(w, nm, t, (SBUF,), "POOL")
        geom(w, nm, t)
    P, X = src.shape[0], src.size // src.shape[0]
    if P % PARTS_PER_CORE:
        raise NkiValidationError(f"{w}: src has {P} partitions; the partition dim must be a multiple of 16")
    if src.dtype != "bfloat16" or val_dst.dtype != "bfloat16":
        raise NkiValidationError(f"{w}: src and val_dst must be bfloat16, got {src.dtype} and {val_dst.dtype}")
    if idx_dst.dtype != "uint32":
        raise NkiValidationError(f"{w}: idx_dst must be uint32, got {idx_dst.dtype}")
    for nm, t in (("val_dst", val_dst), ("idx_dst", idx_dst)):
        if t.shape[0] != P:
            raise NkiValidationError(f"{w}: {nm} has {t.shape[0]} partitions, src has {P}")
    K = val_dst.size // P
    if idx_dst.size // P != K:
        raise NkiValidationError(f"{w}: idx_dst has {idx_dst.size // P} elements per partition, val_dst has {K}")
    if not isinstance(n, (int, np.integer)) or not 8 <= int(n) < 65536:
        raise NkiValidationError(f"{w}: n={n!r} must be an int with 8 <= n < 65536")
    n = int(n)
    if not 1 <= K < 32768 or K > n:
        raise NkiValidationError(f"{w}: K={K} (free size of val_dst) must satisfy 1 <= K < 32768 and K <= n={n}")
    if X < -(-n // 16):
        raise NkiValidationError(f"{w}: src free size {X} < ceil(n / 16) = {-(-n // 16)}")
    inst = record(w, "POOL", reads=[("src", src)], writes=[("val_dst", val_dst), ("idx_dst", idx_dst)], n=n, K=K)
    if inst.shape_only:
        return Instruction(w)
    x = read_raw(w, "src", src)
    ps, cs, vs, ids = [], [], [], []
    for g in range(P // 16):
        snake = x[16 * g:16 * g + 16].astype(np.float32).T.reshape(-1)[:n]      # element i = (i % 16, i // 16)
        order = np.argsort(-snake, kind="stable")[:K][::-1]                      # top-K, ascending
        j = np.arange(K)
        ps.append(16 * g + j % 16)
        cs.append(j // 16)
        vs.append(x[16 * g + order % 16, order // 16])
        ids.append(order)
    ps, cs = np.concatenate(ps), np.concatenate(cs)
    for t, v in ((val_dst, np.concatenate(vs)), (idx_dst, np.concatenate(ids).astype(np.uint32))):
        where = (ps,) + np.unravel_index(cs, t.shape[1:])
        raw(t)[where] = v
        mask(t)[where] = True
    val_dst.storage.dirty = idx_dst.storage.dirty = True
    return Instruction(w)


# ---- nonzero_with_count (v3+) ----------------------------------------------------------------
def nonzero_with_count(dst, src, index_offset=0, padding_val=-1, name=None):
    """On partitions 0, 16, ..., 112 only (GpSimd core c reads/writes its partition 0): the indices (+offset) of
    the nonzero elements, then ``padding_val``, then the count in the extra last slot (SDK-ISA)."""
    w = "nonzero_with_count"
    for nm, t in (("dst", dst), ("src", src)):
        tensor(w, nm, t, (SBUF,), "POOL")
        geom(w, nm, t)
    P, F = src.shape[0], src.size // src.shape[0]
    if dst.shape[0] != P or dst.size // P != F + 1:
        raise NkiValidationError(f"{w}: dst has shape {list(dst.shape)}, expected {P} partitions x {F + 1} elements "
                                 f"(src free size + 1 for the count)")
    if src.dtype not in ("float32", "int32") or dst.dtype != "int32":
        raise NkiValidationError(f"{w}: src must be float32 or int32 and dst int32, got {src.dtype} / {dst.dtype}")
    for nm, v in (("index_offset", index_offset), ("padding_val", padding_val)):
        if not isinstance(v, (int, np.integer)) or not -2 ** 31 <= int(v) < 2 ** 31:
            raise NkiValidationError(f"{w}: {nm} must be an int32 value, got {v!r}")
    rows = list(range(0, P, 16))
    inst = record(w, "POOL", reads=[("src", src[r:r + 1]) for r in rows], writes=[("dst", dst[r:r + 1]) for r in rows])
    if inst.shape_only:
        return Instruction(w)
    for r in rows:
        x = read_raw(w, "src", src[r:r + 1]).reshape(-1)
        nz = np.flatnonzero(x != 0).astype(np.int64) + int(index_offset)
        out = np.full(F + 1, int(padding_val), np.int64)
        out[:len(nz)] = nz
        out[F] = len(nz)
        row = dst[r:r + 1]
        write(row, out.reshape(row.shape))
    return Instruction(w)


# ---- sequence_bounds -------------------------------------------------------------------------
SEQ_BOUNDS_DTYPES = ("float32", "int32")


def sequence_bounds_reference(ids):
    """numpy model of sequence_bounds on one row of segment ids: (2, n) int64 ``[start; end]``. A segment is a
    run of equal consecutive non-zero ids; ``start`` is the index of its first element and ``end`` is one past
    its last (exclusive); padding (id 0) gets ``(n, -1)``. Source: the NumPy equivalent of the SDK docs page
    nki.isa.sequence_bounds and its test (aws-neuron-sdk general/nki/test/test_nki_isa_sequence_bounds.py,
    NKI_EXAMPLE_1: ``max_bounds[i] = i + 1`` at a run's last element, ``max_bounds[-1] = n``; example
    ``[0, 1, 1, 2, 2, 2, 0, 3, 3]`` -> starts ``[9, 1, 1, 3, 3, 3, 9, 7, 7]``, ends ``[-1, 3, 3, 6, 6, 6, -1, 9,
    9]``). An id that reappears after another id starts a new segment (the reference compares neighbours)."""
    ids = np.asarray(ids).reshape(-1)
    n = ids.size
    out = np.empty((2, n), np.int64)
    if n == 0:
        return out
    new = np.ones(n, bool)
    new[1:] = ids[1:] != ids[:-1]
    run = np.cumsum(new) - 1                       # run number of every element
    starts = np.flatnonzero(new)
    ends = np.append(starts[1:], n)
    pad = ids == 0
    out[0] = np.where(pad, n, starts[run])
    out[1] = np.where(pad, -1, ends[run])
    return out


def sequence_bounds(dst, segment_ids, name=None):
    """GpSimd: for every element of a one-partition row of segment ids, the ``[start, end)`` bounds of its
    segment (SDK-ISA nki.isa.sequence_bounds; semantics in ``sequence_bounds_reference``: end is exclusive,
    padding id 0 -> ``(n, -1)``). ``segment_ids``: SBUF, partition dim 1, float32 or int32, n elements.
    ``dst``: SBUF, partition dim 1, float32 or int32, 2n elements read as (2, n): the n starts, then the n ends
    (the documented (1, 2, n) output shape). Ids must be non-negative integers (checked when executing)."""
    w = "sequence_bounds"
    for nm, t in (("dst", dst), ("segment_ids", segment_ids)):
        tensor(w, nm, t, (SBUF,), "POOL")
        geom(w, nm, t)
        if t.shape[0] != 1:
            raise NkiValidationError(f"{w}: {nm} has {t.shape[0]} partitions; the partition dimension must be 1 "
                                     f"(SDK-ISA sequence_bounds)")
        if t.dtype not in SEQ_BOUNDS_DTYPES:
            raise NkiValidationError(f"{w}: {nm} must be float32 or int32, got {t.dtype} (SDK-ISA sequence_bounds)")
    n = segment_ids.size
    if dst.size != 2 * n:
        raise NkiValidationError(f"{w}: dst {list(dst.shape)} has {dst.size} elements, expected 2 x {n} (shape "
                                 f"(1, 2, {n}): a start and an end index per segment id)")
    inst = record(w, "POOL", reads=[("segment_ids", segment_ids)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(w)
    ids = read_raw(w, "segment_ids", segment_ids).reshape(-1)
    if segment_ids.dtype == "float32":
        bad = ~np.isfinite(ids) | (ids < 0) | (ids != np.floor(ids))
    else:
        bad = ids < 0
    if bad.any():
        i = int(np.argmax(bad))
        raise NkiValidationError(f"{w}: segment_ids[0, {i}] = {ids[i].item()!r}; all segment IDs must be non-negative "
                                 f"integers (SDK-ISA sequence_bounds)")
    out = sequence_bounds_reference(ids)
    write(dst, out.reshape(dst.shape) if dtypes.is_int(dst.dtype) else out.astype(F32).reshape(dst.shape))
    return Instruction(w)
