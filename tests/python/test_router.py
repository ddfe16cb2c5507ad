"""kvcache.router: an index fed by engines' KV events that predicts each engine's reuse."""

from __future__ import annotations

import collections
import random
import time
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from fleet_helpers import advance_random_sequence, random_probe, sync_subscriber  # noqa: E402

import kvcache  # noqa: E402
from kvcache import KvCacheConfig, KVCacheManager, ModelConfig, OutOfBlocksError  # noqa: E402
from kvcache.events import END_SEQ, ZmqEventPublisher  # noqa: E402
from kvcache.router import KvIndexer, ZmqEventSubscriber  # noqa: E402

MODEL = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=4)
TPB = 4
SEED = 2026
STEPS = 600


def _manager(
    blocks: dict[int, Any],
    window: list[int | None] | None = None,
    policy: str = "placeholder",
    disk: Path | None = None,
) -> KVCacheManager:
    tier: dict[str, Any] = {}
    if disk is not None:  # sizes only validated: from_blocks takes exact counts
        tier = {"disk_cache_dir": str(disk), "host_cache_size": 1, "disk_cache_size": 1}
    config = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=window,
        backend="host",
        event_buffer_max_size=100_000,
        enable_partial_reuse=False,
        swa_reuse_policy=policy,
        **tier,
    )
    return KVCacheManager.from_blocks(MODEL, config, blocks, max_seq_len=64, max_batch_size=4)


def _stored(group: int, hashes: list[int], window: int | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": None,
        "token_ids": [0] * (TPB * len(hashes)),
        "block_size": TPB,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": group,
        "kv_cache_spec_kind": "full_attention" if window is None else "sliding_window",
        "kv_cache_spec_sliding_window": window,
    }


def test_block_hashes_are_the_hashes_events_carry() -> None:
    kv = _manager({64: 8})
    pub = ZmqEventPublisher(kv, "inproc://rt-hashes")
    prompt = list(range(100, 113))
    image = (b"cat", 2, 3)
    kv.add_sequence(1, prompt, lora_task_id=5, cache_salt="s", multimodal=[image])
    kv.remove_sequence(1)
    (stored,) = pub.convert(kv.get_latest_events())
    pub.close()
    want = kvcache.block_hashes(
        prompt[:12], TPB, lora_task_id=5, cache_salt="s", multimodal=[image]
    )
    assert stored.block_hashes == want and len(want) == 3
    # Only full blocks; each extra key changes the chain.
    assert (
        kvcache.block_hashes(prompt, TPB, lora_task_id=5, cache_salt="s", multimodal=[image])
        == want
    )
    assert kvcache.block_hashes(prompt[:12], TPB, lora_task_id=5, cache_salt="s")[0] != want[0]
    assert kvcache.block_hashes(prompt[:12], TPB, lora_task_id=5)[0] != want[0]
    assert kvcache.block_hashes(prompt[:3], TPB) == []
    with pytest.raises(ValueError, match="tokens_per_block = 0 is out of range"):
        kvcache.block_hashes(prompt, 0)
    with pytest.raises(ValueError, match=r"tokens\[1\] is negative"):
        kvcache.block_hashes([1, -2], 1)
    with pytest.raises(ValueError, match="lora_task_id must be an int"):
        kvcache.block_hashes(prompt, TPB, lora_task_id="x")  # type: ignore[arg-type]


