"""Gated DeltaNet mixer kernel (nki_kernels/gdn.py) vs its PyTorch twin ``model.tp.gdn.gdn_rank``.

Every case runs one TP rank's slice (tiny preset at TP = 1, 2, 4; the real Qwen3.6 per-rank shapes at
TP = 4: hidden 2048, 4 key / 8 value heads of 128, 2048 conv channels) for T = 1, 2, 4 tokens at LNC = 1
and 2, reading checkpoint slot ``read_slot`` (0 or 1) and writing slots 0..T-1, and compares
* ``y``: the sum of the per-core fp32 partials with the twin's fp32 partial,
* every written checkpoint slot: fp32 states and activation-dtype windows,
* the slots >= T: bit-identical to their input (untouched),
and checks that everything is finite and not all zero.

Tolerances (errors are normalised by the reference's max magnitude, ``max|k - r| / max|r|``)
------------------------------------------------------------------------------------------
float32 -- exactness. Kernel and twin evaluate the same fp32 expressions; they differ only in the
order of sums (PE accumulation over 128-row tiles vs torch's BLAS/pairwise sums; the closed-form
parts are identical), i.e. a few fp32 ulps per reduction: y and states <= 1e-4 (measured <= 3.2e-6),
windows (raw fp32 projections, H-term sums) <= 1e-5 (measured <= 4.2e-7).
bfloat16 -- deployment. u, z, b, a, the conv output, o and the gated-norm output are rounded to bf16
exactly where the reference rounds them, but from fp32 values whose last bits depend on the summation
order above; when such a value sits at a rounding boundary the two sides round one bf16 ulp (2^-8
relative) apart. One flipped z (or yg) element of a token moves that token's whole output row by
~2^-8 |yg| |w_out column|: y <= 3e-2 max-normalised and <= 1e-2 relative RMSE (worst measured over ~250
seeded and stress cases: 7.1e-3 and 5.0e-3, one z flip); a flipped k or v element perturbs the state by
~2^-8 |v| |k|: states <= 5e-3 (measured <= 2e-4). Windows are raw projections: each element equal to
the reference or one bf16 ulp away (|d| <= 2^-7 |r|, plus 1e-5 max|r| for sums that cancel to tiny
values), at most 1 % of them differing (measured <= 0.07 %).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import nkisim
from compare import assert_close
from model.config import LINEAR, preset
from model.params import random_params
from model.tp.gdn import GdnDims, gdn_rank, shard_gdn
from nki_kernels import gdn as kg

PREFIX = "model.layers.0"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STRESS = ("repeated_keys", "zero_keys", "strong_decay", "weak_decay", "large")
ARG = {name: f"arg{i}" for i, name in enumerate(("x", "w_in", "conv_w", "A_log", "dt_bias", "norm_w", "w_out",
                                                  "window", "state", "read_slot"))}


def real_cfg():
    """Qwen3.6-35B-A3B with one GDN layer and a token-sized rest (the GDN dims are the real ones)."""
    return preset("qwen3.6-35b-a3b").replace(
        num_hidden_layers=1, layer_types=(LINEAR,), vocab_size=16, num_experts=1, num_experts_per_tok=1,
        moe_intermediate_size=1, shared_expert_intermediate_size=1, mtp_num_hidden_layers=0,
        eos_token_id=(), bos_token_id=None)


_PARAMS = {}


def layer_params(size):
    """(cfg, fp32 params) of one GDN layer, generated once per session."""
    if size not in _PARAMS:
        cfg = real_cfg() if size == "real" else preset("tiny")
        _PARAMS[size] = (cfg, random_params(cfg, seed=1, dtype=torch.float32, include_mtp=False))
    return _PARAMS[size]


def run_case(size, tp, rank, T, lnc, dtype, read_slot=0, slots=4, seed=0, stress=None):
    """Build one rank's inputs, run twin and kernel; returns a dict of both sides' outputs."""
    cfg, p32 = layer_params(size)
    dims = GdnDims.of(cfg, tp)
    g = torch.Generator().manual_seed(seed)
    w = {k: v.clone() for k, v in shard_gdn(p32, PREFIX, cfg, rank, tp).items()}
    x = torch.randn(T, cfg.hidden_size, generator=g)
    window = torch.randn(slots, cfg.conv_window, dims.conv_dim, generator=g)
    state = 0.5 * torch.randn(slots, dims.hv, dims.dk, dims.dv, generator=g)
    kd = dims.key_dim
    if stress == "repeated_keys":        # constant conv input: identical q, k, v for every token
        x[:] = x[0]
        u = x[0:1].to(dtype) @ w["in_proj_qkv"].to(dtype).t()
        window[read_slot] = u.float().expand(cfg.conv_window, -1)
    elif stress == "zero_keys":          # k = silu(0) = 0: l2norm's eps keeps it finite, no state write-back
        w["in_proj_qkv"][kd:2 * kd] = 0
        window[:, :, kd:2 * kd] = 0
    elif stress == "strong_decay":       # g ~ -400 per token: exp(g) underflows to 0, the state is wiped
        w["A_log"][:] = math.log(80.0)
        w["dt_bias"][:] = 5.0
    elif stress == "weak_decay":         # exp(A_log) ~ 1e-13: alpha == 1 in fp32
        w["A_log"][:] = -30.0
    elif stress == "large":
        x *= 30
        window *= 30
        state *= 100
    w = {k: (v if k in ("A_log", "dt_bias") else v.to(dtype)) for k, v in w.items()}
    x, window = x.to(dtype), window.to(dtype)
    part, wins, sts = gdn_rank(dims, w, x, window[read_slot], state[read_slot])
    L = kg.gdn_weight_layout(w, lnc)
    st, wi = state.clone(), window.clone()
    kern = kg.gdn_kernel[2] if lnc == 2 else kg.gdn_kernel
    y, st_out, wi_out = kern(x, L["w_in"], L["conv_w"], L["A_log"], L["dt_bias"], L["norm_w"], L["w_out"], wi, st,
                             torch.tensor([[read_slot]], dtype=torch.int32), cfg.rms_norm_eps)
    return {"T": T, "lnc": lnc, "dtype": dtype, "y": y, "part": part, "wins": wins, "sts": sts, "state": st,
            "window": wi, "state_out": st_out, "window_out": wi_out, "state0": state, "window0": window}


def _nmax(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def check(r):
    T, dtype = r["T"], r["dtype"]
    y, part = r["y"], r["part"]
    assert y.shape == (r["lnc"],) + tuple(part.shape) and y.dtype == torch.float32
    ysum = y.sum(0)
    for name, t in (("y", y), ("state", r["state"]), ("window", r["window"].float())):
        assert torch.isfinite(t).all(), f"{name} has non-finite values"
    assert part.abs().max() > 1e-3 and ysum.abs().max() > 1e-3, "all-zero output"
    # in place, and returned
    assert torch.equal(r["state_out"], r["state"]) and torch.equal(r["window_out"], r["window"])
    # untouched slots
    assert torch.equal(r["state"][T:], r["state0"][T:]) and torch.equal(r["window"][T:], r["window0"][T:])
    bf16 = dtype == torch.bfloat16
    ey = assert_close(ysum, part, rel=3e-2 if bf16 else 1e-4, name="y vs twin")
    es = assert_close(r["state"][:T], r["sts"], rel=5e-3 if bf16 else 1e-4, name="state vs twin")
    rmse = ((ysum - part).norm() / part.norm()).item()
    kw, rw = r["window"][:T].float(), r["wins"].float()
    dw = (kw - rw).abs()
    if not bf16:
        assert _nmax(kw, rw) <= 1e-5
    else:
        assert rmse <= 1e-2, rmse
        assert (dw <= 2.0 ** -7 * rw.abs() + 1e-5 * rw.abs().max()).all()
        assert (dw > 0).float().mean() <= 0.01
    return ey, es


# ---------------------------------------------------------------------------------------------
# parity
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tiny_parity(tp, T, lnc, dtype):
    seed = 100 * tp + 10 * T + lnc
    check(run_case("tiny", tp, seed % tp, T, lnc, DTYPES[dtype], read_slot=seed % 2, seed=seed))


REAL_DEFAULT = [  # (T, lnc, dtype, read_slot): every T, both LNC, both dtypes, both read slots
    (1, 1, "float32", 0),
    (2, 2, "bfloat16", 1),
    (4, 2, "float32", 1),
    (4, 1, "bfloat16", 0),
    (2, 2, "float32", 0),
]
REAL_SLOW = [(T, lnc, dt, rs) for T in (1, 2, 4) for lnc in (1, 2) for dt in DTYPES for rs in (0, 1)
             if (T, lnc, dt, rs) not in REAL_DEFAULT]


@pytest.mark.parametrize("T,lnc,dtype,read_slot", REAL_DEFAULT)
def test_real_parity(T, lnc, dtype, read_slot):
    check(run_case("real", 4, 1, T, lnc, DTYPES[dtype], read_slot=read_slot, seed=T + lnc))


@pytest.mark.slow
@pytest.mark.parametrize("T,lnc,dtype,read_slot", REAL_SLOW)
def test_real_parity_sweep(T, lnc, dtype, read_slot):
    check(run_case("real", 4, (T + lnc) % 4, T, lnc, DTYPES[dtype], read_slot=read_slot, seed=7 * T + lnc))


@pytest.mark.parametrize("stress", STRESS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tiny_stress(stress, dtype):
    r = run_case("tiny", 2, 1, 4, 2, DTYPES[dtype], read_slot=1, seed=3, stress=stress)
    check(r)
    if stress == "strong_decay":      # the state before each token is wiped: S_t = k_t delta_t^T only
        assert r["state"][:4].abs().max() < 10 * r["state0"][1].abs().max()
    if stress == "zero_keys":         # k = 0: no write-back, S_t = alpha^t S_0 exactly as the twin
        assert torch.isfinite(r["sts"]).all()


@pytest.mark.slow
@pytest.mark.parametrize("stress", STRESS)
def test_real_stress(stress):
    check(run_case("real", 4, 2, 4, 2, torch.bfloat16, read_slot=1, seed=11, stress=stress))


def test_read_slot_is_runtime_data():
    """The instruction stream does not depend on the read_slot value (no Python branch on data): the
    executing traces for read_slot 0 and 1 are identical, and the results differ."""
    traces, outs = [], []
    for rs in (0, 1):
        with nkisim.trace.capture() as tr:
            r = run_case("tiny", 4, 3, 2, 2, torch.float32, read_slot=rs, seed=5)
        traces.append(tr.comparable())
        outs.append(r["y"])
        check(r)
    assert traces[0] == traces[1]
    assert not torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# trace at real shapes: bytes moved, LNC split, read/write protocol
# ---------------------------------------------------------------------------------------------

def shape_only_launch(cfg, tp=4, T=2, dtype="bfloat16"):
    """(kernel, args) of one rank's GDN mixer at the config's shapes, LNC=2, ``nkisim.ShapeDtype`` tensors."""
    shapes = kg.kernel_shapes(cfg, tp=tp, T=T, lnc=2, dtype=dtype)
    return kg.gdn_kernel[2], tuple(nkisim.ShapeDtype(s, d) for s, d in shapes.values()) + (float(cfg.rms_norm_eps),)


def _trace(T, dtype="bfloat16"):
    kern, args = shape_only_launch(real_cfg(), tp=4, T=T, dtype=dtype)
    with nkisim.trace.capture() as tr:
        kern(*args)
    return tr, dict(zip(ARG, args))


def _hbm_bytes(tr, arg, kind):
    """Bytes DMA'd from (kind='read') or to (kind='write') the kernel argument ``arg`` (both cores)."""
    side = "reads" if kind == "read" else "writes"
    tot = 0
    for r in tr.instructions:
        if r["op"] == "dma_copy" and r[side] and r[side][0]["name"] == ARG[arg]:
            tot += r["bytes"]["shared_hbm"][kind]
    return tot


