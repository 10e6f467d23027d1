"""TensorE instructions: nc_matmul, nc_transpose (ref §5.2, SDK-ISA, SDK-ARCH, SDK-TRN2)."""
import warnings

import numpy as np

from .. import hw
from ..errors import NkiFidelityWarning, NkiValidationError, UninitializedReadError
from ..memory import PSUM, SBUF
from ..numerics import fp32_matmul, fp32_matmul_active
from ..site import call_site
from ..tensor import _extent, elem_mask, mask, raw
from .common import Instruction, check_enum, geom, mark, match, read, read_raw, record, tensor, write
from .enums import engine as E, matmul_perf_mode

MATMUL_IN = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32")   # trn2 (SDK-ISA)
_FP32ISH = ("float32", "tfloat32")


def _tf32(a):
    """Round fp32 to tf32 (10 explicit mantissa bits, RNE) -- used when an operand is tfloat32."""
    b = a.astype(np.float32).view(np.uint32)
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(np.float32)


def _bank_check(op, dst):
    st = dst.storage
    R = st.row_bytes
    p0 = dst.boffset // R
    lo, hi = _extent(dst.boffset - p0 * R, dst.shape[1:], dst.bstrides[1:], dst.itemsize)
    lo, hi = st.address[1] + lo, st.address[1] + hi
    if lo // hw.PSUM_BANK_BYTES != (hi - 1) // hw.PSUM_BANK_BYTES:
        raise NkiValidationError(f"{op}: dst region bytes [{lo}, {hi}) of each partition crosses a {hw.PSUM_BANK_BYTES} B "
                                 f"PSUM bank boundary; a matmul output must stay inside one PSUM bank (SDK-ARCH)")


FP8_DOUBLE_ROW = ("float8_e4m3", "float8_e5m2")    # trn2 double-row FP8 inputs (SDK-ISA nc_matmul, SDK-TRN2)


def _dense_source(op, data):
    """PE nc_transpose on gen3 needs the data access pattern's partition stride to equal the tensor's free size
    (../shared/docs/trn2-costs.md, "Pitfalls met on real hardware": "data-AP partition stride equal to the tensor free
    size (buffers cannot be oversized/shared)"; the SDK-ISA docstring does not state it). On-chip views always step one
    partition row per index (common.geom refuses any other partition step), so that form always holds here. A view
    that reads only part of each row (a column slice or strided columns of a wider tile) keeps that stride; this
    project long read the pitfall as refusing it too (so
    nki_kernels/lm_head.py evicts each chunk into its own tile), but hardware-run code PE-transposes such views: the
    seed megakernel's measured DeltaNet layer (KevGomes1403/nki-moe-megakernel @2983e6eb: components/conv.py
    ``qkv_to_channel_partition`` transposes 128-column slices of the [T, 3,088] projection, ``conv_load_compute``
    strided tap columns) and AWS's nki-library (core/subkernels/norm_tkg_utils.py ``contiguous_load_transpose``,
    releases 2.29 onwards). Such a view is accepted with a NkiFidelityWarning. The DVE transpose is not affected."""
    P = data.shape[0]
    F = data.size // P if P else 0
    R = data.storage.row_bytes
    if P and F * data.itemsize != R:
        key = (op, call_site())
        if key not in _PART_ROW_WARNED:
            _PART_ROW_WARNED.add(key)
            warnings.warn(
                f"{op} at {key[1]}: engine=tensor transposes {data.describe()}, {F} elements of each "
                f"{R // data.itemsize}-element partition row (a slice of a wider tile). trn2-costs.md's pitfall ('data-AP "
                f"partition stride equal to the tensor free size') is met (the stride is the row), but this project "
                f"once read it as needing a whole tile; the seed's hardware-run DeltaNet layer and AWS's nki-library "
                f"(norm_tkg_utils.contiguous_load_transpose) transpose such slices, hence a warning. Copying the slice "
                f"into its own [{P}, {F}] tile is the safe form", NkiFidelityWarning, stacklevel=4)


_PART_ROW_WARNED = set()


def _psum_word_check(op, dst):
    """PSUM is written in 4-byte words (KLR psum_min_align = 4): a PE write of a sub-word per partition fails
    the verifier (trn2-costs.md: 'Transposing into a bf16 PSUM tile ... fails the verifier at T=1 (2-byte
    sub-word PSUM write)')."""
    per = dst.size // dst.shape[0] * dst.itemsize
    if per % hw.PSUM_MIN_ALIGN:
        raise NkiValidationError(f"{op}: dst {dst.describe()} receives {per} B per partition; PE writes to PSUM must be "
                                 f"whole {hw.PSUM_MIN_ALIGN}-byte words (a 2-byte dst needs an even free size)")


