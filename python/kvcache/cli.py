"""The ``kvcache`` command line: ``models``, ``plan``, ``simulate`` and ``generate``.

Errors print one line to stderr and never a traceback. Exit status: 0 success; 2 a bad
command line or input (unknown option, bad value, unreadable or malformed file, a budget
that holds nothing, an output path that cannot be written; nothing was written); 1 a
failure of the run itself (out of memory, an internal error); 130 interrupted; 141 stdout
closed early (``kvcache models | head``).

Limits, each with its reason: sizes (``--memory``, ``--host-cache``, ``--disk-cache``) at
most 1 PiB (more than any one device or host has; larger values are typos); ``--max-seq-len``,
``--tokens-per-block`` and ``--max-batch-size`` at most 2**31-1 (32-bit in the core);
``--draft-tokens`` at most 256; ``--num-conversations`` at most 10,000 (the built-in
workload is generated in memory; replay larger workloads with ``--trace``).

Example:
    $ kvcache models
    $ kvcache plan --model gemma-3-27b --memory 80GiB --max-seq-len 32768
    $ kvcache plan --model gemma-4-31b --memory 80GiB --kv-cache-dtype full=fp8
    $ kvcache simulate --model gemma-3-12b --memory 24GiB --shares auto
    $ kvcache generate --model gemma3 --num-prompts 32   # needs the torch extra
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TextIO

from kvcache.config import (
    DEFAULT_MAX_NUM_BATCHED_TOKENS,
    SHARE_POLICIES,
    KvCacheConfig,
    ModelConfig,
)
from kvcache.models import ModelPreset, list_models, load_model
from kvcache.sizing import (
    blocks_per_window,
    bytes_per_token,
    format_size,
    max_blocks_per_sequence,
    parse_size,
    peak_blocks_per_sequence,
    resolve_share_policy,
    window_sizes,
)

__all__ = ["MAX_SIZE_BYTES", "PlanRow", "PolicyPlan", "main", "make_plan"]

_PROG = "kvcache"

#: Largest ``--memory`` / ``--host-cache`` / ``--disk-cache`` accepted (1 PiB): more than any
#: single device or host has, so a larger value is a typo (``10000TiB``, ``1e30``).
MAX_SIZE_BYTES = 2**50
_INT32_MAX = 2**31 - 1
_MAX_DRAFT_TOKENS = 256
_MAX_CONVERSATIONS = 10_000
_MAX_ENGINES = 64  # kvcache.simulate.fleet.MAX_ENGINES (not imported: --help stays light)
_DEFAULT_TOKENS_PER_BLOCK = 32


class _UsageError(Exception):
    """A command-line mistake; reported as one line with exit status 2."""


class _Parser(argparse.ArgumentParser):
    """Errors raise :class:`_UsageError`; an unknown option is reported (with the closest
    known one) before a missing required one, and a negative size such as ``-5GiB`` reaches
    its option's type as a value instead of being taken for an option."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # argparse takes "-5GiB" for an option (it knows "-5" and "-.5" only); no option of
        # this parser starts with a digit, so any "-<digit>..." is a value.
        self._negative_number_matcher = re.compile(r"^-\.?\d")
        self._required_later: list[tuple[str, str]] = []  # (dest, option) checked after parsing

    def add_required(self, *flags: str, **kwargs: Any) -> argparse.Action:
        """An option that must be given, checked after the unknown options are reported."""
        action = self.add_argument(*flags, default=None, **kwargs)
        action.help = (action.help or "") + " (required)"
        self._required_later.append((action.dest, flags[0]))
        return action

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        ns, extras = super().parse_known_args(args, namespace)
        if extras and " " in self.prog:  # a subcommand ("kvcache plan"): name the typo here
            self.error(f"unrecognized arguments: {' '.join(extras)}{self._suggestion(extras)}")
        missing = [flag for dest, flag in self._required_later if getattr(ns, dest) is None]
        if missing:
            self.error(f"the following arguments are required: {', '.join(missing)}")
        return ns, extras

    def _suggestion(self, extras: Sequence[str]) -> str:
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        for extra in extras:
            close = difflib.get_close_matches(extra.split("=", 1)[0], known, n=1, cutoff=0.6)
            if extra.startswith("-") and close:
                return f" (did you mean {close[0]}?)"
        return ""

    def error(self, message: str) -> NoReturn:
        raise _UsageError(f"{self.prog}: error: {message}")


