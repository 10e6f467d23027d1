"""Engines: things that run the launches of a ``megakernel.plan.Plan`` (a round or a plain step) on decode state
they hold -- one interface (:class:`Engine`) for every variant, driven by ``harness.speculative.Decoder``.

* :class:`XlaEngine` -- ``xla``: the plan as plain PyTorch over the ``model.tp`` twins (``harness.xla.forward``,
  the function the NxDI xla backend traces), one thread per TP rank;
* :class:`LayerwiseEngine` -- ``layerwise``: one NKI launch per layer stage (``megakernel.layerwise``) under nkisim,
  the cross-rank sums on the host between launches;
* :class:`MegakernelEngine` -- ``megakernel``: one NKI launch per round (``megakernel.round``) under nkisim;
* ``harness.nxdi.modeling.NeuronEngine`` -- the NxDI application on a trn2 chip (never executed here).

Every engine keeps the decode state in the kernels' stacked per-rank layout (``plan.state_specs``) and takes the
run-time inputs of ``plan.input_specs``; the host passes the checkpoint slot to read (``read_slot``), so
committing moves nothing. An engine runs rounds of a fixed number of chained drafts K (``drafts``, 1..3): its
round plan has K draft stages and a verify of K + 1 tokens, its GDN state K + 1 checkpoint slots. The in-process engines also take a host-built state (``load_state``: the reference
model's prefill) and give theirs back in the reference layout (``reference_state``, for the decode-state
invariant tests).

Device-side commit (``MegakernelEngine(device_commit=True)``, issue 15): besides the host-driven round the engine
runs ``chain`` launches (a round plan with ``device_commit``): each round reads the decode-control state the
previous one wrote (``plan.control_specs``, seeded once by :meth:`MegakernelEngine.seed_control` after the
prefill), accepts on device and writes the next one's, so the host passes only ``force`` and reads the emitted
tokens (``LaunchResult.emitted``). Sampled ``chain`` rounds take their Gumbel noise from a noise window the engine
holds (``plan.noise_window_specs``; :meth:`MegakernelEngine.start_noise`, :meth:`MegakernelEngine.write_noise`,
kept ahead of the device by ``harness.speculative.NoiseBook``), not per launch.

Sampling: the xla variant draws its drafts from the MTP head's processed distributions and returns the
distributions for the host's rejection rule (``sampler = "rejection"``); the kernel variants sample inside the
launch by Gumbel-max with host-supplied noise shared by position (``sampler = "gumbel"``: run-time input ``noise``
[T, V] float32, converted per rank by ``plan.noise_inputs``; ``harness.sampling``), so they return token ids only.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from megakernel import plan as rp
from megakernel.sharded import gather_state, kv_heads, rank_state, rank_weights
from model.config import ModelConfig
from model.state import DecodeState
from model.tp.embed_head import combine_argmax
from nki_kernels.host import as_torch

ENGINE_NAMES = ("xla", "layerwise", "megakernel")


@dataclass(frozen=True)
class LaunchResult:
    """What the host reads back from a round / step launch."""

    drafts: list[int]     # the K drafts (round; forced ones as forced) or [pending token] (step)
    targets: list[int]    # greedy token after each verified token (K + 1 for a round, 1 for a step)
    hidden: torch.Tensor  # [T, H] post-final-norm trunk hidden of the verified tokens
    # sampled launches only (an engine with ``sampling``; harness.sampling): the drafts' processed distributions
    # [K, V] float64 they were drawn from, and the verify's logits [T, V] float32
    draft_probs: torch.Tensor | None = None
    target_logits: torch.Tensor | None = None
    # device-committed rounds only: the tokens the round committed on device (1 .. K + 1; plan.EMITTED)
    emitted: list[int] | None = None


def read_outputs(drafts, targets, hidden) -> LaunchResult:
    return LaunchResult([int(d) for d in as_torch(drafts).reshape(-1)], [int(t) for t in as_torch(targets).reshape(-1)],
                        as_torch(hidden))


class Engine(Protocol):
    """Runs round / step launches on the decode state it holds."""

    name: str
    cfg: ModelConfig
    dtype: torch.dtype
    drafts: int           # chained drafts per round (K); the decode state has K + 1 checkpoint slots
    launches: int

    def start(self, max_len: int) -> None:
        """Begin a sequence of at most ``max_len`` positions: every decode-state buffer zero."""

    def run(self, mode: str, inputs: dict) -> LaunchResult:
        """One launch of the ``mode`` ("round" | "step") plan with the run-time inputs of ``plan.input_specs``."""


def state_tensors(cfg: ModelConfig, tp: int, max_len: int, dtype: torch.dtype, slots: int = rp.SLOTS
                  ) -> dict[str, torch.Tensor]:
    """Zero tensors of ``plan.state_specs`` ("activation" = ``dtype``)."""
    return {s.name: torch.zeros(s.shape, dtype=dtype if s.dtype == "activation" else getattr(torch, s.dtype))
            for s in rp.state_specs(cfg, tp, max_len, slots)}


class HostEngine:
    """Shared part of the in-process engines: per-rank weights (converted once) and per-rank decode state.
    ``sampling``: a ``harness.sampling.Sampling`` while the host samples (None: greedy), set by the host;
    ``sampler``: how a sampled launch samples (module docstring)."""

    name = "base"
    sampler = "gumbel"
    sampling = None
    draft_fp8 = False       # the drafts' head in fp8 (megakernel only: MegakernelEngine's draft_fp8)

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2,
                 drafts: int = rp.DEFAULT_DRAFTS, draft_ids=None):
        self.cfg, self.tp, self.lnc, self.drafts = cfg, tp, lnc, rp.check_drafts(drafts)
        self.draft_ids = draft_ids          # FR-Spec draft vocabulary (model.draft_vocab.load) or None: full head
        self.slots = drafts + 1
        self.dtype = params["model.embed_tokens.weight"].dtype
        nd = 0 if draft_ids is None else len(draft_ids)
        self.plans = {m: rp.plan_for(cfg, m, tp, lnc, drafts=drafts, draft_vocab=nd,
                                     draft_fp8=self.draft_fp8 and m == "round")
                      for m in (("round", "step") if cfg.mtp_num_hidden_layers else ("step",))}
        self.weights = [self.rank_weights(params, r) for r in range(tp)]
        self.states: list[dict[str, torch.Tensor]] = []
        self.max_len = 0
        self.launches = 0

    def rank_weights(self, params, rank: int) -> dict:
        return rank_weights(self.cfg, params, rank, self.tp, self.lnc, self.draft_ids, self.draft_fp8)

    def start(self, max_len: int) -> None:
        self.max_len = max_len
        self.states = [state_tensors(self.cfg, self.tp, max_len, self.dtype, self.slots) for _ in range(self.tp)]

    def load_state(self, state: DecodeState) -> None:
        """Take a reference-layout decode state (the host prefill's, ``slots`` = K + 1) in the per-rank stacked
        layout."""
        if state.slots != self.slots:
            raise ValueError(f"{self.name}: the state has {state.slots} checkpoint slots, rounds of {self.drafts} "
                             f"drafts need {self.slots}")
        self.max_len = state.max_len
        self.states = [rank_state(self.cfg, state, r, self.tp) for r in range(self.tp)]

    def reference_state(self, read_slot: int) -> DecodeState:
        """The decode state gathered over the ranks, in the reference layout."""
        like = DecodeState.empty(self.cfg, self.max_len, self.slots, self.dtype)
        return gather_state(self.cfg, self.states, like, read_slot)

    def plan(self, mode: str):
        if mode not in self.plans:
            raise ValueError(f"{self.name}: no {mode} launches for this checkpoint (plans: {sorted(self.plans)})")
        return self.plans[mode]

    def run(self, mode: str, inputs: dict) -> LaunchResult:
        plan = self.plan(mode)
        inputs = dict(inputs)
        key = "draft_noise" if self.sampler == "rejection" else "noise"
        noise = inputs.pop(key, None)
        if plan.device_commit and noise is not None:
            raise ValueError(f"{self.name}: a device-committed round takes its noise from the engine's noise window "
                             f"(write_noise), not per launch")
        if not plan.device_commit and (noise is not None) != (self.sampling is not None
                                                              and (mode == "round" or key == "noise")):
            raise ValueError(f"{self.name}: {key} goes with sampled {'rounds' if key == 'draft_noise' else 'launches'}"
                             f" (engine sampling {self.sampling}, mode {mode})")
        names = rp.input_names(plan.mode, plan.device_commit)
        if set(inputs) != set(names):
            raise ValueError(f"{self.name}: {mode} inputs {sorted(inputs)} differ from {sorted(names)}")
        if plan.mode == "round" and inputs["force"].shape[0] != plan.drafts:
            raise ValueError(f"{self.name}: round inputs for {inputs['force'].shape[0]} drafts, the engine runs "
                             f"{plan.drafts}")
        if noise is not None:
            inputs[key] = noise
        return self._run(plan, inputs)

    def rank_noise(self, plan, inputs: dict, rank: int) -> dict:
        """Rank ``rank``'s noise tensors (``plan.noise_specs``) of a sampled launch's ``noise`` input, {} when
        greedy."""
        if "noise" not in inputs:
            return {}
        return rp.noise_inputs(plan.mode, inputs["noise"], rank, self.tp, self.lnc, max(plan.drafts, 1),
                               self.draft_ids)


class MegakernelEngine(HostEngine):
    """One launch of ``megakernel.round`` per round (D1 + V + D2) and per step, on every rank, under nkisim.
    ``device_commit``: also ``chain`` rounds, accepted and committed on device (module docstring); the engine then
    holds per rank the control state (``controls``) and the RoPE tables of the sequence (``rope``), and for sampled
    chains the noise window (``noise``, ``noise_window`` entries, ``plan.noise_window_specs``)."""

    name = "megakernel"

    def __init__(self, cfg, params, tp: int = 4, lnc: int = 2, drafts: int = rp.DEFAULT_DRAFTS, draft_ids=None,
                 device_commit: bool = False, noise_window: int | None = None, draft_fp8: bool = False):
        self.draft_fp8 = bool(draft_fp8)        # before the plans and weights (HostEngine.__init__)
        super().__init__(cfg, params, tp=tp, lnc=lnc, drafts=drafts, draft_ids=draft_ids)
        self.device_commit = bool(device_commit)
        self.noise_window = rp.check_noise_window(rp.noise_window(drafts) if noise_window is None else noise_window,
                                                  drafts)
        self.controls: list[dict] = []
        self.rope: dict = {}
        self.noise: list[dict] | None = None
        if self.device_commit:
            if "round" not in self.plans:
                raise ValueError(f"{self.name}: device-side commit needs speculative rounds (the checkpoint has no "
                                 f"MTP head)")
            self.plans["chain"] = rp.plan_for(cfg, "round", tp, lnc, drafts=drafts, device_commit=True,
                                              draft_vocab=0 if draft_ids is None else len(draft_ids),
                                              draft_fp8=self.draft_fp8)

    def start(self, max_len: int) -> None:
        super().start(max_len)
        self._start_control()

    def load_state(self, state: DecodeState) -> None:
        super().load_state(state)
        self._start_control()

    def _start_control(self) -> None:
        """Zero control state and the RoPE tables of positions 0 .. cache_length(max_len) - 1 (device commit)."""
        if not self.device_commit:
            return
        cos, sin = rp.rope_table(self.cfg, rp.cache_length(self.max_len))
        self.rope = {"rope_cos": torch.from_numpy(cos), "rope_sin": torch.from_numpy(sin)}
        self.noise = None
        self.controls = [{s.name: torch.zeros(s.shape, dtype=self.dtype if s.dtype == "activation" else torch.int32)
                          for s in rp.control_specs(self.cfg, self.lnc, self.drafts)} for _ in range(self.tp)]

    def seed_control(self, pending: int, hidden, pos: int, read_slot: int) -> None:
        """Write the control state once (after the prefill): pending token at ``pos``, h_{pos-1}, ``read_slot``."""
        if not self.device_commit:
            raise ValueError(f"{self.name}: the engine was built without device_commit")
        st = rp.control_state(self.cfg, self.dtype, pending, hidden, pos, read_slot, self.lnc, self.drafts)
        for c in self.controls:
            c["control"].copy_(torch.from_numpy(st["control"]))
            c["control_hidden"].copy_(st["control_hidden"])

    def start_noise(self) -> None:
        """A zero noise window per rank (a sampled chain; ``plan.noise_window_specs``), written by :meth:`write_noise`
        before the rounds that read it."""
        if not self.device_commit:
            raise ValueError(f"{self.name}: the engine was built without device_commit")
        nd = 0 if self.draft_ids is None else len(self.draft_ids)
        specs = rp.noise_window_specs(self.cfg, self.tp, self.lnc, self.drafts, nd, self.noise_window)
        self.noise = [{s.name: torch.zeros(s.shape, dtype=torch.float32) for s in specs} for _ in range(self.tp)]

    def write_noise(self, noise, starts) -> None:
        """Write the window entries of rounds starting at the positions ``starts`` (``noise``: the sequence's
        ``harness.sampling.GumbelNoise``), each into its slot ``plan.noise_slot``."""
        if self.noise is None:
            raise ValueError(f"{self.name}: start_noise first (no noise window)")
        for s in starts:
            slot = rp.noise_slot(s, self.noise_window)
            for r, window in enumerate(self.noise):
                entry = rp.noise_window_entry(noise, s, r, self.tp, self.lnc, self.drafts, self.draft_ids)
                for name, t in entry.items():
                    window[name][:, slot].copy_(t)

    def control(self) -> dict:
        """The control state the last round wrote, read back (tests, ``Decoder.committed``): {pending, read_slot,
        pos: int, hidden: h_{pos-1} [H], the control_hidden row read_slot} of rank 0, core 0 (every rank and core
        holds the same values)."""
        ctl = {k: int(v) for k, v in zip(rp.CONTROL_COLUMNS, self.controls[0]["control"][0])}
        return {**ctl, "hidden": self.controls[0]["control_hidden"][0, ctl["read_slot"]]}

    def rank_weights(self, params, rank: int) -> dict:
        """The stacked weights, fp8 experts tables (a ``model.tp.moe.quantize_fp8`` checkpoint) as the kernel's
        ``float8_e4m3`` (``nki_kernels.moe.kernel_table``)."""
        from nki_kernels.moe import kernel_table
        return {k: kernel_table(v) for k, v in super().rank_weights(params, rank).items()}

    def _run(self, plan, inputs):
        import nkisim
        from megakernel.round import KERNELS
        names = rp.kernel_weights(plan.mode) + rp.EXPERTS + rp.draft_weights(plan)
        names += rp.EXPERT_SCALES       # present only for fp8 experts
        rt = {k: v for k, v in inputs.items() if k != "noise"}
        window = [{}] * self.tp
        if plan.device_commit:      # the host-driven inputs come from the control state
            rt = {**{n: None for n in rp.input_names(plan.mode) if n not in rt}, **rt}
            if self.sampling is not None:
                if self.noise is None:
                    raise ValueError(f"{self.name}: a sampled device-committed round needs the noise window "
                                     f"(start_noise, write_noise)")
                window = self.noise
        per_rank = [{"plan": plan, **{k: w[k] for k in names if k in w}, **st, **rt, **self.rank_noise(plan, inputs, r),
                     **window[r], **(self.controls[r] if plan.device_commit else {}),
                     **(self.rope if plan.device_commit else {})}
                    for r, (w, st) in enumerate(zip(self.weights, self.states))]
        self.launches += 1
        outs = nkisim.launch(KERNELS[plan.mode], per_rank, tp=self.tp, lnc=self.lnc)
        res = read_outputs(*outs[0][:3])    # the state was written in place (nkisim writes argument tensors back)
        if not plan.device_commit:
            return res
        row = [int(v) for v in as_torch(outs[0][7]).reshape(-1)]
        return dataclasses.replace(res, emitted=row[1:1 + row[0]])


class XlaEngine(HostEngine):
    """The plan as plain PyTorch (``harness.xla.forward``), one thread per rank, no custom kernels. It samples
    by the rejection rule (``sampling``: a ``harness.sampling.Sampling``, set by the host; rounds then take ``draft_noise``
    [K, V] float64 and return the distributions ``harness.sampling.accept`` needs)."""

    name = "xla"
    sampler = "rejection"

    def rank_weights(self, params, rank):
        from harness import xla
        return xla.rank_weights(self.cfg, params, rank, self.tp, self.draft_ids)

    def _run(self, plan, inputs):
        from harness import xla
        rt = {k: as_torch(v) for k, v in inputs.items()}
        world = xla.ThreadWorld(self.tp)
        sampling = self.sampling

        def rank(r, coll, w, st):
            return xla.forward(self.cfg, plan, w, st, rt, coll, sampling)

        self.launches += 1                  # one graph per launch (as the NxDI xla backend runs it)
        outs = world.run(rank, [(w, st) for w, st in zip(self.weights, self.states)])
        for st, out in zip(self.states, outs):
            st.update(out[3])
        res = read_outputs(*outs[0][:3])
        if sampling is None:
            return res
        return dataclasses.replace(res, draft_probs=outs[0][4], target_logits=outs[0][5])


class LayerwiseEngine(HostEngine):
    """One launch per layer stage per rank (``megakernel.layerwise``); reductions and residual adds on the host."""

    name = "layerwise"

    def _sum(self, partials: list) -> torch.Tensor:
        """Per-rank ``[lnc, T, H]`` float32 partials -> their sum in the megakernel's fixed order: per core lane the
        ranks in ascending order, then lane 0 + lane 1."""
        lanes = []
        for c in range(self.lnc):
            acc = torch.as_tensor(partials[0][c]).clone()
            for r in range(1, self.tp):
                acc = acc + torch.as_tensor(partials[r][c])
            lanes.append(acc)
        return lanes[0] + lanes[1] if self.lnc == 2 else lanes[0]

    def _add(self, x: torch.Tensor, partials: list) -> torch.Tensor:
        return (x.float() + self._sum(partials)).to(x.dtype)

    def _launch(self, kernel, per_rank: list) -> list:
        import nkisim
        self.launches += 1                  # every NKI kernel launch (one per layer stage and rank group)
        return nkisim.launch(kernel, per_rank, tp=self.tp, lnc=self.lnc)

    def _layer(self, plan, layer, x, pos, cos, sin, read_slot):
        from megakernel import layerwise as lw
        eps = plan.eps
        W, S = self.weights, self.states
        if layer.kind == rp.ATTENTION:
            per_rank = [None] * self.tp
            for g in range(layer.groups):
                a = layer.mixer * layer.groups + g
                outs = self._launch(lw.attention_stage[self.lnc], [
                    (x, w["norms"], layer.in_norm, w["attn_wqg"], w["attn_wk"], w["attn_wv"], w["attn_wo"],
                     w["attn_norm_w"], cos, sin, st["attn_k"], st["attn_v"], pos, a, eps) for w, st in zip(W, S)])
                for r, o in enumerate(outs):
                    per_rank[r] = o[0] if g == 0 else torch.as_tensor(per_rank[r]) + torch.as_tensor(o[0])
        else:
            outs = self._launch(lw.gdn_stage[self.lnc], [
                (x, w["norms"], layer.in_norm, w["gdn_w_in"], w["gdn_conv_w"], w["gdn_A_log"], w["gdn_dt_bias"],
                 w["gdn_norm_w"], w["gdn_w_out"], st["gdn_window"], st["gdn_state"], read_slot, layer.mixer, eps)
                for w, st in zip(W, S)])
            per_rank = [o[0] for o in outs]
        x = self._add(x, per_rank)
        table, index = layer.experts
        outs = self._launch(lw.moe_stage[self.lnc], [
            (x, w["norms"], layer.post_norm, w["moe_router"], w[f"moe_experts_{table}"], w["moe_shared"], plan.top_k,
             layer.moe, index, eps) for w in W])
        return self._add(x, outs)

    def _kv_rows(self, plan, layer, x, pos, cos, sin):
        """The K / V rows of an attention layer on its input x [T, H] (``megakernel.layerwise.kv_rows_stage``)."""
        from megakernel import layerwise as lw
        for g in range(layer.groups):
            self._launch(lw.kv_rows_stage[self.lnc], [
                (x, w["norms"], layer.in_norm, w["attn_wqg"], w["attn_wk"], w["attn_wv"], w["attn_wo"],
                 w["attn_norm_w"], cos, sin, st["attn_k"], st["attn_v"], pos, layer.mixer * layer.groups + g,
                 plan.eps) for w, st in zip(self.weights, self.states)])

    def _head(self, plan, x, row: int, draft: bool = False, noise=None):
        """(greedy token ids [T], post-norm hidden [T, H]) with the lowest global index winning ties; ``draft`` with
        an FR-Spec draft vocabulary: over the draft head's rows, mapped to their token ids. ``noise``: per rank the
        head's ``plan.noise_specs`` tensor [lnc, P, Cp*T] (sampled launches: Gumbel-max tokens), or None."""
        from megakernel import layerwise as lw
        sub = draft and plan.draft_vocab_per_core > 0
        head, vc = ("draft_head", plan.draft_vocab_per_core) if sub else ("lm_head", plan.vocab_per_core)
        outs = self._launch(lw.head_stage[self.lnc], [(x, w["norms"], row, w[head], plan.eps,
                                                       None if noise is None else noise[r])
                                                      for r, w in enumerate(self.weights)])
        best = torch.cat([torch.as_tensor(b) for b, _ in outs])  # [tp*lnc, T, 2], global core order
        _, idx = combine_argmax(best[..., 0], best[..., 1], vc)
        ids = [int(i) for i in idx]
        if sub:
            ids = [int(self.draft_ids[i]) for i in ids]
        return ids, torch.as_tensor(outs[0][1])

    def _embed(self, ids: list[int]):
        from nki_kernels.embedding import embedding_kernel
        table = self.weights[0]["embed"]
        self.launches += 1
        return torch.as_tensor(embedding_kernel(table, np.array(ids, np.int32).reshape(-1, 1))[0])

    def _mtp(self, plan, stage, tokens: list[int], hidden, inputs, with_head: bool, noise=None):
        """The MTP head on tokens [T] and hiddens [T, H] at the stage's positions -> (greedy token, post-norm
        hidden [1, H]) with the head (T = 1; ``noise``: the draft's per-rank noise, or None), None without."""
        from megakernel import layerwise as lw
        rows = plan.norms
        e = self._embed(tokens)
        h = hidden.reshape(len(tokens), -1).to(self.dtype)
        outs = self._launch(lw.mtp_fc_stage[self.lnc], [
            (e, h, w["norms"], rows.mtp_emb, rows.mtp_hidden, w["mtp_fc"], plan.eps) for w in self.weights])
        x = torch.cat([torch.as_tensor(o[c]) for o in outs for c in range(self.lnc)], dim=-1).to(self.dtype)
        pos, cos, sin = _stage_inputs(stage, inputs)
        if not with_head:       # the replay: the MTP KV rows only (what the megakernel's D2 runs)
            self._kv_rows(plan, stage.layers[0], x, pos, cos, sin)
            return None
        x = self._layer(plan, stage.layers[0], x, pos, cos, sin, inputs["read_slot"])
        ids, hm = self._head(plan, x, rows.mtp_final, draft=True, noise=noise)
        return ids[0], hm

    def _run(self, plan, inputs):
        pending = int(inputs["pending"].reshape(-1)[0])
        ids = [pending]
        h = as_torch(inputs["hidden"]) if plan.drafts else None
        targets = hidden = None
        noise = [self.rank_noise(plan, inputs, r) for r in range(self.tp)] if "noise" in inputs else None
        for stage in plan.stages:
            if stage.kind == rp.DRAFT:
                nd = None if noise is None else [n["noise_d1"][:, stage.draft].contiguous() for n in noise]
                draft, h = self._mtp(plan, stage, [ids[-1]], h, inputs, with_head=True, noise=nd)
                force = np.asarray(inputs["force"])[stage.draft]
                ids.append(int(force[1]) if force[0] else draft)
            elif stage.kind == rp.VERIFY:
                x = self._embed(ids)
                pos, cos, sin = _stage_inputs(stage, inputs)
                for layer in stage.layers:
                    x = self._layer(plan, layer, x, pos, cos, sin, inputs["read_slot"])
                targets, hidden = self._head(plan, x, plan.norms.final,
                                             noise=None if noise is None else [n["noise_v"] for n in noise])
            else:
                self._mtp(plan, stage, ids[1:], hidden[:plan.drafts], inputs, with_head=False)
        return LaunchResult(ids[1:] or ids, targets, hidden)


def _stage_inputs(stage, inputs):
    if stage.inputs == "d1":
        r = stage.rope_row
        return (np.ascontiguousarray(inputs["pos_d1"][r:r + 1]), np.ascontiguousarray(inputs["cos_d1"][r:r + 1]),
                np.ascontiguousarray(inputs["sin_d1"][r:r + 1]))
    r0, r1 = stage.rope_row, stage.rope_row + stage.tokens
    return inputs["pos"], np.ascontiguousarray(inputs["cos_v"][r0:r1]), np.ascontiguousarray(inputs["sin_v"][r0:r1])


ENGINES = {"xla": XlaEngine, "layerwise": LayerwiseEngine, "megakernel": MegakernelEngine}


def make_engine(name: str, cfg: ModelConfig, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2,
                drafts: int = rp.DEFAULT_DRAFTS, draft_ids=None, device_commit: bool = False,
                noise_window: int | None = None, draft_fp8: bool = False) -> HostEngine:
    """An in-process engine by name (:data:`ENGINE_NAMES`), sharded over ``tp`` ranks x ``lnc`` cores, running rounds
    of ``drafts`` chained drafts, each the argmax over ``draft_ids`` (an FR-Spec draft vocabulary,
    ``model.draft_vocab.load``) or over the full vocabulary (None); ``device_commit`` (megakernel only): rounds
    accepted and committed on device, launched back to back (module docstring), sampled ones with a noise window of
    ``noise_window`` entries (None: ``plan.noise_window``). ``draft_fp8`` (megakernel only): the drafts' head in fp8
    (``nki_kernels.lm_head`` "fp8 draft head"; bfloat16 checkpoints)."""
    if name not in ENGINES:
        raise ValueError(f"unknown variant {name!r}; expected one of {ENGINE_NAMES}")
    rp.kv_groups(cfg, tp)
    kv_heads(cfg, 0, tp)
    if draft_fp8 and name != "megakernel":
        raise ValueError(f"an fp8 draft head runs in the megakernel variant only, not {name}")
    if device_commit and name != "megakernel":
        raise ValueError(f"device-side commit runs in the megakernel variant only, not {name}")
    if noise_window is not None and not device_commit:
        raise ValueError("a noise window is for device-committed sampled rounds (device_commit)")
    if name == "megakernel":
        return MegakernelEngine(cfg, params, tp=tp, lnc=lnc, drafts=drafts, draft_ids=draft_ids,
                                device_commit=device_commit, noise_window=noise_window, draft_fp8=draft_fp8)
    return ENGINES[name](cfg, params, tp=tp, lnc=lnc, drafts=drafts, draft_ids=draft_ids)
