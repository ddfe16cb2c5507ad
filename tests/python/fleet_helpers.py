"""Helpers shared by the router tests (tests/python/test_router.py, test_shared_tier.py)."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any

from kvcache import OutOfBlocksError

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


def advance_random_sequence(kv: Any, live: dict[int, int], rng: random.Random, token: int) -> None:
    """One random operation on one of ``live``'s sequences (request id -> tokens still to
    generate) of manager ``kv``: a prefill chunk of 4, a rewind of one token (a rejected draft),
    or 1 to 4 decoded tokens (random, or ``token``, the one a prompt starts with); the sequence
    is removed once done or past 40 tokens, else stores its context blocks at times."""
    rid = rng.choice(list(live))
    left = kv.prompt_length(rid) - kv.num_tokens(rid)
    try:
        if left > 0:
            kv.prefill(rid, min(4, left))
        elif rng.random() < 0.15 and kv.num_tokens(rid) > kv.prompt_length(rid) + 1:
            # A rejected draft: rewinds cut blocks the window may have stored.
            kv.rewind(rid, 1)
        else:
            for _ in range(rng.randrange(1, 5)):
                kv.add_token(rid, rng.choice([rng.randrange(1000), token]))
                live[rid] -= 1
    except OutOfBlocksError:
        live[rid] = 0
    except ValueError as e:  # a rewind into tokens a window released
        assert "already released" in str(e)
    if live[rid] <= 0 or kv.num_tokens(rid) > 40:
        kv.remove_sequence(rid)
        del live[rid]
    elif rng.random() < 0.3:
        kv.store_context_blocks(rid)  # during chunked prefill too
