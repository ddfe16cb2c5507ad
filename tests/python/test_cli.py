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
    # One 32k prompt prefilling in 8,192-token chunks holds ceil((1024 + 8191) / 32) + 1 = 289
    # blocks of window 1024, the others decode in 33: 1 + (3150 - 289) // 33 = 87 (decodes
    # alone would say 3150 // 33 = 95, but the 95th prompt's prefill would not fit).
    assert [r.peak_blocks for r in equal.rows] == [289, 1024]
    assert [r.limited_by for r in equal.rows] == ["chunk", "sequence"]
    assert [r.max_sequences for r in equal.rows] == [87, 16]
    assert (equal.max_sequences, equal.limiting_window) == (16, 32768)
    auto = by_policy["auto"]
    assert [(r.blocks, r.tokens) for r in auto.rows] == [(1123, 35936), (26924, 861568)]
    assert (auto.max_sequences, auto.limiting_window) == (26, 1024)
    assert by_policy["proportional"].max_sequences == 18
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
    assert "-> at most 26 concurrent sequences of 32,768 tokens (limited by window 1,024)" in out
    assert "-> at most 5 concurrent sequences of 32,768 tokens" in out
    summary = out[out.index("summary") :].splitlines()
    assert summary[1].split() == ["equal", "16", "vs", "all-full-attention:", "3.20x"]
    assert summary[3].split() == ["auto", "26", "vs", "all-full-attention:", "5.20x"]
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
    # 4,096 blocks: one prompt prefilling in 8,192-token chunks holds ceil((4096 + 8191) / 32)
    # + 1 = 385 of them, each other sequence 129: 1 + (4096 - 385) // 129 = 29.
    assert eq["windows"][0]["peak_blocks"] == 385
    assert eq["max_sequences"] == 29
    assert data["full_attention"]["max_sequences"] == 4


def test_plan_notes_lengths_beyond_context(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--model", "gemma-2-9b", "--memory", "8GiB", "--max-seq-len", "16384"]
    assert main(argv) == 0
    assert "note: 16,384 tokens exceed the model's context of 8,192" in capsys.readouterr().out


def test_plan_policy_that_fits_nothing_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    # 512-token chunks: window 1,024 needs ceil((1024 + 511) / 32) + 1 = 49 blocks for one
    # 131k prompt, so "auto" fits one sequence while "equal" leaves full attention short. (At
    # 8,192-token chunks it would need 289 blocks, 3.7 GiB, and no policy fits 12 GiB.)
    argv = [
        *("plan", "--model", "gemma-3-27b", "--memory", "12GiB", "--max-seq-len", "131072"),
        *("--max-num-batched-tokens", "512"),
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "-> fits no sequence of 131,072 tokens: window 131,072 has 2,457 blocks" in out
    assert "-> at most 0 concurrent" not in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["plan", "--model", "nope", "--memory", "1GiB"], "unknown model 'nope'; known models:"),
        (["plan", "--model", "gemma-3-1b", "--memory", "80XB"], "invalid size '80XB'"),
        (["plan", "--model", "gemma-3-1b", "--memory", "1KiB"], "cannot hold one sequence"),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--shares", "1,-1"],
            "entry 1 is negative",
        ),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--shares", "1,1,1"],
            "gives 3 share(s) but the model has 2 window(s)",
        ),
        (["plan", "--memory", "1GiB"], "the following arguments are required: --model"),
        (
            ["plan", "--model", "gemma-3-1b", "--memory", "1GiB", "--max-seq-len", "0"],
            "expected a positive integer",
        ),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert main(argv) == 2
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


