"""Round estimates at the same context and routing: the round megakernel (one full-round trace), the layerwise
variant (its stage kernels, one trace per distinct launch, composed as the one XLA graph a layerwise round is)
and an HBM roofline beside each, from that variant's own bytes. Every figure is a band (low / central / high).

A round (DESIGN.md §1) = D1 draft (MTP, T=1) + V verify (40-layer trunk, T=2) + D2 replay (the MTP head's K / V rows, T=1).

**Layerwise.** ``harness.engines.LayerwiseEngine`` walks the round plan (``megakernel.plan``) and launches, per
round: D1 = embedding, MTP fc stage, attention stage (at p - 1), MoE stage, head stage; V = embedding, per layer a
mixer stage (GDN or attention, per KV-head group) and a MoE stage, head stage; D2 = embedding, MTP fc, the K / V
rows at p (:func:`layerwise_plan` lists them from the same plan). On a device these are NKI custom
calls inside ONE XLA graph: the graph compiler assembles the kernels into one executable (SDK
nki/deep-dives/nki-compiler.rst "How the NKI Compiler Works with the Graph Compiler"), so the round pays one
NEFF start (``LAUNCH_OVERHEAD_NS``), not one per kernel. Each kernel runs on its own (its trace starts and ends
drained: nothing overlaps across a kernel boundary) and the next one's first transfer waits on a semaphore of
the previous one (``HANDOFF_DMA_NS``). Between them the graph does what the host does in the simulation: the
cross-rank sum of the stage partials (an XLA all-reduce of [T, H] float32, ``costs.collective_ns``), the
residual add (one VectorE op), the argmax agreement after a head (an all-gather of (value, index) per core) and
the MTP fc columns (an all-gather of [1, H] float32).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .layers import breakdown, label_layers, per_kind
from .predict import BandPrediction, predict_band


@dataclass
class RoundEstimate:
    """One variant's round: every figure {low, central, high} in ns."""
    variant: str
    label: str
    round_ns: dict
    stage_ns: dict                          # D1 / V / D2 (/ other) -> {end: ns}
    part_ns: dict                           # (stage, part) -> {end: ns}
    hbm_bytes_per_rank: float
    bottlenecks: list                       # [(central ns per round, what)] largest first
    layers: dict = field(default_factory=dict)      # per-layer breakdown (megakernel, central)
    layer_kinds: dict = field(default_factory=dict)  # layer kind -> {end: per_kind summary}
    launches: list = field(default_factory=list)     # layerwise: (stage, what, count, {end: ns each})
    prediction: BandPrediction | None = None
    notes: dict = field(default_factory=dict)

    def roofline_ns(self):
        """This variant's HBM bytes per rank at each end's bandwidth."""
        return {e: self.hbm_bytes_per_rank / C.HBM_BW_PER_RANK.at(e) * 1e9 for e in C.ENDS}

    def summary(self, acceptance):
        us = _us
        return {
            "variant": self.variant, "label": self.label,
            "round_us": us(self.round_ns),
            "tokens_per_s": {e: (1.0 + acceptance) / (self.round_ns[e] * 1e-9) for e in C.ENDS},
            # device time + the host dispatch measured around a host-driven public round (C.HOST_ROUND_NS):
            # our rounds are host-driven too (the host reads the ids, accepts, builds the next launch's inputs)
            "end_to_end_round_us": {e: (self.round_ns[e] + C.HOST_ROUND_NS) / 1e3 for e in C.ENDS},
            "end_to_end_tokens_per_s": {e: (1.0 + acceptance) / ((self.round_ns[e] + C.HOST_ROUND_NS) * 1e-9)
                                        for e in C.ENDS},
            **(self.chained(acceptance) if self.notes.get("device_commit") else {}),
            "stages_us": {s: us(v) for s, v in self.stage_ns.items()},
            "parts_us": {f"{s}/{p}": us(v) for (s, p), v in self.part_ns.items()},
            "hbm_MB_per_rank": self.hbm_bytes_per_rank / 1e6,
            "roofline_us": us(self.roofline_ns()),
            "bottlenecks": [{"us": ns / 1e3, "what": w} for ns, w in self.bottlenecks[:12]],
            **self.notes,
        }


    def chained(self, acceptance):
        """A device-committed round launched back to back: per device end, the end-to-end round with the host's
        per-launch cost hidden (``host_hidden``: the device round, its NEFF start included) and exposed
        (``host_exposed``: + the measured host-driven gap), ``C.CHAINED_HOST_NS`` with its sources."""
        ends = {k: {e: (self.round_ns[e] + C.CHAINED_HOST_NS[k]) / 1e3 for e in C.ENDS} for k in ("low", "high")}
        return {"chained_end_to_end_round_us": {"host_hidden": ends["low"], "host_exposed": ends["high"]},
                "chained_end_to_end_tokens_per_s": {
                    k2: {e: (1.0 + acceptance) / (v[e] * 1e-6) for e in C.ENDS}
                    for k2, v in (("host_hidden", ends["low"]), ("host_exposed", ends["high"]))},
                "chained_host_us_per_round": {"low": C.CHAINED_HOST_NS["low"] / 1e3,
                                              "high": C.CHAINED_HOST_NS["high"] / 1e3,
                                              "sources": C.CHAINED_HOST_SOURCES}}


