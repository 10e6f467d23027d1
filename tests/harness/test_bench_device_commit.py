"""``python -m harness.bench predict --device-commit``: the device-committed round's prediction (on the tiny model)
and its chained end-to-end band -- both ends, each with its source, the low end the device round itself (its NEFF
start included), the high end + the measured host-driven gap. Asserts on the outputs' contract, never timings."""
import json

import pytest

from harness import bench
from harness.costmodel import constants as C


def test_predict_device_commit_contract_on_the_tiny_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "BENCH", tmp_path)
    code = bench.main(["predict", "--model", "tiny", "--context", "600", "--device-commit", "--json", "--quiet"])
    out, err = capsys.readouterr()
    assert code == 0, err
    d = json.loads(out)
    assert d == json.loads((tmp_path / "costmodel_predict_device_commit.json").read_text())
    assert not (tmp_path / "costmodel_predict.json").exists()     # the headline JSON is the host-driven round's
    ends = ("low", "central", "high")
    assert d["device_commit"] is True and "on device" in d["label"]
    r = d["round_us"]
    assert r["low"] <= r["central"] <= r["high"] and set(d["stages_us"]) >= {"D1", "V", "D2"}
    ch, host = d["chained_end_to_end_round_us"], d["chained_host_us_per_round"]
    assert host["low"] == C.CHAINED_HOST_NS["low"] / 1e3 and host["high"] == pytest.approx(C.HOST_ROUND_NS / 1e3)
    assert set(host["sources"]) == {"low", "high"} and all(host["sources"].values())
    for e in ends:
        assert ch["host_hidden"][e] == pytest.approx(r[e])
        assert ch["host_exposed"][e] == pytest.approx(r[e] + C.HOST_ROUND_NS / 1e3)
        tps = d["chained_end_to_end_tokens_per_s"]
        assert tps["host_exposed"][e] < tps["host_hidden"][e] == pytest.approx(d["tokens_per_s"][e])
    assert d["kernel_parameters"]["count"] > 0 and d["instructions"] > 0
