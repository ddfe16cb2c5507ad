"""Tests for KVCacheResourceManager.complete_step: the output side of a step in one call.

It must leave the requests, the cache and the freed requests exactly as the per-request form
(``append_tokens`` per sampling entry, ``update_resources``, ``free_resources`` per finished
request) does, and a bad call must change nothing.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvcache import NULL_BLOCK, KvCacheConfig, ModelConfig
from kvcache.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
)

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
WINDOWS = (8, 64)


def make_rm(*, blocks: int = 256, max_draft_tokens: int = 0) -> KVCacheResourceManager:
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual")
    return KVCacheResourceManager.from_blocks(
        MODEL,
        config,
        {8: blocks, 64: blocks},
        max_seq_len=64,
        max_batch_size=16,
        max_draft_tokens=max_draft_tokens,
    )


def snapshot(rm: KVCacheResourceManager, requests: list[Request]) -> list[object]:
    """Everything a step changes: per request its tokens and progress, per running request
    its cached length and blocks in every window, and the pools' used blocks."""
    out: list[object] = []
    for r in requests:
        out.append((r.request_id, list(r.generated), r.state, r.context_position, r.rewind_len))
        out.append(list(r.draft_tokens))
        if rm.has_request(r):
            out.append(rm.manager.num_tokens(r.request_id))
            out.extend(rm.manager.get_cache_block_ids(r.request_id, w) for w in WINDOWS)
    out.extend(rm.get_num_used_blocks(w) for w in WINDOWS)
    return out


def _accepted(r: Request, d: int, out: list[int]) -> int:
    g, a = len(r.generated), 0
    while a < d and r.draft_tokens[a] == out[g + a]:
        a += 1
    return a


def drive(form: str, seed: int) -> tuple[list[list[int]], list[list[int]], list[object]]:
    """Seeded requests (chunked prompts, drafts that partly match) run to the end in one of
    the two forms; returns each step's finished request ids, the generated tokens and the
    snapshots after every step."""
    rng = random.Random(seed)
    rm = make_rm(max_draft_tokens=3)
    shared = [rng.randrange(40) for _ in range(9)]
    requests = [
        Request(
            i,
            prompt=shared[: rng.randrange(10)]
            + [rng.randrange(40) for _ in range(rng.randint(1, 14))],
            max_new_tokens=rng.randint(1, 9),
        )
        for i in range(10)
    ]
    outputs = {
        r.request_id: [rng.randrange(100) for _ in range(r.max_new_tokens)] for r in requests
    }
    waiting = list(requests)
    running: list[Request] = []
    finished_per_step: list[list[int]] = []
    snaps: list[object] = []
    while waiting or running:
        batch = ScheduledBatch()
        for r in running:
            if r.state is RequestState.CONTEXT:
                batch.add_context(r, min(5, r.context_len - r.context_position))
            else:
                out = outputs[r.request_id][len(r.generated) :]
                # Drafts: the true next tokens with one changed now and then.
                r.draft_tokens = [t if rng.random() < 0.7 else t + 1 for t in out[:3]]
                batch.add_generation(r, rm.num_draft_tokens_for(r))
        for r in waiting[: rng.randint(0, 3)]:
            batch.add_context(r, min(5, r.context_len))
            running.append(r)
            waiting.remove(r)
        if not len(batch):
            continue
        rm.prepare_resources(batch)
        if form == "per_request":
            for r, chunk in batch.context:
                if r.context_position + chunk >= r.context_len:
                    r.append_tokens([outputs[r.request_id][len(r.generated)]])
            for r, d in batch.generation:
                a = _accepted(r, d, outputs[r.request_id])
                g = len(r.generated)
                r.append_tokens(outputs[r.request_id][g : g + a + 1])
                r.rewind_len = d - a
            rm.update_resources(batch)
            done = [r for r in batch.context_requests + batch.generation_requests if r.is_finished]
            for r in done:
                rm.free_resources(r)
        else:
            tokens = [
                outputs[r.request_id][len(r.generated)]
                if r.context_position + chunk >= r.context_len
                else -1
                for r, chunk in batch.context
            ]
            accepted = [_accepted(r, d, outputs[r.request_id]) for r, d in batch.generation]
            tokens += [
                outputs[r.request_id][len(r.generated) + a]
                for (r, _), a in zip(batch.generation, accepted, strict=True)
            ]
            done = rm.complete_step(batch, np.array(tokens), accepted=accepted)
        for r in done:
            running.remove(r)
        rm.manager.check_invariants()
        finished_per_step.append([r.request_id for r in done])
        snaps.append(snapshot(rm, requests))
    assert all(r.generated == outputs[r.request_id] for r in requests)
    return finished_per_step, [r.generated for r in requests], snaps


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_complete_step_equals_the_per_request_form(seed: int) -> None:
    expected = drive("per_request", seed)
    got = drive("complete_step", seed)
    assert got[0] == expected[0]  # the same requests finish in the same steps, same order
    assert got[1] == expected[1]
    assert got[2] == expected[2]  # blocks, lengths and states after every step


