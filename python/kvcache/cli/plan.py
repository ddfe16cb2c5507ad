"""``kvcache plan``'s computation and rendering: per window and share policy, the blocks,
concurrency and what limits them (the command line is :mod:`kvcache.cli.commands`)."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from kvcache.cache.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SHARE_POLICIES,
    KvCacheConfig,
    ModelConfig,
)
from kvcache.cache.sizing import (
    blocks_per_window,
    bytes_per_token,
    format_size,
    max_blocks_per_sequence,
    peak_blocks_per_sequence,
)
from kvcache.models import ModelPreset

__all__ = [
    "DEFAULT_TOKENS_PER_BLOCK",
    "PlanRow",
    "PolicyPlan",
    "joined",
    "make_plan",
    "one_sequence",
    "plan_json",
    "render_plan",
    "too_small",
]

#: ``--tokens-per-block``'s default.
DEFAULT_TOKENS_PER_BLOCK = 32


@dataclass(frozen=True)
class PlanRow:
    """One window under one share policy."""

    window: int
    layers: int
    bytes_per_token: int
    share: float
    blocks: int
    tokens: int
    blocks_per_sequence: int
    max_sequences: int
    dtype: str = ""
    """The window's KV dtype(s), ``/``-separated when its layers differ (``bfloat16/fp8``)."""
    head_dim: str = ""
    """The window's head size(s), ``/``-separated when its layers differ (``256/512``)."""
    saved_per_sequence: int = 0
    """Bytes one sequence saves in this window by its dtype choice, against the model's own
    dtypes (``blocks_per_sequence x tokens_per_block x`` the bytes per token saved)."""
    peak_blocks: int = 0
    """Most blocks one ``max_seq_len``-token prompt holds in this window at any point, its
    prefill chunks included (:func:`kvcache.sizing.peak_blocks_per_sequence`): a window with
    fewer blocks rejects such a prompt."""
    limited_by: str = ""
    """What sets ``peak_blocks``: ``"window"`` (the window and drafts), ``"chunk"`` (the
    largest prefill chunk), or ``"sequence"`` (the whole sequence is held)."""


@dataclass(frozen=True)
class PolicyPlan:
    """Every window under one share policy, and the concurrency it allows."""

    policy: str
    rows: tuple[PlanRow, ...]
    max_sequences: int
    limiting_window: int
    source: str = ""
    """Where the policy came from when not from the command line (an environment variable)."""
    model_dtype_max_sequences: int | None = None
    """With ``kv_cache_dtype``: the concurrency of the same policy at the model's own dtypes."""