def test_unexpected_failure_is_one_line_with_status_1(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvcache.cli.commands as cli

    def boom(args: object) -> int:
        raise TypeError("something broke\nsecond line")

    monkeypatch.setattr(cli, "_cmd_models", boom)
    assert main(["models"]) == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [
        "kvcache models: internal error: TypeError: something broke (please report it)"
    ]


# ------------------------------------------------------------------- the installed command
# Every test below runs the installed ``kvcache`` in a subprocess, as a user would.


def _console_script() -> list[str]:
    exe = shutil.which("kvcache")
    if exe is not None:
        return [exe]
    return [sys.executable, "-m", "kvcache.cli"]


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.pop(SHARES_ENV_VAR, None)
    env.pop(TRTLLM_SHARES_ENV_VAR, None)
    # Run against the package this test imported, wherever it lives.
    import kvcache

    package_root = str(Path(kvcache.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [extra.pop("PYTHONPATH", None), package_root, env.get("PYTHONPATH")])
    )
    env.update(extra)
    return env


def kvcache_run(
    *args: str, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs ``kvcache ARGS`` and returns the finished process (text output)."""
    return subprocess.run(
        [*_console_script(), *args],
        capture_output=True,
        text=True,
        env=env or _env(),
        cwd=cwd,
        timeout=120,
    )


def assert_usage_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Status 2, nothing on stdout, one line on stderr holding every fragment."""
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("kvcache") and "error: " in lines[0], lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert proc.stdout == ""
    return lines[0]


TINY = ["--model", "gemma-3-1b", "--memory", "512MiB", "--num-conversations", "2"]


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "t.jsonl"
    path.write_text('{"request_id": 1, "arrival": 0, "prompt": [1, 2, 3], "output": [4, 5]}\n')
    return path


def _trace_line(tmp_path: Path, **fields: object) -> Path:
    obj: dict[str, object] = {"request_id": 1, "arrival": 0, "prompt": [1, 2], "output": [3]}
    obj.update(fields)
    path = tmp_path / "bad.jsonl"
    good = '{"request_id": 0, "arrival": 0, "prompt": [1], "output": [2]}'
    path.write_text(good + "\n" + json.dumps(obj) + "\n")
    return path


def test_console_script_subprocess() -> None:
    ok = kvcache_run("models")
    assert ok.returncode == 0, ok.stderr
    assert "gemma-3-27b" in ok.stdout
    assert_usage_error(kvcache_run("plan", "--model", "x", "--memory", "1GiB"), "unknown model 'x'")


def test_version() -> None:
    import importlib.metadata

    import kvcache

    proc = kvcache_run("--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"kvcache {kvcache.__version__}\n"
    try:
        assert importlib.metadata.version("kvcache") == kvcache.__version__
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a checkout
        pass


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["--memory", "10000TiB"], ["'10000TiB' is 9.77 PiB, more than 1 PiB", "no single"]),
        (["--memory", "1e30"], ["'1e30' is 1e+30 bytes, more than 1 PiB"]),
        (["--host-cache", "2048TiB"], ["argument --host-cache", "more than 1 PiB"]),
        (["--memory", "1000TiB"], ["87,381,333 blocks", "70 bytes of bookkeeping per block"]),
        (["--memory", "lots"], ["invalid size 'lots'"]),
    ],
)
def test_simulate_sizes_are_bounded(trace: Path, args: list[str], fragments: list[str]) -> None:
    assert_usage_error(kvcache_run("simulate", "--trace", str(trace), *args), *fragments)


@pytest.mark.parametrize(
    ("memory", "fragments"),
    [
        ("1e30", ["more than 1 PiB", "no single device or host"]),
        ("1000TiB", ["memory budget too large", "block ids are 32-bit"]),
    ],
)
def test_plan_sizes_are_bounded(memory: str, fragments: list[str]) -> None:
    proc = kvcache_run("plan", "--model", "gemma-3-1b", "--memory", memory)
    assert_usage_error(proc, *fragments)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"request_id": 2**63}, ":2: 'request_id' must be in 0..2**63-1, got 9223372036854775808"),
        ({"request_id": -1}, ":2: 'request_id' must be in 0..2**63-1, got -1"),
        ({"prompt": [1, 2**31]}, ":2: 'prompt' holds 2147483648 at index 1; token ids are ints"),
        ({"output": [2**31]}, ":2: 'output' holds 2147483648 at index 0"),
        ({"lora_task_id": 2**63}, ":2: 'lora_task_id' must be a 64-bit signed int"),
        ({"arrival": 2**64}, ":2: 'arrival' must be an int in 0..2**63-1"),
    ],
)
def test_trace_values_out_of_range(
    tmp_path: Path, fields: dict[str, object], fragment: str
) -> None:
    path = _trace_line(tmp_path, **fields)
    assert_usage_error(kvcache_run("simulate", "--trace", str(path)), str(path) + fragment)


