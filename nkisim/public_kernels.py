"""Fidelity sweep: run unmodified public NKI kernels under nkisim and compare them with numpy references.

    python -m nkisim.public_kernels --nki-library PATH [--sdk PATH] [--extra trnblas=PATH]
                                    [--only SUBSTR] [--json bench/public_kernels.json] [--provenance TEXT]

PATH is a checkout of aws-neuron/nki-library (kernels imported from PATH/src/nkilib_src/nkilib) and,
optionally, of aws-neuron/aws-neuron-sdk (tutorial kernels under PATH/nki/examples) and of third-party
repositories written for the NKI >= 0.3 API (--extra NAME=PATH; known names: see EXTRA_REPOS). Nothing of that code
lives in this repository: the kernels are imported from the user's checkout as they are. What lives here is
ours: which kernel to call with which arguments, the seeded inputs, the numpy reference written from each
kernel's documented semantics, the shapes and the tolerances.

One progress line is printed per kernel variant, then a result table; the JSON (kernel names, source paths
relative to the checkout, content hash of the kernel file, shapes, dtypes, LNC, status, max error) goes to
--json. Statuses:

    PASS        ran and matched the reference within tolerance
    FAIL        ran, but the output differs from the reference
    REFUSED-OK  refused by nkisim for a documented rule the kernel breaks (the rule and its source are listed)
    REFUSED     refused by nkisim and no documented rule was expected to refuse it (a fidelity bug)
    NOT-REFUSED ran although a documented rule forbids it (a fidelity bug)
    NOT-IMPL    uses an API nkisim does not implement (yet)
    ERROR       any other exception
    SKIPPED     a file the kernel needs is not in the given checkout (or no checkout given): the note names it

Exit status: 0 when nothing FAILed / was REFUSED unexpectedly / ERRORed, 1 otherwise, 2 for a bad checkout path.
"""
import argparse
import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import time
import traceback
import warnings

import numpy as np

NKL_SUBDIR = os.path.join("src", "nkilib_src")
SDK_SUBDIR = os.path.join("nki", "examples")
# Third-party repositories (--extra NAME=PATH): NAME -> (GitHub repository, what a checkout must contain).
EXTRA_REPOS = {
    "trnblas": ("trnsci/trnblas", os.path.join("trnblas", "nki")),
}

# Rules whose violation is visible in the kernel file itself: when the checkout's version of the file no longer
# contains the text, upstream fixed it and the variant is expected to run (e.g. platform_target= is gone from the
# SDK tutorial and the nki-library collectives at aws-neuron-sdk 81ce03a / nki-library d2ad3a5).
SOURCE_MARKERS = {"platform_target": "platform_target"}

# Documented rules that refuse some public kernels: (rule and its source, text the refusal must contain).
RULES = {
    "platform_target": ("nki.jit(platform_target=...) raises an error since NKI 0.3.0 (SDK nki/migration/"
                        "nki-0-3-0-update-guide.rst, 'Deprecated and Removed APIs'; ref §1.3)", "platform_target"),
    "is_operator": ("the NKI compiler rejects 'is' / 'is not' since NKI 0.3.0 (SDK nki-0-3-0-update-guide.rst, "
                    "'Language Restrictions'; ref §1.3)", "'is not'"),
    "hbm_output": ("kernel outputs must be nl.shared_hbm; nl.hbm outputs fail to compile since NKI 0.3.0 (SDK "
                   "nki-0-3-0-update-guide.rst 'Output Tensors Must Use nl.shared_hbm'; ref §1.3)", "shared_hbm"),
    "reduce_axis": ("tensor_reduce axis numbers name real dims since NKI 0.3.0; axis=1 meaning 'last dim' of a "
                    "3D/4D tile now errors (SDK nki-0-3-0-update-guide.rst 'nisa.tensor_reduce - Axis Handling "
                    "Fix'; ref §5 tensor_reduce)", "tensor_reduce: axis"),
    "broadcast_binop": ("binary tile ops on tiles of different shapes (broadcasting) are documented as not working on "
                        "hardware (NKI 0.3.0/0.4.0 release notes, Known Issues; ref §5.12)", "broadcasting binary ops"),
    "psum_word": ("PE writes to PSUM in whole 4-byte words: a bf16 dst needs an even free size (KLR psum_min_align "
                  "= 4; trn2-costs.md 'Pitfalls met on real hardware': the verifier rejects the 2-byte write)",
                  "4-byte words"),
}


def _bf16():
    import ml_dtypes
    return ml_dtypes.bfloat16


def _np_dtype(name):
    return _bf16() if name == "bfloat16" else np.dtype(name)


