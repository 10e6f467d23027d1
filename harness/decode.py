"""Speculative decoding of a Qwen3.5/3.6-MoE checkpoint from the command line.

    python harness/decode.py                              # embedded tiny model, every variant
    python harness/decode.py --prompt "def main(" --max-new-tokens 48 --variant xla
    python harness/decode.py --model-path DIR --prompt-ids 1,2,3 --json
    python harness/decode.py --num-draft-tokens 3 --variant megakernel
    python harness/decode.py --variant megakernel --device-commit   # rounds back to back, accept on device
    python harness/decode.py --variant megakernel --device-commit --temperature 0.7 --seed 1

Each round drafts K tokens with the MTP head (--num-draft-tokens, chained: each
draft runs on the previous one and the head's own hidden), verifies [pending,
d_1 .. d_K] with the trunk and keeps the longest matching prefix plus one token
(1 .. K + 1 tokens); the output equals plain greedy decoding (--no-spec).

    python harness/decode.py --variant xla --temperature 0.7 --top-k 20 --top-p 0.9 --seed 1 --num-samples 4
    python harness/decode.py --variant megakernel --temperature 0.7 --seed 1 --num-draft-tokens 2

--device-commit (megakernel, speculative): each round accepts on device and writes the
next round's pending token, read slot, position and hidden into decode state, taking
its RoPE rows from a table by position (sampled: its Gumbel noise rows from a window
the host keeps ahead, also by position); the host launches the rounds back to back and
only reads the emitted tokens (to stop at EOS / --max-new-tokens). Same tokens, greedy
or sampled with the same --seed.

Sampling is lossless in every variant (harness/sampling.py): the committed tokens are
distributed exactly as plain sampling from the model; the same --seed gives the same
tokens. xla: the drafts are sampled from the MTP head and the standard speculative
rejection rule decides (--top-k / --top-p supported). layerwise / megakernel: shared
Gumbel noise per position, the kernels' LM heads take argmax(logit + T * noise) and the
greedy accept rule stays (the output equals plain Gumbel-max sampling with the same
noise); --temperature only, no --top-k / --top-p. The schemes differ, so sampling runs
one --variant at a time.
Bad input prints one line to stderr and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

# Waiting OpenMP threads sleep instead of spinning: on a machine shared with other work, spinning made
# batch-1 decoding ~20x slower (same tokens either way).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from harness.engines import ENGINE_NAMES as VARIANT_NAMES  # noqa: E402
from harness import prefill  # noqa: E402
from harness.sampling import Sampling  # noqa: E402
from harness.speculative import DecodeResult, generate  # noqa: E402
from megakernel.plan import DEFAULT_DRAFTS, MAX_DRAFTS  # noqa: E402
from model.config import ConfigError  # noqa: E402

EMBEDDED_MODEL = Path(__file__).resolve().parent.parent / "model" / "embedded" / "tiny"
DEFAULT_PROMPT = "class Stack:\n    def __init__(self):\n        "
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class UsageError(Exception):
    """Bad input from the user: reported as one line, exit status 2."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="decode.py", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Variants: xla = the plain PyTorch model (the tensor-parallel twins, one thread per rank); layerwise = one NKI launch per layer stage with "
               "host-side reductions; megakernel = one NKI launch per round (draft + verify + replay). "
               "Without Trainium the NKI variants run under nkisim, the CPU interpreter: correct but slow "
               "(seconds per round even for the tiny model).")
    ap.add_argument("--model-path", type=Path, default=EMBEDDED_MODEL,
                    help="Hugging Face checkpoint directory (config.json + safetensors [+ tokenizer]); "
                         "default: the embedded tiny model")
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer files)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids, e.g. 1,2,3")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate (default 64)")
    ap.add_argument("--variant", default="all", choices=[*VARIANT_NAMES, "all"],
                    help="which implementation runs the rounds; 'all' runs each and compares (default)")
    ap.add_argument("--tp", type=int, default=4, choices=[1, 2, 4],
                    help="simulated tensor-parallel degree of every variant (LNC=2 cores per rank; "
                         "default 4 = one trn2 chip)")
    ap.add_argument("--no-spec", action="store_true", help="plain greedy decoding, no MTP speculation")
    ap.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFTS, metavar="K",
                    help=f"chained MTP drafts per round, 1..{MAX_DRAFTS} (default {DEFAULT_DRAFTS}); the verify runs "
                         f"K + 1 tokens")
    ap.add_argument("--device-commit", action="store_true",
                    help="megakernel: accept and commit on device, so rounds launch back to back and the host only "
                         "reads the emitted tokens (speculation only; greedy, or --temperature > 0 with --variant "
                         "megakernel; with --variant all it applies to the megakernel variant; default: the host "
                         "accepts and builds each round's inputs)")
    ap.add_argument("--draft-vocab", type=int, default=None, metavar="N",
                    help="FR-Spec: the drafts choose among the N most frequent tokens only (draft_vocab.json of the "
                         "checkpoint, python -m model.draft_vocab); the verify keeps the full vocabulary, so the "
                         "output is unchanged; N a multiple of 2 x --tp (default: off, full vocabulary; with "
                         "--temperature > 0: layerwise / megakernel only)")
    ap.add_argument("--draft-head", default="bf16", choices=["bf16", "fp8"],
                    help="the drafts' LM head: bf16 (default, the verify's own) or fp8 (opt-in: e4m3 codes, one scale "
                         "per core shard, half the draft head's bytes; --variant megakernel, bf16 checkpoints, "
                         "speculation only; the verify keeps the bf16 head, so the output is unchanged and only "
                         "acceptance can drop)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy); > 0 samples, losslessly: xla by the rejection "
                         "rule, layerwise / megakernel by shared Gumbel noise in the kernels (one --variant)")
    ap.add_argument("--top-k", type=int, default=None,
                    help="sample among the k most likely tokens (>= 1; --variant xla only)")
    ap.add_argument("--top-p", type=float, default=1.0,
                    help="nucleus sampling mass in (0, 1] (default 1: off; --variant xla only)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0); sample i uses seed + i")
    ap.add_argument("--num-samples", type=int, default=1, metavar="N",
                    help="independent sampled sequences from the same prompt (default 1; --json: 'samples')")
    ap.add_argument("--dtype", default="bfloat16", choices=list(DTYPES), help="weight/activation dtype")
    ap.add_argument("--prefill", default="auto", choices=["auto", "nki", "host", "teacher-forced"],
                    help="how the prompt is encoded: nki = the NKI prefill kernels, chunk by chunk (harness/prefill.py); "
                         "host = the PyTorch model on the host hands its state over; teacher-forced = through the "
                         "decode launches; auto (default) = host for every variant (one decode state to compare; "
                         "in bfloat16 the NKI pass rounds differently and greedy tokens can part after a near tie)")
    ap.add_argument("--prefill-chunk", type=int, default=None,
                    help="prompt tokens per NKI prefill chunk (a multiple of 64; default 4096)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text (with the prefill's "
                                                        "predicted trn2 time: a few shape-only traces)")
    return ap.parse_args(argv)


