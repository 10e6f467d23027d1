"""Benchmarks that print tables and write JSON / PNG under bench/ (DESIGN.md §5).

    python -m harness.bench predict [--acceptance 0.75] [--pe-throttle] [--trace T.json ...]
    python -m harness.bench calibrate

``predict``: the trn2 cost model (harness.costmodel) on real-shape traces of Qwen3.6-35B-A3B at TP=4,
LNC=2. Variants: the layerwise round composed from each subkernel family's ``demo_args`` trace, the
megakernel round (once ``megakernel.demo_args`` exists: one full-round trace), and the HBM roofline.
Prints a table per variant, writes bench/costmodel_predict.json, bench/costmodel_timeline.png (one
verify GDN layer, engines x time) and bench/costmodel_stages.png (stage split per variant).
``--trace`` predicts saved nkisim trace JSON files instead (e.g. a megakernel round).

``calibrate``: the model beside every published per-operation measurement of trn2-costs.md
(bench/costmodel_calibration.json and .md).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _fmt_us(ns):
    return f"{ns / 1e3:,.1f}"


def _variant_table(est, acceptance, top=6):
    s = est.summary(acceptance)
    lines = [f"== {est.variant} ==  ({est.label})",
             f"  round            {s['round_us']:>12,.1f} us",
             f"  tokens/s         {s['tokens_per_s']:>12,.1f}   (acceptance {acceptance:.2f} -> "
             f"{1 + acceptance:.2f} tokens/round)",
             f"  HBM per rank     {s['hbm_MB_per_rank']:>12,.1f} MB   {s['achieved_GBps_per_rank']:,.0f} GB/s achieved, "
             f"{s['hbm_utilisation_pct']:.1f}% of the sustainable 635 GB/s; roofline {s['roofline_us']:,.1f} us",
             "  stages           " + "   ".join(f"{k} {v:,.1f} us" for k, v in s["stage_us"].items())]
    parts = sorted(est.part_ns.items(), key=lambda kv: -kv[1])
    lines.append("  split            " + ", ".join(f"{st}/{p} {_fmt_us(v)}" for (st, p), v in parts[:8]))
    lines.append("  top bottlenecks (critical-path us per round):")
    for ns, what in est.bottlenecks[:top]:
        lines.append(f"    {ns / 1e3:>10,.1f}  {what}")
    return "\n".join(lines)


def _family_table(fams):
    lines = ["per-family kernels (one rank, LNC=2, real shapes; trace = shape-only, executed = run on demo data):",
             f"  {'kernel':16s} {'source':9s} {'us':>10s} {'HBM MB':>9s} {'GB/s':>7s} {'instr':>7s}  "
             f"{'PE%':>5s} {'ACT%':>5s} {'DVE%':>5s} {'POOL%':>5s} {'DMA%':>5s}  top critical-path item"]
    for (f, T), c in sorted(fams.items()):
        p = c.prediction
        gbps = c.hbm_bytes_per_rank / c.latency_ns if c.latency_ns else 0.0
        if p is not None:
            b = p.engine_busy_pct()
            top = p.critical[0] if p.critical else None
            tops = f"{top[0] / 1e3:.1f} us {top[2]} {top[3]} {top[1]}" if top else ""
            lines.append(f"  {f + ' T=' + str(T):16s} {c.source:9s} {c.latency_ns / 1e3:>10,.1f} "
                         f"{c.hbm_bytes_per_rank / 1e6:>9,.2f} {gbps:>7,.0f} {p.n_instructions:>7d}  "
                         f"{b['PE']:>5.1f} {b['ACT']:>5.1f} {b['DVE']:>5.1f} {b['POOL']:>5.1f} {b['DMA']:>5.1f}  {tops}")
        else:
            why = f"  ({c.error[:70]})" if c.error else "  (no demo_args yet)"
            lines.append(f"  {f + ' T=' + str(T):16s} {'stand-in':9s} {c.latency_ns / 1e3:>10,.1f} "
                         f"{c.hbm_bytes_per_rank / 1e6:>9,.2f} {gbps:>7,.0f} {'-':>7s}{why}")
    return "\n".join(lines)


def _layer_segments(cfg, fams):
    """One verify GDN layer of the layerwise round laid end to end: [(label, offset, Prediction|None, dur)]."""
    from harness.costmodel import constants as C
    from harness.costmodel import costs
    segs = []
    t = 0.0
    ar = costs.collective_ns("all_reduce", 2 * cfg.hidden_size * 2)
    mixer = "gdn" if cfg.linear_layers else "attention"
    for fam, reduce_after in (("rmsnorm", False), (mixer, True), ("rmsnorm", False), ("moe", True)):
        segs.append(("launch", t, None, C.LAUNCH_OVERHEAD_NS))
        t += C.LAUNCH_OVERHEAD_NS
        c = fams[(fam, 2)]
        label = fam if c.prediction is not None else f"{fam} (stand-in)"
        segs.append((label, t, c.prediction, c.latency_ns))
        t += c.latency_ns
        if reduce_after:
            segs.append(("all-reduce", t, None, ar))
            t += ar
    return segs


def cmd_predict(a):
    import nkisim
    nkisim.install()
    from tqdm import tqdm

    from harness.costmodel import compose, plots, predict
    from model.config import preset

    BENCH.mkdir(exist_ok=True)
    out = {"acceptance": a.acceptance, "model": a.model, "tp": a.tp, "pe_throttle": a.pe_throttle,
           "shape_only": bool(a.shape_only)}
    if a.trace:
        preds = []
        for path in a.trace:
            p = predict(path, stages=a.stages, name=Path(path).stem, pe_throttle=a.pe_throttle)
            print(p.table(top=10))
            est = compose.from_prediction(p.name, p, f"trace {path}")
            print(_variant_table(est, a.acceptance))
            preds.append(p.summary())
            plots.plot_timeline([(p.name, 0.0, p, p.latency_ns)], BENCH / f"costmodel_timeline_{p.name}.png",
                                f"{p.name}: predicted {p.latency_ns / 1e3:.1f} us")
        out["traces"] = preds
        (BENCH / "costmodel_predict_traces.json").write_text(json.dumps(out, indent=1))
        return 0

    cfg = preset(a.model)
    t0 = time.time()
    keys = sorted({(c.family, c.T) for c in compose.round_plan(cfg)})
    bar = tqdm(total=len(keys), desc="tracing families", file=sys.stderr, disable=a.quiet)

    def progress(fam, T):
        bar.set_postfix_str(f"{fam} T={T}")
        bar.update(1)
    execute = () if a.shape_only else compose.EXECUTE_DEFAULT
    fams = compose.family_costs(cfg, tp=a.tp, pe_throttle=a.pe_throttle, progress=progress, execute=execute)
    bar.close()
    variants = [compose.compose_layerwise(cfg, fams, tp=a.tp)]
    mk = compose.megakernel_round(cfg, tp=a.tp, pe_throttle=a.pe_throttle)
    if mk is not None:
        variants.append(mk)
    variants.append(compose.roofline_round(cfg, fams))

    print(f"trn2 cost model: {a.model}, TP={a.tp} x LNC=2, bf16, T=2 verify, per-round device time "
          f"(nkisim traces -> harness.costmodel; no hardware)\n")
    print(_family_table(fams))
    print()
    for est in variants:
        print(_variant_table(est, a.acceptance))
        print()
    if mk is None:
        print("megakernel: no megakernel.demo_args yet -- the layerwise figure above is composed from per-layer "
              "kernels; a full-round trace plugs in via megakernel.demo_args / --trace.\n")
    out["variants"] = [v.summary(a.acceptance) for v in variants]
    out["families"] = {f"{f} T={T}": (c.prediction.summary() if c.prediction else
                                      {"source": "stand-in", "latency_us": c.latency_ns / 1e3,
                                       "hbm_MB_per_rank": c.hbm_bytes_per_rank / 1e6, "error": c.error})
                       for (f, T), c in sorted(fams.items())}
    out["elapsed_s"] = time.time() - t0
    (BENCH / "costmodel_predict.json").write_text(json.dumps(out, indent=1))
    segs = _layer_segments(cfg, fams)
    plots.plot_timeline(segs, BENCH / "costmodel_timeline.png",
                        "one verify GDN layer of the layerwise round (T=2, rank 0, both cores): engines x time "
                        "(launch heads and all-reduces shaded)")
    plots.plot_stages(variants, BENCH / "costmodel_stages.png",
                      f"predicted round split per stage ({a.model}, TP={a.tp}, LNC=2)")
    print(f"wrote {BENCH / 'costmodel_predict.json'}, costmodel_timeline.png, costmodel_stages.png")
    return 0


def cmd_calibrate(a):
    from harness.costmodel import calibration
    BENCH.mkdir(exist_ok=True)
    rows = calibration.rows()
    md = calibration.markdown(rows)
    print(md)
    (BENCH / "costmodel_calibration.md").write_text(
        "# trn2 cost model vs published per-operation measurements\n\n"
        "Generated by `python -m harness.bench calibrate`. *how*: constant = the measurement is the model "
        "constant; fit = the formula was fitted on this row; formula = a formula fitted elsewhere (a real "
        "check); sim = a traced NKI micro-kernel (harness/costmodel/microkernels.py) through the timeline "
        "model.\n\n" + md + "\n")
    (BENCH / "costmodel_calibration.json").write_text(json.dumps(calibration.as_dicts(rows), indent=1))
    print(f"\nwrote {BENCH / 'costmodel_calibration.md'} and .json")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m harness.bench", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="per-round device time from real-shape traces (cost model)")
    p.add_argument("--model", default="qwen3.6-35b-a3b", help="model.config preset")
    p.add_argument("--tp", type=int, default=4)
    p.add_argument("--acceptance", type=float, default=0.75,
                   help="probability the draft token is accepted (tokens/round = 1 + acceptance)")
    p.add_argument("--pe-throttle", action="store_true", help="scale PE by the measured 1.69x throttle")
    p.add_argument("--trace", nargs="*", help="predict these saved nkisim trace JSON files instead")
    p.add_argument("--stages", default="function", help="stage tags for --trace: file | function | loc")
    p.add_argument("--shape-only", action="store_true",
                   help="trace every family shape-only (MoE then shows its minimum traffic: all tokens on the same "
                        "k experts); by default MoE executes on its demo data to show one block per distinct expert")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(fn=cmd_predict)
    c = sub.add_parser("calibrate", help="model vs the published per-op measurements (trn2-costs.md)")
    c.set_defaults(fn=cmd_calibrate)
    a = ap.parse_args(argv)
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
