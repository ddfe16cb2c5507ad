"""Model and KV cache configuration: frozen, validated dataclasses.

Both classes validate every field in ``__post_init__`` and raise :class:`ValueError`
naming the offending field, so a bad value is caught where it is written, not deep
inside the native core. They carry no native state and import nothing native.

Example:
    >>> from kvcache.config import KvCacheConfig, ModelConfig
    >>> model = ModelConfig(num_layers=4, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    >>> model.dtype_bytes
    2
    >>> config = KvCacheConfig(tokens_per_block=16, max_attention_window=[1024, None])
    >>> config.attention_window_per_layer(model.num_layers, max_seq_len=8192)
    [1024, 8192, 1024, 8192]
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from kvcache import _core
from kvcache.cache.fields import (
    DTYPE_BYTES,
    SHARE_POLICIES,
)
from kvcache.cache.fields import (
    INT32_MAX as _INT32_MAX,
)
from kvcache.cache.fields import (
    as_int as _as_int,
)
from kvcache.cache.fields import (
    bool_field as _bool,
)
from kvcache.cache.fields import (
    check_share_values as _check_share_values,
)
from kvcache.cache.fields import (
    choice as _choice,
)
from kvcache.cache.fields import (
    field_names as _field_names,
)
from kvcache.cache.fields import (
    is_int as _is_int,
)
from kvcache.cache.fields import (
    non_negative_int as _non_negative_int,
)
from kvcache.cache.fields import (
    optional_positive_int as _optional_positive_int,
)
from kvcache.cache.fields import (
    parse_share_text as _parse_share_text,
)
from kvcache.cache.fields import (
    per_layer as _per_layer,
)
from kvcache.cache.fields import (
    positive_int as _positive_int,
)
from kvcache.cache.fields import (
    positive_int32 as _positive_int32,
)
from kvcache.cache.fields import (
    priority as _priority,
)
from kvcache.cache.fields import (
    sequence as _sequence,
)
from kvcache.cache.fields import (
    to_plain as _to_plain,
)
from kvcache.cache.fields import (
    unknown_keys as _unknown_keys,
)
from kvcache.cache.state_spec import (
    CHECKPOINT_KINDS,
    StateTensor,
)
from kvcache.cache.state_spec import (
    check_checkpoints as _check_checkpoints,
)
from kvcache.cache.state_spec import (
    check_recurrent_state as _check_recurrent_state,
)

__all__ = [
    "BACKENDS",
    "CHECKPOINT_KINDS",
    "DEFAULT_MAX_NUM_BATCHED_TOKENS",
    "DTYPE_BYTES",
    "SHARE_POLICIES",
    "SWA_REUSE_POLICIES",
    "WINDOW_KINDS",
    "KvCacheConfig",
    "ModelConfig",
    "StateTensor",
]


#: Memory backends accepted by ``KvCacheConfig.backend``.
BACKENDS: tuple[str, ...] = ("auto", "cuda", "host", "virtual")

#: Reuse policies for sliding-window blocks accepted by ``KvCacheConfig.swa_reuse_policy``.
SWA_REUSE_POLICIES: tuple[str, ...] = ("invalidate", "placeholder")

#: Window kinds accepted as ``KvCacheConfig.kv_cache_dtype`` keys (``None`` means ``"full"``).
WINDOW_KINDS: tuple[str, ...] = ("full", "sliding")


#: Default token budget of one engine step (``KvCacheConfig.max_num_batched_tokens``): vLLM's.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


# --------------------------------------------------------------------------------------
# Field checks. Each raises ValueError naming ``name``; bools are never accepted as ints.
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# StateTensor
# --------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------
# ModelConfig
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The attention shape of a model, as far as the KV cache is concerned.

    ``num_kv_heads``, ``head_dim`` and ``dtype`` each take one value for every layer or one
    entry per layer (stored as a tuple), for models whose layers differ in shape (Gemma-4:
    head size 256 on sliding layers, 512 on full ones).

    Args:
        num_layers: Number of attention layers whose KV is cached (> 0).
        num_kv_heads: KV heads per layer: one int for every layer, or one entry per layer.
        head_dim: Size of one attention head (> 0): one int, or one entry per layer.
        dtype: KV cache element type: ``float32``, ``float16``, ``bfloat16``, ``fp8`` or
            ``int8``; one name, or one entry per layer. ``KvCacheConfig.kv_cache_dtype``
            overrides it.
        kv_factor: 2 when keys and values are both cached, 1 for K-only caches (MLA).
        recurrent_layers: Number of recurrent layers (Mamba, Gated DeltaNet, short
            convolution; >= 0, default 0). They hold a fixed-size state per sequence instead
            of KV; ``num_layers`` counts the attention layers only. Needs ``recurrent_state``.
        recurrent_state: The state tensors of one recurrent layer, in order
            (:class:`StateTensor` items or ``{"name", "shape", "dtype"}`` mappings, stored as a
            tuple of ``StateTensor``); every recurrent layer has the same. Empty (the default)
            exactly when ``recurrent_layers`` is 0. The repr and ``to_dict`` leave both out
            for attention-only models.

    Raises:
        ValueError: A field has the wrong type or is out of range; the message names it.

    Example:
        >>> m = ModelConfig(num_layers=3, num_kv_heads=[8, 8, 4], head_dim=64, dtype="fp8")
        >>> m.kv_heads_per_layer()
        [8, 8, 4]
        >>> m.bytes_per_token_per_layer()   # heads * kv_factor * head_dim * dtype_bytes
        [1024, 1024, 512]
        >>> m = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=[256, 512],
        ...                 dtype=["bfloat16", "fp8"])
        >>> m.bytes_per_token_per_layer()
        [1024, 1024]

        A hybrid model, Qwen3.5-9B: 8 full-attention layers and 24 Gated DeltaNet layers.

        >>> m = ModelConfig(num_layers=8, num_kv_heads=4, head_dim=256, dtype="bfloat16",
        ...                 recurrent_layers=24, recurrent_state=[
        ...                     {"name": "conv", "shape": [8192, 3], "dtype": "bfloat16"},
        ...                     {"name": "recurrent", "shape": [32, 128, 128], "dtype": "float32"}])
        >>> m.state_bytes_per_layer(), m.state_bytes_per_sequence()
        (2146304, 51511296)
    """

    num_layers: int
    num_kv_heads: int | Sequence[int]
    head_dim: int | Sequence[int]
    dtype: str | Sequence[str] = "float16"
    kv_factor: int = 2
    recurrent_layers: int = 0
    recurrent_state: Sequence[StateTensor] = ()

    def __post_init__(self) -> None:
        num_layers = _positive_int32("num_layers", self.num_layers)
        recurrent = _as_int(self.recurrent_layers)
        if not _is_int(recurrent) or not 0 <= recurrent <= _INT32_MAX:
            raise ValueError(
                f"recurrent_layers must be an int in [0, {_INT32_MAX}], got {recurrent!r}"
            )
        object.__setattr__(self, "recurrent_layers", int(recurrent))
        state = _check_recurrent_state(self.recurrent_state)
        object.__setattr__(self, "recurrent_state", state)
        if recurrent > 0 and not state:
            raise ValueError(
                f"recurrent_layers = {recurrent} needs recurrent_state: the state tensors of "
                "one recurrent layer (e.g. conv and ssm)"
            )
        if recurrent == 0 and state:
            raise ValueError(
                f"recurrent_state has {len(state)} tensor(s) but recurrent_layers is 0; give "
                "the number of recurrent layers, or no recurrent_state"
            )
        if not _is_int(self.kv_factor) or self.kv_factor not in (1, 2):
            raise ValueError(f"kv_factor must be 1 or 2, got {self.kv_factor!r}")
        for name in ("num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if _is_int(value):
                _positive_int32(name, value)
                continue
            items = _per_layer(name, value, num_layers, "int")
            checked = tuple(
                _positive_int32(f"{name}[{i}]", _as_int(h)) for i, h in enumerate(items)
            )
            object.__setattr__(self, name, checked)
        dtype = self.dtype
        if isinstance(dtype, str):
            _choice("dtype", dtype, tuple(DTYPE_BYTES))
        else:
            items = _per_layer("dtype", dtype, num_layers, "name")
            names = tuple(
                _choice(f"dtype[{i}]", d, tuple(DTYPE_BYTES)) for i, d in enumerate(items)
            )
            object.__setattr__(self, "dtype", names)

    def __repr__(self) -> str:
        names = [f.name for f in dataclasses.fields(self)]
        if self.recurrent_layers == 0:
            names = [n for n in names if n not in _RECURRENT_FIELDS]
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in names)
        return f"{type(self).__name__}({inner})"

    @property
    def is_hybrid(self) -> bool:
        """True when the model has recurrent layers besides its attention layers."""
        return self.recurrent_layers > 0

    def state_bytes_per_layer(self) -> int:
        """Bytes of one recurrent layer's state for one sequence (0 without recurrent layers).

        Example:
            >>> ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8).state_bytes_per_layer()
            0
        """
        return sum(t.nbytes for t in self.recurrent_state)

    def state_bytes_per_sequence(self) -> int:
        """Bytes of the recurrent state of one sequence over every recurrent layer: one state
        slot, ``recurrent_layers * state_bytes_per_layer()``."""
        return self.recurrent_layers * self.state_bytes_per_layer()

    @property
    def dtype_bytes(self) -> int:
        """Bytes per element of :attr:`dtype` (``float16`` -> 2, ``fp8`` -> 1).

        Raises:
            ValueError: The layers differ in dtype (see :meth:`dtype_per_layer`).
        """
        names = set(self.dtype_per_layer())
        if len(names) != 1:
            raise ValueError(
                f"the model's layers differ in dtype ({', '.join(sorted(names))}): "
                "use dtype_per_layer()"
            )
        return DTYPE_BYTES[names.pop()]

    def kv_heads_per_layer(self) -> list[int]:
        """KV head count of every layer, expanded from an int if needed.

        Example:
            >>> ModelConfig(num_layers=2, num_kv_heads=4, head_dim=8).kv_heads_per_layer()
            [4, 4]
        """
        if isinstance(self.num_kv_heads, int):
            return [self.num_kv_heads] * self.num_layers
        return list(self.num_kv_heads)

    def head_dim_per_layer(self) -> list[int]:
        """Head size of every layer, expanded from an int if needed.

        Example:
            >>> ModelConfig(num_layers=2, num_kv_heads=4, head_dim=8).head_dim_per_layer()
            [8, 8]
        """
        if isinstance(self.head_dim, int):
            return [self.head_dim] * self.num_layers
        return list(self.head_dim)

    def dtype_per_layer(self) -> list[str]:
        """KV dtype of every layer, expanded from one name if needed.

        Example:
            >>> ModelConfig(num_layers=2, num_kv_heads=4, head_dim=8).dtype_per_layer()
            ['float16', 'float16']
        """
        if isinstance(self.dtype, str):
            return [self.dtype] * self.num_layers
        return list(self.dtype)

    def bytes_per_token_per_layer(self, dtypes: Sequence[str] | None = None) -> list[int]:
        """KV bytes one token occupies in each layer: ``heads * kv_factor * head_dim * bytes``.

        Args:
            dtypes: One dtype per layer to use instead of the model's (as
                :meth:`KvCacheConfig.kv_dtype_per_layer` resolves them); ``None``: the model's.

        Raises:
            ValueError: ``dtypes`` does not hold one known dtype per layer.

        Example:
            >>> ModelConfig(num_layers=1, num_kv_heads=8, head_dim=128).bytes_per_token_per_layer()
            [4096]
            >>> ModelConfig(num_layers=1, num_kv_heads=8, head_dim=128).bytes_per_token_per_layer(
            ...     ["fp8"])
            [2048]
        """
        if dtypes is None:
            names = self.dtype_per_layer()
        else:
            items = _per_layer("dtypes", dtypes, self.num_layers, "name")
            names = [_choice(f"dtypes[{i}]", d, tuple(DTYPE_BYTES)) for i, d in enumerate(items)]
        return [
            heads * self.kv_factor * dim * DTYPE_BYTES[name]
            for heads, dim, name in zip(
                self.kv_heads_per_layer(), self.head_dim_per_layer(), names, strict=True
            )
        ]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelConfig:
        """Builds a config from a mapping of field names; unknown keys raise ``ValueError``.

        Example:
            >>> ModelConfig.from_dict({"num_layers": 2, "num_kv_heads": 1, "head_dim": 64})
            ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64, dtype='float16', kv_factor=2)
        """
        _unknown_keys(cls.__name__, d, _field_names(cls))
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (lists, not tuples); ``from_dict(to_dict())`` round-trips.

        The recurrent fields appear only for models with recurrent layers, the state tensors
        as ``{"name", "shape", "dtype"}`` dicts.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in _RECURRENT_FIELDS and self.recurrent_layers == 0:
                continue
            value = getattr(self, f.name)
            if f.name == "recurrent_state":
                out[f.name] = [t.to_dict() for t in value]
            else:
                out[f.name] = _to_plain(value)
        return out


