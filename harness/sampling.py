"""Lossless sampling with speculation: the target's processed distribution, the draft's, and the standard
speculative rejection rule (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
Algorithm 1 / Theorem 1; Chen et al. 2023, "Accelerating LLM Decoding with Speculative Sampling").

Processed distribution (:func:`probabilities`, the same function for the target and the draft): logits / T, then
top-k (the k largest logits; ties broken towards the lower token id, a stable sort), softmax, then top-p (the
smallest prefix of the tokens sorted by probability, stable, whose mass reaches p; the first token always stays),
renormalised. float64 throughout.

The rule (:func:`accept`), for K chained drafts d_1 .. d_K drawn from q_1 .. q_K (q_i: the draft's processed
distribution at step i, conditioned on the tokens before it) and the target's processed distributions p_0 .. p_K
of the verify (p_j after the first j + 1 verified tokens): for i = 1 .. K, accept d_i with probability
min(1, p_{i-1}(d_i) / q_i(d_i)); on the first rejection commit a token drawn from norm(max(0, p_{i-1} - q_i)) and
stop; if all K are accepted, commit a bonus token drawn from p_K. Proof sketch (per position, by induction over the
accepted prefix): P(commit x) = q(x) min(1, p(x)/q(x)) + (1 - sum_y min(p(y), q(y))) * max(0, p(x) - q(x)) /
sum_y max(0, p(y) - q(y)) = min(p(x), q(x)) + max(0, p(x) - q(x)) = p(x), since sum_y max(0, p - q) = 1 - sum_y
min(p, q); each committed token is therefore distributed as p given the committed prefix, exactly as plain
sampling. The per-position acceptance probability is sum_x min(p(x), q(x)) = 1 - TV(p, q), the optimum of any
lossless single-draft scheme.

Randomness: one ``torch.Generator`` per sequence (CPU, seeded), drawn in a fixed order (the draft noise of a
round, then the accept uniforms and residual / bonus samples) -> identical output for identical seeds.

Shared Gumbel noise (the kernel variants, layerwise and megakernel; :class:`GumbelNoise`, :func:`gumbel_max`)
---------------------------------------------------------------------------------------------------------
Every absolute position n of the sequence has its own noise vector g_n [V], i.i.d. standard Gumbel, a
deterministic function of (seed + sample, n) alone. The token at position n -- whoever proposes it -- is
argmax_v(l_v + T g_n[v]) of the logits l that propose it (= argmax(l / T + g_n): T > 0 scales every score alike),
lowest index on ties (the kernels' argmax rule): draft i of a round (which predicts the same position as the
verify's token i) with the draft's logits, the verify's target j with the target's. Accept stays the greedy
equality test (longest prefix of drafts equal to the targets, then the target after it).

Claim: the committed sequence equals, token for token, NON-speculative Gumbel-max sampling with the same noise
table, x_n = argmax(l_target(x_<n) + T g_n). Proof sketch, by induction over committed positions: a round starting
at position p with the committed prefix x_<p (equal to the plain run's by induction) verifies [x_p, d_1 .. d_K];
its target y_0 = argmax(l_target(x_<p+1) + T g_{p+1}) is the plain run's x_{p+1}; if d_1 = y_0 the verify's
second token is that same x_{p+1}, so y_1 is the plain run's x_{p+2}, and so on along the accepted prefix; the
first rejected draft is replaced by the target at its position, again the plain run's token. Drafts only decide
HOW MANY of those tokens a round commits, never which. Plain Gumbel-max sampling is exact (Gumbel-max theorem:
P(argmax(l/T + g) = v) = softmax(l/T)_v for i.i.d. Gumbel g), and g_n is independent of x_<n (a function of n
only), so each x_n is distributed as softmax(l_target(x_<n) / T): the committed sequence is distributed exactly
as plain sampling from the target at temperature T. (Up to floating point: the logits are the kernels' bf16 ones,
the scores l + fp32(T g) are rounded once to fp32.) Draft 1 is accepted with probability
P(argmax(l_q/T + g) = argmax(l_p/T + g)), the Gumbel-max coupling of q and p: at most the optimum 1 - TV(p, q)
(which only a maximal coupling, such as the rejection rule, attains) and at least (1 - TV) / (1 + TV) (Daliri et
al. 2024, "Coupling without Communication and Drafter-Invariant Speculative Decoding"); on random 8-token pairs
it sits within 1-3 points of the optimum, and the tiny model's figures are in README "Sampling". Its merit here:
accept stays an equality test inside the kernels, no distribution leaves the chip. top-k / top-p are not
implemented in the kernels (a global k-th-largest threshold would need one more collective per head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """Sampling settings: temperature T > 0 (0: greedy, the default), top_k (0: off), top_p in (0, 1], seed."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, found {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 1 (0: off), found {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], found {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def generator(self, index: int = 0) -> torch.Generator:
        """The generator of sample ``index`` (seed + index)."""
        return torch.Generator().manual_seed(self.seed + index)


