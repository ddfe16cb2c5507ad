"""`kvcache generate`: the command line of kvcache.engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvcache.cli import main

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SMALL = ["--num-prompts", "4", "--max-new-tokens", "4", "--system-prompt-len", "32"]
SMALL += ["--prompt-len", "4", "--tokens-per-block", "8", "--sliding-window", "16"]


def test_generate_reports_speed_reuse_and_occupancy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "gen.json"
    # One request at a time: each later request finds the system prompt cached.
    rc = main(["generate", "--model", "gpt-oss", *SMALL, "--max-batch-size", "1",
               "--json", str(out_json)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "model gpt-oss (tiny, random weights): 4 layers, windows [16, 'full', 16, 'full']" in (
        text
    )
    assert "4 requests" in text and "16 generated" in text and "generated tok/s" in text
    report = json.loads(out_json.read_text())
    assert report["requests"] == 4 and report["generated_tokens"] == 16
    assert report["reused_tokens"] >= 3 * 32  # the system prompt, for requests 2..4
    assert f"reuse: {report['reused_tokens']} of {report['prompt_tokens']} prompt tokens" in text
    assert set(report["peak_used_blocks"]) == {"16", str(max(int(w) for w in report["num_blocks"]))}
    assert "peak occupancy (used / primary blocks): window 16: " in text


def test_generate_runs_a_local_model_directory_and_a_prompt_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvcache.engine import tiny_model

    tiny_model("mistral", sliding_window=16).save_pretrained(tmp_path / "model")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("[1, 2, 3]\n\n[4, 5, 6, 7, 8]\n")
    rc = main(["generate", "--model", str(tmp_path / "model"), "--prompts", str(prompts),
               "--max-new-tokens", "3", "--tokens-per-block", "4"])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "windows [16, 16, 16]" in text and "2 requests, 8 prompt tokens, 6 generated" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--model", "nope"], "neither a family"),
        (["--prompts", "PROMPTS"], "PROMPTS:2: expected a non-empty list of token ids"),
        (["--system-prompt-len", "-1"], "--system-prompt-len must be >= 0"),
        (["--max-new-tokens", "0"], "expected a positive integer"),
    ],
)
def test_generate_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2]\n[]\n")
    args = [str(prompts) if a == "PROMPTS" else a for a in args]
    message = message.replace("PROMPTS", str(prompts))
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def _generate(*args: str) -> subprocess.CompletedProcess[str]:
    """``kvcache generate ARGS`` in a fresh interpreter, as a newcomer runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "generate", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def _one_line_status_2(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    return lines[0]


def test_generate_on_a_device_torch_cannot_use_is_a_usage_error() -> None:
    if torch.version.cuda is None:
        expected = (
            f"kvcache generate: error: --device cuda: this torch ({torch.__version__}) is built "
            "without CUDA; use --device cpu, or install a CUDA build of torch"
        )
        assert _one_line_status_2(_generate("--device", "cuda")) == expected
    elif not torch.cuda.is_available():
        line = _one_line_status_2(_generate("--device", "cuda"))
        assert line.endswith("--device cuda: no CUDA device is visible; use --device cpu")
    else:
        line = _one_line_status_2(_generate("--device", "cuda:99"))
        assert "--device cuda:99: only" in line and "CUDA device(s) are visible" in line
    line = _one_line_status_2(_generate("--device", "mps"))
    assert line.endswith("--device 'mps': the engine serves CPU or CUDA models; use cpu or cuda")


def test_generate_too_many_new_tokens_fails_before_the_model_is_built() -> None:
    start = time.monotonic()
    line = _one_line_status_2(_generate("--max-new-tokens", "100000"))
    assert line == (
        "kvcache generate: error: --max-new-tokens 100,000 after prompts of up to 96 tokens "
        "exceeds the model's context of 1,024 positions; give --max-new-tokens 929 or less"
    )
    assert time.monotonic() - start < 60


def test_generate_a_request_that_never_fits_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["--num-prompts", "2", "--max-new-tokens", "500", "--memory", "100KiB"]
    assert main(["generate", *args]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "new can never fit the KV pools" in err[0], err
    assert "give more memory or fewer new tokens" in err[0]


def test_generate_percentages_have_the_report_style(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["generate", "--model", "mistral", *SMALL]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\d %", out) is None
    assert re.search(r"block hit rate \d+\.\d%", out) is not None