def test_the_sliding_window_rule_from_events() -> None:
    # Group 0: a window of 8 tokens (2 blocks); group 1: full attention. A 25-token prompt is
    # keyed on 24 tokens: 6 blocks h0..h5.
    prompt = list(range(25))
    h = kvcache.block_hashes(prompt[:24], TPB)
    index = KvIndexer()
    index.apply("e", [_stored(1, h), _stored(0, h[3:], window=8)])
    assert index.match("e", prompt) == 24  # the window needs only blocks 4, 5
    assert index.match("e", prompt[:21]) == 20  # blocks 3, 4
    assert index.match("e", prompt[:17]) == 0  # 16 tokens need blocks 2, 3: 2 is gone
    index.apply(
        "e", [{"type": "BlockRemoved", "block_hashes": [h[4]], "medium": "GPU", "group_idx": 0}]
    )
    assert index.match("e", prompt) == 0  # every hit point now lacks a block of its window
    index.apply(
        "e", [{"type": "BlockRemoved", "block_hashes": [h[2]], "medium": "GPU", "group_idx": 1}]
    )
    index.apply("e", [_stored(0, h)])  # the window holds everything again
    assert index.match("e", prompt) == 8  # the full-attention group stops at block 2
    # A window of 9 tokens needs 3 blocks before the hit point.
    nine = KvIndexer()
    nine.apply("e", [_stored(1, h), _stored(0, h[3:], window=9)])
    assert nine.match("e", prompt) == 24 and nine.match("e", prompt[:21]) == 0
    # Two windows: each constrains the hit on its own.
    two = KvIndexer()
    two.apply("e", [_stored(0, h[4:], window=8), _stored(1, h[2:], window=16), _stored(2, h)])
    assert two.match("e", prompt) == 24 and two.match("e", prompt[:21]) == 0
    # The last prompt token is never reused; 0 or 1 tokens reuse nothing.
    assert index.match("e", []) == 0 and index.match("e", [0]) == 0


def test_a_block_counts_in_any_medium_until_its_last_copy_goes() -> None:
    prompt = list(range(9))
    h = kvcache.block_hashes(prompt[:8], TPB)
    index = KvIndexer()
    index.apply("e", [_stored(0, h)])
    host = dict(_stored(0, h[1:]), medium="CPU")
    index.apply("e", [host])  # a second copy of block 1, in host memory
    removed = {"type": "BlockRemoved", "block_hashes": [h[1]], "medium": "GPU", "group_idx": 0}
    index.apply("e", [removed])
    assert index.match("e", prompt) == 8  # still in host memory
    index.apply("e", [dict(removed, medium="CPU")])
    assert index.match("e", prompt) == 4
    index.apply("e", [{"type": "AllBlocksCleared"}])
    assert index.match("e", prompt) == 0 and index.num_blocks("e") == {0: 0}


def _shared(group: int, hashes: list[int], window: int | None = None) -> dict[str, Any]:
    return dict(_stored(group, hashes, window), medium="SHARED_STORAGE")


