"""Per-instance summary of an nkisim trace: instructions per engine and op, DMA bytes by direction,
collectives, on-chip memory high-water marks.

    python -m nkisim.summary TRACE.json [--json]
    nkisim.summary.summarize(trace_or_dict_or_path) -> dict;  nkisim.summary.format_summary(s) -> str

A trace JSON is what ``nkisim.trace.Trace.to_json()`` writes (keys ``launches``, ``allocations``,
``instructions``). Instances are keyed ``(rank, inst)``; a trace may hold several launches, whose
counts add up (memory peaks take the maximum).
"""
import argparse
import json
import sys

DMA_OPS = ("dma_copy", "dma_transpose", "dma_compute", "sendrecv")


def _load(src):
    if isinstance(src, dict):
        return src
    if hasattr(src, "to_dict"):
        return src.to_dict()
    with open(src) as f:
        return json.load(f)


def _mem_kind(m):
    return "hbm" if m in ("shared_hbm", "private_hbm") else m


def summarize(trace):
    """Structured summary: ``{"instances": {"r{rank}c{inst}": {...}}, "totals": {...}}``."""
    d = _load(trace)
    inst = {}

    def slot(rank, i):
        key = f"r{rank}c{i}"
        if key not in inst:
            inst[key] = {"rank": rank, "inst": i, "instructions": 0, "by_engine": {}, "by_op": {},
                         "dma": {}, "dma_bytes": 0, "dma_count": 0, "collectives": {},
                         "sbuf_peak_bytes_per_partition": 0, "psum_peak_bytes_per_partition": 0}
        return inst[key]

    for r in d.get("instructions", []):
        s = slot(r.get("rank", 0), r.get("inst", 0))
        eng, op = r["engine"], r["op"]
        s["instructions"] += 1
        s["by_engine"][eng] = s["by_engine"].get(eng, 0) + 1
        k = f"{eng}.{op}"
        s["by_op"][k] = s["by_op"].get(k, 0) + 1
        if op in DMA_OPS:
            src = sorted({_mem_kind(x["mem"]) for x in r.get("reads", [])}) or ["-"]
            dst = sorted({_mem_kind(x["mem"]) for x in r.get("writes", [])}) or ["-"]
            direction = f"{'+'.join(src)}->{'+'.join(dst)}"
            nbytes = sum(v.get("read", 0) for v in r.get("bytes", {}).values())
            e = s["dma"].setdefault(direction, {"count": 0, "bytes": 0})
            e["count"] += 1
            e["bytes"] += nbytes
            s["dma_bytes"] += nbytes
            s["dma_count"] += 1
        cc = r.get("collective")
        if cc is not None:
            e = s["collectives"].setdefault(cc["kind"], {"count": 0, "bytes_in": 0, "bytes_out": 0})
            e["count"] += 1
            e["bytes_in"] += cc.get("bytes_in", 0)
            e["bytes_out"] += cc.get("bytes_out", 0)
    for L in d.get("launches", []):
        for m in L.get("memory", []):
            s = slot(m["rank"], m["inst"])
            for k in ("sbuf_peak_bytes_per_partition", "psum_peak_bytes_per_partition"):
                s[k] = max(s[k], m.get(k, 0))
    totals = {"instructions": sum(s["instructions"] for s in inst.values()),
              "dma_bytes": sum(s["dma_bytes"] for s in inst.values()),
              "collectives": sum(c["count"] for s in inst.values() for c in s["collectives"].values()),
              "launches": len(d.get("launches", []))}
    order = sorted(inst, key=lambda k: (inst[k]["rank"], inst[k]["inst"]))
    return {"instances": {k: inst[k] for k in order}, "totals": totals}


def _fmt_bytes(n):
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _table(rows, head):
    w = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if rows else [len(h) for h in head]
    line = lambda r: "  ".join(str(x).rjust(n) if i else str(x).ljust(n) for i, (x, n) in enumerate(zip(r, w)))  # noqa
    return "\n".join([line(head), "  ".join("-" * n for n in w)] + [line(r) for r in rows])


def format_summary(s):
    """Human-readable tables of ``summarize()``'s result."""
    insts = s["instances"]
    keys = list(insts)
    out = [f"{s['totals']['launches']} launch(es), {len(keys)} instance(s), {s['totals']['instructions']} "
           f"instructions, {_fmt_bytes(s['totals']['dma_bytes'])} moved by DMA, {s['totals']['collectives']} "
           f"collective calls"]
    engines = sorted({e for v in insts.values() for e in v["by_engine"]})
    out += ["", "instructions per engine", _table(
        [[k] + [insts[k]["by_engine"].get(e, 0) for e in engines] + [insts[k]["instructions"]] for k in keys],
        ["instance"] + engines + ["total"])]
    ops_ = sorted({o for v in insts.values() for o in v["by_op"]})
    out += ["", "instructions per op", _table([[o] + [insts[k]["by_op"].get(o, 0) for k in keys] for o in ops_],
                                              ["engine.op"] + keys)]
    dirs = sorted({x for v in insts.values() for x in v["dma"]})
    if dirs:
        out += ["", "DMA (count / bytes) by direction", _table(
            [[x] + [f"{insts[k]['dma'].get(x, {}).get('count', 0)} / "
                    f"{_fmt_bytes(insts[k]['dma'].get(x, {}).get('bytes', 0))}" for k in keys] for x in dirs],
            ["direction"] + keys)]
    kinds = sorted({c for v in insts.values() for c in v["collectives"]})
    if kinds:
        out += ["", "collectives (count / bytes in / bytes out)", _table(
            [[c] + [(lambda e: f"{e['count']} / {_fmt_bytes(e['bytes_in'])} / {_fmt_bytes(e['bytes_out'])}")(
                insts[k]["collectives"].get(c, {"count": 0, "bytes_in": 0, "bytes_out": 0})) for k in keys]
             for c in kinds], ["kind"] + keys)]
    out += ["", "on-chip high-water mark (bytes per partition)", _table(
        [[k, insts[k]["sbuf_peak_bytes_per_partition"], insts[k]["psum_peak_bytes_per_partition"]] for k in keys],
        ["instance", "SBUF", "PSUM"])]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nkisim.summary", description=__doc__.splitlines()[0])
    ap.add_argument("trace", help="trace JSON written by nkisim.trace.Trace.to_json(path)")
    ap.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    a = ap.parse_args(argv)
    s = summarize(a.trace)
    print(json.dumps(s, indent=1) if a.json else format_summary(s))
    return 0


if __name__ == "__main__":
    sys.exit(main())
