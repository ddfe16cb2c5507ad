"""The ``KVCacheManager`` facade over the native core.

The class subclasses the native ``_core.KVCacheManager`` so that the per-step calls
(``add_tokens``, ``add_token``, ``num_tokens``, ...) go straight to C++ with no Python
frame in between; this module only adds the constructors, argument conversion and the
typed stats object. The native methods check their own arguments: request ids must be in
``[0, 2**63)``, and an integer argument out of range raises ``ValueError`` naming it.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, SupportsIndex

from kvcache import _core
from kvcache.cache.block_keys import key_kwargs
from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.fields import check_type, is_int, optional_int
from kvcache.cache.sizing import blocks_per_window as _blocks_per_window
from kvcache.cache.sizing import pool_shares as _pool_shares
from kvcache.cache.sizing import state_slots as _state_slots
from kvcache.cache.sizing import window_sizes as _window_sizes

__all__ = [
    "NULL_BLOCK",
    "OFFSET_SENTINEL",
    "KVCacheEvent",
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


# Most host memory the host backend counts as available when no budget is given.
_HOST_MEMORY_LIMIT = 4 * 2**30


def _host_available_bytes() -> int:
    """Half of the host's available memory (``MemAvailable``), at most 4 GiB.

    The host backend stands in for a GPU on machines without one (development, tests, CPU
    inference): unlike a dedicated device, the same RAM also holds the model, the engine and
    everything else on the machine, so it takes a modest default, not 90 % of the RAM.
    """
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return min(int(line.split()[1]) * 1024 // 2, _HOST_MEMORY_LIMIT)
    except OSError:
        pass
    free = int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    return min(free // 2, _HOST_MEMORY_LIMIT)


def _resolve_backend(backend: str) -> str:
    if backend == "auto":
        return "cuda" if cuda_available() else "host"
    return backend


def available_memory_bytes(backend: str) -> int:
    """Free memory the primary pools of ``backend`` could use now, in bytes.

    ``cuda``: free device memory (``cudaMemGetInfo``); ``host``: half of the available host
    memory (``MemAvailable``), at most 4 GiB, so a manager sized "from free memory" without a
    GPU takes at most ``free_gpu_memory_fraction`` x 4 GiB (3.6 GiB by default; explicit
    budgets are never capped); ``auto``: whichever of the two ``auto`` resolves to.

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
    """Occupancy and counters. Block counts are primary blocks summed over windows.

    ``max_num_blocks`` and ``num_owned_blocks_per_window_size`` count the blocks each window
    owns now: with ``lend_free_memory`` they move as windows lend each other slabs
    (``lent_slabs`` counts the moves); ``num_free_blocks_per_window_size`` counts each
    window's own free blocks (``get_num_free_blocks`` adds what it could borrow).
    ``forked_blocks`` counts the block references that ``fork_sequence`` children took from
    their parents (no block is taken), ``copied_on_write_blocks`` the private copies that a
    first write into a shared block made (summed over windows).
    ``disk_read_failures`` counts disk-tier blocks dropped because they could not be read back
    intact (I/O error, short read, failed checksum): each was served as a miss.
    Shared tier (``shared_cache_url``): ``shared_hits`` blocks filled from the store at
    ``add_sequence`` (summed over windows), ``shared_writes`` blocks the store accepted,
    ``shared_write_drops`` blocks not written because the write queue was full, and
    ``shared_errors`` lookups or write batches that failed or timed out plus fetched values
    refused (each a miss: not an intact block of its own key, empty, or a key of another Redis
    type), ``shared_auth_failures`` connections the store refused to authenticate (a wrong or
    missing password; each also a failed call in ``shared_errors``).
    Recurrent state (summed over state groups; 0 without recurrent layers): ``state_slots``,
    of which ``working_state_slots`` (one per registered sequence), ``pending_checkpoints``
    (being written), ``cached_checkpoints`` and ``free_state_slots``;
    ``checkpoints_stored`` / ``_restored`` (hits resumed from one) / ``_skipped`` (not taken:
    no slot to spare, a chunk straddled the position, or the chain was not stored) /
    ``_evicted`` (dropped); with host slots ``checkpoints_offloaded`` (moved to the host by an
    eviction), ``checkpoints_onboarded`` (hits restored from the host) and
    ``host_cached_checkpoints``. Why matched prompt tokens were not reused, summed over admissions:
    ``lost_hit_tokens_attention`` (full-attention blocks evicted),
    ``lost_hit_tokens_sliding_window`` (a sliding window's blocks evicted) and
    ``lost_hit_tokens_no_checkpoint`` (no state checkpoint at the position).
    """

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
    disk_read_failures: int = 0
    shared_hits: int = 0
    shared_writes: int = 0
    shared_write_drops: int = 0
    shared_errors: int = 0
    shared_auth_failures: int = 0
    reused_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    missed_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    num_cached_nodes: int = 0
    lent_slabs: int = 0
    num_owned_blocks_per_window_size: dict[int, int] = field(default_factory=dict)
    forked_blocks: int = 0
    copied_on_write_blocks: int = 0
    state_slots: int = 0
    working_state_slots: int = 0
    pending_checkpoints: int = 0
    cached_checkpoints: int = 0
    free_state_slots: int = 0
    checkpoints_stored: int = 0
    checkpoints_restored: int = 0
    checkpoints_skipped: int = 0
    checkpoints_evicted: int = 0
    checkpoints_offloaded: int = 0
    checkpoints_onboarded: int = 0
    host_cached_checkpoints: int = 0
    lost_hit_tokens_attention: int = 0
    lost_hit_tokens_sliding_window: int = 0
    lost_hit_tokens_no_checkpoint: int = 0

    @property
    def cache_hit_rate_per_window_size(self) -> dict[int, float]:
        """reused / (reused + missed) blocks of each window (0.0 before any lookup)."""
        out = {}
        for w, reused in self.reused_blocks_per_window_size.items():
            total = reused + self.missed_blocks_per_window_size.get(w, 0)
            out[w] = reused / total if total else 0.0
        return out


