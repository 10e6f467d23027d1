"""Vocabulary-parallel LM head + greedy argmax for one physical core.

The vocabulary is split over all TP x LNC = 8 physical cores (nki_kernels/README.md); core g holds
rows ``g*Vc .. (g+1)*Vc - 1`` of ``lm_head.weight`` (Vc = 31,040 for Qwen3.6). For the T tokens of a
launch the core computes its logits, rounds them to the activation dtype (exactly what
``F.linear(h, W).float()`` yields in the bf16 model) and returns, per token, its best
``(value, index)``: the largest logit and the LOWEST vocabulary index holding it (torch.argmax).
The 8 per-core winners are combined with ONE collective by
:func:`nki_kernels.collectives.argmax_combine` (packed ``(value, index)``, trn2-costs finding #11).

Layouts
-------
* ``xT``  SBUF ``[P, KT, T]`` activation dtype, ``xT[p, j, t] = h[t, j*P + p]`` (the normed, feature-major
  layout of the README; KT = H / 128). The wrapper DMAs it from HBM.
* ``w``   HBM ``[P, KT*Vc]`` activation dtype, the core's shard in the *block-packed contraction-major*
  layout built by :func:`lm_head_layout`: the vocabulary is cut into blocks of NB = 512 columns (one
  PSUM bank, ``gemm_moving_fmax``); block ``[b0, b0+nb)`` occupies columns ``KT*b0 .. KT*(b0+nb)`` of
  every partition, element ``(p, KT*b0 + j*nb + n) = W[b0 + n, j*P + p]``. One block is therefore ONE
  DMA with a single contiguous 16 KiB run per partition (KT*nb*2 B) -- no short descriptors.
* result ``best`` SBUF ``[T, 2]`` float32: ``best[t] = (max logit, index_base + local index)``; the index
  is an integer held exactly in fp32 (< 2^24).

Algorithm (per core)
--------------------
1. For each vocab block: one weight DMA; KT matmuls ``psum[T, nb] += xT[:, j, :].T @ w_blk[:, j, :]``
   (the weight is the moving operand, 512 columns per instruction, fp32 PSUM accumulation); one ACT
   eviction that rounds the logits to the activation dtype (``lg [T, nb]``, SBUF).
2. Put the vocabulary on partitions: each 128-column chunk c of ``lg`` is transposed by the PE into
   ``lt[:, c*S + t]`` of ONE PSUM tile ``lt [128, Cp*S]`` (fp32; S = token stride, the next power of two
   >= T so no write straddles a bank). bf16: a matmul of the chunk against a ``[T, T]`` identity (exact:
   bf16 x 1.0 summed in fp32) -- a bf16 PSUM transpose fails the hardware verifier at T = 1 (trn2-costs
   pitfalls) and a bf16 -> fp32 staging copy would cost a DVE pass. fp32 (test dtype): ``nc_transpose``
   (bit-exact), each chunk evicted into its own dense tile because the PE transpose needs a source
   whose partition stride equals its free size (trn2-costs pitfalls); fp32 matmul is a two-pass
   LOW/HIGH decomposition whose exactness against an identity is not documented. Entry ``(p, c)`` is local vocab ``c*128 + p``.
   Columns no transpose fills (a partial last chunk, padding up to max8's minimum of 8) hold -FLT_MAX.
   Sampling (optional ``noise``, ``harness.sampling``'s shared Gumbel noise, pre-scaled by the temperature):
   ONE DVE add ``scores[p, c*T + t] = lt[p, c*S + t] + noise[p, c*T + t]`` (fp32, into SBUF; the noise
   DMA rides behind the first weight block), and the scan below runs on ``scores``: the index is the
   Gumbel-max sample argmax(logit + T*g), lowest index on ties. Greedy launches have no such op.
3. Scan on all 128 partitions (trn2-costs finding #4): per token one ``max8`` and one ``nc_find_index8``
   over ``[128, Cp]`` (Cp = 243 at real shapes, instead of [1, 31040] on one lane); the first match is
   the lowest chunk c, i.e. the lowest vocab index within the partition.
4. Cross-partition: candidates (value, c*128 + p) are transposed to ``[T, 128]`` and reduced with
   max, then min over ``index + BIG*(value != max)`` -- the lowest index among equal maxima. No GpSimd
   ``tensor_partition_reduce`` (measured catastrophic).

Bytes at real shapes (Vc = 31,040, H = 2,048, bf16): the weight stream is 31,040 x 2,048 x 2 B =
127.1 MB per core, read once -- the minimum (every weight multiplies the hidden once); xT adds
4 KiB per token. Instruction counts per core: 61 weight DMAs, 61 x 16 = 976 matmuls (N <= 512),
61 evictions, 243 transposes (hidden under the DMA-bound stream), 2T top-8 ops on [128, 243].

Pipelining: the weight blocks stream through a ring of W_BUFS = 4 SBUF buffers (block b's DMA waits only for block
b-4's matmuls; 64 KiB per partition at H = 2048, bf16). harness.costmodel, one rank (kernel[2]) at real shapes, bf16
(``python -m harness.bench kernel nki_kernels/lm_head.py::lm_head_argmax_kernel --arg xT=128,16,2:bfloat16 --arg
w=2,128,496640:bfloat16 --lnc 2``, shape-only, central (low - high)): 414.0 (382.0 - 1,002.8) / 414.8 (382.8 -
1,003.7) / 416.4 (384.4 - 1,005.3) us for T = 1 / 2 / 4 against a 400.5 us HBM roofline (254.3 MB at 635 GB/s per
rank; 97 %); the argmax tail after the last logits is ~2.5 us. With 2 buffers it is 433.5 (387.7 - 1,002.8) /
434.3 (388.5 - 1,003.7) / 435.9 (390.1 - 1,005.3) us: block b+2's DMA then waits for block b's 16 matmuls and
the ~1.3 us semaphore hand-off, so the PE sits on the stream's path; 3 buffers already give the central figures
above alone. The 4th is slack for other
work the round emits between the blocks (``between``, the MTP replay), whose PE instructions delay the blocks'
matmuls (bench/decode_speed.md lever 34). Under the measured 1.69x PE throttle (the band's high end) the head
becomes PE-bound: 16 x 31,040 moving columns per core is inherent to streaming the weight as the moving operand
(the weight-stationary alternative needs 3,880 matmuls).

fp8 draft head (opt-in, issue 15 lever "Draft LM head"; only for the DRAFTS, whose tokens the exact verify checks,
so greedy output is unchanged and only acceptance can drop). ``w`` holds ``FP8`` (``float8_e4m3``) codes of the head
rows quantised with ONE scale s per core shard (:func:`quantize_head`: max |W| / 240, round to nearest even) and the
bf16 xT stays the stationary operand (nc_matmul inputs may differ in dtype except fp32/tf32, nki-reference.md); PSUM
holds x . codes in fp32 and the ACT eviction multiplies by s (``activation(scale=)``, a ``[T, 1]`` fp32 column,
DMA'd once from ``w_scale``) before the rounding to bf16, so logits -- and the Gumbel noise added to them when
sampling -- are in the original units. Why one scale per shard: each core's argmax is invariant to its positive
scale and the eviction undoes it for free; e4m3 keeps 3 mantissa bits at any scale, so per-row scales would only
help rows far below the largest (below 2^-6 s the codes are subnormal) and would cost a DVE multiply per block on
the path (the per-row scale runs along the free axis of ``lg``). Bytes halve (63.6 MB per core, 8 KiB blocks) but
the 16 matmuls x 512 moving columns per block are unchanged, so the PE binds: block b's transposes are therefore
emitted after block b+1's matmuls (otherwise the in-order PE waits for every block's ACT eviction: 344.3 us central,
one rank, T = 1). harness.costmodel, one rank, same command with ``--arg w=2,128,496640:float8_e4m3 --arg
w_scale=2,128,1:float32``: 281.7 (278.2 - 780.8) / 282.5 (279.0 - 781.6) / 284.1 (280.6 - 783.2) us for T = 1 / 2 /
4 (bf16: 414.0 / 414.8 / 416.4), PE busy 269.5 us (976 matmuls 246.7 + 243 transposes), HBM roofline 200.2 us. The
bf16 and fp32 paths emit exactly as before.
"""

