"""The round megakernel and the step kernel: a ``megakernel.plan.Plan`` run in ONE launch per rank.

``round_kernel`` runs a round plan (K chained D1 drafts, a verify of the trunk on K + 1 tokens, D2 replay),
``step_kernel`` a step plan (the trunk on the pending token); both are composed of the subkernel bodies of
``nki_kernels`` (no copies of them) and walk the plan's stages and layers (``run_plan``). With the pending token
x_{t+1} at position p and h_t the trunk's post-norm hidden at position t:

* D1 (:func:`draft`, once per draft i = 0..K-1): embed(token), the two MTP pre-fc norms, ``mtp_fc`` (columns split
  over the cores, gathered), the MTP layer (gated attention with its KV cache at p - 1 + i, MoE), ``mtp.norm``, LM
  head and global argmax -> draft d_{i+1} (or the host's forced draft, for tests; selected arithmetically, no
  branch). Draft 0 runs on (x_{t+1}, h_t), draft i > 0 on (d_i, draft i-1's ``mtp.norm`` output).
* V (:func:`verify`): the residual ``x [T, H]`` (T = K + 1: [x_{t+1}, d_1 .. d_K]) stays in SBUF across all
  layers, bank-stacked (``[S*T, H/S]``, ``RESIDUAL_BANKS``, nki_kernels/stacked.py; so are the MTP layer's residual
  and every partial); after every mixer and every MoE the core partials are all-reduced over the TP x LNC cores;
  KV rows are written in place; every GDN layer writes its per-token checkpoints; final norm; LM head and argmax
  for every position -> targets; the post-norm hidden goes back to the host.
* D2 (:func:`replay`): the MTP head's K / V rows on ([d_1 .. d_K], [h_{t+1} .. h_{t+K}]) at positions p .. p + K - 1,
  which the next round needs for the accepted drafts: the head's input, its input norm and the K / V projections
  only (nothing reads the rest of the layer); no LM head. It needs the verify's hiddens, not its targets, so it is
  emitted inside the verify's LM head (:class:`ReplayInHead`), where it runs on the engines the weight stream
  leaves idle.

Parameters (hand-written, fixed): the plan (compile time), the stacked per-rank weights and decode state of
``megakernel.plan`` (``WEIGHTS``, ``STATE``, experts tables ``moe_experts_0..4``, unused tables None) and the
run-time inputs of ``plan.input_specs`` -- 36 HBM tensors for a round of Qwen3.6 at TP=4 x LNC=2. Inside, the
tensors travel as one :class:`LaunchTensors` object. The decode state is written in place and also returned,
after ``draft``, ``targets``, ``hidden``, so the compiler keeps the writes.

Device-side accept and commit (``plan.device_commit``, opt-in; ``megakernel.plan`` module docstring): the round
takes ``force``, the decode-control state ``control`` / ``control_hidden`` and the RoPE tables ``rope_cos`` /
``rope_sin`` instead of the other run-time inputs (those parameters are None). :func:`control_inputs` reads the
pending token, read slot, position and h_{p-1} (row read_slot of ``control_hidden``) at the launch top;
:func:`_control_rows` builds each stage's positions and RoPE rows when the stage first needs them (register offsets
into the tables, no branch); :func:`commit` accepts right after the verify (arithmetic selection: a prefix product
of draft == target, a one-hot of the last committed token) and writes the next round's control state (D2, which
reads no control state, ran inside the verify's LM head); the launch also returns ``emitted``, then the control
state. A sampled device-committed round takes
``noise_v`` / ``noise_d1`` as a noise window (``plan.noise_window_specs``): :func:`control_inputs` computes the
entry pos & (W - 1), the first LM head loads it into a register (:func:`_noise_slot`) and the LM heads' noise DMAs
read that entry (:func:`_window_entry`); the accept is the same equality test (the shared-Gumbel rule,
``harness.sampling``).
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from megakernel.plan import ATTENTION, DRAFT, MOE_PREFETCH, REPLAY, VERIFY
from nki_kernels.attention import (ATTENTION_REGISTERS, attention_body, attention_ring, kv_rows_inputs,
                                   kv_rows_project, kv_rows_write)
from nki_kernels.collectives import allgather_cores, allreduce_lanes, argmax_combine, combine_lanes, tp_group
from nki_kernels.common import P, carve, kernel_assert, program_sharding
from nki_kernels.embedding import embedding_body, load_token_ids, subset_ids_from_best, token_ids_from_best
from nki_kernels.gdn import gdn_body, gdn_out_proj, gdn_weight_tiles, gdn_weights
from nki_kernels.linear import columns_body, columns_weight, token_major
from nki_kernels.lm_head import NB, lm_head_argmax_body, lm_head_ring, ring_depth
from nki_kernels.moe import moe_tkg_body, moe_weights
from nki_kernels.rmsnorm import residual_rmsnorm_body, rmsnorm_body
from nki_kernels.stacked import banks_for, stack_rows

# Banks of the residual's bank-stacked layout (nki_kernels/stacked.py; issue 15, bench/decode_speed.md lever 22):
# the residual and every partial are [S*T, H/S] across the stages' layers, so the lane combine and the residual
# add are DVE ops of H/S columns and the norm transposes H/S/128 tiles. S = 4: one PSUM bank (512 fp32) per
# partial. A hidden size that does not split into banks of a multiple of 128 columns stays token-major.
RESIDUAL_BANKS = 4
# The verify LM-head vocab blocks after which D2's phases 1, 2, 3 are emitted (phase 0 runs before the final norm;
# ReplayInHead; bench/decode_speed.md levers 27, 35 and 45: each phase's inputs are in by then, so none of its
# instructions waits at an engine queue's head in front of the head's)
REPLAY_PHASES = (10, 20, 30)
REPLAY_QUEUE = nisa.engine.scalar   # phase 0's DMAs (weights, tables, p): not in the default queue ahead of the
#                                     LM head's blocks


class LaunchTensors(nl.NKIObject):
    """The HBM tensors of one launch by role (the kernel's parameters; None where a launch has none)."""

    def __init__(self, embed, lm_head, norms, mtp_fc, gdn, attn, moe_router, moe_shared, experts, gdn_window,
                 gdn_state, attn_k, attn_v, pending, read_slot, pos, cos_v, sin_v, hidden, force, pos_d1, cos_d1,
                 sin_d1):
        self.embed = embed
        self.lm_head = lm_head
        self.norms = norms
        self.mtp_fc = mtp_fc
        self.gdn = gdn              # (w_in, conv_w, A_log, dt_bias, norm_w, w_out), each stacked [G, ...]
        self.attn = attn            # (wqg, wk, wv, wo, norm_w), each stacked [A, ...]
        self.moe_router = moe_router
        self.moe_shared = moe_shared
        self.experts = experts
        self.gdn_window = gdn_window
        self.gdn_state = gdn_state
        self.attn_k = attn_k
        self.attn_v = attn_v
        self.pending = pending
        self.read_slot = read_slot
        self.pos = pos
        self.cos_v = cos_v
        self.sin_v = sin_v
        self.hidden = hidden
        self.force = force
        self.pos_d1 = pos_d1
        self.cos_d1 = cos_d1
        self.sin_d1 = sin_d1
        self.draft_head = None                      # the FR-Spec draft head and its token ids (round, optional)
        self.draft_ids = None
        self.draft_scale = None                     # the fp8 draft head's scales (round, optional)
        self.noise_v = None                         # a sampled launch's Gumbel noise (plan.noise_specs, optional)
        self.noise_d1 = None
        self.control = None                         # a device-committed round's control state (plan.control_specs)
        self.control_hidden = None
        self.rope_cos = None                        # ... and its RoPE tables (plan.rope_table)
        self.rope_sin = None
        self.pos_sb = None                          # ... and its position in SBUF (control_inputs)
        self.noise_entry = None                     # ... and, sampled, its noise window entry (SBUF, a register)
        self.noise_slot = None
        self.moe_scales = None                      # the opt-in fp8 experts' scales [M, ...] (moe_scales)
        self.stack = banks_for(embed.shape[1], RESIDUAL_BANKS)     # the residual's banks S (1: token-major)


@nki.jit
def round_kernel(plan, embed, lm_head, norms, mtp_fc, gdn_w_in, gdn_conv_w, gdn_A_log, gdn_dt_bias, gdn_norm_w,
                 gdn_w_out, attn_wqg, attn_wk, attn_wv, attn_wo, attn_norm_w, moe_router, moe_shared, gdn_window,
                 gdn_state, attn_k, attn_v, pending, read_slot, pos, cos_v, sin_v, hidden, force, pos_d1, cos_d1,
                 sin_d1, moe_experts_0, moe_experts_1=None, moe_experts_2=None, moe_experts_3=None,
                 moe_experts_4=None, draft_head=None, draft_ids=None, noise_v=None, noise_d1=None, control=None,
                 control_hidden=None, rope_cos=None, rope_sin=None, moe_scales=None, draft_scale=None):
    """One speculative round (``plan.mode == "round"``, K = ``plan.drafts``) on one core. Returns (drafts [K, 1]
    int32, targets [K + 1, 1] int32, hidden [K + 1, H], gdn_window, gdn_state, attn_k, attn_v). With ``noise_v``
    and ``noise_d1`` (``plan.noise_specs``) the drafts and targets are Gumbel-max samples (``harness.sampling``).
    With ``plan.device_commit``: the run-time inputs but ``force`` are None, ``control`` int32 [lnc, 3],
    ``control_hidden`` [lnc, K + 1, H] and ``rope_cos`` / ``rope_sin`` float32 [L, rotary] are given
    (``plan.control_specs``, ``plan.rope_table``), and the launch also returns (emitted [1, K + 2] int32, control,
    control_hidden); sampled, ``noise_v`` / ``noise_d1`` are the noise window (``plan.noise_window_specs``) and the
    round takes entry pos & (W - 1). With fp8 experts tables (opt-in, ``nki_kernels.moe`` "fp8 experts")
    ``moe_scales`` [M, ...] holds their scales. With ``plan.draft_fp8`` ``draft_head`` holds fp8 codes and
    ``draft_scale`` [lnc, P, 1] their scales (``nki_kernels.lm_head`` "fp8 draft head")."""
    kernel_assert(plan.mode == "round", f"round_kernel: a {plan.mode} plan (use step_kernel)")
    kernel_assert((noise_v == None) == (noise_d1 == None), "round_kernel: a sampled round takes noise_v and noise_d1")
    given = (control != None, control_hidden != None, rope_cos != None, rope_sin != None)
    kernel_assert(given == (plan.device_commit,) * 4,
                  f"round_kernel: control, control_hidden, rope_cos, rope_sin go with a device-committed plan "
                  f"(plan.device_commit = {plan.device_commit}, given {given})")
    kernel_assert(not plan.device_commit or (pending == None and read_slot == None and pos == None
                                             and hidden == None and cos_v == None and pos_d1 == None),
                  "round_kernel: a device-committed round reads pending, read_slot, pos, hidden and the RoPE rows "
                  "from its control state; pass None for them")
    kernel_assert(not plan.device_commit or noise_v == None or (len(noise_v.shape) == 4 and len(noise_d1.shape) == 5
                                                                and noise_v.shape[1] == noise_d1.shape[1]),
                  "round_kernel: a sampled device-committed round takes its noise window (plan.noise_window_specs: "
                  "noise_v [lnc, W, P, Cp*T], noise_d1 [lnc, W, K, P, Cpd])")
    t = LaunchTensors(embed, lm_head, norms, mtp_fc,
                      (gdn_w_in, gdn_conv_w, gdn_A_log, gdn_dt_bias, gdn_norm_w, gdn_w_out),
                      (attn_wqg, attn_wk, attn_wv, attn_wo, attn_norm_w), moe_router, moe_shared,
                      (moe_experts_0, moe_experts_1, moe_experts_2, moe_experts_3, moe_experts_4),
                      gdn_window, gdn_state, attn_k, attn_v, pending, read_slot, pos, cos_v, sin_v, hidden, force,
                      pos_d1, cos_d1, sin_d1)
    t.draft_head = draft_head
    t.draft_ids = draft_ids
    t.draft_scale = draft_scale
    t.noise_v = noise_v
    t.noise_d1 = noise_d1
    t.control = control
    t.control_hidden = control_hidden
    t.rope_cos = rope_cos
    t.rope_sin = rope_sin
    t.moe_scales = moe_scales
    return run_plan(plan, t)


@nki.jit
def step_kernel(plan, embed, lm_head, norms, gdn_w_in, gdn_conv_w, gdn_A_log, gdn_dt_bias, gdn_norm_w, gdn_w_out,
                attn_wqg, attn_wk, attn_wv, attn_wo, attn_norm_w, moe_router, moe_shared, gdn_window, gdn_state,
                attn_k, attn_v, pending, read_slot, pos, cos_v, sin_v, moe_experts_0, moe_experts_1=None,
                moe_experts_2=None, moe_experts_3=None, moe_experts_4=None, noise_v=None, moe_scales=None):
    """One plain decode step (``plan.mode == "step"``) on one core. Returns (pending [1, 1] int32 as the draft,
    targets [1, 1] int32, hidden [1, H], gdn_window, gdn_state, attn_k, attn_v); with ``noise_v`` the target is a
    Gumbel-max sample."""
    kernel_assert(plan.mode == "step", f"step_kernel: a {plan.mode} plan (use round_kernel)")
    t = LaunchTensors(embed, lm_head, norms, None,
                      (gdn_w_in, gdn_conv_w, gdn_A_log, gdn_dt_bias, gdn_norm_w, gdn_w_out),
                      (attn_wqg, attn_wk, attn_wv, attn_wo, attn_norm_w), moe_router, moe_shared,
                      (moe_experts_0, moe_experts_1, moe_experts_2, moe_experts_3, moe_experts_4),
                      gdn_window, gdn_state, attn_k, attn_v, pending, read_slot, pos, cos_v, sin_v, None, None,
                      None, None, None)
    t.noise_v = noise_v
    t.moe_scales = moe_scales
    return run_plan(plan, t)


KERNELS = {"round": round_kernel, "step": step_kernel}


def run_plan(plan, t):
    """The whole launch on one core: the plan's stages in order, then the outputs."""
    n, core = program_sharding()
    kernel_assert(n == plan.lnc, f"megakernel: plan built for LNC={plan.lnc}, launched with {n} cores")
    T, K = plan.tokens, plan.drafts
    H = t.embed.shape[1]
    # outputs first, before any program_id-dependent code (LNC=2 aliases shared-HBM allocations by order)
    targets_out = nl.ndarray((T, 1), nl.int32, buffer=nl.shared_hbm, name="targets")
    hidden_out = nl.ndarray((T, H), t.embed.dtype, buffer=nl.shared_hbm, name="hidden_out")
    draft_out = nl.ndarray((max(K, 1), 1), nl.int32, buffer=nl.shared_hbm, name="draft")
    emitted_out = None
    pos_sb = None
    if plan.device_commit:
        emitted_out = nl.ndarray((1, T + 1), nl.int32, buffer=nl.shared_hbm, name="emitted")
        pos_sb = control_inputs(plan, t, core)
    rg = tp_group(plan.tp)
    regs = _registers()
    pending = load_token_ids(t.pending)
    proposed = pending          # the draft token ids [K, 1] (the pending token in a step)
    id_rows = [pending]         # the verify's token ids, in row order: the pending token's, then each draft's [1, 1]
    if K > 0:
        proposed = nl.ndarray((K, 1), nl.int32, buffer=nl.sbuf, name="drafts")
        chain_ids = pending     # the token and hidden the next draft runs on
        chain_h = nl.ndarray((1, H), t.embed.dtype, buffer=nl.sbuf, name="h_prev")
        nisa.dma_copy(dst=chain_h, src=t.hidden)
    targets = None
    hidden = None
    emitted = None
    for stage in plan.stages:
        if stage.kind == DRAFT:
            i = stage.draft
            chain_ids, chain_h = draft(plan, stage, t, chain_ids, chain_h, rg, regs, core)
            nisa.dma_copy(dst=proposed[i:i + 1, :], src=chain_ids)
            id_rows.append(chain_ids)
        elif stage.kind == VERIFY:
            targets, hidden = verify(plan, stage, t, id_rows, proposed, rg, regs, core)
            if plan.device_commit:      # right after the verify (D2 ran inside its LM head; it reads no control state)
                emitted = commit(plan, t, proposed, targets, hidden, pos_sb, core)
        else:       # D2 ran inside the verify's LM head (ReplayInHead)
            kernel_assert(stage.kind == REPLAY, f"megakernel: unknown stage kind {stage.kind}")
    if core == 0:  # every core holds the same values; one writes them (the targets last: they are ready last)
        nisa.dma_copy(dst=draft_out, src=proposed)
        nisa.dma_copy(dst=hidden_out, src=hidden)
        nisa.dma_copy(dst=targets_out, src=targets)
        if plan.device_commit:
            nisa.dma_copy(dst=emitted_out, src=emitted)
    if plan.device_commit:
        return (draft_out, targets_out, hidden_out, t.gdn_window, t.gdn_state, t.attn_k, t.attn_v, emitted_out,
                t.control, t.control_hidden)
    return draft_out, targets_out, hidden_out, t.gdn_window, t.gdn_state, t.attn_k, t.attn_v


# ---- device-side accept and commit (plan.device_commit) -------------------------------------------------------
def control_inputs(plan, t, core):
    """A device-committed round's run-time inputs from this core's entry of the control state: sets ``t.pending``,
    ``t.read_slot`` (views of the control row) and ``t.hidden`` (row read_slot of ``control_hidden``, by a register
    offset) and returns the position as SBUF [1, 1] int32 (``t.pos_sb``; :func:`_control_rows` builds the stages'
    positions and RoPE rows from it when a stage first needs them, so their DMAs queue behind the stage's first
    weights). Same instructions on both cores."""
    t.pending = t.control[core:core + 1, 0:1]
    t.read_slot = t.control[core:core + 1, 1:2]
    slot = nisa.register_alloc()
    nisa.register_load(slot, t.read_slot)
    T, H = t.control_hidden.shape[1], t.control_hidden.shape[2]
    t.hidden = t.control_hidden.ap(pattern=[[H, 1], [1, H]], offset=core * T * H, scalar_offset=slot, indirect_dim=1)
    t.pos_sb = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="control_pos")
    nisa.dma_copy(dst=t.pos_sb, src=t.control[core:core + 1, 2:3])
    if t.noise_v != None:   # sampled: the noise window's entry of this position, pos & (W - 1) (plan.noise_slot)
        W = t.noise_v.shape[1]
        kernel_assert(W & (W - 1) == 0, f"round_kernel: the noise window has {W} entries, not a power of two")
        t.noise_entry = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="noise_entry")
        nisa.tensor_scalar(dst=t.noise_entry, data=t.pos_sb, op0=nl.bitwise_and, operand0=W - 1)
    return t.pos_sb


