"""Bad input to the manager: out-of-range integers.

Every case checks the exact exception type and that the message names the argument.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)


def make(**config: Any) -> KVCacheManager:
    """Two windows (8 and full 64), 4-token blocks, host memory, one 5-token sequence (id 1)."""
    cfg = KvCacheConfig(
        tokens_per_block=4, max_attention_window=[8, None], backend="host", **config
    )
    m = KVCacheManager.from_blocks(MODEL, cfg, {8: 8, 64: 8}, max_seq_len=64, max_batch_size=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    return m


# --------------------------------------------------------------------------------------
# Events and block offsets
# --------------------------------------------------------------------------------------


def test_get_latest_events_with_a_huge_timeout_waits_for_an_event() -> None:
    m = make(event_buffer_max_size=64)
    m.get_latest_events()  # drop "created"
    got: list[str] = []

    def consume() -> None:
        got.extend(e.kind for e in m.get_latest_events(timeout_ms=2**62))

    def produce() -> None:
        time.sleep(0.05)
        m.add_sequence(2, list(range(100, 109)))
        m.store_context_blocks(2)

    consumer = threading.Thread(target=consume, daemon=True)
    producer = threading.Thread(target=produce)
    start = time.monotonic()
    consumer.start()
    producer.start()
    consumer.join(timeout=30)
    producer.join()
    if consumer.is_alive():  # never returned: release it before failing
        m.remove_sequence(2)
        consumer.join(timeout=30)
        pytest.fail("get_latest_events(timeout_ms=2**62) did not return after an event")
    assert time.monotonic() - start >= 0.04, "returned before the event was pushed"
    assert "stored" in got
