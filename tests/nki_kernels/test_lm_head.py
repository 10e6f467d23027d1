"""Vocabulary-parallel LM head + argmax kernel (nki_kernels/lm_head.py) vs its PyTorch twin
(model/tp/embed_head.py).

Tolerances. Kernel and twin both accumulate in fp32 and round the logits to the activation dtype; only
the summation order differs. fp32: |k - t| <= 1e-5 + 1e-5|t| (H <= 2048 products of O(1/sqrt(H))).
bf16: the fp32 sums differ by ~1e-6, so after rounding they are equal or one bf16 ulp apart
(ulp <= 2^-7 |t|): |k - t| <= 2^-7 |t| + 1e-5. The argmax is checked EXACTLY against the kernel's own
logits (largest value, lowest index), and against the twin up to such one-ulp near-ties: the kernel's
index must be the twin's or hold a twin logit within one ulp of the twin's maximum. Crafted tie tests
use integer-valued data, exact in both dtypes, and demand exact equality.
"""

from __future__ import annotations

import ml_dtypes
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
from nki_kernels import lm_head as lm
from nki_kernels.common import P, carve
from nki_kernels.host import feature_major

N_CORES = 8


def _np32(a):
    return np.asarray(a.float() if isinstance(a, torch.Tensor) else a.astype(np.float32), dtype=np.float32)


def _tol(dtype):
    return (2.0 ** -7, 1e-5) if dtype == torch.bfloat16 else (1e-5, 1e-5)


