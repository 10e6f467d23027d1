"""Embedding gather kernel (nki_kernels/embedding.py) vs its PyTorch twin (model/tp/embed_head.embed).

Tolerance: none -- a same-dtype DMA gather moves bits, so the rows must be bit-identical."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from compare import assert_finite_nonzero
from model.config import preset
from model.params import random_params
from model.tp import embed_head as eh
from nki_kernels import embedding as emb


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def tiny(request):
    cfg = preset("tiny")
    return cfg, random_params(cfg, seed=5, dtype=request.param, include_mtp=False)


def _ids(V, T, seed=0):
    ids = torch.randint(0, V, (T,), generator=torch.Generator().manual_seed(seed))
    ids[0] = 0
    ids[-1] = V - 1
    return ids


@pytest.mark.parametrize("lnc", [1, 2])
@pytest.mark.parametrize("T", [1, 2, 4])
def test_tiny_matches_twin(tiny, T, lnc):
    cfg, p = tiny
    table = p["model.embed_tokens.weight"]
    ids = _ids(cfg.vocab_size, T, seed=T)
    out = emb.embed_tokens(table, ids, lnc=lnc)             # torch in -> torch out
    assert out.shape == (lnc, T, cfg.hidden_size) and out.dtype == table.dtype
    ref = eh.embed(p, ids)
    for c in range(lnc):                                    # every core holds its own residual copy
        assert torch.equal(out[c], ref)
    assert_finite_nonzero(out, "embedding rows")


def test_repeated_ids_and_numpy_io():
    V, H = 300, 256
    table = np.random.default_rng(0).standard_normal((V, H)).astype(np.float32)
    ids = np.array([7, 7, V - 1, 0], np.int64)
    out = emb.embed_tokens(table, ids)
    assert isinstance(out, np.ndarray)
    np.testing.assert_array_equal(out[0], table[ids])


@pytest.mark.parametrize("T", [2, 4])
def test_real_hidden_rows_bit_exact(T):
    """Real hidden size (2048, bf16), LNC=2, on a 4096-row table (the full table's data run is slow, below)."""
    V, H = 4096, preset("qwen3.6-35b-a3b").hidden_size
    table = emb.pattern_table(V, H, "bfloat16", period=V)
    ids = _ids(V, T, seed=T).numpy()
    out = emb.embed_tokens(table, ids, lnc=2)
    for c in range(2):
        np.testing.assert_array_equal(out[c].view(np.uint16), table[ids].view(np.uint16))


def test_real_vocab_shape_only_and_refusal():
    """The real (replicated) table [248320, 2048] bf16 without data: ids 0 and V-1 pass validation and
    trace; V is refused before launching."""
    cfg = preset("qwen3.6-35b-a3b")
    V, H = cfg.vocab_size, cfg.hidden_size
    table = nkisim.ShapeDtype((V, H), "bfloat16")
    out = emb.embed_tokens(table, np.array([0, V - 1]), lnc=2)
    assert out == nkisim.ShapeDtype((2, 2, H), "bfloat16")
    with nkisim.trace.capture() as tr:
        with pytest.raises(ValueError, match=rf"token id {V} at position 1 is outside the vocabulary \[0, {V}\)"):
            emb.embed_tokens(table, np.array([0, V]), lnc=2)
    assert tr.instructions == []


@pytest.mark.slow
def test_real_vocab_row_ids_0_and_last():
    """Real per-rank shapes with data: the full (replicated) 248320 x 2048 bf16 table (1 GiB; nkisim copies
    it into HBM, 5-20 s), T = 2, ids 0 and V-1, LNC=2."""
    cfg = preset("qwen3.6-35b-a3b")
    V, H = cfg.vocab_size, cfg.hidden_size
    table = emb.pattern_table(V, H, "bfloat16")
    table[V - 1] = np.arange(H, dtype=np.float32) / 64           # a row unlike any other
    ids = np.array([0, V - 1], np.int32)
    out = emb.embed_tokens(table, ids, lnc=2)
    for c in range(2):
        np.testing.assert_array_equal(out[c].view(np.uint16), table[ids].view(np.uint16))
    assert_finite_nonzero(out.astype(np.float32), "embedding rows")


@pytest.mark.slow
@pytest.mark.parametrize("T", [1, 4])
def test_real_vocab_sweep(T):
    cfg = preset("qwen3.6-35b-a3b")
    table = emb.pattern_table(cfg.vocab_size, cfg.hidden_size, "bfloat16", period=1009)
    ids = _ids(cfg.vocab_size, T, seed=11).numpy()
    out = emb.embed_tokens(table, ids, lnc=2)
    np.testing.assert_array_equal(out[1].view(np.uint16), table[ids].view(np.uint16))


@pytest.mark.parametrize("bad, pos", [([3, 272], 1), ([-1, 4], 0), ([5, 6, 2 ** 31 - 1], 2)])
def test_out_of_range_ids_refused_before_any_dma(bad, pos):
    """The host wrapper refuses the ids before launching: no instruction (in particular no DMA) runs."""
    V, H = 272, 128
    table = np.ones((V, H), np.float32)
    with nkisim.trace.capture() as tr:
        with pytest.raises(ValueError, match=rf"token id {bad[pos]} at position {pos} is outside the vocabulary "
                                             rf"\[0, {V}\); refused before launching"):
            emb.embed_tokens(table, np.array(bad, np.int64), lnc=2)
    assert tr.instructions == []


def test_bad_id_arrays_refused():
    table = np.ones((16, 128), np.float32)
    with pytest.raises(TypeError, match="must be integers"):
        emb.embed_tokens(table, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"shape \[T\] with 1 <= T <= 128"):
        emb.embed_tokens(table, np.zeros((129,), np.int32))
    with pytest.raises(ValueError, match=r"shape \[T\] with 1 <= T <= 128"):
        emb.embed_tokens(table, np.zeros((0,), np.int32))


def test_device_oob_net_faults_the_gather():
    """Launched directly (no host check) the gather's oob_mode=error faults instead of reading past the
    table; the ids DMA has run by then, which is why the host wrapper is the refusal."""
    table = np.ones((16, 128), np.float32)
    with nkisim.trace.capture() as tr:
        with pytest.raises(nkisim.OutOfBoundsError, match="oob_mode=error"):
            emb.embedding_kernel(table, np.array([2, 16], np.int32))
    assert [i["op"] for i in tr.instructions] == ["dma_copy", "dma_copy"]     # ids load, then the faulting gather


@nki.jit
def _rows_one_id_each(table, ids):
    """Each id in a 1x1 tile of its own, gathered into its row of one [T, H] tile (``embedding_body(dst=)``: scalar
    indirection, the verify's per-draft rows)."""
    T, H = ids.shape[0], table.shape[1]
    out = nl.ndarray((T, H), table.dtype, buffer=nl.shared_hbm, name="rows_out")
    x = nl.ndarray((T, H), table.dtype, buffer=nl.sbuf, name="rows")
    for t in range(T):
        emb.embedding_body(table, emb.load_token_ids(ids[t:t + 1, :]), x[t:t + 1, :])
    nisa.dma_copy(dst=out, src=x)
    return out


def test_rows_gathered_one_id_tile_at_a_time():
    V, H = 300, 256
    table = np.random.default_rng(1).standard_normal((V, H)).astype(np.float32)
    ids = np.array([[V - 1], [0], [17], [17]], np.int32)
    out = _rows_one_id_each(table, ids)
    np.testing.assert_array_equal(out, table[ids[:, 0]])
    assert np.isfinite(out).all() and np.abs(out).sum() > 0


@nki.jit
def _two_ids_into_rows(table, ids):
    x = nl.ndarray((4, table.shape[1]), table.dtype, buffer=nl.sbuf, name="rows")
    emb.embedding_body(table, emb.load_token_ids(ids), x[2:4, :])
    return x


def test_dst_takes_one_id_only():
    with pytest.raises(ValueError, match="one-id tile"):
        _two_ids_into_rows(np.ones((16, 128), np.float32), np.array([1, 2], np.int32))


def test_kernel_argument_checks():
    table = np.ones((16, 128), np.float32)
    with pytest.raises(TypeError, match="must be int32"):
        emb.embedding_kernel(table, np.array([1, 2], np.uint16))


def shape_only_launch(cfg, T=2, dtype="bfloat16"):
    """(kernel, args) of one rank at the config's shapes: ``embedding_kernel[2]`` over the full (replicated)
    table ``[V, H]`` and T token ids, ``nkisim.ShapeDtype`` tensors."""
    return emb.embedding_kernel[2], (nkisim.ShapeDtype((cfg.vocab_size, cfg.hidden_size), dtype),
                                     nkisim.ShapeDtype((T,), "int32"))


def test_real_shape_trace_reads_only_the_gathered_rows():
    """Shape-only trace at real shapes: per core one ids load (T*4 B), one gather reading T*H*2 B of
    the table (the minimum the math needs) and one store."""
    cfg = preset("qwen3.6-35b-a3b")
    T = 2
    kernel, args = shape_only_launch(cfg, T=T)
    with nkisim.trace.capture() as tr:
        kernel(*args)
    assert tr.summary() == {("DMA", "dma_copy"): 6}
    gathers = [i for i in tr.instructions if any(r.get("indirect") == "vector" for r in i["reads"])]
    assert len(gathers) == 2
    for g in gathers:
        assert g["bytes"]["shared_hbm"]["read"] == T * cfg.hidden_size * 2