def _us(d):
    return {e: v / 1e3 for e, v in d.items()}


def _ends(f):
    return {e: f(e) for e in C.ENDS}


V_STAGES = ("V", "V norms", "V GDN", "V all-reduce", "V MoE", "V attention", "V LM head")


# ---- the megakernel ------------------------------------------------------------------------------
def megakernel_round(cfg, context=2048, routing=None, tp=C.TP_RANKS, lnc=C.LNC, dtype="bfloat16", progress=None,
                     draft_vocab=0, device_commit=False, fp8_experts=False, draft_fp8=False):
    """Trace the shipped round megakernel (``harness.kernel_cases.round_case``; ``draft_vocab``: an FR-Spec draft head
    of that many ids, 0: off; ``device_commit``: the opt-in device-committed round, whose summary adds the chained
    end-to-end band, :meth:`RoundEstimate.chained`; ``fp8_experts``: the opt-in fp8 experts tables; ``draft_fp8``: the
    opt-in fp8 draft head) and predict its band."""
    from harness import kernel_cases
    case = kernel_cases.round_case(cfg, context, routing, tp, lnc, dtype, draft_vocab=draft_vocab,
                                   device_commit=device_commit, fp8_experts=fp8_experts, draft_fp8=draft_fp8)
    if progress:
        progress("tracing the round megakernel")
    tr = case.trace()
    if progress:
        progress(f"predicting {len(tr.instructions):,} instructions x 3 ends")
    band = predict_band(tr, stages=case.stages, name="megakernel")
    labels = label_layers(tr.instructions, case.plan)
    rows = {e: breakdown(band.at(e), labels) for e in C.ENDS}
    kinds = {e: per_kind(rows[e]) for e in C.ENDS}
    stage_ns, part_ns = {}, {}
    for e in C.ENDS:
        for s, v in band.at(e).critical_by_stage.items():
            top = "V" if s in V_STAGES else s
            stage_ns.setdefault(top, {}).setdefault(e, 0.0)
            stage_ns[top][e] += v
            part_ns.setdefault(("round", s), {})[e] = v
    for s in stage_ns:
        for e in C.ENDS:
            stage_ns[s].setdefault(e, 0.0)
    head = {e: C.LAUNCH_OVERHEAD_NS for e in C.ENDS}
    part_ns[("round", "launch head")] = head
    p = band.central
    bott = [(ns, f"{loc} {eng} {op} x{n}") for ns, loc, eng, op, n in p.critical]
    from harness.kernel_cases import kernel_parameters
    notes = {"instructions": p.n_instructions, "band_anomalies_us": band.anomalies(),
             "kernel_parameters": kernel_parameters(case),
             "distinct_experts": list(case.provider.moe.log), "routing": case.routing.describe(),
             "critical_by_category_us": {e: _us(band.at(e).critical_by_category) for e in C.ENDS},
             "runtime_loops": len(tr.loops), "device_commit": bool(device_commit)}
    return RoundEstimate("megakernel", "one launch per round (full-round trace, shipped kernel: runtime loops"
                         + (", accept and commit on device)" if device_commit else ")"),
                         _ends(lambda e: band.time_us()[e] * 1e3 + C.LAUNCH_OVERHEAD_NS), stage_ns, part_ns,
                         p.hbm_bytes / p.n_ranks, bott, rows["central"], kinds, prediction=band, notes=notes)


# ---- the layerwise variant -------------------------------------------------------------------------
@dataclass(frozen=True)
class Launch:
    stage: str          # D1 / V / D2
    key: tuple          # the kernel case: (kind, tokens, position, mtp, distinct)
    count: int
    after: str          # what the graph does after it: "all_reduce" | "all_gather_best" | "all_gather_fc" | ""


