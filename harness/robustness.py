"""How fragile is exact-token parity? The kernel variants under nkisim's hardware-like numerics, teacher-forced
against the CPU reference (``python -m harness.bench robustness [--json]``).

For each model (the embedded trained tiny model, and a random checkpoint of the tp-shaped ``tiny`` preset) and
each prompt: the reference (the single-device PyTorch model, token by token) decodes ``--tokens`` greedy tokens; every
kernel variant (layerwise, megakernel; nkisim, TP x LNC ranks) is then run inside
``nkisim.numerics("hardware-like", ...)``:

* teacher-forced (``harness.teacher_forcing``) through the whole sequence -- prompt and continuation -- from a
  one-token prefill, so that, as on the NxDI engine (whose prefill is teacher-forced rounds), every position
  after the first is the kernels' work and the decode state they read is their own. The variants' prefill is
  the PyTorch reference (harness.speculative.make_decoder), so prediction 0 is the host's and left out; the prompt's positions
  are predictions of the next prompt token.
* free-running (``harness.speculative.generate``, MTP drafts) after a prefill of the whole prompt (the host's),
  until its first token that differs from the reference's.

Logits are the host's projection of each run's post-norm hidden with the checkpoint's LM head (teacher_forcing's
docstring says why); the kernels' own greedy ids are compared too.

Per model and variant, over all teacher-forced positions (``logit_metrics``):

* ``max_abs`` / ``p99_abs``: the maximum and the 99th percentile over positions of the position's largest
  |delta logit| (over the vocabulary);
* ``top1_agreement``: positions whose top-1 of the variant's logits is the reference's; ``kernel_top1_agreement``
  the same for the kernel's own greedy id;
* ``near_tie_fraction``: positions whose reference top-1 / top-2 margin is below 2 x the error observed THERE
  (the margin that error can close: each of the two logits may move by up to it); ``near_tie_fraction_p99`` the
  same against 2 x ``p99_abs``; ``unexplained``: positions where the kernel's id differs from the reference top-1
  OUTSIDE a near tie (should be 0);
* free-running: per prompt the index of the first generated token that differs (None: all ``--tokens`` agree);
* ``check``: the bring-up check's verdict on the same positions at its default tolerance (harness.nxdi.check).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from harness.teacher_forcing import TEXT_PROMPTS

RANDOM_SEED = 18                  # seed of the random checkpoint and its random-id prompts
MODELS = ("embedded", "random")
KERNEL_VARIANTS = ("layerwise", "megakernel")


class UsageError(ValueError):
    pass


def logit_metrics(ref_logits: torch.Tensor, logits: torch.Tensor, kernel_ids: torch.Tensor) -> dict:
    """The figures of one variant (module docstring) from the reference's and the variant's logits [N, V] at the
    same N positions and the variant's own greedy ids [N]."""
    if ref_logits.shape != logits.shape or ref_logits.ndim != 2 or kernel_ids.shape != ref_logits.shape[:1]:
        raise ValueError(f"logit_metrics: shapes {tuple(ref_logits.shape)}, {tuple(logits.shape)}, "
                         f"{tuple(kernel_ids.shape)} do not match ([N, V], [N, V], [N])")
    err = (logits.double() - ref_logits.double()).abs().amax(dim=1)          # [N] per-position max |delta|
    top2 = torch.topk(ref_logits.double(), 2, dim=1).values
    margin = top2[:, 0] - top2[:, 1]
    ref_top1 = ref_logits.argmax(dim=1)
    p99 = float(torch.quantile(err, 0.99))
    near = margin < 2 * err
    kernel_ok = kernel_ids == ref_top1
    return {
        "positions": int(err.numel()),
        "max_abs": float(err.max()),
        "p99_abs": p99,
        "median_abs": float(err.median()),
        "logit_scale": float(ref_logits.abs().max()),
        "top1_agreement": float((logits.argmax(dim=1) == ref_top1).double().mean()),
        "kernel_top1_agreement": float(kernel_ok.double().mean()),
        "near_tie_fraction": float(near.double().mean()),
        "near_tie_fraction_p99": float((margin < 2 * p99).double().mean()),
        "unexplained": int((~kernel_ok & ~near).sum()),
        "min_margin": float(margin.min()),
        "per_position_max_abs": [float(f"{e:.4g}") for e in err.tolist()],
    }


def check_verdict(ref_logits: torch.Tensor, logits: torch.Tensor, kernel_ids: torch.Tensor) -> dict:
    """What the bring-up check (harness.nxdi.check, default tolerance) says of these positions."""
    from harness.nxdi.check import DEFAULT_ATOL, DEFAULT_RTOL, check_positions
    ps = check_positions(ref_logits, logits, kernel_ids.tolist(), rtol=DEFAULT_RTOL, atol=DEFAULT_ATOL)
    return {"rtol": DEFAULT_RTOL, "failing_positions": sum(bool(p.problems) for p in ps),
            "worst_ratio_to_tolerance": max(p.max_abs / p.tolerance for p in ps)}


