"""trn2 cost model: hand-computable NKI micro-kernels (under nkisim) predicted exactly as the formulas of
harness/costmodel/constants.py say -- one test per cost, incl. the costs of issue 13 (cross-engine hand-off,
physical SBUF reuse, DMA size efficiency and engine caps, the HWDGE trigger queue, runtime-loop boundaries,
collective trigger delay, DVE reciprocal, the PE floor) -- the band's order and direction, dependency
bookkeeping, stages, critical path. Assertions are on model outputs (formula results), never on timings."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from harness import costmodel
from harness.costmodel import constants as C
from harness.costmodel import costs
from harness.costmodel import microkernels as mk
from harness.costmodel.costs import Params
from harness.costmodel.deps import DependencyBuilder

# the bare model: no hand-off, no trigger queue, no loop fences, no collective trigger delay (each test of a
# new cost switches exactly that one on)
BARE = dict(handoff_ns=0.0, handoff_dma_ns=0.0, dma_trigger_queue="none", loop_fences="none", cc_trigger_ns=0.0)


def bare(**kw):
    return Params.at("central", **{**BARE, **kw})


def pred(tr, **kw):
    return costmodel.predict(tr, params=bare(**kw))


BW = C.HBM_BW_PER_RANK.central / 1e9          # HBM bytes per ns (central)
B0 = C.DMA_DESCRIPTOR_OVERHEAD_BYTES.central
CORE_BW = C.DMA_ENGINES_PER_CORE * C.DMA_ENGINE_BW


def dve_ns(free):
    return C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * free


def act_ns(free):
    return C.ACT_FIXED_NS + C.ACT_NS_PER_ELEM * free


def pe_ns(cols, passes=1, floor=C.PE_FLOOR_NS.central):
    return max(floor, passes * cols / (C.PE_COLUMNS_PER_CYCLE * C.PE_CLOCK_HZ) * 1e9)


def data_ns(nbytes, partitions, run, hbm=True):
    """Data phase of one DMA alone on its core: its engines (min(16, P) x 23 B/ns) or the core's 16, each
    divided by the size inflation 1 + b0 / run; and the rank's HBM."""
    infl = 1 + B0 / run
    rate = min(min(16, partitions) * C.DMA_ENGINE_BW / infl, CORE_BW / infl, BW if hbm else float("inf"))
    return nbytes / rate


def dma_ns(nbytes, partitions, run, trigger=0.0):
    return trigger + C.DMA_ISSUE_NS + data_ns(nbytes, partitions, run) + C.DMA_COMPLETION_NS


# ---- DMA: fixed latency, size efficiency, engine and bandwidth caps -----------------------------------------
def test_an_isolated_2kib_store_is_the_measured_latency():
    p = pred(mk.capture(mk.one_dma_store, mk.SD((1, 2048), "uint8")), dma_trigger_queue="SP")
    T = p.timeline
    assert T.finish[1] - T.start[1] == pytest.approx(C.DMA_SMALL_LATENCY_NS, abs=1e-6)   # 1,781 ns by construction
    assert p.hbm_read_bytes == 2048 and p.hbm_write_bytes == 2048


@pytest.mark.parametrize("nbytes", [128 * 1024, 4 * 1024 * 1024])
def test_one_large_dma_is_capped_by_the_core_engines_with_the_run_size_efficiency(nbytes):
    p = pred(mk.trace_one_dma(nbytes))          # [128, nbytes/128]: one row per partition
    run = nbytes // 128
    assert p.latency_ns == pytest.approx(dma_ns(nbytes, 128, run), rel=1e-9)
    # 368 GB/s per core (the DMA bandwidth guide), not the rank's 635: one core cannot use the whole HBM
    assert data_ns(nbytes, 128, run) > nbytes / BW


