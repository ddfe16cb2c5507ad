"""Prepared prompts through the Python API: converted and keyed once, accepted like tokens."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig, PreparedPrompt


def make(tpb: int = 4) -> KVCacheManager:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    cfg = KvCacheConfig(tokens_per_block=tpb, max_attention_window=[8, None], backend="virtual")
    return KVCacheManager.from_blocks(model, cfg, {8: 20, 64: 20}, max_seq_len=64, max_batch_size=8)


def test_prepared_prompt_answers_like_the_raw_prompt() -> None:
    m = make()
    tokens = list(range(13))
    p = m.prepare(np.asarray(tokens, dtype=np.int64), lora_task_id=5)
    assert isinstance(p, PreparedPrompt)
    assert len(p) == 13
    assert p.tokens.tolist() == tokens
    assert (p.tokens_per_block, p.lora_task_id, p.num_keyed_blocks) == (4, 5, 3)
    assert repr(p) == "PreparedPrompt(13 tokens, tokens_per_block=4)"
    assert m.get_num_blocks_to_allocate(p, prefill=3) == m.get_num_blocks_to_allocate(
        tokens, lora_task_id=5, prefill=3
    )
    assert m.add_sequence(1, p, prefill=3) == 0
    m.prefill(1, 10)
    m.remove_sequence(1)
    assert m.get_reusable_prefix_length(p) == 12
    assert m.get_reusable_prefix_length(tokens, lora_task_id=5) == 12
    assert m.get_reusable_prefix_length(tokens) == 0  # another key: no LoRA
    assert m.get_num_blocks_to_allocate(p) == {8: 3, 64: 4}  # 3 cached free + the last block
    assert m.add_sequence(2, p, priority=80) == 12  # the full path with options
    m.check_invariants()


def test_prepared_prompt_errors() -> None:
    m = make()
    p = m.prepare([1, 2, 3, 4, 5])
    with pytest.raises(ValueError, match="come from the prepared prompt"):
        m.add_sequence(1, p, lora_task_id=1)
    with pytest.raises(ValueError, match="come from the prepared prompt"):
        m.get_reusable_prefix_length(p, cache_salt="s")
    with pytest.raises(ValueError, match="already prepared"):
        m.prepare(p)
    with pytest.raises(ValueError, match="negative"):
        m.prepare([1, -1])
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        m.prepare(list(range(65)))
    other = make(tpb=8).prepare(list(range(9)))
    with pytest.raises(ValueError, match="tokens_per_block 8"):
        m.add_sequence(1, other)
    assert m.num_sequences == 0
    m.check_invariants()


def test_a_sequence_keeps_its_prepared_prompt_after_the_caller_drops_it() -> None:
    # The sequence holds the prompt itself (shared, not copied): the Python object may go.
    m = make()
    tokens = list(range(20, 33))  # 13 tokens
    p = m.prepare(tokens)
    gone = weakref.ref(p)
    assert m.add_sequence(1, p, prefill=5) == 0
    del p
    gc.collect()
    assert gone() is None  # the Python wrapper is gone; the sequence's reference is not
    m.prefill(1, 8)
    m.add_tokens([1], [7])
    m.add_tokens([1], [8])  # the first generated tokens copy the prompt's into the sequence
    m.check_invariants()
    m.remove_sequence(1)  # stores 14 key tokens: 3 prepared full blocks, the rest keyed now
    assert m.get_reusable_prefix_length([*tokens, 7, 8, 9]) == 14
    assert m.get_reusable_prefix_length(tokens) == 12  # the prompt's own last token is not cached
    m.check_invariants()
