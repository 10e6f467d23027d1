"""The experimental tile-level ``nki.language`` wrappers of NKI 0.6 (``nl.add(a, b)``, ``nl.exp(x)``, ``nl.sum``,
``nl.softmax``, ``nl.matmul``, ...), built out of nkisim's ``nki.isa`` instructions.

Every wrapper allocates its result with ``nl.ndarray`` (SBUF; PSUM for ``matmul`` / ``transpose``) and issues real
ISA instructions, so the trace, the engine / partition / dtype rules, SBUF accounting and shape-only mode apply
exactly as for hand-written ``nisa`` code. An ISA rule violated by a wrapper is reported as
``nl.<name> (lowered to nki.isa): <the ISA message>``.

Sources (ref = ../shared/docs/nki-reference.md):
* SDK-NL 0.5/0.6 stubs (aws-neuron-sdk ``nki/api/nki/language/__init__.py``): names, defaults, semantics
  ("x: a tile or a scalar value"; reductions: "axis ... can only be the last contiguous dim(s)"; ``var``: "keepdims
  currently ignored; result always has keepdims=True shape"; ``where``: "condition tile with float values (1.0 for
  True, 0.0 for False)"; ``logical_not``: "XOR with 1"; ``invert``: "XOR with all-ones"; ``matmul`` and
  ``transpose`` examples return PSUM tiles).
* "NKI Type Promotion" (SDK API common fields): result dtype rules and weakly typed scalars.
* ref §5.12 / §1.3 (SDK-RN 0.3.0-0.6.0): ``nl.copy`` = Vector ``tensor_copy`` (0.6.0); ``nl.rsqrt`` on GpSimd (0.5.0);
  known not to work on hardware: ``divide``, ``mod``, ``fmod``, ``power`` with a scalar exponent, broadcasting binary
  ops, ``matmul`` without ``transpose_x=True`` -- refused here (nkisim found no release note that fixes them).
* Lowerings the documents do not spell out are marked "inference" where they are coded.

Layouts: on-chip tiles are ``[P, f1, ...]`` with the partition dim first (P <= 128); reductions work on trailing free
axes only.
"""
import builtins
import contextlib
import functools
import inspect
import math

import numpy as np

from . import dtypes as _dt
from . import ops as _ops_mod
from .errors import NkiValidationError
from .memory import HBM, ON_CHIP, PSUM, SBUF
from .ops import OPS
from .site import current
from .tensor import NkiTensor

F32 = "float32"

# Documented known issues (ref §1.4 / §5.12: SDK-RN 0.3.0/0.4.0 Known Issues).
_KNOWN_ISSUE = ("is documented as not working on hardware (NKI release notes 0.3.0/0.4.0 Known Issues, ref §5.12); "
                "nkisim refuses it rather than compute what the hardware does not")

# Operator classes of the element-wise wrappers
_BINARY = ("add", "subtract", "multiply", "maximum", "minimum", "divide", "power", "mod", "fmod", "abs_max", "abs_min",
           "equal", "not_equal", "greater", "greater_equal", "less", "less_equal",
           "logical_and", "logical_or", "logical_xor",
           "bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift")
_BITVEC = ("bitwise_and", "bitwise_or", "bitwise_xor", "left_shift", "right_shift", "invert")
# unary functions that are entries of the ScalarE activation table (ref §6.2) -> nisa.activation
_ACT_UNARY = ("exp", "log", "sqrt", "tanh", "sigmoid", "relu", "gelu", "gelu_apprx_sigmoid", "gelu_apprx_tanh",
              "gelu_dx", "gelu_apprx_sigmoid_dx", "silu", "silu_dx", "softplus", "mish", "erf", "erf_dx", "arctan",
              "sign", "square", "abs", "reciprocal", "sin")
_MATMUL_IN = ("float8_e4m3", "float8_e5m2", "bfloat16", "float16", "tfloat32", "float32")


def _isa():
    from . import isa
    return isa


@contextlib.contextmanager
def _lowering(where):
    """Prefix errors raised by the ISA instructions a wrapper issues with the wrapper's name."""
    try:
        yield
    except NkiValidationError as e:
        if str(e).startswith(where):
            raise
        raise type(e)(f"{where} (lowered to nki.isa): {e}") from e


def _fail(where, msg):
    raise NkiValidationError(f"{where}: {msg}")


# ---- dtypes ----------------------------------------------------------------------------------
_FLOAT_BITS = {"float8_e4m3": 8, "float8_e4m3fn": 8, "float8_e5m2": 8, "float16": 16, "bfloat16": 16,
               "tfloat32": 32, "float32": 32}


def _int_info(name):
    if name == "bool_":
        return False, 8
    return name.startswith("int"), _dt.itemsize(name) * 8


