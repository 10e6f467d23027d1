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
A :class:`Plan` is a tuple of :class:`Stage` s. A round with K chained drafts (``drafts``, 1..:data:`MAX_DRAFTS`;
DESIGN.md §1 is K = 1), pending token x at position p:

* K ``D1`` stages (kind ``draft``, draft i = 0..K-1 in ``Stage.draft``): the MTP head at position p - 1 + i on
  (x, hidden h_{p-1}) for i = 0, on (d_i, the MTP head's own post-norm hidden of draft i - 1) after that (the
  chain vLLM runs for Qwen MTP with num_speculative_tokens > 1), then LM head and argmax -> draft d_{i+1} (or the
  forced draft of row i of the run-time input ``force``). Drafts i >= 1 write MTP KV rows from the MTP's own
  hiddens; the replay overwrites them;
* ``V`` (kind ``verify``): the trunk on the T = K + 1 tokens [x, d_1 .. d_K] at positions p .. p + K (GDN
  checkpoint slot j = the state after token j, KV rows in place), final norm, LM head and argmax -> the targets
  and the post-norm hiddens;
* ``D2`` (kind ``replay``): the MTP head on the K tokens [d_1 .. d_K] with the trunk's hiddens [h_p .. h_{p+K-1}]
  at positions p .. p + K - 1: its KV rows only, no LM head. The rows of the accepted drafts are then those of
  plain decoding; the rest are overwritten by later rounds (a row is read only by positions at or after it).

The host accepts the longest prefix of drafts equal to the targets (n of them) plus the target after it, n + 1
tokens, and reads GDN checkpoint slot n next (``harness.speculative``).

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

Device-side accept and commit (``Plan.device_commit``, issue 15; opt-in, the host-driven round stays the default)
-----------------------------------------------------------------------------------------------------------------
A device-committed round takes no host-built run-time input but ``force``: it reads the pending token, the read
slot, the position and h_{p-1} from the decode-control state (:func:`control_specs`, written by the previous round
or once by the host after the prefill, :func:`control_state`), takes its RoPE rows from a cos/sin table by
position (:func:`rope_table`, a register offset), accepts on device (n = the leading drafts equal to their
targets) and writes the next round's control state (pending y_n, read slot n, position p + n + 1, hidden h_{p+n})
and :data:`EMITTED` (the n + 1 committed tokens and their count), so rounds launch back to back and the host only
reads tokens.

