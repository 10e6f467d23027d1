"""Hardware-like numerics (nkisim/numerics.py): off by default, bounded, deterministic, shape-only unaffected."""
import math

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import numerics as nm_ctx
from nkisim.numerics import (DEFAULT_ACT_REL_ERROR, EXACT, FP32_MATMUL_FORMS, current, unit_noise)
from tests.nkisim.nkisim_helpers import run_op

F32 = np.float32
EPS32 = 2.0 ** -24          # half an fp32 ulp, relative


def _act(func, x, bias=None, reduce=False):
    """activation(op=func) of x [P, F] fp32 (bias: a (P, 1) tile); with reduce: also the row sums."""
    op = getattr(nl, func)
    P = x.shape[0]

    def body(*tiles):
        t, o = tiles[0], tiles[-1]
        b = tiles[1] if bias is not None else None
        if reduce:
            r = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
            nisa.activation_reduce(dst=o[:, 0:x.shape[1]], op=op, data=t, reduce_op=nl.add, reduce_res=r, bias=b)
            nisa.tensor_copy(dst=o[:, x.shape[1]:x.shape[1] + 1], src=r)
        else:
            nisa.activation(dst=o, op=op, data=t, bias=b)
    inputs = [x] if bias is None else [x, bias]
    width = x.shape[1] + (1 if reduce else 0)
    return run_op(body, inputs, (P, width), nl.float32)


def _matmul(S, V):
    """nc_matmul of SBUF operands S [K, M], V [K, N] -> fp32 [M, N] (S.T @ V)."""
    M, N = S.shape[1], V.shape[1]

    def body(s, v, o):
        p = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=v)
        nisa.tensor_copy(dst=o, src=p)
    return run_op(body, [S, V], (M, N), nl.float32)


REF = {
    "exp": np.exp, "sigmoid": lambda x: 1 / (1 + np.exp(-x)), "silu": lambda x: x / (1 + np.exp(-x)),
    "tanh": np.tanh, "softplus": lambda x: np.log1p(np.exp(x)), "rsqrt": lambda x: 1 / np.sqrt(x),
}


@pytest.fixture
def x(rng):
    return rng.normal(0, 2, (128, 96)).astype(F32)


def test_off_by_default_and_restored(x, rng):
    assert current() is EXACT and not current().hardware_like
    S, V = rng.normal(size=(128, 64)).astype(F32), rng.normal(size=(128, 80)).astype(F32)
    y0, m0 = _act("exp", x), _matmul(S, V)
    assert np.array_equal(y0, np.exp(x))                                   # nkisim's exact results
    np.testing.assert_allclose(m0, np.matmul(S.T.astype(np.float64), V), rtol=1e-5, atol=1e-5)
    with nm_ctx("hardware-like", seed=3) as setting:
        assert current() is setting and setting.hardware_like
        assert not np.array_equal(_act("exp", x), y0)
        assert not np.array_equal(_matmul(S, V), m0)
    assert current() is EXACT
    assert np.array_equal(_act("exp", x), y0) and np.array_equal(_matmul(S, V), m0)


def test_restored_after_an_error():
    with pytest.raises(RuntimeError):
        with nm_ctx("hardware-like"):
            raise RuntimeError("inside")
    assert current() is EXACT


def test_exact_mode_block_is_the_default(x):
    with nm_ctx("exact", act_rel_error=0.1):
        assert np.array_equal(_act("exp", x), np.exp(x))


@pytest.mark.parametrize("func", sorted(REF))
def test_act_error_bounded_and_present(func, x):
    xin = np.abs(x) + F32(0.01) if func == "rsqrt" else x
    exact = REF[func](xin.astype(np.float64))
    e = DEFAULT_ACT_REL_ERROR
    with nm_ctx("hardware-like", seed=11, act_segment_bits=23):
        y = _act(func, xin)
    assert np.isfinite(y).all()
    rel = np.abs(y - exact) / np.abs(exact)
    assert rel.max() <= e + 8 * EPS32                  # numpy's own fp32 error included
    assert rel.max() > 0.9 * e                         # the full bound is reached somewhere
    assert 0.3 * e < np.median(rel) < 0.7 * e          # u spread over [-1, 1): median |u| ~ 0.5


