"""Reading and writing Hugging Face checkpoints of the Qwen3.5/3.6-MoE text model.

A checkpoint is a directory with

* ``config.json`` -- multimodal ``qwen3_5_moe`` (text model under ``text_config``) or
  text-only ``qwen3_5_moe_text``; parsed by :meth:`ModelConfig.from_json_file`;
* weights -- one ``model.safetensors``, or shards listed by ``model.safetensors.index.json``
  (``{"metadata": {"total_size": N}, "weight_map": {tensor name: shard file}}``).

On-disk names differ from the canonical names of :mod:`model.params` in two ways, both
undone by :func:`load_checkpoint`:

* prefix: the official (multimodal) checkpoint uses ``model.language_model.*``, text-only
  ones ``model.*``; ``lm_head.weight`` and ``mtp.*`` are top level either way. Vision tower
  tensors (``model.visual.*``, ``visual.*``) are skipped.
* routed experts: fused, as in the canonical layout,
  ``<layer>.mlp.experts.gate_up_proj`` [E, 2I, H] (rows 0..I-1 gate, I..2I-1 up) and
  ``<layer>.mlp.experts.down_proj`` [E, H, I]; or per expert,
  ``<layer>.mlp.experts.{e}.gate_proj.weight`` [I, H], ``.up_proj.weight`` [I, H],
  ``.down_proj.weight`` [H, I], which are stacked into the fused layout. transformers 5.23's
  ``save_pretrained`` writes this per-expert form (it reverts its load-time fusion), with
  the ``model.`` prefix.

:func:`save_checkpoint` writes any of these variants, so tests can cover every one.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import ModelConfig
from model.params import expected_shapes, is_fp32_param, random_params

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint", "random_checkpoint",
           "PREFIXES", "EXPERT_LAYOUTS"]

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PREFIXES = ("model.", "model.language_model.")
EXPERT_LAYOUTS = ("fused", "per_expert")
_SHARD_RE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
_PER_EXPERT_RE = re.compile(r"^(?P<base>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
_PROJS = ("gate_proj", "up_proj", "down_proj")
_SKIP_PREFIXES = ("model.visual.", "visual.")
# Floating dtypes we accept on disk (safetensors dtype codes). Quantized checkpoints
# (F8 weights + scales, int4 packs) are not supported.
_FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_LISTED = 8


class CheckpointError(ValueError):
    """A checkpoint directory or file that cannot be read or does not match its config."""


def _listing(names: Iterable[str], limit: int = _MAX_LISTED) -> str:
    names = list(names)
    shown = ", ".join(repr(n) for n in names[:limit])
    return shown + (f", ... and {len(names) - limit} more" if len(names) > limit else "")


def _shape(s) -> list[int]:
    return [int(x) for x in s]


# --------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------
@dataclass
class _Entry:
    """One tensor on disk."""
    file: Path
    name: str              # on-disk name
    shape: tuple[int, ...]
    dtype: str             # safetensors dtype code, e.g. "BF16"


@dataclass
class _ExpertGroup:
    """The per-expert tensors of one MoE block, keyed by (expert, projection)."""
    disk_base: str         # e.g. "model.language_model.layers.3.mlp.experts"
    parts: dict[tuple[int, str], _Entry] = field(default_factory=dict)


def _canonical(name: str) -> str | None:
    """Canonical name of an on-disk tensor name, or None for tensors that are skipped."""
    if name.startswith(_SKIP_PREFIXES):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def _weight_files(root: Path) -> list[tuple[Path, list[str] | None]]:
    """The weight files of a checkpoint, each with the names the index assigns to it
    (None for a single ``model.safetensors``: all of its tensors)."""
    index, single = root / INDEX_FILE, root / SINGLE_FILE
    if index.is_file() and single.exists():
        raise CheckpointError(f"{root}: holds both {SINGLE_FILE} and {INDEX_FILE}; "
                              f"expected exactly one of them")
    if single.exists():
        if not single.is_file():
            raise CheckpointError(f"{single}: expected a safetensors file, found a directory")
        return [(single, None)]
    if not index.is_file():
        raise CheckpointError(f"{root}: no weights found: expected {SINGLE_FILE} or {INDEX_FILE}")
    try:
        d = json.loads(index.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{index}: not valid JSON ({e.msg} at line {e.lineno})") from None
    except (OSError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{index}: cannot read ({e})") from None
    wm = d.get("weight_map") if isinstance(d, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise CheckpointError(f"{index}: expected an object with a 'weight_map' of tensor name -> shard "
                              f"file name (strings), found {type(wm).__name__ if wm is not None else 'none'}")
    by_shard: dict[str, list[str]] = {}
    for name, shard in wm.items():
        by_shard.setdefault(shard, []).append(name)
    out = []
    for shard in sorted(by_shard):
        f = root / shard
        if not f.is_file():
            raise CheckpointError(f"{index}: weight_map assigns {len(by_shard[shard])} tensor(s) "
                                  f"(e.g. {by_shard[shard][0]!r}) to shard {shard!r}, but {f} does not exist")
        out.append((f, by_shard[shard]))
    return out


def _read_header(file: Path, names: list[str] | None) -> list[_Entry]:
    """Names, shapes and dtypes of the tensors in one safetensors file (no data is read)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = list(f.keys())
            present = set(keys)
            wanted = keys if names is None else [n for n in names if n in present]
            absent = [] if names is None else [n for n in names if n not in present]
            entries = []
            for n in wanted:
                sl = f.get_slice(n)
                entries.append(_Entry(file, n, tuple(_shape(sl.get_shape())), str(sl.get_dtype())))
    except Exception as e:  # SafetensorError, OSError: corrupt, truncated or unreadable file
        raise CheckpointError(f"{file}: not a readable safetensors file ({type(e).__name__}: {e})") from None
    if absent:
        raise CheckpointError(f"{file}: {INDEX_FILE} lists {len(absent)} tensor(s) in this shard that it "
                              f"does not contain: {_listing(absent)}")
    return entries