Sampled device-committed rounds (shared Gumbel noise, ``harness.sampling``). What the host-driven sampled round
draws: every absolute position n has its own pre-scaled noise row fp32(T g_n) [V], a pure function of (seed +
sample, n) (``harness.sampling.GumbelNoise``); the draft and the verify of a position share it (the only role
difference: an FR-Spec draft takes its columns of the draft ids). A round whose pending token sits at p takes rows
p + 1 .. p + K + 1 (verified token j predicts position p + 1 + j, draft i -- 0-based -- the same position as
verified token i): :func:`noise_inputs` of ``noise.scaled(p + 1, K + 1)``. Its accept is the greedy equality test
on the Gumbel-max drafts and targets (the committed tokens are plain Gumbel-max sampling's), so the device's accept
(``megakernel.round.commit``) is unchanged and needs no probability. (The standard rejection rule of the xla variant
would need per draft p(d_i) and q(d_i) -- softmaxes over the whole vocabulary of both heads, a sum-exp collective
each --, a uniform, and on a reject a draw from norm(max(0, p - q)) over both heads' logits kept until the verify:
not built; the kernels sample by the Gumbel scheme.) Only the rows depend on p, which the host of
a device-committed round does not know when it launches. So the round takes them from a **noise window**
(:func:`noise_window_specs`): W entries (W a power of two >= K + 2, :func:`noise_window`), entry ``p & (W - 1)``
(:func:`noise_slot`; a VectorE bitwise and of the control state's position, loaded into a register that offsets
the two noise DMAs, as the RoPE rows) holding exactly the host-driven round's ``noise_v`` / ``noise_d1`` for a
round starting at p (:func:`noise_window_entry`). Same noise bytes into the same LM-head instructions: the tokens
equal the host-driven sampled rounds' bit for bit. The host keeps the window ahead of the device
(``harness.speculative.NoiseBook``): before launching a round it makes sure the entries of every start position
the next two rounds can reach, p .. p + K + 1 (p: the position it has read), are written -- so it may launch one
round before reading the previous one's tokens -- and when p + K + 1 reaches the end of what it wrote it writes
the start positions up to p + W - 1 into the slots of positions below p (never read again): a refresh every few
rounds, at most K + 1 new entries per round on average. A deeper pipeline of D rounds in flight needs W >=
(K + 1) D + 1 and the reach (K + 1) D.

What comes next, as data (not as new copies of the round): a chunked prefill (issue 16) is a plan of ``prefill``
stages over prompt chunks beside :func:`teacher_forced_launches`, today's host-driven prefill through the decode
launches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

import nki.language as nl
from model.config import FULL, ModelConfig
from nki_kernels.moe import layers_per_table

GDN, ATTENTION = "gdn", "attention"
DRAFT, VERIFY, REPLAY = "draft", "verify", "replay"
MAX_DRAFTS = 3              # chained drafts per round: the verify of K + 1 <= 4 tokens is what the kernels take
DEFAULT_DRAFTS = 1
SLOTS = DEFAULT_DRAFTS + 1  # GDN checkpoint slots of the decode state at K drafts: one per verified token, K + 1
MOE_TABLES = 5              # experts tables in the kernels' signatures (Qwen3.6: 41 MoE layers, 10 per table)
MOE_PREFETCH = 8            # expert ring depth of moe_tkg_body; the register pool holds twice that

# The stacked per-rank weights and decode state, in the kernels' parameter order (module docstring).
WEIGHTS = ("embed", "lm_head", "norms", "mtp_fc", "gdn_w_in", "gdn_conv_w", "gdn_A_log", "gdn_dt_bias",
           "gdn_norm_w", "gdn_w_out", "attn_wqg", "attn_wk", "attn_wv", "attn_wo", "attn_norm_w", "moe_router",
           "moe_shared")
EXPERTS = tuple(f"moe_experts_{t}" for t in range(MOE_TABLES))
EXPERT_SCALES = ("moe_scales",)   # the opt-in fp8 experts' scales [M, ...] (a launch's last parameter when given)
DRAFT_VOCAB = ("draft_head", "draft_ids")   # a round's optional FR-Spec draft head and its ids (after the experts)
DRAFT_FP8 = ("draft_head", "draft_scale")   # a round's optional fp8 draft head and its scales (round_kernel's last)
NOISE = ("noise_v", "noise_d1")   # a sampled launch's optional Gumbel noise (:func:`noise_specs`; last parameters)
STATE = ("gdn_window", "gdn_state", "attn_k", "attn_v")
# A device-committed round's decode-control state and RoPE tables (:func:`control_specs`, :func:`rope_table`; the
# last parameters of ``round_kernel``) and its extra output, written after the state: [1, T + 1] int32, column 0
# the committed count c (1 .. K + 1), columns 1 .. c the committed tokens (the rest: the verify's other targets).
# A sampled device-committed round takes ``noise_v`` / ``noise_d1`` as its noise window (:func:`noise_window_specs`)
CONTROL = ("control", "control_hidden")
CONTROL_COLUMNS = ("pending", "read_slot", "pos")   # columns of ``control``
ROPE_TABLES = ("rope_cos", "rope_sin")
EMITTED = "emitted"
# What a round / step launch returns first, before the state it writes (the same for every mode: NxD applies
# the first graph's output packer to every graph, harness/nxdi/assembly.py)
LEADING_OUTPUTS = ("draft", "targets", "hidden")


class NormRows(nl.NKIObject):
    """Rows of the stacked ``norms`` tensor: trunk layer i has ``2i`` (input) and ``2i + 1`` (post-attention),
    then the final norm and the MTP head's five (pre-fc embedding, pre-fc hidden, input, post-attention, final)."""

    def __init__(self, layers: int, mtp: bool):
        self.final = 2 * layers
        self.mtp_emb = 2 * layers + 1
        self.mtp_hidden = 2 * layers + 2
        self.mtp_in = 2 * layers + 3
        self.mtp_post = 2 * layers + 4
        self.mtp_final = 2 * layers + 5
        self.count = 2 * layers + (6 if mtp else 1)


class Layer(nl.NKIObject):
    """One decoder layer as a kernel runs it. ``mixer``: its index among the layers of its kind (GDN: the entry of
    the ``gdn_*`` stacks; attention: KV-head group g of the rank is entry ``mixer * groups + g`` of ``attn_*``).
    ``in_norm`` / ``post_norm``: rows of ``norms``; ``moe``: its index in ``moe_router`` / ``moe_shared``;
    ``experts``: (table, index in the table) of its experts."""

    def __init__(self, name: str, kind: str, mixer: int, groups: int, in_norm: int, post_norm: int, moe: int,
                 experts: tuple):
        self.name = name
        self.kind = kind
        self.mixer = mixer
        self.groups = groups
        self.in_norm = in_norm
        self.post_norm = post_norm
        self.moe = moe
        self.experts = experts


class Stage(nl.NKIObject):
    """One stage of a launch: ``kind`` draft / verify / replay, ``name`` as the round calls it (D1, V, D2; the K
    draft stages share the name D1: one kernel function, the cost model reports them together), ``tokens`` it runs
    on, ``layers`` in order, and which run-time inputs give its positions: ``d1`` (row ``rope_row`` of ``pos_d1``,
    ``cos_d1``, ``sin_d1``) or ``v`` (``pos``, ``cos_v``, ``sin_v``, rows ``rope_row`` ..). ``draft``: the index i
    of a draft stage in the chain (0 for the others)."""

    def __init__(self, name: str, kind: str, tokens: int, layers: tuple, inputs: str, rope_row: int = 0,
                 draft: int = 0):
        self.name = name
        self.kind = kind
        self.tokens = tokens
        self.layers = layers
        self.inputs = inputs
        self.rope_row = rope_row
        self.draft = draft


class Plan(nl.NKIObject):
    """A launch: ``mode`` (round | step), its stages, and the compile-time settings every stage shares.
    ``tokens``: the verify's T; ``drafts``: the draft stages K (0 in a step; T = K + 1 in a round);
    ``draft_vocab_per_core``: rows of the FR-Spec draft head per core (``model.draft_vocab``; 0: the drafts use the
    full LM head); ``device_commit``: a round that accepts and commits on device (module docstring);
    ``draft_fp8``: the drafts' head (the full one or the FR-Spec subset) in fp8 (``nki_kernels.lm_head`` "fp8 draft
    head"; the verify keeps the bf16 head)."""

    def __init__(self, mode: str, stages: tuple, tp: int, lnc: int, eps: float, top_k: int, vocab_per_core: int,
                 norms: NormRows, max_context=None, draft_vocab_per_core: int = 0, device_commit: bool = False,
                 draft_fp8: bool = False):
        self.mode = mode
        self.stages = stages
        self.tp = tp
        self.lnc = lnc
        self.eps = float(eps)
        self.top_k = top_k
        self.vocab_per_core = vocab_per_core
        self.norms = norms
        self.max_context = max_context      # attention loops unrolled for a context (shape-only costing), or None
        self.tokens = stages[len(stages) - 1].tokens if mode == "step" else _verify_tokens(stages)
        self.drafts = _count(stages, DRAFT)
        self.draft_vocab_per_core = draft_vocab_per_core
        self.device_commit = bool(device_commit)
        self.draft_fp8 = bool(draft_fp8)


def _count(stages, kind: str) -> int:
    n = 0
    for s in stages:
        if s.kind == kind:
            n += 1
    return n


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


def check_drafts(drafts: int) -> int:
    """K in 1..:data:`MAX_DRAFTS` (a ValueError naming the range otherwise)."""
    if isinstance(drafts, bool) or not isinstance(drafts, int) or not 1 <= drafts <= MAX_DRAFTS:
        raise ValueError(f"plan: the number of draft tokens must be in 1..{MAX_DRAFTS}, found {drafts!r}")
    return drafts


def draft_vocab_per_core(cfg: ModelConfig, draft_vocab: int, n_cores: int) -> int:
    """Rows of the draft head per core for a draft vocabulary of ``draft_vocab`` ids (0: off)."""
    if draft_vocab == 0:
        return 0
    if not 0 < draft_vocab <= cfg.vocab_size or draft_vocab % n_cores:
        raise ValueError(f"plan: a draft vocabulary of {draft_vocab} ids must be in [1, {cfg.vocab_size}] and split "
                         f"evenly over {n_cores} cores")
    return draft_vocab // n_cores


def draft_weights(plan: Plan) -> tuple:
    """The names of the drafts' own head weights a round takes (``DRAFT_VOCAB`` / ``DRAFT_FP8``; () when the drafts
    use the verify's LM head)."""
    names = DRAFT_VOCAB if plan.draft_vocab_per_core else ()
    if plan.draft_fp8:
        names += tuple(n for n in DRAFT_FP8 if n not in names)
    return names


def _plan(cfg: ModelConfig, mode: str, tp: int, lnc: int, max_context, drafts: int, draft_vocab: int = 0,
          device_commit: bool = False, draft_fp8: bool = False) -> Plan:
    if mode not in ("round", "step"):
        raise ValueError(f"plan: mode must be 'round' or 'step', got {mode!r}")
    if device_commit and mode != "round":
        raise ValueError("plan: device-side commit is a round's (a step has no drafts to accept)")
    if draft_fp8 and mode != "round":
        raise ValueError("plan: an fp8 draft head is a round's (a step has no drafts)")
    check_drafts(drafts)
    experts_tables(cfg, tp, lnc)
    trunk = _trunk(cfg, kv_groups(cfg, tp), experts_per_table(cfg, tp, lnc))
    mtp = bool(cfg.mtp_num_hidden_layers)
    if mode == "round":
        if not mtp:
            raise ValueError("plan: a speculative round needs the MTP head (the checkpoint has none)")
        head = (mtp_layer(cfg, tp, lnc),)
        chain = tuple(Stage("D1", DRAFT, 1, head, "d1", rope_row=i, draft=i) for i in range(drafts))
        stages = chain + (Stage("V", VERIFY, drafts + 1, trunk, "v"), Stage("D2", REPLAY, drafts, head, "v"))
    else:
        stages = (Stage("V", VERIFY, 1, trunk, "v"),)
    return Plan(mode, stages, tp, lnc, cfg.rms_norm_eps, cfg.num_experts_per_tok, vocab_per_core(cfg, tp * lnc),
                NormRows(cfg.num_hidden_layers, mtp), max_context,
                draft_vocab_per_core(cfg, draft_vocab, tp * lnc) if mode == "round" else 0, device_commit, draft_fp8)


def round_plan(cfg: ModelConfig, tp: int = 4, lnc: int = 2, max_context=None, drafts: int = DEFAULT_DRAFTS,
               draft_vocab: int = 0, device_commit: bool = False, draft_fp8: bool = False) -> Plan:
    """The speculative round: ``drafts`` (K) chained D1 stages + V (K + 1 tokens) + D2 (K tokens).
    ``max_context`` (shape-only costing only) unrolls the attention loops for that context; the shipped kernel
    has None. ``draft_vocab``: ids of the FR-Spec draft vocabulary (0: the drafts use the full LM head).
    ``device_commit``: the round accepts and commits on device (module docstring). ``draft_fp8``: the drafts' head in
    fp8 (:class:`Plan`)."""
    return _plan(cfg, "round", tp, lnc, max_context, drafts, draft_vocab, device_commit, draft_fp8)


def step_plan(cfg: ModelConfig, tp: int = 4, lnc: int = 2, max_context=None) -> Plan:
    """A plain decode step: V on the pending token."""
    return _plan(cfg, "step", tp, lnc, max_context, DEFAULT_DRAFTS)


def plan_for(cfg: ModelConfig, mode: str, tp: int = 4, lnc: int = 2, max_context=None,
             drafts: int = DEFAULT_DRAFTS, draft_vocab: int = 0, device_commit: bool = False,
             draft_fp8: bool = False) -> Plan:
    return _plan(cfg, mode, tp, lnc, max_context, drafts, draft_vocab, device_commit, draft_fp8)


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


def input_specs(cfg: ModelConfig, mode: str, drafts: int = DEFAULT_DRAFTS, device_commit: bool = False) -> tuple:
    """The run-time inputs of a launch, in order (the step's are a prefix of the round's): ``pending`` token id,
    ``read_slot`` (GDN checkpoint slot to read), ``pos`` (position of the pending token) int32 [1, 1]; ``cos_v``,
    ``sin_v`` float32 [T, rotary] (RoPE rows of positions pos .. pos+T-1, T = K + 1 in a round); round only:
    ``hidden`` [1, H] (h_{p-1}, post final norm), ``force`` int32 [K, 2], row i = (1, token) to impose draft i or
    (0, 0), ``pos_d1`` int32 [K, 1] (the draft stages' positions pos - 1 .. pos + K - 2) and their RoPE rows
    ``cos_d1``, ``sin_d1`` [K, rotary]. A device-committed round (``device_commit``) takes ``force`` only (the rest
    comes from its decode-control state, :func:`control_specs`)."""
    if mode not in ("round", "step"):
        raise ValueError(f"input_specs: mode must be 'round' or 'step', got {mode!r}")
    K, R = check_drafts(drafts), cfg.rotary_dim
    if device_commit:
        if mode != "round":
            raise ValueError("input_specs: device-side commit is a round's")
        return (TensorSpec("force", (K, 2), "int32"),)
    T = K + 1 if mode == "round" else 1
    out = [TensorSpec("pending", (1, 1), "int32"), TensorSpec("read_slot", (1, 1), "int32"),
           TensorSpec("pos", (1, 1), "int32"), TensorSpec("cos_v", (T, R), "float32"),
           TensorSpec("sin_v", (T, R), "float32")]
    if mode == "round":
        out += [TensorSpec("hidden", (1, cfg.hidden_size), "activation"), TensorSpec("force", (K, 2), "int32"),
                TensorSpec("pos_d1", (K, 1), "int32"), TensorSpec("cos_d1", (K, R), "float32"),
                TensorSpec("sin_d1", (K, R), "float32")]
    return tuple(out)


def input_names(mode: str, device_commit: bool = False) -> tuple:
    """Names of :func:`input_specs` (shapes need no config)."""
    if device_commit:
        return ("force",)
    base = ("pending", "read_slot", "pos", "cos_v", "sin_v")
    return base + (("hidden", "force", "pos_d1", "cos_d1", "sin_d1") if mode == "round" else ())


def noise_specs(cfg: ModelConfig, mode: str, tp: int = 4, lnc: int = 2, drafts: int = DEFAULT_DRAFTS,
                draft_vocab: int = 0) -> tuple:
    """The optional inputs of a sampled launch (``harness.sampling``: Gumbel-max with noise shared by position,
    pre-scaled by the temperature), per rank, in the lm-head kernel's vocab-on-partitions layout
    (``nki_kernels.lm_head.noise_layout``): ``noise_v`` float32 [lnc, P, Cp*T] for the T verified tokens (the
    step's one) over each core's LM-head rows, and, in a round, ``noise_d1`` float32 [lnc, K, P, Cpd] (draft i's
    over the rows of the head it uses: the LM head, or the FR-Spec draft head of ``draft_vocab`` ids). Built by
    :func:`noise_inputs`."""
    from nki_kernels.common import P
    from nki_kernels.lm_head import scan_geometry
    K = check_drafts(drafts)
    T = K + 1 if mode == "round" else 1
    vc = vocab_per_core(cfg, tp * lnc)
    out = [TensorSpec("noise_v", (lnc, P, scan_geometry(vc, T)[1] * T), "float32")]
    if mode == "round":
        vd = draft_vocab_per_core(cfg, draft_vocab, tp * lnc) or vc
        out.append(TensorSpec("noise_d1", (lnc, K, P, scan_geometry(vd, 1)[1]), "float32"))
    return tuple(out)


def noise_inputs(mode: str, noise, rank: int, tp: int, lnc: int, drafts: int = DEFAULT_DRAFTS,
                 draft_ids=None) -> dict:
    """Rank ``rank``'s :func:`noise_specs` tensors from ``noise`` float32 [T, V] (row j: the pre-scaled Gumbel noise
    T * g_n of the token the launch's j-th verified token predicts; a round's draft i predicts the same position as
    its verified token i, so draft i uses row i -- restricted to ``draft_ids`` with an FR-Spec draft vocabulary)."""
    import torch

    from nki_kernels.host import as_torch
    from nki_kernels.lm_head import rank_noise_layout
    g = as_torch(noise).float()
    K = check_drafts(drafts)
    T = K + 1 if mode == "round" else 1
    if g.ndim != 2 or g.shape[0] != T or g.shape[1] % (tp * lnc):
        raise ValueError(f"{mode}: noise {list(g.shape)} is not [{T}, V] with V split over {tp * lnc} cores")
    vc = g.shape[1] // (tp * lnc)
    lo, hi = rank * lnc * vc, (rank + 1) * lnc * vc
    out = {"noise_v": rank_noise_layout(g[:, lo:hi], lnc)}
    if mode == "round":
        d = g[:K] if draft_ids is None else g[:K, torch.as_tensor(np.asarray(draft_ids, dtype=np.int64))]
        vd = d.shape[1] // (tp * lnc)
        part = d[:, rank * lnc * vd:(rank + 1) * lnc * vd]
        out["noise_d1"] = torch.stack([rank_noise_layout(part[i:i + 1], lnc) for i in range(K)],
                                      dim=1).contiguous()
    return out


def noise_window(drafts: int = DEFAULT_DRAFTS) -> int:
    """Entries W of a sampled device-committed round's noise window by default: the smallest power of two >= 4 (K +
    1) (a refresh every ~2 (K + 1) positions or more; module docstring)."""
    w = 1
    while w < 4 * (check_drafts(drafts) + 1):
        w *= 2
    return w


def check_noise_window(window: int, drafts: int = DEFAULT_DRAFTS) -> int:
    """W: a power of two (the slot is a bitwise and: the hardware has no integer mod) >= K + 2 (the entries of the
    next two rounds' start positions, module docstring)."""
    K = check_drafts(drafts)
    if isinstance(window, bool) or not isinstance(window, int) or window < K + 2 or window & (window - 1):
        raise ValueError(f"plan: the noise window must be a power of two >= K + 2 = {K + 2} entries, found {window!r}")
    return window


def noise_slot(pos: int, window: int) -> int:
    """The window entry of a round whose pending token sits at ``pos``: pos & (W - 1) (= pos mod W)."""
    return int(pos) & (window - 1)


def noise_window_specs(cfg: ModelConfig, tp: int = 4, lnc: int = 2, drafts: int = DEFAULT_DRAFTS,
                       draft_vocab: int = 0, window: int | None = None) -> tuple:
    """A sampled device-committed round's noise window, per rank (module docstring): ``noise_v`` float32 [lnc, W,
    P, Cp*T] and ``noise_d1`` float32 [lnc, W, K, P, Cpd] -- :func:`noise_specs`' round tensors with an entry axis W
    after the core axis (entry :func:`noise_slot`)."""
    W = check_noise_window(noise_window(drafts) if window is None else window, drafts)
    out = []
    for s in noise_specs(cfg, "round", tp, lnc, drafts, draft_vocab):
        shape = (s.shape[0], W) + s.shape[1:]
        if int(np.prod(shape)) > 2 ** 31 - 1:
            raise ValueError(f"plan: a noise window {list(shape)} has element offsets beyond int32; use fewer entries")
        out.append(TensorSpec(s.name, shape, s.dtype))
    return tuple(out)


def noise_window_entry(noise, start: int, rank: int, tp: int, lnc: int, drafts: int = DEFAULT_DRAFTS,
                       draft_ids=None) -> dict:
    """Rank ``rank``'s window entry for a round whose pending token sits at ``start``: {noise_v [lnc, P, Cp*T],
    noise_d1 [lnc, K, P, Cpd]}, the host-driven round's :func:`noise_inputs` of rows start + 1 .. start + K + 1 of
    ``noise`` (a ``harness.sampling.GumbelNoise``)."""
    K = check_drafts(drafts)
    return noise_inputs("round", noise.scaled(start + 1, K + 1), rank, tp, lnc, K, draft_ids)


def _i32(*values: int) -> np.ndarray:
    return np.array([values], dtype=np.int32)


def _check_token(cfg: ModelConfig, token: int, what: str):
    if not 0 <= int(token) < cfg.vocab_size:
        raise ValueError(f"{what}: token id {token} is outside the vocabulary [0, {cfg.vocab_size})")


def rope_rows(cfg: ModelConfig, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rotary_dim] float32 of positions start..start+T-1 (``nki_kernels.attention.rope_tables``)."""
    from nki_kernels.attention import rope_tables
    return rope_tables(start, T, cfg.rotary_dim, cfg.rope_theta)


def forced_drafts(forced, drafts: int) -> tuple:
    """The forced drafts of a round as a tuple: None (none), one token id (draft 1) or a sequence of at most K ids
    (drafts 1 .. len; the rest come from the MTP head)."""
    if forced is None:
        return ()
    out = (int(forced),) if isinstance(forced, (int, np.integer)) else tuple(int(f) for f in forced)
    if len(out) > drafts:
        raise ValueError(f"round: {len(out)} forced drafts for a round of {drafts} drafts")
    return out


def _round_start(cfg: ModelConfig, dtype, pending: int, hidden, pos: int, read_slot: int, K: int, what: str):
    """Check where a round starts (pending token at ``pos`` >= 1, ``read_slot`` in 0..K) -> h_{pos-1} as [1, H]
    ``dtype`` (a ValueError naming ``what`` otherwise)."""
    from nki_kernels.host import as_torch
    if pos < 1:
        raise ValueError(f"{what}: the pending token's position must be >= 1 (the draft runs at pos-1), found {pos}")
    if read_slot not in range(K + 1):
        raise ValueError(f"{what}: read_slot must be in 0..{K}, found {read_slot}")
    _check_token(cfg, pending, f"{what} pending")
    h = as_torch(hidden).reshape(1, -1).to(dtype)
    if h.shape[1] != cfg.hidden_size:
        raise ValueError(f"{what}: hidden has {h.shape[1]} features, hidden_size is {cfg.hidden_size}")
    return h


def round_inputs(cfg: ModelConfig, dtype, pending: int, hidden, pos: int, read_slot: int,
                 forced_draft=None, drafts: int = DEFAULT_DRAFTS) -> dict:
    """The run-time inputs of one round of ``drafts`` (K) chained drafts (:func:`input_specs`), pending token at
    position ``pos`` >= 1, hidden h_{pos-1} (torch or numpy, converted to ``dtype``), ``read_slot`` in 0..K,
    ``forced_draft`` imposing the first drafts (tests, teacher-forced prefill; :func:`forced_drafts`) or None."""
    import torch

    K = check_drafts(drafts)
    h = _round_start(cfg, dtype, pending, hidden, pos, read_slot, K, "round")
    force = force_input(cfg, forced_draft, K)
    cos_d1, sin_d1 = rope_rows(cfg, pos - 1, K)
    cos_v, sin_v = rope_rows(cfg, pos, K + 1)
    out = {"pending": _i32(pending), "read_slot": _i32(read_slot), "pos": _i32(pos), "cos_v": cos_v, "sin_v": sin_v,
           "hidden": h.contiguous() if isinstance(h, torch.Tensor) else h, "force": force,
           "pos_d1": np.arange(pos - 1, pos - 1 + K, dtype=np.int32).reshape(K, 1), "cos_d1": cos_d1,
           "sin_d1": sin_d1}
    return out


def force_input(cfg: ModelConfig, forced_draft=None, drafts: int = DEFAULT_DRAFTS) -> np.ndarray:
    """``force`` int32 [K, 2]: row i = (1, token) imposing draft i + 1 (:func:`forced_drafts`), else (0, 0)."""
    K = check_drafts(drafts)
    force = np.zeros((K, 2), np.int32)
    for i, f in enumerate(forced_drafts(forced_draft, K)):
        _check_token(cfg, f, "round forced draft")
        force[i] = (1, f)
    return force


def control_specs(cfg: ModelConfig, lnc: int = 2, drafts: int = DEFAULT_DRAFTS) -> tuple:
    """A device-committed round's decode-control state, per rank, one entry per core (each core reads and writes its
    own: no cross-core hazard; the cores hold the same values): ``control`` int32 [lnc, 3] (columns
    :data:`CONTROL_COLUMNS`: the pending token id, the GDN checkpoint slot to read, the pending token's position)
    and ``control_hidden`` [lnc, K + 1, H] (activation dtype: the previous verify's post-norm hiddens; row
    ``read_slot`` is h_{pos-1}, the trunk's hidden before the pending token -- the round writes all K + 1 rows
    right after its verify and the next one picks its row by the read slot, as the GDN state)."""
    return (TensorSpec("control", (lnc, len(CONTROL_COLUMNS)), "int32"),
            TensorSpec("control_hidden", (lnc, check_drafts(drafts) + 1, cfg.hidden_size), "activation"))


def control_state(cfg: ModelConfig, dtype, pending: int, hidden, pos: int, read_slot: int, lnc: int = 2,
                  drafts: int = DEFAULT_DRAFTS) -> dict:
    """The :func:`control_specs` tensors of a sequence whose pending token ``pending`` sits at ``pos`` >= 1 with
    hidden h_{pos-1} and checkpoint slot ``read_slot`` (what the host writes once after the prefill; the rounds
    write it after that)."""
    K = check_drafts(drafts)
    h = _round_start(cfg, dtype, pending, hidden, pos, read_slot, K, "control")
    return {"control": np.tile(_i32(pending, read_slot, pos), (lnc, 1)),
            "control_hidden": h.expand(lnc, K + 1, -1).contiguous()}


def rope_table(cfg: ModelConfig, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """``rope_cos``, ``rope_sin`` float32 [rows, rotary_dim] of positions 0 .. rows - 1 (:func:`rope_rows`): a
    device-committed round reads rows pos - 1 .. pos + K (``rows`` > the largest position a sequence reaches)."""
    return rope_rows(cfg, 0, rows)


def step_inputs(cfg: ModelConfig, token: int, pos: int, read_slot: int, slots: int = SLOTS) -> dict:
    """The run-time inputs of one plain decode step (:func:`input_specs`): token at position ``pos``, reading
    checkpoint slot ``read_slot`` of a state with ``slots`` slots."""
    if pos < 0:
        raise ValueError(f"step: position must be >= 0, found {pos}")
    if read_slot not in range(slots):
        raise ValueError(f"step: read_slot must be in 0..{slots - 1}, found {read_slot}")
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
    (activation dtype; A = attention layers incl. the MTP layer x KV-head groups, L = :func:`cache_length`).
    ``slots``: K + 1 for rounds of K drafts (one per verified token)."""
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
    forced: int | None   # prompt index of the first forced draft (None: none; unforced drafts are not committed)
    accepted: int        # tokens of this launch committed (1 .. K + 1): drafts prompt[forced : forced+accepted-1]


def teacher_forced_launches(n: int, drafts: int = DEFAULT_DRAFTS) -> tuple:
    """The launches that feed an n-token prompt through the decode launches (for an engine without a prefill
    path, e.g. the NxDI application), with rounds of K = ``drafts`` drafts: a step at position 0 on x_0 (nothing
    precedes it for the MTP head), then rounds at p = 1, 1 + (K+1), ... with the drafts forced to x_{p+1} ..
    x_{p+m} (m = min(K, n-1-p)) and those m + 1 tokens committed; the round's first D1 writes the MTP KV row p-1,
    its verify the trunk state of x_p .. x_{p+m}, its D2 the MTP rows p .. p+m-1 -- exactly the rows a prefill
    writes. 1 + ceil((n-1)/(K+1)) launches."""
    if n < 1:
        raise ValueError("prefill: the prompt is empty")
    K = check_drafts(drafts)
    out = [PrefillLaunch("step", 0, None, 1)]
    for p in range(1, n, K + 1):
        m = min(K, n - 1 - p)
        out.append(PrefillLaunch("round", p, p + 1 if m else None, m + 1))
    return tuple(out)
