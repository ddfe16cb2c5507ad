"""The engine step around the manager: scheduler, resource manager, refresh (virtual backend).

Prints tables of medians; never asserts; seeded. Run:
``python bench/bench_step.py`` (about 30 s on a 2-core VM; ``--quick``: 400 requests, a few
seconds; ``--policy``: one of the two policies, default both; ``--json FILE``: the results as
JSON, ``-`` for stdout), ``python bench/bench_step.py --waiting 100 1000 10000`` (about
15 s), ``python bench/bench_step.py --compare /path/to/other-venv/bin/python [--quick]``.

Only the documented API is used (``CapacityScheduler``, ``KVCacheResourceManager``,
``Request``, ``ScheduledBatch``, ``manager.refresh_blocks``, ``manager.get_kv_cache_stats``),
so the same script measures a rewritten scheduler or resource manager unchanged.

(a) The replay of ``bench_reuse.py`` (its ``make_workload``: 2,000 requests; half start with
    one of 20 system prompts of 1,024 tokens, prompts 1,000-4,000 tokens, 128-512 generated
    tokens; all queued at step 0), driven the way ``kvcache.simulate``'s loop drives an
    engine: windows {512, full}, 32-token blocks, 20,000 primary blocks split equally with
    ``lend_free_memory=True`` (``--no-lend``: a fixed split), block reuse on, at most 128
    running (``max_batch_size``), ``CapacityScheduler`` with its default token budget
    (``max_num_batched_tokens`` 8,192) and chunked prefill, first come first served.
    Each step: ``schedule(active)``, ``prepare_resources(batch)``, the "model" (a
    deterministic token, derived from the request id and its position, for every generation
    request and every context request whose chunk ends its prompt, ``batch.is_last_chunk``
    after ``prepare_resources``), ``update_resources(batch)``, ``free_resources`` of every
    request that finished in the step, ``manager.refresh_blocks()``.

    Each part is timed with ``time.thread_time_ns`` (CPU time of this thread: time given
    to other processes does not count, though on a busy machine the shared caches still
    slow the step down; garbage collection inside a part counts); the *step* is their sum,
    the model's token sampling and the engine's own list keeping excluded. Each part
    includes one clock read (printed, and ``clock_floor_ns`` in the JSON: about 0.7 µs on a
    2-core VM), the floor of an empty part; it is not subtracted. Reported per policy
    (``guaranteed_no_evict``, ``max_utilization``): median, p90 and mean µs per step of the
    step and of each part, steps, the median number of requests in a step's batch, the hit
    rate (``get_kv_cache_stats().cache_hit_rate``), pauses (sum of ``num_pauses`` over the
    requests; and the scheduler's ``paused`` lists, summed), rejected and completed
    requests, and the wall time of the replay.

(b) ``--waiting N [N ...]``: the per-step cost as a function of the length of the waiting
    queue. The same set-up and engine with ``N`` more requests in the trace (the same
    generator, ``192 + N`` requests: the first 192 are the trace's first 192), so that ``N``
    requests or more wait behind the running ones throughout (about ``N + 50`` with the
    defaults: some 140 of the first 192 are admitted by the last step); ``--warmup`` steps
    (default 100: the batch fills up) are run untimed, then ``--steps`` steps (default 200)
    are measured: median step µs, median schedule µs, the waiting requests after the last
    measured step (``SchedulerOutput.waiting``, read once after the timing: reading it walks
    the whole queue, and doing that every step would evict the running requests from the CPU
    caches and slow the timed parts of the next step) and the median batch size, per ``N``.
    A flat step cost means the step does not walk the whole queue.

``--batch-form`` runs (a) or (b) with the batch form of the step: the scheduler's index form
(``add_request`` at arrival, ``schedule()``) and ``prepare_resources(batch, next_tokens=...)``
with the step's newest tokens as one list (built inside the timed part), which skips the
per-request consistency check of the request objects. A kvcache without the batch form
(before issue 23) runs its list form instead, and says so (``"form"`` in the JSON).

(c) ``--compare PYTHON``: runs the benchmark chosen by the other flags (replay, or
    ``--waiting``) under this interpreter and under ``PYTHON`` (e.g. a venv holding an older
    build of kvcache), each in a subprocess that prints its results as JSON on stdout,
    ``--rounds R`` times (default 5) in alternating order, and prints for each both medians
    over the rounds (of the per-run medians; for the replay also the mean step) and their
    ratio, ``PYTHON / this``: above 1, this interpreter's kvcache has the cheaper step. One
    run on one machine, so the ratio holds although the machine's speed drifts. For the
    replay it also prints both sides' steps, hit rate, pauses, rejected and completed
    requests (first round): a rewrite that schedules differently shows there, and its
    timings then compare different work. ``--batch-form`` goes to both sides; a side whose
    kvcache lacks the batch form runs its list form, and the table's header and a NOTE line
    say which form each side ran.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

import kvcache
from kvcache import KvCacheConfig, ModelConfig
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import CapacityScheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_reuse import MAX_BATCH, SWA, TOTAL_BLOCKS, TPB, VOCAB, make_workload

POLICIES = ("guaranteed_no_evict", "max_utilization")
PARTS = ("schedule", "prepare", "update", "free", "refresh")
PART_LABELS = {
    "schedule": "schedule",
    "prepare": "prepare_resources",
    "update": "update_resources",
    "free": "free_resources",
    "refresh": "refresh_blocks",
    "step": "step (sum)",
}
MAX_NUM_BATCHED_TOKENS = 8192  # the scheduler's default, passed explicitly
WAITING_BASE = 192  # requests ahead of the N extra ones in --waiting (running or finished)
_DONE = (RequestState.FINISHED, RequestState.FAILED)
#: The step form a --batch-form run reports when its kvcache lacks the batch form.
FALLBACK_FORM = "list (no batch form in this kvcache)"
# Shared Python ints for the token ids, so that long traces (--waiting 10000: ~26 million
# prompt tokens) hold 8 bytes per token, not a fresh int object each.
_INTS = np.array(list(range(VOCAB)), dtype=object)


# ----------------------------------------------------------------------------- set-up


def make_requests(num_requests: int, seed: int) -> list[Request]:
    """``bench_reuse.make_workload``'s trace as ``Request`` objects (prompts as lists of
    ints, all arriving at step 0)."""
    return [
        Request(r.rid, prompt=_INTS[r.prompt].tolist(), max_new_tokens=r.max_new)
        for r in make_workload(num_requests, seed)
    ]


def max_seq_len_of(reqs: list[Request]) -> int:
    """The longest prompt plus output (as ``bench_reuse`` sizes its full window)."""
    return max(r.prompt_len + r.max_new_tokens for r in reqs)


def build(
    policy: str, max_seq_len: int, lend: bool
) -> tuple[KVCacheResourceManager, CapacityScheduler]:
    """The resource manager (20,000 blocks split equally) and the scheduler."""
    model = ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    config = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=[SWA, None],
        backend="virtual",
        enable_block_reuse=True,
        lend_free_memory=lend,
    )
    half = TOTAL_BLOCKS // 2
    rm = KVCacheResourceManager.from_blocks(
        model,
        config,
        {SWA: half, max_seq_len: TOTAL_BLOCKS - half},
        max_seq_len=max_seq_len,
        max_batch_size=MAX_BATCH,
    )
    sched = CapacityScheduler(
        rm, policy, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, chunked_prefill=True
    )
    return rm, sched


def sampled_token(r: Request) -> int:
    """The "model": a deterministic token from the request id and the token's position."""
    return (r.request_id * 7919 + r.num_tokens * 104_729) % VOCAB


