"""The reference model against transformers' Qwen3_5MoeForCausalLM (PyTorch fallback paths).

Bound: float32 weights and activations; over a 40-token prompt the logits agree to
max |diff| <= 1e-4 (measured ~2e-5 for the chunked prefill, ~1e-4 for token-by-token
decode, whose recurrent form sums in a different order than HF's chunked prefill),
and 32 greedy tokens are identical.
"""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from harness.speculative import generate
from harness.speculative import make_decoder
from model.params import random_params
from model.reference import ReferenceModel
from model.state import DecodeState

transformers = pytest.importorskip("transformers")


def hf_model(cfg, params):
    hf_cfg = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    hf_cfg._attn_implementation = "eager"
    m = transformers.Qwen3_5MoeForCausalLM(hf_cfg).eval()
    missing, unexpected = m.load_state_dict({k: v for k, v in params.items() if not k.startswith("mtp.")},
                                            strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return m


@pytest.fixture(params=["tiny", "small"], scope="module")
def setup(request, tiny_cfg, small_cfg):
    cfg = tiny_cfg if request.param == "tiny" else small_cfg
    params = random_params(cfg, seed=11, dtype=torch.float32)
    return cfg, params, hf_model(cfg, params)


def test_prefill_and_decode_logits_match(setup):
    cfg, params, m = setup
    ids = torch.randint(0, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        expected = m(ids[None]).logits[0]
    ref = ReferenceModel(cfg, params)
    st = DecodeState.empty(cfg, 48, dtype=torch.float32)
    prefill = ref.logits(ref.trunk(ids, st, 0, chunked=True))
    st = DecodeState.empty(cfg, 48, dtype=torch.float32)
    steps = []
    for i in range(len(ids)):
        steps.append(ref.logits(ref.trunk(ids[i:i + 1], st, i, chunked=False)))
        st.commit(1)
    decode = torch.cat(steps)
    assert prefill.abs().max() > 0.1
    assert_close(prefill, expected, rtol=0, atol=1e-4, name="chunked prefill logits vs transformers")
    assert_close(decode, expected, rtol=0, atol=1e-4, name="token-by-token logits vs transformers")


def test_greedy_tokens_match_generate(setup):
    """Speculative decoding (itself lossless against plain decoding, tests/harness) vs generate."""
    cfg, params, m = setup
    prompt = torch.randint(0, cfg.vocab_size, (12,), generator=torch.Generator().manual_seed(5)).tolist()
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                         eos_token_id=None, pad_token_id=cfg.vocab_size - 1)
    expected = out[0, len(prompt):].tolist()
    res = generate(make_decoder("xla", cfg, params, tp=1), prompt, 32, spec=True)
    assert res.tokens == expected
