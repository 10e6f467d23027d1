"""Launch and instance state: who is running, their memories, and the deterministic LNC scheduler.

Under ``kernel[2]`` the two program instances run as two threads, but only one runs at a time and
the turn passes only at synchronisation points (``core_barrier``, ``sendrecv``) or when an instance
finishes: instance 0 runs first. Results are therefore deterministic; a kernel that races on shared
HBM without a barrier still gets a deterministic (but not hardware-guaranteed) answer.
"""
import os
import sys
import threading

import numpy as np

from . import hw, trace
from .errors import LaunchAborted, NkiValidationError
from .memory import (PSUM, SBUF, PRIVATE_HBM, SHARED_HBM, HbmAccount, RangeAllocator, Storage,
                     attach_release)
from .tensor import NkiTensor

_local = threading.local()
_PKG_DIR = os.path.dirname(os.path.abspath(__file__))


def current(op="nki"):
    inst = getattr(_local, "inst", None)
    if inst is None:
        raise RuntimeError(f"{op}: called outside a running kernel (call the kernel through nki.jit / "
                           f"nki.simulate; nkisim executes eagerly inside the launch)")
    return inst


def current_or_none():
    return getattr(_local, "inst", None)


def call_site():
    """file:line of the innermost frame outside nkisim (the kernel line that issued the op)."""
    f = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PKG_DIR):
        f = f.f_back
    if f is None:
        return "?"
    return f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


class Launch:
    def __init__(self, kernel_name, lnc, ndim, shape_only):
        self.kernel_name = kernel_name
        self.lnc, self.ndim, self.shape_only = lnc, ndim, shape_only
        self.shared_allocs = []
        self.shared_hbm = HbmAccount(SHARED_HBM, hw.HBM_BYTES_PER_RANK)
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.turn = 0
        self.finished = set()
        self.aborted = None
        self.barrier_arrived = {}       # generation bookkeeping for core_barrier
        self.barrier_gen = 0
        self.pipes = {}                 # sendrecv rendezvous
        self.traces = trace.current()
        self.instances = [Instance(self, i) for i in range(lnc)]
        for t in self.traces:
            t.launches.append({"kernel": kernel_name, "lnc": lnc, "shape_only": shape_only})

    # ---- tracing ---------------------------------------------------------------------------
    def record(self, rec):
        for t in self.traces:
            t._add(dict(rec))

    # ---- scheduler -------------------------------------------------------------------------
    def wait_turn(self, i, pred=lambda: True):
        with self.cond:
            self.cond.wait_for(lambda: self.aborted is not None or (self.turn == i and pred()))
            if self.aborted is not None:
                raise LaunchAborted(f"instance {i}: sibling instance failed")

    def pass_turn(self, i):
        """Give the turn to the next unfinished instance (caller holds the lock)."""
        n = self.lnc
        for k in range(1, n + 1):
            j = (i + k) % n
            if j not in self.finished:
                self.turn = j
                break
        self.cond.notify_all()

    def finish(self, i, exc=None):
        with self.cond:
            self.finished.add(i)
            if exc is not None and self.aborted is None:
                self.aborted = exc
            if self.aborted is None and len(self.finished) < self.lnc and self.barrier_arrived:
                waiting = [j for j in self.barrier_arrived if j not in self.finished]
                if waiting:
                    self.aborted = NkiValidationError(
                        f"core_barrier: instance {i} finished while instance(s) {waiting} wait at a core_barrier "
                        f"it never reached (both instances must execute the same barriers)")
            if self.aborted is None and len(self.finished) < self.lnc and self.pipes:
                self.aborted = NkiValidationError(
                    f"sendrecv: instance {i} finished while its peer waits in sendrecv pipe(s) "
                    f"{sorted(self.pipes)}")
            self.pass_turn(i)

    # ---- shared HBM aliasing ---------------------------------------------------------------
    def shared_alloc(self, inst, shape, dtype, name):
        with self.lock:
            k = inst.shared_count
            inst.shared_count += 1
            if k < len(self.shared_allocs):
                st = self.shared_allocs[k]
                if st.shape != tuple(shape) or st.dtype != dtype:
                    raise NkiValidationError(
                        f"nl.ndarray: shared_hbm allocation #{k} of instance {inst.pid} is {dtype}{list(shape)} "
                        f"but instance {st.owner} allocated {st.dtype}{list(st.shape)} ('{st.name}'); shared-HBM "
                        f"tensors are matched across LNC instances by allocation order")
                return st, False
            st = Storage(SHARED_HBM, shape, dtype, name, with_data=not self.shape_only, owner=inst.pid)
            self.shared_hbm.allocate(st.nbytes, st.name)
            self.shared_allocs.append(st)
            return st, True


