"""Windows that lend each other memory (``KvCacheConfig.lend_free_memory``), from Python:
exact block ids, the shared arena's layout through pools, views and block offsets, joint
admission checks, and the resource manager and scheduler running on it."""

from __future__ import annotations

import numpy as np
import pytest
from test_layer_shapes import mixed

from kvcache import (
    KvCacheConfig,
    KVCacheManager,
    KVCacheResourceManager,
    ModelConfig,
    OutOfBlocksError,
)

TWO = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float16")


def lending(primary: dict[int, int], **kwargs: object) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[4, None],
        backend="host",
        lend_free_memory=True,
        **kwargs,  # type: ignore[arg-type]
    )
    return KVCacheManager.from_blocks(TWO, config, primary, max_seq_len=16, max_batch_size=8)


def test_config_field_is_a_bool() -> None:
    assert KvCacheConfig().lend_free_memory is False
    with pytest.raises(ValueError, match="lend_free_memory"):
        KvCacheConfig(lend_free_memory=1)  # type: ignore[arg-type]
    assert KvCacheConfig.from_dict({"lend_free_memory": True}).lend_free_memory is True


def test_short_window_borrows_and_stats_follow() -> None:
    # Window 4 owns ids 0, 1; full attention (16) ids 2..7 (one block per slab each).
    m = lending({4: 2, 16: 6})
    assert m.lends_free_memory
    assert m.blocks_per_window == {4: (2, 0), 16: (6, 0)}
    assert m.get_num_free_blocks(4) == 8
    m.add_sequence(1, list(range(12)))
    assert m.get_cache_block_ids(1, 4) == [0, 1, 2]
    assert m.get_cache_block_ids(1, 16) == [3, 4, 5]
    stats = m.get_kv_cache_stats()
    assert stats.lent_slabs == 1
    assert stats.num_owned_blocks_per_window_size == {4: 3, 16: 5}
    assert stats.num_free_blocks_per_window_size == {4: 0, 16: 2}
    assert (stats.max_num_blocks, stats.used_num_blocks) == (8, 6)
    assert m.blocks_per_window == {4: (3, 0), 16: (5, 0)}
    assert (m.get_num_free_blocks(4), m.get_num_free_blocks(16), m.get_num_free_blocks()) == (
        2,
        2,
        2,
    )
    m.check_invariants()


def test_can_allocate_is_joint() -> None:
    m = lending({4: 2, 16: 6})
    m.add_sequence(1, list(range(12)))  # full's blocks 6 and 7 are left
    assert m.can_allocate({4: 1, 16: 1})
    assert not m.can_allocate({4: 1, 16: 2})  # both windows count on block 7
    assert m.can_allocate({4: 2})
    assert m.can_allocate({})
    with pytest.raises(ValueError, match="window_size 5 is not one of"):
        m.can_allocate({5: 1})
    with pytest.raises(ValueError, match="blocks count"):
        m.can_allocate({4: 2**40})
    with pytest.raises(OutOfBlocksError, match="wholly free slabs could lend"):
        m.add_sequence(2, list(range(100, 108)))
    m.check_invariants()


def test_without_lending_can_allocate_is_per_window() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[4, None], backend="virtual")
    m = KVCacheManager.from_blocks(TWO, config, {4: 2, 16: 6}, max_seq_len=16, max_batch_size=8)
    assert not m.lends_free_memory
    assert m.can_allocate({4: 2, 16: 6})
    assert not m.can_allocate({4: 3})
    assert m.get_kv_cache_stats().lent_slabs == 0


