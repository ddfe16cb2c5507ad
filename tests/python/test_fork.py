"""fork_sequence (beam search, parallel sampling): shared blocks, copy-on-write bytes, errors,
reuse, events, pins and the step estimates of forked beams."""

from __future__ import annotations

import numpy as np
import pytest

from kvcache import NULL_BLOCK, KvCacheConfig, KVCacheError, KVCacheManager, ModelConfig
from kvcache.cli import main
from kvcache.models import ModelPreset
from kvcache.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
)
from kvcache.simulate.beams import beam_footprint, format_beam_footprint
from kvcache.simulate.workload import TraceRequest

N = NULL_BLOCK


def make(
    blocks: dict[int, int] | None = None,
    *,
    reuse: bool = False,
    events: int = 0,
    backend: str = "host",
    max_batch_size: int = 8,
) -> KVCacheManager:
    """Window 8 (layer 0) and full attention 32 (layer 1), 4 tokens per block."""
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend=backend,
        enable_block_reuse=reuse,
        event_buffer_max_size=events,
    )
    return KVCacheManager.from_blocks(
        model, config, blocks or {8: 16, 32: 16}, max_seq_len=32, max_batch_size=max_batch_size
    )


def blocks(m: KVCacheManager, rid: int) -> list[list[int]]:
    return [m.get_cache_block_ids(rid, w) for w in m.window_sizes]


def test_children_share_every_block() -> None:
    m = make()
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, 2)
    m.fork_sequence(1, [3, 4])
    for rid in (2, 3, 4):
        assert blocks(m, rid) == [[0, 1], [0, 1]]
        assert m.num_tokens(rid) == 6
    assert m.get_num_free_blocks(8) == 14
    stats = m.get_kv_cache_stats()
    assert stats.forked_blocks == 3 * 2 * 2
    assert stats.copied_on_write_blocks == 0
    assert m.get_num_shared_blocks(8) == 6
    m.check_invariants()


def test_first_write_copies_the_shared_block_bytes() -> None:
    m = make()
    m.add_sequence(1, list(range(6)))
    for layer in (0, 1):
        buf = m.get_buffers(layer)  # [blocks, kv, heads, tokens, head_dim]
        buf[1] = np.arange(buf[1].size, dtype=buf.dtype).reshape(buf[1].shape) + 100 * layer
    original = [m.get_buffers(layer)[1].copy() for layer in (0, 1)]
    m.fork_sequence(1, [2, 3])
    # One add_tokens call for the three beams: 1 and 2 copy block 1 (into 2 and 3), 3 keeps it.
    m.add_tokens([1, 2, 3], [10, 20, 30])
    assert blocks(m, 1) == [[0, 2], [0, 2]]
    assert blocks(m, 2) == [[0, 3], [0, 3]]
    assert blocks(m, 3) == [[0, 1], [0, 1]]
    for layer in (0, 1):
        buf = m.get_buffers(layer)
        for copy in (2, 3):
            # The two tokens written before the fork are copied, the rest of the block is not.
            np.testing.assert_array_equal(buf[copy][:, :, :2], original[layer][:, :, :2])
            assert not buf[copy][:, :, 2:].any()
        np.testing.assert_array_equal(buf[1], original[layer])
    assert m.get_kv_cache_stats().copied_on_write_blocks == 4
    m.check_invariants()


def test_bad_forks_raise_and_change_nothing() -> None:
    m = make(max_batch_size=3)
    m.add_sequence(1, list(range(6)))
    m.add_sequence(5, list(range(3)))
    before = (blocks(m, 1), m.get_num_free_blocks(8), m.num_sequences)
    with pytest.raises(KeyError):
        m.fork_sequence(9, 2)
    with pytest.raises(ValueError, match="cannot fork request 1 into itself"):
        m.fork_sequence(1, 1)
    with pytest.raises(ValueError, match="child request id 5 is already registered"):
        m.fork_sequence(1, [2, 5])
    with pytest.raises(ValueError, match="child request id 2 appears twice"):
        m.fork_sequence(1, [2, 2])
    with pytest.raises(ValueError, match="child_ids"):
        m.fork_sequence(1, -3)
    with pytest.raises(ValueError, match="child_ids must be an int or a sequence of ints, got b"):
        m.fork_sequence(1, True)
    with pytest.raises(KVCacheError, match="max_batch_size"):
        m.fork_sequence(1, [2, 3])
    assert (blocks(m, 1), m.get_num_free_blocks(8), m.num_sequences) == before
    assert not m.has_sequence(2)
    m.fork_sequence(1, [])
    m.fork_sequence(1, np.array([2], dtype=np.int64))
    assert m.num_sequences == 3
    m.remove_sequence(2)
    m.fork_sequence(1, np.int64(2))  # one id: any integer scalar
    assert m.num_sequences == 3
    m.check_invariants()


