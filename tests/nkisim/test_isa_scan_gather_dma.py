"""ISA scans, statistics, gathers, top-k, DMA transpose / compute and matmul modes vs numpy, with a refusal test for
every documented constraint: tensor_tensor_scan, tensor_scalar_cumulative, tensor_scalar_reduce, range_select,
bn_stats/bn_aggr, local_gather, nc_n_gather, nc_stream_shuffle, topk, nonzero_with_count, dma_transpose,
dma_compute, nc_matmul(is_transpose / double_row)."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import NkiValidationError
from nkisim_helpers import run_op

F32 = np.float32
BF16 = ml_dtypes.bfloat16
FP32_MIN = float(np.finfo(np.float32).min)


def refuses(body, inputs, out_shape, out_dtype, match):
    with pytest.raises(NkiValidationError, match=match):
        run_op(body, inputs, out_shape, out_dtype)


def sb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


# ---- tensor_tensor_scan ----------------------------------------------------------------------
def test_tensor_tensor_scan_cumsum_and_reverse(rng):
    a = rng.standard_normal((8, 32)).astype(F32)
    b = rng.standard_normal((8, 32)).astype(F32)
    init = rng.standard_normal((8, 1)).astype(F32)

    def cumsum(d0, d1, o):
        nisa.tensor_tensor_scan(dst=o, data0=d0, data1=d1, initial=0.5, op0=nl.multiply, op1=nl.add)
    out = run_op(cumsum, [np.ones_like(a), b], (8, 32), nl.float32)
    want, r = np.empty_like(b), np.full(8, 0.5, F32)
    for i in range(32):
        r = (r + b[:, i]).astype(F32)
        want[:, i] = r
    np.testing.assert_array_equal(out, want)

    def rev(d0, d1, ini, o):
        nisa.tensor_tensor_scan(dst=o, data0=d0, data1=d1, initial=ini, op0=nl.subtract, op1=nl.subtract,
                                reverse0=True, reverse1=True)
    out = run_op(rev, [a, b, init], (8, 32), nl.float32)
    r = init[:, 0].copy()
    for i in range(32):
        r = (b[:, i] - (r - a[:, i])).astype(F32)       # op0(r, a) then op1(b, t)
        want[:, i] = r
    np.testing.assert_array_equal(out, want)


def test_tensor_tensor_scan_refusals(rng):
    x = rng.standard_normal((4, 8)).astype(F32)
    refuses(lambda a, b, o: nisa.tensor_tensor_scan(dst=o, data0=a, data1=b, initial=0.0, op0=nl.bitwise_and,
                                                    op1=nl.add), [x, x], (4, 8), nl.float32, "not a valid ALU operator")

    def int_init(a, b, o):
        t = sb((4, 1), nl.bfloat16)
        nisa.memset(dst=t, value=0.0)
        nisa.tensor_tensor_scan(dst=o, data0=a, data1=b, initial=t, op0=nl.add, op1=nl.add)
    refuses(int_init, [x, x], (4, 8), nl.float32, "initial tile must be float32")

    def psum2(a, b, o):
        p1, p2 = nl.ndarray((4, 8), nl.float32, buffer=nl.psum), nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p1, src=a)
        nisa.tensor_copy(dst=p2, src=b)
        nisa.tensor_tensor_scan(dst=o, data0=p1, data1=p2, initial=0.0, op0=nl.add, op1=nl.add)
    refuses(psum2, [x, x], (4, 8), nl.float32, "both in psum")


# ---- tensor_scalar_cumulative ----------------------------------------------------------------
def test_tensor_scalar_cumulative(rng):
    x = rng.standard_normal((6, 16)).astype(F32)

    def body(a, o):
        t = sb((6, 16))
        nisa.tensor_scalar_cumulative(dst=t, src=a, op0=nl.multiply, op1=nl.add, imm0=2.0)
        nisa.tensor_scalar_cumulative(dst=o[:, 0:8], src=a[:, 0:8], op0=nl.add, op1=nl.maximum, imm0=0.0,
                                      imm1=-1.0, reduce_cmd=nisa.reduce_cmd.load_reduce)
        nisa.tensor_scalar_cumulative(dst=o[:, 8:16], src=a[:, 8:16], op0=nl.add, op1=nl.maximum, imm0=0.0,
                                      reduce_cmd=nisa.reduce_cmd.reduce)       # continues from the registers
        nisa.tensor_tensor(dst=o, data1=o, data2=t, op=nl.subtract)
    out = run_op(body, [x], (6, 16), nl.float32)
    c = np.empty_like(x)
    acc = np.zeros(6, F32)
    for i in range(16):
        acc = (x[:, i] * F32(2) + acc).astype(F32)
        c[:, i] = acc
    m = np.maximum.accumulate(np.concatenate([np.full((6, 1), -1, F32), x], axis=1), axis=1)[:, 1:]
    np.testing.assert_array_equal(out, (m - c).astype(F32))


def test_tensor_scalar_cumulative_refusals(rng):
    x = rng.integers(0, 5, (4, 8)).astype(np.int32)
    refuses(lambda a, o: nisa.tensor_scalar_cumulative(dst=o, src=a, op0=nl.add, op1=nl.add, imm0=1.0),
            [x], (4, 8), nl.int32, "INT32/UINT32 are an ISA limitation")
    y = x.astype(F32)
    refuses(lambda a, o: nisa.tensor_scalar_cumulative(dst=o, src=a, op0=nl.add, op1=nl.power, imm0=1.0),
            [y], (4, 8), nl.float32, "op1=nl.power is not a valid ALU operator|op1=nl.power is not supported")
    refuses(lambda a, o: nisa.tensor_scalar_cumulative(dst=o, src=a, op0=nl.add, op1=nl.add, imm0=1.0,
                                                       reduce_cmd=nisa.reduce_cmd.load_reduce),
            [y], (4, 8), nl.float32, "needs imm1")
    refuses(lambda a, o: nisa.tensor_scalar_cumulative(dst=o, src=a, op0=nl.add, op1=nl.add, imm0=1.0, imm1=2.0),
            [y], (4, 8), nl.float32, "imm1 is only used with reduce_cmd=load_reduce")
    refuses(lambda a, o: nisa.tensor_scalar_cumulative(dst=o, src=a, op0=nl.add, op1=nl.add, imm0=1.0,
                                                       reduce_cmd=nisa.reduce_cmd.idle),
            [y], (4, 8), nl.float32, "reduce_cmd=idle is not supported")


# ---- tensor_scalar_reduce --------------------------------------------------------------------
def test_tensor_scalar_reduce(rng):
    x = rng.standard_normal((8, 24)).astype(F32)
    col = rng.standard_normal((8, 1)).astype(F32)

    def body(a, c, o):
        r1, r2 = sb((8, 1)), sb((8, 1))
        y = sb((8, 24))
        nisa.tensor_scalar_reduce(dst=y, data=a, op0=nl.add, operand0=c, reduce_op=nl.maximum, reduce_res=r1)
        nisa.tensor_scalar_reduce(dst=y, data=a, op0=nl.multiply, operand0=0.5, reduce_op=nl.add,
                                  reduce_cmd=nisa.reduce_cmd.load_reduce, reduce_init=10.0)
        nisa.tensor_scalar_reduce(dst=y, data=a, op0=nl.multiply, operand0=0.5, reduce_op=nl.add, reduce_res=r2,
                                  reduce_cmd=nisa.reduce_cmd.reduce, reduce_res_negate=True)
        nisa.tensor_copy(dst=o[:, 0:1], src=r1)
        nisa.tensor_copy(dst=o[:, 1:2], src=r2)
        nisa.tensor_copy(dst=o[:, 2:26], src=y)
    out = run_op(body, [x, col], (8, 26), nl.float32)
    np.testing.assert_array_equal(out[:, 0], (x + col).max(axis=1))
    half = (x * F32(0.5)).astype(F32)
    s = np.sum(half, axis=1, dtype=F32)
    np.testing.assert_allclose(out[:, 1], -((F32(10) + s) + s), rtol=1e-6)
    np.testing.assert_array_equal(out[:, 2:], half)


def test_tensor_scalar_reduce_refusals(rng):
    x = rng.standard_normal((4, 8)).astype(F32)
    refuses(lambda a, o: nisa.tensor_scalar_reduce(dst=o, data=a, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                                   reverse0=True), [x], (4, 8), nl.float32, "reverse0=True")
    refuses(lambda a, o: nisa.tensor_scalar_reduce(dst=o, data=a, op0=nl.add, operand0=1.0, reduce_op=nl.subtract),
            [x], (4, 8), nl.float32, "reduce_op must be nl.add, nl.multiply")
    refuses(lambda a, o: nisa.tensor_scalar_reduce(dst=o, data=a, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                                   reduce_init=1.0), [x], (4, 8), nl.float32, "reduce_init must be given")
    refuses(lambda a, o: nisa.tensor_scalar_reduce(dst=o, data=a, op0=nl.bitwise_or, operand0=1, reduce_op=nl.add),
            [x], (4, 8), nl.float32, "not a valid ALU operator")
    refuses(lambda a, o: nisa.tensor_scalar_reduce(dst=o, data=a, op0=nl.add, operand0=1.0, reduce_op=nl.add,
                                                   reduce_res=sb((4, 2))), [x], (4, 8), nl.float32, r"expected \(4, 1\)")


# ---- range_select ----------------------------------------------------------------------------
def test_range_select(rng):
    x = rng.standard_normal((8, 40)).astype(F32)
    lo = rng.integers(0, 20, (8, 1)).astype(F32) + 100
    hi = lo + rng.integers(0, 20, (8, 1)).astype(F32)

    def body(a, b0, b1, o):
        r = sb((8, 1))
        nisa.range_select(dst=o[:, 0:40], on_true_tile=a, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0,
                          bound1=b1, reduce_res=r, range_start=100, on_false_value=FP32_MIN)
        nisa.tensor_copy(dst=o[:, 40:41], src=r)
    out = run_op(body, [x, lo, hi], (8, 41), nl.float32)
    idx = np.arange(40, dtype=F32)[None, :] + 100
    m = (idx >= lo) & (idx < hi)
    want = np.where(m, x, F32(FP32_MIN))
    np.testing.assert_array_equal(out[:, :40], want)
    np.testing.assert_array_equal(out[:, 40], want.max(axis=1))


def test_range_select_refusals(rng):
    x = rng.standard_normal((4, 8)).astype(F32)
    b = np.zeros((4, 1), F32)

    def sel(**kw):
        def body(a, b0, b1, o):
            args = dict(dst=o, on_true_tile=a, comp_op0=nl.greater_equal, comp_op1=nl.less, bound0=b0, bound1=b1)
            args.update(kw)
            nisa.range_select(**args)
        return body
    refuses(sel(on_false_value=0.0), [x, b, b], (4, 8), nl.float32, "on_false_value must be FP32_MIN")
    refuses(sel(comp_op0=nl.add), [x, b, b], (4, 8), nl.float32, "comp_op0 must be one of")
    refuses(sel(reduce_op=nl.add), [x, b, b], (4, 8), nl.float32, "reduce_op must be nl.maximum")
    refuses(sel(bound0=1.0), [x, b, b], (4, 8), nl.float32, "bound0 must be a")
    refuses(sel(), [x.astype(np.int32), b, b], (4, 8), nl.float32, "must have a float dtype")
    refuses(sel(range_start=2 ** 24), [x, b, b], (4, 8), nl.float32, "2\\^24")


# ---- bn_stats / bn_aggr ----------------------------------------------------------------------
def test_bn_stats_aggr(rng):
    x = (rng.standard_normal((16, 300)) * 3 + 1).astype(F32)

    def body(a, o):
        st = sb((16, 12))
        nisa.bn_stats(dst=st[:, 0:6], data=a[:, 0:150])
        nisa.bn_stats(dst=st[:, 6:12], data=a[:, 150:300])
        nisa.bn_aggr(dst=o[:, 0:2], data=st)
        nisa.tensor_copy(dst=o[:, 2:8], src=st[:, 0:6])
    out = run_op(body, [x], (16, 8), nl.float32)
    np.testing.assert_allclose(out[:, 0], x.mean(axis=1), rtol=1e-5)
    np.testing.assert_allclose(out[:, 1], x.var(axis=1), rtol=1e-4)
    ev = x[:, 0:150:2]
    np.testing.assert_allclose(out[:, 2:5], np.stack([np.full(16, 75.0), ev.mean(1), ev.var(1) * 75], 1), rtol=1e-4)


def test_bn_refusals(rng):
    x = rng.standard_normal((4, 513)).astype(F32)
    refuses(lambda a, o: nisa.bn_stats(dst=o, data=a), [x], (4, 6), nl.float32, "at most 512")
    refuses(lambda a, o: nisa.bn_stats(dst=o, data=a[:, 0:8]), [x], (4, 5), nl.float32, "6 elements")
    refuses(lambda a, o: nisa.bn_aggr(dst=o, data=a[:, 0:7]), [x], (4, 2), nl.float32, "multiple of 3")
    refuses(lambda a, o: nisa.bn_aggr(dst=o, data=a[:, 0:6]), [x], (4, 3), nl.float32, "2 elements")


# ---- local_gather / nc_n_gather ---------------------------------------------------------------
def test_local_gather_matches_sdk_numpy_semantics(rng):
    src = rng.standard_normal((32, 64, 4)).astype(F32)
    per_core = rng.integers(0, 64, (16, 2)).astype(np.uint16)
    index = np.tile(per_core, (2, 1))
    e, nv = 4, 24
    out = run_op(lambda s, i, o: nisa.local_gather(dst=o, src_buffer=s, index=i, num_elem_per_idx=e,
                                                   num_valid_indices=nv),
                 [src.reshape(32, 256), (index * e).astype(np.uint16)], (32, nv * e), nl.float32)
    want = np.empty((32, nv, e), F32)
    for c in range(2):
        sl = slice(16 * c, 16 * c + 16)
        ids = index[sl].flatten(order="F")[:nv]
        want[sl] = np.take(src[sl], ids, axis=1)
    np.testing.assert_array_equal(out, want.reshape(32, -1))


def test_local_gather_refusals(rng):
    s = rng.standard_normal((32, 16)).astype(F32)
    i16 = np.zeros((32, 1), np.uint16)
    lg = lambda **kw: (lambda a, b, o: nisa.local_gather(dst=o, src_buffer=a, index=b, **kw))  # noqa: E731
    refuses(lg(), [s, i16.astype(np.uint32)], (32, 16), nl.float32, "index must be uint16")
    refuses(lg(), [s[:24], i16[:24]], (24, 16), nl.float32, "multiple of 16")
    refuses(lg(num_elem_per_idx=3), [s, i16], (32, 48), nl.float32, "num_elem_per_idx must be one of")
    refuses(lg(), [s, i16], (32, 4), nl.float32, "expected 32 partitions x 16 elements")
    refuses(lg(num_valid_indices=17), [s, i16], (32, 17), nl.float32, "must be an int in 1..16")
    refuses(lg(), [s, i16 + 20], (32, 16), nl.float32, "outside the 16 elements")


def test_nc_n_gather(rng):
    x = rng.standard_normal((8, 4, 16)).astype(F32)
    idx = rng.integers(0, 64, (8, 10)).astype(np.uint32)
    out = run_op(lambda d, i, o: nisa.nc_n_gather(dst=o, data=d, indices=i), [x.reshape(8, 64), idx], (8, 10),
                 nl.float32)
    np.testing.assert_array_equal(out, np.take_along_axis(x.reshape(8, 64), idx.astype(np.int64), axis=1))
    g = lambda d, i, o: nisa.nc_n_gather(dst=o, data=d, indices=i)  # noqa: E731
    refuses(g, [x.reshape(8, 64), idx.astype(np.int32)], (8, 10), nl.float32, "indices must be uint32")
    refuses(g, [x.reshape(8, 64), idx], (8, 10), nl.bfloat16, "must equal data dtype")
    refuses(g, [x.reshape(8, 64), idx], (8, 9), nl.float32, "must match")
    refuses(g, [x.reshape(8, 64), idx + 64], (8, 10), nl.float32, r"outside \[0, 64\)")


# ---- nc_stream_shuffle -----------------------------------------------------------------------
def test_nc_stream_shuffle(rng):
    x = rng.standard_normal((64, 8)).astype(F32)
    mask = [31 - i for i in range(32)]
    mask[5] = 255

    def body(a, o):
        nisa.memset(dst=o, value=7.0)
        nisa.nc_stream_shuffle(dst=o, src=a, shuffle_mask=mask)
    out = run_op(body, [x], (64, 8), nl.float32)
    for q in range(2):
        for i in range(32):
            want = np.full(8, 7, F32) if i == 5 else x[32 * q + 31 - i]
            np.testing.assert_array_equal(out[32 * q + i], want)


def test_nc_stream_shuffle_refusals(rng):
    x = rng.standard_normal((64, 8)).astype(F32)
    sh = lambda m, sl=slice(0, 64): (lambda a, o: nisa.nc_stream_shuffle(dst=o, src=a[sl], shuffle_mask=m))  # noqa
    refuses(sh(list(range(31))), [x], (64, 8), nl.float32, "32 entries")
    refuses(sh([40] * 32), [x], (64, 8), nl.float32, "32 entries in 0..31")
    refuses(sh(list(range(32)), slice(16, 48)), [x], (32, 8), nl.float32, "starts at partition 16")
    refuses(sh(list(range(32))), [x], (64, 8), nl.bfloat16, "must equal src dtype")


# ---- topk ------------------------------------------------------------------------------------
def test_topk_snake_layout(rng):
    n, K = 100, 20
    vals = np.stack([rng.permutation(256)[:n] for _ in range(2)]).astype(F32)    # distinct, exact in bf16
    src = np.full((32, 8), -1.0, F32)
    for g in range(2):
        for i in range(n):
            src[16 * g + i % 16, i // 16] = vals[g, i]

    def body(s, o):
        v = sb((32, K), nl.bfloat16)
        i = sb((32, K), nl.uint32)
        nisa.memset(dst=v, value=0.0)
        nisa.memset(dst=i, value=0)
        nisa.topk(val_dst=v, idx_dst=i, src=s, n=n)
        nisa.tensor_copy(dst=o[:, 0:K], src=v)
        nisa.tensor_copy(dst=o[:, K:2 * K], src=i)
    out = run_op(body, [src.astype(BF16)], (32, 2 * K), nl.float32)
    for g in range(2):
        order = np.argsort(-vals[g])[:K][::-1]                    # ascending top-K
        for j, s_idx in enumerate(order):
            p, c = 16 * g + j % 16, j // 16
            assert out[p, c] == vals[g, s_idx] and out[p, K + c] == s_idx
        assert (out[16 * g:16 * g + 16, 2:K] == 0).all()         # only ceil(K/16) = 2 columns written


def test_topk_refusals(rng):
    s = rng.standard_normal((16, 8)).astype(BF16)

    def tk(n, K=8, vdt=nl.bfloat16, idt=nl.uint32):
        def body(a, o):
            nisa.topk(val_dst=sb((a.shape[0], K), vdt), idx_dst=sb((a.shape[0], K), idt), src=a, n=n)
            nisa.memset(dst=o, value=0.0)
        return body
    refuses(tk(7), [s], (16, 1), nl.float32, "8 <= n < 65536")
    refuses(tk(200), [s], (16, 1), nl.float32, "ceil\\(n / 16\\)")
    refuses(tk(8, K=9), [s], (16, 1), nl.float32, "K <= n")
    refuses(tk(64, idt=nl.int32), [s], (16, 1), nl.float32, "idx_dst must be uint32")
    refuses(tk(64, vdt=nl.float32), [s], (16, 1), nl.float32, "must be bfloat16")
    refuses(tk(64), [s.astype(F32)], (16, 1), nl.float32, "must be bfloat16")
    refuses(tk(64), [rng.standard_normal((8, 8)).astype(BF16)], (8, 1), nl.float32, "multiple of 16")


# ---- nonzero_with_count ----------------------------------------------------------------------
def test_nonzero_with_count(rng):
    x = (rng.random((32, 12)) < 0.4).astype(np.int32) * rng.integers(1, 9, (32, 12)).astype(np.int32)

    def body(a, o):
        nisa.memset(dst=o, value=99)
        nisa.nonzero_with_count(dst=o, src=a, index_offset=16, padding_val=-1)
    out = run_op(body, [x], (32, 13), nl.int32)
    for p in range(32):
        if p % 16:
            assert (out[p] == 99).all()
            continue
        nz = np.flatnonzero(x[p])
        want = np.full(13, -1)
        want[:len(nz)] = nz + 16
        want[12] = len(nz)
        np.testing.assert_array_equal(out[p], want)
    refuses(lambda a, o: nisa.nonzero_with_count(dst=o, src=a), [x], (32, 12), nl.int32, "src free size \\+ 1")
    refuses(lambda a, o: nisa.nonzero_with_count(dst=o, src=a), [x], (32, 13), nl.float32, "dst int32")


# ---- dma_transpose ---------------------------------------------------------------------------
def _dmat(x_shape, dst_shape, dtype=nl.bfloat16, **kw):
    @nki.jit
    def k(x):
        d = nl.ndarray(dst_shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=x, **kw)
        out = nl.ndarray(dst_shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out
    return k


@pytest.mark.parametrize("shape,perm", [((16, 128), (1, 0)), ((4, 8, 32), (2, 1, 0)), ((4, 2, 3, 16), (3, 1, 2, 0))])
def test_dma_transpose(rng, shape, perm):
    x = rng.standard_normal(shape).astype(BF16)
    x.reshape(-1)[3] = np.nan
    dst_shape = tuple(shape[a] for a in perm)
    out = _dmat(shape, dst_shape, dge_mode=nisa.dge_mode.hwdge if len(shape) == 2 else nisa.dge_mode.unknown)(x)
    assert out.tobytes() == np.ascontiguousarray(np.transpose(x, perm)).tobytes()


def test_dma_transpose_indirect_gather(rng):
    src = rng.standard_normal((300, 64)).astype(BF16)
    idx = rng.integers(0, 300, (128, 2)).astype(np.uint32)

    @nki.jit
    def k(s, ind):
        i = nl.ndarray(ind.shape, ind.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=ind)
        d = nl.ndarray((64, 256), s.dtype, buffer=nl.sbuf)
        nisa.dma_transpose(dst=d, src=s.ap(pattern=[[64, 256], [1, 64]], vector_offset=i, indirect_dim=0))
        out = nl.ndarray((64, 256), s.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out
    out = k(src, idx)
    flat = idx.T.reshape(-1)[:256]
    assert out.tobytes() == np.ascontiguousarray(src[flat].T).tobytes()


def test_dma_transpose_refusals(rng):
    def bad(shape, dst_shape, match, dtype=BF16, **kw):
        with pytest.raises(NkiValidationError, match=match):
            _dmat(shape, dst_shape, **kw)(rng.standard_normal(shape).astype(dtype))
    bad((16, 32), (32, 16), "2-byte dtype", dtype=F32)
    bad((16, 32), (16, 32), "dst is \\[16, 32\\], expected \\[32, 16\\]")
    bad((4, 8, 32), (32, 8, 4), "supported permutation is", axes=(1, 0, 2))
    bad((8, 32), (32, 8), "src.shape\\[0\\] == 16", dge_mode=nisa.dge_mode.hwdge)
    bad((3, 8, 32), (32, 8, 3), "in \\(1, 2, 4, 8, 16\\)", dge_mode=nisa.dge_mode.hwdge)
    bad((16, 32), (32, 16), "not valid for a direct DMA transpose", dge_mode=nisa.dge_mode.swdge)
    bad((16, 32), (32, 16), "oob_mode=skip is only valid", oob_mode=nisa.oob_mode.skip)
    bad((16, 32), (32, 16), "NeuronCore-v4", priority=0)
    bad((2, 2, 2, 2, 2), (2, 2, 2, 2, 2), "supports 2-D, 3-D and 4-D")


# ---- dma_compute -----------------------------------------------------------------------------
def test_dma_compute_sum_and_rmw(rng):
    a, b, c = (rng.standard_normal((8, 16)).astype(BF16) for _ in range(3))

    @nki.jit
    def k(a, b, c):
        out = nl.ndarray((8, 16), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_compute(dst=out, srcs=[a, b, c], reduce_op=nl.add, scales=[1.0, 1.0, 1.0])
        return out
    want = (a.astype(F32) + b.astype(F32)).astype(F32) + c.astype(F32)
    np.testing.assert_array_equal(k(a, b, c), want.astype(F32))

    table = rng.standard_normal((20, 8)).astype(F32)
    rows = rng.permutation(20)[:6].astype(np.uint32).reshape(6, 1)
    upd = rng.standard_normal((6, 8)).astype(F32)

    @nki.jit
    def scatter(table, rows, upd):
        i = nl.ndarray((6, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=rows)
        u = nl.ndarray((6, 8), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=u, src=upd)
        view = table.ap(pattern=[[8, 6], [1, 8]], vector_offset=i, indirect_dim=0)
        nisa.dma_compute(dst=view, srcs=[view, u], reduce_op=nl.add)
        g = nl.ndarray((6, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=g, value=1.0)
        nisa.dma_compute(dst=g, srcs=[table.ap(pattern=[[8, 6], [1, 8]], vector_offset=i, indirect_dim=0), g],
                         reduce_op=nl.add)
        out = nl.ndarray((6, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=g)
        return out
    t0 = table.copy()
    got = scatter(table, rows, upd)
    want_table = t0.copy()
    want_table[rows[:, 0]] += upd
    np.testing.assert_array_equal(table, want_table)                 # in-place scatter-RMW written back
    np.testing.assert_array_equal(got, want_table[rows[:, 0]] + 1)   # gather-RMW


def test_dma_compute_refusals(rng):
    x = rng.standard_normal((4, 8)).astype(F32)

    def bad(match, **kw):
        @nki.jit
        def k(x):
            out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
            args = dict(dst=out, srcs=[x, x], reduce_op=nl.add)
            args.update(kw)
            if "srcs" in kw and kw["srcs"] == "many":
                args["srcs"] = [x] * 17
            nisa.dma_compute(**args)
            return out
        with pytest.raises(NkiValidationError, match=match):
            k(x)
    bad("reduce_op must be nl.add", reduce_op=nl.multiply)
    bad("scales must be None or one 1.0", scales=[2.0, 1.0])
    bad("at most 16", srcs="many")


# ---- nc_matmul transpose mode / double row ---------------------------------------------------
def _eye(n, dtype):
    return np.eye(n, dtype=F32).astype(dtype)


@pytest.mark.parametrize("dt,dst_dt", [(BF16, nl.bfloat16), (F32, nl.float32), (ml_dtypes.float8_e4m3, nl.uint16)])
def test_matmul_transpose_mode_bit_exact(rng, dt, dst_dt):
    x = rng.standard_normal((32, 16)).astype(dt)
    if dt is not ml_dtypes.float8_e4m3:
        x[0, 0], x[1, 2] = np.nan, np.inf

    def body(a, i, o):
        p = nl.ndarray((16, 32), dst_dt, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=a, moving=i, is_transpose=True)
        nisa.tensor_copy(dst=o, src=p)
    out = run_op(body, [x, _eye(32, dt)], (16, 32), dst_dt)
    if dt is ml_dtypes.float8_e4m3:
        np.testing.assert_array_equal(out, x.T.view(np.uint8).astype(np.uint16))
    else:
        assert out.tobytes() == np.ascontiguousarray(x.T).tobytes()


def test_matmul_transpose_mode_refusals(rng):
    x = rng.standard_normal((32, 16)).astype(BF16)

    def tm(dst_dt=nl.bfloat16, **kw):
        def body(a, i, o):
            p = nl.ndarray((16, 32), dst_dt, buffer=nl.psum)
            nisa.nc_matmul(dst=p, stationary=a, moving=i, is_transpose=True, **kw)
            nisa.tensor_copy(dst=o, src=p)
        return body
    refuses(tm(), [x, (_eye(32, F32) * 2).astype(BF16)], (16, 32), nl.bfloat16, "not an identity/permutation")
    refuses(tm(nl.float32), [x, _eye(32, BF16)], (16, 32), nl.float32, "keeps the dtype")
    refuses(tm(accumulate=True), [x, _eye(32, BF16)], (16, 32), nl.bfloat16, "accumulate=True is not possible")
    refuses(tm(), [x, np.ones((32, 16), BF16)], (16, 32), nl.bfloat16, "identity matrix")

    def odd(a, o):
        p = nl.ndarray((16, 1), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=a[0:1, :], engine=nisa.engine.tensor)
        nisa.tensor_copy(dst=o, src=p)
    refuses(odd, [x], (16, 1), nl.bfloat16, "whole 4-byte words")


def test_matmul_double_row(rng):
    e4, e5 = ml_dtypes.float8_e4m3, ml_dtypes.float8_e5m2
    s = rng.uniform(-2, 2, (64, 2, 32)).astype(e4)
    m = rng.uniform(-2, 2, (64, 2, 48)).astype(e5)

    def body(a, b, o):
        p = nl.ndarray((32, 48), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=a, moving=b, perf_mode=nisa.matmul_perf_mode.double_row)
        nisa.tensor_copy(dst=o, src=p)
    out = run_op(body, [s, m], (32, 48), nl.float32)
    want = np.einsum("pjm,pjn->mn", s.astype(np.float64), m.astype(np.float64))
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)

    def dr(a, b, o, **kw):
        p = nl.ndarray((32, 48), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=a, moving=b, perf_mode=nisa.matmul_perf_mode.double_row, **kw)
        nisa.tensor_copy(dst=o, src=p)
    refuses(dr, [s.astype(BF16), m], (32, 48), nl.float32, "needs float8_e4m3/float8_e5m2")
    refuses(dr, [s.reshape(64, 1, 64), m], (32, 48), nl.float32, "shaped \\[K, 2, ...\\]")
    refuses(lambda a, b, o: dr(a, b, o, tile_size=(128, 64), tile_position=(0, 0)), [s, m], (32, 48), nl.float32,
            "column tiling")
    refuses(lambda a, b, o: dr(a, b, o, is_transpose=True), [s, m], (32, 48), nl.float32, "cannot be combined")


def test_vector_offset_gather_refused_off_its_index_partitions():
    """A vector_offset gather pairs each hardware partition with its own index (SDK-ISA dma_copy "Vector
    indirection"): into a destination that starts at another partition than the index tile it is refused; the same
    row through scalar_offset (a 1x1 SBUF offset) lands anywhere."""
    table = np.arange(16 * 8, dtype=F32).reshape(16, 8)

    @nki.jit
    def gather(table, ids, scalar):
        i = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=ids)
        x = nl.ndarray((4, 8), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=x, value=0.0)
        if scalar:
            src = table.ap(pattern=[[8, 1], [1, 8]], offset=0, scalar_offset=i, indirect_dim=0)
        else:
            src = table.ap(pattern=[[8, 1], [1, 8]], offset=0, vector_offset=i, indirect_dim=0)
        nisa.dma_copy(dst=x[2:3, :], src=src)
        out = nl.ndarray((4, 8), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=x)
        return out
    ids = np.array([[5]], np.int32)
    with pytest.raises(NkiValidationError, match="DMA_VECTOR_OFFSET_ALIGN"):
        gather(table, ids, False)
    got = gather(table, ids, True)
    np.testing.assert_array_equal(got[2], table[5])
    assert not got[[0, 1, 3]].any()
