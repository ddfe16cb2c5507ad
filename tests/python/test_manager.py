"""The KVCacheManager facade: behaviour, errors and memory views (host and virtual)."""

from __future__ import annotations

import numpy as np
import pytest

import kvcache
from kvcache import (
    NULL_BLOCK,
    KvCacheConfig,
    KVCacheError,
    KVCacheManager,
    ModelConfig,
    OutOfBlocksError,
)

N = NULL_BLOCK


def make(
    windows: list[int | None] | None = None,
    blocks: dict[int, int | tuple[int, int]] | None = None,
    *,
    layers: int = 2,
    heads: int | list[int] = 1,
    head_dim: int = 4,
    max_seq_len: int = 64,
    backend: str = "host",
    tpb: int = 4,
    **kwargs: int,
) -> KVCacheManager:
    model = ModelConfig(num_layers=layers, num_kv_heads=heads, head_dim=head_dim)
    config = KvCacheConfig(tokens_per_block=tpb, max_attention_window=windows, backend=backend)
    return KVCacheManager.from_blocks(
        model, config, blocks or {64: 8}, max_seq_len=max_seq_len, max_batch_size=8, **kwargs
    )


def snapshot(m: KVCacheManager, ids: list[int]) -> tuple[object, ...]:
    state = []
    for rid in ids:
        if m.has_sequence(rid):
            state.append(
                (rid, m.num_tokens(rid), [m.get_cache_block_ids(rid, w) for w in m.window_sizes])
            )
    free = [m.get_num_free_blocks(w) for w in m.window_sizes]
    return (tuple(map(str, state)), tuple(free), m.get_kv_cache_stats())


def test_properties_and_backend() -> None:
    m = make([8, None], {8: 4, 64: (8, 2)})
    assert m.window_sizes == [8, 64]
    assert m.tokens_per_block == 4
    assert m.max_seq_len == 64
    assert m.blocks_per_window == {8: (4, 0), 64: (8, 2)}
    assert m.backend == "host"
    assert make(backend="virtual").backend == "virtual"
    assert make(backend="auto").backend == ("cuda" if kvcache.cuda_available() else "host")
    assert [p["layers"] for p in m.pools] == [[0], [1]]
    assert m.layer_to_pool == [(0, 0), (1, 0)]


def test_sliding_window_release_through_python() -> None:
    m = make([8, None], {8: 4, 64: 8})
    assert m.add_sequence(1, np.arange(12, dtype=np.int64)) == 0
    assert m.get_cache_block_ids(1, 8) == [0, 1, 2]
    m.add_token(1, 12)
    assert m.get_cache_block_ids(1, 8) == [N, 1, 2, 3]
    assert m.get_cache_block_ids(1, 64) == [0, 1, 2, 3]
    assert m.get_num_free_blocks(8) == 1
    assert m.get_num_free_blocks() == 1  # minimum over windows
    m.remove_sequence(1)
    assert m.get_num_free_blocks(8) == 4
    m.check_invariants()


def test_add_tokens_batch_accepts_arrays_and_lists() -> None:
    m = make()
    m.add_sequence(1, [1, 2, 3])
    m.add_sequence(2, [4])
    m.add_tokens(np.array([1, 2]), np.array([5, 6], dtype=np.int32))
    m.add_tokens([2, 1], [7, 8])
    assert (m.num_tokens(1), m.num_tokens(2)) == (5, 3)
    assert m.get_cache_block_ids(1) == [0, 2]  # single window: window_size may be omitted
    with pytest.raises(ValueError, match="2 request ids but 1 tokens"):
        m.add_tokens([1, 2], [3])
    with pytest.raises(ValueError, match="twice"):
        m.add_tokens([1, 1], [3, 3])
    m.check_invariants()