def probabilities(logits: torch.Tensor, s: Sampling) -> torch.Tensor:
    """logits [T, V] -> the processed distributions [T, V] float64 (module docstring). Traceable (no data-dependent
    Python branches)."""
    if s.greedy:
        raise ValueError("probabilities: greedy decoding has no sampling distribution (temperature 0)")
    z = logits.double() / s.temperature
    V = z.shape[-1]
    if 0 < s.top_k < V:
        order = torch.sort(z, dim=-1, descending=True, stable=True).indices
        drop = order[..., s.top_k:]
        z = z.scatter(-1, drop, float("-inf"))
    p = torch.softmax(z, dim=-1)
    if s.top_p < 1:
        sp, order = torch.sort(p, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sp, dim=-1) - sp            # mass of the tokens ranked above each one
        keep_sorted = before < s.top_p                     # the first token always stays (before = 0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(dim=-1, keepdim=True)
    return p


def gumbel(gen: torch.Generator, shape: tuple) -> torch.Tensor:
    """Standard Gumbel noise float64: argmax(log q + g) is an exact sample of q."""
    u = torch.rand(shape, generator=gen, dtype=torch.float64)
    return -torch.log(-torch.log(u.clamp_min(1e-300)))


def draw(p: torch.Tensor, gen: torch.Generator) -> int:
    """One token from the distribution p [V] (inverse CDF of one uniform)."""
    u = torch.rand((), generator=gen, dtype=torch.float64)
    c = torch.cumsum(p, dim=-1)
    return int(min(int(torch.searchsorted(c, u * c[-1], right=True)), p.shape[-1] - 1))


def accept(drafts: list[int], q: torch.Tensor, p: torch.Tensor, gen: torch.Generator) -> list[int]:
    """The speculative rejection rule (module docstring): drafts [K], draft distributions q [K, V], target
    distributions p [K + 1, V] -> the committed tokens (1 .. K + 1; the accepted drafts, then the correction or
    bonus token)."""
    K = len(drafts)
    if q.shape[0] != K or p.shape[0] != K + 1:
        raise ValueError(f"accept: {K} drafts need q [{K}, V] and p [{K + 1}, V], found {list(q.shape)}, "
                         f"{list(p.shape)}")
    out = []
    for i, d in enumerate(drafts):
        pd, qd = float(p[i, d]), float(q[i, d])
        u = float(torch.rand((), generator=gen, dtype=torch.float64))
        if qd > 0 and u < min(1.0, pd / qd):
            out.append(d)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        out.append(draw(residual if float(residual.sum()) > 0 else p[i], gen))
        return out
    out.append(draw(p[K], gen))
    return out


class GumbelNoise:
    """The shared Gumbel noise table of one sampled sequence (module docstring): ``at(n)`` = g_n [V] float64, i.i.d.
    standard Gumbel, a function of (``seed``, n) only -- a counter-based draw (numpy ``SeedSequence([seed, n])``
    seeding a Philox generator), so any position's noise is available in any order and the same for every
    variant. ``scaled(start, count)``: float32 [count, V] = fp32(T * g_n) for n = start .. start + count - 1, the
    kernels' noise input (``megakernel.plan.noise_inputs``)."""

    def __init__(self, seed: int, vocab: int, temperature: float):
        if not temperature > 0:
            raise ValueError(f"Gumbel noise needs temperature > 0, found {temperature}")
        self.seed, self.vocab, self.temperature = int(seed) % 2 ** 64, int(vocab), float(temperature)

    def at(self, n: int) -> torch.Tensor:
        import numpy as np
        if n < 0:
            raise ValueError(f"Gumbel noise: position must be >= 0, found {n}")
        rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([self.seed, int(n)])))
        u = rng.random(self.vocab) + 2.0 ** -54        # in (0, 1): random() is a multiple of 2^-53 in [0, 1)
        return torch.from_numpy(-np.log(-np.log(u)))

    def scaled(self, start: int, count: int) -> torch.Tensor:
        return torch.stack([(self.temperature * self.at(n)).float() for n in range(start, start + count)])


def gumbel_max(logits: torch.Tensor, scaled_noise: torch.Tensor) -> torch.Tensor:
    """The Gumbel-max tokens of the kernels' rule: argmax(fp32(logits) + scaled_noise) per row, lowest index on ties
    (torch.argmax returns the first maximum). logits [T, V] (any float dtype), scaled_noise float32 [T, V]."""
    return torch.argmax(logits.float() + scaled_noise, dim=-1)
