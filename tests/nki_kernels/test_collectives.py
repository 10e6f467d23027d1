"""SBUF collectives (nki_kernels/collectives.py) across TP x LNC instances under ``nkisim.launch``.

Exactness: sums are checked BIT-FOR-BIT against numpy folded in the documented fixed order (each lane
over ranks ascending in fp32, then lane0 + lane1), against float64 sums to 1e-6 relative, and run to
run; gathers move bits; the argmax combine is exact (comparisons and integer-valued fp32 indices)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from compare import assert_close
from model.config import preset
from model.params import random_params
from model.tp import embed_head as eh
from nki_kernels import collectives as cc
from nki_kernels import embedding as emb
from nki_kernels import lm_head as lm
from nki_kernels.host import feature_major

F32 = np.float32
WORLDS = [(4, 2), (4, 1), (2, 2), (1, 2), (1, 1)]


def _lnc():
    return (nl.num_programs(0), nl.program_id(0)) if nl.program_ndim() != 0 else (1, 0)


@nki.jit
def allreduce_kernel(y, rg, tp):
    """y: HBM [lnc, T, H] float32, this rank's per-core partials -> [lnc, T, H] each core's result."""
    lnc, pid = _lnc()
    _, T, H = y.shape
    out = nl.ndarray((lnc, T, H), nl.float32, buffer=nl.shared_hbm, name="ar_out")
    t = nl.ndarray((T, H), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=y[pid])
    s = cc.allreduce_partials(t, rg)
    nisa.dma_copy(dst=out[pid], src=s)
    return out


@nki.jit
def allgather_kernel(x, rg, tp, via_all_reduce=True):
    lnc, pid = _lnc()
    _, T, F = x.shape
    n = tp * lnc
    out = nl.ndarray((lnc, T, n * F), x.dtype, buffer=nl.shared_hbm, name="ag_out")
    t = nl.ndarray((T, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid])
    g = cc.allgather_cores(t, rg, tp, via_all_reduce=via_all_reduce)
    nisa.dma_copy(dst=out[pid], src=g)
    return out


@nki.jit
def allgather_cast_kernel(x, rg, tp):
    """x HBM [lnc, T, F] float32 -> [lnc, T, n*F] bfloat16: the gather's own copies round (dtype=)."""
    lnc, pid = _lnc()
    _, T, F = x.shape
    out = nl.ndarray((lnc, T, tp * lnc * F), nl.bfloat16, buffer=nl.shared_hbm, name="agc_out")
    t = nl.ndarray((T, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid])
    g = cc.allgather_cores(t, rg, tp, dtype=nl.bfloat16)
    if g.dtype != nl.bfloat16:          # the SBUF result itself is bf16 (the store below would also cast)
        raise ValueError(f"allgather_cores(dtype=bfloat16) returned {g.dtype}")
    nisa.dma_copy(dst=out[pid], src=g)
    return out


@nki.jit
def combine_kernel(best, vc, rg, tp):
    """best: HBM [lnc, T, 2] (value, local index) per core -> [lnc, T, 2] global winner seen by each core."""
    lnc, pid = _lnc()
    _, T, K = best.shape
    out = nl.ndarray((lnc, T, 2), nl.float32, buffer=nl.shared_hbm, name="am_out")
    t = nl.ndarray((T, K), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=best[pid])
    g = cc.argmax_combine(t, vc, rg, tp)
    nisa.dma_copy(dst=out[pid], src=g)
    return out


@nki.jit
def lm_head_greedy_kernel(xT, w, rg, tp):
    """End to end: each core's vocab shard -> local winner -> global token (one packed all-gather)."""
    lnc, pid = _lnc()
    Pp, KT, T = xT.shape
    vc = w.shape[2] // KT
    out = nl.ndarray((lnc, T, 2), nl.float32, buffer=nl.shared_hbm, name="greedy_out")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    local = lm.lm_head_argmax_body(xs, w[pid], index_base=0)
    g = cc.argmax_combine(local, vc, rg, tp)
    nisa.dma_copy(dst=out[pid], src=g)
    return out


