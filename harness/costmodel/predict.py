"""``predict(trace)``: a trace in, a :class:`Prediction` out (latency, engine busy, DMA bytes and bandwidth,
idle time, critical path and its contributors, stage split) at one end of the bands; ``predict_band(trace)``:
the low / central / high :class:`BandPrediction` (one dependency build, three simulations)."""
from __future__ import annotations

import gc
import json
from collections import defaultdict
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .stages import resolver
from .timeline import K_DMA, K_SYNC, build, simulate

ENGINES = ("PE", "ACT", "DVE", "POOL", "SP", "DMA", "CC")
# what a critical-path item is, for the per-layer breakdown
CATEGORIES = ("PE", "ACT", "DVE", "POOL", "SP", "DMA", "CC", "sync", "hand-off", "loop boundary")


def trace_parts(trace):
    """(instruction records, runtime-loop records) of an nkisim Trace, its ``to_dict()``, a list of records,
    or a JSON path."""
    if isinstance(trace, (str, bytes)) or hasattr(trace, "__fspath__"):
        with open(trace) as f:
            trace = json.load(f)
    if hasattr(trace, "instructions"):
        return trace.instructions, getattr(trace, "loops", [])
    if isinstance(trace, dict):
        return trace["instructions"], trace.get("loops", [])
    return list(trace), []


def instructions_of(trace):
    return trace_parts(trace)[0]


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


def engine_of(stream_name):
    """Engine a stream's busy time counts for: DMA triggers / sendrecv count as DMA."""
    if stream_name in ("SR",):
        return "DMA"
    return stream_name


def category(T, i):
    """What critical-path node i is (see CATEGORIES)."""
    P = T.program
    if i >= len(P.recs):
        return "loop boundary"
    k = P.kind[i]
    if k == K_DMA:
        return "DMA"
    rec = P.recs[i]
    if k == K_SYNC:
        return "CC" if rec["op"] in costs.COLLECTIVE_OPS or rec["engine"] == "CC" else "sync"
    return T.streams[T.program.stream[i]][1]


@dataclass
class Prediction:
    """What the cost model predicts for one trace at one end of the bands (all times in ns)."""
    name: str
    end: str
    latency_ns: float
    n_instructions: int
    cores: list
    busy_ns: dict                 # core label -> engine -> ns (DMA: time with any DMA in flight)
    act_table_loads: dict         # core label -> (count, ns)
    hbm_read_bytes: int
    hbm_write_bytes: int
    dma_bytes: int                # all DMA payload (HBM + SBUF<->SBUF)
    pipe_busy_ns: list            # per rank: ns with a DMA in its data phase
    idle_ns: float                # no engine (compute, DMA, collective) busy on any core
    critical: list                # [(contribution ns, loc, engine, op, count)] largest first
    critical_by_stage: dict       # stage -> ns on the critical path (sums to latency)
    critical_by_category: dict    # category -> ns on the critical path (hand-off = waits after a release)
    stage_busy: dict              # stage -> engine -> busy ns (all cores)
    stage_span: dict              # stage -> (first start, last finish)
    stage_order: list
    path: list = field(default_factory=list, repr=False)   # critical path [(node, wait ns, own ns)], last first
    timeline: object = field(default=None, repr=False)
    n_ranks: int = 1

    @property
    def hbm_bytes(self):
        return self.hbm_read_bytes + self.hbm_write_bytes

    @property
    def achieved_bw(self):
        """HBM bytes per second over the whole latency, per rank (the traced ranks' average)."""
        return self.hbm_bytes / max(self.n_ranks, 1) / (self.latency_ns * 1e-9) if self.latency_ns else 0.0

    @property
    def roofline_ns(self):
        """HBM bytes of one rank / the central sustainable bandwidth per rank."""
        return self.hbm_bytes / max(self.n_ranks, 1) / C.HBM_BW_PER_RANK.central * 1e9

    def busy_pct(self):
        L = self.latency_ns or 1.0
        return {c: {e: 100.0 * v / L for e, v in d.items()} for c, d in self.busy_ns.items()}

    def engine_busy_ns(self):
        """engine -> mean busy ns over the cores."""
        out = {}
        for e in ENGINES:
            vals = [d.get(e, 0.0) for d in self.busy_ns.values()]
            out[e] = sum(vals) / len(vals) if vals else 0.0
        return out

    def engine_busy_pct(self):
        L = self.latency_ns or 1.0
        return {e: 100.0 * v / L for e, v in self.engine_busy_ns().items()}

    def summary(self) -> dict:
        L = self.latency_ns
        return {
            "name": self.name,
            "end": self.end,
            "latency_us": L / 1e3,
            "instructions": self.n_instructions,
            "cores": self.cores,
            "engine_busy_us": {e: v / 1e3 for e, v in self.engine_busy_ns().items()},
            "engine_busy_pct": self.engine_busy_pct(),
            "busy_pct_per_core": self.busy_pct(),
            "act_table_loads": {c: {"count": n, "ns": t} for c, (n, t) in self.act_table_loads.items()},
            "hbm_read_bytes": self.hbm_read_bytes,
            "hbm_write_bytes": self.hbm_write_bytes,
            "dma_bytes": self.dma_bytes,
            "achieved_hbm_GBps_per_rank": self.achieved_bw / 1e9,
            "hbm_pipe_busy_pct": [100.0 * b / L if L else 0.0 for b in self.pipe_busy_ns],
            "roofline_us": self.roofline_ns / 1e3,
            "idle_no_engine_us": self.idle_ns / 1e3,
            "critical_path_top": [{"ns": ns, "loc": loc, "engine": eng, "op": op, "count": n}
                                  for ns, loc, eng, op, n in self.critical[:15]],
            "critical_by_category_us": {k: v / 1e3 for k, v in self.critical_by_category.items()},
            "stage_critical_us": {s: v / 1e3 for s, v in self.critical_by_stage.items()},
            "stage_busy_us": {s: {e: v / 1e3 for e, v in d.items()} for s, d in self.stage_busy.items()},
            "stage_span_us": {s: [a / 1e3, b / 1e3] for s, (a, b) in self.stage_span.items()},
        }

    def table(self, top=8) -> str:
        s = self.summary()
        lines = [f"{self.name}: {s['latency_us']:.2f} us predicted ({self.end}), {self.n_instructions} instructions "
                 f"on {len(self.cores)} cores",
                 "  engine busy %: " + "  ".join(f"{e} {v:.1f}" for e, v in s["engine_busy_pct"].items()),
                 f"  HBM {self.hbm_bytes / 1e6:.3f} MB ({s['achieved_hbm_GBps_per_rank']:.0f} GB/s per rank); roofline "
                 f"{s['roofline_us']:.2f} us; idle (no engine busy) {s['idle_no_engine_us']:.2f} us"]
        lines.append("  stages (critical-path us): " + ", ".join(
            f"{k} {v:.2f}" for k, v in s["stage_critical_us"].items()))
        lines.append("  critical path by kind (us): " + ", ".join(
            f"{k} {v:.2f}" for k, v in s["critical_by_category_us"].items() if v))
        lines.append("  critical path top:")
        for c in s["critical_path_top"][:top]:
            lines.append(f"    {c['ns'] / 1e3:9.2f} us  {c['engine']:4s} {c['op']:20s} x{c['count']:<5d} {c['loc']}")
        return "\n".join(lines)


