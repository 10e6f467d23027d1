"""Prefill gated GQA attention kernel (nki_kernels/attention_prefill.py) vs its PyTorch twin
(model/tp/attention.attention_rank with T = N tokens: the same rank math the decode kernel is tested against).

Every case runs the twin and the kernel on the same rank weights, normed chunk and caches, and compares the sum
of the kernel's per-core partials with the twin's fp32 partial, plus the caches.

Tolerances (|kernel - twin| <= tol * max|twin|, elementwise; mean error bounded too):

* float32: tol = 1e-5, mean 2e-6. The same math in fp32; only summation orders differ (2048-term projections,
  the softmax sums and PV in key blocks, the 1024-term o_proj) and where the 1/sqrt(D) scale and the anchor are
  applied (exp(scale*s - m0) vs softmax(scale*s)). Measured <= 1.8e-6 (with a replay) over tiny and real shapes.
* bfloat16: tol = 1.5e-2 (2^-6), mean 2e-3. The kernel rounds the probabilities to bf16 for the PV matmul (the
  twin keeps fp32 probabilities) and a projection or normed value can land one bf16 ulp away when its fp32
  accumulation order differs, then propagates through norm, RoPE, softmax and the bf16 rounding of o and
  o*gate before the o_proj. Measured max 3.2e-3.
* KV rows: every row outside start..start+N-1 is bit-identical (never written). The new rows carry the twin's
  roundings (bf16 projection, norm and RoPE outputs) and may differ by one final ulp where the fp32 projection
  sum, taken in another order, straddles a rounding boundary: bf16 within 2^-7 * max|row| with >= 99% of the
  elements identical, fp32 within 1e-4 * max|row| (a 2048-term fp32 sum: worst case ~n*2^-24 = 1.2e-4).

Chunked prefill (the exact claim tested): a prompt split into two calls at a multiple of ``key_block`` gives
bit-identical KV rows AND outputs to one call; at a multiple of 128 (not of key_block) bit-identical KV rows, the
first chunk's outputs bit-identical and the second chunk's within the fp32 tolerance (its earlier keys come in
other blocks); at any other point the first chunk's outputs are still bit-identical.

Default suite: tiny shapes over lengths, starts and LNC, the replay and NaN paths, a few real per-rank shapes and
shape-only structure checks; longer sweeps are marked slow.
"""

from __future__ import annotations

import functools
import inspect

import numpy as np
import pytest
import torch

import nkisim
from compare import assert_close
from harness.kernel_cases import attention_prefill_launch
from model import functional as fn
from model.config import preset
from model.params import expected_shapes, random_params
from model.reference import ReferenceModel
from model.tp.attention import attention_rank, rank_cache, shard_attention
from nki_kernels import attention_prefill as pf
from nki_kernels.attention import attention_layout

TINY, REAL = "tiny", "qwen3.6-35b-a3b"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1.5e-2}
MEAN_TOL = {torch.float32: 2e-6, torch.bfloat16: 2e-3}


@functools.lru_cache(maxsize=None)
def _params(name, dtype):
    """Canonical params of one attention layer (tiny: the full random model; real: that layer only)."""
    cfg = preset(name)
    pre = f"model.layers.{cfg.full_layers[0]}"
    if name == TINY:
        return cfg, pre, random_params(cfg, seed=0, dtype=dtype, include_mtp=False)
    g = torch.Generator().manual_seed(0)
    params = {}
    for k, shp in expected_shapes(cfg, include_mtp=False).items():
        if k.startswith(pre + ".self_attn"):
            t = 0.1 * torch.randn(shp, generator=g) if len(shp) == 1 else torch.randn(shp, generator=g) / shp[-1] ** 0.5
            params[k] = t.to(dtype)
    return cfg, pre, params


def _shard(name, dtype, rank, edit=None):
    cfg, pre, params = _params(name, dtype)
    sh = shard_attention(params, pre, cfg, rank, 4)
    if edit is not None:
        sh = edit(dict(sh))
    return cfg, sh


def _inputs(cfg, dtype, N, start, L, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, cfg.hidden_size, generator=g).to(dtype)
    k0 = torch.randn(1, L, cfg.head_dim, generator=g).to(dtype)
    v0 = torch.randn(1, L, cfg.head_dim, generator=g).to(dtype)
    return x, k0, v0


