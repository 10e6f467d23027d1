"""The experimental tile-level nki.language wrappers (nkisim/experimental.py): values against numpy, dtype
promotion, refusals, and the ISA instructions they lower to."""
import inspect
import json
import os

import ml_dtypes
import numpy as np
import pytest

import nkisim
import nki
import nki.isa as nisa
import nki.language as nl
from nkisim import NkiValidationError
from nkisim.experimental import promote

BF16 = ml_dtypes.bfloat16


def run_nl(body, inputs):
    """Load every input into SBUF (nl.load), run ``body(*tiles)`` -> a result tile (SBUF, or PSUM evicted to SBUF by
    a tensor_copy), store it into a new shared-HBM output."""
    def kern(hbm):
        tiles = []
        for h in hbm:
            tiles.append(nl.load(h))
        r = body(*tiles)
        if r.buffer == nl.psum:
            s = nl.ndarray(r.shape, r.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=s, src=r)
            r = s
        out = nl.ndarray(r.shape, r.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=r)
        return out
    return nki.jit(kern)(tuple(inputs))


def f32(a):
    return np.asarray(a, dtype=np.float32)


@pytest.fixture
def xy(rng):
    return (rng.standard_normal((64, 48)).astype(np.float32), rng.standard_normal((64, 48)).astype(np.float32))


# ---- the SDK quick-start kernel -----------------------------------------------------------------
@nki.jit
def add_kernel(a_ptr, b_ptr):
    a = nl.load(a_ptr)
    b = nl.load(b_ptr)
    result = nl.add(a, b)
    out = nl.ndarray(a_ptr.shape, dtype=a_ptr.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=result)
    return out


def test_quickstart_add_kernel_simulate_and_jit(rng):
    a = rng.standard_normal((128, 512)).astype(np.float32)
    b = rng.standard_normal((128, 512)).astype(np.float32)
    assert np.array_equal(nki.simulate(add_kernel)(a, b), a + b)
    assert np.array_equal(add_kernel(a, b), a + b)


def test_add_traces_one_dve_tensor_tensor(xy):
    with nkisim.trace.capture() as tr:
        run_nl(lambda a, b: nl.add(a, b), xy)
    ops = [(i["engine"], i["op"]) for i in tr.instructions]
    assert ops == [("DMA", "dma_copy"), ("DMA", "dma_copy"), ("DVE", "tensor_tensor"), ("DMA", "dma_copy")]
    assert tr.instructions[2]["alu"] == "add"


# ---- element-wise binary -----------------------------------------------------------------------
BINARY = [("add", np.add), ("subtract", np.subtract), ("multiply", np.multiply), ("maximum", np.maximum),
          ("minimum", np.minimum), ("equal", np.equal), ("not_equal", np.not_equal), ("greater", np.greater),
          ("greater_equal", np.greater_equal), ("less", np.less), ("less_equal", np.less_equal),
          ("logical_and", np.logical_and), ("logical_or", np.logical_or), ("logical_xor", np.logical_xor)]


@pytest.mark.parametrize("name,ref", BINARY)
def test_binary_tile_tile_fp32(name, ref, rng):
    a = rng.integers(-2, 3, (32, 40)).astype(np.float32)      # small ints: ties and zeros for cmp/logical
    b = rng.integers(-2, 3, (32, 40)).astype(np.float32)
    got = run_nl(lambda x, y: getattr(nl, name)(x, y), (a, b))
    assert got.dtype == np.float32
    assert np.array_equal(got, ref(a, b).astype(np.float32))


@pytest.mark.parametrize("name,ref", BINARY[:5] + [("greater", np.greater)])
def test_binary_scalar_both_sides(name, ref, xy):
    a = xy[0]
    got = run_nl(lambda x: getattr(nl, name)(x, 0.25), (a,))
    assert np.array_equal(got, ref(a, np.float32(0.25)).astype(np.float32))
    got = run_nl(lambda x: getattr(nl, name)(0.25, x), (a,))          # scalar as x -> reverse0
    assert np.array_equal(got, ref(np.float32(0.25), a).astype(np.float32))