def _noise_slot(t):
    """A sampled device-committed round's noise window entry (``t.noise_entry``, computed at the launch top) in a
    register, loaded when the first LM head needs it: then the entry is long computed, so the load holds up none of
    the DMAs queued behind it (at the launch top it would wait for the position's DMA); None in a host-driven
    launch."""
    if t.control == None:
        return None
    if t.noise_slot == None:
        t.noise_slot = nisa.register_alloc()
        nisa.register_load(t.noise_slot, t.noise_entry)
    return t.noise_slot


def _window_entry(window, core, index, slot):
    """This core's row ``index`` of the noise window entry in register ``slot``: ``window`` HBM [lnc, W, ..., P, X]
    float32 (``plan.noise_window_specs``: [lnc, W, P, Cp*T] with index 0, or [lnc, W, K, P, Cpd] with index i) ->
    an HBM view [P, X] (the LM head's ``noise``), moved by the register along the entry axis."""
    shape = window.shape
    P, X = shape[len(shape) - 2], shape[len(shape) - 1]
    per_entry = 1
    for d in range(2, len(shape)):
        per_entry *= shape[d]
    return window.ap(pattern=[[X, P], [1, X]], offset=core * shape[1] * per_entry + index * P * X,
                     scalar_offset=slot, indirect_dim=1)