# ----------------------------------------------------------------------------- the engine


@dataclass
class EngineRun:
    """Per-step samples (ns of thread CPU time per part) and totals of one run."""

    policy: str
    ns: dict[str, list[int]] = field(default_factory=lambda: {p: [] for p in (*PARTS, "step")})
    batch: list[int] = field(default_factory=list)  # requests in each measured step's batch
    waiting: list[int] = field(default_factory=list)  # SchedulerOutput.waiting, last step
    steps: int = 0  # every step run, warm-up included
    pause_events: int = 0  # sum of len(SchedulerOutput.paused)
    num_pauses: int = 0  # sum of Request.num_pauses
    rejected: int = 0
    completed: int = 0
    requests: int = 0
    hit_rate: float = 0.0
    wall_s: float = 0.0


def batch_form_available() -> bool:
    """Whether this interpreter's kvcache has the batch form of the step (the scheduler's
    ``add_request`` and ``prepare_resources(..., next_tokens=...)``); builds before issue 23
    lack it."""
    try:
        params = inspect.signature(KVCacheResourceManager.prepare_resources).parameters
    except (TypeError, ValueError):
        return False
    return hasattr(CapacityScheduler, "add_request") and "next_tokens" in params


def run_engine(
    reqs: list[Request],
    policy: str,
    max_seq_len: int,
    *,
    lend: bool,
    warmup: int = 0,
    max_steps: int | None = None,
    batch_form: bool = False,
) -> EngineRun:
    """Steps the engine until every request is done (or ``max_steps`` steps were measured
    after ``warmup`` untimed ones), mirroring ``kvcache.simulate``'s loop. ``batch_form``:
    the scheduler's index form (``add_request``, ``schedule()``) and ``prepare_resources(batch,
    next_tokens=...)`` with the newest tokens as one list (built inside the timed part)."""
    rm, sched = build(policy, max_seq_len, lend)
    manager = rm.manager
    run = EngineRun(policy, requests=len(reqs))
    ns = run.ns
    clock = time.thread_time_ns
    active = list(reqs)  # every request arrives at step 0, in id order
    if batch_form:
        for r in reqs:
            sched.add_request(r)
    wall0 = time.perf_counter()
    while active and (max_steps is None or run.steps < warmup + max_steps):
        t0 = clock()
        out = sched.schedule() if batch_form else sched.schedule(active)
        t1 = clock()
        batch = out.batch
        if len(batch) == 0 and not out.rejected and not out.paused:
            raise RuntimeError(
                f"step {run.steps}: nothing can be scheduled although {len(active)} requests "
                "wait; the pools are too small for the workload"
            )
        if batch_form:
            rm.prepare_resources(batch, next_tokens=[r.generated[-1] for r, _ in batch.generation])
        else:
            rm.prepare_resources(batch)
        t2 = clock()
        for r in batch.context_requests:  # the model (not timed)
            if batch.is_last_chunk(r):
                r.append_tokens([sampled_token(r)])
        for r in batch.generation_requests:
            r.append_tokens([sampled_token(r)])
        done = [r for r in batch.context_requests + batch.generation_requests if r.is_finished]
        t3 = clock()
        rm.update_resources(batch)
        t4 = clock()
        for r in done:
            rm.free_resources(r)
        t5 = clock()
        manager.refresh_blocks()
        t6 = clock()
        if run.steps >= warmup:
            parts = (t1 - t0, t2 - t1, t4 - t3, t5 - t4, t6 - t5)
            for name, v in zip(PARTS, parts, strict=True):
                ns[name].append(v)
            ns["step"].append(sum(parts))
            run.batch.append(len(batch))
        run.steps += 1
        run.pause_events += len(out.paused)
        run.rejected += len(out.rejected)
        run.completed += len(done)
        if out.rejected:
            active = [r for r in active if r.state not in _DONE]
        else:
            # The finished requests run, so they sit near the front of the list: removing each
            # there leaves the waiting requests behind untouched (a copy of the whole list would
            # walk them all every few steps, evicting the running ones from the CPU caches).
            for r in done:
                active.remove(r)
    run.wall_s = time.perf_counter() - wall0
    if run.steps > warmup:
        # Read once, after the timing: SchedulerOutput.waiting walks the whole queue, and doing
        # so every step evicts the running requests from the CPU caches, which slowed the next
        # step's timed parts by a third with 10,000 waiting (the step itself never walks it).
        run.waiting.append(len(out.waiting))
    run.num_pauses = sum(r.num_pauses for r in reqs)
    run.hit_rate = float(manager.get_kv_cache_stats().cache_hit_rate)
    return run


