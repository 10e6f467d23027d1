"""PRNG instructions (rng, dropout, set_rng_seed, rand_set_state, rand_get_state), the nl.rand /
nl.random_seed / nl.dropout wrappers (nkisim.language_random) and the GpSimd sequence_bounds.

Everything is deterministic: the generator is seeded explicitly (or from the fixed launch-start state), so
the statistical bounds below either always pass or always fail for a given implementation."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim import NkiValidationError
from nkisim.isa.pool import sequence_bounds_reference
from nkisim.isa.rng import expand_seed, xorwow
from nkisim_helpers import run_op

F32 = np.float32
BF16 = ml_dtypes.bfloat16
DUMMY = np.zeros((1, 1), F32)


def sb(shape, dtype=nl.float32):
    return nl.ndarray(shape, dtype, buffer=nl.sbuf)


def out_of(t):
    o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=o, src=t)
    return o


def states(n=128, base=1):
    """Distinct per-lane XORWOW states (n, 6) uint32."""
    return expand_seed(base, n).T.copy()


def load(t_hbm):
    t = nl.ndarray(t_hbm.shape, t_hbm.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=t_hbm)
    return t


# ---- the generator -----------------------------------------------------------------------------
def _xorwow_scalar(s, n):
    """Marsaglia's xorwow written out on Python ints, one stream."""
    x, y, z, w, v, d = (int(a) for a in s)
    out = []
    for _ in range(n):
        t = (x ^ (x >> 2)) & 0xFFFFFFFF
        x, y, z, w = y, z, w, v
        v = (v ^ ((v << 4) & 0xFFFFFFFF)) ^ (t ^ ((t << 1) & 0xFFFFFFFF))
        d = (d + 362437) & 0xFFFFFFFF
        out.append((v + d) & 0xFFFFFFFF)
    return out, [x, y, z, w, v, d]


def test_xorwow_matches_scalar_definition():
    st = np.array([[123456789], [362436069], [521288629], [88675123], [5783321], [6615241]], np.uint32)
    st = np.concatenate([st, expand_seed(7, 3)], axis=1)
    want = [_xorwow_scalar(st[:, j], 50) for j in range(st.shape[1])]
    got = xorwow(st, 50)
    for j, (vals, end) in enumerate(want):
        assert got[j].tolist() == vals
        assert st[:, j].tolist() == end


def test_expand_seed_distinct_and_deterministic():
    a, b, c = expand_seed(1, 512), expand_seed(1, 512), expand_seed(2, 512)
    assert (a == b).all() and not (a == c).all()
    assert len({tuple(col) for col in a.T}) == 512          # every lane/stream different


# ---- rng ---------------------------------------------------------------------------------------
def _rng_kernel(engine, dtype="uint32", shape=(128, 64), seeds=None):
    def k(s):
        t = sb(shape, dtype)
        if seeds != None:  # noqa: E711 (the NKI front end refuses "is not")
            nisa.rand_set_state(src_seeds=load(s))
        nisa.rng(dst=t, engine=engine)
        return out_of(t)
    return nki.jit(k)


@pytest.mark.parametrize("engine", [nisa.engine.gpsimd, nisa.engine.vector, nisa.engine.unknown])
def test_rng_deterministic_across_runs(engine):
    k = _rng_kernel(engine)
    a, b = k(DUMMY), k(DUMMY)
    assert a.dtype == np.uint32 and (a == b).all()
    assert len(np.unique(a)) > 0.99 * a.size                 # 32 random bits: (almost) no repeats
    assert len({r.tobytes() for r in a}) == 128               # lanes differ


def test_rng_seeded_gpsimd_streams_follow_the_state():
    s1, s2 = states(base=1), states(base=2)
    k = _rng_kernel(nisa.engine.gpsimd, seeds=True)
    a, a2, b = k(s1), k(s1), k(s2)
    assert (a == a2).all() and (a != b).mean() > 0.99
    # lane p's row is its XORWOW stream, element j = draw j (nkisim's documented order)
    want = xorwow(s1.T.copy(), 64)
    assert (a == want).all()
    # identical lane states -> identical rows (aws-neuron/nki-library experimental/rng: "unless the 128 lanes hold
    # different seeds they emit identical streams")
    same = np.repeat(s1[:1], 128, axis=0)
    c = k(same)
    assert (c == c[0]).all()