def _nbytes(sd):
    return int(np.prod(sd.shape)) * (2 if sd.dtype == "bfloat16" else 4)


@pytest.mark.parametrize("T", [1, 2, 4])
def test_trace_bytes_once(T):
    """Every weight byte is read once per call whatever T is (the per-core weight slices once; the
    replicated 512-byte output-norm weight once by each of the 2 cores that apply it); the fp32 state is
    read once (one slot) and written once per token checkpoint; the window likewise."""
    tr, a = _trace(T)
    for w in ("w_in", "conv_w", "A_log", "dt_bias", "norm_w", "w_out"):
        copies = 2 if w == "norm_w" else 1
        assert _hbm_bytes(tr, w, "read") == copies * _nbytes(a[w]), w
        assert _hbm_bytes(tr, w, "write") == 0, w
    slot_state = _nbytes(a["state"]) // a["state"].shape[0]
    slot_window = _nbytes(a["window"]) // a["window"].shape[0]
    assert _hbm_bytes(tr, "state", "read") == slot_state
    assert _hbm_bytes(tr, "state", "write") == T * slot_state
    assert _hbm_bytes(tr, "window", "read") == slot_window
    assert _hbm_bytes(tr, "window", "write") == T * slot_window
    # the dynamic reads are the only indirect accesses, and they use the register loaded from read_slot
    indirect = [r for r in tr.instructions if any(reg.get("indirect") for reg in r["reads"] + r["writes"])]
    assert len(indirect) == 2 * 3 and all(r["reads"][0]["indirect"] == "scalar" for r in indirect)
    assert sum(1 for r in tr.instructions if r["op"] == "register_load") == 2


