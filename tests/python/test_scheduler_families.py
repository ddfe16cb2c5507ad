"""Beam families in the capacity scheduler: the beams of a request (parent and the children
``fork_resources`` made) decode, pause and resume together; guaranteed_no_evict counts their
shared blocks once; never_fits and admission charge the beams still to fork."""

from __future__ import annotations

import pytest

from kvcache import KvCacheConfig, ModelConfig
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import CapacityScheduler

#: One step: (context requests with their chunks, generation requests, paused, rejected).
Step = tuple[list[tuple[int, int]], list[int], list[int], list[int]]


def make_rm(blocks: int, *, reuse: bool = False) -> KVCacheResourceManager:
    """Window 8 and full attention (32 tokens), 4-token blocks, ``blocks`` blocks each."""
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        enable_block_reuse=reuse,
    )
    return KVCacheResourceManager.from_blocks(
        model, config, {8: blocks, 32: blocks}, max_seq_len=32, max_batch_size=8
    )


class Driver:
    """A fake engine: every step runs the scheduler's batch, appends one token per finished
    context and decode, forks a prompt with beams into its children (ids from 100) after its
    first token, and frees finished requests."""

    def __init__(self, scheduler: CapacityScheduler, rm: KVCacheResourceManager) -> None:
        self.scheduler, self.rm = scheduler, rm
        self.active: list[Request] = []
        self.next_id = 100
        self.used: list[list[int]] = []  # blocks in use per window after each step

    def step(self) -> Step:
        rm = self.rm
        out = self.scheduler.schedule(self.active)
        batch = out.batch
        rm.prepare_resources(batch)
        self.used.append([rm.get_num_used_blocks(w) for w in rm.window_sizes])
        ended = [r for r, _ in batch.context if batch.is_last_chunk(r)]
        for r in ended:
            r.append_tokens([7])
        for r, _ in batch.generation:
            r.append_tokens([8])
        rm.update_resources(batch)
        for r in ended:
            if r.num_sequences > 1 and r.family_id is None and not r.is_finished:
                new = r.max_new_tokens
                ids = range(self.next_id, self.next_id + r.num_sequences - 1)
                kids = [Request(i, list(r.prompt), new, generated=list(r.generated)) for i in ids]
                self.next_id += len(kids)
                rm.fork_resources(r, kids)
                at = self.active.index(r) + 1
                self.active[at:at] = kids
        for r in [r for r in self.active if r.is_finished or r.state is RequestState.FAILED]:
            if rm.has_request(r):
                rm.free_resources(r)
            self.active.remove(r)
        rm.manager.check_invariants()
        return (
            [(r.request_id, k) for r, k in batch.context],
            [r.request_id for r, _ in batch.generation],
            [r.request_id for r in out.paused],
            [r.request_id for r in out.rejected],
        )

    def run(self, limit: int = 50) -> list[Step]:
        steps = []
        while self.active and len(steps) < limit:
            steps.append(self.step())
        assert not self.active
        return steps


def test_a_family_decodes_whole_or_waits_for_the_budget() -> None:
    rm = make_rm(32)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=3)
    d = Driver(sched, rm)
    single, beams = Request(0, [1, 2, 3], 5), Request(1, [4, 5, 6, 7], 4, num_beams=3)
    d.active = [single, beams]
    assert d.run() == [
        ([(0, 3)], [], [], []),
        ([(1, 2)], [0], [], []),
        ([(1, 2)], [0], [], []),  # its first token: forked into 100 and 101
        # 3 beams need 3 tokens, 2 are left after request 0's: no beam decodes (never 2 of 3).
        ([], [0], [], []),
        ([], [0], [], []),
        ([], [1, 100, 101], [], []),
        ([], [1, 100, 101], [], []),
        ([], [1, 100, 101], [], []),
    ]
    assert single.family_id is None and beams.family_id == 1  # named after the parent


def test_a_family_larger_than_the_budget_decodes_alone() -> None:
    rm = make_rm(32)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=2)
    d = Driver(sched, rm)
    d.active = [Request(0, [4, 5], 3, num_beams=3)]
    assert d.run() == [
        ([(0, 2)], [], [], []),
        ([], [0, 100, 101], [], []),
        ([], [0, 100, 101], [], []),
    ]


