"""Views (indexing rules, .ap broadcast / dtype reinterpret, reshape, view), registers, runtime loops,
DMA gather/scatter."""
import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim

F32 = np.float32


def _probe(fn):
    res = {}

    @nki.jit
    def k(x):
        res.update(fn(x))
        return x
    k(np.zeros((8, 8), F32))
    return res


def test_indexing_rules():
    def f(x):
        s = nl.ndarray((128, 4, 8), nl.float32, buffer=nl.sbuf)
        return {"p_int": s[3].shape, "f_int": s[:, 2].shape, "both": s[:, 1, 2].shape, "hbm": x[2].shape,
                "ds": s[nl.ds(32, 32), ...].shape, "neg": x[-1, 1:].shape, "step": x[::2, ::4].shape,
                "ell": s[..., 3].shape}
    r = _probe(f)
    assert r == {"p_int": (1, 4, 8), "f_int": (128, 8), "both": (128, 1), "hbm": (8,), "ds": (32, 4, 8),
                 "neg": (7,), "step": (4, 2), "ell": (128, 4)}


def test_index_out_of_range():
    with pytest.raises(IndexError, match="out of range"):
        _probe(lambda x: {"a": x[0:9].shape})


def test_ap_broadcast_reinterpret_reshape(rng):
    @nki.jit
    def k(col, ints):
        out = nl.ndarray((4, 6), nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray((2, 8), nl.bfloat16, buffer=nl.shared_hbm)
        c = nl.ndarray((4, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=col)
        b = nl.ndarray((4, 6), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=b, src=c.ap(pattern=[[1, 4], [0, 6]], offset=0))    # stride-0 broadcast
        nisa.dma_copy(dst=out, src=b)
        t = nl.ndarray((2, 4), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=ints)
        nisa.dma_copy(dst=out2, src=t.view(nl.bfloat16))                           # bit reinterpret
        return out, out2
    col = rng.standard_normal((4, 1)).astype(F32)
    ints = rng.integers(0, 2 ** 31, (2, 4)).astype(np.int32)
    out, out2 = k(col, ints)
    np.testing.assert_array_equal(out, np.broadcast_to(col, (4, 6)))
    np.testing.assert_array_equal(out2.view(np.uint16), ints.view(np.uint16).reshape(2, 8))


def test_reshape_rules():
    def f(x):
        s = nl.ndarray((16, 4, 8), nl.float32, buffer=nl.sbuf)
        r = {"r": s.reshape((16, 32)).shape, "flat": s.flatten_dims(1, 2).shape, "perm": s.permute((0, 2, 1)).shape}
        for bad in ((32, 16), (16, 31)):
            try:
                s.reshape(bad)
                r[bad] = "ok"
            except (ValueError, nisa.NkiValidationError) as e:
                r[bad] = type(e).__name__
        return r
    r = _probe(f)
    assert r["r"] == (16, 32) and r["flat"] == (16, 32) and r["perm"] == (16, 8, 4)
    assert r[(32, 16)] == "NkiValidationError" and r[(16, 31)] == "ValueError"


def test_partition_dim_view_rules():
    """SDK-NL NkiTensor: on-chip tensors cannot expand, broadcast or squeeze at dim 0; HBM tensors can."""
    def f(x):
        s = nl.ndarray((16, 1, 8), nl.float32, buffer=nl.sbuf)
        r = {"expand1": s.expand_dim(1).shape, "bcast1": s.broadcast(1, 4).shape,
             "hbm_expand0": x.expand_dim(0).shape}
        for name, bad in (("expand0", lambda: s.expand_dim(0)), ("bcast0", lambda: s[0:1].broadcast(0, 4)),
                          ("squeeze0", lambda: s[0:1].squeeze_dim(0))):
            try:
                bad()
                r[name] = "ok"
            except nisa.NkiValidationError as e:
                r[name] = str(e)
        return r
    r = _probe(f)
    assert r["expand1"] == (16, 1, 1, 8) and r["bcast1"] == (16, 4, 8) and r["hbm_expand0"] == (1, 8, 8)
    assert "before the partition dim" in r["expand0"] and "'s' (sbuf float32[16, 1, 8]" in r["expand0"]
    assert "partition dim" in r["bcast0"] and "partition dim" in r["squeeze0"]


def test_dma_gather_scatter_vector_offset(rng):
    @nki.jit
    def k(data, idx, table):
        P, F = idx.shape[0], data.shape[1]
        out = nl.ndarray((P, F), data.dtype, buffer=nl.shared_hbm)
        i = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx)
        g = nl.ndarray((P, F), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=g, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=i, indirect_dim=0))
        nisa.dma_copy(dst=out, src=g)
        nisa.dma_copy(dst=table.ap(pattern=[[F, P], [1, F]], vector_offset=i, indirect_dim=0), src=g)
        return out
    data = rng.standard_normal((10, 6)).astype(F32)
    idx = np.array([[7], [2], [9]], np.uint32)
    table = np.zeros((10, 6), F32)
    out = k(data, idx, table)
    np.testing.assert_array_equal(out, data[[7, 2, 9]])
    np.testing.assert_array_equal(table[[7, 2, 9]], data[[7, 2, 9]])
    assert not table[[0, 1, 3, 4, 5, 6, 8]].any()


