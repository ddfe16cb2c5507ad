"""The simulation loop: replay requests through the manager the way an engine would.

:func:`simulate` drives a :class:`~kvcache.resource_manager.KVCacheResourceManager` on the
``virtual`` backend (bookkeeping only, no KV memory) step by step with a
:class:`~kvcache.scheduler.CapacityScheduler`: each engine step runs the scheduled context
requests (prefill chunks that fill the step's token budget by default, or whole prompts)
and generates one token for every generation request (more with draft tokens). Output tokens
come from the workload, so runs are deterministic.
"""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TextIO

import numpy as np

from kvcache.cache.config import KvCacheConfig
from kvcache.cache.manager import KVCacheManager
from kvcache.cache.sizing import (
    blocks_per_window,
    bytes_per_token,
    format_size,
    parse_size,
    resolve_share_policy,
)
from kvcache.models import ModelPreset, load_model
from kvcache.serving.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.serving.scheduler import CapacityScheduler
from kvcache.simulate.bounds import KeyTrace, RunRecord, analyze_run
from kvcache.simulate.bounds import key_trace as make_key_trace
from kvcache.simulate.options import (
    DEFAULT_MAX_BATCH_SIZE,
    DEFAULT_MEMORY,
    DEFAULT_MODEL,
    EngineOptions,
    engine_options,
)
from kvcache.simulate.report import SimulationReport, WindowReport
from kvcache.simulate.workload import VOCAB, TraceFile, TraceRequest

__all__ = [
    "BOOKKEEPING_BYTES_PER_BLOCK",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MEMORY",
    "DEFAULT_MODEL",
    "MAX_SIMULATED_BLOCKS",
    "EngineOptions",
    "EngineSetup",
    "ProgressBar",
    "SimulatedEngine",
    "engine_setup",
    "scheduler_requests",
    "simulate",
    "simulation_blocks",
    "trace_lengths",
]

#: Host memory the native manager keeps per block for its bookkeeping, even on the
#: virtual backend (reference counts, owners, free-queue links, tree links), roughly.
BOOKKEEPING_BYTES_PER_BLOCK = 70
#: Most blocks (all windows, primary plus secondary) a simulation may have: about 2.2 GiB
#: of bookkeeping. Real pools are far smaller (an 80 GiB GPU holds tens of thousands of
#: blocks); larger counts come from typos such as ``--memory 1000TiB``.
MAX_SIMULATED_BLOCKS = 2**25


class ProgressBar:
    """A one-line progress bar: requests done and engine steps run (as in the report)."""

    def __init__(self, total: int | None, stream: TextIO | None) -> None:
        self._total = None if total is None else max(total, 1)
        self._stream = stream
        self._last = 0.0

    def update(self, done: int, steps: int, running: int, final: bool = False) -> None:
        if self._stream is None:
            return
        now = time.monotonic()
        if not final and now - self._last < 0.2:
            return
        self._last = now
        if self._total is None:  # a stream of unknown length
            head = f"simulating {done:,} requests"
        else:
            frac = done / self._total
            bar = "#" * int(frac * 30)
            head = f"simulating [{bar:<30}] {frac:4.0%} {done:,}/{self._total:,} requests"
        self._stream.write(f"\r{head}, {steps:,} engine steps, running {running}  ")
        if final:
            self._stream.write("\n")
        self._stream.flush()


@dataclass(frozen=True)
class EngineSetup:
    """What a run's engines are built from: the preset, its config and the pools."""

    preset: ModelPreset
    config: KvCacheConfig
    memory: int
    seq_len: int
    blocks: dict[int, tuple[int, int]]
    share_text: str
    expected_seq_len: int | None
    disk: dict[int, int]

    def state_slots(self, max_batch_size: int) -> int | None:
        """Slots of the recurrent state pool: the primary memory the windows' blocks leave
        (``None`` without recurrent layers)."""
        model = self.preset.model
        if model.recurrent_layers == 0:
            return None
        per_token = bytes_per_token(model, self.config, self.seq_len)
        tpb = self.config.tokens_per_block
        used = sum(p * per_token[w] * tpb for w, (p, _) in self.blocks.items())
        slots = (self.memory - used) // model.state_bytes_per_sequence()
        if slots <= max_batch_size:
            raise ValueError(
                f"{format_size(self.memory)} leaves {format_size(self.memory - used)} for the "
                f"recurrent state: {slots} slots of {model.state_bytes_per_sequence():,} B, but "
                f"max_batch_size {max_batch_size} needs more than {max_batch_size} (a working "
                "slot per sequence and room for checkpoints); give more memory, a larger state "
                "share (--shares) or a smaller --max-batch-size"
            )
        return int(slots)


