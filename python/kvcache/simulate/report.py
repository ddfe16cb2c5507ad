"""Simulation reports: what one run did, as text for people and as JSON.

:func:`report_json` gives the ``--json`` file of ``kvcache simulate``: always one object,
``{"version": ..., "workload": {...}, "runs": [report, ...]}`` with one report per run
(one run, or one per share policy with ``--compare-shares``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvcache.cache.sizing import format_size
from kvcache.simulate.bounds import HitBounds

__all__ = [
    "SimulationReport",
    "WindowReport",
    "format_comparison",
    "format_report",
    "report_json",
]


@dataclass
class WindowReport:
    """Pool size and use of one window over a run."""

    window: int
    layers: int
    blocks: int
    tokens: int
    peak_used_blocks: int
    mean_used_blocks: float


@dataclass
class SimulationReport:
    """What one simulation run did. Times are wall-clock and vary between runs.

    ``steps`` counts the engine steps that ran (idle stretches between arrivals are
    skipped); ``shares`` is the share policy as text, ``"auto(L=N)"`` for the ``"auto"``
    policy sized for sequences of ``expected_seq_len`` = N tokens; ``chunked_prefill`` says
    whether prompts were prefilled in chunks (of at most ``max_chunk_size`` tokens) or whole,
    ``max_num_batched_tokens`` is the token budget per step (``None``: unlimited) and
    ``prefill_chunks`` counts the context entries that ran (one per prompt without
    chunking); ``context_tokens`` counts prompt tokens registered (reused prefixes included)
    and ``series`` holds one value per step for plots (``step``, ``running``, ``waiting``
    and ``used_<window>``).
    """

    model: str
    memory_bytes: int
    shares: str
    scheduler: str
    max_batch_size: int
    max_seq_len: int
    tokens_per_block: int
    draft_tokens: int
    windows: list[WindowReport]
    requests: int
    completed: int
    rejected: int
    steps: int
    generated_tokens: int
    context_tokens: int
    mean_concurrency: float
    peak_concurrency: int
    pause_events: int
    paused_requests: int
    mean_latency_steps: float
    p95_latency_steps: float
    manager_us_per_step: float
    manager_us_p99: float
    scheduler_us_per_step: float
    wall_seconds: float
    reused_tokens: int
    cache_hit_rate: float | None
    reused_blocks: int
    offloaded_blocks: int
    onboarded_blocks: int
    missed_blocks: int = 0
    cache_hit_rate_per_window: dict[int, float] = field(default_factory=dict)
    swa_reuse_policy: str = "placeholder"
    protect_reused_blocks: bool = True
    #: The windows lent each other free memory (``lend_free_memory``), and the slabs moved.
    lend_free_memory: bool = False
    lent_slabs: int = 0
    host_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    #: The hit rate of the same run without the disk tier (``kvcache simulate --disk-cache``).
    cache_hit_rate_without_disk: float | None = None
    secondary_blocks: dict[int, int] = field(default_factory=dict)
    reuse_enabled: bool = True
    expected_seq_len: int | None = None
    chunked_prefill: bool = True
    max_num_batched_tokens: int | None = 8192
    max_chunk_size: int | None = 8192
    prefill_chunks: int = 0
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)
    #: Prompt tokens whose keys the cache matched but that were not reused, by cause (the
    #: manager's ``lost_hit_tokens_*`` counters).
    lost_hit_tokens: dict[str, int] = field(default_factory=dict)
    #: Recurrent state: slots per state group summed (0: no recurrent layers) and the
    #: checkpoints stored, restored (hits resumed from one), skipped and evicted.
    state_slots: int = 0
    checkpoints: dict[str, int] = field(default_factory=dict)
    #: The run beside the trace's offline bounds (``simulate(..., hit_bounds=True)``, the
    #: command line's default; ``None`` without them or without reuse).
    hit_bounds: HitBounds | None = None

    def to_dict(self, *, with_series: bool = True) -> dict[str, Any]:
        """JSON-friendly form (per-step series included unless ``with_series`` is false)."""
        d = asdict(self)
        if not with_series:
            d.pop("series")
        return d


def _us(x: float) -> str:
    return f"{x:,.0f} µs" if x >= 10 else f"{x:.1f} µs"


def _auto_note(length: int, indent: str) -> list[str]:
    return [
        f"auto(L={length}): shares sized so that every window runs out at the same concurrency",
        f"{indent}for sequences of L = {length:,} tokens (by default the workload's mean "
        "prompt + output)",
    ]


def _prefill_text(r: SimulationReport) -> str:
    """How the run prefilled prompts, e.g. ``"chunked prefill (chunks <= 8,192 tokens),
    8,192 tokens per step"``."""
    budget = (
        "unlimited tokens per step"
        if r.max_num_batched_tokens is None
        else f"{r.max_num_batched_tokens:,} tokens per step"
    )
    if not r.chunked_prefill:
        return f"whole-prompt prefill, {budget}"
    chunks = "whole prompts" if r.max_chunk_size is None else f"<= {r.max_chunk_size:,} tokens"
    return f"chunked prefill (chunks {chunks}), {budget}"


