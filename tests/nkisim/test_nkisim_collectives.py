"""nkisim.launch (TP x LNC worlds) and nki.collectives: numerics vs numpy, determinism, replica groups,
stuck/mismatched collectives, refusals, trace records."""
import time

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim.collectives import ReplicaGroup

F32 = np.float32
BF16 = ml_dtypes.bfloat16
ALL4 = ReplicaGroup([[0, 1, 2, 3]])


def fold(arrays, fn=np.add):
    """Reference reduction: fp32, ascending rank order (nkisim's documented fixed order)."""
    acc = arrays[0].astype(F32)
    for a in arrays[1:]:
        acc = fn(acc, a.astype(F32)).astype(F32)
    return acc


# ---- kernels ---------------------------------------------------------------------------------
@nki.jit
def hbm_collective(x, rg, kind, n):
    """x -> named shared-HBM src -> collective -> named dst -> output."""
    R, C = x.shape
    out_rows = {"all_reduce": R, "all_gather": R * n, "reduce_scatter": R // n, "all_to_all": R}[kind]
    src = nl.ndarray((R, C), x.dtype, buffer=nl.shared_hbm, name="cc_src")
    dst = nl.ndarray((out_rows, C), x.dtype, buffer=nl.shared_hbm, name="cc_dst")
    out = nl.ndarray((out_rows, C), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=src, src=x)
    if kind == "all_reduce":
        ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=rg, op=nl.add)
    elif kind == "all_gather":
        ncc.all_gather(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    elif kind == "reduce_scatter":
        ncc.reduce_scatter(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0, op=nl.add)
    else:
        ncc.all_to_all(srcs=[src], dsts=[dst], replica_group=rg, collective_dim=0)
    nisa.dma_copy(dst=out, src=dst)
    return out


@nki.jit
def sbuf_collective(x, rg, kind, n, dim):
    """Each LNC core takes its own half of the rows into SBUF and runs the collective on it."""
    R, C = x.shape
    pid, nprog = nl.program_id(0), nl.num_programs(0)
    h = R // nprog
    t = nl.ndarray((h, C), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * h:(pid + 1) * h, :])
    if kind == "all_reduce":
        o = nl.ndarray((h, C), x.dtype, buffer=nl.sbuf)
        ncc.all_reduce(srcs=[t], dsts=[o], replica_group=rg, op=nl.maximum)
        out = nl.ndarray((R, C), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid * h:(pid + 1) * h, :], src=o)
    elif kind == "all_gather":
        shape = (h * n, C) if dim == 0 else (h, C * n)
        o = nl.ndarray(shape, x.dtype, buffer=nl.sbuf)
        ncc.all_gather(srcs=[t], dsts=[o], replica_group=rg, collective_dim=dim)
        out = nl.ndarray((nprog,) + shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid], src=o)
    else:
        o = nl.ndarray((h // n, C), x.dtype, buffer=nl.sbuf)
        ncc.reduce_scatter(srcs=[t], dsts=[o], replica_group=rg, collective_dim=0, op=nl.add)
        out = nl.ndarray((nprog, h // n, C), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[pid], src=o)
    return out


def per_rank(xs, *rest):
    return [(x,) + rest for x in xs]


# ---- numerics --------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_hbm_all_reduce_tp4_lnc2_equals_numpy_sum(rng, dtype):
    xs = [rng.standard_normal((8, 16)).astype(dtype) for _ in range(4)]
    outs = nkisim.launch(hbm_collective, per_rank(xs, ALL4, "all_reduce", 4), tp=4, lnc=2)
    want = fold(xs).astype(dtype)
    for o in outs:
        assert o.dtype == dtype
        np.testing.assert_array_equal(o.view(np.uint8), want.view(np.uint8))


def test_hbm_all_gather_reduce_scatter_all_to_all(rng):
    xs = [rng.standard_normal((8, 6)).astype(F32) for _ in range(4)]
    ag = nkisim.launch(hbm_collective, per_rank(xs, ALL4, "all_gather", 4), tp=4, lnc=2)
    for o in ag:
        np.testing.assert_array_equal(o, np.concatenate(xs, axis=0))
    rs = nkisim.launch(hbm_collective, per_rank(xs, ALL4, "reduce_scatter", 4), tp=4, lnc=2)
    total = fold(xs)
    for r, o in enumerate(rs):
        np.testing.assert_array_equal(o, total[2 * r:2 * r + 2])
    a2a = nkisim.launch(hbm_collective, per_rank(xs, ALL4, "all_to_all", 4), tp=4, lnc=2)
    for r, o in enumerate(a2a):
        np.testing.assert_array_equal(o, np.concatenate([xs[s][2 * r:2 * r + 2] for s in range(4)], axis=0))


def test_sbuf_collectives_per_core_lanes(rng):
    """Under LNC=2 every core runs the collective on its own SBUF half, meeting the same core of the other ranks."""
    xs = [rng.standard_normal((64, 32)).astype(F32) for _ in range(4)]
    mx = nkisim.launch(sbuf_collective, per_rank(xs, ALL4, "all_reduce", 4, 0), tp=4, lnc=2)
    for o in mx:
        np.testing.assert_array_equal(o, np.maximum.reduce(xs))
    for dim in (0, 1):
        ag = nkisim.launch(sbuf_collective, per_rank(xs, ALL4, "all_gather", 4, dim), tp=4, lnc=2)
        for o in ag:
            for core in range(2):
                np.testing.assert_array_equal(o[core], np.concatenate([x[32 * core:32 * core + 32] for x in xs], axis=dim))
    rs = nkisim.launch(sbuf_collective, per_rank(xs, ALL4, "reduce_scatter", 4, 0), tp=4, lnc=2)
    total = fold(xs)
    for r, o in enumerate(rs):
        for core in range(2):
            np.testing.assert_array_equal(o[core], total[32 * core + 8 * r:32 * core + 8 * r + 8])


def test_bit_identical_across_runs(rng):
    xs = [(rng.standard_normal((32, 64)) * 10 ** rng.uniform(-3, 3, (32, 64))).astype(BF16) for _ in range(4)]
    runs = [nkisim.launch(hbm_collective, per_rank(xs, ALL4, "all_reduce", 4), tp=4, lnc=2) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert a.tobytes() == b.tobytes()
    for o in runs[0][1:]:
        assert o.tobytes() == runs[0][0].tobytes()        # every rank holds the same bits


@pytest.mark.parametrize("groups", [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[3, 1, 0, 2]], [[0], [1], [2], [3]]])
def test_replica_groups(rng, groups):
    xs = [rng.standard_normal((4, 8)).astype(F32) for _ in range(4)]
    rg = ReplicaGroup(groups)
    red = nkisim.launch(hbm_collective, per_rank(xs, rg, "all_reduce", 4), tp=4, lnc=1)
    n = len(groups[0])
    gat = nkisim.launch(hbm_collective, per_rank(xs, rg, "all_gather", n), tp=4, lnc=2)
    for g in groups:
        want_sum = fold([xs[r] for r in sorted(g)])
        want_cat = np.concatenate([xs[r] for r in g], axis=0)       # rank-list order
        for r in g:
            np.testing.assert_array_equal(red[r], want_sum)
            np.testing.assert_array_equal(gat[r], want_cat)


@nki.jit
def tp_reduce_then_lnc_gather(x, rg):
    """MK pattern: each core all-reduces its free block over the TP ranks, then the two cores of a rank
    exchange blocks with sendrecv (intra-rank communication is sendrecv, not a replica group)."""
    P, F = x.shape
    pid = nl.program_id(0)
    half = F // 2
    blk = nl.ndarray((P, half), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=blk, src=x[:, pid * half:(pid + 1) * half])
    red = nl.ndarray((P, half), x.dtype, buffer=nl.sbuf)
    ncc.all_reduce(srcs=[blk], dsts=[red], replica_group=rg, op=nl.add)
    full = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.tensor_copy(dst=full[:, pid * half:(pid + 1) * half], src=red)
    other = nl.ndarray((P, half), x.dtype, buffer=nl.sbuf)
    nisa.sendrecv(src=red, dst=other, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
    nisa.tensor_copy(dst=full[:, (1 - pid) * half:(2 - pid) * half], src=other)
    out = nl.ndarray((2, P, F), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[pid], src=full)
    return out


def test_tp_all_reduce_plus_intra_rank_sendrecv(rng):
    xs = [rng.standard_normal((32, 64)).astype(F32) for _ in range(4)]
    outs = nkisim.launch(tp_reduce_then_lnc_gather, per_rank(xs, ALL4), tp=4, lnc=2)
    for o in outs:
        np.testing.assert_array_equal(o[0], fold(xs))
        np.testing.assert_array_equal(o[1], fold(xs))


@pytest.mark.parametrize("tp,lnc", [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_small_worlds(rng, tp, lnc):
    xs = [rng.standard_normal((4, 8)).astype(F32) for _ in range(tp)]
    rg = ReplicaGroup([list(range(tp))])
    outs = nkisim.launch(hbm_collective, per_rank(xs, rg, "all_reduce", tp), tp=tp, lnc=lnc)
    assert len(outs) == tp
    for o in outs:
        np.testing.assert_array_equal(o, fold(xs))


def test_ranks_have_separate_hbm_and_inplace_writeback(rng):
    @nki.jit
    def bump(cache, rg):
        t = nl.ndarray(cache.shape, cache.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=cache)
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=cache, src=t)
        return cache
    caches = [np.full((2, 4), r, F32) for r in range(4)]
    nkisim.launch(bump, per_rank(caches, ALL4), tp=4, lnc=1)
    for r, c in enumerate(caches):
        np.testing.assert_array_equal(c, np.full((2, 4), r + 1, F32))


# ---- permute / ring / rank ids / all_gather_v -------------------------------------------------
@nki.jit
def permute_kernel(x, pairs):
    src = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="p_src")
    dst = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="p_dst")
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=src, src=x)
    nisa.dma_copy(dst=dst, src=x)          # untargeted ranks keep their own data
    ncc.collective_permute(srcs=[src], dsts=[dst], source_target_pairs=pairs)
    nisa.dma_copy(dst=out, src=dst)
    return out


def test_collective_permute(rng):
    xs = [rng.standard_normal((2, 4)).astype(F32) for _ in range(4)]
    pairs = ((0, 1), (1, 0), (2, 3))
    outs = nkisim.launch(permute_kernel, per_rank(xs, pairs), tp=4, lnc=1)
    for r, want in enumerate([xs[1], xs[0], xs[2], xs[2]]):
        np.testing.assert_array_equal(outs[r], want)


@nki.jit
def ring_kernel(x, rg, n):
    """n-1 ring steps accumulate everyone's x (an all-reduce built from collective_permute_implicit_reduce),
    plus the processing rank ids of each step."""
    P, F = x.shape
    acc = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=acc, src=x)
    mine = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=mine, src=x)
    ids = nl.ndarray((1, n), nl.int32, buffer=nl.sbuf)
    for it in range(n):
        reg = ncc.collective_permute_implicit_current_processing_rank_id(iteration_id=it, replica_group=rg)
        nisa.register_store(ids[0:1, it:it + 1], reg)
    recv = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    ncc.collective_permute_implicit(srcs_by_channel=[[mine]], dsts_by_channel=[[recv]], replica_group=rg)
    out = nl.ndarray((P, F), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=recv)
    red = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    ncc.collective_permute_implicit_reduce(srcs0_by_channel=[[mine]], srcs1_by_channel=[[acc]],
                                           dsts_by_channel=[[red]], replica_group=rg, op=nl.add)
    out2 = nl.ndarray((P, F), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out2, src=red)
    idx = nl.ndarray((1, n), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=idx, src=ids)
    rid = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.register_store(rid, ncc.rank_id())
    rid_out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=rid_out, src=rid)
    return out, out2, idx, rid_out


