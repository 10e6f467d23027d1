"""A decode launch as data: the one description of a round (and of a plain step) that every executor walks.

Built from a ``ModelConfig`` (plus the sharding: ``tp`` ranks x ``lnc`` cores) by :func:`round_plan` /
:func:`step_plan`. Who walks it:

* the round and step megakernels (``megakernel.round``: ``round_kernel`` / ``step_kernel`` take the plan as their
  compile-time first argument and run its stages on one core),
* the layerwise variant (``harness.engines.LayerwiseEngine``: one stage kernel launch per layer step),
* the xla variant and the NxDI xla backend (``harness.xla.forward``: the ``model.tp`` twins, one rank),
* the cost model (``harness.costmodel``: stage and layer tags of a traced round, :func:`stage_functions`).

What a plan says
----------------
A :class:`Plan` is a tuple of :class:`Stage` s. A round (DESIGN.md §1), pending token x at position p:

* ``D1`` (kind ``draft``): the MTP head on (x, hidden h_{p-1}) at position p - 1, then LM head and argmax
  -> the draft d (or the forced draft of the run-time input ``force``);
* ``V`` (kind ``verify``): the trunk on [x, d] at positions p, p + 1 (GDN checkpoints per token, KV rows in
  place), final norm, LM head and argmax -> the targets and the post-norm hiddens;
* ``D2`` (kind ``replay``): the MTP head on (d, h_p) at position p: its KV row only, no LM head.

A step is one ``V`` stage on the pending token. Each stage lists its :class:`Layer` s in order; a layer says its
kind (GDN or attention), its index in the stacked tensors of that kind, the norm rows it applies and where its MoE
lives. After every mixer and every MoE the partials are all-reduced over the TP x LNC cores (the one collective
pattern of a layer; the MTP fc output is all-gathered, the argmax combined).

Stacked tensors (one rank; :data:`WEIGHTS`, :data:`STATE`; built by ``megakernel.sharded``)
---------------------------------------------------------------------------------------
Per-layer tensors are stacked by layer kind, so a kernel takes a fixed, small set of HBM tensors whatever the
depth: ``norms`` [N, P, H/P] (rows: :class:`NormRows`), the GDN layers' ``gdn_*`` [G, ...], the attention layers'
``attn_*`` [A, ...] (the trunk's full-attention layers, then the MTP layer; one entry per KV-head group of the
rank), the MoE layers' ``moe_router`` / ``moe_shared`` [M, ...] (trunk layers, then the MTP layer) and their
experts tables ``moe_experts_<t>`` [per_table, ...] (layer m in table m // per_table: as many layers as keep every
element offset within int32, at most :data:`MOE_TABLES` tables). Decode state: ``gdn_window``, ``gdn_state`` [G,
slots, ...], ``attn_k``, ``attn_v`` [A, L, D].

Run-time inputs: :func:`input_specs` is their one definition (names, shapes, dtypes, order).

What comes next, as data (not as new copies of the round): K chained drafts (issue 17) are K ``draft`` stages and
a verify of T = K + 1 tokens; device-side accept (issue 15) moves inputs of :func:`input_specs` into the decode
state; a chunked prefill (issue 16) is a plan of ``prefill`` stages over prompt chunks beside
:func:`teacher_forced_launches`, today's host-driven prefill through the decode launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import nki.language as nl
from model.config import FULL, ModelConfig
from nki_kernels.moe import layers_per_table

GDN, ATTENTION = "gdn", "attention"
DRAFT, VERIFY, REPLAY = "draft", "verify", "replay"
SLOTS = 2                   # GDN checkpoint slots of the decode state: one per verified token of a round
MOE_TABLES = 5              # experts tables in the kernels' signatures (Qwen3.6: 41 MoE layers, 10 per table)
MOE_PREFETCH = 8            # expert ring depth of moe_tkg_body; the register pool holds twice that

# The stacked per-rank weights and decode state, in the kernels' parameter order (module docstring).
WEIGHTS = ("embed", "lm_head", "norms", "mtp_fc", "gdn_w_in", "gdn_conv_w", "gdn_A_log", "gdn_dt_bias",
           "gdn_norm_w", "gdn_w_out", "attn_wqg", "attn_wk", "attn_wv", "attn_wo", "attn_norm_w", "moe_router",
           "moe_shared")
EXPERTS = tuple(f"moe_experts_{t}" for t in range(MOE_TABLES))
STATE = ("gdn_window", "gdn_state", "attn_k", "attn_v")
# What a round / step launch returns first, before the state it writes (the same for every mode: NxD applies
# the first graph's output packer to every graph, harness/nxdi/assembly.py)
LEADING_OUTPUTS = ("draft", "targets", "hidden")


class NormRows(nl.NKIObject):
    """Rows of the stacked ``norms`` tensor: trunk layer i has ``2i`` (input) and ``2i + 1`` (post-attention),
    then the final norm and the MTP head's five (pre-fc embedding, pre-fc hidden, input, post-attention, final)."""

    def __init__(self, layers: int, mtp: bool):
        self.final = 2 * layers
        self.mtp_emb, self.mtp_hidden = 2 * layers + 1, 2 * layers + 2
        self.mtp_in, self.mtp_post, self.mtp_final = 2 * layers + 3, 2 * layers + 4, 2 * layers + 5
        self.count = 2 * layers + (6 if mtp else 1)


