"""The NxDI application's context encoding: one graph per chunk-length bucket running the NKI prefill kernels on
the per-rank decode weight layout, writing the decode state (plain, tested on CPU; wired by ``modeling``).

A context graph of bucket C (a multiple of 64, :func:`check_buckets`) encodes C prompt tokens at positions
s .. s+C-1 (s a run-time input) into the decode state every graph shares: GDN checkpoint slot 0 (the recurrent
state and conv window after token s+C-1, read from slot 0 before it: the state is carried from chunk to chunk),
the trunk's K/V rows s .. s+C-1 and the MTP layer's K/V rows s .. s+C-1. It is the pass of ``megakernel.prefill``
for one chunk (``megakernel.prefill.prefill_plan``: embedding, per layer the input RMSNorm, ``gdn_prefill`` or
``attention_prefill``, the residual all-reduce fused with the next RMSNorm (``residual_allreduce_stage``), the
MoE prefill, ...; the MTP fc over the chunk's rows and the MTP layer's K/V rows (``attention_prefill_kv_kernel``);
the decode head stage on its last position),
traced as a sequence of NKI custom calls (:func:`megakernel_context`), or, for the xla backend, the same math with
the ``model.tp`` twins (:func:`xla_context`). Its outputs are the three leading outputs of every graph (the token
after the chunk as given, the greedy token after position s+C-1, the post-norm hidden h_{s+C-1}) and then every
state buffer, aliased, as the round graph returns them.

Run-time inputs (:func:`input_specs`, :func:`context_inputs`): ``ids`` int32 [C+1, 1] -- the chunk's tokens and
the prompt token after it (the MTP row p needs token p+1; 0 when the chunk ends the prompt: that row, n-1, is
rewritten by the first round's D1 before anything reads it), ``start`` int32 [1, 1], the chunk's RoPE rows
``cos`` / ``sin`` float32 [C, R]. NxD routes calls by input shapes only, and these differ from every decode graph's.

Why whole buckets, never a padded chunk: the GDN prefill kernel's token count is a compile-time shape (it pads
inside its last tile with beta = 0 and g = 0), so a chunk padded at run time would run its padding tokens through
the recurrence and the conv window. A prompt of n tokens is therefore cut into whole buckets, largest first
(:func:`schedule`), and the tail of fewer tokens than the smallest bucket (< 64 with the default buckets) is fed
teacher-forced through the round graph, K + 1 tokens per launch (:func:`tail_launches`). A prompt shorter than the
smallest bucket is teacher-forced entirely, as before.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megakernel import plan as rp

GDN_BLOCK = 64                      # bucket sizes must be multiples of the GDN prefill kernel's block
MAX_DEFAULT_BUCKET = 4096           # the largest default bucket: the prefill kernels' measured chunk (1K .. 4K)
PREFIX = "context_"                 # graph mode of bucket C: "context_C"
INPUTS = ("ids", "start", "cos", "sin")


class ContextError(ValueError):
    """Bad context buckets or prompt (the message says which)."""


# ---- buckets and graph names -----------------------------------------------------------------------------------
def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 64 up to min(4096, max_len): any multiple of 64 is a sum of distinct ones, so a prompt
    takes at most one launch per bucket below the largest."""
    out, b = [], GDN_BLOCK
    while b <= min(MAX_DEFAULT_BUCKET, max_len):
        out.append(b)
        b *= 2
    return tuple(out)


def check_buckets(buckets, max_len: int) -> tuple[int, ...]:
    """The buckets as a sorted tuple of distinct ints, each a positive multiple of 64 and at most ``max_len``
    (ContextError otherwise). An empty tuple: no context graph (every prompt teacher-forced)."""
    try:
        out = tuple(sorted({int(b) for b in buckets}))
    except (TypeError, ValueError):
        raise ContextError(f"context buckets must be integers, found {buckets!r}") from None
    for b in out:
        if b < GDN_BLOCK or b % GDN_BLOCK:
            raise ContextError(f"context bucket {b} is not a positive multiple of {GDN_BLOCK} (the GDN prefill "
                               f"kernel's block)")
        if b > max_len:
            raise ContextError(f"context bucket {b} exceeds the decode state's {max_len} positions (--max-len)")
    return out


