"""The experimental random-number wrappers of ``nki.language`` (NKI 0.6, SDK-NL; docs pages
nki.language.rand / nki.language.random_seed / nki.language.dropout), built from the ISA instructions of
``nkisim/isa/rng.py`` so that they trace as the instructions they issue. Meant to be exposed as ``nl.rand``,
``nl.random_seed`` and ``nl.dropout``.

* ``rand(shape, dtype, buffer=sbuf, name='')``: uniform values in [0, 1) (docs: "sampled from a uniform
  distribution between 0 and 1"; example comment "[0, 1)"): ``rng`` (Vector, uint32 bits) -> logical shift
  right keeping the top ``b`` bits -> multiply by ``2**-b`` into the new tensor, where ``b`` is the precision
  of ``dtype`` (24 for float32, 8 for bfloat16, 11 for float16/tfloat32, 4 / 3 for fp8 e4m3 / e5m2), so every
  value is exact in ``dtype`` and never rounds up to 1.0. HBM buffers get an SBUF tile DMA-copied out. Integer
  dtypes are refused (a [0, 1) value would always be 0; use ``nisa.rng`` for random integer bits).
* ``random_seed(seed)``: ``nisa.set_rng_seed(seed)``; the 0.6 docs take a [1, 1] SBUF/PSUM tensor holding a
  32-bit value (example: ``nl.full((1, 1), 42, dtype=nl.int32, buffer=nl.sbuf)``). Seeds the Vector PRNG that
  ``rand`` and ``dropout`` use, so the same seed reproduces the same values.
* ``dropout(x, rate, dtype=None)``: a new SBUF tile; ``nisa.dropout`` (elements zeroed with probability
  ``rate``, the others kept unchanged: no 1/(1-rate) rescaling is documented), then a ``tensor_copy`` cast when
  ``dtype`` differs from ``x.dtype``. ``rate``: a scalar or a (x.shape[0], 1) tile.

The numbers are nkisim's XORWOW streams, not trn2's (see nkisim/isa/rng.py).
"""
import numpy as np

from . import dtypes
from .errors import NkiValidationError
from .memory import ON_CHIP, SBUF, MemoryRegion
from .site import current
from .tensor import NkiTensor

# precision (significand bits incl. the implicit one) of the float dtypes nl.rand fills
_RAND_BITS = {"float32": 24, "tfloat32": 11, "bfloat16": 8, "float16": 11, "float8_e4m3": 4, "float8_e4m3fn": 4,
              "float8_e5m2": 3}


def rand(shape, dtype, buffer=SBUF, name=""):
    """nl.rand: a new tensor of ``shape`` / ``dtype`` on ``buffer`` filled with uniform values in [0, 1)."""
    from . import isa
    from .ops import OPS
    w = "nl.rand"
    if type(shape) is not tuple:
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
    dtype = dtypes.normalize(dtype, w)
    if not isinstance(buffer, MemoryRegion):
        raise TypeError(f"{w}: buffer must be nl.sbuf, nl.psum, nl.hbm, nl.private_hbm or nl.shared_hbm, got "
                        f"{buffer!r}")
    b = _RAND_BITS.get(dtype)
    if b is None:
        raise NkiValidationError(f"{w}: dtype {dtype} cannot hold uniform [0, 1) values; expected one of "
                                 f"{', '.join(_RAND_BITS)} (use nisa.rng for random integer bits)")
    inst = current(w)
    on_chip = buffer in ON_CHIP
    out = inst.allocate(shape, dtype, buffer, name or "", None)
    bits = inst.allocate(shape, "uint32", SBUF, "", None)
    isa.rng(dst=bits, engine=isa.engine.vector)
    isa.tensor_scalar(dst=bits, data=bits, op0=OPS["right_shift"], operand0=32 - b)
    tile = out if on_chip else inst.allocate(shape, dtype, SBUF, "", None)
    isa.tensor_scalar(dst=tile, data=bits, op0=OPS["multiply"], operand0=float(2.0 ** -b))
    if not on_chip:
        isa.dma_copy(dst=out, src=tile)
    return out


def random_seed(seed):
    """nl.random_seed: seed the Vector PRNG used by nl.rand / nl.dropout with the 32-bit value in the [1, 1]
    tensor ``seed`` (SBUF or PSUM)."""
    from . import isa
    if not isinstance(seed, NkiTensor):
        raise TypeError(f"nl.random_seed: seed must be a [1, 1] SBUF/PSUM tensor holding a 32-bit value (NKI 0.6), "
                        f"got {type(seed).__name__}; e.g. nl.full((1, 1), {seed!r}, dtype=nl.int32, buffer=nl.sbuf)")
    isa.set_rng_seed(src_seeds=seed)


def dropout(x, rate, dtype=None):
    """nl.dropout: a new SBUF tile equal to ``x`` with each element zeroed with probability ``rate`` (scalar or
    (x.shape[0], 1) tile), cast to ``dtype`` (default ``x.dtype``)."""
    from . import isa
    w = "nl.dropout"
    if not isinstance(x, NkiTensor):
        raise TypeError(f"{w}: x must be an on-chip tile, got {type(x).__name__}")
    if x.buffer not in ON_CHIP:
        raise NkiValidationError(f"{w}: x is in {x.buffer.value} ({x.describe()}); expected an SBUF or PSUM tile")
    dtype = x.dtype if dtype is None else dtypes.normalize(dtype, w)
    inst = current(w)
    out = inst.allocate(tuple(x.shape), dtype, SBUF, "", None)
    if dtype == x.dtype:
        isa.dropout(dst=out, data=x, prob=rate)
        return out
    tmp = inst.allocate(tuple(x.shape), x.dtype, SBUF, "", None)
    isa.dropout(dst=tmp, data=x, prob=rate)
    isa.tensor_copy(dst=out, src=tmp)
    return out