def test_ring_permute_and_rank_ids(rng):
    xs = [rng.standard_normal((4, 8)).astype(F32) for _ in range(4)]
    order = [2, 0, 3, 1]
    outs = nkisim.launch(ring_kernel, per_rank(xs, ReplicaGroup([order]), 4), tp=4, lnc=2)
    for r, (recv, red, idx, rid) in enumerate(outs):
        pos = order.index(r)
        pred = order[(pos - 1) % 4]
        np.testing.assert_array_equal(recv, xs[pred])
        np.testing.assert_array_equal(red, xs[pred] * 2)
        assert idx[0].tolist() == [order[(pos - i) % 4] for i in range(4)]
        assert rid[0, 0] == r


@nki.jit
def agv_kernel(x, meta_in, rg):
    src = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="v_src")
    dst = nl.ndarray((4 * x.shape[0],), x.dtype, buffer=nl.shared_hbm, name="v_dst")
    meta = nl.ndarray(meta_in.shape, meta_in.dtype, buffer=nl.shared_hbm, name="v_meta")
    nisa.dma_copy(dst=src, src=x)
    nisa.dma_copy(dst=meta, src=meta_in)
    z = nl.ndarray((1, 4 * x.shape[0]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=z, value=0.0)
    nisa.dma_copy(dst=dst, src=z)
    ncc.all_gather_v(srcs=[src], dsts=[dst], replica_group=rg, metadata_tensor=meta)
    out = nl.ndarray(dst.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst)
    meta_out = nl.ndarray(meta_in.shape, meta_in.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=meta_out, src=meta)
    return out, meta_out


def test_all_gather_v(rng):
    xs = [rng.standard_normal(8).astype(F32) for _ in range(4)]
    counts = [3, 8, 0, 5]
    metas = [np.array([[c] * 4, [8 - c] * 4, [0] * 4], np.uint32) for c in counts]
    outs = nkisim.launch(agv_kernel, [(x, m, ALL4) for x, m in zip(xs, metas)], tp=4, lnc=2)
    for out, meta in outs:
        want = np.zeros(32, F32)
        for s, c in enumerate(counts):
            want[8 * s:8 * s + c] = xs[s][8 - c:]
        np.testing.assert_array_equal(out, want)
        assert meta[2].tolist() == counts


# ---- stuck / mismatched collectives -----------------------------------------------------------
@nki.jit
def maybe_skip(x, rg, skip, sleep):
    src = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="s_src")
    dst = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="s_dst")
    nisa.dma_copy(dst=src, src=x)
    if sleep:
        time.sleep(sleep)          # host-side stall standing in for a rank that never gets there
    if skip == "finish":
        return src
    if skip == "gather":
        ncc.all_gather(srcs=[src], dsts=[dst], replica_group=ReplicaGroup([[0], [1]]), collective_dim=0)
    ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=rg, op=nl.add)
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=dst)
    return out


