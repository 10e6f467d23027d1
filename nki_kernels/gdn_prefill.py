"""Chunked Gated DeltaNet prefill (context encoding) for L tokens, one TP rank split over its LNC cores.

Same math as the decode mixer (``nki_kernels/gdn.py``; reference ``ReferenceModel.gdn_mixer(chunked=True)``,
PyTorch twin ``model.tp.gdn_prefill.gdn_prefill_rank``), reading the SAME per-rank weight layout
(:func:`nki_kernels.gdn.gdn_weight_layout`) and writing the SAME decode state (``window [slots, K-1, C_rank]``
activation dtype, ``state [slots, Hv_r, D, D]`` float32): the launch reads slot ``read_slot`` and writes the
window and recurrent state after its last token into slot ``write_slot`` (run-time ``[1, 1]`` int32 tensors,
DMA scalar offsets; they may be equal). A prompt prefilled in several calls, each reading the slot the previous
one wrote, equals one call: the 64-token blocks start at each call's first token, so split points must be
multiples of 64; at multiples of :func:`super_tile_tokens` (512 tokens for the deployment, bf16 at LNC=2) every
call meets the same operand shapes and the result is bit-identical (tested). At other multiples of 64 each
element's arithmetic is unchanged too (cross-block terms are exact zeros), but nkisim's numpy matmul may order
an fp32 sum by operand shape, so there the results agree to fp32 rounding.

Recurrence (per value head; FLA's chunked gated delta rule, kernel-algorithms.md §1.3) over 64-token blocks
with start state S: G = cumsum of g inside the block (fp32), Gamma_ij = exp(G_i - G_j) (j <= i) applied
elementwise AFTER the matmuls, A = strict_lower(diag(beta) K K^T * Gamma), X = (I + A)^-T,
U = X^T (beta V), W = X^T (beta exp(G) K), V_new = U - W S, O = exp(G) Q S + lower_incl(Q K^T * Gamma) V_new,
S <- exp(G_C) S + (exp(G_C - G) K)^T V_new.

Layouts
-------
* ``xT [128, H/128, L]`` HBM, activation dtype: the normed hidden states feature-major, element (p, j, t) =
  x[t, j*128 + p] -- the decode ``xT`` layout with T = L. The composition's prefill RMSNorm produces it once
  per layer (the MoE prefill needs the same feature-major operand), so the mixer spends no transposes on its
  input. :func:`feature_major` is the host-side conversion.
* ``y [L, H]`` HBM float32: this core's out_proj partial, token-major (the composition all-reduces the
  partials); the wrapper returns ``[n_cores, L, H]``.
* Weights: :func:`nki_kernels.gdn.gdn_weight_layout` unchanged (``w_in [n, 128, J, N]``, ``conv_w [n, D, NH, K]``,
  ``w_out [n, D, Hv_c, H]``, ``A_log``/``dt_bias [Hv_r]``, ``norm_w [D, 1]``); core c owns value heads
  ``[c*Hv_c, (c+1)*Hv_c)`` and their key heads (``core_split``; a key head shared by both cores, tiny
  configs only, is computed by both and written by its owner, after a core_barrier).
* ``finite [n_cores, 1]`` float32 (wrapper output): 1.0 when the core's final recurrent state and its y are
  finite (0 * (sum of both) == 0; y's row sums come free with its PSUM evictions). A NaN / Inf in xT reaches
  every core; one in the carried state or window the cores that own it. The flag reports non-finite input (or
  an overflow) instead of letting it propagate silently; :func:`check_finite` raises on the host.

Algorithm per core
------------------
Static Python loops only (the token count is a compile-time shape: one specialisation per chunk length; both
cores run identical control flow). A length that is not a multiple of 128 is zero-padded inside the last tile
with beta = 0 and g = 0, which leaves the state untouched; only valid rows of y are written.

1. Super-tiles of 512 tokens (4 tiles; 128 for fp32 or 8 value heads per core, where SBUF is short): in_proj
   with the **weights stationary** (``stationary = w_in[:, j, head cols] [128, D]``, ``moving = xT[:, j, 512
   tokens]``, 16 accumulating matmuls per head) gives channel-major u, z, b, a ``[D, tokens]`` directly. The
   weights stream per super-tile through a 3-group SBUF ring, each group DMA'd two groups ahead (6.3 MB per
   core and super-tile; SBUF goes to the tiles in flight). Order: b|a, the gates and decays of step 3 (they
   need only b|a), the q, k, v heads, z, then the SiLU of z and of the conv (one table load) and l2norm.
2. Causal conv, channel-major with the carried window in the first 3 columns: **4 accumulating matmuls per
   head against diagonal tap matrices** ``diag(w[:, k])`` (built once) over shifted column windows of the
   raw-u tile, one ACT SiLU straight out of PSUM. (Tokens are on the free axis, so the Flywheel 0/1
   shift-selector reduces to an access-pattern offset; the taps go on the diagonal of the stationary.)
   Chosen by the cost model: the shifted-AP alternative (1 DVE multiply + 3 DVE FMAs per head from SBUF)
   predicted 1,563 us vs 1,450 us for this kernel at 4K tokens (1K: 432 vs 405 us) -- the DVE ops land in
   the latency-bound burst below.
3. Gates in fp32 on ``[Hv_c, tokens]`` rows (heads on partitions, tokens free): g = -exp(A_log)
   softplus(a + dt_bias); ln beta = -softplus(-b) (so beta = exp(ln beta) = sigmoid(b) without a sigmoid
   table; ``allow_neg_eigval``: + ln 2); G by one DVE ``tensor_tensor_scan`` restarting at every block
   (segment-relative cumulative log-decays); exps for exp(G), beta exp(G), beta, exp(G_C - G). Then the
   decay matrices of all tiles (below). l2norm of q, k: ACT square, ones-matmul partition sum, ACT
   rsqrt(sum + 1e-6), one DVE multiply (q also by Dk^-0.5).
4. Per 128-token tile = two 64-token blocks (block 2t on partitions 0-63, 2t+1 on 64-127): every [128, 128]
   matrix is block-diagonal, so one matmul serves both blocks of a head.
   * ``[K K^T | K Q^T]`` with the key index on partitions: ONE matmul per key head (stationary K^T, moving
     [K^T | Q^T]): K^T shared by A_kk and A_qk, and by both value heads of the key head.
   * decays: exponent row_i - G_j + mask (0 / -1e30, block-causal) -- the row (G for P, G + ln beta for A)
     broadcast over the partitions by fp32 matmuls of one-hot stationaries against the gate rows, the
     mask by a second matmul, -G_j as the per-partition bias of the ACT exp; every kept exponent is a
     within-block difference <= 0 (never exp of a large cumulative sum, never a split exp(G_i) exp(-G_j)).
     ``P^T = (K Q^T) * Gamma^T`` and ``A^T = (K K^T) * beta_i Gamma^T``: one DVE multiply each out of PSUM.
   * ``X = (I + A)^-T``: the **Flywheel blocked inverse** (below), batched over the value heads.
   * ``U = X^T (beta V)`` (left in PSUM) and ``W^T = (beta exp(G) K)^T X`` (X is the stationary of one and the
     moving operand of the other), evicted as ``-W^T`` in fp32.
   * the chain, per block: ``V_new = U - W S`` (fp32 matmul accumulated onto U), one DVE eviction, the
     state update ``(exp(G_C - G) K)^T V_new`` (V_new is shared with the output), ``S <- exp(G_C) S + update``
     (ACT scale per head + one DVE add, fp32).
   * output channel-major: ``O^T = S^T (exp(G) Q)^T + V_new^T P^T`` (the state as fp32 stationary), gated
     RMSNorm channel-major (ones-matmul partition sum), out_proj with the gated output as stationary
     ``[D, 128 tokens]`` against the SBUF-resident w_out (4 PSUM banks of 512 columns) -> y rows -> HBM
     (software-DGE stores: GpSimd writes their descriptors, so they stay out of the SP queue, where the next
     super-tile's x loads would wait behind them in program order).
5. Software pipeline (:func:`_run_tiles`): each engine runs its instruction stream in program order, so
   independent work must sit between an instruction and its consumer on another engine. Step t interleaves,
   item by item, the chain of tile t, the second half of the state-independent work (P1: inverse, U, W) of
   tile t+1 and the first half of tile t+2's (two independent inverse chains; one tile ahead with two head
   groups, LNC=1, or in fp32), the output (P3) of tile t-1, and the projections of the next super-tile as PE filler.
   PSUM is a pool of 8 one-bank tiles handed out least-recently-released first, and the x, raw-u, weight
   and y buffers are fixed rings: a tile freshly allocated on the address just freed would wait for that
   address's last reader (a false dependency between independent streams), and SBUF would fragment.

Flywheel inverse (upper-triangular orientation; nc_matmul(a, b) = a^T b)
-----------------------------------------------------------------------
With Z = A^T strictly upper (key index on partitions) and level masks m_s (same s-block, different
s/4-block; applied by GpSimd affine_selects, :func:`_level_conditions`): level 1 (4x4 blocks) N1^T = Z m_4,
I - N1 = (I - N1^T)^T (a PE transpose), I - N1^2 =
nc(I - N1^T, I + N1), T_4^-1 = nc(I - N1^T, I + N1^2), T_4^-T = nc(I + N1^2, I - N1^T). Levels 16 and 64:
N = nc(Z_s, T^-1) = A_s T_prev^-1 (exactly the off-block part, the previous inverse being block-diagonal),
N^T = nc(T^-1, Z_s), I - N^2 = nc(I - N^T, I + N), F = (I - N)(I + N^2) = nc(I - N^T, I + N^2),
T^-1 = nc(T^-T_prev, F), T^-T = nc(F, T^-T_prev) (the last level: X = T^-T only). Each "I +/- PSUM" is folded
into the one eviction. 15 matmuls and 15 evictions per head and tile (both blocks), 12 dependent steps; N^4 = 0
at every level, so no long Neumann products (kernel-algorithms.md §1.6). Operands are bf16 (fp32 accumulation)
for beta < 1; with ``allow_neg_eigval`` (beta up to 2, the worst case) every inverse matmul is fp32 (bf16 level
1 alone already errs by 0.16 there). Error of X vs a float64 inverse (max-abs; |X| <= beta), tested: bf16,
beta <= 1: <= 2e-2 (measured 1.5e-2 on alternating near-equal keys, 8e-3 on 4 cycling keys, 4e-3 on a repeated
key with random beta, 1e-3 on random keys); fp32, beta < 2: <= 1e-3 (measured 1.5e-4).

Numerics follow the reference's casts: u, z, b, a and the conv output rounded to the activation dtype;
l2norm, gates, cumsum and the state in fp32; o rounded before the gated norm. In bf16 the chunk matmuls take
bf16 operands like FLA's (K K^T, Q K^T, the inverse, U, W, P V_new, the state update; the decays and silu(z)
are stored in bf16), while every matmul that reads the state (W S, Q S) is fp32 on both sides (§1.6: the state
operand's bf16 rounding dominates otherwise). Assumption (not documented by AWS): an fp32 matmul is exact for
products by 1.0 (the one-hot broadcasts of the gate rows and the identity transposes).

ACT tables (measured groups t0 {copy, square, rsqrt}, silu, exp, softplus; 1.28 us per switch): per
super-tile the stage-A functions run as bursts -- softplus, exp (gates and every decay of the super-tile),
t0 (tile work), SiLU of z and of the conv, then t0 (l2norm and all tile work) -- 5 switches per super-tile
(40 loads, 51 us, at 4K tokens; gates and decays right before the conv's SiLU would save one switch, but their
latency chain then stalls the PE: 1,332 vs 1,326 us when chosen). Native SiLU out of PSUM is one ACT
instruction per head; x / (1 + exp(-x)) (the decode kernel's choice) needs a DVE reciprocal (8x the DVE element
cost) and 0.5 x (1 + tanh(x / 2)) a table of its own plus two DVE passes per head (~11 us per super-tile), so
neither pays for the one switch they would save.
l2norm is one square, one rsqrt (with the eps as bias) and one multiply.

Predicted (``python -m harness.bench kernel nki_kernels/gdn_prefill.py::gdn_prefill_kernel --lnc 2 --arg
xT=128,16,L:bfloat16 ...`` at the real per-rank shapes of Qwen3.6 at TP=4 (4 key / 8 value heads, H=2048),
bf16, LNC=2; central (low - high)): L = 1,024 tokens: 381 us (346 - 598); L = 4,096: 1,317 us (1,208 - 2,218).
At 4K per core: PE busy 1,052 us (projections 423, the inverse 180, out_proj 130, conv 65), ACT 513 (51 of
them table loads), DVE 710, POOL 136; HBM 207 MB per rank (w_in streamed 8 times: 101 MB; y 64 MB; xT 32 MB),
roofline 326 us. The PE idles ~255 us, mostly waiting for ScalarE bursts (gates, l2norm, the gated norm).
The high end is the PE throttle band (x1.69 on every matmul) on a PE-bound kernel.
"""