def _control_rows(stage, t):
    """(pos, cos, sin) private HBM tensors of a device-committed round's stage (the attention body addresses them
    from their first element): draft i at pos - 1 + i with its RoPE row; the verify at pos with rows pos .. pos + K
    (:func:`_stage_inputs` keeps them for D2). The RoPE rows come from the tables by a register offset."""
    p = t.pos_sb
    n = stage.tokens
    if stage.inputs == "d1":
        p = nl.ndarray((1, 1), nl.int32, buffer=nl.sbuf, name="draft_pos_sb")
        nisa.tensor_scalar(dst=p, data=t.pos_sb, op0=nl.add, operand0=float(stage.rope_row - 1))     # int32, exact
    pos = nl.ndarray((1, 1), nl.int32, buffer=nl.private_hbm, name="stage_pos")
    nisa.dma_copy(dst=pos, src=p)
    cos, sin = _rope_rows(t, p, n)
    return pos, cos, sin


def _rope_rows(t, start, n):
    """Rows start .. start + n - 1 of the RoPE tables (``start`` SBUF [1, 1] int32, loaded into a register that
    offsets the DMAs' source rows) -> (cos, sin) private HBM [n, rotary] float32."""
    R = t.rope_cos.shape[1]
    reg = nisa.register_alloc()
    nisa.register_load(reg, start)
    out = []
    for table in (t.rope_cos, t.rope_sin):
        dst = nl.ndarray((n, R), nl.float32, buffer=nl.private_hbm, name="rope_rows")
        nisa.dma_copy(dst=dst, src=table.ap(pattern=[[R, n], [1, R]], offset=0, scalar_offset=reg, indirect_dim=0))
        out.append(dst)
    return out[0], out[1]


