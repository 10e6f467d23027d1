"""The interpreter's fast paths give exactly what the general paths give: view construction, round-on-write,
lazily materialised storage (sentinel, written mask), the PSUM matmul-state bookkeeping, compute-into-dst, and the
first-fit on-chip allocator (a sweep over the live tensors that must place exactly like the reference candidate
search)."""
import warnings

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import dtypes
from nkisim import hw
from nkisim.memory import PSUM, SBUF, SHARED_HBM, RangeAllocator, Storage
from nkisim.tensor import NkiTensor, raw

F32 = np.float32


def _views(rng, onchip):
    st = Storage(SBUF if onchip else SHARED_HBM, (8, 6, 10), "float32", "t", True, 0)
    st.address = (0, 0)
    return st, NkiTensor.whole(st)


def _key(rng, shape):
    key = []
    for n in shape[:int(rng.integers(1, len(shape) + 1))]:
        c = rng.integers(4)
        if c == 0:
            key.append(int(rng.integers(-n, n)))
        elif c == 1:
            key.append(slice(None))
        else:
            a, b = sorted(int(x) for x in rng.integers(-n, n + 1, 2))
            key.append(slice(a, b))
    return tuple(key)


@pytest.mark.parametrize("onchip", [True, False])
def test_getitem_fast_path_equals_general(onchip):
    rng = np.random.default_rng(3)
    st, whole = _views(rng, onchip)
    raw(whole)                                            # parent numpy view cached -> children slice it
    for _ in range(2000):
        key = _key(rng, whole.shape)
        a = whole[key]
        b = whole._getitem(key)
        assert (a.shape, a.bstrides, a.boffset, a.size) == (b.shape, b.bstrides, b.boffset, b.size), key
        got, want = raw(a), np.ndarray(b.shape, dtype=F32, buffer=st.data, offset=b.boffset, strides=b.bstrides)
        assert got.shape == want.shape and got.strides == want.strides
        if want.size:
            assert got.__array_interface__["data"][0] == want.__array_interface__["data"][0]


@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float8_e4m3", "float8_e5m2", "float32", "int8", "uint16",
                                "int32"])
def test_write_rounding_equals_cast(dt):
    """write() assigns float values straight into float storage: same bits as dtypes.cast (one cast kernel)."""
    rng = np.random.default_rng(5)
    vals = np.concatenate([rng.standard_normal(200) * 10 ** rng.uniform(-8, 8, 200),
                           [np.nan, np.inf, -np.inf, 0.0, -0.0, 1e30, -1e30, 0.5, 1.5, 2.5, 65504.0, 448.0, 57344.0]])
    for src in (vals.astype(F32), vals.astype(np.float64)):
        @nki.jit
        def k(x):
            t = nl.ndarray((1, src.size), dt, buffer=nl.sbuf)
            from nkisim.isa.common import write
            write(t, src.reshape(1, -1))
            out = nl.ndarray(t.shape, dt, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=out, src=t)
            return out
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = k(np.zeros(1, F32))
            want = dtypes.cast(src.reshape(1, -1), dt)
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_fresh_storage_sentinel_and_written_mask():
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:2, :], src=x[0:2, :])        # partial first write: the rest keeps the sentinel
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out[0:2, :], src=t[0:2, :])
        i = nl.ndarray((2, 8), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=i[:, 0:4], value=1)
        o2 = nl.ndarray((2, 8), nl.int32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=o2[:, 0:4], src=i[:, 0:4])
        return out, o2
    x = np.arange(32, dtype=F32).reshape(4, 8)
    with pytest.warns(UserWarning, match="never-written|no instruction wrote|elements no instruction"):
        out, o2 = k(x)
    np.testing.assert_array_equal(out[0:2], x[0:2])
    assert np.isnan(out[2:]).all()
    assert (o2[:, 4:] == 4).all() and (o2[:, :4] == 1).all()

    @nki.jit
    def bad(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t[0:2, :], src=x[0:2, :])
        u = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t)
        return x
    with pytest.raises(nkisim.UninitializedReadError, match=r"element \[2, 0\]"):
        bad(x)

    @nki.jit
    def whole_then_part(x):
        t = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)                          # whole first write: no sentinel fill, full
        nisa.memset(dst=t[0:1, 2:4], value=-1.0)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    want = x.copy()
    want[0, 2:4] = -1
    np.testing.assert_array_equal(whole_then_part(x), want)


