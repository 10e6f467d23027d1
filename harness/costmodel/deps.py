"""Dependency graph of a trace: RAW, WAR and WAW hazards between instructions, from the regions each
instruction reads and writes (buffer id + partition range + byte range).

Bookkeeping is per buffer and per partition range: an :class:`IntervalMap` over the byte axis holds, for
each disjoint byte segment, the last writer and the latest reader *per stream* (engine queue). Because
every stream executes in order, depending on the latest reader of each stream is enough for WAR, and on
the last writer for RAW/WAW; dependencies on the instruction's own stream are implied and dropped.
An access whose partition range only partly overlaps an earlier one adds the dependencies but does not
retire the earlier entries (conservative; any extra edge it keeps is implied by a WAW chain).
Cost is O(segments touched) per access with a bisect, so 10^6-instruction traces build in seconds.
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


class DependencyBuilder:
    """Feed accesses in program (trace) order; returns the predecessor set of each instruction.

    ``key_of(region, core)`` chooses the address space: by default the buffer id (the trace's ``buf``),
    so reuse of freed on-chip memory by a new allocation is not a hazard (the compiler's allocator is
    free to place it elsewhere). With ``physical=True`` on-chip regions are keyed by (core, memory)
    and their physical partition/byte addresses, so address reuse serialises like it would with
    nkisim's first-fit placement."""

    def __init__(self, physical: bool = False):
        self.physical = physical
        self.maps = {}          # key -> {prange: IntervalMap}

    def _key(self, reg, core):
        if self.physical and "part" in reg:
            return (core, reg["mem"])
        return reg["buf"]

    def _maps(self, reg, core):
        key = self._key(reg, core)
        pr = tuple(reg["part"]) if "part" in reg else None
        d = self.maps.get(key)
        if d is None:
            d = self.maps[key] = {}
        return d, pr

    @staticmethod
    def _overlaps(pr, q):
        if pr is None or q is None:
            return True
        return pr[0] < q[0] + q[1] and q[0] < pr[0] + pr[1]

    @staticmethod
    def _covers(q, pr):
        """Does access range q cover the whole partition range pr?"""
        if q is None:
            return True
        if pr is None:
            return False
        return q[0] <= pr[0] and pr[0] + pr[1] <= q[0] + q[1]

    def access(self, idx, stream, core, reads, writes):
        deps = set()
        for reg in reads:
            d, q = self._maps(reg, core)
            lo, hi = reg["bytes"]
            if hi <= lo:
                continue
            m = d.get(q)
            if m is not None and len(d) == 1:          # fast path: one partition range on this buffer
                m.read(lo, hi, idx, stream, deps)
                continue
            found = False
            for pr, m in d.items():
                if pr == q:
                    found = True
                    m.read(lo, hi, idx, stream, deps)
                elif self._overlaps(pr, q):
                    # another partition range: pick up its writers, but record the read under q only
                    m.collect_write(lo, hi, _WritersOnly(deps))
            if not found:
                m = d[q] = IntervalMap()
                m.read(lo, hi, idx, stream, deps)
        for reg in writes:
            d, q = self._maps(reg, core)
            lo, hi = reg["bytes"]
            if hi <= lo:
                continue
            m = d.get(q)
            if m is not None and len(d) == 1:
                m.collect_write(lo, hi, deps)
                m.write(lo, hi, idx)
                continue
            for pr, m in d.items():
                if self._overlaps(pr, q):
                    m.collect_write(lo, hi, deps)
                    if self._covers(q, pr):
                        m.write(lo, hi, idx)
            if q not in d:
                m = d[q] = IntervalMap()
                m.write(lo, hi, idx)
        deps.discard(idx)
        return deps


class _WritersOnly:
    """A deps sink for reads through another partition range: keeps writers, ignores readers."""
    __slots__ = ("deps",)

    def __init__(self, deps):
        self.deps = deps

    def add(self, x):
        self.deps.add(x)

    def update(self, xs):
        pass
