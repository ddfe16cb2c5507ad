"""Forks (beam search): what ``fork_sequence`` and a beam step cost.

Prints a table of medians; never asserts. Run: ``python bench/bench_fork.py``.

Model: 24 layers, 8 KV heads of 128 (bf16), windows {1024, full}, 32-token blocks.

* ``fork_sequence`` of a sequence holding ``P`` tokens into 3 children, for ``P`` of 1k, 4k and
  16k tokens, virtual backend (bookkeeping only): its cost grows with the blocks held (one
  reference each, per window) and takes no block and copies nothing (free blocks and
  ``copied_on_write_blocks`` are checked unchanged).
* A beam step right after the fork: one ``add_tokens`` call for the 4 beams, each a different
  token, the prompt's last block partly filled: 3 copies on write per window (the last beam
  writes in place), on the host backend (the copies are memcpy of a 1.5 MiB block: 24 layers x
  K/V x 8 heads x 32 tokens x 128 x 2 bytes) and on the virtual one (bookkeeping alone); then
  the next step, which copies nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

BEAMS = 4
WINDOWS = (1024, None)


def _manager(backend: str, max_seq_len: int, blocks: int) -> KVCacheManager:
    model = ModelConfig(num_layers=24, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    config = KvCacheConfig(
        tokens_per_block=32,
        max_attention_window=list(WINDOWS),
        backend=backend,
        enable_block_reuse=False,
    )
    return KVCacheManager.from_blocks(
        model,
        config,
        {1024: blocks, max_seq_len: blocks},
        max_seq_len=max_seq_len,
        max_batch_size=BEAMS,
    )


def bench_fork(prompt_len: int, repeats: int) -> tuple[float, int]:
    """Median us of one fork_sequence into BEAMS - 1 children; the blocks the parent holds."""
    blocks = (prompt_len + 64) // 32 + BEAMS + 2
    m = _manager("virtual", prompt_len + 64, blocks)
    prompt = np.arange(prompt_len, dtype=np.int32) % 30000
    children = list(range(1, BEAMS))
    times = []
    held = 0
    for _ in range(repeats):
        m.add_sequence(0, prompt)
        held = sum(len(m.get_cache_block_ids(0, w)) for w in m.window_sizes)
        free = [m.get_num_free_blocks(w) for w in m.window_sizes]
        t0 = time.perf_counter_ns()
        m.fork_sequence(0, children)
        times.append((time.perf_counter_ns() - t0) / 1e3)
        assert [m.get_num_free_blocks(w) for w in m.window_sizes] == free  # no block taken
        assert m.get_kv_cache_stats().copied_on_write_blocks == 0  # nothing copied
        for rid in range(BEAMS):
            m.remove_sequence(rid, store_for_reuse=False)
    return statistics.median(times), held


def bench_beam_step(backend: str, repeats: int) -> tuple[float, float, int]:
    """Median us of the first beam step after a fork (copies) and of the next one; the
    blocks copied per first step."""
    prompt_len = 4008  # 125 full blocks and 8 tokens: the last block is shared partly filled
    prompt = np.arange(prompt_len, dtype=np.int32) % 30000
    m = _manager(backend, 8192, (prompt_len + 64) // 32 + 2 * BEAMS + 4)
    ids = list(range(BEAMS))
    first, second = [], []
    copied = 0
    for r in range(repeats):
        m.add_sequence(0, prompt)
        m.fork_sequence(0, ids[1:])
        before = m.get_kv_cache_stats().copied_on_write_blocks
        tokens = [r * BEAMS + i for i in ids]
        t0 = time.perf_counter_ns()
        m.add_tokens(ids, tokens)
        t1 = time.perf_counter_ns()
        m.add_tokens(ids, tokens)
        t2 = time.perf_counter_ns()
        copied = m.get_kv_cache_stats().copied_on_write_blocks - before
        first.append((t1 - t0) / 1e3)
        second.append((t2 - t1) / 1e3)
        for rid in ids:
            m.remove_sequence(rid, store_for_reuse=False)
    return statistics.median(first), statistics.median(second), copied


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    print(f"fork_sequence into {BEAMS - 1} children (virtual backend), median of {args.repeats}")
    print(f"  {'prompt':>8}  {'blocks held':>11}  {'us':>8}  {'ns/block':>8}")
    for p in (1024, 4096, 16384):
        us, held = bench_fork(p, args.repeats)
        print(f"  {p:>8}  {held:>11}  {us:>8.2f}  {1e3 * us / held:>8.1f}")
    print(f"\nbeam step of {BEAMS} beams after the fork (one add_tokens call)")
    print(f"  {'backend':>8}  {'copied':>6}  {'first us':>9}  {'next us':>8}")
    for backend in ("virtual", "host"):
        first, second, copied = bench_beam_step(backend, args.repeats)
        print(f"  {backend:>8}  {copied:>6}  {first:>9.2f}  {second:>8.2f}")


if __name__ == "__main__":
    main()