def test_two_cores_share_the_rank_bandwidth():
    nbytes = 4 * 1024 * 1024
    p = pred(mk.trace_one_dma(nbytes, lnc=2))
    # each core's engines could move 368 GB/s but the rank's HBM gives each of the two DMAs half of 635
    assert p.latency_ns == pytest.approx(C.DMA_ISSUE_NS + 2 * nbytes / BW + C.DMA_COMPLETION_NS, rel=1e-9)


def test_small_transfers_per_partition_lose_bandwidth():
    """Same bytes, runs of 16 B vs 4 KiB per partition: the descriptor overhead b0 per run (DMA bandwidth guide:
    >= 2 KiB per partition approaches peak, 4 KiB saturates)."""
    small, big = pred(mk.trace_one_dma(2048)), pred(mk.trace_one_dma(128 * 4096))
    assert small.latency_ns == pytest.approx(dma_ns(2048, 128, 16), rel=1e-9)
    assert big.latency_ns == pytest.approx(dma_ns(128 * 4096, 128, 4096), rel=1e-9)
    eff = lambda run: 1 / (1 + B0 / run)                                          # noqa: E731
    assert eff(2048) > 0.9 and eff(4096) > 0.95 and eff(16) < 0.2
    lo = costmodel.predict(mk.trace_one_dma(2048), params=bare(dma_descriptor_overhead_bytes=66.0)).latency_ns
    hi = costmodel.predict(mk.trace_one_dma(2048), params=bare(dma_descriptor_overhead_bytes=215.0)).latency_ns
    assert lo < small.latency_ns < hi


def test_back_to_back_small_dmas_are_bound_by_the_two_dges():
    n = 64
    p = pred(mk.trace_small_dmas(n))           # n [1, 128] B loads: one partition (one engine) each
    expect = n / C.DMA_DGE_PER_CORE * C.DMA_ISSUE_NS + data_ns(128, 1, 128) + C.DMA_COMPLETION_NS
    assert p.latency_ns == pytest.approx(expect, rel=1e-6)


def test_software_dge_gathers_are_written_by_gpsimd():
    rec = {"engine": "DMA", "op": "dma_copy", "reads": [{"indirect": "vector"}], "writes": []}
    assert costs.dma_trigger(rec, Params.at()) == "POOL" and costs.dma_issue_ns(rec) == C.DMA_ISSUE_INDIRECT_NS
    assert costs.dma_trigger({"dge_mode": "swdge"}, Params.at()) == "POOL"
    assert costs.dma_trigger({"trigger": "scalar"}, Params.at()) == "ACT"
    assert costs.dma_trigger({"trigger": "unknown"}, Params.at("low")) == "none"
    assert costs.dma_trigger({}, Params.at("central")) == "SP"


# ---- TensorE --------------------------------------------------------------------------------------------
def test_matmul_chain():
    n, N = 8, 512
    p = pred(mk.trace_matmul_chain(n=n, N=N))
    assert p.busy_ns["r0c0"]["PE"] == pytest.approx(n * pe_ns(N), rel=1e-9)
    # the chain starts when the (later) weight load lands: x [128, 2] and w [128, 4096] bf16 share the core's
    # engines (each at most 368 / inflation) while both move, then w alone
    T = p.timeline
    w = max(range(2), key=lambda i: T.finish[i])
    assert p.latency_ns == pytest.approx(T.finish[w] + n * pe_ns(N), rel=1e-9)


def test_pe_floor_at_each_end_of_the_band():
    rec = {"op": "nc_matmul", "N": 1, "dtypes": {"moving": "bfloat16"}, "shapes": {}}
    assert [costs.pe_ns(rec, Params.at(e)) for e in C.ENDS] == [C.PE_FLOOR_NS.low, C.PE_FLOOR_NS.central,
                                                                 C.PE_FLOOR_NS.high * C.PE_THROTTLE.high]
    assert C.PE_FLOOR_NS.central == pytest.approx(1500.0 / 16)      # the measured 16-transpose chain
    p = pred(mk.trace_transposes(16))
    assert p.busy_ns["r0c0"]["PE"] == pytest.approx(16 * C.PE_FLOOR_NS.central)


