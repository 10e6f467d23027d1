"""The public-kernel sweep command's own logic (no public code needed): bad checkout paths, the comparison, the
result table, status classification, and one reference function checked against a kernel of our own."""
import os
import subprocess
import sys

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkisim import NkiValidationError, public_kernels as pk

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_missing_checkout_is_a_one_line_error_with_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "nkisim.public_kernels", "--nki-library", str(tmp_path / "nope"),
                        "--json", ""], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --nki-library")
    assert "src/nkilib_src/nkilib" in lines[0] and "aws-neuron/nki-library" in lines[0]


def test_sdk_path_without_examples_is_refused(tmp_path):
    (tmp_path / "nkl" / "src" / "nkilib_src" / "nkilib").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        pk.main(["--nki-library", str(tmp_path / "nkl"), "--sdk", str(tmp_path), "--json", ""])
    assert e.value.code == 2


def test_help_runs():
    r = subprocess.run([sys.executable, "-m", "nkisim.public_kernels", "--help"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "--nki-library" in r.stdout and "--sdk" in r.stdout and "--extra" in r.stdout
    assert "trnsci/trnblas" in r.stdout


def test_empty_checkout_reports_every_kernel_skipped_with_the_missing_path(tmp_path, capsys):
    (tmp_path / "src" / "nkilib_src" / "nkilib").mkdir(parents=True)
    out_json = tmp_path / "r.json"
    assert pk.main(["--nki-library", str(tmp_path), "--json", str(out_json), "--only", "cumsum"]) == 0
    text = capsys.readouterr().out
    assert "SKIPPED" in text and "totals: SKIPPED 3" in text
    assert "missing: nki-library:src/nkilib_src/nkilib/core/cumsum/cumsum.py" in text
    import json
    doc = json.loads(out_json.read_text())
    assert doc["results"][0]["source"] == "nki-library:src/nkilib_src/nkilib/core/cumsum/cumsum.py"
    assert str(tmp_path) not in out_json.read_text()          # no machine paths in the JSON


def test_a_missing_helper_file_skips_the_kernel_and_names_the_helper(tmp_path, capsys):
    d = tmp_path / "src" / "nkilib_src" / "nkilib" / "experimental" / "foreach"
    d.mkdir(parents=True)
    (d / "foreach_norm.py").write_text("raise RuntimeError('must not be imported')\n")
    assert pk.main(["--nki-library", str(tmp_path), "--json", "", "--only", "foreach/l1"]) == 0
    text = capsys.readouterr().out
    assert "SKIPPED" in text and "foreach_utils.py" in text and "Error" not in text


def test_extra_repositories_are_optional_and_checked(tmp_path, capsys):
    (tmp_path / "src" / "nkilib_src" / "nkilib").mkdir(parents=True)
    assert pk.main(["--nki-library", str(tmp_path), "--json", "", "--only", "trnblas/syrk"]) == 0
    assert "no --extra trnblas=PATH checkout given" in capsys.readouterr().out
    for bad in ("trnblas", "nope=" + str(tmp_path), "trnblas=" + str(tmp_path)):   # no '=', unknown, no trnblas/nki
        with pytest.raises(SystemExit) as e:
            pk.main(["--nki-library", str(tmp_path), "--json", "", "--extra", bad])
        assert e.value.code == 2


def test_compare_and_table():
    ok, err, worst = pk.compare([np.array([1.0, 2.0])], [np.array([1.0, 2.001])], rtol=1e-3, atol=0.0)
    assert ok and abs(err - 0.001) < 1e-12 and worst <= 1.0
    ok, _, _ = pk.compare([np.array([1.0, np.nan])], [np.array([1.0, 2.0])], rtol=1.0, atol=1.0)
    assert not ok
    with pytest.raises(AssertionError, match="shape"):
        pk.compare([np.zeros(3)], [np.zeros(4)], 0, 0)
    rows = [dict(kernel="k/a", variant="v1", lnc=1, status="PASS", max_abs_err=1.5e-6, note=""),
            dict(kernel="k/bb", variant="variant2", lnc=2, status="REFUSED-OK", max_abs_err=None, note="rule x")]
    table = pk.format_table(rows).splitlines()
    assert table[0].split() == list(pk.COLUMNS)
    assert table[2].split() == ["k/a", "v1", "1", "PASS", "1.5e-06"]
    assert table[3].split()[:5] == ["k/bb", "variant2", "2", "REFUSED-OK", "-"]
    assert table[-1] == "totals: PASS 1, REFUSED-OK 1"
    assert pk.failed(rows) == []
    assert pk.failed([dict(rows[0], status="NOT-REFUSED")])


def test_classification_needs_the_expected_reason():
    assert pk._classify(NkiValidationError("nki.jit: 'platform_target=' was removed"), "platform_target")[0] == \
        "REFUSED-OK"
    assert pk._classify(NkiValidationError("nc_matmul: something else"), "platform_target")[0] == "REFUSED"
    assert pk._classify(NkiValidationError("x"), None)[0] == "REFUSED"
    assert pk._classify(NotImplementedError("rng"), None)[0] == "NOT-IMPL"
    assert pk._classify(KeyError("k"), None)[0] == "ERROR"


def test_linear_scan_reference_against_our_kernel():
    """ref_linear_scan checked against a small kernel of ours built on tensor_tensor_scan."""
    @nki.jit
    def scan(decay, data, init):
        P, L = data.shape
        d = nl.ndarray((P, L), nl.float32, buffer=nl.sbuf)
        x = nl.ndarray((P, L), nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=d, src=decay)
        nisa.dma_copy(dst=x, src=data)
        nisa.dma_copy(dst=s, src=init)
        r = nl.ndarray((P, L), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor_scan(dst=r, data0=d, data1=x, initial=s, op0=nl.multiply, op1=nl.add)
        out = nl.ndarray((P, L), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    rng = np.random.default_rng(3)
    decay = rng.uniform(0.5, 1.0, (16, 40)).astype(np.float32)
    data = rng.standard_normal((16, 40)).astype(np.float32)
    init = rng.standard_normal((16, 1)).astype(np.float32)
    ref, final = pk.ref_linear_scan(decay, data, init)
    np.testing.assert_allclose(scan(decay, data, init), ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(final, ref[:, -1:])


def test_other_references_on_small_cases():
    x = np.array([[1.0, 5.0, 2.0], [7.0, 0.0, 7.5]])
    v, i = pk.ref_max_and_index(x)
    assert v.tolist() == [[5.0], [7.5]] and i.tolist() == [[1.0], [2.0]]
    out = pk.ref_scatter_add(np.zeros((3, 2)), np.array([2, 0, 2]), np.ones((3, 2)))
    assert out.tolist() == [[1, 1], [0, 0], [2, 2]]
    assert pk.ref_cumsum(np.array([[1.0, 2.0, 3.0]])).tolist() == [[1, 3, 6]]


def test_new_references_on_small_cases():
    """ref_norm, ref_selective_scan and ref_mp2_partial_sum on cases worked out by hand / by a direct loop."""
    x = np.array([3.0, -4.0, 1.0])
    assert pk.ref_norm(x, "l1") == 8.0 and pk.ref_norm(x, "linf") == 4.0 and pk.ref_norm(x, "l2") == np.sqrt(26)
    # one channel, one state, A = 0 (decay 1): state = running sum of dt*x*B; y = C*state + D*x
    xs, dt = np.array([[[1.0, 2.0, 3.0]]]), np.array([[[1.0, 1.0, 0.5]]])
    A, B, C = np.zeros((1, 1)), np.ones((1, 1, 3)), np.full((1, 1, 3), 2.0)
    y, fin = pk.ref_selective_scan(xs, dt, A, B, C, D=np.array([10.0]), initial_state=np.array([[[1.0]]]))
    assert np.allclose(fin, [[[1 + 1 + 2 + 1.5]]])
    assert np.allclose(y, [[[2 * 2 + 10, 2 * 4 + 20, 2 * 5.5 + 30]]])
    # mp2: nvir = nocc = ic = 1: T (2T - T) / (eo_c + eo_f - 2 ev)
    assert np.isclose(pk.ref_mp2_partial_sum(np.array([[2.0]]), np.array([-1.0]), np.array([-1.0]),
                                             np.array([0.5])), 4.0 / -3.0)
