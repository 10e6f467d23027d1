"""The NxDI adapter with rounds of K = 1..3 chained MTP drafts (issue 17), on CPU against the faithful fakes of
NxD/NxDI (tests/harness/nxd_fakes.py; the K = 1 flow and the fakes themselves: tests/harness/test_nxdi.py).

* Assembly: the round graph's inputs, outputs and state come from the K-plan (``megakernel.plan.input_specs`` /
  ``state_specs`` with K + 1 GDN checkpoint slots), the kernel arguments of a K-round, distinct routes, K checked.
* Conversion records K; a converted or compiled directory of another K is refused (one line; exit 2 in
  ``python -m harness.nxdi.run``), and so is a K outside 1..3.
* The convert / compile / load / reset / prefill / round / step flow for K = 2 and 3, xla backend (forced drafts
  over every accept length 0..K, the MTP's own drafts, the step graph): tokens = plain greedy, the decode-state
  invariant on the fake device state; through the CLI too; the megakernel backend under nkisim for K = 2, 3.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from decoding import alternating, forced_rounds, reference_decode_state, reference_greedy
from harness.nxdi import assembly as asm
from harness.nxdi import config as nxcfg
from harness.nxdi import convert as nxconv
from harness.speculative import Decoder, generate
from megakernel import plan as rp
from megakernel.plan import teacher_forced_launches
from megakernel.sharded import gather_state
from model.config import ConfigError
from model.params import random_params
from model.state import DecodeState
from model.weights import save_checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import nxd_fakes  # noqa: E402
from nxdi_support import PROMPT, fake_nxd, refused, tiny  # noqa: E402,F401  (fixtures)

MAX_LEN = 40


@pytest.fixture(scope="module")
def plain(tiny):
    cfg, params = tiny
    return reference_greedy(cfg, params, PROMPT, 16)


@pytest.fixture(scope="module")
def converted(tiny, tmp_path_factory):
    """Converted xla directories of the tiny model (float32, max_len 40), one per K."""
    cfg, params = tiny
    root = tmp_path_factory.mktemp("conv")
    return {K: nxconv.write_converted(root / f"k{K}", cfg, params, "xla", MAX_LEN, drafts=K)
            for K in (1, 2, 3)}


def _specs(cfg, specs, dtype):
    return {s.name: (tuple(s.shape), dtype if s.dtype == "activation" else getattr(torch, s.dtype)) for s in specs}


# --------------------------------------------------------------------------------------------------
# Assembly: everything shaped by K comes from the K-plan
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("K", [1, 2, 3])
def test_round_graph_inputs_state_and_kernel_arguments_follow_the_plan(tiny_cfg, K):
    cfg, dt = tiny_cfg, torch.bfloat16
    ex = asm.runtime_example(cfg, "round", dt, K)
    assert list(ex) == list(asm.graph_inputs("round"))
    assert {n: (tuple(t.shape), t.dtype) for n, t in ex.items()} == _specs(cfg, rp.input_specs(cfg, "round", K), dt)
    assert tuple(ex["force"].shape) == (K, 2) and tuple(ex["cos_v"].shape) == (K + 1, cfg.rotary_dim)
    assert {n: (tuple(t.shape), t.dtype) for n, t in asm.runtime_example(cfg, "step", dt, K).items()} == \
        _specs(cfg, rp.input_specs(cfg, "step"), dt)                           # the step is the same for every K
    specs = asm.state_specs(cfg, 4, 24, dt, K)
    assert specs == _specs(cfg, rp.state_specs(cfg, 4, 24, K + 1), dt)
    assert specs["gdn_window"][0][1] == specs["gdn_state"][0][1] == K + 1 == asm.state_slots(K)
    plan = asm.launch_plan(cfg, 4, 2, "round", K)
    assert (plan.drafts, plan.tokens) == (K, K + 1)
    # the kernel arguments of a K-round: the K-plan's run-time inputs (as round_inputs builds them) and the state
    w = asm.rank_weights(cfg, random_params(cfg, seed=0), "megakernel", 0, 4, 2)
    rt = rp.round_inputs(cfg, dt, 3, torch.zeros(cfg.hidden_size), 5, K, [7] * K, K)
    kw = asm.kernel_kwargs("round", w, asm.zero_states(specs), rt)
    assert tuple(kw["pos_d1"].shape) == (K, 1) and tuple(kw["gdn_state"].shape) == specs["gdn_state"][0]
    asm.check_routes({m: tuple(asm.runtime_example(cfg, m, dt, K).values()) for m in asm.GRAPHS})


def test_draft_counts_outside_the_range_arerefused(tiny_cfg, tmp_path):
    for bad in (0, 4, True, 1.0):
        with pytest.raises(asm.AssemblyError, match=r"draft tokens must be in 1\.\.3") as e:
            asm.state_specs(tiny_cfg, 4, 24, torch.float32, bad)
        assert "\n" not in str(e.value)
        with pytest.raises(asm.AssemblyError, match=r"1\.\.3"):
            asm.runtime_example(tiny_cfg, "round", torch.float32, bad)
    with pytest.raises(ConfigError, match=r"1\.\.3"):
        nxcfg.attribute_loader(tiny_cfg, "xla", 32, 2, {}, drafts=4)
    with pytest.raises(asm.AssemblyError, match=r"1\.\.3"):
        nxconv.write_converted(tmp_path / "c", tiny_cfg, random_params(tiny_cfg, seed=0), "xla", 32, drafts=0)
    assert not (tmp_path / "c" / nxconv.META_FILE).exists()


# --------------------------------------------------------------------------------------------------
# Conversion records K; other K refused
# --------------------------------------------------------------------------------------------------
def test_conversion_records_k_and_refuses_another(converted, tmp_path):
    for K, path in converted.items():
        meta = nxconv.check_converted(path, drafts=K)
        assert meta["num_draft_tokens"] == K and meta["format"] == nxconv.FORMAT
        other = 1 + K % 3
        with pytest.raises(nxconv.ConvertError, match=f"converted for num_draft_tokens={K} \\(asked {other}\\)") as e:
            nxconv.check_converted(path, drafts=other)
        assert "\n" not in str(e.value)
    # a compiled directory of another K is another conversion
    meta = nxconv.read_meta(converted[2])
    nxconv.link_rank_files(converted[2], tmp_path / "k", 4)
    good = {"neuron_config": {"tp_degree": 4, "torch_dtype": "float32"}, "nxdi_backend": "xla", "nxdi_lnc": 2,
            "nxdi_max_len": MAX_LEN, "nxdi_num_draft_tokens": 2, "nxdi_context_buckets": meta["context_buckets"],
            "nxdi_param_specs": meta["param_specs"]}
    (tmp_path / "k" / nxconv.COMPILED_CONFIG_FILE).write_text(json.dumps(good))
    nxconv.check_compiled(tmp_path / "k", meta, converted[2])
    (tmp_path / "k" / nxconv.COMPILED_CONFIG_FILE).write_text(json.dumps({**good, "nxdi_num_draft_tokens": 1}))
    with pytest.raises(nxconv.ConvertError, match="num_draft_tokens=1 vs 2"):
        nxconv.check_compiled(tmp_path / "k", meta, converted[2])


def test_run_cli_refuses_another_k(converted, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    c, k = str(converted[1]), str(tmp_path / "k")
    decode = ["decode", "--converted", c, "--compiled", k, "--prompt-ids", "5,17,99", "--max-new-tokens", "4"]
    for cmd in (["compile", "--converted", c, "--compiled", k], decode):
        refused(capsys, cmd + ["--num-draft-tokens", "2"], "num_draft_tokens=1 (asked 2)")
        refused(capsys, cmd + ["--num-draft-tokens", "4"], "--num-draft-tokens must be in 1..3, found 4")
    assert not Path(k).exists()     # nothing ran
    refused(capsys, ["convert", "--model-path", str(tmp_path / "nowhere"), "--out", str(tmp_path / "x"),
                      "--num-draft-tokens", "0"], "--num-draft-tokens must be in 1..3, found 0")
    refused(capsys, ["decode", "--executor", "cpu", "--model-path", str(tmp_path / "nowhere"), "--prompt-ids", "1",
                      "--num-draft-tokens", "5"], "found 5")
    # rounds of K drafts need K - 1 positions more than rounds of one (the last verify runs K past the last token)
    refused(capsys, ["decode", "--converted", str(converted[3]), "--compiled", k, "--prompt-ids", "5,17,99",
                      "--max-new-tokens", "35"], "needs 41 positions (prompt + new tokens + K)")


# --------------------------------------------------------------------------------------------------
# The flow against the fakes: K = 2, 3
# --------------------------------------------------------------------------------------------------
def _device_state(engine, cfg, read_slot: int) -> DecodeState:
    """The fake device's decode state (every rank's aliased buffers) in the reference layout."""
    ranks = [{n.removeprefix(asm.STATES_PREFIX): t for n, t in st.items()}
             for st in engine.app.traced_model.nxd_model.state]
    like = DecodeState.empty(cfg, engine.max_len, engine.drafts + 1, engine.dtype)
    return gather_state(cfg, ranks, like, read_slot)


@pytest.mark.parametrize("K", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_trn2_xla_flow_with_k_drafts_tokens_equal_plain_greedy(fake_nxd, tiny, plain, converted, tmp_path, K):
    cfg, params = tiny
    m = fake_nxd
    m.NeuronEngine.compile(converted[K], tmp_path / "k")
    eng = m.NeuronEngine.load(converted[K], tmp_path / "k")
    assert eng.drafts == K
    app = eng.app
    rnd = app.traced_model.nxd_model.models["round_model"]
    dt = torch.float32
    assert rnd.input_specs == list(_specs(cfg, rp.input_specs(cfg, "round", K), dt).values())
    assert [s for s, _ in rnd.output_specs[:3]] == [(K, 1), (K + 1, 1), (K + 1, cfg.hidden_size)]
    want_state = {asm.STATES_PREFIX + n: v for n, v in asm.state_specs(cfg, 4, MAX_LEN, dt, K).items()}
    for g in ("round_model", "step_model", "reset_state_model"):  # every graph shares the K + 1-slot state
        assert app.traced_model.nxd_model.models[g].state_specs == want_state, g
    assert [w.neuron_config.n_active_tokens for w in app.models] == [K + 1, 1, 1]
    state = app.traced_model.nxd_model.state
    assert not any(t.any() for st in state for t in st.values())       # reset after loading (warmup wrote)

    v = Decoder(eng)
    assert v.drafts == K and v.slots.slots == K + 1
    res = generate(v, PROMPT, 14, draft_source=alternating(PROMPT, plain, cfg.vocab_size, K))
    assert res.tokens == plain[:14] and res.drafts == K
    assert set(res.accepted_per_round) == set(range(1, K + 2))         # every accept length 0..K
    assert eng.launches == len(teacher_forced_launches(len(PROMPT), K)) + res.rounds
    assert generate(v, PROMPT, 10, spec=False).tokens == plain[:10]    # the step graph over the K + 1-slot state
    assert generate(v, PROMPT, 10).tokens == plain[:10]                # the MTP's own chained drafts

    # the decode-state invariant after forced accept patterns, read off the fake device state; the reset graph
    # (run by prefill) covers every buffer
    accepts = [K, 0, K - 1, 1, True]
    seq, pos = forced_rounds(v, PROMPT, plain, accepts, cfg.vocab_size)
    assert seq[len(PROMPT):] == plain[:len(seq) - len(PROMPT)]
    got = _device_state(eng, cfg, v.slots.read_slot).committed(pos)
    want = reference_decode_state(cfg, params, seq[:-1])
    for name in want:
        assert got[name].abs().max() > 0, name
        torch.testing.assert_close(got[name].float(), want[name].float(), rtol=0, atol=1e-4, msg=name)
    app.reset_state()
    assert not any(t.any() for st in state for t in st.values())


def test_trn2_cli_flow_with_k_drafts(fake_nxd, tiny, plain, converted, tmp_path, capsys):
    from harness.nxdi import run
    k, ids = str(tmp_path / "k"), ",".join(map(str, PROMPT))
    assert run.main(["compile", "--converted", str(converted[2]), "--compiled", k, "--num-draft-tokens", "2"]) == 0
    assert run.main(["decode", "--converted", str(converted[2]), "--compiled", k, "--prompt-ids", ids,
                     "--max-new-tokens", "8", "--json"]) == 0          # K: the converted one
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[:8] and out["num_draft_tokens"] == 2 and len(out["acceptance_per_position"]) == 2
    assert out["launches"] == len(teacher_forced_launches(len(PROMPT), 2)) + out["rounds"]
    # the compiled directory of the K = 2 conversion is not the K = 1 conversion's
    refused(capsys, ["decode", "--converted", str(converted[1]), "--compiled", k, "--prompt-ids", ids,
                      "--max-new-tokens", "4"], "compiled from another conversion")


def test_run_cli_cpu_executor_with_k_drafts(tiny, plain, tmp_path, capsys):
    from harness.nxdi import run
    cfg, params = tiny
    save_checkpoint(tmp_path / "hf", cfg, params)
    assert run.main(["decode", "--executor", "cpu", "--backend", "xla", "--model-path", str(tmp_path / "hf"),
                     "--dtype", "float32", "--prompt-ids", ",".join(map(str, PROMPT)), "--max-new-tokens", "8",
                     "--num-draft-tokens", "3", "--json", "--prefill", "teacher-forced"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["tokens"] == plain[:8] and out["num_draft_tokens"] == 3
    assert out["launches"] == len(teacher_forced_launches(len(PROMPT), 3)) + out["rounds"]
    assert run.main(["convert", "--model-path", str(tmp_path / "hf"), "--out", str(tmp_path / "conv"),
                     "--backend", "xla", "--max-len", "64", "--dtype", "float32", "--num-draft-tokens", "3"]) == 0
    assert nxconv.read_meta(tmp_path / "conv")["num_draft_tokens"] == 3


@pytest.mark.slow      # ~15 s; the default tier keeps the K = 1 megakernel flow (test_nxdi) and the K = 2 xla flow
@pytest.mark.parametrize("K", [2, 3])
def test_trn2_megakernel_flow_with_k_drafts_tokens_equal_plain_greedy(fake_nxd, tiny, tmp_path, K):
    """The megakernel graphs of a K-draft conversion under nkisim (each rank's kernel call one TP=4 x LNC=2
    launch): a round with K forced right drafts, one with a wrong first draft, prefill teacher-forced."""
    cfg, params = tiny
    prompt, n = PROMPT[:3], K + 3
    want = reference_greedy(cfg, params, prompt, n)
    conv = nxconv.write_converted(tmp_path / "mk", cfg, params, "megakernel", 16, drafts=K)
    fake_nxd.NeuronEngine.compile(conv, tmp_path / "k")
    v = Decoder(fake_nxd.NeuronEngine.load(conv, tmp_path / "k", warmup=False))
    res = generate(v, prompt, n, draft_source=alternating(prompt, want, cfg.vocab_size, K))
    assert res.tokens == want and res.accepted_per_round[:2] == [K + 1, 1]
    assert v.launches == len(teacher_forced_launches(len(prompt), K)) + res.rounds


def test_trn2_check_runs_k_token_accepts_on_the_device_path(fake_nxd, tiny, converted, tmp_path, capsys, monkeypatch):
    """``run check`` on a K = 2 conversion against the fakes: every round forces both drafts to the reference's
    tokens and commits K + 1 = 3 of them (the K-token accept of the round graph), and the check passes."""
    from harness.nxdi import run
    cfg, params = tiny
    save_checkpoint(tmp_path / "hf", cfg, params)
    k = str(tmp_path / "k")
    assert run.main(["compile", "--converted", str(converted[2]), "--compiled", k]) == 0
    commits = []
    real = Decoder.commit
    monkeypatch.setattr(Decoder, "commit", lambda self, n: commits.append(n) or real(self, n))
    assert run.main(["check", "--converted", str(converted[2]), "--compiled", k, "--model-path", str(tmp_path / "hf"),
                     "--prompt-ids", ",".join(map(str, PROMPT)), "--tokens", "8", "--json", "--skip-warmup"]
                    ) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["passed"] and out["num_draft_tokens"] == 2 and out["positions"] == 8
    assert commits == [3, 3]           # predictions 2..4 and 5..7 by K-token accepts, 8 by a step
