"""Stage and layer tags of a traced launch of the megakernel, from its launch plan (``megakernel.plan``), and the
per-layer critical-path breakdown of a prediction: which stage, which layer, which part of it (mixer, MoE,
all-reduce, norms, ...) and which engine / DMA / collective / hand-off each microsecond of the critical path
belongs to.

``megakernel.round`` runs a stage of kind k in the function named k (``plan.stage_functions``) and every decoder
layer in ``decoder_layer``; nkisim records each instruction's kernel call stack. A stage is the outermost stage
function on the stack; a new call of ``decoder_layer`` starts where its frame line goes back (each call runs its
body top to bottom) or the frame reappears after instructions outside it, and the k-th call within a stage is
layer k of that stage in the plan. Parts come from the innermost kernel-body function on the stack (:data:`PARTS`).
"""
from __future__ import annotations

from collections import defaultdict

from .predict import CATEGORIES, category

LAYER_FUNCTION = "decoder_layer"
# innermost kernel-body function on the stack -> the part of a layer it is
PARTS = {"gdn_body": "mixer", "attention_body": "mixer",
         "kv_rows_inputs": "K/V rows", "kv_rows_project": "K/V rows", "kv_rows_write": "K/V rows",
         "moe_tkg_body": "MoE", "allreduce_partials": "all-reduce",
         "allreduce_lanes": "all-reduce", "rmsnorm_body": "norms", "residual_rmsnorm_body": "norms", "columns_body": "MTP fc", "allgather_cores": "MTP fc", "embedding_body": "embedding",
         "lm_head_argmax_body": "LM head", "argmax_combine": "argmax", "token_ids_from_best": "argmax",
         "_add_into": "residual add"}
# the verify stage's parts as stage tags ("V GDN", ...): where the round's time goes by layer type
V_PARTS = {"gdn_body": "GDN", "attention_body": "attention", "moe_tkg_body": "MoE", "lm_head_argmax_body": "LM head",
           "allreduce_partials": "all-reduce", "allreduce_lanes": "all-reduce", "rmsnorm_body": "norms",
           "residual_rmsnorm_body": "norms"}
KINDS = {"gdn": "linear_attention", "attention": "full_attention"}     # plan layer kinds -> config layer types


def _frames(rec):
    out = []
    for f in rec.get("stack") or ():
        file_line, _, fn = f.rpartition(":")
        out.append((fn, int(file_line.rpartition(":")[2] or 0)))
    return out          # innermost first


class StageTagger:
    """rec -> stage of a traced instruction of a launch of ``plan``: its stage name (D1, D2, ...), the verify stage
    split by layer part ("V GDN", "V attention", "V MoE", "V all-reduce", "V norms", "V LM head", plain "V"
    otherwise), "other" outside every stage. The ``stages`` argument of ``harness.costmodel.predict``."""

    def __init__(self, plan):
        from megakernel.plan import VERIFY, stage_functions
        self.functions = stage_functions(plan)
        self.verify = [s.name for s in plan.stages if s.kind == VERIFY][0]

    def __call__(self, rec) -> str:
        stage, part = "other", None     # the innermost stage function names the stage (D2 runs inside V's LM head)
        for frame in reversed(rec.get("stack") or []):
            fn = frame.rsplit(":", 1)[-1]
            if fn in self.functions:
                stage, part = self.functions[fn], None
            elif stage == self.verify and part is None and fn in V_PARTS:
                part = V_PARTS[fn]
        return f"{stage} {part}" if part else stage


def stage_tagger(plan) -> StageTagger:
    return StageTagger(plan)


