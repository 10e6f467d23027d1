"""The NKI prefill pass (``megakernel.prefill``, ``harness.prefill``): its pieces against their references, and the
whole pass against the single-device reference model -- the first token, the tokens decoded after it (plain
greedy), and the decode state it leaves (every GDN state and conv window, every trunk and MTP KV row).

Tolerances (measured at the commit of this file; bounds about 2x the observation):

* RMSNorm prefill vs ``model.functional.rms_norm``: bf16 one rounding step (observed max 1 bf16 ulp at |y| ~ 4:
  rel 2.5e-5 of max), bound rel 1e-2; fp32 bound rel 1e-6.
* The residual all-reduce: fp32 sums in a different order than the host's: bound rel 1e-6.
* The embedded tiny checkpoint (bf16 weights and activations, 8 layers + MTP, TP=4 x LNC=2): the pass rounds
  like the decode kernels, the reference like PyTorch; the state's scale-relative error grows through the
  layers: observed KV rows <= 2.2e-2, conv windows <= 1.3e-2, GDN states <= 2.0e-2 of their max -> bound 5e-2.
* The second config (random fp32 weights, H 256, attention head dim 128, top-2 of 8, 2 chunks): observed
  <= 2.2e-6 -> bound 1e-4.
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from harness.prefill import nki_decoder
from megakernel.prefill import LayerwisePrefill, prefill_chunks, residual_allreduce_stage
from model.config import FULL, LINEAR, preset
from model.functional import rms_norm
from nki_kernels.gdn_prefill import feature_major
from nki_kernels.rmsnorm import rmsnorm_weight_layout
from nki_kernels.rmsnorm_prefill import rmsnorm_prefill_kernel
from tests.compare import assert_close
from tests.decoding import ReferenceDecoder, reference_greedy

TINY_PROMPT = list(b"class Stack:\n    def __init__(self):\n        ")


# ---- pieces ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("N,H,dtype,lnc", [(1, 128, torch.bfloat16, 2), (129, 256, torch.bfloat16, 2),
                                           (600, 2048, torch.bfloat16, 2), (127, 128, torch.float32, 1),
                                           (513, 256, torch.float32, 2)])
def test_rmsnorm_prefill_matches_reference(N, H, dtype, lnc):
    g = torch.Generator().manual_seed(N)
    x = (torch.randn(N, H, generator=g) * 3).to(dtype)
    w = torch.randn(H, generator=g) * 0.1
    kern = rmsnorm_prefill_kernel[lnc] if lnc > 1 else rmsnorm_prefill_kernel
    rows, xT = kern(x, rmsnorm_weight_layout(w), 1e-6)
    want = rms_norm(x, w, 1e-6)
    rel = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert rows.dtype == dtype and xT.dtype == dtype
    assert_close(rows, want, rel=rel, name="rows")
    assert_close(xT, feature_major(want), rel=rel, name="xT")
    (only,) = kern(x, rmsnorm_weight_layout(w), 1e-6, False, True)
    assert torch.equal(only, xT)


@pytest.mark.parametrize("per_core,N,H", [(True, 300, 256), (False, 300, 256), (True, 1024, 256), (False, 130, 256),
                                         (True, 1100, 2048), (False, 1100, 2048)])
def test_residual_allreduce_sums_every_core(per_core, N, H):
    """x + the sum of every core's partials on every core (fp32 sums in the kernel's order: bound rel 1e-6 on fp32
    x), and the fused RMSNorm of the result (rows, xT) equal to the reference norm of the kernel's own residual
    (bf16: one rounding step, bound rel 1e-2). H = 2048 (the real hidden size: groups of 2 sub-tiles) at N = 1100
    runs the software pipeline over 3 / 2 groups per core and a partial last group."""
    import nkisim
    tp = 4
    g = torch.Generator().manual_seed(N)
    parts = [torch.randn((2, N, H) if per_core else (N, H), generator=g) for _ in range(tp)]
    total = sum(p.sum(0) if per_core else p for p in parts)
    x = torch.randn(N, H, generator=g)
    outs = nkisim.launch(residual_allreduce_stage[2], [(x, p, tp, per_core) for p in parts], tp=tp, lnc=2)
    for o in outs:
        assert_close(o, x + total, rel=1e-6)
    xb, w = x.to(torch.bfloat16), torch.randn(H, generator=g) * 0.1
    for layout in ("rows", "xT"):
        outs = nkisim.launch(residual_allreduce_stage[2], [(xb, p, tp, per_core, rmsnorm_weight_layout(w), 1e-6, layout)
                                                           for p in parts], tp=tp, lnc=2)
        res, normed = outs[0]
        assert_close(res, (xb.float() + total).to(torch.bfloat16), rel=1e-2, name="residual")
        want = rms_norm(res, w, 1e-6)
        assert_close(normed, want if layout == "rows" else feature_major(want), rel=1e-2, name=layout)


def test_prefill_chunks():
    assert [(c.start, c.tokens, c.mtp_rows) for c in prefill_chunks(1, 64)] == [(0, 1, 0)]
    assert [(c.start, c.tokens, c.mtp_rows) for c in prefill_chunks(129, 64)] == [(0, 64, 64), (64, 64, 64),
                                                                                   (128, 1, 0)]
    assert [(c.start, c.tokens, c.mtp_rows) for c in prefill_chunks(65, 64, mtp=False)] == [(0, 64, 0), (64, 1, 0)]
    for n in (63, 64, 65, 127, 128):
        ch = prefill_chunks(n, 64)
        assert sum(c.tokens for c in ch) == n and sum(c.mtp_rows for c in ch) == n - 1
    with pytest.raises(ValueError, match="multiple of 64"):
        prefill_chunks(100, 100)
    with pytest.raises(ValueError, match="empty"):
        prefill_chunks(0)


# ---- the whole pass --------------------------------------------------------------------------------------------
def _state_errors(decoder, ref, n, rel):
    got, want = decoder.committed(n), ref.state.committed(n)
    assert set(got) == set(want) and any(k.startswith("mtp_kv") for k in want)
    return {k: assert_close(got[k], want[k], rel=rel, name=k) for k in want}


@pytest.fixture(scope="module")
def embedded():
    from harness.decode import EMBEDDED_MODEL
    from model.weights import load_checkpoint
    return load_checkpoint(EMBEDDED_MODEL, dtype=torch.bfloat16)


def test_tiny_nki_prefill_then_greedy_equals_plain_greedy(embedded):
    """The shipped default: the embedded tiny checkpoint in bf16 on TP=4 x LNC=2, layerwise engine: prefill through
    the NKI prefill kernels, then plain decode steps; the tokens equal plain greedy decoding of the reference and
    the decode state after prefill equals the reference's (tolerances in the module docstring)."""
    from harness.speculative import generate
    cfg, params = embedded
    n_new = 6
    plain = reference_greedy(cfg, params, TINY_PROMPT, n_new)
    assert len(set(plain)) > 2
    v = nki_decoder("layerwise", cfg, params, tp=4)
    res = generate(v, TINY_PROMPT, n_new, spec=False)
    assert res.tokens == plain
    assert v.prefill_info["backend"] == "nki" and v.prefill_info["chunks"] == 1
    ref = ReferenceDecoder(cfg, params)
    ref.prefill(TINY_PROMPT, len(TINY_PROMPT) + n_new + 1)
    v2 = nki_decoder("layerwise", cfg, params, tp=4)
    first, hidden = v2.prefill(TINY_PROMPT, len(TINY_PROMPT) + n_new + 1)
    assert first == plain[0]
    _state_errors(v2, ref, len(TINY_PROMPT), rel=5e-2)


