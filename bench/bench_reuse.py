"""Block reuse: prefix lookups and a shared-system-prompt replay (virtual backend).

Prints tables of medians and totals; never asserts; seeded. Run:
``python bench/bench_reuse.py`` (``--quick``: 400 requests, well under a minute).

(a) ``get_reusable_prefix_length`` for 4k- and 32k-token prompts (numpy token arrays), a hit
    (the whole stored prompt) and a miss (the first token differs): median µs per call.

(b) The replay of issues 4/5/9: 2,000 requests; half start with one of 20 system prompts of
    1,024 tokens (chosen uniformly), the rest are unrelated; prompts 1,000-4,000 tokens,
    128-512 generated tokens; all queued at step 0 and served first come, first served
    with at most 128 running; a full-attention window and a 512-token sliding window (equal
    bytes per token), 32-token blocks, 20,000 primary blocks in total.

    Two engines drive ``KVCacheManager`` directly (not the resource manager and scheduler),
    so that the timings are the manager's own:

    * ``whole``: today's replay. Each step admits queued requests while
      ``get_num_blocks_to_allocate`` says every window has the blocks for the whole prompt
      (``add_sequence``, then ``store_context_blocks``: early reuse), appends one token to
      every running sequence with one ``add_tokens`` call, removes finished sequences (stored
      for reuse) and calls ``refresh_blocks``. No token budget.
    * ``chunk N`` (chunked prefill, engine-style): each step has a budget of
      ``max_num_batched_tokens`` (8,192) tokens. Decodes of running requests whose prompt is
      complete come first (one token each, one ``add_tokens`` call); then prefill chunks,
      first come first served: continuing prefills (one ``prefill(request_ids, chunks)``
      call for the step), then new admissions (``add_sequence(..., prefill=k)`` after
      ``get_num_blocks_to_allocate(..., prefill=k)`` said it fits), each chunk taking
      ``min(N, prompt tokens left, budget left)``. One ``store_context_blocks(request_ids)``
      call stores every chunk that ran; a request whose prompt is complete produces its
      first token and decodes from the next step on. ``--per-request-chunks`` calls
      ``prefill`` and ``store_context_blocks`` once per request instead, as before.

    Both: when ``add_tokens`` or ``prefill`` runs out of blocks, the newest running request
    is removed (its blocks stored for reuse) and queued again at the front with its
    generated tokens, which it then prefills as part of its prompt. An admission attempt
    that does not fit ends the step's admissions and counts as a *deferred admission*.

    Splits of the 20,000 blocks (512 / full): ``equal``; ``equal+lend``, the equal split
    with ``lend_free_memory`` (the windows lend each other free memory at run time);
    ``auto-old``, the ``"auto"`` share
    policy before issue 9 (in proportion to ``min(512 + 32, L)`` : ``L`` with ``L`` the mean
    sequence length); ``auto``, :func:`kvcache.sizing.blocks_per_window` with the ``"auto"``
    policy sized from demand (``max_batch_size`` 128, ``max_num_batched_tokens``, ``L``).

    Reported: manager seconds (wall time inside manager calls only, summed over the
    replay), the decode cost (median over steps of ns per sequence of the ``add_tokens``
    call, Python call included), steps, preemptions, deferred admissions, the hit rate
    (reused / (reused + missed) blocks overall, from ``get_kv_cache_stats``), the hit rate
    of first admissions only (``hit 1st``, from ``get_request_stats`` right after each
    request's first ``add_sequence``) and reused tokens, under
    ``swa_reuse_policy="invalidate"`` and ``"placeholder"``. The best possible hit rate is
    computed from the generated workload, counting blocks the way the manager does (reused =
    prompt block positions whose KV is found, missed = the other prompt block positions, the
    same in every window): every request whose system prompt appeared in an earlier request
    reuses its 32 system-prompt blocks, nothing else is ever reused. Re-admissions after a
    preemption count again in the overall hit rate (they reuse their own stored blocks), so a
    run with preemptions can exceed the "best"; ``hit 1st`` is the comparable figure.

``--sweep`` instead replays chunked prefill (placeholder policy) with the sliding window
given 1,000 to 10,000 of the 20,000 blocks (the full window the rest), then with one window
ample (40,000 blocks) and the other limited, and prints the peak of referenced blocks per
window as well: the measurement behind the demand sizing of the ``"auto"`` policy (see
bench/README.md). ``--paired R`` instead runs whole prompts and chunked prefill (chunks of
512 and 2,048, one ``prefill`` / ``store_context_blocks`` call per step and per request) on
the default split R times in alternating order and prints the median manager seconds and
the median ratio to whole prompts within a round. ``--chunks`` picks the prefill modes
(``whole`` and chunk caps), ``--max-num-batched-tokens`` the step budget.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig, OutOfBlocksError, PreparedPrompt
from kvcache.sizing import blocks_per_window, bytes_per_token

TPB = 32
PREPARED = True  # admissions pass prepared prompts (--raw-prompts: token arrays)
BATCHED_CHUNKS = True  # one prefill / store call per step (--per-request-chunks: per request)
SWA = 512
VOCAB = 32000
TOTAL_BLOCKS = 20_000
MAX_BATCH = 128
SPLITS = ("equal", "equal+lend", "auto-old", "auto")
POLICIES = ("invalidate", "placeholder")

T = TypeVar("T")


def _model() -> ModelConfig:
    return ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")


def _config(policy: str = "placeholder", **extra: object) -> KvCacheConfig:
    return KvCacheConfig(
        tokens_per_block=TPB,
        max_attention_window=[SWA, None],
        backend="virtual",
        enable_block_reuse=True,
        swa_reuse_policy=policy,
        **extra,  # type: ignore[arg-type]
    )


def _manager(
    blocks: dict[int, int], max_seq_len: int, policy: str, max_batch: int, lend: bool = False
) -> KVCacheManager:
    return KVCacheManager.from_blocks(
        _model(),
        _config(policy, lend_free_memory=lend),
        blocks,
        max_seq_len=max_seq_len,
        max_batch_size=max_batch,
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


# ----------------------------------------------------------------------------- (b) workload


@dataclass
class Req:
    rid: int
    prompt: np.ndarray
    max_new: int
    system: int  # index of its system prompt, -1 for none
    generated: list[int] = field(default_factory=list)
    admissions: int = 0

    def tokens(self) -> np.ndarray:
        """What an admission registers: the prompt, plus the tokens generated before a
        preemption."""
        if not self.generated:
            return self.prompt
        return np.concatenate([self.prompt, np.asarray(self.generated, dtype=np.int32)])


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


def mean_seq_len(reqs: list[Req]) -> int:
    """Mean prompt plus generated length (the last generated token is never stored)."""
    return round(sum(len(r.prompt) + r.max_new - 1 for r in reqs) / len(reqs))


def split_blocks(
    reqs: list[Req], max_seq_len: int, how: str, batched_tokens: int
) -> dict[int, int]:
    """The 20,000 blocks per window: ``equal`` (also the initial split of ``equal+lend``),
    ``auto-old`` or ``auto``."""
    total = TOTAL_BLOCKS
    if how in ("equal", "equal+lend"):
        return {SWA: total // 2, max_seq_len: total - total // 2}
    length = mean_seq_len(reqs)
    if how == "auto-old":
        full = int(total * length / (length + min(SWA + TPB, length)))
        return {SWA: total - full, max_seq_len: full}
    config = _config(window_size_shares="auto", max_num_batched_tokens=batched_tokens)
    block_bytes = bytes_per_token(_model(), config, max_seq_len)[SWA] * TPB  # equal in both
    out = blocks_per_window(
        _model(),
        config,
        max_seq_len,
        total * block_bytes,
        expected_seq_len=length,
        max_batch_size=MAX_BATCH,
    )
    return {w: primary for w, (primary, _) in out.items()}


# ----------------------------------------------------------------------------- (b) replays


@dataclass
class ReplayResult:
    manager_s: float = 0.0
    decode_ns_per_seq: list[float] = field(default_factory=list)  # one per add_tokens step
    steps: int = 0
    preemptions: int = 0
    deferred: int = 0
    reused_tokens: int = 0
    hit_rate: float = 0.0
    first_reused: int = 0  # blocks (summed over windows) reused by first admissions
    first_missed: int = 0
    peak_live: dict[int, int] = field(default_factory=dict)  # most referenced blocks
    wall_s: float = 0.0

    @property
    def first_hit_rate(self) -> float:
        """The hit rate of first admissions only (re-admissions after a preemption reuse
        their own blocks): comparable with the best possible."""
        return self.first_reused / max(self.first_reused + self.first_missed, 1)

    @property
    def decode_ns(self) -> float:
        """Median over decode steps of the ``add_tokens`` time per sequence."""
        return statistics.median(self.decode_ns_per_seq) if self.decode_ns_per_seq else 0.0

    def add_decode(self, seconds: float, batch: int) -> None:
        """Records one successful ``add_tokens`` call of ``batch`` sequences."""
        self.decode_ns_per_seq.append(seconds / batch * 1e9)


class _Timed:
    """Calls into the manager, adding their wall time to ``result.manager_s``."""

    def __init__(self, manager: KVCacheManager, result: ReplayResult) -> None:
        self.m = manager
        self.res = result
        self._prepared: dict[int, PreparedPrompt] = {}

    def prompt(self, r: Req) -> np.ndarray | PreparedPrompt:
        """What an admission passes: the tokens, or (by default) a prompt prepared once per
        admission of ``r`` (preparing is timed), so a deferred admission retried every step
        converts and hashes nothing again."""
        tokens = r.tokens()
        if not PREPARED:
            return tokens
        p = self._prepared.get(r.rid)
        if p is None or len(p) != len(tokens):  # new, or re-admitted with generated tokens
            p = self(self.m.prepare, tokens)
            self._prepared[r.rid] = p
        return p

    def __call__(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.res.manager_s += time.perf_counter() - t0

    def admit(self, r: Req, tokens: np.ndarray | PreparedPrompt, prefill: int | None) -> int:
        """``add_sequence``; counts the reuse of a first admission (outside the timing)."""
        reused: int = self(self.m.add_sequence, r.rid, tokens, prefill=prefill)
        self.res.reused_tokens += reused
        r.admissions += 1
        if r.admissions == 1:
            stats = self.m.get_request_stats(r.rid)
            self.res.first_reused += stats["reused_blocks"]
            self.res.first_missed += stats["missed_blocks"]
        return reused

    def end_step(self) -> None:
        """``refresh_blocks``, then the referenced blocks per window (not timed)."""
        self(self.m.refresh_blocks)
        for w in self.m.window_sizes:
            live = self.m.get_num_used_blocks(w)
            self.res.peak_live[w] = max(self.res.peak_live.get(w, 0), live)
        self.res.steps += 1

    def fits(self, tokens: np.ndarray | PreparedPrompt, prefill: int | None) -> bool:
        """Whether ``add_sequence(tokens, prefill=prefill)`` finds the blocks now (every
        window at once: under lending the windows compete for the same free memory)."""
        need = self(self.m.get_num_blocks_to_allocate, tokens, prefill=prefill)
        return self(self.m.can_allocate, need)


def _finish(m: KVCacheManager, res: ReplayResult, wall0: float) -> ReplayResult:
    res.wall_s = time.perf_counter() - wall0
    m.check_invariants()
    res.hit_rate = m.get_kv_cache_stats().cache_hit_rate
    return res


def replay_whole(
    reqs: list[Req], blocks: dict[int, int], max_seq_len: int, policy: str, lend: bool = False
) -> ReplayResult:
    """Today's replay: whole prompts at admission, no token budget (see the module doc)."""
    m = _manager(blocks, max_seq_len, policy, MAX_BATCH, lend)
    res = ReplayResult()
    call = _Timed(m, res)
    queue = deque(reqs)
    running: list[Req] = []
    rng = np.random.default_rng(99)
    wall0 = time.perf_counter()
    while queue or running:
        while queue and len(running) < MAX_BATCH:  # admit, first come first served
            r = queue[0]
            tokens = call.prompt(r)
            if not call.fits(tokens, None):
                res.deferred += 1
                break
            call.admit(r, tokens, None)
            call(m.store_context_blocks, r.rid)
            queue.popleft()
            r.generated.append(int(rng.integers(0, VOCAB)))  # the context step's token
            running.append(r)
        batch = [r for r in running if len(r.generated) < r.max_new]
        while batch:
            ids, toks = [r.rid for r in batch], [r.generated[-1] for r in batch]
            t0 = time.perf_counter()
            try:
                call(m.add_tokens, ids, toks)
            except OutOfBlocksError:
                victim = running.pop()  # the newest
                call(m.remove_sequence, victim.rid)
                res.preemptions += 1
                queue.appendleft(victim)
                batch = [r for r in batch if r is not victim]
                continue
            res.add_decode(time.perf_counter() - t0, len(batch))
            break
        for r in batch:
            r.generated.append(int(rng.integers(0, VOCAB)))
        for r in [r for r in running if len(r.generated) >= r.max_new]:
            call(m.remove_sequence, r.rid)
            running.remove(r)
        call.end_step()
    return _finish(m, res, wall0)


