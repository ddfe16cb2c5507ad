"""The router index against the engines' own lookups, side by side in one process (issue 35).

For 4, 32 and 256 engines (virtual backend, 32-token blocks, 2,000 blocks each: eviction),
each engine serves the same kind of seeded requests (20 shared 1,024-token system prompts,
prompts 1,000-4,000 tokens; 200 requests per engine) and publishes one raw msgpack
``KVEventBatch`` per request. Then, in the same process:

* events: the whole stream applied to a fresh ``KvIndexer`` from the raw bytes (native
  decode, check and apply in one call per batch), beside the previous pure-Python
  ``KvIndexer`` (msgspec decode, Python checks and dicts; loaded from git, commit
  ``63d960e``) on the same bytes (each the median of three replays), and Dynamo's
  ``RadixTree.apply_event`` if ``dynamo`` imports (the same stream
  converted to its JSON events beforehand, conversion not timed), for reference;
* queries (a random request's prompt prefix plus a 16-token tail): per query, median µs of
  one engine's own ``KVCacheManager.get_reusable_prefix_length`` (the native lookup, hashing
  included), ``KvIndexer.scores`` (every engine's answer at once, hashing included; a dict),
  ``KvIndexer.best_engine`` (the same lookup, no dict), the
  previous Python ``KvIndexer.scores`` (on at most 300 queries), and Dynamo's
  ``RadixTree.find_matches`` (hashing with ``kvcache.block_hashes`` included).

Every ``scores`` answer is checked equal to every engine's own ``get_reusable_prefix_length``
(and the previous index's); Dynamo's agreement is counted, not required. Prints a table;
never asserts timings; seeded. ``python bench/bench_router.py`` (``--quick``: 40 requests per
engine and 400 queries; ``--engines 4,32`` picks the sizes). Needs the events extra (pyzmq,
msgspec).
"""

from __future__ import annotations

import os

# numpy's OpenBLAS threads spin after every call and take a core from the timed loops (this
# machine has two): one thread. Before numpy is imported.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

import kvcache
from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.events import EventBatcher
from kvcache.router import KvIndexer

TPB = 32
PREVIOUS = "63d960e"  # the last commit with the pure-Python KvIndexer


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