def _plan(root: Path, cfg: ModelConfig, entries: list[_Entry], include_mtp: bool):
    """Match on-disk tensors to canonical names; raise on anything missing, extra or misshapen.

    Returns (direct, groups): canonical name -> entry for tensors read as they are, and
    canonical ``...mlp.experts`` base -> per-expert group for experts to be stacked.
    """
    expected = expected_shapes(cfg, include_mtp)
    e_n, i_n, h_n = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    direct: dict[str, _Entry] = {}
    groups: dict[str, _ExpertGroup] = {}
    unknown: list[str] = []

    def duplicate(canon: str, a: _Entry, b: _Entry):
        raise CheckpointError(f"{root}: tensor {canon!r} appears twice: as {a.name!r} in {a.file.name} "
                              f"and as {b.name!r} in {b.file.name}")

    for ent in entries:
        canon = _canonical(ent.name)
        if canon is None:
            continue
        if canon.startswith("mtp.") and not include_mtp:
            continue
        if canon == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # redundant copy of the tied embedding
        m = _PER_EXPERT_RE.match(canon)
        if m:
            base, e, proj = m["base"], int(m["e"]), m["proj"]
            if base + ".gate_up_proj" not in expected or e >= e_n:
                unknown.append(ent.name)
                continue
            disk_base = ent.name[: len(ent.name) - len(canon) + len(base)]
            g = groups.setdefault(base, _ExpertGroup(disk_base))
            if (e, proj) in g.parts:
                duplicate(f"{base}.{e}.{proj}.weight", g.parts[(e, proj)], ent)
            g.parts[(e, proj)] = ent
            continue
        if canon in direct:
            duplicate(canon, direct[canon], ent)
        if canon not in expected:
            unknown.append(ent.name)
            continue
        direct[canon] = ent

    problems = []
    for base, g in groups.items():
        for fused in (base + ".gate_up_proj", base + ".down_proj"):
            if fused in direct:
                raise CheckpointError(f"{root}: experts of {base!r} are stored both fused ({direct[fused].name!r} "
                                      f"in {direct[fused].file.name}) and per expert ({g.disk_base}.*)")
    missing = [n for n in expected if n not in direct and n.rsplit(".", 1)[0] not in groups]
    if missing:
        where = ", ".join(sorted({e.file.name for e in entries})) or "no tensors"
        problems.append(f"missing {len(missing)} expected tensor(s) (canonical names): {_listing(missing)} "
                        f"[read {where}]")
    if unknown:
        hint = ""
        if any(_canonical(n).startswith("mtp.") for n in unknown) and cfg.mtp_num_hidden_layers == 0:
            hint = " (config.json has mtp_num_hidden_layers=0, so no mtp.* tensors are expected)"
        problems.append(f"{len(unknown)} unexpected tensor(s) not in the model: {_listing(unknown)}{hint}")
    if problems:
        raise CheckpointError(f"{root}: checkpoint does not match its config.json: " + "; ".join(problems))

    for canon, ent in direct.items():
        if ent.shape != tuple(expected[canon]):
            raise CheckpointError(f"{ent.file}: tensor {ent.name!r} has shape {list(ent.shape)}, "
                                  f"expected {list(expected[canon])}")
    for base, g in groups.items():
        absent = [f"{g.disk_base}.{e}.{p}.weight" for e in range(e_n) for p in _PROJS if (e, p) not in g.parts]
        if absent:
            raise CheckpointError(f"{root}: incomplete per-expert tensors of {g.disk_base!r} (expected "
                                  f"{e_n} experts x {'/'.join(_PROJS)}): missing {len(absent)}: {_listing(absent)}")
        for (e, p), ent in g.parts.items():
            want = (h_n, i_n) if p == "down_proj" else (i_n, h_n)
            if ent.shape != want:
                raise CheckpointError(f"{ent.file}: tensor {ent.name!r} has shape {list(ent.shape)}, "
                                      f"expected {list(want)}")
    for ent in [*direct.values(), *(x for g in groups.values() for x in g.parts.values())]:
        if ent.dtype not in _FLOAT_DTYPES:
            raise CheckpointError(f"{ent.file}: tensor {ent.name!r} has dtype {ent.dtype}, expected one of "
                                  f"{', '.join(_FLOAT_DTYPES)} (quantized checkpoints are not supported)")
    return direct, groups


