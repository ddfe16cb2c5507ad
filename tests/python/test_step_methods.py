"""The per-step methods of the native manager (``prefill``, ``store_context_blocks``,
``remove_sequence``, ``add_tokens``, ...) are bound on CPython's vectorcall protocol instead of
through pybind11 (``cpp/bindings/fast_method.h``). Their arguments, errors and threading must
behave as every other method's: by position or keyword, Python's TypeError wording, ValueError
naming a bad value, nothing changed by a failing call, and no deadlock between threads."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from test_manager import snapshot

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)


def make(backend: str = "virtual", secondary: int = 0, primary: int = 16) -> KVCacheManager:
    """Windows {8, full 64}, 4-token blocks, reuse on."""
    cfg = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend=backend,
        enable_block_reuse=True,
    )
    blocks = {8: (primary, secondary), 64: (primary, secondary)}
    return KVCacheManager.from_blocks(MODEL, cfg, blocks, max_seq_len=64, max_batch_size=8)


def test_arguments_by_position_and_by_keyword_do_the_same() -> None:
    a, b = make(), make()
    prompt = list(range(20))
    assert a.add_sequence(1, prompt, prefill=8) == 0
    assert b.add_sequence(request_id=1, tokens=prompt, prefill=8) == 0
    a.prefill(1, 8)
    b.prefill(num_tokens=8, request_id=1)
    # 16 tokens have blocks and KV: their 4 full blocks are stored.
    assert a.store_context_blocks(1) == b.store_context_blocks(request_id=1) == 4
    assert (a.num_tokens(1), a.prompt_length(1)) == (16, 20)
    assert (b.num_tokens(request_id=1), b.prompt_length(request_id=1)) == (16, 20)
    # Nothing released yet: the first query of the chunk (position 8) attends token 1 onwards.
    assert a.can_allocate({8: 12, 64: 12}) and b.can_allocate(blocks={8: 12, 64: 12})
    assert not a.can_allocate({8: 13}) and not b.can_allocate(blocks={8: 13})
    a.prefill(1, 4)
    b.prefill(1, num_tokens=4)
    a.add_tokens([1], [7])
    b.add_tokens(request_ids=np.array([1]), tokens=np.array([7], dtype=np.int32))
    a.refresh_blocks()
    b.refresh_blocks()
    for m in (a, b):
        # The sliding window released the blocks before token 21 - 8 - 4 (one block of slack).
        assert m.get_cache_block_ids(1, 8) == [-1, -1, -1, 3, 4, 5]
        assert m.get_cache_block_ids(1, 64) == [0, 1, 2, 3, 4, 5]
    # The 5 full blocks of 21 tokens are stored; the sliding window's released blocks 0-2 still
    # hold this sequence's KV, so they are stored and pinned too.
    pinned = {8: [0, 1, 2, 3, 4], 64: [0, 1, 2, 3, 4]}
    assert a.remove_sequence(1, pin=True) == pinned
    assert (
        b.remove_sequence(request_id=np.int64(1), store_for_reuse=np.bool_(True), pin=True)
        == pinned
    )
    assert a._blocks_to_allocate_plain(prompt) == b._blocks_to_allocate_plain(
        tokens=prompt, prefill=None
    )
    # The pinned blocks 0-3 are reused for free; tokens 16-18 match stored block 4 partly, which
    # (pinned, so not taken over) is copied into one fresh block: the prompt's last token fits it.
    assert a._blocks_to_allocate_plain(prompt) == {8: 1, 64: 1}
    assert a._blocks_to_allocate_plain(prompt, 4) == {8: 1, 64: 1}


BAD: list[tuple[str, Callable[[KVCacheManager], object], type[Exception], str]] = [
    (
        "missing",
        lambda m: m.prefill(1),
        TypeError,
        r"^prefill\(\) missing required argument 'num_tokens'$",
    ),
    (
        "too many",
        lambda m: m.prefill(1, 2, 3),
        TypeError,
        r"^prefill\(\) takes 2 positional arguments but 3 were given$",
    ),
    (
        "twice",
        lambda m: m.prefill(1, request_id=1),
        TypeError,
        r"^prefill\(\) got multiple values for argument 'request_id'$",
    ),
    (
        "unknown keyword",
        lambda m: m.store_context_blocks(1, window=8),
        TypeError,
        r"^store_context_blocks\(\) got an unexpected keyword argument 'window'$",
    ),
    (
        "keyword-only",
        lambda m: m.remove_sequence(1, False),
        TypeError,
        r"^remove_sequence\(\) takes 1 positional argument but 2 were given$",
    ),
    (
        "none",
        lambda m: m.refresh_blocks(0),
        TypeError,
        r"^refresh_blocks\(\) takes 0 positional arguments but 1 was given$",
    ),
    (
        "int for bool",
        lambda m: m.remove_sequence(1, store_for_reuse=0),
        ValueError,
        "^store_for_reuse must be a bool, got int$",
    ),
    (
        "None for bool",
        lambda m: m.remove_sequence(1, pin=None),
        ValueError,
        "^pin must be a bool, got NoneType$",
    ),
    ("not a dict", lambda m: m.can_allocate([(8, 1)]), ValueError, "^blocks must be a dict"),
    ("negative id", lambda m: m.prefill(-1, 1), ValueError, r"^request_id = -1 is out of range"),
    ("zero chunk", lambda m: m.prefill(1, 0), ValueError, r"^num_tokens = 0 is out of range"),
    (
        "bool chunk",
        lambda m: m.prefill(1, True),
        ValueError,
        "^num_tokens must be an int, got bool$",
    ),
    ("float id", lambda m: m.num_tokens(1.0), ValueError, "^request_id must be an int, got float$"),
    ("unknown id", lambda m: m.store_context_blocks(2), KeyError, "unknown request id 2"),
    ("chunk too long", lambda m: m.prefill(1, 13), ValueError, "has 12 prompt tokens left"),
    (
        "zero prefill",
        lambda m: m._add_sequence_plain(2, [1, 2], 0),
        ValueError,
        r"^prefill = 0 is out",
    ),
    (
        "no tokens",
        lambda m: m._blocks_to_allocate_plain(prefill=1),
        TypeError,
        r"^_blocks_to_allocate_plain\(\) missing required argument 'tokens'$",
    ),
    ("bad token", lambda m: m.add_tokens([1], [-1]), ValueError, r"tokens\[0\] is negative"),
    (
        "batch with one chunk size",
        lambda m: m.prefill([1], 4),
        ValueError,
        "^prefill: with a list of request ids, num_tokens must be a list as long$",
    ),
    (
        "batch lengths differ",
        lambda m: m.prefill([1], [4, 4]),
        ValueError,
        "^prefill: 1 request ids but 2 num_tokens$",
    ),
    (
        "batch zero chunk",
        lambda m: m.prefill([1], [0]),
        ValueError,
        r"^num_tokens\[0\] = 0 is out of range \[1, 2147483647\]$",
    ),
    (
        "batch bool chunk",
        lambda m: m.prefill([1], [True]),
        ValueError,
        "^num_tokens must hold ints, got bool$",
    ),
    (
        "batch str id",
        lambda m: m.prefill(["1"], [4]),
        ValueError,
        "^request_id must hold ints, got str$",
    ),
    ("str id", lambda m: m.prefill("1", 4), ValueError, "^request_id must be an int, got str$"),
    ("batch unknown id", lambda m: m.prefill([1, 2], [4, 4]), KeyError, "unknown request id 2"),
    (
        "batch id twice",
        lambda m: m.prefill([1, 1], [4, 4]),
        ValueError,
        "^request id 1 appears twice in one prefill call$",
    ),
    (
        "batch chunk too long",
        lambda m: m.prefill(np.array([1]), np.array([13])),
        ValueError,
        "has 12 prompt tokens left",
    ),
    ("store unknown", lambda m: m.store_context_blocks([1, 2]), KeyError, "unknown request id 2"),
    (
        "store id twice",
        lambda m: m.store_context_blocks((1, 1)),
        ValueError,
        "^request id 1 appears twice in one store_context_blocks call$",
    ),
]


@pytest.mark.parametrize(("call", "exc", "match"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_arguments_raise_and_change_nothing(
    call: Callable[[KVCacheManager], object], exc: type[Exception], match: str
) -> None:
    m = make()
    m.add_sequence(1, list(range(20)), prefill=8)
    before = snapshot(m, [1, 2])
    with pytest.raises(exc, match=match):
        call(m)
    assert snapshot(m, [1, 2]) == before
    m.check_invariants()


def _drive(m: KVCacheManager, base: int, errors: list[BaseException]) -> None:
    """Admits, prefills in chunks, stores, decodes and removes 200 requests one at a time; every
    prompt starts with the same 12 tokens, so the other thread's blocks are reused and evicted."""
    try:
        for i in range(200):
            rid = base + i
            prompt = list(range(12)) + [base + i % 7] * (9 + i % 11)
            if i % 3 == 0:
                m.add_sequence(rid, prompt, prefill=8)  # tokens: keyed without the GIL
            else:
                m.add_sequence(rid, m.prepare(prompt), prefill=8)
            while m.num_tokens(rid) < m.prompt_length(rid):
                m.prefill(rid, min(4, m.prompt_length(rid) - m.num_tokens(rid)))
                m.store_context_blocks(rid)
            m.add_tokens([rid], [1])
            m.refresh_blocks()
            m.remove_sequence(rid, store_for_reuse=i % 2 == 0)
    except BaseException as e:  # reported by the test, not lost in the thread
        errors.append(e)


@pytest.mark.parametrize(
    ("backend", "secondary"),
    [("virtual", 0), ("host", 4)],
    ids=["gil-held", "gil-released"],  # MayCopyBlocks: false, then true (host tier)
)
def test_two_threads_drive_one_manager(backend: str, secondary: int) -> None:
    m = make(backend, secondary)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_drive, args=(m, base, errors)) for base in (1000, 2000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), (
        "a thread hung: deadlock between the GIL and the manager"
    )
    assert errors == []
    m.check_invariants()
    assert m.num_sequences == 0
    assert [m.get_num_free_blocks(w) for w in (8, 64)] == [16, 16]
    assert m.get_kv_cache_stats().reused_blocks > 0
