"""The NxDI context-encoding graphs (harness/nxdi/context.py) on CPU. Nothing here runs NxDI or the compiler.

* Plain: buckets (defaults, refusals), the schedule of a prompt (one chunk up to the largest bucket, else a padded
  first chunk then whole ones: every prompt position encoded exactly once), the run-time inputs, the padding
  rotation of the GDN layers, registration order, routes and aliasing.
* The xla backend's context function (``context.xla_context``) in process, one thread per rank: after a prefill of
  one padded chunk and of a padded chunk followed by whole ones, the first token, hidden and decode state (every
  GDN state and window, trunk and MTP K/V rows) equal the reference model's prefill (fp32, 1e-4 of the scale); it
  is traceable (fake and meta tensors).
* The megakernel backend's context function with every kernel replaced by a recorder (nothing executed): its
  custom calls are the sequence ``harness.prefill.predict`` costs (one ``embedding_prefill`` launch per chunk,
  ``moe_prefill`` with the all-reduce, residual and next norm fused, no separate stage after it).
* The trn2 module against the faithful fakes (tests/harness/nxd_fakes.py): the context graphs registered between
  step and reset with their own prefill configs, warmup runs them, and the compile / load / context prefill /
  round / step flow gives plain greedy's tokens for prompts of one padded chunk, one whole chunk and two chunks
  (xla backend; megakernel backend under nkisim, ``@pytest.mark.slow``: each rank's prefill kernel call is one
  TP=4 x LNC=2 nkisim launch, the fused residual all-reduces with their collectives included); through the CLI, with
  ``--prefill teacher-forced`` as the fallback; bad input is one line and exit 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from compare import assert_close
from decoding import ReferenceDecoder, alternating, reference_greedy
from harness.engines import make_engine
from harness.nxdi import assembly as asm
from harness.nxdi import context as ctx
from harness.nxdi import convert as nxconv
from harness.speculative import generate
from megakernel import plan as rp

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nxd_fakes  # noqa: E402
from nxdi_support import fake_nxd, refused, tiny  # noqa: E402,F401  (fixtures)

BUCKETS = (64, 128)
MAX_LEN = 224


def prompt_of(n: int, seed: int = 1) -> list[int]:
    return [int(i) for i in torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))]


# --------------------------------------------------------------------------------------------------
# Plain logic
# --------------------------------------------------------------------------------------------------
def test_default_and_checked_buckets():
    assert ctx.default_buckets(32) == ()
    assert ctx.default_buckets(300) == (64, 128, 256)
    assert ctx.default_buckets(1 << 20) == (64, 128, 256, 512, 1024, 2048, 4096)
    assert ctx.check_buckets([128, 64, 64], 200) == (64, 128)
    assert ctx.check_buckets([], 200) == ()
    assert ctx.parse_buckets("64, 512") == (64, 512) and ctx.parse_buckets("none") == ()
    for bad, match in (([100], "not a positive multiple of 64"), ([0], "multiple of 64"),
                       ([256], "exceeds the decode state's 200"), (["x"], "integers")):
        with pytest.raises(ctx.ContextError, match=match):
            ctx.check_buckets(bad, 200)
    with pytest.raises(ctx.ContextError, match="comma-separated"):
        ctx.parse_buckets("64;128")


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 127, 128, 129, 200, 255, 256, 257, 384])
def test_schedule_encodes_every_prompt_position_once(n):
    s = ctx.schedule(n, BUCKETS)
    covered = []
    for i, (start, b, v) in enumerate(s.chunks):
        assert b in BUCKETS and 1 <= v <= b and start == len(covered)
        if i == 0:
            assert b == min(c for c in BUCKETS if c >= v)        # the smallest bucket that holds it
        else:
            assert b == v == max(BUCKETS)                        # only the first chunk is padded
        covered += range(start, start + v)
    assert covered == list(range(n))
    assert len(s.chunks) == -(-n // max(BUCKETS)) and s.launches == len(s.chunks) and s.teacher_forced == ()
    for K in (1, 3):                                             # no buckets: teacher-forced, as before
        assert ctx.schedule(n, (), K).teacher_forced == rp.teacher_forced_launches(n, K)
    with pytest.raises(ctx.ContextError, match="empty"):
        ctx.schedule(0, BUCKETS)


def test_context_inputs(tiny_cfg):
    prompt = prompt_of(70)
    rt = ctx.context_inputs(tiny_cfg, prompt, 0, 64)
    assert list(rt) == list(ctx.INPUTS)
    assert rt["ids"].shape == (65, 1) and rt["ids"].dtype == np.int32 and rt["valid"].tolist() == [[64]]
    assert rt["ids"][:, 0].tolist() == prompt[:65]                    # the chunk and the token after it
    assert ctx.context_inputs(tiny_cfg, prompt[:64], 0, 64)["ids"][64, 0] == 0   # the chunk ends the prompt
    pad = ctx.context_inputs(tiny_cfg, prompt, 0, 128, 70)                # a padded first chunk
    assert pad["ids"][:, 0].tolist() == prompt + [0] * 59 and pad["valid"].tolist() == [[70]]
    cos, sin = rp.rope_rows(tiny_cfg, 6, 64)
    rt = ctx.context_inputs(tiny_cfg, prompt, 6, 64)
    assert rt["start"].tolist() == [[6]] and np.array_equal(rt["cos"], cos) and np.array_equal(rt["sin"], sin)
    for spec in ctx.input_specs(tiny_cfg, 64):
        assert rt[spec.name].shape == spec.shape and str(rt[spec.name].dtype) == spec.dtype
    with pytest.raises(ctx.ContextError, match="outside"):
        ctx.context_inputs(tiny_cfg, prompt, 10, 64)
    with pytest.raises(ctx.ContextError, match="must be the first one"):
        ctx.context_inputs(tiny_cfg, prompt, 6, 64, 30)
    with pytest.raises(ctx.ContextError, match="token ids"):
        ctx.context_inputs(tiny_cfg, [tiny_cfg.vocab_size] * 64, 0, 64)


def test_padding_rotation():
    t = torch.arange(1, 7, dtype=torch.float32).reshape(6, 1).expand(6, 2).contiguous()   # rows 1..6
    v = torch.tensor([[4]], dtype=torch.int32)
    first = ctx.pad_first(t, v, 0)
    assert first[:, 0].tolist() == [0, 0, 1, 2, 3, 4]          # padding first and zero, the real rows in order
    assert ctx.pad_last(first, v, 0)[:4, 0].tolist() == [1, 2, 3, 4]
    whole = torch.tensor([[6]], dtype=torch.int32)
    assert torch.equal(ctx.pad_first(t, whole, 0), t) and torch.equal(ctx.pad_last(t, whole, 0), t)
    xT = t.t().reshape(1, 2, 6)                                  # feature-major: tokens on the last dim
    assert ctx.pad_first(xT, v, 2)[0, 0].tolist() == [0, 0, 1, 2, 3, 4]


@pytest.mark.parametrize("K", [1, 3])
def test_graph_order_routes_inputs_and_aliases(tiny_cfg, K):
    order = asm.graph_order((128, 64))
    assert order == ("round", "step", "context_64", "context_128", "reset")   # the round first, the reset last
    assert asm.graph_order() == asm.GRAPHS
    examples = {m: tuple(asm.runtime_example(tiny_cfg, m, torch.bfloat16, K).values()) for m in order}
    asm.check_routes(examples)                       # NxD routes by shapes only: every graph's differ
    assert [tuple(t.shape) for t in examples["context_64"]] == [(65, 1), (1, 1), (1, 1), (64, tiny_cfg.rotary_dim),
                                                                 (64, tiny_cfg.rotary_dim)]
    assert asm.graph_inputs("context_64") == ctx.INPUTS
    assert asm.output_names("context_64") == asm.output_names("round")
    assert asm.state_aliases("context_128") == asm.state_aliases("round")
    assert asm.graph_states("context_64", asm.state_specs(tiny_cfg, 4, 128, torch.float32, K)) == list(rp.STATE)
    with pytest.raises(asm.AssemblyError, match="context_<bucket>"):
        asm.graph_inputs("context_x")


# --------------------------------------------------------------------------------------------------
# The xla backend's context function in process vs the reference prefill
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n, buckets, chunks", [(70, BUCKETS, [[0, 128, 70]]),
                                                (134, (64,), [[0, 64, 6], [6, 64, 64], [70, 64, 64]])])
def test_xla_context_prefill_equals_the_reference_prefill(tiny, n, buckets, chunks):
    """A padded chunk, and a padded chunk followed by whole ones: the state after prefill is the reference's."""
    cfg, params = tiny
    prompt = prompt_of(n)
    ref = ReferenceDecoder(cfg, params)
    first_ref, h_ref = ref.prefill(prompt, n + 4)
    v = ctx.context_decoder(ctx.XlaContextEngine(make_engine("xla", cfg, params, tp=4), buckets))
    first, hidden = v.prefill(prompt, n + 4)
    assert v.prefill_info["chunks"] == chunks
    assert first == first_ref
    assert_close(hidden, h_ref, rel=1e-4, name="hidden")
    got, want = v.committed(n), ref.committed(n)
    assert set(got) == set(want) and any(k.startswith("mtp_kv") for k in want)
    for k in want:
        assert_close(got[k], want[k], rel=1e-4, name=k)


