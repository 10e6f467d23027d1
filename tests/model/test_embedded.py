"""The shipped default model (model/embedded/tiny, trained by scripts/train_tiny.py).

Its layout and dtypes, lossless speculation with a real acceptance rate on fixed
prompts, and its byte-level tokenizer through transformers' AutoTokenizer.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from harness import decode
from harness.speculative import generate
from harness.speculative import make_decoder
from model import tokenizer as byte_tok
from model.config import preset
from model.params import expected_shapes, is_fp32_param
from model.weights import load_checkpoint

EMBEDDED = Path(__file__).resolve().parents[2] / "model" / "embedded" / "tiny"
NEW_TOKENS = 64
# Prompts whose greedy continuation is text, not a run of spaces (which any draft
# predicts): "def f(n):\n    " makes this small model indent forever.
PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n        ",
    "    def __repr__(self):\n        return ",
]
# Measured with the shipped bf16 weights: 89 of 102 drafts accepted on these prompts
# (0.87); bench/tiny_acceptance.json has the held-out benchmark (0.896 over 50 prompts).
# The floor leaves room for argmax near-ties resolving differently on other CPUs.
ACCEPTANCE_FLOOR = 0.6


@functools.lru_cache(maxsize=None)
def hf_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(EMBEDDED), local_files_only=True)


@pytest.fixture(scope="module")
def shipped():
    return load_checkpoint(EMBEDDED, dtype=torch.bfloat16)


@pytest.fixture
def one_thread():
    """Batch-1 decode ops are too small to gain from threads; one thread also keeps
    the test fast when other processes share the cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_files_size_and_dtypes():
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md"):
        assert (EMBEDDED / name).is_file(), f"{EMBEDDED}: missing {name}"
    total = sum(p.stat().st_size for p in EMBEDDED.iterdir() if p.is_file())
    assert total <= 20e6, f"embedded model is {total / 1e6:.1f} MB, the budget is 20 MB"
    cfg, stored = load_checkpoint(EMBEDDED, dtype=None)
    assert cfg == preset("tiny")
    assert {k: tuple(v.shape) for k, v in stored.items()} == expected_shapes(cfg)
    for name, t in stored.items():
        want = torch.float32 if is_fp32_param(name) else torch.bfloat16
        assert t.dtype == want, f"{name}: stored as {t.dtype}, expected {want}"
        assert torch.isfinite(t.float()).all(), name
    # trained, not the initialisation: the norm offsets start at exactly 0
    assert stored["model.norm.weight"].abs().max() > 0 and stored["mtp.norm.weight"].abs().max() > 0


def test_transformers_loads_the_trunk():
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(EMBEDDED), local_files_only=True, dtype=torch.bfloat16)
    _, params = load_checkpoint(EMBEDDED, dtype=torch.bfloat16)
    sd = model.state_dict()
    trunk = [k for k in params if not k.startswith("mtp.")]
    assert sorted(sd) == sorted(trunk)
    assert all(torch.equal(sd[k], params[k].to(sd[k].dtype)) for k in trunk)


def test_speculation_is_lossless_and_accepts_drafts(shipped, one_thread):
    cfg, params = shipped
    variant = make_decoder("xla", cfg, params, tp=1)
    rounds = accepted = 0
    for text in PROMPTS:
        ids = byte_tok.encode(text)
        spec = generate(variant, ids, NEW_TOKENS, spec=True)
        plain = generate(variant, ids, NEW_TOKENS, spec=False)
        assert spec.tokens == plain.tokens, f"speculation changed the output for prompt {text!r}"
        assert len(spec.tokens) == NEW_TOKENS
        rounds += spec.rounds
        accepted += sum(a - 1 for a in spec.accepted_per_round)
    rate = accepted / rounds
    assert rate >= ACCEPTANCE_FLOOR, f"acceptance {rate:.3f} over {rounds} rounds is below {ACCEPTANCE_FLOOR}"


def test_benchmark_record_matches_target():
    bench = Path(__file__).resolve().parents[2] / "bench" / "tiny_acceptance.json"
    d = json.loads(bench.read_text())
    assert d["prompts"] >= 50 and d["new_tokens_per_prompt"] >= 64
    assert d["spec_equals_plain_greedy"]
    assert d["acceptance_rate"] >= 0.5 and d["tokens_per_round"] >= 1.5


@settings(max_examples=200, deadline=None)
@given(st.text())
@example("e\u0301 \u212b \ufb01")  # not NFC: a normalizing tokenizer would change these
@example("\x00\r\n\t  \U0001f600 <|eos|>")
def test_tokenizer_round_trips_any_text(text):
    tok = hf_tokenizer()
    ids = tok.encode(text, add_special_tokens=False)
    assert ids == list(text.encode("utf-8")) == byte_tok.encode(text)
    assert tok.decode(ids) == text == byte_tok.decode(ids, errors="strict")


@settings(max_examples=100, deadline=None)
@given(st.binary())
def test_byte_ids_round_trip(data):
    ids = list(data)
    assert bytes(ids) == data
    assert byte_tok.decode(ids) == data.decode("utf-8", errors="replace")


def test_tokenizer_special_tokens():
    cfg = preset("tiny")
    tok = hf_tokenizer()
    assert len(tok) == cfg.vocab_size
    assert tok.bos_token_id == cfg.bos_token_id and tok.eos_token_id == cfg.eos_token_id[0]
    # text that spells a special token is still just bytes
    assert tok.encode("<|eos|><|bos|>", add_special_tokens=False) == list(b"<|eos|><|bos|>")
    assert tok.decode([cfg.bos_token_id, *b"x = 1", cfg.eos_token_id[0]], skip_special_tokens=True) == "x = 1"


def test_prompt_through_the_cli(capsys, one_thread):
    text = "def fibonacci(n):\n    "
    code = decode.main(["--prompt", text, "--max-new-tokens", "16", "--variant", "xla", "--json"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert len(d["tokens"]) == 16
    assert d["text"] == hf_tokenizer().decode(d["tokens"])
    cfg, params = load_checkpoint(EMBEDDED, dtype=torch.bfloat16)
    assert generate(make_decoder("xla", cfg, params), list(text.encode()), 16,
                    eos_ids=cfg.eos_token_id).tokens == d["tokens"]
