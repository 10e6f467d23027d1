"""FR-Spec draft vocabulary: the token ids the MTP draft may propose, ranked by measured frequency.

FR-Spec (arXiv 2502.14856) restricts the *draft's* LM head to the most frequent tokens of a corpus; the verify
keeps the full vocabulary, so the decoded tokens are unchanged (a token outside the subset is simply never drafted;
only acceptance can drop). Here the draft head is the rows of ``lm_head.weight`` (or the tied embedding) of the
subset, split evenly over the TP x LNC cores like the full head (``megakernel.sharded``); the draft is the argmax over
those rows, lowest token id on ties, mapped back to its token id.

The subset is data: ``draft_vocab.json`` next to the checkpoint, written once at conversion time by

    python -m model.draft_vocab --model-path DIR --corpus PATH [PATH ...]      # tokenizer of DIR, files or dirs
    python -m model.draft_vocab --model-path model/embedded/tiny --tiny-training-text

``--tiny-training-text`` counts the embedded tiny model's own training text (the Python stdlib ``.py`` files
``scripts/train_tiny.py`` trains on, held-out files excluded). The file holds every vocabulary id ranked by its
count in the corpus (ties and unseen ids by ascending id), the counts and the source; :func:`load` takes the first
N. ``python harness/decode.py --draft-vocab N`` uses it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path

import numpy as np

FILE = "draft_vocab.json"


def rank(counts: Counter, vocab_size: int) -> list[int]:
    """Every id in [0, vocab_size) by descending count, ties (and unseen ids) by ascending id."""
    return sorted(range(vocab_size), key=lambda i: (-counts.get(i, 0), i))


def build(counts: Counter, vocab_size: int, source: str) -> dict:
    """The file's content for token counts measured on ``source`` (a sentence naming the corpus and tokenizer)."""
    bad = [i for i in counts if not 0 <= i < vocab_size]
    if bad:
        raise ValueError(f"draft vocab: counted ids outside the vocabulary [0, {vocab_size}): {sorted(bad)[:5]}")
    ids = rank(counts, vocab_size)
    return {"source": source, "vocab_size": vocab_size, "tokens_counted": int(sum(counts.values())),
            "ids": ids, "counts": [int(counts.get(i, 0)) for i in ids]}


def load(model_path: Path, n: int, vocab_size: int, n_cores: int) -> np.ndarray:
    """The ``n`` most frequent ids of ``model_path/draft_vocab.json``, ascending, int32 (ascending keeps the draft's
    tie rule -- lowest token id among equal logits -- a lowest-index rule over the subset). ``n`` must be in
    [1, vocab_size] and a multiple of ``n_cores`` (the draft head splits evenly over the cores)."""
    path = Path(model_path) / FILE
    if not path.is_file():
        raise ValueError(f"draft vocab: {path} not found (build it: python -m model.draft_vocab --model-path "
                         f"{model_path} --corpus ...)")
    d = json.loads(path.read_text())
    if d.get("vocab_size") != vocab_size or len(d.get("ids", ())) != vocab_size:
        raise ValueError(f"draft vocab: {path} ranks {len(d.get('ids', ()))} ids of a {d.get('vocab_size')}-token "
                         f"vocabulary; the checkpoint has {vocab_size}")
    if not 1 <= n <= vocab_size:
        raise ValueError(f"draft vocab: N = {n} must be in [1, {vocab_size}]")
    if n % n_cores:
        raise ValueError(f"draft vocab: N = {n} must be a multiple of the {n_cores} TP x LNC cores the draft head "
                         f"splits over")
    return np.sort(np.asarray(d["ids"][:n], dtype=np.int32))


def draft_head_rows(params: dict, cfg, ids, part: int, parts: int):
    """Part ``part`` of ``parts`` of the draft head: the LM-head rows (``lm_head.weight``, or the tied embedding) of
    ``ids[part * n:(part + 1) * n]``, n = len(ids) / parts -> [n, H] (PyTorch layout; also on ``meta`` tensors)."""
    import torch

    from model.tp.embed_head import lm_head_weight
    if len(ids) % parts or not 0 <= part < parts:
        raise ValueError(f"draft vocab: {len(ids)} ids do not split into {parts} parts (part {part})")
    n = len(ids) // parts
    sel = torch.as_tensor(np.asarray(ids[part * n:(part + 1) * n], dtype=np.int64))
    return lm_head_weight(params, cfg).index_select(0, sel.to(lm_head_weight(params, cfg).device))


def count_files(paths, encode) -> Counter:
    """Token counts of every file under ``paths`` (files, or directories read recursively in sorted order)."""
    counts: Counter = Counter()
    for p in paths:
        p = Path(p)
        files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
        for f in files:
            counts.update(encode(f.read_text(encoding="utf-8", errors="replace")))
    return counts


def _tiny_training_counts(cfg):
    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root))
    from model.tokenizer import encode
    from scripts.train_tiny import is_held_out, stdlib_files
    stdlib, files = stdlib_files()
    train = [stdlib / f for f in files if not is_held_out(f)]
    source = (f"byte counts of the embedded tiny model's training text: {len(train)} Python stdlib .py files "
              f"(scripts/train_tiny.py: stdlib_files, held-out files excluded), model/tokenizer.py byte mapping, "
              f"one <|bos|> and one <|eos|> per file as in training")
    counts = count_files(train, encode)
    for special in ((cfg.bos_token_id,) if cfg.bos_token_id is not None else ()) + tuple(cfg.eos_token_id):
        counts[special] += len(train)
    return counts, source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m model.draft_vocab", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-path", type=Path, required=True, help="checkpoint directory (config.json, tokenizer)")
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--corpus", nargs="+", help="text files or directories to count with the checkpoint's tokenizer")
    src.add_argument("--tiny-training-text", action="store_true",
                     help="the embedded tiny model's training text (Python stdlib sources)")
    args = ap.parse_args(argv)
    from model.config import ConfigError, ModelConfig
    try:
        cfg = ModelConfig.from_json_file(args.model_path / "config.json")
    except (OSError, ConfigError, ValueError) as e:
        print(f"draft_vocab: {e}", file=sys.stderr)
        return 2
    if args.tiny_training_text:
        counts, source = _tiny_training_counts(cfg)
    else:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(args.model_path), local_files_only=True)
        counts = count_files(args.corpus, lambda s: tok.encode(s, add_special_tokens=False))
        source = f"token counts of {', '.join(args.corpus)} with the checkpoint's tokenizer"
    out = args.model_path / FILE
    out.write_text(json.dumps(build(counts, cfg.vocab_size, source)) + "\n")
    print(f"wrote {out}: {cfg.vocab_size} ids ranked over {sum(counts.values()):,} tokens")
    return 0


if __name__ == "__main__":
    sys.exit(main())
