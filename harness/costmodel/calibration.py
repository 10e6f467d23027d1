"""The cost model beside every published per-operation measurement of ``shared/docs/trn2-costs.md``, and its
predictions for published kernels beside their published times.

Operation rows: the measurement as published, what the model predicts for the same operation (central band,
by a formula of ``costs`` or by predicting a micro-kernel trace from ``microkernels``), their ratio, and how
the model number arises: ``constant`` (the measurement IS the model constant, so agreement is by
construction), ``fit`` (the row is one of those a formula was fitted on: not independent), ``formula`` (a
formula fitted on other rows, so a genuine check), ``doc`` (a documented figure used as a constant) or
``sim`` (a traced NKI micro-kernel through the whole timeline model).

Kernel rows (:data:`KERNELS`): unmodified public kernels traced shape-only through ``harness.bench kernel``'s
machinery at the shapes their authors timed them, predicted as a band. A published time is shown where the
source gives one, with the hardware it was measured on; nothing is fitted to it.
"""
from __future__ import annotations

import contextlib
import os
import sys
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


def _dve(F, op="tensor_tensor"):
    return costs.fixed_compute_ns({"engine": "DVE", "op": op, "shapes": {"x": [1, F]}})


def _pe(cols, passes=1, pinned=False, throttle=False):
    prm = costs.Params.at("central", pe_throttle=C.PE_THROTTLE.high if throttle else 1.0)
    return costs.pe_ns({"op": "nc_matmul", "N": cols, "shapes": {},
                        "dtypes": {"moving": "float32" if passes == 2 else "bfloat16"}}, prm, pinned=pinned)


def _cc_fixed(op, nbytes):
    """A collective's cost without the trigger delay (the measurements report that delay separately)."""
    prm = costs.Params.at("central")
    return costs.collective_ns(op, nbytes, C.TP_RANKS, prm) - prm.cc_trigger_ns


