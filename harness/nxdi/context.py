"""The NxDI application's context encoding: one graph per chunk-length bucket running the NKI prefill kernels on
the per-rank decode weight layout, writing the decode state (plain, tested on CPU; wired by ``modeling``).

A context graph of bucket C (a multiple of 64, :func:`check_buckets`) encodes v <= C prompt tokens at positions
s .. s+v-1 (s and v run-time inputs; v < C only in a prompt's first chunk, at s = 0) into the decode state every
graph shares: GDN checkpoint slot 0 (the recurrent state and conv window after token s+v-1, read from slot 0
before it: the state is carried from chunk to chunk), the trunk's and the MTP layer's K/V rows s .. s+v-1. It is
the pass of ``megakernel.prefill`` for one chunk (``megakernel.prefill.prefill_plan``), composed as
``harness.prefill`` predicts it: the chunk's embedding (``embedding_prefill``, one launch) and the first layer's
input RMSNorm; per layer ``gdn_prefill`` then the residual all-reduce fused with the post-attention RMSNorm
(``residual_allreduce_stage``), or ``attention_prefill`` with that all-reduce, the residual add and the norm fused
into its o_proj (``attention_prefill_kernel(..., residual, tp, next_norm_w, "rows")``); then ``moe_prefill`` with
its all-reduce, the residual add and the next RMSNorm fused into its combine (``moe_prefill(residual=, tp=, norm_w=,
norm_out=)``: the next layer's input norm, after the last layer the final norm's rows); the MTP fc over the chunk's
rows (their embedding one more ``embedding_prefill`` launch) and the MTP layer's K/V rows
(``attention_prefill_kv_kernel``); the decode head stage on row v-1. It is traced as that sequence of NKI custom
calls (:func:`megakernel_context`), or, for the xla backend, the same math with the ``model.tp`` twins
(:func:`xla_context`). Its outputs are the three leading outputs of every graph (the token after the chunk as given,
the greedy token after position s+v-1, the post-norm hidden h_{s+v-1}) and then every state buffer, aliased, as the
round graph returns them.

Run-time inputs (:func:`input_specs`, :func:`context_inputs`): ``ids`` int32 [C+1, 1] -- the chunk's v tokens,
the prompt token after them (the MTP row p needs token p+1; 0 when the chunk ends the prompt: that row, n-1, is
rewritten by the first round's D1 before anything reads it), zeros after that -- ``start`` and ``valid`` (v) int32
[1, 1], the chunk's RoPE rows ``cos`` / ``sin`` float32 [C, R]. NxD routes calls by input shapes only, and these
differ from every decode graph's.

A padded chunk, exactly. :func:`schedule` gives ONE chunk to a prompt of at most the largest bucket B (the
smallest bucket that holds it); a longer prompt gets a first chunk of its n mod B leading tokens, then whole chunks
of B. Only the first chunk is ever padded (v < C), at its end: in the attention layers the padding rows come after
every real query (causal masking hides them) and their K/V rows land at positions >= v, which the next chunk or
decoding overwrites before anything reads them; the MoE, norms and all-reduces work per row; the head reads row
v-1. The GDN kernel's token count is a compile-time shape, so for it the chunk is ROTATED, the padding first, with
the padding's inputs zeroed (:func:`pad_first`): from the zero state and zero conv window of a fresh sequence, a
zero input gives zero projections, a zero conv output, q = k = v = 0 and so an unchanged (zero) state and window,
whatever the gates; the real tokens follow with exactly their own history, and the window and state written after
the last row are the real tokens'. Its output rows are rotated back (:func:`pad_last`). For a whole chunk (v = C)
the rotation is the identity and the mask all ones. Without buckets a prompt is teacher-forced through the decode
graphs (``megakernel.plan.teacher_forced_launches``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megakernel import plan as rp
from model.tp.embed_head import combine_argmax

GDN_BLOCK = 64                      # bucket sizes must be multiples of the GDN prefill kernel's block
MAX_DEFAULT_BUCKET = 4096           # the largest default bucket: the prefill kernels' measured chunk (1K .. 4K)
PREFIX = "context_"                 # graph mode of bucket C: "context_C"
INPUTS = ("ids", "start", "valid", "cos", "sin")


class ContextError(ValueError):
    """Bad context buckets or prompt (the message says which)."""


# ---- buckets and graph names -----------------------------------------------------------------------------------
def default_buckets(max_len: int) -> tuple[int, ...]:
    """Powers of two from 64 up to min(4096, max_len): a prompt's padded chunk (:func:`schedule`) then runs fewer
    than twice its tokens (or 64), with log2(4096 / 64) + 1 = 7 graphs to compile."""
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
            rp.TensorSpec("valid", (1, 1), "int32"), rp.TensorSpec("cos", (bucket, R), "float32"),
            rp.TensorSpec("sin", (bucket, R), "float32"))


def context_inputs(cfg, prompt: list[int], start: int, bucket: int, valid: int | None = None
                   ) -> dict[str, np.ndarray]:
    """Run-time inputs of the chunk prompt[start : start+valid] (``valid`` default: the whole bucket) in the graph
    of ``bucket`` rows: the token after it (0 at the prompt's end), zeros after that. A padded chunk (valid <
    bucket) must be the first one (start 0: its GDN rotation needs the fresh zero state, module docstring)."""
    v = bucket if valid is None else valid
    if not 1 <= v <= bucket or (v < bucket and start != 0):
        raise ContextError(f"context chunk: {v} tokens at {start} in a bucket of {bucket} (a padded chunk must be "
                           f"the first one)")
    if start < 0 or start + v > len(prompt):
        raise ContextError(f"context chunk {start}..{start + v - 1} is outside the {len(prompt)}-token prompt")
    after = prompt[start + v] if start + v < len(prompt) else 0
    ids = np.zeros((bucket + 1, 1), np.int32)
    ids[:v + 1, 0] = list(prompt[start:start + v]) + [after]
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ContextError(f"prompt token ids must be in 0..{cfg.vocab_size - 1}")
    cos, sin = rp.rope_rows(cfg, start, bucket)
    return {"ids": ids, "start": np.array([[start]], np.int32), "valid": np.array([[v]], np.int32), "cos": cos,
            "sin": sin}


# ---- the schedule of a prompt -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Schedule:
    """How an n-token prompt is encoded: ``chunks`` ((start, bucket, valid) in order: ``valid`` tokens at
    ``start`` in the graph of ``bucket``), or, without buckets, the ``teacher_forced`` launches."""
    n: int
    chunks: tuple
    teacher_forced: tuple

    @property
    def launches(self) -> int:
        return len(self.chunks) + len(self.teacher_forced)


def schedule(n: int, buckets, drafts: int = rp.DEFAULT_DRAFTS) -> Schedule:
    """One chunk in the smallest bucket that holds the prompt; a longer one: its n mod B leading tokens (B the
    largest bucket) in the smallest bucket that holds them, then whole chunks of B (module docstring). No buckets:
    the prompt teacher-forced (``megakernel.plan.teacher_forced_launches``)."""
    if n < 1:
        raise ContextError("prefill: the prompt is empty")
    if not buckets:
        return Schedule(n, (), rp.teacher_forced_launches(n, drafts))
    B = max(buckets)
    first = n % B if n > B else n
    chunks, s = [], 0
    if first:
        chunks.append((0, min(b for b in buckets if b >= first), first))
        s = first
    while s < n:
        chunks.append((s, B, B))
        s += B
    return Schedule(n, tuple(chunks), ())


# ---- the traced graphs --------------------------------------------------------------------------------------------
def context_plan(cfg, bucket: int, tp: int, lnc: int):
    """The prefill plan one context graph runs: ``megakernel.prefill.prefill_plan`` of one bucket-long chunk (its
    layers, MTP layer, norm rows and settings; the chunk's MTP rows are all C of them, see the module docstring)."""
    from megakernel.prefill import prefill_plan
    return prefill_plan(cfg, bucket, tp, lnc, chunk=bucket)


def pad_first(t: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` with its C rows along ``dim`` rotated so that the padding rows (index >= v, v = ``valid`` int [1, 1])
    come first and are zero, the real rows 0 .. v-1 last, in order (module docstring). Traceable: one gather, one
    select."""
    C = t.shape[dim]
    v = valid.reshape(-1)[:1].long()
    i = torch.arange(C, device=t.device)
    rotated = t.index_select(dim, (i + v) % C)
    real = (i >= C - v).reshape([C if d == dim else 1 for d in range(t.dim())])
    return torch.where(real, rotated, torch.zeros((), dtype=t.dtype, device=t.device))


def pad_last(t: torch.Tensor, valid: torch.Tensor, dim: int) -> torch.Tensor:
    """The inverse rotation of :func:`pad_first` along ``dim`` (real rows back to 0 .. v-1)."""
    C = t.shape[dim]
    v = valid.reshape(-1)[:1].long()
    return t.index_select(dim, (torch.arange(C, device=t.device) + C - v) % C)


def _replace(stack: torch.Tensor, a: int, rows: torch.Tensor) -> torch.Tensor:
    """``stack`` with entry ``a`` (dim 0) replaced by ``rows`` [1, ...] (traceable, no in-place write)."""
    return torch.cat([stack[:a], rows.to(stack.dtype), stack[a + 1:]])


def megakernel_context(plan, w: dict, st: dict, rt: dict, coll, lnc: int) -> list[torch.Tensor]:
    """One rank's context graph of the megakernel backend: the NKI prefill kernels as custom calls, each launched
    ``kernel[lnc](...)`` on every rank (the replicated ones -- embedding, RMSNorm -- too: SPMD), in the sequence
    ``harness.prefill.predict`` costs (module docstring): 2 + 2 x layers + GDN layers launches for the trunk (an
    attention layer's mixer one launch per K/V group), 4 for the MTP head, 1 for the head stage. w: the rank's
    ``megakernel.sharded.rank_weights``; st: its decode state (``plan.STATE`` names, not modified); rt: the run-time
    inputs as tensors; coll: the TP collectives (the MTP fc columns and the head's argmax are gathered over ranks).
    Returns [the token after the chunk [1, 1], the greedy token after its last real row [1, 1] int32, that row's
    post-norm hidden [1, H], gdn_window, gdn_state, attn_k, attn_v]."""
    from megakernel.layerwise import head_stage
    from megakernel.prefill import mtp_fc_prefill_stage, residual_allreduce_stage
    from nki_kernels.attention_prefill import KEY_BLOCK, attention_prefill_kernel, attention_prefill_kv_kernel
    from nki_kernels.embedding_prefill import embedding_prefill_kernel
    from nki_kernels.gdn_prefill import gdn_prefill_kernel
    from nki_kernels.moe_prefill import moe_prefill, token_rows
    from nki_kernels.rmsnorm_prefill import rmsnorm_prefill_kernel
    ids, start, valid, cos, sin = rt["ids"], rt["start"], rt["valid"], rt["cos"], rt["sin"]
    C = ids.shape[0] - 1
    last_row = (valid.reshape(-1)[:1].long() - 1).clamp(min=0)   # [1]; 0 for the example inputs' valid = 0
    eps, rows, tp = plan.eps, plan.norms, plan.tp
    norms = w["norms"]
    slot = start * 0                                   # GDN slot 0, read and written (int32 [1, 1])
    windows = list(st["gdn_window"].unbind(0)) if "gdn_window" in st else []
    states = list(st["gdn_state"].unbind(0)) if "gdn_state" in st else []
    kc, vc = st["attn_k"], st["attn_v"]

    def embed(tok):                # ONE launch for the chunk's ids [C, 1] int32
        return embedding_prefill_kernel[lnc](w["embed"], tok)

    def attention(layer, xT, x):   # the all-reduce, residual add and post-attention norm fused (residual=)
        nonlocal kc, vc
        normed = None
        for g in range(layer.groups):  # several KV groups on a rank: each group's output is added in turn
            a = layer.mixer * layer.groups + g
            last = g == layer.groups - 1
            out = attention_prefill_kernel[lnc](
                xT, w["attn_wqg"][a], w["attn_wk"][a], w["attn_wv"][a], w["attn_wo"][a], w["attn_norm_w"][a],
                cos, sin, kc[a:a + 1], vc[a:a + 1], start, eps, KEY_BLOCK, None, x, tp,
                norms[layer.post_norm] if last else None, "rows" if last else "none")
            x = out[0]
            if last:
                normed = out[1]
            kc, vc = _replace(kc, a, out[-2]), _replace(vc, a, out[-1])
        return x, normed

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
                pad_first(xT, valid, 2), w["gdn_w_in"][j], w["gdn_conv_w"][j], w["gdn_A_log"][j],
                w["gdn_dt_bias"][j], w["gdn_norm_w"][j], w["gdn_w_out"][j], windows[j], states[j], slot, slot, eps,
                False)
            part = pad_last(part, valid, 1)
            x, normed = residual_allreduce_stage[lnc](x, part, tp, True, norms[layer.post_norm], eps, "rows")
        else:
            x, normed = attention(layer, xT, x)
        # the MoE with its all-reduce, the residual add and the next RMSNorm fused into its combine: the next
        # layer's input norm (xT), after the last layer the final norm's rows (the MTP head's hidden) or nothing
        table, e = layer.experts
        last = i == len(plan.layers) - 1
        out_layout = ("rows" if plan.mtp is not None else "none") if last else "xT"
        out = moe_prefill[lnc](token_rows(normed), w["moe_router"][layer.moe], w[f"moe_experts_{table}"][e],
                               w["moe_shared"][layer.moe], plan.top_k, None, x, tp,
                               norms[rows.final if last else plan.layers[i + 1].in_norm], eps, out_layout)
        x = out[0]
        if out_layout == "xT":
            xT = out[1]
        elif out_layout == "rows":
            hidden_rows = out[1]
    if plan.mtp is not None:
        fc = mtp_fc_prefill_stage[lnc](embed(ids[1:C + 1]), hidden_rows, norms, rows.mtp_emb, rows.mtp_hidden,
                                       w["mtp_fc"], eps)
        x_m = coll.gather_last(torch.cat([fc[c] for c in range(fc.shape[0])], dim=-1)).to(x.dtype)
        kv_rows(plan.mtp, rmsnorm_prefill_kernel[lnc](x_m, norms[plan.mtp.in_norm], eps, False, True)[0])
    best, hidden = head_stage[lnc](x.index_select(0, last_row), norms, rows.final, w["lm_head"], eps)
    allp = coll.gather_ranks(best.reshape(-1, 2)).reshape(-1, 2)           # [tp * lnc, 2] in global core order
    _, target = combine_argmax(allp[:, 0:1], allp[:, 1:2], plan.vocab_per_core)
    out = [ids.index_select(0, last_row + 1), target.reshape(1, 1).to(torch.int32), hidden.to(x.dtype).reshape(1, -1)]
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
    ids, start, valid, cos, sin = rt["ids"], rt["start"], rt["valid"], rt["cos"], rt["sin"]
    C = ids.shape[0] - 1
    last_row = (valid.reshape(-1)[:1].long() - 1).clamp(min=0)   # [1]; 0 for the example inputs' valid = 0
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
        part, win, s = gdn_prefill_rank(dims, {k: w["gdn_" + k][j] for k in xla.GDN_WEIGHTS}, pad_first(h, valid, 0),
                                        state.windows[j][0], state.states[j][0])
        part = pad_last(part, valid, 0)
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
    h_last = hidden.index_select(0, last_row)
    target = greedy_rank(w["lm_head"], h_last, coll)
    new = state.stacked()
    after = ids.index_select(0, last_row + 1)
    return [after, target.reshape(1, 1).to(torch.int32), h_last] + [new[n] for n in rp.STATE if n in new]


# ---- the host side --------------------------------------------------------------------------------------------------
def _decoder_class():
    from harness.speculative import Decoder

    class ContextDecoder(Decoder):
        """A ``harness.speculative.Decoder`` whose prefill runs the engine's context graphs (``engine.buckets``,
        modes ``context_C``; :func:`schedule`), or, without buckets, teacher-forces the prompt; rounds and steps
        are the engine's. ``prefill_info``: backend "context" (or "teacher-forced"), chunks [[start, bucket,
        tokens], ...], launches of the last prefill."""

        def __init__(self, engine):
            super().__init__(engine, reference=None)
            self.buckets = tuple(engine.buckets)
            self.prefill_info = None

        def prefill(self, prompt: list[int], max_len: int):
            plan = schedule(len(prompt), self.buckets, self.drafts)
            self.begin_prefill(prompt, max_len)
            self.prefill_info = {"backend": "context" if plan.chunks else "teacher-forced",
                                 "chunks": [list(c) for c in plan.chunks], "launches": plan.launches}
            if not plan.chunks:
                return self._teacher_forced(prompt)
            out = None
            for s, b, v in plan.chunks:
                out = self.engine.run(mode_of(b), context_inputs(self.cfg, prompt, s, b, v))
            return out.targets[0], out.hidden[0]

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

    def start(self, max_len: int) -> None:
        """The wrapped engine's start with room for a padded chunk's rows: at least the smallest bucket that holds
        ``max_len`` positions (on the chip, the converted state holds every bucket, ``check_buckets``)."""
        fits = [b for b in self.buckets if b >= max_len]
        self.inner.start(min(fits, default=max_len))

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
