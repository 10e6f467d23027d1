"""Everything the NxDI adapter needs that is plain logic: which tensors each graph takes (the shipped kernels'
parameters, the per-rank weights of each backend, each rank's pre-sharded checkpoint), which state buffers each
graph takes and aliases, the reset graph, the graphs' positional inputs and NxD's shape-only routing. Names,
shapes and order come from the launch plan (``megakernel.plan``): nothing here re-types them. Tested on CPU
(tests/harness/test_nxdi.py); the trn2-only module ``harness.nxdi.modeling`` only wires these into NxDI. Line
numbers cite aws-neuron/neuronx-distributed-inference 0.9.0 and aws-neuron/neuronx-distributed 0.18.0
(harness/nxdi/README.md "Sources").

Vocabulary used below
---------------------
backend
    ``"megakernel"`` -- token generation is ONE launch of ``megakernel.round`` (``round_kernel`` /
    ``step_kernel``) per rank per round; weights in the kernels' stacked HBM layouts
    (``megakernel.sharded.rank_weights``).
    ``"xla"`` -- the same plan as plain traceable PyTorch (``harness.xla.forward``); weights in PyTorch layout,
    stacked the same way (``harness.xla.rank_weights``).
mode / graph
    ``"round"`` (K chained D1 drafts + a verify of K + 1 tokens + a K-token D2 replay), ``"step"`` (plain decode
    of one token) -- the two launch plans of ``megakernel.plan`` -- and ``"reset"`` (zero every decode-state
    buffer before a new sequence; a tiny graph of its own, :func:`reset_outputs`).
drafts (K)
    Chained MTP drafts per round, 1..``megakernel.plan.MAX_DRAFTS``, fixed when converting (``nxdi.json``): it
    fixes the round graph's inputs (``force`` [K, 2], ``pos_d1`` / ``cos_d1`` / ``sin_d1`` [K, ...], ``cos_v`` /
    ``sin_v`` [K + 1, ...]), its outputs (drafts [K, 1], targets [K + 1, 1], hidden [K + 1, H]) and the K + 1 GDN
    checkpoint slots of the decode state that every graph shares (:func:`state_slots`).
per-rank tensor
    Rank r's tensor of a name (``attn_wqg``, ``gdn_window``, ...). The NxDI module registers one parameter per
    name WITH THE PER-RANK SHAPE, and rank r's checkpoint file holds rank r's tensor (:func:`rank_checkpoint`),
    written once by ``harness.nxdi.convert``; NxD's own sharding is not used.

Decode state uses the kernels' stacked per-rank layout (``megakernel.plan.state_specs``) for BOTH backends.
"""

from __future__ import annotations

import inspect

import torch

from harness.nxdi import context
from megakernel import plan as rp
from model.config import ModelConfig
from nki_kernels.host import as_torch

BACKENDS = ("xla", "megakernel")
MODES = ("round", "step")

# The graphs of the application, in the order they are registered with NxD. The FIRST registered graph
# is special in NxD's (legacy) ModelBuilder, which NxDI 0.9 uses: its outputs define the output packer
# applied to EVERY graph's outputs and its aliased parameters are the only decode state the state
# initializer creates on the device (neuronx-distributed src/neuronx_distributed/trace/model_builder.py
# lines 1002-1022, 1034-1051, 1086 at 0.18.0). The round graph aliases every state buffer, so it goes first.
GRAPHS = ("round", "step", "reset")
# Context-encoding graphs (``harness.nxdi.context``: one per chunk-length bucket C, mode "context_C") go between
# the step and the reset graph (:func:`graph_order`): never first, since they take the same states as the round
# but the round's outputs must give the packer.

# The positional inputs of each graph's traced forward: the plan's run-time inputs (``plan.input_specs``; the
# step's are a prefix of the round's). NxD's NxDModel routes a call to a graph by the SHAPES of the inputs alone
# (trace/spmd.py lines 215-219; the shape map is built in model_builder.py lines 1076-1084), so every graph's input
# shapes must differ (check_routes); names play no part.
GRAPH_INPUTS = {"round": rp.input_names("round"), "step": rp.input_names("step"), "reset": ("keep",)}
# What every graph returns first, before the state buffers it aliases: the first graph's packer is
# applied to all graphs' non-aliased outputs (above), so all graphs return these three, in this order.
LEADING_OUTPUTS = rp.LEADING_OUTPUTS

WEIGHTS_PREFIX = "weights."   # nn.ParameterDict holding the per-rank weights
STATES_PREFIX = "states."     # nn.ParameterDict holding the per-rank decode state
RANK_UTIL = "rank_util.rank"  # NeuronBaseModel's SPMDRank parameter: rank r's checkpoint holds [r]


class AssemblyError(ValueError):
    """Arguments that do not match what a graph or kernel expects (the message says which)."""


