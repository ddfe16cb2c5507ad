"""Bad input to the manager: uninitialized or re-initialized objects, out-of-range integers.

Every case checks the exact exception type and that the message names the argument (or the
class, for lifecycle errors).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvcache import (
    CapacityScheduler,
    KvCacheConfig,
    KVCacheManager,
    KVCacheResourceManager,
    ModelConfig,
    Request,
    ScheduledBatch,
    _core,
)

MODEL = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
I63 = 2**63
I31 = 2**31


def make(**config: Any) -> KVCacheManager:
    """Two windows (8 and full 64), 4-token blocks, host memory, one 5-token sequence (id 1)."""
    cfg = KvCacheConfig(
        tokens_per_block=4, max_attention_window=[8, None], backend="host", **config
    )
    m = KVCacheManager.from_blocks(MODEL, cfg, {8: 8, 64: 8}, max_seq_len=64, max_batch_size=4)
    m.add_sequence(1, [1, 2, 3, 4, 5])
    return m


def native_kwargs(**overrides: Any) -> dict[str, Any]:
    """Arguments of a valid ``_core.KVCacheManager``, with ``overrides``."""
    kwargs: dict[str, Any] = {
        "num_layers": 1,
        "num_kv_heads": [1],
        "head_dim": 4,
        "dtype": "float16",
        "kv_factor": 2,
        "tokens_per_block": 4,
        "max_attention_window": [],
        "max_seq_len": 64,
        "max_batch_size": 4,
        "blocks_per_window": {64: (8, 0)},
        "backend": "host",
    }
    kwargs.update(overrides)
    return kwargs


def offsets_table() -> np.ndarray:
    return np.full((2, 4, 2, 16), 99, dtype=np.int32)  # [num_pools, rows, kv_factor, width]


# --------------------------------------------------------------------------------------
# Lifecycle: a method before __init__, a second __init__
# --------------------------------------------------------------------------------------

# Runs in a subprocess: before the fix these calls hung or crashed the interpreter.
_UNINITIALIZED_SCRIPT = """
import json, sys
import numpy as np
import kvcache
from kvcache import _core
cls = kvcache.KVCacheManager if sys.argv[1] == "kvcache" else _core.KVCacheManager
m = cls.__new__(cls)
calls = {
    "add_token": lambda: m.add_token(1, 1),
    "add_tokens": lambda: m.add_tokens([1], [1]),
    "num_sequences": lambda: m.num_sequences,
    "window_sizes": lambda: m.window_sizes,
    "copy_block_offsets": lambda: m.copy_block_offsets(np.zeros((1, 1, 2, 1), np.int32), [1]),
    "remove_sequence": lambda: m.remove_sequence(1),
    "num_tokens": lambda: m.num_tokens(1),
    "has_sequence": lambda: m.has_sequence(1),
    "get_cache_block_ids": lambda: m.get_cache_block_ids(1),
    "rewind": lambda: m.rewind(1, 1),
    "store_context_blocks": lambda: m.store_context_blocks(1),
    "pin_blocks": lambda: m.pin_blocks(1),
    "get_num_free_blocks": lambda: m.get_num_free_blocks(),
    "refresh_blocks": lambda: m.refresh_blocks(),
    "reset_prefix_cache": lambda: m.reset_prefix_cache(),
    "prefill": lambda: m.prefill(1, 1),
    "prompt_length": lambda: m.prompt_length(1),
    "can_allocate": lambda: m.can_allocate({}),
    "check_invariants": lambda: m.check_invariants(),
    "get_buffers": lambda: m.get_buffers(0),
}
if cls is _core.KVCacheManager:
    calls["_add_sequence"] = lambda: m._add_sequence(1, [1])
    calls["_stats_dict"] = lambda: m._stats_dict()
    calls["_latest_events"] = lambda: m._latest_events(0)
    calls["_add_sequence_plain"] = lambda: m._add_sequence_plain(1, [1])
    calls["_blocks_to_allocate_plain"] = lambda: m._blocks_to_allocate_plain([1])
else:
    calls["add_sequence"] = lambda: m.add_sequence(1, [1])
    calls["get_kv_cache_stats"] = lambda: m.get_kv_cache_stats()
    calls["get_latest_events"] = lambda: m.get_latest_events()
    calls["get_reusable_prefix_length"] = lambda: m.get_reusable_prefix_length([1])
    calls["get_num_blocks_to_allocate"] = lambda: m.get_num_blocks_to_allocate([1])
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = ["no error", ""]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


@pytest.mark.parametrize("which", ["kvcache", "_core"])
def test_methods_of_an_uninitialized_manager_raise(which: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNINITIALIZED_SCRIPT, which],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, f"interpreter died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout)
    assert len(results) >= 24
    for name, (exc_type, message) in results.items():
        assert exc_type == "RuntimeError", (name, exc_type, message)
        assert "KVCacheManager is not initialized" in message, (name, message)


def test_second_init_raises_and_changes_nothing() -> None:
    m = make()
    config = m.config
    other = KvCacheConfig(tokens_per_block=8, backend="host")
    with pytest.raises(RuntimeError, match="KVCacheManager is already initialized"):
        m.__init__(MODEL, other, max_seq_len=64, max_batch_size=4, primary_bytes=1 << 20)  # type: ignore[misc]
    with pytest.raises(RuntimeError, match="KVCacheManager is already initialized"):
        _core.KVCacheManager.__init__(m, **native_kwargs())
    assert m.config is config
    assert m.tokens_per_block == 4
    assert m.window_sizes == [8, 64]
    assert m.num_tokens(1) == 5
    m.check_invariants()


def test_second_init_of_the_native_class_raises() -> None:
    m = _core.KVCacheManager(**native_kwargs())
    with pytest.raises(RuntimeError, match="KVCacheManager is already initialized"):
        m.__init__(**native_kwargs(tokens_per_block=8))  # type: ignore[misc]
    assert m.tokens_per_block == 4
    with pytest.raises(TypeError, match="KVCacheManager instance"):
        _core.KVCacheManager.__init__(object(), **native_kwargs())  # type: ignore[arg-type]


