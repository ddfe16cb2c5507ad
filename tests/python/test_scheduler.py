"""Tests for kvcache.scheduler: admission, pausing and long seeded runs on small pools."""

from __future__ import annotations

import random

import pytest

from kvcache import KvCacheConfig, ModelConfig, OutOfBlocksError
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import CapacityScheduler, SchedulerOutput

MODEL = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=8)


def make_rm(
    blocks: dict[int, int],
    *,
    tpb: int = 4,
    pattern: list[int | None] | None = None,
    max_seq_len: int = 64,
    max_batch_size: int = 8,
    max_draft_tokens: int = 0,
    lend_free_memory: bool = False,
) -> KVCacheResourceManager:
    config = KvCacheConfig(
        tokens_per_block=tpb,
        max_attention_window=pattern if pattern is not None else [8, None],
        backend="virtual",
        lend_free_memory=lend_free_memory,
    )
    return KVCacheResourceManager.from_blocks(
        MODEL,
        config,
        blocks,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
        max_draft_tokens=max_draft_tokens,
    )


def ids(requests: list[Request]) -> list[int]:
    return [r.request_id for r in requests]


class Engine:
    """A minimal engine loop: schedule, prepare, produce tokens, update, free finished."""

    def __init__(
        self,
        rm: KVCacheResourceManager,
        scheduler: CapacityScheduler,
        *,
        draft_tokens: int = 0,
        seed: int = 0,
    ) -> None:
        self.rm = rm
        self.scheduler = scheduler
        self.active: list[Request] = []
        self.outputs: dict[int, list[int]] = {}
        self.finished: list[Request] = []
        self.rejected: list[Request] = []
        self.paused_events = 0
        self.draft_tokens = draft_tokens
        self.rng = random.Random(seed)
        self.prefill_chunks = 0
        self.max_step_tokens = 0

    def submit(self, request: Request, output: list[int]) -> None:
        self.active.append(request)
        self.outputs[request.request_id] = output

    def step(self) -> SchedulerOutput:
        for r in self.active:
            if r.state is RequestState.GENERATION and self.draft_tokens:
                truth = self.outputs[r.request_id][r.num_generated :]
                good = self.rng.randint(0, self.draft_tokens)
                r.draft_tokens = [
                    truth[j] if j < good and j < len(truth) else 99_999
                    for j in range(self.draft_tokens)
                ]
        out = self.scheduler.schedule(self.active)
        self.paused_events += len(out.paused)
        self.rejected += out.rejected
        batch = out.batch
        budget = self.scheduler.max_num_batched_tokens
        if budget is not None and self.scheduler.chunked_prefill:
            assert batch.num_tokens() <= budget
        self.max_step_tokens = max(self.max_step_tokens, batch.num_tokens())
        self.rm.prepare_resources(batch)
        for r in batch.context_requests:
            self.prefill_chunks += 1
            if batch.is_last_chunk(r):
                r.append_tokens([self.outputs[r.request_id][r.num_generated]])
        for r, d in batch.generation:
            g = r.num_generated
            truth = self.outputs[r.request_id]
            accepted = 0
            while accepted < d and r.draft_tokens[accepted] == truth[g + accepted]:
                accepted += 1
            r.append_tokens(truth[g : g + accepted + 1])
            r.rewind_len = d - accepted
        self.rm.update_resources(batch)
        for r in batch.context_requests + batch.generation_requests:
            if r.is_finished:
                self.rm.free_resources(r)
                self.finished.append(r)
        self.active = [
            r for r in self.active if r.state not in (RequestState.FINISHED, RequestState.FAILED)
        ]
        return out


# ----------------------------------------------------------------------------- admission


def test_guaranteed_no_evict_reserves_until_completion() -> None:
    rm = make_rm({8: 8, 64: 8})
    reqs = [Request(i, prompt=[1] * 10, max_new_tokens=10) for i in range(3)]
    out = CapacityScheduler(rm, "guaranteed_no_evict").schedule(reqs)
    # each needs ceil(19/4) = 5 full-window blocks before it finishes; 8 hold one
    assert ids(out.batch.context_requests) == [0]
    assert ids(out.waiting) == [1, 2]
    assert out.paused == [] and out.rejected == []