def load_checkpoint(path: str | os.PathLike, dtype: torch.dtype | None = torch.bfloat16,
                    include_mtp: bool = True) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """Read a checkpoint directory into (config, canonical parameters).

    Args:
        path: directory with ``config.json`` and ``model.safetensors`` or
            ``model.safetensors.index.json`` + shards (see module doc for the name forms).
        dtype: dtype of the returned tensors, except ``*.A_log`` / ``*.dt_bias``, which are
            always float32 (:func:`model.params.is_fp32_param`). None keeps the stored dtypes.
        include_mtp: also read the MTP head (``mtp.*``); when False those tensors are skipped.

    Returns:
        ``(cfg, params)``; ``params`` has exactly the names and shapes of
        ``expected_shapes(cfg, include_mtp)``, in that order, e.g.
        ``model.layers.{i}.mlp.experts.gate_up_proj`` [E, 2I, H]. With
        ``cfg.mtp_num_hidden_layers == 0`` no ``mtp.*`` tensors are expected (any on disk
        are an error). With tied embeddings a stored ``lm_head.weight`` is ignored.

    Raises:
        CheckpointError: missing/unreadable directory, config.json or weight files, an
            index naming a missing shard, a corrupt safetensors file, a missing, extra,
            duplicate or misshapen tensor, an incomplete set of per-expert tensors, or a
            non-float (quantized) tensor. The message names the path and tensor.
        ConfigError: config.json is not valid JSON or not a supported config (from
            :meth:`ModelConfig.from_json_file`; it names the file).

    Everything is validated from the safetensors headers before any data is read; then
    tensors are read one at a time (per-expert tensors are copied straight into their
    slot of the fused tensor), so peak memory is the result plus one tensor.
    """
    root = Path(path)
    if not root.exists():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    if not root.is_dir():
        raise CheckpointError(f"{root}: expected a checkpoint directory, found a file")
    if not (root / CONFIG_FILE).is_file():
        raise CheckpointError(f"{root}: no {CONFIG_FILE} (expected a Hugging Face checkpoint directory "
                              f"with {CONFIG_FILE} and {SINGLE_FILE} or {INDEX_FILE})")
    cfg = ModelConfig.from_json_file(root / CONFIG_FILE)

    files = _weight_files(root)
    entries = [ent for f, names in files for ent in _read_header(f, names)]
    direct, groups = _plan(root, cfg, entries, include_mtp)

    def target(canon: str, stored: torch.dtype) -> torch.dtype:
        if dtype is None:
            return stored
        return torch.float32 if is_fp32_param(canon) else dtype

    by_file: dict[Path, list[tuple[str, _Entry, int | None, str | None]]] = {}
    for canon, ent in direct.items():
        by_file.setdefault(ent.file, []).append((canon, ent, None, None))
    for base, g in groups.items():
        for (e, p), ent in sorted(g.parts.items()):
            by_file.setdefault(ent.file, []).append((base, ent, e, p))

    out: dict[str, torch.Tensor] = {}
    i_n = cfg.moe_intermediate_size
    for file, items in by_file.items():
        try:
            with safe_open(str(file), framework="pt") as f:
                for canon, ent, e, p in items:
                    t = f.get_tensor(ent.name)
                    if e is None:
                        out[canon] = t.to(target(canon, t.dtype))
                        continue
                    gu, dp = canon + ".gate_up_proj", canon + ".down_proj"
                    if gu not in out:
                        td = target(gu, t.dtype)
                        out[gu] = torch.empty((cfg.num_experts, 2 * i_n, cfg.hidden_size), dtype=td)
                        out[dp] = torch.empty((cfg.num_experts, cfg.hidden_size, i_n), dtype=td)
                    if p == "gate_proj":
                        out[gu][e, :i_n].copy_(t)
                    elif p == "up_proj":
                        out[gu][e, i_n:].copy_(t)
                    else:
                        out[dp][e].copy_(t)
                    del t
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{file}: failed reading tensor data ({type(e).__name__}: {e})") from None

    order = expected_shapes(cfg, include_mtp)
    return cfg, {n: out[n] for n in order}


