"""nl.max / nl.min as reduction operators (and, with a fidelity warning, element-wise ones), and nl.load_transpose2d of
more than 128 source rows for 4-byte dtypes: fixes found by the second public-kernel sweep (nki-library foreach
norms, trnsci/trnblas GEMM / SYRK)."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
from nkisim import NkiFidelityWarning

F32 = np.float32


def _reduce_kernel(op_for_reduce, op_for_partition):
    @nki.jit
    def k(x):
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        row = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=row, op=op_for_reduce, data=t, axis=1, keepdims=True)
        one = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_partition_reduce(dst=one, op=op_for_partition, data=row)
        scratch = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        red = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.sbuf)
        nisa.tensor_scalar_reduce(dst=scratch, data=t, op0=nl.multiply, operand0=1.0, reduce_op=op_for_reduce,
                                  reduce_res=red)
        out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
        out2 = nl.ndarray((x.shape[0], 1), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=one)
        nisa.dma_copy(dst=out2, src=red)
        return out, out2
    return k


def test_nl_max_and_nl_min_are_reduction_operators():
    """SDK-ISA nki.isa.tensor_scalar_reduce (2.30+, Trn2/Trn3): "The reduce_op can be any of nl.add, nl.multiply,
    nl.max or nl.min" -- the reduction functions name the max / min operators where a reduction is asked for
    (tensor_reduce op, reduce_op=, tensor_partition_reduce op). Same result as nl.maximum / nl.minimum."""
    x = np.random.default_rng(3).standard_normal((16, 40)).astype(F32)
    top, rows = _reduce_kernel(nl.max, nl.max)(x)
    assert top[0, 0] == x.max() and np.array_equal(rows[:, 0], x.max(axis=1))
    ref_top, ref_rows = _reduce_kernel(nl.maximum, nl.maximum)(x)
    assert np.array_equal(top, ref_top) and np.array_equal(rows, ref_rows)
    _, rows_min = _reduce_kernel(nl.min, nl.maximum)(x)
    assert np.array_equal(rows_min[:, 0], x.min(axis=1))


def test_nl_max_as_an_elementwise_operator_computes_maximum_with_a_fidelity_warning():
    """No 0.6 document names nl.max as an element-wise ALU operator, but nki-library's foreach linf norm (hardware
    integration-tested) uses tensor_tensor(..., nl.max): nkisim computes the element-wise maximum and warns."""
    @nki.jit
    def k(x, y):
        a = nl.ndarray(x.shape, nl.float32, buffer=nl.sbuf)
        b = nl.ndarray(y.shape, nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=a, src=x)
        nisa.dma_copy(dst=b, src=y)
        nisa.tensor_tensor(dst=a, data1=a, data2=b, op=nl.max)
        nisa.tensor_tensor(dst=b, data1=a, data2=b, op=nl.min)
        out = nl.ndarray(x.shape, nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=b)
        return out
    rng = np.random.default_rng(7)
    x, y = rng.standard_normal((4, 8)).astype(F32), rng.standard_normal((4, 8)).astype(F32)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = k(x, y)
    msgs = [str(w.message) for w in caught if w.category is NkiFidelityWarning]
    assert any("op=nl.max as an element-wise operator is not documented" in m for m in msgs)
    assert any("op=nl.min as an element-wise operator is not documented" in m for m in msgs)
    np.testing.assert_array_equal(got, np.minimum(np.maximum(x, y), y))


@pytest.mark.parametrize("rows", [256, 200])
def test_load_transpose2d_fp32_with_more_than_128_source_rows(rows):
    """nl.load_transpose2d(src [R, C]) -> [C, R]: C becomes the partition dim (<= 128), R the free size, so R may
    exceed 128 (trnsci/trnblas _syrk_kernel loads a [256, 128] block this way). The 4-byte lowering transposes
    the source in blocks of at most 128 rows; the result is bit-exact."""
    @nki.jit
    def k(a):
        t = nl.load_transpose2d(a)
        out = nl.ndarray((a.shape[1], a.shape[0]), a.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=t)
        return out
    a = np.random.default_rng(4).standard_normal((rows, 96)).astype(F32)
    assert np.array_equal(k(a), a.T)