_RECURRENT_FIELDS = ("recurrent_layers", "recurrent_state")


# --------------------------------------------------------------------------------------
# KvCacheConfig
# --------------------------------------------------------------------------------------


def _check_window_pattern(value: object) -> tuple[int | None, ...] | None:
    if value is None:
        return None
    items = _sequence("max_attention_window", value)
    if len(items) == 0:
        raise ValueError("max_attention_window must be None or a non-empty sequence")
    out: list[int | None] = []
    for i, w in enumerate(items):
        w = None if w == "full" else _as_int(w)
        if w is not None and (not _is_int(w) or w <= 0):
            raise ValueError(f"max_attention_window[{i}] must be a positive int or None, got {w!r}")
        out.append(None if w is None else int(w))
    return tuple(out)


def _byte_count(name: str, value: object) -> int:
    """A byte count: an int >= 0. A size string is refused with the call that converts it:
    byte fields are exact ints; ``kvcache.parse_size`` reads ``"4GiB"``."""
    if isinstance(value, str):
        raise ValueError(
            f"{name} must be a non-negative int (bytes), got {value!r}; for a size string "
            f"pass kvcache.parse_size({value!r})"
        )
    return _non_negative_int(name, value)


def _check_shares(value: object) -> str | tuple[float, ...] | None:
    name = "window_size_shares"
    if value is None:
        return None
    if isinstance(value, str):
        return _parse_share_text(name, value)
    return _check_share_values(name, _sequence(name, value))


