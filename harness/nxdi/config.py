"""Translation between ``model.config.ModelConfig`` and NxDI's configuration objects (plain, tested).

NxDI splits configuration in two (``src/neuronx_distributed_inference/models/config.py`` of
aws-neuron/neuronx-distributed-inference 0.9.0): ``InferenceConfig`` (lines 849-1042) carries the model's
attributes (what a Hugging Face ``PretrainedConfig`` holds; NxDI checks ``get_required_attributes()`` in
``validate_config``, lines 905-910, and saves everything to ``neuron_config.json``), ``NeuronConfig``
(lines 84-782) the Neuron-side settings. This module produces the attribute dict of the first and the
keyword arguments of the second (every keyword is one ``NeuronConfig.__init__`` pops, checked against the
source: an unknown one is only logged, line 639-640); ``harness.nxdi.modeling`` feeds them to the real classes.

Settings that matter for correctness (the rest are NxDI defaults):

* ``cast_type="as-declared"`` (line 118): with NxDI's default ``"config"`` every floating parameter -- and
  every floating checkpoint tensor -- is cast to ``torch_dtype`` (``DecoderModelInstance.load_module`` in
  ``models/model_wrapper.py`` lines 1459-1468, ``checkpoint_loader_fn`` in ``models/application_base.py``
  lines 677-681); that would turn the fp32 GDN recurrent state, norm weights and A_log/dt_bias into bf16.
* ``batch_size`` 1 everywhere; no bucketing, no on-device sampling (the graphs do their own argmax),
  ``speculation_length=0`` (NxDI's own speculation graph is not used: the round graph IS the speculation).
* ``save_sharded_checkpoint=True`` (line 367): ``load()`` reads per-rank weight files
  (``NeuronApplicationBase.load_weights``, ``models/application_base.py`` lines 389-399), which the
  conversion writes (``harness.nxdi.convert``).
* LNC: ``NeuronConfig._get_lnc`` (lines 729-759) takes ``NEURON_LOGICAL_NC_CONFIG`` over the
  ``logical_nc_config`` keyword (with only a warning). The kernels' layout (LM-head vocabulary and MoE
  splits over ``tp * lnc`` cores) is fixed when converting, so :func:`check_lnc` refuses any other LNC.
* ``trace_tokengen_model`` is NOT passed: it is deprecated (``NeuronConfig.__getattribute__`` lines 771-781)
  and ``__init__`` never pops it.
"""

from __future__ import annotations

from typing import Callable

import torch

from harness.nxdi.assembly import BACKENDS, AssemblyError, check_drafts, check_sharding, dtype_name
from megakernel.plan import DEFAULT_DRAFTS
from model.config import ConfigError, ModelConfig, preset

# Attributes of the InferenceConfig: the text model's config.json fields (ModelConfig.to_hf_dict) plus ours.
NXDI_ATTRIBUTES = ("nxdi_backend", "nxdi_max_len", "nxdi_lnc", "nxdi_num_draft_tokens", "nxdi_context_buckets",
                   "nxdi_param_specs")
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