@nki.jit
def greedy_then_embed_kernel(xT, w, table, rg, tp):
    """The D1 -> verify seam without a host round trip: LM head on 8 cores, packed combine, then the
    embedding of the chosen token, all in one launch."""
    lnc, pid = _lnc()
    Pp, KT, T = xT.shape
    vc = w.shape[2] // KT
    out = nl.ndarray((lnc, T, table.shape[1]), table.dtype, buffer=nl.shared_hbm, name="seam_out")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    best = cc.argmax_combine(lm.lm_head_argmax_body(xs, w[pid]), vc, rg, tp)
    x = emb.embedding_body(table, emb.token_ids_from_best(best))
    nisa.dma_copy(dst=out[pid], src=x)
    return out


def _launch(kernel, per_rank, tp, lnc):
    rg = cc.tp_group(tp)
    return nkisim.launch(kernel, [tuple(a) + (rg, tp) for a in per_rank], tp=tp, lnc=lnc)


def fixed_order_sum(ys, lnc):
    """ys[r][c] [T, H]: each lane over ranks ascending in fp32, then lane0 + lane1."""
    lanes = []
    for c in range(lnc):
        acc = ys[0][c].astype(F32)
        for r in range(1, len(ys)):
            acc = (acc + ys[r][c]).astype(F32)
        lanes.append(acc)
    return lanes[0] if lnc == 1 else (lanes[0] + lanes[1]).astype(F32)


@pytest.mark.parametrize("tp, lnc", WORLDS)
@pytest.mark.parametrize("T, H", [(1, 128), (2, 2048), (4, 256)])
def test_allreduce_partials(tp, lnc, T, H):
    rng = np.random.default_rng(T * 100 + tp * 10 + lnc)
    ys = [(rng.standard_normal((lnc, T, H)) * 10.0 ** rng.integers(-3, 3)).astype(F32) for _ in range(tp)]
    outs = _launch(allreduce_kernel, [(y,) for y in ys], tp, lnc)
    want = fixed_order_sum(ys, lnc)
    exact = np.sum(np.stack([y.astype(np.float64) for y in ys]), axis=(0, 1))
    for r in range(tp):
        for c in range(lnc):
            np.testing.assert_array_equal(outs[r][c], want)                 # bit-for-bit, every core
    assert_close(want, exact, rtol=1e-6, atol=1e-6 * np.abs(exact).max(), name="fixed-order sum vs exact")
    again = _launch(allreduce_kernel, [(y,) for y in ys], tp, lnc)
    for r in range(tp):
        np.testing.assert_array_equal(again[r], outs[r])                    # run to run


@pytest.mark.parametrize("via_all_reduce", [True, False], ids=["slots+all_reduce", "all_gather"])
@pytest.mark.parametrize("tp, lnc", WORLDS)
@pytest.mark.parametrize("dtype", [np.float32, "bfloat16"])
def test_allgather_cores(tp, lnc, dtype, via_all_reduce):
    from nkisim import dtypes
    st = dtypes.storage(dtype) if isinstance(dtype, str) else dtype
    T, F = 2, 24
    rng = np.random.default_rng(tp * 10 + lnc)
    xs = [(rng.standard_normal((lnc, T, F)) * 1e3).astype(st) for r in range(tp)]
    xs[0][0, 0, :3] = [np.inf, -np.inf, np.nan]          # non-finite values travel intact either way
    per_rank = [(x, cc.tp_group(tp), tp, via_all_reduce) for x in xs]
    outs = nkisim.launch(allgather_kernel, per_rank, tp=tp, lnc=lnc)
    want = np.concatenate([xs[r][c] for r in range(tp) for c in range(lnc)], axis=1)   # g = r*lnc + c
    for r in range(tp):
        for c in range(lnc):
            assert outs[r][c].dtype == want.dtype
            np.testing.assert_array_equal(outs[r][c].astype(F32), want.astype(F32))   # exact; NaN matches NaN


@pytest.mark.parametrize("tp, lnc", WORLDS)
def test_allgather_cores_rounds_to_dtype(tp, lnc):
    """dtype=: the same gather, each value rounded once fp32 -> bf16 (RNE), as a separate cast copy would."""
    import ml_dtypes
    T, F = 2, 24
    rng = np.random.default_rng(7 * tp + lnc)
    xs = [(rng.standard_normal((lnc, T, F)) * 1e2).astype(F32) for r in range(tp)]
    outs = nkisim.launch(allgather_cast_kernel, [(x, cc.tp_group(tp), tp) for x in xs], tp=tp, lnc=lnc)
    want = np.concatenate([xs[r][c] for r in range(tp) for c in range(lnc)], axis=1).astype(ml_dtypes.bfloat16)
    assert np.abs(want.astype(F32)).max() > 1.0
    for r in range(tp):
        for c in range(lnc):
            np.testing.assert_array_equal(outs[r][c].view(np.uint16), want.view(np.uint16))


