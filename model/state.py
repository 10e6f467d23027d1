"""Decode state: KV caches, GDN conv windows and recurrent states with checkpoint slots.

Layout (batch 1; DESIGN.md §4 "Decode state"):

* ``kv[layer]``: (K, V), each [num_key_value_heads, max_len, head_dim] in the activation
  dtype, one pair per full-attention layer; ``mtp_kv`` the same for the MTP layer.
  Row p holds position p. Rows of rejected tokens are simply overwritten later.
* ``conv[layer]``: [slots, K-1, conv_dim] activation dtype — the raw pre-conv
  projections of the last K-1 tokens, one window per checkpoint slot.
* ``recurrent[layer]``: [slots, Hv, Dk, Dv] float32, one state per checkpoint slot.

A verify of T tokens reads the committed slot ``read_slot`` and writes slot j with
the state after its token j (j < T). Committing n accepted tokens sets
``read_slot = n - 1``: nothing is copied, the next round reads that slot in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from model.config import ModelConfig


@dataclass
class DecodeState:
    cfg: ModelConfig
    max_len: int
    slots: int
    dtype: torch.dtype
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    mtp_kv: tuple[torch.Tensor, torch.Tensor] | None = None
    conv: dict[int, torch.Tensor] = field(default_factory=dict)
    recurrent: dict[int, torch.Tensor] = field(default_factory=dict)
    read_slot: int = 0

    @classmethod
    def empty(cls, cfg: ModelConfig, max_len: int, slots: int = 2, dtype: torch.dtype = torch.bfloat16
              ) -> "DecodeState":
        """Zeroed state for a sequence of at most max_len positions and `slots` checkpoint slots."""
        if slots < 1:
            raise ValueError(f"DecodeState: slots must be >= 1, found {slots}")
        st = cls(cfg, max_len, slots, dtype)
        kv_shape = (cfg.num_key_value_heads, max_len, cfg.head_dim)
        for i in cfg.full_layers:
            st.kv[i] = (torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype))
        if cfg.mtp_num_hidden_layers:
            st.mtp_kv = (torch.zeros(kv_shape, dtype=dtype), torch.zeros(kv_shape, dtype=dtype))
        for i in cfg.linear_layers:
            st.conv[i] = torch.zeros((slots, cfg.conv_window, cfg.conv_dim), dtype=dtype)
            st.recurrent[i] = torch.zeros(
                (slots, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                dtype=torch.float32)
        return st

    def commit(self, accepted: int) -> None:
        """The first `accepted` tokens of the last verify are kept: read slot accepted-1 next."""
        if not 1 <= accepted <= self.slots:
            raise ValueError(f"DecodeState.commit: accepted must be in 1..{self.slots}, found {accepted}")
        self.read_slot = accepted - 1

    def committed(self, length: int) -> dict[str, torch.Tensor]:
        """The state as plain decoding would hold it after `length` tokens (for comparisons).

        Returns flat named tensors: KV rows 0..length-1 of every attention layer and of
        the MTP layer's cache (rows 0..length-2: the MTP at position p needs token p+1),
        and the committed conv window and recurrent state of every GDN layer.
        """
        out = {}
        for i, (k, v) in self.kv.items():
            out[f"kv.{i}.k"], out[f"kv.{i}.v"] = k[:, :length], v[:, :length]
        if self.mtp_kv is not None:
            out["mtp_kv.k"], out["mtp_kv.v"] = self.mtp_kv[0][:, :length - 1], self.mtp_kv[1][:, :length - 1]
        for i in self.conv:
            out[f"conv.{i}"] = self.conv[i][self.read_slot]
            out[f"recurrent.{i}"] = self.recurrent[i][self.read_slot]
        return out
