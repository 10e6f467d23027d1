"""Kernel cases: which kernel is launched with which arguments for the cost model and the trace reports.

The one registry of full-size launches (issue 14: the ``demo_args`` hooks of the kernel modules move here). A
:class:`KernelCase` is a kernel, its per-rank arguments at the real per-rank shapes of the model (weights and
float activations as ``nkisim.ShapeDtype``; positions, token ids and the read slot as real ``int32`` arrays, so
that register loads straight from them see their values), the register-value provider for values computed on
chip (``harness.register_models``), and the context and routing it stands for. ``case.trace()`` returns the
nkisim trace of the launch.

Cases:

* :func:`round_case` -- the round megakernel AS SHIPPED (``max_context=None``: runtime KV-tile loops whose trip
  counts come from the position), one launch per rank on TP x LNC cores.
* :func:`stage_case` -- one launch of a layerwise stage kernel (``megakernel.layerwise``) on one rank: the
  kernels the layerwise variant runs, one per layer stage.
* :func:`embedding_case` -- the embedding kernel of the layerwise variant (one core).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np

from harness.register_models import AttentionRegisters, MoERouting, RoundRegisters, Routing

TOKEN = 1000          # the pending token id of every case (any id: the cost does not depend on it)


def _token(cfg):
    return min(TOKEN, cfg.vocab_size - 1)


@dataclass
class KernelCase:
    name: str
    kernel: object                 # an nki.jit kernel (LNC grid applied when lnc > 1)
    per_rank: list                 # per-rank argument tuples (or dicts of keyword arguments)
    tp: int = 1
    lnc: int = 2
    provider: object = None        # register-value provider (nkisim.register_values), or None
    stages: object = "function"    # the ``stages`` argument of costmodel.predict
    context: int | None = None     # the position p of the pending token (cache rows 0..p-1 valid)
    routing: Routing | None = None
    tokens: int = 2
    notes: dict = field(default_factory=dict)

    def trace(self):
        import contextlib

        import nkisim
        ctx = nkisim.register_values(self.provider) if self.provider is not None else contextlib.nullcontext()
        with ctx, nkisim.trace.capture() as tr:
            if self.tp > 1:
                nkisim.launch(self.kernel, self.per_rank, tp=self.tp, lnc=self.lnc)
            else:
                a = self.per_rank[0]
                k = self.kernel if self.lnc == 1 else self.kernel[self.lnc]
                k(**a) if isinstance(a, dict) else k(*a)
        return tr


# ---- per-rank tensors at full size ---------------------------------------------------------------
def _dtype(name):
    import torch
    return {"bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def _shape_dtype(t):
    import nkisim
    names = {"torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.int32": "int32"}
    return nkisim.ShapeDtype(tuple(t.shape), names[str(t.dtype)])


@functools.lru_cache(maxsize=8)
def rank_tensors(cfg, tp: int = 4, lnc: int = 2, context: int = 2048, dtype: str = "bfloat16") -> tuple:
    """Per rank: {name: ShapeDtype} of every weight (``megakernel.sharded.rank_weights`` run on ``meta`` tensors,
    so the real layout helpers give the shapes) and of the decode state of a sequence of ``context`` tokens plus the
    round's two (``rank_state``)."""
    import torch

    from megakernel.sharded import rank_state, rank_weights
    from model.params import expected_shapes, is_fp32_param
    from model.state import DecodeState
    act = _dtype(dtype)
    params = {k: torch.empty(s, dtype=torch.float32 if is_fp32_param(k) else act, device="meta")
              for k, s in expected_shapes(cfg).items()}
    state = DecodeState.empty(cfg, max_len=context + 2, slots=2, dtype=act)
    out = []
    for r in range(tp):
        tensors = {**rank_weights(cfg, params, r, tp, lnc), **rank_state(cfg, state, r, tp)}
        out.append({k: _shape_dtype(v) for k, v in tensors.items()})
    return tuple(out)


def _runtime(cfg, context: int, dtype: str) -> dict:
    """The round's run-time inputs as a real launch passes them (``harness.nxdi.assembly.round_inputs``): the int32
    arrays keep their values in a shape-only launch; cos/sin and the hidden row are float, so shape-only."""
    import torch

    from harness.nxdi.assembly import round_inputs
    return round_inputs(cfg, _dtype(dtype), _token(cfg), torch.zeros(1, cfg.hidden_size), context, 0)


# ---- the round megakernel -------------------------------------------------------------------------
def round_case(cfg, context: int = 2048, routing: Routing | None = None, tp: int = 4, lnc: int = 2,
               dtype: str = "bfloat16", max_context: int | None = None) -> KernelCase:
    """The round megakernel as shipped (runtime loops, ``max_context=None``) at position p = ``context``.
    ``max_context`` builds the attention's unrolled shape-only specialisation instead (the pre-issue-13
    costing, kept for comparison: ``harness.costmodel.compose.corrections``)."""
    from megakernel.round import RoundSpec, build_kernel, stage_of
    from megakernel.sharded import kv_groups
    from model.tp.embed_head import vocab_per_core
    routing = routing or Routing("expected", 2, cfg.num_experts_per_tok, cfg.num_experts)
    spec = RoundSpec(tuple(cfg.layer_types), len(kv_groups(cfg, 0, tp)), tp, lnc, float(cfg.rms_norm_eps),
                     cfg.num_experts_per_tok, vocab_per_core(cfg, tp * lnc), "round", max_context)
    run = _runtime(cfg, context, dtype)
    per_rank = [{**t, **run} for t in rank_tensors(cfg, tp, lnc, context, dtype)]
    kernel = build_kernel(spec, sorted(per_rank[0]))
    return KernelCase("round megakernel", kernel, per_rank, tp, lnc, RoundRegisters(context, routing, lnc),
                      stage_of, context, routing, 2,
                      notes={"kernel_parameters": len(per_rank[0]),
                             "shipped": "max_context=None (runtime loops)" if max_context is None else
                             f"NOT the shipped kernel: max_context={max_context} (attention loops unrolled)"})


