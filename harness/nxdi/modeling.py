"""trn2 ONLY -- NEVER EXECUTED IN THIS REPOSITORY (no machine we develop on has Trainium or the Neuron SDK).

The NxD Inference application of the speculative round: configuration, the traced module, its graphs
and the engine the host loop drives. Every piece of logic lives in the plain, CPU-tested modules
(``assembly``, ``xla_math``, ``host``, ``config``, ``convert``); this file only hands their results to
NxDI. Importing it without neuronx-distributed-inference raises ImportError saying so.

NxDI API relied on (aws-neuron/neuronx-distributed-inference unless noted; see harness/nxdi/README.md):

* ``models/config.py``: ``InferenceConfig(neuron_config, load_config=...)`` with
  ``get_required_attributes`` / ``get_neuron_config_cls``, ``InferenceConfig.load(path)``; ``NeuronConfig``.
* ``models/model_base.py``: ``NeuronBaseModel(config, optimize_inference)`` calling
  ``setup_attr_for_model`` then ``init_model`` (``optimize_inference=False``: no ``KVCacheManager``, whose
  caches would be allocated for nothing -- our decode state is our own); it creates ``rank_util``
  (``SPMDRank``) whose checkpoint entry ``rank_util.rank`` we write. ``NeuronBaseForCausalLM`` with
  ``_model_cls``, ``get_config_cls``, ``enable_context_encoding`` / ``enable_token_generation`` (overridden:
  they register our graphs), ``get_compiler_args``, ``convert_hf_to_neuron_state_dict``.
* ``models/application_base.py``: ``compile(path)``, ``load(path)``, ``get_state_dict`` (overridden: reads a
  converted checkpoint), ``checkpoint_loader_fn``, ``self.models``.
* ``models/model_wrapper.py``: ``ModelWrapper(config, model_cls, tag, compiler_args, ...)`` with
  ``input_generator`` / ``get_model_instance`` / ``_forward`` (overridden / used); the alias map of
  ``DecoderModelInstance.get`` (state parameter -> output index) is what our instance returns.
* neuronx-distributed: ``trace/model_builder.py`` ``BaseModelInstance``; ``parallel_layers/utils.py``
  ``set_tensor_model_parallel_attributes`` (per-rank parameters sharded along dim 0, as ``SPMDRank`` in
  ``parallel_layers/layers.py``); ``parallel_layers/mappings.py`` ``reduce_from_tensor_model_parallel_region``
  and ``gather_from_tensor_model_parallel_region`` (the xla backend's collectives). NxD's ``NxDModel``
  requires every submodel to share one forward signature and routes a call by the names and shapes of
  the arguments given -- hence one module class and prefixes of ``assembly.FORWARD_INPUTS``.
* NKI from PyTorch: an ``@nki.jit`` kernel called as ``kernel[lnc](**tensors)`` on the traced graph's
  tensors becomes one custom call in the XLA graph (aws-neuron-sdk ``nki/guides/framework_custom_op.rst``;
  NxDI calls its own kernels the same way: ``qkv_kernel = nki.jit(qkv)`` then
  ``qkv_kernel[self.logical_nc_config](input=..., fused_qkv_weights=self.Wqkv.weight.data, ...)`` in
  ``modules/attention/gqa.py``). ``torch_neuronx.nki_jit`` is unsupported since Neuron 2.24 (aws-neuron-sdk
  announcement "announce-no-support-nki-jit-torch").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

NEEDS_SDK = ("harness.nxdi.modeling needs the Neuron SDK (neuronx-distributed-inference, neuronx-distributed, "
             "torch-neuronx, nki) and runs only on a trn2 host; install the `neuron` extra in a Neuron SDK venv "
             "(harness/nxdi/README.md). The plain parts of harness.nxdi work without it.")

try:
    from neuronx_distributed.parallel_layers.mappings import (
        gather_from_tensor_model_parallel_region,
        reduce_from_tensor_model_parallel_region,
    )
    from neuronx_distributed.parallel_layers.utils import set_tensor_model_parallel_attributes
    from neuronx_distributed.trace.model_builder import BaseModelInstance
    from neuronx_distributed_inference.models.config import InferenceConfig, NeuronConfig
    from neuronx_distributed_inference.models.model_base import NeuronBaseForCausalLM, NeuronBaseModel
    from neuronx_distributed_inference.models.model_wrapper import ModelWrapper
except ImportError as e:  # this machine: no Neuron SDK
    raise ImportError(f"{NEEDS_SDK} [{type(e).__name__}: {e}]") from e

from harness.nxdi import assembly as asm
from harness.nxdi import config as nxcfg
from harness.nxdi import convert as nxconv
from harness.nxdi import xla_math
from megakernel.round import build_kernel, mutated_names
from model.config import ModelConfig

TAGS = {"reset": "reset_state_model", "step": "step_model", "round": "round_model"}


class Qwen36InferenceConfig(InferenceConfig):
    """The model's attributes (``harness.nxdi.config.model_attributes``) plus ``nxdi_backend``,
    ``nxdi_max_len`` and ``nxdi_param_specs``."""

    def get_required_attributes(self) -> list[str]:
        return list(nxcfg.REQUIRED_ATTRIBUTES)

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig

    def model_config(self) -> ModelConfig:
        return nxcfg.model_config_from(self)

    @classmethod
    def from_converted(cls, converted: str | Path) -> "Qwen36InferenceConfig":
        meta = nxconv.read_meta(converted)
        cfg = ModelConfig.from_json_file(Path(converted) / nxconv.CONFIG_FILE)
        kwargs = nxcfg.neuron_config_kwargs(cfg, meta["max_len"], meta["tp"], meta["lnc"], asm.dtype_of(meta["dtype"]))
        return cls(NeuronConfig(**kwargs),
                   load_config=nxcfg.attribute_loader(cfg, meta["backend"], meta["max_len"], meta["param_specs"]))


class Qwen36NeuronModel(NeuronBaseModel):
    """One graph of the application (``mode``: reset, step or round); weights and decode state are
    parameters with per-rank shapes. Traced by NxD; never run eagerly."""

    def __init__(self, config: Qwen36InferenceConfig, mode: str = "round"):
        self.mode = mode
        super().__init__(config, optimize_inference=False)

    def setup_attr_for_model(self, config):
        nc = config.neuron_config
        self.on_device_sampling = False
        self.tp_degree = nc.tp_degree
        self.hidden_size = config.hidden_size
        self.num_attention_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.max_batch_size = nc.max_batch_size
        self.buckets = [nc.seq_len]

    def init_model(self, config):
        self.cfg = config.model_config()
        self.backend = config.nxdi_backend
        self.lnc = config.neuron_config.logical_nc_config
        tp = self.tp_degree
        self.weights = nn.ParameterDict()
        for name, (shape, dtype) in asm.specs_from_json(config.nxdi_param_specs).items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1)
            self.weights[name] = p
        act = config.neuron_config.torch_dtype
        self.states = nn.ParameterDict({
            name: nn.Parameter(torch.zeros(shape, dtype=dtype), requires_grad=False)
            for name, (shape, dtype) in asm.state_specs(self.cfg, tp, config.nxdi_max_len, act).items()})
        self.spec = None if self.mode == "reset" else asm.round_spec(self.cfg, tp, self.lnc, self.mode)
        if self.backend == "megakernel" and self.spec is not None:
            self.kernel_names = asm.kernel_arg_names(self.weights.keys(), self.states.keys(), self.mode)
            self.kernel = build_kernel(self.spec, self.kernel_names)

    def aliases(self) -> dict:
        names = list(self.states.keys())
        idx = asm.reset_aliases(names) if self.spec is None else asm.state_aliases(self.spec)
        return {self.states[n]: i for n, i in idx.items()}

    def forward(self, pending, read_slot=None, pos=None, cos_v=None, sin_v=None, hidden=None, force=None,
                pos_d1=None, cos_d1=None, sin_d1=None):
        if self.spec is None:  # reset: zeros for every state buffer (aliased in place)
            return [pending] + [torch.zeros_like(p) for p in self.states.values()]
        given = dict(zip(asm.FORWARD_INPUTS, (pending, read_slot, pos, cos_v, sin_v, hidden, force, pos_d1, cos_d1,
                                              sin_d1)))
        rt = {n: given[n] for n in asm.forward_inputs(self.mode)}
        w = {k: p.data for k, p in self.weights.items()}
        st = {k: p.data for k, p in self.states.items()}
        if self.backend == "megakernel":  # the token-generation hook: ONE kernel launch per rank
            return list(self.kernel[self.lnc](**asm.kernel_kwargs(self.kernel_names, w, st, rt)))
        coll = xla_math.Collectives(all_reduce=reduce_from_tensor_model_parallel_region,
                                    gather_last=gather_from_tensor_model_parallel_region)
        draft, targets, hid, new = xla_math.forward(self.cfg, self.spec, w, st, rt, coll)
        return [draft, targets, hid, *(new[n] for n in mutated_names(self.spec))]


class _GraphInstance(BaseModelInstance):
    """What NxD's ModelBuilder traces for one graph: the module and its state aliasing."""

    def __init__(self, model_cls, config, mode: str):
        self.model_cls, self.config, self.mode = model_cls, config, mode
        self.module = None
        self.input_output_aliases = None

    def load_module(self):
        self.module = self.model_cls(self.config, mode=self.mode)
        self.module.eval()

    def get(self, bucket_rank, **kwargs):
        self.input_output_aliases = self.module.aliases()
        return self.module, self.input_output_aliases


