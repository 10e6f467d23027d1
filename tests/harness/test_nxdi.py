"""The NxDI adapter (harness/nxdi) on CPU. Nothing here runs NxDI, NxD or the Neuron compiler.

* Import guard: ``import harness.nxdi`` works without the SDK; the trn2-only names raise a clear ImportError.
* Assembly: the kernel's arguments (the shipped kernels' hand-written signatures), per-rank shapes/dtypes of
  weights and state, each rank's checkpoint, run-time inputs for several positions, the graphs' inputs, routes
  (shape-only), leading outputs and state aliasing, which states each graph takes, the reset graph.
* Host: the teacher-forced prefill launches, slot selection sequences, what the decoder passes to an engine.
* The xla backend (``harness.xla.forward``, the function traced on trn2): one round vs the reference round
  (fp32, 1e-4 absolute, as tests/megakernel/test_round.py), teacher-forced prefill vs the
  reference prefill, tokens = plain greedy, the decode-state invariant, and no host-value dependence
  (fake tensors) and no tensors created off the inputs' device (meta tensors).
* The megakernel backend behind the same host loop under nkisim: tokens = plain greedy.
* Config translation, checkpoint conversion and its checks, the run.py CLI and its refusals.
* The trn2 module (``harness.nxdi.modeling``) against FAITHFUL fakes of NxD/NxDI (tests/harness/nxd_fakes.py):
  first each faked behaviour on its own (it is what broke the adapter before), then the whole
  convert / compile / load / reset / prefill / round / step flow on CPU, xla backend and megakernel backend
  (nkisim), tokens equal to plain greedy, also through ``python -m harness.nxdi.run``.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import math
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from decoding import ReferenceDecoder, assert_same_round, forced_rounds, reference_decode_state, reference_greedy
from decoding import alternating as alternating_drafts
from harness import xla
from harness.engines import LaunchResult, make_engine
from harness.nxdi import assembly as asm
from harness.nxdi import config as nxcfg
from harness.nxdi import convert as nxconv
from harness.speculative import Decoder, generate
from megakernel import plan as rp
from megakernel.plan import PrefillLaunch, teacher_forced_launches
from megakernel.round import KERNELS
from megakernel.sharded import rank_state, rank_weights
from model import functional as fn
from model.config import ConfigError, preset
from model.params import random_params
from model.state import DecodeState
from model.tp.collectives import SINGLE_RANK
from model.weights import save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nxd_fakes  # noqa: E402
from nxdi_support import PROMPT, fake_nxd, refused, tiny  # noqa: E402,F401  (fixtures)

SDK_PRESENT = importlib.util.find_spec("neuronx_distributed_inference") is not None


@pytest.fixture(scope="module")
def plain(tiny):
    cfg, params = tiny
    return reference_greedy(cfg, params, PROMPT, 12)


def alternating(plain_tokens, vocab, n_prompt=len(PROMPT)):
    """Right, wrong, right, ... drafts: both accept paths run."""
    return alternating_drafts([0] * n_prompt, plain_tokens, vocab)


# --------------------------------------------------------------------------------------------------
# Import guard
# --------------------------------------------------------------------------------------------------
@pytest.mark.skipif(SDK_PRESENT, reason="the Neuron SDK is installed: the trn2-only module imports")
def test_trn2_only_names_raise_a_clear_import_error():
    import harness.nxdi as nxdi
    for name in nxdi.TRN2_ONLY:
        with pytest.raises(ImportError, match="neuronx-distributed-inference"):
            getattr(nxdi, name)
    sys.modules.pop("harness.nxdi.modeling", None)
    with pytest.raises(ImportError, match="trn2 host"):
        importlib.import_module("harness.nxdi.modeling")
    with pytest.raises(AttributeError):
        nxdi.no_such_name  # noqa: B018


def test_trn2_module_parses_and_imports_only_plain_project_modules():
    src = Path(__file__).resolve().parents[2] / "harness" / "nxdi" / "modeling.py"
    tree = ast.parse(src.read_text())
    project = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module
               and n.module.split(".")[0] in ("harness", "model", "megakernel")}
    assert project <= {"harness", "harness.engines", "harness.nxdi", "model.config"}


# --------------------------------------------------------------------------------------------------
# Assembly: kernel arguments, shapes, per-rank checkpoints
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["round", "step"])
def test_kernel_arguments_are_the_shipped_kernels_parameters(tiny_cfg, mode):
    cfg, tp, lnc = tiny_cfg, 4, 2
    params = random_params(cfg, seed=0)
    weights = asm.rank_weights(cfg, params, "megakernel", 0, tp, lnc)
    specs = asm.state_specs(cfg, tp, 24, torch.bfloat16)
    taken = asm.graph_states(mode, specs)
    rt = rp.round_inputs(cfg, torch.bfloat16, 3, torch.zeros(cfg.hidden_size), 4, 0) if mode == "round" \
        else rp.step_inputs(cfg, 3, 4, 0)
    states = asm.zero_states(specs)
    kwargs = asm.kernel_kwargs(mode, weights, {n: states[n] for n in taken}, rt)
    sig = list(inspect.signature(KERNELS[mode]).parameters)
    assert sig[0] == "plan" and list(kwargs) == [n for n in sig if n in kwargs]
    # what the in-process engines launch with: every weight, every state, the mode's inputs; the tiny model uses
    # one experts table, the other four stay at their default None, and so do the optional FR-Spec draft head, a
    # sampled launch's Gumbel noise (the NxDI graphs decode greedily), a device-committed round's control state
    # and RoPE tables (the NxDI graphs are host-driven), the opt-in fp8 experts' scales (bf16 experts here) and the
    # opt-in fp8 draft head's scales
    unused = {"plan", "moe_experts_1", "moe_experts_2", "moe_experts_3", "moe_experts_4"}
    optional = ((set(rp.DRAFT_VOCAB) | set(rp.DRAFT_FP8) | set(rp.CONTROL) | set(rp.ROPE_TABLES) if mode == "round"
                 else set())
                | (set(rp.NOISE) & set(sig)) | set(rp.EXPERT_SCALES))
    assert "noise_v" in optional
    assert set(sig) - set(kwargs) == unused | optional
    assert set(kwargs) == set(weights) - ({"mtp_fc"} if mode == "step" else set()) | set(rp.STATE) | \
        set(rp.input_names(mode))
    assert len(asm.kernel_parameters(mode)) <= 48
    with pytest.raises(asm.AssemblyError, match="missing.*unexpected"):
        asm.kernel_kwargs(mode, weights, {n: states[n] for n in taken}, {**rt, "bogus": 1})
    with pytest.raises(asm.AssemblyError, match="given twice"):
        asm.kernel_kwargs(mode, {"gdn_window": 0}, {"gdn_window": 0}, {})


def test_each_graph_takes_exactly_the_states_it_overwrites(tiny_cfg):
    specs = asm.state_specs(tiny_cfg, 4, 24, torch.bfloat16)
    rnd, stp = (asm.graph_states(m, specs) for m in ("round", "step"))
    # stacked state: a step writes the trunk's entries of every stack (the MTP entries pass through)
    assert rnd == stp == list(rp.STATE) and set(rnd) == set(specs) and asm.graph_states("reset", specs) == list(specs)
    asm.check_graph_states("step", stp, stp, stp)
    with pytest.raises(asm.AssemblyError, match="step: state buffers taken"):
        asm.check_graph_states("step", stp + ["bogus"], stp, stp)  # takes a buffer without aliasing it
    with pytest.raises(asm.AssemblyError, match="do not exist"):
        asm.graph_states("round", stp[:2])


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_specs_equal_the_kernels_state_layout(tiny_cfg, tp):
    for dtype in (torch.bfloat16, torch.float32):
        specs = asm.state_specs(tiny_cfg, tp, 40, dtype)
        for r in range(tp):
            got = rank_state(tiny_cfg, DecodeState.empty(tiny_cfg, 40, 2, dtype), r, tp)
            assert asm.tensor_specs(got) == specs


@pytest.mark.parametrize("backend", asm.BACKENDS)
def test_rank_checkpoints_hold_each_ranks_weights_and_rank(tiny_cfg, backend):
    cfg, tp, lnc = tiny_cfg, 4, 2
    params = random_params(cfg, seed=1)
    specs = None
    for r in range(tp):
        w = asm.rank_weights(cfg, params, backend, r, tp, lnc)
        ck = asm.rank_checkpoint(w, r)
        assert torch.equal(ck.pop(asm.RANK_UTIL), torch.tensor([r], dtype=torch.int32))
        assert ck.keys() == {asm.WEIGHTS_PREFIX + k for k in w}
        assert all(torch.equal(ck[asm.WEIGHTS_PREFIX + k], v) for k, v in w.items())
        assert specs is None or asm.tensor_specs(w) == specs  # symmetric sharding: one set of shapes
        specs = asm.tensor_specs(w)
    assert asm.specs_from_json(json.loads(json.dumps(asm.specs_to_json(specs)))) == specs


def test_kernel_layout_keeps_fp32_where_the_kernels_need_it(tiny_cfg):
    w = asm.rank_weights(tiny_cfg, random_params(tiny_cfg, seed=0), "megakernel", 1, 4, 2)
    assert w["gdn_A_log"].dtype == torch.float32 and w["norms"].dtype == torch.float32
    assert w["embed"].dtype == torch.bfloat16 and all(t.is_contiguous() for t in w.values())


@pytest.mark.parametrize("pos", [1, 2, 7, 600])
def test_round_inputs_for_positions(tiny_cfg, pos):
    cfg = tiny_cfg
    h = torch.randn(cfg.hidden_size)
    rt = rp.round_inputs(cfg, torch.bfloat16, 11, h, pos, 1, forced_draft=42)
    ex = asm.runtime_example(cfg, "round", torch.bfloat16)
    for name, t in zip(asm.graph_inputs("round"), asm.ordered_inputs("round", rt)):
        assert t.shape == ex[name].shape and t.dtype == ex[name].dtype, name
    assert rt["pos"].tolist() == [[pos]] and rt["pos_d1"].tolist() == [[pos - 1]]
    assert rt["pending"].tolist() == [[11]] and rt["read_slot"].tolist() == [[1]] and rt["force"].tolist() == [[1, 42]]
    assert torch.equal(rt["hidden"], h.reshape(1, -1).to(torch.bfloat16))
    for (cos, sin), start, t in (((rt["cos_d1"], rt["sin_d1"]), pos - 1, 1), ((rt["cos_v"], rt["sin_v"]), pos, 2)):
        c, s = fn.rope_cos_sin(torch.arange(start, start + t), cfg.rotary_dim, cfg.rope_theta)
        torch.testing.assert_close(torch.as_tensor(cos), c, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.as_tensor(sin), s, rtol=0, atol=1e-5)
    assert rp.round_inputs(cfg, torch.bfloat16, 11, h, pos, 0)["force"].tolist() == [[0, 0]]
    st = rp.step_inputs(cfg, 9, pos, 0)
    ex = asm.runtime_example(cfg, "step", torch.bfloat16)
    for name, t in zip(asm.graph_inputs("step"), asm.ordered_inputs("step", st)):
        assert t.shape == ex[name].shape and t.dtype == ex[name].dtype, name


def test_runtime_input_errors(tiny_cfg):
    h = torch.zeros(tiny_cfg.hidden_size)
    with pytest.raises(ValueError, match=">= 1"):
        rp.round_inputs(tiny_cfg, torch.float32, 1, h, 0, 0)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        rp.round_inputs(tiny_cfg, torch.float32, tiny_cfg.vocab_size, h, 3, 0)
    with pytest.raises(ValueError, match="read_slot"):
        rp.step_inputs(tiny_cfg, 1, 3, 2)
    with pytest.raises(ValueError, match="hidden_size"):
        rp.round_inputs(tiny_cfg, torch.float32, 1, torch.zeros(7), 3, 0)
    with pytest.raises(asm.AssemblyError, match="do not match"):
        asm.ordered_inputs("step", rp.round_inputs(tiny_cfg, torch.float32, 1, h, 3, 0))
    with pytest.raises(asm.AssemblyError, match="takes 5 inputs"):
        asm.named_inputs("step", (torch.zeros(1),) * 10)


def test_graph_inputs_routes_outputs_and_aliases(tiny_cfg):
    assert asm.GRAPHS[0] == "round"  # the first graph gives NxD's packer and state initializer
    for mode in ("round", "step"):
        assert asm.graph_inputs(mode) == tuple(s.name for s in rp.input_specs(tiny_cfg, mode))
    examples = {m: tuple(asm.runtime_example(tiny_cfg, m, torch.bfloat16).values()) for m in asm.GRAPHS}
    asm.check_routes(examples)  # every graph has its own input shapes
    with pytest.raises(asm.AssemblyError, match="same shapes"):
        asm.check_routes({**examples, "other": examples["step"]})
    states = list(asm.state_specs(tiny_cfg, 4, 24, torch.bfloat16))
    for mode in ("round", "step"):
        al = asm.state_aliases(mode)
        assert asm.output_names(mode)[:3] == list(asm.LEADING_OUTPUTS)
        assert list(al) == list(rp.STATE) and list(al.values()) == list(range(3, 3 + len(al)))
        assert set(al) == set(states)            # every launch writes (part of) every stacked state buffer
    assert asm.reset_aliases(states) == {n: 3 + i for i, n in enumerate(states)}


def _data_inputs(fn_, *args) -> set[int]:
    """Indices of ``args`` whose DATA reaches an output of ``fn_`` (make_fx graph; a ``*_like`` factory or
    ``new_*`` reads only its input's shape, as in XLA): the inputs a traced graph has as parameters."""
    from torch.fx.experimental.proxy_tensor import make_fx
    g = make_fx(fn_)(*args)
    shape_only = ("zeros_like", "empty_like", "ones_like", "full_like", "new_zeros", "new_empty", "new_ones", "new_full")
    placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
    seen, stack = set(), [n for n in g.graph.nodes if n.op == "output"]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_function" and any(k in str(node.target) for k in shape_only):
            continue
        stack.extend(x for x in node.all_input_nodes)
    return {i for i, p in enumerate(placeholders) if p in seen}


def test_reset_graph_reads_and_overwrites_every_state(tiny_cfg):
    specs = asm.state_specs(tiny_cfg, 4, 24, torch.bfloat16)
    states = {k: torch.full(s, float("nan"), dtype=d) for k, (s, d) in specs.items()}
    keep = torch.as_tensor(asm.reset_inputs()["keep"])
    out = asm.reset_outputs(keep, states, tiny_cfg.hidden_size, torch.bfloat16)
    ex = asm.runtime_example(tiny_cfg, "step", torch.bfloat16)
    assert [(tuple(o.shape), o.dtype) for o in out[:3]] == [((1, 1), torch.int32), ((1, 1), torch.int32),
                                                              ((1, tiny_cfg.hidden_size), torch.bfloat16)]
    assert out[0] is not out[1] and tuple(ex["pending"].shape) == (1, 1)
    for (name, t), new in zip(states.items(), out[3:]):
        assert new.shape == t.shape and new.dtype == t.dtype and not new.any(), name  # NaN in, zeros out
    kept = asm.reset_outputs(torch.ones(1, 1, dtype=torch.int32), states, tiny_cfg.hidden_size, torch.bfloat16)
    assert all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(kept[3:], states.values()))
    # every state is an input of the traced graph (so it can be aliased); zeros_like would read none
    names, small = list(specs)[:3], [torch.zeros(2, 3) for _ in range(3)]

    def reset(keep, *ts):
        return asm.reset_outputs(keep, dict(zip(names, ts)), 4, torch.float32)

    def zeros_like_reset(keep, *ts):
        return [keep * 0, keep * 0, keep * 0] + [torch.zeros_like(t) for t in ts]

    assert _data_inputs(reset, keep, *small) == {0, 1, 2, 3}
    assert _data_inputs(zeros_like_reset, keep, *small) == {0}