def test_the_shared_store_serves_every_reader_past_its_local_hit() -> None:
    # Group 0: a window of 8 tokens (2 blocks); group 1: full attention. 6 blocks h0..h5.
    prompt = list(range(25))
    h = kvcache.block_hashes(prompt[:24], TPB)
    index = KvIndexer()  # engines read the store only once known to
    index.add_engine("b", shared_tier=True)
    index.add_engine("c")
    # Engine a writes blocks 0..4 of both groups to the store (and holds them itself).
    index.apply(
        "a", [_stored(1, h[:5]), _stored(0, h[:5], 8), _shared(1, h[:5]), _shared(0, h[:5], 8)]
    )
    assert index.reads_shared_tier("a") and index.reads_shared_tier("b")
    assert not index.reads_shared_tier("c")  # nothing says it has a store
    assert index.num_blocks("a") == {1: 5, 0: 5}  # its own copies only
    assert index.num_shared_blocks() == {(TPB, None): 5, (TPB, 8): 5}
    # b has nothing itself (its groups come from the store's layout) and reads the store.
    assert index.match("b", prompt) == 20 and index.match("c", prompt) == 0
    assert index.match("a", prompt) == 20
    # b holds blocks 0..1 itself: the store continues from there.
    index.apply("b", [_stored(1, h[:2]), _stored(0, h[:2], 8)])
    assert index.match("b", prompt) == 20
    # The store lacks the window's block 2: past b's local hit of 2 blocks, full attention
    # needs 2..h-1 from the store and the window its last 2 blocks: h = 3 needs window block
    # 2 (gone), h = 4 needs 2..3 (2 gone), h = 5 needs 3..4: served.
    index.apply(
        "a",
        [
            {
                "type": "BlockRemoved",
                "block_hashes": [h[2]],
                "medium": "SHARED_STORAGE",
                "group_idx": 0,
            }
        ],
    )
    assert index.match("b", prompt) == 20 and index.match("b", prompt[:17]) == 8
    # The window's block 2 is back; a full-attention gap at 3 stops the hit before it.
    index.apply(
        "a",
        [
            _shared(0, [h[2]], 8),
            {
                "type": "BlockRemoved",
                "block_hashes": [h[3]],
                "medium": "SHARED_STORAGE",
                "group_idx": 1,
            },
        ],
    )
    assert index.match("b", prompt) == 12
    # The engine's own events never touch the store, nor does forgetting an engine.
    index.apply("a", [{"type": "AllBlocksCleared"}])
    index.remove_engine("a")
    assert index.match("b", prompt) == 12
    index.add_engine("c", shared_tier=True)
    assert index.match("c", prompt) == 12
    index.add_engine("c", shared_tier=False)  # declared: no store
    assert index.match("c", prompt) == 0
    # A flushed store: the index is told.
    index.clear_shared_tier()
    assert index.match("b", prompt) == 8 and index.num_shared_blocks() == {}
    # A store block is not the writer's own: gone from its pool, only the store serves it.
    w = KvIndexer()
    w.add_engine("x", shared_tier=False)
    w.apply("x", [_stored(0, h), _shared(0, h)])
    w.apply("x", [{"type": "BlockRemoved", "block_hashes": h[3:], "medium": "GPU", "group_idx": 0}])
    assert w.match("x", prompt) == 12
    w.add_engine("x", shared_tier=True)
    assert w.match("x", prompt) == 24
    # LoRA names: a reader resolves a name another engine's store blocks carried.
    lora = kvcache.block_hashes(prompt[:24], TPB, lora_task_id=7)
    named = dict(_shared(0, lora), lora_id=7, lora_name="sql")
    w.apply("y", [named])
    assert w.match("x", prompt, lora_name="sql") == 24
    with pytest.raises(ValueError, match="shared_tier must be a bool"):
        KvIndexer(shared_tier=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="shared_tier must be a bool or None"):
        w.add_engine("x", shared_tier="yes")  # type: ignore[arg-type]


def test_apply_takes_both_wire_forms_raw_or_decoded() -> None:
    kv = _manager({8: 8, 64: 8}, window=[8, None])
    pubs = [
        ZmqEventPublisher(kv, "inproc://rt-map", "inproc://rt-map-r"),
        ZmqEventPublisher(kv, "inproc://rt-arr", "inproc://rt-arr-r", event_format="array"),
    ]
    prompt = list(range(50, 67))
    kv.add_sequence(1, prompt)
    kv.remove_sequence(1)
    events = kv.get_latest_events()
    payloads = []
    for pub in pubs:
        batch = pub._schema.KVEventBatch(ts=1.0, events=pub.convert(events))
        payloads.append(msgspec.msgpack.encode(batch))
        pub.close()
    assert isinstance(msgspec.msgpack.decode(payloads[0])[1][0], dict)
    assert isinstance(msgspec.msgpack.decode(payloads[1])[1][0], list)
    want = kv.get_reusable_prefix_length(prompt)
    assert want == 16
    decoded = [msgspec.msgpack.decode(p) for p in payloads]
    for payload in (*payloads, *decoded, tuple(decoded[1])):
        index = KvIndexer()
        index.apply("e", payload)
        assert index.match("e", prompt) == want
        assert index.num_blocks("e") == {0: 4, 1: 4}
    # A bad payload raises and applies nothing.
    index = KvIndexer()
    index.apply("e", payloads[0])
    cleared = {"type": "AllBlocksCleared"}
    for events, match in (
        ([cleared, ["Bogus", 1]], "unknown KV event"),
        ([cleared, {"type": "Bogus"}], "unknown KV event type 'Bogus'"),
        ([cleared, {"type": "BlockRemoved", "block_hashes": [[1]]}], "block_hashes must be"),
        ([cleared, dict(_stored(0, [1]), block_size=0)], "block_size must be an int >= 1"),
        (
            [cleared, dict(_stored(0, [1], 8), kv_cache_spec_sliding_window=None)],
            "kv_cache_spec_sliding_window must be an int >= 1",
        ),
        ([cleared, dict(_stored(0, [1]), group_idx=-1)], "group_idx must be"),
    ):
        with pytest.raises(ValueError, match=match):
            index.apply("e", msgspec.msgpack.encode([1.0, events, None]))
    with pytest.raises(ValueError, match="not a msgpack KVEventBatch"):
        index.apply("e", b"\xc1")
    assert index.match("e", prompt) == want


