"""NVIDIA Dynamo's standalone KV indexer (``python -m dynamo.indexer``, the ``kvcache[interop]``
extra) follows kvcache engines' event streams: its ``/query`` score equals each manager's own
``get_reusable_prefix_length`` on every prompt, through eviction, a gap filled by replay and an
``AllBlocksCleared``."""

from __future__ import annotations

import json
import random
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")
pytest.importorskip("dynamo.llm", reason="Dynamo is not installed: pip install 'kvcache[interop]'")

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.events import ZmqEventPublisher
from kvcache.router import KvIndexer, ZmqEventSubscriber

TPB = 4
MODEL_NAME = "kvcache-interop"
SEED = 35


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Dynamo:
    """Dynamo's standalone indexer on a loopback port."""

    def __init__(self) -> None:
        self.port = _free_port()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 30
        while True:
            try:
                self.get("/workers")
                return
            except (OSError, urllib.error.URLError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    pytest.skip("dynamo.indexer did not start")
                time.sleep(0.1)

    def _call(self, path: str, body: Any | None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            data=data,
            headers={"content-type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read())

    def get(self, path: str) -> Any:
        return self._call(path, None)

    def register(self, instance: int, pub: ZmqEventPublisher) -> None:
        # The engine binds tcp://*:P; Dynamo connects to a host address.
        endpoint = pub.endpoint.replace("*", "127.0.0.1")
        self.register_at(instance, endpoint, (pub.replay_endpoint or "").replace("*", "127.0.0.1"))

    def register_at(self, instance: int, endpoint: str, replay: str) -> None:
        got = self._call(
            "/register",
            {
                "instance_id": instance,
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "model_name": MODEL_NAME,
                "block_size": TPB,
            },
        )
        assert got == {"status": "ok"}

    def score(self, instance: int, prompt: list[int]) -> int:
        """Dynamo's matched tokens for ``prompt`` on ``instance``; the last prompt token is
        never reused by the engine, so the query leaves it out."""
        got = self._call("/query", {"token_ids": prompt[:-1], "model_name": MODEL_NAME})
        return int(sum(got["scores"].get(str(instance), {}).values()))

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


@pytest.fixture
def dynamo() -> Iterator[Dynamo]:
    d = Dynamo()
    try:
        yield d
    finally:
        d.stop()


def _engine(blocks: int, events: int = 100_000) -> tuple[KVCacheManager, ZmqEventPublisher]:
    config = KvCacheConfig(
        tokens_per_block=TPB,
        backend="virtual",
        event_buffer_max_size=events,
        enable_partial_reuse=False,
    )
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    kv = KVCacheManager.from_blocks(model, config, {64: blocks}, max_seq_len=64, max_batch_size=4)
    pub = ZmqEventPublisher(kv, f"tcp://*:{_free_port()}", f"tcp://*:{_free_port()}")
    return kv, pub


def _bases(rng: random.Random) -> list[list[int]]:
    """Six shared prefixes of 12 to 36 tokens."""
    return [[rng.randrange(1, 5000) for _ in range(rng.randrange(12, 37))] for _ in range(6)]


def _run(
    kv: KVCacheManager, pub: ZmqEventPublisher, rng: random.Random, bases: list[list[int]], n: int
) -> list[list[int]]:
    """``n`` seeded requests (a prefix of a base plus 0-8 tokens of their own), at most two
    running at once, one published batch per step; returns their prompts."""
    live: list[int] = []
    prompts: list[list[int]] = []
    for _ in range(n):
        base = rng.choice(bases)
        prompt = base[: rng.randrange(5, len(base) + 1)]
        prompt = prompt + [rng.randrange(1, 5000) for _ in range(rng.randrange(0, 9))]
        rid = rng.randrange(2**40)
        kv.add_sequence(rid, prompt)
        live.append(rid)
        prompts.append(prompt)
        while len(live) > 2 or (live and rng.random() < 0.4):
            kv.remove_sequence(live.pop(0))  # stores its blocks for reuse
        pub.publish()
    for rid in live:
        kv.remove_sequence(rid)
    pub.publish()
    return prompts


def _probes(
    rng: random.Random, bases: list[list[int]], prompts: list[list[int]]
) -> list[list[int]]:
    """Every prompt run, and prefixes of the bases with a foreign tail."""
    out = [list(p) for p in prompts]
    for b in bases:
        for cut in range(2, len(b) + 1, 3):
            out.append([*b[:cut], rng.randrange(5000, 6000)])
    return out


def _agree(
    dynamo: Dynamo, instance: int, want: dict[tuple[int, ...], int]
) -> dict[tuple[int, ...], tuple[int, int]]:
    """Waits (up to 20 s) for Dynamo to apply what was published; returns the prompts on which
    its score still differs from ``want``, with (Dynamo's, wanted)."""
    deadline = time.monotonic() + 20
    while True:
        wrong = {}
        for p, w in want.items():
            got = dynamo.score(instance, list(p))
            if got != w:
                wrong[p] = (got, w)
        if not wrong or time.monotonic() > deadline:
            return wrong
        time.sleep(0.2)


def test_dynamo_scores_equal_each_managers_reusable_prefix_through_eviction(
    dynamo: Dynamo,
) -> None:
    rng = random.Random(SEED)
    bases = _bases(rng)
    engines = {1: _engine(blocks=24), 2: _engine(blocks=40)}
    try:
        for instance, (_, pub) in engines.items():
            dynamo.register(instance, pub)
        time.sleep(0.5)  # Dynamo's SUB sockets connect (a gap is also replayed: next test)
        for round_ in range(3):
            for instance, (kv, pub) in engines.items():
                prompts = _run(kv, pub, rng, bases, 25)
                probes = _probes(rng, bases, prompts)
                want = {tuple(p): kv.get_reusable_prefix_length(p) for p in probes}
                assert sum(v > 0 for v in want.values()) >= 10  # reuse to find
                wrong = _agree(dynamo, instance, want)
                assert not wrong, (round_, instance, list(wrong.items())[:5])
            s = engines[1][0].get_kv_cache_stats()
        assert s.alloc_new_blocks > 24  # the small engine evicted
    finally:
        for _, pub in engines.values():
            pub.close()


class LossyRelay:
    """A network fault between an engine and Dynamo: forwards the engine's PUB stream from a
    port of its own, dropping the batches numbered in ``drop``. Replays go to the engine."""

    def __init__(self, pub: ZmqEventPublisher, drop: set[int]) -> None:
        import zmq

        ctx = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(pub.endpoint.replace("*", "127.0.0.1"))
        self.out = ctx.socket(zmq.PUB)
        self.port = _free_port()
        self.out.bind(f"tcp://127.0.0.1:{self.port}")
        self.drop = drop
        self.dropped: list[int] = []
        self.forwarded = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self.sub.poll(20):
                continue
            frames = self.sub.recv_multipart()
            seq = int.from_bytes(frames[1], "big")
            if seq in self.drop:
                self.dropped.append(seq)
            else:
                self.out.send_multipart(frames)
                self.forwarded += 1

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.sub.close(linger=0)
        self.out.close(linger=0)


def test_a_batch_lost_on_the_wire_is_replayed_from_the_engines_ring(dynamo: Dynamo) -> None:
    rng = random.Random(SEED + 1)
    bases = _bases(rng)
    kv, pub = _engine(blocks=64)
    relay = LossyRelay(pub, drop={2, 3})
    try:
        endpoint = f"tcp://127.0.0.1:{relay.port}"
        replay = (pub.replay_endpoint or "").replace("*", "127.0.0.1")
        dynamo.register_at(5, endpoint, replay)
        time.sleep(1.0)  # the relay's and Dynamo's SUB sockets connect
        prompts = _run(kv, pub, rng, bases, 10)
        want = {tuple(p): kv.get_reusable_prefix_length(p) for p in _probes(rng, bases, prompts)}
        wrong = _agree(dynamo, 5, want)
        assert relay.dropped == [2, 3] and relay.forwarded == pub.next_seq - 2
        assert not wrong, list(wrong.items())[:5]
        # Batches 2 and 3 stored blocks that only the replay gave Dynamo.
        assert sum(v > 0 for v in want.values()) >= 10
    finally:
        relay.close()
        pub.close()


def test_all_blocks_cleared_after_lost_events_agrees_with_kvcaches_own_index(
    dynamo: Dynamo,
) -> None:
    rng = random.Random(SEED + 2)
    bases = _bases(rng)
    kv, pub = _engine(blocks=256, events=8)  # a ring of 8 events: a busy step loses some
    index = KvIndexer()
    sub = ZmqEventSubscriber(
        index,
        {
            "e": (
                pub.endpoint.replace("*", "127.0.0.1"),
                pub.replay_endpoint.replace("*", "127.0.0.1"),
            )
        },
    )  # type: ignore[union-attr]
    try:
        dynamo.register(4, pub)
        time.sleep(0.5)
        first = _run(kv, pub, rng, bases, 3)
        for rid in range(30):  # one step storing 30 chains: more than 8 events, some lost
            p = [rng.randrange(1, 5000) for _ in range(13)]
            kv.add_sequence(10_000 + rid, p)
            kv.remove_sequence(10_000 + rid)
        pub.publish()  # starts with AllBlocksCleared
        later = _run(kv, pub, rng, bases, 3)
        assert pub.num_lost_events > 0
        probes = _probes(rng, bases, first + later)
        deadline = time.monotonic() + 20
        while sub.last_seq("e") != pub.next_seq - 1:
            assert time.monotonic() < deadline
            if sub.poll(20) == 0:
                sub.catch_up("e")
        want = {tuple(p): index.match("e", p) for p in probes}
        assert not _agree(dynamo, 4, want)
        # Both under-estimate the engine after the clear, never over-estimate it.
        engine = {tuple(p): kv.get_reusable_prefix_length(p) for p in probes}
        assert all(want[p] <= engine[p] for p in want)
        assert any(want[p] < engine[p] for p in want)
    finally:
        sub.close()
        pub.close()


def test_dynamo_1_6_1_reads_sliding_window_engines_as_full_attention(dynamo: Dynamo) -> None:
    """Documented, not endorsed: Dynamo keys one tree per worker and ignores ``group_idx`` and
    the window, so on an engine with a sliding window it predicts what full attention would
    reuse: never less than the engine, more where the window's blocks were released."""
    rng = random.Random(SEED + 3)
    bases = _bases(rng)
    config = KvCacheConfig(
        tokens_per_block=TPB,
        backend="virtual",
        event_buffer_max_size=100_000,
        enable_partial_reuse=False,
        max_attention_window=[8, None],
    )
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    kv = KVCacheManager.from_blocks(
        model, config, {8: 24, 64: 64}, max_seq_len=64, max_batch_size=4
    )
    pub = ZmqEventPublisher(kv, f"tcp://*:{_free_port()}", f"tcp://*:{_free_port()}")
    try:
        dynamo.register(6, pub)
        time.sleep(0.5)
        prompts = _run(kv, pub, rng, bases, 25)
        probes = _probes(rng, bases, prompts)
        engine = {tuple(p): kv.get_reusable_prefix_length(p) for p in probes}
        deadline = time.monotonic() + 20
        while True:  # until Dynamo applied everything (it never predicts less then)
            got = {p: dynamo.score(6, list(p)) for p in engine}
            if all(got[p] >= engine[p] for p in engine) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert all(got[p] >= engine[p] for p in engine)
        assert sum(got[p] > engine[p] for p in engine) >= 5
    finally:
        pub.close()