def test_init_after_a_failed_init_is_allowed() -> None:
    m = _core.KVCacheManager.__new__(_core.KVCacheManager)
    with pytest.raises(ValueError, match="max_seq_len"):
        m.__init__(**native_kwargs(max_seq_len=I31))  # type: ignore[misc]
    m.__init__(**native_kwargs())  # type: ignore[misc]
    assert m.max_seq_len == 64


# --------------------------------------------------------------------------------------
# Request ids: 0 <= id < 2**63
# --------------------------------------------------------------------------------------

ID_CALLS: dict[str, tuple[str, Callable[[KVCacheManager, int], object]]] = {
    "add_sequence": ("request_id", lambda m, i: m.add_sequence(i, [1, 2])),
    "add_token": ("request_id", lambda m, i: m.add_token(i, 1)),
    "add_tokens": ("request_ids", lambda m, i: m.add_tokens([1, i], [1, 1])),
    "add_tokens_array": ("request_ids", lambda m, i: m.add_tokens(np.array([i]), np.array([1]))),
    "remove_sequence": ("request_id", lambda m, i: m.remove_sequence(i)),
    "rewind": ("request_id", lambda m, i: m.rewind(i, 0)),
    "store_context_blocks": ("request_id", lambda m, i: m.store_context_blocks(i)),
    "store_context_blocks_list": ("request_id", lambda m, i: m.store_context_blocks([1, i])),
    "prefill": ("request_id", lambda m, i: m.prefill(i, 1)),
    "prefill_list": ("request_id", lambda m, i: m.prefill([i], [1])),
    "pin_blocks": ("request_id", lambda m, i: m.pin_blocks(i)),
    "copy_block_offsets": ("request_ids", lambda m, i: m.copy_block_offsets(offsets_table(), [i])),
    "get_cache_block_ids": ("request_id", lambda m, i: m.get_cache_block_ids(i, 8)),
    "num_tokens": ("request_id", lambda m, i: m.num_tokens(i)),
    "is_sequence_valid_for_reuse": ("request_id", lambda m, i: m.is_sequence_valid_for_reuse(i)),
    "get_request_stats": ("request_id", lambda m, i: m.get_request_stats(i)),
}


ID_CASES = [
    (call, request_id)
    for call in sorted(ID_CALLS)
    for request_id in (-1, -(2**63), I63, 2**64)
    if not (call == "add_tokens_array" and request_id == 2**64)  # no numpy dtype holds 2**64
]


@pytest.mark.parametrize(("call", "request_id"), ID_CASES)
def test_out_of_range_request_ids_raise_value_error(call: str, request_id: int) -> None:
    m = make()
    name, fn = ID_CALLS[call]
    with pytest.raises(ValueError, match=rf"\b{name}\b.*out of range"):
        fn(m, request_id)
    assert m.num_sequences == 1
    assert m.num_tokens(1) == 5
    m.check_invariants()


def test_has_sequence_of_a_negative_id_is_false() -> None:
    m = make()
    assert m.has_sequence(-1) is False
    assert m.has_sequence(-(2**63)) is False
    with pytest.raises(ValueError, match=r"\brequest_id\b.*out of range"):
        m.has_sequence(I63)


def test_largest_request_id_and_numpy_ints_are_accepted() -> None:
    m = make()
    m.add_sequence(I63 - 1, [1, 2])
    m.add_token(np.int64(I63 - 1), np.int32(3))
    m.add_tokens(np.array([I63 - 1], dtype=np.uint64), [4])
    assert m.num_tokens(I63 - 1) == 4
    m.remove_sequence(I63 - 1)
    m.check_invariants()


# --------------------------------------------------------------------------------------
# Other integer arguments
# --------------------------------------------------------------------------------------

ARG_CALLS: list[tuple[str, Callable[[KVCacheManager], object]]] = [
    ("token", lambda m: m.add_token(1, I63)),
    ("token", lambda m: m.add_token(1, I31)),
    ("token", lambda m: m.add_token(1, -1)),
    ("tokens", lambda m: m.add_tokens([1], [I31])),
    ("tokens", lambda m: m.add_sequence(2, [1, I63])),
    ("priority", lambda m: m.add_sequence(2, [1], priority=2**40)),
    ("decode_priority", lambda m: m.add_sequence(2, [1], decode_priority=2**40)),
    ("decode_duration_ms", lambda m: m.add_sequence(2, [1], decode_duration_ms=I63)),
    ("decode_duration_ms", lambda m: m.add_sequence(2, [1], decode_duration_ms=-1)),
    ("lora_task_id", lambda m: m.add_sequence(2, [1], lora_task_id=I63)),
    (
        "priority_ranges priority",
        lambda m: m.add_sequence(2, [1], priority_ranges=[(0, 1, I31, 0)]),
    ),
    (
        "priority_ranges start",
        lambda m: m.add_sequence(2, [1], priority_ranges=[(I31, None, 5, 0)]),
    ),
    ("multimodal start", lambda m: m.add_sequence(2, [1], multimodal=[(b"x", I31, 1)])),
    ("num_tokens", lambda m: m.rewind(1, I31)),
    ("num_tokens", lambda m: m.rewind(1, -1)),
    ("window_size", lambda m: m.get_cache_block_ids(1, I31)),
    ("window_size", lambda m: m.get_num_free_blocks(I31)),
    ("window_size", lambda m: m.unpin_blocks_by_id([0], I31)),
    ("block_ids", lambda m: m.unpin_blocks_by_id([I31])),
    ("layer_idx", lambda m: m.get_buffers(I31)),
    ("timeout_ms", lambda m: m.get_latest_events(timeout_ms=-1)),
    ("timeout_ms", lambda m: m.get_latest_events(timeout_ms=I63)),
    ("slot_offset", lambda m: m.copy_block_offsets(offsets_table(), [1], slot_offset=I63)),
    ("slot_offset", lambda m: m.copy_block_offsets(offsets_table(), [1], slot_offset=-1)),
]


