"""Documented constraints are refused with messages naming op, argument, expectation and value."""
import warnings

import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim_helpers import run_body
from nkisim import AllocationError, NkiValidationError, UninitializedReadError

F32 = np.float32


def _sb(shape, dt=nl.float32, buf=nl.sbuf):
    return nl.ndarray(shape, dt, buffer=buf)


def test_partition_limit():
    with pytest.raises(NkiValidationError, match=r"nl.ndarray: .* 130 partitions, the partition dim is at most 128"):
        run_body(lambda x: _sb((130, 4)))


def test_matmul_limits():
    def k_too_big(x):
        s, m, p = _sb((128, 130), nl.bfloat16), _sb((128, 64), nl.bfloat16), _sb((128, 64), buf=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match=r"nc_matmul: .*stationary has 130 free elements \(M\), at most 128"):
        run_body(k_too_big)

    def k_n(x):
        s, m, p = _sb((128, 64), nl.bfloat16), _sb((128, 640), nl.bfloat16), _sb((64, 640), buf=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match=r"(moving has 640 free elements|cannot allocate|needs)"):
        run_body(k_n)

    def k_dtype(x):
        s, m, p = _sb((128, 64), nl.float32), _sb((128, 64), nl.bfloat16), _sb((64, 64), buf=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match="fp32/tf32 operands must pair"):
        run_body(k_dtype)

    def k_bf16_dst(x):
        s, m, p = _sb((128, 64), nl.bfloat16), _sb((128, 64), nl.bfloat16), _sb((64, 64), nl.bfloat16, nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match="dst dtype must be float32"):
        run_body(k_bf16_dst)

    def k_mem(x):
        s, m, p = _sb((128, 64), nl.bfloat16, nl.psum), _sb((128, 64), nl.bfloat16), _sb((64, 64), buf=nl.psum)
        nisa.nc_matmul(dst=p, stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match=r"nc_matmul: stationary is in psum .* expected sbuf"):
        run_body(k_mem)


def test_matmul_bank_crossing():
    def k(x):
        big = _sb((64, 1024), buf=nl.psum)             # two banks
        s, m = _sb((128, 64), nl.bfloat16), _sb((128, 512), nl.bfloat16)
        nisa.memset(dst=s, value=0.0)
        nisa.memset(dst=m, value=0.0)
        nisa.nc_matmul(dst=big[:, 256:768], stationary=s, moving=m)
    with pytest.raises(NkiValidationError, match="crosses a 2048 B PSUM bank boundary"):
        run_body(k)


def test_dma_psum_refused():
    def k(x):
        p = _sb((4, 4), buf=nl.psum)
        nisa.dma_copy(dst=x, src=p)
    with pytest.raises(NkiValidationError, match="dma_copy: src is in psum"):
        run_body(k)


def test_dma_count_mismatch_and_hwdge_cast():
    def k(x):
        nisa.dma_copy(dst=_sb((4, 3)), src=x)
    with pytest.raises(NkiValidationError, match="src .* has 16 elements but dst .* has 12"):
        run_body(k)

    def k2(x):
        nisa.dma_copy(dst=_sb((4, 4), nl.bfloat16), src=x, dge_mode=nisa.dge_mode.hwdge)
    with pytest.raises(NkiValidationError, match="hwdge moves raw bytes"):
        run_body(k2)


def test_engine_reach_and_both_psum():
    def k(x):
        p = _sb((4, 4), buf=nl.psum)
        nisa.memset(dst=p, value=0.0, engine=nisa.engine.gpsimd)
    with pytest.raises(NkiValidationError, match="memset: dst is in psum .*POOL cannot access psum"):
        run_body(k)

    def k2(x):
        a, b = _sb((4, 4), buf=nl.psum), _sb((4, 4), buf=nl.psum)
        nisa.tensor_tensor(dst=_sb((4, 4)), data1=a, data2=b, op=nl.add)
    with pytest.raises(NkiValidationError, match="both in psum"):
        run_body(k2)


def test_partition_and_element_mismatch():
    def k(x):
        nisa.tensor_copy(dst=_sb((4, 8)), src=_sb((4, 9)))
    with pytest.raises(NkiValidationError, match="dst .* has 8 elements per partition but src .* has 9"):
        run_body(k)

    def k2(x):
        nisa.tensor_copy(dst=_sb((8, 4)), src=_sb((4, 8)))
    with pytest.raises(NkiValidationError, match="dst has 8 partitions but src has 4"):
        run_body(k2)