def _decoding(rm: KVCacheResourceManager) -> tuple[Request, Request]:
    a = Request(1, prompt=list(range(8)), max_new_tokens=3)
    b = Request(2, prompt=list(range(20, 26)), max_new_tokens=5)
    batch = ScheduledBatch()
    batch.add_context(a)
    batch.add_context(b)
    rm.prepare_resources(batch)
    assert rm.complete_step(batch, [70, 80]) == []
    return a, b


def test_exact_tokens_blocks_and_freed_requests() -> None:
    rm = make_rm(blocks=16)
    a, b = _decoding(rm)
    assert (a.generated, b.generated) == ([70], [80])
    assert a.state is b.state is RequestState.GENERATION
    # Blocks are handed out in order: a's 8 prompt tokens hold blocks 0, 1 of each window.
    assert rm.manager.get_cache_block_ids(1, 64) == [0, 1]
    assert rm.manager.get_cache_block_ids(2, 64) == [2, 3]
    batch = ScheduledBatch()
    batch.add_generation(b)
    batch.add_generation(a)
    rm.prepare_resources(batch)
    assert rm.complete_step(batch, np.array([81, 71], dtype=np.int32)) == []
    assert rm.manager.get_cache_block_ids(1, 64) == [0, 1, 4]  # token 70 opened block 4
    batch = ScheduledBatch()
    batch.add_generation(a)
    batch.add_generation(b)
    rm.prepare_resources(batch)
    done = rm.complete_step(batch, [72, 82])
    assert done == [a]  # a reached max_new_tokens=3: freed, b goes on
    assert a.generated == [70, 71, 72] and a.state is RequestState.FINISHED
    assert not rm.has_request(a) and rm.has_request(b)
    assert b.generated == [80, 81, 82] and rm.manager.num_tokens(2) == 8
    # a's full blocks were stored for reuse: a new prompt with its prefix finds them.
    assert rm.manager.get_reusable_prefix_length([*range(8), 99]) == 8


def test_store_for_reuse_false_and_a_single_token_request() -> None:
    rm = make_rm(blocks=16)
    r = Request(5, prompt=list(range(9)), max_new_tokens=1)
    batch = ScheduledBatch()
    batch.add_context(r)
    rm.prepare_resources(batch)
    used = [rm.get_num_used_blocks(w) for w in WINDOWS]
    assert used == [3, 3]
    assert rm.complete_step(batch, [42], store_for_reuse=False) == [r]
    assert r.generated == [42] and r.state is RequestState.FINISHED
    assert [rm.get_num_used_blocks(w) for w in WINDOWS] == [0, 0]
    # The prompt's two full blocks were stored when its chunk ran; nothing else was.
    assert rm.manager.get_reusable_prefix_length([*range(9), 1]) == 8