@pytest.mark.parametrize("err", [2.0 ** -12, 1e-2])
def test_act_error_scales_with_the_parameter(err, x):
    with nm_ctx("hardware-like", act_rel_error=err):
        y = _act("sigmoid", x)
    rel = np.abs(y / REF["sigmoid"](x.astype(np.float64)) - 1)
    assert 0.5 * err < rel.max() <= err + 8 * EPS32


@pytest.mark.parametrize("func", ["copy", "relu", "abs", "square"])
def test_exact_functions_unchanged(func, x):
    base = _act(func, x)
    with nm_ctx("hardware-like", act_rel_error=0.1):
        assert np.array_equal(_act(func, x), base)


def test_act_deterministic_seeded_and_value_keyed(x):
    with nm_ctx("hardware-like", seed=5):
        a, b = _act("exp", x), _act("exp", x)
        # same input value anywhere -> same output (a function of the value, not of position or order)
        flipped = _act("exp", np.ascontiguousarray(x[::-1, ::-1]))
    with nm_ctx("hardware-like", seed=6):
        c = _act("exp", x)
    assert np.array_equal(a, b)
    assert np.array_equal(flipped, a[::-1, ::-1])
    assert not np.array_equal(a, c)


def test_act_independent_of_cores():
    """LNC=2: each core computes half the rows; the bits equal the LNC=1 run (scheduling-independent)."""
    x = np.random.default_rng(2).normal(size=(128, 32)).astype(F32)

    @nki.jit
    def k(x):
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        h = x.shape[0] // nl.num_programs(0)
        pid = nl.program_id(0)
        t = nl.ndarray((h, x.shape[1]), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[pid * h:(pid + 1) * h, :])
        y = nl.ndarray((h, x.shape[1]), nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=y, op=nl.silu, data=t)
        nisa.dma_copy(dst=out[pid * h:(pid + 1) * h, :], src=y)
        return out
    with nm_ctx("hardware-like", seed=9):
        one, two, again = k(x), k[2](x), k[2](x)
    assert np.array_equal(one, two) and np.array_equal(two, again)
    assert not np.array_equal(one, k(x))          # outside the block: nkisim's exact silu


def test_act_segments_share_their_error():
    """Inputs with the same sign, exponent and top act_segment_bits mantissa bits get the same u."""
    base = np.array([1.0, 1.5, -3.25, 1000.0], F32)
    near = (base.view(np.uint32) + np.uint32(5)).view(F32)             # last mantissa bits differ
    far = (base.view(np.uint32) + np.uint32(1 << 17)).view(F32)        # bit 17 is inside the top 7 bits
    u = lambda v, bits: unit_noise(1, "exp", v, bits)
    assert np.array_equal(u(base, 7), u(near, 7))
    assert not np.array_equal(u(base, 7), u(far, 7))
    assert not np.array_equal(u(base, 23), u(near, 23))


def test_activation_reduce_sums_the_perturbed_outputs(x):
    bias = np.full((128, 1), 0.25, F32)
    with nm_ctx("hardware-like", seed=4):
        out = _act("exp", x, bias=bias, reduce=True)
    y, r = out[:, :-1], out[:, -1]
    exact = np.exp(x.astype(np.float64) + 0.25)
    assert np.abs(y / exact - 1).max() <= DEFAULT_ACT_REL_ERROR + 8 * EPS32       # bias applied before f
    np.testing.assert_allclose(r, y.sum(axis=1, dtype=np.float64), rtol=1e-6)


def _bound(S, V, per_product):
    return per_product * np.matmul(np.abs(S).T.astype(np.float64), np.abs(V).astype(np.float64))


@pytest.mark.parametrize("form,per_product", [("bf16x3", 3 * 2.0 ** -18), ("tf32", 2 * 2.0 ** -11 + 2.0 ** -22),
                                              ("bf16", 2 * 2.0 ** -9 + 2.0 ** -18)])
