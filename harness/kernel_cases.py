"""Kernel cases: which kernel is launched with which arguments for the cost model and the trace reports.

The one registry of full-size launches (the kernel modules build no arguments of their own). A
:class:`KernelCase` is a kernel, its per-rank arguments at the real per-rank shapes of the model (weights and
float activations as ``nkisim.ShapeDtype``; positions, token ids and the read slot as real ``int32`` arrays, so
that register loads straight from them see their values), the register-value provider for values computed on
chip (``harness.register_models``), and the context and routing it stands for. ``case.trace()`` returns the
nkisim trace of the launch.

Cases:

* :func:`round_case` / :func:`step_case` -- the round / step megakernel AS SHIPPED (``megakernel.round``, its
  plan with ``max_context=None``: runtime KV-tile loops whose trip counts come from the position), one launch per
  rank on TP x LNC cores.
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
    plan: object = None            # the launch plan of a round / step megakernel case (megakernel.plan)

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
    # fp8 experts tables: e4m3 codes in torch.float8_e4m3fn storage (nki_kernels.moe "fp8 experts")
    names = {"torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.int32": "int32",
             "torch.float8_e4m3fn": "float8_e4m3"}
    return nkisim.ShapeDtype(tuple(t.shape), names[str(t.dtype)])


@functools.lru_cache(maxsize=8)
def rank_tensors(cfg, tp: int = 4, lnc: int = 2, context: int = 2048, dtype: str = "bfloat16",
                 draft_vocab: int = 0, fp8_experts: bool = False, draft_fp8: bool = False) -> tuple:
    """Per rank: {name: ShapeDtype} of every stacked weight (``megakernel.sharded.rank_weights`` run on ``meta``
    tensors, so the real layout helpers give the shapes) and of the decode state of a sequence of ``context``
    tokens plus the round's two (``megakernel.plan.state_specs``). ``draft_vocab`` > 0 adds an FR-Spec draft head of
    that many ids (ids 0..N-1 stand in: the cost does not depend on which rows). ``fp8_experts``: the routed experts
    quantised (``model.tp.moe.quantize_fp8``: e4m3 tables and their scales, opt-in; it changes the output).
    ``draft_fp8``: the drafts' head in fp8 (``megakernel.sharded.rank_weights``; opt-in, the output is unchanged)."""
    import torch

    import nkisim
    from megakernel.plan import state_specs
    from megakernel.sharded import rank_weights
    from model.params import expected_shapes, is_fp32_param
    act = _dtype(dtype)
    params = {k: torch.empty(s, dtype=torch.float32 if is_fp32_param(k) else act, device="meta")
              for k, s in expected_shapes(cfg).items()}
    if fp8_experts:
        from model.tp.moe import quantize_fp8
        params = quantize_fp8(params)
    state = {s.name: nkisim.ShapeDtype(s.shape, dtype if s.dtype == "activation" else s.dtype)
             for s in state_specs(cfg, tp, context + 2)}
    ids = np.arange(draft_vocab, dtype=np.int32) if draft_vocab else None
    return tuple({**{k: _shape_dtype(v) for k, v in rank_weights(cfg, params, r, tp, lnc, ids, draft_fp8).items()},
                  **state}
                 for r in range(tp))


def _runtime(cfg, context: int, dtype: str, mode: str = "round", device_commit: bool = False) -> dict:
    """The run-time inputs as a real launch passes them (``megakernel.plan.round_inputs`` / ``step_inputs``): the
    int32 arrays keep their values in a shape-only launch; cos/sin and the hidden row are float, so shape-only. A
    device-committed round: ``force``, the control state (int32, real: the position reaches the register loads)
    and the RoPE tables of the sequence (``megakernel.plan.control_state``, ``rope_table``); the host inputs None."""
    import torch

    from megakernel import plan as rp
    if mode == "step":
        return rp.step_inputs(cfg, _token(cfg), context, 0)
    if device_commit:
        import nkisim
        st = rp.control_state(cfg, _dtype(dtype), _token(cfg), torch.zeros(1, cfg.hidden_size), context, 0)
        rows = (rp.cache_length(context + 2), cfg.rotary_dim)
        return {**{n: None for n in rp.input_names("round")}, "force": rp.force_input(cfg),
                "control": st["control"], "control_hidden": _shape_dtype(st["control_hidden"]),
                "rope_cos": nkisim.ShapeDtype(rows, "float32"), "rope_sin": nkisim.ShapeDtype(rows, "float32")}
    return rp.round_inputs(cfg, _dtype(dtype), _token(cfg), torch.zeros(1, cfg.hidden_size), context, 0)


