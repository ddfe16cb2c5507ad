"""A real redis-server for the shared-tier tests (test_shared_tier.py,
test_shared_tier_faults.py): a throwaway server on a free port, and the managers, model and
prompt those tests share."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

# Layers 0 and 2 slide over 8 tokens (2 blocks of 4), layers 1 and 3 are full attention.
MODEL = ModelConfig(num_layers=4, num_kv_heads=2, head_dim=8)
SWA, FULL = 8, 64
PROMPT = list(range(30))  # 29 keyed tokens: 7 full blocks
FULL_BLOCKS = 7


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """A redis-server of its own on a free port, in a temporary directory."""

    def __init__(self, tmp: Path, password: str | None = None) -> None:
        self.port = free_port()
        self.password = password
        auth = [] if password is None else ["--requirepass", password]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = subprocess.Popen(
            [
                "redis-server",
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(tmp),
                *auth,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                if self.client().ping():
                    break
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.02)

    def client(self):  # type: ignore[no-untyped-def]
        import redis

        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=5, password=self.password
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.terminate()
            self.proc.wait(10)


def make(
    url: str | None,
    model: ModelConfig = MODEL,
    blocks: dict[int, tuple[int, int]] | None = None,
    max_attention_window: list[int | None] | None = [SWA, None],  # noqa: B006 (never mutated)
    **kw: object,
) -> KVCacheManager:
    if url is not None:
        # A loaded test machine must not turn a lookup into a timeout miss: the tests of
        # timeouts set their own.
        kw.setdefault("shared_cache_timeout_ms", 1000)
    config = KvCacheConfig(
        tokens_per_block=4,
        backend="host",
        max_attention_window=max_attention_window,
        shared_cache_url=url,
        event_buffer_max_size=1000,
        **kw,  # type: ignore[arg-type]
    )
    counts = blocks or {SWA: (8, 0), FULL: (16, 0)}
    return KVCacheManager.from_blocks(model, config, counts, max_seq_len=64, max_batch_size=4)


def window_of(layer: int) -> int:
    return SWA if layer % 2 == 0 else FULL


def compute_and_store(
    m: KVCacheManager, seed: int = 0, windows: tuple[int, ...] = (SWA, FULL)
) -> dict[tuple[int, int], list[np.ndarray]]:
    """Request 1 runs PROMPT: every block gets random KV, then the request ends and stores it.
    Returns the bytes of every (window, position) it stored, one array per layer."""
    rng = np.random.default_rng(seed)
    assert m.add_sequence(1, PROMPT) == 0
    for layer in range(MODEL.num_layers):
        buf = m.get_buffers(layer)
        buf[...] = rng.standard_normal(buf.shape).astype(buf.dtype)
    want: dict[tuple[int, int], list[np.ndarray]] = {}
    for w in windows:
        for d, b in enumerate(m.get_cache_block_ids(1, w)[:FULL_BLOCKS]):
            want[w, d] = [
                m.get_buffers(layer)[b].copy() for layer in range(4) if window_of(layer) == w
            ]
    m.remove_sequence(1)
    assert m.flush_shared_cache(timeout_ms=10_000)
    return want


def held_bytes(m: KVCacheManager, request: int, w: int, d: int) -> list[np.ndarray]:
    b = m.get_cache_block_ids(request, w)[d]
    return [m.get_buffers(layer)[b] for layer in range(4) if window_of(layer) == w]
