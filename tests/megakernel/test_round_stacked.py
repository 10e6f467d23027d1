"""The round megakernel with the bank-stacked residual (megakernel.round.RESIDUAL_BANKS, nki_kernels/stacked.py)
against the single-device reference round. The tiny preset's hidden size (128) does not split into banks of 128
columns, so its megakernel tests run the token-major layout; this config (tiny with H = 512: 4 banks, MoE fold
R = 2) runs the stacked one end to end: stage entries, every layer's partials and residual adds, both norms, the
MTP layer. Same tolerances as tests/megakernel/test_round.py (fp32 weights, another summation order)."""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from decoding import ReferenceDecoder
from harness.speculative import make_decoder
from model.params import random_params
from nki_kernels.stacked import banks_for

from megakernel.round import RESIDUAL_BANKS

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.mark.slow
def test_stacked_round_matches_the_reference_round(tiny_cfg):
    cfg = tiny_cfg.replace(hidden_size=512, moe_intermediate_size=512, shared_expert_intermediate_size=512)
    assert banks_for(cfg.hidden_size, RESIDUAL_BANKS) == 4
    params = random_params(cfg, seed=3, dtype=torch.float32)
    ref, mk = ReferenceDecoder(cfg, params), make_decoder("megakernel", cfg, params, tp=4)
    outs = []
    for v in (ref, mk):
        first, h = v.prefill(PROMPT, max_len=24)
        outs.append((first, v.round(first, h, len(PROMPT))))
    (f0, r0), (f1, r1) = outs
    assert f0 == f1 and r0.drafts == r1.drafts and r0.targets == r1.targets
    assert torch.isfinite(r1.hidden).all() and r1.hidden.abs().max() > 0.1
    assert_close(r1.hidden, r0.hidden, rtol=0, atol=1e-4, name="stacked round hidden vs reference")
    p = len(PROMPT)
    for slot in (0, 1):  # every checkpoint slot and KV rows p, p+1 (and the MTP rows p-1, p)
        ref.commit(slot + 1)
        mk.commit(slot + 1)
        want, got = ref.committed(p + 1 + slot), mk.committed(p + 1 + slot)
        for name in want:
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)