def test_fp32_matmul_is_two_passes_and_the_throttle_is_the_high_end():
    c = Params.at("central")
    assert costs.pe_ns({"op": "nc_matmul", "N": 512, "dtypes": {"moving": "float32"}, "shapes": {}}, c) == \
        pytest.approx(pe_ns(512, 2))
    thr = costs.pe_ns({"op": "nc_matmul", "N": 512, "dtypes": {"moving": "bfloat16"}, "shapes": {}},
                      Params.at("central", pe_throttle=C.PE_THROTTLE.high))
    assert thr == pytest.approx(pe_ns(512) * 1.69)


def test_in_proj_pe_busy_matches_the_column_model():
    p = pred(mk.trace_in_proj())
    runs = (256, 256, 512, 512, 16)
    assert p.busy_ns["r0c0"]["PE"] == pytest.approx(16 * sum(pe_ns(r, 2) for r in runs), rel=1e-9)


# ---- VectorE / ScalarE -----------------------------------------------------------------------------------
def test_dve_formula_is_independent_of_partitions():
    for P in (1, 128):
        p = pred(mk.trace_dve(P, 512))
        assert p.busy_ns["r0c0"]["DVE"] == pytest.approx(dve_ns(512), rel=1e-12)


def test_dve_reciprocal_costs_eight_times_per_element():
    p = pred(mk.trace_reciprocal(512))
    assert p.busy_ns["r0c0"]["DVE"] == pytest.approx(C.DVE_FIXED_NS + 8 * C.DVE_NS_PER_ELEM * 512, rel=1e-12)


def test_argmax_chunk_is_two_dve_scans_of_the_chunk():
    F = 15520
    p = pred(mk.trace_argmax_chunk(F))
    assert p.busy_ns["r0c0"]["DVE"] == pytest.approx(dve_ns(8) + 2 * dve_ns(F), rel=1e-12)


def test_act_table_loads_on_group_switch():
    F = 256
    p = pred(mk.trace_act_sequence(F))
    # exp exp silu exp rsqrt square copy sigmoid softplus tanh: loads at the first exp, silu, exp, rsqrt
    # (t0 also holds square and copy), sigmoid, softplus and tanh (own group) = 7
    n, t = p.act_table_loads["r0c0"]
    assert n == 7 and t == pytest.approx(7 * C.ACT_TABLE_LOAD_NS)
    assert p.busy_ns["r0c0"]["ACT"] == pytest.approx(len(mk.ACT_SEQUENCE) * act_ns(F) + 7 * C.ACT_TABLE_LOAD_NS)


# ---- cross-engine hand-off ---------------------------------------------------------------------------------
def test_dependency_chain_across_engines_adds_up_and_pays_one_hand_off_per_engine_change():
    F = 512
    tr = mk.trace_engine_chain(F)
    p = pred(tr)
    T = p.timeline
    t_w = max(T.finish[0], T.finish[1])        # both loads (x and w) land
    chain = (pe_ns(F) + act_ns(F) + C.ACT_TABLE_LOAD_NS + dve_ns(F) + act_ns(F) + C.ACT_TABLE_LOAD_NS
             + dve_ns(F) + dma_ns(128 * F * 4, 128, F * 4))
    assert p.latency_ns == pytest.approx(t_w + chain, rel=1e-9)
    assert sum(ns for ns, *_ in p.critical) == pytest.approx(p.latency_ns, rel=1e-9)
    assert sum(p.critical_by_stage.values()) == pytest.approx(p.latency_ns, rel=1e-9)
    # DMA -> PE -> ACT -> DVE -> ACT -> DVE: five compute consumers of another engine, then one DMA waiting on DVE
    h, hd = 300.0, 1000.0
    q = costmodel.predict(tr, params=bare(handoff_ns=h, handoff_dma_ns=hd))
    assert q.latency_ns - p.latency_ns == pytest.approx(5 * h + hd, rel=1e-9)
    assert q.critical_by_category["hand-off"] >= 5 * h + hd - 1e-6


