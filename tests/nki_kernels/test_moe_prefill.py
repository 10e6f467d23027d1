"""nki_kernels/moe_prefill.py (the MoE prefill of a chunk of N tokens) against the PyTorch twin
model/tp/moe.py (``moe_rank``, which evaluates each selected expert once on all of its tokens), under nkisim.

The kernel returns the rank's partial y [N, H] float32 (each core writes its token tiles' rows in full) and a
finite flag per core. Tolerances (max |kernel - twin| over the output, relative to max |twin|):

* float32: 1e-5. Both sides compute in fp32 and differ only in summation order (PSUM accumulation of the
  gate/up contraction split over the two cores' h-halves and 128-row blocks, the 128-long down contraction,
  the fp32 sum of <= k + 1 contributions): ~sqrt(2048) * 2^-24 relative at worst; observed <= 6e-7.
* bfloat16: 1e-2. The kernel rounds at exactly the twin's points (gate x and up x, h = silu(g) * u, each
  rank's down projection per expert, the routing weights); the fp32 sums before each rounding run in another
  order, so a rounded value occasionally lands one bf16 ulp (2^-8 relative) away, on <= 4 roundings per
  expert contribution: observed <= 2e-3 at the real shapes, <= 1e-4 at the tiny ones. Routing is exact in
  both dtypes (same bf16-rounded logits, fp32 softmax, lower index on ties; the crafted-tie tests check it).

Every parity check also asserts the output is finite and not all zero, and counts the routed-expert weight
bytes the trace actually moved: exactly one expert block (both cores' halves) per DISTINCT selected expert --
each used expert read once per chunk, unused ones never.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nki
import nki.language as nl
import nkisim
from compare import assert_close
from harness.kernel_cases import moe_prefill_launch
from model.config import preset
from model.params import random_params
from model.tp.moe import distinct_experts, moe_rank, route_tokens, shard_moe
from nki_kernels.moe import expert_block_bytes, moe_hbm_layout
from nki_kernels.moe_prefill import (P, check_finite, default_capacity, moe_prefill, moe_prefill_body,
                                     routed_expert_bytes, table_rows, token_rows)

PREFIX = "model.layers.1"
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def run_kernel(shard, x, top_k, lnc, capacity=None, layout=None):
    """(y [N, H] f32 torch, finite flags, routed-expert bytes moved)."""
    L = layout if layout is not None else moe_hbm_layout(shard, lnc)
    kernel = moe_prefill[lnc] if lnc == 2 else moe_prefill
    with nkisim.trace.capture() as tr:
        y, fin = kernel(token_rows(x), L["router"], L["experts"], L["shared"], top_k, capacity)
    y = torch.as_tensor(np.asarray(y))
    assert y.shape == x.shape and y.dtype == torch.float32
    return y, torch.as_tensor(np.asarray(fin)), routed_expert_bytes(tr)


def check_close(got, ref, dtype):
    return assert_close(got, ref, rel=TOL[dtype], name="kernel vs twin")


def block_bytes(cfg, tp, dtype):
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp) * (2 if dtype == torch.bfloat16 else 4)


def check_parity(shard, x, cfg, tp, lnc, dtype, capacity=None):
    """Kernel vs twin, finite flags, and the read-once bound; returns the distinct selected experts."""
    k = cfg.num_experts_per_tok
    got, fin, nbytes = run_kernel(shard, x, k, lnc, capacity)
    check_close(got, moe_rank(shard, x, k), dtype)
    assert bool((fin == 1.0).all())
    used = distinct_experts(shard, x, k)
    assert nbytes == len(used) * block_bytes(cfg, tp, dtype), (nbytes, len(used))
    return used


# ---------------------------------------------------------------------------------------------
# tiny shapes (cfg "tiny": H 128, 16 experts, top-4, I 64)
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_params():
    cfg = preset("tiny")
    return {dt: random_params(cfg, seed=3, dtype=dt) for dt in (torch.float32, torch.bfloat16)}


def tiny_x(cfg, N, seed, dtype):
    return torch.randn(N, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


# chunk lengths around the 16-row slot granularity and the 128-token tiles, each with a different
# (LNC, TP, dtype): LNC=2 at TP=4 splits the single 128-row h-block into two 64-partition halves; at LNC=2, 512
# swaps the routing results of its two full pairs in one packed sendrecv, 129 its one partial pair alone, and 400
# both (one full pair packed, then the partial pair)
LENGTHS = [(1, 2, 4, torch.bfloat16), (63, 2, 2, torch.float32), (64, 1, 4, torch.bfloat16),
           (65, 2, 1, torch.bfloat16), (127, 1, 2, torch.float32), (128, 2, 4, torch.float32),
           (129, 2, 2, torch.bfloat16), (400, 2, 2, torch.float32), (512, 2, 4, torch.bfloat16)]


@pytest.mark.parametrize("N,lnc,tp,dtype", LENGTHS, ids=[f"N{n}-lnc{l}-tp{t}-{str(d)[6:]}" for n, l, t, d in LENGTHS])
def test_tiny_lengths(tiny_params, N, lnc, tp, dtype):
    cfg = preset("tiny")
    shard = shard_moe(tiny_params[dtype], PREFIX, cfg, tp - 1, tp)
    check_parity(shard, tiny_x(cfg, N, seed=N, dtype=dtype), cfg, tp, lnc, dtype)


@pytest.mark.parametrize("lnc,N,cap", [(1, 300, 16), (2, 300, 16), (2, 385, 48)])
def test_tiny_heavy_experts(tiny_params, lnc, N, cap):
    """A capacity far below the expert counts: every expert takes the heavy path (the runtime loop over 128-row
    windows, weights at each expert's first window only) -- same result, each expert still read once. Every slot
    is then unused and gathers the table's spare rows; at 385 tokens the two cores' placements of a heavy expert
    overlap in its own rows with sums beyond the token range (an unused slot reading them would gather out of
    bounds)."""
    cfg = preset("tiny")
    assert table_rows(N, cfg.num_experts, cfg.num_experts_per_tok, cap)[1] > 0
    shard = shard_moe(tiny_params[torch.bfloat16], PREFIX, cfg, 1, 2)
    used = check_parity(shard, tiny_x(cfg, N, seed=5, dtype=torch.bfloat16), cfg, 2, lnc, torch.bfloat16, cap)
    assert len(used) == cfg.num_experts


def test_tiny_every_expert_active_regular(tiny_params):
    """Random routing of 256 tokens over 16 experts: every expert active, every one regular (count <= capacity),
    so all 16 slots are used and the heavy loop runs 0 times."""
    cfg = preset("tiny")
    N = 256
    shard = shard_moe(tiny_params[torch.float32], PREFIX, cfg, 0, 2)
    x = tiny_x(cfg, N, seed=9, dtype=torch.float32)
    counts = torch.bincount(route_tokens(shard, x, cfg.num_experts_per_tok)[1].reshape(-1), minlength=16)
    assert bool((counts > 0).all()) and int(counts.max()) <= default_capacity(N, 16, cfg.num_experts_per_tok)
    check_parity(shard, x, cfg, 2, 2, torch.float32)


def test_tiny_all_tokens_same_experts(tiny_params):
    """Identical tokens choose the same k experts: k blocks read, not more; with N > capacity those k experts are
    heavy (the runtime loop) while the other slots are unused (their weight DMAs skipped)."""
    cfg = preset("tiny")
    N = 200
    shard = shard_moe(tiny_params[torch.bfloat16], PREFIX, cfg, 1, 2)
    x = tiny_x(cfg, 1, seed=7, dtype=torch.bfloat16).repeat(N, 1)
    used = check_parity(shard, x, cfg, 2, 2, torch.bfloat16)
    assert len(used) == cfg.num_experts_per_tok and N > default_capacity(N, 16, cfg.num_experts_per_tok)


def designed_logits(shard, x, columns):
    """logits[t, e] = columns[t % len(columns)][e] EXACTLY: router column c holds pattern c's logits, every other
    router entry 0, and x[t, :len(columns)] = one-hot(t % len(columns))."""
    C = len(columns)
    router = torch.zeros_like(shard["router"])
    x = x.clone()
    x[:, :C] = 0
    for t in range(x.shape[0]):
        x[t, t % C] = 1
    for c in range(C):
        router[:, c] = torch.as_tensor(columns[c], dtype=torch.float32).to(router.dtype)
    return dict(shard, router=router), x


def tie_columns(E, k):
    """Pattern 0: k - 3 clear winners, then 6 tied experts for the last 3 seats; pattern 1: all tied (the k lowest
    indices win)."""
    v = np.full(E, -1.0)
    for i, e in enumerate([E - 1, 3, E // 2, 1, 7][:k - 3]):
        v[e] = 4.0 - 0.5 * i
    for e in (E - 2, 5, 2, E // 2 + 1, 0, 6):
        v[e] = 1.0
    return [v, np.full(E, 0.5)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_router_ties(tiny_params, dtype):
    """Exact ties straddling the top-k boundary, 70 tokens alternating the two patterns (ties inside and across
    the token tiles): the lower expert index wins, as in the twin and the decode kernel."""
    cfg = preset("tiny")
    k, E = cfg.num_experts_per_tok, cfg.num_experts
    shard = shard_moe(tiny_params[dtype], PREFIX, cfg, 1, 2)
    shard, x = designed_logits(shard, tiny_x(cfg, 70, seed=2, dtype=dtype), tie_columns(E, k))
    chosen = [set(r) for r in route_tokens(shard, x, k)[1].tolist()]
    assert chosen[1] == set(range(k)) and {0, 2}.issubset(chosen[0]) and E - 2 not in chosen[0]
    check_parity(shard, x, cfg, 2, 2, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_tiny_non_finite_input_is_reported(tiny_params, bad):
    cfg = preset("tiny")
    shard = shard_moe(tiny_params[torch.float32], PREFIX, cfg, 0, 2)
    x = tiny_x(cfg, 40, seed=4, dtype=torch.float32)
    x[17, 33] = bad
    _, fin, _ = run_kernel(shard, x, cfg.num_experts_per_tok, 2)
    assert bool((fin == 0.0).any())
    with pytest.raises(FloatingPointError, match="non-finite"):
        check_finite(fin)
    x[17, 33] = 0.0
    _, fin, _ = run_kernel(shard, x, cfg.num_experts_per_tok, 2)
    check_finite(fin)


@nki.jit
def stacked_prefill(x, router, experts, shared, top_k, layer):
    """The body as a composed kernel uses it: a stacked weight group, the layer picked by index."""
    H = router.shape[3] * P
    N = x.shape[0] * P // H
    y = nl.ndarray((N, H), dtype=nl.float32, buffer=nl.shared_hbm)
    moe_prefill_body(x, router, experts, shared, top_k, y, layer=layer)
    return y


def test_stacked_layers(tiny_params):
    """With [G, ...] stacked weights the run-time expert DMAs address layer ``layer``'s table."""
    cfg = preset("tiny")
    k = cfg.num_experts_per_tok
    params = random_params(cfg, seed=9, dtype=torch.float32)
    shards = [shard_moe(params, f"model.layers.{i}", cfg, 1, 2) for i in (0, 1)]
    layouts = [moe_hbm_layout(sh, 2) for sh in shards]
    stack = {n: torch.stack([L[n] for L in layouts]) for n in ("router", "experts", "shared")}
    x = tiny_x(cfg, 50, seed=4, dtype=torch.float32)
    for layer in (1, 0):
        y = stacked_prefill[2](token_rows(x), stack["router"], stack["experts"], stack["shared"], k, layer)
        check_close(torch.as_tensor(np.asarray(y)), moe_rank(shards[layer], x, k), torch.float32)


def test_refuses_bad_arguments(tiny_params):
    cfg = preset("tiny")
    shard = shard_moe(tiny_params[torch.float32], PREFIX, cfg, 0, 4)
    L = moe_hbm_layout(shard, 2)
    x = tiny_x(cfg, 8, seed=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="LNC=1"):
        moe_prefill(token_rows(x), L["router"], L["experts"], L["shared"], cfg.num_experts_per_tok)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_prefill[2](token_rows(x).to(torch.bfloat16), L["router"], L["experts"], L["shared"],
                       cfg.num_experts_per_tok)
    with pytest.raises(ValueError, match="capacity"):
        moe_prefill[2](token_rows(x), L["router"], L["experts"], L["shared"], cfg.num_experts_per_tok, 400)


def test_capacity_and_tables():
    """The default capacity at the real shapes, and the table bounds: no heavy windows when cap >= N."""
    assert [default_capacity(n, 256, 8) for n in (1, 64, 512, 1024, 2048, 4096)] == [16, 16, 48, 64, 112, 176]
    assert table_rows(32, 256, 8, 32)[1] == 0
    S, nhw, hb, rows = table_rows(4096, 256, 8, 176)
    assert S == 256 and hb == 256 * 176 and nhw == 32768 // 128 + 32768 // 177 and rows * 2048 < 2 ** 31


# ---------------------------------------------------------------------------------------------
# real per-rank shapes (Qwen3.6-35B-A3B at TP=4: 256 experts, intermediate slice 128, hidden 2048)
# ---------------------------------------------------------------------------------------------

def real_shard(dtype, seed=0):
    """One rank's MoE weights at the real shapes, every expert random (random tokens use nearly all of them)."""
    cfg = preset("qwen3.6-35b-a3b")
    tp = 4
    E, H = cfg.num_experts, cfg.hidden_size
    Ir = cfg.moe_intermediate_size // tp
    g = torch.Generator().manual_seed(seed)

    def rnd(*s, fan):
        return (torch.randn(*s, generator=g) * fan ** -0.5).to(dtype)
    return cfg, {"router": rnd(E, H, fan=H), "shared_expert_gate": rnd(1, H, fan=H),
                 "gate": rnd(E, Ir, H, fan=H), "up": rnd(E, Ir, H, fan=H),
                 "down": rnd(E, H, Ir, fan=cfg.moe_intermediate_size),
                 "shared_gate": rnd(Ir, H, fan=H), "shared_up": rnd(Ir, H, fan=H),
                 "shared_down": rnd(H, Ir, fan=cfg.shared_expert_intermediate_size)}


@pytest.fixture(scope="module")
def real_bf16():
    return real_shard(torch.bfloat16)


def real_x(cfg, N, seed, dtype):
    return torch.randn(N, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_real_bf16_lnc2(real_bf16):
    """The deployed shapes, 129 tokens (a partial second token tile): nearly every expert active."""
    cfg, shard = real_bf16
    used = check_parity(shard, real_x(cfg, 129, seed=1, dtype=torch.bfloat16), cfg, 4, 2, torch.bfloat16)
    assert len(used) > 200


def test_real_bf16_lnc1(real_bf16):
    """LNC=1: one core takes all 16 h-blocks and all output columns."""
    cfg, shard = real_bf16
    check_parity(shard, real_x(cfg, 64, seed=2, dtype=torch.bfloat16), cfg, 4, 1, torch.bfloat16)


def test_real_tokens_choosing_the_same_experts(real_bf16):
    """Crafted router: 96 tokens all routed to the same 8 experts, one of them expert 255 (the last block of
    the table): 8 blocks read once each, the experts heavy (96 > capacity 16), every other slot skipped."""
    cfg, shard = real_bf16
    N, A = 96, [0, 9, 40, 77, 128, 199, 230, 255]
    x = real_x(cfg, N, seed=3, dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    u = torch.randn(cfg.hidden_size, generator=g)
    u /= u.norm()
    router = shard["router"].float().clone()
    router[A] += 4.0 * u
    x = (x + 8.0 * u).to(torch.bfloat16)
    shard = dict(shard, router=router.to(torch.bfloat16))
    used = check_parity(shard, x, cfg, 4, 2, torch.bfloat16)
    assert used == A


@pytest.mark.slow
def test_real_fp32_lnc2():
    cfg, shard = real_shard(torch.float32, seed=1)
    check_parity(shard, real_x(cfg, 100, seed=4, dtype=torch.float32), cfg, 4, 2, torch.float32)


@pytest.mark.slow
@pytest.mark.parametrize("N", [512, 2048])
def test_real_bf16_long(real_bf16, N):
    """Longer chunks at the real shapes (2K: all 256 experts active, capacity 112, possibly a heavy expert)."""
    cfg, shard = real_bf16
    used = check_parity(shard, real_x(cfg, N, seed=N, dtype=torch.bfloat16), cfg, 4, 2, torch.bfloat16)
    assert len(used) == cfg.num_experts


def test_demo_shape_only_trace():
    """The shape-only demo trace at 1K tokens: every slot reads one expert block (registers read 0: the
    realistic all-experts-active case) and the heavy loop runs 0 times."""
    cfg = preset("qwen3.6-35b-a3b")
    kernel, args = moe_prefill_launch(cfg, tp=4, N=1024)
    with nkisim.trace.capture() as tr:
        y, fin = kernel(*args)
    assert tuple(y.shape) == (1024, cfg.hidden_size)
    nbytes = 0
    for r in tr.instructions:
        src = [g for g in r["reads"] if g["arg"] == "src"]
        if r["op"] == "dma_copy" and src and src[0].get("indirect") == "scalar" and src[0].get("name") == "arg2":
            nbytes += r["bytes"]["shared_hbm"]["read"]
    assert nbytes == cfg.num_experts * expert_block_bytes(cfg, 4)
    assert [lp["trips"] for lp in tr.loops] == [0, 0, 0, 0]    # the heavy placements and windows, each core


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_tiny_random_sweep(tiny_params, seed):
    cfg = preset("tiny")
    rng = np.random.default_rng(seed)
    for dtype in (torch.float32, torch.bfloat16):
        tp = int(rng.choice([1, 2, 4]))
        shard = shard_moe(tiny_params[dtype], PREFIX, cfg, seed % tp, tp)
        N = int(rng.integers(1, 700))
        cap = None if seed % 2 else int(rng.integers(1, 64))
        check_parity(shard, tiny_x(cfg, N, seed=100 + seed, dtype=dtype), cfg, tp, 1 + seed % 2, dtype, cap)


# ---------------------------------------------------------------------------------------------
# the fused next step (residual + all-reduce over the ranks + RMSNorm in the combine)
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("N,tp,norm_out", [(300, 2, "xT"), (129, 4, "rows"), (64, 2, "none")])
def test_fused_residual_allreduce_equals_the_separate_stage(tiny_params, N, tp, norm_out):
    """moe_prefill(residual=...) on every rank equals moe_prefill's partial y followed by
    megakernel.prefill.residual_allreduce_stage (the separate launch it replaces), bit for bit: the new residual
    and its normed rows / xT. N = 300 pipelines two tiles on core 0 and one on core 1; 129 a partial tile."""
    from megakernel.prefill import residual_allreduce_stage
    from nki_kernels.rmsnorm import rmsnorm_weight_layout
    cfg = preset("tiny")
    dtype = torch.bfloat16
    k = cfg.num_experts_per_tok
    x = tiny_x(cfg, N, seed=N, dtype=dtype)
    residual = tiny_x(cfg, N, seed=N + 1, dtype=dtype)
    w = rmsnorm_weight_layout(torch.randn(cfg.hidden_size, generator=torch.Generator().manual_seed(5)) * 0.1)
    w_arg = w if norm_out != "none" else None
    lays = [moe_hbm_layout(shard_moe(tiny_params[dtype], PREFIX, cfg, r, tp), 2) for r in range(tp)]
    ys = [moe_prefill[2](token_rows(x), L["router"], L["experts"], L["shared"], k)[0] for L in lays]
    want = nkisim.launch(residual_allreduce_stage[2], [(residual, y, tp, False, w_arg, 1e-6, norm_out) for y in ys],
                         tp=tp, lnc=2)
    got = nkisim.launch(moe_prefill[2], [(token_rows(x), L["router"], L["experts"], L["shared"], k, None, residual,
                                          tp, w_arg, 1e-6, norm_out) for L in lays], tp=tp, lnc=2)
    for r in range(tp):
        exp = want[r] if isinstance(want[r], tuple) else (want[r],)
        assert len(got[r]) == len(exp) + 1 and bool((torch.as_tensor(got[r][-1]) == 1.0).all())
        for a, b in zip(got[r][:-1], exp):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            assert a.dtype == dtype and torch.isfinite(a.float()).all() and (a != 0).any()
            assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    new_res = torch.as_tensor(got[0][0]).float()
    assert not torch.equal(new_res, residual.float())          # the MoE output was added
