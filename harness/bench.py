"""Benchmarks that print tables and write JSON / PNG under bench/ (DESIGN.md §5). No hardware is involved: every
time is the trn2 cost model's (harness.costmodel) on nkisim traces, as a band (low / central / high).

    python -m harness.bench predict [--context 2048] [--routing expected|min|max] [--draft-head bf16|fp8] [--json]
    python -m harness.bench predict --trace T.json ...
    python -m harness.bench kernel FILE::FUNCTION --arg x=128,512:bfloat16 ... [--int n=4] [--lnc 1|2] [--tp N] [--json]
    python -m harness.bench calibrate [--sdk PATH] [--nki-library PATH] [--seed PATH]
    python -m harness.bench robustness [--models embedded,random] [--prompts 4] [--tokens 12] [--json]
    python -m harness.bench nkisim-speed [--quick] [--no-model] [--context 4096] [--out FILE.json]

``predict``: one decode round of Qwen3.6-35B-A3B at TP=4 x LNC=2, T=2 verify, at a context of ``--context``
tokens (the pending token's position) and a routing model for the in-kernel top-k: the round megakernel as it
ships (one full-round trace, runtime loops), the layerwise variant (its stage kernels, composed as one XLA graph),
and the HBM roofline of each variant's own bytes. Prints the tables, writes bench/costmodel_predict.json,
bench/costmodel_stages.png, bench/costmodel_timeline.png (the megakernel round on rank 0's two cores),
bench/costmodel_layers.png and .md (the per-layer critical-path breakdown). ``--json`` prints the JSON object.

``kernel``: predicts any NKI kernel function from any file (its package context honoured) in shape-only mode:
``--arg NAME=D0,D1,...:DTYPE`` per tensor argument in the function's order, ``--int NAME=VALUE`` for an int
argument (``--int NAME=V0,V1,...:int32[:D0xD1]`` for a real integer array), ``--float NAME=VALUE``, ``--lnc`` /
``--tp`` for the launch; parameters not given take their defaults. Prints the time band, per-engine busy time,
bytes moved and the top critical-path items (``--json``:
one object). Bad input prints one line and exits 2.

``robustness``: the kernel variants teacher-forced against the CPU reference under nkisim's hardware-like
numerics (harness/robustness.py): |delta logit|, top-1 agreement, near-ties, first divergent token of a free run;
writes bench/robustness.json.

``nkisim-speed``: the interpreter's own speed (``python -m nkisim.bench``: instruction rates, a 2048^3 matmul, a
big shape-only trace) and the time to trace the shipped full-size round megakernel shape-only (TP=4 x LNC=2, the
``harness.kernel_cases`` round case at ``--context``); writes bench/nkisim_speed.json. Wall-clock figures need a
quiet machine (the JSON records the load average; ``*_cpu`` figures are process CPU time).

``calibrate``: the model beside every published per-operation measurement of trn2-costs.md, and its predictions
for published kernels (SDK tutorials, the nki-library kernels of the public sweep, the seed's isolated DeltaNet
layer) beside their published times where there are any (bench/costmodel_calibration.json and .md).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from harness.kernel_loading import BadInput, trace_kernel

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"


def _band(d, unit="us", fmt="{:,.1f}"):
    return f"{fmt.format(d['central'])} {unit} ({fmt.format(d['low'])} - {fmt.format(d['high'])})"


def _git_head():
    try:
        return subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


# ---- predict ------------------------------------------------------------------------------------------
def _layer_kinds(est, cfg):
    """layer_us of the contract: per layer kind {low, central, high, parts (central), by_category (central)}."""
    out = {}
    for kind, name in (("linear_attention", "gdn"), ("full_attention", "attention")):
        per = {e: est.layer_kinds[e].get(kind) for e in ("low", "central", "high")}
        if per["central"] is None:
            continue
        c = per["central"]
        out[name] = {e: per[e]["mean_ns"] / 1e3 for e in per} | {
            "layers": c["layers"], "parts": {k: v / 1e3 for k, v in c["parts_ns"].items()},
            "by_category": {k: v / 1e3 for k, v in c["by_category_ns"].items() if v}}
    return out


def _layerwise_layers(est, cfg, tp):
    """layer_us of the layerwise variant: a layer's launches (mixer stage + MoE stage, each with what the graph
    does after it), per end; parts central."""
    from harness.costmodel import constants as C
    out = {}
    each = {(stage, name): (n, e) for stage, name, n, e in est.launches}
    moe = [(n, e) for (st, name), (n, e) in each.items() if st == "V" and name.startswith("moe T=2")]
    tot = sum(n for n, _ in moe)
    moe_mean = {k: sum(n * e[k] for n, e in moe) / tot for k in C.ENDS}
    for mixer, name in (("gdn T=2", "gdn"), ("attention T=2", "attention")):
        hit = each.get(("V", mixer))
        if hit is None:
            continue
        m = hit[1]
        out[name] = {k: (m[k] + moe_mean[k]) / 1e3 for k in C.ENDS} | {
            "parts": {"mixer launch (+ all-reduce, add, hand-off)": m["central"] / 1e3,
                      "MoE launch (+ all-reduce, add, hand-off)": moe_mean["central"] / 1e3}}
    return out


def cmd_predict(a):
    import nkisim
    nkisim.install()
    from tqdm import tqdm

    from harness.costmodel import compose, constants as C, layers, plots, predict_band
    from harness.register_models import Routing
    from model.config import preset

    BENCH.mkdir(exist_ok=True)
    if a.trace:
        return _predict_traces(a)
    if a.context < 1:
        raise BadInput(f"predict: --context must be >= 1 (the pending token's position), got {a.context}")
    try:
        cfg = preset(a.model)
    except Exception as e:          # model.config.ConfigError: one line
        raise BadInput(f"predict: {e}") from None
    routing = Routing(a.routing, 2, cfg.num_experts_per_tok, cfg.num_experts)
    t0, c0 = time.time(), time.process_time()
    bar = tqdm(total=2 + 12, desc="predict", file=sys.stderr, disable=a.quiet or a.json, leave=False)

    def progress(what):
        bar.set_postfix_str(what[:60])
        bar.update(1)
    if a.draft_vocab:
        from megakernel.plan import draft_vocab_per_core
        try:
            draft_vocab_per_core(cfg, a.draft_vocab, a.tp * 2)
        except ValueError as e:
            raise BadInput(f"predict: --draft-vocab: {e}") from None
    draft_fp8 = a.draft_head == "fp8"
    if draft_fp8 and (a.device_commit or a.corrections or a.fp8_experts):
        raise BadInput("predict: --draft-head fp8 predicts the host-driven bf16 round alone (no --device-commit, "
                       "--fp8-experts or --corrections)")
    if a.fp8_experts:
        if a.device_commit or a.corrections:
            raise BadInput("predict: --fp8-experts predicts the host-driven round alone (no --device-commit, "
                           "no --corrections)")
        mk = compose.megakernel_round(cfg, a.context, routing, a.tp, 2, progress=progress, draft_vocab=a.draft_vocab,
                                      fp8_experts=True)
        bar.close()
        return _predict_fp8_experts(a, cfg, mk, routing, t0)
    if a.device_commit:
        mk = compose.megakernel_round(cfg, a.context, routing, a.tp, 2, progress=progress,
                                      draft_vocab=a.draft_vocab, device_commit=True)
        bar.close()
        return _predict_device_commit(a, mk, routing, t0)
    mk = compose.megakernel_round(cfg, a.context, routing, a.tp, 2, progress=progress, draft_vocab=a.draft_vocab,
                                  draft_fp8=draft_fp8)
    if a.draft_vocab or draft_fp8:
        bar.close()
        return _predict_drafts(a, cfg, mk, routing, t0)
    t_mk = time.time() - t0
    lw = compose.layerwise_round(cfg, a.context, routing, a.tp, 2, progress=progress)
    bar.close()
    acc = a.acceptance
    mks, lws = mk.summary(acc), lw.summary(acc)
    out = {
        "command": "python -m harness.bench predict " + " ".join(a.argv),
        "model": a.model, "tp": a.tp, "lnc": 2, "tokens_verified": 2, "dtype": "bfloat16",
        "context": a.context, "routing": routing.describe(), "measured_commit": _git_head(),
        "draft_vocab": None, "round_us": mks["round_us"], "stages_us": mks["stages_us"], "layer_us": _layer_kinds(mk, cfg),
        "distinct_experts": mk.notes["distinct_experts"], "kernel_parameters": mk.notes["kernel_parameters"],
        "tokens_per_s": mks["tokens_per_s"], "acceptance": acc,
        "end_to_end_round_us": mks["end_to_end_round_us"], "end_to_end_tokens_per_s": mks["end_to_end_tokens_per_s"],
        "critical_by_category_us": mk.notes["critical_by_category_us"],
        "band_anomalies_us": mk.notes["band_anomalies_us"],
        "instructions": mk.notes["instructions"], "runtime_loops": mk.notes["runtime_loops"],
        "bottlenecks": mks["bottlenecks"],
        "layers": [{"layer": lab, "kind": r["kind"], "total_us": r["total_ns"] / 1e3,
                    "by_category_us": {k: v / 1e3 for k, v in r["by_category"].items() if v},
                    "by_part_us": {k: v / 1e3 for k, v in r["by_part"].items()}} for lab, r in mk.layers.items()],
        "layerwise": {"round_us": lws["round_us"], "stages_us": lws["stages_us"],
                      "layer_us": _layerwise_layers(lw, cfg, a.tp), "distinct_experts": lw.notes["distinct_experts"],
                      "kernel_calls": lw.notes["kernel_calls"], "parts_us": lws["parts_us"],
                      "tokens_per_s": lws["tokens_per_s"], "end_to_end_round_us": lws["end_to_end_round_us"],
                      "end_to_end_tokens_per_s": lws["end_to_end_tokens_per_s"], "bottlenecks": lws["bottlenecks"],
                      "launches": [{"stage": s, "kernel": k, "count": n, "us_each": {e: v / 1e3 for e, v in d.items()}}
                                   for s, k, n, d in lw.launches], "label": lw.label},
        "roofline_us": {"megakernel": mks["roofline_us"], "layerwise": lws["roofline_us"]},
        "hbm_MB_per_rank": {"megakernel": mks["hbm_MB_per_rank"], "layerwise": lws["hbm_MB_per_rank"]},
        "host_dispatch_us_outside_device_time": C.HOST_ROUND_NS / 1e3,
        "assumptions": C.assumptions(),
        "elapsed_s": {"total_wall": round(time.time() - t0, 1), "total_cpu": round(time.process_time() - c0, 1),
                      "megakernel_wall": round(t_mk, 1)},
    }
    if a.corrections:
        out["corrections"] = compose.corrections(cfg, a.context, routing, a.tp, 2,
                                                 progress=None if a.quiet or a.json else
                                                 (lambda s: print(f"  corrections: {s}", file=sys.stderr)))
    (BENCH / "costmodel_predict.json").write_text(json.dumps(out, indent=1))
    title = f"{a.model}, TP={a.tp} x LNC=2, T=2 verify, context {a.context}, routing {a.routing}"
    plots.plot_stages([mk, lw], BENCH / "costmodel_stages.png", f"predicted round ({title})")
    plots.plot_timeline(mk.prediction.central, BENCH / "costmodel_timeline.png",
                        f"megakernel round, rank 0 (both cores), central: {mk.round_ns['central'] / 1e3:,.0f} us "
                        f"incl. the launch head ({title}); stage spans shaded", offset_ns=C.LAUNCH_OVERHEAD_NS)
    plots.plot_layers(mk.layers, BENCH / "costmodel_layers.png",
                      f"megakernel critical path per layer, central ({title})")
    (BENCH / "costmodel_layers.md").write_text(
        f"# Megakernel critical path per layer\n\nGenerated by `{out['command']}` at commit {out['measured_commit']} "
        f"({title}). Central band; us of the round's critical path spent in each layer, by what was on it "
        f"(hand-off = waits after a release: semaphores, queues, DGEs).\n\n" + _md_layers(mk.layers) + "\n")
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    _print_predict(out, mk, lw, layers)
    print(f"\nwrote {BENCH / 'costmodel_predict.json'}, costmodel_stages.png, costmodel_timeline.png, "
          f"costmodel_layers.png/.md ({out['elapsed_s']['total_wall']:.0f} s wall, "
          f"{out['elapsed_s']['total_cpu']:.0f} s CPU)")
    return 0


def _megakernel_variant(a, cfg, mk, routing, t0, **fields):
    """The JSON of a megakernel-only predict variant (``fields`` first, then the round's figures)."""
    s = mk.summary(a.acceptance)
    out = {"command": "python -m harness.bench predict " + " ".join(a.argv),
           "model": a.model, "tp": a.tp, "lnc": 2, "dtype": "bfloat16"}
    out.update(fields)
    out.update({
        "context": a.context, "routing": routing.describe(), "measured_commit": _git_head(),
        "draft_vocab": a.draft_vocab or None, "label": mk.label, "acceptance": a.acceptance,
        "round_us": s["round_us"], "stages_us": s["stages_us"], "layer_us": _layer_kinds(mk, cfg),
        "tokens_per_s": s["tokens_per_s"], "end_to_end_round_us": s["end_to_end_round_us"],
        "roofline_us": s["roofline_us"], "hbm_MB_per_rank": s["hbm_MB_per_rank"],
        "critical_by_category_us": s["critical_by_category_us"], "band_anomalies_us": s["band_anomalies_us"],
        "instructions": s["instructions"], "kernel_parameters": s["kernel_parameters"],
        "bottlenecks": s["bottlenecks"], "elapsed_s": {"total_wall": round(time.time() - t0, 1)},
    })
    return out


def _predict_drafts(a, cfg, mk, routing, t0):
    """``predict --draft-vocab N`` and / or ``--draft-head fp8``: the round whose drafts argmax over an FR-Spec draft
    head of N ids (``model.draft_vocab``) and / or the opt-in fp8 draft head (``nki_kernels.lm_head`` "fp8 draft
    head") -> bench/costmodel_predict_draft_vocab.json (the FR-Spec head alone) or costmodel_predict_draft_fp8.json,
    megakernel only (the headline JSON and plots stay the default round's). Output unchanged: the verify keeps the
    full bf16 head; the acceptance the drafts keep is not modelled."""
    fp8 = a.draft_head == "fp8"
    heads = []
    if a.draft_vocab:
        heads.append(f"an FR-Spec draft head of {a.draft_vocab} ids")
    if fp8:
        heads.append("an fp8 draft head")
    what = " and ".join(heads)
    out = _megakernel_variant(a, cfg, mk, routing, t0, **({"draft_head": "float8_e4m3"} if fp8 else {}),
                              numerics=f"tokens unchanged (the verify keeps the full bf16 head); the drafts' acceptance "
                                       f"with {what} is not modelled (acceptance below is assumed)")
    path = BENCH / ("costmodel_predict_draft_fp8.json" if fp8 else "costmodel_predict_draft_vocab.json")
    return _write_variant(a, out, path, (
        f"megakernel round, drafts over {what} ({a.model}, TP={a.tp} x LNC=2, context {a.context}, routing "
        f"{a.routing}, commit {out['measured_commit']})",
        f"  round            {_band(out['round_us'])}   tokens/s {out['tokens_per_s']['central']:,.0f} at "
        f"acceptance {a.acceptance} (assumed)"))


def _predict_fp8_experts(a, cfg, mk, routing, t0):
    """``predict --fp8-experts``: the round with the opt-in fp8 experts tables (``nki_kernels.moe`` "fp8 experts")
    -> bench/costmodel_predict_fp8_experts.json. It changes the model's output: an experiment, never the target's
    figure (the headline JSON and plots stay the bf16 round's)."""
    out = _megakernel_variant(a, cfg, mk, routing, t0, experts_dtype="float8_e4m3",
                              numerics="changes the model's output (fp8 routed experts): does not count toward "
                                       "the target")
    return _write_variant(a, out, BENCH / "costmodel_predict_fp8_experts.json", (
        f"megakernel round, fp8 experts -- changes the output, not the target's figure ({a.model}, TP={a.tp} x "
        f"LNC=2, context {a.context}, routing {a.routing}, commit {out['measured_commit']})",
        f"  round            {_band(out['round_us'])}   tokens/s {out['tokens_per_s']['central']:,.0f} at "
        f"acceptance {a.acceptance}"))


def _write_variant(a, out, path, lines):
    """Write a variant's predict JSON to ``path``; print it (``--json``) or ``lines``, its stages and the path."""
    path.write_text(json.dumps(out, indent=1))
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for line in lines:
        print(line)
    print("  stages           " + "   ".join(f"{k} {_band(v)}" for k, v in out["stages_us"].items()))
    print(f"\nwrote {path} ({out['elapsed_s']['total_wall']:.0f} s wall)")
    return 0


def _predict_device_commit(a, mk, routing, t0):
    """``predict --device-commit``: the device-committed round (``megakernel.plan`` device_commit) and its chained
    end-to-end band -> bench/costmodel_predict_device_commit.json (the headline JSON and plots stay the
    host-driven round's)."""
    from harness.costmodel import constants as C
    s = mk.summary(a.acceptance)
    out = {
        "command": "python -m harness.bench predict " + " ".join(a.argv),
        "model": a.model, "tp": a.tp, "lnc": 2, "dtype": "bfloat16", "context": a.context,
        "routing": routing.describe(), "measured_commit": _git_head(), "draft_vocab": a.draft_vocab or None,
        "device_commit": True, "label": mk.label, "acceptance": a.acceptance,
        "round_us": s["round_us"], "stages_us": s["stages_us"], "tokens_per_s": s["tokens_per_s"],
        "chained_end_to_end_round_us": s["chained_end_to_end_round_us"],
        "chained_end_to_end_tokens_per_s": s["chained_end_to_end_tokens_per_s"],
        "chained_host_us_per_round": s["chained_host_us_per_round"],
        "host_driven_gap_us": C.HOST_ROUND_NS / 1e3,
        "critical_by_category_us": s["critical_by_category_us"], "band_anomalies_us": s["band_anomalies_us"],
        "instructions": s["instructions"], "kernel_parameters": s["kernel_parameters"],
        "bottlenecks": s["bottlenecks"], "assumptions": C.assumptions(),
        "elapsed_s": {"total_wall": round(time.time() - t0, 1)},
    }
    ch = out["chained_end_to_end_round_us"]
    return _write_variant(a, out, BENCH / "costmodel_predict_device_commit.json", (
        f"megakernel round, accept and commit on device ({a.model}, TP={a.tp} x LNC=2, context {a.context}, "
        f"routing {a.routing}, commit {out['measured_commit']})",
        f"  device           {_band(out['round_us'])}   tokens/s {out['tokens_per_s']['central']:,.0f} at "
        f"acceptance {a.acceptance}",
        f"  back to back     {_band(ch['host_hidden'])} (host enqueue hidden) .. {_band(ch['host_exposed'])} "
        f"(the whole {out['host_driven_gap_us']:,.0f} us host-driven gap exposed)"))


def _md_layers(rows):
    from harness.costmodel.predict import CATEGORIES
    cats = [c for c in CATEGORIES if any(r["by_category"].get(c, 0.0) for r in rows.values())]
    lines = ["| layer | kind | total | " + " | ".join(cats) + " |", "|---|---|---:|" + "---:|" * len(cats)]
    for lab, r in rows.items():
        lines.append(f"| {lab} | {r['kind']} | {r['total_ns'] / 1e3:,.1f} | " +
                     " | ".join(f"{r['by_category'].get(c, 0.0) / 1e3:,.1f}" for c in cats) + " |")
    return "\n".join(lines)


def _print_predict(out, mk, lw, layers):
    print(f"trn2 cost model (no hardware): {out['model']}, TP={out['tp']} x LNC=2, T=2 verify, bf16, "
          f"context {out['context']}, routing {out['routing']['mode']} "
          f"({out['routing']['mean_distinct_experts']:.2f} distinct experts per verify layer), commit "
          f"{out['measured_commit']}")
    print("band = central (low - high); the ends come from the uncertain constants listed in the JSON 'assumptions'\n")
    print(f"megakernel round   {_band(out['round_us'])}   tokens/s {out['tokens_per_s']['central']:,.0f} at "
          f"acceptance {out['acceptance']}")
    print(f"  end to end       {_band(out['end_to_end_round_us'])}   tokens/s "
          f"{out['end_to_end_tokens_per_s']['central']:,.0f}  (device + {out['host_dispatch_us_outside_device_time']:,.0f} us "
          f"host dispatch per host-driven round, measured around the public kernel)")
    print("  stages           " + "   ".join(f"{s} {_band(v)}" for s, v in out["stages_us"].items()))
    for k, v in out["layer_us"].items():
        print(f"  {k} layer (critical path, mean)  {_band(v)}   parts: " +
              ", ".join(f"{p} {x:,.1f}" for p, x in sorted(v["parts"].items(), key=lambda kv: -kv[1])))
    print("  critical path by kind (central us): " + ", ".join(
        f"{k} {v:,.0f}" for k, v in out["critical_by_category_us"]["central"].items() if v))
    print(f"  {out['instructions']:,} instructions, {out['runtime_loops']:,} runtime loops, "
          f"{out['kernel_parameters']['count']} HBM tensor parameters "
          f"({out['kernel_parameters']['bytes'] / 1e9:.2f} GB "
          f"per rank)")
    print(f"layerwise round    {_band(out['layerwise']['round_us'])}   ({out['layerwise']['kernel_calls']} NKI calls "
          f"in one XLA graph)")
    print(f"  end to end       {_band(out['layerwise']['end_to_end_round_us'])}")
    print("  stages           " + "   ".join(f"{s} {_band(v)}" for s, v in out["layerwise"]["stages_us"].items()))
    for name in ("megakernel", "layerwise"):
        print(f"roofline ({name} bytes, {out['hbm_MB_per_rank'][name]:,.0f} MB/rank)  {_band(out['roofline_us'][name])}")
    print("\nmegakernel critical path per layer (central us):")
    print(layers.table(mk.layers))
    if "corrections" in out:
        print("\nwhat each correction does to the central megakernel round (us; without = the round with only that "
              "correction taken out):")
        for r in out["corrections"]["rows"]:
            print(f"  {r['effect_us']:>+10,.1f}  (without: {r['without_us']:>10,.1f})  {r['correction']}")
    print("\nmegakernel top critical-path items (central):")
    for b in out["bottlenecks"][:8]:
        print(f"  {b['us']:>9,.1f} us  {b['what']}")


def _predict_traces(a):
    from harness.costmodel import predict_band
    res = []
    for path in a.trace:
        if not os.path.isfile(path):
            raise BadInput(f"predict: no such trace file: {path}")
        try:
            b = predict_band(path, stages=a.stages, name=Path(path).stem)
        except (ValueError, KeyError, json.JSONDecodeError) as e:
            raise BadInput(f"predict: {path} is not an nkisim trace ({type(e).__name__}: {e})") from None
        res.append(b.summary())
        if not a.json:
            print(f"{b.name}: {_band(b.time_us())}")
            print(b.central.table(top=10))
    out = {"traces": res}
    (BENCH / "costmodel_predict_traces.json").write_text(json.dumps(out, indent=1))
    if a.json:
        print(json.dumps(out, indent=1))
    return 0


# ---- kernel --------------------------------------------------------------------------------------------
def kernel_summary(band, name, lnc, tp):
    """The --json object of the kernel command."""
    c = band.central
    return {"kernel": name, "lnc": lnc, "tp": tp, "time_us": band.time_us(),
            "engines": {"busy_us": c.summary()["engine_busy_us"], "busy_pct": c.engine_busy_pct()},
            "bytes": {"hbm_read": c.hbm_read_bytes, "hbm_write": c.hbm_write_bytes, "dma": c.dma_bytes,
                      "per_rank_hbm": c.hbm_bytes / c.n_ranks},
            "roofline_us": c.roofline_ns / 1e3, "instructions": c.n_instructions,
            "critical_path": c.summary()["critical_path_top"][:10],
            "critical_by_category_us": c.summary()["critical_by_category_us"],
            "stage_us": band.stage_us(), "assumptions": band.summary()["assumptions"]}


def cmd_kernel(a):
    from harness.costmodel import predict_band
    tr, name = trace_kernel(a.target, a.arg or (), a.int or (), a.lnc, a.tp, a.float or ())
    band = predict_band(tr, stages="function", name=name)
    s = kernel_summary(band, name, a.lnc, a.tp)
    if a.json:
        print(json.dumps(s, indent=1))
        return 0
    c = band.central
    print(f"{name} ({a.target}, LNC={a.lnc}, TP={a.tp}, shape-only): predicted {_band(s['time_us'])}")
    print(f"  {c.n_instructions:,} instructions; HBM read {c.hbm_read_bytes / 1e6:,.3f} MB, write "
          f"{c.hbm_write_bytes / 1e6:,.3f} MB, all DMA {c.dma_bytes / 1e6:,.3f} MB; roofline {s['roofline_us']:,.2f} us")
    print("  engine busy (central, mean over cores): " + ", ".join(
        f"{e} {v:,.2f} us" for e, v in s["engines"]["busy_us"].items() if v))
    print("  critical path by kind (us): " + ", ".join(
        f"{k} {v:,.2f}" for k, v in s["critical_by_category_us"].items() if v))
    print("  top critical-path items:")
    for it in s["critical_path"][:8]:
        print(f"    {it['ns'] / 1e3:9.2f} us  {it['engine']:5s} {it['op']:22s} x{it['count']:<5d} {it['loc']}")
    return 0


# ---- nkisim-speed ----------------------------------------------------------------------------------------
def cmd_nkisim_speed(a):
    from nkisim import bench as sim_bench
    if a.context < 1:
        raise BadInput(f"nkisim-speed: --context must be >= 1, got {a.context}")
    res = sim_bench.run(quick=a.quick)
    if not (a.quick or a.no_model):
        from harness.kernel_cases import round_case
        from model.config import preset
        t0 = time.perf_counter()
        case = round_case(preset("qwen3.6-35b-a3b"), context=a.context)
        t1, c1 = time.perf_counter(), time.process_time()
        tr = case.trace()
        dt, dc = time.perf_counter() - t1, time.process_time() - c1
        res["model_round"] = (f"qwen3.6-35b-a3b round megakernel as shipped (harness.kernel_cases.round_case), TP=4 x "
                              f"LNC=2, T={case.tokens}, context {a.context}, {case.routing.mode} routing, shape-only")
        res["model_round_args_s"] = round(t1 - t0, 2)
        res["model_round_instructions"] = len(tr.instructions)
        res["model_round_trace_s"] = round(dt, 2)
        res["model_round_trace_cpu_s"] = round(dc, 2)
    sim_bench.print_figures(res)
    out = a.out or (None if a.quick or a.no_model else BENCH / "nkisim_speed.json")   # partial runs: printed only
    if out is not None:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
        print(f"wrote {out}")
    return 0


# ---- calibrate -------------------------------------------------------------------------------------------
def cmd_calibrate(a):
    from harness.costmodel import calibration
    BENCH.mkdir(exist_ok=True)
    roots = {"sdk": a.sdk, "nki-library": a.nki_library, "seed": a.seed}
    for k, v in roots.items():
        if v is not None and not os.path.isdir(v):
            raise BadInput(f"calibrate: --{k} {v}: no such directory")
    rows = calibration.rows()
    kernels = calibration.kernel_rows(roots, progress=None if a.quiet else
                                      (lambda s: print(f"  {s}", file=sys.stderr)))
    md = calibration.markdown(rows, kernels)
    print(md)
    (BENCH / "costmodel_calibration.md").write_text(md + "\n")
    (BENCH / "costmodel_calibration.json").write_text(json.dumps(
        {"operations": calibration.as_dicts(rows), "kernels": kernels, "commit": _git_head()}, indent=1))
    print(f"\nwrote {BENCH / 'costmodel_calibration.md'} and .json")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m harness.bench", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("predict", help="per-round device time band of the megakernel and the layerwise variant")
    p.add_argument("--model", default="qwen3.6-35b-a3b", help="model.config preset (default qwen3.6-35b-a3b)")
    p.add_argument("--tp", type=int, default=4, choices=[4], help="TP ranks (the round kernel is built for 4)")
    p.add_argument("--context", type=int, default=2048,
                   help="position of the pending token = tokens already in the KV caches (default 2048)")
    p.add_argument("--routing", default="expected", choices=["expected", "min", "max"],
                   help="distinct experts per verify layer: expected (15.75 for top-8 of 256), min (8), max (16)")
    p.add_argument("--acceptance", type=float, default=0.75,
                   help="probability the draft token is accepted (tokens/round = 1 + acceptance)")
    p.add_argument("--draft-vocab", type=int, default=0, metavar="N",
                   help="predict the megakernel round whose MTP drafts argmax over an FR-Spec draft head of N ids "
                        "(model.draft_vocab; the verify keeps the full vocabulary); writes "
                        "bench/costmodel_predict_draft_vocab.json only (no layerwise, no plots). Default off")
    p.add_argument("--draft-head", default="bf16", choices=["bf16", "fp8"],
                   help="fp8: predict the megakernel round whose MTP drafts argmax over the opt-in fp8 (e4m3) copy of "
                        "their head (with --draft-vocab N: of the N ids; the verify keeps the bf16 head, so the "
                        "tokens are unchanged); writes bench/costmodel_predict_draft_fp8.json only (no layerwise, no "
                        "plots). Default bf16")
    p.add_argument("--device-commit", action="store_true",
                   help="predict the opt-in device-committed round (accept and commit on device, rounds launched back "
                        "to back) and its end-to-end band (host enqueue hidden .. the measured host-driven gap); "
                        "writes bench/costmodel_predict_device_commit.json only (no layerwise, no plots)")
    p.add_argument("--fp8-experts", action="store_true",
                   help="predict the round with the routed experts in float8_e4m3 (per-channel scales; opt-in "
                        "experiment: it changes the model's output and never counts toward the target); writes "
                        "bench/costmodel_predict_fp8_experts.json only (no layerwise, no plots)")
    p.add_argument("--corrections", action="store_true",
                   help="also measure what each correction of issue 13 does to the central megakernel round (re-traces "
                        "the round three times: several minutes); adds 'corrections' to the JSON")
    p.add_argument("--trace", nargs="*", help="predict these saved nkisim trace JSON files instead")
    p.add_argument("--stages", default="function", help="stage tags for --trace: file | function | loc")
    p.add_argument("--json", action="store_true", help="print the JSON object (also written to bench/)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(fn=cmd_predict)
    k = sub.add_parser("kernel", help="predict any NKI kernel function (shape-only trace)",
                       description="Trace FILE::FUNCTION shape-only under nkisim and predict it with the trn2 cost "
                                   "model (band: low / central / high).")
    k.add_argument("target", help="FILE::FUNCTION (an @nki.jit kernel or a plain kernel function)")
    k.add_argument("--arg", action="append", metavar="NAME=D0,D1,...:DTYPE",
                   help="a tensor argument, e.g. --arg x=128,512:bfloat16 (repeat, in the function's order)")
    k.add_argument("--int", action="append", metavar="NAME=VALUE",
                   help="an int argument (--int n=4), or a real integer array: --int pos=2048:int32:1x1")
    k.add_argument("--float", action="append", metavar="NAME=VALUE", help="a float argument, e.g. --float eps=1e-6")
    k.add_argument("--lnc", type=int, default=1, help="1 or 2 physical cores per launch (default 1)")
    k.add_argument("--tp", type=int, default=1, help="ranks (nkisim.launch with collectives), default 1")
    k.add_argument("--json", action="store_true", help="print one JSON object")
    k.set_defaults(fn=cmd_kernel)
    c = sub.add_parser("calibrate", help="model vs the published per-op measurements and kernel times")
    c.add_argument("--sdk", help="checkout of aws-neuron/aws-neuron-sdk (tutorial kernels under nki/examples)")
    c.add_argument("--nki-library", help="checkout of aws-neuron/nki-library")
    c.add_argument("--seed", help="checkout of KevGomes1403/nki-moe-megakernel (the isolated DeltaNet layer)")
    c.add_argument("--quiet", action="store_true")
    c.set_defaults(fn=cmd_calibrate)
    from harness import robustness
    r = sub.add_parser("robustness", help="kernel variants under hardware-like numerics vs the reference (logits)",
                       description=robustness.__doc__.split("\n\n")[0])
    robustness.add_arguments(r)
    r.set_defaults(fn=robustness.cmd)
    n = sub.add_parser("nkisim-speed", help="nkisim's own speed and the time to trace the full-size round",
                       description="The interpreter's speed (nkisim.bench) and the shape-only trace time of the "
                                   "shipped full-size round megakernel; writes bench/nkisim_speed.json.")
    n.add_argument("--quick", action="store_true", help="smaller sizes, no model round (a smoke run)")
    n.add_argument("--no-model", action="store_true", help="skip the full-size round (~15-45 s on an idle machine)")
    n.add_argument("--context", type=int, default=4096, help="the round's context (pending token's position), default 4096")
    n.add_argument("--out", help="JSON output (default bench/nkisim_speed.json; --quick / --no-model runs only print)")
    n.set_defaults(fn=cmd_nkisim_speed)
    from harness import prefill
    pf = sub.add_parser("prefill", help="time to first token of the NKI prefill pass (band) vs teacher-forced and floor",
                        description=prefill.__doc__.split("\n\n")[0])
    prefill.add_arguments(pf)
    pf.set_defaults(fn=prefill.cmd)
    from harness import spec_bench
    sp = sub.add_parser("spec", help="chained MTP drafts K = 1..3: measured acceptance x predicted round time -> tok/s",
                        description=spec_bench.__doc__.split("\n\n")[0])
    spec_bench.add_arguments(sp)
    sp.set_defaults(fn=spec_bench.cmd)
    argv = sys.argv[1:] if argv is None else list(argv)
    a = ap.parse_args(argv)
    a.argv = argv[1:]
    try:
        return a.fn(a)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