def test_xla_context_has_no_host_values_and_keeps_the_device(tiny_cfg):
    """What the xla context graph traces: fake tensors raise on .item()/.tolist()/int()/bool() of a tensor (an XLA
    trace would bake the value in as a constant), meta tensors refuse tensors created on another device."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from model.params import random_params
    from model.tp.collectives import SINGLE_RANK
    cfg = tiny_cfg
    w = asm.rank_weights(cfg, random_params(cfg, seed=0), "xla", 0, 1, 2)
    st = asm.zero_states(asm.state_specs(cfg, 1, 160, torch.bfloat16))
    rt = {k: torch.as_tensor(v) for k, v in ctx.context_inputs(cfg, prompt_of(80), 0, 64, 50).items()}
    plan = ctx.context_plan(cfg, 64, 1, 2)
    with FakeTensorMode() as m:
        out = ctx.xla_context(cfg, plan, *({k: m.from_tensor(t) for k, t in d.items()} for d in (w, st, rt)),
                              SINGLE_RANK)
    assert [tuple(o.shape) for o in out[:3]] == [(1, 1), (1, 1), (1, cfg.hidden_size)]
    assert out[0].dtype == out[1].dtype == torch.int32
    assert [tuple(o.shape) for o in out[3:]] == [tuple(st[n].shape) for n in rp.STATE]
    assert [o.dtype for o in out[3:]] == [st[n].dtype for n in rp.STATE]
    meta = ctx.xla_context(cfg, plan, *({k: t.to("meta") for k, t in d.items()} for d in (w, st, rt)), SINGLE_RANK)
    assert meta[2].device.type == "meta"


# --------------------------------------------------------------------------------------------------
# The megakernel backend's kernel sequence (recorded, no kernel executed)
# --------------------------------------------------------------------------------------------------
class _Recorded:
    """A stand-in for one NKI kernel: ``kernel[lnc](*args)`` checks the arguments bind to the real kernel's
    signature, records (name, args, outputs) and returns ``outputs(*args)`` (right shapes, constant values)."""

    def __init__(self, real, outputs, calls, lnc):
        self.real, self.outputs, self.calls, self.lnc = real, outputs, calls, lnc

    def __getitem__(self, lnc):
        assert lnc == self.lnc
        return self

    def __call__(self, *args):
        import inspect
        inspect.signature(self.real.fn).bind(*args)
        out = self.outputs(*args)
        self.calls.append((self.real.fn.__name__, args, out))
        return out


def test_megakernel_context_runs_the_predicted_kernel_sequence(tiny_cfg, monkeypatch):
    """``megakernel_context``'s custom calls are the sequence ``harness.prefill.predict`` costs: ONE
    ``embedding_prefill`` launch for the chunk's C ids (and one for the MTP rows' ids), per layer the mixer --
    ``gdn_prefill`` then the residual all-reduce fused with the post-attention norm, or ``attention_prefill`` with
    that all-reduce, the residual add and the norm fused (its residual the previous layer's, its rows the MoE's
    input) and no separate stage after it -- then ``moe_prefill`` with the MoE all-reduce, the residual add and the
    next norm fused (its residual the mixer step's output, the next layer's input norm's xT its normed output, the
    final norm's rows after the last layer) and no separate stage after it; the MTP fc and K/V rows; the head
    stage. No host all-reduce. (The numbers: the slow megakernel flow test below.)"""
    from megakernel import layerwise, prefill
    from model.params import random_params
    from model.tp.collectives import Collectives
    from nki_kernels import attention_prefill, embedding_prefill, gdn_prefill, moe_prefill, rmsnorm_prefill
    from nki_kernels.common import P
    cfg, tp, lnc, C = tiny_cfg, 4, 2, 64
    H = cfg.hidden_size
    plan = ctx.context_plan(cfg, C, tp, lnc)
    w = asm.rank_weights(cfg, random_params(cfg, seed=0), "megakernel", 0, tp, lnc)
    st = asm.zero_states(asm.state_specs(cfg, tp, 128, torch.float32))
    rt = {k: torch.as_tensor(v) for k, v in ctx.context_inputs(cfg, prompt_of(80), 0, C, 50).items()}
    calls = []
    fills = iter(range(1, 10 ** 6))

    def z(*shape):                                   # a new value per output: identities below are meaningful
        return torch.full(shape, float(next(fills)))

    def normed(layout):                              # a fused RMSNorm's output, if any
        return {"xT": (z(P, H // P, C),), "rows": (z(C, H),), "none": ()}[layout]

    def fused(x, router, experts, shared, top_k, capacity=None, residual=None, tp_=1, norm_w=None, eps=1e-6,
              norm_out="none"):
        if residual is None:                         # the unfused form: the rank's partial y
            return z(C, H), torch.ones(lnc, 1)
        return (residual.clone(), *normed(norm_out), torch.ones(lnc, 1))

    def attention(*a):
        if len(a) < 15 or a[14] is None:             # the unfused form: per-core partials
            return z(lnc, C, H), z(lnc, 3), a[8], a[9]
        return (a[14].clone(), *normed(a[17]), z(lnc, 3), a[8], a[9])

    stubs = {
        (embedding_prefill, "embedding_prefill_kernel"): lambda table, ids: z(ids.shape[0], H),
        (rmsnorm_prefill, "rmsnorm_prefill_kernel"): lambda x, *a: (z(P, H // P, x.shape[0]),),
        (gdn_prefill, "gdn_prefill_kernel"): lambda *a: (z(lnc, C, H), a[8], a[7], torch.ones(1, 1)),
        (attention_prefill, "attention_prefill_kernel"): attention,
        (attention_prefill, "attention_prefill_kv_kernel"): lambda *a: (z(lnc, 1), a[6], a[7]),
        (prefill, "residual_allreduce_stage"): lambda x, part, tp_, per_core, norm_w=None, eps=1e-6, norm_out="none":
            (x.clone(), *normed(norm_out)),
        (moe_prefill, "moe_prefill"): fused,
        (prefill, "mtp_fc_prefill_stage"): lambda e, *a: z(lnc, e.shape[0], H // (tp * lnc)),
        (layerwise, "head_stage"): lambda x, *a: (z(lnc, 1, 2), z(1, H)),
    }
    for (module, name), outputs in stubs.items():
        monkeypatch.setattr(module, name, _Recorded(getattr(module, name), outputs, calls, lnc))

    def no_host_sum(t):
        raise AssertionError("the context graph sums on chip, never through coll.all_reduce")

    coll = Collectives(all_reduce=no_host_sum, gather_last=lambda t: torch.cat([t] * tp, dim=-1))
    out = ctx.megakernel_context(plan, w, st, rt, coll, lnc)
    assert [tuple(o.shape) for o in out[3:]] == [tuple(st[n].shape) for n in rp.STATE]

    want = ["embedding_prefill_kernel", "rmsnorm_prefill_kernel"]
    for layer in plan.layers:
        mixer = (["gdn_prefill_kernel", "residual_allreduce_stage"] if layer.kind == rp.GDN
                 else ["attention_prefill_kernel"] * layer.groups)
        want += mixer + ["moe_prefill"]
    want += ["embedding_prefill_kernel", "mtp_fc_prefill_stage", "rmsnorm_prefill_kernel"]
    want += ["attention_prefill_kv_kernel"] * plan.mtp.groups + ["head_stage"]
    names = [c[0] for c in calls]
    assert names == want
    n_gdn = sum(1 for layer in plan.layers if layer.kind == rp.GDN)
    assert 0 < n_gdn < len(plan.layers)
    assert len(names) == 2 + 2 * len(plan.layers) + n_gdn + 4 + 1     # harness.prefill.predict: a last chunk

    embeds = [c for c in calls if c[0] == "embedding_prefill_kernel"]
    assert torch.equal(embeds[0][1][1], rt["ids"][0:C]) and torch.equal(embeds[1][1][1], rt["ids"][1:C + 1])
    norms = w["norms"]
    for i, layer in enumerate(plan.layers):
        at = [k for k, c in enumerate(calls) if c[0] == "moe_prefill"][i]
        ar, moe, after = calls[at - 1], calls[at], calls[at + 1]
        before = calls[at - 2] if layer.kind == rp.GDN else ar          # the mixer's call
        if layer.kind == rp.GDN:
            assert ar[0] == "residual_allreduce_stage" and ar[1][2:4] == (tp, True) and ar[1][6] == "rows"
            assert torch.equal(ar[1][4], norms[layer.post_norm])
            assert torch.equal(ar[1][1], ctx.pad_last(before[2][0], rt["valid"], 1))   # the GDN's partials
            residual_in = ar[1][0]
        else:                                                     # all-reduce + residual + norm fused
            assert ar[0] == "attention_prefill_kernel" and len(ar[1]) == 18 and ar[1][15] == tp
            assert ar[1][17] == "rows" and torch.equal(ar[1][16], norms[layer.post_norm])
            residual_in = ar[1][14]
        if i == 0:                                                # the block's residual: the embedding, ...
            assert residual_in is embeds[0][2]
        else:                                                     # ... then the previous MoE's new residual
            assert residual_in is [c for c in calls if c[0] == "moe_prefill"][i - 1][2][0]
        args = moe[1]
        assert args[5] is None and args[6] is ar[2][0] and args[7] == tp     # the residual: the mixer step's output
        assert torch.equal(args[0], moe_prefill.token_rows(ar[2][1]))         # its input: that step's normed rows
        last = i == len(plan.layers) - 1
        assert args[10] == ("rows" if last else "xT")
        assert torch.equal(args[8], norms[plan.norms.final if last else plan.layers[i + 1].in_norm])
        if last:                                                  # the final norm's rows: the MTP fc's hidden
            assert after[0] == "embedding_prefill_kernel" and calls[at + 2][1][1] is moe[2][1]
        elif after[0] == "gdn_prefill_kernel":                    # the next layer's input norm: its mixer's xT,
            assert torch.equal(after[1][0], ctx.pad_first(moe[2][1], rt["valid"], 2))   # rotated for the GDN
        else:
            assert after[0] == "attention_prefill_kernel" and after[1][0] is moe[2][1]


# --------------------------------------------------------------------------------------------------
# The trn2 module against the fakes
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """A converted xla directory of the tiny model (float32, max_len 224, context buckets 64 and 128)."""
    cfg, params = tiny
    return nxconv.write_converted(tmp_path_factory.mktemp("conv") / "xla", cfg, params, "xla", MAX_LEN,
                                  buckets=BUCKETS)


def test_context_graphs_registered_compiled_and_warmed_up(fake_nxd, converted, tmp_path, monkeypatch):
    m = fake_nxd
    app = m.Qwen36ForCausalLM(str(converted), config=m.Qwen36InferenceConfig.from_converted(converted))
    tags = [w.tag for w in app.models]
    assert tags == ["round_model", "step_model", "context_encoding_model_64", "context_encoding_model_128",
                    "reset_state_model"]
    for w, b in zip(app.models[2:4], BUCKETS):
        nc = w.neuron_config
        assert nc.is_prefill_stage is True and nc.buckets == [b] and nc.n_active_tokens == b
        assert "-O1" in w.compiler_args and "--cc-pipeline-tiling-factor=2" in w.compiler_args
    assert all(w.neuron_config.is_prefill_stage is False for w in app.models if w not in app.models[2:4])
    m.NeuronEngine.compile(converted, tmp_path / "k")
    runs = []
    real = nxd_fakes.TracedGraph.run
    monkeypatch.setattr(nxd_fakes.TracedGraph, "run", lambda self, inputs: runs.append(self.key) or real(self, inputs))
    eng = m.NeuronEngine.load(converted, tmp_path / "k")
    assert runs == tags + ["reset_state_model"]      # warmup ran every graph in order, then the engine reset
    assert eng.buckets == BUCKETS
    graph = eng.app.traced_model.nxd_model.models["context_encoding_model_64"]
    assert set(graph.aliases) == {asm.STATES_PREFIX + n for n in rp.STATE}   # every state aliased, none a weight
    assert not any(k.startswith(asm.STATES_PREFIX) for k in graph.weight_specs)


@pytest.mark.parametrize("n, chunks", [(45, [[0, 64, 45]]),
                                       pytest.param(64, [[0, 64, 64]], marks=pytest.mark.slow),
                                       (200, [[0, 128, 72], [72, 128, 128]])])
def test_xla_flow_with_context_prefill_tokens_equal_plain_greedy(fake_nxd, tiny, converted, tmp_path, n, chunks):
    cfg, params = tiny
    prompt = prompt_of(n)
    plain = reference_greedy(cfg, params, prompt, 8)
    fake_nxd.NeuronEngine.compile(converted, tmp_path / "k")
    v = ctx.context_decoder(fake_nxd.NeuronEngine.load(converted, tmp_path / "k", warmup=False))
    res = generate(v, prompt, 8, draft_source=alternating(prompt, plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.prefill_info["chunks"] == chunks
    assert v.launches == len(chunks) + res.rounds
    assert generate(v, prompt, 8).tokens == plain                # the MTP's own drafts after the context prefill
    assert generate(v, prompt, 8, spec=False).tokens == plain    # the step graph after it


def test_cli_context_prefill_fallback_and_bad_input(fake_nxd, tiny, converted, tmp_path, capsys):
    from harness.nxdi import run
    cfg, params = tiny
    prompt = prompt_of(70)
    plain = reference_greedy(cfg, params, prompt, 6)
    k = str(tmp_path / "k")
    assert run.main(["compile", "--converted", str(converted), "--compiled", k]) == 0
    base = ["decode", "--converted", str(converted), "--compiled", k, "--prompt-ids", ",".join(map(str, prompt)),
            "--max-new-tokens", "6", "--json", "--skip-warmup"]
    assert run.main(base) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain and out["prefill"] == {"backend": "context", "chunks": [[0, 128, 70]],
                                                         "launches": 1}
    assert out["launches"] == 1 + out["rounds"]
    assert run.main(base + ["--prefill", "teacher-forced"]) == 0   # the fallback: the round graph only
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain and out["prefill"] == {"backend": "teacher-forced"}
    assert out["launches"] == len(rp.teacher_forced_launches(70)) + out["rounds"]
    refused(capsys, base[:5] + ["--prompt-ids", ",".join(["5"] * 220), "--max-new-tokens", "6"],
             "the sequence needs 227 positions")
    refused(capsys, ["convert", "--model-path", str(tmp_path), "--out", str(tmp_path / "c"), "--max-len", "256",
                      "--context-buckets", "64,100"], "context bucket 100 is not a positive multiple of 64")
    refused(capsys, ["convert", "--model-path", str(tmp_path), "--out", str(tmp_path / "c"), "--max-len", "100",
                      "--context-buckets", "128"], "exceeds the decode state's 100 positions")


def test_cpu_executor_context_prefill(tiny, tmp_path, capsys):
    """``decode --executor cpu`` (no fakes): the xla backend runs ``context.xla_context`` in process."""
    from harness.nxdi import run
    from model.weights import save_checkpoint
    cfg, params = tiny
    save_checkpoint(tmp_path / "hf", cfg, params)
    prompt = prompt_of(66)
    plain = reference_greedy(cfg, params, prompt, 4)
    assert run.main(["decode", "--executor", "cpu", "--model-path", str(tmp_path / "hf"), "--dtype", "float32",
                     "--prompt-ids", ",".join(map(str, prompt)), "--max-new-tokens", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain and out["prefill"]["chunks"] == [[0, 128, 66]]


@pytest.mark.slow  # ~2 minutes per case on 2 cores: every prefill kernel of every layer under nkisim, 4 ranks x 2 cores
@pytest.mark.parametrize("n, chunks", [(45, [[0, 64, 45]]), (100, [[0, 64, 36], [36, 64, 64]])])
def test_megakernel_flow_with_context_prefill_tokens_equal_plain_greedy(fake_nxd, tiny, tmp_path, n, chunks):
    """The megakernel backend's context graph under nkisim: embedding_prefill, RMSNorm, gdn_prefill /
    attention_prefill, residual_allreduce_stage (with its collectives), moe_prefill with the all-reduce, residual
    and next norm fused (its collectives too), the MTP fc and K/V rows, the head stage, each one joined TP=4 x
    LNC=2 launch; one padded chunk, and a padded chunk then a whole one; then rounds."""
    cfg, params = tiny
    prompt = prompt_of(n)
    plain = reference_greedy(cfg, params, prompt, 4)
    conv = nxconv.write_converted(tmp_path / "mk", cfg, params, "megakernel", max(n + 8, 64), buckets=(64,))
    fake_nxd.NeuronEngine.compile(conv, tmp_path / "k")
    v = ctx.context_decoder(fake_nxd.NeuronEngine.load(conv, tmp_path / "k", warmup=False))
    res = generate(v, prompt, 4, draft_source=alternating(prompt, plain, cfg.vocab_size))
    assert res.tokens == plain and 1 in res.accepted_per_round and 2 in res.accepted_per_round
    assert v.prefill_info["chunks"] == chunks
