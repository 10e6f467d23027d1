"""The NxDI adapter's plain logic (harness/nxdi), on CPU. Nothing here runs NxDI, NxD or the Neuron compiler.

* Import guard: ``import harness.nxdi`` works without the SDK; the trn2-only names raise a clear ImportError.
* Assembly: the kernel's argument names (the generated signature), per-rank shapes/dtypes of weights and
  state, the NxDI state dict and its per-rank slices, run-time inputs for several positions, the traced
  forward's input prefixes and the state aliasing.
* Host: the teacher-forced prefill plan, slot selection sequences, what the variant passes to an engine.
* The xla backend (``xla_math``, the function traced on trn2): one round vs the reference round
  (fp32, 1e-4 absolute, as tests/harness/test_kernel_variants.py), teacher-forced prefill vs the
  reference prefill, tokens = plain greedy, the decode-state invariant, and no host-value dependence
  (fake tensors) and no tensors created off the inputs' device (meta tensors).
* The megakernel backend behind the same host loop under nkisim: tokens = plain greedy.
* Config translation, checkpoint conversion, the run.py CLI.
* The trn2 module's wiring, against FAKE NxDI base classes that provide only what our subclasses call.
  This checks our code (names, shapes, forward order, aliasing), not NxDI's.
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
from torch import nn

from harness.nxdi import assembly as asm
from harness.nxdi import config as nxcfg
from harness.nxdi import convert as nxconv
from harness.nxdi import xla_math
from harness.nxdi.cpu import CpuEngine, ThreadWorld
from harness.nxdi.host import NxdiVariant, PrefillLaunch, SlotBook, accepted_count, prefill_plan
from harness.speculative import forced_rounds, generate, token_by_token_state
from harness.variants import XlaVariant
from megakernel.round import RUNTIME_INPUTS, build_kernel, mutated_names
from megakernel.sharded import rank_state, rank_weights
from model import functional as fn
from model.config import ConfigError, preset
from model.params import random_params
from model.state import DecodeState
from model.weights import save_checkpoint

PROMPT = [5, 17, 99, 3, 250, 41]
SDK_PRESENT = importlib.util.find_spec("neuronx_distributed_inference") is not None


@pytest.fixture(scope="module")
def tiny(tiny_cfg):
    return tiny_cfg, random_params(tiny_cfg, seed=3, dtype=torch.float32)


@pytest.fixture(scope="module")
def plain(tiny):
    cfg, params = tiny
    return generate(XlaVariant(cfg, params), PROMPT, 12, spec=False).tokens


def right_draft(plain_tokens):
    return lambda seq: plain_tokens[len(seq) - len(PROMPT)] if len(seq) - len(PROMPT) < len(plain_tokens) else 0


def alternating(plain_tokens, vocab):
    """Right, wrong, right, ... drafts: both accept paths run."""
    right, calls = right_draft(plain_tokens), []

    def source(seq):
        calls.append(1)
        return right(seq) if len(calls) % 2 else (right(seq) + 1) % vocab
    return source


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
    assert project <= {"harness.nxdi", "megakernel.round", "model.config"}


# --------------------------------------------------------------------------------------------------
# Assembly: kernel arguments, shapes, state dict
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["round", "step"])
def test_kernel_argument_names_match_the_generated_signature(tiny_cfg, mode):
    cfg, tp, lnc = tiny_cfg, 4, 2
    params = random_params(cfg, seed=0)
    weights = asm.rank_weights(cfg, params, "megakernel", 0, tp, lnc)
    specs = asm.state_specs(cfg, tp, 24, torch.bfloat16)
    names = asm.kernel_arg_names(weights, specs, mode)
    # what harness.kernel_variants launches with: sorted names of {weights, state, run-time inputs}
    state = rank_state(cfg, DecodeState.empty(cfg, 24, 2, torch.bfloat16), 0, tp)
    assert names == sorted({**rank_weights(cfg, params, 0, tp, lnc), **state, **dict.fromkeys(RUNTIME_INPUTS[mode])})
    kernel = build_kernel(asm.round_spec(cfg, tp, lnc, mode), names)
    assert list(inspect.signature(kernel).parameters) == names
    rt = asm.round_inputs(cfg, torch.bfloat16, 3, torch.zeros(cfg.hidden_size), 4, 0) if mode == "round" \
        else asm.step_inputs(cfg, 3, 4, 0)
    kwargs = asm.kernel_kwargs(names, weights, asm.zero_states(specs), rt)
    assert list(kwargs) == names
    with pytest.raises(asm.AssemblyError, match="missing.*unexpected"):
        asm.kernel_kwargs(names, weights, asm.zero_states(specs), {**rt, "bogus": 1})
    with pytest.raises(asm.AssemblyError, match="both a weight and a state"):
        asm.kernel_arg_names(["l0_window"], ["l0_window"], mode)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_state_specs_equal_the_kernels_state_layout(tiny_cfg, tp):
    for dtype in (torch.bfloat16, torch.float32):
        specs = asm.state_specs(tiny_cfg, tp, 40, dtype)
        for r in range(tp):
            got = rank_state(tiny_cfg, DecodeState.empty(tiny_cfg, 40, 2, dtype), r, tp)
            assert {k: (tuple(v.shape), v.dtype) for k, v in got.items()} == specs


@pytest.mark.parametrize("backend", asm.BACKENDS)
def test_neuron_state_dict_concatenates_ranks_and_slices_back(tiny_cfg, backend):
    cfg, tp, lnc = tiny_cfg, 4, 2
    params = random_params(cfg, seed=1)
    sd = asm.neuron_state_dict(cfg, params, backend, tp, lnc)
    assert torch.equal(sd[asm.RANK_UTIL], torch.arange(tp, dtype=torch.int32))
    specs = asm.param_specs(sd, tp)
    for r in range(tp):
        w = asm.rank_weights(cfg, params, backend, r, tp, lnc)
        assert {k: (tuple(v.shape), v.dtype) for k, v in w.items()} == specs
        got = asm.rank_slice(sd, r, tp)
        assert set(got) == set(w) and all(torch.equal(got[k], w[k]) for k in w)
    assert asm.specs_from_json(json.loads(json.dumps(asm.specs_to_json(specs)))) == specs


def test_kernel_layout_keeps_fp32_where_the_kernels_need_it(tiny_cfg):
    w = asm.rank_weights(tiny_cfg, random_params(tiny_cfg, seed=0), "megakernel", 1, 4, 2)
    assert w["l0_gdn_A_log"].dtype == torch.float32 and w["final_norm"].dtype == torch.float32
    assert w["embed"].dtype == torch.bfloat16 and all(t.is_contiguous() for t in w.values())


@pytest.mark.parametrize("pos", [1, 2, 7, 600])
def test_round_inputs_for_positions(tiny_cfg, pos):
    cfg = tiny_cfg
    h = torch.randn(cfg.hidden_size)
    rt = asm.round_inputs(cfg, torch.bfloat16, 11, h, pos, 1, forced_draft=42)
    ex = asm.runtime_example(cfg, "round", torch.bfloat16)
    for name, t in zip(asm.forward_inputs("round"), asm.ordered_inputs("round", rt)):
        assert t.shape == ex[name].shape and t.dtype == ex[name].dtype, name
    assert rt["pos"].tolist() == [[pos]] and rt["pos_d1"].tolist() == [[pos - 1]]
    assert rt["pending"].tolist() == [[11]] and rt["read_slot"].tolist() == [[1]] and rt["force"].tolist() == [[1, 42]]
    assert torch.equal(rt["hidden"], h.reshape(1, -1).to(torch.bfloat16))
    for (cos, sin), start, t in (((rt["cos_d1"], rt["sin_d1"]), pos - 1, 1), ((rt["cos_v"], rt["sin_v"]), pos, 2)):
        c, s = fn.rope_cos_sin(torch.arange(start, start + t), cfg.rotary_dim, cfg.rope_theta)
        torch.testing.assert_close(torch.as_tensor(cos), c, rtol=0, atol=1e-5)
        torch.testing.assert_close(torch.as_tensor(sin), s, rtol=0, atol=1e-5)
    assert asm.round_inputs(cfg, torch.bfloat16, 11, h, pos, 0)["force"].tolist() == [[0, 0]]
    st = asm.step_inputs(cfg, 9, pos, 0)
    ex = asm.runtime_example(cfg, "step", torch.bfloat16)
    for name, t in zip(asm.forward_inputs("step"), asm.ordered_inputs("step", st)):
        assert t.shape == ex[name].shape and t.dtype == ex[name].dtype, name


def test_runtime_input_errors(tiny_cfg):
    h = torch.zeros(tiny_cfg.hidden_size)
    with pytest.raises(asm.AssemblyError, match=">= 1"):
        asm.round_inputs(tiny_cfg, torch.float32, 1, h, 0, 0)
    with pytest.raises(asm.AssemblyError, match="outside the vocabulary"):
        asm.round_inputs(tiny_cfg, torch.float32, tiny_cfg.vocab_size, h, 3, 0)
    with pytest.raises(asm.AssemblyError, match="read_slot"):
        asm.step_inputs(tiny_cfg, 1, 3, 2)
    with pytest.raises(asm.AssemblyError, match="hidden_size"):
        asm.round_inputs(tiny_cfg, torch.float32, 1, torch.zeros(7), 3, 0)
    with pytest.raises(asm.AssemblyError, match="do not match"):
        asm.ordered_inputs("step", asm.round_inputs(tiny_cfg, torch.float32, 1, h, 3, 0))


def test_forward_inputs_are_prefixes_and_aliases_follow_the_outputs(tiny_cfg):
    assert asm.forward_inputs("reset") == ("pending",)
    assert asm.forward_inputs("round") == asm.FORWARD_INPUTS
    assert asm.FORWARD_INPUTS[:len(asm.forward_inputs("step"))] == asm.forward_inputs("step")
    for mode in ("round", "step"):
        assert set(asm.forward_inputs(mode)) == set(RUNTIME_INPUTS[mode])
    states = list(asm.state_specs(tiny_cfg, 4, 24, torch.bfloat16))
    for mode in ("round", "step"):
        spec = asm.round_spec(tiny_cfg, 4, 2, mode)
        al = asm.state_aliases(spec)
        assert list(al) == mutated_names(spec) and list(al.values()) == list(range(3, 3 + len(al)))
        assert set(al) <= set(states)
    assert set(asm.state_aliases(asm.round_spec(tiny_cfg, 4, 2, "round"))) == set(states)  # a round writes all
    assert not any(n.startswith("mtp") for n in asm.state_aliases(asm.round_spec(tiny_cfg, 4, 2, "step")))
    assert asm.reset_aliases(states) == {n: 1 + i for i, n in enumerate(states)}


def test_sharding_is_checked_up_front(tiny_cfg, small_cfg):
    with pytest.raises(asm.AssemblyError, match="tp=3"):
        asm.check_sharding(tiny_cfg, 3, 2)
    with pytest.raises(asm.AssemblyError, match="does not shard"):
        asm.check_sharding(small_cfg, 4, 2)
    asm.check_sharding(preset("qwen3.6-35b-a3b"), 4, 2)


# --------------------------------------------------------------------------------------------------
# Host: prefill plan, slots, what reaches the engine
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", range(1, 9))
def test_prefill_plan_covers_the_prompt_once(n):
    plan = prefill_plan(n)
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
        prefill_plan(0)


def test_slot_book_sequences():
    book = SlotBook()
    assert [book.commit(a) for a in (2, 1, 1, 2, 2, 1)] == [1, 0, 0, 1, 1, 0]
    for bad in (0, 3):
        with pytest.raises(ValueError, match="1..2"):
            book.commit(bad)
    book.reset()
    assert book.read_slot == 0
    assert accepted_count(5, [5, 9]) == 2 and accepted_count(4, [5, 9]) == 1


class RecordingEngine:
    """A fake engine: records the run-time inputs and answers with fixed tokens."""

    def __init__(self, cfg, max_len=64):
        self.cfg, self.dtype, self.max_len, self.launches = cfg, torch.float32, max_len, 0
        self.calls, self.resets = [], 0

    def reset(self):
        self.resets += 1

    def run(self, mode, runtime):
        self.launches += 1
        self.calls.append((mode, {k: (v.tolist() if hasattr(v, "tolist") else v) for k, v in runtime.items()}))
        T = 2 if mode == "round" else 1
        d = runtime["force"][0, 1] if mode == "round" and runtime["force"][0, 0] else 7
        hidden = torch.arange(T, dtype=torch.float32)[:, None].expand(T, self.cfg.hidden_size) + 100 * self.launches
        return asm.LaunchResult(int(d), [7 + self.launches, 8 + self.launches][:T], hidden)


def test_variant_prefill_and_slot_selection(tiny_cfg):
    eng = RecordingEngine(tiny_cfg)
    v = NxdiVariant(eng)
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
    with pytest.raises(NotImplementedError):
        v.committed(3)


def test_variant_prefill_odd_tail_commits_one(tiny_cfg):
    eng = RecordingEngine(tiny_cfg)
    first, _ = NxdiVariant(eng).prefill([10, 11, 12, 13], max_len=20)
    assert [rt.get("force") for _, rt in eng.calls] == [None, [[1, 12]], [[0, 0]]]
    assert first == 7 + 3  # targets[0] of the last launch: the token after x_3


# --------------------------------------------------------------------------------------------------
# The xla backend
# --------------------------------------------------------------------------------------------------
def _engine_from_reference(cfg, params, backend, tp, ref_state, max_len):
    eng = CpuEngine(cfg, params, backend, max_len=max_len, tp=tp)
    eng.states = [rank_state(cfg, ref_state, r, tp) for r in range(tp)]
    return eng


@pytest.mark.parametrize("tp", [1, 4])
def test_xla_round_matches_reference_round(tiny, tp):
    cfg, params = tiny
    ref = XlaVariant(cfg, params)
    first, h = ref.prefill(PROMPT, max_len=24)
    eng = _engine_from_reference(cfg, params, "xla", tp, ref.state, 24)
    v = NxdiVariant(eng)
    r1 = v.round(first, h, len(PROMPT))
    r0 = ref.round(first, h, len(PROMPT))
    assert (r1.draft, r1.targets) == (r0.draft, r0.targets)
    assert torch.isfinite(r1.hidden).all() and r1.hidden.abs().max() > 0.1
    torch.testing.assert_close(r1.hidden, r0.hidden, rtol=0, atol=1e-4)
    p = len(PROMPT)
    for slot in (0, 1):
        ref.commit(slot + 1)
        v.commit(slot + 1)
        want, got = ref.committed(p + 1 + slot), v.committed(p + 1 + slot)
        for name in want:
            torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


@pytest.mark.parametrize("n", [1, 2, 5, 6])
def test_teacher_forced_prefill_matches_reference_prefill(tiny, n):
    cfg, params = tiny
    prompt = PROMPT[:n]
    ref = XlaVariant(cfg, params)
    f0, h0 = ref.prefill(prompt, max_len=16)
    v = NxdiVariant(CpuEngine(cfg, params, "xla", max_len=16, tp=4))
    f1, h1 = v.prefill(prompt, max_len=16)
    assert f1 == f0 and v.launches == len(prefill_plan(n))
    torch.testing.assert_close(h1, h0, rtol=0, atol=1e-4)
    want, got = ref.committed(n), v.committed(n)
    for name in want:  # reference prefill is the chunked GDN form: fp32 agreement ~1e-6
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)


def test_xla_tokens_equal_plain_greedy(tiny, plain):
    cfg, params = tiny
    v = NxdiVariant(CpuEngine(cfg, params, "xla", max_len=32, tp=4))
    res = generate(v, PROMPT, len(plain), draft_source=alternating(plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(prefill_plan(len(PROMPT))) + res.rounds
    assert generate(v, PROMPT, len(plain), spec=False).tokens == plain
    assert generate(v, PROMPT, len(plain)).tokens == plain  # the MTP's own drafts


def test_xla_state_invariant_after_forced_rounds(tiny, plain):
    cfg, params = tiny
    v = NxdiVariant(CpuEngine(cfg, params, "xla", max_len=32, tp=4))
    seq, pos = forced_rounds(v, PROMPT, plain, [True, False, False, True, True], cfg.vocab_size)
    assert seq[len(PROMPT):] == plain[:len(seq) - len(PROMPT)]
    want = token_by_token_state(XlaVariant(cfg, params), seq[:-1])
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
    rt = asm.round_inputs(cfg, torch.bfloat16, 3, torch.zeros(cfg.hidden_size), 5, 1) if mode == "round" \
        else asm.step_inputs(cfg, 3, 5, 1)
    rt = dict(zip(asm.forward_inputs(mode), asm.ordered_inputs(mode, rt)))
    spec = asm.round_spec(cfg, 1, 2, mode)
    with FakeTensorMode() as m:
        out = xla_math.forward(cfg, spec, *({k: m.from_tensor(t) for k, t in d.items()} for d in (w, st, rt)),
                               xla_math.SINGLE_RANK)
    T = spec.tokens
    assert [tuple(o.shape) for o in out[:3]] == [(1, 1), (T, 1), (T, cfg.hidden_size)]
    assert out[0].dtype == out[1].dtype == torch.int32 and list(out[3]) == mutated_names(spec)
    meta = xla_math.forward(cfg, spec, *({k: t.to("meta") for k, t in d.items()} for d in (w, st, rt)),
                            xla_math.SINGLE_RANK)
    assert meta[2].device.type == "meta"


def test_thread_world_collectives_and_errors():
    world = ThreadWorld(3)

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
def test_megakernel_engine_tokens_equal_plain_greedy(tiny, plain):
    cfg, params = tiny
    n = 5
    v = NxdiVariant(CpuEngine(cfg, params, "megakernel", max_len=16, tp=4))
    res = generate(v, PROMPT, n, draft_source=alternating(plain, cfg.vocab_size))
    assert res.tokens == plain[:n] and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.launches == len(prefill_plan(len(PROMPT))) + res.rounds  # one launch per round, prefill included


# --------------------------------------------------------------------------------------------------
# Config translation and checkpoint conversion
# --------------------------------------------------------------------------------------------------
def test_neuron_config_for_one_trn2_chip():
    cfg = preset("qwen3.6-35b-a3b")
    kw = nxcfg.neuron_config_kwargs(cfg, 4096)
    assert (kw["tp_degree"], kw["logical_nc_config"], kw["batch_size"], kw["seq_len"]) == (4, 2, 1, 4096)
    assert kw["cast_type"] == "as-declared" and kw["torch_dtype"] == "bfloat16" and kw["speculation_length"] == 0
    with pytest.raises(ConfigError, match="max_len"):
        nxcfg.neuron_config_kwargs(cfg, cfg.max_position_embeddings + 1)
    with pytest.raises(asm.AssemblyError):
        nxcfg.neuron_config_kwargs(cfg, 4096, tp=3)
    args = nxcfg.compiler_args(2)
    assert "--lnc=2" in args and "--auto-cast=none" in args


@pytest.mark.parametrize("name", ["tiny", "qwen3.6-35b-a3b"])
def test_inference_attributes_round_trip(name):
    cfg = preset(name)
    obj = types.SimpleNamespace()
    nxcfg.attribute_loader(cfg, "megakernel", 128, {"x": {"shape": [1], "dtype": "float32"}})(obj)
    assert all(hasattr(obj, a) for a in nxcfg.REQUIRED_ATTRIBUTES)
    assert nxcfg.model_config_from(obj) == cfg
    reloaded = types.SimpleNamespace(**json.loads(json.dumps(vars(obj))))  # as neuron_config.json stores it
    assert nxcfg.model_config_from(reloaded) == cfg and reloaded.nxdi_backend == "megakernel"
    with pytest.raises(ConfigError, match="backend"):
        nxcfg.attribute_loader(cfg, "cuda", 128, {})


@pytest.mark.parametrize("backend,shard_bytes", [("xla", 1 << 40), ("megakernel", 300_000)])
def test_converted_checkpoint_equals_the_state_dict(tiny_cfg, tmp_path, backend, shard_bytes):
    cfg = tiny_cfg
    params = random_params(cfg, seed=2)
    want = asm.neuron_state_dict(cfg, params, backend, 4, 2)
    consumed = dict(params)
    out = nxconv.write_converted(tmp_path / "c", cfg, consumed, backend, 64, shard_bytes=shard_bytes)
    assert not consumed  # freed once converted
    got = nxconv.load_converted(out)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    meta = nxconv.read_meta(out)
    assert (meta["backend"], meta["tp"], meta["lnc"], meta["max_len"]) == (backend, 4, 2, 64)
    assert asm.specs_from_json(meta["param_specs"]) == asm.param_specs(want, 4)
    assert (out / nxconv.INDEX_FILE).is_file() == (shard_bytes < 1 << 40)
    from model.config import ModelConfig
    assert ModelConfig.from_json_file(out / "config.json") == cfg
    with pytest.raises(nxconv.ConvertError, match="not a converted"):
        nxconv.read_meta(tmp_path)


# --------------------------------------------------------------------------------------------------
# run.py
# --------------------------------------------------------------------------------------------------
def test_run_cli_cpu_decode_convert_and_neuron_errors(tiny, plain, tmp_path, capsys):
    from harness.nxdi import run
    cfg, params = tiny
    save_checkpoint(tmp_path / "hf", cfg, params)
    ids = ",".join(map(str, PROMPT))
    assert run.main(["decode", "--executor", "cpu", "--backend", "xla", "--model-path", str(tmp_path / "hf"),
                     "--dtype", "float32", "--prompt-ids", ids, "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[:8] and out["launches"] == len(prefill_plan(len(PROMPT))) + out["rounds"]
    assert run.main(["convert", "--model-path", str(tmp_path / "hf"), "--out", str(tmp_path / "conv"),
                     "--backend", "xla", "--max-len", "64", "--dtype", "float32"]) == 0
    assert nxconv.read_meta(tmp_path / "conv")["backend"] == "xla"
    capsys.readouterr()
    assert run.main(["convert", "--model-path", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err
    if not SDK_PRESENT:
        assert run.main(["compile", "--converted", str(tmp_path / "conv"), "--compiled", str(tmp_path / "k")]) == 2
        assert "Neuron SDK" in capsys.readouterr().err
        assert run.main(["decode", "--converted", str(tmp_path / "conv"), "--compiled", str(tmp_path / "k"),
                         "--prompt-ids", ids]) == 2
        assert "Neuron SDK" in capsys.readouterr().err


# --------------------------------------------------------------------------------------------------
# The trn2 module's wiring against fake NxDI base classes
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def fake_nxdi(monkeypatch):
    """Minimal stand-ins for the NxD/NxDI names modeling.py imports: enough to construct our subclasses and
    run the module's forward eagerly at TP=1 (collectives are identities). They do NOT behave like NxDI."""
    def module(name, **attrs):
        m = types.ModuleType(name)
        m.__dict__.update(attrs)
        monkeypatch.setitem(sys.modules, name, m)

    def set_attrs(t, is_parallel, dim, stride=1):
        t.tensor_model_parallel, t.partition_dim, t.partition_stride = is_parallel, dim, stride

    class InferenceConfig:
        def __init__(self, neuron_config, load_config=None, **kwargs):
            self.neuron_config = neuron_config
            if load_config is not None:
                load_config(self)
            self.__dict__.update(kwargs)
            missing = [a for a in self.get_required_attributes() if not hasattr(self, a)]
            assert not missing, missing

    class NeuronConfig:
        def __init__(self, **kw):
            self.__dict__.update(kw)
            self.torch_dtype = getattr(torch, kw["torch_dtype"])

    class NeuronBaseModel(nn.Module):
        def __init__(self, config, optimize_inference=True):
            super().__init__()
            self.config, self.neuron_config = config, config.neuron_config
            self.setup_attr_for_model(config)
            self.init_model(config)

    class ModelWrapper(nn.Module):
        def __init__(self, config, model_cls, tag="", compiler_args=None, **kw):
            super().__init__()
            self.config, self.neuron_config, self.model_cls, self.tag = config, config.neuron_config, model_cls, tag
            self.compiler_args = compiler_args

    for pkg in ("neuronx_distributed", "neuronx_distributed.parallel_layers", "neuronx_distributed.trace",
                "neuronx_distributed_inference", "neuronx_distributed_inference.models"):
        module(pkg)
    module("neuronx_distributed.parallel_layers.mappings", reduce_from_tensor_model_parallel_region=lambda t: t,
           gather_from_tensor_model_parallel_region=lambda t: t)
    module("neuronx_distributed.parallel_layers.utils", set_tensor_model_parallel_attributes=set_attrs)
    module("neuronx_distributed.trace.model_builder", BaseModelInstance=object)
    module("neuronx_distributed_inference.models.config", InferenceConfig=InferenceConfig, NeuronConfig=NeuronConfig)
    module("neuronx_distributed_inference.models.model_base", NeuronBaseModel=NeuronBaseModel,
           NeuronBaseForCausalLM=object)
    module("neuronx_distributed_inference.models.model_wrapper", ModelWrapper=ModelWrapper)
    monkeypatch.delitem(sys.modules, "harness.nxdi.modeling", raising=False)
    mod = importlib.import_module("harness.nxdi.modeling")
    yield mod
    sys.modules.pop("harness.nxdi.modeling", None)
    import harness.nxdi
    harness.nxdi.__dict__.pop("modeling", None)  # or `from harness.nxdi import modeling` would find it