from __future__ import annotations

import torch

from model.tp.moe import quantize_channels
import nki
import nki.isa as nisa
import nki.language as nl
from nki_kernels.common import MOVING_MAX, P, program_sharding
from nki_kernels.host import as_torch
from nki_kernels.moe import FP8, kernel_table

NB = MOVING_MAX          # vocab columns per matmul: the moving free size = one PSUM bank of fp32
W_BUFS = 4               # weight-block ring depth (16 KiB per partition each at H = 2048, bf16); see module doc
TOP8_MIN = 8             # max8 / nc_find_index8 need >= 8 elements per partition (SDK-ISA)
FP32_MIN = -3.4028234663852886e38
BIG_INDEX = 16777216.0   # 2^24 > any index: the penalty that removes non-maximal candidates


# ---- geometry (shared by kernel and host helpers) -------------------------------------------------
def vocab_blocks(vc: int):
    """[(start, size)] of the NB-column blocks covering a core's ``vc`` vocabulary rows."""
    blocks = []
    for b0 in range(0, vc, NB):
        blocks.append((b0, min(NB, vc - b0)))
    return blocks


def scan_geometry(vc: int, T: int):
    """(C, Cp, S): 128-row chunks of the vocab, chunks padded to max8's minimum, token stride in lt."""
    C = -(-vc // P)
    S = 1
    while S < T:
        S *= 2
    return C, max(C, TOP8_MIN), S


# ---- shared SBUF helper ---------------------------------------------------------------------------
def select_max_lowest_index(out, vals, idx):
    """Per partition (token): the max of ``vals`` and the lowest ``idx`` holding it.

    out:  SBUF ``[T, 2]`` float32 -> (max value, its lowest index).
    vals: ``[T, n]`` float32 (SBUF or PSUM); idx: ``[T, n]`` float32 integer-valued (< 2^24), the index
    of each candidate (SBUF or PSUM; not both in PSUM). Exact: comparisons and an integer min in fp32.
    """
    T, n = vals.shape[0], vals.shape[1]
    nisa.tensor_reduce(dst=out[:, 0:1], op=nl.maximum, data=vals, axis=1)
    pen = nl.ndarray((T, n), nl.float32, buffer=nl.sbuf, name="argmax_penalty")
    # pen = BIG where vals != max else 0; then + idx; then min -> lowest index among the maxima
    nisa.tensor_scalar(dst=pen, data=vals, op0=nl.not_equal, operand0=out[:, 0:1],
                       op1=nl.multiply, operand1=BIG_INDEX)
    nisa.tensor_tensor(dst=pen, data1=pen, data2=idx, op=nl.add)
    nisa.tensor_reduce(dst=out[:, 1:2], op=nl.minimum, data=pen, axis=1)
    return out


# ---- body -----------------------------------------------------------------------------------------
def ring_depth(w, KT: int) -> int:
    """Buffers of :func:`lm_head_argmax_body`'s weight ring for the shard ``w`` (HBM ``[P, KT*Vc]``)."""
    return min(W_BUFS, len(vocab_blocks(w.shape[1] // KT)))


def lm_head_ring(w, KT: int, tiles):
    """The first buffers of :func:`lm_head_argmax_body`'s weight ring for the shard ``w`` (HBM ``[P, KT*Vc]``), in
    ``tiles`` (SBUF ``[P, KT, min(NB, Vc)]`` of w's dtype, at most :func:`ring_depth`: e.g. ``common.carve`` of an idle
    arena),
    with the DMAs of their blocks issued now, for ``lm_head_argmax_body(..., ring=)``: a caller issues them before
    the body's inputs are ready, so they stream while those are computed (they depend on nothing else). Triggered
    from GpSimd (``dge_mode.swdge``): in a hardware-DGE queue these 2 MiB blocks would hold back the caller's later
    DMAs of that queue (the DMAs of one queue move in order, SDK nki-dma-overview.rst "DMA Queues")."""
    blocks = vocab_blocks(w.shape[1] // KT)
    if len(tiles) > ring_depth(w, KT):
        raise ValueError(f"lm_head: {len(tiles)} ring buffers, at most {ring_depth(w, KT)}")
    for i in range(len(tiles)):
        b0, nb = blocks[i]
        nisa.dma_copy(dst=tiles[i][:, :, 0:nb], src=w[:, KT * b0:KT * (b0 + nb)], dge_mode=nisa.dge_mode.swdge)
    return tiles


def transpose_block(lt, S, ident, logits_out, b0, nb, ps, lg):
    """Step 2 of the module docstring for the vocab block ``[b0, b0+nb)``: its 128-column chunks into ``lt``
    ``[P, Cp*S]`` PSUM (vocab on partitions). ``ps`` ``[T, nb]`` PSUM fp32: the block's sums; ``lg`` ``[T, nb]`` SBUF:
    its rounded logits (bf16; ``ident`` the ``[T, T]`` identity), or None (float32 activations: ``ident`` None, each
    chunk evicted from ``ps`` here, into ``logits_out`` too when given)."""
    T = ps.shape[0]
    for q0 in range(0, nb, P):
        wc = min(P, nb - q0)
        c = (b0 + q0) // P
        dst = lt[0:wc, c * S:c * S + T]
        if ident != None:
            nisa.nc_matmul(dst=dst, stationary=lg[:, q0:q0 + wc], moving=ident, accumulate=False)
        else:
            # nc_transpose needs a dense source (partition stride == free size, trn2 pitfall):
            # evict each 128-column chunk into its own tile
            lgc = nl.ndarray((T, wc), nl.float32, buffer=nl.sbuf, name="logits_chunk")
            nisa.activation(dst=lgc, op=nl.copy, data=ps[:, q0:q0 + wc])
            if logits_out != None:
                nisa.dma_copy(dst=logits_out[:, b0 + q0:b0 + q0 + wc], src=lgc)
            nisa.nc_transpose(dst=dst, data=lgc, engine=nisa.engine.tensor)


def lm_head_argmax_body(xT, w, index_base: int = 0, logits_out=None, noise=None, between=None, w_scale=None,
                        ring=None):
    """Body: greedy (value, index) of this core's vocabulary shard for each of T tokens.

    xT: SBUF ``[P, KT, T]`` activation dtype (normed hidden, feature-major). w: HBM ``[P, KT*Vc]``
    block-packed shard (:func:`lm_head_layout`), same dtype -- or, with ``w_scale``, the fp8 draft head (module
    docstring "fp8 draft head"): ``FP8`` codes against bfloat16 xT, ``w_scale`` HBM ``[P, 1]`` float32 holding the
    shard's scale s in every row (:func:`fp8_head_scale_layout`). index_base: compile-time int added to the
    local index (0 when :func:`nki_kernels.collectives.argmax_combine` adds the core offsets).
    logits_out: optional HBM ``[T, Vc]`` (activation dtype) receiving the rounded logits (tests, top-k
    on the host). noise: optional HBM ``[P, Cp*T]`` float32, vocab on partitions like ``lt``
    (:func:`noise_layout`: entry ``(p, c*T + t)`` = the noise of local vocab ``c*P + p`` for token t, 0 in
    the padding): sampling by Gumbel-max (``harness.sampling``); the scan then runs on ``lt + noise``
    (ONE DVE add, fp32, into SBUF) and ``best`` holds the noisy score. None: greedy, no extra instruction.
    between: None, or an object whose ``step(b, n)`` the body calls after vocab block b of n: other work emitted
    between the blocks in program order, so that it runs on the engines the weight stream leaves idle (the round's
    MTP replay, ``megakernel.round.ReplayInHead``).
    ring: None, or :func:`lm_head_ring` of ``w``: the weight ring's first buffers with their blocks already issued
    (the body allocates the others).
    Returns ``best`` SBUF ``[T, 2]`` float32 (value, index).
    """
    Pp, KT, T = xT.shape
    if Pp != P:
        raise ValueError(f"lm_head: xT has {Pp} partitions, expected {P} (feature-major [P, H/P, T])")
    if not 1 <= T <= P:
        raise ValueError(f"lm_head: {T} tokens, expected 1..{P}")
    if w.shape[0] != P or w.shape[1] % KT:
        raise ValueError(f"lm_head: weight shard {list(w.shape)} is not [P={P}, KT*Vc] with KT={KT}")
    if w_scale != None:
        if w.dtype != FP8 or xT.dtype != nl.bfloat16:
            raise TypeError(f"lm_head: an fp8 head needs {FP8} weights and bfloat16 activations, got {w.dtype} "
                            f"weights and {xT.dtype} activations")
        if tuple(w_scale.shape) != (P, 1) or w_scale.dtype != nl.float32:
            raise ValueError(f"lm_head: fp8 head scale {list(w_scale.shape)} {w_scale.dtype} is not [P={P}, 1] "
                             f"float32 (fp8_head_scale_layout)")
    elif w.dtype != xT.dtype:
        raise TypeError(f"lm_head: weight dtype {w.dtype} differs from activation dtype {xT.dtype}")
    act = xT.dtype
    vc = w.shape[1] // KT
    if vc + index_base >= 2 ** 24:
        raise ValueError(f"lm_head: indices up to {vc + index_base} are not exact in fp32 (limit 2^24)")
    C, Cp, S = scan_geometry(vc, T)
    if Cp * S * 4 > 4 * 2048:
        raise ValueError(f"lm_head: transposed logits need {Cp * S * 4} B of PSUM per partition; at most 4 banks "
                         f"(8192 B) are budgeted ({vc} vocab rows x stride {S})")

    if noise != None and (tuple(noise.shape) != (P, Cp * T) or noise.dtype != nl.float32):
        raise ValueError(f"lm_head: noise {list(noise.shape)} {noise.dtype} is not [P={P}, Cp*T={Cp * T}] float32 "
                         f"(noise_layout of {vc} vocab rows x {T} tokens)")

    # transposed, rounded logits: vocab on partitions, entry (p, c*S + t) = logit of vocab c*P + p
    lt = nl.ndarray((P, Cp * S), nl.float32, buffer=nl.psum, name="logits_vocab_major")
    noise_sb = None
    c_full = vc // P
    if c_full < Cp:     # partial last chunk and max8 padding: never the max
        nisa.memset(dst=lt[:, c_full * S:Cp * S], value=FP32_MIN)
    if act == nl.float32:
        ident = None
    else:
        ident = nl.shared_identity_matrix(T, dtype=act)

    # weight ring: W_BUFS block buffers, block b streams into buffer b % W_BUFS (its DMA waits only for
    # the matmuls of block b - W_BUFS), so W_BUFS - 1 block loads run ahead of the PE
    nbuf = ring_depth(w, KT)
    wring = [] if ring == None else list(ring)
    issued = len(wring)
    fits = issued <= nbuf
    for b in wring:
        fits = fits and tuple(b.shape) == (P, KT, min(NB, vc)) and b.dtype == w.dtype
    if not fits:
        raise ValueError(f"lm_head: the ring passed is not at most {nbuf} buffers of [{P}, {KT}, {min(NB, vc)}] "
                         f"{w.dtype} (lm_head_ring of the same weight)")
    for i in range(issued, nbuf):
        wring.append(nl.ndarray((P, KT, min(NB, vc)), w.dtype, buffer=nl.sbuf, name=f"lm_head_w{i}"))
    scale = 1.0
    if w_scale != None:     # fp8 head: the eviction multiplies the PSUM sums of the codes by s (fp32, ACT)
        scale = nl.ndarray((T, 1), nl.float32, buffer=nl.sbuf, name="lm_head_scale")
        nisa.dma_copy(dst=scale, src=w_scale[0:T, :])
    # fp8: the PE binds, so block b's transposes are emitted after block b+1's matmuls (the PE then never waits
    # for block b's eviction; the block's PSUM and logits tiles live one block longer); bf16: in block order
    pending = None
    blocks = vocab_blocks(vc)
    for bi in range(len(blocks)):
        b0, nb = blocks[bi]
        wt = wring[bi % nbuf][:, :, 0:nb]
        if bi >= issued:
            nisa.dma_copy(dst=wt, src=w[:, KT * b0:KT * (b0 + nb)])
        if noise != None and bi == 0:     # behind the first weight block: hidden under the stream
            noise_sb = nl.ndarray((P, Cp * T), nl.float32, buffer=nl.sbuf, name="sample_noise")
            nisa.dma_copy(dst=noise_sb, src=noise)
        ps = nl.ndarray((T, nb), nl.float32, buffer=nl.psum, name="logits_psum")
        for j in range(KT):
            nisa.nc_matmul(dst=ps, stationary=xT[:, j, :], moving=wt[:, j, :], accumulate=(j > 0))
        lg = None
        if ident != None:
            lg = nl.ndarray((T, nb), act, buffer=nl.sbuf, name="logits")
            nisa.activation(dst=lg, op=nl.copy, data=ps, scale=scale)      # (x s,) round to the activation dtype
            if logits_out != None:
                nisa.dma_copy(dst=logits_out[:, b0:b0 + nb], src=lg)
        if pending != None:
            transpose_block(lt, S, ident, logits_out, *pending)
        pending = (b0, nb, ps, lg)
        if w_scale == None:
            transpose_block(lt, S, ident, logits_out, *pending)
            pending = None
        if between != None:
            between.step(bi, len(blocks))
    if pending != None:
        transpose_block(lt, S, ident, logits_out, *pending)

    scores, stride = lt, S
    if noise_sb != None:    # Gumbel-max: logits + noise, fp32 (padding: -FLT_MAX + 0 stays the minimum);
        scores, stride = nl.ndarray((P, Cp * T), nl.float32, buffer=nl.sbuf, name="noisy_logits"), T
        nisa.tensor_tensor(dst=scores.reshape((P, Cp, T)), data1=lt.reshape((P, Cp, S))[:, :, 0:T],
                           data2=noise_sb.reshape((P, Cp, T)), op=nl.add)      # token columns T..S-1 unread

    # per-partition top-1 per token (first occurrence = lowest chunk)
    m8 = nl.ndarray((P, T, 8), nl.float32, buffer=nl.sbuf, name="top8_vals")
    i8 = nl.ndarray((P, T, 8), nl.uint32, buffer=nl.sbuf, name="top8_idx")
    for t in range(T):
        view = scores[:, t:Cp * stride:stride]
        nisa.max8(dst=m8[:, t, :], src=view)
        nisa.nc_find_index8(dst=i8[:, t, :], data=view, vals=m8[:, t, :])
    vals = nl.ndarray((P, T), nl.float32, buffer=nl.sbuf, name="part_best_val")
    nisa.tensor_copy(dst=vals, src=m8[:, :, 0])
    cidx = nl.ndarray((P, T), nl.float32, buffer=nl.sbuf, name="part_best_idx")
    nisa.tensor_copy(dst=cidx, src=i8[:, :, 0])              # uint32 -> fp32 before any arithmetic
    pcol = nl.ndarray((P, 1), nl.float32, buffer=nl.sbuf, name="partition_index")
    nisa.iota(dst=pcol, pattern=[[0, 1]], offset=0, channel_multiplier=1)
    nisa.tensor_scalar(dst=cidx, data=cidx, op0=nl.multiply, operand0=float(P), op1=nl.add, operand1=pcol)

    # across partitions: PE transposes to token-major, then max / lowest index
    vT = nl.ndarray((T, P), nl.float32, buffer=nl.psum, name="cand_val_T")
    nisa.nc_transpose(dst=vT, data=vals, engine=nisa.engine.tensor)
    iT = nl.ndarray((T, P), nl.float32, buffer=nl.psum, name="cand_idx_T")
    nisa.nc_transpose(dst=iT, data=cidx, engine=nisa.engine.tensor)
    best = nl.ndarray((T, 2), nl.float32, buffer=nl.sbuf, name="core_best")
    select_max_lowest_index(best, vT, iT)
    if index_base:
        nisa.tensor_scalar(dst=best[:, 1:2], data=best[:, 1:2], op0=nl.add, operand0=float(index_base))
    return best


# ---- wrapper --------------------------------------------------------------------------------------
@nki.jit
def lm_head_argmax_kernel(xT, w, vocab_base=0, with_logits=False, noise=None, w_scale=None):
    """Wrapper: xT HBM ``[P, KT, T]``, w HBM ``[n_cores, P, KT*Vc]`` (one block-packed shard per
    physical core) -> ``best [n_cores, T, 2]`` float32 (value, vocab_base + core*Vc + local index), and
    with ``with_logits=True`` also ``logits [n_cores, T, Vc]`` (activation dtype). ``noise``: optional
    HBM ``[n_cores, P, Cp*T]`` float32 (:func:`rank_noise_layout`): Gumbel-max sampling instead of argmax.
    ``w_scale``: the fp8 head's scale HBM ``[n_cores, P, 1]`` float32 (:func:`fp8_head_scale_layout`) with ``w``
    ``FP8`` codes (``nki_kernels.moe.kernel_table`` of the block-packed :func:`quantize_head` codes).

    Launch ``lm_head_argmax_kernel(...)`` for one core (n_cores = 1) or ``[2]`` for a rank's two cores;
    ``vocab_base`` = the first vocab row of this launch (rank * 2 * Vc for a rank).
    """
    n_cores, core = program_sharding()
    if w.shape[0] != n_cores:
        raise ValueError(f"lm_head: weight holds {w.shape[0]} core shards, launched on {n_cores} cores")
    Pp, KT, T = xT.shape
    vc = w.shape[2] // KT
    best_out = nl.ndarray((n_cores, T, 2), nl.float32, buffer=nl.shared_hbm, name="lm_head_best")
    logits = None
    if with_logits:
        logits = nl.ndarray((n_cores, T, vc), xT.dtype, buffer=nl.shared_hbm, name="lm_head_logits")
    xs = nl.ndarray((Pp, KT, T), xT.dtype, buffer=nl.sbuf, name="xT")
    nisa.dma_copy(dst=xs, src=xT)
    best = lm_head_argmax_body(xs, w[core], index_base=vocab_base + core * vc,
                               logits_out=logits[core] if with_logits else None,
                               noise=noise[core] if noise != None else None,
                               w_scale=w_scale[core] if w_scale != None else None)
    nisa.dma_copy(dst=best_out[core], src=best)
    if with_logits:
        return best_out, logits
    return best_out


# ---- host-side layout helpers (plain numpy/torch, run once per checkpoint) -------------------------
def lm_head_layout(w_shard) -> torch.Tensor:
    """One core's shard ``[Vc, H]`` (PyTorch layout, numpy or torch) -> block-packed ``[P, KT*Vc]`` (torch)."""
    w = as_torch(w_shard)
    vc, H = w.shape
    if H % P:
        raise ValueError(f"lm_head: hidden size {H} is not a multiple of {P}")
    KT = H // P
    blocks = []
    for b0, nb in vocab_blocks(vc):                       # block [p, j*nb + n] = W[b0+n, j*P+p]
        blocks.append(w[b0:b0 + nb].t().reshape(KT, P, nb).permute(1, 0, 2).reshape(P, KT * nb))
    return torch.cat(blocks, dim=1).contiguous()


def rank_lm_head_layout(shards) -> torch.Tensor:
    """Tuple of a rank's per-core shards ``[Vc, H]`` -> ``[n_cores, P, KT*Vc]`` (the wrapper's ``w``)."""
    return torch.stack([lm_head_layout(s) for s in shards])


def noise_layout(noise) -> torch.Tensor:
    """One core's noise ``[T, Vc]`` (token-major, float32: the pre-scaled Gumbel noise of the core's vocab rows,
    ``harness.sampling``) -> ``[P, Cp*T]`` float32, vocab on partitions as in the kernel's ``lt``: entry
    ``(p, c*T + t)`` = ``noise[t, c*P + p]``; the padding (a partial last chunk, chunks up to max8's minimum)
    holds 0, so the -FLT_MAX padding of ``lt`` stays the minimum."""
    g = as_torch(noise).float()
    T, vc = g.shape
    C, Cp, S = scan_geometry(vc, T)
    full = torch.zeros(T, Cp * P, dtype=torch.float32)
    full[:, :vc] = g
    return full.reshape(T, Cp, P).permute(2, 1, 0).reshape(P, Cp * T).contiguous()   # [t, c, p] -> [p, c, t]


def rank_noise_layout(noise, n_cores: int) -> torch.Tensor:
    """A rank's noise ``[T, n_cores*Vc]`` (its cores' vocab rows in order) -> ``[n_cores, P, Cp*T]`` (the
    wrapper's ``noise``)."""
    g = as_torch(noise)
    vc = g.shape[1] // n_cores
    if vc * n_cores != g.shape[1]:
        raise ValueError(f"lm_head: noise over {g.shape[1]} vocab rows does not split over {n_cores} cores")
    return torch.stack([noise_layout(g[:, c * vc:(c + 1) * vc]) for c in range(n_cores)])


def quantize_head(w) -> tuple[torch.Tensor, torch.Tensor]:
    """One core's head rows ``[Vc, H]`` -> (e4m3 codes ``[Vc, H]`` in ``model.tp.moe.FP8_CODES`` storage, the shard's
    scale s, a float32 scalar tensor): s = max |w| / 240 (1 for an all-zero shard), codes = round-to-nearest-even(w /
    s) (module docstring "fp8 draft head"; every core undoes its own s, so the cores' logits compare in the original
    units). The fp8 experts' quantiser (``model.tp.moe.quantize_channels``) over one channel; torch ops only, so it
    runs on ``meta`` tensors too."""
    w = as_torch(w)
    codes, scale = quantize_channels(w.reshape(1, -1), 1)
    return codes.reshape(w.shape), scale.reshape(())


def fp8_head_scale_layout(scales) -> torch.Tensor:
    """The cores' fp8 head scales (scalars, core order) -> the wrapper's ``w_scale`` ``[n_cores, P, 1]`` float32 (each
    core's s in every row: the eviction reads rows 0..T-1 as its per-partition scale column)."""
    s = torch.stack([torch.as_tensor(x, dtype=torch.float32).reshape(()) for x in scales])
    return s.reshape(-1, 1, 1).expand(-1, P, 1).contiguous()