# --------------------------------------------------------------------------------------
# Saving
# --------------------------------------------------------------------------------------
def _multimodal_dict(cfg: ModelConfig) -> dict:
    text = cfg.to_hf_dict()
    text.pop("architectures", None)
    text["model_type"] = "qwen3_5_moe_text"
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "model_type": "qwen3_5_moe",
        "text_config": text,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }


def _check_params(cfg: ModelConfig, params: dict[str, torch.Tensor]):
    expected = expected_shapes(cfg)
    missing = [n for n in expected if n not in params]
    extra = [n for n in params if n not in expected]
    if missing or extra:
        msg = []
        if missing:
            msg.append(f"missing {len(missing)}: {_listing(missing)}")
        if extra:
            msg.append(f"{len(extra)} not in the model: {_listing(extra)}")
        hint = (" (for a model without the MTP head use cfg.replace(mtp_num_hidden_layers=0))"
                if any(n.startswith("mtp.") for n in missing) else "")
        raise CheckpointError("save_checkpoint: params do not match expected_shapes(cfg): "
                              + "; ".join(msg) + hint)
    for n, shape in expected.items():
        t = params[n]
        if not isinstance(t, torch.Tensor):
            raise CheckpointError(f"save_checkpoint: params[{n!r}] is a {type(t).__name__}, expected a tensor")
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"save_checkpoint: params[{n!r}] has shape {list(t.shape)}, expected {list(shape)}")


def _disk_items(cfg: ModelConfig, params: dict[str, torch.Tensor], prefix: str, expert_layout: str
                ) -> list[tuple[str, Callable[[], torch.Tensor], int]]:
    """(on-disk name, producer of the tensor, byte size) for every tensor to write, in order."""
    def disk(canon: str) -> str:
        return prefix + canon[len("model."):] if canon.startswith("model.") else canon

    i_n = cfg.moe_intermediate_size
    items = []
    for canon in expected_shapes(cfg):
        t = params[canon].detach()
        if expert_layout == "per_expert" and canon.endswith(".mlp.experts.down_proj"):
            continue  # written together with gate_up_proj below
        if expert_layout == "per_expert" and canon.endswith(".mlp.experts.gate_up_proj"):
            base = canon[: -len(".gate_up_proj")]
            down = params[base + ".down_proj"].detach()
            for e in range(cfg.num_experts):
                for p, src in (("gate_proj", lambda e=e, t=t: t[e, :i_n]),
                               ("up_proj", lambda e=e, t=t: t[e, i_n:]),
                               ("down_proj", lambda e=e, down=down: down[e])):
                    size = src().numel() * t.element_size()
                    items.append((disk(f"{base}.{e}.{p}.weight"), src, size))
            continue
        items.append((disk(canon), lambda t=t: t, t.numel() * t.element_size()))
    return items


def _standalone(t: torch.Tensor, seen: set[int]) -> torch.Tensor:
    """t itself if it is contiguous and owns its whole storage, else a contiguous copy
    (safetensors refuses tensors that share storage)."""
    st = t.untyped_storage()
    if (t.is_contiguous() and t.storage_offset() == 0 and st.nbytes() == t.numel() * t.element_size()
            and st.data_ptr() not in seen):
        seen.add(st.data_ptr())
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _write_atomic(path: Path, writer: Callable[[Path], None]):
    tmp = path.with_name(path.name + ".tmp")
    writer(tmp)
    os.replace(tmp, path)