def _combine_world(vals, idxs, vc, tp, lnc):
    """vals/idxs [n_cores, T] in global core order -> per-rank [lnc, T, 2] inputs, launched."""
    per_rank = []
    for r in range(tp):
        b = np.stack([np.stack([vals[r * lnc + c], idxs[r * lnc + c]], axis=-1) for c in range(lnc)])
        per_rank.append((b.astype(F32), vc))
    return _launch(combine_kernel, per_rank, tp, lnc)


@pytest.mark.parametrize("tp, lnc", WORLDS)
def test_argmax_combine_ties_lowest_global_index(tp, lnc):
    n, vc, T = tp * lnc, 31040, 4
    rng = np.random.default_rng(n)
    vals = rng.integers(-4, 4, size=(n, T)).astype(F32)
    idxs = rng.integers(0, vc, size=(n, T)).astype(F32)
    vals[:, 0] = 7.0                              # every core ties: core 0 wins whatever its local index
    idxs[0, 0] = vc - 1
    if n > 2:                                     # tie between two later cores: the lower core wins
        vals[n - 1, 1] = vals[1, 1] = 9.0
        idxs[n - 1, 1], idxs[1, 1] = 0, vc - 1
    vals[n - 1, 2] = 11.0                         # a unique max on the last core
    outs = _combine_world(vals, idxs, vc, tp, lnc)
    tv, ti = eh.combine_argmax(torch.from_numpy(vals), torch.from_numpy(idxs).long(), vc)
    for r in range(tp):
        for c in range(lnc):
            np.testing.assert_array_equal(outs[r][c][:, 0], tv.numpy())
            np.testing.assert_array_equal(outs[r][c][:, 1], ti.numpy().astype(F32))
    assert outs[0][0][0, 1] == vc - 1 and outs[0][0][2, 1] == (n - 1) * vc + idxs[n - 1, 2]
    if n > 2:
        assert outs[0][0][1, 1] == 2 * vc - 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_lm_head_greedy_across_8_cores(dtype, T):
    """LM head body on each of the 8 cores + argmax_combine = torch.argmax of the reference logits
    (the kernel's logits may differ from torch's by one bf16 ulp: then the pick must be a near-tie)."""
    cfg = preset("tiny")
    p = random_params(cfg, seed=11, dtype=dtype, include_mtp=False)
    vc = eh.vocab_per_core(cfg, 8)
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(dtype)
    xT = feature_major(h)
    per_rank = [(xT, lm.rank_lm_head_layout([eh.shard_lm_head(p, cfg, 2 * r + c) for c in range(2)]))
                for r in range(4)]
    outs = _launch(lm_head_greedy_kernel, per_rank, 4, 2)
    for r in range(4):
        for c in range(2):
            np.testing.assert_array_equal(np.asarray(outs[r][c]), np.asarray(outs[0][0]))  # every core agrees
    tok = torch.as_tensor(outs[0][0][:, 1]).long()
    ref = eh.core_logits(h, eh.lm_head_weight(p, cfg))
    tv, ti = ref.max(-1)
    tol = 2.0 ** -7 * tv.abs() + 1e-5 if dtype == torch.bfloat16 else 1e-5 * tv.abs() + 1e-5
    assert torch.all((tok == ti) | (ref.gather(-1, tok[:, None])[:, 0] >= tv - tol))
    assert torch.allclose(torch.as_tensor(outs[0][0][:, 0]), tv, rtol=2.0 ** -7, atol=1e-5)