def promote(a, b):
    """Result dtype of an arithmetic op on dtypes ``a`` and ``b`` ("NKI Type Promotion"): (float, int) -> the float;
    (float, float) -> the wider, or float32 for fp16/bf16 (bfloat16 for two fp8 formats); (int, int) -> the wider,
    or a widened signed type that holds both ranges ((int8, uint8) -> int16), float32 past 32 bits
    ((int32, uint32) -> float32)."""
    if a == b:
        return a
    fa, fb = a in _FLOAT_BITS, b in _FLOAT_BITS
    if fa != fb:
        return a if fa else b
    if fa:
        ba, bb = _FLOAT_BITS[a], _FLOAT_BITS[b]
        if ba != bb:
            return a if ba > bb else b
        return {32: "float32", 16: "float32", 8: "bfloat16"}[ba]
    (sa, wa), (sb, wb) = _int_info(a), _int_info(b)
    if sa == sb:
        return a if wa >= wb else b
    (ws, s), wu = ((wa, a), wb) if sa else ((wb, b), wa)
    if ws > wu:
        return s
    return "float32" if 2 * wu > 32 else f"int{2 * wu}"


def _dtype_of(x):
    """dtype of a tile or a scalar operand. Weakly typed Python scalars count as the widest hardware type of their
    kind ("Weakly Typed Scalar Type Inference": bool -> uint8, int -> int32, float -> float32); numpy scalars keep
    their dtype (64-bit ones count as weak)."""
    if isinstance(x, NkiTensor):
        return x.dtype
    if isinstance(x, np.generic) and x.dtype.itemsize < 8 and x.dtype != np.bool_:
        return _dt.normalize(x.dtype)
    if isinstance(x, (bool, np.bool_)):
        return "uint8"
    if isinstance(x, (int, np.integer)):
        return "int32"
    return F32


def _out_dtype(where, dtype, default):
    return default if dtype is None else _dt.normalize(dtype, f"{where}: dtype")


# ---- operands --------------------------------------------------------------------------------
def _scalar(x):
    return isinstance(x, (bool, int, float, np.generic)) and not isinstance(x, NkiTensor)


def _tile(where, name, x):
    """An on-chip (SBUF/PSUM) tile argument."""
    if not isinstance(x, NkiTensor):
        raise TypeError(f"{where}: {name} must be a tile (NkiTensor), got {type(x).__name__}")
    if x.storage.kind not in ON_CHIP:
        _fail(where, f"{name} is in {x.buffer.value} ({x.describe()}); the tile-level wrappers take SBUF/PSUM tiles "
                     f"(nl.load / nisa.dma_copy it into SBUF first)")
    return x


def _new(shape, dtype, buffer=SBUF):
    """A new tile in the running instance, as ``nl.ndarray(shape, dtype, buffer=buffer)`` allocates it."""
    return current("nl.ndarray").allocate(tuple(shape), _dt.normalize(dtype, "nl.ndarray"), buffer, "", None)


def _axes(where, x, axis):
    """Sorted tuple of reduction axes; they must be the trailing contiguous free axes (SDK-NL: "[1], [1,2], ...")."""
    nd = x.ndim
    ax = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis) if axis is not None else ()
    try:
        ax = tuple(sorted(int(a) + nd if int(a) < 0 else int(a) for a in ax))
    except TypeError:
        raise TypeError(f"{where}: axis must be an int or a tuple/list of ints, got {axis!r}") from None
    if not ax or ax != tuple(range(ax[0], nd)) or ax[0] < 1:
        _fail(where, f"axis={axis!r} for a tile of shape {list(x.shape)}: must name the trailing contiguous free "
                     f"dims (e.g. {nd - 1}, or {tuple(range(1, nd))}); the partition dim 0 cannot be reduced")
    return ax


def _reduced_shape(shape, axes, keepdims):
    """Result shape of a reduction. On-chip tiles stay >= 2-D (the partition dim plus at least one free dim; see
    NkiTensor.squeeze_dim), so a reduction of every free dim without keepdims gives [P, 1]."""
    if keepdims:
        return tuple(1 if d in axes else s for d, s in enumerate(shape))
    kept = tuple(s for d, s in enumerate(shape) if d not in axes)
    return kept if len(kept) >= 2 else (shape[0], 1)


def _bcast(t, shape):
    """Stride-0 view of ``t`` (size-1 free dims) over ``shape`` (a read-only broadcast access pattern)."""
    for d in range(1, len(shape)):
        if t.shape[d] == 1 and shape[d] != 1:
            t = t.broadcast(d, shape[d])
    return t