def test_pruned_beam_frees_only_its_own_blocks_and_kept_beam_is_stored() -> None:
    m = make(reuse=True, events=100)
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, 2)
    m.add_tokens([1, 2], [6, 106])  # 1 copies block 1 into 2; 2 writes block 1
    m.add_tokens([1, 2], [7, 107])
    m.add_tokens([1, 2], [8, 108])  # both start a new block: 1 gets 3, 2 gets 4
    assert blocks(m, 1) == [[0, 2, 3], [0, 2, 3]]
    assert blocks(m, 2) == [[0, 1, 4], [0, 1, 4]]
    m.get_latest_events()
    m.remove_sequence(2, store_for_reuse=False)  # pruned
    assert m.get_num_free_blocks(32) == 16 - 3
    m.remove_sequence(1)  # kept: stored
    stored = [e for e in m.get_latest_events() if e.kind == "stored"]
    # Per window, block 0 (shared with the pruned beam) and 1's copy of block 1: one stored
    # event entry per block, never one per beam (9 tokens key 8: block 3 stores nothing).
    for w in (8, 32):
        tokens = [b["tokens"] for e in stored if e.window_size == w for b in e.data["blocks"]]
        assert tokens == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert m.get_reusable_prefix_length([0, 1, 2, 3, 4, 5, 6, 7, 99]) == 8
    # The pruned beam stored nothing: its branch matches only the shared tokens 4, 5 (partly).
    assert m.get_reusable_prefix_length([0, 1, 2, 3, 4, 5, 106, 107, 99]) == 6
    m.check_invariants()


def test_each_beam_stores_its_own_branch() -> None:
    m = make(reuse=True, events=100)
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, 2)
    for step in range(3):
        m.add_tokens([1, 2], [6 + step, 106 + step])
    m.get_latest_events()
    m.remove_sequence(1)
    m.remove_sequence(2)
    stored = [e for e in m.get_latest_events() if e.kind == "stored"]
    per_window = {
        w: [b["tokens"] for e in stored if e.window_size == w for b in e.data["blocks"]]
        for w in (8, 32)
    }
    # The shared prompt block once, then each beam's second block.
    assert per_window[32] == [[0, 1, 2, 3], [4, 5, 6, 7], [4, 5, 106, 107]]
    assert m.get_reusable_prefix_length([0, 1, 2, 3, 4, 5, 106, 107, 1]) == 8
    m.check_invariants()


def test_pins_of_a_beam_make_its_blocks_shared() -> None:
    m = make(reuse=True)
    m.add_sequence(1, list(range(9)))
    m.fork_sequence(1, 2)
    pinned = m.pin_blocks(2)
    assert pinned == {8: [0, 1], 32: [0, 1]}
    m.remove_sequence(1)
    m.remove_sequence(2)
    assert m.get_num_free_blocks(32) == 14  # the pins hold both blocks
    m.unpin_blocks_by_id(pinned)
    assert m.get_num_free_blocks(32) == 16
    m.check_invariants()


def test_step_estimates_count_one_copy_per_beam() -> None:
    m = make()
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, [2, 3])
    # Each beam's next token lands in shared block 1: one copy per beam, except that its last
    # writer keeps it (every holder writes it in this call): 2 copies, exactly what the call takes.
    assert m.get_step_needs([1, 2, 3], [1, 1, 1], [], []) == [2, 2]
    assert m.get_step_needs([1, 2], [1, 1], [], []) == [2, 2]  # 3 still holds it: both copy
    assert m.get_sequence_step_needs(1, 1) == [1, 1]
    free = {w: m.get_num_free_blocks(w) for w in m.window_sizes}
    m.add_tokens([1, 2, 3], [0, 0, 0])
    assert [free[w] - m.get_num_free_blocks(w) for w in m.window_sizes] == [2, 2]
    assert m.get_step_needs([1, 2, 3], [1, 1, 1], [], []) == [0, 0]


def test_remaining_blocks_count_the_copy_once() -> None:
    m = make()
    m.add_sequence(1, list(range(6)))
    alone = m.get_remaining_blocks([1], [12])
    m.fork_sequence(1, 2)
    both = m.get_remaining_blocks([1, 2], [12, 12])
    # Each beam: its copy of block 1 and block 2 (tokens 8..11); the shared block 0 never twice.
    assert alone == [1, 1]
    assert both == [4, 4]


