"""How far from the possible: a trace's offline hit-rate bounds, and why a run lost hits.

Everything here is computed from the trace alone (plus, for the breakdown, what a run
recorded), on the same block keys as the manager's: :func:`key_trace` hashes every request
with :func:`kvcache.block_hashes` at the run's ``tokens_per_block`` (the core's own chained
keys, ``lora_task_id`` and ``cache_salt`` included). A request *looks up* the full blocks of
its prompt but the last token (the manager always computes that one again) and *stores* the
full blocks of what it holds when it ends: prompt and output but the last two tokens (the
last generated token is never computed; the manager keeps one token less than it holds). A
hit is the longest run of looked-up blocks, from the first, that the cache holds; hit rates
are hit tokens over prompt tokens. Requests are taken in replay order (arrival step, then
id; a streamed file in file order).

* **Ideal** (:func:`ideal_hits`): an unbounded cache: a block hits if any earlier request
  stored its key. No timing: a block still being prefilled counts as stored.
* **LRU** (:func:`lru_hits`): a plain LRU cache of ``capacity`` blocks, one pass over an
  ``OrderedDict``: a request's lookup, then all its blocks touched from its last to its first
  (so a chain is evicted from its end, as an engine's free queue does), then evictions from
  the least recently used end. O(total blocks).
* **Belady** (:func:`belady_hits`): the same capacity, evicting the block whose next lookup
  is farthest away (and not caching a block that is looked up later than everything cached,
  or never): Belady's MIN, with next-use positions computed in one vectorized pass and a
  heap. A block's next lookup always comes before its children's, so the cache stays closed
  under prefixes and MIN's block hits are its prefix hits: it is an upper bound for the LRU,
  and an estimate (not a proof) of the best any eviction order does at this capacity.

:func:`analyze_run` sets a run's achieved hits (the manager's reuse at each request's first
admission, in whole blocks) beside these and splits ``ideal - achieved`` by cause; see
:class:`HitBounds`.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from kvcache.cache.block_keys import block_hashes
from kvcache.simulate.workload import TokenArrays, TraceFile, TraceRequest

__all__ = [
    "NEAR_IDEAL",
    "HitBounds",
    "KeyTrace",
    "RunRecord",
    "analyze_run",
    "belady_hits",
    "ideal_hits",
    "key_trace",
    "lru_hits",
]

#: Within this much (a fraction: 1 percentage point) of the ideal, more memory cannot help.
NEAR_IDEAL = 0.01

_I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class KeyTrace:
    """The block keys of a trace's requests, in replay order.

    Attributes:
        tokens_per_block: Block size of the keys.
        request_ids: Each request's id.
        prompt_lengths: Each request's prompt tokens.
        output_lengths: Each request's output tokens.
        starts: Offsets into ``keys``: request ``i`` has ``keys[starts[i]:starts[i + 1]]``,
            the keys of the blocks it stores, of which the first ``lookups[i]`` are looked up.
        lookups: Full blocks of each prompt but its last token.
        keys: Every stored block's key as a small int (equal ints, equal 64-bit keys).
    """

    tokens_per_block: int
    request_ids: _I64
    prompt_lengths: _I64
    output_lengths: _I64
    starts: _I64
    lookups: _I64
    keys: _I64

    @property
    def requests(self) -> int:
        """Requests in the trace."""
        return len(self.request_ids)

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all requests."""
        return int(self.prompt_lengths.sum())


def _arrays(trace: Iterable[TraceRequest] | TraceFile) -> Iterable[TokenArrays]:
    if isinstance(trace, TraceFile):
        return trace.token_arrays()
    if isinstance(trace, Sequence):
        trace = sorted(trace, key=lambda t: (t.arrival, t.request_id))
    return (
        TokenArrays(
            t.request_id,
            t.arrival,
            np.asarray(t.prompt, dtype=np.int32),
            np.asarray(t.output, dtype=np.int32),
            t.lora_task_id,
            t.cache_salt,
        )
        for t in trace
    )