def test_binary_bf16_result_and_dtype_cast(rng):
    a = rng.standard_normal((16, 64)).astype(BF16)
    b = rng.standard_normal((16, 64)).astype(BF16)
    got = run_nl(lambda x, y: nl.multiply(x, y), (a, b))
    assert got.dtype == BF16
    assert np.array_equal(got, (f32(a) * f32(b)).astype(BF16))          # fp32 math, one RNE rounding
    got = run_nl(lambda x, y: nl.add(x, y, dtype=nl.float32), (a, b))
    assert got.dtype == np.float32 and np.array_equal(got, f32(a) + f32(b))


def test_type_promotion_rules_and_weak_scalars(rng):
    # "NKI Type Promotion" examples
    assert promote("int32", "float16") == "float16"
    assert promote("uint16", "tfloat32") == "tfloat32"
    assert promote("float32", "bfloat16") == "float32"
    assert promote("float16", "bfloat16") == "float32"
    assert promote("float8_e4m3", "bfloat16") == "bfloat16"
    assert promote("float8_e4m3", "float8_e5m2") == "bfloat16"
    assert promote("int8", "uint8") == "int16"
    assert promote("int8", "uint16") == "int32"
    assert promote("uint16", "int32") == "int32"
    assert promote("int32", "uint32") == "float32"
    a = rng.standard_normal((8, 16)).astype(BF16)
    assert run_nl(lambda x: nl.add(x, 1.5), (a,)).dtype == np.float32          # weak float -> float32
    assert run_nl(lambda x: nl.add(x, np.float16(1.5)), (a,)).dtype == np.float32   # (bf16, fp16) -> fp32
    i = rng.integers(-5, 5, (8, 16)).astype(np.int8)
    got = run_nl(lambda x: nl.add(x, 2), (i,))                                # weak int -> int32
    assert got.dtype == np.int32 and np.array_equal(got, i.astype(np.int32) + 2)
    assert run_nl(lambda x, y: nl.subtract(x, y), (a, i)).dtype == BF16       # (float, int) -> the float


def test_int32_add_and_bitwise(rng):
    a = rng.integers(-1000, 1000, (16, 32)).astype(np.int32)
    b = rng.integers(0, 7, (16, 32)).astype(np.int32)
    with nkisim.trace.capture() as tr:
        got = run_nl(lambda x, y: nl.add(x, y), (a, b))
    assert np.array_equal(got, a + b) and tr.instructions[2]["engine"] == "POOL"   # GpSimd native int32
    assert np.array_equal(run_nl(lambda x, y: nl.bitwise_and(x, y), (a, b)), a & b)
    assert np.array_equal(run_nl(lambda x, y: nl.bitwise_xor(x, y), (a, b)), a ^ b)
    assert np.array_equal(run_nl(lambda x: nl.left_shift(x, 3), (b,)), b << 3)
    assert np.array_equal(run_nl(lambda x: nl.invert(x), (a,)), ~a)
    u = rng.integers(0, 255, (16, 32)).astype(np.uint8)
    assert np.array_equal(run_nl(lambda x: nl.invert(x), (u,)), ~u)


def test_power_tile_tile_on_gpsimd(rng):
    a = rng.uniform(0.5, 2.0, (16, 32)).astype(np.float32)
    b = rng.uniform(-2, 2, (16, 32)).astype(np.float32)
    with nkisim.trace.capture() as tr:
        got = run_nl(lambda x, y: nl.power(x, y), (a, b))
    assert np.allclose(got, a ** b, rtol=1e-6)
    assert tr.instructions[2]["engine"] == "POOL"


# ---- element-wise unary ------------------------------------------------------------------------
def _sig(x):
    return 1 / (1 + np.exp(-x))


UNARY = [("exp", np.exp), ("tanh", np.tanh), ("sigmoid", _sig), ("relu", lambda x: np.maximum(x, 0)),
         ("silu", lambda x: x * _sig(x)), ("square", np.square), ("abs", np.abs), ("sign", np.sign),
         ("arctan", np.arctan), ("sin", np.sin), ("cos", np.cos), ("negative", np.negative),
         ("softplus", lambda x: np.logaddexp(0, x)), ("floor", np.floor), ("ceil", np.ceil), ("trunc", np.trunc),
         ("gelu_apprx_tanh", lambda x: 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3))))]


