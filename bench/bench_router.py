"""The router index against the engines' own lookups, side by side in one process (issue 35).

Four engines (virtual backend, 32-token blocks, 2,000 blocks each: eviction), fed 500 seeded
requests each over 20 shared 1,024-token system prompts (prompts 1,000-4,000 tokens); every
engine's events go to one ``KvIndexer`` as raw msgpack batches (one per request). Then 2,000
queries (a random request's prompt prefix plus a tail): per query, median µs of

* one engine's own ``get_reusable_prefix_length`` (the native lookup, hashing included);
* ``KvIndexer.scores`` (every engine's answer at once, hashing included);
* ``KvIndexer.match`` on each of the four engines (four calls).

Also the time to apply the whole event stream. Every answer is checked equal to the engine's.
Prints a table; never asserts timings; seeded. ``python bench/bench_router.py`` (``--quick``:
100 requests per engine and 400 queries). Needs the events extra (pyzmq, msgspec).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.events import EventBatcher
from kvcache.router import KvIndexer

TPB = 32
ENGINES = 4


def _engine() -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=TPB,
        backend="virtual",
        event_buffer_max_size=1_000_000,
        enable_partial_reuse=False,
    )
    model = ModelConfig(num_layers=4, num_kv_heads=8, head_dim=128)
    return KVCacheManager.from_blocks(
        model, config, {8192: 2000}, max_seq_len=8192, max_batch_size=8
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    requests, queries = (100, 400) if args.quick else (500, 2000)
    rng = np.random.default_rng(35)
    systems = [rng.integers(0, 32000, 1024).tolist() for _ in range(20)]
    engines = [_engine() for _ in range(ENGINES)]
    batchers = [EventBatcher(kv) for kv in engines]
    index = KvIndexer()
    prompts: list[list[int]] = []
    apply_s = 0.0
    batches = 0
    for e, (kv, batcher) in enumerate(zip(engines, batchers, strict=True)):
        for r in range(requests):
            own = rng.integers(0, 32000, int(rng.integers(0, 3000))).tolist()
            prompt = (
                systems[int(rng.integers(20))] + own if rng.random() < 0.7 else own + [1] * 1000
            )
            kv.add_sequence(r, prompt)
            kv.remove_sequence(r)
            prompts.append(prompt)
            payload = batcher.batch()
            if payload is not None:
                t = time.perf_counter()
                index.apply(e, payload)
                apply_s += time.perf_counter() - t
                batches += 1
    pick = random.Random(35)
    native, scores, matches = [], [], []
    hits = 0
    for _ in range(queries):
        base = pick.choice(prompts)
        q = base[: pick.randrange(64, len(base) + 1)] + [pick.randrange(32000) for _ in range(16)]
        t = time.perf_counter()
        want0 = engines[0].get_reusable_prefix_length(q)
        native.append(time.perf_counter() - t)
        t = time.perf_counter()
        got = index.scores(q)
        scores.append(time.perf_counter() - t)
        t = time.perf_counter()
        each = [index.match(e, q) for e in range(ENGINES)]
        matches.append(time.perf_counter() - t)
        want = [kv.get_reusable_prefix_length(q) for kv in engines]
        assert want[0] == want0 and list(got.values()) == want == each, (want, got, each)
        hits += sum(w > 0 for w in want)
    us = lambda xs: statistics.median(xs) * 1e6  # noqa: E731
    print(
        f"{ENGINES} engines, {requests} requests each, {batches} batches, {queries} queries "
        f"({hits} engine hits), every answer equal to the engine's"
    )
    print(f"  events applied          {apply_s:.3f} s ({apply_s / batches * 1e6:.0f} µs per batch)")
    print(f"  native lookup (1 engine)  {us(native):7.1f} µs")
    print(f"  KvIndexer.scores (all)    {us(scores):7.1f} µs  ({us(scores) / us(native):.1f}x)")
    ratio = us(matches) / us(native)
    print(f"  KvIndexer.match x {ENGINES}       {us(matches):7.1f} µs  ({ratio:.1f}x)")


if __name__ == "__main__":
    main()
