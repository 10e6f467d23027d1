"""The bank-stacked residual layout (nki_kernels/stacked.py): the stage-entry conversion, the MoE fold's unfold and
the RMSNorm of a stacked residual, each against the token-major path, bit for bit (all three only move values:
copies, DMAs and exact PE transposes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import P
from nki_kernels.host import as_torch
from nki_kernels.rmsnorm import rmsnorm_body, rmsnorm_weight_layout
from nki_kernels.stacked import bank_block, bank_of, banks_for, stack_rows, unfold


def stacked_reference(x, S):
    """Host twin of the layout: [T, H] -> [S*T, H/S] with row s*T + t = x[t, block(s)*W : (block(s)+1)*W]."""
    T, H = x.shape
    W = H // S
    return torch.cat([x[:, bank_block(s, S) * W:(bank_block(s, S) + 1) * W] for s in range(S)], dim=0)


@nki.jit
def _norm_both(x, w1, eps, S):
    """x HBM [T, H] -> (stack_rows(x) [S*T, H/S], token-major norm xT, stacked norm xT)."""
    T, H = x.shape
    J = H // P
    xs_out = nl.ndarray((S * T, H // S), x.dtype, buffer=nl.shared_hbm, name="xs_out")
    a_out = nl.ndarray((P, J, T), x.dtype, buffer=nl.shared_hbm, name="a_out")
    b_out = nl.ndarray((P, J, T), x.dtype, buffer=nl.shared_hbm, name="b_out")
    x_sb = nl.ndarray((T, H), x.dtype, buffer=nl.sbuf, name="x")
    nisa.dma_copy(dst=x_sb, src=x)
    xs = stack_rows(x_sb, S)
    nisa.dma_copy(dst=xs_out, src=xs)
    nisa.dma_copy(dst=a_out, src=rmsnorm_body(x_sb, w1, eps))
    nisa.dma_copy(dst=b_out, src=rmsnorm_body(xs, w1, eps, stack=S))
    return xs_out, a_out, b_out


@nki.jit
def _unfold(fold, R, S, T):
    """fold HBM [R*T, H/R] float32 -> unfold() into [S*T, H/S]."""
    H = fold.shape[1] * R
    out = nl.ndarray((S * T, H // S), nl.float32, buffer=nl.shared_hbm, name="unfold_out")
    f_sb = nl.ndarray(fold.shape, nl.float32, buffer=nl.sbuf, name="fold")
    nisa.dma_copy(dst=f_sb, src=fold)
    y = nl.ndarray((S * T, H // S), nl.float32, buffer=nl.sbuf, name="y")
    unfold(f_sb, R, S, T, y, nisa.engine.vector)
    nisa.dma_copy(dst=out, src=y)
    return out


def test_bank_order_and_counts():
    for S in (1, 2, 4, 8):
        assert sorted(bank_block(s, S) for s in range(S)) == list(range(S))
        assert all(bank_of(bank_block(s, S), S) == s for s in range(S))
    assert [bank_block(s, 4) for s in range(4)] == [0, 2, 1, 3]
    assert banks_for(2048, 4) == 4 and banks_for(2048, 8) == 8 and banks_for(128, 4) == 1
    assert banks_for(512, 4) == 4 and banks_for(384, 4) == 1 and banks_for(4096, 4) == 1


@pytest.mark.parametrize("S,T,dtype", [(4, 2, torch.bfloat16), (8, 1, torch.bfloat16), (4, 1, torch.float32),
                                       (2, 2, torch.float32)])
def test_stacked_norm_equals_token_major_norm(S, T, dtype):
    H = 1024
    g = torch.Generator().manual_seed(7 * S + T)
    x = (3.0 * torch.randn(T, H, generator=g)).to(dtype)
    w = (0.1 * torch.randn(H, generator=g)).to(dtype)
    xs, a, b = _norm_both(x, rmsnorm_weight_layout(w), 1e-6, S)
    xs, a, b = as_torch(xs), as_torch(a), as_torch(b)
    assert torch.equal(xs, stacked_reference(x, S))
    assert torch.isfinite(a.float()).all() and a.float().abs().max() > 0.1
    assert torch.equal(a.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                       b.view(torch.int16 if dtype == torch.bfloat16 else torch.int32))


@pytest.mark.parametrize("R,S,T", [(2, 4, 2), (2, 8, 1), (1, 4, 2), (4, 4, 1), (16, 4, 2), (8, 2, 1)])
def test_unfold_writes_the_stacked_layout(R, S, T):
    H = 1024
    y = torch.randn(T, H, generator=torch.Generator().manual_seed(R * 10 + S))
    fold = torch.cat([y[:, g * (H // R):(g + 1) * (H // R)] for g in range(R)], dim=0)
    out = as_torch(_unfold(fold, R, S, T))
    assert torch.equal(out, stacked_reference(y, S)) and out.abs().max() > 0.1


# ---- the bodies' stacked partials --------------------------------------------------------------------------
# nkisim computes each nc_matmul with one fp32 sgemm, whose summation order depends on the stationary's width M
# (numpy's BLAS blocks by shape), so a zero-padded stationary [K, S*T] and the plain [K, T] can give different last
# fp32 bits here, while on trn2 each PE column accumulates on its own (nki_kernels/stacked.py). The partials are
# therefore compared at fp32 rounding (<= 4 ulps of the largest value), the layout itself exactly (a wrong bank is
# off by O(1)).

def _close_stacked(got, want_token_major, S):
    want = stacked_reference(want_token_major, S)
    assert got.shape == want.shape and torch.isfinite(got).all() and want.abs().max() > 1e-3
    err, bound = (got - want).abs().max().item(), 4 * 2.0 ** -23 * want.abs().max().item()
    assert err <= bound, f"stacked partial differs from the token-major one by {err:.3g} (bound {bound:.3g})"


def _mid_cfg():
    """tiny (4 layers: GDN, MoE and attention layers) with a hidden size that splits into 4 banks of 128 columns."""
    from model.config import _pattern, preset
    return preset("tiny").replace(hidden_size=512, num_hidden_layers=4, layer_types=_pattern(4))


@nki.jit
def _gdn_stacked(x, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, eps, S):
    from nki_kernels import gdn as kg
    from nki_kernels.common import program_sharding
    T, H = x.shape
    y_out = nl.ndarray((w_in.shape[0], S * T, H // S), nl.float32, buffer=nl.shared_hbm, name="y_stacked")
    _, core = program_sharding()
    y = kg.gdn_body(kg.load_feature_major(x), w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state,
                    read_slot, eps, stack=S)
    nisa.dma_copy(dst=y_out[core], src=y)
    return y_out


@pytest.mark.parametrize("S,T", [(4, 2)])
def test_gdn_stacked_partial(S, T):
    from model.params import random_params
    from model.tp.gdn import GdnDims, shard_gdn
    from nki_kernels import gdn as kg
    cfg = _mid_cfg()
    p = random_params(cfg, seed=1, dtype=torch.float32, include_mtp=False)
    dims = GdnDims.of(cfg, 4)
    w = {k: (v if k in ("A_log", "dt_bias") else v.to(torch.bfloat16))
         for k, v in shard_gdn(p, "model.layers.0", cfg, 0, 4).items()}
    g = torch.Generator().manual_seed(S + T)
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    window = torch.randn(4, cfg.conv_window, dims.conv_dim, generator=g).to(torch.bfloat16)
    state = 0.5 * torch.randn(4, dims.hv, dims.dk, dims.dv, generator=g)
    L = kg.gdn_weight_layout(w, 2)
    args = (L["w_in"], L["conv_w"], L["A_log"], L["dt_bias"], L["norm_w"], L["w_out"])
    rs = torch.tensor([[0]], dtype=torch.int32)
    y, _, _ = kg.gdn_kernel[2](x, *args, window.clone(), state.clone(), rs, cfg.rms_norm_eps)
    ys = _gdn_stacked[2](x, *args, window.clone(), state.clone(), rs, cfg.rms_norm_eps, S)
    for c in range(2):
        _close_stacked(as_torch(ys)[c], as_torch(y)[c], S)


@nki.jit
def _attention_stacked(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps, kv_tile, max_context, S):
    from nki_kernels import attention as att
    from nki_kernels.common import program_sharding
    n_cores, core = program_sharding()
    Pp, KT, T = xT.shape
    out = nl.ndarray((n_cores, S * T, KT * P // S), nl.float32, buffer=nl.shared_hbm, name="att_stacked")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf, name="att_x")
    nisa.dma_copy(dst=xs, src=xT)
    y = att.attention_body(xs, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=core,
                           n_cores=n_cores, kv_tile=kv_tile, max_context=max_context, stack=S)
    nisa.dma_copy(dst=out[core], src=y)
    return out, k_cache, v_cache


@pytest.mark.parametrize("S,T", [(4, 2)])
def test_attention_stacked_partial(S, T):
    from model.params import random_params
    from model.tp.attention import shard_attention
    from nki_kernels import attention as att
    cfg = _mid_cfg()
    p = random_params(cfg, seed=0, dtype=torch.bfloat16, include_mtp=False)
    sh = shard_attention(p, f"model.layers.{cfg.full_layers[0]}", cfg, 0, 4)
    g = torch.Generator().manual_seed(S + T)
    L = 2 * att.KV_TILE
    x = torch.randn(T, cfg.hidden_size, generator=g).to(torch.bfloat16)
    k0 = torch.randn(1, L, cfg.head_dim, generator=g).to(torch.bfloat16)
    v0 = torch.randn(1, L, cfg.head_dim, generator=g).to(torch.bfloat16)
    layout = att.attention_layout(sh)
    want = att.run_attention(layout, x, k0.clone(), v0.clone(), 5, cfg, lnc=2)
    args = att.kernel_args(layout, x, k0.clone(), v0.clone(), 5, cfg)
    got, _, _ = _attention_stacked[2](*args, S)
    for c in range(2):
        _close_stacked(as_torch(got)[c], as_torch(want)[c], S)


@nki.jit
def _moe_stacked(x, router, experts, shared, top_k, S, scales=None):
    from nki_kernels.common import program_sharding
    from nki_kernels.moe import moe_tkg_body
    T, H = x.shape
    lnc, pid = program_sharding()
    out = nl.ndarray((lnc, S * T, H // S), dtype=nl.float32, buffer=nl.shared_hbm, name="moe_stacked")
    xT = nl.ndarray((P, H // P, T), dtype=x.dtype, buffer=nl.sbuf, name="moe_x")
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, H // P], [H, T]], offset=0))
    nisa.dma_copy(dst=out[pid], src=moe_tkg_body(xT, router, experts, shared, top_k, stack=S, scales=scales))
    return out


@pytest.mark.parametrize("S,T", [(4, 2)])
def test_moe_stacked_partial(S, T):
    """Routed experts with fold R = 2 (the down projections accumulate the stacked layout, moe._down_banks), the
    shared expert with R = 16 (its own accumulator, unfolded), their stacked sum."""
    from model.params import random_params
    from model.tp.moe import shard_moe
    from nki_kernels.moe import moe_hbm_layout, moe_tkg
    cfg = _mid_cfg().replace(moe_intermediate_size=512, shared_expert_intermediate_size=64)
    p = random_params(cfg, seed=2, dtype=torch.bfloat16, include_mtp=False)
    L = moe_hbm_layout(shard_moe(p, "model.layers.1", cfg, 0, 4), 2)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(S * T)).to(torch.bfloat16)
    args = (x, L["router"], L["experts"], L["shared"], cfg.num_experts_per_tok)
    want, got = moe_tkg[2](*args), _moe_stacked[2](*args, S)
    for c in range(2):
        _close_stacked(as_torch(got)[c], as_torch(want)[c], S)


def test_moe_stacked_partial_fp8_experts():
    """The opt-in fp8 experts (moe.py "fp8 experts") in the stacked layout: the same partial as their token-major
    run (the stationaries stay bfloat16 beside the e4m3 blocks: the stacked down projections take the activation
    dtype, not the block's)."""
    from model.params import random_params
    from model.tp.moe import quantize_fp8, shard_moe
    from nki_kernels.moe import kernel_table, moe_hbm_layout, moe_tkg
    S, T = 4, 2
    cfg = _mid_cfg().replace(moe_intermediate_size=512, shared_expert_intermediate_size=64)
    p = quantize_fp8(random_params(cfg, seed=2, dtype=torch.bfloat16, include_mtp=False))
    L = moe_hbm_layout(shard_moe(p, "model.layers.1", cfg, 0, 4), 2)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    args = (x, L["router"], kernel_table(L["experts"]), L["shared"], cfg.num_experts_per_tok)
    want = moe_tkg[2](*args, scales=L["scales"])
    got = _moe_stacked[2](*args, S, L["scales"])
    for c in range(2):
        _close_stacked(as_torch(got)[c], as_torch(want)[c], S)