def test_mixed_pools_interleave_in_one_arena() -> None:
    """Window 8 holds two pools (128 bytes of a block each), full attention two (256 each):
    a window-8 block is 256 bytes, a full block 512, so a slab is 512 bytes (two window-8
    blocks). 3 x 256 + 5 x 512 bytes make 6 slabs: window 8 owns slab 0, full slabs 1-5."""
    m = mixed(lend_free_memory=True)
    assert m.blocks_per_window == {8: (2, 0), 32: (5, 0)}
    pools = m.pools
    base = pools[0]["primary_ptr"]
    layout = [
        (p["primary_ptr"] - base, p["block_bytes"], p["block_stride"], p["num_primary_blocks"])
        for p in pools
    ]
    assert layout == [(0, 128, 256, 12), (128, 128, 256, 12), (0, 256, 512, 6), (256, 256, 512, 6)]
    assert m.get_kv_cache_stats().allocated_bytes == 6 * 512
    buf = m.get_buffers(2)  # window 8's second pool
    assert (buf.shape[0], buf.strides[0], buf.ctypes.data) == (12, 256, base + 128)
    m.add_sequence(1, list(range(6)))  # 2 blocks: window 8 ids 0 1; full ids 1 2
    assert m.get_cache_block_ids(1, 8) == [0, 1]
    assert m.get_cache_block_ids(1, 32) == [1, 2]
    out = np.full((4, 1, 2, 3), 99, dtype=np.int32)
    assert m.copy_block_offsets(out, [1]) == 2
    # block x stride / K-V slab + k; slabs of 32, 64, 128 and 64 bytes
    assert out[:, 0, :, :2].tolist() == [
        [[0, 8], [1, 9]],
        [[0, 4], [1, 5]],
        [[4, 8], [5, 9]],
        [[8, 16], [9, 17]],
    ]
    # Every layer writes its own value into the blocks the request holds: none overwrites
    # another (views of different windows share the arena, blocks do not).
    held = {layer: m.get_cache_block_ids(1, 8 if layer in (0, 2, 4) else 32) for layer in range(6)}
    for layer, blocks in held.items():
        m.get_buffers(layer)[blocks] = layer + 1
    for layer, blocks in held.items():
        assert (m.get_buffers(layer)[blocks] == layer + 1).all(), layer
    m.check_invariants()


def test_sliding_window_borrows_a_slab_of_two_of_its_blocks() -> None:
    m = mixed(lend_free_memory=True)
    # 3 blocks each: window 8 owns 2 and borrows full attention's next victim, slab 1, which
    # holds window-8 blocks 2 and 3; full attention takes 2, 3, 4 (other bytes: its block 2
    # is slab 2).
    m.add_sequence(1, list(range(12)))
    assert m.get_cache_block_ids(1, 8) == [0, 1, 2]
    assert m.get_cache_block_ids(1, 32) == [2, 3, 4]
    assert m.blocks_per_window == {8: (4, 0), 32: (4, 0)}
    assert m.get_num_free_blocks(8) == 1 + 2 * 1  # its block 3 and full's wholly free slab 5
    assert m.get_num_free_blocks(32) == 1
    rng = np.random.default_rng(4)
    held = {layer: m.get_cache_block_ids(1, 8 if layer in (0, 2, 4) else 32) for layer in range(6)}
    written = {}
    for layer, blocks in held.items():
        buf = m.get_buffers(layer)
        written[layer] = rng.integers(1, 100, size=buf[blocks].shape).astype(buf.dtype)
        buf[blocks] = written[layer]
    for layer, blocks in held.items():
        np.testing.assert_array_equal(m.get_buffers(layer)[blocks], written[layer])
    m.remove_sequence(1)
    assert m.get_num_free_blocks(8) == 4 + 2 * 4
    m.check_invariants()


def test_resource_manager_reports_used_blocks() -> None:
    config = KvCacheConfig(
        tokens_per_block=4, max_attention_window=[4, None], backend="virtual", lend_free_memory=True
    )
    rm = KVCacheResourceManager.from_blocks(
        TWO, config, {4: 2, 16: 6}, max_seq_len=16, max_batch_size=8
    )
    rm.manager.add_sequence(7, list(range(12)))
    assert (rm.get_num_used_blocks(4), rm.get_num_used_blocks(16)) == (3, 3)
    assert rm.num_primary_blocks(4) == 2  # the initial split
    assert rm.can_allocate({4: 1, 16: 1})
    assert not rm.can_allocate({4: 1, 16: 2})
    assert rm.can_allocate({4: 2, 16: -1})  # full frees one first: it can lend both
    assert rm.fits_when_empty({4: 4, 16: 4})
    assert not rm.fits_when_empty({4: 5, 16: 4})