def test_max_utilization_pauses_whole_families_and_resumes_them_together() -> None:
    """Request 0 and a 3-beam family share 7 blocks per window. When the beams' step (two
    copies of their shared partial block and request 0's new block) does not fit, the newest
    request's whole family is paused, newest first (pausing beam 101 alone would have made
    room: its blocks are shared). Its members come back one per step, each first admission
    reusing the prefix its siblings hold, and decode again only once all three are back."""
    rm = make_rm(7, reuse=True)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=None)
    d = Driver(sched, rm)
    d.active = [Request(0, list(range(8)), 5), Request(1, list(range(10, 16)), 6, num_beams=3)]
    assert d.run() == [
        ([(0, 8), (1, 6)], [], [], []),
        ([], [0, 1, 100, 101], [], []),
        ([], [0, 1, 100, 101], [], []),
        ([], [0], [101, 100, 1], []),
        ([(1, 2)], [0], [], []),  # 9 context tokens, 7 cached
        ([(100, 1)], [], [], []),  # 1 is back (registered, waiting): the family does not decode
        ([(101, 1)], [], [], []),
        ([], [1, 100, 101], [], []),
        ([], [1, 100, 101], [], []),
    ]
    assert max(u for step in d.used for u in step) <= 7


def test_waiting_members_that_can_never_fit_are_rejected_not_stuck() -> None:
    """Without block reuse, each resumed beam recomputes its own copy of the shared prefix;
    when the last one cannot fit beside its registered siblings and nothing else runs, it is
    rejected instead of waiting forever."""
    rm = make_rm(7, reuse=False)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=None)
    d = Driver(sched, rm)
    d.active = [Request(0, list(range(8)), 5), Request(1, list(range(10, 16)), 6, num_beams=3)]
    steps = d.run()
    assert steps[3:7] == [
        ([], [0], [101, 100, 1], []),
        ([(1, 9)], [0], [], []),
        ([(100, 9)], [], [], []),
        ([], [], [], [101]),
    ]
    assert steps[7:] == [([], [1, 100], [], []), ([], [1, 100], [], [])]


def test_guaranteed_no_evict_counts_shared_blocks_once() -> None:
    """Three beams forked at 6 tokens share blocks 0 and 1 and grow to 12 tokens: together
    they take 2 copies (the last writer keeps block 1) and a block each, 5 per window. Each
    beam alone is charged 2 (6 for the three) and the window's extra holdings add 4 more: 10
    in window 8. With 5, a 4-token request (2 blocks) fits 9 blocks beside them."""
    rm = make_rm(9)
    m = rm.manager
    sched = CapacityScheduler(rm, "guaranteed_no_evict", max_num_batched_tokens=None)
    d = Driver(sched, rm)
    family = Request(1, list(range(10, 16)), 7, num_beams=3)
    # Before its fork: its own 3 blocks plus 2 beams x (a copy and one new block).
    assert sched.blocks_to_run_alone(family) == {8: 7, 32: 7}
    assert rm.get_remaining_blocks_per_window(family) == {8: 7, 32: 7}
    d.active = [family]
    assert d.step() == ([(1, 6)], [], [], [])
    beams = [1, 100, 101]
    assert m.get_family_remaining_blocks(beams, 12) == ([5, 5], [4, 0])
    assert m.get_remaining_blocks(beams, [12] * 3) == [6, 6]
    assert [m.get_num_shared_blocks(w) for w in m.window_sizes] == [4, 0]
    d.active.append(Request(2, [1, 2, 3, 4], 5))
    assert d.run() == [
        ([(2, 4)], [1, 100, 101], [], []),
        ([], [1, 100, 101, 2], [], []),
        ([], [1, 100, 101, 2], [], []),
        ([], [1, 100, 101, 2], [], []),
        ([], [1, 100, 101, 2], [], []),
        ([], [1, 100, 101], [], []),
    ]
    # Blocks in use once each step's blocks were given (window 8, full): exactly the pool at
    # the peak; then window 8 releases the shared block 0 (no one else holds it).
    assert d.used == [[2, 2], [5, 5], [6, 6], [9, 9], [9, 9], [9, 9], [6, 7]]


