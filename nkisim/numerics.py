"""Hardware-like numerics: an opt-in mode in which nkisim's ScalarE functions and fp32 matmuls are as inexact
as trn2's may be (nkisim/README.md, "Hardware-like numerics").

By default nkisim computes every activation function with numpy and every fp32 ``nc_matmul`` with one fp32
sgemm ("exact" mode), so kernels reproduce the PyTorch reference to the last bits and the parity tests can
demand identical greedy tokens. trn2 does not: its ScalarE functions are piece-wise polynomial approximations
(SDK ``nki/api/nki.api.shared.rst``, "Supported Activation Functions") and an fp32 matmul lowers to two
``FP32_LO_HI`` matmul instructions at a quarter of the bf16 rate (SDK
``tools/neuron-explorer/profile-schema-reference.rst``, ``raw_flops`` / ``adjusted_flops``;
``nki/guides/architecture/trainium2_arch.rst``: 20 FP32 vs 79 BF16 dense TFLOPS). Neither the functions' error
nor the matmul's arithmetic is published, so every bound here is a parameter whose default is an assumption,
stated where it is defined::

    import nkisim
    with nkisim.numerics("hardware-like", seed=1):                 # the defaults below
        y = kernel[2](x, w)
    with nkisim.numerics("hardware-like", act_rel_error=2**-12, fp32_matmul="fp32"):
        ...

The setting is process-wide (the launch threads of every rank and core see it) and restored when the block
ends. Every perturbation is a pure function of (seed, function, the input value) or of the operands: the same
launch gives the same bits on every run, whatever order the instances run in. Shape-only launches compute
nothing and are unaffected.
"""
from __future__ import annotations

import contextlib
import zlib
from dataclasses import dataclass

import ml_dtypes
import numpy as np

MODES = ("exact", "hardware-like")

# fp32 nc_matmul forms (operands S [K, M], V [K, N] fp32 -> S.T @ V, fp32 accumulation of every pass):
#   fp32    one fp32 sgemm (nkisim's exact mode)
#   bf16x3  each operand split into a bf16 high part and a bf16 low part (RNE, x = hi + lo + r, |r| <= 2^-18 |x|);
#           three bf16 passes hi.hi + hi.lo + lo.hi (products exact in fp32), lo.lo dropped:
#           |error| <= ~3 * 2^-18 * sum_k |S||V| plus fp32 accumulation rounding
#   tf32    one pass on tf32-rounded operands (10 explicit mantissa bits, RNE): <= ~2^-10 relative per product
#   bf16    one pass on bf16-rounded operands (what neuronx-cc's default --auto-cast does to fp32 matmuls of an
#           XLA graph; SDK archive/appnotes/neuronx-cc/neuronx-cc-training-mixed-precision.rst): <= ~2^-8
FP32_MATMUL_FORMS = ("fp32", "bf16x3", "tf32", "bf16")

# Functions the ScalarE evaluates exactly in this model (degree <= 2 or piece-wise linear: a polynomial table
# reproduces them; an assumption). Every other activation-table function carries the relative error.
EXACT_FUNCTIONS = frozenset({"copy", "relu", "abs", "sign", "square"})

# Default bound of the relative error of an approximated ScalarE function. No bound is published (nki-reference
# §12, open questions). The tables serve bf16 outputs at full rate, where an error near bf16's half ulp
# (2^-9 = 1.95e-3) would already make one result in several off by one bf16 ulp -- so a table cannot be much
# worse than that and stay in use; we take that as the PESSIMISTIC default (assumption). The SDK's statements that
# DVE reciprocal and GpSimd rsqrt are "more precise" than their ACT counterparts (SDK-SHARED "Engine Selection")
# say the ACT versions are not correctly rounded fp32, nothing more.
DEFAULT_ACT_REL_ERROR = 2.0 ** -9

# The error is constant over inputs that share sign, exponent and their top ACT_SEGMENT_BITS mantissa bits (the
# bf16 truncation of the input at 7): a piece-wise model in which nearby inputs get correlated errors, as inputs
# in one polynomial segment do. 23: a separate error per fp32 input value. Assumption (segment layout unpublished).
DEFAULT_ACT_SEGMENT_BITS = 7

# Default fp32 matmul form: the docs give the pass count and the rate, not the arithmetic; bf16x3 is the cheapest
# standard split into bf16-width products that keeps fp32-grade accuracy (~1e-5 relative), so a kernel that passes
# under it does not lean on the last bits of an exact sgemm. Assumption.
DEFAULT_FP32_MATMUL = "bf16x3"


@dataclass(frozen=True)
class Numerics:
    """One numerics setting (``nkisim.numerics(...)`` builds and validates it)."""

    mode: str = "exact"
    seed: int = 0
    act_rel_error: float = DEFAULT_ACT_REL_ERROR
    act_segment_bits: int = DEFAULT_ACT_SEGMENT_BITS
    fp32_matmul: str = DEFAULT_FP32_MATMUL

    @property
    def hardware_like(self) -> bool:
        return self.mode == "hardware-like"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "seed": self.seed, "act_rel_error": self.act_rel_error,
                "act_segment_bits": self.act_segment_bits, "fp32_matmul": self.fp32_matmul}


EXACT = Numerics()
_current = EXACT


def current() -> Numerics:
    """The active setting (``EXACT`` outside any ``numerics`` block)."""
    return _current


