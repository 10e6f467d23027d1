"""Shared fixtures: small model configs and deterministic random weights."""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch: sleeping, not spinning, OpenMP waits

import pytest  # noqa: E402
import torch

import nkisim
from model.config import FULL, LINEAR, preset

nkisim.install()  # the NKI modules: nkisim's unless the real SDK is importable

torch.set_num_threads(2)


def other_small_config():
    """A second small config with dims unlike `tiny`: attention every 2nd layer, one KV
    head, partial rotary 0.5, GVA ratio 3, key head dim != value head dim, top-2 of 8."""
    return preset("tiny").replace(
        vocab_size=300, hidden_size=96, num_hidden_layers=4,
        layer_types=(LINEAR, FULL, LINEAR, FULL), num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, partial_rotary_factor=0.5, rope_theta=10000.0, linear_num_key_heads=2,
        linear_num_value_heads=6, linear_key_head_dim=16, linear_value_head_dim=24,
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
        shared_expert_intermediate_size=32, bos_token_id=None, eos_token_id=())


@pytest.fixture(scope="session")
def tiny_cfg():
    return preset("tiny")


@pytest.fixture(scope="session")
def small_cfg():
    return other_small_config()
