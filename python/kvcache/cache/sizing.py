"""Memory per attention window: pure functions from a model, a config and a byte budget.

Everything here is plain arithmetic with no native calls, so it can be used for planning
without a GPU. Block counts are computed with exact rational arithmetic (no float
rounding surprises); the shares returned to callers are floats that sum to 1.0.

Example: a Gemma-3-27B-shaped model (62 layers, 16 KV heads of 128, bfloat16; five
1024-token sliding-window layers for every full-attention layer) at 32,768 tokens::

    >>> from kvcache import KvCacheConfig, ModelConfig
    >>> model = ModelConfig(num_layers=62, num_kv_heads=16, head_dim=128, dtype="bfloat16")
    >>> config = KvCacheConfig(max_attention_window=[1024] * 5 + [None])
    >>> window_sizes(model, config, 32768)
    [1024, 32768]
    >>> bytes_per_token(model, config, 32768)     # 52 and 10 layers of 8192 B
    {1024: 425984, 32768: 81920}
"""

from __future__ import annotations

import logging
import math
from typing import Any

from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.fields import non_negative_count, positive_count
from kvcache.cache.shares import (
    SHARES_ENV_VAR,
    TRTLLM_SHARES_ENV_VAR,
    auto_demand_tokens,
    bytes_per_token,
    max_blocks_per_sequence,
    model_pool_fractions,
    peak_blocks_per_sequence,
    pool_shares,
    resolve_share_policy,
    window_size_shares,
    window_sizes,
)
from kvcache.cache.units import format_size, parse_size

__all__ = [
    "MAX_BLOCKS_PER_WINDOW",
    "SHARES_ENV_VAR",
    "TRTLLM_SHARES_ENV_VAR",
    "auto_demand_tokens",
    "blocks_per_window",
    "bytes_per_token",
    "format_size",
    "max_blocks_per_sequence",
    "parse_size",
    "peak_blocks_per_sequence",
    "pool_shares",
    "resolve_share_policy",
    "state_slots",
    "window_size_shares",
    "window_sizes",
]

logger = logging.getLogger(__name__)

#: Environment variable with the window shares, read when the config does not set them.
#: Most blocks (primary plus secondary) one window can have: block ids are 32-bit.
MAX_BLOCKS_PER_WINDOW = 2**31 - 1

# (max_tokens, windows) pairs already warned about, so each warning is logged once.
_max_tokens_warned: set[tuple[int, tuple[int, ...]]] = set()


