"""Trace summaries of every decode kernel launch at the real per-rank shapes of Qwen3.6-35B-A3B.

    python -m harness.kernel_report                 # table, T=2 (verify), bfloat16, one rank of TP=4
    python -m harness.kernel_report --tokens 1 --json

Each launch of the layerwise variant (``megakernel.layerwise`` stage kernels and the embedding) is traced once in
nkisim's shape-only mode from its kernel case (``harness.kernel_cases``: the real per-rank shapes, the real int32
positions and read slot, the register values of the attention loops and the MoE routing model). Per physical
core it reports instructions per engine, DMA bytes read from HBM, collectives, and the SBUF / PSUM high-water
marks. Writes ``bench/kernel_traces.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import nkisim

ENGINES = ("PE", "ACT", "DVE", "POOL", "DMA", "SP")
BENCH = Path(__file__).resolve().parent.parent / "bench"


def trace_case(case) -> dict:
    """Trace one kernel case; returns nkisim.summary's per-instance dict."""
    from nkisim.summary import summarize
    return summarize(case.trace())


def cases(cfg, tokens: int, dtype: str) -> dict:
    from harness import kernel_cases as kc
    out = {"embedding": kc.embedding_case(cfg, tokens, dtype=dtype)}
    for st in kc.STAGES:
        T = 1 if st == "mtp_fc" else tokens
        out[st] = kc.stage_case(cfg, st, T, dtype=dtype)
    return out


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
    nkisim.install()
    report = {name: trace_case(c) for name, c in cases(cfg, args.tokens, args.dtype).items()}
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