def _transpose_mode(op, dst, stationary, moving, accumulate, perf_mode):
    """nc_matmul(is_transpose=True): bit-accurate PE transpose (v3+). moving must be a permutation (normally
    the identity) [K, K]; dst[m, n] = stationary[k(n), m]. fp32/bf16/fp16 inputs give a dst of the same dtype;
    fp8 inputs give 16-bit PSUM elements whose upper 8 bits are zero (SDK-TRN2 "Built-in Transpose Support")."""
    if perf_mode != matmul_perf_mode.none:
        raise NkiValidationError(f"{op}: is_transpose=True cannot be combined with perf_mode=double_row (SDK-TRN2)")
    if accumulate:
        raise NkiValidationError(f"{op}: is_transpose=True is a bit-accurate data move; accumulate=True is not "
                                 f"possible (inference: transpose mode writes PSUM in the input precision)")
    K, M = stationary.shape[0], stationary.size // stationary.shape[0]
    N = moving.size // moving.shape[0]
    if moving.shape[0] != K or N != K:
        raise NkiValidationError(f"{op}: is_transpose=True needs moving to be a [K, K] = [{K}, {K}] identity matrix, "
                                 f"got {list(moving.shape)}")
    if stationary.dtype in ("float8_e4m3", "float8_e5m2"):
        if dst.itemsize != 2:
            raise NkiValidationError(f"{op}: FP8 transpose writes 16-bit PSUM elements (upper 8 bits zero); dst must be "
                                     f"a 2-byte dtype, got {dst.dtype}")
    elif dst.dtype != stationary.dtype:
        raise NkiValidationError(f"{op}: is_transpose=True keeps the dtype: dst must be {stationary.dtype} like "
                                 f"stationary, got {dst.dtype}")
    if dst.shape[0] != M or dst.size // dst.shape[0] != K:
        raise NkiValidationError(f"{op}: dst {list(dst.shape)} must be [{M}, {K}] for stationary {list(stationary.shape)}")
    return K, M


def _double_row(op, stationary, moving, tile_size):
    """perf_mode=double_row (v3+): both inputs fp8 e4m3/e5m2, shapes [K, 2, M] and [K, 2, N...], contraction
    over (partition, pair): dst[m, n] = sum_{p,j} stat[p, j, m] * mov[p, j, n] (SDK-ISA, SDK-TRN2)."""
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in FP8_DOUBLE_ROW:
            raise NkiValidationError(f"{op}: perf_mode=double_row needs float8_e4m3/float8_e5m2 operands on trn2, "
                                     f"{nm} is {t.dtype}")
        if t.ndim < 3 or t.shape[1] != 2:
            raise NkiValidationError(f"{op}: perf_mode=double_row needs {nm} shaped [K, 2, ...] (the first free dim "
                                     f"is 2 and part of the contraction), got {list(t.shape)}")
    if stationary.ndim != 3:
        raise NkiValidationError(f"{op}: perf_mode=double_row needs stationary [K, 2, M], got {list(stationary.shape)}")
    if tile_size and tile_size[1] != 128:
        raise NkiValidationError(f"{op}: perf_mode=double_row cannot be combined with column tiling "
                                 f"(tile_size={tile_size})")
    return stationary.shape[2], moving.size // (moving.shape[0] * 2)


