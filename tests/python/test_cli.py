"""Tests for the kvcache command line (models and plan; simulate is in test_simulate.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvcache.cli import main, make_plan
from kvcache.models import list_models, load_model
from kvcache.sizing import SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


def test_models_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:2] == ["name", "layers"]
    assert [line.split()[0] for line in lines[1:]] == list_models()
    gemma = next(line for line in lines if line.startswith("gemma-3-27b"))
    assert gemma.split()[1:6] == ["62", "16", "128", "bfloat16", "131,072"]
    assert "5 x 1024, full (repeating)" in gemma


def test_models_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list_models()
    mistral = next(r for r in rows if r["name"] == "mistral-7b-v0.1")
    assert mistral["max_attention_window"] == [4096]
    assert mistral["model"]["num_layers"] == 32


def test_make_plan_gemma3_27b_80gib_32k() -> None:
    plan = make_plan(load_model("gemma-3-27b"), 80 * 2**30, 32768)
    by_policy = {p.policy: p for p in plan["policies"]}
    assert list(by_policy) == ["equal", "proportional", "auto"]
    equal = by_policy["equal"]
    assert [(r.window, r.layers, r.bytes_per_token, r.blocks) for r in equal.rows] == [
        (1024, 52, 425984, 3150),
        (32768, 10, 81920, 16384),
    ]
    assert [r.blocks_per_sequence for r in equal.rows] == [33, 1024]
    assert [r.max_sequences for r in equal.rows] == [95, 16]
    assert (equal.max_sequences, equal.limiting_window) == (16, 32768)
    auto = by_policy["auto"]
    assert [(r.blocks, r.tokens) for r in auto.rows] == [(904, 28928), (28064, 898048)]
    assert (auto.max_sequences, auto.limiting_window) == (27, 1024)
    assert by_policy["proportional"].max_sequences == 26
    full = plan["full_attention"]
    assert [(r.window, r.layers, r.blocks) for r in full.rows] == [(32768, 62, 5285)]
    assert full.max_sequences == 5


def test_plan_table(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gemma-3-27b", "--memory", "80GiB", "--max-seq-len", "32768"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "gemma-3-27b: 62 layers, 16 KV heads x 128, bfloat16" in out
    assert "primary memory 80.0 GiB (85,899,345,920 B)" in out
    for heading in ("equal:", "proportional:", "auto:", "all layers full attention:"):
        assert heading in out.splitlines()
    assert "-> at most 27 concurrent sequences of 32,768 tokens (limited by window 1,024)" in out
    assert "-> at most 5 concurrent sequences of 32,768 tokens" in out
    summary = out[out.index("summary") :].splitlines()
    assert summary[1].split() == ["equal", "16", "vs", "all-full-attention:", "3.20x"]
    assert summary[3].split() == ["auto", "27", "vs", "all-full-attention:", "5.40x"]
    assert summary[4].split() == ["full", "attention", "5"]


def test_plan_json_and_custom_shares(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gemma-3-27b", "--memory", "80GiB", "--max-seq-len", "32768"]
    assert main([*argv, "--shares", "0.2,0.8", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [p["policy"] for p in data["policies"]] == ["equal", "proportional", "auto", "0.2,0.8"]
    custom = data["policies"][3]
    assert [w["blocks"] for w in custom["windows"]] == [1260, 26214]
    assert data["full_attention"]["max_sequences"] == 5


def test_plan_defaults_to_max_context(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "mistral-7b-v0.1", "--memory", "16GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["max_seq_len"] == 32768
    # one 4096-token sliding window for every layer: 128 KiB per token, 4 MiB per block
    eq = data["policies"][0]
    assert eq["windows"][0]["blocks"] == 4096
    assert eq["windows"][0]["blocks_per_sequence"] == 129
    assert eq["max_sequences"] == 31
    assert data["full_attention"]["max_sequences"] == 4


def test_plan_notes_lengths_beyond_context(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gemma-2-9b", "--memory", "8GiB", "--max-seq-len", "16384"]
    assert main(argv) == 0
    assert "note: 16,384 tokens exceed the model's context of 8,192" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["plan", "--model", "nope", "--memory", "1GiB"], 1, "unknown model 'nope'; known models:"),
        (["plan", "--model", "gemma-3-1b", "--memory", "80XB"], 1, "invalid size '80XB'"),
        (["plan", "--model", "gemma-3-1b", "--memory", "1KiB"], 1, "memory budget too small"),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--shares", "1,-1"],
            1,
            "window_size_shares: entry 1 is negative",
        ),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--shares", "1,1,1"],
            1,
            "gives 3 share(s) but the model has 2 window(s)",
        ),
        (["plan", "--memory", "1GiB"], 2, "the following arguments are required: --model"),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--max-seq-len", "0"],
            2,
            "expected a positive integer",
        ),
        (["frobnicate"], 2, "invalid choice: 'frobnicate'"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], status: int, message: str
) -> None:
    assert main(argv) == status
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("kvcache")
    assert "error: " in lines[0]
    assert message in lines[0]
    assert "Traceback" not in captured.err


def test_no_command_prints_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvcache" in capsys.readouterr().out


def test_help_returns_zero(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--help"]) == 0
    assert "--max-seq-len" in capsys.readouterr().out


def _console_script() -> list[str]:
    exe = shutil.which("kvcache")
    if exe is not None:
        return [exe]
    return [sys.executable, "-m", "kvcache.cli"]


def test_console_script_subprocess() -> None:
    env = dict(os.environ)
    env.pop(SHARES_ENV_VAR, None)
    env.pop(TRTLLM_SHARES_ENV_VAR, None)
    # Run against the package this test imported, wherever it lives.
    import kvcache

    package_root = str(Path(kvcache.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    ok = subprocess.run(
        [*_console_script(), "models"], capture_output=True, text=True, env=env, timeout=60
    )
    assert ok.returncode == 0, ok.stderr
    assert "gemma-3-27b" in ok.stdout
    bad = subprocess.run(
        [*_console_script(), "plan", "--model", "x", "--memory", "1GiB"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 1
    assert bad.stderr.count("\n") == 1
    assert bad.stderr.startswith("kvcache: error: unknown model 'x'")
