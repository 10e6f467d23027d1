"""Host side of the kernel variants: weights and decode state in the kernels' stacked per-rank HBM layouts.

Conversion happens once per checkpoint (weights) and once per prefill (state): the kernels never transpose or
slice weights at run time. The names, stacking order and shapes are those of ``megakernel.plan`` (module
docstring "Stacked tensors"); each entry of a stack is in the layout of its family's kernel:

weights (rank r of ``tp``, ``lnc`` cores)
  ``embed`` [V, H]; ``lm_head`` [lnc, P, KT*Vc] (vocab shard of core g = r*lnc + c, ``nki_kernels.lm_head``);
  ``norms`` [N, P, H/P] float32 (``nki_kernels.rmsnorm.rmsnorm_weight_layout``; rows ``plan.NormRows``);
  ``mtp_fc`` [lnc, P, 2J, H/(tp*lnc)] (``nki_kernels.linear.column_layout``); ``gdn_{w_in, conv_w, A_log, dt_bias,
  norm_w, w_out}`` [G, ...] (``nki_kernels.gdn.gdn_weight_layout``); ``attn_{wqg, wk, wv, wo, norm_w}`` [A, ...]
  (``nki_kernels.attention.attention_layout`` of each KV-head group of the rank, trunk layers then MTP);
  ``moe_router``, ``moe_shared`` [M, ...] and ``moe_experts_<t>`` [per_table, E, lnc, P, F]
  (``nki_kernels.moe.moe_hbm_layout``, trunk layers then MTP); from a checkpoint with fp8 experts
  (``model.tp.moe.quantize_fp8``, opt-in) the experts tables hold e4m3 codes and ``moe_scales`` [M, E, lnc, 2ic]
  float32 their scales (``nki_kernels.moe.expert_scales``; all MoE layers in one table, like ``moe_router``).
state (:func:`megakernel.plan.state_specs`)
  ``gdn_window`` [G, slots, K-1, C_rank], ``gdn_state`` [G, slots, Hv_rank, D, D] float32,
  ``attn_k`` / ``attn_v`` [A, L, D].

A rank with several KV heads (TP=1 or 2 with two KV heads) runs its attention once per KV-head group; the
groups' o_proj partials add up.
"""

from __future__ import annotations

import torch

from megakernel import plan as rp
from model.config import FULL, ModelConfig
from model.state import DecodeState
from model.tp.attention import kv_heads_of_rank, shard_attention
from model.tp.embed_head import shard_lm_head
from model.tp.gdn import GdnDims, gather_windows, shard_gdn, split_window
from model.tp.moe import shard_moe
from nki_kernels.attention import attention_layout
from nki_kernels.gdn import gdn_weight_layout
from nki_kernels.linear import column_layout
from nki_kernels.lm_head import fp8_head_scale_layout, quantize_head, rank_lm_head_layout
from nki_kernels.moe import moe_hbm_layout
from nki_kernels.rmsnorm import rmsnorm_weight_layout

GDN_FIELDS = ("w_in", "conv_w", "A_log", "dt_bias", "norm_w", "w_out")
ATTN_FIELDS = ("wqg", "wk", "wv", "wo", "norm_w")


def kv_heads(cfg: ModelConfig, rank: int, tp: int) -> list[int]:
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


def _stack(layouts: list[dict], fields, prefix: str) -> dict:
    return {prefix + k: torch.stack([lay[k] for lay in layouts]) for k in fields}


def attention_prefixes(cfg: ModelConfig) -> list[str]:
    """Checkpoint prefixes of the attention stack's layers, in stack order: full-attention trunk layers, MTP."""
    out = [f"model.layers.{i}" for i in cfg.full_layers]
    return out + (["mtp.layers.0"] if cfg.mtp_num_hidden_layers else [])


def moe_prefixes(cfg: ModelConfig) -> list[str]:
    """Checkpoint prefixes of the MoE stack's layers, in stack order: every trunk layer, then the MTP layer."""
    out = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
    return out + (["mtp.layers.0"] if cfg.mtp_num_hidden_layers else [])


def norm_names(cfg: ModelConfig) -> list[str]:
    """Checkpoint names of the ``norms`` rows, in row order (``plan.NormRows``)."""
    out = []
    for i in range(cfg.num_hidden_layers):
        out += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
    out.append("model.norm.weight")
    if cfg.mtp_num_hidden_layers:
        out += ["mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
                "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight",
                "mtp.norm.weight"]
    return out


