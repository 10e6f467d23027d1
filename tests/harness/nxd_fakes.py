"""Small fakes of the NxD / NxDI names ``harness/nxdi/modeling.py`` uses, reproducing the behaviours of the real
code that decide whether our application works (not only the attributes our subclasses touch).

Mirrored sources (the last public ones; line numbers of these snapshots):
  NxDI = aws-neuron/neuronx-distributed-inference 0.9.0, ``src/neuronx_distributed_inference/``
  NxD  = aws-neuron/neuronx-distributed 0.18.0, ``src/neuronx_distributed/``

Behaviours reproduced (each class/function below cites the code it mirrors):
* NxDI ``NeuronBaseForCausalLM.__init__`` asserts every graph's ``is_prefill_stage is not None``.
* NxD sharding touches only parameters of its parallel layer types (``__SUPPORTED_SHARDED_MODULES``).
* The traced executor takes the LAST registered graph's input count; ``NxDModel.forward(list)`` routes
  by input SHAPES only (a later graph with the same shapes takes the route over).
* The FIRST registered graph's outputs give the packer applied to every graph's outputs, and its
  aliased parameters are the only decode state created on the device (zeros).
* A traced graph's non-aliased parameters are weights: ``initialize`` needs each in every rank's
  checkpoint with the traced shape and dtype; aliased outputs update the state buffers in place.
* ``load()`` runs every graph once on its example inputs (warmup), unless skipped.
* ``NEURON_LOGICAL_NC_CONFIG`` wins over the ``logical_nc_config`` keyword.

Execution model of a fake "NEFF": the traced module runs eagerly on CPU on every rank at once, one thread
per rank, NxD's mappings collectives between the threads (``harness.xla.ThreadWorld``), and an NKI
kernel called by the ranks is ONE multi-rank nkisim launch (on the device the custom call runs on every
rank of the SPMD program together). Not reproduced: XLA itself (lazy tracing, dead-code elimination,
in-place aliasing on the device), compile flags, layout optimisation, async and ranked execution.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import os
import sys
import tempfile
import threading
import types
import warnings
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from harness.xla import ThreadWorld

logger = logging.getLogger("Neuron")


# ==================================================================================================
# NxD parallel_layers
# ==================================================================================================
class _ParallelState:
    """NxD ``parallel_layers/parallel_state.py``: the TP group is set up inside ModelBuilder's trace and
    shard steps (``trace/model_builder.py`` lines 551-559 and 828-835), and queried by layers."""

    tp: int | None = None

    @classmethod
    @contextlib.contextmanager
    def initialized(cls, tp: int):
        cls.tp = tp
        try:
            yield
        finally:
            cls.tp = None


def get_tensor_model_parallel_size() -> int:
    if _ParallelState.tp is None:
        raise AssertionError("tensor model parallel group is not initialized")
    return _ParallelState.tp


_MODEL_PARALLEL_ATTRIBUTES = ("tensor_model_parallel", "partition_dim", "partition_stride", "num_partitions",
                              "rank_ordering")


def set_tensor_model_parallel_attributes(tensor, is_parallel: bool, dim: int, stride: int, num_partitions: int = -1,
                                         rank_ordering=None) -> None:
    """NxD ``parallel_layers/utils.py`` lines 55-74 (without rank_ordering validation)."""
    for attribute in _MODEL_PARALLEL_ATTRIBUTES:
        assert not hasattr(tensor, attribute)
    if num_partitions == -1:
        warnings.warn('NeuronxDistributed: Please pass "num_partitions" argument to '
                      'set_tensor_model_parallel_attributes() method.')
        num_partitions = get_tensor_model_parallel_size()
    tensor.tensor_model_parallel, tensor.partition_dim, tensor.partition_stride = is_parallel, dim, stride
    tensor.num_partitions, tensor.rank_ordering = num_partitions, rank_ordering


class BaseParallelLinear(nn.Module):
    """Stand-in for NxD's parallel linear layer types (``parallel_layers/layers.py``): a supported sharded module."""

    def __init__(self, out_features: int, in_features: int, tp: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features // tp, in_features), requires_grad=False)
        set_tensor_model_parallel_attributes(self.weight, is_parallel=True, dim=0, stride=1, num_partitions=tp)


class SPMDRank(nn.Module):
    """NxD ``parallel_layers/layers.py`` lines 1543-1566: a rank parameter sharded along dim 0 over world_size."""

    def __init__(self, world_size: int, tensor_model_parallel_size: int | None = None):
        super().__init__()
        self.world_size = world_size
        self.tensor_model_parallel_size = (tensor_model_parallel_size if tensor_model_parallel_size is not None
                                           else get_tensor_model_parallel_size())
        self.rank = nn.Parameter(torch.zeros(1, dtype=torch.int32), requires_grad=False)
        set_tensor_model_parallel_attributes(self.rank, is_parallel=True, dim=0, stride=1, num_partitions=world_size)


_rank_context = threading.local()  # (rank, collectives) of the executing SPMD rank thread


def _collectives():
    ctx = getattr(_rank_context, "value", None)
    if ctx is None:
        raise RuntimeError("NxD collective called outside an SPMD execution (no rank context)")
    return ctx[1]


def reduce_from_tensor_model_parallel_region(input_, process_group=None):
    """NxD ``parallel_layers/mappings.py`` line 410: all-reduce (sum) over the TP ranks."""
    return _collectives().all_reduce(input_)


def gather_from_tensor_model_parallel_region(input_, process_group=None):
    """NxD ``parallel_layers/mappings.py`` line 426: all-gather along the last dim, in rank order."""
    return _collectives().gather_last(input_)


# ==================================================================================================
# NxD trace/trace.py: checkpoint sharding
# ==================================================================================================
SUPPORTED_SHARDED_MODULES = (BaseParallelLinear, SPMDRank)  # trace/trace.py lines 49-59 (their stand-ins here)


def preprocess_checkpoint(model: nn.Module, checkpoint: dict) -> None:
    """trace/trace.py lines 628-644: drop checkpoint keys that are not in the model's state dict."""
    keys = set(model.state_dict())
    for key in [k for k in checkpoint if k not in keys]:
        checkpoint.pop(key)


def shard_children(module: nn.Module, checkpoint: dict, prefix: str, rank: int, tp_degree: int) -> None:
    """trace/trace.py lines 737-825: recurse; shard only the leaf parameters of SUPPORTED module types."""
    for name, child in module._modules.items():
        if child is not None:
            shard_children(child, checkpoint, prefix + name + ".", rank, tp_degree)
    if not isinstance(module, SUPPORTED_SHARDED_MODULES):
        return
    for pname, param in module.named_parameters():
        if len(pname.split(".")) != 1:
            continue
        key = prefix + pname
        if key not in checkpoint:
            continue
        tensor = checkpoint[key]
        if getattr(param, "tensor_model_parallel", False):
            n = param.num_partitions
            size = tensor.shape[param.partition_dim] // n
            checkpoint[key] = tensor.narrow(param.partition_dim, (rank % n) * size, size)
        if checkpoint[key].shape != param.shape:
            raise RuntimeError(f"expected shape {param.shape} for {key} but found {checkpoint[key].shape}")


def get_sharded_checkpoint(checkpoint: dict, model: nn.Module, rank: int, tp_degree: int, is_cached: bool = False):
    """trace/trace.py lines 646-656."""
    if not is_cached:
        preprocess_checkpoint(model, checkpoint)
    shard_children(model, checkpoint, "", rank, tp_degree)


# ==================================================================================================
# NxD trace/spmd.py + trace/model_builder.py: traced graphs, routing, packer, state, executor
# ==================================================================================================
class _KernelLaunches:
    """Joins the NKI kernel calls the rank threads make into one multi-rank nkisim launch (the SPMD custom
    call). Installed over ``nkisim.jit.launch`` (what ``Kernel.__call__`` calls) during an execution."""

    def __init__(self, tp: int, timeout: float = 600.0):
        self.tp = tp
        self.calls: list = [None] * tp
        self.results, self.error = None, None
        self.barrier = threading.Barrier(tp, action=self._launch, timeout=timeout)

    def _launch(self):
        import nkisim
        fns = {id(c[0]) for c in self.calls}
        lncs = {c[1] for c in self.calls}
        self.results, self.error = None, None
        if len(fns) != 1 or len(lncs) != 1:
            self.error = RuntimeError("SPMD ranks launched different kernels or LNC degrees")
            return
        fn, lnc = self.calls[0][0], self.calls[0][1]
        try:
            self.results = nkisim.launch(fn, [c[2] for c in self.calls], tp=self.tp, lnc=lnc,
                                         per_rank_kwargs=[c[3] for c in self.calls])
        except BaseException as e:  # noqa: BLE001 - re-raised on every rank
            self.error = e

    def launch(self, fn, lnc, ndim, args, kwargs, name=None):
        ctx = getattr(_rank_context, "value", None)
        if ctx is None:
            raise RuntimeError("NKI kernel launched outside an SPMD execution")
        if ndim != 1:
            raise RuntimeError("the traced graph launches the kernel without the LNC grid (kernel[lnc](...))")
        self.calls[ctx[0]] = (fn, lnc, tuple(args), dict(kwargs))
        self.barrier.wait()
        if self.error is not None:
            raise self.error
        return self.results[ctx[0]]

    @contextlib.contextmanager
    def installed(self):
        import importlib
        jit = importlib.import_module("nkisim.jit")  # the module (``nkisim.jit`` the attribute is the decorator)
        with mock.patch.object(jit, "launch", self.launch):
            yield


def _spmd_run(modules: list, inputs, aliases: dict, states: list) -> list:
    """Run ``modules[r](*inputs)`` on every rank at once; aliased outputs overwrite ``states[r][name]`` in place.
    Returns every rank's non-aliased outputs."""
    tp = len(modules)
    world, kernels = ThreadWorld(tp), _KernelLaunches(tp)
    alias_idx = set(aliases.values())

    def body(r, coll):
        _rank_context.value = (r, coll)
        try:
            outs = list(modules[r](*inputs))
        except BaseException:
            kernels.barrier.abort()
            raise
        finally:
            _rank_context.value = None
        for name, i in aliases.items():
            if i >= len(outs):
                raise RuntimeError(f"state {name} is aliased to output {i}, the graph returns {len(outs)}")
            new = outs[i]
            if tuple(new.shape) != tuple(states[r][name].shape) or new.dtype != states[r][name].dtype:
                raise RuntimeError(f"aliased output {i} is {list(new.shape)} {new.dtype}, its state {name} "
                                   f"{list(states[r][name].shape)} {states[r][name].dtype}")
            states[r][name].copy_(new)
        return [o for i, o in enumerate(outs) if i not in alias_idx]

    with kernels.installed():
        return world.run(body, [()] * tp)


def _bind(module: nn.Module, tensors: dict) -> nn.Module:
    """A copy of ``module`` whose parameters are exactly ``tensors`` (no copy of the tensors)."""
    m = copy.deepcopy(module)
    for name, p in m.named_parameters():
        p.data = tensors[name]
    return m


class TracedGraph:
    """One compiled graph ("NEFF" + metaneff) of the legacy ModelBuilder (``_generate_hlo``,
    trace/model_builder.py lines 860-931; torch-neuronx ``generate_hlo``): the module's aliased parameters
    are its states (INPUT_STATE), every other parameter a weight, the example inputs fix its input
    signature, the non-aliased outputs its user outputs."""

    def __init__(self, key: str, module: nn.Module, aliases: dict, example: tuple, tp: int):
        names = {id(p): n for n, p in module.named_parameters()}
        self.key, self.module, self.tp = key, module, tp
        self.aliases = {}
        for p, i in aliases.items():
            if id(p) not in names:
                raise RuntimeError(f"{key}: an aliased tensor is not a parameter of the traced module")
            self.aliases[names[id(p)]] = i
        params = dict(module.named_parameters())
        self.state_specs = {n: (tuple(params[n].shape), params[n].dtype) for n in self.aliases}
        self.weight_specs = {n: (tuple(p.shape), p.dtype) for n, p in params.items() if n not in self.aliases}
        self.input_specs = [(tuple(t.shape), t.dtype) for t in example]
        # "trace": run the graph once (the real trace runs the Python forward under XLA, without values)
        zeros = [{n: torch.zeros(s, dtype=d) for n, (s, d) in {**self.weight_specs, **self.state_specs}.items()}
                 for _ in range(tp)]
        outs = _spmd_run([_bind(module, z) for z in zeros], example, self.aliases, zeros)[0]
        self.output_specs = [(tuple(o.shape), o.dtype) for o in outs]
        self.ranks = None

    def initialize(self, states: list, weights: list) -> None:
        """Bind every rank's weights and the shared states (SPMDModel.initialize, spmd.py lines 171-193)."""
        ranks = []
        for r in range(self.tp):
            bound = {}
            for what, specs, source in (("weight", self.weight_specs, weights[r]), ("state", self.state_specs, states[r])):
                for n, (shape, dtype) in specs.items():
                    t = source.get(n)
                    if t is None:
                        raise RuntimeError(f"{self.key}: {what} {n!r} is not in rank {r}'s "
                                           f"{'checkpoint' if what == 'weight' else 'device state'}")
                    if tuple(t.shape) != shape or t.dtype != dtype:
                        raise RuntimeError(f"{self.key}: {what} {n!r} of rank {r} is {list(t.shape)} {t.dtype}, "
                                           f"the graph was traced with {list(shape)} {dtype}")
                    bound[n] = t
            ranks.append(bound)
        self.states = states
        self.ranks = [_bind(self.module, b) for b in ranks]

    def run(self, inputs: list) -> list:
        if self.ranks is None:
            raise ValueError("This model is not initialized, please call traced_model.nxd_model.initialize(...)")
        got = [(tuple(t.shape), t.dtype) for t in inputs]
        if got != self.input_specs:
            raise RuntimeError(f"{self.key}: inputs {got} do not match the traced inputs {self.input_specs}")
        return _spmd_run(self.ranks, inputs, self.aliases, self.states)[0]  # the first local rank's outputs


class StateInitializer:
    """trace/spmd.py lines 68-140: zero tensors of the given shapes and dtypes, one dict per local rank."""

    def __init__(self, shapes: dict, dtypes: dict, local_ranks_size: int):
        self.shapes, self.dtypes, self.local_ranks_size = shapes, dtypes, local_ranks_size

    def __call__(self) -> list:
        return [{k: torch.zeros(self.shapes[k], dtype=self.dtypes[k]) for k in self.shapes}
                for _ in range(self.local_ranks_size)]


class Packer:
    """The output packer traced from the FIRST graph's non-aliased outputs (model_builder.py lines 1034-1051,
    1086), applied to every graph's outputs (spmd.py line 239)."""

    def __init__(self, count: int):
        self.count = count

    def __call__(self, result: list) -> list:
        if len(result) != self.count:
            raise RuntimeError(f"the packer (built from the first graph) packs {self.count} outputs, got {len(result)}")
        return list(result)


class NxDModel:
    """trace/spmd.py lines 142-240: graphs sharing weights and state, routed by input shapes."""

    def __init__(self, models: dict, input_shape_map: dict, packer: Packer, state_initializer):
        self.models, self.input_shape_map, self.packer = models, input_shape_map, packer
        self.state_initializer = state_initializer
        self.weights, self.state = None, None

    def initialize(self, checkpoint: list, start_rank_tensor: torch.Tensor) -> None:
        self.weights = checkpoint
        self.state = self.state_initializer() if self.state_initializer is not None else [{} for _ in checkpoint]
        for graph in self.models.values():
            graph.initialize(self.state, self.weights)

    def router(self, inputs: list):
        actual_shape = str([list(t.shape) for t in inputs])
        if actual_shape not in self.input_shape_map:
            raise ValueError(f"Input shape {actual_shape} not found in input_shape_map: {self.input_shape_map.keys()}")
        return self.input_shape_map[actual_shape]

    def forward(self, inputs: list) -> list:
        key, _ = self.router(inputs)
        return self.packer(self.models[key].run(list(inputs)))


class NxDModelExecutor:
    """trace/spmd.py lines 281-291, ``torch.jit.trace``d with the LAST graph's first example inputs
    (model_builder.py line 1106): a traced function takes exactly that many inputs."""

    def __init__(self, nxd_model: NxDModel, traced_arity: int):
        self.nxd_model, self.traced_arity = nxd_model, traced_arity

    def __call__(self, *inputs):
        if len(inputs) != self.traced_arity:
            raise RuntimeError(f"forward() expected {self.traced_arity} argument(s) but received {len(inputs)} "
                               f"(the executor is traced with the last graph's example inputs)")
        return self.nxd_model.forward(list(inputs))


class BaseModelInstance:
    """trace/model_builder.py lines 381-391."""

    def __init__(self, module_cls, input_output_aliases):
        self.module_cls, self.module = module_cls, None
        self.input_output_aliases = [input_output_aliases]

    def load_module(self):
        self.module = self.module_cls()

    def get(self, bucket_rank, **kwargs):
        return self.module, self.input_output_aliases[0]


def append_default_compiler_flags(compiler_args: str | None = "") -> str:
    """trace/model_builder.py lines 104-124."""
    if not compiler_args:
        compiler_args = "--enable-saturate-infinity --auto-cast=none --model-type=transformer -O1"
    if "--auto-cast" not in compiler_args:
        compiler_args += " --auto-cast=none "
    if not any(f"-O{i}" in compiler_args for i in range(4)):
        compiler_args += " -O1 "
    if "--verbose" not in compiler_args:
        compiler_args += " --verbose=35"
    return compiler_args


class _Container:
    def __init__(self, model_instance, example_inputs, compiler_args, bucket_config, priority_model_idx):
        self.model_instance, self.example_inputs, self.compiler_args = model_instance, example_inputs, compiler_args
        self.bucket_config, self.priority_model_idx = bucket_config, priority_model_idx
        self.graph = None


class ModelBuilder:
    """The legacy ModelBuilder NxDI 0.9 uses (trace/model_builder.py lines 441-1109), one bucket per graph."""

    def __init__(self, router, tp_degree, checkpoint_loader, start_rank_id=0, pp_degree=1, ep_degree=1,
                 local_ranks_size=None, world_size=None, compiler_workdir=None, master_proc_env_vars=None, debug=False,
                 num_cores_per_group=1, init_custom_process_group_fn=None, logical_nc_config=1,
                 weights_to_skip_layout_optimization=(), compiler_flag_hook=None):
        self.tp_degree, self.checkpoint_loader, self.start_rank_id = tp_degree, checkpoint_loader, start_rank_id
        self.world_size = world_size or tp_degree * pp_degree * ep_degree
        self.local_ranks_size = local_ranks_size or self.world_size
        self.compiler_workdir = compiler_workdir or str(Path(tempfile.gettempdir()) / "nxd_model")
        self.logical_nc_config = logical_nc_config
        self.model_collection: dict[str, _Container] = {}

    def add(self, key, model_instance, example_inputs, compiler_args=None, bucket_config=None,
            priority_model_idx=None) -> "ModelBuilder":
        if len(example_inputs) != 1:
            raise NotImplementedError("the fake ModelBuilder traces one bucket per graph")
        self.model_collection[key] = _Container(model_instance, example_inputs,
                                                append_default_compiler_flags(compiler_args), bucket_config,
                                                priority_model_idx)
        return self

    def trace(self, initialize_model_weights=True, dry_run=False, disable_fail_fast=False) -> NxDModelExecutor:
        with _ParallelState.initialized(self.tp_degree):
            for key, c in self.model_collection.items():
                c.model_instance.load_module()
                module, aliases = c.model_instance.get(0)
                c.graph = TracedGraph(key, module, aliases, c.example_inputs[0], self.local_ranks_size)
        executor = self.build_nxd_model()
        if initialize_model_weights:
            raise NotImplementedError("the fake ModelBuilder does not initialize weights at trace")
        return executor

    def build_state_initializer(self):
        """model_builder.py lines 1002-1022: the states of the FIRST graph."""
        first = next(iter(self.model_collection.values())).graph
        if not first.state_specs:
            return None
        return StateInitializer({k: s for k, (s, _) in first.state_specs.items()},
                                {k: d for k, (_, d) in first.state_specs.items()}, self.local_ranks_size)

    def build_nxd_model(self) -> NxDModelExecutor:
        """model_builder.py lines 1053-1109."""
        input_shape_map, example_inputs = {}, None
        for key, c in self.model_collection.items():
            example_inputs = c.example_inputs
            for i, example in enumerate(example_inputs):
                input_shape_map[str([list(t.shape) for t in example])] = (key, i)
        first = next(iter(self.model_collection.values())).graph
        nxd_model = NxDModel({k: c.graph for k, c in self.model_collection.items()}, input_shape_map,
                             Packer(len(first.output_specs)), self.build_state_initializer())
        return NxDModelExecutor(nxd_model, len(example_inputs[0]))

    def shard_checkpoint(self, serialize_path=None) -> list:
        """model_builder.py lines 817-858: shard the checkpoint with the FIRST graph's module."""
        if serialize_path is not None:
            os.makedirs(serialize_path, exist_ok=True)
        container = next(iter(self.model_collection.values()))
        out = []
        with _ParallelState.initialized(self.tp_degree):
            container.model_instance.load_module()
            model, _ = container.model_instance.get(0)
            checkpoint = self.checkpoint_loader()
            preprocess_checkpoint(model, checkpoint)
            for rank in range(self.start_rank_id, self.start_rank_id + self.local_ranks_size):
                sharded = dict(checkpoint)
                get_sharded_checkpoint(sharded, model, rank, self.tp_degree, is_cached=True)
                if serialize_path is not None:
                    save_file({k: v.contiguous() for k, v in sharded.items()},
                              os.path.join(serialize_path, f"tp{rank}_sharded_checkpoint.safetensors"))
                out.append(sharded)
        return out


# ==================================================================================================
# NxDI models/config.py
# ==================================================================================================
CONFIG_FILE = "neuron_config.json"  # models/config.py line 23

# Keywords NeuronConfig.__init__ pops, with their defaults (models/config.py line numbers); a subset.
_NEURON_CONFIG_KEYS = {
    "batch_size": 1,                      # 94
    "padding_side": "right",              # 95
    "on_cpu": False,                      # 102
    "output_logits": False,               # 103
    "cast_type": "config",                # 118
    "vocab_parallel": False,              # 142
    "sequence_parallel_enabled": False,   # 153
    "is_continuous_batching": False,      # 164
    "on_device_sampling_config": None,    # 173
    "async_mode": False,                  # 183
    "enable_bucketing": False,            # 186
    "quantized": False,                   # 216
    "speculation_length": 0,              # 243
    "enable_fused_speculation": False,    # 245
    "enable_eagle_speculation": False,    # 246
    "is_medusa": False,                   # 268
    "medusa_speculation_length": 0,       # 269
    "lora_config": None,                  # 356
    "tp_degree": 1,                       # 361
    "pp_degree": 1,                       # 365
    "ep_degree": 1,                       # 366
    "save_sharded_checkpoint": False,     # 367
    "skip_sharding": False,               # 368
    "start_rank_id": 0,                   # 386
    "cc_pipeline_tiling_factor": 2,       # 581
    "weights_to_skip_layout_optimization": [],  # 596
    "skip_warmup": False,                 # 610
}


class NeuronConfig:
    """models/config.py lines 84-782 (the keywords above, the seq_len family, dtype, buckets and LNC)."""

    def __init__(self, **kwargs):
        self.seq_len = kwargs.pop("seq_len", 128)                                    # 98
        self.n_active_tokens = kwargs.pop("n_active_tokens", self.seq_len)           # 99
        self.n_positions = kwargs.pop("n_positions", self.seq_len)                   # 101
        self.is_prefill_stage = None  # 104: set only in enable_<>() in NeuronBaseForCausalLM
        dtype = kwargs.pop("torch_dtype", torch.bfloat16)                            # 107-116
        self.torch_dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        self.max_context_length = kwargs.pop("max_context_length", self.seq_len)     # 134
        self.max_length = kwargs.pop("max_length", self.seq_len)                     # 138
        assert self.max_context_length <= self.max_length, "max_context_length cannot be more than max_length"
        for k, default in _NEURON_CONFIG_KEYS.items():
            setattr(self, k, kwargs.pop(k, copy.copy(default)))
        if self.cast_type not in ("config", "as-declared"):                          # 119-120
            raise ValueError("cast_type must be one of config, as-declared")
        self.ctx_batch_size = kwargs.pop("ctx_batch_size", self.batch_size)          # 161
        self.tkg_batch_size = kwargs.pop("tkg_batch_size", self.batch_size)          # 162
        self.max_batch_size = kwargs.pop("max_batch_size", self.batch_size)          # 163
        self.buckets = kwargs.pop("buckets", [self.seq_len])                         # 187
        self.is_chunked_prefill = kwargs.pop("chunked_prefill_config", None) is not None  # 306
        self.world_size = kwargs.pop("world_size", None) or self.tp_degree * self.pp_degree * self.ep_degree  # 382
        self.local_ranks_size = kwargs.pop("local_ranks_size", None) or self.world_size  # 387-390
        self.logical_nc_config = self._get_lnc(kwargs)                              # 570
        if kwargs:                                                                   # 639-640
            logging.warning(f"NeuronConfig init: Unexpected keyword arguments: {kwargs}")

    @staticmethod
    def _get_lnc(kwargs) -> int:
        """models/config.py lines 729-759: NEURON_LOGICAL_NC_CONFIG > logical_nc_config > platform (2 on trn2)."""
        env_lnc = int(os.environ.get("NEURON_LOGICAL_NC_CONFIG", -1))
        kwargs_lnc = int(kwargs.pop("logical_nc_config")) if "logical_nc_config" in kwargs else -1
        if env_lnc != -1 and kwargs_lnc != -1 and env_lnc != kwargs_lnc:
            warnings.warn(f"NEURON_LOGICAL_NC_CONFIG={env_lnc} does not match provided logical_nc_config="
                          f"{kwargs_lnc}. Using NEURON_LOGICAL_NC_CONFIG to set LNC.", category=UserWarning)
        if env_lnc != -1:
            return env_lnc
        return kwargs_lnc if kwargs_lnc != -1 else 2

    def __getattribute__(self, name):
        if name == "trace_tokengen_model":                                           # 771-781
            warnings.warn("'trace_tokengen_model' is deprecated and will be removed in a future release.",
                          category=DeprecationWarning)
            return True
        return super().__getattribute__(name)


def to_dict(obj):
    """models/config.py lines 62-77."""
    if type(obj) is dict:
        return {k: to_dict(v) for k, v in obj.items()}
    if type(obj) is list:
        return [to_dict(v) for v in obj]
    if inspect.isclass(obj):
        return {"__module__": obj.__module__, "__name__": obj.__name__}
    if hasattr(obj, "__dict__"):
        return {k: to_dict(v) for k, v in obj.__dict__.items()}
    if type(obj) is torch.dtype:
        return str(obj).split(".")[1]
    return obj


class InferenceConfig:
    """models/config.py lines 849-1042 (no attribute map, no fused speculation)."""

    def __init__(self, neuron_config, fused_spec_config=None, load_config=None, metadata=None, **kwargs):
        self.neuron_config = neuron_config
        self.fused_spec_config = fused_spec_config
        if load_config is not None:
            load_config(self)
        else:
            self.load_config()
        self.metadata = metadata
        for key, value in kwargs.items():
            setattr(self, key, value)
        self.add_derived_config()
        self.validate_config()

    def add_derived_config(self):
        self.num_cores_per_group = 1

    def load_config(self):
        pass

    def get_required_attributes(self) -> list:
        return []

    def validate_config(self):
        missing = [x for x in self.get_required_attributes() if not hasattr(self, x)]
        assert len(missing) == 0, f"Config must define {missing}"

    def get_text_config(self):
        return getattr(self, "text_config", None) or self

    def save(self, model_path):
        os.makedirs(model_path, exist_ok=True)
        with open(os.path.join(model_path, CONFIG_FILE), "w", encoding="utf-8") as f:
            f.write(json.dumps(to_dict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, model_path, **kwargs):
        with open(os.path.join(model_path, CONFIG_FILE), encoding="utf-8") as f:
            merged = json.loads(f.read())
        merged.update(kwargs)
        if isinstance(merged.get("neuron_config"), dict):
            merged["neuron_config"] = cls.get_neuron_config_cls()(**merged["neuron_config"])
        return cls(**merged)

    @classmethod
    def get_neuron_config_cls(cls):
        return NeuronConfig


# ==================================================================================================
# NxDI models/model_wrapper.py
# ==================================================================================================
CONTEXT_ENCODING_MODEL_TAG = "context_encoding_model"
TOKEN_GENERATION_MODEL_TAG = "token_generation_model"


class ModelWrapper(nn.Module):
    """models/model_wrapper.py lines 50-174 (compiler arguments, tag, model) and 705-718 (``_forward``)."""

    def __init__(self, config, model_cls, tag="", compiler_args=None, priority_model_idx=None,
                 pipeline_execution=False, return_ranked_to_cpu=False, model_init_kwargs={}):
        super().__init__()
        self.config, self.neuron_config = config, config.neuron_config
        if getattr(config, "pad_token_id", None) is None:
            config.pad_token_id = 0
        self.model_cls, self.model, self.tag = model_cls, None, tag
        if compiler_args is None:  # lines 86-128, without the optional features
            nc = self.neuron_config
            if tag == TOKEN_GENERATION_MODEL_TAG:
                nc.cc_pipeline_tiling_factor = 1
            tensorizer = (f"--enable-ccop-compute-overlap --cc-pipeline-tiling-factor={nc.cc_pipeline_tiling_factor} "
                          "--vectorize-strided-dma ")
            self.compiler_args = (f"--auto-cast=none --model-type=transformer --tensorizer-options='{tensorizer}'"
                                  f" --lnc={nc.logical_nc_config}")
            self.compiler_args += " -O1 " if tag == CONTEXT_ENCODING_MODEL_TAG else " -O2 "
        else:
            self.compiler_args = compiler_args
        self.compiler_args += " --internal-hlo2tensorizer-options='--verify-hlo=true' "  # line 162
        self.bucket_config, self.priority_model_idx = None, priority_model_idx
        self.model_init_kwargs = model_init_kwargs
        self.async_mode = self.neuron_config.async_mode

    def _forward(self, *args):
        return self.model(*args)


# ==================================================================================================
# NxDI models/application_base.py and models/model_base.py
# ==================================================================================================
COMPILED_MODEL_FILE_NAME = "model.pt"
_TRACED: dict[str, NxDModelExecutor] = {}  # stands for torch.jit.save / torch.jit.load of the executor


class NeuronApplicationBase(nn.Module):
    """models/application_base.py lines 68-822 (compile, load, warmup, weights; no LoRA, quantisation,
    snapshots or CPU mode)."""

    def __init__(self, model_path: str, config=None, neuron_config=None):
        super().__init__()
        model_path = os.path.join(os.path.normpath(model_path), "")
        if config is None:
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.config, self.neuron_config = config, config.neuron_config
        self.fused_spec_config = config.fused_spec_config
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.model_path = model_path
        self.models: list = []
        self.traced_model = None
        self.is_compiled = os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)
        self.is_loaded_to_neuron = False
        self._builder = None

    def get_builder(self, debug=False):  # lines 148-183
        if self._builder is None:
            self._builder = ModelBuilder(
                router=None, tp_degree=self.neuron_config.tp_degree, pp_degree=self.neuron_config.pp_degree,
                ep_degree=self.neuron_config.ep_degree, world_size=self.neuron_config.world_size,
                start_rank_id=self.neuron_config.start_rank_id, local_ranks_size=self.neuron_config.local_ranks_size,
                checkpoint_loader=self.checkpoint_loader_fn,
                compiler_workdir=os.environ.get("BASE_COMPILE_WORK_DIR"),
                logical_nc_config=self.neuron_config.logical_nc_config,
                weights_to_skip_layout_optimization=self.config.neuron_config.weights_to_skip_layout_optimization)
            for model in self.models:
                self._builder.add(key=model.tag, model_instance=model.get_model_instance(),
                                  example_inputs=model.input_generator(), compiler_args=model.compiler_args,
                                  bucket_config=model.bucket_config, priority_model_idx=model.priority_model_idx)
        return self._builder

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls is not implemented")

    def get_compiler_args(self):
        return None

    def shard_weights(self, compiled_model_path, debug=False, pre_shard_weights_hook=None):  # lines 240-265
        path = os.path.join(os.path.normpath(compiled_model_path), "weights", "")
        if pre_shard_weights_hook:
            pre_shard_weights_hook(self)
        if self.neuron_config.skip_sharding or not self.neuron_config.save_sharded_checkpoint:
            return
        self.get_builder(debug).shard_checkpoint(serialize_path=path)

    def _save_configs_to_compiler_workdir(self):  # lines 267-290
        workdir = self.get_builder().compiler_workdir
        self.config.save(workdir)
        for submodel in self.models:
            for bucket_rank, bucket_size in enumerate(submodel.config.neuron_config.buckets):
                specific = copy.deepcopy(submodel.config)
                specific.neuron_config.buckets = [bucket_size]
                specific.save(os.path.join(workdir, submodel.tag, f"_tp0_bk{bucket_rank}"))

    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None, dry_run=False,
                disable_fail_fast=False):  # lines 292-316
        compiled_model_path = os.path.join(os.path.normpath(compiled_model_path), "")
        self.config.save(compiled_model_path)
        traced_model = self.get_builder(debug).trace(initialize_model_weights=False, dry_run=dry_run)
        self._save_configs_to_compiler_workdir()
        if dry_run:
            return
        Path(compiled_model_path, COMPILED_MODEL_FILE_NAME).write_text("fake traced model\n")
        _TRACED[os.path.realpath(compiled_model_path + COMPILED_MODEL_FILE_NAME)] = traced_model
        self.shard_weights(compiled_model_path, debug, pre_shard_weights_hook)
        self.is_compiled = True

    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None, skip_warmup=False):  # 318-347
        compiled_model_path = os.path.join(os.path.normpath(compiled_model_path), "")
        key = os.path.realpath(compiled_model_path + COMPILED_MODEL_FILE_NAME)
        if not os.path.isfile(key) or key not in _TRACED:
            raise RuntimeError(f"open file failed: {compiled_model_path + COMPILED_MODEL_FILE_NAME}")
        self.traced_model = _TRACED[key]
        self.load_weights(compiled_model_path, start_rank_id=start_rank_id, local_ranks_size=local_ranks_size)
        for model_wrapper in self.models:
            model_wrapper.model = self.traced_model
        self.is_loaded_to_neuron = True
        if not self.neuron_config.skip_warmup and not skip_warmup:
            self.warmup()

    def warmup(self):  # lines 349-373
        for model in self.models:
            for example in model.input_generator():
                try:
                    model.model.nxd_model.forward(example)
                except RuntimeError as e:
                    logger.warning(f"Received a {type(e).__name__} during warmup of a model tagged as {model.tag}. "
                                   f"This is safe to ignore.")

    def load_weights(self, compiled_model_path, start_rank_id=None, local_ranks_size=None):  # lines 375-421
        if self.traced_model is None:
            raise ValueError("Model is not loaded")
        start = self.neuron_config.start_rank_id if start_rank_id is None else start_rank_id
        size = self.neuron_config.local_ranks_size if local_ranks_size is None else local_ranks_size
        if self.neuron_config.save_sharded_checkpoint:
            weights = [load_file(os.path.join(compiled_model_path, f"weights/tp{r}_sharded_checkpoint.safetensors"))
                       for r in range(start, start + size)]
        else:
            weights = self.get_builder().shard_checkpoint()
        self.traced_model.nxd_model.initialize(weights, torch.tensor([start], dtype=torch.int32))

    def checkpoint_loader_fn(self, mmap: bool = False):  # lines 630-683 (no casting, no fused speculation)
        model_path = getattr(self.config, "_name_or_path", None)
        if model_path is None or not os.path.exists(model_path):
            model_path = self.model_path
        return self.get_state_dict(model_path, self.config)

    @classmethod
    def get_state_dict(cls, model_name_or_path, config) -> dict:  # lines 692-739 (safetensors directory only)
        sd = {}
        for f in sorted(Path(model_name_or_path).glob("*.safetensors")):
            sd.update(load_file(str(f)))
        return cls.convert_hf_to_neuron_state_dict(sd, config)

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        return state_dict