def check_core(best, klogits, h, w_shard, base):
    """best [T, 2], klogits [T, Vc] from the kernel for the shard w_shard [Vc, H] starting at vocab ``base``."""
    best, kl = _np32(best), _np32(klogits)
    tl = eh.core_logits(h, w_shard).numpy()
    rtol, atol = _tol(h.dtype)
    assert_close(kl, tl, rtol=rtol, atol=atol, name="core logits vs twin")
    assert np.isfinite(best).all()
    # exact argmax semantics on the kernel's own logits: largest value, lowest index
    np.testing.assert_array_equal(best[:, 0], kl.max(-1))
    np.testing.assert_array_equal(best[:, 1], kl.argmax(-1) + base)
    # against the twin: same token, or a one-ulp near-tie
    tv, ti = eh.core_argmax(torch.from_numpy(tl))
    k_idx = best[:, 1].astype(np.int64) - base
    for t in range(len(k_idx)):
        if k_idx[t] != int(ti[t]):
            assert tl[t, k_idx[t]] >= float(tv[t]) - (rtol * abs(float(tv[t])) + atol), (t, k_idx[t], int(ti[t]))
    return k_idx


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    cfg = preset("tiny")
    return cfg, random_params(cfg, seed=7, dtype=request.param, include_mtp=False)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_tiny_rank_launches_match_twin(tiny, T):
    """TP=4 ranks x kernel[2]: every core's (value, index) and logits; their global combination is
    torch.argmax of the reference logits (up to one-ulp near-ties)."""
    cfg, p = tiny
    dtype = p["lm_head.weight"].dtype
    vc = eh.vocab_per_core(cfg, N_CORES)
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(T)).to(dtype)
    vals, idxs = [], []
    for rank in range(N_CORES // 2):
        shards = [eh.shard_lm_head(p, cfg, 2 * rank + c, N_CORES) for c in range(2)]
        best, logits = lm.lm_head_argmax_kernel[2](feature_major(h), lm.rank_lm_head_layout(shards),
                                                   vocab_base=2 * rank * vc, with_logits=True)
        assert best.shape == (2, T, 2) and logits.shape == (2, T, vc)
        for c in range(2):
            g = 2 * rank + c
            check_core(best[c], logits[c], h, shards[c], g * vc)
            vals.append(torch.from_numpy(_np32(best[c][:, 0])))
            idxs.append(torch.from_numpy(_np32(best[c][:, 1])).long() - g * vc)
    v, i = eh.combine_argmax(torch.stack(vals), torch.stack(idxs), vc)
    tv, ti = eh.lm_head_argmax(p, cfg, h)
    rtol, atol = _tol(dtype)
    assert torch.allclose(v, tv, rtol=rtol, atol=atol)
    ref_logits = eh.core_logits(h, eh.lm_head_weight(p, cfg))
    picked = ref_logits.gather(-1, i[:, None])[:, 0]
    assert torch.all((i == ti) | (picked >= tv - (rtol * tv.abs() + atol)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vc, T", [(700, 3), (1024, 2), (34, 1), (130, 4)])
def test_geometries_lnc1(dtype, vc, T):
    """Several blocks with a partial last chunk (700), whole chunks only (1024: no -inf padding),
    fewer than 8 chunks (34, 130: max8 padding), T = 3 (token stride 4)."""
    H = 256
    g = torch.Generator().manual_seed(vc)
    w = (torch.randn(vc, H, generator=g) / H ** 0.5).to(dtype)
    h = torch.randn(T, H, generator=g).to(dtype)
    best, logits = lm.lm_head_argmax_kernel(feature_major(h), lm.lm_head_layout(w)[None], vocab_base=5 * vc,
                                            with_logits=True)
    check_core(best[0], logits[0], h, w, 5 * vc)


def _tie_problem(vc, cases, H=128):
    """Integer weights: background logits 0..4 by row, chosen rows reach 9 for token t (exact)."""
    w = torch.zeros(vc, H)
    w[:, 0] = torch.arange(vc) % 5
    h = torch.zeros(len(cases), H)
    for t, rows in enumerate(cases):
        h[t, 0] = 1.0
        h[t, 1 + t] = 1.0
        w[rows, 1 + t] = 9.0 - w[rows, 0]
    return w, h


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_crafted_ties_within_a_core_lowest_index_wins(dtype):
    vc = 700                                    # chunks c = v // 128 on partitions p = v % 128
    cases = [
        [3 + 128 * 4, 3 + 128 * 1],             # same partition, different chunks
        [128 * 2 + 90, 128 * 2 + 17],           # same chunk, different partitions
        [5 * 128 + 3, 1 * 128 + 100, 650],      # lower index sits on a HIGHER partition; across blocks
        [699, 0],                               # first and last rows (last in the partial chunk)
    ]
    w, h = _tie_problem(vc, cases)
    for lnc in (1, 2):
        wl = lm.rank_lm_head_layout([w.to(dtype)] * lnc)
        kernel = lm.lm_head_argmax_kernel if lnc == 1 else lm.lm_head_argmax_kernel[2]
        best = _np32(kernel(feature_major(h.to(dtype)), wl, vocab_base=vc))
        for c in range(lnc):
            assert best[c][:, 0].tolist() == [9.0] * len(cases)
            assert best[c][:, 1].tolist() == [min(r) + vc * (1 + c) for r in cases]
    assert torch.equal(eh.core_argmax(eh.core_logits(h.to(dtype), w.to(dtype)))[1],
                       torch.tensor([min(r) for r in cases]))


@pytest.mark.parametrize("T", [1, 2])
def test_real_shape_one_core(T):
    """Real per-core shapes: Vc = 248320 / 8 = 31040 rows of H = 2048, bf16, the last core's offset."""
    cfg = preset("qwen3.6-35b-a3b")
    vc = eh.vocab_per_core(cfg, N_CORES)
    H = cfg.hidden_size
    g = torch.Generator().manual_seed(100 + T)
    w = (torch.randn(vc, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    best, logits = lm.lm_head_argmax_kernel(feature_major(h), lm.lm_head_layout(w)[None], vocab_base=7 * vc,
                                            with_logits=True)
    check_core(best[0], logits[0], h, w, 7 * vc)


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 4])
def test_real_shape_rank_fp32(T):
    cfg = preset("qwen3.6-35b-a3b")
    vc = eh.vocab_per_core(cfg, N_CORES)
    H = cfg.hidden_size
    g = torch.Generator().manual_seed(200 + T)
    w = torch.randn(2 * vc, H, generator=g) / H ** 0.5
    h = torch.randn(T, H, generator=g)
    best, logits = lm.lm_head_argmax_kernel[2](feature_major(h), lm.rank_lm_head_layout((w[:vc], w[vc:])),
                                               vocab_base=2 * vc, with_logits=True)
    for c in range(2):
        check_core(best[c], logits[c], h, w[c * vc:(c + 1) * vc], (2 + c) * vc)


def test_layout_roundtrip():
    vc, H = 700, 256
    w = np.arange(vc * H, dtype=np.float32).reshape(vc, H)
    lay = lm.lm_head_layout(w)
    KT = H // 128
    for b0, nb in lm.vocab_blocks(vc):
        blk = lay[:, KT * b0:KT * (b0 + nb)].reshape(128, KT, nb)
        for j in (0, KT - 1):
            np.testing.assert_array_equal(blk[:, j, :], w[b0:b0 + nb, j * 128:(j + 1) * 128].T)


def test_argument_checks():
    with pytest.raises(ValueError, match="hidden size 200 is not a multiple of 128"):
        lm.lm_head_layout(np.zeros((10, 200), np.float32))
    xT = np.zeros((128, 2, 1), np.float32)
    w = lm.lm_head_layout(np.zeros((64, 256), np.float32))[None]
    with pytest.raises(TypeError, match="weight dtype bfloat16 differs from activation dtype float32"):
        lm.lm_head_argmax_kernel(xT, w.to(torch.bfloat16))
    with pytest.raises(ValueError, match="weight holds 1 core shards, launched on 2 cores"):
        lm.lm_head_argmax_kernel[2](xT, w)
    with pytest.raises(ValueError, match="xT has 64 partitions"):
        lm.lm_head_argmax_kernel(np.zeros((64, 4, 1), np.float32), w)


def shape_only_launch(cfg, tp=4, T=2, dtype="bfloat16"):
    """(kernel, args) of one rank at the config's shapes: ``lm_head_argmax_kernel[2]`` over xT ``[P, KT, T]`` and
    the rank's two shards ``[2, P, KT * Vc]`` (Vc = V / (2 tp)), ``nkisim.ShapeDtype`` tensors."""
    n_cores, KT = 2 * tp, cfg.hidden_size // P
    assert cfg.vocab_size % n_cores == 0
    vc = cfg.vocab_size // n_cores
    return lm.lm_head_argmax_kernel[2], (nkisim.ShapeDtype((P, KT, T), dtype),
                                         nkisim.ShapeDtype((2, P, KT * vc), dtype))


def test_real_shape_trace_counts_and_bytes():
    """Shape-only trace of one rank (kernel[2]) at real shapes, T = 2: the weight stream is read once
    (Vc*H*2 B per core, the minimum), and the instruction mix is what the module doc states."""
    cfg = preset("qwen3.6-35b-a3b")
    T = 2
    kernel, args = shape_only_launch(cfg, T=T)
    with nkisim.trace.capture() as tr:
        out = kernel(*args)
    assert out.shape == (2, T, 2)
    vc, H = cfg.vocab_size // N_CORES, cfg.hidden_size
    nblk = len(lm.vocab_blocks(vc))
    C, _, _ = lm.scan_geometry(vc, T)
    s = tr.summary()
    assert s[("PE", "nc_matmul")] == 2 * (nblk * H // 128 + C)          # projections + identity transposes
    assert s[("ACT", "activation")] == 2 * nblk
    assert s[("DVE", "max8")] == s[("DVE", "nc_find_index8")] == 2 * T
    assert not any(op == "tensor_partition_reduce" for _, op in s)
    for inst in (0, 1):
        hbm_read = sum(i["bytes"].get("shared_hbm", {}).get("read", 0) for i in tr.instructions if i["inst"] == inst)
        assert hbm_read == vc * H * 2 + H * T * 2


@nki.jit
def _head_with_ring(xT, w, n_ring):
    """lm_head_argmax_body with its first ``n_ring`` weight blocks issued ahead (``lm_head_ring``) into buffers
    carved out of one larger SBUF tile (``common.carve``, as the megakernel carves the GDN arena) -> best [T, 2]."""
    _, KT, T = xT.shape
    vc = w.shape[1] // KT
    xs = nl.ndarray(tuple(xT.shape), xT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xs, src=xT)
    arena = nl.ndarray((P, n_ring * KT * min(lm.NB, vc) + 7), w.dtype, buffer=nl.sbuf)   # +7: a remainder left out
    bufs = carve([arena], (KT, min(lm.NB, vc)), w.dtype)
    ring = lm.lm_head_ring(w, KT, bufs[0:n_ring])
    best = lm.lm_head_argmax_body(xs, w, ring=ring)
    out = nl.ndarray((T, 2), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=best)
    return out


@pytest.mark.parametrize("n_ring", [1, 3])
def test_ring_issued_ahead_is_bit_identical(n_ring):
    """A ring whose first blocks the caller issued (fewer than the body's depth, or all of it) gives the same bits
    as the body's own ring: same blocks, same matmuls, in the same order."""
    vc, H, T = 1300, 256, 2                # 3 vocab blocks: the body's ring is 3 deep
    g = torch.Generator().manual_seed(13)
    w = lm.lm_head_layout((torch.randn(vc, H, generator=g) / H ** 0.5).to(torch.bfloat16))
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    want = _np32(lm.lm_head_argmax_kernel(feature_major(h), w[None])[0])
    with nkisim.trace.capture() as tr:
        got = _np32(_head_with_ring(feature_major(h), w, n_ring))
    assert np.isfinite(got).all() and np.abs(got[:, 0]).max() > 0
    np.testing.assert_array_equal(got, want)
    weight_dmas = [i for i in tr.instructions if i["op"] == "dma_copy" and i["bytes"].get("shared_hbm", {}).get("read")
                   and i.get("dge_mode") != "swdge"]
    assert sum(i.get("dge_mode") == "swdge" for i in tr.instructions) == n_ring       # the ring's, from GpSimd
    assert len(weight_dmas) == 3 - n_ring + 1          # the body's own blocks + xT's load


def test_ring_deeper_than_the_body_refused():
    vc, H, T = 600, 128, 1                 # 2 vocab blocks
    w = lm.lm_head_layout(torch.zeros(vc, H, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at most 2"):
        _head_with_ring(feature_major(torch.zeros(T, H, dtype=torch.bfloat16)), w, 3)


def fp8_twin_logits(h, codes, scale):
    """Torch twin of the fp8 draft head: bf16 h against the e4m3 codes in fp32, times s, rounded to bf16."""
    return ((h.float() @ codes.float().t()) * scale).to(torch.bfloat16).float()


@pytest.mark.parametrize("vc, T", [(700, 3), (34, 1)])
def test_fp8_head_matches_twin(vc, T):
    """The fp8 draft head (module docstring "fp8 draft head"): codes + per-tensor scale against a bf16 xT. Logits
    vs the twin within one bf16 ulp, the argmax exact on the kernel's own logits (lowest index), and the logits
    close to the bf16 head's (e4m3: 2^-4 relative per weight)."""
    from nki_kernels.moe import kernel_table
    H = 256
    g = torch.Generator().manual_seed(vc + 1)
    w = (torch.randn(vc, H, generator=g) / H ** 0.5).to(torch.bfloat16)
    h = torch.randn(T, H, generator=g).to(torch.bfloat16)
    codes, s = lm.quantize_head(w)
    assert codes.dtype == torch.float8_e4m3fn and codes.float().abs().max() <= 240 and float(s) > 0
    best, logits = lm.lm_head_argmax_kernel(feature_major(h), kernel_table(lm.lm_head_layout(codes)[None]),
                                            vocab_base=2 * vc, with_logits=True,
                                            w_scale=lm.fp8_head_scale_layout([s]))
    best, kl = _np32(best[0]), _np32(logits[0])
    tl = fp8_twin_logits(h, codes, float(s)).numpy()
    assert np.isfinite(kl).all() and np.abs(kl).max() > 0
    assert_close(kl, tl, rtol=2.0 ** -7, atol=1e-5, name="fp8 logits vs twin")
    np.testing.assert_array_equal(best[:, 0], kl.max(-1))
    np.testing.assert_array_equal(best[:, 1], kl.argmax(-1) + 2 * vc)
    exact = eh.core_logits(h, w).numpy()
    assert np.abs(kl - exact).max() <= 0.1 * np.abs(exact).max()


def test_fp8_head_ties_lowest_index():
    """Integer codes with scale 1 (exact): equal maxima in different blocks -> the lowest index."""
    from nki_kernels.moe import kernel_table
    vc, H = 700, 128
    w = torch.zeros(vc, H)
    w[:, 0] = torch.arange(vc) % 5
    w[[40, 600], 0] = 4.0          # background logits 0..4; rows 40 and 600 (blocks 0 and 1) both reach 4 + 5 = 9
    w[[40, 600], 1] = 5.0
    h = torch.zeros(1, H)
    h[0, 0], h[0, 1] = 1.0, 1.0
    codes = w.to(torch.float8_e4m3fn)
    best = lm.lm_head_argmax_kernel(feature_major(h.to(torch.bfloat16)), kernel_table(lm.lm_head_layout(codes)[None]),
                                    w_scale=lm.fp8_head_scale_layout([1.0]))
    np.testing.assert_array_equal(_np32(best[0]), [[9.0, 40.0]])


def test_fp8_head_argument_checks():
    from nki_kernels.moe import kernel_table
    codes = kernel_table(lm.lm_head_layout(torch.zeros(64, 256).to(torch.float8_e4m3fn))[None])
    sc = lm.fp8_head_scale_layout([1.0])
    with pytest.raises(TypeError, match="an fp8 head needs float8_e4m3 weights and bfloat16 activations"):
        lm.lm_head_argmax_kernel(np.zeros((128, 2, 1), np.float32), codes, w_scale=sc)
    xT = feature_major(torch.zeros(1, 256, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="an fp8 head needs"):
        lm.lm_head_argmax_kernel(xT, lm.lm_head_layout(torch.zeros(64, 256, dtype=torch.bfloat16))[None], w_scale=sc)
    with pytest.raises(ValueError, match=r"fp8 head scale \[64, 1\]"):
        lm.lm_head_argmax_kernel(xT, codes, w_scale=sc[:, :64])