def test_lora_and_cache_salt() -> None:
    kv = _manager({64: 16})
    pub = ZmqEventPublisher(kv, "inproc://rt-lora", lora_names={5: "sql"})
    prompt = list(range(13))
    kv.add_sequence(1, prompt, lora_task_id=5)
    kv.remove_sequence(1)
    kv.add_sequence(2, prompt, cache_salt="tenant-a")
    kv.remove_sequence(2)
    index = KvIndexer()
    index.apply("e", pub.convert(kv.get_latest_events()))
    pub.close()
    cases: list[tuple[dict[str, Any], dict[str, Any], int]] = [
        ({}, {}, 0),
        ({"lora_name": "sql"}, {"lora_task_id": 5}, 12),
        ({"lora_id": 5}, {"lora_task_id": 5}, 12),
        ({"lora_id": 6}, {"lora_task_id": 6}, 0),
        ({"cache_salt": "tenant-a"}, {"cache_salt": "tenant-a"}, 12),
        ({"cache_salt": "tenant-b"}, {"cache_salt": "tenant-b"}, 0),
    ]
    for router_kw, engine_kw, want in cases:
        assert index.match("e", prompt, **router_kw) == want
        assert kv.get_reusable_prefix_length(prompt, **engine_kw) == want
    assert index.match("e", prompt, lora_name="unknown") == 0
    # Multimodal items are part of the keys too.
    image = (b"img", 5, 3)  # positions 5-7: blocks 1 and 2 carry it
    kv.add_sequence(3, prompt, multimodal=[image])
    kv.remove_sequence(3)
    with ZmqEventPublisher(kv, "inproc://rt-mm") as mm_pub:
        index.apply("e", mm_pub.convert(kv.get_latest_events()))
    # Block 0 holds no item, so every prompt shares it; block 1 differs from there on.
    for items, want in (([image], 12), ([(b"other", 5, 3)], 4), ([(b"img", 4, 3)], 4), ([], 4)):
        assert index.match("e", prompt, multimodal=items) == want
        assert kv.get_reusable_prefix_length(prompt, multimodal=items) == want
    with pytest.raises(ValueError, match="not both"):
        index.match("e", prompt, lora_name="sql", lora_id=5)


def test_best_engine_breaks_ties_on_load() -> None:
    prompt = list(range(13))
    h = kvcache.block_hashes(prompt[:12], TPB)
    index = KvIndexer()
    index.apply("a", [_stored(0, h[:2])])
    index.apply("b", [_stored(0, h[:3])])
    index.apply("c", [_stored(0, h[:3])])
    assert index.engines == ["a", "b", "c"]
    assert index.best_engine(prompt) == ("b", 12)  # equal hits, equal load: first heard of
    assert index.best_engine(prompt, load={"b": 3, "c": 1}) == ("c", 12)
    assert index.best_engine(prompt, load=lambda e: {"b": 1, "c": 2}.get(e, 0)) == ("b", 12)
    assert index.best_engine(prompt, engines=["a"]) == ("a", 8)
    # No hit anywhere: the least loaded engine.
    assert index.best_engine([7, 7, 7, 7, 7], load={"a": 2, "b": 1, "c": 2}) == ("b", 0)
    index.remove_engine("b")
    assert index.best_engine(prompt, load={"c": 5}) == ("c", 12)
    with pytest.raises(KeyError):
        index.remove_engine("b")
    with pytest.raises(KeyError):
        index.match("b", prompt)
    with pytest.raises(ValueError, match="no engine"):
        KvIndexer().best_engine(prompt)


