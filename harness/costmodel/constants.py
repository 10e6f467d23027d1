"""Every constant of the trn2 cost model, each with its source. Nothing else in harness.costmodel
holds a number about the hardware.

Sources: ``shared/docs/trn2-costs.md`` ("costs" below; "costs/facts" = its Trainium2 facts table,
"costs/measured" = its per-operation table, "costs/derived" = its derived calibration, "costs/2026" = its
official 2026 figures) and the Neuron SDK docs (aws-neuron/aws-neuron-sdk, path given). A constant marked
ASSUMPTION has no measurement behind it; it is stated so and kept where a measurement can replace it. No
constant is tuned to make an end-to-end number come out: each comes from one per-operation measurement or a
documented figure.

**Bands.** A constant that the evidence does not pin down is a :class:`Band`: the value the *low* (fast),
*central* and *high* (slow) predictions use, each end from a cited figure. Every prediction is run three
times, once per end (``harness.costmodel.predict_band``); the JSON lists every band with its source
(:func:`assumptions`).
"""
from __future__ import annotations

from dataclasses import dataclass

ENDS = ("low", "central", "high")


@dataclass(frozen=True)
class Band:
    """An uncertain constant: the values the low / central / high predictions use (low = the fast end, so a
    bandwidth's low end is its largest figure), its unit and where each end comes from."""
    name: str
    low: object
    central: object
    high: object
    unit: str
    source: str

    def at(self, end: str):
        return getattr(self, end)

    def as_dict(self):
        return {"name": self.name, "low": self.low, "central": self.central, "high": self.high, "unit": self.unit,
                "source": self.source}


# ---- topology --------------------------------------------------------------------------------
TP_RANKS = 4                  # DESIGN.md §4: TP=4 ranks on one trn2 chip (costs/facts "logical NeuronCores")
LNC = 2                       # physical cores per rank (costs/facts: LNC=2 default)

# ---- TensorE (PE) ----------------------------------------------------------------------------
PE_CLOCK_HZ = 1.46e9          # costs/derived PE: "at 1.38 columns/cycle and 1.46 GHz that is 24.65 µs"
PE_COLUMNS_PER_CYCLE = 1.38   # costs/measured "PE moving-stream throughput": 1.38 columns/cycle, 4 rotating groups
PE_COLUMNS_PER_CYCLE_PINNED = 1.08   # same row: all tiles pinned to tile_position=(0,0) (-28 %)
PE_FP32_PASSES = 2            # costs/measured "fp32 nc_matmul lowers to 2 LDWEIGHTS + 2 MATMUL"; nc_transpose 1 pass
PE_FLOOR_NS = Band(
    "pe_floor_ns", 62.0, 1500.0 / 16, 140.0, "ns per PE instruction",
    "costs/measured back-to-back chains: central = a 16-transpose chain takes 1.5 µs (94 ns each); low = "
    "LDWEIGHTS/MATMUL pairs issue ~62 ns apart; high = the ~140 ns 'PE per-instruction floor' the measuring project "
    "used for estimates (not itself a measured chain)")
PE_THROTTLE = Band(
    "pe_throttle", 1.0, 1.0, 1.69, "x PE duration",
    "costs/measured: identical in_proj matmul 592 ns unthrottled, 1,001 ns under the 0.5-utilisation throttle "
    "(1.69x), which covered 44 µs of one capture; off at low/central, on at high")

# ---- VectorE (DVE) ---------------------------------------------------------------------------
DVE_FIXED_NS = 150.0          # costs/derived DVE: t ≈ 0.15 µs + 1.04 ns x free elements per partition
DVE_NS_PER_ELEM = 1.04        # same fit (685 ns at 512 columns; 16.3 µs at 15,520), independent of partitions
DVE_RECIPROCAL_FACTOR = 8     # SDK nki/api/nki.api.shared.rst "Engine Selection": reciprocal costs max(MIN_II, 8N)
#                               cycles on VectorE vs max(MIN_II, N) on ScalarE: 8x the per-element time
# No perf-mode speed-up for bf16 is applied: costs/facts quotes 2-4x for bf16 copies in SBUF but no
# instruction was measured in that mode.