def test_max_utilization_admits_by_next_step() -> None:
    rm = make_rm({8: 8, 64: 8})
    reqs = [Request(i, prompt=[1] * 10, max_new_tokens=10) for i in range(3)]
    out = CapacityScheduler(rm, "max_utilization").schedule(reqs)
    assert ids(out.batch.context_requests) == [0, 1]  # 3 blocks each
    assert ids(out.waiting) == [2]


def test_first_come_first_served_without_overtaking() -> None:
    rm = make_rm({8: 8, 64: 8})
    big = Request(0, prompt=[1] * 30, max_new_tokens=2)  # 8 blocks
    small = Request(1, prompt=[1] * 2, max_new_tokens=2)
    running = Request(2, prompt=[1] * 2, max_new_tokens=2)
    sched = CapacityScheduler(rm, "guaranteed_no_evict")
    first = sched.schedule([running])
    rm.prepare_resources(first.batch)
    running.append_tokens([5])
    out = sched.schedule([running, big, small])
    assert ids(out.batch.generation_requests) == [2]
    assert out.batch.context_requests == []
    assert ids(out.waiting) == [0, 1]  # small waits behind big


def test_rejects_requests_that_can_never_fit() -> None:
    rm = make_rm({8: 4, 64: 6})
    too_long = Request(0, prompt=[1] * 60, max_new_tokens=10)  # > max_seq_len
    too_big = Request(1, prompt=[1] * 30, max_new_tokens=1)  # 8 blocks > 6 and > 4
    ok = Request(2, prompt=[1] * 4, max_new_tokens=4)
    for policy in ("guaranteed_no_evict", "max_utilization"):
        for r in (too_long, too_big, ok):
            r.state = RequestState.WAITING
        out = CapacityScheduler(rm, policy).schedule([too_long, too_big, ok])
        assert ids(out.rejected) == [0, 1]
        assert too_long.state is RequestState.FAILED
        assert ids(out.batch.context_requests) == [2]


def test_batch_size_and_token_limits() -> None:
    rm = make_rm({8: 64, 64: 64}, max_batch_size=3)
    reqs = [Request(i, prompt=[1] * 6, max_new_tokens=2) for i in range(5)]
    out = CapacityScheduler(rm, "max_utilization").schedule(reqs)
    assert ids(out.batch.context_requests) == [0, 1, 2]
    out = CapacityScheduler(rm, "max_utilization", max_batch_size=2).schedule(reqs)
    assert ids(out.batch.context_requests) == [0, 1]
    # chunked prefill fills the token budget: the third prompt gets what is left
    out = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=13).schedule(reqs)
    assert [(r.request_id, out.batch.chunk_size(r)) for r in out.batch.context_requests] == [
        (0, 6),
        (1, 6),
        (2, 1),
    ]
    out = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=4).schedule(reqs)
    assert [(r.request_id, out.batch.chunk_size(r)) for r in out.batch.context_requests] == [(0, 4)]
    capped = CapacityScheduler(rm, "max_utilization", max_chunk_size=5)
    assert capped.max_chunk_size == 5
    out = capped.schedule(reqs)
    assert [out.batch.chunk_size(r) for r in out.batch.context_requests] == [5, 5, 5]
    # whole prompts: admitted while they fit the budget; one above it still runs alone
    whole = {"chunked_prefill": False}
    out = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=13, **whole).schedule(
        reqs
    )
    assert ids(out.batch.context_requests) == [0, 1]
    out = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=4, **whole).schedule(reqs)
    assert ids(out.batch.context_requests) == [0]
    assert out.batch.chunk_size(reqs[0]) == 6


def test_constructor_errors() -> None:
    rm = make_rm({8: 8, 64: 8})
    with pytest.raises(ValueError, match="policy must be one of"):
        CapacityScheduler(rm, "fcfs")
    with pytest.raises(ValueError, match=r"max_batch_size must be in 1\.\.8"):
        CapacityScheduler(rm, max_batch_size=9)
    with pytest.raises(ValueError, match="max_num_batched_tokens must be a positive int"):
        CapacityScheduler(rm, max_num_batched_tokens=0)
    with pytest.raises(ValueError, match="max_chunk_size must be a positive int"):
        CapacityScheduler(rm, max_chunk_size=0)
    with pytest.raises(ValueError, match="max_chunk_size needs chunked_prefill"):
        CapacityScheduler(rm, max_chunk_size=8, chunked_prefill=False)
    with pytest.raises(ValueError, match=r"must exceed the manager's max_draft_tokens \(3\)"):
        CapacityScheduler(make_rm({8: 8, 64: 8}, max_draft_tokens=3), max_num_batched_tokens=3)
    default = CapacityScheduler(rm)
    assert default.policy == "guaranteed_no_evict"
    assert (default.max_num_batched_tokens, default.chunked_prefill) == (8192, True)
    assert default.max_chunk_size == 8192
    assert CapacityScheduler(rm, max_num_batched_tokens=None).max_chunk_size is None
    assert CapacityScheduler(rm, chunked_prefill=False).max_chunk_size is None


