"""The ``KVCacheManager`` facade over the native core.

The class subclasses the native ``_core.KVCacheManager`` so that the per-step calls
(``add_tokens``, ``add_token``, ``num_tokens``, ...) go straight to C++ with no Python
frame in between; this module only adds the constructors, argument conversion and the
typed stats object.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache import _core
from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.sizing import blocks_per_window as _blocks_per_window
from kvcache.sizing import window_sizes as _window_sizes

__all__ = [
    "NULL_BLOCK",
    "OFFSET_SENTINEL",
    "KVCacheManager",
    "KvCacheStats",
    "available_memory_bytes",
    "cuda_available",
]

NULL_BLOCK: int = _core.NULL_BLOCK
"""Block-list entry of a position that holds no block (released by a sliding window)."""
OFFSET_SENTINEL: int = _core.OFFSET_SENTINEL
"""Block-offset table entry of a position that holds no block."""


def cuda_available() -> bool:
    """True when kvcache was built with CUDA and a CUDA device is usable now."""
    return bool(_core.cuda_available())


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "cuda" if cuda_available() else "host"
    return backend


def available_memory_bytes(backend: str) -> int:
    """Free memory the primary pools of ``backend`` could use now, in bytes.

    ``cuda``: free device memory (``cudaMemGetInfo``); ``host``: available host memory
    (``MemAvailable``); ``auto``: whichever of the two ``auto`` resolves to.

    Raises:
        ValueError: For the ``virtual`` backend, which has no memory to measure.
        KVCacheError: ``cuda`` without a usable device.
    """
    resolved = _resolve_backend(backend)
    if resolved == "virtual":
        raise ValueError(
            "the virtual backend needs an explicit budget: pass primary_bytes or set "
            "max_gpu_total_bytes"
        )
    if resolved == "cuda":
        return int(_core.cuda_mem_get_info()[0])
    return _host_available_bytes()


@dataclass(frozen=True)
class KvCacheStats:
    """Occupancy and counters. Block counts are primary blocks summed over windows."""

    max_num_blocks: int
    free_num_blocks: int
    used_num_blocks: int
    tokens_per_block: int
    alloc_total_blocks: int
    alloc_new_blocks: int
    reused_blocks: int
    missed_blocks: int
    cache_hit_rate: float
    num_free_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    allocated_bytes: int = 0
    offloaded_blocks: int = 0
    onboarded_blocks: int = 0


def _native_kwargs(
    model: ModelConfig,
    config: KvCacheConfig,
    blocks: Mapping[int, int | tuple[int, int]],
    max_seq_len: int,
    max_batch_size: int,
    max_draft_tokens: int,
) -> dict[str, Any]:
    if not isinstance(model, ModelConfig):
        raise ValueError(f"model must be a kvcache.ModelConfig, got {type(model).__name__}")
    if not isinstance(config, KvCacheConfig):
        raise ValueError(f"config must be a kvcache.KvCacheConfig, got {type(config).__name__}")
    for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if isinstance(max_draft_tokens, bool) or not isinstance(max_draft_tokens, int):
        raise ValueError(f"max_draft_tokens must be an int, got {max_draft_tokens!r}")
    expected = _window_sizes(model, config, max_seq_len)
    if sorted(blocks) != expected:
        raise ValueError(
            f"blocks_per_window keys must be the window sizes {expected}, got {sorted(blocks)}"
        )
    counts: dict[int, tuple[int, int]] = {}
    for window, count in blocks.items():
        if isinstance(count, int) and not isinstance(count, bool):
            counts[int(window)] = (count, 0)
        elif (
            isinstance(count, tuple)
            and len(count) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) for v in count)
        ):
            counts[int(window)] = (count[0], count[1])
        else:
            raise ValueError(
                f"blocks_per_window[{window}] must be an int or a (primary, secondary) pair, "
                f"got {count!r}"
            )
    pattern = config.max_attention_window
    return {
        "num_layers": model.num_layers,
        "num_kv_heads": model.kv_heads_per_layer(),
        "head_dim": model.head_dim,
        "dtype": model.dtype,
        "kv_factor": model.kv_factor,
        "tokens_per_block": config.tokens_per_block,
        "max_attention_window": [0 if w is None else int(w) for w in (pattern or [])],
        "max_seq_len": max_seq_len,
        "max_batch_size": max_batch_size,
        "blocks_per_window": counts,
        "backend": config.backend,
        "max_draft_tokens": max_draft_tokens,
    }


class KVCacheManager(_core.KVCacheManager):
    """KV cache manager for models with one or more attention windows (VSWA).

    One block pool per (window, KV-head count); every window's blocks are written linearly
    and sliding windows release blocks that left the window. Every mutating call either
    succeeds or raises with nothing changed. Thread-safe (one internal mutex; long calls
    release the GIL).

    Example:
        >>> from kvcache import KVCacheManager, KvCacheConfig, ModelConfig
        >>> model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
        >>> config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None],
        ...                        backend="virtual")
        >>> m = KVCacheManager.from_blocks(model, config, {8: 4, 64: 8}, max_seq_len=64,
        ...                                max_batch_size=2)
        >>> m.add_sequence(1, list(range(10)))
        0
        >>> m.get_cache_block_ids(1, 8), m.get_cache_block_ids(1, 64)
        ([0, 1, 2], [0, 1, 2])
        >>> m.add_tokens([1], [10]); m.add_tokens([1], [11]); m.get_cache_block_ids(1, 8)
        [-1, 1, 2]
    """

    model: ModelConfig
    config: KvCacheConfig

    def __init__(
        self,
        model: ModelConfig,
        config: KvCacheConfig,
        *,
        max_seq_len: int,
        max_batch_size: int,
        primary_bytes: int | None = None,
        max_draft_tokens: int = 0,
    ) -> None:
        """Sizes the pools from a memory budget and allocates them.

        The primary budget is ``primary_bytes`` if given, else ``config.max_gpu_total_bytes``,
        else free device memory (free host memory on the host backend) times
        ``config.free_gpu_memory_fraction``; the secondary budget is ``config.host_cache_size``.
        Blocks per window follow from :func:`kvcache.sizing.blocks_per_window`.

        Args:
            model: Shape of the model's KV cache.
            config: Cache configuration.
            max_seq_len: Longest sequence (prompt plus generated tokens); required.
            max_batch_size: Most sequences registered at once.
            primary_bytes: Explicit primary budget in bytes.
            max_draft_tokens: Extra tokens sliding windows keep so that ``rewind`` of up to
                this many tokens never needs a released block.

        Raises:
            ValueError: Bad arguments, or a budget too small for one block per window.
            KVCacheError: The pools could not be allocated.
        """
        if primary_bytes is None:
            if config.max_gpu_total_bytes is not None:
                primary_bytes = config.max_gpu_total_bytes
            else:
                free = available_memory_bytes(config.backend)
                primary_bytes = int(free * config.free_gpu_memory_fraction)
        if (
            isinstance(primary_bytes, bool)
            or not isinstance(primary_bytes, int)
            or primary_bytes <= 0
        ):
            raise ValueError(f"primary_bytes must be a positive int, got {primary_bytes!r}")
        blocks = _blocks_per_window(
            model, config, max_seq_len, primary_bytes, config.host_cache_size
        )
        self._init(model, config, blocks, max_seq_len, max_batch_size, max_draft_tokens)

    def _init(
        self,
        model: ModelConfig,
        config: KvCacheConfig,
        blocks: Mapping[int, int | tuple[int, int]],
        max_seq_len: int,
        max_batch_size: int,
        max_draft_tokens: int,
    ) -> None:
        kwargs = _native_kwargs(
            model, config, blocks, max_seq_len, max_batch_size, max_draft_tokens
        )
        _core.KVCacheManager.__init__(self, **kwargs)
        self.model = model
        self.config = config

    @classmethod
    def from_blocks(
        cls,
        model: ModelConfig,
        config: KvCacheConfig,
        blocks_per_window: Mapping[int, int | tuple[int, int]],
        *,
        max_seq_len: int,
        max_batch_size: int,
        max_draft_tokens: int = 0,
    ) -> KVCacheManager:
        """Builds a manager with exact block counts per window (tests, simulations).

        Args:
            model: Shape of the model's KV cache.
            config: Cache configuration (its memory-budget fields are not used).
            blocks_per_window: Window -> primary count, or (primary, secondary); the keys must
                equal ``kvcache.window_sizes(model, config, max_seq_len)``.
            max_seq_len: Longest sequence; required.
            max_batch_size: Most sequences registered at once.
            max_draft_tokens: See ``__init__``.
        """
        self = cls.__new__(cls)
        self._init(model, config, blocks_per_window, max_seq_len, max_batch_size, max_draft_tokens)
        return self

    def add_sequence(
        self,
        request_id: int,
        tokens: Sequence[int] | Any,
        *,
        lora_task_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
        priority: int | None = None,
    ) -> int:
        """Registers a sequence whose prompt is ``tokens`` and gives every window its blocks.

        Args:
            request_id: New, unique request id.
            tokens: Prompt token ids (sequence of ints or 1-D integer ndarray), non-empty,
                at most ``max_seq_len`` long.
            lora_task_id: LoRA adapter id (part of the reuse key).
            cache_salt: Cache salt (part of the reuse key).
            multimodal: ``(content_hash, start, length)`` items (part of the reuse key).
            priority: Retention priority 0..100 of this sequence's blocks.

        Returns:
            Prompt tokens whose KV is already cached in every window (0 without reuse).

        Raises:
            ValueError: Duplicate id, empty or too long prompt, negative token, bad priority.
            OutOfBlocksError: A window lacks blocks; nothing was changed.
        """
        del lora_task_id, cache_salt, multimodal  # reuse keys: used once block reuse lands
        return int(self._add_sequence(request_id, tokens, priority))

    def get_kv_cache_stats(self) -> KvCacheStats:
        """Occupancy and allocation counters (primary blocks, summed over windows)."""
        return KvCacheStats(**self._stats_dict())
