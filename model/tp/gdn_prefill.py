"""One TP rank's Gated DeltaNet prefill (the twin of ``nki_kernels/gdn_prefill.py``).

``ReferenceModel.gdn_mixer(chunked=True)`` restricted to the rank's heads (sharding and casts as
:func:`model.tp.gdn.gdn_rank`): projections and the conv output in the activation dtype, l2norm, gates
and the chunked delta rule (``model.functional.gdn_chunked``, 64-token blocks) in fp32, the recurrent
output cast to the activation dtype before the gated norm, the out_proj partial in fp32. Only the window
and state after the last token are returned (what a prefill writes into its decode-state slot).
"""

from __future__ import annotations

import torch

from model import functional as fn
from model.tp.gdn import GdnDims, mixer_inputs, out_partial


def gdn_prefill_rank(dims: GdnDims, w: dict[str, torch.Tensor], x_norm: torch.Tensor, window: torch.Tensor,
                     state: torch.Tensor, allow_neg_eigval: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rank's GDN mixer over a prompt chunk of L tokens.

    x_norm: [L, H] activation dtype; w: ``model.tp.gdn.shard_gdn``; window: [K-1, C_rank] raw pre-conv
    projections before the chunk; state: [Hv_r, Dk, Dv] float32. allow_neg_eigval: beta = 2 sigmoid(b)
    (FLA's option; not used by Qwen3.6 -- it exercises the inverse's worst case, beta near 2).
    Returns (partial [L, H] float32, window [K-1, C_rank] after the last token, state [Hv_r, Dk, Dv] float32).
    """
    q, k, v, z, g, beta, windows = mixer_inputs(dims, w, x_norm, window)
    if allow_neg_eigval:
        beta = 2.0 * beta
    o, final = fn.gdn_chunked(q, k, v, g, beta, state)
    return out_partial(dims, w, o, z, x_norm.dtype), windows[-1], final
