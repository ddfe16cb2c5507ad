"""kvcache.router attacked from outside: an engine that restarts, batches that are malformed
in every field the index reads, repeated batches, and prompts checked before any lookup."""

from __future__ import annotations

import math
import random
import socket
import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from test_router import TPB, _manager, _stored  # noqa: E402

import kvcache  # noqa: E402
from kvcache.events import ZmqEventPublisher  # noqa: E402
from kvcache.router import KvIndexer, ZmqEventSubscriber  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve(kv: kvcache.KVCacheManager, prompts: list[list[int]], first: int = 0) -> None:
    """Requests ``first ..`` run ``prompts`` and end: their blocks are stored."""
    for r, p in enumerate(prompts, first):
        kv.add_sequence(r, p)
        kv.remove_sequence(r)


def test_an_engine_that_restarts_is_cleared_and_followed_again() -> None:
    port, replay = _free_port(), _free_port()
    old_prompts = [[1000 * r + t for t in range(9)] for r in range(5)]
    new_prompts = [[5000 + 1000 * r + t for t in range(9)] for r in range(40)]
    old = _manager({64: 64})
    pub = ZmqEventPublisher(old, f"tcp://*:{port}", f"tcp://*:{replay}")
    index = KvIndexer()
    sub = ZmqEventSubscriber(index, {"e": (f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")})
    try:
        deadline = time.monotonic() + 30
        for r, p in enumerate(old_prompts):
            _serve(old, [p], r)
            pub.publish()
        while sub.last_seq("e") != 4:
            assert time.monotonic() < deadline
            if sub.poll(20) == 0:
                sub.catch_up("e")
        assert [index.match("e", p) for p in old_prompts] == [8] * 5
        pub.close()
        # The engine restarts: a fresh manager, a fresh publisher on the same ports, numbering
        # from 0 again. Before, every batch <= 4 was dropped as "already applied": the index
        # kept the dead engine's blocks and never learnt the new ones.
        new = _manager({64: 64})
        while True:  # the old publisher's thread releases the ports as it closes
            try:
                pub = ZmqEventPublisher(new, f"tcp://*:{port}", f"tcp://*:{replay}")
                break
            except zmq.ZMQError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
        served = 0
        while sub.num_restarts == 0:  # until the SUB socket reconnected and heard one
            assert time.monotonic() < deadline and served < len(new_prompts)
            _serve(new, [new_prompts[served]], served)
            pub.publish()
            served += 1
            sub.poll(50)
        while sub.last_seq("e") != served - 1:
            assert time.monotonic() < deadline
            if sub.poll(20) == 0:
                sub.catch_up("e")
        assert sub.num_restarts == 1
        for p in old_prompts + new_prompts:
            assert index.match("e", p) == new.get_reusable_prefix_length(p)
        assert [index.match("e", p) for p in new_prompts[:served]] == [8] * served
        assert [index.match("e", p) for p in old_prompts] == [0] * 5
        assert index.num_blocks("e") == {0: 2 * served}
    finally:
        sub.close()
        pub.close()


def _raw_pair(name: str) -> tuple[Any, KvIndexer, ZmqEventSubscriber]:
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.bind(f"inproc://{name}")
    index = KvIndexer()
    return pub, index, ZmqEventSubscriber(index, {"e": (f"inproc://{name}", None)})


def _send_until_applied(pub: Any, sub: ZmqEventSubscriber, seq: int, payload: bytes) -> None:
    deadline = time.monotonic() + 20
    while sub.last_seq("e") != seq:  # the slow joiner: resend until it arrives
        assert time.monotonic() < deadline
        pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])
        sub.poll(20)


def test_a_repeated_batch_is_a_duplicate_and_a_sequence_that_goes_back_a_restart() -> None:
    pub, index, sub = _raw_pair("rf-dup")
    try:
        a, b = list(range(9)), list(range(50, 59))
        batch_a = msgspec.msgpack.encode([1.0, [_stored(0, kvcache.block_hashes(a[:8], TPB))], 0])
        batch_b = msgspec.msgpack.encode([2.0, [_stored(0, kvcache.block_hashes(b[:8], TPB))], 0])
        _send_until_applied(pub, sub, 0, batch_a)  # also sends batch 0 more than once
        _send_until_applied(pub, sub, 1, batch_b)
        for _ in range(3):  # the same bytes again: dropped
            pub.send_multipart([b"", (0).to_bytes(8, "big"), batch_a])
        time.sleep(0.05)
        while sub.poll(20):
            pass
        assert (sub.num_restarts, sub.last_seq("e")) == (0, 1)
        assert (index.match("e", a), index.match("e", b)) == (8, 8)
        # Batch 0 with other bytes: a new engine behind the same address.
        pub.send_multipart([b"", (0).to_bytes(8, "big"), batch_b])
        deadline = time.monotonic() + 20
        while sub.num_restarts == 0:
            assert time.monotonic() < deadline
            sub.poll(20)
        assert sub.last_seq("e") == 0
        assert (index.match("e", a), index.match("e", b)) == (0, 8)
    finally:
        sub.close()
        pub.close(linger=0)


def _good(hashes: list[int]) -> dict[str, Any]:
    return _stored(0, hashes)


BAD_FIELDS: list[tuple[str, Any, str]] = [
    ("medium", ["GPU"], "medium must be a str or None"),
    ("medium", {"GPU": 1}, "medium must be a str or None"),
    ("lora_id", "7", "lora_id must be an int or None"),
    ("lora_id", math.nan, "lora_id must be an int or None"),
    ("lora_id", True, "lora_id must be an int or None"),
    ("lora_name", 3, "lora_name must be a str or None"),
    ("group_idx", True, "group_idx must be an int >= 0 or None"),
    ("group_idx", 1.0, "group_idx must be an int >= 0 or None"),
    ("block_size", "4", "block_size must be an int >= 1"),
    ("block_hashes", [1, [2]], "block_hashes must be a list of ints or bytes"),
    ("block_hashes", [True], "block_hashes must be a list of ints or bytes"),
    ("kv_cache_spec_kind", ["x"], "kv_cache_spec_kind must be a str or None"),
    ("kv_cache_spec_sliding_window", "8", "kv_cache_spec_sliding_window must be an int >= 1"),
    ("type", ["BlockStored"], "unknown KV event type"),
    ("type", {"a": 1}, "unknown KV event type"),
]


@pytest.mark.parametrize(("field", "value", "message"), BAD_FIELDS)
def test_a_batch_with_one_bad_field_is_refused_whole(field: str, value: Any, message: str) -> None:
    prompt = list(range(9))
    hashes = kvcache.block_hashes(prompt[:8], TPB)
    bad = _good(hashes)
    if field == "kv_cache_spec_sliding_window":
        bad["kv_cache_spec_kind"] = "sliding_window"
    bad[field] = value
    index = KvIndexer()
    index.add_engine("e")
    for payload in (
        [_good(hashes[:1]), bad],  # a list of events
        msgspec.msgpack.encode([1.0, [_good(hashes[:1]), bad], 0]),  # raw, map form
    ):
        with pytest.raises(ValueError, match=rf"event 1\b.*{message}"):
            index.apply("e", payload)
        assert index.num_blocks("e") == {}  # not even the good event before it
        assert index.match("e", prompt) == 0


@pytest.mark.parametrize(
    "event",
    [[["BlockStored"], [1], None], [{"x": 1}], [], 7],
    ids=["unhashable-tag", "map-tag", "empty", "not-an-event"],
)
def test_an_array_event_with_a_bad_tag_is_a_value_error(event: Any) -> None:
    index = KvIndexer()
    with pytest.raises(ValueError, match="event 0: unknown KV event"):
        index.apply("e", msgspec.msgpack.encode([1.0, [event], 0]))
    assert index.engines == []


def test_a_malformed_batch_through_the_subscriber_is_counted_and_never_raises() -> None:
    pub, index, sub = _raw_pair("rf-bad")
    try:
        prompt = list(range(9))
        hashes = kvcache.block_hashes(prompt[:8], TPB)
        _send_until_applied(pub, sub, 0, msgspec.msgpack.encode([1.0, [_good(hashes)], 0]))
        assert index.match("e", prompt) == 8
        bad = _good(hashes)
        bad["medium"] = {"GPU": 1}  # a TypeError (unhashable) escaped poll() before
        pub.send_multipart([b"", (1).to_bytes(8, "big"), msgspec.msgpack.encode([2.0, [bad], 0])])
        deadline = time.monotonic() + 20
        while sub.last_seq("e") != 1:
            assert time.monotonic() < deadline
            sub.poll(20)
        assert (sub.num_rejected_batches, sub.num_unrecoverable_gaps) == (1, 1)
        assert index.match("e", prompt) == 0  # the engine's state is unknown: cleared
    finally:
        sub.close()
        pub.close(linger=0)


@pytest.mark.parametrize("prompt", [["a", "b"], [1, -2], [2**40], [1.0, 2.0]])
def test_prompts_are_checked_before_an_engine_announced_anything(prompt: list[Any]) -> None:
    index = KvIndexer()
    index.add_engine("e")
    with pytest.raises(ValueError, match="tokens"):
        index.match("e", prompt)
    with pytest.raises(ValueError, match="tokens"):
        index.best_engine(prompt)
    assert index.match("e", [1, 2, 3]) == 0


def test_scores_gives_every_engines_match_at_once_and_stops_at_the_first_miss() -> None:
    engines = {
        "full": _manager({64: 64}),
        "swa": _manager({8: 32, 64: 64}, window=[8, None]),
        "empty": _manager({64: 8}),
    }
    index = KvIndexer()
    pubs = {
        name: ZmqEventPublisher(kv, f"inproc://rf-scores-{name}") for name, kv in engines.items()
    }
    try:
        rng = random.Random(7)
        prompts = [[rng.randrange(50) for _ in range(rng.randrange(2, 30))] for _ in range(40)]
        for name, kv in engines.items():
            if name == "empty":
                index.add_engine(name)
                continue
            for r, p in enumerate(prompts[:20]):
                kv.add_sequence(r, p)
                kv.remove_sequence(r)
            index.apply(name, pubs[name].convert(kv.get_latest_events()))
        for p in prompts:
            got = index.scores(p)
            assert list(got) == ["full", "swa", "empty"]
            assert got == {name: kv.get_reusable_prefix_length(p) for name, kv in engines.items()}
            assert got == {name: index.match(name, p) for name in engines}
        assert index.scores(prompts[0], engines=["swa"]) == {"swa": index.match("swa", prompts[0])}
        with pytest.raises(ValueError, match="tokens"):
            KvIndexer().scores(["x"])
    finally:
        for pub in pubs.values():
            pub.close()
