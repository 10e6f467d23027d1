"""Three kernels written as one would for trn2 (ISA-first, explicit dst=), used by the tests."""
import nki
import nki.isa as nisa
import nki.language as nl


@nki.jit
def tiled_matmul(lhsT, rhs):
    """out[M, N] = lhsT[K, M].T @ rhs[K, N]; bf16 in, fp32 PSUM accumulation, bf16 out.
    K, M multiples of 128; N multiple of 512."""
    K, M = lhsT.shape
    _, N = rhs.shape
    out = nl.ndarray((M, N), dtype=lhsT.dtype, buffer=nl.shared_hbm)
    TK, TM, TN = nl.tile_size.pmax, nl.tile_size.gemm_stationary_fmax, nl.tile_size.gemm_moving_fmax
    for m in nl.affine_range(M // TM):
        for n in nl.affine_range(N // TN):
            acc = nl.ndarray((TM, TN), dtype=nl.float32, buffer=nl.psum)
            for k in nl.affine_range(K // TK):
                a = nl.ndarray((TK, TM), dtype=lhsT.dtype, buffer=nl.sbuf)
                b = nl.ndarray((TK, TN), dtype=rhs.dtype, buffer=nl.sbuf)
                nisa.dma_copy(dst=a, src=lhsT[k * TK:(k + 1) * TK, m * TM:(m + 1) * TM])
                nisa.dma_copy(dst=b, src=rhs[k * TK:(k + 1) * TK, n * TN:(n + 1) * TN])
                nisa.nc_matmul(dst=acc, stationary=a, moving=b)
            res = nl.ndarray((TM, TN), dtype=out.dtype, buffer=nl.sbuf)
            nisa.tensor_copy(dst=res, src=acc)
            nisa.dma_copy(dst=out[m * TM:(m + 1) * TM, n * TN:(n + 1) * TN], src=res)
    return out


@nki.jit
def rmsnorm(x, w, eps):
    """out[T, H] = x / sqrt(mean(x^2) + eps) * w; x [T, H] (T <= 128 on partitions), w [H]."""
    T, H = x.shape
    out = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.shared_hbm)
    xt = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xt, src=x)
    sq = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.sbuf)
    ss = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.activation(dst=sq, op=nl.square, data=xt)
    nisa.tensor_reduce(dst=ss, op=nl.add, data=sq, axis=1)
    rstd = nl.ndarray((T, 1), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=rstd, data=ss, op0=nl.multiply, operand0=1.0 / H, op1=nl.add, operand1=eps)
    nisa.activation(dst=rstd, op=nl.rsqrt, data=rstd)
    # broadcast w over the T partitions with a stride-0 DMA source
    wt = nl.ndarray((T, H), dtype=w.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=wt, src=w.ap(pattern=[[0, T], [1, H]], offset=0))
    y = nl.ndarray((T, H), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=y, data=xt, op0=nl.multiply, operand0=rstd)
    o = nl.ndarray((T, H), dtype=x.dtype, buffer=nl.sbuf)
    nisa.tensor_tensor(dst=o, data1=y, data2=wt, op=nl.multiply)
    nisa.dma_copy(dst=out, src=o)
    return out


@nki.jit
def softmax(x):
    """Row softmax of x [R, C], R a multiple of 128 split over the LNC instances, rows on partitions."""
    R, C = x.shape
    out = nl.ndarray((R, C), dtype=x.dtype, buffer=nl.shared_hbm)
    P = nl.tile_size.pmax
    n_prg, pid = (nl.num_programs(0), nl.program_id(0)) if nl.program_ndim() != 0 else (1, 0)
    tiles = R // P
    for i in range(pid, tiles, n_prg):
        xt = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=xt, src=x[i * P:(i + 1) * P, :])
        mx = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.tensor_reduce(dst=mx, op=nl.maximum, data=xt, axis=1, negate=True)
        e = nl.ndarray((P, C), dtype=nl.float32, buffer=nl.sbuf)
        s = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.activation(dst=e, op=nl.exp, data=xt, bias=mx, reduce_op=nl.add, reduce_res=s,
                        reduce_cmd=nisa.reduce_cmd.reset_reduce)
        r = nl.ndarray((P, 1), dtype=nl.float32, buffer=nl.sbuf)
        nisa.reciprocal(dst=r, data=s)
        o = nl.ndarray((P, C), dtype=x.dtype, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=o, data=e, op0=nl.multiply, operand0=r)
        nisa.dma_copy(dst=out[i * P:(i + 1) * P, :], src=o)
    return out
