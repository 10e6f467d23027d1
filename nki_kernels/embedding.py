"""Token embedding: gather T rows of the embedding table (HBM) into the residual ``x [T, H]`` (SBUF).

Layouts
-------
* ``table``  HBM ``[V, H]`` activation dtype (the PyTorch layout; replicated on every rank -- a gather
  reads T*H elements however the table is sharded, so sharding would only add a collective).
* ``ids``    HBM ``[T]`` or ``[T, 1]`` int32, run-time data (T <= 128).
* ``x``      SBUF ``[T, H]`` activation dtype: token t on partition t (the residual layout of
  nki_kernels/README.md).

The gather is ONE ``dma_copy`` whose source access pattern is indexed by the ids tile (``indirect_dim=0``): row t of
``x`` <- ``table[ids[t], :]``. Several ids: vector indirection (``vector_offset``, one row id per destination
partition, the ids tile aligned with ``x``); one id into a row of a larger tile (``dst=``: the verify gathers each
draft's row straight from the tile its argmax left): scalar indirection (``scalar_offset``, the 1x1 ids tile; SDK
dma_copy "Scalar indirection"), which holds wherever the row starts. No Python branch looks at the ids; the same
instruction stream serves any ids.

Out-of-range ids
----------------
The ids are run-time data, so the kernel cannot refuse them while it is being built. Two layers:

1. **Host refusal (the guarantee).** :func:`embed_tokens` -- the launch wrapper tests and the
   layerwise variant call -- validates every id against ``[0, V)`` in numpy and raises ``ValueError``
   naming the id and its position BEFORE the kernel is launched, i.e. before any DMA (tested with a
   trace capture: zero instructions). The megakernel's own in-kernel ids come from the LM-head argmax,
   which lies in ``[0, V)`` by construction; the host validates the ids it feeds a round.
2. **Device net.** The gather uses ``oob_mode=oob_mode.error`` (SDK-ISA dma_copy): an out-of-range
   index faults the DMA instead of reading a neighbouring allocation. It fires only after the ids
   themselves were DMA'd into SBUF, so it is a safety net, not the refusal. ``oob_mode.skip`` is
   deliberately not used: it would leave stale residual rows and decode garbage silently.

Cost (real shapes, T=2, bf16): the gather reads T*H*2 = 8 KiB of table and 8 B of ids per core --
exactly the minimum the math requires; under LNC=2 each physical core gathers its own copy of the
residual (both cores need all of x), 16 KiB per rank.
"""

from __future__ import annotations

import numpy as np

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import P, program_sharding


def load_token_ids(ids):
    """HBM ids ``[T]`` / ``[T, 1]`` int32 -> SBUF ``[T, 1]`` int32 (one id per partition)."""
    T = ids.shape[0]
    if ids.dtype != nl.int32:
        raise TypeError(f"embedding: token ids must be int32, got {ids.dtype}")
    if len(ids.shape) not in (1, 2) or (len(ids.shape) == 2 and ids.shape[1] != 1):
        raise ValueError(f"embedding: token ids must have shape [T] or [T, 1], got {list(ids.shape)}")
    if not 1 <= T <= P:
        raise ValueError(f"embedding: {T} token ids, expected 1..{P} (one per partition)")
    ids_sb = nl.ndarray((T, 1), nl.int32, buffer=nl.sbuf, name="token_ids")
    nisa.dma_copy(dst=ids_sb, src=ids)
    return ids_sb


def token_ids_from_best(best):
    """The in-kernel seam from the LM head to the embedding: ``best`` SBUF ``[T, 2]`` float32
    (value, global index) from ``collectives.argmax_combine`` -> SBUF ``[T, 1]`` int32 ids (exact: the
    indices are integers < 2^24; fp32 -> int32 conversion rounds to nearest). Such ids are in ``[0, V)``
    by construction, so no host check is needed for them."""
    T = best.shape[0]
    ids_sb = nl.ndarray((T, 1), nl.int32, buffer=nl.sbuf, name="greedy_ids")
    nisa.tensor_copy(dst=ids_sb, src=best[:, 1:2])
    return ids_sb


def subset_ids_from_best(best, subset_ids):
    """The FR-Spec draft's seam: ``best`` SBUF ``[T, 2]`` float32 (value, index into the draft vocabulary) from
    ``collectives.argmax_combine`` over the draft head -> SBUF ``[T, 2]`` float32 (value, token id): the index
    gathers its id from ``subset_ids`` HBM ``[Vd, 1]`` int32 (the draft vocabulary, ascending; ``model.draft_vocab``)
    with the embedding's indirect DMA (:func:`embedding_body` of a one-column int32 table). The index lies in
    ``[0, Vd)`` by construction; ids < 2^24 are exact in fp32."""
    T = best.shape[0]
    idx = token_ids_from_best(best)
    ids = embedding_body(subset_ids, idx)
    out = nl.ndarray((T, 2), nl.float32, buffer=nl.sbuf, name="draft_vocab_best")
    nisa.tensor_copy(dst=out[:, 0:1], src=best[:, 0:1])
    nisa.tensor_copy(dst=out[:, 1:2], src=ids)
    return out