def rows():
    from . import microkernels as mk
    from .predict import predict

    def lat(tr):
        return predict(tr).latency_ns

    def busy(tr, eng):
        p = predict(tr)
        return sum(d.get(eng, 0.0) for d in p.busy_ns.values())

    eff = lambda run: 1 / (1 + C.DMA_DESCRIPTOR_OVERHEAD_BYTES.central / run)     # noqa: E731
    return [
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
        Row("DVE reciprocal, [128, 512] (SDK Engine Selection: max(64, 8N) DVE cycles)",
            f"{max(64, 8 * 512) / 0.96:,.0f} ns (doc, at 0.96 GHz)", max(64, 8 * 512) / 0.96,
            busy(mk.trace_reciprocal(512), "DVE"), "sim", "8x the fitted per-element DVE time"),
        Row("PE back-to-back chain: 16 nc_transpose [128,128] bf16", "1.5 µs", 1500,
            busy(mk.trace_transposes(16), "PE"), "fit (sim)", "the PE floor (central) comes from this chain"),
        Row("LDWEIGHTS/MATMUL pair spacing", "~62 ns", 62, C.PE_FLOOR_NS.low, "constant", "the PE floor's low end"),
        Row("in_proj matmul, fp32, 512 columns, unthrottled", "592 ns", 592, _pe(512, 2), "formula"),
        Row("same, under the 0.5-utilisation throttle", "1,001 ns", 1001, _pe(512, 2, throttle=True), "formula",
            "throttle factor 1.69 (the high end) is itself from 1,001/592"),
        Row("in_proj MATMUL window (16 h1 x runs {256,256,512,512,16}, fp32)", "24.7 µs", 24700,
            busy(mk.trace_in_proj(), "PE"), "fit (sim)",
            "the 16-column run hits the floor (the pure column model gives 24.65 µs)"),
        Row("in_proj window with tiles pinned to (0,0) (1.08 col/cycle)", "31.4 µs", 31400,
            16 * sum(_pe(r, 2, pinned=True) for r in (256, 256, 512, 512, 16)), "fit",
            "1.08 col/cycle comes from this row"),
        Row("nc_transpose instruction time", "~213 ns each", 213, _pe_transpose(), "formula",
            "measured instruction time includes LDWEIGHTS/MATMUL pairing"),
        Row("TP all-reduce 8 KB (4 ranks, per core)", "13,331 ns", 13331, _cc_fixed("all_reduce", 8192), "constant",
            f"+ bytes term; the model adds a {C.CC_TRIGGER_NS.central:,.0f} ns trigger delay (measured separately)"),
        Row("... its cc_trigger_start_delay (145 µs over 80)", "1,813 ns", 145000 / 80, C.CC_TRIGGER_NS.central,
            "constant"),
        Row("AllGather 2 fp32 (8 B)", "26,729 / 22,158 ns", (26729 + 22158) / 2, _cc_fixed("all_gather", 8),
            "constant", "mean of the two (the band's ends are the two)"),
        Row("AllGather 2,048 B in / 8,192 B out (eh_proj, D1)", "24,896 / 34,491 ns", (24896 + 34491) / 2,
            _cc_fixed("all_gather", 8192), "formula", "latency of the 8 B gather + bytes term"),
        Row("AllGather 2,048 B in / 8,192 B out (D2)", "22,235 / 24,192 ns", (22235 + 24192) / 2,
            _cc_fixed("all_gather", 8192), "formula"),
        Row("sendrecv intra-LNC 4,096 B", "354 ns", 354, _sendrecv(mk), "constant", "+ bytes term"),
        Row("core_barrier x3 (round end)", "5,138 ns", 5138, 3 * C.CORE_BARRIER_NS, "constant"),
        Row("PSEUDO_CORE_BARRIER (one instance / average)", "3,084 / ~600 ns", 3084, C.CORE_BARRIER_NS, "formula",
            "modelled as a core_barrier"),
        Row("small DMA: 2,048 B SBUF->HBM", "1,781 ns", 1781, _store_latency(mk), "constant",
            "the completion latency is derived from this row"),
        Row("DMA semaphore-to-start (DMA bandwidth guide)", "~1,300 ns", 1300, C.HANDOFF_DMA_NS.central, "doc",
            "added when a DMA waits on another engine's result"),
        Row("DMA engines per core x rate (DMA bandwidth guide)", "16 x 23 B/ns = 368 GB/s", (4 << 20) / 368.0,
            lat(mk.trace_one_dma(4 << 20)) - C.DMA_ISSUE_NS - C.DMA_COMPLETION_NS, "sim",
            "one 4 MiB DMA on one core: data phase at the per-core engine cap (x the run-size efficiency)"),
        Row("DMA efficiency at 2 KiB / 4 KiB per partition", "'approaches' / 'saturates' peak", None,
            None, "doc", f"model: {100 * eff(2048):.0f} % / {100 * eff(4096):.0f} % (central descriptor overhead "
            f"{C.DMA_DESCRIPTOR_OVERHEAD_BYTES.central:.0f} B)"),
        Row("proj_w repack: runs 512-1,024 B -> 4,096 B", "240 -> 267 GB/s (x1.11)", 267 / 240,
            eff(4096) / eff(768), "fit", "ratio of the efficiencies at 768 B and 4 KiB runs"),
        Row("64 x 128-byte DMAs back to back (merged)", "22,704 ns", 22704, lat(mk.trace_small_dmas(64)), "sim",
            "2 DGEs x 640 ns issue"),
        Row("... their summed instruction time", "40,951 ns", 40951, 64 * C.DMA_ISSUE_NS, "constant"),
        Row("T=2 verify head: 134 small DMAs (merged)", "44,501 ns", 44501, lat(mk.trace_small_dmas(134)), "sim",
            "sizes not stated; 128 B assumed"),
        Row("XLA glue DMA_DIRECT2D (GpSimd)", "~650 ns each", 650, C.DMA_ISSUE_NS, "formula",
            "issue cost of the 128 B row"),
        Row("DMA_INDIRECT (gather)", "~1.0 µs each", 1035, C.DMA_ISSUE_INDIRECT_NS, "constant"),
        Row("sustainable DMA bandwidth per rank", "635 GB/s (20 µs), 707 (10 µs)", None, None, "constant",
            "the HBM bandwidth band: 707 / 635 / 571 GB/s"),
        Row("routed-expert stream 26.0 MB/layer (50 x 512 KB, 2 cores)", "47.75 µs (544 GB/s)", 47750,
            lat(mk.trace_weight_stream(25, 4096, lnc=2)), "sim",
            "all 50 issued up front into distinct buffers (the measured design had a 2-deep prefetch ring)"),
        Row("vocab head weight stream 246.85 MB (2 cores)", "423.75 µs (571 GB/s)", 423750,
            lat(mk.trace_weight_stream(118, 8192, lnc=2, ring=16)), "sim",
            "2 cores x 118 x 1 MiB loads through a 16-deep ring of buffers"),
        Row("instruction fetch at NEFF start", "13.1 µs", 13100, C.LAUNCH_OVERHEAD_NS, "constant",
            "charged once per round (both variants)"),
        Row("4-byte token-id seam (4 instructions)", "238 ns", 238, 4 * C.SP_INSTR_NS, "constant",
            "used as the SP register-op cost"),
        Row("GpSimd tensor_partition_reduce in the DeltaNet layer", "+110 µs", None, None, "—",
            "a layer-level delta; the model has no GpSimd partition-reduce measurement"),
        Row("weight-DMA descriptor generation 2 -> 20 DMAs", "1.32 -> 21.75 µs", None, None, "—",
            "the model charges descriptors through the run-size efficiency of the data phase, not GpSimd time"),
    ]


