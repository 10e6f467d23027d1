"""One tensor-parallel rank's slice of the Gated DeltaNet mixer (the twin of ``nki_kernels/gdn.py``).

Sharding (DESIGN.md §4, nki_kernels/README.md): rank r of ``tp`` holds key heads
``[r*Hk/tp, (r+1)*Hk/tp)`` and value heads ``[r*Hv/tp, (r+1)*Hv/tp)`` -- consistent with GVA
(value head h uses key head h // (Hv/Hk)) because both ranges are contiguous and aligned.
Its conv channels are ``q_r ‖ k_r ‖ v_r`` (in that order, C_rank = 2*Hk_r*Dk + Hv_r*Dv), its slice of
``in_proj_z``/``in_proj_b``/``in_proj_a``/``A_log``/``dt_bias`` the rows of its value heads, the
output norm weight is replicated, and ``out_proj`` contributes the columns of its value heads, so the
rank's output is a **partial sum**: the layer output is the sum over ranks of :func:`gdn_rank`'s
partials (an all-reduce in the megakernel).

The math is ``ReferenceModel.gdn_mixer`` restricted to the rank's heads, with the same dtype casts
(projections and conv output in the activation dtype, l2norm/gates/recurrence in fp32, the recurrent
output cast to the activation dtype before the gated norm). The partial is returned in **float32**
(the ``out_proj`` product accumulated in fp32 and not rounded), like the kernel's core partial ``y``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from model import functional as fn
from model.config import ModelConfig

WEIGHT_NAMES = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "A_log", "dt_bias", "norm",
                "out_proj")


@dataclass(frozen=True)
class GdnDims:
    """Per-rank GDN dimensions: key/value heads of the rank, head dims, conv taps, norm eps."""

    hk: int
    hv: int
    dk: int
    dv: int
    conv_kernel: int
    eps: float

    @classmethod
    def of(cls, cfg: ModelConfig, tp: int) -> "GdnDims":
        hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        if hk % tp or hv % tp:
            raise ValueError(f"gdn: tp={tp} does not divide the {hk} key heads and {hv} value heads")
        return cls(hk // tp, hv // tp, cfg.linear_key_head_dim, cfg.linear_value_head_dim,
                   cfg.linear_conv_kernel_dim, cfg.rms_norm_eps)

    @property
    def key_dim(self) -> int:
        return self.hk * self.dk

    @property
    def value_dim(self) -> int:
        return self.hv * self.dv

    @property
    def conv_dim(self) -> int:
        """The rank's conv channels: q_r ‖ k_r ‖ v_r."""
        return 2 * self.key_dim + self.value_dim


def shard_gdn(params: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, rank: int, tp: int
              ) -> dict[str, torch.Tensor]:
    """The rank's slice of one GDN layer's weights, in PyTorch layout.

    params: canonical parameter dict (``model.params``); prefix: ``model.layers.{i}``.
    Returns ``{name: tensor}`` for the names of ``WEIGHT_NAMES``:
    in_proj_qkv [C_rank, H], in_proj_z [Vd_r, H], in_proj_b/in_proj_a [Hv_r, H], conv1d [C_rank, K],
    A_log/dt_bias [Hv_r] (float32), norm [Dv] (replicated), out_proj [H, Vd_r] (columns of the rank).
    """
    if not 0 <= rank < tp:
        raise ValueError(f"shard_gdn: rank {rank} outside 0..{tp - 1}")
    d = GdnDims.of(cfg, tp)
    a = f"{prefix}.linear_attn"
    kd, kdr, vdr, hvr = cfg.linear_key_dim, d.key_dim, d.value_dim, d.hv

    def conv_rows(t):
        return torch.cat([t[rank * kdr:(rank + 1) * kdr], t[kd + rank * kdr:kd + (rank + 1) * kdr],
                          t[2 * kd + rank * vdr:2 * kd + (rank + 1) * vdr]])

    vrows = slice(rank * vdr, (rank + 1) * vdr)
    hrows = slice(rank * hvr, (rank + 1) * hvr)
    return {
        "in_proj_qkv": conv_rows(params[f"{a}.in_proj_qkv.weight"]),
        "in_proj_z": params[f"{a}.in_proj_z.weight"][vrows],
        "in_proj_b": params[f"{a}.in_proj_b.weight"][hrows],
        "in_proj_a": params[f"{a}.in_proj_a.weight"][hrows],
        "conv1d": conv_rows(params[f"{a}.conv1d.weight"][:, 0, :]),
        "A_log": params[f"{a}.A_log"][hrows],
        "dt_bias": params[f"{a}.dt_bias"][hrows],
        "norm": params[f"{a}.norm.weight"],
        "out_proj": params[f"{a}.out_proj.weight"][:, vrows],
    }


