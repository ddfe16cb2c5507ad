"""kvcache.vllm.layout: where kvcache's window pools lie in vLLM's block-id space (no vLLM
needed)."""

from __future__ import annotations

import pytest

from kvcache import NULL_BLOCK, KvCacheConfig
from kvcache.vllm.layout import kvcache_config_for, plan_layout

GEMMA = [64, 64, 64, 64, 64, None]


def config(windows: list[int | None], shares: object, lend: bool) -> KvCacheConfig:
    return kvcache_config_for(
        windows,
        block_size=32,
        enable_caching=True,
        enable_events=False,
        max_num_batched_tokens=256,
        window_size_shares=shares,
        lend_free_memory=lend,
    )


def test_separate_ranges_without_lending() -> None:
    cfg = config(GEMMA, [0.5, 0.5], False)
    layout = plan_layout(GEMMA, cfg, num_blocks=101, max_seq_len=352, max_batch_size=4)
    assert layout.window_sizes == (64, 352)
    assert layout.window_groups == ((0, 1, 2, 3, 4), (5,))
    assert dict(layout.blocks) == {64: 10, 352: 50}
    # Window 64: five groups of 10 ids from 1; window 352: 50 ids after them.
    assert layout.group_offsets == (1, 11, 21, 31, 41, 51)
    assert layout.used_pages == 100
    assert layout.vllm_ids(2, [0, 9, NULL_BLOCK]) == [21, 30, 0]
    assert layout.vllm_ids(5, [0, 49]) == [51, 100]


def test_interleaved_arena_with_lending() -> None:
    cfg = config(GEMMA, [0.5, 0.5], True)
    layout = plan_layout(GEMMA, cfg, num_blocks=101, max_seq_len=352, max_batch_size=4)
    assert layout.lends
    # A window-64 block k is pages 5k..5k+4 of the arena, a full-attention block k page k.
    assert layout.vllm_ids(0, [0, 1, NULL_BLOCK]) == [1, 6, 0]
    assert layout.vllm_ids(4, [0, 1]) == [5, 10]
    assert layout.vllm_ids(5, [0, 7]) == [1, 8]


def test_every_id_distinct_and_in_range() -> None:
    cfg = config(GEMMA, None, False)
    layout = plan_layout(GEMMA, cfg, num_blocks=500, max_seq_len=1056, max_batch_size=8)
    seen: set[int] = set()
    for w, groups in zip(layout.window_sizes, layout.window_groups, strict=True):
        for g in groups:
            ids = layout.vllm_ids(g, range(layout.blocks[w]))
            assert not seen & set(ids)
            seen |= set(ids)
    assert min(seen) == 1 and max(seen) <= 499
    assert len(seen) == layout.used_pages


def test_too_few_blocks() -> None:
    cfg = config([None], None, False)
    with pytest.raises(ValueError, match="at least 2"):
        plan_layout([None], cfg, num_blocks=1, max_seq_len=64, max_batch_size=1)