def trace_lengths(trace: Iterable[TraceRequest] | TraceFile) -> Sequence[int] | None:
    """Prompt plus output minus one of each request of a list or :class:`TraceFile` (the
    file is scanned once), ``None`` for any other iterable (a stream read once)."""
    if isinstance(trace, TraceFile):
        return trace.scan().lengths
    if isinstance(trace, Sequence):
        return [len(t.prompt) + len(t.output) - 1 for t in trace]
    return None


def engine_setup(trace: Iterable[TraceRequest] | TraceFile, options: EngineOptions) -> EngineSetup:
    """Sizes the pools of a run's engines (``options``) for ``trace``; raises what
    :func:`simulate` raises for bad sizing."""
    model, max_seq_len = options.model, options.max_seq_len
    memory_bytes, host_cache_bytes = options.memory_bytes, options.host_cache_bytes
    expected_seq_len, draft_tokens = options.expected_seq_len, options.draft_tokens
    disk_cache_bytes = options.disk_bytes_used
    preset = model if isinstance(model, ModelPreset) else load_model(model)
    memory = parse_size(DEFAULT_MEMORY) if memory_bytes is None else memory_bytes
    lengths = trace_lengths(trace)
    if lengths is not None and not lengths:
        raise ValueError("the workload holds no requests")
    if lengths is None and max_seq_len is None:
        raise ValueError(
            "a stream of requests (not a list or TraceFile) needs max_seq_len: the longest "
            "request cannot be known before the stream is read"
        )
    if max_seq_len is not None:
        seq_len = max_seq_len
    else:
        assert lengths is not None
        seq_len = min(max(lengths), preset.max_context)
    config = preset.kv_cache_config(
        tokens_per_block=options.tokens_per_block,
        window_size_shares=options.shares,
        backend="virtual",
        enable_block_reuse=options.enable_block_reuse,
        enable_partial_reuse=options.enable_partial_reuse,
        swa_reuse_policy=options.swa_reuse_policy,
        protect_reused_blocks=options.protect_reused_blocks,
        host_cache_size=host_cache_bytes,
        disk_cache_size=disk_cache_bytes,
        lend_free_memory=options.lend_free_memory,
    )
    policy, _ = resolve_share_policy(config.window_size_shares)
    share_text = policy if isinstance(policy, str) else ",".join(f"{s:g}" for s in policy)
    expected: int | None = None
    if policy == "auto":
        # "auto" balances windows for a typical sequence: take the workload's mean length.
        if not expected_seq_len and lengths is None:
            raise ValueError(
                "the 'auto' share policy sizes for the workload's mean length: give "
                "expected_seq_len for a stream of requests"
            )
        expected = expected_seq_len or round(
            sum(min(n, seq_len) for n in lengths or ()) / max(len(lengths or ()), 1)
        )
        share_text = f"auto(L={expected})"
    blocks = blocks_per_window(
        preset.model,
        config,
        seq_len,
        memory,
        host_cache_bytes,
        expected_seq_len=expected,
        max_draft_tokens=draft_tokens,
    )
    disk = {w: 0 for w in blocks}
    if disk_cache_bytes:  # split over the windows like the host cache
        sized = blocks_per_window(
            preset.model,
            config,
            seq_len,
            memory,
            disk_cache_bytes,
            expected_seq_len=expected,
            max_draft_tokens=draft_tokens,
        )
        disk = {w: c[1] for w, c in sized.items()}
    total_blocks = sum(p + s + disk[w] for w, (p, s) in blocks.items())
    if total_blocks > MAX_SIMULATED_BLOCKS:
        raise ValueError(
            f"{format_size(memory)} of primary"
            + (f" and {format_size(host_cache_bytes)} of host" if host_cache_bytes else "")
            + (f" and {format_size(disk_cache_bytes)} of disk" if disk_cache_bytes else "")
            + f" memory make {total_blocks:,} blocks; the manager keeps about "
            f"{BOOKKEEPING_BYTES_PER_BLOCK} bytes of bookkeeping per block, so a simulation "
            f"is limited to {MAX_SIMULATED_BLOCKS:,} blocks "
            f"({format_size(MAX_SIMULATED_BLOCKS * BOOKKEEPING_BYTES_PER_BLOCK)}); "
            "give less memory or more tokens per block"
        )
    return EngineSetup(preset, config, memory, seq_len, blocks, share_text, expected, disk)