def test_errors_leave_state_unchanged() -> None:
    m = make([8, None], {8: 8, 16: 8}, max_seq_len=16)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    before = snapshot(m, [1, 2])
    with pytest.raises(ValueError, match="already registered"):
        m.add_sequence(1, [1])
    with pytest.raises(ValueError, match="empty"):
        m.add_sequence(2, [])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m.add_sequence(2, list(range(17)))
    with pytest.raises(ValueError, match="negative"):
        m.add_sequence(2, [1, -1])
    with pytest.raises(ValueError, match="ints"):
        m.add_sequence(2, [1.5])
    with pytest.raises(ValueError, match="ints"):
        m.add_sequence(2, "abc")
    with pytest.raises(ValueError, match="integers"):
        m.add_sequence(2, np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="priority"):
        m.add_sequence(2, [1], priority=101)
    with pytest.raises(KeyError):
        m.add_token(9, 1)
    with pytest.raises(KeyError):
        m.add_tokens([1, 9], [1, 1])
    with pytest.raises(KeyError):
        m.remove_sequence(9)
    with pytest.raises(KeyError):
        m.num_tokens(9)
    with pytest.raises(KeyError):
        m.get_cache_block_ids(9, 8)
    with pytest.raises(ValueError, match="window_size 12 is not one of"):
        m.get_cache_block_ids(1, 12)
    # None and "full" name full attention, the window max_seq_len (as the config does).
    assert m.get_cache_block_ids(1) == m.get_cache_block_ids(1, "full") == [0, 1]
    assert m.get_cache_block_ids(1, 16) == [0, 1]
    with pytest.raises(ValueError, match="or None / \"full\" for full attention; got 'sliding'"):
        m.get_cache_block_ids(1, "sliding")
    with pytest.raises(ValueError, match="cannot drop"):
        m.rewind(1, 5)
    with pytest.raises(ValueError):
        m.add_token(1, -3)
    assert snapshot(m, [1, 2]) == before
    assert not m.has_sequence(2)
    m.check_invariants()


def test_out_of_blocks_is_all_or_nothing() -> None:
    m = make([8, None], {8: 6, 64: 6})
    m.add_sequence(1, [0] * 4)
    m.add_sequence(2, [0] * 4)
    m.add_sequence(3, [0] * 12)
    before = snapshot(m, [1, 2, 3, 4])
    assert issubclass(OutOfBlocksError, KVCacheError)
    assert issubclass(KVCacheError, RuntimeError)
    with pytest.raises(OutOfBlocksError, match="window 8 needs 2 blocks"):
        m.add_sequence(4, [0] * 5)
    with pytest.raises(OutOfBlocksError, match="needs 2 new blocks"):
        m.add_tokens([1, 2], [9, 9])
    assert snapshot(m, [1, 2, 3, 4]) == before
    m.check_invariants()


def test_host_bytes_survive_other_sequences() -> None:
    """Bytes written at the block-table positions read back after others come and go."""
    m = make([8, None], {8: 30, 64: 30}, layers=4, heads=[2, 1, 2, 1], head_dim=4)
    rng = np.random.default_rng(7)

    def fill(rid: int) -> dict[tuple[int, int, int], np.ndarray]:
        written = {}
        for layer in range(4):
            buf = m.get_buffers(layer)
            window = m.window_sizes[layer % 2]
            for pos, block in enumerate(m.get_cache_block_ids(rid, window)):
                if block == N:
                    continue
                data = rng.standard_normal(buf.shape[1:]).astype(np.float16)
                buf[block] = data
                written[(layer, pos, block)] = data
        return written

    m.add_sequence(1, list(range(10)))
    mine = fill(1)
    for rid in range(2, 12):
        m.add_sequence(rid, list(range(1 + rid % 6)))
        fill(rid)
        if rid % 2:
            m.remove_sequence(rid)
    for (layer, _pos, block), data in mine.items():
        np.testing.assert_array_equal(m.get_buffers(layer)[block], data)
    m.check_invariants()


def test_buffers_layout_and_lifetime() -> None:
    m = make([None], {64: 3}, layers=2, heads=[2, 2], head_dim=4)
    buf = m.get_buffers(1)
    assert buf.shape == (3, 2, 2, 4, 4)
    assert buf.dtype == np.float16
    assert buf.strides == (2 * 2 * 2 * 4 * 4 * 2, 2 * 4 * 4 * 2, 4 * 4 * 2, 4 * 2, 2)
    buf[2, 1, 0, 3, :] = [1, 2, 3, 4]
    del m  # the view keeps the manager (and its memory) alive
    assert buf[2, 1, 0, 3].tolist() == [1, 2, 3, 4]