def test_virtual_backend_forks_without_bytes() -> None:
    m = make(backend="virtual")
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, 2)
    m.add_tokens([2], [5])
    assert blocks(m, 2) == [[0, 2], [0, 2]]
    m.check_invariants()


def test_forked_beam_blocks_count_only_the_beams_own_blocks() -> None:
    m = make()
    # Forked at 6 tokens, grown to 12: a copy of block 1 and block 2 (window 8 and full alike);
    # grown to 30: full attention 7 blocks, window 8 never more than the 3 it spans.
    assert m.get_forked_beam_blocks(6, 12) == [2, 2]
    assert m.get_forked_beam_blocks(6, 30) == [3, 7]
    assert m.get_forked_beam_blocks(8, 8) == [0, 0]
    with pytest.raises(ValueError, match="fork_tokens"):
        m.get_forked_beam_blocks(0, 8)


def test_request_beam_fields() -> None:
    assert Request(1, [1, 2], 4, num_beams=3).num_sequences == 3
    assert Request(1, [1, 2], 4, n=2).num_sequences == 2
    assert Request(1, [1, 2], 4).num_sequences == 1
    with pytest.raises(ValueError, match="num_beams must be an int >= 1, got 0"):
        Request(1, [1], 4, num_beams=0)
    with pytest.raises(ValueError, match="n must be an int >= 1, got True"):
        Request(1, [1], 4, n=True)
    with pytest.raises(ValueError, match="cannot both exceed 1"):
        Request(1, [1], 4, num_beams=2, n=2)


def test_remaining_blocks_charge_the_prompt_once_for_all_beams() -> None:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        enable_block_reuse=False,
    )
    rm = KVCacheResourceManager.from_blocks(
        model, config, {8: 64, 32: 64}, max_seq_len=32, max_batch_size=8
    )
    one = Request(1, list(range(6)), 7)  # 12 tokens at most: 3 blocks
    beams = Request(2, list(range(6)), 7, num_beams=3)
    assert rm.get_remaining_blocks_per_window(one) == {8: 3, 32: 3}
    # 3 + 2 forked beams x (copy of block 1 + block 2): 7, not 3 x 3 = 9.
    assert rm.get_remaining_blocks_per_window(beams) == {8: 7, 32: 7}
    assert rm.get_remaining_blocks_per_window(beams, prefill_only=True) == {8: 2, 32: 2}
    batch = ScheduledBatch()
    batch.add_context(beams)
    rm.prepare_resources(batch)
    # Registered (not forked yet): its own growth (1 block) + 2 x forked at 6 tokens.
    assert rm.get_remaining_blocks_per_window(beams) == {8: 5, 32: 5}


def test_beam_footprint_counts_the_shared_prompt_once() -> None:
    preset = ModelPreset(
        name="tiny",
        model=ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4),
        max_attention_window=(8, None),
        max_context=64,
        description="two layers: window 8 and full attention",
    )
    request = TraceRequest(request_id=0, arrival=0, prompt=list(range(10)), output=list(range(7)))
    f = beam_footprint([request], preset, num_beams=3, tokens_per_block=4)
    # Forks: the prompt's 3 blocks once; the first step copies the shared partial block for two
    # beams (5), 13 tokens start a block per beam (full attention 8); window 8 released block 0
    # at 12 tokens (all three beams in one call), so it peaks at 7. Separate sequences: 3 x 3
    # blocks, then 3 more in full attention.
    assert f.forked == {8: 7.0, 16: 8.0}
    assert f.separate == {8: 9.0, 16: 12.0}
    assert f.copied_on_write == 4.0
    text = format_beam_footprint(f)
    assert "beam search, 3 beams (1 request alone, 4-token blocks)" in text
    assert "     total        15.0        21.0     29%" in text
    with pytest.raises(ValueError, match=r"num_beams must be in 1\.\.64"):
        beam_footprint([request], preset, num_beams=0, tokens_per_block=4)