def key_trace(trace: Iterable[TraceRequest] | TraceFile, tokens_per_block: int) -> KeyTrace:
    """Hashes every request of ``trace`` into its block keys, one request at a time.

    Args:
        trace: A list (taken in replay order: arrival, then id), a :class:`TraceFile`
            (streamed in file order, arrays without Python tuples) or any iterable of
            requests in replay order.
        tokens_per_block: Block size (the run's).

    Raises:
        ValueError: ``tokens_per_block`` < 1, or what reading the trace raises.
    """
    if tokens_per_block < 1:
        raise ValueError(f"tokens_per_block must be >= 1, got {tokens_per_block}")
    b = tokens_per_block
    ids: list[int] = []
    prompts: list[int] = []
    outputs: list[int] = []
    lookups: list[int] = []
    chunks: list[npt.NDArray[np.uint64]] = []
    for t in _arrays(trace):
        n_in, n_out = len(t.prompt), len(t.output)
        held = max(n_in - 1, n_in + n_out - 2)
        tokens = t.prompt if n_in >= held else np.concatenate((t.prompt, t.output))
        keys = block_hashes(tokens[:held], b, lora_task_id=t.lora_task_id, cache_salt=t.cache_salt)
        chunks.append(np.array(keys, dtype=np.uint64))
        ids.append(t.request_id)
        prompts.append(n_in)
        outputs.append(n_out)
        lookups.append((n_in - 1) // b)
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    starts = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(sizes, out=starts[1:])
    flat = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint64)
    _, inverse = np.unique(flat, return_inverse=True)
    return KeyTrace(
        b,
        np.array(ids, dtype=np.int64),
        np.array(prompts, dtype=np.int64),
        np.array(outputs, dtype=np.int64),
        starts,
        np.array(lookups, dtype=np.int64),
        inverse.astype(np.int64).ravel(),
    )


def _owner(kt: KeyTrace) -> _I64:
    """The request index of every key position."""
    return np.repeat(np.arange(kt.requests, dtype=np.int64), np.diff(kt.starts))


def _lookup_mask(kt: KeyTrace) -> npt.NDArray[np.bool_]:
    """True at the key positions a request looks up (the first ``lookups`` of each)."""
    offset = np.arange(len(kt.keys), dtype=np.int64) - np.repeat(kt.starts[:-1], np.diff(kt.starts))
    return np.asarray(offset < np.repeat(kt.lookups, np.diff(kt.starts)))


def _prefix_runs(kt: KeyTrace, ok: npt.NDArray[np.bool_]) -> _I64:
    """Per request: how many of its looked-up blocks, from the first, are ``ok``."""
    bad = np.flatnonzero(~ok)
    first = kt.starts[:-1]
    if bad.size == 0:
        return kt.lookups.copy()
    i = np.searchsorted(bad, first)
    nxt = np.where(i < bad.size, bad[np.minimum(i, bad.size - 1)], np.iinfo(np.int64).max)
    return np.asarray(np.minimum(nxt - first, kt.lookups), dtype=np.int64)


def ideal_hits(kt: KeyTrace) -> _I64:
    """Hit blocks per request with an unbounded cache (any earlier request stored the key)."""
    owner = _owner(kt)
    first_owner = np.full(int(kt.keys.max(initial=-1)) + 1, kt.requests, dtype=np.int64)
    np.minimum.at(first_owner, kt.keys, owner)
    return _prefix_runs(kt, first_owner[kt.keys] < owner)


def _cached_run(keys: list[int], start: int, lookups: int, cache: Container[int]) -> int:
    """How many of a request's first ``lookups`` keys (from ``start``) are cached, in a row:
    its hit blocks under any cache (the scan LRU and Belady share)."""
    h = 0
    while h < lookups and keys[start + h] in cache:
        h += 1
    return h


