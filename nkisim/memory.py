"""Memories: per-allocation byte storage, written-tracking, and capacity accounting.

Each ``nl.ndarray`` allocation is one :class:`Storage` (a flat little-endian byte array in row-major
order of its allocation shape, plus a per-byte "written" mask). On-chip storages (SBUF/PSUM) also get
a placement ``(partition_offset, byte_offset)`` from a per-instance allocator so capacity, PSUM bank
boundaries and start partitions can be checked. Allocations are released when the last Python
reference to the tensor goes away (the interpreter's stand-in for the compiler's liveness analysis).
"""
import enum
import itertools
import threading
import weakref

import numpy as np

from . import dtypes, hw
from .errors import AllocationError


class MemoryRegion(enum.Enum):
    """Buffers (``nl.sbuf``, ``nl.psum``, ``nl.private_hbm`` (= ``nl.hbm``), ``nl.shared_hbm``)."""
    sbuf = "sbuf"
    psum = "psum"
    private_hbm = "private_hbm"
    shared_hbm = "shared_hbm"

    def __repr__(self):
        return f"nl.{self.value}"

    __str__ = __repr__


SBUF, PSUM, PRIVATE_HBM, SHARED_HBM = (MemoryRegion.sbuf, MemoryRegion.psum,
                                       MemoryRegion.private_hbm, MemoryRegion.shared_hbm)
ON_CHIP = (SBUF, PSUM)
HBM = (PRIVATE_HBM, SHARED_HBM)

_ids = itertools.count(1)
_id_lock = threading.Lock()


def _next_id():
    with _id_lock:
        return next(_ids)


class Storage:
    """One allocation. ``data``/``written`` are None in shape-only mode."""
    __slots__ = ("id", "kind", "name", "shape", "dtype", "nbytes", "row_bytes", "partitions", "address",
                 "data", "written", "mm", "owner", "dirty", "is_input", "named", "cc", "full", "__weakref__")

    def __init__(self, kind, shape, dtype, name="", with_data=True, owner=None, fill=True):
        self.id = _next_id()
        self.kind = kind
        self.name = name or f"t{self.id}"
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        n = 1
        for s in self.shape:
            n *= s
        self.nbytes = n * dtypes.itemsize(dtype)
        if kind in ON_CHIP:
            self.partitions = self.shape[0]
            self.row_bytes = self.nbytes // max(self.partitions, 1)
        else:
            self.partitions = None
            self.row_bytes = self.nbytes
        self.address = (0, 0)
        self.owner = owner
        self.dirty = False
        self.is_input = False
        self.named = False            # an explicit name= (collective HBM operands need one, see collectives.py)
        self.cc = False               # operand of a collective (may then not be a kernel output)
        self.full = False             # every byte written (monotonic: written bits are never cleared)
        self.mm = None
        if with_data:
            self.data = np.empty(self.nbytes, dtype=np.uint8)
            if fill:
                typed = self.data.view(dtypes.storage(dtype)) if self.nbytes else self.data
                if dtypes.is_float(dtype) and dtype not in dtypes.PACKED:
                    typed[...] = np.nan
                else:
                    typed[...] = hw.INT_SENTINEL
            self.written = np.zeros(self.nbytes, dtype=np.bool_)
            if kind == PSUM:
                self.mm = np.zeros(self.nbytes, dtype=np.bool_)   # "last written by nc_matmul"
        else:
            self.data = None
            self.written = None

    def describe(self):
        return f"'{self.name}' ({self.kind.value} {self.dtype}{list(self.shape)})"


class RangeAllocator:
    """First-fit allocator over the per-partition byte range of SBUF or PSUM (all partitions share
    one byte range per tensor; tensors are placed at partition offset 0 unless ``address=`` says
    otherwise)."""

    def __init__(self, kind, capacity, align=1, bank=None):
        self.kind, self.capacity, self.align, self.bank = kind, capacity, align, bank
        self.live = {}     # start -> (end, name, partition range)
        self.lock = threading.Lock()
        self.peak = 0

    def _fits(self, lo, hi, prange):
        for s, (e, _, pr) in self.live.items():
            if lo < e and s < hi and prange[0] < pr[1] and pr[0] < prange[1]:
                return False
        return True

    def _candidates(self, size):
        a, b = self.align, self.bank
        starts = [0] + sorted(e for e, _, _ in self.live.values())
        for s in starts:
            s = -(-s // a) * a
            if b:
                if size <= b:
                    if s // b != (s + size - 1) // b:      # keep a <= 1-bank tensor inside one bank
                        s = -(-s // b) * b
                else:
                    s = -(-s // b) * b
            yield s

    def allocate(self, size, name, prange, fixed=None):
        with self.lock:
            if size > self.capacity:
                raise AllocationError(
                    f"nl.ndarray: '{name}' needs {size:,} B per partition in {self.kind.value}, which has "
                    f"{self.capacity:,} B per partition")
            if fixed is not None:
                lo = fixed
                if self.bank and lo % self.bank:
                    raise AllocationError(f"nl.ndarray: '{name}' address byte offset {lo} in psum must start "
                                          f"at a bank boundary (multiple of {self.bank} B)")
                if lo < 0 or lo + size > self.capacity:
                    raise AllocationError(f"nl.ndarray: '{name}' at byte offset {lo} with {size:,} B per "
                                          f"partition exceeds {self.kind.value} capacity {self.capacity:,} B")
                if not self._fits(lo, lo + size, prange):
                    raise AllocationError(f"nl.ndarray: '{name}' at byte offset {lo} overlaps a live "
                                          f"{self.kind.value} tensor: {self._summary()}")
            else:
                lo = None
                for s in self._candidates(size):
                    if s + size <= self.capacity and self._fits(s, s + size, prange):
                        lo = s
                        break
                if lo is None:
                    used = sum(e - s for s, (e, _, _) in self.live.items())
                    raise AllocationError(
                        f"nl.ndarray: cannot allocate '{name}' ({size:,} B per partition) in {self.kind.value}: "
                        f"capacity {self.capacity:,} B per partition, {used:,} B live in {len(self.live)} "
                        f"tensors ({self._summary()})")
            self.live[lo] = (lo + size, name, prange)
            self.peak = max(self.peak, max(e for e, _, _ in self.live.values()))
            return lo

    def _summary(self, k=6):
        items = sorted(self.live.items(), key=lambda kv: -(kv[1][0] - kv[0]))[:k]
        return ", ".join(f"{n}@{s}:{e - s}B" for s, (e, n, _) in items) + (" ..." if len(self.live) > k else "")

    def free(self, start):
        with self.lock:
            self.live.pop(start, None)


class HbmAccount:
    """HBM capacity accounting (no placement)."""

    def __init__(self, kind, capacity):
        self.kind, self.capacity, self.used, self.lock = kind, capacity, 0, threading.Lock()
        self.peak = 0

    def allocate(self, size, name):
        with self.lock:
            if self.used + size > self.capacity:
                raise AllocationError(f"nl.ndarray: cannot allocate '{name}' ({size:,} B) in {self.kind.value}: "
                                      f"{self.used:,} of {self.capacity:,} B in use")
            self.used += size
            self.peak = max(self.peak, self.used)

    def free(self, size):
        with self.lock:
            self.used -= size


def attach_release(storage, fn, *args):
    weakref.finalize(storage, fn, *args)
