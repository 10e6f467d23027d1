"""Trace fields the cost model needs: register reads/writes, offset sources in reads, launch index, kernel call
stack, depends_on edges, resolved dynamic-offset regions, shared_identity_matrix as one constant load."""
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim

F32 = np.float32


def _stage_d1(x, t):
    return _load_row(x, t)


def _load_row(x, t):
    nisa.dma_copy(dst=t, src=x[0:1, :])
    return t


@nki.jit
def regs_kernel(x, n):
    """register_load -> scalar-offset DMA and fori_loop bound; nested helpers for the stack."""
    n_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=n_sb, src=n)
    r = nisa.register_alloc()
    nisa.register_load(r, n_sb)
    row = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=row, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=r,
                                    indirect_dim=0))
    t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    _stage_d1(x, t)
    acc = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=acc, value=0.0)
    def body(i):
        nisa.tensor_tensor(dst=acc, data1=acc, data2=row, op=nl.add)
    nl.fori_loop(0, r, body)
    r2 = nisa.register_alloc()
    nisa.register_move(r2, r)
    st = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.register_store(st, r2)
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=acc)
    return out


def _by_op(tr, op):
    return [r for r in tr.instructions if r["op"] == op]


def test_register_reads_writes_and_stack():
    x = np.arange(4 * 8, dtype=F32).reshape(4, 8)
    with nkisim.trace.capture() as tr:
        out = regs_kernel(x, np.array([[2]], np.int32))
    np.testing.assert_array_equal(out, 2 * x[2:3])
    load, = _by_op(tr, "register_load")
    rid = load["reg_writes"][0]
    dyn = [r for r in _by_op(tr, "dma_copy") if any(g.get("indirect") == "scalar" for g in r["reads"])]
    assert len(dyn) == 1 and dyn[0]["reg_reads"] == [rid]
    body = _by_op(tr, "tensor_tensor")
    assert len(body) == 2 and all(r["reg_reads"] == [rid] for r in body)          # fori_loop bound register
    move, = _by_op(tr, "register_move")
    store, = _by_op(tr, "register_store")
    assert move["reg_reads"] == [rid] and store["reg_reads"] == move["reg_writes"] != [rid]
    assert "reg_reads" not in _by_op(tr, "memset")[0]
    # stack: nearest kernel frames, innermost first, no nkisim internals; loc = file:line of stack[0]
    helper = next(r for r in _by_op(tr, "dma_copy") if r["stack"][0].endswith(":_load_row"))
    assert [s.split(":")[2] for s in helper["stack"]] == ["_load_row", "_stage_d1", "regs_kernel"]
    assert helper["loc"] == helper["stack"][0].rsplit(":", 1)[0]
    assert [s.split(":")[2] for s in body[0]["stack"]] == ["body", "regs_kernel"]
    assert all("nkisim/" not in s and not s.startswith(("runtime.py", "language.py")) for r in tr.instructions
               for s in r["stack"])


def test_resolved_dynamic_region_and_comparable():
    x = np.arange(4 * 8, dtype=F32).reshape(4, 8)
    n = np.array([[3]], np.int32)
    with nkisim.trace.capture() as t_exec:
        regs_kernel(x, n)
    dyn = next(r for r in t_exec.instructions if any(g.get("indirect") == "scalar" for g in r["reads"]))
    g = dyn["reads"][0]
    assert g["resolved"] is True and g["bytes"] == [3 * 8 * 4, 4 * 8 * 4] and g["extent"] == {"bytes": [0, 128]}
    with nkisim.trace.capture() as t_shape:
        regs_kernel(nkisim.ShapeDtype(x.shape, "float32"), nkisim.ShapeDtype(n.shape, "int32"))
    gs = next(r for r in t_shape.instructions if any(g.get("indirect") == "scalar" for g in r["reads"]))["reads"][0]
    assert gs["resolved"] is False and gs["bytes"] == [0, 128] and "extent" not in gs
    # data-independent view: equal up to the runtime loop (0 iterations in shape-only mode: placeholder register)
    def c(tr):
        return [{k: v for k, v in r.items() if k != "seq"} for r in tr.comparable() if r["op"] != "tensor_tensor"]
    assert c(t_exec) == c(t_shape)
    with nkisim.trace.capture() as t_other:
        regs_kernel(x, np.array([[1]], np.int32))
    assert c(t_other) == c(t_exec)