def test_share_env_var_in_plan() -> None:
    argv = ["plan", "--model", "gemma-3-27b", "--memory", "80GiB", "--max-seq-len", "32768"]
    proc = kvcache_run(*argv, env=_env(KVCACHE_WINDOW_SIZE_SHARES="0.2,0.8"))
    assert proc.returncode == 0, proc.stderr
    assert "0.2,0.8 (from KVCACHE_WINDOW_SIZE_SHARES):" in proc.stdout.splitlines()
    assert "all layers full attention:" in proc.stdout.splitlines()  # not given the variable
    summary = proc.stdout[proc.stdout.index("summary") :].splitlines()
    assert summary[4].split() == ["0.2,0.8", "25", "vs", "all-full-attention:", "5.00x"]
    proc = kvcache_run(*argv, "--json", env=_env(TRTLLM_WINDOW_SIZE_SHARES="auto"))
    data = json.loads(proc.stdout)
    assert [(p["policy"], p["source"]) for p in data["policies"]] == [
        ("equal", None),
        ("proportional", None),
        ("auto", "TRTLLM_WINDOW_SIZE_SHARES"),
    ]


@pytest.mark.parametrize(
    ("var", "value", "fragments"),
    [
        (SHARES_ENV_VAR, "garbage", ["environment variable KVCACHE_WINDOW_SIZE_SHARES", "garbage"]),
        (SHARES_ENV_VAR, "1,nan", ["KVCACHE_WINDOW_SIZE_SHARES: entry 1 is nan"]),
        (
            TRTLLM_SHARES_ENV_VAR,
            "1,2,3",
            ["TRTLLM_WINDOW_SIZE_SHARES gives 3 share(s)", "2 window"],
        ),
    ],
)
def test_bad_share_env_var(var: str, value: str, fragments: list[str]) -> None:
    env = _env(**{var: value})
    argv = ["--model", "gemma-3-27b", "--memory", "80GiB", "--max-seq-len", "32768"]
    assert_usage_error(kvcache_run("plan", *argv, env=env), *fragments)
    if value != "1,2,3":  # simulate checks the variable before it runs anything
        assert_usage_error(kvcache_run("simulate", *TINY, env=env), *fragments)


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (
            ["--max-seq-len", "99999999999999999999"],
            ["argument --max-seq-len", "is more than 2,147,483,647", "32-bit"],
        ),
        (
            ["--max-seq-len", "5000000"],
            # at its peak: 289 blocks of window 1,024 while 8,192-token chunks prefill
            ["80.0 GiB cannot hold one sequence of 5,000,000 tokens", "one needs 385 GiB"],
        ),
        (["--tokens-per-block", "2147483648"], ["argument --tokens-per-block", "32-bit"]),
    ],
)
def test_plan_lengths_are_bounded(args: list[str], fragments: list[str]) -> None:
    proc = kvcache_run("plan", "--model", "gemma-3-27b", "--memory", "80GiB", *args)
    assert_usage_error(proc, *fragments)


def test_simulate_that_rejects_everything_fails_like_plan(trace: Path) -> None:
    proc = kvcache_run("simulate", *TINY[:2], "--memory", "2MiB", "--num-conversations", "2")
    assert_usage_error(proc, "all 4 requests were rejected: none can ever fit in 2.00 MiB")
    assert_usage_error(
        kvcache_run("simulate", "--memory", "1MiB", "--num-conversations", "2"),
        "memory budget too small",
    )
    proc = kvcache_run("simulate", "--trace", str(trace), "--max-seq-len", "2")
    assert_usage_error(proc, "every one is longer than max_seq_len 2")


def test_model_file_errors(tmp_path: Path) -> None:
    proc = kvcache_run("plan", "--model", "nope.json", "--memory", "1GiB", cwd=tmp_path)
    assert_usage_error(proc, "model file 'nope.json' does not exist")
    assert "unknown model" not in proc.stderr
    (tmp_path / "m.json").write_text('{"name": "m", "model": {"num_layers": 2}}')
    proc = kvcache_run("plan", "--model", "m.json", "--memory", "1GiB", cwd=tmp_path)
    assert_usage_error(proc, "m.json: missing keys 'max_context'; a preset needs 'name'")
    (tmp_path / "m.json").write_text('{"name": "m", "model": {"num_layers": 2}, "max_context": 8}')
    proc = kvcache_run("plan", "--model", "m.json", "--memory", "1GiB", cwd=tmp_path)
    assert_usage_error(proc, "m.json: 'model' is missing 'num_kv_heads', 'head_dim'")


