"""The recurrent-state pool through the Python API: state views, checkpoint copies, the hybrid
hit, chunk limits in the scheduler, checkpoint events, and errors."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache import (
    CapacityScheduler,
    KvCacheConfig,
    KVCacheError,
    KVCacheManager,
    KVCacheResourceManager,
    ModelConfig,
    Request,
    StateTensor,
)
from kvcache.events import EventBatcher

TPB = 4


def hybrid_model(layers: int = 1) -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        recurrent_layers=layers,
        recurrent_state=(
            StateTensor("conv", (2, 3), "float32"),
            StateTensor("ssm", (4,), "float32"),
        ),
    )


def hybrid(
    backend: str = "host", slots: int = 6, max_batch: int = 2, **config: object
) -> KVCacheManager:
    c = KvCacheConfig(
        tokens_per_block=TPB,
        backend=backend,
        enable_block_reuse=True,
        event_buffer_max_size=1000,
        **config,  # type: ignore[arg-type]
    )
    return KVCacheManager.from_blocks(
        hybrid_model(), c, {64: 32}, max_seq_len=64, max_batch_size=max_batch, state_slots=slots
    )


def test_state_groups_and_views() -> None:
    m = hybrid()
    assert m.num_state_groups == 1
    assert m.group_kinds == [("full_attention", None), ("recurrent_state", None)]
    (g,) = m.state_groups()
    assert g["layers"] == [0]
    assert g["tensors"] == [([2, 3], "float32"), ([4], "float32")]
    assert g["slot_bytes"] == 24 + 16
    assert g["num_slots"] == 6
    conv, ssm = m.get_state_view(0, 0), m.get_state_view(0, 1)
    assert conv.shape == (6, 2, 3) and conv.strides == (40, 12, 4)
    assert ssm.shape == (6, 4) and ssm.strides == (40, 4)
    with pytest.raises(ValueError, match="2 state tensors"):
        m.get_state_view(0, 2)
    with pytest.raises(ValueError, match="recurrent layer 1"):
        m.get_state_view(1, 0)
    with pytest.raises(KVCacheError, match="not virtual"):
        hybrid("virtual").get_state_view(0, 0)


def test_checkpoint_is_copied_stored_and_restored() -> None:
    m = hybrid()
    conv, ssm = m.get_state_view(0, 0), m.get_state_view(0, 1)
    prompt = list(range(13))
    assert m.get_prompt_chunk_limit(m.prepare(prompt), 13) == 12
    assert m.add_sequence(1, prompt, prefill=12) == 0
    w = m.get_state_slot(1)
    conv[w] = 12.0  # the engine's forward pass over [0, 12)
    ssm[w] = -12.0
    copies = m.take_state_copies()
    assert len(copies) == 1 and copies[0][:2] == (0, w)
    _, src, dst = copies[0]
    conv[dst], ssm[dst] = conv[src], ssm[src]
    assert m.take_state_copies() == []
    m.prefill([1], [1])
    m.remove_sequence(1)
    stats = m._stats_dict()
    assert (stats["checkpoints_stored"], stats["cached_checkpoints"]) == (1, 1)
    other = [*range(12), 90, 91, 92]
    assert m.get_reusable_by_kind(m.prepare(other)) == {
        "matched": 12,
        "full_attention": 12,
        "sliding_window": 12,
        "recurrent_state": 12,
        "reused": 12,
    }
    assert m.add_sequence(2, other) == 12
    w2 = m.get_state_slot(2)
    assert w2 != dst
    np.testing.assert_array_equal(conv[w2], np.full((2, 3), 12.0, np.float32))
    np.testing.assert_array_equal(ssm[w2], np.full(4, -12.0, np.float32))
    assert m._stats_dict()["checkpoints_restored"] == 1
    m.check_invariants()


def test_fresh_state_is_zeroed_and_forks_copy() -> None:
    m = hybrid(max_batch=3)
    conv = m.get_state_view(0, 0)
    conv[:] = 5.0
    m.add_sequence(1, list(range(6)))
    w = m.get_state_slot(1)
    np.testing.assert_array_equal(conv[w], np.zeros((2, 3), np.float32))
    conv[w] = 2.5
    m.fork_sequence(1, [2, 3])
    kids = {m.get_state_slot(2), m.get_state_slot(3)}
    assert len(kids | {w}) == 3
    for k in kids:
        np.testing.assert_array_equal(conv[k], np.full((2, 3), 2.5, np.float32))
    m.check_invariants()


def test_rewind_without_checkpoint_is_refused() -> None:
    m = hybrid()
    m.add_sequence(1, list(range(6)))
    m.add_tokens([1], [7])
    with pytest.raises(ValueError, match="recurrent layers"):
        m.rewind(1, 1)
    assert m.num_tokens(1) == 7


def test_slots_must_exceed_the_batch() -> None:
    with pytest.raises(ValueError, match="state_slots must exceed max_batch_size"):
        hybrid(slots=2, max_batch=2)


def test_checkpoint_events_name_their_group() -> None:
    m = hybrid()
    batcher = EventBatcher(m)
    m.add_sequence(1, list(range(13)), prefill=12)
    m.save_checkpoints()
    m.prefill([1], [1])
    m.remove_sequence(1)
    out = batcher.convert(m.get_latest_events())
    stored = [e for e in out if type(e).__name__ == "BlockStored"]
    assert [(e.group_idx, e.kv_cache_spec_kind, len(e.block_hashes)) for e in stored] == [
        (0, "full_attention", 3),
        (1, "mamba", 1),
    ]
    assert stored[1].block_hashes == stored[0].block_hashes[-1:]
    assert stored[1].parent_block_hash == stored[0].block_hashes[1]
    assert m.reset_prefix_cache()
    removed = [
        e for e in batcher.convert(m.get_latest_events()) if type(e).__name__ == "BlockRemoved"
    ]
    assert sorted((e.group_idx, len(e.block_hashes)) for e in removed) == [(0, 3), (1, 1)]


def test_scheduler_ends_chunks_at_checkpoints_and_the_second_wave_hits() -> None:
    m = hybrid("virtual", slots=8, max_batch=2)
    rm = KVCacheResourceManager(m)
    sched = CapacityScheduler(rm, max_num_batched_tokens=64)
    shared = list(range(16))
    chunks: list[int] = []

    def run(reqs: list[Request]) -> None:
        active = list(reqs)
        while active:
            batch = sched.schedule(active).batch
            rm.prepare_resources(batch)
            chunks.extend(k for _, k in batch.context)
            for r in batch.context_requests:
                if batch.is_last_chunk(r):
                    r.append_tokens([1000 + r.request_id])
            for r in batch.generation_requests:
                r.append_tokens([1000 + r.request_id])
            done = [r for r in batch.context_requests + batch.generation_requests if r.is_finished]
            rm.update_resources(batch)
            for r in done:
                rm.free_resources(r)
                active.remove(r)

    run([Request(1, [*shared, 50, 51, 52], max_new_tokens=2)])
    # The prompt's checkpoint is at 16 (the last boundary before its last token): 16 + 3.
    assert chunks == [16, 3]
    stats = m._stats_dict()
    # The prompt's checkpoint is stored; the finish policy's one at 20 tokens (the boundary the
    # first generated token reached) is not: the sequence ended there, and a chain is stored
    # up to its last token only.
    assert (stats["checkpoints_stored"], stats["checkpoints_skipped"]) == (1, 1)
    chunks.clear()
    run([Request(2, [*shared, 60, 61, 62, 63, 64], max_new_tokens=2)])
    # Resumed at 16 from the checkpoint; its own checkpoint is due at 20.
    assert chunks == [4, 1]
    assert m._stats_dict()["checkpoints_restored"] == 1
    m.check_invariants()


def test_router_predicts_hybrid_hits_with_checkpoints() -> None:
    """KvIndexer, fed only the events, answers as get_reusable_prefix_length does on a hybrid
    engine (full attention + a sliding window + a state group) through stores, evictions of
    blocks and of checkpoints, and a reset."""
    pytest.importorskip("msgspec")
    from kvcache.router import KvIndexer

    model = ModelConfig(
        num_layers=2,
        num_kv_heads=1,
        head_dim=8,
        recurrent_layers=1,
        recurrent_state=(StateTensor("ssm", (4,), "float32"),),
    )
    c = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=[8, None],
        backend="virtual",
        enable_block_reuse=True,
        event_buffer_max_size=10_000,
        recurrent_checkpoint_interval=2,
    )
    m = KVCacheManager.from_blocks(
        model, c, {8: 24, 64: 24}, max_seq_len=64, max_batch_size=2, state_slots=5
    )
    batcher = EventBatcher(m)
    index = KvIndexer()
    rng = np.random.default_rng(7)
    prefixes = [list(range(k * 100, k * 100 + 24)) for k in range(3)]
    checked = hits = 0
    for i in range(60):
        prompt = prefixes[int(rng.integers(3))][: int(rng.integers(6, 24))]
        prompt = prompt + [int(t) for t in rng.integers(1000, 2000, size=int(rng.integers(1, 9)))]
        p = m.prepare(prompt)
        first = m.get_prompt_chunk_limit(p, len(prompt))
        try:
            m.add_sequence(i, prompt, prefill=first)
        except KVCacheError:
            continue
        m.save_checkpoints()
        while m.num_tokens(i) < len(prompt):
            m.prefill([i], [m.get_chunk_limit(i, len(prompt) - m.num_tokens(i))])
            m.save_checkpoints()
        m.remove_sequence(i)
        payload = batcher.batch()
        if payload is not None:
            index.apply("e", payload)
        for q in prefixes:
            probe = [*q[: int(rng.integers(5, 24))], 7]
            want = m.get_reusable_prefix_length(probe)
            assert index.match("e", probe) == want, (i, probe)
            checked += 1
            hits += want > 0
    assert checked == 180 and hits > 20
    stats = m.get_kv_cache_stats()
    assert stats.checkpoints_evicted > 0 and stats.cached_checkpoints > 0


def test_simulate_a_hybrid_preset_within_its_memory() -> None:
    """kvcache simulate on Qwen3.5-9B: the state pool takes what the windows leave of the
    budget, the chat's later turns resume from checkpoints, and the report says why hits were
    lost; a budget too small for the batch's working slots is a clear error."""
    from kvcache.simulate import default_workload, simulate

    trace = default_workload(num_conversations=40, seed=0)
    r = simulate(trace, model="qwen3.5-9b", memory_bytes=24 * 2**30, check_invariants=True)
    # 24 GiB, equal shares: 12 GiB of attention blocks (8 layers x 4 heads x 256 x 2 x 2 B per
    # token: 32,768 B, 1 MiB per 32-token block) and 12 GiB of 51,511,296-byte state slots.
    assert r.windows[0].blocks == 12 * 1024
    assert r.state_slots == 12 * 2**30 // 51_511_296 == 250
    assert r.checkpoints["restored"] > 0 and r.checkpoints["stored"] > 0
    assert set(r.lost_hit_tokens) == {
        "attention blocks evicted",
        "sliding window evicted",
        "no state checkpoint",
    }
    assert r.cache_hit_rate is not None and r.cache_hit_rate > 0.5
    with pytest.raises(ValueError, match="83 slots"):
        simulate(trace, model="qwen3.5-9b", memory_bytes=8 * 2**30)