def label_layers(recs, plan):
    """Per instruction: (layer label, layer kind, part). Labels: the plan's layer names in the verify stage
    ("L<i>", kind the config's layer type), "<stage> MTP" for a layer of another stage (kind "mtp"), and for
    instructions outside any layer "<stage> <part>" (e.g. "V LM head")."""
    from megakernel.plan import VERIFY, stage_functions
    functions = stage_functions(plan)
    layers = {s.name: s.layers for s in plan.stages}
    verify = [s.name for s in plan.stages if s.kind == VERIFY][0]
    state = {}          # (rank, core, stage) -> [calls, last line, active]
    out = []
    for rec in recs:
        fr = _frames(rec)
        stage = "other"
        for fn, _ in reversed(fr):
            if fn in functions:
                stage = functions[fn]
        part = "other"
        for fn, _ in fr:        # innermost first, within the innermost stage function
            if fn in functions:
                break
            if fn in PARTS:
                part = PARTS[fn]
                break
        key = (rec.get("rank", 0), rec.get("inst", 0), stage)
        st = state.setdefault(key, [-1, None, False])
        call = None
        for fn, line in fr:
            if fn == LAYER_FUNCTION:
                if not st[2] or st[1] is None or line < st[1]:
                    st[0] += 1
                st[1], st[2] = line, True
                call = st[0]
                break
        if call is None:
            st[2] = False
            out.append((f"{stage} {part}" if part != "other" else stage, "outside", part))
        elif stage == verify and call < len(layers[stage]):
            layer = layers[stage][call]
            out.append((layer.name, KINDS.get(layer.kind, layer.kind), part))
        else:
            out.append((f"{stage} MTP", "mtp", part))
    return out


def breakdown(pred, labels):
    """{layer label: {"kind", "total_ns", "by_category": {...}, "by_part": {...}}} of a Prediction's critical
    path (``pred.path``), in first-seen order along the round. Fence nodes count for the layer of the
    instruction they follow."""
    T = pred.timeline
    P = T.program
    n = len(P.recs)
    rows = {}
    for node, wait, own in reversed(pred.path):          # the path is stored last-first
        if node < n:
            lab, kind, part = labels[node]
        else:
            ci, k = T.fences[node - n]
            i = P.order[ci][k] if k >= 0 else P.order[ci][0]
            lab, kind, part = labels[i]
        r = rows.get(lab)
        if r is None:
            r = rows[lab] = {"kind": kind, "total_ns": 0.0, "by_category": defaultdict(float),
                             "by_part": defaultdict(float)}
        r["total_ns"] += wait + own
        r["by_category"]["hand-off"] += wait
        r["by_category"][category(T, node)] += own
        r["by_part"][part] += wait + own
    for r in rows.values():
        r["by_category"] = {c: r["by_category"].get(c, 0.0) for c in CATEGORIES}
        r["by_part"] = dict(r["by_part"])
    return rows


def per_kind(rows):
    """{layer kind: {"mean_ns", "layers", "parts_ns" (mean per layer), "by_category_ns" (mean)}} over the trunk
    layers of a breakdown."""
    acc = {}
    for r in rows.values():
        k = r["kind"]
        if k in ("outside", "mtp"):
            continue
        a = acc.setdefault(k, {"n": 0, "total": 0.0, "parts": defaultdict(float), "cats": defaultdict(float)})
        a["n"] += 1
        a["total"] += r["total_ns"]
        for p, v in r["by_part"].items():
            a["parts"][p] += v
        for c, v in r["by_category"].items():
            a["cats"][c] += v
    return {k: {"layers": a["n"], "mean_ns": a["total"] / a["n"],
                "parts_ns": {p: v / a["n"] for p, v in a["parts"].items()},
                "by_category_ns": {c: v / a["n"] for c, v in a["cats"].items()}} for k, a in acc.items()}


def table(rows, top=None) -> str:
    """The breakdown as a fixed-width table (us)."""
    cats = [c for c in CATEGORIES if any(r["by_category"].get(c, 0.0) for r in rows.values())]
    head = f"  {'layer':14s} {'kind':18s} {'total':>8s} " + " ".join(f"{c[:8]:>8s}" for c in cats)
    lines = [head]
    for lab, r in list(rows.items())[:top]:
        lines.append(f"  {lab:14s} {r['kind']:18s} {r['total_ns'] / 1e3:8.1f} " +
                     " ".join(f"{r['by_category'].get(c, 0.0) / 1e3:8.1f}" for c in cats))
    return "\n".join(lines)
