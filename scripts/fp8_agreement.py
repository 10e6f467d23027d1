"""How far fp8 experts move the embedded tiny model's output (issue 15 "fp8 experts", an opt-in experiment).

    python scripts/fp8_agreement.py [--prompts 8] [--tokens 32]

The tiny checkpoint (bf16) and the same checkpoint with its routed experts quantised to float8_e4m3 with
per-channel scales (``model.tp.moe.quantize_fp8``) decode held-out prompts (``scripts/train_tiny.py``
``eval_prompts``) with the xla variant (TP = 4, K = 1 speculative rounds, greedy), whose MoE is the twin of the fp8
kernel (``model.tp.moe.moe_rank`` of a quantised shard: the kernel's rounding points, parity-tested against
``nki_kernels.moe``). Both prefill teacher-forced through their own decode launches, so every MoE of the fp8 run
is fp8. Reports, per prompt and in total: generated tokens equal to the bf16 run's (position by position) and the
first divergence; and, teacher-forcing BOTH models along the bf16 run's tokens (plain steps), the max |logit
difference| over all positions and how often the two argmaxes agree. Writes bench/decode_fp8_agreement.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _decoder(cfg, params):
    from harness.engines import make_engine
    from harness.speculative import Decoder
    return Decoder(make_engine("xla", cfg, params, tp=4), None)     # teacher-forced prefill on the engine


def _forced_logits(cfg, params, prompt, tokens):
    """Logits [n, V] fp32 of the model after the prompt and after each of tokens[:-1] (plain greedy steps forced
    along ``tokens``): row i predicts tokens[i]."""
    import torch

    from model.reference import ReferenceModel
    d, head = _decoder(cfg, params), ReferenceModel(cfg, params)
    _, h = d.prefill(prompt, max_len=len(prompt) + len(tokens) + 2)
    rows = [h]
    for i, t in enumerate(tokens[:-1]):
        _, h = d.step(t, len(prompt) + i)
        rows.append(h)
    return head.logits(torch.stack(rows))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=8, help="held-out prompts (128 bytes each), default 8")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens per prompt, default 32")
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 2:
        print("fp8_agreement: need --prompts >= 1 and --tokens >= 2", file=sys.stderr)
        return 2
    import torch
    from tqdm import tqdm

    from harness.speculative import generate
    from model.tp.moe import quantize_fp8
    from model.weights import load_checkpoint
    from scripts.train_tiny import eval_prompts, is_held_out, stdlib_files
    tiny = ROOT / "model" / "embedded" / "tiny"
    cfg, params = load_checkpoint(tiny, dtype=torch.bfloat16)
    fp8 = quantize_fp8(params)
    stdlib, files = stdlib_files()
    prompts = eval_prompts(stdlib, [f for f in files if is_held_out(f)], args.prompts, 128)
    rows = []
    for name, prompt in tqdm(prompts, desc="prompts", file=sys.stderr):
        runs = [generate(_decoder(cfg, p), prompt, args.tokens, spec=True) for p in (params, fp8)]
        a, b = runs[0].tokens, runs[1].tokens
        n = min(len(a), len(b))
        same = sum(1 for i in range(n) if a[i] == b[i])
        first = next((i for i in range(n) if a[i] != b[i]), n)
        la, lb = (_forced_logits(cfg, p, prompt, a) for p in (params, fp8))
        diff = (la - lb).abs()
        rows.append({"prompt": name, "tokens": n, "equal_tokens": same, "first_divergence": first,
                     "bf16_acceptance": runs[0].acceptance_rate, "fp8_acceptance": runs[1].acceptance_rate,
                     "max_abs_logit_diff": float(diff.max()), "max_abs_logit_bf16": float(la.abs().max()),
                     "forced_argmax_agree": int((la.argmax(1) == lb.argmax(1)).sum()), "forced_positions": len(a)})
        print(f"{name[:40]:40s} equal {same}/{n}, first divergence {first}, max |dlogit| {rows[-1]['max_abs_logit_diff']:.3f}"
              f" (max |logit| {rows[-1]['max_abs_logit_bf16']:.2f}), forced argmax agree "
              f"{rows[-1]['forced_argmax_agree']}/{len(a)}", flush=True)
    tot = {k: sum(r[k] for r in rows) for k in ("tokens", "equal_tokens", "forced_argmax_agree", "forced_positions")}
    tot["max_abs_logit_diff"] = max(r["max_abs_logit_diff"] for r in rows)
    tot["prompts_identical"] = sum(1 for r in rows if r["equal_tokens"] == r["tokens"])
    print(f"total: {tot['equal_tokens']}/{tot['tokens']} tokens equal to the bf16 run, {tot['prompts_identical']}/"
          f"{len(rows)} prompts identical, max |logit difference| {tot['max_abs_logit_diff']:.3f}, forced argmax agree "
          f"{tot['forced_argmax_agree']}/{tot['forced_positions']}")
    out = {"command": "python scripts/fp8_agreement.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "model": "embedded tiny (bf16; fp8: routed experts float8_e4m3, per-channel scales)", "variant": "xla",
           "tp": 4, "drafts": 1, "prefill": "teacher-forced through the decode launches", "prompts": len(rows),
           "new_tokens": args.tokens, "prompt_source": "scripts/train_tiny.py eval_prompts (held-out stdlib files)",
           "total": tot, "per_prompt": rows}
    (ROOT / "bench" / "decode_fp8_agreement.json").write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
