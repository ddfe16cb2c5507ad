"""Mooncake traces as they are, streamed replays, and the offline hit-rate bounds."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import kvcache.simulate.loop as loop
from kvcache.cli import main
from kvcache.simulate import (
    KeyTrace,
    TraceFile,
    TraceRequest,
    belady_hits,
    format_report,
    ideal_hits,
    iter_trace,
    key_trace,
    lru_hits,
    read_trace,
    simulate,
    write_trace,
)
from kvcache.simulate.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    mooncake_output_tokens,
    mooncake_prompt_tokens,
)
from kvcache.sizing import SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR

ROOT = Path(__file__).resolve().parents[2]
SHARED_TRACE = Path(
    os.environ.get(
        "KVCACHE_MOONCAKE_TRACE",
        ROOT.parent / "shared" / "traces" / "mooncake_synthetic_trace.jsonl",
    )
)
B = MOONCAKE_BLOCK_TOKENS


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


def _line(ts: float, n_in: int, n_out: int, ids: list[int]) -> str:
    return json.dumps(
        {"timestamp": ts, "input_length": n_in, "output_length": n_out, "hash_ids": ids}
    )


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _chats(path: Path, *, conversations: int = 6, turns: int = 4, seed: int = 0) -> Path:
    """A small multi-turn Mooncake trace: each turn repeats its conversation's ids and adds
    one or two blocks; a shared "system" id starts every conversation."""
    rng = np.random.default_rng(seed)
    next_id = 1
    rows: list[tuple[int, str]] = []
    for _conversation in range(conversations):
        ids = [0]
        start = int(rng.integers(0, 4000))
        for t in range(turns):
            for _ in range(int(rng.integers(1, 3))):
                ids.append(next_id)
                next_id += 1
            n_in = (len(ids) - 1) * B + int(rng.integers(1, B + 1))
            rows.append(
                (start + 3000 * t, _line(start + 3000 * t, n_in, int(rng.integers(2, 40)), ids))
            )
    rows.sort(key=lambda r: r[0])
    return _write(path, [r[1] for r in rows])


# ------------------------------------------------------------------ tokens per hash id


def test_equal_ids_give_equal_tokens_and_different_ids_different(tmp_path: Path) -> None:
    path = _write(
        tmp_path / "t.jsonl",
        [_line(0, 3 * B, 4, [10, 11, 12]), _line(5, 2 * B + 100, 4, [10, 11, 13])],
    )
    a, b = read_trace(path)
    assert (a.request_id, b.request_id) == (0, 1)
    assert len(a.prompt) == 3 * B and len(b.prompt) == 2 * B + 100
    assert a.prompt[: 2 * B] == b.prompt[: 2 * B]  # ids 10, 11: token for token
    assert sum(x == y for x, y in zip(a.prompt[2 * B :], b.prompt[2 * B :], strict=False)) < 5
    # The same id gives the same block wherever it appears, and the function is fixed.
    alone = mooncake_prompt_tokens([11], B)
    assert tuple(alone.tolist()) == a.prompt[B : 2 * B]
    assert np.array_equal(
        mooncake_prompt_tokens([10, 11], 700), mooncake_prompt_tokens([10, 11], 700)
    )
    assert (
        mooncake_prompt_tokens([10], B).min() >= 0 and mooncake_prompt_tokens([10], B).max() < 32000
    )
    # Outputs: per request, distinct, and at least one token.
    assert a.output != b.output and len(a.output) == 4
    assert len(mooncake_output_tokens(7, 0)) == 1
    assert not np.array_equal(mooncake_output_tokens(1, 8), mooncake_output_tokens(2, 8))


@pytest.mark.parametrize("tokens_per_block", [16, 32, 128, 512])
def test_reuse_follows_the_ids_whatever_the_block_size(
    tmp_path: Path, tokens_per_block: int
) -> None:
    """Two ids shared, the third not: exactly 1,024 tokens reused at any block size, and the
    ideal says the same."""
    path = _write(
        tmp_path / "t.jsonl",
        [_line(0, 3 * B, 2, [1, 2, 3]), _line(100_000, 3 * B, 2, [1, 2, 4])],
    )
    r = simulate(
        TraceFile(path),
        model="llama-3.1-8b",
        memory_bytes=2**30,
        tokens_per_block=tokens_per_block,
        hit_bounds=True,
    )
    assert r.reused_tokens == 2 * B
    assert r.hit_bounds is not None
    assert r.hit_bounds.ideal_tokens == r.hit_bounds.achieved_tokens == 2 * B


# ------------------------------------------------------------------ arrivals, --first


def test_timestamps_map_to_steps_exactly(tmp_path: Path) -> None:
    stamps = [0, 49, 50, 125, 1000, 1000.5]
    path = _write(tmp_path / "t.jsonl", [_line(t, 10, 0, [i]) for i, t in enumerate(stamps)])
    assert [r.arrival for r in read_trace(path)] == [0, 0, 1, 2, 20, 20]  # 50 ms per step
    assert [r.arrival for r in read_trace(path, step_ms=25)] == [0, 1, 2, 5, 40, 40]
    assert [r.arrival for r in read_trace(path, step_ms=1000)] == [0, 0, 0, 0, 1, 1]
    assert [r.arrival for r in read_trace(path, arrival="asap")] == [0] * 6
    assert TraceFile(path, step_ms=25).scan().arrivals == (0, 1, 2, 5, 40, 40)
    assert all(len(r.output) == 1 for r in read_trace(path))  # output_length 0: one token
    with pytest.raises(ValueError, match="arrival='asap' ignores them"):
        TraceFile(path, arrival="asap", step_ms=10)
    with pytest.raises(ValueError, match="step_ms must be a positive number"):
        TraceFile(path, step_ms=0)
    kv = tmp_path / "kv.jsonl"
    write_trace([TraceRequest(0, 3, (1, 2), (3,))], kv)
    with pytest.raises(ValueError, match=r"kv\.jsonl:1: step_ms times Mooncake timestamps"):
        read_trace(kv, step_ms=10)
    assert [r.arrival for r in read_trace(kv, arrival="asap")] == [0]


def test_first_n_of_either_format(tmp_path: Path) -> None:
    moon = _chats(tmp_path / "m.jsonl")
    assert [r.request_id for r in read_trace(moon, first=5)] == [0, 1, 2, 3, 4]
    assert read_trace(moon, first=5) == read_trace(moon)[:5]
    assert TraceFile(moon, first=5).scan().requests == 5
    assert len(read_trace(moon, first=10_000)) == 24
    kv = tmp_path / "kv.jsonl"
    write_trace([TraceRequest(9 - i, i, (1, 2, i), (3,)) for i in range(6)], kv)
    assert [r.request_id for r in read_trace(kv, first=3)] == [9, 8, 7]  # file order
    with pytest.raises(ValueError, match="first must be an int >= 1"):
        TraceFile(kv, first=0)


# ------------------------------------------------------------------ streaming


def test_the_loop_reads_requests_only_as_they_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    consumed: list[int] = []

    def stream(n: int, gap: int) -> Iterator[TraceRequest]:
        for i in range(n):
            consumed.append(i)
            yield TraceRequest(i, i * gap, tuple(rng.integers(0, 32000, 300).tolist()), (1, 2, 3))

    seen: list[int] = []
    step = loop.SimulatedEngine.step

    def spy(self: Any, s: int) -> int:
        if not seen:
            seen.append(len(consumed))
        return step(self, s)

    monkeypatch.setattr(loop.SimulatedEngine, "step", spy)
    r = simulate(stream(50, 100), model="llama-3.1-8b", memory_bytes=2**30, max_seq_len=400)
    assert r.completed == 50
    assert seen == [2]  # the first request, and the next one peeked at: arrives at step 100
    consumed.clear()
    seen.clear()
    r = simulate(
        stream(200, 0), model="llama-3.1-8b", memory_bytes=2**30, max_seq_len=400, max_batch_size=4
    )
    assert r.completed == 200
    assert seen == [2 * 4 + 1]  # all arrived at step 0: 2 x max_batch_size read, one peeked

    def backwards() -> Iterator[TraceRequest]:
        yield TraceRequest(0, 5, (1, 2), (3,))
        yield TraceRequest(1, 2, (1, 2), (3,))

    with pytest.raises(ValueError, match="a stream must come in arrival order"):
        simulate(backwards(), model="llama-3.1-8b", memory_bytes=2**30, max_seq_len=8)
    with pytest.raises(ValueError, match="needs max_seq_len"):
        simulate(backwards(), model="llama-3.1-8b", memory_bytes=2**30)
    with pytest.raises(ValueError, match="not a one-shot stream"):
        simulate(
            backwards(), model="llama-3.1-8b", memory_bytes=2**30, max_seq_len=8, hit_bounds=True
        )


def test_a_streamed_file_replays_like_the_list(tmp_path: Path) -> None:
    path = _chats(tmp_path / "m.jsonl", conversations=8)
    kwargs: dict[str, Any] = {"model": "gemma-3-1b", "memory_bytes": 64 * 2**20, "hit_bounds": True}
    a = simulate(read_trace(path), **kwargs).to_dict()
    b = simulate(TraceFile(path), **kwargs).to_dict()
    for key in ("wall_seconds", "manager_us_per_step", "manager_us_p99", "scheduler_us_per_step"):
        a.pop(key), b.pop(key)
    assert a == b
    # A file read lazily: a bad line is an error only once it is reached.
    bad = _write(tmp_path / "bad.jsonl", [_line(0, 10, 1, [1]), _line(1, 10, 1, [2]), "{"])
    it = iter_trace(bad)
    assert [next(it).request_id, next(it).request_id] == [0, 1]
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: not valid JSON"):
        next(it)


# ------------------------------------------------------------------ malformed lines


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"timestamp": 0, "input_length": 10, "hash_ids": [1]}'], ":1: missing 'output_length'"),
        ([_line(0, 10, 1, [1])[:-1] + ', "session": 3}'], ":1: unknown key(s) 'session'"),
        ([_line(-1, 10, 1, [1])], ":1: 'timestamp' must be a number >= 0"),
        ([_line(0, 10, 1, [1]).replace('"timestamp": 0', '"timestamp": true')], "'timestamp' must"),
        ([_line(0, 10, 1, [1]).replace('"timestamp": 0', '"timestamp": NaN')], "'timestamp' must"),
        ([_line(0, 0, 1, [1])], ":1: 'input_length' must be an int >= 1, got 0"),
        ([_line(0, 10.5, 1, [1])], "'input_length' must be an int >= 1, got 10.5"),  # type: ignore[arg-type]
        ([_line(0, 10, -1, [1])], ":1: 'output_length' must be an int >= 0, got -1"),
        ([_line(0, 10, 1, [])], ":1: 'hash_ids' must be a non-empty list of ints"),
        ([_line(0, 10, 1, ["a"])], "'hash_ids' holds 'a' at index 0"),  # type: ignore[list-item]
        ([_line(0, 10, 1, [-4])], "'hash_ids' holds -4 at index 0"),
        ([_line(0, 1025, 1, [1, 2])], ":1: 'hash_ids' holds 2 ids, but input_length 1025 needs 3"),
        ([_line(0, 512, 1, [1, 2])], "'hash_ids' holds 2 ids, but input_length 512 needs 1"),
        (
            [_line(0, 10, 1, [1]), '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1]}'],
            ":2: a kvcache line in a Mooncake trace (line 1 is in Mooncake's format)",
        ),
        (
            [
                '{"request_id": 1, "arrival": 0, "prompt": [1], "output": [1]}',
                "",
                _line(0, 10, 1, [1]),
            ],
            ":3: a Mooncake line in a kvcache trace (line 1 is in kvcache's format)",
        ),
        ([_line(0, 10, 1, [1]), "[1, 2]"], ":2: a kvcache line in a Mooncake trace"),
    ],
)
def test_malformed_mooncake_lines(tmp_path: Path, lines: list[str], message: str) -> None:
    path = _write(tmp_path / "bad.jsonl", lines)
    with pytest.raises(ValueError) as info:
        read_trace(path)
    assert str(path) in str(info.value)
    assert message in str(info.value)
    with pytest.raises(ValueError):  # the same check before a replay
        TraceFile(path).scan()


# ------------------------------------------------------------------ bounds


def _hand_trace(requests: list[list[int]]) -> KeyTrace:
    """A KeyTrace of one-token blocks: each request looks up (and stores) the keys given."""
    sizes = np.array([len(r) for r in requests], dtype=np.int64)
    starts = np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)
    n = len(requests)
    return KeyTrace(
        1,
        np.arange(n, dtype=np.int64),
        sizes + 1,
        np.ones(n, dtype=np.int64),
        starts,
        sizes,
        np.array([k for r in requests for k in r], dtype=np.int64),
    )


def test_ideal_lru_and_belady_on_a_hand_made_trace() -> None:
    # Chains A = (1, 2) and B = (3,), then A, B, A again; a cache of 2 blocks.
    kt = _hand_trace([[1, 2], [3], [1, 2], [3], [1, 2]])
    # Ideal: everything seen before hits.
    assert ideal_hits(kt).tolist() == [0, 0, 2, 1, 2]
    # LRU (touched last block first): after A [2, 1]; B evicts 2: [1, 3]; A hits 1 only,
    # re-inserts 2 and evicts 3: [2, 1]; B misses, evicts 2; A hits 1 only.
    assert lru_hits(kt, 2).tolist() == [0, 0, 1, 0, 1]
    # Belady: B's next use (position 5) is later than A's (3, 4): B is not cached; A hits
    # twice; B's second use is its last, so nothing is evicted for it.
    assert belady_hits(kt, 2).tolist() == [0, 0, 2, 0, 2]
    assert lru_hits(kt, 3).tolist() == belady_hits(kt, 3).tolist() == [0, 0, 2, 1, 2]
    assert lru_hits(kt, 0).tolist() == belady_hits(kt, 0).tolist() == [0] * 5
    # A chain is reused as a prefix only: (1, 9) after (1, 2) hits one block everywhere.
    # With one block: LRU keeps the chain's first block (touched last); Belady keeps it too
    # (looked up next) and does not cache block 2, looked up later than it.
    kt = _hand_trace([[1, 2], [1, 9], [1, 2]])
    assert ideal_hits(kt).tolist() == [0, 1, 2]
    assert lru_hits(kt, 1).tolist() == belady_hits(kt, 1).tolist() == [0, 1, 1]


def test_key_trace_uses_the_cores_keys() -> None:
    base = list(range(100, 108))
    trace = [
        TraceRequest(0, 0, (*base, 1), (5,)),  # holds 8 tokens: 2 blocks of 4
        TraceRequest(1, 1, (*base, 7, 8), (5, 6, 7, 8)),  # looks up 2, stores 3
        TraceRequest(2, 2, tuple(base), (1,)),  # looks up 7 tokens: 1 block
        TraceRequest(3, 3, (*base, 7), (1,), cache_salt="x"),  # another salt: no hit
    ]
    kt = key_trace(trace, 4)
    assert kt.lookups.tolist() == [2, 2, 1, 2]
    assert np.diff(kt.starts).tolist() == [2, 3, 1, 2]
    assert kt.keys[2:4].tolist() == kt.keys[0:2].tolist()
    assert ideal_hits(kt).tolist() == [0, 2, 1, 0]
    assert kt.prompt_tokens == 9 + 10 + 8 + 9


@pytest.mark.skipif(not SHARED_TRACE.exists(), reason="the shared Mooncake trace is not here")
def test_ideal_of_the_real_mooncake_trace() -> None:
    """The trace's README: an unbounded cache hits 65.1 % of prompt tokens."""
    t0 = time.perf_counter()
    kt = key_trace(TraceFile(SHARED_TRACE), 32)
    ideal = int(ideal_hits(kt).sum()) * 32 / kt.prompt_tokens
    assert time.perf_counter() - t0 < 5
    assert kt.requests == 3993
    assert round(100 * ideal, 1) == 65.1