def test_collective_with_missing_rank_fails_naming_it():
    x = np.ones((2, 2), F32)
    args = [(x, ALL4, None, 0)] * 3 + [(x, ALL4, "finish", 0)]
    t0 = time.monotonic()
    with pytest.raises(nkisim.NkiValidationError) as e:
        nkisim.launch(maybe_skip, args, tp=4, lnc=2)
    msg = str(e.value)
    assert time.monotonic() - t0 < 5
    assert "deadlock" in msg and "all_reduce" in msg and "rank 3 core 0 (finished" in msg
    assert "rank list [0, 1, 2, 3]" in msg


def test_stuck_rank_times_out_with_message():
    x = np.ones((2, 2), F32)
    args = [(x, ALL4, None, 0)] * 3 + [(x, ALL4, None, 1.5)]
    t0 = time.monotonic()
    with pytest.raises(nkisim.runtime.LaunchTimeout) as e:
        nkisim.launch(maybe_skip, args, tp=4, lnc=1, timeout=0.3)
    assert time.monotonic() - t0 < 1.5
    msg = str(e.value)
    assert "timeout=0.3" in msg and "rank 3 core 0 running at test_nkisim_collectives.py" in msg
    assert "ncc.all_reduce call #1 on rank list [0, 1, 2, 3] (core 0) waits for rank 3 core 0" in msg