def load_tokenizer(path: Path, required: bool):
    """AutoTokenizer from local files only; None if the checkpoint has none and none is required."""
    has_files = any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    if not has_files:
        if required:
            raise UsageError(f"{path}: no tokenizer files; give --prompt-ids instead of --prompt")
        return None
    from transformers import AutoTokenizer
    try:
        return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # a broken tokenizer file
        if required:
            raise UsageError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
        return None


def prompt_ids(args, cfg, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--prompt-ids: expected comma-separated integers, found {args.prompt_ids!r}") from None
    else:
        text = args.prompt if args.prompt is not None else DEFAULT_PROMPT
        if tokenizer is None:
            raise UsageError(f"{args.model_path}: no tokenizer files; give --prompt-ids")
        ids = list(tokenizer.encode(text, add_special_tokens=False))
    if not ids:
        raise UsageError("the prompt is empty")
    bad = [i for i in ids if not 0 <= i < cfg.vocab_size]
    if bad:
        raise UsageError(f"prompt token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, found {args.max_new_tokens}")
    if len(ids) + args.max_new_tokens > cfg.max_position_embeddings:
        raise UsageError(f"prompt ({len(ids)} tokens) + --max-new-tokens ({args.max_new_tokens}) exceeds the "
                         f"context of {cfg.max_position_embeddings} positions")
    return ids


def build_variants(names, cfg, params, args) -> dict:
    """Every requested variant, built before any decoding so that an unsupported config fails first."""
    out = {}
    for name in names:
        try:
            commit = {"device_commit": True} if args.device_commit and name == "megakernel" else {}
            out[name] = prefill.make_variant(name, cfg, params, args.tp, args.prefill, args.prefill_chunk,
                                             drafts=args.num_draft_tokens, **draft_vocab_kw(cfg, args),
                                             **draft_head_kw(name, args), **commit)
        except ValueError as e:
            if str(e).startswith(("--prefill", "prefill:")):
                raise UsageError(str(e)) from None
            raise UsageError(f"--variant {name}: {e} (every variant is sharded over --tp {args.tp} ranks x 2 "
                             f"cores; try a smaller --tp)") from None
    return out


def draft_head_kw(name: str, args) -> dict:
    """``{"draft_fp8": True}`` for --draft-head fp8 (variant ``name``), or {} for the default bf16 head."""
    if getattr(args, "draft_head", "bf16") == "bf16":
        return {}
    if args.no_spec or name != "megakernel":
        raise UsageError(f"--draft-head fp8 is the megakernel's drafts' head: it needs speculation (no --no-spec) and "
                         f"--variant megakernel (found {name})")
    return {"draft_fp8": True}


def draft_vocab_kw(cfg, args) -> dict:
    """``{"draft_ids": ...}`` for --draft-vocab N (``model.draft_vocab.load``), or {} when off."""
    if args.draft_vocab is None:
        return {}
    if args.no_spec or (getattr(args, "temperature", 0) > 0 and args.variant not in GUMBEL_VARIANTS):
        raise UsageError("--draft-vocab restricts the MTP drafts: it needs speculation (no --no-spec), and with "
                         f"--temperature > 0 --variant {' / '.join(GUMBEL_VARIANTS)}")
    from model import draft_vocab
    try:
        return {"draft_ids": draft_vocab.load(args.model_path, args.draft_vocab, cfg.vocab_size, 2 * args.tp)}
    except ValueError as e:
        raise UsageError(f"--draft-vocab: {e}") from None


def run_variant(name, variant, ids, args, cfg, sampling=None, sample: int = 0
                ) -> tuple[DecodeResult, float, int | None]:
    """Decode with one variant: (result, seconds, launches: NKI kernel launches, or XLA graphs for xla)."""
    bar = tqdm(total=args.max_new_tokens, desc=f"{name:>10}", unit="tok", leave=False,
               disable=args.json or not sys.stderr.isatty())
    t0, launches0 = time.perf_counter(), variant.launches
    res = generate(variant, ids, args.max_new_tokens, eos_ids=cfg.eos_token_id, spec=not args.no_spec,
                   on_tokens=lambda toks: bar.update(len(toks)), sampling=sampling, sample=sample)
    bar.close()
    return res, time.perf_counter() - t0, variant.launches - launches0


SAMPLING_VARIANTS = ("xla", "layerwise", "megakernel")
GUMBEL_VARIANTS = ("layerwise", "megakernel")     # sample in the kernels by shared Gumbel noise: temperature only


def check_args(args) -> Sampling | None:
    """Flag values that need no checkpoint (one-line errors, nothing run) -> the sampling settings (None: greedy)."""
    if not 1 <= args.num_draft_tokens <= MAX_DRAFTS:
        raise UsageError(f"--num-draft-tokens must be in 1..{MAX_DRAFTS}, found {args.num_draft_tokens}")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, found {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise UsageError(f"--top-k must be >= 1, found {args.top_k}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top-p must be in (0, 1], found {args.top_p}")
    if args.num_samples < 1:
        raise UsageError(f"--num-samples must be >= 1, found {args.num_samples}")
    if args.device_commit:
        if args.variant not in ("megakernel", "all"):
            raise UsageError(f"--device-commit runs in the megakernel variant (got --variant {args.variant})")
        if args.no_spec:
            raise UsageError("--device-commit accepts speculative rounds on device: it needs speculation "
                             "(no --no-spec)")
    sampling_flags = args.top_k is not None or args.top_p != 1 or args.num_samples > 1
    if args.temperature == 0:
        if sampling_flags:
            raise UsageError("--top-k / --top-p / --num-samples need --temperature > 0 (temperature 0 is greedy)")
        return None
    if args.variant not in SAMPLING_VARIANTS:
        raise UsageError(f"sampling (--temperature > 0) runs one --variant at a time ({' / '.join(SAMPLING_VARIANTS)}):"
                         f" xla (rejection rule) and the kernel variants (shared Gumbel noise) draw different samples "
                         f"(got --variant {args.variant})")
    if args.variant in GUMBEL_VARIANTS and (args.top_k is not None or args.top_p != 1):
        raise UsageError(f"--variant {args.variant} samples with --temperature only; --top-k / --top-p run on "
                         f"--variant xla")
    if args.variant in GUMBEL_VARIANTS and args.prefill == "nki":
        raise UsageError("--prefill nki returns no logits to sample the first token from; with --temperature > 0 "
                         "use --prefill host or teacher-forced")
    return Sampling(args.temperature, args.top_k or 0, args.top_p, args.seed)


def predicted_prefill(cfg, ids, args, variants) -> dict:
    """{variant: predicted trn2 prefill band (us)} of the variants that prefill on the device: the NKI pass from
    shape-only traces at this checkpoint's shapes (``harness.prefill.predict``), or the teacher-forced rounds."""
    out = {}
    for name, v in variants.items():
        backend = prefill.backend_of(name, args.prefill)
        if backend == "nki":
            try:
                out[name] = prefill.predict(cfg, len(ids), args.prefill_chunk, tp=args.tp)["ttft_us"]
            except ValueError:      # a kernel's demo shapes do not exist at this --tp: no prediction
                out[name] = None
        elif backend == "teacher-forced":
            out[name] = prefill.baseline_us(len(ids), None)[0]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sampling = check_args(args)
        from model.weights import CheckpointError, load_checkpoint
        if not args.model_path.is_dir():
            raise UsageError(f"--model-path {args.model_path}: no such directory")
        try:
            cfg, params = load_checkpoint(args.model_path, dtype=DTYPES[args.dtype])
        except (CheckpointError, ConfigError) as e:
            raise UsageError(str(e)) from None
        if not args.no_spec and not cfg.mtp_num_hidden_layers:
            raise UsageError(f"{args.model_path}: the checkpoint has no MTP head; use --no-spec")
        tokenizer = load_tokenizer(args.model_path, required=args.prompt is not None)
        ids = prompt_ids(args, cfg, tokenizer)
        names = list(VARIANT_NAMES) if args.variant == "all" else [args.variant]
        variants = build_variants(names, cfg, params, args)
    except UsageError as e:
        print(f"decode.py: error: {e}", file=sys.stderr)
        return 2

    results = {name: run_variant(name, v, ids, args, cfg, sampling) for name, v in variants.items()}
    first = results[names[0]][0]
    samples = [first.tokens]
    for i in range(1, args.num_samples):
        samples.append(run_variant(names[0], variants[names[0]], ids, args, cfg, sampling, i)[0].tokens)
    identical = all(r.tokens == first.tokens for r, _, _ in results.values())

    if args.json:
        out = first.to_dict()
        out["variant"] = names[0]
        predicted = predicted_prefill(cfg, ids, args, variants)
        out["variants"] = {n: {**r.to_dict(), "seconds": round(s, 3), "launches": k,
                               "prefill": prefill.report(variants[n], len(ids), predicted.get(n))}
                           for n, (r, s, k) in results.items()}
        out["identical_tokens"] = identical
        out["device_commit"] = args.device_commit
        if sampling is not None:
            out["sampling"] = {"temperature": sampling.temperature, "top_k": sampling.top_k or None,
                               "top_p": sampling.top_p, "seed": sampling.seed}
            out["samples"] = samples
        if tokenizer is not None:
            out["text"] = tokenizer.decode(first.tokens)
        print(json.dumps(out))
        return 0

    K = args.num_draft_tokens
    mode = "plain" if args.no_spec else f"MTP speculation, {K} draft token{'s' if K > 1 else ''} per round"
    mode += ", megakernel accepts on device" if args.device_commit else ""
    mode += ", greedy" if sampling is None else (f", sampling T={sampling.temperature} top-k={sampling.top_k or '-'} "
                                                 f"top-p={sampling.top_p} seed={sampling.seed}")
    print(f"model: {args.model_path}  dtype: {args.dtype}  prompt: {len(ids)} tokens  ({mode})")
    if tokenizer is not None:
        print(f"\n{tokenizer.decode(ids)}\033[1m{tokenizer.decode(first.tokens)}\033[0m\n"
              if sys.stdout.isatty() else f"\n{tokenizer.decode(ids)}{tokenizer.decode(first.tokens)}\n")
    else:
        print(f"tokens: {first.tokens}")
    for i, toks in enumerate(samples[1:], start=1):
        print(f"sample {i} (seed {sampling.seed + i}): " + (repr(tokenizer.decode(toks)) if tokenizer else str(toks)))
    pos_cols = "" if args.no_spec else "".join(f"{f'acc d{i + 1}':>9}" for i in range(K))
    print(f"{'variant':<12}{'tokens':>8}{'rounds':>8}{'accept':>9}{pos_cols}{'tok/round':>11}{'launches':>10}"
          f"{'seconds':>9}{'round ms p50/p90/p99':>23}")
    for n, (r, s, k) in results.items():
        acc = "-" if args.no_spec else f"{100 * r.acceptance_rate:.1f}%"
        per = "" if args.no_spec else "".join(f"{100 * a:>8.1f}%" for a in r.acceptance_per_position)
        tpr = "-" if args.no_spec else f"{r.tokens_per_round:.2f}"
        launches = "-" if k is None else str(k)
        pct = r.round_time_percentiles()
        ms = "/".join(f"{pct[q]:.0f}" for q in ("p50", "p90", "p99")) if pct else "-"
        print(f"{n:<12}{len(r.tokens):>8}{r.rounds:>8}{acc:>9}{per}{tpr:>11}{launches:>10}{s:>9.2f}{ms:>23}")
    if len(results) > 1:
        print("all variants produced identical tokens" if identical else "WARNING: variants disagree")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