# ---- element-wise binary ---------------------------------------------------------------------
def _binary(name, x, y, dtype):
    """tile (op) tile of the same shape -> one ``nisa.tensor_tensor`` (DVE; GpSimd for all-int32 operands or
    ``power``, the ISA's default engine choice); tile (op) scalar -> one ``nisa.tensor_scalar`` (DVE,
    ``reverse0=True`` when the scalar is x)."""
    where = f"nl.{name}"
    op = OPS[name]
    tx, ty = isinstance(x, NkiTensor), isinstance(y, NkiTensor)
    for nm, v, t in (("x", x, tx), ("y", y, ty)):
        if t:
            _tile(where, nm, v)
        elif not _scalar(v):
            raise TypeError(f"{where}: {nm} must be a tile or a Python scalar, got {type(v).__name__}")
    if not (tx or ty):
        _fail(where, f"at least one of x, y must be a tile, got two scalars ({x!r}, {y!r})")
    if op.v4:
        _fail(where, "is NeuronCore-v4 (trn3) only (SDK-RN 0.4.0); not available on trn2")
    if name in ("divide", "mod", "fmod"):
        _fail(where, f"nl.{name} {_KNOWN_ISSUE}; multiply by nisa.reciprocal(...) of the divisor instead")
    if name in _BITVEC:
        for nm, v in (("x", x), ("y", y)):
            if not _dt.is_int(_dtype_of(v)) or isinstance(v, (float, np.floating)):
                _fail(where, f"inputs must be integer typed (SDK-NL); {nm} is "
                             f"{v.dtype if isinstance(v, NkiTensor) else repr(v)}")
    out_dt = _out_dtype(where, dtype, promote(_dtype_of(x), _dtype_of(y)))
    isa = _isa()
    if tx and ty:
        if x.shape != y.shape:
            _fail(where, f"x {list(x.shape)} and y {list(y.shape)} differ in shape: broadcasting binary ops "
                         f"{_KNOWN_ISSUE}; broadcast a [P, 1] column with nisa.tensor_scalar(operand0=column), or "
                         f"materialise it with nl.broadcast_to first")
        out = _new(x.shape, out_dt)
        with _lowering(where):
            isa.tensor_tensor(dst=out, data1=x, data2=y, op=op)
        return out
    t, s, rev = (x, y, False) if tx else (y, x, True)
    if name == "power":
        if not rev:
            _fail(where, f"power with a scalar exponent {_KNOWN_ISSUE}; pass the exponent as a full tile")
        _fail(where, "power with a scalar base has no trn2 instruction (nl.power is a GpSimd tensor_tensor op; "
                     "tensor_scalar on GpSimd is rsqrt only); pass the base as a full tile")
    if name in _BITVEC:
        s = int(s)
    out = _new(t.shape, out_dt)
    with _lowering(where):
        isa.tensor_scalar(dst=out, data=t, op0=op, operand0=s, reverse0=rev)
    return out


def _make_binary(name):
    def f(x, y, dtype=None):
        return _binary(name, x, y, dtype)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"nl.{name}(x, y, dtype=None): element-wise; see experimental._binary for the lowering."
    return f


# ---- element-wise unary ----------------------------------------------------------------------
def _unary_out(where, x, dtype):
    _tile(where, "x", x)
    return _new(x.shape, _out_dtype(where, dtype, x.dtype))


def _act(name, x, dtype=None):
    """Activation-table function -> one ``nisa.activation(op=nl.<name>)`` on ScalarE (ref §6.2). nl.sin: SDK-NL 0.5
    adds range reduction to the wrapper; nkisim's ACT sin is exact for every input, so one activation gives the
    same values (inference)."""
    where = f"nl.{name}"
    out = _unary_out(where, x, dtype)
    with _lowering(where):
        _isa().activation(dst=out, op=OPS[name], data=x)
    return out


def _make_act(name):
    def f(x, dtype=None):
        return _act(name, x, dtype)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"nl.{name}(x, dtype=None): one nisa.activation(op=nl.{name}) on ScalarE."
    return f


def rsqrt(x, dtype=None):
    """GpSimd ``tensor_scalar(op0=nl.rsqrt, operand0=0.0, engine=gpsimd)`` (NKI 0.5.0 moved nl.rsqrt to GpSimd for
    precision; so PSUM inputs are refused: GpSimd cannot access PSUM)."""
    out = _unary_out("nl.rsqrt", x, dtype)
    isa = _isa()
    with _lowering("nl.rsqrt"):
        isa.tensor_scalar(dst=out, data=x, op0=OPS["rsqrt"], operand0=0.0, engine=isa.engine.gpsimd)
    return out


def negative(x, dtype=None):
    """DVE ``tensor_scalar(op0=nl.multiply, operand0=-1.0)`` (inference)."""
    out = _unary_out("nl.negative", x, dtype)
    with _lowering("nl.negative"):
        _isa().tensor_scalar(dst=out, data=x, op0=OPS["multiply"], operand0=-1.0)
    return out


def logical_not(x, dtype=None):
    """SDK-NL: "Implemented as XOR with 1" -> DVE ``tensor_scalar(op0=nl.logical_xor, operand0=1)`` (boolean-like
    0/1 inputs; a nonzero value counts as 1)."""
    out = _unary_out("nl.logical_not", x, dtype)
    with _lowering("nl.logical_not"):
        _isa().tensor_scalar(dst=out, data=x, op0=OPS["logical_xor"], operand0=1.0)
    return out


