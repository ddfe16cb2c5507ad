"""The simulation loop: replay requests through the manager the way an engine would.

:func:`simulate` drives a :class:`~kvcache.resource_manager.KVCacheResourceManager` on the
``virtual`` backend (bookkeeping only, no KV memory) step by step with a
:class:`~kvcache.scheduler.CapacityScheduler`: each engine step runs the scheduled context
requests (prefill chunks that fill the step's token budget by default, or whole prompts)
and generates one token for every generation request (more with draft tokens). Output tokens
come from the workload, so runs are deterministic.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TextIO

import numpy as np

from kvcache.config import KvCacheConfig
from kvcache.manager import KVCacheManager
from kvcache.models import ModelPreset, load_model
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, CapacityScheduler
from kvcache.simulate.report import SimulationReport, WindowReport
from kvcache.simulate.workload import _VOCAB, TraceRequest
from kvcache.sizing import blocks_per_window, format_size, parse_size, resolve_share_policy

__all__ = [
    "BOOKKEEPING_BYTES_PER_BLOCK",
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MEMORY",
    "DEFAULT_MODEL",
    "MAX_SIMULATED_BLOCKS",
    "simulate",
    "simulation_blocks",
]

#: The preset simulated when none is given (a VSWA model: 5 sliding layers per full one).
DEFAULT_MODEL = "gemma-3-12b"
#: The primary memory budget simulated when none is given.
DEFAULT_MEMORY = "16GiB"
#: Most requests running at once when not given.
DEFAULT_MAX_BATCH_SIZE = 128
#: Host memory the native manager keeps per block for its bookkeeping, even on the
#: virtual backend (reference counts, owners, free-queue links, tree links), roughly.
BOOKKEEPING_BYTES_PER_BLOCK = 70
#: Most blocks (all windows, primary plus secondary) a simulation may have: about 2.2 GiB
#: of bookkeeping. Real pools are far smaller (an 80 GiB GPU holds tens of thousands of
#: blocks); larger counts come from typos such as ``--memory 1000TiB``.
MAX_SIMULATED_BLOCKS = 2**25


class _Progress:
    """A one-line progress bar: requests done and engine steps run (as in the report)."""

    def __init__(self, total: int, stream: TextIO | None) -> None:
        self._total = max(total, 1)
        self._stream = stream
        self._last = 0.0

    def update(self, done: int, steps: int, running: int, final: bool = False) -> None:
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
            f"{steps:,} engine steps, running {running}  "
        )
        if final:
            self._stream.write("\n")
        self._stream.flush()


@dataclass(frozen=True)
class _Setup:
    preset: ModelPreset
    config: KvCacheConfig
    memory: int
    seq_len: int
    blocks: dict[int, tuple[int, int]]
    share_text: str
    expected_seq_len: int | None
    disk: dict[int, int]


def _setup(
    trace: Sequence[TraceRequest],
    *,
    model: str | ModelPreset,
    memory_bytes: int | None,
    shares: str | Sequence[float] | None,
    max_seq_len: int | None,
    tokens_per_block: int,
    enable_block_reuse: bool,
    swa_reuse_policy: str,
    host_cache_bytes: int,
    expected_seq_len: int | None,
    protect_reused_blocks: bool = True,
    draft_tokens: int = 0,
    disk_cache_bytes: int = 0,
    lend_free_memory: bool = False,
) -> _Setup:
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
        protect_reused_blocks=protect_reused_blocks,
        host_cache_size=host_cache_bytes,
        disk_cache_size=disk_cache_bytes,
        lend_free_memory=lend_free_memory,
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
    return _Setup(preset, config, memory, seq_len, blocks, share_text, expected, disk)


def simulation_blocks(
    trace: Sequence[TraceRequest],
    *,
    model: str | ModelPreset = DEFAULT_MODEL,
    memory_bytes: int | None = None,
    shares: str | Sequence[float] | None = None,
    max_seq_len: int | None = None,
    tokens_per_block: int = 32,
    host_cache_bytes: int = 0,
    expected_seq_len: int | None = None,
    disk_cache_bytes: int = 0,
) -> dict[int, tuple[int, int]]:
    """The ``(primary, secondary)`` blocks per window that :func:`simulate` would use.

    Cheap (no manager is built): checks a run's sizing before starting it. The arguments
    mean what they mean for :func:`simulate`.

    Raises:
        ValueError: Exactly what :func:`simulate` raises for these arguments before it runs.
    """
    return _setup(
        trace,
        model=model,
        memory_bytes=memory_bytes,
        shares=shares,
        max_seq_len=max_seq_len,
        tokens_per_block=tokens_per_block,
        enable_block_reuse=True,
        swa_reuse_policy="placeholder",
        host_cache_bytes=host_cache_bytes,
        expected_seq_len=expected_seq_len,
        disk_cache_bytes=disk_cache_bytes,
    ).blocks


def simulate(
    trace: Sequence[TraceRequest],
    *,
    model: str | ModelPreset = DEFAULT_MODEL,
    memory_bytes: int | None = None,
    shares: str | Sequence[float] | None = None,
    scheduler: str = "max_utilization",
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE,
    max_seq_len: int | None = None,
    tokens_per_block: int = 32,
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
    chunked_prefill: bool = True,
    max_chunk_size: int | None = None,
    enable_block_reuse: bool = True,
    swa_reuse_policy: str = "placeholder",
    protect_reused_blocks: bool = True,
    lend_free_memory: bool = False,
    host_cache_bytes: int = 0,
    expected_seq_len: int | None = None,
    draft_tokens: int = 0,
    draft_acceptance: float = 0.6,
    seed: int = 0,
    disk_cache_bytes: int = 0,
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
        max_num_batched_tokens: Tokens per engine step, generation tokens and prefill
            chunks together (``None``: unlimited; see
            :class:`~kvcache.scheduler.CapacityScheduler`).
        chunked_prefill: Prefill prompts in chunks that fill the token budget (default);
            ``False`` prefills every prompt whole in one step.
        max_chunk_size: Most tokens of one prefill chunk (``None``: the budget).
        enable_block_reuse: Reuse cached prompt prefixes (the config's
            ``enable_block_reuse``).
        swa_reuse_policy: ``"invalidate"`` or ``"placeholder"`` (the config's
            ``swa_reuse_policy``): what reuse does with sliding-window blocks that another
            request reclaimed.
        protect_reused_blocks: Segmented LRU (the config's ``protect_reused_blocks``);
            ``False`` evicts in plain LRU order per priority.
        lend_free_memory: The windows lend each other free memory at run time (the
            config's ``lend_free_memory``): the shares set the initial split only.
        host_cache_bytes: Secondary (host) memory for offloaded reusable blocks (the
            config's ``host_cache_size``; 0: none).
        disk_cache_bytes: Disk tier below the host cache (the config's
            ``disk_cache_size``; needs ``host_cache_bytes``; 0: none).
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
        ValueError: Bad arguments, shares or budget: at least one block per window, and at
            most :data:`MAX_SIMULATED_BLOCKS` blocks in all (the manager keeps about
            :data:`BOOKKEEPING_BYTES_PER_BLOCK` bytes of bookkeeping per block).
    """
    setup = _setup(
        trace,
        model=model,
        memory_bytes=memory_bytes,
        shares=shares,
        max_seq_len=max_seq_len,
        tokens_per_block=tokens_per_block,
        enable_block_reuse=enable_block_reuse,
        swa_reuse_policy=swa_reuse_policy,
        protect_reused_blocks=protect_reused_blocks,
        lend_free_memory=lend_free_memory,
        host_cache_bytes=host_cache_bytes,
        expected_seq_len=expected_seq_len,
        draft_tokens=draft_tokens,
        disk_cache_bytes=disk_cache_bytes if enable_block_reuse else 0,
    )
    preset, config, seq_len, blocks = setup.preset, setup.config, setup.seq_len, setup.blocks
    memory, expected = setup.memory, setup.expected_seq_len
    manager = KVCacheManager.from_blocks(
        preset.model,
        config,
        {w: (p, s, setup.disk[w]) for w, (p, s) in blocks.items()},
        max_seq_len=seq_len,
        max_batch_size=max_batch_size,
        max_draft_tokens=draft_tokens,
    )
    rm = KVCacheResourceManager(manager)
    sched = CapacityScheduler(
        rm,
        scheduler,
        max_num_batched_tokens=max_num_batched_tokens,
        chunked_prefill=chunked_prefill,
        max_chunk_size=max_chunk_size,
    )
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
    pause_events = rejected = generated = context_tokens = reused_tokens = chunks = 0
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
        starting = [r for r in batch.context_requests if not rm.has_request(r)]
        rm.prepare_resources(batch)
        t2 = time.perf_counter()
        for r in starting:  # registered this step: its cached prefix counts once
            context_tokens += r.reused_tokens
            reused_tokens += r.reused_tokens
        for r in batch.context_requests:
            context_tokens += batch.chunk_size(r)
            chunks += 1
            if batch.is_last_chunk(r):
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
            series[f"used_{w}"].append(rm.get_num_used_blocks(w))
        if done or out.rejected:
            active = [
                r for r in active if r.state not in (RequestState.FINISHED, RequestState.FAILED)
            ]
        step += 1
        bar.update(len(finish_step) + rejected, len(series["step"]), len(batch))
    bar.update(len(finish_step) + rejected, len(series["step"]), 0, final=True)
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
        shares=setup.share_text,
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
        protect_reused_blocks=protect_reused_blocks,
        lend_free_memory=bool(manager.lends_free_memory),
        lent_slabs=int(stats.lent_slabs),
        host_cache_bytes=host_cache_bytes if enable_block_reuse else 0,
        disk_cache_bytes=disk_cache_bytes if enable_block_reuse else 0,
        secondary_blocks={int(w): int(v[1]) for w, v in manager.blocks_per_window.items()},
        reuse_enabled=enable_block_reuse,
        expected_seq_len=expected,
        chunked_prefill=chunked_prefill,
        max_num_batched_tokens=max_num_batched_tokens,
        max_chunk_size=sched.max_chunk_size,
        prefill_chunks=chunks,
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