def _previous_indexer() -> Any | None:
    """The pure-Python ``KvIndexer`` of commit ``PREVIOUS`` (None without git history)."""
    root = Path(__file__).resolve().parent.parent
    try:
        source = subprocess.run(
            ["git", "show", f"{PREVIOUS}:python/kvcache/fleet/router.py"],
            cwd=root,
            capture_output=True,
            check=True,
            text=True,
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("kvcache_router_previous")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    exec(compile(source, f"{PREVIOUS}:router.py", "exec"), module.__dict__)
    return module.KvIndexer


def _dynamo() -> Any | None:
    try:
        from dynamo.llm import RadixTree
    except ImportError:
        return None
    return RadixTree


def _dynamo_events(payload: bytes, next_id: list[int]) -> list[bytes | None]:
    """One batch as Dynamo's JSON ``KvCacheEvent``s (``None``: clear the worker)."""
    out: list[bytes | None] = []
    for e in msgspec.msgpack.decode(payload)[1]:
        next_id[0] += 1
        if e["type"] == "BlockStored":
            blocks = [{"block_hash": h, "tokens_hash": h} for h in e["block_hashes"]]
            data: Any = {"stored": {"parent_hash": e.get("parent_block_hash"), "blocks": blocks}}
        elif e["type"] == "BlockRemoved":
            data = {"removed": {"block_hashes": e["block_hashes"]}}
        else:
            out.append(None)
            continue
        out.append(json.dumps({"event_id": next_id[0], "data": data}).encode())
    return out


def _us(xs: list[float]) -> float:
    return statistics.median(xs) * 1e6


def run(n: int, requests: int, queries: int, previous: Any | None, radix: Any | None) -> None:
    rng = np.random.default_rng(35)
    systems = [rng.integers(0, 32000, 1024).tolist() for _ in range(20)]
    engines = [_engine() for _ in range(n)]
    stream: list[tuple[int, bytes]] = []
    prompts: list[list[int]] = []
    for e, kv in enumerate(engines):
        batcher = EventBatcher(kv)
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
                stream.append((e, payload))
    decoded = [msgspec.msgpack.decode(p)[1] for _, p in stream]
    num_events = sum(len(events) for events in decoded)
    num_hashes = sum(len(ev.get("block_hashes", ())) for events in decoded for ev in events)

    def replay(make: Any) -> tuple[Any, float]:
        """The stream applied to fresh indexes, three times: the last index, the median s."""
        took = []
        for _ in range(3):
            target = make()
            t = time.perf_counter()
            for e, payload in stream:
                target.apply(e, payload)
            took.append(time.perf_counter() - t)
        return target, statistics.median(took)

    index, native_apply = replay(KvIndexer)
    old = None
    old_apply = float("nan")
    if previous is not None:
        old, old_apply = replay(previous)
    tree = None
    tree_apply = float("nan")
    if radix is not None:
        tree = radix()
        next_id = [0]
        converted = [(e, _dynamo_events(p, next_id)) for e, p in stream]
        t = time.perf_counter()
        for e, events in converted:
            for ev in events:
                if ev is None:
                    tree.clear_all_blocks(e)
                else:
                    tree.apply_event(e, ev)
        tree_apply = time.perf_counter() - t

    pick = random.Random(35)
    native, scores, bests, olds, trees = [], [], [], [], []
    hits = agree = 0
    for k in range(queries):
        base = pick.choice(prompts)
        q = base[: pick.randrange(64, len(base) + 1)] + [pick.randrange(32000) for _ in range(16)]
        # The three timed calls in turn first, so none always meets a cold prompt.
        calls = [
            (native, engines[0].get_reusable_prefix_length),
            (scores, index.scores),
            (bests, index.best_engine),
        ]
        answers = []
        for j in range(3):
            times, call = calls[(k + j) % 3]
            t = time.perf_counter()
            answers.append(call(q))
            times.append(time.perf_counter() - t)
        want0, got, chosen = (answers[(j - k) % 3] for j in range(3))
        want = [kv.get_reusable_prefix_length(q) for kv in engines]
        assert chosen == (want.index(max(want)), max(want))
        assert want[0] == want0 and list(got.values()) == want, (want, got)
        hits += sum(w > 0 for w in want)
        if old is not None and k < 300:
            t = time.perf_counter()
            before = old.scores(q)
            olds.append(time.perf_counter() - t)
            assert list(before.values()) == want
        if tree is not None:
            t = time.perf_counter()
            found = tree.find_matches(kvcache.block_hashes(q[:-1], TPB)).scores
            trees.append(time.perf_counter() - t)
            agree += all(found.get((e, 0), 0) * TPB == w for e, w in enumerate(want))
    print(
        f"{n} engines: {requests} requests each, {len(stream)} batches, {num_events} events, "
        f"{num_hashes} block hashes; {queries} queries ({hits} engine hits), "
        "every KvIndexer answer equal to the engine's"
    )
    rate = num_events / native_apply
    print(
        f"  events, native from raw msgpack  {native_apply:7.3f} s "
        f"({native_apply / len(stream) * 1e6:6.1f} µs per batch, {rate / 1e3:.0f} k events/s)"
    )
    if old is not None:
        print(
            f"  events, previous Python path     {old_apply:7.3f} s "
            f"({old_apply / len(stream) * 1e6:6.1f} µs per batch; "
            f"native x{old_apply / native_apply:.1f} faster)"
        )
    if tree is not None:
        print(
            f"  events, Dynamo RadixTree (JSON)  {tree_apply:7.3f} s "
            f"({tree_apply / len(stream) * 1e6:6.1f} µs per batch)"
        )
    base_us = _us(native)
    print(f"  one engine's get_reusable_prefix_length  {base_us:7.1f} µs")
    print(
        f"  KvIndexer.scores, all {n:3d} engines      {_us(scores):7.1f} µs "
        f"(x{_us(scores) / base_us:.2f} one engine's lookup)"
    )
    print(
        f"  KvIndexer.best_engine, {n:3d} engines     {_us(bests):7.1f} µs "
        f"(x{_us(bests) / base_us:.2f})"
    )
    if olds:
        print(
            f"  previous KvIndexer.scores ({len(olds)} queries) {_us(olds):7.1f} µs "
            f"(x{_us(olds) / base_us:.2f})"
        )
    if trees:
        print(
            f"  Dynamo RadixTree.find_matches          {_us(trees):7.1f} µs "
            f"(x{_us(trees) / base_us:.2f}; equal on {agree} of {queries} queries)"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--engines", default="4,32,256", help="comma-separated fleet sizes")
    args = ap.parse_args()
    requests, queries = (40, 400) if args.quick else (200, 2000)
    previous = _previous_indexer()
    radix = _dynamo()
    if previous is None:
        print("(no git history: the previous Python index is not run)")
    if radix is None:
        print("(dynamo does not import: Dynamo's RadixTree is not run)")
    for n in (int(x) for x in args.engines.split(",")):
        run(n, requests, queries, previous, radix)


if __name__ == "__main__":
    main()