@pytest.mark.parametrize(
    ("name", "call"), ARG_CALLS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(ARG_CALLS)]
)
def test_out_of_range_arguments_raise_value_error(
    name: str, call: Callable[[KVCacheManager], object]
) -> None:
    m = make()
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        call(m)
    assert m.num_sequences == 1
    assert m.num_tokens(1) == 5
    m.check_invariants()


def test_a_float_argument_raises_value_error_naming_it() -> None:
    m = make()
    with pytest.raises(ValueError, match=r"\btoken must be an int, got float"):
        m.add_token(1, 1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"\brequest_id must be an int, got bool"):
        m.num_tokens(True)


@pytest.mark.parametrize(
    "name",
    [
        "num_layers",
        "head_dim",
        "kv_factor",
        "tokens_per_block",
        "max_seq_len",
        "max_batch_size",
        "max_draft_tokens",
        "secondary_offload_min_priority",
    ],
)
@pytest.mark.parametrize("value", [-1, I31, I63])
def test_native_constructor_checks_every_integer(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _core.KVCacheManager(**native_kwargs(**{name: value}))


@pytest.mark.parametrize("value", [-1, 2**64])
def test_native_constructor_checks_the_event_buffer_size(value: int) -> None:
    with pytest.raises(ValueError, match=r"\bevent_buffer_max_size\b"):
        _core.KVCacheManager(**native_kwargs(event_buffer_max_size=value))


@pytest.mark.parametrize(
    ("name", "overrides"),
    [
        ("num_kv_heads", {"num_kv_heads": [I31]}),
        ("max_attention_window", {"max_attention_window": [I31]}),
        ("blocks_per_window window", {"blocks_per_window": {I31: (8, 0)}}),
        ("blocks_per_window count", {"blocks_per_window": {64: (I31, 0)}}),
        ("blocks_per_window count", {"blocks_per_window": {64: (8, -1)}}),
    ],
)
def test_native_constructor_checks_integers_in_collections(
    name: str, overrides: dict[str, Any]
) -> None:
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        _core.KVCacheManager(**native_kwargs(**overrides))


@pytest.mark.parametrize("name", ["max_seq_len", "max_batch_size"])
def test_python_constructor_reports_out_of_range_sizes(name: str) -> None:
    config = KvCacheConfig(tokens_per_block=4, backend="virtual")
    sizes = {"max_seq_len": 64, "max_batch_size": 4, name: I31}
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        KVCacheManager.from_blocks(MODEL, config, {sizes["max_seq_len"]: 8}, **sizes)


def test_python_constructor_reports_out_of_range_tokens_per_block() -> None:
    config = KvCacheConfig(tokens_per_block=I31, backend="virtual")
    with pytest.raises(ValueError, match=r"\btokens_per_block\b"):
        KVCacheManager.from_blocks(MODEL, config, {64: 8}, max_seq_len=64, max_batch_size=4)


# --------------------------------------------------------------------------------------
# Events and block offsets
# --------------------------------------------------------------------------------------


def test_get_latest_events_with_a_huge_timeout_waits_for_an_event() -> None:
    m = make(event_buffer_max_size=64)
    m.get_latest_events()  # drop "created"
    got: list[str] = []

    def consume() -> None:
        got.extend(e.kind for e in m.get_latest_events(timeout_ms=2**62))

    def produce() -> None:
        time.sleep(0.05)
        m.add_sequence(2, list(range(100, 109)))
        m.store_context_blocks(2)

    consumer = threading.Thread(target=consume, daemon=True)
    producer = threading.Thread(target=produce)
    start = time.monotonic()
    consumer.start()
    producer.start()
    consumer.join(timeout=30)
    producer.join()
    if consumer.is_alive():  # never returned: release it before failing
        m.remove_sequence(2)
        consumer.join(timeout=30)
        pytest.fail("get_latest_events(timeout_ms=2**62) did not return after an event")
    assert time.monotonic() - start >= 0.04, "returned before the event was pushed"
    assert "stored" in got


def test_copy_block_offsets_rejects_a_slot_offset_that_overflows() -> None:
    m = make()
    out = offsets_table()
    with pytest.raises(ValueError, match=r"\bslot_offset\b"):
        m.copy_block_offsets(out, [1], slot_offset=I63 - 1)
    with pytest.raises(ValueError, match=r"\bslot_offset\b"):
        m.copy_block_offsets(out, [1, 1], slot_offset=3)
    assert (out == 99).all()
    assert m.copy_block_offsets(out, [1], slot_offset=3) == 2


class _MyInt(int):
    """An int subclass: converted by the general path, as before the list fast path."""


@pytest.mark.parametrize(
    "ids",
    [
        [2**62 + 5, 0],  # a multi-digit id
        (2**62 + 5, 0),
        [_MyInt(2**62 + 5), _MyInt(0)],
        np.array([2**62 + 5, 0], dtype=np.int64),
        np.array([2**62 + 5, 0], dtype=np.uint64),
    ],
)
@pytest.mark.parametrize(
    "tokens",
    [[2**31 - 1, 0], (2**31 - 1, 0), [_MyInt(2**31 - 1), 0], np.array([2**31 - 1, 0])],
)
def test_add_tokens_takes_lists_tuples_and_arrays_alike(ids: Any, tokens: Any) -> None:
    m = _small_manager()
    m.add_sequence(2**62 + 5, [1, 2, 3])
    m.add_sequence(0, [1, 2, 3])
    m.add_tokens(ids, tokens)
    assert m.num_tokens(2**62 + 5) == 4 and m.num_tokens(0) == 4


@pytest.mark.parametrize(
    ("ids", "tokens", "message"),
    [
        ([1, -1], [1, 1], r"request_ids\[1\] = -1 is out of range"),
        (np.array([1, -1]), [1, 1], r"request_ids\[1\] = -1 is out of range"),
        ([1, 2**63], [1, 1], r"request_ids\[1\] = 9223372036854775808 is out of range"),
        ([1, True], [1, 1], "request_ids must hold ints, got bool"),
        ([1, np.int64(0)], [1, 1], "request_ids must hold ints, got numpy.int64"),
        ([1, 0], [1, -3], r"tokens\[1\] is negative \(-3\)"),
        ([1, 0], [2**31, 1], r"tokens\[0\] = 2147483648 does not fit a 32-bit token id"),
        ([1, 0], np.array([1, -3], dtype=np.int32), r"tokens\[1\] is negative \(-3\)"),
        ([1, 0], np.array([2**31, 1]), r"tokens\[0\] = 2147483648 does not fit"),
        ([1, 0], [1.0, 2], "tokens must hold ints, got float"),
    ],
)
def test_add_tokens_names_the_bad_item(ids: Any, tokens: Any, message: str) -> None:
    m = _small_manager()
    m.add_sequence(1, [1, 2, 3])
    m.add_sequence(0, [1, 2, 3])
    with pytest.raises(ValueError, match=message):
        m.add_tokens(ids, tokens)
    assert m.num_tokens(1) == 3 and m.num_tokens(0) == 3


def _small_manager() -> KVCacheManager:
    model = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8)
    config = KvCacheConfig(tokens_per_block=4, max_attention_window=[None], backend="virtual")
    return KVCacheManager.from_blocks(model, config, {64: 40}, max_seq_len=64, max_batch_size=4)