def _rand(rng, shape, dtype, lo=None, hi=None):
    x = rng.uniform(lo, hi, size=shape) if lo is not None else rng.standard_normal(shape)
    return x.astype(np.float32).astype(_np_dtype(dtype))


def _f64(x):
    return np.asarray(x).astype(np.float64)


# --------------------------------------------------------------------------------------------------------------
# numpy references (ours, from each kernel's documented semantics)
# --------------------------------------------------------------------------------------------------------------

def ref_matmul(lhsT, rhs):
    """result[M, N] = lhsT.T @ rhs (SDK matmul tutorial: 'lhsT ... delivered transposed')."""
    return _f64(lhsT).T @ _f64(rhs)


def ref_cumsum(x):
    """Cumulative sum along the last dimension (nkilib core/cumsum)."""
    return np.cumsum(_f64(x), axis=-1)


def ref_linear_scan(decay, data, initial=None):
    """result[..., t] = decay[..., t] * result[..., t-1] + data[..., t]; state starts at `initial` (or 0);
    final_state = result[..., -1:] (nkilib experimental/scan/linear_scan)."""
    d, x = _f64(decay), _f64(data)
    out = np.empty_like(x)
    state = np.zeros(x.shape[:-1]) if initial is None else _f64(initial)[..., 0]
    for t in range(x.shape[-1]):
        state = d[..., t] * state + x[..., t]
        out[..., t] = state
    return out, out[..., -1:]


def ref_scatter_add(inp, index, src):
    """out = inp; out[index[i], :] += src[i, :] for every i (torch scatter_add along dim 0)."""
    out = _f64(inp).copy()
    np.add.at(out, np.asarray(index).astype(np.int64), _f64(src))
    return out


def ref_rows_add(a, b, n_rows):
    """First n_rows rows of a + b (nkilib experimental/dynamic_shapes/dynamic_elementwise_add)."""
    return _f64(a)[:n_rows] + _f64(b)[:n_rows]


def ref_max_and_index(x):
    """Maximum along the last dimension and the index of that maximum, both with a trailing 1 dim
    (nkilib core/max/cascaded_max)."""
    xf = _f64(x)
    return xf.max(axis=-1, keepdims=True), np.argmax(xf, axis=-1)[..., None].astype(np.float64)


def ref_norm(x, kind):
    """Norm of all elements of x: 'l1' sum |x|, 'l2' sqrt(sum x^2), 'linf' max |x| (nkilib experimental/foreach)."""
    v = _f64(x).ravel()
    return {"l1": np.abs(v).sum(), "l2": np.sqrt((v * v).sum()), "linf": np.abs(v).max()}[kind]


def ref_selective_scan(x, dt, A, B, C, D=None, initial_state=None):
    """Mamba selective scan (nkilib experimental/scan/selective_scan docstring): per batch b, channel c, state n:
    state_t = exp(dt_t * A[c, n]) * state_{t-1} + dt_t * x_t * B[b, n, t], starting at initial_state (or 0);
    y_t = sum_n C[b, n, t] * state_t (+ D[c] * x_t). Returns (y, final states [b, c, n])."""
    x, dt, A, B, C = map(_f64, (x, dt, A, B, C))
    nb, ch, L = x.shape
    ns = A.shape[1]
    state = np.zeros((nb, ch, ns)) if initial_state is None else _f64(initial_state).copy()
    y = np.zeros_like(x)
    for t in range(L):
        decay = np.exp(dt[:, :, t, None] * A[None, :, :])                        # [b, c, n]
        state = decay * state + (dt[:, :, t] * x[:, :, t])[:, :, None] * B[:, None, :, t]
        y[:, :, t] = (state * C[:, None, :, t]).sum(axis=2)
    if D is not None:
        y += _f64(D)[None, :, None] * x
    return y, state


def ref_mp2_partial_sum(T_flat, eo_c, eo_f, ev):
    """Sum over i < ic, j < nocc, a, b < nvir of T[i,j,a,b] (2 T[i,j,a,b] - T[i,j,b,a]) / (eo_c[i] + eo_f[j] - ev[a]
    - ev[b]) with T[i,j,a,b] = T_flat[i*nvir + a, j*nvir + b] (DF-MP2 energy, trnblas _mp2_energy_kernel)."""
    T_flat, eo_c, eo_f, ev = map(_f64, (T_flat, eo_c, eo_f, ev))
    ic, nocc, nvir = eo_c.size, eo_f.size, ev.size
    T = T_flat.reshape(ic, nvir, nocc, nvir).transpose(0, 2, 1, 3)
    den = eo_c.reshape(ic, 1, 1, 1) + eo_f.reshape(1, nocc, 1, 1) - ev.reshape(1, 1, nvir, 1) - ev.reshape(1, 1, 1, nvir)
    return float((T * (2 * T - T.transpose(0, 1, 3, 2)) / den).sum())


