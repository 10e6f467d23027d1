"""Instruction trace: every executed ISA instruction, in program order per instance.

Usage::

    with nkisim.trace.capture() as tr:
        kernel[2](x, w)
    tr.instructions[0]         # dict: seq, inst, engine, op, loc, shapes, dtypes, bytes, reads, writes, ...
    tr.to_json("trace.json")

A region is ``{"buf": storage id, "mem": "sbuf"|"psum"|"shared_hbm"|"private_hbm", "name": tensor name,
"inst": owning instance (None for shared HBM), "part": [first_partition, n] (on-chip only, physical),
"bytes": [lo, hi)}`` -- on-chip byte ranges are physical byte addresses within each partition, HBM
ranges are byte offsets inside the allocation. Indirect (gather/scatter) accesses record the whole
indexed extent and ``"indirect": "vector"|"scalar"`` so the trace does not depend on data.
"""
import contextlib
import json
import threading

_active = []          # stack of Trace objects (main thread sets it; instance threads append)
_lock = threading.Lock()


class Trace:
    def __init__(self):
        self.instructions = []
        self.allocations = []
        self.launches = []
        self._lock = threading.Lock()

    def _add(self, rec):
        with self._lock:
            rec["seq"] = len(self.instructions)
            self.instructions.append(rec)

    def _alloc(self, rec):
        with self._lock:
            self.allocations.append(rec)

    def by_instance(self, inst):
        return [r for r in self.instructions if r["inst"] == inst]

    def summary(self):
        """{(engine, op): count}."""
        out = {}
        for r in self.instructions:
            k = (r["engine"], r["op"])
            out[k] = out.get(k, 0) + 1
        return out

    def to_dict(self):
        return {"launches": self.launches, "allocations": self.allocations, "instructions": self.instructions}

    def to_json(self, path=None, **kw):
        s = json.dumps(self.to_dict(), **kw)
        if path is not None:
            with open(path, "w") as f:
                f.write(s)
        return s

    def comparable(self):
        """The trace without storage ids (ids differ between runs); for equality tests."""
        def strip(r):
            r = dict(r)
            for k in ("reads", "writes"):
                r[k] = [{kk: vv for kk, vv in reg.items() if kk != "buf"} for reg in r[k]]
            return r
        return [strip(r) for r in self.instructions]


@contextlib.contextmanager
def capture():
    """Record every instruction executed by kernels launched inside the block."""
    t = Trace()
    with _lock:
        _active.append(t)
    try:
        yield t
    finally:
        with _lock:
            _active.remove(t)


def current():
    with _lock:
        return list(_active)