def test_cli_simulate_num_beams(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--model", "gemma-3-1b", "--memory", "512MiB"]
    assert main([*argv, "--num-conversations", "6", "--num-beams", "4", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "beam search, 4 beams" in out
    assert "copy-on-write:" in out
    assert main([*argv, "--num-beams", "0"]) == 2


@pytest.mark.cuda
def test_cuda_copy_on_write_copies_the_bytes() -> None:
    torch = pytest.importorskip("torch")
    m = make(backend="cuda")
    m.add_sequence(1, list(range(6)))
    original = []
    for layer in (0, 1):
        buf = torch.from_dlpack(m.get_buffers(layer))  # [blocks, kv, heads, tokens, head_dim]
        values = torch.arange(buf[1].numel(), dtype=buf.dtype, device=buf.device) + 100 * layer
        buf[1].copy_(values.reshape(buf[1].shape))
        original.append(buf[1].clone())
    torch.cuda.synchronize()
    m.fork_sequence(1, [2, 3])
    m.add_tokens([1, 2, 3], [10, 20, 30])  # cudaMemcpyAsync on the manager's stream, synced
    assert blocks(m, 1) == [[0, 2], [0, 2]]
    assert blocks(m, 2) == [[0, 3], [0, 3]]
    for layer in (0, 1):
        buf = torch.from_dlpack(m.get_buffers(layer))
        for copy in (2, 3):
            assert torch.equal(buf[copy][:, :, :2], original[layer][:, :, :2])
        assert torch.equal(buf[1], original[layer])
    assert m.get_kv_cache_stats().copied_on_write_blocks == 4


def _resource_manager() -> KVCacheResourceManager:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        enable_block_reuse=False,
    )
    return KVCacheResourceManager.from_blocks(
        model, config, {8: 16, 32: 16}, max_seq_len=32, max_batch_size=8
    )


def test_fork_resources_runs_beams_as_generation_requests() -> None:
    rm = _resource_manager()
    m = rm.manager
    parent = Request(1, list(range(6)), 6, num_beams=3)
    batch = ScheduledBatch()
    batch.add_context(parent)
    rm.prepare_resources(batch)
    parent.append_tokens([100])
    rm.update_resources(batch)
    # Its own growth (1 block) and 2 beams forked at 6 tokens (a copy and a new block each).
    assert rm.get_remaining_blocks_per_window(parent) == {8: 5, 32: 5}
    kids = [
        Request(2, list(range(6)), 6, generated=[200]),
        Request(3, list(range(6)), 6, generated=[300]),
    ]
    rm.fork_resources(parent, kids)
    assert [m.get_cache_block_ids(r, 32) for r in (1, 2, 3)] == [[0, 1]] * 3
    assert all(k.state is RequestState.GENERATION and rm.has_request(k) for k in kids)
    # Forked: the parent is charged its own growth and its next write's copy, no more beams.
    assert rm.get_remaining_blocks_per_window(parent) == {8: 2, 32: 2}
    assert rm.get_remaining_blocks_for([parent, *kids]) == [6, 6]
    batch = ScheduledBatch()
    for r in (parent, *kids):
        batch.add_generation(r)
    assert rm.get_needed_blocks_for_step(batch) == {8: 2, 32: 2}  # the last writer keeps it
    rm.prepare_resources(batch)  # one add_tokens call: 1 and 2 copy block 1, 3 keeps it
    assert [m.get_cache_block_ids(r, 32) for r in (1, 2, 3)] == [[0, 2], [0, 3], [0, 1]]
    for r, token in zip((parent, *kids), (101, 201, 301), strict=True):
        r.append_tokens([token])
    rm.update_resources(batch)
    rm.free_resources(kids[0], store_for_reuse=False)  # pruned: only block 3 is freed
    assert rm.get_num_free_blocks(32) == 16 - 3
    m.check_invariants()


def test_fork_resources_checks_everything_first() -> None:
    rm = _resource_manager()
    parent = Request(1, list(range(6)), 6)
    with pytest.raises(KeyError):
        rm.fork_resources(parent, [Request(2, list(range(6)), 6)])
    batch = ScheduledBatch()
    batch.add_context(parent)
    rm.prepare_resources(batch)
    with pytest.raises(ValueError, match="fork a generating request"):
        rm.fork_resources(parent, [Request(2, list(range(6)), 6)])
    parent.append_tokens([100])
    rm.update_resources(batch)
    good = Request(2, list(range(6)), 6, generated=[7])
    with pytest.raises(ValueError, match="needs its prompt, max_new_tokens"):
        rm.fork_resources(parent, [good, Request(3, [9, 9], 6, generated=[1])])
    with pytest.raises(ValueError, match="registered or repeated"):
        rm.fork_resources(parent, [good, good])
    assert not rm.has_request(good) and rm.manager.num_sequences == 1
    rm.fork_resources(parent, [good])
    assert rm.manager.num_sequences == 2
