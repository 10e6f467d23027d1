"""Token embedding of a prompt chunk (prefill): the N rows ``table[ids[t]]`` into HBM in ONE launch.

The decode body (``nki_kernels.embedding.embedding_body``) gathers at most 128 rows (one id per partition); a
chunk has thousands, and a launch per 128 tokens costs a launch head each (``costmodel.constants.
LAUNCH_OVERHEAD_NS``, 13.1 us: 32 heads for a 4K chunk). Here one launch loops over the chunk's 128-token tiles:
per tile one DMA of its ids into SBUF (one per partition), the decode body's gather (one software-DGE
``dma_copy`` indexed by the ids, ``oob_mode.error``), one DMA of the rows out. Tiles are dealt round-robin over
the LNC cores (core c: tiles c, c + n, ...; disjoint rows), and the ring of :data:`RING` tiles lets the gathers of
consecutive tiles overlap.

Layouts: ``table`` HBM ``[V, H]`` activation dtype (replicated, the decode layout); ``ids`` HBM ``[N, 1]`` int32,
run-time data in ``[0, V)`` -- the host refuses others before launching (:func:`nki_kernels.embedding.
check_token_ids` per 128 ids, as the prefill executor does); output ``x`` HBM ``[N, H]`` table dtype, token-major
(the residual of the chunk). The rows are bit-identical to the decode kernel's (the same gather).
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import INT32_MAX, P, kernel_assert, program_sharding
from nki_kernels.embedding import embedding_body

RING = 3        # ids / row tiles in flight per core


@nki.jit
def embedding_prefill_kernel(table, ids):
    """HBM wrapper: ``table [V, H]``, ``ids [N, 1]`` int32 -> ``x [N, H]`` (module docstring)."""
    V, H = table.shape
    kernel_assert(len(ids.shape) == 2 and ids.shape[1] == 1 and ids.dtype == nl.int32,
                  f"embedding_prefill: ids must be int32 [N, 1], got {ids.dtype}{list(ids.shape)}")
    N = ids.shape[0]
    kernel_assert(N * H <= INT32_MAX, f"embedding_prefill: x [{N}, {H}] has element offsets beyond int32")
    n_cores, core = program_sharding()
    out = nl.ndarray((N, H), table.dtype, buffer=nl.shared_hbm, name="embed_prefill_out")
    ring = []
    for i in range(RING):
        ring.append(nl.ndarray((P, 1), nl.int32, buffer=nl.sbuf, name="embed_prefill_ids"))
    k = 0
    for t0 in range(core * P, N, n_cores * P):
        nt = min(P, N - t0)
        ids_sb = ring[k % RING][0:nt, :]
        k = k + 1
        nisa.dma_copy(dst=ids_sb, src=ids[t0:t0 + nt, :])
        x = embedding_body(table, ids_sb)
        nisa.dma_copy(dst=out[t0:t0 + nt, :], src=x)
    return out
