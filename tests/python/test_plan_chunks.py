"""``kvcache plan``'s per-window numbers against the blocks the manager actually takes.

For every window of a plan, a manager gets exactly the plan's ``peak_blocks`` in that window
(the others ample) and runs one ``max_seq_len``-token prompt chunk by chunk, as the scheduler
cuts it: the most blocks it holds is exactly the plan's peak, and one block less is rejected.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvcache import KVCacheManager, OutOfBlocksError
from kvcache.cli import make_plan
from kvcache.models import load_model

MAX_SEQ_LEN = 4096
TPB = 32


def _run_prompt(
    blocks: dict[int, int], chunk: int | None, drafts: int, first: int | None = None
) -> tuple[dict[int, int], KVCacheManager]:
    """Runs a max_seq_len-token prompt on a fresh manager with ``blocks`` per window, a first
    chunk of ``first`` tokens (default ``chunk``) and then chunks of ``chunk``; returns the most
    blocks each window held."""
    preset = load_model("gemma-3-27b")
    config = dataclasses.replace(preset.kv_cache_config(tokens_per_block=TPB), backend="virtual")
    kv = KVCacheManager.from_blocks(
        preset.model,
        config,
        blocks,
        max_seq_len=MAX_SEQ_LEN,
        max_batch_size=1,
        max_draft_tokens=drafts,
    )
    peak = dict.fromkeys(blocks, 0)

    def observe() -> None:
        for w in blocks:
            peak[w] = max(peak[w], kv.get_num_used_blocks(w))

    prompt = list(range(1, MAX_SEQ_LEN + 1))
    kv.add_sequence(1, prompt, prefill=first or chunk)
    observe()
    while kv.num_tokens(1) < MAX_SEQ_LEN:
        assert chunk is not None
        kv.prefill(1, min(chunk, MAX_SEQ_LEN - kv.num_tokens(1)))
        observe()
    return peak, kv


@pytest.mark.parametrize(
    ("max_num_batched_tokens", "max_chunk_size", "chunked", "drafts"),
    [(512, None, True, 0), (2048, 700, True, 0), (8192, None, False, 0), (512, None, True, 3)],
)
def test_plan_peak_is_what_the_manager_takes(
    max_num_batched_tokens: int, max_chunk_size: int | None, chunked: bool, drafts: int
) -> None:
    preset = load_model("gemma-3-27b")
    plan = make_plan(
        preset,
        8 * 2**30,
        MAX_SEQ_LEN,
        tokens_per_block=TPB,
        policies=["equal"],
        max_num_batched_tokens=max_num_batched_tokens,
        max_chunk_size=max_chunk_size,
        chunked_prefill=chunked,
        max_draft_tokens=drafts,
    )
    rows = {r.window: r for r in plan["policies"][0].rows}
    chunk = plan["chunk_size"]
    assert chunk == (min(max_num_batched_tokens, max_chunk_size or 10**9) if chunked else None)
    ample = {v: rows[v].peak_blocks + 8 for v in rows}
    # The plan's peak is the worst case over every cutting the scheduler may make (a first
    # chunk shortened by the step's budget shifts the rest): try every first-chunk size.
    firsts = [None] if chunk is None else list(range(1, chunk + 1))
    observed = {w: 0 for w in rows}
    worst: dict[int, int | None] = {}
    for first in firsts:
        peak, kv = _run_prompt(ample, chunk, drafts, first)
        for w in rows:
            if peak[w] > observed[w]:
                observed[w], worst[w] = peak[w], first
    kv.check_invariants()
    assert observed == {w: r.peak_blocks for w, r in rows.items()}
    for w, row in rows.items():  # exactly the peak fits, one block less is rejected
        _run_prompt({**ample, w: row.peak_blocks}, chunk, drafts, worst[w])
        with pytest.raises(OutOfBlocksError):
            _run_prompt({**ample, w: row.peak_blocks - 1}, chunk, drafts, worst[w])


def test_plan_numbers_and_what_limits_each_window() -> None:
    plan = make_plan(
        load_model("gemma-3-27b"),
        8 * 2**30,
        MAX_SEQ_LEN,
        tokens_per_block=TPB,
        policies=["equal"],
        max_num_batched_tokens=512,
    )
    rows = {r.window: r for r in plan["policies"][0].rows}
    # Window 1024: ceil((1024 + 512 - 1) / 32) + 1 = 49 blocks while chunks of 512 prefill,
    # ceil(1023 / 32) + 1 = 33 while decoding; full attention: the whole 4,096 tokens.
    assert (rows[1024].peak_blocks, rows[1024].blocks_per_sequence) == (49, 33)
    assert rows[1024].limited_by == "chunk"
    assert (rows[4096].peak_blocks, rows[4096].blocks_per_sequence) == (128, 128)
    assert rows[4096].limited_by == "sequence"
    whole = make_plan(
        load_model("gemma-3-27b"),
        8 * 2**30,
        MAX_SEQ_LEN,
        tokens_per_block=TPB,
        policies=["equal"],
        chunked_prefill=False,
    )
    assert whole["policies"][0].rows[0].peak_blocks == 128  # a whole prompt: every block


def test_auto_never_recommends_a_split_that_rejects_a_max_seq_len_prompt() -> None:
    # The case: gpt-oss-120b, 80 GiB, 131,072 tokens. Window 128 needs 261 blocks for
    # one prompt in 8,192-token chunks; "auto" used to give it 88.
    plan = make_plan(load_model("gpt-oss-120b"), 80 * 2**30, 131072, policies=["auto"])
    p = plan["policies"][0]
    row = p.rows[0]
    assert row.window == 128 and row.peak_blocks == 261 and row.limited_by == "chunk"
    assert row.blocks >= row.peak_blocks
    assert p.max_sequences > 0
    proportional = make_plan(
        load_model("gpt-oss-120b"), 80 * 2**30, 131072, policies=["proportional"]
    )["policies"][0]
    assert proportional.rows[0].blocks < 261 and proportional.max_sequences == 0
