"""The full-size round megakernel in its SHIPPED form (``megakernel.round.round_kernel`` with its round plan,
runtime loops, ``max_context=None``: the kernel the variants and the NxDI build launch) traced under nkisim at
TP=4 x LNC=2 in shape-only mode, from the registry of kernel cases (``harness.kernel_cases.round_case``).

nkisim refuses, per launch and rank, any difference between the two cores' runtime loops (site, trip count,
nesting), any integer beyond int32 (e.g. an element offset into a stacked MoE table), PSUM loop state, classes
that are not plain NKIObjects and the Python the NKI front end does not take: a trace that completes is the
check. The integer run-time inputs carry real values (context 2048: D1 attends at p = 2047, V and D2 at 2048),
and the registers the kernel computes on chip come from ``harness.register_models.RoundRegisters`` (the
attention registers of an executing launch at the same positions, the MoE routing model), so the runtime loops
run their real trip counts -- checked against the attention tiling of nki_kernels/attention.py.

Full size: ~8 s to build the per-rank argument shapes and 30-70 s to interpret ~280k instructions on 8 cores:
slow (``make test-slow``). The tiny-preset megakernel runs the same kernel code executing in the default suite
(tests/megakernel/test_round.py).
"""

from __future__ import annotations

import pytest

import nkisim
from model.config import preset
from nki_kernels.attention import tile_loop_trips

CONTEXT = 2048
LNC = 2


@pytest.mark.slow
def test_shipped_round_kernel_traces_with_real_trip_counts():
    from harness.kernel_cases import kernel_parameters, round_case
    from megakernel.round import round_kernel
    case = round_case(preset("qwen3.6-35b-a3b"), context=CONTEXT)   # (records executing tiny launches first)
    assert case.kernel is round_kernel and len(case.per_rank) == 4 and case.plan.max_context is None
    assert kernel_parameters(case)["count"] <= 48
    tr = case.trace()
    assert len(tr.instructions) > 200_000
    want = [tile_loop_trips(CONTEXT - 1)] + [tile_loop_trips(CONTEXT)] * 10    # D1, V (D2 runs no cache loop)
    assert want[0] != want[1]          # D1 (head tile and odd tail) and V (even tail) take different paths
    for rank in range(4):
        for core in range(LNC):
            att = [lp["trips"] for lp in tr.loops
                   if lp["rank"] == rank and lp["inst"] == core and lp["loc"].startswith("attention.py")]
            n = len(want[0])        # runtime loops per attention call
            got = [tuple(att[i:i + n]) for i in range(0, len(att), n)]
            assert got == want, f"rank {rank} core {core}: attention loop trips {got}"
            moe = [lp["trips"] for lp in tr.loops
                   if lp["rank"] == rank and lp["inst"] == core and lp["loc"].startswith("moe.py")]
            # V: 40 layers x 8 loops over the 8 conditional slots (nki_kernels/moe.py _conditional_levels: the level
            # of slots 8-11 and its 3 remainders, nested in it the level 12-15 and its 3); with 15 or 16 distinct
            # experts (routing "expected") exactly 2 run per layer: the first level and the second or a remainder
            assert len(moe) == 40 * 8 and sum(moe) == 2 * 40 and set(moe) == {0, 1}