# ----------------------------------------------------------------------------- pausing


def test_max_utilization_pauses_newest_and_resumes_without_loss() -> None:
    # Full window: 6 blocks of 4 tokens. Two requests of 8-token prompts and 12 new tokens
    # each need 5 blocks at the end: both start, the newer one is paused when the pool runs
    # out, and resumes (prompt + generated registered again) once the older one finished.
    rm = make_rm({8: 6, 64: 6})
    engine = Engine(rm, CapacityScheduler(rm, "max_utilization"))
    a = Request(1, prompt=list(range(8)), max_new_tokens=12)
    b = Request(2, prompt=list(range(100, 108)), max_new_tokens=12)
    engine.submit(a, list(range(200, 212)))
    engine.submit(b, list(range(300, 312)))
    paused_at = None
    for step in range(100):
        out = engine.step()
        rm.manager.check_invariants()
        if out.paused:
            assert ids(out.paused) == [2]
            assert b.state is RequestState.PAUSED
            assert not rm.has_request(b)
            paused_at = step
        if not engine.active:
            break
    assert paused_at is not None
    assert b.num_pauses == 1
    assert a.generated == list(range(200, 212))
    assert b.generated == list(range(300, 312))  # nothing lost
    assert engine.finished == [a, b]
    assert rm.get_num_free_blocks(64) == 6
    assert rm.get_num_free_blocks(8) == 6


def test_guaranteed_no_evict_never_pauses_on_the_same_workload() -> None:
    rm = make_rm({8: 6, 64: 6})
    engine = Engine(rm, CapacityScheduler(rm, "guaranteed_no_evict"))
    a = Request(1, prompt=list(range(8)), max_new_tokens=12)
    b = Request(2, prompt=list(range(100, 108)), max_new_tokens=12)
    engine.submit(a, list(range(200, 212)))
    engine.submit(b, list(range(300, 312)))
    while engine.active:
        engine.step()
        rm.manager.check_invariants()
    assert engine.paused_events == 0
    assert b.generated == list(range(300, 312))


# ----------------------------------------------------------------------------- long runs


def _long_run(
    policy: str,
    *,
    num_requests: int,
    seed: int,
    draft_tokens: int = 0,
    pattern: list[int | None] | None = None,
    blocks: dict[int, int] | None = None,
    tpb: int = 4,
    lend_free_memory: bool = False,
    **options: int | bool | None,
) -> Engine:
    rng = random.Random(seed)
    rm = make_rm(
        blocks if blocks is not None else {8: 24, 64: 40},
        tpb=tpb,
        pattern=pattern,
        max_batch_size=12,
        max_draft_tokens=draft_tokens,
        lend_free_memory=lend_free_memory,
    )
    engine = Engine(
        rm, CapacityScheduler(rm, policy, **options), draft_tokens=draft_tokens, seed=seed + 1
    )
    next_id = 0
    steps = 0
    while next_id < num_requests or engine.active:
        for _ in range(rng.choice([0, 0, 1, 1, 2, 3])):
            if next_id < num_requests:
                # prompts just below, at and above the window (8) and block (4) boundaries
                p = rng.choice([1, 3, 4, 5, 7, 8, 9, 12, 13, 20, 33])
                n = rng.randint(1, min(30, 64 - p + 1))
                engine.submit(
                    Request(
                        next_id, prompt=[rng.randrange(50) for _ in range(p)], max_new_tokens=n
                    ),
                    [rng.randrange(50) for _ in range(n)],
                )
                next_id += 1
        engine.step()
        rm.manager.check_invariants()
        for w in rm.window_sizes:
            assert 0 <= rm.get_num_used_blocks(w) <= rm.manager.blocks_per_window[w][0]
            if not lend_free_memory:
                assert rm.get_num_free_blocks(w) <= rm.num_primary_blocks(w)
        steps += 1
        assert steps < 100_000
    for w in rm.window_sizes:
        assert rm.get_num_used_blocks(w) == 0
        if not lend_free_memory:
            assert rm.get_num_free_blocks(w) == rm.num_primary_blocks(w)
    assert rm.manager.num_sequences == 0
    for r in engine.finished:
        assert r.generated == engine.outputs[r.request_id]
    assert len(engine.finished) + len(engine.rejected) == num_requests
    return engine


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_thousands_of_requests_on_a_small_pool(policy: str) -> None:
    engine = _long_run(policy, num_requests=2000, seed=7)
    assert len(engine.finished) == 2000  # every request fits the pool on its own
    if policy == "guaranteed_no_evict":
        assert engine.paused_events == 0
    else:
        assert engine.paused_events > 0


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_long_run_with_draft_tokens(policy: str) -> None:
    engine = _long_run(policy, num_requests=600, seed=11, draft_tokens=3)
    assert len(engine.finished) == 600