def lru_hits(kt: KeyTrace, capacity: int) -> _I64:
    """Hit blocks per request with a plain LRU cache of ``capacity`` blocks (see the module
    docstring for the order blocks are touched in)."""
    hits = np.zeros(kt.requests, dtype=np.int64)
    if capacity < 1:
        return hits
    keys = kt.keys.tolist()
    starts = kt.starts.tolist()
    lookups = kt.lookups.tolist()
    cache: OrderedDict[int, None] = OrderedDict()
    touch = cache.move_to_end
    for i in range(kt.requests):
        a, b, n = starts[i], starts[i + 1], lookups[i]
        hits[i] = _cached_run(keys, a, n, cache)
        for p in range(b - 1, a - 1, -1):
            k = keys[p]
            if k in cache:
                touch(k)
            else:
                cache[k] = None
        while len(cache) > capacity:
            cache.popitem(last=False)
    return hits


def _next_lookup(kt: KeyTrace) -> _I64:
    """For every key position, the next position that looks the same key up (``len(keys)``:
    never)."""
    n = len(kt.keys)
    order = np.argsort(kt.keys, kind="stable")  # grouped by key, positions ascending
    group = kt.keys[order]
    val = np.where(_lookup_mask(kt)[order], order, n)
    # Offsets keep each key's group apart: a later group's values are all larger.
    w = val + group * (n + 1)
    suffix_min = np.minimum.accumulate(w[::-1])[::-1]
    nxt = np.full(n, n, dtype=np.int64)
    if n > 1:
        same = group[1:] == group[:-1]
        nxt[:-1] = np.where(same, suffix_min[1:] - group[:-1] * (n + 1), n)
    out = np.empty(n, dtype=np.int64)
    out[order] = np.minimum(nxt, n)
    return out


def belady_hits(kt: KeyTrace, capacity: int) -> _I64:
    """Hit blocks per request with ``capacity`` blocks evicted farthest-next-use first (see
    the module docstring)."""
    hits = np.zeros(kt.requests, dtype=np.int64)
    if capacity < 1:
        return hits
    never = len(kt.keys)
    nxt = _next_lookup(kt).tolist()
    keys = kt.keys.tolist()
    starts = kt.starts.tolist()
    lookups = kt.lookups.tolist()
    cache: dict[int, int] = {}  # key -> its next lookup
    heap: list[tuple[int, int]] = []  # (-next lookup, key); stale entries skipped
    for i in range(kt.requests):
        a, b, n = starts[i], starts[i + 1], lookups[i]
        hits[i] = _cached_run(keys, a, n, cache)
        for p in range(a, b):
            k, nu = keys[p], nxt[p]
            if k in cache:
                if nu == never:
                    del cache[k]
                else:
                    cache[k] = nu
                    heapq.heappush(heap, (-nu, k))
                continue
            if nu == never:
                continue
            if len(cache) >= capacity:
                while cache.get(heap[0][1]) != -heap[0][0]:
                    heapq.heappop(heap)
                far, victim = heap[0]
                if -far <= nu:
                    continue  # everything cached is needed sooner: do not cache this one
                heapq.heappop(heap)
                del cache[victim]
            cache[k] = nu
            heapq.heappush(heap, (-nu, k))
        if len(heap) > 4 * len(cache) + 1024:  # drop the stale entries
            heap = [(-v, k) for k, v in cache.items()]
            heapq.heapify(heap)
    return hits


@dataclass
class RunRecord:
    """What a run recorded for :func:`analyze_run` (``simulate(..., hit_bounds=True)``).

    Attributes:
        admit_step: Request id -> the engine step of its first registration.
        first_reuse: Request id -> prompt tokens the manager reused then.
        progress: Request id -> ``(step, position)`` after each of its prefill chunks: from
            engine step ``step`` on, the prompt's blocks before ``position`` are stored.
        finish_step: Request id -> the step from which all its blocks are stored.
        lost_sliding_tokens: The manager's ``lost_hit_tokens_sliding_window`` counted at first
            admissions (steps that also re-admitted a paused request are left out).
        lost_checkpoint_tokens: The same for ``lost_hit_tokens_no_checkpoint``.
        recomputed_tokens: Tokens computed again after pauses (preemption): all context
            tokens computed, less each admitted prompt's tokens after its first reuse.
    """

    admit_step: dict[int, int] = field(default_factory=dict)
    first_reuse: dict[int, int] = field(default_factory=dict)
    progress: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    finish_step: dict[int, int] = field(default_factory=dict)
    lost_sliding_tokens: int = 0
    lost_checkpoint_tokens: int = 0
    recomputed_tokens: int = 0