def nc_matmul(dst, stationary, moving, is_stationary_onezero=False, is_moving_onezero=False, is_transpose=False,
              accumulate=None, tile_position=(), tile_size=(), perf_mode=matmul_perf_mode.none, name=None):
    op = "nc_matmul"
    tensor(op, "stationary", stationary, (SBUF,), "PE")
    tensor(op, "moving", moving, (SBUF,), "PE")
    tensor(op, "dst", dst, (PSUM,), "PE")
    check_enum(op, "perf_mode", perf_mode, matmul_perf_mode)
    if accumulate not in (None, True, False):
        raise TypeError(f"{op}: accumulate must be None, True or False, got {accumulate!r}")
    geom(op, "stationary", stationary)
    geom(op, "moving", moving)
    geom(op, "dst", dst)
    K = stationary.shape[0]
    if K != moving.shape[0]:
        raise NkiValidationError(f"{op}: stationary has {K} partitions (contraction K) but moving has "
                                 f"{moving.shape[0]}; both must share the partition (contraction) dim")
    kmax, mmax = hw.GEMM_CONTRACT_MAX, hw.GEMM_STATIONARY_FMAX
    tile_size, tile_position = tuple(tile_size), tuple(tile_position)
    if tile_size or tile_position:
        if len(tile_size) != 2 or len(tile_position) != 2:
            raise NkiValidationError(f"{op}: tile_position and tile_size must both be (row, col) pairs, got "
                                     f"{tile_position!r}, {tile_size!r}")
        for s, p in zip(tile_size, tile_position):
            if s not in (32, 64, 128) or p % s or p + s > 128:
                raise NkiValidationError(f"{op}: tile_size {tile_size} / tile_position {tile_position} invalid: sizes "
                                         f"in (32, 64, 128), positions multiples of the size within 128")
        kmax, mmax = tile_size
    for nm, t in (("stationary", stationary), ("moving", moving)):
        if t.dtype not in MATMUL_IN:
            extra = " (float8_e4m3fn is NeuronCore-v4 only; use float8_e4m3 on trn2)" if t.dtype == "float8_e4m3fn" else ""
            raise NkiValidationError(f"{op}: {nm} dtype {t.dtype} is not a matmul input type on trn2; expected one of "
                                     f"{', '.join(MATMUL_IN)}{extra}")
    if (stationary.dtype in _FP32ISH) != (moving.dtype in _FP32ISH):
        raise NkiValidationError(f"{op}: fp32/tf32 operands must pair with fp32/tf32, got stationary "
                                 f"{stationary.dtype} and moving {moving.dtype}")
    double = perf_mode == matmul_perf_mode.double_row
    if is_transpose:
        N, M = _transpose_mode(op, dst, stationary, moving, accumulate, perf_mode)
        _psum_word_check(op, dst)
    elif double:
        M, N = _double_row(op, stationary, moving, tile_size)
    else:
        M = stationary.size // K
        N = moving.size // K
    if K > kmax:
        raise NkiValidationError(f"{op}: stationary has {K} partitions, the contraction (partition) dim is at most {kmax}")
    if M > mmax:
        raise NkiValidationError(f"{op}: stationary has {M} free elements (M), at most {mmax} (gemm_stationary_fmax)")
    if N > hw.GEMM_MOVING_FMAX:
        raise NkiValidationError(f"{op}: moving has {N} free elements (N), at most {hw.GEMM_MOVING_FMAX} on trn2 "
                                 f"(gemm_moving_fmax, one PSUM bank)")
    if not is_transpose:
        if dst.dtype != "float32":
            raise NkiValidationError(f"{op}: dst dtype must be float32 on trn2 (PSUM accumulates fp32), got {dst.dtype}")
        if dst.shape[0] != M or dst.size // dst.shape[0] != N:
            raise NkiValidationError(f"{op}: dst {list(dst.shape)} must be [M={M} partitions, N={N} elements per "
                                     f"partition] for stationary {list(stationary.shape)} and moving {list(moving.shape)}")
    _bank_check(op, dst)
    extra = {"perf_mode": perf_mode.name} if double else {}
    if is_transpose:
        extra["is_transpose"] = True
    if tile_size:
        extra["tile_position"], extra["tile_size"] = list(tile_position), list(tile_size)
    inst = record(op, "PE", reads=[("stationary", stationary), ("moving", moving)], writes=[("dst", dst)],
                  K=K * (2 if double else 1), M=M, N=N, accumulate=accumulate, **extra)
    if inst.shape_only:
        return Instruction(op)
    if is_transpose:
        return _run_transpose(op, dst, stationary, moving, K, M)
    S, Mv = _operand(op, "stationary", stationary), _operand(op, "moving", moving)
    if stationary.dtype == "tfloat32":
        S = _tf32(S)
    if moving.dtype == "tfloat32":
        Mv = _tf32(Mv)
    if double:      # contraction over (partition, pair) -> 2K rows
        S = S.reshape(K * 2, M)
        Mv = Mv.reshape(K * 2, N)
    if fp32_matmul_active(stationary.dtype, moving.dtype):     # hardware-like numerics (nkisim/numerics.py)
        res = fp32_matmul(S, Mv)
    else:
        res = np.matmul(S.T, Mv)      # fp32 x fp32 -> fp32 through BLAS sgemm (a dtype= argument bypasses BLAS)
    st = dst.storage
    # acc: where to add onto the old PSUM value. Uniform storage states (storage.full / storage.mm_state, see
    # common.mark) answer the mask questions without building per-element masks.
    if accumulate is False:
        acc = False
    else:
        mm_state = st.mm_state
        if mm_state is True:                      # every element last written by a matmul (so written too)
            written = mm = True
        else:
            written = True if st.full else elem_mask(dst).reshape(M, N)
            mm = False if mm_state is False else elem_mask(dst, st.mm).reshape(M, N)
        if accumulate is None:
            acc = mm
            stray = (written if mm is False else written & ~mm) if written is not True or mm is not True else False
            if stray is not False and (stray is True or stray.any()):
                old = raw(dst).astype(np.float32).reshape(M, N)
                if np.any(old[np.broadcast_to(stray, (M, N))] != 0):
                    warnings.warn(f"{op}: dst holds non-zero values written by a non-matmul instruction; auto "
                                  f"accumulation overwrites them here, on trn2 accumulating onto them is undefined",
                                  stacklevel=2)
        else:
            if written is not True and not written.all():
                bad = np.argwhere(~written)[0]
                raise UninitializedReadError(f"{op}: accumulate=True into never-written PSUM of {st.describe()} at "
                                             f"dst element {list(bad)} (the first matmul of a group must overwrite)")
            if mm is not True and (mm is False or not mm.all()):
                warnings.warn(f"{op}: accumulate=True onto PSUM last written by a non-matmul instruction is undefined "
                              f"on trn2 (ref §5.2)", stacklevel=2)
            acc = True
    if acc is True:
        d = raw(dst)
        if d.shape == res.shape:             # 2-D [M, N] fp32 dst: accumulate in place (same fp32 sum)
            np.add(d, res, out=d)
            mark(dst, mm=True)
            return Instruction(op)
        res = d.astype(np.float32).reshape(M, N) + res
    elif acc is not False and acc.any():
        old = raw(dst).astype(np.float32).reshape(M, N)
        res = np.where(acc, old + res, res)
    write(dst, res, mm=True)
    return Instruction(op)


