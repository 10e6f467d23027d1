"""Trace summaries of every decode subkernel at the real per-rank shapes of Qwen3.6-35B-A3B.

    python -m harness.kernel_report                 # table, T=2 (verify), bfloat16, one rank of TP=4
    python -m harness.kernel_report --tokens 1 --json

Each kernel is launched once in nkisim's shape-only mode (no weights allocated; the trace is the one
an executing run yields) through the family's ``demo_args``. Per physical core it reports
instructions per engine, DMA bytes read from HBM, collectives, and the SBUF / PSUM high-water marks.
The cost model (``python -m harness.bench predict``) reads the same traces. Writes
``bench/kernel_traces.json``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import nkisim

FAMILIES = ("embedding", "rmsnorm", "gdn", "attention", "moe", "lm_head")
ENGINES = ("PE", "ACT", "DVE", "POOL", "DMA", "SP")
BENCH = Path(__file__).resolve().parent.parent / "bench"


def trace_family(name: str, cfg, tokens: int, dtype: str) -> dict:
    """Shape-only launch of one family's demo kernel; returns nkisim.summary's per-instance dict."""
    nkisim.install()
    from nkisim.summary import summarize
    module = importlib.import_module(f"nki_kernels.{name}")
    kernel, args = module.demo_args(cfg, tp=4, T=tokens, dtype=dtype, shape_only=True)
    with nkisim.trace.capture() as tr:
        kernel(*args)
    return summarize(tr)


def hbm_read_bytes(inst: dict) -> int:
    return sum(v["bytes"] for k, v in inst["dma"].items() if k.startswith("hbm->"))


def rows(report: dict) -> list[list]:
    out = []
    for name, s in report.items():
        inst = s["instances"]["r0c0"]
        out.append([name, *(inst["by_engine"].get(e, 0) for e in ENGINES), inst["instructions"],
                    f"{hbm_read_bytes(inst) / 2**20:.2f}",
                    sum(c["count"] for c in inst["collectives"].values()),
                    f"{inst['sbuf_peak_bytes_per_partition'] / 1024:.1f}",
                    f"{inst['psum_peak_bytes_per_partition'] / 1024:.1f}"])
    return out


def format_table(table: list[list]) -> str:
    head = ["kernel", *ENGINES, "total", "HBM read MiB", "collectives", "SBUF KiB/part", "PSUM KiB/part"]
    width = [max(len(str(r[i])) for r in [head, *table]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, width)))
    return "\n".join([fmt(head), "  ".join("-" * w for w in width), *map(fmt, table)])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.kernel_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=2, choices=[1, 2, 3, 4], help="tokens per launch (default 2)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", action="store_true", help="print the full per-instance summaries as JSON")
    args = ap.parse_args(argv)
    from model.config import preset
    cfg = preset("qwen3.6-35b-a3b")
    report = {name: trace_family(name, cfg, args.tokens, args.dtype) for name in FAMILIES}
    BENCH.mkdir(exist_ok=True)
    (BENCH / "kernel_traces.json").write_text(json.dumps(
        {"tokens": args.tokens, "dtype": args.dtype, "tp": 4, "lnc": 2, "kernels": report}, indent=1))
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print(f"Qwen3.6-35B-A3B, one rank of TP=4 (LNC=2), T={args.tokens}, {args.dtype}; core 0 of the rank")
        print(format_table(rows(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
