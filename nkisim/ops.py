"""Operator constants: ``nl.add``, ``nl.exp``, ... are both the ``op=`` arguments of ISA
instructions and (experimental) tile-level functions (calls go to nkisim/experimental.py). Semantics from SDK-SHARED tbl-aluop and
tbl-act-func (ref §6). All float math is done in fp32."""
import math
import warnings

import numpy as np

from .errors import NkiFidelityWarning, NkiValidationError

F32 = np.float32
TILE_FUNCTIONS = [None]   # [experimental.call]: the layer above (nkisim/experimental.py) sets it when imported


class Op:
    """kinds: 'arith' (binary), 'bitvec', 'cmp', 'logical', 'unary' (ALU unary), 'other' (power,
    v4-only abs_max/min), 'act_only' (activation-table functions that are not ALU ops)."""

    def __init__(self, name, kind, fn=None, act=None, reducible=False, identity=None, v4=False, alu_v4=False):
        self.name, self.kind, self.fn, self.act = name, kind, fn, act
        self.reducible, self.identity, self.v4, self.alu_v4 = reducible, identity, v4, alu_v4
        self.__name__ = name
        self.__qualname__ = name

    def __repr__(self):
        return f"nl.{self.name}"

    def __call__(self, *args, **kwargs):
        """``nl.add(x, y)``, ``nl.exp(x)``, ...: the experimental tile-level wrapper of the same name (built out of
        ISA instructions, see nkisim/experimental.py, which registers itself in TILE_FUNCTIONS)."""
        return TILE_FUNCTIONS[0](self.name, *args, **kwargs)

    @property
    def is_alu(self):
        return self.kind in ("arith", "bitvec", "cmp", "logical", "unary", "other")


def _b(x):
    return x != 0


def _f(x):
    return x.astype(F32)


def _lshift(a, b):
    return np.left_shift(a, b)


def _rshift(a, b):
    return np.right_shift(a, b)


def _sigmoid(x):
    with np.errstate(over="ignore"):
        return F32(1) / (F32(1) + np.exp(-x))


def _erf(x):
    import torch
    return torch.special.erf(torch.from_numpy(np.ascontiguousarray(x, dtype=F32))).numpy()


def _gelu(x):
    return F32(0.5) * x * (F32(1) + _erf(x / F32(math.sqrt(2.0))))


def _gelu_dx(x):
    cdf = F32(0.5) * (F32(1) + _erf(x / F32(math.sqrt(2.0))))
    pdf = np.exp(F32(-0.5) * x * x) / F32(math.sqrt(2 * math.pi))
    return cdf + x * pdf


def _gelu_tanh(x):
    return F32(0.5) * x * (F32(1) + np.tanh(F32(math.sqrt(2 / math.pi)) * (x + F32(0.044715) * x * x * x)))


def _gelu_sig(x):
    return x * _sigmoid(F32(1.702) * x)


def _gelu_sig_dx(x):
    s = _sigmoid(F32(1.702) * x)
    return s + x * F32(1.702) * s * (F32(1) - s)


def _softplus(x):
    return np.logaddexp(F32(0), x).astype(F32)


def _silu_dx(x):
    s = _sigmoid(x)
    return s * (F32(1) + x * (F32(1) - s))


def _rsqrt(x):
    return F32(1) / np.sqrt(x)


_ACT_RANGE = {}   # documented valid input ranges (SDK-SHARED tbl-act-func); informational


