"""Launch and instance state: ranks, program instances, their memories, and the deterministic scheduler.

A launch is a *world* of ``tp`` ranks (logical NeuronCores) x ``lnc`` program instances (physical cores).
Every instance runs as a thread, but only one runs at a time and the turn passes only at
synchronisation points (``core_barrier``, ``sendrecv``, ``nki.collectives.*``) or when an instance
finishes. The next instance is picked round-robin in global order (rank-major, then program id)
among those that can proceed, so results are bit-identical run to run. A kernel that races on
shared HBM without a barrier still gets a deterministic (but not hardware-guaranteed) answer.

When no instance can proceed (every unfinished instance waits at a synchronisation point nobody
else will reach) the launch fails at once with a message naming every waiter and what it waits
for; a wall-clock ``timeout`` covers instances that never reach a synchronisation point at all.
"""
import contextlib
import os
import sys
import threading
import time

import numpy as np

from . import blas, controlflow, frontend, hbm_order, hw, int32, trace
from .errors import LaunchAborted, NkiValidationError
from .memory import (PSUM, SBUF, PRIVATE_HBM, SHARED_HBM, HbmAccount, RangeAllocator, Storage,
                     attach_release)
from .site import _local, _where, call_site, kernel_site
from .tensor import NkiTensor


class LaunchTimeout(NkiValidationError):
    """The launch exceeded its wall-clock timeout (a stuck collective / barrier / endless loop)."""


# Engines compute in IEEE fp32 where overflow/NaN are values, not errors: every launch runs its kernel under
# np.errstate(all="ignore") (thread-local), so instructions need no per-op errstate (which costs ~10 us each).
QUIET = contextlib.nullcontext()

DEFAULT_TIMEOUT = float(os.environ.get("NKISIM_TIMEOUT", "600"))   # seconds of wall clock per launch