def test_rng_state_round_trip_reproduces_continuation():
    def k(s):
        nisa.rand_set_state(src_seeds=load(s))
        first = sb((128, 16), nl.uint32)
        nisa.rng(dst=first, engine=nisa.engine.gpsimd)
        saved = sb((128, 6), nl.uint32)
        nisa.rand_get_state(dst=saved, engine=nisa.engine.gpsimd)
        a = sb((128, 40), nl.uint32)
        nisa.rng(dst=a, engine=nisa.engine.gpsimd)
        nisa.rand_set_state(src_seeds=saved, engine=nisa.engine.unknown)
        b = sb((128, 24), nl.uint32)                      # split the same 40 draws into 24 + 16
        nisa.rng(dst=b, engine=nisa.engine.gpsimd)
        c = sb((128, 16), nl.uint32)
        nisa.rng(dst=c, engine=nisa.engine.gpsimd)
        return out_of(first), out_of(saved), out_of(a), out_of(b), out_of(c)
    s = states()
    first, saved, a, b, c = nki.jit(k)(s)
    assert (np.concatenate([b, c], axis=1) == a).all()
    st = s.T.copy()
    assert (xorwow(st, 16) == first).all() and (st.T == saved).all()


def test_rand_set_state_on_lane_subrange_keeps_other_lanes():
    def k(s, s2):
        nisa.rand_set_state(src_seeds=load(s))
        sub = load(s2)
        nisa.rand_set_state(src_seeds=sub[32:64], engine=nisa.engine.gpsimd)     # lanes 32..63
        st = sb((128, 6), nl.uint32)
        nisa.rand_get_state(dst=st)
        part = sb((64, 6), nl.uint32)
        nisa.rand_get_state(dst=part)                                            # lanes 0..63
        t = sb((128, 8), nl.uint32)
        nisa.rng(dst=t[32:64], engine=nisa.engine.gpsimd)                       # lanes 32..63 only
        r = sb((32, 8), nl.uint32)
        nisa.tensor_copy(dst=r, src=t[32:64])
        return out_of(st), out_of(part), out_of(r)
    s1, s2 = states(base=1), states(base=2)
    st, part, r = nki.jit(k)(s1, s2)
    want = s1.copy()
    want[32:64] = s2[32:64]
    assert (st == want).all() and (part == want[:64]).all()
    assert (r == xorwow(s2[32:64].T.copy(), 8)).all()           # partition p of the view = lane 32 + p


@pytest.mark.parametrize("dtype, npdt", [("uint8", np.uint8), ("int8", np.int8), ("uint16", np.uint16),
                                         ("int16", np.int16), ("int32", np.int32)])
def test_rng_integer_dst_keeps_least_significant_bits(dtype, npdt):
    s = states()
    bits = xorwow(s.T.copy(), 32)
    got = _rng_kernel(nisa.engine.gpsimd, dtype=dtype, shape=(128, 32), seeds=True)(s)
    want = bits.astype(np.dtype(f"uint{8 * np.dtype(npdt).itemsize}")).view(npdt)
    assert got.dtype == npdt and (got == want).all()


def test_rng_uniformity_chi_square():
    """Top 4 bits and low 4 bits of 128 x 1024 draws of each engine in 16 bins: chi-square with 15 d.o.f. below 40
    (p ~ 5e-4); deterministic given the seed."""
    def k(s):
        seed = sb((1, 1), nl.uint32)
        nisa.memset(dst=seed, value=12345)
        nisa.set_rng_seed(src_seeds=seed)
        nisa.rand_set_state(src_seeds=load(s))
        a = sb((128, 1024), nl.uint32)
        nisa.rng(dst=a, engine=nisa.engine.gpsimd)
        b = sb((128, 1024), nl.uint32)
        nisa.rng(dst=b)
        return out_of(a), out_of(b)
    for x in nki.jit(k)(states()):
        x = x.reshape(-1)
        for bins in (x >> 28, x & 15):
            n = np.bincount(bins.astype(np.int64), minlength=16)
            e = x.size / 16
            assert ((n - e) ** 2 / e).sum() < 40
        u = (x >> 8) * 2.0 ** -24
        assert abs(u.mean() - 0.5) < 5 * np.sqrt(1 / 12 / x.size)


