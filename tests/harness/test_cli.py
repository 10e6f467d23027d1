"""decode.py: the JSON schema, exact tokens against transformers' generate on a
checkpoint written by save_pretrained, and one clear line + exit 2 on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness import decode
from model.params import random_params
from model.weights import random_checkpoint

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory, small_cfg):
    path = tmp_path_factory.mktemp("ckpt")
    random_checkpoint(path, small_cfg, seed=4, dtype=torch.float32)
    return path


def run(capsys, *argv):
    code = decode.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_json_schema(ckpt, capsys):
    code, out, err = run(capsys, "--model-path", ckpt, "--prompt-ids", "1,2,3", "--max-new-tokens", 9,
                         "--variant", "xla", "--tp", 1, "--json")
    assert code == 0, err
    d = json.loads(out)
    assert len(d["tokens"]) == 9 and all(isinstance(t, int) for t in d["tokens"])
    assert d["rounds"] == len(d["accepted_per_round"]) and sum(d["accepted_per_round"]) >= 8
    assert 0.0 <= d["acceptance_rate"] <= 1.0 and 1.0 <= d["tokens_per_round"] <= 2.0
    assert d["variants"]["xla"]["tokens"] == d["tokens"]


def test_no_spec_text_output(ckpt, capsys):
    code, out, _ = run(capsys, "--model-path", ckpt, "--prompt-ids", "4,5", "--max-new-tokens", 5,
                       "--no-spec", "--dtype", "float32", "--variant", "xla", "--tp", 1)
    assert code == 0 and "tokens: [" in out and "xla" in out


def test_kernel_variant_refuses_unsupported_config(ckpt, capsys):
    """The small test config's hidden size (96) is not a multiple of 128: the NKI variants refuse it
    before decoding, with one line."""
    code, out, err = run(capsys, "--model-path", ckpt, "--prompt-ids", "4,5", "--variant", "megakernel")
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1 and "--variant megakernel" in err


@pytest.mark.parametrize("argv,needle", [
    (["--model-path", "/nonexistent/dir", "--prompt-ids", "1"], "no such directory"),
    (["--prompt-ids", "1,x"], "comma-separated integers"),
    (["--prompt-ids", "1,99999"], "outside the vocabulary"),
    (["--prompt-ids", "1", "--max-new-tokens", "100000"], "exceeds the context"),
    (["--prompt-ids", "1", "--max-new-tokens", "0"], "must be >= 1"),
    (["--prompt", "hello"], "no tokenizer files"),
    (["--prompt-ids", ","], "prompt is empty"),
])
def test_bad_input_exits_2_with_one_line(ckpt, capsys, argv, needle):
    if "--model-path" not in argv:
        argv = ["--model-path", str(ckpt), *argv]
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and lines[0].startswith("decode.py: error:")


def test_malformed_config_and_missing_tensor(ckpt, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{oops")
    code, _, err = run(capsys, "--model-path", bad, "--prompt-ids", "1")
    assert code == 2 and "not valid JSON" in err and len(err.strip().splitlines()) == 1
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((ckpt / "config.json").read_text())
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run(capsys, "--model-path", broken, "--prompt-ids", "1")
    assert code == 2 and "model.norm.weight" in err and len(err.strip().splitlines()) == 1


def test_script_entry_point_and_help():
    out = subprocess.run([sys.executable, "harness/decode.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--variant" in out.stdout and "--prompt-ids" in out.stdout


def test_matches_transformers_generate_on_save_pretrained_checkpoint(tiny_cfg, tmp_path, capsys):
    """The issue's acceptance check: a checkpoint written by transformers' save_pretrained,
    with mtp.* tensors added, decodes (xla, float32, speculative) to exactly the tokens
    of transformers' greedy generate."""
    transformers = pytest.importorskip("transformers")
    cfg = tiny_cfg
    params = random_params(cfg, seed=8, dtype=torch.float32)
    hf_cfg = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in cfg.to_hf_dict().items() if k not in ("architectures", "model_type")})
    m = transformers.Qwen3_5MoeForCausalLM(hf_cfg).eval()
    m.load_state_dict({k: v for k, v in params.items() if not k.startswith("mtp.")})
    m.save_pretrained(tmp_path)
    files = sorted(tmp_path.glob("*.safetensors"))
    assert len(files) == 1
    tensors = load_file(files[0])
    tensors.update({k: v.contiguous() for k, v in params.items() if k.startswith("mtp.")
                    and "experts" not in k})
    for k, v in params.items():  # MTP experts on disk in the per-expert form save_pretrained uses
        if k.startswith("mtp.") and k.endswith("experts.gate_up_proj"):
            base, inter = k[: -len(".gate_up_proj")], v.shape[1] // 2
            for e in range(v.shape[0]):
                tensors[f"{base}.{e}.gate_proj.weight"] = v[e, :inter].contiguous()
                tensors[f"{base}.{e}.up_proj.weight"] = v[e, inter:].contiguous()
                tensors[f"{base}.{e}.down_proj.weight"] = params[f"{base}.down_proj"][e].contiguous()
    save_file(tensors, files[0], metadata={"format": "pt"})
    prompt = [7, 100, 31, 250, 9, 64, 12, 200]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = m.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32, do_sample=False,
                         pad_token_id=0)
    expected = out[0, len(prompt):].tolist()
    code, stdout, err = run(capsys, "--model-path", tmp_path, "--prompt-ids", ",".join(map(str, prompt)),
                            "--max-new-tokens", 32, "--variant", "xla", "--tp", 1, "--dtype", "float32", "--json")
    assert code == 0, err
    got = json.loads(stdout)["tokens"]
    assert got == expected


@pytest.mark.parametrize("extra", [["--variant", "xla"], ["--variant", "megakernel", "--no-spec"]],
                         ids=["xla", "no-spec"])
def test_fp8_draft_head_is_the_megakernels_drafts(ckpt, capsys, extra):
    code, out, err = run(capsys, "--model-path", ckpt, "--prompt-ids", "4,5", "--draft-head", "fp8", *extra)
    assert code == 2 and out == "" and "--draft-head fp8" in err and len(err.strip().splitlines()) == 1
