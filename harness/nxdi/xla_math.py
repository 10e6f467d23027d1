"""The "xla" backend of the NxDI adapter: one rank's round (or step) as plain, TRACEABLE PyTorch.

This is what ``harness.nxdi.modeling`` traces on trn2 for ``backend="xla"``: the same D1 draft / 2-token
verify / D2 replay as the megakernel (``megakernel.round``), with the same run-time inputs
(``assembly.round_inputs``), the same decode-state buffers in the same per-rank layout, and the same
outputs (``assembly.output_names``), so the host loop cannot tell the backends apart.

The math is that of the model/tp twins (``model.tp.attention``, ``model.tp.gdn``, ``model.tp.moe``,
``model.tp.embed_head``) and of ``model.functional``, rewritten where the twins depend on host values
(an XLA trace must not): positions, read slot and forced draft are tensors, the KV rows are written
with ``index_copy`` and attention masks rows past the query position instead of slicing, and the MoE
gathers the selected experts' weights by index instead of looping over ``unique()``. The GDN mixer IS
the twin (``model.tp.gdn.gdn_rank``: static shapes, no host values). Nothing here calls ``.item()``,
``.tolist()``, ``int(tensor)`` or branches on a tensor (tested with fake tensors, which raise on any
of those).

Collectives are injected (:class:`Collectives`): on trn2 they are NxD's
``reduce_from_tensor_model_parallel_region`` and ``gather_from_tensor_model_parallel_region``
(neuronx-distributed ``src/neuronx_distributed/parallel_layers/mappings.py``); on CPU a thread per
rank (``harness.nxdi.cpu.ThreadWorld``). Sums over ranks are in fp32.

Per-rank weights (:func:`rank_weights`, PyTorch ``[out, in]`` layouts)
    ``embed`` [V, H] (replicated), ``lm_head`` [V/tp, H] (vocabulary rows of the rank), ``final_norm`` [H];
    per layer ``l{i}_in_norm``, ``l{i}_post_norm`` [H]; attention ``l{i}_attn_{q_proj,k_proj,v_proj,o_proj,
    q_norm,k_norm}`` (``model.tp.attention.shard_attention``); GDN ``l{i}_gdn_<name>`` for the names of
    ``model.tp.gdn.WEIGHT_NAMES`` (``shard_gdn``); MoE ``l{i}_moe_{router,shared_expert_gate,gate,up,down,
    shared_gate,shared_up,shared_down}`` (``shard_moe``); MTP ``mtp_norm_emb``, ``mtp_norm_hidden``,
    ``mtp_fc`` [H, 2H] (replicated: 2H*H is small), ``mtp_in_norm``, ``mtp_post_norm``, ``mtp_attn_*``,
    ``mtp_moe_*``, ``mtp_norm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from megakernel.round import RoundSpec, mutated_names
from model import functional as fn
from model.config import FULL, ModelConfig
from model.tp.attention import shard_attention
from model.tp.embed_head import shard_lm_head
from model.tp.gdn import WEIGHT_NAMES as GDN_WEIGHTS
from model.tp.gdn import GdnDims, gdn_rank, shard_gdn
from model.tp.moe import shard_moe

ATTN_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MOE_WEIGHTS = ("router", "shared_expert_gate", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")


@dataclass(frozen=True)
class Collectives:
    """TP collectives of one rank. all_reduce: elementwise sum over the ranks (the same tensor on every
    rank); gather_last: concatenation over the ranks along the last dim, in rank order."""

    all_reduce: Callable[[torch.Tensor], torch.Tensor]
    gather_last: Callable[[torch.Tensor], torch.Tensor]

    def gather_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """[*s] on every rank -> [tp, *s]: rank r's tensor at index r."""
        return self.gather_last(t.unsqueeze(-1)).movedim(-1, 0)


SINGLE_RANK = Collectives(all_reduce=lambda t: t, gather_last=lambda t: t)


# --------------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------------
def _layer_weights(params, cfg: ModelConfig, prefix: str, name: str, kind: str, rank: int, tp: int) -> dict:
    w = {f"{name}_in_norm": params[f"{prefix}.input_layernorm.weight"],
         f"{name}_post_norm": params[f"{prefix}.post_attention_layernorm.weight"]}
    if kind == FULL:
        a = shard_attention(params, prefix, cfg, rank, tp)
        w.update({f"{name}_attn_{k}": a[k] for k in ATTN_WEIGHTS})
    else:
        g = shard_gdn(params, prefix, cfg, rank, tp)
        w.update({f"{name}_gdn_{k}": g[k] for k in GDN_WEIGHTS})
    m = shard_moe(params, prefix, cfg, rank, tp)
    w.update({f"{name}_moe_{k}": m[k] for k in MOE_WEIGHTS})
    return w


