"""Chunked (prefill) vs recurrent (decode) Gated DeltaNet, and the conv window.

Both forms compute the same function in fp32; the chunked one reorders sums through
a triangular solve, so outputs and final states agree to ~1e-5 relative (bound
asserted: 2e-4 absolute on O(1) values; measured well below)."""

from __future__ import annotations

import pytest
import torch

from compare import assert_close
from model import functional as fn

HK, HV, DK, DV = 2, 4, 16, 8


def inputs(n, seed, decay="normal", keys="random"):
    g = torch.Generator().manual_seed(seed)
    q = fn.l2norm(torch.randn(n, HK, DK, generator=g)) * DK ** -0.5
    k = fn.l2norm(torch.randn(n, HK, DK, generator=g))
    if keys == "repeated":
        k = k[:1].expand(n, HK, DK).clone()
    elif keys == "zero":
        k[::3] = 0.0
    v = torch.randn(n, HV, DV, generator=g)
    a = torch.randn(n, HV, generator=g)
    b = torch.randn(n, HV, generator=g)
    A_log = {"normal": torch.zeros(HV), "strong": torch.full((HV,), 4.0), "weak": torch.full((HV,), -8.0)}[decay]
    gl, beta = fn.gdn_gates(a, b, A_log, torch.zeros(HV))
    state = torch.randn(HV, DK, DV, generator=g)
    return q, k, v, gl, beta, state


@pytest.mark.parametrize("n", [1, 63, 64, 65, 130])
@pytest.mark.parametrize("decay", ["normal", "strong", "weak"])
def test_chunked_equals_recurrent(n, decay):
    q, k, v, g, beta, s0 = inputs(n, seed=n, decay=decay)
    o_r, states = fn.gdn_recurrent(q, k, v, g, beta, s0)
    o_c, final = fn.gdn_chunked(q, k, v, g, beta, s0)
    assert o_c.abs().max() > 1e-3
    assert_close(o_c, o_r, rtol=0, atol=2e-4, name="chunked vs recurrent")
    torch.testing.assert_close(final, states[-1], rtol=0, atol=2e-4)


@pytest.mark.parametrize("keys", ["repeated", "zero"])
def test_degenerate_keys(keys):
    q, k, v, g, beta, s0 = inputs(130, seed=7, keys=keys)
    o_r, states = fn.gdn_recurrent(q, k, v, g, beta, s0)
    o_c, final = fn.gdn_chunked(q, k, v, g, beta, s0)
    assert_close(o_c, o_r, rtol=0, atol=2e-4, name="chunked vs recurrent")
    torch.testing.assert_close(final, states[-1], rtol=0, atol=2e-4)


def test_zero_key_leaves_state_decayed_only():
    q, k, v, g, beta, s0 = inputs(1, seed=3)
    k.zero_()
    _, states = fn.gdn_recurrent(q, k, v, g, beta, s0)
    torch.testing.assert_close(states[0], s0 * g[0].exp()[:, None, None])


def test_recurrent_step_matches_closed_form():
    """S_t = a (I - b k k^T) S + b k v^T, o = S_t^T q, for one head, in float64."""
    q, k, v, g, beta, s0 = inputs(1, seed=4)
    o, states = fn.gdn_recurrent(q, k, v, g, beta, s0)
    h = 3
    kk, qq = k[0, h // 2].double(), q[0, h // 2].double()
    a, b = g[0, h].double().exp(), beta[0, h].double()
    s = a * (torch.eye(DK, dtype=torch.float64) - b * torch.outer(kk, kk)) @ s0[h].double() \
        + b * torch.outer(kk, v[0, h].double())
    torch.testing.assert_close(states[0, h].double(), s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o[0, h].double(), s.T @ qq, rtol=1e-5, atol=1e-5)


def test_causal_conv_window_carries_history():
    """Conv over a sequence in one call == in pieces with the returned windows."""
    g = torch.Generator().manual_seed(0)
    u = torch.randn(9, 6, generator=g)
    w = torch.randn(6, 4, generator=g)
    full, windows = fn.causal_conv(u, torch.zeros(3, 6), w)
    first, win1 = fn.causal_conv(u[:5], torch.zeros(3, 6), w)
    second, _ = fn.causal_conv(u[5:], win1[-1], w)
    torch.testing.assert_close(torch.cat([first, second]), full)
    torch.testing.assert_close(windows[4], u[2:5])
    # direct definition: out_t = silu(sum_j w[:, j] u_{t-3+j})
    padded = torch.cat([torch.zeros(3, 6), u])
    direct = torch.nn.functional.silu(torch.stack([(padded[t:t + 4] * w.T).sum(0) for t in range(9)]))
    torch.testing.assert_close(full, direct)
