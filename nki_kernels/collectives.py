"""SBUF collectives across the TP x LNC = 4 x 2 physical cores: the megakernel's building blocks.

Communication model (nkisim/README.md "Multi-rank launch", SDK-CC, ref §5.10):

* ``nki.collectives`` run over *ranks* (logical cores). Under LNC=2 each physical core issues its own
  collective with its own SBUF buffers, and core c meets core c of the other ranks -- two independent
  "lanes" of 4 members. The two cores of one rank talk through ``nisa.sendrecv``.
* So an 8-core reduction is: ONE collective per lane (both lanes concurrently, ~13 us of fixed latency
  each on trn2, trn2-costs "TP all-reduce ... 13,331 ns") + ONE intra-rank ``sendrecv`` (~0.35 us) +
  one local combine. At TP = 1 (``rg=None``) the collective is skipped (trn2-costs: a NEFF with
  collectives and no communicator fails to load); at LNC = 1 the sendrecv is skipped.
* Global core order: ``g = rank * lnc + core``. The LM head's vocabulary shard of core g starts at
  ``g * Vc`` (nki_kernels/README.md).

Determinism (fixed order, bit-identical on every core and every run):
``allreduce_partials`` returns ``(((y_r0 + y_r1) + y_r2) + y_r3)|lane 0  +  (...)|lane 1`` -- each lane's
collective folds ranks in ascending rank id in fp32 and rounds once (nkisim's documented model; the real
CC-core order is not documented, ref §12), then the two lane sums are added with one fp32 DVE add. Both
cores add the same two operands; fp32 addition is commutative, so both get the same bits.

Collectives per decoder layer -- the minimum for this sharding is TWO reductions per layer:
  1. after the mixer (GDN or attention): ``x += allreduce(mixer partials)``;
  2. after the MoE: ``x += allreduce(MoE partials)``.
Each is 1 CC all-reduce per lane (in parallel) + 1 sendrecv + 1 add (in the megakernel the add is
taken twice: the next norm adds the transposed lanes itself, ``allreduce_lanes`` + ``rmsnorm.residual_rmsnorm_body``,
and the residual's own ``combine_lanes`` add runs later, off the critical path). Folding both into one reduction per
layer (trn2-costs finding #1(b)) does not work here: the MoE reads the post-attention RMSNorm of the
FULL ``u = x + sum_c a_c`` -- every core needs every element of it, because the router dots the whole
vector (then a nonlinear top-k) and every core's expert shard (G_c, U_c: [I/8, H]) contracts over all of
H. Precomputing "the attention partial's contribution to the norm statistics" only gives the scalar
``mean(u^2)``; the MoE still needs u itself, which is exactly the all-reduce. The same argument puts a
reduction between the MoE and the next layer's input norm. Removing one would take redundant compute
(every core computing the whole o_proj: +14 MB weight reads per core per layer, ~45 us, vs one ~13 us
collective) or a row-parallel MoE (a reduce-scatter + a norm-statistics all-reduce: more collectives,
not fewer). The real levers are scheduling (finding #1(a): stream the next weights during the all-reduce
window) and keeping each reduction to one collective + one sendrecv, as here.
Collective forms compared (issue 15). (a) This one: a 4-rank mesh all-reduce per core + an intra-rank sendrecv +
an add. It is the measured form: trn2-costs' 13,331 ns "TP all-reduce, nccl Mesh" row comes from a public Qwen3.6
round kernel whose reductions are exactly that -- per core, ``nccl.all_reduce`` over the replica group of the 4 TP
ranks, then a sendrecv with the LNC peer (there a gather of the peer's H-half, bf16, 4 KiB per core at T = 2; here
an add of the peer's full-H fp32 lane, 16 KiB: the bytes term is ~0.04 us either way). (b) One 8-core collective:
not expressible at LNC = 2 -- collectives run over ranks, the 4 logical cores of the chip (SDK nki.collectives:
"4 under LNC=2"). (c) Rings of sendrecv / collective_permute: nothing measured (the only sendrecv figure is
intra-LNC; permutes are costed as an all-gather, 24 us, by assumption), so the model cannot rank them honestly.

Per round: verify 40 layers x 2 = 80 reductions, each MTP pass 2, plus ONE packed ``(value, index)``
collective per LM-head evaluation (``argmax_combine``, finding #11) -- never two.

Layouts (nki_kernels/README.md): partial ``y`` SBUF ``[T, H]`` float32, token-major, or in the megakernel
bank-stacked ``[S*T, H/S]`` (nki_kernels/stacked.py; every function here is elementwise over y); LM-head winner
``best`` SBUF ``[T, 2]`` float32 ``(value, local index)``. Collective operands must be dense 2-D SBUF
tiles (MK: "nccl SBUF all-reduce needs a densely packed operand").

Cost note: the lane combine is a DVE add over ``[T, H]`` -- DVE time grows with the free size, not the
partitions (trn2-costs calibration: ~0.15 us + 1.04 ns/element), so ~2.3 us at H = 2048 whatever T is.
It is the same one add the sendrecv-first order would need; only a producer-side layout with H spread
over more partitions makes it cheaper: the megakernel's bank-stacked partials ``[4T, H/4]`` (0.68 us; the
same bytes, so the same collective cost).
"""