@pytest.mark.parametrize("name,ref", UNARY)
def test_unary_fp32(name, ref, rng):
    x = (rng.standard_normal((32, 40)) * 2).astype(np.float32)
    x[0, :6] = [0.0, -0.0, 2.0, -2.0, 2.5, -2.5]          # integral / half values for the rounding functions
    got = run_nl(lambda t: getattr(nl, name)(t), (x,))
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name,ref,lo", [("log", np.log, 0.1), ("sqrt", np.sqrt, 0.0),
                                         ("rsqrt", lambda x: 1 / np.sqrt(x), 0.1),
                                         ("reciprocal", lambda x: 1 / x, 0.1), ("tan", np.tan, -1.2)])
def test_unary_positive_domain(name, ref, lo, rng):
    x = rng.uniform(lo, 1.3, (16, 24)).astype(np.float32)
    got = run_nl(lambda t: getattr(nl, name)(t), (x,))
    np.testing.assert_allclose(got, ref(x.astype(np.float64)), rtol=2e-5, atol=1e-6)


def test_unary_bf16_and_dtype(rng):
    x = rng.standard_normal((16, 64)).astype(BF16)
    got = run_nl(lambda t: nl.exp(t), (x,))
    assert got.dtype == BF16 and np.array_equal(got, np.exp(f32(x)).astype(BF16))
    got = run_nl(lambda t: nl.exp(t, dtype=nl.float32), (x,))
    assert got.dtype == np.float32 and np.allclose(got, np.exp(f32(x)), rtol=1e-6)


def test_unary_lowering_engines(xy):
    def body(t):
        nl.exp(t)
        nl.rsqrt(nl.abs(t))
        nl.copy(t)
        return nl.negative(t)
    with nkisim.trace.capture() as tr:
        run_nl(body, xy[:1])
    ops = [(i["engine"], i["op"]) for i in tr.instructions[1:-1]]
    assert ops == [("ACT", "activation"), ("ACT", "activation"), ("POOL", "tensor_scalar"), ("DVE", "tensor_copy"),
                   ("DVE", "tensor_scalar")]


def test_copy_is_bit_exact_for_int32(rng):
    a = rng.integers(2 ** 30, 2 ** 31 - 1, (8, 16)).astype(np.int32)     # beyond fp32 precision
    assert np.array_equal(run_nl(lambda t: nl.copy(t), (a,)), a)
    got = run_nl(lambda t: nl.copy(t, dtype=nl.float32), (a,))
    assert np.array_equal(got, a.astype(np.float32))


def test_logical_not(rng):
    a = rng.integers(0, 2, (8, 16)).astype(np.float32)
    assert np.array_equal(run_nl(lambda t: nl.logical_not(t), (a,)), 1 - a)


# ---- reductions --------------------------------------------------------------------------------
@pytest.mark.parametrize("name,ref", [("sum", np.sum), ("max", np.max), ("min", np.min), ("prod", np.prod),
                                      ("mean", np.mean)])
def test_reductions_2d(name, ref, rng):
    x = rng.uniform(0.5, 1.5, (32, 24)).astype(np.float32)
    got = run_nl(lambda t: getattr(nl, name)(t, axis=1), (x,))
    assert got.shape == (32, 1)           # on-chip tiles stay 2-D
    np.testing.assert_allclose(got[:, 0], ref(x, axis=1), rtol=1e-5)
    got = run_nl(lambda t: getattr(nl, name)(t, axis=(1,), keepdims=True), (x,))
    assert got.shape == (32, 1)


