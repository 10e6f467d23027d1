"""Each ISA op against numpy on normal and edge cases."""
import ml_dtypes
import numpy as np
import pytest

import nki.isa as nisa
import nki.language as nl
from nkisim_helpers import run_op

F32 = np.float32
BF16 = ml_dtypes.bfloat16


def test_tensor_tensor_arith_and_cmp(rng):
    a, b = rng.standard_normal((128, 64)).astype(F32), rng.standard_normal((128, 64)).astype(F32)
    for op, ref in ((nl.add, a + b), (nl.subtract, a - b), (nl.multiply, a * b), (nl.maximum, np.maximum(a, b)),
                    (nl.minimum, np.minimum(a, b)), (nl.greater, (a > b).astype(F32)),
                    (nl.equal, (a == b).astype(F32))):
        out = run_op(lambda x, y, o: nisa.tensor_tensor(dst=o, data1=x, data2=y, op=op), [a, b], (128, 64), nl.float32)
        np.testing.assert_array_equal(out, ref)


def test_tensor_tensor_rounds_to_bf16(rng):
    a, b = rng.standard_normal((32, 16)).astype(F32), rng.standard_normal((32, 16)).astype(F32)
    out = run_op(lambda x, y, o: nisa.tensor_tensor(dst=o, data1=x, data2=y, op=nl.multiply), [a, b], (32, 16),
                 nl.bfloat16)
    np.testing.assert_array_equal(out, (a * b).astype(BF16))     # fp32 compute, RNE on write


def test_tensor_tensor_int32_exact_and_bitwise():
    a = np.array([[2 ** 30 + 1, -7, 5, 3]], np.int32)
    b = np.array([[2 ** 30 + 3, 2, 6, 1]], np.int32)
    out = run_op(lambda x, y, o: nisa.tensor_tensor(dst=o, data1=x, data2=y, op=nl.subtract), [a, b], (1, 4), nl.int32)
    np.testing.assert_array_equal(out, a - b)          # GpSimd int32 path is exact
    out = run_op(lambda x, y, o: nisa.tensor_tensor(dst=o, data1=x, data2=y, op=nl.bitwise_and), [a, b], (1, 4),
                 nl.int32)
    np.testing.assert_array_equal(out, a & b)


def test_tensor_scalar_variants(rng):
    a = rng.standard_normal((128, 32)).astype(F32)
    col = rng.standard_normal((128, 1)).astype(F32)
    out = run_op(lambda x, c, o: nisa.tensor_scalar(dst=o, data=x, op0=nl.multiply, operand0=c, op1=nl.add,
                                                     operand1=2.0), [a, col], (128, 32), nl.float32)
    np.testing.assert_allclose(out, a * col + 2.0, rtol=1e-6)
    out = run_op(lambda x, o: nisa.tensor_scalar(dst=o, data=x, op0=nl.subtract, operand0=1.0, reverse0=True),
                 [a], (128, 32), nl.float32)
    np.testing.assert_array_equal(out, 1.0 - a)
    pos = np.abs(a) + 0.5
    out = run_op(lambda x, o: nisa.tensor_scalar(dst=o, data=x, op0=nl.rsqrt, operand0=None), [pos], (128, 32),
                 nl.float32)
    np.testing.assert_allclose(out, 1 / np.sqrt(pos), rtol=1e-6)


def test_scalar_tensor_tensor(rng):
    a, b = rng.standard_normal((64, 40)).astype(F32), rng.standard_normal((64, 40)).astype(F32)
    out = run_op(lambda x, y, o: nisa.scalar_tensor_tensor(dst=o, data=x, op0=nl.multiply, operand0=3.0,
                                                            op1=nl.add, operand1=y), [a, b], (64, 40), nl.float32)
    np.testing.assert_allclose(out, a * 3 + b, rtol=1e-6)


