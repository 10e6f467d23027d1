"""``predict(trace, stages=...)``: a trace in, a :class:`Prediction` out (latency, engine busy, DMA bytes
and bandwidth, idle time, critical-path contributors, stage split)."""
from __future__ import annotations

import gc
import json
from collections import defaultdict
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .stages import resolver
from .timeline import K_COMPUTE, K_DMA, K_SYNC, build, simulate

ENGINES = ("PE", "ACT", "DVE", "POOL", "SP", "DMA", "CC")


def instructions_of(trace):
    """Instruction records of an nkisim Trace, its ``to_dict()``, a list of records, or a JSON path."""
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        with open(trace) as f:
            trace = json.load(f)
    if hasattr(trace, "instructions"):
        return trace.instructions
    if isinstance(trace, dict):
        return trace["instructions"]
    return list(trace)


def _union(intervals):
    """Total length of a union of (start, end) intervals."""
    tot = 0.0
    cur_s = cur_e = None
    for s, e in sorted(intervals):
        if e <= s:
            continue
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                tot += cur_e - cur_s
            cur_s, cur_e = s, e
        elif e > cur_e:
            cur_e = e
    if cur_e is not None:
        tot += cur_e - cur_s
    return tot


def _engine_name(stream_name):
    return "DMA" if stream_name.startswith("DMA") else stream_name


@dataclass
class Prediction:
    """What the cost model predicts for one trace (all times in ns)."""
    name: str
    latency_ns: float
    n_instructions: int
    cores: list
    busy_ns: dict                 # core label -> engine -> ns (DMA: time with any queue active)
    act_table_loads: dict         # core label -> (count, ns)
    hbm_read_bytes: int
    hbm_write_bytes: int
    dma_bytes: int                # all DMA traffic (HBM + SBUF<->SBUF)
    pipe_busy_ns: list            # per rank: ns with a DMA in its data phase
    idle_ns: float                # no engine (compute, DMA, collective) busy on any core
    critical: list                # [(contribution ns, loc, engine, op, count)] largest first
    critical_by_stage: dict       # stage -> ns on the critical path (sums to latency)
    stage_busy: dict              # stage -> engine -> busy ns (all cores)
    stage_span: dict              # stage -> (first start, last finish)
    stage_order: list
    timeline: object = field(default=None, repr=False)
    n_ranks: int = 1

    # ---- derived figures ----------------------------------------------------------------------
    @property
    def hbm_bytes(self):
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def achieved_bw(self):
        """HBM bytes per second over the whole latency, per rank (the traced ranks' average)."""
        return self.hbm_bytes / max(self.n_ranks, 1) / (self.latency_ns * 1e-9) if self.latency_ns else 0.0

    @property
    def roofline_ns(self):
        """HBM bytes of one rank / sustainable bandwidth per rank."""
        return self.hbm_bytes / max(self.n_ranks, 1) / C.HBM_BW_PER_RANK * 1e9

    def busy_pct(self):
        """core -> engine -> % of latency busy."""
        L = self.latency_ns or 1.0
        return {c: {e: 100.0 * v / L for e, v in d.items()} for c, d in self.busy_ns.items()}

    def engine_busy_pct(self):
        """engine -> mean % busy over the cores."""
        L = self.latency_ns or 1.0
        out = {}
        for e in ENGINES:
            vals = [d.get(e, 0.0) for d in self.busy_ns.values()]
            out[e] = 100.0 * sum(vals) / len(vals) / L if vals else 0.0
        return out

    def summary(self) -> dict:
        L = self.latency_ns
        return {
            "name": self.name,
            "latency_us": L / 1e3,
            "instructions": self.n_instructions,
            "cores": self.cores,
            "engine_busy_pct": self.engine_busy_pct(),
            "busy_pct_per_core": self.busy_pct(),
            "act_table_loads": {c: {"count": n, "ns": t} for c, (n, t) in self.act_table_loads.items()},
            "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes,
            "dma_bytes": self.dma_bytes,
            "achieved_hbm_GBps_per_rank": self.achieved_bw / 1e9,
            "hbm_utilisation_pct": 100.0 * self.achieved_bw / C.HBM_BW_PER_RANK,
            "hbm_pipe_busy_pct": [100.0 * b / L if L else 0.0 for b in self.pipe_busy_ns],
            "roofline_us": self.roofline_ns / 1e3,
            "idle_no_engine_us": self.idle_ns / 1e3,
            "critical_path_top": [{"ns": ns, "loc": loc, "engine": eng, "op": op, "count": n}
                                  for ns, loc, eng, op, n in self.critical[:15]],
            "stage_critical_us": {s: v / 1e3 for s, v in self.critical_by_stage.items()},
            "stage_busy_us": {s: {e: v / 1e3 for e, v in d.items()} for s, d in self.stage_busy.items()},
            "stage_span_us": {s: [a / 1e3, b / 1e3] for s, (a, b) in self.stage_span.items()},
        }

    def table(self, top=8) -> str:
        s = self.summary()
        lines = [f"{self.name}: {s['latency_us']:.2f} us predicted, {self.n_instructions} instructions on "
                 f"{len(self.cores)} cores",
                 "  engine busy %: " + "  ".join(f"{e} {v:.1f}" for e, v in s["engine_busy_pct"].items()),
                 f"  HBM {self.hbm_bytes / 1e6:.3f} MB ({s['achieved_hbm_GBps_per_rank']:.0f} GB/s per rank, "
                 f"{s['hbm_utilisation_pct']:.1f}% of {C.HBM_BW_PER_RANK / 1e9:.0f}); roofline "
                 f"{s['roofline_us']:.2f} us; idle (no engine busy) {s['idle_no_engine_us']:.2f} us"]
        lines.append("  stages (critical-path us): " + ", ".join(
            f"{k} {v:.2f}" for k, v in s["stage_critical_us"].items()))
        lines.append("  critical path top:")
        for c in s["critical_path_top"][:top]:
            lines.append(f"    {c['ns'] / 1e3:9.2f} us  {c['engine']:4s} {c['op']:20s} x{c['count']:<5d} {c['loc']}")
        return "\n".join(lines)


