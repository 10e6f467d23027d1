"""PyTorch twin of the tensor-parallel sparse MoE block (``nki_kernels/moe.py``).

Sharding (nki_kernels/README.md): the router (``mlp.gate.weight`` [E, H]) and the shared-expert
gate (``mlp.shared_expert_gate.weight`` [1, H]) are replicated on every rank; rank ``r`` of ``tp``
holds columns ``r*I/tp .. (r+1)*I/tp - 1`` of the intermediate of EVERY routed expert and of the
shared expert (gate and up rows, down columns). Each rank routes all tokens itself (same logits,
same top-k on every rank), runs the SiLU-gated MLP of the selected experts on its intermediate
slice and returns its partial ``[T, H]`` in float32; the sum of the partials over the ranks is the
MoE output before its final cast to the activation dtype.

Numerics are those of :func:`model.functional.sparse_moe`: router logits and the shared-expert gate
logit are ``F.linear`` in the activation dtype (rounded to it), softmax / top-k / renormalisation in
fp32 with ties going to the LOWER expert index, the routing weight rounded to the activation dtype
before it scales the expert output, expert MLPs in the activation dtype with fp32 accumulation.
For float32 weights the sum over ranks equals ``ReferenceModel.moe`` up to fp32 summation order; in
bfloat16 each rank's down projection is rounded to bf16 separately (tp roundings instead of one),
an extra error of at most ~tp x 2^-9 relative per expert output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import functional as fn
from model.config import ModelConfig


def intermediate_slice(size: int, rank: int, tp: int) -> slice:
    """Rank ``rank``'s columns of an intermediate of ``size`` (it must split evenly over ``tp``)."""
    if tp < 1 or not 0 <= rank < tp:
        raise ValueError(f"moe: rank {rank} outside [0, tp={tp})")
    if size % tp:
        raise ValueError(f"moe: intermediate size {size} does not split evenly over tp={tp} ranks")
    n = size // tp
    return slice(rank * n, (rank + 1) * n)


def shard_moe(params: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, rank: int, tp: int
              ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of the MoE block of the layer at ``prefix`` (e.g. ``model.layers.3``).

    Returns (PyTorch layouts, activation dtype, views where possible):
      ``router`` [E, H] and ``shared_expert_gate`` [1, H] (replicated),
      ``gate``, ``up`` [E, I_r, H] and ``down`` [E, H, I_r] of the routed experts,
      ``shared_gate``, ``shared_up`` [Is_r, H] and ``shared_down`` [H, Is_r],
    with ``I_r = I / tp`` and ``Is_r = Is / tp``.
    """
    m = f"{prefix}.mlp"
    inter, s_inter = cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    rs, ss = intermediate_slice(inter, rank, tp), intermediate_slice(s_inter, rank, tp)
    gate_up = params[f"{m}.experts.gate_up_proj"]          # [E, 2I, H], gate rows first
    return {
        "router": params[f"{m}.gate.weight"],
        "shared_expert_gate": params[f"{m}.shared_expert_gate.weight"],
        "gate": gate_up[:, rs],
        "up": gate_up[:, inter + rs.start:inter + rs.stop],
        "down": params[f"{m}.experts.down_proj"][:, :, rs],
        "shared_gate": params[f"{m}.shared_expert.gate_proj.weight"][ss],
        "shared_up": params[f"{m}.shared_expert.up_proj.weight"][ss],
        "shared_down": params[f"{m}.shared_expert.down_proj.weight"][:, ss],
    }


def route_tokens(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router every rank runs: (weights [T, k] fp32, expert indices [T, k] int64)."""
    return fn.route(F.linear(x, shard["router"]), top_k)


def moe_rank(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> torch.Tensor:
    """This rank's partial of the MoE block output. x: [T, H] activation dtype -> [T, H] float32.

    ``shard`` is :func:`shard_moe`'s dict (each tensor may also be one layer of a stack). The selected experts'
    intermediate slices are gathered by index ([T, k, I_r, H]): no host-side loop over the chosen experts, so
    the function traces. The per-token contribution is ``weight.to(x.dtype) * expert(x_t)`` accumulated in fp32,
    as in ``sparse_moe``; the shared expert is scaled by sigmoid of its gate.
    """
    weights, idx = route_tokens(shard, x, top_k)                     # [T, k] fp32, int64
    xe = x[:, None, :, None]                                         # [T, 1, H, 1]
    hg = torch.matmul(shard["gate"][idx], xe)[..., 0]                # [T, k, I_r] activation dtype
    hu = torch.matmul(shard["up"][idx], xe)[..., 0]
    h = (F.silu(hg.float()) * hu.float()).to(x.dtype)
    y = torch.matmul(shard["down"][idx], h[..., None])[..., 0]       # [T, k, H]
    out = (weights.to(x.dtype).float()[..., None] * y.float()).sum(dim=1)
    shared = fn.swiglu_mlp(x, shard["shared_gate"], shard["shared_up"], shard["shared_down"]).float()
    return out + torch.sigmoid(F.linear(x, shard["shared_expert_gate"]).float()) * shared


def distinct_experts(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> list[int]:
    """The distinct routed experts the tokens of ``x`` select (ascending): the experts whose weights
    a rank must read, at least once each."""
    return sorted(set(route_tokens(shard, x, top_k)[1].reshape(-1).tolist()))
