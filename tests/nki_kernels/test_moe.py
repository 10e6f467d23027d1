"""nki_kernels/moe.py (moe_tkg) against its PyTorch twin model/tp/moe.py (moe_rank), under nkisim.

The kernel returns per-core partials [n_cores, T, H]; their sum is compared with the rank's partial
from the twin. Tolerances (max |kernel - twin| over the output, relative to max |twin|):

* float32: 1e-5. Both sides compute in fp32 and differ only in summation order (PSUM accumulation
  over 16 contraction blocks, the 2048-long down contraction cut into 512-column banks, fp32 sums of
  <= 33 expert contributions): ~sqrt(2048) * 2^-24 ~ 3e-6 relative at worst; observed <= 6e-7.
* bfloat16: 2e-2 (~10 x 2^-9). Kernel and twin round to bf16 at different points: the twin rounds
  gate x, up x (F.linear outputs), h = silu(g) * u and each expert's down projection; the kernel
  keeps those in fp32 and rounds a = silu(g) * w * u once. That is <= 5 differing bf16 roundings
  (2^-9 relative each) per expert contribution, over <= k + 1 = 9 contributions whose weights sum
  to <= 2; random signs make the typical sum far smaller: observed <= 9e-3 over 108 random
  tiny-shape cases, ~4e-3 at the real shapes. Routing itself is exact in both dtypes (same
  bf16-rounded logits, fp32 softmax, lower index on ties), which the crafted-tie tests check.

Every parity check also asserts the output is finite and not all zero, and where the test is about
traffic it counts the HBM bytes of the routed-expert DMAs in the nkisim trace against the minimum
(one block per DISTINCT selected expert).
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
from model import functional as fn
from model.config import preset
from model.params import random_params
from model.tp.moe import distinct_experts, moe_rank, route_tokens, shard_moe
from nki_kernels import moe as moe_mod
from nki_kernels.moe import (P, block_width, expert_block_bytes, expert_blocks, moe_hbm_layout, moe_tkg,
                             moe_tkg_body, router_block, routed_expert_bytes)

PREFIX = "model.layers.1"
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def full_size_launch(cfg, tp=4, T=2, dtype="bfloat16", shape_only=False, lnc=2, seed=0):
    """(kernel, args) of one rank's MoE at the config's shapes, launched LNC=``lnc``: ``kernel(*args)``.

    With shape_only the tensors are ``nkisim.ShapeDtype``: the trace is then that of a launch where
    the register-loaded values read 0 -- every always-valid slot fetches expert 0 and the k..S-1
    conditional slots run zero times, i.e. the minimum traffic (T tokens agreeing on the same k
    experts: k blocks + the shared one). An executing run (shape_only=False, random weights, distinct
    per expert) shows the real data-dependent traffic: one block per DISTINCT selected expert.
    """
    H, E = cfg.hidden_size, cfg.num_experts
    ir, isr = cfg.moe_intermediate_size // tp, cfg.shared_expert_intermediate_size // tp
    F, Fs = block_width(ir // lnc, H), block_width(isr // lnc, H)
    shapes = {"x": (T, H), "router": (lnc, P, H // P, E // lnc + 1), "experts": (E, lnc, P, F),
              "shared": (lnc, P, Fs)}
    if shape_only:
        args = tuple(nkisim.ShapeDtype(s, dtype) for s in shapes.values())
    else:
        rng = np.random.default_rng(seed)
        np_dt = ml_dtypes.bfloat16 if dtype == "bfloat16" else np.float32
        args = []
        for name, s in shapes.items():
            scale = 1.0 if name == "x" else (H ** -0.5)
            args.append((rng.standard_normal(s, dtype=np.float32) * np.float32(scale)).astype(np_dt))
        args = tuple(args)
    return moe_tkg[lnc], args + (cfg.num_experts_per_tok,)


def run_kernel(shard, x, top_k, lnc, layout=None):
    """(rank partial [T, H] f32, routed-expert bytes read, kernel output [n_cores, T, H])."""
    L = layout if layout is not None else moe_hbm_layout(shard, lnc)
    with nkisim.trace.capture() as tr:
        out = moe_tkg[lnc](x, L["router"], L["experts"], L["shared"], top_k)
    assert out.shape == (lnc, x.shape[0], x.shape[1]) and out.dtype == torch.float32
    return out.sum(0), routed_expert_bytes(tr), out


def check_close(got, ref, dtype):
    return assert_close(got, ref, rel=TOL[dtype], name="kernel vs twin")


def block_bytes_tiny(cfg, tp, dtype):
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp) * (2 if dtype == torch.bfloat16 else 4)


# ---------------------------------------------------------------------------------------------
# tiny shapes (cfg "tiny": H 128, 16 experts, top-4, I 64): every expert random
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_params():
    cfg = preset("tiny")
    return {dt: random_params(cfg, seed=3, dtype=dt) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_tiny_parity(tiny_params, dtype, tp, lnc, T):
    """tp=1/2/4 x LNC 1/2 give 8..64 intermediate columns per core, i.e. 2..16 folded down-row groups."""
    cfg = preset("tiny")
    rank = tp - 1
    shard = shard_moe(tiny_params[dtype], PREFIX, cfg, rank, tp)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(10 * T + tp)).to(dtype)
    got, nbytes, _ = run_kernel(shard, x, cfg.num_experts_per_tok, lnc)
    check_close(got, moe_rank(shard, x, cfg.num_experts_per_tok), dtype)
    U = len(distinct_experts(shard, x, cfg.num_experts_per_tok))
    assert nbytes == U * block_bytes_tiny(cfg, tp, dtype)


def test_tiny_identical_tokens_read_each_expert_once(tiny_params):
    """Two identical tokens choose the same experts: k blocks are read, not 2k."""
    cfg = preset("tiny")
    shard = shard_moe(tiny_params[torch.bfloat16], PREFIX, cfg, 0, 2)
    x = torch.randn(1, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16).repeat(2, 1)
    got, nbytes, _ = run_kernel(shard, x, cfg.num_experts_per_tok, 2)
    check_close(got, moe_rank(shard, x, cfg.num_experts_per_tok), torch.bfloat16)
    assert nbytes == cfg.num_experts_per_tok * block_bytes_tiny(cfg, 2, torch.bfloat16)


def designed_logits(shard, x, columns):
    """Make logits[t, e] = columns[t][e] EXACTLY: router column t holds token t's logits, every other
    router entry 0, and x[t, :T] = one-hot(t) (each logit is then one exact product by 1)."""
    T = x.shape[0]
    router = torch.zeros_like(shard["router"])
    x = x.clone()
    x[:, :T] = 0
    for t in range(T):
        x[t, t] = 1
        router[:, t] = torch.as_tensor(columns[t], dtype=torch.float32).to(router.dtype)
    return dict(shard, router=router), x


def tie_columns(E, k, T):
    """Per-token logits with exact ties straddling the top-k boundary (lower index must win)."""
    cols = []
    for t in range(T):
        v = np.full(E, -1.0)
        if t % 2 == 0:       # k - 3 clear winners, then 6 tied experts for the last 3 seats
            wins = [E - 1, 3, E // 2, 1, 7][:k - 3]
            for i, e in enumerate(wins):
                v[e] = 4.0 - 0.5 * i
            for e in (E - 2, 5, 2, E // 2 + 1, 0, 6):
                v[e] = 1.0
        else:                # everything tied: the k lowest indices win
            v[:] = 0.5
        cols.append(v)
    return cols


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_tiny_router_ties(tiny_params, dtype):
    cfg = preset("tiny")
    k, T = cfg.num_experts_per_tok, 2
    shard = shard_moe(tiny_params[dtype], PREFIX, cfg, 1, 2)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(2)).to(dtype)
    shard, x = designed_logits(shard, x, tie_columns(cfg.num_experts, k, T))
    chosen = [set(r) for r in route_tokens(shard, x, k)[1].tolist()]
    assert chosen[1] == set(range(k))
    assert {0, 2}.issubset(chosen[0]) and cfg.num_experts - 2 not in chosen[0]
    got, nbytes, _ = run_kernel(shard, x, k, 2)
    check_close(got, moe_rank(shard, x, k), dtype)
    assert nbytes == len(chosen[0] | chosen[1]) * block_bytes_tiny(cfg, 2, dtype)


@nki.jit
def routing_probe(x, router, top_k):
    """The body's routing alone (``_router_logits`` + ``_top_k``) on x [T, P] and a router block
    [n_cores, P, 1, E/n_cores + 1]: per core one float32 row block [T, E + S + 1] = w | ids (row 0) | gate logit."""
    T = x.shape[0]
    lnc, pid = (nl.num_programs(0), nl.program_id(0)) if nl.program_ndim() != 0 else (1, 0)
    E = (router.shape[3] - 1) * lnc
    S = min(T * top_k, E)
    out = nl.ndarray((lnc, T, E + S + 1), dtype=nl.float32, buffer=nl.shared_hbm)
    xT = nl.ndarray((P, 1, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, 1], [P, T]], offset=0))
    r_sb = nl.ndarray((P, lnc, 1, router.shape[3]), dtype=router.dtype, buffer=nl.sbuf)
    for c in range(lnc):
        nisa.dma_copy(dst=r_sb[:, c, :, :], src=router[c])
    gl, w, keys, ids, trips = moe_mod._top_k(moe_mod._router_logits(xT, r_sb), top_k, S, pid, x.dtype)
    o = nl.ndarray((T, E + S + 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=o, value=-1.0)
    nisa.tensor_copy(dst=o[:, 0:E], src=w)
    nisa.tensor_copy(dst=o[0:1, E:E + S], src=ids)
    nisa.tensor_copy(dst=o[:, E + S:E + S + 1], src=gl)
    nisa.dma_copy(dst=out[pid], src=o)
    return out


def probe_logits(kind, T, E, seed):
    """[T, E] logits: random, with many exact ties (coarse), all equal (flat), spread so that most softmax
    numerators underflow to 0 (spread), or distinct logits whose fp32 exp values collide (near)."""
    rng = np.random.default_rng(seed)
    if kind == "normal":
        return rng.standard_normal((T, E)) * 2
    if kind == "coarse":
        return np.round(rng.standard_normal((T, E)) * 2)
    if kind == "flat":
        return np.full((T, E), 0.25)
    if kind == "spread":
        return rng.standard_normal((T, E)) * 60
    return 3.0 + rng.integers(0, 3, size=(T, E)) * 2.0 ** -20          # near


@pytest.mark.parametrize("E,k,T,lnc,dtype", [(256, 8, 2, 2, torch.bfloat16), (16, 4, 3, 1, torch.float32),
                                             (64, 8, 4, 2, torch.float32)], ids=["real-bf16", "tiny-fp32", "e64-t4"])
@pytest.mark.parametrize("kind", ["normal", "coarse", "flat", "spread", "near"])
def test_routing_matches_the_twin(E, k, T, lnc, dtype, kind):
    """The kernel's routing against ``model.functional.route`` on the same rounded logits: token 0's k expert ids
    are exactly its top-k set (ties to the lower index), the slots after them exactly the other tokens' further
    experts (ascending, then unused = E), every token's weights non-zero only on its own set and equal to the
    twin's up to the activation dtype's rounding; the gate logit comes through unchanged."""
    lg = torch.as_tensor(probe_logits(kind, T, E, seed=E + T)).to(dtype)
    gate = torch.linspace(-1.0, 1.0, T).to(dtype)
    Eh = E // lnc
    x = torch.zeros(T, P, dtype=dtype)
    x[range(T), range(T)] = 1
    router = torch.zeros(lnc, P, 1, Eh + 1, dtype=dtype)    # logit (t, e) = x[t] . router[:, e] = lg[t, e] exactly
    for c in range(lnc):
        router[c, :T, 0, :Eh] = lg[:, c * Eh:(c + 1) * Eh]
        router[c, :T, 0, Eh] = gate
    out = torch.as_tensor(np.asarray(routing_probe[lnc](x, router, k)))
    assert torch.equal(out[0], out[-1]), "the cores route differently"
    w, ids, gl = out[0, :, :E], out[0, 0, E:-1], out[0, :, -1]
    want_w, want_idx = fn.route(lg.float(), k)
    sets = [set(r) for r in want_idx.tolist()]
    assert set(ids[:k].tolist()) == sets[0] and len(set(ids[:k].tolist())) == k
    rest = sorted(set().union(*sets) - sets[0])
    assert ids[k:k + len(rest)].tolist() == rest and (ids[k + len(rest):] == E).all()
    assert torch.isfinite(w).all() and (w > 0).any()
    for t in range(T):
        others = [e for e in range(E) if e not in sets[t]]
        assert (w[t, others] == 0).all()
        got, want = w[t, want_idx[t]], want_w[t]
        tol = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -20
        assert ((got - want).abs() <= tol * want + 1e-30).all(), (t, got, want)
    assert torch.equal(gl, gate.float())


def _launch_io(x):
    """A test launch's (out HBM [lnc, T, H] float32, x's feature-major copy SBUF [P, H/P, T], this core's index)."""
    T, H = x.shape
    lnc, pid = (nl.num_programs(0), nl.program_id(0)) if nl.program_ndim() != 0 else (1, 0)
    out = nl.ndarray((lnc, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    xT = nl.ndarray((P, H // P, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, H // P], [H, T]], offset=0))
    return out, xT, pid


@nki.jit
def stacked_moe(x, router, experts, shared, top_k, layer):
    """The body as a megakernel uses it: weights of all layers stacked, the layer picked by index."""
    io = _launch_io(x)
    out, xT, pid = io[0], io[1], io[2]
    y = moe_tkg_body(xT, router, experts, shared, top_k, layer=layer, experts_layer=layer)
    nisa.dma_copy(dst=out[pid], src=y)
    return out


def test_stacked_layers(tiny_params):
    """With [L, ...] stacked weights the run-time expert DMA must address layer `layer`'s table
    (``.ap()`` addresses the base tensor, so the layer offset is added explicitly)."""
    cfg = preset("tiny")
    k = cfg.num_experts_per_tok
    params = random_params(cfg, seed=9, dtype=torch.float32)
    shards = [shard_moe(params, f"model.layers.{i}", cfg, 1, 2) for i in (0, 1)]
    layouts = [moe_hbm_layout(sh, 2) for sh in shards]
    stack = {n: torch.stack([L[n] for L in layouts]) for n in ("router", "experts", "shared")}
    x = torch.randn(3, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    for layer in (1, 0):
        out = stacked_moe[2](x, stack["router"], stack["experts"], stack["shared"], k, layer)
        check_close(out.sum(0), moe_rank(shards[layer], x, k), torch.float32)


@nki.jit
def pooled_moe(x, router, experts, shared, top_k, n_regs):
    """The body with a caller's pool of ``n_regs`` registers (a megakernel passes one pool to every layer)."""
    io = _launch_io(x)
    out, xT, pid = io[0], io[1], io[2]
    pool = []
    for i in range(n_regs):
        pool.append(nisa.register_alloc())
    nisa.dma_copy(dst=out[pid], src=moe_tkg_body(xT, router, experts, shared, top_k, regs=tuple(pool)))
    return out


@pytest.mark.parametrize("n_regs", [4, 16])
def test_small_register_pool(tiny_params, n_regs):
    """T = 4 on the tiny shapes has 3 nesting levels of conditional slots. With the minimum pool (4: one trip
    register per level, one id register, reloaded for every DMA of a block) and with 16 (a register per loop,
    loaded up front, and two groups' id registers) the body gives the same bits as with its own registers."""
    cfg = preset("tiny")
    k = cfg.num_experts_per_tok
    shard = shard_moe(tiny_params[torch.bfloat16], PREFIX, cfg, 1, 2)
    L = moe_hbm_layout(shard, 2)
    x = torch.randn(4, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    assert len(distinct_experts(shard, x, k)) > k + 2 * moe_mod.LEVEL          # the third level's loops run
    want = moe_tkg[2](x, L["router"], L["experts"], L["shared"], k)
    got = pooled_moe[2](x, L["router"], L["experts"], L["shared"], k, n_regs)
    assert torch.equal(torch.as_tensor(np.asarray(got)), torch.as_tensor(np.asarray(want)))
    check_close(torch.as_tensor(np.asarray(got)).sum(0), moe_rank(shard, x, k), torch.bfloat16)


def test_stacked_table_beyond_int32_is_refused_and_groups_fit():
    """Real per-rank shapes: one layer's experts table is 201,326,592 elements, so at most 10 layers stack into
    one table whose element offsets fit int32 (SDK-LG "NKI Values"); 11 are refused with the group size named,
    and the round plan (megakernel.plan) maps MoE layer i to experts table i // 10, index i % 10 (the MTP layer,
    41st, alone in the fifth table)."""
    from megakernel import plan as rp
    from nki_kernels.moe import layers_per_table
    cfg = preset("qwen3.6-35b-a3b")
    _, args = full_size_launch(cfg, tp=4, T=2, shape_only=True)
    x, router, experts, shared, k = args
    per_layer = int(np.prod(experts.shape))
    assert per_layer == 201_326_592 and layers_per_table(per_layer) == 10
    assert 10 * per_layer <= 2 ** 31 - 1 < 11 * per_layer

    def stack(a, n):
        return nkisim.ShapeDtype((n,) + tuple(a.shape), a.dtype)

    with pytest.warns(nkisim.NkiFidelityWarning, match="more than int32 holds"), \
            pytest.raises(ValueError, match="offsets must fit int32.*at most 10 layers"):
        stacked_moe[2](x, stack(router, 11), stack(experts, 11), stack(shared, 11), k, 3)
    with nkisim.trace.capture() as tr:
        stacked_moe[2](x, stack(router, 10), stack(experts, 10), stack(shared, 10), k, 9)
    assert routed_expert_bytes(tr) == cfg.num_experts_per_tok * expert_block_bytes(cfg, 4)
    plan = rp.round_plan(cfg, 4, 2)
    assert rp.experts_per_table(cfg, 4, 2) == 10 and rp.experts_tables(cfg, 4, 2) == 5
    trunk = [s for s in plan.stages if s.kind == rp.VERIFY][0].layers
    for layer in (0, 9, 10, 39):
        assert trunk[layer].experts == (layer // 10, layer % 10) and trunk[layer].moe == layer
    assert plan.stages[0].layers[0].experts == (4, 0) and plan.stages[0].layers[0].moe == 40


def test_layout_helpers_round_trip():
    """expert_blocks / router_block place every weight where the kernel reads it."""
    E, I, H, C = 3, 64, 256, 2
    g = torch.Generator().manual_seed(0)
    gate, up, down = torch.randn(E, I, H, generator=g), torch.randn(E, I, H, generator=g), torch.randn(E, H, I, generator=g)
    b = expert_blocks(gate, up, down, C)
    ic, J = I // C, H // P
    R = P // ic
    assert b.shape == (E, C, P, block_width(ic, H))
    for e, c, p, j, n in [(0, 0, 0, 0, 0), (2, 1, 127, 1, 2 * ic - 1), (1, 1, 5, 0, ic + 3)]:
        src = gate if n < ic else up
        assert b[e, c, p, j * 2 * ic + n] == src[e, c * ic + n % ic, j * P + p]
    for e, c, grp, i, col in [(0, 0, 0, 0, 0), (2, 1, R - 1, ic - 1, H // R - 1), (1, 0, 1, 4, 9)]:
        assert b[e, c, grp * ic + i, J * 2 * ic + col] == down[e, grp * (H // R) + col, c * ic + i]
    rw, seg = torch.randn(16, H, generator=g), torch.randn(1, H, generator=g)
    rb = router_block(rw, seg, 2)
    assert rb.shape == (2, P, J, 9)
    assert rb[0, 3, 1, 2] == rw[2, P + 3] and rb[1, 3, 1, 2] == rw[10, P + 3]
    assert rb[0, 7, 0, 8] == seg[0, 7] and rb[1, 7, 1, 8] == seg[0, P + 7]


def test_refuses_mismatched_launch(tiny_params):
    cfg = preset("tiny")
    shard = shard_moe(tiny_params[torch.float32], PREFIX, cfg, 0, 4)
    L = moe_hbm_layout(shard, 2)
    x = torch.randn(1, cfg.hidden_size)
    with pytest.raises(ValueError, match="LNC=1"):
        moe_tkg(x, L["router"], L["experts"], L["shared"], cfg.num_experts_per_tok)
    with pytest.raises(ValueError, match="bfloat16"):
        moe_tkg[2](x.to(torch.bfloat16), L["router"], L["experts"], L["shared"], cfg.num_experts_per_tok)
    with pytest.raises(ValueError, match="divisor"):
        expert_blocks(torch.zeros(1, 48, 128), torch.zeros(1, 48, 128), torch.zeros(1, 128, 48), 1)


# ---------------------------------------------------------------------------------------------
# real per-rank shapes (Qwen3.6-35B-A3B at TP=4: 256 experts, intermediate slice 128, hidden 2048)
# ---------------------------------------------------------------------------------------------

class RealRank:
    """One rank's MoE weights at the real shapes. The expert tables are full size, zero except the
    experts some test selects, which get random weights on first use (``fill``); a kernel reading a
    wrong expert therefore reads zeros (or another expert) and fails the parity check."""

    def __init__(self, dtype, lncs, seed=0):
        self.cfg = cfg = preset("qwen3.6-35b-a3b")
        self.tp, self.dtype, self.k = 4, dtype, cfg.num_experts_per_tok
        E, H = cfg.num_experts, cfg.hidden_size
        Ir, Is = cfg.moe_intermediate_size // self.tp, cfg.shared_expert_intermediate_size // self.tp
        self.g = g = torch.Generator().manual_seed(seed)
        rnd = lambda *s, fan: (torch.randn(*s, generator=g) * fan ** -0.5).to(dtype)
        self.shard = {"router": rnd(E, H, fan=H), "shared_expert_gate": rnd(1, H, fan=H),
                      "gate": torch.zeros(E, Ir, H, dtype=dtype), "up": torch.zeros(E, Ir, H, dtype=dtype),
                      "down": torch.zeros(E, H, Ir, dtype=dtype),
                      "shared_gate": rnd(Is, H, fan=H), "shared_up": rnd(Is, H, fan=H),
                      "shared_down": rnd(H, Is, fan=cfg.shared_expert_intermediate_size)}
        self.tables = {}
        for lnc in lncs:
            ic = Ir // lnc
            self.tables[lnc] = {"router": router_block(self.shard["router"], self.shard["shared_expert_gate"], lnc),
                                "experts": torch.zeros(E, lnc, P, block_width(ic, H), dtype=dtype),
                                "shared": expert_blocks(self.shard["shared_gate"][None], self.shard["shared_up"][None],
                                                        self.shard["shared_down"][None], lnc)[0]}
        self.filled = set()

    def fill(self, experts):
        new = sorted(set(experts) - self.filled)
        if not new:
            return
        s, H, I = self.shard, self.cfg.hidden_size, self.cfg.moe_intermediate_size
        n, Ir = len(new), s["gate"].shape[1]
        w = torch.randn(n, 3, Ir, H, generator=self.g)
        gate, up = (w[:, 0] * H ** -0.5).to(self.dtype), (w[:, 1] * H ** -0.5).to(self.dtype)
        down = (w[:, 2] * I ** -0.5).to(self.dtype).transpose(1, 2)
        s["gate"][new], s["up"][new], s["down"][new] = gate, up, down
        for lnc, t in self.tables.items():
            t["experts"][new] = expert_blocks(gate.float(), up.float(), down.float(), lnc).to(self.dtype)
        self.filled.update(new)

    def run(self, x, lnc=2, router=None):
        """Fill the experts the twin selects, run kernel and twin; returns (got, ref, bytes, U)."""
        shard = self.shard if router is None else dict(self.shard, router=router)
        sel = distinct_experts(shard, x, self.k)
        self.fill(sel)
        layout = dict(self.tables[lnc])
        if router is not None:
            layout["router"] = router_block(router, shard["shared_expert_gate"], lnc)
        got, nbytes, _ = run_kernel(shard, x, self.k, lnc, layout)
        return got, moe_rank(shard, x, self.k), nbytes, sel

    def x(self, T, seed):
        return torch.randn(T, self.cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(self.dtype)

    def block_bytes(self):
        return expert_block_bytes(self.cfg, self.tp, "bfloat16" if self.dtype == torch.bfloat16 else "float32")


@pytest.fixture(scope="module")
def real_bf16():
    return RealRank(torch.bfloat16, lncs=(1, 2))


@pytest.mark.parametrize("T", [1, 2, 4])
def test_real_parity_and_traffic_bf16(real_bf16, T):
    """LNC=2 at the deployed shapes: parity, and the routed-expert bytes in the trace equal the
    minimum, one 1.5 MiB block per distinct selected expert (each core reads its 768 KiB half)."""
    r = real_bf16
    got, ref, nbytes, sel = r.run(r.x(T, seed=T))
    check_close(got, ref, torch.bfloat16)
    assert nbytes == len(sel) * r.block_bytes()
    assert nbytes <= 1.05 * len(sel) * r.block_bytes()


def test_real_parity_lnc1_bf16(real_bf16):
    """LNC=1: one core takes all 128 intermediate columns (no down-row fold)."""
    r = real_bf16
    got, ref, nbytes, sel = r.run(r.x(2, seed=21), lnc=1)
    check_close(got, ref, torch.bfloat16)
    assert nbytes == len(sel) * r.block_bytes()


def _boost(router, x, experts_per_token, seed, alpha=4.0, beta=2.0):
    """Crafted routing: token t gets a component alpha * u_t and the experts in
    experts_per_token[t] get beta * u_t added to their router row, so they win by ~alpha*beta logits."""
    H = x.shape[1]
    g = torch.Generator().manual_seed(seed)
    router, x = router.float().clone(), x.float().clone()
    for t, experts in enumerate(experts_per_token):
        u = torch.randn(H, generator=g)
        u /= u.norm()
        x[t] += alpha * u
        router[list(experts)] += beta * u
    return router, x


def test_real_tokens_choosing_the_same_experts(real_bf16):
    """Different tokens routed (by a crafted router) to the same 8 experts: the 8 blocks are read
    once, each run T-wide with every token's own weight."""
    r = real_bf16
    T, A = 2, [9, 40, 77, 128, 130, 199, 230, 254]
    router, x = _boost(r.shard["router"], r.x(T, seed=5), [A] * T, seed=1)
    router, x = router.to(r.dtype), x.to(r.dtype)
    got, ref, nbytes, sel = r.run(x, router=router)
    assert sel == A
    check_close(got, ref, torch.bfloat16)
    assert nbytes == len(A) * r.block_bytes()


def test_real_experts_0_and_255(real_bf16):
    """Token 0 routed to expert 0, token 1 to expert 255 (the first and last blocks of the table)."""
    r = real_bf16
    router, x = _boost(r.shard["router"], r.x(2, seed=6), [[0], [255]], seed=2)
    router, x = router.to(r.dtype), x.to(r.dtype)
    got, ref, nbytes, sel = r.run(x, router=router)
    assert 0 in sel and 255 in sel
    check_close(got, ref, torch.bfloat16)
    assert nbytes == len(sel) * r.block_bytes()


def test_real_router_ties(real_bf16):
    r = real_bf16
    E, k, T = r.cfg.num_experts, r.k, 2
    shard, x = designed_logits(r.shard, r.x(T, seed=8), tie_columns(E, k, T))
    got, ref, nbytes, sel = r.run(x, router=shard["router"])
    assert set(range(k)).issubset(sel) and E - 2 not in sel
    check_close(got, ref, torch.bfloat16)
    assert nbytes == len(sel) * r.block_bytes()


def test_real_parity_fp32():
    r = RealRank(torch.float32, lncs=(2,), seed=1)
    got, ref, nbytes, sel = r.run(r.x(2, seed=31))
    check_close(got, ref, torch.float32)
    assert nbytes == len(sel) * r.block_bytes()


def test_demo_shape_only_trace():
    """The shape-only demo trace: registers read 0, so the k always-valid slots fetch expert 0 and the
    conditional slots run 0 times -- the minimum traffic of k blocks (documented in full_size_launch)."""
    cfg = preset("qwen3.6-35b-a3b")
    kernel, args = full_size_launch(cfg, tp=4, T=2, shape_only=True)
    with nkisim.trace.capture() as tr:
        out = kernel(*args)
    assert out.shape == (2, 2, cfg.hidden_size)
    assert routed_expert_bytes(tr) == cfg.num_experts_per_tok * expert_block_bytes(cfg, 4)
    ops = tr.summary()
    assert ops[("DVE", "max8")] == 2 * 3        # per core: the top-k values, the top-k keys, one union round


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 4])
def test_real_parity_fp32_sweep(T):
    r = RealRank(torch.float32, lncs=(1, 2), seed=2)
    for lnc in (1, 2):
        got, ref, nbytes, sel = r.run(r.x(T, seed=40 + T), lnc=lnc)
        check_close(got, ref, torch.float32)
        assert nbytes == len(sel) * r.block_bytes()


@pytest.mark.slow
def test_demo_executes():
    cfg = preset("qwen3.6-35b-a3b")
    kernel, args = full_size_launch(cfg, tp=4, T=2, shape_only=False)
    with nkisim.trace.capture() as tr:
        out = kernel(*args)
    assert np.isfinite(out).all() and np.abs(out).max() > 0
    assert routed_expert_bytes(tr) >= cfg.num_experts_per_tok * expert_block_bytes(cfg, 4)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(20))
def test_tiny_random_sweep(seed):
    cfg = preset("tiny")
    for dtype in (torch.float32, torch.bfloat16):
        params = random_params(cfg, seed=100 + seed, dtype=dtype)
        for tp in (1, 4):
            shard = shard_moe(params, PREFIX, cfg, seed % tp, tp)
            for T in (1, 3, 4):
                x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(seed)).to(dtype)
                got, nbytes, _ = run_kernel(shard, x, cfg.num_experts_per_tok, 2)
                check_close(got, moe_rank(shard, x, cfg.num_experts_per_tok), dtype)
                assert nbytes == len(distinct_experts(shard, x, cfg.num_experts_per_tok)) * \
                    block_bytes_tiny(cfg, tp, dtype)