def invert(x, dtype=None):
    """SDK-NL: integer input, "Implemented as XOR with all-ones" -> DVE ``tensor_scalar(op0=nl.bitwise_xor)``."""
    where = "nl.invert"
    _tile(where, "x", x)
    if not _dt.is_int(x.dtype):
        _fail(where, f"input must be integer typed (SDK-NL), got {x.dtype}")
    out = _unary_out(where, x, dtype)
    with _lowering(where):
        _isa().tensor_scalar(dst=out, data=x, op0=OPS["bitwise_xor"], operand0=-1)
        # all-ones is -1: NKI integers are 32-bit (nkisim/int32.py), 0xFFFFFFFF is not one
    return out


def copy(x, dtype=None):
    """NKI 0.6.0: Vector ``tensor_copy`` into a new SBUF tile (bit-exact for equal dtypes; ref §5.12)."""
    out = _unary_out("nl.copy", x, dtype)
    isa = _isa()
    with _lowering("nl.copy"):
        isa.tensor_copy(dst=out, src=x, engine=isa.engine.vector)
    return out


def cos(x, dtype=None):
    """cos(x) = sin(x + pi/2): one ``activation(op=nl.sin, bias=pi/2)`` (scalar bias, v3+) (inference)."""
    out = _unary_out("nl.cos", x, dtype)
    with _lowering("nl.cos"):
        _isa().activation(dst=out, op=OPS["sin"], data=x, bias=math.pi / 2)
    return out


def tan(x, dtype=None):
    """tan = sin(x) * (1 / sin(x + pi/2)): two ACT sin, DVE reciprocal, DVE tensor_tensor multiply (no divide on
    hardware, see nl.divide) (inference)."""
    where = "nl.tan"
    out = _unary_out(where, x, dtype)
    isa = _isa()
    s, c = _new(x.shape, F32), _new(x.shape, F32)
    with _lowering(where):
        isa.activation(dst=s, op=OPS["sin"], data=x)
        isa.activation(dst=c, op=OPS["sin"], data=x, bias=math.pi / 2)
        isa.reciprocal(dst=c, data=c)
        isa.tensor_tensor(dst=out, data1=s, data2=c, op=OPS["multiply"])
    return out


def _round_down_up(where, x, up, out):
    """floor / ceil through the fp32 -> int32 cast (round to nearest even): r = int(x); floor = r - (r > x);
    ceil = r + (r < x). Three DVE instructions; exact for |x| < 2^31 (inference: no ALU rounding op exists)."""
    isa = _isa()
    r = _new(x.shape, "int32")
    c = _new(x.shape, F32)
    with _lowering(where):
        isa.tensor_copy(dst=r, src=x)
        isa.tensor_tensor(dst=c, data1=r, data2=x, op=OPS["less" if up else "greater"])
        isa.tensor_tensor(dst=out, data1=r, data2=c, op=OPS["add" if up else "subtract"])
    return out


def floor(x, dtype=None):
    out = _unary_out("nl.floor", x, dtype)
    return _round_down_up("nl.floor", x, False, out)


def ceil(x, dtype=None):
    out = _unary_out("nl.ceil", x, dtype)
    return _round_down_up("nl.ceil", x, True, out)


def trunc(x, dtype=None):
    """trunc(x) = sign(x) * floor(|x|): ACT abs, floor (3 DVE), ACT sign, DVE multiply (inference)."""
    where = "nl.trunc"
    out = _unary_out(where, x, dtype)
    isa = _isa()
    a, f, sg = _new(x.shape, F32), _new(x.shape, F32), _new(x.shape, F32)
    with _lowering(where):
        isa.activation(dst=a, op=OPS["abs"], data=x)
    _round_down_up(where, a, False, f)
    with _lowering(where):
        isa.activation(dst=sg, op=OPS["sign"], data=x)
        isa.tensor_tensor(dst=out, data1=sg, data2=f, op=OPS["multiply"])
    return out


# ---- reductions ------------------------------------------------------------------------------
def _reduce(name, opname, x, axis, dtype, keepdims, default_dtype=None):
    """One DVE ``nisa.tensor_reduce(op, axis, keepdims)`` over trailing free axes."""
    where = f"nl.{name}"
    _tile(where, "x", x)
    axes = _axes(where, x, axis)
    out = _new(_reduced_shape(x.shape, axes, keepdims), _out_dtype(where, dtype, default_dtype or x.dtype))
    with _lowering(where):
        _isa().tensor_reduce(dst=out, op=OPS[opname], data=x, axis=axes, keepdims=keepdims)
    return out


def sum(x, axis, dtype=None, keepdims=False):
    return _reduce("sum", "add", x, axis, dtype, keepdims)


def max(x, axis, dtype=None, keepdims=False):
    return _reduce("max", "maximum", x, axis, dtype, keepdims)


def min(x, axis, dtype=None, keepdims=False):
    return _reduce("min", "minimum", x, axis, dtype, keepdims)


