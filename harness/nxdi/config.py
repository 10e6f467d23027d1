"""Translation between ``model.config.ModelConfig`` and NxDI's configuration objects (plain, tested).

NxDI splits configuration in two (``src/neuronx_distributed_inference/models/config.py`` of
aws-neuron/neuronx-distributed-inference): ``InferenceConfig`` carries the model's attributes (what a
Hugging Face ``PretrainedConfig`` holds; NxDI checks ``get_required_attributes()`` and saves everything to
``neuron_config.json``), ``NeuronConfig`` the Neuron-side settings (``tp_degree``, ``logical_nc_config``,
``batch_size``, ``seq_len``, ``torch_dtype``, ``cast_type``, ...). This module produces the attribute dict
of the first and the keyword arguments of the second; ``harness.nxdi.modeling`` feeds them to the real
classes.

Settings that matter for correctness (the rest are NxDI defaults):

* ``cast_type="as-declared"``: with NxDI's default ``"config"`` every floating parameter -- and every
  floating checkpoint tensor -- is cast to ``torch_dtype`` (``DecoderModelInstance.load_module`` in
  ``models/model_wrapper.py``, ``checkpoint_loader_fn`` in ``models/application_base.py``); that would
  turn the fp32 GDN recurrent state, norm weights and A_log/dt_bias into bf16.
* ``batch_size`` 1 everywhere; no bucketing, no on-device sampling (the graphs do their own argmax),
  ``speculation_length=0`` (NxDI's own speculation graph is not used: the round graph IS the
  speculation).
* ``save_sharded_checkpoint=True``: ``compile()`` writes per-rank weights once, ``load()`` reads them
  (``NeuronApplicationBase.shard_weights`` / ``load_weights`` in ``models/application_base.py``).
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.nxdi.assembly import BACKENDS, check_sharding, dtype_name
from model.config import ConfigError, ModelConfig, preset

# Attributes of the InferenceConfig: the text model's config.json fields (ModelConfig.to_hf_dict) plus ours.
NXDI_ATTRIBUTES = ("nxdi_backend", "nxdi_max_len", "nxdi_param_specs")
_OPTIONAL_KEYS = ("bos_token_id", "eos_token_id")  # written by to_hf_dict only when set
_MODEL_KEYS = tuple(k for k in preset("tiny").to_hf_dict() if k not in ("architectures",) + _OPTIONAL_KEYS)
REQUIRED_ATTRIBUTES = _MODEL_KEYS + NXDI_ATTRIBUTES


def model_attributes(cfg: ModelConfig) -> dict:
    """The model's attributes as the InferenceConfig holds them (JSON-serialisable values)."""
    d = cfg.to_hf_dict()
    d.pop("architectures", None)
    return d


def model_config_from(obj) -> ModelConfig:
    """ModelConfig from an object carrying the attributes of :func:`model_attributes` (an InferenceConfig,
    or one loaded back from neuron_config.json)."""
    d = {k: getattr(obj, k) for k in _MODEL_KEYS + _OPTIONAL_KEYS if getattr(obj, k, None) is not None}
    d["model_type"] = "qwen3_5_moe_text"
    return ModelConfig.from_hf_dict(d)


def attribute_loader(cfg: ModelConfig, backend: str, max_len: int, param_specs_json: dict) -> Callable[[object], None]:
    """The ``load_config`` callable NxDI's ``InferenceConfig(neuron_config, load_config=...)`` calls with the
    new config object: sets the model's attributes and ours."""
    if backend not in BACKENDS:
        raise ConfigError(f"nxdi backend must be one of {BACKENDS}, found {backend!r}")

    def load(obj):
        for k, v in model_attributes(cfg).items():
            setattr(obj, k, v)
        obj.nxdi_backend = backend
        obj.nxdi_max_len = int(max_len)
        obj.nxdi_param_specs = param_specs_json
        if getattr(obj, "pad_token_id", None) is None:
            obj.pad_token_id = 0  # NxDI's ModelWrapper sets this too when absent
    return load


def neuron_config_kwargs(cfg: ModelConfig, max_len: int, tp: int = 4, lnc: int = 2,
                         dtype: torch.dtype = torch.bfloat16) -> dict:
    """Keyword arguments of NxDI's ``NeuronConfig`` for one trn2.3xlarge: batch 1, ``max_len`` positions."""
    check_sharding(cfg, tp, lnc)
    if not 2 <= max_len <= cfg.max_position_embeddings:
        raise ConfigError(f"max_len must be in 2..{cfg.max_position_embeddings} (max_position_embeddings), "
                          f"found {max_len}")
    if lnc not in (1, 2):
        raise ConfigError(f"logical_nc_config (lnc) must be 1 or 2 on trn2, found {lnc}")
    return {
        "tp_degree": tp, "logical_nc_config": lnc,
        "batch_size": 1, "ctx_batch_size": 1, "tkg_batch_size": 1, "max_batch_size": 1,
        "seq_len": max_len, "max_context_length": max_len, "n_positions": max_len, "max_length": max_len,
        "torch_dtype": dtype_name(dtype), "cast_type": "as-declared", "padding_side": "right",
        "on_device_sampling_config": None, "enable_bucketing": False, "speculation_length": 0,
        "trace_tokengen_model": True, "save_sharded_checkpoint": True,
    }


def compiler_args(lnc: int) -> str:
    """neuronx-cc arguments of every graph. ``--auto-cast=none`` keeps fp32 state and accumulations fp32;
    ``--lnc`` must equal ``logical_nc_config`` (NxDI's ModelWrapper adds the same two,
    ``models/model_wrapper.py``)."""
    return f"--auto-cast=none --model-type=transformer --lnc={lnc} -O1"
