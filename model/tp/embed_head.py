"""PyTorch twins of the embedding and of the vocabulary-parallel LM head + greedy argmax.

Sharding (nki_kernels/README.md): the embedding table is replicated on every rank (a gather of
T rows reads T*H elements whatever the sharding, so splitting it would only add a collective);
the LM head is split by vocabulary over all TP x LNC = 8 physical cores: core g (= rank * lnc +
physical core) holds rows ``g*Vc .. (g+1)*Vc - 1`` of ``lm_head.weight``, ``Vc = V / n_cores``.
Each core computes its logits ``[T, Vc]`` and its argmax; the global winner is the core with the
largest value, the LOWEST global index winning ties (``torch.argmax`` semantics).

Numerics: logits are ``F.linear`` in the activation dtype (fp32 accumulation, rounded to the
activation dtype, as ``ReferenceModel.logits`` does) and compared as fp32. Rounding to the
activation dtype BEFORE the argmax matters: the model is bf16 end to end and bf16 logits tie far
more often than fp32 ones; an argmax over more precise logits would pick a different token on
exactly those ties (trn2-costs "Don't upcast the LM head").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model.config import ModelConfig


def lm_head_weight(params: dict[str, torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """The [V, H] output projection (the embedding table when the config ties them)."""
    return params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]


def vocab_per_core(cfg: ModelConfig, n_cores: int) -> int:
    """Rows of the LM head per core; the vocabulary must split evenly (248320 = 8 x 31040)."""
    if n_cores < 1 or cfg.vocab_size % n_cores:
        raise ValueError(f"lm_head: vocab_size {cfg.vocab_size} does not split evenly over {n_cores} cores")
    return cfg.vocab_size // n_cores


def shard_lm_head(params: dict[str, torch.Tensor], cfg: ModelConfig, core: int, n_cores: int = 8) -> torch.Tensor:
    """Core ``core``'s rows of the LM head: [Vc, H] (PyTorch layout, a view), core in [0, n_cores)."""
    if not 0 <= core < n_cores:
        raise ValueError(f"lm_head: core {core} outside [0, {n_cores})")
    vc = vocab_per_core(cfg, n_cores)
    return lm_head_weight(params, cfg)[core * vc:(core + 1) * vc]


def check_token_ids(ids, vocab_size: int, where: str = "embedding") -> None:
    """Refuse token ids outside [0, vocab_size) with a message naming the first offender."""
    t = torch.as_tensor(ids)
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
        raise TypeError(f"{where}: token ids must be integers, got {t.dtype}")
    flat = t.reshape(-1).to(torch.int64)
    bad = ((flat < 0) | (flat >= vocab_size)).nonzero()
    if len(bad):
        i = int(bad[0])
        raise ValueError(f"{where}: token id {int(flat[i])} at position {i} is outside the vocabulary "
                         f"[0, {vocab_size})")


def embed(params: dict[str, torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """ids [T] integer -> rows of the (replicated) embedding table [T, H], activation dtype."""
    table = params["model.embed_tokens.weight"]
    check_token_ids(ids, table.shape[0])
    return F.embedding(torch.as_tensor(ids).to(torch.int64), table)


def core_logits(hidden: torch.Tensor, w_shard: torch.Tensor) -> torch.Tensor:
    """Post-norm hidden [T, H] x one core's shard [Vc, H] -> logits [T, Vc] fp32 (activation-dtype values)."""
    return F.linear(hidden, w_shard).float()


def core_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: (max value fp32 [T], lowest local index of it int64 [T]) over a core's logits [T, Vc]."""
    idx = torch.argmax(logits, dim=-1)                     # first occurrence of the maximum
    return logits.gather(-1, idx[:, None])[:, 0], idx


def combine_argmax(values: torch.Tensor, local_idx: torch.Tensor, vc: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cross-core combine. values, local_idx: [n_cores, T] in core order -> (value [T], global index [T]).

    global index = core * vc + local index; among cores holding the same maximum the lowest
    global index wins (= the first such core, since each core's range lies above the previous)."""
    n = values.shape[0]
    gidx = local_idx.to(torch.int64) + vc * torch.arange(n, dtype=torch.int64, device=values.device)[:, None]
    best = values.max(dim=0).values
    cand = torch.where(values == best[None], gidx, torch.iinfo(torch.int64).max)
    return best, cand.min(dim=0).values


def lm_head_argmax(params: dict[str, torch.Tensor], cfg: ModelConfig, hidden: torch.Tensor,
                   n_cores: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy token of each row of the post-norm hidden [T, H] via the 8-way vocabulary split:
    (value [T] fp32, token id [T] int64) -- equals torch.argmax(ReferenceModel.logits(hidden), -1)."""
    vals, idxs = [], []
    for c in range(n_cores):
        v, i = core_argmax(core_logits(hidden, shard_lm_head(params, cfg, c, n_cores)))
        vals.append(v)
        idxs.append(i)
    return combine_argmax(torch.stack(vals), torch.stack(idxs), vocab_per_core(cfg, n_cores))


def greedy_rank(lm_head_rows: torch.Tensor, h: torch.Tensor, coll) -> torch.Tensor:
    """Greedy token of each row of the post-norm hidden h [T, H] with the vocabulary split by rows over the ranks:
    ``lm_head_rows`` [V/tp, H] is this rank's (rank r holds rows r*V/tp ..); ``coll`` a
    ``model.tp.collectives.Collectives``. Each rank's (max, first index) is packed as fp32 (indices < 2^24) and
    gathered once; the largest value wins, the lowest global index among equal values (``torch.argmax`` semantics,
    as :func:`combine_argmax`). Traceable. Returns int64 [T], the same on every rank."""
    logits = F.linear(h, lm_head_rows).float()  # rounded to the activation dtype first, as the reference
    val, idx = core_argmax(logits)
    allp = coll.gather_ranks(torch.stack([val, idx.float()], dim=-1))  # [tp, T, 2]
    values, local = allp[..., 0], allp[..., 1].long()
    gidx = local + lm_head_rows.shape[0] * torch.arange(allp.shape[0], device=h.device)[:, None]
    best = values.max(dim=0).values
    cand = torch.where(values == best[None], gidx, torch.full_like(gidx, torch.iinfo(torch.int64).max))
    return cand.min(dim=0).values
