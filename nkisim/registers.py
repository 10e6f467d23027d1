"""Engine-sequencer registers (``nisa.register_*``) and runtime loops (ref §2.4, §5.11)."""
from .errors import NkiValidationError


class VirtualRegister:
    """A 32-bit runtime register. ``bool(reg)`` supports the deprecated ``while reg:`` loop.
    In shape-only mode a register loaded from memory holds the placeholder 0 (``placeholder`` True).

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
        return self.value != 0

    def __repr__(self):
        return f"VirtualRegister({self.value}{', frozen' if self.frozen else ''})"

    def _arith(self, *a):
        raise TypeError("VirtualRegister values are runtime values: Python arithmetic on them is not possible "
                        "in NKI; pass the register as .ap(scalar_offset=reg) or use nisa.register_* ops")

    __add__ = __radd__ = __mul__ = __rmul__ = __sub__ = __rsub__ = __index__ = __int__ = _arith
    __floordiv__ = __mod__ = __lt__ = __le__ = __gt__ = __ge__ = _arith


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