@dataclass(frozen=True)
class KVCacheEvent:
    """One KV cache event.

    ``kind`` is ``"created"`` (``data["num_blocks_per_cache_level"]``), ``"stored"``
    (``data["parent_hash"]``, ``data["blocks"]``: dicts with ``block_hash``, ``tokens``,
    ``lora_task_id``, ``cache_level``, ``priority``), ``"removed"`` (``data["block_hashes"]``)
    or ``"updated"`` (``data["block_hash"]``, ``data["cache_level"]`` and ``data["priority"]``
    as ``(old, new)`` or ``None``). Cache levels: 0 primary, 1 secondary (host), 2 disk tier.
    """

    event_id: int
    window_size: int
    kind: str
    data: dict[str, Any] = field(default_factory=dict)


def _check_types(model: object, config: object) -> None:
    """TypeError unless ``model`` is a ModelConfig and ``config`` a KvCacheConfig."""
    check_type("model", model, ModelConfig)
    check_type("config", config, KvCacheConfig)


def _native_kwargs(
    model: ModelConfig,
    config: KvCacheConfig,
    blocks: Mapping[int, int | tuple[int, int] | tuple[int, int, int]],
    max_seq_len: int,
    max_batch_size: int,
    max_draft_tokens: int,
    state_slots: int | tuple[int, int] = 0,
) -> dict[str, Any]:
    """The native constructor's keyword arguments. The recurrent-state ones
    (``recurrent_layers``, ``state_slots``, ``checkpoint_policy``) are passed only for a model
    with recurrent layers: one ``[(shape, dtype), ...]`` list per recurrent layer."""
    _check_types(model, config)
    for name, value in (("max_seq_len", max_seq_len), ("max_batch_size", max_batch_size)):
        if not is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not is_int(max_draft_tokens):
        raise ValueError(f"max_draft_tokens must be an int, got {max_draft_tokens!r}")
    expected = _window_sizes(model, config, max_seq_len)
    if sorted(blocks) != expected:
        raise ValueError(
            f"blocks_per_window keys must be the window sizes {expected}, got {sorted(blocks)}"
        )
    counts: dict[int, tuple[int, int]] = {}
    disk: dict[int, int] = {}
    for window, count in blocks.items():
        if isinstance(count, int) and not isinstance(count, bool):
            counts[int(window)] = (count, 0)
        elif (
            isinstance(count, tuple)
            and len(count) in (2, 3)
            and all(isinstance(v, int) and not isinstance(v, bool) for v in count)
        ):
            counts[int(window)] = (count[0], count[1])
            if len(count) == 3:
                disk[int(window)] = count[2]
        else:
            raise ValueError(
                f"blocks_per_window[{window}] must be an int, a (primary, secondary) pair or a "
                f"(primary, secondary, disk) triple, got {count!r}"
            )
    pattern = config.max_attention_window
    head_dims = model.head_dim_per_layer()
    dtypes = config.kv_dtype_per_layer(model, max_seq_len)
    state: dict[str, Any] = {}
    if model.recurrent_layers > 0:
        secondary = 0
        if isinstance(state_slots, tuple) and len(state_slots) == 2:
            state_slots, secondary = state_slots
        for name, v in (("state_slots", state_slots), ("state secondary slots", secondary)):
            if not is_int(v):
                raise ValueError(
                    f"{name} must be an int or a (primary, secondary) pair of ints, got {v!r}"
                )
        state = {
            "recurrent_layers": [
                [(list(t.shape), t.dtype) for t in model.recurrent_state]
                for _ in range(model.recurrent_layers)
            ],
            "state_slots": state_slots,
            "state_secondary_slots": secondary,
            "checkpoint_policy": config.checkpoint_policy(),
        }
    return {
        "num_layers": model.num_layers,
        "num_kv_heads": model.kv_heads_per_layer(),
        "head_dim": head_dims[0],
        "dtype": dtypes[0],
        "head_dims": head_dims if len(set(head_dims)) > 1 else [],
        "dtypes": dtypes if len(set(dtypes)) > 1 else [],
        "kv_factor": model.kv_factor,
        "tokens_per_block": config.tokens_per_block,
        "max_attention_window": [0 if w is None else int(w) for w in (pattern or [])],
        "max_seq_len": max_seq_len,
        "max_batch_size": max_batch_size,
        "blocks_per_window": counts,
        "backend": config.backend,
        "max_draft_tokens": max_draft_tokens,
        "enable_block_reuse": config.enable_block_reuse,
        "enable_partial_reuse": config.enable_partial_reuse,
        "copy_on_partial_reuse": config.copy_on_partial_reuse,
        "onboard_blocks": config.onboard_blocks,
        "secondary_offload_min_priority": config.secondary_offload_min_priority,
        "event_buffer_max_size": config.event_buffer_max_size,
        "swa_reuse_policy": config.swa_reuse_policy,
        "protect_reused_blocks": config.protect_reused_blocks,
        "disk_blocks_per_window": disk,
        "disk_cache_dir": config.disk_cache_dir or "",
        "lend_free_memory": config.lend_free_memory,
        "shared_cache_url": config.shared_cache_url or "",
        "shared_cache_namespace": config.shared_cache_namespace or "",
        "shared_cache_timeout_ms": config.shared_cache_timeout_ms,
        "shared_cache_queue_bytes": config.shared_cache_queue_bytes,
        **state,
    }