def rank_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights of the xla backend (module docstring), views of ``params`` where possible."""
    w = {"embed": params["model.embed_tokens.weight"], "lm_head": shard_lm_head(params, cfg, rank, tp),
         "final_norm": params["model.norm.weight"]}
    for i, kind in enumerate(cfg.layer_types):
        w.update(_layer_weights(params, cfg, f"model.layers.{i}", f"l{i}", kind, rank, tp))
    if cfg.mtp_num_hidden_layers:
        w["mtp_norm_emb"] = params["mtp.pre_fc_norm_embedding.weight"]
        w["mtp_norm_hidden"] = params["mtp.pre_fc_norm_hidden.weight"]
        w["mtp_fc"] = params["mtp.fc.weight"]
        lw = _layer_weights(params, cfg, "mtp.layers.0", "mtp", FULL, rank, tp)
        w.update(lw)
        w["mtp_norm"] = params["mtp.norm.weight"]
    return w


# --------------------------------------------------------------------------------------------------
# Blocks (one rank; T tokens; x [T, H] in the activation dtype)
# --------------------------------------------------------------------------------------------------
def _positions(pos: torch.Tensor, t: int, device) -> torch.Tensor:
    """Positions pos..pos+t-1 as int64 [t] from an int32 [1, 1] tensor."""
    return pos.reshape(-1)[:1].long() + torch.arange(t, device=device)


def masked_attention(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, positions: torch.Tensor, scale: float
                     ) -> torch.Tensor:
    """``model.functional.causal_attention`` over the WHOLE cache, rows past each query's position masked.

    q [T, Hq, D]; kc, vc [Hkv, L, D]; positions int64 [T]. Scores and softmax in fp32. Returns [T, Hq, D]
    in q's dtype. Masked rows get probability exactly 0, so the result equals attending rows 0..pos."""
    t, hq, _ = q.shape
    hkv, length, _ = kc.shape
    k = kc.float().repeat_interleave(hq // hkv, dim=0)
    v = vc.float().repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("thd,hnd->htn", q.float(), k) * scale
    mask = torch.arange(length, device=q.device)[None, :] > positions[:, None]  # [T, L]
    scores = scores.masked_fill(mask[None], float("-inf"))
    return torch.einsum("htn,hnd->thd", torch.softmax(scores, dim=-1), v).to(q.dtype)


def attention(w: dict, pre: str, x: torch.Tensor, ks: list, vs: list, pos: torch.Tensor, cos: torch.Tensor,
              sin: torch.Tensor, cfg: ModelConfig):
    """One rank's gated GQA attention (``model.tp.attention.attention_rank`` with tensor positions).

    ks, vs: the rank's caches, one [1, L, D] per KV-head group; cos, sin [T, rotary_dim] float32.
    Returns (o_proj partial [T, H] float32, new ks, new vs) with rows pos..pos+T-1 written."""
    t, d = x.shape[0], cfg.head_dim
    q_proj = w[pre + "q_proj"]
    hq, nk = q_proj.shape[0] // (2 * d), len(ks)
    qg = F.linear(x, q_proj).reshape(t, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
    k = F.linear(x, w[pre + "k_proj"]).reshape(t, nk, d)
    v = F.linear(x, w[pre + "v_proj"]).reshape(t, nk, d)
    q = fn.rms_norm(q, w[pre + "q_norm"], cfg.rms_norm_eps)
    k = fn.rms_norm(k, w[pre + "k_norm"], cfg.rms_norm_eps)
    q, k = fn.apply_partial_rope(q, cos, sin), fn.apply_partial_rope(k, cos, sin)
    positions = _positions(pos, t, x.device)
    kc = torch.cat(ks, dim=0)
    vc = torch.cat(vs, dim=0)
    kc = kc.index_copy(1, positions, k.transpose(0, 1).to(kc.dtype))
    vc = vc.index_copy(1, positions, v.transpose(0, 1).to(vc.dtype))
    o = masked_attention(q, kc, vc, positions, d ** -0.5).reshape(t, -1)
    o = (o.float() * torch.sigmoid(gate.float())).to(x.dtype)
    return F.linear(o.float(), w[pre + "o_proj"].float()), list(kc.split(1, dim=0)), list(vc.split(1, dim=0))


def gdn(w: dict, pre: str, dims: GdnDims, x: torch.Tensor, windows: torch.Tensor, states: torch.Tensor,
        read_slot: torch.Tensor):
    """One rank's GDN mixer reading checkpoint slot ``read_slot`` (int32 [1, 1]).

    windows [slots, K-1, C_rank], states [slots, Hv_rank, Dk, Dv] float32. Returns (partial [T, H] float32,
    new windows, new states): slot j holds the state after token j (j < T), other slots are kept."""
    idx = read_slot.reshape(-1)[:1].long()
    window = windows.index_select(0, idx)[0]
    state = states.index_select(0, idx)[0]
    partial, new_w, new_s = gdn_rank(dims, {k: w[pre + k] for k in GDN_WEIGHTS}, x, window, state)
    t = x.shape[0]
    return partial, torch.cat([new_w.to(windows.dtype), windows[t:]]), torch.cat([new_s, states[t:]])


def moe(w: dict, pre: str, x: torch.Tensor, top_k: int) -> torch.Tensor:
    """One rank's MoE partial [T, H] float32 (``model.tp.moe.moe_rank`` without host-side loops): the
    selected experts' intermediate slices are gathered by index, [T, k, I_r, H]."""
    weights, idx = fn.route(F.linear(x, w[pre + "router"]), top_k)  # [T, k] fp32, int64
    xe = x[:, None, :, None]                                         # [T, 1, H, 1]
    hg = torch.matmul(w[pre + "gate"][idx], xe)[..., 0]              # [T, k, I_r] activation dtype
    hu = torch.matmul(w[pre + "up"][idx], xe)[..., 0]
    h = (F.silu(hg.float()) * hu.float()).to(x.dtype)
    y = torch.matmul(w[pre + "down"][idx], h[..., None])[..., 0]     # [T, k, H]
    out = (weights.to(x.dtype).float()[..., None] * y.float()).sum(dim=1)
    shared = fn.swiglu_mlp(x, w[pre + "shared_gate"], w[pre + "shared_up"], w[pre + "shared_down"]).float()
    return out + torch.sigmoid(F.linear(x, w[pre + "shared_expert_gate"]).float()) * shared


def greedy(lm_head: torch.Tensor, h: torch.Tensor, coll: Collectives) -> torch.Tensor:
    """Greedy token of each row of the post-norm hidden h [T, H] over the vocabulary split by rows of
    ``lm_head`` [V/tp, H]: int64 [T]. Each rank's (max, first index) is packed as fp32 (indices < 2^24)
    and gathered once; the largest value wins, the lowest global index among equal values
    (``torch.argmax`` semantics, as ``model.tp.embed_head.combine_argmax``)."""
    logits = F.linear(h, lm_head).float()  # rounded to the activation dtype first, as the reference
    idx = torch.argmax(logits, dim=-1)
    val = logits.gather(-1, idx[:, None])[:, 0]
    allp = coll.gather_ranks(torch.stack([val, idx.float()], dim=-1))  # [tp, T, 2]
    values, local = allp[..., 0], allp[..., 1].long()
    gidx = local + lm_head.shape[0] * torch.arange(allp.shape[0], device=h.device)[:, None]
    best = values.max(dim=0).values
    cand = torch.where(values == best[None], gidx, torch.full_like(gidx, torch.iinfo(torch.int64).max))
    return cand.min(dim=0).values


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Residual update x + (fp32 sum of partials), rounded once to x's dtype."""
    return (x.float() + y).to(x.dtype)


def _caches(st: dict, name: str, groups: int):
    return [st[f"{name}_g{g}_k"] for g in range(groups)], [st[f"{name}_g{g}_v"] for g in range(groups)]


def _put_caches(st: dict, name: str, ks: list, vs: list):
    for g, (k, v) in enumerate(zip(ks, vs)):
        st[f"{name}_g{g}_k"], st[f"{name}_g{g}_v"] = k, v


def mtp(cfg: ModelConfig, spec: RoundSpec, w: dict, st: dict, ids: torch.Tensor, h: torch.Tensor, pos, cos, sin,
        coll: Collectives) -> torch.Tensor:
    """MTP head at one position (vLLM's Qwen3_5MoeMTP, as ``ReferenceModel.mtp``): ids int64 [1] (token p+1),
    h [1, H] (trunk hidden at p). Writes the MTP KV row ``pos`` into ``st``. Returns the post-``mtp.norm``
    hidden [1, H]."""
    eps = cfg.rms_norm_eps
    dtype = w["embed"].dtype
    e = fn.rms_norm(F.embedding(ids, w["embed"]), w["mtp_norm_emb"], eps)
    hh = fn.rms_norm(h.to(dtype), w["mtp_norm_hidden"], eps)
    x = F.linear(torch.cat([e, hh], dim=-1), w["mtp_fc"])
    ks, vs = _caches(st, "mtp", spec.kv_groups)
    part, ks, vs = attention(w, "mtp_attn_", fn.rms_norm(x, w["mtp_in_norm"], eps), ks, vs, pos, cos, sin, cfg)
    _put_caches(st, "mtp", ks, vs)
    x = _add(x, coll.all_reduce(part))
    x = _add(x, coll.all_reduce(moe(w, "mtp_moe_", fn.rms_norm(x, w["mtp_post_norm"], eps), cfg.num_experts_per_tok)))
    return fn.rms_norm(x, w["mtp_norm"], eps)


def forward(cfg: ModelConfig, spec: RoundSpec, w: dict, st: dict, rt: dict, coll: Collectives):
    """One rank's launch: the round (``spec.mode == "round"``) or plain step (``"step"``).

    w: :func:`rank_weights`; st: the rank's decode-state buffers the graph takes (``assembly.graph_states``:
    a step takes no MTP cache), not modified;
    rt: run-time inputs as torch tensors (``assembly.round_inputs`` / ``step_inputs``).
    Returns (draft int32 [1, 1], targets int32 [T, 1], hidden [T, H] activation dtype, new state
    {name: tensor} for ``megakernel.round.mutated_names(spec)``) -- the kernel's outputs, in its order."""
    eps, top_k = cfg.rms_norm_eps, cfg.num_experts_per_tok
    dims = GdnDims.of(cfg, spec.tp)
    new = dict(st)
    pending = rt["pending"].reshape(-1)[:1].long()
    if spec.mode == "round":
        hm = mtp(cfg, spec, w, new, pending, rt["hidden"].reshape(1, -1), rt["pos_d1"], rt["cos_d1"], rt["sin_d1"],
                 coll)
        draft = greedy(w["lm_head"], hm, coll)
        force = rt["force"].reshape(-1).long()
        draft = torch.where(force[0] == 1, force[1:2], draft)
        ids = torch.cat([pending, draft])
    else:
        draft, ids = pending, pending
    x = F.embedding(ids, w["embed"])
    for i, kind in enumerate(spec.layer_types):
        pre = f"l{i}_"
        h = fn.rms_norm(x, w[pre + "in_norm"], eps)
        if kind == FULL:
            ks, vs = _caches(new, f"l{i}", spec.kv_groups)
            part, ks, vs = attention(w, pre + "attn_", h, ks, vs, rt["pos"], rt["cos_v"], rt["sin_v"], cfg)
            _put_caches(new, f"l{i}", ks, vs)
        else:
            part, new[f"l{i}_window"], new[f"l{i}_state"] = gdn(
                w, pre + "gdn_", dims, h, new[f"l{i}_window"], new[f"l{i}_state"], rt["read_slot"])
        x = _add(x, coll.all_reduce(part))
        x = _add(x, coll.all_reduce(moe(w, pre + "moe_", fn.rms_norm(x, w[pre + "post_norm"], eps), top_k)))
    hidden = fn.rms_norm(x, w["final_norm"], eps)
    targets = greedy(w["lm_head"], hidden, coll)
    if spec.mode == "round":  # D2: only the MTP KV row at pos is kept (the rest is dead code to XLA)
        mtp(cfg, spec, w, new, draft, hidden[0:1], rt["pos"], rt["cos_v"][0:1], rt["sin_v"][0:1], coll)
    return (draft.reshape(1, 1).to(torch.int32), targets.reshape(-1, 1).to(torch.int32), hidden,
            {n: new[n] for n in mutated_names(spec)})