def test_long_run_three_windows_unaligned() -> None:
    # windows 5 and 10 are not multiples of the 4-token block
    engine = _long_run(
        "max_utilization",
        num_requests=600,
        seed=3,
        pattern=[5, 10, None],
        blocks={5: 20, 10: 24, 64: 40},
    )
    assert len(engine.finished) == 600


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_long_run_with_lending(policy: str) -> None:
    """Windows that lend each other memory: the sliding window's 12 blocks could not hold a
    33-token prompt (9 blocks) plus its neighbours for long, full attention's 52 blocks have
    room; every step stays allocatable, guaranteed_no_evict never pauses, every block is
    free at the end, and memory really moved."""
    engine = _long_run(
        policy, num_requests=600, seed=5, blocks={8: 12, 64: 52}, lend_free_memory=True
    )
    assert len(engine.finished) == 600
    assert engine.rm.manager.get_kv_cache_stats().lent_slabs > 0
    if policy == "guaranteed_no_evict":
        assert engine.paused_events == 0


def test_guaranteed_no_evict_rejects_what_exceeds_the_pool() -> None:
    engine = _long_run("guaranteed_no_evict", num_requests=300, seed=5, blocks={8: 24, 64: 12})
    assert engine.rejected  # e.g. 33-token prompts with long outputs need > 12 blocks
    assert all(r.state is RequestState.FAILED for r in engine.rejected)


# ----------------------------------------------------------------------------- reuse


def _reuse_run(
    policy: str,
    swa_policy: str,
    *,
    seed: int,
    num_requests: int = 500,
    **options: int | bool | None,
) -> Engine:
    """Requests that share prefixes (system prompts longer than the window, later turns
    extending earlier prompts) arrive while others run, so running requests share cached
    blocks, including sliding-window blocks that they later release."""
    rng = random.Random(seed)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        swa_reuse_policy=swa_policy,
    )
    rm = KVCacheResourceManager.from_blocks(
        MODEL, config, {8: 24, 64: 40}, max_seq_len=64, max_batch_size=12
    )
    engine = Engine(rm, CapacityScheduler(rm, policy, **options), seed=seed + 1)
    systems = [[rng.randrange(50) for _ in range(n)] for n in (6, 13, 17, 21)]
    history: list[list[int]] = []
    next_id = steps = max_shared = 0
    while next_id < num_requests or engine.active:
        for _ in range(rng.choice([0, 1, 1, 2, 3])):
            if next_id >= num_requests:
                break
            if history and rng.random() < 0.3:
                base = rng.choice(history)
            else:
                base = rng.choice(systems)
            prompt = (base + [rng.randrange(50) for _ in range(rng.randint(0, 9))])[:40]
            n = rng.randint(1, 64 - len(prompt))
            output = [rng.randrange(50) for _ in range(n)]
            history.append((prompt + output)[:36])
            engine.submit(Request(next_id, prompt=prompt, max_new_tokens=n), output)
            next_id += 1
        engine.step()
        rm.manager.check_invariants()
        max_shared = max(max_shared, rm.get_num_shared_blocks(8))
        assert rm.get_num_shared_blocks(64) == 0  # full attention never releases early
        steps += 1
        assert steps < 100_000
    for w in rm.window_sizes:
        assert rm.get_num_free_blocks(w) == rm.num_primary_blocks(w)  # cached blocks are free
    assert rm.get_num_shared_blocks(8) == 0
    assert rm.manager.num_sequences == 0
    assert len(engine.finished) + len(engine.rejected) == num_requests
    for r in engine.finished:
        assert r.generated == engine.outputs[r.request_id]
    stats = rm.manager.get_kv_cache_stats()
    assert stats.reused_blocks > 0
    assert sum(r.reused_tokens for r in engine.finished) > 0
    assert max_shared > 0  # running requests really shared sliding-window blocks
    return engine


