"""Memories: per-allocation byte storage, written-tracking, and capacity accounting.

Each ``nl.ndarray`` allocation is one :class:`Storage` (a flat little-endian byte array in row-major
order of its allocation shape, plus a per-byte "written" mask). On-chip storages (SBUF/PSUM) also get
a placement ``(partition_offset, byte_offset)`` from a per-instance allocator so capacity, PSUM bank
boundaries and start partitions can be checked. Allocations are released when the last Python
reference to the tensor goes away (the interpreter's stand-in for the compiler's liveness analysis).
"""
import bisect
import enum
import itertools
import linecache
import os
import re
import threading

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


_ASSIGNED = re.compile(r"\s*([A-Za-z_][\w.]*(?:\[[^=]*?\])*)\s*=[^=]")


def _assigned_name(filename, line):
    """The assignment target on a source line (``x = nl.ndarray(...)`` -> "x", ``b["k"] = ...`` -> 'b["k"]'),
    or None when the line is not a simple assignment."""
    m = _ASSIGNED.match(linecache.getline(filename, line))
    return m.group(1) if m else None


def label(name, site, desc=""):
    """A tensor as error messages show it: its name= if the kernel gave one (``site`` None); else the variable
    the kernel assigned it to and where (``'acc' (sbuf float32[128, 512], allocated at k.py:12)``), so that no
    message shows nkisim's internal default names (those stay in traces, where they must be deterministic)."""
    if site is None:
        return f"'{name}' ({desc})" if desc else f"'{name}'"
    filename, line = site
    var = _assigned_name(filename, line) or name
    where = f"allocated at {os.path.basename(filename)}:{line}"
    return f"'{var}' ({desc}, {where})" if desc else f"'{var}' ({where})"


def _next_id():
    return next(_ids)          # itertools.count is atomic under the GIL


class Storage:
    """One allocation. ``data``/``written`` are None in shape-only mode."""
    __slots__ = ("id", "kind", "name", "shape", "dtype", "nbytes", "row_bytes", "partitions", "address",
                 "data", "written", "mm", "owner", "dirty", "is_input", "named", "cc", "full", "release",
                 "onchip", "nelems", "cstrides", "mm_state", "fresh", "psum", "loops", "epoch", "site", "known",
                 "shared", "__weakref__")

    def __init__(self, kind, shape, dtype, name="", with_data=True, owner=None, fill=True):
        self.id = _next_id()
        self.kind = kind
        self.name = name or f"t{self.id}"
        self.shape = shape if type(shape) is tuple else tuple(int(s) for s in shape)
        self.dtype = dtype
        n = 1
        for s in self.shape:
            n *= s
        self.nelems = n
        self.nbytes = n * dtypes.itemsize(dtype)
        self.onchip = kind in ON_CHIP
        self.psum = kind is PSUM
        self.loops = ()               # runtime loops enclosing the allocation (Instance.loops at nl.ndarray)
        self.epoch = None             # PSUM: Instance.loop_events at its last access (isa.common._psum_loop_rules)
        self.site = None              # (filename, line) of the kernel line that allocated an unnamed tensor
        self.known = None             # shape-only: {element index: value} DMA-copied from a real integer input
        self.shared = False           # nl.shared_identity_matrix's constant (the compiler may share its storage)
        self.cstrides = None          # row-major byte strides (NkiTensor.whole)
        self.mm_state = False         # PSUM "last written by nc_matmul": True/False everywhere, None = mixed
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
        # PSUM "last written by nc_matmul" per byte; allocated (mm_array) and meaningful only while mm_state is
        # None (mixed); uniform states live in mm_state alone.
        self.mm = None
        self.release = None
        # New memory holds the "never written" sentinel and an all-False written mask. Both are materialised
        # lazily (``fresh``, see materialize()): a first write that covers the whole tensor needs neither, and
        # a storage written whole (``full``) may have no mask array at all (``written`` None; written_array()).
        self.fresh = False
        if with_data:
            self.data = np.empty(self.nbytes, dtype=np.uint8)
            if fill:
                self.written = None
                self.fresh = True
            else:
                self.written = np.zeros(self.nbytes, dtype=np.bool_)
        else:
            self.data = None
            self.written = None

    def describe(self, dtype=None, shape=None):
        """How error messages name the tensor, see :func:`label`."""
        desc = f"{self.kind.value} {dtype or self.dtype}{list(self.shape if shape is None else shape)}"
        return label(self.name, self.site, desc)

    def __del__(self):
        # the allocation is released when the last Python reference goes (cheaper than weakref.finalize)
        r = self.release
        if r is not None:
            self.release = None
            try:
                r[0](*r[1:])
            except Exception:       # noqa: BLE001 -- interpreter shutdown
                pass


_TEMPLATES = {}       # dtype -> uint8 bytes of the "never written" sentinel (NaN / 4), grown on demand


def materialize(st):
    """Give a fresh storage its initial content: the sentinel (NaN for floats, 4 for ints and packed types,
    as the official simulator, SDK-SIM) and an all-False written mask. Every access to ``data`` / ``written``
    of a storage that may be fresh goes through tensor.raw / tensor.mask (or calls this first)."""
    if st.fresh:
        st.fresh = False
        st.data[...] = _template(st.dtype, st.nbytes)
        st.written = np.zeros(st.nbytes, dtype=np.bool_)


def written_array(st):
    """The per-byte written mask of a storage with data, allocated on demand (all True for a full storage)."""
    w = st.written
    if w is None:
        if st.fresh:
            materialize(st)
        else:
            st.written = np.ones(st.nbytes, dtype=np.bool_) if st.full else np.zeros(st.nbytes, dtype=np.bool_)
        w = st.written
    return w


