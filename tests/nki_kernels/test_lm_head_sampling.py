"""Gumbel-max sampling in the LM-head kernel (nki_kernels/lm_head.py, optional ``noise``; harness.sampling).

With noise the kernel's index must be EXACTLY argmax(fp32(its own rounded logits) + noise), lowest index on ties,
and its value that maximum (one fp32 add, the same IEEE rounding as torch). Against the PyTorch twin's logits the
index must agree up to one-ulp near-ties of the noisy scores (tolerances of test_lm_head.py). Without noise the
instruction stream is the greedy one; with noise it is exactly one DMA and one DVE add longer.
"""

from __future__ import annotations

import pytest
import torch

import nkisim
from model.config import preset
from model.tp import embed_head as eh
from nki_kernels import lm_head as lm
from nki_kernels.common import P
from nki_kernels.host import as_torch, feature_major


def _tol(dtype):
    return (2.0 ** -7, 1e-5) if dtype == torch.bfloat16 else (1e-5, 1e-5)


def _noise(T, vc, seed, scale=2.0):
    """scale * standard Gumbel [T, vc] float32 (seeded): the temperature-scaled noise the host passes."""
    u = torch.rand(T, vc, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).clamp(1e-12, 1 - 1e-12)
    return (scale * -torch.log(-torch.log(u))).float()


def check_sampled_core(best, klogits, noise, h, w_shard, base):
    """best [T, 2], klogits [T, Vc] of a noisy launch: exact Gumbel-max on the kernel's logits, near-tie agreement
    with the twin's. Returns the local indices."""
    best = as_torch(best).float()
    kl = as_torch(klogits).float()
    assert torch.isfinite(best).all() and torch.isfinite(kl).all() and kl.abs().max() > 0
    scores = kl + noise
    assert torch.equal(best[:, 0], scores.max(-1).values)
    assert torch.equal(best[:, 1].long(), scores.argmax(-1) + base)     # torch.argmax: the first maximum
    tl = eh.core_logits(h, w_shard).float()
    rtol, atol = _tol(h.dtype)
    tscores = tl + noise
    k_idx = best[:, 1].long() - base
    top = tscores.max(-1).values
    picked = tscores.gather(-1, k_idx[:, None])[:, 0]
    assert torch.all((k_idx == tscores.argmax(-1)) | (picked >= top - (rtol * tl.abs().max(-1).values + atol)))
    return k_idx


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("vc, T", [(700, 3), (1024, 2), (34, 1), (130, 4)])
def test_noisy_argmax_is_gumbel_max_of_the_kernel_logits(dtype, vc, T):
    """Partial last chunk (700), whole chunks (1024), max8 padding (34, 130), T = 3 (lt's token stride 4 != T)."""
    H = 256
    g = torch.Generator().manual_seed(vc + T)
    w = (torch.randn(vc, H, generator=g) / H ** 0.5).to(dtype)
    h = torch.randn(T, H, generator=g).to(dtype)
    noise = _noise(T, vc, seed=vc)
    best, logits = lm.lm_head_argmax_kernel(feature_major(h), lm.lm_head_layout(w)[None], vocab_base=3 * vc,
                                            with_logits=True, noise=lm.rank_noise_layout(noise, 1))
    k_idx = check_sampled_core(best[0], logits[0], noise, h, w, 3 * vc)
    greedy = as_torch(logits[0]).float().argmax(-1)
    assert not torch.equal(k_idx, greedy) or T == 1      # the noise matters (scale 2 against O(1) logits)