def _pe_transpose():
    return costs.pe_ns({"op": "nc_transpose", "shapes": {"data": [128, 128]}, "dtypes": {}}, costs.Params.at())


def _sendrecv(mk):
    from .predict import predict
    p = predict(mk.trace_sendrecv(32, 64))
    T = p.timeline
    i = next(k for k, r in enumerate(T.program.recs) if r["op"] == "sendrecv")
    return T.finish[i] - T.work_start[i]


def _store_latency(mk):
    from .predict import predict
    p = predict(mk.capture(mk.one_dma_store, mk.SD((1, 2048), "uint8")), params=costs.Params.at(
        "central", handoff_dma_ns=0.0))
    T = p.timeline
    return T.finish[1] - T.start[1]


# ---- published kernels ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class KernelCase:
    label: str
    repo: str                   # "sdk" | "nki-library" | "seed"
    path: str                   # file inside the checkout
    function: str
    args: tuple                 # "NAME=D0,...:DTYPE"
    ints: tuple = ()            # "NAME=VALUE" / "NAME=V:int32:1x1"
    floats: tuple = ()          # "NAME=VALUE"
    lnc: int = 1
    published: str = ""         # the source's time, with its hardware
    published_us: float | None = None
    note: str = ""


def _mm(name, fn, extra=()):
    return KernelCase(f"SDK matmul {name}: [4096,1024] x [1024,2048] bf16", "sdk",
                      "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py", fn,
                      ("lhsT=1024,4096:bfloat16", "rhs=1024,2048:bfloat16") + tuple(extra),
                      note="the tutorial's benchmark shape (matrix_multiplication_torch.py); no time published; "
                           "PE-bound floor 2MNK / 79 TFLOPS = 217 µs")


MAMBA = "nki/examples/fused_mamba/mamba_nki_kernels.py"
TUTORIAL_HW = "fused_mamba.rst (NeuronCore-v2 era tutorial; trn2 would be faster)"


def _mamba(ver, b, L, ch, n, published_us, what):
    return KernelCase(f"SDK fused mamba {ver} [batch {b}, seq {L}, channels {ch}, state {n}] fp32", "sdk", MAMBA,
                      f"mamba_{ver}", (f"delta={b},{ch},{L}:float32", f"u={b},{ch},{L}:float32",
                                       f"A={ch},{n}:float32", f"B={b},{n},{L}:float32", f"C={b},{n},{L}:float32"),
                      published=f"{published_us:,.2f} µs ({what}; {TUTORIAL_HW})", published_us=published_us)


NKL = "src/nkilib_src/nkilib/"
SEED_LAYER = "nki_kernels/deltanet/decode/fused_layer.py"

