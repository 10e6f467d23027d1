"""Per-instruction costs: what one traced instruction costs on its engine (compute engines), or its DMA /
synchronisation parameters, at one end of the bands (:class:`Params`). Formulas only; every number comes from
``constants``."""
from __future__ import annotations

from dataclasses import dataclass

from . import constants as C

COMPUTE_ENGINES = ("PE", "ACT", "DVE", "POOL", "SP")
# nki.collectives operations (ref §5.10); any of them in a trace is a cross-rank rendezvous.
COLLECTIVE_OPS = frozenset({
    "all_reduce", "all_gather", "all_gather_v", "reduce_scatter", "all_to_all", "all_to_all_v",
    "collective_permute", "collective_permute_implicit", "collective_permute_implicit_reduce",
})
BARRIER_OPS = frozenset({"core_barrier"})
SENDRECV_OPS = frozenset({"sendrecv"})
HBM_MEMS = ("shared_hbm", "private_hbm", "hbm")


@dataclass(frozen=True)
class Params:
    """The value of every band at one end (``Params.at("central")``); overrides for experiments:
    ``Params.at("central", handoff_ns=0.0)``."""
    end: str
    pe_floor_ns: float
    pe_throttle: float
    handoff_ns: float
    handoff_dma_ns: float
    dma_descriptor_overhead_bytes: float
    hbm_bw_per_rank: float
    dma_trigger_queue: str
    loop_fences: str
    all_reduce_ns: float
    cc_trigger_ns: float
    all_gather_ns: float

    @classmethod
    def at(cls, end="central", **overrides):
        if end not in C.ENDS:
            raise ValueError(f"costmodel: end must be one of {C.ENDS}, got {end!r}")
        vals = {b.name: b.at(end) for b in C.BANDS}
        unknown = set(overrides) - set(vals)
        if unknown:
            raise TypeError(f"costmodel: no band named {sorted(unknown)}; bands: {sorted(vals)}")
        vals.update(overrides)
        return cls(end=end, **vals)


def free_elems(rec) -> int:
    """Largest number of elements per partition over the instruction's on-chip operands (the free size
    an engine streams; for a reduction that is its input)."""
    best = 0
    for name, shape in rec.get("shapes", {}).items():
        n = 1
        for s in shape[1:]:
            n *= s
        best = max(best, n)
    return best


def act_group(func: str | None) -> str | None:
    """Activation-table group of an ACT function (None: the instruction needs no table)."""
    if func is None:
        return None
    return C.ACT_TABLE_GROUPS.get(func, "own:" + func)


def pe_stream_ns(rec, pinned: bool = False) -> float:
    """TensorE streaming time without the floor: passes x moving columns / (columns per cycle x clock)
    (costs/derived PE). nc_matmul moves N columns (fp32 operands: 2 passes); a PE nc_transpose of data [P, F]
    moves its P columns (identity as the moving side, single pass)."""
    if rec["op"] == "nc_matmul":
        cols = rec.get("N") or free_elems({"shapes": {"m": rec["shapes"].get("moving", [1, 1])}})
        passes = C.PE_FP32_PASSES if rec.get("dtypes", {}).get("moving") == "float32" else 1
    else:
        cols = rec["shapes"].get("data", [1])[0]
        passes = 1
    rate = (C.PE_COLUMNS_PER_CYCLE_PINNED if pinned else C.PE_COLUMNS_PER_CYCLE) * C.PE_CLOCK_HZ
    return passes * cols / rate * 1e9


def pe_ns(rec, params: Params, pinned: bool = False) -> float:
    """TensorE: max(floor, streaming time) x throttle."""
    return max(params.pe_floor_ns, pe_stream_ns(rec, pinned)) * params.pe_throttle


def fixed_compute_ns(rec) -> float:
    """Duration of a non-PE compute instruction (no band enters; ACT table loads not included)."""
    eng = rec["engine"]
    if eng == "DVE":
        per = C.DVE_NS_PER_ELEM * (C.DVE_RECIPROCAL_FACTOR if rec["op"] == "reciprocal" else 1)
        return C.DVE_FIXED_NS + per * free_elems(rec)
    if eng == "ACT":
        return C.ACT_FIXED_NS + C.ACT_NS_PER_ELEM * free_elems(rec)
    if eng == "POOL":
        return C.POOL_FIXED_NS + C.POOL_NS_PER_ELEM * free_elems(rec)
    if eng == "SP":
        return C.SP_INSTR_NS
    raise ValueError(f"costmodel: no compute cost for engine {eng!r} (op {rec['op']} at {rec.get('loc')})")


def compute_ns(rec, params: Params) -> float:
    """Duration of a compute-engine instruction (without ACT table loads)."""
    if rec["engine"] == "PE":
        return pe_ns(rec, params, pinned=bool(rec.get("tile_position")))
    return fixed_compute_ns(rec)


