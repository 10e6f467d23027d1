"""The round megakernel with the bank-stacked residual (megakernel.round.RESIDUAL_BANKS, nki_kernels/stacked.py)
against the single-device reference round. The tiny preset's hidden size (128) does not split into banks of 128
columns, so its megakernel tests run the token-major layout; this config (tiny with H = 512: 4 banks, MoE fold
R = 2) runs the stacked one end to end: stage entries, every layer's partials and residual adds, both norms, the
MTP layer. Same tolerances as tests/megakernel/test_round.py (fp32 weights, another summation order)."""

from __future__ import annotations

import pytest
import torch

from decoding import assert_round_matches_reference
from model.params import random_params
from nki_kernels.stacked import banks_for

from megakernel.round import RESIDUAL_BANKS

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.mark.slow
def test_stacked_round_matches_the_reference_round(tiny_cfg):
    cfg = tiny_cfg.replace(hidden_size=512, moe_intermediate_size=512, shared_expert_intermediate_size=512)
    assert banks_for(cfg.hidden_size, RESIDUAL_BANKS) == 4
    assert_round_matches_reference(cfg, random_params(cfg, seed=3, dtype=torch.float32), PROMPT)