def format_report(r: SimulationReport, *, workload: str | None = None) -> str:
    """The human-readable report of one run.

    Args:
        r: The run.
        workload: One line describing the workload, shown under the heading.
    """
    lines = [
        f"kvcache simulate: {r.model}, {format_size(r.memory_bytes)} primary KV memory, "
        f"{r.shares} window shares"
        + (
            f" (windows lend free memory: {r.lent_slabs:,} slab{'' if r.lent_slabs == 1 else 's'}"
            " moved; blocks below are the initial split)"
            if r.lend_free_memory
            else ""
        )
        + f", {r.scheduler} scheduling, virtual backend",
        *([f"  workload: {workload}"] if workload else []),
        f"  max_batch_size {r.max_batch_size}, max_seq_len {r.max_seq_len:,}, "
        f"tokens_per_block {r.tokens_per_block}"
        + (f", {r.draft_tokens} draft tokens" if r.draft_tokens else ""),
        f"  {_prefill_text(r)}",
        "  block reuse "
        + (
            f"on (sliding windows: {r.swa_reuse_policy}"
            + ("" if r.protect_reused_blocks else ", plain LRU")
            + "), host cache "
            + (format_size(r.host_cache_bytes) if r.host_cache_bytes else "none")
            + (f", disk cache {format_size(r.disk_cache_bytes)}" if r.disk_cache_bytes else "")
            if r.reuse_enabled
            else "off"
        ),
    ]
    if r.expected_seq_len is not None:
        lines += ["  " + x for x in _auto_note(r.expected_seq_len, " " * 4)]
    lines += [
        "",
        f"  {'window':>7} {'layers':>6} {'blocks':>9} {'tokens':>12} {'peak used':>16} "
        f"{'mean used':>10}",
    ]
    for w in r.windows:
        peak = f"{w.peak_used_blocks:,} ({w.peak_used_blocks / w.blocks:.0%})"
        lines.append(
            f"  {w.window:>7,} {w.layers:>6} {w.blocks:>9,} {w.tokens:>12,} {peak:>16} "
            f"{w.mean_used_blocks / w.blocks:>10.0%}"
        )
    lines += [
        "",
        f"  requests            {r.requests:,} ({r.completed:,} completed"
        + (f", {r.rejected:,} rejected: can never fit" if r.rejected else "")
        + ")",
        f"  engine steps        {r.steps:,}",
        f"  generated tokens    {r.generated_tokens:,} ({r.generated_tokens / max(r.steps, 1):.1f} "
        "per step)",
        f"  context tokens      {r.context_tokens:,} (prompts, plus recomputation after pauses) "
        f"in {r.prefill_chunks:,} prefill chunks",
        f"  concurrency         mean {r.mean_concurrency:.1f}, peak {r.peak_concurrency}",
        f"  paused              {r.paused_requests:,} requests ({r.pause_events:,} pauses)",
        f"  latency (steps)     mean {r.mean_latency_steps:,.0f}, p95 {r.p95_latency_steps:,.0f} "
        "(engine steps from arrival to the last token, completed requests)",
        f"  manager time/step   mean {_us(r.manager_us_per_step)}, p99 {_us(r.manager_us_p99)}; "
        f"scheduler {_us(r.scheduler_us_per_step)}",
    ]
    if not r.reuse_enabled:
        lines.append("  prefix reuse        off (--no-reuse)")
    elif r.cache_hit_rate is None:
        lines.append("  prefix reuse        no prompt block was looked up")
    else:
        per_window = ", ".join(
            f"window {w:,} {rate:.1%}" for w, rate in sorted(r.cache_hit_rate_per_window.items())
        )
        lines += [
            f"  prefix reuse        hit rate {r.cache_hit_rate:.1%} ({per_window})",
            f"                      {r.reused_blocks:,} blocks reused, {r.missed_blocks:,} missed",
            f"                      {r.reused_tokens:,} prompt tokens reused "
            f"({r.reused_tokens / max(r.context_tokens, 1):.1%} of context tokens)",
            f"  host offload        offloaded {r.offloaded_blocks:,} blocks, onboarded "
            f"{r.onboarded_blocks:,}"
            + (
                " (secondary blocks: "
                + ", ".join(f"{w:,}: {n:,}" for w, n in sorted(r.secondary_blocks.items()))
                + ")"
                if r.host_cache_bytes
                else " (no host cache: --host-cache SIZE)"
            ),
        ]
        lost = {k: v for k, v in r.lost_hit_tokens.items() if v}
        if lost:
            lines.append(
                "  hits lost           " + ", ".join(f"{k} {v:,} tokens" for k, v in lost.items())
            )
        if r.state_slots:
            c = r.checkpoints
            lines.append(
                f"  recurrent state     {r.state_slots:,} slots; checkpoints stored "
                f"{c.get('stored', 0):,}, restored {c.get('restored', 0):,}, skipped "
                f"{c.get('skipped', 0):,}, evicted {c.get('evicted', 0):,}"
            )
        if r.hit_bounds is not None:
            lines += _bounds_lines(r.hit_bounds)
        if r.disk_cache_bytes and r.cache_hit_rate_without_disk is not None:
            gain = 100 * (r.cache_hit_rate - r.cache_hit_rate_without_disk)
            lines.append(
                f"  disk tier           hit rate {r.cache_hit_rate:.1%} with it, "
                f"{r.cache_hit_rate_without_disk:.1%} without it ({gain:+.1f} pp)"
            )
    lines.append(f"  wall time           {r.wall_seconds:.1f} s")
    return "\n".join(lines)