def test_output_paths_are_checked_before_the_run(tmp_path: Path) -> None:
    # The default workload takes seconds; a checked path fails at once, writing nothing.
    proc = kvcache_run("simulate", "--json", str(tmp_path / "no" / "r.json"))
    assert_usage_error(proc, "--json", "directory", "does not exist")
    assert_usage_error(kvcache_run("simulate", "--json", str(tmp_path)), "is a directory")
    proc = kvcache_run("simulate", "--plot", str(tmp_path / "r.xyz"))
    assert_usage_error(proc, "matplotlib does not write .xyz files")
    same = str(tmp_path / "r.out")
    assert_usage_error(kvcache_run("simulate", "--json", same, "--plot", same), "the same file")
    assert list(tmp_path.iterdir()) == []


def test_plot_without_matplotlib(tmp_path: Path) -> None:
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('no matplotlib')\n")
    out = tmp_path / "r.png"
    proc = kvcache_run("simulate", "--plot", str(out), env=_env(PYTHONPATH=str(fake)))
    assert_usage_error(proc, "--plot needs matplotlib", "kvcache[plot]")
    assert not out.exists()


def test_outputs_report_where_they_went(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    proc = kvcache_run("simulate", *TINY, "--json", str(out_json), "--plot", str(out_png))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-2:] == [
        f"wrote the JSON report to {out_json}",
        f"wrote the plot to {out_png}",
    ]
    single = json.loads(out_json.read_text())
    proc = kvcache_run("simulate", *TINY, "--compare-shares", "--json", str(out_json))
    assert proc.returncode == 0, proc.stderr
    compared = json.loads(out_json.read_text())
    # Always the same top-level shape: one run or several.
    assert set(single) == set(compared) == {"version", "workload", "runs"}
    assert len(single["runs"]) == 1 and len(compared["runs"]) == 3
    assert single["workload"] == compared["workload"]
    assert single["workload"]["source"] == "built-in"
    assert single["workload"]["conversations"] == 2
    assert single["workload"]["requests"] == single["runs"][0]["requests"]
    assert [r["shares"][:4] for r in compared["runs"]] == ["equa", "prop", "auto"]


def test_num_requests_is_named_for_what_it_counts(trace: Path) -> None:
    proc = kvcache_run("simulate", *TINY)
    assert proc.returncode == 0, proc.stderr
    workload = proc.stdout.splitlines()[1]
    assert workload.startswith("  workload: built-in multi-turn chat, 2 conversations (seed 0): ")
    requests = int(workload.split(": ")[2].split()[0])
    assert f"  requests            {requests:,} ({requests:,} completed)" in proc.stdout
    assert_usage_error(
        kvcache_run("simulate", "--num-requests", "200"),
        "--num-requests is now --num-conversations",
    )
    assert_usage_error(
        kvcache_run("simulate", "--num-conversations", "0"), "expected a positive integer"
    )
    assert_usage_error(
        kvcache_run("simulate", "--num-conversations", "10001"), "generated in memory"
    )


def test_workload_options_with_a_trace(trace: Path) -> None:
    proc = kvcache_run("simulate", "--trace", str(trace), "--num-conversations", "5")
    assert_usage_error(proc, "--num-conversations sizes the built-in workload", "--trace")
    proc = kvcache_run("simulate", "--trace", str(trace), "--seed", "3")
    assert_usage_error(proc, "--seed seeds the built-in workload", "would change nothing")
    ok = kvcache_run("simulate", "--trace", str(trace), "--seed", "3", "--draft-tokens", "2")
    assert ok.returncode == 0, ok.stderr  # with drafts the seed matters
    assert f"  workload: trace {trace}, 1 request" in ok.stdout