# ---- ScalarE (ACT) ---------------------------------------------------------------------------
ACT_NS_PER_ELEM = 1.0 / 1.2   # costs/facts "engine clocks": Scalar 1.2 GHz, 128 elems/cycle = 1 per partition per cycle
ACT_FIXED_NS = 150.0          # ASSUMPTION: no ACT instruction was measured; DVE's fixed cost (costs/derived) reused
ACT_TABLE_LOAD_NS = 1283.0    # costs/measured "ACT_TABLE_LOAD 1,283 ns each, constant (also under throttling)"
# costs/measured "ACT table groups": t0 = {COPY, SQUARE, RSQRT}, t1 = SIGMOID, t2 = SILU, t3 = EXP, t4 = SOFTPLUS;
# any switch between groups costs one load. Functions not listed there are ASSUMED to live in a group of
# their own (a switch to or from them costs a load). Keys are nkisim's `func` names (nkisim/ops.py). ASSUMPTION:
# a ScalarE instruction without an activation function (tensor_copy, memset on ScalarE) loads no table -- no document
# says either way (the GDN projections' late evictions and the attention evictions rely on it).
ACT_TABLE_GROUPS = {
    "copy": "t0", "identity": "t0", "square": "t0", "rsqrt": "t0",
    "sigmoid": "t1",
    "silu": "t2",
    "exp": "t3",
    "softplus": "t4",
}

# ---- GpSimd (POOL) ---------------------------------------------------------------------------
POOL_NS_PER_ELEM = 1.0 / 1.2  # costs/facts: GpSimd 1.2 GHz, 8 cores x 16 partitions; ASSUMPTION 1 elem/partition/cycle
POOL_FIXED_NS = 150.0         # ASSUMPTION: DVE's fixed cost (no plain GpSimd compute op was measured)

# ---- Sync engine (SP): register ops and DMA triggers ------------------------------------------
SP_INSTR_NS = 238.0 / 4       # costs/measured "4-byte token-id seam: 4 instructions, 238 ns" (closest evidence)

# ---- cross-engine hand-off -------------------------------------------------------------------
# A dependency between two engines is a semaphore: the consumer waits for the producer's semaphore (SDK
# nki/api/nki/isa/__init__.py NkiInstruction.depends_on: "a semaphore wait that the device executes"; SDK
# nki/deep-dives/nki_perf_guide.rst Opt #3/#4: idle gaps end on semaphore waits of another engine or a DMA queue).
HANDOFF_NS = Band(
    "handoff_ns", 62.0, (243.0 + 197.0) / 2, 243.0, "ns per cross-engine dependency (compute consumer)",
    "costs/measured: sendrecv consumer semaphore blocks 243 / 197 ns (central = their mean, high = the larger); "
    "low = the ~62 ns issue spacing of PE LDWEIGHTS/MATMUL pairs (the fastest engine-to-engine reaction measured)")
HANDOFF_DMA_NS = Band(
    "handoff_dma_ns", 0.0, 1300.0, 1300.0, "ns from a producer's semaphore to the start of the DMA waiting on it",
    "SDK nki/deep-dives/nki-dma-bandwidth-guide.rst: every DMA transfer incurs 'semaphore-to-start latency "
    "(~1300 ns cross-engine)' (central and high); low = 0: the measured 1,781 ns small-DMA latency (costs/measured) "
    "already contains it")

# ---- DMA -------------------------------------------------------------------------------------
DMA_DGE_PER_CORE = 2          # costs/facts "2 hardware DGE instances per core"
DMA_ISSUE_NS = 40951.0 / 64   # costs/measured "128-byte DMAs x64: 40,951 ns instruction time" = 640 ns per DMA
#                               instruction on its DGE (SDK trainium2_arch.rst DGE: "about 600 ns to execute")
DMA_ISSUE_INDIRECT_NS = 62100.0 / 60   # costs/measured XLA glue "60 DMA_INDIRECT 62.1 µs (~1.0 µs each)" on GpSimd
DMA_ENGINES_PER_CORE = 16     # SDK nki-dma-bandwidth-guide.rst: "Each NeuronCore has 16 DMA engines"
DMA_ENGINE_BW = 23.0          # B/ns per DMA engine on trn2 (same guide, table "BW / Engine"): 16 x 23 = 368 GB/s
#                               per core
# A DMA spreads its partitions over the engines ("Use full partitions (P=128). Fewer partitions means fewer engines
# utilized", same guide): it uses min(16, partitions) engines.
DMA_DESCRIPTOR_OVERHEAD_BYTES = Band(
    "dma_descriptor_overhead_bytes", 66.0, 108.0, 215.0, "B of engine time per contiguous run (descriptor)",
    "a DMA moving runs of r contiguous bytes per descriptor achieves r / (r + b) of the engine rate. central and low: "
    "costs/measured proj_w repack, runs of 512-1,024 B -> 4,096 B took 240 -> 267 GB/s (b = 108 B at the 768 B "
    "mid-run, 66 B at 512 B); high: the DMA bandwidth guide's 'approaches peak at >= 2 KiB, saturates at 4 KiB per "
    "partition' read as 95 % at 4 KiB (b = 215 B)")