# --------------------------------------------------------------------------------------
# plan
# --------------------------------------------------------------------------------------


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


def _joined(values: Sequence[object]) -> str:
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
                dtype=_joined([dtypes[i] for i in layers]),
                head_dim=_joined([head_dims[i] for i in layers]),
                saved_per_sequence=per_seq * tpb * (own_bpt[w] - bpt[w]),
                peak_blocks=peak,
                limited_by=limited_by,
            )
        )
    limiting = min(rows, key=lambda r: (r.max_sequences, r.window))
    return PolicyPlan(name, tuple(rows), limiting.max_sequences, limiting.window)


def _render_plan(plan: dict[str, Any], out: TextIO) -> None:
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
    shapes = _joined([f"{h} KV heads x {d}" for h, d in zip(heads, dims, strict=True)])
    return f"{shapes.replace('/', ' or ')}, {_joined(dtypes)}"


def _plan_json(plan: dict[str, Any]) -> dict[str, Any]:
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


def _one_sequence(
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


def _too_small(
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
    if tpb > _DEFAULT_TOKENS_PER_BLOCK:
        small, _ = _one_sequence(
            preset,
            max_seq_len,
            _DEFAULT_TOKENS_PER_BLOCK,
            args.kv_cache_dtype,
            chunk,
            args.max_draft_tokens,
        )
        if memory >= small:
            return (
                f"{head}: the block size is the problem: every block holds "
                f"--tokens-per-block {tpb:,} tokens' worth of memory however few the window "
                f"keeps, and with {_DEFAULT_TOKENS_PER_BLOCK} (the default) one needs only "
                f"{format_size(small)}; give a smaller --tokens-per-block"
            )
    return f"{head}; give more --memory or a shorter --max-seq-len"


def _cmd_plan(args: argparse.Namespace) -> int:
    preset = load_model(args.model)
    memory: int = args.memory
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else preset.max_context
    tpb: int = args.tokens_per_block
    policies: list[str | Sequence[float]] = list(SHARE_POLICIES)
    if args.shares is not None and args.shares not in policies:
        policies.append(args.shares)
    # What an engine would use with no shares configured: the environment, if set.
    env_policy, env_source = resolve_share_policy(None)
    env_var = env_source.removeprefix("environment variable ") if env_source != "default" else ""
    if env_var:
        n_windows = len(window_sizes(preset.model, preset.kv_cache_config(), max_seq_len))
        if not isinstance(env_policy, str) and len(env_policy) != n_windows:
            raise ValueError(
                f"{env_var} gives {len(env_policy)} share(s) but {preset.name} has "
                f"{n_windows} window(s) at {max_seq_len:,} tokens; give one share per window "
                "in ascending window order"
            )
        if env_policy not in policies:
            policies.append(env_policy)
    dtype_choice = args.kv_cache_dtype
    caps = [c for c in (args.max_chunk_size, args.max_num_batched_tokens) if c is not None]
    chunk = None if args.no_chunked_prefill else min(caps)
    need, per_window = _one_sequence(
        preset, max_seq_len, tpb, dtype_choice, chunk, args.max_draft_tokens
    )
    if memory < need:
        raise ValueError(_too_small(args, preset, memory, need, per_window, max_seq_len, chunk))
    plan = make_plan(
        preset,
        memory,
        max_seq_len,
        tokens_per_block=tpb,
        policies=policies,
        kv_cache_dtype=dtype_choice,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_chunk_size=args.max_chunk_size,
        chunked_prefill=not args.no_chunked_prefill,
        max_draft_tokens=args.max_draft_tokens,
    )
    if env_var:
        plan["policies"] = [
            dataclasses.replace(p, source=env_var) if policy == env_policy else p
            for p, policy in zip(plan["policies"], policies, strict=True)
        ]
    if max(p.max_sequences for p in plan["policies"]) == 0:
        raise ValueError(
            f"{format_size(memory)} fits no sequence of {max_seq_len:,} tokens of "
            f"{preset.name} under any share policy (one needs {format_size(need)} split "
            "exactly: " + per_window + "); give more --memory or a shorter --max-seq-len"
        )
    if args.json:
        print(json.dumps(_plan_json(plan), indent=2))
    else:
        _render_plan(plan, sys.stdout)
    return 0


# --------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------


def _cmd_models(args: argparse.Namespace) -> int:
    presets = [load_model(name) for name in list_models()]
    if args.json:
        rows = [
            {
                "name": p.name,
                "model": p.model.to_dict(),
                "max_attention_window": None
                if p.max_attention_window is None
                else list(p.max_attention_window),
                "max_context": p.max_context,
                "description": p.description,
                "source": p.source,
            }
            for p in presets
        ]
        print(json.dumps(rows, indent=2))
        return 0
    print(
        f"{'name':<16} {'layers':>6} {'kv heads':>8} {'head dim':>8} {'dtype':<9} "
        f"{'context':>8} {'KV B/token':>11}  windows"
    )
    for p in presets:
        m = p.model
        per_token = sum(m.bytes_per_token_per_layer())
        print(
            f"{p.name:<16} {m.num_layers:>6} {_joined(m.kv_heads_per_layer()):>8} "
            f"{_joined(m.head_dim_per_layer()):>8} {_joined(m.dtype_per_layer()):<9} "
            f"{p.max_context:>8,} {per_token:>11,}  {p.window_pattern_text()}"
        )
    return 0


# --------------------------------------------------------------------------------------
# simulate
# --------------------------------------------------------------------------------------


def _cmd_simulate(args: argparse.Namespace) -> int:
    if args.num_requests is not None:
        raise _UsageError(
            f"{_PROG} simulate: error: --num-requests is now --num-conversations: the "
            "built-in workload counts conversations of 1-6 requests (one per turn)"
        )
    from kvcache.simulate.command import run_cli  # only this command needs the simulator

    return run_cli(args)


def _cmd_generate(args: argparse.Namespace) -> int:
    from kvcache.generate_cli import run_cli  # imports torch and transformers

    return run_cli(args)


def _int_in(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An argparse type: an integer in ``lo..hi``; ``why`` explains the upper bound."""

    def parse(text: str) -> int:
        try:
            value = int(text.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < lo:
            kind = "a positive integer" if lo == 1 else f"an integer >= {lo}"
            raise argparse.ArgumentTypeError(f"expected {kind}, got {text!r}")
        if value > hi:
            reason = f" ({why})" if why else ""
            raise argparse.ArgumentTypeError(f"{text!r} is more than {hi:,}{reason}")
        return value

    return parse


_positive_int32 = _int_in(1, _INT32_MAX, "the core stores it as a 32-bit integer")
_non_negative_int32 = _int_in(0, _INT32_MAX, "the core stores it as a 32-bit integer")


_DECIMAL_UNITS = ("kb", "mb", "gb", "tb", "pb")
_BARE_NUMBER_LIMIT = 2**20  # a unitless size below 1 MiB is a forgotten unit, not a budget


def _size_type(notes: list[str]) -> Callable[[str], int]:
    """An argparse type: a byte count such as ``80GiB``, at most :data:`MAX_SIZE_BYTES`.

    A decimal unit (``80GB``) is taken as written and adds a note to ``notes`` saying the
    bytes and the binary size; a unitless number below 1 MiB (``80``) is refused: the unit
    was forgotten.
    """

    def parse(text: str) -> int:
        try:
            value = parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value > MAX_SIZE_BYTES:
            raise argparse.ArgumentTypeError(
                f"{text!r} is {format_size(value) if value < 2**60 else f'{value:.3g} bytes'}, "
                "more than 1 PiB, the most kvcache accepts: no single device or host has that "
                "much memory"
            )
        number, unit = _split_unit(text)
        if not unit and 0 < value < _BARE_NUMBER_LIMIT:
            raise argparse.ArgumentTypeError(
                f"{text!r} has no unit, so it means {value:,} bytes; write the unit, e.g. "
                f"{number}GiB (or {number}B if you mean bytes)"
            )
        if unit.lower() in _DECIMAL_UNITS:
            notes.append(
                f"note: {text.strip()!r} is decimal: {value:,} bytes = {format_size(value)} "
                f"({number}{unit[0].upper()}iB would be {parse_size(number + unit[0] + 'iB'):,} "
                "bytes)"
            )
        return value

    return parse


def _split_unit(text: str) -> tuple[str, str]:
    """``" 80 GB"`` -> ``("80", "GB")``: the number and the unit as written."""
    s = text.strip()
    i = len(s)
    while i > 0 and s[i - 1].isalpha():
        i -= 1
    return s[:i].strip(), s[i:]


def _shares(text: str) -> str | tuple[float, ...]:
    """An argparse type: a share policy name or comma-separated shares."""
    try:
        value = KvCacheConfig(window_size_shares=text).window_size_shares
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).removeprefix("window_size_shares: ")) from None
    assert value is not None
    return value if isinstance(value, str) else tuple(value)


def _kv_cache_dtype(text: str) -> str | dict[int | str | None, str]:
    """An argparse type: ``fp8`` (every layer), or ``KEY=DTYPE,...`` with keys ``full``,
    ``sliding`` or a window size (``full=fp8,sliding=bfloat16``, ``1024=bfloat16``)."""
    value: str | dict[int | str | None, str] = text.strip()
    if "=" in text:
        value = {}
        for part in text.split(","):
            key, sep, dtype = part.partition("=")
            if not sep or not key.strip():
                raise argparse.ArgumentTypeError(
                    f"expected a dtype or KEY=DTYPE pairs such as full=fp8,sliding=bfloat16; "
                    f"got {part.strip()!r}"
                )
            value[key.strip()] = dtype.strip()
    try:
        checked = KvCacheConfig(kv_cache_dtype=value).kv_cache_dtype
    except ValueError as e:
        hint = ""
        if isinstance(value, str):  # one dtype that is not one: maybe a KEY=DTYPE attempt
            hint = (
                "; to choose per window kind or size give KEY=DTYPE pairs, e.g. "
                "full=fp8,sliding=bfloat16"
            )
        raise argparse.ArgumentTypeError(f"{e}{hint}") from None
    if checked is None or isinstance(checked, str):
        return value
    return dict(checked)


def _version() -> str:
    from kvcache import __version__

    return __version__


def _build_parser(notes: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``kvcache`` parser; size options add their notes (decimal units) to ``notes``."""
    size = _size_type(notes if notes is not None else [])
    parser = _Parser(
        prog=_PROG,
        description="KV cache manager for LLM inference: model presets, memory planning and "
        "workload simulation for variable sliding window attention (VSWA) models.",
        epilog="Exit status: 0 success, 2 bad command line or input, 1 the run failed.",
    )
    parser.add_argument("--version", action="version", version=f"{_PROG} {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    p_models = sub.add_parser("models", help="list the built-in model presets")
    p_models.add_argument("--json", action="store_true", help="print JSON")
    p_models.set_defaults(func=_cmd_models)

    p_plan = sub.add_parser(
        "plan", help="blocks, tokens and max concurrent sequences per window and share policy"
    )
    assert isinstance(p_plan, _Parser)
    p_plan.usage = "%(prog)s --model NAME|FILE.json --memory SIZE [options]"
    p_plan.add_required("--model", help="preset name or preset JSON file")
    p_plan.add_required("--memory", type=size, help="primary KV memory, e.g. 80GiB (<= 1 PiB)")
    p_plan.add_argument(
        "--max-seq-len",
        type=_positive_int32,
        default=None,
        help="sequence length to plan for (default: the model's max context)",
    )
    p_plan.add_argument(
        "--tokens-per-block", type=_positive_int32, default=_DEFAULT_TOKENS_PER_BLOCK
    )
    p_plan.add_argument(
        "--shares", type=_shares, default=None, help="an extra share list to compare, e.g. 0.2,0.8"
    )
    p_plan.add_argument(
        "--kv-cache-dtype",
        type=_kv_cache_dtype,
        default=None,
        metavar="SPEC",
        help="KV dtype instead of the model's: one dtype (fp8), or KEY=DTYPE pairs with keys "
        "full, sliding or a window size (full=fp8,sliding=bfloat16); the plan then shows "
        "what each window's choice saves",
    )
    p_plan.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int32,
        default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens per engine step, the largest prefill chunk (default 8192, the scheduler's)",
    )
    p_plan.add_argument(
        "--max-chunk-size",
        type=_positive_int32,
        default=None,
        help="most tokens of one prefill chunk (default: the step's token budget)",
    )
    p_plan.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="plan for prompts prefilled whole in one step",
    )
    p_plan.add_argument(
        "--max-draft-tokens",
        type=_non_negative_int32,
        default=0,
        help="draft tokens per step (speculative decoding): sliding windows keep them too",
    )
    p_plan.add_argument("--json", action="store_true", help="print JSON")
    p_plan.set_defaults(func=_cmd_plan)

    p_sim = sub.add_parser(
        "simulate", help="replay a workload through the manager and report pool use"
    )
    p_sim.add_argument("--model", default=None, help="preset name (default: gemma-3-12b)")
    p_sim.add_argument(
        "--memory", type=size, default=None, help="primary KV memory (default: 16GiB)"
    )
    p_sim.add_argument(
        "--shares",
        type=_shares,
        default=None,
        help="equal | proportional | auto | a,b,... (default: KVCACHE_WINDOW_SIZE_SHARES, "
        "else equal); auto(L=N) in the report means auto sized for sequences of N tokens",
    )
    p_sim.add_argument("--trace", default=None, metavar="FILE", help="JSON Lines trace to replay")
    p_sim.add_argument("--max-batch-size", type=_positive_int32, default=None)
    p_sim.add_argument(
        "--max-seq-len",
        type=_positive_int32,
        default=None,
        help="longest sequence (default: 8192 for the built-in workload, else the longest "
        "request of the trace)",
    )
    p_sim.add_argument("--tokens-per-block", type=_positive_int32, default=None)
    p_sim.add_argument(
        "--scheduler",
        choices=["guaranteed_no_evict", "max_utilization"],
        default="max_utilization",
    )
    p_sim.add_argument(
        "--num-conversations",
        type=_int_in(1, _MAX_CONVERSATIONS, "the built-in workload is generated in memory"),
        default=None,
        metavar="N",
        help="conversations in the built-in workload, each 1-6 requests (default 400, "
        "about 1,000 requests)",
    )
    p_sim.add_argument("--num-requests", default=None, help=argparse.SUPPRESS)
    p_sim.add_argument(
        "--draft-tokens",
        type=_int_in(0, _MAX_DRAFT_TOKENS, "drafts are verified one position at a time"),
        default=0,
        help="draft tokens per generation step (speculative decoding; default 0)",
    )
    p_sim.add_argument(
        "--seed",
        type=_int_in(0, 2**63 - 1),
        default=None,
        help="seeds the built-in workload and the draft acceptance (default 0)",
    )
    p_sim.add_argument(
        "--max-num-batched-tokens",
        type=_positive_int32,
        default=None,
        metavar="N",
        help="tokens per engine step: generation tokens and prefill chunks (default 8192)",
    )
    p_sim.add_argument(
        "--max-chunk-size",
        type=_positive_int32,
        default=None,
        metavar="N",
        help="most tokens of one prefill chunk (default: the step's token budget)",
    )
    p_sim.add_argument(
        "--no-chunked-prefill",
        action="store_true",
        help="prefill every prompt whole in one step (default: in chunks that fill the "
        "step's token budget)",
    )
    p_sim.add_argument("--no-reuse", action="store_true", help="disable block reuse")
    p_sim.add_argument(
        "--swa-reuse-policy",
        choices=["invalidate", "placeholder"],
        default="placeholder",
        help="reuse of sliding-window chains whose out-of-window blocks were reclaimed "
        "(default: placeholder)",
    )
    p_sim.add_argument(
        "--plain-lru",
        action="store_true",
        help="evict cached blocks in plain LRU order per priority instead of protecting blocks "
        "that served a reuse hit (protect_reused_blocks=False), to show the difference",
    )
    p_sim.add_argument(
        "--lend-free-memory",
        action="store_true",
        help="let the windows lend each other free memory at run time (lend_free_memory=True): "
        "the shares set the initial split only",
    )
    p_sim.add_argument(
        "--host-cache",
        type=size,
        default=None,
        metavar="SIZE",
        help="host (secondary) memory for offloaded reusable blocks, e.g. 8GiB (default: none)",
    )
    p_sim.add_argument(
        "--disk-cache",
        type=size,
        default=None,
        metavar="SIZE",
        help="disk tier below the host cache (needs --host-cache), e.g. 64GiB; the report "
        "shows the hit rate with and without it (default: none)",
    )
    p_sim.add_argument(
        "--num-beams",
        type=_int_in(1, 64, "beams are forks of one sequence"),
        default=1,
        metavar="K",
        help="also report the blocks per request of beam search with K beams: forked "
        "(fork_sequence, the prompt's blocks shared) against K separate sequences",
    )
    p_sim.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p_sim.add_argument(
        "--plot", default=None, metavar="FILE.png", help="plot pool use (needs matplotlib)"
    )
    p_sim.add_argument("--compare-shares", action="store_true", help="run under every share policy")
    p_sim.add_argument(
        "--engines",
        type=_int_in(1, _MAX_ENGINES, "each engine is a whole manager"),
        default=1,
        metavar="N",
        help="simulate a fleet of N engines behind --router (each with --memory; default 1)",
    )
    p_sim.add_argument(
        "--router",
        choices=["kv", "round-robin", "least-loaded"],  # kvcache.simulate.fleet.ROUTERS
        default="kv",
        help="how a fleet routes requests: kv (an index fed by the engines' KV events; needs "
        "kvcache[events]), round-robin or least-loaded (default: kv)",
    )
    p_sim.add_argument(
        "--compare-routers",
        action="store_true",
        help="run the fleet under every router and print one table (needs --engines 2+)",
    )
    p_sim.add_argument("--no-progress", action="store_true", help="no progress bar")
    p_sim.set_defaults(func=_cmd_simulate)

    from kvcache.generate_cli import add_arguments  # no torch import: --help works without it

    p_gen = sub.add_parser(
        "generate",
        help="greedy generation with a Hugging Face model on kvcache (needs the torch extra: "
        "pip install 'kvcache[torch]', or '.[torch]' in a checkout)",
    )
    add_arguments(p_gen, size, _positive_int32)
    p_gen.set_defaults(func=_cmd_generate)
    return parser


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)
    first = msg.strip().splitlines()[0] if msg.strip() else ""
    return first or type(e).__name__


def main(argv: list[str] | None = None) -> int:
    """Runs the ``kvcache`` command line and returns the exit status.

    Args:
        argv: Arguments without the program name (default ``sys.argv[1:]``).

    Returns:
        0 on success, 2 for a bad command line or input, 1 when the run itself failed,
        130 when interrupted, 141 when stdout was closed early. Errors print one line to
        stderr, never a traceback.
    """
    prog = _PROG  # "kvcache simulate" once the command is known, as argparse says it
    try:
        notes: list[str] = []
        parser = _build_parser(notes)
        args = parser.parse_args(argv)
        if args.command is None:
            parser.print_help()
            return 2
        prog = f"{_PROG} {args.command}"
        for note in dict.fromkeys(notes):  # a default such as generate's 16MiB adds none
            print(f"{prog}: {note}", file=sys.stderr)
        return int(args.func(args))
    except SystemExit as e:  # --help and --version
        return e.code if isinstance(e.code, int) else 0
    except _UsageError as e:
        print(e, file=sys.stderr)
        return 2
    except BrokenPipeError:  # e.g. `kvcache models | head`: stop quietly
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return 141
    except (ValueError, OSError) as e:
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except MemoryError:
        print(f"{prog}: error: out of memory", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as e:  # kvcache.KVCacheError and its subclasses
        print(f"{prog}: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:
        print(
            f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} (please report it)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