@dataclass(eq=False)
class _Active:
    """An admitted request in the chunked engine."""

    req: Req
    left: int  # prompt tokens still to prefill
    alive: bool = True


class ChunkedReplay:
    """The engine-style replay with chunked prefill (see the module doc)."""

    def __init__(
        self,
        reqs: list[Req],
        blocks: dict[int, int],
        max_seq_len: int,
        policy: str,
        chunk: int,
        batched_tokens: int,
        lend: bool = False,
    ) -> None:
        self.m = _manager(blocks, max_seq_len, policy, MAX_BATCH, lend)
        self.res = ReplayResult()
        self.call = _Timed(self.m, self.res)
        self.chunk = chunk
        self.batched_tokens = batched_tokens
        self.queue = deque(reqs)
        self.running: list[_Active] = []
        self.rng = np.random.default_rng(99)

    def run(self) -> ReplayResult:
        """Steps until every request finished."""
        wall0 = time.perf_counter()
        while self.queue or self.running:
            self.step()
        return _finish(self.m, self.res, wall0)

    def step(self) -> None:
        """Schedules decodes and chunks within the token budget, then 'runs' them."""
        decodes = [a for a in self.running if a.left == 0]
        budget = self.batched_tokens - len(decodes)
        self._decode(decodes)
        chunks: list[_Active] = []
        if BATCHED_CHUNKS:
            budget = self._prefill_batch(budget, chunks)
        else:
            for a in [a for a in self.running if a.left > 0]:
                k = min(self.chunk, a.left, budget)
                if k == 0:
                    break
                if a.alive and self._prefill(a, k):
                    budget -= k
                    chunks.append(a)
        self._admit(budget, chunks)
        ran = [a.req.rid for a in chunks if a.alive]
        if not BATCHED_CHUNKS:
            for rid in ran:
                self.call(self.m.store_context_blocks, rid)
        elif ran:
            self.call(self.m.store_context_blocks, ran)
        self._complete(decodes, chunks)
        self.call.end_step()

    def _preempt_newest(self) -> _Active:
        victim = self.running.pop()
        victim.alive = False
        self.call(self.m.remove_sequence, victim.req.rid)
        self.res.preemptions += 1
        self.queue.appendleft(victim.req)
        return victim

    def _decode(self, decodes: list[_Active]) -> None:
        batch = decodes
        while batch:
            ids, toks = [a.req.rid for a in batch], [a.req.generated[-1] for a in batch]
            t0 = time.perf_counter()
            try:
                self.call(self.m.add_tokens, ids, toks)
            except OutOfBlocksError:
                self._preempt_newest()
                batch = [a for a in batch if a.alive]
                continue
            self.res.add_decode(time.perf_counter() - t0, len(batch))
            return

    def _prefill(self, a: _Active, k: int) -> bool:
        while a.alive:
            try:
                self.call(self.m.prefill, a.req.rid, k)
            except OutOfBlocksError:
                self._preempt_newest()
                continue
            a.left -= k
            return True
        return False

    def _prefill_batch(self, budget: int, chunks: list[_Active]) -> int:
        """The continuing prefills' chunks in one ``prefill`` call; returns the budget left."""
        plan: list[tuple[_Active, int]] = []
        for a in [a for a in self.running if a.left > 0]:
            k = min(self.chunk, a.left, budget)
            if k == 0:
                break
            plan.append((a, k))
            budget -= k
        while plan:
            try:
                self.call(self.m.prefill, [a.req.rid for a, _ in plan], [k for _, k in plan])
            except OutOfBlocksError:
                victim = self._preempt_newest()
                budget += sum(k for a, k in plan if a is victim)
                plan = [(a, k) for a, k in plan if a.alive]
                continue
            break
        for a, k in plan:
            a.left -= k
            chunks.append(a)
        return budget

    def _admit(self, budget: int, chunks: list[_Active]) -> None:
        while self.queue and len(self.running) < MAX_BATCH and budget > 0:
            r = self.queue[0]
            tokens = self.call.prompt(r)
            k = min(self.chunk, budget)
            if not self.call.fits(tokens, k):
                self.res.deferred += 1
                return
            reused = self.call.admit(r, tokens, k)
            done = min(k, len(tokens) - reused)
            budget -= done
            self.queue.popleft()
            a = _Active(r, len(tokens) - reused - done)
            self.running.append(a)
            chunks.append(a)

    def _complete(self, decodes: list[_Active], chunks: list[_Active]) -> None:
        """The step's forward pass: new tokens, then finished requests leave."""
        for a in decodes + [a for a in chunks if a.left == 0]:
            if a.alive:
                a.req.generated.append(int(self.rng.integers(0, VOCAB)))
        still = []
        for a in self.running:
            if len(a.req.generated) >= a.req.max_new:
                self.call(self.m.remove_sequence, a.req.rid)
            else:
                still.append(a)
        self.running = still


