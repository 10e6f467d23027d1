"""Acceptance of the embedded tiny model's MTP drafts with FR-Spec draft vocabularies (``--draft-vocab N``).

    python scripts/draft_vocab_acceptance.py [--sizes 96,64,32] [--prompts 8] [--tokens 32]

Greedy speculative decoding (K = 1, xla variant, bf16, TP = 4) of held-out prompts (``scripts/train_tiny.py``
``eval_prompts``) with the full vocabulary and with each draft vocabulary of ``model/embedded/tiny/draft_vocab.json``;
prints the acceptance per size, checks that every run decodes the same tokens, writes
bench/draft_vocab_acceptance.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="96,64,32", help="draft vocabulary sizes (multiples of 8)")
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (128 bytes each)")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    args = ap.parse_args(argv)
    import torch

    from harness.speculative import generate, make_decoder
    from model import draft_vocab
    from model.weights import load_checkpoint
    from scripts.train_tiny import eval_prompts, is_held_out, stdlib_files
    tiny = ROOT / "model" / "embedded" / "tiny"
    cfg, params = load_checkpoint(tiny, dtype=torch.bfloat16)
    stdlib, files = stdlib_files()
    prompts = eval_prompts(stdlib, [f for f in files if is_held_out(f)], args.prompts, 128)
    results, first = {}, None
    for n in [None] + [int(s) for s in args.sizes.split(",")]:
        ids = None if n is None else draft_vocab.load(tiny, n, cfg.vocab_size, 8)
        v = make_decoder("xla", cfg, params, tp=4, draft_ids=ids)
        runs = [generate(v, p, args.tokens, eos_ids=cfg.eos_token_id, spec=True) for _, p in prompts]
        tokens = [r.tokens for r in runs]
        first = tokens if first is None else first
        rounds = sum(r.rounds for r in runs)
        acc = sum(r.acceptance_rate * r.rounds for r in runs) / rounds
        results["full" if n is None else str(n)] = {"acceptance": acc, "rounds": rounds,
                                                    "tokens_equal_full_vocabulary": tokens == first}
        print(f"{'full' if n is None else n:>6}: acceptance {acc:.3f} over {rounds} rounds, same tokens "
              f"{tokens == first}", flush=True)
    out = {"command": "python scripts/draft_vocab_acceptance.py " + " ".join(argv or sys.argv[1:]),
           "model": "embedded tiny (bf16)", "variant": "xla", "tp": 4, "drafts": 1, "prompts": len(prompts),
           "new_tokens": args.tokens, "prompt_source": "scripts/train_tiny.py eval_prompts (held-out stdlib files)",
           "draft_vocab_source": json.loads((tiny / draft_vocab.FILE).read_text())["source"], "results": results}
    (ROOT / "bench" / "draft_vocab_acceptance.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0 if all(r["tokens_equal_full_vocabulary"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
