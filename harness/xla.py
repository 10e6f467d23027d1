"""The xla variant: one rank's launch of a ``megakernel.plan.Plan`` as plain, traceable PyTorch over the ``model.tp``
twins -- what the NxDI application traces for ``backend="xla"`` (``harness.nxdi.modeling``) and what
``harness.engines.XlaEngine`` runs in process, one thread per rank (:class:`ThreadWorld`).

Same stages, run-time inputs (``plan.input_specs``), decode-state buffers in the same stacked per-rank layout
(``plan.state_specs``) and outputs as the megakernel (``megakernel.round``), so the host loop cannot tell them
apart. Traceable: positions, the read slot and the forced draft are tensors; nothing calls ``.item()``,
``.tolist()`` or ``int(tensor)`` or branches on a tensor, and nothing is created off the inputs' device (tested with
fake and meta tensors). Sums over ranks are fp32 partials (``model.tp.collectives``).

Per-rank weights (:func:`rank_weights`, PyTorch ``[out, in]`` layouts, stacked like the kernels')
    ``embed`` [V, H] (replicated), ``lm_head`` [V/tp, H] (the rank's vocabulary rows), ``norms`` [N, H] (the
    zero-centred weights, rows ``plan.NormRows``), ``mtp_fc`` [H, 2H] (replicated); ``gdn_<name>`` [G, ...] for the
    names of ``model.tp.gdn.WEIGHT_NAMES`` (``shard_gdn``), ``attn_<name>`` [A, ...] (``shard_attention``; trunk
    full-attention layers then MTP, all the rank's KV heads per entry), ``moe_<name>`` [M, ...] (``shard_moe``;
    trunk layers then MTP; a checkpoint with fp8 experts, ``model.tp.moe.quantize_fp8``, adds their scales).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from harness.sampling import probabilities
from megakernel import plan as rp
from megakernel.sharded import attention_prefixes, moe_prefixes, norm_names
from model import functional as fn
from model.config import ModelConfig
from model.tp.attention import attention_rank, shard_attention
from model.tp.collectives import Collectives
from model.tp.embed_head import greedy_rank, shard_lm_head
from model.tp.gdn import WEIGHT_NAMES as GDN_WEIGHTS
from model.tp.gdn import GdnDims, gdn_rank_slots, shard_gdn
from model.tp.moe import FP8_SCALES, moe_rank, shard_moe

ATTN_WEIGHTS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")
MOE_WEIGHTS = ("router", "shared_expert_gate", "gate", "up", "down", "shared_gate", "shared_up", "shared_down")


# ---- weights -----------------------------------------------------------------------------------------------
def rank_weights(cfg: ModelConfig, params: dict[str, torch.Tensor], rank: int, tp: int, draft_ids=None
                 ) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s weights of the xla variant (module docstring). ``draft_ids``: an FR-Spec draft vocabulary
    (``model.draft_vocab.load``, ascending): adds ``draft_head`` (the rank's part of its LM-head rows, [Vd/tp, H])
    and ``draft_ids`` [Vd] int64, which the drafts then use instead of ``lm_head``."""
    w = {"embed": params["model.embed_tokens.weight"], "lm_head": shard_lm_head(params, cfg, rank, tp),
         "norms": torch.stack([params[n] for n in norm_names(cfg)])}
    if cfg.mtp_num_hidden_layers:
        w["mtp_fc"] = params["mtp.fc.weight"]
    gdn = [shard_gdn(params, f"model.layers.{i}", cfg, rank, tp) for i in cfg.linear_layers]
    for k in GDN_WEIGHTS if gdn else ():
        w["gdn_" + k] = torch.stack([g[k] for g in gdn])
    attn = [shard_attention(params, p, cfg, rank, tp) for p in attention_prefixes(cfg)]
    for k in ATTN_WEIGHTS if attn else ():
        w["attn_" + k] = torch.stack([a[k] for a in attn])
    moe = [shard_moe(params, p, cfg, rank, tp) for p in moe_prefixes(cfg)]
    for k in MOE_WEIGHTS + FP8_SCALES:
        if k in moe[0]:
            w["moe_" + k] = torch.stack([m[k] for m in moe])
    if draft_ids is not None:
        from model.draft_vocab import draft_head_rows
        w["draft_head"] = draft_head_rows(params, cfg, draft_ids, rank, tp)
        w["draft_ids"] = torch.as_tensor(draft_ids, dtype=torch.int64)
    return w