class Instance:
    """One program instance = one physical NeuronCore: its SBUF, PSUM, private HBM, registers."""

    def __init__(self, launch, pid):
        self.launch, self.pid = launch, pid
        self.shape_only = launch.shape_only
        self.sbuf = RangeAllocator(SBUF, hw.SBUF_PARTITION_BYTES, hw.SBUF_MIN_ALIGN)
        self.psum = RangeAllocator(PSUM, hw.PSUM_PARTITION_BYTES, hw.PSUM_MIN_ALIGN, bank=hw.PSUM_BANK_BYTES)
        self.private_hbm = HbmAccount(PRIVATE_HBM, hw.HBM_BYTES_PER_RANK)
        self.shared_count = 0
        self.act_regs = np.zeros(hw.PMAX, np.float32)   # ACT accumulator registers (ref §5.0)
        self.dve_regs = np.zeros(hw.PMAX, np.float32)   # DVE accumulator registers
        self.n_registers = 0
        self.n_alloc = 0

    def allocate(self, shape, dtype, buffer, name="", address=None):
        op = "nl.ndarray"
        shape = tuple(int(s) for s in shape)
        self.n_alloc += 1
        name = name or f"{buffer.value}{self.n_alloc}"     # deterministic default names (trace equality)
        if any(s <= 0 for s in shape) or not shape:
            raise ValueError(f"{op}: shape must be non-empty with positive dims, got {list(shape)}")
        if buffer == SHARED_HBM:
            if address is not None:
                raise NkiValidationError(f"{op}: address= applies to SBUF/PSUM tensors only")
            st, new = self.launch.shared_alloc(self, shape, dtype, name)
            if new:
                self._trace_alloc(st)
            return NkiTensor.whole(st)
        st = Storage(buffer, shape, dtype, name, with_data=not self.shape_only, owner=self.pid)
        if buffer == PRIVATE_HBM:
            if address is not None:
                raise NkiValidationError(f"{op}: address= applies to SBUF/PSUM tensors only")
            self.private_hbm.allocate(st.nbytes, st.name)
            attach_release(st, self.private_hbm.free, st.nbytes)
        else:
            if len(shape) < 2:
                raise NkiValidationError(f"{op}: {buffer.value} tensors are at least 2-D with the partition dim "
                                         f"first; got shape {list(shape)}")
            if shape[0] > hw.PMAX:
                raise NkiValidationError(f"{op}: '{st.name}' has {shape[0]} partitions, the partition dim is at "
                                         f"most {hw.PMAX}")
            poff, fixed = 0, None
            if address is not None:
                try:
                    poff, fixed = int(address[0]), int(address[1])
                except (TypeError, IndexError, ValueError):
                    raise TypeError(f"{op}: address must be (partition_offset, byte_offset), got {address!r}") from None
                if poff < 0 or poff + shape[0] > hw.PMAX:
                    raise NkiValidationError(f"{op}: '{st.name}' partitions [{poff}, {poff + shape[0]}) exceed "
                                             f"{hw.PMAX} partitions")
            alloc = self.sbuf if buffer == SBUF else self.psum
            lo = alloc.allocate(st.row_bytes, st.name, (poff, poff + shape[0]), fixed)
            st.address = (poff, lo)
            attach_release(st, alloc.free, lo)
        self._trace_alloc(st)
        return NkiTensor.whole(st)

    def _trace_alloc(self, st):
        if self.launch.traces:
            rec = {"inst": self.pid, "buf": st.id, "mem": st.kind.value, "name": st.name, "shape": list(st.shape),
                   "dtype": st.dtype, "bytes": st.nbytes, "address": list(st.address), "loc": call_site()}
            for t in self.launch.traces:
                t._alloc(rec)


def run_instance(launch, inst, fn, args, kwargs, results):
    _local.inst = inst
    exc = None
    try:
        launch.wait_turn(inst.pid)
        results[inst.pid] = fn(*args, **kwargs)
    except LaunchAborted as e:
        exc = e
    except BaseException as e:    # noqa: BLE001 -- reported by the launcher
        exc = e
        results[("exc", inst.pid)] = e
    finally:
        _local.inst = None
        launch.finish(inst.pid, exc if not isinstance(exc, LaunchAborted) else None)


def run_single(launch, fn, args, kwargs):
    inst = launch.instances[0]
    prev = getattr(_local, "inst", None)
    _local.inst = inst
    try:
        return fn(*args, **kwargs)
    finally:
        _local.inst = prev
