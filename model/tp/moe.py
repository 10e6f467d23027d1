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

fp8 experts (opt-in, issue 15: it changes the model's output). :func:`quantize_fp8` turns a checkpoint's routed
experts into float8_e4m3 codes with per-channel fp32 scales (``gate_up_proj`` per output row, ``down_proj`` per
input column, i.e. per intermediate column on both sides: max-abs / 240, round to nearest even); :func:`shard_moe`
then also returns ``gate_scale``, ``up_scale``, ``down_scale`` [E, I_r], and :func:`moe_rank` computes what the fp8
kernel computes (``nki_kernels/moe.py`` "fp8 experts"): gate|up of the codes in fp32, times the gate scale / the up
x down scale (fp32 product), ``a = silu(g) * w * u`` in fp32 (w the bf16-rounded routing weight), ``a`` rounded to
the activation dtype once, the down projection of the codes accumulated in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import functional as fn
from model.config import ModelConfig

FP8_MAX = 240.0                      # largest float8_e4m3 magnitude (trn2's IEEE-like e4m3)
FP8_CODES = torch.float8_e4m3fn      # host storage of e4m3 codes: torch has no IEEE-like e4m3; within +-240 the two
                                     # formats have the same values and bytes (nki_kernels.moe.kernel_table)
FP8_SCALES = ("gate_scale", "up_scale", "down_scale")   # what shard_moe adds for a quantised checkpoint


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
        **_shard_scales(params, m, inter, rs),
    }


def _shard_scales(params, m, inter, rs):
    """The rank's fp8 scales of a quantised checkpoint (:func:`quantize_fp8`), or nothing."""
    if f"{m}.experts.gate_up_scale" not in params:
        return {}
    gus = params[f"{m}.experts.gate_up_scale"]                      # [E, 2I]
    return {"gate_scale": gus[:, rs], "up_scale": gus[:, inter + rs.start:inter + rs.stop],
            "down_scale": params[f"{m}.experts.down_scale"][:, rs]}


def quantize_channels(w: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel float8_e4m3 quantisation of ``w`` with the channel's elements along ``dim``: scale = max |w| over
    ``dim`` / 240 in fp32 (1 for an all-zero channel), codes = round-to-nearest-even(w / scale) (``FP8_CODES``
    storage, every code within +-240). Returns (codes like w, scale with ``dim`` removed); w ~ codes * scale with a
    relative error of at most 2^-4 per element above the e4m3 subnormals (2^-6 * scale)."""
    wf = w.float()
    amax = wf.abs().amax(dim=dim, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (wf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_CODES)
    return codes, scale.squeeze(dim)


def quantize_fp8(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint with its routed experts in fp8 (module docstring): every ``*.mlp.experts.gate_up_proj``
    [E, 2I, H] becomes e4m3 codes plus ``*.mlp.experts.gate_up_scale`` [E, 2I] (per output row), every
    ``*.mlp.experts.down_proj`` [E, H, I] codes plus ``*.mlp.experts.down_scale`` [E, I] (per input column); the
    rest is unchanged (same tensors). Torch ops only, so it runs on ``meta`` tensors too."""
    out = dict(params)
    for name, t in params.items():
        if name.endswith(".mlp.experts.gate_up_proj"):
            out[name], out[name[:-len("proj")] + "scale"] = quantize_channels(t, 2)
        elif name.endswith(".mlp.experts.down_proj"):
            out[name], out[name[:-len("proj")] + "scale"] = quantize_channels(t, 1)
    return out


def route_tokens(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The router every rank runs: (weights [T, k] fp32, expert indices [T, k] int64)."""
    return fn.route(F.linear(x, shard["router"]), top_k)


def moe_rank(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> torch.Tensor:
    """This rank's partial of the MoE block output. x: [T, H] activation dtype -> [T, H] float32.

    ``shard`` is :func:`shard_moe`'s dict (each tensor may also be one layer of a stack). The selected experts'
    intermediate slices are gathered by index ([T, k, I_r, H]): no host-side loop over the chosen experts, so
    the function traces. The per-token contribution is ``weight.to(x.dtype) * expert(x_t)`` accumulated in fp32,
    as in ``sparse_moe``; the shared expert is scaled by sigmoid of its gate. A quantised shard (fp8 codes and
    ``*_scale``, :func:`quantize_fp8`) runs the fp8 kernel's math (module docstring).
    """
    weights, idx = route_tokens(shard, x, top_k)                     # [T, k] fp32, int64
    if "gate_scale" in shard:
        return _fp8_moe(shard, x, weights, idx)
    xe = x[:, None, :, None]                                         # [T, 1, H, 1]
    hg = torch.matmul(shard["gate"][idx], xe)[..., 0]                # [T, k, I_r] activation dtype
    hu = torch.matmul(shard["up"][idx], xe)[..., 0]
    h = (F.silu(hg.float()) * hu.float()).to(x.dtype)
    y = torch.matmul(shard["down"][idx], h[..., None])[..., 0]       # [T, k, H]
    out = (weights.to(x.dtype).float()[..., None] * y.float()).sum(dim=1)
    shared = fn.swiglu_mlp(x, shard["shared_gate"], shard["shared_up"], shard["shared_down"]).float()
    return out + torch.sigmoid(F.linear(x, shard["shared_expert_gate"]).float()) * shared


def _fp8_moe(shard: dict[str, torch.Tensor], x: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor
             ) -> torch.Tensor:
    """A quantised shard's partial [T, H] float32 with the kernel's rounding points: the routed experts' codes
    dequantised by their scales (module docstring), and the bf16 shared expert likewise in fp32 until ``a``."""
    xe = x.float()[:, None, :, None]                                 # [T, 1, H, 1]
    g = torch.matmul(shard["gate"][idx].float(), xe)[..., 0] * shard["gate_scale"][idx].float()     # [T, k, I_r]
    u = torch.matmul(shard["up"][idx].float(), xe)[..., 0] * (shard["up_scale"][idx].float()
                                                              * shard["down_scale"][idx].float())
    a = (F.silu(g) * weights.to(x.dtype).float()[..., None] * u).to(x.dtype)
    y = torch.matmul(shard["down"][idx].float(), a.float()[..., None])[..., 0]      # [T, k, H]
    sg = torch.sigmoid(F.linear(x, shard["shared_expert_gate"]).float())            # [T, 1]
    gs, us = x.float() @ shard["shared_gate"].float().T, x.float() @ shard["shared_up"].float().T
    a_s = (F.silu(gs) * sg * us).to(x.dtype)
    return y.sum(dim=1) + a_s.float() @ shard["shared_down"].float().T


def distinct_experts(shard: dict[str, torch.Tensor], x: torch.Tensor, top_k: int) -> list[int]:
    """The distinct routed experts the tokens of ``x`` select (ascending): the experts whose weights
    a rank must read, at least once each."""
    return sorted(set(route_tokens(shard, x, top_k)[1].reshape(-1).tolist()))