@pytest.mark.parametrize("swa_policy", ["invalidate", "placeholder"])
@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_long_run_with_shared_prefixes(policy: str, swa_policy: str) -> None:
    engine = _reuse_run(policy, swa_policy, seed=21)
    if policy == "guaranteed_no_evict":
        assert engine.paused_events == 0  # shared blocks never made anyone run out


def test_admission_counts_blocks_held_by_running_requests() -> None:
    # Full window of 8 blocks: a 16-token prompt (4 blocks, 5 at the end) runs; the same
    # prompt again only needs a fresh last block (the rest is held by the first), so it
    # is admitted although 4 fresh blocks would not fit next to the first one's reservation.
    rm = make_rm({8: 16, 64: 8})
    sched = CapacityScheduler(rm, "guaranteed_no_evict")
    prompt = list(range(1, 17))
    a = Request(1, prompt=prompt, max_new_tokens=4)  # 19 tokens at most: 5 blocks
    out = sched.schedule([a])
    rm.prepare_resources(out.batch)
    a.append_tokens([90])
    rm.update_resources(out.batch)  # stores a's prompt blocks for early reuse
    b = Request(2, prompt=prompt, max_new_tokens=1)
    # early reuse stored blocks 0-2 (the last prompt token is never stored), all held by a:
    # one fresh block
    assert rm.get_remaining_blocks_to_completion(b, 64) == 1
    # without looking at the cache: one block per position
    assert rm.get_remaining_blocks_to_completion(b, 64, use_reuse=False) == 4
    out = sched.schedule([a, b])
    assert ids(out.batch.context_requests) == [2]
    rm.prepare_resources(out.batch)
    assert b.reused_tokens == 12
    rm.manager.check_invariants()


# ----------------------------------------------------------------------------- chunked prefill


@pytest.mark.parametrize("swa_policy", ["invalidate", "placeholder"])
@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
@pytest.mark.parametrize(("budget", "chunk"), [(24, 7), (40, 13)])
def test_long_run_with_chunked_prefill_and_shared_prefixes(
    policy: str, swa_policy: str, budget: int, chunk: int
) -> None:
    """Chunks shorter and longer than the 8-token window, not multiples of the block, a
    token budget that binds: invariants hold every step, the budget is never exceeded,
    every block is free at the end and guaranteed_no_evict never pauses."""
    engine = _reuse_run(
        policy,
        swa_policy,
        seed=31,
        num_requests=300,
        max_num_batched_tokens=budget,
        max_chunk_size=chunk,
    )
    assert engine.prefill_chunks > len(engine.finished)  # prompts really ran in chunks
    assert budget - chunk < engine.max_step_tokens <= budget  # the budget binds
    if policy == "guaranteed_no_evict":
        assert engine.paused_events == 0


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_long_run_with_chunks_and_draft_tokens(policy: str) -> None:
    engine = _long_run(policy, num_requests=400, seed=13, draft_tokens=3, max_num_batched_tokens=16)
    assert len(engine.finished) == 400
    assert engine.prefill_chunks > 400
    assert engine.max_step_tokens == 16
    if policy == "guaranteed_no_evict":
        assert engine.paused_events == 0


