"""Pure functions on tensors: the exact math of Qwen3.5/3.6-MoE (``shared/docs/qwen36.md`` §4).

Batch 1 throughout: token-major tensors ``[T, ...]`` with no batch dimension.
Numerics (DESIGN.md §4): matmuls take the activation dtype and accumulate in fp32;
norms, gates, softmax and the Gated DeltaNet recurrence run in fp32; the GDN
recurrent state is fp32. These functions are the "xla" variant's math and the
PyTorch twins of the NKI subkernels.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------
# Norms
# ---------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: ``x * rsqrt(mean(x^2) + eps) * (1 + weight)`` over the last dim.

    x: [..., D] any float dtype; weight: [D] (stored as an offset from 1). Computed
    in fp32, returned in x's dtype. Used for every norm except the GDN output norm.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: ``weight * x * rsqrt(mean(x^2) + eps) * silu(gate)`` per value head.

    x, gate: [..., Dv]; weight: [Dv] (plain weight, NOT zero-centred). fp32 inside,
    returned in x's dtype.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * y * F.silu(gate.float())).to(x.dtype)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x * rsqrt(sum(x^2) + eps)`` over the last dim (FLA's convention: eps inside the sqrt)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


# ---------------------------------------------------------------------------
# Rotary position embedding (partial, rotate-half)
# ---------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, rotary_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables [T, rotary_dim] (fp32) for integer positions [T].

    inv_freq_j = theta^(-2j/rotary_dim), j < rotary_dim/2; the table repeats the
    frequencies twice (rotate-half pairs (i, i + rotary_dim/2)).
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first rotary_dim dims of each head; the rest pass through.

    x: [T, heads, D]; cos, sin: [T, rotary_dim]. Computed in fp32, returned in x's dtype.
    """
    r = cos.shape[-1]
    xr, xp = x[..., :r].float(), x[..., r:]
    half = r // 2
    rotated = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([(xr * c + rotated * s).to(x.dtype), xp], dim=-1)


# ---------------------------------------------------------------------------
# Gated attention
# ---------------------------------------------------------------------------


