"""Checkpoint reading/writing (model/weights.py): round trips over every on-disk variant,
bad-file errors, and interop with transformers' Qwen3_5MoeForCausalLM in both directions."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from model.config import ConfigError, preset
from model.params import expected_shapes, random_params
from model.weights import (CheckpointError, load_checkpoint, random_checkpoint, save_checkpoint)

TINY = preset("tiny")
# Smaller still, for the variant matrix: 3 GDN layers + 1 attention layer, 4 experts.
MINI = TINY.replace(num_hidden_layers=4, layer_types=TINY.layer_types[:4], num_experts=4,
                    num_experts_per_tok=2, vocab_size=64, hidden_size=32, head_dim=16,
                    linear_key_head_dim=8, linear_value_head_dim=8, moe_intermediate_size=16,
                    shared_expert_intermediate_size=16, bos_token_id=0, eos_token_id=(1,))
MINI_BYTES = 2 * sum(torch.Size(s).numel() for s in expected_shapes(MINI).values())  # bf16
SHARD = MINI_BYTES // 6  # gives several shards


def disk_keys(root) -> dict[str, str]:
    """on-disk tensor name -> file name, over every weight file of a checkpoint."""
    out = {}
    for f in sorted(root.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                assert k not in out, f"{k} stored twice"
                out[k] = f.name
    return out


def rewrite(root, edit):
    """Apply edit(dict of tensors) to the single model.safetensors of a checkpoint."""
    f = root / "model.safetensors"
    tensors = load_file(str(f))
    edit(tensors)
    save_file(tensors, str(f), metadata={"format": "pt"})


def assert_same(a: dict, b: dict):
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k


# ---------------------------------------------------------------------------------------
# Round trips
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("multimodal", [False, True], ids=["text_cfg", "mm_cfg"])
@pytest.mark.parametrize("max_shard_bytes", [None, SHARD], ids=["single", "sharded"])
@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("prefix", ["model.", "model.language_model."])
def test_roundtrip_all_variants(tmp_path, prefix, layout, max_shard_bytes, multimodal):
    params = random_checkpoint(tmp_path, MINI, seed=3, prefix=prefix, expert_layout=layout,
                               max_shard_bytes=max_shard_bytes, multimodal_config=multimodal)
    cfg, loaded = load_checkpoint(tmp_path)
    assert cfg == MINI
    assert_same(params, loaded)
    assert loaded["model.layers.0.linear_attn.A_log"].dtype == torch.float32
    assert loaded["model.embed_tokens.weight"].dtype == torch.bfloat16

    conf = json.loads((tmp_path / "config.json").read_text())
    if multimodal:
        assert conf["model_type"] == "qwen3_5_moe"
        assert conf["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
        assert conf["text_config"]["model_type"] == "qwen3_5_moe_text"
    else:
        assert conf["model_type"] == "qwen3_5_moe_text"

    keys = disk_keys(tmp_path)
    for k in keys:
        assert k.startswith((prefix, "lm_head.", "mtp.")), k
    fused = [k for k in keys if k.endswith((".experts.gate_up_proj", ".experts.down_proj"))]
    per = [k for k in keys if re.search(r"\.experts\.\d+\.", k)]
    n_moe = MINI.num_hidden_layers + 1  # trunk + MTP layer
    if layout == "fused":
        assert len(fused) == 2 * n_moe and not per
    else:
        assert len(per) == 3 * MINI.num_experts * n_moe and not fused
        assert f"mtp.layers.0.mlp.experts.{MINI.num_experts - 1}.down_proj.weight" in keys
        assert f"{prefix}layers.3.mlp.experts.0.gate_proj.weight" in keys

    if max_shard_bytes is None:
        assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]
    else:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        shards = sorted(p.name for p in tmp_path.glob("*.safetensors"))
        n = len(shards)
        assert n > 1
        assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        assert index["weight_map"] == keys
        total = 0
        for f in shards:
            with safe_open(str(tmp_path / f), "pt") as h:
                size = sum(h.get_tensor(k).numel() * h.get_tensor(k).element_size() for k in h.keys())
                assert size <= max_shard_bytes or len(list(h.keys())) == 1
                total += size
        assert index["metadata"]["total_size"] == total


def test_per_expert_stacking_order(tmp_path):
    """Per-expert gate/up/down land in the documented rows of the fused tensors."""
    params = random_checkpoint(tmp_path, MINI, seed=5, expert_layout="per_expert")
    raw = load_file(str(tmp_path / "model.safetensors"))
    i_n = MINI.moe_intermediate_size
    gu = params["model.layers.2.mlp.experts.gate_up_proj"]
    dp = params["model.layers.2.mlp.experts.down_proj"]
    for e in range(MINI.num_experts):
        assert torch.equal(raw[f"model.layers.2.mlp.experts.{e}.gate_proj.weight"], gu[e, :i_n])
        assert torch.equal(raw[f"model.layers.2.mlp.experts.{e}.up_proj.weight"], gu[e, i_n:])
        assert torch.equal(raw[f"model.layers.2.mlp.experts.{e}.down_proj.weight"], dp[e])


def test_fp32_roundtrip_and_dtypes(tmp_path):
    params = random_checkpoint(tmp_path, MINI, seed=1, dtype=torch.float32)
    cfg, as_stored = load_checkpoint(tmp_path, dtype=None)
    assert cfg == MINI
    assert_same(params, as_stored)
    _, bf = load_checkpoint(tmp_path)  # default bf16; A_log/dt_bias stay fp32
    for k, v in bf.items():
        if k.endswith((".A_log", ".dt_bias")):
            assert v.dtype == torch.float32 and torch.equal(v, params[k])
        else:
            assert v.dtype == torch.bfloat16 and torch.equal(v, params[k].to(torch.bfloat16)), k
    assert all(v.is_contiguous() for v in bf.values())


def test_bf16_file_loaded_as_fp32(tmp_path):
    params = random_checkpoint(tmp_path, MINI, seed=2, expert_layout="per_expert")
    _, loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    for k, v in loaded.items():
        assert v.dtype == torch.float32 and torch.equal(v, params[k].float()), k


def test_include_mtp_false_skips_mtp(tmp_path):
    params = random_checkpoint(tmp_path, MINI)
    _, loaded = load_checkpoint(tmp_path, include_mtp=False)
    assert list(loaded) == list(expected_shapes(MINI, include_mtp=False))
    assert not any(k.startswith("mtp.") for k in loaded)
    assert all(torch.equal(loaded[k], params[k]) for k in loaded)


def test_config_without_mtp(tmp_path):
    cfg0 = MINI.replace(mtp_num_hidden_layers=0)
    params = random_checkpoint(tmp_path, cfg0)
    assert not any(k.startswith("mtp.") for k in disk_keys(tmp_path))
    cfg, loaded = load_checkpoint(tmp_path)
    assert cfg.mtp_num_hidden_layers == 0
    assert_same(params, loaded)


def test_mtp_tensors_with_mtp_disabled_config_are_rejected(tmp_path):
    random_checkpoint(tmp_path, MINI)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf["mtp_num_hidden_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match=r"mtp\.fc\.weight.*mtp_num_hidden_layers=0"):
        load_checkpoint(tmp_path)
    _, loaded = load_checkpoint(tmp_path, include_mtp=False)  # explicitly skipping them is fine
    assert not any(k.startswith("mtp.") for k in loaded)


def test_visual_tensors_are_skipped(tmp_path):
    params = random_checkpoint(tmp_path, MINI, prefix="model.language_model.", multimodal_config=True)
    rewrite(tmp_path, lambda t: t.update({"model.visual.blocks.0.attn.qkv.weight": torch.ones(6, 4),
                                          "visual.merger.weight": torch.ones(3)}))
    _, loaded = load_checkpoint(tmp_path)
    assert_same(params, loaded)


def test_tied_embeddings(tmp_path):
    cfg_t = MINI.replace(tie_word_embeddings=True)
    params = random_checkpoint(tmp_path, cfg_t, multimodal_config=True)
    assert "lm_head.weight" not in params and "lm_head.weight" not in disk_keys(tmp_path)
    cfg, loaded = load_checkpoint(tmp_path)
    assert cfg.tie_word_embeddings
    assert_same(params, loaded)
    # a redundant stored lm_head of a tied model is ignored
    rewrite(tmp_path, lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}))
    assert_same(params, load_checkpoint(tmp_path)[1])


def test_save_is_deterministic_and_replaces_old_weights(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        random_checkpoint(d, MINI, seed=7, expert_layout="per_expert", max_shard_bytes=SHARD)
    files = sorted(p.name for p in a.iterdir())
    assert files == sorted(p.name for p in b.iterdir())
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    # saving a single-file checkpoint over a sharded one leaves no stale shards/index behind
    params = random_checkpoint(a, MINI, seed=8)
    assert sorted(p.name for p in a.iterdir()) == ["config.json", "model.safetensors"]
    assert_same(params, load_checkpoint(a)[1])


def test_save_views_and_shared_storage(tmp_path):
    """Non-contiguous or storage-sharing params are written as plain contiguous tensors."""
    params = random_params(MINI, seed=4)
    w = params["model.layers.0.linear_attn.out_proj.weight"]
    params["model.layers.0.linear_attn.out_proj.weight"] = w.t().contiguous().t()  # non-contiguous view
    big = torch.randn(2, MINI.hidden_size).to(torch.bfloat16)
    params["model.layers.0.input_layernorm.weight"] = big[0]  # two views of one storage
    params["model.layers.0.post_attention_layernorm.weight"] = big[1]
    save_checkpoint(tmp_path, MINI, params)
    _, loaded = load_checkpoint(tmp_path)
    for k in params:
        assert torch.equal(loaded[k], params[k]), k


# ---------------------------------------------------------------------------------------
# save_checkpoint argument errors
# ---------------------------------------------------------------------------------------
def test_save_rejects_bad_params(tmp_path):
    params = random_params(MINI)
    bad = dict(params)
    del bad["model.layers.1.mlp.gate.weight"]
    with pytest.raises(CheckpointError, match=r"missing 1: 'model\.layers\.1\.mlp\.gate\.weight'"):
        save_checkpoint(tmp_path, MINI, bad)
    bad = dict(params, **{"model.layers.1.extra": torch.zeros(1)})
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.extra"):
        save_checkpoint(tmp_path, MINI, bad)
    bad = dict(params, **{"model.norm.weight": torch.zeros(3)})
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*\[3\].*\[32\]"):
        save_checkpoint(tmp_path, MINI, bad)
    no_mtp = random_params(MINI, include_mtp=False)
    with pytest.raises(CheckpointError, match=r"mtp_num_hidden_layers=0"):
        save_checkpoint(tmp_path, MINI, no_mtp)
    with pytest.raises(CheckpointError, match="prefix"):
        save_checkpoint(tmp_path, MINI, params, prefix="language_model.")
    with pytest.raises(CheckpointError, match="expert_layout"):
        save_checkpoint(tmp_path, MINI, params, expert_layout="stacked")
    with pytest.raises(CheckpointError, match="max_shard_bytes"):
        save_checkpoint(tmp_path, MINI, params, max_shard_bytes=0)


# ---------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------
@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ck"
    random_checkpoint(d, MINI, seed=11)
    return d


def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "nope")) + ".*does not exist"):
        load_checkpoint(tmp_path / "nope")


def test_path_is_a_file(ckpt):
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "config.json")) + ".*directory"):
        load_checkpoint(ckpt / "config.json")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt)) + ".*no config.json"):
        load_checkpoint(ckpt)


def test_malformed_config_json(ckpt):
    (ckpt / "config.json").write_text('{"model_type": "qwen3_5_moe_text",')
    with pytest.raises(ConfigError, match=re.escape(str(ckpt / "config.json")) + ".*not valid JSON"):
        load_checkpoint(ckpt)


def test_unsupported_config_propagates(ckpt):
    conf = json.loads((ckpt / "config.json").read_text())
    conf["model_type"] = "llama"
    (ckpt / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match=re.escape(str(ckpt / "config.json")) + ".*model_type.*llama"):
        load_checkpoint(ckpt)


def test_missing_weights_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt)) + ".*model.safetensors"):
        load_checkpoint(ckpt)


def test_index_points_at_missing_shard(tmp_path):
    random_checkpoint(tmp_path, MINI, max_shard_bytes=SHARD)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=re.escape(shard.name) + ".*" + re.escape(str(shard)) + ".*does not exist"):
        load_checkpoint(tmp_path)


def test_malformed_index(tmp_path):
    random_checkpoint(tmp_path, MINI, max_shard_bytes=SHARD)
    idx = tmp_path / "model.safetensors.index.json"
    idx.write_text("{not json")
    with pytest.raises(CheckpointError, match=re.escape(str(idx)) + ".*not valid JSON"):
        load_checkpoint(tmp_path)
    idx.write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match=re.escape(str(idx)) + ".*weight_map"):
        load_checkpoint(tmp_path)


def test_index_names_tensor_absent_from_shard(tmp_path):
    random_checkpoint(tmp_path, MINI, max_shard_bytes=SHARD)
    idx = tmp_path / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    shards = sorted(set(d["weight_map"].values()))
    d["weight_map"]["model.norm.weight"] = next(s for s in shards if s != d["weight_map"]["model.norm.weight"])
    idx.write_text(json.dumps(d))
    with pytest.raises(CheckpointError, match=r"does not contain.*'model\.norm\.weight'"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "garbage", "tiny", "empty"])
def test_corrupt_safetensors(ckpt, damage):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes({"truncated": data[: len(data) // 2], "garbage": b"\x00garbage" * 50,
                   "tiny": data[:5], "empty": b""}[damage])
    with pytest.raises(CheckpointError, match=re.escape(str(f)) + ".*safetensors"):
        load_checkpoint(ckpt)


def test_corrupt_shard(tmp_path):
    random_checkpoint(tmp_path, MINI, max_shard_bytes=SHARD)
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=re.escape(str(shard))):
        load_checkpoint(tmp_path)


def test_missing_tensor(ckpt):
    rewrite(ckpt, lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError,
                       match=re.escape(str(ckpt)) + r".*missing 1 .*'model\.layers\.3\.self_attn\.k_proj\.weight'"):
        load_checkpoint(ckpt)


def test_missing_tensor_language_model_prefix(tmp_path):
    random_checkpoint(tmp_path, MINI, prefix="model.language_model.", expert_layout="per_expert")
    rewrite(tmp_path, lambda t: t.pop("model.language_model.norm.weight"))
    with pytest.raises(CheckpointError, match=r"missing 1 .*'model\.norm\.weight'"):
        load_checkpoint(tmp_path)


def test_missing_lm_head_and_mtp(ckpt):
    rewrite(ckpt, lambda t: [t.pop("lm_head.weight"), t.pop("mtp.fc.weight")])
    with pytest.raises(CheckpointError, match=r"missing 2 .*'lm_head\.weight'.*'mtp\.fc\.weight'"):
        load_checkpoint(ckpt)
    with pytest.raises(CheckpointError, match=r"missing 1 .*'lm_head\.weight'") as e:
        load_checkpoint(ckpt, include_mtp=False)  # the MTP head is not needed then, lm_head still is
    assert "mtp.fc" not in str(e.value)


def test_misshapen_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.1.linear_attn.in_proj_z.weight": torch.zeros(7, 32)}))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt / "model.safetensors"))
                       + r".*'model\.layers\.1\.linear_attn\.in_proj_z\.weight'.*\[7, 32\].*expected \[64, 32\]"):
        load_checkpoint(ckpt)


def test_misshapen_fused_and_per_expert(tmp_path):
    random_checkpoint(tmp_path, MINI, expert_layout="per_expert")
    rewrite(tmp_path, lambda t: t.update({"mtp.layers.0.mlp.experts.2.down_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(CheckpointError,
                       match=r"'mtp\.layers\.0\.mlp\.experts\.2\.down_proj\.weight'.*\[16, 32\].*expected \[32, 16\]"):
        load_checkpoint(tmp_path)
    random_checkpoint(tmp_path, MINI)
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.experts.gate_up_proj": torch.zeros(4, 16, 32)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*\[4, 16, 32\].*"
                                              r"expected \[4, 32, 32\]"):
        load_checkpoint(tmp_path)


def test_incomplete_per_expert(tmp_path):
    random_checkpoint(tmp_path, MINI, prefix="model.language_model.", expert_layout="per_expert")
    rewrite(tmp_path, lambda t: t.pop("model.language_model.layers.2.mlp.experts.3.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"incomplete per-expert.*"
                                              r"'model\.language_model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight'"):
        load_checkpoint(tmp_path)


def test_per_expert_index_out_of_range(tmp_path):
    random_checkpoint(tmp_path, MINI, expert_layout="per_expert")
    rewrite(tmp_path, lambda t: t.update({"model.layers.0.mlp.experts.4.gate_proj.weight": torch.zeros(16, 32)}))
    with pytest.raises(CheckpointError, match=r"unexpected.*'model\.layers\.0\.mlp\.experts\.4\.gate_proj\.weight'"):
        load_checkpoint(tmp_path)


def test_unknown_extra_tensor(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.zeros(2, 2),
                                      "model.layers.9.input_layernorm.weight": torch.zeros(32)}))
    with pytest.raises(CheckpointError, match=re.escape(str(ckpt)) + r".*2 unexpected.*"
                       r"'model\.layers\.0\.self_attn\.q_proj\.weight'.*'model\.layers\.9\.input_layernorm\.weight'"):
        load_checkpoint(ckpt)


def test_duplicate_under_both_prefixes(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.language_model.norm.weight": t["model.norm.weight"].clone()}))
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' appears twice"):
        load_checkpoint(ckpt)


def test_fused_and_per_expert_both_present(ckpt):
    rewrite(ckpt, lambda t: t.update({f"model.layers.1.mlp.experts.{e}.{p}.weight": torch.zeros(1)
                                      for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")}))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.experts.*both fused"):
        load_checkpoint(ckpt)


def test_quantized_dtype_rejected(ckpt):
    rewrite(ckpt, lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(4, 32, dtype=torch.int8)}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.mlp\.gate\.weight'.*I8"):
        load_checkpoint(ckpt)


def test_both_single_and_index(tmp_path):
    random_checkpoint(tmp_path, MINI, max_shard_bytes=SHARD)
    random_checkpoint(tmp_path / "other", MINI)
    (tmp_path / "model.safetensors").write_bytes((tmp_path / "other" / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="both model.safetensors and model.safetensors.index.json"):
        load_checkpoint(tmp_path)


# ---------------------------------------------------------------------------------------
# transformers interop
# ---------------------------------------------------------------------------------------
transformers = pytest.importorskip("transformers")


def _hf_load(path):
    model, info = transformers.Qwen3_5MoeForCausalLM.from_pretrained(
        path, dtype=torch.float32, output_loading_info=True)
    return model, info


@pytest.mark.parametrize("variant", [
    dict(),  # fused, "model." prefix, text config: the form the brief requires
    dict(prefix="model.language_model.", expert_layout="per_expert", max_shard_bytes=1 << 20),
], ids=["fused_model", "per_expert_language_model_sharded"])
def test_transformers_loads_our_checkpoint(tmp_path, variant):
    params = random_checkpoint(tmp_path, TINY, seed=21, dtype=torch.float32, **variant)
    assert any(k.startswith("mtp.") for k in disk_keys(tmp_path))
    model, info = _hf_load(tmp_path)
    assert not info["missing_keys"], info
    assert not info["mismatched_keys"], info
    assert not info.get("error_msgs"), info
    sd = model.state_dict()
    trunk = {k for k in params if not k.startswith("mtp.")}
    assert set(sd) == trunk
    for k in sd:
        assert sd[k].shape == params[k].shape and torch.equal(sd[k], params[k]), k


@pytest.mark.parametrize("max_shard_size", [None, "1MB"], ids=["single", "sharded"])
def test_we_load_transformers_checkpoint(tmp_path, max_shard_size):
    hf_cfg = transformers.Qwen3_5MoeTextConfig(
        **{k: v for k, v in TINY.to_hf_dict().items() if k not in ("architectures", "model_type")})
    model = transformers.Qwen3_5MoeForCausalLM(hf_cfg).float()
    ours = random_params(TINY, seed=9, dtype=torch.float32)
    missing, unexpected = model.load_state_dict({k: v for k, v in ours.items() if not k.startswith("mtp.")},
                                                strict=True)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(tmp_path, **kw)

    # transformers 5.23 writes experts per expert (it reverts its load-time fusion).
    keys = disk_keys(tmp_path)
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in keys
    assert "model.layers.0.mlp.experts.gate_up_proj" not in keys

    # add the MTP head into a weight file (and the index, if sharded)
    mtp = {k: v for k, v in ours.items() if k.startswith("mtp.")}
    target = sorted(tmp_path.glob("*.safetensors"))[-1]
    tensors = load_file(str(target))
    tensors.update(mtp)
    save_file(tensors, str(target), metadata={"format": "pt"})
    idx = tmp_path / "model.safetensors.index.json"
    assert idx.exists() == (max_shard_size is not None)
    if idx.exists():
        d = json.loads(idx.read_text())
        d["weight_map"].update({k: target.name for k in mtp})
        idx.write_text(json.dumps(d))

    cfg, loaded = load_checkpoint(tmp_path, dtype=torch.float32)
    assert cfg == TINY
    sd = model.state_dict()
    assert set(loaded) == set(sd) | set(mtp)
    for k, v in loaded.items():
        assert torch.equal(v, sd[k] if k in sd else mtp[k]), k
        assert torch.equal(v, ours[k]), k
