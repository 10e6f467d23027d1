"""trn2 cost model: hand-computable micro-kernels (NKI under nkisim) predicted exactly as the formulas of
harness/costmodel/constants.py say; dependency bookkeeping; stages; critical path; composition.
Assertions are on model outputs (formula results), never on wall-clock timings."""
import pytest

from harness import costmodel
from harness.costmodel import constants as C
from harness.costmodel import costs
from harness.costmodel import microkernels as mk
from harness.costmodel.deps import DependencyBuilder

BW = C.HBM_BW_PER_RANK / 1e9          # bytes per ns


def dma_ns(nbytes, issue=C.DMA_ISSUE_NS):
    """An isolated DMA: issue + bytes over the rank's bandwidth + completion latency."""
    return issue + nbytes / BW + C.DMA_COMPLETION_NS


def dve_ns(free):
    return C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * free


def act_ns(free):
    return C.ACT_FIXED_NS + C.ACT_NS_PER_ELEM * free


def pe_ns(cols, passes=1):
    return max(C.PE_FLOOR_NS, passes * cols / (C.PE_COLUMNS_PER_CYCLE * C.PE_CLOCK_HZ) * 1e9)


# ---- single-engine formulas ---------------------------------------------------------------------------
def test_one_small_dma_is_the_measured_latency():
    p = costmodel.predict(mk.trace_one_dma(2048))
    assert p.latency_ns == pytest.approx(C.DMA_SMALL_LATENCY_NS, abs=1e-6)   # 1,781 ns by construction
    assert p.hbm_read_bytes == 2048 and p.hbm_write_bytes == 0


@pytest.mark.parametrize("nbytes", [128 * 1024, 4 * 1024 * 1024])
def test_one_large_dma_is_latency_plus_bytes_over_bandwidth(nbytes):
    p = costmodel.predict(mk.trace_one_dma(nbytes))
    assert p.latency_ns == pytest.approx(dma_ns(nbytes), rel=1e-9)
    assert p.summary()["hbm_pipe_busy_pct"][0] == pytest.approx(100 * nbytes / BW / p.latency_ns, rel=1e-9)


def test_two_cores_share_the_rank_bandwidth():
    nbytes = 4 * 1024 * 1024
    p = costmodel.predict(mk.trace_one_dma(nbytes, lnc=2))
    # both cores issue at t=0 and share the pipe: each transfer's data phase takes 2 x bytes / BW
    assert p.latency_ns == pytest.approx(C.DMA_ISSUE_NS + 2 * nbytes / BW + C.DMA_COMPLETION_NS, rel=1e-9)


def test_back_to_back_small_dmas_are_bound_by_the_two_dges():
    n = 64
    p = costmodel.predict(mk.trace_small_dmas(n))
    # 2 DGEs issue 640 ns each; the last pair issues at n/2 * 640, shares the pipe for 2 x 128 B, completes
    expect = n / C.DMA_DGE_PER_CORE * C.DMA_ISSUE_NS + 2 * 128 / BW + C.DMA_COMPLETION_NS
    assert p.latency_ns == pytest.approx(expect, rel=1e-6)


def test_matmul_chain():
    n, N = 8, 512
    p = costmodel.predict(mk.trace_matmul_chain(n=n, N=N))
    pe = p.busy_ns["r0c0"]["PE"]
    assert pe == pytest.approx(n * pe_ns(N), rel=1e-9)
    # the chain starts when the (later) weight load lands: loads of 512 B and 1 MiB share the pipe
    w_bytes, x_bytes = 128 * n * N * 2, 128 * 2 * 2
    t_w = C.DMA_ISSUE_NS + 2 * x_bytes / BW + (w_bytes - x_bytes) / BW + C.DMA_COMPLETION_NS
    assert p.latency_ns == pytest.approx(t_w + n * pe_ns(N), rel=1e-9)


def test_fp32_matmul_is_two_passes_and_the_floor_applies():
    assert costs.pe_ns({"op": "nc_matmul", "N": 512, "dtypes": {"moving": "float32"}, "shapes": {}}) == \
        pytest.approx(pe_ns(512, 2))
    assert costs.pe_ns({"op": "nc_matmul", "N": 1, "dtypes": {"moving": "bfloat16"}, "shapes": {}}) == C.PE_FLOOR_NS
    thr = costs.pe_ns({"op": "nc_matmul", "N": 512, "dtypes": {"moving": "bfloat16"}, "shapes": {}}, throttle=True)
    assert thr == pytest.approx(pe_ns(512) * C.PE_THROTTLE_FACTOR)