def run_replay(
    reqs: list[Req],
    blocks: dict[int, int],
    max_seq_len: int,
    policy: str,
    chunk: int | None,
    batched_tokens: int,
    lend: bool = False,
) -> ReplayResult:
    """One replay from a fresh state: whole prompts (``chunk=None``) or chunked prefill;
    ``lend``: the windows lend each other memory (``lend_free_memory``)."""
    for r in reqs:
        r.generated = []
        r.admissions = 0
    if chunk is None:
        return replay_whole(reqs, blocks, max_seq_len, policy, lend)
    return ChunkedReplay(reqs, blocks, max_seq_len, policy, chunk, batched_tokens, lend).run()


# ----------------------------------------------------------------------------- output


def _print_replays(
    reqs: list[Req], max_seq_len: int, chunks: list[int | None], batched_tokens: int
) -> None:
    print(
        f"  {'prefill':<11}{'split (512 / full)':<27}{'swa_reuse_policy':<18}{'manager s':>10}"
        f"{'decode ns/seq':>15}{'steps':>8}{'preempt':>9}{'deferred':>10}{'hit rate':>10}"
        f"{'hit 1st':>9}{'reused tokens':>15}"
    )
    for chunk in chunks:
        label = "whole" if chunk is None else f"chunk {chunk}"
        for how in SPLITS:
            blocks = split_blocks(reqs, max_seq_len, how, batched_tokens)
            split = f"{how} {blocks[SWA]:,}/{blocks[max_seq_len]:,}"
            for policy in POLICIES:
                res = run_replay(
                    reqs, blocks, max_seq_len, policy, chunk, batched_tokens, how == "equal+lend"
                )
                print(
                    f"  {label:<11}{split:<27}{policy:<18}{res.manager_s:>10.2f}"
                    f"{res.decode_ns:>15.1f}{res.steps:>8,}{res.preemptions:>9,}"
                    f"{res.deferred:>10,}{res.hit_rate:>10.1%}{res.first_hit_rate:>9.1%}"
                    f"{res.reused_tokens:>15,}"
                )


