"""Chunked NKI prefill: a prompt encoded by the prefill kernels, chunk by chunk, into the decode state.

What a prefill pass runs, per chunk of ``C`` prompt tokens at positions s .. s+C-1 (:class:`PrefillPlan`, built by
:func:`prefill_plan` from the decode launch plan's layers, ``megakernel.plan``):

1. embedding of the chunk's ids (``nki_kernels.embedding_prefill``: one launch, one gather per 128 tokens);
2. per trunk layer: input RMSNorm (``nki_kernels.rmsnorm_prefill``: token-major rows + feature-major xT), the
   mixer -- ``gdn_prefill`` (reads / writes GDN slot 0: the chunk carries the recurrent state and conv window
   of the previous one) or ``attention_prefill`` (K/V rows s.. written into the decode cache, rows 0..s-1 read)
   -- then ``x += all-reduce(partials)`` over the TP x LNC cores; post-attention RMSNorm, ``moe_prefill``,
   ``x += all-reduce``;
3. the final RMSNorm of every chunk token (the post-norm hidden h_p the MTP head reads);
4. the MTP head over the prompt: for rows p = s .. min(s+C, n-1) - 1, fc(concat[norm_emb(embed(x_{p+1})),
   norm_hidden(h_p)]) (:func:`mtp_fc_prefill_stage`, this core's fc columns; all-gathered), input norm and the
   MTP layer's K/V rows p only (``attention_prefill_kv_kernel``, bit-identical to the rows the full attention
   kernel writes): its attention output is not needed -- the first draft, D1 of the first round, runs the MTP
   head at p = n-1 with the returned hidden;
5. after the last chunk only: final norm + LM head + argmax on the LAST position (the decode ``head_stage``),
   giving the first generated token and h_{n-1}.

Chunks are multiples of 64 tokens (the GDN kernel's 64-token blocks start at each call's first token) except the
last; at multiples of 512 (GDN super-tiles) and 1024 (attention key blocks) a chunked prefill is bit-identical
to one call of each kernel (the kernels' docstrings).

Executors. :class:`LayerwisePrefill` runs the plan under nkisim on any in-process engine holding the stacked
per-rank weights and decode state (``harness.engines``): one launch per kernel and layer, all ranks at once
(``nkisim.launch``), the cross-rank sums on the host in the decode variants' fixed order (per core lane the
ranks ascending, then lane 0 + lane 1). The replicated work -- the RMSNorms and the embedding, identical on
every rank -- is launched once (one rank, its LNC cores) and its output handed to every rank. The layerwise and
the megakernel variants both prefill through it: the issue allows one launch per layer per chunk, and the
megakernel variant's decode launch is a round, not a chunk. ``harness.prefill`` predicts the same plan's time
on trn2 from shape-only traces of the same kernels, with the cross-core step on chip: the GDN mixer's all-reduce
is :func:`residual_allreduce_stage`, which also emits the RMSNorm that follows it (the same math as the separate
norm launch the nkisim executor makes after its host-side sum; both are tested against the reference norm); the
attention mixer's all-reduce, the residual add and that norm run inside ``attention_prefill_kernel``
(``residual=``), and the MoE's all-reduce and the norm after it inside ``moe_prefill`` (``residual=``); both fused
forms are bit-identical to the kernel followed by :func:`residual_allreduce_stage` (tested). What the executor does
differently: it sums the partials on the host (a different fp32 order than the on-chip collectives: within 1e-6
relative, tested) and launches every norm separately; the NxDI context graph (``harness.nxdi.context``) runs the
on-chip composition the prediction costs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import nki
import nki.collectives as ncc
import nki.isa as nisa
import nki.language as nl
from megakernel import plan as rp
from model.tp.embed_head import combine_argmax
from nki_kernels.common import P, kernel_assert, program_sharding
from nki_kernels.rmsnorm_prefill import (allreduce_groups, broadcast_weight, feature_major_tile, norm_output,
                                         residual_norm_tile, rmsnorm_rows_tile, token_group_ap)

CHUNK = 4096            # default prompt tokens per chunk (the prefill kernels' measured sizes: 1K .. 4K)
GDN_BLOCK = 64          # chunk lengths (except the last) must be multiples of the GDN kernel's block
F32 = nl.float32


# ---- the plan --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillChunk:
    """One chunk: prompt positions ``start`` .. ``start + tokens - 1``; MTP KV rows ``start`` ..
    ``start + mtp_rows - 1`` (the MTP row p needs token p+1, so the prompt's last position has none)."""
    start: int
    tokens: int
    mtp_rows: int


@dataclass(frozen=True)
class PrefillPlan:
    """A prefill pass over an n-token prompt: its chunks and the decode plan's layers and norm rows."""
    n: int
    chunk: int
    chunks: tuple               # PrefillChunk s in order
    layers: tuple               # megakernel.plan.Layer s of the trunk
    mtp: object                 # the MTP head's Layer, or None
    norms: object               # megakernel.plan.NormRows
    tp: int
    lnc: int
    eps: float
    top_k: int
    vocab_per_core: int

    @property
    def last(self) -> PrefillChunk:
        return self.chunks[-1]


def prefill_chunks(n: int, chunk: int = CHUNK, mtp: bool = True) -> tuple:
    """The chunks of an n-token prompt, ``chunk`` tokens each (the last one shorter)."""
    if n < 1:
        raise ValueError("prefill: the prompt is empty")
    if chunk < GDN_BLOCK or chunk % GDN_BLOCK:
        raise ValueError(f"prefill: the chunk must be a positive multiple of {GDN_BLOCK} tokens (the GDN prefill "
                         f"kernel's blocks start at each chunk's first token), got {chunk}")
    out = []
    for s in range(0, n, chunk):
        t = min(chunk, n - s)
        out.append(PrefillChunk(s, t, (min(s + t, n - 1) - s) if mtp else 0))
    return tuple(out)


def prefill_plan(cfg, n: int, tp: int = 4, lnc: int = 2, chunk: int = CHUNK) -> PrefillPlan:
    """The prefill pass of an n-token prompt for ``cfg`` sharded over tp x lnc cores, in chunks of ``chunk``."""
    step = rp.plan_for(cfg, "step", tp, lnc)
    mtp = rp.mtp_layer(cfg, tp, lnc) if cfg.mtp_num_hidden_layers else None
    return PrefillPlan(n, chunk, prefill_chunks(n, chunk, mtp is not None), step.stages[0].layers, mtp,
                       rp.NormRows(cfg.num_hidden_layers, mtp is not None), tp, lnc, step.eps, step.top_k,
                       step.vocab_per_core)


# ---- the MTP fc over the prompt (a new small body: the decode stage takes one token) ----------------------------
@nki.jit
def mtp_fc_prefill_stage(e, h, norms, emb_row, hidden_row, fc, eps):
    """MTP input of N prompt rows: embeddings ``e [N, H]`` (of tokens p+1) and post-final-norm trunk hiddens
    ``h [N, H]`` (of positions p), activation dtype, token-major -> this core's fc output columns
    ``[n_cores, N, Nc]`` float32 (core c writes row c; concatenated over the TP x LNC cores in global order they
    are fc(concat[norm_emb(e), norm_hidden(h)])). ``fc [lnc, P, 2J, Nc]`` (``nki_kernels.linear.column_layout``);
    ``norms`` rows ``emb_row`` / ``hidden_row`` the two pre-fc norms.

    Per 128-token tile: both RMSNorms (``rmsnorm_prefill`` tile helpers), their feature-major tiles side by side
    as the stationary ``[P, 2J, tokens]``, the fc columns (loaded once) moving, 2J accumulating matmuls into one
    PSUM bank per 512 columns."""
    N, H = e.shape
    n, c = program_sharding()
    _, wp, J2, nc = fc.shape
    J = H // P
    kernel_assert(tuple(h.shape) == (N, H) and wp == P and J2 == 2 * J,
                  f"mtp_fc_prefill: e {list(e.shape)}, h {list(h.shape)}, fc {list(fc.shape)}: expected [N, H], "
                  f"[N, H], [lnc, {P}, {2 * J}, Nc]")
    out = nl.ndarray((n, N, nc), F32, buffer=nl.shared_hbm, name="mtp_fc_prefill_out")
    w_e = broadcast_weight(norms[emb_row], H)
    w_h = broadcast_weight(norms[hidden_row], H)
    w_sb = nl.ndarray((P, 2 * J, nc), fc.dtype, buffer=nl.sbuf, name="mtp_fc_w")
    nisa.dma_copy(dst=w_sb, src=fc[c])
    ident = nl.shared_identity_matrix(n=P, dtype=e.dtype)
    for t0 in range(0, N, P):
        nt = min(P, N - t0)
        es = nl.ndarray((P, H), e.dtype, buffer=nl.sbuf, name="mtp_e")
        nisa.dma_copy(dst=es[0:nt, :], src=e[t0:t0 + nt, :])
        hs = nl.ndarray((P, H), h.dtype, buffer=nl.sbuf, name="mtp_h")
        nisa.dma_copy(dst=hs[0:nt, :], src=h[t0:t0 + nt, :])
        eT = feature_major_tile(rmsnorm_rows_tile(es, w_e, nt, eps), nt, ident)
        hT = feature_major_tile(rmsnorm_rows_tile(hs, w_h, nt, eps), nt, ident)
        y = nl.ndarray((P, nc), F32, buffer=nl.sbuf, name="mtp_fc_y")
        for n0 in range(0, nc, 512):
            n1 = min(nc, n0 + 512)
            ps = nl.ndarray((P, n1 - n0), F32, buffer=nl.psum, name="mtp_fc_ps")
            for j in range(2 * J):
                src = eT if j < J else hT
                nisa.nc_matmul(dst=ps[0:nt, :], stationary=src[:, j % J, 0:nt], moving=w_sb[:, j, n0:n1],
                               accumulate=j > 0)
            nisa.tensor_copy(dst=y[0:nt, n0:n1], src=ps[0:nt, :])
        nisa.dma_copy(dst=out[c, t0:t0 + nt, :], src=y[0:nt, :])
    return out


# ---- the nkisim executor ---------------------------------------------------------------------------------------
@dataclass
class PrefillResult:
    first: int              # greedy token after the prompt
    hidden: torch.Tensor    # [H] post-final-norm hidden at the last prompt position (h_{n-1})
    launches: int           # NKI kernel launches of the pass
    chunks: int


class LayerwisePrefill:
    """Runs a :class:`PrefillPlan` under nkisim on an in-process engine (``harness.engines.HostEngine``: its
    ``cfg``, ``tp``, ``lnc``, ``dtype``, per-rank ``weights`` and decode ``states``, started for the sequence).
    Writes GDN slot 0, the trunk and MTP KV rows 0..n-1 / 0..n-2; returns a :class:`PrefillResult`."""

    def __init__(self, engine):
        self.e = engine
        self.cfg, self.tp, self.lnc, self.dtype = engine.cfg, engine.tp, engine.lnc, engine.dtype
        self.launches = 0

    # launches
    def _all(self, kernel, per_rank):
        import nkisim
        self.launches += 1
        return nkisim.launch(kernel[self.lnc] if self.lnc > 1 else kernel, per_rank, tp=self.tp, lnc=self.lnc)

    def _one(self, kernel, *args):
        """A replicated launch: every rank would compute the same bits, so one rank runs it."""
        self.launches += 1
        return (kernel[self.lnc] if self.lnc > 1 else kernel)(*args)

    def _sum(self, partials):
        """Per-rank ``[lnc, N, H]`` float32 partials -> their sum: per core lane the ranks ascending, then lanes."""
        lanes = []
        for c in range(partials[0].shape[0]):
            acc = torch.as_tensor(partials[0][c]).float().clone()
            for r in range(1, len(partials)):
                acc = acc + torch.as_tensor(partials[r][c]).float()
            lanes.append(acc)
        total = lanes[0]
        for lane in lanes[1:]:
            total = total + lane
        return total

    def _add(self, x, total):
        return (x.float() + total).to(self.dtype)

    # stages
    def embed(self, ids: list[int]) -> torch.Tensor:
        """The chunk's embedding rows [N, H]: one ``embedding_prefill_kernel`` launch (ids checked on the host first)."""
        from nki_kernels.embedding import check_token_ids
        from nki_kernels.embedding_prefill import embedding_prefill_kernel
        parts = []
        for t0 in range(0, len(ids), P):
            parts.append(check_token_ids(np.array(ids[t0:t0 + P]), self.cfg.vocab_size, "prefill"))
        out = self._one(embedding_prefill_kernel, self.e.weights[0]["embed"], np.concatenate(parts).reshape(-1, 1))
        return torch.as_tensor(out)

    def norm(self, x, row: int, layout: str):
        """The chunk ``x`` normed by norms row ``row``: rows [N, H] (layout "rows") or xT [P, H/P, N] ("xT")."""
        from nki_kernels.rmsnorm_prefill import rmsnorm_prefill_kernel
        out = self._one(rmsnorm_prefill_kernel, x, self.e.weights[0]["norms"][row], self.plan.eps,
                        layout == "rows", layout == "xT")
        return torch.as_tensor(out[0])

    def gdn(self, layer, xT):
        from nki_kernels.gdn_prefill import check_finite, gdn_prefill_kernel
        j, slot = layer.mixer, np.zeros((1, 1), np.int32)
        outs = self._all(gdn_prefill_kernel, [
            (xT, w["gdn_w_in"][j], w["gdn_conv_w"][j], w["gdn_A_log"][j], w["gdn_dt_bias"][j], w["gdn_norm_w"][j],
             w["gdn_w_out"][j], st["gdn_window"][j], st["gdn_state"][j], slot, slot, self.plan.eps, False)
            for w, st in zip(self.e.weights, self.e.states)])
        for o in outs:
            check_finite(o[3], f"prefill {layer.name} gdn_prefill")
        return self._sum([o[0] for o in outs])

    def attention(self, layer, xT, start: int):
        from nki_kernels.attention_prefill import KEY_BLOCK, attention_prefill_kernel
        N = xT.shape[2]
        cos, sin = rp.rope_rows(self.cfg, start, N)
        st_in = np.array([[start]], np.int32)
        total = None
        for g in range(layer.groups):
            a = layer.mixer * layer.groups + g
            outs = self._all(attention_prefill_kernel, [
                (xT, w["attn_wqg"][a], w["attn_wk"][a], w["attn_wv"][a], w["attn_wo"][a], w["attn_norm_w"][a],
                 cos, sin, st["attn_k"][a:a + 1], st["attn_v"][a:a + 1], st_in, self.plan.eps, KEY_BLOCK, None)
                for w, st in zip(self.e.weights, self.e.states)])
            bad = sum(float(np.asarray(o[1])[:, 2].sum()) for o in outs)
            if bad:
                raise FloatingPointError(f"prefill {layer.name}: attention_prefill reports {int(bad)} non-finite "
                                         f"output rows (NaN or Inf in the hidden states, weights or cache)")
            part = self._sum([o[0] for o in outs])
            total = part if total is None else total + part
        return total

    def kv_rows(self, layer, xT, start: int):
        """K/V cache rows start.. of an attention layer whose output is not needed (``attention_prefill_kv_kernel``)."""
        from nki_kernels.attention_prefill import attention_prefill_kv_kernel
        N = xT.shape[2]
        cos, sin = rp.rope_rows(self.cfg, start, N)
        st_in = np.array([[start]], np.int32)
        for g in range(layer.groups):
            a = layer.mixer * layer.groups + g
            outs = self._all(attention_prefill_kv_kernel, [
                (xT, w["attn_wk"][a], w["attn_wv"][a], w["attn_norm_w"][a], cos, sin, st["attn_k"][a:a + 1],
                 st["attn_v"][a:a + 1], st_in, self.plan.eps) for w, st in zip(self.e.weights, self.e.states)])
            bad = sum(float(np.asarray(o[0]).sum()) for o in outs)
            if bad:
                raise FloatingPointError(f"prefill {layer.name}: attention_prefill_kv reports {int(bad)} non-finite "
                                         f"K/V rows (NaN or Inf in the hidden states or weights)")

    def moe(self, layer, rows):
        from nki_kernels.moe_prefill import check_finite, moe_prefill, token_rows
        table, i = layer.experts
        x = token_rows(rows)
        outs = self._all(moe_prefill, [
            (x, w["moe_router"][layer.moe], w[f"moe_experts_{table}"][i], w["moe_shared"][layer.moe],
             self.plan.top_k) for w in self.e.weights])
        for o in outs:
            check_finite(o[1], f"prefill {layer.name} moe_prefill")
        return self._sum([torch.as_tensor(o[0])[None] for o in outs])     # rows disjoint per core: one lane

    def layer(self, layer, x, start: int):
        xT = self.norm(x, layer.in_norm, "xT")
        mix = self.gdn(layer, xT) if layer.kind == rp.GDN else self.attention(layer, xT, start)
        x = self._add(x, mix)
        rows = self.norm(x, layer.post_norm, "rows")
        return self._add(x, self.moe(layer, rows))

    def mtp(self, prompt, chunk: PrefillChunk, hidden_rows):
        s, m = chunk.start, chunk.mtp_rows
        rows = self.plan.norms
        e = self.embed(prompt[s + 1:s + 1 + m])
        h = hidden_rows[0:m].contiguous()
        outs = self._all(mtp_fc_prefill_stage, [(e, h, w["norms"], rows.mtp_emb, rows.mtp_hidden, w["mtp_fc"],
                                                 self.plan.eps) for w in self.e.weights])
        x = torch.cat([torch.as_tensor(o[c]) for o in outs for c in range(self.lnc)], dim=-1).to(self.dtype)
        xT = self.norm(x, self.plan.mtp.in_norm, "xT")
        self.kv_rows(self.plan.mtp, xT, s)               # the MTP KV rows s .. s+m-1; the output is not needed

    def head(self, x_last):
        """(greedy id, post-norm hidden [H]) of one position: the decode head stage on every rank, the lowest
        global vocabulary index winning ties."""
        from megakernel import layerwise as lw
        outs = self._all(lw.head_stage, [(x_last, w["norms"], self.plan.norms.final, w["lm_head"], self.plan.eps)
                                         for w in self.e.weights])
        best = torch.cat([torch.as_tensor(b) for b, _ in outs])      # [tp*lnc, 1, 2] in global core order
        _, idx = combine_argmax(best[..., 0], best[..., 1], self.plan.vocab_per_core)
        return int(idx[0]), torch.as_tensor(outs[0][1])[0]

    def run(self, prompt: list[int], chunk: int = CHUNK) -> PrefillResult:
        """Prefill ``prompt`` into the engine's (started) decode state."""
        self.plan = prefill_plan(self.cfg, len(prompt), self.tp, self.lnc, chunk)
        self.launches = 0
        x = None
        for ch in self.plan.chunks:
            x = self.embed(prompt[ch.start:ch.start + ch.tokens])
            for layer in self.plan.layers:
                x = self.layer(layer, x, ch.start)
            if ch.mtp_rows:
                hidden_rows = self.norm(x, self.plan.norms.final, "rows")
                self.mtp(prompt, ch, hidden_rows)
        first, hidden = self.head(x[-1:].contiguous())
        return PrefillResult(first, hidden, self.launches, len(self.plan.chunks))


# ---- the all-reduce of a chunk's partials (the on-chip composition; costed by harness.prefill) -------------------
def _allreduce_loads(x, partial, group, c, per_core, mine, peer, xs):
    """The loads of one group ``(t0, rows, kk)`` of :func:`residual_allreduce_stage` on core c into its ring tiles
    ``[P, >= kk H]``: ``mine`` this core's partial (float32; the rows' partial with disjoint rows), ``peer`` the
    other core's partial of the same rows (``per_core`` with two cores, else None; the partial is one HBM tensor
    both cores read), ``xs`` the residual rows."""
    N, H = x.shape
    t0, rows, kk = group
    F = kk * H
    nisa.dma_copy(dst=mine[0:rows, 0:F], src=token_group_ap(partial, (c * N + t0) * H if per_core else t0 * H,
                                                         rows, kk, H))
    if peer != None:
        nisa.dma_copy(dst=peer[0:rows, 0:F], src=token_group_ap(partial, ((1 - c) * N + t0) * H, rows, kk, H))
    nisa.dma_copy(dst=xs[0:rows, 0:F], src=token_group_ap(x, t0 * H, rows, kk, H))


def _allreduce_reduce(group, H, rg, mine, peer, total):
    """The cross-core add (``mine + peer`` when ``peer`` is given) and the collective over the ranks of one group
    into ``total`` (float32, dense); returns the tile holding the group's float32 sum (``mine`` without ranks to
    reduce over)."""
    t0, rows, kk = group
    F = kk * H
    if peer != None:
        nisa.tensor_tensor(dst=mine[0:rows, 0:F], data1=mine[0:rows, 0:F], data2=peer[0:rows, 0:F], op=nl.add)
    if rg == None:
        return mine
    ncc.all_reduce(srcs=[mine[0:rows, 0:F]], dsts=[total[0:rows, 0:F]], replica_group=rg, op=nl.add)
    return total


def _dense_tile(group, H, ring_tile, name):
    """``ring_tile``, or for a partial last group (fewer sub-tiles) a float32 tile of its own width: collective
    operands must be densely packed."""
    if group[2] * H != ring_tile.shape[1]:
        return nl.ndarray((P, group[2] * H), F32, buffer=nl.sbuf, name=name)
    return ring_tile


def _ring(shape, dtype, name, depth):
    out = []
    for i in range(depth):
        out.append(nl.ndarray(shape, dtype, buffer=nl.sbuf, name=name))
    return out


@nki.jit
def residual_allreduce_stage(x, partial, tp, per_core, norm_w=None, eps=1e-6, norm_out="none"):
    """``x + all-reduce(partial)`` of a chunk on one rank's cores, the step between the prefill kernels on chip,
    optionally fused with the RMSNorm that follows it: ``x [N, H]`` residual (activation dtype), ``partial
    [n_cores, N, H]`` float32 (``per_core``: every core holds a partial of every row, the mixers' layout) or
    ``[N, H]`` (rows disjoint between the cores, the MoE's) -> the new residual ``[N, H]``, and with ``norm_w``
    (a ``[P, H/P]`` row of ``norms``) and ``norm_out`` "rows" / "xT" also its RMSNorm (``rmsnorm_prefill``'s
    rows ``[N, H]`` or xT ``[P, H/P, N]``), computed from the residual tile still in SBUF.

    The rows are split over the cores in groups of k 128-token sub-tiles (``rmsnorm_prefill.allreduce_groups``;
    core c: groups c, c + n, ...; k x H x 4 bytes per partition <= ``AR_TILE_BYTES``; partition p of sub-tile i =
    token t0 + 128 i + p, so a sub-tile is an ordinary token tile for the norm): with ``per_core`` a core loads
    both cores' partials of its group (the partial is one HBM tensor) and adds them, then each core all-reduces
    its group over the TP ranks (one collective per group and lane), adds the residual, writes its rows (and
    normalises them). The groups are
    software-pipelined (loads two groups ahead, the collective one ahead of the residual add, stores and norm):
    4K tokens at the real shapes, per_core + rows 564 -> 269 us, disjoint rows + xT 491 -> 245 us predicted
    central (``bench/prefill_speed.md``)."""
    N, H = x.shape
    n, c = program_sharding()
    rg = ncc.ReplicaGroup([list(range(tp))]) if tp > 1 else None
    out = nl.ndarray((N, H), x.dtype, buffer=nl.shared_hbm, name="ar_prefill_out")
    norm_t = norm_output(N, H, x.dtype, norm_out, "ar_prefill")
    kernel_assert(norm_out == "none" or norm_w != None, "residual_allreduce: a fused norm needs norm_w")
    wb = None
    ident = None
    if norm_t != None:
        wb = broadcast_weight(norm_w, H)
        ident = nl.shared_identity_matrix(n=P, dtype=x.dtype)
    groups = allreduce_groups(N, H)          # (first token, partitions used, sub-tiles)
    Fmax = groups[0][2] * H
    mine_groups = []      # this core's groups: c, c + n, ...
    for g in range(c, len(groups), n):
        mine_groups.append(groups[g])
    # software pipeline over this core's groups q, in program order: the loads of q + 2, the add + collective of
    # q + 1, then q's residual add, stores and norm (engines and DMA trigger queues run in program order: a store
    # or norm waiting for its collective would otherwise hold the next group's loads and adds behind it). Ring
    # depths: a tile written at step q - 2 and read at step q needs 3, one read at step q - 1 needs 2.
    Q = len(mine_groups)
    two = per_core and n > 1
    mine = _ring((P, Fmax), F32, "ar_pf_mine", 2 if rg != None else 3)
    peer = _ring((P, Fmax), F32, "ar_pf_peer", 2) if two else [None, None]
    total = _ring((P, Fmax), F32, "ar_pf_total", 2)
    xs = _ring((P, Fmax), x.dtype, "ar_pf_x", 3)
    mines = [None, None, None]
    sums = [None, None, None]
    for q in range(-2, Q):
        if 0 <= q + 1 < Q:
            g = mine_groups[q + 1]
            sums[(q + 1) % 3] = _allreduce_reduce(g, H, rg, mines[(q + 1) % 3], peer[(q + 1) % 2],
                                                  _dense_tile(g, H, total[(q + 1) % 2], "ar_pf_total_tail"))
        if q + 2 < Q:
            g = mine_groups[q + 2]
            mines[(q + 2) % 3] = _dense_tile(g, H, mine[(q + 2) % len(mine)], "ar_pf_mine_tail")
            _allreduce_loads(x, partial, g, c, per_core, mines[(q + 2) % 3], peer[(q + 2) % 2], xs[(q + 2) % 3])
        if q < 0:
            continue
        t0, rows, kk = mine_groups[q]
        residual_norm_tile(xs[q % 3], sums[q % 3], rows, kk, H, token_group_ap(out, t0 * H, rows, kk, H), norm_t,
                           norm_out, t0, wb, ident, eps)
    if norm_t != None:
        return out, norm_t
    return out
