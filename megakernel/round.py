"""The round megakernel: MTP draft, 2-token verify of the trunk and draft replay in ONE launch per rank.

One ``kernel[lnc]`` launch per TP rank per decode round, composed of the subkernel bodies of
``nki_kernels`` (no copies of them). With the pending token x_{t+1} at position p = t+1 and h_t the
trunk's post-norm hidden at position t:

* D1 (MTP at position p-1): embed(x_{t+1}), the two MTP pre-fc norms, ``mtp.fc`` (columns split over
  the cores, gathered), one gated-attention + MoE layer with the MTP KV cache, ``mtp.norm``, LM head
  and global argmax -> draft d (or the host's forced draft, for tests; selected arithmetically).
* V (trunk at positions p, p+1 on [x_{t+1}, d]): the residual ``x [2, H]`` stays in SBUF across all
  layers; after every mixer and every MoE the core partials are all-reduced over the TP x LNC cores;
  KV rows are written in place; every GDN layer writes its per-token checkpoints; final norm; LM head
  and argmax for both positions -> targets; the post-norm hidden goes back to the host.
* D2 (MTP at position p on (d, h_{t+1})): writes the MTP KV row that the next round needs if d is
  accepted; no LM head.

``mode="step"`` builds the plain-decode kernel instead: V on the single pending token, no MTP.

Arguments are individual top-level HBM tensors (NKI binds no lists): the names of
``megakernel.sharded`` plus the run-time inputs of :data:`RUNTIME_INPUTS`. The kernel function is
generated as Python source with one named parameter per tensor and imported from a file, so the real
NKI front end (which parses the kernel's source) sees an ordinary function; its compile-time settings
(:class:`RoundSpec`, an ``NKIObject``) are built from literals inside that function, not read from a module
global. Mutated caches and checkpoints are returned with the outputs so the compiler keeps the writes.
The MoE weights of the trunk come in stacked groups (``megakernel.sharded.moe_weights``) whose element
offsets fit int32.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import nki
import nki.isa as nisa
import nki.language as nl

from megakernel.sharded import moe_weights
from nki_kernels.attention import ATTENTION_REGISTERS, attention_body
from nki_kernels.collectives import allgather_cores, allreduce_partials, argmax_combine, tp_group
from nki_kernels.embedding import embedding_body, load_token_ids, token_ids_from_best
from nki_kernels.gdn import gdn_body
from nki_kernels.linear import columns_body, token_major
from nki_kernels.lm_head import lm_head_argmax_body
from nki_kernels.moe import moe_tkg_body
from nki_kernels.rmsnorm import rmsnorm_body

FULL = "full_attention"
MOE_PREFETCH = 8  # expert ring depth of moe_tkg_body (its default); the register pool holds 2x that

# Run-time inputs of a round (host-built, see megakernel.variant): token ids and positions are int32
# [1, 1]; cos/sin are float32 [T, rotary_dim] rows of the positions; force = (flag, token) int32 [1, 2].
RUNTIME_INPUTS = {
    "round": ("pending", "hidden", "read_slot", "force", "pos_d1", "pos", "cos_d1", "sin_d1", "cos_v",
              "sin_v"),
    "step": ("pending", "read_slot", "pos", "cos_v", "sin_v"),
}


class RoundSpec(nl.NKIObject):
    """Compile-time constants of the round kernel (everything else is a tensor argument).

    An ``NKIObject`` (SDK-LG "Class Support": only its ``__dict__`` crosses into the kernel): plain fields,
    no properties. The generated kernel builds it from literals (:func:`build_kernel`), so the kernel is a
    pure function of its arguments and source (SDK-LG "Kernel Caching")."""

    def __init__(self, layer_types, kv_groups, tp, lnc, eps, top_k, vocab_per_core, mode, max_context=None):
        if mode not in ("round", "step"):
            raise ValueError(f"RoundSpec: mode must be 'round' or 'step', got {mode!r}")
        self.layer_types = tuple(layer_types)
        self.kv_groups = kv_groups          # KV heads per rank: attention bodies per attention layer
        self.tp = tp
        self.lnc = lnc
        self.eps = float(eps)
        self.top_k = top_k
        self.vocab_per_core = vocab_per_core
        self.mode = mode                    # "round" or "step"
        self.max_context = max_context      # attention loop specialisation for shape-only traces (None: general)
        self.tokens = 2 if mode == "round" else 1   # tokens of the verify

    def fields(self) -> tuple:
        """The constructor arguments, in order (host side: the kernel cache key and the generated source)."""
        return (self.layer_types, self.kv_groups, self.tp, self.lnc, self.eps, self.top_k, self.vocab_per_core,
                self.mode, self.max_context)


def _add_into(x, y):
    """Residual update: x (activation dtype) + y (fp32 sum of the partials), rounded once."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, name="residual")
    nisa.tensor_tensor(dst=out, data1=x, data2=y, op=nl.add)
    return out


