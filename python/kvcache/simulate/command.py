"""``kvcache simulate``: checks every input first, then runs, reports and writes files.

Everything that can be wrong with the command line (flag combinations, model, shares and
the share environment variables, output paths, matplotlib, the trace, the sizing) is
checked before the first simulated step, so a mistake costs no waiting and never leaves a
half-written file. Errors are ``ValueError`` with one line of text; :mod:`kvcache.cli.commands`
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

from kvcache._extras import install_hint
from kvcache.cache.config import SHARE_POLICIES
from kvcache.cache.sizing import format_size, parse_size, resolve_share_policy, window_sizes
from kvcache.models import ModelPreset, load_model
from kvcache.serving.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS
from kvcache.simulate.beams import beam_footprint, format_beam_footprint
from kvcache.simulate.bounds import key_trace
from kvcache.simulate.fleet import (
    ROUTERS,
    format_fleet_report,
    format_router_comparison,
    simulate_fleet,
)
from kvcache.simulate.loop import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    simulate,
    simulation_blocks,
    trace_lengths,
)
from kvcache.simulate.mooncake import DEFAULT_STEP_MS
from kvcache.simulate.options import EngineOptions
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
    TraceFile,
    TraceRequest,
    default_workload,
)

__all__ = ["check_output_path", "run_cli"]


def _count(n: int, noun: str) -> str:
    """``"1 request"``, ``"2,000 requests"``."""
    return f"{n:,} {noun}" + ("" if n == 1 else "s")


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
    if getattr(args, "step_ms", None) is not None and getattr(args, "arrival", "") == "asap":
        raise ValueError(
            "--step-ms times a trace's timestamps; --arrival asap puts every request at step 0"
        )
    if args.trace is None:
        for flag, used in (
            ("--first", getattr(args, "first", None) is not None),
            ("--arrival asap", getattr(args, "arrival", "timestamps") == "asap"),
            ("--step-ms", getattr(args, "step_ms", None) is not None),
        ):
            if used:
                raise ValueError(f"{flag} replays a trace as given; it needs --trace")
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


def _check_fleet_flags(args: argparse.Namespace) -> None:
    """``--router`` needs ``--engines``; fills in the defaults (one engine, the kv router)."""
    engines, router = getattr(args, "engines", None), getattr(args, "router", None)
    compare = getattr(args, "compare_routers", False)
    if router is not None and compare:
        raise ValueError(
            f"--compare-routers runs every router; --router {router} would change nothing"
        )
    if router is not None and engines is None:
        raise ValueError(
            f"--router {router} routes the requests of a fleet; give --engines N (2 or more) to "
            "simulate N engines behind it"
        )
    if router is not None and engines == 1:
        print(
            f"kvcache simulate: warning: --router {router} with --engines 1: every request goes "
            "to the one engine, so the router changes nothing",
            file=sys.stderr,
        )
    args.engines = 1 if engines is None else engines
    args.router = "kv" if router is None else router


def _trace_file(args: argparse.Namespace) -> TraceFile:
    """The ``--trace`` file with ``--first``, ``--arrival`` and ``--step-ms``, checked whole."""
    first, arrival = getattr(args, "first", None), getattr(args, "arrival", "timestamps")
    tf = TraceFile(args.trace, first=first, arrival=arrival)
    summary = tf.scan()  # every line checked before the first step
    step_ms = getattr(args, "step_ms", None)
    if step_ms is not None:
        if summary.format != "mooncake":
            raise ValueError(
                f"--step-ms times a Mooncake trace's timestamps (milliseconds); {args.trace} is "
                "in kvcache's format, whose arrivals are engine steps"
            )
        tf = TraceFile(args.trace, first=first, arrival=arrival, step_ms=step_ms)
        tf.scan()
    return tf


def _workload(args: argparse.Namespace) -> tuple[list[TraceRequest], str, dict[str, Any]]:
    """The requests in a list (a fleet routes them from memory), a one-line description and
    the JSON description."""
    trace, text, info = _workload_stream(args)
    return (trace if isinstance(trace, list) else list(trace)), text, info


def _workload_stream(
    args: argparse.Namespace,
) -> tuple[list[TraceRequest] | TraceFile, str, dict[str, Any]]:
    """As :func:`_workload`, with ``--trace`` as a :class:`TraceFile` (streamed)."""
    if args.trace is not None:
        tf = _trace_file(args)
        summary = tf.scan()
        n = summary.requests
        info: dict[str, Any] = {
            "source": "trace",
            "path": args.trace,
            "format": summary.format,
            "requests": n,
            "first": tf.first,
            "arrival": tf.arrival,
        }
        if summary.format == "mooncake":
            arrivals = (
                "all at step 0"
                if tf.arrival == "asap"
                else (f"timestamps at {tf.step_ms or DEFAULT_STEP_MS:g} ms per engine step")
            )
            if tf.arrival != "asap":
                info["step_ms"] = tf.step_ms or DEFAULT_STEP_MS
            text = (
                f"Mooncake trace {args.trace}, {_count(n, 'request')}"
                + (f" (the first {tf.first:,} of the file)" if tf.first is not None else "")
                + f", {summary.prompt_tokens / n:,.0f} prompt tokens on average; arrivals: "
                + arrivals
            )
        else:
            text = (
                f"trace {args.trace}, {_count(n, 'request')}"
                + (f" (the first {tf.first:,} of the file)" if tf.first is not None else "")
                + (", all arriving at step 0" if tf.arrival == "asap" else "")
            )
        return tf, text, info
    conversations = args.num_conversations or DEFAULT_CONVERSATIONS
    seed = args.seed or 0
    max_seq_len = args.max_seq_len or DEFAULT_MAX_SEQ_LEN
    trace = default_workload(seed=seed, num_conversations=conversations, max_seq_len=max_seq_len)
    if not trace:
        raise ValueError(_empty_workload(seed, conversations, max_seq_len))
    text = (
        f"built-in multi-turn chat, {_count(conversations, 'conversation')} (seed {seed}): "
        f"{_count(len(trace), 'request')}, one per turn"
    )
    info = {
        "source": "built-in",
        "conversations": conversations,
        "seed": seed,
        "max_seq_len": max_seq_len,
        "requests": len(trace),
    }
    return trace, text, info


def _empty_workload(seed: int, conversations: int, max_seq_len: int) -> str:
    """Why the built-in workload at ``--max-seq-len`` holds no request, and the fix."""
    # The smallest limit that keeps a request (the workload grows with the limit).
    lo, hi = max_seq_len + 1, max(DEFAULT_MAX_SEQ_LEN, max_seq_len + 1)
    while lo < hi:
        mid = (lo + hi) // 2
        if default_workload(seed=seed, num_conversations=conversations, max_seq_len=mid):
            hi = mid
        else:
            lo = mid + 1
    default = len(default_workload(seed=seed, num_conversations=conversations))
    return (
        f"--max-seq-len {max_seq_len:,} leaves the built-in workload empty: a conversation "
        "ends at its first turn longer than the limit, and every first turn (a system prompt "
        f"of 200-2,000 tokens, a question and an answer) is longer than {max_seq_len:,} "
        f"tokens; give --max-seq-len {lo:,} or more (the default {DEFAULT_MAX_SEQ_LEN:,} "
        f"keeps {default:,} requests), or replay your own requests with --trace FILE"
    )


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
                f"{_count(requests, 'request')} instead of {len(full):,} at the default "
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


def _all_rejected(report: SimulationReport, trace: Sequence[TraceRequest] | TraceFile) -> str:
    shortest = min(trace_lengths(trace) or [0])
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


def _engine_options(args: argparse.Namespace, model: ModelPreset | None = None) -> EngineOptions:
    """The one engine the flags describe (every run of the command and every engine of a
    fleet is built from it; ``--compare-shares`` changes only the shares)."""
    max_seq_len = args.max_seq_len
    if max_seq_len is None and args.trace is None:
        max_seq_len = DEFAULT_MAX_SEQ_LEN
    return EngineOptions(
        model=model or load_model(args.model or DEFAULT_MODEL),
        memory_bytes=args.memory if args.memory is not None else parse_size(DEFAULT_MEMORY),
        shares=args.shares,
        scheduler=args.scheduler,
        max_batch_size=args.max_batch_size or DEFAULT_MAX_BATCH_SIZE,
        max_seq_len=max_seq_len,
        tokens_per_block=args.tokens_per_block or 32,
        max_num_batched_tokens=args.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
        chunked_prefill=not args.no_chunked_prefill,
        max_chunk_size=args.max_chunk_size,
        enable_block_reuse=not args.no_reuse,
        swa_reuse_policy=args.swa_reuse_policy,
        protect_reused_blocks=not args.plain_lru,
        lend_free_memory=args.lend_free_memory,
        host_cache_bytes=args.host_cache or 0,
        disk_cache_bytes=getattr(args, "disk_cache", None) or 0,
        draft_tokens=args.draft_tokens,
        seed=args.seed or 0,
    )


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``kvcache simulate`` from parsed arguments (see :mod:`kvcache.cli.commands`).

    ``args.memory`` and ``args.host_cache`` are byte counts (or ``None``), ``args.shares``
    a parsed policy (or ``None``); integers are already range-checked.

    Returns:
        0.

    Raises:
        ValueError: Any bad input (one line; the command exits with status 2), including a
            run in which every request was rejected.
    """
    _check_fleet_flags(args)
    if args.engines > 1 or getattr(args, "compare_routers", False):
        return _run_fleet(args)
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
    trace, workload_text, workload_info = _workload_stream(args)
    warnings = _length_warnings(args, model, len(trace))  # printed once the runs succeeded

    show = not args.no_progress and sys.stderr.isatty()
    options = _engine_options(args, model)
    max_seq_len = options.max_seq_len
    policies: list[str | Sequence[float] | None] = [shares]
    if args.compare_shares:
        policies = list(SHARE_POLICIES)
        if shares is not None and shares not in policies:
            policies.append(shares)
    for p in policies:  # every run's sizing is checked before the first one starts
        simulation_blocks(trace, options, shares=p)
    progress = sys.stderr if show else None
    keys = None
    if not args.no_reuse and not getattr(args, "no_bounds", False):
        ordered = trace if isinstance(trace, list) or trace.scan().in_order else list(trace)
        keys = key_trace(ordered, options.tokens_per_block)
    reports = [
        simulate(trace, options, shares=p, key_trace=keys, progress=progress) for p in policies
    ]
    if options.disk_cache_bytes:  # the same runs without the disk tier: what it adds
        reports = [
            dataclasses.replace(
                r,
                cache_hit_rate_without_disk=simulate(
                    trace, options, shares=p, disk_cache_bytes=0, progress=progress
                ).cache_hit_rate,
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
            trace if isinstance(trace, list) else list(trace),
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


def _run_fleet(args: argparse.Namespace) -> int:
    """``kvcache simulate --engines N`` (N > 1) or ``--compare-routers``.

    Checks every input before the first step, as ``kvcache simulate`` does; ``--json`` writes
    ``{"version", "workload", "fleets": [fleet report, ...]}``.

    Raises:
        ValueError: Any bad input (one line; the command exits with status 2).
    """
    from kvcache import __version__

    _check_flags(args)
    if args.compare_routers and args.engines < 2:
        raise ValueError("--compare-routers compares how a fleet is routed; give --engines 2+")
    for flag, used in (
        ("--compare-shares", args.compare_shares),
        ("--plot", args.plot is not None),
    ):
        if used:
            raise ValueError(f"{flag} shows one engine's run; it cannot be used with --engines")
    routers = list(ROUTERS) if args.compare_routers else [args.router]
    if "kv" in routers:
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError:
            which = (
                "--compare-routers runs the kv router too, which"
                if args.compare_routers
                else "--router kv (the default router of --engines)"
            )
            raise ValueError(f"{which} needs the events extra: {install_hint('events')}") from None
    if args.shares is None:
        resolve_share_policy(None)
    if args.json is not None:
        check_output_path(args.json, "--json")
    trace, workload_text, workload_info = _workload(args)
    options = _engine_options(args)
    simulation_blocks(trace, options)
    show = not args.no_progress and sys.stderr.isatty()
    reports = [
        simulate_fleet(
            trace,
            options,
            engines=args.engines,
            router=router,
            progress=sys.stderr if show else None,
        )
        for router in routers
    ]
    for r in reports:
        if r.completed == 0 and r.rejected == r.requests:
            raise ValueError(
                _all_rejected(dataclasses.replace(r.engines[0], requests=r.requests), trace)
            )
    if args.compare_routers:
        print(format_router_comparison(reports, workload=workload_text))
    else:
        print(format_fleet_report(reports[0], workload=workload_text))
    if reports[0].rejected:
        print(
            f"kvcache: warning: {reports[0].rejected:,} of {reports[0].requests:,} requests were "
            "rejected: they can never fit an engine's pools or max_seq_len",
            file=sys.stderr,
        )
    if args.json is not None:
        payload = {
            "version": __version__,
            "workload": workload_info,
            "fleets": [r.to_dict() for r in reports],
        }
        try:
            Path(args.json).write_text(json.dumps(payload) + "\n", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {args.json!r}: {e.strerror or e}") from None
        print(f"wrote the JSON report to {os.fspath(args.json)}")
    return 0
