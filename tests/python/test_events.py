"""ZmqEventPublisher: vLLM's KV event wire format on loopback, replay, no loss under load."""

from __future__ import annotations

import time
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig  # noqa: E402
from kvcache.events import (  # noqa: E402
    END_SEQ,
    MAX_BUFFER_STEPS,
    MAX_HWM,
    ZmqEventPublisher,
    offset_endpoint_port,
)
from kvcache.resource_manager import (  # noqa: E402
    KVCacheResourceManager,
    Request,
    ScheduledBatch,
)

TIMEOUT_MS = 20_000  # only a hang guard; nothing asserts on time
MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)


# vLLM 0.32's wire schema, written here from its documented field lists (not kvcache's
# structs): events are tagged maps, fields equal to their default omitted. Unknown fields are
# rejected, so kvcache can send nothing vLLM's decoder would not expect.
class VEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class VBlockStored(VEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class VBlockRemoved(VEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class VAllBlocksCleared(VEvent, tag="AllBlocksCleared"):
    pass


class VBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]
    data_parallel_rank: int | None = None


# The older array form, also written here: every field present, in this order.
class AEvent(msgspec.Struct, array_like=True, gc=False, tag=True, forbid_unknown_fields=True):
    pass


class ABlockStored(AEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class ABlockRemoved(AEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None


class AAllBlocksCleared(AEvent, tag="AllBlocksCleared"):
    pass


class ABatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ABlockStored | ABlockRemoved | AAllBlocksCleared]
    data_parallel_rank: int | None


V_DECODER = msgspec.msgpack.Decoder(VBatch)
A_DECODER = msgspec.msgpack.Decoder(ABatch)


def _manager(
    blocks: dict[int, Any], window: list[int | None] | None = None, events: int = 10_000
) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=window,
        backend="host",
        event_buffer_max_size=events,
    )
    return KVCacheManager.from_blocks(MODEL, config, blocks, max_seq_len=64, max_batch_size=8)


class Subscriber:
    """A SUB socket on loopback that decodes with the test's own vLLM schema."""

    def __init__(self, endpoint: str, topic: str = "", array_like: bool = False) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.decoder = A_DECODER if array_like else V_DECODER
        self.topic = topic.encode()

    def recv(self, timeout_ms: int = TIMEOUT_MS) -> tuple[int, Any, bytes] | None:
        if not self.sock.poll(timeout_ms):
            return None
        topic, seq, payload = self.sock.recv_multipart()
        assert topic == self.topic and len(seq) == 8
        return int.from_bytes(seq, "big"), self.decoder.decode(payload), payload

    def close(self) -> None:
        self.sock.close(linger=0)


def _wait_connected(
    pub: ZmqEventPublisher, sub: Subscriber, kv: KVCacheManager
) -> tuple[int, Any, bytes]:
    """Publishes single-event steps until the subscriber sees one (ZeroMQ's slow joiner);
    returns the first (seq, batch, payload) it got."""
    rid = 10_000
    while True:
        kv.add_sequence(rid, [7_000_000 + rid] * 5)
        kv.remove_sequence(rid)  # stores one full block
        rid += 1
        assert pub.publish() is not None
        got = sub.recv(50)
        if got is not None:
            return got


def _replay(endpoint: str, start: int, topic: bytes | None = b"") -> list[tuple[int, bytes]]:
    """Every (seq, payload) of a replay answer read by a DEALER, checking each frame: with
    ``topic`` (the map form) ``[b"", topic, seq, payload]`` and ``[b"", b"", END_SEQ, b""]``,
    without (``None``, the array form) ``[b"", seq, payload]`` and ``[b"", END_SEQ, b""]``."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(TIMEOUT_MS)
            frames = sock.recv_multipart()
            if topic is None:
                empty, seq, payload = frames
            else:
                empty, got_topic, seq, payload = frames
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b"" and (topic is None or got_topic == b"")
                return out
            assert topic is None or got_topic == topic
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def _as_tuples(events: list[Any]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in events:
        name = type(e).__name__.removeprefix("V")
        if name == "BlockStored":
            out.append((name, e.medium, e.block_hashes, e.parent_block_hash, e.group_idx))
        elif name == "BlockRemoved":
            out.append((name, e.medium, e.block_hashes, e.group_idx))
        else:
            out.append((name,))
    return out


def test_stores_removals_offloads_and_onboards_arrive_in_order() -> None:
    kv = _manager({64: (4, 4)})
    pub = ZmqEventPublisher(kv, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*")
    a = list(range(100, 109))  # 2 full key blocks + 1 token
    b = list(range(200, 213))  # 3 full key blocks + 1 token
    # Step 0: store A.
    kv.add_sequence(1, a)
    kv.remove_sequence(1)
    assert pub.publish() == 0
    # Step 1: B takes every primary block: A's two blocks go to host memory. Then B is stored.
    kv.add_sequence(2, b)
    kv.remove_sequence(2)
    assert pub.publish() == 1
    # Step 2: A again: a hit in host memory, onboarded into B's free last block, then into
    # B's tail block, which goes to host memory, and A's last block takes B's middle one.
    assert kv.add_sequence(3, a) == 8
    assert pub.publish() == 2
    assert pub.publish() is None  # an empty step sends nothing
    batches = _replay(str(pub.replay_endpoint), 0)
    pub.close()
    assert [seq for seq, _ in batches] == [0, 1, 2]
    decoded = [V_DECODER.decode(p) for _, p in batches]
    assert all(d.data_parallel_rank is None for d in decoded)

    (s0,) = decoded[0].events
    a0, a1 = s0.block_hashes
    assert _as_tuples(decoded[0].events) == [("BlockStored", "GPU", [a0, a1], None, 0)]
    assert s0.token_ids == a[:8] and s0.block_size == 4 and s0.lora_id is None
    assert s0.kv_cache_spec_kind == "full_attention" and s0.kv_cache_spec_sliding_window is None
    ev1 = decoded[1].events
    b_hashes = ev1[-1].block_hashes
    assert _as_tuples(ev1) == [
        ("BlockRemoved", "GPU", [a1], 0),
        ("BlockStored", "CPU", [a1], a0, 0),
        ("BlockRemoved", "GPU", [a0], 0),
        ("BlockStored", "CPU", [a0], None, 0),
        ("BlockStored", "GPU", b_hashes, None, 0),
    ]
    assert len(b_hashes) == 3 and ev1[1].token_ids == a[4:8] and ev1[4].token_ids == b[:12]
    b0, b1, b2 = b_hashes
    assert _as_tuples(decoded[2].events) == [
        ("BlockRemoved", "CPU", [a0], 0),
        ("BlockStored", "GPU", [a0], None, 0),
        ("BlockRemoved", "GPU", [b2], 0),
        ("BlockStored", "CPU", [b2], b1, 0),
        ("BlockRemoved", "CPU", [a1], 0),
        ("BlockStored", "GPU", [a1], a0, 0),
        ("BlockRemoved", "GPU", [b1], 0),
        ("BlockStored", "CPU", [b1], b0, 0),
    ]
    assert decoded[2].events[3].token_ids == b[8:12]

    # The raw payload is vLLM 0.32's: [ts, [{"type": tag, field: value...}], rank], the
    # fields in vLLM's order, those equal to their default (None) left out.
    raw = msgspec.msgpack.decode(batches[0][1])
    assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2] is None
    assert raw[1] == [
        {
            "type": "BlockStored",
            "block_hashes": [a0, a1],
            "parent_block_hash": None,
            "token_ids": a[:8],
            "block_size": 4,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        }
    ]
    assert list(raw[1][0]) == [
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "group_idx",
        "kv_cache_spec_kind",
    ]
    removed = msgspec.msgpack.decode(batches[1][1])[1][0]
    assert removed == {
        "type": "BlockRemoved",
        "block_hashes": [a1],
        "medium": "GPU",
        "group_idx": 0,
    }


def test_sliding_windows_and_the_older_array_form() -> None:
    kv = _manager({8: 8, 64: 8}, window=[8, None])
    pub = ZmqEventPublisher(
        kv, "inproc://kv-arr", replay_endpoint="inproc://kv-arr-r", event_format="array"
    )
    kv.add_sequence(1, list(range(9)))
    kv.remove_sequence(1)
    pub.publish()
    # The older replay answer has no topic frame.
    ((_, payload),) = _replay("inproc://kv-arr-r", 0, topic=None)
    pub.close()
    events = A_DECODER.decode(payload).events
    groups = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events]
    assert groups == [(0, "sliding_window", 8), (1, "full_attention", None)]
    h0, h1 = events[0].block_hashes
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0] == [
        "BlockStored",
        [h0, h1],
        None,
        list(range(8)),
        4,
        None,
        "GPU",
        None,
        None,
        0,
        "sliding_window",
        8,
    ]
    assert raw[1][1][9:] == [1, "full_attention", None]


def test_sliding_windows_in_the_map_form() -> None:
    kv = _manager({8: 8, 64: 8}, window=[8, None])
    pub = ZmqEventPublisher(kv, "inproc://kv-map", replay_endpoint="inproc://kv-map-r")
    kv.add_sequence(1, list(range(9)))
    kv.remove_sequence(1)
    pub.publish()
    ((_, payload),) = _replay("inproc://kv-map-r", 0)
    pub.close()
    events = V_DECODER.decode(payload).events
    groups = [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events]
    assert groups == [(0, "sliding_window", 8), (1, "full_attention", None)]
    raw = msgspec.msgpack.decode(payload)[1]
    assert raw[0]["kv_cache_spec_sliding_window"] == 8
    assert "kv_cache_spec_sliding_window" not in raw[1]  # None: omitted


def test_late_subscriber_recovers_missed_batches_through_replay() -> None:
    kv = _manager({64: 64})
    pub = ZmqEventPublisher(
        kv, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", data_parallel_rank=0
    )
    try:
        for r in range(20):  # nobody listens to these
            kv.add_sequence(r, [1000 * r + t for t in range(9)])
            kv.remove_sequence(r)
            assert pub.publish() == r
        # A replay answer means the sender thread has sent those batches (to nobody).
        assert len(_replay(str(pub.replay_endpoint), 0)) == 20
        sub = Subscriber(pub.endpoint)
        first = _wait_connected(pub, sub, kv)[0]
        assert first >= 20
        # Missed: every batch before the first one received, recovered from the buffer.
        missed = _replay(str(pub.replay_endpoint), 0)
        assert [s for s, _ in missed][:first] == list(range(first))
        for seq, payload in missed[:20]:
            (stored,) = V_DECODER.decode(payload).events
            assert stored.token_ids == [1000 * seq + t for t in range(8)]
            assert V_DECODER.decode(payload).data_parallel_rank == 0
        # A replay from a later point starts there.
        assert [s for s, _ in _replay(str(pub.replay_endpoint), 15)][:5] == [15, 16, 17, 18, 19]
        sub.close()
    finally:
        pub.close()


def test_replay_buffer_keeps_the_last_buffer_steps_batches() -> None:
    kv = _manager({64: 16})
    pub = ZmqEventPublisher(kv, "inproc://kv-buf", "inproc://kv-buf-r", buffer_steps=3)
    for r in range(7):
        kv.add_sequence(r, [1000 * r + t for t in range(5)])
        kv.remove_sequence(r)
        pub.publish()
    assert [s for s, _ in _replay("inproc://kv-buf-r", 0)] == [4, 5, 6]
    assert [s for s, _ in _replay("inproc://kv-buf-r", 6)] == [6]
    assert _replay("inproc://kv-buf-r", 7) == []
    pub.close()


def test_nothing_is_lost_under_100000_events() -> None:
    blocks = 64
    kv = _manager({64: blocks}, events=2_000)
    pub = ZmqEventPublisher(
        kv, "tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*", topic="kv"
    )
    sub = Subscriber(pub.endpoint, topic="kv")
    try:
        first, first_batch, _ = _wait_connected(pub, sub, kv)
        start = pub.next_seq
        steps, per_step = 505, 100
        rid = 0
        for _ in range(steps):
            for _ in range(per_step):
                # 2 full key blocks each, all distinct: one store, and (once the pool is
                # full) one removal of two blocks per request.
                kv.add_sequence(rid, [rid * 16 + t for t in range(9)])
                kv.remove_sequence(rid)
                rid += 1
            pub.publish()
        end = pub.next_seq
        # The live stream, every batch from the first one received, in order.
        received: dict[int, Any] = {first: first_batch}
        while len(received) < end - first:
            got = sub.recv()
            assert got is not None, f"stream stalled after {len(received)} batches"
            seq, batch, _ = got
            assert seq == first + len(received)
            received[seq] = batch
        # The warm-up batches before the first received come from replay.
        for seq, payload in _replay(str(pub.replay_endpoint), 0, topic=b"kv"):
            received.setdefault(seq, V_DECODER.decode(payload))
        assert sorted(received) == list(range(end))
        # Replaying the stream reproduces the cache's content exactly.
        router: dict[int, str] = {}
        n_events = n_stored = n_removed = 0
        for seq in range(end):
            for e in received[seq].events:
                n_events += seq >= start
                if isinstance(e, VBlockStored):
                    for h in e.block_hashes:
                        assert h not in router
                        router[h] = e.medium
                    n_stored += len(e.block_hashes) * (seq >= start)
                else:
                    for h in e.block_hashes:
                        del router[h]
                    n_removed += len(e.block_hashes) * (seq >= start)
        assert n_events >= 100_000
        assert n_stored == 2 * steps * per_step
        assert pub.num_lost_events == 0
        stats = kv.get_kv_cache_stats()
        assert len(router) == stats.num_cached_nodes
        assert set(router.values()) == {"GPU"}
    finally:
        sub.close()
        pub.close()


def test_lost_events_clear_the_router() -> None:
    kv = _manager({64: 64}, events=4)
    pub = ZmqEventPublisher(kv, "inproc://kv-lost", "inproc://kv-lost-r")
    kv.add_sequence(0, list(range(9)))
    kv.remove_sequence(0)
    pub.publish()
    for r in range(1, 10):  # 9 stored events into a buffer of 4
        kv.add_sequence(r, [100 * r + t for t in range(9)])
        kv.remove_sequence(r)
    pub.publish()
    assert pub.num_lost_events == 5
    (_, _), (_, p1) = _replay("inproc://kv-lost-r", 0)
    events = V_DECODER.decode(p1).events
    assert [type(e).__name__ for e in events] == ["VAllBlocksCleared"] + ["VBlockStored"] * 4
    assert msgspec.msgpack.decode(p1)[1][0] == {"type": "AllBlocksCleared"}
    pub.close()


def test_resource_manager_publishes_once_per_step() -> None:
    kv = _manager({64: 16})
    pub = ZmqEventPublisher(kv, "inproc://kv-rm", "inproc://kv-rm-r")
    rm = KVCacheResourceManager(kv, event_publisher=pub)
    r = Request(1, prompt=list(range(9)), max_new_tokens=2)
    batch = ScheduledBatch()
    batch.add_context(r)
    rm.prepare_resources(batch)
    r.append_tokens([50])
    rm.update_resources(batch)  # stores the prompt's full blocks: one batch
    assert pub.next_seq == 1
    rm.free_resources(r)
    rm.update_resources(ScheduledBatch())
    assert pub.next_seq == 1  # nothing new to store: no batch
    pub.close()


def test_bad_arguments() -> None:
    quiet = KVCacheManager.from_blocks(
        MODEL,
        KvCacheConfig(tokens_per_block=4, backend="virtual"),
        {64: 4},
        max_seq_len=64,
        max_batch_size=1,
    )
    with pytest.raises(ValueError, match="event_buffer_max_size"):
        ZmqEventPublisher(quiet, "inproc://x")
    kv = _manager({64: 4})
    for kwargs, match in (
        ({"buffer_steps": 0}, r"buffer_steps must be an int in \[1, 10000000\], got 0"),
        ({"buffer_steps": 2**63}, r"buffer_steps must be an int in \[1, 10000000\]"),
        ({"hwm": -1}, r"hwm must be an int in \[1, 2147483647\], got -1"),
        ({"hwm": 2**63}, r"hwm must be an int in \[1, 2147483647\]"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
        ({"event_format": "json"}, "event_format"),
        ({"replay_timeout_s": 0}, "replay_timeout_s"),
        ({"lora_names": {"a": 1}}, "lora_names"),
        ({"endpoint": "garbage"}, "endpoint must be a ZeroMQ address"),
        ({"endpoint": None}, "endpoint must be a ZeroMQ address"),
        ({"endpoint": "tcp://nohost"}, "invalid ZeroMQ endpoint 'tcp://nohost'"),
        ({"replay_endpoint": "garbage"}, "replay_endpoint must be a ZeroMQ address"),
    ):
        kwargs.setdefault("endpoint", "inproc://x")
        with pytest.raises(ValueError, match=match):
            ZmqEventPublisher(kv, **kwargs)
    # The bounds themselves are accepted.
    ZmqEventPublisher(kv, "inproc://kv-max", buffer_steps=MAX_BUFFER_STEPS, hwm=MAX_HWM).close()
    pub = ZmqEventPublisher(kv, "inproc://kv-bad")
    pub.close()
    pub.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        pub.publish()


def test_data_parallel_rank_offsets_ports_like_vllm() -> None:
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", None) == "tcp://*:5557"
    assert offset_endpoint_port("inproc://cache", 1) == "inproc://cache_dp1"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError):
        offset_endpoint_port("ipc:///tmp/x", 1)


def _store_steps(kv: KVCacheManager, pub: ZmqEventPublisher, n: int) -> None:
    """``n`` steps of one stored block each: batches 0 .. n - 1 (a pool of 64 blocks evicts
    the oldest: later batches also remove a block)."""
    for r in range(n):
        kv.add_sequence(r, [100_000 + 8 * r + t for t in range(5)])
        kv.remove_sequence(r)
        assert pub.publish() == r


def test_replay_waits_for_a_slow_client_and_drops_nothing() -> None:
    # 3,000 batches through a pipe of a few messages: every one arrives, then the end marker.
    kv = _manager({64: 64})
    pub = ZmqEventPublisher(kv, "inproc://kv-bp", "inproc://kv-bp-r", topic="t", hwm=2)
    n = 3_000
    _store_steps(kv, pub, n)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.connect("inproc://kv-bp-r")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        time.sleep(0.3)  # the pipe fills; the publisher must wait, not drop
        seqs = []
        while True:
            assert sock.poll(TIMEOUT_MS)
            frames = sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            if frames[2] == END_SEQ:
                assert frames[1] == b"" and frames[3] == b""
                break
            assert frames[1] == b"t"
            seqs.append(int.from_bytes(frames[2], "big"))
            if len(seqs) % 500 == 0:
                time.sleep(0.05)  # a client that stalls now and then
        assert seqs == list(range(n))
        assert pub.num_replays_abandoned == 0
    finally:
        sock.close(linger=0)
        pub.close()


def test_replay_to_a_client_that_stops_reading_ends_without_the_end_marker() -> None:
    kv = _manager({64: 64})
    pub = ZmqEventPublisher(
        kv, "inproc://kv-stall", "inproc://kv-stall-r", hwm=2, replay_timeout_s=0.2
    )
    n = 200
    _store_steps(kv, pub, n)
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.RCVHWM, 2)
    sock.connect("inproc://kv-stall-r")
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        deadline = time.monotonic() + 20
        while pub.num_replays_abandoned == 0:  # reads nothing until the publisher gives up
            assert time.monotonic() < deadline
            time.sleep(0.05)
        seqs = []
        while sock.poll(300):
            _, _, seq, _ = sock.recv_multipart()
            assert seq != END_SEQ, "an answer that lost batches must not report completion"
            seqs.append(int.from_bytes(seq, "big"))
        # What did arrive is a gap-free prefix: nothing was dropped in between.
        assert 0 < len(seqs) < n and seqs == list(range(len(seqs)))
        assert pub.num_replays_abandoned == 1
        # Live batches kept flowing while the replay waited, and a new request is answered.
        kv.add_sequence(n, list(range(900_000, 900_005)))
        kv.remove_sequence(n)
        assert pub.publish() == n
        assert [s for s, _ in _replay("inproc://kv-stall-r", n - 5)] == list(range(n - 5, n + 1))
    finally:
        sock.close(linger=0)
        pub.close()


class _BrokenSocket:
    """Stands in for the PUB socket: every send fails."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def send_multipart(self, *args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    def close(self, linger: int | None = None) -> None:
        self.real.close(linger=0)


def test_a_dead_sender_thread_makes_publish_raise_with_the_cause() -> None:
    kv = _manager({64: 16})
    pub = ZmqEventPublisher(kv, "inproc://kv-dead")
    pub._pub = _BrokenSocket(pub._pub)  # type: ignore[assignment]
    kv.add_sequence(1, list(range(5)))
    kv.remove_sequence(1)
    assert pub.publish() == 0  # queued; the thread dies sending it
    deadline = time.monotonic() + 20
    with pytest.raises(RuntimeError, match="sender thread failed") as err:
        while True:
            assert time.monotonic() < deadline
            kv.add_sequence(2, list(range(5)))
            kv.remove_sequence(2)
            pub.publish()
            time.sleep(0.01)
    assert isinstance(err.value.__cause__, OSError) and "No space left" in str(err.value)
    pub.close()  # still closes


def test_lora_names_are_published() -> None:
    kv = _manager({64: 16})
    pub = ZmqEventPublisher(kv, "inproc://kv-lora", "inproc://kv-lora-r", lora_names={7: "sql"})
    kv.add_sequence(1, list(range(5)), lora_task_id=7)
    kv.remove_sequence(1)
    kv.add_sequence(2, list(range(5)), lora_task_id=8)
    kv.remove_sequence(2)
    pub.publish()
    ((_, payload),) = _replay("inproc://kv-lora-r", 0)
    pub.close()
    events = V_DECODER.decode(payload).events
    assert [(e.lora_id, e.lora_name) for e in events] == [(7, "sql"), (8, None)]


def test_a_closed_publishers_inproc_addresses_can_be_bound_again_at_once() -> None:
    # Without unbinding before close, about 4 in 10 of these binds failed ("Address already
    # in use": ZeroMQ frees the address only when its reaper gets to the closed socket).
    kv = _manager({64: 4})
    for _ in range(100):
        ZmqEventPublisher(kv, "inproc://kv-again", "inproc://kv-again-r").close()