# ----------------------------------------------------------------------------- estimates


def test_estimate_methods_reject_bad_arguments_and_change_nothing() -> None:
    from kvcache import KvCacheConfig, KVCacheManager, ModelConfig

    kv = KVCacheManager.from_blocks(
        ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8),
        KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None], backend="virtual"),
        {8: 16, 64: 16},
        max_seq_len=64,
        max_batch_size=4,
    )
    kv.add_sequence(1, list(range(10)), prefill=4)
    before = (kv.num_tokens(1), kv.get_num_free_blocks(8), kv.get_num_free_blocks(64))
    with pytest.raises(ValueError, match="must pair up"):
        kv.get_step_needs([1], [1, 2], [], [])
    with pytest.raises(ValueError, match="still in prefill"):
        kv.get_step_needs([1], [1], [], [])
    with pytest.raises(ValueError, match="prompt tokens left"):
        kv.get_step_needs([], [], [1], [7])
    with pytest.raises(KeyError):
        kv.get_remaining_blocks([5], [10])
    with pytest.raises(ValueError, match="chunk_size"):
        kv.get_remaining_blocks([1], [10], chunk_size=0)
    with pytest.raises(ValueError, match="window_size"):
        kv.get_num_shared_blocks(5)
    with pytest.raises(ValueError, match="final_tokens"):
        kv._set_final_tokens(1, 3)
    with pytest.raises(ValueError, match="prompt_len"):
        kv.get_blocks_to_run_alone(0, 10)
    with pytest.raises(TypeError):
        kv.get_prompt_remaining_blocks([1, 2, 3], 10)  # a PreparedPrompt is required
    assert (kv.num_tokens(1), kv.get_num_free_blocks(8), kv.get_num_free_blocks(64)) == before
    # A 6-token chunk from 4 to 10 tokens starts blocks 1 and 2 in both windows; window 8
    # releases nothing yet (its first query, at position 4, still sees position 0).
    assert kv.get_step_needs([], [], [1], [6]) == [2, 2]
    kv.check_invariants()


# --------------------------------------------------------------------------------------
# Every public callable: the documented exception, a message naming the mistake, and the
# manager exactly as it was
# --------------------------------------------------------------------------------------


def _state(m: KVCacheManager) -> tuple[object, ...]:
    """Everything a failed call must leave alone: sequences, their blocks, the free pools."""
    windows = m.window_sizes
    return (
        m.num_sequences,
        m.num_tokens(1),
        m.prompt_length(1),
        tuple(tuple(m.get_cache_block_ids(1, w)) for w in windows),
        tuple(m.get_num_free_blocks(w) for w in windows),
        tuple(m.get_num_used_blocks(w) for w in windows),
        m.get_kv_cache_stats().reused_blocks,
    )


Row = tuple[str, Callable[[KVCacheManager], object], type[Exception], str]

