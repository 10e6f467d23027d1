"""Per-round estimates composed from per-family kernel traces (the layerwise variant), the analytic HBM
roofline, and the hook for a full-round megakernel trace.

A round (DESIGN.md §1) = D1 draft (MTP, T=1) + V verify (40-layer trunk, T=2) + D2 replay (MTP, T=1).
The layerwise composition launches one kernel per family call; between launches it pays the measured
launch head (``LAUNCH_OVERHEAD_NS``) and, after every mixer / MoE launch, the measured TP all-reduce of
the layer output. Each kernel's own trace already contains its HBM round trip of the residual (its
wrapper loads x from HBM and stores its partial). A family whose ``demo_args`` has not landed yet is
stood in for by its analytic weight bytes over the rank bandwidth plus one small-DMA latency, and is
labelled ``stand-in`` everywhere.
"""
from __future__ import annotations

import importlib
from collections import defaultdict
from dataclasses import dataclass, field

from . import constants as C
from . import costs
from .predict import Prediction, predict

FAMILIES = ("embedding", "rmsnorm", "gdn", "attention", "moe", "lm_head")


# ---- analytic weight / state bytes per rank (stand-ins and the roofline cross-check) -----------------
def analytic_bytes(cfg, family, T, tp=C.TP_RANKS, dtype_bytes=2, context=0):
    """HBM bytes one rank must move for one launch of ``family`` at T tokens (weights, state, caches)."""
    H = cfg.hidden_size
    if family == "embedding":
        return T * H * dtype_bytes
    if family == "rmsnorm":
        return H * dtype_bytes + 2 * T * H * dtype_bytes
    if family == "gdn":
        kd, vd = cfg.linear_key_dim, cfg.linear_value_dim
        w = H * (2 * kd + 2 * vd + 2 * cfg.linear_num_value_heads) // tp + vd // tp * H
        w += cfg.conv_dim // tp * cfg.linear_conv_kernel_dim
        state = cfg.linear_num_value_heads // tp * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        return w * dtype_bytes + state * (1 + T)
    if family == "attention":
        D = cfg.head_dim
        q = H * 2 * cfg.num_attention_heads * D // tp          # q and its gate
        kv = 2 * H * D                                          # the rank's KV head
        o = cfg.num_attention_heads * D // tp * H
        cache = 2 * (context + T) * D * dtype_bytes
        return (q + kv + o) * dtype_bytes + cache
    if family == "moe":
        I, Ish = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
        experts = min(T * cfg.num_experts_per_tok, cfg.num_experts)
        return (H * cfg.num_experts + 3 * H * Ish // tp + experts * 3 * H * I // tp) * dtype_bytes
    if family == "lm_head":
        return cfg.vocab_size // tp * H * dtype_bytes
    if family == "mtp_fc":
        return 2 * H * H // tp * dtype_bytes
    raise ValueError(f"no analytic bytes for family {family!r}")


# ---- the round plan -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Call:
    stage: str          # D1 / V / D2
    family: str
    T: int
    count: int
    reduce_after: bool  # a TP all-reduce of the [T, H] output follows this launch


def round_plan(cfg):
    """The launches of one layerwise round, in order (counts fold the identical layers)."""
    n_lin = len(cfg.linear_layers)
    n_full = len(cfg.full_layers)
    L = cfg.num_hidden_layers
    mtp = []
    if cfg.mtp_num_hidden_layers:
        mtp = [("embedding", 1, 1, False), ("rmsnorm", 1, 2, False), ("mtp_fc", 1, 1, True),
               ("rmsnorm", 1, 1, False), ("attention", 1, 1, True), ("rmsnorm", 1, 1, False),
               ("moe", 1, 1, True), ("rmsnorm", 1, 1, False), ("lm_head", 1, 1, False)]
    verify = [("embedding", 2, 1, False), ("rmsnorm", 2, L, False), ("gdn", 2, n_lin, True),
              ("attention", 2, n_full, True), ("rmsnorm", 2, L, False), ("moe", 2, L, True),
              ("rmsnorm", 2, 1, False), ("lm_head", 2, 1, False)]
    out = []
    replay = mtp[:-2]  # D2 only writes the MTP KV row: no final MTP norm, no LM head (DESIGN.md §1)
    for stage, calls in (("D1", mtp), ("V", verify), ("D2", replay)):
        for fam, T, n, red in calls:
            if n:
                out.append(Call(stage, fam, T, n, red))
    return out


# ---- per-family traces -------------------------------------------------------------------------
def trace_family(cfg, family, T, tp=C.TP_RANKS, dtype="bfloat16", shape_only=True):
    """Trace ``nki_kernels.<family>.demo_args(cfg, tp, T, dtype, shape_only)``; None if the family (or its
    demo_args) does not exist yet. ``shape_only=False`` executes on the demo's data: needed where the
    traffic is data-dependent (MoE: a shape-only trace reads register values as 0, so all T tokens pick
    the same k experts -- the minimum traffic; executing shows one block per distinct expert)."""
    import nkisim
    try:
        mod = importlib.import_module(f"nki_kernels.{family}")
    except ImportError:
        return None
    demo = getattr(mod, "demo_args", None)
    if demo is None:
        return None
    kernel, args = demo(cfg, tp=tp, T=T, dtype=dtype, shape_only=shape_only)
    with nkisim.trace.capture() as tr:
        if isinstance(args, list):                          # per-rank argument tuples: a multi-rank launch
            nkisim.launch(kernel, args, tp=len(args))
        else:
            kernel(*args)
    return tr


@dataclass
class FamilyCost:
    family: str
    T: int
    latency_ns: float
    hbm_bytes_per_rank: float
    source: str                       # "trace" or "stand-in"
    prediction: Prediction | None = None
    error: str | None = None


EXECUTE_DEFAULT = ("moe",)     # families traced on data (data-dependent traffic), see trace_family


def family_costs(cfg, tp=C.TP_RANKS, dtype="bfloat16", pe_throttle=False, progress=None,
                 execute=EXECUTE_DEFAULT):
    """{(family, T): FamilyCost} for every (family, T) of the round plan; families in ``execute`` are
    traced executing on their demo data instead of shape-only."""
    out = {}
    keys = sorted({(c.family, c.T) for c in round_plan(cfg)})
    for fam, T in keys:
        if progress:
            progress(fam, T)
        tr, err = None, None
        if fam != "mtp_fc":
            try:
                tr = trace_family(cfg, fam, T, tp=tp, dtype=dtype, shape_only=fam not in execute)
            except Exception as e:      # a family under construction: report it, stand in for it
                err = f"{type(e).__name__}: {e}"
                tr = None
        if tr is not None and tr.instructions:
            p = predict(tr, stages="function", name=f"{fam} T={T}", pe_throttle=pe_throttle)
            src = "executed" if fam in execute else "trace"
            out[(fam, T)] = FamilyCost(fam, T, p.latency_ns, p.hbm_bytes / p.n_ranks, src, p)
        else:
            b = analytic_bytes(cfg, fam, T, tp=tp)
            t = C.DMA_SMALL_LATENCY_NS + b / C.HBM_BW_PER_RANK * 1e9
            out[(fam, T)] = FamilyCost(fam, T, t, b, "stand-in", None, err)
    return out


@dataclass
class RoundEstimate:
    """A per-round estimate: a composed layerwise round, or a megakernel round trace."""
    variant: str
    round_ns: float
    label: str
    stage_ns: dict                         # D1 / V / D2 -> ns
    part_ns: dict                          # (stage, part) -> ns, part = family / "launch overhead" / "all-reduce"
    hbm_bytes_per_rank: float
    bottlenecks: list                      # [(ns per round, what)] largest first
    families: dict = field(default_factory=dict)
    prediction: Prediction | None = None   # the megakernel's full-round prediction

    @property
    def roofline_ns(self):
        return self.hbm_bytes_per_rank / C.HBM_BW_PER_RANK * 1e9

    def tokens_per_s(self, acceptance):
        """Committed tokens per second when the draft is accepted with probability ``acceptance``
        (1 + acceptance tokens per round)."""
        return (1.0 + acceptance) / (self.round_ns * 1e-9)

    def summary(self, acceptance):
        return {
            "variant": self.variant, "label": self.label, "round_us": self.round_ns / 1e3,
            "acceptance": acceptance, "tokens_per_s": self.tokens_per_s(acceptance),
            "hbm_MB_per_rank": self.hbm_bytes_per_rank / 1e6,
            "achieved_GBps_per_rank": self.hbm_bytes_per_rank / self.round_ns,
            "hbm_utilisation_pct": 100.0 * self.hbm_bytes_per_rank / self.round_ns / (C.HBM_BW_PER_RANK / 1e9),
            "roofline_us": self.roofline_ns / 1e3,
            "stage_us": {k: v / 1e3 for k, v in self.stage_ns.items()},
            "part_us": {f"{s}/{p}": v / 1e3 for (s, p), v in self.part_ns.items()},
            "bottlenecks": [{"us": ns / 1e3, "what": w} for ns, w in self.bottlenecks[:10]],
            "families": {f"{f} T={T}": {"us": c.latency_ns / 1e3, "source": c.source,
                                        "hbm_MB_per_rank": c.hbm_bytes_per_rank / 1e6,
                                        **({"error": c.error} if c.error else {})}
                         for (f, T), c in sorted(self.families.items())},
        }


def compose_layerwise(cfg, fam_costs, tp=C.TP_RANKS):
    """Sum the round plan: launches x (kernel latency + launch head) + the all-reduces between them."""
    stage_ns = defaultdict(float)
    part_ns = defaultdict(float)
    bott = defaultdict(float)
    hbm = 0.0
    H = cfg.hidden_size
    for c in round_plan(cfg):
        fc = fam_costs[(c.family, c.T)]
        k = c.count
        stage_ns[c.stage] += k * (fc.latency_ns + C.LAUNCH_OVERHEAD_NS)
        part_ns[(c.stage, c.family)] += k * fc.latency_ns
        part_ns[(c.stage, "launch overhead")] += k * C.LAUNCH_OVERHEAD_NS
        bott[f"launch head x{'{n}'} ({C.LAUNCH_OVERHEAD_NS / 1e3:.1f} us each, NEFF instruction fetch)"] += \
            k * C.LAUNCH_OVERHEAD_NS
        hbm += k * fc.hbm_bytes_per_rank
        if c.reduce_after:
            ar = costs.collective_ns("all_reduce", c.T * H * 2, tp)
            stage_ns[c.stage] += k * ar
            part_ns[(c.stage, "all-reduce")] += k * ar
            bott[f"TP all-reduce of the layer output ({ar / 1e3:.1f} us each, serialised)"] += k * ar
        if c.family == "lm_head":           # agree on the argmax over the 8 vocabulary shards
            ag = costs.collective_ns("all_gather", 8, tp)
            stage_ns[c.stage] += ag
            part_ns[(c.stage, "argmax all-gather")] += ag
            bott["argmax all-gather after each LM head"] += ag
        if fc.prediction is not None:
            for ns, loc, eng, op, n in fc.prediction.critical:
                bott[f"{loc} {eng} {op} ({c.family} T={c.T})"] += k * ns
        else:
            bott[f"{c.family} T={c.T} (stand-in: weight bytes / bandwidth)"] += k * fc.latency_ns
    n_launch = sum(c.count for c in round_plan(cfg))
    bott = {w.replace("{n}", str(n_launch)): v for w, v in bott.items()}
    total = sum(stage_ns.values())
    stand = sorted({f"{f} T={T}" for (f, T), c in fam_costs.items() if c.source == "stand-in"})
    label = (f"composed from per-layer kernels: {n_launch} launches (per-launch head, residual HBM round trips "
             f"inside each kernel, TP all-reduce after each mixer/MoE)")
    if stand:
        label += "; stand-ins (bytes/bandwidth) for " + ", ".join(stand)
    ex = sorted({f for (f, T), c in fam_costs.items() if c.source == "executed"})
    if ex:
        label += "; executed on demo data (data-dependent traffic): " + ", ".join(ex)
    return RoundEstimate("layerwise (composed)", total, label, dict(stage_ns), dict(part_ns), hbm,
                         sorted(((v, w) for w, v in bott.items()), reverse=True), dict(fam_costs))


def roofline_round(cfg, fam_costs):
    """Round time if every byte of the composed round moved at the sustainable bandwidth and nothing else
    cost anything."""
    stage = defaultdict(float)
    part = defaultdict(float)
    hbm = 0.0
    for c in round_plan(cfg):
        b = c.count * fam_costs[(c.family, c.T)].hbm_bytes_per_rank
        hbm += b
        stage[c.stage] += b / C.HBM_BW_PER_RANK * 1e9
        part[(c.stage, c.family)] += b / C.HBM_BW_PER_RANK * 1e9
    t = sum(stage.values())
    return RoundEstimate("roofline", t, f"HBM bytes per rank / {C.HBM_BW_PER_RANK / 1e9:.0f} GB/s", dict(stage),
                         dict(part), hbm, [(t, "HBM bandwidth")])


def megakernel_round(cfg, tp=C.TP_RANKS, dtype="bfloat16", pe_throttle=False):
    """The full-round megakernel, if ``megakernel`` provides ``demo_args(cfg, tp, T, dtype, shape_only)``
    (same convention as the families; T=2 verify tokens) and optionally ``STAGES`` (a ``stages`` argument
    for :func:`predict`, e.g. {"D1": [...], "V": [...], "D2": [...]}). None until it exists."""
    import nkisim
    try:
        mod = importlib.import_module("megakernel")
    except ImportError:
        return None
    demo = getattr(mod, "demo_args", None)
    if demo is None:
        return None
    kernel, args = demo(cfg, tp=tp, T=2, dtype=dtype, shape_only=True)
    with nkisim.trace.capture() as tr:
        if isinstance(args, list):
            nkisim.launch(kernel, args, tp=len(args))
        else:
            kernel(*args)
    p = predict(tr, stages=getattr(mod, "STAGES", "function"), name="megakernel", pe_throttle=pe_throttle)
    return from_prediction("megakernel", p, "one launch per round (full-round trace)")


def from_prediction(variant, p: Prediction, label):
    bott = [(ns, f"{loc} {eng} {op} x{n}") for ns, loc, eng, op, n in p.critical]
    return RoundEstimate(variant, p.latency_ns + C.LAUNCH_OVERHEAD_NS, label + " + one launch head",
                         dict(p.critical_by_stage), {("round", s): v for s, v in p.critical_by_stage.items()},
                         p.hbm_bytes / p.n_ranks, bott, prediction=p)
