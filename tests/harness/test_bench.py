"""python -m harness.bench: the ``kernel`` command on an SDK-style example kernel file and a package with relative
imports, its bad-input behaviour (one line, exit 2), the ``predict`` output contract (on the tiny model), a saved
trace, and ``calibrate``. Asserts on the model's outputs and the command's behaviour, never on timings."""
import json
import textwrap

import pytest

from harness import bench
from harness.costmodel import constants as C

# An SDK quickstart-style kernel (written for this test: tiled add, HBM -> SBUF -> VectorE -> HBM).
ADD_KERNEL = '''
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def tensor_add(a_input, b_input):
    """a + b of two [R, C] tensors, R a multiple of 128, in [128, C] tiles."""
    out = nl.ndarray(a_input.shape, a_input.dtype, buffer=nl.shared_hbm)
    for i in range(a_input.shape[0] // 128):
        a = nl.ndarray((128, a_input.shape[1]), a_input.dtype, buffer=nl.sbuf)
        b = nl.ndarray((128, a_input.shape[1]), a_input.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=a_input[i * 128:(i + 1) * 128, :])
        nisa.dma_copy(dst=b, src=b_input[i * 128:(i + 1) * 128, :])
        c = nl.ndarray((128, a_input.shape[1]), a_input.dtype, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=a, data2=b, op=nl.add)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=c)
    return out


def scaled_rows(x, n):
    """x [R, C]: its first n [128, C] tiles times 2 (a plain function: the command wraps it in nki.jit)."""
    out = nl.ndarray((n * 128, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    for i in range(n):
        t = nl.ndarray((128, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i * 128:(i + 1) * 128, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=out[i * 128:(i + 1) * 128, :], src=t)
    return out
'''


@pytest.fixture
def add_file(tmp_path):
    p = tmp_path / "tensor_add_kernels.py"
    p.write_text(ADD_KERNEL)
    return p


def run(capsys, *argv):
    code = bench.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_kernel_command_json(add_file, capsys):
    code, out, err = run(capsys, "kernel", f"{add_file}::tensor_add", "--arg", "a_input=256,1024:float32",
                         "--arg", "b_input=256,1024:float32", "--json")
    assert code == 0, err
    d = json.loads(out)
    t = d["time_us"]
    assert 0 < t["low"] <= t["central"] <= t["high"]
    assert d["bytes"]["hbm_read"] == 2 * 256 * 1024 * 4 and d["bytes"]["hbm_write"] == 256 * 1024 * 4
    assert d["engines"]["busy_us"]["DVE"] > 0 and d["engines"]["busy_us"]["DMA"] > 0
    assert d["instructions"] == 2 * 4 and d["critical_path"] and d["assumptions"]["bands"]


def test_kernel_command_table_lnc2_and_a_plain_function_with_an_int(add_file, capsys):
    code, out, err = run(capsys, "kernel", f"{add_file}::scaled_rows", "--arg", "x=512,256:bfloat16",
                         "--int", "n=3", "--lnc", "2")
    assert code == 0, err
    assert "predicted" in out and "top critical-path items" in out and "LNC=2" in out


def test_kernel_command_honours_the_package_context(tmp_path, capsys):
    pkg = tmp_path / "mykernels" / "ops"
    pkg.mkdir(parents=True)
    (tmp_path / "mykernels" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (tmp_path / "mykernels" / "tiles.py").write_text("P = 128\n")
    (pkg / "double.py").write_text(textwrap.dedent('''
        import nki
        import nki.isa as nisa
        import nki.language as nl
        from ..tiles import P


        @nki.jit
        def double(x):
            out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
            t = nl.ndarray((P, x.shape[1]), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=t, src=x)
            nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
            nisa.dma_copy(dst=out, src=t)
            return out
    '''))
    code, out, err = run(capsys, "kernel", f"{pkg / 'double.py'}::double", "--arg", "x=128,64:float32", "--json")
    assert code == 0, err
    assert json.loads(out)["instructions"] == 3


@pytest.mark.parametrize("argv,needle", [
    (["kernel", "/nonexistent/k.py::f"], "no such file"),
    (["kernel", "{f}"], "FILE::FUNCTION"),
    (["kernel", "{f}::missing"], "no function 'missing'"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,x:float32", "--arg", "b_input=256,8:float32"],
     "not a comma-separated list"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,8:float33", "--arg", "b_input=256,8:float32"],
     "unknown dtype"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,0:float32", "--arg", "b_input=256,8:float32"], ">= 1"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,8:float32"], "has no value"),
    (["kernel", "{f}::tensor_add", "--arg", "c=256,8:float32"], "no parameter 'c'"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,8:float32", "--arg", "b_input=128,8:float32"],
     "refused"),
    (["kernel", "{f}::scaled_rows", "--arg", "x=128,8:float32", "--int", "n=2"], "refused"),
    (["kernel", "{f}::tensor_add", "--arg", "a_input=256,8:float32", "--arg", "b_input=256,8:float32",
      "--lnc", "3"], "--lnc"),
    (["predict", "--context", "0"], "--context"),
    (["predict", "--trace", "/nonexistent/t.json"], "no such trace"),
    (["predict", "--fp8-experts", "--device-commit"], "--fp8-experts"),
    (["predict", "--draft-head", "fp8", "--device-commit"], "--draft-head fp8"),
])
def test_bad_input_is_one_line_and_exit_2(add_file, capsys, argv, needle):
    code, out, err = run(capsys, *[a.replace("{f}", str(add_file)) for a in argv])
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and needle in err