def _sweep_splits() -> list[tuple[int, int]]:
    """(512, full) blocks: the 20,000 split every 500 blocks, then each window alone
    limited (the other one ample, 40,000 blocks) to see which window limits what."""
    splits = [(swa, TOTAL_BLOCKS - swa) for swa in range(1000, 10001, 500)]
    ample = 40_000
    splits += [(swa, ample) for swa in (6000, 9000, 12000)]
    splits += [(ample, full) for full in (10500, 11000, 14000)]
    return splits


def _print_sweep(
    reqs: list[Req], max_seq_len: int, chunks: list[int | None], batched_tokens: int
) -> None:
    print(
        f"  {'prefill':<11}{'512 / full':<16}{'preempt':>9}{'deferred':>10}{'hit rate':>10}"
        f"{'hit 1st':>9}{'peak live 512 / full':>22}"
    )
    for chunk in chunks:
        label = "whole" if chunk is None else f"chunk {chunk}"
        for swa, full in _sweep_splits():
            blocks = {SWA: swa, max_seq_len: full}
            res = run_replay(reqs, blocks, max_seq_len, "placeholder", chunk, batched_tokens)
            peak = f"{res.peak_live[SWA]:,} / {res.peak_live[max_seq_len]:,}"
            print(
                f"  {label:<11}{f'{swa:,}/{full:,}':<16}{res.preemptions:>9,}"
                f"{res.deferred:>10,}{res.hit_rate:>10.1%}{res.first_hit_rate:>9.1%}{peak:>22}"
            )