def test_trace_structure_real():
    """LNC=2 at real shapes: each core streams its half of the weights with 64 projection matmuls
    (16 hidden tiles x 4 column chunks, weights moving) and 16 out_proj matmuls; no core barrier is
    needed (the cores' heads and window columns are disjoint); the q/k heads' l2norm runs under the v heads' conv
    matmuls, and z's 16 matmuls are deferred past its rsqrt (they fill the PE's idle time of the v heads' conv and
    the recurrence); the ACT function sequence is the copies, softplus, exp (gates, the q/k heads' SiLU),
    {copy, square, rsqrt} (l2norm), exp (the v heads' SiLU, z's SiLU during the recurrence, whose ScalarE work is
    table-free), {copy, square, rsqrt} (gated norm)."""
    tr, _ = _trace(2)
    for core in (0, 1):
        recs = [r for r in tr.instructions if r["inst"] == core]
        mm = [r for r in recs if r["op"] == "nc_matmul"]
        weight_mm = [r for r in mm if r["M"] == 2 and r["K"] == 128 and r["dtypes"]["moving"] == "bfloat16"]
        assert len(weight_mm) == 64 + 16                        # in_proj (16 x 4 chunks) + out_proj (4 x 4)
        assert sum(1 for r in weight_mm if r["N"] == 512) == 48 + 16    # chunks 512, 512, 512, 8 | 4 x 512
        assert not any(r["op"] == "core_barrier" for r in recs)
        funcs = [r["func"] for r in recs if r["engine"] == "ACT" and r.get("func")]    # tensor_copy: no table
        groups = []
        for f in funcs:
            grp = {"copy": "t0", "square": "t0", "rsqrt": "t0"}.get(f, f)
            if not groups or groups[-1] != grp:
                groups.append(grp)
        assert groups == ["t0", "softplus", "exp", "t0", "exp", "t0"], groups
        in_proj_ids = set(id(r) for r in weight_mm[0:64])           # program order: in_proj before out_proj
        in_proj = [i for i, r in enumerate(recs) if id(r) in in_proj_ids]
        l2_rsqrt = [i for i, r in enumerate(recs) if r.get("func") == "rsqrt"][0]
        assert sum(1 for i in in_proj if i > l2_rsqrt) == 16       # z's: the v heads' conv matmuls come before