def test_auto_shares_are_explained() -> None:
    proc = kvcache_run("simulate", *TINY, "--shares", "auto")
    assert proc.returncode == 0, proc.stderr
    heading = proc.stdout.splitlines()[0]
    length = int(heading.split("auto(L=")[1].split(")")[0])
    assert (
        f"  auto(L={length}): shares sized so that every window runs out at the same "
        "concurrency" in proc.stdout
    )
    assert f"for sequences of L = {length:,} tokens" in proc.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (["--draft-tokens", "1000"], "argument --draft-tokens: '1000' is more than 256"),
        (["--max-batch-size", "0"], "argument --max-batch-size: expected a positive integer"),
        (["--seed", "-1"], "argument --seed: expected an integer >= 0"),
        (["--shares", "1,x"], "argument --shares: expected one of 'equal'"),
        (["--model", "nope"], "unknown model 'nope'"),
        (
            ["--max-num-batched-tokens", "0"],
            "argument --max-num-batched-tokens: expected a positive integer",
        ),
        (["--max-chunk-size", "x"], "argument --max-chunk-size: expected an integer"),
        (
            ["--max-chunk-size", "64", "--no-chunked-prefill"],
            "--max-chunk-size limits prefill chunks; it cannot be used with --no-chunked-prefill",
        ),
        (
            ["--max-num-batched-tokens", "3", "--draft-tokens", "3"],
            "--max-num-batched-tokens 3 must exceed --draft-tokens 3",
        ),
    ],
)
def test_simulate_bad_values(args: list[str], fragment: str) -> None:
    assert_usage_error(kvcache_run("simulate", *args), fragment)


def test_progress_bar_counts_steps_like_the_report() -> None:
    import pty

    main_fd, child_fd = pty.openpty()  # the bar is drawn only when stderr is a terminal
    try:
        proc = subprocess.run(
            [*_console_script(), "simulate", *TINY],
            stdout=subprocess.PIPE,
            stderr=child_fd,
            text=True,
            env=_env(),
            timeout=120,
        )
    finally:
        os.close(child_fd)
    chunks = []
    while True:
        try:
            chunk = os.read(main_fd, 65536)
        except OSError:  # EIO: nothing left
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(main_fd)
    assert proc.returncode == 0
    bar = b"".join(chunks).decode().replace("\r\n", "\n").split("\r")[-1]
    steps = next(line.split()[2] for line in proc.stdout.splitlines() if "engine steps" in line)
    assert "100% " in bar and f" {steps} engine steps, running 0" in bar, bar


# --------------------------------------------------------------------------------------
# A newcomer's first hour: each mistake is one line naming the fix, status 2 (subprocess)
# --------------------------------------------------------------------------------------

GEMMA = ["--model", "gemma-3-27b"]


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        # a forgotten unit
        (["--memory", "80"], ["'80' has no unit, so it means 80 bytes", "e.g. 80GiB"]),
        # PiB is a unit (the limit message speaks of it), 2 PiB is over the limit
        (["--memory", "2PiB"], ["'2PiB' is 2.00 PiB, more than 1 PiB"]),
        (["--memory", "2PB"], ["'2PB' is 1.78 PiB, more than 1 PiB"]),
        # a negative size reaches the size check instead of "expected one argument"
        (["--memory", "-5GiB"], ["invalid size '-5GiB': must be positive"]),
        # the block size, not the memory, is the problem
        (
            ["--memory", "80GiB", "--tokens-per-block", "100000"],
            [
                "the block size is the problem",
                "with 32 (the default) one needs only 13.7 GiB",
                "give a smaller --tokens-per-block",
            ],
        ),
        # an unknown option is named (with the closest one), as simulate does, before the
        # missing required option
        (["--memry", "80GiB"], ["unrecognized arguments: --memry 80GiB (did you mean --memory?)"]),
        # one dtype that is not one: the KEY=DTYPE form is named
        (
            ["--memory", "80GiB", "--kv-cache-dtype", "full:fp8"],
            ["got 'full:fp8'", "KEY=DTYPE pairs, e.g. full=fp8,sliding=bfloat16"],
        ),
    ],
)
def test_plan_newcomer_mistakes_are_one_line(args: list[str], fragments: list[str]) -> None:
    assert_usage_error(kvcache_run("plan", *GEMMA, *args), *fragments)


def test_simulate_names_a_typo_like_plan() -> None:
    line = assert_usage_error(kvcache_run("simulate", "--memry", "80GiB"))
    assert line == (
        "kvcache simulate: error: unrecognized arguments: --memry 80GiB (did you mean --memory?)"
    )
    line = assert_usage_error(kvcache_run("plan", "--memory", "1GiB"))
    assert line == "kvcache plan: error: the following arguments are required: --model"