def attribute_loader(cfg: ModelConfig, backend: str, max_len: int, lnc: int, param_specs_json: dict,
                     drafts: int = DEFAULT_DRAFTS, buckets=()) -> Callable[[object], None]:
    """The ``load_config`` callable NxDI's ``InferenceConfig(neuron_config, load_config=...)`` calls with the
    new config object (``models/config.py`` lines 863-866): sets the model's attributes and ours.
    ``nxdi_lnc`` is the LNC the weights were converted for (``neuron_config.logical_nc_config`` may differ:
    the environment wins there, :func:`check_lnc`); ``nxdi_num_draft_tokens`` the chained drafts per round (K)
    the graphs are built for; ``nxdi_context_buckets`` the chunk lengths of the context-encoding graphs
    (``harness.nxdi.context``)."""
    if backend not in BACKENDS:
        raise ConfigError(f"nxdi backend must be one of {BACKENDS}, found {backend!r}")
    try:
        drafts = check_drafts(drafts)
    except AssemblyError as e:
        raise ConfigError(str(e)) from None
    from harness.nxdi.context import ContextError, check_buckets
    try:
        buckets = list(check_buckets(buckets, max_len))
    except ContextError as e:
        raise ConfigError(str(e)) from None

    def load(obj):
        for k, v in model_attributes(cfg).items():
            setattr(obj, k, v)
        obj.nxdi_backend = backend
        obj.nxdi_max_len = int(max_len)
        obj.nxdi_lnc = int(lnc)
        obj.nxdi_num_draft_tokens = drafts
        obj.nxdi_context_buckets = buckets
        obj.nxdi_param_specs = param_specs_json
        if getattr(obj, "pad_token_id", None) is None:
            obj.pad_token_id = 0  # NxDI's ModelWrapper sets this too when absent (model_wrapper.py lines 69-70)
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
        "save_sharded_checkpoint": True,
    }


def compiler_args(lnc: int, backend: str, context: bool = False) -> str:
    """neuronx-cc arguments of every graph of ``backend``.

    xla: the flags NxDI's ``ModelWrapper`` builds for its token-generation graph when given none
    (``models/model_wrapper.py`` lines 86-128: ``cc_pipeline_tiling_factor`` forced to 1 for the
    token-generation tag, ``-O2``, the tensorizer options). We pass them explicitly because our graphs' tags
    are not NxDI's token-generation tag, for which alone that factor is set to 1. ``ModelWrapper`` appends
    ``--internal-hlo2tensorizer-options='--verify-hlo=true'`` to any arguments (line 162) and NxD's
    ``append_default_compiler_flags`` ``--verbose=35`` (``trace/model_builder.py`` lines 104-124).
    megakernel: each graph is one NKI custom call, so the XLA tensorizer options have nothing to tune; NxD's
    default flags (``trace/model_builder.py`` line 106) plus ``--lnc``.
    Both keep ``--auto-cast=none`` (fp32 state and accumulations stay fp32) and ``--lnc`` = the converted LNC.
    ``context``: a context-encoding graph (``harness.nxdi.context``); xla: the flags NxDI builds for its own
    context-encoding graph (same lines: ``cc_pipeline_tiling_factor`` at its default 2, ``NeuronConfig`` line 581,
    ``-O1`` "force Modular flow for CTE model", lines 120-124; its optional features left out as for the decode
    graphs); megakernel: as for the decode graphs."""
    if backend == "xla" and context:
        return ("--auto-cast=none --model-type=transformer "
                "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=2 "
                f"--vectorize-strided-dma ' --lnc={lnc} -O1")
    if backend == "xla":
        return ("--auto-cast=none --model-type=transformer "
                "--tensorizer-options='--enable-ccop-compute-overlap --cc-pipeline-tiling-factor=1 "
                f"--vectorize-strided-dma ' --lnc={lnc} -O2")
    if backend == "megakernel":
        return f"--enable-saturate-infinity --auto-cast=none --model-type=transformer --lnc={lnc} -O1"
    raise ConfigError(f"nxdi backend must be one of {BACKENDS}, found {backend!r}")


LNC_ENV = "NEURON_LOGICAL_NC_CONFIG"


def check_lnc(running: int, converted: int) -> None:
    """Raise ConfigError unless the LNC NxDI runs with equals the one the weights were converted for."""
    if int(running) != int(converted):
        raise ConfigError(f"the running LNC is {running} ({LNC_ENV} overrides logical_nc_config in NxDI) but the "
                          f"weights were converted for lnc={converted}: set {LNC_ENV}={converted} or convert "
                          f"again with --lnc {running}")


def env_lnc(environ) -> int | None:
    """The LNC ``NEURON_LOGICAL_NC_CONFIG`` sets, or None when unset (as NxDI reads it: an int)."""
    v = environ.get(LNC_ENV)
    if v is None or v.strip() == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{LNC_ENV}={v!r} is not an integer") from None
