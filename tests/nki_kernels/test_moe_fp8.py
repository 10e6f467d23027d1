"""The opt-in fp8 experts of nki_kernels/moe.py (issue 15): the quantiser, the kernel against its fp8 twin
(model/tp/moe.py ``moe_rank`` of a quantised shard), the refusals, and the tables the megakernel takes.

Tolerance of kernel vs twin: 1e-5 relative to max |twin|. The twin computes at the kernel's rounding points (gate|up
of the e4m3 codes in fp32 times the same fp32 scales, a = silu(g) * w * u in fp32 rounded to bf16 once, the down
projection of the codes and the shared expert likewise), so they differ only in fp32 summation order (PSUM over the
contraction blocks and banks vs torch's matmul) and the ACT's silu / exp: observed ~1e-7.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
from compare import assert_close
from model.config import preset
from model.params import random_params
from model.tp.moe import FP8_MAX, distinct_experts, moe_rank, quantize_channels, quantize_fp8, shard_moe
from nki_kernels.moe import (FP8, P, expert_block_bytes, kernel_table, moe_hbm_layout, moe_tkg, moe_tkg_body,
                             routed_expert_bytes)

import nkisim

PREFIX = "model.layers.1"
TOL = 1e-5


@pytest.fixture(scope="module")
def tiny():
    cfg = preset("tiny")
    params = random_params(cfg, seed=3, dtype=torch.bfloat16)
    return cfg, params, quantize_fp8(params)


def run_fp8(shard, x, top_k, lnc):
    """(rank partial [T, H] f32, routed-expert bytes read) of the fp8 kernel on a quantised shard."""
    L = moe_hbm_layout(shard, lnc)
    with nkisim.trace.capture() as tr:
        out = moe_tkg[lnc](x, L["router"], kernel_table(L["experts"]), L["shared"], top_k, scales=L["scales"])
    out = torch.as_tensor(np.asarray(out))
    assert out.shape == (lnc, x.shape[0], x.shape[1]) and out.dtype == torch.float32
    return out.sum(0), routed_expert_bytes(tr)


def test_quantizer_round_trip_bounds():
    """codes within +-240, the channel max-abs maps to exactly +-240, |w - codes * scale| <= half an e4m3 step
    (2^-4 relative above the subnormals, 2^-10 * scale below), an all-zero channel gets scale 1 and codes 0, and
    the codes' bytes are float8_e4m3's (ml_dtypes' RNE cast of the same values)."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 40, 96, generator=g) * torch.logspace(-4, 1, 40)[None, :, None]
    w[1, 5] = 0
    for dim in (1, 2):
        codes, scale = quantize_channels(w, dim)
        c = codes.float()
        assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
        assert c.abs().max() <= FP8_MAX and torch.isfinite(c).all()
        v = w / scale.unsqueeze(dim)
        err = (v - c).abs()
        assert (err <= torch.maximum(v.abs() * 2.0 ** -4, torch.full_like(v, 2.0 ** -10))).all()
        nz = w.abs().amax(dim) > 0
        assert torch.equal(c.abs().amax(dim)[nz], torch.full_like(scale[nz], FP8_MAX))
        e4m3 = v.numpy().astype(ml_dtypes.float8_e4m3)
        assert np.array_equal(kernel_table(codes).view(np.uint8), e4m3.view(np.uint8))
        assert kernel_table(codes).dtype == ml_dtypes.float8_e4m3
    assert (quantize_channels(w, 2)[1][1, 5] == 1) and (quantize_channels(w, 2)[0][1, 5].float() == 0).all()


def test_quantize_fp8_checkpoint(tiny):
    cfg, params, q = tiny
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    m = f"{PREFIX}.mlp.experts"
    assert q[f"{m}.gate_up_proj"].dtype == torch.float8_e4m3fn and q[f"{m}.gate_up_scale"].shape == (E, 2 * I)
    assert q[f"{m}.down_proj"].dtype == torch.float8_e4m3fn and q[f"{m}.down_scale"].shape == (E, I)
    deq = q[f"{m}.gate_up_proj"].float() * q[f"{m}.gate_up_scale"][:, :, None]
    ref = params[f"{m}.gate_up_proj"].float()
    assert (deq - ref).abs().max() <= 2.0 ** -4 * ref.abs().max()
    assert q[f"{PREFIX}.mlp.shared_expert.up_proj.weight"] is params[f"{PREFIX}.mlp.shared_expert.up_proj.weight"]
    assert set(q) - set(params) == {k for k in q if k.endswith("_scale")} and len(set(q) - set(params)) == 2 * (
        cfg.num_hidden_layers + cfg.mtp_num_hidden_layers)


@pytest.mark.parametrize("tp, lnc, T", [(2, 2, 2), (1, 1, 3), (4, 2, 4), (4, 2, 1)])
def test_fp8_kernel_matches_its_twin(tiny, tp, lnc, T):
    """Kernel vs fp8 twin within 1e-5; bytes = one fp8 block + one scales row per token per core per DISTINCT
    expert; and the fp8 output stays near the bf16 model's (a sanity bound on the quantisation, not a parity)."""
    cfg, params, q = tiny
    k = cfg.num_experts_per_tok
    shard = shard_moe(q, PREFIX, cfg, tp - 1, tp)
    x = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(5 + T)).to(torch.bfloat16)
    got, nbytes = run_fp8(shard, x, k, lnc)
    want = moe_rank(shard, x, k)
    assert torch.isfinite(got).all() and got.abs().max() > 0
    assert_close(got, want, rel=TOL, name="fp8 kernel vs fp8 twin")
    U = len(distinct_experts(shard, x, k))
    ic2 = 2 * cfg.moe_intermediate_size // tp // lnc
    assert nbytes == U * (expert_block_bytes(cfg, tp, FP8) + lnc * T * ic2 * 4)
    bf16 = moe_rank(shard_moe(params, PREFIX, cfg, tp - 1, tp), x, k)
    assert (want - bf16).abs().max() <= 0.1 * bf16.abs().max()