def test_rng_vector_to_psum_and_seeded_by_set_rng_seed():
    def k(x):
        seed = sb((1, 1), nl.int32)
        nisa.memset(dst=seed, value=42)
        nisa.set_rng_seed(src_seeds=seed)
        p = nl.ndarray((128, 64), nl.uint32, buffer=nl.psum)
        nisa.rng(dst=p)                                   # Vector may write PSUM
        a = sb((128, 64), nl.uint32)
        nisa.tensor_copy(dst=a, src=p)
        nisa.set_rng_seed(src_seeds=seed)
        b = sb((128, 64), nl.uint32)
        nisa.rng(dst=b, engine=nisa.engine.vector)
        nisa.memset(dst=seed, value=43)
        nisa.set_rng_seed(src_seeds=seed)
        c = sb((128, 64), nl.uint32)
        nisa.rng(dst=c, engine=nisa.engine.vector)
        g = sb((128, 64), nl.uint32)
        nisa.rng(dst=g, engine=nisa.engine.gpsimd)        # separate engine state, unaffected by set_rng_seed
        return out_of(a), out_of(b), out_of(c), out_of(g)
    a, b, c, g = nki.jit(k)(DUMMY)
    assert (a == b).all() and (a != c).mean() > 0.99
    g0 = _rng_kernel(nisa.engine.gpsimd)(DUMMY)               # launch-start GpSimd state
    assert (g == g0).all()
    # Vector: element j of a lane is draw j // 4 of its sub-stream j % 4 (nkisim's documented order)
    st = expand_seed(42, 512, 0x0DDBA11 ^ 1)
    full = xorwow(st, 16).reshape(128, 4, 16).transpose(0, 2, 1).reshape(128, 64)
    assert (a == full).all()


def test_rng_vector_odd_free_size_and_views():
    def k(x):
        a = sb((64, 3, 7), nl.int16)                     # 21 elements per partition: 5 x 4 + 1
        nisa.rng(dst=a)
        b = sb((32, 5), nl.uint32)
        nisa.rng(dst=b)
        return out_of(a), out_of(b)
    a, b = nki.jit(k)(DUMMY)
    a2, b2 = nki.jit(k)(DUMMY)
    assert a.shape == (64, 3, 7) and (a == a2).all() and (b == b2).all()
    assert len(np.unique(a)) > 1000


