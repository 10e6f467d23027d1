"""Dependency graph of a trace: RAW, WAR and WAW hazards between instructions, from the regions each
instruction reads and writes (buffer id or physical address + partition range + byte range).

Bookkeeping is per core, per buffer (or physical memory) and per quadrant of partitions: an
:class:`IntervalMap` over the byte axis holds, for each disjoint byte segment, the last writer and the latest
reader *per stream*. A stream that executes in order (a compute engine) needs only its latest reader for WAR;
a DMA completes out of order, so the timeline gives every DMA a stream of its own. Dependencies on the
instruction's own stream are implied and dropped by the caller. Cost is O(segments touched) per access with a
bisect.
"""
from __future__ import annotations

from bisect import bisect_right

_INF = float("inf")


class IntervalMap:
    """Disjoint byte segments [b[i], b[i+1]) -> [writer, {stream: reader}] (None = untouched)."""
    __slots__ = ("b", "seg")

    def __init__(self):
        self.b = [0, _INF]
        self.seg = [None]

    def _split(self, x):
        b = self.b
        i = bisect_right(b, x) - 1
        if b[i] == x:
            return i
        b.insert(i + 1, x)
        s = self.seg[i]
        self.seg.insert(i + 1, None if s is None else [s[0], dict(s[1])])
        return i + 1

    def read(self, lo, hi, idx, stream, deps):
        """Record a read of [lo, hi) by instruction idx on stream; add RAW deps (last writers)."""
        i = self._split(lo)
        j = self._split(hi)
        seg = self.seg
        for k in range(i, j):
            s = seg[k]
            if s is None:
                seg[k] = [-1, {stream: idx}]
            else:
                if s[0] >= 0:
                    deps.add(s[0])
                s[1][stream] = idx

    def collect_write(self, lo, hi, deps):
        """Dependencies of a write to [lo, hi): last writers (WAW) and latest readers (WAR)."""
        b, seg = self.b, self.seg
        k = bisect_right(b, lo) - 1
        n = len(seg)
        while k < n and b[k] < hi:
            s = seg[k]
            if s is not None:
                if s[0] >= 0:
                    deps.add(s[0])
                deps.update(s[1].values())
            k += 1

    def write(self, lo, hi, idx):
        """Retire everything in [lo, hi): idx becomes the only writer, with no readers yet."""
        i = self._split(lo)
        j = self._split(hi)
        self.seg[i:j] = [[idx, {}]]
        del self.b[i + 1:j]


QUADRANT = 32          # partitions per bookkeeping bucket (trn2 compute engines start at 0/32/64/96)


class DependencyBuilder:
    """Feed accesses in program (trace) order; returns the predecessor set of each instruction.

    Hazards are per core: two physical cores are ordered only by their synchronising instructions
    (``core_barrier``, ``sendrecv``, collectives: rendezvous in the timeline), never by the order nkisim
    happened to record them in -- a shared-HBM tensor written by one core and read by the other without a
    barrier between them is a race on hardware, not an edge. Regions are keyed by (buffer id, core), so reuse
    of freed on-chip memory by a new allocation is not a hazard (the compiler's allocator is free to place it
    elsewhere); with ``physical=True`` on-chip regions are keyed by (core, memory) and their physical
    partition/byte addresses instead, so address reuse serialises like it would with nkisim's first-fit
    placement.

    On-chip partitions are tracked per quadrant of 32: an access to partitions [p0, p0 + n) touches the interval
    maps of the quadrants it overlaps. Conservative (rows of one quadrant share bookkeeping) and cheap: at most
    four maps per access. A write retires what it covers in its quadrants; a later reader of a row it did not
    write still waits for the older writer through the write's own WAW edge."""

    def __init__(self, physical: bool = False):
        self.physical = physical
        self.maps = {}          # key -> IntervalMap

    def _regions(self, reg, core):
        if "part" in reg:
            base = (core, reg["mem"]) if self.physical else (reg["buf"], core)
            p0, n = reg["part"]
            q0, q1 = p0 // QUADRANT, (p0 + max(n, 1) - 1) // QUADRANT
            keys = [(base, q) for q in range(q0, q1 + 1)]
        else:
            keys = [(reg["buf"], core)]
        out = []
        for k in keys:
            m = self.maps.get(k)
            if m is None:
                m = self.maps[k] = IntervalMap()
            out.append(m)
        return out

    def access(self, idx, stream, core, reads, writes):
        deps = set()
        for reg in reads:
            lo, hi = reg["bytes"]
            if hi <= lo:
                continue
            for m in self._regions(reg, core):
                m.read(lo, hi, idx, stream, deps)
        for reg in writes:
            lo, hi = reg["bytes"]
            if hi <= lo:
                continue
            for m in self._regions(reg, core):
                m.collect_write(lo, hi, deps)
                m.write(lo, hi, idx)
        deps.discard(idx)
        return deps