# ---- physical SBUF reuse ------------------------------------------------------------------------------------
def test_a_reused_address_waits_for_its_last_reader():
    F = 2048
    tr = mk.trace_physical_reuse(F)
    on = costmodel.predict(tr, params=bare())
    off = costmodel.predict(tr, params=bare(), physical_deps=False)
    T = on.timeline
    # the second memset (instruction 2) writes the bytes the ACT copy (instruction 1) is reading
    assert T.start[2] == pytest.approx(T.finish[1])
    assert T.finish[1] == pytest.approx(dve_ns(F) + C.ACT_TABLE_LOAD_NS + act_ns(F))
    assert off.timeline.start[2] == pytest.approx(dve_ns(F))    # by buffer id: right after the first memset
    assert on.latency_ns > off.latency_ns


# ---- the HWDGE trigger queue ------------------------------------------------------------------------------
def test_dmas_of_one_queue_move_in_order_and_queues_share_the_engines():
    """SDK nki-dma-overview.rst "DMA Queues": transfers within a queue run in order, different queues round robin.
    Two 4 MiB loads from the SP queue: the first moves alone at the core's engine rate, the second starts its data
    phase when the first's ends; the second on ScalarE's queue: both move at once, each at half the rate. Without a
    trigger queue (the band's low end) no order is known and they share as well."""
    nbytes = 4 * 1024 * 1024
    run = nbytes // 128
    one = data_ns(nbytes, 128, run)
    t0 = C.SP_INSTR_NS + C.DMA_ISSUE_NS           # trigger + issue on its DGE (the two DGEs issue in parallel)
    same = costmodel.predict(mk.trace_two_loads(nbytes), params=bare(dma_trigger_queue="SP")).timeline
    a, b = 0, 1
    assert same.finish[a] == pytest.approx(t0 + one + C.DMA_COMPLETION_NS, rel=1e-9)
    assert same.finish[b] == pytest.approx(t0 + 2 * one + C.DMA_COMPLETION_NS, rel=1e-6)
    assert same.binder[b][0] == a                  # the critical path goes through the queue's earlier DMA
    split = costmodel.predict(mk.trace_two_loads(nbytes, True), params=bare(dma_trigger_queue="SP")).timeline
    assert split.finish[a] == pytest.approx(split.finish[b], rel=1e-3)
    assert split.finish[a] == pytest.approx(t0 + 2 * one + C.DMA_COMPLETION_NS, rel=1e-3)
    free = costmodel.predict(mk.trace_two_loads(nbytes), params=bare()).timeline
    assert free.finish[a] == pytest.approx(free.finish[b], rel=1e-3)


def test_a_dma_trigger_waits_in_its_queue_behind_a_waiting_trigger():
    F = 4096
    tr = mk.trace_queued_dmas(F)
    dve = dve_ns(F) * 2                     # memset + tensor_scalar on the same tile
    free = costmodel.predict(tr, params=bare()).timeline
    sp = costmodel.predict(tr, params=bare(dma_trigger_queue="SP")).timeline
    store, load = 2, 3
    assert free.start[load] == 0.0                                   # no queue: the independent load goes at once
    assert sp.start[store] == pytest.approx(dve)
    assert sp.start[load] == pytest.approx(dve + C.SP_INSTR_NS)      # behind the store's trigger
    act = costmodel.predict(tr, params=bare(dma_trigger_queue="ACT")).timeline
    assert act.start[load] == pytest.approx(dve + C.SP_INSTR_NS)


# ---- runtime-loop boundaries -----------------------------------------------------------------------------
def test_loop_iterations_are_fenced():
    n, F, h = 4, 1024, 250.0
    tr = mk.trace_loop_body(n, F)
    assert [lp["trips"] for lp in tr.loops] == [n]
    none = costmodel.predict(tr, params=bare(handoff_ns=h))
    it = costmodel.predict(tr, params=bare(handoff_ns=h, loop_fences="iteration"))
    # the DVE op (F columns) is longer than the ACT op (F/4): without fences DVE runs its n ops back to back;
    # with fences each iteration ends waiting for both and the next starts one hand-off later
    assert it.latency_ns - none.latency_ns == pytest.approx((n - 1) * h, rel=1e-9)
    assert len(it.timeline.fences) == n      # n - 1 iteration ends + the exit
    entry = costmodel.predict(tr, params=bare(handoff_ns=h, loop_fences="entry+iteration"))
    assert entry.latency_ns >= it.latency_ns