def make_plan(
    preset: ModelPreset,
    memory_bytes: int,
    max_seq_len: int,
    *,
    tokens_per_block: int = 32,
    policies: Sequence[str | Sequence[float]] = SHARE_POLICIES,
    kv_cache_dtype: str | Mapping[int | str | None, str] | None = None,
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    max_chunk_size: int | None = None,
    chunked_prefill: bool = True,
    max_draft_tokens: int = 0,
) -> dict[str, Any]:
    """Blocks, tokens and maximum concurrent sequences per window under each share policy.

    A sequence of ``max_seq_len`` tokens holds
    :func:`kvcache.sizing.max_blocks_per_sequence` blocks of each window while it decodes,
    and at most :func:`kvcache.sizing.peak_blocks_per_sequence` (``peak_blocks``) at any
    point, its prompt prefilled in chunks as the scheduler cuts them: at most
    ``min(max_chunk_size, max_num_batched_tokens)`` tokens (whole prompts without
    ``chunked_prefill``). A window with fewer blocks than that peak rejects such a prompt, so
    the concurrency of a policy is, over windows, the minimum of ``0`` if ``blocks <
    peak_blocks`` else ``1 + (blocks - peak_blocks) // blocks_per_sequence`` (one sequence
    prefilling, the others decoding). The ``"auto"`` policy gives every window at least its
    peak. The same budget with every layer at full attention is given as the baseline. Each
    row shows the window's dtype and head size; with ``kv_cache_dtype`` (see
    :attr:`KvCacheConfig.kv_cache_dtype`) each row also says what one sequence saves in that
    window against the model's own dtypes, and each policy the concurrency it had at them.

    Args:
        preset: The model.
        memory_bytes: Primary memory budget.
        max_seq_len: Sequence length to plan for.
        tokens_per_block: Block size.
        policies: Share policies to compare (names or per-window share lists).
        kv_cache_dtype: KV dtype per window kind or window size, overriding the model's.
        max_num_batched_tokens: Tokens per engine step (the scheduler's default: 8,192).
        max_chunk_size: Most tokens of one prefill chunk (``None``: the step's budget).
        chunked_prefill: Prompts prefilled in chunks (default) or whole.
        max_draft_tokens: Draft tokens sliding windows keep beyond the window.

    Returns:
        ``{"policies": [PolicyPlan, ...], "full_attention": PolicyPlan, "model": preset,
        "memory_bytes": ..., "max_seq_len": ..., "tokens_per_block": ...,
        "kv_cache_dtype": ...}``.

    Raises:
        ValueError: Bad shares, a bad ``kv_cache_dtype`` or a budget too small for one block
            per window.

    Example:
        >>> plan = make_plan(load_model("gemma-3-27b"), 80 * 2**30, 32768)
        >>> [(p.policy, p.max_sequences) for p in plan["policies"]]
        [('equal', 16), ('proportional', 18), ('auto', 26)]
        >>> plan["full_attention"].max_sequences
        5
    """
    caps = [c for c in (max_chunk_size, max_num_batched_tokens) if c is not None]
    chunk = min(caps) if chunked_prefill else None
    settings = _PlanSettings(max_seq_len, chunk, max_draft_tokens, chunked_prefill)
    out: list[PolicyPlan] = []
    for policy in policies:
        name = policy if isinstance(policy, str) else ",".join(f"{s:g}" for s in policy)
        config = preset.kv_cache_config(
            tokens_per_block=tokens_per_block,
            window_size_shares=policy,
            kv_cache_dtype=kv_cache_dtype,
        )
        config = dataclasses.replace(config, max_num_batched_tokens=chunk or max_seq_len)
        plan = _policy_plan(preset, config, name, memory_bytes, settings)
        if kv_cache_dtype is not None:
            own = dataclasses.replace(config, kv_cache_dtype=None)
            at_model = _policy_plan(preset, own, name, memory_bytes, settings)
            plan = dataclasses.replace(plan, model_dtype_max_sequences=at_model.max_sequences)
        out.append(plan)
    # One window: the share is 1 whatever the policy; "equal" keeps the environment out. A
    # window-size dtype key names a sliding window this baseline does not have: kinds only.
    full = KvCacheConfig(
        tokens_per_block=tokens_per_block,
        window_size_shares="equal",
        kv_cache_dtype=_full_attention_dtype(kv_cache_dtype),
    )
    baseline = _policy_plan(preset, full, "all layers full attention", memory_bytes, settings)
    return {
        "model": preset,
        "memory_bytes": memory_bytes,
        "max_seq_len": max_seq_len,
        "tokens_per_block": tokens_per_block,
        "policies": out,
        "full_attention": baseline,
        "kv_cache_dtype": _dtype_text(kv_cache_dtype),
        "chunk_size": chunk,
        "max_draft_tokens": max_draft_tokens,
    }


@dataclass(frozen=True)
class _PlanSettings:
    """What a plan's per-sequence block counts depend on besides the window."""

    max_seq_len: int
    chunk: int | None
    max_draft_tokens: int
    chunked_prefill: bool


def _full_attention_dtype(
    choice: str | Mapping[int | str | None, str] | None,
) -> str | None:
    """The dtype the all-full-attention baseline takes from a ``kv_cache_dtype`` choice."""
    if choice is None or isinstance(choice, str):
        return choice
    for key in (None, "full"):
        if key in choice:
            return choice[key]
    return None


def _dtype_text(choice: str | Mapping[int | str | None, str] | None) -> str | None:
    if choice is None or isinstance(choice, str):
        return choice
    return ",".join(f"{'full' if k is None else k}={v}" for k, v in choice.items())


def joined(values: Sequence[object]) -> str:
    """Distinct values in first-seen order, ``/``-separated."""
    return "/".join(str(v) for v in dict.fromkeys(values))


def _policy_plan(
    preset: ModelPreset, config: KvCacheConfig, name: str, memory: int, settings: _PlanSettings
) -> PolicyPlan:
    tpb = config.tokens_per_block
    model = preset.model
    max_seq_len = settings.max_seq_len
    drafts = settings.max_draft_tokens
    bpt = bytes_per_token(model, config, max_seq_len)
    try:
        blocks = blocks_per_window(model, config, max_seq_len, memory, max_draft_tokens=drafts)
    except ValueError:
        if len(bpt) > 1 or memory >= next(iter(bpt.values())) * tpb:
            raise
        blocks = {w: (0, 0) for w in bpt}  # the all-full-attention baseline holds no block
    layer_windows = config.attention_window_per_layer(model.num_layers, max_seq_len)
    dtypes = config.kv_dtype_per_layer(model, max_seq_len)
    own_bpt = bytes_per_token(model, dataclasses.replace(config, kv_cache_dtype=None), max_seq_len)
    head_dims = model.head_dim_per_layer()
    total_bytes = max(1, sum(blocks[w][0] * bpt[w] * tpb for w in blocks))
    rows = []
    for w, (primary, _) in blocks.items():
        per_seq = max_blocks_per_sequence(max_seq_len, w, tpb, drafts)
        peak = peak_blocks_per_sequence(
            max_seq_len, w, tpb, max_draft_tokens=drafts, chunk_size=settings.chunk
        )
        whole = peak_blocks_per_sequence(max_seq_len, max_seq_len, tpb)
        limited_by = "sequence" if peak >= whole else "chunk" if peak > per_seq else "window"
        layers = [i for i, lw in enumerate(layer_windows) if lw == w]
        rows.append(
            PlanRow(
                window=w,
                layers=len(layers),
                bytes_per_token=bpt[w],
                share=primary * bpt[w] * tpb / total_bytes,
                blocks=primary,
                tokens=primary * tpb,
                blocks_per_sequence=per_seq,
                max_sequences=0 if primary < peak else 1 + (primary - peak) // per_seq,
                dtype=joined([dtypes[i] for i in layers]),
                head_dim=joined([head_dims[i] for i in layers]),
                saved_per_sequence=per_seq * tpb * (own_bpt[w] - bpt[w]),
                peak_blocks=peak,
                limited_by=limited_by,
            )
        )
    limiting = min(rows, key=lambda r: (r.max_sequences, r.window))
    return PolicyPlan(name, tuple(rows), limiting.max_sequences, limiting.window)


