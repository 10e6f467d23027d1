"""Hugging Face checkpoint -> converted NxDI checkpoint, once, before compiling (plain, tested).

A converted directory holds

* ``config.json`` -- the text model's config (``ModelConfig.to_hf_dict``);
* ``nxdi.json`` -- ``{"format": 1, "backend", "tp", "lnc", "max_len", "dtype", "param_specs"}``, param_specs
  = per-rank shape and dtype of every weight (what the NxDI module registers its parameters with);
* ``model.safetensors`` or ``model-NNNNN-of-NNNNN.safetensors`` + ``model.safetensors.index.json`` -- the
  state dict of ``assembly.neuron_state_dict``: ``weights.<name>`` = the ranks' tensors concatenated along
  dim 0, and ``rank_util.rank``.

Conversion streams to bound host memory: each rank's weights are converted and written to a temporary
file, then freed; the canonical parameters are freed; then each name's four rank slices are read back
(memory-mapped) and concatenated into the output shards. Peak host memory is about the canonical
checkpoint plus one rank's weights (~70 GB + ~19 GB for Qwen3.6-35B-A3B in bf16); scratch disk about
twice the model. The result equals ``assembly.neuron_state_dict`` exactly (tested).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from harness.nxdi import assembly as asm
from model.config import ModelConfig

FORMAT = 1
META_FILE = "nxdi.json"
CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 4 << 30


class ConvertError(ValueError):
    """A converted directory that is missing, incomplete or of another format."""


def _write_shards(out: Path, names_sizes: list[tuple[str, int]], produce, shard_bytes: int) -> list[str]:
    """Write tensors (produced one at a time by produce(name)) into shards of at most shard_bytes each
    (a bigger single tensor gets its own shard). Returns the file names."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, n in names_sizes:
        if groups[-1] and size + n > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    single = len(groups) == 1
    files = [SINGLE_FILE] if single else [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map = {}
    for fname, group in zip(files, groups):
        tensors = {n: produce(n).contiguous() for n in group}
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in group})
        del tensors
    if not single:
        index = {"metadata": {"total_size": sum(n for _, n in names_sizes)}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return files


def write_converted(out: str | os.PathLike, cfg: ModelConfig, params: dict[str, torch.Tensor], backend: str,
                    max_len: int, tp: int = 4, lnc: int = 2, shard_bytes: int = DEFAULT_SHARD_BYTES,
                    progress=None) -> Path:
    """Convert canonical ``params`` for ``backend`` and write a converted directory (module docstring).

    ``params`` is consumed: its entries are deleted once every rank is converted (pass a copy of the dict
    to keep them). progress: optional callable(str) for status lines."""
    from harness.nxdi.config import neuron_config_kwargs
    neuron_config_kwargs(cfg, max_len, tp, lnc)  # validates sharding and max_len before any work
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = params["model.embed_tokens.weight"].dtype
    scratch = Path(tempfile.mkdtemp(prefix="nxdi_convert_", dir=out))
    try:
        rank_files, first = [], None
        for r in range(tp):
            w = asm.rank_weights(cfg, params, backend, r, tp, lnc)
            if first is None:
                first = {k: (tuple(v.shape), v.dtype) for k, v in w.items()}
            elif {k: (tuple(v.shape), v.dtype) for k, v in w.items()} != first:
                raise asm.AssemblyError(f"rank {r}'s weights differ in names, shapes or dtypes from rank 0's")
            f = scratch / f"rank{r}.safetensors"
            save_file(w, str(f))
            rank_files.append(f)
            del w
            if progress:
                progress(f"converted rank {r + 1}/{tp}")
        params.clear()
        handles = [safe_open(str(f), framework="pt") for f in rank_files]

        def produce(key: str) -> torch.Tensor:
            if key == asm.RANK_UTIL:
                return torch.arange(tp, dtype=torch.int32)
            name = key[len(asm.WEIGHTS_PREFIX):]
            return torch.cat([h.get_tensor(name) for h in handles], dim=0)

        items = [(asm.WEIGHTS_PREFIX + k, tp * torch.Size(s).numel() * torch.empty((), dtype=d).element_size())
                 for k, (s, d) in first.items()] + [(asm.RANK_UTIL, 4 * tp)]
        for stale in [SINGLE_FILE, INDEX_FILE, *(p.name for p in out.glob("model-*-of-*.safetensors"))]:
            (out / stale).unlink(missing_ok=True)
        _write_shards(out, items, produce, shard_bytes)
        del handles
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    meta = {"format": FORMAT, "backend": backend, "tp": tp, "lnc": lnc, "max_len": int(max_len),
            "dtype": asm.dtype_name(dtype), "param_specs": asm.specs_to_json(first)}
    (out / META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    (out / CONFIG_FILE).write_text(json.dumps(cfg.to_hf_dict(), indent=2, sort_keys=True) + "\n")
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
        raise ConvertError(f"{f}: format {meta.get('format')!r}, this code reads format {FORMAT}")
    missing = [k for k in ("backend", "tp", "lnc", "max_len", "dtype", "param_specs") if k not in meta]
    if missing:
        raise ConvertError(f"{f}: missing {missing}")
    return meta


def load_converted(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """The state dict of a converted directory (every tensor, read into memory)."""
    root = Path(path)
    read_meta(root)
    if (root / SINGLE_FILE).is_file():
        return load_file(str(root / SINGLE_FILE))
    index = root / INDEX_FILE
    if not index.is_file():
        raise ConvertError(f"{root}: no {SINGLE_FILE} or {INDEX_FILE}")
    out: dict[str, torch.Tensor] = {}
    for fname in sorted(set(json.loads(index.read_text())["weight_map"].values())):
        out.update(load_file(str(root / fname)))
    return out