def test_in_proj_pe_busy_matches_the_column_model():
    p = costmodel.predict(mk.trace_in_proj())
    runs = (256, 256, 512, 512, 16)
    assert p.busy_ns["r0c0"]["PE"] == pytest.approx(16 * sum(pe_ns(r, 2) for r in runs), rel=1e-9)


def test_dve_formula_is_independent_of_partitions():
    for P in (1, 128):
        p = costmodel.predict(mk.trace_dve(P, 512))
        assert p.busy_ns["r0c0"]["DVE"] == pytest.approx(dve_ns(512), rel=1e-12)


def test_argmax_chunk_is_two_dve_scans_of_the_chunk():
    F = 15520
    p = costmodel.predict(mk.trace_argmax_chunk(F))
    assert p.busy_ns["r0c0"]["DVE"] == pytest.approx(dve_ns(8) + 2 * dve_ns(F), rel=1e-12)


# ---- dependencies across engines ---------------------------------------------------------------------------
def test_dependency_chain_across_engines_adds_up():
    F = 512
    p = costmodel.predict(mk.trace_engine_chain(F))
    x_b, w_b = 128 * 128 * 2, 128 * F * 2
    # both loads issue on the two DGEs at t=0 and share the pipe; the chain waits for the weight load
    t_w = C.DMA_ISSUE_NS + 2 * x_b / BW + (w_b - x_b) / BW + C.DMA_COMPLETION_NS
    chain = (pe_ns(F) + act_ns(F) + C.ACT_TABLE_LOAD_NS + dve_ns(F) + act_ns(F) + C.ACT_TABLE_LOAD_NS
             + dve_ns(F) + dma_ns(128 * F * 4))
    assert p.latency_ns == pytest.approx(t_w + chain, rel=1e-9)
    # the critical path covers the whole latency
    assert sum(ns for ns, *_ in p.critical) == pytest.approx(p.latency_ns, rel=1e-9)
    assert sum(p.critical_by_stage.values()) == pytest.approx(p.latency_ns, rel=1e-9)


def test_act_table_loads_on_group_switch():
    F = 256
    p = costmodel.predict(mk.trace_act_sequence(F))
    # exp exp silu exp rsqrt square copy sigmoid softplus tanh: loads at the first exp, silu, exp, rsqrt
    # (t0 also holds square and copy), sigmoid, softplus and tanh (own group) = 7
    n, t = p.act_table_loads["r0c0"]
    assert n == 7 and t == pytest.approx(7 * C.ACT_TABLE_LOAD_NS)
    assert p.busy_ns["r0c0"]["ACT"] == pytest.approx(len(mk.ACT_SEQUENCE) * act_ns(F) + 7 * C.ACT_TABLE_LOAD_NS)


def test_war_waits_for_the_reader_and_partitions_do_not_conflict():
    b = DependencyBuilder()
    tile = lambda p0, n, lo, hi: {"buf": 7, "mem": "sbuf", "part": [p0, n], "bytes": [lo, hi]}
    assert b.access(0, 0, 0, [], [tile(0, 128, 0, 1024)]) == set()       # write
    assert b.access(1, 1, 0, [tile(0, 128, 0, 512)], []) == {0}           # RAW
    assert b.access(2, 2, 0, [], [tile(0, 128, 256, 768)]) == {0, 1}      # WAW + WAR on the reader
    assert b.access(3, 3, 0, [tile(0, 128, 512, 1024)], []) == {0, 2}     # two writers of the range
    assert b.access(4, 4, 0, [], [tile(0, 1, 2048, 2050)]) == set()       # untouched bytes
    assert b.access(5, 5, 0, [], [tile(1, 1, 2048, 2050)]) == set()       # other partition: no WAW
    assert b.access(6, 6, 0, [tile(0, 2, 2048, 2050)], []) == {4, 5}      # read across both rows


