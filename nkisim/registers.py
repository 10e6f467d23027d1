"""Engine-sequencer registers (``nisa.register_*``) and runtime loops (ref §2.4, §5.11).

A register holds a value that exists only at run time (SDK nki-language-guide.rst "Dynamic Control Flow": "Unlike
compile-time integer values, a VirtualRegister holds a value that exists at runtime"), so Python cannot compute with
it, compare it or branch on it while the kernel is built (SDK-ISA VirtualRegister note: "using a register in Python
control flow (``if``/``while``) or converting it with ``int()`` / ``range()`` raises ``TypeError``"). nkisim refuses
all of that with :class:`RegisterUseError`. Two things stay legal:

* ``reg == None`` / ``reg != None`` (False / True): a static test of the Python value, not of the register's contents
  (the kernels' ``x == None`` form, as ``is None`` is not NKI);
* ``while reg:`` -- the documented dynamic while loop (nki-language-guide.rst "Dynamic Control Flow": "A dynamic
  while loop is specified using the standard while-loop with a condition that is a single register value";
  nki-dynamic-loops.rst "Using while with a VirtualRegister"), deprecated in NKI 0.6.0 in favour of
  ``nl.while_loop`` (SDK-RN 0.6.0 "Deprecated and Removed APIs": "NKI emits a deprecation warning when it encounters
  ... ``while reg:`` loops"; migration guide 0.6.0 "Pattern 2"). nkisim runs it as that runtime loop (see
  :func:`nkisim.language._while_condition`): a deprecation warning, a ``while reg`` runtime loop in the trace and in the LNC=2
  uniformity log (nkisim/controlflow.py), the same rules as ``nl.while_loop`` (none inside ``nl.no_reorder``; the
  condition register is read by every body instruction). Its condition must be the register itself (``while reg:``,
  ``while regs["c"]:``): ``while not reg:``, ``while reg and x:`` and the like are refused, and so are ``break`` /
  ``return`` in its body (the loop ends only when the register reads 0).
"""
import os
import sys

from .errors import NkiValidationError

RULE = "NKI registers"
_DOC = ("SDK-ISA VirtualRegister: a register's value is not known while the kernel is built, so 'using a register "
        "in Python control flow (if/while) or converting it with int() / range() raises TypeError'")


class RegisterUseError(NkiValidationError, TypeError):
    """Python computing with, comparing or branching on a register value (a TypeError, as the SDK documents)."""


class VirtualRegister:
    """A 32-bit runtime register (see the module docstring for what Python may do with it: ``reg == None``
    and ``while reg:`` only). In shape-only mode a register loaded from memory holds the placeholder 0
    (``placeholder`` True).

    Registers are virtual (SDK-ISA register_alloc: "Users do not need to explicitly free a register ... The NKI
    compiler handles physical register allocation (and deallocation)"): one made by ``register_alloc`` counts
    against its instance's 64 physical registers only while it is alive, i.e. until the Python object is
    garbage-collected (``owner`` is that instance, None for registers that are not register_alloc'd).
    ``id`` names the register in the trace (``reg_writes`` / ``reg_reads``): a per-instance number given at its
    first traced use, 0 before."""
    __slots__ = ("value", "frozen", "placeholder", "owner", "id")

    def __init__(self, state=None, frozen=False):
        self.value = 0 if state is None else _scalar(state, "register_alloc")
        self.frozen = frozen
        self.placeholder = False
        self.owner = None
        self.id = 0

    def __del__(self):
        o = self.owner
        if o is not None:
            self.owner = None
            o.live_registers -= 1

    def __bool__(self):
        return WHILE_CONDITION[0](self, sys._getframe(1))

    def __eq__(self, other):
        if other is None:
            return False
        _refuse("compares it with ==", sys._getframe(1))

    def __ne__(self, other):
        if other is None:
            return True
        _refuse("compares it with !=", sys._getframe(1))

    __hash__ = object.__hash__

    def __repr__(self):
        return f"VirtualRegister({self.value}{', frozen' if self.frozen else ''})"

    def _arith(self, *a):
        _refuse("computes with it (Python arithmetic)", sys._getframe(1))

    def _order(self, *a):
        _refuse("compares it with < / <= / > / >=", sys._getframe(1))

    def _convert(self, *a):
        _refuse("converts it to a Python number (int() / float() / range() / an index)", sys._getframe(1))

    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __truediv__ = __rtruediv__ = _arith
    __floordiv__ = __rfloordiv__ = __mod__ = __rmod__ = __pow__ = __rpow__ = __neg__ = __pos__ = __abs__ = _arith
    __and__ = __rand__ = __or__ = __ror__ = __xor__ = __rxor__ = __lshift__ = __rlshift__ = _arith
    __rshift__ = __rrshift__ = __invert__ = _arith
    __lt__ = __le__ = __gt__ = __ge__ = _order
    __index__ = __int__ = __float__ = __round__ = _convert


