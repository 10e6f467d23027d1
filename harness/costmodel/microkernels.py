"""Hand-computable NKI micro-kernels for calibrating the cost model (run under nkisim, traced).

Each ``trace_*`` function launches one kernel in shape-only mode inside ``nkisim.trace.capture()`` and
returns the trace. The tests predict them and compare with the formulas; ``calibration`` uses them to
put a model number beside each published measurement of ``trn2-costs.md``.
"""
from __future__ import annotations

import nkisim

nkisim.install()

import nki  # noqa: E402
import nki.isa as nisa  # noqa: E402
import nki.language as nl  # noqa: E402

SD = nkisim.ShapeDtype


def capture(kernel, *args):
    with nkisim.trace.capture() as tr:
        kernel(*args)
    return tr


# ---- one DMA ------------------------------------------------------------------------------------
@nki.jit
def one_dma_store(x):
    """x: [P, F] HBM; one HBM->SBUF load then the measured object: one SBUF->HBM store of P*F bytes."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.shared_hbm)
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    nisa.dma_copy(dst=out, src=t)
    return out


@nki.jit
def one_dma_load(x):
    """One HBM->SBUF DMA of x (and nothing else)."""
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_one_dma(nbytes, lnc=1):
    """A single HBM->SBUF DMA of nbytes (uint8 [1, nbytes] or [128, nbytes/128])."""
    shape = (128, nbytes // 128) if nbytes % 128 == 0 and nbytes >= 128 * 4 else (1, nbytes)
    k = one_dma_load if lnc == 1 else one_dma_load[lnc]
    return capture(k, SD(shape, "uint8"))


@nki.jit
def two_loads(a, b, second_on_scalar=False):
    """Two independent HBM->SBUF loads of [P, F], issued in program order; the second from ScalarE's queue when
    ``second_on_scalar`` (engine=scalar), else from the compiler's choice like the first."""
    ta = nl.ndarray(a.shape, a.dtype, buffer=nl.sbuf)
    tb = nl.ndarray(b.shape, b.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=ta, src=a)
    if second_on_scalar:
        nisa.dma_copy(dst=tb, src=b, engine=nisa.engine.scalar, dge_mode=nisa.dge_mode.hwdge)
    else:
        nisa.dma_copy(dst=tb, src=b)
    out = nl.ndarray((1, 1), a.dtype, buffer=nl.shared_hbm)
    return out