class Layer(nl.NKIObject):
    """One decoder layer as a kernel runs it. ``mixer``: its index among the layers of its kind (GDN: the entry of
    the ``gdn_*`` stacks; attention: KV-head group g of the rank is entry ``mixer * groups + g`` of ``attn_*``).
    ``in_norm`` / ``post_norm``: rows of ``norms``; ``moe``: its index in ``moe_router`` / ``moe_shared``;
    ``experts``: (table, index in the table) of its experts."""

    def __init__(self, name: str, kind: str, mixer: int, groups: int, in_norm: int, post_norm: int, moe: int,
                 experts: tuple):
        self.name, self.kind, self.mixer, self.groups = name, kind, mixer, groups
        self.in_norm, self.post_norm, self.moe, self.experts = in_norm, post_norm, moe, experts


class Stage(nl.NKIObject):
    """One stage of a launch: ``kind`` draft / verify / replay, ``name`` as the round calls it (D1, V, D2),
    ``tokens`` it runs on, ``layers`` in order, and which run-time inputs give its positions: ``d1`` (``pos_d1``,
    ``cos_d1``, ``sin_d1``) or ``v`` (``pos``, ``cos_v``, ``sin_v``, rows ``rope_row`` ..)."""

    def __init__(self, name: str, kind: str, tokens: int, layers: tuple, inputs: str, rope_row: int = 0):
        self.name, self.kind, self.tokens, self.layers = name, kind, tokens, layers
        self.inputs, self.rope_row = inputs, rope_row


class Plan(nl.NKIObject):
    """A launch: ``mode`` (round | step), its stages, and the compile-time settings every stage shares."""

    def __init__(self, mode: str, stages: tuple, tp: int, lnc: int, eps: float, top_k: int, vocab_per_core: int,
                 norms: NormRows, max_context=None):
        self.mode, self.stages = mode, stages
        self.tp, self.lnc, self.eps, self.top_k, self.vocab_per_core = tp, lnc, float(eps), top_k, vocab_per_core
        self.norms = norms
        self.max_context = max_context      # attention loops unrolled for a context (shape-only costing), or None
        self.tokens = stages[len(stages) - 1].tokens if mode == "step" else _verify_tokens(stages)


def _verify_tokens(stages) -> int:
    for s in stages:
        if s.kind == VERIFY:
            return s.tokens
    raise ValueError("plan: a round needs a verify stage")


