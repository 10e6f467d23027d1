"""Model configuration of the Qwen3.5/3.6-MoE architecture.

One home for every model dimension: kernels, the reference model, the weight
loader and the harness all read them from a `ModelConfig`. It is read from a
Hugging Face ``config.json`` in either form the checkpoints use:

* multimodal ``model_type: "qwen3_5_moe"`` with the text model nested under
  ``text_config`` (what the Qwen3.6-35B-A3B checkpoint ships), or
* text-only ``model_type: "qwen3_5_moe_text"``.

Field names follow transformers' ``Qwen3_5MoeTextConfig`` (5.23); ``mtp_num_hidden_layers``
is the field vLLM reads for the MTP head. See ``shared/docs/qwen36.md`` §2.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

LINEAR = "linear_attention"
FULL = "full_attention"
MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")


class ConfigError(ValueError):
    """A config.json that does not describe a model this project can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a Qwen3.5-MoE text model plus its MTP head."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    partial_rotary_factor: float
    rope_theta: float
    max_position_embeddings: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    mtp_num_hidden_layers: int = 1
    rms_norm_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = field(default_factory=tuple)

    def __post_init__(self):
        self._validate()

    # ---- derived dimensions -------------------------------------------------
    @property
    def rotary_dim(self) -> int:
        """Number of leading head dims that RoPE rotates (64 of 256 for Qwen3.6)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: q ‖ k ‖ v."""
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def conv_window(self) -> int:
        """Raw pre-conv projections kept as decode state (kernel size - 1)."""
        return self.linear_conv_kernel_dim - 1

    @property
    def gqa_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @property
    def gva_group(self) -> int:
        """Value heads per GDN key head (value head h uses key head h // gva_group)."""
        return self.linear_num_value_heads // self.linear_num_key_heads

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR)

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL)

    # ---- validation ----------------------------------------------------------
    def _validate(self):
        def need(ok: bool, name: str, msg: str):
            if not ok:
                raise ConfigError(f"config field {name!r}: {msg}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "max_position_embeddings",
                     "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                     "linear_value_head_dim", "linear_conv_kernel_dim", "num_experts",
                     "num_experts_per_tok", "moe_intermediate_size",
                     "shared_expert_intermediate_size"):
            v = getattr(self, name)
            need(isinstance(v, int) and not isinstance(v, bool) and v > 0, name,
                 f"expected a positive integer, found {v!r}")
        need(isinstance(self.mtp_num_hidden_layers, int) and self.mtp_num_hidden_layers >= 0,
             "mtp_num_hidden_layers", f"expected an integer >= 0, found {self.mtp_num_hidden_layers!r}")
        need(self.mtp_num_hidden_layers <= 1, "mtp_num_hidden_layers",
             f"this project supports at most one MTP layer, found {self.mtp_num_hidden_layers}")
        need(len(self.layer_types) == self.num_hidden_layers, "layer_types",
             f"expected {self.num_hidden_layers} entries (num_hidden_layers), found {len(self.layer_types)}")
        bad = sorted({t for t in self.layer_types if t not in (LINEAR, FULL)})
        need(not bad, "layer_types", f"entries must be {LINEAR!r} or {FULL!r}, found {bad}")
        need(self.num_attention_heads % self.num_key_value_heads == 0, "num_key_value_heads",
             f"{self.num_key_value_heads} does not divide num_attention_heads={self.num_attention_heads}")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0, "linear_num_value_heads",
             f"{self.linear_num_value_heads} is not a multiple of linear_num_key_heads={self.linear_num_key_heads}")
        need(0.0 < self.partial_rotary_factor <= 1.0, "partial_rotary_factor",
             f"expected a value in (0, 1], found {self.partial_rotary_factor}")
        need(self.rotary_dim % 2 == 0 and self.rotary_dim > 0, "partial_rotary_factor",
             f"head_dim*factor = {self.head_dim * self.partial_rotary_factor} must be a positive even integer")
        need(self.rope_theta > 0, "rope_theta", f"expected a positive value, found {self.rope_theta}")
        need(self.num_experts_per_tok <= self.num_experts, "num_experts_per_tok",
             f"{self.num_experts_per_tok} exceeds num_experts={self.num_experts}")
        need(self.hidden_act == "silu", "hidden_act", f"only 'silu' is supported, found {self.hidden_act!r}")
        need(not self.attention_bias, "attention_bias", "attention projections with bias are not supported")
        need(self.norm_topk_prob, "norm_topk_prob", "Qwen3.5-MoE always renormalises the top-k weights")
        need(self.rms_norm_eps > 0, "rms_norm_eps", f"expected a positive value, found {self.rms_norm_eps}")
        for t in self.eos_token_id:
            need(0 <= t < self.vocab_size, "eos_token_id", f"{t} is outside the vocabulary [0, {self.vocab_size})")

    # ---- Hugging Face config.json -------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        """Build from the dict of a config.json (either model_type, see module doc)."""
        if not isinstance(d, dict):
            raise ConfigError(f"config.json must hold a JSON object, found {type(d).__name__}")
        mt = d.get("model_type")
        if mt == "qwen3_5_moe":
            text = d.get("text_config")
            if not isinstance(text, dict):
                raise ConfigError("config field 'text_config': a qwen3_5_moe config needs a nested text_config object")
            text = dict(text)
            # Multimodal configs keep a few fields at the top level only.
            for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
                if key not in text and key in d:
                    text[key] = d[key]
        elif mt == "qwen3_5_moe_text":
            text = d
        else:
            raise ConfigError(f"config field 'model_type': expected one of {MODEL_TYPES}, found {mt!r}")

        def get(name, default=None, required=True):
            if name in text:
                return text[name]
            if required and default is None:
                raise ConfigError(f"config field {name!r} is missing")
            return default

        n_layers = get("num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = get("full_attention_interval", 4)
            if not isinstance(interval, int) or interval <= 0:
                raise ConfigError(f"config field 'full_attention_interval': expected a positive integer, found {interval!r}")
            layer_types = [LINEAR if (i + 1) % interval else FULL for i in range(n_layers)]
        rope = text.get("rope_parameters") or {}
        if not isinstance(rope, dict):
            raise ConfigError(f"config field 'rope_parameters': expected an object, found {type(rope).__name__}")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"config field 'rope_parameters.rope_type': only 'default' is supported, found {rope_type!r}")
        eos = text.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
        try:
            return cls(
                vocab_size=get("vocab_size"),
                hidden_size=get("hidden_size"),
                num_hidden_layers=n_layers,
                layer_types=tuple(layer_types),
                num_attention_heads=get("num_attention_heads"),
                num_key_value_heads=get("num_key_value_heads"),
                head_dim=get("head_dim", _default_head_dim(text)),
                partial_rotary_factor=float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))),
                rope_theta=float(rope.get("rope_theta", text.get("rope_theta", 10000.0))),
                max_position_embeddings=get("max_position_embeddings", 32768),
                linear_num_key_heads=get("linear_num_key_heads"),
                linear_num_value_heads=get("linear_num_value_heads"),
                linear_key_head_dim=get("linear_key_head_dim"),
                linear_value_head_dim=get("linear_value_head_dim"),
                linear_conv_kernel_dim=get("linear_conv_kernel_dim", 4),
                num_experts=get("num_experts"),
                num_experts_per_tok=get("num_experts_per_tok"),
                moe_intermediate_size=get("moe_intermediate_size"),
                shared_expert_intermediate_size=get("shared_expert_intermediate_size"),
                mtp_num_hidden_layers=text.get("mtp_num_hidden_layers", 0),
                rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
                norm_topk_prob=bool(text.get("norm_topk_prob", True)),
                tie_word_embeddings=bool(text.get("tie_word_embeddings", False)),
                hidden_act=text.get("hidden_act", "silu"),
                attention_bias=bool(text.get("attention_bias", False)),
                bos_token_id=text.get("bos_token_id"),
                eos_token_id=eos,
            )
        except ConfigError:
            raise
        except (TypeError, ValueError) as e:  # a field of the wrong JSON type reaching a conversion
            raise ConfigError(f"config.json has a field of the wrong type: {e}") from None

    @classmethod
    def from_json_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such file") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        try:
            return cls.from_hf_dict(d)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None

    def to_hf_dict(self) -> dict:
        """The text-only ``qwen3_5_moe_text`` config.json that transformers loads."""
        d = {
            "architectures": ["Qwen3_5MoeForCausalLM"],
            "model_type": "qwen3_5_moe_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta,
                                "partial_rotary_factor": self.partial_rotary_factor},
            "max_position_embeddings": self.max_position_embeddings,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "num_experts": self.num_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
            "mtp_num_hidden_layers": self.mtp_num_hidden_layers,
            "rms_norm_eps": self.rms_norm_eps,
            "norm_topk_prob": self.norm_topk_prob,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": self.hidden_act,
            "attention_bias": self.attention_bias,
        }
        if self.bos_token_id is not None:
            d["bos_token_id"] = self.bos_token_id
        if self.eos_token_id:
            d["eos_token_id"] = list(self.eos_token_id) if len(self.eos_token_id) > 1 else self.eos_token_id[0]
        return d

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _default_head_dim(text: dict):
    """hidden_size // num_attention_heads when both are usable (validation reports them otherwise)."""
    hs, nh = text.get("hidden_size"), text.get("num_attention_heads")
    ok = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hs, nh))
    return hs // nh if ok else hs


