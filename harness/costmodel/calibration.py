"""The cost model beside every published per-operation measurement of ``shared/docs/trn2-costs.md``.

Each row: the measurement as published, what the model predicts for the same operation (by a formula of
``costs`` or by predicting a micro-kernel trace from ``microkernels``), their ratio, and how the model
number arises: ``constant`` (the measurement IS the model constant, so agreement is by construction), ``fit`` (the
row is one of those the derived-calibration formula was fitted on: not independent), ``formula`` (a
formula fitted on other rows, so this is a genuine check) or ``sim`` (a traced NKI
micro-kernel through the whole timeline model). Rows the model cannot speak to say why.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import constants as C
from . import costs


@dataclass
class Row:
    operation: str
    measured: str
    measured_ns: float | None
    model_ns: float | None
    how: str
    note: str = ""

    @property
    def ratio(self):
        if self.measured_ns and self.model_ns is not None:
            return self.model_ns / self.measured_ns
        return None


def _dve(F):
    return C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * F


def _pe(cols, passes=1, pinned=False, throttle=False):
    return costs.pe_ns({"op": "nc_matmul", "N": cols, "shapes": {},
                        "dtypes": {"moving": "float32" if passes == 2 else "bfloat16"}}, pinned=pinned,
                       throttle=throttle)


def rows():
    from . import microkernels as mk
    from .predict import predict

    def lat(tr):
        return predict(tr).latency_ns

    def busy(tr, eng):
        p = predict(tr)
        return sum(d.get(eng, 0.0) for d in p.busy_ns.values())

    out = [
        Row("ACT_TABLE_LOAD", "1,283 ns", 1283, C.ACT_TABLE_LOAD_NS, "constant"),
        Row("ACT table switch sequence (10 activations, 7 group changes, [128,256] fp32)", "—", None,
            busy(mk.trace_act_sequence(256), "ACT"), "sim", "no measurement: shows the 7 x 1,283 ns loads"),
        Row("DVE tensor_tensor fp32 [128,512]", "≈685 ns", 685, busy(mk.trace_dve(128, 512), "DVE"), "fit (sim)"),
        Row("DVE tensor_tensor fp32 [1,512]", "≈685 ns", 685, busy(mk.trace_dve(1, 512), "DVE"), "fit (sim)"),
        Row("DVE tensor_tensor fp32 [128,1024]", "~690 ns", 690, busy(mk.trace_dve(128, 1024), "DVE"), "sim",
            "conflicts with the [128,512] row (trn2-costs §derived: probably mislabelled)"),
        Row("DVE TENSOR_TENSOR in the qkv PSUM chain", "615 ns", 615, None, "—",
            "shape not stated; the formula gives 615 ns at 447 columns"),
        Row("DVE tensor_reduce max, 1 partition x 15,520 bf16", "16,309 ns", 16309, _dve(15520), "fit"),
        Row("nc_find_index8 on the same chunk", "16,314 ns", 16314, _dve(15520), "fit"),
        Row("argmax chunk: tensor_reduce + nc_find_index8 (+ memset) in sequence", "16,309 + 16,314 ns",
            16309 + 16314, busy(mk.trace_argmax_chunk(15520), "DVE"), "sim", "includes an 8-column memset"),
        Row("PE per-instruction floor (1-column nc_matmul)", "~140 ns", 140, _pe(1), "constant"),
        Row("in_proj matmul, fp32, 512 columns, unthrottled", "592 ns", 592, _pe(512, 2), "formula"),
        Row("same, under the 0.5-utilisation throttle", "1,001 ns", 1001, _pe(512, 2, throttle=True), "formula",
            "throttle factor 1.69 is itself from 1,001/592"),
        Row("in_proj MATMUL window (16 h1 x runs {256,256,512,512,16}, fp32)", "24.7 µs", 24700,
            busy(mk.trace_in_proj(), "PE"), "fit (sim)",
            "the 16-column run hits the 140 ns floor (the pure column model gives 24.65 µs)"),
        Row("in_proj window with tiles pinned to (0,0) (1.08 col/cycle)", "31.4 µs", 31400,
            16 * sum(_pe(r, 2, pinned=True) for r in (256, 256, 512, 512, 16)), "fit",
            "1.08 col/cycle comes from this row"),
        Row("16-transpose chain (PE nc_transpose [128,128] bf16)", "1.5 µs", 1500,
            busy(mk.trace_transposes(16), "PE"), "sim", "each transpose at the 140 ns floor; measured ~94 ns each"),
        Row("nc_transpose instruction time", "~213 ns each", 213, _pe_transpose(), "formula",
            "measured instruction time includes LDWEIGHTS/MATMUL pairing"),
        Row("TP all-reduce 8 KB (4 ranks, per core)", "13,331 ns", 13331,
            _cc_busy(mk.trace_all_reduce(2, 2048)), "constant", "+ 19 ns bytes term"),
        Row("AllGather 2 fp32 (8 B)", "26,729 / 22,158 ns", (26729 + 22158) / 2,
            costs.collective_ns("all_gather", 8), "constant", "mean of the two"),
        Row("AllGather 2,048 B in / 8,192 B out (eh_proj, D1)", "24,896 / 34,491 ns", (24896 + 34491) / 2,
            costs.collective_ns("all_gather", 8192), "formula", "latency of the 8 B gather + bytes term"),
        Row("AllGather 2,048 B in / 8,192 B out (D2)", "22,235 / 24,192 ns", (22235 + 24192) / 2,
            costs.collective_ns("all_gather", 8192), "formula"),
        Row("sendrecv intra-LNC 4,096 B", "354 ns", 354, lat(mk.trace_sendrecv(32, 64)) - _dve(64), "constant",
            "+ 6 ns bytes term"),
        Row("core_barrier x3 (round end)", "5,138 ns", 5138, 3 * C.CORE_BARRIER_NS, "constant"),
        Row("PSEUDO_CORE_BARRIER (one instance / average)", "3,084 / ~600 ns", 3084, C.CORE_BARRIER_NS, "formula",
            "modelled as a core_barrier"),
        Row("small DMA: 2,048 B SBUF->HBM", "1,781 ns", 1781, _store_latency(mk), "constant"),
        Row("64 x 128-byte DMAs back to back (merged)", "22,704 ns", 22704, lat(mk.trace_small_dmas(64)), "sim",
            "2 DGEs x 640 ns issue"),
        Row("... their summed instruction time", "40,951 ns", 40951, 64 * C.DMA_ISSUE_NS, "constant"),
        Row("T=2 verify head: 134 small DMAs (merged)", "44,501 ns", 44501, lat(mk.trace_small_dmas(134)), "sim",
            "sizes not stated; 128 B assumed"),
        Row("XLA glue DMA_DIRECT2D (GpSimd)", "~650 ns each", 650, C.DMA_ISSUE_NS, "formula",
            "issue cost of the 128 B row"),
        Row("DMA_INDIRECT (gather)", "~1.0 µs each", 1035, C.DMA_ISSUE_INDIRECT_NS, "constant"),
        Row("sustainable DMA bandwidth per rank", "635 GB/s", None, None, "constant",
            f"{C.HBM_BW_PER_RANK / 1e9:.0f} GB/s is the model's pipe"),
        Row("routed-expert stream 26.0 MB/layer (50 x 512 KB, 2 cores)", "47.75 µs (544 GB/s)", 47750,
            lat(mk.trace_weight_stream(25, 4096, lnc=2)), "sim",
            "all 50 issued up front (the measured design had a 2-deep prefetch ring)"),
        Row("vocab head weight stream 246.85 MB (2 cores)", "423.75 µs (571 GB/s)", 423750,
            lat(mk.trace_weight_stream(118, 8192, lnc=2)), "sim", "as 2 cores x 118 x 1 MiB loads issued up front"),
        Row("instruction fetch at NEFF start", "13.1 µs", 13100, C.LAUNCH_OVERHEAD_NS, "constant",
            "charged once per launch"),
        Row("4-byte token-id seam (4 instructions)", "238 ns", 238, 4 * C.SP_INSTR_NS, "constant",
            "used as the SP register-op cost"),
        Row("GpSimd tensor_partition_reduce in the DeltaNet layer", "+110 µs", None, None, "—",
            "a layer-level delta; the model has no GpSimd partition-reduce measurement"),
        Row("weight-DMA descriptor generation 2 -> 20 DMAs", "1.32 -> 21.75 µs", None, None, "—",
            "descriptor counts (run lengths) are not in the trace; not modelled"),
    ]
    return out


def _pe_transpose():
    return costs.pe_ns({"op": "nc_transpose", "shapes": {"data": [128, 128]}, "dtypes": {}})


def _cc_busy(tr):
    from .predict import predict
    p = predict(tr)
    return sum(d.get("CC", 0.0) for d in p.busy_ns.values()) / len(p.busy_ns)


def _store_latency(mk):
    from .predict import predict
    p = predict(mk.capture(mk.one_dma_store, mk.SD((1, 2048), "uint8")))
    T = p.timeline
    return T.finish[1] - T.work_start[1]


def _fmt(ns):
    if ns is None:
        return "—"
    return f"{ns:,.0f} ns" if ns < 10_000 else f"{ns / 1e3:,.2f} µs"


def markdown(rs=None):
    rs = rows() if rs is None else rs
    lines = ["| operation | measured (trn2-costs.md) | model | model / measured | how | note |",
             "|---|---|---|---|---|---|"]
    for r in rs:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "—"
        lines.append(f"| {r.operation} | {r.measured} | {_fmt(r.model_ns)} | {ratio} | {r.how} | {r.note} |")
    return "\n".join(lines)


def as_dicts(rs=None):
    rs = rows() if rs is None else rs
    return [{"operation": r.operation, "measured": r.measured, "measured_ns": r.measured_ns,
             "model_ns": r.model_ns, "ratio": r.ratio, "how": r.how, "note": r.note} for r in rs]