def prod(x, axis, dtype=None, keepdims=False):
    return _reduce("prod", "multiply", x, axis, dtype, keepdims)


def all(x, axis, dtype=None):
    """logical-AND reduction (1 where every element is nonzero), dtype defaults to x's (SDK-NL 0.6)."""
    return _reduce("all", "logical_and", x, axis, dtype, False)


def _count(shape, axes):
    n = 1
    for d in axes:
        n *= shape[d]
    return n


def mean(x, axis, dtype=None, keepdims=False):
    """SDK-NL: "Float32 intermediate values are used": DVE ``tensor_reduce(add)`` into fp32, then DVE
    ``tensor_scalar(multiply, 1/n)`` into the result dtype."""
    where = "nl.mean"
    s = _reduce("mean", "add", x, axis, F32, keepdims)
    n = _count(x.shape, _axes(where, x, axis))
    out = _new(s.shape, _out_dtype(where, dtype, x.dtype))
    with _lowering(where):
        _isa().tensor_scalar(dst=out, data=s, op0=OPS["multiply"], operand0=1.0 / n)
    return out


def var(x, axis, dtype=None, keepdims=False):
    """Population variance in fp32, two passes: mean (2 DVE), x - mean (DVE tensor_tensor with a stride-0 broadcast
    view), square (DVE tensor_tensor), sum (DVE tensor_reduce), * 1/n (DVE tensor_scalar). SDK-NL: keepdims is
    ignored, the result always has the keepdims=True shape."""
    where = "nl.var"
    _tile(where, "x", x)
    axes = _axes(where, x, axis)
    n = _count(x.shape, axes)
    isa = _isa()
    m = mean(x, axes, F32, True)
    d = _new(x.shape, F32)
    with _lowering(where):
        isa.tensor_tensor(dst=d, data1=x, data2=_bcast(m, x.shape), op=OPS["subtract"])
        isa.tensor_tensor(dst=d, data1=d, data2=d, op=OPS["multiply"])
    ss = _reduce("var", "add", d, axes, F32, True)
    out = _new(ss.shape, _out_dtype(where, dtype, x.dtype))
    with _lowering(where):
        isa.tensor_scalar(dst=out, data=ss, op0=OPS["multiply"], operand0=1.0 / n)
    return out


# ---- softmax / rms_norm ----------------------------------------------------------------------
def softmax(x, axis=-1, dtype=None):
    """exp(x - max) / sum(exp(x - max)) over trailing free axes, fp32 intermediates.

    Over every free axis (e.g. [P, F], axis=1) it is the documented kernel pattern (ref §7): DVE
    ``tensor_reduce(max, negate=True)`` -> [P, 1]; ACT ``activation(exp, bias=-max, reduce_op=add,
    reduce_cmd=reset_reduce, reduce_res=sum)``; DVE ``reciprocal``; DVE ``tensor_scalar(multiply, 1/sum)``.
    Over a subset of the free axes the per-row values are broadcast back with stride-0 views: DVE max (keepdims),
    DVE subtract, ACT exp, DVE sum, DVE reciprocal, DVE multiply."""
    where = "nl.softmax"
    _tile(where, "x", x)
    axes = _axes(where, x, axis)
    isa = _isa()
    out = _new(x.shape, _out_dtype(where, dtype, x.dtype))
    e = _new(x.shape, F32)
    if axes == tuple(range(1, x.ndim)):
        P = x.shape[0]
        nmax, ssum, rsum = _new((P, 1), F32), _new((P, 1), F32), _new((P, 1), F32)
        with _lowering(where):
            isa.tensor_reduce(dst=nmax, op=OPS["maximum"], data=x, axis=axes, negate=True)
            isa.activation(dst=e, op=OPS["exp"], data=x, bias=nmax, reduce_op=OPS["add"], reduce_res=ssum,
                           reduce_cmd=isa.reduce_cmd.reset_reduce)
            isa.reciprocal(dst=rsum, data=ssum)
            isa.tensor_scalar(dst=out, data=e, op0=OPS["multiply"], operand0=rsum)
        return out
    kshape = _reduced_shape(x.shape, axes, True)
    m, s = _new(kshape, F32), _new(kshape, F32)
    with _lowering(where):
        isa.tensor_reduce(dst=m, op=OPS["maximum"], data=x, axis=axes, keepdims=True)
        isa.tensor_tensor(dst=e, data1=x, data2=_bcast(m, x.shape), op=OPS["subtract"])
        isa.activation(dst=e, op=OPS["exp"], data=e)
        isa.tensor_reduce(dst=s, op=OPS["add"], data=e, axis=axes, keepdims=True)
        isa.reciprocal(dst=s, data=s)
        isa.tensor_tensor(dst=out, data1=e, data2=_bcast(s, x.shape), op=OPS["multiply"])
    return out


