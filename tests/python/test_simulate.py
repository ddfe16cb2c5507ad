"""Tests for kvcache.simulate and ``kvcache simulate``."""

from __future__ import annotations

import json
import random
from fractions import Fraction
from pathlib import Path

import pytest

from kvcache.cli import main
from kvcache.simulate import (
    TraceRequest,
    default_workload,
    format_comparison,
    format_report,
    read_trace,
    simulate,
    write_trace,
)
from kvcache.sizing import SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR

SMALL = ["--model", "gemma-3-1b", "--memory", "512MiB", "--num-conversations", "12"]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


# ----------------------------------------------------------------------------- workloads


def test_default_workload_is_seeded_and_shaped() -> None:
    a = default_workload(seed=5, num_conversations=30)
    assert a == default_workload(seed=5, num_conversations=30)
    assert a != default_workload(seed=6, num_conversations=30)
    assert [r.request_id for r in a] == list(range(len(a)))
    assert [r.arrival for r in a] == sorted(r.arrival for r in a)
    assert len(a) > 30  # multi-turn
    for r in a:
        assert len(r.prompt) + len(r.output) - 1 <= 8192
        assert 16 <= len(r.output) <= 1500
        assert all(0 <= t < 32000 for t in r.prompt)
    # shared system prompts: many requests start with the same 200 tokens
    heads = {r.prompt[:200] for r in a}
    assert len(heads) <= 6
    # a follow-up turn repeats its conversation's history token for token
    follow = [
        (x, y)
        for x in a
        for y in a
        if y.arrival > x.arrival
        and y.prompt[: len(x.prompt) + len(x.output)] == x.prompt + x.output
    ]
    assert follow


def test_default_workload_respects_max_seq_len() -> None:
    w = default_workload(seed=2, num_conversations=40, max_seq_len=1500)
    assert all(len(r.prompt) + len(r.output) - 1 <= 1500 for r in w)