def test_reductions_3d_axes_keepdims_dtype(rng):
    x = rng.standard_normal((16, 4, 8)).astype(np.float32)
    got = run_nl(lambda t: nl.sum(t, axis=2), (x,))
    assert got.shape == (16, 4) and np.allclose(got, x.sum(2), atol=1e-5)
    got = run_nl(lambda t: nl.max(t, axis=2, keepdims=True), (x,))
    assert got.shape == (16, 4, 1) and np.array_equal(got[..., 0], x.max(2))
    got = run_nl(lambda t: nl.sum(t, axis=(1, 2), dtype=nl.bfloat16), (x,))
    assert got.shape == (16, 1) and got.dtype == BF16
    assert np.allclose(f32(got[:, 0]), x.sum((1, 2)), rtol=1e-2, atol=1e-2)
    got = run_nl(lambda t: nl.mean(t, axis=-1, keepdims=True), (x,))
    assert np.allclose(got[..., 0], x.mean(2), atol=1e-6)


def test_var_keeps_dims_and_all(rng):
    x = rng.standard_normal((16, 4, 8)).astype(np.float32)
    got = run_nl(lambda t: nl.var(t, axis=2), (x,))                  # keepdims ignored: always kept
    assert got.shape == (16, 4, 1) and np.allclose(got[..., 0], x.var(2), rtol=1e-5, atol=1e-6)
    got = run_nl(lambda t: nl.var(t, axis=(1, 2)), (x,))
    assert np.allclose(got.reshape(16), x.reshape(16, -1).var(1), rtol=1e-5)
    b = (rng.uniform(size=(16, 8)) > 0.2).astype(np.float32)
    got = run_nl(lambda t: nl.all(t, axis=1), (b,))
    assert np.array_equal(got[:, 0], b.all(1).astype(np.float32))


def test_reduction_bf16_input(rng):
    x = rng.standard_normal((16, 64)).astype(BF16)
    got = run_nl(lambda t: nl.sum(t, axis=1), (x,))
    assert got.dtype == BF16
    assert np.array_equal(got[:, 0], f32(x).sum(1, dtype=np.float32).astype(BF16))


# ---- softmax / rms_norm kernels ----------------------------------------------------------------
@nki.jit
def softmax_kernel(x):
    t = nl.load(x)
    y = nl.softmax(t, axis=1)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=y)
    return out


@nki.jit
def rms_norm_kernel(x, w):
    t = nl.load(x)
    wt = nl.load(w)
    y = nl.rms_norm(t, wt, axis=1, n=x.shape[1], epsilon=1e-5)
    out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
    nl.store(out, value=y)
    return out


def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


@pytest.mark.parametrize("dt,tol", [(np.float32, 1e-6), (BF16, 1e-2)])
def test_softmax_kernel(dt, tol, rng):
    x = (rng.standard_normal((128, 200)) * 4).astype(dt)
    got = softmax_kernel(x)
    assert got.dtype == dt
    np.testing.assert_allclose(f32(got), _softmax(f32(x).astype(np.float64), 1), rtol=tol, atol=tol * 1e-2)


def test_softmax_lowering_and_subset_axis(rng):
    x = rng.standard_normal((16, 32)).astype(np.float32)
    with nkisim.trace.capture() as tr:
        softmax_kernel(x)
    assert [(i["engine"], i["op"]) for i in tr.instructions[1:-1]] == [
        ("DVE", "tensor_reduce"), ("ACT", "activation"), ("DVE", "reciprocal"), ("DVE", "tensor_scalar")]
    x3 = rng.standard_normal((16, 4, 8)).astype(np.float32)
    got = run_nl(lambda t: nl.softmax(t, axis=2), (x3,))
    np.testing.assert_allclose(got, _softmax(x3, 2), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("dt,tol", [(np.float32, 1e-5), (BF16, 1e-2)])
def test_rms_norm_kernel(dt, tol, rng):
    x = rng.standard_normal((128, 256)).astype(dt)
    w = rng.standard_normal((128, 256)).astype(dt)
    got = rms_norm_kernel(x, w)
    xf = f32(x).astype(np.float64)
    ref = xf / np.sqrt((xf * xf).mean(1, keepdims=True) + 1e-5) * f32(w)
    np.testing.assert_allclose(f32(got), ref, rtol=tol, atol=tol)


def test_rms_norm_subset_axis_compute_dtype(rng):
    x = rng.standard_normal((8, 4, 16)).astype(np.float32)
    w = rng.standard_normal((8, 4, 16)).astype(np.float32)
    got = run_nl(lambda t, u: nl.rms_norm(t, u, axis=2, n=16, compute_dtype=nl.float32), (x, w))
    ref = x / np.sqrt((x * x).mean(2, keepdims=True) + 1e-6) * w
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)