def _mk():
    o = {}

    def add(name, kind, fn=None, act=None, **kw):
        o[name] = Op(name, kind, fn, act, **kw)

    inf = float("inf")
    # arithmetic
    add("add", "arith", np.add, reducible=True, identity=0.0)
    add("subtract", "arith", np.subtract, reducible=True, identity=0.0)
    add("multiply", "arith", np.multiply, reducible=True, identity=1.0)
    add("maximum", "arith", np.maximum, reducible=True, identity=-inf)
    add("minimum", "arith", np.minimum, reducible=True, identity=inf)
    add("divide", "arith", np.divide)            # KLR has it; NKI documents divide as not working on HW
    # comparisons -> 1.0 / 0.0
    for n, f in (("equal", np.equal), ("not_equal", np.not_equal), ("greater", np.greater),
                 ("greater_equal", np.greater_equal), ("less", np.less), ("less_equal", np.less_equal)):
        add(n, "cmp", (lambda f: lambda a, b: f(a, b).astype(F32))(f))
    # logical (nonzero = true)
    add("logical_and", "logical", lambda a, b: (_b(a) & _b(b)).astype(F32), reducible=True, identity=1.0)
    add("logical_or", "logical", lambda a, b: (_b(a) | _b(b)).astype(F32), reducible=True, identity=0.0)
    add("logical_xor", "logical", lambda a, b: (_b(a) ^ _b(b)).astype(F32), reducible=True, identity=0.0)
    add("logical_not", "unary", lambda a: (~_b(a)).astype(F32))
    # bit-vector (integer bit patterns)
    add("bitwise_and", "bitvec", np.bitwise_and, reducible=True)
    add("bitwise_or", "bitvec", np.bitwise_or, reducible=True)
    add("bitwise_xor", "bitvec", np.bitwise_xor, reducible=True)
    add("left_shift", "bitvec", _lshift)
    add("right_shift", "bitvec", _rshift)        # logical shift (arith right shift unsupported)
    add("invert", "bitvec", np.invert)
    # other binary
    add("power", "other", lambda a, b: np.power(a, b).astype(F32))
    add("abs_max", "other", lambda a, b: np.maximum(np.abs(a), np.abs(b)), v4=True)
    add("abs_min", "other", lambda a, b: np.minimum(np.abs(a), np.abs(b)), v4=True)
    add("mod", "other", np.mod)
    add("fmod", "other", np.fmod)
    # unary ALU ops that are also activation functions
    add("abs", "unary", np.abs, act=np.abs)
    add("rsqrt", "unary", _rsqrt, act=_rsqrt)
    add("reciprocal", "unary", lambda a: F32(1) / a, act=lambda a: F32(1) / a)
    add("square", "unary", np.square, act=np.square, alu_v4=True)      # v4-only as tensor_scalar op0
    add("relu", "unary", lambda a: np.maximum(a, F32(0)), act=lambda a: np.maximum(a, F32(0)), alu_v4=True)
    # activation-table-only functions (ScalarE)
    acts = {
        "copy": lambda x: x, "sigmoid": _sigmoid, "gelu": _gelu, "gelu_dx": _gelu_dx,
        "gelu_apprx_tanh": _gelu_tanh, "gelu_apprx_sigmoid": _gelu_sig, "gelu_apprx_sigmoid_dx": _gelu_sig_dx,
        "silu": lambda x: x * _sigmoid(x), "silu_dx": _silu_dx, "tanh": np.tanh, "softplus": _softplus,
        "mish": lambda x: x * np.tanh(_softplus(x)), "erf": _erf,
        "erf_dx": lambda x: F32(2 / math.sqrt(math.pi)) * np.exp(-x * x),
        "exp": np.exp, "log": np.log, "sin": np.sin, "arctan": np.arctan, "sqrt": np.sqrt, "sign": np.sign,
    }
    for n, f in acts.items():
        add(n, "act_only", act=f)
    for n, f in (("cos", np.cos), ("tan", np.tan), ("ceil", np.ceil), ("floor", np.floor), ("trunc", np.trunc),
                 ("negative", np.negative)):
        add(n, "lang_only", act=None)
    # special markers
    add("bypass", "marker")
    add("average", "marker", reducible=True)
    add("prelu", "act_only", act=None, v4=True)
    return o


OPS = _mk()


# The reduction functions nl.max / nl.min name the max / min ALU operators where an instruction takes a *reduction*
# operator: SDK-ISA nki.isa.tensor_scalar_reduce (2.30+, Trn2/Trn3) "The reduce_op can be any of nl.add,
# nl.multiply, nl.max or nl.min", and SDK / NKL kernels pass op=nl.max to tensor_reduce. Filled by
# nkisim/experimental.py (the functions live there); see get(..., reduction=True).
REDUCTION_ALIASES = {}
_ALIAS_WARNED = set()


def get(op, where, arg="op", reduction=False):
    """The Op behind ``op``. The functions nl.max / nl.min stand for nl.maximum / nl.minimum: documented as
    reduction operators (``reduction=True``: tensor_reduce, reduce_op=, tensor_partition_reduce; SDK-ISA
    tensor_scalar_reduce: "reduce_op can be any of nl.add, nl.multiply, nl.max or nl.min"). As element-wise
    operators no document lists them, but AWS's own nki-library relies on it (experimental/foreach/foreach_norm.py
    linf norm: tensor_tensor(..., nl.max), covered by its integration test; weak evidence, as that repository also
    holds kernels NKI 0.3.0 rejects), so they compute the
    element-wise maximum / minimum with a NkiFidelityWarning (once per call site)."""
    if isinstance(op, Op):
        return op
    alias = REDUCTION_ALIASES.get(op) if callable(op) else None
    if alias is not None:
        if not reduction:
            from .site import call_site
            site = call_site()
            if site not in _ALIAS_WARNED:
                _ALIAS_WARNED.add(site)
                warnings.warn(f"{site}: {where}: {arg}=nl.{op.__name__} as an element-wise operator is not documented "
                              f"(only as a reduction operator); computed as nl.{alias}, as nki-library's foreach "
                              f"norm kernel relies on. Prefer nl.{alias}.", NkiFidelityWarning, stacklevel=3)
        return OPS[alias]
    raise TypeError(f"{where}: {arg} must be an nki.language operator such as nl.add or nl.exp, got {op!r}")