HBM_BW_PER_RANK = Band(
    "hbm_bw_per_rank", 707e9, 635e9, 571e9, "B/s per rank (both cores' DMAs share it)",
    "costs/measured 'sustainable DMA bandwidth per rank': 635 GB/s over 20 µs windows (central), 707 GB/s over "
    "10 µs (low); high = the vocab-head weight stream's 571 GB/s (costs/measured)")
HBM_BW_SPEC_PER_RANK = 2.9e12 / TP_RANKS   # costs/facts "HBM bandwidth 2.9 TB/s (arch page)", 4 stacks = 4 ranks
DMA_SMALL_LATENCY_NS = 1781.0  # costs/measured "small DMA latency: 2,048 B dma_copy SBUF->HBM 1,781 ns"
DMA_SMALL_LATENCY_BYTES = 2048
# Completion latency after the data moved, so that an isolated 2,048 B DMA takes exactly the measured
# 1,781 ns = trigger (an SP instruction) + issue + data phase + completion at the central constants (a 2 KiB
# single-partition store: one engine at 23 B/ns with the central descriptor overhead). Derived, not tuned
# against anything else.
_RUN = DMA_SMALL_LATENCY_BYTES
DMA_COMPLETION_NS = (DMA_SMALL_LATENCY_NS - SP_INSTR_NS - DMA_ISSUE_NS
                     - DMA_SMALL_LATENCY_BYTES * (1 + DMA_DESCRIPTOR_OVERHEAD_BYTES.central / _RUN) / DMA_ENGINE_BW)
# Which instruction queue triggers a hardware-DGE DMA ("commanded through either SyncE or ScalarE sequencer ...
# currently determined by NKI compiler", SDK nki/guides/architecture/trainium2_arch.rst "Descriptor Generation
# Engine"): the DMA waits in that queue in program order behind the queue's earlier instructions.
DMA_TRIGGER_QUEUE = Band(
    "dma_trigger_queue", "none", "SP", "ACT", "queue of a DMA whose engine= the kernel leaves to the compiler",
    "SDK trainium2_arch.rst DGE section ('commanded through either SyncE or ScalarE sequencer', the compiler's "
    "choice; a trigger on ScalarE is 'hidden behind earlier compute instructions', i.e. it waits for their issue, not "
    "their completion): central = SP (the triggers queue in program order with the register ops), high = ACT (in "
    "program order with the activations: a waiting trigger also holds them up), low = no queue ordering (a DMA "
    "triggers as soon as its inputs are ready, the pre-issue-13 model)")

# ---- runtime loops ---------------------------------------------------------------------------
LOOP_FENCES = Band(
    "loop_fences", "none", "iteration", "entry+iteration", "where a runtime loop fences the core",
    "SDK nki/deep-dives/nki-dynamic-loops.rst: a dynamic loop is a hardware loop instruction whose body is not "
    "unrolled, 'no scheduling across the boundary' (costs/2026). central: at every iteration end and at the loop "
    "exit the loop's own work (every engine's last instruction and every DMA since the previous boundary) completes "
    "before anything after it starts; high: also the loop entry waits for everything issued before it (outstanding "
    "DMAs included); low: no fence")

# ---- cross-core synchronisation and collectives ----------------------------------------------
SENDRECV_NS = 354.0           # costs/measured "sendrecv intra-LNC, 4,096 B: 354 ns" (+ bytes / HBM_BW_PER_RANK)
CORE_BARRIER_NS = 5138.0 / 3  # costs/measured "core_barrier x3 (round end): 5,138 ns instruction time"
ALL_REDUCE_NS = Band(
    "all_reduce_ns", 13030.0, 13331.0, 13820.0, "ns per TP all-reduce (fixed part)",
    "costs/measured 'TP all-reduce, nccl Mesh, 4,096 bf16 (8 KB): mean 13,331 ns ... octile means 13.03-13.82 µs'")
CC_TRIGGER_NS = Band(
    "cc_trigger_ns", 0.0, 145000.0 / 80, 145000.0 / 80, "ns before a collective starts",
    "costs/measured all-reduce row: '~145 µs total cc_trigger_start_delay' over its 80 all-reduces = 1.8 µs each "
    "(central, high); low = 0 (if that delay overlapped other work)")