def test_gather_oob_error_and_skip(rng):
    def make(mode):
        @nki.jit
        def k(data, idx):
            out = nl.ndarray((2, 4), data.dtype, buffer=nl.shared_hbm)
            i = nl.ndarray((2, 1), nl.int32, buffer=nl.sbuf)
            nisa.dma_copy(dst=i, src=idx)
            g = nl.ndarray((2, 4), data.dtype, buffer=nl.sbuf)
            nisa.memset(dst=g, value=-1.0)
            nisa.dma_copy(dst=g, src=data.ap(pattern=[[4, 2], [1, 4]], vector_offset=i, indirect_dim=0),
                          oob_mode=mode)
            nisa.dma_copy(dst=out, src=g)
            return out
        return k
    data = rng.standard_normal((5, 4)).astype(F32)
    idx = np.array([[1], [5]], np.int32)
    with pytest.raises(nkisim.OutOfBoundsError):
        make(nisa.oob_mode.error)(data, idx)
    out = make(nisa.oob_mode.skip)(data, idx)
    np.testing.assert_array_equal(out[0], data[1])
    np.testing.assert_array_equal(out[1], -1.0)


def test_registers_fori_loop_scalar_offset(rng):
    @nki.jit
    def k(x, n):
        R, C = x.shape
        out = nl.ndarray((1, C), x.dtype, buffer=nl.shared_hbm)
        acc = nl.ndarray((1, C), nl.float32, buffer=nl.sbuf)
        nisa.memset(dst=acc, value=0.0)
        nsb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=nsb, src=n)
        r = nisa.register_alloc()
        nisa.register_load(r, nsb)

        def body(i):
            row = nl.ndarray((1, C), x.dtype, buffer=nl.sbuf)
            nisa.dma_copy(dst=row, src=x.ap(pattern=[[C, 1], [1, C]], offset=0, scalar_offset=i, indirect_dim=0))
            nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
        nl.fori_loop(0, r, body)
        nisa.dma_copy(dst=out, src=acc)
        return out
    x = rng.standard_normal((6, 5)).astype(F32)
    out = k(x, np.array([[4]], np.int32))
    np.testing.assert_allclose(out[0], x[:4].sum(0), rtol=1e-6)
    with nkisim.trace.capture() as tr:
        k(nkisim.ShapeDtype((6, 5), "float32"), nkisim.ShapeDtype((1, 1), "int32"))
    # shape-only: register loads read the placeholder 0 -> the runtime loop body runs 0 times (documented)
    assert [r["op"] for r in tr.instructions].count("tensor_tensor") == 0


def test_dynamic_range_and_while():
    @nki.jit
    def k(x):
        out = nl.ndarray((1, 1), nl.int32, buffer=nl.shared_hbm)
        c = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=c, value=0)
        for i in nl.dynamic_range(3):
            nisa.tensor_scalar(dst=c, data=c, op0=nl.add, operand0=2.0)
        nisa.dma_copy(dst=out, src=c)
        return out
    assert k(np.zeros((1, 1), F32))[0, 0] == 6


# ---- phase 2: front-end lint, tensor-valued select, rearrange ---------------------------------
def test_frontend_lint_is_and_dict_keys():
    @nki.jit
    def uses_is(x, flag):
        if flag is None:
            pass
        return x

    with pytest.raises(nkisim.NkiValidationError, match="uses 'is' at test_views_dynamic.py:.*use == / !="):
        uses_is(np.zeros((2, 2), np.float32), None)

    @nki.jit
    def int_keys(x):
        d = {0: x}
        return d["0"] if False else x

    with pytest.raises(nkisim.NkiValidationError, match="dict with key 0 .* must be strings"):
        int_keys(np.zeros((2, 2), np.float32))

    @nki.jit
    def ok(x, cfg):
        return x
    with pytest.raises(nkisim.NkiValidationError, match="non-string key"):
        ok(np.zeros((2, 2), np.float32), {1: 2})