from __future__ import annotations

import math

import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import INT32_MAX, P, PSUM_BANK, kernel_assert, own_identity, program_sharding
from nki_kernels.gdn import L2_EPS, core_split

BLOCK = 64              # C: tokens per chunk of the delta rule
TILE = 128              # tokens per tile: two blocks on partitions 0-63 / 64-127
SUPER = 4               # at most 4 tiles per projection super-tile: 512 tokens = one PSUM bank of fp32 columns
PSUM_COLS = PSUM_BANK      # fp32 columns of one PSUM bank
PSUM_BANKS = 8          # 8 banks x 2 KB per partition (nkisim.hw.PSUM_NUM_BANKS)
NEG = -1.0e30           # additive causal mask inside the exponent: exp(x + NEG) == 0 exactly
LOGB_PAD = -30000.0     # ln(beta) of padding tokens: beta == 0 exactly, finite in every matmul
FIXED_SBUF_MAX = 96 * 1024   # per partition: w_out + conv taps + weight ring; the rest is for the tiles
W_RING = 3              # in_proj weight groups in flight (streamed, issued 2 groups ahead of their matmuls)
LN2 = math.log(2.0)

ACT_ENG = nisa.engine.scalar
DVE_ENG = nisa.engine.vector
POOL_ENG = nisa.engine.gpsimd
F32 = nl.float32

# rows of the per-super-tile gate tile ``gr [Hv_c, NQ, W]`` (fp32): G, H = G + ln beta, exp(G), -G
Q_G, Q_H, Q_GAM, Q_NG = 0, 1, 2, 3
NQ = 4
# columns of the token-major gate tile ``gt [128, tiles, NC, Hv_c]``: beta exp(G), beta, exp(G_C - G), -G
C_BG, C_BETA, C_DEC, C_NG = 0, 1, 2, 3
NC = 4


# ---------------------------------------------------------------------------------------------
# small helpers (traced)
# ---------------------------------------------------------------------------------------------

def _row(t):
    """Elements per partition of a freshly allocated on-chip tensor (the partition step of its APs)."""
    n = 1
    for s in t.shape[1:]:
        n *= s
    return n


def _bview(t, parts, dims, offset):
    """Access-pattern view of tile ``t``: ``parts`` partitions, free dims ``dims`` ([[step, num], ...],
    stride 0 = broadcast), starting ``offset`` elements into partition 0 of ``t``."""
    pat = [[_row(t), parts]]
    for d in dims:
        pat.append(d)
    return t.ap(pattern=pat, offset=offset)


def psum_pool():
    """The launch's PSUM as PSUM_BANKS one-bank tiles, handed out least-recently-released first (a bank's
    previous readers are then long done: reusing the bank just released would make the next writer wait for
    them -- a false dependency between independent streams)."""
    banks = []
    free = []
    for b in range(PSUM_BANKS):
        banks.append(nl.ndarray((P, PSUM_COLS), F32, buffer=nl.psum, name="psum_bank" + str(b)))
        free.append(b)
    return {"banks": banks, "free": free}


def _ps(c, parts, dims):
    """(view, bank): a float32 PSUM view [parts, *dims] (row-major, at most 512 elements per partition) on
    the least recently released bank; release it with :func:`_ps_free` after its last reader."""
    pool = c["psum"]
    kernel_assert(len(pool["free"]) > 0, "gdn_prefill: every PSUM bank is in use")
    b = pool["free"].pop(0)
    pat = [[PSUM_COLS, parts]]
    size = 1
    for d in dims:
        size *= d
    kernel_assert(size <= PSUM_COLS, f"gdn_prefill: PSUM view {dims} exceeds a bank")
    step = size
    for d in dims:
        step = step // d
        pat.append([step, d])
    return pool["banks"][b].ap(pattern=pat, offset=0), b


def _ps_free(c, b):
    c["psum"]["free"].append(b)


def _after(write, reads):
    """Order a decode-state write after every read of the starting slot (read and write slot may be equal)."""
    for r in reads:
        write.depends_on(r)


def _ones(shape, dtype, name):
    t = nl.ndarray(shape, dtype, buffer=nl.sbuf, name=name)
    nisa.memset(dst=t, value=1.0, engine=POOL_ENG)
    return t


def _upper_block(s, strict, name):
    """[128, 128] float32 0/1 mask of (column c, row p): same s-block and c > p (strict) or c >= p."""
    t = _ones((P, P), F32, name)
    nisa.affine_select(dst=t, pattern=[[1, P]], channel_multiplier=-1, on_true_tile=t, on_false_value=0.0,
                       cmp_op=nl.greater if strict else nl.greater_equal)
    nb = P // s
    nisa.affine_select(dst=t, pattern=[[-s, nb], [0, s]], channel_multiplier=1, on_true_tile=t,
                       on_false_value=0.0, cmp_op=nl.greater_equal)               # p - s*blk(c) >= 0
    nisa.affine_select(dst=t, pattern=[[s, nb], [0, s]], channel_multiplier=-1, offset=s - 1, on_true_tile=t,
                       on_false_value=0.0, cmp_op=nl.greater_equal)               # s*blk(c) + s-1 - p >= 0
    return t