def _attention_shard(w: dict, a: int, cfg: ModelConfig, groups: int) -> dict:
    s = {k: w["attn_" + k][a] for k in ATTN_WEIGHTS}
    s["num_heads"] = s["q_proj"].shape[0] // (2 * cfg.head_dim)
    s["num_kv_heads"] = groups
    return s


# ---- one rank's launch ---------------------------------------------------------------------------------------
class _State:
    """The decode state of one launch as per-layer pieces (functional updates; stacked again at the end)."""

    def __init__(self, st: dict):
        self.windows = list(st["gdn_window"].unbind(0)) if "gdn_window" in st else []
        self.states = list(st["gdn_state"].unbind(0)) if "gdn_state" in st else []
        self.k, self.v = st["attn_k"], st["attn_v"]

    def stacked(self) -> dict:
        out = {"attn_k": self.k, "attn_v": self.v}
        if self.windows:
            out["gdn_window"], out["gdn_state"] = torch.stack(self.windows), torch.stack(self.states)
        return out


def _add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Residual update x + (fp32 sum of partials), rounded once to x's dtype."""
    return (x.float() + y).to(x.dtype)


def decoder_layer(cfg: ModelConfig, plan, layer, w: dict, st: _State, x, pos, cos, sin, read_slot, coll):
    """One decoder layer of the plan on x [T, H]: x += mixer(norm(x)), x += MoE(norm(x)), partials summed over
    the ranks."""
    eps = plan.eps
    h = fn.rms_norm(x, w["norms"][layer.in_norm], eps)
    if layer.kind == rp.ATTENTION:
        a0, g = layer.mixer * layer.groups, layer.groups
        part, kc, vc = attention_rank(_attention_shard(w, layer.mixer, cfg, g), h, st.k[a0:a0 + g], st.v[a0:a0 + g],
                                      pos, cfg, cos, sin)
        st.k = torch.cat([st.k[:a0], kc, st.k[a0 + g:]])
        st.v = torch.cat([st.v[:a0], vc, st.v[a0 + g:]])
    else:
        j = layer.mixer
        part, st.windows[j], st.states[j] = gdn_rank_slots(
            GdnDims.of(cfg, plan.tp), {k: w["gdn_" + k][j] for k in GDN_WEIGHTS}, h, st.windows[j], st.states[j],
            read_slot)
    x = _add(x, coll.all_reduce(part))
    shard = {k: w["moe_" + k][layer.moe] for k in MOE_WEIGHTS + FP8_SCALES if "moe_" + k in w}
    return _add(x, coll.all_reduce(moe_rank(shard, fn.rms_norm(x, w["norms"][layer.post_norm], eps), plan.top_k)))


def _stage_inputs(stage, rt):
    if stage.inputs == "d1":
        r = stage.rope_row
        return rt["pos_d1"][r:r + 1], rt["cos_d1"][r:r + 1], rt["sin_d1"][r:r + 1]
    r0, r1 = stage.rope_row, stage.rope_row + stage.tokens
    return rt["pos"], rt["cos_v"][r0:r1], rt["sin_v"][r0:r1]


def mtp_head(cfg: ModelConfig, plan, stage, w: dict, st: _State, ids: torch.Tensor, h: torch.Tensor, rt, coll):
    """The MTP head (vLLM's Qwen3_5MoeMTP, as ``ReferenceModel.mtp``) at the stage's T positions q: ids int64 [T]
    (token q+1), h [T, H] (hidden at q). Writes the MTP KV rows. Returns the post-``mtp.norm`` hidden [T, H]."""
    rows, eps = plan.norms, plan.eps
    dtype = w["embed"].dtype
    e = fn.rms_norm(F.embedding(ids, w["embed"]), w["norms"][rows.mtp_emb], eps)
    hh = fn.rms_norm(h.to(dtype), w["norms"][rows.mtp_hidden], eps)
    x = F.linear(torch.cat([e, hh], dim=-1), w["mtp_fc"])
    pos, cos, sin = _stage_inputs(stage, rt)
    x = decoder_layer(cfg, plan, stage.layers[0], w, st, x, pos, cos, sin, rt["read_slot"], coll)
    return fn.rms_norm(x, w["norms"][rows.mtp_final], eps)