def gdn_rank(dims: GdnDims, w: dict[str, torch.Tensor], x_norm: torch.Tensor, window: torch.Tensor,
             state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank's GDN mixer on T tokens, keeping a checkpoint after every token.

    x_norm: [T, H] activation dtype (the normed residual); w: :func:`shard_gdn`;
    window: [K-1, C_rank] raw pre-conv projections before the first token (activation dtype);
    state: [Hv_r, Dk, Dv] float32.
    Returns (partial [T, H] float32, windows [T, K-1, C_rank] activation dtype, states [T, Hv_r, Dk, Dv]
    float32): the rank's out_proj contribution, and the conv window / recurrent state after token j.
    """
    q, k, v, z, g, beta, windows = mixer_inputs(dims, w, x_norm, window)
    o, states = fn.gdn_recurrent(q, k, v, g, beta, state)
    return out_partial(dims, w, o, z, x_norm.dtype), windows, states


def mixer_inputs(dims: GdnDims, w: dict[str, torch.Tensor], x_norm: torch.Tensor, window: torch.Tensor):
    """The rank's projections, causal conv, l2norms and gates for T tokens (shared by decode and prefill).

    Returns (q [T, Hk_r, Dk] fp32 l2-normed and scaled by Dk^-0.5, k [T, Hk_r, Dk] fp32 l2-normed,
    v [T, Hv_r, Dv] activation dtype, z [T, Hv_r, Dv] activation dtype, g and beta [T, Hv_r] fp32,
    windows [T, K-1, C_rank] activation dtype: the conv window after token j).
    """
    t = x_norm.shape[0]
    u = F.linear(x_norm, w["in_proj_qkv"])  # [T, C_rank]
    z = F.linear(x_norm, w["in_proj_z"]).reshape(t, dims.hv, dims.dv)
    b = F.linear(x_norm, w["in_proj_b"])
    a = F.linear(x_norm, w["in_proj_a"])
    conv_out, windows = fn.causal_conv(u, window, w["conv1d"])
    kd = dims.key_dim
    q = conv_out[:, :kd].reshape(t, dims.hk, dims.dk)
    k = conv_out[:, kd:2 * kd].reshape(t, dims.hk, dims.dk)
    v = conv_out[:, 2 * kd:].reshape(t, dims.hv, dims.dv)
    q = fn.l2norm(q.float()) * dims.dk ** -0.5
    k = fn.l2norm(k.float())
    g, beta = fn.gdn_gates(a, b, w["A_log"], w["dt_bias"])
    return q, k, v, z, g, beta, windows


def out_partial(dims: GdnDims, w: dict[str, torch.Tensor], o: torch.Tensor, z: torch.Tensor, dtype) -> torch.Tensor:
    """The gated RMSNorm of the recurrent output o [T, Hv_r, Dv] (cast to ``dtype`` first) and the rank's
    out_proj partial [T, H] float32."""
    y = fn.gated_rms_norm(o.to(dtype), z, w["norm"], dims.eps)
    return F.linear(y.reshape(o.shape[0], dims.value_dim).float(), w["out_proj"].float())


def gather_windows(windows: list[torch.Tensor], dims: GdnDims) -> torch.Tensor:
    """Per-rank windows ``[..., C_rank]`` (rank order) -> the full layer's ``[..., conv_dim]`` (q ‖ k ‖ v)."""
    kd = dims.key_dim
    parts = [[w[..., :kd] for w in windows], [w[..., kd:2 * kd] for w in windows],
             [w[..., 2 * kd:] for w in windows]]
    return torch.cat([torch.cat(p, dim=-1) for p in parts], dim=-1)


def split_window(window: torch.Tensor, dims: GdnDims, rank: int) -> torch.Tensor:
    """The full layer's window ``[..., conv_dim]`` -> rank ``rank``'s channels ``[..., C_rank]``."""
    kd, vd = dims.key_dim, dims.value_dim
    if window.shape[-1] % dims.conv_dim:
        raise ValueError(f"split_window: {window.shape[-1]} channels is not a multiple of the rank's {dims.conv_dim}")
    full_kd = window.shape[-1] // dims.conv_dim * kd      # tp * Kd_r: the layer's key dim
    return torch.cat([window[..., rank * kd:(rank + 1) * kd],
                      window[..., full_kd + rank * kd:full_kd + (rank + 1) * kd],
                      window[..., 2 * full_kd + rank * vd:2 * full_kd + (rank + 1) * vd]], dim=-1)


def gdn_rank_slots(dims: GdnDims, w: dict[str, torch.Tensor], x_norm: torch.Tensor, windows: torch.Tensor,
                   states: torch.Tensor, read_slot) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`gdn_rank` on the decode state's checkpoint slots, as the kernel reads and writes them: start from slot
    ``read_slot`` (the run-time int32 [1, 1] input, or an int) of windows [slots, K-1, C_rank] / states [slots, Hv_r,
    Dk, Dv] float32; slot j receives the window / state after token j (j < T), later slots are kept. Traceable (the
    slot is selected with ``index_select``). Returns (partial [T, H] float32, new windows, new states)."""
    idx = torch.as_tensor(read_slot, device=windows.device).reshape(-1)[:1].long()
    window = windows.index_select(0, idx)[0]
    state = states.index_select(0, idx)[0]
    partial, new_w, new_s = gdn_rank(dims, w, x_norm, window, state)
    t = x_norm.shape[0]
    return partial, torch.cat([new_w.to(windows.dtype), windows[t:]]), torch.cat([new_s, states[t:]])
