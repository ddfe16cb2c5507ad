"""A fleet of simulated engines behind a router: ``kvcache simulate --engines N --router R``.

:func:`simulate_fleet` builds ``N`` engines (same model, memory and config each), each a
virtual-backend manager driven step by step exactly as :func:`~kvcache.simulate.simulate`
drives its one engine (both use ``loop.SimulatedEngine``), on one shared clock of engine steps. A
request is routed when it arrives (before that step runs) and stays on its engine:

* ``round-robin``: request ``i`` (in arrival order) goes to engine ``i % N``;
* ``least-loaded``: the engine holding the fewest requests (running plus waiting), the
  lowest index on a tie;
* ``kv``: a :class:`~kvcache.router.KvIndexer` fed only by the engines' KV event streams
  picks the engine that would reuse the longest prefix of the prompt
  (:meth:`~kvcache.router.KvIndexer.best_engine`), with the load above as the tie-break.
  After every step each engine's events go through :class:`~kvcache.events.EventBatcher`
  (the msgpack ``KVEventBatch`` payloads a ``ZmqEventPublisher`` sends) and the raw payloads
  into :meth:`~kvcache.router.KvIndexer.apply`: the wire format is exercised, no socket is
  opened. Needs ``pip install 'kvcache[events]'``.

The router sees the engines as they were after the previous step: requests that arrive in
the same step do not see each other's blocks, and a request that waits in an engine's queue
may find more (blocks stored meanwhile) or less (blocks evicted meanwhile) than the router
predicted. With ``enable_partial_reuse`` (on by default) an engine also reuses part of the
block after the predicted prefix, so it may find up to ``tokens_per_block - 1`` tokens more.
:class:`FleetReport` counts how often the prediction was exact, over or under.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO, cast

import numpy as np

from kvcache._extras import install_hint
from kvcache.cache.fields import is_int
from kvcache.cache.sizing import format_size
from kvcache.serving.resource_manager import Request
from kvcache.simulate.loop import (
    ProgressBar,
    SimulatedEngine,
    engine_setup,
    scheduler_requests,
)
from kvcache.simulate.options import EngineOptions, engine_options
from kvcache.simulate.report import SimulationReport
from kvcache.simulate.workload import TraceRequest

__all__ = [
    "MAX_ENGINES",
    "ROUTERS",
    "FleetReport",
    "format_fleet_report",
    "format_router_comparison",
    "simulate_fleet",
]

#: The routers :func:`simulate_fleet` knows.
ROUTERS = ("kv", "round-robin", "least-loaded")
#: Most engines in one simulated fleet (each is a whole manager).
MAX_ENGINES = 64
#: Events each engine's manager may buffer between two steps (they are drained every step).
_EVENT_BUFFER = 1_000_000


@dataclass
class FleetReport:
    """What a fleet run did: one :class:`SimulationReport` per engine and the fleet's totals.

    ``cache_hit_rate`` is the fleet's block hit rate (reused blocks over blocks looked up,
    all engines together; ``None`` when nothing was looked up); ``reused_tokens`` and
    ``context_tokens`` sum the engines'. ``assigned`` counts the requests routed to each
    engine, ``placement`` maps each request id to its engine. ``load_imbalance`` is max
    over mean of the engines' running requests (batch sizes), averaged over the steps in
    which any request ran (1.0 is perfect balance, ``N`` is one engine doing all the work).
    ``steps`` counts the steps in which any engine ran.

    For the ``kv`` router, ``predicted_tokens`` sums the prompt tokens the router predicted
    each request would reuse on the engine it chose, and ``found_tokens`` what those requests
    reused when their engine registered them (requests never registered, i.e. rejected, are
    left out); ``predicted_exact``, ``predicted_over`` and ``predicted_under`` count requests
    whose prediction was equal to, above or below what they found. ``None`` for the other
    routers, which predict nothing. ``lost_events`` counts engine events lost to a full event
    buffer (the index then forgets that engine's blocks; 0 in any normal run).
    """

    router: str
    num_engines: int
    engines: list[SimulationReport]
    assigned: list[int]
    placement: dict[int, int]
    requests: int
    completed: int
    rejected: int
    steps: int
    cache_hit_rate: float | None
    reused_blocks: int
    missed_blocks: int
    reused_tokens: int
    context_tokens: int
    load_imbalance: float
    predicted_tokens: int | None = None
    found_tokens: int | None = None
    predicted_exact: int | None = None
    predicted_over: int | None = None
    predicted_under: int | None = None
    lost_events: int = 0
    wall_seconds: float = 0.0
    series: dict[str, list[float]] = field(default_factory=dict, repr=False)

    @property
    def reused_token_share(self) -> float:
        """Reused prompt tokens over context tokens, all engines together."""
        return self.reused_tokens / max(self.context_tokens, 1)

    def to_dict(self, *, with_series: bool = False) -> dict[str, Any]:
        """JSON-friendly form (per-step series, fleet and engines', only with ``with_series``)."""
        d = dataclasses.asdict(self)
        d["engines"] = [e.to_dict(with_series=with_series) for e in self.engines]
        d["reused_token_share"] = self.reused_token_share
        if not with_series:
            d.pop("series")
        return d


class _KvRoute:
    """The ``kv`` router: an index fed by the engines' event payloads."""

    def __init__(self, engines: Sequence[SimulatedEngine]) -> None:
        try:
            from kvcache.fleet.events import EventBatcher
            from kvcache.fleet.router import KvIndexer
        except ImportError as e:
            raise ImportError(
                f"the kv router needs the events extra: {install_hint('events')} ({e})"
            ) from e
        self.index = KvIndexer()
        self.batchers = [EventBatcher(e.manager) for e in engines]
        for i in range(len(engines)):
            self.index.add_engine(i)

    def pick(self, t: TraceRequest, load: Callable[[Any], float]) -> tuple[int, int]:
        engine, tokens = self.index.best_engine(
            t.prompt, lora_id=t.lora_task_id, cache_salt=t.cache_salt, load=load
        )
        return cast(int, engine), tokens  # the index's engine ids are the fleet's indices

    def feed(self) -> None:
        """Applies every engine's events of the step just run, as wire payloads."""
        for i, batcher in enumerate(self.batchers):
            payload = batcher.batch()
            if payload is not None:
                self.index.apply(i, payload)

    @property
    def lost_events(self) -> int:
        return sum(b.num_lost_events for b in self.batchers)


def simulate_fleet(
    trace: Sequence[TraceRequest],
    options: EngineOptions | None = None,
    *,
    engines: int = 2,
    router: str = "kv",
    progress: TextIO | None = None,
    **changes: Any,
) -> FleetReport:
    """Replays a workload through ``engines`` simulated engines behind ``router``.

    Every engine gets what :func:`~kvcache.simulate.simulate` would build for these
    arguments (``memory_bytes`` is per engine) and is stepped the same way; with one engine
    the engine's report equals :func:`~kvcache.simulate.simulate`'s (timings aside). Engine
    ``i`` seeds its draft acceptance with ``seed`` (``i == 0``) or ``[seed, i]``.

    Args:
        trace: The requests (routed by arrival step, then id).
        engines: Engines in the fleet, 1 to :data:`MAX_ENGINES`.
        router: ``"kv"``, ``"round-robin"`` or ``"least-loaded"`` (see the module).
        options, **changes: Every engine's options, as for :func:`~kvcache.simulate.simulate`
            (``memory_bytes`` is per engine; ``enable_partial_reuse=False`` makes the ``kv``
            router's predictions exact whenever nothing changed between routing and
            registration).
        progress: As for :func:`~kvcache.simulate.simulate`.

    Returns:
        The fleet's report, with each engine's.

    Raises:
        ValueError: A bad ``engines`` or ``router``; what :func:`~kvcache.simulate.simulate`
            raises for the other arguments.
        ImportError: The ``kv`` router without ``kvcache[events]``.
        RuntimeError: An engine cannot schedule anything (pools too small).
    """
    if not is_int(engines):
        raise ValueError(f"engines must be an int in 1..{MAX_ENGINES}, got {engines!r}")
    if not 1 <= engines <= MAX_ENGINES:
        raise ValueError(f"engines must be in 1..{MAX_ENGINES}, got {engines}")
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {', '.join(ROUTERS)}; got {router!r}")
    opts = engine_options(options, changes, caller="simulate_fleet")
    setup = engine_setup(trace, opts)
    config = dataclasses.replace(
        setup.config, event_buffer_max_size=_EVENT_BUFFER if router == "kv" else 0
    )
    outputs = {t.request_id: t.output for t in trace}
    fleet = [
        SimulatedEngine(
            setup,
            config,
            outputs,
            opts,
            rng=np.random.default_rng([opts.seed, i] if i else opts.seed),
        )
        for i in range(engines)
    ]
    kv = _KvRoute(fleet) if router == "kv" else None
    run = _run(fleet, trace, router, kv, progress)
    reports = [e.report(wall_seconds=run.wall, options=opts) for e in fleet]
    return _fleet_report(router, fleet, reports, run, kv)


@dataclass
class _Run:
    assigned: list[int]
    placement: dict[int, int]
    predicted: dict[int, tuple[int, int]]  # request id -> (engine, tokens predicted)
    imbalance: list[float]
    series: dict[str, list[float]]
    wall: float


def _run(
    fleet: list[SimulatedEngine],
    trace: Sequence[TraceRequest],
    router: str,
    kv: _KvRoute | None,
    progress: TextIO | None,
) -> _Run:
    """Routes and steps the whole trace on one clock of engine steps."""
    by_id = {t.request_id: t for t in trace}
    pending: list[Request] = scheduler_requests(trace)
    n = len(fleet)
    run = _Run([0] * n, {}, {}, [], {"step": [], "running": [], "imbalance": []}, 0.0)

    def load(e: Any) -> float:
        return float(len(fleet[int(e)].active))

    bar = ProgressBar(len(pending), progress)
    wall0 = time.perf_counter()
    step = next_pending = 0
    while next_pending < len(pending) or any(e.active for e in fleet):
        if not any(e.active for e in fleet) and pending[next_pending].arrival > step:
            step = pending[next_pending].arrival  # the fleet idles until the next arrival
        while next_pending < len(pending) and pending[next_pending].arrival <= step:
            r = pending[next_pending]
            if kv is not None:
                target, tokens = kv.pick(by_id[r.request_id], load)
                run.predicted[r.request_id] = (target, tokens)
            elif router == "round-robin":
                target = next_pending % n
            else:
                target = min(range(n), key=lambda i: (len(fleet[i].active), i))
            fleet[target].admit(r)
            run.assigned[target] += 1
            run.placement[r.request_id] = target
            next_pending += 1
        running = [e.step(step) if e.active else 0 for e in fleet]
        if kv is not None:
            kv.feed()
        mean = sum(running) / n
        if mean > 0:  # a step that ran nothing (only rejections or pauses) is not counted
            run.imbalance.append(max(running) / mean)
        run.series["step"].append(step)
        run.series["running"].append(sum(running))
        run.series["imbalance"].append(max(running) / mean if mean > 0 else 1.0)
        step += 1
        bar.update(sum(e.num_done for e in fleet), len(run.series["step"]), sum(running))
    bar.update(sum(e.num_done for e in fleet), len(run.series["step"]), 0, final=True)
    run.wall = time.perf_counter() - wall0
    return run


def _fleet_report(
    router: str,
    fleet: list[SimulatedEngine],
    reports: list[SimulationReport],
    run: _Run,
    kv: _KvRoute | None,
) -> FleetReport:
    reused = sum(r.reused_blocks for r in reports)
    missed = sum(r.missed_blocks for r in reports)
    out = FleetReport(
        router=router,
        num_engines=len(fleet),
        engines=reports,
        assigned=run.assigned,
        placement=run.placement,
        requests=sum(r.requests for r in reports),
        completed=sum(r.completed for r in reports),
        rejected=sum(r.rejected for r in reports),
        steps=len(run.series["step"]),
        cache_hit_rate=reused / (reused + missed) if reused + missed else None,
        reused_blocks=reused,
        missed_blocks=missed,
        reused_tokens=sum(r.reused_tokens for r in reports),
        context_tokens=sum(r.context_tokens for r in reports),
        load_imbalance=float(np.mean(run.imbalance)) if run.imbalance else 1.0,
        wall_seconds=run.wall,
        series=run.series,
    )
    if kv is not None:
        pairs = [
            (tokens, fleet[e].first_reuse[rid])
            for rid, (e, tokens) in run.predicted.items()
            if rid in fleet[e].first_reuse
        ]
        out.predicted_tokens = sum(p for p, _ in pairs)
        out.found_tokens = sum(f for _, f in pairs)
        out.predicted_exact = sum(1 for p, f in pairs if p == f)
        out.predicted_over = sum(1 for p, f in pairs if p > f)
        out.predicted_under = sum(1 for p, f in pairs if p < f)
        out.lost_events = kv.lost_events
    return out


def _mean_latency(r: FleetReport) -> float:
    """Mean latency (steps) over every completed request of the fleet."""
    done = sum(e.completed for e in r.engines)
    return sum(e.mean_latency_steps * e.completed for e in r.engines) / max(done, 1)


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def format_fleet_report(r: FleetReport, *, workload: str | None = None) -> str:
    """The human-readable report of one fleet run: the fleet, then one row per engine."""
    first = r.engines[0]
    lines = [
        f"kvcache simulate: {r.num_engines} engines, {r.router} router; each {first.model}, "
        f"{format_size(first.memory_bytes)} primary KV memory, {first.shares} window shares, "
        f"{first.scheduler} scheduling, virtual backend",
        *([f"  workload: {workload}"] if workload else []),
        "",
        f"  requests            {r.requests:,} ({r.completed:,} completed"
        + (f", {r.rejected:,} rejected: can never fit" if r.rejected else "")
        + ")",
        f"  fleet steps         {r.steps:,}",
        f"  fleet hit rate      {_rate(r.cache_hit_rate)} ({r.reused_blocks:,} blocks reused, "
        f"{r.missed_blocks:,} missed); {r.reused_tokens:,} prompt tokens reused "
        f"({r.reused_token_share:.1%} of context tokens)",
        f"  load imbalance      {r.load_imbalance:.2f} (max / mean running requests, mean over "
        "steps; 1.00 is even)",
    ]
    if r.predicted_tokens is not None:
        lines += [
            f"  router predicted    {r.predicted_tokens:,} reused tokens; the engines found "
            f"{r.found_tokens:,}",
            f"                      per request: {r.predicted_exact:,} exact, "
            f"{r.predicted_under:,} found more, {r.predicted_over:,} found less"
            + (f"; {r.lost_events:,} events lost" if r.lost_events else ""),
        ]
    lines += [
        "",
        f"  {'engine':>6} {'requests':>9} {'steps':>8} {'hit rate':>9} {'reused tokens':>14} "
        f"{'mean running':>13} {'peak':>5} {'mean latency (steps)':>21}",
    ]
    for i, (e, n) in enumerate(zip(r.engines, r.assigned, strict=True)):
        lines.append(
            f"  {i:>6} {n:>9,} {e.steps:>8,} {_rate(e.cache_hit_rate):>9} "
            f"{e.reused_tokens:>14,} {e.mean_concurrency:>13.1f} {e.peak_concurrency:>5} "
            f"{e.mean_latency_steps:>21,.0f}"
        )
    lines.append(f"  wall time           {r.wall_seconds:.1f} s")
    return "\n".join(lines)


def format_router_comparison(reports: Sequence[FleetReport], *, workload: str | None = None) -> str:
    """Fleet runs of one workload side by side, one column per router."""
    rows: list[tuple[str, list[str]]] = [
        ("router", [r.router for r in reports]),
        ("fleet hit rate", [_rate(r.cache_hit_rate) for r in reports]),
        ("reused tokens", [f"{r.reused_tokens:,}" for r in reports]),
        ("of context tokens", [f"{r.reused_token_share:.1%}" for r in reports]),
        ("load imbalance", [f"{r.load_imbalance:.2f}" for r in reports]),
        ("fleet steps", [f"{r.steps:,}" for r in reports]),
        (
            "mean latency (steps)",
            [f"{_mean_latency(r):,.0f}" for r in reports],
        ),
        ("rejected", [f"{r.rejected:,}" for r in reports]),
        (
            "predicted / found",
            [
                "-"
                if r.predicted_tokens is None
                else f"{r.predicted_tokens:,} / {r.found_tokens:,}"
                for r in reports
            ],
        ),
        ("requests per engine", ["/".join(str(n) for n in r.assigned) for r in reports]),
    ]
    width = max(14, *(len(v) for _, vals in rows for v in vals))
    first = reports[0].engines[0]
    lines = [
        f"kvcache simulate --compare-routers: {reports[0].num_engines} engines, each "
        f"{first.model}, {format_size(first.memory_bytes)}, {first.shares} shares, "
        f"{reports[0].requests:,} requests",
        *([f"  workload: {workload}"] if workload else []),
        "",
    ]
    for label, vals in rows:
        lines.append(f"  {label:<22}" + "".join(f"{v:>{width + 2}}" for v in vals))
    return "\n".join(lines)