def test_trn2_module_wiring_with_fake_nxdi(fake_nxdi, tiny, tmp_path):
    m = fake_nxdi
    cfg, params = tiny
    tp = 1
    conv = nxconv.write_converted(tmp_path / "conv", cfg, dict(params), "xla", 24, tp=tp)
    config = m.Qwen36InferenceConfig.from_converted(conv)
    assert config.model_config() == cfg and config.neuron_config.tp_degree == tp
    sd = m.Qwen36ForCausalLM.get_state_dict(str(conv), config)
    want = m.Qwen36ForCausalLM.convert_hf_to_neuron_state_dict(params, config)
    assert set(sd) == set(want) and all(torch.equal(sd[k], want[k]) for k in want)

    graphs = {}
    for mode in ("reset", "step", "round"):
        wrapper = m._GraphWrapper(config, m.Qwen36NeuronModel, mode, "args")
        (example,) = wrapper.input_generator()
        assert len(example) == len(asm.forward_inputs(mode))
        inst = wrapper.get_model_instance()
        inst.load_module()
        module, aliases = inst.get(None)
        for name, p in module.weights.items():
            assert p.partition_dim == 0 and p.tensor_model_parallel
            p.data = asm.rank_slice(sd, 0, tp)[name].clone()
        graphs[mode] = (module, aliases)
    # the graphs must agree on the state buffers they share
    names = [list(g.states) for g, _ in graphs.values()]
    assert names[0] == names[1] == names[2]

    eng = CpuEngine(cfg, params, "xla", max_len=24, tp=tp)  # the reference for the module's outputs
    state = {k: v.clone() for k, v in eng.states[0].items()}

    def launch(mode, runtime):
        module, aliases = graphs[mode]
        for k, p in module.states.items():
            p.data = state[k]
        outs = module(*asm.ordered_inputs(mode, runtime))
        inv = {p: k for k, p in module.states.items()}
        for p, i in aliases.items():
            state[inv[p]] = outs[i]
        return outs

    outs = launch("reset", {"pending": asm.i32(0)})
    assert all(not t.any() for t in state.values()) and len(outs) == 1 + len(state)
    for mode, rt in (("step", asm.step_inputs(cfg, PROMPT[0], 0, 0)),
                     ("round", asm.round_inputs(cfg, torch.float32, PROMPT[1], torch.randn(cfg.hidden_size), 1, 0,
                                                PROMPT[2]))):
        got = asm.read_outputs(*launch(mode, rt)[:3])
        want = eng.run(mode, rt)
        assert (got.draft, got.targets) == (want.draft, want.targets)
        assert torch.equal(got.hidden, want.hidden)
        for k in state:
            assert torch.equal(state[k], eng.states[0][k]), k