BAD_CALLS: list[Row] = [
    # add_sequence / prepare / lookups: the prompt
    ("add_sequence-text", lambda m: m.add_sequence(2, "abc"), ValueError, "tokens must be a"),
    ("add_sequence-float", lambda m: m.add_sequence(2, [1.5]), ValueError, "got float"),
    ("add_sequence-none", lambda m: m.add_sequence(2, None), ValueError, "tokens must be a"),
    ("add_sequence-duplicate", lambda m: m.add_sequence(1, [1]), ValueError, "already registered"),
    ("add_sequence-empty", lambda m: m.add_sequence(2, []), ValueError, "prompt is empty"),
    ("add_sequence-long", lambda m: m.add_sequence(2, [1] * 65), ValueError, "exceeds max_seq_len"),
    (
        "add_sequence-prefill",
        lambda m: m.add_sequence(2, [1], prefill=True),
        ValueError,
        "prefill must be an int",
    ),
    ("prepare-text", lambda m: m.prepare("ab"), ValueError, "tokens must be a"),
    (
        "get_reusable_prefix_length-text",
        lambda m: m.get_reusable_prefix_length("ab"),
        ValueError,
        "tokens must be a",
    ),
    (
        "get_num_blocks_to_allocate-float",
        lambda m: m.get_num_blocks_to_allocate([1.5]),
        ValueError,
        "got float",
    ),
    # per-step calls
    ("add_token-text", lambda m: m.add_token(1, "x"), ValueError, "token must be an int, got str"),
    (
        "add_tokens-mismatch",
        lambda m: m.add_tokens([1], [1, 2]),
        ValueError,
        "1 request ids but 2 tokens",
    ),
    ("add_tokens-none", lambda m: m.add_tokens(None, [1]), ValueError, "request_ids must be a"),
    ("prefill-text", lambda m: m.prefill(1, "2"), ValueError, "num_tokens must be an int"),
    ("rewind-too-far", lambda m: m.rewind(1, 6), ValueError, "cannot drop 6"),
    ("remove_sequence-unknown", lambda m: m.remove_sequence(7), KeyError, "unknown request id 7"),
    (
        "remove_sequence-text",
        lambda m: m.remove_sequence("1"),
        ValueError,
        "request_id must be an int",
    ),
    (
        "store_context_blocks-none",
        lambda m: m.store_context_blocks(None),
        ValueError,
        "request_id must be an int",
    ),
    # forks
    (
        "fork_sequence-unknown-parent",
        lambda m: m.fork_sequence(9, [10]),
        KeyError,
        "unknown request id 9",
    ),
    ("fork_sequence-itself", lambda m: m.fork_sequence(3, [4, 3]), ValueError, "into itself"),
    ("fork_sequence-repeated", lambda m: m.fork_sequence(3, [4, 4]), ValueError, "appears twice"),
    (
        "fork_sequence-text",
        lambda m: m.fork_sequence(3, "x"),
        ValueError,
        "child_ids must be a sequence of ints",
    ),
    ("fork_sequence-negative", lambda m: m.fork_sequence(3, [-1]), ValueError, "out of range"),
    ("fork_sequence-float", lambda m: m.fork_sequence(3, [1.5]), ValueError, "got float"),
    (
        "get_forked_beam_blocks-negative",
        lambda m: m.get_forked_beam_blocks(-1, 5),
        ValueError,
        "fork_tokens = -1 is out of range",
    ),
    (
        "get_forked_beam_blocks-text",
        lambda m: m.get_forked_beam_blocks("x", 5),
        ValueError,
        "fork_tokens must be an int",
    ),
    (
        "get_family_remaining_blocks-unknown",
        lambda m: m.get_family_remaining_blocks([3, 99], 5),
        KeyError,
        "unknown request id 99",
    ),
    (
        "get_family_remaining_blocks-text",
        lambda m: m.get_family_remaining_blocks("x", 5),
        ValueError,
        "request ids must be a sequence of ints",
    ),
    (
        "get_family_remaining_blocks-final",
        lambda m: m.get_family_remaining_blocks([3], 0),
        ValueError,
        "final_tokens = 0 is out of range",
    ),
    (
        "get_family_remaining_blocks-repeated",
        lambda m: m.get_family_remaining_blocks([3, 3], 5),
        ValueError,
        "request id 3 appears twice",
    ),
    # the shared tier (none here: the checks come first)
    (
        "flush_shared_cache-negative",
        lambda m: m.flush_shared_cache(-1),
        ValueError,
        "timeout_ms = -1 is out of range",
    ),
    (
        "flush_shared_cache-text",
        lambda m: m.flush_shared_cache("x"),
        ValueError,
        "timeout_ms must be an int, got str",
    ),
    # pins
    ("pin_blocks-unknown", lambda m: m.pin_blocks(9), KeyError, "unknown request id 9"),
    (
        "unpin_blocks_by_id-dict-of-int",
        lambda m: m.unpin_blocks_by_id({64: 5}),
        ValueError,
        r"block_ids\[64\] must be a list of block ids, got int",
    ),
    (
        "unpin_blocks_by_id-none",
        lambda m: m.unpin_blocks_by_id(None),
        ValueError,
        "block_ids must be a list of block ids or the",
    ),
    ("unpin_blocks_by_id-text", lambda m: m.unpin_blocks_by_id("x"), ValueError, "got str"),
    (
        "unpin_blocks_by_id-float",
        lambda m: m.unpin_blocks_by_id([1.0]),
        ValueError,
        "block_ids must hold ints, got float",
    ),
    (
        "unpin_blocks_by_id-negative",
        lambda m: m.unpin_blocks_by_id([-1]),
        ValueError,
        r"block_ids\[0\] = -1 is out of range",
    ),
    (
        "unpin_blocks_by_id-window-key",
        lambda m: m.unpin_blocks_by_id({"8": [0]}),
        ValueError,
        "window_size must be an int, got str",
    ),
    (
        "unpin_blocks_by_id-dict-and-window",
        lambda m: m.unpin_blocks_by_id({8: [0]}, 8),
        ValueError,
        "goes with a list",
    ),
    # capacity queries: a dict {window: blocks}, as can_allocate documents
    (
        "can_allocate-list",
        lambda m: m.can_allocate([1]),
        ValueError,
        "blocks must be a dict {window: blocks}, got list",
    ),
    (
        "fits_when_empty-list",
        lambda m: m.fits_when_empty([1]),
        ValueError,
        "blocks must be a dict {window: blocks}, got list",
    ),
    ("fits_when_empty-none", lambda m: m.fits_when_empty(None), ValueError, "got NoneType"),
    (
        "can_allocate-window",
        lambda m: m.can_allocate({5: 1}),
        ValueError,
        "window_size 5 is not one of",
    ),
    (
        "fits_when_empty-window",
        lambda m: m.fits_when_empty({5: 1}),
        ValueError,
        "window_size 5 is not one of",
    ),
    (
        "get_num_free_blocks-text",
        lambda m: m.get_num_free_blocks("8"),
        ValueError,
        "window_size must be an int",
    ),
    ("get_num_used_blocks-window", lambda m: m.get_num_used_blocks(5), ValueError, "window_size 5"),
    (
        "get_num_shared_blocks-window",
        lambda m: m.get_num_shared_blocks(5),
        ValueError,
        "window_size 5",
    ),
    (
        "get_num_held_blocks-unknown",
        lambda m: m.get_num_held_blocks(9, 8),
        KeyError,
        "unknown request id 9",
    ),
    # per-request queries
    (
        "get_cache_block_ids-bad-window-name",
        lambda m: m.get_cache_block_ids(1, "sliding"),
        ValueError,
        'window_size must be one of this manager\'s windows \\[8, 64\\], or None / "full"',
    ),
    ("num_tokens-unknown", lambda m: m.num_tokens(9), KeyError, "unknown request id 9"),
    # recurrent state (this manager has none)
    (
        "get_chunk_limit-unknown",
        lambda m: m.get_chunk_limit(9, 4),
        KeyError,
        "unknown request id 9",
    ),
    ("get_chunk_limit-zero", lambda m: m.get_chunk_limit(1, 0), ValueError, "must be >= 1"),
    (
        "get_prompt_chunk_limit-list",
        lambda m: m.get_prompt_chunk_limit([1, 2], 4),
        TypeError,
        "get_prompt_chunk_limit",
    ),
    (
        "get_prompt_chunk_limit-zero",
        lambda m: m.get_prompt_chunk_limit(m.prepare([1, 2]), 0),
        ValueError,
        "must be >= 1",
    ),
    (
        "get_reusable_by_kind-list",
        lambda m: m.get_reusable_by_kind([1, 2]),
        TypeError,
        "get_reusable_by_kind",
    ),
    ("get_state_slot-no-group", lambda m: m.get_state_slot(1), ValueError, "state group 0"),
    ("get_state_view-no-layer", lambda m: m.get_state_view(0, 0), ValueError, "recurrent layer 0"),
    ("prompt_length-unknown", lambda m: m.prompt_length(9), KeyError, "unknown request id 9"),
    (
        "get_request_stats-unknown",
        lambda m: m.get_request_stats(9),
        KeyError,
        "unknown request id 9",
    ),
    (
        "is_sequence_valid_for_reuse-unknown",
        lambda m: m.is_sequence_valid_for_reuse(9),
        KeyError,
        "unknown request id 9",
    ),
    (
        "get_sequence_step_needs-unknown",
        lambda m: m.get_sequence_step_needs(9, 1),
        KeyError,
        "unknown request id 9",
    ),
    # estimates
    (
        "get_step_needs-none",
        lambda m: m.get_step_needs(None, [], [], []),
        ValueError,
        "must be a sequence",
    ),
    (
        "get_remaining_blocks-pairs",
        lambda m: m.get_remaining_blocks([1], [1, 2]),
        ValueError,
        "must pair up",
    ),
    (
        "get_blocks_to_run_alone-negative",
        lambda m: m.get_blocks_to_run_alone(-1, 3),
        ValueError,
        "prompt_len = -1 is out of range",
    ),
    (
        "get_prompt_step_needs-list",
        lambda m: m.get_prompt_step_needs([1, 2], 1),
        TypeError,
        "get_prompt_step_needs",
    ),
    # memory views and events
    (
        "get_buffers-layer",
        lambda m: m.get_buffers(2),
        ValueError,
        r"layer_idx 2 is out of range \[0, 2\)",
    ),
    (
        "copy_block_offsets-list",
        lambda m: m.copy_block_offsets([[1]], [1]),
        ValueError,
        "out must be a numpy.ndarray",
    ),
    (
        "get_latest_events-text",
        lambda m: m.get_latest_events(timeout_ms="1"),
        ValueError,
        "timeout_ms must be an int",
    ),
    # constructors and the classes around the manager
    (
        "KVCacheManager-model",
        lambda m: KVCacheManager(
            "m", KvCacheConfig(), max_seq_len=64, max_batch_size=4, primary_bytes=1 << 20
        ),
        TypeError,
        "model must be a kvcache.ModelConfig, got str",
    ),
    (
        "KVCacheManager-config",
        lambda m: KVCacheManager(
            MODEL, None, max_seq_len=64, max_batch_size=4, primary_bytes=1 << 20
        ),
        TypeError,
        "config must be a kvcache.KvCacheConfig, got NoneType",
    ),
    (
        "from_blocks-model",
        lambda m: KVCacheManager.from_blocks(
            "m", KvCacheConfig(), {64: 8}, max_seq_len=64, max_batch_size=4
        ),
        TypeError,
        "model must be a kvcache.ModelConfig, got str",
    ),
    (
        "KVCacheResourceManager-none",
        lambda m: KVCacheResourceManager(None),
        TypeError,
        "manager must be a kvcache.KVCacheManager, got NoneType",
    ),
    (
        "CapacityScheduler-text",
        lambda m: CapacityScheduler("rm"),
        TypeError,
        "resource_manager must be a kvcache.KVCacheResourceManager, got str",
    ),
    (
        "ModelConfig-num_layers",
        lambda m: ModelConfig(num_layers=I63, num_kv_heads=1, head_dim=4),
        ValueError,
        r"num_layers = 9223372036854775808 is out of range \[1, 2147483647\]",
    ),
    (
        "ModelConfig-head_dim",
        lambda m: ModelConfig(num_layers=2, num_kv_heads=1, head_dim=I31),
        ValueError,
        "head_dim = 2147483648 is out of range",
    ),
    (
        "ModelConfig-num_kv_heads",
        lambda m: ModelConfig(num_layers=2, num_kv_heads=[1, I31], head_dim=4),
        ValueError,
        r"num_kv_heads\[1\] = 2147483648",
    ),
    (
        "Request-negative-id",
        lambda m: Request(-1, [1], 1),
        ValueError,
        r"request_id = -1 is out of range \[0, 9223372036854775807\]",
    ),
    (
        "Request-id-2**63",
        lambda m: Request(I63, [1], 1),
        ValueError,
        "request_id = 9223372036854775808 is out of range",
    ),
    (
        "Request-nan",
        lambda m: Request(1, [float("nan")], 1),
        ValueError,
        r"prompt\[0\] must be an int token id, got float nan",
    ),
    (
        "Request-bool",
        lambda m: Request(1, [True], 1),
        ValueError,
        r"prompt\[0\] must be an int token id, got bool",
    ),
    (
        "Request-text",
        lambda m: Request(1, "ab", 1),
        ValueError,
        "the prompt must be token ids, got text",
    ),
    (
        "Request-token-2**31",
        lambda m: Request(1, [I31], 1),
        ValueError,
        r"prompt\[0\] = 2147483648 is out of range",
    ),
    # the resource manager's hooks, over the same manager
    (
        "KVCacheResourceManager.prepare_resources-list",
        lambda m: KVCacheResourceManager(m).prepare_resources([1]),
        TypeError,
        "batch must be a kvcache.ScheduledBatch, got list",
    ),
    (
        "KVCacheResourceManager.update_resources-none",
        lambda m: KVCacheResourceManager(m).update_resources(None),
        TypeError,
        "batch must be a kvcache.ScheduledBatch, got NoneType",
    ),
    (
        "KVCacheResourceManager.free_resources-int",
        lambda m: KVCacheResourceManager(m).free_resources(1),
        TypeError,
        "request must be a kvcache.Request, got int",
    ),
    (
        "KVCacheResourceManager.has_request-int",
        lambda m: KVCacheResourceManager(m).has_request(1),
        TypeError,
        "request must be a kvcache.Request, got int",
    ),
    (
        "KVCacheResourceManager.num_primary_blocks-window",
        lambda m: KVCacheResourceManager(m).num_primary_blocks(5),
        ValueError,
        r"window_size 5 is not one of this manager's windows \[8, 64\]",
    ),
    (
        "KVCacheResourceManager.can_allocate-list",
        lambda m: KVCacheResourceManager(m).can_allocate([1]),
        ValueError,
        "blocks must be a dict {window: blocks}, got list",
    ),
    (
        "KVCacheResourceManager.fits_when_empty-list",
        lambda m: KVCacheResourceManager(m).fits_when_empty([1]),
        ValueError,
        "blocks must be a dict {window: blocks}, got list",
    ),
    (
        "Request.append_tokens-float",
        lambda m: Request(1, [1], 2).append_tokens([1.5]),
        ValueError,
        r"request 1: tokens\[0\] must be an int token id, got float 1.5",
    ),
    (
        "ScheduledBatch.add_context-none",
        lambda m: ScheduledBatch().add_context(None),
        TypeError,
        "request must be a kvcache.Request, got NoneType",
    ),
    (
        "ScheduledBatch.add_generation-int",
        lambda m: ScheduledBatch().add_generation(1),
        TypeError,
        "request must be a kvcache.Request, got int",
    ),
    (
        "Request-negative-token",
        lambda m: Request(1, [0, -3], 1),
        ValueError,
        r"prompt\[1\] = -3 is out of range",
    ),
]