def trace_two_loads(nbytes, second_on_scalar=False):
    shape = (128, nbytes // 128)
    return capture(two_loads, SD(shape, "uint8"), SD(shape, "uint8"), second_on_scalar)


@nki.jit
def many_small_dmas(x):
    """x: [n, 128] uint8 HBM; n independent 128-byte HBM->SBUF DMAs (the head_major_from_tp2013 shape)."""
    n = x.shape[0]
    t = nl.ndarray((1, n * 128), x.dtype, buffer=nl.sbuf)
    for i in range(n):
        nisa.dma_copy(dst=t[0:1, i * 128:(i + 1) * 128], src=x[i:i + 1, :])
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_small_dmas(n=64):
    return capture(many_small_dmas, SD((n, 128), "uint8"))


@nki.jit
def weight_stream(w, ring):
    """w: [n, 128, F] HBM; n HBM->SBUF loads of [128, F] issued up front into a ring of ``ring`` buffers (load i
    reuses the buffer of load i - ring: a weight stream; ring = n gives every load its own buffer)."""
    n, P, F = w.shape
    bufs = []
    for i in range(ring):
        bufs.append(nl.ndarray((P, F), w.dtype, buffer=nl.sbuf))
    for i in range(n):
        nisa.dma_copy(dst=bufs[i % ring], src=w[i])
    out = nl.ndarray((1, 1), w.dtype, buffer=nl.shared_hbm)
    return out


def trace_weight_stream(n, row_bytes, lnc=2, ring=None):
    k = weight_stream if lnc == 1 else weight_stream[lnc]
    return capture(k, SD((n, 128, row_bytes // 2), "bfloat16"), n if ring is None else ring)


# ---- TensorE ------------------------------------------------------------------------------------
@nki.jit
def matmul_chain(xT, w):
    """xT: [K, M] (stationary), w: [K, n*N] (moving). Loads both, then n matmuls of N columns accumulating
    into one PSUM tile (a chain on PE), then one PSUM->SBUF copy (ACT) and a store."""
    K, M = xT.shape
    N = 512 if w.shape[1] >= 512 else w.shape[1]
    n = w.shape[1] // N
    x_sb = nl.ndarray((K, M), xT.dtype, buffer=nl.sbuf)
    w_sb = nl.ndarray((K, n * N), w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=xT)
    nisa.dma_copy(dst=w_sb, src=w)
    p = nl.ndarray((M, N), nl.float32, buffer=nl.psum)
    for i in range(n):
        nisa.nc_matmul(dst=p, stationary=x_sb, moving=w_sb[:, i * N:(i + 1) * N], accumulate=i > 0)
    out = nl.ndarray((M, N), nl.float32, buffer=nl.shared_hbm)
    return out


def trace_matmul_chain(n=8, N=512, dtype="bfloat16", M=2):
    return capture(matmul_chain, SD((128, M), dtype), SD((128, n * N), dtype))


@nki.jit
def in_proj_pe(xT, w):
    """The in_proj GEMV of trn2-costs (derived calibration): 16 contraction tiles (h1) x column runs
    {256, 256, 512, 512, 16}, fp32 (2 passes), weight as the moving operand, T=2 stationary columns."""
    K, H1, T = xT.shape
    x_sb = nl.ndarray((K, H1, T), xT.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=xT)
    w_sb = nl.ndarray((K, H1, w.shape[2]), w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w)
    runs = (256, 256, 512, 512, 16)
    for h in range(H1):
        c0 = 0
        for r in runs:
            p = nl.ndarray((T, 512), nl.float32, buffer=nl.psum)
            nisa.nc_matmul(dst=p[:, 0:r], stationary=x_sb[:, h, :], moving=w_sb[:, h, c0:c0 + r])
            c0 += r
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    return out


def trace_in_proj():
    return capture(in_proj_pe, SD((128, 16, 2), "float32"), SD((128, 16, 1552), "float32"))


@nki.jit
def transpose_chain(x):
    """n PE transposes of [128, 128] bf16 tiles, independent (the "16-transpose chain")."""
    n, P, F = x.shape
    tiles = []
    for i in range(n):  # one dense tile each: a PE transpose source must be a whole tile on trn2
        t = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x[i])
        tiles.append(t)
    for i in range(n):
        p = nl.ndarray((F, P), x.dtype, buffer=nl.psum)
        nisa.nc_transpose(dst=p, data=tiles[i], engine=nisa.engine.tensor)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_transposes(n=16):
    return capture(transpose_chain, SD((n, 128, 128), "bfloat16"))


# ---- cross-engine dependency chain --------------------------------------------------------------
@nki.jit
def engine_chain(x, w):
    """DMA -> PE -> ACT(copy) -> DVE -> ACT(exp) -> DVE -> DMA, each step reading the previous result."""
    P, F = x.shape
    x_sb = nl.ndarray((P, P), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=x_sb, src=x[:, 0:P])
    w_sb = nl.ndarray((P, F), w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=w_sb, src=w)
    p = nl.ndarray((P, F), nl.float32, buffer=nl.psum)
    nisa.nc_matmul(dst=p, stationary=x_sb, moving=w_sb)
    a = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=a, op=nl.copy, data=p)
    b = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=b, data=a, op0=nl.multiply, operand0=0.5)
    c = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=c, op=nl.exp, data=b)
    d = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=d, data1=c, data2=a, op=nl.add)
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=d)
    return out


