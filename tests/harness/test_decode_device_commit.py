"""decode.py --device-commit: the megakernel's device-committed rounds give the host-driven rounds' tokens on the
embedded checkpoint, greedy and sampled (--temperature); bad combinations are one line and exit 2 (checked before
any checkpoint is read)."""

from __future__ import annotations

import json

import pytest

from harness import decode


def run(capsys, *argv):
    code = decode.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _host_and_device(capsys, argv):
    """The decode CLI's JSON for argv, host-driven and with --device-commit."""
    runs = []
    for extra in ((), ("--device-commit",)):
        code, out, err = run(capsys, *argv, *extra)
        assert code == 0, err
        runs.append(json.loads(out))
    return runs


def test_device_commit_gives_the_host_driven_tokens(capsys):
    host, dev = _host_and_device(capsys, ["--variant", "megakernel", "--tp", 1, "--max-new-tokens", 5, "--json"])
    assert dev["device_commit"] is True and host["device_commit"] is False
    assert dev["tokens"] == host["tokens"] and len(dev["tokens"]) == 5 and len(set(dev["tokens"])) > 1
    assert dev["accepted_per_round"] == host["accepted_per_round"]
    assert dev["variants"]["megakernel"]["launches"] == dev["rounds"]     # one launch per round, host prefill


@pytest.mark.slow
def test_sampled_device_commit_gives_the_host_driven_tokens(capsys):
    """--temperature > 0: the device-committed rounds take their noise from the window, the same seed gives the
    host-driven sampled tokens (~12 s: slow tier; tests/megakernel/test_device_commit_sampled.py checks the rounds)."""
    host, dev = _host_and_device(capsys, ["--variant", "megakernel", "--tp", 1, "--max-new-tokens", 4, "--json",
                                          "--temperature", 0.7, "--seed", 1])
    assert dev["device_commit"] is True and dev["sampling"]["temperature"] == 0.7
    assert dev["tokens"] == host["tokens"] and len(dev["tokens"]) == 4
    assert dev["accepted_per_round"] == host["accepted_per_round"]


@pytest.mark.parametrize("argv,needle", [
    (["--variant", "xla"], "runs in the megakernel variant"),
    (["--no-spec"], "needs speculation"),
    (["--variant", "megakernel", "--no-spec", "--temperature", "0.7"], "needs speculation"),
    (["--variant", "megakernel", "--temperature", "0.7", "--top-k", "5"], "--temperature only"),
    (["--variant", "all", "--temperature", "0.7"], "one --variant at a time"),
])
def test_bad_combinations_exit_2_with_one_line(capsys, argv, needle):
    code, out, err = run(capsys, "--prompt-ids", "1,2", "--device-commit", *argv)
    lines = err.strip().splitlines()
    assert code == 2 and out == "" and len(lines) == 1 and needle in lines[0]


def test_help_explains_the_flag(capsys):
    with pytest.raises(SystemExit):
        decode.parse_args(["--help"])
    assert "--device-commit" in capsys.readouterr().out