def test_lnc2_cores_have_their_own_state():
    def k(s):
        out = nl.ndarray((2, 128, 8), nl.uint32, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        if pid == 0:
            nisa.rand_set_state(src_seeds=load(s))
        t = sb((128, 8), nl.uint32)
        nisa.rng(dst=t, engine=nisa.engine.gpsimd)
        nisa.dma_copy(dst=out[pid], src=t)
        return out
    o = nki.jit(k)[2](states())
    assert (o[0] == xorwow(states().T.copy(), 8)).all()
    assert (o[1] == _rng_kernel(nisa.engine.gpsimd, shape=(128, 8))(DUMMY)).all()


# ---- dropout -----------------------------------------------------------------------------------
def _seeded(seed=7):
    s = sb((1, 1), nl.uint32)
    nisa.memset(dst=s, value=seed)
    nisa.set_rng_seed(src_seeds=s)


def test_dropout_rates_zero_one_and_binomial_tolerance(rng):
    x = (rng.random((128, 512)) + 0.5).astype(F32)          # no zeros in the input

    def body(d, o):
        _seeded()
        nisa.dropout(dst=o, data=d, prob=0.3)
    out = run_op(body, [x], (128, 512), nl.float32)
    dropped = out == 0
    n, p = x.size, 0.3
    assert abs(dropped.sum() - n * p) < 6 * np.sqrt(n * p * (1 - p))
    assert (out[~dropped] == x[~dropped]).all()             # kept elements unchanged: no 1/(1-p) rescale
    assert (run_op(body, [x], (128, 512), nl.float32) == out).all()        # same seed, same mask
    for prob, want in ((0.0, x), (1.0, np.zeros_like(x))):
        o = run_op(lambda d, o, prob=prob: nisa.dropout(dst=o, data=d, prob=prob), [x], (128, 512), nl.float32)
        assert (o == want).all()


def test_dropout_mask_is_the_vector_stream():
    """dropout draws the same Vector PRNG bits as rng: dropped iff (bits >> 8) * 2**-24 < prob."""
    def k(x):
        d = load(x)
        _seeded(99)
        bits = sb((128, 64), nl.uint32)
        nisa.rng(dst=bits, engine=nisa.engine.vector)
        _seeded(99)
        o = sb((128, 64))
        nisa.dropout(dst=o, data=d, prob=0.25)
        return out_of(bits), out_of(o)
    bits, o = nki.jit(k)(np.ones((128, 64), F32))
    assert ((o == 0) == ((bits >> 8) * 2.0 ** -24 < np.float32(0.25))).all()


def test_dropout_prob_tile_per_partition(rng):
    x = np.ones((128, 256), F32)
    prob = np.linspace(0, 1, 128, dtype=F32).reshape(128, 1)
    prob[5] = 2.0                                            # >= 1 drops all (SDK example uses such values)
    prob[6] = -1.0

    def body(d, pr, o):
        _seeded()
        nisa.dropout(dst=o, data=d, prob=pr)
    out = run_op(body, [x, prob], (128, 256), nl.float32)
    rate = (out == 0).mean(axis=1)
    assert rate[0] == 0 and rate[127] == 1 and rate[5] == 1 and rate[6] == 0
    n = 256 * 120
    mid = np.r_[1:5, 7:127]
    assert abs((out[mid] == 0).sum() - prob[mid].sum() * 256) < 6 * np.sqrt(n / 4)


def test_dropout_integer_and_bf16_data():
    xi = np.arange(1, 128 * 32 + 1, dtype=np.int32).reshape(128, 32) * 1000003     # > 2**24: copied bit-exactly
    pr = np.full((128, 1), 0.5, F32)

    def body(d, p, o):
        nisa.dropout(dst=o, data=d, prob=p)
    out = run_op(body, [xi, pr], (128, 32), nl.int32)
    kept = out != 0
    assert 0.4 < kept.mean() < 0.6 and (out[kept] == xi[kept]).all()
    xb = np.full((16, 64), 1.5, BF16)
    pb = np.full((16, 1), 0.5, BF16)                     # float data: any float prob dtype
    out = run_op(body, [xb, pb], (16, 64), nl.bfloat16)
    assert set(np.unique(out.astype(F32))) == {0.0, 1.5}


@pytest.mark.parametrize("case, match", [
    ("dtype", "dst dtype bfloat16 must match data dtype float32"),
    ("prob_range", r"prob=1.5 is not a probability"),
    ("prob_neg", r"prob=-0.1 is not a probability"),
    ("prob_shape", r"prob tile has shape \[8, 2\], expected \(8, 1\)"),
    ("int_prob", "prob must be float32, got bfloat16"),
    ("prob_int_tile", "prob tile must have a float dtype, got int32"),
    ("shape", "elements per partition"),
    ("hbm", "expected sbuf/psum"),
    ("psum2", "both in psum"),
])
def test_dropout_refusals(case, match):
    def k(x):
        d = sb((8, 16))
        nisa.memset(dst=d, value=1.0)
        o = sb((8, 16))
        if case == "dtype":
            nisa.dropout(dst=sb((8, 16), nl.bfloat16), data=d, prob=0.5)
        elif case == "prob_range":
            nisa.dropout(dst=o, data=d, prob=1.5)
        elif case == "prob_neg":
            nisa.dropout(dst=o, data=d, prob=-0.1)
        elif case == "prob_shape":
            nisa.dropout(dst=o, data=d, prob=sb((8, 2)))
        elif case == "int_prob":
            di = sb((8, 16), nl.int32)
            nisa.dropout(dst=sb((8, 16), nl.int32), data=di, prob=sb((8, 1), nl.bfloat16))
        elif case == "prob_int_tile":
            nisa.dropout(dst=o, data=d, prob=sb((8, 1), nl.int32))
        elif case == "shape":
            nisa.dropout(dst=sb((8, 8)), data=d, prob=0.5)
        elif case == "hbm":
            nisa.dropout(dst=o, data=x, prob=0.5)
        elif case == "psum2":
            pd = nl.ndarray((8, 16), nl.float32, buffer=nl.psum)
            pp = nl.ndarray((8, 1), nl.float32, buffer=nl.psum)
            nisa.dropout(dst=o, data=pd, prob=pp)
        return out_of(o)
    with pytest.raises(NkiValidationError, match=match):
        nki.jit(k)(np.ones((8, 16), F32))


# ---- refusals of rng / state ops ---------------------------------------------------------------
@pytest.mark.parametrize("case, exc, match", [
    ("float_dst", NkiValidationError, r"rng: dst must be an integer type .* got float32"),
    ("bool_dst", NkiValidationError, r"rng: dst must be an integer type .* got bool_"),
    ("gpsimd_psum", NkiValidationError, r"rng: dst is in psum .*\(POOL cannot access psum\)"),
    ("scalar_engine", NkiValidationError, r"rng: engine=engine.scalar is not supported"),
    ("raw_engine", NkiValidationError, r"rng: engine must be a nki.isa.engine member"),
    ("hbm_dst", NkiValidationError, r"rng: dst is in shared_hbm"),
    ("set_vector", NkiValidationError, r"rand_set_state: engine=engine.vector is not supported on trn2.*"
                                       r"NeuronCore-v4"),
    ("get_vector", NkiValidationError, r"rand_get_state: engine=engine.vector is not supported on trn2"),
    ("set_dtype", NkiValidationError, r"rand_set_state: src_seeds must be uint32, got int32"),
    ("set_words", NkiValidationError, r"rand_set_state: src_seeds has shape \[128, 5\]; expected a 2-D \(lanes, 6\)"),
    ("set_3d", NkiValidationError, r"rand_set_state: src_seeds has shape \[128, 2, 3\]; expected a 2-D"),
    ("set_psum", NkiValidationError, r"rand_set_state: src_seeds is in psum"),
    ("get_dtype", NkiValidationError, r"rand_get_state: dst must be uint32, got float32"),
    ("get_words", NkiValidationError, r"rand_get_state: dst has shape \[128, 24\]"),
    ("get_psum", NkiValidationError, r"rand_get_state: dst is in psum"),
    ("seed_shape", NkiValidationError, r"set_rng_seed: src_seeds must be a \[1, 1\] tensor, got \[1, 2\]"),
    ("seed_dtype", NkiValidationError, r"set_rng_seed: src_seeds must hold a 32-bit value .* got int16"),
    ("seed_hbm", NkiValidationError, r"set_rng_seed: src_seeds is in shared_hbm"),
    ("seed_int", TypeError, r"must be a tensor"),
    ("rand2", NkiValidationError, r"nisa.rand2: NeuronCore-v4"),
])
def test_rng_state_refusals(case, exc, match):
    def k(x):
        if case == "float_dst":
            nisa.rng(dst=sb((8, 8)))
        elif case == "bool_dst":
            nisa.rng(dst=sb((8, 8), nl.bool_))
        elif case == "gpsimd_psum":
            nisa.rng(dst=nl.ndarray((8, 8), nl.uint32, buffer=nl.psum), engine=nisa.engine.gpsimd)
        elif case == "scalar_engine":
            nisa.rng(dst=sb((8, 8), nl.uint32), engine=nisa.engine.scalar)
        elif case == "raw_engine":
            nisa.rng(dst=sb((8, 8), nl.uint32), engine=3)
        elif case == "hbm_dst":
            nisa.rng(dst=nl.ndarray((8, 8), nl.uint32, buffer=nl.shared_hbm))
        elif case == "set_vector":
            nisa.rand_set_state(src_seeds=sb((128, 24), nl.uint32), engine=nisa.engine.vector)
        elif case == "get_vector":
            nisa.rand_get_state(dst=sb((128, 24), nl.uint32), engine=nisa.engine.vector)
        elif case == "set_dtype":
            nisa.rand_set_state(src_seeds=sb((128, 6), nl.int32))
        elif case == "set_words":
            nisa.rand_set_state(src_seeds=sb((128, 5), nl.uint32))
        elif case == "set_3d":
            nisa.rand_set_state(src_seeds=sb((128, 2, 3), nl.uint32))
        elif case == "set_psum":
            nisa.rand_set_state(src_seeds=nl.ndarray((128, 6), nl.uint32, buffer=nl.psum))
        elif case == "get_dtype":
            nisa.rand_get_state(dst=sb((128, 6)))
        elif case == "get_words":
            nisa.rand_get_state(dst=sb((128, 24), nl.uint32))
        elif case == "get_psum":
            nisa.rand_get_state(dst=nl.ndarray((128, 6), nl.uint32, buffer=nl.psum))
        elif case == "seed_shape":
            nisa.set_rng_seed(src_seeds=sb((1, 2), nl.uint32))
        elif case == "seed_dtype":
            nisa.set_rng_seed(src_seeds=sb((1, 1), nl.int16))
        elif case == "seed_hbm":
            nisa.set_rng_seed(src_seeds=nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm))
        elif case == "seed_int":
            nisa.set_rng_seed(src_seeds=42)
        elif case == "rand2":
            nisa.rand2(dst=sb((8, 8)), min=0.0, max=1.0)
        return x
    with pytest.raises(exc, match=match):
        nki.jit(k)(DUMMY)