def _constants(g, conv_w, A_log, dt_bias, norm_w):
    """Constant tiles of one launch (built once per core)."""
    hv, D, NH, K, mdt, idt = g["hv"], g["D"], g["NH"], g["K"], g["mdt"], g["idt"]
    c = {}
    # identities of the kernel's own: the inverse addresses them by raw access patterns (_bview)
    c["I_f"] = own_identity(P, F32, "gdn_pf_ident_f")
    c["I_m"] = c["I_f"] if mdt == F32 else own_identity(P, mdt, "gdn_pf_ident_m")
    c["I_i"] = c["I_f"] if idt == F32 else c["I_m"]
    inverse_constants(c)
    u64 = _upper_block(BLOCK, True, "ub64")
    i64 = _upper_block(BLOCK, False, "ib64")
    # additive masks 0 (kept) / NEG (masked): (mask - 1) * (-NEG)
    ma_i = nl.ndarray((P, P), F32, buffer=nl.sbuf, name="madd_incl")
    nisa.tensor_scalar(dst=ma_i, data=i64, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=-NEG)
    ma_s = nl.ndarray((P, P), F32, buffer=nl.sbuf, name="madd_strict")
    nisa.tensor_scalar(dst=ma_s, data=u64, op0=nl.subtract, operand0=1.0, op1=nl.multiply, operand1=-NEG)
    if mdt == F32:
        c["madd_incl"] = ma_i
        c["madd_strict"] = ma_s
    else:
        c["madd_incl"] = nl.ndarray((P, P), mdt, buffer=nl.sbuf, name="madd_incl_mm")
        nisa.tensor_copy(dst=c["madd_incl"], src=ma_i, engine=POOL_ENG)
        c["madd_strict"] = nl.ndarray((P, P), mdt, buffer=nl.sbuf, name="madd_strict_mm")
        nisa.tensor_copy(dst=c["madd_strict"], src=ma_s, engine=POOL_ENG)
    # onehot[k, h, j] = (k == h): stationary h broadcasts head h's gate row over the partitions
    oh = _ones((hv, hv, P), F32, "onehot")
    nisa.affine_select(dst=oh, pattern=[[-1, hv], [0, P]], channel_multiplier=1, on_true_tile=oh,
                       on_false_value=0.0, cmp_op=nl.equal)
    c["onehot"] = oh
    sel = _ones((2 * hv, hv), mdt, "sel_a")           # sel[hv + i, i] = 1: moves the a rows to partition 0
    nisa.affine_select(dst=sel, pattern=[[-1, hv]], channel_multiplier=1, offset=-hv, on_true_tile=sel,
                       on_false_value=0.0, cmp_op=nl.equal)
    c["sel_a"] = sel
    c["ones_d"] = _ones((D, D), F32, "ones_d")
    c["ones_col"] = _ones((P, 1), F32, "ones_col")
    # segmented-scan restart mask: 0 at the first token of every block
    rs = _ones((hv, g["super"] * TILE // BLOCK, BLOCK), F32, "scan_reset")
    nisa.affine_select(dst=rs, pattern=[[0, g["super"] * TILE // BLOCK], [1, BLOCK]], channel_multiplier=0,
                       on_true_tile=rs, on_false_value=0.0, cmp_op=nl.greater)
    c["reset"] = rs
    # conv taps as diagonal stationaries: taps[:, h, k, :] = diag(conv_w[core][:, h, k])
    wc = nl.ndarray((D, NH, K), conv_w.dtype, buffer=nl.sbuf, name="conv_w_in")
    nisa.dma_copy(dst=wc, src=conv_w[g["core"]])
    taps = nl.ndarray((D, NH, K, D), mdt, buffer=nl.sbuf, name="conv_diag")
    nisa.affine_select(dst=taps, pattern=[[0, NH * K], [-1, D]], channel_multiplier=1,
                       on_true_tile=_bview(wc, D, [[1, NH * K], [0, D]], 0), on_false_value=0.0, cmp_op=nl.equal)
    c["taps"] = taps
    vh0 = g["vh0"]
    nA = nl.ndarray((hv, 1), F32, buffer=nl.sbuf, name="neg_exp_A")
    nisa.dma_copy(dst=nA, src=A_log[vh0:vh0 + hv])
    nisa.activation(dst=nA, op=nl.exp, data=nA)
    nisa.tensor_scalar(dst=nA, data=nA, op0=nl.multiply, operand0=-1.0)
    c["nA"] = nA
    dtb = nl.ndarray((hv, 1), F32, buffer=nl.sbuf, name="dt_bias")
    nisa.dma_copy(dst=dtb, src=dt_bias[vh0:vh0 + hv])
    c["dtb"] = dtb
    wn = nl.ndarray((D, 1), F32, buffer=nl.sbuf, name="norm_w")
    nisa.dma_copy(dst=wn, src=norm_w)
    c["wn"] = wn
    return c


# ---------------------------------------------------------------------------------------------
# stage A of a super-tile (<= 512 tokens): projections, conv, gates, l2norm -- channel-major. Written as
# a list of items so the tile work of the previous super-tile can interleave them (see _run_tiles).
# ---------------------------------------------------------------------------------------------

def _a_open(g, c, xT, s, prev):
    """Context of stage A for super-tile ``s`` (``prev``: the previous super-tile's context, or the carried
    window [D, NH, K-1] for s = 0): issues the input DMA and returns the context with its item list."""
    D, J, hv, NH, Km1, adt = g["D"], g["J"], g["hv"], g["NH"], g["Km1"], g["adt"]
    t0 = s * g["super"] * TILE
    vs = min(g["super"] * TILE, g["L"] - t0)            # valid tokens
    nt = (vs + TILE - 1) // TILE
    W = nt * TILE
    xs = c["x_buf"][:, :, 0:W]          # one fixed buffer (the previous super-tile's projections are all issued)
    if vs < W:
        nisa.memset(dst=xs[:, :, vs:W], value=0.0, engine=POOL_ENG)
    jq = (J + 3) // 4              # four DMAs: the first matmuls (j ascending) start after the first quarter
    for j0 in range(0, J, jq):
        nisa.dma_copy(dst=xs[:, j0:min(J, j0 + jq), 0:vs], src=xT[:, j0:min(J, j0 + jq), t0:t0 + vs],
                      engine=nisa.engine.sync, dge_mode=nisa.dge_mode.hwdge)
    ucat = c["u_ring"][s % 2][:, :, 0:Km1 + W]    # raw u behind the carried columns
    if s == 0:
        nisa.tensor_copy(dst=ucat[:, :, 0:Km1], src=prev, engine=POOL_ENG)
    else:
        nisa.tensor_copy(dst=ucat[:, :, 0:Km1], src=prev["tail"], engine=POOL_ENG)
    # order: b|a and the gates and decays (their ACT / DVE chain runs behind the next projections), the conv
    # heads, z, then the SiLU burst (z and the conv: one table) and l2norm -- the latency-bound part, hidden by
    # the tiles of the previous super-tile
    items = []
    wseq = [NH + hv]
    for j in range(J):
        items.append(("ba", 0, j))
    items.append(("ba_end", 0, 0))
    items.append(("gates", 0, 0))
    for h in range(NH):
        wseq.append(h)
        for j in range(J):
            items.append(("proj", h, j))
        items.append(("proj_end", h, 0))
    for h in range(NH, NH + hv):
        wseq.append(h)
        for j in range(J):
            items.append(("proj", h, j))
        items.append(("proj_end", h, 0))
    items.append(("silu_z", 0, 0))
    items.append(("act_burst", 0, 0))
    for kh in range(g["hk"]):
        items.append(("l2norm", kh, 0))
    items.append(("done", 0, 0))
    A = {"s": s, "t0": t0, "vs": vs, "nt": nt, "W": W, "xs": xs, "ucat": ucat,
            "zs": nl.ndarray((D, hv, W), adt, buffer=nl.sbuf, name="z"),
            "cqk": nl.ndarray((D, 2 * g["hk"], W), adt, buffer=nl.sbuf, name="conv_qk"),
            "cv": nl.ndarray((D, hv, W), adt, buffer=nl.sbuf, name="conv_v"),
            "items": items, "pos": 0, "ps": None, "wbuf": [], "wseq": wseq, "complete": False}
    for gw in range(NH + hv + 1):
        A["wbuf"].append(None)
    _w_issue(g, c, A, 0)
    _w_issue(g, c, A, 1)
    return A


def _w_cols(g, gw):
    """Columns of w_in of in_proj weight group gw (a q/k/v/z head, then b | a)."""
    D, NH, hv = g["D"], g["NH"], g["hv"]
    if gw < NH + hv:
        return gw * D, (gw + 1) * D
    return g["cb"], g["cb"] + 2 * hv


def _w_issue(g, c, A, k):
    """DMA the weights of the k-th group of A's projection order into the next buffer of the ring (each
    group is read once per super-tile; streamed, not SBUF-resident: SBUF goes to the tiles in flight)."""
    if k >= len(A["wseq"]):
        return
    gw = A["wseq"][k]
    c0, c1 = _w_cols(g, gw)
    buf = c["w_ring"][c["w_next"] % W_RING]
    c["w_next"] += 1
    nisa.dma_copy(dst=buf[:, :, 0:c1 - c0], src=c["w_in"][g["core"], :, :, c0:c1], engine=ACT_ENG,
                  dge_mode=nisa.dge_mode.hwdge)
    A["wbuf"][gw] = buf[:, :, 0:c1 - c0]


def _a_cost(g, A, item):
    """Estimated PE time (ns) of an item: what it contributes as filler between dependent tile steps."""
    kind = item[0]
    if kind == "proj" or kind == "ba":
        return 254.0 * A["W"] / PSUM_COLS
    if kind == "act_burst":
        return g["NH"] * g["K"] * 254.0 * A["W"] / PSUM_COLS
    return 0.0


def _a_item(g, c, A, item, neg):
    kind, h, j = item[0], item[1], item[2]
    D, J, hv, hk, NH, Km1, adt, W = g["D"], g["J"], g["hv"], g["hk"], g["NH"], g["Km1"], g["adt"], A["W"]
    if kind == "proj" or kind == "ba":
        gw = h if kind == "proj" else NH + hv
        c0, c1 = _w_cols(g, gw)
        if j == 0:
            view_bank = _ps(c, c1 - c0, [W])
            A["ps"] = view_bank[0]
            A["psb"] = view_bank[1]
            k = 0
            for i in range(len(A["wseq"])):
                if A["wseq"][i] == gw:
                    k = i
            _w_issue(g, c, A, k + 2)
        nisa.nc_matmul(dst=A["ps"], stationary=A["wbuf"][gw][:, j, :], moving=A["xs"][:, j, :], accumulate=j > 0)
        if j == J - 1:
            A["wbuf"][gw] = None
    elif kind == "proj_end":
        dst = A["ucat"][:, h, Km1:Km1 + W] if h < NH else A["zs"][:, h - NH, :]
        nisa.tensor_copy(dst=dst, src=A["ps"], engine=DVE_ENG)
        _ps_free(c, A["psb"])
        A["ps"] = None
    elif kind == "ba_end":
        ba = nl.ndarray((2 * hv, W), adt, buffer=nl.sbuf, name="b_a")
        nisa.tensor_copy(dst=ba, src=A["ps"], engine=DVE_ENG)
        _ps_free(c, A["psb"])
        A["ba"] = ba
        A["ps"] = None
    elif kind == "act_burst":
        # the conv and its SiLU (all heads; right after the SiLU of z: one table load)
        for hh in range(NH):
            ps, pb = _ps(c, D, [W])
            for k in range(g["K"]):
                nisa.nc_matmul(dst=ps, stationary=c["taps"][:, hh, k, :], moving=A["ucat"][:, hh, k:k + W],
                               accumulate=k > 0)
            dst = A["cqk"][:, hh, :] if hh < 2 * hk else A["cv"][:, hh - 2 * hk, :]
            nisa.activation(dst=dst, op=nl.silu, data=ps)
            _ps_free(c, pb)
    elif kind == "gates":
        # softplus and exp of the gates, then every decay of the super-tile (exp): needs only b|a, so its
        # latency chain hides behind the q/k/v/z projections
        _gates(g, c, A, neg)
        decays = []
        for tl in range(A["nt"]):
            per = []
            for grp in g["groups"]:
                per.append([_decay(g, c, A, Q_G, c["madd_incl"], tl * TILE, grp, g["mdt"], "decay_incl"),
                            _decay(g, c, A, Q_H, c["madd_strict"], tl * TILE, grp, g["idt"], "decay_beta")])
            decays.append(per)
        A["decays"] = decays
        gam = nl.ndarray((hv, 1, W), F32, buffer=nl.sbuf, name="gamma_rows")       # exp(G): all the tiles need
        nisa.tensor_copy(dst=gam[:, 0, :], src=A["gr"][:, Q_GAM, :], engine=POOL_ENG)
        A["gam_rows"] = gam
        A["gr"] = None
        A["q32"] = nl.ndarray((D, hk, W), F32, buffer=nl.sbuf, name="q")
        A["qkm"] = nl.ndarray((D, hk, 2, W), g["mdt"], buffer=nl.sbuf, name="qk_mm")
    elif kind == "silu_z":
        sz = nl.ndarray((D, hv, W), adt, buffer=nl.sbuf, name="silu_z")
        nisa.activation(dst=sz, op=nl.silu, data=A["zs"])
        A["sz"] = sz
        A["zs"] = None
        A["xs"] = None
    elif kind == "l2norm":
        _l2norm_head(g, c, A, h, hk + h, A["qkm"][:, h, 0, :], 1.0)                  # k (matmul dtype)
        _l2norm_head(g, c, A, h, h, A["q32"][:, h, :], 1.0 / math.sqrt(D))          # q * Dk^-0.5 (fp32)
        if g["mdt"] == F32:
            nisa.tensor_copy(dst=A["qkm"][:, h, 1, :], src=A["q32"][:, h, :], engine=POOL_ENG)
        else:
            nisa.tensor_copy(dst=A["qkm"][:, h, 1, :], src=A["q32"][:, h, :], engine=POOL_ENG)
    elif kind == "done":
        # the raw u of the last K-1 tokens: the next super-tile's carried columns / the final window
        tail = nl.ndarray((D, NH, Km1), adt, buffer=nl.sbuf, name="u_tail")
        nisa.tensor_copy(dst=tail, src=A["ucat"][:, :, A["vs"]:A["vs"] + Km1], engine=POOL_ENG)
        A["tail"] = tail
        A["ucat"] = None
        A["cqk"] = None
        A["complete"] = True


def _a_fill(g, c, A, budget, neg):
    """Emit stage-A items until about ``budget`` ns of PE work was emitted (a negative budget: all)."""
    if A == None:
        return
    spent = 0.0
    items = A["items"]
    while A["pos"] < len(items) and (budget < 0 or spent < budget):
        item = items[A["pos"]]
        _a_item(g, c, A, item, neg)
        spent += _a_cost(g, A, item)
        A["pos"] += 1


def _a_remaining(g, A):
    if A == None:
        return 0.0
    tot = 0.0
    items = A["items"]
    for i in range(A["pos"], len(items)):
        tot += _a_cost(g, A, items[i])
    return tot


def _gates(g, c, A, neg):
    """Gate rows ``gr [hv, NQ, W]`` and columns ``tb [hv, 3, W]`` fp32 (module docstring step 3), computed in
    place in those two tiles (they use hv partitions of the full per-partition width); padding tokens get
    g = 0 and beta = 0."""
    hv, W, vs = g["hv"], A["W"], A["vs"]
    gr = nl.ndarray((hv, NQ, W), F32, buffer=nl.sbuf, name="gates")
    tb = nl.ndarray((hv, 3, W), F32, buffer=nl.sbuf, name="gate_cols")
    a_ps, pb = _ps(c, hv, [W])            # a rows moved to partition 0 (exact)
    nisa.nc_matmul(dst=a_ps, stationary=c["sel_a"], moving=A["ba"], accumulate=False)
    tmp = tb[:, C_DEC, :]
    nisa.tensor_scalar(dst=tmp, data=a_ps, op0=nl.add, operand0=c["dtb"])
    _ps_free(c, pb)
    nisa.activation(dst=tmp, op=nl.softplus, data=tmp)
    nisa.activation(dst=tb[:, C_BETA, :], op=nl.softplus, data=A["ba"][0:hv, :], scale=-1.0)
    gl = tb[:, C_BG, :]
    nisa.tensor_scalar(dst=gl, data=tmp, op0=nl.multiply, operand0=c["nA"])      # g
    if vs < W:
        nisa.memset(dst=gl[:, vs:W], value=0.0, engine=POOL_ENG)
    nisa.tensor_tensor_scan(dst=gr[:, Q_G, :], data0=c["reset"].ap(pattern=[[g["super"] * TILE, hv], [1, W]], offset=0),
                            data1=gl, initial=0.0, op0=nl.multiply, op1=nl.add)
    # tb = [H | ln beta | G_C - G] -> [beta exp(G) | beta | exp(G_C - G)]; ln beta = -softplus(-b) (+ ln 2)
    nisa.tensor_scalar(dst=tb[:, C_BETA, :], data=tb[:, C_BETA, :], op0=nl.multiply, operand0=-1.0, op1=nl.add,
                       operand1=LN2 if neg else 0.0)
    if vs < W:
        nisa.memset(dst=tb[:, C_BETA, vs:W], value=LOGB_PAD, engine=POOL_ENG)
    nisa.tensor_tensor(dst=gr[:, Q_H, :], data1=gr[:, Q_G, :], data2=tb[:, C_BETA, :], op=nl.add)
    nb = W // BLOCK                      # G at the end of each token's block, minus G
    nisa.tensor_tensor(dst=tb[:, C_DEC, :], data1=_bview(gr, hv, [[BLOCK, nb], [0, BLOCK]], Q_G * W + BLOCK - 1),
                       data2=gr[:, Q_G, :], op=nl.subtract)
    nisa.activation(dst=gr[:, Q_GAM, :], op=nl.exp, data=gr[:, Q_G, :])
    nisa.activation(dst=tb[:, C_BG, :], op=nl.exp, data=gr[:, Q_H, :])
    nisa.activation(dst=tb[:, C_BETA:C_DEC + 1, :], op=nl.exp, data=tb[:, C_BETA:C_DEC + 1, :])
    nisa.tensor_scalar(dst=gr[:, Q_NG, :], data=gr[:, Q_G, :], op0=nl.multiply, operand0=-1.0)
    # token-major gate columns of every tile (PE transposes)
    nt = A["nt"]
    gt_ps, pb = _ps(c, P, [nt, NC, hv])
    for tl in range(nt):
        for q in range(NC):
            src = gr[:, Q_NG, tl * TILE:(tl + 1) * TILE] if q == C_NG else tb[:, q, tl * TILE:(tl + 1) * TILE]
            nisa.nc_matmul(dst=gt_ps[:, tl, q, :], stationary=src,
                           moving=c["I_f"][0:hv, 0:hv], accumulate=False)
    gt = nl.ndarray((P, nt, NC, hv), F32, buffer=nl.sbuf, name="gate_tok")
    nisa.tensor_copy(dst=gt, src=gt_ps, engine=DVE_ENG)
    _ps_free(c, pb)
    A["gt"] = gt
    A["gr"] = gr
    A["ba"] = None


def _l2norm_head(g, c, A, kh, h, dst, scale):
    """dst [D, W] = l2norm(conv output of head h over the D partitions) * scale."""
    D, W, cact = g["D"], A["W"], A["cqk"]
    sq = nl.ndarray((D, W), F32, buffer=nl.sbuf, name="qk_sq")
    nisa.activation(dst=sq, op=nl.square, data=cact[:, h, :])
    ss, pb = _ps(c, D, [W])
    nisa.nc_matmul(dst=ss, stationary=c["ones_d"], moving=sq, accumulate=False)
    rr = nl.ndarray((D, W), F32, buffer=nl.sbuf, name="qk_rstd")
    nisa.activation(dst=rr, op=nl.rsqrt, data=ss, bias=L2_EPS)
    _ps_free(c, pb)
    nisa.scalar_tensor_tensor(dst=dst, data=cact[:, h, :], op0=nl.multiply, operand0=scale,
                              op1=nl.multiply, operand1=rr)


# ---------------------------------------------------------------------------------------------
# the Flywheel blocked inverse
# ---------------------------------------------------------------------------------------------

INV_STAGES = 12         # dependent steps of flywheel_inverse (independent products of a level share a step)


def _products(c, n, stat, mov):
    """(PSUM [128, n, 128], bank) with slice h = stat[:, h, :]^T mov[:, h, :] (``mov`` may be [128, 128])."""
    ps, b = _ps(c, P, [n, P])
    for h in range(n):
        m = mov if len(mov.shape) == 2 else mov[:, h, :]
        nisa.nc_matmul(dst=ps[:, h, :], stationary=stat[:, h, :], moving=m, accumulate=False)
    return [ps, b]


def _evict(c, st, key, psb, const, sign, engine=ACT_ENG):
    """st[key] = ps (const None: a copy on ``engine``, ACT or DVE), or const + sign * ps (DVE, the [128, 128]
    constant broadcast over the heads)."""
    n = st["n"]
    ps = psb[0]
    dst = nl.ndarray((P, n, P), st["out"] if key == "x" else st["idt"], buffer=nl.sbuf, name="inv_" + key)
    if const == None and engine == DVE_ENG:
        nisa.tensor_copy(dst=dst, src=ps, engine=DVE_ENG)
    elif const == None:
        nisa.activation(dst=dst, op=nl.copy, data=ps)
    else:
        nisa.scalar_tensor_tensor(dst=dst, data=ps, op0=nl.multiply, operand0=sign, op1=nl.add,
                                  operand1=_bview(const, P, [[0, n], [1, P]], 0))
    _ps_free(c, psb[1])
    st[key] = dst


def _level_conditions(lev):
    """The two affine conditions of the inverse's level mask ``lev`` (1: m4, 2: m16 - m4, 3: m64 - m16) on (row
    p = key index, column c = s b + r), as [s, step, channel_multiplier, cmp] over the columns split into
    128 // s blocks of s: "c > p" is c - p > 0 (s = 1); "c's s-block above p's" (so c > p over the block) is
    s b - p > 0; "c in p's s-block or an earlier one" is p - s b >= 0."""
    if lev == 1:
        return [[1, 1, -1, nl.greater], [4, -4, 1, nl.greater_equal]]
    if lev == 2:
        return [[4, 4, -1, nl.greater], [16, -16, 1, nl.greater_equal]]
    return [[16, 16, -1, nl.greater], [BLOCK, -BLOCK, 1, nl.greater_equal]]


def _masked(dst, src, n, lev):
    """dst = src * m_lev (the 0/1 level mask broadcast over the n heads of [128, n, 128]) as two GpSimd
    affine_selects (a copy where both conditions hold, 0.0 elsewhere; a float multiply cannot run on GpSimd)."""
    conds = _level_conditions(lev)
    for i in range(2):
        s, step, cm, cmp = conds[i][0], conds[i][1], conds[i][2], conds[i][3]
        nisa.affine_select(dst=dst, pattern=[[0, n], [step, P // s], [0, s]], channel_multiplier=cm,
                           on_true_tile=src if i == 0 else dst, on_false_value=0.0, cmp_op=cmp)


def inverse_constants(c):
    """Constants of :func:`inverse_stage` beside the identities: ``two_I`` (2I, fp32)."""
    two = nl.ndarray((P, P), F32, buffer=nl.sbuf, name="two_I")
    nisa.tensor_scalar(dst=two, data=c["I_f"], op0=nl.multiply, operand0=2.0)
    c["two_I"] = two


def inverse_open(zT, n, idt, out_dtype):
    """State of one Flywheel inverse of n heads: zT [128, n, 128] SBUF (dtype idt), ``zT[:, h, :] = A_h^T``."""
    return {"z": zT, "n": n, "idt": idt, "out": out_dtype}


def inverse_stage(c, st, k):
    """Step k (0 .. INV_STAGES-1) of the Flywheel inverse (module docstring); step INV_STAGES-1 leaves
    X = (I + A)^-T in st["x"] (dtype out_dtype). Constants ``c``: I_f / I_i identities and
    :func:`inverse_constants`."""
    n, idt = st["n"], st["idt"]
    I_f, two = c["I_f"], c["two_I"]
    if k == 0:                        # level-1 operands and the level-2/3 parts of A^T (masks on POOL)
        n1t = nl.ndarray((P, n, P), idt, buffer=nl.sbuf, name="inv_n1t")
        _masked(n1t, st["z"], n, 1)
        imnt = nl.ndarray((P, n, P), idt, buffer=nl.sbuf, name="inv_imnt")
        nisa.tensor_tensor(dst=imnt, data1=_bview(I_f, P, [[0, n], [1, P]], 0), data2=n1t, op=nl.subtract,
                           engine=DVE_ENG)
        st["imnt"] = imnt
        for lev in (2, 3):
            t = nl.ndarray((P, n, P), idt, buffer=nl.sbuf, name="inv_z" + str(lev))
            _masked(t, st["z"], n, lev)
            st["z" + str(lev)] = t
        st["z"] = None
    elif k == 1:                      # I + N1 = 2I - (I - N1^T)^T (a PE transpose)
        _evict(c, st, "ipn", _products(c, n, st["imnt"], c["I_i"]), two, -1.0)
    elif k == 2:                      # I + N1^2 = 2I - (I - N1)(I + N1)
        _evict(c, st, "ipn2", _products(c, n, st["imnt"], st["ipn"]), two, -1.0)
    elif k == 3:                      # T4^-1 = (I - N1)(I + N1^2), T4^-T
        pa = _products(c, n, st["imnt"], st["ipn2"])
        pb = _products(c, n, st["ipn2"], st["imnt"])
        _evict(c, st, "lo", pa, None, 1.0)
        _evict(c, st, "up", pb, None, 1.0)
    else:
        lev = 2 if k < 8 else 3
        j = k - 4 if k < 8 else k - 8
        z = st["z" + str(lev)]
        if j == 0:                    # I + N (N = A_s T^-1) and I - N^T
            pa = _products(c, n, z, st["lo"])
            pb = _products(c, n, st["lo"], z)
            _evict(c, st, "ipn", pa, I_f, 1.0)
            _evict(c, st, "imnt", pb, I_f, -1.0)
        elif j == 1:                  # I + N^2 = 2I - (I - N)(I + N)
            _evict(c, st, "ipn2", _products(c, n, st["imnt"], st["ipn"]), two, -1.0)
        elif j == 2:                  # F = (I - N)(I + N^2)
            _evict(c, st, "f", _products(c, n, st["imnt"], st["ipn2"]), None, 1.0)
        elif lev == 2:                # T16^-1 = T4^-1 F, T16^-T = F^T T4^-T
            # evicted on DVE, the other plain copies on ACT: the ACT / DVE balance the cost model chose (4K
            # tokens: 1,326 us with all of them on ACT, 1,308 with these two on DVE; others moved did not pay)
            pa = _products(c, n, st["up"], st["f"])
            pb = _products(c, n, st["f"], st["up"])
            _evict(c, st, "lo", pa, None, 1.0, DVE_ENG)
            _evict(c, st, "up", pb, None, 1.0, DVE_ENG)
        else:                         # X = T64^-T = F^T T16^-T
            _evict(c, st, "x", _products(c, n, st["f"], st["up"]), None, 1.0)
            for key in ("imnt", "ipn", "ipn2", "f", "lo", "up", "z2", "z3"):
                st[key] = None


def flywheel_inverse(c, zT, n, idt, out_dtype):
    """X = (I + A)^-T for n heads at once, all steps in sequence (module docstring, "Flywheel inverse").

    zT: [128, n, 128] SBUF, ``zT[:, h, :] = A_h^T`` (strictly upper; block-diagonal over the two 64-token
    blocks; key index on partitions), dtype ``idt`` (the inverse's matmul dtype). Returns X [128, n, 128] of
    dtype ``out_dtype``.
    """
    st = inverse_open(zT, n, idt, out_dtype)
    for k in range(INV_STAGES):
        inverse_stage(c, st, k)
    return st["x"]


# ---------------------------------------------------------------------------------------------
# stage B: one 128-token tile (two 64-token blocks) as three item streams: P1 (state-independent operands
# and the inverse), the chain (the two blocks' recurrence), P3 (output, gated norm, out_proj)
# ---------------------------------------------------------------------------------------------

def _broadcast_rows(c, ps, rows, h0, n, parts):
    """ps[:, h, :] = rows[h0 + h, :] on each of ``parts`` partitions, for the group's n heads: one fp32 matmul
    per head with the one-hot stationary ``onehot[:, h0 + h, 0:parts]`` (column j of it is e_{h0+h}) against
    the rows ``[hv, 128]`` (every product is by 1.0 or 0.0: exact). No VectorE work; the PE streams what one
    n x 128-column matmul would."""
    for h in range(n):
        nisa.nc_matmul(dst=ps[:, h, :], stationary=c["onehot"][:, h0 + h, 0:parts], moving=rows, accumulate=False)


def _decay(g, c, A, q, madd, c0, grp, dtype, name):
    """exp(row_q[i] - G[j] + madd[j, i]) for the group's heads: [128 j, n, 128 i]. The row broadcast over the
    partitions (:func:`_broadcast_rows`) plus the additive 0 / -1e30 block-causal mask (a matmul in the matmul
    dtype: 1 x -1e30 is as good in bf16) accumulate in PSUM; -G_j is the per-partition bias of one ACT exp per
    head."""
    h0, n = grp["h0"], grp["n"]
    ps, pb = _ps(c, P, [n, TILE])
    _broadcast_rows(c, ps, A["gr"][:, q, c0:c0 + TILE], h0, n, P)
    nisa.nc_matmul(dst=ps, stationary=c["I_m"], moving=_bview(madd, P, [[0, n], [1, TILE]], 0), accumulate=True)
    out = nl.ndarray((P, n, TILE), dtype, buffer=nl.sbuf, name=name)
    for h in range(n):
        nisa.activation(dst=out[:, h, :], op=nl.exp, data=ps[:, h, :],
                        bias=A["gt"][:, c0 // TILE, C_NG, h0 + h:h0 + h + 1])
    _ps_free(c, pb)
    return out


def super_tiles(isz, hv):
    """Tiles per projection super-tile: 4 (512 tokens: the projections stream full 512-column moving tiles)
    for a bf16 core with at most 4 value heads (Qwen3.6 at TP=4, LNC=2: peak SBUF 203 KB of 208 KB in the
    nkisim trace at 3-4K tokens), else 1: fp32 operands or 8 value heads per core (LNC=1) double the bytes in
    flight, and the super-tile is what gives way (peaks 189 KB fp32 at LNC=2, 195 KB bf16 at LNC=1, 4K tokens;
    the projections then run 128-column matmuls at the PE floor). Compile time."""
    return SUPER if (isz == 2 and hv <= PSUM_COLS // P) else 1


def super_tile_tokens(dtype, hv_core):
    """Tokens per projection super-tile for an activation dtype (torch, numpy or NKI name) and value heads per
    core: prompt chunks split at multiples of it see the same shapes as one call (host helper)."""
    isz = 2 if "bfloat16" in str(dtype) else 4
    return super_tiles(isz, hv_core) * TILE


def head_groups(hv, runs):
    """The core's value heads in groups of at most 4 (one PSUM bank holds [128, 4, 128] fp32), each with its
    key-head runs ([key head, first, end) relative to the group). Compile time, NKI Python subset."""
    size = PSUM_COLS // P
    groups = []
    for h0 in range(0, hv, size):
        h1 = min(hv, h0 + size)
        gruns = []
        for run in runs:
            a = max(run[1], h0)
            b = min(run[2], h1)
            if a < b:
                gruns.append([run[0], a - h0, b - h0])
        groups.append({"h0": h0, "n": h1 - h0, "runs": gruns})
    return groups


def _t_open(g, A, c0, groups, index):
    """Context of the tile at column c0 of super-tile context A, with its three item lists."""
    ng = len(groups)
    p1 = [("shared", 0, 0)]
    for kind in ("pa",):
        for gi in range(ng):
            p1.append((kind, gi, 0))
    for k in range(INV_STAGES):
        for gi in range(ng):
            p1.append(("inv", gi, k))
    for kind in ("tok", "gamma", "uw"):
        for gi in range(ng):
            p1.append((kind, gi, 0))
    chain = [("ws", 0, 0), ("st", 0, 0), ("ws", BLOCK, 0), ("st", BLOCK, 0)]
    p3 = []
    for kind in ("o", "norm"):
        for gi in range(ng):
            p3.append((kind, gi, 0))
    for k in range((g["H"] + PSUM_COLS - 1) // PSUM_COLS):
        p3.append(("yproj", k, 0))
    grp = []
    for gi in range(ng):
        grp.append({"h0": groups[gi]["h0"], "n": groups[gi]["n"], "runs": groups[gi]["runs"]})
    return {"A": A, "c0": c0, "grp": grp, "index": index, "items": {"p1": p1, "chain": chain, "p3": p3}}


def _p1_item(g, c, T, item):
    """State-independent work of a tile (module docstring step 4)."""
    kind, gi, k = item[0], item[1], item[2]
    D, hv, hk, mdt, idt = g["D"], g["hv"], g["hk"], g["mdt"], g["idt"]
    A, c0 = T["A"], T["c0"]
    W, q32, qkm = A["W"], A["q32"], A["qkm"]
    gto = (c0 // TILE) * NC * hv        # this tile's columns in A["gt"]
    if kind == "shared":
        # [K K^T | K Q^T] per key head (key index on partitions), token-major k and gate columns
        kkq = []
        kkb = []
        for kh in range(hk):
            if kh % 2 == 0:
                ps, pb = _ps(c, P, [2, 2, TILE])
                kkb.append(pb)
            nisa.nc_matmul(dst=ps[:, kh % 2, :, :], stationary=qkm[:, kh, 0, c0:c0 + TILE],
                           moving=qkm[:, kh, :, c0:c0 + TILE], accumulate=False)
            kkq.append([c["psum"]["banks"][pb], (kh % 2) * 2 * TILE])    # (bank, element offset)
        kt_ps, pb = _ps(c, P, [hk, D])
        for kh in range(hk):
            nisa.nc_matmul(dst=kt_ps[:, kh, :], stationary=qkm[:, kh, 0, c0:c0 + TILE], moving=c["I_m"][0:D, 0:D],
                           accumulate=False)
        kt = nl.ndarray((P, hk, D), F32, buffer=nl.sbuf, name="k_tok")
        nisa.activation(dst=kt, op=nl.copy, data=kt_ps)
        _ps_free(c, pb)
        T["kkq"] = kkq
        T["kkb"] = kkb
        T["kt"] = kt

        return
    G = T["grp"][gi]
    h0, n, runs = G["h0"], G["n"], G["runs"]
    if kind == "pa":
        # P^T = (K Q^T) Gamma^T, A^T = (K K^T) beta_i Gamma^T (key-head products shared by its value heads)
        dec = A["decays"][c0 // TILE][gi]
        pT = nl.ndarray((P, n, TILE), mdt, buffer=nl.sbuf, name="pT")
        aT = nl.ndarray((P, n, TILE), idt, buffer=nl.sbuf, name="aT")
        for run in runs:
            kk, i0, i1 = run[0], run[1], run[2]
            m = i1 - i0
            bank, off = T["kkq"][kk][0], T["kkq"][kk][1]
            nisa.tensor_tensor(dst=pT[:, i0:i1, :], data1=_bview(bank, P, [[0, m], [1, TILE]], off + TILE),
                               data2=dec[0][:, i0:i1, :], op=nl.multiply, engine=DVE_ENG)
            nisa.tensor_tensor(dst=aT[:, i0:i1, :], data1=_bview(bank, P, [[0, m], [1, TILE]], off),
                               data2=dec[1][:, i0:i1, :], op=nl.multiply, engine=DVE_ENG)
        G["pT"] = pT
        A["decays"][c0 // TILE][gi] = None
        G["inv"] = inverse_open(aT, n, idt, mdt)
        if gi == len(T["grp"]) - 1:
            for pb in T["kkb"]:
                _ps_free(c, pb)
            T["kkq"] = None
            T["kkb"] = None
    elif kind == "inv":
        inverse_stage(c, G["inv"], k)
    elif kind == "tok":
        # beta v (token-major), beta exp(G) k, exp(G_C - G) k
        kt, gt = T["kt"], A["gt"]
        vt_ps, pb = _ps(c, P, [n, D])
        for i in range(n):
            nisa.nc_matmul(dst=vt_ps[:, i, :], stationary=A["cv"][:, h0 + i, c0:c0 + TILE],
                           moving=c["I_m"][0:D, 0:D], accumulate=False)
        bv = nl.ndarray((P, n, D), mdt, buffer=nl.sbuf, name="beta_v")
        nisa.tensor_tensor(dst=bv, data1=vt_ps, data2=_bview(gt, P, [[1, n], [0, D]], gto + C_BETA * hv + h0),
                           op=nl.multiply, engine=DVE_ENG)
        _ps_free(c, pb)
        bgk = nl.ndarray((P, n, D), mdt, buffer=nl.sbuf, name="beta_gamma_k")
        ktl = nl.ndarray((P, n, D), mdt, buffer=nl.sbuf, name="decayed_k")
        for run in runs:
            kk, i0, i1 = run[0], run[1], run[2]
            m = i1 - i0
            nisa.tensor_tensor(dst=bgk[:, i0:i1, :], data1=_bview(kt, P, [[0, m], [1, D]], kk * D),
                               data2=_bview(gt, P, [[1, m], [0, D]], gto + C_BG * hv + h0 + i0), op=nl.multiply,
                               engine=DVE_ENG)
            nisa.tensor_tensor(dst=ktl[:, i0:i1, :], data1=_bview(kt, P, [[0, m], [1, D]], kk * D),
                               data2=_bview(gt, P, [[1, m], [0, D]], gto + C_DEC * hv + h0 + i0), op=nl.multiply,
                               engine=DVE_ENG)
        G["bv"] = bv
        G["bgk"] = bgk
        G["ktl"] = ktl
        if gi == len(T["grp"]) - 1:
            T["kt"] = None
    elif kind == "gamma":
        # exp(G) broadcast over the D partitions (PSUM), exp(G) Q^T (fp32) straight from it, and the two
        # blocks' exp(G_C) columns (the chain's state decay)
        gb_ps, pb = _ps(c, D, [n, TILE])
        _broadcast_rows(c, gb_ps, A["gam_rows"][:, 0, c0:c0 + TILE], h0, n, D)
        gq = nl.ndarray((D, n, TILE), F32, buffer=nl.sbuf, name="gamma_q")
        for run in runs:
            kk, i0, i1 = run[0], run[1], run[2]
            m = i1 - i0
            nisa.tensor_tensor(dst=gq[:, i0:i1, :], data1=_bview(q32, D, [[0, m], [1, TILE]], kk * W + c0),
                               data2=gb_ps[:, i0:i1, :], op=nl.multiply, engine=DVE_ENG)
        gam = nl.ndarray((D, n, 2), F32, buffer=nl.sbuf, name="gamma_c")
        nisa.tensor_copy(dst=gam, src=c["psum"]["banks"][pb].ap(pattern=[[PSUM_COLS, D], [TILE, n], [BLOCK, 2]],
                                                                 offset=BLOCK - 1), engine=DVE_ENG)
        _ps_free(c, pb)
        G["gam"] = gam
        G["gq"] = gq
    elif kind == "uw":
        # U = X^T (beta V) stays in PSUM (V_new accumulates onto it); -W^T = -(beta gamma K)^T X (fp32)
        x = G["inv"]["x"]
        vn_ps, vnb = _ps(c, P, [n, D])
        wt_ps, pb = _ps(c, D, [n, TILE])
        for h in range(n):
            nisa.nc_matmul(dst=vn_ps[:, h, :], stationary=x[:, h, :], moving=G["bv"][:, h, :], accumulate=False)
            nisa.nc_matmul(dst=wt_ps[:, h, :], stationary=G["bgk"][:, h, :], moving=x[:, h, :], accumulate=False)
        nmw = nl.ndarray((D, n, TILE), F32, buffer=nl.sbuf, name="neg_w_t")
        nisa.activation(dst=nmw, op=nl.copy, data=wt_ps, scale=-1.0)
        _ps_free(c, pb)
        G["vn_ps"] = vn_ps
        G["vnb"] = vnb
        G["nmw"] = nmw
        G["inv"] = None
        G["bv"] = None
        G["bgk"] = None


def _chain_item(g, c, T, S, item):
    """One step of the recurrence for every head group; ``S`` (list of [D, n, D] fp32 states, one per group)
    is updated in place at the "st" steps. "ws": V_new = U - W S (into PSUM) and its eviction; "st":
    S <- exp(G_C) S + (exp(G_C - G) K)^T V_new."""
    kind, r0 = item[0], item[1]
    D, mdt = g["D"], g["mdt"]
    r1 = r0 + BLOCK
    for gi in range(len(T["grp"])):
        G = T["grp"][gi]
        n = G["n"]
        if kind == "ws":
            if r0 == 0:
                G["S0"] = S[gi]
                G["vnew"] = nl.ndarray((P, n, D), mdt, buffer=nl.sbuf, name="v_new")
            else:
                G["S1"] = S[gi]
            for h in range(n):
                nisa.nc_matmul(dst=G["vn_ps"][r0:r1, h, :], stationary=G["nmw"][:, h, r0:r1], moving=S[gi][:, h, :],
                               accumulate=True)
            nisa.tensor_copy(dst=G["vnew"][r0:r1, :, :], src=G["vn_ps"][r0:r1, :, :], engine=DVE_ENG)
            if r0 == BLOCK:
                _ps_free(c, G["vnb"])
        else:
            st_ps, pb = _ps(c, D, [n, D])
            for h in range(n):
                nisa.nc_matmul(dst=st_ps[:, h, :], stationary=G["ktl"][r0:r1, h, :], moving=G["vnew"][r0:r1, h, :],
                               accumulate=False)
            sd = nl.ndarray((D, n, D), F32, buffer=nl.sbuf, name="state_decayed")
            for h in range(n):
                nisa.activation(dst=sd[:, h, :], op=nl.copy, data=S[gi][:, h, :],
                                scale=G["gam"][:, h, r0 // BLOCK:r0 // BLOCK + 1])
            s_new = nl.ndarray((D, n, D), F32, buffer=nl.sbuf, name="state")
            nisa.tensor_tensor(dst=s_new, data1=sd, data2=st_ps, op=nl.add, engine=DVE_ENG)
            _ps_free(c, pb)
            S[gi] = s_new
            if r0 == BLOCK:
                G["vn_ps"] = None
                G["nmw"] = None
                G["ktl"] = None


def _p3_item(g, c, T, item, wo, y, eps):
    """Output of a tile: O^T = S^T (gamma Q)^T + V_new^T P^T, gated RMSNorm (channel-major), out_proj."""
    kind, gi = item[0], item[1]
    D, H, adt = g["D"], g["H"], g["adt"]
    A, c0 = T["A"], T["c0"]
    if kind == "o":
        G = T["grp"][gi]
        n = G["n"]
        o_ps, pb = _ps(c, D, [n, TILE])
        for h in range(n):
            nisa.nc_matmul(dst=o_ps[:, h, 0:BLOCK], stationary=G["S0"][:, h, :], moving=G["gq"][:, h, 0:BLOCK],
                           accumulate=False)
            nisa.nc_matmul(dst=o_ps[:, h, BLOCK:TILE], stationary=G["S1"][:, h, :], moving=G["gq"][:, h, BLOCK:TILE],
                           accumulate=False)
            nisa.nc_matmul(dst=o_ps[:, h, :], stationary=G["vnew"][:, h, :], moving=G["pT"][:, h, :],
                           accumulate=True)
        oa = nl.ndarray((D, n, TILE), adt, buffer=nl.sbuf, name="o")
        nisa.activation(dst=oa, op=nl.copy, data=o_ps)
        _ps_free(c, pb)
        G["oa"] = oa
        for key in ("S0", "S1", "gq", "vnew", "pT", "gam"):
            G[key] = None
    elif kind == "norm":
        G = T["grp"][gi]
        n, h0, oa = G["n"], G["h0"], G["oa"]
        sq = nl.ndarray((D, n, TILE), F32, buffer=nl.sbuf, name="o_sq")
        nisa.activation(dst=sq, op=nl.square, data=oa)
        ss, pb = _ps(c, D, [n, TILE])
        nisa.nc_matmul(dst=ss, stationary=c["ones_d"], moving=sq, accumulate=False)
        rstd = nl.ndarray((D, n, TILE), F32, buffer=nl.sbuf, name="o_rstd")
        nisa.activation(dst=rstd, op=nl.rsqrt, data=ss, scale=1.0 / D, bias=float(eps))
        _ps_free(c, pb)
        yn = nl.ndarray((D, n, TILE), F32, buffer=nl.sbuf, name="o_norm")
        nisa.tensor_tensor(dst=yn, data1=oa, data2=rstd, op=nl.multiply, engine=DVE_ENG)
        yg = nl.ndarray((D, n, TILE), adt, buffer=nl.sbuf, name="o_gated")
        nisa.scalar_tensor_tensor(dst=yg, data=yn, op0=nl.multiply, operand0=c["wn"], op1=nl.multiply,
                                  operand1=A["sz"][:, h0:h0 + n, c0:c0 + TILE])
        G["yg"] = yg
        G["oa"] = None
    elif kind == "yproj":
        k = gi
        nk = (H + PSUM_COLS - 1) // PSUM_COLS
        n0 = k * PSUM_COLS
        n1 = min(H, n0 + PSUM_COLS)
        ps, pb = _ps(c, TILE, [n1 - n0])
        first = True
        for G in T["grp"]:
            for h in range(G["n"]):
                nisa.nc_matmul(dst=ps, stationary=G["yg"][:, h, :], moving=wo[:, G["h0"] + h, n0:n1],
                               accumulate=not first)
                first = False
        ysb = c["y_ring"][k][:, 0:n1 - n0]       # fixed buffers: a chunk's DMA has a whole tile to drain
        # the eviction also sums the chunk's rows (free on both engines): the finite flag covers y
        col = c["y_sums"][:, T["index"] * nk + k:T["index"] * nk + k + 1]
        if k % 2 == 0:
            nisa.activation(dst=ysb, op=nl.copy, data=ps, reduce_op=nl.add, reduce_res=col,
                            reduce_cmd=nisa.reduce_cmd.reset_reduce)
        else:
            nisa.tensor_scalar_reduce(dst=ysb, data=ps, op0=nl.multiply, operand0=1.0, reduce_op=nl.add,
                                      reduce_res=col)
        _ps_free(c, pb)
        t0 = A["t0"] + c0
        nv = min(TILE, A["t0"] + A["vs"] - t0)
        nisa.dma_copy(dst=y[t0:t0 + nv, n0:n1], src=ysb[0:nv, :], dge_mode=nisa.dge_mode.swdge)
        if k == nk - 1:
            for G in T["grp"]:
                G["yg"] = None


def _emit(g, c, kind, T, upto, S, wo, y, eps):
    """Emit the items of stream ``kind`` ("p1", "chain", "p3") of tile context T up to index ``upto``."""
    items = T["items"][kind]
    pos = T["pos_" + kind] if ("pos_" + kind) in T else 0
    while pos < upto:
        if kind == "p1":
            _p1_item(g, c, T, items[pos])
        elif kind == "chain":
            _chain_item(g, c, T, S, items[pos])
        else:
            _p3_item(g, c, T, items[pos], wo, y, eps)
        pos += 1
    T["pos_" + kind] = pos


def _run_tiles(g, c, xT, hist, S, groups, wo, y, eps, neg):
    """Every tile of the launch, software-pipelined in program order (each engine runs its instructions in
    program order, so independent work must sit between an instruction and its consumer on another engine).
    Step t interleaves, item by item: the chain of tile t, the second half of the state-independent work
    (P1: decays, inverse, U, W) of tile t+1 and the first half of tile t+2's (two independent inverse chains),
    the output (P3) of tile t-1, and -- as PE filler -- the projections and conv of the next super-tile
    (stage A). Returns the last super-tile's context (its ``tail`` holds the final window)."""
    L = g["L"]
    sw = g["super"] * TILE
    n_super = (L + sw - 1) // sw
    tiles = []                       # (super-tile, column) of every tile
    for s in range(n_super):
        vs = min(sw, L - s * sw)
        for tl in range((vs + TILE - 1) // TILE):
            tiles.append((s, tl * TILE))
    nt = len(tiles)
    Wm = g["super"] * TILE
    c["x_buf"] = nl.ndarray((P, g["J"], Wm), g["adt"], buffer=nl.sbuf, name="x_tile")   # fixed: never fragments
    c["u_ring"] = []
    for k in range(2):
        c["u_ring"].append(nl.ndarray((g["D"], g["NH"], g["Km1"] + Wm), g["adt"], buffer=nl.sbuf, name="u_raw"))
    c["y_sums"] = nl.ndarray((TILE, nt * ((g["H"] + PSUM_COLS - 1) // PSUM_COLS)), F32, buffer=nl.sbuf,
                             name="y_row_sums")
    # P1 two tiles ahead (two independent inverse chains) -- one tile ahead with two head groups (they are
    # the second chain) or in fp32 (twice the bytes in flight)
    ahead = 2 if (len(groups) == 1 and g["adt"] != F32) else 1
    ctxs = [_a_open(g, c, xT, 0, hist)]
    _a_fill(g, c, ctxs[0], -1.0, neg)
    if n_super > 1:
        ctxs.append(_a_open(g, c, xT, 1, ctxs[0]))
    Ts = []
    for t in range(nt):
        Ts.append(None)

    for t in range(-1, nt + 1):
        # open tiles t+1 .. t+ahead (a tile's super-tile must have completed stage A)
        for u in range(t + 1, t + 1 + ahead):
            if u < nt and u >= 0 and Ts[u] == None:
                su = tiles[u][0]
                if not ctxs[su]["complete"]:
                    _a_fill(g, c, ctxs[su], -1.0, neg)
                if len(ctxs) == su + 1 and su + 1 < n_super:
                    ctxs.append(_a_open(g, c, xT, su + 1, ctxs[su]))
                if su >= 1:
                    ctxs[su - 1] = None                  # the tile contexts hold what they need
                Ts[u] = _t_open(g, ctxs[su], tiles[u][1], groups, u)
        # this step's streams and their target positions
        jobs = []                                        # [tile context, stream, target]
        if t + 1 < nt and t + 1 >= 0:
            jobs.append([Ts[t + 1], "p1", len(Ts[t + 1]["items"]["p1"])])
        if ahead == 2 and t + 2 < nt:
            jobs.append([Ts[t + 2], "p1", len(Ts[t + 2]["items"]["p1"]) // 2])
        if t >= 0 and t < nt:
            jobs.append([Ts[t], "chain", len(Ts[t]["items"]["chain"])])
        if t >= 1:
            jobs.append([Ts[t - 1], "p3", len(Ts[t - 1]["items"]["p3"])])
        starts = []
        R = 1
        for job in jobs:
            key = "pos_" + job[1]
            p0 = job[0][key] if key in job[0] else 0
            starts.append(p0)
            R = max(R, job[2] - p0)
        # PE filler: the stage A being prepared, spread over the steps before its first tile's P1 opens
        filler = None
        for k in range(len(ctxs)):
            if ctxs[k] != None and not ctxs[k]["complete"] and filler == None:
                filler = ctxs[k]
        budget = 0.0
        if filler != None:
            first = nt
            for k in range(nt - 1, -1, -1):
                if tiles[k][0] == filler["s"]:
                    first = k
            steps_left = max(1, first - ahead - t)
            budget = _a_remaining(g, filler) / (steps_left * R)
        for r in range(R):
            for i in range(len(jobs)):
                job = jobs[i]
                n = job[2] - starts[i]
                _emit(g, c, job[1], job[0], starts[i] + -(-(r + 1) * n // R), S, wo, y, eps)
            _a_fill(g, c, filler, budget, neg)
        if t >= 1:
            Ts[t - 1] = None
    return ctxs[len(ctxs) - 1]


# ---------------------------------------------------------------------------------------------
# body
# ---------------------------------------------------------------------------------------------

def gdn_prefill_body(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, write_slot, y,
                     eps, allow_neg_eigval):
    """Body of one core: feature-major normed input ``xT [128, H/128, L]`` (HBM, activation dtype) + HBM
    weights (:func:`nki_kernels.gdn.gdn_weight_layout`) + decode state -> this core's out_proj partial written
    to ``y [L, H]`` (HBM float32), the window and recurrent state after token L-1 written to slot
    ``write_slot`` (this core's heads / owned window columns). Starts from slot ``read_slot``; both are
    run-time ``[1, 1]`` int32 HBM tensors. eps: gated-norm epsilon; allow_neg_eigval: beta = 2 sigmoid(b)
    (fp32 inverse). Returns ``finite [1, 1]`` float32 SBUF (1.0 when the final state and y are finite).
    """
    pdim, J, L = xT.shape
    adt = xT.dtype
    n_cores, _, Jw, Ncol = w_in.shape
    _, D, NH, K = conv_w.shape
    hv_r = A_log.shape[0]
    slots, hv_r2, Dk, Dv = state.shape
    C_rank = window.shape[2]
    H = J * P
    n_launch, core = program_sharding()
    kernel_assert(pdim == P and L >= 1, f"gdn_prefill: xT has shape {xT.shape}, expected [{P}, H/{P}, L]")
    kernel_assert(n_cores == n_launch, f"gdn_prefill: weights are laid out for {n_cores} cores but the launch has "
                                       f"{n_launch} (gdn_weight_layout(lnc=...) must match kernel[lnc])")
    kernel_assert(Jw == J and Dk == D and Dv == D and hv_r2 == hv_r and window.shape[1] == K - 1
                  and window.shape[0] == slots,
                  f"gdn_prefill: inconsistent shapes: xT {xT.shape}, w_in {w_in.shape}, conv_w {conv_w.shape}, "
                  f"state {state.shape}, window {window.shape}")
    kernel_assert(tuple(y.shape) == (L, H), f"gdn_prefill: y has shape {y.shape}, expected [{L}, {H}]")
    kernel_assert(D <= P, f"gdn_prefill: head dim {D} exceeds {P} partitions")
    kernel_assert(L * H <= INT32_MAX and slots * hv_r * D * D <= INT32_MAX and slots * (K - 1) * C_rank <= INT32_MAX,
                  "gdn_prefill: a tensor's element offsets exceed int32")
    kd_r = (C_rank - hv_r * D) // 2
    hk_r = kd_r // D
    s = core_split(hk_r, hv_r, n_cores, core)
    hv, hk, vh0, kh0 = s["hv_c"], s["hk_c"], s["vh0"], s["kh0"]
    kernel_assert(NH == 2 * hk + hv and Ncol == NH * D + hv * D + 2 * hv,
                  f"gdn_prefill: w_in has {Ncol} columns / conv_w {NH} heads, expected q|k|v|z|b|a of {hk} key and "
                  f"{hv} value heads of {D}")
    kernel_assert(hk * D <= PSUM_COLS and 3 * hv <= PSUM_COLS, f"gdn_prefill: {hk} key heads x {D} exceed a PSUM bank")
    neg = bool(allow_neg_eigval)
    mdt = adt
    idt = F32 if (neg or adt == F32) else adt
    Km1 = K - 1
    g = {"J": J, "L": L, "D": D, "NH": NH, "K": K, "Km1": Km1, "H": H, "hv": hv, "hk": hk, "vh0": vh0,
         "kh0": kh0, "core": core, "runs": s["runs"], "adt": adt, "mdt": mdt, "idt": idt,
         "cb": NH * D + hv * D, "groups": head_groups(hv, s["runs"])}

    # ---- run-time slots, carried window (channel-major) and state ------------------------------
    rs = nisa.register_alloc()
    nisa.register_load(rs, read_slot)
    wsl = nisa.register_alloc()
    nisa.register_load(wsl, write_slot)
    hist = nl.ndarray((D, NH, Km1), adt, buffer=nl.sbuf, name="window_in")
    reads = [
        nisa.dma_copy(dst=hist[:, 0:hk, :], src=window.ap(pattern=[[1, D], [D, hk], [C_rank, Km1]],
                                                          offset=kh0 * D, scalar_offset=rs, indirect_dim=0)),
        nisa.dma_copy(dst=hist[:, hk:2 * hk, :], src=window.ap(pattern=[[1, D], [D, hk], [C_rank, Km1]],
                                                               offset=kd_r + kh0 * D, scalar_offset=rs,
                                                               indirect_dim=0)),
        nisa.dma_copy(dst=hist[:, 2 * hk:NH, :], src=window.ap(pattern=[[1, D], [D, hv], [C_rank, Km1]],
                                                               offset=2 * kd_r + vh0 * D, scalar_offset=rs,
                                                               indirect_dim=0)),
    ]
    groups = g["groups"]
    S = []
    for grp in groups:
        t = nl.ndarray((D, grp["n"], D), F32, buffer=nl.sbuf, name="state_in")
        reads.append(nisa.dma_copy(dst=t, src=state.ap(pattern=[[D, D], [D * D, grp["n"]], [1, D]],
                                                       offset=(vh0 + grp["h0"]) * D * D, scalar_offset=rs,
                                                       indirect_dim=0)))
        S.append(t)
    if s["shared"]:
        # both cores read a shared key head's window columns; only its owner writes them
        nisa.core_barrier(data=window, cores=(0, 1))

    isz = 2 if adt == nl.bfloat16 else 4
    kernel_assert(2 * hv <= D, f"gdn_prefill: the b|a group ({2 * hv} columns) must fit a head's {D}")
    g["super"] = super_tiles(isz, hv)
    fixed = hv * H * isz + NH * K * D * isz + W_RING * J * D * isz      # w_out, conv taps, weight ring
    kernel_assert(fixed <= FIXED_SBUF_MAX,
                  f"gdn_prefill: {fixed // 1024} KB per partition of resident weights ({hv} value heads per core, "
                  f"{adt}) leave too little SBUF for the tiles in flight (at most {FIXED_SBUF_MAX // 1024} KB); "
                  f"use LNC=2 or bfloat16")
    c = _constants(g, conv_w, A_log, dt_bias, norm_w)
    c["psum"] = psum_pool()
    c["w_in"] = w_in
    c["w_ring"] = []
    for r in range(W_RING):
        c["w_ring"].append(nl.ndarray((P, J, D), adt, buffer=nl.sbuf, name="w_in_group"))
    c["w_next"] = 0
    c["y_ring"] = []
    for k in range((H + PSUM_COLS - 1) // PSUM_COLS):
        c["y_ring"].append(nl.ndarray((TILE, PSUM_COLS), F32, buffer=nl.sbuf, name="y_chunk"))
    wo = nl.ndarray((D, hv, H), adt, buffer=nl.sbuf, name="w_out")
    nisa.dma_copy(dst=wo, src=w_out[core])

    # ---- super-tiles, tiles, blocks (software-pipelined) ------------------------------------
    last = _run_tiles(g, c, xT, hist, S, groups, wo, y, eps, neg)

    # ---- decode-state slot: final window (raw u of the last K-1 tokens) and state --------------
    u = last["tail"]
    o0, o1 = s["own"]
    if o1 > o0:
        for part in range(2):
            wr = nisa.dma_copy(dst=window.ap(pattern=[[1, D], [D, o1 - o0], [C_rank, Km1]],
                                             offset=part * kd_r + (kh0 + o0) * D, scalar_offset=wsl, indirect_dim=0),
                               src=u[:, part * hk + o0:part * hk + o1, :])
            _after(wr, reads)
    wr = nisa.dma_copy(dst=window.ap(pattern=[[1, D], [D, hv], [C_rank, Km1]], offset=2 * kd_r + vh0 * D,
                                     scalar_offset=wsl, indirect_dim=0),
                       src=u[:, 2 * hk:NH, :])
    _after(wr, reads)
    tot, pb = _ps(c, 1, [1])
    for gi in range(len(groups)):
        grp = groups[gi]
        wr = nisa.dma_copy(dst=state.ap(pattern=[[D, D], [D * D, grp["n"]], [1, D]], offset=(vh0 + grp["h0"]) * D * D,
                                        scalar_offset=wsl, indirect_dim=0), src=S[gi])
        _after(wr, reads)
        # finite flag: 0 * sum(S) == 0 exactly when every element is finite (NaN and +-Inf give NaN)
        rsum = nl.ndarray((D, 1), F32, buffer=nl.sbuf, name="state_sum")
        nisa.tensor_reduce(dst=rsum, op=nl.add, data=S[gi], axis=(1, 2))
        nisa.nc_matmul(dst=tot, stationary=c["ones_d"][:, 0:1], moving=rsum, accumulate=gi > 0)
    ysum = nl.ndarray((TILE, 1), F32, buffer=nl.sbuf, name="y_sum")
    nisa.tensor_reduce(dst=ysum, op=nl.add, data=c["y_sums"], axis=(1,))
    nisa.nc_matmul(dst=tot, stationary=c["ones_col"], moving=ysum, accumulate=True)
    fin = nl.ndarray((1, 1), F32, buffer=nl.sbuf, name="finite")
    nisa.tensor_scalar(dst=fin, data=tot, op0=nl.multiply, operand0=0.0, op1=nl.equal, operand1=0.0)
    return fin


@nki.jit
def gdn_prefill_kernel(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, write_slot,
                       eps=1e-6, allow_neg_eigval=False):
    """HBM wrapper: ``xT [128, H/128, L]`` (feature-major, activation dtype; :func:`feature_major`), weights in
    the layout of :func:`nki_kernels.gdn.gdn_weight_layout` for this launch's LNC, ``window [slots, K-1, C_rank]``,
    ``state [slots, Hv_r, D, D]`` float32 (slot ``write_slot`` written in place), ``read_slot`` / ``write_slot``
    ``[1, 1]`` int32, eps (gated-norm epsilon), allow_neg_eigval (compile-time bool).
    Returns ``(y [n_cores, L, H] float32 per-core partials, state, window, finite [n_cores, 1] float32)``.
    """
    _, J, L = xT.shape
    n = w_in.shape[0]
    kernel_assert(n * L * J * P <= INT32_MAX, f"gdn_prefill: y [{n}, {L}, {J * P}] has element offsets beyond int32")
    y_out = nl.ndarray((n, L, J * P), F32, buffer=nl.shared_hbm, name="y_partials")
    fin_out = nl.ndarray((n, 1), F32, buffer=nl.shared_hbm, name="finite")
    _, core = program_sharding()
    fin = gdn_prefill_body(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, write_slot,
                           y_out[core], eps, allow_neg_eigval)
    nisa.dma_copy(dst=fin_out[core:core + 1, :], src=fin)
    return y_out, state, window, fin_out


# ---------------------------------------------------------------------------------------------
# host-side helpers (plain torch / numpy, never traced)
# ---------------------------------------------------------------------------------------------

def feature_major(x):
    """Token-major normed input ``x [L, H]`` -> the kernel's ``xT [128, H/128, L]`` (same dtype, torch)."""
    import torch
    from nki_kernels.host import as_torch
    x = as_torch(x)
    L, H = x.shape
    if H % P:
        raise ValueError(f"feature_major: hidden size {H} is not a multiple of {P}")
    return x.t().reshape(H // P, P, L).permute(1, 0, 2).contiguous()


def check_finite(finite, what="gdn_prefill"):
    """Raise ``FloatingPointError`` when a launch's ``finite`` flags report a non-finite state."""
    from nki_kernels.host import as_torch
    f = as_torch(finite).float().reshape(-1)
    if not bool((f == 1.0).all()):
        bad = [i for i in range(f.numel()) if float(f[i]) != 1.0]
        raise FloatingPointError(f"{what}: non-finite recurrent state on core(s) {bad}: NaN or Inf in the input "
                                 f"(xT, the carried window or the carried state) or an overflow")


# ---------------------------------------------------------------------------------------------
# demo arguments at real shapes (trace reports, cost model)
# ---------------------------------------------------------------------------------------------

def kernel_shapes(cfg, tp=4, L=1024, lnc=2, dtype="bfloat16", slots=2):
    """Name -> (shape, dtype) of gdn_prefill_kernel's tensor arguments for one rank of ``cfg`` (ModelConfig-like)."""
    from nki_kernels.gdn import kernel_shapes as decode_shapes
    d = decode_shapes(cfg, tp=tp, T=1, lnc=lnc, dtype=dtype, slots=slots)
    H = cfg.hidden_size
    out = {"xT": ((P, H // P, L), dtype)}
    for name in ("w_in", "conv_w", "A_log", "dt_bias", "norm_w", "w_out", "window", "state", "read_slot"):
        out[name] = d[name]
    out["write_slot"] = ((1, 1), "int32")
    return out