class World:
    """One launch: ``tp`` ranks x ``lnc`` program instances and the scheduler they share.

    ``comms`` is True when the launch initialised collectives (``nkisim.launch``); a plain
    ``kernel(...)`` / ``kernel[2](...)`` is a single-process launch in which, as on hardware,
    ``nki.collectives`` cannot run (trn2-costs.md: "comms uninitialised -> NEFF load failure")."""

    def __init__(self, kernel_name, tp, lnc, ndim, shape_only, comms=False, timeout=None):
        self.kernel_name, self.tp, self.lnc, self.ndim = kernel_name, tp, lnc, ndim
        self.shape_only, self.comms = shape_only, comms
        self.timeout = DEFAULT_TIMEOUT if timeout is None else timeout
        self.lock = threading.Lock()
        self.cond = self.lock      # ``with world.cond:`` guards the scheduler / rendezvous state
        self.turn = 0
        self.finished = set()
        self.aborted = None
        self.waiting = {}          # gid -> (predicate, describe(), call site)
        self.collectives = {}      # rendezvous table of nkisim.collectives
        self.cc_ids = 0
        self.traces = trace.current()
        self.lint = True           # walk the helper frames for the front-end lint (jit.run_world decides)
        self.register_values = None    # provider of register_load values (jit.register_values)
        self.ranks = [Launch(self, r) for r in range(tp)]
        self.instances = [i for L in self.ranks for i in L.instances]
        for g, i in enumerate(self.instances):
            i.gid = g
        self.trace_rec = {"kernel": kernel_name, "tp": tp, "lnc": lnc, "shape_only": shape_only}
        self.trace_slots = []      # (trace, index of this launch in trace.launches): records carry "launch"
        for t in self.traces:
            self.trace_slots.append((t, len(t.launches)))
            t.launches.append(self.trace_rec)

    def record_memory(self):
        """High-water marks, for the trace: on-chip bytes per partition (highest allocated address), HBM bytes."""
        if self.traces:
            self.trace_rec["memory"] = [
                {"rank": i.rank, "inst": i.pid, "sbuf_peak_bytes_per_partition": i.sbuf.peak,
                 "psum_peak_bytes_per_partition": i.psum.peak, "private_hbm_peak_bytes": i.private_hbm.peak,
                 "shared_hbm_peak_bytes": i.launch.shared_hbm.peak} for i in self.instances]

    def name(self, inst):
        return f"rank {inst.launch.rank} core {inst.pid}" if self.tp > 1 else f"instance {inst.pid}"

    # ---- scheduler (every method below except start/finish is called with self.lock held) ------
    # Hand-off is direct: every instance sleeps on its own binary semaphore (a Lock held while it sleeps) and
    # the instance giving up the turn wakes exactly the next one, so a switch costs one thread wake-up (a
    # Condition.notify_all woke every instance, which then fought for the GIL just to go back to sleep).
    def _sleep(self, inst, handoff=None):
        """Sleep until woken (self.lock held on entry and on return). ``handoff`` (claimed by _claim) is woken
        only after self.lock is released, so it neither wakes into a held lock nor into a GIL its waker still
        needs for long: the waker blocks right after."""
        inst.sleeping = True
        self.lock.release()
        try:
            if handoff is not None:
                handoff.wake.release()
            inst.wake.acquire()
        finally:
            self.lock.acquire()

    def _claim(self, inst):
        """Mark a sleeping instance as woken; returns it (the caller releases its wake lock) or None."""
        if inst.sleeping:
            inst.sleeping = False
            return inst
        return None

    def _wake(self, inst):
        if inst.sleeping:
            inst.sleeping = False
            inst.wake.release()

    def wake_all(self):
        for i in self.instances:
            self._wake(i)

    def start(self, inst):
        with self.lock:
            while self.aborted is None and self.turn != inst.gid:
                self._sleep(inst)
            if self.aborted is not None:
                raise LaunchAborted(f"{self.name(inst)}: another instance failed")

    def block(self, inst, pred, describe):
        """Give up the turn until ``pred()`` holds and the scheduler picks this instance again."""
        g = inst.gid
        self.waiting[g] = (pred, describe, call_site())
        nxt = self._pass(g)
        while self.aborted is None and self.turn != g:
            self._sleep(inst, nxt)
            nxt = None
        if nxt is not None:
            nxt.wake.release()
        self.waiting.pop(g, None)
        if self.aborted is not None:
            raise LaunchAborted(f"{self.name(inst)}: another instance failed")

    def _pass(self, g):
        """Give the turn to the next instance (round-robin) that can proceed; returns that instance if it must be
        woken (the caller wakes it once it has released self.lock), else None."""
        if self.aborted is not None:
            self.turn = -1
            self.wake_all()
            return None
        n = len(self.instances)
        for k in range(1, n + 1):
            j = (g + k) % n
            if j in self.finished:
                continue
            w = self.waiting.get(j)
            if w is None or w[0]():
                self.turn = j
                return self._claim(self.instances[j])
        if len(self.finished) < n:
            self.aborted = NkiValidationError(
                f"{self.kernel_name}: deadlock, no program instance can proceed (tp={self.tp}, lnc={self.lnc}):\n"
                + self.describe_waits())
            for L in self.ranks:           # cores that ran different runtime loops: that is the cause
                msg = controlflow.divergence(L)
                if msg is not None:
                    self.aborted = NkiValidationError(msg + "\n(this left the launch deadlocked:\n"
                                                      + self.describe_waits() + ")")
                    break
        self.turn = -1
        self.wake_all()
        return None

    def describe_waits(self):
        lines = []
        for g in sorted(self.waiting):
            _, describe, loc = self.waiting[g]
            lines.append(f"  {self.name(self.instances[g])} at {loc}: {describe()}")
        return "\n".join(lines)

    def finish(self, inst, exc=None):
        with self.lock:
            self.finished.add(inst.gid)
            if exc is not None and self.aborted is None:
                self.aborted = exc
            nxt = self._pass(inst.gid)
        if nxt is not None:
            nxt.wake.release()

    def status_of(self, inst):
        """'finished' / 'waiting at <loc>' / 'running' (for messages)."""
        if inst.gid in self.finished:
            return "finished without reaching it"
        w = self.waiting.get(inst.gid)
        if w is not None:
            return f"waiting at {w[2]} ({w[1]()})"
        return "not there yet"