def rms_norm(x, w, axis, n, epsilon=1e-06, dtype=None, compute_dtype=None):
    """``x / sqrt(sum(x^2 over axis) / n + epsilon) * w`` (SDK-NL: "x / RMS(x) * w", n = number of values in the
    RMS). w must have x's shape (broadcasting binary ops are a known issue). Lowering (ref §7 RMSNorm pattern):
    ACT ``activation(square)`` (fp32), DVE ``tensor_reduce(add)``, ACT ``activation(rsqrt, scale=1/n,
    bias=epsilon)``, DVE ``tensor_scalar(multiply, rstd)`` (``tensor_tensor`` with a broadcast view when only some
    free axes are reduced) into ``compute_dtype`` (default float32), DVE ``tensor_tensor(multiply, w)``."""
    where = "nl.rms_norm"
    _tile(where, "x", x)
    _tile(where, "w", w)
    axes = _axes(where, x, axis)
    if w.shape != x.shape:
        _fail(where, f"w {list(w.shape)} must have x's shape {list(x.shape)}: broadcasting binary ops {_KNOWN_ISSUE} "
                     f"(nl.broadcast_to the weight first)")
    if not isinstance(n, (int, np.integer)) or n <= 0:
        _fail(where, f"n must be a positive int (the number of values in the RMS), got {n!r}")
    cdt = _out_dtype(where, compute_dtype, F32)
    isa = _isa()
    sq = _new(x.shape, F32)
    kshape = _reduced_shape(x.shape, axes, True)
    ss, rstd = _new(kshape, F32), _new(kshape, F32)
    y = _new(x.shape, cdt)
    out = _new(x.shape, _out_dtype(where, dtype, x.dtype))
    with _lowering(where):
        isa.activation(dst=sq, op=OPS["square"], data=x)
        isa.tensor_reduce(dst=ss, op=OPS["add"], data=sq, axis=axes, keepdims=True)
        isa.activation(dst=rstd, op=OPS["rsqrt"], data=ss, scale=1.0 / int(n), bias=float(epsilon))
        if axes == tuple(range(1, x.ndim)):
            isa.tensor_scalar(dst=y, data=x, op0=OPS["multiply"], operand0=rstd)
        else:
            isa.tensor_tensor(dst=y, data1=x, data2=_bcast(rstd, x.shape), op=OPS["multiply"])
        isa.tensor_tensor(dst=out, data1=y, data2=w, op=OPS["multiply"])
    return out


# ---- selection -------------------------------------------------------------------------------
def where(condition, x, y, dtype=None):
    """``x`` where condition is nonzero (SDK-NL: a float 1.0/0.0 tile), else ``y``; x and y are tiles of the
    condition's shape or Python scalars. Lowering (inference): y -> result dtype (DVE ``tensor_copy``, or
    ``memset`` for a scalar), condition -> uint8 predicate (DVE ``tensor_copy``), then DVE
    ``tensor_copy_predicated(src=x)`` (x cast / filled first when it is not a tile of the result dtype)."""
    w = "nl.where"
    _tile(w, "condition", condition)
    for nm, v in (("x", x), ("y", y)):
        if isinstance(v, NkiTensor):
            _tile(w, nm, v)
            if v.shape != condition.shape:
                _fail(w, f"{nm} {list(v.shape)} must have the condition's shape {list(condition.shape)} (broadcasting "
                         f"binary ops {_KNOWN_ISSUE})")
        elif not _scalar(v):
            raise TypeError(f"{w}: {nm} must be a tile or a Python scalar, got {type(v).__name__}")
    out_dt = _out_dtype(w, dtype, promote(_dtype_of(x), _dtype_of(y)))
    isa = _isa()

    def as_out(v):
        t = _new(condition.shape, out_dt)
        if isinstance(v, NkiTensor):
            isa.tensor_copy(dst=t, src=v)
        else:
            isa.memset(dst=t, value=int(v) if _dt.is_int(out_dt) else float(v))
        return t

    with _lowering(w):
        out = as_out(y)
        pred = _new(condition.shape, "uint8")
        isa.tensor_copy(dst=pred, src=condition)
        src = x if isinstance(x, NkiTensor) and x.dtype == out_dt else as_out(x)
        isa.tensor_copy_predicated(dst=out, src=src, predicate=pred)
    return out


# ---- matmul / transpose ----------------------------------------------------------------------
def matmul(x, y, transpose_x=False):
    """``x.T @ y`` with ``transpose_x=True``: x [K, M] (K <= 128, M <= 128) is the stationary, y [K, N] (N <= 512)
    the moving operand of one PE ``nc_matmul``; returns a new float32 PSUM tile [M, N] (SDK-NL example: the result
    is evicted with nisa.tensor_copy). ``transpose_x=False`` is refused: documented as not working on hardware."""
    where = "nl.matmul"
    _tile(where, "x", x)
    _tile(where, "y", y)
    if not transpose_x:
        _fail(where, f"transpose_x=False {_KNOWN_ISSUE}; pass x already transposed ([K, M], contraction on the "
                     f"partition dim) with transpose_x=True")
    if x.ndim != 2:
        _fail(where, f"x must be a 2-D [K, M] tile, got shape {list(x.shape)}")
    out = _new((x.shape[1],) + tuple(y.shape[1:]), F32, PSUM)
    with _lowering(where):
        _isa().nc_matmul(dst=out, stationary=x, moving=y)
    return out


