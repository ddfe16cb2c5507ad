"""Runs one vLLM engine over waves of prompts and prints what it did as JSON (one process per
engine: vLLM's CPU worker keeps process-wide state).

Usage: ``python run_engine.py SPEC_JSON`` with ``{"kind", "which", "root", "waves":
[[prompt, ...], ...], "max_tokens", "reset_between": bool, "llm": {LLM kwargs}}``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from harness import engine, generate, scheduler_of


def main() -> None:
    spec = json.loads(sys.argv[1])
    llm = engine(spec["kind"], spec["which"], Path(spec["root"]), **spec.get("llm", {}))
    sched = scheduler_of(llm)
    outputs = []
    resets = []
    for i, wave in enumerate(spec["waves"]):
        if i and spec.get("reset_between"):
            resets.append(bool(llm.reset_prefix_cache()))
        outputs.append(generate(llm, wave, spec.get("max_tokens", 16)))
    p = sched.probe
    result = {
        "scheduler": type(sched).__mro__[1].__module__,
        "manager": type(sched.kv_cache_manager).__name__,
        "outputs": outputs,
        "resets": resets,
        "queries": p.queries,
        "hits": p.hits,
        "requests": p.requests,
        "preempted_requests": p.preempted_requests,
        "reset_stats": p.resets,
        "lookups": p.lookups,
        "trace": p.trace,
        "steps": len(p.schedule_s),
        "schedule_s": p.schedule_s,
        "update_s": p.update_s,
        "num_groups": len(sched.kv_cache_config.kv_cache_groups),
        "num_blocks": sched.kv_cache_config.num_blocks,
    }
    kv = getattr(sched.kv_cache_manager, "kv", None)
    if kv is not None:
        stats = kv.get_kv_cache_stats()
        result["copied_on_write_blocks"] = stats.copied_on_write_blocks
        result["blocks_per_window"] = {
            str(w): b for w, b in sched.kv_cache_manager.layout.blocks.items()
        }
        kv.check_invariants()
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
