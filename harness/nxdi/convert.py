"""Hugging Face checkpoint -> converted NxDI checkpoint, once, before compiling (plain, tested).

A converted directory holds

* ``config.json`` -- the text model's config (``ModelConfig.to_hf_dict``);
* ``nxdi.json`` -- ``{"format": 4, "backend", "tp", "lnc", "max_len", "num_draft_tokens", "context_buckets",
  "dtype", "param_specs"}``; context_buckets = the chunk lengths of the context-encoding graphs
  (``harness.nxdi.context``: multiples of 64, at most max_len; [] for none); num_draft_tokens = K, the chained MTP drafts per round the graphs are built for (the weights
  do not depend on it, but the round graph's inputs and outputs and the decode state's K + 1 GDN checkpoint
  slots do, so it is fixed here with the other settings the compiled graphs bake in); param_specs = per-rank
  shape and dtype of every weight (what the NxDI module registers its parameters with);
* ``weights/tp{r}_sharded_checkpoint.safetensors`` for r in 0..tp-1 -- rank r's checkpoint
  (``assembly.rank_checkpoint``): ``weights.<name>`` with the per-rank shape, and ``rank_util.rank`` = [r].

The per-rank files have the names and the layout NxDI's ``load_weights`` reads from a compiled directory
(``models/application_base.py`` lines 389-399, neuronx-distributed-inference 0.9.0); ``compile`` links them
there (``Qwen36ForCausalLM.shard_weights``). NxD's own sharding is not used: it only slices parameters of
NxD's parallel layer types (``trace/trace.py`` lines 49-59 and 752, neuronx-distributed 0.18.0).

Peak host memory: the canonical checkpoint plus one rank's weights (~70 GB + ~19 GB for Qwen3.6-35B-A3B
in bf16); disk: the model once (~70 GB).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from harness.nxdi import assembly as asm
from megakernel.plan import DEFAULT_DRAFTS
from model.config import ModelConfig

FORMAT = 4  # 3: drafts (K) recorded; 4: context buckets
META_FILE = "nxdi.json"
CONFIG_FILE = "config.json"
WEIGHTS_DIR = "weights"
# What NxDI's InferenceConfig.save writes into a compiled directory (models/config.py line 23, 927-934).
COMPILED_CONFIG_FILE = "neuron_config.json"
META_KEYS = ("backend", "tp", "lnc", "max_len", "num_draft_tokens", "context_buckets", "dtype", "param_specs")


class ConvertError(ValueError):
    """A converted (or compiled) directory that is missing, incomplete, of another format, or converted
    for other settings than asked (the message says which)."""


def rank_file(path: str | os.PathLike, rank: int) -> Path:
    """Rank ``rank``'s checkpoint file under a converted (or compiled) directory."""
    return Path(path) / WEIGHTS_DIR / f"tp{rank}_sharded_checkpoint.safetensors"


def write_converted(out: str | os.PathLike, cfg: ModelConfig, params: dict[str, torch.Tensor], backend: str,
                    max_len: int, tp: int = 4, lnc: int = 2, progress=None, drafts: int = DEFAULT_DRAFTS,
                    buckets=None) -> Path:
    """Convert canonical ``params`` (``model.weights.load_checkpoint`` names) for ``backend`` and write a
    converted directory (module docstring) for rounds of ``drafts`` (K) chained drafts and context graphs of
    ``buckets`` (None: ``harness.nxdi.context.default_buckets(max_len)``), one rank at a time.
    progress: optional callable(str)."""
    from harness.nxdi import context
    from harness.nxdi.config import neuron_config_kwargs
    asm.check_drafts(drafts)
    buckets = context.check_buckets(context.default_buckets(max_len) if buckets is None else buckets, max_len)
    neuron_config_kwargs(cfg, max_len, tp, lnc)  # validates sharding and max_len before any work
    out = Path(out)
    (out / WEIGHTS_DIR).mkdir(parents=True, exist_ok=True)
    (out / META_FILE).unlink(missing_ok=True)  # an interrupted conversion leaves no valid directory
    for stale in (out / WEIGHTS_DIR).glob("tp*_sharded_checkpoint.safetensors"):
        stale.unlink()
    dtype = params["model.embed_tokens.weight"].dtype
    first = None
    for r in range(tp):
        w = asm.rank_weights(cfg, params, backend, r, tp, lnc)
        specs = asm.tensor_specs(w)
        if first is None:
            first = specs
        elif specs != first:
            raise asm.AssemblyError(f"rank {r}'s weights differ in names, shapes or dtypes from rank 0's")
        save_file(asm.rank_checkpoint(w, r), str(rank_file(out, r)), metadata={"format": "pt"})
        del w
        if progress:
            progress(f"converted rank {r + 1}/{tp}")
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True) + "\n")
    meta = {"format": FORMAT, "backend": backend, "tp": tp, "lnc": lnc, "max_len": int(max_len),
            "num_draft_tokens": drafts, "context_buckets": list(buckets),
            "dtype": asm.dtype_name(dtype), "param_specs": asm.specs_to_json(first)}
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if progress:
        progress(f"wrote {out}")
    return out


def read_meta(path: str | os.PathLike) -> dict:
    """The ``nxdi.json`` of a converted directory (validated)."""
    f = Path(path) / META_FILE
    if not f.is_file():
        raise ConvertError(f"{path}: not a converted NxDI checkpoint (no {META_FILE}); run "
                           f"`python -m harness.nxdi.run convert` first")
    meta = json.loads(f.read_text())
    if meta.get("format") != FORMAT:
        raise ConvertError(f"{f}: format {meta.get('format')!r}, this code reads format {FORMAT}; convert again")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ConvertError(f"{f}: missing {missing}")
    from harness.nxdi.context import ContextError, check_buckets
    try:
        check_buckets(meta["context_buckets"], meta["max_len"])
    except ContextError as e:
        raise ConvertError(f"{f}: {e}") from None
    return meta