def causal_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, start: int,
                     scale: float) -> torch.Tensor:
    """Softmax attention of T new queries over a KV cache that already holds them.

    q: [T, Hq, D] at positions start..start+T-1; k_cache, v_cache: [Hkv, L, D] with
    rows 0..start+T-1 valid (L may be larger). Query head h uses kv head h // (Hq/Hkv).
    Scores and softmax in fp32. Returns [T, Hq, D] in q's dtype.
    """
    t, hq, _ = q.shape
    hkv = k_cache.shape[0]
    n = start + t
    k = k_cache[:, :n].float().repeat_interleave(hq // hkv, dim=0)  # [Hq, n, D]
    v = v_cache[:, :n].float().repeat_interleave(hq // hkv, dim=0)
    scores = torch.einsum("thd,hnd->htn", q.float(), k) * scale  # [Hq, T, n]
    pos_q = start + torch.arange(t)[:, None]
    mask = torch.arange(n)[None, :] > pos_q  # [T, n]
    scores = scores.masked_fill(mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("htn,hnd->thd", probs, v)
    return out.to(q.dtype)


# ---------------------------------------------------------------------------
# Gated DeltaNet
# ---------------------------------------------------------------------------


def causal_conv(u: torch.Tensor, window: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv + SiLU over the raw projections of T tokens, with history.

    u: [T, C] raw pre-conv projections (q ‖ k ‖ v channels); window: [K-1, C] the raw
    projections of the K-1 previous tokens (zeros before the sequence start);
    weight: [C, K] (weight[:, K-1] multiplies the current token).
    Returns (out [T, C] = silu(conv) in u's dtype, windows [T, K-1, C]: the window
    after each token, i.e. the last K-1 raw rows ending at that token).
    """
    k = weight.shape[-1]
    full = torch.cat([window.to(u.dtype), u], dim=0)  # [K-1+T, C]
    out = (full.unfold(0, k, 1).float() * weight.float()).sum(-1)  # [T, C]
    windows = full.unfold(0, k - 1, 1)[1:].transpose(1, 2)  # [T, K-1, C]
    return F.silu(out).to(u.dtype), windows


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b), fp32.

    a, b: [T, Hv]; A_log, dt_bias: [Hv]. Returns (g [T, Hv], beta [T, Hv]).
    """
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def _expand_heads(q: torch.Tensor, k: torch.Tensor, hv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped value attention: value head h uses key head h // (Hv/Hk)."""
    rep = hv // k.shape[1]
    return q.repeat_interleave(rep, dim=1), k.repeat_interleave(rep, dim=1)


def gdn_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, token by token, keeping the state after every token.

    q, k: [T, Hk, Dk] already l2-normalised, q already scaled by Dk^-0.5; v: [T, Hv, Dv];
    g, beta: [T, Hv] fp32; state: [Hv, Dk, Dv] fp32 (not modified).
    Per token and value head: S <- exp(g) S; m = S^T k; S <- S + k (beta (v - m))^T;
    o = S^T q (the updated state). Returns (o [T, Hv, Dv] fp32, states [T, Hv, Dk, Dv] fp32).
    """
    hv = v.shape[1]
    q, k = _expand_heads(q.float(), k.float(), hv)
    v = v.float()
    s = state.float().clone()
    outs, states = [], []
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        m = torch.einsum("hkv,hk->hv", s, k[t])
        delta = beta[t][:, None] * (v[t] - m)
        s = s + k[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", s, q[t]))
        states.append(s)
    return torch.stack(outs), torch.stack(states)


def gdn_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                state: torch.Tensor, chunk: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked (WY / UT-transform) form of ``gdn_recurrent``; returns only the final state.

    Same arguments. Per chunk of C tokens with incoming state S (per value head):
    gamma = cumsum(g); D_ij = exp(gamma_i - gamma_j) for j <= i;
    A = strict_lower((beta k) k^T * D); T = (I + A)^-1;
    U = T (beta v); W = T (beta k * exp(gamma)); V' = U - W S;
    O = (q * exp(gamma)) S + lower_incl((q k^T) * D) V';
    S <- exp(gamma_C) S + (k * exp(gamma_C - gamma))^T V'.
    The tail chunk is zero-padded (g = 0, beta = 0 leave the state unchanged).
    Returns (o [T, Hv, Dv] fp32, final state [Hv, Dk, Dv] fp32).
    """
    n, hv = q.shape[0], v.shape[1]
    q, k = _expand_heads(q.float(), k.float(), hv)
    v, g, beta = v.float(), g.float(), beta.float()
    pad = (-n) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
    # -> [chunks, Hv, C, d]
    def split(x):
        return x.reshape(-1, chunk, *x.shape[1:]).transpose(1, 2)
    qc, kc, vc = split(q), split(k), split(v)
    gc, bc = split(g[..., None])[..., 0], split(beta[..., None])[..., 0]  # [chunks, Hv, C]
    dev = q.device               # constants on the inputs' device (traceable on any device)
    eye = torch.eye(chunk, device=dev)
    lower_strict = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=dev), -1)
    lower_incl = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=dev))
    zero = torch.zeros((), device=dev)
    s = state.float().clone()
    outs = []
    for c in range(qc.shape[0]):
        gam = gc[c].cumsum(-1)  # [Hv, C]
        diff = gam[:, :, None] - gam[:, None, :]
        decay = torch.where(lower_incl, diff, torch.full_like(diff, float("-inf"))).exp()  # [Hv, C, C]
        kb = kc[c] * bc[c][..., None]
        a = torch.where(lower_strict, (kb @ kc[c].transpose(-1, -2)) * decay, zero)
        tinv = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
        u = tinv @ (vc[c] * bc[c][..., None])
        w = tinv @ (kb * gam.exp()[..., None])
        v_new = u - w @ s
        attn = torch.where(lower_incl, (qc[c] @ kc[c].transpose(-1, -2)) * decay, zero)
        outs.append((qc[c] * gam.exp()[..., None]) @ s + attn @ v_new)
        last = gam[:, -1:]
        s = s * last.exp()[..., None] + (kc[c] * (last - gam).exp()[..., None]).transpose(-1, -2) @ v_new
    o = torch.cat(outs, dim=1).transpose(0, 1)[:n]  # [T, Hv, Dv]
    return o, s


# ---------------------------------------------------------------------------
# Mixture of experts
# ---------------------------------------------------------------------------


def route(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: fp32 softmax over experts, top-k, renormalise.

    logits: [T, E]. Returns (weights [T, k] fp32, indices [T, k] int64), experts in
    descending probability; ties go to the LOWER expert index (stable sort).
    """
    probs = torch.softmax(logits.float(), dim=-1)
    vals, idx = torch.sort(probs, dim=-1, descending=True, stable=True)
    vals, idx = vals[:, :top_k], idx[:, :top_k]
    return vals / vals.sum(-1, keepdim=True), idx


def swiglu_mlp(x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """down(silu(gate x) * up x). x: [T, H]; w_gate, w_up: [I, H]; w_down: [H, I]."""
    h = F.silu(F.linear(x, w_gate).float()) * F.linear(x, w_up).float()
    return F.linear(h.to(x.dtype), w_down)


def sparse_moe(x: torch.Tensor, router_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               shared_gate: torch.Tensor, shared_up: torch.Tensor, shared_down: torch.Tensor,
               shared_expert_gate: torch.Tensor, top_k: int) -> torch.Tensor:
    """Sparse MoE block with the sigmoid-gated shared expert.

    x: [T, H]; router_w: [E, H]; gate_up: [E, 2I, H] (gate rows first); down: [E, H, I];
    shared_*: the shared expert's MLP; shared_expert_gate: [1, H].
    out = sum_e w_e * expert_e(x) + sigmoid(shared_expert_gate . x) * shared(x); [T, H] in x's dtype.
    """
    inter = down.shape[-1]
    weights, idx = route(F.linear(x, router_w), top_k)
    out = torch.zeros(x.shape, dtype=torch.float32)
    for t in range(x.shape[0]):
        for j in range(top_k):
            e = int(idx[t, j])
            y = swiglu_mlp(x[t:t + 1], gate_up[e, :inter], gate_up[e, inter:], down[e])
            out[t] += weights[t, j].to(x.dtype).float() * y[0].float()
    shared = swiglu_mlp(x, shared_gate, shared_up, shared_down).float()
    out += torch.sigmoid(F.linear(x, shared_expert_gate).float()) * shared
    return out.to(x.dtype)
