"""Disk tier bandwidth: blocks written to disk on eviction, onboarded from disk on a hit.

Prints medians; never asserts. Run: ``python bench/bench_disk.py [--blocks N] [--rounds R]
[--dir DIR]``.

Host backend, one full-attention window, 1 MiB blocks (8 layers x K/V x 8 heads x 32 tokens
x 128 x float16). Each round: prompt A (N full blocks) is stored; prompt B takes every
primary block, so A's blocks go to the host pool (1 block) and on to disk (N - 1 blocks):
*spill*, the time of B's ``add_sequence`` over the bytes written. Then A again: its blocks are
onboarded (N - 1 from disk): *onboard*, the time of A's ``add_sequence`` over the bytes read
from disk, with the files in the page cache (*warm*: just written) and after
``fsync`` + ``posix_fadvise(DONTNEED)`` (*cold*: read from the device, as far as the kernel
drops the pages).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

MODEL = ModelConfig(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16")
TPB = 32
BLOCK_BYTES = 8 * 2 * 8 * TPB * 128 * 2  # 1 MiB


def _drop_page_cache(directory: Path) -> None:
    for f in directory.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _round(n: int, directory: Path, cold: bool) -> tuple[float, float]:
    """(spill GB/s, onboard GB/s) of one round on a fresh manager."""
    config = KvCacheConfig(
        tokens_per_block=TPB,
        backend="host",
        host_cache_size=1,
        disk_cache_size=1,
        disk_cache_dir=str(directory),
    )
    m = KVCacheManager.from_blocks(
        MODEL, config, {n * TPB + 1: (n + 1, 1, n)}, max_seq_len=n * TPB + 1, max_batch_size=2
    )
    for layer in range(MODEL.num_layers):  # touch the pool: a real engine's memory is mapped
        m.get_buffers(layer)[:] = 1
    a = list(range(n * TPB + 1))
    b = [t + 10**6 for t in a]
    m.add_sequence(1, a)
    m.remove_sequence(1)
    t0 = time.perf_counter()
    m.add_sequence(2, b)  # A: 1 block to host memory, n - 1 on to disk
    spill = time.perf_counter() - t0
    m.remove_sequence(2, store_for_reuse=False)
    if cold:
        _drop_page_cache(directory)
    t0 = time.perf_counter()
    reused = m.add_sequence(3, a)
    onboard = time.perf_counter() - t0
    if reused != n * TPB:
        raise SystemExit(f"expected a hit of {n * TPB} tokens, got {reused}")
    disk_bytes = (n - 1) * BLOCK_BYTES
    del m
    return disk_bytes / spill / 1e9, disk_bytes / onboard / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=128, help="blocks per prompt (1 MiB each)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        directory = Path(tmp)
        rows = []
        for cold in (False, True):
            results = [_round(args.blocks, directory, cold) for _ in range(args.rounds)]
            rows.append(
                (
                    "cold" if cold else "warm",
                    statistics.median(r[0] for r in results),
                    statistics.median(r[1] for r in results),
                )
            )
    mib = args.blocks - 1
    print(f"disk tier, {mib} MiB per round through disk, 1 MiB blocks, {args.rounds} rounds")
    print(f"{'page cache':>10} {'spill GB/s':>11} {'onboard GB/s':>13}")
    for name, spill, onboard in rows:
        print(f"{name:>10} {spill:>11.2f} {onboard:>13.2f}")


if __name__ == "__main__":
    main()
