"""32-bit integers: every integer that reaches the kernel must fit int32.

SDK ``nki/get-started/nki-language-guide.rst`` "NKI Values": the NKI language has "32-bit integer values" (and
32-bit floats); there is no wider integer. So every integer the kernel hands to the API is a 32-bit value:
tensor shapes, slice bounds and integer indices, ``.ap()`` offsets / steps / counts, the element offset and strides
of a view (``NkiTensor.offset`` / ``.strides`` are integers), scalar operands of instructions, loop bounds and
steps, register immediates (SDK-LG: "Each register is 32-bit"), and integer kernel arguments. SDK-ISA says it
explicitly for iota / affine_select ``offset`` / ``channel_multiplier`` ("an int32 offset value") and
nonzero_with_count ``index_offset`` / ``padding_val``.

Refused (NkiValidationError naming the value, what it is and the kernel line): a value outside
[-2**31, 2**31 - 1]; for a view, an element offset or stride beyond that range (e.g. a stacked HBM tensor of
7.85e9 elements sliced near its end). Warned (NkiFidelityWarning, the rule is inferred, not stated): a view that
starts inside int32 but whose last element lies beyond it, and a tensor with more than 2**31 - 1 elements
(its ``size`` is not a 32-bit value).

Switch: ``nkisim.hw.INT32_CHECK`` ("error" by default, "off").
"""
import os
import warnings

from . import hw
from .errors import NkiFidelityWarning, NkiValidationError

RULE = "32-bit integers"
DOC = "SDK nki-language-guide.rst 'NKI Values'"
_warned = set()


def _where():
    from .site import current_or_none, kernel_site
    if current_or_none() is None:
        return "the kernel call"
    s = kernel_site()
    return "?" if s is None else f"{os.path.basename(s[0])}:{s[1]}"


def fail(value, what):
    raise NkiValidationError(f"{RULE}: {what} is {value}, outside the 32-bit integer range [{hw.INT32_MIN}, "
                             f"{hw.INT32_MAX}] at {_where()}; NKI integers are 32-bit ({DOC})")


def check(value, what):
    """``value`` (a Python int) if it fits int32, else refuse it; ``what`` names it ("nl.fori_loop: upper")."""
    if (value > hw.INT32_MAX or value < hw.INT32_MIN) and hw.INT32_CHECK != "off":
        fail(value, what)
    return value


def check_ints(values, what):
    """Refuse the first int of ``values`` outside int32 (``what`` names the sequence, e.g. "nl.ndarray shape")."""
    if hw.INT32_CHECK == "off":
        return
    for i, v in enumerate(values):
        if type(v) is int and (v > hw.INT32_MAX or v < hw.INT32_MIN):
            fail(v, f"{what}[{i}]")


def check_scalar(value, what):
    """A scalar operand: ints (not bools) must fit int32."""
    if type(value) is int or (isinstance(value, int) and not isinstance(value, bool)):
        check(int(value), what)
    elif hasattr(value, "dtype") and getattr(value.dtype, "kind", "") in "iu" and not isinstance(value, bool):
        try:
            check(int(value), what)
        except TypeError:
            pass
    return value


def check_view(op, name, t):
    """A view of a storage with more than 2**31 - 1 elements (only those can exceed int32): its element offset and
    element strides must be 32-bit; its last element beyond int32 is warned."""
    if hw.INT32_CHECK == "off":
        return
    isz = t.itemsize
    off = t.boffset // isz
    what = f"{op}: {name} ({t.describe()})"
    if off > hw.INT32_MAX:
        fail(off, f"the element offset of {what}")
    hi = off
    for n, s in zip(t.shape, t.bstrides):
        es = s // isz
        if abs(es) > hw.INT32_MAX:
            fail(es, f"an element stride of {what}")
        if es > 0:
            hi += es * (n - 1)
    ind = t.indirect
    if ind is not None and ind.limit:          # the furthest a dynamic offset can reach
        hi += (ind.limit - 1) * (ind.unit // isz)
    if hi > hw.INT32_MAX:
        warn_once((op, name, t.storage.id), f"{RULE}: {what} starts at element {off} but reaches element {hi}, beyond "
                  f"int32 ({hw.INT32_MAX}) at {_where()}; NKI integers are 32-bit ({DOC}) -- inferred: the docs do not "
                  f"say how the hardware forms element addresses; split the tensor so every access stays below 2**31")


def check_size(st):
    """A tensor with more elements than int32 holds: warned once (its ``size`` attribute is not a 32-bit value)."""
    if st.nelems > hw.INT32_MAX and hw.INT32_CHECK != "off":
        warn_once(("size", st.id), f"{RULE}: tensor {st.describe()} has {st.nelems} elements, more than int32 holds "
                  f"({hw.INT32_MAX}) ({DOC}: its size and the element offsets past 2**31 - 1 are not 32-bit values); "
                  f"accesses beyond element {hw.INT32_MAX} are refused -- split it (e.g. one tensor per layer)")


def warn_once(key, msg):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(msg, NkiFidelityWarning, stacklevel=4)
