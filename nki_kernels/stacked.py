"""The bank-stacked layout of a token-major ``[T, H]`` tensor (the megakernel's residual and partials, issue 15).

A DVE / ACT instruction costs by its free size, not its partitions (trn2-costs: ~0.15 us + 1.04 ns per element),
so a ``[T, H]`` add on T = 1..2 partitions costs 2.3 us at H = 2048. The stacked layout spreads the hidden axis
over S "banks" of W = H / S columns on S * T partitions::

    stacked [S*T, W]:   stacked[s*T + t, c] = x[t, block(s)*W + c]      (bank s holds column block block(s))

so an elementwise op over it has free size W (0.68 us at S = 4), a collective moves the same bytes, and the
RMSNorm transposes it with W / 128 PE matmuls instead of H / 128. The banks are interleaved
(:func:`bank_block`: ``block(s) = (s % 2) * S/2 + s // 2``, i.e. blocks 0, 2, 1, 3 at S = 4) so that the MoE's
down-projection fold ``[2T, H/2]`` (``nki_kernels.moe``, row g*T + t holds column half g) is bank pairs: its
column slice h*W .. (h+1)*W is banks 2h, 2h + 1 (:func:`fold_banks`), so the MoE accumulates the stacked layout
directly (its block-diagonal stationary placed at column offset 2hT); other folds go through :func:`unfold`.

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

from nki_kernels.common import MOVING_MAX, P, kernel_assert, own_identity


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


def fold_banks(R: int, S: int) -> bool:
    """Does the fold ``[R*T, H/R]`` map onto the banks in row-group order, i.e. is column piece h (of width H/S) of
    fold row group g bank h*R + g for every g < R, h < S/R? Then a block-diagonal stationary of the fold placed at
    column offset h*R*T of an ``[*, S*T]`` one accumulates piece h straight into the stacked layout (the MoE's down
    projection, ``nki_kernels.moe``). True for R = 2 and every S >= 2 (the interleaved bank order)."""
    if R < 2 or S < R or S % R:
        return False
    for g in range(R):
        for h in range(S // R):
            if bank_of(g * (S // R) + h, S) != h * R + g:
                return False
    return True


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
    """Token-major SBUF ``x [T, H]`` -> stacked SBUF ``[S*T, H/S]`` (same dtype, bit-exact) on the PE: bank s is
    one matmul of a selection stationary ``E_s [T, S*T]`` (a [T, T] identity in columns s*T .. s*T + T - 1, zeros
    elsewhere: one non-zero product per output) against ``x[:, block(s)]``, all S into one PSUM bank, then one
    copy. For the stage entries (embedding, the MTP fc output); no DMA, so nothing queues behind the stage's weight
    DMAs, and off the critical path (the first input norm reads the token-major x)."""
    T, H = x.shape
    check_stack(S, T, H, "stack_rows")
    if S == 1:
        return x
    W = H // S
    if W > MOVING_MAX:
        raise ValueError(f"stack_rows: bank width {W} exceeds one PSUM bank ({MOVING_MAX} fp32)")
    ident = own_identity(T, x.dtype, "stack_ident")     # broadcast_banks addresses it by .ap()
    e = nl.ndarray((T, 1, S, S * T), x.dtype, buffer=nl.sbuf, name="stack_select")
    nisa.memset(dst=e, value=0.0, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=diagonal(e, S, T, 1), src=broadcast_banks(ident, T, 1, S), engine=nisa.engine.gpsimd)
    ps = nl.ndarray((S * T, W), nl.float32, buffer=nl.psum, name="stack_ps")
    for s in range(S):
        b = bank_block(s, S)
        nisa.nc_matmul(dst=ps, stationary=e[:, 0, s, :], moving=x[:, b * W:(b + 1) * W], accumulate=s > 0)
    out = nl.ndarray((S * T, W), x.dtype, buffer=nl.sbuf, name=name)
    nisa.tensor_copy(dst=out, src=ps)
    return out


def unfold(fold, R: int, S: int, T: int, out, engine):
    """A fold ``[R*T, H/R]`` (SBUF fp32; row g*T + t holds ``y[t, g*H/R + c]``, ``nki_kernels.moe``) into the
    stacked SBUF ``out [S*T, H/S]`` (R, S powers of two).

    R <= S (a bank inside one fold group): banks are written in runs of consecutive banks that read consecutive
    fold row groups at one column offset, one ``[n*T, W]`` piece each; R > S: one ``[T, H/R]`` piece per fold
    group. The piece at partition 0 of both sides is one copy on ``engine``, every other one an SBUF -> SBUF DMA
    with equal partition counts (trn2-costs pitfalls)."""
    HR = fold.shape[1]
    W = out.shape[1]
    pieces = []             # (dst, src, on partition 0 of both sides)
    if HR < W:
        for g in range(R):
            s = bank_of((g * HR) // W, S)
            off = (g * HR) % W
            pieces.append((out[s * T:(s + 1) * T, off:off + HR], fold[g * T:(g + 1) * T, :], g == 0 and s == 0))
    else:
        s = 0
        while s < S:
            b = bank_block(s, S)
            g, off = (b * W) // HR, (b * W) % HR
            n = 1
            while s + n < S and bank_block(s + n, S) * W == (g + n) * HR + off and g + n < R:
                n = n + 1
            pieces.append((out[s * T:(s + n) * T, :], fold[g * T:(g + n) * T, off:off + W], g == 0 and s == 0))
            s = s + n
    for p in pieces:        # the DMAs first (their triggers may share a queue with the copy's engine)
        if not p[2]:
            nisa.dma_copy(dst=p[0], src=p[1])
    for p in pieces:        # the same partitions, from partition 0 (compute-engine start rule, ref §3.4)
        if p[2]:
            nisa.tensor_copy(dst=p[0], src=p[1], engine=engine)