def test_lost_hits_add_up_to_ideal_minus_achieved(tmp_path: Path) -> None:
    path = _chats(tmp_path / "m.jsonl", conversations=10, turns=5)
    for model, memory in (("llama-3.1-8b", 2**30), ("gemma-3-1b", 256 * 2**20)):
        r = simulate(TraceFile(path), model=model, memory_bytes=memory, hit_bounds=True)
        h = r.hit_bounds
        assert h is not None
        assert sum(h.lost_tokens.values()) == h.ideal_tokens - h.achieved_tokens
        assert h.never_seen_tokens == h.prompt_tokens - h.ideal_tokens
        assert h.prompt_tokens == sum(len(t.prompt) for t in read_trace(path))
        assert h.achieved_tokens <= h.ideal_tokens
        assert h.lru_tokens <= h.belady_tokens <= h.ideal_tokens  # type: ignore[operator]
        assert h.lost_tokens["capacity"] > 0  # the pools are small
        if not r.pause_events:
            assert h.achieved_tokens + h.partial_tokens == r.reused_tokens
        assert h.achieved_tokens % 32 == 0
        assert "vs the possible" in format_report(r)
    assert h.lost_tokens["sliding window"] > 0  # gemma-3-1b's 512-token window


def test_concurrency_and_the_verdicts(tmp_path: Path) -> None:
    # The same prompt twice in one step: the second cannot find the first's blocks yet.
    same = _write(tmp_path / "same.jsonl", [_line(0, 4 * B, 2, [1, 2, 3, 4])] * 2)
    r = simulate(
        TraceFile(same, arrival="asap"), model="llama-3.1-8b", memory_bytes=2**30, hit_bounds=True
    )
    h = r.hit_bounds
    assert h is not None and h.achieved_tokens == 0
    assert h.ideal_tokens == (4 * B - 1) // 32 * 32
    assert h.lost_tokens == {
        "not yet stored": h.ideal_tokens,
        "sliding window": 0,
        "no checkpoint": 0,
        "rejected": 0,
        "capacity": 0,
    }
    assert h.lru_tokens == h.ideal_tokens
    assert h.verdict.startswith("more memory cannot help much: a plain LRU cache of this capacity")
    assert h.verdict.endswith("mostly not yet stored")
    # Far apart: the run reaches the ideal.
    apart = _write(tmp_path / "apart.jsonl", [_line(t, 4 * B, 2, [1, 2, 3, 4]) for t in (0, 10**5)])
    r = simulate(TraceFile(apart), model="llama-3.1-8b", memory_bytes=2**30, hit_bounds=True)
    assert r.hit_bounds is not None
    assert r.hit_bounds.achieved_tokens == r.hit_bounds.ideal_tokens
    assert r.hit_bounds.verdict.startswith("more memory cannot help: the run is within 0.0 pp")