def check_asked(meta: dict, path, **asked) -> None:
    """Raise ConvertError if the converted settings differ from any setting asked (None: not asked).
    asked keys: tp, lnc, dtype (name), max_len, num_draft_tokens."""
    diff = [f"{k}={meta[k]} (asked {v})" for k, v in asked.items() if v is not None and meta[k] != v]
    if diff:
        raise ConvertError(f"{path} was converted for {', '.join(diff)}; convert again with the settings you want")


def check_rank_files(path: str | os.PathLike, meta: dict) -> None:
    """Raise ConvertError unless every rank's file exists and holds exactly the weights of ``param_specs``
    (per-rank shape and dtype) plus ``rank_util.rank`` = [rank]. Reads the file headers, not the data."""
    want = {asm.WEIGHTS_PREFIX + k: v for k, v in asm.specs_from_json(meta["param_specs"]).items()}
    want[asm.RANK_UTIL] = ((1,), torch.int32)
    for r in range(meta["tp"]):
        f = rank_file(path, r)
        if not f.is_file():
            raise ConvertError(f"{path}: rank {r}'s checkpoint {f.relative_to(path)} is missing; convert again")
        with safe_open(str(f), framework="pt") as h:
            keys = set(h.keys())
            missing = sorted(set(want) - keys)
            extra = sorted(keys - set(want))
            if missing or extra:
                what = f"is missing {missing[:4]}{' ...' if len(missing) > 4 else ''}" if missing else \
                    f"holds unexpected {extra[:4]}"
                raise ConvertError(f"{f}: {what} ({len(missing)} missing, {len(extra)} unexpected); convert again")
            for k, (shape, dtype) in want.items():
                s = h.get_slice(k)
                got = (tuple(s.get_shape()), asm.dtype_of(_safetensors_dtype(s.get_dtype())))
                if got != (shape, dtype):
                    raise ConvertError(f"{f}: {k} is {list(got[0])} {asm.dtype_name(got[1])}, expected "
                                       f"{list(shape)} {asm.dtype_name(dtype)}; convert again")
            rank = h.get_tensor(asm.RANK_UTIL)
            if rank.tolist() != [r]:
                raise ConvertError(f"{f}: {asm.RANK_UTIL} is {rank.tolist()}, expected [{r}]")


def _safetensors_dtype(name: str) -> str:
    names = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "I32": "int32", "I64": "int64",
             "U8": "uint8", "I8": "int8", "BOOL": "bool"}
    if name not in names:
        raise ConvertError(f"unexpected safetensors dtype {name}")
    return names[name]


def check_converted(path: str | os.PathLike, tp: int | None = None, lnc: int | None = None,
                    dtype: str | None = None, max_len: int | None = None, drafts: int | None = None) -> dict:
    """The validated meta of a converted directory: format, the asked settings (None: take the directory's),
    every rank's file complete."""
    meta = read_meta(path)
    check_asked(meta, path, tp=tp, lnc=lnc, dtype=dtype, max_len=max_len, num_draft_tokens=drafts)
    check_rank_files(path, meta)
    return meta


def check_compiled(compiled: str | os.PathLike, meta: dict, converted) -> None:
    """Raise ConvertError unless the compiled directory was compiled from a conversion with ``meta``'s
    settings. Reads the ``neuron_config.json`` NxDI wrote there (plain JSON)."""
    f = Path(compiled) / COMPILED_CONFIG_FILE
    if not f.is_file():
        raise ConvertError(f"{compiled}: not a compiled NxDI application (no {COMPILED_CONFIG_FILE}); run "
                           f"`python -m harness.nxdi.run compile` first")
    c = json.loads(f.read_text())
    nc = c.get("neuron_config", {})
    have = {"backend": c.get("nxdi_backend"), "tp": nc.get("tp_degree"), "lnc": c.get("nxdi_lnc"),
            "max_len": c.get("nxdi_max_len"), "num_draft_tokens": c.get("nxdi_num_draft_tokens"),
            "context_buckets": c.get("nxdi_context_buckets"),
            "dtype": nc.get("torch_dtype"), "param_specs": c.get("nxdi_param_specs")}
    diff = [k for k in META_KEYS if have[k] != meta[k]]
    if diff:
        shown = ", ".join(f"{k}={have[k]} vs {meta[k]}" for k in diff if k != "param_specs")
        raise ConvertError(f"{compiled} was compiled from another conversion than {converted} "
                           f"({shown or 'other weights'}); compile again")


def link_rank_files(converted: str | os.PathLike, dest: str | os.PathLike, tp: int, progress=None) -> None:
    """Put the converted per-rank files into ``dest`` (a compiled directory): hard links when both are on one
    file system (no copy of ~70 GB), else copies."""
    for r in range(tp):
        src, dst = rank_file(converted, r), rank_file(dest, r)
        if not src.is_file():
            raise ConvertError(f"{converted}: rank {r}'s checkpoint {src.name} is missing; convert again")
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.unlink(missing_ok=True)
        try:
            os.link(src, dst)
        except OSError:
            shutil.copyfile(src, dst)
        if progress:
            progress(f"weights of rank {r + 1}/{tp} in {dst.parent}")
