"""PNG plots (matplotlib, Agg): an engines x time timeline and a stage bar chart."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


ROW_ENGINES = ("PE", "ACT", "DVE", "POOL", "SP", "DMA", "CC")
COLORS = {"PE": "tab:red", "ACT": "tab:green", "DVE": "tab:blue", "POOL": "tab:purple", "SP": "tab:gray",
          "DMA": "tab:orange", "CC": "tab:brown", "gap": "0.85"}


def _merged(iv, min_gap):
    out = []
    for s, e in sorted(iv):
        if out and s <= out[-1][1] + min_gap:
            if e > out[-1][1]:
                out[-1][1] = e
        else:
            out.append([s, e])
    return [(s, e - s) for s, e in out]


def plot_timeline(segments, path, title, cores=None):
    """segments: [(label, offset_ns, Prediction | None, duration_ns)]; None = a gap (launch head,
    collective) drawn as a grey span, or a stand-in (label contains "stand-in") drawn hatched.
    Rows: engines of each core (r<rank>c<core>); times in µs."""
    rows = {}
    spans = []
    total = 0.0
    for label, off, p, dur in segments:
        total = max(total, off + dur)
        if p is None:
            spans.append((off, dur, label, "stand-in" if "stand-in" in label else "gap"))
            continue
        T = p.timeline
        P = T.program
        labs = [f"r{r}c{c}" for r, c in P.cores]
        for i in range(len(P.recs)):
            lab = labs[P.core[i]]
            if cores is not None and lab not in cores:
                continue
            name = P.streams[P.stream[i]][1]
            eng = "DMA" if name.startswith("DMA") else name
            rows.setdefault((lab, eng), []).append((off + T.work_start[i], off + T.finish[i]))
        spans.append((off, dur, label, "kernel"))
    keys = sorted(rows, key=lambda k: (k[0], ROW_ENGINES.index(k[1]) if k[1] in ROW_ENGINES else 99))
    fig, ax = plt.subplots(figsize=(14, 0.35 * max(len(keys), 4) + 1.6))
    us = 1e-3
    min_gap = total * 1e-4
    for y, k in enumerate(keys):
        bars = _merged(rows[k], min_gap)
        ax.broken_barh([(s * us, d * us) for s, d in bars], (y - 0.4, 0.8), color=COLORS.get(k[1], "k"))
    for off, dur, label, kind in spans:
        if kind == "gap":
            ax.axvspan(off * us, (off + dur) * us, color="0.8", alpha=0.5, lw=0)
        elif kind == "stand-in":
            ax.axvspan(off * us, (off + dur) * us, facecolor="none", edgecolor="0.5", hatch="//", lw=0)
        else:
            ax.axvline(off * us, color="0.6", lw=0.5, ls=":")
        ax.text((off + dur / 2) * us, len(keys) - 0.3, label, ha="center", va="bottom", fontsize=7, rotation=0)
    ax.set_yticks(range(len(keys)))
    ax.set_yticklabels([f"{c} {e}" for c, e in keys], fontsize=8)
    ax.set_ylim(-0.8, len(keys) + 0.6)
    ax.set_xlim(0, total * us)
    ax.set_xlabel("time (µs)")
    ax.set_title(title, fontsize=10)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_stages(estimates, path, title):
    """Stacked horizontal bars: one per (variant, stage), split by part (family / overhead / collective)."""
    bars = []
    parts = []
    for est in estimates:
        for stage in est.stage_ns:
            segs = [(p, v) for (s, p), v in est.part_ns.items() if s == stage and v > 0]
            bars.append((f"{est.variant}: {stage}", segs))
            for p, _ in segs:
                if p not in parts:
                    parts.append(p)
    cmap = plt.get_cmap("tab20")
    color = {p: cmap(i % 20) for i, p in enumerate(parts)}
    fig, ax = plt.subplots(figsize=(12, 0.5 * len(bars) + 2))
    for y, (name, segs) in enumerate(bars):
        left = 0.0
        for p, v in segs:
            ax.barh(y, v / 1e3, left=left / 1e3, color=color[p], edgecolor="w", lw=0.3)
            left += v
        ax.text(left / 1e3, y, f" {left / 1e3:.0f} µs", va="center", fontsize=8)
    ax.set_yticks(range(len(bars)))
    ax.set_yticklabels([b[0] for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("µs per round")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[p]) for p in parts]
    ax.legend(handles, parts, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
