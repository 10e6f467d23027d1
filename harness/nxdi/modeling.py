"""trn2 ONLY -- NEVER EXECUTED ON TRAINIUM IN THIS REPOSITORY (no machine we develop on has the chip or the SDK).

The NxD Inference application of the speculative round: configuration, the traced module, its graphs
and the engine the host loop drives. Every piece of logic lives in the plain, CPU-tested modules
(``assembly``, ``config``, ``convert``; ``harness.xla`` for the xla backend, ``megakernel.round`` for the
shipped kernels); this file only hands their results to NxDI. Importing it without neuronx-distributed-inference raises ImportError saying so. On CPU it is
exercised end to end against fakes that reproduce NxD/NxDI's behaviour (tests/harness/nxd_fakes.py).

Written against the source of aws-neuron/neuronx-distributed-inference 0.9.0 and
aws-neuron/neuronx-distributed 0.18.0 (Neuron 2.29, the last public source; Neuron 2.30/2.31 ship
NxDI 0.10.x, whose source is not published). Line numbers below are of those versions.

What NxD/NxDI do that shapes this file:

* ``NeuronBaseForCausalLM.__init__`` calls ``enable_context_encoding()`` then ``enable_token_generation()``
  and asserts every registered graph's ``neuron_config.is_prefill_stage is not None``
  (``models/model_base.py`` lines 3027-3073); NxDI's own ``enable_*`` give each graph a deep copy of the
  config with that flag and its buckets (lines 3107-3153). :meth:`Qwen36ForCausalLM._add` does the same.
* ``NeuronApplicationBase.get_builder`` registers ``self.models`` in order with NxD's legacy ModelBuilder
  (``models/application_base.py`` lines 148-183). The FIRST graph gives the output packer applied to every
  graph's outputs and the state initializer that creates the decode state on the device
  (neuronx-distributed ``trace/model_builder.py`` lines 1002-1022, 1034-1051, 1086): the round graph, which
  aliases every state buffer, is registered first and every graph returns the same three leading outputs.
* The traced executor ``traced_model(*inputs)`` is ``torch.jit.trace``d with the LAST graph's example inputs
  (``model_builder.py`` line 1106; ``trace/spmd.py`` lines 281-291), so it only takes that graph's input
  count. ``NxDModel.forward(list)`` routes by input shapes (``spmd.py`` lines 215-240) and is what NxDI's
  own warmup calls (``application_base.py`` line 363): :meth:`_GraphWrapper.forward` calls it.
* A parameter the traced graph takes but does not alias is a weight, loaded from the checkpoint; so each
  graph registers exactly the state buffers it overwrites and aliases them (``assembly.graph_states``).
* ``load()`` runs every graph once on its example inputs (``warmup``, ``application_base.py`` lines
  340-373), which writes into the decode state: :class:`NeuronEngine` resets after loading, and the host
  loop resets before every prefill.
* ``NEURON_LOGICAL_NC_CONFIG`` wins over ``logical_nc_config`` (``models/config.py`` lines 729-759); the
  kernels' layout is fixed at conversion, so the application refuses another LNC (``config.check_lnc``).

NKI from PyTorch: an ``@nki.jit`` kernel called as ``kernel[lnc](**tensors)`` on the traced graph's tensors
becomes one custom call in the XLA graph (aws-neuron-sdk ``nki/guides/framework_custom_op.rst``; the LNC
given in brackets must match ``NEURON_LOGICAL_NC_CONFIG``, ``nki/api/nki/__init__.py`` ``jit`` docstring;
NxDI calls its kernels the same way, ``qkv_kernel[self.logical_nc_config](...)`` in
``modules/attention/gqa.py``).
"""

from __future__ import annotations

import copy
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

from harness import xla
from harness.engines import LaunchResult, read_outputs
from harness.nxdi import assembly as asm
from harness.nxdi import config as nxcfg
from harness.nxdi import context as nxctx
from harness.nxdi import convert as nxconv
from model.config import ModelConfig

TAGS = {"round": "round_model", "step": "step_model", "reset": "reset_state_model"}


