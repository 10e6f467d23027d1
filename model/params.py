"""The canonical parameter names and shapes of a model, and deterministic random weights.

Canonical names are those of transformers' ``Qwen3_5MoeForCausalLM`` plus the MTP
head as vLLM names it (``shared/docs/qwen36.md`` §3):

* ``model.embed_tokens.weight``, ``model.norm.weight``, ``lm_head.weight``
* ``model.layers.{i}.input_layernorm.weight`` / ``post_attention_layernorm.weight``
* GDN layers: ``model.layers.{i}.linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.weight``,
  ``conv1d.weight`` [conv_dim, 1, K], ``A_log``, ``dt_bias``, ``norm.weight``
* attention layers: ``model.layers.{i}.self_attn.{q_proj,k_proj,v_proj,o_proj,q_norm,k_norm}.weight``
* MoE (every layer): ``mlp.gate.weight``, fused ``mlp.experts.gate_up_proj`` [E, 2I, H]
  (rows 0..I-1 gate, I..2I-1 up) and ``mlp.experts.down_proj`` [E, H, I], ``mlp.shared_expert.*``,
  ``mlp.shared_expert_gate.weight``
* MTP: ``mtp.pre_fc_norm_embedding.weight``, ``mtp.pre_fc_norm_hidden.weight``, ``mtp.fc.weight``,
  ``mtp.layers.0.*`` (an attention + MoE decoder layer), ``mtp.norm.weight``

On-disk variants (``model.language_model.`` prefix, per-expert tensors) are
translated to these names by ``model.weights``.
"""

from __future__ import annotations

import torch

from model.config import FULL, ModelConfig


def _attention_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, d = cfg.hidden_size, cfg.head_dim
    return {
        f"{p}.self_attn.q_proj.weight": (2 * cfg.num_attention_heads * d, h),
        f"{p}.self_attn.k_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{p}.self_attn.v_proj.weight": (cfg.num_key_value_heads * d, h),
        f"{p}.self_attn.o_proj.weight": (h, cfg.num_attention_heads * d),
        f"{p}.self_attn.q_norm.weight": (d,),
        f"{p}.self_attn.k_norm.weight": (d,),
    }


def _gdn_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, hv = cfg.hidden_size, cfg.linear_num_value_heads
    q = f"{p}.linear_attn"
    return {
        f"{q}.in_proj_qkv.weight": (cfg.conv_dim, h),
        f"{q}.in_proj_z.weight": (cfg.linear_value_dim, h),
        f"{q}.in_proj_b.weight": (hv, h),
        f"{q}.in_proj_a.weight": (hv, h),
        f"{q}.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        f"{q}.A_log": (hv,),
        f"{q}.dt_bias": (hv,),
        f"{q}.norm.weight": (cfg.linear_value_head_dim,),
        f"{q}.out_proj.weight": (h, cfg.linear_value_dim),
    }


def _moe_shapes(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, e, i, s = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    m = f"{p}.mlp"
    return {
        f"{m}.gate.weight": (e, h),
        f"{m}.experts.gate_up_proj": (e, 2 * i, h),
        f"{m}.experts.down_proj": (e, h, i),
        f"{m}.shared_expert.gate_proj.weight": (s, h),
        f"{m}.shared_expert.up_proj.weight": (s, h),
        f"{m}.shared_expert.down_proj.weight": (h, s),
        f"{m}.shared_expert_gate.weight": (1, h),
    }


def _layer_shapes(cfg: ModelConfig, p: str, layer_type: str) -> dict[str, tuple[int, ...]]:
    h = cfg.hidden_size
    out = {f"{p}.input_layernorm.weight": (h,), f"{p}.post_attention_layernorm.weight": (h,)}
    out.update(_attention_shapes(cfg, p) if layer_type == FULL else _gdn_shapes(cfg, p))
    out.update(_moe_shapes(cfg, p))
    return out


def expected_shapes(cfg: ModelConfig, include_mtp: bool = True) -> dict[str, tuple[int, ...]]:
    """Every canonical parameter name of the model with its shape."""
    h, v = cfg.hidden_size, cfg.vocab_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i, t in enumerate(cfg.layer_types):
        out.update(_layer_shapes(cfg, f"model.layers.{i}", t))
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (v, h)
    if include_mtp and cfg.mtp_num_hidden_layers:
        out["mtp.pre_fc_norm_embedding.weight"] = (h,)
        out["mtp.pre_fc_norm_hidden.weight"] = (h,)
        out["mtp.fc.weight"] = (h, 2 * h)
        out.update(_layer_shapes(cfg, "mtp.layers.0", FULL))
        out["mtp.norm.weight"] = (h,)
    return out


def is_fp32_param(name: str) -> bool:
    """Parameters kept in float32 whatever the weight dtype (GDN decay parameters)."""
    return name.endswith(".A_log") or name.endswith(".dt_bias")


def random_params(cfg: ModelConfig, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                  include_mtp: bool = True) -> dict[str, torch.Tensor]:
    """Deterministic random weights of every parameter, scaled so activations stay O(1).

    Norm offsets are small random values around 0 (zero-centred norms) or 1 (the
    plain-weight GDN norm), so a wrong "1 + w" convention shows up in parity tests.
    """
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in expected_shapes(cfg, include_mtp).items():
        if name.endswith("A_log"):
            t = torch.log(torch.empty(shape).uniform_(1.0, 8.0, generator=g))
        elif name.endswith("dt_bias"):
            t = torch.empty(shape).uniform_(-1.0, 1.0, generator=g)
        elif name.endswith("linear_attn.norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, generator=g)
        elif len(shape) == 1:  # zero-centred norm offsets
            t = 0.1 * torch.randn(shape, generator=g)
        elif name.endswith("conv1d.weight"):
            t = torch.randn(shape, generator=g) / shape[-1] ** 0.5
        elif name.endswith("embed_tokens.weight"):
            t = torch.randn(shape, generator=g)
        else:
            fan_in = shape[-1]
            t = torch.randn(shape, generator=g) / fan_in ** 0.5
        out[name] = t.to(torch.float32 if is_fp32_param(name) else dtype)
    return out