def render_plan(plan: dict[str, Any], out: TextIO) -> None:
    preset: ModelPreset = plan["model"]
    m = preset.model
    n = plan["max_seq_len"]
    print(
        f"{preset.name}: {m.num_layers} layers, {_shape_text(m)}; windows: "
        f"{preset.window_pattern_text()}; max context {preset.max_context:,}",
        file=out,
    )
    choice = plan.get("kv_cache_dtype")
    print(
        f"primary memory {format_size(plan['memory_bytes'])} ({plan['memory_bytes']:,} B), "
        f"tokens_per_block {plan['tokens_per_block']}, sequences of {n:,} tokens"
        + (f", KV dtype {choice}" if choice else ""),
        file=out,
    )
    if n > preset.max_context:
        print(f"note: {n:,} tokens exceed the model's context of {preset.max_context:,}", file=out)
    header = (
        f"  {'window':>7} {'layers':>6} {'dtype':>14} {'head':>7} {'B/token':>10} {'share':>7} "
        f"{'blocks':>10} {'tokens':>13} {'blk/seq':>8} {'peak/seq':>9} {'set by':>8} "
        f"{'max seqs':>9}" + (f" {'saves/seq':>10}" if choice else "")
    )
    baseline: PolicyPlan = plan["full_attention"]
    for p, title in _distinct_tables(plan["policies"], baseline):
        print(file=out)
        print(title, file=out)
        print(header, file=out)
        for r in p.rows:
            print(
                f"  {r.window:>7,} {r.layers:>6} {r.dtype:>14} {r.head_dim:>7} "
                f"{r.bytes_per_token:>10,} {r.share:>7.1%} "
                f"{r.blocks:>10,} {r.tokens:>13,} {r.blocks_per_sequence:>8,} "
                f"{r.peak_blocks:>9,} {r.limited_by:>8} {r.max_sequences:>9,}"
                + (f" {format_size(r.saved_per_sequence):>10}" if choice else ""),
                file=out,
            )
        if p.max_sequences:
            print(
                f"  -> at most {p.max_sequences:,} concurrent sequences of {n:,} tokens "
                f"(limited by window {p.limiting_window:,})",
                file=out,
            )
        else:
            short = next(r for r in p.rows if r.window == p.limiting_window)
            print(
                f"  -> fits no sequence of {n:,} tokens: window {short.window:,} has "
                f"{short.blocks:,} blocks, one {n:,}-token prompt needs {short.peak_blocks:,} "
                f"(set by the {short.limited_by})",
                file=out,
            )
    print(file=out)
    chunk = plan.get("chunk_size")
    how = f"in chunks of at most {chunk:,} tokens" if chunk else "whole (no chunked prefill)"
    print(
        f"note: blk/seq is what a {n:,}-token sequence holds while decoding; peak/seq the most\n"
        f"      it holds, its prompt prefilled {how}\n"
        "      (set by: the window, the chunk or the whole sequence). max seqs: one sequence\n"
        "      at its peak, the others decoding.",
        file=out,
    )
    print(file=out)
    print("summary (max concurrent sequences):", file=out)
    for p in plan["policies"]:
        gain = (
            f"{p.max_sequences / baseline.max_sequences:.2f}x"
            if baseline.max_sequences
            else "n/a (full attention fits none)"
        )
        own = (
            f"; at the model's dtypes {p.model_dtype_max_sequences:,}"
            if p.model_dtype_max_sequences is not None
            else ""
        )
        print(
            f"  {p.policy:<14} {p.max_sequences:>8,}   vs all-full-attention: {gain}{own}",
            file=out,
        )
    print(f"  {'full attention':<14} {baseline.max_sequences:>8,}", file=out)