def divergence_summary(first: list[int | None], tokens: int) -> dict:
    """Distribution of the first divergent token over prompts (None = no divergence within ``tokens``)."""
    hit = sorted(i for i in first if i is not None)
    return {"prompts": len(first), "diverged": len(hit), "tokens": tokens, "first_divergent": first,
            "median_first": float(np.median(hit)) if hit else None, "earliest": hit[0] if hit else None}


@dataclass
class Model:
    name: str
    cfg: object
    params: dict
    prompts: list[list[int]]


def load_models(names, n_prompts: int) -> list[Model]:
    """The embedded tiny model with text prompts, and a random float32 checkpoint of the ``tiny`` preset with
    seeded random-id prompts (3 to 10 tokens)."""
    from pathlib import Path

    from model import tokenizer
    from model.config import preset
    from model.params import random_params
    from model.weights import load_checkpoint
    out = []
    for name in names:
        if name == "embedded":
            path = Path(__file__).resolve().parents[1] / "model" / "embedded" / "tiny"
            cfg, params = load_checkpoint(path, dtype=torch.float32)
            prompts = [tokenizer.encode(t) for t in TEXT_PROMPTS[:n_prompts]]
        elif name == "random":
            cfg = preset("tiny")
            params = random_params(cfg, seed=RANDOM_SEED, dtype=torch.float32)
            g = torch.Generator().manual_seed(RANDOM_SEED)
            prompts = [torch.randint(0, cfg.vocab_size, (int(torch.randint(3, 11, (1,), generator=g)),),
                                     generator=g).tolist() for _ in range(n_prompts)]
        else:
            raise UsageError(f"unknown model {name!r}; expected one of {', '.join(MODELS)}")
        out.append(Model(name, cfg, params, prompts))
    return out


def run(models: list[Model], variants, tokens: int, numerics: dict, tp: int = 4, lnc: int = 2,
        progress=None) -> dict:
    """The report (module docstring) as a JSON-able dict. ``numerics``: keyword arguments of
    ``nkisim.numerics`` (mode included). ``progress(str)`` is called after each run."""
    import nkisim
    from harness.speculative import make_decoder
    from harness.teacher_forcing import first_divergence, forced_run, head_weight, host_logits, reference_run
    report = {}
    for m in models:
        head = head_weight(m.cfg, m.params)
        conts, ref_logits = [], []
        for prompt in m.prompts:
            cont, hidden = reference_run(m.cfg, m.params, prompt, tokens)
            conts.append(cont)
            ref_logits.append(host_logits(hidden[1:], head))     # [0]: the host prefill's (module docstring)
        entry = {"prompts": m.prompts, "reference_tokens": conts, "variants": {}}
        for name in variants:
            v = make_decoder(name, m.cfg, m.params, tp=tp, lnc=lnc)
            logits, ids, first = [], [], []
            with nkisim.numerics(**numerics):
                for prompt, cont in zip(m.prompts, conts):
                    f = forced_run(v, prompt[:1], prompt[1:] + cont)
                    logits.append(f.logits(head)[1:])          # [0]: the host prefill's (module docstring)
                    ids.append(torch.tensor(f.targets[1:]))
                    first.append(first_divergence(v, prompt, cont))
                    if progress:
                        progress(f"{m.name} {name}")
            entry["variants"][name] = {
                **logit_metrics(torch.cat(ref_logits), torch.cat(logits), torch.cat(ids)),
                "check": check_verdict(torch.cat(ref_logits), torch.cat(logits), torch.cat(ids)),
                "free_running": divergence_summary(first, tokens)}
        report[m.name] = entry
    return report


