"""Sparse MoE decode subkernel (``moe_tkg``): router, routed experts and the sigmoid-gated shared
expert of one layer for T = 1..4 tokens, on one TP rank (its LNC cores split the work).

Math (shared/docs/qwen36.md §4.4; twin: ``model/tp/moe.py``, ``moe_rank``)::

    logits = x Wr^T (rounded to the activation dtype, as F.linear)      [T, E]
    p      = softmax(logits) in fp32; top-k; w = p_top / sum(p_top)      ties -> LOWER expert index
    y      = sum_e w_e.to(dtype) * down_e(silu(gate_e x) * up_e x)     on the rank's intermediate slice
           + sigmoid(w_seg . x) * shared(x)                              (w_seg . x rounded like F.linear)

SBUF layouts (nki_kernels/README.md): input ``xT [P, H/P, T]`` (feature-major), output the core's
partial ``y [T, H]`` float32. P = 128 partitions.

Design
------
**Router.** The host table holds one router block per core (``router_block``: half of the experts' rows under
LNC = 2, plus the shared-expert gate as an extra column), but every core reads ALL the blocks (1 MiB bf16 at the
real shapes, prefetched off the path by ``moe_weights``) and computes all E logits: one accumulation over the H/P
contraction blocks whose moving operand spans every block (258 columns, one PSUM bank) gives the logits and the
gate logit. Both cores run the same matmuls in the same order on the same data, so they route identically with
no exchange on the routing's path (before: the halves were swapped with ``sendrecv`` after their rounding, and the
softmax max taken over the halves' maxima; the wider moving operand costs less than the swap and its hand-offs,
and the extra 0.5 MiB per core per layer of router weight is prefetched: bench/decode_speed.md lever 51, with the
measured round bands). Logits are rounded to the activation dtype by one DVE pass that also reduces them (over both
free axes) to the negated max, and the softmax numerators ``p = exp(l - max)`` are fp32 (``exp`` with the per-token
max as bias); the 8 largest ``p`` are the same ``exp`` of the 8 largest logits (``exp`` is monotone), so their
``max8`` runs on the logits while ScalarE computes ``p``; the softmax denominator is not needed (same top-k set; it
cancels in the renormalised weights). The top-k SET is exact with lower-index ties and needs nothing but ``max8`` values
(documented: the 8 largest values, descending): with ``vk`` = the k-th value of max8(p), the key
``(p > vk) + (p >= vk) * (E - e) / 2^m`` (2^m >= E; exact) is unique per expert where non-zero and orders
every ``p > vk`` above every tie ``p == vk``, the ties lowest index first; its k-th largest value (a second
``max8``) is the threshold of the selection. No instruction's handling of equal values is relied on
(``nc_find_index8`` is not used: its docstring says "first occurrence" and leaves duplicated ``vals``
unspecified). The renormalised weights ``p_e / sum(v[:k])`` are rounded to the activation dtype like the twin's
``weights.to(x.dtype)``.

**Dedup of the T*k choices.** The union of the tokens' selections becomes a list of at most
``S = min(T*k, E)`` distinct expert slots: the first k are token 0's own experts (always valid: one
token selects k distinct experts; straight from the top-k key's ``max8``: its experts with ``p > vk`` ascending,
then its admitted ties ascending), the rest the
experts the other tokens chose and token 0 did not (a ones-vector matmul counts the tokens choosing
each expert; ascending, by repeated ``max8`` over ``(count > 0) * (1 - sel_0) * (E - e)``), valid iff
their key is non-zero. The keys are unique per expert, so again no tie semantics. A one-hot matmul gathers, per slot,
the column of per-token weights ``Wsel[t, s] = w[t, id_s]`` (0 for a token that did not choose it).
Slot s then reads expert ``id_s`` ONCE and runs it on all T tokens as a T-wide matmul, each token's
activation scaled by its own weight (0 when it did not choose the expert).

**Run-time addressing.** ``id_s`` goes to a register (``register_load``) that is the ``scalar_offset`` of the
expert block's DMAs (``experts.ap(..., scalar_offset=reg, indirect_dim=0)``, HWDGE). The k always-valid slots
run in straight-line code. The conditional slots k..S-1 (a prefix of them is used) run in NESTED runtime loops of 0
or 1 trips (the nki-library "conditional iteration" pattern), LEVEL = 4 slots per level: the level of slots
s..s+3 runs iff all four are used, and its body holds the next level; otherwise exactly one of three remainder
loops after it runs (the one whose r = 1..3 slots are used). The trip counts are computed on chip from the keys
(``moe_cond_trips``); when the register pool allows, each loop has its own trip register and a level loads all
of them before its first loop, so no register load sits between the loop exits at the end of the stream (issue
15: 4-layer A/B 1,601.1 -> 1,599.9 us); else the level's one register is loaded before each of its loops. So an
unused slot moves no byte and computes nothing, every loop exit comes after all the work it encloses (no fence in
the middle of the expert stream), and the nkisim trace of an executing run shows exactly the distinct experts'
DMAs. Nothing branches in Python on data. No PSUM value is live across a device
loop (loop state is carried in SBUF, SDK-NL fori_loop; neuronx-cc rejects PSUM written inside a device loop but
allocated outside it, NCC_IBIR092): the shared expert and the always-valid slots accumulate in one PSUM group in
straight-line code, evicted to an SBUF fold before the first loop; each conditional loop body streams its slots
into a PSUM accumulator allocated inside it and adds that into the fold before any deeper loop starts. A table
argument's every element offset fits int32 (SDK-LG "NKI Values"); stacked tables are therefore split into groups
of layers (``megakernel.sharded``).

**Weight stream.** Host-side, each expert's slice for (rank, core) is one contiguous ``[P, F]`` block,
partition-major (a 6 KiB run per partition at the real bf16 shapes, 768 KiB per expert per core): the
gate|up columns contraction-major ``[P, H/P, 2*ic]`` and the down rows folded over the partitions, ``R = P / ic``
row groups each holding ``H / R`` columns (``geometry``). Each block moves as ``GU_PIECES + 1`` (3) DMAs of
sub-ranges of its partition rows: its gate|up part in GU_PIECES contraction pieces (``H/P / GU_PIECES`` blocks of
``2*ic`` columns each), then its down rows (at the real bf16 shapes three DMAs of 256 KiB, 2 KiB runs per
partition). A group issues, on one queue, every slot's first piece, then every slot's second piece, and then
the PREVIOUS group's down rows (its own follow the next group's pieces, or end the batch of groups issued
together); in the ring the group's region of ``G * F`` elements per partition holds the pieces in that order, then
the down rows (``_gu_cols``), so each gate|up matmul reads only the bytes of its own piece and the PE starts on a
group's gate|up while its later pieces and its down rows are still in flight (the DMAs of one queue move in
order). At the last group of a layer this takes the gate|up and most of the activation chain off the tail after
the last expert byte (issue 15, 4-layer A/B round: 1,621.8 -> 1,614.1 us for gate|up then down, -> 1,609.2 with two
pieces, -> 1,601.1 with the down rows deferred by a group; pieces of 1 KiB runs,
GU_PIECES = 4, gained 2.5 us more central but lost 10 at the low end, where all DMAs share the bandwidth and the DGE
issue time adds up). The blocks stream through ONE ring of ``Ns`` slot buffers ``[P, Ns, F]`` (``prefetch``
slots, 8 by default: 48 KiB per partition) shared by the static and the conditional slots: the first groups' DMAs
are issued as soon as token 0's max8 has given their ids, every later group's as soon as the down projection of
the group whose ring positions it takes has run (the WAR on the buffer; the conditional levels' DMAs are issued
in program order while the static slots compute). A stream of which more than ``WINDOW`` (4) groups fit in the
ring keeps only WINDOW of them in flight instead: their DMAs are issued up front and group g + WINDOW's from
ScalarE's queue right after group g's ``silu`` (its ring positions were consumed a group earlier, so nothing else
holds it back). The DMAs of one queue move in order
(SDK nki-dma-overview.rst "DMA Queues"), so the up-front groups land one after the other, the first as soon as its
own bytes are in; at the default ring (8 slots = 4 groups) every static group is issued up front (issue 15,
bench/decode_speed.md lever 23). The router and
shared-expert blocks do not depend on the routing: ``moe_weights`` issues them (a caller does so before the
post-attention norm, so they fly under it), else the body does first. The ACT's exp table is loaded by a dummy
activation while they fly.

**Expert compute** (per group of G = ``group_size(ic)`` = 2 slots at the real shapes, per core, ``ic`` =
intermediate columns of the core): ``gu[T, G, 2ic] = sum_j xT[:, j, :]^T W_gu[j]`` (H/P matmuls whose moving
operand is the G slots' [P, G, 2ic] columns, 256 at the real shapes: fewer, fuller PE instructions), ``silu`` on
ACT for the group, per slot ``a = silu(g) * w_tok * u`` on DVE (fp32) and one PE transpose to ``a^T``, one mask
multiply into the block-diagonal stationaries ``Z [P, G, R*T]`` (``Z[g*ic+i, g*T+t] = a[t, i]``) so that ONE
matmul per 512-column bank with the folded down block (K = 128) yields the folded output ``[R*T, H/R]``:
``y[t, g*H/R + c] = out[g*T + t, c]``. At the real shapes (ic = 64, R = 2) this halves the down matmuls and the
free size of the accumulation. On the PE (software pipelining in program order, within a straight-line run): the
matmuls of group g+1's first gate|up piece, then group g's transposes, then the rest of group g+1's gate|up, then
group g's down projection. The bytes of the first piece land first, so the PE works on them while ACT / DVE finish
group g, and group g's transposes wait for no piece still in flight: at a stream's end the last group's gate|up no
longer holds back the previous group's chain. A stream's last group takes one mask multiply per slot, so its first
slot's down matmuls need not wait for the second slot's transpose. (Issue 15, 4-layer A/B round, context 2,048,
expected routing, central (low - high): 1,490.8 (1,345.2 - 3,008.5) -> 1,487.9 (1,344.8 - 2,990.2) us against the
whole gate|up of group g+1 before group g's transposes; the split at the last pair of a stream only: 1,487.9
(1,344.4 - 2,996.8); the whole gate|up after the transposes at the last pair: 1,489.5.) The folded sum is unfolded
into ``y [T, H]`` at the end by R SBUF->SBUF DMAs.

**LNC = 2.** The two cores split the rank's intermediate columns (64 + 64 of 128), so each core
reads exactly half of every selected expert: the DMA split is balanced whatever the number of
distinct experts, and both cores run identical control flow (required for device loops under
LNC = 2: the same loops with the same trip counts). Splitting the experts instead (each core reading
whole experts) would halve the DMAs per core but not the bytes or the PE columns, and with a
data-dependent number of distinct experts it would need a column-split fallback for an odd last one to
keep the cores' loops identical; not done. Each core returns its own partial; the wrapper writes
``out[core]``.

ACT table use: ``exp`` (warm-up, softmax numerators, and the gate as ``1 / (1 + exp(-z))``) then ``silu``
for every expert: two table loads, the first off the critical path, no thrash.

**Traces.** An executing nkisim run traces exactly the slots that ran: one block's DMAs (gate|up pieces, down
rows) per DISTINCT selected expert (``routed_expert_bytes``). In shape-only mode the registers read 0 unless a
provider gives them (``harness.register_models.MoERouting``, which models the ids, the trip counts and their load
order): without one, the k always-valid slots fetch expert 0 and no conditional loop runs, i.e. the trace shows
the minimum traffic (all tokens agreeing on k experts).

**fp8 experts** (opt-in, issue 15; it changes the model's output). The routed experts' blocks may be ``FP8``
(``float8_e4m3``: 384 KiB per expert per core instead of 768) with a small fp32 scales table ``[E, n_cores, 2ic]``
(:func:`expert_scales`): per gate|up output column, the gate columns' scale and, for the up columns, up scale x the
scale of the down row of the same intermediate column (the quantiser, ``model.tp.moe.quantize_fp8``, is per
gate / up output column and per down input row, max-abs / 240). The same register that addresses a slot's block
addresses its scales row (one DMA of 2ic fp32 broadcast to the T token partitions, issued just before the
block's gate|up part on the same queue); one DVE multiply of the group's fp32 gate|up PSUM by them precedes the
silu, so ``a`` carries the down rows' scale and the down accumulation over the slots needs no rescale. The
matmuls take bf16 stationaries and e4m3 moving operands (the two may differ on trn2; fp32 PSUM). The shared
expert, router and activations stay bfloat16; with bfloat16 blocks nothing changes (same instructions). Twin:
``model.tp.moe.moe_rank`` of a quantised shard (same rounding points). Host storage: torch has no IEEE-like e4m3,
so the layout helpers keep e4m3 codes in ``torch.float8_e4m3fn`` tensors (every code is within +-240, where the
two formats' bytes are the same) and :func:`kernel_table` views them as ``float8_e4m3`` for the kernel.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import torch

import nki
import nki.isa as nisa
import nki.language as nl

from nki_kernels.common import INT32_MAX, MOVING_MAX, PSUM_BANK, P, layer_of, layer_offset, program_sharding
from nki_kernels.stacked import check_stack, fold_banks, unfold

MAX8 = 8           # values per max8 (SDK-ISA max8)
RING_BUDGET = 120 * 1024   # SBUF bytes per partition the expert ring may take
GROUP = 2          # slots whose gate|up matmuls share one moving operand (group_size)
LEVEL = 4          # conditional slots per nesting level (_conditional_levels)
GU_PIECES = 2       # DMAs per expert block's gate|up part (_issue; at the real bf16 shapes 3 DMAs of 256 KiB per block)
WINDOW = 4         # slot groups in flight in a stream (_stream; >= 2: group g+1's gate|up precedes g's down)
FP8 = nl.float8_e4m3      # the opt-in expert block dtype (IEEE-like e4m3, max 240; trn2 has no e4m3fn matmul)
IDS_NAME = "moe_expert_ids"    # the on-chip tensors the body loads registers from (harness.register_models)
TRIPS_NAME = "moe_cond_trips"


# ---------------------------------------------------------------------------------------------
# geometry: the one home of the HBM block layout, shared by the host helpers and the kernel
# ---------------------------------------------------------------------------------------------

def fold_groups(inter_core: int) -> int:
    """R: row groups of the down block folded over the 128 partitions (R * inter_core = 128)."""
    if inter_core < 1 or P % inter_core:
        raise ValueError(f"moe: {inter_core} intermediate columns per core; the kernel needs a divisor of {P} "
                         f"(the down block is folded over the {P} partitions)")
    return P // inter_core


def block_width(inter_core: int, hidden: int) -> int:
    """Free size F of one expert block [P, F]: gate|up [P, (H/P)*2*ic] then folded down [P, H/R]."""
    return (hidden // P) * 2 * inter_core + hidden // fold_groups(inter_core)


def geometry(width, hidden, what):
    """(ic, R, H/R, down offset, chunks) of a block of free size ``width`` (the unique ic that fits)."""
    hits = []
    for ic in range(1, P + 1):
        if P % ic == 0 and block_width(ic, hidden) == width:
            hits.append(ic)
    if len(hits) != 1:
        raise ValueError(f"moe_tkg: {what} block has free size {width}, which is not the layout of "
                         f"block_width(ic, H={hidden}) for exactly one ic dividing {P} (got {hits})")
    ic = hits[0]
    R = P // ic
    HR = hidden // R
    chunks = []
    c0 = 0
    while c0 < HR:
        chunks.append((c0, min(PSUM_BANK, HR - c0)))
        c0 += PSUM_BANK
    return {"ic": ic, "R": R, "HR": HR, "off_d": (hidden // P) * 2 * ic, "F": width, "chunks": chunks}


# ---------------------------------------------------------------------------------------------
# host-side layout helpers (torch; run once per checkpoint)
# ---------------------------------------------------------------------------------------------

def layers_per_table(layer_elems: int) -> int:
    """How many layers' expert tables of ``layer_elems`` elements each may be stacked into one HBM tensor so
    that every element offset (and the end offset) fits int32: the stacking group size of the megakernel."""
    if not 0 < layer_elems <= INT32_MAX:
        raise ValueError(f"moe: one layer's expert table of {layer_elems} elements does not fit int32 offsets")
    return INT32_MAX // layer_elems


def expert_blocks(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, n_cores: int) -> torch.Tensor:
    """One rank's expert slices in PyTorch layout -> the kernel's HBM blocks.

    gate, up: [E, I_r, H]; down: [E, H, I_r] (``model.tp.moe.shard_moe``). Core c takes intermediate
    columns ``c*ic .. (c+1)*ic - 1``, ``ic = I_r / n_cores``. Returns ``[E, n_cores, P, F]`` (same
    dtype, contiguous), F = ``block_width(ic, H)``: block[e, c, p, j*2ic + n] = gate|up[e, c*ic + n, j*P + p]
    (n < ic gate, else up), and block[e, c, g*ic + i, off_d + col] = down[e, g*(H/R) + col, c*ic + i].
    """
    E, inter, H = gate.shape
    if up.shape != gate.shape or down.shape != (E, H, inter):
        raise ValueError(f"expert_blocks: gate {list(gate.shape)}, up {list(up.shape)}, down {list(down.shape)}: "
                         f"expected [E, I, H], [E, I, H], [E, H, I]")
    if H % P:
        raise ValueError(f"expert_blocks: hidden size {H} is not a multiple of {P}")
    if inter % n_cores:
        raise ValueError(f"expert_blocks: {inter} intermediate columns do not split over {n_cores} cores")
    ic = inter // n_cores
    R = fold_groups(ic)
    J, HR = H // P, H // R
    gu = torch.cat([gate.reshape(E, n_cores, ic, H), up.reshape(E, n_cores, ic, H)], dim=2)
    gu = gu.reshape(E, n_cores, 2 * ic, J, P).permute(0, 1, 4, 3, 2).reshape(E, n_cores, P, J * 2 * ic)
    d = down.reshape(E, H, n_cores, ic).permute(0, 2, 3, 1)                      # [E, C, ic, H]
    d = d.reshape(E, n_cores, ic, R, HR).permute(0, 1, 3, 2, 4).reshape(E, n_cores, P, HR)
    return torch.cat([gu, d], dim=3).contiguous()


def router_block(router: torch.Tensor, shared_expert_gate: torch.Tensor, n_cores: int = 2) -> torch.Tensor:
    """[E, H] router and [1, H] shared-expert gate -> [n_cores, P, H/P, E/n_cores + 1]: core c's block
    holds experts c*E/n_cores .. (c+1)*E/n_cores - 1 and, in its last column, the gate (both cores
    need it); element (c, p, j, n) = W_c[n, j*P + p], partition-major (one contiguous run per partition)."""
    E, H = router.shape
    if shared_expert_gate.shape != (1, H):
        raise ValueError(f"router_block: shared_expert_gate {list(shared_expert_gate.shape)}, expected [1, {H}]")
    if H % P:
        raise ValueError(f"router_block: hidden size {H} is not a multiple of {P}")
    if E % n_cores:
        raise ValueError(f"router_block: {E} experts do not split over {n_cores} cores")
    Eh = E // n_cores
    w = router.reshape(n_cores, Eh, H)
    w = torch.cat([w, shared_expert_gate.to(router.dtype).expand(n_cores, 1, H)], 1)      # [C, Eh+1, H]
    return w.transpose(1, 2).reshape(n_cores, H // P, P, Eh + 1).permute(0, 2, 1, 3).contiguous()


def expert_scales(gate_scale: torch.Tensor, up_scale: torch.Tensor, down_scale: torch.Tensor, n_cores: int
                  ) -> torch.Tensor:
    """Per-channel fp8 scales of one rank's experts (``model.tp.moe.quantize_fp8``: gate / up per output column,
    down per input row; each [E, I_r]) -> the kernel's table [E, n_cores, 2ic] float32: row (e, c) holds core c's
    gate|up columns' multipliers, ``gate_scale[e, c*ic + n]`` for n < ic, ``up_scale * down_scale`` (fp32 product)
    of intermediate column c*ic + n - ic after."""
    E, inter = gate_scale.shape
    if up_scale.shape != (E, inter) or down_scale.shape != (E, inter):
        raise ValueError(f"expert_scales: gate {list(gate_scale.shape)}, up {list(up_scale.shape)}, down "
                         f"{list(down_scale.shape)}: expected three [E, I]")
    if inter % n_cores:
        raise ValueError(f"expert_scales: {inter} intermediate columns do not split over {n_cores} cores")
    ic = inter // n_cores
    ud = up_scale.float() * down_scale.float()
    return torch.cat([gate_scale.float().reshape(E, n_cores, ic), ud.reshape(E, n_cores, ic)], dim=2).contiguous()


def kernel_table(t):
    """A host table for the kernel: fp8 experts blocks (``torch.float8_e4m3fn`` holding e4m3 codes, module docstring
    "fp8 experts") -> a numpy ``float8_e4m3`` array of the same bytes; any other tensor unchanged."""
    if t is None or t.dtype != torch.float8_e4m3fn:
        return t
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3)


def moe_hbm_layout(shard: dict[str, torch.Tensor], n_cores: int = 2) -> dict[str, torch.Tensor]:
    """A rank's shard (``model.tp.moe.shard_moe``) -> the kernel's HBM tensors:
    ``router`` [n_cores, P, H/P, E/n_cores + 1], ``experts`` [E, n_cores, P, F], ``shared`` [n_cores, P, Fs];
    a quantised shard (``model.tp.moe.quantize_fp8``: fp8 expert codes and ``*_scale``) adds ``scales``
    [E, n_cores, 2ic] (:func:`expert_scales`)."""
    if "gate_scale" in shard:
        out = moe_hbm_layout({k: v for k, v in shard.items() if not k.endswith("_scale")}, n_cores)
        out["scales"] = expert_scales(shard["gate_scale"], shard["up_scale"], shard["down_scale"], n_cores)
        return out
    return {
        "router": router_block(shard["router"], shard["shared_expert_gate"], n_cores),
        "experts": expert_blocks(shard["gate"], shard["up"], shard["down"], n_cores),
        "shared": expert_blocks(shard["shared_gate"][None], shard["shared_up"][None], shard["shared_down"][None],
                                n_cores)[0],
    }


# ---------------------------------------------------------------------------------------------
# kernel body
# ---------------------------------------------------------------------------------------------

def group_size(inter_core: int) -> int:
    """Slots whose gate|up projections share one moving operand: at most GROUP, and the group's gate|up
    columns (``G * 2 * ic``) fill at most one moving operand / PSUM bank (``MOVING_MAX``)."""
    return max(1, min(GROUP, MOVING_MAX // (2 * inter_core)))


def _groups(s0, s1, G):
    """[(first slot, slots)] covering slots s0..s1-1 in consecutive groups of at most G."""
    out = []
    s = s0
    while s < s1:
        n = min(G, s1 - s)
        out.append((s, n))
        s = s + n
    return out


def _router_logits(xT, r_sb):
    """PSUM [T, lnc, E/lnc + 1] f32 from the router table r_sb [P, lnc, H/P, E/lnc + 1] (:func:`moe_weights`): block c's
    logits (experts c*E/lnc ..) | the shared-expert gate logit, every block in one moving operand per contraction
    block (one accumulation group, the PSUM free size 2 * (E/2 + 1) = 258 fp32 at the real shapes: one bank)."""
    _, J, T = xT.shape
    lg_ps = nl.ndarray((T, r_sb.shape[1], r_sb.shape[3]), dtype=nl.float32, buffer=nl.psum)
    for j in range(J):
        nisa.nc_matmul(dst=lg_ps, stationary=xT[:, j, :], moving=r_sb[:, :, j, :], accumulate=j > 0)
    return lg_ps


def _top_k(lg_ps, top_k, S, pid, adt):
    """Routing on SBUF from all E logits (PSUM [T, lnc, E/lnc + 1], see :func:`_router_logits`).

    Returns (gl [T, 1] activation dtype: the shared-expert gate logit, w [T, E] activation dtype: each token's
    renormalised weight of every expert (0 if not selected), keys [1, 8 * rounds] f32: the distinct selected
    experts' keys E - e, token 0's k first (in the top-k key's order), then the other tokens' further experts in
    descending order (0 past the last), ids [1, S] int32: slot s's expert E - keys[s]
    (E for an unused slot, never loaded), trips [1, 2 ceil((S - k) / 2)] int32 or None: the trip counts of
    the conditional loops, see :func:`_conditional_levels`). Every core computes all E logits with the same matmuls
    in the same order, so both cores route identically with no exchange. The ids of the first k slots are decoded
    from the top-k key's max8 values, so their DMAs can start before the selection mask and the union exist.
    """
    T, lnc = lg_ps.shape[0], lg_ps.shape[1]
    Eh = lg_ps.shape[2] - 1
    E = Eh * lnc
    f32 = nl.float32
    k = top_k
    # constants (set while the PE runs the router matmuls): rev[e] = E - e and the tie keys revs = rev / 2^m,
    # 2^m >= E (exact: a power-of-two scale of small integers)
    ones_t = nl.ndarray((T, 1), dtype=adt, buffer=nl.sbuf)
    nisa.memset(dst=ones_t, value=1.0)
    rev = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.iota(dst=rev, pattern=[[-1, E]], offset=E)
    revs = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    m2 = 1
    while m2 < E:
        m2 = 2 * m2
    nisa.tensor_scalar(dst=revs, data=rev, op0=nl.multiply, operand0=1.0 / m2)

    # logits rounded to the activation dtype by one pass that also yields -max of them (the max of the rounded
    # values: rounding is monotone), read past the blocks' gate columns
    gl = nl.ndarray((T, 1), dtype=adt, buffer=nl.sbuf)            # the shared-expert gate logit
    lg = nl.ndarray((T, E), dtype=adt, buffer=nl.sbuf)
    nmx = nl.ndarray((T, 1), dtype=adt, buffer=nl.sbuf)
    nisa.tensor_scalar_reduce(dst=lg.reshape((T, lnc, Eh)), data=lg_ps[:, :, 0:Eh], op0=nl.multiply, operand0=1.0,
                              reduce_op=nl.maximum, reduce_res=nmx, reduce_res_negate=True)

    # softmax numerators (fp32): p = exp(l - max). The top-k set of the softmax is that of p, and the renormalised
    # weights p_top / sum(p_top) do not depend on the softmax denominator, which cancels: it is not computed
    p = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=p, op=nl.exp, data=lg, bias=nmx)
    # v8 = max8(p) without VectorE waiting for p: exp(. - max) is monotone, so the 8 largest p are, in order, the
    # same ScalarE exp of the 8 largest logits (max8 on lg runs on VectorE while ScalarE computes p); then the gate
    # logit, from this core's own block
    l8 = nl.ndarray((T, MAX8), dtype=adt, buffer=nl.sbuf)
    nisa.max8(dst=l8, src=lg)
    nisa.tensor_copy(dst=gl, src=lg_ps[:, pid, Eh:Eh + 1])          # (while VectorE waits for v8)
    v8 = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=v8, op=nl.exp, data=l8, bias=nmx)

    # exact top-k set, ties to the lower index: with vk the k-th largest p, the key comp = (p > vk) + (p >= vk) * revs
    # is 1 + revs for p > vk, revs for p == vk, 0 below (unique per expert where non-zero: revs < 1 + revs' for all
    # pairs); its k largest values are the selection (every p > vk, then the tied experts lowest index first), and
    # ck = the k-th largest is the threshold: selected iff comp >= ck
    vk = v8[:, k - 1:k]
    tied = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)         # VectorE: GpSimd runs no float tensor_tensor
    nisa.scalar_tensor_tensor(dst=tied, data=p, op0=nl.greater_equal, operand0=vk, op1=nl.multiply, operand1=revs)
    comp = nl.ndarray((T, E), dtype=f32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=comp, data=p, op0=nl.greater, operand0=vk, op1=nl.add, operand1=tied)
    c8 = nl.ndarray((T, MAX8), dtype=f32, buffer=nl.sbuf)
    nisa.max8(dst=c8, src=comp)
    ck = c8[:, k - 1:k]

    # slots: the first k are token 0's own experts, decoded from c8 (E - e = 2^m (c8 - [c8 > 1]): its experts with
    # p > vk ascending, then its admitted ties ascending), then the experts
    # the other tokens chose and token 0 did not (ascending: max8 rounds over (count > 0) * (1 - sel_0) * (E - e),
    # the count of tokens choosing each expert from a ones-vector matmul); the keys are unique per expert, so no
    # tie semantics are relied on. Each slot's ids are written as soon as its max8 round is done: the first k
    # slots' DMAs wait for no union work
    rounds = -(-(S - k) // MAX8)
    keys = nl.ndarray((1, max(MAX8, k + rounds * MAX8)), dtype=f32, buffer=nl.sbuf)
    ids = nl.ndarray((1, S), dtype=nl.int32, buffer=nl.sbuf, name=IDS_NAME)
    r0 = nl.ndarray((1, k), dtype=f32, buffer=nl.sbuf)            # (E - e) / 2^m of token 0's experts
    nisa.scalar_tensor_tensor(dst=r0, data=c8[0:1, 0:k], op0=nl.greater, operand0=1.0, op1=nl.subtract,
                              operand1=c8[0:1, 0:k], reverse1=True)
    nisa.tensor_scalar(dst=ids[:, 0:k], data=r0, op0=nl.multiply, operand0=-float(m2), op1=nl.add, operand1=float(E))
    nisa.tensor_scalar(dst=keys[:, 0:k], data=r0, op0=nl.multiply, operand0=float(m2))
    sel = nl.ndarray((T, E), dtype=adt, buffer=nl.sbuf)           # 0/1 selection mask
    nisa.tensor_scalar(dst=sel, data=comp, op0=nl.greater_equal, operand0=ck)
    if S > k:
        cnt_ps = nl.ndarray((1, E), dtype=f32, buffer=nl.psum)
        nisa.nc_matmul(dst=cnt_ps, stationary=ones_t, moving=sel, accumulate=False)
        nrev = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)             # -(E - e)
        nisa.iota(dst=nrev, pattern=[[1, E]], offset=-E)
        other = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)            # (1 - sel_0) * (E - e)
        nisa.scalar_tensor_tensor(dst=other, data=sel[0:1, :], op0=nl.subtract, operand0=1.0, op1=nl.multiply,
                                  operand1=nrev)
        ukey = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)
        nisa.scalar_tensor_tensor(dst=ukey, data=cnt_ps, op0=nl.greater, operand0=0.0, op1=nl.multiply,
                                  operand1=other)
        for r in range(rounds):
            c0 = k + r * MAX8
            nisa.max8(dst=keys[:, c0:c0 + MAX8], src=ukey)
            n_r = min(MAX8, S - c0)
            nisa.tensor_scalar(dst=ids[:, c0:c0 + n_r], data=keys[:, c0:c0 + n_r], op0=nl.multiply, operand0=-1.0,
                               op1=nl.add, operand1=float(E))
            if r + 1 < rounds:
                nxt = nl.ndarray((1, E), dtype=f32, buffer=nl.sbuf)
                nisa.scalar_tensor_tensor(dst=nxt, data=ukey, op0=nl.less, operand0=keys[:, c0 + MAX8 - 1:c0 + MAX8],
                                          op1=nl.multiply, operand1=ukey)
                ukey = nxt
    trips = None
    if S > k:               # used[j]: conditional slot k + j is used (a prefix of them is)
        C = S - k
        L = LEVEL
        nl_ = -(-C // L)
        used = nl.ndarray((1, nl_ * L + 1), dtype=f32, buffer=nl.sbuf)
        nisa.memset(dst=used[:, C:nl_ * L + 1], value=0.0)
        nisa.tensor_scalar(dst=used[:, 0:C], data=keys[:, k:S], op0=nl.greater, operand0=0.0)
        lastu = nl.ndarray((1, nl_ * L), dtype=f32, buffer=nl.sbuf)     # slot k + j is the last used one
        nisa.tensor_tensor(dst=lastu, data1=used[:, 0:nl_ * L], data2=used[:, 1:nl_ * L + 1], op=nl.subtract)
        trips = nl.ndarray((1, nl_ * L), dtype=nl.int32, buffer=nl.sbuf, name=TRIPS_NAME)
        nisa.tensor_copy(dst=trips.ap(pattern=[[nl_ * L, 1], [L, nl_]], offset=0),
                         src=used.ap(pattern=[[nl_ * L + 1, 1], [L, nl_]], offset=L - 1))
        if L > 1:
            nisa.tensor_copy(dst=trips.ap(pattern=[[nl_ * L, 1], [L, nl_], [1, L - 1]], offset=1),
                             src=lastu.ap(pattern=[[nl_ * L, 1], [L, nl_], [1, L - 1]], offset=0))

    # renormalised weights, rounded to the activation dtype: w = sel * p / sum(v8[:k])
    vsum = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_reduce(dst=vsum, op=nl.add, data=v8[:, 0:k], axis=1)
    rv = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.reciprocal(dst=rv, data=vsum)
    w = nl.ndarray((T, E), dtype=adt, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=w, data=sel, op0=nl.multiply, operand0=rv, op1=nl.multiply, operand1=p)
    return gl, w, keys, ids, trips


def _shared_gate(gl):
    """[T, 1] f32 sigmoid of the gate logit gl [T, 1] as 1 / (1 + exp(-z)): exp keeps ACT on the softmax's
    table."""
    T = gl.shape[0]
    f32 = nl.float32
    ez = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=ez, op=nl.exp, data=gl, scale=-1.0)
    ez1 = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=ez1, data=ez, op0=nl.add, operand0=1.0)
    gate = nl.ndarray((T, 1), dtype=f32, buffer=nl.sbuf)
    nisa.reciprocal(dst=gate, data=ez1)
    return gate


def _slot_weights(w, keys, S):
    """wsel [T, S] f32: wsel[t, s] = w[t, id_s] (0 for a token that did not choose the slot's expert or an
    unused slot), by a one-hot matmul against the slots' keys E - id_s broadcast to every partition."""
    T, E = w.shape
    adt = w.dtype
    f32 = nl.float32
    ones_r = nl.ndarray((1, P), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=ones_r, value=1.0)
    kb = nl.ndarray((P, S), dtype=f32, buffer=nl.psum)            # keys broadcast to every partition
    nisa.nc_matmul(dst=kb, stationary=ones_r, moving=keys[:, 0:S], accumulate=False)
    ident = nl.shared_identity_matrix(T, dtype=adt)
    ws_ps = nl.ndarray((T, S), dtype=f32, buffer=nl.psum)
    n_chunks = -(-E // P)
    for c in range(n_chunks):
        pc = min(P, E - c * P)
        ecol = nl.ndarray((pc, 1), dtype=f32, buffer=nl.sbuf)       # E - e for the experts of this chunk
        nisa.iota(dst=ecol, pattern=[[0, 1]], offset=E - c * P, channel_multiplier=-1)
        onehot = nl.ndarray((pc, S), dtype=adt, buffer=nl.sbuf)
        nisa.tensor_scalar(dst=onehot, data=kb[0:pc, :], op0=nl.equal, operand0=ecol)
        wt_ps = nl.ndarray((pc, T), dtype=f32, buffer=nl.psum)    # w[:, chunk]^T via the identity
        nisa.nc_matmul(dst=wt_ps, stationary=w[:, c * P:c * P + pc], moving=ident, accumulate=False)
        wt = nl.ndarray((pc, T), dtype=adt, buffer=nl.sbuf)
        nisa.tensor_copy(dst=wt, src=wt_ps)
        nisa.nc_matmul(dst=ws_ps, stationary=wt, moving=onehot, accumulate=c > 0)
    wsel = nl.ndarray((T, S), dtype=f32, buffer=nl.sbuf)
    nisa.tensor_copy(dst=wsel, src=ws_ps)
    return wsel


def _fold_mask(ic, T):
    """[P, R*T] f32: mask[q, g*T + t] = 1 iff partition q belongs to row group g (q // ic == g)."""
    R = P // ic
    v = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.iota(dst=v, pattern=[[-ic, R], [0, T]], offset=0, channel_multiplier=1)     # q - g*ic
    lo = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.tensor_scalar(dst=lo, data=v, op0=nl.greater_equal, operand0=0.0)
    mask = nl.ndarray((P, R * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.scalar_tensor_tensor(dst=mask, data=v, op0=nl.less, operand0=float(ic), op1=nl.multiply, operand1=lo)
    return mask


def _row(t):
    """Elements per partition of the SBUF tile t."""
    n = 1
    for d in t.shape[1:]:
        n = n * d
    return n


def _pieces(geo):
    """How many contraction pieces each gate|up part moves in (GU_PIECES if it divides H/P, else 1)."""
    J = geo["off_d"] // (2 * geo["ic"])
    return GU_PIECES if J % GU_PIECES == 0 else 1


def _gu_cols(v, geo, j):
    """The moving operand [P, n, 2ic] of contraction block j of the n slots of the group view v = (tile, element
    offset, n): the group's region of n * F elements per partition holds, per contraction piece c (of
    :func:`_pieces`), the n slots' gate|up columns of that piece [P, H/P/pieces, 2ic] one after the other, then the
    slots' folded down parts [P, H/R] (a single block [P, F] is a group of one: its own host layout)."""
    t, o, n = v
    ic2 = 2 * geo["ic"]
    jc = geo["off_d"] // ic2 // _pieces(geo)
    c = j // jc
    return t.ap(pattern=[[_row(t), P], [jc * ic2, n], [1, ic2]], offset=o + (c * n * jc + j % jc) * ic2)


def _down_cols(v, geo, i, c0, cn):
    """Columns c0 .. c0 + cn - 1 of slot i's folded down part [P, H/R] in the group view v (:func:`_gu_cols`)."""
    t, o, n = v
    return t.ap(pattern=[[_row(t), P], [1, cn]], offset=o + n * geo["off_d"] + i * geo["HR"] + c0)


def _gate_up(xT, v, geo, n, j0=0, j1=None, gu=None):
    """PSUM [T, n, 2ic] f32: gate|up of the n slots of the group view v (:func:`_gu_cols`), ONE matmul per
    contraction block for all n slots (moving operand [P, n, 2ic], n * 2ic <= 512 columns). Blocks j0 .. j1 - 1
    only (default: all), into ``gu`` when given (a later part of the same accumulation, issued later in program
    order), else into a new PSUM tile."""
    _, J, T = xT.shape
    ic2 = 2 * geo["ic"]
    if gu == None:
        gu = nl.ndarray((T, n, ic2), dtype=nl.float32, buffer=nl.psum)
    if j1 == None:
        j1 = J
    for j in range(j0, j1):
        nisa.nc_matmul(dst=gu, stationary=xT[:, j, :], moving=_gu_cols(v, geo, j), accumulate=j > 0)
    return gu


def _down(gu, v, geo, n, wts, c0, mask, acc, first):
    """The rest of n slots after their gate|up (PSUM gu [T, n, 2ic]): :func:`_activate` then :func:`_project`."""
    aT = _activate(gu, geo, n, wts, c0)[0]
    _project(aT, v, geo, n, mask, acc, first)


def _activate(gu, geo, n, wts, c0, st=None, refill=None, sc=None):
    """The activations of n slots after their gate|up (PSUM gu [T, n, 2ic]): silu (ACT, all n at once), per slot
    a = silu(g) * w_tok * u on DVE (fp32; w_tok = wts[:, c0 + i], the slot's per-token weight) and one PE
    transpose into a^T. Returns (aT PSUM [P, n, T] f32 for :func:`_project`, the refill's ring view or None).
    ``refill``: a group (first slot, slots) whose DMAs are issued on ScalarE's queue right after the silu
    (:func:`_stream`, into ``st``'s ring). ``sc``: fp8 blocks (``FP8``) -- the n slots' scales [T, n, 2ic] fp32
    (:func:`expert_scales`), which multiply gu first (one DVE op: gate columns by theirs, up columns by up x
    down-row scales, so the down projection of the e4m3 rows needs no rescale)."""
    T = gu.shape[0]
    f32 = nl.float32
    ic, R = geo["ic"], geo["R"]
    if sc != None:
        gs = nl.ndarray((T, n, 2 * ic), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=gs, data1=gu, data2=sc, op=nl.multiply)
        gu = gs
    h = nl.ndarray((T, n, ic), dtype=f32, buffer=nl.sbuf)
    nisa.activation(dst=h, op=nl.silu, data=gu[:, :, 0:ic])
    view = None
    if refill != None:
        view = _issue(st, refill, nisa.engine.scalar)
        _flush(st)
    aT = nl.ndarray((P, n, T), dtype=f32, buffer=nl.psum)
    for i in range(n):
        a = nl.ndarray((T, R * ic), dtype=f32, buffer=nl.sbuf)      # silu(g) * w_tok * u, repeated R times
        nisa.scalar_tensor_tensor(dst=a, data=h.ap(pattern=[[n * ic, T], [0, R], [1, ic]], offset=i * ic),
                                  op0=nl.multiply, operand0=wts[:, c0 + i:c0 + i + 1], op1=nl.multiply,
                                  operand1=gu.ap(pattern=[[n * 2 * ic, T], [0, R], [1, ic]], offset=i * 2 * ic + ic))
        nisa.nc_transpose(dst=aT[:, i, :], data=a, engine=nisa.engine.tensor)
    return (aT, view)


def _project(aT, v, geo, n, mask, acc, first, per_slot=False):
    """The down projection of n slots from their a^T (PSUM [P, n, T], :func:`_activate`) and their group view v:
    one mask multiply into the block-diagonal stationaries z [P, n, R*T] (the activation dtype; bfloat16 beside
    fp8 blocks), and per slot one matmul per 512-column bank with the folded down block accumulated into acc
    (PSUM [R*T, H/R]; ``first``: the first matmul overwrites). ``per_slot``: one mask multiply per slot instead
    (a stream's last group: slot 0's matmuls need not wait for slot 1's transpose; same values)."""
    T = aT.shape[2]
    R = geo["R"]
    adt = v[0].dtype
    if adt == FP8:
        adt = nl.bfloat16          # fp8 blocks run with bfloat16 activations (moe_tkg_body checks)
    if geo["banks"] > 1:
        _down_banks(aT, v, geo, n, mask, acc, first, adt, per_slot)
        return
    z = nl.ndarray((P, n, R * T), dtype=adt, buffer=nl.sbuf)        # block-diagonal stationaries
    parts = [(0, n)]
    if per_slot:
        parts = _groups(0, n, 1)
    for part in parts:
        i0, m = part
        if R == 1:
            nisa.tensor_copy(dst=z[:, i0:i0 + m, :], src=aT[:, i0:i0 + m, :])
        else:
            nisa.tensor_tensor(dst=z[:, i0:i0 + m, :],
                               data1=aT.ap(pattern=[[n * T, P], [T, m], [0, R], [1, T]], offset=i0 * T),
                               data2=mask.ap(pattern=[[R * T, P], [0, m], [T, R], [1, T]], offset=0), op=nl.multiply)
    for i in range(n):
        for chunk in geo["chunks"]:
            cs, cn = chunk
            nisa.nc_matmul(dst=acc[:, cs:cs + cn], stationary=z[:, i, :], moving=_down_cols(v, geo, i, cs, cn),
                           accumulate=not first)
        first = False


def _down_banks(aT, v, geo, n, mask, acc, first, adt, per_slot=False):
    """:func:`_project`'s stationaries and matmuls into the bank-stacked accumulator acc PSUM ``[S*T, H/S]``
    (S = ``geo["banks"]``, ``stacked.fold_banks``): the block-diagonal stationary of slot i is placed once per
    column piece h (width W = H/S of the folded down block) at column offset h*R*T of an otherwise zero
    ``[P, S*T]``, so piece h of fold row group g lands in bank h*R + g: ONE multiply of a^T by the padded mask
    (:func:`_bank_mask`) writes every element, zeros included (no memset per group, so no WAR chain on the
    previous group's stationaries). Same moving columns as the folded layout (W = 512 at the real shapes: the same
    matmuls), one PSUM bank instead of H/R/512. ``adt``: the stationaries' dtype (the activation dtype; bfloat16
    beside fp8 blocks); ``per_slot``: one multiply per slot (:func:`_project`)."""
    T = aT.shape[2]
    R, S = geo["R"], geo["banks"]
    W = geo["HR"] * R // S
    Hb = S // R
    z = nl.ndarray((P, n, Hb, S * T), dtype=adt, buffer=nl.sbuf)     # zero-padded stationaries
    parts = [(0, n)]
    if per_slot:
        parts = _groups(0, n, 1)
    for part in parts:
        i0, m = part
        nisa.tensor_tensor(dst=z[:, i0:i0 + m, :, :],
                           data1=aT.ap(pattern=[[n * T, P], [T, m], [0, Hb * S], [1, T]], offset=i0 * T),
                           data2=mask.ap(pattern=[[Hb * S * T, P], [0, m], [S * T, Hb], [1, S * T]], offset=0),
                           op=nl.multiply)
    for i in range(n):
        for h in range(Hb):
            nisa.nc_matmul(dst=acc, stationary=z[:, i, h, :], moving=_down_cols(v, geo, i, h * W, W),
                           accumulate=not (first and h == 0))
        first = False


def _bank_mask(mask, R, S, T):
    """The fold mask ``[P, R*T]`` (:func:`_fold_mask`) padded for :func:`_down_banks`: ``[P, S/R, S*T]`` f32 with
    the mask at column offset h*R*T of row h, zeros elsewhere (once per body: a memset and one copy)."""
    Hb = S // R
    m = nl.ndarray((P, Hb, S * T), dtype=nl.float32, buffer=nl.sbuf)
    nisa.memset(dst=m, value=0.0, engine=nisa.engine.gpsimd)
    nisa.tensor_copy(dst=m.ap(pattern=[[Hb * S * T, P], [(S + R) * T, Hb], [1, R * T]], offset=0),
                     src=mask.ap(pattern=[[R * T, P], [0, Hb], [1, R * T]], offset=0), engine=nisa.engine.gpsimd)
    return m


def _place(st, n):
    """The first ring position p of the next group of n slots: positions p..p+n-1 from st["pos"] on (back to 0
    when the group would not fit before the end: a group is one contiguous view)."""
    Ns = st["ring"].shape[1]
    p = st["pos"]
    if p + n > Ns:
        p = 0
    st["pos"] = (p + n) % Ns
    return p


def _issue(st, group, engine=nisa.engine.unknown):
    """Place a group (first slot, slots) in the ring and DMA its gate|up parts: per slot, its expert id into a
    register (round robin over the id registers) that is the ``scalar_offset`` of the HWDGE DMAs of the expert's
    [P, F] block of this core; per contraction piece (:func:`_pieces`), every slot's piece of its gate|up part into
    the group's region (:func:`_gu_cols`); then the previous group's down rows, deferred by the previous call
    (:func:`_flush`), and this group's down rows are deferred in turn (issued by the next call or the flush ending
    the batch). All on ``engine``'s queue (e.g. ``nisa.engine.scalar``; ``engine.unknown``: the default queue),
    where DMAs move in order: a group's gate|up matmuls run while its later pieces and its down rows are in flight,
    and the last group of a batch has only its own and the previous group's down rows behind its gate|up. With fp8
    blocks the same register first addresses the expert's scales row of this core, broadcast to the T token
    partitions of the scale ring (a stride-0 HBM read, 2ic fp32 per token). Returns the group's (view (ring, element
    offset, n), scales view [T, n, 2ic] or None)."""
    s0, n = group
    F, off_d = st["F"], st["off_d"]
    ring = st["ring"]
    row = _row(ring)
    p = _place(st, n)
    sc = None
    if st["scales"] != None:
        sc = st["sc_ring"][:, p:p + n, :]
    pc = off_d // st["pieces"]     # elements per partition of one contraction piece of a gate|up part
    held = []               # slot i's id register
    for i in range(n):
        r = st["id_regs"][st["next"] % len(st["id_regs"])]
        st["next"] = st["next"] + 1
        nisa.register_load(r, st["ids"][0:1, s0 + i:s0 + i + 1])
        held.append(r)
        if sc != None:
            ssrc = st["scales"].ap(pattern=[[0, st["T"]], [1, st["ic2"]]], offset=st["sc_offset"], scalar_offset=r,
                                   indirect_dim=st["sc_edim"])
            nisa.dma_copy(dst=sc[:, i, :], src=ssrc, dge_mode=nisa.dge_mode.hwdge, engine=engine)
    for c in range(st["pieces"]):
        for i in range(n):
            r = _id_reg(st, held, s0, n, i)
            src = st["table"].ap(pattern=[[F, P], [1, pc]], offset=st["offset"] + c * pc, scalar_offset=r,
                                 indirect_dim=st["edim"])
            dst = ring.ap(pattern=[[row, P], [1, pc]], offset=p * F + (c * n + i) * pc)
            nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=engine)
    _flush(st)        # the previous group's down rows after this group's gate|up pieces
    st["pending"].append((s0, n, p, held, engine))
    return ((ring, p * F, n), sc)


def _flush(st):
    """Issue the down-row DMAs that :func:`_issue` deferred (the last group of a batch of consecutive issues: every
    batch ends with a flush, so no DMA is pending at a compute step or a loop boundary)."""
    for item in st["pending"]:
        _issue_down(st, item)
    st["pending"] = []


def _issue_down(st, item):
    """The down-row DMAs [P, H/R] of a group (first slot, slots, ring position, id registers, engine) into the
    group's down region (:func:`_gu_cols`)."""
    s0, n, p, held, engine = item
    F, off_d = st["F"], st["off_d"]
    ring = st["ring"]
    for i in range(n):
        r = _id_reg(st, held, s0, n, i)
        src = st["table"].ap(pattern=[[F, P], [1, F - off_d]], offset=st["offset"] + off_d, scalar_offset=r,
                             indirect_dim=st["edim"])
        dst = ring.ap(pattern=[[_row(ring), P], [1, F - off_d]], offset=p * F + n * off_d + i * (F - off_d))
        nisa.dma_copy(dst=dst, src=src, dge_mode=nisa.dge_mode.hwdge, engine=engine)


def _id_reg(st, held, s0, n, i):
    """Slot s0 + i's id register ``held[i]`` for a DMA of its block: loaded again when a later slot may have taken
    it over (fewer id registers than two groups' slots: a group's ids are all loaded before its first piece, and its
    down rows are issued after the next group's pieces)."""
    r = held[i]
    if 2 * st["G"] > len(st["id_regs"]):
        nisa.register_load(r, st["ids"][0:1, s0 + i:s0 + i + 1])
    return r


def _ahead(groups, Ns):
    """How many of the first groups fit in the ring of Ns slots together (their DMAs are issued up front)."""
    used = 0
    n = 0
    for group in groups:
        s0, c = group
        if used + c > Ns:
            break
        used = used + c
        n = n + 1
    return max(1, n)


def _stream(xT, st, groups, geo, wts, mask, acc, first, bufs):
    """Run ``groups`` (consecutive slot groups) through the ring: ``bufs`` holds the :func:`_issue` views of the groups
    issued before the call; the rest of the groups that fit in the ring are issued up front, every later one
    right after the down projection of the group whose ring positions it takes -- or, when more than ``WINDOW``
    of them fit, WINDOW groups up front and group g + WINDOW right after group g's silu (ScalarE-triggered, see
    :func:`_activate`). On the PE the first gate|up piece of group g + 1 is issued before group g's transposes and
    the rest of it after them (module docstring "Expert compute"). Accumulates into acc (``first``: the first
    matmul overwrites)."""
    ng = len(groups)
    ahead = max(len(bufs), _ahead(groups, st["ring"].shape[1]))
    lead = ahead
    if WINDOW < ahead:
        lead = max(len(bufs), WINDOW)
    views = []
    for g in range(ng):
        views.append(bufs[g] if g < len(bufs) else None)
    for g in range(len(bufs), min(lead, ng)):
        views[g] = _issue(st, groups[g])
    _flush(st)        # the last up-front group's down rows
    J = xT.shape[1]
    jp = J // _pieces(geo)      # contraction blocks in a gate|up part's first piece
    gu = _gate_up(xT, views[0][0], geo, groups[0][1])
    for g in range(ng):
        s0, n = groups[g]
        refill = None
        if lead < ahead and g + lead < ng:
            refill = groups[g + lead]
        gu_g = gu
        if g + 1 < ng:      # group g + 1's first contraction piece: its bytes land first
            gu = _gate_up(xT, views[g + 1][0], geo, groups[g + 1][1], 0, jp)
        a_v = _activate(gu_g, geo, n, wts, s0, st, refill, views[g][1])
        if g + 1 < ng:      # ... the rest after group g's transposes
            _gate_up(xT, views[g + 1][0], geo, groups[g + 1][1], jp, J, gu)
        if refill != None:
            views[g + lead] = a_v[1]
        _project(a_v[0], views[g][0], geo, n, mask, acc, first, g + 1 == ng)
        first = False
        views[g] = None
        if lead == ahead and g + ahead < ng:
            views[g + ahead] = _issue(st, groups[g + ahead])
            _flush(st)


def _conditional(xT, st, groups, geo, wts, mask, fold):
    """Conditional slot groups (inside their runtime loop): streamed into a PSUM accumulator of their own
    (allocated inside the loop: no PSUM value crosses a loop boundary, and it is released before any deeper
    loop starts), then added into the SBUF fold."""
    acc = nl.ndarray(fold.shape, dtype=nl.float32, buffer=nl.psum)
    _stream(xT, st, groups, geo, wts, mask, acc, True, [])
    nisa.tensor_tensor(dst=fold, data1=fold, data2=acc, op=nl.add)


def _conditional_levels(xT, st, q, geo, wts, mask, fold, trips, trip_regs):
    """The conditional slots from s = k + q L on (L = LEVEL) as NESTED runtime loops of 0 or 1 trips (the used
    slots are a prefix): the level s..s+L-1 runs iff all its slots are used (trips[qL]) and its body holds the
    deeper levels; otherwise exactly one of the L - 1 remainder loops after it runs, the one of r = the used
    slots of the level (trips[qL + r]: slot s + r - 1 is the last used one), streaming slots s..s+r-1. Every
    loop exit comes after all the work it encloses; deeper levels' DMAs are issued (in program order) as the
    ring frees while shallower levels compute, and each loop body streams its slots software-pipelined."""
    k, S, L = st["k"], st["S"], LEVEL
    s = k + q * L
    if s >= S:
        return
    regs_q = trip_regs[q]       # one register for all of the level's loops, or one per loop (loaded up front)
    loops = []              # the level's loops: 0 = the whole level, r = the remainder of r slots
    if s + L <= S:
        loops.append(0)
    for r in range(1, min(L - 1, S - s) + 1):
        loops.append(r)
    if len(regs_q) > 1:     # every trip count of the level before its first loop: none after a loop's exit fence
        for j in loops:
            nisa.register_load(regs_q[j], trips[0:1, q * L + j:q * L + j + 1])
    pos = st["pos"]
    G = st["G"]
    if s + L <= S:
        reg = _trip_reg(regs_q, trips, q * L)

        def level(i):
            _conditional(xT, st, _groups(s, s + L, G), geo, wts, mask, fold)
            _conditional_levels(xT, st, q + 1, geo, wts, mask, fold, trips, trip_regs)

        nl.fori_loop(0, reg, level)
    for r in range(1, min(L - 1, S - s) + 1):
        st["pos"] = pos         # an alternative of the level: the same ring positions
        reg = _trip_reg(regs_q, trips, q * L + r)

        def remainder(i):
            _conditional(xT, st, _groups(s, s + r, G), geo, wts, mask, fold)

        nl.fori_loop(0, reg, remainder)


def _trip_reg(regs_q, trips, j):
    """The register holding trip count ``trips[j]`` of a level's loop: the level's own register for it (loaded up
    front by :func:`_conditional_levels`), or the level's one shared register, loaded here."""
    if len(regs_q) == 1:
        nisa.register_load(regs_q[0], trips[0:1, j:j + 1])
        return regs_q[0]
    return regs_q[j % LEVEL]


def _check_scales(scales, experts, layer, adt, ic2):
    """The fp8 experts' scales table matches this layer's experts (one row of 2ic fp32 per expert and core), stacked
    like router / shared (``layer``)."""
    if adt != nl.bfloat16:
        raise ValueError(f"moe_tkg: {FP8} experts need bfloat16 activations, got {adt} (fp32 pairs only with fp32)")
    want = (experts.shape[0], experts.shape[1], ic2)
    got = tuple(scales.shape) if layer == None else tuple(scales.shape[1:])
    if scales.dtype != nl.float32 or got != want or (layer != None and not 0 <= layer < scales.shape[0]):
        raise ValueError(f"moe_tkg: scales {list(scales.shape)} {scales.dtype} (layer {layer}), expected "
                         f"{list(want)} float32 (stacked [M, ...] with layer=) for experts {list(experts.shape)} "
                         f"(expert_scales)")


def _acc_of(accs, R):
    """The accumulator entry ``[R, psum, sbuf fold]`` of fold factor R in ``accs``, or None."""
    for a in accs:
        if a[0] == R:
            return a
    return None


class MoEWeights(nl.NKIObject):
    """SBUF tiles of one layer's routing-independent MoE weights on this core (:func:`moe_weights`): ``router``
    [P, lnc, H/P, E/lnc + 1] (every core's router block: its experts' rows | the shared-expert gate) and ``shared``
    [P, 1, Fs] (this core's block of the shared expert)."""

    def __init__(self, router, shared):
        self.router = router
        self.shared = shared


def moe_weights(router, shared, layer=None):
    """Issue the DMAs of the whole router (every core's block: each core computes all E logits, so the cores need no
    exchange to route alike) and of this core's shared-expert block (one HWDGE DMA per block, contiguous runs per
    partition) into fresh SBUF tiles; returns :class:`MoEWeights` for ``moe_tkg_body(..., weights=)``. A megakernel
    calls it before the layer's post-attention norm so the 1.8 MiB per core fly under the mixer.
    router / shared as for :func:`moe_tkg_body` (stacked with ``layer``)."""
    router, shared = layer_of(router, layer), layer_of(shared, layer)
    _, pid = program_sharding()
    n_cores = router.shape[0]
    r_sb = nl.ndarray((P, n_cores, router.shape[2], router.shape[3]), dtype=router.dtype, buffer=nl.sbuf,
                      name="moe_router_w")
    for c in range(n_cores):
        nisa.dma_copy(dst=r_sb[:, c, :, :], src=router[c], dge_mode=nisa.dge_mode.hwdge)
    sh = nl.ndarray((P, 1, shared.shape[2]), dtype=shared.dtype, buffer=nl.sbuf, name="moe_shared_w")
    nisa.dma_copy(dst=sh[:, 0, :], src=shared[pid], dge_mode=nisa.dge_mode.hwdge)
    return MoEWeights(r_sb, sh)


def moe_tkg_body(xT, router, experts, shared, top_k, prefetch=8, regs=None, layer=None, experts_layer=None,
                 weights=None, scales=None, stack=1):
    """Sparse MoE of T tokens on one core: SBUF xT in, SBUF partial y out.

    xT:      SBUF [P, H/P, T] activation dtype (bfloat16 or float32), element (p, j, t) = x[t, j*P + p]
    router:  HBM [n_cores, P, H/P, E/n_cores + 1] (``router_block``): each core's router rows and the
             shared-expert gate (every core reads every block: :func:`moe_weights`)
    experts: HBM [E, n_cores, P, F] (``expert_blocks``), n_cores = the launch's LNC degree -- a whole
             tensor, or with ``experts_layer`` a stacked table [G, E, n_cores, P, F] of G layers (the
             run-time-addressed DMA uses ``.ap()``, which addresses the base tensor, not a view)
    shared:  HBM [n_cores, P, Fs] (``expert_blocks`` of the shared expert)
    top_k:   experts per token (<= 8); prefetch: expert blocks the ring holds (DMAs in flight)
    regs:    optional tuple of registers to reuse (a megakernel composing many layers passes one pool): at least
             one per nesting level of conditional slots plus one; with LEVEL per level plus 2 * group_size more,
             every loop gets its own trip register and no id register is reloaded; allocated here when None.
    layer:   with stacked router [M, ...] and shared [M, ...] (``megakernel.plan``), this layer's index in them.
    experts_layer: with a stacked experts table, this layer's index in it (nki_kernels/common.py "Stacked
             tensors"). None / None: one layer's tensors.
    weights: the :class:`MoEWeights` of this layer from :func:`moe_weights` (DMAs issued early by the caller),
             or None (issued here).
    scales:  the opt-in fp8 experts (module docstring "fp8 experts"): with ``experts`` of dtype ``FP8`` (and
             bfloat16 activations), HBM [E, n_cores, 2ic] float32 (:func:`expert_scales`), or stacked
             [M, E, n_cores, 2ic] like router / shared (with ``layer``: all MoE layers in one small table);
             None for experts in the activation dtype.
    stack:   S > 1: y comes bank-stacked, SBUF [S*T, H/S] (``nki_kernels.stacked``): when the fold maps onto
             the banks (``stacked.fold_banks``: R = 2, the real shapes) the down projections accumulate that layout
             directly (:func:`_down_banks`; one PSUM bank, no unfold), else the fold's unfold writes it.
    Returns y: SBUF [T, H] float32, this core's partial (sum over cores and ranks = MoE output).
    """
    _, J, T = xT.shape
    H = J * P
    adt = xT.dtype
    f32 = nl.float32
    stacked = experts
    if experts_layer != None:
        if len(experts.shape) != 5 or not 0 <= experts_layer < experts.shape[0]:
            raise ValueError(f"moe_tkg: layer {experts_layer} of stacked experts {list(experts.shape)}: expected "
                             f"[G, E, n_cores, {P}, F] with 0 <= layer < G")
    elif len(experts.shape) != 4:
        raise ValueError(f"moe_tkg: experts {list(experts.shape)}: expected [E, n_cores, {P}, F], or stacked "
                         f"[G, E, n_cores, {P}, F] with experts_layer=")
    router, shared = layer_of(router, layer), layer_of(shared, layer)
    n_elems = 1
    for d in stacked.shape:
        n_elems = n_elems * d
    if n_elems > INT32_MAX:
        raise ValueError(f"moe_tkg: the experts table {list(stacked.shape)} holds {n_elems} elements; its element "
                         f"offsets must fit int32 (SDK-LG 'NKI Values'): stack at most "
                         f"{layers_per_table(n_elems // stacked.shape[0])} layers per table (layers_per_table)")
    base = layer_offset(stacked, experts_layer)     # element offset of this layer's expert table in `stacked`
    experts = layer_of(stacked, experts_layer)
    if xT.shape[0] != P:
        raise ValueError(f"moe_tkg: xT has {xT.shape[0]} partitions, expected {P} (layout [P, H/P, T])")
    if adt not in (nl.bfloat16, nl.float32):
        raise ValueError(f"moe_tkg: activation dtype {adt} is not bfloat16 or float32")
    E, n_cores = experts.shape[0], experts.shape[1]
    if experts.shape[2] != P or E % n_cores or tuple(router.shape) != (n_cores, P, J, E // n_cores + 1):
        raise ValueError(f"moe_tkg: experts {list(experts.shape)} / router {list(router.shape)} do not match "
                         f"H={H}, E={E} (expected [E, n_cores, {P}, F] and [n_cores, {P}, {J}, E/n_cores + 1])")
    for nm_t in (("router", router), ("experts", experts), ("shared", shared)):
        nm, t = nm_t
        if t.dtype != adt and not (nm == "experts" and t.dtype == FP8):
            raise ValueError(f"moe_tkg: {nm} is {t.dtype} but the activations are {adt}; weights must match")
    if (experts.dtype == FP8) != (scales != None):
        raise ValueError(f"moe_tkg: experts are {experts.dtype} and scales are {'given' if scales != None else 'None'}"
                         f": {FP8} experts take a scales table (expert_scales), other experts none")
    if not 1 <= top_k <= MAX8 or E < MAX8 or E + n_cores > PSUM_BANK:     # the logits | gates: one PSUM bank
        raise ValueError(f"moe_tkg: top_k={top_k}, E={E}: need 1 <= top_k <= {MAX8} and {MAX8} <= E <= "
                         f"{PSUM_BANK} - n_cores")
    if not 1 <= T <= 16:
        raise ValueError(f"moe_tkg: {T} tokens; the decode kernel handles 1..16")
    check_stack(stack, T, H, "moe_tkg")
    lnc, pid = program_sharding()
    if n_cores != lnc or tuple(shared.shape[0:2]) != (lnc, P):
        raise ValueError(f"moe_tkg: weights laid out for {n_cores} cores (shared {list(shared.shape)}) but the "
                         f"launch has LNC={lnc}")
    geo = geometry(experts.shape[3], H, "expert")
    geo_s = geometry(shared.shape[2], H, "shared-expert")
    for g in (geo, geo_s):
        if g["R"] * T > P:
            raise ValueError(f"moe_tkg: {T} tokens x {g['R']} down-row groups exceed {P} output partitions")
        # stack > 1 and the fold maps onto the banks: the down projection accumulates the stacked layout itself
        g["banks"] = stack if stack > 1 and fold_banks(g["R"], stack) else 1
    F, Fs = geo["F"], geo_s["F"]
    S = min(T * top_k, E)
    G = group_size(geo["ic"])
    isz = 2 if adt == nl.bfloat16 else 4
    if scales != None:
        _check_scales(scales, experts, layer, adt, 2 * geo["ic"])
        isz = 1
    Ns = max(2 * G, min(-(-prefetch // G) * G, -(-S // G) * G, RING_BUDGET // (G * F * isz) * G))
    nq = -(-(S - top_k) // LEVEL)          # nesting levels of conditional slots
    need = nq + 1                           # one trip register per nesting level + at least one id register
    if regs == None:
        pool = []
        for i in range(nq * LEVEL + Ns):
            pool.append(nisa.register_alloc())
        regs = tuple(pool)
    if len(regs) < need:
        raise ValueError(f"moe_tkg: {len(regs)} registers given, the body needs at least {need} for T={T}")

    # 1. the expert ring first (first fit puts it where the caller's just-freed temporaries were: its first
    # write comes after the routing, so the wait for their last reader costs nothing); the weights that do not
    # depend on the routing -- router (+gate) and the shared expert -- unless the caller prefetched them
    # (moe_weights); and the ACT's exp table is loaded while they fly (the softmax's exp is on the critical path)
    ring = nl.ndarray((P, Ns, F), dtype=experts.dtype, buffer=nl.sbuf, name="moe_expert_ring")
    sc_ring = None
    if scales != None:      # the slots' fp8 scales, ring position for ring position
        sc_ring = nl.ndarray((T, Ns, 2 * geo["ic"]), dtype=f32, buffer=nl.sbuf, name="moe_scale_ring")
    if weights == None:
        weights = moe_weights(router, shared)
    r_sb, sh = weights.router, weights.shared
    if tuple(r_sb.shape) != (P, lnc, J, E // lnc + 1) or tuple(sh.shape) != (P, 1, Fs):
        raise ValueError(f"moe_tkg: prefetched weights {list(r_sb.shape)} / {list(sh.shape)} do not match "
                         f"[{P}, {lnc}, {J}, {E // lnc + 1}] / [{P}, 1, {Fs}]")
    warm = nl.ndarray((1, 1), dtype=f32, buffer=nl.sbuf)
    nisa.memset(dst=warm, value=0.0)
    nisa.activation(dst=warm, op=nl.exp, data=warm)

    # 2. routing; the shared expert's gate|up is issued on the PE between the router matmuls and the routing's
    # own later matmuls (the PE would otherwise idle while DVE ranks the experts)
    lg_ps = _router_logits(xT, r_sb)
    sh_v = (sh, 0, 1)       # the shared block [P, 1, Fs] as a group view of one slot (_gu_cols)
    gu_s = _gate_up(xT, sh_v, geo_s, 1)
    gl, w, keys, ids, trips = _top_k(lg_ps, top_k, S, pid, adt)

    # 3. the expert stream through the ring of Ns slot buffers; the always-valid slots 0..k-1 first
    per = 1                 # trip registers per level: one per loop when the pool also leaves two groups' id registers
    if len(regs) >= nq * LEVEL + 2 * G:
        per = LEVEL
    trip_regs = []
    for q in range(nq):
        trip_regs.append(tuple(regs[q * per:(q + 1) * per]))
    st = {"table": stacked, "offset": base + pid * P * F, "edim": 0 if experts_layer == None else 1, "F": F,
          "off_d": geo["off_d"], "pieces": _pieces(geo), "pending": [],
          "ring": ring, "pos": 0, "id_regs": regs[nq * per:], "next": 0, "ids": ids, "k": top_k, "S": S, "G": G,
          "scales": scales, "sc_ring": sc_ring, "T": T, "ic2": 2 * geo["ic"],
          "sc_offset": 0 if scales == None else layer_offset(scales, layer) + pid * 2 * geo["ic"],
          "sc_edim": 0 if layer == None else 1}
    static = _groups(0, top_k, G)
    first_bufs = []
    for g in range(min(_ahead(static, Ns), len(static), WINDOW)):     # DMAs as soon as the ids are known
        first_bufs.append(_issue(st, static[g]))
    _flush(st)
    gate = _shared_gate(gl)
    wsel = _slot_weights(w, keys, S)

    # 4. the shared expert (weighted by its gate) and the always-valid slots accumulate in PSUM: one
    # accumulation group per fold factor R, with no runtime loop inside it
    accs = []               # [R, PSUM accumulator, SBUF fold]
    for g in (geo_s, geo):
        if _acc_of(accs, g["R"]) == None:
            shape = (stack * T, H // stack) if g["banks"] > 1 else (g["R"] * T, g["HR"])
            accs.append([g["R"], nl.ndarray(shape, dtype=f32, buffer=nl.psum), None])
    mask_s = _fold_mask(geo_s["ic"], T) if geo_s["R"] > 1 else None
    if geo["ic"] == geo_s["ic"]:
        mask = mask_s
    else:
        mask = _fold_mask(geo["ic"], T) if geo["R"] > 1 else None
    if geo_s["banks"] > 1:
        mask_s = _bank_mask(mask_s, geo_s["R"], stack, T)
    if geo["banks"] > 1:
        mask = mask_s if geo["ic"] == geo_s["ic"] else _bank_mask(mask, geo["R"], stack, T)
    acc_s = _acc_of(accs, geo_s["R"])
    _down(gu_s, sh_v, geo_s, 1, gate, 0, mask_s, acc_s[1], True)
    _stream(xT, st, static, geo, wsel, mask, _acc_of(accs, geo["R"])[1], geo["R"] != geo_s["R"], first_bufs)
    for a in accs:          # evict every accumulator before the first runtime loop
        a[2] = nl.ndarray(tuple(a[1].shape), dtype=f32, buffer=nl.sbuf)
        nisa.tensor_copy(dst=a[2], src=a[1])
        a[1] = None

    # 5. the conditional slots k..S-1 (nested 0/1-trip loops, pairs then the odd last slot), each group into a
    # PSUM bank of its own added into the SBUF fold (loop state stays in SBUF)
    if trips != None:
        _conditional_levels(xT, st, 0, geo, wsel, mask, _acc_of(accs, geo["R"])[2], trips, trip_regs)

    # 6. fold back: y[t, g*H/R + c] = fold[g*T + t, c] (stack > 1: into the bank-stacked layout, stacked.unfold)
    parts = []
    for a in accs:
        R, fold = a[0], a[2]
        if stack > 1 and fold_banks(R, stack):      # stacked already (_down_banks)
            parts.append(fold)
            continue
        if stack > 1:
            ys = nl.ndarray((stack * T, H // stack), dtype=f32, buffer=nl.sbuf)
            unfold(fold, R, stack, T, ys, nisa.engine.scalar)
            parts.append(ys)
            continue
        if R == 1:
            parts.append(fold)
            continue
        yR = nl.ndarray((T, H), dtype=f32, buffer=nl.sbuf)
        HR = H // R
        for g in range(R):
            nisa.dma_copy(dst=yR[:, g * HR:(g + 1) * HR], src=fold[g * T:(g + 1) * T, :])
        parts.append(yR)
    y = parts[0]
    for extra in parts[1:]:
        total = nl.ndarray(y.shape, dtype=f32, buffer=nl.sbuf)
        nisa.tensor_tensor(dst=total, data1=y, data2=extra, op=nl.add)
        y = total
    return y


@nki.jit
def moe_tkg(x, router, experts, shared, top_k, prefetch=8, scales=None):
    """HBM wrapper of :func:`moe_tkg_body`: x [T, H] (activation dtype) -> per-core partials
    [n_cores, T, H] float32 (core c writes row c; the rank's partial is their sum).
    Weights from :func:`moe_hbm_layout` for the launch's LNC degree (``scales``: its fp8 experts' table)."""
    T, H = x.shape
    if H % P:
        raise ValueError(f"moe_tkg: hidden size {H} is not a multiple of {P}")
    lnc, pid = program_sharding()
    out = nl.ndarray((lnc, T, H), dtype=nl.float32, buffer=nl.shared_hbm)
    xT = nl.ndarray((P, H // P, T), dtype=x.dtype, buffer=nl.sbuf)
    nisa.dma_copy(dst=xT, src=x.ap(pattern=[[1, P], [P, H // P], [H, T]], offset=0))
    y = moe_tkg_body(xT, router, experts, shared, top_k, prefetch, scales=scales)
    nisa.dma_copy(dst=out[pid], src=y)
    return out


# ---------------------------------------------------------------------------------------------
# trace helpers
# ---------------------------------------------------------------------------------------------

def routed_expert_bytes(trace, rank=None):
    """HBM bytes read by the routed-expert DMAs (the scalar-offset reads of the experts table and, with fp8
    experts, of its scales table) in an nkisim trace, summed over the cores (and ranks, unless ``rank`` is given)."""
    total = 0
    for r in trace.instructions:
        if r["op"] != "dma_copy" or (rank is not None and r.get("rank") != rank):
            continue
        src = [g for g in r["reads"] if g["arg"] == "src"]
        if src and src[0].get("indirect") == "scalar":
            total += r["bytes"].get(src[0]["mem"], {}).get("read", 0)
    return total


def expert_block_bytes(cfg, tp=4, dtype="bfloat16"):
    """Bytes one rank reads for one routed expert (all its cores): 3 * H * I/tp elements (of ``dtype``: the
    experts' dtype, bfloat16, float32 or ``FP8``)."""
    isz = {"bfloat16": 2, "float32": 4, FP8: 1}[dtype]
    return 3 * cfg.hidden_size * (cfg.moe_intermediate_size // tp) * isz
