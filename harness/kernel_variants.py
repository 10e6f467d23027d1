"""The kernel variants, run under nkisim: ``layerwise`` (one launch per layer stage) and ``megakernel``
(one launch per round), behind the same ``Variant`` interface as ``xla``.

Both convert the checkpoint once into the kernels' per-rank layouts (``megakernel.sharded``), take the
reference prefill's state in those layouts, and launch on a simulated trn2 chip of ``tp`` ranks x
``lnc`` cores with ``nkisim.launch``. The host keeps the committed slot (``read_slot``) and passes it
to every launch; committing moves nothing.
"""

from __future__ import annotations

import numpy as np
import torch

import nkisim
from harness.nxdi.assembly import i32 as _i32
from harness.nxdi.assembly import round_inputs, rope_rows, step_inputs
from harness.variants import RoundOutput, Variant
from megakernel import layerwise as lw  # importing nki_kernels installs nkisim where the SDK is absent
from megakernel.round import RoundSpec, build_kernel, mutated_names
from megakernel.sharded import gather_state, kv_groups, moe_weights, rank_state, rank_weights
from model.config import FULL, ModelConfig
from model.tp.embed_head import vocab_per_core
from nki_kernels.embedding import embedding_kernel


class KernelVariant(Variant):
    """Shared host side: per-rank weights, per-rank kernel state, slot bookkeeping."""

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor], tp: int = 4, lnc: int = 2):
        super().__init__(cfg, params)
        self.tp, self.lnc = tp, lnc
        self.weights = [rank_weights(cfg, params, r, tp, lnc) for r in range(tp)]
        self.groups = len(kv_groups(cfg, 0, tp))
        self.vc = vocab_per_core(cfg, tp * lnc)
        self.launches = 0
        self.kstate: list[dict[str, torch.Tensor]] = []
        self.read_slot = 0

    def prefill(self, prompt, max_len):
        first, h = super().prefill(prompt, max_len)
        self.kstate = [rank_state(self.cfg, self.state, r, self.tp) for r in range(self.tp)]
        self.read_slot = 0
        return first, h

    def commit(self, accepted: int) -> None:
        if accepted not in (1, 2):
            raise ValueError(f"commit: accepted must be 1 or 2, found {accepted}")
        self.read_slot = accepted - 1

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        st = gather_state(self.cfg, self.kstate, self.state, self.read_slot)
        return st.committed(length)

    def launch(self, kernel, per_rank: list) -> list:
        self.launches += 1
        return nkisim.launch(kernel, per_rank, tp=self.tp, lnc=self.lnc)

    def rope(self, start: int, T: int):
        return rope_rows(self.cfg, start, T)


class MegakernelVariant(KernelVariant):
    """One launch per round (D1 + V + D2) per rank; one launch per token with --no-spec."""

    name = "megakernel"

    def _run(self, mode: str, runtime: dict) -> tuple:
        spec = RoundSpec(tuple(self.cfg.layer_types), self.groups, self.tp, self.lnc, float(self.cfg.rms_norm_eps),
                         self.cfg.num_experts_per_tok, self.vc, mode)
        per_rank = [{**w, **st, **runtime} for w, st in zip(self.weights, self.kstate)]
        kernel = build_kernel(spec, sorted(per_rank[0]))
        outs = self.launch(kernel, per_rank)
        draft, targets, hidden = outs[0][:3]
        for st, out in zip(self.kstate, outs):  # the launch wrote the state in place; keep its handles
            st.update(zip(mutated_names(spec), out[3:]))
        return int(draft.reshape(-1)[0]), [int(t) for t in targets.reshape(-1)], hidden

    def round(self, pending, hidden, pos, forced_draft=None):
        runtime = round_inputs(self.cfg, self.ref.dtype, pending, hidden, pos, self.read_slot, forced_draft)
        draft, targets, hv = self._run("round", runtime)
        return RoundOutput(draft, (targets[0], targets[1]), hv)

    def step(self, token, pos):
        _, targets, hv = self._run("step", step_inputs(self.cfg, token, pos, self.read_slot))
        self.commit(1)
        return targets[0], hv[0]


