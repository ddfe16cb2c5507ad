"""Per-step cost of the native manager (virtual backend: bookkeeping only).

Prints a table of medians; never asserts. Run: ``python bench/bench_manager.py``.

* ``add_tokens``: one decode step for a batch of 256 sequences on a model with two windows
  (a 128-token sliding window and full attention), reported as ns per sequence per step.
* ``add_sequence + remove_sequence`` of a 4,096-token prompt.
* Prepared prompts (``KVCacheManager.prepare``): ``add_sequence`` alone of a 2,500-token
  prompt that misses the cache (windows {512, full}, 32-token blocks, reuse on), from a
  Python list, an int32 ndarray and a prepared prompt; and the retry of a deferred admission
  (``get_num_blocks_to_allocate``) of a prompt whose 1,024-token system prompt is cached.
* What a chunk costs: a 4,096-token prepared prompt that misses the cache (the same set-up),
  admitted whole (``add_sequence`` + ``store_context_blocks``) and in 8 chunks of 512
  (``add_sequence(..., prefill=512)``, then 7 x ``prefill`` + ``store_context_blocks``, storing
  after every chunk), each through its first decode step (``add_token``: a whole prompt's
  sliding window releases there what the chunks released along the way). The two managers
  take the same prompts, request by request in turn, so the machine's speed changes hit both
  alike.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig


def _manager(max_seq_len: int, blocks: int, reuse: bool = False) -> KVCacheManager:
    model = ModelConfig(num_layers=24, num_kv_heads=8, head_dim=64, dtype="bfloat16")
    config = KvCacheConfig(
        tokens_per_block=32,
        max_attention_window=[128, None],
        backend="virtual",
        enable_block_reuse=reuse,
    )
    return KVCacheManager.from_blocks(
        model,
        config,
        {128: blocks, max_seq_len: blocks},
        max_seq_len=max_seq_len,
        max_batch_size=4096,
    )


def bench_add_tokens(batch: int, steps: int, repeats: int) -> float:
    """Median ns per sequence per decode step."""
    samples = []
    for r in range(repeats):
        m = _manager(max_seq_len=8192, blocks=batch * ((400 + steps) // 32 + 2))
        ids = np.arange(batch, dtype=np.int64)
        for i in ids:
            m.add_sequence(int(i), np.arange(100 + (int(i) * 7) % 300, dtype=np.int32))
        tokens = np.full(batch, 5, dtype=np.int32)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter_ns()
            m.add_tokens(ids, tokens)
            times.append(time.perf_counter_ns() - t0)
        samples.append(statistics.median(times) / batch)
        del r
    return statistics.median(samples)


def bench_add_remove(prompt_len: int, iterations: int, reuse: bool) -> float:
    """Median µs for add_sequence + remove_sequence of one prompt.

    With reuse on, every iteration after the first is a full hit of the same prompt: the
    lookup (hashing included), claiming the cached blocks and storing the chain again.
    """
    m = _manager(max_seq_len=8192, blocks=1024, reuse=reuse)
    prompt = np.arange(prompt_len, dtype=np.int32)
    times = []
    for i in range(iterations):
        t0 = time.perf_counter_ns()
        m.add_sequence(i, prompt)
        m.remove_sequence(i)
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1000


def _reuse_manager() -> KVCacheManager:
    model = ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    config = KvCacheConfig(tokens_per_block=32, max_attention_window=[512, None], backend="virtual")
    return KVCacheManager.from_blocks(
        model, config, {512: 40000, 8192: 40000}, max_seq_len=8192, max_batch_size=4096
    )


def _median_us(samples: list[int]) -> float:
    return statistics.median(samples) / 1000


def bench_prepared(iterations: int) -> list[tuple[str, float]]:
    """Median µs of add_sequence (a miss) and of an admission retry, raw vs prepared."""
    rng = np.random.default_rng(7)
    out: list[tuple[str, float]] = []
    prompts = [rng.integers(0, 32000, 2500, dtype=np.int32) for _ in range(iterations)]
    for label, convert in (
        ("list", lambda p: p.tolist()),
        ("int32 ndarray", lambda p: p),
        ("prepared", None),
    ):
        m = _reuse_manager()
        inputs = [m.prepare(p) if convert is None else convert(p) for p in prompts]
        times = []
        for i, prompt in enumerate(inputs):
            t0 = time.perf_counter_ns()
            m.add_sequence(i, prompt)
            times.append(time.perf_counter_ns() - t0)
            m.remove_sequence(i, store_for_reuse=False)
        out.append((f"add_sequence, 2,500-token miss, {label}", _median_us(times)))
    system = rng.integers(0, 32000, 1024, dtype=np.int32)
    prompt = np.concatenate([system, rng.integers(0, 32000, 1500, dtype=np.int32)])
    for label, query in (("int32 ndarray", prompt), ("prepared", None)):
        m = _reuse_manager()
        m.add_sequence(0, system)
        m.remove_sequence(0)  # the system prompt is cached
        q = m.prepare(prompt) if query is None else query
        times = []
        for _ in range(iterations):
            t0 = time.perf_counter_ns()
            m.get_num_blocks_to_allocate(q)
            times.append(time.perf_counter_ns() - t0)
        out.append((f"admission retry (1,024-token hit), {label}", _median_us(times)))
    return out


def bench_chunks(
    iterations: int, prompt_len: int = 4096, chunk: int = 512
) -> list[tuple[str, float]]:
    """Median µs of a whole-prompt admission, of the same prompt in chunks (both through the
    first decode step), and of one later chunk (``prefill`` + ``store_context_blocks``)."""
    rng = np.random.default_rng(11)
    whole, chunked = _reuse_manager(), _reuse_manager()
    t_whole, t_chunked, t_chunk = [], [], []
    for i in range(iterations):
        tokens = rng.integers(0, 32000, prompt_len, dtype=np.int32)
        p, q = whole.prepare(tokens), chunked.prepare(tokens)
        t0 = time.perf_counter_ns()
        whole.add_sequence(i, p)
        whole.store_context_blocks(i)
        whole.add_token(i, 7)
        t_whole.append(time.perf_counter_ns() - t0)
        whole.remove_sequence(i, store_for_reuse=False)
        t0 = time.perf_counter_ns()
        chunked.add_sequence(i, q, prefill=chunk)
        chunked.store_context_blocks(i)
        total = time.perf_counter_ns() - t0
        # A chance partial hit (a first token seen before) shifts the chunks by its length.
        while (left := prompt_len - chunked.num_tokens(i)) > 0:
            t1 = time.perf_counter_ns()
            chunked.prefill(i, min(chunk, left))
            chunked.store_context_blocks(i)
            dt = time.perf_counter_ns() - t1
            t_chunk.append(dt)
            total += dt
        t0 = time.perf_counter_ns()
        chunked.add_token(i, 7)
        t_chunked.append(total + time.perf_counter_ns() - t0)
        chunked.remove_sequence(i, store_for_reuse=False)
    n = prompt_len // chunk
    return [
        (f"{prompt_len:,}-token prompt, whole, to its first decode", _median_us(t_whole)),
        (f"the same in {n} chunks of {chunk}", _median_us(t_chunked)),
        ("  one later chunk (prefill + store)", _median_us(t_chunk)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    per_seq = bench_add_tokens(args.batch, args.steps, args.repeats)
    add_remove = bench_add_remove(4096, 2000, reuse=False)
    add_remove_hit = bench_add_remove(4096, 2000, reuse=True)
    print(f"{'benchmark':<48} {'median':>12}")
    print(f"{f'add_tokens, batch {args.batch}, 2 windows':<48} {per_seq:>9.1f} ns/seq/step")
    print(f"{'add_sequence + remove_sequence, 4096 tokens':<48} {add_remove:>9.1f} us")
    print(f"{'  the same with reuse on (a full hit each time)':<48} {add_remove_hit:>9.1f} us")
    for label, us in bench_prepared(2000) + bench_chunks(1000):
        print(f"{label:<48} {us:>9.2f} us")


if __name__ == "__main__":
    main()