# ---- the round megakernel -------------------------------------------------------------------------
def round_case(cfg, context: int = 2048, routing: Routing | None = None, tp: int = 4, lnc: int = 2,
               dtype: str = "bfloat16", max_context: int | None = None, draft_vocab: int = 0,
               device_commit: bool = False, fp8_experts: bool = False, draft_fp8: bool = False) -> KernelCase:
    """The round megakernel as shipped (``megakernel.round.round_kernel``, runtime loops) at position p =
    ``context``. ``max_context`` plans the attention's unrolled shape-only specialisation instead (the pre-issue-13
    costing, kept for comparison: ``harness.costmodel.compose.corrections``). ``draft_vocab``: ids of an FR-Spec
    draft vocabulary (0: the drafts use the full LM head). ``device_commit``: the opt-in device-committed round
    (``megakernel.plan`` ``device_commit``; its inputs from the control state). ``fp8_experts``: the opt-in fp8
    experts tables (:func:`rank_tensors`). ``draft_fp8``: the opt-in fp8 draft head (``megakernel.plan`` ``draft_fp8``)."""
    return launch_case(cfg, "round", context, routing, tp, lnc, dtype, max_context, draft_vocab, device_commit,
                       fp8_experts, draft_fp8)


def step_case(cfg, context: int = 2048, routing: Routing | None = None, tp: int = 4, lnc: int = 2,
              dtype: str = "bfloat16") -> KernelCase:
    """The plain-decode step kernel as shipped (``megakernel.round.step_kernel``) at position p = ``context``."""
    return launch_case(cfg, "step", context, routing, tp, lnc, dtype, None)


def launch_case(cfg, mode: str, context: int, routing: Routing | None, tp: int, lnc: int, dtype: str,
                max_context, draft_vocab: int = 0, device_commit: bool = False, fp8_experts: bool = False,
                draft_fp8: bool = False) -> KernelCase:
    from harness.costmodel.layers import stage_tagger
    from megakernel import plan as rp
    from megakernel.round import KERNELS
    routing = routing or Routing("expected", 2 if mode == "round" else 1, cfg.num_experts_per_tok, cfg.num_experts)
    plan = rp.plan_for(cfg, mode, tp, lnc, max_context, draft_vocab=draft_vocab, device_commit=device_commit,
                       draft_fp8=draft_fp8)
    run = _runtime(cfg, context, dtype, mode, device_commit)
    nd = draft_vocab if plan.draft_vocab_per_core else 0
    skip = set(rp.WEIGHTS) - set(rp.kernel_weights(mode))       # a step takes no MTP weights
    per_rank = [{"plan": plan, **{k: v for k, v in t.items() if k not in skip}, **run}
                for t in rank_tensors(cfg, tp, lnc, context, dtype, nd, fp8_experts, draft_fp8)]
    case = KernelCase(f"{mode} megakernel", KERNELS[mode], per_rank, tp, lnc,
                      RoundRegisters(context, routing, plan), stage_tagger(plan), context, routing, plan.tokens,
                      notes={"shipped": "max_context=None (runtime loops)" if max_context is None else
                             f"NOT the shipped kernel: max_context={max_context} (attention loops unrolled)"},
                      plan=plan)
    case.notes["kernel_parameters"] = kernel_parameters(case)["count"]
    return case