def save_checkpoint(path: str | os.PathLike, cfg: ModelConfig, params: dict[str, torch.Tensor],
                    prefix: str = "model.", expert_layout: str = "fused", max_shard_bytes: int | None = None,
                    multimodal_config: bool = False) -> list[Path]:
    """Write ``params`` (canonical names, exactly ``expected_shapes(cfg)``) as a checkpoint.

    Args:
        path: output directory (created if needed). Weight files and index of an earlier
            save there (``model.safetensors``, ``model-NNNNN-of-NNNNN.safetensors``,
            ``model.safetensors.index.json``) are removed first; nothing else is touched.
        prefix: on-disk prefix of the ``model.*`` tensors: ``"model."`` (text-only
            checkpoints) or ``"model.language_model."`` (the official multimodal one).
        expert_layout: ``"fused"`` (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj``
            [E, H, I]) or ``"per_expert"`` (``experts.{e}.gate_proj.weight`` [I, H],
            ``up_proj`` [I, H], ``down_proj`` [H, I]); applies to trunk and MTP layers.
        max_shard_bytes: if given, write shards ``model-00001-of-0000N.safetensors`` (filled
            greedily in canonical order, a shard exceeds the limit only when it holds a single
            larger tensor) plus ``model.safetensors.index.json``, even when N is 1; else one
            ``model.safetensors``.
        multimodal_config: write the ``qwen3_5_moe`` config.json wrapper (text model under
            ``text_config``) instead of the text-only ``qwen3_5_moe_text`` one.

    Tensors are stored in their own dtype, contiguous, with safetensors metadata
    ``{"format": "pt"}`` (what transformers expects). The output is a deterministic
    function of the arguments. Returns the weight files written.
    """
    if prefix not in PREFIXES:
        raise CheckpointError(f"save_checkpoint: prefix must be one of {PREFIXES}, found {prefix!r}")
    if expert_layout not in EXPERT_LAYOUTS:
        raise CheckpointError(f"save_checkpoint: expert_layout must be one of {EXPERT_LAYOUTS}, "
                              f"found {expert_layout!r}")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes <= 0):
        raise CheckpointError(f"save_checkpoint: max_shard_bytes must be a positive integer or None, "
                              f"found {max_shard_bytes!r}")
    _check_params(cfg, params)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    for old in sorted(root.iterdir()):
        if old.name in (SINGLE_FILE, INDEX_FILE) or _SHARD_RE.match(old.name):
            old.unlink()

    conf = _multimodal_dict(cfg) if multimodal_config else cfg.to_hf_dict()
    _write_atomic(root / CONFIG_FILE,
                  lambda p: p.write_text(json.dumps(conf, indent=2, sort_keys=True) + "\n"))

    items = _disk_items(cfg, params, prefix, expert_layout)
    shards: list[list[tuple[str, Callable[[], torch.Tensor], int]]] = [[]]
    size = 0
    for it in items:
        if max_shard_bytes is not None and shards[-1] and size + it[2] > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(it)
        size += it[2]

    n = len(shards)
    names = [SINGLE_FILE] if max_shard_bytes is None else [f"model-{k + 1:05d}-of-{n:05d}.safetensors"
                                                          for k in range(n)]
    written = []
    for fname, shard in zip(names, shards):
        seen: set[int] = set()
        tensors = {name: _standalone(make(), seen) for name, make, _ in shard}
        _write_atomic(root / fname, lambda p: save_file(tensors, str(p), metadata={"format": "pt"}))
        del tensors
        written.append(root / fname)
    if max_shard_bytes is not None:
        index = {
            "metadata": {"total_size": sum(it[2] for it in items)},
            "weight_map": {name: fname for fname, shard in zip(names, shards) for name, _, _ in shard},
        }
        index["weight_map"] = dict(sorted(index["weight_map"].items()))
        _write_atomic(root / INDEX_FILE, lambda p: p.write_text(json.dumps(index, indent=2) + "\n"))
    return written


def random_checkpoint(path: str | os.PathLike, cfg: ModelConfig, seed: int = 0,
                      dtype: torch.dtype = torch.bfloat16, **save_kwargs) -> dict[str, torch.Tensor]:
    """Write ``random_params(cfg, seed, dtype)`` with :func:`save_checkpoint` (``save_kwargs``
    are passed on) and return those params."""
    params = random_params(cfg, seed=seed, dtype=dtype)
    save_checkpoint(path, cfg, params, **save_kwargs)
    return params