def simulation_blocks(
    trace: Sequence[TraceRequest] | TraceFile,
    options: EngineOptions | None = None,
    **changes: Any,
) -> dict[int, tuple[int, int]]:
    """The ``(primary, secondary)`` blocks per window that :func:`simulate` would use.

    Cheap (no manager is built): checks a run's sizing before starting it. ``options`` and
    the keyword ``changes`` mean what they mean for :func:`simulate` (only the sizing fields
    matter: model, memory, shares, max_seq_len, tokens_per_block, host and disk cache,
    expected_seq_len).

    Raises:
        ValueError: Exactly what :func:`simulate` raises for these arguments before it runs.
        TypeError: A keyword that is no :class:`~kvcache.simulate.options.EngineOptions` field.
    """
    opts = engine_options(options, changes, caller="simulation_blocks")
    # The disk tier is sized whether or not the run reuses (simulate sizes it only with).
    return engine_setup(trace, dataclasses.replace(opts, enable_block_reuse=True)).blocks


def simulate(
    trace: Iterable[TraceRequest] | TraceFile,
    options: EngineOptions | None = None,
    *,
    progress: TextIO | None = None,
    hit_bounds: bool = False,
    key_trace: KeyTrace | None = None,
    belady: bool = True,
    **changes: Any,
) -> SimulationReport:
    """Replays a workload through a virtual-backend manager and reports what happened.

    Args:
        trace: The requests: a list (any order; replayed by arrival step, then id), a
            :class:`~kvcache.simulate.workload.TraceFile` (streamed in file order when its
            arrivals never decrease, else read whole and sorted) or any iterable in arrival
            order (streamed; needs ``max_seq_len``, and ``expected_seq_len`` for ``"auto"``
            shares). A streamed request is read when it has arrived and the engine holds
            fewer than ``2 * max_batch_size`` requests (running ones included; the scheduler
            admits first come, first served, at most ``max_batch_size`` at a time), and its
            tokens are dropped when it finishes, so a long trace never sits in memory whole.
            The run is the list's, except that more than ``max_batch_size`` requests in a
            row that can never fit are rejected over several steps instead of one.
        options: The engine (:class:`~kvcache.simulate.options.EngineOptions`: model,
            memory, shares, scheduler, batch and step limits, cache policy, host and disk
            cache, drafts, seed, ``check_invariants``); ``None``: the defaults.
        **changes: Any :class:`~kvcache.simulate.options.EngineOptions` field as a keyword
            (``simulate(trace, memory_bytes=2**30)``), applied to ``options``.
        progress: Stream for a progress bar (``None``: none).
        hit_bounds: Set the run beside the trace's offline bounds
            (:mod:`kvcache.simulate.bounds`): the report's ``hit_bounds``. Reads the trace
            once more before the run (not possible for a one-shot stream without
            ``key_trace``).
        key_trace: The trace's keys at ``tokens_per_block``, computed once for several runs
            (:func:`~kvcache.simulate.bounds.key_trace`); implies ``hit_bounds``.
        belady: With ``hit_bounds``, also the Belady bound (one more pass).

    Returns:
        The report, with per-step series for plotting.

    Raises:
        ValueError: Bad arguments, shares or budget: at least one block per window, and at
            most :data:`MAX_SIMULATED_BLOCKS` blocks in all (the manager keeps about
            :data:`BOOKKEEPING_BYTES_PER_BLOCK` bytes of bookkeeping per block); a stream
            whose arrivals decrease.
    """
    opts = engine_options(options, changes, caller="simulate")
    if isinstance(trace, TraceFile) and not trace.scan().in_order:
        trace = sorted(trace, key=lambda t: (t.arrival, t.request_id))
    setup = engine_setup(trace, opts)
    tokens_per_block, max_batch_size = opts.tokens_per_block, opts.max_batch_size
    keys: KeyTrace | None = None
    if opts.enable_block_reuse and (hit_bounds or key_trace is not None):
        keys = key_trace
        if keys is None:
            if not isinstance(trace, (Sequence, TraceFile)):
                raise ValueError(
                    "hit_bounds reads the trace once more: give a list, a TraceFile or "
                    "key_trace, not a one-shot stream"
                )
            keys = make_key_trace(trace, tokens_per_block)
        elif keys.tokens_per_block != tokens_per_block:
            raise ValueError(
                f"key_trace is keyed at {keys.tokens_per_block} tokens per block, the run "
                f"at {tokens_per_block}"
            )
    engine = SimulatedEngine(
        setup, setup.config, {}, opts, rng=np.random.default_rng(opts.seed), record=keys is not None
    )
    if isinstance(trace, Sequence):
        in_order = sorted(trace, key=lambda t: (t.arrival, t.request_id))
        ordered: Iterable[TraceRequest] = in_order
        arrivals: Sequence[int] | None = [t.arrival for t in in_order]
    elif isinstance(trace, TraceFile):
        ordered, arrivals = trace, trace.scan().arrivals
    else:
        ordered, arrivals = trace, None
    source = iter(ordered)
    # A list is in memory already: every arrived request waits in the engine, as before. A
    # stream is read only as far as the scheduler looks (first come, first served, at most
    # max_batch_size admissions a step).
    ahead = 2 * max_batch_size
    if isinstance(trace, Sequence):
        ahead = max(ahead, len(trace))
    bar = ProgressBar(len(arrivals) if arrivals is not None else None, progress)
    wall0 = time.perf_counter()
    step = pulled = last = 0
    nxt = next(source, None)
    while nxt is not None or engine.active:
        if not engine.active and nxt is not None and nxt.arrival > step:
            step = nxt.arrival  # idle until the next arrival
        while nxt is not None and nxt.arrival <= step and len(engine.active) < ahead:
            if nxt.arrival < last:
                raise ValueError(
                    f"request {nxt.request_id} arrives at step {nxt.arrival}, before the one "
                    f"read before it (step {last}): a stream must come in arrival order"
                )
            last = nxt.arrival
            engine.admit(_request(nxt), nxt.output)
            pulled += 1
            nxt = next(source, None)
        engine.unread = bisect.bisect_right(arrivals, step) - pulled if arrivals is not None else 0
        running = engine.step(step)
        step += 1
        bar.update(engine.num_done, engine.num_steps, running)
    bar.update(engine.num_done, engine.num_steps, 0, final=True)
    report = engine.report(wall_seconds=time.perf_counter() - wall0, options=opts)
    if keys is not None:
        window = max(setup.blocks)
        primary, secondary = setup.blocks[window]
        report.hit_bounds = analyze_run(
            keys,
            engine.run_record(),
            capacity_blocks=primary + secondary + setup.disk[window],
            capacity_window=window,
            belady=belady,
        )
    return report