# ------------------------------------------------------------------ the command line


def test_cli_replays_a_mooncake_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _chats(tmp_path / "m.jsonl", conversations=10)
    out = tmp_path / "r.json"
    argv = ["simulate", "--trace", str(path), "--model", "gemma-3-1b", "--memory", "64MiB"]
    assert main([*argv, "--first", "20", "--json", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "Mooncake trace" in text and "20 requests (the first 20 of the file)" in text
    assert "50 ms per engine step" in text
    for line in ("vs the possible", "lost vs ideal", "verdict"):
        assert line in text
    doc = json.loads(out.read_text())
    assert doc["workload"] == {
        "source": "trace",
        "path": str(path),
        "format": "mooncake",
        "requests": 20,
        "first": 20,
        "arrival": "timestamps",
        "step_ms": 50.0,
    }
    run = doc["runs"][0]
    assert run["requests"] == 20
    h = run["hit_bounds"]
    for key in (
        "achieved_hit_rate",
        "ideal_hit_rate",
        "lru_hit_rate",
        "belady_hit_rate",
        "verdict",
    ):
        assert key in h
    assert sum(h["lost_tokens"].values()) == h["ideal_tokens"] - h["achieved_tokens"]
    assert h["prompt_tokens"] == sum(len(t.prompt) for t in read_trace(path, first=20))
    assert (
        main([*argv, "--first", "20", "--arrival", "asap", "--no-bounds", "--json", str(out)]) == 0
    )
    doc = json.loads(out.read_text())
    assert doc["runs"][0]["hit_bounds"] is None and "step_ms" not in doc["workload"]
    assert main([*argv, "--step-ms", "500", "--compare-shares"]) == 0
    assert "ideal (unbounded)" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--first", "3"], "--first replays a trace as given; it needs --trace"),
        (["--step-ms", "10"], "--step-ms replays a trace as given; it needs --trace"),
        (["--arrival", "asap"], "--arrival asap replays a trace as given; it needs --trace"),
        (["--step-ms", "0"], "expected a positive number of milliseconds"),
    ],
)
def test_cli_trace_flags_need_a_trace(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--num-conversations", "2", *extra]) == 2
    assert message in capsys.readouterr().err


def test_cli_step_ms_is_for_mooncake_timestamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kv = tmp_path / "kv.jsonl"
    write_trace([TraceRequest(0, 0, (1, 2), (3,))], kv)
    assert main(["simulate", "--trace", str(kv), "--step-ms", "20"]) == 2
    assert "--step-ms times a Mooncake trace's timestamps" in capsys.readouterr().err
    moon = _write(tmp_path / "m.jsonl", [_line(0, 10, 1, [1])])
    assert main(["simulate", "--trace", str(moon), "--step-ms", "20", "--arrival", "asap"]) == 2
    assert "--arrival asap puts every request at step 0" in capsys.readouterr().err
