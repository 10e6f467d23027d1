"""The NxDI path from the command line: convert a checkpoint, compile, decode.

    python -m harness.nxdi.run convert --model-path HF_DIR --out CONVERTED --backend megakernel --max-len 4096 \
        --num-draft-tokens 2
    python -m harness.nxdi.run compile --converted CONVERTED --compiled COMPILED            # trn2 only
    python -m harness.nxdi.run decode --converted CONVERTED --compiled COMPILED --prompt-ids 1,2,3  # trn2 only
    python -m harness.nxdi.run decode --executor cpu --model-path HF_DIR --backend xla --prompt-ids 1,2,3
    python -m harness.nxdi.run check --converted CONVERTED --compiled COMPILED --model-path HF_DIR   # trn2 only

``decode --executor neuron`` (default) drives the compiled NxDI application; ``--executor cpu`` runs the
same per-rank work on this machine (``harness.engines``: the xla backend over one thread per rank, the
megakernel under nkisim) behind the same host loop. Prefill (``--prefill``): ``context`` (default) encodes the
prompt with the context-encoding graphs, one per chunk-length bucket (``convert --context-buckets``; the NKI
prefill kernels, or their PyTorch twins for the xla backend; ``harness.nxdi.context``): one launch per chunk of
the largest bucket, the first chunk padded; on the cpu executor the xla backend runs the same context function in
process and the megakernel backend the NKI prefill pass of ``harness.prefill``.
``teacher-forced`` feeds the whole prompt through the round graph, K + 1 tokens per launch. The chained MTP
drafts per round (``--num-draft-tokens K``, 1..3) are fixed at conversion: the round graph's inputs and outputs
and the decode state's K + 1 GDN checkpoint slots depend on K. Before touching the Neuron SDK, ``compile`` and
``decode --executor neuron`` check the converted directory: its TP, LNC, dtype, max length and K against
``--tp/--lnc/--dtype/--max-len/--num-draft-tokens`` when given and the LNC NxDI will run with
(``NEURON_LOGICAL_NC_CONFIG`` wins over the config in NxDI), every rank's checkpoint complete, and (decode) that
the compiled directory comes from it. Bad input prints one line to stderr and exits with status 2; so does a
neuron command on a machine without the Neuron SDK.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repo importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from megakernel.plan import DEFAULT_DRAFTS, MAX_DRAFTS  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


class UsageError(Exception):
    pass


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="python -m harness.nxdi.run", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("convert", help="HF checkpoint -> converted NxDI checkpoint (any machine)")
    c.add_argument("--model-path", type=Path, required=True, help="Hugging Face checkpoint directory")
    c.add_argument("--out", type=Path, required=True, help="output directory")
    c.add_argument("--backend", choices=["xla", "megakernel"], default="megakernel")
    c.add_argument("--max-len", type=int, default=4096, help="positions the decode state holds (default 4096)")
    c.add_argument("--tp", type=int, default=4)
    c.add_argument("--lnc", type=int, default=2)
    c.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    c.add_argument("--num-draft-tokens", type=int, default=DEFAULT_DRAFTS, metavar="K",
                   help=f"chained MTP drafts per round the graphs are built for, 1..{MAX_DRAFTS} (default "
                        f"{DEFAULT_DRAFTS}): the verify runs K + 1 tokens, the decode state holds K + 1 GDN "
                        f"checkpoint slots")
    c.add_argument("--context-buckets", metavar="C1,C2,..",
                   help="chunk lengths of the context-encoding graphs (one graph each; multiples of 64, at most "
                        "--max-len; 'none': no context graph). Default: the powers of two from 64 to "
                        "min(4096, --max-len)")

    k = sub.add_parser("compile", help="trace and compile the application (trn2 only)")
    k.add_argument("--converted", type=Path, required=True, help="converted directory (`convert`)")
    k.add_argument("--compiled", type=Path, required=True, help="output directory")
    _expected(k)

    d = sub.add_parser("decode", help="speculative (or --no-spec) greedy decoding")
    d.add_argument("--executor", choices=["neuron", "cpu"], default="neuron")
    d.add_argument("--converted", type=Path, help="converted directory (neuron executor)")
    d.add_argument("--compiled", type=Path, help="compiled directory (neuron executor)")
    d.add_argument("--model-path", type=Path, help="Hugging Face checkpoint (cpu executor; tokenizer for --prompt)")
    d.add_argument("--backend", choices=["xla", "megakernel"], default="xla", help="cpu executor's backend")
    _expected(d, cpu=True)
    d.add_argument("--skip-warmup", action="store_true", help="neuron executor: skip NxDI's warmup at load")
    src = d.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="prompt text (needs the checkpoint's tokenizer: --model-path)")
    src.add_argument("--prompt-ids", help="prompt as comma-separated token ids")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--no-spec", action="store_true", help="plain greedy decoding, no MTP speculation")
    _prefill_flag(d)
    d.add_argument("--json", action="store_true", help="print one JSON object")

    from harness.nxdi import check
    t = sub.add_parser("check", help="bring-up check: teacher-forced logits vs the CPU reference (tolerance, "
                                     "top-1 outside near-ties); exit 1 on FAIL", description=check.__doc__.split("\n\n")[0])
    check.add_arguments(t)
    _expected(t, cpu=True)
    _prefill_flag(t)
    return ap.parse_args(argv)


PREFILLS = ("context", "teacher-forced")


def _prefill_flag(parser):
    parser.add_argument("--prefill", choices=PREFILLS, default="context",
                        help="context (default): the context-encoding graphs, one launch per chunk of the largest "
                             "bucket; teacher-forced: the prompt through the round graph, K + 1 tokens per launch "
                             "(the fallback)")


def _expected(parser, cpu: bool = False):
    what = ("cpu executor: the value to run with (default {}); neuron executor: " if cpu else "") + \
        "refuse a converted directory with another value (default: take the directory's)"
    parser.add_argument("--tp", type=int, help=what.format(4))
    parser.add_argument("--lnc", type=int, help=what.format(2))
    parser.add_argument("--dtype", choices=list(DTYPES), help=what.format("bfloat16"))
    parser.add_argument("--num-draft-tokens", type=int, metavar="K",
                        help="chained MTP drafts per round, 1..{}; {}".format(MAX_DRAFTS, what.format(DEFAULT_DRAFTS)))
    if not cpu:
        parser.add_argument("--max-len", type=int, help=what)


def _checked_conversion(args, max_len=None) -> dict:
    """The converted directory's meta after every check that needs no SDK (module docstring). ``max_len``: the
    positions the sequence needs with rounds of one draft (:func:`_engine`)."""
    from harness.nxdi.config import check_lnc, env_lnc
    from harness.nxdi.convert import ConvertError, check_converted
    from model.config import ConfigError
    try:
        meta = check_converted(args.converted, tp=args.tp, lnc=args.lnc, dtype=args.dtype,
                               max_len=getattr(args, "max_len", None), drafts=args.num_draft_tokens)
        running = env_lnc(os.environ)
        if running is not None:
            check_lnc(running, meta["lnc"])
    except (ConvertError, ConfigError) as e:
        raise UsageError(str(e)) from None
    need = None if max_len is None else max_len + meta["num_draft_tokens"] - 1
    if need is not None and need > meta["max_len"]:
        raise UsageError(f"the sequence needs {need} positions (prompt + new tokens + K); {args.converted} holds "
                         f"{meta['max_len']} (convert again with a larger --max-len)")
    return meta


def _neuron():
    try:
        from harness.nxdi import modeling
    except ImportError as e:
        raise UsageError(str(e)) from None
    return modeling


def cmd_convert(args) -> int:
    from harness.nxdi.assembly import AssemblyError
    from harness.nxdi.convert import write_converted
    from model.config import ConfigError
    from model.weights import CheckpointError, load_checkpoint
    from harness.nxdi.context import ContextError, check_buckets, parse_buckets
    try:
        buckets = None if args.context_buckets is None else check_buckets(parse_buckets(args.context_buckets),
                                                                          args.max_len)
        cfg, params = load_checkpoint(args.model_path, dtype=DTYPES[args.dtype])
        write_converted(args.out, cfg, params, args.backend, args.max_len, args.tp, args.lnc,
                        progress=lambda s: print(s, file=sys.stderr), drafts=args.num_draft_tokens, buckets=buckets)
    except (CheckpointError, ConfigError, AssemblyError, ContextError) as e:
        raise UsageError(str(e)) from None
    return 0


def cmd_compile(args) -> int:
    _checked_conversion(args)
    modeling = _neuron()
    modeling.NeuronEngine.compile(args.converted, args.compiled)
    return 0


def _engine(args, max_len: int):
    """(engine, cfg) for the chosen executor, running rounds of K drafts (``--num-draft-tokens``; neuron executor:
    the converted K). ``max_len``: the positions the sequence needs with rounds of one draft (prompt + new tokens +
    1); rounds of K drafts need K - 1 more (the last verify runs K positions past the last emitted token)."""
    if args.executor == "cpu":
        from harness.engines import make_engine
        from harness.nxdi.assembly import AssemblyError, check_sharding
        from model.config import ConfigError
        from model.weights import CheckpointError, load_checkpoint
        if args.model_path is None:
            raise UsageError("--executor cpu needs --model-path (a Hugging Face checkpoint)")
        try:
            cfg, params = load_checkpoint(args.model_path, dtype=DTYPES[args.dtype or "bfloat16"])
            check_sharding(cfg, args.tp or 4, args.lnc or 2)
            return make_engine(args.backend, cfg, params, tp=args.tp or 4, lnc=args.lnc or 2,
                               drafts=args.num_draft_tokens or DEFAULT_DRAFTS), cfg
        except (CheckpointError, ConfigError, AssemblyError) as e:
            raise UsageError(str(e)) from None
    if args.converted is None or args.compiled is None:
        raise UsageError("--executor neuron needs --converted and --compiled")
    from harness.nxdi.convert import ConvertError, check_compiled
    meta = _checked_conversion(args, max_len)
    try:
        check_compiled(args.compiled, meta, args.converted)
    except ConvertError as e:
        raise UsageError(str(e)) from None
    modeling = _neuron()
    engine = modeling.NeuronEngine.load(args.converted, args.compiled, warmup=not args.skip_warmup)
    return engine, engine.cfg


def _prompt(args, cfg, tokenizer) -> list[int]:
    from harness.decode import UsageError as DecodeUsage
    from harness.decode import prompt_ids
    if args.prompt is None and args.prompt_ids is None:
        raise UsageError("give --prompt-ids (or --prompt with a tokenizer)")
    ns = argparse.Namespace(prompt=args.prompt, prompt_ids=args.prompt_ids, max_new_tokens=args.max_new_tokens,
                            model_path=args.model_path)
    try:
        return prompt_ids(ns, cfg, tokenizer)
    except DecodeUsage as e:
        raise UsageError(str(e)) from None


def decoder(args, engine):
    """The host loop's decoder over ``engine`` with the prefill of ``--prefill`` (module docstring)."""
    from harness.speculative import Decoder
    if args.prefill == "teacher-forced":
        return Decoder(engine)
    from harness.nxdi.context import XlaContextEngine, context_decoder, default_buckets
    if args.executor == "neuron":
        return context_decoder(engine)
    if engine.name == "xla":
        return context_decoder(XlaContextEngine(engine, default_buckets(engine.cfg.max_position_embeddings)))
    from harness.prefill import nki_prefill_decoder_class
    return nki_prefill_decoder_class()(engine)