def _operand(op, name, t):
    """fp32 matmul operand [K, free]: the storage itself when it is already a contiguous aligned fp32 2-D view
    (np.matmul then takes the same BLAS sgemm path as with a copy), else an fp32 copy."""
    if t.dtype == "float32" and len(t.shape) == 2:
        a = read_raw(op, name, t)
        if a is not None and a.flags.c_contiguous and a.flags.aligned:
            return a
    return read(op, name, t)


def _run_transpose(op, dst, stationary, moving, K, M):
    mv = read(op, "moving", moving)
    ones = mv == 1.0
    if not (((mv == 0.0) | ones).all() and (ones.sum(axis=0) == 1).all()):
        raise NkiValidationError(f"{op}: is_transpose=True: moving {moving.describe()} is not an identity/permutation "
                                 f"matrix (one 1.0 per column, zeros elsewhere); transpose mode is a data move, not "
                                 f"a general matmul")
    src_row = np.argmax(ones, axis=0)                 # dst column n comes from stationary row src_row[n]
    a = read_raw(op, "stationary", stationary)        # [K, M] storage values, bit-exact
    t = np.ascontiguousarray(a[src_row].T)            # [M, K]
    if stationary.itemsize == 1:                      # fp8 -> 16-bit elements, upper 8 bits zero
        t = t.view(np.uint8).astype(np.uint16).view(dtypes_storage(dst.dtype))
    write(dst, t.reshape(dst.shape), exact=True, mm=False)
    return Instruction(op)


def dtypes_storage(name):
    from .. import dtypes
    return dtypes.storage(name)


def nc_transpose(dst, data, engine=E.unknown, name=None):
    op = "nc_transpose"
    check_enum(op, "engine", engine, E)
    if not hasattr(data, "shape") or not hasattr(dst, "shape"):
        tensor(op, "data", data)
        tensor(op, "dst", dst)
    P = data.shape[0]
    F = data.size // P if P else 0
    if engine == E.unknown:
        engine = E.vector if (P <= hw.DVE_TRANSPOSE_MAX and F <= hw.DVE_TRANSPOSE_MAX) else E.tensor
    if engine == E.tensor:
        eng, lim = "PE", hw.PE_TRANSPOSE_MAX
        tensor(op, "data", data, (SBUF,), "PE")
        tensor(op, "dst", dst, (PSUM,), "PE")
    elif engine == E.vector:
        eng, lim = "DVE", hw.DVE_TRANSPOSE_MAX
        tensor(op, "data", data, (SBUF, PSUM), "DVE")
        tensor(op, "dst", dst, (SBUF, PSUM), "DVE")
    else:
        raise NkiValidationError(f"{op}: engine must be engine.tensor or engine.vector, got {engine}")
    geom(op, "data", data)
    geom(op, "dst", dst)
    if P > lim or F > lim:
        raise NkiValidationError(f"{op}: data is [{P}, {F}] (free dims flattened); the {eng} transpose handles at most "
                                 f"[{lim}, {lim}]")
    if dst.dtype != data.dtype:
        raise NkiValidationError(f"{op}: dst dtype {dst.dtype} must equal data dtype {data.dtype}")
    if dst.shape[0] != F or dst.size != P * F:
        raise NkiValidationError(f"{op}: dst {list(dst.shape)} must be [{F}, {P}] for data {list(data.shape)} "
                                 f"(free dims flattened, then transposed)")
    if eng == "PE":
        _bank_check(op, dst)
        _psum_word_check(op, dst)
        _dense_source(op, data)
    inst = record(op, eng, reads=[("data", data)], writes=[("dst", dst)])
    if inst.shape_only:
        return Instruction(op)
    a = read_raw(op, "data", data)
    write(dst, np.ascontiguousarray(a.T), exact=True)      # bit-accurate (v3+ PE, DVE data move)
    return Instruction(op)