def test_start_partition_rule():
    def k(x):
        t = _sb((128, 4))
        nisa.memset(dst=t[5:6, :], value=0.0)
    with pytest.raises(NkiValidationError, match=r"starts at partition 5 with 1 partitions"):
        run_body(k)

    def ok(x):
        t = _sb((128, 4))
        nisa.memset(dst=t[32:64, :], value=0.0)
        nisa.memset(dst=t[64:128, :], value=0.0)
    run_body(ok)


def test_tensor_scalar_operand_dtype_and_scalar_engine():
    def k(x):
        col = _sb((4, 1), nl.bfloat16)
        nisa.tensor_scalar(dst=_sb((4, 4)), data=_sb((4, 4)), op0=nl.multiply, operand0=col)
    with pytest.raises(NkiValidationError, match="operand0 tile must be float32"):
        run_body(k)

    def k2(x):
        nisa.tensor_scalar(dst=_sb((4, 4)), data=_sb((4, 4)), op0=nl.maximum, operand0=1.0,
                           engine=nisa.engine.scalar)
    with pytest.raises(NkiValidationError, match="engine=scalar supports only"):
        run_body(k2)


def test_activation_rules():
    def k(x):
        nisa.activation(dst=_sb((4, 4)), op=nl.add, data=_sb((4, 4)))
    with pytest.raises(NkiValidationError, match="not an activation function"):
        run_body(k)

    def k2(x):
        nisa.activation(dst=_sb((4, 4)), op=nl.exp, data=_sb((4, 4)), reduce_op=nl.maximum,
                        reduce_res=_sb((4, 1)), reduce_cmd=nisa.reduce_cmd.reset_reduce)
    with pytest.raises(NkiValidationError, match="reduce_op must be nl.add"):
        run_body(k2)


def test_tensor_reduce_axis_rule():
    def k(x):
        nisa.tensor_reduce(dst=_sb((4, 8)), op=nl.add, data=_sb((4, 8, 2)), axis=1)
    with pytest.raises(NkiValidationError, match=r"trailing contiguous free.*since NKI 0.3.0 axis=1 no longer means "
                                                 r"the last dim of a 3-D tensor"):
        run_body(k)


def test_memset_value_type():
    def k(x):
        nisa.memset(dst=_sb((4, 4), nl.int32), value=1.5)
    with pytest.raises(NkiValidationError, match="value type must match"):
        run_body(k)


def test_uninitialized_read_names_op_and_tensor():
    def k(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, name="scratch")
        nisa.tensor_copy(dst=_sb((4, 4)), src=t)
    with pytest.raises(UninitializedReadError, match=r"tensor_copy: src reads never-written memory of tensor 'scratch'"):
        run_body(k)

    def partial(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, name="half")
        nisa.memset(dst=t[:, 0:2], value=0.0)
        nisa.activation(dst=_sb((4, 4)), op=nl.exp, data=t)
    with pytest.raises(UninitializedReadError, match=r"element \[0, 2\]"):
        run_body(partial)


def test_new_memory_is_nan_filled():
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.shared_hbm)
        return out
    with pytest.warns(UserWarning, match="no instruction wrote"):
        out = k(np.zeros((1, 1), F32))
    assert np.isnan(out).all()


def test_sbuf_capacity():
    def k(x):
        a = _sb((128, 30000))          # 120,000 B per partition
        b = _sb((128, 30000))          # another 120,000 -> over 212,984
    with pytest.raises(AllocationError, match=r"cannot allocate .* capacity 212,984 B per partition"):
        run_body(k)

    def freed(x):
        for _ in range(4):
            a = _sb((128, 30000))       # previous tile is released when rebound... after allocation
            del a
    run_body(freed)


def test_psum_capacity():
    def k(x):
        ts = [_sb((128, 512), buf=nl.psum) for _ in range(9)]
    with pytest.raises(AllocationError, match="psum"):
        run_body(k)


def test_output_must_be_shared_hbm():
    @nki.jit
    def k(x):
        out = nl.ndarray((4, 4), nl.float32, buffer=nl.hbm)
        nisa.dma_copy(dst=out, src=x)
        return out
    with pytest.raises(NkiValidationError, match="must be allocated in nl.shared_hbm"):
        k(np.zeros((4, 4), F32))