def trace_engine_chain(F=512):
    return capture(engine_chain, SD((128, F), "bfloat16"), SD((128, F), "bfloat16"))


# ---- ACT table switches -------------------------------------------------------------------------
ACT_SEQUENCE = ("exp", "exp", "silu", "exp", "rsqrt", "square", "copy", "sigmoid", "softplus", "tanh")


@nki.jit
def act_sequence(x):
    """One activation per function name of ACT_SEQUENCE, each on the same [128, F] fp32 SBUF tile."""
    P, F = x.shape
    t = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    for name in ACT_SEQUENCE:
        u = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
        nisa.activation(dst=u, op=getattr(nl, name), data=t)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_act_sequence(F=256):
    return capture(act_sequence, SD((128, F), "float32"))


# ---- DVE ----------------------------------------------------------------------------------------
@nki.jit
def dve_ops(x):
    """tensor_tensor on x (P rows, F columns, fp32); then tensor_reduce(max) and nc_find_index8 of row 0."""
    P, F = x.shape
    t = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    u = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=u, data1=t, data2=t, op=nl.add)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_dve(P, F, dtype="float32"):
    return capture(dve_ops, SD((P, F), dtype))


@nki.jit
def dve_reciprocal(x):
    """One VectorE reciprocal of x [P, F] fp32 (SBUF)."""
    P, F = x.shape
    t = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    u = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.reciprocal(dst=u, data=t)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_reciprocal(F=512, P=128):
    return capture(dve_reciprocal, SD((P, F), "float32"))


@nki.jit
def argmax_chunk(x):
    """x: [1, F] bf16: tensor_reduce(max) on one partition, then nc_find_index8 of that max (the argmax chunk)."""
    P, F = x.shape
    t = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=t, src=x)
    m = nl.ndarray((P, 8), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=m, value=0.0)
    nisa.tensor_reduce(dst=m[:, 0:1], op=nl.maximum, data=t, axis=1)
    idx = nl.ndarray((P, 8), nl.uint32, buffer=nl.sbuf)
    nisa.nc_find_index8(dst=idx, data=t, vals=m)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_argmax_chunk(F=15520):
    return capture(argmax_chunk, SD((1, F), "bfloat16"))


# ---- cross-core ---------------------------------------------------------------------------------
@nki.jit
def barrier_imbalance(x, F):
    """LNC=2, x: [P, 1] fp32 shared HBM. Core 0 runs one DVE op of F columns and stores its column 0 into
    x; both cores meet at core_barrier(data=x); core 1 then loads x (what core 0 wrote)."""
    P = x.shape[0]
    t = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    if nl.program_id(0) == 0:
        nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
        nisa.dma_copy(dst=x, src=t[:, 0:1])
    nisa.core_barrier(data=x, cores=(0, 1))
    if nl.program_id(0) == 1:
        u = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf)
        nisa.dma_copy(dst=u, src=x)
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    return out


def trace_barrier(F=1024):
    return capture(barrier_imbalance[2], SD((128, 1), "float32"), F)


@nki.jit
def sendrecv_pair(x):
    """LNC=2: each core exchanges a [P, F] SBUF tile with the other (x gives P, F and dtype)."""
    P, F = x.shape
    a = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=a, value=0.0)
    b = nl.ndarray((P, F), x.dtype, buffer=nl.sbuf)
    me = nl.program_id(0)
    nisa.sendrecv(src=a, dst=b, send_to_rank=1 - me, recv_from_rank=1 - me, pipe_id=0)
    out = nl.ndarray((1, 1), x.dtype, buffer=nl.shared_hbm)
    return out


def trace_sendrecv(P=32, F=64, dtype="float16"):
    return capture(sendrecv_pair[2], SD((P, F), dtype))