# ---- nl wrappers -------------------------------------------------------------------------------
def test_nl_rand_uniform_and_reproducible():
    def k(x):
        seed = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=seed, value=42)
        nl.random_seed(seed)
        a = nl.rand((128, 512), nl.float32)
        nl.random_seed(seed)
        b = nl.rand((128, 512), dtype=nl.float32, buffer=nl.sbuf, name="b")
        c = nl.rand((128, 256), nl.bfloat16, buffer=nl.psum)
        h = nl.rand((64, 32), nl.float16, nl.shared_hbm)
        cs = sb((128, 256), nl.bfloat16)
        nisa.tensor_copy(dst=cs, src=c)
        return out_of(a), out_of(b), out_of(cs), h
    a, b, c, h = nki.jit(k)(DUMMY)
    assert a.dtype == np.float32 and (a == b).all()
    for v, bits in ((a, 24), (c, 8), (h, 11)):
        f = v.astype(np.float64)
        assert f.min() >= 0 and f.max() < 1                  # [0, 1): never rounds up to 1.0
        assert (f * 2 ** bits == np.floor(f * 2 ** bits)).all()
        assert abs(f.mean() - 0.5) < 5 * np.sqrt(1 / 12 / f.size)
    n = np.bincount((a.reshape(-1) * 16).astype(np.int64), minlength=16)
    assert ((n - a.size / 16) ** 2 / (a.size / 16)).sum() < 40