ALL_GATHER_NS = Band(
    "all_gather_ns", 22158.0, (26729.0 + 22158.0) / 2, 26729.0, "ns per all-gather / other collective (fixed part)",
    "costs/measured 'AllGather Ring, 2 fp32 (8 B): 26,729 + 22,158 ns' (low, high; central = their mean). Other "
    "collectives (reduce_scatter, all_to_all, permutes) were not measured: ASSUMED to cost an all-gather")
# ASSUMPTION: the bytes term of a collective moves at the DMA bandwidth of a rank (at 8 KB it is 13 ns, consistent
# with costs/derived "TP all-reduce at 8 KB is pure latency").

# ---- launches --------------------------------------------------------------------------------
LAUNCH_OVERHEAD_NS = 13100.0  # costs/measured "instruction fetch at NEFF start: 13.1 µs head with no input DMA";
#                               charged once per round for both variants: the layerwise round is one XLA graph
#                               whose NKI kernels the graph compiler assembles into ONE executable (SDK
#                               nki/deep-dives/nki-compiler.rst "How the NKI Compiler Works with the Graph Compiler")
HOST_ROUND_NS = 10.31e6 - 9.50e6   # costs/2026 "host dispatch around a round (public kernel, measured): host p50
#                               10.31 ms vs device 9.50 ms": reported beside device time, never added to it
# A device-committed round (megakernel.plan device_commit, issue 15) needs no host decision between launches, so
# the host / runtime can enqueue launch n + 1 while launch n runs. Its per-round cost beyond the device round lies
# between nothing (the enqueue hidden under the previous round; the round still pays its NEFF start,
# LAUNCH_OVERHEAD_NS, which the device round includes) and the whole measured host-driven gap (nothing hidden).
# Not measured on a trn2 host: reported as this band with both ends, never as its low end alone.
CHAINED_HOST_NS = {"low": 0.0, "high": HOST_ROUND_NS}
CHAINED_HOST_SOURCES = {
    "low": "costs/measured 'instruction fetch at NEFF start: 13.1 us head' (LAUNCH_OVERHEAD_NS, inside the device "
           "round) only: the host enqueue fully overlaps the previous round",
    "high": "costs/2026 'host dispatch around a round (public kernel, measured)': the whole 0.81 ms gap of a "
            "host-driven round (HOST_ROUND_NS), nothing hidden"}

BANDS = (PE_FLOOR_NS, PE_THROTTLE, HANDOFF_NS, HANDOFF_DMA_NS, DMA_DESCRIPTOR_OVERHEAD_BYTES, HBM_BW_PER_RANK,
         DMA_TRIGGER_QUEUE, LOOP_FENCES, ALL_REDUCE_NS, CC_TRIGGER_NS, ALL_GATHER_NS)

# Fixed model choices, listed with the bands in every prediction's "assumptions".
FIXED = (
    ("physical_sbuf_reuse", "on", "a buffer's next writer waits for the last reader of the same physical SBUF/PSUM "
     "bytes (nkisim's first-fit placement); the real allocator may place tiles elsewhere"),
    ("dma_engine_bw", DMA_ENGINE_BW, "B/ns per DMA engine, 16 per core (SDK nki-dma-bandwidth-guide.rst)"),
    ("dve", f"{DVE_FIXED_NS} ns + {DVE_NS_PER_ELEM} ns/element", "costs/derived DVE fit; reciprocal 8x per element "
     "(SDK Engine Selection)"),
    ("act", f"{ACT_FIXED_NS} ns + {ACT_NS_PER_ELEM:.3f} ns/element + {ACT_TABLE_LOAD_NS} ns per table switch",
     "costs/facts clock; costs/measured ACT_TABLE_LOAD and groups; fixed part ASSUMED = DVE's"),
    ("pe_columns_per_cycle", PE_COLUMNS_PER_CYCLE, "costs/measured PE moving-stream throughput at 1.46 GHz"),
    ("dma_issue_ns", DMA_ISSUE_NS, "costs/measured 64 x 128 B DMAs; 2 DGEs per core (costs/facts)"),
    ("dma_completion_ns", DMA_COMPLETION_NS, "derived: an isolated 2 KiB store = the measured 1,781 ns"),
    ("launch_head_ns", LAUNCH_OVERHEAD_NS, "costs/measured NEFF start, once per round for every variant"),
)


def assumptions():
    """Every band and fixed choice with its source (the "assumptions" of a prediction's JSON)."""
    return {"bands": [b.as_dict() for b in BANDS],
            "fixed": [{"name": n, "value": v, "source": s} for n, v, s in FIXED]}
