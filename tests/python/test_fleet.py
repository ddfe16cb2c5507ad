"""Tests for kvcache.simulate.fleet and ``kvcache simulate --engines N --router R``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import kvcache
from kvcache.simulate import TraceRequest, default_workload, simulate
from kvcache.simulate.fleet import FleetReport, simulate_fleet

msgspec = pytest.importorskip("msgspec")
zmq = pytest.importorskip("zmq")

from kvcache.events import EventBatcher, ZmqEventPublisher, wire_schema  # noqa: E402
from kvcache.router import KvIndexer  # noqa: E402

MODEL = "gemma-3-1b"  # 5 sliding layers (window 512) per full one
TIMING = ("wall_seconds", "manager_us_per_step", "manager_us_p99", "scheduler_us_per_step")


def _run_dict(report: Any) -> dict[str, Any]:
    d: dict[str, Any] = report.to_dict()
    for key in TIMING:
        d.pop(key)
    return d


def _tokens(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(32000) for _ in range(n))


@pytest.mark.parametrize("router", ["kv", "round-robin", "least-loaded"])
def test_one_engine_fleet_equals_simulate(router: str) -> None:
    # Small pools (pauses, evictions, host offload) and drafts: every part of a step runs.
    trace = default_workload(seed=4, num_conversations=60, mean_gap=1.0)
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "memory_bytes": 160 * 2**20,
        "host_cache_bytes": 32 * 2**20,
        "draft_tokens": 2,
        "seed": 9,
    }
    single = simulate(trace, **kwargs)
    fleet = simulate_fleet(trace, engines=1, router=router, **kwargs)
    # Not a trivial run: a pause, rejections, offload and onboarding.
    assert single.pause_events > 0 and single.rejected > 0 and single.onboarded_blocks > 0
    assert _run_dict(fleet.engines[0]) == _run_dict(single)
    assert fleet.requests == single.requests == len(trace)
    assert fleet.cache_hit_rate == pytest.approx(single.cache_hit_rate)
    assert fleet.steps == single.steps
    assert fleet.load_imbalance == 1.0
    assert fleet.placement == {t.request_id: 0 for t in trace}


def test_round_robin_assigns_request_i_to_engine_i_mod_n() -> None:
    trace = default_workload(seed=1, num_conversations=20)
    report = simulate_fleet(trace, engines=3, router="round-robin", model=MODEL)
    order = sorted(trace, key=lambda t: (t.arrival, t.request_id))
    assert report.placement == {t.request_id: i % 3 for i, t in enumerate(order)}
    assert report.assigned == [len(range(k, len(trace), 3)) for k in range(3)]
    assert [e.requests for e in report.engines] == report.assigned
    assert report.predicted_tokens is None and report.found_tokens is None
    assert report.completed == len(trace)


def _req(rid: int, arrival: int, prompt: tuple[int, ...], out_len: int) -> TraceRequest:
    return TraceRequest(rid, arrival, prompt, tuple(range(1, out_len + 1)))


def test_least_loaded_picks_the_engine_holding_fewest_requests() -> None:
    rng = random.Random(3)
    # Step 0: three requests, one per engine; request 0 runs for 100 steps, 1 and 2 finish
    # within a few. Step 50: engine 0 still holds request 0, engines 1 and 2 are empty.
    trace = [
        _req(0, 0, _tokens(rng, 40), 100),
        _req(1, 0, _tokens(rng, 40), 2),
        _req(2, 0, _tokens(rng, 40), 2),
        _req(3, 50, _tokens(rng, 40), 5),
        _req(4, 50, _tokens(rng, 40), 5),
        _req(5, 50, _tokens(rng, 40), 5),
    ]
    least = simulate_fleet(trace, engines=3, router="least-loaded", model=MODEL)
    # 3 -> engine 1 (0 held; tie with 2 goes to the lower index), 4 -> engine 2 (the only
    # empty one), 5 -> engine 0 (all hold one: the lowest index).
    assert least.placement == {0: 0, 1: 1, 2: 2, 3: 1, 4: 2, 5: 0}
    rr = simulate_fleet(trace, engines=3, router="round-robin", model=MODEL)
    assert rr.placement == {0: 0, 1: 1, 2: 2, 3: 0, 4: 1, 5: 2}
    assert least.completed == rr.completed == 6


def test_kv_router_sends_a_shared_prefix_to_the_engine_that_holds_it() -> None:
    rng = random.Random(5)
    p, q = _tokens(rng, 100), _tokens(rng, 70)
    trace = [
        _req(0, 0, p + _tokens(rng, 10), 4),  # engine 0 (nothing cached: load tie)
        _req(1, 0, q + _tokens(rng, 10), 4),  # engine 1 (engine 0 holds request 0)
        _req(2, 50, q + _tokens(rng, 10), 4),  # q is on engine 1
        _req(3, 50, p + _tokens(rng, 10), 4),  # p is on engine 0
        _req(4, 50, _tokens(rng, 50), 4),  # nothing shared: the load tie-break
    ]
    kwargs: dict[str, Any] = {
        "model": MODEL,
        "tokens_per_block": 16,
        "enable_partial_reuse": False,
    }
    kv = simulate_fleet(trace, engines=2, router="kv", **kwargs)
    # Request 4 sees both engines holding one request and reuse 0: the lower index.
    assert kv.placement == {0: 0, 1: 1, 2: 1, 3: 0, 4: 0}
    # 70 shared tokens are 4 whole blocks of 16; 100 are 6.
    assert kv.engines[1].reused_tokens == 64
    assert kv.engines[0].reused_tokens == 96
    assert (kv.predicted_tokens, kv.found_tokens, kv.predicted_exact) == (160, 160, 5)
    rr = simulate_fleet(trace, engines=2, router="round-robin", **kwargs)
    assert rr.placement == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0}
    assert rr.reused_tokens == 0 and rr.cache_hit_rate == 0.0
    assert kv.cache_hit_rate is not None and kv.cache_hit_rate > 0.0


def test_predicted_hits_equal_found_hits_without_evictions() -> None:
    # Pools far larger than the workload: nothing is evicted, so what the index saw after a
    # step is what the engine reuses when it registers the request.
    trace = default_workload(seed=2, num_conversations=40, mean_gap=5.0)
    report = simulate_fleet(
        trace,
        engines=3,
        router="kv",
        model=MODEL,
        memory_bytes=4 * 2**30,
        enable_partial_reuse=False,
    )
    assert report.completed == len(trace)
    assert report.found_tokens == report.reused_tokens > 10_000
    assert report.predicted_tokens == report.found_tokens
    assert report.predicted_exact == len(trace)
    assert report.predicted_over == report.predicted_under == 0
    assert report.lost_events == 0
    assert all(e.offloaded_blocks == 0 for e in report.engines)
    assert sorted(set(report.placement.values())) == [0, 1, 2]


def test_kv_router_beats_round_robin_on_shared_prefixes() -> None:
    trace = default_workload(seed=0, num_conversations=80)
    kwargs: dict[str, Any] = {"engines": 4, "model": MODEL, "memory_bytes": 256 * 2**20}
    kv = simulate_fleet(trace, router="kv", **kwargs)
    rr = simulate_fleet(trace, router="round-robin", **kwargs)
    assert kv.cache_hit_rate is not None and rr.cache_hit_rate is not None
    assert kv.cache_hit_rate > rr.cache_hit_rate + 0.05
    assert kv.reused_tokens > rr.reused_tokens
    # Partial reuse lets an engine find a part of a block more than the router predicted.
    assert kv.found_tokens is not None and kv.predicted_tokens is not None
    assert 0 <= kv.found_tokens - kv.predicted_tokens <= 31 * len(trace)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"engines": 0}, "engines must be in 1..64, got 0"),
        ({"engines": 65}, "engines must be in 1..64, got 65"),
        ({"engines": 2.0}, "engines must be an int"),
        ({"router": "random"}, "router must be one of kv, round-robin, least-loaded"),
    ],
)
def test_bad_fleet_arguments(kwargs: dict[str, Any], message: str) -> None:
    trace = default_workload(seed=1, num_conversations=2)
    with pytest.raises(ValueError, match=message):
        simulate_fleet(trace, model=MODEL, **kwargs)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvcache.cli", "simulate", "--no-progress", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


SMALL = ["--model", MODEL, "--memory", "256MiB", "--num-conversations", "30"]


def test_cli_fleet_subprocess(tmp_path: Path) -> None:
    proc = _cli(*SMALL, "--engines", "3", "--router", "round-robin")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "3 engines, round-robin router; each gemma-3-1b, 256 MiB" in out
    assert "fleet hit rate" in out and "load imbalance" in out
    assert "router predicted" not in out  # round-robin predicts nothing
    assert (
        len([line for line in out.splitlines() if line.strip().startswith(("0 ", "1 ", "2 "))]) == 3
    )

    path = tmp_path / "fleet.json"
    proc = _cli(*SMALL, "--engines", "3", "--compare-routers", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "kvcache simulate --compare-routers: 3 engines" in proc.stdout
    doc = json.loads(path.read_text())
    assert [f["router"] for f in doc["fleets"]] == ["kv", "round-robin", "least-loaded"]
    kv, rr, _ = doc["fleets"]
    assert kv["predicted_tokens"] > 0 and rr["predicted_tokens"] is None
    assert sum(kv["assigned"]) == doc["workload"]["requests"] == kv["requests"]
    assert len(kv["engines"]) == 3 and "series" not in kv["engines"][0]
    # The table shows the same numbers as the JSON.
    assert f"{kv['cache_hit_rate']:.1%}" in proc.stdout
    assert f"{rr['cache_hit_rate']:.1%}" in proc.stdout

    # One engine: the single-engine report, whatever the router.
    one = _cli(*SMALL, "--engines", "1", "--router", "round-robin")
    plain = _cli(*SMALL)
    assert one.returncode == plain.returncode == 0
    strip = [
        line for line in one.stdout.splitlines() if "wall time" not in line and "µs" not in line
    ]
    assert strip == [
        line for line in plain.stdout.splitlines() if "wall time" not in line and "µs" not in line
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--compare-routers"],
            "--compare-routers compares how a fleet is routed; give --engines 2+",
        ),
        (["--engines", "2", "--compare-shares"], "--compare-shares shows one engine's run"),
        (["--engines", "65"], "each engine is a whole manager"),
        (["--engines", "2", "--router", "random"], "invalid choice: 'random'"),
        (
            ["--engines", "2", "--memory", "2MiB"],
            "all 78 requests were rejected: none can ever fit in 2.00 MiB of KV memory",
        ),
    ],
)
def test_cli_fleet_errors(args: list[str], message: str) -> None:
    proc = _cli(*SMALL, *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert proc.stdout == ""


def test_cli_knows_the_fleets_routers_and_bound() -> None:
    from kvcache.cli import commands as cli
    from kvcache.simulate import fleet

    assert cli._MAX_ENGINES == fleet.MAX_ENGINES
    proc = _cli("--help")
    assert "--router {" + ",".join(fleet.ROUTERS) + "}" in proc.stdout


def test_report_dict_round_trips_to_json() -> None:
    trace = default_workload(seed=1, num_conversations=6)
    report = simulate_fleet(trace, engines=2, router="least-loaded", model=MODEL)
    assert isinstance(report, FleetReport)
    d = json.loads(json.dumps(report.to_dict()))
    assert d["num_engines"] == 2 and d["router"] == "least-loaded"
    assert d["reused_token_share"] == pytest.approx(report.reused_tokens / report.context_tokens)
    assert {int(k): v for k, v in d["placement"].items()} == report.placement


def test_event_batcher_gives_the_publishers_payloads() -> None:
    model = kvcache.ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    config = kvcache.KvCacheConfig(
        tokens_per_block=4,
        backend="virtual",
        event_buffer_max_size=1000,
        max_attention_window=[8, 64],
        enable_partial_reuse=False,
    )
    with pytest.raises(ValueError, match="event_buffer_max_size > 0"):
        EventBatcher(
            kvcache.KVCacheManager.from_blocks(
                model,
                kvcache.KvCacheConfig(tokens_per_block=4, backend="virtual"),
                {64: 8},
                max_seq_len=64,
                max_batch_size=2,
            )
        )
    managers = [
        kvcache.KVCacheManager.from_blocks(
            model, config, {8: 16, 64: 16}, max_seq_len=64, max_batch_size=2
        )
        for _ in range(2)
    ]
    batcher = EventBatcher(managers[0])
    pub = ZmqEventPublisher(
        managers[1], "inproc://test-fleet-batcher", replay_endpoint="inproc://test-fleet-batcher-r"
    )
    assert batcher.batch() is None
    prompt = list(range(21))
    for kv in managers:
        kv.add_sequence(1, prompt)
        kv.remove_sequence(1)
    payload = batcher.batch()
    assert payload is not None and pub.publish() == 0
    replay = zmq.Context.instance().socket(zmq.DEALER)
    replay.connect("inproc://test-fleet-batcher-r")
    replay.send_multipart([b"", (0).to_bytes(8, "big")])
    _, _, _, sent = replay.recv_multipart()
    replay.close()
    pub.close()
    schema = wire_schema()
    ours = msgspec.msgpack.decode(payload, type=schema.KVEventBatch)
    theirs = msgspec.msgpack.decode(sent, type=schema.KVEventBatch)
    assert ours.events == theirs.events  # the same wire events (only ts differs)
    assert [type(e).__name__ for e in ours.events] == ["BlockStored", "BlockStored"]
    assert batcher.batch() is None and batcher.num_lost_events == 0
    index = KvIndexer()
    index.apply("e", payload)
    probe = [*range(20), 7]
    assert index.match("e", probe) == managers[0].get_reusable_prefix_length(probe) == 20