def _attention(a, s, prefix, xT, pos, cos, sin, core, regs):
    """The rank's attention partial: one attention body per KV-head group, partials added."""
    y = None
    for g in range(s.kv_groups):
        p = prefix + "_g" + str(g) + "_"
        yg = attention_body(xT, a[p + "wqg"], a[p + "wk"], a[p + "wv"], a[p + "wo"], a[p + "norm_w"], cos, sin,
                            a[p + "k"], a[p + "v"], pos, eps=s.eps, core=core, n_cores=s.lnc,
                            max_context=s.max_context, regs=regs["attention"])
        if g == 0:
            y = yg
        else:
            nisa.tensor_tensor(dst=y, data1=y, data2=yg, op=nl.add)
    return y


def _moe(a, s, xT, regs, layer):
    """MoE of trunk layer ``layer`` (its stacked group, ``megakernel.sharded.moe_weights``), or of the MTP
    layer when layer is None."""
    if layer == None:
        router, experts, shared, index = a["mtp_moe_router"], a["mtp_moe_experts"], a["mtp_moe_shared"], None
    else:
        router, experts, shared, index = moe_weights(a, layer)
    return moe_tkg_body(xT, router, experts, shared, s.top_k, prefetch=MOE_PREFETCH, regs=regs["moe"],
                        layer=index, experts_layer=index)


def _trunk_layer(a, s, x, i, rg, regs, pos, cos, sin, core):
    xT = rmsnorm_body(x, a["l" + str(i) + "_in_norm"], s.eps)
    pre = "l" + str(i)
    if s.layer_types[i] == FULL:
        y = _attention(a, s, pre, xT, pos, cos, sin, core, regs)
    else:
        g = pre + "_gdn_"
        y = gdn_body(xT, a[g + "w_in"], a[g + "conv_w"], a[g + "A_log"], a[g + "dt_bias"], a[g + "norm_w"],
                     a[g + "w_out"], a[pre + "_window"], a[pre + "_state"], a["read_slot"], s.eps)
    x = _add_into(x, allreduce_partials(y, rg))
    xT = rmsnorm_body(x, a[pre + "_post_norm"], s.eps)
    return _add_into(x, allreduce_partials(_moe(a, s, xT, regs, i), rg))


def _mtp_layer(a, s, ids, h, rg, regs, pos, cos, sin, core):
    """MTP head up to its final norm: ids SBUF [1, 1] int32 (token p+1), h SBUF [1, H] (trunk hidden
    at p) -> feature-major ``mtp.norm`` output [P, J, 1]. Writes the MTP KV row p."""
    e = embedding_body(a["embed"], ids)
    eT = rmsnorm_body(e, a["mtp_norm_emb"], s.eps)
    hT = rmsnorm_body(h, a["mtp_norm_hidden"], s.eps)
    P, J, _ = eT.shape
    uT = nl.ndarray((P, 2 * J, 1), eT.dtype, buffer=nl.sbuf, name="mtp_fc_in")
    nisa.tensor_copy(dst=uT[:, 0:J, :], src=eT)
    nisa.tensor_copy(dst=uT[:, J:2 * J, :], src=hT)
    fc = allgather_cores(columns_body(uT, a["mtp_fc"][core]), rg, s.tp)
    x = nl.ndarray((1, J * P), e.dtype, buffer=nl.sbuf, name="mtp_x")
    nisa.tensor_copy(dst=x, src=fc)
    xT = rmsnorm_body(x, a["mtp_in_norm"], s.eps)
    x = _add_into(x, allreduce_partials(_attention(a, s, "mtp", xT, pos, cos, sin, core, regs), rg))
    xT = rmsnorm_body(x, a["mtp_post_norm"], s.eps)
    x = _add_into(x, allreduce_partials(_moe(a, s, xT, regs, None), rg))
    return rmsnorm_body(x, a["mtp_norm"], s.eps)