def _print_paired(reqs: list[Req], max_seq_len: int, batched_tokens: int, rounds: int) -> None:
    """Manager seconds of whole prompts against chunked prefill, on the default (``auto``)
    split under ``"placeholder"``, the modes run in turn (reversed every other round, so a
    drift of the machine's speed hits all alike); medians, and the median over rounds of
    each mode's ratio to whole prompts in the same round."""
    global BATCHED_CHUNKS
    modes: list[tuple[str, int | None, bool]] = [
        ("whole", None, True),
        ("chunk 512", 512, True),
        ("chunk 512, per request", 512, False),
        ("chunk 2048", 2048, True),
        ("chunk 2048, per request", 2048, False),
    ]
    blocks = split_blocks(reqs, max_seq_len, "auto", batched_tokens)
    times: dict[str, list[float]] = {label: [] for label, _, _ in modes}
    before = BATCHED_CHUNKS
    for r in range(rounds):
        for label, chunk, batched in modes if r % 2 == 0 else modes[::-1]:
            BATCHED_CHUNKS = batched
            res = run_replay(reqs, blocks, max_seq_len, "placeholder", chunk, batched_tokens)
            times[label].append(res.manager_s)
    BATCHED_CHUNKS = before
    print(f"\n(c) manager seconds, {rounds} rounds in alternating order (auto split, placeholder)")
    print(f"  {'prefill':<26}{'median s':>9}{'vs whole':>10}{'range of ratios':>18}")
    for label, _, _ in modes:
        ratios = [t / w for t, w in zip(times[label], times["whole"], strict=True)]
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}"
        print(
            f"  {label:<26}{statistics.median(times[label]):>9.3f}"
            f"{statistics.median(ratios):>10.2f}{spread:>18}"
        )