@pytest.mark.parametrize("axis,shape", [(1, (16, 64)), (2, (16, 4, 16)), ((1, 2), (16, 4, 16))])
def test_tensor_reduce_axes(rng, axis, shape):
    a = rng.standard_normal(shape).astype(F32)
    ax = (axis,) if isinstance(axis, int) else axis
    ref = a.sum(axis=ax)
    oshape = (16, int(np.prod(ref.shape[1:])) if ref.ndim > 1 else 1)
    out = run_op(lambda x, o: nisa.tensor_reduce(dst=o, op=nl.add, data=x, axis=axis), [a], oshape, nl.float32)
    np.testing.assert_allclose(out.reshape(ref.shape[0], -1), ref.reshape(16, -1), rtol=1e-5, atol=1e-5)
    out = run_op(lambda x, o: nisa.tensor_reduce(dst=o, op=nl.maximum, data=x, axis=axis, negate=True), [a], oshape,
                 nl.float32)
    np.testing.assert_array_equal(out.reshape(16, -1), -a.max(axis=ax).reshape(16, -1))


def test_activation_table_scale_bias_reduce(rng):
    a = rng.standard_normal((128, 50)).astype(F32)
    b = rng.standard_normal((128, 1)).astype(F32)
    sig = lambda v: 1 / (1 + np.exp(-v))
    for op, f in ((nl.exp, np.exp), (nl.silu, lambda v: v * sig(v)), (nl.sigmoid, sig), (nl.tanh, np.tanh),
                  (nl.copy, lambda v: v), (nl.square, np.square), (nl.softplus, lambda v: np.log1p(np.exp(v))),
                  (nl.relu, lambda v: np.maximum(v, 0)), (nl.gelu_apprx_tanh,
                   lambda v: 0.5 * v * (1 + np.tanh(np.sqrt(2 / np.pi) * (v + 0.044715 * v ** 3))))):
        out = run_op(lambda x, bb, o: nisa.activation(dst=o, op=op, data=x, bias=bb, scale=0.5), [a, b], (128, 50),
                     nl.float32)
        np.testing.assert_allclose(out, f(a * 0.5 + b), rtol=2e-5, atol=1e-6, err_msg=repr(op))

    def body(x, o):
        e = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=x, reduce_op=nl.add, reduce_res=o,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        nisa.activation(dst=e, op=nl.exp, data=x, reduce_op=nl.add, reduce_res=o, reduce_cmd=nisa.reduce_cmd.reduce)
    out = run_op(body, [a], (128, 1), nl.float32)
    np.testing.assert_allclose(out[:, 0], 2 * np.exp(a).sum(1), rtol=1e-5)


def test_activation_psum_input_rsqrt(rng):
    a = (rng.random((4, 8)) + 0.1).astype(F32)

    def body(x, o):
        p = nl.ndarray((4, 8), nl.float32, buffer=nl.psum)
        nisa.tensor_copy(dst=p, src=x)
        nisa.activation(dst=o, op=nl.rsqrt, data=p, scale=2.0, bias=1.0)
    np.testing.assert_allclose(run_op(body, [a], (4, 8), nl.float32), 1 / np.sqrt(2 * a + 1), rtol=1e-6)


def test_tensor_copy_cast_and_exact(rng):
    a = rng.standard_normal((8, 8)).astype(F32)
    np.testing.assert_array_equal(run_op(lambda x, o: nisa.tensor_copy(dst=o, src=x), [a], (8, 8), nl.bfloat16),
                                  a.astype(BF16))
    big = np.array([[2 ** 31 - 1, 2 ** 24 + 1]], np.int32)
    np.testing.assert_array_equal(run_op(lambda x, o: nisa.tensor_copy(dst=o, src=x), [big], (1, 2), nl.int32), big)
    # fp32 -> int rounds to nearest even and saturates
    f = np.array([[2.5, -2.5, 3.5, 1e10, -1e10, 0.49]], F32)
    np.testing.assert_array_equal(run_op(lambda x, o: nisa.tensor_copy(dst=o, src=x), [f], (1, 6), nl.int8),
                                  [[2, -2, 4, 127, -128, 0]])