@pytest.mark.parametrize(
    ("call", "exc", "phrase"), [r[1:] for r in BAD_CALLS], ids=[r[0] for r in BAD_CALLS]
)
def test_every_public_callable_rejects_bad_input_and_changes_nothing(
    call: Callable[[KVCacheManager], object], exc: type[Exception], phrase: str
) -> None:
    m = make()
    m.add_sequence(3, [9, 9, 9, 9, 9, 9])
    m.pin_blocks(3)  # something to unpin wrongly
    before = _state(m)
    with pytest.raises(exc, match=phrase):
        call(m)
    assert _state(m) == before
    assert m.num_tokens(3) == 6
    m.check_invariants()


def test_bad_call_table_covers_every_public_manager_method() -> None:
    """A new public method needs a row above (properties are read, not called with input)."""
    covered = {name.split("-")[0] for name, *_ in BAD_CALLS}
    no_input = {
        "check_invariants",
        "refresh_blocks",
        "reset_prefix_cache",
        "get_kv_cache_stats",
        "save_checkpoints",
        "take_state_copies",
        "state_groups",
    }
    methods = {
        n
        for n in dir(KVCacheManager)
        if not n.startswith("_") and callable(getattr(KVCacheManager, n))
    }
    elsewhere = {
        "has_sequence",  # test_has_sequence_of_a_negative_id_is_false
        "get_prompt_remaining_blocks",  # test_estimate_methods_reject_bad_arguments...
    }
    assert methods - no_input - covered - elsewhere == set(), sorted(methods - covered)