def parse_buckets(text: str) -> tuple[int, ...]:
    """``"64,512"`` -> (64, 512); ``""`` or ``"none"``: no context graph."""
    if text.strip().lower() in ("", "none"):
        return ()
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ContextError(f"--context-buckets: expected comma-separated integers, found {text!r}") from None


def mode_of(bucket: int) -> str:
    return f"{PREFIX}{int(bucket)}"


def bucket_of(mode: str) -> int | None:
    """The bucket of a context graph mode ("context_C"), None for any other graph."""
    if not isinstance(mode, str) or not mode.startswith(PREFIX):
        return None
    tail = mode[len(PREFIX):]
    return int(tail) if tail.isdigit() else None


# ---- inputs ------------------------------------------------------------------------------------------------------
def input_specs(cfg, bucket: int) -> tuple:
    """The context graph's run-time inputs (module docstring), as ``megakernel.plan.TensorSpec`` s."""
    R = cfg.rotary_dim
    return (rp.TensorSpec("ids", (bucket + 1, 1), "int32"), rp.TensorSpec("start", (1, 1), "int32"),
            rp.TensorSpec("cos", (bucket, R), "float32"), rp.TensorSpec("sin", (bucket, R), "float32"))


def context_inputs(cfg, prompt: list[int], start: int, bucket: int) -> dict[str, np.ndarray]:
    """Run-time inputs of the chunk prompt[start : start+bucket] (and the token after it, or 0 at the end)."""
    if start < 0 or start + bucket > len(prompt):
        raise ContextError(f"context chunk {start}..{start + bucket - 1} is outside the {len(prompt)}-token prompt")
    after = prompt[start + bucket] if start + bucket < len(prompt) else 0
    ids = np.array(list(prompt[start:start + bucket]) + [after], np.int32).reshape(-1, 1)
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ContextError(f"prompt token ids must be in 0..{cfg.vocab_size - 1}")
    cos, sin = rp.rope_rows(cfg, start, bucket)
    return {"ids": ids, "start": np.array([[start]], np.int32), "cos": cos, "sin": sin}


