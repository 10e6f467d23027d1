"""The host loop: prefill, then rounds of draft / verify / replay with greedy accept, over any engine.

Greedy speculative decoding is lossless: the committed tokens equal plain greedy decoding of the same model. A
round of K chained drafts d_1 .. d_K verifies [x, d_1 .. d_K] and gets the targets y_0 .. y_K (y_j: the trunk's
greedy token after the first j + 1 of them). It emits y_0 (always right) and, for the longest prefix of drafts
with d_j = y_{j-1} (n of them), y_1 .. y_n as well: n + 1 tokens, the last one the bonus / correction token.

Sampling (``generate(..., sampling=Sampling(temperature > 0, ...))``), lossless in every variant
(``harness.sampling``): the xla variant draws the drafts from the MTP head's processed distributions inside the
launch and the host applies the standard speculative rejection rule to the verify's distributions
(``engine.sampler == "rejection"``); the kernel variants (``"gumbel"``) get the shared Gumbel noise of the
launch's positions (``harness.sampling.GumbelNoise``) as a run-time input, draft and verify each take the
Gumbel-max token, and the host keeps the greedy accept rule: the committed tokens are those of plain Gumbel-max
sampling with the same noise. Either way they are distributed exactly as plain sampling from the target model.

Device-committed rounds (an engine built with ``device_commit``, the megakernel): after the prefill the host seeds
the engine's control state once (:meth:`Decoder.start_chain`); then every round is launched with no input but
``force`` (:meth:`Decoder.chained_round`): the round accepts on device and writes the next round's pending token,
read slot, position and hidden, and the host only reads the emitted tokens (to stop at EOS or max tokens). Sampled
(shared Gumbel noise), the round takes its noise rows from the engine's noise window by the device's position; the
host only keeps the window ahead (:class:`NoiseBook`, ``megakernel.plan`` module docstring). The tokens equal the
host-driven rounds' (tested), greedy and sampled.

:class:`Decoder` is the one host side of every variant: the slot bookkeeping (:class:`SlotBook`), the accept rule
(:func:`accepted_count`), the run-time inputs of each launch (``megakernel.plan.round_inputs`` / ``step_inputs``)
and the prefill: on the host with the reference model when the engine takes a state (``load_state``), otherwise
teacher-forced through the decode launches (``megakernel.plan.teacher_forced_launches``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from harness.engines import LaunchResult
from harness.sampling import GumbelNoise, Sampling, accept, draw, gumbel, gumbel_max, probabilities
from megakernel import plan as rp
from model.reference import ReferenceModel
from model.state import DecodeState

# A test draft source: given every token so far (prompt + generated), propose the drafts for the round instead of
# the MTP head (one token id, or a list of up to K).
DraftSource = Callable[[list[int]], "int | list[int]"]


def accepted_count(drafts: list[int], targets: list[int]) -> int:
    """Greedy acceptance of K chained drafts: 1 + the length of the longest prefix with drafts[j] == targets[j]
    (1 .. K + 1 tokens committed)."""
    if len(targets) != len(drafts) + 1:
        raise ValueError(f"accept: {len(drafts)} drafts need {len(drafts) + 1} targets, found {len(targets)}")
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n + 1


class SlotBook:
    """Which GDN checkpoint slot holds the committed state. A verify of T tokens writes slot j with the state after
    token j; committing n accepted tokens makes slot n-1 the one the next launch reads. Nothing is copied.
    ``slots``: K + 1 for rounds of K drafts."""

    def __init__(self, slots: int = rp.SLOTS):
        self.slots = slots
        self.read_slot = 0

    def commit(self, accepted: int) -> int:
        if not 1 <= accepted <= self.slots:
            raise ValueError(f"commit: accepted must be in 1..{self.slots}, found {accepted}")
        self.read_slot = accepted - 1
        return self.read_slot

    def reset(self) -> None:
        self.read_slot = 0


class NoiseBook:
    """Which round start positions the engine's noise window holds (sampled device-committed rounds; the contract is
    in the ``megakernel.plan`` module docstring): [p, ``hi``) for the position p the host has read. :meth:`due`
    before each launch gives the start positions to write now: none while p + K + 1 < hi (the entries of the next
    two rounds, p .. p + K + 1, are there), else hi .. p + W - 1 (p .. p + W - 1 the first time), whose slots hold
    positions below p, which no round reads again. ``refreshes``: how many writes so far."""

    def __init__(self, window: int, drafts: int):
        self.window, self.reach = rp.check_noise_window(window, drafts), drafts + 1
        self.hi = None
        self.refreshes = 0

    def due(self, pos: int) -> range:
        if self.hi is not None and pos + self.reach < self.hi:
            return range(0)
        if self.hi is not None and pos > self.hi:
            raise ValueError(f"noise window: position {pos} is past the written entries (< {self.hi})")
        start = pos if self.hi is None else self.hi
        self.hi = pos + self.window
        self.refreshes += 1
        return range(start, self.hi)


class Decoder:
    """The host side of a variant over an engine (``harness.engines.Engine``).

    Positions: after prefill of p prompt tokens the pending token x_p sits at position p and ``hidden`` is
    h_{p-1}. ``round(pending, hidden, pos)`` takes pos = the position of the pending token. ``reference``: the
    host model for the prefill (None: teacher-forced prefill through the engine's decode launches). Rounds have
    the engine's number of chained drafts (``engine.drafts``, 1 when the engine does not say)."""

    def __init__(self, engine, reference: ReferenceModel | None = None):
        self.engine = engine
        self.cfg = engine.cfg
        self.name = engine.name
        self.drafts = getattr(engine, "drafts", rp.DEFAULT_DRAFTS)
        self.reference = reference if hasattr(engine, "load_state") else None
        self.slots = SlotBook(self.drafts + 1)
        self.first_logits = None    # logits [V] of the token after the prompt (set by prefill)
        self.noise = None           # the shared Gumbel noise of a sampled sequence (sampler "gumbel")
        self.first_sampled = False  # prefill's first token is already its Gumbel-max sample (teacher-forced)
        self.chained = False        # the device holds the control state (start_chain): it knows the read slot
        self.chain_pos = 0          # ... and the pending token's position, as the host read it from the emitted tokens
        self.noise_book = None      # ... and, sampled, the noise window's bookkeeping (NoiseBook)

    @property
    def device_commit(self) -> bool:
        """Whether the engine runs device-committed rounds (``harness.engines.MegakernelEngine(device_commit)``)."""
        return bool(getattr(self.engine, "device_commit", False))

    @property
    def gumbel(self) -> bool:
        """Whether the engine samples by shared Gumbel noise (the kernel variants) rather than by the rejection
        rule (the xla variant; an engine that does not say)."""
        return getattr(self.engine, "sampler", "rejection") == "gumbel"

    def set_sampling(self, sampling, sample: int = 0) -> None:
        """Sampled launches (a ``harness.sampling.Sampling`` with temperature > 0; ``sample``: the sequence index,
        seed + sample) or greedy ones (None). Only an engine with a ``sampling`` attribute samples; the Gumbel
        engines take no top-k / top-p (``harness.sampling`` docstring)."""
        if not hasattr(self.engine, "sampling"):
            raise ValueError(f"variant {self.name} decodes greedily only (sampling: --variant xla / layerwise / "
                             f"megakernel)")
        self.noise = None
        if sampling is not None and self.gumbel:
            if sampling.top_k or sampling.top_p < 1:
                raise ValueError(f"variant {self.name} samples with --temperature only (no --top-k / --top-p: "
                                 f"those run on --variant xla)")
            self.noise = GumbelNoise(sampling.seed + sample, self.cfg.vocab_size, sampling.temperature)
        self.engine.sampling = sampling

    def _noise(self, pos: int, tokens: int) -> dict:
        """The ``noise`` input of a Gumbel-sampled launch whose first verified token sits at ``pos``: rows for the
        positions pos + 1 .. pos + tokens its targets predict ({} when not sampling by Gumbel noise)."""
        return {} if self.noise is None else {"noise": self.noise.scaled(pos + 1, tokens)}

    @property
    def launches(self) -> int:
        return self.engine.launches

    def begin_prefill(self, prompt: list[int], max_len: int) -> None:
        """What every prefill (this one and the NKI / NxDI context ones) does first: refuse an empty prompt, start
        the engine's decode state, reset the slot book and forget the previous prompt's first-token facts."""
        if not prompt:
            raise ValueError("prefill: the prompt is empty")
        self.engine.start(max_len)
        self.slots.reset()
        self.first_sampled = False
        self.first_logits = None
        self.chained = False

    def prefill(self, prompt: list[int], max_len: int) -> tuple[int, torch.Tensor]:
        """Encode the prompt; returns (first generated token, h at the last prompt position). Also fills the MTP KV
        cache for positions 0..p-2 (the MTP at p uses token p+1)."""
        self.begin_prefill(prompt, max_len)
        if self.reference is None:
            return self._teacher_forced(prompt)
        ref, cfg = self.reference, self.cfg
        state = DecodeState.empty(cfg, max_len, slots=self.slots.slots, dtype=ref.dtype)
        ids = torch.tensor(prompt, dtype=torch.long)
        h = ref.trunk(ids, state, 0, chunked=True)
        self.first_logits = ref.logits(h[-1:])[0]
        first = int(torch.argmax(self.first_logits))
        if cfg.mtp_num_hidden_layers and len(prompt) > 1:
            ref.mtp(ids[1:], h[:-1], state, 0)
        self.engine.load_state(state)
        return first, h[-1]

    def _teacher_forced(self, prompt: list[int]) -> tuple[int, torch.Tensor]:
        hidden, out, last = None, None, None
        for launch in rp.teacher_forced_launches(len(prompt), self.drafts):
            if launch.mode == "step":
                out = self._launch_step(prompt[launch.pos], launch.pos)
            else:
                forced = None if launch.forced is None else prompt[launch.forced:launch.forced + launch.accepted - 1]
                noise = None    # sampled launches: the unforced drafts are never committed here; no noise
                if getattr(self.engine, "sampling", None) is not None and not self.gumbel:
                    noise = torch.zeros(self.drafts, self.cfg.vocab_size, dtype=torch.float64)
                out = self.round(prompt[launch.pos], hidden, launch.pos, forced, noise)
            self.slots.commit(launch.accepted)
            hidden, last = out.hidden[launch.accepted - 1], launch.accepted
        self.first_logits = None if out.target_logits is None else out.target_logits[last - 1]
        self.first_sampled = self.noise is not None     # the last launch carried the noise of position n
        return out.targets[last - 1], hidden

    def round(self, pending: int, hidden: torch.Tensor, pos: int, forced_draft=None, draft_noise=None
              ) -> LaunchResult:
        """One speculative round (``forced_draft``: ``plan.forced_drafts``; ``draft_noise`` [K, V] float64 Gumbel
        noise of a rejection-sampled round; a Gumbel-sampled one gets its positions' noise here, its drafts and
        targets are then Gumbel-max tokens); the host then commits 1 .. K + 1 tokens (:meth:`commit`)."""
        inputs = rp.round_inputs(self.cfg, self.engine.dtype, pending, hidden, pos, self.slots.read_slot,
                                 forced_draft, self.drafts)
        if draft_noise is not None:
            inputs["draft_noise"] = draft_noise
        return self.engine.run("round", {**inputs, **self._noise(pos, self.drafts + 1)})

    def _launch_step(self, token: int, pos: int) -> LaunchResult:
        inputs = rp.step_inputs(self.cfg, token, pos, self.slots.read_slot, self.slots.slots)
        return self.engine.run("step", {**inputs, **self._noise(pos, 1)})

    def step(self, token: int, pos: int) -> tuple[int, torch.Tensor]:
        """Plain greedy (Gumbel-sampled) decode of one token at ``pos``: (next token, its hidden [H])."""
        out = self._launch_step(token, pos)
        self.slots.commit(1)
        return out.targets[0], out.hidden[0]

    def sampled_step(self, token: int, pos: int, sampling, gen: torch.Generator) -> tuple[int, torch.Tensor]:
        """Plain sampled decode of one token at ``pos``: (next token drawn from the target, its hidden [H])."""
        out = self._launch_step(token, pos)
        self.slots.commit(1)
        return draw(probabilities(out.target_logits, sampling)[0], gen), out.hidden[0]

    def sampled_round(self, pending: int, hidden: torch.Tensor, pos: int, sampling, gen: torch.Generator
                      ) -> tuple[list[int], LaunchResult, torch.Tensor]:
        """One sampled round: Gumbel noise for the drafts, the launch, the rejection rule, the commit. Returns (the
        committed tokens, the launch result, the target distributions p [K + 1, V])."""
        noise = gumbel(gen, (self.drafts, self.cfg.vocab_size))
        r = self.round(pending, hidden, pos, None, noise)
        p = probabilities(r.target_logits, sampling)
        tokens = accept(r.drafts, r.draft_probs, p, gen)
        self.commit(len(tokens))
        return tokens, r, p

    def start_chain(self, pending: int, hidden: torch.Tensor, pos: int) -> None:
        """Hand the sequence to the device (once, after the prefill): the control state of the pending token at
        ``pos`` with h_{pos-1} = ``hidden`` and the committed checkpoint slot; from here on the rounds keep it."""
        self.engine.seed_control(pending, hidden, pos, self.slots.read_slot)
        self.chained, self.chain_pos, self.noise_book = True, pos, None
        if self.noise is not None:      # sampled: a noise window, kept ahead of the device
            self.engine.start_noise()
            self.noise_book = NoiseBook(self.engine.noise_window, self.drafts)

    def chained_round(self, forced_draft=None) -> LaunchResult:
        """One device-committed round (after :meth:`start_chain`): no host input but ``force`` (``forced_draft``:
        ``plan.forced_drafts``, tests); ``LaunchResult.emitted`` holds the 1 .. K + 1 tokens it committed. Sampled,
        the noise window is refreshed first when the position read so far nears its end (:class:`NoiseBook`)."""
        if not self.chained:
            raise ValueError("chained_round: start_chain first (the device holds no control state)")
        if self.noise_book is not None:
            due = self.noise_book.due(self.chain_pos)
            if len(due):
                self.engine.write_noise(self.noise, due)
        r = self.engine.run("chain", {"force": rp.force_input(self.cfg, forced_draft, self.drafts)})
        self.chain_pos += len(r.emitted)
        return r

    def commit(self, accepted: int) -> None:
        """Keep the first ``accepted`` (1 .. K + 1) verified tokens' state."""
        self.slots.commit(accepted)

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        """The committed decode state after ``length`` trunk tokens in the reference layout (for the decode-state
        invariant: it must equal plain token-by-token decoding's), when the engine can read its state back."""
        read_back = getattr(self.engine, "reference_state", None)
        if read_back is None:
            raise TypeError(f"{type(self.engine).__name__} cannot read its decode state back")
        slot = self.engine.control()["read_slot"] if self.chained else self.slots.read_slot
        return read_back(slot).committed(length)


def make_decoder(name: str, cfg, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2,
                 drafts: int = rp.DEFAULT_DRAFTS, draft_ids=None, device_commit: bool = False,
                 noise_window: int | None = None, draft_fp8: bool = False) -> Decoder:
    """A variant by name (``harness.engines.ENGINE_NAMES``) with rounds of ``drafts`` chained drafts (over the FR-Spec
    draft vocabulary ``draft_ids``, or the full one): its in-process engine, prefilled on the host.
    ``device_commit``: device-committed rounds (megakernel only), sampled ones with a noise window of
    ``noise_window`` entries (None: ``plan.noise_window``). ``draft_fp8``: the drafts' head in fp8 (megakernel only,
    ``harness.engines.make_engine``)."""
    from harness.engines import make_engine
    return Decoder(make_engine(name, cfg, params, tp=tp, lnc=lnc, drafts=drafts, draft_ids=draft_ids,
                               device_commit=device_commit, noise_window=noise_window, draft_fp8=draft_fp8),
                   ReferenceModel(cfg, params))


@dataclass
class DecodeResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    drafts: int = rp.DEFAULT_DRAFTS  # chained drafts per round (K)
    accepted_per_round: list[int] = field(default_factory=list)  # tokens committed by each round (1 .. K + 1)
    round_seconds: list[float] = field(default_factory=list)     # host wall time of each round's launch
    # sampled rounds: sum_x min(p_0(x), q_1(x)) = 1 - TV(p_0, q_1), the acceptance probability of draft 1 (the
    # optimum of any lossless scheme, which the rejection rule attains)
    draft1_optimum: list[float] = field(default_factory=list)

    @property
    def rounds(self) -> int:
        return len(self.accepted_per_round)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of all drafts accepted (0 when no round ran)."""
        return sum(a - 1 for a in self.accepted_per_round) / (self.rounds * self.drafts) if self.rounds else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """Entry i: the fraction of rounds whose draft i + 1 was accepted (a draft counts only when every draft
        before it was: the accepted prefix)."""
        if not self.rounds:
            return [0.0] * self.drafts
        return [sum(a - 1 > i for a in self.accepted_per_round) / self.rounds for i in range(self.drafts)]

    @property
    def tokens_per_round(self) -> float:
        return sum(self.accepted_per_round) / self.rounds if self.rounds else 0.0

    def round_time_percentiles(self) -> dict:
        """p50 / p90 / p99 of the rounds' wall time in milliseconds (nearest rank; empty without rounds)."""
        if not self.round_seconds:
            return {}
        xs = sorted(self.round_seconds)
        return {f"p{q}": round(1e3 * xs[max(0, -(-q * len(xs) // 100) - 1)], 3) for q in (50, 90, 99)}

    def to_dict(self) -> dict:
        return {
            "tokens": self.tokens,
            "num_draft_tokens": self.drafts,
            "rounds": self.rounds,
            "accepted_per_round": self.accepted_per_round,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_per_position": self.acceptance_per_position,
            "tokens_per_round": self.tokens_per_round,
            "round_ms": self.round_time_percentiles(),
            **({"draft1_acceptance_optimum": sum(self.draft1_optimum) / len(self.draft1_optimum)}
               if self.draft1_optimum else {}),
        }


def generate(decoder: Decoder, prompt: list[int], max_new_tokens: int, eos_ids: tuple[int, ...] = (),
             spec: bool = True, draft_source: DraftSource | None = None,
             on_tokens: Callable[[list[int]], None] | None = None, sampling: Sampling | None = None,
             sample: int = 0) -> DecodeResult:
    """Decode up to max_new_tokens after prompt (greedy, or sampled with ``sampling``); stops after an EOS token.

    spec=False: plain decoding, one trunk step per token. draft_source (tests; greedy, or Gumbel sampling): forces
    the drafts of each round (one token or up to K, ``plan.forced_drafts``). on_tokens, if given, is called with
    each batch of newly emitted tokens (for progress display). sampling: temperature / top-k / top-p / seed
    (``harness.sampling.Sampling``; temperature 0 = greedy); ``sample`` picks the generator (seed + sample). A
    Gumbel-sampling engine runs the greedy loop below on noisy scores (the noise rides with every launch). A
    decoder whose engine commits on device (``Decoder.device_commit``) chains its rounds: the host reads the emitted
    tokens and computes no launch input (sampled: it keeps the noise window ahead, ``Decoder.chained_round``).
    """
    if not prompt:
        raise ValueError("generate: the prompt is empty")
    if max_new_tokens < 1:
        raise ValueError(f"generate: max_new_tokens must be >= 1, found {max_new_tokens}")
    sampled = sampling is not None and not sampling.greedy
    if sampled:
        decoder.set_sampling(sampling, sample)
    elif hasattr(decoder.engine, "sampling"):
        decoder.set_sampling(None)
    if sampled and draft_source is not None and not decoder.gumbel:
        raise ValueError("generate: forced drafts are for greedy decoding and Gumbel sampling")
    chained = spec and getattr(decoder, "device_commit", False)
    if chained and sampled and not decoder.gumbel:
        raise ValueError("generate: device-committed rounds sample by shared Gumbel noise (the kernel variants); "
                         "the rejection rule needs the host")
    gumbel_sampled = sampled and decoder.gumbel      # the greedy loop on noisy scores
    gen = sampling.generator(sample) if sampled and not gumbel_sampled else None
    K = decoder.drafts
    # The verify of the last round may write K positions past the last emitted token.
    pending, hidden = decoder.prefill(prompt, max_len=len(prompt) + max_new_tokens + K)
    if gumbel_sampled and not getattr(decoder, "first_sampled", False):
        # host prefill: the first token's Gumbel-max sample from its logits (a teacher-forced prefill's last target
        # already is that sample: its launch carried the noise of position len(prompt))
        if getattr(decoder, "first_logits", None) is None:
            raise ValueError(f"generate: the {decoder.name} prefill gives no logits to sample the first token from")
        pending = int(gumbel_max(decoder.first_logits[None], decoder.noise.scaled(len(prompt), 1))[0])
    elif sampled and not gumbel_sampled:
        if decoder.first_logits is None:
            raise ValueError(f"generate: the {decoder.name} prefill gives no logits to sample the first token from")
        pending = draw(probabilities(decoder.first_logits[None], sampling)[0], gen)
    result = DecodeResult(tokens=[pending], drafts=K)
    if on_tokens:
        on_tokens([pending])
    pos = len(prompt)  # position of the pending token

    def finished() -> bool:
        return len(result.tokens) >= max_new_tokens or result.tokens[-1] in eos_ids

    if chained and not finished():
        decoder.start_chain(pending, hidden, pos)
    while not finished():
        if chained:     # the device accepts and commits; the host reads the emitted tokens only
            forced = draft_source(prompt + result.tokens) if draft_source else None
            t0 = time.perf_counter()
            emitted = decoder.chained_round(forced).emitted
            result.round_seconds.append(time.perf_counter() - t0)
            result.accepted_per_round.append(len(emitted))
        elif not spec:
            if sampled and not gumbel_sampled:
                pending, hidden = decoder.sampled_step(pending, pos, sampling, gen)
            else:
                pending, hidden = decoder.step(pending, pos)
            pos += 1
            emitted = [pending]
        elif sampled and not gumbel_sampled:
            t0 = time.perf_counter()
            emitted, r, p = decoder.sampled_round(pending, hidden, pos, sampling, gen)
            result.round_seconds.append(time.perf_counter() - t0)
            result.draft1_optimum.append(float(torch.minimum(p[0], r.draft_probs[0]).sum()))
            accepted = len(emitted)
            result.accepted_per_round.append(accepted)
            pending, hidden = emitted[-1], r.hidden[accepted - 1]
            pos += accepted
        else:
            forced = draft_source(prompt + result.tokens) if draft_source else None
            t0 = time.perf_counter()
            r = decoder.round(pending, hidden, pos, forced)
            result.round_seconds.append(time.perf_counter() - t0)
            accepted = accepted_count(r.drafts, r.targets)
            decoder.commit(accepted)
            emitted = list(r.targets[:accepted])
            result.accepted_per_round.append(accepted)
            pending, hidden = emitted[-1], r.hidden[accepted - 1]
            pos += accepted
        for tok in emitted:  # honour max_new_tokens and EOS inside a multi-token round
            if finished():
                break
            result.tokens.append(tok)
        if on_tokens:
            on_tokens(emitted)
    return result