def test_drafts_accepted_and_rewound() -> None:
    rm = make_rm(blocks=16, max_draft_tokens=3)
    a, b = _decoding(rm)
    a.draft_tokens, b.draft_tokens = [5], [6, 7, 8]
    batch = ScheduledBatch()
    batch.add_generation(a, 1)
    batch.add_generation(b, 3)
    rm.prepare_resources(batch)
    assert rm.manager.num_tokens(2) == 6 + 4  # the newest token and 3 drafts
    done = rm.complete_step(batch, [71, 90], accepted=[1, 1])
    assert done == [a]  # 70, the accepted draft 5 and 71: max_new_tokens=3
    assert a.generated == [70, 5, 71]
    assert b.generated == [80, 6, 90]  # draft 6 accepted, 7 and 8 rewound
    assert b.rewind_len == 0 and b.draft_tokens == []
    assert rm.manager.num_tokens(2) == 8  # prompt + 80 + 6: 90 is the next step's input
    # Without ``accepted`` no draft is accepted: all rewound.
    b.draft_tokens = [1]  # 2 tokens left: at most one draft
    batch = ScheduledBatch()
    batch.add_generation(b, 1)
    rm.prepare_resources(batch)
    assert rm.complete_step(batch, [91]) == []
    assert b.generated == [80, 6, 90, 91] and rm.manager.num_tokens(2) == 9


def test_drafts_not_verified_are_dropped() -> None:
    rm = make_rm(blocks=16, max_draft_tokens=3)
    _, b = _decoding(rm)
    b.draft_tokens = [1, 2]
    batch = ScheduledBatch()
    batch.add_generation(b)  # verifies none of them
    rm.prepare_resources(batch)
    rm.complete_step(batch, [81])
    assert b.draft_tokens == [] and b.generated == [80, 81]


BAD_TOKENS = [
    ([70], "tokens has 1 entries, the batch 2: give one per entry"),
    ([70, 80, 90], "tokens has 3 entries, the batch 2"),
    ([True, 80], r"tokens\[0\] = True is a bool, not a token id"),
    (np.array([True, False]), "tokens must be a 1-D sequence or array of integers, got dtype bool"),
    ([70.0, 80.0], "got dtype float64"),
    (np.array([[70], [80]]), "got 2-D"),
    ([70, 2**31], r"tokens\[1\] = 2147483648 is out of range"),
    ([70, -1], r"tokens\[1\] = -1: generation request 2 must sample a token"),
    (["a", "b"], "got dtype <U1"),
]


@pytest.mark.parametrize(("tokens", "message"), BAD_TOKENS)
def test_bad_tokens_change_nothing(tokens: object, message: str) -> None:
    rm = make_rm(blocks=16)
    a, b = _decoding(rm)
    batch = ScheduledBatch()
    batch.add_generation(a)
    batch.add_generation(b)
    rm.prepare_resources(batch)
    before = snapshot(rm, [a, b])
    with pytest.raises(ValueError, match=message):
        rm.complete_step(batch, tokens)  # type: ignore[arg-type]
    assert snapshot(rm, [a, b]) == before
    assert rm.complete_step(batch, [71, 81]) == []  # still the prepared batch
    assert (a.generated, b.generated) == ([70, 71], [80, 81])


def test_context_entries_sample_exactly_when_their_chunk_ends_the_prompt() -> None:
    rm = make_rm(blocks=16)
    a = Request(1, prompt=list(range(10)), max_new_tokens=2)
    b = Request(2, prompt=list(range(3)), max_new_tokens=2)
    batch = ScheduledBatch()
    batch.add_context(a, 4)
    batch.add_context(b)
    rm.prepare_resources(batch)
    before = snapshot(rm, [a, b])
    with pytest.raises(ValueError, match=r"tokens\[0\] = 5: request 1's chunk does not end"):
        rm.complete_step(batch, [5, 6])
    with pytest.raises(ValueError, match=r"tokens\[1\] = -3: request 2's chunk ends its prompt"):
        rm.complete_step(batch, [-1, -3])
    assert snapshot(rm, [a, b]) == before
    assert rm.complete_step(batch, [-1, 6]) == []
    assert (a.context_position, a.state, a.generated) == (4, RequestState.CONTEXT, [])
    assert (b.context_position, b.state, b.generated) == (3, RequestState.GENERATION, [6])