def test_nl_dropout_wrapper(rng):
    x = (rng.random((128, 128)) + 1).astype(F32)

    def k(xh):
        xt = load(xh)
        seed = nl.ndarray((1, 1), nl.uint32, buffer=nl.sbuf)
        nisa.memset(dst=seed, value=5)
        nl.random_seed(seed)
        a = nl.dropout(xt, 0.5)
        nl.random_seed(seed)
        b = nl.dropout(xt, 0.5, dtype=nl.bfloat16)             # same mask, cast to bf16
        rate = nl.ndarray((128, 1), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=rate, value=0.0)
        c = nl.dropout(xt, rate)
        return out_of(a), out_of(b), out_of(c)
    a, b, c = nki.jit(k)(x)
    assert b.dtype == BF16 and ((a == 0) == (b == 0)).all()
    assert (b[a != 0] == a[a != 0].astype(BF16)).all() and (a[a != 0] == x[a != 0]).all()
    assert 0.45 < (a == 0).mean() < 0.55 and (c == x).all()


@pytest.mark.parametrize("case, exc, match", [
    ("rand_int", NkiValidationError, r"nl.rand: dtype int32 cannot hold uniform \[0, 1\) values"),
    ("seed_scalar", TypeError, r"nl.random_seed: seed must be a \[1, 1\] SBUF/PSUM tensor"),
    ("dropout_hbm", NkiValidationError, r"nl.dropout: x is in shared_hbm"),
    ("rand_buffer", TypeError, r"nl.rand: buffer must be"),
])
def test_nl_wrapper_refusals(case, exc, match):
    def k(x):
        if case == "rand_int":
            nl.rand((8, 8), nl.int32)
        elif case == "seed_scalar":
            nl.random_seed(42)
        elif case == "dropout_hbm":
            nl.dropout(x, 0.5)
        elif case == "rand_buffer":
            nl.rand((8, 8), nl.float32, buffer="sbuf")
        return x
    with pytest.raises(exc, match=match):
        nki.jit(k)(DUMMY)