def tag_of(mode: str) -> str:
    """A graph's NxDI tag: ``TAGS``, or ``context_encoding_model_<C>`` for the context graph of bucket C (one
    wrapper per bucket: each is its own graph with its own config, ``buckets=[C]``)."""
    bucket = nxctx.bucket_of(mode)
    return TAGS[mode] if bucket is None else f"context_encoding_model_{bucket}"


class Qwen36InferenceConfig(InferenceConfig):
    """The model's attributes (``harness.nxdi.config.model_attributes``) plus ``nxdi_backend``,
    ``nxdi_max_len``, ``nxdi_lnc``, ``nxdi_num_draft_tokens`` (K), ``nxdi_context_buckets`` and
    ``nxdi_param_specs``."""

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
        return cls(NeuronConfig(**kwargs), load_config=nxcfg.attribute_loader(
            cfg, meta["backend"], meta["max_len"], meta["lnc"], meta["param_specs"], meta["num_draft_tokens"],
            meta["context_buckets"]))


class Qwen36NeuronModel(NeuronBaseModel):
    """One graph of the application (``mode``: round, step, reset or ``context_C``, the context graph of bucket C).
    Weights and the graph's decode-state buffers (K + 1 GDN checkpoint slots for rounds of K =
    ``nxdi_num_draft_tokens`` drafts) are parameters with per-rank shapes. Traced by NxD; never run eagerly on
    trn2."""

    def __init__(self, config: Qwen36InferenceConfig, mode: str = "round"):
        self.mode = mode
        super().__init__(config, optimize_inference=False)  # no KVCacheManager: the decode state is ours

    def setup_attr_for_model(self, config):  # the attributes NeuronBaseModel asks for (model_base.py 120-131)
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
        nxcfg.check_lnc(self.lnc, config.nxdi_lnc)
        tp = self.tp_degree
        self.act_dtype = config.neuron_config.torch_dtype
        self.weights = nn.ParameterDict()
        for name, (shape, dtype) in asm.specs_from_json(config.nxdi_param_specs).items():
            p = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
            # Documents the truth (global tensor = the ranks' tensors along dim 0); NxD's sharding never reads it
            # here, since ParameterDict is not one of its parallel layer types (trace/trace.py line 752).
            set_tensor_model_parallel_attributes(p, is_parallel=True, dim=0, stride=1, num_partitions=tp)
            self.weights[name] = p
        drafts = config.nxdi_num_draft_tokens
        specs = asm.state_specs(self.cfg, tp, config.nxdi_max_len, self.act_dtype, drafts)
        self.bucket = nxctx.bucket_of(self.mode)
        if self.bucket is not None:   # the prefill plan of one bucket-long chunk (harness.nxdi.context)
            self.plan = nxctx.context_plan(self.cfg, self.bucket, tp, self.lnc)
        else:
            self.plan = None if self.mode == "reset" else asm.launch_plan(self.cfg, tp, self.lnc, self.mode, drafts)
        # output order of the graph's states (a ParameterDict built from a dict iterates its keys SORTED)
        self.state_order = asm.graph_states(self.mode, specs)
        self.states = nn.ParameterDict({
            n: nn.Parameter(torch.zeros(specs[n][0], dtype=specs[n][1]), requires_grad=False)
            for n in self.state_order})
        # the shipped kernel itself (megakernel.round.round_kernel / step_kernel), its plan the first argument
        self.kernel = asm.kernel_of(self.mode) if self.backend == "megakernel" and self.mode in asm.MODES else None

    def aliases(self) -> dict:
        """{state parameter: output index}, as NxDI's DecoderModelInstance.get returns (model_wrapper.py
        lines 1578-1627); every state the graph takes is aliased (checked)."""
        names = self.state_order
        idx = asm.reset_aliases(names) if self.plan is None else asm.state_aliases(self.mode)
        taken = [n for n in asm.kernel_parameters(self.mode) if n in self.states] if self.kernel else list(self.states)
        asm.check_graph_states(self.mode, taken, idx, asm.graph_states(self.mode, names))
        return {self.states[n]: i for n, i in idx.items()}

    def forward(self, *inputs):
        rt = asm.named_inputs(self.mode, inputs)
        st = {n: self.states[n].data for n in self.state_order}
        if self.plan is None:
            return asm.reset_outputs(rt["keep"], st, self.hidden_size, self.act_dtype)
        w = {k: p.data for k, p in self.weights.items()}
        coll = xla.Collectives(all_reduce=reduce_from_tensor_model_parallel_region,
                               gather_last=gather_from_tensor_model_parallel_region)
        if self.bucket is not None:   # context encoding: the NKI prefill kernels (or their twins) on one chunk
            if self.backend == "megakernel":
                return nxctx.megakernel_context(self.plan, w, st, rt, coll, self.lnc)
            return nxctx.xla_context(self.cfg, self.plan, w, st, rt, coll)
        if self.kernel is not None:  # the token-generation hook: ONE kernel launch per rank
            return list(self.kernel[self.lnc](self.plan, **asm.kernel_kwargs(self.mode, w, st, rt)))
        draft, targets, hid, new = xla.forward(self.cfg, self.plan, w, st, rt, coll)
        return [draft, targets, hid, *(new[n] for n in self.state_order)]


