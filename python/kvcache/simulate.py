"""Workload simulation: replay requests through the manager the way an engine would.

The simulator drives a :class:`~kvcache.resource_manager.KVCacheResourceManager` on the
``virtual`` backend (bookkeeping only, no KV memory) step by step with a
:class:`~kvcache.scheduler.CapacityScheduler`: each engine step runs the scheduled context
requests (whole prompts) and generates one token for every generation request (more with
draft tokens). Output tokens come from the workload, so runs are deterministic.

Workloads are either the built-in seeded multi-turn chat generator
(:func:`default_workload`) or a JSON Lines trace (:func:`read_trace`), one request per line::

    {"request_id": 1, "arrival": 0, "prompt": [1, 2, 3], "output": [4, 5]}

with optional ``"lora_task_id"`` (int), ``"cache_salt"`` (str or int) and ``"priority"``
(int 0..100). ``arrival`` is the engine step at which the request arrives.

Example:
    >>> trace = default_workload(seed=1, num_conversations=4)
    >>> report = simulate(trace, model="gemma-3-1b", memory_bytes=256 * 2**20)
    >>> report.completed == len(trace), report.generated_tokens == sum(
    ...     len(t.output) for t in trace)
    (True, True)
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvcache.config import SHARE_POLICIES, KvCacheConfig
from kvcache.manager import KVCacheManager
from kvcache.models import ModelPreset, load_model
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import CapacityScheduler
from kvcache.sizing import blocks_per_window, format_size, parse_size, resolve_share_policy

__all__ = [
    "DEFAULT_MEMORY",
    "DEFAULT_MODEL",
    "SimulationReport",
    "TraceRequest",
    "WindowReport",
    "default_workload",
    "format_comparison",
    "format_report",
    "plot_reports",
    "read_trace",
    "run_cli",
    "simulate",
    "write_trace",
]

#: The preset simulated when none is given (a VSWA model: 5 sliding layers per full one).
DEFAULT_MODEL = "gemma-3-12b"
#: The primary memory budget simulated when none is given.
DEFAULT_MEMORY = "16GiB"
_DEFAULT_MAX_SEQ_LEN = 8192
_DEFAULT_MAX_BATCH = 128
_VOCAB = 32000
_TRACE_KEYS = frozenset(
    {"request_id", "arrival", "prompt", "output", "lora_task_id", "cache_salt", "priority"}
)


# --------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: its prompt, the tokens it will generate and when it
    arrives."""

    request_id: int
    arrival: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    lora_task_id: int | None = None
    cache_salt: str | int | None = None
    priority: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON Lines object of this request (optional keys only when set)."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "prompt": list(self.prompt),
            "output": list(self.output),
        }
        for key in ("lora_task_id", "cache_salt", "priority"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_trace_line(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(obj) - _TRACE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}")
    for key in ("request_id", "arrival", "prompt", "output"):
        if key not in obj:
            raise ValueError(f"missing {key!r}")
    rid, arrival = obj["request_id"], obj["arrival"]
    if not _is_int(rid):
        raise ValueError(f"'request_id' must be an int, got {rid!r}")
    if not _is_int(arrival) or arrival < 0:
        raise ValueError(f"'arrival' must be an int >= 0, got {arrival!r}")
    tokens: dict[str, tuple[int, ...]] = {}
    for key in ("prompt", "output"):
        value = obj[key]
        if not isinstance(value, list) or not value:
            raise ValueError(f"{key!r} must be a non-empty list of token ids")
        if not all(_is_int(t) and t >= 0 for t in value):
            bad = next(t for t in value if not (_is_int(t) and t >= 0))
            raise ValueError(f"{key!r} holds {bad!r}; token ids are ints >= 0")
        tokens[key] = tuple(value)
    lora = obj.get("lora_task_id")
    if lora is not None and not _is_int(lora):
        raise ValueError(f"'lora_task_id' must be an int, got {lora!r}")
    salt = obj.get("cache_salt")
    if salt is not None and not isinstance(salt, (str, int)):
        raise ValueError(f"'cache_salt' must be a string or an int, got {salt!r}")
    prio = obj.get("priority")
    if prio is not None and not (_is_int(prio) and 0 <= prio <= 100):
        raise ValueError(f"'priority' must be an int in 0..100, got {prio!r}")
    return TraceRequest(rid, arrival, tokens["prompt"], tokens["output"], lora, salt, prio)


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Reads a JSON Lines trace (see the module docstring); blank lines are skipped.

    Raises:
        ValueError: The file cannot be read, or a line is malformed (``FILE:LINE: why``),
            or a request id repeats.

    Example:
        A line ``{"request_id": 3, "arrival": 2, "prompt": [1, 2], "output": [3]}`` becomes
        ``TraceRequest(request_id=3, arrival=2, prompt=(1, 2), output=(3,))``.
    """
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    out: list[TraceRequest] = []
    seen: dict[int, int] = {}
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    req = _parse_trace_line(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
                except ValueError as e:
                    raise ValueError(f"{p}:{lineno}: {e}") from None
                if req.request_id in seen:
                    raise ValueError(
                        f"{p}:{lineno}: request_id {req.request_id} already used on line "
                        f"{seen[req.request_id]}"
                    )
                seen[req.request_id] = lineno
                out.append(req)
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not a UTF-8 text file ({e.reason})") from None
    if not out:
        raise ValueError(f"{p}: the trace holds no requests")
    return out


def write_trace(requests: Iterable[TraceRequest], path: str | os.PathLike[str]) -> None:
    """Writes requests as a JSON Lines trace that :func:`read_trace` reads back."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def default_workload(
    *,
    seed: int = 0,
    num_conversations: int = 400,
    num_system_prompts: int = 6,
    max_seq_len: int = _DEFAULT_MAX_SEQ_LEN,
    mean_gap: float = 30.0,
) -> list[TraceRequest]:
    """A seeded multi-turn chat workload with shared system prompts.

    Conversations start at exponential gaps (mean ``mean_gap`` engine steps) and pick one
    of ``num_system_prompts`` system prompts (200-2,000 tokens, popularity falling as
    1/rank). Each has 1-6 turns; a turn's prompt is the system prompt, the whole history
    (earlier user messages and answers, token for token) and a new user message
    (log-normal, median 150 tokens); answers are log-normal with a median of 250 tokens.
    A follow-up turn arrives after the previous answer would have been generated plus a
    think time of 20-200 steps. Turns that would exceed ``max_seq_len`` end the
    conversation.

    Returns:
        Requests ordered by arrival, with ids 0, 1, 2, ... in that order.

    Example:
        >>> w = default_workload(seed=3, num_conversations=2)
        >>> [r.request_id for r in w] == list(range(len(w)))
        True
    """
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, _VOCAB, int(rng.integers(200, 2001))).tolist()
        for _ in range(num_system_prompts)
    ]
    popularity = 1.0 / np.arange(1, num_system_prompts + 1)
    popularity /= popularity.sum()
    starts = np.cumsum(rng.exponential(mean_gap, num_conversations))
    raw: list[tuple[int, list[int], list[int]]] = []
    for c in range(num_conversations):
        history = list(systems[int(rng.choice(num_system_prompts, p=popularity))])
        arrival = int(starts[c])
        turns = min(6, int(rng.geometric(0.4)))
        for _ in range(turns):
            user_len = int(np.clip(rng.lognormal(math.log(150), 0.8), 8, 2000))
            out_len = int(np.clip(rng.lognormal(math.log(250), 0.7), 16, 1500))
            prompt = history + rng.integers(0, _VOCAB, user_len).tolist()
            if len(prompt) + out_len - 1 > max_seq_len:
                break
            output = rng.integers(0, _VOCAB, out_len).tolist()
            raw.append((arrival, prompt, output))
            history = prompt + output
            arrival += out_len + int(rng.integers(20, 201))
    raw.sort(key=lambda t: t[0])
    return [
        TraceRequest(i, arrival, tuple(prompt), tuple(output))
        for i, (arrival, prompt, output) in enumerate(raw)
    ]


