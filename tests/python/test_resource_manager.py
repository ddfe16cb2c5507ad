"""Tests for kvcache.resource_manager: estimates against what the manager really allocates."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from kvcache import NULL_BLOCK, KvCacheConfig, ModelConfig, OutOfBlocksError
from kvcache.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
    peak_live_blocks,
)

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)


def make_rm(
    window: int,
    tpb: int,
    *,
    max_seq_len: int = 256,
    blocks: int = 512,
    max_draft_tokens: int = 0,
    max_batch_size: int = 16,
    reuse: bool = True,
    swa_reuse_policy: str = "invalidate",
) -> KVCacheResourceManager:
    """One sliding window and one full-attention window."""
    config = KvCacheConfig(
        tokens_per_block=tpb,
        max_attention_window=[window, None],
        backend="virtual",
        enable_block_reuse=reuse,
        swa_reuse_policy=swa_reuse_policy,
    )
    return KVCacheResourceManager.from_blocks(
        MODEL,
        config,
        {window: blocks, max_seq_len: blocks},
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        max_draft_tokens=max_draft_tokens,
    )


def live_blocks(rm: KVCacheResourceManager, r: Request, w: int) -> int:
    return sum(1 for b in rm.manager.get_cache_block_ids(r.request_id, w) if b != NULL_BLOCK)


def positions(rm: KVCacheResourceManager, r: Request, w: int) -> int:
    return len(rm.manager.get_cache_block_ids(r.request_id, w))


# ----------------------------------------------------------------------------- pure math


def _brute_peak(lo: int, hi: int, keep: int, tpb: int, front: int) -> int:
    best = -(10**9)
    for m in range(lo, hi + 1):
        released = max(0, m - keep) // tpb
        best = max(best, -(-m // tpb) - max(front, released))
    return best


@pytest.mark.parametrize("tpb", [1, 3, 4, 8])
@pytest.mark.parametrize("keep", [1, 4, 5, 6, 8, 9, 13, 46])
def test_peak_live_blocks_matches_brute_force(tpb: int, keep: int) -> None:
    for front in range(3):
        for lo in range(front * tpb + 1, 45, 2):  # released blocks lie below the length
            for hi in range(lo, 90, 5):
                assert peak_live_blocks(
                    lo, hi, keep=keep, tokens_per_block=tpb, front=front
                ) == _brute_peak(lo, hi, keep, tpb, front), (lo, hi, front)


def test_peak_live_blocks_examples() -> None:
    # window-aligned: window/tpb + 1; one past alignment: no extra block; two past: extra.
    assert peak_live_blocks(1, 1000, keep=1024, tokens_per_block=32) == 32
    assert peak_live_blocks(1, 5000, keep=1024, tokens_per_block=32) == 33
    assert peak_live_blocks(1, 5000, keep=1025, tokens_per_block=32) == 33
    assert peak_live_blocks(1, 5000, keep=1026, tokens_per_block=32) == 34
    with pytest.raises(ValueError, match="hi"):
        peak_live_blocks(5, 4, keep=8, tokens_per_block=4)


# ----------------------------------------------------------------------------- a tiny engine


@dataclass
class StepRecord:
    needed: dict[int, int]
    net: dict[int, int]
    remaining: dict[int, int]
    allocated: dict[int, int]  # new block positions this step
    consumed: dict[int, int]  # free blocks taken this step (allocations - releases)
    live: dict[int, int]  # blocks held after the step


def run_single(
    rm: KVCacheResourceManager,
    request: Request,
    *,
    drafts: int = 0,
    seed: int = 0,
) -> tuple[dict[int, int], list[StepRecord]]:
    """Runs one request to completion; returns the estimates before admission and per step."""
    windows = rm.window_sizes
    rng = random.Random(seed)
    before = {w: rm.get_remaining_blocks_to_completion(request, w) for w in windows}
    records: list[StepRecord] = []
    first = True
    while not request.is_finished:
        batch = ScheduledBatch()
        if first:
            batch.add_context(request)
        else:
            request.draft_tokens = [rng.randrange(1000) for _ in range(drafts)]
            batch.add_generation(request, rm.num_draft_tokens_for(request))
        needed = {w: rm.get_needed_blocks_one_step(request, w) for w in windows}
        net = {w: rm.get_needed_blocks_one_step(request, w, credit_releases=True) for w in windows}
        remaining = {w: rm.get_remaining_blocks_to_completion(request, w) for w in windows}
        pos0 = {w: positions(rm, request, w) if not first else 0 for w in windows}
        free0 = {w: rm.get_num_free_blocks(w) for w in windows}
        rm.prepare_resources(batch)
        rm.manager.check_invariants()
        allocated = {w: positions(rm, request, w) - pos0[w] for w in windows}
        consumed = {w: free0[w] - rm.get_num_free_blocks(w) for w in windows}
        if first:
            request.append_tokens([rng.randrange(1000)])
        else:
            d = batch.num_draft_tokens(request)
            accepted = rng.randint(0, d)
            request.append_tokens([rng.randrange(1000) for _ in range(accepted + 1)])
            request.rewind_len = d - accepted
        rm.update_resources(batch)
        rm.manager.check_invariants()
        live = {w: live_blocks(rm, request, w) for w in windows}
        for w in windows:
            assert rm.get_num_allocated_blocks(request, w) == live[w]
        records.append(StepRecord(needed, net, remaining, allocated, consumed, live))
        first = False
    rm.free_resources(request)
    rm.manager.check_invariants()
    return before, records


CASES = [
    # (window, tpb, prompt lengths around window and block boundaries, new tokens)
    (8, 4, [1, 3, 4, 5, 7, 8, 9, 12, 13, 30], [1, 2, 9, 40]),
    (6, 4, [5, 6, 7, 8, 9], [1, 7, 30]),
    (5, 4, [4, 5, 6, 9], [3, 25]),
    (3, 4, [1, 2, 3, 4, 5], [1, 10]),
    (46, 8, [45, 46, 47, 48, 49, 100], [1, 8, 60]),
]


@pytest.mark.parametrize(("window", "tpb", "prompts", "news"), CASES)
def test_estimates_equal_actual_allocations(
    window: int, tpb: int, prompts: list[int], news: list[int]
) -> None:
    rm = make_rm(window, tpb, reuse=False)
    rid = 0
    for p in prompts:
        for n in news:
            rid += 1
            req = Request(rid, prompt=list(range(1, p + 1)), max_new_tokens=n)
            before, records = run_single(rm, req)
            for w in rm.window_sizes:
                peak = max(rec.live[w] for rec in records)
                # The context step registers the whole prompt in every window.
                peak = max(peak, -(-p // tpb))
                assert before[w] == peak, (w, p, n)
                for i, rec in enumerate(records):
                    assert rec.needed[w] == rec.allocated[w], (w, p, n, i)
                    assert rec.net[w] == max(0, rec.consumed[w]), (w, p, n, i)
                    held_before = records[i - 1].live[w] if i else 0
                    future_peak = max(r.live[w] for r in records[i:])
                    if i == 0:
                        future_peak = max(future_peak, -(-p // tpb))
                    assert rec.remaining[w] == max(0, future_peak - held_before), (w, p, n, i)
            assert rm.get_num_free_blocks() == 512


def _shared_prefix_prompts(rng: random.Random, window: int, tpb: int) -> list[list[int]]:
    """Prompts that share prefixes: a few system prompts (some longer than the window)
    followed by user text, and later turns that extend an earlier prompt."""
    systems = [[rng.randrange(1, 50) for _ in range(n)] for n in (tpb + 1, window + 2 * tpb + 1)]
    systems.append(systems[1][: window + tpb])  # a prefix of another system prompt
    prompts: list[list[int]] = []
    for _ in range(14):
        if prompts and rng.random() < 0.4:  # a later turn: earlier prompt + answer + user
            base = rng.choice(prompts)
            extra = rng.randint(1, 3 * tpb)
            prompt = base + [rng.randrange(1, 50) for _ in range(extra)]
        else:
            sys_prompt = rng.choice(systems)
            prompt = sys_prompt + [rng.randrange(1, 50) for _ in range(rng.randint(0, 2 * tpb))]
        prompts.append(prompt[:120])
    return prompts


@pytest.mark.parametrize("policy", ["invalidate", "placeholder"])
@pytest.mark.parametrize(("window", "tpb"), [(8, 4), (6, 4), (5, 4), (46, 8)])
def test_estimates_equal_actual_allocations_with_reuse(window: int, tpb: int, policy: str) -> None:
    """Reuse on, requests one at a time: the estimates equal the free blocks really taken
    (reused cached blocks cost one each, and a sliding window needs no block before
    ``reused - window``)."""
    rm = make_rm(window, tpb, swa_reuse_policy=policy)
    rng = random.Random(window * 100 + tpb)
    full = rm.window_sizes[-1]
    reused_steps = front_steps = 0
    for rid, prompt in enumerate(_shared_prefix_prompts(rng, window, tpb), 1):
        n = rng.choice([1, 2, tpb + 1, 3 * window])
        req = Request(rid, prompt=prompt, max_new_tokens=n)
        free0 = {w: rm.get_num_free_blocks(w) for w in rm.window_sizes}
        expected_reuse = rm.manager.get_reusable_prefix_length(prompt)
        cost = rm.manager.get_num_blocks_to_allocate(prompt)
        before, records = run_single(rm, req, seed=rid)
        assert req.reused_tokens == expected_reuse
        if req.reused_tokens:
            reused_steps += 1
        p = len(prompt)
        for w in rm.window_sizes:
            front = max(0, req.reused_tokens - w) // tpb
            front_steps += front > 0
            # What must be free to register is get_num_blocks_to_allocate, exactly what is
            # taken: every position from `front` on (nobody else holds anything).
            assert cost[w] == records[0].consumed[w], (w, rid)
            assert records[0].consumed[w] == records[0].live[w] == -(-p // tpb) - front
            assert records[0].needed[w] == cost[w], (w, rid)
            peak = max(rec.live[w] for rec in records)
            if w == full:
                assert before[w] == peak, (w, rid)
            else:
                assert before[w] == max(peak, cost[w]), (w, rid)
            for i, rec in enumerate(records):
                if i:
                    assert rec.needed[w] == rec.allocated[w], (w, rid, i)
                    assert rec.net[w] == max(0, rec.consumed[w]), (w, rid, i)
                    held_before = records[i - 1].live[w]
                    future_peak = max(r.live[w] for r in records[i:])
                    assert rec.remaining[w] == max(0, future_peak - held_before), (w, rid, i)
            assert rm.get_num_free_blocks(w) == free0[w] == 512
        assert rm.get_num_shared_blocks(full) == rm.get_num_shared_blocks(window) == 0
    assert reused_steps >= 5
    assert front_steps >= 2  # some sliding-window hits skipped out-of-window blocks
    assert rm.manager.get_kv_cache_stats().reused_blocks > 0


def test_sliding_window_never_needs_more_than_window_plus_one_block() -> None:
    rm = make_rm(46, 8, max_seq_len=1024)
    req = Request(1, prompt=[1] * 10, max_new_tokens=900)
    assert rm.get_remaining_blocks_to_completion(req, 46) == 7  # ceil(46/8) + 1
    assert rm.get_remaining_blocks_to_completion(req, 1024) == 114  # ceil(909/8)
    long_prompt = Request(2, prompt=[1] * 500, max_new_tokens=10)
    assert rm.get_remaining_blocks_to_completion(long_prompt, 46) == 63  # the prompt itself


@pytest.mark.parametrize(("drafts", "max_draft"), [(3, 3), (5, 5), (5, 2)])
@pytest.mark.parametrize("prompt", [40, 46, 47, 53])
def test_draft_tokens_estimates_bound_actual(drafts: int, max_draft: int, prompt: int) -> None:
    rm = make_rm(46, 8, max_draft_tokens=max_draft, reuse=False)
    for seed in range(4):
        req = Request(100 + seed, prompt=[7] * prompt, max_new_tokens=70)
        before, records = run_single(rm, req, drafts=drafts, seed=seed)
        for w in rm.window_sizes:
            peak = max(max(rec.live[w] for rec in records), -(-prompt // 8))
            assert before[w] >= peak
            for i, rec in enumerate(records):
                assert rec.needed[w] == rec.allocated[w]
                assert rec.net[w] >= rec.consumed[w]
                held_before = records[i - 1].live[w] if i else 0
                future_peak = max(r.live[w] for r in records[i:])
                assert rec.remaining[w] >= future_peak - held_before
        assert req.num_generated == 70
        assert rm.get_num_free_blocks() == 512


def test_draft_count_is_capped() -> None:
    rm = make_rm(8, 4, max_draft_tokens=2)
    req = Request(1, prompt=[1, 2, 3], max_new_tokens=3, draft_tokens=[5, 6, 7])
    assert rm.num_draft_tokens_for(req) == 2  # manager allowance
    req.generated = [9, 9]
    assert rm.num_draft_tokens_for(req) == 0  # one token left: no drafts


# ----------------------------------------------------------------------------- batches


def test_batch_generation_is_one_add_tokens_call_and_all_or_nothing() -> None:
    rm = make_rm(8, 4, blocks=6, max_seq_len=32)
    a = Request(1, prompt=[1] * 8, max_new_tokens=10)
    b = Request(2, prompt=[2] * 4, max_new_tokens=10)
    batch = ScheduledBatch()
    batch.add_context(a)
    batch.add_context(b)
    rm.prepare_resources(batch)
    a.append_tokens([3])
    b.append_tokens([4])
    rm.update_resources(batch)
    assert rm.get_num_free_blocks(32) == 3
    # Both now cross a block boundary: 2 blocks needed, 3 free.
    gen = ScheduledBatch()
    gen.add_generation(a)
    gen.add_generation(b)
    assert [rm.get_needed_blocks_one_step(r, 32) for r in (a, b)] == [1, 1]
    rm.prepare_resources(gen)
    assert rm.get_num_free_blocks(32) == 1
    a.append_tokens([5])
    b.append_tokens([6])
    rm.update_resources(gen)
    # A third request's prompt of 8 tokens does not fit: nothing changes.
    c = Request(3, prompt=[3] * 8, max_new_tokens=2)
    bad = ScheduledBatch()
    bad.add_generation(a)
    bad.add_context(c)
    free = {w: rm.get_num_free_blocks(w) for w in rm.window_sizes}
    ids_a = rm.manager.get_cache_block_ids(1, 32)
    with pytest.raises(OutOfBlocksError):
        rm.prepare_resources(bad)
    rm.manager.check_invariants()
    assert {w: rm.get_num_free_blocks(w) for w in rm.window_sizes} == free
    assert rm.manager.get_cache_block_ids(1, 32) == ids_a
    assert rm.manager.num_tokens(1) == 9
    assert not rm.has_request(c)
    assert c.state is RequestState.WAITING


def test_roll_back_of_a_later_context_failure() -> None:
    rm = make_rm(8, 4, blocks=4, max_seq_len=32)
    a = Request(1, prompt=[1] * 8, max_new_tokens=2)  # 2 blocks
    b = Request(2, prompt=[2] * 12, max_new_tokens=2)  # 3 blocks: does not fit after a
    batch = ScheduledBatch()
    batch.add_context(a)
    batch.add_context(b)
    with pytest.raises(OutOfBlocksError):
        rm.prepare_resources(batch)
    assert rm.get_num_free_blocks() == 4
    assert not rm.has_request(a)
    assert a.state is RequestState.WAITING
    rm.manager.check_invariants()


def test_roll_back_of_draft_tokens() -> None:
    rm = make_rm(8, 4, blocks=2, max_seq_len=32, max_draft_tokens=4)
    a = Request(1, prompt=[1] * 4, max_new_tokens=20)
    ctx = ScheduledBatch()
    ctx.add_context(a)
    rm.prepare_resources(ctx)
    a.append_tokens([2])
    rm.update_resources(ctx)
    # 4 cached tokens (1 block); the newest token + 4 drafts reach 9 tokens: 2 more blocks,
    # but only 1 is free. The 5th token gets it, the 9th fails and everything is rewound.
    a.draft_tokens = [5, 6, 7, 8]
    gen = ScheduledBatch()
    gen.add_generation(a, 4)
    assert rm.get_needed_blocks_one_step(a, 32) == 2
    with pytest.raises(OutOfBlocksError):
        rm.prepare_resources(gen)
    assert rm.manager.num_tokens(1) == 4
    assert rm.get_num_allocated_blocks(a, 32) == 1
    assert rm.get_num_free_blocks(32) == 1
    rm.manager.check_invariants()


def test_chunked_context_registers_on_first_chunk_only() -> None:
    rm = make_rm(8, 4)
    r = Request(1, prompt=list(range(1, 11)), max_new_tokens=3)
    first = ScheduledBatch()
    first.add_context(r, chunk_size=6)
    assert first.num_tokens() == 6
    rm.prepare_resources(first)
    assert rm.manager.num_tokens(1) == 10
    r.context_position = 6  # the engine processed the first chunk
    second = ScheduledBatch()
    second.add_context(r)
    assert second.chunk_size(r) == 4
    assert rm.get_needed_blocks_one_step(r, 8) == 0
    rm.prepare_resources(second)
    assert rm.manager.num_tokens(1) == 10
    r.append_tokens([11])
    assert r.context_position == 10
    assert r.state is RequestState.GENERATION


def test_errors() -> None:
    rm = make_rm(8, 4, max_draft_tokens=1)
    r = Request(1, prompt=[1, 2], max_new_tokens=4)
    gen = ScheduledBatch()
    gen.add_generation(r)
    with pytest.raises(ValueError, match="not in generation"):
        rm.prepare_resources(gen)
    ctx = ScheduledBatch()
    ctx.add_context(r)
    rm.prepare_resources(ctx)
    with pytest.raises(ValueError, match="cannot start its context"):
        rm.prepare_resources(ctx)
    r.append_tokens([3, 4])  # two tokens at once: the cache is one behind
    with pytest.raises(ValueError, match="the cache holds 2 tokens but the request has 4"):
        rm.prepare_resources(gen)
    r.generated.pop()
    r.draft_tokens = [1, 2]
    with pytest.raises(ValueError, match="2 draft tokens, at most 1"):
        bad = ScheduledBatch()
        bad.add_generation(r, 2)
        rm.prepare_resources(bad)
    one = ScheduledBatch()
    one.add_generation(r, 1)
    rm.prepare_resources(one)
    r.rewind_len = 2
    with pytest.raises(ValueError, match=r"rewind_len 2 is not in 0\.\.1"):
        rm.update_resources(one)
    with pytest.raises(ValueError, match="not one of this manager's windows"):
        rm.get_needed_blocks_one_step(r, 7)
    too_long = Request(2, prompt=[1] * 200, max_new_tokens=100)
    ctx2 = ScheduledBatch()
    ctx2.add_context(too_long)
    with pytest.raises(ValueError, match="exceeds max_seq_len 256"):
        rm.prepare_resources(ctx2)
    with pytest.raises(KeyError):
        rm.free_resources(too_long)


def test_request_validation_and_batch_arguments() -> None:
    with pytest.raises(ValueError, match="prompt is empty"):
        Request(1, prompt=[], max_new_tokens=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(1, prompt=[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="request_id"):
        Request(True, prompt=[1], max_new_tokens=1)
    r = Request(1, prompt=[1, 2], max_new_tokens=1)
    batch = ScheduledBatch()
    with pytest.raises(ValueError, match=r"chunk_size must be in 1\.\.2"):
        batch.add_context(r, chunk_size=3)
    with pytest.raises(ValueError, match=r"num_draft_tokens must be in 0\.\.0"):
        batch.add_generation(r, 1)
    with pytest.raises(ValueError, match="would exceed max_new_tokens=1"):
        r.append_tokens([1, 2])


def test_free_blocks_and_available_tokens() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    rm = KVCacheResourceManager.from_blocks(
        MODEL, config, {8: 5, 64: 9}, max_seq_len=64, max_batch_size=4, max_draft_tokens=3
    )
    assert rm.window_sizes == [8, 64]
    assert rm.tokens_per_block == 4
    assert rm.max_seq_len == 64
    assert rm.max_draft_tokens == 3
    assert rm.max_batch_size == 4
    assert (rm.num_primary_blocks(8), rm.num_primary_blocks(64)) == (5, 9)
    assert rm.get_num_free_blocks() == 5
    assert rm.get_num_free_blocks(64) == 9
    assert rm.get_num_available_tokens() == 5 * 4 - 3


def test_from_memory_uses_sizing() -> None:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    # 2 layers x 1 head x 8 dims x 2 (K, V) x 2 bytes = 32 B per token per layer; 128 B/block.
    rm = KVCacheResourceManager.from_memory(
        MODEL, config, max_seq_len=64, max_batch_size=4, primary_bytes=128 * 20
    )
    assert rm.manager.blocks_per_window == {8: (10, 0), 64: (10, 0)}