#: A ``kv_cache_dtype`` key: a window kind (``"full"``, ``"sliding"``, ``None``) or window size.
KvDtypeKey = int | str | None


def _check_kv_dtype_name(name: str, value: object) -> str:
    if value == "auto":
        return "auto"
    return _choice(name, value, (*DTYPE_BYTES, "auto"))


def _check_kv_cache_dtype(value: object) -> str | Mapping[KvDtypeKey, str] | None:
    """One dtype for every layer, or window kinds / window sizes mapped to dtypes.

    Keys: ``"full"`` (or ``None``), ``"sliding"``, or a window size (an int, or its digits as
    text, as JSON and TOML spell keys). Values: a dtype name or ``"auto"`` (the model's).
    Stored as a read-only mapping with ``None`` spelled ``"full"``.
    """
    name = "kv_cache_dtype"
    if value is None or isinstance(value, str):
        return None if value is None else _check_kv_dtype_name(name, value)
    if not isinstance(value, Mapping):
        raise ValueError(
            f"{name} must be a dtype name or a mapping of window kinds ('full', 'sliding') or "
            f"window sizes to dtype names, got {value!r}"
        )
    if not value:
        raise ValueError(f"{name} must not be an empty mapping (use None for the model's dtypes)")
    out: dict[KvDtypeKey, str] = {}
    for raw, dtype in value.items():
        key: KvDtypeKey
        if raw is None or raw == "full":
            key = "full"
        elif raw == "sliding":
            key = "sliding"
        elif isinstance(raw, str) and raw.strip().isdigit():
            key = int(raw.strip())
        else:
            raw = _as_int(raw)
            if not _is_int(raw):
                raise ValueError(
                    f"{name} keys must be 'full' (or None), 'sliding' or a window size, got {raw!r}"
                )
            key = raw
        if isinstance(key, int) and key <= 0:
            raise ValueError(f"{name} window sizes must be positive, got {key}")
        if key in out:
            raise ValueError(f"{name} names {key!r} twice (None and 'full' are the same key)")
        out[key] = _check_kv_dtype_name(f"{name}[{key!r}]", dtype)
    return MappingProxyType(out)