def test_randomized_workload_match_equals_each_engines_rule(tmp_path: Path) -> None:
    rng = random.Random(SEED)
    engines = {
        "a": _manager({8: (5, 3, 4), 64: (12, 6, 6)}, window=[8, None], disk=tmp_path),
        "b": _manager({8: (6, 2), 16: (6, 2), 64: (12, 4)}, window=[8, 16, None]),
        "c": _manager({6: (8, 4), 10: (8, 4)}, window=[6, 10], policy="invalidate"),
    }
    pubs = {
        name: ZmqEventPublisher(kv, f"inproc://rt-{name}", f"inproc://rt-{name}-r", topic="kv")
        for name, kv in engines.items()
    }
    media: collections.Counter[str] = collections.Counter()

    class CountingIndexer(KvIndexer):
        """Tallies the media of the stored blocks it applies."""

        def apply(self, engine_id: Any, payload: Any) -> None:
            super().apply(engine_id, payload)
            for e in msgspec.msgpack.decode(payload)[1] if isinstance(payload, bytes) else []:
                if e["type"] == "BlockStored":
                    media[e["medium"]] += len(e["block_hashes"])

    index = CountingIndexer()
    sub = ZmqEventSubscriber(
        index, {n: (f"inproc://rt-{n}", f"inproc://rt-{n}-r") for n in engines}, topic="kv"
    )
    bases = [[rng.randrange(1000) for _ in range(28)] for _ in range(4)]
    keys: list[dict[str, Any]] = [{}, {"lora_task_id": 3}, {"cache_salt": "x"}]
    live: dict[str, dict[int, int]] = {n: {} for n in engines}  # request -> tokens left
    next_id = 0
    probes = hits = 0
    try:
        for _ in range(STEPS):
            name = rng.choice(list(engines))
            kv = engines[name]
            op = rng.random()
            if op < 0.35 and len(live[name]) < 2:
                base = rng.choice(bases)
                prompt = base[: rng.randrange(2, 24)] + [
                    rng.randrange(1000) for _ in range(rng.randrange(3))
                ]
                kw = dict(rng.choice(keys))
                if len(prompt) > 5 and rng.random() < 0.3:
                    kw["prefill"] = 4  # chunked prefill: 4 tokens now, the rest later
                try:
                    kv.add_sequence(next_id, prompt, **kw)
                    live[name][next_id] = rng.randrange(1, 12)
                except OutOfBlocksError:
                    pass
                next_id += 1
            elif op < 0.75 and live[name]:
                advance_random_sequence(kv, live[name], rng, bases[0][0])
            elif live[name]:
                rid = rng.choice(list(live[name]))
                kv.remove_sequence(rid)
                del live[name][rid]
            for pub in pubs.values():
                pub.publish()
            sync_subscriber(sub, pubs)
            for probe_engine, probe_kv in engines.items():
                for _ in range(4):
                    prompt, key, router_key = random_probe(rng, keys, bases)
                    want = probe_kv.get_reusable_prefix_length(prompt, **key)
                    got = index.match(probe_engine, prompt, **router_key)
                    assert got == want, (probe_engine, prompt, key, got, want)
                    probes += 1
                    hits += want > 0
        stats = {n: kv.get_kv_cache_stats() for n, kv in engines.items()}
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()
    # The workload reached what it is meant to exercise.
    assert probes == STEPS * 3 * 4 and hits > STEPS
    assert all(s.offloaded_blocks > 0 and s.onboarded_blocks > 0 for s in stats.values())
    assert media["DISK"] > 0 and media["CPU"] > 0  # blocks in every tier were matched
    assert sub.num_unrecoverable_gaps == 0


