"""The seed-layer row of ``harness.bench calibrate``: missing files are reported, a present layer is traced with the
--nki-library package root on sys.path and the nested-jit switch on (restored afterwards), and the row says so.

The seed's own code is not in this repository: a stand-in kernel with the seed's entry point and argument names is
written to a temporary directory (it calls an @nki.jit helper and imports a module from the fake nki-library root,
the two things the context provides)."""
import importlib
import os
import sys
import textwrap
import warnings

import pytest

from harness.costmodel import calibration

STAND_IN = '''
import nki
import nki.isa as nisa
import nki.language as nl

from fake_nkilib_helper import ROWS


@nki.jit
def _inner(hidden):
    t = nl.ndarray((ROWS, 2048), hidden.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=hidden.reshape((2, 2048)))
    out = nl.ndarray((ROWS, 2048), hidden.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def deltanet_attention_layer_state(hidden, proj_w, gamma, eps, conv_state, conv_weight, key_dim, A_log, dt_bias,
                                   init_state, z_gamma, out_w, z_eps=1e-6):
    return _inner(hidden)
'''


def _seed_dir(tmp_path):
    seed = tmp_path / "seed"
    d = seed / os.path.dirname(calibration.SEED_LAYER)
    d.mkdir(parents=True)
    (d / "fused_layer.py").write_text(textwrap.dedent(STAND_IN))
    nkl = tmp_path / "nkl" / "src" / "nkilib_src"
    nkl.mkdir(parents=True)
    (nkl / "fake_nkilib_helper.py").write_text("ROWS = 2\n")
    return seed, tmp_path / "nkl"


def _seed_row(roots):
    saved = calibration.KERNELS, calibration.project_gdn_row
    calibration.KERNELS, calibration.project_gdn_row = (), dict
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return calibration.kernel_rows(roots)[0]
    finally:
        calibration.KERNELS, calibration.project_gdn_row = saved


def test_seed_row_missing_and_predicted(tmp_path):
    jit = importlib.import_module("nkisim.jit")
    row = _seed_row({"seed": str(tmp_path)})
    assert row["status"] == calibration.SEED_MISSING
    seed, nkl = _seed_dir(tmp_path)
    path_before = list(sys.path)
    row = _seed_row({"seed": str(seed), "nki-library": str(nkl)})
    assert row["status"] == "predicted", row["status"]
    t = row["time_us"]
    assert 0 < t["low"] <= t["central"] <= t["high"]
    assert row["central_over_published"] == pytest.approx(t["central"] / 98.82)
    assert calibration.SEED_RELAXED in row["note"] and calibration.SEED_PROVENANCE in row["note"]
    assert jit.NESTED_JIT == "error" and sys.path == path_before        # the context is undone
    md = calibration.markdown([], [row])
    assert "**Seed DeltaNet layer vs its published time.** Predicted" in md
    # without the nki-library root the stand-in's absolute import fails: reported, not raised
    sys.modules.pop("fake_nkilib_helper", None)
    for name in [m for m in sys.modules if m.startswith("deltanet")]:
        sys.modules.pop(name)
    row = _seed_row({"seed": str(seed)})
    assert row["status"].startswith("not predicted: kernel: cannot import"), row["status"]
