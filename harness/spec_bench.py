"""``python -m harness.bench spec``: which number of chained MTP drafts K pays on trn2.

For each K (default 1, 2, 3):

* measured acceptance: greedy speculative decoding of the embedded tiny checkpoint (bf16, xla variant, TP=1) on
  held-out prompts (the evaluation split of ``scripts/train_tiny.py``: its one home) -- acceptance of each draft
  position, tokens per round; the committed tokens are checked against plain greedy decoding. ``--temperature``:
  sampled instead, with the mean optimum 1 - TV(p, q) of draft 1 beside it; ``--variant megakernel`` /
  ``layerwise`` (under nkisim, slow) then measures the kernels' shared-Gumbel scheme, whose optimum is computed on
  the host from the reference model's target and MTP distributions at each round's position (teacher-forced over
  the committed tokens); ``--draft-head fp8`` (megakernel only): the drafts' head in fp8 (``nki_kernels.lm_head``
  "fp8 draft head"), in the acceptance and in the predicted round;
* predicted round time: the shipped round megakernel with K draft stages and a verify of K + 1 tokens, traced
  shape-only at Qwen3.6-35B-A3B's full size (TP=4 x LNC=2, context ``--context``, expected routing) and run through
  the cost model: low / central / high band (``harness.costmodel.predict_band``);
* predicted tokens/s = tokens per round / round time, each band end.

Caveats: :data:`CAVEATS` (also in the JSON).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CAVEATS = ("the acceptance comes from the embedded tiny model, not from Qwen3.6's MTP head",
           "the K - 1 later draft stages are costed with the register values of the first draft's position (p - 1 "
           "instead of p .. p + K - 2: at most 2 KV rows at a context of thousands)",
           "the MoE routing model gives every multi-token MoE call of the round the distinct-expert count of K + 1 "
           "tokens (the K-token replay's is a little smaller: pessimistic for K >= 2)",
           "device time only: the host's accept and input preparation between rounds is not included",
           "round_us includes the launch's 13.1 us NEFF start, as `predict` does; stages_us split the rest")


def _train_tiny():
    """scripts/train_tiny.py as a module (the held-out split and prompt picker live there)."""
    spec = importlib.util.spec_from_file_location("train_tiny", ROOT / "scripts" / "train_tiny.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


COUPLING_DRAWS = 4096      # Monte Carlo noise draws per round for the expected Gumbel-coupling acceptance


def draft1_figures(ref, ids: list[int], tokens: list[int], accepted_per_round: list[int], temperature: float
                   ) -> tuple[list[float], list[float]]:
    """Per round of a run (prompt ``ids``, generated ``tokens``): (1 - TV(p, q) of draft 1, the Gumbel coupling's
    expected acceptance P(argmax(log q + g) = argmax(log p + g)) over :data:`COUPLING_DRAWS` seeded noise draws),
    from the reference model teacher-forced over the committed sequence: the round with its pending token at
    position n has p = softmax(logits(h_n) / T) (the target at n + 1), q = softmax(logits(MTP(x_n, h_{n-1})) / T)."""
    import torch

    from harness.sampling import Sampling, gumbel, probabilities
    from model.state import DecodeState
    seq = torch.tensor(ids + tokens)
    state = DecodeState.empty(ref.cfg, len(seq) + 1, slots=2, dtype=ref.dtype)
    h = ref.trunk(seq, state, 0, chunked=True)
    hm = ref.mtp(seq[1:], h[:-1], state, 0)              # row n - 1: MTP(x_n, h_{n-1}), predicts n + 1
    s = Sampling(temperature)
    gen = torch.Generator().manual_seed(0)
    optimum, coupling, n = [], [], len(ids)
    for a in accepted_per_round:
        p = probabilities(ref.logits(h[n:n + 1]), s)[0]
        q = probabilities(ref.logits(hm[n - 1:n]), s)[0]
        optimum.append(float(torch.minimum(p, q).sum()))
        g = gumbel(gen, (COUPLING_DRAWS, p.shape[0]))
        coupling.append(float(((p.log() + g).argmax(-1) == (q.log() + g).argmax(-1)).double().mean()))
        n += a
    return optimum, coupling


def measure_acceptance(drafts: list[int], prompts: int, prompt_len: int, new_tokens: int, quiet: bool,
                       temperature: float = 0.0, variant: str = "xla", draft_fp8: bool = False) -> dict:
    """{K: acceptance figures} of speculative decoding of the embedded checkpoint on held-out prompts: greedy
    (checked against plain greedy decoding) or sampled at ``temperature`` (seed = prompt index; with the mean
    1 - TV(p, q) of draft 1, the optimum its acceptance is compared with), by ``variant`` at TP=1 (``draft_fp8``:
    with the fp8 draft head)."""
    import torch
    from tqdm import tqdm

    from harness.decode import EMBEDDED_MODEL
    from harness.sampling import Sampling
    from harness.speculative import generate, make_decoder
    from model.reference import ReferenceModel
    from model.weights import load_checkpoint
    torch.set_num_threads(1)        # batch-1 decode ops are tiny; one thread is fastest on a shared machine
    tt = _train_tiny()
    root, files = tt.stdlib_files()
    picked = tt.eval_prompts(root, [f for f in files if tt.is_held_out(f)], prompts, prompt_len)
    cfg, params = load_checkpoint(EMBEDDED_MODEL, dtype=torch.bfloat16)
    decoders = {k: make_decoder(variant, cfg, params, tp=1, drafts=k, draft_fp8=draft_fp8) for k in drafts}
    ref = ReferenceModel(cfg, params)
    acc = {k: {"accepted_per_round": [], "differing_prompts": 0, "optimum": [], "coupling": []} for k in drafts}
    sampling = Sampling(temperature) if temperature > 0 else None
    for i, (_, ids) in enumerate(tqdm(picked, desc="acceptance", unit="prompt", file=sys.stderr, disable=quiet,
                                      leave=False)):
        plain = None if sampling else generate(decoders[drafts[0]], ids, new_tokens, spec=False).tokens
        for k in drafts:
            res = generate(decoders[k], ids, new_tokens, sampling=sampling, sample=i)
            acc[k]["accepted_per_round"] += res.accepted_per_round
            if sampling and decoders[k].gumbel:
                res.draft1_optimum, coupling = draft1_figures(ref, ids, res.tokens, res.accepted_per_round,
                                                              temperature)
                acc[k]["coupling"] += coupling
            acc[k]["optimum"] += res.draft1_optimum
            acc[k]["differing_prompts"] += plain is not None and res.tokens != plain
    out = {}
    for k in drafts:
        a = acc[k]["accepted_per_round"]
        out[k] = {"rounds": len(a), "tokens_per_round": sum(a) / len(a),
                  "acceptance_per_position": [sum(n - 1 > i for n in a) / len(a) for i in range(k)],
                  **({"draft1_acceptance_optimum": sum(acc[k]["optimum"]) / len(acc[k]["optimum"])} if sampling else
                     {"prompts_differing_from_plain_greedy": acc[k]["differing_prompts"]}),
                  **({"draft1_gumbel_coupling_expected": sum(acc[k]["coupling"]) / len(acc[k]["coupling"])}
                     if acc[k]["coupling"] else {})}
    return out


def round_case(cfg, drafts: int, context: int, tp: int = 4, lnc: int = 2, dtype: str = "bfloat16",
               draft_fp8: bool = False):
    """The shipped round megakernel with ``drafts`` chained drafts at position ``context``, shape-only, at the
    per-rank shapes of ``cfg`` (``harness.kernel_cases`` for the weights; the decode state with K + 1 slots);
    ``draft_fp8``: with the fp8 draft head."""
    import torch

    import nkisim
    from harness.costmodel.layers import stage_tagger
    from harness.kernel_cases import KernelCase, _token, rank_tensors
    from harness.register_models import RoundRegisters, Routing
    from megakernel import plan as rp
    from megakernel.round import KERNELS
    plan = rp.round_plan(cfg, tp, lnc, drafts=drafts, draft_fp8=draft_fp8)
    routing = Routing("expected", drafts + 1, cfg.num_experts_per_tok, cfg.num_experts)
    state = {s.name: nkisim.ShapeDtype(s.shape, dtype if s.dtype == "activation" else s.dtype)
             for s in rp.state_specs(cfg, tp, context + drafts + 1, drafts + 1)}
    act = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    run = rp.round_inputs(cfg, act, _token(cfg), torch.zeros(1, cfg.hidden_size), context, 0, drafts=drafts)
    per_rank = [{"plan": plan, **t, **state, **run} for t in rank_tensors(cfg, tp, lnc, context, dtype,
                                                                              draft_fp8=draft_fp8)]
    return KernelCase(f"round megakernel K={drafts}", KERNELS["round"], per_rank, tp, lnc,
                      RoundRegisters(context, routing, plan), stage_tagger(plan), context, routing, plan.tokens,
                      plan=plan)


def predict_round(cfg, drafts: int, context: int, draft_fp8: bool = False) -> dict:
    """Predicted round time band (us) of the K-draft round at full size, with its per-stage split."""
    from harness.costmodel import predict_band
    from harness.costmodel import constants as C
    case = round_case(cfg, drafts, context, draft_fp8=draft_fp8)
    t0 = time.time()
    tr = case.trace()
    band = predict_band(tr, stages=case.stages, name=f"round K={drafts}")
    stages = {}
    for e in C.ENDS:
        for s, v in band.at(e).critical_by_stage.items():
            top = "V" if s.startswith("V") else s
            stages.setdefault(top, {}).setdefault(e, 0.0)
            stages[top][e] += v / 1e3
    # the round as `predict` reports it: the launch's NEFF start included (harness.costmodel.compose)
    round_us = {e: v + C.LAUNCH_OVERHEAD_NS / 1e3 for e, v in band.time_us().items()}
    return {"round_us": round_us, "stages_us": stages, "instructions": len(tr.instructions),
            "seconds": round(time.time() - t0, 1)}


def run(drafts: list[int], context: int, prompts: int, prompt_len: int, new_tokens: int, predict: bool,
        quiet: bool, temperature: float = 0.0, variant: str = "xla", draft_fp8: bool = False) -> dict:
    from model.config import preset
    t0 = time.time()
    acc = measure_acceptance(drafts, prompts, prompt_len, new_tokens, quiet, temperature, variant, draft_fp8)
    rows = []
    cfg = preset("qwen3.6-35b-a3b") if predict else None
    for k in drafts:
        row = {"drafts": k, **acc[k]}
        if predict:
            if not quiet:
                print(f"spec: tracing the K={k} round at full size (shape-only) ...", file=sys.stderr, flush=True)
            row.update(predict_round(cfg, k, context, draft_fp8))
            r = row["round_us"]
            # more time per round -> fewer tokens/s: the low time end gives the high rate
            row["tokens_per_s"] = {"low": row["tokens_per_round"] * 1e6 / r["high"],
                                   "central": row["tokens_per_round"] * 1e6 / r["central"],
                                   "high": row["tokens_per_round"] * 1e6 / r["low"]}
        rows.append(row)
    best = max(rows, key=lambda r: r["tokens_per_s"]["central"])["drafts"] if predict else None
    import subprocess
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or None
    return {"command": "python -m harness.bench spec " + " ".join(sys.argv[2:]), "measured_commit": commit,
            "model_for_time": "qwen3.6-35b-a3b",
            "tp": 4, "lnc": 2, "context": context, "routing": "expected",
            "acceptance_source": {"checkpoint": "model/embedded/tiny (bf16)", "variant": f"{variant}, TP=1, " + (
                                      f"sampled at temperature {temperature}, seed = prompt index, "
                                      + ("shared Gumbel noise (draft 1 optimum from the reference model)"
                                         if variant != "xla" else "rejection rule")
                                      if temperature > 0 else "greedy"),
                                  "prompts": prompts, "prompt_bytes": prompt_len, "new_tokens": new_tokens,
                                  "split": "held-out stdlib files of scripts/train_tiny.py"},
            "draft_head": "fp8" if draft_fp8 else "bf16",
            "rows": rows, "best_drafts_central": best,
            "caveats": list(CAVEATS),
            "elapsed_s": round(time.time() - t0, 1)}


def table(out: dict) -> str:
    lines = ["| K | accept per position | tokens/round | round time us (low-central-high) | tok/s (low-central-high) |",
             "|---|---|---|---|---|"]
    for r in out["rows"]:
        per = " / ".join(f"{100 * a:.0f}%" for a in r["acceptance_per_position"])
        if "round_us" in r:
            t, s = r["round_us"], r["tokens_per_s"]
            times = f"{t['central']:,.0f} ({t['low']:,.0f}-{t['high']:,.0f})"
            rate = f"{s['central']:,.0f} ({s['low']:,.0f}-{s['high']:,.0f})"
        else:
            times = rate = "-"
        lines.append(f"| {r['drafts']} | {per} | {r['tokens_per_round']:.2f} | {times} | {rate} |")
        if "draft1_acceptance_optimum" in r:
            lines.append(f"|   | draft 1 optimum 1 - TV(p, q): {100 * r['draft1_acceptance_optimum']:.0f}% | | | |")
        if "draft1_gumbel_coupling_expected" in r:
            lines.append(f"|   | draft 1 Gumbel coupling, expected: {100 * r['draft1_gumbel_coupling_expected']:.0f}% "
                         f"| | | |")
    if out["best_drafts_central"]:
        lines.append(f"\nbest K (central): {out['best_drafts_central']}")
    return "\n".join(lines)


def add_arguments(p):
    p.add_argument("--drafts", default="1,2,3", help="comma-separated K values in 1..3 (default 1,2,3)")
    p.add_argument("--context", type=int, default=2048, help="the round's context (pending token's position), "
                                                             "default 2048")
    p.add_argument("--prompts", type=int, default=20, help="held-out prompts for the acceptance (default 20)")
    p.add_argument("--prompt-bytes", type=int, default=128, help="bytes per prompt (default 128)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt (default 64)")
    p.add_argument("--temperature", type=float, default=0.0, help="measure the acceptance with sampling at this "
                                                                 "temperature (default 0: greedy)")
    p.add_argument("--variant", default="xla", choices=["xla", "layerwise", "megakernel"],
                   help="the variant whose acceptance is measured, TP=1 (default xla; the kernel variants run under "
                        "nkisim: about a second per round)")
    p.add_argument("--draft-head", default="bf16", choices=["bf16", "fp8"],
                   help="the drafts' LM head: bf16 (default, the verify's) or fp8 (opt-in, nki_kernels.lm_head "
                        "'fp8 draft head'; megakernel variant only; the output is unchanged, only acceptance can drop)")
    p.add_argument("--no-predict", action="store_true", help="acceptance only: skip the full-size round traces "
                                                             "(minutes each)")
    p.add_argument("--json", action="store_true", help="print the JSON instead of the table")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.add_argument("--out", default=str(ROOT / "bench" / "spec.json"), help="JSON output (default bench/spec.json)")


def cmd(a):
    from harness.kernel_loading import BadInput
    from megakernel.plan import MAX_DRAFTS
    try:
        drafts = sorted({int(x) for x in a.drafts.split(",") if x.strip()})
    except ValueError:
        raise BadInput(f"spec: --drafts: expected comma-separated integers, found {a.drafts!r}") from None
    if not drafts or not all(1 <= k <= MAX_DRAFTS for k in drafts):
        raise BadInput(f"spec: --drafts values must be in 1..{MAX_DRAFTS}, found {a.drafts!r}")
    for name in ("context", "prompts", "prompt_bytes", "new_tokens"):
        if getattr(a, name) < 1:
            raise BadInput(f"spec: --{name.replace('_', '-')} must be >= 1, found {getattr(a, name)}")
    if not a.temperature >= 0:
        raise BadInput(f"spec: --temperature must be >= 0, found {a.temperature}")
    if a.draft_head == "fp8" and a.variant != "megakernel":
        raise BadInput(f"spec: --draft-head fp8 runs in the megakernel variant only (--variant megakernel), not "
                       f"{a.variant}")
    out = run(drafts, a.context, a.prompts, a.prompt_bytes, a.new_tokens, not a.no_predict, a.quiet or a.json,
              a.temperature, a.variant, a.draft_head == "fp8")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out) if a.json else table(out))
    return 0