class Launch:
    """One rank (a logical NeuronCore): its shared HBM and its ``lnc`` program instances."""

    def __init__(self, world, rank):
        self.world, self.rank = world, rank
        self.kernel_name, self.lnc, self.ndim = world.kernel_name, world.lnc, world.ndim
        self.shape_only = world.shape_only
        self.shared_allocs = []
        self.shared_hbm = HbmAccount(SHARED_HBM, hw.HBM_BYTES_PER_RANK)
        self.alloc_lock = threading.Lock()
        self.cond = world.cond
        self.barrier_arrived = {}       # generation bookkeeping for core_barrier
        self.barrier_gen = 0
        self.barrier_data = {}          # pid -> storage its pending core_barrier names (hbm_order)
        self.hbm_phase = {}             # storage id -> (storage, per-core DMA access logs) since its last barrier
        self.pipes = {}                 # sendrecv rendezvous
        self.constants = {}             # nl.shared_constant: storage id -> (data digest, core, site) of its first core
        self.traces = world.traces
        self.instances = [Instance(self, i) for i in range(world.lnc)]

    # ---- tracing ---------------------------------------------------------------------------
    def record(self, rec):
        """Append an instruction record to every active trace; returns [(trace, stored record), ...]."""
        rec["rank"] = self.rank
        slots = self.world.trace_slots
        if len(slots) == 1:                 # the usual single capture: no copy
            t, rec["launch"] = slots[0]
            t._add(rec)
            return [(t, rec)]
        out = []
        for t, li in slots:
            r = dict(rec)
            r["launch"] = li
            t._add(r)
            out.append((t, r))
        return out

    # ---- shared HBM aliasing ---------------------------------------------------------------
    def shared_alloc(self, inst, shape, dtype, name):
        with self.alloc_lock:
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


_BUFNAME = {b: b.value for b in (SBUF, PSUM, PRIVATE_HBM, SHARED_HBM)}