def test_tensor_valued_select_and_vector_select(rng):
    table = rng.standard_normal((5, 3, 8)).astype(np.float32)

    @nki.jit
    def k(tbl, idx_in, rows_in):
        i = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx_in)
        a = nl.ndarray((3, 8), tbl.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=tbl.select(0, i))            # dynamic row of dim 0
        b = nl.ndarray((5, 8), tbl.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=b, src=tbl[:, i, :])                 # tensor index on dim 1
        r = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=r, src=rows_in)
        flat = tbl.reshape((5, 24))
        c = nl.ndarray((4, 24), tbl.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=c, src=flat.vector_select(0, r))     # gather rows
        outs = []
        for t in (a, b, c):
            o = nl.ndarray(t.shape, t.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=t)
            outs.append(o)
        return tuple(outs)
    rows = np.array([[4], [0], [2], [2]], np.int32)
    a, b, c = k(table, np.array([[2]], np.int32), rows)
    np.testing.assert_array_equal(a, table[2])
    np.testing.assert_array_equal(b, table[:, 2, :])
    np.testing.assert_array_equal(c, table.reshape(5, 24)[rows[:, 0]])
    with pytest.raises(nkisim.OutOfBoundsError):
        k(table, np.array([[3]], np.int32), rows)              # 3 >= dim-1 size 3 (inside the storage, still OOB)

    @nki.jit
    def onchip_dim0(x):
        i = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=i, value=0)
        t = nl.ndarray((4, 4), x.dtype, buffer=nl.sbuf)
        t.select(0, i)
        return x
    with pytest.raises(nkisim.NkiValidationError, match="cannot target the partition dim 0"):
        onchip_dim0(np.zeros((2, 2), np.float32))


def test_dynamic_offsets_come_from_sbuf():
    """SDK-AP: scalar_offset is "an SBUF tensor of shape (1, 1)" (or a register), vector_offset "an SBUF tensor", and
    select / vector_select take their indices "in SBUF": the same index tiles in PSUM are refused."""
    def make(kind):
        @nki.jit
        def k(x):
            i = nl.ndarray((1, 1), nl.int32, buffer=nl.psum)
            r = nl.ndarray((2, 1), nl.int32, buffer=nl.psum)
            if kind == "scalar_offset":
                x.ap([[4, 2], [1, 4]], offset=0, scalar_offset=i, indirect_dim=0)
            elif kind == "vector_offset":
                x.ap([[4, 2], [1, 4]], offset=0, vector_offset=r, indirect_dim=0)
            elif kind == "select":
                x.select(0, i)
            else:
                x.vector_select(0, r)
            return x
        return k
    for kind in ("scalar_offset", "vector_offset", "select", "vector_select"):
        with pytest.raises(nkisim.NkiValidationError, match="SBUF tensor"):
            make(kind)(np.zeros((4, 4), np.float32))


def test_rearrange(rng):
    x = rng.standard_normal((6, 4 * 8)).astype(np.float32)

    @nki.jit
    def k(x):
        v = x.rearrange(("a", ("b", "c")), ("b", "a", "c"), {"b": 4})       # [6, 32] -> [4, 6, 8]
        o = nl.ndarray((4, 6, 8), x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((4, 6, 8), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=v)
        nisa.dma_copy(dst=o, src=t)
        w = x.rearrange(("a", ("b", "c")), ("a", "c", "b"), {"c": 8})
        assert w.shape == (6, 8, 4) and w.strides == (32, 1, 8)
        try:
            x.rearrange(("a", ("b", "c")), ("a", ("c", "b")), {"c": 8})     # merge of non-adjacent strides
        except nisa.NkiValidationError:
            pass
        else:
            raise AssertionError("merge of permuted dims must be refused")
        return o
    out = k(x)
    np.testing.assert_array_equal(out, x.reshape(6, 4, 8).transpose(1, 0, 2))


def test_dynamic_offsets_on_compute_engines(rng):
    """tensor_copy + .ap(scalar_offset=reg) replaced tensor_copy_dynamic_src/dst (SDK-MIG 0.3.0)."""
    x = rng.standard_normal((8, 4, 16)).astype(np.float32)

    @nki.jit
    def k(x, j_in):
        t = nl.ndarray((8, 4, 16), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        j = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
        nisa.dma_copy(dst=j, src=j_in)
        r = nisa.register_alloc()
        nisa.register_load(r, j)
        a = nl.ndarray((8, 16), x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a, src=t.ap(pattern=[[64, 8], [1, 16]], offset=0, scalar_offset=r, indirect_dim=1))
        b = nl.ndarray((8, 16), x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=b, data=t.select(1, j), op0=nl.multiply, operand0=2.0)
        outs = []
        for v in (a, b):
            o = nl.ndarray(v.shape, v.dtype, buffer=nl.shared_hbm)
            nisa.dma_copy(dst=o, src=v)
            outs.append(o)
        return tuple(outs)
    a, b = k(x, np.array([[3]], np.int32))
    np.testing.assert_array_equal(a, x[:, 3, :])
    np.testing.assert_array_equal(b, x[:, 3, :] * 2)
    with pytest.raises(nkisim.OutOfBoundsError, match="partition boundary|outside"):
        k(x, np.array([[4]], np.int32))

    @nki.jit
    def dim0(x):
        t = nl.ndarray((8, 16), x.dtype, buffer=nl.sbuf)
        nisa.memset(dst=t, value=0.0)
        r = nisa.register_alloc(1)
        u = nl.ndarray((1, 16), x.dtype, buffer=nl.sbuf)
        nisa.tensor_copy(dst=u, src=t.ap(pattern=[[16, 1], [1, 16]], scalar_offset=r, indirect_dim=0))
        return x
    with pytest.raises(nkisim.NkiValidationError, match="cannot target dim 0"):
        dim0(x)