def test_family_remaining_blocks_need_lockstep_beams() -> None:
    rm = make_rm(16)
    m = rm.manager
    m.add_sequence(1, list(range(6)))
    m.fork_sequence(1, [2])
    m.add_tokens([1], [0])
    assert m.get_family_remaining_blocks([1, 2], 12) is None  # 7 and 6 tokens
    m.add_tokens([2], [0])
    assert m.get_family_remaining_blocks([1, 2], 12) == ([2, 2], [1, 0])
    m.add_sequence(3, list(range(10)), prefill=4)
    assert m.get_family_remaining_blocks([3], 12) is None  # in prefill


def test_never_fits_counts_the_beams_to_fork() -> None:
    rm = make_rm(6)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=None)
    alone, beams = Request(0, list(range(6)), 7), Request(1, list(range(6)), 7, num_beams=3)
    assert sched.blocks_to_run_alone(alone) == {8: 3, 32: 3}
    assert sched.blocks_to_run_alone(beams) == {8: 7, 32: 7}
    assert not sched.never_fits(alone) and sched.never_fits(beams)
    out = sched.schedule([beams, alone])
    assert [r.request_id for r in out.rejected] == [1] and beams.state is RequestState.FAILED
    assert [(r.request_id, k) for r, k in out.batch.context] == [(0, 6)]


@pytest.mark.parametrize("policy", ["guaranteed_no_evict", "max_utilization"])
def test_requests_without_families_schedule_as_before(policy: str) -> None:
    """The family arguments change nothing for requests without beams: the same decisions
    with families passed (all -1) as without."""
    rm = make_rm(12)
    native = CapacityScheduler(rm, policy, max_num_batched_tokens=6)._native
    prompts = [rm._prompt(Request(i, list(range(i, i + 5)), 4)) for i in range(4)]
    args = ([], None, None, [0, 1, 2, 3], prompts, [8] * 4)
    plain = native.schedule(*args)
    with_families = native.schedule(
        *args, families=[], beams=[], candidate_families=[-1] * 4, candidate_beams=[0] * 4
    )
    # Nothing running: generation and drafts are None (every running request decodes).
    assert plain == with_families == (None, None, [], [], [0, 1], [5, 1], [], [])


class IndexDriver(Driver):
    """The same fake engine on the index form: ``add_request`` once, ``schedule()``."""

    def step(self) -> Step:
        sched = self.scheduler
        original = sched.schedule
        sched.schedule = lambda requests=None: original()  # type: ignore[method-assign]
        try:
            return super().step()
        finally:
            sched.schedule = original  # type: ignore[method-assign]


@pytest.mark.parametrize("reuse", [True, False])
def test_index_form_schedules_families_as_the_list_form(reuse: bool) -> None:
    logs = []
    for driver in (Driver, IndexDriver):
        rm = make_rm(7, reuse=reuse)
        sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=None)
        d = driver(sched, rm)
        d.active = [Request(0, list(range(8)), 5), Request(1, list(range(10, 16)), 6, num_beams=3)]
        if driver is IndexDriver:
            for r in d.active:
                sched.add_request(r)
        logs.append(d.run())
    assert logs[0] == logs[1]
    assert ([], [0], [101, 100, 1], []) in logs[1]  # the whole family paused


def test_admission_keeps_batch_slots_for_the_beams_to_fork() -> None:
    """max_batch_size 8: two 4-beam prompts take every slot once forked, so the single request
    behind them waits (admitting it would make the second fork exceed the batch); 9 beams can
    never fit."""
    rm = make_rm(64)
    sched = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=None)
    d = Driver(sched, rm)
    too_many = Request(3, [1, 2], 2, num_beams=9)
    assert sched.never_fits(too_many)
    d.active = [
        Request(0, [1, 2, 3], 3, num_beams=4),
        Request(1, [4, 5, 6], 2, num_beams=4),
        Request(2, [7, 8], 2),
        too_many,
    ]
    assert d.run() == [
        ([(0, 3), (1, 3)], [], [], [3]),
        ([], [0, 100, 101, 102, 1, 103, 104, 105], [], []),
        ([(2, 2)], [0, 100, 101, 102], [], []),
        ([], [2], [], []),
    ]