def test_budget_goes_to_decodes_first_then_chunks() -> None:
    rm = make_rm({8: 64, 64: 64})
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=10)
    engine = Engine(rm, sched)
    reqs = [Request(i, prompt=[i + 1] * 3, max_new_tokens=8) for i in range(5)]
    for r in reqs:
        engine.submit(r, list(range(8)))
    out = engine.step()  # 3 + 3 + 3 + 1: the fourth prompt starts with one token
    assert [out.batch.chunk_size(r) for r in out.batch.context_requests] == [3, 3, 3, 1]
    out = engine.step()  # 3 decodes, then the rest of the fourth prompt, then a chunk of 5
    assert ids(out.batch.generation_requests) == [0, 1, 2]
    assert [(r.request_id, out.batch.chunk_size(r)) for r in out.batch.context_requests] == [
        (3, 2),
        (4, 3),
    ]
    assert out.batch.num_tokens() == 8
    # 5 decodes of 1 + 2 drafts would take 15 tokens: the last two skip the step, keep their
    # blocks and run in a later step
    drafts = make_rm({8: 64, 64: 64}, max_draft_tokens=2)
    sched = CapacityScheduler(drafts, "max_utilization", max_num_batched_tokens=10)
    engine = Engine(drafts, sched, draft_tokens=2)
    for i in range(5):
        engine.submit(Request(i, prompt=[1], max_new_tokens=9), list(range(9)))
    engine.step()
    out = engine.step()
    assert [(r.request_id, d) for r, d in out.batch.generation] == [(0, 2), (1, 2), (2, 2)]
    assert all(drafts.has_request(r) for r in engine.active)
    while engine.active:
        engine.step()
        drafts.manager.check_invariants()
    assert len(engine.finished) == 5


def test_chunks_admit_a_prompt_too_long_for_the_sliding_pool() -> None:
    """A 60-token prompt needs 15 blocks in every window when registered whole, more than
    the 8-token window's pool of 10; in chunks of 8 the window holds at most 5."""
    for policy in ("guaranteed_no_evict", "max_utilization"):
        rm = make_rm({8: 10, 64: 20})
        r = Request(1, prompt=list(range(1, 61)), max_new_tokens=4)
        whole = CapacityScheduler(rm, policy, chunked_prefill=False)
        assert ids(whole.schedule([r]).rejected) == [1]
        r.state = RequestState.WAITING
        engine = Engine(rm, CapacityScheduler(rm, policy, max_chunk_size=8))
        engine.submit(r, [1, 2, 3, 4])
        while engine.active:
            engine.step()
            rm.manager.check_invariants()
            assert rm.get_num_allocated_blocks(r, 8) <= 5
        assert engine.finished == [r] and engine.prefill_chunks == 8
        assert rm.get_num_free_blocks(8) == 10 and rm.get_num_free_blocks(64) == 20


def test_max_utilization_keeps_blocks_for_prompts_being_prefilled() -> None:
    """A prompt whose later chunks the full window must still hold is not starved by
    newer admissions: they wait until its prefill is done."""
    rm = make_rm({8: 64, 64: 12})
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=8)
    engine = Engine(rm, sched)
    a = Request(1, prompt=list(range(1, 33)), max_new_tokens=2)  # 8 full-window blocks
    b = Request(2, prompt=list(range(40, 56)), max_new_tokens=2)  # 4 more: 12 in all
    c = Request(3, prompt=list(range(60, 64)), max_new_tokens=2)
    engine.submit(a, [1, 2])
    engine.submit(b, [1, 2])
    engine.submit(c, [1, 2])
    out = engine.step()
    assert ids(out.batch.context_requests) == [1]  # b's first chunk would not leave a room
    while a.state is RequestState.CONTEXT:
        out = engine.step()
        assert 3 not in ids(out.batch.context_requests)
    while engine.active:
        engine.step()
        rm.manager.check_invariants()
    assert engine.paused_events == 0
    assert engine.finished == [a, b, c]


# ----------------------------------------------------------------------------- the index form


class IndexedEngine(Engine):
    """The same loop with the scheduler's index: add_request at arrival, schedule()."""

    def submit(self, request: Request, output: list[int]) -> None:
        super().submit(request, output)
        self.scheduler.add_request(request)

    def step(self) -> SchedulerOutput:
        listed = self.scheduler.schedule
        self.scheduler.schedule = lambda _active=None: listed()  # type: ignore[method-assign]
        try:
            return super().step()
        finally:
            del self.scheduler.schedule


