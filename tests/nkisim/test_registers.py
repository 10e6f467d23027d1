"""Virtual registers: only live ones count against the 64 per engine sequencer (SDK-ISA register_alloc: the
compiler allocates and frees virtual registers)."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import hw

N_REGS = hw.NUM_REGISTERS          # (kernel code reads no nkisim module)


def _layer(i_sb, acc):
    """One 'layer': a fresh register loaded from SBUF, used as a runtime loop bound, then dropped."""
    r = nisa.register_alloc()
    nisa.register_load(r, i_sb)
    def body(i):
        nisa.tensor_scalar(dst=acc, data=acc, op0=nl.add, operand0=1.0)
    nl.fori_loop(0, r, body)


def test_dead_registers_are_freed():
    """A 40+-layer kernel allocating one register per layer is legal: the compiler frees dead virtual
    registers (SDK-ISA register_alloc); only live ones count."""
    @nki.jit
    def k(n):
        i_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i_sb, src=n)
        acc = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        for _ in range(3 * N_REGS):
            _layer(i_sb, acc)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=acc)
        return out
    out = k(np.array([[2]], np.int32))
    assert out[0, 0] == 2 * 3 * hw.NUM_REGISTERS


def _hold(n):
    @nki.jit
    def k(x):
        held = []
        for i in range(n):
            held.append(nisa.register_alloc(i))
        return x
    return k


def test_live_register_limit():
    x = np.zeros((1, 1), np.float32)
    _hold(hw.NUM_REGISTERS)(x)                             # 64 live at once: fine
    with pytest.raises(nkisim.NkiValidationError, match="65 registers live at once"):
        _hold(hw.NUM_REGISTERS + 1)(x)


def test_register_limit_is_per_instance():
    """Each LNC instance (physical core) has its own sequencers: 64 live on each core is fine."""
    x = np.zeros((1, 1), np.float32)
    _hold(hw.NUM_REGISTERS)[2](x)