def layerwise_plan(cfg, context, routing, tp=C.TP_RANKS, lnc=C.LNC):
    """The layerwise round's launches in order, from the round plan (identical launches folded into counts)."""
    from megakernel import plan as rp
    p = context
    out = []
    moe_counts = defaultdict(int)
    for stage in rp.round_plan(cfg, tp, lnc).stages:
        T, mtp = stage.tokens, stage.kind != rp.VERIFY
        out.append(Launch(stage.name, ("embedding", T, p, False, None), 1, ""))
        if mtp:
            out.append(Launch(stage.name, ("mtp_fc", 1, p, True, None), 1, "all_gather_fc"))
            at = p - 1 if stage.inputs == "d1" else p
            for layer in stage.layers:
                if stage.kind == rp.REPLAY:     # the MTP KV rows only (LayerwiseEngine._kv_rows)
                    out.append(Launch(stage.name, ("kv_rows", T, at, True, None), layer.groups, ""))
                    continue
                out.append(Launch(stage.name, ("attention", T, at, True, None), layer.groups, "all_reduce"))
                out.append(Launch(stage.name, ("moe", T, p, True, None), 1, "all_reduce"))
            if stage.kind == rp.DRAFT:
                out.append(Launch(stage.name, ("head", T, p, True, None), 1, "all_gather_best"))
            continue
        kinds = defaultdict(int)
        for layer in stage.layers:
            kinds[layer.kind] += layer.groups if layer.kind == rp.ATTENTION else 1
        for i, layer in enumerate(stage.layers):
            moe_counts[routing.distinct(i)] += 1
        out.append(Launch(stage.name, ("gdn", T, p, False, None), kinds[rp.GDN], "all_reduce"))
        out.append(Launch(stage.name, ("attention", T, p, False, None), kinds[rp.ATTENTION], "all_reduce"))
        for d, n in sorted(moe_counts.items()):
            out.append(Launch(stage.name, ("moe", T, p, False, d), n, "all_reduce"))
        out.append(Launch(stage.name, ("head", T, p, False, None), 1, "all_gather_best"))
    return [launch for launch in out if launch.count]


def _case(cfg, key, routing, tp, lnc, dtype):
    from harness import kernel_cases
    kind, T, p, mtp, d = key
    if kind == "embedding":
        return kernel_cases.embedding_case(cfg, T, tp, lnc, p, dtype)
    return kernel_cases.stage_case(cfg, kind, T, p, routing, d, mtp, tp, lnc, dtype)


def between_ns(cfg, after, T, tp, params):
    """What the XLA graph does after a launch (see the module docstring), at one end of the bands."""
    H = cfg.hidden_size
    if after == "all_reduce":
        add = C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * T * H / 128           # the residual add, [128, T*H/128]
        return costs.collective_ns("all_reduce", T * H * 4, tp, params) + add
    if after == "all_gather_best":
        return costs.collective_ns("all_gather", T * 2 * 4, tp, params)
    if after == "all_gather_fc":
        return costs.collective_ns("all_gather", H * 4, tp, params)
    return 0.0


def layerwise_round(cfg, context=2048, routing=None, tp=C.TP_RANKS, lnc=C.LNC, dtype="bfloat16", progress=None):
    from harness.register_models import Routing
    routing = routing or Routing("expected", 2, cfg.num_experts_per_tok, cfg.num_experts)
    plan = layerwise_plan(cfg, context, routing, tp, lnc)
    preds = {}
    for c in plan:
        if c.key not in preds:
            case = _case(cfg, c.key, routing, tp, lnc, dtype)
            if progress:
                progress(f"layerwise: {case.name}")
            preds[c.key] = (case, predict_band(case.trace(), stages="function", name=case.name))
    stage_ns = defaultdict(lambda: {e: 0.0 for e in C.ENDS})
    part_ns = defaultdict(lambda: {e: 0.0 for e in C.ENDS})
    bott = defaultdict(float)
    launches = []
    hbm = 0.0
    n_calls = 0
    for c in plan:
        case, band = preds[c.key]
        n_calls += c.count
        hbm += c.count * band.central.hbm_bytes / band.central.n_ranks
        each = {}
        for e in C.ENDS:
            prm = costs.Params.at(e)
            k = band.time_us()[e] * 1e3
            b = prm.handoff_dma_ns
            x = between_ns(cfg, c.after, c.key[1], tp, prm)
            each[e] = k + b + x
            stage_ns[c.stage][e] += c.count * (k + b + x)
            part_ns[(c.stage, case.name)][e] += c.count * k
            part_ns[(c.stage, "kernel boundaries")][e] += c.count * b
            if x:
                part_ns[(c.stage, f"XLA {c.after.replace('_', '-')}")][e] += c.count * x
        launches.append((c.stage, case.name, c.count, each))
        for ns, loc, eng, op, n in band.central.critical:
            bott[f"{loc} {eng} {op} ({case.name})"] += c.count * ns
        prm = costs.Params.at("central")
        x = between_ns(cfg, c.after, c.key[1], tp, prm)
        if x:
            bott[f"XLA {c.after} between launches"] += c.count * x
        bott["kernel boundaries (semaphore hand-off between NKI calls)"] += c.count * prm.handoff_dma_ns
    head = {e: C.LAUNCH_OVERHEAD_NS for e in C.ENDS}
    part_ns[("round", "launch head")] = head
    total = {e: sum(v[e] for v in stage_ns.values()) + C.LAUNCH_OVERHEAD_NS for e in C.ENDS}
    label = (f"one XLA graph per round: {n_calls} NKI kernel calls (one NEFF start per round, a semaphore hand-off "
             f"per call, XLA collectives and residual adds between them)")
    moe_d = [c.key[4] for c in plan if c.key[0] == "moe" and c.key[1] > 1 for _ in range(c.count)]
    notes = {"kernel_calls": n_calls, "routing": routing.describe(),
             "distinct_experts": [routing.distinct(i) for i in range(cfg.num_hidden_layers)],
             "distinct_experts_traced": sorted(set(moe_d))}
    return RoundEstimate("layerwise", label, total, dict(stage_ns), dict(part_ns), hbm,
                         sorted(((v, w) for w, v in bott.items()), reverse=True), launches=launches, notes=notes)



