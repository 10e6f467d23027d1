"""Cross-core ordering of shared HBM under LNC=2: a core may read (or overwrite) bytes of a shared HBM tensor that the
other core of its rank wrote (or read) in the same launch only across a ``core_barrier`` on THAT tensor.

SDK ``nki.isa.core_barrier``: it is for when "two NeuronCores both need to write to disjoint portions of a shared HBM
tensor (``data``) ... and consume the tensor after both cores have finished", and "other engines will not be blocked":
the ordering a barrier gives is per tensor. (nki-library issues one barrier per shared tensor, e.g.
``bwmm_shard_on_I.py``.) nkisim runs each barrier as a rendezvous of the two cores, which would order everything, so
the rule is checked here instead of being left to the interleaving of the simulated cores.

Every executed DMA access of a shared HBM tensor by a core of an LNC=2 launch is logged per tensor (its resolved
view, or the element addresses of a gather / scatter). A ``core_barrier(data=t)`` ends the current *phase* of t's
storage on both cores (both have arrived, so the phase is complete on each); at that point, and for every storage
when the launch ends, the phase is checked: bytes one core wrote, and the other did not, must not be read by the
other core in the same phase, before or after the write (a read-after-write or write-after-read race). The check
does not depend on how the simulated cores interleaved. Not checked: both cores writing the same bytes (kernels
store identical values from both cores; such bytes do not count as the other core's), the HBM operands of
collectives and of dma_transpose, shape-only launches (their offsets are placeholders) and private
HBM (one core's own).
Switches: ``nkisim.hw.CORE_BARRIER_ORDER`` for scratch the kernel allocates ("error" by default: the read can only
see the other core's data or garbage) and ``CORE_BARRIER_ORDER_ARGUMENTS`` for the kernel's HBM arguments ("warn": a
core may read old contents on purpose and discard them, as the decode attention's masked head tiles do with cache rows
the other core is writing; nkisim cannot tell that from a race whose values are used).
"""
from __future__ import annotations

import numpy as np

from . import hw
from .errors import by_switch
from .memory import SHARED_HBM

DOC = ("SDK nki.isa.core_barrier: consume a shared HBM tensor the other core writes 'after both cores have finished', "
       "synchronised on that tensor (data=); the barrier orders only that tensor")


_ARGUMENT_NOTE = (" -- unless the kernel reads the old contents on purpose and discards them (a kernel argument: e.g. "
                  "masked cache rows), which nkisim cannot tell from a race whose values are used")


def note(inst, storage, write, op, view=None, addr=None, itemsize=1):
    """Log one executed DMA access of ``storage`` by ``inst``'s core: a direct ``view`` or byte ``addr`` (1-D)."""
    launch = inst.launch
    if launch.lnc != 2 or storage.kind is not SHARED_HBM or hw.CORE_BARRIER_ORDER == hw.CORE_BARRIER_ORDER_ARGUMENTS \
            == "off":
        return
    logs = launch.hbm_phase.get(storage.id)
    if logs is None:
        logs = launch.hbm_phase[storage.id] = (storage, ([], []))
    logs[1][inst.pid].append((write, op, view, addr, itemsize))


def _bytes(nbytes, entries):
    """Boolean mask over the storage's bytes touched by ``entries``."""
    m = np.zeros(nbytes, bool)
    for _, _, view, addr, isz in entries:
        _set(m, view, addr, isz)
    return m


def _set(m, view, addr, isz):
    if view is not None:
        shape = tuple(view.shape) + (view.itemsize,)
        strides = tuple(view.bstrides) + (1,)
        np.lib.stride_tricks.as_strided(m[view.boffset:], shape=shape, strides=strides, writeable=True)[...] = True
    else:
        m[(addr.reshape(-1, 1) + np.arange(isz)).reshape(-1)] = True


def _hits(m, view, addr, isz):
    if view is not None:
        shape = tuple(view.shape) + (view.itemsize,)
        strides = tuple(view.bstrides) + (1,)
        return bool(np.lib.stride_tricks.as_strided(m[view.boffset:], shape=shape, strides=strides).any())
    return bool(m[(addr.reshape(-1, 1) + np.arange(isz)).reshape(-1)].any())


def _check(storage, per_core, where):
    for a in (0, 1):
        writes = [e for e in per_core[a] if e[0]]
        other = [e for e in per_core[1 - a] if not e[0]]
        if not writes or not other:
            continue
        m = _bytes(storage.nbytes, writes)
        own = [e for e in per_core[1 - a] if e[0]]
        if own:                 # bytes the reading core wrote too (the same values from both cores): not a race
            m &= ~_bytes(storage.nbytes, own)
        for e in other:
            if _hits(m, e[2], e[3], e[4]):
                switch = "CORE_BARRIER_ORDER_ARGUMENTS" if storage.is_input else "CORE_BARRIER_ORDER"
                by_switch(getattr(hw, switch),
                          f"{where}: core {1 - a} reads bytes of {storage.describe()} "
                          f"({e[1]}) that core {a} wrote ({writes[0][1]}) with no core_barrier(data=) on that tensor "
                          f"between them ({DOC}); add a core_barrier on it after the writes, before the other core's "
                          f"access{_ARGUMENT_NOTE if storage.is_input else ''} (switch: nkisim.hw.{switch})",
                          stacklevel=3)
                return


def barrier(launch, storages):
    """Both cores reached a ``core_barrier`` on ``storages``: check and close their current phase."""
    for st in storages:
        logs = launch.hbm_phase.pop(st.id, None)
        if logs is not None:
            _check(logs[0], logs[1], "core_barrier")


def check_world(world):
    """End of a launch: check the last phase of every logged storage of every rank."""
    for launch in world.ranks:
        phases, launch.hbm_phase = launch.hbm_phase, {}
        for storage, per_core in phases.values():
            _check(storage, per_core, f"{world.kernel_name} (end of launch)")