# --------------------------------------------------------------------------------------
# Objects made with __new__: every bound class refuses them
# --------------------------------------------------------------------------------------

_UNINITIALIZED_OBJECTS_SCRIPT = """
import json
import numpy as np
import kvcache
from kvcache import _core
model = kvcache.ModelConfig(num_layers=1, num_kv_heads=1, head_dim=4)
config = kvcache.KvCacheConfig(tokens_per_block=4, backend="host")
live = kvcache.KVCacheManager.from_blocks(model, config, {64: 8}, max_seq_len=64, max_batch_size=2)
buf = _core.LayerBuffer.__new__(_core.LayerBuffer)
prompt = _core.PreparedPrompt.__new__(_core.PreparedPrompt)
sched = _core.CapacityScheduler.__new__(_core.CapacityScheduler)
bare = _core.KVCacheManager.__new__(_core.KVCacheManager)
calls = {
    "LayerBuffer.shape": lambda: buf.shape,
    "LayerBuffer.strides": lambda: buf.strides,
    "LayerBuffer.data_ptr": lambda: buf.data_ptr,
    "LayerBuffer.dtype": lambda: buf.dtype,
    "LayerBuffer.__dlpack_device__": lambda: buf.__dlpack_device__(),
    "LayerBuffer.__dlpack__": lambda: buf.__dlpack__(),
    "LayerBuffer.__cuda_array_interface__": lambda: buf.__cuda_array_interface__,
    "np.from_dlpack(LayerBuffer)": lambda: np.from_dlpack(buf),
    "PreparedPrompt.__len__": lambda: len(prompt),
    "PreparedPrompt.tokens": lambda: prompt.tokens,
    "PreparedPrompt.__repr__": lambda: repr(prompt),
    "add_sequence(PreparedPrompt)": lambda: live.add_sequence(5, prompt),
    "get_prompt_remaining_blocks(PreparedPrompt)": (
        lambda: live.get_prompt_remaining_blocks(prompt, 10)
    ),
    "get_reusable_prefix_length(PreparedPrompt)": lambda: live.get_reusable_prefix_length(prompt),
    "CapacityScheduler.never_fits": lambda: sched.never_fits(1, 1),
    "CapacityScheduler.blocks_to_run_alone": lambda: sched.blocks_to_run_alone(1, 1),
    "KVCacheManager.get_family_remaining_blocks": lambda: bare.get_family_remaining_blocks([1], 1),
    "CapacityScheduler.schedule": lambda: sched.schedule([], None, None, [], [], []),
    "KVCacheManager.get_step_needs": lambda: bare.get_step_needs([1], [1], [], []),
    "KVCacheManager.get_num_shared_blocks": lambda: bare.get_num_shared_blocks(64),
    "KVCacheManager.get_blocks_to_run_alone": lambda: bare.get_blocks_to_run_alone(1, 2),
}
try:
    import torch
    calls["torch.from_dlpack(LayerBuffer)"] = lambda: torch.from_dlpack(buf)
except ImportError:
    pass
out = {}
for name, call in calls.items():
    try:
        call()
        out[name] = ["no error", ""]
    except Exception as e:
        out[name] = [type(e).__name__, str(e)]
live.check_invariants()
out["live manager"] = [str(live.num_sequences), ""]
print(json.dumps(out))
"""