def test_barrier_synchronises_the_lnc_pair():
    F = 1024
    p = costmodel.predict(mk.trace_barrier(F))
    small = dma_ns(128 * 4)
    # core 0: memset, multiply, store; barrier at max arrival + cost; core 1: load after the barrier
    expect = 2 * dve_ns(F) + small + C.CORE_BARRIER_NS + small
    assert p.latency_ns == pytest.approx(expect, rel=1e-9)


def test_sendrecv_rendezvous():
    p = costmodel.predict(mk.trace_sendrecv(P=32, F=64, dtype="float16"))
    assert p.latency_ns == pytest.approx(dve_ns(64) + C.SENDRECV_NS + 4096 / BW, rel=1e-9)


# ---- collectives ----------------------------------------------------------------------------------------
def test_all_reduce_8kb_under_nkisim_launch():
    p = costmodel.predict(mk.trace_all_reduce(T=2, H=2048, tp=4, lnc=2))
    assert len(p.cores) == 8
    ar = C.ALL_REDUCE_NS + 2 * 3 / 4 * 8192 / (C.COLLECTIVE_BW / 1e9)
    # every core: memset [2, 2048], the all-reduce with its lane peers on the other ranks, an 8 KB store.
    # The 8 stores (2 per rank) share their rank's pipe pairwise.
    store = C.DMA_ISSUE_NS + 2 * 8192 / BW + C.DMA_COMPLETION_NS
    assert p.latency_ns == pytest.approx(dve_ns(2048) + ar + store, rel=1e-9)
    assert p.critical[0][3] == "all_reduce" and p.critical[0][0] == pytest.approx(ar, rel=1e-9)


def _rec(inst, engine, op, reads=(), writes=(), rank=0, nbytes=None, **kw):
    r = {"rank": rank, "inst": inst, "engine": engine, "op": op, "loc": f"synthetic.py:{op}", "shapes": {},
         "dtypes": {}, "bytes": {}, "reads": list(reads), "writes": list(writes)}
    if nbytes is not None:
        r["bytes"] = {"sbuf": {"read": nbytes, "write": nbytes}}
    r.update(kw)
    return r


def test_all_reduce_8kb_costs_the_measured_latency():
    sb = lambda inst, buf: {"buf": buf, "mem": "sbuf", "inst": inst, "part": [0, 2], "bytes": [0, 4096]}
    recs = []
    for rank in range(4):
        for inst in range(2):
            buf = 10 + 2 * rank + inst
            recs.append(_rec(inst, "DVE", "tensor_scalar", writes=[sb(inst, buf)], rank=rank,
                             shapes={"dst": [2, 2048]}))
    for rank in range(4):
        for inst in range(2):
            buf = 10 + 2 * rank + inst
            recs.append(_rec(inst, "CC", "all_reduce", reads=[sb(inst, buf)], writes=[sb(inst, buf)], rank=rank,
                             nbytes=8192))
    p = costmodel.predict(recs)
    ar = C.ALL_REDUCE_NS + 2 * 3 / 4 * 8192 / (C.COLLECTIVE_BW / 1e9)
    assert costs.collective_ns("all_reduce", 8192, 4) == pytest.approx(ar)
    assert p.latency_ns == pytest.approx(dve_ns(2048) + ar, rel=1e-9)
    assert len(p.cores) == 8


def test_collective_waits_for_the_slowest_core():
    sb = lambda inst, lo: {"buf": 1 + inst, "mem": "sbuf", "inst": inst, "part": [0, 1], "bytes": [lo, lo + 8]}
    recs = [_rec(0, "DVE", "tensor_scalar", writes=[sb(0, 0)], shapes={"dst": [1, 4096]}),
            _rec(0, "CC", "all_gather", reads=[sb(0, 0)], writes=[sb(0, 8)], nbytes=8),
            _rec(1, "CC", "all_gather", reads=[sb(1, 0)], writes=[sb(1, 8)], nbytes=8)]
    p = costmodel.predict(recs)
    assert p.latency_ns == pytest.approx(dve_ns(4096) + costs.collective_ns("all_gather", 8), rel=1e-9)


# ---- stages ---------------------------------------------------------------------------------------------
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


def test_json_round_trip(tmp_path):
    tr = mk.trace_matmul_chain(n=2)
    path = tmp_path / "t.json"
    tr.to_json(str(path))
    assert costmodel.predict(str(path)).latency_ns == pytest.approx(costmodel.predict(tr).latency_ns)