class NeuronBaseModel(nn.Module):
    """models/model_base.py lines 70-141 (``optimize_inference`` would build NxDI's KV cache manager:
    not reproduced, refused)."""

    def __init__(self, config, optimize_inference=True):
        super().__init__()
        self.config, self.sampler, self.kv_mgr = config, None, None
        self.neuron_config = config.neuron_config
        self.batch_size = config.neuron_config.batch_size
        self.n_positions = config.neuron_config.n_positions
        self.n_active_tokens = config.neuron_config.n_active_tokens
        self.vocab_size = config.vocab_size
        self.speculation_length = config.neuron_config.speculation_length
        self.padding_side = config.neuron_config.padding_side
        self.max_length = config.neuron_config.max_length
        self.rank_util = SPMDRank(world_size=self.config.neuron_config.tp_degree)   # line 94
        self.num_cores_per_group = config.num_cores_per_group
        self.setup_attr_for_model(config)
        self.init_model(config)
        if optimize_inference:
            raise NotImplementedError("fake NeuronBaseModel: NxDI's KV cache manager is not reproduced")

    def setup_attr_for_model(self, config):
        raise NotImplementedError("setup_attr_for_model() is not implemented")

    def init_model(self, config):
        raise NotImplementedError("init_model() is not implemented")


