"""Register-value providers for shape-only traces of this project's kernels (``nkisim.register_values``).

A shape-only launch has no data, so every value a kernel computes on chip and loads into a register (loop trip
counts, DMA offsets) is nkisim's placeholder 0. These providers give those registers the values a real launch
would see, so that a shape-only trace costs what the shipped kernel does:

* :class:`MoERouting` -- the MoE's in-kernel top-k (``nki_kernels.moe.moe_tkg_body``): per call, the distinct
  expert ids of its slots (a seeded sample, ascending: the kernel's order may differ, which the DMA costs ignore)
  and the slot flags (1 for the first ``n`` distinct experts, 0 after), with ``n`` from a :class:`Routing` model.
* :class:`AttentionRegisters` -- the attention body's position-derived registers (``att_*``: the cache write
  offset and the KV-tile loop bounds), recorded from an EXECUTING launch of the attention kernel at the same
  position on the tiny config (the values depend only on the position, the KV tile and the core split).
* :class:`RoundRegisters` -- the round / step megakernel: MoE routing plus the attention registers of each
  stage's position (D1 at p - 1, V and D2 at p), the stage told apart by the kernel frames of the load (the stage
  functions of the launch plan, ``megakernel.plan.stage_functions``).

Registers loaded straight from a real integer input (the GDN read slot) need no provider: shape-only launches
keep integer inputs' values. Each provider refuses loads it does not understand inside the body it models (a
kernel change shows up as an error, not as a silently wrong trace).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

MOE_BODY = "moe_tkg_body"
ATTENTION_BODY = "attention_body"


def _in(q, function):
    return any(f.rsplit(":", 1)[-1] == function for f in q.stack)


@dataclass(frozen=True)
class Routing:
    """How many distinct experts the tokens of one MoE call select.

    mode "expected" (default): the expectation for T tokens each choosing top_k of E experts independently and
    uniformly, E (1 - (1 - k/E)^T) -- 15.75 for T=2, top-8 of 256 -- realised per layer as a pattern of
    floor/ceil counts whose mean over every 4 consecutive multi-token calls is exact when E (1 - ...) has a
    quarter fraction (15, 16, 16, 16 for 15.75); "min": top_k (all tokens agree); "max": min(T k, E)."""
    mode: str = "expected"
    tokens: int = 2
    top_k: int = 8
    experts: int = 256

    def __post_init__(self):
        if self.mode not in ("expected", "min", "max"):
            raise ValueError(f"routing: mode must be expected, min or max, got {self.mode!r}")

    @property
    def expected_distinct(self) -> float:
        E, k, T = self.experts, self.top_k, self.tokens
        return E * (1.0 - (1.0 - k / E) ** T)

    @property
    def mean_distinct(self) -> float:
        if self.mode == "min":
            return float(self.top_k)
        if self.mode == "max":
            return float(min(self.tokens * self.top_k, self.experts))
        return self.expected_distinct

    def distinct(self, call: int) -> int:
        """Distinct experts of the ``call``-th multi-token MoE call (0-based): a Bresenham split of the mean."""
        m = self.mean_distinct
        return int(math.floor((call + 1) * m + 1e-9) - math.floor(call * m + 1e-9))

    def describe(self):
        return {"mode": self.mode, "tokens": self.tokens, "top_k": self.top_k, "experts": self.experts,
                "mean_distinct_experts": self.mean_distinct, "expected_distinct_experts": self.expected_distinct}


class MoERouting:
    """Values of the MoE body's ``register_load``s under a :class:`Routing`.

    The body (nki_kernels/moe.py "Run-time addressing") loads the expert id ``ids[s]`` of every slot it runs:
    the k always-valid slots first (a call starts with ids[0] from a tensor not seen before); then, when the
    call has conditional slots (S = min(T k, E) > k), the trip counts of its nested 0/1-trip loops from the
    tensor named ``nki_kernels.moe.TRIPS_NAME`` -- per level q of L = ``nki_kernels.moe.LEVEL`` slots from
    s = k + qL: trips[qL] = 1 iff slot s+L-1 is used (the whole level runs), trips[qL + r] = 1 iff s+r-1 is the
    last used slot (the remainder of r slots runs) -- and the ids of the conditional slots inside the loops
    that run. Multi-token calls
    (those with conditional slots) take their distinct count n from the routing pattern in order; ``distinct``
    overrides it for every call. Expert ids are a seeded sample, ascending (the kernel runs token 0's slots in its top-k key's order: the ids
    only offset DMAs, so their order does not change a cost); a load
    of an unused slot's id is refused (the kernel never runs an unused slot)."""

    def __init__(self, routing: Routing, distinct: int | None = None, seed: int = 0):
        self.routing, self.fixed, self.seed = routing, distinct, seed
        self.state = {}                 # (rank, core) -> per-core state
        self.log = []                   # distinct experts of every multi-token call (core 0 of rank 0)

    def _multi(self, st, key):
        st["multi"] += 1
        st["n"] = self.fixed if self.fixed is not None else self.routing.distinct(st["multi"])
        if key == (0, 0):
            self.log.append(st["n"])

    def __call__(self, q):
        if not _in(q, MOE_BODY):
            return None
        from nki_kernels.moe import LEVEL, TRIPS_NAME
        key = (q.rank, q.core)
        st = self.state.setdefault(key, {"calls": -1, "multi": -1, "ids": None, "trips": None, "n": None,
                                         "experts": None})
        k, E = self.routing.top_k, self.routing.experts
        if q.index == 0 and q.tensor_id != st["ids"] and q.tensor_id != st["trips"] and q.tensor != TRIPS_NAME:
            st["calls"] += 1
            st["ids"], st["trips"], st["n"] = q.tensor_id, None, None
            rng = np.random.default_rng((self.seed, st["calls"]))
            size = min(E, self.routing.tokens * k)
            st["experts"] = np.sort(rng.choice(E, size=size, replace=False))
        if q.tensor_id == st["ids"]:
            s = q.index
            if s >= k and st["n"] is None:
                self._multi(st, key)
            n = st["n"] if st["n"] is not None else k
            if s >= n:
                raise ValueError(f"MoERouting: the id of slot {s} is loaded but the call uses {n} slots "
                                 f"(tokens={self.routing.tokens}, top_k={k}) at {q.loc}")
            return int(st["experts"][s])
        if q.tensor == TRIPS_NAME and st["ids"] is not None and st["trips"] in (None, q.tensor_id):
            if st["trips"] is None:
                st["trips"] = q.tensor_id
                if st["n"] is None:
                    self._multi(st, key)
            L = LEVEL
            s, r = k + L * (q.index // L), q.index % L
            return int(st["n"] >= s + L) if r == 0 else int(st["n"] == s + r)
        raise ValueError(f"MoERouting: register_load of {q.tensor}[{q.index}] at {q.loc} is neither the expert ids "
                         f"nor the slot flags (conditional-slot trip counts) of the current MoE call "
                         f"(nki_kernels/moe.py changed?)")


def tiny_attention_args(position: int, tokens: int, lnc: int = 2) -> tuple:
    """Data arguments of ``megakernel.layerwise.attention_stage`` for rank 0 of TP=4 on the tiny config (the first
    full-attention layer, random weights, an empty cache of ``position + tokens`` rows) at ``position``."""
    import torch

    from megakernel import plan as rp
    from megakernel.sharded import rank_state, rank_weights
    from model.config import preset
    from model.params import random_params
    from model.state import DecodeState
    cfg = preset("tiny")
    layer = [L for L in rp.step_plan(cfg, 4, lnc).stages[0].layers if L.kind == rp.ATTENTION][0]
    w = rank_weights(cfg, random_params(cfg, seed=0, dtype=torch.float32), 0, 4, lnc)
    st = rank_state(cfg, DecodeState.empty(cfg, max_len=position + tokens, slots=2, dtype=torch.float32), 0, 4)
    cos, sin = rp.rope_rows(cfg, position, tokens)
    x = (0.1 * torch.randn(tokens, cfg.hidden_size, generator=torch.Generator().manual_seed(0))).float()
    return (x, w["norms"], layer.in_norm, w["attn_wqg"], w["attn_wk"], w["attn_wv"], w["attn_wo"], w["attn_norm_w"],
            cos, sin, st["attn_k"], st["attn_v"], np.array([[position]], np.int32), layer.mixer * layer.groups,
            float(cfg.rms_norm_eps))


@functools.lru_cache(maxsize=None)
def attention_registers(position: int, tokens: int, lnc: int = 2) -> dict:
    """{(core, tensor, index): value} of every register the attention body loads at ``position`` for ``tokens``
    query tokens on ``lnc`` cores, recorded from an executing launch of ``megakernel.layerwise.attention_stage`` on
    the tiny config (one layer, random weights; the registers depend only on the position, the KV tile and the core
    split, which the tiny launch shares with the real one)."""
    import nkisim

    from megakernel import layerwise as lw
    args = tiny_attention_args(position, tokens, lnc)
    seen = {}

    def record(q):
        if q.value is not None and _in(q, ATTENTION_BODY):
            seen[(q.core, q.tensor, q.index)] = q.value

    with nkisim.register_values(record):
        lw.attention_stage[lnc](*args)
    if not seen:
        raise RuntimeError("attention_registers: the attention body loaded no register (nki_kernels/attention.py "
                           "changed?)")
    return seen


class AttentionRegisters:
    """The attention body's registers at one position (see :func:`attention_registers`)."""

    def __init__(self, position: int, tokens: int, lnc: int = 2):
        self.values = attention_registers(position, tokens, lnc)
        self.position, self.tokens = position, tokens

    def __call__(self, q):
        if not _in(q, ATTENTION_BODY):
            return None
        return lookup(self.values, q, f"position {self.position}, T={self.tokens}")


def lookup(values, q, what):
    key = (q.core, q.tensor, q.index)
    if key not in values:
        raise ValueError(f"attention registers: no recorded value for {q.tensor}[{q.index}] on core {q.core} at "
                         f"{q.loc} ({what}); recorded: {sorted({k[1] for k in values})}")
    return values[key]


class RoundRegisters:
    """A launch's registers: MoE routing, and the attention registers of each stage's position (``plan``: D1
    attends at ``pos_d1`` = p - 1 with one token, V at p with its tokens, D2 at p with one)."""

    def __init__(self, position: int, routing: Routing, plan, seed: int = 0):
        from megakernel import plan as rp
        self.stages = rp.stage_functions(plan)
        self.moe = MoERouting(routing, seed=seed)
        self.attention = {s.name: AttentionRegisters(position - 1 if s.inputs == "d1" else position, s.tokens,
                                                     plan.lnc) for s in plan.stages}

    def stage(self, q):
        for f in reversed(q.stack):
            s = self.stages.get(f.rsplit(":", 1)[-1])
            if s is not None:
                return s
        return None

    def __call__(self, q):
        if _in(q, MOE_BODY):
            return self.moe(q)
        if _in(q, ATTENTION_BODY):
            s = self.stage(q)
            if s is None:
                raise ValueError(f"RoundRegisters: attention register load at {q.loc} outside D1/V/D2")
            return self.attention[s](q)
        return None
