"""Per-instruction costs: what one traced instruction costs on its engine (compute engines), or its
DMA / synchronisation parameters. Formulas only; every number comes from ``constants``."""
from __future__ import annotations

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


def pe_ns(rec, pinned: bool = False, throttle: bool = False) -> float:
    """TensorE: max(floor, passes x moving columns / (columns per cycle x clock)) (costs/derived PE).
    nc_matmul moves N columns (fp32 operands: 2 passes); a PE nc_transpose of data [P, F] moves its P
    columns (identity as the moving side, single pass)."""
    if rec["op"] == "nc_matmul":
        cols = rec.get("N") or free_elems({"shapes": {"m": rec["shapes"].get("moving", [1, 1])}})
        passes = C.PE_FP32_PASSES if rec.get("dtypes", {}).get("moving") == "float32" else 1
    else:
        cols = rec["shapes"].get("data", [1])[0]
        passes = 1
    rate = (C.PE_COLUMNS_PER_CYCLE_PINNED if pinned else C.PE_COLUMNS_PER_CYCLE) * C.PE_CLOCK_HZ
    t = max(C.PE_FLOOR_NS, passes * cols / rate * 1e9)
    return t * (C.PE_THROTTLE_FACTOR if throttle else 1.0)


def compute_ns(rec, pe_throttle: bool = False) -> float:
    """Duration of a compute-engine instruction (without ACT table loads)."""
    eng = rec["engine"]
    if eng == "PE":
        pinned = bool(rec.get("tile_position"))
        return pe_ns(rec, pinned=pinned, throttle=pe_throttle)
    if eng == "DVE":
        return C.DVE_FIXED_NS + C.DVE_NS_PER_ELEM * free_elems(rec)
    if eng == "ACT":
        return C.ACT_FIXED_NS + C.ACT_NS_PER_ELEM * free_elems(rec)
    if eng == "POOL":
        return C.POOL_FIXED_NS + C.POOL_NS_PER_ELEM * free_elems(rec)
    if eng == "SP":
        return C.SP_INSTR_NS
    raise ValueError(f"costmodel: no compute cost for engine {eng!r} (op {rec['op']} at {rec.get('loc')})")


def hbm_bytes(rec) -> tuple[int, int]:
    """(HBM bytes read, HBM bytes written) of an instruction, from the trace's per-memory byte counts."""
    r = w = 0
    for mem, d in rec.get("bytes", {}).items():
        if mem in HBM_MEMS:
            r += d.get("read", 0)
            w += d.get("write", 0)
    return r, w


def transfer_bytes(rec) -> int:
    """Bytes a DMA moves: its HBM traffic (read + write) if it touches HBM, else its SBUF bytes written."""
    r, w = hbm_bytes(rec)
    if r or w:
        return r + w
    return sum(d.get("write", 0) for d in rec.get("bytes", {}).values())


def dma_issue_ns(rec) -> float:
    indirect = any(reg.get("indirect") for reg in rec.get("reads", []) + rec.get("writes", []))
    return C.DMA_ISSUE_INDIRECT_NS if indirect else C.DMA_ISSUE_NS


def sync_ns(rec, n_ranks: int) -> float:
    """Cost of a synchronising instruction after its last participant arrived."""
    op = rec["op"]
    if op in BARRIER_OPS:
        return C.CORE_BARRIER_NS
    if op in SENDRECV_OPS:
        return C.SENDRECV_NS + transfer_bytes(rec) / C.HBM_BW_PER_RANK * 1e9
    if op in COLLECTIVE_OPS or rec.get("engine") == "CC":
        cc = rec.get("collective") or {}
        R = len(cc.get("rank_list") or ()) or n_ranks
        return collective_ns(op, collective_bytes(rec), R)
    raise ValueError(f"costmodel: {op} is not a synchronising op")


def collective_bytes(rec) -> int:
    """Bytes of a collective's local operand (the larger of what it reads and writes)."""
    cc = rec.get("collective")
    if cc is not None and ("bytes_in" in cc or "bytes_out" in cc):
        return max(cc.get("bytes_in", 0), cc.get("bytes_out", 0))
    rd = sum(d.get("read", 0) for d in rec.get("bytes", {}).values())
    wr = sum(d.get("write", 0) for d in rec.get("bytes", {}).values())
    return max(rd, wr)


def collective_ns(op: str, nbytes: int, n_ranks: int = C.TP_RANKS) -> float:
    """Measured fixed latency + algorithmic bytes over the collective bandwidth.
    all_reduce moves 2(R-1)/R of the operand, gathers/scatters (R-1)/R (standard ring/mesh volumes)."""
    R = max(n_ranks, 1)
    if op == "all_reduce":
        fixed, vol = C.ALL_REDUCE_NS, 2 * (R - 1) / R * nbytes
    else:
        fixed, vol = C.ALL_GATHER_NS, (R - 1) / R * nbytes
    return fixed + vol / C.COLLECTIVE_BW * 1e9
