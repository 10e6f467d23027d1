"""Every constant of the trn2 cost model, each with its source. Nothing else in harness.costmodel
holds a number about the hardware.

Sources: ``shared/docs/trn2-costs.md`` ("costs" below; "costs/facts" = its Trainium2 facts table,
"costs/measured" = its per-operation table, "costs/derived" = its derived calibration) and
``shared/docs/nki-reference.md`` §4 ("ref §4"). A constant marked ASSUMPTION has no measurement
behind it; it is stated so and kept where a measurement can replace it. No constant is tuned to
make an end-to-end number come out: each comes from one per-operation measurement or spec figure.
"""

# ---- topology --------------------------------------------------------------------------------
TP_RANKS = 4                  # DESIGN.md §4: TP=4 ranks on one trn2 chip (costs/facts "logical NeuronCores")
LNC = 2                       # physical cores per rank (costs/facts: LNC=2 default)

# ---- TensorE (PE) ----------------------------------------------------------------------------
PE_CLOCK_HZ = 1.46e9          # costs/derived PE: "at 1.38 columns/cycle and 1.46 GHz that is 24.65 µs"
PE_COLUMNS_PER_CYCLE = 1.38   # costs/measured "PE moving-stream throughput": 1.38 columns/cycle, 4 rotating groups
PE_COLUMNS_PER_CYCLE_PINNED = 1.08   # same row: all tiles pinned to tile_position=(0,0) (-28 %)
PE_FLOOR_NS = 140.0           # costs/measured "PE per-instruction floor ~140 ns"
PE_FP32_PASSES = 2            # costs/measured "fp32 nc_matmul lowers to 2 LDWEIGHTS + 2 MATMUL"; nc_transpose 1 pass
PE_THROTTLE_FACTOR = 1.69     # costs/measured "identical in_proj matmul 592 ns unthrottled, 1,001 ns throttled (1.69x)"
# Used only when predict(..., pe_throttle=True): the "0.5 utilisation" throttle covered 44 µs of one capture.

# ---- VectorE (DVE) ---------------------------------------------------------------------------
DVE_FIXED_NS = 150.0          # costs/derived DVE: t ≈ 0.15 µs + 1.04 ns x free elements per partition
DVE_NS_PER_ELEM = 1.04        # same fit (685 ns at 512 columns; 16.3 µs at 15,520), independent of partitions
# No perf-mode speed-up for bf16 is applied: costs/facts quotes 2-4x for bf16 copies in SBUF but no
# instruction was measured in that mode.

# ---- ScalarE (ACT) ---------------------------------------------------------------------------
ACT_NS_PER_ELEM = 1.0 / 1.2   # costs/facts "engine clocks": Scalar 1.2 GHz, 128 elems/cycle = 1 per partition per cycle
ACT_FIXED_NS = 150.0          # ASSUMPTION: no ACT instruction was measured; DVE's fixed cost (costs/derived) reused
ACT_TABLE_LOAD_NS = 1283.0    # costs/measured "ACT_TABLE_LOAD 1,283 ns each, constant (also under throttling)"
# costs/measured "ACT table groups": t0 = {COPY, SQUARE, RSQRT}, t1 = SIGMOID, t2 = SILU, t3 = EXP, t4 = SOFTPLUS;
# any switch between groups costs one load. Functions not listed there are ASSUMED to live in a group of
# their own (a switch to or from them costs a load). Keys are nkisim's `func` names (nkisim/ops.py).
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

# ---- Sync engine (SP): register ops ------------------------------------------------------------
SP_INSTR_NS = 238.0 / 4       # costs/measured "4-byte token-id seam: 4 instructions, 238 ns" (closest evidence)

# ---- DMA -------------------------------------------------------------------------------------
DMA_QUEUES_PER_CORE = 16      # costs/facts "DMA engines: 128 per chip, typically 16 paired with each physical core"
DMA_DGE_PER_CORE = 2          # costs/facts "2 hardware DGE instances per core"
DMA_ISSUE_NS = 40951.0 / 64   # costs/measured "128-byte DMAs x64: 40,951 ns instruction time" = 640 ns per DMA
#                               instruction on its DGE (costs/facts: "~600 ns per DGE DMA instruction")
DMA_ISSUE_INDIRECT_NS = 62100.0 / 60   # costs/measured XLA glue "60 DMA_INDIRECT 62.1 µs (~1.0 µs each)"
HBM_BW_PER_RANK = 635e9       # B/s, costs/measured "sustainable DMA bandwidth per rank 635 GB/s (20 µs window)"
HBM_BW_SPEC_PER_RANK = 2.9e12 / TP_RANKS   # costs/facts "HBM bandwidth 2.9 TB/s (arch page)", 4 stacks = 4 ranks
DMA_SMALL_LATENCY_NS = 1781.0  # costs/measured "small DMA latency: 2,048 B dma_copy SBUF->HBM 1,781 ns"
DMA_SMALL_LATENCY_BYTES = 2048
# Completion latency after the data moved, so that an isolated 2,048 B DMA takes exactly the measured
# 1,781 ns = issue + bytes/bandwidth + completion (derived, not tuned against anything else).
DMA_COMPLETION_NS = DMA_SMALL_LATENCY_NS - DMA_ISSUE_NS - DMA_SMALL_LATENCY_BYTES / HBM_BW_PER_RANK * 1e9

# ---- cross-core synchronisation and collectives ----------------------------------------------
SENDRECV_NS = 354.0           # costs/measured "sendrecv intra-LNC, 4,096 B: 354 ns" (+ bytes / HBM_BW_PER_RANK)
CORE_BARRIER_NS = 5138.0 / 3  # costs/measured "core_barrier x3 (round end): 5,138 ns instruction time"
ALL_REDUCE_NS = 13331.0       # costs/measured "TP all-reduce, nccl Mesh, 4,096 bf16 (8 KB): mean 13,331 ns"
ALL_GATHER_NS = (26729.0 + 22158.0) / 2   # costs/measured "AllGather Ring, 2 fp32 (8 B): 26,729 + 22,158 ns"
# Other collectives (reduce_scatter, all_to_all, permutes) were not measured: ASSUMED to cost an all-gather.
COLLECTIVE_BW = HBM_BW_PER_RANK   # ASSUMPTION: the bytes term of a collective moves at the DMA bandwidth of a rank
# (at 8 KB it is 13 ns, consistent with costs/derived "TP all-reduce at 8 KB is pure latency").

# ---- launches (the layerwise composition) ----------------------------------------------------
LAUNCH_OVERHEAD_NS = 13100.0  # costs/measured "instruction fetch at NEFF start: 13.1 µs head with no input DMA"