# --------------------------------------------------------------------------------------------------
# Host: teacher-forced prefill launches, slots, what reaches the engine
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 9))
def test_prefill_launches_cover_the_prompt_once(n):
    plan = teacher_forced_launches(n)
    assert len(plan) == 1 + math.ceil((n - 1) / 2)
    assert plan[0] == PrefillLaunch("step", 0, None, 1)
    verified, mtp_rows = [0], []
    for launch in plan[1:]:
        assert launch.mode == "round"
        mtp_rows.append((launch.pos - 1, launch.pos))       # D1: row pos-1 from (x_pos, h_{pos-1})
        verified.append(launch.pos)
        if launch.forced is not None:
            assert launch.forced == launch.pos + 1 and launch.accepted == 2
            verified.append(launch.forced)
            mtp_rows.append((launch.pos, launch.pos + 1))    # D2: row pos from (x_{pos+1}, h_pos)
        else:
            assert launch.accepted == 1 and launch is plan[-1] and launch.pos == n - 1
    assert verified == list(range(n))
    assert sum(p.accepted for p in plan) == n
    assert mtp_rows == [(p, p + 1) for p in range(n - 1)]   # exactly the MTP rows a prefill writes
    with pytest.raises(ValueError):
        teacher_forced_launches(0)


class RecordingEngine:
    """A fake engine: records the run-time inputs and answers with fixed tokens."""

    name = "recording"

    def __init__(self, cfg, max_len=64):
        self.cfg, self.dtype, self.max_len, self.launches = cfg, torch.float32, max_len, 0
        self.calls, self.resets = [], 0

    def start(self, max_len):
        if max_len > self.max_len:
            raise ValueError(f"the sequence needs {max_len} positions, the engine holds {self.max_len}")
        self.resets += 1

    def run(self, mode, runtime):
        self.launches += 1
        self.calls.append((mode, {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in runtime.items()}))
        T = 2 if mode == "round" else 1
        d = runtime["force"][0, 1] if mode == "round" and runtime["force"][0, 0] else 7
        hidden = torch.arange(T, dtype=torch.float32)[:, None].expand(T, self.cfg.hidden_size) + 100 * self.launches
        return LaunchResult([int(d)], [7 + self.launches, 8 + self.launches][:T], hidden)