def second_config():
    """A tp-shaped config unlike tiny: hidden 256 (two 128-feature tiles), 4 layers alternating GDN / attention,
    attention head dim 128 with half-rotary RoPE, 64-dim GDN heads, top-2 of 8 experts, vocabulary 304."""
    return preset("tiny").replace(
        vocab_size=304, hidden_size=256, num_hidden_layers=4, layer_types=(LINEAR, FULL, LINEAR, FULL),
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, partial_rotary_factor=0.5, rope_theta=10000.0,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=128, shared_expert_intermediate_size=64,
        bos_token_id=None, eos_token_id=())


@pytest.fixture(scope="module")
def second():
    from model.weights import random_params
    cfg = second_config()
    params = random_params(cfg, seed=3, dtype=torch.float32)
    prompt = [int(i) for i in torch.randint(0, cfg.vocab_size, (70,), generator=torch.Generator().manual_seed(1))]
    return cfg, params, prompt


def test_second_config_two_chunks(second):
    """Random fp32 checkpoint of the second config, 70 prompt tokens in chunks of 64 (state carried from chunk to
    chunk), layerwise engine: the prefill's first token, hidden and decode state equal the reference's, and plain
    decode steps after it give plain greedy's tokens."""
    from harness.speculative import generate
    cfg, params, prompt = second
    ref = ReferenceDecoder(cfg, params)
    _, h_ref = ref.prefill(prompt, len(prompt) + 6)
    plain = reference_greedy(cfg, params, prompt, 3)
    v = nki_decoder("layerwise", cfg, params, tp=4, chunk=64)
    first, hidden = v.prefill(prompt, len(prompt) + 6)
    assert v.prefill_info["chunks"] == 2 and first == plain[0]
    assert_close(hidden, h_ref, rel=1e-4, name="hidden")
    _state_errors(v, ref, len(prompt), rel=1e-4)
    assert generate(v, prompt, 3, spec=False).tokens == plain