def _decisions(out: SchedulerOutput) -> tuple[object, ...]:
    batch = out.batch
    return (
        [(r.request_id, k) for r, k in batch.context],
        [(r.request_id, d) for r, d in batch.generation],
        ids(out.paused),
        ids(out.rejected),
        ids(out.waiting),
    )


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("guaranteed_no_evict", {}),
        ("max_utilization", {}),
        ("max_utilization", {"max_num_batched_tokens": 24, "max_chunk_size": 8}),
        ("guaranteed_no_evict", {"max_num_batched_tokens": 16}),
    ],
)
def test_index_form_decides_exactly_as_the_list_form(policy: str, options: dict[str, int]) -> None:
    """Two managers, one driven by schedule(active), one by add_request + schedule(): the
    same seeded arrivals give the same batches, chunk sizes, drafts, pauses, rejections and
    waiting lists at every step (small pools, so both pause and reject)."""
    rng = random.Random(7)
    engines = []
    for cls in (Engine, IndexedEngine):
        rm = make_rm({8: 10, 64: 14}, max_batch_size=6, max_draft_tokens=2)
        engines.append(cls(rm, CapacityScheduler(rm, policy, **options), draft_tokens=2, seed=3))
    next_id = steps = paused = rejected = 0
    while next_id < 160 or any(e.active for e in engines):
        for _ in range(rng.choice([0, 0, 1, 2]) if next_id < 160 else 0):
            prompt = [rng.randrange(40) for _ in range(rng.randint(1, 30))]
            n = rng.randint(1, 64 - len(prompt))
            output = [rng.randrange(40) for _ in range(n)]
            for e in engines:
                e.submit(Request(next_id, prompt=list(prompt), max_new_tokens=n), list(output))
            next_id += 1
        a, b = (e.step() for e in engines)
        assert _decisions(a) == _decisions(b), steps
        paused += len(a.paused)
        rejected += len(a.rejected)
        steps += 1
        assert steps < 20_000
    for e in engines:
        assert len(e.finished) + len(e.rejected) == 160
        for r in e.finished:
            assert r.generated == e.outputs[r.request_id]
    if policy == "max_utilization" and not options:
        assert paused > 0  # the small pools really made it pause