@dataclass
class BandPrediction:
    """low / central / high predictions of one trace (each a :class:`Prediction`)."""
    name: str
    low: Prediction
    central: Prediction
    high: Prediction

    def __iter__(self):
        return iter((self.low, self.central, self.high))

    def at(self, end):
        return getattr(self, end)

    @property
    def latency_ns(self):
        return {e: self.at(e).latency_ns for e in C.ENDS}

    def time_us(self):
        """{low, central, high} µs. Each end is its own simulation of a greedy in-order schedule, which is not
        guaranteed monotone in its constants: an end that lands on the wrong side of the central value (a
        scheduling anomaly, rare and small) is shown as the central value and listed in :meth:`anomalies`."""
        c = self.central.latency_ns
        return {"low": min(self.low.latency_ns, c) / 1e3, "central": c / 1e3,
                "high": max(self.high.latency_ns, c) / 1e3}

    def anomalies(self):
        c = self.central.latency_ns
        out = {}
        if self.low.latency_ns > c:
            out["low"] = self.low.latency_ns / 1e3
        if self.high.latency_ns < c:
            out["high"] = self.high.latency_ns / 1e3
        return out

    def stage_us(self):
        """stage -> {low, central, high} critical-path us (each end's own critical path: a stage's ends need not
        bracket its central value, only the round's do)."""
        out = {}
        for e in C.ENDS:
            for s, v in self.at(e).critical_by_stage.items():
                out.setdefault(s, {})[e] = v / 1e3
        return out

    def summary(self):
        d = self.central.summary()
        d["time_us"] = self.time_us()
        d["band_anomalies_us"] = self.anomalies()
        d["stage_us"] = self.stage_us()
        d["assumptions"] = C.assumptions()
        return d


def predict(trace, stages=None, name="trace", end="central", params=None, physical_deps=True) -> Prediction:
    """Predict the device time of a traced launch at one end of the bands (see package docstring).

    trace: nkisim Trace / dict / list of records / JSON path. stages: see ``costmodel.stages``. end: "low" |
    "central" | "high"; params: a ``costs.Params`` instead (e.g. ``Params.at("central", handoff_ns=0)``).
    physical_deps: key on-chip hazards by physical address (default; see ``timeline.build``)."""
    recs, loops = trace_parts(trace)
    params = params or costs.Params.at(end)
    with _no_gc():
        P = build(recs, loops, physical_deps=physical_deps)
        return _summarise(P, simulate(P, params), _stages(recs, stages), name)


