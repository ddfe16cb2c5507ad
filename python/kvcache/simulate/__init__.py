"""Workload simulation: replay requests through the manager the way an engine would.

The simulator drives a :class:`~kvcache.resource_manager.KVCacheResourceManager` on the
``virtual`` backend (bookkeeping only, no KV memory) step by step with a
:class:`~kvcache.scheduler.CapacityScheduler`: each engine step runs the scheduled context
requests (prefill chunks that fill the step's token budget by default, or whole prompts) and
generates one token for every generation request (more with draft tokens). Output tokens
come from the workload, so runs are deterministic.

Workloads are either the built-in seeded multi-turn chat generator
(:func:`default_workload`) or a JSON Lines trace (:func:`read_trace`, or :class:`TraceFile`
to stream it), one request per line, in kvcache's format::

    {"request_id": 1, "arrival": 0, "prompt": [1, 2, 3], "output": [4, 5]}

with optional ``"lora_task_id"`` (int), ``"cache_salt"`` (str or int) and ``"priority"``
(int 0..100), ``arrival`` being the engine step at which the request arrives; or in
Mooncake's (:mod:`~kvcache.simulate.mooncake`: ``timestamp``, ``input_length``,
``output_length``, ``hash_ids``), tokens synthesized per hash id.

Modules: :mod:`~kvcache.simulate.workload` (traces, the built-in workload),
:mod:`~kvcache.simulate.mooncake` (Mooncake's format), :mod:`~kvcache.simulate.bounds`
(offline hit-rate bounds and the lost-hit split),
:mod:`~kvcache.simulate.loop` (:func:`simulate`), :mod:`~kvcache.simulate.report` (text and
JSON reports), :mod:`~kvcache.simulate.plot` (matplotlib) and
:mod:`~kvcache.simulate.command` (``kvcache simulate``).

Example:
    >>> trace = default_workload(seed=1, num_conversations=4)
    >>> report = simulate(trace, model="gemma-3-1b", memory_bytes=256 * 2**20)
    >>> report.completed == len(trace), report.generated_tokens == sum(
    ...     len(t.output) for t in trace)
    (True, True)
"""

from __future__ import annotations

from kvcache.simulate.bounds import (
    HitBounds,
    KeyTrace,
    RunRecord,
    analyze_run,
    belady_hits,
    ideal_hits,
    key_trace,
    lru_hits,
)
from kvcache.simulate.loop import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    MAX_SIMULATED_BLOCKS,
    simulate,
    simulation_blocks,
    trace_lengths,
)
from kvcache.simulate.mooncake import DEFAULT_STEP_MS
from kvcache.simulate.options import EngineOptions
from kvcache.simulate.plot import plot_reports
from kvcache.simulate.report import (
    SimulationReport,
    WindowReport,
    format_comparison,
    format_report,
    report_json,
)
from kvcache.simulate.workload import (
    ARRIVAL_MODES,
    DEFAULT_CONVERSATIONS,
    MAX_REQUEST_ID,
    MAX_TOKEN_ID,
    TraceFile,
    TraceRequest,
    TraceSummary,
    default_workload,
    iter_trace,
    read_trace,
    write_trace,
)

__all__ = [
    "ARRIVAL_MODES",
    "DEFAULT_CONVERSATIONS",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MEMORY",
    "DEFAULT_MODEL",
    "DEFAULT_STEP_MS",
    "MAX_REQUEST_ID",
    "MAX_SIMULATED_BLOCKS",
    "MAX_TOKEN_ID",
    "EngineOptions",
    "HitBounds",
    "KeyTrace",
    "RunRecord",
    "SimulationReport",
    "TraceFile",
    "TraceRequest",
    "TraceSummary",
    "WindowReport",
    "analyze_run",
    "belady_hits",
    "default_workload",
    "format_comparison",
    "format_report",
    "ideal_hits",
    "iter_trace",
    "key_trace",
    "lru_hits",
    "plot_reports",
    "read_trace",
    "report_json",
    "simulate",
    "simulation_blocks",
    "trace_lengths",
    "write_trace",
]