def kernel_parameters(case: KernelCase) -> dict:
    """HBM tensor parameters of a case's kernel on rank 0 (at full size for the registry's cases): the tensors the
    launch passes (an unused experts table stays at its default None and is no parameter of that launch) -- count,
    total bytes, and the signature's tensor parameters (``declared``: every parameter but the compile-time ones)."""
    import inspect

    import nkisim
    from nkisim import dtypes
    a = case.per_rank[0]
    n = nbytes = 0
    for v in (a.values() if isinstance(a, dict) else a):
        if isinstance(v, nkisim.ShapeDtype) or hasattr(v, "shape"):
            name = v.dtype if isinstance(v, nkisim.ShapeDtype) else dtypes.normalize(v.dtype)
            n += 1
            nbytes += int(np.prod(v.shape)) * dtypes.itemsize(name)
    fn = getattr(case.kernel, "fn", case.kernel)
    declared = len([p for p in inspect.signature(fn).parameters if p != "plan"])
    return {"count": n, "bytes": nbytes, "declared": declared}


# ---- the layerwise variant's launches ---------------------------------------------------------------
STAGES = ("gdn", "attention", "kv_rows", "moe", "head", "mtp_fc")


def stage_case(cfg, stage: str, tokens: int, context: int = 2048, routing: Routing | None = None,
               distinct: int | None = None, mtp: bool = False, tp: int = 4, lnc: int = 2,
               dtype: str = "bfloat16") -> KernelCase:
    """One launch of a ``megakernel.layerwise`` stage kernel on rank 0 with the arguments the layerwise variant
    passes it (``harness.engines.LayerwiseEngine``) for the first layer of its kind in the round plan (or the MTP
    layer with ``mtp``). stage: gdn | attention | kv_rows | moe | head | mtp_fc. attention attends at ``context``
    (the MTP draft's D1 launch passes context - 1), kv_rows (the replay's K / V rows) writes there; moe routes with ``routing`` (``distinct`` fixes the distinct-expert
    count of a multi-token call)."""
    import nkisim

    from megakernel import layerwise as lw
    from megakernel import plan as rp
    if stage not in STAGES:
        raise ValueError(f"stage_case: stage must be one of {STAGES}, got {stage!r}")
    w = rank_tensors(cfg, tp, lnc, context, dtype)[0]
    plan = rp.round_plan(cfg, tp, lnc) if cfg.mtp_num_hidden_layers else rp.step_plan(cfg, tp, lnc)
    trunk = [s for s in plan.stages if s.kind == rp.VERIFY][0].layers
    SD = nkisim.ShapeDtype
    eps = float(cfg.rms_norm_eps)
    H = cfg.hidden_size
    x = SD((tokens, H), dtype)
    routing = routing or Routing("expected", 2, cfg.num_experts_per_tok, cfg.num_experts)
    provider, notes = None, {}

    def first(kind):
        if mtp:
            return rp.mtp_layer(cfg, tp, lnc)
        return [layer for layer in trunk if layer.kind == kind][0]
    if stage == "gdn":
        L = first(rp.GDN)
        args = (x, w["norms"], L.in_norm, w["gdn_w_in"], w["gdn_conv_w"], w["gdn_A_log"], w["gdn_dt_bias"],
                w["gdn_norm_w"], w["gdn_w_out"], w["gdn_window"], w["gdn_state"], np.array([[0]], np.int32), L.mixer,
                eps)
        kernel = lw.gdn_stage
    elif stage in ("attention", "kv_rows"):
        L = first(rp.ATTENTION)
        cos, sin = rp.rope_rows(cfg, context, tokens)
        args = (x, w["norms"], L.in_norm, w["attn_wqg"], w["attn_wk"], w["attn_wv"], w["attn_wo"], w["attn_norm_w"],
                cos, sin, w["attn_k"], w["attn_v"], np.array([[context]], np.int32), L.mixer * L.groups, eps)
        kernel = lw.attention_stage if stage == "attention" else lw.kv_rows_stage
        if stage == "attention":
            provider = AttentionRegisters(context, tokens, lnc)
    elif stage == "moe":
        L = rp.mtp_layer(cfg, tp, lnc) if mtp else trunk[0]
        table, index = L.experts
        args = (x, w["norms"], L.post_norm, w["moe_router"], w[f"moe_experts_{table}"], w["moe_shared"],
                cfg.num_experts_per_tok, L.moe, index, eps)
        kernel = lw.moe_stage
        provider = MoERouting(routing, distinct=distinct)
        notes["distinct"] = distinct if tokens > 1 else cfg.num_experts_per_tok
    elif stage == "head":
        args = (x, w["norms"], plan.norms.mtp_final if mtp else plan.norms.final, w["lm_head"], eps)
        kernel = lw.head_stage
    else:
        args = (SD((1, H), dtype), SD((1, H), dtype), w["norms"], plan.norms.mtp_emb, plan.norms.mtp_hidden,
                w["mtp_fc"], eps)
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


