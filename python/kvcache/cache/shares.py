"""The memory-budget shares of attention windows and of the recurrent state pool.

Pure functions from a model, a config and (for ``"auto"``) a budget: which policy applies
(config, environment, default), and each pool's fraction of the budget. ``kvcache.sizing``
turns the fractions into block and slot counts and re-exports the public names.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from kvcache import _core as _block_math
from kvcache.cache.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SHARE_POLICIES,
    KvCacheConfig,
    ModelConfig,
)
from kvcache.cache.fields import check_share_values as _check_share_values
from kvcache.cache.fields import non_negative_count, positive_count
from kvcache.cache.fields import parse_share_text as _parse_share_text
from kvcache.cache.units import format_size

__all__ = [
    "SHARES_ENV_VAR",
    "TRTLLM_SHARES_ENV_VAR",
    "auto_demand_tokens",
    "bytes_per_token",
    "max_blocks_per_sequence",
    "peak_blocks_per_sequence",
    "pool_shares",
    "resolve_share_policy",
    "window_size_shares",
    "window_sizes",
]

SHARES_ENV_VAR = "KVCACHE_WINDOW_SIZE_SHARES"
#: TensorRT-LLM's spelling, accepted for compatibility after :data:`SHARES_ENV_VAR`.
TRTLLM_SHARES_ENV_VAR = "TRTLLM_WINDOW_SIZE_SHARES"

_CONFIG_SOURCE = "KvCacheConfig.window_size_shares"

SharePolicy = str | tuple[float, ...]


# --------------------------------------------------------------------------------------
# Windows and bytes per token
# --------------------------------------------------------------------------------------


def window_sizes(model: ModelConfig, config: KvCacheConfig, max_seq_len: int) -> list[int]:
    """The distinct attention windows of the model, ascending.

    Layers whose window is ``None`` or ``>= max_seq_len`` are full attention and get window
    ``max_seq_len``.

    Args:
        model: The model's attention shape.
        config: Supplies the ``max_attention_window`` pattern (repeats over layers).
        max_seq_len: Longest sequence the cache must hold.

    Returns:
        Ascending, distinct window sizes.

    Raises:
        ValueError: ``max_seq_len`` is not a positive int, or the pattern is longer than the
            model has layers.

    Example:
        >>> m = ModelConfig(num_layers=4, num_kv_heads=8, head_dim=128)
        >>> window_sizes(m, KvCacheConfig(max_attention_window=[4096, 512]), 2048)
        [512, 2048]
        >>> window_sizes(m, KvCacheConfig(), 2048)
        [2048]
    """
    positive_count("max_seq_len", max_seq_len)
    return sorted(set(config.attention_window_per_layer(model.num_layers, max_seq_len)))


def bytes_per_token(model: ModelConfig, config: KvCacheConfig, max_seq_len: int) -> dict[int, int]:
    """KV bytes one token occupies in each window, summed over that window's layers.

    ``bytes_per_token[w]`` = sum over the layers of window ``w`` of
    ``num_kv_heads[layer] * kv_factor * head_dim[layer] * dtype_bytes[layer]``, with each
    layer's dtype from :meth:`KvCacheConfig.kv_dtype_per_layer` (``config.kv_cache_dtype``
    over the model's).

    Args:
        model: The model's attention shape.
        config: Supplies the ``max_attention_window`` pattern and ``kv_cache_dtype``.
        max_seq_len: Longest sequence; full-attention layers get this window.

    Returns:
        Window -> bytes per token, in ascending window order.

    Example:
        Two layers of 8 heads and one of 4, head_dim 128, float16, pattern [1024, 1024, None]:
        window 1024 holds 2 x 8 x 2 x 128 x 2 = 8192 B, the full window 4 x 2 x 128 x 2 = 2048 B.

        >>> m = ModelConfig(num_layers=3, num_kv_heads=[8, 8, 4], head_dim=128)
        >>> bytes_per_token(m, KvCacheConfig(max_attention_window=[1024, 1024, None]), 8192)
        {1024: 8192, 8192: 2048}
        >>> bytes_per_token(m, KvCacheConfig(max_attention_window=[1024, 1024, None],
        ...                                  kv_cache_dtype={"full": "fp8"}), 8192)
        {1024: 8192, 8192: 1024}
    """
    layer_windows = config.attention_window_per_layer(model.num_layers, max_seq_len)
    dtypes = config.kv_dtype_per_layer(model, max_seq_len)
    out = dict.fromkeys(sorted(set(layer_windows)), 0)
    for window, nbytes in zip(layer_windows, model.bytes_per_token_per_layer(dtypes), strict=True):
        out[window] += nbytes
    return out


# --------------------------------------------------------------------------------------
# Shares
# --------------------------------------------------------------------------------------


def resolve_share_policy(
    config_value: str | Sequence[float] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
) -> tuple[SharePolicy, str]:
    """Which share policy applies, and where it came from.

    The first that is set wins: ``config_value`` (``KvCacheConfig.window_size_shares``), the
    environment variable ``KVCACHE_WINDOW_SIZE_SHARES``, ``TRTLLM_WINDOW_SIZE_SHARES``, and
    finally ``"equal"``. Empty environment values count as unset. Environment values are a
    policy name or comma-separated numbers.

    Args:
        config_value: The config field's value (``None`` when unset).
        environ: The environment to read (default ``os.environ``).

    Returns:
        ``(policy, source)``: a policy name or a tuple of raw shares, and a description of
        its source for error messages.

    Raises:
        ValueError: The chosen source holds text that is not a policy or a list of finite,
            non-negative numbers with a positive sum; the message names the source.

    Example:
        >>> resolve_share_policy(None, environ={"TRTLLM_WINDOW_SIZE_SHARES": "0.2, 0.8"})
        ((0.2, 0.8), 'environment variable TRTLLM_WINDOW_SIZE_SHARES')
        >>> resolve_share_policy("auto", environ={"KVCACHE_WINDOW_SIZE_SHARES": "1,1"})
        ('auto', 'KvCacheConfig.window_size_shares')
        >>> resolve_share_policy(None, environ={})
        ('equal', 'default')
    """
    if config_value is not None:
        return _normalise_policy(config_value, _CONFIG_SOURCE), _CONFIG_SOURCE
    env = os.environ if environ is None else environ
    for var in (SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR):
        text = env.get(var)
        if text is not None and text.strip():
            source = f"environment variable {var}"
            return _parse_share_text(source, text), source
    return "equal", "default"


def _normalise_policy(policy: str | Sequence[float], source: str) -> SharePolicy:
    if isinstance(policy, str):
        return _parse_share_text(source, policy)
    return _check_share_values(source, list(policy))


def _share_fractions(
    bpt: Mapping[int, int],
    policy: SharePolicy,
    source: str,
    *,
    max_seq_len: int | None,
    expected_seq_len: int | None,
    tokens_per_block: int,
    max_batch_size: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    primary_bytes: int | None = None,
    max_draft_tokens: int = 0,
) -> dict[int, Fraction]:
    """Exact shares per window (ascending); see :func:`window_size_shares`."""
    windows = sorted(bpt)
    if not windows:
        raise ValueError("bytes_per_token is empty: the model has no windows")
    for w in windows:
        positive_count(f"window {w!r}", w)
        positive_count(f"bytes_per_token[{w}]", bpt[w])
    weights: list[Fraction]
    if isinstance(policy, tuple):
        if len(policy) != len(windows):
            raise ValueError(
                f"{source} gives {len(policy)} share(s) but the model has {len(windows)} "
                f"window(s) {windows}; give one share per window in ascending window order"
            )
        # Through the shortest decimal text, so that 0.1, 0.2, 0.7 are exactly 1:2:7.
        weights = [Fraction(repr(s)) for s in policy]
    elif policy == "equal":
        weights = [Fraction(1)] * len(windows)
    elif policy == "proportional":
        weights = [Fraction(w * bpt[w]) for w in windows]
    elif policy == "auto":
        seq_len = expected_seq_len if expected_seq_len is not None else max_seq_len
        if seq_len is None:
            raise ValueError(
                f'the "auto" share policy ({source}) needs max_seq_len or expected_seq_len'
            )
        positive_count(
            "expected_seq_len" if expected_seq_len is not None else "max_seq_len", seq_len
        )
        tpb = positive_count("tokens_per_block", tokens_per_block)
        draft = non_negative_count("max_draft_tokens", max_draft_tokens)
        if max_batch_size is None:
            weights = _auto_weights_alone(
                bpt, seq_len, tpb, draft, max_num_batched_tokens, primary_bytes
            )
        else:
            demand = auto_demand_tokens(
                windows,
                seq_len,
                tokens_per_block=tpb,
                max_batch_size=max_batch_size,
                max_num_batched_tokens=max_num_batched_tokens,
                max_draft_tokens=draft,
            )
            whole = max_batch_size * tpb * peak_blocks_per_sequence(seq_len, seq_len, tpb)
            weights = _auto_weights(bpt, demand, whole, primary_bytes)
    else:
        raise ValueError(
            f"{source}: unknown share policy {policy!r}; expected one of "
            f"{', '.join(map(repr, SHARE_POLICIES))} or one number per window"
        )
    total = sum(weights, Fraction(0))
    if total <= 0:  # pragma: no cover - excluded by the value checks above
        raise ValueError(f"{source}: shares are all zero; their sum must be positive")
    return {w: x / total for w, x in zip(windows, weights, strict=True)}


def _auto_seq_len(source: str, max_seq_len: int | None, expected_seq_len: int | None) -> int:
    """The sequence length the ``"auto"`` policy sizes for, validated."""
    seq_len = expected_seq_len if expected_seq_len is not None else max_seq_len
    if seq_len is None:
        raise ValueError(
            f'the "auto" share policy ({source}) needs max_seq_len or expected_seq_len'
        )
    return positive_count(
        "expected_seq_len" if expected_seq_len is not None else "max_seq_len", seq_len
    )


def pool_fractions(
    bpt: Mapping[int, int],
    slot_bytes: int,
    policy: SharePolicy,
    source: str,
    *,
    max_seq_len: int | None,
    expected_seq_len: int | None,
    tokens_per_block: int,
    max_batch_size: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    primary_bytes: int | None = None,
    max_draft_tokens: int = 0,
    fixed_slots: int | None = None,
) -> tuple[dict[int, Fraction], Fraction]:
    """Exact shares of the windows (ascending) and of the recurrent state pool, whose slots
    are ``slot_bytes`` each (0: no recurrent layers, the windows' shares alone); see
    :func:`pool_shares`."""
    common: dict[str, Any] = {
        "max_seq_len": max_seq_len,
        "expected_seq_len": expected_seq_len,
        "tokens_per_block": tokens_per_block,
        "max_batch_size": max_batch_size,
        "max_num_batched_tokens": max_num_batched_tokens,
        "max_draft_tokens": max_draft_tokens,
    }
    if slot_bytes == 0:
        shares = _share_fractions(bpt, policy, source, primary_bytes=primary_bytes, **common)
        return shares, Fraction(0)
    windows = sorted(bpt)
    n = len(windows)
    if isinstance(policy, tuple) and len(policy) != n + 1:
        raise ValueError(
            f"{source} gives {len(policy)} share(s) but the model has {n} window(s) {windows} "
            f"and a recurrent state pool: give {n + 1} shares, one per window in ascending "
            "window order and then the state pool's"
        )
    window_policy: SharePolicy = policy[:n] if isinstance(policy, tuple) else policy

    def scaled(rest: int | None, state: Fraction) -> tuple[dict[int, Fraction], Fraction]:
        shares = _share_fractions(bpt, window_policy, source, primary_bytes=rest, **common)
        return {w: f * (1 - state) for w, f in shares.items()}, state

    if fixed_slots is not None:
        # The pool's bytes come first; the windows divide the rest by their own shares.
        reserve = fixed_slots * slot_bytes
        if primary_bytes is None or reserve >= primary_bytes:
            budget = "no primary budget"
            if primary_bytes is not None:
                budget = f"a budget of {format_size(primary_bytes)} ({primary_bytes:,} bytes)"
            raise ValueError(
                f"state_slots = {fixed_slots} needs {format_size(reserve)} ({reserve:,} bytes: "
                f"{fixed_slots} slots of {slot_bytes:,} bytes) of recurrent state, and leaves "
                f"nothing for the attention windows with {budget}"
            )
        return scaled(primary_bytes - reserve, Fraction(reserve, primary_bytes))
    weights: list[Fraction]
    if isinstance(policy, tuple):
        weights = [Fraction(repr(x)) for x in policy]
    elif policy == "equal":
        weights = [Fraction(1)] * (n + 1)
    elif policy == "proportional":
        weights = [Fraction(w * bpt[w]) for w in windows] + [Fraction(2 * slot_bytes)]
    elif policy == "auto":
        seq_len = _auto_seq_len(source, max_seq_len, expected_seq_len)
        tpb = positive_count("tokens_per_block", tokens_per_block)
        draft = non_negative_count("max_draft_tokens", max_draft_tokens)
        if max_batch_size is None:
            for w in windows:
                positive_count(f"window {w!r}", w)
                positive_count(f"bytes_per_token[{w}]", bpt[w])
            weights = _auto_weights_alone(
                bpt, seq_len, tpb, draft, max_num_batched_tokens, primary_bytes, 2 * slot_bytes
            )
        else:
            reserve = 2 * positive_count("max_batch_size", max_batch_size) * slot_bytes
            if primary_bytes is not None and reserve < primary_bytes:
                return scaled(primary_bytes - reserve, Fraction(reserve, primary_bytes))
            # No budget, or not even the state's: every pool runs out at the same concurrency.
            demand = auto_demand_tokens(
                windows,
                seq_len,
                tokens_per_block=tpb,
                max_batch_size=max_batch_size,
                max_num_batched_tokens=max_num_batched_tokens,
                max_draft_tokens=draft,
            )
            weights = [Fraction(demand[w] * bpt[w]) for w in windows] + [Fraction(reserve)]
    else:
        return scaled(primary_bytes, Fraction(0))  # raises: unknown policy
    total = sum(weights, Fraction(0))
    if total <= 0:  # pragma: no cover - excluded by the value checks
        raise ValueError(f"{source}: shares are all zero; their sum must be positive")
    for w in windows:
        positive_count(f"window {w!r}", w)
        positive_count(f"bytes_per_token[{w}]", bpt[w])
    return {w: x / total for w, x in zip(windows, weights, strict=False)}, weights[n] / total


def peak_blocks_per_sequence(
    seq_len: int,
    window: int,
    tokens_per_block: int,
    *,
    max_draft_tokens: int = 0,
    chunk_size: int | None = None,
) -> int:
    """Most blocks one sequence whose prompt is ``seq_len`` tokens holds in a window at any
    point of its life, prefilled in chunks of at most ``chunk_size`` tokens (``None``: whole),
    with nothing reused: what the manager needs free in that window to admit and run it
    alone. The native core computes it (``kvcache._core.blocks_to_run_alone``),
    with the rule its ``add_sequence``, ``prefill`` and ``add_tokens`` follow.

    A sliding window holds at most ``ceil((K + C - 1) / tokens_per_block) + 1`` blocks while
    chunks of ``C`` tokens are prefilled (``K = window + max_draft_tokens``), and the whole
    prompt when it is prefilled in one chunk; full attention holds the whole sequence.

    Args:
        seq_len: Tokens of the prompt (> 0).
        window: Attention window (> 0; ``>= seq_len``: nothing is released).
        tokens_per_block: Block size (> 0).
        max_draft_tokens: Draft tokens the window keeps beyond it (>= 0).
        chunk_size: Largest prefill chunk (> 0), ``None`` for whole prompts.

    Returns:
        The block count.

    Example:
        A 131,072-token prompt, window 128, 32-token blocks: 261 blocks in chunks of 8,192
        tokens (``ceil((128 + 8192 - 1) / 32) + 1``), all 4,096 when prefilled whole.

        >>> peak_blocks_per_sequence(131072, 128, 32, chunk_size=8192)
        261
        >>> peak_blocks_per_sequence(131072, 128, 32)
        4096
    """
    n = positive_count("seq_len", seq_len)
    w = positive_count("window", window)
    tpb = positive_count("tokens_per_block", tokens_per_block)
    draft = non_negative_count("max_draft_tokens", max_draft_tokens)
    chunk = None if chunk_size is None else positive_count("chunk_size", chunk_size)
    keep = _block_math.window_keep(w, draft, n + 1) if w < n else _block_math.KEEP_ALL
    return int(_block_math.blocks_to_run_alone(n, n, chunk, w, keep, tpb))


def _auto_weights_alone(
    bpt: Mapping[int, int],
    seq_len: int,
    tpb: int,
    draft: int,
    chunk: int,
    primary_bytes: int | None,
    state_bytes: int = 0,
) -> list[Fraction]:
    """``"auto"`` without ``max_batch_size``: ``n`` sequences of ``seq_len`` tokens need
    ``peak + (n - 1) * live`` blocks of a window (one prefilling in chunks of ``chunk``
    tokens, :func:`peak_blocks_per_sequence`; the others decoding,
    :func:`max_blocks_per_sequence`). With ``primary_bytes`` the shares give every window the
    same ``n``, so no window is short of one sequence's prefill; without it, or when the
    budget holds less than one peak per window, in proportion to ``live`` (or the peaks).

    ``state_bytes`` > 0 adds the recurrent state pool as a last entry that needs
    ``state_bytes`` per sequence, peak and live alike."""
    windows = sorted(bpt)
    live = [max_blocks_per_sequence(seq_len, w, tpb, draft) * tpb * bpt[w] for w in windows]
    if state_bytes > 0:
        live.append(state_bytes)
    if primary_bytes is None:
        return [Fraction(x) for x in live]
    peak = [
        peak_blocks_per_sequence(seq_len, w, tpb, max_draft_tokens=draft, chunk_size=chunk)
        * tpb
        * bpt[w]
        for w in windows
    ]
    if state_bytes > 0:
        peak.append(state_bytes)
    extra = Fraction(primary_bytes - sum(peak), sum(live))  # sequences beyond the first
    if extra <= 0:
        return [Fraction(x) for x in peak]
    return [p + extra * x for p, x in zip(peak, live, strict=True)]


def auto_demand_tokens(
    windows: Sequence[int],
    seq_len: int,
    *,
    tokens_per_block: int,
    max_batch_size: int,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_draft_tokens: int = 0,
) -> dict[int, int]:
    """Tokens of live blocks each window needs with ``max_batch_size`` sequences running
    under chunked prefill; the demand that the ``"auto"`` policy sizes for.

    ``demand[w] = t * min(floor((n * (w + D + 2t - 2) + B) / t), n * ceil(L / t))`` with
    ``t = tokens_per_block``, ``n = max_batch_size``, ``D = max_draft_tokens``,
    ``B = max_num_batched_tokens`` and ``L = seq_len``. A sliding window keeps the last
    ``K = w + D`` tokens of a sequence (drafts may be rewound), and ``K`` tokens that do not
    start at a block boundary straddle one more block: a decoding sequence holds at most
    ``ceil((K - 1) / t) + 1`` blocks (never more than ``ceil(K / t) + 1``). A sequence in
    prefill holds its chunk of ``C`` tokens on top, at most ``ceil((K + C - 1) / t) + 1``
    blocks; the chunks of one step add up to at most ``B`` tokens, so summed over the
    sequences, rounding included, the blocks stay below ``(n * (K + 2t - 2) + B) / t``. No
    window holds more than the whole sequence, ``ceil(L / t)`` blocks each: that is the
    demand of full attention (``w >= L``). For sliding windows this is an upper bound; for
    full attention an estimate (sequences of the typical length ``L``; long ones running
    together can exceed it, shared prefixes lower it).

    Args:
        windows: The windows, ascending.
        seq_len: Typical sequence length ``L`` (prompt plus output).
        tokens_per_block: Block size.
        max_batch_size: Most sequences running at once.
        max_num_batched_tokens: Token budget of one engine step (decodes and prefill chunks).
        max_draft_tokens: Draft tokens a sliding window keeps beyond the window.

    Returns:
        Window -> tokens (whole blocks), ascending window order.

    Raises:
        ValueError: An argument is not a positive int (``max_draft_tokens``: non-negative).

    Example:
        128 sequences of 2,818 tokens, a 512-token window, 32-token blocks, 8,192 tokens a step:
        the window holds (128 x (512 + 62) + 8192) / 32 = 2,552 blocks, full attention
        128 x ceil(2818 / 32) = 11,392 blocks.

        >>> auto_demand_tokens([512, 4496], 2818, tokens_per_block=32, max_batch_size=128)
        {512: 81664, 4496: 364544}
    """
    seq = positive_count("expected_seq_len", seq_len)
    tpb = positive_count("tokens_per_block", tokens_per_block)
    n = positive_count("max_batch_size", max_batch_size)
    step = positive_count("max_num_batched_tokens", max_num_batched_tokens)
    draft = non_negative_count("max_draft_tokens", max_draft_tokens)
    out = {}
    for w in windows:
        keep = positive_count("window", w) + draft
        out[w] = tpb * int(_block_math.demand_blocks(n, seq, keep, step, tpb))
    return out


def _auto_weights(
    bpt: Mapping[int, int],
    demand: Mapping[int, int],
    whole_tokens: int,
    primary_bytes: int | None,
) -> list[Fraction]:
    """Bytes per window: the demand, plus the budget left over split over the sliding
    windows (demand below ``whole_tokens``, all sequences whole) in proportion to their
    bytes per token, so that each gets the same tokens of room."""
    need = {w: Fraction(demand[w] * bpt[w]) for w in demand}
    total = sum(need.values(), Fraction(0))
    sliding = [w for w in demand if demand[w] < whole_tokens]
    if primary_bytes is None or primary_bytes <= total or not sliding:
        return list(need.values())
    spare = primary_bytes - total
    sliding_bpt = sum(bpt[w] for w in sliding)
    for w in sliding:
        need[w] += spare * bpt[w] / sliding_bpt
    return list(need.values())


def window_size_shares(
    bytes_per_token: Mapping[int, int],
    policy: str | Sequence[float] | None = None,
    *,
    max_seq_len: int | None = None,
    expected_seq_len: int | None = None,
    tokens_per_block: int = 32,
    max_batch_size: int | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    primary_bytes: int | None = None,
    max_draft_tokens: int = 0,
) -> dict[int, float]:
    """Fraction of the memory budget given to each attention window; sums to 1.0.

    Policies:

    * ``"equal"``: ``1/n`` for each of the ``n`` windows (the default).
    * ``"proportional"``: share ∝ ``window * bytes_per_token[window]``, the bytes one
      full-length sequence would occupy if nothing were released.
    * ``"auto"``, sized from demand under chunked prefill, with ``L = expected_seq_len or
      max_seq_len``:

      - with ``max_batch_size``: each window first gets the bytes of its demand
        (:func:`auto_demand_tokens`: about ``n * (window + D + 2 * tokens_per_block) + B``
        tokens, at most ``n * L``, with ``n = max_batch_size``, ``B =
        max_num_batched_tokens``, ``D = max_draft_tokens``, counting the block a window
        straddles at a block boundary). What
        ``primary_bytes`` holds beyond that goes to the sliding windows (those that hold
        less than the whole sequence), the same number of tokens to each: running
        sequences keep the prefixes they share alive in a full-attention window, but
        release them from a sliding window once the prefill passed them, so a sliding
        window keeps a cached prefix only in free blocks. Without ``primary_bytes``, or when
        it does not cover the demand, shares ∝ demand: every window runs out at the same
        concurrency.
      - without ``max_batch_size``: share ∝ ``min(ceil((window + D - 1) /
        tokens_per_block) + 1, ceil(L / tokens_per_block)) * tokens_per_block *
        bytes_per_token[window]``, the bytes one decoding sequence keeps live (the window,
        its drafts and the block it straddles), so every window runs out at the same
        concurrency.
    * a sequence of numbers (or comma-separated text): one share per window in ascending
      window order, normalised to sum 1.

    With ``policy=None`` the environment decides (see :func:`resolve_share_policy`).

    Args:
        bytes_per_token: Window -> bytes per token (see :func:`bytes_per_token`).
        policy: A policy name, a list of shares, or ``None`` for the environment/default.
        max_seq_len: Sequence length for ``"auto"`` when ``expected_seq_len`` is not given.
        expected_seq_len: Typical sequence length for ``"auto"``.
        tokens_per_block: Block size, used by ``"auto"``.
        max_batch_size: Most sequences running at once, used by ``"auto"``.
        max_num_batched_tokens: Tokens of one engine step, used by ``"auto"`` with
            ``max_batch_size``.
        primary_bytes: The budget the shares divide, used by ``"auto"`` with
            ``max_batch_size``.
        max_draft_tokens: Draft tokens sliding windows keep beyond the window, used by
            ``"auto"``.

    Returns:
        Window -> share, ascending window order, summing to 1.0.

    Raises:
        ValueError: Unknown policy; a share list of the wrong length, or with a negative,
            NaN, infinite or non-numeric entry, or all zeros; ``"auto"`` without a length,
            or with a ``max_batch_size``, ``max_num_batched_tokens`` or ``primary_bytes``
            that is not a positive int. The message names the source (argument or
            environment variable).

    Example:
        Windows {1024, 4096, 8192} with equal bytes per token, "proportional":
        1024 : 4096 : 8192 = 1 : 4 : 8, so 1/13, 4/13 and 8/13.

        >>> shares = window_size_shares({1024: 10, 4096: 10, 8192: 10}, "proportional")
        >>> [round(s, 4) for s in shares.values()]
        [0.0769, 0.3077, 0.6154]
        >>> window_size_shares({1024: 10, 4096: 10, 8192: 10}, "equal")[4096] == 1 / 3
        True

        "auto" for a Gemma-3-27B shape at 32,768 tokens (52 sliding layers of window 1024,
        10 full layers, 8192 B per layer and token, 32-token blocks): the sliding window
        keeps (1024 + 32) x 52 x 8192 B per sequence live, the full one 32768 x 10 x 8192 B,
        so the full window gets 327680 / (54912 + 327680) ≈ 85.6 %.

        >>> s = window_size_shares({1024: 425984, 32768: 81920}, "auto", max_seq_len=32768)
        >>> round(s[32768], 4)
        0.8565

        From demand: windows {512, full} with 4096 B per token each, 128 sequences of 2,818
        tokens, 8,192 tokens a step and 20,000 blocks of 32 tokens: full attention gets its
        128 x ceil(2818 / 32) = 11,392 blocks, the sliding window the other 8,608 blocks.

        >>> s = window_size_shares({512: 4096, 4496: 4096}, "auto", expected_seq_len=2818,
        ...                        max_batch_size=128, primary_bytes=20000 * 32 * 4096)
        >>> round(s[4496] * 20000, 6), round(s[512] * 20000, 6)
        (11392.0, 8608.0)
    """
    if policy is None:
        resolved, source = resolve_share_policy(None)
    else:
        source = "policy argument"
        resolved = _normalise_policy(policy, source)
    if primary_bytes is not None:
        positive_count("primary_bytes", primary_bytes)
    fractions = _share_fractions(
        bytes_per_token,
        resolved,
        source,
        max_seq_len=max_seq_len,
        expected_seq_len=expected_seq_len,
        tokens_per_block=tokens_per_block,
        max_batch_size=max_batch_size,
        max_num_batched_tokens=max_num_batched_tokens,
        primary_bytes=primary_bytes,
        max_draft_tokens=max_draft_tokens,
    )
    return {w: float(f) for w, f in fractions.items()}


def pool_shares(
    model: ModelConfig,
    config: KvCacheConfig,
    max_seq_len: int,
    *,
    primary_bytes: int | None = None,
    expected_seq_len: int | None = None,
    max_batch_size: int | None = None,
    max_draft_tokens: int = 0,
) -> tuple[dict[int, float], float]:
    """Shares of the memory budget of each attention window and of the recurrent state pool.

    The policy is ``config.window_size_shares``, else ``KVCACHE_WINDOW_SIZE_SHARES``, else
    ``TRTLLM_WINDOW_SIZE_SHARES``, else ``"equal"`` (:func:`resolve_share_policy`). For an
    attention-only model the state share is 0 and the windows' shares are those of
    :func:`window_size_shares`. For a model with recurrent layers the state pool is one more
    pool after the windows, its slots ``S = model.state_bytes_per_sequence()`` bytes each:

    * ``"equal"``: ``1/(n+1)`` for each of the ``n`` windows and the state pool.
    * ``"proportional"``: windows ∝ ``window * bytes_per_token[window]`` as without state,
      the state pool ∝ ``2 * S``: what one full-length sequence occupies in each pool, its
      state counted twice (its working slot and the checkpoint it is resumed from).
    * ``"auto"``: with ``max_batch_size`` the state pool first gets ``2 * max_batch_size * S``
      bytes (a working slot and one checkpoint per running sequence) and the windows share the
      rest of ``primary_bytes`` as :func:`window_size_shares` shares a budget; without
      ``primary_bytes``, or when it holds no more than the state's bytes, every pool ∝ its
      demand. Without ``max_batch_size`` the state pool is one more pool needing ``2 * S``
      bytes per sequence, so every pool holds the same number of sequences.
    * numbers: ``n + 1`` of them, one per window in ascending window order and then the
      state pool's (``ValueError`` naming the expected count otherwise).

    With ``config.state_slots`` set, the pool's ``state_slots * S`` bytes come first and the
    windows divide the rest of ``primary_bytes`` by their own shares (a number list still has
    ``n + 1`` entries; the state pool's is not used).

    Args:
        model: The model (windows, bytes per token, recurrent state).
        config: Shares, window pattern, block size, ``max_num_batched_tokens``,
            ``state_slots``.
        max_seq_len: Longest sequence; full-attention layers get this window.
        primary_bytes: The budget the shares divide (``"auto"``, ``state_slots``).
        expected_seq_len: Typical sequence length for ``"auto"`` (default
            ``config.expected_seq_len``, else ``max_seq_len``).
        max_batch_size: Most sequences running at once, used by ``"auto"``.
        max_draft_tokens: Draft tokens sliding windows keep beyond the window (``"auto"``).

    Returns:
        ``(window -> share in ascending window order, state pool share)``, summing to 1.0.

    Raises:
        ValueError: As :func:`window_size_shares`; a number list of the wrong length; a
            ``state_slots`` whose bytes do not leave room for the windows.

    Example:
        Qwen3.5-9B's shape (8 full-attention layers of 4 KV heads x 256, bfloat16; 24 Gated
        DeltaNet layers of 2,146,304 B, so 51,511,296 B per slot), 16 GiB, 32 sequences:
        "equal" halves the budget; "auto" gives the state 64 slots (3.07 GiB) first.

        >>> from kvcache.models import load_model
        >>> p = load_model("qwen3.5-9b")
        >>> pool_shares(p.model, p.kv_cache_config(window_size_shares="equal"), 32768)
        ({32768: 0.5}, 0.5)
        >>> w, state = pool_shares(p.model, p.kv_cache_config(window_size_shares="auto"), 32768,
        ...                        primary_bytes=16 * 2**30, max_batch_size=32)
        >>> round(state * 16 * 2**30 / p.model.state_bytes_per_sequence())
        64
    """
    if primary_bytes is not None:
        positive_count("primary_bytes", primary_bytes)
    windows, state = model_pool_fractions(
        model,
        config,
        max_seq_len,
        primary_bytes,
        expected_seq_len,
        max_batch_size,
        max_draft_tokens,
    )
    return {w: float(f) for w, f in windows.items()}, float(state)


def model_pool_fractions(
    model: ModelConfig,
    config: KvCacheConfig,
    max_seq_len: int,
    primary_bytes: int | None,
    expected_seq_len: int | None,
    max_batch_size: int | None,
    max_draft_tokens: int,
) -> tuple[dict[int, Fraction], Fraction]:
    """Exact :func:`pool_shares` (``primary_bytes`` 0 or ``None``: no budget)."""
    policy, source = resolve_share_policy(config.window_size_shares)
    return pool_fractions(
        bytes_per_token(model, config, max_seq_len),
        model.state_bytes_per_sequence(),
        policy,
        source,
        max_seq_len=max_seq_len,
        expected_seq_len=expected_seq_len
        if expected_seq_len is not None
        else config.expected_seq_len,
        tokens_per_block=config.tokens_per_block,
        max_batch_size=max_batch_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        primary_bytes=primary_bytes or None,
        max_draft_tokens=max_draft_tokens,
        fixed_slots=config.state_slots if model.recurrent_layers > 0 else None,
    )


def max_blocks_per_sequence(
    seq_len: int, window: int, tokens_per_block: int, max_draft_tokens: int = 0
) -> int:
    """Blocks one sequence of ``seq_len`` tokens needs at most in a window while decoding.

    A window keeps the last ``K = window + max_draft_tokens`` tokens. When the sequence fits
    (``seq_len <= K``, always for full attention) it needs ``ceil(seq_len / tokens_per_block)``.
    Otherwise ``K`` tokens that do not start at a block boundary straddle one more block:
    ``ceil((K - 1) / tokens_per_block) + 1`` (at most ``ceil(K / tokens_per_block) + 1``, one
    less when ``K`` is one past a block boundary), never more than the whole sequence.

    Args:
        seq_len: Tokens in the sequence (> 0).
        window: Attention window (> 0).
        tokens_per_block: Block size (> 0).
        max_draft_tokens: Draft tokens the window keeps beyond it (>= 0).

    Returns:
        The block count.

    Example:
        >>> max_blocks_per_sequence(512, 1024, 64), max_blocks_per_sequence(513, 1024, 64)
        (8, 9)
        >>> max_blocks_per_sequence(512, 256, 64), max_blocks_per_sequence(512, 257, 64)
        (5, 5)
        >>> max_blocks_per_sequence(512, 258, 64), max_blocks_per_sequence(512, 256, 64, 2)
        (6, 6)
    """
    n = positive_count("seq_len", seq_len)
    keep = positive_count("window", window) + non_negative_count(
        "max_draft_tokens", max_draft_tokens
    )
    tpb = positive_count("tokens_per_block", tokens_per_block)
    return int(_block_math.peak_live_blocks(1, n, keep, tpb))