KERNELS = (
    KernelCase("SDK matmul basic [64,128] x [128,512] bf16", "sdk",
               "nki/examples/matrix_multiplication/matrix_multiplication_nki_kernels.py", "nki_matmul_basic_",
               ("lhsT=128,64:bfloat16", "rhs=128,512:bfloat16"), note="no time published"),
    _mm("tiled", "nki_matmul_tiled_"),
    _mm("hoist_load", "nki_matmul_hoist_load_"),
    _mm("block_free_dimension", "nki_matmul_block_free_dimension_"),
    _mm("fully_optimized", "nki_matmul_fully_optimized_"),
    _mamba("v1", 1, 512, 256, 16, 172.93, "the tutorial's first profile"),
    _mamba("v1", 1, 512, 4096, 16, 2340.0, "channels x16"),
    _mamba("v2", 1, 512, 4096, 16, 1610.0, "loop reordering"),
    _mamba("v2", 1, 8192, 4096, 16, 53330.0, "seq_len 8K: SBUF spills"),
    _mamba("v3", 1, 8192, 4096, 16, 27800.0, "seq_len tiling"),
    KernelCase("nkl cumsum [300,5000] fp32", "nki-library", NKL + "core/cumsum/cumsum.py", "cumsum",
               ("x=300,5000:float32",), note="public sweep shape; no time published"),
    KernelCase("nkl cumsum [4,10,1000] fp32", "nki-library", NKL + "core/cumsum/cumsum.py", "cumsum",
               ("x=4,10,1000:float32",)),
    KernelCase("nkl cumsum [130,2100] bf16", "nki-library", NKL + "core/cumsum/cumsum.py", "cumsum",
               ("x=130,2100:bfloat16",)),
    KernelCase("nkl dynamic_elementwise_add M512 H1024 bf16, 4 of 4 tiles", "nki-library",
               NKL + "experimental/dynamic_shapes/dynamic_elementwise_add.py", "dynamic_elementwise_add",
               ("input_a=512,1024:bfloat16", "input_b=512,1024:bfloat16"), ("num_m_tiles=4:int32:1x1",),
               note="the tile count is a real int32 input: its runtime loop runs 4 times"),
    KernelCase("nkl dynamic_elementwise_add M512 H1024 bf16, 3 of 4 tiles", "nki-library",
               NKL + "experimental/dynamic_shapes/dynamic_elementwise_add.py", "dynamic_elementwise_add",
               ("input_a=512,1024:bfloat16", "input_b=512,1024:bfloat16"), ("num_m_tiles=3:int32:1x1",)),
    KernelCase("nkl dynamic_elementwise_add M256 H512 fp32, 2 of 2 tiles", "nki-library",
               NKL + "experimental/dynamic_shapes/dynamic_elementwise_add.py", "dynamic_elementwise_add",
               ("input_a=256,512:float32", "input_b=256,512:float32"), ("num_m_tiles=2:int32:1x1",)),
)


def seed_case(cfg=None):
    """The seed's isolated DeltaNet decode layer (``deltanet_attention_layer_state``, T=2 verify, bf16, the
    per-rank shapes of Qwen3.6-35B-A3B at TP=4: hidden 2048, 4 key heads and 8 value heads of 128 per rank)."""
    from model.config import preset
    cfg = cfg or preset("qwen3.6-35b-a3b")
    tp = C.TP_RANKS
    H = cfg.hidden_size
    kd = cfg.linear_key_dim // tp
    vd = cfg.linear_value_dim // tp
    hv = cfg.linear_num_value_heads // tp
    conv = 2 * kd + vd
    I = conv + vd + 2 * hv               # q|k|v, z, a, b projection columns
    K = cfg.linear_conv_kernel_dim
    D = cfg.linear_value_head_dim
    return KernelCase(
        "seed isolated DeltaNet decode layer (deltanet_attention_layer_state), T=2, bf16, per-rank shapes", "seed",
        SEED_LAYER, "deltanet_attention_layer_state",
        (f"hidden=1,2,{H}:bfloat16", f"proj_w={H},{I}:bfloat16", f"gamma=1,{H}:bfloat16",
         f"conv_state={conv},{K - 1}:bfloat16", f"conv_weight={conv},{K}:bfloat16", f"A_log={hv}:float32",
         f"dt_bias={hv}:float32", f"init_state={hv},{D},{D}:float32", f"z_gamma={D}:bfloat16",
         f"out_w={vd},{H}:bfloat16"),
        (f"key_dim={kd}",), (f"eps={cfg.rms_norm_eps}",), lnc=2,
        published=SEED_PUBLISHED, published_us=98.82,
        note="argument shapes from the seed's specs/deltanet_tkg.md and in_proj.py docstrings (hidden [B, S, H] in "
             "HBM, proj_w [H, I = q|k|v|z|a|b = 3,088])")