@nki.jit
def stacked_fp8(x, router, experts, shared, scales, top_k, layer):
    """The body as the megakernel calls it: stacked tables, the layer picked by index, fp8 scales alongside."""
    T, H = x.shape
    lnc, pid = (nl.num_programs(0), nl.program_id(0)) if nl.program_ndim() != 0 else (1, 0)
    out = nl.ndarray((lnc, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    xT = nl.ndarray((P, H // P, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, H // P], [H, T]], offset=0))
    y = moe_tkg_body(xT, router, experts, shared, top_k, layer=layer, experts_layer=1 - layer, scales=scales)
    nisa.dma_copy(dst=out[pid], src=y)
    return out


def test_fp8_stacked_layers(tiny):
    """The scales DMA adds the layer's offset in the scales table stacked like router / shared (index ``layer``),
    the block DMA its own in the experts table (here stacked in the other order: index 1 - layer)."""
    cfg, _, q = tiny
    k = cfg.num_experts_per_tok
    shards = [shard_moe(q, f"model.layers.{i}", cfg, 1, 2) for i in (0, 1)]
    layouts = [moe_hbm_layout(sh, 2) for sh in shards]
    st = {n: torch.stack([L[n] for L in layouts]) for n in ("router", "shared", "scales")}
    st["experts"] = torch.stack([layouts[1]["experts"], layouts[0]["experts"]])
    x = torch.randn(2, cfg.hidden_size, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    for layer in (1, 0):
        out = stacked_fp8[2](x, st["router"], kernel_table(st["experts"]), st["shared"], st["scales"], k, layer)
        got = torch.as_tensor(np.asarray(out)).sum(0)
        assert torch.isfinite(got).all() and got.abs().max() > 0
        assert_close(got, moe_rank(shards[layer], x, k), rel=TOL, name=f"stacked fp8 layer {layer}")


def test_fp8_refusals(tiny):
    cfg, params, q = tiny
    k = cfg.num_experts_per_tok
    L = moe_hbm_layout(shard_moe(q, PREFIX, cfg, 1, 2), 2)
    x = torch.randn(2, cfg.hidden_size).to(torch.bfloat16)
    with pytest.raises(ValueError, match="scales"):
        moe_tkg[2](x, L["router"], kernel_table(L["experts"]), L["shared"], k)
    Lb = moe_hbm_layout(shard_moe(params, PREFIX, cfg, 1, 2), 2)
    with pytest.raises(ValueError, match="scales"):
        moe_tkg[2](x, Lb["router"], Lb["experts"], Lb["shared"], k, scales=L["scales"])
    with pytest.raises(ValueError, match="expected"):
        moe_tkg[2](x, L["router"], kernel_table(L["experts"]), L["shared"], k, scales=L["scales"][:, :, :-1])
    with pytest.raises(Exception, match="float8_e4m3fn"):     # torch's e4m3fn storage is not trn2's e4m3
        moe_tkg[2](x, L["router"], L["experts"], L["shared"], k, scales=L["scales"])


def test_megakernel_tables(tiny):
    """megakernel.sharded.rank_weights of a quantised checkpoint: fp8 experts tables and ONE scales table of all MoE
    layers (stacked like moe_router); the bf16 checkpoint has none."""
    from megakernel import plan as rp
    from megakernel.sharded import rank_weights
    cfg, params, q = tiny
    w, wb = rank_weights(cfg, q, 1, 4, 2), rank_weights(cfg, params, 1, 4, 2)
    ic2 = 2 * cfg.moe_intermediate_size // 4 // 2
    for t in range(rp.experts_tables(cfg, 4, 2)):
        e = w[f"moe_experts_{t}"]
        assert e.dtype == torch.float8_e4m3fn and e.shape == wb[f"moe_experts_{t}"].shape
    s = w["moe_scales"]
    assert s.dtype == torch.float32 and tuple(s.shape) == (w["moe_router"].shape[0], cfg.num_experts, 2, ic2)
    assert set(w) - set(wb) == set(rp.EXPERT_SCALES)