# ---- the schedule of a prompt -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """How an n-token prompt is encoded: ``chunks`` ((start, bucket) in order, whole buckets), then the
    teacher-forced ``tail`` (:func:`tail_launches` from position ``tail_start``; empty when the chunks end at n)."""
    n: int
    chunks: tuple
    tail_start: int
    tail: tuple

    @property
    def launches(self) -> int:
        return len(self.chunks) + len(self.tail)


def schedule(n: int, buckets, drafts: int = rp.DEFAULT_DRAFTS) -> Schedule:
    """Whole buckets, the largest that fits first, then the teacher-forced tail (module docstring)."""
    if n < 1:
        raise ContextError("prefill: the prompt is empty")
    chunks, s = [], 0
    for b in sorted(buckets, reverse=True):
        while n - s >= b:
            chunks.append((s, b))
            s += b
    return Schedule(n, tuple(chunks), s, tail_launches(s, n, drafts))


def tail_launches(m: int, n: int, drafts: int = rp.DEFAULT_DRAFTS) -> tuple:
    """The teacher-forced launches of prompt tokens m .. n-1 after a context prefill of tokens 0 .. m-1 (m = 0: the
    whole prompt, ``megakernel.plan.teacher_forced_launches``): rounds at p = m, m + K + 1, ... on the pending x_p
    and h_{p-1}, drafts forced to x_{p+1} .. x_{p+j} (j = min(K, n-1-p)), j + 1 tokens committed. The round's first
    D1 writes MTP KV row p-1 (from x_p and h_{p-1}: the context graph wrote the same row), its verify the trunk
    state of x_p .. x_{p+j}, its D2 the MTP rows p .. p+j-1."""
    if m == 0:
        return rp.teacher_forced_launches(n, drafts)
    K = rp.check_drafts(drafts)
    out = []
    for p in range(m, n, K + 1):
        j = min(K, n - 1 - p)
        out.append(rp.PrefillLaunch("round", p, p + 1 if j else None, j + 1))
    return tuple(out)


# ---- the traced graphs --------------------------------------------------------------------------------------------
def context_plan(cfg, bucket: int, tp: int, lnc: int):
    """The prefill plan one context graph runs: ``megakernel.prefill.prefill_plan`` of one bucket-long chunk (its
    layers, MTP layer, norm rows and settings; the chunk's MTP rows are all C of them, see the module docstring)."""
    from megakernel.prefill import prefill_plan
    return prefill_plan(cfg, bucket, tp, lnc, chunk=bucket)


def _replace(stack: torch.Tensor, a: int, rows: torch.Tensor) -> torch.Tensor:
    """``stack`` with entry ``a`` (dim 0) replaced by ``rows`` [1, ...] (traceable, no in-place write)."""
    return torch.cat([stack[:a], rows.to(stack.dtype), stack[a + 1:]])


def megakernel_context(plan, w: dict, st: dict, rt: dict, coll, lnc: int) -> list[torch.Tensor]:
    """One rank's context graph of the megakernel backend: the NKI prefill kernels as custom calls, each launched
    ``kernel[lnc](...)`` on every rank (the replicated ones -- embedding, RMSNorm -- too: SPMD). w: the rank's
    ``megakernel.sharded.rank_weights``; st: its decode state (``plan.STATE`` names, not modified); rt: the run-time
    inputs as tensors; coll: the TP collectives (the MTP fc columns and the head's argmax are gathered over ranks).
    Returns [ids[C], target, hidden [1, H], gdn_window, gdn_state, attn_k, attn_v]."""
    from megakernel.layerwise import head_stage
    from megakernel.prefill import mtp_fc_prefill_stage, residual_allreduce_stage
    from nki_kernels.attention_prefill import KEY_BLOCK, attention_prefill_kernel, attention_prefill_kv_kernel
    from nki_kernels.common import P
    from nki_kernels.embedding import embedding_kernel
    from nki_kernels.gdn_prefill import gdn_prefill_kernel
    from nki_kernels.moe_prefill import moe_prefill, token_rows
    from nki_kernels.rmsnorm_prefill import rmsnorm_prefill_kernel
    ids, start, cos, sin = rt["ids"], rt["start"], rt["cos"], rt["sin"]
    C = ids.shape[0] - 1
    eps, rows, tp = plan.eps, plan.norms, plan.tp
    norms = w["norms"]
    slot = start * 0                                   # GDN slot 0, read and written (int32 [1, 1])
    windows = list(st["gdn_window"].unbind(0)) if "gdn_window" in st else []
    states = list(st["gdn_state"].unbind(0)) if "gdn_state" in st else []
    kc, vc = st["attn_k"], st["attn_v"]

    def embed(tok):
        parts = [embedding_kernel[lnc](w["embed"], tok[t0:t0 + P])[0] for t0 in range(0, tok.shape[0], P)]
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def attention(layer, xT):
        nonlocal kc, vc
        total = None
        for g in range(layer.groups):
            a = layer.mixer * layer.groups + g
            part, _, k_new, v_new = attention_prefill_kernel[lnc](
                xT, w["attn_wqg"][a], w["attn_wk"][a], w["attn_wv"][a], w["attn_wo"][a], w["attn_norm_w"][a],
                cos, sin, kc[a:a + 1], vc[a:a + 1], start, eps, KEY_BLOCK, None)
            kc, vc = _replace(kc, a, k_new), _replace(vc, a, v_new)
            total = part if total is None else total + part
        return total

    def kv_rows(layer, xT):        # K/V rows only: the MTP layer's attention output is not needed
        nonlocal kc, vc
        for g in range(layer.groups):
            a = layer.mixer * layer.groups + g
            _, k_new, v_new = attention_prefill_kv_kernel[lnc](
                xT, w["attn_wk"][a], w["attn_wv"][a], w["attn_norm_w"][a], cos, sin, kc[a:a + 1], vc[a:a + 1],
                start, eps)
            kc, vc = _replace(kc, a, k_new), _replace(vc, a, v_new)

    x = embed(ids[0:C])
    xT = rmsnorm_prefill_kernel[lnc](x, norms[plan.layers[0].in_norm], eps, False, True)[0]
    hidden_rows = None
    for i, layer in enumerate(plan.layers):
        if layer.kind == rp.GDN:
            j = layer.mixer
            part, states[j], windows[j], _ = gdn_prefill_kernel[lnc](
                xT, w["gdn_w_in"][j], w["gdn_conv_w"][j], w["gdn_A_log"][j], w["gdn_dt_bias"][j],
                w["gdn_norm_w"][j], w["gdn_w_out"][j], windows[j], states[j], slot, slot, eps, False)
        else:
            part = attention(layer, xT)
        x, normed = residual_allreduce_stage[lnc](x, part, tp, True, norms[layer.post_norm], eps, "rows")
        table, e = layer.experts
        y, _ = moe_prefill[lnc](token_rows(normed), w["moe_router"][layer.moe], w[f"moe_experts_{table}"][e],
                                w["moe_shared"][layer.moe], plan.top_k)
        last = i == len(plan.layers) - 1
        x, nxt = residual_allreduce_stage[lnc](x, y, tp, False, norms[rows.final if last else
                                                                     plan.layers[i + 1].in_norm], eps,
                                               "rows" if last else "xT")
        if last:
            hidden_rows = nxt
        else:
            xT = nxt
    if plan.mtp is not None:
        fc = mtp_fc_prefill_stage[lnc](embed(ids[1:C + 1]), hidden_rows, norms, rows.mtp_emb, rows.mtp_hidden,
                                       w["mtp_fc"], eps)
        x_m = coll.gather_last(torch.cat([fc[c] for c in range(fc.shape[0])], dim=-1)).to(x.dtype)
        kv_rows(plan.mtp, rmsnorm_prefill_kernel[lnc](x_m, norms[plan.mtp.in_norm], eps, False, True)[0])
    best, hidden = head_stage[lnc](x[C - 1:C], norms, rows.final, w["lm_head"], eps)
    allp = coll.gather_ranks(best.reshape(-1, 2)).reshape(-1, 2)           # [tp * lnc, 2] in global core order
    values, local = allp[:, 0], allp[:, 1]
    gidx = local + plan.vocab_per_core * torch.arange(allp.shape[0], device=allp.device, dtype=allp.dtype)
    top = values.max()
    target = torch.where(values == top, gidx, torch.full_like(gidx, float("inf"))).min()
    out = [ids[C:C + 1], target.reshape(1, 1).to(torch.int32), hidden.to(x.dtype).reshape(1, -1)]
    new = {"attn_k": kc, "attn_v": vc}
    if windows:
        new["gdn_window"], new["gdn_state"] = torch.stack(windows), torch.stack(states)
    return out + [new[n] for n in rp.STATE if n in new]


def xla_context(cfg, plan, w: dict, st: dict, rt: dict, coll) -> list[torch.Tensor]:
    """One rank's context graph of the xla backend: the same pass as :func:`megakernel_context` with the
    ``model.tp`` twins on ``harness.xla.rank_weights`` (GDN: the chunked twin ``model.tp.gdn_prefill``; attention
    and the MTP layer: ``harness.xla.decoder_layer`` on C tokens). Traceable. Same outputs."""
    import torch.nn.functional as F

    from harness import xla
    from model import functional as fn
    from model.tp.embed_head import greedy_rank
    from model.tp.gdn import GdnDims
    from model.tp.gdn_prefill import gdn_prefill_rank
    from model.tp.moe import moe_rank
    ids, start, cos, sin = rt["ids"], rt["start"], rt["cos"], rt["sin"]
    C = ids.shape[0] - 1
    tok = ids.reshape(-1).long()
    state = xla._State(st)
    slot = start * 0
    dims = GdnDims.of(cfg, plan.tp)
    x = F.embedding(tok[0:C], w["embed"])
    for layer in plan.layers:
        if layer.kind == rp.ATTENTION:
            x = xla.decoder_layer(cfg, plan, layer, w, state, x, start, cos, sin, slot, coll)
            continue
        j = layer.mixer
        h = fn.rms_norm(x, w["norms"][layer.in_norm], plan.eps)
        part, win, s = gdn_prefill_rank(dims, {k: w["gdn_" + k][j] for k in xla.GDN_WEIGHTS}, h,
                                        state.windows[j][0], state.states[j][0])
        state.windows[j] = _replace(state.windows[j], 0, win[None])
        state.states[j] = _replace(state.states[j], 0, s[None])
        x = xla._add(x, coll.all_reduce(part))
        shard = {k: w["moe_" + k][layer.moe] for k in xla.MOE_WEIGHTS}
        x = xla._add(x, coll.all_reduce(moe_rank(shard, fn.rms_norm(x, w["norms"][layer.post_norm], plan.eps),
                                                 plan.top_k)))
    hidden = fn.rms_norm(x, w["norms"][plan.norms.final], plan.eps)
    if plan.mtp is not None:
        rows = plan.norms
        e = fn.rms_norm(F.embedding(tok[1:C + 1], w["embed"]), w["norms"][rows.mtp_emb], plan.eps)
        hh = fn.rms_norm(hidden, w["norms"][rows.mtp_hidden], plan.eps)
        x_m = F.linear(torch.cat([e, hh], dim=-1), w["mtp_fc"])
        xla.decoder_layer(cfg, plan, plan.mtp, w, state, x_m, start, cos, sin, slot, coll)   # its KV rows only
    target = greedy_rank(w["lm_head"], hidden[C - 1:C], coll)
    new = state.stacked()
    return [ids[C:C + 1], target.reshape(1, 1).to(torch.int32), hidden[C - 1:C]] + [new[n] for n in rp.STATE
                                                                                      if n in new]


# ---- the host side --------------------------------------------------------------------------------------------------
def _decoder_class():
    from harness.speculative import Decoder

    class ContextDecoder(Decoder):
        """A ``harness.speculative.Decoder`` whose prefill runs the engine's context graphs (``engine.buckets``,
        modes ``context_C``) over the prompt's whole buckets, then the teacher-forced tail (:func:`schedule`);
        rounds and steps are the engine's. ``prefill_info``: backend "context", chunks [[start, bucket], ...],
        tail tokens, launches of the last prefill."""

        def __init__(self, engine):
            super().__init__(engine, reference=None)
            self.buckets = tuple(engine.buckets)
            self.prefill_info = None

        def prefill(self, prompt: list[int], max_len: int):
            if not prompt:
                raise ValueError("prefill: the prompt is empty")
            plan = schedule(len(prompt), self.buckets, self.drafts)
            self.engine.start(max_len)
            self.slots.reset()
            self.prefill_info = {"backend": "context", "chunks": [list(c) for c in plan.chunks],
                                 "tail": len(prompt) - plan.tail_start, "launches": plan.launches}
            if not plan.chunks:
                return self._teacher_forced(prompt)
            out = None
            for s, b in plan.chunks:
                out = self.engine.run(mode_of(b), context_inputs(self.cfg, prompt, s, b))
            first, hidden = out.targets[0], out.hidden[0]
            for launch in plan.tail:
                forced = None if launch.forced is None else prompt[launch.forced:launch.forced + launch.accepted - 1]
                r = self.round(prompt[launch.pos], hidden, launch.pos, forced)
                self.slots.commit(launch.accepted)
                first, hidden = r.targets[launch.accepted - 1], r.hidden[launch.accepted - 1]
            self.first_logits = None
            return first, hidden

    return ContextDecoder


def context_decoder(engine):
    """A decoder prefilling through ``engine``'s context graphs (an engine with ``buckets`` and ``context_C``
    modes: ``harness.nxdi.modeling.NeuronEngine``, :class:`XlaContextEngine`)."""
    return _decoder_class()(engine)


class XlaContextEngine:
    """``harness.engines.XlaEngine`` with the xla backend's context graphs run in process: mode ``context_C`` is
    :func:`xla_context` on every rank at once (one thread per rank, ``harness.xla.ThreadWorld``), the function the
    NxDI xla graph traces; every other mode and attribute is the wrapped engine's. (The megakernel backend's CPU
    counterpart is ``harness.prefill``'s NKI prefill pass, which runs the same kernels with the sums on the host.)"""

    def __init__(self, engine, buckets):
        if engine.name != "xla":
            raise ContextError(f"XlaContextEngine wraps the xla engine, not {engine.name!r}")
        self.inner = engine
        self.buckets = tuple(buckets)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, mode: str, inputs: dict):
        from harness import xla
        from harness.engines import read_outputs
        from nki_kernels.host import as_torch
        bucket = bucket_of(mode)
        if bucket is None:
            return self.inner.run(mode, inputs)
        e = self.inner
        plan = context_plan(e.cfg, bucket, e.tp, e.lnc)
        rt = {k: as_torch(v) for k, v in inputs.items()}

        def rank(r, coll, w, st):
            return xla_context(e.cfg, plan, w, st, rt, coll)

        e.launches += 1
        outs = xla.ThreadWorld(e.tp).run(rank, [(w, st) for w, st in zip(e.weights, e.states)])
        for st, out in zip(e.states, outs):
            st.update(dict(zip([n for n in rp.STATE if n in st], out[3:])))
        return read_outputs(*outs[0][:3])
