"""Bring-up check: the device's teacher-forced logits against the CPU reference, passing on a stated logit
tolerance and top-1 agreement outside near-ties (``python -m harness.nxdi.run check``).

Exact greedy-token equality with a CPU run is the wrong test for a chip: trn2's activation functions are
piece-wise polynomial approximations and its fp32 matmul is not one sgemm, so a correct kernel moves logits by a
little, and wherever the reference's two best logits are closer than that the greedy token may flip -- after
which the sequences share nothing (``python -m harness.bench robustness`` measures how often). The check instead
follows NxDI's logit validation (neuronx-distributed-inference 0.9.0,
``src/neuronx_distributed_inference/experimental/core/accuracy/logit_validation.py``: ``logit_validation``
teacher-forces the model under test through the reference's tokens, lines 296-343, and ``_validate_single_token_logits``
checks the logits with (atol, rtol) tolerances and, where the greedy tokens differ, that the expected token is
within ``divergence_difference_tol`` of the best one, lines 430-559; ``utils/accuracy.py`` ``check_accuracy_logits``
drives it for an NxDI application, lines 478-705):

* the reference (the single-device PyTorch model on the CPU, token by token) decodes ``tokens`` greedy tokens per
  prompt, and the device is teacher-forced through prompt + those tokens (harness.teacher_forcing: after its
  prefill -- the context-encoding graphs by default, ``--prefill``), rounds of its K drafts all forced to the
  reference's tokens and K + 1 tokens committed each, so the round graph's K-token accept runs). The device's
  logits are the host's projection of the post-norm hidden it returns (its LM-head kernel returns ids, not
  logits) with the checkpoint's LM head; its ids are checked against those logits.
* at every position i, with ``tol_i = atol + rtol * max_v |reference logit_v|`` (a tolerance relative to the
  position's logit scale, like NxDI's rtol, with its atol 1e-5):

  1. logits: ``max_v |device logit_v - reference logit_v| <= tol_i``;
  2. top-1: the device's greedy id equals the reference's top-1 unless the position is a NEAR-TIE (reference
     top-1 / top-2 margin <= 2 tol_i: errors within tolerance can close it); at a near tie the device's id must
     be one of the reference's near-tied ids (its reference logit within 2 tol_i of the best), NxDI's
     divergence-difference rule;
  3. head: the device's id is a top-1 of the device's own logits up to tol_i (its on-chip argmax is right).

DEFAULT_RTOL = 0.05 is NxDI's tolerance for the whole vocabulary (``DEFAULT_TOLERANCE_MAP`` "all": (1e-5, 0.05);
its top-5 tier is 0.01), here relative to the position's largest |logit|. The robustness report (README, "Numerics
robustness") measures, on the embedded model under nkisim's pessimistic hardware-like numerics, a p99 error of
~1% of that scale and a worst of 2.8% -- the position where an MoE router's near-tied experts swapped -- so 0.01
would fail correct kernels and 0.05 passes them with a margin of ~1.8x, while a kernel bug (a wrong weight, layout
or missing term) moves logits by a good part of the scale. A random checkpoint is not a good bring-up model: its
routers are near-tied far more often, and swapped experts move its logits by up to 15% of the scale (same report).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

DEFAULT_RTOL = 0.05
DEFAULT_ATOL = 1e-5
DEFAULT_TOKENS = 12


@dataclass
class Position:
    """One checked position: prediction ``index`` of prompt ``prompt`` (the token after prompt + continuation[:index])."""

    prompt: int
    index: int
    max_abs: float          # max_v |device - reference| logit
    at_id: int              # the vocabulary id where it is largest
    tolerance: float
    ref_top1: int
    ref_margin: float       # reference top-1 minus top-2 logit
    device_id: int
    near_tie: bool
    problems: list[str] = field(default_factory=list)


def check_positions(ref_logits: torch.Tensor, dev_logits: torch.Tensor, dev_ids, prompt: int = 0,
                    rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL) -> list[Position]:
    """The three rules (module docstring) at each of N positions: logits [N, V] (float), device ids [N]."""
    ref, dev = ref_logits.double(), dev_logits.double()
    if ref.shape != dev.shape or ref.ndim != 2 or len(dev_ids) != ref.shape[0]:
        raise ValueError(f"check_positions: shapes {tuple(ref.shape)}, {tuple(dev.shape)} and {len(dev_ids)} ids "
                         f"do not match ([N, V], [N, V], [N])")
    out = []
    for i in range(ref.shape[0]):
        r, d, did = ref[i], dev[i], int(dev_ids[i])
        delta = (d - r).abs()
        at = int(delta.argmax())
        tol = atol + rtol * float(r.abs().max())
        top2 = torch.topk(r, 2)
        margin = float(top2.values[0] - top2.values[1])
        p = Position(prompt, i, float(delta[at]), at, tol, int(top2.indices[0]), margin, did, margin <= 2 * tol)
        if p.max_abs > tol:
            p.problems.append(f"logit of id {at} off by {p.max_abs:.4g} (tolerance {tol:.3g})")
        if not 0 <= did < r.numel():
            p.problems.append(f"device id {did} is outside the vocabulary [0, {r.numel()})")
        else:
            if did != p.ref_top1 and not p.near_tie:
                p.problems.append(f"top-1 {did} != reference {p.ref_top1} (margin {margin:.4g} > 2 x tolerance)")
            elif did != p.ref_top1 and float(r.max() - r[did]) > 2 * tol:
                p.problems.append(f"top-1 {did} is {float(r.max() - r[did]):.4g} below the reference's best "
                                  f"(near-tie allowance {2 * tol:.3g})")
            short = float(d.max() - d[did])
            if short > tol:
                p.problems.append(f"device id {did} is {short:.4g} below the best of the device's own logits")
        out.append(p)
    return out


@dataclass
class CheckResult:
    positions: list[Position]
    rtol: float
    atol: float
    prompts: list[list[int]]
    continuations: list[list[int]]

    @property
    def failures(self) -> list[Position]:
        return [p for p in self.positions if p.problems]

    @property
    def passed(self) -> bool:
        return bool(self.positions) and not self.failures

    def summary(self) -> dict:
        ps = self.positions
        worst = max(ps, key=lambda p: p.max_abs / p.tolerance)
        return {"passed": self.passed, "positions": len(ps), "failures": len(self.failures),
                "rtol": self.rtol, "atol": self.atol, "max_abs": max(p.max_abs for p in ps),
                "worst_ratio_to_tolerance": worst.max_abs / worst.tolerance,
                "worst_at": {"prompt": worst.prompt, "index": worst.index},
                "top1_equal": sum(p.device_id == p.ref_top1 for p in ps),
                "near_ties": sum(p.near_tie for p in ps)}

    def to_dict(self) -> dict:
        return {**self.summary(), "prompts": self.prompts, "reference_tokens": self.continuations,
                "failing_positions": [asdict(p) for p in self.failures]}

    def report(self, show: int = 20) -> str:
        """Readable: the tolerance, the figures, PASS or FAIL with a table of the failing positions."""
        s = self.summary()
        n = len(self.prompts)
        lines = [f"bring-up check: {n} prompt{'s' * (n != 1)}, {s['positions']} teacher-forced positions; tolerance "
                 f"|dlogit| <= {self.atol:g} + {self.rtol:g} x max |reference logit| of the position",
                 f"max |dlogit| {s['max_abs']:.4g}; worst {s['worst_ratio_to_tolerance']:.2f} x tolerance (prompt "
                 f"{s['worst_at']['prompt']}, position {s['worst_at']['index']})",
                 f"top-1: {s['top1_equal']} / {s['positions']} equal to the reference; {s['near_ties']} near-ties "
                 f"(reference margin <= 2 x tolerance)"]
        if self.passed:
            lines.append("PASS")
            return "\n".join(lines)
        lines.append(f"FAIL: {s['failures']} of {s['positions']} positions")
        lines.append(f"{'prompt':>6} {'pos':>4} {'input':>7} {'max|dlogit|':>11} {'at id':>7} {'tolerance':>9} "
                     f"{'ref top-1':>9} {'margin':>8} {'device':>7}  problem")
        for p in self.failures[:show]:
            prompt, cont = self.prompts[p.prompt], self.continuations[p.prompt]
            token = prompt[-1] if p.index == 0 else cont[p.index - 1]
            for k, why in enumerate(p.problems):
                head = (f"{p.prompt:>6} {p.index:>4} {token:>7} {p.max_abs:>11.4g} {p.at_id:>7} {p.tolerance:>9.3g} "
                        f"{p.ref_top1:>9} {p.ref_margin:>8.3g} {p.device_id:>7}") if k == 0 else " " * 83
                lines.append(f"{head}  {why}")
        if len(self.failures) > show:
            lines.append(f"... {len(self.failures) - show} more (--json lists all)")
        return "\n".join(lines)


def run_check(cfg, params: dict[str, torch.Tensor], device, prompts: list[list[int]], tokens: int = DEFAULT_TOKENS,
              rtol: float = DEFAULT_RTOL, atol: float = DEFAULT_ATOL, progress=None) -> CheckResult:
    """Teacher-force ``device`` (a ``harness.speculative.Decoder``) through each prompt + the reference's ``tokens``
    greedy tokens (the single-device reference of ``params``, token by token) and check every position."""
    from harness.teacher_forcing import forced_run, head_weight, host_logits, reference_run
    head = head_weight(cfg, params)
    positions, conts = [], []
    for k, prompt in enumerate(prompts):
        cont, hidden = reference_run(cfg, params, prompt, tokens)
        conts.append(cont)
        dev = forced_run(device, prompt, cont)
        ref_logits = host_logits(hidden[len(prompt) - 1:], head)
        positions += check_positions(ref_logits, dev.logits(head), dev.targets, k, rtol, atol)
        if progress:
            progress(k)
    return CheckResult(positions, rtol, atol, [list(p) for p in prompts], conts)


class NoisyDecoder:
    """A decoder whose returned hiddens carry seeded Gaussian noise of ``scale`` x their RMS (``--inject-noise``:
    a self-test of the check on CPU). Everything else is the wrapped decoder's."""

    def __init__(self, variant, scale: float, seed: int = 0):
        self.inner, self.scale = variant, scale
        self.gen = torch.Generator().manual_seed(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _noisy(self, h: torch.Tensor) -> torch.Tensor:
        h = h.float()
        rms = h.pow(2).mean(dim=-1, keepdim=True).sqrt()
        return h + self.scale * rms * torch.randn(h.shape, generator=self.gen)

    def prefill(self, prompt, max_len):
        first, h = self.inner.prefill(prompt, max_len)
        return first, self._noisy(h)

    def round(self, *args, **kwargs):
        r = self.inner.round(*args, **kwargs)
        return dataclasses.replace(r, hidden=self._noisy(r.hidden))

    def step(self, token, pos):
        tok, h = self.inner.step(token, pos)
        return tok, self._noisy(h)


# ---- command line (registered by harness.nxdi.run) -----------------------------------------------------------
def add_arguments(p) -> None:
    """The check's own options (harness.nxdi.run adds --tp / --lnc / --dtype as for decode)."""
    p.add_argument("--executor", choices=["neuron", "cpu"], default="neuron")
    p.add_argument("--converted", type=Path, help="converted directory (neuron executor)")
    p.add_argument("--compiled", type=Path, help="compiled directory (neuron executor)")
    p.add_argument("--model-path", type=Path, required=True,
                   help="Hugging Face checkpoint: the CPU reference and the LM head (and the cpu executor's weights)")
    p.add_argument("--backend", choices=["xla", "megakernel"], default="xla", help="cpu executor's backend")
    p.add_argument("--skip-warmup", action="store_true", help="neuron executor: skip NxDI's warmup at load")
    p.add_argument("--prompt-ids", action="append", metavar="ID,ID,...",
                   help="a prompt as comma-separated token ids (repeat for several; default: the bytes of the four "
                        "first prompts of harness.robustness)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help=f"teacher-forced positions per prompt (default {DEFAULT_TOKENS})")
    p.add_argument("--rtol", type=float, default=DEFAULT_RTOL,
                   help=f"logit tolerance relative to the position's max |reference logit| (default {DEFAULT_RTOL})")
    p.add_argument("--atol", type=float, default=DEFAULT_ATOL, help=f"absolute part (default {DEFAULT_ATOL:g})")
    p.add_argument("--inject-noise", type=float, default=0.0, metavar="SCALE",
                   help="cpu executor: add seeded noise of SCALE x RMS to every hidden the device returns (a self-test "
                        "of the check: small noise passes, large fails)")
    p.add_argument("--hardware-like", action="store_true",
                   help="cpu executor, megakernel backend: run the kernels under nkisim.numerics('hardware-like')")
    p.add_argument("--show", type=int, default=20, help="failing positions printed (default 20)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _prompts(args, vocab: int, usage) -> list[list[int]]:
    if not args.prompt_ids:
        from harness.teacher_forcing import TEXT_PROMPTS
        return [list(t.encode("utf-8")) for t in TEXT_PROMPTS[:4]]
    out = []
    for text in args.prompt_ids:
        try:
            ids = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise usage(f"--prompt-ids: expected comma-separated integers, found {text!r}") from None
        if not ids:
            raise usage("--prompt-ids: a prompt is empty")
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise usage(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        out.append(ids)
    return out


def cmd(args, make_engine, usage, make_decoder) -> int:
    """``python -m harness.nxdi.run check``: 0 on PASS, 1 on FAIL. ``make_engine(args, max_len)`` -> (engine, cfg)
    is the CLI's engine of ``--executor``, ``make_decoder(args, engine)`` its decoder with the prefill of
    ``--prefill`` (harness.nxdi.run); usage errors raise ``usage`` (run.UsageError). The device runs rounds of its
    K drafts, all K forced to the reference's tokens and K + 1 tokens committed (harness.teacher_forcing.forced_run):
    the K-token accept path of the round graph runs on the device."""
    import contextlib

    from model.config import ConfigError
    from model.weights import CheckpointError, load_checkpoint
    if args.tokens < 1:
        raise usage(f"--tokens must be >= 1, found {args.tokens}")
    if args.rtol < 0 or args.atol < 0:
        raise usage("--rtol and --atol must be >= 0")
    if args.executor != "cpu" and (args.inject_noise or args.hardware_like):
        raise usage("--inject-noise and --hardware-like are for --executor cpu (a self-test on CPU)")
    if args.hardware_like and args.backend != "megakernel":
        raise usage("--hardware-like needs --backend megakernel (the xla backend does not run under nkisim)")
    if args.inject_noise < 0:
        raise usage(f"--inject-noise must be >= 0, found {args.inject_noise}")
    # the device first (it fixes the dtype), then the CPU reference in that dtype
    probe = _prompts(args, 1 << 31, usage)
    engine, cfg = make_engine(args, max_len=max(len(p) for p in probe) + args.tokens + 2)
    prompts = _prompts(args, cfg.vocab_size, usage)
    try:
        _, params = load_checkpoint(args.model_path, dtype=engine.dtype)
    except (CheckpointError, ConfigError) as e:
        raise usage(str(e)) from None
    device = make_decoder(args, engine)   # prefill: the context graphs (default) or teacher-forced
    if args.inject_noise:
        device = NoisyDecoder(device, args.inject_noise)
    numerics = contextlib.nullcontext()
    if args.hardware_like:
        import nkisim
        numerics = nkisim.numerics("hardware-like")
    with numerics:
        try:
            result = run_check(cfg, params, device, prompts, args.tokens, args.rtol, args.atol,
                               progress=None if args.json else (
                                   lambda k: print(f"  prompt {k + 1}/{len(prompts)} done", file=sys.stderr)))
        except ValueError as e:         # e.g. a sequence longer than the decode state holds
            raise usage(str(e)) from None
    if args.json:
        print(json.dumps({**result.to_dict(), "executor": args.executor, "num_draft_tokens": device.drafts,
                          "prefill": getattr(device, "prefill_info", None) or {"backend": "teacher-forced"}}))
    else:
        print(result.report(args.show))
    return 0 if result.passed else 1