def commit(plan, t, drafts, targets, hidden, pos, core):
    """Accept and commit on device: drafts SBUF [K, 1] int32 (d_1 .. d_K, forced ones as forced), targets SBUF [T, 1]
    int32 (y_0 .. y_K), hidden SBUF [T, H] (the verify's post-norm hiddens), pos SBUF [1, 1] int32 (the pending
    token's). n = the number of leading drafts equal to their targets (d_j == y_{j-1}); writes this core's entry of
    the control state (pending y_n, read slot n, position pos + n + 1; ``control_hidden`` <- all T hiddens, row n
    is h_{pos+n}) and returns the emitted row SBUF [1, T + 1] int32 (n + 1, y_0 .. y_K). Arithmetic selection in
    fp32 (ids < 2^24 are exact): run_j = prod_{i <= j} [d_i == y_{i-1}] (run_0 = 1, run_T = 0), one-hot sel_j =
    run_j - run_{j+1}, count = sum run_j."""
    K, T = plan.drafts, plan.tokens
    f32, i32 = nl.float32, nl.int32
    nisa.dma_copy(dst=t.control_hidden[core], src=hidden)   # needs no n: the next round reads row n
    # y_0 .. y_K, d_1 .. d_K along the free dim of one partition, through HBM (an SBUF -> SBUF DMA cannot fold
    # partitions into a row: trn2-costs pitfalls)
    row_hbm = nl.ndarray((1, T + K), i32, buffer=nl.private_hbm, name="commit_ids_hbm")
    # the HBM side shaped like the SBUF columns ([T, 1], [K, 1]: equal partition counts, trn2-costs pitfalls), the
    # same bytes as the row read back below
    nisa.dma_copy(dst=row_hbm.ap(pattern=[[1, T], [1, 1]], offset=0), src=targets)
    nisa.dma_copy(dst=row_hbm.ap(pattern=[[1, K], [1, 1]], offset=T), src=drafts)
    ids = nl.ndarray((1, T + K), i32, buffer=nl.sbuf, name="commit_ids")
    nisa.dma_copy(dst=ids, src=row_hbm)
    f = nl.ndarray((1, T + K + 1), f32, buffer=nl.sbuf, name="commit_f")
    run = nl.ndarray((1, T + 1), f32, buffer=nl.sbuf, name="commit_run")
    nisa.tensor_copy(dst=f[:, T + K:T + K + 1], src=pos)     # (these three wait for no DMA above)
    nisa.memset(dst=run[:, 0:1], value=1.0)
    nisa.memset(dst=run[:, T:T + 1], value=0.0)
    nisa.tensor_copy(dst=f[:, 0:T + K], src=ids)
    eq = nl.ndarray((1, K), f32, buffer=nl.sbuf, name="commit_eq")
    nisa.tensor_tensor(dst=eq, data1=f[:, T:T + K], data2=f[:, 0:K], op=nl.equal)
    for j in range(1, T):
        nisa.tensor_tensor(dst=run[:, j:j + 1], data1=run[:, j - 1:j], data2=eq[:, j - 1:j], op=nl.multiply)
    sel = nl.ndarray((1, T), f32, buffer=nl.sbuf, name="commit_sel")
    nisa.tensor_tensor(dst=sel, data1=run[:, 0:T], data2=run[:, 1:T + 1], op=nl.subtract)
    nisa.tensor_tensor(dst=sel, data1=sel, data2=f[:, 0:T], op=nl.multiply)     # y_n at n, zeros elsewhere
    out = nl.ndarray((1, 3 + T + 1), f32, buffer=nl.sbuf, name="commit_out")    # control row, then emitted
    nisa.tensor_reduce(dst=out[:, 0:1], op=nl.add, data=sel, axis=1)             # pending y_n
    nisa.tensor_reduce(dst=out[:, 3:4], op=nl.add, data=run[:, 0:T], axis=1)     # count n + 1
    nisa.tensor_scalar(dst=out[:, 1:2], data=out[:, 3:4], op0=nl.add, operand0=-1.0)            # read slot n
    nisa.tensor_tensor(dst=out[:, 2:3], data1=f[:, T + K:T + K + 1], data2=out[:, 3:4], op=nl.add)  # pos + n + 1
    nisa.tensor_copy(dst=out[:, 4:4 + T], src=f[:, 0:T])
    row = nl.ndarray((1, 3 + T + 1), i32, buffer=nl.sbuf, name="commit_row")
    nisa.tensor_copy(dst=row, src=out)
    nisa.dma_copy(dst=t.control[core:core + 1, :], src=row[:, 0:3])
    return row[:, 3:3 + T + 1]