def make(mode: str = "hardware-like", seed: int = 0, act_rel_error: float = DEFAULT_ACT_REL_ERROR,
         act_segment_bits: int = DEFAULT_ACT_SEGMENT_BITS, fp32_matmul: str = DEFAULT_FP32_MATMUL) -> Numerics:
    """A validated setting; ValueError with one line naming the bad parameter."""
    if mode not in MODES:
        raise ValueError(f"nkisim.numerics: mode must be one of {', '.join(MODES)}, got {mode!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or not 0 <= int(seed) < 2 ** 32:
        raise ValueError(f"nkisim.numerics: seed must be an int in [0, 2**32), got {seed!r}")
    err = float(act_rel_error)
    if not 0.0 <= err < 0.5:
        raise ValueError(f"nkisim.numerics: act_rel_error must be in [0, 0.5), got {act_rel_error!r}")
    if isinstance(act_segment_bits, bool) or not isinstance(act_segment_bits, (int, np.integer)) \
            or not 0 <= int(act_segment_bits) <= 23:
        raise ValueError(f"nkisim.numerics: act_segment_bits must be an int in 0..23, got {act_segment_bits!r}")
    if fp32_matmul not in FP32_MATMUL_FORMS:
        raise ValueError(f"nkisim.numerics: fp32_matmul must be one of {', '.join(FP32_MATMUL_FORMS)}, "
                         f"got {fp32_matmul!r}")
    return Numerics(mode, int(seed), err, int(act_segment_bits), fp32_matmul)


@contextlib.contextmanager
def numerics(mode: str = "hardware-like", seed: int = 0, act_rel_error: float = DEFAULT_ACT_REL_ERROR,
             act_segment_bits: int = DEFAULT_ACT_SEGMENT_BITS, fp32_matmul: str = DEFAULT_FP32_MATMUL):
    """Run the launches inside the block with this numerics setting (process-wide; the previous one comes back
    at the end). ``mode="exact"`` is nkisim's default behaviour. Yields the ``Numerics``."""
    global _current
    setting = make(mode, seed, act_rel_error, act_segment_bits, fp32_matmul)
    previous = _current
    _current = setting
    try:
        yield setting
    finally:
        _current = previous


# ---- ScalarE functions ----------------------------------------------------------------------------------------
def act_perturbed(func: str) -> bool:
    """Does ``activation(op=func)`` carry an error under the active setting?"""
    s = _current
    return s.hardware_like and s.act_rel_error > 0.0 and func not in EXACT_FUNCTIONS


_M1, _M2, _GOLDEN = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB), np.uint64(0x9E3779B97F4A7C15)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64 finalizer (Steele, Lea, Flood 2014) on uint64 arrays (wrapping arithmetic)."""
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def unit_noise(seed: int, func: str, x: np.ndarray, segment_bits: int) -> np.ndarray:
    """Deterministic u in [-1, 1) per element of fp32 ``x``: a hash of (seed, func, the input's segment)."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    key = (bits >> np.uint32(23 - segment_bits)).astype(np.uint64)
    salt = np.uint64((zlib.crc32(func.encode()) << 32) | seed)
    z = _mix(_mix(key ^ salt))
    return ((z >> np.uint64(11)).astype(np.float64) * 2.0 ** -52 - 1.0).reshape(np.shape(x))


def act_output(func: str, x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """The function's fp32 result ``out = f(x)`` with the active relative error: ``fl32(out * (1 + e * u))``,
    ``|u| < 1``, so ``|result - f(x)| <= e * |f(x)|`` plus one fp32 rounding. Zeros, infinities and NaNs pass
    unchanged."""
    s = _current
    u = unit_noise(s.seed, func, x, s.act_segment_bits)
    with np.errstate(over="ignore", invalid="ignore"):
        return (out.astype(np.float64) * (1.0 + s.act_rel_error * u)).astype(np.float32)


# ---- fp32 matmul ----------------------------------------------------------------------------------------------
def fp32_matmul_active(stationary_dtype: str, moving_dtype: str) -> bool:
    """Does an nc_matmul with these operand dtypes run in a reduced form under the active setting?"""
    s = _current
    return s.hardware_like and s.fp32_matmul != "fp32" and "float32" in (stationary_dtype, moving_dtype)


def _split_bf16(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    hi = a.astype(ml_dtypes.bfloat16).astype(np.float32)
    lo = (a - hi).astype(ml_dtypes.bfloat16).astype(np.float32)
    return hi, lo


def _tf32(a: np.ndarray) -> np.ndarray:
    b = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    b = (b + np.uint32(0xFFF) + ((b >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return b.view(np.float32)


def fp32_matmul(S: np.ndarray, V: np.ndarray) -> np.ndarray:
    """``S.T @ V`` (S [K, M], V [K, N] fp32) in the active fp32 matmul form; fp32 [M, N]. Each pass is one fp32
    sgemm of exactly representable products, accumulated into the result in pass order."""
    form = _current.fp32_matmul
    S = np.asarray(S, dtype=np.float32)
    V = np.asarray(V, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        if form == "bf16":
            return np.matmul(S.astype(ml_dtypes.bfloat16).astype(np.float32).T,
                             V.astype(ml_dtypes.bfloat16).astype(np.float32))
        if form == "tf32":
            return np.matmul(_tf32(S).T, _tf32(V))
        if form == "bf16x3":
            sh, sl = _split_bf16(S)
            vh, vl = _split_bf16(V)
            res = np.matmul(sh.T, vh)
            res += np.matmul(sh.T, vl)
            res += np.matmul(sl.T, vh)
            return res
    return np.matmul(S.T, V)