def test_bad_accepted_changes_nothing() -> None:
    rm = make_rm(blocks=16, max_draft_tokens=3)
    a, b = _decoding(rm)
    a.draft_tokens, b.draft_tokens = [5], [7]
    batch = ScheduledBatch()
    batch.add_generation(a, 1)
    batch.add_generation(b, 1)
    rm.prepare_resources(batch)
    before = snapshot(rm, [a, b])
    for accepted, message in [
        ([0], "accepted has 1 entries, the batch 2"),
        ([0, 2], r"accepted\[1\] = 2: request 2 verified 1 draft tokens this step"),
        ([-1, 0], r"accepted\[0\] = -1: request 1 verified 1"),
        ([1, True], r"accepted\[1\] = True is a bool"),
    ]:
        with pytest.raises(ValueError, match=message):
            rm.complete_step(batch, [71, 81], accepted=accepted)
        assert snapshot(rm, [a, b]) == before


def test_only_the_prepared_batch_once() -> None:
    rm = make_rm(blocks=16)
    a, b = _decoding(rm)
    other = ScheduledBatch()
    other.add_generation(a)
    with pytest.raises(ValueError, match="not the one prepare_resources prepared last"):
        rm.complete_step(other, [71])
    batch = ScheduledBatch()
    batch.add_generation(a)
    rm.prepare_resources(batch)
    rm.complete_step(batch, [71])
    with pytest.raises(ValueError, match="or its step was completed already"):
        rm.complete_step(batch, [72])
    assert a.generated == [70, 71]
    with pytest.raises(TypeError, match="batch must be"):
        rm.complete_step([a], [1])  # type: ignore[arg-type]
    # update_resources also ends the prepared step.
    batch = ScheduledBatch()
    batch.add_generation(b)
    rm.prepare_resources(batch)
    b.append_tokens([81])
    rm.update_resources(batch)
    with pytest.raises(ValueError, match="completed already"):
        rm.complete_step(batch, [82])


def test_a_request_out_of_step_with_its_cache_is_an_error() -> None:
    rm = make_rm(blocks=16)
    a, _ = _decoding(rm)
    batch = ScheduledBatch()
    batch.add_generation(a)
    rm.prepare_resources(batch)
    rm.complete_step(batch, [71])
    batch = ScheduledBatch()
    batch.add_generation(a)
    rm.prepare_resources(batch)  # the cache now holds a's final length: this step ends it
    a.generated.pop()  # behind complete_step's back, after prepare_resources checked
    with pytest.raises(ValueError, match="request 1: its cache reached its final length with 1"):
        rm.complete_step(batch, [72])
    assert a.generated == [70] and rm.has_request(a)


def test_a_failed_prepare_leaves_the_prepared_step() -> None:
    rm = make_rm(blocks=3)  # 3 blocks per window
    a = Request(1, prompt=list(range(12)), max_new_tokens=2)
    b = Request(2, prompt=list(range(20, 28)), max_new_tokens=2)
    first = ScheduledBatch()
    first.add_context(a)
    rm.prepare_resources(first)
    second = ScheduledBatch()
    second.add_context(b)
    with pytest.raises(Exception, match="block"):
        rm.prepare_resources(second)
    with pytest.raises(ValueError, match="not the one prepare_resources prepared last"):
        rm.complete_step(second, [1])
    # The failed call rolled itself back: the step prepared before it completes.
    assert [b for b in rm.manager.get_cache_block_ids(1, 64) if b != NULL_BLOCK] == [0, 1, 2]
    assert rm.complete_step(first, [5]) == []
    assert a.generated == [5] and not rm.has_request(b)