from __future__ import annotations

import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl

from nki_kernels.common import program_sharding
from nki_kernels.lm_head import select_max_lowest_index


def tp_group(tp: int):
    """The replica group of all TP ranks (``ReplicaGroup([[0, .., tp-1]])``), or None at TP = 1."""
    return ncc.ReplicaGroup([list(range(tp))]) if tp > 1 else None


def _check_group(rg, tp, where):
    """rg must be ``tp_group(tp)``: None exactly when tp == 1 (a ReplicaGroup exposes no attributes in the
    NKI 0.6 API, so the group's size travels as the compile-time int ``tp``)."""
    if tp < 1 or (rg == None) != (tp == 1):
        raise ValueError(f"{where}: replica group and tp={tp} disagree (pass rg = tp_group(tp): None iff tp == 1)")


def _dense(t, where):
    """t itself if it is a dense 2-D SBUF tile starting at its storage's first element, else a copy
    (collectives need densely packed operands; ``.ap()`` offsets below count from the storage start)."""
    if len(t.shape) != 2:
        raise ValueError(f"{where}: expected a 2-D SBUF tile, got shape {list(t.shape)}")
    if t.buffer != nl.sbuf:
        raise ValueError(f"{where}: operand must be in SBUF, got {t.buffer}")
    if not t.is_contiguous() or t.offset != 0:
        d = nl.ndarray(t.shape, t.dtype, buffer=nl.sbuf, name="cc_dense")
        nisa.tensor_copy(dst=d, src=t)
        return d
    return t


def _rank_slots(x, tp, name):
    """``[T, tp*F]`` tile holding x in this rank's slot (block ``rank_id``) and 0 elsewhere: one GpSimd
    affine_select against the run-time rank register, no data-dependent branch. x: dense ``[T, F]``."""
    T, F = x.shape
    slots = nl.ndarray((T, tp * F), x.dtype, buffer=nl.sbuf, name=name)
    nisa.affine_select(dst=slots.reshape((T, tp, F)), pattern=[[-1, tp], [0, F]], channel_multiplier=0,
                       on_true_tile=x.ap(pattern=[[F, T], [0, tp], [1, F]], offset=0), on_false_value=0.0,
                       cmp_op=nl.equal, offset=ncc.rank_id())
    return slots


def allreduce_partials(y, rg, pipe_id: int = 0):
    """Sum every core's partial ``y`` over all TP x LNC cores.

    y:  SBUF ``[T, H]`` float32, this core's partial (dense; a view is copied first), or any other layout of
        the same elements (the megakernel's bank-stacked ``[S*T, H/S]``): the result has y's shape.
    rg: ``tp_group(tp)`` (None at TP = 1: no collective).
    pipe_id: sendrecv pipe for the intra-rank exchange (distinct from any concurrently open pipe).
    Returns SBUF ``[T, H]`` float32, identical bits on every core: lane sums over ranks in ascending
    order, then ``lane0 + lane1``. Cost: 1 all-reduce per lane + 1 sendrecv + 1 DVE add.
    """
    return combine_lanes(allreduce_lanes(y, rg, pipe_id))


