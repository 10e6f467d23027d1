"""The round megakernel with fp8 experts tables (opt-in, ``nki_kernels.moe`` "fp8 experts"): the scales tables reach
every layer's MoE (trunk and MTP), so greedy decoding equals the xla variant on the same quantised checkpoint (whose
MoE is the fp8 twin, ``model.tp.moe``); both prefill teacher-forced through their own launches."""

from __future__ import annotations

import pytest
import torch

from harness.engines import make_engine
from harness.speculative import Decoder, generate
from model.params import random_params
from model.tp.moe import quantize_fp8

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.mark.slow  # ~1-2 min: a teacher-forced prefill and 5 rounds of the tiny round megakernel under nkisim
def test_fp8_megakernel_tokens_equal_the_fp8_twin(tiny_cfg):
    q = quantize_fp8(random_params(tiny_cfg, seed=3, dtype=torch.bfloat16))
    runs = {name: generate(Decoder(make_engine(name, tiny_cfg, q, tp=4), None), PROMPT, 6, spec=True)
            for name in ("xla", "megakernel")}
    assert runs["megakernel"].tokens == runs["xla"].tokens and len(runs["xla"].tokens) == 6
    assert runs["megakernel"].rounds == runs["xla"].rounds