def test_memset_iota_affine_select():
    def body(o):
        nisa.memset(dst=o, value=7)
    np.testing.assert_array_equal(run_op(body, [], (4, 3), nl.int32), np.full((4, 3), 7))

    def body(o):
        nisa.iota(dst=o, pattern=[[1, 6]], offset=10, channel_multiplier=100)
    np.testing.assert_array_equal(run_op(body, [], (3, 6), nl.int32),
                                  10 + np.arange(6)[None] + 100 * np.arange(3)[:, None])

    ones = np.ones((8, 8), F32)

    def body(x, o):   # causal mask: keep col <= row
        nisa.affine_select(dst=o, pattern=[[-1, 8]], channel_multiplier=1, on_true_tile=x, on_false_value=-1e30,
                           cmp_op=nl.greater_equal)
    np.testing.assert_array_equal(run_op(body, [ones], (8, 8), nl.float32), np.where(np.tril(ones) > 0, 1.0, -1e30).astype(F32))


def test_select_reduce_and_reciprocal(rng):
    a = rng.standard_normal((16, 10)).astype(F32)
    pred = (rng.random((16, 10)) > 0.5).astype(np.uint8)

    def body(x, p, o):
        d = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        nisa.select_reduce(dst=d, predicate=p, on_true=x, on_false=-5.0, reduce_res=o,
                           reduce_cmd=nisa.reduce_cmd.reset_reduce)
    np.testing.assert_array_equal(run_op(body, [a, pred], (16, 1), nl.float32)[:, 0],
                                  np.where(pred > 0, a, -5.0).max(1))
    np.testing.assert_allclose(run_op(lambda x, o: nisa.reciprocal(dst=o, data=x), [a], (16, 10), nl.float32), 1 / a,
                               rtol=1e-6)


def test_max8_find_index8_match_replace8():
    x = np.array([[1, 9, 3, 9, 5, 7, 2, 8, 0, 6, 4, 9]], F32)
    out = run_op(lambda s, o: nisa.max8(dst=o, src=s), [x], (1, 8), nl.float32)
    np.testing.assert_array_equal(out, [[9, 9, 9, 8, 7, 6, 5, 4]])
    vals = out.astype(F32)
    idx = run_op(lambda d, v, o: nisa.nc_find_index8(dst=o, data=d, vals=v), [x, vals], (1, 8), nl.uint32)
    np.testing.assert_array_equal(idx, [[1, 3, 11, 7, 5, 9, 4, 10]])      # duplicates -> successive occurrences
    miss = np.full((1, 8), 42, F32)
    idx = run_op(lambda d, v, o: nisa.nc_find_index8(dst=o, data=d, vals=v), [x, miss], (1, 8), nl.uint32)
    assert (idx == 0xFFFFFFFF).all()
    data = np.array([[1, 2, 3, 4, 8, 8, 8, 8, 8, 8, 8]], F32)
    v = np.array([[3, 8, 8, 8, 8, 8, 8, 8]], F32)

    def body(d, vv, o):
        r = nl.ndarray(d.shape, nl.float32, buffer=nl.sbuf)
        nisa.nc_match_replace8(dst=r, data=d, vals=vv, imm=-1.0, dst_idx=o)
    np.testing.assert_array_equal(run_op(body, [data, v], (1, 8), nl.uint32), [[2, 10, 9, 8, 7, 6, 5, 4]])


def test_transposes(rng):
    a = rng.standard_normal((128, 96)).astype(BF16)

    def body(x, o):
        p = nl.ndarray((96, 128), nl.bfloat16, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=x)                  # PE (> 32x32)
        nisa.tensor_copy(dst=o, src=p)
    np.testing.assert_array_equal(run_op(body, [a], (96, 128), nl.bfloat16), a.T)
    s = rng.standard_normal((32, 20)).astype(F32)
    np.testing.assert_array_equal(
        run_op(lambda x, o: nisa.nc_transpose(dst=o, data=x, engine=nisa.engine.vector), [s], (20, 32), nl.float32), s.T)


def test_tensor_partition_reduce(rng):
    a = rng.standard_normal((64, 12)).astype(F32)
    out = run_op(lambda x, o: nisa.tensor_partition_reduce(dst=o, op=nl.add, data=x), [a], (1, 12), nl.float32)
    np.testing.assert_allclose(out[0], a.sum(0), rtol=1e-5, atol=1e-6)
