"""Host side of the kernel variants: weights and decode state in the kernels' per-rank HBM layouts.

Conversion happens once per checkpoint (weights) and once per prefill (state): the kernels never
transpose or slice weights at run time. Both kernel variants (``megakernel.layerwise`` and
``megakernel.round``) read the same per-rank tensors, named flatly because NKI binds only top-level
tensor arguments:

weights (rank r of ``tp``, ``lnc`` cores; layouts documented in each nki_kernels module)
  ``embed`` [V, H]; ``lm_head`` [lnc, P, KT*Vc] (vocab shard of core g = r*lnc + c); ``final_norm``;
  per trunk layer i: ``l{i}_in_norm``, ``l{i}_post_norm`` [P, J] float32; GDN layers ``l{i}_gdn_*``
  (``nki_kernels.gdn.gdn_weight_layout``); attention layers, per KV-head group g of the rank,
  ``l{i}_g{g}_{wqg,wk,wv,wo,norm_w}`` (``nki_kernels.attention.attention_layout``);
  MoE of the trunk layers stacked in groups of G layers, ``moe_router_{g}`` / ``moe_experts_{g}`` /
  ``moe_shared_{g}`` [G, ...] holding layers g*G .. g*G + G - 1 (``nki_kernels.moe.moe_hbm_layout``; G keeps
  every element offset of a group's experts table within int32, :func:`moe_group_size`, and
  :func:`moe_weights` finds a layer's group); MTP ``mtp_norm_emb``, ``mtp_norm_hidden``, ``mtp_fc``
  [lnc, P, 2J, H/(tp*lnc)] (``nki_kernels.linear.column_layout``), ``mtp_in_norm``, ``mtp_post_norm``,
  ``mtp_g{g}_*`` attention, ``mtp_moe_{router,experts,shared}``, ``mtp_norm``.
state
  ``l{i}_window`` [slots, K-1, C_rank], ``l{i}_state`` [slots, Hv_rank, D, D] float32 (GDN);
  ``l{i}_g{g}_k``, ``l{i}_g{g}_v`` [1, L, D] (attention, L >= one KV tile per core, :func:`cache_length`);
  ``mtp_g{g}_k``/``_v``.

A rank with several KV heads (TP=1 or 2 with two KV heads) runs its attention once per KV-head
group; the groups' o_proj partials add up.
"""

from __future__ import annotations

import torch

from model.config import FULL, ModelConfig
from model.state import DecodeState
from model.tp.attention import kv_heads_of_rank, shard_attention
from model.tp.embed_head import shard_lm_head
from model.tp.gdn import GdnDims, gather_windows, shard_gdn, split_window
from model.tp.moe import shard_moe
from nki_kernels.attention import KV_TILE, attention_layout
from nki_kernels.gdn import gdn_weight_layout
from nki_kernels.linear import column_layout
from nki_kernels.lm_head import rank_lm_head_layout
from nki_kernels.moe import layers_per_table, moe_hbm_layout
from nki_kernels.rmsnorm import rmsnorm_weight_layout


def kv_groups(cfg: ModelConfig, rank: int, tp: int) -> list[int]:
    """Global KV heads the rank attends with (one attention body call each)."""
    first, n = kv_heads_of_rank(cfg, rank, tp)
    return list(range(first, first + n))


def _group_shard(shard: dict, cfg: ModelConfig, g: int) -> dict:
    """The part of a rank's attention shard that uses KV head index g of the rank (query heads of
    that group, one KV head): the single-KV-head shard ``attention_layout`` takes."""
    d, n = cfg.head_dim, shard["num_kv_heads"]
    hq = shard["num_heads"] // n
    q, o = slice(g * hq * 2 * d, (g + 1) * hq * 2 * d), slice(g * hq * d, (g + 1) * hq * d)
    kv = slice(g * d, (g + 1) * d)
    return {"q_proj": shard["q_proj"][q], "k_proj": shard["k_proj"][kv], "v_proj": shard["v_proj"][kv],
            "o_proj": shard["o_proj"][:, o], "q_norm": shard["q_norm"], "k_norm": shard["k_norm"],
            "num_heads": hq, "kv_head": shard["kv_head"] + g, "num_kv_heads": 1}