# ---- one prefill kernel on one rank (harness.prefill, the kernels' trace tests) ------------------------------
def gdn_prefill_launch(cfg, tp: int = 4, L: int = 1024, dtype: str = "bfloat16") -> tuple:
    """(kernel, args) of one rank's GDN prefill of L tokens at the config's shapes (``nki_kernels.gdn_prefill``,
    LNC=2), ``nkisim.ShapeDtype`` tensors; the slot registers read 0 in a shape-only launch."""
    import nkisim
    from nki_kernels import gdn_prefill as kp
    shapes = kp.kernel_shapes(cfg, tp=tp, L=L, lnc=2, dtype=dtype)
    return kp.gdn_prefill_kernel[2], (tuple(nkisim.ShapeDtype(s, d) for s, d in shapes.values()) +
                                      (float(cfg.rms_norm_eps), False))


def attention_prefill_launch(cfg, tp: int = 4, N: int = 1024, start: int = 0, dtype: str = "bfloat16",
                             key_block: int | None = None) -> tuple:
    """(kernel, args) of one rank's attention prefill (``nki_kernels.attention_prefill``, LNC=2) of a chunk of N
    tokens at positions start..start+N-1, cache length ceil((start + N) / key_block) key blocks, ``nkisim.ShapeDtype``
    tensors and ``static_start = start`` (the trace holds the blocks a launch at that start runs)."""
    import nkisim
    from nki_kernels import attention_prefill as ap
    kb = ap.KEY_BLOCK if key_block is None else key_block
    H, D, R, P = cfg.hidden_size, cfg.head_dim, cfg.rotary_dim, ap.P
    if cfg.num_attention_heads % tp or tp % cfg.num_key_value_heads:
        raise ValueError(f"attention_prefill: tp={tp} must divide the {cfg.num_attention_heads} query heads and be "
                         f"a multiple of the {cfg.num_key_value_heads} KV heads (one KV head per rank)")
    hq = cfg.num_attention_heads // tp
    L = max(kb, -(-(start + N) // kb) * kb)
    shapes = (((P, H // P, N), dtype), ((H, 2, hq, D), dtype), ((H, D), dtype), ((H, D), dtype), ((hq * D, H), dtype),
              ((2, D), "float32"), ((N, R), "float32"), ((N, R), "float32"), ((1, L, D), dtype), ((1, L, D), dtype),
              ((1, 1), "int32"))       # xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, start
    return ap.attention_prefill_kernel[2], (tuple(nkisim.ShapeDtype(*s) for s in shapes) +
                                            (float(cfg.rms_norm_eps), kb, start))


def moe_prefill_launch(cfg, tp: int = 4, N: int = 1024, dtype: str = "bfloat16", lnc: int = 2) -> tuple:
    """(kernel, args) of one rank's MoE prefill of N tokens (``nki_kernels.moe_prefill``, LNC=``lnc``),
    ``nkisim.ShapeDtype`` tensors. The registers a shape-only launch loads read 0, which here is the realistic case at
    N k >= E: every slot is used (all read expert 0's bytes: one expert block per slot, as when every expert is
    active) and no expert is heavy (the heavy loop runs 0 times)."""
    import nkisim
    from nki_kernels import moe_prefill as mp
    shapes = mp.kernel_shapes(cfg, tp, N, lnc, dtype)
    return (mp.moe_prefill[lnc] if lnc == 2 else mp.moe_prefill), (
        tuple(nkisim.ShapeDtype(s, dtype) for s in shapes.values()) + (cfg.num_experts_per_tok,))