def rank_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], rank: int, tp: int, lnc: int,
                 draft_ids=None, draft_fp8: bool = False) -> dict[str, torch.Tensor]:
    """Every stacked weight tensor of rank ``rank`` (module docstring), in ``plan.WEIGHTS`` order then the
    experts tables in use. Torch ops only, so it also runs on ``meta`` tensors (full-size shapes without data).
    ``draft_ids``: an FR-Spec draft vocabulary (``model.draft_vocab.load``, ascending), adding ``draft_head``
    [lnc, P, KT*Vd/(tp*lnc)] (its LM-head rows split over the cores like ``lm_head``) and ``draft_ids`` [Vd, 1] int32.
    ``draft_fp8``: the drafts' head (those rows, or the full LM head) as fp8 codes in ``draft_head`` plus
    ``draft_scale`` [lnc, P, 1] float32 (``nki_kernels.lm_head.quantize_head``, one scale per core shard; the codes in
    ``model.tp.moe.FP8_CODES`` storage, ``nki_kernels.moe.kernel_table`` views them for the kernel)."""
    H = cfg.hidden_size
    n_cores = tp * lnc
    if H % n_cores:
        raise ValueError(f"megakernel: hidden size {H} does not split over {n_cores} cores (MTP fc columns)")
    w: dict[str, torch.Tensor] = {
        "embed": params["model.embed_tokens.weight"],
        "lm_head": rank_lm_head_layout(tuple(shard_lm_head(params, cfg, rank * lnc + c, n_cores)
                                             for c in range(lnc))),
        "norms": torch.stack([rmsnorm_weight_layout(params[n]) for n in norm_names(cfg)]),
    }
    if cfg.mtp_num_hidden_layers:
        nc = H // n_cores
        w["mtp_fc"] = torch.stack([column_layout(params["mtp.fc.weight"], (rank * lnc + c) * nc, nc)
                                   for c in range(lnc)])
    gdn = [gdn_weight_layout(shard_gdn(params, f"model.layers.{i}", cfg, rank, tp), lnc=lnc)
           for i in cfg.linear_layers]
    if gdn:
        w.update(_stack(gdn, GDN_FIELDS, "gdn_"))
    attn = []
    for prefix in attention_prefixes(cfg):
        shard = shard_attention(params, prefix, cfg, rank, tp)
        attn += [attention_layout(_group_shard(shard, cfg, g)) for g in range(shard["num_kv_heads"])]
    if attn:
        w.update(_stack(attn, ATTN_FIELDS, "attn_"))
    moe = [moe_hbm_layout(shard_moe(params, p, cfg, rank, tp), n_cores=lnc) for p in moe_prefixes(cfg)]
    w.update(_stack(moe, ("router", "shared") + (("scales",) if "scales" in moe[0] else ()), "moe_"))
    per = rp.experts_per_table(cfg, tp, lnc)
    for t in range(rp.experts_tables(cfg, tp, lnc)):
        w[f"moe_experts_{t}"] = torch.stack([lay["experts"] for lay in moe[t * per:(t + 1) * per]])
    if draft_ids is not None or draft_fp8:
        from model.draft_vocab import draft_head_rows
        rows = [shard_lm_head(params, cfg, rank * lnc + c, n_cores) if draft_ids is None else
                draft_head_rows(params, cfg, draft_ids, rank * lnc + c, n_cores) for c in range(lnc)]
        if draft_fp8:
            if rows[0].dtype != torch.bfloat16:
                raise ValueError(f"megakernel: an fp8 draft head runs against bfloat16 activations; the checkpoint is "
                                 f"{rows[0].dtype}")
            rows, scales = zip(*(quantize_head(r) for r in rows))
            w["draft_scale"] = fp8_head_scale_layout(scales)
        w["draft_head"] = rank_lm_head_layout(tuple(rows))
        if draft_ids is not None:
            w["draft_ids"] = torch.as_tensor(draft_ids, dtype=torch.int32).reshape(-1, 1).contiguous()
    return w


def rank_state(cfg: ModelConfig, state: DecodeState, rank: int, tp: int) -> dict[str, torch.Tensor]:
    """The rank's slice of a reference DecodeState in the kernels' stacked layouts (fresh tensors, shapes of
    ``plan.state_specs``)."""
    dims = GdnDims.of(cfg, tp)
    specs = {s.name: s.shape for s in rp.state_specs(cfg, tp, state.max_len, state.slots)}
    out = {}
    if cfg.linear_layers:
        out["gdn_window"] = torch.stack([split_window(state.conv[i], dims, rank) for i in cfg.linear_layers])
        out["gdn_state"] = torch.stack([state.recurrent[i][:, rank * dims.hv:(rank + 1) * dims.hv]
                                        for i in cfg.linear_layers]).contiguous()
    caches = [state.kv[i] for i in cfg.full_layers] + ([state.mtp_kv] if state.mtp_kv is not None else [])
    heads = kv_heads(cfg, rank, tp)
    for name, which in (("attn_k", 0), ("attn_v", 1)):
        t = torch.zeros(specs[name], dtype=state.dtype)
        for a, kv in enumerate(caches):
            for g, head in enumerate(heads):
                t[a * len(heads) + g, :state.max_len] = kv[which][head]
        out[name] = t
    for name, t in out.items():
        if tuple(t.shape) != tuple(specs[name]):
            raise AssertionError(f"rank_state: {name} {list(t.shape)} differs from plan.state_specs {specs[name]}")
    return out


def gather_state(cfg: ModelConfig, ranks: list[dict[str, torch.Tensor]], like: DecodeState, read_slot: int
                 ) -> DecodeState:
    """Per-rank stacked kernel state -> a reference DecodeState (same max_len/slots/dtype as ``like``).

    GDN windows and states are concatenated over ranks; each KV head is taken from the first rank holding it
    (ranks sharing a KV head write identical rows)."""
    tp = len(ranks)
    dims = GdnDims.of(cfg, tp)
    st = DecodeState.empty(cfg, like.max_len, like.slots, like.dtype)
    st.read_slot = read_slot
    for j, i in enumerate(cfg.linear_layers):
        st.conv[i] = gather_windows([torch.as_tensor(r["gdn_window"])[j] for r in ranks], dims)
        st.recurrent[i] = torch.cat([torch.as_tensor(r["gdn_state"])[j] for r in ranks], dim=1)
    caches = [st.kv[i] for i in cfg.full_layers] + ([st.mtp_kv] if st.mtp_kv is not None else [])
    for a, (k, v) in enumerate(caches):
        done = set()
        for rank in range(tp):
            heads = kv_heads(cfg, rank, tp)
            for g, head in enumerate(heads):
                if head not in done:
                    done.add(head)
                    k[head] = torch.as_tensor(ranks[rank]["attn_k"])[a * len(heads) + g, :like.max_len]
                    v[head] = torch.as_tensor(ranks[rank]["attn_v"])[a * len(heads) + g, :like.max_len]
    return st