class Instance:
    """One program instance = one physical NeuronCore: its SBUF, PSUM, private HBM, registers."""

    def __init__(self, launch, pid):
        self.launch, self.pid = launch, pid
        self.gid = 0
        self.shape_only = launch.shape_only
        self.sbuf = RangeAllocator(SBUF, hw.SBUF_PARTITION_BYTES, hw.SBUF_MIN_ALIGN)
        self.psum = RangeAllocator(PSUM, hw.PSUM_PARTITION_BYTES, hw.PSUM_MIN_ALIGN, bank=hw.PSUM_BANK_BYTES)
        self.private_hbm = HbmAccount(PRIVATE_HBM, hw.HBM_BYTES_PER_RANK)
        self.shared_count = 0
        self.act_regs = np.zeros(hw.PMAX, np.float32)   # ACT accumulator registers (ref §5.0)
        self.dve_regs = np.zeros(hw.PMAX, np.float32)   # DVE accumulator registers
        self.live_registers = 0                         # live register_alloc'd VirtualRegisters (<= 64)
        self.reg_ids = 0                                # trace names of registers (common.reg_id)
        self.loops = ()                                 # ids of the enclosing runtime loops (innermost last)
        self.loop_regs = ()                             # registers bounding them (traced as reg_reads)
        self.n_loops = 0
        self.loop_events = 0                            # runtime-loop entries + exits so far (PSUM liveness rule)
        self.loop_log = []                              # runtime loops run, in order (nkisim/controlflow.py)
        self.no_reorder = []                            # call sites of the enclosing nl.no_reorder() blocks
        self.loop_iters = ()                            # ((loop id, iteration), ...) traced as "loop" (outer first)
        self.traced = None                              # [(trace, record)] of the last traced instruction
        self.last_recs = None                           # trace records of the last instruction (Instruction)
        self.identities = {}                            # nl.shared_identity_matrix: (n, dtype) -> tensor
        self.lint_seen = {}                             # frames walked by the front-end lint (frontend.check_stack)
        self.lint_last = None                           # (frame, code, caller, caller code) of the last ISA call
        self.n_alloc = 0
        self.cc_seq = {}                                # collective call counters per rank-list
        self.wake = threading.Lock()                    # held while the instance sleeps (see World._sleep)
        self.wake.acquire()
        self.sleeping = False

    @property
    def rank(self):
        return self.launch.rank

    @property
    def world(self):
        return self.launch.world

    def allocate(self, shape, dtype, buffer, name="", address=None):
        op = "nl.ndarray"
        for s in shape:
            if type(s) is not int:
                shape = tuple(int(s) for s in shape)
                break
        self.n_alloc += 1
        explicit = bool(name)
        if not explicit:        # deterministic default names (trace equality); no enum hashing (a Python call)
            name = ("sbuf" if buffer is SBUF else "psum" if buffer is PSUM else _BUFNAME[buffer]) + str(self.n_alloc)
        if not shape or min(shape) <= 0:
            raise ValueError(f"{op}: shape must be non-empty with positive dims, got {list(shape)}")
        if max(shape) > hw.INT32_MAX:
            int32.check_ints(shape, f"{op}: shape")
        if buffer is SHARED_HBM:
            if address is not None:
                raise NkiValidationError(f"{op}: address= applies to SBUF/PSUM tensors only")
            st, new = self.launch.shared_alloc(self, shape, dtype, name)
            if new:
                int32.check_size(st)
            st.named = st.named or explicit
            if new and not explicit:
                st.site = kernel_site()
            if new:
                self._trace_alloc(st)
            return NkiTensor.whole(st)
        if len(shape) > hw.VIEW_MAX_DIMS and (buffer is SBUF or buffer is PSUM):
            raise NkiValidationError(f"{op}: an on-chip tensor has at most {hw.VIEW_MAX_DIMS} dims (partition + "
                                     f"{hw.AP_MAX_FREE_DIMS} free; SDK-LG 'Tensor Values': a view is 'a strided access "
                                     f"pattern with up to 5 dimensions'), got {list(shape)}: merge free dims")
        st = Storage(buffer, shape, dtype, name, not self.shape_only, self.pid)
        st.named = explicit
        if not explicit:
            st.site = kernel_site()
        if self.loops:
            st.loops = self.loops
        if buffer is PRIVATE_HBM:
            int32.check_size(st)
            if address is not None:
                raise NkiValidationError(f"{op}: address= applies to SBUF/PSUM tensors only")
            self.private_hbm.allocate(st.nbytes, st.name)
            attach_release(st, self.private_hbm.free, st.nbytes)
        else:
            if len(shape) < 2:
                raise NkiValidationError(f"{op}: {buffer.value} tensors are at least 2-D with the partition dim "
                                         f"first; got shape {list(shape)}")
            if shape[0] > hw.PMAX:
                raise NkiValidationError(f"{op}: {st.describe()} has {shape[0]} partitions, the partition dim is at "
                                         f"most {hw.PMAX}")
            poff, fixed = 0, None
            if address is not None:
                try:
                    poff, fixed = int(address[0]), int(address[1])
                except (TypeError, IndexError, ValueError):
                    raise TypeError(f"{op}: address must be (partition_offset, byte_offset), got {address!r}") from None
                if poff < 0 or poff + shape[0] > hw.PMAX:
                    raise NkiValidationError(f"{op}: {st.describe()} partitions [{poff}, {poff + shape[0]}) exceed "
                                             f"{hw.PMAX} partitions")
            alloc = self.sbuf if buffer is SBUF else self.psum
            lo = alloc.allocate(st.row_bytes, name, (poff, poff + shape[0]), fixed, st.site)
            st.address = (poff, lo)
            st.release = (alloc.free, lo, poff)
        if self.launch.traces:
            self._trace_alloc(st)
        return NkiTensor.whole(st)

    def _trace_alloc(self, st):
        if self.launch.traces:
            rec = {"rank": self.launch.rank, "inst": self.pid, "buf": st.id, "mem": st.kind.value, "name": st.name,
                   "shape": list(st.shape), "dtype": st.dtype, "bytes": st.nbytes, "address": list(st.address),
                   "loc": call_site()}
            for t, li in self.world.trace_slots:
                r = dict(rec)
                r["launch"] = li
                t._alloc(r)