def test_mismatched_collectives_fail():
    x = np.ones((2, 2), F32)
    args = [(x, ReplicaGroup([[0], [1]]), None, 0), (x, ReplicaGroup([[0], [1]]), "gather", 0)]
    nkisim.launch(maybe_skip, args, tp=2, lnc=1)          # different calls on *different* rank lists: fine
    args = [(x, ReplicaGroup([[0, 1]]), None, 0), (x, ReplicaGroup([[0, 1]]), "finish", 0)]
    with pytest.raises(nkisim.NkiValidationError, match="rank 1 core 0 \\(finished"):
        nkisim.launch(maybe_skip, args, tp=2, lnc=1)

    @nki.jit
    def k(x, kind):
        src = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="m_src")
        dst = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="m_dst")
        nisa.dma_copy(dst=src, src=x)
        op = nl.add if kind == 0 else nl.maximum
        ncc.all_reduce(srcs=[src], dsts=[dst], replica_group=ReplicaGroup([[0, 1]]), op=op)
        return x
    with pytest.raises(nkisim.NkiValidationError, match="does not match what rank 0 issued"):
        nkisim.launch(k, [(x, 0), (x, 1)], tp=2, lnc=1)


# ---- refusals --------------------------------------------------------------------------------
def _refuse(body, match, tp=2, lnc=1, shape=(4, 8)):
    @nki.jit
    def k(x):
        body(x)
        return x
    with pytest.raises(nkisim.NkiValidationError, match=match):
        nkisim.launch(k, [(np.ones(shape, F32),)] * tp, tp=tp, lnc=lnc)


