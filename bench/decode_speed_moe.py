"""MoE decode stage alone, from the trn2 cost model (issue 15, the MoE lever table in bench/decode_speed_moe.md).

    python bench/decode_speed_moe.py [--label TEXT] [--json]

Traces the layerwise MoE stage launch (``harness.kernel_cases.stage_case(cfg, "moe", 2, distinct=n)``: post-attention
norm + ``nki_kernels.moe.moe_tkg_body`` on rank 0, T = 2 verify tokens, LNC = 2) shape-only with the routing
provider fixing n distinct experts, for n = 15 and n = 16 (the two counts of the "expected" routing pattern
15, 16, 16, 16: mean 15.75, harness/register_models.py), and predicts each with the band (low / central / high).
Prints one line per n, the routing-weighted mean band, the critical path by kind and the HBM floor (the launch's
own bytes over the band's rank bandwidth), and writes bench/decode_speed_moe.json (``--label`` names the row).
No hardware is involved.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PATTERN = (15, 16, 16, 16)      # distinct experts of consecutive T=2 calls under routing "expected"


def measure(n):
    from harness.costmodel import predict_band
    from harness.kernel_cases import stage_case
    from model.config import preset
    band = predict_band(stage_case(preset("qwen3.6-35b-a3b"), "moe", 2, distinct=n).trace(), stages="function")
    c = band.central
    return {"distinct": n, "time_us": band.time_us(), "critical_by_category_us": c.summary()["critical_by_category_us"],
            "hbm_MB_per_rank": c.hbm_bytes / c.n_ranks / 1e6, "roofline_us": c.roofline_ns / 1e3,
            "instructions": c.n_instructions}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--label", default="current", help="name of this measurement in the JSON (default: current)")
    ap.add_argument("--json", action="store_true", help="print the JSON object instead of the table")
    a = ap.parse_args(argv)
    rows = {n: measure(n) for n in sorted(set(PATTERN))}
    mean = {e: sum(rows[n]["time_us"][e] for n in PATTERN) / len(PATTERN) for e in ("low", "central", "high")}
    floor = sum(rows[n]["roofline_us"] for n in PATTERN) / len(PATTERN)
    try:
        commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    out = {"label": a.label, "command": "python bench/decode_speed_moe.py", "commit": commit,
           "case": "layerwise MoE stage (norm + moe_tkg_body), rank 0, T=2, LNC=2, bf16, qwen3.6-35b-a3b",
           "routing_pattern": list(PATTERN), "mean_us": mean, "hbm_floor_us_mean": floor,
           "by_distinct": [rows[n] for n in sorted(rows)]}
    path = ROOT / "bench" / "decode_speed_moe.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out, indent=1))
        return 0
    for n in sorted(rows):
        r = rows[n]
        t = r["time_us"]
        crit = ", ".join(f"{k} {v:.1f}" for k, v in r["critical_by_category_us"].items() if v >= 0.05)
        print(f"n={n}: {t['central']:.1f} us ({t['low']:.1f} - {t['high']:.1f}); HBM {r['hbm_MB_per_rank']:.2f} MB "
              f"per rank, floor {r['roofline_us']:.1f} us; critical path: {crit}")
    print(f"mean over {PATTERN}: {mean['central']:.1f} us ({mean['low']:.1f} - {mean['high']:.1f}); "
          f"HBM floor {floor:.1f} us; wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
