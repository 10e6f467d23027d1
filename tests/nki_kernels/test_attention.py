"""Gated GQA attention kernel (nki_kernels/attention.py) vs its PyTorch twin (model/tp/attention.attention_rank).

Every case runs the twin and the kernel on the same rank weights, normed input and caches, and compares the
sum of the kernel's per-core partials with the twin's fp32 partial, plus the caches.

Tolerances (|kernel - twin| <= tol * max|twin|, elementwise; mean error bounded too):

* float32: tol = 1e-5, mean 2e-6. Both sides compute the same math in fp32; only summation orders differ
  (2048-term projections, up to 4096-key softmax sums and PV, 1024-term o_proj), plus where the 1/sqrt(D)
  scale is applied (exp(scale*s - m) vs softmax(scale*s)). Measured max 8.6e-7 (mean 1.6e-7) over tiny and
  real shapes; 1e-5 leaves 10x margin while one lost key (>= 1/4096 of the mass) or a dropped d-tile is
  orders of magnitude larger.
* bfloat16: tol = 1.5e-2 (2^-6), mean 2e-3. The kernel rounds the softmax probabilities to bf16 for the PV
  matmul (2^-9 relative each; the twin keeps fp32 probabilities), and a projection or normed value can land
  one bf16 ulp (2^-8) away when its fp32 accumulation order differs, which then propagates through norm,
  RoPE, softmax and the bf16 rounding of o before the 1024-term o_proj. Measured max 5.7e-3, mean <= 8.7e-4.
* KV rows: every row outside p..p+T-1 is bit-identical (never written). The new rows carry the same
  roundings as the twin's (bf16 projection, bf16 norm output, bf16 RoPE output); they may differ by one
  final ulp where the fp32 projection sum, taken in another order, straddles a rounding boundary: bf16 rows
  within 2^-7 * max|row| with >= 99% of the elements bit-identical (measured: all identical at these seeds),
  fp32 rows within 1e-4 * max|row| (a 2048-term fp32 sum in another order: worst case ~n*2^-24 = 1.2e-4
  relative, measured 3.5e-5).

Default suite: tiny shapes over T, positions and LNC, a few real per-rank shapes; the long sweep is slow.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

import nkisim
from compare import assert_close
from model import functional as fn
from model.config import preset
from model.params import expected_shapes, random_params
from model.tp.attention import attention_rank, shard_attention
from nki_kernels import attention as att

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


def _case(name, dtype, T, p, lnc, rank=0, L=None, kv_tile=att.KV_TILE, seed=1, poison=False, edit=None,
          max_context=None):
    """Run twin and kernel; returns (cfg, kernel partials [lnc, T, H], twin [T, H], caches before/after)."""
    cfg, sh = _shard(name, dtype, rank, edit)
    g = torch.Generator().manual_seed(seed)
    L = L or max(lnc * kv_tile, -(-(p + T + 3) // 128) * 128)
    D = cfg.head_dim
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    k0 = torch.randn(1, L, D, generator=g).to(dtype)
    v0 = torch.randn(1, L, D, generator=g).to(dtype)
    if poison:      # rows past the valid prefix: never read unmasked, must not leak
        k0[:, p + T:] = float("nan")
        v0[:, p + T:] = float("nan")
    kt, vt = k0.clone(), v0.clone()
    want, kt, vt = attention_rank(sh, x, kt, vt, p, cfg)
    kk, vk = k0.clone(), v0.clone()
    got = att.run_attention(att.attention_layout(sh), x, kk, vk, p, cfg, lnc=lnc, kv_tile=kv_tile,
                            max_context=max_context)
    return cfg, got, want, (k0, v0), (kt, vt), (kk, vk)


def _check(dtype, got, want, T, H, lnc):
    assert got.shape == (lnc, T, H) and got.dtype == torch.float32
    err = assert_close(got.sum(0), want, rel=TOL[dtype], mean_rel=MEAN_TOL[dtype], name="kernel vs twin")
    if lnc == 2:    # both cores contribute (their heads' o_proj columns)
        assert (got[0] != 0).any() and (got[1] != 0).any()
    return err


def _check_caches(dtype, p, T, before, twin, kern):
    for b, t, k in zip(before, twin, kern):
        # rows outside p..p+T-1: untouched, bit for bit (NaN poison included)
        assert torch.equal(k[:, :p].view(torch.int16) if dtype == torch.bfloat16 else k[:, :p],
                           b[:, :p].view(torch.int16) if dtype == torch.bfloat16 else b[:, :p])
        rest_k = k[:, p + T:].contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        rest_b = b[:, p + T:].contiguous().view(torch.int16 if dtype == torch.bfloat16 else torch.int32)
        assert torch.equal(rest_k, rest_b)
        new_k, new_t = k[:, p:p + T].float(), t[:, p:p + T].float()
        if dtype == torch.bfloat16:
            assert ((new_k - new_t).abs() <= 2 ** -7 * new_t.abs().max()).all()
            assert (new_k == new_t).float().mean() >= 0.99
        else:
            assert ((new_k - new_t).abs() <= 1e-4 * new_t.abs().max()).all()


# ---- tiny shapes: positions x T x LNC x dtype ---------------------------------------------------------------
TINY_CASES = [(1, 0), (2, 1), (4, 127), (2, 128), (3, 129), (1, 600), (2, 1100), (4, 2700)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T,p", TINY_CASES)
def test_tiny_parity(T, p, lnc, dtype):
    cfg, got, want, before, twin, kern = _case(TINY, dtype, T, p, lnc, rank=2)
    _check(dtype, got, want, T, cfg.hidden_size, lnc)
    _check_caches(dtype, p, T, before, twin, kern)


POSITIONS = [0, 1, 127, 128, 129, 511, 512, 513, 1023, 1024, 1536, 4096]


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("p", POSITIONS)
def test_positions_and_uniform_runtime_loops(p, T, lnc):
    """Parity at the tile-boundary positions, and the runtime loops each core ran: the seven loops of the KV
    tiling with the trip counts of ``tile_loop_trips(p)`` on EVERY core (LNC=2: both cores run the same
    runtime loops, lnc.rst; nkisim also refuses a launch whose cores differ)."""
    with nkisim.trace.capture() as tr:
        cfg, got, want, before, twin, kern = _case(TINY, torch.float32, T, p, lnc, rank=p % 4)
    _check(torch.float32, got, want, T, cfg.hidden_size, lnc)
    _check_caches(torch.float32, p, T, before, twin, kern)
    for core in range(lnc):
        trips = tuple(lp["trips"] for lp in tr.loops if lp["inst"] == core)
        assert trips == att.tile_loop_trips(p, n_cores=lnc), f"core {core}: {trips}"


@pytest.mark.parametrize("lnc", [1, 2])
def test_tile_loop_trips_cover_every_tile_once(lnc):
    """The seven runtime loops' trip counts (host statement of the on-chip registers) for 0..11 full rank tiles:
    the head tile iff r > 0; the lone tile, the first-two body, the pairs and the odd tail load n tiles in all;
    exactly one of the lone tile / odd tail / even tail finishes the last tile when n >= 1."""
    S = lnc * att.KV_TILE
    for n in range(12):
        for r in (0, 1, S - 1):
            head0, head, one, two, pairs, odd, even = att.tile_loop_trips(n * S + r, lnc)
            assert head0 == int(r > 0 and n == 0) and head == int(r > 0 and n >= 1)
            assert one + 2 * two + 2 * pairs + odd == n, (n, r)
            assert one + odd + even == int(n >= 1) and one + two <= 1, (n, r)


@pytest.mark.parametrize("T,p,kv_tile", [(2, 300, 128), (4, 256, 128), (1, 383, 128), (3, 1021, 256)])
def test_tiny_small_tiles(T, p, kv_tile):
    """Smaller KV tiles: head tile + several runtime-loop iterations, tile boundaries at p."""
    cfg, got, want, before, twin, kern = _case(TINY, torch.float32, T, p, 2, kv_tile=kv_tile)
    _check(torch.float32, got, want, T, cfg.hidden_size, 2)
    _check_caches(torch.float32, p, T, before, twin, kern)


@pytest.mark.parametrize("lnc", [1, 2])
def test_tiny_32k_context(lnc):
    """A 32K-token cache (31 full rank tiles + the head tiles + the new block at LNC=2), both LNC degrees."""
    with nkisim.trace.capture() as tr:
        cfg, got, want, before, twin, kern = _case(TINY, torch.bfloat16, 2, 32_700, lnc, L=32_768)
    _check(torch.bfloat16, got, want, 2, cfg.hidden_size, lnc)
    _check_caches(torch.bfloat16, 32_700, 2, before, twin, kern)
    for core in range(lnc):
        assert tuple(lp["trips"] for lp in tr.loops if lp["inst"] == core) == att.tile_loop_trips(32_700, lnc)


def test_positions_past_the_cache_fault():
    """p + T > L: the run-time cache write is out of bounds and the DMA faults (oob_mode=error)."""
    cfg, sh = _shard(TINY, torch.float32, 0)
    kc = np.zeros((1, 512, cfg.head_dim), np.float32)
    with pytest.raises(nkisim.OutOfBoundsError):
        att.run_attention(att.attention_layout(sh), torch.randn(2, cfg.hidden_size), kc, kc.copy(), 511, cfg, lnc=1)


@pytest.mark.parametrize("p", [0, 5, 700])
def test_poisoned_rows_beyond_prefix(p):
    """NaN in every cache row >= p+T (the head tile reads some of them when p < kv_tile): output finite and
    correct, the NaN rows untouched."""
    dtype = torch.bfloat16
    cfg, got, want, before, twin, kern = _case(TINY, dtype, 2, p, 2, poison=True, L=1024)
    _check(dtype, got, want, 2, cfg.hidden_size, 2)
    _check_caches(dtype, p, 2, before, twin, kern)


# ---- real per-rank shapes (H 2048, 4 query heads, 1 KV head, D 256) -------------------------------------------
@pytest.mark.parametrize("dtype,T,p,lnc,rank", [
    (torch.bfloat16, 2, 129, 2, 2),
    (torch.float32, 1, 0, 2, 0),
    (torch.bfloat16, 4, 128, 1, 3),
    (torch.float32, 4, 4096, 2, 1),
])
def test_real_parity(dtype, T, p, lnc, rank):
    cfg, got, want, before, twin, kern = _case(REAL, dtype, T, p, lnc, rank=rank)
    _check(dtype, got, want, T, cfg.hidden_size, lnc)
    _check_caches(dtype, p, T, before, twin, kern)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("p", [0, 1, 127, 128, 129, 511, 512, 513, 1023, 4096])
def test_real_sweep(p, T, lnc, dtype):
    cfg, got, want, before, twin, kern = _case(REAL, dtype, T, p, lnc, rank=p % 4)
    _check(dtype, got, want, T, cfg.hidden_size, lnc)
    _check_caches(dtype, p, T, before, twin, kern)


@pytest.mark.slow
@pytest.mark.parametrize("lnc", [1, 2])
def test_real_32k_context(lnc):
    cfg, got, want, before, twin, kern = _case(REAL, torch.bfloat16, 2, 32_700, lnc, L=32_768)
    _check(torch.bfloat16, got, want, 2, cfg.hidden_size, lnc)
    _check_caches(torch.bfloat16, 32_700, 2, before, twin, kern)


def test_split_k_both_dtiles_accumulated():
    """kernel-algorithms §6 item 10: with the query confined to one 128-dim half (the other half's q weights
    zeroed), the scores come from one d-tile only; parity in both cases proves both d-tiles of the split-K
    QK^T are accumulated, and the two results differ (each half matters)."""
    outs = []
    for half in (0, 1):
        def edit(sh, half=half):
            q = sh["q_proj"].clone().reshape(4, 2, 256, -1)
            q[:, 0, half * 128:(half + 1) * 128] = 0        # query rows of that d-half, every head
            sh["q_proj"] = q.reshape(sh["q_proj"].shape)
            return sh
        cfg, got, want, *_ = _case(REAL, torch.float32, 2, 200, 2, edit=edit)
        _check(torch.float32, got, want, 2, cfg.hidden_size, 2)
        outs.append(want)
    assert (outs[0] - outs[1]).abs().max() > 1e-2 * outs[0].abs().max()


def test_large_logits_softmax_stability():
    """q/k norm weights x24 -> |scaled logits| in the hundreds (exp would overflow fp32 without the max)."""
    def edit(sh):
        sh["q_norm"] = sh["q_norm"] * 0 + 23.0
        sh["k_norm"] = sh["k_norm"] * 0 + 23.0
        return sh
    cfg, sh = _shard(TINY, torch.float32, 0, edit)
    q = torch.randn(3, cfg.head_dim)
    q = fn.rms_norm(q, sh["q_norm"], 1e-6)
    assert q.abs().max() * q.abs().max() / cfg.head_dim ** 0.5 > 100     # the logit scale reached
    cfg, got, want, before, twin, kern = _case(TINY, torch.float32, 3, 700, 2, edit=edit)
    _check(torch.float32, got, want, 3, cfg.hidden_size, 2)


# ---- structure: bytes read, compile-time context specialisation, demo -----------------------------------------
def _weight_reads(tr, names):
    reads = {}
    for r in tr.instructions:
        if r["op"] != "dma_copy":
            continue
        for reg in r["reads"]:
            if reg["name"] in names:
                reads[reg["name"]] = reads.get(reg["name"], 0) + r["bytes"]["shared_hbm"]["read"]
    return reads


def full_size_launch(cfg, tp=4, T=2, dtype="bfloat16", shape_only=False, context=4096):
    """(kernel, args) for one rank at the config's shapes: ``attention_kernel[2]`` at position p = context.

    Data mode: seeded random weights / caches, cache length max(2 tiles, ceil((context + T) / KV_TILE) tiles),
    the general kernel (run-time loops). Shape-only: ``nkisim.ShapeDtype`` arguments and ``max_context =
    context``, so the trace holds the tiles a launch at p = context runs."""
    H, D, R, P = cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, att.P
    assert cfg.num_attention_heads % tp == 0 and tp % cfg.num_key_value_heads == 0
    hq = cfg.num_attention_heads // tp
    L = max(2 * att.KV_TILE, -(-(context + T) // att.KV_TILE) * att.KV_TILE)   # LNC=2: a KV tile per core at least
    shapes = {"xT": ((P, H // P, T), dtype), "wqg": ((H, 2, hq, D), dtype), "wk": ((H, D), dtype),
              "wv": ((H, D), dtype), "wo": ((hq * D, H), dtype), "norm_w": ((2, D), "float32"),
              "cos": ((T, R), "float32"), "sin": ((T, R), "float32"), "k_cache": ((1, L, D), dtype),
              "v_cache": ((1, L, D), dtype), "pos": ((1, 1), "int32")}
    eps = float(cfg.rms_norm_eps)
    if shape_only:
        return att.attention_kernel[2], tuple(nkisim.ShapeDtype(*v) for v in shapes.values()) + (eps, att.KV_TILE,
                                                                                                 context)
    from nkisim import dtypes
    st = dtypes.storage(dtype)
    rng = np.random.default_rng(0)
    arrs = {}
    for k, (shp, dt) in shapes.items():
        if k == "pos":
            arrs[k] = np.array([[context]], np.int32)
        elif k in ("cos", "sin"):
            arrs["cos"], arrs["sin"] = att.rope_tables(context, T, R, cfg.rope_theta)
        elif k == "norm_w":
            arrs[k] = (1.0 + 0.1 * rng.standard_normal(shp)).astype(np.float32)
        else:
            scale = 1.0 / np.sqrt(shp[0]) if k.startswith("w") else 1.0
            arrs[k] = (rng.standard_normal(shp, dtype=np.float32) * scale).astype(st)
    return att.attention_kernel[2], tuple(arrs[k] for k in shapes) + (eps, att.KV_TILE, None)


@pytest.mark.parametrize("T,lnc,context", [(1, 2, 2048), (4, 2, 1536), (4, 1, 1536)])
def test_every_weight_byte_read_once(T, lnc, context):
    """Shape-only trace at real shapes: over the launch (both cores) each weight tensor is read exactly once,
    whatever T. The cores split every rank tile of S = lnc * kv_tile cache rows, so the cache rows below p are
    read once when S divides p; otherwise the head tiles (one B-row tile per core, masked at r = p mod S) read
    S rows for the r head rows: S * ceil(p / S) rows in all."""
    cfg = preset(REAL)
    kernel, args = full_size_launch(cfg, T=T, shape_only=True, context=context)
    if lnc == 1:
        kernel = att.attention_kernel
    with nkisim.trace.capture() as tr:
        kernel(*args)
    names = {f"arg{i}": a for i, a in enumerate(args[:11])}
    reads = _weight_reads(tr, set(names))
    for i, nm in ((1, "wqg"), (2, "wk"), (3, "wv"), (4, "wo"), (5, "norm_w")):
        a = args[i]
        nbytes = int(np.prod(a.shape)) * (4 if a.dtype == "float32" else 2)
        want = nbytes if nm != "norm_w" else None
        if want is not None:
            assert reads[f"arg{i}"] == want, f"{nm}: read {reads[f'arg{i}']} B, holds {want} B"
    row = cfg.head_dim * 2
    S = lnc * att.KV_TILE
    assert reads["arg8"] == reads["arg9"] == -(-context // S) * S * row


def test_max_context_specialisation_matches_and_traces_like_data_run():
    """max_context = N: same results as the general kernel for p in N's tile bucket, and the shape-only trace
    of the specialised kernel has the instruction mix of a data launch at p = N."""
    for p in (700, 1000):      # bucket of N = 900 with kv_tile 512: one full tile + a head tile
        cfg, got, want, *_ = _case(TINY, torch.float32, 2, p, 2, max_context=900)
        _check(torch.float32, got, want, 2, cfg.hidden_size, 2)
    cfg = preset(TINY)
    kernel, args = full_size_launch(cfg, tp=4, T=2, shape_only=False, context=900, dtype="float32")
    with nkisim.trace.capture() as data_tr:
        kernel(*args)
    kernel, args = full_size_launch(cfg, tp=4, T=2, shape_only=True, context=900, dtype="float32")
    with nkisim.trace.capture() as shape_tr:
        kernel(*args)
    assert shape_tr.summary() == data_tr.summary()


def test_real_shape_only_trace_fits_sbuf():
    cfg = preset(REAL)
    kernel, args = full_size_launch(cfg, T=2, shape_only=True, context=4096)
    with nkisim.trace.capture() as tr:
        kernel(*args)
    s = tr.summary()
    assert s[("DMA", "sendrecv")] == 4 and s[("PE", "nc_matmul")] > 0     # two exchanges per core
    mem = tr.launches[0]["memory"]
    assert all(m["sbuf_peak_bytes_per_partition"] < 212_984 for m in mem)


# ---- host helpers and argument checks --------------------------------------------------------------------------
def test_rope_tables_match_functional():
    for cfg in (preset(TINY), preset(REAL)):
        c, s = att.rope_tables(4093, 4, cfg.rotary_dim, cfg.rope_theta)
        c2, s2 = fn.rope_cos_sin(torch.arange(4093, 4097), cfg.rotary_dim, cfg.rope_theta)
        # same fp32 angles; numpy's and torch's fp32 cos/sin may differ in the last bit
        np.testing.assert_allclose(c, c2.numpy(), rtol=0, atol=2.5e-7)
        np.testing.assert_allclose(s, s2.numpy(), rtol=0, atol=2.5e-7)


def test_layout_deinterleaves_query_and_gate():
    cfg, sh = _shard(TINY, torch.float32, 1)
    lay = att.attention_layout(sh)
    D, hq = cfg.head_dim, sh["num_heads"]
    q = sh["q_proj"].numpy()
    for h in range(hq):
        np.testing.assert_array_equal(lay["wqg"][:, 0, h, :], q[h * 2 * D:h * 2 * D + D].T)
        np.testing.assert_array_equal(lay["wqg"][:, 1, h, :], q[h * 2 * D + D:(h + 1) * 2 * D].T)
    np.testing.assert_array_equal(lay["wo"], sh["o_proj"].numpy().T)
    np.testing.assert_allclose(lay["norm_w"][0], 1 + sh["q_norm"].numpy())


def test_argument_errors():
    cfg, sh = _shard(TINY, torch.float32, 0)
    lay = att.attention_layout(sh)
    x = torch.randn(2, cfg.hidden_size)
    kc = np.zeros((1, 256, cfg.head_dim), np.float32)
    with pytest.raises(ValueError, match="shorter than one KV tile"):
        att.run_attention(lay, x, kc, kc.copy(), 0, cfg, lnc=1)
    kc = np.zeros((1, 512, cfg.head_dim), np.float32)
    with pytest.raises(ValueError, match="kv_tile"):
        att.run_attention(lay, x, kc, kc.copy(), 0, cfg, lnc=1, kv_tile=384)
    with pytest.raises(ValueError, match="1..4"):
        att.run_attention(lay, torch.randn(5, cfg.hidden_size), kc, kc.copy(), 0, cfg, lnc=1)
    bad = dict(lay, norm_w=lay["norm_w"].to(torch.float16))
    with pytest.raises(ValueError, match="norm_w"):
        att.run_attention(bad, x, kc, kc.copy(), 0, cfg, lnc=1)
    with pytest.raises(ValueError, match="one KV head"):
        att.attention_layout(dict(sh, num_kv_heads=2))


def test_body_reuses_caller_registers():
    """A megakernel composing many attention layers passes the same registers to every body call (64 per
    engine sequencer): eight calls in one launch with ATTENTION_REGISTERS registers give eight correct
    partials and allocate nothing more."""
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def eight(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps):
        out = nl.ndarray((8, xT.shape[2], xT.shape[0] * xT.shape[1]), nl.float32, buffer=nl.shared_hbm)
        xs = nl.ndarray(xT.shape, xT.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=xT)
        regs = []
        for _ in range(att.ATTENTION_REGISTERS):
            regs.append(nisa.register_alloc())
        for i in range(8):
            y = att.attention_body(xs, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps,
                                   regs=tuple(regs))
            nisa.dma_copy(dst=out[i], src=y)
        return out

    cfg, sh = _shard(TINY, torch.float32, 0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, cfg.hidden_size, generator=g)
    kc, vc = torch.randn(1, 512, cfg.head_dim, generator=g), torch.randn(1, 512, cfg.head_dim, generator=g)
    want = attention_rank(sh, x, kc.clone(), vc.clone(), 40, cfg)[0]
    args = att.kernel_args(att.attention_layout(sh), x, kc.numpy(), vc.numpy(), 40, cfg)[:12]
    got = eight(*args)
    for i in range(8):
        assert_close(got[i], want, rel=1e-5, name=f"launch {i} vs twin")


@pytest.mark.parametrize("slots,lnc", [(6, 2), (8, 1)])
def test_early_ring_same_bits(slots, lnc):
    """attention_ring (the megakernel's early-issued projection ring; real shapes: 8 chunks of 2 input tiles)
    gives the body's own 3-slot ring's outputs bit for bit: the same DMAs and matmuls in another order."""
    cfg, sh = _shard(REAL, torch.bfloat16, 1)
    lay = att.attention_layout(sh)
    g = torch.Generator().manual_seed(7)
    T, p, L, D = 2, 300, 1024, cfg.head_dim
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    k0 = torch.randn(1, L, D, generator=g).to(torch.bfloat16)
    v0 = torch.randn(1, L, D, generator=g).to(torch.bfloat16)
    kernel = att.attention_kernel if lnc == 1 else att.attention_kernel[lnc]
    outs = []
    for rs in (0, slots):
        kc, vc = k0.clone(), v0.clone()
        args = att.kernel_args(lay, x, kc, vc, p, cfg)
        out, _, _ = kernel(*args, rs)
        outs.append((torch.as_tensor(out), kc, vc))
    (a, ka, va), (b, kb, vb) = outs
    assert torch.isfinite(a).all() and (a != 0).any()
    assert torch.equal(a, b) and torch.equal(ka.view(torch.int16), kb.view(torch.int16)) \
        and torch.equal(va.view(torch.int16), vb.view(torch.int16))


def _kv_rows_kernel():
    """An @nki.jit wrapper of attention_kv_rows: HBM in (the attention_kernel arguments), the caches out."""
    import nki
    import nki.isa as nisa
    import nki.language as nl
    from nki_kernels.common import program_sharding

    @nki.jit
    def kv_rows(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps):
        n_cores, core = program_sharding()
        xs = nl.ndarray(xT.shape, xT.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xs, src=xT)
        att.attention_kv_rows(xs, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=core,
                              n_cores=n_cores)
        return k_cache, v_cache
    return kv_rows


@pytest.mark.parametrize("name,dtype,T,p,lnc", [(TINY, torch.float32, 2, 130, 1), (TINY, torch.bfloat16, 3, 600, 2),
                                                (REAL, torch.bfloat16, 2, 300, 2), (REAL, torch.bfloat16, 1, 0, 1)])
def test_kv_rows_equal_the_body_rows(name, dtype, T, p, lnc):
    """attention_kv_rows (the round's MTP replay) writes exactly the K / V rows attention_body writes, bit for bit,
    and nothing else of the caches."""
    cfg, sh = _shard(name, dtype, 1)
    lay = att.attention_layout(sh)
    g = torch.Generator().manual_seed(11)
    L, D = max(lnc * att.KV_TILE, 1024), cfg.head_dim
    x = torch.randn(T, cfg.hidden_size, generator=g).to(dtype)
    k0 = torch.randn(1, L, D, generator=g).to(dtype)
    v0 = torch.randn(1, L, D, generator=g).to(dtype)
    full, rows = att.attention_kernel if lnc == 1 else att.attention_kernel[lnc], _kv_rows_kernel()
    rows = rows if lnc == 1 else rows[lnc]
    kb, vb = k0.clone(), v0.clone()
    full(*att.kernel_args(lay, x, kb, vb, p, cfg))
    kr, vr = k0.clone(), v0.clone()
    rows(*att.kernel_args(lay, x, kr, vr, p, cfg)[:12])
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    for want, got, before in ((kb, kr, k0), (vb, vr, v0)):
        new = got[:, p:p + T].float()
        assert torch.isfinite(new).all() and (new != 0).any()
        assert not torch.equal(got[:, p:p + T], before[:, p:p + T])
        assert torch.equal(got.view(bits), want.view(bits))