def _hbm(x, name="h", shape=None):
    t = nl.ndarray(shape or x.shape, x.dtype, buffer=nl.shared_hbm, name=name)
    return t


def _sb(x, shape=None):
    t = nl.ndarray(shape or x.shape, x.dtype, buffer=nl.sbuf)
    return t


RG2 = ReplicaGroup([[0, 1]])


def test_refusals():
    def arg_src(x):
        ncc.all_reduce(srcs=[x], dsts=[_hbm(x)], replica_group=RG2, op=nl.add)
    _refuse(arg_src, "kernel argument; collective instructions cannot read/write kernel I/O")

    def unnamed(x):
        ncc.all_reduce(srcs=[nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)], dsts=[_hbm(x)],
                       replica_group=RG2, op=nl.add)
    _refuse(unnamed, "without name=.*NCC_IBIR440")

    def mixed(x):
        ncc.all_reduce(srcs=[_sb(x)], dsts=[_hbm(x)], replica_group=RG2, op=nl.add)
    _refuse(mixed, "mix HBM and SBUF")

    def psum(x):
        ncc.all_reduce(srcs=[nl.ndarray(x.shape, x.dtype, buffer=nl.psum)], dsts=[_sb(x)], replica_group=RG2, op=nl.add)
    _refuse(psum, "is in psum")

    def not_dense(x):
        big = _sb(x, (4, 16))
        nisa.memset(dst=big, value=0.0)
        ncc.all_reduce(srcs=[big[:, 0:8]], dsts=[_sb(x)], replica_group=RG2, op=nl.add)
    _refuse(not_dense, "not densely packed")

    def coalesced_sbuf(x):
        a, b = _sb(x), _sb(x)
        ncc.all_reduce(srcs=[a, b], dsts=[_sb(x), _sb(x)], replica_group=RG2, op=nl.add)
    _refuse(coalesced_sbuf, "coalesced collectives .* only supported on HBM")

    def bad_op(x):
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=RG2, op=nl.multiply)
    _refuse(bad_op, "op must be nl.add, nl.minimum or nl.maximum")

    def hbm_dim1(x):
        ncc.all_gather(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b", (4, 16))], replica_group=RG2, collective_dim=1)
    _refuse(hbm_dim1, "collective_dim=1 is not supported for HBM")

    def bad_gather_shape(x):
        ncc.all_gather(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=RG2, collective_dim=0)
    _refuse(bad_gather_shape, r"dsts\[0\] is \[4, 8\], expected \[8, 8\]")

    def sbuf_a2a(x):
        ncc.all_to_all(srcs=[_sb(x)], dsts=[_sb(x)], replica_group=RG2, collective_dim=0)
    _refuse(sbuf_a2a, "must reside on HBM")

    def prio(x):
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=RG2, op=nl.add, priority=0)
    _refuse(prio, "priority= .* NeuronCore-v4")

    def overlap(x):
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=ReplicaGroup([[0, 1], [1]]), op=nl.add)
    _refuse(overlap, "must not overlap")

    def out_of_range(x):
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=ReplicaGroup([[0, 1, 2]]), op=nl.add)
    _refuse(out_of_range, "names rank 2, but the launch has ranks 0..1")

    def dtype_mismatch(x):
        d = nl.ndarray(x.shape, nl.bfloat16, buffer=nl.shared_hbm, name="b")
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[d], replica_group=RG2, op=nl.add)
    _refuse(dtype_mismatch, "dtypes must match")

    def a2av(x):
        ncc.all_to_all_v(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=RG2, metadata_tensor=None)
    _refuse(a2av, "inter-node replica groups")

    def unwritten(x):
        ncc.all_reduce(srcs=[_hbm(x, "a")], dsts=[_hbm(x, "b")], replica_group=RG2, op=nl.add)
    _refuse(unwritten, "never-written")

    def three_channels_subset(x):
        t = [[_sb(x)] for _ in range(3)]
        ncc.collective_permute_implicit(srcs_by_channel=t, dsts_by_channel=t, replica_group=ReplicaGroup([[0, 1]]),
                                        channel_ids=[0, 1, 2])
    _refuse(three_channels_subset, "at most 2 for rank list", tp=4)