SEED_PUBLISHED = ("98.82 µs (the seed's isolated-layer profile on trn2, trn2-costs.md §4.2: the baseline before its "
                  "I-shard / z-defer / packed proj_w wins)")
SEED_MISSING = ("not predicted: the seed's file is not in the checkout given (its current snapshot no longer has "
                "nki_kernels/deltanet: recover the package of commit 2983e6eb file by file -- decode/fused_layer.py, "
                "components/{conv,in_proj,out_proj,recurrence,norm_gate}.py, vendored/{__init__,qkv_tkg}.py -- and "
                "give --seed its parent and --nki-library an nki-library whose core/utils/common_types.py has "
                "DtypeMode)")
SEED_PROVENANCE = ("the seed's files as stored in the code index: decode/fused_layer.py, components/conv.py, "
                   "components/in_proj.py and vendored/qkv_tkg.py at 2983e6eb; components/out_proj.py (bb186141), "
                   "components/recurrence.py, components/norm_gate.py and vendored/__init__.py (41d5b0ec) are the "
                   "stored versions, not stored at 2983e6eb, whose signatures match the 2983e6eb callers. Its "
                   "nkilib (bundled with NKI 0.5.0) is not stored: the nki-library of --nki-library stands in (the "
                   "published figure used aws-neuron/nki-library d2ad3a5 with core/utils/common_types.py from a "
                   "newer stored version, which adds the DtypeMode and QuantizationType.is_mx the vendored qkv_tkg "
                   "imports). NKI_DELTANET_IN_PROJ_I_SHARD unset (0): the 98.82 µs baseline")
SEED_RELAXED = ("traced with nkisim.jit.NESTED_JIT='warn': the layer calls nki-library's @nki.jit "
                "output_projection_tkg from inside its kernel, which the SDK migration guide 0.2.0 documents as an "
                "error (refused by default); also warned, not refused: raw dge_mode=3 in nki-library's norm loads, "
                "PE transposes of column slices of wider tiles, 'is' in nki-library helpers (see nkisim/README.md)")


@contextlib.contextmanager
def _seed_context(roots):
    """The seed imports the installed ``nkilib`` (absolute imports): the --nki-library checkout's package root goes on
    sys.path for its trace, and its nested @nki.jit call runs inline with a warning (SEED_RELAXED)."""
    import importlib
    jit = importlib.import_module("nkisim.jit")      # the module (nkisim.jit the attribute is the decorator)
    nkl = roots.get("nki-library")
    path_before = list(sys.path)        # the package root, and the layer's own directory (kernel_loading._import_file)
    if nkl is not None:
        sys.path.insert(0, os.path.join(os.path.abspath(nkl), "src", "nkilib_src"))
    saved, jit.NESTED_JIT = jit.NESTED_JIT, "warn"
    try:
        yield
    finally:
        jit.NESTED_JIT = saved
        sys.path[:] = path_before