class NeuronBaseForCausalLM(NeuronApplicationBase):
    """models/model_base.py lines 3024-3073 (no fused speculation, medusa, async or chunked prefill)."""

    _model_cls = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.text_config = self.config.get_text_config()
        self.vocab_size = self.text_config.vocab_size
        self.padding_side = self.neuron_config.padding_side
        if self.neuron_config.is_chunked_prefill:
            raise NotImplementedError("Chunked Prefill is not available in NxDI for now")
        if self.neuron_config.enable_fused_speculation or self.neuron_config.speculation_length > 0 or \
                self.neuron_config.medusa_speculation_length > 0:
            raise NotImplementedError("fake NeuronBaseForCausalLM: speculation graphs are not reproduced")
        self.enable_context_encoding()
        self.enable_token_generation()
        for model in self.models:
            assert model.neuron_config.is_prefill_stage is not None, \
                f"{model.tag} doesn't indicate whether it is part of the prefill or generation step."

    def enable_context_encoding(self, **model_init_kwargs):
        raise NotImplementedError("fake NeuronBaseForCausalLM: NxDI's own graphs are not reproduced")

    def enable_token_generation(self, enable_wlt_optimization: bool = True, **model_init_kwargs):
        raise NotImplementedError("fake NeuronBaseForCausalLM: NxDI's own graphs are not reproduced")