# ----------------------------------------------------------------------------- statistics


def clock_floor_ns(samples: int = 20_000) -> int:
    """Median ns between two back-to-back ``thread_time_ns`` calls: what an empty part
    measures (every part includes one such read; not subtracted)."""
    clock = time.thread_time_ns
    gaps = []
    for _ in range(samples):
        a = clock()
        gaps.append(clock() - a)
    return int(statistics.median(gaps))


def _us(values: list[int], q: float | None = None) -> float:
    """Median (or percentile ``q``) of ns samples, in µs."""
    if not values:
        return 0.0
    if q is None:
        return statistics.median(values) / 1000
    return float(np.percentile(values, q)) / 1000


def summarize(run: EngineRun) -> dict[str, Any]:
    """The reported numbers of one run (JSON-ready)."""
    parts = {
        name: {
            "median_us": _us(v),
            "p90_us": _us(v, 90),
            "mean_us": (sum(v) / len(v) / 1000) if v else 0.0,
        }
        for name, v in run.ns.items()
    }
    return {
        "policy": run.policy,
        "requests": run.requests,
        "steps": run.steps,
        "measured_steps": len(run.ns["step"]),
        "parts": parts,
        "median_batch": statistics.median(run.batch) if run.batch else 0,
        "median_waiting": statistics.median(run.waiting) if run.waiting else 0,
        "hit_rate": run.hit_rate,
        "num_pauses": run.num_pauses,
        "pause_events": run.pause_events,
        "rejected": run.rejected,
        "completed": run.completed,
        "wall_s": run.wall_s,
    }