def _greedy(a, s, xT, rg, core):
    """Global argmax over the vocabulary (split over every core): SBUF [T, 2] float32 (value, index)."""
    return argmax_combine(lm_head_argmax_body(xT, a["lm_head"][core]), s.vocab_per_core, rg, s.tp)


def _forced(best, force):
    """Replace the draft index by the host's when force[0] = 1: idx + flag * (token - idx), in fp32
    (exact for token ids < 2^24). No data-dependent branch."""
    f = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf, name="force_f32")
    nisa.tensor_copy(dst=f, src=force)
    d = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf, name="force_delta")
    nisa.tensor_tensor(dst=d, data1=f[:, 1:2], data2=best[:, 1:2], op=nl.subtract)
    nisa.tensor_tensor(dst=d, data1=d, data2=f[:, 0:1], op=nl.multiply)
    out = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf, name="draft_best")
    nisa.tensor_copy(dst=out, src=best)
    nisa.tensor_tensor(dst=out[:, 1:2], data1=best[:, 1:2], data2=d, op=nl.add)
    return out


def _registers(n):
    pool = []
    for _ in range(n):
        pool.append(nisa.register_alloc())
    return tuple(pool)


def _regs():
    """One register pool per launch, reused by every layer's bodies (registers are a per-engine
    resource: 64 per sequencer)."""
    return {"moe": _registers(2 * MOE_PREFETCH), "attention": _registers(ATTENTION_REGISTERS)}


def _draft(a, s, pending, rg, regs, core):
    """D1: the MTP head on (x_{t+1}, h_t) at position p-1 -> draft ids SBUF [1, 1] int32."""
    H = a["embed"].shape[1]
    h_prev = nl.ndarray((1, H), a["embed"].dtype, buffer=nl.sbuf, name="h_prev")
    nisa.dma_copy(dst=h_prev, src=a["hidden"])
    hm = _mtp_layer(a, s, pending, h_prev, rg, regs, a["pos_d1"], a["cos_d1"], a["sin_d1"], core)
    force = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf, name="force")
    nisa.dma_copy(dst=force, src=a["force"])
    return token_ids_from_best(_forced(_greedy(a, s, hm, rg, core), force))


def _verify(a, s, ids, rg, regs, core):
    """V: the trunk on ids SBUF [T, 1] at positions p..p+T-1 -> (targets [T, 1] int32, hidden [T, H])."""
    x = embedding_body(a["embed"], ids)
    for i in range(len(s.layer_types)):
        x = _trunk_layer(a, s, x, i, rg, regs, a["pos"], a["cos_v"], a["sin_v"], core)
    xT = rmsnorm_body(x, a["final_norm"], s.eps)
    return token_ids_from_best(_greedy(a, s, xT, rg, core)), token_major(xT)


def _replay(a, s, draft, h, rg, regs, core):
    """D2: the MTP head on (d, h_{t+1}) at position p: writes its KV row; no LM head."""
    _mtp_layer(a, s, draft, h, rg, regs, a["pos"], a["cos_v"][0:1, :], a["sin_v"][0:1, :], core)