def project_gdn_row():
    """This project's own DeltaNet layer at the same shapes (megakernel.layerwise.gdn_stage, T=2, bf16, rank 0 of
    TP=4, LNC=2): not the seed's kernel, its closest counterpart here, beside the seed's published time."""
    from harness import kernel_cases
    from model.config import preset
    from .predict import predict_band
    case = kernel_cases.stage_case(preset("qwen3.6-35b-a3b"), "gdn", 2)
    b = predict_band(case.trace(), stages="function", name=case.name)
    return {"label": "this project's GDN layer stage (megakernel.layerwise.gdn_stage: input RMSNorm, in_proj, "
                     "conv, recurrence, gated norm, out_proj), T=2, bf16, per-rank shapes -- NOT the seed's kernel",
            "source": "harness.kernel_cases.stage_case(cfg, 'gdn', 2)", "args": [], "ints": [], "floats": [],
            "lnc": 2, "published": SEED_PUBLISHED + " -- the seed's kernel, for scale", "published_us": 98.82,
            "note": "same layer, same per-rank shapes, a different kernel", "status": "predicted",
            "time_us": b.time_us(), "instructions": b.central.n_instructions, "hbm_MB": b.central.hbm_bytes / 1e6,
            "roofline_us": b.central.roofline_ns / 1e3, "central_over_published": b.central.latency_ns / 1e3 / 98.82,
            "critical_by_category_us": {c: v / 1e3 for c, v in b.central.critical_by_category.items() if v}}


def kernel_rows(roots, progress=None):
    """Predict every KERNELS entry (and the seed layer) whose checkout is given: [{label, ..., time_us}]."""
    from .predict import predict_band
    out = []
    cases = list(KERNELS) + [seed_case()]
    for k in cases:
        row = {"label": k.label, "source": f"{k.repo}:{k.path}::{k.function}", "args": list(k.args),
               "ints": list(k.ints), "floats": list(k.floats), "lnc": k.lnc, "published": k.published,
               "published_us": k.published_us,
               "note": k.note}
        root = roots.get(k.repo)
        if root is None:
            row["status"] = (SEED_MISSING + "; no --seed checkout given") if k.repo == "seed" else \
                f"not run: no --{k.repo} checkout given"
            out.append(row)
            continue
        path = os.path.join(root, k.path)
        if not os.path.isfile(path):
            row["status"] = SEED_MISSING if k.repo == "seed" else f"not run: {k.path} is not in the checkout"
            out.append(row)
            continue
        if progress:
            progress(k.label)
        from harness.kernel_loading import BadInput, trace_kernel
        context = _seed_context(roots) if k.repo == "seed" else contextlib.nullcontext()
        try:
            with context:
                tr, _ = trace_kernel(f"{path}::{k.function}", k.args, k.ints, k.lnc, 1, k.floats)
        except BadInput as e:
            row["status"] = f"not predicted: {e}"
            out.append(row)
            continue
        if k.repo == "seed":
            row["note"] = f"{k.note}; {SEED_PROVENANCE}; {SEED_RELAXED}"
        b = predict_band(tr, stages="function", name=k.label)
        row.update(status="predicted", time_us=b.time_us(), instructions=b.central.n_instructions,
                   hbm_MB=b.central.hbm_bytes / 1e6, roofline_us=b.central.roofline_ns / 1e3,
                   critical_by_category_us={c: v / 1e3 for c, v in b.central.critical_by_category.items() if v},
                   engine_busy_us={e: v / 1e3 for e, v in b.central.engine_busy_ns().items() if v})
        if k.published_us:
            row["central_over_published"] = b.central.latency_ns / 1e3 / k.published_us
        out.append(row)
    if progress:
        progress("this project's GDN layer stage")
    out.append(project_gdn_row())
    return out


def _fmt(ns):
    if ns is None:
        return "—"
    return f"{ns:,.0f} ns" if ns < 10_000 else f"{ns / 1e3:,.2f} µs"