def forward(cfg: ModelConfig, plan, w: dict, st: dict, rt: dict, coll: Collectives, sampling=None):
    """One rank's launch of ``plan`` (a round or a step). w: :func:`rank_weights`; st: the rank's decode state
    (``plan.STATE``, not modified); rt: the run-time inputs as torch tensors (``plan.input_specs``).
    Returns (drafts int32 [K, 1] (the pending token [1, 1] in a step), targets int32 [T, 1], hidden [T, H]
    activation dtype, new state {name: tensor} of ``plan.STATE``) -- the kernel's outputs, in its order.

    ``sampling`` (a ``harness.sampling.Sampling``, in-process engine only; None: greedy, the traced graph): draft i
    is drawn from the draft's processed distribution q_i as argmax(log q_i + rt["draft_noise"][i]) (Gumbel noise
    [K, V] from the host: an exact sample); two more outputs follow the state: q [K, V] float64 and the verify's
    full logits [T, V] float32 (for the host's rejection rule, ``harness.sampling.accept``)."""
    state = _State(st)
    pending = rt["pending"].reshape(-1)[:1].long()
    drafts, ids = [], pending
    chain_ids, chain_h = pending, None
    draft_probs = []
    targets = hidden = None
    for stage in plan.stages:
        if stage.kind == rp.DRAFT:
            h = rt["hidden"].reshape(1, -1) if stage.draft == 0 else chain_h
            chain_h = mtp_head(cfg, plan, stage, w, state, chain_ids, h, rt, coll)
            force = rt["force"][stage.draft].long()
            if sampling is None and "draft_head" in w:     # FR-Spec: argmax over the draft vocabulary's rows
                choice = w["draft_ids"][greedy_rank(w["draft_head"], chain_h, coll)]
            elif sampling is None:
                choice = greedy_rank(w["lm_head"], chain_h, coll)
            else:
                q = probabilities(coll.gather_last(F.linear(chain_h, w["lm_head"]).float()), sampling)
                choice = torch.argmax(torch.log(q) + rt["draft_noise"][stage.draft:stage.draft + 1].double(), dim=-1)
                draft_probs.append(q)
            chain_ids = torch.where(force[0] == 1, force[1:2], choice)
            drafts.append(chain_ids)
            ids = torch.cat([pending] + drafts)
        elif stage.kind == rp.VERIFY:
            x = F.embedding(ids, w["embed"])
            pos, cos, sin = _stage_inputs(stage, rt)
            for layer in stage.layers:
                x = decoder_layer(cfg, plan, layer, w, state, x, pos, cos, sin, rt["read_slot"], coll)
            hidden = fn.rms_norm(x, w["norms"][plan.norms.final], plan.eps)
            targets = greedy_rank(w["lm_head"], hidden, coll)
        else:  # replay: only the MTP KV rows are kept (the rest is dead code to XLA)
            K = len(drafts)
            mtp_head(cfg, plan, stage, w, state, ids[1:], hidden[0:K], rt, coll)
    out = ids[1:] if drafts else pending
    result = (out.reshape(-1, 1).to(torch.int32), targets.reshape(-1, 1).to(torch.int32), hidden, state.stacked())
    if sampling is None:
        return result
    q = torch.cat(draft_probs) if draft_probs else None
    return result + (q, coll.gather_last(F.linear(hidden, w["lm_head"]).float()))


# ---- one thread per rank on CPU --------------------------------------------------------------------------------
class ThreadWorld:
    """tp ranks, one thread each, with an all-reduce and an all-gather between them.

    Reductions add the ranks' tensors in rank order (identical on every rank, deterministic). A rank that raises
    aborts the barrier so the others fail instead of waiting forever."""

    def __init__(self, tp: int, timeout: float = 600.0):
        self.tp = tp
        self._slots: list = [None] * tp
        self._barrier = threading.Barrier(tp, timeout=timeout)

    def _exchange(self, rank: int, t: torch.Tensor) -> list[torch.Tensor]:
        self._slots[rank] = t
        self._barrier.wait()
        got = list(self._slots)
        self._barrier.wait()
        return got

    def collectives(self, rank: int) -> Collectives:
        def all_reduce(t):
            parts = self._exchange(rank, t)
            acc = parts[0]
            for p in parts[1:]:
                acc = acc + p
            return acc

        def gather_last(t):
            return torch.cat(self._exchange(rank, t), dim=-1)

        return Collectives(all_reduce=all_reduce, gather_last=gather_last)

    def run(self, fn_, per_rank_args: list) -> list:
        """fn_(rank, collectives, *args) on every rank; returns the results in rank order."""
        results: list = [None] * self.tp
        errors: list = [None] * self.tp

        def body(r):
            try:
                results[r] = fn_(r, self.collectives(r), *per_rank_args[r])
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors[r] = e
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}") for r in range(self.tp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        self._barrier.reset()
        first = next((e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)), None)
        if first is None:
            first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first
        return results
