"""What the NxDI adapter's test modules share (test_nxdi.py, test_nxdi_drafts.py, test_nxdi_context.py): the tiny
model's random fp32 checkpoint, the faithful NxD/NxDI fakes installed for one test, and the CLI's refusal check.
A module uses the fixtures by importing them (``from nxdi_support import fake_nxd, tiny``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from model.params import random_params

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nxd_fakes  # noqa: E402

PROMPT = [5, 17, 99, 3, 250, 41]


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    """(cfg, params): the tiny config with random fp32 weights (seed 3)."""
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


@pytest.fixture
def fake_nxd(monkeypatch, tmp_path):
    """``harness.nxdi.modeling`` imported against the fakes (tests/harness/nxd_fakes.py), forgotten afterwards."""
    monkeypatch.setenv("BASE_COMPILE_WORK_DIR", str(tmp_path / "nxd_work"))
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    yield nxd_fakes.install(monkeypatch)
    nxd_fakes.uninstall()


def refused(capsys, argv, match):
    """``python -m harness.nxdi.run argv`` exits 2 with one line on stderr containing ``match``."""
    from harness.nxdi import run
    assert run.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("harness.nxdi.run: error: ") and match in err, err