class _GraphInstance(BaseModelInstance):
    """What NxD's ModelBuilder traces for one graph: the module and its state aliasing (the interface of
    ``BaseModelInstance``, ``trace/model_builder.py`` lines 381-391)."""

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
        super().__init__(config=config, model_cls=model_cls, tag=tag_of(mode), compiler_args=compiler_args)
        self.mode = mode

    def input_generator(self):
        ex = asm.runtime_example(self.config.model_config(), self.mode, self.neuron_config.torch_dtype,
                                 self.config.nxdi_num_draft_tokens)
        return [tuple(ex[n] for n in asm.graph_inputs(self.mode))]

    def get_model_instance(self):
        return _GraphInstance(self.model_cls, self.config, self.mode)

    def forward(self, *inputs):
        # NOT self._forward / self.model(*inputs): the traced executor takes only the last graph's input count.
        return self.model.nxd_model.forward(list(inputs))


def graph_config(config, mode: str):
    """A graph's own config, a deep copy as NxDI's ``enable_*`` make (``models/model_base.py`` lines 3107-3153):
    decode graphs ``is_prefill_stage=False``, one bucket of ``seq_len``, ``n_active_tokens`` = the tokens the
    graph's trunk runs (the round plan's verify: K + 1); the context graph of bucket C ``is_prefill_stage=True``,
    ``buckets=[C]``, ``n_active_tokens=C`` (its chunk)."""
    new = copy.deepcopy(config)
    nc = new.neuron_config
    bucket = nxctx.bucket_of(mode)
    if bucket is not None:
        nc.is_prefill_stage, nc.buckets, nc.n_active_tokens = True, [bucket], bucket
        return new
    nc.is_prefill_stage = False
    nc.buckets = [nc.seq_len]
    nc.n_active_tokens = 1 if mode != "round" else asm.launch_plan(
        config.model_config(), nc.tp_degree, config.nxdi_lnc, mode, config.nxdi_num_draft_tokens).tokens
    return new