def _chunk_list(text: str) -> list[int | None]:
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip()
        out.append(None if part == "whole" else int(part))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="400 requests, fewer repeats")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--chunks",
        type=_chunk_list,
        default=[None, 512, 2048],
        help="prefill modes to replay: 'whole' and chunk caps (default whole,512,2048)",
    )
    parser.add_argument(
        "--max-num-batched-tokens", type=int, default=8192, help="token budget per step"
    )
    parser.add_argument("--sweep", action="store_true", help="sweep the split instead of the table")
    parser.add_argument(
        "--raw-prompts",
        action="store_true",
        help="pass token arrays to every admission call instead of prepared prompts",
    )
    parser.add_argument(
        "--paired",
        type=int,
        metavar="R",
        default=0,
        help="instead of the table: R alternating rounds of whole vs chunked manager time",
    )
    parser.add_argument(
        "--per-request-chunks",
        action="store_true",
        help="one prefill and one store_context_blocks call per chunk instead of per step",
    )
    args = parser.parse_args()
    global PREPARED, BATCHED_CHUNKS
    PREPARED = not args.raw_prompts
    BATCHED_CHUNKS = not args.per_request_chunks
    num_requests = 400 if args.quick else 2000
    repeats = 50 if args.quick else 300
    budget = args.max_num_batched_tokens

    reqs = make_workload(num_requests, args.seed)
    max_seq_len = max(len(r.prompt) + r.max_new for r in reqs)
    title = (
        f"(b) replay: {num_requests:,} requests, half behind one of 20 system prompts of 1,024 "
        f"tokens, at most {MAX_BATCH} running, windows {SWA} and full ({max_seq_len:,}), "
        f"{TOTAL_BLOCKS:,} blocks, max_num_batched_tokens {budget:,}, mean length "
        f"{mean_seq_len(reqs):,}"
    )
    if args.sweep:
        print(title)
        _print_sweep(reqs, max_seq_len, args.chunks, budget)
        return
    if args.paired:
        print(title)
        _print_paired(reqs, max_seq_len, budget, args.paired)
        return

    print("(a) get_reusable_prefix_length, windows {512, full}, 32-token blocks")
    print(f"  {'lookup':<28}{'median':>12}")
    for label, us in bench_lookups(repeats):
        print(f"  {label:<28}{us:>9.1f} µs")
    print()
    print(title)
    _print_replays(reqs, max_seq_len, args.chunks, budget)
    reused, missed = best_hit_rate(reqs)
    print(f"  best possible hit rate {reused / (reused + missed):.1%}, {reused * TPB:,} tokens")


if __name__ == "__main__":
    main()