def hbm_bytes(rec) -> tuple[int, int]:
    """(HBM bytes read, HBM bytes written) of an instruction, from the trace's per-memory byte counts."""
    r = w = 0
    for mem, d in rec.get("bytes", {}).items():
        if mem in HBM_MEMS:
            r += d.get("read", 0)
            w += d.get("write", 0)
    return r, w


def payload_bytes(rec) -> int:
    """Bytes a DMA moves (what it writes; a DMA with no traced write: what it reads)."""
    w = sum(d.get("write", 0) for d in rec.get("bytes", {}).values())
    if w:
        return w
    return sum(d.get("read", 0) for k, d in rec.get("bytes", {}).items() if k != "const")


def dma_partitions(rec) -> int:
    """Partitions a DMA spreads over the engines: dim 0 of its on-chip side (of dst when both are), else of dst."""
    for reg in (*rec.get("writes", ()), *rec.get("reads", ())):
        if "part" in reg:
            return max(1, reg["part"][1])
    shp = rec.get("shapes", {}).get("dst") or [1]
    return max(1, shp[0])


def dma_run_bytes(rec) -> int:
    """Contiguous bytes one descriptor moves: nkisim's ``run_bytes`` (traced since issue 13), else the bytes per
    partition of the transfer."""
    nb = payload_bytes(rec)
    per = nb / dma_partitions(rec) if nb else 0
    run = rec.get("run_bytes")
    if run is None:
        return max(1, int(per))
    return max(1, min(run, int(per) or run))


def dma_engines(rec) -> int:
    return min(C.DMA_ENGINES_PER_CORE, dma_partitions(rec))


def dma_inflation(rec, params: Params) -> float:
    """Engine bytes per payload byte: 1 + descriptor overhead / run (the size-efficiency of the transfer)."""
    return 1.0 + params.dma_descriptor_overhead_bytes / dma_run_bytes(rec)


def dma_issue_ns(rec) -> float:
    return C.DMA_ISSUE_INDIRECT_NS if is_indirect_vector(rec) else C.DMA_ISSUE_NS


def is_indirect_vector(rec) -> bool:
    return any(reg.get("indirect") == "vector" for reg in rec.get("reads", []) + rec.get("writes", []))


def dma_trigger(rec, params: Params) -> str:
    """The instruction queue that triggers the DMA: POOL for software DGE (a vector-offset gather/scatter, or
    dge_mode=swdge: descriptors written by GpSimd, costs/measured "DMA_DIRECT2D ~650 ns / DMA_INDIRECT ~1.0 µs
    each" on GpSimd); the ``engine=`` the kernel gave (sync -> SP, scalar -> ACT); else the band's queue
    ("none": no queue)."""
    if rec.get("dge_mode") == "swdge" or is_indirect_vector(rec):
        return "POOL"
    eng = rec.get("trigger")
    if eng == "sync":
        return "SP"
    if eng == "scalar":
        return "ACT"
    return params.dma_trigger_queue


def sync_ns(rec, n_ranks: int, params: Params) -> float:
    """Cost of a synchronising instruction after its last participant arrived."""
    op = rec["op"]
    if op in BARRIER_OPS:
        return C.CORE_BARRIER_NS
    if op in SENDRECV_OPS:
        return C.SENDRECV_NS + payload_bytes(rec) / params.hbm_bw_per_rank * 1e9
    if op in COLLECTIVE_OPS or rec.get("engine") == "CC":
        cc = rec.get("collective") or {}
        R = len(cc.get("rank_list") or ()) or n_ranks
        return collective_ns(op, collective_bytes(rec), R, params)
    raise ValueError(f"costmodel: {op} is not a synchronising op")


def collective_bytes(rec) -> int:
    """Bytes of a collective's local operand (the larger of what it reads and writes)."""
    cc = rec.get("collective")
    if cc is not None and ("bytes_in" in cc or "bytes_out" in cc):
        return max(cc.get("bytes_in", 0), cc.get("bytes_out", 0))
    rd = sum(d.get("read", 0) for d in rec.get("bytes", {}).values())
    wr = sum(d.get("write", 0) for d in rec.get("bytes", {}).values())
    return max(rd, wr)


def collective_ns(op: str, nbytes: int, n_ranks: int = C.TP_RANKS, params: Params | None = None) -> float:
    """Trigger delay + measured fixed latency + algorithmic bytes over the collective bandwidth.
    all_reduce moves 2(R-1)/R of the operand, gathers/scatters (R-1)/R (standard ring/mesh volumes)."""
    params = params or Params.at("central")
    R = max(n_ranks, 1)
    if op == "all_reduce":
        fixed, vol = params.all_reduce_ns, 2 * (R - 1) / R * nbytes
    else:
        fixed, vol = params.all_gather_ns, (R - 1) / R * nbytes
    return params.cc_trigger_ns + fixed + vol / params.hbm_bw_per_rank * 1e9