def allreduce_lanes(y, rg, pipe_id: int = 0):
    """:func:`allreduce_partials` without its final add: ``(lane, peer)``, this core's lane sum and the other
    core's (peer None at LNC = 1), float32 in y's shape. For a consumer that adds them itself
    (``rmsnorm.residual_rmsnorm_body`` does, in the norm's feature-major layout); ``lane + peer`` is
    commutative, so both cores of a rank get the same bits whichever operand comes first."""
    y = _dense(y, "allreduce_partials")
    if y.dtype != nl.float32:
        raise TypeError(f"allreduce_partials: partials must be float32 (PSUM-accumulated), got {y.dtype}")
    T, H = y.shape
    lnc, pid = program_sharding()
    if rg != None:
        lane = nl.ndarray((T, H), nl.float32, buffer=nl.sbuf, name="ar_lane_sum")
        ncc.all_reduce(srcs=[y], dsts=[lane], replica_group=rg, op=nl.add)
    else:
        lane = y
    if lnc == 1:
        return (lane, None)
    peer = nl.ndarray((T, H), nl.float32, buffer=nl.sbuf, name="ar_peer_lane")
    nisa.sendrecv(src=lane, dst=peer, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=pipe_id)
    return (lane, peer)


def combine_lanes(lanes):
    """``lane + peer`` of :func:`allreduce_lanes` (one fp32 DVE add; the lane itself at LNC = 1)."""
    lane = lanes[0]
    peer = lanes[1]
    if peer == None:
        return lane
    total = nl.ndarray(tuple(lane.shape), nl.float32, buffer=nl.sbuf, name="ar_total")
    nisa.tensor_tensor(dst=total, data1=lane, data2=peer, op=nl.add)       # commutative: same bits on both cores
    return total


def allgather_cores(x, rg, tp: int, pipe_id: int = 0, via_all_reduce: bool = True, dtype=None):
    """Concatenate every core's ``x [T, F]`` along the free axis in global core order.

    rg, tp: ``tp_group(tp)`` and the TP degree (compile time).
    dtype: the result's dtype (None: x's); the gather's own copies round to it (RNE), so a caller that needs the
    result in another dtype pays no extra copy.
    Returns SBUF ``[T, n*F]`` (n = tp * lnc), block g = core ``g = rank*lnc + core``'s x; same bits on
    every core. Cost: 1 collective per lane + 1 sendrecv + lnc strided copies.

    via_all_reduce (default): the lane collective is an all-reduce (add) of ``[T, tp*F]`` tiles holding x in
    the caller's rank slot and zeros elsewhere -- each slot sums exactly one non-zero term, so values
    (incl. inf/NaN) arrive bit-exact except -0.0, which arrives as +0.0. trn2 measured the small mesh
    all-reduce at 13.3 us vs 22-35 us for a tiny ring all-gather (trn2-costs). via_all_reduce=False:
    ``ncc.all_gather`` (bit-exact for every value, moves tp times fewer bytes).
    """
    _check_group(rg, tp, "allgather_cores")
    x = _dense(x, "allgather_cores")
    T, F = x.shape
    lnc, pid = program_sharding()
    if rg != None:
        lane = nl.ndarray((T, tp * F), x.dtype, buffer=nl.sbuf, name="ag_lane")
        if via_all_reduce:
            ncc.all_reduce(srcs=[_rank_slots(x, tp, "ag_slots")], dsts=[lane], replica_group=rg, op=nl.add)
        else:
            ncc.all_gather(srcs=[x], dsts=[lane], replica_group=rg, collective_dim=1)
    else:
        lane = x
    out_dtype = x.dtype if dtype == None else dtype
    out = nl.ndarray((T, tp * lnc * F), out_dtype, buffer=nl.sbuf, name="ag_all")
    if lnc == 1:
        if out_dtype == x.dtype:
            return lane
        nisa.tensor_copy(dst=out, src=lane)
        return out
    peer = nl.ndarray((T, tp * F), x.dtype, buffer=nl.sbuf, name="ag_peer_lane")
    nisa.sendrecv(src=lane, dst=peer, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=pipe_id)
    o4 = out.reshape((T, tp, lnc, F))
    nisa.tensor_copy(dst=o4[:, :, pid, :], src=lane.reshape((T, tp, F)))
    nisa.tensor_copy(dst=o4[:, :, 1 - pid, :], src=peer.reshape((T, tp, F)))
    return out