def predict(trace, stages=None, name="trace", pe_throttle=False, physical_deps=False) -> Prediction:
    """Predict the device time of a traced launch (see package docstring).

    trace: nkisim Trace / dict / list of records / JSON path. stages: see ``costmodel.stages``.
    pe_throttle: scale PE durations by the measured 1.69x throttle. physical_deps: key on-chip hazards
    by physical address (nkisim's first-fit placement) instead of buffer id."""
    recs = instructions_of(trace)
    gc_was = gc.isenabled()
    gc.disable()            # millions of small acyclic objects: the cyclic GC only costs time here
    try:
        return _predict(recs, stages, name, pe_throttle, physical_deps)
    finally:
        if gc_was:
            gc.enable()


def _predict(recs, stages, name, pe_throttle, physical_deps):
    P = build(recs, pe_throttle=pe_throttle, physical_deps=physical_deps)
    T = simulate(P)
    stage_of = resolver(stages)
    stage = [stage_of(i, r) for i, r in enumerate(recs)]
    order = list(dict.fromkeys(stage))
    labels = [f"r{r}c{c}" for r, c in P.cores]

    busy = {lab: defaultdict(float) for lab in labels}
    tloads = {lab: [0, 0.0] for lab in labels}
    stage_busy = defaultdict(lambda: defaultdict(float))
    span = {}
    per_core_iv = [[] for _ in P.cores]
    dma_iv = [[] for _ in P.cores]
    hr = hw = dmab = 0
    for i, rec in enumerate(recs):
        ci = P.core[i]
        lab = labels[ci]
        eng = _engine_name(P.streams[P.stream[i]][1])
        a, b = T.work_start[i], T.finish[i]
        d = b - a
        if P.kind[i] == K_DMA:
            dma_iv[ci].append((a, b))
            r, w = costs.hbm_bytes(rec)
            hr += r
            hw += w
            dmab += P.nbytes[i]
        elif eng != "DMA":
            busy[lab][eng] += d
        if P.tload[i]:
            tloads[lab][0] += 1
            tloads[lab][1] += P.tload[i]
        if P.kind[i] == K_SYNC and eng == "DMA":
            dma_iv[ci].append((a, b))
        per_core_iv[ci].append((a, b))
        st = stage[i]
        stage_busy[st][eng] += d
        s0 = span.get(st)
        span[st] = (min(s0[0], T.start[i]), max(s0[1], b)) if s0 else (T.start[i], b)
    for ci, lab in enumerate(labels):
        busy[lab]["DMA"] = _union(dma_iv[ci])
    idle = T.end - _union([iv for lst in per_core_iv for iv in lst])

    # critical path: walk back from the last instruction to finish along the binding constraints
    crit = defaultdict(lambda: [0.0, 0])
    crit_stage = defaultdict(float)
    if recs:
        cur = max(range(len(recs)), key=lambda i: T.finish[i])
        t = T.finish[cur]
        seen = 0
        while cur is not None and seen <= len(recs) * 2:
            seen += 1
            b = T.binder[cur]
            rel_t = b[1] if b else 0.0
            contrib = max(t - rel_t, 0.0)
            rec = recs[cur]
            key = (rec.get("loc") or "?", _engine_name(P.streams[P.stream[cur]][1]), rec["op"])
            crit[key][0] += contrib
            crit[key][1] += 1
            crit_stage[stage[cur]] += contrib
            t = rel_t
            cur = b[0] if b else None
    critical = sorted(((v[0], k[0], k[1], k[2], v[1]) for k, v in crit.items()), reverse=True)
    return Prediction(
        name=name, latency_ns=T.end, n_instructions=len(recs), cores=labels,
        busy_ns={k: dict(v) for k, v in busy.items()},
        act_table_loads={k: tuple(v) for k, v in tloads.items()},
        hbm_read_bytes=hr, hbm_write_bytes=hw, dma_bytes=dmab, pipe_busy_ns=T.pipe_busy, idle_ns=idle,
        critical=critical, critical_by_stage={s: crit_stage.get(s, 0.0) for s in order},
        stage_busy={s: dict(stage_busy[s]) for s in order}, stage_span={s: span[s] for s in order},
        stage_order=order, timeline=T, n_ranks=len({r for r, _ in P.cores}))
