"""ZmqEventPublisher: vLLM's KV event wire format on loopback, replay, no loss under load."""

from __future__ import annotations

from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig  # noqa: E402
from kvcache.events import (  # noqa: E402
    END_SEQ,
    KVEventBatch,
    ZmqEventPublisher,
    offset_endpoint_port,
    wire_schema,
)
from kvcache.resource_manager import (  # noqa: E402
    KVCacheResourceManager,
    Request,
    ScheduledBatch,
)

TIMEOUT_MS = 20_000  # only a hang guard; nothing asserts on time
MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)


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
    """A SUB socket on loopback that decodes with a decoder built from the wire schema."""

    def __init__(self, endpoint: str, topic: str = "", array_like: bool = True) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(wire_schema(array_like).KVEventBatch)
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


def _replay(endpoint: str, start: int) -> list[tuple[int, bytes]]:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert sock.poll(TIMEOUT_MS)
            empty, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def _as_tuples(events: list[Any]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in events:
        name = type(e).__name__
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
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    decoded = [decoder.decode(p) for _, p in batches]
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

    # The raw payload is vLLM's array form: [ts, [[tag, fields...]], rank].
    raw = msgspec.msgpack.decode(batches[0][1])
    assert isinstance(raw, list) and isinstance(raw[0], float) and raw[2] is None
    assert raw[1] == [
        [
            "BlockStored",
            [a0, a1],
            None,
            a[:8],
            4,
            None,
            "GPU",
            None,
            None,
            0,
            "full_attention",
            None,
        ]
    ]


def test_sliding_windows_and_the_map_form() -> None:
    kv = _manager({8: 8, 64: 8}, window=[8, None])
    pub = ZmqEventPublisher(
        kv, "inproc://kv-map", replay_endpoint="inproc://kv-map-r", event_format="map"
    )
    kv.add_sequence(1, list(range(9)))
    kv.remove_sequence(1)
    pub.publish()
    ((_, payload),) = _replay("inproc://kv-map-r", 0)
    pub.close()
    events = msgspec.msgpack.Decoder(wire_schema(array_like=False).KVEventBatch).decode(payload)
    groups = [
        (e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in events.events
    ]
    assert groups == [(0, "sliding_window", 8), (1, "full_attention", None)]
    raw = msgspec.msgpack.decode(payload)
    assert raw[1][0]["type"] == "BlockStored" and raw[1][0]["medium"] == "GPU"


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
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        for seq, payload in missed[:20]:
            (stored,) = decoder.decode(payload).events
            assert stored.token_ids == [1000 * seq + t for t in range(8)]
            assert decoder.decode(payload).data_parallel_rank == 0
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
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        for seq, payload in _replay(str(pub.replay_endpoint), 0):
            received.setdefault(seq, decoder.decode(payload))
        assert sorted(received) == list(range(end))
        # Replaying the stream reproduces the cache's content exactly.
        router: dict[int, str] = {}
        n_events = n_stored = n_removed = 0
        for seq in range(end):
            for e in received[seq].events:
                n_events += seq >= start
                if type(e).__name__ == "BlockStored":
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
    events = msgspec.msgpack.Decoder(KVEventBatch).decode(p1).events
    assert [type(e).__name__ for e in events] == ["AllBlocksCleared"] + ["BlockStored"] * 4
    assert msgspec.msgpack.decode(p1)[1][0] == ["AllBlocksCleared"]
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
        ({"buffer_steps": 0}, "buffer_steps"),
        ({"hwm": -1}, "hwm"),
        ({"data_parallel_rank": -1}, "data_parallel_rank"),
        ({"event_format": "json"}, "event_format"),
    ):
        with pytest.raises(ValueError, match=match):
            ZmqEventPublisher(kv, "inproc://x", **kwargs)
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