def test_tiny_rank_launch_lnc2_with_noise():
    """kernel[2] over a rank's two shards of the tiny config: per-core exact Gumbel-max; the combined (value,
    index) over all 8 cores is the global Gumbel-max of the twin's logits up to near-ties."""
    from model.params import random_params
    cfg = preset("tiny")
    p = random_params(cfg, seed=7, dtype=torch.bfloat16, include_mtp=False)
    n_cores, T = 8, 2
    vc = eh.vocab_per_core(cfg, n_cores)
    h = torch.randn(T, cfg.hidden_size, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    noise = _noise(T, cfg.vocab_size, seed=5)
    vals, idxs = [], []
    for rank in range(n_cores // 2):
        shards = [eh.shard_lm_head(p, cfg, 2 * rank + c, n_cores) for c in range(2)]
        part = noise[:, 2 * rank * vc:2 * (rank + 1) * vc]
        best, logits = lm.lm_head_argmax_kernel[2](feature_major(h), lm.rank_lm_head_layout(shards),
                                                   vocab_base=2 * rank * vc, with_logits=True,
                                                   noise=lm.rank_noise_layout(part, 2))
        for c in range(2):
            gc = 2 * rank + c
            check_sampled_core(best[c], logits[c], part[:, c * vc:(c + 1) * vc], h, shards[c], gc * vc)
            vals.append(as_torch(best[c])[:, 0].float())
            idxs.append(as_torch(best[c])[:, 1].long())
    v = torch.stack(vals)
    top = v.max(0).values
    won = torch.where(v == top, torch.stack(idxs), torch.full_like(torch.stack(idxs), 1 << 30)).min(0).values
    tl = eh.core_logits(h, eh.lm_head_weight(p, cfg)).float()
    tscores = tl + noise
    slack = 2.0 ** -7 * tl.abs().max(-1).values + 1e-5                  # one bf16 ulp of the largest logit
    picked = tscores.gather(-1, won[:, None])[:, 0]
    assert torch.all((won == tscores.argmax(-1)) | (picked >= tscores.max(-1).values - slack))


def test_ties_of_noisy_scores_go_to_the_lowest_index():
    """Integer logits (row % 5) + integer noise: chosen rows tie at the maximum 20 (exact in fp32)."""
    vc, H = 700, 128
    w = torch.zeros(vc, H)
    w[:, 0] = torch.arange(vc) % 5
    h = torch.zeros(2, H)
    h[:, 0] = 1.0
    cases = [[3 + 128 * 4, 3 + 128 * 1, 699], [128 * 2 + 90, 650, 128 * 2 + 17]]
    noise = torch.zeros(2, vc)
    for t, rows in enumerate(cases):
        for r in rows:
            noise[t, r] = 20.0 - float(w[r, 0])
    best = as_torch(lm.lm_head_argmax_kernel(feature_major(h), lm.lm_head_layout(w)[None],
                                             noise=lm.rank_noise_layout(noise, 1)))[0]
    assert best[:, 0].tolist() == [20.0, 20.0]
    assert best[:, 1].tolist() == [float(min(r)) for r in cases]


def test_noise_layout_matches_the_kernel_geometry():
    vc, T = 300, 3
    g = torch.arange(T * vc, dtype=torch.float32).reshape(T, vc) + 1
    lay = lm.noise_layout(g)
    C, Cp, S = lm.scan_geometry(vc, T)
    assert lay.shape == (P, Cp * T)
    for t, v in [(0, 0), (2, 299), (1, 130), (0, 257)]:
        c, p = divmod(v, P)
        assert float(lay[p, c * T + t]) == float(g[t, v])
    assert int((lay != 0).sum()) == T * vc                # padding (rows 300..383, chunks 3..7) is 0


def test_bad_noise_is_refused():
    w = lm.lm_head_layout(torch.randn(200, 128))[None]
    x = feature_major(torch.randn(2, 128))
    with pytest.raises(ValueError, match="noise"):
        lm.lm_head_argmax_kernel(x, w, noise=torch.zeros(1, P, 8 * 1))          # built for T = 1, launched T = 2
    with pytest.raises(ValueError, match="split"):
        lm.rank_noise_layout(torch.zeros(2, 201), 2)


def test_greedy_stream_unchanged_noise_adds_one_dma_and_one_add():
    """Shape-only traces of one rank at real shapes (kernel[2], T = 2): the greedy launch has no noise op (its
    stream is the same as a launch built before the option existed: test_lm_head's counts), the sampled one exactly
    one more DMA and one more DVE tensor_tensor per core, and reads the noise bytes once."""
    cfg = preset("qwen3.6-35b-a3b")
    T, KT = 2, cfg.hidden_size // P
    vc = cfg.vocab_size // 8
    _, Cp, _ = lm.scan_geometry(vc, T)
    args = (nkisim.ShapeDtype((P, KT, T), "bfloat16"), nkisim.ShapeDtype((2, P, KT * vc), "bfloat16"))
    streams = []
    for noise in (None, nkisim.ShapeDtype((2, P, Cp * T), "float32")):
        with nkisim.trace.capture() as tr:
            lm.lm_head_argmax_kernel[2](*args, noise=noise)
        streams.append(tr)
    greedy, sampled = (t.summary() for t in streams)
    diff = {k: sampled.get(k, 0) - greedy.get(k, 0) for k in set(greedy) | set(sampled)}
    diff = {k: d for k, d in diff.items() if d}
    dma = [k for k in diff if k[1] == "dma_copy"]
    assert len(dma) == 1 and diff.pop(dma[0]) == 2
    assert diff == {("DVE", "tensor_tensor"): 2}
    for inst in (0, 1):
        def hbm(tr):
            return sum(i["bytes"].get("shared_hbm", {}).get("read", 0) for i in tr.instructions if i["inst"] == inst)
        assert hbm(streams[1]) - hbm(streams[0]) == P * Cp * T * 4