def test_psum_matmul_state_mixed_regions(rng):
    """Partial matmul / non-matmul writes of one PSUM tile: auto-accumulation follows the per-element state."""
    a = rng.standard_normal((32, 16)).astype(F32)
    b = rng.standard_normal((32, 64)).astype(F32)

    @nki.jit
    def k(a, b):
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        p = nl.ndarray((16, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p[:, 0:32], stationary=sa, moving=sb[:, 0:32])          # matmul-written left half
        nisa.memset(dst=p[:, 32:64], value=0.0)                                     # non-matmul right half
        nisa.nc_matmul(dst=p, stationary=sa, moving=sb)                             # auto: left acc, right overwrite
        nisa.nc_matmul(dst=p[:, 32:64], stationary=sa, moving=sb[:, 32:64])         # right now matmul-written: acc
        nisa.nc_matmul(dst=p[:, 0:16], stationary=sa, moving=sb[:, 0:16], accumulate=False)
        nisa.nc_matmul(dst=p, stationary=sa, moving=sb, accumulate=True)
        o = nl.ndarray((16, 64), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=o, src=p)
        out = nl.ndarray((16, 64), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    r = a.T @ b
    want = r.copy()
    want[:, 0:32] *= 2                      # left: written twice, then +1 below
    want[:, 32:64] *= 2                     # right: overwrite, then accumulate
    want[:, 0:16] = r[:, 0:16]              # reset by accumulate=False
    want += r                               # accumulate=True everywhere
    np.testing.assert_allclose(k(a, b), want, rtol=1e-5, atol=1e-5)

    @nki.jit
    def stray(a, b):
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        p = nl.ndarray((16, 64), nl.float32, buffer=nl.psum)
        nisa.memset(dst=p[:, 0:8], value=1.0)
        nisa.nc_matmul(dst=p, stationary=sa, moving=sb)
        return a
    with pytest.warns(UserWarning, match="non-zero values written by a non-matmul"):
        stray(a, b)


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_compute_into_dst_overlapping_views(dt):
    """tensor_tensor / tensor_scalar whose dst overlaps a source (shifted) read the sources as they were."""
    x = (np.arange(2 * 16, dtype=F32).reshape(2, 16) / 7).astype(dtypes.storage(dt))

    @nki.jit
    def k(x):
        t = nl.ndarray((2, 16), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.tensor_tensor(dst=t[:, 1:9], data1=t[:, 0:8], data2=t[:, 2:10], op=nl.add)
        nisa.tensor_scalar(dst=t[:, 8:16], data=t[:, 7:15], op0=nl.multiply, operand0=3.0, op1=nl.subtract,
                           operand1=1.0)
        out = nl.ndarray((2, 16), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    t = x.astype(F32)
    t[:, 1:9] = t[:, 0:8] + t[:, 2:10]
    t = t.astype(x.dtype).astype(F32)
    t[:, 8:16] = t[:, 7:15].copy() * F32(3) - F32(1)
    np.testing.assert_array_equal(k(x).astype(F32), t.astype(x.dtype).astype(F32))


def _reference_first_fit(alloc, size, prange):
    """The original candidate search: 0 and every live end (aligned, bank rules), lowest that fits."""
    a, b = alloc.align, alloc.bank
    starts = [0] + sorted(e for e, _, _ in alloc.live.values())
    for s in starts:
        s = -(-s // a) * a
        if b:
            if size <= b:
                if s // b != (s + size - 1) // b:
                    s = -(-s // b) * b
            else:
                s = -(-s // b) * b
        if s + size <= alloc.capacity and alloc._fits(s, s + size, prange):
            return s
    return None


@pytest.mark.parametrize("kind", ["sbuf", "psum"])
def test_first_fit_sweep_matches_reference(kind):
    rng = np.random.default_rng(7)
    if kind == "sbuf":
        alloc = RangeAllocator(SBUF, 4096, hw.SBUF_MIN_ALIGN)
        sizes = lambda: int(rng.integers(1, 700))
    else:
        alloc = RangeAllocator(PSUM, hw.PSUM_PARTITION_BYTES, hw.PSUM_MIN_ALIGN, bank=hw.PSUM_BANK_BYTES)
        sizes = lambda: int(rng.choice([4, 8, 64, 512, 1000, 2048, 3000, 4096]))
    live = []
    for step in range(3000):
        if live and rng.random() < 0.45:
            lo, p0 = live.pop(int(rng.integers(len(live))))
            alloc.free(lo, p0)
            continue
        size = sizes()
        p0 = int(rng.choice([0, 0, 0, 32, 64]))
        prange = (p0, p0 + int(rng.integers(1, 129 - p0)))
        want = _reference_first_fit(alloc, size, prange)
        got = alloc._first_fit(size, prange)
        assert got == want, (step, size, prange, got, want)
        if got is not None:
            alloc.allocate(size, f"t{step}", prange)
            live.append((got, p0))


def test_same_byte_offset_disjoint_partitions():
    """Two tensors at the same byte offset on disjoint partitions (address=) are both tracked and freed."""
    alloc = RangeAllocator(SBUF, 4096, 1)
    alloc.allocate(100, "a", (0, 64), fixed=0)
    alloc.allocate(100, "b", (64, 128), fixed=0)
    with pytest.raises(nkisim.errors.AllocationError, match="overlaps"):
        alloc.allocate(10, "c", (0, 128), fixed=50)
    alloc.free(0, 0)
    assert alloc._first_fit(100, (0, 64)) == 0
    assert alloc._first_fit(100, (0, 128)) == 100