# ---- where / matmul / transpose / data movement ------------------------------------------------
def test_where(rng):
    c = (rng.uniform(size=(16, 32)) > 0.5).astype(np.float32)
    a = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal((16, 32)).astype(BF16)
    got = run_nl(lambda cc, x, y: nl.where(cc, x, y), (c, a, b))
    assert got.dtype == np.float32 and np.array_equal(got, np.where(c != 0, a, f32(b)))
    got = run_nl(lambda cc, x: nl.where(cc, x, 0.0), (c, a))
    assert np.array_equal(got, np.where(c != 0, a, 0).astype(np.float32))


def test_matmul_transpose_x(rng):
    x = rng.standard_normal((64, 32)).astype(np.float32)     # [K, M]
    y = rng.standard_normal((64, 96)).astype(np.float32)     # [K, N]
    with nkisim.trace.capture() as tr:
        got = run_nl(lambda a, b: nl.matmul(a, b, transpose_x=True), (x, y))
    assert got.shape == (32, 96) and np.allclose(got, x.T @ y, rtol=1e-5, atol=1e-5)
    assert ("PE", "nc_matmul") in [(i["engine"], i["op"]) for i in tr.instructions]
    xb, yb = x.astype(BF16), y.astype(BF16)
    got = run_nl(lambda a, b: nl.matmul(a, b, transpose_x=True), (xb, yb))
    assert got.dtype == np.float32 and np.allclose(got, f32(xb).T @ f32(yb), rtol=1e-4, atol=1e-4)


def test_transpose_returns_psum_tile(rng):
    x = rng.standard_normal((48, 80)).astype(BF16)
    seen = {}

    def body(t):
        r = nl.transpose(t)
        seen["buf"] = r.buffer
        return r
    got = run_nl(body, (x,))
    assert seen["buf"] == nl.psum and np.array_equal(got, x.T)
    got = run_nl(lambda t: nl.transpose(t, dtype=nl.float32), (x,))
    assert got.dtype == np.float32 and np.array_equal(got, f32(x).T)


@pytest.mark.parametrize("dt", [np.float32, BF16])
def test_load_transpose2d(dt, rng):
    a = rng.standard_normal((32, 64)).astype(dt)

    @nki.jit
    def k(src):
        t = nl.load_transpose2d(src)
        out = nl.ndarray(t.shape, dtype=t.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=t)
        return out
    with nkisim.trace.capture() as tr:
        got = k(a)
    assert np.array_equal(got, a.T)
    first = tr.instructions[0]["op"]
    assert first == ("dma_transpose" if dt is BF16 else "dma_copy")


def test_expand_dims_and_broadcast_to(rng):
    x = rng.standard_normal((16, 1)).astype(np.float32)
    got = run_nl(lambda t: nl.broadcast_to(t, (16, 24)), (x,))
    assert np.array_equal(got, np.broadcast_to(x, (16, 24)))
    row = rng.standard_normal((1, 24)).astype(BF16)
    with nkisim.trace.capture() as tr:
        got = run_nl(lambda t: nl.broadcast_to(t, (32, 24)), (row,))    # partition broadcast via the PE
    assert got.dtype == BF16 and np.array_equal(got, np.broadcast_to(row, (32, 24)))
    assert ("PE", "nc_matmul") in [(i["engine"], i["op"]) for i in tr.instructions]
    x3 = rng.standard_normal((8, 1, 6)).astype(np.float32)
    got = run_nl(lambda t: nl.broadcast_to(nl.expand_dims(t.reshape((8, 6)), 1), (8, 3, 6)), (x3,))
    assert np.array_equal(got, np.broadcast_to(x3, (8, 3, 6)))


