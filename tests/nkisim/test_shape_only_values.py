"""Shape-only launches with real values: integer inputs keep their data (register_load of one yields its value),
a register-value provider supplies values computed on-chip, runtime loops are traced (``loop`` fields and
``Trace.loops``). The invariant tested throughout: shape-only with the values an executing run sees gives the
same trace (``Trace.comparable()``) as executing."""
import numpy as np
import pytest

import nkisim

nkisim.install()
import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

SD = nkisim.ShapeDtype


@nki.jit
def rows_from_count(n, x):
    """n: [1, 1] int32 HBM; x: [R, F] HBM. Copies rows 0..n-1 of x (a runtime loop of n trips, each a DMA at the
    run-time row offset) into an SBUF tile and stores its last row."""
    r = nisa.register_alloc()
    nisa.register_load(r, n)
    t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)

    def body(i):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                      indirect_dim=0))
    nl.fori_loop(0, r, body)
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def rows_from_computed(n, x):
    """Like rows_from_count, but the trip count is computed on-chip: n + 1 (DMA to SBUF, an integer add, then
    register_load from the SBUF tile)."""
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="count_plus_one")
    nisa.dma_copy(dst=s, src=n)
    nisa.tensor_scalar(dst=s, data=s, op0=nl.add, operand0=1)
    r = nisa.register_alloc()
    nisa.register_load(r, s)
    t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)

    def body(i):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                      indirect_dim=0))
    nl.fori_loop(0, r, body)
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def _x():
    return np.arange(6 * 64, dtype=np.float32).reshape(6, 64)


def _trace(kernel, *args):
    with nkisim.trace.capture() as tr:
        out = kernel(*args)
    return tr, out


def test_real_int_input_next_to_shape_only_weights_gives_the_executing_trace():
    n = np.array([[4]], np.int32)
    ex, out = _trace(rows_from_count, n, _x())
    so, out_so = _trace(rows_from_count, n, SD((6, 64), "float32"))
    assert np.array_equal(out, _x()[3:4])                      # the executing run really ran 4 trips
    assert isinstance(out_so, nkisim.ShapeDtype)               # the float output has no data
    dmas = [r for r in so.instructions if r["op"] == "dma_copy" and r.get("loop")]
    assert len(dmas) == 4
    assert so.comparable() == ex.comparable()
    # the real register value resolves the dynamic offsets: row i of x, not the whole tensor
    assert [d["reads"][0]["bytes"] for d in dmas] == [[256 * i, 256 * (i + 1)] for i in range(4)]
    assert all(d["reads"][0]["resolved"] for d in dmas)


def test_shape_only_int_placeholder_without_data():
    so, _ = _trace(rows_from_count, SD((1, 1), "int32"), SD((6, 64), "float32"))
    assert not [r for r in so.instructions if r.get("loop")]  # the placeholder 0: the loop ran 0 times
    assert [lp["trips"] for lp in so.loops] == [0]


def test_values_computed_on_chip_have_no_data_without_a_provider():
    so, _ = _trace(rows_from_computed, np.array([[2]], np.int32), SD((6, 64), "float32"))
    assert not [r for r in so.instructions if r.get("loop")]  # n + 1 was computed on chip: placeholder 0


def test_provider_supplies_values_computed_on_chip_and_observes_executing_runs():
    n = np.array([[2]], np.int32)
    seen = []

    def observe(q):
        seen.append((q.function, q.tensor, q.named, q.memory, q.index, q.dtype, q.value, q.rank, q.core))

    with nkisim.register_values(observe):
        ex, _ = _trace(rows_from_computed, n, _x())
    assert seen == [("rows_from_computed", "count_plus_one", True, "sbuf", 0, "int32", 3, 0, 0)]

    asked = []

    def provide(q):
        asked.append(q.value)
        return 3 if q.tensor == "count_plus_one" else None

    with nkisim.register_values(provide):
        so, _ = _trace(rows_from_computed, n, SD((6, 64), "float32"))
    assert asked == [None]
    assert so.comparable() == ex.comparable()


