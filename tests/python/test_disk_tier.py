"""The disk tier below host memory, through the Python API: bytes, sizing, events, simulate."""

from __future__ import annotations

import gc
from pathlib import Path

import numpy as np
import pytest

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.cli import main

MODEL = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=8)


def make(tmp_path: Path, blocks: tuple[int, int, int] = (3, 1, 4)) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=4,
        backend="host",
        event_buffer_max_size=1000,
        disk_cache_dir=str(tmp_path / "tier"),
        host_cache_size=1,  # only validated here: from_blocks takes exact counts
        disk_cache_size=1,
    )
    return KVCacheManager.from_blocks(MODEL, config, {64: blocks}, max_seq_len=64, max_batch_size=4)


def _fill(m: KVCacheManager, block: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for layer in range(MODEL.num_layers):
        buf = m.get_buffers(layer)
        buf[block] = rng.standard_normal(buf[block].shape).astype(buf.dtype)
        out.append(buf[block].copy())
    return out


def test_store_evict_to_host_then_disk_then_onboard_keeps_every_byte(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    m = make(tmp_path)
    a = list(range(9))
    m.add_sequence(1, a)  # blocks 0, 1, 2
    want = [_fill(m, b, rng) for b in m.get_cache_block_ids(1, 64)[:2]]
    m.remove_sequence(1)
    m.get_latest_events()
    # Another prompt takes all three primary blocks: A's second block goes to host memory,
    # then on to disk when the first one takes its place in host memory.
    m.add_sequence(2, list(range(100, 109)))
    moves = [e.data["cache_level"] for e in m.get_latest_events() if e.kind == "updated"]
    assert moves == [(0, 1), (1, 2), (0, 1)]
    for b in m.get_cache_block_ids(2, 64):
        _fill(m, b, rng)  # the other prompt writes every primary block
    m.remove_sequence(2, store_for_reuse=False)
    files = list((tmp_path / "tier").iterdir())
    assert len(files) == 1 and files[0].stat().st_size == 2 * 2 * 2 * 4 * 8 * 2  # 1 slot of 512 B
    # A again: one block onboarded from host memory, one from disk, both byte for byte.
    assert m.add_sequence(3, a) == 8
    moves = [e.data["cache_level"] for e in m.get_latest_events() if e.kind == "updated"]
    assert moves == [(1, 0), (2, 0)]
    for j, block in enumerate(m.get_cache_block_ids(3, 64)[:2]):
        for layer in range(MODEL.num_layers):
            np.testing.assert_array_equal(m.get_buffers(layer)[block], want[j][layer])
    stats = m.get_kv_cache_stats()
    assert (stats.offloaded_blocks, stats.onboarded_blocks) == (2, 2)
    m.check_invariants()
    assert m.disk_blocks_per_window == {64: 4}
    del m
    gc.collect()
    assert list((tmp_path / "tier").iterdir()) == []  # the manager's files are gone


def test_the_publisher_reports_disk_as_its_own_medium(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvcache.events import ZmqEventPublisher

    m = make(tmp_path)
    pub = ZmqEventPublisher(m, "inproc://disk-medium")
    try:
        m.add_sequence(1, list(range(9)))
        m.remove_sequence(1)
        m.add_sequence(2, list(range(100, 109)))
        events = pub.convert(m.get_latest_events())
        media = [(type(e).__name__, e.medium) for e in events]
        assert media == [
            ("BlockStored", "GPU"),
            ("BlockRemoved", "GPU"),
            ("BlockStored", "CPU"),
            ("BlockRemoved", "CPU"),
            ("BlockStored", "DISK"),
            ("BlockRemoved", "GPU"),
            ("BlockStored", "CPU"),
        ]
        a0, a1 = events[0].block_hashes
        assert events[4].block_hashes == [a1] and events[4].parent_block_hash == a0
    finally:
        pub.close()


def test_disk_budget_is_split_like_the_host_budget() -> None:
    config = KvCacheConfig(
        tokens_per_block=16,
        max_attention_window=[64, None],
        backend="virtual",
        host_cache_size=2**20,
        disk_cache_size=4 * 2**20,
    )
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64)  # 4 KiB per block and layer
    m = KVCacheManager(model, config, max_seq_len=1024, max_batch_size=4, primary_bytes=2**20)
    assert m.blocks_per_window == {64: (128, 128), 1024: (128, 128)}
    assert m.disk_blocks_per_window == {64: 512, 1024: 512}
    plain = KVCacheManager(
        model,
        KvCacheConfig(tokens_per_block=16, backend="virtual"),
        max_seq_len=1024,
        max_batch_size=4,
        primary_bytes=2**20,
    )
    assert plain.disk_blocks_per_window == {1024: 0}


def test_bad_disk_settings() -> None:
    with pytest.raises(ValueError, match="needs host_cache_size"):
        KvCacheConfig(disk_cache_size=2**20)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        KvCacheConfig(host_cache_size=1, disk_cache_size=1, disk_cache_dir="")
    with pytest.raises(ValueError, match="disk_cache_size"):
        KvCacheConfig(disk_cache_size=-1)
    config = KvCacheConfig(tokens_per_block=4, backend="virtual")
    with pytest.raises(ValueError, match="disk blocks but no secondary"):
        KVCacheManager.from_blocks(MODEL, config, {64: (4, 0, 2)}, max_seq_len=64, max_batch_size=1)
    with pytest.raises(ValueError, match="triple"):
        KVCacheManager.from_blocks(
            MODEL, config, {64: (4, 0, 2, 1)}, max_seq_len=64, max_batch_size=1
        )


def test_simulate_shows_the_extra_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--num-conversations", "40", "--memory", "2GiB", "--no-progress"]
    assert main([*args, "--host-cache", "512MiB", "--disk-cache", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "disk cache 4.00 GiB" in out
    line = next(x for x in out.splitlines() if "disk tier" in x)
    with_disk, without = (float(x.split("%")[0]) for x in line.split("hit rate ")[1].split(", "))
    assert with_disk > without
    assert main([*args, "--disk-cache", "4GiB"]) == 2
    assert "--disk-cache needs --host-cache" in capsys.readouterr().err