def kernel_parameters(case: KernelCase) -> dict:
    """HBM tensor parameters of a case's kernel on rank 0 at full size: count and total bytes."""
    import nkisim
    from nkisim import dtypes
    a = case.per_rank[0]
    n = nbytes = 0
    for v in (a.values() if isinstance(a, dict) else a):
        if isinstance(v, nkisim.ShapeDtype) or hasattr(v, "shape"):
            name = v.dtype if isinstance(v, nkisim.ShapeDtype) else dtypes.normalize(v.dtype)
            n += 1
            nbytes += int(np.prod(v.shape)) * dtypes.itemsize(name)
    return {"count": n, "bytes": nbytes}


# ---- the layerwise variant's launches ---------------------------------------------------------------
STAGES = ("gdn", "attention", "moe", "head", "mtp_fc")


def stage_case(cfg, stage: str, tokens: int, context: int = 2048, routing: Routing | None = None,
               distinct: int | None = None, mtp: bool = False, tp: int = 4, lnc: int = 2,
               dtype: str = "bfloat16") -> KernelCase:
    """One launch of a ``megakernel.layerwise`` stage kernel on rank 0 with the arguments the layerwise variant
    passes it (``harness.kernel_variants.LayerwiseVariant``). stage: gdn | attention | moe | head | mtp_fc.
    attention attends at ``context`` (the MTP draft's D1 launch passes context - 1); moe routes with ``routing``
    (``distinct`` fixes the distinct-expert count of a multi-token call); ``mtp`` picks the MTP layer's weights."""
    import nkisim

    from harness.nxdi.assembly import rope_rows
    from megakernel import layerwise as lw
    from megakernel.sharded import moe_weights
    if stage not in STAGES:
        raise ValueError(f"stage_case: stage must be one of {STAGES}, got {stage!r}")
    w = rank_tensors(cfg, tp, lnc, context, dtype)[0]
    SD = nkisim.ShapeDtype
    eps = float(cfg.rms_norm_eps)
    H = cfg.hidden_size
    x = SD((tokens, H), dtype)
    routing = routing or Routing("expected", 2, cfg.num_experts_per_tok, cfg.num_experts)
    provider, notes = None, {}
    if stage == "gdn":
        i = cfg.linear_layers[0]
        g = f"l{i}_gdn_"
        args = (x, w[f"l{i}_in_norm"], w[g + "w_in"], w[g + "conv_w"], w[g + "A_log"], w[g + "dt_bias"],
                w[g + "norm_w"], w[g + "w_out"], w[f"l{i}_window"], w[f"l{i}_state"], np.array([[0]], np.int32), eps)
        kernel = lw.gdn_stage
    elif stage == "attention":
        pre = "mtp" if mtp else f"l{cfg.full_layers[0]}"
        norm = "mtp_in_norm" if mtp else f"{pre}_in_norm"
        p = f"{pre}_g0_"
        cos, sin = rope_rows(cfg, context, tokens)
        args = (x, w[norm], w[p + "wqg"], w[p + "wk"], w[p + "wv"], w[p + "wo"], w[p + "norm_w"], cos, sin,
                w[p + "k"], w[p + "v"], np.array([[context]], np.int32), eps)
        kernel = lw.attention_stage
        provider = AttentionRegisters(context, tokens, lnc)
    elif stage == "moe":
        if mtp:
            r, e, s, li = w["mtp_moe_router"], w["mtp_moe_experts"], w["mtp_moe_shared"], None
            norm = "mtp_post_norm"
        else:
            r, e, s, li = moe_weights(w, 0)
            norm = f"l0_post_norm"
        args = (x, w[norm], r, e, s, cfg.num_experts_per_tok, li, eps)
        kernel = lw.moe_stage
        provider = MoERouting(routing, distinct=distinct)
        notes["distinct"] = distinct if tokens > 1 else cfg.num_experts_per_tok
    elif stage == "head":
        args = (x, w["mtp_norm" if mtp else "final_norm"], w["lm_head"], eps)
        kernel = lw.head_stage
    else:
        args = (SD((1, H), dtype), SD((1, H), dtype), w["mtp_norm_emb"], w["mtp_norm_hidden"], w["mtp_fc"], eps)
        kernel = lw.mtp_fc_stage
    name = f"{stage}{' (MTP)' if mtp else ''} T={tokens}"
    return KernelCase(name, kernel, [args], 1, lnc, provider, "function", context, routing, tokens, notes)


def embedding_case(cfg, tokens: int, tp: int = 4, lnc: int = 2, context: int = 2048,
                   dtype: str = "bfloat16") -> KernelCase:
    """The layerwise variant's embedding launch (``nki_kernels.embedding.embedding_kernel``, one core)."""
    from nki_kernels.embedding import embedding_kernel
    w = rank_tensors(cfg, tp, lnc, context, dtype)[0]
    ids = np.full((tokens, 1), _token(cfg), np.int32)
    return KernelCase(f"embedding T={tokens}", embedding_kernel, [(w["embed"], ids)], 1, 1, None, "function",
                      context, None, tokens)