# ---- what each correction of issue 13 does to the round ---------------------------------------------------
def corrections(cfg, context=2048, routing=None, tp=C.TP_RANKS, lnc=C.LNC, progress=None):
    """[{"correction", "without_us", "effect_us"}]: the central megakernel round with each modelling correction
    of issue 13 taken out on its own (the rest kept), so ``effect_us`` = central - central without it. The
    routing, shipped-kernel and context rows re-trace the round; the others re-simulate (or re-build) the same
    trace."""
    from harness import kernel_cases
    from harness.register_models import Routing
    from .predict import trace_parts
    from .timeline import build, simulate
    routing = routing or Routing("expected", 2, cfg.num_experts_per_tok, cfg.num_experts)
    head = C.LAUNCH_OVERHEAD_NS
    out = []

    def traced(case, what):
        if progress:
            progress(what)
        recs, loops = trace_parts(case.trace())
        return build(recs, loops)

    P = traced(kernel_cases.round_case(cfg, context, routing, tp, lnc), "the shipped round")
    base = simulate(P, costs.Params.at("central")).end + head

    def add(name, ns):
        out.append({"correction": name, "without_us": ns / 1e3, "effect_us": (base - ns) / 1e3})

    for name, ov in (("cross-engine hand-off (semaphores)", dict(handoff_ns=0.0, handoff_dma_ns=0.0)),
                     ("DMA size efficiency (descriptor overhead per run)", dict(dma_descriptor_overhead_bytes=0.0)),
                     ("HWDGE DMAs triggered from the SP queue in program order", dict(dma_trigger_queue="none")),
                     ("all-reduce / collective trigger delay", dict(cc_trigger_ns=0.0)),
                     ("runtime-loop boundaries (fences)", dict(loop_fences="none")),
                     ("PE floor 94 ns (was 140 ns)", dict(pe_floor_ns=140.0))):
        add(name, simulate(P, costs.Params.at("central", **ov)).end + head)
    recip = P.base[:]
    for i, rec in enumerate(P.recs):
        if rec["op"] == "reciprocal" and rec["engine"] == "DVE":
            recip[i] = C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * costs.free_elems(rec)
    n_recip = sum(1 for a, b in zip(recip, P.base) if a != b)
    P1 = _program_with(P, base=recip)
    add(f"DVE reciprocal at 8x per element ({n_recip} instructions)", simulate(P1, costs.Params.at("central")).end
        + head)
    if progress:
        progress("physical reuse off (rebuild)")
    P0 = build(P.recs, P.loops, physical_deps=False)
    add("physical SBUF reuse (WAR on reused addresses)", simulate(P0, costs.Params.at("central")).end + head)
    del P0, P1
    for name, case in (
            ("realistic routing (vs all tokens on the same top-k experts)",
             kernel_cases.round_case(cfg, context, Routing("min", 2, cfg.num_experts_per_tok, cfg.num_experts), tp,
                                     lnc)),
            (f"the shipped kernel's runtime loops (vs the max_context={context} unrolled specialisation)",
             kernel_cases.round_case(cfg, context, routing, tp, lnc, max_context=context)),
            (f"context {context} (vs the old headline's 4,096, shipped kernel)",
             kernel_cases.round_case(cfg, 4096, routing, tp, lnc))):
        Q = traced(case, name)
        add(name, simulate(Q, costs.Params.at("central")).end + head)
        del Q
    return {"central_us": base / 1e3, "context": context, "routing": routing.describe(), "rows": out}


def _program_with(P, **fields):
    """A shallow copy of a Program with some fields replaced."""
    import copy
    Q = copy.copy(P)
    for k, v in fields.items():
        setattr(Q, k, v)
    return Q
