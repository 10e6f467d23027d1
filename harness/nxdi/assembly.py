"""Everything the NxDI adapter needs that is plain logic: names, shapes, dtypes and order of the round
kernel's per-rank arguments, the run-time inputs of a launch, the per-rank weights of each backend, each
rank's pre-sharded checkpoint, which state buffers each graph takes and aliases, the reset graph, and NxD's
shape-only routing. Tested on CPU (tests/harness/test_nxdi.py); the trn2-only module
``harness.nxdi.modeling`` only wires these into NxDI. Line numbers cite aws-neuron/neuronx-distributed-inference
0.9.0 and aws-neuron/neuronx-distributed 0.18.0 (harness/nxdi/README.md "Sources").

Vocabulary used below
---------------------
backend
    ``"megakernel"`` -- token generation is ONE launch of ``megakernel.round`` per rank per round;
    weights in the kernels' HBM layouts (``megakernel.sharded.rank_weights``).
    ``"xla"`` -- the same round as plain traceable PyTorch (``harness.nxdi.xla_math``); weights in
    PyTorch layout, sharded like the model/tp twins.
mode / graph
    ``"round"`` (D1 draft + 2-token verify + D2 replay), ``"step"`` (plain decode of one token) --
    the two modes of ``megakernel.round.RoundSpec`` -- and ``"reset"`` (zero every decode-state buffer
    before a new sequence; a tiny graph of its own, :func:`reset_outputs`).
per-rank tensor
    Rank r's tensor of a flat name (``l3_g0_wqg``, ``l5_window``, ...). The NxDI module registers one
    parameter per name WITH THE PER-RANK SHAPE, and rank r's checkpoint file holds rank r's tensor
    (:func:`rank_checkpoint`), written once by ``harness.nxdi.convert``; NxD's own sharding is not used.

Decode state uses the kernels' per-rank layout (``megakernel.sharded`` docstring) for BOTH backends:
``l{i}_window`` [slots, K-1, C_rank] (activation dtype), ``l{i}_state`` [slots, Hv_rank, Dk, Dv] float32,
``l{i}_g{g}_k`` / ``_v`` and ``mtp_g{g}_k`` / ``_v`` [1, L, D] with L = ``cache_length(max_len)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from megakernel.round import RUNTIME_INPUTS, RoundSpec, mutated_names
from megakernel.sharded import cache_length, kv_groups
from model.config import LINEAR, ModelConfig
from model.tp.embed_head import vocab_per_core
from model.tp.gdn import GdnDims
from nki_kernels.attention import rope_tables
from nki_kernels.host import as_torch

BACKENDS = ("xla", "megakernel")
MODES = ("round", "step")
SLOTS = 2  # GDN checkpoint slots: one per verified token of a round

# The graphs of the application, in the order they are registered with NxD. The FIRST registered graph
# is special in NxD's (legacy) ModelBuilder, which NxDI 0.9 uses: its outputs define the output packer
# applied to EVERY graph's outputs and its aliased parameters are the only decode state the state
# initializer creates on the device (neuronx-distributed src/neuronx_distributed/trace/model_builder.py
# lines 1002-1022, 1034-1051, 1086 at 0.18.0). The round graph aliases every state buffer, so it goes first.
GRAPHS = ("round", "step", "reset")

# The positional inputs of each graph's traced forward. NxD's NxDModel routes a call to a graph by the
# SHAPES of the inputs alone (trace/spmd.py lines 215-219; the shape map is built in model_builder.py
# lines 1076-1084), so every graph's input shapes must differ (check_routes); names play no part.
GRAPH_INPUTS = {
    "round": ("pending", "read_slot", "pos", "cos_v", "sin_v", "hidden", "force", "pos_d1", "cos_d1", "sin_d1"),
    "step": ("pending", "read_slot", "pos", "cos_v", "sin_v"),
    "reset": ("keep",),
}
# What every graph returns first, before the state buffers it aliases: the first graph's packer is
# applied to all graphs' non-aliased outputs (above), so all graphs return these three, in this order.
LEADING_OUTPUTS = ("draft", "targets", "hidden")

WEIGHTS_PREFIX = "weights."   # nn.ParameterDict holding the per-rank weights
STATES_PREFIX = "states."     # nn.ParameterDict holding the per-rank decode state
RANK_UTIL = "rank_util.rank"  # NeuronBaseModel's SPMDRank parameter: rank r's checkpoint holds [r]


class AssemblyError(ValueError):
    """Arguments that do not match what a graph or kernel expects (the message says which)."""


# --------------------------------------------------------------------------------------------------
# Small host-side conversions
# --------------------------------------------------------------------------------------------------
def i32(*values: int) -> np.ndarray:
    """A [1, len(values)] int32 run-time input (token ids, positions, slot, force flag)."""
    return np.array([values], dtype=np.int32)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise AssemblyError(f"unknown dtype name {name!r}")
    return d


# --------------------------------------------------------------------------------------------------
# Specs of the round kernel
# --------------------------------------------------------------------------------------------------
def round_spec(cfg: ModelConfig, tp: int, lnc: int, mode: str) -> RoundSpec:
    """The compile-time constants of the round kernel (also used by the xla backend for layer types,
    KV-head groups per rank and the mode)."""
    if mode not in MODES:
        raise AssemblyError(f"mode must be one of {MODES}, found {mode!r}")
    return RoundSpec(tuple(cfg.layer_types), len(kv_groups(cfg, 0, tp)), tp, lnc, float(cfg.rms_norm_eps),
                     cfg.num_experts_per_tok, vocab_per_core(cfg, tp * lnc), mode)


def check_sharding(cfg: ModelConfig, tp: int, lnc: int) -> None:
    """Raise AssemblyError if cfg does not shard over tp ranks x lnc cores (every constraint the
    twins and kernels impose, checked up front with one message)."""
    try:
        kv_groups(cfg, 0, tp)
        GdnDims.of(cfg, tp)
        vocab_per_core(cfg, tp * lnc)
        for size, what in ((cfg.moe_intermediate_size, "moe_intermediate_size"),
                           (cfg.shared_expert_intermediate_size, "shared_expert_intermediate_size")):
            if size % (tp * lnc):
                raise ValueError(f"{what}={size} does not split over {tp * lnc} cores")
        if cfg.hidden_size % (tp * lnc):
            raise ValueError(f"hidden_size={cfg.hidden_size} does not split over {tp * lnc} cores (MTP fc)")
    except ValueError as e:
        raise AssemblyError(f"config does not shard over tp={tp} x lnc={lnc}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Per-rank weights, state, and each rank's checkpoint
# --------------------------------------------------------------------------------------------------
def rank_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], backend: str, rank: int, tp: int, lnc: int
                 ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights for ``backend`` as contiguous torch tensors, flat names.

    megakernel: ``megakernel.sharded.rank_weights`` (the kernels' HBM layouts, converted once here);
    xla: ``harness.nxdi.xla_math.rank_weights`` (PyTorch layouts of the model/tp twins)."""
    if backend == "megakernel":
        from megakernel.sharded import rank_weights as kernel_rank_weights
        w = kernel_rank_weights(cfg, params, rank, tp, lnc)
    elif backend == "xla":
        from harness.nxdi.xla_math import rank_weights as xla_rank_weights
        w = xla_rank_weights(cfg, params, rank, tp)
    else:
        raise AssemblyError(f"backend must be one of {BACKENDS}, found {backend!r}")
    return {k: as_torch(v).contiguous() for k, v in w.items()}