def test_predict_contract_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    code, out, err = run(capsys, "predict", "--model", "tiny", "--context", "600", "--json", "--quiet")
    assert code == 0, err
    d = json.loads(out)
    ends = ("low", "central", "high")

    def band(x):
        assert set(x) >= set(ends) and x["low"] <= x["central"] <= x["high"]

    band(d["round_us"])
    assert set(d["stages_us"]) >= {"D1", "V", "D2"}
    # the stages split each end's critical path: they add up to that end's round (less the launch head)
    for e in ends:
        total = sum(v[e] for v in d["stages_us"].values())
        assert total == pytest.approx(d["round_us"][e] - C.LAUNCH_OVERHEAD_NS / 1e3, rel=1e-6) or d["band_anomalies_us"]
    assert set(d["layer_us"]) == {"gdn", "attention"}
    for v in d["layer_us"].values():
        band(v)
        assert v["parts"] and v["layers"] > 0
    assert d["context"] == 600 and d["routing"]["mode"] == "expected"
    assert len(d["distinct_experts"]) == 8 and d["kernel_parameters"]["count"] > 0
    band(d["layerwise"]["round_us"])
    # end to end = device round + the measured host dispatch of a host-driven round, at every end
    for x in (d, d["layerwise"]):
        band(x["end_to_end_round_us"])
        for e in ends:
            assert x["end_to_end_round_us"][e] == pytest.approx(x["round_us"][e] + C.HOST_ROUND_NS / 1e3)
            assert x["end_to_end_tokens_per_s"][e] < x["tokens_per_s"][e]
    assert set(d["layerwise"]["stages_us"]) == {"D1", "V", "D2"} and d["layerwise"]["layer_us"]
    band(d["roofline_us"]["megakernel"])
    band(d["roofline_us"]["layerwise"])
    assert {b["name"] for b in d["assumptions"]["bands"]} >= {"handoff_ns", "pe_floor_ns", "hbm_bw_per_rank",
                                                               "all_reduce_ns", "pe_throttle"}
    assert all(b["source"] for b in d["assumptions"]["bands"])
    assert d["layers"] and {"D1 MTP", "L0", "D2 K/V rows"} <= {r["layer"] for r in d["layers"]}
    assert json.loads((tmp_path / "costmodel_predict.json").read_text())["round_us"] == d["round_us"]
    for png in ("costmodel_stages.png", "costmodel_timeline.png", "costmodel_layers.png"):
        assert (tmp_path / png).stat().st_size > 10_000
    assert "| L0 |" in (tmp_path / "costmodel_layers.md").read_text()