def test_shared_key_head_uses_barrier_and_single_writer():
    """Tiny TP=4: one key head per rank, shared by both cores. Both compute it, only core 0 writes its
    window columns, and a core_barrier separates the reads from the checkpoint writes."""
    cfg, _ = layer_params("tiny")
    kern, args = shape_only_launch(cfg, tp=4, T=2, dtype="float32")
    with nkisim.trace.capture() as tr:
        kern(*args)
    assert sum(1 for r in tr.instructions if r["op"] == "core_barrier") == 2
    win_writes = {0: 0, 1: 0}
    for r in tr.instructions:
        if r["op"] == "dma_copy" and r["writes"][0]["name"] == ARG["window"]:
            win_writes[r["inst"]] += r["bytes"]["shared_hbm"]["write"]
    assert win_writes[0] == 3 * win_writes[1]       # core 0: q, k and its v head; core 1: its v head
    assert win_writes[0] + win_writes[1] == 2 * _nbytes(args[7]) // args[7].shape[0]    # T = 2 whole slots


def test_core_split():
    s = kg.core_split(4, 8, 2, 1)
    assert (s["hv_c"], s["vh0"], s["kh0"], s["hk_c"], s["key_of"], s["own"], s["shared"]) == \
        (4, 4, 2, 2, [0, 0, 1, 1], (0, 2), False)
    assert s["runs"] == [[0, 0, 2], [1, 2, 4]]
    s = kg.core_split(1, 2, 2, 1)
    assert (s["kh0"], s["hk_c"], s["own"], s["shared"]) == (0, 1, (0, 0), True)
    with pytest.raises(ValueError, match="split"):
        kg.core_split(2, 6, 4, 0)


