"""Byte-level tokenizer of the embedded tiny model: token id = byte value.

Ids 0..255 are the 256 bytes, then the special tokens: ``<|bos|>`` (the config's
``bos_token_id``), ``<|eos|>`` (``eos_token_id``), ``<|pad|>`` and reserved
tokens up to the vocabulary size. Any text round-trips exactly:
``decode(encode(s)) == s`` for every str that UTF-8 can encode, and
``encode(s) == list(s.encode("utf-8"))`` — no BOS is added, no normalisation.

The same mapping is written as a Hugging Face ``tokenizers`` JSON
(``write_tokenizer_files``) so ``transformers.AutoTokenizer.from_pretrained(dir)``
loads it: a byte-level pre-tokenizer maps each byte to one printable character
and a merge-free BPE maps that character to the byte's id; no normalizer. The
special tokens are registered with ``split_special_tokens`` so that text which
happens to spell one (e.g. the string "<|eos|>") is still encoded as its bytes.

transformers 5.x loads the tokenizer of a ``qwen3_5_moe*`` checkpoint with its own
``Qwen3_5Tokenizer`` class whatever ``tokenizer_class`` says, and that class rebuilds
the pipeline from the vocabulary with an NFC normalizer (so "e\u0301" would come back
as "\u00e9"). ``tokenizer_config.json`` therefore sets ``"trust_remote_code": true``:
transformers forwards it to ``convert_to_native_format``, which then loads
``tokenizer.json`` as it is. There is no remote code (no ``auto_map``); the flag only
selects that loading path. ``"unk_token": null`` stops the class adding its default
``<|endoftext|>`` token. ``tests/model/test_embedded.py`` checks the round trip.
"""

from __future__ import annotations

import json
from pathlib import Path

from model.config import ModelConfig

NUM_BYTES = 256
BOS_TEXT, EOS_TEXT, PAD_TEXT = "<|bos|>", "<|eos|>", "<|pad|>"


def encode(text: str) -> list[int]:
    """str -> byte ids (UTF-8). No BOS/EOS is added."""
    return list(text.encode("utf-8"))


def decode(ids, errors: str = "replace") -> str:
    """Byte ids -> str. Special ids (>= 256) are dropped; invalid UTF-8 (e.g. a
    generation cut inside a multi-byte character) becomes U+FFFD with errors="replace"."""
    return bytes(int(i) for i in ids if 0 <= int(i) < NUM_BYTES).decode("utf-8", errors=errors)


def special_tokens(cfg: ModelConfig) -> dict[int, str]:
    """id -> text of every non-byte id in [256, vocab_size)."""
    if cfg.bos_token_id is None or not cfg.eos_token_id:
        raise ValueError("byte tokenizer: the config needs bos_token_id and eos_token_id")
    out = {cfg.bos_token_id: BOS_TEXT, cfg.eos_token_id[0]: EOS_TEXT}
    free = [i for i in range(NUM_BYTES, cfg.vocab_size) if i not in out]
    if not free or min(out) < NUM_BYTES:
        raise ValueError(f"byte tokenizer: specials {sorted(out)} must lie in [256, {cfg.vocab_size}) "
                         "with room for a pad token")
    out[free[0]] = PAD_TEXT
    for n, i in enumerate(free[1:]):
        out[i] = f"<|reserved_{n}|>"
    return dict(sorted(out.items()))


def _byte_to_char() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode char table (what tokenizers' ByteLevel uses)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    table, extra = {}, 0
    for b in range(NUM_BYTES):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(NUM_BYTES + extra)
            extra += 1
    return table


def tokenizer_json(cfg: ModelConfig) -> dict:
    """The ``tokenizers`` JSON (tokenizer.json) of the byte tokenizer."""
    chars = _byte_to_char()
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in special_tokens(cfg).items()]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                          "use_regex": False},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": {chars[b]: b for b in range(NUM_BYTES)}, "merges": []},
    }


def write_tokenizer_files(directory: str | Path, cfg: ModelConfig) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json into directory."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    specials = special_tokens(cfg)
    (d / "tokenizer.json").write_text(json.dumps(tokenizer_json(cfg), ensure_ascii=False, indent=1) + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TEXT,
        "eos_token": EOS_TEXT,
        "pad_token": PAD_TEXT,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": True,
        "unk_token": None,
        "trust_remote_code": True,  # load tokenizer.json as is (see the module doc); no remote code exists
        "model_max_length": cfg.max_position_embeddings,
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, t in specials.items()},
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    (d / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS_TEXT, "eos_token": EOS_TEXT, "pad_token": PAD_TEXT}, indent=1) + "\n")