def state_slots(
    model: ModelConfig,
    config: KvCacheConfig,
    max_seq_len: int,
    primary_bytes: int,
    *,
    max_batch_size: int,
    expected_seq_len: int | None = None,
    max_draft_tokens: int = 0,
    process_group: Any = None,
) -> int:
    """Slots of the recurrent state pool of each recurrent layer group for a memory budget.

    ``slots = floor(primary_bytes * state_share / S)`` with ``S =
    model.state_bytes_per_sequence()`` and the state share of :func:`pool_shares` (the same
    that :func:`blocks_per_window` leaves out of the windows); ``config.state_slots`` when
    set. A pool needs more slots than ``max_batch_size``: one working slot per running
    sequence and at least one to checkpoint into.

    Args:
        model: The model; 0 is returned when it has no recurrent layers.
        config: Shares, ``state_slots`` and what :func:`pool_shares` reads.
        max_seq_len: Longest sequence; full-attention layers get this window.
        primary_bytes: The primary (device) budget that windows and state divide (> 0).
        max_batch_size: Most sequences running at once (> 0).
        expected_seq_len: Typical sequence length for ``"auto"``.
        max_draft_tokens: Draft tokens sliding windows keep (``"auto"``).
        process_group: A ``torch.distributed`` process group: every rank gets the smallest
            rank's slot count (see :func:`blocks_per_window`). ``None``: this process alone.

    Returns:
        Slots per recurrent group.

    Raises:
        ValueError: Bad arguments or shares; fewer than ``max_batch_size + 1`` slots (the
            message names the pool's bytes, the slot size and the share needed); more than
            ``2**31 - 1`` slots.

    Example:
        Qwen3.5-9B, 16 GiB, equal shares: 8 GiB / 51,511,296 B = 166 slots.

        >>> from kvcache.models import load_model
        >>> p = load_model("qwen3.5-9b")
        >>> state_slots(p.model, p.kv_cache_config(window_size_shares="equal"), 32768,
        ...             16 * 2**30, max_batch_size=32)
        166
    """
    if process_group is not None:
        from kvcache.cache.distributed import min_reduce_blocks

        try:
            local = state_slots(
                model,
                config,
                max_seq_len,
                primary_bytes,
                max_batch_size=max_batch_size,
                expected_seq_len=expected_seq_len,
                max_draft_tokens=max_draft_tokens,
            )
        except ValueError:
            min_reduce_blocks(None, process_group)
            raise
        agreed = min_reduce_blocks({0: (local, 0)}, process_group)
        assert agreed is not None
        return agreed[0][0]
    primary = positive_count("primary_bytes", primary_bytes)
    batch = positive_count("max_batch_size", max_batch_size)
    slot = model.state_bytes_per_sequence()
    if slot == 0:
        return 0
    need = batch + 1
    n = 0
    if config.state_slots is not None:
        n = config.state_slots
        if n < need:
            raise ValueError(
                f"state_slots = {n} is too few for max_batch_size = {batch}: a recurrent state "
                f"pool needs at least {need} slots (one working slot per running sequence and "
                "one to checkpoint into)"
            )
    _, share = model_pool_fractions(
        model, config, max_seq_len, primary, expected_seq_len, batch, max_draft_tokens
    )  # with state_slots: raises when the slots leave nothing for the windows
    if config.state_slots is not None:
        return n
    pool = math.floor(primary * share)
    n = pool // slot
    if n < need:
        need_share = need * slot / primary
        raise ValueError(
            f"memory budget too small for the recurrent state: its pool gets "
            f"{format_size(pool)} (share {float(share):.4f} of {format_size(primary)}), {n} "
            "slot(s) "
            f"of {format_size(slot)} ({slot:,} bytes: {model.recurrent_layers} recurrent "
            f"layers x {model.state_bytes_per_layer():,} bytes), but max_batch_size = {batch} "
            f"needs at least {need} (one working slot per running sequence and one to "
            f"checkpoint into): {format_size(need * slot)} ({need * slot:,} bytes), a share of "
            f"{need_share:.4f}; give the state pool a larger share or set state_slots"
        )
    if n > MAX_BLOCKS_PER_WINDOW:
        raise ValueError(
            f"memory budget too large: the recurrent state pool would get {n:,} slots, but "
            f"slot ids are 32-bit (at most {MAX_BLOCKS_PER_WINDOW:,}); give less memory"
        )
    return n


# --------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------