def _where(frame):
    c = frame.f_code
    return f"{c.co_name} ({os.path.basename(c.co_filename)}:{frame.f_lineno})"


def _refuse(what, frame):
    raise RegisterUseError(
        f"{RULE}: {_where(frame)} {what} on a VirtualRegister: a register holds a run-time value, so Python can neither "
        f"compute with it, compare it nor branch on it while the kernel is built ({_DOC}). Compute on the device "
        f"(register_load of a tile an engine computed, .ap(scalar_offset=reg)), loop with nl.fori_loop / "
        f"nl.while_loop, or test a compile-time value instead (e.g. nl.program_id(0) rather than a register); "
        f"'reg == None' is the only comparison (a static test)")


def _truth_refused(reg, frame):
    _refuse("uses it as a Python truth value", frame)


# ``bool(reg)`` runs the deprecated ``while reg:`` loop, a runtime loop of nki.language: nkisim/language.py (the layer
# above, which owns runtime loops) puts its handler here when it is imported.
WHILE_CONDITION = [_truth_refused]


def _scalar(x, op):
    if isinstance(x, bool):
        return int(x)
    if isinstance(x, int):
        if not -2 ** 31 <= x < 2 ** 32:
            raise NkiValidationError(f"{op}: {x} does not fit a 32-bit register")
        return x
    if isinstance(x, float):
        return x
    try:
        import numpy as np
        if isinstance(x, np.integer):
            return int(x)
        if isinstance(x, np.floating):
            return float(x)
    except ImportError:  # pragma: no cover
        pass
    raise TypeError(f"{op}: expected an int/float or a VirtualRegister, got {type(x).__name__}")


def value_of(x, op):
    """Runtime value of an int or register argument."""
    if isinstance(x, VirtualRegister):
        return x.value
    return _scalar(x, op)


class RegisterLoad:
    """One ``register_load``, as a register-value provider sees it (``nkisim.register_values``).

    kernel: launch kernel name; rank, core: the instance; loc / stack: kernel ``file:line`` and the
    ``file:line:function`` frames (innermost first, as traced); function: innermost kernel function;
    tensor: source tensor name, tensor_id: its storage id (unique per allocation), named: True when the
    kernel gave ``name=``; memory: ``sbuf`` / ``shared_hbm`` / ...; index: flat element index of the
    loaded element in the source tensor; dtype; value: the loaded value when known (executing, or a real
    integer input in shape-only mode), else None."""
    __slots__ = ("kernel", "rank", "core", "loc", "stack", "function", "tensor", "tensor_id", "named", "memory",
                 "index", "dtype", "value")

    def __init__(self, **kw):
        for k in self.__slots__:
            setattr(self, k, kw.get(k))

    def __repr__(self):
        return (f"RegisterLoad({self.function} {self.tensor}[{self.index}] r{self.rank}c{self.core} "
                f"value={self.value})")