# ---- collectives (nkisim.launch: TP ranks x LNC cores) --------------------------------------------
@nki.jit
def all_reduce_8kb(x, rg):
    """Every core of every rank: memset a [T, H] bf16 SBUF partial (8 KB at T=2, H=2048), all-reduce it
    over the replica group, store the result. x gives the shape."""
    import nki.collectives as ncc
    T, H = x.shape
    t = nl.ndarray((T, H), x.dtype, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    r = nl.ndarray((T, H), x.dtype, buffer=nl.sbuf)
    ncc.all_reduce(srcs=[t], dsts=[r], replica_group=rg, op=nl.add)
    out = nl.ndarray((nl.num_programs(0), T, H), x.dtype, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out[nl.program_id(0)], src=r)
    return out


def trace_all_reduce(T=2, H=2048, tp=4, lnc=2):
    from nki.collectives import ReplicaGroup
    rg = ReplicaGroup([list(range(tp))])
    with nkisim.trace.capture() as tr:
        nkisim.launch(all_reduce_8kb, [(SD((T, H), "bfloat16"), rg) for _ in range(tp)], tp=tp, lnc=lnc)
    return tr


# ---- the costs of issue 13: physical reuse, DMA trigger queue, runtime-loop boundaries -----------------
def _reuse_stage(x, u, F):
    """Write an SBUF tile (DVE) and read it into u (ACT); the tile is freed on return (its address reused)."""
    t = nl.ndarray((x.shape[0], F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    nisa.activation(dst=u, op=nl.copy, data=t)


@nki.jit
def physical_reuse(x, F):
    """x gives P. Stage 1: memset a [P, F] tile (DVE), copy it into u1 on ACT (the long read); stage 2 allocates a
    tile of the same size -- first-fit places it at the freed address -- and memsets it: with physical hazards
    that write waits for stage 1's ACT read (WAR on the address), by buffer id it does not."""
    P = x.shape[0]
    u1 = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    u2 = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    _reuse_stage(x, u1, F)
    t = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=2.0)
    nisa.tensor_copy(dst=u2, src=t)
    out = nl.ndarray((1, 1), nl.float32, buffer=nl.shared_hbm)
    return out


def trace_physical_reuse(F=2048):
    return capture(physical_reuse, SD((128, 1), "float32"), F)


@nki.jit
def queued_dmas(x, y):
    """x, y: [P, F] fp32 HBM. DVE memsets a tile for a long time... (F columns), DMA 1 stores it (waits for the
    DVE), DMA 2 loads y into another tile (independent) -- in program order after DMA 1, so in one trigger queue
    it waits behind DMA 1's trigger."""
    P, F = x.shape
    t = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=t, value=1.0)
    nisa.tensor_scalar(dst=t, data=t, op0=nl.multiply, operand0=2.0)
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=t)
    v = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.dma_copy(dst=v, src=y)
    return out


def trace_queued_dmas(F=4096):
    return capture(queued_dmas, SD((128, F), "float32"), SD((128, F), "float32"))


@nki.jit
def loop_body(n, x):
    """n: [1, 1] int32 (the trip count, a real input); x gives [P, F]. A runtime loop of n iterations, each a DVE
    op on tile a (in place) and an ACT op on tile b (in place): independent engines, so without loop boundaries
    they overlap across iterations; then one store of a."""
    P, F = x.shape
    r = nisa.register_alloc()
    nisa.register_load(r, n)
    a = nl.ndarray((P, F), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=a, value=1.0)
    b = nl.ndarray((P, F // 4), nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=b, value=1.0, engine=nisa.engine.gpsimd)

    def body(i):
        nisa.tensor_scalar(dst=a, data=a, op0=nl.multiply, operand0=0.5)
        nisa.activation(dst=b, op=nl.copy, data=b)
    nl.fori_loop(0, r, body)
    out = nl.ndarray((P, F), nl.float32, buffer=nl.shared_hbm)
    nisa.dma_copy(dst=out, src=a)
    return out


def trace_loop_body(n=4, F=1024):
    import numpy as np
    return capture(loop_body, np.array([[n]], np.int32), SD((128, F), "float32"))