class _GraphWrapper(ModelWrapper):
    def __init__(self, config, model_cls, mode: str, compiler_args: str):
        super().__init__(config=config, model_cls=model_cls, tag=TAGS[mode], compiler_args=compiler_args)
        self.mode = mode

    def input_generator(self):
        cfg = self.config.model_config()
        ex = asm.runtime_example(cfg, "step", self.neuron_config.torch_dtype) if self.mode == "reset" else \
            asm.runtime_example(cfg, self.mode, self.neuron_config.torch_dtype)
        return [tuple(ex[n] for n in asm.forward_inputs(self.mode))]

    def get_model_instance(self):
        return _GraphInstance(self.model_cls, self.config, self.mode)

    def forward(self, *inputs):
        return self._forward(*inputs)


class Qwen36ForCausalLM(NeuronBaseForCausalLM):
    """The application: graphs ``reset_state_model``, ``step_model``, ``round_model`` sharing weights and
    decode state. No context-encoding graph: prompts are teacher-forced through step/round
    (``harness.nxdi.host`` docstring). ``model_path`` is a converted directory (``harness.nxdi.convert``)."""

    _model_cls = Qwen36NeuronModel

    @classmethod
    def get_config_cls(cls):
        return Qwen36InferenceConfig

    def _add(self, mode: str):
        wrapper = _GraphWrapper(self.config, self._model_cls, mode, self.get_compiler_args())
        self.models.append(wrapper)
        self.graphs = {**getattr(self, "graphs", {}), mode: wrapper}

    def enable_context_encoding(self):
        self._add("reset")
        self._add("step")

    def enable_token_generation(self, *args, **kwargs):
        self._add("round")

    def get_compiler_args(self):
        return nxcfg.compiler_args(self.neuron_config.logical_nc_config)

    @classmethod
    def get_state_dict(cls, model_name_or_path, config) -> dict:
        return nxconv.load_converted(model_name_or_path)

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict: dict, config) -> dict:
        """Canonical parameters (``model.weights.load_checkpoint`` names) -> the NxDI state dict."""
        nc = config.neuron_config
        return asm.neuron_state_dict(config.model_config(), state_dict, config.nxdi_backend, nc.tp_degree,
                                     nc.logical_nc_config)

    def launch(self, mode: str, runtime: dict) -> asm.LaunchResult:
        outs = self.graphs[mode](*asm.ordered_inputs(mode, runtime))
        return asm.read_outputs(*outs[:3])

    def reset_state(self) -> None:
        self.graphs["reset"](torch.zeros((1, 1), dtype=torch.int32))


class NeuronEngine:
    """``harness.nxdi.host.Engine`` over a compiled and loaded application."""

    def __init__(self, app: Qwen36ForCausalLM):
        self.app = app
        self.cfg = app.config.model_config()
        self.dtype = app.neuron_config.torch_dtype
        self.max_len = int(app.config.nxdi_max_len)
        self.launches = 0

    @staticmethod
    def compile(converted: str | Path, compiled: str | Path) -> None:
        app = Qwen36ForCausalLM(str(converted), config=Qwen36InferenceConfig.from_converted(converted))
        app.compile(str(compiled))

    @classmethod
    def load(cls, converted: str | Path, compiled: str | Path) -> "NeuronEngine":
        app = Qwen36ForCausalLM(str(converted), config=Qwen36InferenceConfig.load(str(compiled)))
        app.load(str(compiled))
        return cls(app)

    def reset(self) -> None:
        self.app.reset_state()

    def run(self, mode: str, runtime: dict) -> asm.LaunchResult:
        self.launches += 1
        return self.app.launch(mode, runtime)
