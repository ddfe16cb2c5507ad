"""Fixed-work targets for instruction counts (``valgrind --tool=callgrind``); never asserts.

Run one operation ``n`` times (``python bench/callgrind_ops.py OP N``) under callgrind twice,
with two values of ``N``: the difference of the two totals divided by the difference of ``N``
is the cost of one iteration, Python calls included, with the interpreter's start-up and the
set-up cancelled out. Operations:

* ``miss``: ``add_sequence`` of a prepared 2,500-token prompt that misses the cache, then
  ``remove_sequence(store_for_reuse=False)`` (as ``bench_manager.py``).
* ``retry``: ``get_num_blocks_to_allocate`` of a prepared 2,500-token prompt behind a cached
  1,024-token system prompt (a deferred admission retried).
* ``add_tokens``: one decode step of 256 sequences, windows {128, full}, token and id lists;
  ``add_tokens_np``: the same with an int64 id array and an int32 token array.
* ``replay``: the chunked-prefill replay of ``bench_reuse.py`` (chunks of 512, ``auto``
  split, placeholder) with ``N`` requests.
* ``replay_calls``: the same replay, every timed manager call (what ``manager_s`` sums) made
  through a ``functools.partial``, so that ``valgrind --tool=callgrind
  --toggle-collect=partial_vectorcall`` counts the manager calls alone (Python call overhead
  included), without the replay's own work. Toggle on ``partial_vectorcall`` only: a call with
  keyword arguments (``add_sequence(..., prefill=k)``, ``get_num_blocks_to_allocate(...,
  prefill=k)``) goes on from it into ``partial_call``, and toggling on that too would switch
  collection off inside those calls.
  ``replay_whole_calls``: the same with whole-prompt prefill.

Compare builds made the same way from scratch: LTO's inlining can move counts by a few
percent. The Release extension pip installs is stripped; for function names in
``callgrind_annotate``, configure a separate build with ``-DCMAKE_BUILD_TYPE=Release
-DCMAKE_CXX_FLAGS=-g -DCMAKE_STRIP=/bin/true -DKVCACHE_BUILD_PYTHON=ON``, build the ``_core``
target and put a copy of ``python/kvcache`` with that ``_core`` in it first on ``PYTHONPATH``.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig


def _reuse_manager() -> KVCacheManager:
    model = ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    config = KvCacheConfig(tokens_per_block=32, max_attention_window=[512, None], backend="virtual")
    return KVCacheManager.from_blocks(
        model, config, {512: 40000, 8192: 40000}, max_seq_len=8192, max_batch_size=4096
    )


def miss(n: int) -> None:
    rng = np.random.default_rng(7)
    m = _reuse_manager()
    prompts = [m.prepare(rng.integers(0, 32000, 2500, dtype=np.int32)) for _ in range(4)]
    for i in range(n):
        m.add_sequence(i, prompts[i % 4])
        m.remove_sequence(i, store_for_reuse=False)


def retry(n: int) -> None:
    rng = np.random.default_rng(7)
    m = _reuse_manager()
    system = rng.integers(0, 32000, 1024, dtype=np.int32)
    m.add_sequence(0, system)
    m.remove_sequence(0)
    q = m.prepare(np.concatenate([system, rng.integers(0, 32000, 1500, dtype=np.int32)]))
    for _ in range(n):
        m.get_num_blocks_to_allocate(q)


def add_tokens(n: int, arrays: bool = False) -> None:
    model = ModelConfig(num_layers=24, num_kv_heads=8, head_dim=64, dtype="bfloat16")
    config = KvCacheConfig(tokens_per_block=32, max_attention_window=[128, None], backend="virtual")
    batch = 256
    blocks = batch * ((400 + n) // 32 + 2)
    m = KVCacheManager.from_blocks(
        model, config, {128: blocks, 8192: blocks}, max_seq_len=8192, max_batch_size=4096
    )
    for i in range(batch):
        m.add_sequence(i, np.arange(100 + (i * 7) % 300, dtype=np.int32))
    ids: list[int] | np.ndarray = list(range(batch))
    tokens: list[int] | np.ndarray = [5] * batch
    if arrays:
        ids = np.arange(batch, dtype=np.int64)
        tokens = np.full(batch, 5, dtype=np.int32)
    for _ in range(n):
        m.add_tokens(ids, tokens)


def add_tokens_np(n: int) -> None:
    add_tokens(n, arrays=True)


def replay(n: int, chunk: int | None = 512) -> None:
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import bench_reuse as br

    reqs = br.make_workload(n, 0)
    max_seq_len = max(len(r.prompt) + r.max_new for r in reqs)
    blocks = br.split_blocks(reqs, max_seq_len, "auto", 8192)
    res = br.run_replay(reqs, blocks, max_seq_len, "placeholder", chunk, 8192)
    print(
        f"steps {res.steps} preemptions {res.preemptions} deferred {res.deferred} "
        f"hit {res.hit_rate:.4%} first {res.first_hit_rate:.4%} reused {res.reused_tokens}"
    )


def replay_calls(n: int, chunk: int | None = 512) -> None:
    import functools

    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    import bench_reuse as br

    def call(self: br._Timed, fn: Any, *args: object, **kwargs: object) -> Any:
        return functools.partial(fn, *args, **kwargs)()

    br._Timed.__call__ = call  # type: ignore[assignment,method-assign]
    replay(n, chunk)


def replay_whole_calls(n: int) -> None:
    replay_calls(n, chunk=None)


if __name__ == "__main__":
    ops = {
        "miss": miss,
        "retry": retry,
        "add_tokens": add_tokens,
        "add_tokens_np": add_tokens_np,
        "replay": replay,
        "replay_calls": replay_calls,
        "replay_whole_calls": replay_whole_calls,
    }
    ops[sys.argv[1]](int(sys.argv[2]))