# ---- trace and shape-only mode -------------------------------------------------------------------
def _trace_kernel(x, s, ids):
    xt = load(x)
    nisa.rand_set_state(src_seeds=load(s))
    st = sb((128, 6), nl.uint32)
    nisa.rand_get_state(dst=st)
    r = sb((128, 16), nl.int32)
    nisa.rng(dst=r, engine=nisa.engine.gpsimd)
    seed = sb((1, 1), nl.int32)
    nisa.memset(dst=seed, value=3)
    nl.random_seed(seed)
    u = nl.rand((128, 16), nl.float32)
    d = nl.dropout(xt, 0.5)
    seg = load(ids)
    bounds = nl.ndarray((1, 2, ids.shape[1]), nl.int32, buffer=nl.sbuf)
    nisa.sequence_bounds(dst=bounds, segment_ids=seg)
    return out_of(r), out_of(u), out_of(d), out_of(st), out_of(bounds)


def test_trace_records_and_shape_only_equals_execution():
    x, s = np.ones((128, 16), F32), states()
    ids = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], np.int32)
    k = nki.jit(_trace_kernel)
    with nkisim.trace.capture() as t_exec:
        k(x, s, ids)
    shapes = tuple(nkisim.ShapeDtype(a.shape, str(a.dtype)) for a in (x, s, ids))
    with nkisim.trace.capture() as t_shape:
        outs = k(*shapes)
    assert all(isinstance(o, nkisim.ShapeDtype) for o in outs)
    assert t_exec.comparable() == t_shape.comparable()
    ops = [(r["engine"], r["op"]) for r in t_exec.instructions if r["op"] != "dma_copy"]
    assert ops == [("POOL", "rand_set_state"), ("POOL", "rand_get_state"), ("POOL", "rng"), ("DVE", "memset"),
                   ("DVE", "set_rng_seed"), ("DVE", "rng"), ("DVE", "tensor_scalar"), ("DVE", "tensor_scalar"),
                   ("DVE", "dropout"), ("POOL", "sequence_bounds")]
    recs = {r["op"]: r for r in t_exec.instructions}
    assert recs["rng"]["rng"] == {"engine": "DVE", "lanes": [0, 128], "draws": 16}
    assert recs["rand_get_state"]["writes"][0]["part"] == [0, 128]
    assert recs["rand_set_state"]["reads"][0]["arg"] == "src_seeds"
    assert recs["dropout"]["prob"] == 0.5 and [g["arg"] for g in recs["dropout"]["reads"]] == ["data"]
    assert recs["sequence_bounds"]["shapes"] == {"segment_ids": [1, 9], "dst": [1, 2, 9]}


# ---- sequence_bounds -----------------------------------------------------------------------------
def _bounds_loop(seq):
    """Element-by-element model written from the docs' description: neighbours with the same non-zero id share a
    segment; start = first index, end = last index + 1; id 0 -> (n, -1)."""
    n = len(seq)
    starts, ends = [0] * n, [0] * n
    for i in range(n):
        if seq[i] == 0:
            starts[i], ends[i] = n, -1
            continue
        a = i
        while a > 0 and seq[a - 1] == seq[i]:
            a -= 1
        b = i
        while b + 1 < n and seq[b + 1] == seq[i]:
            b += 1
        starts[i], ends[i] = a, b + 1
    return np.array([starts, ends])


