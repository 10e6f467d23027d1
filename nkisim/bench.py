"""Speed benchmark of the interpreter itself (not a test; timings are never asserted).

    python -m nkisim.bench [--quick] [--out FILE.json]

Measures (1) instructions executed per second on a stream of small DVE/ACT instructions, with and without
tracing, (2) wall time of a tiled 2048^3 bf16 matmul kernel (numerics on), (3) shape-only trace time and
rate of a big synthetic kernel (a 4096 x 4096 x 8192 bf16 tiled matmul plus an eviction epilogue); prints the
figures (and writes them to ``--out``). The time to trace the project's full-size decode round is the application's
to measure: ``python -m harness.bench nkisim-speed`` adds it and writes bench/nkisim_speed.json.
"""
import argparse
import json
import os
import platform
import sys
import time

import numpy as np


def _kernels():
    import nki
    import nki.isa as nisa
    import nki.language as nl

    @nki.jit
    def small_ops(x, n_iter):
        """n_iter x (tensor_scalar, tensor_tensor, activation, tensor_reduce) on a [128, 64] fp32 tile."""
        t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        nisa.dma_copy(dst=t, src=x)
        u = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf)
        r = nl.ndarray((x.shape[0], 1), x.dtype, buffer=nl.sbuf)
        for _ in range(n_iter):
            nisa.tensor_scalar(dst=u, data=t, op0=nl.multiply, operand0=0.5, op1=nl.add, operand1=1.0)
            nisa.tensor_tensor(dst=u, data1=u, data2=t, op=nl.subtract)
            nisa.activation(dst=u, op=nl.exp, data=u, scale=-0.01)
            nisa.tensor_reduce(dst=r, op=nl.maximum, data=u, axis=1)
        out = nl.ndarray((x.shape[0], 1), x.dtype, buffer=nl.shared_hbm)
        nisa.dma_copy(dst=out, src=r)
        return out

    @nki.jit
    def tiled_matmul(a_t, b):
        """out[M, N] = a_t.T @ b; a_t [K, M], b [K, N] bf16 in HBM, 128 x 512 output tiles, fp32 PSUM."""
        K, M = a_t.shape
        N = b.shape[1]
        out = nl.ndarray((M, N), b.dtype, buffer=nl.shared_hbm)
        for m in range(M // 128):
            for n in range(N // 512):
                acc = nl.ndarray((128, 512), nl.float32, buffer=nl.psum)
                for k in range(K // 128):
                    lt = nl.ndarray((128, 128), a_t.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=lt, src=a_t[k * 128:(k + 1) * 128, m * 128:(m + 1) * 128])
                    rt = nl.ndarray((128, 512), b.dtype, buffer=nl.sbuf)
                    nisa.dma_copy(dst=rt, src=b[k * 128:(k + 1) * 128, n * 512:(n + 1) * 512])
                    nisa.nc_matmul(dst=acc, stationary=lt, moving=rt, accumulate=k > 0)
                o = nl.ndarray((128, 512), b.dtype, buffer=nl.sbuf)
                nisa.tensor_copy(dst=o, src=acc)
                nisa.dma_copy(dst=out[m * 128:(m + 1) * 128, n * 512:(n + 1) * 512], src=o)
        return out

    return small_ops, tiled_matmul


def run(quick=False):
    import ml_dtypes
    import nkisim
    nkisim.install()
    small_ops, tiled_matmul = _kernels()
    res = {"python": platform.python_version(), "numpy": np.__version__, "machine": platform.machine(),
           "cpus": os.cpu_count(), "load_avg_1min_at_start": round(os.getloadavg()[0], 2),
           "note": "wall-clock figures; *_cpu figures use process CPU time (robust to a loaded machine)"}
    rng = np.random.default_rng(0)

    # (1) instruction rate
    n_iter = 250 if quick else 1000
    x = rng.standard_normal((128, 64)).astype(np.float32)
    small_ops(x, 2)                                       # warm-up
    for traced in (False, True):
        t0, c0 = time.perf_counter(), time.process_time()
        if traced:
            with nkisim.trace.capture() as tr:
                small_ops(x, n_iter)
            n = len(tr.instructions)
        else:
            small_ops(x, n_iter)
            n = 4 * n_iter + 2
        dt, dc = time.perf_counter() - t0, time.process_time() - c0
        key = "instr_per_s_traced" if traced else "instr_per_s"
        res[key] = round(n / dt)
        res[key + "_cpu"] = round(n / dc)
    # (2) tiled 2048^3 bf16 matmul with numerics
    S = 1024 if quick else 2048
    a = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    b = rng.standard_normal((S, S)).astype(ml_dtypes.bfloat16)
    t0, c0 = time.perf_counter(), time.process_time()
    out = tiled_matmul(a, b)
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    ref = (a.astype(np.float32).T @ b.astype(np.float32))
    err = float(np.max(np.abs(out.astype(np.float32) - ref)) / np.max(np.abs(ref)))
    n_instr = (S // 128) * (S // 512) * ((S // 128) * 3 + 2)
    res[f"matmul_{S}_bf16_s"] = round(dt, 3)
    res[f"matmul_{S}_bf16_cpu_s"] = round(dc, 3)
    res[f"matmul_{S}_instructions"] = n_instr
    res[f"matmul_{S}_max_rel_err"] = err
    # (3) shape-only trace of a big synthetic kernel
    K, M, N = (2048, 2048, 4096) if quick else (4096, 4096, 8192)
    SD = nkisim.ShapeDtype
    t0, c0 = time.perf_counter(), time.process_time()
    with nkisim.trace.capture() as tr:
        tiled_matmul(SD((K, M), "bfloat16"), SD((K, N), "bfloat16"))
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    res["shape_only_kernel"] = f"tiled_matmul K={K} M={M} N={N} bf16"
    res["shape_only_instructions"] = len(tr.instructions)
    res["shape_only_trace_s"] = round(dt, 3)
    res["shape_only_trace_cpu_s"] = round(dc, 3)
    res["shape_only_instr_per_s"] = round(len(tr.instructions) / dt)
    res["shape_only_instr_per_s_cpu"] = round(len(tr.instructions) / dc)
    return res


def print_figures(res):
    w = max(len(k) for k in res)
    for k, v in res.items():
        print(f"{k.ljust(w)}  {v:,}" if isinstance(v, (int, float)) and not isinstance(v, bool) else f"{k.ljust(w)}  {v}")


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nkisim.bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller sizes (CI smoke run)")
    ap.add_argument("--out", help="also write the figures to this JSON file")
    a = ap.parse_args(argv)
    res = run(quick=a.quick)
    print_figures(res)
    if a.out:
        os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
