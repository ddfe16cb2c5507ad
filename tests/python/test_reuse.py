"""Block reuse through the Python facade: keys and their conversion, stats, events, pins."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache import (
    NULL_BLOCK,
    KvCacheConfig,
    KVCacheError,
    KVCacheEvent,
    KVCacheManager,
    ModelConfig,
)

N = NULL_BLOCK


def make(
    windows: list[int | None] | None = None,
    blocks: dict[int, int | tuple[int, int]] | None = None,
    **config: object,
) -> KVCacheManager:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    cfg = KvCacheConfig(tokens_per_block=4, max_attention_window=windows, backend="host", **config)  # type: ignore[arg-type]
    return KVCacheManager.from_blocks(
        model, cfg, blocks or {64: 16}, max_seq_len=64, max_batch_size=16
    )


def test_prompt_reuse_and_last_token() -> None:
    m = make()
    assert m.add_sequence(1, list(range(9))) == 0
    m.remove_sequence(1)
    assert m.get_reusable_prefix_length(list(range(9))) == 8
    assert m.get_reusable_prefix_length(np.arange(10)) == 8  # token 8 was the last: not stored
    assert m.get_reusable_prefix_length([0]) == 0
    assert m.get_num_blocks_to_allocate(list(range(9))) == {64: 3}  # 2 cached free + 1 new
    free = m.get_num_free_blocks()
    assert m.add_sequence(2, list(range(9))) == 8
    assert free - m.get_num_free_blocks() == 3
    assert m.get_request_stats(2) == {
        "reused_tokens": 8,
        "reused_blocks": 2,
        "missed_blocks": 1,
        "new_blocks": 1,
    }
    stats = m.get_kv_cache_stats()
    assert (stats.reused_blocks, stats.missed_blocks) == (2, 4)
    assert stats.cache_hit_rate == pytest.approx(2 / 6)
    assert stats.cache_hit_rate_per_window_size == {64: pytest.approx(2 / 6)}
    assert stats.num_cached_nodes == 2
    m.check_invariants()


def test_reuse_disabled_by_config() -> None:
    m = make(enable_block_reuse=False)
    m.add_sequence(1, list(range(9)))
    m.remove_sequence(1)
    assert m.add_sequence(2, list(range(9))) == 0
    assert m.get_reusable_prefix_length(list(range(9))) == 0
    assert not m.reuse_enabled


@pytest.mark.parametrize(
    ("stored", "query", "hit"),
    [
        ({}, {}, True),
        ({"lora_task_id": 3}, {"lora_task_id": 3}, True),
        ({"lora_task_id": 3}, {"lora_task_id": 4}, False),
        ({"lora_task_id": 0}, {}, False),
        ({"cache_salt": "user-1"}, {"cache_salt": "user-1"}, True),
        ({"cache_salt": "user-1"}, {"cache_salt": b"user-1"}, True),
        ({"cache_salt": "user-1"}, {"cache_salt": "user-2"}, False),
        ({"cache_salt": "user-1"}, {}, False),
        ({}, {"cache_salt": 0}, False),
        ({"multimodal": [(b"\x01" * 32, 1, 2)]}, {"multimodal": [(b"\x01" * 32, 1, 2)]}, True),
        ({"multimodal": [(b"\x01" * 32, 1, 2)]}, {"multimodal": [(b"\x02" * 32, 1, 2)]}, False),
        ({"multimodal": [(2**200 + 5, 1, 2)]}, {"multimodal": [(2**200 + 5, 1, 2)]}, True),
        ({"multimodal": [(7, 1, 2)]}, {"multimodal": [(7, 2, 2)]}, False),
        ({"multimodal": [(7, 0, 13)]}, {"multimodal": [(7, 0, 13)]}, True),
        ({"multimodal": [(7, 0, 13)]}, {"multimodal": [(7, 0, 2)]}, False),  # only the length
    ],
)
def test_extra_keys(stored: dict[str, object], query: dict[str, object], hit: bool) -> None:
    m = make()
    m.add_sequence(1, list(range(9)), **stored)  # type: ignore[arg-type]
    m.remove_sequence(1)
    assert m.get_reusable_prefix_length(list(range(9)), **query) == (8 if hit else 0)  # type: ignore[arg-type]


def test_the_same_image_over_fewer_positions_reuses_nothing() -> None:
    # Image h at positions 0-12, then the same h at 0-1 with text after it: block 0 of the
    # second prompt holds text KV at positions 2-3, so it must not be the first prompt's block.
    m = make()
    image = b"\x07" * 32
    tokens = list(range(13))
    m.add_sequence(1, tokens, multimodal=[(image, 0, 13)])
    first = m.get_cache_block_ids(1, 64)
    m.remove_sequence(1)
    assert m.add_sequence(2, tokens, multimodal=[(image, 0, 2)]) == 0
    assert m.get_cache_block_ids(2, 64)[0] not in first
    m.remove_sequence(2)
    # Everything equal: the first prompt's blocks are reused as before.
    assert m.add_sequence(3, tokens, multimodal=[(image, 0, 13)]) == 12
    assert m.get_cache_block_ids(3, 64)[:3] == first[:3]
    m.check_invariants()


def test_bad_reuse_arguments_raise_value_error() -> None:
    m = make()
    with pytest.raises(ValueError, match="multimodal"):
        m.add_sequence(1, [1, 2], multimodal=[(b"x", 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="multimodal"):
        m.add_sequence(1, [1, 2], multimodal=[(b"x", -1, 2)])
    with pytest.raises(ValueError, match="cache_salt"):
        m.add_sequence(1, [1, 2], cache_salt=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="priority range"):
        m.add_sequence(1, [1, 2], priority_ranges=[(4, 2, 50, None)])
    with pytest.raises(ValueError, match="decode_priority"):
        m.add_sequence(1, [1, 2], decode_priority=200)
    with pytest.raises(ValueError, match="lora_task_id"):
        m.add_sequence(1, [1, 2], lora_task_id="a")  # type: ignore[arg-type]
    assert not m.has_sequence(1)
    m.check_invariants()


def test_events_through_python() -> None:
    m = make(event_buffer_max_size=16)
    events = m.get_latest_events()
    assert [(e.kind, e.window_size, e.event_id) for e in events] == [("created", 64, 0)]
    assert events[0].data == {"num_blocks_per_cache_level": (16, 0)}
    m.add_sequence(1, list(range(9)), lora_task_id=5, priority=60)
    m.remove_sequence(1)
    (stored,) = m.get_latest_events(timeout_ms=10)
    assert isinstance(stored, KVCacheEvent)
    assert stored.kind == "stored"
    assert stored.data["parent_hash"] is None
    assert [b["tokens"] for b in stored.data["blocks"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert {b["lora_task_id"] for b in stored.data["blocks"]} == {5}
    assert {b["priority"] for b in stored.data["blocks"]} == {60}
    m.add_sequence(2, list(range(9)), lora_task_id=5, priority=10)  # reused: new priority
    updated = m.get_latest_events()
    assert [e.kind for e in updated] == ["updated", "updated"]
    assert [e.data["priority"] for e in updated] == [(60, 10), (60, 10)]
    assert make().get_latest_events() == []  # no buffer, no events


def test_offload_and_onboard_keep_bytes_on_host() -> None:
    m = make(blocks={64: (3, 2)})
    m.add_sequence(1, list(range(5)))  # blocks 0, 1
    buf = m.get_buffers(1)
    buf[0] = 7.0
    m.remove_sequence(1)  # block 0 cached
    m.add_sequence(2, list(range(100, 112)))  # 2, 1, then evicts 0: offloaded to host
    buf[0] = -1.0  # request 2 overwrites the device block
    assert m.get_kv_cache_stats().offloaded_blocks == 1
    m.remove_sequence(2, store_for_reuse=False)
    assert m.add_sequence(3, list(range(5))) == 4
    block = m.get_cache_block_ids(3)[0]
    assert m.get_kv_cache_stats().onboarded_blocks == 1
    assert (m.get_buffers(1)[block] == 7.0).all()
    m.check_invariants()


def test_pin_and_unpin_all_windows() -> None:
    m = make([8, None], {8: 4, 64: 4})
    m.add_sequence(1, list(range(9)))
    m.pin_blocks(1)
    last = m.get_cache_block_ids(1, 64)[1]
    m.remove_sequence(1)
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (2, 2)
    with pytest.raises(ValueError, match="not a stored block"):
        m.unpin_blocks_by_id([3])
    m.unpin_blocks_by_id([last])
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (4, 4)
    m.check_invariants()


def test_pins_return_their_blocks_and_unpin_takes_exactly_those() -> None:
    m = make([8, None], {8: 4, 64: 4})
    m.add_sequence(1, list(range(9)))
    first = m.pin_blocks(1)  # 8 key tokens: two full blocks per window
    assert first == {8: [0, 1], 64: [0, 1]}
    assert m.add_sequence(2, list(range(9))) == 8
    assert m.remove_sequence(2, pin=True) == {8: [0, 1], 64: [0, 1]}  # the cached blocks
    assert m.remove_sequence(1) is None
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (2, 2)
    m.unpin_blocks_by_id(first)
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (2, 2)  # pinned twice
    m.unpin_blocks_by_id({8: [0, 1], 64: [0, 1]})
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (4, 4)
    with pytest.raises(ValueError, match="has 0 pins"):
        m.unpin_blocks_by_id({8: [0], 64: [1, 1]})
    with pytest.raises(ValueError, match="window_size goes with a list"):
        m.unpin_blocks_by_id(first, window_size=8)
    assert m.get_reusable_prefix_length(list(range(9))) == 8  # still cached, now evictable
    m.check_invariants()


def test_pin_on_removal_needs_reuse() -> None:
    m = make(enable_block_reuse=False)
    m.add_sequence(1, list(range(9)))
    with pytest.raises(KVCacheError, match="needs block reuse"):
        m.remove_sequence(1, pin=True)
    assert m.has_sequence(1)
    assert m.remove_sequence(1) is None


@pytest.mark.parametrize("policy", ["invalidate", "placeholder"])
def test_sliding_window_ownership(policy: str) -> None:
    m = make([8, None], {8: 4, 64: 16}, swa_reuse_policy=policy)
    m.add_sequence(0, list(range(8)))
    m.add_tokens([0, 0, 0, 0][:1], [8])
    for t in (9, 10, 11):
        m.add_token(0, t)
    assert m.get_cache_block_ids(0, 8) == [N, 1, 2]
    m.add_sequence(1, list(range(100, 105)))  # takes the released block 0
    assert not m.is_sequence_valid_for_reuse(0)
    assert m.is_sequence_valid_for_reuse(1)
    m.remove_sequence(1)
    for t in range(12, 16):
        m.add_token(0, t)
    m.remove_sequence(0)
    assert m.add_sequence(2, list(range(16))) == (15 if policy == "placeholder" else 0)
    m.check_invariants()


def test_refresh_blocks_decays_timed_priorities() -> None:
    m = make(event_buffer_max_size=16)
    m._set_fake_time_ms(0)
    m.add_sequence(1, list(range(5)), priority_ranges=[(0, None, 90, 10)])
    m.remove_sequence(1)
    m.get_latest_events()
    m._set_fake_time_ms(5)
    m.refresh_blocks()
    assert m.get_latest_events() == []
    m._set_fake_time_ms(10)
    m.refresh_blocks()
    (event,) = m.get_latest_events()
    assert (event.kind, event.data["priority"]) == ("updated", (90, 35))


def _hashes(events: list[KVCacheEvent], kind: str) -> dict[int, list[int]]:
    """Block hashes per window named by the events of ``kind`` (sorted)."""
    out: dict[int, list[int]] = {}
    for e in events:
        if e.kind == "stored":
            found = [b["block_hash"] for b in e.data["blocks"]]
        elif e.kind == "removed":
            found = list(e.data["block_hashes"])
        else:
            continue
        if e.kind == kind:
            out.setdefault(e.window_size, []).extend(found)
    return {w: sorted(h) for w, h in out.items()}


def test_reset_prefix_cache_refused_while_running_then_drops_every_prefix() -> None:
    m = make(event_buffer_max_size=64, blocks={64: 8})
    m.get_latest_events()
    prompt = list(range(13))
    assert m.add_sequence(1, prompt) == 0
    assert m.store_context_blocks(1) == 3  # 12 key tokens: three full blocks
    assert m.get_reusable_prefix_length(prompt) == 12
    stored = _hashes(m.get_latest_events(), "stored")
    assert [len(h) for h in stored.values()] == [3]

    assert m.reset_prefix_cache() is False  # request 1 still runs: nothing changes
    assert m.get_reusable_prefix_length(prompt) == 12
    assert m.get_kv_cache_stats().num_cached_nodes == 3
    assert m.get_latest_events() == []
    m.check_invariants()

    m.remove_sequence(1)
    assert m.reset_prefix_cache() is True
    assert m.get_reusable_prefix_length(prompt) == 0
    assert m.get_num_free_blocks(64) == 8
    stats = m.get_kv_cache_stats()
    assert (stats.num_cached_nodes, stats.free_num_blocks) == (0, 8)
    events = m.get_latest_events()
    assert {e.kind for e in events} == {"removed"}
    assert _hashes(events, "removed") == stored
    m.check_invariants()

    assert m.reset_prefix_cache() is True  # nothing left to drop
    assert m.get_latest_events() == []
    assert m.add_sequence(2, prompt) == 0
    m.check_invariants()


def test_reset_prefix_cache_refused_while_a_block_is_pinned() -> None:
    m = make()
    m.add_sequence(1, list(range(9)))
    pinned = m.pin_blocks(1)
    assert pinned == {64: [0, 1]}
    m.remove_sequence(1)
    assert m.reset_prefix_cache() is False
    assert m.get_reusable_prefix_length(list(range(9))) == 8
    m.check_invariants()
    m.unpin_blocks_by_id(pinned)
    assert m.reset_prefix_cache() is True
    assert m.get_reusable_prefix_length(list(range(9))) == 0
    assert m.get_num_free_blocks() == 16
    m.check_invariants()


def test_reset_prefix_cache_drops_offloaded_blocks() -> None:
    m = make(event_buffer_max_size=64, blocks={64: (4, 2)})
    m.add_sequence(1, list(range(9)))
    m.remove_sequence(1)  # two full blocks cached in primary blocks 0, 1
    m.add_sequence(2, list(range(100, 113)))  # scratch 2, 3, then evicts 1 and 0 to the host
    assert m.get_kv_cache_stats().offloaded_blocks == 2
    m.remove_sequence(2)
    assert m.get_reusable_prefix_length(list(range(9))) == 8  # served from host blocks
    stored = _hashes(m.get_latest_events(), "stored")
    assert [len(h) for h in stored.values()] == [5]

    assert m.reset_prefix_cache() is True
    assert _hashes(m.get_latest_events(), "removed") == stored
    assert m.get_reusable_prefix_length(list(range(9))) == 0
    assert m.get_num_free_blocks() == 4
    m.check_invariants()
    assert m.add_sequence(3, list(range(9))) == 0
    assert m.get_kv_cache_stats().onboarded_blocks == 0
    m.check_invariants()


def test_reset_prefix_cache_clears_every_window() -> None:
    m = make([8, None], {8: 8, 64: 16}, event_buffer_max_size=64)
    m.get_latest_events()
    prompt = list(range(21))
    m.add_sequence(1, prompt)
    m.remove_sequence(1)
    assert m.get_reusable_prefix_length(prompt) == 20
    stored = _hashes(m.get_latest_events(), "stored")
    assert sorted(stored) == [8, 64] and len(stored[64]) == 5

    assert m.reset_prefix_cache() is True
    assert _hashes(m.get_latest_events(), "removed") == stored
    assert m.get_reusable_prefix_length(prompt) == 0
    assert (m.get_num_free_blocks(8), m.get_num_free_blocks(64)) == (8, 16)
    assert m.get_kv_cache_stats().num_cached_nodes == 0
    m.check_invariants()


def test_reset_prefix_cache_without_reuse() -> None:
    m = make(enable_block_reuse=False)
    assert m.reset_prefix_cache() is True
    m.add_sequence(1, list(range(9)))
    assert m.reset_prefix_cache() is False
    m.remove_sequence(1)
    assert m.reset_prefix_cache() is True