@pytest.mark.slow
def test_second_config_megakernel_speculative(second):
    """The megakernel engine after the NKI prefill (2 chunks), MTP speculation: the tokens equal plain greedy."""
    from harness.speculative import generate
    cfg, params, prompt = second
    plain = reference_greedy(cfg, params, prompt, 4)
    res = generate(nki_decoder("megakernel", cfg, params, tp=4, chunk=64), prompt, 4, spec=True)
    assert res.tokens == plain


def test_non_finite_prompt_is_reported(second):
    """A NaN in the chunk's hidden states (a poisoned embedding row) is reported by the first prefill kernel, not
    propagated into the decode state silently."""
    from harness.engines import make_engine
    cfg, params, prompt = second
    bad = dict(params)
    bad["model.embed_tokens.weight"] = params["model.embed_tokens.weight"].clone()
    bad["model.embed_tokens.weight"][prompt[5]] = float("nan")
    eng = make_engine("layerwise", cfg, bad, tp=4)
    eng.start(len(prompt) + 2)
    with pytest.raises(FloatingPointError, match="non-finite"):
        LayerwisePrefill(eng).run(prompt[:20], 64)


def test_nki_prefill_refuses_the_xla_engine(second):
    cfg, params, _ = second
    with pytest.raises(ValueError, match="layerwise and megakernel"):
        nki_decoder("xla", cfg, params, tp=4)


@pytest.mark.slow
def test_tiny_multi_chunk_equals_one_chunk(embedded):
    """The embedded tiny model, a 130-token prompt in chunks of 64 (3 chunks) vs one chunk: same first token,
    states within the bf16 tolerance of each other and of the reference."""
    cfg, params = embedded
    prompt = (TINY_PROMPT * 3)[:130]
    ref = ReferenceDecoder(cfg, params)
    first_ref, _ = ref.prefill(prompt, len(prompt) + 2)
    outs = []
    for chunk in (64, 4096):
        v = nki_decoder("layerwise", cfg, params, tp=4, chunk=chunk)
        outs.append(v.prefill(prompt, len(prompt) + 2)[0])
        _state_errors(v, ref, len(prompt), rel=5e-2)
    assert outs == [first_ref, first_ref]


# ---- the bench command -----------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_prefill_command(tmp_path):
    out = tmp_path / "prefill.json"
    r = subprocess.run([sys.executable, "-m", "harness.bench", "prefill", "--model", "tiny", "--context", "130",
                        "--chunk", "64", "--json", "--quiet", "--output", str(out)], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d == json.loads(out.read_text())
    assert d["context"] == 130 and d["chunks"] == 3 and d["extrapolated_starts"] == []
    t = d["ttft_us"]
    assert 0 < t["low"] <= t["central"] <= t["high"] and np.isfinite(t["high"])
    assert 0 < d["floor_us"] < t["low"]
    assert set(d["parts_us"]) >= {"gdn_prefill", "attention_prefill", "moe_prefill", "all_reduce", "rmsnorm",
                                  "mtp", "lm_head", "embedding", "launch_overhead"}
    assert abs(sum(p["central"] for p in d["parts_us"].values()) - t["central"]) < 1e-6 * t["central"]


def test_bench_prefill_bad_input():
    r = subprocess.run([sys.executable, "-m", "harness.bench", "prefill", "--context", "100", "--chunk", "100"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "multiple of 64" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_prefill_backend_of_each_mode():
    """auto = host for every variant (decode.py compares the variants from one decode state); nki runs the NKI pass
    for the kernel variants only (the xla variant has no NKI kernels and keeps the host model)."""
    from harness.prefill import backend_of
    for v in ("xla", "layerwise", "megakernel"):
        assert backend_of(v, "auto") == backend_of(v, "host") == "xla"
        assert backend_of(v, "teacher-forced") == "teacher-forced"
    assert backend_of("xla", "nki") == "xla"
    assert backend_of("layerwise", "nki") == backend_of("megakernel", "nki") == "nki"
