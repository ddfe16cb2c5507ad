"""Helpers shared by the router tests (tests/python/test_router.py, test_shared_tier.py)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvcache.events import ZmqEventPublisher
    from kvcache.router import ZmqEventSubscriber


def last_seq(sub: ZmqEventSubscriber, engine: str) -> int:
    """The last sequence number the subscriber applied for ``engine``; -1 before any."""
    last = sub.last_seq(engine)
    return -1 if last is None else last


def sync_subscriber(sub: ZmqEventSubscriber, pubs: dict[str, ZmqEventPublisher]) -> None:
    """Polls until the subscriber has applied every batch each publisher sent."""
    deadline = time.monotonic() + 20
    for engine, pub in pubs.items():
        target, polls = pub.next_seq - 1, 0
        while target >= 0 and last_seq(sub, engine) < target:
            assert time.monotonic() < deadline, f"{engine} stuck at {sub.last_seq(engine)}"
            if sub.poll(20) == 0:
                polls += 1
                if polls % 5 == 0:  # the stream went quiet: its last batches were lost
                    sub.catch_up(engine)


def random_probe(
    rng: random.Random, keys: list[dict[str, Any]], bases: list[list[int]]
) -> tuple[list[int], dict[str, Any], dict[str, Any]]:
    """A random probe: a prefix of one of ``bases`` (1 to 28 tokens) under one of ``keys``;
    returns the prompt, the engine's keyword arguments and the router's."""
    key = rng.choice(keys)
    prompt = rng.choice(bases)[: rng.randrange(1, 29)]
    router_key = {"lora_id": key.get("lora_task_id"), "cache_salt": key.get("cache_salt")}
    return prompt, key, router_key