# --------------------------------------------------------------------------------------------------------------
# comparison and result formatting (independent of the public code; unit-tested)
# --------------------------------------------------------------------------------------------------------------

def compare(outs, refs, rtol, atol):
    """Compare outputs with references element-wise: |out - ref| <= atol + rtol * |ref|.
    Returns (ok, max_abs_err, worst_ratio) over all pairs; worst_ratio = max |out-ref| / (atol + rtol|ref|)."""
    ok, max_err, worst = True, 0.0, 0.0
    for o, r in zip(outs, refs):
        o, r = _f64(o), _f64(r)
        if o.shape != r.shape:
            raise AssertionError(f"output shape {o.shape} != reference shape {r.shape}")
        if o.size == 0:
            continue
        bad = ~np.isfinite(o)
        err = np.where(bad, np.inf, np.abs(o - r))
        lim = atol + rtol * np.abs(r)
        max_err = max(max_err, float(err.max()))
        worst = max(worst, float((err / lim).max()))
        ok = ok and bool((err <= lim).all())
    return ok, max_err, worst


COLUMNS = ("kernel", "variant", "lnc", "status", "max_abs_err", "note")


def format_table(rows):
    """Plain-text table of result rows (dicts with the COLUMNS keys)."""
    def cell(r, c):
        v = r.get(c)
        if c == "max_abs_err":
            return "-" if v is None else f"{v:.3g}"
        return "" if v is None else str(v)
    body = [[cell(r, c) for c in COLUMNS] for r in rows]
    width = [max([len(c)] + [len(b[i]) for b in body]) for i, c in enumerate(COLUMNS)]
    width[-1] = len(COLUMNS[-1])  # the note column is not padded
    line = lambda cells: "  ".join(s.ljust(w) for s, w in zip(cells, width)).rstrip()
    out = [line(COLUMNS), line(["-" * w for w in width])]
    out += [line(b) for b in body]
    counts = {}
    for r in rows:
        counts[r["status"]] = counts.get(r["status"], 0) + 1
    out.append("")
    out.append("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(out)


def failed(rows):
    return [r for r in rows if r["status"] in ("FAIL", "REFUSED", "NOT-REFUSED", "ERROR")]


# --------------------------------------------------------------------------------------------------------------
# the cases: what to import, how to call it, against which reference
# --------------------------------------------------------------------------------------------------------------

class Case:
    """One public kernel: `repo` ('nki-library' | 'sdk'), `path` (file inside the checkout), `module`/`attr`
    (what to import), `variants` (dicts: label, dtype, lnc, + case parameters), `run(kernel, v, rng)` ->
    (outputs, references, rtol, atol). `refusal`: the documented rule expected to refuse it."""

    def __init__(self, name, repo, path, attr, variants, run=None, module=None, refusal=None, note="", needs=()):
        # refusal: a RULES key, for every variant (a variant may carry its own "refusal" key instead)
        # needs: further files (same checkout) the kernel imports; a missing one makes the variants SKIPPED
        self.name, self.repo, self.path, self.attr, self.needs = name, repo, path, attr, tuple(needs)
        self.variants, self.run, self.module, self.refusal, self.note = variants, run, module, refusal, note


def _launch(kernel, lnc):
    return kernel if lnc == 1 else kernel[lnc]


def _tol(dtype, fp32, bf16):
    return fp32 if dtype == "float32" else bf16


def _run_matmul(kernel, v, rng):
    K, M, N = v["K"], v["M"], v["N"]
    lhsT, rhs = _rand(rng, (K, M), v["dtype"]), _rand(rng, (K, N), v["dtype"])
    out = _launch(kernel, v["lnc"])(lhsT, rhs, **v.get("kwargs", {}))
    scale = np.sqrt(K)  # |entries| ~ sqrt(K) for N(0,1) inputs
    rtol, atol = _tol(v["dtype"], (1e-5, 1e-5 * scale), (8e-3, 8e-3 * scale))
    return [out], [ref_matmul(lhsT, rhs)], rtol, atol


def _run_cumsum(kernel, v, rng):
    x = _rand(rng, v["shape"], v["dtype"])
    out = _launch(kernel, v["lnc"])(x)
    ref = ref_cumsum(x)
    # fp32 running sums, one rounding per step (fp32) / per stored element and per 2048-column carry (bf16)
    span = float(np.abs(ref).max()) + 1.0
    rtol, atol = _tol(v["dtype"], (1e-5, 2e-6 * span), (1e-2, 1e-2 * span))
    return [out], [ref], rtol, atol


def _run_linear_scan(kernel, v, rng):
    decay = _rand(rng, v["shape"], v["dtype"], 0.5, 1.0)
    data = _rand(rng, v["shape"], v["dtype"])
    init = _rand(rng, v["shape"][:-1] + (1,), "float32") if v.get("initial") else None
    args = (decay, data) if init is None else (decay, data, init)
    res, fin = _launch(kernel, v["lnc"])(*args)
    r_res, r_fin = ref_linear_scan(decay, data, init)
    span = float(np.abs(r_res).max()) + 1.0
    rtol, atol = _tol(v["dtype"], (1e-5, 1e-5 * span), (1e-2, 1e-2 * span))
    return [res, fin], [r_res, r_fin], rtol, atol


def _run_scatter_add(kernel, v, rng):
    N, D, K = v["N"], v["D"], v["K"]
    inp = _rand(rng, (N, D), v["dtype"])
    if v["unique"]:
        index = rng.permutation(N)[:K].astype(np.int32)
    else:
        index = rng.integers(0, max(2, N // 8), size=K).astype(np.int32)
    src = _rand(rng, (K, D), v["dtype"])
    ref = ref_scatter_add(inp, index, src)
    out = _launch(kernel, v["lnc"])(inp, 0, index, src, v["unique"])
    rtol, atol = _tol(v["dtype"], (1e-6, 1e-6), (8e-3, 8e-3))
    return [out], [ref], rtol, atol


def _run_dyn_add(kernel, v, rng):
    M, H, n = v["M"], v["H"], v["n_tiles"]
    a, b = _rand(rng, (M, H), v["dtype"]), _rand(rng, (M, H), v["dtype"])
    out = _launch(kernel, v["lnc"])(a, b, np.array([[n]], dtype=np.int32))
    rtol, atol = _tol(v["dtype"], (1e-6, 1e-6), (4e-3, 4e-3))
    return [np.asarray(out)[:n * 128]], [ref_rows_add(a, b, n * 128)], rtol, atol


def _run_cascaded_max(kernel, v, rng):
    x = _rand(rng, v["shape"], v["dtype"])
    vals, idx = _launch(kernel, v["lnc"])(x)
    r_vals, r_idx = ref_max_and_index(x)
    return [vals, idx], [r_vals, r_idx], 0.0, 0.0   # a max and its position are exact


def _run_allgather(kernel, v, rng):
    import nkisim
    from nki.collectives import ReplicaGroup
    tp = v["tp"]
    xs = [_rand(rng, v["shape"], v["dtype"]) for _ in range(tp)]
    rg = ReplicaGroup([list(range(tp))])
    outs = nkisim.launch(kernel, [(x, rg, tp) for x in xs], tp=tp, lnc=v["lnc"])
    ref = np.concatenate([_f64(x) for x in xs], axis=1)
    return list(outs), [ref] * tp, 0.0, 0.0


def _run_tensor_add(kernel, v, rng):
    a, b = _rand(rng, v["shape"], v["dtype"]), _rand(rng, v["shape"], v["dtype"])
    out = _launch(kernel, v["lnc"])(a, b)
    return [out], [_f64(a) + _f64(b)], *_tol(v["dtype"], (1e-6, 1e-6), (4e-3, 4e-3))


def _run_norm(kernel, v, rng):
    x = _rand(rng, (v["n"],), v["dtype"])
    out = _launch(kernel, v["lnc"])(x, v["n"])
    ref = np.array([[ref_norm(x, v["kind"])]])
    # fp32 partial sums per partition, then across partitions and cores; bf16: the result is stored as bf16
    return [out], [ref], *_tol(v["dtype"], (1e-5, 1e-6), (8e-3, 1e-6))


def _run_selective_scan(kernel, v, rng):
    nb, ch, L, ns = v["shape"]
    dt_ = v["dtype"]
    x = _rand(rng, (nb, ch, L), dt_)
    dt = _rand(rng, (nb, ch, L), dt_, 0.01, 0.1)            # positive time steps
    A = _rand(rng, (ch, ns), "float32", -2.0, -0.5)          # negative: decaying state
    B, C = _rand(rng, (nb, ns, L), dt_), _rand(rng, (nb, ns, L), dt_)
    kw = {}
    if v.get("skip"):
        kw["D"] = _rand(rng, (ch,), "float32")
    if v.get("initial"):
        kw["initial_state"] = _rand(rng, (nb, ch, ns), "float32")
    y, fin = _launch(kernel, v["lnc"])(x, dt, A, B, C, **kw)
    r_y, r_fin = ref_selective_scan(x, dt, A, B, C, kw.get("D"), kw.get("initial_state"))
    span = float(np.abs(r_y).max()) + 1.0
    return [y, fin], [r_y, r_fin], *_tol(dt_, (1e-5, 1e-5 * span), (1e-2, 1e-2 * span))


def _run_gemm_nn(kernel, v, rng):
    """C = A @ B (trnblas _gemm_kernel; A [M, K], B [K, N] as given, M, K multiples of 128)."""
    M, K, N = v["M"], v["K"], v["N"]
    a, b = _rand(rng, (M, K), v["dtype"]), _rand(rng, (K, N), v["dtype"])
    out = _launch(kernel, v["lnc"])(a, b)
    scale = np.sqrt(K)
    return [out], [_f64(a) @ _f64(b)], *_tol(v["dtype"], (1e-5, 1e-5 * scale), (8e-3, 8e-3 * scale))


def _run_syrk(kernel, v, rng):
    """C = A @ A.T (trnblas _syrk_kernel)."""
    M, K = v["M"], v["K"]
    a = _rand(rng, (M, K), v["dtype"])
    out = _launch(kernel, v["lnc"])(a)
    scale = np.sqrt(K)
    return [out], [_f64(a) @ _f64(a).T], *_tol(v["dtype"], (1e-5, 1e-5 * scale), (8e-3, 8e-3 * scale))


def _run_mp2(kernel, v, rng):
    """trnblas _mp2_energy_kernel returns per-partition partials (P_TILE, ic, nocc); their sum is the energy."""
    nocc, nvir, ic = v["nocc"], v["nvir"], v["ic"]
    T = _rand(rng, (ic * nvir, nocc * nvir), v["dtype"])
    eo = np.linspace(-1.0, -0.2, nocc).astype(np.float32)
    ev = np.linspace(0.2, 1.0, nvir).astype(np.float32)
    part = _launch(kernel, v["lnc"])(T, eo[None, :ic].copy(), eo[None, :], ev[:, None].copy(), ev[None, :].copy())
    ref = ref_mp2_partial_sum(T, eo[:ic], eo, ev)
    return [np.array(_f64(part).sum())], [np.array(ref)], 1e-4, 1e-4


def _mm(name, attr, variants):
    return Case(f"sdk/matmul/{name}", "sdk", "matrix_multiplication/matrix_multiplication_nki_kernels.py", attr,
                variants, _run_matmul)


def _v(label, dtype, lnc=1, **kw):
    return dict(label=label, dtype=dtype, lnc=lnc, **kw)


CASES = [
    _mm("basic", "nki_matmul_basic_", [
        _v("K128 M64 N512", "float32", K=128, M=64, N=512),
        _v("K128 M64 N512", "bfloat16", K=128, M=64, N=512)]),
    _mm("tiled", "nki_matmul_tiled_", [
        _v("K512 M256 N1024", "float32", K=512, M=256, N=1024),
        _v("K512 M256 N1024", "bfloat16", K=512, M=256, N=1024)]),
    _mm("hoist_load", "nki_matmul_hoist_load_", [
        _v("K512 M256 N1024", "float32", K=512, M=256, N=1024),
        _v("K512 M256 N1024", "bfloat16", K=512, M=256, N=1024)]),
    _mm("block_free_dimension", "nki_matmul_block_free_dimension_", [
        _v("K512 M256 N1024", "float32", K=512, M=256, N=1024),
        _v("K512 M256 N1024", "bfloat16", K=512, M=256, N=1024)]),
    _mm("fully_optimized", "nki_matmul_fully_optimized_", [
        _v("K512 M256 N1024 blocks 2x2x2", "float32", K=512, M=256, N=1024,
           kwargs=dict(TILES_IN_BLOCK_M=2, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=2)),
        _v("K512 M256 N1024 blocks 2x2x2", "bfloat16", K=512, M=256, N=1024,
           kwargs=dict(TILES_IN_BLOCK_M=2, TILES_IN_BLOCK_N=2, TILES_IN_BLOCK_K=2))]),
    Case("sdk/tensor_addition", "sdk", "tensor_addition/tensor_addition_nki_kernels.py", "nki_tensor_add",
         [_v("[256,1024]", "float32", shape=(256, 1024))], _run_tensor_add, refusal="platform_target"),
    Case("sdk/simulate/add_kernel", "sdk", "simulate/nki_simulate_example.py", "add_kernel",
         [_v("[128,512]", "float32", shape=(128, 512))], _run_tensor_add,
         note="the script runs its own nki.simulate check when imported"),
    Case("nkl/core/cumsum", "nki-library", "nkilib/core/cumsum/cumsum.py", "cumsum", [
        _v("[300,5000]", "float32", shape=(300, 5000)),
        _v("[4,10,1000]", "float32", shape=(4, 10, 1000)),
        _v("[130,2100]", "bfloat16", shape=(130, 2100))], _run_cumsum),
    Case("nkl/core/max/cascaded_max", "nki-library", "nkilib/core/max/cascaded_max.py", "cascaded_max", [
        _v("[2,4,1000]", "float32", shape=(2, 4, 1000)),
        _v("[2,4,1000]", "float32", lnc=2, shape=(2, 4, 1000)),
        _v("[1,4096]", "float32", shape=(1, 4096)),
        _v("[1,4096]", "float32", lnc=2, shape=(1, 4096)),
        _v("[6,3000]", "bfloat16", lnc=2, shape=(6, 3000), refusal="psum_word")], _run_cascaded_max,
         refusal="reduce_axis"),
    Case("nkl/experimental/scan/linear_scan", "nki-library", "nkilib/experimental/scan/linear_scan.py",
         "linear_scan", [
             _v("[2,130,2100] initial", "float32", shape=(2, 130, 2100), initial=True),
             _v("[64,300]", "bfloat16", shape=(64, 300))], _run_linear_scan, refusal="is_operator",
         note="also returns nl.hbm tensors (rule hbm_output)"),
    Case("nkl/experimental/misc/scatter_add", "nki-library", "nkilib/experimental/misc/scatter_add.py",
         "scatter_add", [
             _v("N300 D1024 K200 unique", "float32", N=300, D=1024, K=200, unique=True),
             _v("N300 D1024 K200 unique", "float32", lnc=2, N=300, D=1024, K=200, unique=True),
             _v("N64 D2560 K24 repeated idx", "float32", N=64, D=2560, K=24, unique=False),
             _v("N300 D512 K130 unique", "bfloat16", lnc=2, N=300, D=512, K=130, unique=True)],
         _run_scatter_add),
    Case("nkl/experimental/dynamic_shapes/dynamic_elementwise_add", "nki-library",
         "nkilib/experimental/dynamic_shapes/dynamic_elementwise_add.py", "dynamic_elementwise_add", [
             _v("M512 H1024 4 of 4 tiles", "bfloat16", M=512, H=1024, n_tiles=4),
             _v("M512 H1024 3 of 4 tiles", "bfloat16", M=512, H=1024, n_tiles=3),
             _v("M256 H512 2 of 2 tiles", "float32", M=256, H=512, n_tiles=2)], _run_dyn_add),
    Case("nkl/experimental/collectives/allgather_sb2sb", "nki-library",
         "nkilib/experimental/collectives/sb2sb_allgather.py", "allgather_sb2sb",
         [_v("TP4 [64,128]", "float32", shape=(64, 128), tp=4)], _run_allgather, refusal="platform_target"),
    Case("nkl/experimental/collectives/allgather_sb2sb_tiled", "nki-library",
         "nkilib/experimental/collectives/sb2sb_allgather.py", "allgather_sb2sb_tiled",
         [_v("TP2 x LNC2 [256,64]", "bfloat16", lnc=2, shape=(256, 64), tp=2)], _run_allgather,
         refusal="platform_target"),
    Case("nkl/experimental/foreach/l2_norm", "nki-library", "nkilib/experimental/foreach/foreach_norm.py",
         "l2_norm_kernel", [
             _v("N=38477 (tail 77)", "float32", kind="l2", n=128 * 300 + 77),
             _v("N=40000", "bfloat16", lnc=2, kind="l2", n=40000)], _run_norm,
         needs=("nkilib/experimental/foreach/foreach_utils.py",)),
    Case("nkl/experimental/foreach/l1_norm", "nki-library", "nkilib/experimental/foreach/foreach_norm.py",
         "l1_norm_kernel", [_v("N=38477 (tail 77)", "float32", lnc=2, kind="l1", n=128 * 300 + 77)], _run_norm,
         needs=("nkilib/experimental/foreach/foreach_utils.py",)),
    Case("nkl/experimental/foreach/linf_norm", "nki-library", "nkilib/experimental/foreach/foreach_norm.py",
         "linf_norm_kernel", [_v("N=38477 (tail 77)", "float32", kind="linf", n=128 * 300 + 77)], _run_norm,
         needs=("nkilib/experimental/foreach/foreach_utils.py",),
         note="uses nl.max as the element-wise op of tensor_tensor (undocumented; see nkisim/README.md)"),
    Case("nkl/experimental/scan/selective_scan", "nki-library", "nkilib/experimental/scan/selective_scan.py",
         "selective_scan", [
             _v("[1,130,600] N=4 D+initial", "float32", shape=(1, 130, 600, 4), skip=True, initial=True),
             _v("[2,256,300] N=3", "bfloat16", lnc=2, shape=(2, 256, 300, 3))], _run_selective_scan,
         needs=("nkilib/experimental/scan/ssd_utils.py", "nkilib/core/utils/stream_shuffle_broadcast.py")),
    Case("trnblas/gemm", "trnblas", "trnblas/nki/dispatch.py", "_gemm_kernel", [
        _v("M256 K256 N512", "float32", M=256, K=256, N=512),
        _v("M256 K256 N512", "bfloat16", M=256, K=256, N=512)], _run_gemm_nn),
    Case("trnblas/syrk", "trnblas", "trnblas/nki/dispatch.py", "_syrk_kernel",
         [_v("M256 K128", "float32", M=256, K=128)], _run_syrk),
    Case("trnblas/mp2_energy", "trnblas", "trnblas/nki/dispatch.py", "_mp2_energy_kernel",
         [_v("nocc4 nvir8 ic4", "float32", nocc=4, nvir=8, ic=4)], _run_mp2, refusal="broadcast_binop"),
]


# --------------------------------------------------------------------------------------------------------------
# driver
# --------------------------------------------------------------------------------------------------------------

def _checkout_commit(root):
    try:
        r = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _subdir(repo):
    return {"nki-library": NKL_SUBDIR, "sdk": SDK_SUBDIR}.get(repo, "")


def _file_of(case, roots):
    root = roots.get(case.repo)
    if root is None:
        return None, None
    base = os.path.join(root, _subdir(case.repo))
    return base, os.path.join(base, case.path)


def _rel(case, path=None):
    p = os.path.join(_subdir(case.repo), path or case.path).replace(os.sep, "/")
    return f"{EXTRA_REPOS[case.repo][0] if case.repo in EXTRA_REPOS else case.repo}:{p}"


_modules = {}


def _import(case, base, fpath):
    """Import the kernel module unmodified: nki-library as the `nkilib` package, SDK tutorials by file path."""
    key = (case.repo, fpath)
    if key not in _modules:
        if case.repo == "nki-library":
            if base not in sys.path:
                sys.path.insert(0, base)
            modname = case.path[:-3].replace("/", ".")
            _modules[key] = importlib.import_module(modname)
        else:   # SDK tutorials and third-party files: by path (their own imports are nki, numpy, torch only)
            modname = f"nkisim_{case.repo.replace('-', '_')}_" + case.path[:-3].replace("/", "_")
            spec = importlib.util.spec_from_file_location(modname, fpath)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[modname] = mod
            spec.loader.exec_module(mod)
            _modules[key] = mod
    return getattr(_modules[key], case.attr)


def _classify(exc, rule):
    """Status of a variant that raised ``exc``; ``rule`` is the RULES key expected to refuse it (or None)."""
    from nkisim.errors import NkiValidationError
    if isinstance(exc, NkiValidationError):
        msg = str(exc).splitlines()[0]
        return ("REFUSED-OK" if rule and RULES[rule][1] in msg else "REFUSED"), msg
    if isinstance(exc, NotImplementedError):
        return "NOT-IMPL", str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "ERROR", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def run_case(case, roots, seed=0, verbose=False):
    base, fpath = _file_of(case, roots)
    rows = []
    for i, v in enumerate(case.variants):
        row = dict(kernel=case.name, source=_rel(case), variant=v["label"], dtype=v["dtype"], lnc=v["lnc"],
                   status=None, max_abs_err=None, note="")
        if fpath is None:
            flag = f"--{case.repo}" if case.repo not in EXTRA_REPOS else f"--extra {case.repo}=PATH"
            row.update(status="SKIPPED", note=f"no {flag} checkout given")
            rows.append(row)
            continue
        missing = [p for p in (case.path,) + case.needs if not os.path.isfile(os.path.join(base, p))]
        if missing:
            row.update(status="SKIPPED", note="missing: " + ", ".join(_rel(case, p) for p in missing))
            rows.append(row)
            continue
        with open(fpath, "rb") as f:
            src = f.read()
        row["sha256_12"] = hashlib.sha256(src).hexdigest()[:12]
        rule = v.get("refusal", case.refusal)
        marker = SOURCE_MARKERS.get(rule)
        if marker is not None and marker.encode() not in src:
            rule = None          # this version of the file no longer breaks the rule (fixed upstream): must pass
        rng = np.random.default_rng([seed, i, len(case.name)])
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                kernel = _import(case, base, fpath)
                outs, refs, rtol, atol = case.run(kernel, v, rng)
                ok, err, worst = compare(outs, refs, rtol, atol)
                row.update(status="PASS" if ok else "FAIL", max_abs_err=err, rtol=rtol, atol=atol,
                           err_over_tol=round(worst, 4))
                if rule:
                    row["note"] = "expected a refusal: " + RULES[rule][0]
                    row["status"] = "NOT-REFUSED"  # ran although a documented rule forbids it: an nkisim gap
            except Exception as exc:  # noqa: BLE001 -- every failure is reported, none aborts the sweep
                status, msg = _classify(exc, rule)
                row.update(status=status, note=msg[:300])
                if rule:
                    row["expected_rule"] = RULES[rule][0]
                if verbose and status != "REFUSED-OK":
                    traceback.print_exc()
        row["seconds"] = round(time.perf_counter() - t0, 2)
        row["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught
                                  if issubclass(w.category, UserWarning)})
        rows.append(row)
    return rows


def _check_root(flag, path, sub, repo=None):
    if path is None:
        return None
    if not os.path.isdir(os.path.join(path, sub)):
        repo = repo or ("aws-neuron/nki-library" if "nkilib" in sub else "aws-neuron/aws-neuron-sdk")
        print(f"error: {flag} {path!r}: no {sub.replace(os.sep, '/')} directory there (expected a checkout of {repo})",
              file=sys.stderr)
        raise SystemExit(2)
    return os.path.abspath(path)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m nkisim.public_kernels",
                                 description="Run unmodified public NKI kernels under nkisim and compare them "
                                             "with numpy references (see the module docstring).")
    ap.add_argument("--nki-library", required=True, metavar="PATH", help="checkout of aws-neuron/nki-library")
    ap.add_argument("--sdk", metavar="PATH", help="checkout of aws-neuron/aws-neuron-sdk (tutorial kernels)")
    ap.add_argument("--extra", action="append", default=[], metavar="NAME=PATH",
                    help="checkout of a third-party repository with NKI >= 0.3 kernels; NAME is one of "
                         + ", ".join(f"{k} ({v[0]})" for k, v in EXTRA_REPOS.items()) + " (repeatable)")
    ap.add_argument("--only", metavar="SUBSTR", help="run only the kernels whose name contains SUBSTR")
    ap.add_argument("--json", metavar="FILE",
                    help="where to write the results (default: bench/public_kernels.json for a full sweep; a "
                         "partial --only run writes only when given --json)")
    ap.add_argument("--provenance", metavar="TEXT",
                    help="where the checkouts' files came from, recorded in the JSON (useful when a checkout is an "
                         "extracted tree without git metadata; each file's sha256 is recorded either way)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-v", "--verbose", action="store_true", help="print tracebacks of failures")
    args = ap.parse_args(argv)
    roots = {"nki-library": _check_root("--nki-library", args.nki_library, os.path.join(NKL_SUBDIR, "nkilib")),
             "sdk": _check_root("--sdk", args.sdk, SDK_SUBDIR)}
    for item in args.extra:
        name, sep, path = item.partition("=")
        if not sep or name not in EXTRA_REPOS:
            print(f"error: --extra {item!r}: expected NAME=PATH with NAME one of {', '.join(EXTRA_REPOS)}",
                  file=sys.stderr)
            raise SystemExit(2)
        roots[name] = _check_root(f"--extra {name}=", path, EXTRA_REPOS[name][1], EXTRA_REPOS[name][0])

    import nkisim
    nkisim.install()

    rows = []
    cases = [c for c in CASES if not args.only or args.only in c.name]
    for case in cases:
        for row in run_case(case, roots, seed=args.seed, verbose=args.verbose):
            err = "-" if row["max_abs_err"] is None else f"{row['max_abs_err']:.3g}"
            print(f"[{len(rows) + 1}] {row['kernel']} {row['variant']} {row['dtype']} lnc={row['lnc']}: "
                  f"{row['status']} max_abs_err={err} ({row.get('seconds', 0)} s)"
                  + (f" -- {row['note'][:160]}" if row["note"] else ""), flush=True)
            rows.append(row)
    print()
    print(format_table([dict(r, variant=f"{r['variant']} {r['dtype']}") for r in rows]))
    doc = {
        "command": "python -m nkisim.public_kernels --nki-library PATH" + (" --sdk PATH" if args.sdk else "")
                   + "".join(f" --extra {k}=PATH" for k in EXTRA_REPOS if roots.get(k)),
        "seed": args.seed,
        "checkouts": {k: {"git_commit": _checkout_commit(v)} for k, v in roots.items() if v},
        "provenance": args.provenance,
        "rules": {k: v[0] for k, v in RULES.items()},
        "results": rows,
    }
    out = args.json or (None if args.only else os.path.join("bench", "public_kernels.json"))
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"wrote {out}")
    return 1 if failed(rows) else 0


if __name__ == "__main__":
    sys.exit(main())
