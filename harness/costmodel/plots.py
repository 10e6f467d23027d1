"""PNG plots (matplotlib, Agg): the round's engines x time timeline, the variants' round split with bands and
rooflines, and the per-layer critical-path breakdown."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .predict import CATEGORIES, engine_of  # noqa: E402
from .timeline import K_DMA  # noqa: E402

ROW_ENGINES = ("PE", "ACT", "DVE", "POOL", "SP", "DMA", "CC", "SR")
COLORS = {"PE": "tab:red", "ACT": "tab:green", "DVE": "tab:blue", "POOL": "tab:purple", "SP": "tab:gray",
          "DMA": "tab:orange", "CC": "tab:brown", "SR": "tab:olive", "sync": "tab:olive", "hand-off": "0.75",
          "loop boundary": "k"}


def _merged(iv, min_gap):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1] + min_gap:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e - s) for s, e in out]


def plot_timeline(pred, path, title, cores=("r0c0", "r0c1"), offset_ns=0.0):
    """Engines x time of one Prediction (rows: engines of each core in ``cores``), stage spans shaded at the
    top. Times in µs; ``offset_ns`` shifts the axis (e.g. the launch head before the kernel)."""
    T = pred.timeline
    P = T.program
    labs = [f"r{r}c{c}" for r, c in P.cores]
    rows = {}
    for i in range(len(P.recs)):
        lab = labs[P.core[i]]
        if cores is not None and lab not in cores:
            continue
        if P.kind[i] == K_DMA:
            eng = "DMA"
            a = T.work_start[i]
        else:
            eng = engine_of(T.streams[P.stream[i]][1])
            a = T.work_start[i]
        rows.setdefault((lab, eng), []).append((offset_ns + a, offset_ns + T.finish[i]))
    keys = sorted(rows, key=lambda k: (k[0], ROW_ENGINES.index(k[1]) if k[1] in ROW_ENGINES else 99))
    total = offset_ns + pred.latency_ns
    fig, ax = plt.subplots(figsize=(15, 0.35 * max(len(keys), 4) + 2.0))
    us = 1e-3
    min_gap = total * 2e-4
    for y, k in enumerate(keys):
        bars = _merged(rows[k], min_gap)
        ax.broken_barh([(s * us, d * us) for s, d in bars], (y - 0.4, 0.8), color=COLORS.get(k[1], "k"))
    for j, (st, (a, b)) in enumerate(pred.stage_span.items()):
        if st in ("other",):
            continue
        ax.axvspan((offset_ns + a) * us, (offset_ns + b) * us, ymin=0.0, ymax=1.0, alpha=0.06,
                   color="C%d" % (j % 10), lw=0)
    if offset_ns:
        ax.axvspan(0, offset_ns * us, color="0.8", alpha=0.6, lw=0)
        ax.text(offset_ns * us / 2, -0.6, "launch head", ha="center", fontsize=7)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{c} {e}" for c, e in keys], fontsize=8)
    ax.set_ylim(len(keys) - 0.4, -0.9)
    ax.set_xlim(0, total * us)
    ax.set_xlabel("time (µs)")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stages(estimates, path, title):
    """One stacked horizontal bar per variant (central, split by stage / part), the low-high band as a whisker,
    and beside each the roofline of that variant's own HBM bytes."""
    bars = []
    parts = []
    for est in estimates:
        segs = [(f"{s}/{p}" if s != "round" else p, v["central"]) for (s, p), v in est.part_ns.items()
                if v["central"] > 0]
        bars.append((est.variant, segs, est.round_ns))
        roof = est.roofline_ns()
        bars.append((f"roofline of the {est.variant} bytes", [("HBM bytes / bandwidth", roof["central"])], roof))
        for p, _ in segs:
            if p not in parts:
                parts.append(p)
    parts.append("HBM bytes / bandwidth")
    cmap = plt.get_cmap("tab20")
    color = {p: cmap(i % 20) for i, p in enumerate(parts)}
    color["HBM bytes / bandwidth"] = "0.6"
    fig, ax = plt.subplots(figsize=(13, 0.7 * len(bars) + 2.5))
    for y, (name, segs, band) in enumerate(bars):
        left = 0.0
        for p, v in segs:
            ax.barh(y, v / 1e3, left=left / 1e3, color=color[p], edgecolor="w", lw=0.3)
            left += v
        lo, c, hi = band["low"] / 1e3, band["central"] / 1e3, band["high"] / 1e3
        ax.errorbar([c], [y], xerr=[[c - lo], [hi - c]], fmt="none", ecolor="k", capsize=4, lw=1)
        ax.text(hi, y, f"  {c:,.0f} µs ({lo:,.0f}-{hi:,.0f})", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per round (bar: central; whisker: low-high band)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[p]) for p in parts]
    ax.legend(handles, parts, fontsize=6, loc="upper left", bbox_to_anchor=(1.01, 1.0), ncol=1 + len(parts) // 30)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_layers(rows, path, title):
    """Per-layer critical-path breakdown: one stacked bar per layer (in round order) by category."""
    labels = list(rows)
    cats = [c for c in CATEGORIES if any(r["by_category"].get(c, 0.0) for r in rows.values())]
    fig, ax = plt.subplots(figsize=(13, 0.22 * len(labels) + 2.0))
    for y, lab in enumerate(labels):
        left = 0.0
        for c in cats:
            v = rows[lab]["by_category"].get(c, 0.0) / 1e3
            if v:
                ax.barh(y, v, left=left, color=COLORS.get(c, "k"), edgecolor="w", lw=0.2)
                left += v
    ax.set_yticks(range(len(labels)))
    ax.set_yticklabels([f"{lab} ({rows[lab]['kind']})" for lab in labels], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("critical-path µs (central)")
    ax.set_title(title, fontsize=10)
    ax.legend([plt.Rectangle((0, 0), 1, 1, color=COLORS.get(c, "k")) for c in cats], cats, fontsize=7,
              loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