# --------------------------------------------------------------------------------------------------
# Small host-side conversions
# --------------------------------------------------------------------------------------------------
def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    d = getattr(torch, name, None)
    if not isinstance(d, torch.dtype):
        raise AssemblyError(f"unknown dtype name {name!r}")
    return d


# --------------------------------------------------------------------------------------------------
# Plans and kernels
# --------------------------------------------------------------------------------------------------
def check_drafts(drafts) -> int:
    """K, the chained drafts per round, in 1..``megakernel.plan.MAX_DRAFTS`` (AssemblyError otherwise)."""
    try:
        return rp.check_drafts(drafts)
    except ValueError:
        raise AssemblyError(f"the number of draft tokens must be in 1..{rp.MAX_DRAFTS}, found {drafts!r}") from None


def state_slots(drafts: int) -> int:
    """GDN checkpoint slots of the decode state for rounds of K drafts: one per token the round's verify runs
    (the round plan's ``tokens``, K + 1)."""
    return check_drafts(drafts) + 1


def launch_plan(cfg: ModelConfig, tp: int, lnc: int, mode: str, drafts: int = rp.DEFAULT_DRAFTS) -> rp.Plan:
    """The plan a round / step graph runs (``megakernel.plan``; the kernels' compile-time first argument); a round
    of ``drafts`` (K) chained drafts."""
    if mode not in MODES:
        raise AssemblyError(f"mode must be one of {MODES}, found {mode!r}")
    return rp.plan_for(cfg, mode, tp, lnc, drafts=check_drafts(drafts))


def kernel_of(mode: str):
    """The shipped kernel of a mode: ``megakernel.round.round_kernel`` / ``step_kernel``."""
    from megakernel.round import KERNELS
    if mode not in KERNELS:
        raise AssemblyError(f"mode must be one of {MODES}, found {mode!r}")
    return KERNELS[mode]


def kernel_parameters(mode: str) -> list[str]:
    """The shipped kernel's HBM tensor parameters (its signature without the plan), in order."""
    return [n for n in inspect.signature(kernel_of(mode)).parameters if n != "plan"]


def check_sharding(cfg: ModelConfig, tp: int, lnc: int) -> None:
    """Raise AssemblyError if cfg does not shard over tp ranks x lnc cores (every constraint the plan, the twins
    and the kernels impose, checked up front with one message)."""
    from model.tp.gdn import GdnDims
    try:
        for mode in MODES if cfg.mtp_num_hidden_layers else ("step",):
            rp.plan_for(cfg, mode, tp, lnc)
        GdnDims.of(cfg, tp)
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
    """Rank ``rank``'s weights for ``backend`` as contiguous torch tensors.

    megakernel: ``megakernel.sharded.rank_weights`` (the kernels' stacked HBM layouts, converted once here);
    xla: ``harness.xla.rank_weights`` (PyTorch layouts of the model/tp twins, stacked)."""
    if backend == "megakernel":
        from megakernel.sharded import rank_weights as kernel_rank_weights
        w = kernel_rank_weights(cfg, params, rank, tp, lnc)
    elif backend == "xla":
        from harness.xla import rank_weights as xla_rank_weights
        w = xla_rank_weights(cfg, params, rank, tp)
    else:
        raise AssemblyError(f"backend must be one of {BACKENDS}, found {backend!r}")
    return {k: as_torch(v).contiguous() for k, v in w.items()}