def test_decoder_prefill_and_slot_selection(tiny_cfg):
    eng = RecordingEngine(tiny_cfg)
    v = Decoder(eng)
    prompt = [10, 11, 12, 13, 14]
    first, h = v.prefill(prompt, max_len=20)
    got = [(m, rt["pending"], rt["pos"], rt["read_slot"], rt.get("force")) for m, rt in eng.calls]
    assert got == [("step", [[10]], [[0]], [[0]], None),
                   ("round", [[11]], [[1]], [[0]], [[1, 12]]),
                   ("round", [[13]], [[3]], [[1]], [[1, 14]])]
    assert eng.resets == 1 and first == 8 + 3 and torch.equal(h, torch.full((tiny_cfg.hidden_size,), 301.0))
    assert torch.equal(torch.as_tensor(eng.calls[2][1]["hidden"]), torch.full((1, tiny_cfg.hidden_size), 201.0))
    # the host loop's slot selection: read_slot = accepted - 1 of the previous commit, no copies
    v.commit(1)
    v.round(first, h, 5)
    v.commit(2)
    v.step(3, 7)
    v.step(4, 8)
    assert [rt["read_slot"] for _, rt in eng.calls[3:]] == [[[0]], [[1]], [[0]]]
    with pytest.raises(ValueError, match="holds 64"):
        v.prefill(prompt, max_len=65)
    with pytest.raises(TypeError, match="cannot read its decode state back"):
        v.committed(3)