class LayerwiseVariant(KernelVariant):
    """One launch per layer stage per rank; reductions and residual adds on the host between launches."""

    name = "layerwise"

    def _sum(self, partials: list) -> torch.Tensor:
        """Per-rank ``[lnc, T, H]`` float32 partials -> their sum in the megakernel's fixed order:
        per core lane the ranks in ascending order, then lane 0 + lane 1."""
        lanes = []
        for c in range(self.lnc):
            acc = partials[0][c].clone()
            for r in range(1, self.tp):
                acc = acc + partials[r][c]
            lanes.append(acc)
        return lanes[0] + lanes[1] if self.lnc == 2 else lanes[0]

    def _add(self, x: torch.Tensor, partials: list) -> torch.Tensor:
        return (x.float() + self._sum(partials)).to(x.dtype)

    def _attention(self, prefix: str, x, pos: int, cos, sin):
        """Per-rank attention partials, the rank's KV-head groups summed first (as in the megakernel)."""
        per_rank = [None] * self.tp
        eps = float(self.cfg.rms_norm_eps)
        norm = "mtp_in_norm" if prefix == "mtp" else f"{prefix}_in_norm"
        for g in range(self.groups):
            p = f"{prefix}_g{g}_"
            outs = self.launch(lw.attention_stage[self.lnc], [
                (x, w[norm], w[p + "wqg"], w[p + "wk"], w[p + "wv"], w[p + "wo"], w[p + "norm_w"], cos, sin,
                 st[p + "k"], st[p + "v"], _i32(pos), eps) for w, st in zip(self.weights, self.kstate)])
            for r, (part, k, v) in enumerate(outs):
                per_rank[r] = part if g == 0 else per_rank[r] + part
                self.kstate[r][p + "k"], self.kstate[r][p + "v"] = k, v
        return per_rank

    def _moe(self, x, norm: str, prefix: str, layer):
        k = self.cfg.num_experts_per_tok
        eps = float(self.cfg.rms_norm_eps)
        if layer is None:
            tables = [(w[prefix + "router"], w[prefix + "experts"], w[prefix + "shared"], None) for w in self.weights]
        else:  # the layer's stacked group (int32 offsets) and its index in it
            tables = [moe_weights(w, layer) for w in self.weights]
        return self.launch(lw.moe_stage[self.lnc], [
            (x, w[norm], r, e, s, k, i, eps) for w, (r, e, s, i) in zip(self.weights, tables)])

    def _head(self, x, norm: str):
        """(greedy token ids [T], post-norm hidden [T, H]) with the lowest global index winning ties."""
        outs = self.launch(lw.head_stage[self.lnc], [(x, w[norm], w["lm_head"], float(self.cfg.rms_norm_eps))
                                                     for w in self.weights])
        best = torch.cat([torch.as_tensor(b) for b, _ in outs])  # [tp*lnc, T, 2], global core order
        values, local = best[..., 0], best[..., 1]
        idx = local + self.vc * torch.arange(best.shape[0], dtype=torch.float32)[:, None]
        top = values.max(dim=0).values
        idx = torch.where(values == top, idx, torch.full_like(idx, float("inf"))).min(dim=0).values
        return [int(i) for i in idx], outs[0][1]

    def _embed(self, ids: list[int]):
        table = self.weights[0]["embed"]
        return torch.as_tensor(embedding_kernel(table, np.array(ids, np.int32).reshape(-1, 1))[0])

    def _trunk(self, ids: list[int], pos: int):
        x = self._embed(ids)
        cos, sin = self.rope(pos, len(ids))
        eps = float(self.cfg.rms_norm_eps)
        for i, kind in enumerate(self.cfg.layer_types):
            if kind == FULL:
                x = self._add(x, self._attention(f"l{i}", x, pos, cos, sin))
            else:
                g = f"l{i}_gdn_"
                outs = self.launch(lw.gdn_stage[self.lnc], [
                    (x, w[f"l{i}_in_norm"], w[g + "w_in"], w[g + "conv_w"], w[g + "A_log"], w[g + "dt_bias"],
                     w[g + "norm_w"], w[g + "w_out"], st[f"l{i}_window"], st[f"l{i}_state"],
                     _i32(self.read_slot), eps) for w, st in zip(self.weights, self.kstate)])
                for st, (_, win, s) in zip(self.kstate, outs):
                    st[f"l{i}_window"], st[f"l{i}_state"] = win, s
                x = self._add(x, [o[0] for o in outs])
            x = self._add(x, self._moe(x, f"l{i}_post_norm", "moe_", i))
        return self._head(x, "final_norm")

    def _mtp(self, token: int, hidden, pos: int, with_head: bool):
        e = self._embed([token])
        eps = float(self.cfg.rms_norm_eps)
        h = hidden.reshape(1, -1).to(self.ref.dtype)
        outs = self.launch(lw.mtp_fc_stage[self.lnc], [
            (e, h, w["mtp_norm_emb"], w["mtp_norm_hidden"], w["mtp_fc"], eps) for w in self.weights])
        x = torch.cat([torch.as_tensor(o[c]) for o in outs for c in range(self.lnc)], dim=-1).to(self.ref.dtype)
        cos, sin = self.rope(pos, 1)
        x = self._add(x, self._attention("mtp", x, pos, cos, sin))
        x = self._add(x, self._moe(x, "mtp_post_norm", "mtp_moe_", None))
        return self._head(x, "mtp_norm")[0][0] if with_head else None

    def round(self, pending, hidden, pos, forced_draft=None):
        draft = self._mtp(pending, hidden, pos - 1, with_head=True)
        if forced_draft is not None:
            draft = forced_draft
        targets, hv = self._trunk([pending, draft], pos)
        self._mtp(draft, hv[0], pos, with_head=False)
        return RoundOutput(draft, (targets[0], targets[1]), torch.as_tensor(hv))

    def step(self, token, pos):
        targets, hv = self._trunk([token], pos)
        self.commit(1)
        return targets[0], torch.as_tensor(hv)[0]