class Qwen36ForCausalLM(NeuronBaseForCausalLM):
    """The application: graphs ``round_model``, ``step_model``, one ``context_encoding_model_<C>`` per context
    bucket C and ``reset_state_model``, sharing weights and decode state (``asm.graph_order``). A prompt is encoded
    by the context graphs, one launch per chunk (``harness.nxdi.context``); with no buckets, or ``--prefill
    teacher-forced``, it is teacher-forced through the decode graphs (``megakernel.plan.teacher_forced_launches``). ``model_path`` is a converted directory
    (``harness.nxdi.convert``)."""

    _model_cls = Qwen36NeuronModel

    @classmethod
    def get_config_cls(cls):
        return Qwen36InferenceConfig

    def _add(self, mode: str):
        context = nxctx.bucket_of(mode) is not None
        args = nxcfg.compiler_args(self.neuron_config.logical_nc_config, self.config.nxdi_backend, context)
        wrapper = _GraphWrapper(graph_config(self.config, mode), self._model_cls, mode, args)
        self.models.append(wrapper)
        self.graphs = {**getattr(self, "graphs", {}), mode: wrapper}

    def enable_context_encoding(self, **kwargs):
        """Nothing here: NxDI calls this before ``enable_token_generation`` (``models/model_base.py`` lines
        3062-3068), but the round graph must be registered first (module docstring), so the context graphs are
        registered there, after the step graph."""

    def enable_token_generation(self, *args, **kwargs):
        nxcfg.check_lnc(self.neuron_config.logical_nc_config, self.config.nxdi_lnc)
        cfg = self.config.model_config()
        drafts = self.config.nxdi_num_draft_tokens
        order = asm.graph_order(self.config.nxdi_context_buckets)
        asm.check_routes({m: tuple(asm.runtime_example(cfg, m, self.neuron_config.torch_dtype, drafts).values())
                          for m in order})
        for mode in order:  # the round graph first (module docstring)
            self._add(mode)

    def get_compiler_args(self):
        """The decode graphs' arguments (each graph gets its own in :meth:`_add`)."""
        return nxcfg.compiler_args(self.neuron_config.logical_nc_config, self.config.nxdi_backend)

    @classmethod
    def get_state_dict(cls, model_name_or_path, config) -> dict:
        raise RuntimeError("the converted checkpoint is pre-sharded per rank (harness.nxdi.convert); the whole "
                                  "model is never loaded into host memory")

    def checkpoint_loader_fn(self, mmap: bool = False):
        return self.get_state_dict(self.model_path, self.config)

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):
        """Instead of NxD's sharding (which would copy every full tensor to every rank): the converted per-rank
        files, linked into ``compiled/weights/`` where ``load_weights`` reads them."""
        nxconv.link_rank_files(self.model_path, compiled_model_path, self.neuron_config.tp_degree)

    def launch(self, mode: str, runtime: dict) -> LaunchResult:
        outs = self.graphs[mode](*asm.ordered_inputs(mode, runtime))
        return read_outputs(*outs[:len(asm.LEADING_OUTPUTS)])

    def reset_state(self) -> None:
        self.launch("reset", asm.reset_inputs())


class NeuronEngine:
    """A ``harness.engines.Engine`` over a compiled and loaded application (no host-side state). ``buckets``: the
    context graphs' chunk lengths (modes ``context_C`` of :meth:`run`): ``harness.nxdi.context.context_decoder``
    prefills through them, ``harness.speculative.Decoder`` teacher-forced through the decode graphs."""

    name = "nxdi"

    def __init__(self, app: Qwen36ForCausalLM):
        self.app = app
        self.cfg = app.config.model_config()
        self.dtype = app.neuron_config.torch_dtype
        self.max_len = int(app.config.nxdi_max_len)
        self.drafts = int(app.config.nxdi_num_draft_tokens)  # K: the host loop runs rounds of K drafts
        self.buckets = tuple(int(b) for b in app.config.nxdi_context_buckets)
        self.launches = 0

    @staticmethod
    def compile(converted: str | Path, compiled: str | Path) -> None:
        nxconv.check_converted(converted)
        app = Qwen36ForCausalLM(str(converted), config=Qwen36InferenceConfig.from_converted(converted))
        app.compile(str(compiled))

    @classmethod
    def load(cls, converted: str | Path, compiled: str | Path, warmup: bool = True) -> "NeuronEngine":
        meta = nxconv.check_converted(converted)
        nxconv.check_compiled(compiled, meta, converted)
        app = Qwen36ForCausalLM(str(converted), config=Qwen36InferenceConfig.load(str(compiled)))
        app.load(str(compiled), skip_warmup=not warmup)
        engine = cls(app)
        engine.reset()  # warmup ran every graph on example inputs and wrote into the state
        return engine

    def reset(self) -> None:
        self.app.reset_state()

    def start(self, max_len: int) -> None:
        if max_len > self.max_len:
            raise ValueError(f"nxdi: the sequence needs {max_len} positions, the compiled decode state holds "
                             f"{self.max_len} (compile with a larger --max-len)")
        self.reset()

    def run(self, mode: str, runtime: dict) -> LaunchResult:
        self.launches += 1
        return self.app.launch(mode, runtime)