def state_specs(cfg: ModelConfig, tp: int, max_len: int, dtype: torch.dtype, slots: int = SLOTS
                ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (per-rank shape, dtype) of every decode-state buffer; the same on every rank and equal to
    ``megakernel.sharded.rank_state`` of an empty ``DecodeState`` (tested)."""
    dims = GdnDims.of(cfg, tp)
    length = cache_length(max_len)
    out: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for i, kind in enumerate(cfg.layer_types):
        if kind == LINEAR:
            out[f"l{i}_window"] = ((slots, cfg.conv_window, dims.conv_dim), dtype)
            out[f"l{i}_state"] = ((slots, dims.hv, dims.dk, dims.dv), torch.float32)
    caches = [f"l{i}" for i in cfg.full_layers] + (["mtp"] if cfg.mtp_num_hidden_layers else [])
    for name in caches:
        for g in range(len(kv_groups(cfg, 0, tp))):
            out[f"{name}_g{g}_k"] = ((1, length, cfg.head_dim), dtype)
            out[f"{name}_g{g}_v"] = ((1, length, cfg.head_dim), dtype)
    return out


def zero_states(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict[str, torch.Tensor]:
    """Fresh zero tensors for ``state_specs`` (the state a sequence starts from)."""
    return {k: torch.zeros(shape, dtype=dt) for k, (shape, dt) in specs.items()}


def rank_checkpoint(weights: dict[str, torch.Tensor], rank: int) -> dict[str, torch.Tensor]:
    """What rank ``rank``'s pre-sharded checkpoint file holds: ``weights.<name>`` = the rank's tensor (per-rank
    shape, the shape the module registers) and ``rank_util.rank`` = [rank] int32 (the slice of arange(tp) that
    NxD's sharding would give NeuronBaseModel's ``SPMDRank``, neuronx-distributed
    ``src/neuronx_distributed/parallel_layers/layers.py`` lines 1543-1566).

    NxDI's ``load_weights`` reads exactly these files, ``weights/tp{rank}_sharded_checkpoint.safetensors``,
    when ``save_sharded_checkpoint`` is set (``models/application_base.py`` lines 389-399 at 0.9.0).
    Why we write them ourselves: NxD shards a checkpoint only for parameters of its parallel layer types
    (``trace/trace.py`` ``__SUPPORTED_SHARDED_MODULES`` lines 49-59, checked in ``shard_children`` line 752);
    our ``nn.ParameterDict`` is not one of them, so NxD would copy every full tensor into every rank's file."""
    out = {WEIGHTS_PREFIX + k: v.contiguous() for k, v in weights.items()}
    out[RANK_UTIL] = torch.tensor([rank], dtype=torch.int32)
    return out


def tensor_specs(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (shape, dtype)."""
    return {k: (tuple(v.shape), v.dtype) for k, v in tensors.items()}


def specs_to_json(specs: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> dict:
    return {k: {"shape": list(s), "dtype": dtype_name(d)} for k, (s, d) in specs.items()}


def specs_from_json(d: dict) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    try:
        return {k: (tuple(int(x) for x in v["shape"]), dtype_of(v["dtype"])) for k, v in d.items()}
    except (KeyError, TypeError) as e:
        raise AssemblyError(f"parameter specs: expected {{name: {{shape, dtype}}}}, found an entry without {e}") from None


# --------------------------------------------------------------------------------------------------
# Kernel arguments
# --------------------------------------------------------------------------------------------------
def kernel_arg_names(weight_names, state_names, mode: str) -> list[str]:
    """The round kernel's parameters for ``mode``, in the order ``megakernel.round.build_kernel`` declares
    them: every weight, the graph's state buffers (:func:`graph_states`) and the mode's run-time inputs,
    sorted by name."""
    runtime = RUNTIME_INPUTS[mode]
    groups = [("weight", list(weight_names)), ("state", list(state_names)), ("run-time input", list(runtime))]
    seen: dict[str, str] = {}
    for what, names in groups:
        for n in names:
            if n in seen:
                raise AssemblyError(f"kernel argument {n!r} is both a {seen[n]} and a {what}")
            seen[n] = what
    return sorted(seen)


def kernel_kwargs(names: list[str], weights: dict, states: dict, runtime: dict) -> dict:
    """The keyword arguments of one rank's launch: exactly ``names``, each from the one source that has it.
    Missing or unexpected names are an error naming them (a kernel built for other tensors)."""
    sources = {**weights, **states, **runtime}
    if len(sources) != len(weights) + len(states) + len(runtime):
        dup = sorted((set(weights) & set(states)) | (set(weights) | set(states)) & set(runtime))
        raise AssemblyError(f"kernel arguments given twice: {dup[:8]}")
    missing = [n for n in names if n not in sources]
    extra = sorted(set(sources) - set(names))
    if missing or extra:
        raise AssemblyError(f"kernel arguments do not match the kernel: missing {missing[:8]}"
                            f"{' ...' if len(missing) > 8 else ''}, unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return {n: sources[n] for n in names}


def output_names(spec: RoundSpec) -> list[str]:
    """What a round/step graph returns, in order: draft [1, 1] int32, targets [T, 1] int32, hidden [T, H]
    (activation dtype), then the state buffers the launch writes (``megakernel.round.mutated_names``)."""
    return [*LEADING_OUTPUTS, *mutated_names(spec)]


def graph_states(mode: str, spec: RoundSpec | None, state_names) -> list[str]:
    """The decode-state buffers a graph takes, in output order: exactly those it overwrites (and aliases).

    round / step: ``megakernel.round.mutated_names(spec)`` (a step does not take the MTP KV caches);
    reset: every buffer. A graph must not take a state it does not alias: NxD treats a non-aliased
    parameter as a WEIGHT, to be loaded from the checkpoint, where no state is."""
    names = list(state_names)
    if mode == "reset":
        return names
    want = mutated_names(spec)
    missing = sorted(set(want) - set(names))
    if missing:
        raise AssemblyError(f"{mode}: the graph writes state buffers that do not exist: {missing[:8]}")
    return want


def state_aliases(spec: RoundSpec) -> dict[str, int]:
    """State buffer name -> index of the round/step graph output that is its new value (NxD input/output
    aliasing: the buffer is updated in place on the device, nothing goes back to the host)."""
    return {n: i for i, n in enumerate(output_names(spec)) if i >= len(LEADING_OUTPUTS)}


def reset_aliases(state_names) -> dict[str, int]:
    """The reset graph returns the leading outputs then every state buffer, in the given order."""
    return {n: len(LEADING_OUTPUTS) + i for i, n in enumerate(state_names)}


def check_graph_states(mode: str, taken, aliased, expected) -> None:
    """Raise unless the state buffers a graph takes (registers, passes to the kernel), the ones it aliases
    and the ones it overwrites are the same set."""
    taken, aliased, expected = set(taken), set(aliased), set(expected)
    if not taken == aliased == expected:
        raise AssemblyError(f"{mode}: state buffers taken {sorted(taken ^ expected)[:6]} / aliased "
                            f"{sorted(aliased ^ expected)[:6]} differ from those the graph overwrites")


def reset_outputs(keep: torch.Tensor, states: dict[str, torch.Tensor], hidden_size: int, dtype: torch.dtype
                  ) -> list[torch.Tensor]:
    """The reset graph (traceable): leading outputs (zeros of the step graph's shapes) then each state buffer
    as ``where(keep != 0, state, 0)``; the host passes keep = 0, so every buffer becomes zero.

    keep: int32 [1, 1]. Why not ``torch.zeros_like(state)``: that never READS the state, so the lowered graph
    has no parameter for it and the alias has nothing to attach to -- the device buffer would keep its old
    contents (torch-neuronx's tracer looks each aliased tensor up among the lowered graph's parameters: an
    older ``xla_impl/hlo_conversion.py`` ``xla_trace``, harness/nxdi/README.md open risk 3). ``where`` with a
    run-time ``keep`` reads the buffer and overwrites all of it whatever it held (NaN included)."""
    flag = keep.reshape(1, 1)
    out = [flag * 0, flag * 0, (flag.to(dtype) * 0).expand(1, hidden_size).contiguous()]
    for t in states.values():
        out.append(torch.where(flag.reshape([1] * t.dim()) != 0, t, torch.zeros_like(t)))
    return out


# --------------------------------------------------------------------------------------------------
# Run-time inputs
# --------------------------------------------------------------------------------------------------
def graph_inputs(mode: str) -> tuple[str, ...]:
    """The positional inputs of a graph's traced forward (:data:`GRAPH_INPUTS`)."""
    if mode not in GRAPH_INPUTS:
        raise AssemblyError(f"graph must be one of {GRAPHS}, found {mode!r}")
    names = GRAPH_INPUTS[mode]
    if mode != "reset" and set(names) != set(RUNTIME_INPUTS[mode]):
        raise AssemblyError(f"{mode}: graph inputs {names} differ from the kernel's {RUNTIME_INPUTS[mode]}")
    return names


def named_inputs(mode: str, inputs) -> dict:
    """A graph's positional inputs as {name: tensor}; the count must match."""
    names = graph_inputs(mode)
    if len(inputs) != len(names):
        raise AssemblyError(f"{mode}: the graph takes {len(names)} inputs {names}, got {len(inputs)}")
    return dict(zip(names, inputs))


def route_key(tensors) -> tuple[tuple[int, ...], ...]:
    """The key NxD's NxDModel routes a call by: the list of input shapes (trace/spmd.py ``router``)."""
    return tuple(tuple(t.shape) for t in tensors)


def check_routes(examples: dict) -> None:
    """Raise if two graphs' example inputs have the same shapes: NxD keys its routing table by shapes only,
    so the graph registered later would silently receive the other graph's calls."""
    seen: dict = {}
    for mode, ex in examples.items():
        key = route_key(ex)
        if key in seen:
            raise AssemblyError(f"graphs {seen[key]!r} and {mode!r} take inputs of the same shapes {list(key)}: "
                                f"NxD routes by shapes only and could not tell them apart")
        seen[key] = mode


def rope_rows(cfg: ModelConfig, start: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [T, rotary_dim] float32 of positions start..start+T-1 (``nki_kernels.attention.rope_tables``)."""
    return rope_tables(start, T, cfg.rotary_dim, cfg.rope_theta)


def _check_token(cfg: ModelConfig, token: int, what: str):
    if not 0 <= int(token) < cfg.vocab_size:
        raise AssemblyError(f"{what}: token id {token} is outside the vocabulary [0, {cfg.vocab_size})")


def round_inputs(cfg: ModelConfig, dtype: torch.dtype, pending: int, hidden: torch.Tensor, pos: int, read_slot: int,
                 forced_draft: int | None = None) -> dict:
    """Run-time inputs of one round (``RUNTIME_INPUTS["round"]``), pending token at position ``pos``.

    pending/read_slot/pos/pos_d1 int32 [1, 1]; force int32 [1, 2] = (1, token) to impose the draft, else
    (0, 0); hidden [1, H] in ``dtype`` (h_{pos-1}, post final norm); cos_d1/sin_d1 [1, R] float32 at pos-1
    (the D1 draft), cos_v/sin_v [2, R] at pos, pos+1 (verify; D2 uses row 0)."""
    if pos < 1:
        raise AssemblyError(f"round: the pending token's position must be >= 1 (the draft runs at pos-1), found {pos}")
    if read_slot not in range(SLOTS):
        raise AssemblyError(f"round: read_slot must be in 0..{SLOTS - 1}, found {read_slot}")
    _check_token(cfg, pending, "round pending")
    if forced_draft is not None:
        _check_token(cfg, forced_draft, "round forced draft")
    h = as_torch(hidden).reshape(1, -1).to(dtype)
    if h.shape[1] != cfg.hidden_size:
        raise AssemblyError(f"round: hidden has {h.shape[1]} features, hidden_size is {cfg.hidden_size}")
    cos_d1, sin_d1 = rope_rows(cfg, pos - 1, 1)
    cos_v, sin_v = rope_rows(cfg, pos, 2)
    out = {"pending": i32(pending), "hidden": h, "read_slot": i32(read_slot),
           "force": i32(0 if forced_draft is None else 1, 0 if forced_draft is None else forced_draft),
           "pos_d1": i32(pos - 1), "pos": i32(pos), "cos_d1": cos_d1, "sin_d1": sin_d1, "cos_v": cos_v,
           "sin_v": sin_v}
    assert set(out) == set(RUNTIME_INPUTS["round"])
    return out


def step_inputs(cfg: ModelConfig, token: int, pos: int, read_slot: int) -> dict:
    """Run-time inputs of one plain decode step (``RUNTIME_INPUTS["step"]``): token at position ``pos``."""
    if pos < 0:
        raise AssemblyError(f"step: position must be >= 0, found {pos}")
    if read_slot not in range(SLOTS):
        raise AssemblyError(f"step: read_slot must be in 0..{SLOTS - 1}, found {read_slot}")
    _check_token(cfg, token, "step token")
    cos, sin = rope_rows(cfg, pos, 1)
    out = {"pending": i32(token), "read_slot": i32(read_slot), "pos": i32(pos), "cos_v": cos, "sin_v": sin}
    assert set(out) == set(RUNTIME_INPUTS["step"])
    return out


def reset_inputs() -> dict:
    """Run-time inputs of the reset graph: keep = 0 (every state buffer becomes zero)."""
    return {"keep": i32(0)}


def runtime_example(cfg: ModelConfig, mode: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero tensors with the exact shapes and dtypes of a graph's run-time inputs (the example inputs the
    graph is traced with, and NxD's routing key)."""
    T = 2 if mode == "round" else 1
    r = cfg.rotary_dim
    shapes = {"pending": ((1, 1), torch.int32), "read_slot": ((1, 1), torch.int32), "pos": ((1, 1), torch.int32),
              "cos_v": ((T, r), torch.float32), "sin_v": ((T, r), torch.float32),
              "hidden": ((1, cfg.hidden_size), dtype), "force": ((1, 2), torch.int32),
              "pos_d1": ((1, 1), torch.int32), "cos_d1": ((1, r), torch.float32), "sin_d1": ((1, r), torch.float32),
              "keep": ((1, 1), torch.int32)}
    return {n: torch.zeros(shapes[n][0], dtype=shapes[n][1]) for n in graph_inputs(mode)}


def ordered_inputs(mode: str, runtime: dict) -> tuple[torch.Tensor, ...]:
    """A graph's run-time inputs as torch tensors in the traced forward's positional order."""
    names = graph_inputs(mode)
    if set(runtime) != set(names):
        raise AssemblyError(f"{mode}: run-time inputs {sorted(runtime)} do not match {sorted(names)}")
    return tuple(as_torch(runtime[n]) for n in names)


@dataclass(frozen=True)
class LaunchResult:
    """What the host reads back from a round/step launch."""

    draft: int            # the draft (round; forced draft if forced) or the pending token (step)
    targets: list[int]    # greedy token after each verified token (2 for a round, 1 for a step)
    hidden: torch.Tensor  # [T, H] post-final-norm trunk hidden of the verified tokens


def read_outputs(draft, targets, hidden) -> LaunchResult:
    return LaunchResult(int(as_torch(draft).reshape(-1)[0]), [int(t) for t in as_torch(targets).reshape(-1)],
                        as_torch(hidden))
