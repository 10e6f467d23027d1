"""nki_kernels/embedding_prefill.py: the chunk's embedding rows in one launch, against table[ids] (a gather is
exact: bit for bit), at chunk lengths around the 128-token tiles and both LNC degrees, plus a shape-only trace at
the real vocabulary and hidden size."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nkisim
from nki_kernels.embedding_prefill import embedding_prefill_kernel


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("N", [1, 127, 128, 129, 300, 513])
def test_rows_equal_the_table_rows(N, lnc):
    V, H = 1000, 256
    g = torch.Generator().manual_seed(N)
    table = torch.randn(V, H, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, V, (N, 1), generator=g, dtype=torch.int32)
    ids[0, 0], ids[-1, 0] = 0, V - 1                        # both ends of the table
    kern = embedding_prefill_kernel[lnc] if lnc > 1 else embedding_prefill_kernel
    out = torch.as_tensor(kern(table, ids.numpy()))
    want = table[ids[:, 0].long()]
    assert out.shape == (N, H) and out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))
    assert torch.isfinite(out.float()).all() and (out != 0).any()


def test_out_of_range_id_faults():
    """An id outside [0, V) faults the gather (oob_mode.error) instead of reading another row (the host refuses
    such ids before launching; this is the device net)."""
    table = torch.randn(100, 128).to(torch.bfloat16)
    ids = np.zeros((130, 1), np.int32)
    ids[129, 0] = 100
    with pytest.raises(Exception, match="(?i)out of bounds|oob|outside|range"):
        embedding_prefill_kernel[2](table, ids)


def test_real_shapes_shape_only():
    """Real vocabulary and hidden size, a 4K chunk, shape-only: the launch moves exactly the chunk's rows (read
    from the table, written out) and its ids."""
    from model.config import preset
    cfg = preset("qwen3.6-35b-a3b")
    V, H, N = cfg.vocab_size, cfg.hidden_size, 4096
    with nkisim.trace.capture() as tr:
        embedding_prefill_kernel[2](nkisim.ShapeDtype((V, H), "bfloat16"), np.zeros((N, 1), np.int32))
    dma = [r for r in tr.instructions if r["op"] == "dma_copy"]
    read = sum(r["bytes"].get("shared_hbm", {}).get("read", 0) for r in dma)
    written = sum(r["bytes"].get("shared_hbm", {}).get("write", 0) for r in dma)
    assert (read, written) == (N * H * 2 + N * 4, N * H * 2)    # rows gathered + ids, rows written
    assert len(dma) == 3 * (N // 128)                           # per tile: ids, gather, rows out