def _run_instance(world, inst, fn, args, kwargs, results):
    _local.inst = inst
    exc = None
    try:
        world.start(inst)
        with blas.single_thread(), np.errstate(all="ignore"):
            results[inst.gid] = fn(*args, **kwargs)
    except LaunchAborted:
        pass
    except BaseException as e:    # noqa: BLE001 -- reported by the launcher
        exc = e
    finally:
        _local.inst = None
        world.finish(inst, exc)


def run(world, fn, per_rank_args, per_rank_kwargs):
    """Run every instance of the world; returns the value returned by program 0 of each rank."""
    _check_lnc_env(world)
    frontend.check_launch(fn, per_rank_args, per_rank_kwargs)     # arguments, closure, referenced code
    insts = world.instances
    if len(insts) == 1:
        inst = insts[0]
        prev = getattr(_local, "inst", None)
        _local.inst = inst
        try:
            with blas.single_thread(), np.errstate(all="ignore"):
                return [fn(*per_rank_args[0], **per_rank_kwargs[0])]
        finally:
            _local.inst = prev
            world.record_memory()
    results = {}
    threads = [threading.Thread(target=_run_instance,
                                args=(world, i, fn, per_rank_args[i.rank], per_rank_kwargs[i.rank], results),
                                name=f"nkisim-{world.kernel_name}-r{i.rank}c{i.pid}", daemon=True) for i in insts]
    for t in threads:
        t.start()
    deadline = time.monotonic() + world.timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
        if t.is_alive():
            _timeout(world, threads)
            break
    world.record_memory()
    if world.aborted is not None:
        raise world.aborted
    controlflow.check_world(world)
    hbm_order.check_world(world)
    return [results.get(L.instances[0].gid) for L in world.ranks]


def _check_lnc_env(world):
    """SDK-NKI jit: "The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable set for the Neuron
    Runtime. Mismatching the two will cause a runtime error" (checked when the variable is set)."""
    env = os.environ.get("NEURON_LOGICAL_NC_CONFIG")
    if env is None or env.strip() == "":
        return
    try:
        want = int(env)
    except ValueError:
        raise NkiValidationError(f"{world.kernel_name}: NEURON_LOGICAL_NC_CONFIG={env!r} is not an integer") from None
    if want != world.lnc:
        raise NkiValidationError(f"{world.kernel_name}: launched at LNC={world.lnc} but NEURON_LOGICAL_NC_CONFIG={want}; "
                                 f"'The LNC value must match the NEURON_LOGICAL_NC_CONFIG environment variable ... "
                                 f"Mismatching the two will cause a runtime error' (SDK nki.jit): launch kernel[{want}] "
                                 f"or change the variable")


def _timeout(world, threads):
    frames = sys._current_frames()
    with world.cond:
        running = [f"  {world.name(i)} running at {_where(frames.get(t.ident))}"
                   for i, t in zip(world.instances, threads)
                   if t.is_alive() and i.gid not in world.waiting and i.gid not in world.finished]
        if world.aborted is None:
            world.aborted = LaunchTimeout(
                f"{world.kernel_name}: launch did not finish within timeout={world.timeout:g} s (tp={world.tp}, "
                f"lnc={world.lnc}); a synchronisation point is never reached:\n"
                + "\n".join(running + ([world.describe_waits()] if world.waiting else [])))
        world.wake_all()
    for t in threads:
        t.join(0.5)