def _bounds(ids, dst_dtype=nl.int32, dst_shape=None):
    n = ids.shape[1]

    def k(x):
        seg = load(x)
        o = nl.ndarray(dst_shape or (1, 2, n), dst_dtype, buffer=nl.sbuf)
        nisa.sequence_bounds(dst=o, segment_ids=seg)
        return out_of(o)
    return nki.jit(k)(ids)


def test_sequence_bounds_doc_example():
    ids = np.array([[0, 1, 1, 2, 2, 2, 0, 3, 3]], np.int32)
    out = _bounds(ids)
    assert out.tolist() == [[[9, 1, 1, 3, 3, 3, 9, 7, 7], [-1, 3, 3, 6, 6, 6, -1, 9, 9]]]


@pytest.mark.parametrize("case", ["all_padding", "single", "many", "sorted_random", "repeat_id", "one"])
def test_sequence_bounds_vs_model(case, rng):
    n = 64
    ids = {"all_padding": np.zeros(n), "single": np.full(n, 5), "one": np.array([3]),
           "many": np.repeat(np.arange(1, 17), 4),
           "sorted_random": np.sort(rng.integers(0, 12, n)),
           "repeat_id": np.array([1, 1, 2, 1, 1, 0, 0, 1] * 8)}[case]
    ids = ids.reshape(1, -1)
    want = _bounds_loop(ids[0])
    assert (sequence_bounds_reference(ids) == want).all()
    for src_dt, dst_dt, npdt in (("int32", nl.int32, np.int32), ("float32", nl.float32, F32)):
        out = _bounds(ids.astype(src_dt), dst_dt)
        assert out.dtype == npdt and (out.reshape(2, -1) == want).all()
    out = _bounds(ids.astype(F32), nl.int32, dst_shape=(1, 2 * ids.shape[1]))       # (1, 2n) view: same layout
    assert (out.reshape(2, -1) == want).all()


@pytest.mark.parametrize("case, match", [
    ("partitions", r"segment_ids has 2 partitions; the partition dimension must be 1"),
    ("dst_partitions", r"dst has 2 partitions"),
    ("dtype", r"segment_ids must be float32 or int32, got int16"),
    ("dst_dtype", r"dst must be float32 or int32, got bfloat16"),
    ("size", r"dst \[1, 2, 8\] has 16 elements, expected 2 x 9"),
    ("psum", r"dst is in psum"),
    ("negative", r"segment_ids\[0, 3\] = -1; all segment IDs must be non-negative integers"),
    ("fraction", r"segment_ids\[0, 2\] = 1.5"),
])
def test_sequence_bounds_refusals(case, match):
    def k(x):
        seg = sb((1, 9), nl.int32)
        nisa.iota(dst=seg, pattern=[[1, 9]])
        o = nl.ndarray((1, 2, 9), nl.int32, buffer=nl.sbuf)
        if case == "partitions":
            nisa.sequence_bounds(dst=o, segment_ids=sb((2, 9), nl.int32))
        elif case == "dst_partitions":
            nisa.sequence_bounds(dst=sb((2, 9), nl.int32), segment_ids=seg)
        elif case == "dtype":
            nisa.sequence_bounds(dst=o, segment_ids=sb((1, 9), nl.int16))
        elif case == "dst_dtype":
            nisa.sequence_bounds(dst=sb((1, 2, 9), nl.bfloat16), segment_ids=seg)
        elif case == "size":
            nisa.sequence_bounds(dst=sb((1, 2, 8), nl.int32), segment_ids=seg)
        elif case == "psum":
            nisa.sequence_bounds(dst=nl.ndarray((1, 2, 9), nl.int32, buffer=nl.psum), segment_ids=seg)
        elif case in ("negative", "fraction"):
            xs = load(x)
            nisa.sequence_bounds(dst=o, segment_ids=xs)
        return x
    data = {"negative": np.array([[1, 1, 2, -1, 0, 0, 3, 3, 3]], np.int32),
            "fraction": np.array([[1, 1, 1.5, 2, 0, 0, 3, 3, 3]], F32)}.get(case, DUMMY)
    with pytest.raises(NkiValidationError, match=match):
        nki.jit(k)(data)