# ----------------------------------------------------------------------------- the modes


def bench_replay(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """(a): the whole trace once per policy."""
    n = 400 if args.quick else 2000
    results: dict[str, Any] = {}
    max_seq_len = 0
    for policy in args.policies:
        reqs = make_requests(n, args.seed)  # fresh requests: a run changes their state
        max_seq_len = max_seq_len_of(reqs)
        results[policy] = summarize(
            run_engine(reqs, policy, max_seq_len, lend=not args.no_lend, batch_form=args.batch_form)
        )
    print(
        f"(a) engine step: {n:,} requests (bench_reuse's trace), windows {SWA} and full "
        f"({max_seq_len:,}), {TPB}-token blocks, {TOTAL_BLOCKS:,} blocks split equally"
        f"{'' if args.no_lend else ' with lend_free_memory'}, at most {MAX_BATCH} running, "
        f"max_num_batched_tokens {MAX_NUM_BATCHED_TOKENS:,}, chunked prefill, reuse on",
        file=out,
    )
    print(
        f"  {'policy':<21}{'part':<19}{'median µs':>11}{'p90 µs':>10}{'mean µs':>10}",
        file=out,
    )
    for policy, res in results.items():
        for name in (*PARTS, "step"):
            p = res["parts"][name]
            print(
                f"  {policy:<21}{PART_LABELS[name]:<19}{p['median_us']:>11.1f}"
                f"{p['p90_us']:>10.1f}{p['mean_us']:>10.1f}",
                file=out,
            )
    print(
        f"\n  {'policy':<21}{'steps':>7}{'batch':>7}{'hit rate':>10}{'pauses':>8}"
        f"{'paused':>8}{'rejected':>10}{'completed':>11}{'wall s':>8}",
        file=out,
    )
    for policy, res in results.items():
        print(
            f"  {policy:<21}{res['steps']:>7,}{res['median_batch']:>7g}{res['hit_rate']:>10.1%}"
            f"{res['num_pauses']:>8,}{res['pause_events']:>8,}{res['rejected']:>10,}"
            f"{res['completed']:>11,}{res['wall_s']:>8.1f}",
            file=out,
        )
    print(
        "  (batch: median requests in a step's batch; pauses: sum of Request.num_pauses; "
        "paused: sum of the scheduler's paused lists)",
        file=out,
    )
    print(
        f"  (each part includes one clock read, {args.clock_ns / 1000:.2f} µs here: the floor "
        "of an empty part, not subtracted)",
        file=out,
    )
    return results


def bench_waiting(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """(b): a fixed number of steps with N more requests waiting, per N and policy."""
    results: dict[str, Any] = {}
    for policy in args.policies:
        results[policy] = {}
        for n in args.waiting:
            reqs = make_requests(WAITING_BASE + n, args.seed)
            run = run_engine(
                reqs,
                policy,
                max_seq_len_of(reqs),
                lend=not args.no_lend,
                warmup=args.warmup,
                max_steps=args.steps,
                batch_form=args.batch_form,
            )
            results[policy][str(n)] = summarize(run)
    print(
        f"(b) step cost against the waiting queue: {WAITING_BASE} + N requests, "
        f"{args.warmup} steps of warm-up, then {args.steps} measured (set-up as in (a))",
        file=out,
    )
    print(
        f"  {'policy':<21}{'N':>7}{'waiting':>9}{'batch':>7}{'step µs':>10}{'schedule µs':>13}"
        f"{'step vs first N':>17}",
        file=out,
    )
    for policy, by_n in results.items():
        first = None
        for n, res in by_n.items():
            step = res["parts"]["step"]["median_us"]
            first = step if first is None else first
            print(
                f"  {policy:<21}{int(n):>7,}{res['median_waiting']:>9g}{res['median_batch']:>7g}"
                f"{step:>10.1f}{res['parts']['schedule']['median_us']:>13.1f}"
                f"{step / first if first else 0.0:>17.2f}",
                file=out,
            )
    return results


def run_benchmark(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    """The replay, or the waiting-queue sweep; returns the JSON document."""
    args.clock_ns = clock_floor_ns()
    form = "batch" if args.batch_form else "list"
    if args.batch_form and not batch_form_available():
        # An older kvcache (e.g. the baseline of --compare): its list form instead, said so.
        args.batch_form = False
        form = FALLBACK_FORM
        print(
            "note: --batch-form asked for, but this kvcache has no batch form (no "
            "CapacityScheduler.add_request / prepare_resources(next_tokens=...)): "
            "measuring its list form instead",
            file=out,
        )
    doc: dict[str, Any] = {
        "form": form,
        "kvcache": {"version": kvcache.__version__, "path": str(Path(kvcache.__file__).parent)},
        "python": sys.executable,
        "seed": args.seed,
        "lend_free_memory": not args.no_lend,
        "clock_floor_ns": args.clock_ns,
    }
    if args.waiting:
        doc["waiting"] = bench_waiting(args, out)
    else:
        doc["replay"] = bench_replay(args, out)
    return doc


# ----------------------------------------------------------------------------- --compare


def _child_args(args: argparse.Namespace) -> list[str]:
    """The benchmark's own flags, for a child run."""
    out = ["--seed", str(args.seed), "--policy", args.policy]
    if args.quick:
        out.append("--quick")
    if args.no_lend:
        out.append("--no-lend")
    if args.batch_form:
        out.append("--batch-form")
    if args.waiting:
        out += ["--waiting", *map(str, args.waiting)]
        out += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    return out


def _run_child(python: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [python, str(Path(__file__).resolve()), *_child_args(args), "--json", "-"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr}")
    doc: dict[str, Any] = json.loads(proc.stdout)
    return doc


_BEHAVIOUR = ("steps", "hit_rate", "num_pauses", "pause_events", "rejected", "completed")


def _metrics(doc: dict[str, Any]) -> dict[str, float]:
    """The compared medians of one child's results, by label."""
    out: dict[str, float] = {}
    for policy, res in doc.get("replay", {}).items():
        for name in (*PARTS, "step"):
            out[f"{policy} {PART_LABELS[name]}"] = res["parts"][name]["median_us"]
        out[f"{policy} step (sum), mean"] = res["parts"]["step"]["mean_us"]
    for policy, by_n in doc.get("waiting", {}).items():
        for n, res in by_n.items():
            out[f"{policy} N={int(n):,} step"] = res["parts"]["step"]["median_us"]
            out[f"{policy} N={int(n):,} schedule"] = res["parts"]["schedule"]["median_us"]
    return out


def compare(args: argparse.Namespace) -> dict[str, Any]:
    """(c): alternating child runs under this interpreter and ``args.compare``."""
    pythons = {"this": sys.executable, "other": args.compare}
    docs: dict[str, list[dict[str, Any]]] = {"this": [], "other": []}
    for rnd in range(args.rounds):
        order = ("this", "other") if rnd % 2 == 0 else ("other", "this")
        for who in order:
            t0 = time.perf_counter()
            docs[who].append(_run_child(pythons[who], args))
            print(
                f"  round {rnd + 1}/{args.rounds}: {who} done in {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )
    this = [_metrics(d) for d in docs["this"]]
    other = [_metrics(d) for d in docs["other"]]
    forms = {who: docs[who][0].get("form", "list") for who in pythons}
    print(
        f"(c) {args.rounds} rounds in alternating order; medians over the rounds of each "
        f"run's median µs per step\n  this:  {pythons['this']} "
        f"(kvcache at {docs['this'][0]['kvcache']['path']}; {forms['this']} form)\n"
        f"  other: {pythons['other']} "
        f"(kvcache at {docs['other'][0]['kvcache']['path']}; {forms['other']} form)"
    )
    if forms["this"] != forms["other"]:
        print(
            f"  NOTE: the sides ran different forms of the step (this: {forms['this']}; "
            f"other: {forms['other']}): the ratios compare the one form against the other"
        )
    print(
        f"  {'metric':<46}{'this µs':>10}{'other µs':>10}{'other/this':>12}{'range of ratios':>17}"
    )
    table = {}
    for label in this[0]:
        a = statistics.median(m[label] for m in this)
        b = statistics.median(m[label] for m in other)
        ratios = [o[label] / t[label] for t, o in zip(this, other, strict=True) if t[label]]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        ratio = b / a if a else 0.0
        table[label] = {"this_us": a, "other_us": b, "ratio": ratio}
        print(f"  {label:<46}{a:>10.1f}{b:>10.1f}{ratio:>12.2f}{spread:>17}")
    print("  (other/this above 1: this interpreter's kvcache has the cheaper step)")
    for policy in docs["this"][0].get("replay", {}):
        a, b = docs["this"][0]["replay"][policy], docs["other"][0]["replay"][policy]
        same = all(a[k] == b[k] for k in _BEHAVIOUR)
        print(
            f"  {policy}: "
            + ", ".join(f"{k} {a[k]:g} / {b[k]:g}" for k in _BEHAVIOUR)
            + (" (this / other, first round: the same)" if same else " (this / other: DIFFER)")
        )
    return {"pythons": pythons, "forms": forms, "rounds": docs, "medians": table}


# ----------------------------------------------------------------------------- main


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 requests instead of 2,000")
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed (default 0)")
    parser.add_argument(
        "--policy", choices=(*POLICIES, "both"), default="both", help="default: both"
    )
    parser.add_argument(
        "--no-lend", action="store_true", help="a fixed equal split (lend_free_memory off)"
    )
    parser.add_argument(
        "--waiting",
        type=int,
        nargs="+",
        metavar="N",
        help="instead of the replay: step cost with N more requests waiting, per N",
    )
    parser.add_argument("--warmup", type=int, default=100, help="--waiting: untimed steps")
    parser.add_argument("--steps", type=int, default=200, help="--waiting: measured steps")
    parser.add_argument(
        "--compare",
        metavar="PYTHON",
        help="run under this interpreter and PYTHON in alternating rounds; print both",
    )
    parser.add_argument("--rounds", type=int, default=5, help="--compare: rounds (default 5)")
    parser.add_argument(
        "--batch-form",
        action="store_true",
        help="the batch form: add_request + schedule(), prepare_resources(next_tokens=...)",
    )
    parser.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    args = parser.parse_args()
    args.policies = POLICIES if args.policy == "both" else (args.policy,)
    if args.waiting and any(n < 0 for n in args.waiting):
        parser.error("--waiting takes counts >= 0")

    if args.compare:
        doc = compare(args)
    else:
        # With --json - the tables go to stderr: stdout holds the JSON alone.
        doc = run_benchmark(args, sys.stderr if args.json == "-" else sys.stdout)
    if args.json == "-":
        json.dump(doc, sys.stdout)
        print()
    elif args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    main()