def test_jit_rejects_removed_options_and_bad_grid():
    with pytest.raises(NkiValidationError, match="mode"):
        nki.jit(mode="simulation")(lambda x: x)
    with pytest.raises(NkiValidationError, match="1 or 2"):
        nki.jit(lambda x: x)[4]
    with pytest.raises(NkiValidationError, match="lists"):
        nki.jit(lambda x: x)([np.zeros(2)])


def test_ap_partition_step_rule():
    def k(x):
        t = _sb((128, 64))
        t.ap(pattern=[[128, 64], [1, 64]])            # every other partition
    with pytest.raises(NkiValidationError, match="partition step .* must equal the free size"):
        run_body(k)


# ---- free dims of compute-engine operands (isa/common._ap_limits, hw.AP_*) -------------------------------------
def _free_dims_kernel(view, engine_op=True):
    """Copy x [4, 120] through an SBUF tile [4, 2, 3, 4, 5], reading it back through ``view(tile)`` with tensor_copy
    (engine_op) or an SBUF -> SBUF dma_copy; returns the kernel."""
    @nki.jit
    def k(x):
        t = nl.ndarray((4, 2, 3, 4, 5), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x.reshape((4, 2, 3, 4, 5)))
        d = nl.ndarray((4, 120), nl.float32, buffer=nl.sbuf)
        if engine_op:
            nisa.tensor_copy(dst=d, src=view(t))
        else:
            nisa.dma_copy(dst=d, src=view(t))
        out = nl.ndarray((4, 120), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=d)
        return out
    return k


def _whole(t):
    return t


def _reversed(t):
    return t.permute((0, 4, 3, 2, 1))               # free pattern [[1, 5], [5, 4], [20, 3], [60, 2]]: no merge


def _inner_swapped(t):
    return t.permute((0, 1, 2, 4, 3))               # [[60, 2], [20, 3], [1, 5], [5, 4]] -> [[20, 6], [1, 5], [5, 4]]


_X120 = np.arange(4 * 120, dtype=F32).reshape(4, 120)
_REVERSED = np.ascontiguousarray(_X120.reshape(4, 2, 3, 4, 5).transpose(0, 4, 3, 2, 1)).reshape(4, 120)


def test_four_free_dims_that_do_not_merge_are_warned_or_refused(monkeypatch):
    """SDK nki-aps.rst: "most instructions only support 1D/2D/3D in the free dimension": a compute operand whose four
    free dims cannot merge is warned (refused with the switch at "error"); the data still moves as the view says."""
    with pytest.warns(nkisim.NkiFidelityWarning, match=r"tensor_copy: src .*\[\[1, 5\], \[5, 4\], \[20, 3\], "
                                                          r"\[60, 2\]\].* 4 free dims; \"most instructions"):
        y = _free_dims_kernel(_reversed)(_X120)
    np.testing.assert_array_equal(y, _REVERSED)
    monkeypatch.setattr(nkisim.hw, "AP_FOUR_FREE_DIMS", "error")
    with pytest.raises(NkiValidationError, match=r"tensor_copy: src .* 4 free dims; \"most instructions"):
        _free_dims_kernel(_reversed)(_X120)