# ---- composition and the bench command --------------------------------------------------------------------
def test_compose_layerwise_adds_launches_collectives_and_kernels(tiny_cfg):
    from harness.costmodel import compose
    fams = {}
    for c in compose.round_plan(tiny_cfg):
        fams[(c.family, c.T)] = compose.FamilyCost(c.family, c.T, 1000.0 * c.T, 1e6, "stand-in")
    est = compose.compose_layerwise(tiny_cfg, fams)
    plan = compose.round_plan(tiny_cfg)
    H = tiny_cfg.hidden_size
    expect = sum(c.count * (1000.0 * c.T + C.LAUNCH_OVERHEAD_NS
                            + (costs.collective_ns("all_reduce", c.T * H * 2) if c.reduce_after else 0.0))
                 for c in plan)
    expect += sum(costs.collective_ns("all_gather", 8) for c in plan if c.family == "lm_head")
    assert est.round_ns == pytest.approx(expect, rel=1e-12)
    assert sum(est.stage_ns.values()) == pytest.approx(est.round_ns, rel=1e-12)
    assert sum(est.part_ns.values()) == pytest.approx(est.round_ns, rel=1e-12)
    assert est.hbm_bytes_per_rank == pytest.approx(1e6 * sum(c.count for c in plan))
    assert est.tokens_per_s(0.5) == pytest.approx(1.5 / (est.round_ns * 1e-9))
    roof = compose.roofline_round(tiny_cfg, fams)
    assert roof.round_ns == pytest.approx(est.hbm_bytes_per_rank / C.HBM_BW_PER_RANK * 1e9)
    # the verify stage runs every trunk layer: one mixer per layer, rmsnorm twice per layer (+ final norm)
    v = {}
    for c in plan:
        if c.stage == "V":
            v[c.family] = v.get(c.family, 0) + c.count
    assert v.get("gdn", 0) + v.get("attention", 0) == tiny_cfg.num_hidden_layers
    assert v["moe"] == tiny_cfg.num_hidden_layers and v["rmsnorm"] == 2 * tiny_cfg.num_hidden_layers + 1


def test_bench_predict_on_a_saved_trace_and_calibrate(tmp_path, monkeypatch, capsys):
    from harness import bench
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    path = tmp_path / "chain.json"
    mk.trace_engine_chain(256).to_json(str(path))
    assert bench.main(["predict", "--trace", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "chain" in out and "critical path top" in out
    assert (tmp_path / "costmodel_timeline_chain.png").stat().st_size > 0
    assert bench.main(["calibrate"]) == 0
    md = (tmp_path / "costmodel_calibration.md").read_text()
    assert "ACT_TABLE_LOAD" in md and "13,331 ns" in md


def test_dynamic_offsets_wait_for_their_register_and_index_tile():
    """The trace names neither registers nor vector_offset index tiles: a scalar-offset DMA waits for the
    core's latest register write, a gather for the core's latest integer tile write (documented workaround)."""
    sb = lambda buf, lo, hi: {"arg": "dst", "buf": buf, "mem": "sbuf", "part": [0, 1], "bytes": [lo, hi]}
    hbm = lambda kind: {"arg": "src", "buf": 9, "mem": "shared_hbm", "indirect": kind, "bytes": [0, 1 << 20]}
    recs = [
        _rec(0, "DVE", "iota", writes=[sb(1, 0, 8)], shapes={"dst": [1, 2]}, dtypes={"dst": "int32"}),
        _rec(0, "SP", "register_load", reads=[{**sb(1, 0, 4), "arg": "src"}]),
        _rec(0, "DMA", "dma_copy", reads=[hbm("scalar")], writes=[sb(2, 0, 256)],
             bytes={"shared_hbm": {"read": 256, "write": 0}}),
        _rec(0, "DMA", "dma_copy", reads=[hbm("vector")], writes=[sb(3, 0, 256)],
             bytes={"shared_hbm": {"read": 256, "write": 0}}),
    ]
    p = costmodel.predict(recs)
    T = p.timeline
    assert T.start[2] == pytest.approx(T.finish[1])       # after the register load
    assert T.start[3] == pytest.approx(T.finish[0])       # after the index tile (int32) was written
    assert T.finish[1] == pytest.approx(dve_ns(2) + C.SP_INSTR_NS)