def test_collective_needs_multi_rank_launch():
    @nki.jit
    def k(x):
        s = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="a")
        ncc.all_reduce(srcs=[s], dsts=[s], replica_group=ReplicaGroup([[0]]), op=nl.add)
        return x
    with pytest.raises(nkisim.NkiValidationError, match="nkisim.launch"):
        k[2](np.ones((2, 2), F32))


def test_collective_operand_cannot_be_output():
    @nki.jit
    def k(x):
        s = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="a")
        d = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm, name="b")
        nisa.dma_copy(dst=s, src=x)
        ncc.all_reduce(srcs=[s], dsts=[d], replica_group=RG2, op=nl.add)
        return d
    with pytest.raises(nkisim.NkiValidationError, match="operand of a collective"):
        nkisim.launch(k, [(np.ones((2, 2), F32),)] * 2, tp=2, lnc=1)


def test_launch_argument_checks():
    x = np.ones((2, 2), F32)
    with pytest.raises(nkisim.NkiValidationError, match="one trn2 chip has 8"):
        nkisim.launch(hbm_collective, [(x,)] * 8, tp=8, lnc=2)
    with pytest.raises(ValueError, match="one per rank"):
        nkisim.launch(hbm_collective, [(x,)] * 3, tp=4)
    with pytest.raises(nkisim.NkiValidationError, match="lnc must be one of"):
        nkisim.launch(hbm_collective, [(x,)], lnc=4)


# ---- trace / shape-only ----------------------------------------------------------------------
def test_trace_records_collectives(rng):
    xs = [rng.standard_normal((8, 16)).astype(F32) for _ in range(4)]
    with nkisim.trace.capture() as tr:
        nkisim.launch(hbm_collective, per_rank(xs, ALL4, "all_gather", 4), tp=4, lnc=2)
    cc = [r for r in tr.instructions if r["engine"] == "CC"]
    assert len(cc) == 8
    assert {(r["rank"], r["inst"]) for r in cc} == {(r, c) for r in range(4) for c in range(2)}
    by_core = {}
    for r in cc:
        c = r["collective"]
        assert c["kind"] == "all_gather" and c["rank_list"] == [0, 1, 2, 3] and c["mem"] == "hbm"
        assert c["bytes_in"] == 8 * 16 * 4 and c["bytes_out"] == 4 * 8 * 16 * 4
        assert c["participants"] == [[k, c["core"]] for k in range(4)]
        by_core.setdefault(c["core"], set()).add(c["id"])
    assert all(len(ids) == 1 for ids in by_core.values()) and by_core[0] != by_core[1]
    L = tr.launches[-1]
    assert {k: L[k] for k in ("kernel", "tp", "lnc", "shape_only")} == {"kernel": "hbm_collective", "tp": 4, "lnc": 2,
                                                                         "shape_only": False}
    assert [(m["rank"], m["inst"]) for m in L["memory"]] == [(r, c) for r in range(4) for c in range(2)]
    assert all(m["shared_hbm_peak_bytes"] >= 3 * 8 * 16 * 4 for m in L["memory"])


def test_shape_only_multi_rank_trace_equals_execution(rng):
    xs = [rng.standard_normal((64, 32)).astype(F32) for _ in range(4)]
    with nkisim.trace.capture() as t_exec:
        nkisim.launch(sbuf_collective, per_rank(xs, ALL4, "reduce_scatter", 4, 0), tp=4, lnc=2)
    shapes = [nkisim.ShapeDtype(x.shape, x.dtype) for x in xs]
    with nkisim.trace.capture() as t_shape:
        outs = nkisim.launch(sbuf_collective, per_rank(shapes, ALL4, "reduce_scatter", 4, 0), tp=4, lnc=2)
    assert t_exec.comparable() == t_shape.comparable()
    assert outs[0] == nkisim.ShapeDtype((2, 8, 32), "float32")