def test_lm_head_greedy_crafted_cross_core_ties():
    """Exact data, equal maxima on several cores and within cores: the lowest global index wins."""
    cfg = preset("tiny")
    vc = cfg.vocab_size // 8
    w = torch.zeros(cfg.vocab_size, cfg.hidden_size)
    w[:, 0] = torch.arange(cfg.vocab_size) % 5
    cases = [[6 * vc + 3, 2 * vc + 30, 7 * vc], [vc - 1, vc], [4 * vc + 20, 4 * vc + 2]]
    h = torch.zeros(len(cases), cfg.hidden_size)
    for t, rows in enumerate(cases):
        h[t, 0] = h[t, 1 + t] = 1.0
        w[rows, 1 + t] = 9.0 - w[rows, 0]
    for dtype in (torch.float32, torch.bfloat16):
        wd = w.to(dtype)
        per_rank = [(feature_major(h.to(dtype)), lm.rank_lm_head_layout([wd[(2 * r + c) * vc:(2 * r + c + 1) * vc]
                                                                        for c in range(2)])) for r in range(4)]
        outs = _launch(lm_head_greedy_kernel, per_rank, 4, 2)
        want = [min(rows) for rows in cases]
        assert torch.equal(torch.argmax(eh.core_logits(h.to(dtype), wd), -1), torch.tensor(want))
        for r in range(4):
            for c in range(2):
                assert outs[r][c][:, 1].tolist() == want and outs[r][c][:, 0].tolist() == [9.0] * 3


def test_greedy_token_feeds_the_embedding_in_kernel():
    cfg = preset("tiny")
    p = random_params(cfg, seed=13, dtype=torch.bfloat16, include_mtp=False)
    h = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    table = p["model.embed_tokens.weight"]
    per_rank = [(feature_major(h), lm.rank_lm_head_layout([eh.shard_lm_head(p, cfg, 2 * r + c) for c in range(2)]),
                 table) for r in range(4)]
    outs = _launch(greedy_then_embed_kernel, per_rank, 4, 2)
    tv, ti = eh.lm_head_argmax(p, cfg, h)
    ref = eh.core_logits(h, eh.lm_head_weight(p, cfg))
    for t in range(2):
        rows = (table == outs[0][0][t]).all(-1).nonzero()[:, 0]      # which token's row arrived
        k = int(rows[0])
        assert k == int(ti[t]) or ref[t, k] >= tv[t] - 2.0 ** -7 * abs(float(tv[t]))   # or a one-ulp near-tie
    for r in range(4):
        for c in range(2):
            assert torch.equal(outs[r][c], outs[0][0])


def test_one_collective_per_reduction_in_the_trace():
    """Shape-only trace of one all-reduce of a real-size partial (T=2, H=2048, fp32) and one argmax
    combine on 4 x 2 cores: each core issues exactly one CC op and one sendrecv per call."""
    T, H = 2, 2048
    with nkisim.trace.capture() as tr:
        _launch(allreduce_kernel, [(nkisim.ShapeDtype((2, T, H), "float32"),)] * 4, 4, 2)
    s = tr.summary()
    assert s[("CC", "all_reduce")] == 8 and s[("DMA", "sendrecv")] == 8
    ids = {i["collective"]["id"] for i in tr.instructions if i["engine"] == "CC"}
    assert len(ids) == 2                                        # one collective per lane, run concurrently
    with nkisim.trace.capture() as tr:
        _launch(combine_kernel, [(nkisim.ShapeDtype((2, T, 2), "float32"), 31040)] * 4, 4, 2)
    s = tr.summary()
    assert s[("CC", "all_reduce")] == 8 and s[("DMA", "sendrecv")] == 8 and ("CC", "all_gather") not in s
    ccs = [i for i in tr.instructions if i["engine"] == "CC"]
    assert all(g["collective"]["bytes_in"] == T * 2 * 4 * 4 for g in ccs)    # (value, index) slots of 4 ranks


@nki.jit
def allreduce_bf16_kernel(y, rg, tp):
    t = nl.ndarray(y.shape, y.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=y)
    s = cc.allreduce_partials(t, rg)
    out = nl.ndarray(y.shape, nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=s)
    return out


def test_argument_checks():
    with pytest.raises(TypeError, match="partials must be float32"):
        _launch(allreduce_bf16_kernel, [(np.zeros((2, 128), np.float16),)] * 2, 2, 2)
    with pytest.raises(ValueError, match=r"best must be \[T, 2\] float32"):
        _launch(combine_kernel, [(np.zeros((2, 2, 3), F32), 10)] * 2, 2, 2)
    with pytest.raises(ValueError, match="replica group and tp=2 disagree"):
        nkisim.launch(combine_kernel, [(np.zeros((2, 2, 2), F32), 10, None, 2)] * 2, tp=2, lnc=2)