def test_gather_flattened(rng):
    data = rng.standard_normal((16, 40)).astype(np.float32)
    idx = rng.integers(0, 40, (16, 12)).astype(np.int32)
    with nkisim.trace.capture() as tr:
        got = run_nl(lambda d, i: nl.gather_flattened(d, i), (data, idx))
    assert np.array_equal(got, np.take_along_axis(data, idx, axis=1))
    assert ("POOL", "nc_n_gather") in [(i["engine"], i["op"]) for i in tr.instructions]


def test_full_zeros_ones_in_hbm_and_psum():
    @nki.jit
    def k():
        o = nl.full((4, 300), 2.5, dtype=nl.float32, buffer=nl.shared_hbm)
        z = nl.zeros((2, 3, 5), dtype=nl.int32, buffer=nl.shared_hbm)
        p = nl.ones((8, 16), dtype=nl.float32, buffer=nl.psum)
        s = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=s, src=p)
        q = nl.ndarray((8, 16), dtype=nl.float32, buffer=nl.shared_hbm)
        nl.store(q, value=s)
        return o, z, q
    o, z, q = k()
    assert np.array_equal(o, np.full((4, 300), 2.5, np.float32))
    assert np.array_equal(z, np.zeros((2, 3, 5), np.int32)) and np.array_equal(q, np.ones((8, 16), np.float32))


# ---- refusals ----------------------------------------------------------------------------------
def _raises(body, inputs, match, exc=NkiValidationError):
    with pytest.raises(exc, match=match):
        run_nl(body, inputs)


def test_refusals(rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)
    col = rng.standard_normal((16, 1)).astype(np.float32)
    _raises(lambda x, c: nl.add(x, c), (a, col), r"nl\.add: x \[16, 32\] and y \[16, 1\] differ in shape: "
                                                 r"broadcasting binary ops is documented as not working")
    _raises(lambda x: nl.divide(x, x), (a,), r"nl\.divide .*not working on hardware")
    _raises(lambda x: nl.mod(x, 2.0), (a,), r"nl\.mod .*not working on hardware")
    _raises(lambda x: nl.fmod(x, x), (a,), r"nl\.fmod .*not working on hardware")
    _raises(lambda x: nl.power(x, 2.0), (a,), r"power with a scalar exponent is documented as not working")
    _raises(lambda x: nl.abs_max(x, x), (a,), r"nl\.abs_max: is NeuronCore-v4")
    _raises(lambda x: nl.add(1.0, 2.0), (a,), r"at least one of x, y must be a tile")
    _raises(lambda x: nl.bitwise_and(x, x), (a,), r"nl\.bitwise_and: inputs must be integer typed")
    _raises(lambda x: nl.matmul(x, x), (a,), r"nl\.matmul: transpose_x=False is documented as not working")
    _raises(lambda x: nl.sum(x, axis=0), (a,), r"nl\.sum: axis=0 .*partition dim 0 cannot be reduced")
    x3 = rng.standard_normal((8, 4, 6)).astype(np.float32)
    _raises(lambda x: nl.sum(x, axis=1), (x3,), r"nl\.sum: axis=1 .*trailing contiguous free dims")
    _raises(lambda x, c: nl.rms_norm(x, c, axis=1, n=32), (a, col), r"nl\.rms_norm: w \[16, 1\] must have x's shape")
    _raises(lambda x: nl.expand_dims(x, 0), (a,), r"nl\.expand_dims: axis=0 .*after the partition dim")
    _raises(lambda x: nl.broadcast_to(x, (16, 64)), (a,), r"nl\.broadcast_to: cannot broadcast \[16, 32\]")
    _raises(lambda x: nl.gather_flattened(x, x), (a,), r"indices must be an integer tile, got float32")
    with pytest.raises(TypeError, match="nl.bypass is an operator constant"):
        run_nl(lambda x: nl.bypass(x), (a,))