def embedding_body(table, ids_sb, dst=None):
    """Body: gather rows ``ids_sb`` of ``table`` into the residual.

    table:  HBM ``[V, H]`` (activation dtype).
    ids_sb: SBUF ``[T, 1]`` int32, T <= 128, values in ``[0, V)`` (run-time; out-of-range values
            fault the DMA, ``oob_mode.error``; refuse them on the host first, see module doc).
    dst:    None, or, for a one-id tile (T = 1), an SBUF ``[1, H]`` view (table dtype) to gather into, e.g. a row of a
            larger tile whose other rows come from other id tiles (one DMA per tile, each issued as soon as its id
            exists).
    Returns x: SBUF ``[T, H]``, table dtype, token t on partition t (``dst`` when given).
    """
    V, H = table.shape
    T = ids_sb.shape[0]
    if T > P:
        raise ValueError(f"embedding: ids tile has {T} partitions, the partition dim is at most {P}")
    if ids_sb.dtype not in (nl.int32, nl.uint32):
        raise TypeError(f"embedding: ids tile must be int32/uint32, got {ids_sb.dtype}")
    x = dst
    if x == None:
        x = nl.ndarray((T, H), table.dtype, buffer=nl.sbuf, name="embed_x")
    elif tuple(x.shape) != (T, H) or x.dtype != table.dtype:
        raise ValueError(f"embedding: dst {x.dtype}{list(x.shape)} is not [{T}, {H}] {table.dtype}")
    if dst == None:
        # vector indirection ("each of the hardware partitions gets its own index"): the ids tile is aligned with
        # the rows it fills
        rows = table.ap(pattern=[[H, T], [1, H]], offset=0, vector_offset=ids_sb, indirect_dim=0)
    elif T == 1:
        # into a row of a larger tile: scalar indirection (SDK dma_copy "Scalar indirection": a 1x1 SBUF offset
        # applied to every partition), which holds wherever dst starts
        rows = table.ap(pattern=[[H, 1], [1, H]], offset=0, scalar_offset=ids_sb, indirect_dim=0)
    else:
        raise ValueError(f"embedding: dst= takes the row of a one-id tile (scalar indirection); {T} ids gather "
                         f"into a tile of their own")
    nisa.dma_copy(dst=x, src=rows, oob_mode=nisa.oob_mode.error)
    return x


@nki.jit
def embedding_kernel(table, ids):
    """Wrapper: table HBM ``[V, H]``, ids HBM ``[T]``/``[T, 1]`` int32 -> ``[n_cores, T, H]``.

    Launch ``embedding_kernel(...)`` (LNC=1) or ``embedding_kernel[2](...)`` (a rank's two physical
    cores); every core gathers its own copy of the residual and writes row ``program_id`` of the output.
    Prefer :func:`embed_tokens`, which refuses out-of-range ids before launching.
    """
    n_cores, core = program_sharding()
    V, H = table.shape
    T = ids.shape[0]
    out = nl.ndarray((n_cores, T, H), table.dtype, buffer=nl.shared_hbm, name="embed_out")
    ids_sb = load_token_ids(ids)
    x = embedding_body(table, ids_sb)
    nisa.dma_copy(dst=out[core], src=x)
    return out


# ---- host side ---------------------------------------------------------------------------------
def check_token_ids(ids, vocab_size: int, where: str = "embedding") -> np.ndarray:
    """Validate run-time token ids on the host; returns them as an int32 ``[T]`` array.

    Raises TypeError for non-integer ids, ValueError for a bad shape or any id outside
    ``[0, vocab_size)`` (the message names the first offending id and its position)."""
    a = np.asarray(ids.detach().cpu().numpy() if hasattr(ids, "detach") else ids)
    if a.dtype.kind not in "iu":
        raise TypeError(f"{where}: token ids must be integers, got {a.dtype}")
    if a.ndim == 2 and a.shape[1] == 1:
        a = a[:, 0]
    if a.ndim != 1 or not 1 <= a.shape[0] <= P:
        raise ValueError(f"{where}: token ids must have shape [T] with 1 <= T <= {P}, got {list(a.shape)}")
    bad = np.flatnonzero((a < 0) | (a >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"{where}: token id {int(a[i])} at position {i} is outside the vocabulary "
                         f"[0, {vocab_size}); refused before launching the kernel (no DMA issued)")
    return a.astype(np.int32)


def embed_tokens(table, ids, lnc: int = 1):
    """Host launch wrapper: validate ``ids`` against the table, then run :func:`embedding_kernel`.

    table: ``[V, H]`` numpy (incl. ml_dtypes bf16) or torch tensor; ids: ``[T]`` integers.
    Returns ``[lnc, T, H]`` (one residual copy per physical core)."""
    ids32 = check_token_ids(ids, table.shape[0])
    k = embedding_kernel if lnc == 1 else embedding_kernel[lnc]
    return k(table, ids32)


def pattern_table(V: int, H: int, dtype: str = "bfloat16", period: int = 257, seed: int = 0) -> np.ndarray:
    """A cheap deterministic ``[V, H]`` table for demos and real-shape tests: ``period`` random rows
    repeated (row v = row v % period), so a 1 GiB table costs one memory copy instead of V*H draws."""
    from nkisim import dtypes as _dt
    small = np.random.default_rng(seed).standard_normal((min(period, V), H)).astype(np.float32)
    return np.take(small.astype(_dt.storage(dtype)), np.arange(V) % small.shape[0], axis=0)
