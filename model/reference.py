"""The PyTorch reference model: trunk, MTP head and LM head over a parameter dict and a DecodeState.

This is the "xla" variant's math (a plain model with no custom kernels) and the
twin every NKI kernel is compared with. Parameter names are the canonical ones of
``model.params``; shapes and layouts are documented in ``model.functional``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import functional as fn
from model.config import FULL, ModelConfig
from model.state import DecodeState


class ReferenceModel:
    """Qwen3.5/3.6-MoE text model plus MTP head, batch 1.

    params: canonical name -> tensor (``model.params.expected_shapes``), weights in
    the activation dtype (bfloat16 or float32), A_log/dt_bias float32.
    """

    def __init__(self, cfg: ModelConfig, params: dict[str, torch.Tensor]):
        self.cfg = cfg
        self.p = params
        self.dtype = params["model.embed_tokens.weight"].dtype

    # ---- building blocks ---------------------------------------------------
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids: [T] int64 -> [T, H]."""
        return F.embedding(ids, self.p["model.embed_tokens.weight"])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Post-norm hidden [T, H] -> logits [T, V] (fp32)."""
        w = self.p["model.embed_tokens.weight" if self.cfg.tie_word_embeddings else "lm_head.weight"]
        return F.linear(hidden, w).float()

    def norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        return fn.rms_norm(x, self.p[name], self.cfg.rms_norm_eps)

    def gdn_mixer(self, prefix: str, x: torch.Tensor, window: torch.Tensor, state: torch.Tensor,
                  chunked: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gated DeltaNet mixer on normed x [T, H].

        window: [K-1, conv_dim] raw projections before x; state: [Hv, Dk, Dv] fp32.
        Returns (out [T, H], windows [T, K-1, conv_dim], states [T, Hv, Dk, Dv] fp32) —
        with chunked=True (prefill) only the final window/state: shapes [1, ...].
        """
        c, p = self.cfg, self.p
        a = f"{prefix}.linear_attn"
        t = x.shape[0]
        u = F.linear(x, p[f"{a}.in_proj_qkv.weight"])  # [T, conv_dim]
        z = F.linear(x, p[f"{a}.in_proj_z.weight"]).reshape(t, c.linear_num_value_heads, c.linear_value_head_dim)
        b = F.linear(x, p[f"{a}.in_proj_b.weight"])
        av = F.linear(x, p[f"{a}.in_proj_a.weight"])
        conv_out, windows = fn.causal_conv(u, window, p[f"{a}.conv1d.weight"][:, 0, :])
        kd, vd = c.linear_key_dim, c.linear_value_dim
        q = conv_out[:, :kd].reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
        k = conv_out[:, kd:2 * kd].reshape(t, c.linear_num_key_heads, c.linear_key_head_dim)
        v = conv_out[:, 2 * kd:].reshape(t, c.linear_num_value_heads, c.linear_value_head_dim)
        q = fn.l2norm(q.float()) * c.linear_key_head_dim ** -0.5
        k = fn.l2norm(k.float())
        g, beta = fn.gdn_gates(av, b, p[f"{a}.A_log"], p[f"{a}.dt_bias"])
        if chunked:
            o, final = fn.gdn_chunked(q, k, v, g, beta, state)
            windows, states = windows[-1:], final[None]
        else:
            o, states = fn.gdn_recurrent(q, k, v, g, beta, state)
        y = fn.gated_rms_norm(o.to(self.dtype), z, p[f"{a}.norm.weight"], c.rms_norm_eps)
        return F.linear(y.reshape(t, vd), p[f"{a}.out_proj.weight"]), windows, states

    def attention_mixer(self, prefix: str, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                        start: int) -> torch.Tensor:
        """Gated GQA attention on normed x [T, H] at positions start..start+T-1.

        Writes the T new K/V rows into kv ([Hkv, L, D] each) in place, then attends
        causally over rows 0..start+T-1. Returns [T, H].
        """
        c, p = self.cfg, self.p
        a = f"{prefix}.self_attn"
        t, d = x.shape[0], c.head_dim
        qg = F.linear(x, p[f"{a}.q_proj.weight"]).reshape(t, c.num_attention_heads, 2 * d)
        q, gate = qg[..., :d], qg[..., d:].reshape(t, -1)
        k = F.linear(x, p[f"{a}.k_proj.weight"]).reshape(t, c.num_key_value_heads, d)
        v = F.linear(x, p[f"{a}.v_proj.weight"]).reshape(t, c.num_key_value_heads, d)
        q = fn.rms_norm(q, p[f"{a}.q_norm.weight"], c.rms_norm_eps)
        k = fn.rms_norm(k, p[f"{a}.k_norm.weight"], c.rms_norm_eps)
        cos, sin = fn.rope_cos_sin(torch.arange(start, start + t), c.rotary_dim, c.rope_theta)
        q, k = fn.apply_partial_rope(q, cos, sin), fn.apply_partial_rope(k, cos, sin)
        kc, vc = kv
        if start + t > kc.shape[1]:
            raise ValueError(f"attention: positions up to {start + t - 1} exceed the KV cache length {kc.shape[1]}")
        kc[:, start:start + t] = k.transpose(0, 1).to(kc.dtype)
        vc[:, start:start + t] = v.transpose(0, 1).to(vc.dtype)
        o = fn.causal_attention(q, kc, vc, start, d ** -0.5).reshape(t, -1)
        o = (o.float() * torch.sigmoid(gate.float())).to(self.dtype)
        return F.linear(o, p[f"{a}.o_proj.weight"])

    def moe(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        m = f"{prefix}.mlp"
        p = self.p
        return fn.sparse_moe(
            x, p[f"{m}.gate.weight"], p[f"{m}.experts.gate_up_proj"], p[f"{m}.experts.down_proj"],
            p[f"{m}.shared_expert.gate_proj.weight"], p[f"{m}.shared_expert.up_proj.weight"],
            p[f"{m}.shared_expert.down_proj.weight"], p[f"{m}.shared_expert_gate.weight"],
            self.cfg.num_experts_per_tok)

    # ---- trunk and heads -----------------------------------------------------
    def trunk(self, ids: torch.Tensor, state: DecodeState, start: int, chunked: bool) -> torch.Tensor:
        """Run the trunk on tokens ids [T] at positions start..start+T-1.

        GDN layers read the committed slot ``state.read_slot``. chunked=True (prefill):
        the final conv window and recurrent state go to slot 0 and read_slot becomes 0.
        chunked=False (decode/verify): slot j receives the state after token j.
        KV rows start..start+T-1 are written. Returns the post-final-norm hidden [T, H].
        """
        x = self.embed(ids)
        src = state.read_slot
        for i, kind in enumerate(self.cfg.layer_types):
            pre = f"model.layers.{i}"
            h = self.norm(f"{pre}.input_layernorm.weight", x)
            if kind == FULL:
                mix = self.attention_mixer(pre, h, state.kv[i], start)
            else:
                window = state.conv[i][src].clone()
                rec = state.recurrent[i][src].clone()
                mix, windows, states = self.gdn_mixer(pre, h, window, rec, chunked)
                n = windows.shape[0]
                state.conv[i][:n] = windows.to(state.conv[i].dtype)
                state.recurrent[i][:n] = states
            x = x + mix
            x = x + self.moe(pre, self.norm(f"{pre}.post_attention_layernorm.weight", x))
        if chunked:
            state.read_slot = 0
        return self.norm("model.norm.weight", x)

    def mtp(self, next_ids: torch.Tensor, hidden: torch.Tensor, state: DecodeState, start: int) -> torch.Tensor:
        """MTP head at positions start..start+T-1 (vLLM's Qwen3_5MoeMTP).

        next_ids: [T] the token at position p+1 for each position p; hidden: [T, H] the
        trunk's post-final-norm hidden at p. Writes the MTP KV rows. Returns the
        post-``mtp.norm`` hidden [T, H]; ``logits`` of it predicts the token at p+2.
        """
        e = self.norm("mtp.pre_fc_norm_embedding.weight", self.embed(next_ids))
        h = self.norm("mtp.pre_fc_norm_hidden.weight", hidden.to(self.dtype))
        x = F.linear(torch.cat([e, h], dim=-1), self.p["mtp.fc.weight"])
        pre = "mtp.layers.0"
        x = x + self.attention_mixer(pre, self.norm(f"{pre}.input_layernorm.weight", x), state.mtp_kv, start)
        x = x + self.moe(pre, self.norm(f"{pre}.post_attention_layernorm.weight", x))
        return self.norm("mtp.norm.weight", x)
