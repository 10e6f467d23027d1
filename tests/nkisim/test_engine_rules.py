"""Engine and operand rules (found by the public-kernel sweep, python -m nkisim.public_kernels): DMA and matmul
destinations, the matmul contraction dim, GpSimd's reach; a refused kernel stays refused on every launch; a DMA
self-copy of partly written HBM is not a read of garbage."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim_helpers import run_body
from nkisim import NkiValidationError

F32 = np.float32


def _zeros(shape, dt=nl.bfloat16, buf=nl.sbuf):
    t = nl.ndarray(shape, dt, buffer=buf)
    nisa.memset(dst=t, value=0.0)
    return t


# ---- documented rules without a refusal test before the sweep ------------------------------------------------

def test_dma_cannot_write_psum():
    """SDK-ISA dma_copy: src and dst live in HBM or SBUF; a DMA from HBM straight into PSUM is refused."""
    def body(x):
        nisa.dma_copy(dst=nl.ndarray((4, 4), nl.float32, buffer=nl.psum), src=x)
    with pytest.raises(NkiValidationError, match=r"dma_copy: dst is in psum .*DMA cannot access PSUM.*write PSUM with "
                                                 r"an engine"):
        run_body(body)


def test_matmul_operands_must_share_the_contraction_dim():
    def body(x):
        p = nl.ndarray((64, 64), nl.float32, buffer=nl.psum)
        nisa.nc_matmul(dst=p, stationary=_zeros((128, 64)), moving=_zeros((64, 64)))
    with pytest.raises(NkiValidationError, match=r"stationary has 128 partitions \(contraction K\) but moving has 64"):
        run_body(body)


def test_matmul_result_goes_to_psum_only():
    def body(x):
        nisa.nc_matmul(dst=_zeros((64, 64), nl.float32), stationary=_zeros((128, 64)), moving=_zeros((128, 64)))
    with pytest.raises(NkiValidationError, match=r"nc_matmul: dst is in sbuf .*expected psum"):
        run_body(body)


def test_gpsimd_cannot_read_psum():
    def body(x):
        p = _zeros((4, 4), nl.float32, nl.psum)
        nisa.tensor_copy(dst=_zeros((4, 4), nl.float32), src=p, engine=nisa.engine.gpsimd)
    with pytest.raises(NkiValidationError, match=r"tensor_copy: src is in psum .*POOL cannot access psum"):
        run_body(body)


@pytest.mark.parametrize("dt", [nl.float32, nl.bfloat16])
def test_gpsimd_runs_no_float_tensor_tensor(dt):
    """Ref §5.0: GpSimd tensor_tensor only with int32/uint32 operands or op=nl.power; the seed's hardware runs met
    'tensor_tensor cannot run on Pool' (trn2-costs pitfalls). A float add on GpSimd is refused, on VectorE accepted."""
    def on_pool(x):
        a, b = _zeros((4, 8), dt), _zeros((4, 8), dt)
        nisa.tensor_tensor(dst=_zeros((4, 8), dt), data1=a, data2=b, op=nl.add, engine=nisa.engine.gpsimd)

    def on_dve(x):
        a, b = _zeros((4, 8), dt), _zeros((4, 8), dt)
        nisa.tensor_tensor(dst=_zeros((4, 8), dt), data1=a, data2=b, op=nl.add, engine=nisa.engine.vector)
    with pytest.raises(NkiValidationError, match=r"engine=gpsimd with floating-point operands.*POOL_FLOAT_TENSOR"):
        run_body(on_pool)
    run_body(on_dve)


def test_gpsimd_tensor_tensor_on_int32_is_accepted():
    def body(x):
        a = nl.ndarray((4, 8), nl.int32, buffer=nl.sbuf)
        nisa.memset(dst=a, value=3)
        c = nl.ndarray((4, 8), nl.int32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=c, data1=a, data2=a, op=nl.add, engine=nisa.engine.gpsimd)
    run_body(body)


@pytest.mark.parametrize("op", [nl.bitwise_and, nl.bitwise_xor, nl.left_shift])
def test_gpsimd_runs_no_bitvec_tensor_tensor(op):
    """SDK-ISA tensor_tensor: bitvec operators are documented on VectorE ("Vector Engine treats all input elements as
    bit patterns"); int32 goes to GpSimd for arithmetic only. Explicit engine=gpsimd is refused; the int32 default
    of a bitvec op is VectorE (the trace says so), and an int32 add still defaults to GpSimd."""
    def ints(name):
        t = nl.ndarray((4, 8), nl.int32, buffer=nl.sbuf, name=name)
        nisa.memset(dst=t, value=3)
        return t

    def on_pool(x):
        nisa.tensor_tensor(dst=ints("c"), data1=ints("a"), data2=ints("b"), op=op, engine=nisa.engine.gpsimd)

    def by_default(x):
        nisa.tensor_tensor(dst=ints("c"), data1=ints("a"), data2=ints("b"), op=op)
        nisa.tensor_tensor(dst=ints("d"), data1=ints("a"), data2=ints("b"), op=nl.add)
    with pytest.raises(NkiValidationError, match=r"engine=gpsimd with bitvec op.*POOL_BITVEC_TENSOR_TENSOR"):
        run_body(on_pool)
    with nkisim.trace.capture() as tr:
        run_body(by_default)
    engines = [r["engine"] for r in tr.instructions if r["op"] == "tensor_tensor"]
    assert engines == ["DVE", "POOL"], engines


def test_sbuf_to_sbuf_dma_cannot_fold_partitions():
    """trn2-costs 'Pitfalls met on real hardware': dma_copy needs equal partition counts src/dst; SBUF access
    patterns cannot fold partitions into a row. [4, 1] -> [1, 4] on chip is refused; through HBM it is accepted,
    and an on-chip copy between equal partition counts stays accepted."""
    def fold(x):
        col = _zeros((4, 1), nl.float32)
        nisa.dma_copy(dst=nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf), src=col)

    def via_hbm(x):
        col = _zeros((4, 1), nl.float32)
        scratch = nl.ndarray((4, 1), nl.float32, buffer=nl.private_hbm)
        nisa.dma_copy(dst=scratch, src=col)
        nisa.dma_copy(dst=nl.ndarray((1, 4), nl.float32, buffer=nl.sbuf), src=scratch.ap(pattern=[[4, 1], [1, 4]],
                                                                                          offset=0))
        nisa.dma_copy(dst=nl.ndarray((4, 2), nl.float32, buffer=nl.sbuf)[:, 0:1], src=col)
    with pytest.raises(NkiValidationError, match=r"cannot fold partitions into a row.*DMA_SBUF_PARTITION_FOLD"):
        run_body(fold)
    run_body(via_hbm)


def test_a_raw_access_pattern_on_the_shared_identity_is_refused():
    """SDK-NL shared_identity_matrix: "The compiler will reuse all the identity matrices of the same dtype in the
    graph", so its storage may be a larger shared identity and a raw ``.ap()`` (which addresses the storage, its
    partition step = the storage's row) would read other elements: refused. Views of it and an identity loaded into
    a tile of one's own (``dst=``) stay accepted."""
    def raw(x):
        ident = nl.shared_identity_matrix(n=4, dtype=nl.float32)
        out = nl.ndarray((4, 2, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ident.ap(pattern=[[4, 4], [0, 2], [1, 4]], offset=0))

    def own(x):
        ident = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nl.shared_identity_matrix(n=4, dtype=nl.float32, dst=ident)
        out = nl.ndarray((4, 2, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=out, src=ident.ap(pattern=[[4, 4], [0, 2], [1, 4]], offset=0))
        nisa.tensor_copy(dst=out[:, 0, 0:2], src=nl.shared_identity_matrix(n=4, dtype=nl.float32)[:, 0:2])
    with pytest.raises(NkiValidationError, match=r"shared_identity_matrix's constant"):
        run_body(raw)
    run_body(own)


@pytest.mark.parametrize("buf, free, ok", [(nl.sbuf, 65536, True), (nl.sbuf, 65537, False),
                                           (nl.psum, 4096, True)])
def test_engine_free_size_per_instruction(buf, free, ok):
    """SDK trainium_inferentia2_arch.rst: one VectorE / ScalarE instruction reads at most 64K elements per partition
    from SBUF and 4K from PSUM."""
    def body(x):
        t = nl.ndarray((2, free), nl.bfloat16 if buf == nl.sbuf else nl.float32, buffer=buf)
        nisa.memset(dst=t, value=0.0, engine=nisa.engine.vector)
    if ok:
        run_body(body)
    else:
        with pytest.raises(NkiValidationError, match=r"65537 elements per partition; one DVE instruction accesses "
                                                     r"at most 65536 in SBUF"):
            run_body(body)


# ---- a kernel refused by the front end is refused at every launch --------------------------------------------

def test_front_end_refusal_repeats_on_every_launch():
    @nki.jit
    def optional_bias(x, bias=None):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        if bias is not None:                      # the NKI front end rejects 'is not'
            nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=1.0)
        nisa.dma_copy(dst=out, src=t)
        return out

    x = np.ones((4, 8), F32)
    for _ in range(3):                            # was: refused once, then silently run
        with pytest.raises(NkiValidationError, match="uses 'is not'"):
            optional_bias(x)


# ---- DMA self-copy of a partly written HBM tensor ------------------------------------------------------------

def test_dma_self_copy_of_partly_written_hbm_is_not_a_read_of_garbage():
    """A kernel fills only some rows of its output, then copies the whole output onto itself (a fence). The copy
    moves bytes onto themselves, so the unwritten rows stay unwritten instead of failing as an uninitialized read;
    the output warning still names them."""
    @nki.jit
    def first_rows(x, n_rows):
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray((n_rows, x.shape[1]), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[0:n_rows, :])
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=3.0)
        nisa.dma_copy(dst=out[0:n_rows, :], src=t)
        nisa.dma_copy(dst=out, src=out)
        return out

    x = np.arange(64, dtype=F32).reshape(8, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = first_rows(x, 5)
    np.testing.assert_array_equal(y[:5], 3 * x[:5])
    assert any("elements no instruction wrote" in str(w.message) for w in caught)


def test_dma_copy_between_different_regions_still_checks_initialization():
    @nki.jit
    def shift(x):
        tmp = nl.ndarray(x.shape, x.dtype, buffer=nl.hbm)
        nisa.dma_copy(dst=tmp[0:2, :], src=x[0:2, :])
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=tmp)           # rows 2.. of tmp were never written
        return out

    with pytest.raises(NkiValidationError, match="reads never-written memory"):
        shift(np.zeros((4, 4), F32))
