"""Instruction trace: every executed ISA instruction, in program order per instance.

Usage::

    with nkisim.trace.capture() as tr:
        kernel[2](x, w)
    tr.instructions[0]         # dict: seq, inst, engine, op, loc, shapes, dtypes, bytes, reads, writes, ...
    tr.to_json("trace.json")

A region is ``{"buf": storage id, "mem": "sbuf"|"psum"|"shared_hbm"|"private_hbm", "name": tensor name,
"inst": owning instance (None for shared HBM), "part": [first_partition, n] (on-chip only, physical),
"bytes": [lo, hi)}`` -- on-chip byte ranges are physical byte addresses within each partition, HBM
ranges are byte offsets inside the allocation. Dynamic accesses carry ``"indirect": "vector"|"scalar"``:
gathers/scatters (vector) record the whole indexed extent; a scalar dynamic offset records, when executing, the
region actually accessed (``"resolved": true``, the whole-tensor span kept in ``"extent"``) and in shape-only
mode the whole tensor (``"resolved": false``). ``Trace.comparable()`` maps both to the data-independent form.
See nkisim/README.md "Trace" for the instruction fields (stack, launch, reg_reads/reg_writes, loop, depends_on, ...).
``Trace.loops``: one record per runtime loop executed (``fori_loop`` / ``while_loop`` / ``dynamic_range``), also
when it ran 0 times: ``op``, ``id`` (per instance), ``rank``, ``inst``, ``launch``, ``loc``, ``trips``, ``outer``
(ids of the enclosing loops), ``before`` / ``last`` (``seq`` of the instance's last instruction before the loop /
at its exit, -1 if none).
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
        self.loops = []
        self._lock = threading.Lock()

    def _add(self, rec):
        with self._lock:
            rec["seq"] = len(self.instructions)
            self.instructions.append(rec)

    def _alloc(self, rec):
        with self._lock:
            self.allocations.append(rec)

    def _loop(self, rec):
        with self._lock:
            self.loops.append(rec)

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
        return {"launches": self.launches, "allocations": self.allocations, "loops": self.loops,
                "instructions": self.instructions}

    def to_json(self, path=None, **kw):
        s = json.dumps(self.to_dict(), **kw)
        if path is not None:
            with open(path, "w") as f:
                f.write(s)
        return s

    def comparable(self):
        """The data-independent part of the trace, for equality tests: no storage ids (they differ between runs)
        and, for resolved dynamic offsets, the data-independent ``extent`` instead of the accessed region (so an
        executing trace equals its shape-only trace and does not depend on offset values)."""
        def reg(g):
            out = {k: v for k, v in g.items() if k not in ("buf", "resolved", "extent")}
            out.update(g.get("extent", {}))
            return out

        def strip(r):
            r = dict(r)
            for k in ("reads", "writes"):
                r[k] = [reg(g) for g in r[k]]
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