# ---- stages (one function per stage kind: the cost model tags instructions by them, plan.stage_functions) ----
def draft(plan, stage, t, ids, h, rg, regs, core):
    """D1, draft i = ``stage.draft``: the MTP head on (ids SBUF [1, 1] int32, h SBUF [1, H]) at position p - 1 + i
    -> (draft ids SBUF [1, 1] int32, the head's post-norm hidden SBUF [1, H] for the next draft, or None after the
    last one)."""
    i = stage.draft
    # x, the MTP layer's last residual and its pending MoE lanes, stays allocated (bound here) through the LM head, as
    # the verify's does: its SBUF cannot become the head's weight ring, whose first DMA would then wait (WAR) for the
    # final norm's reads
    hm, x = mtp_head(plan, stage, t, ids, h, rg, regs, core)
    force = nl.ndarray((1, 2), nl.int32, buffer=nl.sbuf, name="force")
    nisa.dma_copy(dst=force, src=t.force[i:i + 1, :])
    d = token_ids_from_best(_forced(_draft_greedy(plan, t, hm, rg, core, i), force))
    return d, (token_major(hm) if i + 1 < plan.drafts else None)


def verify(plan, stage, t, id_rows, proposed, rg, regs, core):
    """V: the trunk on the T token ids at positions p..p+T-1 -> (targets [T, 1] int32, hidden [T, H]). ``id_rows``:
    the ids as SBUF int32 tiles [n, 1] in row order (the pending token's, then each draft's): each gathers its
    embedding rows with a DMA of its own, straight from the tile the draft's argmax left (no copy into one ids tile
    on the draft-to-verify seam). A round's D2 (on the drafts ``proposed`` SBUF [K, 1] and the first K hiddens) is
    emitted inside the LM head (:class:`ReplayInHead`)."""
    e = nl.ndarray((stage.tokens, t.embed.shape[1]), t.embed.dtype, buffer=nl.sbuf, name="verify_embed")
    r0 = 0
    for i in range(len(id_rows)):
        n = id_rows[i].shape[0]
        embedding_body(t.embed, id_rows[i], e[r0:r0 + n, :])
        r0 += n
    kernel_assert(r0 == stage.tokens, f"megakernel: the verify has {stage.tokens} tokens but {r0} ids")
    x = stack_rows(e, t.stack)
    pos, cos, sin = _stage_inputs(stage, t)
    layers = stage.layers
    lanes = None
    for i in range(len(layers)):
        out = decoder_layer(plan, layers[i], t, x, rg, regs, pos, cos, sin, core, _next_gdn(layers, i), True,
                            e if i == 0 else None, lanes, i == len(layers) - 1)
        x = out[0]
        lanes = out[1]
    w_final = _sbuf_copy(t.norms[plan.norms.final], "final_norm_w")
    ring = regs.head_ring
    side = None
    for s in plan.stages:
        if s.kind == REPLAY:    # D2's loads first: they stream under the last all-reduce and the final norm
            side = ReplayInHead(plan, s, t, proposed, rg, regs, core)
            replay(side, 0)
    xT = residual_rmsnorm_body(x, lanes, w_final, plan.eps, stack=t.stack)
    hidden = token_major(xT)
    if side != None:
        side.h = hidden[0:plan.drafts, :]
    return token_ids_from_best(_greedy(plan, t, xT, rg, core, side, ring)), hidden