def round_body(s: RoundSpec, a: dict):
    """The whole launch on one core. ``a`` maps argument names to the kernel's HBM tensors."""
    n = nl.num_programs(0) if nl.program_ndim() != 0 else 1
    core = nl.program_id(0) if nl.program_ndim() != 0 else 0
    if n != s.lnc:
        raise ValueError(f"round kernel built for LNC={s.lnc}, launched with {n} cores")
    T = s.tokens
    H = a["embed"].shape[1]
    # outputs first, before any program_id-dependent code (LNC=2 aliases shared-HBM allocations by order)
    targets_out = nl.ndarray((T, 1), nl.int32, buffer=nl.shared_hbm, name="targets")
    hidden_out = nl.ndarray((T, H), a["embed"].dtype, buffer=nl.shared_hbm, name="hidden_out")
    draft_out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm, name="draft")
    rg = tp_group(s.tp)
    regs = _regs()
    pending = load_token_ids(a["pending"])
    if s.mode == "round":
        draft = _draft(a, s, pending, rg, regs, core)
        ids = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf, name="verify_ids")
        nisa.dma_copy(dst=ids[0:1, :], src=pending)
        nisa.dma_copy(dst=ids[1:2, :], src=draft)
    else:
        draft = pending
        ids = pending
    targets, hidden = _verify(a, s, ids, rg, regs, core)
    if s.mode == "round":
        _replay(a, s, draft, hidden[0:1, :], rg, regs, core)
    if core == 0:  # every core holds the same values; one writes them
        nisa.dma_copy(dst=targets_out, src=targets)
        nisa.dma_copy(dst=hidden_out, src=hidden)
        nisa.dma_copy(dst=draft_out, src=draft)
    outputs = [draft_out, targets_out, hidden_out]
    for name in mutated_names(s):
        outputs.append(a[name])
    return tuple(outputs)


def mutated_names(s: RoundSpec) -> list[str]:
    """Decode-state arguments the launch writes in place (returned after the outputs)."""
    out = []
    for i in range(len(s.layer_types)):
        if s.layer_types[i] == FULL:
            for g in range(s.kv_groups):
                out.append("l" + str(i) + "_g" + str(g) + "_k")
                out.append("l" + str(i) + "_g" + str(g) + "_v")
        else:
            out.append("l" + str(i) + "_window")
            out.append("l" + str(i) + "_state")
    if s.mode == "round":
        for g in range(s.kv_groups):
            out.append("mtp_g" + str(g) + "_k")
            out.append("mtp_g" + str(g) + "_v")
    return out


_KERNELS: dict = {}