@dataclass
class HitBounds:
    """A run's prompt-token hit rate beside what the trace allows, and where the rest went.

    Token counts are over all ``prompt_tokens`` of the trace; rates divide by it.
    ``achieved_tokens`` is the manager's reuse at each request's first admission in whole
    blocks (``partial_tokens``: partly matched blocks on top, outside the block bounds).
    ``lost_tokens`` splits ``ideal_tokens - achieved_tokens`` exactly:

    * ``"not yet stored"``: ideal hits on blocks no request had stored when the request was
      admitted (another request was still prefilling them: concurrency, not memory);
    * ``"sliding window"``: blocks a sliding window had released or lost (the manager's
      ``lost_hit_tokens_sliding_window`` at first admissions);
    * ``"no checkpoint"``: recurrent state without a checkpoint at the hit (the manager's
      ``lost_hit_tokens_no_checkpoint``);
    * ``"rejected"``: ideal hits of requests the scheduler rejected;
    * ``"capacity"``: the rest: blocks that had been stored but were evicted for room (from
      every tier) before the request came.

    ``never_seen_tokens`` (``prompt_tokens - ideal_tokens``) no cache could serve: first
    uses and the last token of every prompt. ``recomputed_tokens`` counts preemption's cost,
    tokens computed again after pauses: a paused request's blocks go back to the cache, so
    preemption costs compute rather than first-admission hits, and it is not part of the
    split. ``capacity_blocks`` is the LRU's and Belady's size: the pool (primary, host and
    disk blocks) of the largest window, ``capacity_window``; sliding windows and recurrent
    state are not modelled there. ``verdict`` says in one line whether more memory can help.
    """

    tokens_per_block: int
    capacity_window: int
    capacity_blocks: int
    prompt_tokens: int
    achieved_tokens: int
    partial_tokens: int
    ideal_tokens: int
    lru_tokens: int
    belady_tokens: int | None
    never_seen_tokens: int
    recomputed_tokens: int
    lost_tokens: dict[str, int]
    achieved_hit_rate: float
    ideal_hit_rate: float
    lru_hit_rate: float
    belady_hit_rate: float | None
    verdict: str


def _visible_steps(kt: KeyTrace, record: RunRecord) -> _I64:
    """For every key position, the first engine step at which the run had stored it."""
    b = kt.tokens_per_block
    never = np.iinfo(np.int64).max
    out = np.full(len(kt.keys), never, dtype=np.int64)
    for i, rid in enumerate(kt.request_ids.tolist()):
        a, z = int(kt.starts[i]), int(kt.starts[i + 1])
        if z == a:
            continue
        vis = out[a:z]
        prog = record.progress.get(rid)
        if prog:
            steps = np.array([s for s, _ in prog], dtype=np.int64)
            held = np.maximum.accumulate(
                np.minimum(np.array([p for _, p in prog], dtype=np.int64), kt.prompt_lengths[i] - 1)
            )
            ends = (np.arange(z - a, dtype=np.int64) + 1) * b
            j = np.searchsorted(held, ends)
            vis[j < len(steps)] = steps[j[j < len(steps)]]
        fin = record.finish_step.get(rid)
        if fin is not None:
            np.minimum(vis, fin, out=vis)
    return out


def _pct(x: float) -> str:
    return f"{x:.1%}"