def test_provider_is_ignored_when_the_value_is_known():
    with nkisim.register_values(lambda q: 5):
        so, _ = _trace(rows_from_count, np.array([[1]], np.int32), SD((6, 64), "float32"))
    assert len([r for r in so.instructions if r.get("loop")]) == 1


def test_provider_must_be_callable_and_return_a_32_bit_number():
    with pytest.raises(TypeError, match="callable"):
        with nkisim.register_values(3):
            pass
    with nkisim.register_values(lambda q: 2 ** 40):
        with pytest.raises(nkisim.NkiValidationError, match="32-bit"):
            rows_from_computed(SD((1, 1), "int32"), SD((6, 64), "float32"))


@nki.jit
def nested(n, x):
    """An outer runtime loop of n trips around an inner loop of 2 trips, one DVE op per inner iteration, and a
    0-trip loop after them."""
    r = nisa.register_alloc()
    nisa.register_load(r, n)
    t = nl.ndarray((1, 8), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)

    def inner(j):
        nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)

    def outer(i):
        nl.fori_loop(0, 2, inner)
    nl.fori_loop(0, r, outer)
    nl.fori_loop(0, 0, inner)
    out = nl.ndarray((1, 8), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_runtime_loops_are_traced_with_iterations_and_trip_counts():
    so, _ = _trace(nested, np.array([[3]], np.int32), SD((1, 1), "float32"))
    body = [r["loop"] for r in so.instructions if r["op"] == "tensor_scalar"]
    ids = sorted({lp["id"] for lp in so.loops})
    outer_id = [lp["id"] for lp in so.loops if lp["trips"] == 3][0]
    assert [tuple(x[0]) for x in body] == [(outer_id, i) for i in range(3) for _ in range(2)]
    assert [x[1][1] for x in body] == [0, 1] * 3
    trips = sorted(lp["trips"] for lp in so.loops)
    assert trips == [0, 2, 2, 2, 3] and len(ids) == 5
    zero = [lp for lp in so.loops if lp["trips"] == 0][0]
    assert zero["before"] == zero["last"] == so.instructions[-2]["seq"]
    assert zero["loc"].startswith("test_shape_only_values.py:")
    ex, _ = _trace(nested, np.array([[3]], np.int32), np.zeros((1, 1), np.float32))
    assert so.comparable() == ex.comparable() and so.loops == ex.loops


@nki.jit
def rows_from_copied_count(n, x):
    """Like rows_from_count, but the count is first DMA-copied into SBUF (the nki-library pattern) and broadcast
    to 4 partitions; register_load reads partition 2's copy."""
    s = nl.ndarray((4, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=n.ap(pattern=[[0, 4], [1, 1]], offset=0))
    r = nisa.register_alloc()
    nisa.register_load(r, s[2:3, :])
    t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)

    def body(i):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                      indirect_dim=0))
    nl.fori_loop(0, r, body)
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def rows_from_overwritten_copy(n, x):
    """The count is DMA-copied into SBUF and then overwritten on chip (+1): the copy's value is forgotten."""
    s = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf)
    nisa.dma_copy(dst=s, src=n)
    nisa.tensor_scalar(dst=s, data=s, op0=nl.add, operand0=1)
    r = nisa.register_alloc()
    nisa.register_load(r, s)
    t = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=0.0)

    def body(i):
        nisa.dma_copy(dst=t, src=x.ap(pattern=[[x.shape[1], 1], [1, x.shape[1]]], offset=0, scalar_offset=i,
                                      indirect_dim=0))
    nl.fori_loop(0, r, body)
    out = nl.ndarray((1, x.shape[1]), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    return out


def test_a_dma_copy_of_a_real_int_input_keeps_its_value():
    n = np.array([[3]], np.int32)
    ex, _ = _trace(rows_from_copied_count, n, _x())
    so, _ = _trace(rows_from_copied_count, n, SD((6, 64), "float32"))
    assert len([r for r in so.instructions if r.get("loop")]) == 3
    assert so.comparable() == ex.comparable()


def test_an_on_chip_write_forgets_the_copied_value():
    so, _ = _trace(rows_from_overwritten_copy, np.array([[3]], np.int32), SD((6, 64), "float32"))
    assert not [r for r in so.instructions if r.get("loop")]      # computed on chip: the placeholder again
