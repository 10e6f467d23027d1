"""LNC=2 (shared-HBM aliasing, barrier, sendrecv, in-place args), trace, shape-only mode."""
import json

import ml_dtypes
import numpy as np
import pytest

import nki
import nki.isa as nisa
import nki.language as nl
import nkisim
from nkisim_example_kernels import rmsnorm, softmax, tiled_matmul

F32 = np.float32


@nki.jit
def halves(x):
    """Each core writes one half of the shared output; core 1 then reads core 0's half after a barrier."""
    R, C = x.shape
    out = nl.ndarray((R, C), x.dtype, buffer=nl.shared_hbm)
    echo = nl.ndarray((R // 2, C), x.dtype, buffer=nl.shared_hbm)
    pid = nl.program_id(0)
    h = R // 2
    t = nl.ndarray((h, C), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x[pid * h:(pid + 1) * h, :])
    nisa.tensor_scalar(dst=t, data=t, op0=nl.add, operand0=float(pid + 1))
    nisa.dma_copy(dst=out[pid * h:(pid + 1) * h, :], src=t)
    nisa.core_barrier(data=out, cores=(0, 1))
    if pid == 1:
        u = nl.ndarray((h, C), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=u, src=out[0:h, :])
        nisa.dma_copy(dst=echo, src=u)
    return out, echo


def test_lnc2_shared_hbm_aliasing_and_barrier(rng):
    x = rng.standard_normal((8, 16)).astype(F32)
    out, echo = halves[2](x)
    np.testing.assert_array_equal(out[:4], x[:4] + 1)
    np.testing.assert_array_equal(out[4:], x[4:] + 2)
    np.testing.assert_array_equal(echo, x[:4] + 1)


def test_program_id_without_grid():
    @nki.jit
    def k(x):
        assert nl.program_ndim() == 0 and nl.program_id(0) == 0 and nl.num_programs(0) == 1
        out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        nisa.dma_copy(dst=out, src=t)
        return out
    k(np.zeros((2, 2), F32))


def test_sendrecv_swaps(rng):
    @nki.jit
    def k(x):
        out = nl.ndarray((2, 4, 8), x.dtype, buffer=nl.shared_hbm)
        pid = nl.program_id(0)
        mine = nl.ndarray((4, 8), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=mine, src=x[pid])
        got = nl.ndarray((4, 8), x.dtype, buffer=nl.sbuf)
        nisa.sendrecv(src=mine, dst=got, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=0)
        nisa.dma_copy(dst=out[pid], src=got)
        return out
    x = rng.standard_normal((2, 4, 8)).astype(F32)
    out = k[2](x)
    np.testing.assert_array_equal(out[0], x[1])
    np.testing.assert_array_equal(out[1], x[0])


def test_error_in_one_instance_propagates():
    @nki.jit
    def k(x):
        if nl.program_id(0) == 1:
            nl.ndarray((200, 2), nl.float32, buffer=nl.sbuf)
        nisa.core_barrier(data=x, cores=(0, 1))
        return x
    with pytest.raises(nkisim.NkiValidationError, match="200 partitions"):
        k[2](np.zeros((2, 2), F32))


def test_inplace_write_to_input_visible(rng):
    @nki.jit
    def k(cache, row):
        t = nl.ndarray((1, 8), row.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=row)
        nisa.dma_copy(dst=cache[3:4, :], src=t)
        return cache

    cache = np.zeros((6, 8), F32)
    row = rng.standard_normal((1, 8)).astype(F32)
    k(cache, row)
    np.testing.assert_array_equal(cache[3], row[0])
    assert not cache[[0, 1, 2, 4, 5]].any()


def test_trace_contents_and_json(rng):
    x = rng.standard_normal((256, 64)).astype(F32)
    with nkisim.trace.capture() as tr:
        softmax[2](x)
    ins = tr.instructions
    assert {r["inst"] for r in ins} == {0, 1}
    assert tr.summary()[("PE", "nc_matmul")] if ("PE", "nc_matmul") in tr.summary() else True
    dma = [r for r in ins if r["op"] == "dma_copy"]
    assert dma[0]["bytes"]["shared_hbm"]["read"] == 128 * 64 * 4 and dma[0]["bytes"]["sbuf"]["write"] == 128 * 64 * 4
    assert dma[0]["loc"].startswith("nkisim_example_kernels.py:")
    act = next(r for r in ins if r["op"] == "activation")
    assert act["engine"] == "ACT" and act["func"] == "exp" and act["writes"][0]["part"] == [0, 128]
    json.loads(tr.to_json())


@pytest.mark.parametrize("case", ["matmul", "rmsnorm", "softmax2"])
def test_shape_only_trace_equals_execution(rng, case):
    bf = ml_dtypes.bfloat16
    if case == "matmul":
        k, args = tiled_matmul, (rng.standard_normal((256, 128)).astype(bf), rng.standard_normal((256, 512)).astype(bf))
    elif case == "rmsnorm":
        k, args = rmsnorm, (rng.standard_normal((4, 256)).astype(bf), rng.standard_normal(256).astype(bf), 1e-6)
    else:
        k, args = softmax[2], (rng.standard_normal((256, 64)).astype(F32),)
    with nkisim.trace.capture() as t_exec:
        k(*args)
    shapes = tuple(nkisim.ShapeDtype(a.shape, a.dtype) if isinstance(a, np.ndarray) else a for a in args)
    with nkisim.trace.capture() as t_shape:
        out = k(*shapes)
    assert t_exec.comparable() == t_shape.comparable()
    assert len(t_exec.instructions) > 3
    outs = out if isinstance(out, tuple) else (out,)
    assert all(isinstance(o, nkisim.ShapeDtype) for o in outs)
    with nkisim.shape_only(), nkisim.trace.capture() as t_ctx:
        k(*args)
    assert t_ctx.comparable() == t_exec.comparable()


def test_shape_only_big_args_allocate_nothing():
    big = nkisim.ShapeDtype((1 << 20, 4096), "bfloat16")     # 8 GiB if it were real
    with nkisim.trace.capture() as tr:
        out = tiled_matmul(nkisim.ShapeDtype((128, 128), "bfloat16"), nkisim.ShapeDtype((128, 512), "bfloat16"))
    assert out == nkisim.ShapeDtype((128, 512), "bfloat16") and big.shape[0] == 1 << 20
    assert [r["op"] for r in tr.instructions].count("nc_matmul") == 1


def test_summary_function_and_cli(rng, tmp_path, capsys):
    from nkisim import summary
    x = rng.standard_normal((256, 64)).astype(F32)
    with nkisim.trace.capture() as tr:
        softmax[2](x)
    path = tmp_path / "t.json"
    tr.to_json(str(path))
    s = summary.summarize(str(path))
    assert set(s["instances"]) == {"r0c0", "r0c1"}
    c0 = s["instances"]["r0c0"]
    assert c0["instructions"] == sum(c0["by_engine"].values()) == len(tr.by_instance(0))
    assert c0["by_op"]["ACT.activation"] >= 1
    assert c0["dma"]["hbm->sbuf"]["bytes"] == 128 * 64 * 4
    assert 0 < c0["sbuf_peak_bytes_per_partition"] <= nkisim.hw.SBUF_PARTITION_BYTES
    assert summary.summarize(tr) == s
    assert summary.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "instructions per engine" in out and "r0c1" in out and "hbm->sbuf" in out