def _verdict(h: HitBounds) -> str:
    gap = h.ideal_hit_rate - h.achieved_hit_rate
    causes = {k: v for k, v in h.lost_tokens.items() if v > 0}
    top = max(causes, key=lambda k: causes[k]) if causes else None
    if gap <= NEAR_IDEAL:
        return (
            f"more memory cannot help: the run is within {100 * gap:.1f} pp of the trace's "
            f"ideal; the {_pct(1 - h.ideal_hit_rate)} it misses was never seen before"
        )
    if h.lru_hit_rate >= h.ideal_hit_rate - NEAR_IDEAL:
        return (
            "more memory cannot help much: a plain LRU cache of this capacity reaches the "
            f"ideal (within 1 pp); the run's {100 * gap:.1f} pp gap is mostly {top}"
        )
    tail = (
        f"; the largest loss is {top} ({100 * causes[top] / h.prompt_tokens:.1f} pp)" if top else ""
    )
    return (
        f"{100 * gap:.1f} pp more is possible: an unbounded cache reaches "
        f"{_pct(h.ideal_hit_rate)}, an LRU cache of this capacity {_pct(h.lru_hit_rate)}{tail}"
    )


def analyze_run(
    kt: KeyTrace,
    record: RunRecord,
    *,
    capacity_blocks: int,
    capacity_window: int,
    belady: bool = True,
) -> HitBounds:
    """Sets a run beside its trace's bounds (see :class:`HitBounds` for every field).

    Args:
        kt: The trace's keys at the run's ``tokens_per_block``.
        record: What the run recorded.
        capacity_blocks: The LRU's and Belady's capacity.
        capacity_window: The window whose pool that is (reported).
        belady: Compute the Belady bound (one more pass; ``belady_tokens`` is ``None``
            without it).
    """
    b = kt.tokens_per_block
    ideal = ideal_hits(kt)
    lru = lru_hits(kt, capacity_blocks)
    bel = belady_hits(kt, capacity_blocks) if belady else None
    prompt = kt.prompt_tokens
    ids = kt.request_ids.tolist()
    admitted = np.array([rid in record.admit_step for rid in ids], dtype=bool)
    reuse = np.array([record.first_reuse.get(rid, 0) for rid in ids], dtype=np.int64)
    achieved = int((reuse // b).sum()) * b
    partial = int((reuse % b).sum())

    vis = _visible_steps(kt, record)
    min_vis = np.full(int(kt.keys.max(initial=-1)) + 1, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(min_vis, kt.keys, vis)
    admit = np.array([record.admit_step.get(rid, -1) for rid in ids], dtype=np.int64)
    stored = _prefix_runs(kt, min_vis[kt.keys] <= admit[_owner(kt)])
    not_yet = int((ideal - np.minimum(ideal, stored))[admitted].sum()) * b
    rejected = int(ideal[~admitted].sum()) * b
    ideal_tokens = int(ideal.sum()) * b
    lost = {
        "not yet stored": not_yet,
        "sliding window": record.lost_sliding_tokens,
        "no checkpoint": record.lost_checkpoint_tokens,
        "rejected": rejected,
    }
    lost["capacity"] = ideal_tokens - achieved - sum(lost.values())

    def rate(tokens: int) -> float:
        return tokens / prompt if prompt else 0.0

    out = HitBounds(
        tokens_per_block=b,
        capacity_window=capacity_window,
        capacity_blocks=capacity_blocks,
        prompt_tokens=prompt,
        achieved_tokens=achieved,
        partial_tokens=partial,
        ideal_tokens=ideal_tokens,
        lru_tokens=int(lru.sum()) * b,
        belady_tokens=None if bel is None else int(bel.sum()) * b,
        never_seen_tokens=prompt - ideal_tokens,
        recomputed_tokens=record.recomputed_tokens,
        lost_tokens=lost,
        achieved_hit_rate=rate(achieved),
        ideal_hit_rate=rate(ideal_tokens),
        lru_hit_rate=rate(int(lru.sum()) * b),
        belady_hit_rate=None if bel is None else rate(int(bel.sum()) * b),
        verdict="",
    )
    out.verdict = _verdict(out)
    return out
