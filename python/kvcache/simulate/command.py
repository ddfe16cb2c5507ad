"""``kvcache simulate``: checks every input first, then runs, reports and writes files.

Everything that can be wrong with the command line (flag combinations, model, shares and
the share environment variables, output paths, matplotlib, the trace, the sizing) is
checked before the first simulated step, so a mistake costs no waiting and never leaves a
half-written file. Errors are ``ValueError`` with one line of text; :mod:`kvcache.cli`
prints it and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvcache.config import SHARE_POLICIES
from kvcache.models import ModelPreset, load_model
from kvcache.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from kvcache.simulate.beams import beam_footprint, format_beam_footprint
from kvcache.simulate.loop import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    simulate,
    simulation_blocks,
)
from kvcache.simulate.plot import check_plot_path, plot_reports
from kvcache.simulate.report import (
    SimulationReport,
    format_comparison,
    format_report,
    report_json,
)
from kvcache.simulate.workload import (
    DEFAULT_CONVERSATIONS,
    DEFAULT_MAX_SEQ_LEN,
    TraceRequest,
    default_workload,
    read_trace,
)
from kvcache.sizing import format_size, parse_size, resolve_share_policy, window_sizes

__all__ = ["check_output_path", "run_cli"]


def check_output_path(path: str, what: str) -> None:
    """Checks that ``path`` can be written, without leaving a file behind.

    Args:
        path: The file to write later.
        what: What it is, for the message (e.g. ``"--json"``).

    Raises:
        ValueError: ``path`` is a directory, its directory does not exist, or it cannot be
            opened for writing.
    """
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{what} {path!r} is a directory; give a file name")
    parent = p.parent
    if not parent.is_dir():
        raise ValueError(f"{what} {path!r}: directory {str(parent)!r} does not exist")
    existed = p.exists()
    try:
        with p.open("a", encoding="utf-8"):
            pass
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be written: {e.strerror or e}") from None
    if not existed:
        p.unlink(missing_ok=True)


def _check_flags(args: argparse.Namespace) -> None:
    if getattr(args, "disk_cache", None) and not args.host_cache:
        raise ValueError(
            "--disk-cache needs --host-cache: evicted blocks reach the disk tier from host memory"
        )
    if getattr(args, "disk_cache", None) and args.no_reuse:
        raise ValueError("--disk-cache caches reusable blocks; it cannot be used with --no-reuse")
    if args.max_chunk_size is not None and args.no_chunked_prefill:
        raise ValueError(
            "--max-chunk-size limits prefill chunks; it cannot be used with "
            "--no-chunked-prefill, which prefills every prompt whole"
        )
    budget = args.max_num_batched_tokens
    if budget is not None and budget <= args.draft_tokens:
        raise ValueError(
            f"--max-num-batched-tokens {budget} must exceed --draft-tokens "
            f"{args.draft_tokens}: a generation step takes 1 + drafts tokens"
        )
    if args.trace is None:
        return
    if args.num_conversations is not None:
        raise ValueError(
            "--num-conversations sizes the built-in workload; it cannot be used with --trace, "
            "whose requests are given"
        )
    if args.seed is not None and not args.draft_tokens:
        raise ValueError(
            "--seed seeds the built-in workload and, with --draft-tokens, the draft "
            "acceptance; with --trace and no --draft-tokens it would change nothing"
        )


def _workload(
    args: argparse.Namespace,
) -> tuple[list[TraceRequest], str, dict[str, Any]]:
    """The requests, a one-line description and the JSON description."""
    if args.trace is not None:
        trace = read_trace(args.trace)
        text = f"trace {args.trace}, {len(trace):,} requests"
        return trace, text, {"source": "trace", "path": args.trace, "requests": len(trace)}
    conversations = args.num_conversations or DEFAULT_CONVERSATIONS
    seed = args.seed or 0
    max_seq_len = args.max_seq_len or DEFAULT_MAX_SEQ_LEN
    trace = default_workload(seed=seed, num_conversations=conversations, max_seq_len=max_seq_len)
    text = (
        f"built-in multi-turn chat, {conversations:,} conversations (seed {seed}): "
        f"{len(trace):,} requests, one per turn"
    )
    info = {
        "source": "built-in",
        "conversations": conversations,
        "seed": seed,
        "max_seq_len": max_seq_len,
        "requests": len(trace),
    }
    return trace, text, info


def _length_warnings(args: argparse.Namespace, model: ModelPreset, requests: int) -> list[str]:
    """What a short ``--max-seq-len`` changes besides the limit, one line each: the built-in
    workload ends conversations early (fewer requests than at the default length), and a
    sliding window not shorter than the limit becomes full attention (one window fewer)."""
    limit = args.max_seq_len
    if limit is None:
        return []
    out = []
    if args.trace is None and limit < DEFAULT_MAX_SEQ_LEN:
        full = default_workload(
            seed=args.seed or 0,
            num_conversations=args.num_conversations or DEFAULT_CONVERSATIONS,
            max_seq_len=DEFAULT_MAX_SEQ_LEN,
        )
        if requests < len(full):
            out.append(
                f"--max-seq-len {limit:,} ends conversations early: the built-in workload has "
                f"{requests:,} requests instead of {len(full):,} at the default "
                f"{DEFAULT_MAX_SEQ_LEN:,} (a conversation ends at its first turn over the limit)"
            )
    config = model.kv_cache_config()
    pattern = {w for w in config.max_attention_window or [] if w is not None}
    merged = sorted(w for w in pattern if w >= limit)
    if merged:
        n = len(window_sizes(model.model, config, limit))
        before = len(window_sizes(model.model, config, max(pattern) + 1))
        out.append(
            f"--max-seq-len {limit:,} is not longer than the sliding window"
            f"{'s' if len(merged) > 1 else ''} {', '.join(f'{w:,}' for w in merged)} of "
            f"{model.name}: those layers run as full attention, so the run has {n} "
            f"window{'s' if n > 1 else ''} instead of {before}"
        )
    return out


def _all_rejected(report: SimulationReport, trace: Sequence[TraceRequest]) -> str:
    shortest = min(len(t.prompt) + len(t.output) - 1 for t in trace)
    if shortest > report.max_seq_len:
        return (
            f"all {report.requests:,} requests were rejected: every one is longer than "
            f"max_seq_len {report.max_seq_len:,} (the shortest holds {shortest:,} tokens); "
            "give a larger --max-seq-len"
        )
    pools = ", ".join(
        f"window {w.window:,}: {w.blocks:,} block{'' if w.blocks == 1 else 's'} of "
        f"{report.tokens_per_block} tokens"
        for w in report.windows
    )
    return (
        f"all {report.requests:,} requests were rejected: none can ever fit in "
        f"{format_size(report.memory_bytes)} of KV memory ({pools}); give more --memory "
        f"('kvcache plan --model {report.model} --memory ...' shows what fits)"
    )


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``kvcache simulate`` from parsed arguments (see :mod:`kvcache.cli`).

    ``args.memory`` and ``args.host_cache`` are byte counts (or ``None``), ``args.shares``
    a parsed policy (or ``None``); integers are already range-checked.

    Returns:
        0.

    Raises:
        ValueError: Any bad input (one line; the command exits with status 2), including a
            run in which every request was rejected.
    """
    if getattr(args, "engines", 1) > 1 or getattr(args, "compare_routers", False):
        from kvcache.simulate.fleet import run_fleet_cli

        return run_fleet_cli(args)
    _check_flags(args)
    model = load_model(args.model or DEFAULT_MODEL)
    shares = args.shares
    if shares is None:
        resolve_share_policy(None)  # a bad KVCACHE_WINDOW_SIZE_SHARES fails now
    if args.json is not None:
        check_output_path(args.json, "--json")
    if args.plot is not None:
        if args.json is not None and Path(args.json).resolve() == Path(args.plot).resolve():
            raise ValueError("--json and --plot name the same file")
        check_output_path(args.plot, "--plot")
        check_plot_path(args.plot)
    trace, workload_text, workload_info = _workload(args)
    warnings = _length_warnings(args, model, len(trace))  # printed once the runs succeeded

    show = not args.no_progress and sys.stderr.isatty()
    memory = args.memory if args.memory is not None else parse_size(DEFAULT_MEMORY)
    host_cache = args.host_cache or 0
    max_seq_len = args.max_seq_len if args.max_seq_len is not None else None
    if max_seq_len is None and args.trace is None:
        max_seq_len = DEFAULT_MAX_SEQ_LEN
    sizing: dict[str, Any] = {
        "model": model,
        "memory_bytes": memory,
        "max_seq_len": max_seq_len,
        "tokens_per_block": args.tokens_per_block or 32,
        "host_cache_bytes": host_cache,
    }
    policies: list[str | Sequence[float] | None] = [shares]
    if args.compare_shares:
        policies = list(SHARE_POLICIES)
        if shares is not None and shares not in policies:
            policies.append(shares)
    disk_cache = getattr(args, "disk_cache", None) or 0
    for p in policies:  # every run's sizing is checked before the first one starts
        simulation_blocks(trace, shares=p, disk_cache_bytes=disk_cache, **sizing)

    common: dict[str, Any] = {
        **sizing,
        "scheduler": args.scheduler,
        "max_batch_size": args.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
        "enable_block_reuse": not args.no_reuse,
        "swa_reuse_policy": args.swa_reuse_policy,
        "protect_reused_blocks": not args.plain_lru,
        "lend_free_memory": args.lend_free_memory,
        "draft_tokens": args.draft_tokens,
        "max_num_batched_tokens": args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        "chunked_prefill": not args.no_chunked_prefill,
        "max_chunk_size": args.max_chunk_size,
        "seed": args.seed or 0,
        "progress": sys.stderr if show else None,
    }
    reports = [simulate(trace, shares=p, disk_cache_bytes=disk_cache, **common) for p in policies]
    if disk_cache:  # the same runs without the disk tier: what it adds
        reports = [
            dataclasses.replace(
                r,
                cache_hit_rate_without_disk=simulate(trace, shares=p, **common).cache_hit_rate,
            )
            for p, r in zip(policies, reports, strict=True)
        ]
    for r in reports:
        if r.completed == 0 and r.rejected == r.requests:
            raise ValueError(_all_rejected(r, trace))

    for line in warnings:
        print(f"kvcache simulate: warning: {line}", file=sys.stderr)
    if args.compare_shares:
        print(format_comparison(reports, workload=workload_text))
    else:
        print(format_report(reports[0], workload=workload_text))
    worst = max(reports, key=lambda r: r.rejected)
    if worst.rejected:
        print(
            f"kvcache: warning: {worst.rejected:,} of {worst.requests:,} requests were rejected "
            f"({worst.shares} shares): they can never fit the pools or max_seq_len",
            file=sys.stderr,
        )
    beams = None
    if getattr(args, "num_beams", 1) > 1:
        beams = beam_footprint(
            trace,
            model,
            num_beams=args.num_beams,
            tokens_per_block=args.tokens_per_block or 32,
            max_seq_len=max_seq_len,
        )
        print(format_beam_footprint(beams))
    if args.json is not None:
        payload = report_json(reports, workload=workload_info)
        if beams is not None:
            payload["beam_footprint"] = dataclasses.asdict(beams)
        try:
            Path(args.json).write_text(json.dumps(payload) + "\n", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {args.json!r}: {e.strerror or e}") from None
        print(f"wrote the JSON report to {os.fspath(args.json)}")
    if args.plot is not None:
        plot_reports(reports, args.plot)
        print(f"wrote the plot to {os.fspath(args.plot)}")
    return 0