@nki.jit
def _empty_loop_between(n, x):
    """A long ACT op on tile b, then a runtime loop of n (0) trips, then an independent DVE op on tile a and a store
    of a: only a fence that waits for pre-loop work puts the ACT op on the store's path."""
    P, F = x.shape
    r = nisa.register_alloc()
    nisa.register_load(r, n)
    b = nl.ndarray((P, 4 * F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=b, value=1.0, engine=nisa.engine.gpsimd)
    nisa.activation(dst=b, op=nl.copy, data=b)
    a = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)

    def body(i):
        nisa.memset(dst=a, value=2.0)
    nl.fori_loop(0, r, body)
    nisa.memset(dst=a, value=1.0)
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def test_a_loop_that_ran_zero_times_does_not_wait_for_the_work_before_it():
    tr = mk.capture(_empty_loop_between, np.array([[0]], np.int32), mk.SD((128, 256), "float32"))
    assert [lp["trips"] for lp in tr.loops] == [0]
    none = pred(tr)
    it = pred(tr, loop_fences="iteration")         # central: a 0-trip loop has no loop work to fence
    assert len(it.timeline.fences) == 1
    assert it.latency_ns == pytest.approx(none.latency_ns, rel=1e-9)
    entry = pred(tr, loop_fences="entry+iteration")  # high: the entry waits for everything issued before it
    assert entry.latency_ns > none.latency_ns + act_ns(4 * 256) / 2


# ---- dependencies ----------------------------------------------------------------------------------------
def test_war_waits_for_the_reader_and_quadrants_do_not_conflict():
    b = DependencyBuilder()
    tile = lambda p0, n, lo, hi: {"buf": 7, "mem": "sbuf", "part": [p0, n], "bytes": [lo, hi]}   # noqa: E731
    assert b.access(0, 0, 0, [], [tile(0, 128, 0, 1024)]) == set()       # write
    assert b.access(1, 1, 0, [tile(0, 128, 0, 512)], []) == {0}           # RAW
    assert b.access(2, 2, 0, [], [tile(0, 128, 256, 768)]) == {0, 1}      # WAW + WAR on the reader
    assert b.access(3, 3, 0, [tile(0, 128, 512, 1024)], []) == {0, 2}     # two writers of the range
    assert b.access(4, 4, 0, [], [tile(0, 1, 2048, 2050)]) == set()       # untouched bytes
    assert b.access(5, 5, 0, [], [tile(32, 1, 2048, 2050)]) == set()      # another quadrant: no WAW
    assert b.access(6, 6, 0, [tile(0, 64, 2048, 2050)], []) == {4, 5}     # a read across both quadrants
    assert b.access(7, 7, 1, [tile(0, 128, 0, 1024)], []) == set()        # another core: only sync orders cores


def test_registers_are_dependencies():
    sb = lambda buf, lo, hi: {"arg": "dst", "buf": buf, "mem": "sbuf", "part": [0, 1], "bytes": [lo, hi]}  # noqa
    hbm = {"arg": "src", "buf": 9, "mem": "shared_hbm", "indirect": "scalar", "bytes": [0, 1 << 20]}
    recs = [_rec(0, "DVE", "iota", writes=[sb(1, 0, 8)], shapes={"dst": [1, 2]}),
            _rec(0, "SP", "register_load", reads=[{**sb(1, 0, 4), "arg": "src"}], reg_writes=[1]),
            _rec(0, "DMA", "dma_copy", reads=[hbm], writes=[sb(2, 1024, 1280)], reg_reads=[1],
                 bytes={"shared_hbm": {"read": 256}, "sbuf": {"write": 256}})]
    T = costmodel.predict(recs, params=bare()).timeline
    assert T.start[2] == pytest.approx(T.finish[1]) and T.finish[1] == pytest.approx(dve_ns(2) + C.SP_INSTR_NS)
    # the same DMA triggered from SP: the register is its own queue's, no semaphore even with a DMA hand-off
    T = costmodel.predict(recs, params=bare(dma_trigger_queue="SP", handoff_dma_ns=1000.0)).timeline
    assert T.start[2] == pytest.approx(T.finish[1])


