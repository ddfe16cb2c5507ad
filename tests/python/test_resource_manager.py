"""Tests for kvcache.resource_manager: estimates against what the manager really allocates."""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import pytest

from kvcache import NULL_BLOCK, KvCacheConfig, ModelConfig, OutOfBlocksError
from kvcache import _core as block_math
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
    with pytest.raises(ValueError, match="no prompt tokens left to prefill"):
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


# ----------------------------------------------------------------------------- chunked prefill


def _brute_prefill_peak(start: int, end: int, chunk: int, keep: int, tpb: int, front: int) -> int:
    """Most blocks held after any chunk [a, b] with start <= a < b <= min(a + chunk, end):
    the core releases the blocks below a + 1 - keep, then allocates up to b."""
    best = -(10**9)
    for a in range(start, end):
        released = max(0, a + 1 - keep) // tpb
        for b in range(a + 1, min(a + chunk, end) + 1):
            best = max(best, -(-b // tpb) - max(front, released))
    return best


@pytest.mark.parametrize("tpb", [1, 3, 4])
@pytest.mark.parametrize("keep", [1, 4, 5, 9])
def test_prefill_peak_is_the_worst_chunking(tpb: int, keep: int) -> None:
    for chunk in (1, 2, 3, 4, 7, 12):
        for front in range(2):
            for start in range(front * tpb, 24, 3):
                for end in range(start + 1, 40, 4):
                    assert block_math.prefill_peak(
                        start, end, chunk, keep, tpb, front
                    ) == _brute_prefill_peak(start, end, chunk, keep, tpb, front), (
                        start,
                        end,
                        chunk,
                        front,
                    )


def run_chunked(
    rm: KVCacheResourceManager,
    request: Request,
    chunks: list[int],
    *,
    bound: int | None,
    seed: int = 0,
) -> tuple[dict[int, int], list[StepRecord]]:
    """Runs one request to completion, its prompt in ``chunks`` (tokens after the reused
    prefix; the rest in one chunk once they run out) and checks the per-chunk estimates
    against what the core takes. ``bound`` is the largest chunk told to the estimates."""
    windows = rm.window_sizes
    rng = random.Random(seed)
    before = rm.get_remaining_blocks_per_window(request, chunk_size=bound)
    records: list[StepRecord] = []
    todo = list(chunks)
    while not request.is_finished:
        batch = ScheduledBatch()
        registered = rm.has_request(request)
        if request.state is RequestState.GENERATION:
            batch.add_generation(request)
            chunk = None
        else:
            start = (
                request.context_position if registered else rm.get_reusable_prefix_length(request)
            )
            rest = request.context_len - start
            chunk = min(todo.pop(0), rest) if todo else rest
            assert bound is None or chunk <= bound
            batch.add_context(request, chunk)
        needed = rm.get_needed_blocks_per_window(request, chunk_size=chunk)
        net = rm.get_needed_blocks_per_window(request, chunk_size=chunk, credit_releases=True)
        remaining = rm.get_remaining_blocks_per_window(request, chunk_size=bound)
        if not registered:
            assert remaining == before
        pos0 = {w: positions(rm, request, w) if registered else 0 for w in windows}
        free0 = {w: rm.get_num_free_blocks(w) for w in windows}
        rm.prepare_resources(batch)
        rm.manager.check_invariants()
        if registered:
            allocated = {w: positions(rm, request, w) - pos0[w] for w in windows}
        else:  # a registration: every block it holds (a sliding window skips the front)
            allocated = {w: live_blocks(rm, request, w) for w in windows}
        consumed = {w: free0[w] - rm.get_num_free_blocks(w) for w in windows}
        if chunk is not None:
            assert batch.chunk_size(request) == chunk
            assert rm.manager.num_tokens(request.request_id) == request.context_position + chunk
            if batch.is_last_chunk(request):
                request.append_tokens([rng.randrange(1000)])
        else:
            request.append_tokens([rng.randrange(1000)])
        rm.update_resources(batch)
        rm.manager.check_invariants()
        live = {w: live_blocks(rm, request, w) for w in windows}
        for w in windows:
            assert rm.get_num_allocated_blocks(request, w) == live[w]
        records.append(StepRecord(needed, net, remaining, allocated, consumed, live))
    rm.free_resources(request)
    rm.manager.check_invariants()
    return before, records


def _check_chunk_records(
    records: list[StepRecord], windows: list[int], exact_from: int, what: object
) -> None:
    """Every step's estimates equal what the core took; the estimate to completion (the
    worst case over every cutting into chunks of at most the bound) bounds the future peak,
    exactly from step ``exact_from`` on (the rest of the prompt is one chunk)."""
    for w in windows:
        for i, rec in enumerate(records):
            assert rec.needed[w] == rec.allocated[w], (what, w, i)
            assert rec.net[w] == max(0, rec.consumed[w]), (what, w, i)
            held_before = records[i - 1].live[w] if i else 0
            future_peak = max(r.live[w] for r in records[i:])
            assert rec.remaining[w] >= future_peak - held_before, (what, w, i)
            if i >= exact_from:
                assert rec.remaining[w] == max(0, future_peak - held_before), (what, w, i)


CHUNK_CASES = [
    # (window, tpb, chunk bound): window > chunk, window < chunk, chunks not multiples of tpb
    (8, 4, 3),
    (8, 4, 4),
    (8, 4, 13),
    (5, 4, 6),
    (46, 8, 20),
    (46, 8, 100),
]


@pytest.mark.parametrize(("window", "tpb", "bound"), CHUNK_CASES)
def test_chunk_estimates_equal_what_the_core_takes(window: int, tpb: int, bound: int) -> None:
    rm = make_rm(window, tpb, reuse=False)
    rng = random.Random(window * 1000 + bound)
    rid = 0
    for p in (1, tpb + 1, window + 1, 3 * window + 5, 120):
        for n in (1, 9, 40):
            for kind in ("full", "random"):
                rid += 1
                req = Request(
                    rid, prompt=[rng.randrange(1, 50) for _ in range(p)], max_new_tokens=n
                )
                if kind == "full":
                    chunks = [bound] * (p // bound + 1)
                else:
                    chunks = [rng.randint(1, bound) for _ in range(p)]
                sizes = []
                left = p
                for c in chunks:
                    if left <= 0:
                        break
                    sizes.append(min(c, left))
                    left -= sizes[-1]
                before, records = run_chunked(rm, req, chunks, bound=bound, seed=rid)
                # the worst case over chunkings: exact from the last chunk on
                _check_chunk_records(records, rm.window_sizes, len(sizes) - 1, (p, n, kind))
                assert len(records) == len(sizes) + n - 1
                # a sliding window holds at most ceil((keep + chunk - 1) / tpb) + 1 blocks
                prefill_peak = max(r.live[window] for r in records[: len(sizes)])
                assert prefill_peak <= -(-(window + bound - 1) // tpb) + 1
                if p <= bound:  # one chunk: the estimate before admission is the peak
                    assert before == {w: max(r.live[w] for r in records) for w in rm.window_sizes}
    assert rm.get_num_free_blocks() == 512


@pytest.mark.parametrize("policy", ["invalidate", "placeholder"])
@pytest.mark.parametrize(("window", "tpb", "bound"), [(8, 4, 3), (8, 4, 13), (46, 8, 20)])
def test_chunk_estimates_with_reuse_hits(window: int, tpb: int, bound: int, policy: str) -> None:
    """Reuse on, one request at a time: reused prefixes end anywhere (partial blocks,
    mid-chunk), the first chunk counts after them, and every chunk's estimate equals the
    free blocks the core takes (cached blocks reused cost one each)."""
    rm = make_rm(window, tpb, swa_reuse_policy=policy)
    rng = random.Random(window * 7 + bound)
    hits = mid_block = 0
    for rid, prompt in enumerate(_shared_prefix_prompts(rng, window, tpb), 1):
        n = rng.choice([1, 2, tpb + 1, 3 * window])
        req = Request(rid, prompt=prompt, max_new_tokens=n)
        reused = rm.get_reusable_prefix_length(req)
        first = rng.randint(1, bound)
        cost = rm.manager.get_num_blocks_to_allocate(prompt, prefill=first)
        chunks = [first] + [rng.randint(1, bound) for _ in range(len(prompt))]
        _, records = run_chunked(rm, req, chunks, bound=bound, seed=rid)
        assert req.reused_tokens == reused
        hits += reused > 0
        mid_block += reused % tpb != 0
        assert records[0].consumed == cost
        assert records[0].needed == cost
        rest = len(prompt) - reused
        sizes = []
        for c in chunks:
            if rest <= 0:
                break
            sizes.append(min(c, rest))
            rest -= sizes[-1]
        _check_chunk_records(records, rm.window_sizes, len(sizes) - 1, rid)
        for w in rm.window_sizes:
            assert rm.get_num_free_blocks(w) == 512
            assert rm.get_num_shared_blocks(w) == 0
    assert hits >= 5
    assert mid_block >= 1  # a partial-block hit: the first chunk starts mid-block


def test_chunked_prefill_steps_and_progress() -> None:
    rm = make_rm(8, 4, max_seq_len=64, blocks=32)
    r = Request(1, prompt=list(range(1, 21)), max_new_tokens=3)
    first = ScheduledBatch()
    first.add_context(r, chunk_size=6)
    rm.prepare_resources(first)
    assert (rm.manager.num_tokens(1), rm.manager.prompt_length(1)) == (6, 20)
    assert (r.state, r.context_position, first.is_last_chunk(r)) == (RequestState.CONTEXT, 0, False)
    rm.update_resources(first)  # no token: the prompt is not done
    assert r.context_position == 6
    assert rm.get_needed_blocks_one_step(r, 8, chunk_size=8) == 2  # positions 6..13
    assert rm.get_needed_blocks_one_step(r, 8, chunk_size=8, credit_releases=True) == 2
    second = ScheduledBatch()
    second.add_context(r, 8)
    rm.prepare_resources(second)
    assert rm.manager.get_cache_block_ids(1, 8)[0] != NULL_BLOCK  # 6 + 1 - 8 < 0: no release
    r.append_tokens([7])  # wrong: the chunk did not end the prompt
    with pytest.raises(ValueError, match="appended after a chunk that did not end its prompt"):
        rm.update_resources(second)
    r.generated.clear()
    r.state = RequestState.CONTEXT
    rm.update_resources(second)
    assert r.context_position == 14
    # the rest, positions 14..19, starts one block (16..19); positions below 14 + 1 - 8 = 7
    # leave the window first, which frees block 0
    assert rm.get_needed_blocks_one_step(r, 8) == 1
    assert rm.get_needed_blocks_one_step(r, 8, credit_releases=True) == 0
    with pytest.raises(ValueError, match="chunk_size 7 exceeds the 6 prompt tokens left"):
        rm.get_needed_blocks_one_step(r, 8, chunk_size=7)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1"):
        rm.get_remaining_blocks_to_completion(r, 8, chunk_size=0)
    last = ScheduledBatch()
    last.add_context(r)
    rm.prepare_resources(last)
    assert last.is_last_chunk(r)
    with pytest.raises(ValueError, match="append its first generated token"):
        rm.update_resources(last)
    r.append_tokens([7])
    rm.update_resources(last)
    assert (r.state, r.context_position) == (RequestState.GENERATION, 20)
    ids_8 = rm.manager.get_cache_block_ids(1, 8)
    assert ids_8[0] == NULL_BLOCK and NULL_BLOCK not in ids_8[1:]  # released below 7
    rm.manager.check_invariants()


def test_first_chunk_counts_after_the_reused_prefix() -> None:
    rm = make_rm(8, 4, max_seq_len=64, blocks=32)
    prompt = list(range(1, 21))
    a = Request(1, prompt=prompt, max_new_tokens=1)
    batch = ScheduledBatch()
    batch.add_context(a)
    rm.prepare_resources(batch)
    a.append_tokens([5])
    rm.update_resources(batch)  # stores 4 full blocks (the last prompt token is no key)
    rm.free_resources(a)
    b = Request(2, prompt=prompt, max_new_tokens=2)
    assert rm.get_reusable_prefix_length(b) == 19
    batch = ScheduledBatch()
    batch.add_context(b, 10)  # more than the 1 token left after the hit: shortened
    rm.prepare_resources(batch)
    assert (b.reused_tokens, b.context_position, batch.chunk_size(b)) == (19, 19, 1)
    assert batch.is_last_chunk(b)
    assert rm.get_reusable_prefix_length(b) == 19  # registered: what it reused
    rm.manager.check_invariants()


def test_a_step_that_cannot_prefill_changes_nothing() -> None:
    rm = make_rm(8, 4, max_seq_len=64, blocks=6)
    a = Request(1, prompt=list(range(1, 21)), max_new_tokens=2)
    first = ScheduledBatch()
    first.add_context(a, 8)
    rm.prepare_resources(first)
    rm.update_resources(first)
    b = Request(2, prompt=list(range(30, 38)), max_new_tokens=2)
    batch = ScheduledBatch()
    batch.add_context(b, 8)  # registers first (2 blocks), then a's chunk needs 3 of 2 left
    batch.add_context(a, 12)
    free = {w: rm.get_num_free_blocks(w) for w in rm.window_sizes}
    assert rm.get_needed_blocks_for_step(batch) == {8: 3, 64: 3}  # b is not registered yet
    with pytest.raises(OutOfBlocksError, match=r"window 8 needs 3 free blocks .* but has 2"):
        rm.prepare_resources(batch)
    assert {w: rm.get_num_free_blocks(w) for w in rm.window_sizes} == free
    assert not rm.has_request(b) and b.state is RequestState.WAITING
    assert (a.context_position, rm.manager.num_tokens(1)) == (8, 8)
    assert [(r.request_id, k) for r, k in batch.context] == [(2, 8), (1, 12)]
    rm.manager.check_invariants()


def test_step_need_credits_releases_across_requests() -> None:
    """A whole prompt's first generated token releases most of its sliding-window blocks;
    in the same add_tokens call they serve another request's new block, so a full sliding
    pool runs the step (a sum of per-request needs would have said one block short)."""
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[4, None], backend="virtual")
    rm = KVCacheResourceManager.from_blocks(
        MODEL, config, {4: 5, 64: 16}, max_seq_len=64, max_batch_size=4
    )
    a = Request(1, prompt=list(range(1, 17)), max_new_tokens=4)  # 4 blocks
    b = Request(2, prompt=list(range(20, 24)), max_new_tokens=4)  # 1 block
    ctx = ScheduledBatch()
    ctx.add_context(a)
    ctx.add_context(b)
    rm.prepare_resources(ctx)
    a.append_tokens([1])
    b.append_tokens([2])
    rm.update_resources(ctx)
    assert rm.get_num_free_blocks(4) == 0
    gen = ScheduledBatch()
    gen.add_generation(a)
    gen.add_generation(b)
    per_request = [rm.get_needed_blocks_one_step(r, 4, credit_releases=True) for r in (a, b)]
    assert per_request == [0, 1]
    assert rm.get_needed_blocks_for_step(gen) == {4: 0, 64: 2}
    rm.prepare_resources(gen)
    assert rm.get_num_free_blocks(4) == 1  # a released 3 and took 1, b took 1
    rm.manager.check_invariants()


def test_remaining_and_run_alone_with_chunks() -> None:
    rm = make_rm(46, 8, max_seq_len=1024)
    long_prompt = Request(2, prompt=[1] * 500, max_new_tokens=10)
    assert rm.get_remaining_blocks_to_completion(long_prompt, 46) == 63  # whole: the prompt
    # chunks of at most 20 tokens: at most ceil((46 + 20 - 1) / 8) + 1 = 10 blocks; 9 here
    assert rm.get_remaining_blocks_to_completion(long_prompt, 46, chunk_size=20) == 9
    assert rm.get_remaining_blocks_to_completion(long_prompt, 1024, chunk_size=20) == 64
    assert rm.get_blocks_to_run_alone(long_prompt, chunk_size=20) == {46: 9, 1024: 64}
    assert rm.get_blocks_to_run_alone(long_prompt) == {46: 63, 1024: 64}
    assert rm.get_remaining_blocks_per_window(long_prompt, chunk_size=20, prefill_only=True) == {
        46: 9,
        1024: 63,
    }


# ----------------------------------------------------------------------------- the batch form


def _two_decoding(rm: KVCacheResourceManager) -> tuple[Request, Request]:
    a = Request(1, prompt=list(range(8)), max_new_tokens=10)
    b = Request(2, prompt=list(range(20, 24)), max_new_tokens=10)
    batch = ScheduledBatch()
    batch.add_context(a)
    batch.add_context(b)
    rm.prepare_resources(batch)
    a.append_tokens([3])
    b.append_tokens([4])
    rm.update_resources(batch)
    return a, b


def test_next_tokens_appends_the_models_tokens_like_the_per_request_form() -> None:
    """prepare_resources(batch, next_tokens=...) gives the same blocks and keys as reading
    each request's newest token: the tokens a later request reuses are the ones given."""
    per_request, batched = make_rm(8, 4), make_rm(8, 4)
    for rm, form in ((per_request, False), (batched, True)):
        a, b = _two_decoding(rm)
        for step in range(6):
            gen = ScheduledBatch()
            gen.add_generation(a)
            gen.add_generation(b)
            if form:
                rm.prepare_resources(gen, next_tokens=np.array([a.generated[-1], b.generated[-1]]))
            else:
                rm.prepare_resources(gen)
            a.append_tokens([50 + step])
            b.append_tokens([60 + step])
            rm.update_resources(gen)
        rm.manager.check_invariants()
    for rid in (1, 2):
        for w in per_request.window_sizes:
            ids = per_request.manager.get_cache_block_ids(rid, w)
            assert ids == batched.manager.get_cache_block_ids(rid, w)
    assert [per_request.manager.num_tokens(r) for r in (1, 2)] == [14, 10]
    assert [batched.manager.num_tokens(r) for r in (1, 2)] == [14, 10]
    # The appended tokens were the given ones: request 1's first three blocks are reusable.
    tokens = [*range(8), 3, 50, 51, 52]
    for rm in (per_request, batched):
        rm.manager.remove_sequence(1)
        assert rm.manager.get_reusable_prefix_length([*tokens, 99]) == 12


def test_next_tokens_errors_change_nothing() -> None:
    rm = make_rm(8, 4)
    a, b = _two_decoding(rm)
    gen = ScheduledBatch()
    gen.add_generation(a)
    gen.add_generation(b)
    before = [rm.manager.get_cache_block_ids(r.request_id, 256) for r in (a, b)]
    with pytest.raises(ValueError, match="next_tokens has 1 tokens for 2 generation requests"):
        rm.prepare_resources(gen, next_tokens=[7])
    ghost = Request(9, prompt=[1, 2], max_new_tokens=4, state=RequestState.GENERATION)
    bad = ScheduledBatch()
    bad.add_generation(a)
    bad.add_generation(ghost)
    with pytest.raises(KeyError):
        rm.prepare_resources(bad, next_tokens=[7, 8])
    assert [rm.manager.get_cache_block_ids(r.request_id, 256) for r in (a, b)] == before
    assert [rm.manager.num_tokens(r.request_id) for r in (a, b)] == [8, 4]
    rm.manager.check_invariants()