def predict_band(trace, stages=None, name="trace", physical_deps=True) -> BandPrediction:
    """The low / central / high predictions of a trace: one dependency build, one simulation per end."""
    recs, loops = trace_parts(trace)
    with _no_gc():
        P = build(recs, loops, physical_deps=physical_deps)
        stage = _stages(recs, stages)
        preds = [_summarise(P, simulate(P, costs.Params.at(e)), stage, name) for e in C.ENDS]
    return BandPrediction(name, *preds)


def _stages(recs, stages):
    stage_of = resolver(stages)
    return [stage_of(i, r) for i, r in enumerate(recs)]


class _no_gc:
    """Millions of small acyclic objects: the cyclic GC only costs time here."""

    def __enter__(self):
        self.was = gc.isenabled()
        gc.disable()

    def __exit__(self, *exc):
        if self.was:
            gc.enable()


def _summarise(P, T, stage, name):
    """Metrics of one simulation; ``stage``: the stage of every instruction."""
    recs = P.recs
    n = len(recs)
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
        a, b = T.work_start[i], T.finish[i]
        if P.kind[i] == K_DMA:
            eng = "DMA"
            dma_iv[ci].append((a, b))
            r, w = costs.hbm_bytes(rec)
            hr += r
            hw += w
            dmab += P.dma[i][0]
        else:
            eng = engine_of(T.streams[P.stream[i]][1])
            if eng == "DMA":
                dma_iv[ci].append((a, b))
            else:
                busy[lab][eng] += b - a
        if P.tload[i]:
            tloads[lab][0] += 1
            tloads[lab][1] += P.tload[i]
        per_core_iv[ci].append((a, b))
        st = stage[i]
        stage_busy[st][eng] += b - a
        s0 = span.get(st)
        span[st] = (min(s0[0], T.start[i]), max(s0[1], b)) if s0 else (T.start[i], b)
    for ci, lab in enumerate(labels):
        busy[lab]["DMA"] = _union(dma_iv[ci])
    idle = T.end - _union([iv for lst in per_core_iv for iv in lst])

    # critical path: walk back from the last node to finish along the binding constraints; each node's
    # contribution = its finish - its release, split into the wait before it started (hand-off, queue,
    # DGE or bandwidth waits) and its own time
    crit = defaultdict(lambda: [0.0, 0])
    crit_stage = defaultdict(float)
    crit_cat = defaultdict(float)
    path = []
    N = len(T.finish)
    if N:
        cur = max(range(N), key=lambda i: T.finish[i])
        t = T.finish[cur]
        seen = 0
        while cur is not None and seen <= N * 2:
            seen += 1
            b = T.binder[cur]
            rel_t = b[1] if b else 0.0
            contrib = max(t - rel_t, 0.0)
            wait = min(max(T.start[cur] - rel_t, 0.0), contrib)
            own = contrib - wait
            path.append((cur, wait, own))
            if cur < n:
                rec = recs[cur]
                key = (rec.get("loc") or "?", category(T, cur), rec["op"])
                st = stage[cur]
            else:
                key = ("loop boundary", "loop boundary", "fence")
                st = _fence_stage(P, T, cur, stage)
            crit[key][0] += contrib
            crit[key][1] += 1
            crit_stage[st] += contrib
            crit_cat["hand-off"] += wait
            crit_cat[category(T, cur)] += own
            # a stream-order binder can release its successor before it finishes itself (a DMA queue frees at the
            # trigger, not the completion), so its own release may lie after t: the path goes on from t, never
            # forward in time (the segments stay disjoint and add up to the latency)
            t = min(rel_t, t)
            cur = b[0] if b else None
    critical = sorted(((v[0], k[0], k[1], k[2], v[1]) for k, v in crit.items()), reverse=True)
    for s in crit_stage:
        if s not in order:
            order.append(s)
    return Prediction(
        name=name, end=T.params.end, latency_ns=T.end, n_instructions=n, cores=labels,
        busy_ns={k: dict(v) for k, v in busy.items()},
        act_table_loads={k: tuple(v) for k, v in tloads.items()},
        hbm_read_bytes=hr, hbm_write_bytes=hw, dma_bytes=dmab, pipe_busy_ns=T.pipe_busy, idle_ns=idle,
        critical=critical, critical_by_stage={s: crit_stage.get(s, 0.0) for s in order},
        critical_by_category={c: crit_cat.get(c, 0.0) for c in CATEGORIES},
        stage_busy={s: dict(stage_busy[s]) for s in order if s in stage_busy},
        stage_span={s: span[s] for s in order if s in span}, stage_order=order, path=path, timeline=T,
        n_ranks=len({r for r, _ in P.cores}))


def _fence_stage(P, T, node, stage):
    """A fence belongs to the stage of the instruction it follows."""
    ci, k = T.fences[node - len(P.recs)]
    if k < 0:
        return stage[P.order[ci][0]] if P.order[ci] else "other"
    return stage[P.order[ci][k]]