@dataclass(frozen=True)
class KvCacheConfig:
    """How the KV cache is sized and behaves. See API.md "Configuration".

    Args:
        tokens_per_block: Token positions per block (> 0).
        max_attention_window: Window per layer as a pattern that repeats over the layers;
            ``None`` (or ``"full"``) entries, or a ``None`` list, mean full attention. Stored
            as a tuple with ``None`` for full attention.
        max_tokens: Caps the primary pool of a single-window model, in tokens; ignored
            (with a warning) when the model has several windows.
        free_gpu_memory_fraction: Fraction of free memory to use, in (0, 1].
        max_gpu_total_bytes: Primary budget in bytes; ``None`` (or 0, stored as ``None``)
            means "use the free memory fraction".
        host_cache_size: Bytes of host memory for secondary (offloaded) blocks.
        disk_cache_size: Bytes of the disk tier below host memory: evicted host blocks are
            written there and onboarded on a hit (0: none; needs ``host_cache_size`` > 0).
        disk_cache_dir: Directory of the disk tier's files; ``None``: a private temporary
            directory, removed with the manager.
        shared_cache_url: A Redis server that managers (engines) share KV blocks through,
            ``"redis://[[user]:password@]host[:port][/db]"`` (credentials percent-encoded; a
            password may instead come from the ``KVCACHE_SHARED_CACHE_PASSWORD`` environment
            variable); ``None``: no shared tier. Needs block reuse and a backend with memory.
            See API.md "The shared tier".
        shared_cache_namespace: Key prefix in the store; ``None``: ``"kvcache:"`` and a
            fingerprint of the model layout, dtypes, tokens per block and windows, so only
            managers whose blocks are interchangeable read each other's.
        shared_cache_timeout_ms: Most milliseconds one ``add_sequence`` spends on the store's
            lookups (> 0; default 5): past it the lookup is a miss.
        shared_cache_queue_bytes: Bytes of blocks queued for the store's writer at most
            (default 64 MiB); a block that does not fit is dropped and counted.
        enable_block_reuse: Reuse cached prompt prefixes across requests.
        enable_partial_reuse: Allow reusing a partially matching block.
        copy_on_partial_reuse: Copy a partially matched block instead of taking it over.
        onboard_blocks: Offload evicted reusable blocks to host and onboard them on reuse.
        secondary_offload_min_priority: Blocks below this priority (0..100) are not offloaded.
        window_size_shares: Memory share per window: ``"equal"``, ``"proportional"``,
            ``"auto"``, one number per window in ascending window order, or the same as
            comma-separated text. ``None`` defers to the environment (see
            :func:`kvcache.sizing.window_size_shares`). Number lists are stored as tuples.
            For a model with recurrent layers the recurrent state pool is one more entry,
            after the windows (see :func:`kvcache.sizing.pool_shares`).
        state_slots: Slots of the recurrent state pool of each recurrent layer group (models
            with recurrent layers only): one working slot per running sequence plus the
            checkpoints that prefix reuse resumes from; more than the manager's
            ``max_batch_size``. The pool's bytes are then taken from the budget first and the
            windows divide the rest. ``None`` (default): sized from the state pool's share of
            the budget (:func:`kvcache.sizing.state_slots`).
        recurrent_checkpoints: Where state checkpoints are taken, any of ``"prompt_end"``
            (the last block boundary before a prompt's last token), ``"finish"`` (the last
            block boundary a sequence reached, stored when it ends), ``"junction"`` (the end
            of a prefix that a lookup matched past the deepest checkpoint there) and
            ``"chunk_end"`` (the end of every prefill chunk that ends on a block boundary);
            default the first three. A sequence or comma-separated text, stored as a tuple in
            that order.
        recurrent_checkpoint_interval: Also checkpoint a prompt every this many blocks
            (>= 0; 0, the default, turns it off).
        max_checkpoints_per_path: Most checkpoints on one path of the reuse tree (>= 0; 0,
            the default: no cap); storing one more evicts the shallowest.
        event_buffer_max_size: Events kept for ``get_latest_events`` (0 disables events).
        swa_reuse_policy: ``"placeholder"`` (default: a reclaimed out-of-window block leaves
            a placeholder and the rest of the chain stays reusable) or ``"invalidate"``.
        protect_reused_blocks: Segmented LRU (default): a cached block that served a reuse
            hit is evicted only after the cached blocks of its priority that never did, so a
            stream of prompts seen once cannot flush a prefix that requests keep sharing (at
            most a tenth of a pool is protected). ``False``: plain LRU within each priority.
        lend_free_memory: Windows lend each other memory at run time: every window's primary
            blocks live in one shared arena cut into slabs (the least common multiple of the
            windows' block sizes), and a window that runs out of free blocks takes a wholly
            free slab of another window (evicting what that slab cached) instead of failing.
            The window shares then set the initial split only. Block ids span the whole arena
            (``pools[i]["num_primary_blocks"]``) and a window's blocks sit
            ``pools[i]["block_stride"]`` bytes apart. ``False`` (default): fixed pools.
        expected_seq_len: Typical sequence length (prompt plus output) that the ``"auto"``
            share policy sizes the windows for; ``None`` means ``max_seq_len``. Sizing for the
            real length rather than the maximum gives sliding windows their fair share.
        max_num_batched_tokens: Tokens one engine step processes at most (decodes plus
            prefill chunks, > 0; default 8192). The ``"auto"`` share policy counts them as
            the prefill chunks a sliding window holds on top of its window.
        backend: ``"auto"``, ``"cuda"``, ``"host"`` or ``"virtual"``.
        kv_cache_dtype: KV dtype overriding the model's: one name for every layer
            (``"fp8"``), or a mapping from window kinds or window sizes to names:
            ``{"full": "fp8", "sliding": "bfloat16"}`` or ``{1024: "bfloat16", None: "fp8"}``
            (``None`` is ``"full"``; a window size matches the layers of that window after
            full-attention windows become ``max_seq_len``; it wins over a kind). ``"auto"``
            or a layer no key matches keeps the model's dtype. ``None``: the model's dtypes.
            A mapping is stored read-only with ``"full"`` for ``None``; window-size keys
            may be written as digits (``"1024"``), as JSON and TOML keys are text.

    Raises:
        ValueError: A field has the wrong type or is out of range; the message names it.

    Example:
        >>> c = KvCacheConfig.from_dict({"tokens_per_block": 64, "window_size_shares": "1,3"})
        >>> c.window_size_shares
        (1.0, 3.0)
        >>> c.to_dict()["window_size_shares"]
        [1.0, 3.0]
    """

    tokens_per_block: int = 32
    max_attention_window: Sequence[int | None] | None = None
    max_tokens: int | None = None
    free_gpu_memory_fraction: float = 0.9
    max_gpu_total_bytes: int | None = None
    host_cache_size: int = 0
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    copy_on_partial_reuse: bool = True
    onboard_blocks: bool = True
    secondary_offload_min_priority: int = 30
    window_size_shares: str | Sequence[float] | None = None
    event_buffer_max_size: int = 0
    swa_reuse_policy: str = "placeholder"
    protect_reused_blocks: bool = True
    lend_free_memory: bool = False
    backend: str = "auto"
    expected_seq_len: int | None = None
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    kv_cache_dtype: str | Mapping[KvDtypeKey, str] | None = None
    disk_cache_size: int = 0
    disk_cache_dir: str | None = None
    shared_cache_url: str | None = None
    shared_cache_namespace: str | None = None
    shared_cache_timeout_ms: int = 5
    shared_cache_queue_bytes: int = 64 << 20
    state_slots: int | None = None
    recurrent_checkpoints: Sequence[str] = ("prompt_end", "finish", "junction")
    recurrent_checkpoint_interval: int = 0
    max_checkpoints_per_path: int = 0

    def __post_init__(self) -> None:
        _positive_int("tokens_per_block", self.tokens_per_block)
        slots = self.state_slots
        if slots is not None:
            _positive_int32("state_slots", slots)
        object.__setattr__(
            self, "recurrent_checkpoints", _check_checkpoints(self.recurrent_checkpoints)
        )
        for name in ("recurrent_checkpoint_interval", "max_checkpoints_per_path"):
            n = _non_negative_int(name, getattr(self, name))
            if n > _INT32_MAX:
                raise ValueError(f"{name} = {n} is out of range [0, {_INT32_MAX}]")
        object.__setattr__(
            self, "max_attention_window", _check_window_pattern(self.max_attention_window)
        )
        _optional_positive_int("max_tokens", self.max_tokens)
        _optional_positive_int("expected_seq_len", self.expected_seq_len)
        _positive_int("max_num_batched_tokens", self.max_num_batched_tokens)
        frac = self.free_gpu_memory_fraction
        if (
            isinstance(frac, bool)
            or not isinstance(frac, (int, float))
            or not math.isfinite(frac)
            or not 0 < frac <= 1
        ):
            raise ValueError(f"free_gpu_memory_fraction must be a number in (0, 1], got {frac!r}")
        object.__setattr__(self, "free_gpu_memory_fraction", float(frac))
        total = self.max_gpu_total_bytes
        if total is not None:
            _byte_count("max_gpu_total_bytes", total)
            if total == 0:
                object.__setattr__(self, "max_gpu_total_bytes", None)
        _byte_count("host_cache_size", self.host_cache_size)
        _byte_count("disk_cache_size", self.disk_cache_size)
        if self.disk_cache_size > 0 and self.host_cache_size == 0:
            raise ValueError(
                "disk_cache_size needs host_cache_size > 0: blocks reach the disk tier from "
                "host memory"
            )
        if self.disk_cache_dir is not None and (
            not isinstance(self.disk_cache_dir, str) or not self.disk_cache_dir
        ):
            raise ValueError(
                f"disk_cache_dir must be a non-empty str or None, got {self.disk_cache_dir!r}"
            )
        for name in ("shared_cache_url", "shared_cache_namespace"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty str or None, got {value!r}")
        if self.shared_cache_url is not None:
            _core._check_shared_cache_url(self.shared_cache_url)  # the core's own URL rule
        if self.shared_cache_namespace is not None and self.shared_cache_url is None:
            raise ValueError("shared_cache_namespace needs shared_cache_url")
        _positive_int("shared_cache_timeout_ms", self.shared_cache_timeout_ms)
        _non_negative_int("shared_cache_queue_bytes", self.shared_cache_queue_bytes)
        for name in (
            "enable_block_reuse",
            "enable_partial_reuse",
            "copy_on_partial_reuse",
            "onboard_blocks",
            "protect_reused_blocks",
            "lend_free_memory",
        ):
            _bool(name, getattr(self, name))
        _priority("secondary_offload_min_priority", self.secondary_offload_min_priority)
        object.__setattr__(self, "window_size_shares", _check_shares(self.window_size_shares))
        _non_negative_int("event_buffer_max_size", self.event_buffer_max_size)
        _choice("swa_reuse_policy", self.swa_reuse_policy, SWA_REUSE_POLICIES)
        _choice("backend", self.backend, BACKENDS)
        object.__setattr__(self, "kv_cache_dtype", _check_kv_cache_dtype(self.kv_cache_dtype))

    def __hash__(self) -> int:
        return hash(tuple(_hashable(getattr(self, name)) for name in _field_names(type(self))))

    def attention_window_per_layer(self, num_layers: int, max_seq_len: int) -> list[int]:
        """The attention window of every layer, with full attention as ``max_seq_len``.

        The ``max_attention_window`` pattern repeats over the layers; entries that are
        ``None`` or ``>= max_seq_len`` become ``max_seq_len``. No pattern means every layer
        is full attention.

        Args:
            num_layers: Number of layers to expand over (> 0).
            max_seq_len: Longest sequence the cache must hold (> 0).

        Returns:
            One window per layer.

        Raises:
            ValueError: Non-positive arguments, or a pattern longer than ``num_layers``.

        Example:
            >>> KvCacheConfig(max_attention_window=[512, 512, None]).attention_window_per_layer(
            ...     5, max_seq_len=4096)
            [512, 512, 4096, 512, 512]
            >>> KvCacheConfig(max_attention_window=[8192]).attention_window_per_layer(2, 4096)
            [4096, 4096]
        """
        _positive_int("num_layers", num_layers)
        _positive_int("max_seq_len", max_seq_len)
        pattern = self.max_attention_window
        if pattern is None:
            return [max_seq_len] * num_layers
        if len(pattern) > num_layers:
            raise ValueError(
                f"max_attention_window has {len(pattern)} entries, more than the model's "
                f"{num_layers} layers"
            )
        out = []
        for layer in range(num_layers):
            w = pattern[layer % len(pattern)]
            out.append(max_seq_len if w is None or w >= max_seq_len else w)
        return out

    def kv_dtype_per_layer(self, model: ModelConfig, max_seq_len: int) -> list[str]:
        """The KV dtype of every layer: the model's, overridden by :attr:`kv_cache_dtype`.

        A window-size key matches the layers whose window (:meth:`attention_window_per_layer`,
        full attention as ``max_seq_len``) equals it and wins over ``"full"`` / ``"sliding"``,
        which match full-attention and sliding-window layers; ``"auto"`` keeps the model's.

        Args:
            model: The model (its dtypes and layer count).
            max_seq_len: Longest sequence (decides which layers are full attention).

        Returns:
            One dtype name per layer.

        Raises:
            ValueError: A window-size key matches no layer (the message lists the windows).

        Example:
            >>> m = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16")
            >>> c = KvCacheConfig(max_attention_window=[512, 512, None],
            ...                   kv_cache_dtype={"full": "fp8"})
            >>> c.kv_dtype_per_layer(m, 4096)
            ['bfloat16', 'bfloat16', 'fp8']
            >>> KvCacheConfig(max_attention_window=[512, None], kv_cache_dtype={512: "fp8"}
            ...               ).kv_dtype_per_layer(m, 4096)
            ['fp8', 'bfloat16', 'fp8']
        """
        model_dtypes = model.dtype_per_layer()
        choice = self.kv_cache_dtype
        if choice is None:
            return model_dtypes
        if isinstance(choice, str):
            return model_dtypes if choice == "auto" else [choice] * model.num_layers
        windows = self.attention_window_per_layer(model.num_layers, max_seq_len)
        unknown = sorted(k for k in choice if isinstance(k, int) and k not in windows)
        if unknown:
            raise ValueError(
                f"kv_cache_dtype names window(s) {unknown} but the model's windows at "
                f"max_seq_len={max_seq_len} are {sorted(set(windows))}"
            )
        out = []
        for window, own in zip(windows, model_dtypes, strict=True):
            kind = "full" if window >= max_seq_len else "sliding"
            name = choice.get(window, choice.get(kind, "auto"))
            out.append(own if name == "auto" else name)
        return out

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> KvCacheConfig:
        """Builds a config from a mapping of field names; unknown keys raise ``ValueError``.

        Example:
            >>> KvCacheConfig.from_dict({"backend": "virtual"}).backend
            'virtual'
        """
        _unknown_keys(cls.__name__, d, _field_names(cls))
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (lists, not tuples); ``from_dict(to_dict())`` round-trips.

        The recurrent-state fields (``state_slots``, ``recurrent_checkpoints``,
        ``recurrent_checkpoint_interval``, ``max_checkpoints_per_path``) appear only where
        they differ from their defaults, so configs that do not use them read as before.
        """
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in _STATE_POOL_FIELDS and value == f.default:
                continue
            out[f.name] = _to_plain(value)
        return out

    def checkpoint_policy(self) -> dict[str, bool | int]:
        """The checkpoint fields as the native core's ``checkpoint_policy`` argument.

        Example:
            >>> p = KvCacheConfig(recurrent_checkpoints="finish, chunk_end",
            ...                   max_checkpoints_per_path=4).checkpoint_policy()
            >>> [p[k] for k in ("prompt_end", "finish", "chunk_end", "interval_blocks")]
            [False, True, True, 0]
        """
        out: dict[str, bool | int] = {k: k in self.recurrent_checkpoints for k in CHECKPOINT_KINDS}
        out["interval_blocks"] = self.recurrent_checkpoint_interval
        out["max_per_path"] = self.max_checkpoints_per_path
        return out

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> KvCacheConfig:
        """Reads a config from a JSON, TOML or YAML file (chosen by the file suffix).

        The file holds one table/object of ``KvCacheConfig`` fields. YAML needs the
        ``pyyaml`` package. Errors (unreadable file, bad syntax, unknown field, bad value)
        raise ``ValueError`` naming the file.

        TOML has no null, so a full-attention entry of ``max_attention_window`` may be
        written as the string ``"full"`` in any format.

        Example:
            A file ``kv.toml`` holding::

                tokens_per_block = 64
                max_attention_window = [1024, 1024, 1024, 1024, 1024, "full"]
                window_size_shares = "auto"

            loads as ``KvCacheConfig(tokens_per_block=64, max_attention_window=(1024, 1024,
            1024, 1024, 1024, None), window_size_shares='auto')``.
        """
        p = Path(path)
        suffix = p.suffix.lower()
        try:
            text = p.read_text(encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot read KV cache config file {str(p)!r}: {e}") from None
        data: object
        try:
            if suffix == ".json":
                data = json.loads(text)
            elif suffix == ".toml":
                data = _load_toml(text)
            elif suffix in (".yaml", ".yml"):
                data = _load_yaml(text)
            else:
                raise ValueError(
                    f"unsupported config file type {suffix or '(none)'!r}; "
                    "use .json, .toml, .yaml or .yml"
                )
        except ValueError as e:
            raise ValueError(f"{str(p)!r}: {e}") from None
        if not isinstance(data, Mapping):
            raise ValueError(f"{str(p)!r}: expected a table of KvCacheConfig fields at top level")
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{str(p)!r}: {e}") from None


_STATE_POOL_FIELDS = (
    "state_slots",
    "recurrent_checkpoints",
    "recurrent_checkpoint_interval",
    "max_checkpoints_per_path",
)


def _hashable(value: object) -> object:
    if isinstance(value, Mapping):
        return tuple(sorted((str(k), v) for k, v in value.items()))
    return value


def _load_toml(text: str) -> object:
    try:
        import tomllib  # Python >= 3.11
    except ModuleNotFoundError:  # pragma: no cover - Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef,import-not-found,unused-ignore]
        except ModuleNotFoundError:
            raise ValueError("reading TOML needs Python >= 3.11 or the tomli package") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"invalid TOML: {e}") from None


def _load_yaml(text: str) -> object:
    try:
        import yaml  # type: ignore[import-untyped,unused-ignore]
    except ModuleNotFoundError:
        raise ValueError("reading YAML needs the pyyaml package (pip install pyyaml)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"invalid YAML: {e}") from None