# ---- sharding facts the plan needs ------------------------------------------------------------------------
def kv_groups(cfg: ModelConfig, tp: int) -> int:
    """KV heads per rank (one attention body call each): 1 when ranks share a KV head (Qwen3.6 at TP=4)."""
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1 or hq % tp:
        raise ValueError(f"plan: tp={tp} does not divide num_attention_heads={hq}")
    hq_r, group = hq // tp, hq // hkv
    if hq_r % group and group % hq_r:
        raise ValueError(f"plan: {hq_r} query heads per rank straddle KV groups of {group} heads")
    return max(1, hq_r // group)


def vocab_per_core(cfg: ModelConfig, n_cores: int) -> int:
    """LM-head rows per core; the vocabulary splits evenly over all TP x LNC cores (248320 = 8 x 31040)."""
    if n_cores < 1 or cfg.vocab_size % n_cores:
        raise ValueError(f"plan: vocab_size {cfg.vocab_size} does not split evenly over {n_cores} cores")
    return cfg.vocab_size // n_cores


def moe_layers(cfg: ModelConfig) -> int:
    """MoE layers: every trunk layer, then the MTP layer."""
    return cfg.num_hidden_layers + (1 if cfg.mtp_num_hidden_layers else 0)


def experts_per_table(cfg: ModelConfig, tp: int, lnc: int) -> int:
    """MoE layers per stacked experts table: as many as keep its element offsets within int32 (10 for Qwen3.6
    at TP=4 x LNC=2: 201M elements per layer), capped by the MoE layer count. A layer's table on one rank holds
    gate, up and down of every expert on the rank's intermediate slice: E * 3 * H * I / tp elements (the size of
    ``nki_kernels.moe.expert_blocks``' [E, lnc, P, F], whatever the block layout)."""
    inter = cfg.moe_intermediate_size
    if inter % tp:
        raise ValueError(f"plan: moe_intermediate_size={inter} does not split over tp={tp} ranks")
    elems = cfg.num_experts * 3 * cfg.hidden_size * (inter // tp)
    return min(layers_per_table(elems), moe_layers(cfg))


def experts_tables(cfg: ModelConfig, tp: int, lnc: int) -> int:
    """Stacked experts tables in use (at most :data:`MOE_TABLES`, the kernels' signature)."""
    per = experts_per_table(cfg, tp, lnc)
    n = -(-moe_layers(cfg) // per)
    if n > MOE_TABLES:
        raise ValueError(f"plan: {moe_layers(cfg)} MoE layers need {n} experts tables of {per} layers; the kernels "
                         f"take at most {MOE_TABLES}")
    return n


# ---- plans ---------------------------------------------------------------------------------------------------
def _trunk(cfg: ModelConfig, groups: int, per_table: int) -> tuple:
    layers, g, a = [], 0, 0
    for i, kind in enumerate(cfg.layer_types):
        if kind == FULL:
            layer = Layer(f"L{i}", ATTENTION, a, groups, 2 * i, 2 * i + 1, i, divmod(i, per_table))
            a += 1
        else:
            layer = Layer(f"L{i}", GDN, g, 1, 2 * i, 2 * i + 1, i, divmod(i, per_table))
            g += 1
        layers.append(layer)
    return tuple(layers)


def mtp_layer(cfg: ModelConfig, tp: int, lnc: int) -> Layer:
    """The MTP head's decoder layer (full attention + MoE): the last entry of the attention and MoE stacks."""
    groups, m = kv_groups(cfg, tp), cfg.num_hidden_layers
    rows = NormRows(cfg.num_hidden_layers, True)
    return Layer("MTP", ATTENTION, len(cfg.full_layers), groups, rows.mtp_in, rows.mtp_post, m,
                 divmod(m, experts_per_table(cfg, tp, lnc)))


def _plan(cfg: ModelConfig, mode: str, tp: int, lnc: int, max_context) -> Plan:
    if mode not in ("round", "step"):
        raise ValueError(f"plan: mode must be 'round' or 'step', got {mode!r}")
    experts_tables(cfg, tp, lnc)
    trunk = _trunk(cfg, kv_groups(cfg, tp), experts_per_table(cfg, tp, lnc))
    mtp = bool(cfg.mtp_num_hidden_layers)
    if mode == "round":
        if not mtp:
            raise ValueError("plan: a speculative round needs the MTP head (the checkpoint has none)")
        head = (mtp_layer(cfg, tp, lnc),)
        stages = (Stage("D1", DRAFT, 1, head, "d1"), Stage("V", VERIFY, 2, trunk, "v"),
                  Stage("D2", REPLAY, 1, head, "v", rope_row=0))
    else:
        stages = (Stage("V", VERIFY, 1, trunk, "v"),)
    return Plan(mode, stages, tp, lnc, cfg.rms_norm_eps, cfg.num_experts_per_tok, vocab_per_core(cfg, tp * lnc),
                NormRows(cfg.num_hidden_layers, mtp), max_context)


def round_plan(cfg: ModelConfig, tp: int = 4, lnc: int = 2, max_context=None) -> Plan:
    """The speculative round D1 + V (2 tokens) + D2. ``max_context`` (shape-only costing only) unrolls the
    attention loops for that context; the shipped kernel has None."""
    return _plan(cfg, "round", tp, lnc, max_context)


def step_plan(cfg: ModelConfig, tp: int = 4, lnc: int = 2, max_context=None) -> Plan:
    """A plain decode step: V on the pending token."""
    return _plan(cfg, "step", tp, lnc, max_context)


def plan_for(cfg: ModelConfig, mode: str, tp: int = 4, lnc: int = 2, max_context=None) -> Plan:
    return _plan(cfg, mode, tp, lnc, max_context)


def stage_functions(plan: Plan) -> dict:
    """{kernel function name: stage name} of the plan: ``megakernel.round`` runs a stage of kind k in the function
    named k (the cost model tags traced instructions by their kernel call stack)."""
    out = {}
    for s in plan.stages:
        out[s.kind] = s.name
    return out


# ---- run-time inputs and decode state: names, shapes, dtypes ----------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    """A per-rank tensor: name, shape, dtype name ("int32", "float32", or "activation": the model's dtype)."""
    name: str
    shape: tuple
    dtype: str


def kernel_weights(mode: str) -> tuple:
    """The stacked weights a ``mode`` launch takes, in parameter order (a step runs no MTP head: no ``mtp_fc``);
    the experts tables (:data:`EXPERTS`) follow the run-time inputs."""
    return WEIGHTS if mode == "round" else tuple(n for n in WEIGHTS if n != "mtp_fc")


def input_specs(cfg: ModelConfig, mode: str) -> tuple:
    """The run-time inputs of a launch, in order (the step's are a prefix of the round's): ``pending`` token id,
    ``read_slot`` (GDN checkpoint slot to read), ``pos`` (position of the pending token) int32 [1, 1]; ``cos_v``,
    ``sin_v`` float32 [T, rotary] (RoPE rows of positions pos .. pos+T-1); round only: ``hidden`` [1, H] (h_{p-1},
    post final norm), ``force`` int32 [1, 2] = (1, token) to impose the draft or (0, 0), ``pos_d1`` = pos - 1 and its
    RoPE row ``cos_d1``, ``sin_d1`` [1, rotary]."""
    if mode not in ("round", "step"):
        raise ValueError(f"input_specs: mode must be 'round' or 'step', got {mode!r}")
    T, R = (2 if mode == "round" else 1), cfg.rotary_dim
    out = [TensorSpec("pending", (1, 1), "int32"), TensorSpec("read_slot", (1, 1), "int32"),
           TensorSpec("pos", (1, 1), "int32"), TensorSpec("cos_v", (T, R), "float32"),
           TensorSpec("sin_v", (T, R), "float32")]
    if mode == "round":
        out += [TensorSpec("hidden", (1, cfg.hidden_size), "activation"), TensorSpec("force", (1, 2), "int32"),
                TensorSpec("pos_d1", (1, 1), "int32"), TensorSpec("cos_d1", (1, R), "float32"),
                TensorSpec("sin_d1", (1, R), "float32")]
    return tuple(out)


def input_names(mode: str) -> tuple:
    """Names of :func:`input_specs` (shapes need no config)."""
    base = ("pending", "read_slot", "pos", "cos_v", "sin_v")
    return base + (("hidden", "force", "pos_d1", "cos_d1", "sin_d1") if mode == "round" else ())


def _i32(*values: int) -> np.ndarray:
    return np.array([values], dtype=np.int32)


def _check_token(cfg: ModelConfig, token: int, what: str):
    if not 0 <= int(token) < cfg.vocab_size:
        raise ValueError(f"{what}: token id {token} is outside the vocabulary [0, {cfg.vocab_size})")


def rope_rows(cfg: ModelConfig, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rotary_dim] float32 of positions start..start+T-1 (``nki_kernels.attention.rope_tables``)."""
    from nki_kernels.attention import rope_tables
    return rope_tables(start, T, cfg.rotary_dim, cfg.rope_theta)


def round_inputs(cfg: ModelConfig, dtype, pending: int, hidden, pos: int, read_slot: int,
                 forced_draft: int | None = None) -> dict:
    """The run-time inputs of one round (:func:`input_specs`), pending token at position ``pos`` >= 1, hidden
    h_{pos-1} (torch or numpy, converted to ``dtype``), ``forced_draft`` imposing the draft (tests, teacher-forced
    prefill) or None."""
    import torch

    from nki_kernels.host import as_torch
    if pos < 1:
        raise ValueError(f"round: the pending token's position must be >= 1 (the draft runs at pos-1), found {pos}")
    if read_slot not in range(SLOTS):
        raise ValueError(f"round: read_slot must be in 0..{SLOTS - 1}, found {read_slot}")
    _check_token(cfg, pending, "round pending")
    if forced_draft is not None:
        _check_token(cfg, forced_draft, "round forced draft")
    h = as_torch(hidden).reshape(1, -1).to(dtype)
    if h.shape[1] != cfg.hidden_size:
        raise ValueError(f"round: hidden has {h.shape[1]} features, hidden_size is {cfg.hidden_size}")
    cos_d1, sin_d1 = rope_rows(cfg, pos - 1, 1)
    cos_v, sin_v = rope_rows(cfg, pos, 2)
    force = _i32(0, 0) if forced_draft is None else _i32(1, forced_draft)
    out = {"pending": _i32(pending), "read_slot": _i32(read_slot), "pos": _i32(pos), "cos_v": cos_v, "sin_v": sin_v,
           "hidden": h.contiguous() if isinstance(h, torch.Tensor) else h, "force": force, "pos_d1": _i32(pos - 1),
           "cos_d1": cos_d1, "sin_d1": sin_d1}
    return out


def step_inputs(cfg: ModelConfig, token: int, pos: int, read_slot: int) -> dict:
    """The run-time inputs of one plain decode step (:func:`input_specs`): token at position ``pos``."""
    if pos < 0:
        raise ValueError(f"step: position must be >= 0, found {pos}")
    if read_slot not in range(SLOTS):
        raise ValueError(f"step: read_slot must be in 0..{SLOTS - 1}, found {read_slot}")
    _check_token(cfg, token, "step token")
    cos, sin = rope_rows(cfg, pos, 1)
    return {"pending": _i32(token), "read_slot": _i32(read_slot), "pos": _i32(pos), "cos_v": cos, "sin_v": sin}


def cache_length(max_len: int) -> int:
    """KV cache rows the attention kernel needs: at least one KV tile per core of an LNC=2 rank (the head tiles of
    a rank read rows 0 .. 2 * KV_TILE - 1, ``nki_kernels.attention``)."""
    from nki_kernels.attention import KV_TILE
    return max(max_len, 2 * KV_TILE)


def state_specs(cfg: ModelConfig, tp: int, max_len: int, slots: int = SLOTS) -> tuple:
    """The stacked per-rank decode state (the same on every rank): ``gdn_window`` [G, slots, K-1, C_rank]
    (activation dtype), ``gdn_state`` [G, slots, Hv_rank, Dk, Dv] float32, ``attn_k``, ``attn_v`` [A, L, D]
    (activation dtype; A = attention layers incl. the MTP layer x KV-head groups, L = :func:`cache_length`)."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    if hk % tp or hv % tp:
        raise ValueError(f"plan: tp={tp} does not divide the {hk} GDN key heads and {hv} value heads")
    c_rank = 2 * (hk // tp) * cfg.linear_key_head_dim + (hv // tp) * cfg.linear_value_head_dim
    G = len(cfg.linear_layers)
    A = (len(cfg.full_layers) + (1 if cfg.mtp_num_hidden_layers else 0)) * kv_groups(cfg, tp)
    L = cache_length(max_len)
    return (TensorSpec("gdn_window", (G, slots, cfg.conv_window, c_rank), "activation"),
            TensorSpec("gdn_state", (G, slots, hv // tp, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                       "float32"),
            TensorSpec("attn_k", (A, L, cfg.head_dim), "activation"),
            TensorSpec("attn_v", (A, L, cfg.head_dim), "activation"))


# ---- the host-driven prefill through the decode launches ------------------------------------------------------
@dataclass(frozen=True)
class PrefillLaunch:
    """One launch of the teacher-forced prefill (indices are prompt positions)."""
    mode: str            # "step" or "round"
    pos: int             # position of the pending token (= its prompt index)
    forced: int | None   # prompt index of the forced draft (None: not forced; the draft is not committed)
    accepted: int        # tokens of this launch committed (1 or 2)


def teacher_forced_launches(n: int) -> tuple:
    """The launches that feed an n-token prompt through the decode launches (for an engine without a prefill
    path, e.g. the NxDI application): a step at position 0 on x_0 (nothing precedes it for the MTP head), then
    rounds at p = 1, 3, 5, ... with the draft forced to x_{p+1} and both tokens committed; the round's D1 writes
    the MTP KV row p-1, its verify the trunk state of x_p, x_{p+1}, its D2 the MTP row p -- exactly the rows a
    prefill writes. A left-over last token (n even) gets a round that commits only it. 1 + ceil((n-1)/2)
    launches."""
    if n < 1:
        raise ValueError("prefill: the prompt is empty")
    out = [PrefillLaunch("step", 0, None, 1)]
    for p in range(1, n, 2):
        out.append(PrefillLaunch("round", p, p + 1, 2) if p + 1 < n else PrefillLaunch("round", p, None, 1))
    return tuple(out)