def state_specs(cfg: ModelConfig, tp: int, max_len: int, dtype: torch.dtype, drafts: int = rp.DEFAULT_DRAFTS
                ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (per-rank shape, torch dtype) of every decode-state buffer (``megakernel.plan.state_specs`` with
    :func:`state_slots` GDN checkpoint slots for rounds of ``drafts`` drafts; the same on every rank),
    activation-dtype buffers in ``dtype``."""
    return {s.name: (tuple(s.shape), dtype if s.dtype == "activation" else getattr(torch, s.dtype))
            for s in rp.state_specs(cfg, tp, max_len, state_slots(drafts))}


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
# Kernel arguments, graph states and aliases
# --------------------------------------------------------------------------------------------------
def kernel_kwargs(mode: str, weights: dict, states: dict, runtime: dict) -> dict:
    """The keyword arguments of one rank's launch of the shipped kernel (without the plan): each of its tensor
    parameters from the one source that has it; an experts table the checkpoint does not need stays at its
    default (None); a weight only the other mode's kernel takes (``mtp_fc`` in a step) is left out. Missing,
    unexpected or doubly given names are an error naming them."""
    sig = inspect.signature(kernel_of(mode)).parameters
    sources = {**weights, **states, **runtime}
    if len(sources) != len(weights) + len(states) + len(runtime):
        dup = sorted((set(weights) & set(states)) | (set(weights) | set(states)) & set(runtime))
        raise AssemblyError(f"kernel arguments given twice: {dup[:8]}")
    names = kernel_parameters(mode)
    other = set(kernel_parameters("round")) | set(kernel_parameters("step"))
    missing = [n for n in names if n not in sources and sig[n].default is inspect.Parameter.empty]
    extra = sorted(set(sources) - set(names) - (set(weights) & other))
    if missing or extra:
        raise AssemblyError(f"kernel arguments do not match the {mode} kernel: missing {missing[:8]}"
                            f"{' ...' if len(missing) > 8 else ''}, unexpected {extra[:8]}{' ...' if len(extra) > 8 else ''}")
    return {n: sources[n] for n in names if n in sources}


def output_names(mode: str) -> list[str]:
    """What a round/step/context graph returns, in order: drafts [K, 1] int32 (a step: the pending token [1, 1]; a
    context graph: the token after its chunk [1, 1]), targets [T, 1] int32, hidden [T, H] (activation dtype; T =
    K + 1 in a round, 1 in a step and a context graph), then the state buffers the launch writes (``plan.STATE``,
    every one in every mode)."""
    if mode not in MODES and context.bucket_of(mode) is None:
        raise AssemblyError(f"mode must be one of {MODES}, found {mode!r}")
    return [*LEADING_OUTPUTS, *rp.STATE]


def graph_states(mode: str, state_names) -> list[str]:
    """The decode-state buffers a graph takes, in output order: exactly those it overwrites (and aliases).

    round / step: ``plan.STATE`` (a step writes the trunk's rows of the stacked caches and GDN slots, the MTP
    layer's entries pass through unchanged); reset: every buffer. A graph must not take a state it does not
    alias: NxD treats a non-aliased parameter as a WEIGHT, to be loaded from the checkpoint, where no state is."""
    names = list(state_names)
    if mode == "reset":
        return names
    want = output_names(mode)[len(LEADING_OUTPUTS):]
    missing = sorted(set(want) - set(names))
    if missing:
        raise AssemblyError(f"{mode}: the graph writes state buffers that do not exist: {missing[:8]}")
    return want


def state_aliases(mode: str) -> dict[str, int]:
    """State buffer name -> index of the round/step graph output that is its new value (NxD input/output
    aliasing: the buffer is updated in place on the device, nothing goes back to the host)."""
    return {n: i for i, n in enumerate(output_names(mode)) if i >= len(LEADING_OUTPUTS)}


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
# Run-time inputs (built by megakernel.plan.round_inputs / step_inputs)
# --------------------------------------------------------------------------------------------------
def graph_order(buckets=()) -> tuple[str, ...]:
    """Every graph of the application in registration order: round, step, the context graphs of ``buckets``
    (ascending), reset."""
    return ("round", "step", *(context.mode_of(b) for b in sorted(buckets)), "reset")


def graph_inputs(mode: str) -> tuple[str, ...]:
    """The positional inputs of a graph's traced forward (:data:`GRAPH_INPUTS`; a context graph's
    ``harness.nxdi.context.INPUTS``)."""
    if context.bucket_of(mode) is not None:
        return context.INPUTS
    if mode not in GRAPH_INPUTS:
        raise AssemblyError(f"graph must be one of {GRAPHS} or context_<bucket>, found {mode!r}")
    return GRAPH_INPUTS[mode]


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


def reset_inputs() -> dict:
    """Run-time inputs of the reset graph: keep = 0 (every state buffer becomes zero)."""
    import numpy as np
    return {"keep": np.zeros((1, 1), np.int32)}


def runtime_example(cfg: ModelConfig, mode: str, dtype: torch.dtype, drafts: int = rp.DEFAULT_DRAFTS
                    ) -> dict[str, torch.Tensor]:
    """Zero tensors with the exact shapes and dtypes of a graph's run-time inputs (``plan.input_specs`` for rounds
    of ``drafts`` drafts: the example inputs the graph is traced with, and NxD's routing key)."""
    if mode == "reset":
        return {"keep": torch.zeros((1, 1), dtype=torch.int32)}
    graph_inputs(mode)
    bucket = context.bucket_of(mode)
    specs = context.input_specs(cfg, bucket) if bucket is not None else rp.input_specs(cfg, mode, check_drafts(drafts))
    return {s.name: torch.zeros(s.shape, dtype=dtype if s.dtype == "activation" else getattr(torch, s.dtype))
            for s in specs}


def ordered_inputs(mode: str, runtime: dict) -> tuple[torch.Tensor, ...]:
    """A graph's run-time inputs as torch tensors in the traced forward's positional order."""
    names = graph_inputs(mode)
    if set(runtime) != set(names):
        raise AssemblyError(f"{mode}: run-time inputs {sorted(runtime)} do not match {sorted(names)}")
    return tuple(as_torch(runtime[n]) for n in names)