# ---- cross-core and collectives ------------------------------------------------------------------------------
def test_barrier_synchronises_the_lnc_pair():
    F = 1024
    p = pred(mk.trace_barrier(F))
    small = dma_ns(128 * 4, 128, 4)
    # core 0: memset, multiply, store; barrier at max arrival + cost; core 1: load after the barrier
    assert p.latency_ns == pytest.approx(2 * dve_ns(F) + small + C.CORE_BARRIER_NS + small, rel=1e-9)


def test_sendrecv_rendezvous():
    p = pred(mk.trace_sendrecv(P=32, F=64, dtype="float16"))
    assert p.latency_ns == pytest.approx(dve_ns(64) + C.SENDRECV_NS + 4096 / BW, rel=1e-9)


def _rec(inst, engine, op, reads=(), writes=(), rank=0, nbytes=None, **kw):
    r = {"rank": rank, "inst": inst, "engine": engine, "op": op, "loc": f"synthetic.py:{op}", "shapes": {},
         "dtypes": {}, "bytes": {}, "reads": list(reads), "writes": list(writes)}
    if nbytes is not None:
        r["bytes"] = {"sbuf": {"read": nbytes, "write": nbytes}}
    r.update(kw)
    return r


def _all_reduce_recs():
    sb = lambda inst, buf: {"buf": buf, "mem": "sbuf", "inst": inst, "part": [0, 2], "bytes": [0, 4096]}  # noqa
    recs = []
    for rank in range(4):
        for inst in range(2):
            recs.append(_rec(inst, "DVE", "tensor_scalar", writes=[sb(inst, 10 + 2 * rank + inst)], rank=rank,
                             shapes={"dst": [2, 2048]}))
    for rank in range(4):
        for inst in range(2):
            b = 10 + 2 * rank + inst
            recs.append(_rec(inst, "CC", "all_reduce", reads=[sb(inst, b)], writes=[sb(inst, b)], rank=rank,
                             nbytes=8192))
    return recs


def test_all_reduce_costs_the_measured_latency_plus_its_trigger_delay():
    recs = _all_reduce_recs()
    ar = C.ALL_REDUCE_NS.central + 2 * 3 / 4 * 8192 / BW
    p = costmodel.predict(recs, params=bare())
    assert p.latency_ns == pytest.approx(dve_ns(2048) + ar, rel=1e-9) and len(p.cores) == 8
    q = costmodel.predict(recs, params=bare(cc_trigger_ns=C.CC_TRIGGER_NS.central))
    assert q.latency_ns - p.latency_ns == pytest.approx(C.CC_TRIGGER_NS.central)


def test_all_reduce_8kb_under_nkisim_launch():
    p = pred(mk.trace_all_reduce(T=2, H=2048, tp=4, lnc=2))
    assert len(p.cores) == 8
    ar = C.ALL_REDUCE_NS.central + 2 * 3 / 4 * 8192 / BW
    assert p.critical[0][3] == "all_reduce" and p.critical[0][0] == pytest.approx(ar, rel=1e-9)


