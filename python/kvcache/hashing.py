"""Block keys as the core computes them, for routers and tools outside the manager."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvcache import _core
from kvcache.manager import _key_kwargs

__all__ = ["block_hashes"]


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
            tokens, tokens_per_block, **_key_kwargs(lora_task_id, cache_salt, multimodal)
        )
    )