# ==================================================================================================
# Installation
# ==================================================================================================
_MODULES = {
    "neuronx_distributed": {},
    "neuronx_distributed.parallel_layers": {},
    "neuronx_distributed.parallel_layers.utils": {
        "set_tensor_model_parallel_attributes": set_tensor_model_parallel_attributes},
    "neuronx_distributed.parallel_layers.layers": {"SPMDRank": SPMDRank, "BaseParallelLinear": BaseParallelLinear},
    "neuronx_distributed.parallel_layers.mappings": {
        "reduce_from_tensor_model_parallel_region": reduce_from_tensor_model_parallel_region,
        "gather_from_tensor_model_parallel_region": gather_from_tensor_model_parallel_region},
    "neuronx_distributed.trace": {},
    "neuronx_distributed.trace.trace": {"get_sharded_checkpoint": get_sharded_checkpoint,
                                        "shard_children": shard_children,
                                        "preprocess_checkpoint": preprocess_checkpoint},
    "neuronx_distributed.trace.spmd": {"NxDModel": NxDModel, "NxDModelExecutor": NxDModelExecutor,
                                       "StateInitializer": StateInitializer},
    "neuronx_distributed.trace.model_builder": {"BaseModelInstance": BaseModelInstance, "ModelBuilder": ModelBuilder},
    "neuronx_distributed_inference": {},
    "neuronx_distributed_inference.models": {},
    "neuronx_distributed_inference.models.config": {"InferenceConfig": InferenceConfig, "NeuronConfig": NeuronConfig},
    "neuronx_distributed_inference.models.model_wrapper": {"ModelWrapper": ModelWrapper},
    "neuronx_distributed_inference.models.application_base": {"NeuronApplicationBase": NeuronApplicationBase},
    "neuronx_distributed_inference.models.model_base": {"NeuronBaseModel": NeuronBaseModel,
                                                        "NeuronBaseForCausalLM": NeuronBaseForCausalLM},
}


def install(monkeypatch) -> types.ModuleType:
    """Put the fakes in ``sys.modules`` under the real module names (undone by ``monkeypatch``) and import
    ``harness.nxdi.modeling`` against them. Returns the modeling module."""
    for name, attrs in _MODULES.items():
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)
    monkeypatch.delitem(sys.modules, "harness.nxdi.modeling", raising=False)
    import harness.nxdi
    monkeypatch.delattr(harness.nxdi, "modeling", raising=False)
    import importlib
    return importlib.import_module("harness.nxdi.modeling")


def uninstall() -> None:
    """Forget the modeling module imported against the fakes (``from harness.nxdi import modeling`` must not
    find it afterwards)."""
    sys.modules.pop("harness.nxdi.modeling", None)
    import harness.nxdi
    harness.nxdi.__dict__.pop("modeling", None)
