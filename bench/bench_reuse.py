"""Block reuse: prefix lookups and a shared-system-prompt replay (virtual backend).

Prints tables of medians and totals; never asserts; seeded. Run:
``python bench/bench_reuse.py`` (``--quick`` for a smaller replay).

(a) ``get_reusable_prefix_length`` for 4k- and 32k-token prompts (numpy token arrays), a hit
    (the whole stored prompt) and a miss (the first token differs): median µs per call.

(b) The replay of issue 4/5: 2,000 requests; half start with one of 20 system prompts of
    1,024 tokens (chosen uniformly), the rest are unrelated; prompts 1,000-4,000 tokens,
    128-512 generated tokens; all queued at step 0 and served first come, first served
    with at most 128 running; a full-attention window and a 512-token sliding window,
    32-token blocks, 20,000 primary blocks in total.

    The 20,000 blocks are split two ways (both printed): ``equal``, 10,000 per window; and
    like the ``"auto"`` share policy with equal bytes per token in both windows, in
    proportion to what one sequence of the workload's mean length L keeps live, ``L`` for
    full attention and ``min(512 + 32, L)`` for the sliding window. ``auto`` starves the
    sliding window of room for cached blocks (every prompt is registered whole in it), so
    its cached system-prompt blocks are evicted and the hit rate drops.

    The replay drives ``KVCacheManager`` directly, not the resource manager and scheduler,
    so that the timings are the manager's own: each step admits queued requests while
    ``get_num_blocks_to_allocate`` says every window has the blocks (then ``add_sequence``
    and ``store_context_blocks``, early reuse), appends one token to every running
    sequence with one ``add_tokens`` call, removes finished sequences (stored for reuse)
    and calls ``refresh_blocks``. If ``add_tokens`` runs out of blocks, the newest running
    request is removed (its blocks stored) and queued again at the front with its
    generated tokens, like the ``max_utilization`` scheduler.

    Reported: manager seconds (wall time inside manager calls only), the decode cost (ns per
    sequence per ``add_tokens`` step, Python call included), the hit rate (reused / (reused
    + missed) blocks, per window and overall, from ``get_kv_cache_stats``) and preemptions,
    under ``swa_reuse_policy="invalidate"`` and ``"placeholder"``. The best possible hit
    rate is computed from the generated workload, counting blocks the way the manager does
    (reused = prompt block positions whose KV is found, missed = the other prompt block
    positions, the same in every window): every request whose system prompt appeared in an
    earlier request reuses its 32 system-prompt blocks, nothing else is ever reused.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig, OutOfBlocksError

TPB = 32
SWA = 512
VOCAB = 32000


def _model() -> ModelConfig:
    return ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def _manager(
    blocks: dict[int, int], max_seq_len: int, policy: str, max_batch: int
) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=[SWA, None],
        backend="virtual",
        enable_block_reuse=True,
        swa_reuse_policy=policy,
    )
    return KVCacheManager.from_blocks(
        _model(), config, blocks, max_seq_len=max_seq_len, max_batch_size=max_batch
    )


# ----------------------------------------------------------------------------- (a) lookups


def bench_lookups(repeats: int) -> list[tuple[str, float]]:
    rng = np.random.default_rng(1)
    max_seq_len = 32768 + 64
    m = _manager({SWA: 2048, max_seq_len: 2048}, max_seq_len, "placeholder", 4)
    rows = []
    for rid, n in enumerate((4096, 32768)):
        prompt = rng.integers(0, VOCAB, n, dtype=np.int32)
        m.add_sequence(rid, prompt)
        m.add_token(rid, 7)
        m.remove_sequence(rid)  # stores the prompt
        miss = prompt.copy()
        miss[0] = (miss[0] + 1) % VOCAB
        assert m.get_reusable_prefix_length(prompt) == n - 1, "the stored prompt must hit"
        for label, tokens in (("hit", prompt), ("miss", miss)):
            samples = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                m.get_reusable_prefix_length(tokens)
                samples.append(time.perf_counter() - t0)
            rows.append((f"{n // 1024}k-token prompt, {label}", statistics.median(samples) * 1e6))
    return rows


# ----------------------------------------------------------------------------- (b) replay


@dataclass
class Req:
    rid: int
    prompt: np.ndarray
    max_new: int
    system: int  # index of its system prompt, -1 for none
    generated: list[int] = field(default_factory=list)


def make_workload(num_requests: int, seed: int) -> list[Req]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, 1024, dtype=np.int32) for _ in range(20)]
    reqs = []
    for rid in range(num_requests):
        length = int(rng.integers(1000, 4001))
        max_new = int(rng.integers(128, 513))
        if rid % 2 == 0:  # half of them, interleaved; at least one token after the system
            s = int(rng.integers(0, 20))
            length = max(length, 1025)
            tail = rng.integers(0, VOCAB, length - 1024, dtype=np.int32)
            prompt = np.concatenate([systems[s], tail])
        else:
            s = -1
            prompt = rng.integers(0, VOCAB, length, dtype=np.int32)
        reqs.append(Req(rid, prompt, max_new, s))
    return reqs


def best_hit_rate(reqs: list[Req]) -> tuple[int, int]:
    """(reused, missed) prompt blocks per window if every repeated system prompt is reused
    in full and nothing else is."""
    seen: set[int] = set()
    reused = total = 0
    for r in reqs:
        total += -(-len(r.prompt) // TPB)
        if r.system >= 0:
            if r.system in seen:
                reused += 1024 // TPB
            seen.add(r.system)
    return reused, total - reused


def split_blocks(reqs: list[Req], total: int, max_seq_len: int, how: str) -> dict[int, int]:
    if how == "equal":
        return {SWA: total // 2, max_seq_len: total - total // 2}
    mean_len = round(sum(len(r.prompt) + r.max_new - 1 for r in reqs) / len(reqs))
    full_share = mean_len / (mean_len + min(SWA + TPB, mean_len))
    full = int(total * full_share)
    return {SWA: total - full, max_seq_len: full}


@dataclass
class ReplayResult:
    manager_s: float
    decode_ns: float
    steps: int
    preemptions: int
    hit_rate: float
    hit_rate_per_window: dict[int, float]
    reused_tokens: int
    wall_s: float


def replay(reqs: list[Req], blocks: dict[int, int], max_seq_len: int, policy: str) -> ReplayResult:
    m = _manager(blocks, max_seq_len, policy, 128)
    windows = sorted(blocks)
    queue = list(reqs)[::-1]  # pop() from the end = first come
    running: list[Req] = []
    tokens_rng = np.random.default_rng(99)
    mgr = 0.0
    decode_time = 0.0
    decode_entries = 0
    steps = preemptions = reused_tokens = 0
    wall0 = time.perf_counter()
    pc = time.perf_counter
    while queue or running:
        # admit, first come first served
        while queue and len(running) < 128:
            r = queue[-1]
            tokens = r.prompt if not r.generated else np.concatenate([r.prompt, r.generated])
            t0 = pc()
            need = m.get_num_blocks_to_allocate(tokens)
            ok = all(need[w] <= m.get_num_free_blocks(w) for w in windows)
            if ok:
                reused_tokens += m.add_sequence(r.rid, tokens)
                m.store_context_blocks(r.rid)
            mgr += pc() - t0
            if not ok:
                break
            queue.pop()
            r.generated.append(int(tokens_rng.integers(0, VOCAB)))  # the context step's token
            running.append(r)
        # decode: the newest token of every running request that already has one cached
        batch = [r for r in running if len(r.generated) < r.max_new]
        while batch:
            ids = [r.rid for r in batch]
            toks = [r.generated[-1] for r in batch]
            t0 = pc()
            try:
                m.add_tokens(ids, toks)
            except OutOfBlocksError:
                victim = running.pop()  # the newest
                m.remove_sequence(victim.rid)
                mgr += pc() - t0
                preemptions += 1
                queue.append(victim)
                batch = [r for r in batch if r is not victim]
                continue
            dt = pc() - t0
            mgr += dt
            decode_time += dt
            decode_entries += len(batch)
            break
        for r in batch:
            r.generated.append(int(tokens_rng.integers(0, VOCAB)))
        t0 = pc()
        still = []
        for r in running:
            if len(r.generated) >= r.max_new:
                m.remove_sequence(r.rid)
            else:
                still.append(r)
        m.refresh_blocks()
        mgr += pc() - t0
        running = still
        steps += 1
    wall = pc() - wall0
    m.check_invariants()
    stats = m.get_kv_cache_stats()
    return ReplayResult(
        manager_s=mgr,
        decode_ns=decode_time / max(decode_entries, 1) * 1e9,
        steps=steps,
        preemptions=preemptions,
        hit_rate=stats.cache_hit_rate,
        hit_rate_per_window=dict(stats.cache_hit_rate_per_window_size),
        reused_tokens=reused_tokens,
        wall_s=wall,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 requests, fewer repeats")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    num_requests = 400 if args.quick else 2000
    repeats = 50 if args.quick else 300

    print("(a) get_reusable_prefix_length, windows {512, full}, 32-token blocks")
    print(f"  {'lookup':<28}{'median':>12}")
    for label, us in bench_lookups(repeats):
        print(f"  {label:<28}{us:>9.1f} µs")

    reqs = make_workload(num_requests, args.seed)
    max_seq_len = max(len(r.prompt) + r.max_new for r in reqs)
    reused, missed = best_hit_rate(reqs)
    print()
    print(
        f"(b) replay: {num_requests:,} requests, half behind one of 20 system prompts of 1,024 "
        f"tokens, at most 128 running, windows {SWA} and full ({max_seq_len:,}), 20,000 blocks"
    )
    print(
        f"  {'split (512 / full)':<22}{'swa_reuse_policy':<18}{'manager s':>10}"
        f"{'decode ns/seq':>15}{'steps':>8}{'preempt':>9}{'hit rate':>10}{'window 512':>12}"
        f"{'full':>8}{'reused tokens':>15}"
    )
    for how in ("equal", "auto"):
        blocks = split_blocks(reqs, 20_000, max_seq_len, how)
        split = f"{how} {blocks[SWA]:,}/{blocks[max_seq_len]:,}"
        for policy in ("invalidate", "placeholder"):
            for r in reqs:
                r.generated = []
            res = replay(reqs, blocks, max_seq_len, policy)
            per = res.hit_rate_per_window
            print(
                f"  {split:<22}{policy:<18}{res.manager_s:>10.2f}{res.decode_ns:>15.1f}"
                f"{res.steps:>8,}{res.preemptions:>9,}{res.hit_rate:>10.1%}"
                f"{per.get(SWA, 0.0):>12.1%}{per.get(max_seq_len, 0.0):>8.1%}"
                f"{res.reused_tokens:>15,}"
            )
    best = reused / (reused + missed)
    print(
        f"  {'any':<22}{'best possible':<18}{'':>10}{'':>15}{'':>8}{'':>9}{best:>10.1%}"
        f"{best:>12.1%}{best:>8.1%}{reused * TPB:>15,}"
    )


if __name__ == "__main__":
    main()