def test_objects_made_with_new_raise_instead_of_handing_out_garbage() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _UNINITIALIZED_OBJECTS_SCRIPT],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, f"interpreter died (rc {proc.returncode}): {proc.stderr[-2000:]}"
    results = json.loads(proc.stdout)
    assert results.pop("live manager") == ["0", ""]  # the failed add_sequence changed nothing
    assert len(results) >= 19
    for name, (exc_type, message) in results.items():
        assert exc_type == "RuntimeError", (name, exc_type, message)
        cls = name.split(".")[0].split("(")[-1].rstrip(")")
        expected = {
            "LayerBuffer": "LayerBuffer is not initialized: it was made with __new__; get one "
            "from KVCacheManager.get_buffers()",
            "PreparedPrompt": "PreparedPrompt is not initialized: it was made with __new__; get "
            "one from KVCacheManager.prepare()",
            "CapacityScheduler": "CapacityScheduler is not initialized: its __init__ never ran",
            "KVCacheManager": "KVCacheManager is not initialized: its __init__ never ran",
        }
        key = next(k for k in expected if k in name)
        assert message == expected[key], (name, cls, message)


def test_second_init_of_a_native_scheduler_raises() -> None:
    from kvcache import KVCacheResourceManager as RM

    rm = RM(make())
    native = _core.CapacityScheduler(rm.manager, "max_utilization", 4, None, True, None)
    with pytest.raises(RuntimeError, match="CapacityScheduler is already initialized"):
        native.__init__(rm.manager, "guaranteed_no_evict", 2, None, True, None)  # type: ignore[misc]
    assert native.never_fits(5, 65) is True  # longer than max_seq_len: still the first one


# --------------------------------------------------------------------------------------
# Engine.generate: every prompt checked before anything runs
# --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine() -> Any:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvcache.engine import Engine, tiny_model

    model = tiny_model("mistral", num_layers=1, sliding_window=16)  # vocabulary of 128
    return Engine(
        model,
        KvCacheConfig(tokens_per_block=4),
        max_seq_len=64,
        max_batch_size=2,
        blocks_per_window={16: 6},
    )


@pytest.mark.parametrize(
    ("prompts", "max_new_tokens", "phrase"),
    [
        ([[1, 1.7]], 2, r"prompt 0: token 1 must be an int, got float 1.7"),
        ([[1], ["5"]], 2, r"prompt 1: token 0 must be an int, got str '5'"),
        ([[True]], 2, r"prompt 0: token 0 must be an int, got bool"),
        ([[1, 128]], 2, r"prompt 0: token 128 is outside the vocabulary \[0, 128\)"),
        ([[-1]], 2, r"prompt 0: token -1 is outside the vocabulary"),
        ([[]], 2, "prompt 0 is empty"),
        (["abc"], 2, "prompt 0 must be a list of token ids, got str"),
        ([[1]], 65, "max_new_tokens = 65 exceeds max_seq_len=64"),
        ([[1] * 60], 10, r"prompt 0: 60 tokens \+ 10 new exceed max_seq_len=64"),
        ([[1]], 2.0, "max_new_tokens must be an int"),
        ([[1]], True, "max_new_tokens must be an int"),
        # 6 blocks of 4 tokens in the only window (16): a 40-token prompt, prefilled whole,
        # holds 10 at once, more than the pool ever has.
        ([[1, 2], [1] * 40], 11, r"prompt 1: 40 tokens \+ 11 new can never fit the KV pools"),
    ],
)
def test_engine_generate_rejects_bad_prompts_before_running(
    engine: Any, prompts: Any, max_new_tokens: Any, phrase: str
) -> None:
    before = engine.stats()
    with pytest.raises(ValueError, match=phrase):
        engine.generate(prompts, max_new_tokens)
    after = engine.stats()
    assert (after.steps, after.requests, after.prompt_tokens) == (
        before.steps,
        before.requests,
        before.prompt_tokens,
    )
    assert engine.manager.num_sequences == 0
    engine.manager.check_invariants()
    assert engine.generate([[1, 2, 3]], 2) and engine.manager.num_sequences == 0


@pytest.mark.parametrize(
    ("method", "args"),
    [
        ("num_draft_tokens_for", (7,)),
        ("get_num_allocated_blocks", (7, 8)),
        ("get_reusable_prefix_length", (7,)),
        ("get_needed_blocks_one_step", (7, 8)),
        ("get_needed_blocks_per_window", (7,)),
        ("get_remaining_blocks_to_completion", (7, 8)),
        ("get_remaining_blocks_per_window", (7,)),
        ("get_blocks_to_run_alone", (7,)),
        ("get_remaining_blocks_for", ([7],)),
        ("get_needed_blocks_for_step", ([7],)),
        ("fork_resources", (7, [])),
    ],
)
def test_estimates_name_a_wrong_request_type(method: str, args: tuple[object, ...]) -> None:
    """Every resource-manager method that takes requests refuses another type up front."""
    m = make()
    m.add_sequence(3, [9, 9, 9, 9, 9, 9])
    rm = KVCacheResourceManager(m)
    before = _state(m)
    name = "batch" if method == "get_needed_blocks_for_step" else "(request|parent)"
    got = "list" if method == "get_needed_blocks_for_step" else "int"
    with pytest.raises(TypeError, match=rf"{name} must be a kvcache\.\w+, got {got}"):
        getattr(rm, method)(*args)
    assert _state(m) == before