def _bounds_lines(b: HitBounds) -> list[str]:
    """The report's lines on the offline bounds and the lost hits."""
    prompt = max(b.prompt_tokens, 1)
    belady = "" if b.belady_hit_rate is None else f", Belady {b.belady_hit_rate:.1%}"
    partial = (
        f" (+{b.partial_tokens:,} tokens of partly matched blocks)" if b.partial_tokens else ""
    )
    lost = ", ".join(
        f"{k} {v / prompt:.1%}" for k, v in b.lost_tokens.items() if v or k == "capacity"
    )
    return [
        f"  vs the possible     prompt tokens hit: achieved {b.achieved_hit_rate:.1%}{partial}, "
        f"LRU {b.lru_hit_rate:.1%}{belady}, ideal {b.ideal_hit_rate:.1%}",
        f"                      (ideal: an unbounded cache; LRU and Belady: "
        f"{b.capacity_blocks:,} blocks, the pool of window {b.capacity_window:,}; offline, "
        f"{b.tokens_per_block}-token blocks)",
        f"  lost vs ideal       {lost} of prompt tokens; never seen "
        f"{b.never_seen_tokens / prompt:.1%}"
        + (
            f"; preemption recomputed {b.recomputed_tokens:,} tokens" if b.recomputed_tokens else ""
        ),
        f"  verdict             {b.verdict}",
    ]