def _case(name, dtype, N, start, lnc, rank=1, L=None, key_block=pf.KEY_BLOCK, seed=1, edit=None, inputs=None,
          poison=False, check_finite=True):
    """Run twin and kernel; returns (cfg, partials [lnc, N, H], stats [lnc, 3], twin [N, H], caches before /
    twin / kernel)."""
    cfg, sh = _shard(name, dtype, rank, edit)
    L = L or max(key_block, -(-(start + N + 3) // 128) * 128)
    x, k0, v0 = inputs(cfg, dtype, N, start, L) if inputs is not None else _inputs(cfg, dtype, N, start, L, seed)
    if poison:      # rows past the valid prefix: masked or never read, must not leak
        k0[:, start + N:] = float("nan")
        v0[:, start + N:] = float("nan")
    kt, vt = k0.clone(), v0.clone()
    want, kt, vt = attention_rank(sh, x, kt, vt, start, cfg)
    kk, vk = k0.clone(), v0.clone()
    got, stats = pf.run_attention_prefill(attention_layout(sh), x, kk, vk, start, cfg, lnc=lnc, key_block=key_block,
                                          return_stats=True, check_finite=check_finite)
    return cfg, got, stats, want, (k0, v0), (kt, vt), (kk, vk)


def _check(dtype, got, want, N, H, lnc):
    assert got.shape == (lnc, N, H) and got.dtype == torch.float32
    err = assert_close(got.sum(0), want, rel=TOL[dtype], mean_rel=MEAN_TOL[dtype], name="kernel vs twin")
    if lnc == 2:    # both cores contribute (their heads' o_proj columns)
        assert (got[0] != 0).any() and (got[1] != 0).any()
    return err


def _bits(t):
    return t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else torch.int32)


def _check_caches(dtype, start, N, before, twin, kern):
    for b, t, k in zip(before, twin, kern):
        assert torch.equal(_bits(k[:, :start]), _bits(b[:, :start]))            # untouched, bit for bit
        assert torch.equal(_bits(k[:, start + N:]), _bits(b[:, start + N:]))    # (NaN poison included)
        new_k, new_t = k[:, start:start + N].float(), t[:, start:start + N].float()
        if dtype == torch.bfloat16:
            assert ((new_k - new_t).abs() <= 2 ** -7 * new_t.abs().max()).all()
            assert (new_k == new_t).float().mean() >= 0.99
        else:
            assert ((new_k - new_t).abs() <= 1e-4 * new_t.abs().max()).all()


def _no_replay(stats):
    assert (stats[:, 0:2] == 0).all() and (stats[:, 2] == 0).all(), f"stats {stats}"


# ---- tiny shapes: chunk lengths, starts, LNC, dtypes ---------------------------------------------------------
@pytest.mark.parametrize("N", [1, 63, 64, 65, 127, 128, 129])
def test_tiny_chunk_boundaries(N):
    cfg, got, stats, want, before, twin, kern = _case(TINY, torch.float32, N, 0, 2)
    _check(torch.float32, got, want, N, cfg.hidden_size, 2)
    _check_caches(torch.float32, 0, N, before, twin, kern)
    _no_replay(stats)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("N,start,kb", [(65, 0, 1024), (300, 700, 512), (200, 1024, 512), (129, 2500, 1024),
                                        (700, 300, 512)])
def test_tiny_parity(N, start, kb, lnc, dtype):
    """Context from earlier chunks (head block iff start mod KB > 0, full blocks), chunk blocks before the
    diagonal block (N > KB)."""
    cfg, got, stats, want, before, twin, kern = _case(TINY, dtype, N, start, lnc, key_block=kb)
    _check(dtype, got, want, N, cfg.hidden_size, lnc)
    _check_caches(dtype, start, N, before, twin, kern)
    _no_replay(stats)


@pytest.mark.parametrize("start", [0, 100, 600])
def test_poisoned_rows_beyond_prefix(start):
    """NaN in every cache row >= start+N: the head block reads some of them when start mod KB > 0 (zeroed in
    SBUF and masked); output finite and correct, nothing reported, the NaN rows untouched."""
    cfg, got, stats, want, before, twin, kern = _case(TINY, torch.bfloat16, 65, start, 2, key_block=512,
                                                      poison=True, L=1024)
    _check(torch.bfloat16, got, want, 65, cfg.hidden_size, 2)
    _check_caches(torch.bfloat16, start, 65, before, twin, kern)
    _no_replay(stats)


# ---- real per-rank shapes (H 2048, 4 query heads, 1 KV head, D 256) -------------------------------------------
@pytest.mark.parametrize("dtype,N,start,lnc,rank", [
    (torch.bfloat16, 256, 0, 2, 2),
    (torch.float32, 129, 300, 2, 1),
    (torch.bfloat16, 128, 1100, 1, 0),
])
def test_real_parity(dtype, N, start, lnc, rank):
    cfg, got, stats, want, before, twin, kern = _case(REAL, dtype, N, start, lnc, rank=rank)
    _check(dtype, got, want, N, cfg.hidden_size, lnc)
    _check_caches(dtype, start, N, before, twin, kern)
    _no_replay(stats)


REAL_SWEEP = []
for _dt in (torch.float32, torch.bfloat16):
    for _n, _s, _lnc in ((1024, 0, 2), (640, 1500, 2), (1, 2047, 2), (300, 1024, 1)):
        if not (_lnc == 1 and _dt == torch.float32):     # refused by design (test_refusals): fp32 weights of
            REAL_SWEEP.append((_dt, _n, _s, _lnc))        # 4 heads do not fit one core's SBUF


@pytest.mark.slow
@pytest.mark.parametrize("dtype,N,start,lnc", REAL_SWEEP)
def test_real_sweep(dtype, N, start, lnc):
    cfg, got, stats, want, before, twin, kern = _case(REAL, dtype, N, start, lnc, rank=N % 4)
    _check(dtype, got, want, N, cfg.hidden_size, lnc)
    _check_caches(dtype, start, N, before, twin, kern)
    _no_replay(stats)


def test_tp4_sum_and_kv_rows_equal_the_reference_model():
    """All four ranks (each LNC=2): the sum of every core's partial equals ReferenceModel.attention_mixer (which
    rounds the o_proj output to bf16: tolerance 1.5e-2 covers that rounding too), and each rank's KV rows equal
    the reference cache rows of the KV head it holds (the cache tolerance above)."""
    dtype, N, start = torch.bfloat16, 129, 300
    cfg, pre, params = _params(TINY, dtype)
    L = 1024
    x, _, _ = _inputs(cfg, dtype, N, start, L)
    g = torch.Generator().manual_seed(5)
    k0 = torch.randn(cfg.num_key_value_heads, L, cfg.head_dim, generator=g).to(dtype)
    v0 = torch.randn(cfg.num_key_value_heads, L, cfg.head_dim, generator=g).to(dtype)
    kr, vr = k0.clone(), v0.clone()
    want = ReferenceModel(cfg, params).attention_mixer(pre, x, (kr, vr), start).float()
    total = torch.zeros(N, cfg.hidden_size)
    for r in range(4):
        sh = shard_attention(params, pre, cfg, r, 4)
        kc, vc = rank_cache(k0, sh), rank_cache(v0, sh)
        total += pf.run_attention_prefill(attention_layout(sh), x, kc, vc, start, cfg, lnc=2).sum(0)
        h0 = sh["kv_head"]
        _check_caches(dtype, start, N, (k0[h0:h0 + 1], v0[h0:h0 + 1]), (kr[h0:h0 + 1], vr[h0:h0 + 1]), (kc, vc))
    assert_close(total, want, rel=TOL[dtype], name="sum over ranks vs reference")


# ---- chunk-by-chunk prefill ---------------------------------------------------------------------------------
def _split(name, dtype, N1, N2, key_block, lnc=2):
    cfg, sh = _shard(name, dtype, 1)
    lay = attention_layout(sh)
    L = max(key_block, -(-(N1 + N2) // key_block) * key_block)
    x, k0, v0 = _inputs(cfg, dtype, N1 + N2, 0, L)
    ka, va = k0.clone(), v0.clone()
    one = pf.run_attention_prefill(lay, x, ka, va, 0, cfg, lnc=lnc, key_block=key_block)
    kb, vb = k0.clone(), v0.clone()
    a = pf.run_attention_prefill(lay, x[:N1], kb, vb, 0, cfg, lnc=lnc, key_block=key_block)
    b = pf.run_attention_prefill(lay, x[N1:], kb, vb, N1, cfg, lnc=lnc, key_block=key_block)
    return one, a, b, (ka, va), (kb, vb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_split_at_key_block_is_bit_identical(dtype):
    """Two calls split at a multiple of key_block == one call, bit for bit: KV rows and every output."""
    one, a, b, (ka, va), (kb, vb) = _split(TINY, dtype, 512, 300, 512)
    assert torch.equal(_bits(ka), _bits(kb)) and torch.equal(_bits(va), _bits(vb))
    assert torch.equal(one[:, :512], a) and torch.equal(one[:, 512:], b)
    assert torch.isfinite(one).all() and one.abs().max() > 0


def test_split_elsewhere():
    """At a multiple of 128: KV rows and the first chunk bit-identical, the second chunk within the fp32 bound;
    at 300: the first chunk still bit-identical, the rest within the bound."""
    one, a, b, (ka, va), (kb, vb) = _split(TINY, torch.float32, 384, 500, 512)
    assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(one[:, :384], a)
    scale = one.sum(0).abs().max()
    assert (one[:, 384:].sum(0) - b.sum(0)).abs().max() <= TOL[torch.float32] * scale
    one, a, b, (ka, va), (kb, vb) = _split(TINY, torch.float32, 300, 500, 512)
    assert torch.equal(one[:, :300], a)
    assert (one[:, 300:].sum(0) - b.sum(0)).abs().max() <= TOL[torch.float32] * scale
    assert (ka - kb).abs().max() <= 1e-4 * ka[:, :800].abs().max()


@pytest.mark.slow
def test_split_real_bf16():
    one, a, b, (ka, va), (kb, vb) = _split(REAL, torch.bfloat16, 1024, 384, 1024)
    assert torch.equal(_bits(ka), _bits(kb)) and torch.equal(_bits(va), _bits(vb))
    assert torch.equal(one[:, :1024], a) and torch.equal(one[:, 1024:], b)


# ---- static anchor: the l-check and the replay -------------------------------------------------------------
def _replay_trips(tr):
    """Trip counts of the replay loop per core (the fori_loop on the replay register)."""
    src, first = inspect.getsourcelines(pf._replay_if_needed)
    line = first + next(i for i, s in enumerate(src) if 'rt["replay"], replay' in s)
    trips = {}
    for lp in tr.loops:
        if lp["loc"].endswith(f"attention_prefill.py:{line}"):
            trips[lp["inst"]] = lp["trips"]
    return trips


SPIKE_ROW = 700


def _spiked(name, dtype, N, start, lnc, amp, key_block=512, one_head=False):
    """A repeated-token chunk (every query of a head points the same way, up to RoPE on R of D dims) and cache
    row SPIKE_ROW = amp * the direction of query head 1 (core 1 at LNC=2): a late logit spike of about amp above
    the keys of the chunk. With one_head, head 0's query weights are head 1's negated, so head 0 sees a large
    negative logit there instead (core 0 never freezes). Returns (the _case tuple, replay trips per core, the
    largest (spike logit - anchor) of head 1 over the chunk's rows, the anchor being the max of the row's
    diagonal block as the kernel takes it)."""
    D = preset(name).head_dim

    def edit(s):
        q = s["q_proj"].clone().reshape(s["num_heads"], 2, D, -1)
        if one_head:
            q[0, 0] = -q[1, 0]
        s["q_proj"] = q.reshape(s["q_proj"].shape)
        return s
    cfg, sh = _shard(name, dtype, 1, edit)
    seen = {}

    def inputs(cfg_, dtype_, N_, start_, L_):
        x, k0, v0 = _inputs(cfg_, dtype_, N_, start_, L_)
        x[:] = x[0]
        qg = torch.nn.functional.linear(x, sh["q_proj"]).reshape(N_, sh["num_heads"], 2 * D)
        q = fn.rms_norm(qg[:, :, :D], sh["q_norm"], cfg.rms_norm_eps)
        k = fn.rms_norm(torch.nn.functional.linear(x, sh["k_proj"]).reshape(N_, 1, D), sh["k_norm"], cfg.rms_norm_eps)
        cos, sin = fn.rope_cos_sin(torch.arange(start_, start_ + N_), cfg.rotary_dim, cfg.rope_theta)
        q, k = fn.apply_partial_rope(q, cos, sin)[:, 1].float(), fn.apply_partial_rope(k, cos, sin)[:, 0].float()
        k0[0, SPIKE_ROW] = (amp * q[0] / q[0].norm()).to(dtype_)
        spike = q @ k0[0, SPIKE_ROW].float() * D ** -0.5
        chunk = q @ k.T * D ** -0.5                          # [row, chunk key]
        t = torch.arange(N_)
        k_lo = (t // 128 * 128) // key_block * key_block     # the row's diagonal block starts here (chunk-relative)
        diag = (t[None, :] <= t[:, None]) & (t[None, :] >= k_lo[:, None])
        anchor = chunk.masked_fill(~diag, -float("inf")).max(dim=1).values
        seen["margin"] = (spike - anchor).max().item()       # spike above the kernel's anchor (head 1)
        return x, k0, v0
    with nkisim.trace.capture() as tr:
        res = _case(name, dtype, N, start, lnc, edit=edit, inputs=inputs, key_block=key_block)
    return res, _replay_trips(tr), seen["margin"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
def test_late_spike_above_tau_replays_exactly(lnc, dtype):
    """A context key whose logit is far above every row's anchor (the diagonal block's max) by more than tau:
    the static pass freezes the rows at that block, the replay runs (trip count 1 on every core) and resumes them
    with online rescaling through the rest of the context and the chunk blocks after it (N > KB); the result
    matches the exact softmax of the twin."""
    N, start = 700, 1024
    (cfg, got, stats, want, before, twin, kern), trips, margin = _spiked(TINY, dtype, N, start, lnc, 3000.0)
    assert margin > 10 * pf.static_tau(1536)
    assert trips == {c: 1 for c in range(lnc)}
    assert (stats[:, 1] == 1).all() and stats[:, 0].sum() > 0 and (stats[:, 2] == 0).all()
    _check(dtype, got, want, N, cfg.hidden_size, lnc)
    _check_caches(dtype, start, N, before, twin, kern)


def test_spike_on_one_core_replays_on_both():
    """Only core 1's head freezes; the flag is summed over the cores, so both run the replay (identical runtime
    control flow, which nkisim checks) and core 0's rows are left bit-for-bit as the static pass made them."""
    (cfg, got, stats, want, *_), trips, _ = _spiked(TINY, torch.float32, 300, 1024, 2, 3000.0, one_head=True)
    assert stats[0, 0] == 0 and stats[1, 0] > 0 and (stats[:, 1] == 1).all()
    assert trips == {0: 1, 1: 1}
    _check(torch.float32, got, want, 300, cfg.hidden_size, 2)


def test_spike_below_tau_needs_no_replay():
    """A spike of 30-60 nats above every other logit stays under tau (~70): no row freezes, no replay, exact."""
    (cfg, got, stats, want, *_), trips, margin = _spiked(TINY, torch.float32, 300, 1024, 2, 55.0)
    assert 30 < margin < pf.static_tau(1536) - 5
    assert trips == {0: 0, 1: 0}
    _no_replay(stats)
    _check(torch.float32, got, want, 300, cfg.hidden_size, 2)


# ---- non-finite input is reported ----------------------------------------------------------------------------
def test_nan_in_hidden_state_is_reported():
    """NaN in token 200's hidden state: its q, k, v are NaN, and the PE transposes of its 128-token tile (identity
    matmuls: NaN * 0 = NaN, as on the PE) spread it over the tile's q^T and K^T, so every row from the tile's
    first (128) on is non-finite -- rows of earlier tiles never see it. stats[2] counts exactly those rows per
    core; the host helper raises."""
    def inputs(cfg, dtype, N, start, L):
        x, k0, v0 = _inputs(cfg, dtype, N, start, L)
        x[200, 5] = float("nan")
        return x, k0, v0
    cfg, got, stats, *_ = _case(TINY, torch.bfloat16, 300, 0, 2, inputs=inputs, check_finite=False)
    assert stats[:, 2].tolist() == [172.0, 172.0]        # rows 128..299, one head per core (tiny: 2 per rank)
    assert torch.isfinite(got[:, :128]).all() and not torch.isfinite(got[:, 128:]).all(dim=-1).any()
    with pytest.raises(FloatingPointError, match="not finite"):
        _case(TINY, torch.bfloat16, 300, 0, 2, inputs=inputs)


def test_inf_in_visible_cache_row_is_reported():
    """+Inf in an earlier chunk's V row: every query sees it, every row is reported."""
    def inputs(cfg, dtype, N, start, L):
        x, k0, v0 = _inputs(cfg, dtype, N, start, L)
        v0[0, 10, 3] = float("inf")
        return x, k0, v0
    cfg, got, stats, *_ = _case(TINY, torch.float32, 65, 600, 1, inputs=inputs, check_finite=False)
    assert stats[0, 2] == 65 * 2
    with pytest.raises(FloatingPointError):
        _case(TINY, torch.float32, 65, 600, 1, inputs=inputs)


def _shape_only_run(kernel, args):
    """Trace one shape-only launch: (trace, peak SBUF bytes per partition, shared-HBM bytes read per argument)."""
    with nkisim.trace.capture() as tr:
        kernel(*args)
    peak = max(m["sbuf_peak_bytes_per_partition"] for m in tr.launches[0]["memory"])
    reads = {}
    for r in tr.instructions:
        if r["op"] == "dma_copy":
            for reg in r["reads"]:
                reads[reg["name"]] = reads.get(reg["name"], 0) + r["bytes"].get("shared_hbm", {}).get("read", 0)
    return tr, peak, reads


# ---- structure: weights read once, SBUF plan, static_start, refusals -------------------------------------------
def test_shape_only_real_4k_fits_and_reads_every_weight_once():
    """Shape-only trace of a 4096-token chunk at real shapes (LNC=2): fits SBUF (the planner's bound is an upper
    bound within 10% of nkisim's peak), and over the two cores every weight tensor is read exactly once (the
    decode layout, no second copy)."""
    cfg = preset(REAL)
    kernel, args = attention_prefill_launch(cfg, N=4096)
    tr, peak, reads = _shape_only_run(kernel, args)
    plan = pf.sbuf_bytes(4096, cfg.head_dim, cfg.hidden_size, 2, 2)
    assert peak <= plan <= 1.1 * peak and plan <= pf.SBUF_BUDGET
    for i in (1, 2, 3, 4):                   # wqg, wk, wv, wo
        assert reads[f"arg{i}"] == int(np.prod(args[i].shape)) * 2


def test_static_start_traces_like_a_data_launch():
    """static_start = S unrolls the context loop: the shape-only trace at S has the instruction mix of a data
    launch at start S (head block + full blocks + chunk blocks)."""
    cfg = preset(TINY)
    kernel, args = attention_prefill_launch(cfg, N=300, start=1300, dtype="float32", key_block=512)
    with nkisim.trace.capture() as shape_tr:
        kernel(*args)
    with nkisim.trace.capture() as data_tr:
        kernel(*_with_data(cfg, args, start=1300), *args[11:-1], None)
    assert shape_tr.summary() == data_tr.summary()


def _with_data(cfg, args, start):
    """The 11 tensors of an attention_prefill_launch filled with data: seeded random weights / x / caches of
    moderate scale, norm weights near 1, the RoPE rows of positions start.., the chunk start."""
    from nkisim import dtypes
    rng = np.random.default_rng(0)
    out = []
    for i, a in enumerate(args[:11]):
        if i == 10:
            out.append(np.array([[start]], np.int32))
        elif i in (6, 7):
            out.append(pf.rope_tables(start, a.shape[0], a.shape[1], cfg.rope_theta)[i - 6])
        elif i == 5:
            out.append((1.0 + 0.1 * rng.standard_normal(a.shape)).astype(np.float32))
        else:
            scale = 1.0 / np.sqrt(a.shape[0]) if 1 <= i <= 4 else 1.0     # wqg, wk, wv, wo: 1 / sqrt(fan-in)
            out.append((rng.standard_normal(a.shape, dtype=np.float32) * scale).astype(dtypes.storage(a.dtype)))
    return out


def test_refusals():
    cfg, sh = _shard(TINY, torch.float32, 0)
    lay = attention_layout(sh)
    x = torch.randn(65, cfg.hidden_size)
    kc = np.zeros((1, 256, cfg.head_dim), np.float32)
    with pytest.raises(ValueError, match="shorter than one key block"):
        pf.run_attention_prefill(lay, x, kc, kc.copy(), 0, cfg, lnc=1)
    kc = np.zeros((1, 1024, cfg.head_dim), np.float32)
    with pytest.raises(ValueError, match="key_block"):
        pf.run_attention_prefill(lay, x, kc, kc.copy(), 0, cfg, lnc=1, key_block=384)
    with pytest.raises(nkisim.OutOfBoundsError):          # rows start..start+N-1 past the cache
        pf.run_attention_prefill(lay, x, kc, kc.copy(), 1000, cfg, lnc=1)
    real = preset(REAL)
    kernel, args = attention_prefill_launch(real, N=8192)
    with pytest.raises(ValueError, match=r"prefill in chunks of at most \d+ tokens"):
        kernel(*args)
    kernel, args = attention_prefill_launch(real, N=128, dtype="float32")
    with pytest.raises(ValueError, match="launch with LNC=2 or in bfloat16"):
        pf.attention_prefill_kernel(*args)


def test_tau_below_minimum_is_refused(monkeypatch):
    cfg, sh = _shard(TINY, torch.float32, 0)
    kc = np.zeros((1, 1024, cfg.head_dim), np.float32)
    assert pf.static_tau(1024) > pf.TAU_MIN
    monkeypatch.setattr(pf, "TAU_MIN", pf.static_tau(1024) + 1.0)
    with pytest.raises(ValueError, match="tau"):
        pf.run_attention_prefill(attention_layout(sh), torch.randn(2, cfg.hidden_size), kc, kc.copy(), 0, cfg,
                                 lnc=1)


# ---- K/V rows only (attention_prefill_kv_kernel: the MTP layer over the prompt) ----------------------------------
def _kv_only(name, dtype, N, start, lnc, rank=1, edit_x=None):
    """(before, full-kernel caches, KV-kernel caches, bad [lnc, 1]) of one chunk: the same rank weights, normed
    chunk and caches through attention_prefill_kernel and attention_prefill_kv_kernel."""
    cfg, sh = _shard(name, dtype, rank)
    L = max(pf.KEY_BLOCK, -(-(start + N + 3) // 128) * 128)
    x, k0, v0 = _inputs(cfg, dtype, N, start, L)
    if edit_x is not None:
        edit_x(x)
    lay = attention_layout(sh)
    args = list(pf.kernel_args(lay, x, k0.clone(), v0.clone(), start, cfg))
    full = pf.attention_prefill_kernel[lnc] if lnc > 1 else pf.attention_prefill_kernel
    kv = pf.attention_prefill_kv_kernel[lnc] if lnc > 1 else pf.attention_prefill_kv_kernel
    _, _, kf, vf = full(*args)
    xT, _, wk, wv, _, norm_w, cos, sin, _, _, st = args[:11]
    bad, kk, vk = kv(xT, wk, wv, norm_w, cos, sin, k0.clone(), v0.clone(), st, float(cfg.rms_norm_eps))
    return (k0, v0), (torch.as_tensor(kf), torch.as_tensor(vf)), (torch.as_tensor(kk), torch.as_tensor(vk)), \
        np.asarray(bad)


@pytest.mark.parametrize("name,dtype,N,start,lnc", [
    (TINY, torch.bfloat16, 65, 0, 2), (TINY, torch.float32, 300, 700, 1), (TINY, torch.bfloat16, 129, 2500, 2),
    (REAL, torch.bfloat16, 200, 1064, 2), (REAL, torch.bfloat16, 130, 0, 1)], ids=str)
def test_kv_rows_only_equal_the_full_kernel_bit_for_bit(name, dtype, N, start, lnc):
    """The K/V-only kernel writes exactly the rows the full kernel writes (same projections, norm and RoPE
    instruction sequence per row), bit for bit, rows start..start+N-1 only; real per-rank shapes included."""
    before, full, kv, bad = _kv_only(name, dtype, N, start, lnc)
    for b, f, k in zip(before, full, kv):
        assert torch.equal(_bits(k), _bits(f))
        assert torch.equal(_bits(k[:, :start]), _bits(b[:, :start]))
        assert torch.equal(_bits(k[:, start + N:]), _bits(b[:, start + N:]))
        new = k[:, start:start + N].float()
        assert torch.isfinite(new).all() and (new != b[:, start:start + N].float()).any() and (new != 0).any()
    assert (bad == 0).all()


def test_kv_rows_only_reports_nan_input():
    """NaN in token 200's hidden state makes its K and V rows non-finite: each core counts its row (K on core 0,
    V on core 1), and the prefill executor raises on a non-zero count."""
    def poison(x):
        x[200, 5] = float("nan")
    _, _, kv, bad = _kv_only(TINY, torch.bfloat16, 300, 0, 2, edit_x=poison)
    assert bad.ravel().tolist() == [1.0, 1.0]
    assert not torch.isfinite(kv[0][:, 200].float()).all() and torch.isfinite(kv[0][:, :200].float()).all()


# ---- the fused next step (all-reduce over cores and ranks + residual add + RMSNorm in the o_proj) ----------------
def _fused_vs_stage(name, dtype, N, start, tp, lnc, norm_out, key_block=pf.KEY_BLOCK):
    """attention_prefill_kernel(residual=...) on tp ranks vs attention_prefill_kernel then
    megakernel.prefill.residual_allreduce_stage (the separate launch it replaces): (fused outputs per rank,
    stage outputs per rank, fused stats / caches, unfused stats / caches)."""
    from megakernel.prefill import residual_allreduce_stage
    from nki_kernels.rmsnorm import rmsnorm_weight_layout
    cfg = preset(name)
    H = cfg.hidden_size
    L = max(key_block, -(-(start + N) // 128) * 128)
    x, k0, v0 = _inputs(cfg, dtype, N, start, L, seed=N)
    residual = torch.randn(N, H, generator=torch.Generator().manual_seed(N + 1)).to(dtype)
    w = rmsnorm_weight_layout(torch.randn(H, generator=torch.Generator().manual_seed(5)) * 0.1)
    w_arg = w if norm_out != "none" else None
    layouts = [attention_layout(_shard(name, dtype, r)[1]) for r in range(tp)]
    kern = pf.attention_prefill_kernel[lnc] if lnc > 1 else pf.attention_prefill_kernel

    def args(r):
        return pf.kernel_args(layouts[r], x, k0.clone(), v0.clone(), start, cfg, key_block=key_block)

    plain = nkisim.launch(kern, [args(r) for r in range(tp)], tp=tp, lnc=lnc)
    stage = residual_allreduce_stage[lnc] if lnc > 1 else residual_allreduce_stage
    want = nkisim.launch(stage, [(residual, o[0], tp, True, w_arg, float(cfg.rms_norm_eps), norm_out) for o in plain],
                         tp=tp, lnc=lnc)
    got = nkisim.launch(kern, [args(r) + (residual, tp, w_arg, norm_out) for r in range(tp)], tp=tp, lnc=lnc)
    return got, want, plain, residual


@pytest.mark.parametrize("N,start,tp,lnc,norm_out", [(300, 0, 4, 2, "rows"), (129, 1000, 2, 1, "none"),
                                                     (640, 1100, 2, 2, "xT")], ids=str)
def test_fused_residual_allreduce_equals_the_separate_stage(N, start, tp, lnc, norm_out):
    """attention_prefill_kernel(residual=, tp=, next_norm_w=, norm_out=) on every rank equals the unfused kernel
    followed by residual_allreduce_stage (per-core partials), bit for bit: the new residual and its normed rows /
    xT, the stats and the K/V caches. N = 300 (tiny: 2-tile groups) gives core 0 a 2-tile group and core 1 a
    partial 1-tile one (an uneven og^T swap); 640 at start 1100 runs three pipeline steps over context blocks;
    LNC=1 one accumulation over every head."""
    got, want, plain, residual = _fused_vs_stage(TINY, torch.bfloat16, N, start, tp, lnc, norm_out)
    for r in range(tp):
        exp = want[r] if isinstance(want[r], tuple) else (want[r],)
        assert len(got[r]) == len(exp) + 3
        for a, b in zip(got[r][:len(exp)], exp):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            assert a.dtype == torch.bfloat16 and torch.isfinite(a.float()).all() and (a != 0).any()
            assert torch.equal(_bits(a), _bits(b))
        for a, b in zip(got[r][len(exp):], plain[r][1:]):            # stats, k_cache, v_cache
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    assert not torch.equal(torch.as_tensor(got[0][0]), residual)     # the attention output was added


def test_shape_only_real_4k_fused_fits():
    """Shape-only trace of the fused kernel (rows out) on a 4096-token chunk at real shapes (LNC=2, one rank, no
    collective: the same tiles): fits SBUF (the planner's bound within 10% of nkisim's peak, under the budget),
    wqg / wk / wv read once over the two cores and the o_proj weight twice (each core projects its rows over all
    of the rank's heads), the residual read once, no float32 partials written."""
    cfg = preset(REAL)
    kernel, args = attention_prefill_launch(cfg, N=4096)
    H = cfg.hidden_size
    full = tuple(args) + (nkisim.ShapeDtype((4096, H), "bfloat16"), 1, nkisim.ShapeDtype((pf.P, H // pf.P), "float32"),
                          "rows")
    tr, peak, reads = _shape_only_run(kernel, full)
    plan = pf.sbuf_bytes(4096, cfg.head_dim, H, 2, 2, fused="rows")
    assert peak <= plan <= 1.1 * peak and plan <= pf.SBUF_BUDGET
    for name, i, times in (("arg1", 1, 1), ("arg2", 2, 1), ("arg3", 3, 1), ("arg4", 4, 2), ("arg11", 14, 1)):
        assert reads[name] == times * int(np.prod(full[i].shape)) * 2          # wqg, wk, wv, wo, residual
    writes = sum(r["bytes"].get("shared_hbm", {}).get("write", 0) for r in tr.instructions if r["op"] == "dma_copy")
    assert writes == 2 * 4096 * H * 2 + 2 * 4096 * cfg.head_dim * 2 + 2 * 3 * 4    # residual, rows, K/V rows, stats
    with pytest.raises(ValueError, match="SBUF"):                   # the xT output's group tile does not fit at 4K
        kernel(*(full[:-1] + ("xT",)))
