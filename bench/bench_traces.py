"""A public trace as it is: achieved hit rate against the trace's bounds (virtual backend).

Replays a Mooncake-format trace (``timestamp``, ``input_length``, ``output_length``,
``hash_ids``; e.g. the synthetic trace of Mooncake's FAST'25 release,
``FAST25-release/traces/synthetic_trace.jsonl`` in github.com/kvcache-ai/Mooncake) with
``kvcache.simulate.simulate`` for two presets, one attention-only (llama-3.1-8b) and one with
sliding windows (gemma-3-12b, 5 sliding layers of 1,024 tokens per full one), at two primary
memory sizes each, everything else at ``kvcache simulate``'s defaults (32-token blocks,
equal shares, max_utilization, chunked prefill of 8,192 tokens per step, 50 ms per step for
the timestamps, no host cache). For each run it prints the prompt-token hit rate the manager
achieved (first admissions, whole blocks), a plain LRU cache and Belady's MIN of the same
pool (the largest window's blocks), the trace's ideal (an unbounded cache), the lost hits by
cause (percent of prompt tokens), the manager's mean time per engine step and the wall time
of the replay; then each run's one-line verdict. The keys are computed once
(``kvcache.simulate.key_trace``). Seeded by construction (the tokens are a function of the
hash ids); never asserts. Run::

    python bench/bench_traces.py TRACE.jsonl [--first N] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from kvcache.simulate import TraceFile, key_trace, simulate
from kvcache.sizing import format_size, parse_size

MODELS = ("llama-3.1-8b", "gemma-3-12b")
MEMORIES = ("40GiB", "160GiB")
CAUSES = ("not yet stored", "capacity", "sliding window", "rejected")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a Mooncake-format (or kvcache-format) JSON Lines trace")
    p.add_argument("--first", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated presets")
    p.add_argument("--memories", default=",".join(MEMORIES), help="comma-separated sizes")
    p.add_argument("--step-ms", type=float, default=None, help="ms per engine step (50)")
    p.add_argument("--json", default=None, help="also write the rows as JSON")
    args = p.parse_args()

    trace = TraceFile(args.trace, first=args.first, step_ms=args.step_ms)
    summary = trace.scan()
    print(
        f"{args.trace}: {summary.requests:,} requests ({summary.format} format), "
        f"{summary.prompt_tokens / summary.requests:,.0f} prompt tokens on average, "
        f"{summary.prompt_tokens / 1e6:.1f} M in all"
    )
    t0 = time.perf_counter()
    keys = key_trace(trace, 32)
    print(f"block keys: {len(keys.keys):,} blocks of 32 tokens in {time.perf_counter() - t0:.1f} s")
    header = (
        f"{'model':<14}{'memory':>8}{'pool blocks':>13}{'achieved':>10}{'LRU':>8}{'Belady':>8}"
        f"{'ideal':>8}  "
        + "".join(f"{c:>16}" for c in CAUSES)
        + f"{'mgr µs/step':>13}{'wall s':>8}"
    )
    print(header)
    rows = []
    for model in args.models.split(","):
        for memory in args.memories.split(","):
            t0 = time.perf_counter()
            r = simulate(trace, model=model, memory_bytes=parse_size(memory), key_trace=keys)
            wall = time.perf_counter() - t0
            h = r.hit_bounds
            assert h is not None
            lost = {c: h.lost_tokens[c] / h.prompt_tokens for c in CAUSES}
            print(
                f"{model:<14}{format_size(r.memory_bytes):>8}{h.capacity_blocks:>13,}"
                f"{h.achieved_hit_rate:>10.1%}{h.lru_hit_rate:>8.1%}"
                f"{h.belady_hit_rate or 0:>8.1%}{h.ideal_hit_rate:>8.1%}  "
                + "".join(f"{v:>16.1%}" for v in lost.values())
                + f"{r.manager_us_per_step:>13,.0f}{r.wall_seconds:>8.1f}"
            )
            sys.stdout.flush()
            rows.append(
                {
                    "model": model,
                    "memory": memory,
                    "requests": r.requests,
                    "completed": r.completed,
                    "rejected": r.rejected,
                    "steps": r.steps,
                    "pause_events": r.pause_events,
                    "manager_us_per_step": r.manager_us_per_step,
                    "replay_seconds": r.wall_seconds,
                    "run_seconds": wall,
                    "hit_bounds": r.to_dict(with_series=False)["hit_bounds"],
                }
            )
    print()
    for row in rows:
        print(f"{row['model']}, {row['memory']}: {row['hit_bounds']['verdict']}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"trace": args.trace, "first": args.first, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
