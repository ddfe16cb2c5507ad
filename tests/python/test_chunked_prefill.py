"""Chunked prefill through the Python API: blocks per chunk, queries, errors."""

from __future__ import annotations

import numpy as np
import pytest
from test_manager import snapshot

from kvcache import NULL_BLOCK, KvCacheConfig, KVCacheManager, ModelConfig, OutOfBlocksError

N = NULL_BLOCK


def make(blocks: dict[int, int], windows: list[int | None], reuse: bool = True) -> KVCacheManager:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    cfg = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=windows,
        backend="virtual",
        enable_block_reuse=reuse,
    )
    return KVCacheManager.from_blocks(model, cfg, blocks, max_seq_len=64, max_batch_size=8)


def test_chunks_release_what_no_query_attends() -> None:
    m = make({4: 20, 64: 20}, [4, None])
    prompt = list(range(20))
    assert m.get_num_blocks_to_allocate(prompt, prefill=8) == {4: 2, 64: 2}
    assert m.add_sequence(1, prompt, prefill=8) == 0
    assert (m.num_tokens(1), m.prompt_length(1)) == (8, 20)
    assert m.get_cache_block_ids(1, 4) == [0, 1]
    m.prefill(1, 8)
    assert m.get_cache_block_ids(1, 4) == [N, 1, 2, 3]
    assert m.get_cache_block_ids(1, 64) == [0, 1, 2, 3]
    m.prefill(1, 4)
    assert m.get_cache_block_ids(1, 4) == [N, N, N, 3, 4]
    assert m.num_tokens(1) == 20
    m.add_token(1, 99)
    assert m.num_tokens(1) == 21
    m.check_invariants()


def test_reuse_then_chunks_and_store_context_blocks() -> None:
    m = make({4: 20, 64: 20}, [4, None])
    m.add_sequence(1, list(range(13)))
    m.remove_sequence(1)
    prompt = list(range(20))
    assert m.add_sequence(2, prompt, prefill=6) == 12
    assert m.get_cache_block_ids(2, 4) == [N, N, 2, 4, 5]
    assert m.num_tokens(2) == 18
    m.prefill(2, 2)
    assert m.store_context_blocks(2) == 1  # 19 key tokens: block 3 joins the 3 cached ones
    m.remove_sequence(2)
    assert m.get_reusable_prefix_length(prompt) == 19  # 4 full blocks + 3 tokens of the last
    m.check_invariants()


def test_errors_change_nothing() -> None:
    m = make({64: 3}, [None], reuse=False)
    prompt = list(range(20))
    with pytest.raises(ValueError, match="prefill"):
        m.add_sequence(1, prompt, prefill=0)
    m.add_sequence(1, prompt, prefill=8)
    with pytest.raises(OutOfBlocksError):
        m.prefill(1, 8)
    with pytest.raises(ValueError, match="still in prefill"):
        m.add_tokens([1], [5])
    with pytest.raises(ValueError, match="still in prefill"):
        m.rewind(1, 1)
    with pytest.raises(ValueError, match="12 prompt tokens left"):
        m.prefill(1, 13)
    with pytest.raises(ValueError, match="num_tokens"):
        m.prefill(1, 0)
    assert m.num_tokens(1) == 8
    assert m.get_cache_block_ids(1, 64) == [0, 1]
    m.prefill(1, 4)
    assert m.get_cache_block_ids(1, 64) == [0, 1, 2]
    m.check_invariants()


def test_a_steps_chunks_and_stores_in_one_call() -> None:
    # Every sequence releases before any hands out: blocks 0 and 2 leave the sliding window and
    # go to the back of its queue before 4, 5 and 6 are taken.
    lists, arrays = make({4: 20, 64: 20}, [4, None]), make({4: 20, 64: 20}, [4, None])
    for m in (lists, arrays):
        m.add_sequence(1, list(range(20)), prefill=8)
        m.add_sequence(2, list(range(100, 120)), prefill=8)
    lists.prefill([1, 2], [8, 4])
    arrays.prefill(np.array([1, 2]), np.array([8, 4], dtype=np.int32))
    for m in (lists, arrays):
        assert (m.num_tokens(1), m.num_tokens(2)) == (16, 12)
        assert m.get_cache_block_ids(1, 4) == [N, 1, 4, 5]
        assert m.get_cache_block_ids(2, 4) == [N, 3, 6]
        assert m.get_cache_block_ids(1, 64) == [0, 1, 4, 5]
        assert m.get_cache_block_ids(2, 64) == [2, 3, 6]
    assert lists.store_context_blocks([1, 2]) == 4 + 3  # full blocks of 16 and 12 tokens
    assert arrays.store_context_blocks((2, 1)) == 3 + 4
    for m in (lists, arrays):
        assert m.store_context_blocks([2, 1]) == 0  # nothing new
        assert m.get_reusable_prefix_length(list(range(20))) == 16
        assert m.get_reusable_prefix_length(list(range(100, 120))) == 12
        m.prefill([], [])  # a step without later chunks changes nothing
        assert m.store_context_blocks([]) == 0
        m.check_invariants()


def test_a_failing_batch_changes_nothing() -> None:
    m = make({64: 6}, [None])
    m.add_sequence(1, list(range(20)), prefill=8)
    m.add_sequence(2, list(range(100, 120)), prefill=4)
    before = snapshot(m, [1, 2])
    with pytest.raises(OutOfBlocksError, match="needs 4 new blocks in window 64 for 2 requests"):
        m.prefill([1, 2], [8, 8])
    with pytest.raises(KeyError, match="unknown request id 3"):
        m.prefill([1, 3], [4, 4])
    with pytest.raises(ValueError, match="request id 2 appears twice in one prefill call"):
        m.prefill([2, 1, 2], [4, 4, 4])
    with pytest.raises(ValueError, match="has 16 prompt tokens left, cannot prefill 17"):
        m.prefill([1, 2], [4, 17])
    with pytest.raises(KeyError, match="unknown request id 3"):
        m.store_context_blocks([1, 2, 3])
    with pytest.raises(ValueError, match="appears twice in one store_context_blocks call"):
        m.store_context_blocks([1, 1])
    assert snapshot(m, [1, 2]) == before
    assert m.get_reusable_prefix_length(list(range(20))) == 0  # nothing was stored
    m.prefill([1, 2], [8, 4])  # 2 + 1 new blocks: exactly what is free
    assert m.get_cache_block_ids(1, 64) == [0, 1, 3, 4]
    assert m.get_cache_block_ids(2, 64) == [2, 5]
    assert m.get_num_free_blocks(64) == 0
    m.check_invariants()