@pytest.mark.slow  # two tiny-round predictions (~15 s idle, 60 s on a busy machine)
def test_predict_fp8_experts_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    """``predict --fp8-experts``: its own JSON (never the headline's), marked as changing the output, with a band,
    and fewer HBM bytes per rank than the bf16 round (the routed experts' blocks are half the size)."""
    from harness.costmodel import compose
    from model.config import preset
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    code, out, err = run(capsys, "predict", "--model", "tiny", "--context", "600", "--fp8-experts", "--json",
                         "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert d["experts_dtype"] == "float8_e4m3" and "does not count toward the target" in d["numerics"]
    assert d["round_us"]["low"] <= d["round_us"]["central"] <= d["round_us"]["high"]
    assert set(d["stages_us"]) >= {"D1", "V", "D2"} and set(d["layer_us"]) == {"gdn", "attention"}
    assert json.loads((tmp_path / "costmodel_predict_fp8_experts.json").read_text())["round_us"] == d["round_us"]
    assert not (tmp_path / "costmodel_predict.json").exists()
    bf16 = compose.megakernel_round(preset("tiny"), 600)
    assert d["hbm_MB_per_rank"] < bf16.hbm_bytes_per_rank / 1e6


@pytest.mark.slow       # ~20 s: a tiny-model round trace
def test_predict_draft_vocab_writes_its_own_json(tmp_path, monkeypatch, capsys):
    """``predict --draft-vocab N``: its own JSON (the headline JSON and plots are the default round's), with a band
    and fewer HBM bytes per rank than the full-vocabulary round (the draft head streams N rows, not the vocabulary)."""
    from harness.costmodel import compose
    from model.config import preset
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    code, out, err = run(capsys, "predict", "--model", "tiny", "--context", "600", "--draft-vocab", "64", "--json",
                         "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert d["draft_vocab"] == 64 and d["round_us"]["low"] <= d["round_us"]["central"] <= d["round_us"]["high"]
    assert json.loads((tmp_path / "costmodel_predict_draft_vocab.json").read_text())["round_us"] == d["round_us"]
    assert not (tmp_path / "costmodel_predict.json").exists() and not (tmp_path / "costmodel_stages.png").exists()
    full = compose.megakernel_round(preset("tiny"), 600)
    assert d["hbm_MB_per_rank"] < full.hbm_bytes_per_rank / 1e6


def test_predict_on_a_saved_trace_and_calibrate(tmp_path, monkeypatch, capsys):
    from harness.costmodel import microkernels as mk
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    path = tmp_path / "chain.json"
    mk.trace_engine_chain(256).to_json(str(path))
    code, out, err = run(capsys, "predict", "--trace", str(path), "--quiet")
    assert code == 0, err and "chain" in out and "critical path top" in out
    code, out, err = run(capsys, "calibrate", "--quiet")
    assert code == 0, err
    md = (tmp_path / "costmodel_calibration.md").read_text()
    assert "ACT_TABLE_LOAD" in md and "13,331 ns" in md and "not run: no --sdk checkout given" in md


def test_nkisim_speed_quick_writes_only_where_asked(tmp_path, capsys):
    out = tmp_path / "speed.json"
    code, text, _ = run(capsys, "nkisim-speed", "--quick", "--out", out)
    d = json.loads(out.read_text())
    assert code == 0 and d["instr_per_s"] > 0 and d["shape_only_instructions"] > 0 and "model_round" not in d
    assert "instr_per_s_traced" in text
    code, _, err = run(capsys, "nkisim-speed", "--context", "0")
    assert code == 2 and err.startswith("error: nkisim-speed: --context")


def test_spec_fp8_draft_head_needs_the_megakernel(capsys):
    code, out, err = run(capsys, "spec", "--draft-head", "fp8", "--variant", "xla", "--no-predict")
    assert code != 0 and "--draft-head fp8 runs in the megakernel variant only" in err


@pytest.mark.slow       # ~20 s: a tiny-model round trace
def test_predict_draft_fp8_writes_its_own_json(tmp_path, monkeypatch, capsys):
    """``predict --draft-head fp8``: its own JSON (the headline JSON and plots are the default round's), with a band and
    fewer HBM bytes per rank than the bf16-draft round (the draft head streams one byte per weight, not two)."""
    from harness.costmodel import compose
    from model.config import preset
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    code, out, err = run(capsys, "predict", "--model", "tiny", "--context", "600", "--draft-head", "fp8", "--json",
                         "--quiet")
    assert code == 0, err
    d = json.loads(out)
    assert d["draft_head"] == "float8_e4m3" and "tokens unchanged" in d["numerics"]
    assert d["round_us"]["low"] <= d["round_us"]["central"] <= d["round_us"]["high"]
    assert json.loads((tmp_path / "costmodel_predict_draft_fp8.json").read_text())["round_us"] == d["round_us"]
    assert not (tmp_path / "costmodel_predict.json").exists() and not (tmp_path / "costmodel_stages.png").exists()
    bf16 = compose.megakernel_round(preset("tiny"), 600)
    assert d["hbm_MB_per_rank"] < bf16.hbm_bytes_per_rank / 1e6