def test_decoder_prefill_odd_tail_commits_one(tiny_cfg):
    eng = RecordingEngine(tiny_cfg)
    first, _ = Decoder(eng).prefill([10, 11, 12, 13], max_len=20)
    assert [rt.get("force") for _, rt in eng.calls] == [None, [[1, 12]], [[0, 0]]]
    assert first == 7 + 3  # targets[0] of the last launch: the token after x_3


# --------------------------------------------------------------------------------------------------
# The xla backend
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 4])
def test_xla_round_matches_reference_round(tiny, tp):
    cfg, params = tiny
    ref = ReferenceDecoder(cfg, params)
    first, h = ref.prefill(PROMPT, max_len=24)
    eng = make_engine("xla", cfg, params, tp=tp)
    eng.load_state(ref.state)
    v = Decoder(eng)
    r1 = v.round(first, h, len(PROMPT))
    r0 = ref.round(first, h, len(PROMPT))
    assert_same_round(ref, v, r0, r1, len(PROMPT))


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_teacher_forced_prefill_matches_reference_prefill(tiny, n):
    cfg, params = tiny
    prompt = PROMPT[:n]
    ref = ReferenceDecoder(cfg, params)
    f0, h0 = ref.prefill(prompt, max_len=16)
    v = Decoder(make_engine("xla", cfg, params, tp=4))
    f1, h1 = v.prefill(prompt, max_len=16)
    assert f1 == f0 and v.launches == len(teacher_forced_launches(n))
    torch.testing.assert_close(h1, h0, rtol=0, atol=1e-4)
    want, got = ref.committed(n), v.committed(n)
    for name in want:  # reference prefill is the chunked GDN form: fp32 agreement ~1e-6
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


