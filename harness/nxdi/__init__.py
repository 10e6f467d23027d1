"""NxD Inference (NxDI) adapter: the speculative round of Qwen3.6-35B-A3B as an NxDI application on one
trn2.3xlarge (TP=4, LNC=2), token generation either plain PyTorch traced by XLA (``backend="xla"``) or
one megakernel launch per rank per round (``backend="megakernel"``). See harness/nxdi/README.md.

Plain modules (importable and tested everywhere):
    assembly   kernel arguments, per-rank weights/state/checkpoints, graphs, aliasing, graph inputs, routes
    config     ModelConfig <-> NxDI InferenceConfig/NeuronConfig, compiler arguments
    convert    HF checkpoint -> converted directory (one pre-sharded checkpoint per rank) and its checks
    context    the context-encoding graphs (one per chunk-length bucket): buckets, the schedule of a prompt, inputs,
               the traced per-rank functions of both backends, the decoder that prefills through them
The launch plan, the run-time inputs and the teacher-forced prefill schedule are ``megakernel.plan``'s; the xla
backend's forward is ``harness.xla.forward``; the host loop is ``harness.speculative.Decoder`` over an engine
(``harness.engines``: the same per-rank work on CPU; ``NeuronEngine`` below on trn2).

trn2-only (needs neuronx-distributed-inference; NEVER EXECUTED in this repository):
    modeling   Qwen36InferenceConfig, Qwen36NeuronModel, Qwen36ForCausalLM, NeuronEngine
Those names are importable from here lazily: on a machine without the Neuron SDK, touching one raises
an ImportError that says what is missing.
"""

from __future__ import annotations

TRN2_ONLY = ("Qwen36InferenceConfig", "Qwen36NeuronModel", "Qwen36ForCausalLM", "NeuronEngine")


def __getattr__(name: str):
    if name in TRN2_ONLY:
        import importlib
        modeling = importlib.import_module("harness.nxdi.modeling")  # ImportError with the reason without the SDK
        return getattr(modeling, name)
    raise AttributeError(f"module 'harness.nxdi' has no attribute {name!r}")
