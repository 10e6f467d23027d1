"""Tensor-parallel twin of the gated GQA attention mixer: one rank's slice of the math.

The PyTorch twin of ``nki_kernels/attention.py`` (nki_kernels/README.md "Contract of a family").
Sharding (DESIGN.md §4): rank ``r`` of ``tp`` owns the query heads ``[r*Hq/tp, (r+1)*Hq/tp)`` (their
query AND gate rows of ``q_proj``), the matching input columns of ``o_proj``, and the KV heads those
query heads read: ``kv_heads_of_rank`` -- with Hkv < tp (Qwen3.6: Hkv = 2, tp = 4) rank r holds the
single KV head ``r*Hkv // tp`` (ranks 0,1 -> head 0; ranks 2,3 -> head 1), a replica shared with its
neighbour; with Hkv >= tp it holds ``Hkv/tp`` heads. Tiny presets shard the same way.

Each rank keeps its own K/V cache ``[Hkv_rank, L, D]`` (replicated heads are written identically by
both ranks). ``attention_rank`` returns the rank's **fp32 partial** of the layer output (the o_proj
contraction over the rank's heads only); the sum over ranks equals
``ReferenceModel.attention_mixer`` up to the final cast (the reference rounds the o_proj output to
the activation dtype, the partials are summed in fp32 first) -- tested in
tests/model/test_tp_attention.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import functional as fn
from model.config import ModelConfig


def kv_heads_of_rank(cfg: ModelConfig, rank: int, tp: int) -> tuple[int, int]:
    """(first KV head, number of KV heads) that rank ``rank`` of ``tp`` needs.

    Query head h reads KV head h // (Hq/Hkv). The rank's query heads must map onto whole KV heads:
    either several query-head groups per rank (Hq/tp a multiple of the group) or several ranks per
    KV head (the group a multiple of Hq/tp).
    """
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    if tp < 1 or hq % tp:
        raise ValueError(f"attention sharding: tp={tp} does not divide num_attention_heads={hq}")
    if not 0 <= rank < tp:
        raise ValueError(f"attention sharding: rank {rank} outside 0..{tp - 1}")
    hq_r, group = hq // tp, hq // hkv
    if hq_r % group and group % hq_r:
        raise ValueError(f"attention sharding: {hq_r} query heads per rank straddle KV groups of {group} heads")
    first = rank * hq_r // group
    return first, max(1, hq_r // group)


def shard_attention(params: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, rank: int, tp: int
                    ) -> dict[str, torch.Tensor | int]:
    """The rank's attention weights, PyTorch layout (``[out, in]``), sliced from canonical params.

    prefix: the decoder layer, e.g. ``"model.layers.3"`` or ``"mtp.layers.0"``. Returns
    ``q_proj [Hq_r*2*D, H]`` (per head: D query rows then D gate rows, the checkpoint's interleave),
    ``k_proj``/``v_proj [Hkv_r*D, H]``, ``o_proj [H, Hq_r*D]``, ``q_norm``/``k_norm [D]`` (zero-centred
    offsets, replicated), plus ``num_heads`` (Hq_r), ``kv_head`` (first global KV head) and
    ``num_kv_heads`` (Hkv_r).
    """
    a = f"{prefix}.self_attn"
    d = cfg.head_dim
    hq_r = cfg.num_attention_heads // tp
    k0, nk = kv_heads_of_rank(cfg, rank, tp)
    q0 = rank * hq_r
    return {
        "q_proj": params[f"{a}.q_proj.weight"][q0 * 2 * d:(q0 + hq_r) * 2 * d],
        "k_proj": params[f"{a}.k_proj.weight"][k0 * d:(k0 + nk) * d],
        "v_proj": params[f"{a}.v_proj.weight"][k0 * d:(k0 + nk) * d],
        "o_proj": params[f"{a}.o_proj.weight"][:, q0 * d:(q0 + hq_r) * d],
        "q_norm": params[f"{a}.q_norm.weight"],
        "k_norm": params[f"{a}.k_norm.weight"],
        "num_heads": hq_r,
        "kv_head": k0,
        "num_kv_heads": nk,
    }


def rank_cache(cache: torch.Tensor, shard: dict) -> torch.Tensor:
    """The rank's replica ``[Hkv_r, L, D]`` (a copy) of a full cache ``[Hkv, L, D]``."""
    k0, nk = shard["kv_head"], shard["num_kv_heads"]
    return cache[k0:k0 + nk].clone()


def attention_rank(shard: dict, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], start: int,
                   cfg: ModelConfig) -> torch.Tensor:
    """One rank's gated GQA attention on normed x ``[T, H]`` at positions start..start+T-1.

    kv: the rank's caches ``(K, V)``, each ``[Hkv_r, L, D]`` (activation dtype); rows start..start+T-1
    are written in place, then the rank's query heads attend causally over rows 0..start+T-1.
    Same math and casts as ``ReferenceModel.attention_mixer`` (projections in the activation dtype,
    zero-centred q/k RMSNorm, partial rotate-half RoPE, fp32 softmax, o * sigmoid(gate) rounded to
    the activation dtype). Returns the rank's o_proj partial ``[T, H]`` in **float32**.
    """
    t, d = x.shape[0], cfg.head_dim
    hq_r, nk = shard["num_heads"], shard["num_kv_heads"]
    qg = F.linear(x, shard["q_proj"]).reshape(t, hq_r, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
    k = F.linear(x, shard["k_proj"]).reshape(t, nk, d)
    v = F.linear(x, shard["v_proj"]).reshape(t, nk, d)
    q = fn.rms_norm(q, shard["q_norm"], cfg.rms_norm_eps)
    k = fn.rms_norm(k, shard["k_norm"], cfg.rms_norm_eps)
    cos, sin = fn.rope_cos_sin(torch.arange(start, start + t), cfg.rotary_dim, cfg.rope_theta)
    q, k = fn.apply_partial_rope(q, cos, sin), fn.apply_partial_rope(k, cos, sin)
    kc, vc = kv
    if kc.shape[0] != nk or vc.shape[0] != nk:
        raise ValueError(f"attention_rank: caches hold {kc.shape[0]}/{vc.shape[0]} KV heads, the rank has {nk}")
    if start + t > kc.shape[1]:
        raise ValueError(f"attention_rank: positions up to {start + t - 1} exceed the KV cache length {kc.shape[1]}")
    kc[:, start:start + t] = k.transpose(0, 1).to(kc.dtype)
    vc[:, start:start + t] = v.transpose(0, 1).to(vc.dtype)
    o = fn.causal_attention(q, kc, vc, start, d ** -0.5).reshape(t, -1)
    o = (o.float() * torch.sigmoid(gate.float())).to(x.dtype)
    return F.linear(o.float(), shard["o_proj"].float())