def test_a_decimal_size_is_taken_with_a_note() -> None:
    proc = kvcache_run("plan", *GEMMA, "--memory", "80GB", "--max-seq-len", "32768", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["memory_bytes"] == 80 * 10**9
    assert proc.stderr == (
        "kvcache plan: note: '80GB' is decimal: 80,000,000,000 bytes = 74.5 GiB "
        "(80GiB would be 85,899,345,920 bytes)\n"
    )
    proc = kvcache_run("plan", *GEMMA, "--memory", "80GiB", "--max-seq-len", "32768")
    assert proc.returncode == 0 and proc.stderr == ""


def test_plan_of_a_single_window_model_prints_one_table() -> None:
    proc = kvcache_run("plan", "--model", "llama-3.1-8b", "--memory", "80GiB")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("   window layers") == 1
    assert (
        "equal, proportional, auto, all layers full attention (one window: the whole budget):"
        in out
    )
    assert "-> at most 5 concurrent sequences of 131,072 tokens" in out
    # one window at this length, but the baseline (all full attention) differs: two tables
    proc = kvcache_run("plan", "--model", "mistral-7b-v0.1", "--memory", "80GiB")
    assert proc.stdout.count("   window layers") == 2
    assert "equal, proportional, auto (one window: the whole budget):" in proc.stdout
    # two windows: one table per policy and the baseline, as before
    proc = kvcache_run("plan", *GEMMA, "--memory", "80GiB", "--max-seq-len", "32768")
    assert proc.stdout.count("   window layers") == 4


def test_simulate_memory_zero_prints_sizes_not_raw_bytes() -> None:
    line = assert_usage_error(kvcache_run("simulate", "--memory", "0", "--num-conversations", "2"))
    assert "window 1024 gets 0 B (share 0.5000 of 0 B) but one block needs 10.0 MiB" in line
    assert "a primary budget of at least 20.0 MiB (20,971,520 bytes) is needed" in line
    assert "10485760" not in line


def test_simulate_short_max_seq_len_says_what_it_dropped() -> None:
    proc = kvcache_run("simulate", "--max-seq-len", "512", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [
        "kvcache simulate: warning: --max-seq-len 512 ends conversations early: the built-in "
        "workload has 4 requests instead of 1,003 at the default 8,192 (a conversation ends at "
        "its first turn over the limit)",
        "kvcache simulate: warning: --max-seq-len 512 is not longer than the sliding window "
        "1,024 of gemma-3-12b: those layers run as full attention, so the run has 1 window "
        "instead of 2",
    ]
    assert "4 requests, one per turn" in proc.stdout
    # the default length and a trace change nothing: no warning
    proc = kvcache_run("simulate", *TINY, "--no-progress")
    assert proc.returncode == 0 and proc.stderr == ""


def test_compare_shares_shows_the_hit_rate_and_defines_latency() -> None:
    proc = kvcache_run("simulate", "--compare-shares", "--num-conversations", "20", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    rows = {line[:24].strip(): line[24:].split() for line in proc.stdout.splitlines()}
    assert rows["shares"] == ["equal", "proportional", "auto(L=2359)"]
    rates = rows["prefix hit rate"]
    assert len(rates) == 3 and all(r.endswith("%") and 0 < float(r[:-1]) <= 100 for r in rates)
    assert "mean latency (steps)" in rows
    assert (
        "  latency: engine steps from a request's arrival to its last token (completed requests)"
        in proc.stdout
    )
    # the single report defines it too
    proc = kvcache_run("simulate", *TINY, "--no-progress")
    assert "(engine steps from arrival to the last token, completed requests)" in proc.stdout


def test_percentages_have_one_style() -> None:
    """Every percentage the commands print is written ``36.9%``, never ``36.9 %``."""
    import re

    out = kvcache_run("simulate", *TINY, "--no-progress").stdout
    out += kvcache_run("plan", *GEMMA, "--memory", "80GiB").stdout
    assert re.search(r"\d %", out) is None
    assert re.search(r"\d%", out) is not None


_NO_TORCH = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}")
sys.meta_path.insert(0, _Block())
from kvcache.cli import main
sys.exit(main(["generate"]))
"""


def test_generate_without_torch_names_both_install_commands() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _NO_TORCH], capture_output=True, text=True, timeout=60
    )
    line = assert_usage_error(proc)
    assert line.startswith(
        "kvcache generate: error: kvcache generate needs torch and transformers: pip install "
        "'kvcache[torch]' (in a source checkout: pip install '.[torch]')"
    ), line