def argmax_combine(best, vc: int, rg, tp: int, pipe_id: int = 0):
    """Global greedy token from every core's LM-head winner, with ONE packed collective.

    best: SBUF ``[T, 2]`` float32 ``(value, local index)`` from ``lm_head_argmax_body(..., index_base=0)``.
    vc:   vocabulary rows per core; core g's local index i is global index ``g*vc + i``.
    rg, tp: ``tp_group(tp)`` and the TP degree (compile time).
    Returns SBUF ``[T, 2]`` float32 ``(max logit, lowest global index holding it)`` -- torch.argmax over
    the full vocabulary -- identical on every core.

    The (value, index) pair travels packed, once (trn2-costs finding #11), and as an ALL-REDUCE, not an
    all-gather: each core writes its pair into its rank's slot of a zero ``[T, 2*tp]`` tile
    (one ``affine_select`` against ``ncc.rank_id()``, no data-dependent branch) and the lane all-reduce
    (add) of those tiles IS the gather -- every slot receives exactly one non-zero term, so it is exact for
    finite values (a -0.0 logit arrives as +0.0, which compares equal). trn2 measured a small mesh
    all-reduce at 13.3 us and a tiny ring all-gather at 22-35 us (trn2-costs), i.e. ~11 us saved per
    LM-head evaluation. Then 1 sendrecv joins the two lanes, and ~8 small ops pick the winner.
    """
    if tuple(best.shape[1:]) != (2,) or best.dtype != nl.float32:
        raise ValueError(f"argmax_combine: best must be [T, 2] float32 (value, index), got {list(best.shape)} "
                         f"{best.dtype}")
    _check_group(rg, tp, "argmax_combine")
    best = _dense(best, "argmax_combine")
    T = best.shape[0]
    lnc, pid = program_sharding()
    n = tp * lnc
    if n * vc >= 2 ** 24:
        raise ValueError(f"argmax_combine: global indices up to {n * vc} are not exact in fp32")
    if rg != None:
        lane = nl.ndarray((T, 2 * tp), nl.float32, buffer=nl.sbuf, name="am_lane")
        ncc.all_reduce(srcs=[_rank_slots(best, tp, "am_slots")], dsts=[lane], replica_group=rg, op=nl.add)
    else:
        lane = best
    lanes = [(pid, lane)]
    if lnc == 2:
        peer = nl.ndarray((T, 2 * tp), nl.float32, buffer=nl.sbuf, name="am_peer_lane")
        nisa.sendrecv(src=lane, dst=peer, send_to_rank=1 - pid, recv_from_rank=1 - pid, pipe_id=pipe_id)
        lanes.append((1 - pid, peer))
    # candidates, column c*tp + r = core g = r*lnc + c
    vals = nl.ndarray((T, n), nl.float32, buffer=nl.sbuf, name="am_vals")
    idx = nl.ndarray((T, n), nl.float32, buffer=nl.sbuf, name="am_idx")
    for c_src in lanes:
        c, src = c_src
        pairs = src.reshape((T, tp, 2))
        nisa.tensor_copy(dst=vals[:, c * tp:(c + 1) * tp], src=pairs[:, :, 0])
        nisa.tensor_copy(dst=idx[:, c * tp:(c + 1) * tp], src=pairs[:, :, 1])
    base = nl.ndarray((T, n), nl.float32, buffer=nl.sbuf, name="am_core_base")
    nisa.iota(dst=base, pattern=[[vc, lnc], [lnc * vc, tp]], offset=0, channel_multiplier=0)   # (r*lnc + c)*vc
    nisa.tensor_tensor(dst=idx, data1=idx, data2=base, op=nl.add)
    out = nl.ndarray((T, 2), nl.float32, buffer=nl.sbuf, name="am_global_best")
    return select_max_lowest_index(out, vals, idx)