def test_vector_offset_index_tile_in_reads():
    @nki.jit
    def gather(data, idx):
        P, F = idx.shape[0], data.shape[1]
        i = nl.ndarray((P, 1), nl.uint32, buffer=nl.sbuf)
        nisa.dma_copy(dst=i, src=idx)
        g = nl.ndarray((P, F), data.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=g, src=data.ap(pattern=[[F, P], [1, F]], vector_offset=i, indirect_dim=0))
        out = nl.ndarray((P, F), data.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=g)
        return out
    data = np.arange(60, dtype=F32).reshape(10, 6)
    with nkisim.trace.capture() as tr:
        gather(data, np.array([[7], [2], [9]], np.uint32))
    load_idx, gat, _ = tr.instructions
    assert gat["reads"][0]["indirect"] == "vector" and gat["reads"][0]["name"] == "arg0"
    ind = gat["reads"][1]
    assert ind["arg"] == "src.vector_offset" and ind["buf"] == load_idx["writes"][0]["buf"]
    assert "indirect" not in ind and gat["shapes"]["src.vector_offset"] == [3, 1]
    assert gat["bytes"]["sbuf"]["read"] == 3 * 4


def test_launch_index_and_allocations():
    x = np.arange(4 * 8, dtype=F32).reshape(4, 8)
    with nkisim.trace.capture() as outer:
        regs_kernel(x, np.array([[1]], np.int32))
        with nkisim.trace.capture() as inner:
            regs_kernel(x, np.array([[1]], np.int32))
    assert len(outer.launches) == 2 and len(inner.launches) == 1
    assert {r["launch"] for r in outer.instructions} == {0, 1}
    assert {r["launch"] for r in inner.instructions} == {0}
    assert {a["launch"] for a in outer.allocations} == {0, 1}
    n0 = sum(1 for r in outer.instructions if r["launch"] == 0)
    assert n0 == len(inner.instructions)


def test_depends_on_edges_and_loop_rule():
    @nki.jit
    def k(x):
        a = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        i1 = nisa.dma_copy(dst=a, src=x)
        b = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        i2 = nisa.memset(dst=b, value=1.0)
        i3 = nisa.tensor_tensor(dst=b, data1=a, data2=b, op=nl.add)
        i3.depends_on(i1, i2).depends_on(i1)
        def body(i):
            nisa.tensor_copy(dst=a, src=b).depends_on(i2)          # producer in an enclosing scope: fine
        nl.fori_loop(0, 2, body)
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=a)
        return out
    with nkisim.trace.capture() as tr:
        k(np.ones((2, 4), F32))
    seq = {r["op"]: r["seq"] for r in tr.instructions if r["op"] in ("dma_copy", "memset")}
    tt, = _by_op(tr, "tensor_tensor")
    assert tt["depends_on"] == [tr.instructions[0]["seq"], seq["memset"]]
    assert all(r["depends_on"] == [seq["memset"]] for r in _by_op(tr, "tensor_copy"))

    @nki.jit
    def out_of_loop(x):
        a = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        got = []

        def body(i):
            got.append(nisa.memset(dst=a, value=0.0))
        nl.fori_loop(0, 1, body)
        nisa.tensor_copy(dst=a, src=a).depends_on(got[0])
        return x
    with pytest.raises(nkisim.NkiValidationError, match="into or out of a dynamic loop"):
        out_of_loop(np.ones((2, 4), F32))


SEEN = []


def test_shared_identity_matrix_is_one_constant_per_core():
    @nki.jit
    def k(x):
        ids = []
        for _ in range(3):
            ids.append(nl.shared_identity_matrix(4, dtype=nl.float32))
        SEEN.append(ids)
        SEEN.append(nl.shared_identity_matrix(4, dtype=nl.bfloat16))
        d = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nl.shared_identity_matrix(4, dtype=nl.float32, dst=d)
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        nisa.tensor_tensor(dst=d, data1=d, data2=ids[2], op=nl.add)
        nisa.dma_copy(dst=out, src=d)
        return out
    with nkisim.trace.capture() as tr:
        out = k[2](np.zeros((4, 4), F32))
    np.testing.assert_array_equal(out, 2 * np.eye(4, dtype=F32))
    for ids, other in (SEEN[0:2], SEEN[2:4]):                     # one SEEN pair per core
        assert ids[0] is ids[1] is ids[2] and other is not ids[0]
    assert SEEN[0][0] is not SEEN[2][0]                           # each core has its own SBUF copy
    ident = _by_op(tr, "shared_identity_matrix")
    assert len(ident) == 2 * 3                                    # per core: f32, bf16, and the dst= load
    assert all(r["engine"] == "DMA" and r["constant"] for r in ident)
    assert ident[0]["bytes"] == {"sbuf": {"read": 0, "write": 64}, "const": {"read": 64, "write": 0}}


def _nest(t, depth):
    if depth == 0:
        nisa.memset(dst=t, value=1.0)
    else:
        _nest(t, depth - 1)


@nki.jit
def deep_kernel():
    t = nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf)
    _nest(t, 30)
    out = nl.ndarray((1, 4), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_stack_reaches_the_kernel_entry_through_deep_helpers():
    """A stage tag is the outermost stage function on the stack: 31 nested helper frames still end at the kernel."""
    with nkisim.trace.capture() as tr:
        deep_kernel()
    st = _by_op(tr, "memset")[0]["stack"]
    assert len(st) == 32 and st[-1].endswith(":deep_kernel") and all(s.endswith(":_nest") for s in st[:-1])

