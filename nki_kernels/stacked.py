"""The bank-stacked layout of a token-major ``[T, H]`` tensor (the megakernel's residual and partials, issue 15).

A DVE / ACT instruction costs by its free size, not its partitions (trn2-costs: ~0.15 us + 1.04 ns per element),
so a ``[T, H]`` add on T = 1..2 partitions costs 2.3 us at H = 2048. The stacked layout spreads the hidden axis
over S "banks" of W = H / S columns on S * T partitions::

    stacked [S*T, W]:   stacked[s*T + t, c] = x[t, block(s)*W + c]      (bank s holds column block block(s))

so an elementwise op over it has free size W (0.68 us at S = 4), a collective moves the same bytes, and the
RMSNorm transposes it with W / 128 PE matmuls instead of H / 128. The banks are interleaved
(:func:`bank_block`: ``block(s) = (s % 2) * S/2 + s // 2``, i.e. blocks 0, 2, 1, 3 at S = 4) so that the MoE's
down-projection fold ``[2T, H/2]`` (``nki_kernels.moe``, row g*T + t holds column half g) is bank pairs already:
its column slice h*W .. (h+1)*W is banks 2h, 2h + 1, i.e. one ``[2T, W]`` piece (:func:`unfold`).

How the bodies produce a stacked partial for free: an output projection accumulates each column block of y in
PSUM with ``stationary = a^T [K, T]``; with ``stationary = Z_s [K, S*T]`` (a^T in columns s*T .. s*T + T - 1,
zeros elsewhere: :func:`diagonal`) and ``moving = W_out[:, block(s)]``, all S banks accumulate into ONE PSUM tile
``[S*T, W]``: rows of other banks receive exact zeros (a zero stationary column contributes 0 * w = +-0 to every
output of that row; the PE reduces each output column independently), so each row gets its block's sum in the same
fp32 order as the token-major projection. The moving columns and the matmul count are unchanged at W = 512, and
the eviction is one copy of ``[S*T, W]`` instead of S copies of ``[T, W]``. (nkisim's fp32 sgemm is not column-
independent: numpy's BLAS sums in an order that depends on M, so under nkisim a stacked partial and a token-major
one can differ in the last fp32 bit; on trn2 each PE column accumulates alone.)

``S = 1`` is the token-major layout itself (every helper is then the identity).
"""

from __future__ import annotations

import nki.isa as nisa
import nki.language as nl

from nki_kernels.common import MOVING_MAX, P, kernel_assert


def banks_for(hidden: int, want: int) -> int:
    """The bank count S of a hidden size: the largest power of two <= ``want`` whose bank width H / S is a
    multiple of 128, or 1 (the token-major layout) when that width exceeds one PSUM bank (512 fp32) or no S > 1
    fits (e.g. H = 128)."""
    s = 1
    while 2 * s <= want and hidden % (2 * s * P) == 0:
        s = 2 * s
    if s > 1 and hidden // s > MOVING_MAX:
        return 1
    return s


def bank_block(s: int, S: int) -> int:
    """The column block (of width H / S) bank s holds: (s % 2) * S/2 + s // 2 (S = 1: 0)."""
    if S == 1:
        return 0
    return (s % 2) * (S // 2) + s // 2


def bank_of(block: int, S: int) -> int:
    """Inverse of :func:`bank_block`: the bank holding column block ``block``."""
    if S == 1:
        return 0
    half = S // 2
    return 2 * (block % half) + block // half


def check_stack(S: int, T: int, H: int, where: str):
    """S must be a power of two with H / S a multiple of 128 (the norm transposes 128-column tiles) and the
    stacked rows S*T <= 128."""
    kernel_assert(S >= 1 and S & (S - 1) == 0, f"{where}: stack {S} is not a power of two")
    kernel_assert(H % (S * P) == 0 or S == 1,
                  f"{where}: hidden {H} does not split into {S} banks of a multiple of {P} columns")
    kernel_assert(S * T <= P, f"{where}: {S} banks x {T} tokens exceed {P} partitions")


def diagonal(z, S: int, T: int, n: int):
    """Access pattern of the bank diagonals of a zero-padded stationary ``z`` [K, n, S, S*T] (SBUF, dense): the
    elements (k, i, s, s*T + t), iterated as [K, n, S, T]."""
    K = z.shape[0]
    return z.ap(pattern=[[n * S * S * T, K], [S * S * T, n], [(S + 1) * T, S], [1, T]], offset=0)


def broadcast_banks(a, T: int, n: int, S: int):
    """``a`` dense [K, n, T] (SBUF) as [K, n, S, T], stride 0 along the banks (the source of a :func:`diagonal`
    write)."""
    K = a.shape[0]
    return a.ap(pattern=[[n * T, K], [T, n], [0, S], [1, T]], offset=0)


def stack_rows(x, S: int, name: str = "stacked_x"):
    """Token-major SBUF ``x [T, H]`` -> stacked SBUF ``[S*T, H/S]`` (same dtype, bit-exact): bank 0 (block 0, the
    same partitions) by one copy on GpSimd, every other bank by one SBUF -> SBUF DMA of ``[T, W]`` (equal partition
    counts on both sides, trn2-costs pitfalls). For the stage entries (embedding, the MTP fc output), off the
    critical path: the first input norm reads the token-major x."""
    T, H = x.shape
    check_stack(S, T, H, "stack_rows")
    if S == 1:
        return x
    W = H // S
    out = nl.ndarray((S * T, W), x.dtype, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=out[0:T, :], src=x[:, 0:W], engine=nisa.engine.gpsimd)
    for s in range(1, S):
        b = bank_block(s, S)
        nisa.dma_copy(dst=out[s * T:(s + 1) * T, :], src=x[:, b * W:(b + 1) * W])
    return out


def unfold(fold, R: int, S: int, T: int, out, engine):
    """A fold ``[R*T, H/R]`` (SBUF fp32; row g*T + t holds ``y[t, g*H/R + c]``) into the stacked SBUF ``out
    [S*T, H/S]`` (R = S: the fold itself is stacked when the bank order matches; general R, S powers of two).

    Banks are written in runs of consecutive banks that read consecutive fold row groups at one column offset (one
    ``[n*T, W]`` piece each): the piece of bank 0 (the same partitions from 0) is one copy on ``engine``, any other one SBUF ->
    SBUF DMA with equal partition counts."""
    HR = fold.shape[1]
    W = out.shape[1]
    s = 0
    while s < S:
        b = bank_block(s, S)
        g, off = (b * W) // HR, (b * W) % HR
        n = 1
        while s + n < S and bank_block(s + n, S) * W == (g + n) * HR + off and g + n < R:
            n = n + 1
        src = fold[g * T:(g + n) * T, off:off + W]
        dst = out[s * T:(s + n) * T, :]
        if g == 0 and s == 0:     # the same partitions, from partition 0 (compute-engine start rule, ref §3.4)
            nisa.tensor_copy(dst=dst, src=src, engine=engine)
        else:
            nisa.dma_copy(dst=dst, src=src)
        s = s + n