def _attention(params, prefix, cfg, rank, tp, name) -> dict:
    shard = shard_attention(params, prefix, cfg, rank, tp)
    out = {}
    for g in range(shard["num_kv_heads"]):
        for k, v in attention_layout(_group_shard(shard, cfg, g)).items():
            out[f"{name}_g{g}_{k}"] = v
    return out


def _moe(params, prefixes, cfg, rank, tp, lnc) -> list[dict]:
    """The MoE layouts of ``prefixes`` stacked in groups of :func:`moe_group_size` layers: one dict of
    ``router`` / ``experts`` / ``shared`` [G, ...] per group."""
    layouts = [moe_hbm_layout(shard_moe(params, p, cfg, rank, tp), n_cores=lnc) for p in prefixes]
    size = moe_group_size(layouts[0]["experts"])
    groups = []
    for g0 in range(0, len(layouts), size):
        part = layouts[g0:g0 + size]
        groups.append({k: torch.stack([lay[k] for lay in part]) for k in ("router", "experts", "shared")})
    return groups


def moe_group_size(experts: torch.Tensor) -> int:
    """Layers per stacked MoE group: as many as keep every element offset of the stacked experts table
    within int32 (``nki_kernels.moe.layers_per_table``; 10 at the real per-rank shapes, 201M elements each)."""
    return layers_per_table(experts.numel())


def moe_weights(w: dict, layer: int):
    """(router, experts, shared, index in the group) of trunk layer ``layer`` in a rank's weights ``w``:
    the stacked group ``moe_{router,experts,shared}_{layer // G}`` and ``layer % G``, G = the group size."""
    size = w["moe_experts_0"].shape[0]
    g, i = divmod(layer, size)
    return w[f"moe_router_{g}"], w[f"moe_experts_{g}"], w[f"moe_shared_{g}"], i


def rank_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], rank: int, tp: int, lnc: int
                 ) -> dict[str, object]:
    """Every weight tensor of rank ``rank`` in the kernels' HBM layouts (module docstring)."""
    H = cfg.hidden_size
    n_cores = tp * lnc
    if H % n_cores:
        raise ValueError(f"megakernel: hidden size {H} does not split over {n_cores} cores (MTP fc columns)")
    w: dict[str, object] = {
        "embed": params["model.embed_tokens.weight"],
        "lm_head": rank_lm_head_layout(tuple(shard_lm_head(params, cfg, rank * lnc + c, n_cores)
                                             for c in range(lnc))),
        "final_norm": rmsnorm_weight_layout(params["model.norm.weight"]),
    }
    for i, kind in enumerate(cfg.layer_types):
        pre = f"model.layers.{i}"
        w[f"l{i}_in_norm"] = rmsnorm_weight_layout(params[f"{pre}.input_layernorm.weight"])
        w[f"l{i}_post_norm"] = rmsnorm_weight_layout(params[f"{pre}.post_attention_layernorm.weight"])
        if kind == FULL:
            w.update(_attention(params, pre, cfg, rank, tp, f"l{i}"))
        else:
            for k, v in gdn_weight_layout(shard_gdn(params, pre, cfg, rank, tp), lnc=lnc).items():
                w[f"l{i}_gdn_{k}"] = v
    moe = _moe(params, [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)], cfg, rank, tp, lnc)
    for g, group in enumerate(moe):
        w.update({f"moe_{k}_{g}": v for k, v in group.items()})
    if cfg.mtp_num_hidden_layers:
        nc = H // n_cores
        fc = params["mtp.fc.weight"]
        w["mtp_norm_emb"] = rmsnorm_weight_layout(params["mtp.pre_fc_norm_embedding.weight"])
        w["mtp_norm_hidden"] = rmsnorm_weight_layout(params["mtp.pre_fc_norm_hidden.weight"])
        w["mtp_fc"] = torch.stack([column_layout(fc, (rank * lnc + c) * nc, nc) for c in range(lnc)])
        w["mtp_in_norm"] = rmsnorm_weight_layout(params["mtp.layers.0.input_layernorm.weight"])
        w["mtp_post_norm"] = rmsnorm_weight_layout(params["mtp.layers.0.post_attention_layernorm.weight"])
        w.update(_attention(params, "mtp.layers.0", cfg, rank, tp, "mtp"))
        moe = _moe(params, ["mtp.layers.0"], cfg, rank, tp, lnc)[0]
        w.update({f"mtp_moe_{k}": v[0] for k, v in moe.items()})
        w["mtp_norm"] = rmsnorm_weight_layout(params["mtp.norm.weight"])
    return w


