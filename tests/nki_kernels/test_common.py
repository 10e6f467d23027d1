"""nki_kernels/common.py: the tile sizes are nl.tile_size's, the core-id helper, raising checks, stacked offsets."""

from __future__ import annotations

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels import common
from nki_kernels.host import feature_major, from_feature_major


def test_tile_sizes_are_nl_tile_size():
    assert common.P == nl.tile_size.pmax
    assert common.PSUM_BANK == nl.tile_size.psum_bank_fmax
    assert common.MOVING_MAX == nl.tile_size.gemm_moving_fmax
    assert common.STATIONARY_MAX == nl.tile_size.gemm_stationary_fmax
    for v in (common.P, common.PSUM_BANK, common.MOVING_MAX, common.STATIONARY_MAX):
        assert type(v) is int


def test_kernel_assert_raises_with_the_message():
    common.kernel_assert(True, "never")
    with pytest.raises(ValueError, match="gdn: q has 130 partitions"):
        common.kernel_assert(False, "gdn: q has 130 partitions, the partition dim is at most 128")


@nki.jit
def _whoami(x):
    n, c = common.program_sharding()
    out = nl.ndarray((n, 1, 2), nl.float32, buffer=nl.shared_hbm)
    t = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t[:, 0:1], value=float(n))
    nisa.memset(dst=t[:, 1:2], value=float(c))
    nisa.dma_copy(dst=out[c], src=t)
    return out


def test_program_sharding_with_and_without_a_grid():
    x = np.zeros((1, 1), np.float32)
    got = np.asarray(_whoami[2](x))
    assert got[:, 0].tolist() == [[2.0, 0.0], [2.0, 1.0]]
    assert np.asarray(_whoami(x))[0].tolist() == [[1.0, 0.0]]


@nki.jit
def _read_layer(t, layer):
    """Row 0 of layer ``layer`` of a stacked [L, 2, 4] tensor, once through the view and once through .ap()."""
    out = nl.ndarray((2, 1, 4), t.dtype, buffer=nl.shared_hbm)
    a = nl.ndarray((1, 4), t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=a, src=common.layer_of(t, layer)[0:1, :])
    b = nl.ndarray((1, 4), t.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=b, src=t.ap(pattern=[[4, 1], [1, 4]], offset=common.layer_offset(t, layer)))
    nisa.dma_copy(dst=out[0], src=a)
    nisa.dma_copy(dst=out[1], src=b)
    return out


def test_stacked_layer_view_and_offset_agree():
    t = np.arange(3 * 2 * 4, dtype=np.float32).reshape(3, 2, 4)
    got = np.asarray(_read_layer(t, 2))
    assert got[0].tolist() == got[1].tolist() == [t[2, 0].tolist()]
    with pytest.raises(ValueError, match="layer 3 is outside 0..2"):
        _read_layer(t, 3)


def test_feature_major_round_trip():
    x = np.random.default_rng(0).standard_normal((3, 256)).astype(np.float32)
    xT = feature_major(x)
    assert xT.shape == (128, 2, 3) and xT[5, 1, 2] == x[2, 128 + 5]
    assert np.array_equal(from_feature_major(xT), x)
    with pytest.raises(ValueError, match="not a multiple of 128"):
        feature_major(np.zeros((1, 100), np.float32))
