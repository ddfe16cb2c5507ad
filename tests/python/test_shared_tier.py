"""The shared tier on Redis: managers reuse each other's blocks byte for byte, and a store that
is gone, stalled, flushed or corrupt is a miss and a counter, never an exception."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from redis_helpers import (
    FULL,
    FULL_BLOCKS,
    MODEL,
    PROMPT,
    SWA,
    Server,
    compute_and_store,
    free_port,
    held_bytes,
    make,
    window_of,
)

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

pytestmark = pytest.mark.skipif(
    shutil.which("redis-server") is None,
    reason="redis-server is not on PATH (apt install redis-server)",
)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    pytest.importorskip("redis")
    s = Server(tmp_path)
    try:
        yield s
    finally:
        s.stop()


def test_a_fresh_manager_reuses_another_ones_prefix_byte_exact_in_every_window(
    server: Server,
) -> None:
    a = make(server.url)
    want = compute_and_store(a)
    # Both windows' 7 full blocks were written (not the 1-token tail), under the keys the
    # stored events name.
    assert a.get_kv_cache_stats().shared_writes == 14
    hashes = {
        (e.window_size, b["block_hash"] % 2**64)
        for e in a.get_latest_events()
        if e.kind == "stored"
        for b in e.data["blocks"]
        if len(b["tokens"]) == 4
    }
    ns = a.shared_cache_namespace
    label = {SWA: SWA, FULL: 0}
    expect = sorted(f"{ns}:w{label[w]}:{h:016x}" for w, h in hashes)
    from kvcache.shared_cache import shared_cache_keys

    assert shared_cache_keys(server.url, ns) == expect and len(expect) == 14

    b = make(server.url)
    assert b.add_sequence(7, PROMPT) == 28
    # Full attention holds all 7 positions, the sliding window only the last 2 (its front):
    # 9 blocks filled from the store, each byte for byte A's.
    assert b.get_cache_block_ids(7, SWA)[:5] == [-1] * 5
    for w, positions in ((FULL, range(7)), (SWA, range(5, 7))):
        for d in positions:
            for got, exp in zip(held_bytes(b, 7, w, d), want[w, d], strict=True):
                np.testing.assert_array_equal(got, exp)
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors, s.reused_blocks_per_window_size) == (
        9,
        0,
        {SWA: 7, FULL: 7},
    )
    b.check_invariants()
    # B stores them (no second write: they came from the store), and a local hit follows.
    b.remove_sequence(7)
    assert b.flush_shared_cache() and b.get_kv_cache_stats().shared_writes == 0
    assert b.add_sequence(8, PROMPT) == 29  # the local hit adds the 1-token tail block
    assert b.get_kv_cache_stats().shared_hits == 9
    b.check_invariants()


def test_the_store_extends_a_shorter_local_hit(server: Server) -> None:
    a = make(server.url)
    want = compute_and_store(a)
    b = make(server.url)
    # A 13-token prompt: 3 blocks from the store (the window: positions 1..2), then cached.
    assert b.add_sequence(1, PROMPT[:13]) == 12
    assert b.get_kv_cache_stats().shared_hits == 3 + 2
    b.remove_sequence(1)
    # The whole prompt: 3 blocks cached here (and the 1-token tail, dropped for the store's
    # longer hit), 4 more from the store.
    assert b.add_sequence(2, PROMPT) == 28
    s = b.get_kv_cache_stats()
    assert s.shared_hits == 3 + 2 + 4 + 2  # full attention 3..6, the window 5..6
    for d in range(3, 7):
        for got, exp in zip(held_bytes(b, 2, FULL, d), want[FULL, d], strict=True):
            np.testing.assert_array_equal(got, exp)
    b.check_invariants()


def test_managers_of_different_models_never_read_each_others_blocks(server: Server) -> None:
    a = make(server.url)
    compute_and_store(a)
    other = ModelConfig(num_layers=4, num_kv_heads=1, head_dim=16)  # same bytes per block
    c = make(server.url, model=other)
    assert c.shared_cache_namespace != a.shared_cache_namespace
    assert c.shared_cache_namespace.startswith("kvcache:") and len(c.shared_cache_namespace) == 24
    assert c.add_sequence(1, PROMPT) == 0
    assert c.get_kv_cache_stats().shared_hits == 0
    # A different block size keys tokens differently: its own namespace too.
    d = KVCacheManager.from_blocks(
        MODEL,
        KvCacheConfig(
            tokens_per_block=8,
            backend="host",
            max_attention_window=[SWA, None],
            shared_cache_url=server.url,
        ),
        {SWA: (8, 0), FULL: (16, 0)},
        max_seq_len=64,
        max_batch_size=4,
    )
    assert d.shared_cache_namespace not in (a.shared_cache_namespace, c.shared_cache_namespace)
    # The same model under another max_seq_len shares: full attention is labelled 0.
    e = KVCacheManager.from_blocks(
        MODEL,
        KvCacheConfig(
            tokens_per_block=4,
            backend="host",
            max_attention_window=[SWA, None],
            shared_cache_url=server.url,
        ),
        {SWA: (8, 0), 128: (16, 0)},
        max_seq_len=128,
        max_batch_size=4,
    )
    assert e.shared_cache_namespace == a.shared_cache_namespace
    assert e.add_sequence(1, PROMPT) == 28


def _same_as_without_tier(m: KVCacheManager, request: int) -> None:
    """m registered `request` with PROMPT as a manager without a shared tier would."""
    plain = make(None)
    assert plain.add_sequence(request, PROMPT) == 0
    for w in (SWA, FULL):
        assert m.get_cache_block_ids(request, w) == plain.get_cache_block_ids(request, w)
    m.check_invariants()


def test_a_server_killed_mid_run_gives_misses_and_nothing_half_changed(server: Server) -> None:
    a = make(server.url)
    compute_and_store(a)
    b = make(server.url)
    server.stop()
    assert b.add_sequence(1, PROMPT) == 0  # a miss, no exception
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors, s.missed_blocks_per_window_size) == (
        0,
        1,
        {SWA: 8, FULL: 8},
    )
    _same_as_without_tier(b, 1)
    # Writes to the dead store fail behind the calls: counted, never raised.
    b.remove_sequence(1)
    assert b.flush_shared_cache(timeout_ms=10_000)
    assert b.get_kv_cache_stats().shared_writes == 0
    assert b.get_kv_cache_stats().shared_errors >= 2
    b.check_invariants()
    assert b.get_kv_cache_stats().free_num_blocks == 24


def test_a_flushed_store_is_a_plain_miss(server: Server) -> None:
    a = make(server.url)
    compute_and_store(a)
    server.client().flushall()
    b = make(server.url)
    assert b.add_sequence(1, PROMPT) == 0
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors) == (0, 0)
    _same_as_without_tier(b, 1)


def test_a_port_nobody_listens_on_is_a_miss_and_a_counter() -> None:
    m = make(f"redis://127.0.0.1:{free_port()}")
    assert m.add_sequence(1, PROMPT) == 0
    m.remove_sequence(1, store_for_reuse=False)
    assert m.add_sequence(2, PROMPT) == 0  # within the backoff: no new connection attempt
    s = m.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors) == (0, 2)
    m.check_invariants()


def test_a_block_that_does_not_verify_ends_the_hit_before_it(server: Server) -> None:
    a = make(server.url)
    want = compute_and_store(a)
    ns = a.shared_cache_namespace
    stored = [
        (e.window_size, b["block_hash"] % 2**64)
        for e in a.get_latest_events()
        if e.kind == "stored" and e.window_size == FULL
        for b in e.data["blocks"]
    ]
    key = f"{ns}:w0:{stored[3][1]:016x}"  # full attention, position 3
    client = server.client()
    value = bytearray(client.get(key))
    value[-1] ^= 0xFF  # one flipped bit of the last byte: the checksum fails
    client.set(key, bytes(value))
    b = make(server.url)
    # The probe reads no bytes: it counts the block (the one case where it says more).
    assert b.get_reusable_prefix_length(PROMPT) == 28
    # The hit stops at 3 blocks; the window then needs positions 1..2.
    assert b.add_sequence(1, PROMPT) == 12
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors) == (3 + 2, 1)
    for w, positions in ((FULL, range(3)), (SWA, range(1, 3))):
        for d in positions:
            for got, exp in zip(held_bytes(b, 1, w, d), want[w, d], strict=True):
                np.testing.assert_array_equal(got, exp)
    b.check_invariants()


def test_a_stalled_server_costs_one_timeout_and_drops_what_does_not_fit(server: Server) -> None:
    a = make(server.url)
    compute_and_store(a)
    b = make(server.url, shared_cache_timeout_ms=50, shared_cache_queue_bytes=1)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        assert b.add_sequence(1, PROMPT) == 0
        assert time.monotonic() - start < 5  # a hang guard: the lookup is bounded by 50 ms
        assert b.get_kv_cache_stats().shared_errors == 1
        _same_as_without_tier(b, 1)
        # 14 blocks to write while the store is stalled and the queue holds one: 13 dropped.
        b.remove_sequence(1)
        s = b.get_kv_cache_stats()
        assert (s.shared_write_drops, s.shared_writes) == (13, 0)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)


def test_bad_shared_cache_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="shared_cache_url must look like redis://"):
        KvCacheConfig(shared_cache_url="http://x")
    with pytest.raises(ValueError, match="shared_cache_namespace needs shared_cache_url"):
        KvCacheConfig(shared_cache_namespace="ns")
    with pytest.raises(ValueError, match="shared_cache_queue_bytes"):
        KvCacheConfig(shared_cache_url="redis://h", shared_cache_queue_bytes=-1)
    with pytest.raises(ValueError, match="shared_cache_url must be a non-empty str or None"):
        KvCacheConfig(shared_cache_url="")
    c = KvCacheConfig(shared_cache_url="redis://h:1/2", shared_cache_namespace="n")
    assert KvCacheConfig.from_dict(c.to_dict()) == c
    with pytest.raises(ValueError, match="shared_cache_timeout_ms"):
        KvCacheConfig(shared_cache_url="redis://h", shared_cache_timeout_ms=0)
    with pytest.raises(ValueError, match=r"the port must be an integer in 1\.\.65535"):
        make("redis://127.0.0.1:0")
    with pytest.raises(ValueError, match="needs enable_block_reuse"):
        make("redis://127.0.0.1:1", enable_block_reuse=False)
    config = KvCacheConfig(backend="virtual", shared_cache_url="redis://127.0.0.1:1")
    with pytest.raises(ValueError, match="virtual backend has no KV bytes"):
        KVCacheManager.from_blocks(MODEL, config, {64: (4, 0)}, max_seq_len=64, max_batch_size=1)
    named = make("redis://127.0.0.1:1", shared_cache_namespace="fleet-a")
    assert named.shared_cache_namespace == "fleet-a"
    assert make(None).shared_cache_namespace == ""


def test_a_longer_hit_that_would_not_fit_is_left_out(server: Server) -> None:
    a = make(server.url)
    compute_and_store(a)
    b = make(server.url, blocks={SWA: (16, 0), FULL: (16, 0)})
    # Another request holds 12 of each window's 16 blocks: 4 are free.
    assert b.add_sequence(9, list(range(1000, 1048))) == 0
    assert b.get_num_free_blocks(FULL) == 4
    # In 4-token chunks, the store's 7 blocks would need 8 blocks at once (the hit and the
    # first chunk); without them the first chunk needs 1. The call takes the miss.
    assert b.add_sequence(1, PROMPT, prefill=4) == 0
    assert [len([x for x in b.get_cache_block_ids(1, w) if x >= 0]) for w in (SWA, FULL)] == [1, 1]
    assert b.get_kv_cache_stats().shared_hits == 0
    b.check_invariants()


def test_clear_shared_cache_deletes_one_namespace(server: Server) -> None:
    from kvcache.shared_cache import clear_shared_cache, shared_cache_keys

    a = make(server.url)
    compute_and_store(a)
    server.client().set("other:key", b"x")
    assert clear_shared_cache(server.url, a.shared_cache_namespace) == 14
    assert shared_cache_keys(server.url, a.shared_cache_namespace) == []
    assert server.client().get("other:key") == b"x"
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        shared_cache_keys(server.url, "")
    with pytest.raises(ValueError, match="url must look like redis://"):
        clear_shared_cache("http://x", "ns")


class StallingStore:
    """A fake Redis: answers EXISTS from `values`, then the first `answered` GETs, and then
    nothing more (a store that became slow mid-reply)."""

    def __init__(self, values: dict[bytes, bytes], answered: int) -> None:
        import threading

        self.values = values
        self.answered = answered
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4)
        self.url = f"redis://127.0.0.1:{self.listener.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        self.conns.append(conn)
        buf = b""
        gets = 0
        while True:
            try:
                data = conn.recv(1 << 16)
            except OSError:
                return
            if not data:
                return
            buf += data
            while True:
                command, buf = _parse_command(buf)
                if command is None:
                    break
                name, key = command[0].upper(), command[1]
                if name == b"EXISTS":
                    conn.sendall(b":1\r\n" if key in self.values else b":0\r\n")
                elif name == b"GET":
                    gets += 1
                    if gets <= self.answered:
                        v = self.values[key]
                        conn.sendall(b"$%d\r\n%s\r\n" % (len(v), v))

    def close(self) -> None:
        self.listener.close()
        for c in self.conns:
            c.close()


def _parse_command(buf: bytes) -> tuple[list[bytes] | None, bytes]:
    """One RESP array of bulk strings from the front of `buf`, or None if incomplete."""
    end = buf.find(b"\r\n")
    if end < 0:
        return None, buf
    count, pos, out = int(buf[1:end]), end + 2, []
    for _ in range(count):
        end = buf.find(b"\r\n", pos)
        if end < 0:
            return None, buf
        length = int(buf[pos + 1 : end])
        if len(buf) < end + 2 + length + 2:
            return None, buf
        out.append(buf[end + 2 : end + 2 + length])
        pos = end + 2 + length + 2
    return out, buf[pos:]


def test_a_store_that_stalls_mid_reply_serves_the_prefix_that_came_back(server: Server) -> None:
    full_only = {"model": MODEL, "blocks": {FULL: (16, 0)}, "max_attention_window": None}
    a = make(server.url, **full_only)  # type: ignore[arg-type]
    compute_and_store(a, windows=(FULL,))
    client = server.client()
    values = {k: client.get(k) for k in client.keys("*")}
    assert len(values) == 7
    store = StallingStore(values, answered=3)
    try:
        b = make(store.url, shared_cache_timeout_ms=200, **full_only)  # type: ignore[arg-type]
        start = time.monotonic()
        assert b.add_sequence(1, PROMPT) == 12  # blocks 0..2 arrived; 3..6 never did
        assert time.monotonic() - start < 5  # a hang guard
        s = b.get_kv_cache_stats()
        assert (s.shared_hits, s.shared_errors) == (3, 1)
        b.check_invariants()
    finally:
        store.close()


def test_another_manager_hits_blocks_a_running_request_stored(server: Server) -> None:
    a = make(server.url)
    rng = np.random.default_rng(3)
    assert a.add_sequence(1, PROMPT) == 0
    for layer in range(MODEL.num_layers):
        buf = a.get_buffers(layer)
        buf[...] = rng.standard_normal(buf.shape).astype(buf.dtype)
    assert a.store_context_blocks(1) == 7  # request 1 keeps running
    assert a.flush_shared_cache()
    b = make(server.url)
    assert b.add_sequence(5, PROMPT) == 28
    for d in range(7):
        want = a.get_cache_block_ids(1, FULL)[d]
        got = b.get_cache_block_ids(5, FULL)[d]
        for layer in (1, 3):
            np.testing.assert_array_equal(b.get_buffers(layer)[got], a.get_buffers(layer)[want])
    assert a.has_sequence(1)


def _expected_kv(tokens: list[int], d: int, layer: int, shape: tuple[int, ...]) -> np.ndarray:
    """The KV an engine computes for block d of `tokens` in `layer`: a function of the prefix."""
    seed = hash((tuple(tokens[: (d + 1) * 4]), layer)) & 0xFFFFFFFF
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float16)


def test_randomized_managers_sharing_a_store_only_ever_serve_the_right_bytes(
    server: Server,
) -> None:
    rng = np.random.default_rng(11)
    managers = [make(server.url, blocks={SWA: (10, 0), FULL: (12, 0)}) for _ in range(3)]
    stems = [list(rng.integers(0, 50, size=16)) for _ in range(3)]
    live: list[tuple[int, int, list[int]]] = []  # (manager, request, tokens)
    next_id = 0
    for _ in range(60):
        if live and (len(live) >= 3 or rng.random() < 0.4):
            i, rid, _tokens = live.pop(int(rng.integers(len(live))))
            managers[i].remove_sequence(rid)
            managers[i].flush_shared_cache(timeout_ms=10_000)
            continue
        i = int(rng.integers(3))
        m = managers[i]
        tokens = [int(t) for t in stems[int(rng.integers(3))][: int(rng.integers(5, 17))]]
        tokens += [int(t) for t in rng.integers(0, 50, size=int(rng.integers(1, 12)))]
        try:
            reused = m.add_sequence(next_id, tokens)
        except Exception:  # a full pool: the request waits (nothing changed)
            m.check_invariants()
            continue
        shape = m.get_buffers(0).shape[1:]
        n_blocks = (len(tokens) + 3) // 4
        for w in (SWA, FULL):
            ids = m.get_cache_block_ids(next_id, w)
            for d in range(n_blocks):
                if ids[d] < 0:
                    continue
                for layer in [x for x in range(4) if window_of(x) == w]:
                    buf = m.get_buffers(layer)
                    want = _expected_kv(tokens, d, layer, shape)
                    if d < reused // 4:  # reused: locally or from the store, the exact bytes
                        np.testing.assert_array_equal(buf[ids[d]], want)
                    else:  # computed now
                        buf[ids[d]] = want
        m.check_invariants()
        live.append((i, next_id, tokens))
        next_id += 1
    stats = [m.get_kv_cache_stats() for m in managers]
    assert sum(s.shared_hits for s in stats) > 0 and sum(s.shared_errors for s in stats) == 0
    assert sum(s.reused_blocks for s in stats) > sum(s.shared_hits for s in stats)  # local hits too


def test_blocks_queued_for_the_store_are_announced_as_shared_storage(server: Server) -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvcache.events import ZmqEventPublisher

    m = make(server.url, max_attention_window=[FULL, FULL], blocks={FULL: (16, 0)})
    m.get_latest_events()
    pub = ZmqEventPublisher(m, "inproc://shared-medium")
    try:
        assert m.add_sequence(1, PROMPT) == 0
        m.remove_sequence(1)
        raw = [e for e in m.get_latest_events() if e.kind == "stored"]
        assert [[b["cache_level"] for b in e.data["blocks"]] for e in raw] == [
            [0] * 8,
            [3] * FULL_BLOCKS,  # the partial last block is not written to the store
        ]
        primary, shared = raw
        assert shared.data["parent_hash"] == primary.data["parent_hash"] is None
        for p, s in zip(primary.data["blocks"], shared.data["blocks"], strict=False):
            assert (s["block_hash"], s["tokens"], s["lora_task_id"]) == (
                p["block_hash"],
                p["tokens"],
                p["lora_task_id"],
            )
        events = pub.convert(raw)
        media = [(type(e).__name__, e.medium, len(e.block_hashes)) for e in events]
        assert media == [
            ("BlockStored", "GPU", FULL_BLOCKS),
            ("BlockStored", "SHARED_STORAGE", FULL_BLOCKS),
        ]
        assert events[1].block_hashes == events[0].block_hashes
        assert m.flush_shared_cache(timeout_ms=10_000)
    finally:
        pub.close()


def test_a_dropped_write_announces_nothing_in_the_store(server: Server) -> None:
    m = make(
        server.url,
        max_attention_window=[FULL, FULL],
        blocks={FULL: (16, 0)},
        shared_cache_queue_bytes=1,
    )
    m.get_latest_events()
    assert m.add_sequence(1, PROMPT) == 0
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        # The store is stalled and the queue holds one block: block 0 is queued, 1..6 dropped.
        m.remove_sequence(1)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    stored = [e for e in m.get_latest_events() if e.kind == "stored"]
    assert [[b["cache_level"] for b in e.data["blocks"]] for e in stored] == [[0] * 8, [3]]
    assert stored[1].data["blocks"][0]["block_hash"] == stored[0].data["blocks"][0]["block_hash"]
    assert m.get_kv_cache_stats().shared_write_drops == FULL_BLOCKS - 1


WINDOW_SETUPS = {
    "sliding+full": ([SWA, None], {SWA: (8, 0), FULL: (16, 0)}),
    "full": (None, {FULL: (16, 0)}),
    "sliding": ([SWA], {SWA: (8, 0)}),
    "two windows, one not block-aligned": ([6, 12, None], {6: (8, 0), 12: (8, 0), FULL: (16, 0)}),
}


@pytest.mark.parametrize("setup", list(WINDOW_SETUPS))
def test_get_reusable_prefix_length_probes_the_store_as_add_sequence_onboards(
    server: Server, setup: str
) -> None:
    window, blocks = WINDOW_SETUPS[setup]
    client = server.client()
    from_store = local_only = cut = 0
    for seed in range(3):
        client.flushall()
        a = make(server.url, max_attention_window=window, blocks=blocks)
        b = make(server.url, max_attention_window=window, blocks=blocks)
        # A computes PROMPT (7 full blocks to the store); B computes its first 2 blocks itself.
        assert a.add_sequence(1, PROMPT) == 0 and b.add_sequence(1, PROMPT[:9]) == 0
        a.remove_sequence(1)
        b.remove_sequence(1)
        assert a.flush_shared_cache(timeout_ms=10_000) and b.flush_shared_cache(timeout_ms=10_000)
        # A partial chain (seed 0: none): some windows' blocks at some positions are gone.
        rng = np.random.default_rng(seed)
        keys = sorted(client.keys(f"{a.shared_cache_namespace}:*"))
        gone = [k for k in keys if seed > 0 and rng.random() < 0.3]
        if gone:
            client.delete(*gone)
        # Every prefix length (the last token is never reused), then other tails.
        probes = [PROMPT[:n] for n in range(1, len(PROMPT) + 1)]
        probes += [[*PROMPT[:n], 99, 98] for n in range(0, len(PROMPT), 3)]
        for i, prompt in enumerate(probes):
            hits = b.get_kv_cache_stats().shared_hits
            want = b.get_reusable_prefix_length(prompt)
            assert b.get_reusable_prefix_length(b.prepare(prompt)) == want  # the same probe
            got = b.add_sequence(100 + i, prompt)
            assert want == got, (setup, seed, len(prompt), gone, want, got)
            onboarded = b.get_kv_cache_stats().shared_hits > hits
            from_store += onboarded
            local_only += not onboarded and got > 0
            cut += got < 4 * ((len(prompt) - 1) // 4)
            b.remove_sequence(100 + i, store_for_reuse=False)  # B's cache stays as it was
        assert b.get_kv_cache_stats().shared_errors == 0
        b.check_invariants()
    # Store hits, local hits and hits a missing block cut short were all compared.
    assert from_store > 20 and local_only > 5 and cut > 20


def test_get_reusable_prefix_length_with_an_unreachable_store_is_the_local_hit() -> None:
    m = make(f"redis://127.0.0.1:{free_port()}")
    assert m.add_sequence(1, PROMPT[:9]) == 0
    m.remove_sequence(1)
    assert m.flush_shared_cache(timeout_ms=10_000)  # the writes failed behind the calls
    errors = m.get_kv_cache_stats().shared_errors
    assert m.get_reusable_prefix_length(PROMPT) == 8  # a miss, no exception
    assert m.get_kv_cache_stats().shared_errors == errors + 1
    assert m.add_sequence(2, PROMPT) == 8
    m.check_invariants()


@pytest.mark.parametrize("partial", [False, True], ids=["exact", "partial-reuse"])
def test_randomized_fleet_router_match_equals_each_engines_lookup_with_the_store(
    server: Server, tmp_path: Path, partial: bool
) -> None:
    """Three engines of one model (windows of 6 and 16 tokens and full attention; small pools
    that evict, two with host offload, one with a disk tier, one under "invalidate") share a
    store and publish their events over ZeroMQ: after every step, for random probes on every
    engine, the router's ``match`` equals the engine's ``get_reusable_prefix_length`` (which
    probes the store; with partial reuse it is at most a block above), and every admission
    reuses what the engine said before it."""
    import random

    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from fleet_helpers import advance_random_sequence, random_probe, sync_subscriber

    from kvcache import OutOfBlocksError
    from kvcache.events import ZmqEventPublisher
    from kvcache.router import KvIndexer, ZmqEventSubscriber

    model = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=4)
    windows: list[int | None] = [6, 16, None]

    def engine(
        blocks: dict[int, Any], disk: Path | None = None, policy: str = "placeholder"
    ) -> KVCacheManager:
        tier: dict[str, Any] = {}
        if disk is not None:  # sizes only validated: from_blocks takes exact counts
            tier = {"disk_cache_dir": str(disk), "host_cache_size": 1, "disk_cache_size": 1}
        config = KvCacheConfig(
            tokens_per_block=4,
            max_attention_window=windows,
            backend="host",
            event_buffer_max_size=100_000,
            enable_partial_reuse=partial,
            swa_reuse_policy=policy,
            shared_cache_url=server.url,
            shared_cache_timeout_ms=1000,  # a loaded test machine: never a timeout miss
            **tier,
        )
        return KVCacheManager.from_blocks(model, config, blocks, max_seq_len=64, max_batch_size=4)

    rng = random.Random(26 + partial)
    engines = {
        "a": engine({6: (5, 3, 4), 16: (7, 3, 3), 64: (12, 6, 6)}, disk=tmp_path),
        "b": engine({6: (6, 2), 16: (8, 2), 64: (12, 4)}),
        "c": engine({6: (8, 0), 16: (10, 0), 64: (14, 0)}, policy="invalidate"),
    }
    assert len({kv.shared_cache_namespace for kv in engines.values()}) == 1
    pubs = {
        name: ZmqEventPublisher(kv, f"inproc://st-{name}", f"inproc://st-{name}-r", topic="kv")
        for name, kv in engines.items()
    }
    local = KvIndexer()  # the same events, as if no engine read the store

    class TwoIndexes(KvIndexer):
        def apply(self, engine_id: Any, payload: Any) -> None:
            super().apply(engine_id, payload)
            local.apply(engine_id, payload)

    index = TwoIndexes(shared_tier=True)
    for name in engines:
        local.add_engine(name, shared_tier=False)
    sub = ZmqEventSubscriber(
        index, {n: (f"inproc://st-{n}", f"inproc://st-{n}-r") for n in engines}, topic="kv"
    )
    bases = [[rng.randrange(1000) for _ in range(28)] for _ in range(4)]
    keys: list[dict[str, Any]] = [{}, {"lora_task_id": 3}, {"cache_salt": "x"}]
    live: dict[str, dict[int, int]] = {n: {} for n in engines}  # request -> tokens left
    next_id = 0
    probes = hits = from_store = admitted = 0
    steps = 300
    try:
        for _ in range(steps):
            name = rng.choice(list(engines))
            kv = engines[name]
            op = rng.random()
            if op < 0.35 and len(live[name]) < 2:
                prompt = rng.choice(bases)[: rng.randrange(2, 24)] + [
                    rng.randrange(1000) for _ in range(rng.randrange(3))
                ]
                kw = dict(rng.choice(keys))
                predicted = kv.get_reusable_prefix_length(prompt, **kw)
                if len(prompt) > 5 and rng.random() < 0.3:
                    kw["prefill"] = 4  # chunked prefill: 4 tokens now, the rest later
                try:
                    reused = kv.add_sequence(next_id, prompt, **kw)
                    live[name][next_id] = rng.randrange(1, 12)
                    if "prefill" not in kw:  # (a chunk may not fit the store's blocks)
                        assert reused == predicted, (name, prompt, kw, reused, predicted)
                        admitted += 1
                except OutOfBlocksError:
                    pass
                next_id += 1
            elif op < 0.75 and live[name]:
                advance_random_sequence(kv, live[name], rng, bases[0][0])
            elif live[name]:
                rid = rng.choice(list(live[name]))
                kv.remove_sequence(rid)
                del live[name][rid]
            for kv in engines.values():  # the store holds what the events announced
                assert kv.flush_shared_cache(timeout_ms=10_000)
            for pub in pubs.values():
                pub.publish()
            sync_subscriber(sub, pubs)
            for probe_engine, probe_kv in engines.items():
                for _ in range(4):
                    prompt, key, router_key = random_probe(rng, keys, bases)
                    want = probe_kv.get_reusable_prefix_length(prompt, **key)
                    got = index.match(probe_engine, prompt, **router_key)
                    if partial:  # the engine may also take part of the next block
                        assert got <= want < got + 4, (probe_engine, prompt, key, got, want)
                    else:
                        assert got == want, (probe_engine, prompt, key, got, want)
                    probes += 1
                    hits += want > 0
                    from_store += want > local.match(probe_engine, prompt, **router_key)
        stats = {n: kv.get_kv_cache_stats() for n, kv in engines.items()}
    finally:
        sub.close()
        for pub in pubs.values():
            pub.close()
    # The workload reached what it is meant to exercise: hits beyond each engine's own
    # cache, store hits onboarded, offloads and onboards, evictions, no store error.
    assert probes == steps * 3 * 4 and hits > steps and from_store > steps // 2
    assert admitted > 30
    assert all(s.shared_errors == 0 and s.shared_write_drops == 0 for s in stats.values())
    assert sum(s.shared_hits for s in stats.values()) > 50
    assert all(s.offloaded_blocks > 0 for n, s in stats.items() if n != "c")
    assert sub.num_unrecoverable_gaps == 0


def test_an_offload_after_a_store_write_moves_the_engines_own_copy(server: Server) -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvcache.events import ZmqEventPublisher

    model = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=4)
    m = make(server.url, model=model, max_attention_window=None, blocks={FULL: (3, 2)})
    pub = ZmqEventPublisher(m, "inproc://shared-offload")
    try:
        m.add_sequence(1, list(range(9)))
        m.remove_sequence(1)
        m.add_sequence(2, list(range(100, 109)))  # evicts request 1's 2 blocks to host
        m.remove_sequence(2)
        got = [
            (type(e).__name__, e.medium, len(e.block_hashes))
            for e in pub.convert(m.get_latest_events())
        ]
    finally:
        pub.close()
    # The store's copy stays announced; the engine's own copies move GPU -> CPU.
    assert got == [
        ("BlockStored", "GPU", 2),
        ("BlockStored", "SHARED_STORAGE", 2),
        ("BlockRemoved", "GPU", 1),
        ("BlockStored", "CPU", 1),
        ("BlockRemoved", "GPU", 1),
        ("BlockStored", "CPU", 1),
        ("BlockStored", "GPU", 2),
        ("BlockStored", "SHARED_STORAGE", 2),
    ]
    assert m.flush_shared_cache(timeout_ms=10_000)


def test_a_store_watcher_keeps_the_router_exact_through_deletions_and_evictions(
    server: Server,
) -> None:
    pytest.importorskip("msgspec")
    pytest.importorskip("zmq")
    from kvcache.events import EventBatcher
    from kvcache.router import KvIndexer
    from kvcache.shared_cache import SharedStoreWatcher, clear_shared_cache

    a, b = make(server.url), make(server.url)
    index = KvIndexer(shared_tier=True)
    index.add_engine("b")
    batcher = EventBatcher(a)
    ns = a.shared_cache_namespace
    watcher = SharedStoreWatcher(index, server.url, ns)
    client = server.client()
    rng = np.random.default_rng(5)
    prompts = [PROMPT] + [[int(t) for t in rng.integers(100, 900, size=30)] for _ in range(150)]

    def same(n: int = len(prompts)) -> int:
        """Asserts match == the engine's probe for prompts and their prefixes; their sum."""
        assert watcher.sync()
        total = 0
        for p in prompts[:n]:
            for cut in (30, 21, 13):
                want = b.get_reusable_prefix_length(p[:cut])
                assert index.match("b", p[:cut]) == want, (p[:cut], want)
                total += want
        return total

    try:
        compute_and_store(a)
        index.apply("a", batcher.convert(a.get_latest_events()))
        assert same(1) == 28 + 20 + 12
        # A DEL (full attention, position 3) ends both predictions at 3 blocks.
        stored = index.num_shared_blocks()
        assert stored == {(4, SWA): 7, (4, None): 7}
        full3 = kvcache_hashes(PROMPT)[3]
        assert client.delete(f"{ns}:w0:{full3:016x}") == 1
        assert same(1) == 12 + 12 + 12 and watcher.num_removed == 1
        # Evictions (LRU): 150 prompts are written, then the store gives back half of that.
        before = int(client.info("memory")["used_memory"])
        for i, p in enumerate(prompts[1:]):
            assert a.add_sequence(10 + i, p) == 0
            a.remove_sequence(10 + i)
        assert a.flush_shared_cache(timeout_ms=10_000)
        index.apply("a", batcher.convert(a.get_latest_events()))
        used = int(client.info("memory")["used_memory"])
        # Under load the bounded write queue may drop some blocks: count what the store holds.
        keys = client.dbsize()
        assert 14 + 14 < keys <= 14 + 150 * 14 - 1
        client.config_set("maxmemory-policy", "allkeys-lru")
        target = used - (used - before) // 2
        client.config_set("maxmemory", target)
        # Redis evicts in time-bounded rounds: wait until it is under the limit.
        deadline = time.monotonic() + 10
        while int(client.info("memory")["used_memory"]) > target and time.monotonic() < deadline:
            time.sleep(0.01)
        client.config_set("maxmemory", 0)
        assert watcher.sync()
        evicted = int(client.info("stats")["evicted_keys"])
        assert evicted > (keys - 14) // 4 and watcher.num_removed == 1 + evicted
        assert client.dbsize() == keys - evicted
        assert same() > 0
        # clear_shared_cache deletes key by key: the watcher sees every one.
        clear_shared_cache(server.url, ns)
        assert same() == 0
        # A flush sends no per-key notification: the index must be told.
        a.add_sequence(1, PROMPT)
        a.remove_sequence(1)
        assert a.flush_shared_cache(timeout_ms=10_000)
        index.apply("a", batcher.convert(a.get_latest_events()))
        assert same(1) == 28 + 20 + 12
        client.flushall()
        assert index.match("b", PROMPT) == 28 and b.get_reusable_prefix_length(PROMPT) == 0
        index.clear_shared_tier()
        assert same(1) == 0
    finally:
        watcher.close()
        watcher.close()


def kvcache_hashes(tokens: list[int]) -> list[int]:
    import kvcache

    return list(kvcache.block_hashes(tokens[:-1], 4))


def test_a_watcher_whose_store_goes_away_counts_errors_and_closes(server: Server) -> None:
    from kvcache.router import KvIndexer
    from kvcache.shared_cache import SharedStoreWatcher

    watcher = SharedStoreWatcher(KvIndexer(shared_tier=True), server.url, "ns")
    try:
        assert watcher.sync() and watcher.num_errors == 0
        flags = server.client().config_get("notify-keyspace-events")["notify-keyspace-events"]
        assert set(flags) == set("Kgxe")
        server.stop()
        deadline = time.monotonic() + 10  # a hang guard, not a timing assertion
        while watcher.num_errors == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    finally:
        watcher.close()
    with pytest.raises(ValueError, match="namespace must be a non-empty str"):
        SharedStoreWatcher(KvIndexer(), server.url, "")
