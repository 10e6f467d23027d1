"""Per-layer critical-path breakdown of a round megakernel prediction: which layer, which part of it (mixer,
MoE, all-reduce, norms, ...) and which engine / DMA / collective / hand-off each microsecond of the critical
path belongs to.

Layers are found from nkisim's recorded call stacks: every instruction issued under ``_trunk_layer`` /
``_mtp_layer`` (``megakernel/round.py``) belongs to a call of that function, and a new call starts where the
function's frame line goes back (each call runs its body top to bottom) or the frame reappears after
instructions outside it. Parts come from the innermost kernel-body function on the stack (:data:`PARTS`).
"""
from __future__ import annotations

from collections import defaultdict

from .predict import CATEGORIES, category

LAYER_FUNCTIONS = ("_trunk_layer", "_mtp_layer")
STAGE_FUNCTIONS = {"_draft": "D1", "_verify": "V", "_replay": "D2"}
# innermost kernel-body function on the stack -> the part of a layer it is
PARTS = {"gdn_body": "mixer", "attention_body": "mixer", "moe_tkg_body": "MoE", "allreduce_partials": "all-reduce",
         "rmsnorm_body": "norms", "columns_body": "MTP fc", "allgather_cores": "MTP fc", "embedding_body": "embedding",
         "lm_head_argmax_body": "LM head", "argmax_combine": "argmax", "token_ids_from_best": "argmax",
         "_add_into": "residual add"}


def _frames(rec):
    out = []
    for f in rec.get("stack") or ():
        file_line, _, fn = f.rpartition(":")
        out.append((fn, int(file_line.rpartition(":")[2] or 0)))
    return out          # innermost first


def label_layers(recs, layer_types=None):
    """Per instruction: (layer label, layer kind, part). Labels: "L<i>" for trunk call i (kind = the config's
    layer type when ``layer_types`` is given, else "trunk"), "D1 MTP" / "D2 MTP" for the MTP layer calls, and for
    instructions outside any layer "<stage> <part>" (e.g. "V LM head")."""
    state = {}          # core -> {function: [calls, last line, active]}
    out = []
    for rec in recs:
        ck = (rec.get("rank", 0), rec.get("inst", 0))
        st = state.setdefault(ck, {f: [-1, None, False] for f in LAYER_FUNCTIONS})
        fr = _frames(rec)
        stage = "other"
        for fn, _ in reversed(fr):
            if fn in STAGE_FUNCTIONS:
                stage = STAGE_FUNCTIONS[fn]
        part = "other"
        for fn, _ in fr:
            if fn in PARTS:
                part = PARTS[fn]
                break
        layer = None
        for fn, line in fr:
            if fn in LAYER_FUNCTIONS:
                s = st[fn]
                if not s[2] or s[1] is None or line < s[1]:
                    s[0] += 1
                s[1], s[2] = line, True
                layer = (fn, s[0])
                break
        for fn in LAYER_FUNCTIONS:
            if layer is None or layer[0] != fn:
                st[fn][2] = False
        if layer is None:
            out.append((f"{stage} {part}" if part != "other" else stage, "outside", part))
        elif layer[0] == "_trunk_layer":
            kind = layer_types[layer[1]] if layer_types is not None and layer[1] < len(layer_types) else "trunk"
            out.append((f"L{layer[1]}", kind, part))
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