def cmd_decode(args) -> int:
    from harness.decode import UsageError as DecodeUsage
    from harness.decode import load_tokenizer
    from harness.speculative import generate
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, found {args.max_new_tokens}")
    if args.prompt_ids is not None:
        n_prompt = len([x for x in args.prompt_ids.split(",") if x.strip()])
    else:
        n_prompt = None
    tokenizer = None
    if args.prompt is not None:
        if args.model_path is None:
            raise UsageError("--prompt needs --model-path for the tokenizer; or give --prompt-ids")
        try:
            tokenizer = load_tokenizer(args.model_path, required=True)
        except DecodeUsage as e:
            raise UsageError(str(e)) from None
        n_prompt = len(tokenizer.encode(args.prompt, add_special_tokens=False))
    if n_prompt is None:
        raise UsageError("give --prompt-ids (or --prompt with a tokenizer)")
    engine, cfg = _engine(args, max_len=n_prompt + args.max_new_tokens + 1)
    ids = _prompt(args, cfg, tokenizer)
    if not args.no_spec and not cfg.mtp_num_hidden_layers:
        raise UsageError("the checkpoint has no MTP head; use --no-spec")
    variant = decoder(args, engine)
    t0 = time.perf_counter()
    try:
        res = generate(variant, ids, args.max_new_tokens, eos_ids=cfg.eos_token_id, spec=not args.no_spec)
    except ValueError as e:
        raise UsageError(str(e)) from None
    seconds = time.perf_counter() - t0
    out = {**res.to_dict(), "executor": args.executor, "launches": engine.launches, "seconds": round(seconds, 3),
           "prefill": getattr(variant, "prefill_info", None) or {"backend": "teacher-forced"}}
    if args.executor == "cpu":
        out["backend"] = args.backend
    if args.json:
        print(json.dumps(out))
    else:
        text = f"\n{tokenizer.decode(res.tokens)}\n" if tokenizer is not None else f"tokens: {res.tokens}"
        print(text)
        mode = "plain greedy" if args.no_spec else (f"{res.rounds} rounds of {res.drafts} draft(s), "
                                                    f"{res.tokens_per_round:.2f} tokens/round")
        pre = out["prefill"]
        how = pre["backend"] if not pre.get("chunks") else f"{pre['backend']}: {len(pre['chunks'])} chunk(s)"
        print(f"{len(res.tokens)} tokens, {mode}, {engine.launches} launches (prefill included: {how}), "
              f"{seconds:.2f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        K = getattr(args, "num_draft_tokens", None)
        if K is not None and not 1 <= K <= MAX_DRAFTS:
            raise UsageError(f"--num-draft-tokens must be in 1..{MAX_DRAFTS}, found {K}")
        if args.command == "check":
            from harness.nxdi import check
            return check.cmd(args, _engine, UsageError, decoder)
        return {"convert": cmd_convert, "compile": cmd_compile, "decode": cmd_decode}[args.command](args)
    except UsageError as e:
        print(f"harness.nxdi.run: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