def test_refusals():
    cfg, p32 = layer_params("tiny")
    w = shard_gdn(p32, PREFIX, cfg, 0, 2)
    L = kg.gdn_weight_layout(w, lnc=2)
    x = torch.randn(2, cfg.hidden_size)
    dims = GdnDims.of(cfg, 2)
    win = torch.zeros(2, 3, dims.conv_dim)
    st = torch.zeros(2, dims.hv, dims.dk, dims.dv)
    rs = torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="laid out for 2 cores"):
        kg.gdn_kernel(x, L["w_in"], L["conv_w"], L["A_log"], L["dt_bias"], L["norm_w"], L["w_out"], win, st, rs,
                      1e-6)
    with pytest.raises(ValueError, match="checkpoint slots"):
        kg.gdn_kernel[2](torch.randn(4, cfg.hidden_size), L["w_in"], L["conv_w"], L["A_log"], L["dt_bias"],
                         L["norm_w"], L["w_out"], win, st, rs, 1e-6)
    bad = dict(w)
    bad["norm"] = torch.ones(16)
    with pytest.raises(ValueError, match="in_proj_z"):
        kg.gdn_weight_layout(bad, lnc=2)
    with pytest.raises(TypeError, match="A_log must be float32"):      # a hardware-DGE DMA cannot cast it
        kg.gdn_kernel[2](x, L["w_in"], L["conv_w"], torch.as_tensor(L["A_log"]).to(torch.bfloat16), L["dt_bias"],
                         L["norm_w"], L["w_out"], win, st, rs, 1e-6)