def _rate(r: SimulationReport) -> str:
    """The prefix-reuse hit rate as the report prints it, or why there is none."""
    if not r.reuse_enabled:
        return "off"
    return "n/a" if r.cache_hit_rate is None else f"{r.cache_hit_rate:.1%}"


def format_comparison(reports: Sequence[SimulationReport], *, workload: str | None = None) -> str:
    """Several runs of one workload side by side (one column per share policy).

    Args:
        reports: The runs, one column each.
        workload: One line describing the workload, shown under the heading.
    """
    rows: list[tuple[str, list[str]]] = [
        ("shares", [r.shares for r in reports]),
        ("engine steps", [f"{r.steps:,}" for r in reports]),
        ("tokens per step", [f"{r.generated_tokens / max(r.steps, 1):.1f}" for r in reports]),
        ("mean concurrency", [f"{r.mean_concurrency:.1f}" for r in reports]),
        ("peak concurrency", [str(r.peak_concurrency) for r in reports]),
        ("paused requests", [f"{r.paused_requests:,}" for r in reports]),
        ("rejected", [f"{r.rejected:,}" for r in reports]),
        ("mean latency (steps)", [f"{r.mean_latency_steps:,.0f}" for r in reports]),
        ("prefix hit rate", [_rate(r) for r in reports]),
    ]
    if all(r.hit_bounds is not None for r in reports):
        hb = [r.hit_bounds for r in reports if r.hit_bounds is not None]
        rows += [
            ("prompt tokens hit", [f"{b.achieved_hit_rate:.1%}" for b in hb]),
            ("  LRU (same size)", [f"{b.lru_hit_rate:.1%}" for b in hb]),
            (
                "  Belady (same size)",
                ["n/a" if b.belady_hit_rate is None else f"{b.belady_hit_rate:.1%}" for b in hb],
            ),
            ("  ideal (unbounded)", [f"{b.ideal_hit_rate:.1%}" for b in hb]),
        ]
    for i, w in enumerate(reports[0].windows):
        rows.append((f"window {w.window:,} blocks", [f"{r.windows[i].blocks:,}" for r in reports]))
        rows.append(
            (
                f"window {w.window:,} peak use",
                [f"{r.windows[i].peak_used_blocks / r.windows[i].blocks:.0%}" for r in reports],
            )
        )
    width = max(14, *(len(v) for _, vals in rows for v in vals))
    first = reports[0]
    lines = [
        f"kvcache simulate --compare-shares: {first.model}, {format_size(first.memory_bytes)}, "
        f"{first.scheduler}, {first.requests:,} requests, {_prefill_text(first)}",
        *([f"  workload: {workload}"] if workload else []),
        "",
    ]
    for label, vals in rows:
        lines.append(f"  {label:<22}" + "".join(f"{v:>{width + 2}}" for v in vals))
    for length in sorted({r.expected_seq_len for r in reports if r.expected_seq_len}):
        lines += ["", *("  " + x for x in _auto_note(length, "  "))]
    lines += [
        "",
        "  latency: engine steps from a request's arrival to its last token (completed requests)",
        "  prefix hit rate: prompt blocks found in the cache / prompt blocks looked up",
    ]
    return "\n".join(lines)


def report_json(
    reports: Sequence[SimulationReport],
    *,
    workload: Mapping[str, Any] | None = None,
    with_series: bool = True,
) -> dict[str, Any]:
    """The JSON document of one or more runs: always the same top-level shape.

    Args:
        reports: The runs.
        workload: What was replayed (e.g. ``{"source": "built-in", "seed": 0,
            "conversations": 400, "requests": 1003}``).
        with_series: Include the per-step series of each run.

    Returns:
        ``{"version": kvcache version, "workload": {...}, "runs": [report dict, ...]}``.
    """
    from kvcache import __version__

    return {
        "version": __version__,
        "workload": dict(workload or {}),
        "runs": [r.to_dict(with_series=with_series) for r in reports],
    }