def _warn_merged_windows(config: KvCacheConfig, max_seq_len: int, windows: list[int]) -> None:
    """A warning when sliding windows of ``config`` not shorter than ``max_seq_len`` ran as
    full attention and so merged with another window (one pool fewer than configured)."""
    pattern = set(config.max_attention_window or [])
    merged = sorted(w for w in pattern if w is not None and w >= max_seq_len)
    if merged and len(windows) < len(pattern):
        warnings.warn(
            f"max_attention_window {', '.join(map(str, merged))} is not shorter than "
            f"max_seq_len {max_seq_len}: those layers run as full attention, so the manager "
            f"has {len(windows)} window(s) {windows} instead of {len(pattern)}",
            UserWarning,
            stacklevel=4,  # the caller of KVCacheManager(...) / from_blocks(...)
        )


def _draft_for_sizing(value: object) -> int:
    """``max_draft_tokens`` for the sizing; a bad value is reported by the native constructor."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return 0


class KVCacheManager(_core.KVCacheManager):
    """KV cache manager for models with one or more attention windows (VSWA).

    One block pool per (window, KV-head count, head size, dtype); every window's blocks are
    written linearly and sliding windows release blocks that left the window. Every mutating
    call either succeeds or raises with nothing changed. Thread-safe (one internal mutex;
    long calls release the GIL).

    Request ids are ints in ``[0, 2**63)``; an id or other integer argument out of range raises
    ``ValueError`` naming the argument (``has_sequence`` of a negative id is ``False``). A
    manager is initialized once: a method called before ``__init__`` ran, or a second
    ``__init__``, raises ``RuntimeError``.

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
        process_group: Any = None,
    ) -> None:
        """Sizes the pools from a memory budget and allocates them.

        The primary budget is ``primary_bytes`` if given, else ``config.max_gpu_total_bytes``,
        else free device memory (free host memory on the host backend) times
        ``config.free_gpu_memory_fraction``; the secondary budget is ``config.host_cache_size``.
        Blocks per window follow from :func:`kvcache.sizing.blocks_per_window`; for a model
        with recurrent layers the state pool's slots from :func:`kvcache.sizing.state_slots`
        (``config.state_slots`` when set), its share of the primary budget left out of the
        windows'.

        Args:
            model: Shape of the model's KV cache.
            config: Cache configuration.
            max_seq_len: Longest sequence (prompt plus generated tokens); required.
            max_batch_size: Most sequences registered at once.
            primary_bytes: Explicit primary budget in bytes.
            max_draft_tokens: Extra tokens sliding windows keep so that ``rewind`` of up to
                this many tokens never needs a released block.
            process_group: A ``torch.distributed`` process group (e.g. the tensor-parallel
                ranks): every rank constructs its manager with it, and the pools of every
                rank get the per-window minimum of the ranks' block counts, so all ranks
                hold identical pools and block tables. ``None``: size this process alone
                (``torch`` is never imported).

        Raises:
            ValueError: Bad arguments, or a budget too small for one block per window or
                for ``max_batch_size + 1`` state slots (on every rank of ``process_group``
                when one rank's is), or ranks whose windows differ.
            KVCacheError: The pools could not be allocated.
            RuntimeError: This manager is already initialized; nothing was changed.
            TypeError: ``model`` is not a :class:`ModelConfig` or ``config`` not a
                :class:`KvCacheConfig`.
        """
        _check_types(model, config)
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
            hint = ""
            if isinstance(primary_bytes, str):  # a size string: the caller converts it
                hint = f"; for a size string pass kvcache.parse_size({primary_bytes!r})"
            raise ValueError(
                f"primary_bytes must be a positive int (bytes), got {primary_bytes!r}{hint}"
            )

        def split(secondary_bytes: int) -> dict[int, tuple[int, int]]:
            """Primary blocks and ``secondary_bytes`` worth of offload blocks per window."""
            return _blocks_per_window(
                model,
                config,
                max_seq_len,
                primary_bytes,
                secondary_bytes,
                max_batch_size=max_batch_size if max_batch_size > 0 else None,
                max_draft_tokens=_draft_for_sizing(max_draft_tokens),
                process_group=process_group,
            )

        blocks = split(config.host_cache_size)
        sized: dict[int, tuple[int, int] | tuple[int, int, int]] = dict(blocks)
        if config.disk_cache_size > 0:
            # The disk budget splits over the windows like the host budget.
            disk = split(config.disk_cache_size)
            sized = {w: (p, s, disk[w][1]) for w, (p, s) in blocks.items()}
        slots = 0
        if model.recurrent_layers > 0 and config.state_slots is not None:
            slots = config.state_slots
        elif model.recurrent_layers > 0:
            slots = _state_slots(
                model,
                config,
                max_seq_len,
                primary_bytes,
                max_batch_size=max_batch_size,
                max_draft_tokens=_draft_for_sizing(max_draft_tokens),
                process_group=process_group,
            )
        host_slots = 0
        if model.recurrent_layers > 0 and config.host_cache_size > 0:
            # The state pool's share of the host budget holds offloaded checkpoints.
            _, state_share = _pool_shares(
                model,
                config,
                max_seq_len,
                primary_bytes=primary_bytes,
                max_batch_size=max_batch_size,
                max_draft_tokens=_draft_for_sizing(max_draft_tokens),
            )
            host_slots = int(config.host_cache_size * state_share) // (
                model.state_bytes_per_sequence()
            )
        self._init(
            model, config, sized, max_seq_len, max_batch_size, max_draft_tokens, (slots, host_slots)
        )

    def _init(
        self,
        model: ModelConfig,
        config: KvCacheConfig,
        blocks: Mapping[int, int | tuple[int, int] | tuple[int, int, int]],
        max_seq_len: int,
        max_batch_size: int,
        max_draft_tokens: int,
        state_slots: int | tuple[int, int] = 0,
    ) -> None:
        kwargs = _native_kwargs(
            model, config, blocks, max_seq_len, max_batch_size, max_draft_tokens, state_slots
        )
        _core.KVCacheManager.__init__(self, **kwargs)
        self.model = model
        self.config = config
        _warn_merged_windows(config, max_seq_len, self.window_sizes)
        self._disk_blocks: dict[int, int] = {
            w: kwargs["disk_blocks_per_window"].get(w, 0) for w in self.window_sizes
        }

    @classmethod
    def from_blocks(
        cls,
        model: ModelConfig,
        config: KvCacheConfig,
        blocks_per_window: Mapping[int, int | tuple[int, int] | tuple[int, int, int]],
        *,
        max_seq_len: int,
        max_batch_size: int,
        max_draft_tokens: int = 0,
        state_slots: int | tuple[int, int] | None = None,
    ) -> KVCacheManager:
        """Builds a manager with exact block counts per window (tests, simulations).

        Args:
            model: Shape of the model's KV cache.
            config: Cache configuration (its memory-budget fields are not used).
            blocks_per_window: Window -> primary count, (primary, secondary) or (primary,
                secondary, disk); the keys must equal ``kvcache.window_sizes(model, config,
                max_seq_len)``. Disk blocks live in the disk tier (``config.disk_cache_dir``).
            max_seq_len: Longest sequence; required.
            max_batch_size: Most sequences registered at once.
            max_draft_tokens: See ``__init__``.
            state_slots: Slots of each recurrent state pool (models with recurrent layers; more
                than ``max_batch_size``), or a (primary, secondary) pair: secondary (host)
                slots receive evicted checkpoints; ``None``: ``config.state_slots``, else
                ``2 * max_batch_size + 2``. Ignored for attention-only models.
        """
        if state_slots is None:
            state_slots = getattr(config, "state_slots", None)  # config is checked in _init
            if state_slots is None:
                state_slots = 2 * max_batch_size + 2 if isinstance(max_batch_size, int) else 0
        self = cls.__new__(cls)
        self._init(
            model,
            config,
            blocks_per_window,
            max_seq_len,
            max_batch_size,
            max_draft_tokens,
            state_slots,
        )
        return self

    def prepare(
        self,
        tokens: Sequence[int] | Any,
        *,
        lora_task_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
    ) -> _core.PreparedPrompt:
        """Converts and keys a prompt once, for every later call that takes a prompt.

        ``add_sequence``, ``get_reusable_prefix_length`` and ``get_num_blocks_to_allocate``
        accept the result in place of ``tokens`` (without ``lora_task_id`` / ``cache_salt`` /
        ``multimodal``, which it carries), so an admission retried every step, a lookup and a
        re-admission after preemption convert and hash nothing again.

        Raises:
            ValueError: Empty or too long prompt, negative token, bad multimodal item, an
                integer argument out of range.
        """
        if lora_task_id is None and cache_salt is None and multimodal is None:
            return self._prepare(tokens)  # positional: the bindings parse no keywords
        return self._prepare(tokens, **key_kwargs(lora_task_id, cache_salt, multimodal))

    def add_sequence(
        self,
        request_id: int,
        tokens: Sequence[int] | _core.PreparedPrompt | Any,
        *,
        lora_task_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
        priority: int | None = None,
        priority_ranges: Sequence[tuple[int, int | None, int, int | None]] | None = None,
        decode_priority: int | None = None,
        decode_duration_ms: int | None = None,
        prefill: int | None = None,
    ) -> int:
        """Registers a sequence whose prompt is ``tokens`` and gives every window its blocks.

        With ``prefill`` (chunked prefill) the whole prompt is keyed and looked up, but blocks
        are given only for the reused prefix plus the first ``prefill`` prompt tokens; call
        :meth:`prefill` for each later chunk. ``num_tokens`` counts the tokens with blocks and
        ``prompt_length`` the whole prompt.

        With reuse on, prompt blocks found in the reuse tree are taken from the cache (onboarded
        from host memory if they were offloaded; a partially matching block is taken over or
        copied); a sliding window that reuses a prefix of length P gets ``NULL_BLOCK`` before
        ``P - window``.

        Args:
            request_id: New, unique request id, ``0 <= request_id < 2**63``.
            tokens: Prompt token ids (sequence of ints or 1-D integer ndarray), non-empty,
                at most ``max_seq_len`` long, or a :meth:`prepare` d prompt (then without the
                reuse-key arguments, which it carries).
            lora_task_id: LoRA adapter id (part of every block key; ``None`` differs from 0).
            cache_salt: Cache salt (part of the first block key, so of the whole chain).
            multimodal: ``(content_hash, start, length)`` items; each block's key holds every
                item overlapping it with its offset relative to the block.
            priority: Retention priority 0..100 of this sequence's blocks (default 35).
            priority_ranges: ``(start, end or None, priority, duration_ms or None)`` per prompt
                token range; a block takes the range holding its first token.
            decode_priority: Priority of the blocks of generated tokens.
            decode_duration_ms: How long the decode priority lasts (None: forever).
            prefill: Prompt tokens after the reused prefix that get blocks now (``>= 1``;
                ``None``: the whole prompt).

        Returns:
            Prompt tokens whose KV is already present in every window (never more than
            ``len(tokens) - 1``; 0 without reuse).

        Raises:
            ValueError: Duplicate or out-of-range id, empty or too long prompt, negative token,
                bad priority or multimodal item, an integer argument out of range.
            OutOfBlocksError: A window lacks blocks; nothing was changed.
        """
        if (
            priority is None
            and priority_ranges is None
            and decode_priority is None
            and decode_duration_ms is None
            and lora_task_id is None
            and cache_salt is None
            and multimodal is None
        ):
            return self._add_sequence_plain(request_id, tokens, prefill)  # the common case
        ranges = []
        for r in priority_ranges or ():
            if not isinstance(r, tuple | list) or len(r) != 4:
                raise ValueError(
                    f"priority ranges are (start, end, priority, duration_ms), got {r!r}"
                )
            start, end, prio, duration = r
            ranges.append((start, -1 if end is None else end, prio, duration or 0))
        return int(
            self._add_sequence(
                request_id,
                tokens,
                priority=optional_int("priority", priority),
                priority_ranges=ranges,
                decode_priority=optional_int("decode_priority", decode_priority),
                decode_duration_ms=optional_int("decode_duration_ms", decode_duration_ms) or 0,
                prefill=optional_int("prefill", prefill),
                **key_kwargs(lora_task_id, cache_salt, multimodal),
            )
        )

    def get_cache_block_ids(
        self, request_id: SupportsIndex, window_size: SupportsIndex | str | None = None
    ) -> list[int]:
        """Block ids per block position of one window (``NULL_BLOCK`` where a sliding window
        released the block).

        ``window_size`` is one of :attr:`window_sizes`, or ``None`` / ``"full"`` for full
        attention, as in ``KvCacheConfig.max_attention_window``: the window ``max_seq_len``.
        ``None`` is also the only window of a one-window manager, whatever it is.

        Raises:
            ValueError: Not a window of this manager, ``"full"`` (or ``None`` with several
                windows) and the manager has no full-attention window, or an unknown request.
        """
        if window_size is None or isinstance(window_size, str):
            window_size = self._full_window(window_size)
        return _core.KVCacheManager.get_cache_block_ids(self, request_id, window_size)

    def _full_window(self, window_size: str | None) -> int | None:
        """The window that ``None`` / ``"full"`` names (``None``: the core's own choice)."""
        windows = self.window_sizes
        if window_size is None and len(windows) == 1:
            return None
        if window_size is not None and window_size != "full":
            raise ValueError(
                f'window_size must be one of this manager\'s windows {windows}, or None / "full" '
                f"for full attention; got {window_size!r}"
            )
        if self.max_seq_len not in windows:
            raise ValueError(
                f"window_size {window_size!r} means full attention, but this manager has no "
                f"full-attention window: its windows {windows} are all sliding (shorter than "
                f"max_seq_len {self.max_seq_len}); give one of them"
            )
        return int(self.max_seq_len)

    def get_reusable_prefix_length(
        self,
        tokens: Sequence[int] | _core.PreparedPrompt | Any,
        *,
        lora_task_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
    ) -> int:
        """What :meth:`add_sequence` would return for this prompt now, changing nothing."""
        if lora_task_id is None and cache_salt is None and multimodal is None:
            return self._get_reusable_prefix_length(tokens)
        return int(
            self._get_reusable_prefix_length(
                tokens, **key_kwargs(lora_task_id, cache_salt, multimodal)
            )
        )

    def get_num_blocks_to_allocate(
        self,
        tokens: Sequence[int] | _core.PreparedPrompt | Any,
        *,
        lora_task_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
        prefill: int | None = None,
    ) -> dict[int, int]:
        """Free primary blocks per window that :meth:`add_sequence` of this prompt takes now.

        Reused blocks that other sequences hold cost nothing; reused cached (free) blocks,
        onboarded blocks, the partial block and fresh blocks cost one each. With ``prefill``,
        for the first chunk only, as ``add_sequence(..., prefill=prefill)``.
        """
        if lora_task_id is None and cache_salt is None and multimodal is None:
            return self._blocks_to_allocate_plain(tokens, prefill)
        return dict(
            self._get_num_blocks_to_allocate(
                tokens,
                prefill=optional_int("prefill", prefill),
                **key_kwargs(lora_task_id, cache_salt, multimodal),
            )
        )

    def get_latest_events(self, timeout_ms: int = 0) -> list[KVCacheEvent]:
        """Takes the buffered events (oldest first); waits up to ``timeout_ms`` for one.

        Empty unless ``config.event_buffer_max_size > 0``. A timeout too long for the clock
        (such as ``2**62``) waits until an event arrives.

        Raises:
            ValueError: ``timeout_ms`` is negative or not below ``2**63``.
        """
        out = []
        for d in self._latest_events(timeout_ms):
            event_id = d.pop("event_id")
            window = d.pop("window_size")
            kind = d.pop("kind")
            out.append(KVCacheEvent(event_id, window, kind, d))
        return out

    @property
    def disk_blocks_per_window(self) -> dict[int, int]:
        """Disk-tier blocks per window (0 without a disk tier), ascending window order."""
        return dict(self._disk_blocks)

    def get_kv_cache_stats(self) -> KvCacheStats:
        """Occupancy and allocation counters (primary blocks, summed over windows)."""
        return KvCacheStats(**self._stats_dict())
