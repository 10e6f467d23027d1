"""The layerwise variant's stage kernels: the same subkernel bodies, one launch per layer stage.

Each stage is an ``@nki.jit`` kernel launched on every TP rank (``kernel[lnc]`` per rank) with the stacked
per-rank tensors of ``megakernel.plan`` and the index of the layer in them (compile-time ints); activations go
through HBM and the cross-rank/cross-core reductions happen on the host between launches
(``harness.engines.LayerwiseEngine``, which walks the same plan as the megakernel). A decoder layer is two
stages: [input norm + mixer] and [post-attention norm + MoE]; the head is [final norm + LM head + per-core
argmax]. Outputs are per-core partials ``[n_cores, T, ...]`` (core c writes row c), like the subkernel wrappers.
"""

from __future__ import annotations

import nki
import nki.isa as nisa
import nki.language as nl

from nki_kernels.attention import attention_body, attention_kv_rows
from nki_kernels.common import program_sharding
from nki_kernels.gdn import gdn_body
from nki_kernels.linear import columns_body, token_major
from nki_kernels.lm_head import lm_head_argmax_body
from nki_kernels.moe import moe_tkg_body, moe_weights
from nki_kernels.rmsnorm import rmsnorm_body


def _load(x):
    t = nl.ndarray(x.shape, x.dtype, buffer=nl.sbuf, name="stage_in")
    nisa.dma_copy(dst=t, src=x)
    return t


def _partials(T, H):
    n, c = program_sharding()
    return nl.ndarray((n, T, H), nl.float32, buffer=nl.shared_hbm, name="stage_partials"), c


@nki.jit
def gdn_stage(x, norms, norm_row, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, layer,
              eps):
    """x [T, H] residual -> (partials [n, T, H], window, state): input norm (row ``norm_row`` of the stacked
    norms) + GDN layer ``layer`` of the stacked GDN tensors (its window / state slots written in place)."""
    T, H = x.shape
    out, c = _partials(T, H)
    xT = rmsnorm_body(_load(x), norms[norm_row], eps)
    y = gdn_body(xT, w_in, conv_w, A_log, dt_bias, norm_w, w_out, window, state, read_slot, eps, layer=layer)
    nisa.dma_copy(dst=out[c], src=y)
    return out, window, state


@nki.jit
def attention_stage(x, norms, norm_row, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, layer, eps):
    """x [T, H] residual -> (partials [n, T, H], k_cache, v_cache): input norm + the gated attention of entry
    ``layer`` (one KV-head group of one layer) of the stacked attention tensors."""
    T, H = x.shape
    out, c = _partials(T, H)
    n, _ = program_sharding()
    xT = rmsnorm_body(_load(x), norms[norm_row], eps)
    y = attention_body(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=c, n_cores=n,
                       layer=layer)
    nisa.dma_copy(dst=out[c], src=y)
    return out, k_cache, v_cache


@nki.jit
def kv_rows_stage(x, norms, norm_row, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, layer, eps):
    """x [T, H] (the MTP layer's input) -> (k_cache, v_cache): input norm + only the K / V rows of attention entry
    ``layer`` at the positions of ``pos`` (``attention_kv_rows``: the MTP replay, which reads nothing else)."""
    n, c = program_sharding()
    xT = rmsnorm_body(_load(x), norms[norm_row], eps)
    attention_kv_rows(xT, wqg, wk, wv, wo, norm_w, cos, sin, k_cache, v_cache, pos, eps=eps, core=c, n_cores=n,
                      layer=layer)
    return k_cache, v_cache


@nki.jit
def moe_stage(x, norms, norm_row, router, experts, shared, top_k, layer, experts_layer, eps):
    """x [T, H] residual -> partials [n, T, H]: post-attention norm + MoE layer ``layer`` of the stacked router /
    shared expert, its experts at ``experts_layer`` of the stacked experts table ``experts``."""
    T, H = x.shape
    out, c = _partials(T, H)
    wts = moe_weights(router, shared, layer)        # routing-independent weights: their DMAs fly under the norm
    xT = rmsnorm_body(_load(x), norms[norm_row], eps)
    y = moe_tkg_body(xT, router, experts, shared, top_k, layer=layer, experts_layer=experts_layer, weights=wts)
    nisa.dma_copy(dst=out[c], src=y)
    return out


@nki.jit
def head_stage(x, norms, norm_row, lm_head, eps, noise=None):
    """x [T, H] residual -> (best [n, T, 2] float32 per-core (value, local index), hidden [T, H]): final norm,
    the post-norm hidden, and this core's LM-head shard argmax (with ``noise`` [n, P, Cp*T] float32, the rank's
    ``megakernel.plan.noise_specs`` layout: the Gumbel-max sample, ``harness.sampling``)."""
    T, H = x.shape
    n, c = program_sharding()
    best_out = nl.ndarray((n, T, 2), nl.float32, buffer=nl.shared_hbm, name="stage_best")
    hidden_out = nl.ndarray((T, H), x.dtype, buffer=nl.shared_hbm, name="stage_hidden")
    xT = rmsnorm_body(_load(x), norms[norm_row], eps)
    nisa.dma_copy(dst=best_out[c], src=lm_head_argmax_body(xT, lm_head[c], noise=noise[c] if noise != None else None))
    if c == 0:
        nisa.dma_copy(dst=hidden_out, src=token_major(xT))
    return best_out, hidden_out


@nki.jit
def mtp_fc_stage(e, h, norms, emb_row, hidden_row, fc, eps):
    """MTP input: embedding rows e [T, H] and hiddens h [T, H] -> this core's fc output columns
    ``[n, T, Nc]`` float32 (concatenated over the cores in global order = the fc output)."""
    n, c = program_sharding()
    nc = fc.shape[3]
    out = nl.ndarray((n, e.shape[0], nc), nl.float32, buffer=nl.shared_hbm, name="stage_fc")
    eT = rmsnorm_body(_load(e), norms[emb_row], eps)
    hT = rmsnorm_body(_load(h), norms[hidden_row], eps)
    P, J, T = eT.shape
    uT = nl.ndarray((P, 2 * J, T), eT.dtype, buffer=nl.sbuf, name="stage_fc_in")
    nisa.tensor_copy(dst=uT[:, 0:J, :], src=eT)
    nisa.tensor_copy(dst=uT[:, J:2 * J, :], src=hT)
    nisa.dma_copy(dst=out[c], src=columns_body(uT, fc[c]))
    return out