def test_collective_waits_for_the_slowest_core():
    sb = lambda inst, lo: {"buf": 1 + inst, "mem": "sbuf", "inst": inst, "part": [0, 1], "bytes": [lo, lo + 8]}  # noqa
    recs = [_rec(0, "DVE", "tensor_scalar", writes=[sb(0, 0)], shapes={"dst": [1, 4096]}),
            _rec(0, "CC", "all_gather", reads=[sb(0, 0)], writes=[sb(0, 8)], nbytes=8),
            _rec(1, "CC", "all_gather", reads=[sb(1, 0)], writes=[sb(1, 8)], nbytes=8)]
    p = costmodel.predict(recs, params=bare())
    assert p.latency_ns == pytest.approx(dve_ns(4096) + costs.collective_ns("all_gather", 8, 4, bare()), rel=1e-9)


# ---- the band --------------------------------------------------------------------------------------------
BAND_KERNELS = {
    "engine chain": lambda: mk.trace_engine_chain(512),
    "small DMAs": lambda: mk.trace_small_dmas(64),
    "matmul chain": lambda: mk.trace_matmul_chain(),
    "loop": lambda: mk.trace_loop_body(4, 1024),
    "queued DMAs": lambda: mk.trace_queued_dmas(),
    "all-reduce": lambda: mk.trace_all_reduce(),
    "weight stream": lambda: mk.trace_weight_stream(8, 4096),
}


@pytest.mark.parametrize("name", sorted(BAND_KERNELS))
def test_the_band_is_ordered_and_each_end_moves_the_way_its_constant_says(name):
    tr = BAND_KERNELS[name]()
    b = costmodel.predict_band(tr)
    t = b.time_us()
    assert t["low"] <= t["central"] <= t["high"]
    c = b.central.latency_ns
    for band in C.BANDS:
        lo = costmodel.predict(tr, params=Params.at("central", **{band.name: band.low})).latency_ns
        hi = costmodel.predict(tr, params=Params.at("central", **{band.name: band.high})).latency_ns
        assert lo <= c * (1 + 1e-12) and hi >= c * (1 - 1e-12), band.name


def test_every_band_has_its_source_and_ordered_numeric_ends():
    names = set()
    for band in C.BANDS:
        assert band.source and band.unit and band.name not in names
        names.add(band.name)
        if isinstance(band.central, float):
            fast_is_high = band.name == "hbm_bw_per_rank"
            lo, hi = (band.high, band.low) if fast_is_high else (band.low, band.high)
            assert lo <= band.central <= hi, band.name
    a = C.assumptions()
    assert {b["name"] for b in a["bands"]} == names and a["fixed"]


# ---- stages, JSON ------------------------------------------------------------------------------------------
def test_stage_tags_dict_function_and_markers():
    tr = mk.trace_engine_chain(128)
    by_fn = costmodel.predict(tr, stages="function")
    assert set(by_fn.stage_order) == {"microkernels.py:engine_chain"}
    d = costmodel.predict(tr, stages={"compute": ["*:engine_chain"], "never": ["nothing.py:*"]})
    assert d.stage_order == ["compute"]
    by_engine = costmodel.predict(tr, stages=lambda rec: "dma" if rec["engine"] == "DMA" else "compute")
    assert sum(by_engine.critical_by_stage.values()) == pytest.approx(by_engine.latency_ns, rel=1e-9)
    assert by_engine.critical_by_stage["dma"] > 0 and by_engine.critical_by_stage["compute"] > 0

    import nkisim
    with nkisim.trace.capture() as tr2:
        marks = costmodel.StageMarks(tr2)
        with marks.stage("first"):
            mk.dve_ops(nkisim.ShapeDtype((128, 64), "float32"))
        with marks.stage("second"):
            mk.dve_ops(nkisim.ShapeDtype((128, 64), "float32"))
    p = costmodel.predict(tr2, stages=marks)
    assert p.stage_order == ["first", "second"]


def test_json_round_trip_keeps_the_loops(tmp_path):
    tr = mk.trace_loop_body(3, 256)
    path = tmp_path / "t.json"
    tr.to_json(str(path))
    assert costmodel.predict(str(path)).latency_ns == pytest.approx(costmodel.predict(tr).latency_ns)
    assert len(costmodel.predict(str(path)).timeline.fences) == 3