def test_add_request_errors_and_the_lazy_waiting_list() -> None:
    rm = make_rm({8: 8, 64: 8})
    sched = CapacityScheduler(rm, "guaranteed_no_evict")
    reqs = [Request(i, prompt=[1] * 10, max_new_tokens=10) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    with pytest.raises(ValueError, match="already added"):
        sched.add_request(reqs[0])
    out = sched.schedule()
    assert [r.request_id for r in out.batch.context_requests] == [0]
    assert ids(out.waiting) == [1, 2]  # built when first read
    running = Request(9, prompt=[1], max_new_tokens=1, state=RequestState.GENERATION)
    with pytest.raises(ValueError, match="not waiting"):
        sched.add_request(running)


def test_index_form_requeues_an_admission_whose_prepare_failed() -> None:
    """A batch that prepare_resources rejects (out of blocks) is rolled back: its admitted
    request waits again, in the index too, and is scheduled again later."""
    rm = make_rm({8: 8, 64: 8})
    sched = CapacityScheduler(rm, "max_utilization")
    a = Request(0, prompt=[1] * 10, max_new_tokens=2)
    sched.add_request(a)
    out = sched.schedule()
    assert ids(out.batch.context_requests) == [0]
    # Another engine path took the blocks meanwhile: registering fails and rolls back.
    rm.manager.add_sequence(99, list(range(100, 132)))
    with pytest.raises(OutOfBlocksError):
        rm.prepare_resources(out.batch)
    assert a.state is RequestState.WAITING and not rm.has_request(a)
    rm.manager.remove_sequence(99, store_for_reuse=False)
    again = sched.schedule()
    assert ids(again.batch.context_requests) == [0]
    rm.prepare_resources(again.batch)
    assert rm.has_request(a)
    failed = Request(1, prompt=[1] * 100, max_new_tokens=2)  # never fits: rejected at the head
    sched.add_request(failed)
    assert ids(sched.schedule().rejected) == [1]


def test_prepare_reads_an_edited_generation_list_not_the_schedulers_note() -> None:
    """The scheduler hands prepare_resources the ids of the generation entries it built, used
    only while the batch's entries are unchanged: after an engine drops or swaps an entry,
    prepare appends tokens to exactly the requests the batch names."""
    rm = make_rm({8: 16, 64: 16})
    sched = CapacityScheduler(rm, "guaranteed_no_evict")
    reqs = [Request(i, prompt=[i + 1] * 5, max_new_tokens=6) for i in range(3)]
    out = sched.schedule(reqs)
    assert ids(out.batch.context_requests) == [0, 1, 2]
    rm.prepare_resources(out.batch)
    for r in reqs:
        r.append_tokens([50 + r.request_id])
    rm.update_resources(out.batch)

    out = sched.schedule(reqs)  # all three decode
    assert [(r.request_id, d) for r, d in out.batch.generation] == [(0, 0), (1, 0), (2, 0)]
    del out.batch.generation[1]  # the engine skips request 1 in this step
    rm.prepare_resources(out.batch)
    assert [int(rm.manager.num_tokens(i)) for i in range(3)] == [6, 5, 6]
    for r in (reqs[0], reqs[2]):
        r.append_tokens([60 + r.request_id])
    rm.update_resources(out.batch)

    out = sched.schedule(reqs)
    assert ids(out.batch.generation_requests) == [0, 1, 2]
    out.batch.generation[0] = (reqs[1], 0)  # an entry replaced: request 1 twice, 0 never
    with pytest.raises(ValueError, match="request id 1 appears twice in one add_tokens call"):
        rm.prepare_resources(out.batch)
    assert [int(rm.manager.num_tokens(i)) for i in range(3)] == [6, 5, 6]  # nothing changed


# ----------------------------------------------------------------------------- step caches


def _decode_step(rm: KVCacheResourceManager, out: SchedulerOutput) -> None:
    """Prepares the batch, gives every request of it one token, updates."""
    batch = out.batch
    rm.prepare_resources(batch)
    for r in batch.context_requests:
        if batch.is_last_chunk(r):
            r.append_tokens([7])
    for r in batch.generation_requests:
        r.append_tokens([7])
    rm.update_resources(batch)


def _running_pair() -> tuple[KVCacheResourceManager, CapacityScheduler, list[Request]]:
    """Two requests running (both decoding), the list form's head cached."""
    rm = make_rm({8: 32, 64: 32})
    sched = CapacityScheduler(rm, "guaranteed_no_evict")
    reqs = [Request(i, prompt=[1, 2, 3, 4, 5], max_new_tokens=6) for i in range(2)]
    _decode_step(rm, sched.schedule(reqs))  # the prompts
    _decode_step(rm, sched.schedule(reqs))  # one decode: the head is cached now
    return rm, sched, reqs


def test_list_form_head_cache_rereads_states_every_step() -> None:
    """A registered request that finished (not freed yet) leaves the batch although the list
    and the registrations are the same objects as at the cached call."""
    _, sched, reqs = _running_pair()
    reqs[1].state = RequestState.FINISHED
    out = sched.schedule(reqs)
    assert ids(out.batch.generation_requests) == [0]
    assert out.batch.context == []


def test_list_form_head_cache_follows_a_replaced_entry_and_other_sequences() -> None:
    """Another object in the head (same length), or a tuple instead of a list: the cache is
    not used; decisions as without it."""
    rm, sched, reqs = _running_pair()
    newcomer = Request(9, prompt=[4, 4, 4], max_new_tokens=2)
    out = sched.schedule([reqs[0], newcomer, reqs[1]])  # reqs[1] registered but not leading
    assert ids(out.batch.generation_requests) == [0, 1]
    assert ids(out.batch.context_requests) == [9]
    out = sched.schedule(tuple(reqs))
    assert ids(out.batch.generation_requests) == [0, 1]
    _decode_step(rm, out)
    assert [rm.manager.num_tokens(r.request_id) for r in reqs] == [7, 7]


def test_noted_decode_step_falls_back_to_the_named_error() -> None:
    """The one-call decode path of a scheduled batch: a request whose generated tokens do not
    match the cache gets the request-by-request check's error, and nothing is appended."""
    rm, sched, reqs = _running_pair()
    out = sched.schedule(reqs)
    reqs[1].generated.append(8)  # one token too many for the cache
    expected = r"request 1: the cache holds 6 tokens but the request has 8"
    with pytest.raises(ValueError, match=expected):
        rm.prepare_resources(out.batch)
    assert [rm.manager.num_tokens(r.request_id) for r in reqs] == [6, 6]
    reqs[1].generated.pop()
    rm.prepare_resources(out.batch)  # the same batch, now consistent: one token each
    assert [rm.manager.num_tokens(r.request_id) for r in reqs] == [7, 7]