def _request(t: TraceRequest) -> Request:
    """A trace request as the scheduler's."""
    return Request(
        t.request_id,
        prompt=t.prompt,
        max_new_tokens=len(t.output),
        lora_task_id=t.lora_task_id,
        cache_salt=t.cache_salt,
        priority=t.priority,
        arrival=t.arrival,
    )


def scheduler_requests(trace: Sequence[TraceRequest]) -> list[Request]:
    """The trace's requests as the scheduler's, by arrival step, then id."""
    return [_request(t) for t in sorted(trace, key=lambda t: (t.arrival, t.request_id))]


class SimulatedEngine:
    """One simulated engine: a manager, its scheduler and the requests admitted to it.

    :meth:`admit` hands it a request; :meth:`step` runs one engine step (schedule, prepare,
    run the batch with the workload's output tokens, update, free what finished);
    :meth:`report` sums up. :func:`simulate` drives one; ``kvcache.simulate.fleet`` drives
    several behind a router, so both step an engine the same way.
    """

    def __init__(
        self,
        setup: EngineSetup,
        config: KvCacheConfig,
        outputs: dict[int, tuple[int, ...]],
        options: EngineOptions,
        *,
        rng: np.random.Generator,
        record: bool = False,
    ) -> None:
        self.setup = setup
        self.config = config
        scheduler, max_batch_size = options.scheduler, options.max_batch_size
        max_num_batched_tokens, draft_tokens = options.max_num_batched_tokens, options.draft_tokens
        chunked_prefill = options.chunked_prefill
        self.manager = KVCacheManager.from_blocks(
            setup.preset.model,
            config,
            {w: (p, s, setup.disk[w]) for w, (p, s) in setup.blocks.items()},
            max_seq_len=setup.seq_len,
            max_batch_size=max_batch_size,
            max_draft_tokens=draft_tokens,
            state_slots=setup.state_slots(max_batch_size),
        )
        self.rm = KVCacheResourceManager(self.manager)
        self.sched = CapacityScheduler(
            self.rm,
            scheduler,
            max_num_batched_tokens=max_num_batched_tokens,
            chunked_prefill=chunked_prefill,
            max_chunk_size=options.max_chunk_size,
        )
        self.scheduler = scheduler
        self.max_batch_size = max_batch_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.chunked_prefill = chunked_prefill
        self.draft_tokens = draft_tokens
        self._acceptance = options.draft_acceptance
        self._rng = rng
        self._check = options.check_invariants
        self._outputs = outputs
        self.windows = self.rm.window_sizes
        self.primary = {w: self.rm.num_primary_blocks(w) for w in self.windows}
        #: Request id -> arrival step of every request admitted; those not yet finished or
        #: failed (only these hold their tokens).
        self.arrivals: dict[int, int] = {}
        self.active: list[Request] = []
        #: Requests that arrived but were not read yet (a streamed workload), for the series.
        self.unread = 0
        #: What :func:`~kvcache.simulate.bounds.analyze_run` needs (``None``: not recorded).
        self.record = RunRecord() if record else None
        self._first_prompt_tokens = 0
        #: Request id -> the engine step after which it finished.
        self.finish_step: dict[int, int] = {}
        #: Request id -> prompt tokens it reused when it was first registered.
        self.first_reuse: dict[int, int] = {}
        self.paused_ids: set[int] = set()
        self.pause_events = self.rejected = self.generated = 0
        self.context_tokens = self.reused_tokens = self.chunks = 0
        self.series: dict[str, list[float]] = {"step": [], "running": [], "waiting": []}
        for w in self.windows:
            self.series[f"used_{w}"] = []
        self.manager_times: list[float] = []
        self.sched_times: list[float] = []

    @property
    def num_done(self) -> int:
        """Requests finished or rejected."""
        return len(self.finish_step) + self.rejected

    @property
    def num_steps(self) -> int:
        """Engine steps run."""
        return len(self.series["step"])

    def admit(self, r: Request, output: Sequence[int] | None = None) -> None:
        """Queues ``r`` (with the tokens it will generate, unless the engine was given them):
        the next :meth:`step` may schedule it."""
        self.arrivals[r.request_id] = r.arrival
        if output is not None:
            self._outputs[r.request_id] = tuple(output)
        self.active.append(r)

    def _lost_counters(self) -> tuple[int, int]:
        """The manager's lost-hit counters: sliding window, no checkpoint."""
        stats = self.manager.get_kv_cache_stats()
        return int(stats.lost_hit_tokens_sliding_window), int(stats.lost_hit_tokens_no_checkpoint)

    def run_record(self) -> RunRecord:
        """The run's record for the bounds (the engine must have been made with ``record``)."""
        assert self.record is not None
        rec = self.record
        rec.first_reuse = dict(self.first_reuse)
        computed = self.context_tokens - self.reused_tokens
        rec.recomputed_tokens = computed - (
            self._first_prompt_tokens - sum(self.first_reuse.values())
        )
        return rec

    def step(self, step: int) -> int:
        """Runs engine step ``step`` over the active requests; returns the batch size.

        Raises:
            RuntimeError: Requests wait but nothing can be scheduled (pools too small).
        """
        rm, outputs, active = self.rm, self._outputs, self.active
        if self.draft_tokens:
            for r in active:
                if r.state is RequestState.GENERATION:
                    r.draft_tokens = _propose_drafts(
                        r, outputs, self.draft_tokens, self._acceptance, self._rng
                    )

        t0 = time.perf_counter()
        out = self.sched.schedule(active)
        t1 = time.perf_counter()
        batch = out.batch
        self.rejected += len(out.rejected)
        for r in out.rejected:
            outputs.pop(r.request_id, None)
        self.pause_events += len(out.paused)
        self.paused_ids.update(r.request_id for r in out.paused)
        if len(batch) == 0 and not out.rejected and not out.paused:
            raise RuntimeError(
                f"step {step}: nothing can be scheduled although {len(active)} requests wait; "
                "the pools are too small for the workload"
            )
        starting = [r for r in batch.context_requests if not rm.has_request(r)]
        rec = self.record
        lost0 = None
        untimed = 0.0  # the record's counter reads are not manager time
        if rec is not None and starting:
            ts = time.perf_counter()
            lost0 = self._lost_counters()
            untimed = time.perf_counter() - ts
        rm.prepare_resources(batch)
        t2 = time.perf_counter()
        resumed = False
        for r in starting:  # registered this step: its cached prefix counts once
            self.context_tokens += r.reused_tokens
            self.reused_tokens += r.reused_tokens
            if r.request_id in self.first_reuse:
                resumed = True
                continue
            self.first_reuse[r.request_id] = r.reused_tokens
            self._first_prompt_tokens += len(r.prompt)
            if rec is not None:
                rec.admit_step[r.request_id] = step
        if lost0 is not None and rec is not None and not resumed:
            sliding, checkpoint = self._lost_counters()
            rec.lost_sliding_tokens += sliding - lost0[0]
            rec.lost_checkpoint_tokens += checkpoint - lost0[1]
        # The model's output, one token per batch entry (-1: a chunk that does not end its
        # prompt), and per generation entry the drafts that matched; applied in one call.
        tokens: list[int] = []
        for r, chunk in batch.context:
            self.context_tokens += chunk
            self.chunks += 1
            if r.context_position + chunk >= r.context_len:
                tokens.append(outputs[r.request_id][r.num_generated])
                self.generated += 1
            else:
                tokens.append(-1)
        accepted: list[int] | None = [] if self.draft_tokens else None
        for r, d in batch.generation:
            g = r.num_generated
            ours = outputs[r.request_id]
            a = 0
            while a < d and r.draft_tokens[a] == ours[g + a]:
                a += 1
            tokens.append(ours[g + a])
            self.generated += a + 1
            if accepted is not None:
                accepted.append(a)
        t3 = time.perf_counter()
        done = rm.complete_step(batch, tokens, accepted=accepted)
        for r in done:
            self.finish_step[r.request_id] = step + 1
        self.manager.refresh_blocks()
        t4 = time.perf_counter()
        self.manager_times.append((t2 - t1 - untimed) + (t4 - t3))
        for r in done:
            outputs.pop(r.request_id, None)
        if rec is not None:
            # Blocks stored this step are found from the next one on.
            for r in batch.context_requests:
                rec.progress.setdefault(r.request_id, []).append((step + 1, r.context_position))
            for r in done:
                rec.finish_step[r.request_id] = step + 1
        self.sched_times.append(t1 - t0)
        if self._check:
            self.manager.check_invariants()

        series = self.series
        series["step"].append(step)
        series["running"].append(len(batch))
        waiting = sum(1 for r in active if r.state in (RequestState.WAITING, RequestState.PAUSED))
        waiting += self.unread
        series["waiting"].append(waiting)
        for w in self.windows:
            series[f"used_{w}"].append(rm.get_num_used_blocks(w))
        if done or out.rejected:
            self.active = [
                r for r in active if r.state not in (RequestState.FINISHED, RequestState.FAILED)
            ]
        return len(batch)

    def report(self, *, wall_seconds: float, options: EngineOptions) -> SimulationReport:
        """What this engine did (``options``: the run's, as given to :func:`simulate`)."""
        setup, series, manager = self.setup, self.series, self.manager
        preset, config, seq_len = setup.preset, self.config, setup.seq_len
        tokens_per_block = config.tokens_per_block
        layer_windows = config.attention_window_per_layer(preset.model.num_layers, seq_len)
        stats = manager.get_kv_cache_stats()
        lookups = stats.reused_blocks + stats.missed_blocks
        latencies = np.array(
            [step - self.arrivals[rid] for rid, step in self.finish_step.items()], dtype=float
        )
        running = np.array(series["running"], dtype=float)
        mt = np.array(self.manager_times) * 1e6
        st = np.array(self.sched_times) * 1e6
        primary = self.primary
        return SimulationReport(
            model=preset.name,
            memory_bytes=setup.memory,
            shares=setup.share_text,
            scheduler=self.scheduler,
            max_batch_size=self.max_batch_size,
            max_seq_len=seq_len,
            tokens_per_block=tokens_per_block,
            draft_tokens=self.draft_tokens,
            windows=[
                WindowReport(
                    window=w,
                    layers=layer_windows.count(w),
                    blocks=primary[w],
                    tokens=primary[w] * tokens_per_block,
                    peak_used_blocks=int(max(series[f"used_{w}"], default=0)),
                    mean_used_blocks=float(np.mean(series[f"used_{w}"])) if running.size else 0.0,
                )
                for w in self.windows
            ],
            requests=len(self.arrivals),
            completed=len(self.finish_step),
            rejected=self.rejected,
            steps=len(series["step"]),
            generated_tokens=self.generated,
            context_tokens=self.context_tokens,
            mean_concurrency=float(running.mean()) if running.size else 0.0,
            peak_concurrency=int(running.max()) if running.size else 0,
            pause_events=self.pause_events,
            paused_requests=len(self.paused_ids),
            mean_latency_steps=float(latencies.mean()) if latencies.size else 0.0,
            p95_latency_steps=float(np.percentile(latencies, 95)) if latencies.size else 0.0,
            manager_us_per_step=float(mt.mean()) if mt.size else 0.0,
            manager_us_p99=float(np.percentile(mt, 99)) if mt.size else 0.0,
            scheduler_us_per_step=float(st.mean()) if st.size else 0.0,
            wall_seconds=wall_seconds,
            reused_tokens=self.reused_tokens,
            cache_hit_rate=float(stats.cache_hit_rate) if lookups > 0 else None,
            reused_blocks=int(stats.reused_blocks),
            offloaded_blocks=int(stats.offloaded_blocks),
            onboarded_blocks=int(stats.onboarded_blocks),
            missed_blocks=int(stats.missed_blocks),
            cache_hit_rate_per_window={
                int(w): float(v) for w, v in stats.cache_hit_rate_per_window_size.items()
            },
            swa_reuse_policy=options.swa_reuse_policy,
            protect_reused_blocks=options.protect_reused_blocks,
            lend_free_memory=bool(manager.lends_free_memory),
            lent_slabs=int(stats.lent_slabs),
            host_cache_bytes=options.host_cache_bytes if options.enable_block_reuse else 0,
            disk_cache_bytes=options.disk_bytes_used,
            secondary_blocks={int(w): int(v[1]) for w, v in manager.blocks_per_window.items()},
            reuse_enabled=options.enable_block_reuse,
            expected_seq_len=setup.expected_seq_len,
            chunked_prefill=self.chunked_prefill,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_chunk_size=self.sched.max_chunk_size,
            prefill_chunks=self.chunks,
            series=series,
            lost_hit_tokens={
                "attention blocks evicted": int(stats.lost_hit_tokens_attention),
                "sliding window evicted": int(stats.lost_hit_tokens_sliding_window),
                "no state checkpoint": int(stats.lost_hit_tokens_no_checkpoint),
            },
            state_slots=int(stats.state_slots),
            checkpoints={
                "stored": int(stats.checkpoints_stored),
                "restored": int(stats.checkpoints_restored),
                "skipped": int(stats.checkpoints_skipped),
                "evicted": int(stats.checkpoints_evicted),
            },
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
            drafts.append((truth[j] + 1) % VOCAB if j < len(truth) else 0)
            drafts.extend([0] * (k - j - 1))
            break
    return drafts