def test_four_free_dims_that_merge_and_dma_operands_are_accepted():
    """A [4, 2, 3, 4, 5] tile read whole merges to one free dim, and a view keeping the two outer and the two inner
    dims together ([[60, 2], [20, 3]] -> [[20, 6]]) to three; a DMA may take the unmerged four-dim view (the docs limit
    engine access patterns, not DMA descriptors)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", nkisim.NkiFidelityWarning)
        y = _free_dims_kernel(_whole)(_X120)
        np.testing.assert_array_equal(y, _X120)
        y = _free_dims_kernel(_inner_swapped)(_X120)
        ref = np.ascontiguousarray(_X120.reshape(4, 2, 3, 4, 5).transpose(0, 1, 2, 4, 3)).reshape(4, 120)
        np.testing.assert_array_equal(y, ref)
        y = _free_dims_kernel(_reversed, engine_op=False)(_X120)
        np.testing.assert_array_equal(y, _REVERSED)


def test_tensor_reduce_takes_four_free_dims_and_views_have_at_most_five():
    """tensor_reduce's data is documented with four free dims (SDK-NL sum axis [1,2,3,4]; the average_pool2d tutorial's
    [P, H/2, W/2, 2, 2] view): no warning. An on-chip view has at most 5 dims (SDK-LG "Tensor Values"), so no engine
    operand has more than the hardware's four free dims: a 6-D tile or reshape is refused."""
    x = np.arange(2 * 36, dtype=F32).reshape(2, 36)

    @nki.jit
    def pool(x):
        t = nl.ndarray((2, 36), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        v = t.ap([[36, 2], [12, 3], [2, 3], [6, 2], [1, 2]])        # 6x6 image, 2x2 windows
        s = nl.ndarray((2, 3, 3), nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=s, op=nl.add, data=v, axis=(3, 4))
        out = nl.ndarray((2, 3, 3), nl.float32, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=s)
        return out
    with warnings.catch_warnings():
        warnings.simplefilter("error", nkisim.NkiFidelityWarning)
        y = pool(x)
    np.testing.assert_array_equal(y, x.reshape(2, 3, 2, 3, 2).sum(axis=(2, 4)))

    def six_d_tile(x):
        _sb((4, 2, 2, 2, 2, 2))
    with pytest.raises(NkiValidationError, match=r"nl.ndarray: an on-chip tensor has at most 5 dims"):
        run_body(six_d_tile)

    def six_d_view(x):
        _sb((4, 32)).reshape((4, 2, 2, 2, 2, 2))
    with pytest.raises(NkiValidationError, match=r"view: an on-chip view has at most 5 dims"):
        run_body(six_d_view)


def test_engine_step_beyond_int16_is_refused():
    """SDK trainium_inferentia2_arch.rst: an engine AP's free-dim stride is an int16 in elements. Every other 40,000th
    bf16 element (a [1, 2, 40000] tile read at [:, :, 0]) cannot be encoded; a run inside one row of it can."""
    def k(x):
        t = _sb((1, 2, 40000), nl.bfloat16)
        nisa.memset(dst=t[:, 0, :], value=1.0)
        nisa.memset(dst=t[:, 1, :], value=2.0)
        d = _sb((1, 2), nl.bfloat16)
        nisa.tensor_copy(dst=d, src=t[:, :, 0:1])
    with pytest.raises(NkiValidationError, match=r"tensor_copy: src .* step 40000 does not fit the int16 stride"):
        run_body(k)

    def ok(x):
        t = _sb((1, 2, 40000), nl.bfloat16)
        nisa.memset(dst=t[:, 0, :], value=1.0)
        nisa.memset(dst=t[:, 1, :], value=2.0)
        d = _sb((1, 1000), nl.bfloat16)
        nisa.tensor_copy(dst=d, src=t[:, 1, 39000:40000])
    run_body(ok)


def test_top8_output_ranks():
    """SDK-ISA max8: "the output tile is always 2-dimensional"; nc_find_index8: dst "a 2D tile", vals "up to
    3-dimensional". A (P, 1, 8) dst is refused; the same tile viewed as (P, 8) runs."""
    def k(x):
        src = _sb((2, 16))
        nisa.iota(dst=src, pattern=[[1, 16]], offset=0, channel_multiplier=16)
        d = _sb((2, 1, 8))
        nisa.max8(dst=d, src=src)
    with pytest.raises(NkiValidationError, match=r"max8: dst has shape \[2, 1, 8\]; it may have at most 2 dims"):
        run_body(k)

    def k_vals(x):
        src = _sb((2, 16))
        nisa.iota(dst=src, pattern=[[1, 16]], offset=0, channel_multiplier=16)
        v = _sb((2, 2, 2, 2))
        nisa.memset(dst=v, value=1.0)
        nisa.nc_find_index8(dst=_sb((2, 8), nl.uint32), data=src, vals=v)
    with pytest.raises(NkiValidationError, match=r"nc_find_index8: vals has shape \[2, 2, 2, 2\]; it may have at "
                                                 r"most 3 dims"):
        run_body(k_vals)

    def ok(x):
        src = _sb((2, 16))
        nisa.iota(dst=src, pattern=[[1, 16]], offset=0, channel_multiplier=16)
        d = _sb((2, 1, 8))
        nisa.max8(dst=d[:, 0, :], src=src)
        nisa.nc_find_index8(dst=_sb((2, 8), nl.uint32), data=src, vals=d.reshape((2, 2, 4)))
    run_body(ok)


def test_install_idempotent_and_api_surface():
    import json
    import os
    import sys
    assert nkisim.install() and nkisim.install()
    assert sys.modules["nki.isa"] is nisa and sys.modules["nki.language"] is nl
    import nki.collectives  # noqa: F401
    import nki.typing  # noqa: F401
    spec = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "docs", "nki-api-0.6.json")
    if not os.path.exists(spec):
        pytest.skip("API spec not present")
    api = json.load(open(spec))["modules"]
    mods = {"nki": nki, "nki.isa": nisa, "nki.language": nl, "nki.collectives": sys.modules["nki.collectives"]}
    missing = [f"{m}.{f}" for m, v in api.items() for f in v["functions"] if not hasattr(mods[m], f)]
    missing += [f"{m}.{e}" for m, v in api.items() for e in v["enums"] if m != "nki.language" and not hasattr(mods[m], e)]
    missing += [f"{m}.{c}" for m, v in api.items() for c in v["constants"] if not hasattr(mods[m], c)]
    from nkisim.tensor import NkiTensor
    for m, v in api.items():
        for cname, c in v["classes"].items():
            cls = NkiTensor if cname == "NkiTensor" else getattr(mods[m], cname, None)
            missing += [f"{m}.{cname}.{meth}" for meth in c["methods"] if cls is None or not hasattr(cls, meth)]
    assert missing == []
    # every isa function accepts the documented parameter names
    import inspect
    for f, params in api["nki.isa"]["functions"].items():
        sig = inspect.signature(getattr(nisa, f))
        if any(p.kind == p.VAR_KEYWORD for p in sig.parameters.values()):
            continue
        names = [p["name"] for p in params]
        assert list(sig.parameters)[:len(names)] == names, f