def markdown(rs=None, kernels=()):
    rs = rows() if rs is None else rs
    lines = ["# trn2 cost model vs published measurements", "",
             "Generated by `python -m harness.bench calibrate --sdk PATH --nki-library PATH --seed PATH`. "
             "Model figures are the central band unless a band is shown. Never a hardware measurement of ours: "
             "nothing here was run on a Trainium chip.", "",
             "## Per-operation measurements (trn2-costs.md)", "",
             "*how*: constant = the measurement is the model constant; fit = a formula was fitted on this row; "
             "formula = a formula fitted elsewhere (a real check); doc = a documented figure used as a constant; "
             "sim = a traced NKI micro-kernel (harness/costmodel/microkernels.py) through the timeline model.", "",
             "| operation | measured | model | model / measured | how | note |",
             "|---|---|---|---|---|---|"]
    for r in rs:
        ratio = f"{r.ratio:.2f}" if r.ratio is not None else "—"
        model = _fmt(r.model_ns) if r.how != "fit" or r.model_ns is None or r.model_ns > 10 else f"{r.model_ns:.2f}"
        lines.append(f"| {r.operation} | {r.measured} | {model} | {ratio} | {r.how} | {r.note} |")
    if kernels:
        lines += ["", "## Published kernels (shape-only traces of the unmodified sources)", "",
                  "Predicted with `python -m harness.bench kernel FILE::FUNCTION --arg ...` (the arguments below). "
                  "Band = central (low - high).", "",
                  "| kernel | predicted µs | published | central / published | instructions | HBM MB | note |",
                  "|---|---|---|---|---|---|---|"]
        for k in kernels:
            if k.get("status") != "predicted":
                lines.append(f"| {k['label']} | {k.get('status')} | {k['published'] or '—'} | — | — | — | "
                             f"{k['note']} |")
                continue
            t = k["time_us"]
            ratio = f"{k['central_over_published']:.2f}" if k.get("central_over_published") else "—"
            lines.append(f"| {k['label']} | {t['central']:,.2f} ({t['low']:,.2f} - {t['high']:,.2f}) | "
                         f"{k['published'] or '—'} | {ratio} | {k['instructions']:,} | {k['hbm_MB']:,.2f} | "
                         f"{k['note']} |")
        seed = [k for k in kernels if k.get("source", "").startswith("seed:") and k.get("status") == "predicted"]
        if seed:
            lines += ["", seed_paragraph(seed[0])]
        lines += ["", "Arguments:", ""]
        for k in kernels:
            lines.append(f"- {k['label']}: `{k['source']}` " + " ".join(f"--arg {a}" for a in k["args"]) +
                         "".join(f" --int {i}" for i in k["ints"]) + "".join(f" --float {x}" for x in k["floats"])
                         + f" --lnc {k['lnc']}")
    return "\n".join(lines)


# The seed's own profile of the same layer (trn2-costs.md §4.2, from its deltanet_decode_opt study).
SEED_PROFILE = {"tensor_busy_pct": 41.7, "no_compute_us": 29.56, "first_conv_transpose_us": 42.74}


def seed_paragraph(k):
    """The seed layer's prediction beside its published time and profile, from its kernel row."""
    t, busy, crit = k["time_us"], k.get("engine_busy_us", {}), k.get("critical_by_category_us", {})
    pe_measured = SEED_PROFILE["tensor_busy_pct"] / 100 * k["published_us"]
    path = ", ".join(f"{c} {v:,.1f}" for c, v in sorted(crit.items(), key=lambda kv: -kv[1]) if v >= 0.5)
    return (f"**Seed DeltaNet layer vs its published time.** Predicted {t['central']:,.1f} µs ({t['low']:,.1f} - "
            f"{t['high']:,.1f}) against the seed's measured {k['published_us']} µs: central / published "
            f"{k['central_over_published']:.2f}, and even the low end is {t['low'] / k['published_us']:.2f}x. The model "
            f"puts the critical path in (µs) {path}; its PE busy is {busy.get('PE', 0):,.1f} µs against the profile's "
            f"Tensor busy {SEED_PROFILE['tensor_busy_pct']}% = {pe_measured:,.1f} µs (trn2-costs.md §4.2; that profile "
            f"also shows {SEED_PROFILE['no_compute_us']} µs with no engine computing). The excess is therefore not PE "
            f"work: it sits in the DMA and hand-off terms of the path, the constants this latency-bound layer is most "
            f"sensitive to (the seed's study: 'latency/hand-off bound'). Caveats: three of the seed's component "
            f"files and its NKI-0.5 nkilib are stand-ins (see the row's note), and the trace ran with the nested-jit "
            f"switch on.")


def as_dicts(rs=None):
    rs = rows() if rs is None else rs
    return [{"operation": r.operation, "measured": r.measured, "measured_ns": r.measured_ns,
             "model_ns": r.model_ns, "ratio": r.ratio, "how": r.how, "note": r.note} for r in rs]