def test_xla_tokens_equal_plain_greedy(tiny, plain):
    cfg, params = tiny
    v = Decoder(make_engine("xla", cfg, params, tp=4))
    res = generate(v, PROMPT, len(plain), draft_source=alternating(plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(teacher_forced_launches(len(PROMPT))) + res.rounds
    assert generate(v, PROMPT, len(plain), spec=False).tokens == plain
    assert generate(v, PROMPT, len(plain)).tokens == plain  # the MTP's own drafts


def test_xla_state_invariant_after_forced_rounds(tiny, plain):
    cfg, params = tiny
    v = Decoder(make_engine("xla", cfg, params, tp=4))
    seq, pos = forced_rounds(v, PROMPT, plain, [True, False, False, True, True], cfg.vocab_size)
    assert seq[len(PROMPT):] == plain[:len(seq) - len(PROMPT)]
    want = reference_decode_state(cfg, params, seq[:-1])
    got = v.committed(pos)
    for name in want:
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("mode", ["round", "step"])
def test_xla_forward_has_no_host_values_and_keeps_the_device(tiny_cfg, mode):
    """Fake tensors raise on .item()/.tolist()/int()/bool() of a tensor (what an XLA trace would bake in as a
    constant); meta tensors refuse tensors created on another device (an arange without device=)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    cfg = tiny_cfg
    w = asm.rank_weights(cfg, random_params(cfg, seed=0), "xla", 0, 1, 2)
    st = asm.zero_states(asm.state_specs(cfg, 1, 24, torch.bfloat16))
    rt = rp.round_inputs(cfg, torch.bfloat16, 3, torch.zeros(cfg.hidden_size), 5, 1) if mode == "round" \
        else rp.step_inputs(cfg, 3, 5, 1)
    rt = asm.named_inputs(mode, asm.ordered_inputs(mode, rt))
    plan = asm.launch_plan(cfg, 1, 2, mode)
    with FakeTensorMode() as m:
        out = xla.forward(cfg, plan, *({k: m.from_tensor(t) for k, t in d.items()} for d in (w, st, rt)), SINGLE_RANK)
    T = plan.tokens
    assert [tuple(o.shape) for o in out[:3]] == [(1, 1), (T, 1), (T, cfg.hidden_size)]
    assert out[0].dtype == out[1].dtype == torch.int32 and set(out[3]) == set(rp.STATE)
    assert all(tuple(out[3][n].shape) == tuple(st[n].shape) for n in rp.STATE)
    meta = xla.forward(cfg, plan, *({k: t.to("meta") for k, t in d.items()} for d in (w, st, rt)), SINGLE_RANK)
    assert meta[2].device.type == "meta"


def test_thread_world_collectives_and_errors():
    world = xla.ThreadWorld(3)

    def body(r, coll):
        return coll.all_reduce(torch.tensor([float(r), 1.0])), coll.gather_ranks(torch.tensor([r, 10 * r]))

    for red, gat in world.run(body, [()] * 3):
        assert red.tolist() == [3.0, 3.0] and gat.tolist() == [[0, 0], [1, 10], [2, 20]]

    def failing(r, coll):
        if r == 1:
            raise RuntimeError("rank 1 failed")
        return coll.all_reduce(torch.zeros(1))

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        world.run(failing, [()] * 3)
    assert len(world.run(body, [()] * 3)) == 3  # usable again


# --------------------------------------------------------------------------------------------------
# The megakernel backend behind the same host loop (nkisim)
# --------------------------------------------------------------------------------------------------
@pytest.mark.slow  # the default suite runs the megakernel behind the host loop in the flow against the fakes
def test_megakernel_engine_tokens_equal_plain_greedy(tiny):
    cfg, params = tiny
    prompt = PROMPT[:3]
    want = reference_greedy(cfg, params, prompt, 4)
    v = Decoder(make_engine("megakernel", cfg, params, tp=4))
    res = generate(v, prompt, 4, draft_source=alternating(want, cfg.vocab_size, len(prompt)))
    assert res.tokens == want and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(teacher_forced_launches(len(prompt))) + res.rounds  # one per round, prefill too


# --------------------------------------------------------------------------------------------------
# Config translation
# --------------------------------------------------------------------------------------------------
def test_neuron_config_for_one_trn2_chip():
    cfg = preset("qwen3.6-35b-a3b")
    kw = nxcfg.neuron_config_kwargs(cfg, 4096)
    assert (kw["tp_degree"], kw["logical_nc_config"], kw["batch_size"], kw["seq_len"]) == (4, 2, 1, 4096)
    assert kw["cast_type"] == "as-declared" and kw["torch_dtype"] == "bfloat16" and kw["speculation_length"] == 0
    assert kw["save_sharded_checkpoint"] and "trace_tokengen_model" not in kw
    with pytest.raises(ConfigError, match="max_len"):
        nxcfg.neuron_config_kwargs(cfg, cfg.max_position_embeddings + 1)
    with pytest.raises(asm.AssemblyError):
        nxcfg.neuron_config_kwargs(cfg, 4096, tp=3)
    xla, mk = nxcfg.compiler_args(2, "xla"), nxcfg.compiler_args(2, "megakernel")
    for args in (xla, mk):
        assert "--lnc=2" in args and "--auto-cast=none" in args
    assert "--cc-pipeline-tiling-factor=1" in xla and "-O2" in xla
    # what NxDI builds itself for its token-generation graph (the fake mirrors model_wrapper.py lines 86-128)
    nc = nxd_fakes.NeuronConfig(logical_nc_config=2)
    tkg = nxd_fakes.ModelWrapper(types.SimpleNamespace(neuron_config=nc), nn.Module, tag="token_generation_model")
    assert tkg.compiler_args.split() == (xla + " --internal-hlo2tensorizer-options='--verify-hlo=true'").split()
    with pytest.raises(ConfigError, match="backend"):
        nxcfg.compiler_args(2, "cuda")


def test_lnc_checks():
    nxcfg.check_lnc(2, 2)
    with pytest.raises(ConfigError, match="NEURON_LOGICAL_NC_CONFIG=2"):
        nxcfg.check_lnc(1, 2)
    assert nxcfg.env_lnc({}) is None and nxcfg.env_lnc({"NEURON_LOGICAL_NC_CONFIG": "1"}) == 1
    with pytest.raises(ConfigError, match="not an integer"):
        nxcfg.env_lnc({"NEURON_LOGICAL_NC_CONFIG": "two"})


@pytest.mark.parametrize("name", ["tiny", "qwen3.6-35b-a3b"])
def test_inference_attributes_round_trip(name):
    cfg = preset(name)
    obj = types.SimpleNamespace()
    nxcfg.attribute_loader(cfg, "megakernel", 128, 2, {"x": {"shape": [1], "dtype": "float32"}})(obj)
    assert all(hasattr(obj, a) for a in nxcfg.REQUIRED_ATTRIBUTES)
    assert nxcfg.model_config_from(obj) == cfg and obj.nxdi_lnc == 2
    reloaded = types.SimpleNamespace(**json.loads(json.dumps(vars(obj))))  # as neuron_config.json stores it
    assert nxcfg.model_config_from(reloaded) == cfg and reloaded.nxdi_backend == "megakernel"
    with pytest.raises(ConfigError, match="backend"):
        nxcfg.attribute_loader(cfg, "cuda", 128, 2, {})


# --------------------------------------------------------------------------------------------------
# Checkpoint conversion and its checks
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """A converted xla directory of the tiny model (float32, max_len 32); tests copy it before damaging it."""
    cfg, params = tiny
    return nxconv.write_converted(tmp_path_factory.mktemp("conv") / "xla", cfg, params, "xla", 32)


def _copy(src: Path, dst: Path) -> Path:
    import shutil
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize("backend", asm.BACKENDS)
def test_converted_directory_holds_each_ranks_checkpoint(tiny_cfg, tmp_path, backend):
    cfg = tiny_cfg
    params = random_params(cfg, seed=2)
    out = nxconv.write_converted(tmp_path / "c", cfg, params, backend, 64)
    meta = nxconv.check_converted(out)
    assert (meta["backend"], meta["tp"], meta["lnc"], meta["max_len"], meta["dtype"]) == (backend, 4, 2, 64, "bfloat16")
    for r in range(4):
        got = load_file(str(nxconv.rank_file(out, r)))
        want = asm.rank_checkpoint(asm.rank_weights(cfg, params, backend, r, 4, 2), r)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    specs = asm.tensor_specs(asm.rank_weights(cfg, params, backend, 0, 4, 2))
    assert asm.specs_from_json(meta["param_specs"]) == specs
    from model.config import ModelConfig
    assert ModelConfig.from_json_file(out / "config.json") == cfg
    with pytest.raises(nxconv.ConvertError, match="not a converted"):
        nxconv.read_meta(tmp_path)


def test_converted_directory_checks_refuse_with_one_line(converted, tmp_path):
    for asked in ({"tp": 2}, {"lnc": 1}, {"dtype": "bfloat16"}, {"max_len": 4096}):
        with pytest.raises(nxconv.ConvertError, match=f"converted for {next(iter(asked))}=") as e:
            nxconv.check_converted(converted, **asked)
        assert "\n" not in str(e.value)
    nxconv.check_converted(converted, tp=4, lnc=2, dtype="float32", max_len=32)
    # a rank file without one tensor, with a wrong shape, with an extra tensor, missing
    cases = {"missing": lambda sd: sd.pop(next(k for k in sd if k != asm.RANK_UTIL)),
             "expected": lambda sd: sd.update({k: sd[k][:1] for k in [next(k for k in sd if sd[k].shape[0] > 1)]}),
             "unexpected": lambda sd: sd.update({"weights.bogus": torch.zeros(1)})}
    for what, damage in cases.items():
        d = _copy(converted, tmp_path / what)
        sd = load_file(str(nxconv.rank_file(d, 3)))
        damage(sd)
        save_file(sd, str(nxconv.rank_file(d, 3)))
        with pytest.raises(nxconv.ConvertError, match=what):
            nxconv.check_converted(d)
    d = _copy(converted, tmp_path / "gone")
    nxconv.rank_file(d, 2).unlink()
    with pytest.raises(nxconv.ConvertError, match="rank 2's checkpoint .* is missing"):
        nxconv.check_converted(d)
    old = json.loads((converted / nxconv.META_FILE).read_text())
    d = _copy(converted, tmp_path / "old")
    (d / nxconv.META_FILE).write_text(json.dumps({**old, "format": 1}))
    with pytest.raises(nxconv.ConvertError, match="format 1"):
        nxconv.read_meta(d)


def test_link_rank_files_and_compiled_check(converted, tmp_path):
    meta = nxconv.read_meta(converted)
    nxconv.link_rank_files(converted, tmp_path / "k", 4)
    for r in range(4):
        assert nxconv.rank_file(tmp_path / "k", r).read_bytes() == nxconv.rank_file(converted, r).read_bytes()
    with pytest.raises(nxconv.ConvertError, match="not a compiled"):
        nxconv.check_compiled(tmp_path / "k", meta, converted)
    nc = {"tp_degree": 4, "torch_dtype": "float32"}
    good = {"neuron_config": nc, "nxdi_backend": "xla", "nxdi_lnc": 2, "nxdi_max_len": 32, "nxdi_num_draft_tokens": 1,
            "nxdi_context_buckets": meta["context_buckets"], "nxdi_param_specs": meta["param_specs"]}
    (tmp_path / "k" / nxconv.COMPILED_CONFIG_FILE).write_text(json.dumps(good))
    nxconv.check_compiled(tmp_path / "k", meta, converted)
    (tmp_path / "k" / nxconv.COMPILED_CONFIG_FILE).write_text(json.dumps({**good, "nxdi_max_len": 64}))
    with pytest.raises(nxconv.ConvertError, match="max_len=64 vs 32"):
        nxconv.check_compiled(tmp_path / "k", meta, converted)
    (tmp_path / "k" / nxconv.COMPILED_CONFIG_FILE).write_text(json.dumps({**good, "nxdi_context_buckets": [64]}))
    with pytest.raises(nxconv.ConvertError, match=r"context_buckets=\[64\] vs \[\]"):
        nxconv.check_compiled(tmp_path / "k", meta, converted)


# --------------------------------------------------------------------------------------------------
# run.py
# --------------------------------------------------------------------------------------------------
def test_run_cli_cpu_decode_and_convert(tiny, plain, tmp_path, capsys):
    from harness.nxdi import run
    cfg, params = tiny
    save_checkpoint(tmp_path / "hf", cfg, params)
    ids = ",".join(map(str, PROMPT))
    assert run.main(["decode", "--executor", "cpu", "--backend", "xla", "--model-path", str(tmp_path / "hf"),
                     "--dtype", "float32", "--prompt-ids", ids, "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[:8] and out["launches"] == 1 + out["rounds"]      # one context chunk, then rounds
    assert out["prefill"] == {"backend": "context", "chunks": [[0, 64, len(PROMPT)]], "launches": 1}
    assert run.main(["convert", "--model-path", str(tmp_path / "hf"), "--out", str(tmp_path / "conv"),
                     "--backend", "xla", "--max-len", "64", "--dtype", "float32"]) == 0
    assert nxconv.read_meta(tmp_path / "conv")["backend"] == "xla"
    capsys.readouterr()
    assert run.main(["convert", "--model-path", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_run_cli_refuses_a_conversion_unlike_what_is_asked(converted, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    c, k = str(converted), str(tmp_path / "k")
    ids = "5,17,99"
    for cmd in (["compile", "--converted", c, "--compiled", k],
                ["decode", "--converted", c, "--compiled", k, "--prompt-ids", ids, "--max-new-tokens", "4"]):
        for flag, value, match in (("--lnc", "1", "lnc=2 (asked 1)"), ("--tp", "2", "tp=4 (asked 2)"),
                                   ("--dtype", "bfloat16", "dtype=float32 (asked bfloat16)")):
            refused(capsys, cmd + [flag, value], match)
        monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
        refused(capsys, cmd, "NEURON_LOGICAL_NC_CONFIG=2")
        monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    refused(capsys, ["compile", "--converted", c, "--compiled", k, "--max-len", "64"], "max_len=32 (asked 64)")
    refused(capsys, ["decode", "--converted", c, "--compiled", k, "--prompt-ids", ids, "--max-new-tokens", "40"],
             "needs 44 positions")
    d = _copy(converted, tmp_path / "damaged")
    sd = load_file(str(nxconv.rank_file(d, 1)))
    sd.pop("weights.norms")
    save_file(sd, str(nxconv.rank_file(d, 1)))
    refused(capsys, ["compile", "--converted", str(d), "--compiled", k], "is missing ['weights.norms']")
    refused(capsys, ["decode", "--converted", c, "--compiled", k, "--prompt-ids", ids, "--max-new-tokens", "4"],
             "not a compiled")
    if not SDK_PRESENT:  # every check passes: the missing SDK is the one error left
        refused(capsys, ["compile", "--converted", c, "--compiled", k], "Neuron SDK")


# --------------------------------------------------------------------------------------------------
# The faithful fakes, one behaviour at a time (tests/harness/nxd_fakes.py)
# --------------------------------------------------------------------------------------------------
class _Toy(nn.Module):
    """A graph of a toy application: out = x + w (a weight); with a state, also state + x (its new value)."""

    def __init__(self, shape=(1, 2), outputs=1, stateful=True):
        super().__init__()
        self.w = nn.Parameter(torch.ones(2), requires_grad=False)
        if stateful:
            self.state = nn.Parameter(torch.zeros(2), requires_grad=False)
        self.shape, self.outputs, self.stateful = shape, outputs, stateful

    def forward(self, x):
        y = x.reshape(-1)[:2] + self.w
        return [y] * self.outputs + ([self.state + x.reshape(-1)[:2]] if self.stateful else [])


def _toy_builder(graphs):
    """A fake ModelBuilder over toy graphs {key: (module, state aliased?)}; traced and initialized, tp=1."""
    b = nxd_fakes.ModelBuilder(router=None, tp_degree=1, checkpoint_loader=None)
    for key, (module, alias) in graphs.items():
        inst = nxd_fakes.BaseModelInstance(lambda m=module: m, {module.state: module.outputs} if alias else {})
        b.add(key, inst, [(torch.zeros(module.shape),)])
    ex = b.trace(initialize_model_weights=False)
    ex.nxd_model.initialize([{"w": torch.ones(2)}], torch.tensor([0]))
    return ex


def test_fake_causal_lm_asserts_every_graph_says_whether_it_is_prefill(monkeypatch):
    nxd_fakes.install(monkeypatch)

    class App(nxd_fakes.NeuronBaseForCausalLM):
        def enable_context_encoding(self):
            pass

        def enable_token_generation(self):  # registers a graph with the application's own config
            self.models.append(nxd_fakes.ModelWrapper(self.config, nn.Module, tag="g", compiler_args="-O1"))

    config = nxd_fakes.InferenceConfig(nxd_fakes.NeuronConfig(), vocab_size=10)
    assert config.neuron_config.is_prefill_stage is None
    with pytest.raises(AssertionError, match="g doesn't indicate whether it is part of the prefill"):
        App("unused", config=config)
    nxd_fakes.uninstall()


def test_fake_sharding_touches_only_nxd_parallel_layers():
    with nxd_fakes._ParallelState.initialized(4):
        m = nn.Module()
        m.rank_util = nxd_fakes.SPMDRank(world_size=4)
        m.linear = nxd_fakes.BaseParallelLinear(8, 3, tp=4)
        m.weights = nn.ParameterDict({"a": nn.Parameter(torch.zeros(2, 3))})
    full = {"rank_util.rank": torch.arange(4, dtype=torch.int32), "linear.weight": torch.arange(24.).reshape(8, 3),
            "weights.a": torch.arange(24.).reshape(8, 3), "not.in.model": torch.zeros(1)}
    ck = dict(full)
    nxd_fakes.get_sharded_checkpoint(ck, m, rank=2, tp_degree=4)
    assert ck["rank_util.rank"].tolist() == [2] and torch.equal(ck["linear.weight"], full["linear.weight"][4:6])
    assert torch.equal(ck["weights.a"], full["weights.a"])  # a ParameterDict keeps the whole tensor on every rank
    assert "not.in.model" not in ck


def test_fake_executor_takes_the_last_graphs_arity_and_routes_by_shapes():
    a, b = _Toy(shape=(1, 2)), _Toy(shape=(1, 3))
    ex = _toy_builder({"a": (a, True), "b": (b, True)})
    ex(torch.zeros(1, 2))  # the last graph's arity (one input); the route is found by the shapes
    with pytest.raises(RuntimeError, match="expected 1 argument"):
        ex(torch.zeros(1, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="not found in input_shape_map"):
        ex.nxd_model.forward([torch.zeros(1, 4)])
    assert ex.nxd_model.forward([torch.ones(1, 3)])[0].tolist() == [2.0, 2.0]
    # two graphs with the same input shapes: the later one takes the route over, silently
    same = _toy_builder({"a": (_Toy(), True), "b": (_Toy(), True)})
    assert set(same.nxd_model.input_shape_map.values()) == {("b", 0)}


def test_fake_packer_and_state_come_from_the_first_graph():
    first, second = _Toy(shape=(1, 2), outputs=1), _Toy(shape=(1, 3), outputs=2)
    ex = _toy_builder({"a": (first, True), "b": (second, True)})
    with pytest.raises(RuntimeError, match="packs 1 outputs, got 2"):
        ex.nxd_model.forward([torch.zeros(1, 3)])  # the second graph's own two outputs
    # the first graph aliases no state: the device state holds none, the second graph's state is missing
    with pytest.raises(RuntimeError, match="'state' is not in rank 0's device state"):
        _toy_builder({"a": (_Toy(shape=(1, 2), stateful=False), False), "b": (_Toy(shape=(1, 3)), True)})
    # a parameter the graph takes without aliasing it is a WEIGHT: initialize needs it in the checkpoint
    with pytest.raises(RuntimeError, match="weight 'state' is not in rank 0's checkpoint"):
        _toy_builder({"a": (_Toy(), False)})


def test_fake_aliased_outputs_update_the_state_in_place():
    ex = _toy_builder({"a": (_Toy(), True)})
    for _ in range(3):
        ex.nxd_model.forward([torch.ones(1, 2)])
    assert ex.nxd_model.state[0]["state"].tolist() == [3.0, 3.0]


def test_fake_lnc_comes_from_the_environment_first(monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.warns(UserWarning, match="Using NEURON_LOGICAL_NC_CONFIG"):
        assert nxd_fakes.NeuronConfig(logical_nc_config=2).logical_nc_config == 1
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG")
    assert nxd_fakes.NeuronConfig(logical_nc_config=1).logical_nc_config == 1
    assert nxd_fakes.NeuronConfig().logical_nc_config == 2  # trn2's platform default


# --------------------------------------------------------------------------------------------------
# The trn2 module against the fakes: construction, compile, load, and the whole flow
# --------------------------------------------------------------------------------------------------
def _count_runs(monkeypatch):
    runs = []
    real = nxd_fakes.TracedGraph.run
    monkeypatch.setattr(nxd_fakes.TracedGraph, "run", lambda self, inputs: runs.append(self.key) or real(self, inputs))
    return runs


def test_trn2_application_against_the_fakes(fake_nxd, converted, tmp_path, monkeypatch, caplog):
    m = fake_nxd
    config = m.Qwen36InferenceConfig.from_converted(converted)
    assert not [r for r in caplog.records if "Unexpected keyword" in r.getMessage()]  # every keyword is NxDI's
    app = m.Qwen36ForCausalLM(str(converted), config=config)
    assert [w.tag for w in app.models] == ["round_model", "step_model", "reset_state_model"]
    assert all(w.neuron_config.is_prefill_stage is False and w.neuron_config.buckets == [32] for w in app.models)
    assert app.config.neuron_config.is_prefill_stage is None  # each graph has its own copy
    assert "--cc-pipeline-tiling-factor=1" in app.models[0].compiler_args
    with pytest.raises(RuntimeError, match="pre-sharded per rank"):
        nxd_fakes.NeuronApplicationBase.shard_weights(app, tmp_path / "nxd_path")  # NxD's own sharding path
    m.NeuronEngine.compile(converted, tmp_path / "k")
    for r in range(4):
        assert load_file(str(nxconv.rank_file(tmp_path / "k", r)))[asm.RANK_UTIL].tolist() == [r]
    runs = _count_runs(monkeypatch)
    app = m.Qwen36ForCausalLM(str(converted), config=m.Qwen36InferenceConfig.load(str(tmp_path / "k")))
    app.load(str(tmp_path / "k"))
    assert runs == ["round_model", "step_model", "reset_state_model"]  # warmup ran every graph, in order
    state = app.traced_model.nxd_model.state
    with pytest.raises(RuntimeError, match="expected 1 argument"):
        app.traced_model(*asm.ordered_inputs("step", rp.step_inputs(app.config.model_config(), 1, 0, 0)))
    app.launch("step", rp.step_inputs(app.config.model_config(), 7, 0, 0))
    assert any(t.any() for st in state for t in st.values())  # the step wrote into the decode state ...
    app.reset_state()
    assert not any(t.any() for st in state for t in st.values())  # ... the reset graph zeroed all of it
    eng = m.NeuronEngine.load(converted, tmp_path / "k", warmup=False)
    assert not any(t.any() for st in eng.app.traced_model.nxd_model.state for t in st.values())


def test_trn2_application_refuses_another_running_lnc(fake_nxd, converted, monkeypatch):
    monkeypatch.setenv("NEURON_LOGICAL_NC_CONFIG", "1")
    with pytest.raises(ConfigError, match="running LNC is 1"), pytest.warns(UserWarning, match="does not match"):
        fake_nxd.Qwen36ForCausalLM(str(converted), config=fake_nxd.Qwen36InferenceConfig.from_converted(converted))


def test_trn2_xla_flow_against_the_fakes_tokens_equal_plain_greedy(fake_nxd, tiny, plain, converted, tmp_path):
    cfg, params = tiny
    fake_nxd.NeuronEngine.compile(converted, tmp_path / "k")
    v = Decoder(fake_nxd.NeuronEngine.load(converted, tmp_path / "k"))
    res = generate(v, PROMPT, 8, draft_source=alternating(plain, cfg.vocab_size))
    assert res.tokens == plain[:8] and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(teacher_forced_launches(len(PROMPT))) + res.rounds
    assert generate(v, PROMPT, 8, spec=False).tokens == plain[:8]  # the step graph
    assert generate(v, PROMPT, 8).tokens == plain[:8]               # the MTP's own drafts


def test_trn2_cli_flow_against_the_fakes(fake_nxd, plain, converted, tmp_path, capsys):
    from harness.nxdi import run
    k = str(tmp_path / "k")
    assert run.main(["compile", "--converted", str(converted), "--compiled", k, "--tp", "4", "--lnc", "2"]) == 0
    ids = ",".join(map(str, PROMPT))
    assert run.main(["decode", "--converted", str(converted), "--compiled", k, "--prompt-ids", ids,
                     "--max-new-tokens", "6", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[:6] and out["executor"] == "neuron"
    other = nxconv.write_converted(tmp_path / "other", preset("tiny"), random_params(preset("tiny"), seed=4,
                                                                                     dtype=torch.float32), "xla", 24)
    refused(capsys, ["decode", "--converted", str(other), "--compiled", k, "--prompt-ids", ids,
                      "--max-new-tokens", "4"], "compiled from another conversion")


def test_trn2_megakernel_flow_against_the_fakes_tokens_equal_plain_greedy(fake_nxd, tiny, tmp_path):
    """The megakernel graphs under nkisim: each rank's kernel call is one 4-rank x LNC=2 launch."""
    cfg, params = tiny
    prompt = PROMPT[:3]
    want = reference_greedy(cfg, params, prompt, 4)
    conv = nxconv.write_converted(tmp_path / "mk", cfg, params, "megakernel", 16)
    fake_nxd.NeuronEngine.compile(conv, tmp_path / "k")
    v = Decoder(fake_nxd.NeuronEngine.load(conv, tmp_path / "k", warmup=False))
    res = generate(v, prompt, 4, draft_source=alternating(want, cfg.vocab_size, len(prompt)))
    assert res.tokens == want and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(teacher_forced_launches(len(prompt))) + res.rounds