def test_trn3_only_ops_are_the_only_refused_isa_functions():
    """Every nki.isa function of the 0.6 API is implemented except the NeuronCore-v4 ones, which are refused as
    a trn2 compiler would (ref §5.13), not reported as missing."""
    refused = sorted(n for n in dir(nisa) if getattr(getattr(nisa, n), "trn3_only", False))
    assert refused == ["activate2", "exponential", "nc_matmul_mx", "quantize_mx", "rand2"]
    for n in refused:
        with pytest.raises(NkiValidationError, match=rf"nisa.{n}: NeuronCore-v4 \(trn3\) only"):
            getattr(nisa, n)()


def test_messages_name_unnamed_tensors_by_their_kernel_variable_and_line():
    """Without name=, errors show the variable the kernel assigned the tensor to and the allocating line, not
    nkisim's internal default name (which traces keep)."""
    def uninit(x):
        scratch = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        acc = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=acc, data1=scratch, data2=scratch, op=nl.add)
    with pytest.raises(UninitializedReadError, match=r"tensor 'scratch' \(sbuf float32\[4, 4\], allocated at "
                                                     r"test_constraints.py:\d+\)"):
        run_body(uninit)

    def too_big(x):
        huge = nl.ndarray((128, 60_000), nl.float32, buffer=nl.sbuf)
    with pytest.raises(AllocationError, match=r"'huge' \(allocated at test_constraints.py:\d+\) needs 240,000 B"):
        run_body(too_big)

    def named(x):
        t = nl.ndarray((4, 4), nl.float32, buffer=nl.sbuf, name="my_tile")
        nisa.tensor_copy(dst=t, src=t)
    with pytest.raises(UninitializedReadError, match=r"tensor 'my_tile' \(sbuf float32\[4, 4\]\)"):
        run_body(named)


def test_tile_size_constants_trn2():
    """nl.tile_size on trn2 (SDK-TILE; ref §4): per-partition SBUF figures vs the all-partition total."""
    ts = nl.tile_size
    assert (ts.pmax, ts.psum_bank_fmax, ts.psum_bank_fmax_bytes, ts.psum_num_banks) == (128, 512, 2048, 8)
    assert (ts.gemm_stationary_fmax, ts.gemm_moving_fmax, ts.bn_stats_fmax) == (128, 512, 512)
    assert ts.sbuf_fmax_bytes == ts.total_available_sbuf_size == 212_984 and ts.sbuf_fmax == 212_984 // 4
    assert ts.sbuf_size_bytes == 28 * 2 ** 20            # "total SBUF capacity (all partitions combined)"
    assert ts.psum_fmax == ts.psum_bank_fmax             # deprecated alias