def test_trace_round_trip(tmp_path: Path) -> None:
    reqs = [
        TraceRequest(5, 0, (1, 2, 3), (4,)),
        TraceRequest(6, 3, (1, 2), (7, 8), lora_task_id=2, cache_salt="s", priority=80),
    ]
    path = tmp_path / "t.jsonl"
    write_trace(reqs, path)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {
        "request_id": 5,
        "arrival": 0,
        "prompt": [1, 2, 3],
        "output": [4],
    }
    assert json.loads(lines[1])["cache_salt"] == "s"
    path.write_text(path.read_text() + "\n\n")  # blank lines are skipped
    assert read_trace(path) == reqs


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("{", ":1: not valid JSON"),
        ("[1]", ":1: expected a JSON object"),
        ('{"request_id": 1, "arrival": 0, "prompt": [1]}', ":1: missing 'output'"),
        ('{"request_id": "1", "arrival": 0, "prompt": [1], "output": [1]}', "'request_id' must"),
        ('{"request_id": 1, "arrival": -1, "prompt": [1], "output": [1]}', "'arrival' must"),
        ('{"request_id": 1, "arrival": 0, "prompt": [], "output": [1]}', "'prompt' must be a non"),
        ('{"request_id": 1, "arrival": 0, "prompt": [1, -2], "output": [1]}', "holds -2"),
        ('{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1.5]}', "holds 1.5"),
        ('{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1], "x": 1}', "unknown key"),
        (
            '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1], "priority": 101}',
            "'priority' must be an int in 0..100",
        ),
        (
            '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1], "cache_salt": [1]}',
            "'cache_salt' must be",
        ),
        (
            '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1]}\n'
            '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1]}',
            ":2: request_id 1 already used on line 1",
        ),
        ("\n\n", "holds no requests"),
    ],
)
def test_trace_errors(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(ValueError) as info:
        read_trace(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_trace_unreadable(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read trace"):
        read_trace(tmp_path / "missing.jsonl")
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ValueError, match="not a UTF-8 text file"):
        read_trace(binary)


# ----------------------------------------------------------------------------- simulate


def test_simulate_small_run_is_complete_and_deterministic() -> None:
    trace = default_workload(seed=1, num_conversations=10)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": 512 * 2**20, "check_invariants": True}
    a = simulate(trace, **kwargs)  # type: ignore[arg-type]
    b = simulate(trace, **kwargs)  # type: ignore[arg-type]
    assert a.completed == len(trace)
    assert a.rejected == 0
    assert a.generated_tokens == sum(len(t.output) for t in trace)
    assert a.context_tokens >= sum(len(t.prompt) for t in trace)
    assert [w.window for w in a.windows] == [512, a.max_seq_len]
    assert a.windows[0].layers == 22 and a.windows[1].layers == 4
    assert a.shares == "equal"
    assert a.cache_hit_rate is None or 0.0 <= a.cache_hit_rate <= 1.0
    for w in a.windows:
        assert 0 < w.peak_used_blocks <= w.blocks
    timing = {"wall_seconds", "manager_us_per_step", "manager_us_p99", "scheduler_us_per_step"}
    da, db = a.to_dict(), b.to_dict()
    for key in timing:
        da.pop(key)
        db.pop(key)
    assert da == db
    assert set(a.series) == {"step", "running", "waiting", "used_512", f"used_{a.max_seq_len}"}
    assert len(a.series["step"]) == a.steps


def test_default_workload_later_turns_extend_earlier_ones() -> None:
    trace = default_workload(seed=2, num_conversations=12)
    prompts = {t.prompt for t in trace}
    extended = 0
    for t in trace:
        full = t.prompt + t.output
        # a later turn's prompt = this turn's prompt + its answer + new user text
        extended += any(len(p) > len(full) and p[: len(full)] == full for p in prompts)
    assert extended >= 5
    systems = {t.prompt[:200] for t in trace}  # system prompts are >= 200 tokens
    assert len(systems) < len({t.prompt for t in trace if len(t.prompt) > 200}) // 2


def test_simulate_reports_reuse_per_window() -> None:
    trace = default_workload(seed=1, num_conversations=10)
    on = simulate(trace, model="gemma-3-1b", memory_bytes=512 * 2**20, check_invariants=True)
    off = simulate(
        trace,
        model="gemma-3-1b",
        memory_bytes=512 * 2**20,
        enable_block_reuse=False,
        check_invariants=True,
    )
    for r in (on, off):
        assert r.completed == len(trace)
        assert r.generated_tokens == sum(len(t.output) for t in trace)
    assert on.reuse_enabled and not off.reuse_enabled
    assert on.cache_hit_rate is not None and on.cache_hit_rate > 0.5
    assert on.cache_hit_rate == on.reused_blocks / (on.reused_blocks + on.missed_blocks)
    assert set(on.cache_hit_rate_per_window) == {512, on.max_seq_len}
    assert all(0 < v <= 1 for v in on.cache_hit_rate_per_window.values())
    assert on.reused_tokens > 0 and on.offloaded_blocks == 0
    assert (off.cache_hit_rate, off.reused_tokens, off.reused_blocks) == (None, 0, 0)
    assert "prefix reuse        off" in format_report(off)
    text = format_report(on)
    assert f"hit rate {on.cache_hit_rate:.1%} (window 512 " in text
    assert "no host cache" in text


@pytest.mark.parametrize("policy", ["invalidate", "placeholder"])
def test_simulate_host_cache_offloads_and_onboards(policy: str) -> None:
    trace = default_workload(seed=1, num_conversations=10)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": 64 * 2**20, "check_invariants": True}
    without = simulate(trace, swa_reuse_policy=policy, **kwargs)  # type: ignore[arg-type]
    r = simulate(
        trace,
        swa_reuse_policy=policy,
        host_cache_bytes=64 * 2**20,
        **kwargs,  # type: ignore[arg-type]
    )
    assert r.swa_reuse_policy == policy
    assert r.secondary_blocks == {512: 46, r.max_seq_len: 256}  # as many as primary blocks
    assert r.completed + r.rejected == len(trace)
    assert r.offloaded_blocks > 0 and r.onboarded_blocks > 0
    assert without.offloaded_blocks == without.onboarded_blocks == 0
    assert r.reused_tokens > without.reused_tokens  # evicted prefixes came back from host
    assert f"host offload        offloaded {r.offloaded_blocks:,} blocks" in format_report(r)


def test_simulate_guaranteed_and_drafts() -> None:
    trace = default_workload(seed=4, num_conversations=8)
    g = simulate(
        trace,
        model="gemma-3-1b",
        memory_bytes=256 * 2**20,
        scheduler="guaranteed_no_evict",
        draft_tokens=3,
        check_invariants=True,
    )
    assert g.pause_events == 0
    assert g.completed == len(trace)
    assert g.generated_tokens == sum(len(t.output) for t in trace)
    assert g.steps < sum(len(t.output) for t in trace)  # drafts save steps


def test_simulate_auto_shares_use_expected_length() -> None:
    trace = default_workload(seed=1, num_conversations=4)
    r = simulate(
        trace, model="gemma-3-1b", memory_bytes=512 * 2**20, shares="auto", expected_seq_len=600
    )
    assert r.shares == "auto(L=600)"
    # n sequences need peak + (n - 1) x live blocks: a 600-token prompt is one chunk, so both
    # windows peak at ceil(600 / 32) = 19 blocks; decoding, the sliding window keeps
    # ceil(511 / 32) + 1 = 17 (x 22 layers), full attention 19 (x 4), of 1024 B per token each
    block = 32 * 1024
    extra = Fraction(512 * 2**20 - 19 * block * 26, 17 * block * 22 + 19 * block * 4)
    assert r.windows[0].blocks == int(19 + extra * 17) == 619


def test_simulate_rejects_requests_longer_than_max_seq_len() -> None:
    trace = [TraceRequest(1, 0, (1,) * 50, (2,) * 10), TraceRequest(2, 0, (1,) * 5, (2,) * 5)]
    r = simulate(trace, model="gemma-3-1b", memory_bytes=16 * 2**20, max_seq_len=32)
    assert (r.completed, r.rejected) == (1, 1)


def test_format_comparison_columns() -> None:
    trace = default_workload(seed=1, num_conversations=4)
    reps = [
        simulate(trace, model="gemma-3-1b", memory_bytes=512 * 2**20, shares=s)
        for s in ("equal", "auto")
    ]
    text = format_comparison(reps)
    mean_len = round(sum(len(t.prompt) + len(t.output) - 1 for t in trace) / len(trace))
    assert text.splitlines()[2].split() == ["shares", "equal", f"auto(L={mean_len})"]


def _long_prompts(seed: int) -> list[TraceRequest]:
    """12 requests, one every 3 steps: a shared 2,048-token system prompt plus 3,000 to
    10,000 tokens of their own, then 100 to 600 generated tokens."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(32000) for _ in range(2048))
    return [
        TraceRequest(
            i,
            3 * i,
            system + tuple(rng.randrange(32000) for _ in range(rng.randint(3000, 10000))),
            tuple(rng.randrange(32000) for _ in range(rng.randint(100, 600))),
        )
        for i in range(12)
    ]


@pytest.mark.parametrize(
    ("seed", "memory_mib", "whole", "chunked", "chunks"),
    [
        # (pauses, completed, rejected, steps): same requests served in a third of the steps;
        # every prompt after the first reuses the 2,048-token system prompt, which leaves at
        # most 7,867 tokens to prefill: one chunk each
        (3, 448, (0, 12, 0, 2904), (0, 12, 0, 1032), 12),
        # the 279-block window pool holds none of the longer prompts whole: rejected; two
        # chunks for the first prompt (10,089 tokens, nothing cached yet) and for the three
        # with more than 8,192 tokens beyond the system prompt
        (1, 384, (0, 6, 6, 443), (0, 12, 0, 1714), 16),
    ],
)
def test_simulate_default_chunked_prefill_beats_whole_prompts(
    seed: int,
    memory_mib: int,
    whole: tuple[int, int, int, int],
    chunked: tuple[int, int, int, int],
    chunks: int,
) -> None:
    """gemma-3-1b, 512-token sliding window: a whole 5,000-12,000-token prompt needs 157-375
    blocks of the window's pool at once (and, beyond the 8,192-token budget, a step of its
    own); in the default chunks of at most 8,192 tokens it never needs more than
    ceil((512 + 8192) / 32) + 1 = 273. Exact admission means neither mode preempts here:
    whole prompts wait or are rejected instead."""
    trace = _long_prompts(seed)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": memory_mib * 2**20, "check_invariants": True}
    w = simulate(trace, chunked_prefill=False, **kwargs)  # type: ignore[arg-type]
    c = simulate(trace, **kwargs)  # type: ignore[arg-type]
    assert (w.pause_events, w.completed, w.rejected, w.steps) == whole
    assert (c.pause_events, c.completed, c.rejected, c.steps) == chunked
    assert c.pause_events <= w.pause_events and c.completed >= w.completed
    assert (c.chunked_prefill, c.max_num_batched_tokens, c.max_chunk_size) == (True, 8192, 8192)
    assert (w.chunked_prefill, w.max_chunk_size) == (False, None)
    assert c.prefill_chunks == chunks
    assert "  chunked prefill (chunks <= 8,192 tokens), 8,192 tokens per step" in format_report(c)
    assert "  whole-prompt prefill, 8,192 tokens per step" in format_report(w)


def test_simulate_chunk_limits() -> None:
    trace = default_workload(seed=1, num_conversations=6)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": 256 * 2**20, "check_invariants": True}
    r = simulate(trace, max_num_batched_tokens=1024, max_chunk_size=300, **kwargs)  # type: ignore[arg-type]
    assert r.completed == len(trace)
    assert r.generated_tokens == sum(len(t.output) for t in trace)
    assert r.context_tokens >= sum(len(t.prompt) for t in trace)
    assert r.prefill_chunks > len(trace)  # prompts of more than 300 new tokens ran in chunks
    assert (r.max_num_batched_tokens, r.max_chunk_size) == (1024, 300)
    assert "chunked prefill (chunks <= 300 tokens), 1,024 tokens per step" in format_report(r)
    unlimited = simulate(trace, max_num_batched_tokens=None, **kwargs)  # type: ignore[arg-type]
    assert unlimited.max_chunk_size is None
    assert "chunked prefill (chunks whole prompts), unlimited tokens per step" in format_report(
        unlimited
    )
    with pytest.raises(ValueError, match="max_chunk_size needs chunked_prefill"):
        simulate(trace, chunked_prefill=False, max_chunk_size=64, **kwargs)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- command line


def test_cli_simulate_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    out_png = tmp_path / "r.png"
    argv = ["simulate", *SMALL, "--json", str(out_json), "--plot", str(out_png)]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert text.startswith("kvcache simulate: gemma-3-1b, 512 MiB primary KV memory, equal")
    for label in ("requests", "engine steps", "concurrency", "paused", "manager time/step"):
        assert f"  {label}" in text
    data = json.loads(out_json.read_text())["runs"][0]
    assert data["model"] == "gemma-3-1b"
    assert data["completed"] == data["requests"]
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_simulate_trace_and_shares(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    write_trace(default_workload(seed=9, num_conversations=5), trace)
    argv = ["simulate", "--model", "gemma-3-1b", "--memory", "512MiB", "--trace", str(trace)]
    assert main([*argv, "--shares", "0.3,0.7"]) == 0
    assert "0.3,0.7 window shares" in capsys.readouterr().out
    assert (
        main([*argv, "--compare-shares", "--shares", "1,3", "--json", str(tmp_path / "c.json")])
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert lines[1] == f"  workload: trace {trace}, {len(read_trace(trace))} requests"
    assert lines[3].split()[:3] == ["shares", "equal", "proportional"]
    assert lines[3].split()[3].startswith("auto(L=")  # auto uses the workload's mean length
    assert lines[3].split()[4] == "1,3"
    assert len(json.loads((tmp_path / "c.json").read_text())["runs"]) == 4


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--model", "nope"], "unknown model 'nope'"),
        (["--memory", "lots"], "invalid size 'lots'"),
        (["--shares", "1,2,3"], "gives 3 share(s) but the model has 2 window(s)"),
        (["--memory", "1KiB"], "memory budget too small"),
        (["--scheduler", "fifo"], "invalid choice: 'fifo'"),
        (["--swa-reuse-policy", "keep"], "invalid choice: 'keep'"),
        (["--host-cache", "lots"], "invalid size 'lots'"),
    ],
)
def test_cli_simulate_errors(
    capsys: pytest.CaptureFixture[str], extra: list[str], message: str
) -> None:
    assert main(["simulate", *SMALL, *extra]) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1, err
    assert message in err


def test_cli_simulate_bad_trace_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"request_id": 1, "arrival": 0, "prompt": [1], "output": [2]}\nnot json\n')
    assert main(["simulate", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [
        f"kvcache simulate: error: {trace}:2: not valid JSON (Expecting value)"
    ]
    assert main(["simulate", "--trace", str(tmp_path / "none.jsonl")]) == 2
    assert "cannot read trace" in capsys.readouterr().err


def test_cli_simulate_default_run(capsys: pytest.CaptureFixture[str]) -> None:
    """The documented default: built-in workload, gemma-3-12b, 16 GiB, virtual backend."""
    assert main(["simulate"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(
        "kvcache simulate: gemma-3-12b, 16.0 GiB primary KV memory, equal window shares, "
        "max_utilization scheduling, virtual backend"
    )
    assert "  requests            1,003 (1,003 completed)" in text
    assert "  chunked prefill (chunks <= 8,192 tokens), 8,192 tokens per step" in text
    assert "  block reuse on (sliding windows: placeholder), host cache none" in text
    assert "  prefix reuse        hit rate " in text


def test_cli_simulate_reuse_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    argv = ["simulate", *SMALL, "--swa-reuse-policy", "placeholder", "--host-cache", "64MiB"]
    assert main([*argv, "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "  block reuse on (sliding windows: placeholder), host cache 64.0 MiB" in text
    assert "  host offload        offloaded " in text
    data = json.loads(out_json.read_text())["runs"][0]
    assert data["swa_reuse_policy"] == "placeholder"
    assert data["host_cache_bytes"] == 64 * 2**20
    assert set(data["cache_hit_rate_per_window"]) == {"512", str(data["max_seq_len"])}
    assert main(["simulate", *SMALL, "--no-reuse"]) == 0
    assert "  block reuse off" in capsys.readouterr().out


def test_cli_simulate_prefill_flags(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_json = tmp_path / "r.json"
    argv = ["simulate", *SMALL, "--max-num-batched-tokens", "2048", "--max-chunk-size", "512"]
    assert main([*argv, "--json", str(out_json)]) == 0
    assert "  chunked prefill (chunks <= 512 tokens), 2,048 tokens per step" in (
        capsys.readouterr().out
    )
    data = json.loads(out_json.read_text())["runs"][0]
    assert (data["chunked_prefill"], data["max_num_batched_tokens"]) == (True, 2048)
    assert data["max_chunk_size"] == 512 and data["prefill_chunks"] > data["requests"]
    assert main(["simulate", *SMALL, "--no-chunked-prefill", "--json", str(out_json)]) == 0
    assert "  whole-prompt prefill, 8,192 tokens per step" in capsys.readouterr().out
    data = json.loads(out_json.read_text())["runs"][0]
    assert (data["chunked_prefill"], data["max_chunk_size"]) == (False, None)


def test_segmented_lru_keeps_more_prefixes_than_plain_lru() -> None:
    """60 chat conversations on gemma-3-1b in 128 MiB: blocks that served a hit outlive the
    turns seen once (segmented LRU, the default); ``protect_reused_blocks=False`` (the CLI's
    ``--plain-lru``) evicts in release order and reuses 220 blocks fewer."""
    trace = default_workload(seed=0, num_conversations=60)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": 128 * 2**20, "check_invariants": True}
    slru = simulate(trace, **kwargs)  # type: ignore[arg-type]
    lru = simulate(trace, protect_reused_blocks=False, **kwargs)  # type: ignore[arg-type]
    assert (slru.completed, slru.pause_events, lru.completed, lru.pause_events) == (115, 0, 115, 0)
    assert (slru.reused_blocks, slru.missed_blocks) == (4334, 9156)
    assert (lru.reused_blocks, lru.missed_blocks) == (4114, 9376)
    assert (slru.protect_reused_blocks, lru.protect_reused_blocks) == (True, False)
    assert (
        "  block reuse on (sliding windows: placeholder), host cache none"
        in format_report(slru).splitlines()
    )
    assert "  block reuse on (sliding windows: placeholder, plain LRU), host cache none" in (
        format_report(lru).splitlines()
    )


def test_cli_simulate_plain_lru(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    assert main(["simulate", *SMALL, "--plain-lru", "--json", str(out_json)]) == 0
    assert ", plain LRU), host cache none" in capsys.readouterr().out
    assert json.loads(out_json.read_text())["runs"][0]["protect_reused_blocks"] is False


def test_lending_admits_what_a_fixed_split_rejects() -> None:
    """60 chat conversations on gemma-3-1b in 128 MiB, equal shares: the sliding window's
    share (93 blocks) cannot hold the peak of 34 long requests, which a fixed split rejects;
    with ``lend_free_memory`` 21 of them fit the shared memory, so 21 more requests complete
    (no pauses: between steps slabs move towards the window whose equal-priority cache is
    newer) and more prefixes are reused."""
    trace = default_workload(seed=0, num_conversations=60)
    kwargs = {"model": "gemma-3-1b", "memory_bytes": 128 * 2**20, "check_invariants": True}
    fixed = simulate(trace, **kwargs)  # type: ignore[arg-type]
    lend = simulate(trace, lend_free_memory=True, **kwargs)  # type: ignore[arg-type]
    assert (fixed.completed, fixed.rejected, fixed.pause_events) == (115, 34, 0)
    assert (lend.completed, lend.rejected, lend.pause_events, lend.lent_slabs) == (136, 13, 0, 20)
    assert (fixed.lend_free_memory, lend.lend_free_memory) == (False, True)
    assert (lend.reused_blocks, lend.missed_blocks) == (5858, 12086)
    assert "window shares (windows lend free memory: 20 slabs moved; blocks below" in (
        format_report(lend)
    )


def test_cli_simulate_lend_free_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_json = tmp_path / "r.json"
    assert main(["simulate", *SMALL, "--lend-free-memory", "--json", str(out_json)]) == 0
    assert "(windows lend free memory: " in capsys.readouterr().out
    assert json.loads(out_json.read_text())["runs"][0]["lend_free_memory"] is True