def _distinct_tables(
    policies: Sequence[PolicyPlan], baseline: PolicyPlan
) -> list[tuple[PolicyPlan, str]]:
    """The tables to print, each with its title: one per policy and the baseline, except that
    with one window (every policy gives it the whole budget) the policies' identical tables
    are printed once under all their names, together with the baseline's when it is the same
    too (a model whose layers are all full attention)."""

    def name(p: PolicyPlan) -> str:
        return p.policy + (f" (from {p.source})" if p.source else "")

    if len({p.rows for p in policies}) > 1 or len(policies[0].rows) > 1:
        return [(p, f"{name(p)}:") for p in [*policies, baseline]]
    same = [*policies, baseline] if baseline.rows == policies[0].rows else list(policies)
    tables = [(same[-1], f"{', '.join(map(name, same))} (one window: the whole budget):")]
    if len(same) == len(policies):
        tables.append((baseline, f"{name(baseline)}:"))
    return tables


def _shape_text(m: ModelConfig) -> str:
    """``16 KV heads x 128, bfloat16``, or per window kind where the layers differ."""
    heads, dims, dtypes = m.kv_heads_per_layer(), m.head_dim_per_layer(), m.dtype_per_layer()
    shapes = joined([f"{h} KV heads x {d}" for h, d in zip(heads, dims, strict=True)])
    return f"{shapes.replace('/', ' or ')}, {joined(dtypes)}"


def plan_json(plan: dict[str, Any]) -> dict[str, Any]:
    def policy(p: PolicyPlan) -> dict[str, Any]:
        return {
            "policy": p.policy,
            "source": p.source or None,
            "max_sequences": p.max_sequences,
            "limiting_window": p.limiting_window,
            "model_dtype_max_sequences": p.model_dtype_max_sequences,
            "windows": [vars(r) for r in p.rows],
        }

    return {
        "model": plan["model"].name,
        "memory_bytes": plan["memory_bytes"],
        "max_seq_len": plan["max_seq_len"],
        "tokens_per_block": plan["tokens_per_block"],
        "kv_cache_dtype": plan.get("kv_cache_dtype"),
        "chunk_size": plan.get("chunk_size"),
        "max_draft_tokens": plan.get("max_draft_tokens"),
        "policies": [policy(p) for p in plan["policies"]],
        "full_attention": policy(plan["full_attention"]),
    }


def one_sequence(
    preset: ModelPreset,
    max_seq_len: int,
    tpb: int,
    kv_cache_dtype: str | Mapping[int | str | None, str] | None = None,
    chunk: int | None = None,
    drafts: int = 0,
) -> tuple[int, str]:
    """Bytes one sequence of ``max_seq_len`` tokens holds at its peak (its prompt in chunks of
    ``chunk`` tokens, ``None``: whole), and per window."""
    config = preset.kv_cache_config(
        tokens_per_block=tpb, window_size_shares="equal", kv_cache_dtype=kv_cache_dtype
    )
    bpt = bytes_per_token(preset.model, config, max_seq_len)
    parts = {
        w: peak_blocks_per_sequence(max_seq_len, w, tpb, max_draft_tokens=drafts, chunk_size=chunk)
        for w in bpt
    }
    need = sum(n * bpt[w] * tpb for w, n in parts.items())
    text = ", ".join(
        f"window {w:,}: {n:,} blocks of {format_size(bpt[w] * tpb)}" for w, n in parts.items()
    )
    return need, text


def too_small(
    args: argparse.Namespace,
    preset: ModelPreset,
    memory: int,
    need: int,
    per_window: str,
    max_seq_len: int,
    chunk: int | None,
) -> str:
    """Why ``memory`` holds no sequence, and the fix: more memory or a shorter sequence, or,
    when the same budget fits with the default block size, a smaller ``--tokens-per-block``."""
    tpb: int = args.tokens_per_block
    head = (
        f"{format_size(memory)} cannot hold one sequence of {max_seq_len:,} tokens of "
        f"{preset.name}: one needs {format_size(need)} ({per_window})"
    )
    if tpb > DEFAULT_TOKENS_PER_BLOCK:
        small, _ = one_sequence(
            preset,
            max_seq_len,
            DEFAULT_TOKENS_PER_BLOCK,
            args.kv_cache_dtype,
            chunk,
            args.max_draft_tokens,
        )
        if memory >= small:
            return (
                f"{head}: the block size is the problem: every block holds "
                f"--tokens-per-block {tpb:,} tokens' worth of memory however few the window "
                f"keeps, and with {DEFAULT_TOKENS_PER_BLOCK} (the default) one needs only "
                f"{format_size(small)}; give a smaller --tokens-per-block"
            )
    return f"{head}; give more --memory or a shorter --max-seq-len"