def _flush(pub: ZmqEventPublisher) -> None:
    """Returns once the publisher's thread has sent every batch published so far (it sends
    them all before it answers a replay request)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(pub.replay_endpoint)
    sock.send_multipart([b"", (2**62).to_bytes(8, "big")])
    assert sock.poll(20_000)
    assert sock.recv_multipart()[-2] == END_SEQ  # either framing
    sock.close(linger=0)


@pytest.mark.parametrize("event_format", ["map", "array"])
def test_subscriber_fills_gaps_from_replay_and_clears_what_it_cannot(event_format: str) -> None:
    kv = _manager({64: 64})
    pub = ZmqEventPublisher(
        kv, "inproc://rt-gap", "inproc://rt-gap-r", buffer_steps=4, event_format=event_format
    )
    prompts = [[1000 * r + t for t in range(9)] for r in range(8)]
    for r in range(3):  # nobody listens yet
        kv.add_sequence(r, prompts[r])
        kv.remove_sequence(r)
        pub.publish()
    _flush(pub)  # sent to nobody
    index = KvIndexer()
    sub = ZmqEventSubscriber(index, {"e": ("inproc://rt-gap", "inproc://rt-gap-r")})
    try:
        sync_subscriber(sub, {"e": pub})
        assert sub.last_seq("e") == 2 and sub.num_unrecoverable_gaps == 0
        assert sub.num_replays >= 1  # everything came from replay
        assert [index.match("e", p) for p in prompts[:3]] == [8, 8, 8]
        # A subscriber that misses more than the ring holds: the engine is cleared, and the
        # index under-estimates it from then on (never over-estimates).
        for r in range(3, 8):
            kv.add_sequence(r, prompts[r])
            kv.remove_sequence(r)
            pub.publish()
        _flush(pub)
        late = KvIndexer()
        late_sub = ZmqEventSubscriber(late, {"e": ("inproc://rt-gap", "inproc://rt-gap-r")})
        sync_subscriber(late_sub, {"e": pub})
        assert late_sub.num_unrecoverable_gaps == 1 and late_sub.last_seq("e") == 7
        got = [late.match("e", p) for p in prompts]
        assert got == [0, 0, 0, 0, 8, 8, 8, 8]  # batches 4-7 from the ring of 4
        assert all(kv.get_reusable_prefix_length(p) == 8 for p in prompts)
        late_sub.close()
    finally:
        sub.close()
        pub.close()


def test_subscriber_bad_arguments() -> None:
    index = KvIndexer()
    for engines, match in (
        ({}, "at least one engine"),
        ({"e": "tcp://x:1"}, "expected \\(endpoint, replay_endpoint\\)"),
        ({"e": ("garbage", None)}, "endpoint must be a ZeroMQ address"),
        ({"e": ("inproc://x", "garbage")}, "replay_endpoint must be a ZeroMQ address"),
    ):
        with pytest.raises(ValueError, match=match):
            ZmqEventSubscriber(index, engines)
    with pytest.raises(ValueError, match="replay_timeout_s"):
        ZmqEventSubscriber(index, {"e": ("inproc://x", None)}, replay_timeout_s=0)
    assert index.engines == []  # nothing registered by a failed construction


def test_a_background_subscriber_catches_up_with_a_quiet_stream() -> None:
    kv = _manager({8: 8, 64: 16}, window=[8, None])
    pub = ZmqEventPublisher(kv, "inproc://rt-bg", "inproc://rt-bg-r")
    prompt = list(range(300, 321))
    kv.add_sequence(1, prompt)
    kv.remove_sequence(1)
    pub.publish()
    _flush(pub)  # sent before anyone subscribed, and nothing follows it
    index = KvIndexer()
    sub = ZmqEventSubscriber(index, {"e": ("inproc://rt-bg", "inproc://rt-bg-r")}, catch_up_s=0.2)
    sub.start()
    try:
        deadline = time.monotonic() + 20
        while index.match("e", prompt) != 20:  # the thread asks the replay socket
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert kv.get_reusable_prefix_length(prompt) == 20
        assert sub.last_seq("e") == 0 and sub.num_replays >= 1
    finally:
        sub.close()
        pub.close()


def test_a_rejected_batch_clears_its_engine_and_the_stream_goes_on() -> None:
    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.bind("inproc://rt-raw")
    index = KvIndexer()
    sub = ZmqEventSubscriber(index, {"e": ("inproc://rt-raw", None)})
    try:
        h = kvcache.block_hashes(list(range(8)), TPB)
        good = msgspec.msgpack.encode([1.0, [_stored(0, h)], None])
        bad = msgspec.msgpack.encode([1.0, [{"type": "Bogus"}], None])
        deadline = time.monotonic() + 20
        while sub.last_seq("e") is None:  # the slow joiner: resend batch 0 until it arrives
            assert time.monotonic() < deadline
            pub.send_multipart([b"", (0).to_bytes(8, "big"), good])
            sub.poll(20)
        assert index.match("e", list(range(9))) == 8
        pub.send_multipart([b"", b"short"])  # malformed: ignored
        pub.send_multipart([b"", (1).to_bytes(8, "big"), bad])
        pub.send_multipart([b"", (2).to_bytes(8, "big"), good])
        while sub.last_seq("e") != 2:
            assert time.monotonic() < deadline
            sub.poll(20)
        assert sub.num_unrecoverable_gaps == 1
        assert index.match("e", list(range(9))) == 8  # cleared at batch 1, stored again at 2
    finally:
        sub.close()
        pub.close(linger=0)


def test_hundreds_of_engines_in_one_native_lookup_and_hashes_of_every_kind() -> None:
    prompt = list(range(41))  # keyed on 40 tokens: 10 blocks
    h = kvcache.block_hashes(prompt[:40], TPB)
    index = KvIndexer()
    want: dict[Any, int] = {}
    for e in range(300):
        held = e % 11
        payload = msgspec.msgpack.encode([1.0, [_stored(0, [*h[:held], h[9]])], 0])
        index.apply(("engine", e), payload if e % 2 else msgspec.msgpack.decode(payload))
        want[("engine", e)] = 4 * (10 if held >= 9 else held)
    assert index.scores(prompt) == want
    assert index.best_engine(prompt) == (("engine", 9), 40)
    for e in range(0, 300, 3):
        index.remove_engine(("engine", e))
    assert index.scores(prompt) == {k: v for k, v in want.items() if k[1] % 3}
    assert index.scores(prompt, engines=[("engine", 4), ("engine", 4)]) == {("engine", 4): 16}
    # Hashes an engine may send besides the core's: bytes, negative and big ints are keys of
    # their own (counted, removed), never equal to a prompt's block.
    odd: list[Any] = [b"\x01", b"\x01", -5, 2**70, 5, h[0]]
    index.apply("odd", [dict(_stored(0, odd), medium="CPU")])
    assert index.num_blocks("odd") == {0: 5}
    assert index.match("odd", prompt) == 4
    index.apply(
        "odd", [{"type": "BlockRemoved", "block_hashes": [b"\x01", 2**70, -5], "medium": None}]
    )
    assert index.num_blocks("odd") == {0: 2}
    raw = msgspec.msgpack.encode([1.0, [dict(_stored(0, [b"\x02", -7]), medium="CPU")], 0])
    index.apply("odd", raw)
    assert index.num_blocks("odd") == {0: 4}
    index.apply(
        "odd",
        [{"type": "BlockRemoved", "block_hashes": [b"\x02", -7], "medium": "CPU", "group_idx": 0}],
    )
    assert index.num_blocks("odd") == {0: 2}