def transpose(x, dtype=None):
    """2-D tile [P, F] -> [F, P] through the PE: ``nc_transpose(engine=tensor)`` into a new PSUM tile (SDK-NL
    example: ``result_psum = nl.transpose(x)``). A PSUM source or a dtype change is first copied into an SBUF tile
    of the result dtype (DVE ``tensor_copy``), since the PE reads SBUF and transposes bit-exactly."""
    where = "nl.transpose"
    _tile(where, "x", x)
    if x.ndim != 2:
        _fail(where, f"x must be a 2-D tile, got shape {list(x.shape)}")
    dt = _out_dtype(where, dtype, x.dtype)
    isa = _isa()
    src = x
    with _lowering(where):
        if x.buffer == PSUM or dt != x.dtype:
            src = _new(x.shape, dt)
            isa.tensor_copy(dst=src, src=x)
        out = _new((x.shape[1], x.shape[0]), dt, PSUM)
        isa.nc_transpose(dst=out, data=src, engine=isa.engine.tensor)
    return out


def load_transpose2d(src, dtype=None):
    """HBM [R, C] -> new SBUF tile [C, R]. 2-byte dtypes: one ``dma_transpose`` (the DMA transposes 2-byte types,
    SDK-ISA); other dtypes: per block of <= 128 src rows, ``dma_copy`` into SBUF, PE ``nc_transpose`` into PSUM, DVE
    ``tensor_copy`` back to SBUF (inference). A dtype change adds a DVE ``tensor_copy``."""
    where = "nl.load_transpose2d"
    if not isinstance(src, NkiTensor) or src.storage.kind not in HBM:
        _fail(where, f"src must be an HBM tensor, got {src.describe() if isinstance(src, NkiTensor) else type(src)}")
    if src.ndim != 2:
        _fail(where, f"src must be 2-D, got shape {list(src.shape)}")
    R, C = src.shape
    dt = _out_dtype(where, dtype, src.dtype)
    isa = _isa()
    with _lowering(where):
        t = _new((C, R), src.dtype)
        if src.itemsize == 2:
            isa.dma_transpose(dst=t, src=src)
        else:
            # R is the free size of the result and may exceed 128: one PE transpose per <= 128-row block of src
            # (each block [r, C] -> [C, r] into PSUM, then into its columns of t).
            for r0 in range(0, R, 128):
                r = builtins.min(128, R - r0)
                a = _new((r, C), src.dtype)
                isa.dma_copy(dst=a, src=src[r0:r0 + r, :])
                p = _new((C, r), src.dtype, PSUM)
                isa.nc_transpose(dst=p, data=a, engine=isa.engine.tensor)
                isa.tensor_copy(dst=t[:, r0:r0 + r], src=p)
        if dt == src.dtype:
            return t
        out = _new((C, R), dt)
        isa.tensor_copy(dst=out, src=t)
    return out


# ---- views / data movement -------------------------------------------------------------------
def expand_dims(x, axis):
    """A view with a new size-1 dim at ``axis`` (no instruction); never in front of the partition dim."""
    where = "nl.expand_dims"
    _tile(where, "x", x)
    a = int(axis)
    a = a + x.ndim + 1 if a < 0 else a
    if not 1 <= a <= x.ndim:
        _fail(where, f"axis={axis} for a tile of rank {x.ndim}: the new dim must come after the partition dim "
                     f"(1 <= axis <= {x.ndim})")
    return x.expand_dim(a)


def broadcast_to(x, shape, dtype=None):
    """A new SBUF tile of ``shape`` (same rank as x; each dim equal or broadcast from 1). Free dims: one DVE
    ``tensor_copy`` from a stride-0 view. Partition dim (x has 1 partition): PE ``nc_matmul`` of a ones row
    (stationary [1, P]) with x (moving [1, F]) into PSUM [P, F] (float32 products of 1.0, exact), then the DVE copy
    (inference: the partition-broadcast-by-matmul pattern, SDK-ARCH). Integer x goes through float32 first (exact
    below 2^24). Equal shapes: x itself, or a dtype-cast copy (SDK-NL)."""
    where = "nl.broadcast_to"
    _tile(where, "x", x)
    shape = tuple(int(s) for s in shape)
    if len(shape) != x.ndim or any(s != t and t != 1 for s, t in zip(shape, x.shape)):
        _fail(where, f"cannot broadcast {list(x.shape)} to {list(shape)}: same rank, each dim equal or 1 in x")
    dt = _out_dtype(where, dtype, x.dtype)
    if shape == x.shape:
        return x if dt == x.dtype else copy(x, dt)
    isa = _isa()
    src = x
    with _lowering(where):
        if x.shape[0] != shape[0]:
            if src.dtype not in _MATMUL_IN:
                src = _new(x.shape, F32)
                isa.tensor_copy(dst=src, src=x)
            ones = _new((1, shape[0]), src.dtype)
            isa.memset(dst=ones, value=1.0)
            ps = _new((shape[0],) + tuple(x.shape[1:]), F32, PSUM)
            isa.nc_matmul(dst=ps, stationary=ones, moving=src)
            src = ps
        out = _new(shape, dt)
        isa.tensor_copy(dst=out, src=_bcast(src, shape))
    return out


