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


def positions(pos, t: int, device) -> torch.Tensor:
    """Positions pos..pos+t-1 as int64 [t] from a run-time position (an int tensor of one element, e.g. the
    kernels' int32 [1, 1] input, or a Python int on the host)."""
    p = torch.as_tensor(pos, device=device).reshape(-1)[:1].long()
    return p + torch.arange(t, device=device)


def masked_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, pos_q: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """``model.functional.causal_attention`` over the WHOLE cache with the rows past each query's position masked
    (no slicing by a host value: traceable). q [T, Hq, D]; kc, vc [Hkv, L, D]; pos_q int64 [T]. Scores and softmax
    in fp32; masked rows get probability exactly 0 and their contents (zeros, stale rows, even NaN) never reach
    the result, so it equals attending rows 0..pos. Returns [T, Hq, D] in q's dtype."""
    t, hq, _ = q.shape
    hkv, length, _ = kc.shape
    seen = torch.arange(length, device=q.device)[None, :] <= pos_q.max()          # [1, L] rows any query sees
    k = torch.where(seen[0, None, :, None], kc.float(), 0.0).repeat_interleave(hq // hkv, dim=0)
    v = torch.where(seen[0, None, :, None], vc.float(), 0.0).repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("thd,hnd->htn", q.float(), k) * scale
    mask = torch.arange(length, device=q.device)[None, :] > pos_q[:, None]        # [T, L]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("htn,hnd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)


def attention_rank(shard: dict, x: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos, cfg: ModelConfig,
                   cos: torch.Tensor | None = None, sin: torch.Tensor | None = None):
    """One rank's gated GQA attention on normed x ``[T, H]`` at positions pos..pos+T-1.

    k_cache, v_cache: the rank's caches ``[Hkv_r, L, D]`` (activation dtype); pos: the run-time position of the
    first token (an int tensor of one element, e.g. int32 [1, 1], or an int); cos, sin: float32 ``[T, rotary]``
    RoPE rows of the positions (the kernels' run-time inputs; computed from pos when None). Same math and casts as
    ``ReferenceModel.attention_mixer`` (projections in the activation dtype, zero-centred q/k RMSNorm, partial
    rotate-half RoPE, fp32 softmax, o * sigmoid(gate) rounded to the activation dtype). Traceable: no host value,
    no slicing by the position (rows are written with ``index_copy``, later rows masked), nothing created off the
    inputs' device. Returns (the rank's o_proj partial ``[T, H]`` float32, new K cache, new V cache) with rows
    pos..pos+T-1 written.
    """
    t, d = x.shape[0], cfg.head_dim
    hq_r, nk = shard["num_heads"], shard["num_kv_heads"]
    if k_cache.shape[0] != nk or v_cache.shape[0] != nk:
        raise ValueError(f"attention_rank: caches hold {k_cache.shape[0]}/{v_cache.shape[0]} KV heads, the rank has "
                         f"{nk}")
    qg = F.linear(x, shard["q_proj"]).reshape(t, hq_r, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
    k = F.linear(x, shard["k_proj"]).reshape(t, nk, d)
    v = F.linear(x, shard["v_proj"]).reshape(t, nk, d)
    q = fn.rms_norm(q, shard["q_norm"], cfg.rms_norm_eps)
    k = fn.rms_norm(k, shard["k_norm"], cfg.rms_norm_eps)
    pq = positions(pos, t, x.device)
    if cos is None:
        cos, sin = fn.rope_cos_sin(pq, cfg.rotary_dim, cfg.rope_theta)
    q, k = fn.apply_partial_rope(q, cos, sin), fn.apply_partial_rope(k, cos, sin)
    kc = k_cache.index_copy(1, pq, k.transpose(0, 1).to(k_cache.dtype))
    vc = v_cache.index_copy(1, pq, v.transpose(0, 1).to(v_cache.dtype))
    o = masked_attention(q, kc, vc, pq, d ** -0.5).reshape(t, -1)
    o = (o.float() * torch.sigmoid(gate.float())).to(x.dtype)
    return F.linear(o.float(), shard["o_proj"].float()), kc, vc