def test_fp32_matmul_forms_bounded(form, per_product, rng):
    S, V = rng.normal(size=(128, 64)).astype(F32), rng.normal(size=(128, 256)).astype(F32)
    exact = np.matmul(S.T.astype(np.float64), V.astype(np.float64))
    with nm_ctx("hardware-like", fp32_matmul=form):
        got = _matmul(S, V)
    err = np.abs(got - exact)
    accum = 128 * 2.0 ** -23 * _bound(S, V, 1.0)                        # fp32 accumulation of 128 products
    assert (err <= _bound(S, V, per_product) + accum).all()
    sgemm_err = np.abs(_matmul(S, V) - exact).max()                    # outside the block: one fp32 sgemm
    assert err.max() > 4 * sgemm_err                                    # really less precise than one sgemm


def test_bf16x3_is_between_fp32_and_bf16(rng):
    S, V = rng.normal(size=(128, 128)).astype(F32), rng.normal(size=(128, 128)).astype(F32)
    exact = np.matmul(S.T.astype(np.float64), V.astype(np.float64))
    errs = {}
    for form in FP32_MATMUL_FORMS:
        with nm_ctx("hardware-like", fp32_matmul=form):
            errs[form] = np.abs(_matmul(S, V) - exact).max()
    assert errs["fp32"] < errs["bf16x3"] < errs["tf32"] < errs["bf16"]
    base = _matmul(S, V)
    with nm_ctx("hardware-like", fp32_matmul="fp32"):
        assert np.array_equal(_matmul(S, V), base)                      # 'fp32' form = nkisim's exact sgemm


def test_bf16_matmul_unaffected(rng):
    S = rng.normal(size=(128, 64)).astype(ml_dtypes.bfloat16)
    V = rng.normal(size=(128, 96)).astype(ml_dtypes.bfloat16)
    base = _matmul(S, V)
    with nm_ctx("hardware-like", fp32_matmul="bf16"):
        assert np.array_equal(_matmul(S, V), base)


def test_fp32_matmul_deterministic(rng):
    S, V = rng.normal(size=(64, 32)).astype(F32), rng.normal(size=(64, 48)).astype(F32)
    with nm_ctx("hardware-like", seed=1):
        a = _matmul(S, V)
    with nm_ctx("hardware-like", seed=2):
        b = _matmul(S, V)
    assert np.array_equal(a, b)          # the matmul form does not depend on the seed or the run


def test_shape_only_trace_unaffected():
    def body(s, v, o):
        p = nl.ndarray((64, 48), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=v)
        nisa.activation(dst=o, op=nl.exp, data=p)

    def kern(a, b):
        sa = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
        sb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=sa, src=a)
        nisa.dma_copy(dst=sb, src=b)
        o = nl.ndarray((64, 48), nl.float32, buffer=nl.sbuf)
        body(sa, sb, o)
        out = nl.ndarray((64, 48), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=o)
        return out
    k = nki.jit(kern)
    args = (nkisim.ShapeDtype((32, 64), "float32"), nkisim.ShapeDtype((32, 48), "float32"))
    traces = []
    for mode in ("exact", "hardware-like"):
        with nm_ctx(mode), nkisim.trace.capture() as tr:
            out = k(*args)
        assert isinstance(out, nkisim.ShapeDtype)
        traces.append(tr.comparable())
    assert traces[0] == traces[1] and len(traces[0]) > 0


@pytest.mark.parametrize("kw,msg", [({"mode": "fast"}, "mode must be"), ({"fp32_matmul": "fp64"}, "fp32_matmul"),
                                    ({"act_rel_error": -1e-3}, "act_rel_error"),
                                    ({"act_rel_error": 0.5}, "act_rel_error"), ({"seed": -1}, "seed"),
                                    ({"seed": 1.5}, "seed"), ({"act_segment_bits": 24}, "act_segment_bits")])
def test_bad_settings_refused(kw, msg):
    with pytest.raises(ValueError, match=msg):
        with nm_ctx(**kw):
            pass
    assert current() is EXACT


def test_numerics_to_dict_round_trip():
    with nm_ctx("hardware-like", seed=7, act_rel_error=1e-4, fp32_matmul="tf32") as s:
        d = s.to_dict()
    assert d == {"mode": "hardware-like", "seed": 7, "act_rel_error": 1e-4,
                 "act_segment_bits": 7, "fp32_matmul": "tf32"}
    assert math.isclose(DEFAULT_ACT_REL_ERROR, 2.0 ** -9)