def mm_array(st):
    """The PSUM per-byte matmul mask, allocated on demand and filled with the current uniform state."""
    if st.mm is None:
        st.mm = np.empty(st.nbytes, dtype=np.bool_)
    if st.mm_state is not None:
        st.mm.fill(st.mm_state)
    return st.mm


def _template(dtype, nbytes):
    t = _TEMPLATES.get(dtype)
    if t is None or t.size < nbytes:
        n = max(nbytes, 1 << 16, 0 if t is None else 2 * t.size)
        isz = dtypes.itemsize(dtype)
        n = -(-n // isz) * isz
        t = np.empty(n, dtype=np.uint8)
        typed = t.view(dtypes.storage(dtype))
        if dtypes.is_float(dtype) and dtype not in dtypes.PACKED:
            typed[...] = np.nan
        else:
            typed[...] = hw.INT_SENTINEL
        _TEMPLATES[dtype] = t
    return t[:nbytes]


class RangeAllocator:
    """First-fit allocator over the per-partition byte range of SBUF or PSUM (all partitions share
    one byte range per tensor; tensors are placed at partition offset 0 unless ``address=`` says
    otherwise).

    First fit = the lowest candidate start (0 or the end of a live tensor, aligned, PSUM bank rules applied)
    whose range overlaps no live tensor sharing a partition. It is found by one sweep over the live tensors
    sorted by start (``_order``): the candidate moves past every conflicting tensor; the sweep result equals
    the lowest fitting candidate because the adjustment (align up, move to the next bank) is monotonic and
    idempotent."""

    def __init__(self, kind, capacity, align=1, bank=None):
        self.kind, self.capacity, self.align, self.bank = kind, capacity, align, bank
        self.live = {}     # (start, first partition) -> (end, (name, site), partition range)
        self._order = []   # sorted (start, end, p0, p1) of the live tensors
        self.lock = threading.Lock()
        self.peak = 0

    def _adjust(self, s, size):
        a, b = self.align, self.bank
        if a > 1:
            s = -(-s // a) * a
        if b:
            if size <= b:
                if s // b != (s + size - 1) // b:      # keep a <= 1-bank tensor inside one bank
                    s = -(-s // b) * b
            else:
                s = -(-s // b) * b
        return s

    def _fits(self, lo, hi, prange):
        for (s, _), (e, _, pr) in self.live.items():
            if lo < e and s < hi and prange[0] < pr[1] and pr[0] < prange[1]:
                return False
        return True

    def _first_fit(self, size, prange):
        q0, q1 = prange
        if self.align == 1 and not self.bank:          # SBUF: no adjustment
            cand = 0
            for s, e, p0, p1 in self._order:
                if e <= cand or p1 <= q0 or q1 <= p0:
                    continue
                if s >= cand + size:
                    break
                cand = e
        else:
            adjust = self._adjust
            cand = adjust(0, size)
            for s, e, p0, p1 in self._order:
                if e <= cand or p1 <= q0 or q1 <= p0:
                    continue
                if s >= cand + size:
                    break
                cand = adjust(e, size)
        return cand if cand + size <= self.capacity else None

    def allocate(self, size, name, prange, fixed=None, site=None):
        with self.lock:
            if size > self.capacity:
                raise AllocationError(
                    f"nl.ndarray: {label(name, site)} needs {size:,} B per partition in {self.kind.value}, which has "
                    f"{self.capacity:,} B per partition")
            if fixed is not None:
                lo = fixed
                if self.bank and lo % self.bank:
                    raise AllocationError(f"nl.ndarray: {label(name, site)} address byte offset {lo} in psum must start "
                                          f"at a bank boundary (multiple of {self.bank} B)")
                if lo < 0 or lo + size > self.capacity:
                    raise AllocationError(f"nl.ndarray: {label(name, site)} at byte offset {lo} with {size:,} B per "
                                          f"partition exceeds {self.kind.value} capacity {self.capacity:,} B")
                if not self._fits(lo, lo + size, prange):
                    raise AllocationError(f"nl.ndarray: {label(name, site)} at byte offset {lo} overlaps a live "
                                          f"{self.kind.value} tensor: {self._summary()}")
            else:
                lo = self._first_fit(size, prange)
                if lo is None:
                    used = sum(e - s for (s, _), (e, _, _) in self.live.items())
                    raise AllocationError(
                        f"nl.ndarray: cannot allocate {label(name, site)} ({size:,} B per partition) in {self.kind.value}: "
                        f"capacity {self.capacity:,} B per partition, {used:,} B live in {len(self.live)} "
                        f"tensors ({self._summary()})")
            self.live[(lo, prange[0])] = (lo + size, (name, site), prange)
            bisect.insort(self._order, (lo, lo + size, prange[0], prange[1]))
            if lo + size > self.peak:
                self.peak = lo + size
            return lo

    def _summary(self, k=6):
        items = sorted(self.live.items(), key=lambda kv: -(kv[1][0] - kv[0][0]))[:k]
        return ", ".join(f"{label(*n)}@{s}:{e - s}B" for (s, _), (e, n, _) in items) + (" ..." if len(self.live) > k
                                                                                       else "")

    def free(self, start, p0=0):
        with self.lock:
            v = self.live.pop((start, p0), None)
            if v is not None:
                o = self._order
                i = bisect.bisect_left(o, (start, v[0], v[2][0], v[2][1]))
                del o[i]


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
    storage.release = (fn,) + args