def gather_flattened(data, indices, axis=0, dtype=None):
    """Per partition ``out[p, k] = flat(data[p])[indices[p, k]]``: one GpSimd ``nc_n_gather`` (the 2.27 release
    notes: nc_n_gather "used to be nl.gather_flattened"). Indices that are not uint32 are converted first (GpSimd
    ``tensor_copy``); a dtype change adds a DVE ``tensor_copy``. Result shape = indices' shape; SBUF only."""
    where = "nl.gather_flattened"
    _tile(where, "data", data)
    _tile(where, "indices", indices)
    if axis != 0:
        _fail(where, f"axis={axis!r}: only the documented default (0; gather along the flattened free dims of each "
                     f"partition) is implemented")
    if not _dt.is_int(indices.dtype):
        _fail(where, f"indices must be an integer tile, got {indices.dtype}")
    dt = _out_dtype(where, dtype, data.dtype)
    isa = _isa()
    with _lowering(where):
        idx = indices
        if idx.dtype != "uint32":
            idx = _new(indices.shape, "uint32")
            isa.tensor_copy(dst=idx, src=indices, engine=isa.engine.gpsimd)
        g = _new(indices.shape, data.dtype)
        isa.nc_n_gather(dst=g, data=data, indices=idx)
        if dt == data.dtype:
            return g
        out = _new(indices.shape, dt)
        isa.tensor_copy(dst=out, src=g)
    return out


def fill_hbm(t, value):
    """Fill an HBM tensor (nl.full/zeros/ones with an HBM buffer; SDK-NL lists hbm among their buffers): one memset
    of an SBUF staging tile [p, f] (p = the largest divisor of the element count <= 128), then one ``dma_copy`` per
    column chunk of the flattened tensor viewed as [p, N/p] (inference: memset cannot reach HBM)."""
    from . import hw
    isa = _isa()
    N = t.size
    p = next(d for d in range(hw.PMAX, 0, -1) if N % d == 0)
    f = N // p
    chunk = builtins.min(f, 8192)
    stage = _new((p, chunk), t.dtype)
    isa.memset(dst=stage, value=value)
    flat = t.reshape((p, f))
    for c0 in range(0, f, chunk):
        c1 = builtins.min(f, c0 + chunk)
        isa.dma_copy(dst=flat[:, c0:c1], src=stage[:, 0:c1 - c0])
    return t


# ---- registry: nl.<name> -> wrapper ---------------------------------------------------------
def _named(f):
    """Every error a wrapper raises (its own checks, nl.ndarray, the ISA instructions) names the wrapper."""
    @functools.wraps(f)
    def g(*args, **kwargs):
        with _lowering(f"nl.{f.__name__}"):
            return f(*args, **kwargs)
    return g


WRAPPERS = {}
for _n in _BINARY:
    WRAPPERS[_n] = _named(_make_binary(_n))
for _n in _ACT_UNARY:
    WRAPPERS[_n] = _named(_make_act(_n))
for _f in (rsqrt, negative, logical_not, invert, copy, cos, tan, floor, ceil, trunc, sum, max, min, prod, all, mean,
           var, softmax, rms_norm, where, matmul, transpose, load_transpose2d, expand_dims, broadcast_to,
           gather_flattened):
    WRAPPERS[_f.__name__] = globals()[_f.__name__] = _named(_f)
del _n, _f

# nl.max / nl.min are also accepted as *reduction* operators (nkisim/ops.py REDUCTION_ALIASES).
_ops_mod.REDUCTION_ALIASES.update({max: "maximum", min: "minimum"})

# The nl.* operator constants (nkisim.ops.Op) double as these functions: give them the wrappers' signatures.
for _n, _o in OPS.items():
    if _n in WRAPPERS:
        _o.__signature__ = inspect.signature(WRAPPERS[_n])
del _n, _o


def call(name, *args, **kwargs):
    """Entry point of ``Op.__call__``: run the wrapper named ``name``."""
    f = WRAPPERS.get(name)
    if f is None:
        raise TypeError(f"nl.{name} is an operator constant (an op= argument of nki.isa instructions), not a "
                        f"tile-level function in NKI 0.6")
    return f(*args, **kwargs)


_ops_mod.TILE_FUNCTIONS[0] = call