def _pattern(n_layers: int, interval: int = 4) -> tuple[str, ...]:
    return tuple(LINEAR if (i + 1) % interval else FULL for i in range(n_layers))


PRESETS: dict[str, ModelConfig] = {
    # Qwen3.6-35B-A3B (= Qwen3.5-35B-A3B dims), shared/docs/qwen36.md §2.
    "qwen3.6-35b-a3b": ModelConfig(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, layer_types=_pattern(40),
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        rope_theta=1e7, max_position_embeddings=262144, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, mtp_num_hidden_layers=1, rms_norm_eps=1e-6,
        bos_token_id=248044, eos_token_id=(248044,),
    ),
    # Small dims with every structural feature: 3:1 GDN/attention pattern, value heads
    # = 2 x key heads, GQA (8 q heads over 2 kv heads), partial RoPE, top-k + shared
    # expert, one MTP layer. Head counts shard over TP=4 like the real model's
    # (1 GDN key head, 2 value heads, 2 query heads and 1 kv head per rank); hidden 128
    # fills the 128 partitions. Vocabulary: 256 bytes + specials, padded to a
    # multiple of 16 so it splits evenly over 8 cores.
    "tiny": ModelConfig(
        vocab_size=272, hidden_size=128, num_hidden_layers=8, layer_types=_pattern(8),
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25,
        rope_theta=1e7, max_position_embeddings=4096, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=64, mtp_num_hidden_layers=1, rms_norm_eps=1e-6,
        bos_token_id=256, eos_token_id=(257,),
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"no preset named {name!r}; known presets: {', '.join(PRESETS)}") from None
