"""Everything the NxDI adapter needs that is plain logic: names, shapes, dtypes and order of the round
kernel's per-rank arguments, the run-time inputs of a launch, the per-rank weights of each backend, the
NxDI state dict and the input/output aliasing of the traced graphs. Tested on CPU
(tests/harness/test_nxdi.py); the trn2-only module ``harness.nxdi.modeling`` only wires these into NxDI.

Vocabulary used below
---------------------
backend
    ``"megakernel"`` -- token generation is ONE launch of ``megakernel.round`` per rank per round;
    weights in the kernels' HBM layouts (``megakernel.sharded.rank_weights``).
    ``"xla"`` -- the same round as plain traceable PyTorch (``harness.nxdi.xla_math``); weights in
    PyTorch layout, sharded like the model/tp twins.
mode
    ``"round"`` (D1 draft + 2-token verify + D2 replay), ``"step"`` (plain decode of one token) --
    the two modes of ``megakernel.round.RoundSpec`` -- and ``"reset"`` (zero every decode-state buffer
    before a new sequence; a tiny graph of its own, see :func:`reset_aliases`).
per-rank tensor
    Rank r's tensor of a flat name (``l3_g0_wqg``, ``l5_window``, ...). NxDI holds one parameter per
    name whose GLOBAL value is the concatenation of the ranks' tensors along dim 0; NxD's checkpoint
    sharding (``partition_dim=0``) hands rank r its slice, so on the device each rank sees exactly its
    per-rank tensor. This is the mechanism of NxD's ``SPMDRank`` (``rank_util.rank`` is
    ``arange(tp)`` in the checkpoint, one element per rank): neuronx-distributed
    ``src/neuronx_distributed/parallel_layers/layers.py`` (``SPMDRank``) and ``parallel_layers/utils.py``
    (``set_tensor_model_parallel_attributes``); NxDI's Qwen3-MoE writes ``rank_util.rank`` the same way in
    ``src/neuronx_distributed_inference/models/qwen3_moe/modeling_qwen3_moe.py``.

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
from model.config import FULL, LINEAR, ModelConfig
from model.tp.embed_head import vocab_per_core
from model.tp.gdn import GdnDims
from nki_kernels.attention import rope_tables
from nki_kernels.host import as_torch

BACKENDS = ("xla", "megakernel")
MODES = ("round", "step")
SLOTS = 2  # GDN checkpoint slots: one per verified token of a round

# The traced forward's positional parameters. Every graph of the application is the same nn.Module
# class, so they share ONE signature (NxD's NxDModel refuses submodels with different signatures and
# routes a call by the names and shapes of the arguments provided); each mode passes a PREFIX of this
# tuple: reset 1, step 5, round 10 (see forward_inputs).
FORWARD_INPUTS = ("pending", "read_slot", "pos", "cos_v", "sin_v", "hidden", "force", "pos_d1", "cos_d1", "sin_d1")
RESET_INPUTS = ("pending",)

WEIGHTS_PREFIX = "weights."   # nn.ParameterDict holding the per-rank weights
STATES_PREFIX = "states."     # nn.ParameterDict holding the per-rank decode state
RANK_UTIL = "rank_util.rank"  # NeuronBaseModel's SPMDRank parameter, arange(tp) in the checkpoint


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
# Per-rank weights, state, and the NxDI state dict
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


def neuron_state_dict(cfg: ModelConfig, params: dict[str, torch.Tensor], backend: str, tp: int, lnc: int,
                      progress=None) -> dict[str, torch.Tensor]:
    """The NxDI checkpoint of the application: ``weights.<name>`` = the ranks' tensors concatenated along
    dim 0 (rank r's rows first-to-last in rank order), plus ``rank_util.rank`` = arange(tp) int32.

    params: canonical parameters (``model.weights.load_checkpoint``). Every name must have the same
    per-rank shape and dtype on every rank (the sharding is symmetric); anything else is an error.
    progress: optional callable(rank) called after each rank's conversion."""
    check_sharding(cfg, tp, lnc)
    ranks = []
    for r in range(tp):
        ranks.append(rank_weights(cfg, params, backend, r, tp, lnc))
        if progress:
            progress(r)
    out: dict[str, torch.Tensor] = {}
    for name, first in ranks[0].items():
        for r, w in enumerate(ranks[1:], start=1):
            t = w.get(name)
            if t is None or t.shape != first.shape or t.dtype != first.dtype:
                got = "missing" if t is None else f"{list(t.shape)} {t.dtype}"
                raise AssemblyError(f"weight {name!r}: rank 0 has {list(first.shape)} {first.dtype}, rank {r} {got}")
        if first.dim() == 0:
            raise AssemblyError(f"weight {name!r} is a scalar; per-rank tensors need a dim 0 to concatenate along")
        out[WEIGHTS_PREFIX + name] = torch.cat([w[name] for w in ranks], dim=0)
    out[RANK_UTIL] = torch.arange(tp, dtype=torch.int32)
    return out


def rank_slice(state_dict: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s per-rank weights from a ``neuron_state_dict`` (what NxD's sharding along dim 0 gives it)."""
    out = {}
    for key, t in state_dict.items():
        if not key.startswith(WEIGHTS_PREFIX):
            continue
        if t.shape[0] % tp:
            raise AssemblyError(f"{key}: dim 0 of {list(t.shape)} does not split over tp={tp}")
        n = t.shape[0] // tp
        out[key[len(WEIGHTS_PREFIX):]] = t[rank * n:(rank + 1) * n]
    return out


def param_specs(state_dict: dict[str, torch.Tensor], tp: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """Name -> (per-rank shape, dtype) of the weights in a ``neuron_state_dict``: the shapes the NxDI
    module registers its parameters with."""
    out = {}
    for key, t in state_dict.items():
        if key.startswith(WEIGHTS_PREFIX):
            if t.shape[0] % tp:
                raise AssemblyError(f"{key}: dim 0 of {list(t.shape)} does not split over tp={tp}")
            out[key[len(WEIGHTS_PREFIX):]] = ((t.shape[0] // tp, *t.shape[1:]), t.dtype)
    return out


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
    them: every weight, every state buffer and the mode's run-time inputs, sorted by name."""
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
    return ["draft", "targets", "hidden", *mutated_names(spec)]


def state_aliases(spec: RoundSpec) -> dict[str, int]:
    """State buffer name -> index of the graph output that is its new value (NxD input/output aliasing:
    the buffer is updated in place on the device, nothing goes back to the host)."""
    return {n: i for i, n in enumerate(output_names(spec)) if i >= 3}


def reset_aliases(state_names) -> dict[str, int]:
    """The reset graph returns ``pending`` (so it has a non-state output) then zeros for every state
    buffer, in the given order: name -> output index."""
    return {n: 1 + i for i, n in enumerate(state_names)}


# --------------------------------------------------------------------------------------------------
# Run-time inputs
# --------------------------------------------------------------------------------------------------
def forward_inputs(mode: str) -> tuple[str, ...]:
    """The positional inputs a mode passes to the traced forward (a prefix of FORWARD_INPUTS)."""
    if mode == "reset":
        return RESET_INPUTS
    if mode not in MODES:
        raise AssemblyError(f"mode must be one of {MODES + ('reset',)}, found {mode!r}")
    names = FORWARD_INPUTS[:len(RUNTIME_INPUTS[mode])]
    assert set(names) == set(RUNTIME_INPUTS[mode]), (mode, names)
    return names


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


def runtime_example(cfg: ModelConfig, mode: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Zero tensors with the exact shapes and dtypes of a mode's run-time inputs (the example inputs the
    graph is traced with)."""
    T = 2 if mode == "round" else 1
    r = cfg.rotary_dim
    shapes = {"pending": ((1, 1), torch.int32), "read_slot": ((1, 1), torch.int32), "pos": ((1, 1), torch.int32),
              "cos_v": ((T, r), torch.float32), "sin_v": ((T, r), torch.float32),
              "hidden": ((1, cfg.hidden_size), dtype), "force": ((1, 2), torch.int32),
              "pos_d1": ((1, 1), torch.int32), "cos_d1": ((1, r), torch.float32), "sin_d1": ((1, r), torch.float32)}
    return {n: torch.zeros(shapes[n][0], dtype=shapes[n][1]) for n in forward_inputs(mode)}


def ordered_inputs(mode: str, runtime: dict) -> tuple[torch.Tensor, ...]:
    """A mode's run-time inputs as torch tensors in the traced forward's positional order."""
    names = forward_inputs(mode)
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
