"""Block keys as the core computes them, for routers and tools outside the manager."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from kvcache import _core
from kvcache.cache.fields import optional_int

__all__ = ["block_hashes", "key_kwargs"]


def block_hashes(
    tokens: Sequence[int] | Any,
    tokens_per_block: int,
    *,
    lora_task_id: int | None = None,
    cache_salt: str | bytes | int | None = None,
    multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
) -> list[int]:
    """The chained 64-bit keys of the full blocks of ``tokens``: the ints events carry.

    Block ``i`` covers ``tokens[i * tokens_per_block:(i + 1) * tokens_per_block]``; a partly
    filled last block has no key here (events publish full blocks only). The keys are the
    core's own (one implementation, in C++): ``BlockStored.block_hashes`` of a prompt stored
    with the same ``lora_task_id``, ``cache_salt`` and ``multimodal`` items (as
    ``KVCacheManager.add_sequence`` takes them) are these ints. A manager keys a prompt's
    tokens but the last (it is always computed again), so a router looking up a prompt
    passes ``tokens[:-1]``.

    Raises:
        ValueError: ``tokens_per_block`` < 1, a token outside ``[0, 2**31)``, a bad extra key.

    Example:
        >>> import kvcache
        >>> hashes = kvcache.block_hashes(list(range(9)), 4)
        >>> len(hashes), hashes == kvcache.block_hashes(list(range(8)), 4)
        (2, True)
    """
    return list(
        _core._block_hashes(
            tokens, tokens_per_block, **key_kwargs(lora_task_id, cache_salt, multimodal)
        )
    )


_MASK64 = (1 << 64) - 1


def _hash64(value: bytes | str | int, what: str) -> int:
    """Maps a content hash or salt to the 64-bit value the native keys use (stable)."""
    if isinstance(value, bool):
        raise ValueError(f"{what} must be bytes, str or int, got bool")
    if isinstance(value, int):
        if 0 <= value <= _MASK64:
            return value
        value = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
    elif isinstance(value, str):
        value = value.encode("utf-8")
    elif not isinstance(value, bytes | bytearray):
        raise ValueError(f"{what} must be bytes, str or int, got {type(value).__name__}")
    return int.from_bytes(hashlib.blake2b(bytes(value), digest_size=8).digest(), "little")


def _multimodal(
    items: Sequence[tuple[bytes | int, int, int]] | None,
) -> list[tuple[int, int, int]]:
    out: list[tuple[int, int, int]] = []
    for item in items or ():
        if not isinstance(item, tuple | list) or len(item) != 3:
            raise ValueError(f"multimodal items are (content_hash, start, length), got {item!r}")
        content, start, length = item
        if not isinstance(start, int) or not isinstance(length, int) or start < 0 or length < 0:
            raise ValueError(f"multimodal item start and length must be ints >= 0, got {item!r}")
        out.append((_hash64(content, "multimodal content_hash"), start, length))
    return out


def key_kwargs(
    lora_task_id: int | None,
    cache_salt: str | bytes | int | None,
    multimodal: Sequence[tuple[bytes | int, int, int]] | None,
) -> dict[str, Any]:
    """The reuse-key arguments of the native calls (``lora_task_id``, ``cache_salt``,
    ``multimodal``), validated and converted: the one place every caller goes through."""
    return {
        "lora_task_id": optional_int("lora_task_id", lora_task_id),
        "cache_salt": None if cache_salt is None else _hash64(cache_salt, "cache_salt"),
        "multimodal": _multimodal(multimodal),
    }