def blocks_per_window(
    model: ModelConfig,
    config: KvCacheConfig,
    max_seq_len: int,
    primary_bytes: int,
    secondary_bytes: int = 0,
    *,
    expected_seq_len: int | None = None,
    max_batch_size: int | None = None,
    max_draft_tokens: int = 0,
    process_group: Any = None,
) -> dict[int, tuple[int, int]]:
    """Primary and secondary block counts per window for a memory budget.

    ``primary[w] = floor(primary_bytes * share[w] / (bytes_per_token[w] * tokens_per_block))``
    and ``secondary[w]`` likewise from ``secondary_bytes``, with shares from
    ``config.window_size_shares``, else ``KVCACHE_WINDOW_SIZE_SHARES``, else
    ``TRTLLM_WINDOW_SIZE_SHARES``, else ``"equal"``.

    ``config.max_tokens`` caps the primary blocks of a single-window model at
    ``ceil(max_tokens / tokens_per_block)``. With several windows it is ignored and a warning
    is logged (once per ``max_tokens`` and window set): each window's pool then follows
    from its share of the budget.

    Args:
        model: The model's attention shape.
        config: Block size, window pattern, shares and ``max_tokens``.
        max_seq_len: Longest sequence; full-attention layers get this window.
        primary_bytes: Budget for primary (device) blocks.
        secondary_bytes: Budget for secondary (host) blocks.
        expected_seq_len: Typical sequence length for the ``"auto"`` policy (default
            ``config.expected_seq_len``, else ``max_seq_len``).
        max_batch_size: Most sequences running at once: with it, ``"auto"`` sizes every
            window from its demand under chunked prefill (with
            ``config.max_num_batched_tokens``) and gives the rest of ``primary_bytes`` to
            the sliding windows; see :func:`window_size_shares`.
        max_draft_tokens: Draft tokens sliding windows keep beyond the window (the
            manager's ``max_draft_tokens``), counted by ``"auto"``.
        process_group: A ``torch.distributed`` process group: every rank of it must call
            this, and every rank gets the per-window minimum over the ranks (tensor-parallel
            ranks need identical pools; see :func:`kvcache.distributed.min_reduce_blocks`).
            ``None`` (default) sizes this process alone and never imports ``torch``.

    Returns:
        Window -> ``(primary_blocks, secondary_blocks)``, ascending window order.

    Raises:
        ValueError: Bad arguments or shares (see :func:`window_size_shares`), a window
            whose share of ``primary_bytes`` does not hold one block (the message names the
            window and the missing bytes), or a window that would get more than
            :data:`MAX_BLOCKS_PER_WINDOW` blocks.

    Example:
        Three windows with equal bytes per token (one layer each, 1 head of 64, float16:
        256 B per token, 4 KiB per 16-token block) and 16,384 blocks' worth of memory,
        proportional shares 1/13, 4/13, 8/13:

        >>> m = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=64)
        >>> c = KvCacheConfig(tokens_per_block=16, max_attention_window=[1024, 4096, 8192],
        ...                   window_size_shares="proportional")
        >>> blocks_per_window(m, c, 8192, primary_bytes=16384 * 4096)
        {1024: (1260, 0), 4096: (5041, 0), 8192: (10082, 0)}
    """
    if process_group is not None:
        from kvcache.cache.distributed import min_reduce_blocks

        try:
            local = blocks_per_window(
                model,
                config,
                max_seq_len,
                primary_bytes,
                secondary_bytes,
                expected_seq_len=expected_seq_len,
                max_batch_size=max_batch_size,
                max_draft_tokens=max_draft_tokens,
            )
        except ValueError:
            min_reduce_blocks(None, process_group)  # lets the other ranks fail too
            raise
        agreed = min_reduce_blocks(local, process_group)
        assert agreed is not None
        return agreed
    primary = non_negative_count("primary_bytes", primary_bytes)
    secondary = non_negative_count("secondary_bytes", secondary_bytes)
    tpb = config.tokens_per_block
    bpt = bytes_per_token(model, config, max_seq_len)
    shares, _ = model_pool_fractions(
        model,
        config,
        max_seq_len,
        primary,
        expected_seq_len,
        max_batch_size,
        max_draft_tokens,
    )
    # The secondary (host) budget splits like the primary one: the state pool's share of it
    # holds offloaded checkpoints (KVCacheManager's state_secondary_slots).
    secondary_shares = dict(shares)
    windows = list(bpt)
    cap: int | None = None
    if config.max_tokens is not None:
        if len(windows) == 1:
            cap = -(-config.max_tokens // tpb)
        else:
            key = (config.max_tokens, tuple(windows))
            if key not in _max_tokens_warned:
                _max_tokens_warned.add(key)
                logger.warning(
                    "KvCacheConfig.max_tokens=%d is ignored: the model has %d attention "
                    "windows %s, and each window's pool follows from its share of the memory "
                    "budget",
                    config.max_tokens,
                    len(windows),
                    windows,
                )
    out: dict[int, tuple[int, int]] = {}
    for w in windows:
        block_bytes = bpt[w] * tpb
        n_primary = math.floor(primary * shares[w] / block_bytes)
        n_secondary = math.floor(secondary * secondary_shares[w] / block_bytes)
        if n_primary < 1:
            window_bytes = math.floor(primary * shares[w])
            missing = block_bytes - window_bytes
            if shares[w] > 0:
                need_total = math.ceil(block_bytes / shares[w])
                hint = (
                    f"; a primary budget of at least {format_size(need_total)} "
                    f"({need_total:,} bytes) is needed"
                )
            else:
                hint = "; its share is 0"
            raise ValueError(
                f"memory budget too small: window {w} gets {format_size(window_bytes)} "
                f"(share {float(shares[w]):.4f} of {format_size(primary)}) but one block "
                f"needs {format_size(block_bytes)} ({tpb} tokens x {bpt[w]:,} bytes per "
                f"token), {format_size(missing)} short{hint}"
            )
        if cap is not None:
            n_primary = min(n_primary, cap)
        if n_primary + n_secondary > MAX_BLOCKS_PER_WINDOW:
            raise ValueError(
                f"memory budget too large: window {w} would get {n_primary + n_secondary:,} "
                f"blocks ({n_primary:,} primary, {n_secondary:,} secondary) but block ids are "
                f"32-bit, so a window holds at most {MAX_BLOCKS_PER_WINDOW:,}; give less "
                "memory or more tokens per block"
            )
        out[w] = (n_primary, n_secondary)
    return out