def test_refusals_from_the_isa_name_the_wrapper(rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)

    def psum_rsqrt(x):
        p = nl.matmul(x, x, transpose_x=True)             # [32, 32] fp32 PSUM
        return nl.rsqrt(p)                                # GpSimd cannot read PSUM (NKI 0.5.0 nl.rsqrt)
    _raises(psum_rsqrt, (a,), r"nl\.rsqrt \(lowered to nki\.isa\): tensor_scalar: data is in psum .*POOL cannot "
                              r"access psum")

    def two_psum(x):
        p = nl.matmul(x, x, transpose_x=True)
        q = nl.matmul(x, x, transpose_x=True)
        return nl.add(p, q)
    _raises(two_psum, (a,), r"nl\.add \(lowered to nki\.isa\): tensor_tensor: data1 and data2 are both in psum")
    big = rng.standard_normal((16, 600)).astype(np.float32)
    _raises(lambda x: nl.matmul(x, x, transpose_x=True), (big,), r"nl\.matmul \(lowered to nki\.isa\): nl\.ndarray: .* 600 partitions")


def test_hbm_operand_refused(rng):
    a = rng.standard_normal((16, 32)).astype(np.float32)

    @nki.jit
    def k(x):
        y = nl.exp(x)
        out = nl.ndarray(x.shape, dtype=x.dtype, buffer=nl.shared_hbm)
        nl.store(out, value=y)
        return out
    with pytest.raises(NkiValidationError, match=r"nl\.exp: x is in shared_hbm .*nl\.load"):
        k(a)


# ---- shape-only mode, op= behaviour, signatures ------------------------------------------------
def _wrapper_kernel(x, w):
    t = nl.load(x)
    u = nl.load(w)
    y = nl.multiply(nl.rms_norm(t, u, axis=1, n=x.shape[1]), 0.5)
    s = nl.softmax(nl.add(y, t), axis=1)
    m = nl.matmul(nl.copy(s, dtype=nl.bfloat16), nl.copy(u, dtype=nl.bfloat16), transpose_x=True)
    r = nl.copy(m)
    out = nl.ndarray(m.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out, value=r)
    t_sum = nl.sum(nl.copy(nl.transpose(u)), axis=1)
    out2 = nl.ndarray(t_sum.shape, nl.float32, buffer=nl.shared_hbm)
    nl.store(out2, value=t_sum)
    return out, out2


def test_shape_only_trace_equals_execution(rng):
    x = rng.standard_normal((32, 64)).astype(np.float32)
    w = rng.standard_normal((32, 64)).astype(np.float32)
    k = nki.jit(_wrapper_kernel)
    with nkisim.trace.capture() as t_exec:
        k(x, w)
    with nkisim.trace.capture() as t_shape:
        k(nkisim.ShapeDtype(x.shape, "float32"), nkisim.ShapeDtype(w.shape, "float32"))
    assert len(t_exec.instructions) > 10
    assert t_exec.comparable() == t_shape.comparable()


def test_op_constants_still_work_as_op_arguments(xy):
    def body(a, b):
        o = nl.ndarray(a.shape, nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=o, data1=a, data2=b, op=nl.add)
        nisa.activation(dst=o, op=nl.exp, data=o)
        return o
    assert np.allclose(run_nl(body, xy), np.exp(xy[0] + xy[1]), rtol=1e-6)


def test_signatures_match_the_0_6_api():
    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "docs", "nki-api-0.6.json")
    if not os.path.exists(spec):
        pytest.skip("API spec not present")
    fns = json.load(open(spec))["modules"]["nki.language"]["functions"]
    from nkisim.experimental import WRAPPERS
    checked = 0
    for name in WRAPPERS:
        params = [(p["name"], p["default"]) for p in fns[name]]
        sig = inspect.signature(getattr(nl, name))
        got = [(p.name, None if p.default is p.empty else repr(p.default)) for p in sig.parameters.values()]
        assert [g[0] for g in got] == [p[0] for p in params], name
        assert [g[1] for g in got] == [p[1] for p in params], name
        checked += 1
    skipped = {"rand", "random_seed", "dropout"}
    assert set(WRAPPERS) >= {n for n in fns if n not in skipped and hasattr(nl, n) and
                             type(getattr(nl, n)).__name__ == "Op"}
    assert checked >= 70