def build_kernel(spec: RoundSpec, names: list[str]):
    """The @nki.jit round kernel for ``spec`` taking exactly the tensors ``names`` (sorted) as named
    parameters. Generated once per (spec, names), written to a source file and imported."""
    key = (spec.fields(), tuple(names))
    if key in _KERNELS:
        return _KERNELS[key]
    params = ", ".join(names)
    entries = ", ".join(f"{n!r}: {n}" for n in names)
    src = (f'"""Generated by megakernel.round.build_kernel: one named parameter per HBM tensor."""\n'
           f"from megakernel.round import RoundSpec, round_body\n\n\n"
           f"def round_kernel({params}):\n"
           f"    return round_body(RoundSpec{spec.fields()!r}, {{{entries}}})\n")
    digest = hashlib.sha1(src.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / "megakernel_generated" / f"round_{digest}.py"
    path.parent.mkdir(exist_ok=True)
    if not path.exists() or path.read_text() != src:
        path.write_text(src)
    mod_name = f"megakernel_generated_round_{digest}"
    spec_obj = importlib.util.spec_from_file_location(mod_name, path)
    module = importlib.util.module_from_spec(spec_obj)
    sys.modules[mod_name] = module
    spec_obj.loader.exec_module(module)
    kernel = nki.jit(module.round_kernel)
    _KERNELS[key] = kernel
    return kernel


def _shape_dtype(t):
    import nkisim
    names = {"torch.bfloat16": "bfloat16", "torch.float32": "float32", "torch.int32": "int32"}
    return nkisim.ShapeDtype(tuple(t.shape), names[str(t.dtype)])


def demo_args(cfg, tp: int = 4, T: int = 2, dtype: str = "bfloat16", shape_only: bool = True, context: int = 4096,
              lnc: int = 2, shipped: bool = False):
    """(kernel, per-rank keyword arguments) of one full decode round at the config's shapes.

    Shape-only (the only mode at full size: 70 GB of weights are never allocated): the per-rank weight
    shapes come from running the real layout helpers on ``meta`` tensors, the decode state is that of a
    ``context``-token sequence. The integer run-time inputs carry real values (pending token 0, read slot 0,
    no forced draft, ``pos_d1`` = context - 1, ``pos`` = context; a shape-only launch keeps integer inputs'
    data). By default the attention loops are specialised to that context (``max_context``) so the trace
    costs it without any register values; ``shipped=True`` builds the kernel the variants and the NxDI build
    launch (``max_context=None``, runtime loops), whose on-chip computed loop bounds are nkisim's placeholder
    0 unless a register-value provider gives them (``harness.register_models.RoundRegisters``). Launch with
    ``nkisim.launch(kernel, args, tp=len(args), lnc=lnc)``. T must be 2 (the verify of [pending, draft]).
    Used by ``python -m harness.bench predict``.
    """
    import torch

    from megakernel.sharded import kv_groups, rank_state, rank_weights
    from model.params import expected_shapes, is_fp32_param
    from model.state import DecodeState
    from model.tp.embed_head import vocab_per_core
    if T != 2 or not shape_only:
        raise ValueError("megakernel.demo_args: only the shape-only trace of a T=2 round is supported")
    act = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    params = {k: torch.empty(s, dtype=torch.float32 if is_fp32_param(k) else act, device="meta")
              for k, s in expected_shapes(cfg).items()}
    state = DecodeState.empty(cfg, max_len=context + 2, slots=2, dtype=act)
    spec = RoundSpec(tuple(cfg.layer_types), len(kv_groups(cfg, 0, tp)), tp, lnc, float(cfg.rms_norm_eps),
                     cfg.num_experts_per_tok, vocab_per_core(cfg, tp * lnc), "round",
                     max_context=None if shipped else context)
    runtime = {"hidden": ((1, cfg.hidden_size), dtype), "cos_d1": ((1, cfg.rotary_dim), "float32"),
               "sin_d1": ((1, cfg.rotary_dim), "float32"), "cos_v": ((2, cfg.rotary_dim), "float32"),
               "sin_v": ((2, cfg.rotary_dim), "float32")}
    ints = {"pending": [[0]], "read_slot": [[0]], "force": [[0, 0]], "pos_d1": [[context - 1]], "pos": [[context]]}
    import numpy as np

    import nkisim
    per_rank = []
    for r in range(tp):
        tensors = {**rank_weights(cfg, params, r, tp, lnc), **rank_state(cfg, state, r, tp)}
        args = {k: _shape_dtype(v) for k, v in tensors.items()}
        args.update({k: nkisim.ShapeDtype(sh, dt) for k, (sh, dt) in runtime.items()})
        args.update({k: np.array(v, np.int32) for k, v in ints.items()})
        per_rank.append(args)
    return build_kernel(spec, sorted(per_rank[0])), per_rank


STAGE_FUNCTIONS = {"_draft": "D1", "_verify": "V", "_replay": "D2"}


def stage_of(rec: dict) -> str:
    """Stage of a traced instruction (D1 draft, V verify split by layer type, D2 replay) from the kernel
    call stack nkisim records (``stack``: ``file:line:function`` frames, innermost first)."""
    frames = rec.get("stack") or []
    stage = "other"
    for frame in reversed(frames):
        fn = frame.rsplit(":", 1)[-1]
        if fn in STAGE_FUNCTIONS:
            stage = STAGE_FUNCTIONS[fn]
        elif stage == "V" and fn in V_PARTS:
            return "V " + V_PARTS[fn]
    return stage


V_PARTS = {"gdn_body": "GDN", "attention_body": "attention", "moe_tkg_body": "MoE", "lm_head_argmax_body": "LM head",
           "allreduce_partials": "all-reduce", "rmsnorm_body": "norms"}