def test_dlpack_view_shares_memory() -> None:
    m = make([None], {64: 3}, layers=1, heads=2, head_dim=4)
    lb = m._layer_buffer(0)
    assert lb.shape == (3, 2, 2, 4, 4)
    assert lb.__dlpack_device__() == (1, 0)
    arr = np.from_dlpack(lb)
    m.get_buffers(0)[1, 0, 1, 2, 3] = 5
    assert arr[1, 0, 1, 2, 3] == 5
    assert arr.shape == (3, 2, 2, 4, 4)
    assert arr.ctypes.data == lb.data_ptr


def test_virtual_backend_has_no_buffers() -> None:
    m = make(backend="virtual")
    with pytest.raises(RuntimeError, match="virtual"):
        m.get_buffers(0)
    with pytest.raises(ValueError, match="out of range"):
        make().get_buffers(5)


def test_copy_block_offsets() -> None:
    m = make([4, None], {4: 4, 32: 8}, max_seq_len=32)
    m.add_sequence(1, list(range(12)))
    m.add_token(1, 12)
    out = np.full((2, 2, 2, 6), 99, dtype=np.int32)
    assert m.copy_block_offsets(out, [1], slot_offset=1) == 4
    assert out[0, 1, 0].tolist() == [-1, -1, 4, 6, 99, 99]
    assert out[0, 1, 1].tolist() == [-1, -1, 5, 7, 99, 99]
    assert out[1, 1, 0].tolist() == [0, 2, 4, 6, 99, 99]
    assert (out[:, 0] == 99).all()
    with pytest.raises(ValueError, match="int32"):
        m.copy_block_offsets(out.astype(np.int64), [1])
    with pytest.raises(ValueError, match="num_pools"):
        m.copy_block_offsets(np.zeros((3, 2, 2, 6), np.int32), [1])
    with pytest.raises(ValueError, match="wide"):
        m.copy_block_offsets(np.zeros((2, 2, 2, 3), np.int32), [1])
    with pytest.raises(ValueError, match="rows"):
        m.copy_block_offsets(out, [1], slot_offset=2)
    with pytest.raises(KeyError):
        m.copy_block_offsets(out, [5])


def test_memory_budget_constructor() -> None:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)  # 16 B/token per layer
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    m = KVCacheManager(model, config, max_seq_len=64, max_batch_size=4, primary_bytes=64 * 100)
    # equal shares: 3200 B per window / (16 B/token * 4 tokens) = 50 blocks each
    assert m.blocks_per_window == {8: (50, 0), 64: (50, 0)}
    with pytest.raises(ValueError, match="explicit budget"):
        KVCacheManager(model, config, max_seq_len=64, max_batch_size=4)
    budget = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        max_gpu_total_bytes=64 * 10,
    )
    assert KVCacheManager(model, budget, max_seq_len=64, max_batch_size=4).blocks_per_window == {
        8: (5, 0),
        64: (5, 0),
    }


def test_from_blocks_validates_keys() -> None:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None])
    with pytest.raises(ValueError, match="window sizes"):
        KVCacheManager.from_blocks(model, config, {8: 4}, max_seq_len=64, max_batch_size=1)
    with pytest.raises(ValueError, match="max_seq_len"):
        KVCacheManager.from_blocks(model, config, {8: 4, 64: 4}, max_seq_len=0, max_batch_size=1)


def test_max_batch_size_is_enforced() -> None:
    m = make()
    for rid in range(8):
        m.add_sequence(rid, [1])
    with pytest.raises(KVCacheError, match="max_batch_size"):
        m.add_sequence(8, [1])


@pytest.mark.cuda
def test_cuda_buffers_expose_cuda_array_interface() -> None:
    m = make(backend="cuda")
    buf = m.get_buffers(0)
    cai = buf.__cuda_array_interface__
    assert cai["shape"] == (8, 2, 1, 4, 4)
    assert cai["typestr"] == "<f2"
    assert buf.__dlpack_device__() == (2, 0)
