"""config.json in both forms, presets, and invalid configs naming the field."""

from __future__ import annotations

import json

import pytest

from model.config import FULL, LINEAR, PRESETS, ConfigError, ModelConfig, preset


def test_real_preset_dims():
    c = preset("qwen3.6-35b-a3b")
    assert c.full_layers == tuple(range(3, 40, 4))
    assert c.rotary_dim == 64 and c.conv_dim == 8192 and c.gva_group == 2 and c.gqa_group == 8


@pytest.mark.parametrize("name", list(PRESETS))
def test_roundtrip_text_and_multimodal(name):
    c = preset(name)
    text = c.to_hf_dict()
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(text))) == c
    mm = {"model_type": "qwen3_5_moe", "tie_word_embeddings": False,
          "text_config": {k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")}}
    assert ModelConfig.from_hf_dict(mm) == c


def test_layer_types_from_interval_and_legacy_rope_fields():
    d = preset("tiny").to_hf_dict()
    del d["layer_types"], d["rope_parameters"]
    d.update(full_attention_interval=2, rope_theta=5e6, partial_rotary_factor=0.5)
    c = ModelConfig.from_hf_dict(d)
    assert c.layer_types == (LINEAR, FULL) * 4 and c.rope_theta == 5e6 and c.rotary_dim == 32


def test_tiny_keeps_structural_features():
    c = preset("tiny")
    assert c.layer_types[:4] == (LINEAR, LINEAR, LINEAR, FULL)
    assert c.gva_group == 2 and c.gqa_group > 1 and c.rotary_dim < c.head_dim
    assert 1 < c.num_experts_per_tok < c.num_experts and c.mtp_num_hidden_layers == 1


@pytest.mark.parametrize("change,field", [
    ({"model_type": "llama"}, "model_type"),
    ({"num_key_value_heads": 3}, "num_key_value_heads"),
    ({"linear_num_value_heads": 6}, "linear_num_value_heads"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types"),
    ({"layer_types": ["mamba"] * 8}, "layer_types"),
    ({"num_experts_per_tok": 99}, "num_experts_per_tok"),
    ({"hidden_size": -4}, "hidden_size"),
    ({"hidden_size": "big"}, "hidden_size"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type"),
    ({"eos_token_id": 9999}, "eos_token_id"),
    ({"mtp_num_hidden_layers": 2}, "mtp_num_hidden_layers"),
])
def test_invalid_config_names_field(change, field):
    d = preset("tiny").to_hf_dict()
    d.update(change)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_hf_dict(d)


def test_missing_field_and_bad_files(tmp_path):
    d = preset("tiny").to_hf_dict()
    del d["num_experts"]
    with pytest.raises(ConfigError, match="'num_experts' is missing"):
        ModelConfig.from_hf_dict(d)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        ModelConfig.from_json_file(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no such file"):
        ModelConfig.from_json_file(tmp_path / "missing.json")
    with pytest.raises(ConfigError, match="nested text_config"):
        ModelConfig.from_hf_dict({"model_type": "qwen3_5_moe"})