# --------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------


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
    """What one simulation run did. Times are wall-clock and vary between runs."""

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
    host_cache_bytes: int = 0
    secondary_blocks: dict[int, int] = field(default_factory=dict)
    reuse_enabled: bool = True
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)

    def to_dict(self, *, with_series: bool = True) -> dict[str, Any]:
        """JSON-friendly form (per-step series included unless ``with_series`` is false)."""
        d = asdict(self)
        if not with_series:
            d.pop("series")
        return d


def _us(x: float) -> str:
    return f"{x:,.0f} µs" if x >= 10 else f"{x:.1f} µs"


def format_report(r: SimulationReport) -> str:
    """The human-readable report of one run."""
    lines = [
        f"kvcache simulate: {r.model}, {format_size(r.memory_bytes)} primary KV memory, "
        f"{r.shares} window shares, {r.scheduler} scheduling, virtual backend",
        f"  max_batch_size {r.max_batch_size}, max_seq_len {r.max_seq_len:,}, "
        f"tokens_per_block {r.tokens_per_block}"
        + (f", {r.draft_tokens} draft tokens" if r.draft_tokens else ""),
        "  block reuse "
        + (
            f"on (sliding windows: {r.swa_reuse_policy}), host cache "
            + (format_size(r.host_cache_bytes) if r.host_cache_bytes else "none")
            if r.reuse_enabled
            else "off"
        ),
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
        f"  context tokens      {r.context_tokens:,} (prompts, plus recomputation after pauses)",
        f"  concurrency         mean {r.mean_concurrency:.1f}, peak {r.peak_concurrency}",
        f"  paused              {r.paused_requests:,} requests ({r.pause_events:,} pauses)",
        f"  latency (steps)     mean {r.mean_latency_steps:,.0f}, p95 {r.p95_latency_steps:,.0f}",
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
    lines.append(f"  wall time           {r.wall_seconds:.1f} s")
    return "\n".join(lines)


def format_comparison(reports: Sequence[SimulationReport]) -> str:
    """Several runs of one workload side by side (one column per share policy)."""
    rows: list[tuple[str, list[str]]] = [
        ("shares", [r.shares for r in reports]),
        ("engine steps", [f"{r.steps:,}" for r in reports]),
        ("tokens per step", [f"{r.generated_tokens / max(r.steps, 1):.1f}" for r in reports]),
        ("mean concurrency", [f"{r.mean_concurrency:.1f}" for r in reports]),
        ("peak concurrency", [str(r.peak_concurrency) for r in reports]),
        ("paused requests", [f"{r.paused_requests:,}" for r in reports]),
        ("rejected", [f"{r.rejected:,}" for r in reports]),
        ("mean latency", [f"{r.mean_latency_steps:,.0f}" for r in reports]),
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
        f"{first.scheduler}, {first.requests:,} requests",
        "",
    ]
    for label, vals in rows:
        lines.append(f"  {label:<22}" + "".join(f"{v:>{width + 2}}" for v in vals))
    return "\n".join(lines)


def plot_reports(reports: Sequence[SimulationReport], path: str | os.PathLike[str]) -> None:
    """Plots per-window pool use and running requests over the steps (one column per run).

    Raises:
        ValueError: matplotlib is not installed, or the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib (pip install matplotlib)") from None
    n = len(reports)
    fig, axes = plt.subplots(2, n, figsize=(6 * n, 6), sharex="col", squeeze=False)
    for col, r in enumerate(reports):
        steps = r.series["step"]
        top, bottom = axes[0][col], axes[1][col]
        for w in r.windows:
            used = np.asarray(r.series[f"used_{w.window}"]) / w.blocks * 100
            top.plot(steps, used, label=f"window {w.window:,} ({w.blocks:,} blocks)", lw=0.8)
        top.set_ylabel("pool use (%)")
        top.set_ylim(0, 105)
        top.set_title(f"{r.model}, {format_size(r.memory_bytes)}, {r.shares} shares")
        top.legend(loc="lower right", fontsize="small")
        bottom.plot(steps, r.series["running"], color="tab:green", lw=0.8, label="running")
        bottom.plot(steps, r.series["waiting"], color="tab:gray", lw=0.8, label="waiting")
        bottom.set_xlabel("engine step")
        bottom.set_ylabel("requests")
        bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path), dpi=110)
    except OSError as e:
        raise ValueError(f"cannot write plot {os.fspath(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------
# The simulation loop
# --------------------------------------------------------------------------------------


class _Progress:
    def __init__(self, total: int, stream: TextIO | None) -> None:
        self._total = max(total, 1)
        self._stream = stream
        self._last = 0.0

    def update(self, done: int, step: int, running: int, final: bool = False) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        if not final and now - self._last < 0.2:
            return
        self._last = now
        frac = done / self._total
        bar = "#" * int(frac * 30)
        self._stream.write(
            f"\rsimulating [{bar:<30}] {frac:4.0%} {done:,}/{self._total:,} requests, "
            f"step {step:,}, running {running}  "
        )
        if final:
            self._stream.write("\n")
        self._stream.flush()


def simulate(
    trace: Sequence[TraceRequest],
    *,
    model: str | ModelPreset = DEFAULT_MODEL,
    memory_bytes: int | None = None,
    shares: str | Sequence[float] | None = None,
    scheduler: str = "max_utilization",
    max_batch_size: int = _DEFAULT_MAX_BATCH,
    max_seq_len: int | None = None,
    tokens_per_block: int = 32,
    max_num_tokens: int | None = 8192,
    enable_block_reuse: bool = True,
    swa_reuse_policy: str = "placeholder",
    host_cache_bytes: int = 0,
    expected_seq_len: int | None = None,
    draft_tokens: int = 0,
    draft_acceptance: float = 0.6,
    seed: int = 0,
    check_invariants: bool = False,
    progress: TextIO | None = None,
) -> SimulationReport:
    """Replays a workload through a virtual-backend manager and reports what happened.

    Args:
        trace: The requests (any order; they are replayed by arrival step, then id).
        model: A preset name or preset.
        memory_bytes: Primary KV memory budget (default :data:`DEFAULT_MEMORY`).
        shares: Window share policy or list (``None``: environment, else ``"equal"``).
        scheduler: ``"max_utilization"`` or ``"guaranteed_no_evict"``.
        max_batch_size: Most requests running at once.
        max_seq_len: Longest sequence (default: the longest request, within the model's
            context).
        tokens_per_block: Block size.
        max_num_tokens: Token budget per step for admitting prompts (``None``: unlimited).
        enable_block_reuse: Reuse cached prompt prefixes (the config's
            ``enable_block_reuse``).
        swa_reuse_policy: ``"invalidate"`` or ``"placeholder"`` (the config's
            ``swa_reuse_policy``): what reuse does with sliding-window blocks that another
            request reclaimed.
        host_cache_bytes: Secondary (host) memory for offloaded reusable blocks (the
            config's ``host_cache_size``; 0: none).
        expected_seq_len: Typical sequence length for the ``"auto"`` share policy
            (default: the workload's mean prompt + output length).
        draft_tokens: Draft tokens proposed per generation step (speculative decoding).
        draft_acceptance: Probability that each successive draft token is accepted.
        seed: Seeds the draft acceptance.
        check_invariants: Call ``check_invariants()`` after every step (slow).
        progress: Stream for a progress bar (``None``: none).

    Returns:
        The report, with per-step series for plotting.

    Raises:
        ValueError: Bad arguments, shares or budget (one block per window at least).
    """
    preset = model if isinstance(model, ModelPreset) else load_model(model)
    memory = parse_size(DEFAULT_MEMORY) if memory_bytes is None else memory_bytes
    if not trace:
        raise ValueError("the workload holds no requests")
    longest = max(len(t.prompt) + len(t.output) - 1 for t in trace)
    seq_len = max_seq_len if max_seq_len is not None else min(longest, preset.max_context)
    config = preset.kv_cache_config(
        tokens_per_block=tokens_per_block,
        window_size_shares=shares,
        backend="virtual",
        enable_block_reuse=enable_block_reuse,
        swa_reuse_policy=swa_reuse_policy,
        host_cache_size=host_cache_bytes,
    )
    policy, _ = resolve_share_policy(config.window_size_shares)
    share_text = policy if isinstance(policy, str) else ",".join(f"{s:g}" for s in policy)
    expected: int | None = None
    if policy == "auto":
        # "auto" balances windows for a typical sequence: take the workload's mean length.
        expected = expected_seq_len or round(
            sum(min(len(t.prompt) + len(t.output) - 1, seq_len) for t in trace) / len(trace)
        )
        share_text = f"auto(L={expected})"
    blocks = blocks_per_window(
        preset.model, config, seq_len, memory, host_cache_bytes, expected_seq_len=expected
    )
    manager = KVCacheManager.from_blocks(
        preset.model,
        config,
        blocks,
        max_seq_len=seq_len,
        max_batch_size=max_batch_size,
        max_draft_tokens=draft_tokens,
    )
    rm = KVCacheResourceManager(manager)
    sched = CapacityScheduler(rm, scheduler, max_num_tokens=max_num_tokens)
    windows = rm.window_sizes
    layer_windows = config.attention_window_per_layer(preset.model.num_layers, seq_len)
    primary = {w: rm.num_primary_blocks(w) for w in windows}
    rng = np.random.default_rng(seed)

    ordered = sorted(trace, key=lambda t: (t.arrival, t.request_id))
    outputs = {t.request_id: t.output for t in ordered}
    pending = [
        Request(
            t.request_id,
            prompt=t.prompt,
            max_new_tokens=len(t.output),
            lora_task_id=t.lora_task_id,
            cache_salt=t.cache_salt,
            priority=t.priority,
            arrival=t.arrival,
        )
        for t in ordered
    ]
    next_pending = 0
    active: list[Request] = []
    finish_step: dict[int, int] = {}
    paused_ids: set[int] = set()
    pause_events = rejected = generated = context_tokens = reused_tokens = 0
    series: dict[str, list[float]] = {"step": [], "running": [], "waiting": []}
    for w in windows:
        series[f"used_{w}"] = []
    manager_times: list[float] = []
    sched_times: list[float] = []
    bar = _Progress(len(pending), progress)
    wall0 = time.perf_counter()
    step = 0
    while next_pending < len(pending) or active:
        if not active and pending[next_pending].arrival > step:
            step = pending[next_pending].arrival  # idle until the next arrival
        while next_pending < len(pending) and pending[next_pending].arrival <= step:
            active.append(pending[next_pending])
            next_pending += 1
        if draft_tokens:
            for r in active:
                if r.state is RequestState.GENERATION:
                    r.draft_tokens = _propose_drafts(
                        r, outputs, draft_tokens, draft_acceptance, rng
                    )

        t0 = time.perf_counter()
        out = sched.schedule(active)
        t1 = time.perf_counter()
        batch = out.batch
        rejected += len(out.rejected)
        pause_events += len(out.paused)
        paused_ids.update(r.request_id for r in out.paused)
        if len(batch) == 0 and not out.rejected and not out.paused:
            raise RuntimeError(
                f"step {step}: nothing can be scheduled although {len(active)} requests wait; "
                "the pools are too small for the workload"
            )
        rm.prepare_resources(batch)
        t2 = time.perf_counter()
        for r in batch.context_requests:
            context_tokens += batch.chunk_size(r)
            reused_tokens += r.reused_tokens
            r.append_tokens([outputs[r.request_id][r.num_generated]])
            generated += 1
        for r, d in batch.generation:
            g = r.num_generated
            accepted = 0
            while accepted < d and r.draft_tokens[accepted] == outputs[r.request_id][g + accepted]:
                accepted += 1
            r.append_tokens(outputs[r.request_id][g : g + accepted + 1])
            generated += accepted + 1
            r.rewind_len = d - accepted
        t3 = time.perf_counter()
        rm.update_resources(batch)
        done = [r for r in batch.context_requests + batch.generation_requests if r.is_finished]
        for r in done:
            rm.free_resources(r)
            finish_step[r.request_id] = step + 1
        manager.refresh_blocks()
        t4 = time.perf_counter()
        manager_times.append((t2 - t1) + (t4 - t3))
        sched_times.append(t1 - t0)
        if check_invariants:
            manager.check_invariants()

        series["step"].append(step)
        series["running"].append(len(batch))
        waiting = sum(1 for r in active if r.state in (RequestState.WAITING, RequestState.PAUSED))
        series["waiting"].append(waiting)
        for w in windows:
            series[f"used_{w}"].append(primary[w] - rm.get_num_free_blocks(w))
        if done or out.rejected:
            active = [
                r for r in active if r.state not in (RequestState.FINISHED, RequestState.FAILED)
            ]
        step += 1
        bar.update(len(finish_step) + rejected, step, len(batch))
    bar.update(len(finish_step) + rejected, step, 0, final=True)
    wall = time.perf_counter() - wall0

    stats = manager.get_kv_cache_stats()
    lookups = stats.reused_blocks + stats.missed_blocks
    latencies = np.array(
        [finish_step[r.request_id] - r.arrival for r in pending if r.request_id in finish_step],
        dtype=float,
    )
    running = np.array(series["running"], dtype=float)
    mt = np.array(manager_times) * 1e6
    st = np.array(sched_times) * 1e6
    return SimulationReport(
        model=preset.name,
        memory_bytes=memory,
        shares=share_text,
        scheduler=scheduler,
        max_batch_size=max_batch_size,
        max_seq_len=seq_len,
        tokens_per_block=tokens_per_block,
        draft_tokens=draft_tokens,
        windows=[
            WindowReport(
                window=w,
                layers=layer_windows.count(w),
                blocks=primary[w],
                tokens=primary[w] * tokens_per_block,
                peak_used_blocks=int(max(series[f"used_{w}"], default=0)),
                mean_used_blocks=float(np.mean(series[f"used_{w}"])) if running.size else 0.0,
            )
            for w in windows
        ],
        requests=len(pending),
        completed=len(finish_step),
        rejected=rejected,
        steps=len(series["step"]),
        generated_tokens=generated,
        context_tokens=context_tokens,
        mean_concurrency=float(running.mean()) if running.size else 0.0,
        peak_concurrency=int(running.max()) if running.size else 0,
        pause_events=pause_events,
        paused_requests=len(paused_ids),
        mean_latency_steps=float(latencies.mean()) if latencies.size else 0.0,
        p95_latency_steps=float(np.percentile(latencies, 95)) if latencies.size else 0.0,
        manager_us_per_step=float(mt.mean()) if mt.size else 0.0,
        manager_us_p99=float(np.percentile(mt, 99)) if mt.size else 0.0,
        scheduler_us_per_step=float(st.mean()) if st.size else 0.0,
        wall_seconds=wall,
        reused_tokens=reused_tokens,
        cache_hit_rate=float(stats.cache_hit_rate) if lookups > 0 else None,
        reused_blocks=int(stats.reused_blocks),
        offloaded_blocks=int(stats.offloaded_blocks),
        onboarded_blocks=int(stats.onboarded_blocks),
        missed_blocks=int(stats.missed_blocks),
        cache_hit_rate_per_window={
            int(w): float(v) for w, v in stats.cache_hit_rate_per_window_size.items()
        },
        swa_reuse_policy=swa_reuse_policy,
        host_cache_bytes=host_cache_bytes if enable_block_reuse else 0,
        secondary_blocks={int(w): int(v[1]) for w, v in manager.blocks_per_window.items()},
        reuse_enabled=enable_block_reuse,
        series=series,
    )


def _propose_drafts(
    r: Request,
    outputs: dict[int, tuple[int, ...]],
    k: int,
    acceptance: float,
    rng: np.random.Generator,
) -> list[int]:
    """``k`` draft tokens: the true continuation up to a random point, then wrong tokens."""
    truth = outputs[r.request_id][r.num_generated : r.num_generated + k]
    drafts: list[int] = []
    for j in range(k):
        if j < len(truth) and rng.random() < acceptance:
            drafts.append(truth[j])
        else:
            drafts.append((truth[j] + 1) % _VOCAB if j < len(truth) else 0)
            drafts.extend([0] * (k - j - 1))
            break
    return drafts


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _shares_arg(text: str | None) -> str | Sequence[float] | None:
    if text is None:
        return None
    return KvCacheConfig(window_size_shares=text).window_size_shares


def run_cli(args: Any) -> int:
    """Runs ``kvcache simulate`` from parsed arguments (see :mod:`kvcache.cli`)."""
    model = load_model(args.model or DEFAULT_MODEL)
    memory = parse_size(args.memory or DEFAULT_MEMORY)
    shares = _shares_arg(args.shares)
    if args.trace:
        trace = read_trace(args.trace)
    else:
        kwargs: dict[str, Any] = {"seed": args.seed}
        if args.num_requests is not None:
            kwargs["num_conversations"] = args.num_requests
        if args.max_seq_len is not None:
            kwargs["max_seq_len"] = args.max_seq_len
        trace = default_workload(**kwargs)
    show = not args.no_progress and sys.stderr.isatty()
    common: dict[str, Any] = {
        "model": model,
        "memory_bytes": memory,
        "scheduler": args.scheduler,
        "max_batch_size": args.max_batch_size or _DEFAULT_MAX_BATCH,
        "max_seq_len": args.max_seq_len
        if args.max_seq_len is not None
        else (None if args.trace else _DEFAULT_MAX_SEQ_LEN),
        "tokens_per_block": args.tokens_per_block or 32,
        "enable_block_reuse": not args.no_reuse,
        "swa_reuse_policy": getattr(args, "swa_reuse_policy", None) or "placeholder",
        "host_cache_bytes": parse_size(args.host_cache) if getattr(args, "host_cache", None) else 0,
        "draft_tokens": args.draft_tokens,
        "seed": args.seed,
        "progress": sys.stderr if show else None,
    }
    if args.compare_shares:
        policies: list[str | Sequence[float] | None] = list(SHARE_POLICIES)
        if isinstance(shares, tuple) or (shares is not None and shares not in policies):
            policies.append(shares)
        reports = [simulate(trace, shares=p, **common) for p in policies]
        print(format_comparison(reports))
    else:
        reports = [simulate(trace, shares=shares, **common)]
        print(format_report(reports[0]))
    if args.json:
        payload: Any = (
            [r.to_dict() for r in reports] if args.compare_shares else reports[0].to_dict()
        )
        try:
            Path(args.json).write_text(json.dumps(payload) + "\n", encoding="utf-8")
        except OSError as e:
            raise ValueError(f"cannot write {args.json!r}: {e.strerror or e}") from None
    if args.plot:
        plot_reports(reports, args.plot)
    return 0