def cache_length(max_len: int) -> int:
    """KV cache rows the attention kernel needs: at least one KV tile per core of an LNC=2 rank (the head
    tiles of a rank read rows 0 .. 2*KV_TILE - 1, ``nki_kernels.attention``)."""
    return max(max_len, 2 * KV_TILE)


def _rank_cache(cache: torch.Tensor, head: int, length: int) -> torch.Tensor:
    out = torch.zeros((1, length, cache.shape[-1]), dtype=cache.dtype)
    out[0, :cache.shape[1]] = cache[head]
    return out


def rank_state(cfg: ModelConfig, state: DecodeState, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The rank's slice of a reference DecodeState in the kernels' layouts (fresh tensors)."""
    dims = GdnDims.of(cfg, tp)
    length = cache_length(state.max_len)
    out = {}
    for i in cfg.linear_layers:
        out[f"l{i}_window"] = split_window(state.conv[i], dims, rank).contiguous()
        out[f"l{i}_state"] = state.recurrent[i][:, rank * dims.hv:(rank + 1) * dims.hv].contiguous()
    heads = kv_groups(cfg, rank, tp)
    caches = [(f"l{i}", state.kv[i]) for i in cfg.full_layers]
    if state.mtp_kv is not None:
        caches.append(("mtp", state.mtp_kv))
    for name, (k, v) in caches:
        for g, head in enumerate(heads):
            out[f"{name}_g{g}_k"] = _rank_cache(k, head, length)
            out[f"{name}_g{g}_v"] = _rank_cache(v, head, length)
    return out


def gather_state(cfg: ModelConfig, ranks: list[dict[str, torch.Tensor]], like: DecodeState, read_slot: int
                 ) -> DecodeState:
    """Per-rank kernel state -> a reference DecodeState (same max_len/slots/dtype as ``like``).

    GDN windows and states are concatenated over ranks; each KV head is taken from the first rank
    holding it (ranks sharing a KV head write identical rows)."""
    tp = len(ranks)
    dims = GdnDims.of(cfg, tp)
    st = DecodeState.empty(cfg, like.max_len, like.slots, like.dtype)
    st.read_slot = read_slot
    for i in cfg.linear_layers:
        st.conv[i] = gather_windows([r[f"l{i}_window"] for r in ranks], dims)
        st.recurrent[i] = torch.cat([r[f"l{i}_state"] for r in ranks], dim=1)
    caches = [(f"l{i}", st.kv[i]) for i in cfg.full_layers]
    if st.mtp_kv is not None:
        caches.append(("mtp", st.mtp_kv))
    for name, (k, v) in caches:
        done = set()
        for rank in range(tp):
            for g, head in enumerate(kv_groups(cfg, rank, tp)):
                if head not in done:
                    done.add(head)
                    k[head] = ranks[rank][f"{name}_g{g}_k"][0, :like.max_len]
                    v[head] = ranks[rank][f"{name}_g{g}_v"][0, :like.max_len]
    return st