def _head_ring(t, regs, core):
    """The verify's LM head weight ring in the launch's GDN arena, its first blocks issued now -- in the verify's last
    layer, an attention layer, after its mixer: the arena is idle from the last GDN layer on (nothing reads or fills it
    again in the launch), and the HBM is, under the mid-layer all-reduce, the norm and the routing -- or None (no
    arena). Triggered by GpSimd (software DGE): in ScalarE's or the default queue the 8 MiB per core would hold back
    the layer's own DMAs (the o_proj weight, the routed experts; the DMAs of one queue move in order, SDK
    nki-dma-overview.rst "DMA Queues"). Before, the head's first DMAs waited for the exit fence of the layer's last
    MoE loop and, in tiles of their own, first-fit placement put them where the MoE's tiles had been
    (bench/decode_speed.md lever 45)."""
    if regs.gdn == None or regs.gdn_layer != -1:
        return None
    w = t.lm_head[core]
    KT = t.embed.shape[1] // P
    bufs = carve(regs.gdn.big, (KT, min(NB, w.shape[1] // KT)), w.dtype)
    return lm_head_ring(w, KT, bufs[0:min(len(bufs), ring_depth(w, KT))])


class ReplayInHead(nl.NKIObject):
    """D2 emitted inside the verify's LM head (``lm_head_argmax_body(between=)``): D2 needs only the drafts and the
    verify's hiddens, not its targets, so its short chain runs while the head streams its weight, on the engines
    the DMA-bound head leaves idle, instead of after it (bench/decode_speed.md lever 27). Each engine runs its
    instructions in program order, so a D2 instruction still waiting for its inputs would hold back the head's
    next ones on that engine (PE, ScalarE, the DMA queue): :func:`replay`'s phases are emitted after the vocab
    blocks :data:`REPLAY_PHASES` (or the last block), each once the previous phase's results are in."""

    def __init__(self, plan, stage, t, ids, rg, regs, core):
        self.plan = plan
        self.stage = stage
        self.t = t
        self.ids = ids
        self.rg = rg
        self.regs = regs
        self.core = core
        self.h = None           # the verify's hiddens [K, H], set once computed (phase 0 does not read them)
        self.e = None
        self.w_norm = None
        self.w_norms = None
        self.w_fc = None
        self.kin = None
        self.xe = None
        self.rows = None

    def step(self, b, n):
        """Called by the LM head after vocab block b of n: the phases 1.. due there (phase 0 ran before the head)."""
        for phase in range(1, len(REPLAY_PHASES) + 1):
            if b == min(REPLAY_PHASES[phase - 1], n - 1):
                replay(self, phase)


def replay(r, phase):
    """D2, phase ``phase`` (0: before the verify's final norm; 1, 2, 3: after the LM head's vocab blocks
    :data:`REPLAY_PHASES`; ``r``: the :class:`ReplayInHead` of the round): the MTP head's
    KV rows on (drafts ids SBUF [K, 1], trunk hiddens h SBUF [K, H] of positions p .. p + K - 1) at positions p ..
    p + K - 1 -- the only part of the MTP layer anything reads later (the next rounds' drafts attend to them): the
    head's input (:func:`mtp_input`), its input norm and the K / V projections (``attention_kv_rows``' steps); no
    query, attention, o_proj, MoE or LM head (bench/decode_speed.md lever 26).
    Phase 0: every DMA that needs nothing computed (the embedding rows, the three norm weights, the fc columns, the
    K / V weights and tables); 1: the head's input up to the fc all-gather; 2: the input norm and the K / V rows;
    3: their writes."""
    plan, t, layer = r.plan, r.t, r.stage.layers[0]
    if phase == 0:
        r.e = embedding_body(t.embed, r.ids)
        r.w_norm = _sbuf_copy(t.norms[layer.in_norm], "in_norm_w")
        r.w_norms = _mtp_input_norms(plan, t)
        r.w_fc = columns_weight(t.mtp_fc[r.core], REPLAY_QUEUE)
        pos, cos, sin = _stage_inputs(r.stage, t)
        a = t.attn
        T, H = plan.drafts, t.embed.shape[1]
        kin = []
        for g in range(layer.groups):
            kin.append(kv_rows_inputs((P, H // P, T), t.embed.dtype, a[0], a[1], a[2], a[3], a[4], cos,
                                      sin, t.attn_k, t.attn_v, pos, r.core, plan.lnc,
                                      layer=layer.mixer * layer.groups + g, reg=r.regs.attention[g],
                                      engine=REPLAY_QUEUE))
        r.kin = kin
    elif phase == 1:
        r.xe = mtp_input(plan, t, r.ids, r.h, r.rg, r.core, r.e, r.w_fc, r.w_norms)
    elif phase == 2:
        xT = rmsnorm_body(r.xe, r.w_norm, plan.eps)
        rows = []
        for kin in r.kin:
            rows.append(kv_rows_project(xT, kin, plan.eps))
        r.rows = rows
    else:
        for g in range(len(r.kin)):
            kv_rows_write(r.kin[g], r.rows[g])


# ---- layers --------------------------------------------------------------------------------------------------
def decoder_layer(plan, layer, t, x, rg, regs, pos, cos, sin, core, next_gdn=None, early_ring=False, entry=None,
                  lanes=None, last=False):
    """One decoder layer on the residual x, bank-stacked SBUF [S*T, H/S] (S = ``t.stack``, nki_kernels/stacked.py;
    S = 1: token-major [T, H]): x += mixer(norm(x)); x += MoE(norm(x)), each partial (stacked too) all-reduced
    over the TP x LNC cores. ``entry``: at a stage's first layer, the same residual token-major [T, H], which the
    input norm reads (so the stacking copies of the stage entry run beside the norm and the mixer), else None.
    ``next_gdn``: the GDN layer to run next (``_next_gdn``, ``_first_gdn``; None: none); its weights are issued
    into the launch's arena as soon as this layer's mixer is done, so they stream under the all-reduces, the norm
    and the routing instead of at the top of that layer -- all but its out_proj weight, issued at its own top.
    ``early_ring`` (the verify's layers): an attention layer's
    projection ring (``attention_ring``) is allocated and its first chunks issued before the input norm, so they
    stream under the previous all-reduce (the MTP layers' drafts have no SBUF room for it next to the GDN arena:
    they keep the body's own ring). Both norm weights (8 KiB each) are loaded first: the DMAs of one queue move in
    order (SDK nki-dma-overview.rst "DMA Queues"), so behind the ring's chunks the input norm would wait for them
    (bench/decode_speed.md lever 24). ``last``: the verify's last layer, which issues the LM head's first weight
    blocks after an attention mixer (``_head_ring``).
    ``lanes``: the previous layer's MoE reduction still pending (``allreduce_lanes``; None: x is up to date): the
    residual is then x + (lane + peer), the input norm takes it from the lanes (``residual_rmsnorm_body``) and the
    residual's own adds are issued after the mixer, where VectorE waits for the collective. Returns (x, the MoE
    partial's ``allreduce_lanes``), the latter pending in the same way for the caller's next norm; the mid-layer
    reduction is handled so inside the layer (its residual adds after the MoE's)."""
    g = t.gdn
    wg = None
    if layer.kind != ATTENTION:     # GDN weights into the launch's arena (issue 15): prefetched by the previous GDN
        if regs.gdn_layer != layer.mixer:   # layer of the stage, else issued here, before the norm
            gdn_weights(g[0], g[1], g[2], g[3], g[4], g[5], layer.mixer, _gdn_arena(regs, g))
        else:                               # prefetched without its out_proj weight: issued now
            gdn_out_proj(g[5], layer.mixer, regs.gdn)
        wg = regs.gdn
        regs.gdn_layer = -1
    w_norm = _sbuf_copy(t.norms[layer.in_norm], "in_norm_w")
    w_post = _sbuf_copy(t.norms[layer.post_norm], "post_norm_w")
    ring = None
    if layer.kind == ATTENTION and layer.groups == 1 and early_ring:
        ring = attention_ring(t.attn[0], t.attn[1], t.attn[2], core, plan.lnc, layer.mixer)
    if entry != None:
        xT = rmsnorm_body(entry, w_norm, plan.eps)
    elif lanes != None:
        xT = residual_rmsnorm_body(x, lanes, w_norm, plan.eps, stack=t.stack)
    else:
        xT = rmsnorm_body(x, w_norm, plan.eps, stack=t.stack)
    if layer.kind == ATTENTION:
        y = _attention(plan, layer, t, xT, pos, cos, sin, core, regs, ring)
    else:
        y = gdn_body(xT, g[0], g[1], g[2], g[3], g[4], g[5], t.gdn_window, t.gdn_state, t.read_slot, plan.eps,
                     layer=layer.mixer, weights=wg, stack=t.stack)
    # the GDN arena's first use allocates it before the MoE weights' tiles: placed after them (1 MiB of router per
    # core), it leaves the verify's attention layer no room for the expert ring
    arena = _gdn_arena(regs, g) if next_gdn != None else None
    wm = moe_weights(t.moe_router, t.moe_shared, layer.moe)     # router + shared expert: under the all-reduce
    if last and layer.kind == ATTENTION:
        regs.head_ring = _head_ring(t, regs, core)
    if next_gdn != None:            # its DMAs wait only for this mixer's reads of the arena (WAR)
        gdn_weights(g[0], g[1], g[2], g[3], g[4], g[5], next_gdn.mixer, arena, out_proj=False)
        regs.gdn_layer = next_gdn.mixer
    mixer_lanes = allreduce_lanes(y, rg)
    if lanes != None:       # the previous reduction's residual update, after the mixer's VectorE work (y stays
        x = _add_into(x, combine_lanes(lanes))      # bound: these tiles must not take its SBUF under the collective)
    xT = residual_rmsnorm_body(x, mixer_lanes, w_post, plan.eps, stack=t.stack)
    m = _moe(plan, layer, t, xT, regs, wm)
    moe_lanes = allreduce_lanes(m, rg)
    return _add_into(x, combine_lanes(mixer_lanes)), moe_lanes


def _gdn_arena(regs, g):
    """The launch's GDN weight arena (``gdn_weight_tiles``), allocated on first use."""
    if regs.gdn == None:
        regs.gdn = gdn_weight_tiles(g[0], g[1], g[5])
    return regs.gdn


def _next_gdn(layers, i):
    """The first GDN layer after ``layers[i]`` if that is a GDN layer (which prefetches its weights), else None."""
    if layers[i].kind == ATTENTION:
        return None
    for j in range(i + 1, len(layers)):
        if layers[j].kind != ATTENTION:
            return layers[j]
    return None


def _first_gdn(plan, stage):
    """For the first draft stage: the verify's first GDN layer (its weights are prefetched by the draft's MTP layer,
    while the draft is latency-bound); else None."""
    if stage.kind != DRAFT or stage.draft != 0:
        return None
    for s in plan.stages:
        if s.kind == VERIFY:
            for layer in s.layers:
                if layer.kind != ATTENTION:
                    return layer
    return None


def mtp_input(plan, t, ids, h, rg, core, e=None, w_fc=None, w_norms=None):
    """The MTP layer's input on T positions q: ids SBUF [T, 1] int32 (token q+1), h SBUF [T, H] (hidden at q) ->
    token-major SBUF [T, H]: embed(ids) and h, each RMS-normed, concatenated and projected by ``mtp_fc`` (columns
    split over the cores, gathered). ``e`` / ``w_fc`` / ``w_norms``: the embedding rows, this core's fc columns
    (``columns_weight``) and the two norm weights (SBUF) if the caller loaded them, else loaded here."""
    rows = plan.norms
    if e == None:
        e = embedding_body(t.embed, ids)
    if w_norms == None:
        w_norms = (t.norms[rows.mtp_emb], t.norms[rows.mtp_hidden])
    hT = rmsnorm_body(h, w_norms[1], plan.eps)      # first: h needs no gather, so its norm runs under e's DMAs
    eT = rmsnorm_body(e, w_norms[0], plan.eps)
    _, J, T = eT.shape
    uT = nl.ndarray((P, 2 * J, T), eT.dtype, buffer=nl.sbuf, name="mtp_fc_in")
    nisa.tensor_copy(dst=uT[:, 0:J, :], src=eT)
    nisa.tensor_copy(dst=uT[:, J:2 * J, :], src=hT)
    return allgather_cores(columns_body(uT, t.mtp_fc[core], w_fc), rg, plan.tp, dtype=e.dtype)


def mtp_head(plan, stage, t, ids, h, rg, regs, core):
    """The MTP head up to its final norm on T = ``stage.tokens`` positions q (arguments as :func:`mtp_input`) ->
    (feature-major ``mtp.norm`` output [P, J, T], (the layer's last residual, its MoE reduction's pending lanes)).
    Writes the MTP KV rows of the stage's positions. The launch's first draft issues its input's weights first (the
    two norm weights, then the fc columns on ScalarE's DMA queue), so the fc columns stream while the head's input
    is gathered and normed instead of behind the norms' small DMAs (bench/decode_speed.md lever 30)."""
    layer = stage.layers[0]
    w_fc = w_norms = None
    if stage.draft == 0:
        w_norms = _mtp_input_norms(plan, t)
        w_fc = columns_weight(t.mtp_fc[core], nisa.engine.scalar)
    xe = mtp_input(plan, t, ids, h, rg, core, None, w_fc, w_norms)
    x = stack_rows(xe, t.stack)
    pos, cos, sin = _stage_inputs(stage, t)
    out = decoder_layer(plan, layer, t, x, rg, regs, pos, cos, sin, core, _first_gdn(plan, stage), False, xe)
    return residual_rmsnorm_body(out[0], out[1], t.norms[plan.norms.mtp_final], plan.eps, stack=t.stack), out


def _mtp_input_norms(plan, t):
    """SBUF copies of the MTP input's two norm weights (embedding, hidden), for :func:`mtp_input`: loaded ahead, so
    the second norm's weight DMA does not wait for the first norm through its tile's placement (a first-fit hole),
    holding back the DMAs behind it in SP's queue."""
    rows = plan.norms
    return (_sbuf_copy(t.norms[rows.mtp_emb], "mtp_emb_norm_w"),
            _sbuf_copy(t.norms[rows.mtp_hidden], "mtp_hidden_norm_w"))


def _stage_inputs(stage, t):
    """(pos, cos, sin) HBM tensors of a stage's positions (``plan.Stage.inputs``)."""
    if t.control != None and stage.inputs == "d1":      # a device-committed round: built when first needed
        return _control_rows(stage, t)
    if t.control != None and t.pos == None:
        rows = _control_rows(stage, t)
        t.pos = rows[0]
        t.cos_v = rows[1]
        t.sin_v = rows[2]
    if stage.inputs == "d1":
        if t.pos_d1.shape[0] == 1:
            return t.pos_d1, t.cos_d1, t.sin_d1
        # the attention body addresses pos / cos / sin with access patterns from their first element (``.ap``), so
        # draft i's rows get tensors of their own (three small HBM -> HBM copies)
        r = stage.rope_row
        pos = nl.ndarray((1, 1), nl.int32, buffer=nl.private_hbm, name="draft_pos")
        cos = nl.ndarray((1, t.cos_d1.shape[1]), nl.float32, buffer=nl.private_hbm, name="draft_cos")
        sin = nl.ndarray((1, t.sin_d1.shape[1]), nl.float32, buffer=nl.private_hbm, name="draft_sin")
        nisa.dma_copy(dst=pos, src=t.pos_d1[r:r + 1, :])
        nisa.dma_copy(dst=cos, src=t.cos_d1[r:r + 1, :])
        nisa.dma_copy(dst=sin, src=t.sin_d1[r:r + 1, :])
        return pos, cos, sin
    if stage.rope_row == 0 and stage.tokens == t.cos_v.shape[0]:
        return t.pos, t.cos_v, t.sin_v
    r0, r1 = stage.rope_row, stage.rope_row + stage.tokens
    kernel_assert(r0 == 0, f"megakernel: stage {stage.name} reads RoPE rows from {r0}; the attention body addresses "
                           f"them from the tensor's first row")
    return t.pos, t.cos_v[r0:r1, :], t.sin_v[r0:r1, :]


def _attention(plan, layer, t, xT, pos, cos, sin, core, regs, ring=None):
    """The rank's attention partial: one attention body per KV-head group of the layer, partials added (``ring``:
    the first group's ``attention_ring``, or None)."""
    a = t.attn
    y = None
    for g in range(layer.groups):
        yg = attention_body(xT, a[0], a[1], a[2], a[3], a[4], cos, sin, t.attn_k, t.attn_v, pos, eps=plan.eps,
                            core=core, n_cores=plan.lnc, max_context=plan.max_context, regs=regs.attention,
                            layer=layer.mixer * layer.groups + g, ring=ring if g == 0 else None,
                            stack=t.stack)
        if g == 0:
            y = yg
        else:
            nisa.tensor_tensor(dst=y, data1=y, data2=yg, op=nl.add)
    return y


def _moe(plan, layer, t, xT, regs, weights=None):
    table, index = layer.experts
    return moe_tkg_body(xT, t.moe_router, t.experts[table], t.moe_shared, plan.top_k, prefetch=MOE_PREFETCH,
                        regs=regs.moe, layer=layer.moe, experts_layer=index, weights=weights,
                        scales=t.moe_scales, stack=t.stack)


def _sbuf_copy(w, name):
    """An SBUF copy of the HBM tensor ``w`` (same shape and dtype): one DMA, issued here."""
    sb = nl.ndarray(tuple(w.shape), w.dtype, buffer=nl.sbuf, name=name)
    nisa.dma_copy(dst=sb, src=w)
    return sb


def _add_into(x, y):
    """Residual update: x (activation dtype) + y (fp32 sum of the partials), rounded once; both in the residual's
    layout (bank-stacked [S*T, H/S]: a DVE op of H/S columns)."""
    out = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, name="residual")
    nisa.tensor_tensor(dst=out, data1=x, data2=y, op=nl.add)
    return out


def _greedy(plan, t, xT, rg, core, between=None, ring=None):
    """The verify's (step's) global argmax over the vocabulary: SBUF [T, 2] float32 (value, index); in a sampled
    launch the Gumbel-max sample with the verify's noise ``t.noise_v`` (a device-committed round: its window
    entry). ``between``: work emitted inside the LM head (:class:`ReplayInHead`), or None; ``ring``: the head's
    ``lm_head_ring`` if the caller issued it, or None."""
    noise = None
    if t.noise_v != None:
        slot = _noise_slot(t)
        noise = t.noise_v[core] if slot == None else _window_entry(t.noise_v, core, 0, slot)
    return _vocab_argmax(plan, t, xT, rg, core, noise, between, ring)


def _vocab_argmax(plan, t, xT, rg, core, noise, between=None, ring=None):
    """Global argmax over the vocabulary (split over every core) of the logits (+ ``noise``, this core's
    [P, Cp*T] float32, or None): SBUF [T, 2] float32 (value, index)."""
    return argmax_combine(lm_head_argmax_body(xT, t.lm_head[core], noise=noise, between=between, ring=ring),
                          plan.vocab_per_core, rg, plan.tp)


def _draft_greedy(plan, t, xT, rg, core, i):
    """Draft i's greedy token, SBUF [T, 2] float32 (value, token id): over the full vocabulary, or with an FR-Spec
    draft vocabulary (``plan.draft_vocab_per_core`` > 0) over the draft head's rows only -- lowest subset index, i.e.
    lowest token id (the ids are ascending), among equal logits -- mapped to its token id. The verify always uses
    the full head (:func:`_greedy`), so the decoded tokens do not depend on it. Sampled rounds: the Gumbel-max
    sample with draft i's noise ``t.noise_d1[core, i]`` (over the draft head's rows; a device-committed round: row i
    of its window entry). ``plan.draft_fp8``: the draft head (full or subset) holds fp8 codes, ``t.draft_scale`` their
    scales (``nki_kernels.lm_head`` "fp8 draft head")."""
    noise = None
    if t.noise_d1 != None:
        slot = _noise_slot(t)
        noise = t.noise_d1[core, i] if slot == None else _window_entry(t.noise_d1, core, i, slot)
    if plan.draft_vocab_per_core == 0 and not plan.draft_fp8:
        return _vocab_argmax(plan, t, xT, rg, core, noise)
    kernel_assert(t.draft_head != None and (t.draft_ids != None or plan.draft_vocab_per_core == 0),
                  "megakernel: the plan has a draft vocabulary but the launch passes no draft_head / draft_ids")
    kernel_assert((t.draft_scale != None) == plan.draft_fp8,
                  f"megakernel: draft_scale goes with an fp8 draft head (plan.draft_fp8 = {plan.draft_fp8})")
    scale = t.draft_scale[core] if plan.draft_fp8 else None
    best = argmax_combine(lm_head_argmax_body(xT, t.draft_head[core], noise=noise, w_scale=scale),
                          plan.draft_vocab_per_core or plan.vocab_per_core, rg, plan.tp)
    if plan.draft_vocab_per_core == 0:
        return best
    return subset_ids_from_best(best, t.draft_ids)


def _forced(best, force):
    """Replace the draft index by the host's when force[0] = 1: idx + flag * (token - idx), in fp32 (exact for
    token ids < 2^24). No data-dependent branch."""
    f = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf, name="force_f32")
    nisa.tensor_copy(dst=f, src=force)
    d = nl.ndarray((1, 1), nl.float32, buffer=nl.sbuf, name="force_delta")
    nisa.tensor_tensor(dst=d, data1=f[:, 1:2], data2=best[:, 1:2], op=nl.subtract)
    nisa.tensor_tensor(dst=d, data1=d, data2=f[:, 0:1], op=nl.multiply)
    out = nl.ndarray((1, 2), nl.float32, buffer=nl.sbuf, name="draft_best")
    nisa.tensor_copy(dst=out, src=best)
    nisa.tensor_tensor(dst=out[:, 1:2], data1=best[:, 1:2], data2=d, op=nl.add)
    return out


class Registers(nl.NKIObject):
    """One register pool per launch, reused by every layer's bodies (registers are a per-engine resource: 64 per
    sequencer): the MoE expert ring's (2 per ring slot) and the attention body's; and the launch's SBUF arena of
    GDN weights (``gdn``: ``nki_kernels.gdn.gdn_weight_tiles``, allocated by the first GDN layer, then reused by
    every GDN layer so its weight DMA waits only for the previous GDN layer's reads)."""

    def __init__(self, moe, attention):
        self.moe = moe
        self.attention = attention
        self.gdn = None
        self.gdn_layer = -1         # the GDN layer whose weight DMAs into the arena are issued and not yet used
        self.head_ring = None       # the verify's LM head ring in the arena (``_head_ring``), once issued


def _allocate(n):
    pool = []
    for _ in range(n):
        pool.append(nisa.register_alloc())
    return tuple(pool)


def _registers():
    return Registers(_allocate(2 * MOE_PREFETCH), _allocate(ATTENTION_REGISTERS))