# ---- command ----------------------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    from nkisim.numerics import (DEFAULT_ACT_REL_ERROR, DEFAULT_ACT_SEGMENT_BITS, DEFAULT_FP32_MATMUL,
                                 FP32_MATMUL_FORMS)
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {', '.join(MODELS)} "
                                                              f"(default: both)")
    p.add_argument("--variants", default=",".join(KERNEL_VARIANTS),
                   help="comma-separated kernel variants (default: layerwise,megakernel)")
    p.add_argument("--prompts", type=int, default=4, help=f"prompts per model, 1..{len(TEXT_PROMPTS)} (default 4)")
    p.add_argument("--tokens", type=int, default=12,
                   help="reference tokens decoded after each prompt: the continuation teacher-forced after the prompt "
                        "and the free run's length (default 12)")
    p.add_argument("--tp", type=int, default=4, help="TP ranks of the kernel variants (default 4; LNC is 2)")
    p.add_argument("--mode", default="hardware-like", choices=["hardware-like", "exact"],
                   help="nkisim numerics of the kernel variants (default hardware-like)")
    p.add_argument("--seed", type=int, default=0, help="numerics seed (default 0)")
    p.add_argument("--act-rel-error", type=float, default=DEFAULT_ACT_REL_ERROR,
                   help=f"relative error bound of ScalarE functions (default 2^-9 = {DEFAULT_ACT_REL_ERROR:.3g})")
    p.add_argument("--act-segment-bits", type=int, default=DEFAULT_ACT_SEGMENT_BITS,
                   help=f"mantissa bits of an error segment (default {DEFAULT_ACT_SEGMENT_BITS})")
    p.add_argument("--fp32-matmul", default=DEFAULT_FP32_MATMUL, choices=list(FP32_MATMUL_FORMS),
                   help=f"fp32 nc_matmul form (default {DEFAULT_FP32_MATMUL})")
    p.add_argument("--out", default=None, help="JSON path (default bench/robustness.json)")
    p.add_argument("--json", action="store_true", help="print the JSON object (also written)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _names(text: str, known, what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in known]
    if not names or bad:
        raise UsageError(f"--{what}: expected a comma-separated subset of {', '.join(known)}, got {text!r}")
    return names


def table(report: dict) -> str:
    """Markdown table of the report (one row per model and variant)."""
    lines = ["| model | variant | positions | max \\|dlogit\\| | p99 \\|dlogit\\| | logit scale | top-1 agree "
             "(logits / kernel id) | near-ties (margin < 2 err) | unexplained | free-run diverged | first "
             "divergent token | check (worst / tolerance) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for model, entry in report.items():
        for name, r in entry["variants"].items():
            fr = r["free_running"]
            firsts = ", ".join("-" if i is None else str(i) for i in fr["first_divergent"])
            lines.append(f"| {model} | {name} | {r['positions']} | {r['max_abs']:.3g} | {r['p99_abs']:.3g} | "
                         f"{r['logit_scale']:.3g} | {r['top1_agreement']:.3f} / {r['kernel_top1_agreement']:.3f} | "
                         f"{r['near_tie_fraction']:.3f} | {r['unexplained']} | {fr['diverged']} / {fr['prompts']} | "
                         f"{firsts} | {_verdict(r['check'])} |")
    return "\n".join(lines)


def _verdict(c: dict) -> str:
    ok = "pass" if c["failing_positions"] == 0 else f"FAIL at {c['failing_positions']}"
    return f"{ok} ({c['worst_ratio_to_tolerance']:.2f})"


def cmd(a) -> int:
    """``python -m harness.bench robustness``: bad input prints one line and returns 2."""
    try:
        return _cmd(a)
    except UsageError as e:
        print(f"error: robustness: {e}", file=sys.stderr)
        return 2


def _cmd(a) -> int:
    import subprocess
    from pathlib import Path

    import nkisim
    from tqdm import tqdm
    nkisim.install()
    from nkisim.numerics import make
    models = _names(a.models, MODELS, "models")
    variants = _names(a.variants, KERNEL_VARIANTS, "variants")
    if not 1 <= a.prompts <= len(TEXT_PROMPTS):
        raise UsageError(f"--prompts must be in 1..{len(TEXT_PROMPTS)}, got {a.prompts}")
    if not 2 <= a.tokens <= 256:
        raise UsageError(f"--tokens must be in 2..256, got {a.tokens}")
    if a.tp not in (1, 2, 4):
        raise UsageError(f"--tp must be 1, 2 or 4, got {a.tp}")
    try:
        setting = make(a.mode, a.seed, a.act_rel_error, a.act_segment_bits, a.fp32_matmul)
    except ValueError as e:
        raise UsageError(str(e)) from None
    root = Path(__file__).resolve().parents[1]
    out_path = Path(a.out) if a.out else root / "bench" / "robustness.json"
    bar = tqdm(total=len(models) * len(variants) * a.prompts, desc="robustness", unit="prompt", file=sys.stderr,
               disable=a.quiet or a.json)
    try:        # read before the run: the code measured is the checkout's when it starts
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    t0 = time.time()
    report = run(load_models(models, a.prompts), variants, a.tokens, setting.to_dict(), tp=a.tp,
                 progress=lambda s: (bar.set_postfix_str(s), bar.update(1)))
    bar.close()
    doc = {"command": "python -m harness.bench robustness " + " ".join(getattr(a, "argv", []) or []),
           "commit": commit, "numerics": setting.to_dict(), "tp": a.tp, "lnc": 2, "tokens": a.tokens,
           "seconds": round(time.time() - t0, 1), "models": report}
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(doc, indent=1) + "\n")
    if a.json:
        print(json.dumps(doc))
    else:
        print(f"numerics: {setting.to_dict()}; TP={a.tp} x LNC=2; {a.tokens} teacher-forced positions per prompt\n")
        print(table(report))
        print(f"\nwrote {out_path} ({doc['seconds']} s)")
    return 0
