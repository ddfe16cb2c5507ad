"""Capacity scheduling: which requests run in the next engine step, window by window.

Each step has a token budget, ``max_num_batched_tokens`` (8,192 by default, as vLLM's), split
first come, first served: running generation requests first (one token each plus their
draft tokens), then running requests whose prompt is still being prefilled, then new (or
resumed) requests, each prefill chunk taking what is left of the budget, at most
``max_chunk_size`` tokens. With ``chunked_prefill=False`` prompts are prefilled whole: a new
request is admitted only if its whole prompt fits what is left of the budget (or runs alone
in an otherwise empty step).

Two block policies, as in TensorRT-LLM's capacity scheduler:

* ``"guaranteed_no_evict"``: a request is admitted only if every window can hold everything
  it will still need until it finishes, on top of what the running requests will still
  need (:meth:`KVCacheResourceManager.get_remaining_blocks_to_completion`, which credits
  sliding-window releases; with chunked prefill it is the worst case over chunks of at most
  the largest chunk this scheduler schedules, so a sliding window is charged at most
  ``ceil((window + chunk) / tokens_per_block) + 1`` blocks whatever the prompt length).
  Running requests never run out of blocks and are never paused.
* ``"max_utilization"``: a request is admitted if every window can hold its next step (its
  first chunk). When the running requests' next step (their tokens and chunks) does not fit
  some window, the newest running requests are paused (their blocks freed) until it does;
  they resume later, in arrival order, with their prompt and generated tokens registered
  again, so nothing is lost.

Both admit in the order given (no overtaking), respect the manager's ``max_batch_size``, and
reject requests that could never fit (longer than ``max_seq_len`` or than a window's whole
pool). A running request whose step does not fit what is left of the token budget skips the
step (it keeps its blocks). The budget is never exceeded, except by a whole prompt longer
than the budget, which runs alone (``chunked_prefill=False`` only).

With block reuse on, a new request's first chunk counts the tokens after its cached prefix,
and admission counts reusable blocks: the first request admitted in a step is charged
exactly what registering its first chunk takes now (cached prefix blocks that running
requests hold cost nothing). Later admissions of the same step are charged one block per
position their chunk may cover, because the blocks the earlier ones allocate may evict
cached blocks the later ones hoped to reuse. ``guaranteed_no_evict`` also keeps in reserve
the extra holdings of sliding window blocks that several running requests share
(:meth:`KVCacheResourceManager.get_num_shared_blocks`): only the last holder's release frees
such a block.

Beam families (:mod:`kvcache.families`): the requests sharing a :attr:`Request.family_id`
(the beams or samples ``fork_resources`` made) decode all in one step or not at all, and
only once every member is back after a pause; ``max_utilization`` pauses whole families;
``guaranteed_no_evict`` charges a family's shared blocks once; a request's beams still to fork
are charged at admission (blocks and batch slots) and in the never-fits check.

Example:
    >>> from kvcache import KvCacheConfig, ModelConfig
    >>> from kvcache.resource_manager import KVCacheResourceManager, Request
    >>> model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    >>> config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None],
    ...                        backend="virtual")
    >>> rm = KVCacheResourceManager.from_blocks(model, config, {8: 8, 64: 8},
    ...                                         max_seq_len=64, max_batch_size=8)
    >>> reqs = [Request(i, prompt=[1] * 10, max_new_tokens=10) for i in range(3)]
    >>> out = CapacityScheduler(rm, "guaranteed_no_evict").schedule(reqs)
    >>> [r.request_id for r in out.batch.context_requests]   # 5 full-window blocks each
    [0]
    >>> out = CapacityScheduler(rm, "max_utilization").schedule(reqs)
    >>> [r.request_id for r in out.batch.context_requests]   # 3 blocks each now
    [0, 1]
    >>> out = CapacityScheduler(rm, "max_utilization", max_num_batched_tokens=16).schedule(reqs)
    >>> [(r.request_id, out.batch.chunk_size(r)) for r in out.batch.context_requests]
    [(0, 10), (1, 6)]
"""

from __future__ import annotations

import itertools
import operator
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from kvcache import _core
from kvcache.cache.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from kvcache.cache.fields import is_int
from kvcache.serving.families import family_arrays, unforked_beams, waiting_families
from kvcache.serving.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
)

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "POLICIES", "CapacityScheduler", "SchedulerOutput"]

#: Scheduling policies.
POLICIES: tuple[str, ...] = ("guaranteed_no_evict", "max_utilization")
_RUNNING = (RequestState.CONTEXT, RequestState.GENERATION)
_request_id = operator.attrgetter("request_id")
_state = operator.attrgetter("state")
_EMPTY: list[Any] = []  # never changed: the empty candidate lists of a full batch
#: The list form's head of registered requests: (the resource manager's epoch, the requests,
#: their ids, their prompt lengths less one).
_HeadCache = tuple[int, list[Request], list[int], list[int]]
_WAITING = (RequestState.WAITING, RequestState.PAUSED)


class SchedulerOutput:
    """The decisions of one :meth:`CapacityScheduler.schedule` call.

    Attributes:
        batch: Requests to run in the next step (context requests with their chunk sizes,
            generation requests with their draft-token counts).
        paused: Running requests that were paused and freed (``max_utilization``, or a beam
            family stuck waiting for siblings that do not fit), newest first.
        rejected: Requests that can never fit; their state is ``FAILED``.
        waiting: Requests left waiting (built when first read: read it before the next
            ``schedule`` call).
    """

    def __init__(
        self,
        batch: ScheduledBatch | None = None,
        paused: list[Request] | None = None,
        rejected: list[Request] | None = None,
        waiting: list[Request] | None = None,
    ) -> None:
        self.batch = batch if batch is not None else ScheduledBatch()
        self.paused: list[Request] = paused if paused is not None else []
        self.rejected: list[Request] = rejected if rejected is not None else []
        self._waiting = waiting
        self._waiting_source: Iterable[Request] = ()
        self._taken: set[int] = set()  # requests of the queue admitted or rejected

    @property
    def waiting(self) -> list[Request]:
        """Requests left waiting, in order."""
        if self._waiting is None:
            taken = self._taken
            self._waiting = [
                r for r in self._waiting_source if r.request_id not in taken and r.state in _WAITING
            ]
        return self._waiting


def _positive(name: str, value: int | None) -> None:
    if value is not None and (not is_int(value) or value < 1):
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")


class CapacityScheduler:
    """Chooses the requests of each engine step so that every window has the blocks.

    Args:
        resource_manager: Supplies the per-window estimates and frees paused requests.
        policy: ``"guaranteed_no_evict"`` or ``"max_utilization"``.
        max_batch_size: Most requests registered at once (default and upper bound: the
            manager's).
        max_num_batched_tokens: Tokens per step: generation tokens (one per request plus
            drafts) and prefill chunks (``None``: unlimited). Must exceed the manager's
            ``max_draft_tokens``, so that any generation step fits an empty step.
        chunked_prefill: Prefill prompts in chunks that fill the token budget (default);
            ``False`` prefills every prompt whole in one step.
        max_chunk_size: Most tokens of one prefill chunk (a long-prefill threshold;
            ``None``: the budget). Only with ``chunked_prefill``.

    Raises:
        TypeError: ``resource_manager`` is not a :class:`KVCacheResourceManager`.
        ValueError: Unknown policy or bad limits.
    """

    def __init__(
        self,
        resource_manager: KVCacheResourceManager,
        policy: str = "guaranteed_no_evict",
        *,
        max_batch_size: int | None = None,
        max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        chunked_prefill: bool = True,
        max_chunk_size: int | None = None,
    ) -> None:
        if not isinstance(resource_manager, KVCacheResourceManager):
            raise TypeError(
                "resource_manager must be a kvcache.KVCacheResourceManager, got "
                f"{type(resource_manager).__name__}"
            )
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        limit = resource_manager.max_batch_size
        if max_batch_size is not None and not 0 < max_batch_size <= limit:
            raise ValueError(f"max_batch_size must be in 1..{limit}, got {max_batch_size!r}")
        _positive("max_num_batched_tokens", max_num_batched_tokens)
        _positive("max_chunk_size", max_chunk_size)
        drafts = resource_manager.max_draft_tokens
        if max_num_batched_tokens is not None and max_num_batched_tokens <= drafts:
            raise ValueError(
                f"max_num_batched_tokens ({max_num_batched_tokens}) must exceed the manager's "
                f"max_draft_tokens ({drafts}): a generation step takes 1 + drafts tokens"
            )
        if max_chunk_size is not None and not chunked_prefill:
            raise ValueError("max_chunk_size needs chunked_prefill")
        self._rm = resource_manager
        self._policy = policy
        self._max_batch = max_batch_size if max_batch_size is not None else limit
        self._max_tokens = max_num_batched_tokens
        self._chunked = bool(chunked_prefill)
        caps = [c for c in (max_chunk_size, max_num_batched_tokens) if c is not None]
        self._chunk: int | None = min(caps) if chunked_prefill and caps else None
        self._native = _core.CapacityScheduler(
            resource_manager.manager,
            policy,
            self._max_batch,
            max_num_batched_tokens,
            self._chunked,
            self._chunk,
        )
        self._guaranteed = policy == "guaranteed_no_evict"
        self._families = False  # a request with beams or a family was seen: pass families
        self._fits_checked: dict[int, int] = {}  # request id -> context length checked
        # The index form (add_request, then schedule()): requests in arrival order.
        self._rank: dict[int, int] = {}  # request id -> arrival rank
        self._queue: deque[Request] = deque()  # waiting and paused requests, by rank
        self._running: list[Request] = []  # registered requests, by rank
        self._head_cache: _HeadCache | None = None  # see _cache_head
        # The index form's running requests as of the resource manager's epoch: (the epoch,
        # their ids, their prompt lengths less one); see _indexed.
        self._index_cache: tuple[int, list[int], list[int]] | None = None
        # The generation entries of an all-decode step of cached running requests (keyed by
        # their cached ids).
        self._pairs: tuple[list[int], list[tuple[Request, int]]] | None = None

    @property
    def policy(self) -> str:
        """The scheduling policy."""
        return self._policy

    @property
    def max_num_batched_tokens(self) -> int | None:
        """Tokens per step (``None``: unlimited)."""
        return self._max_tokens

    @property
    def chunked_prefill(self) -> bool:
        """True if prompts are prefilled in chunks."""
        return self._chunked

    @property
    def max_chunk_size(self) -> int | None:
        """The largest prefill chunk this scheduler schedules: ``max_chunk_size`` or the
        budget, whichever is smaller (``None``: whole prompts)."""
        return self._chunk

    def blocks_to_run_alone(self, request: Request) -> dict[int, int]:
        """Per window, the most blocks the request holds from an otherwise empty pool, its
        prompt prefilled in this scheduler's chunks, nothing reused: its own sequence plus,
        before its first fork, the ``num_beams - 1`` (or ``n - 1``) beams it forks after its
        prompt (each charged ``KVCacheManager.get_forked_beam_blocks``)."""
        alone = self._native.blocks_to_run_alone(
            request.context_len, request.max_kv_tokens, unforked_beams(request)
        )
        return dict(zip(self._rm.window_sizes, (int(n) for n in alone), strict=True))

    def never_fits(self, request: Request) -> bool:
        """Whether the request can never run: longer than ``max_seq_len``, or
        :meth:`blocks_to_run_alone` beyond some window's whole pool."""
        return bool(
            self._native.never_fits(
                request.context_len, request.max_kv_tokens, unforked_beams(request)
            )
        )

    def add_request(self, request: Request) -> None:
        """Queues a new request for the index form of :meth:`schedule` (``schedule()`` with no
        argument), after every request added before it.

        Raises:
            ValueError: The request was added before, or is not waiting.
        """
        rid = request.request_id
        if rid in self._rank:
            raise ValueError(f"request {rid} was already added")
        if request.state is not RequestState.WAITING:
            raise ValueError(f"request {rid} is {request.state.value}, not waiting")
        self._rank[rid] = len(self._rank)
        self._queue.append(request)

    def schedule(self, requests: Sequence[Request] | None = None) -> SchedulerOutput:
        """Schedules the next step.

        Two forms. ``schedule(requests)``: the active requests in priority (arrival) order,
        running ones (context or generation state, holding blocks) and waiting or paused ones;
        finished and failed requests are ignored. ``schedule()``: the requests given to
        :meth:`add_request` that are not finished or failed; its work is proportional to the
        running requests and those it admits, whatever the length of the queue.

        The decisions are the native scheduler's (``kvcache._core.CapacityScheduler``): a
        waiting request is checked against the pools (longer than ``max_seq_len``, or beyond a
        window's whole pool: rejected) when it reaches the head of the queue.

        Returns:
            The batch, and the paused, rejected and still-waiting requests.
        """
        if requests is None:
            indexed, index_ids, index_bases = self._indexed()
            candidates, rejected, scanned = self._head_candidates(len(indexed))
            out = self._decide(indexed, index_ids, index_bases, candidates, rejected, self._queue)
            self._reindex(out, scanned)
            return out
        running, ids, candidates, rejected = self._scan(requests)
        cache = self._head_cache
        bases = cache[3] if cache is not None and ids is cache[2] else None
        return self._decide(running, ids, bases, candidates, rejected, requests)

    # ------------------------------------------------------------------ internals

    def _scan(
        self, requests: Sequence[Request]
    ) -> tuple[list[Request], list[int] | None, list[Request], list[Request]]:
        """The list form's running requests (registered, in the list's order), their ids when
        read on the way (else ``None``), admission candidates (the first waiting requests
        that can fit, as many as the batch has room for), and the waiting requests before
        them that never fit (now ``FAILED``). Stops as soon as every registered request was
        seen and the candidates are complete, so the waiting requests behind them cost
        nothing."""
        registered = self._rm._running
        unseen = len(registered)
        most = self._max_batch
        running: list[Request] = []
        candidates: list[Request] = []
        rejected: list[Request] = []
        ids: list[int] | None = None
        start = 0
        head = requests[:unseen]
        if type(head) is not list:
            head = list(head)
        cache = self._head_cache
        if cache is None or cache[0] != self._rm._epoch or head != cache[1]:
            # Not the registered requests of the last call (compared by identity, in C).
            cache = self._cache_head(head, unseen)
        if cache is not None:
            # The usual order: the registered requests first.
            states = list(map(_state, head))
            gen, ctx = RequestState.GENERATION, RequestState.CONTEXT
            num_gen = states.count(gen)  # (count compares by identity first: fast on a match)
            if num_gen == unseen or num_gen + states.count(ctx) == unseen:
                running, ids = head, cache[2]  # all of them run: their ids are cached
            else:
                running = [r for r, st in zip(head, states, strict=True) if st is gen or st is ctx]
            start, unseen = unseen, 0
        for r in itertools.islice(requests, start, None):
            if r.request_id in registered:
                if r.state in _RUNNING:
                    running.append(r)
                unseen -= 1
            elif len(candidates) < most - len(running) and self._admissible(r, rejected):
                candidates.append(r)
            if unseen == 0 and len(candidates) >= most - len(running):
                break
        if len(running) != len(head):
            ids = None  # running requests came after the head: read their ids again
        return running, ids, candidates[: max(0, most - len(running))], rejected

    def _cache_head(self, head: list[Request], num_registered: int) -> _HeadCache | None:
        """Caches the list form's head if it holds exactly the registered requests: their
        ids and prompt lengths less one (the resource manager's), valid while the
        registrations and the head's requests stay the same (a request's id does not
        change)."""
        self._head_cache = None
        rm = self._rm
        if len(head) != num_registered:
            return None
        if head == list(rm._running.values()):  # registration order: the usual case (by identity)
            ids = list(rm._running)
            bases = list(rm._base_of.values())  # kept in the same order
        else:
            ids = list(map(_request_id, head))
            if not all(map(rm._running.__contains__, ids)):
                return None
            bases = list(map(rm._base_of.__getitem__, ids))
        self._head_cache = (rm._epoch, head, ids, bases)
        return self._head_cache

    def _head_candidates(self, num_running: int) -> tuple[list[Request], list[Request], int]:
        """The index form's admission candidates: the queue's first waiting requests, as many
        as the batch has room for, with the ones before them that never fit (now ``FAILED``),
        and how many queue entries were looked at."""
        room = self._max_batch - num_running
        candidates: list[Request] = []
        rejected: list[Request] = []
        scanned = 0
        for r in self._queue:
            if len(candidates) >= room:
                break
            scanned += 1
            if self._admissible(r, rejected):
                candidates.append(r)
        return candidates, rejected, scanned

    def _admissible(self, r: Request, rejected: list[Request]) -> bool:
        """Whether a queued request can be an admission candidate: it still waits (not failed,
        nor run by a caller) and can ever fit; one that never fits is marked ``FAILED`` and
        appended to ``rejected``."""
        if r.state not in _WAITING:
            return False
        if self._never_fits(r):
            r.state = RequestState.FAILED
            rejected.append(r)
            return False
        return True

    def _decide(
        self,
        running: list[Request],
        ids: list[int] | None,
        bases: list[int] | None,
        candidates: list[Request],
        rejected: list[Request],
        source: Iterable[Request],
    ) -> SchedulerOutput:
        """Asks the native scheduler about the running requests (``ids``: their request ids,
        ``bases``: their prompt lengths less one, if known, both cached while the running
        requests stay the same) and the admission candidates (in order); ``rejected`` never
        fit; ``source`` is what the lazily built ``waiting`` output comes from."""
        rm = self._rm
        out = SchedulerOutput()
        out._waiting_source = source
        out.rejected.extend(rejected)
        drafts = [rm.num_draft_tokens_for(r) for r in running] if rm.max_draft_tokens else None
        if ids is None:
            ids = [r.request_id for r in running]
        if candidates:
            cand_ids = [r.request_id for r in candidates]
            contexts = [rm._prompt(r) for r in candidates]
            finals = [r.max_kv_tokens for r in candidates]
        else:  # the usual full batch: nothing to convert
            cand_ids = contexts = finals = _EMPTY
        if not self._families and rm._forked:
            self._families = True
        fams = family_arrays(running, candidates) if self._families else None
        if fams is None:
            gen, ndraft, chunked, sizes, admitted, first, paused, failed = self._native.schedule(
                ids, None, drafts, cand_ids, contexts, finals
            )
        else:
            gen, ndraft, chunked, sizes, admitted, first, paused, failed = self._native.schedule(
                ids,
                fams[2],
                drafts,
                cand_ids,
                contexts,
                finals,
                families=fams[0],
                beams=fams[1],
                candidate_families=fams[3],
                candidate_beams=fams[4],
                waiting_families=waiting_families(source),
            )
        taken = out._taken
        for i in paused:
            r = running[i]
            self._pause(r)
            out.paused.append(r)
            taken.add(r.request_id)
        batch = out.batch
        gen_bases: list[int] | None = None
        most = 0
        snapshot: list[tuple[Request, int]] | None = None  # of batch.generation, for the note
        if gen is None:  # every running request decodes, in order, without drafts
            # Cached running requests: the entries of their last such step.
            if bases is not None:
                if self._pairs is None or self._pairs[0] is not ids:
                    self._pairs = (ids, [(r, 0) for r in running])
                snapshot = self._pairs[1]  # never changed: each batch gets a copy
                batch.generation = snapshot.copy()
            else:
                batch.generation = [(r, 0) for r in running]
            gen_ids, gen_reqs, gen_bases = ids, running, bases
        elif len(gen) == len(running):  # every running request decodes (indices 0..n-1)
            batch.generation = list(zip(running, ndraft, strict=True))
            gen_ids, gen_reqs, gen_bases = ids, running, bases
            most = max(ndraft, default=0)
        else:
            batch.generation = [(running[i], d) for i, d in zip(gen, ndraft, strict=True)]
            gen_ids = [ids[i] for i in gen]
            gen_reqs = [r for r, _ in batch.generation]
            if bases is not None:
                gen_bases = list(map(bases.__getitem__, gen))
            most = max(ndraft, default=0)
        rm._note_generation(batch.generation, gen_ids, most, gen_reqs, gen_bases, snapshot)
        if chunked:
            batch.context = [(running[i], k) for i, k in zip(chunked, sizes, strict=True)]
        for j, k in zip(admitted, first, strict=True):
            r = candidates[j]
            batch.context.append((r, k))
            taken.add(r.request_id)
            self._fits_checked.pop(r.request_id, None)
        for j in failed:
            r = candidates[j]
            r.state = RequestState.FAILED
            out.rejected.append(r)
            self._fits_checked.pop(r.request_id, None)
        for r in out.rejected:
            taken.add(r.request_id)
        return out

    def _never_fits(self, r: Request) -> bool:
        """Longer than max_seq_len, or a window's peak beyond its whole pool. A resumed
        request registers its generated tokens too, so it is checked again after a pause."""
        n = r.context_len
        if self._fits_checked.get(r.request_id) == n:
            return False
        beams = unforked_beams(r)
        if beams or r.family_id is not None:
            self._families = True
        if self._native.never_fits(n, r.max_kv_tokens, beams):
            self._fits_checked.pop(r.request_id, None)
            return True
        self._fits_checked[r.request_id] = n
        return False

    def _pause(self, r: Request) -> None:
        """Marks a request the native scheduler paused (its sequence is already removed)."""
        self._rm._forget(r)
        r.state = RequestState.PAUSED
        r.num_pauses += 1
        r.context_position = 0
        r.draft_tokens = []
        r.rewind_len = 0

    def _indexed(self) -> tuple[list[Request], list[int], list[int]]:
        """The index form's running requests, in arrival order (a copy), their ids and prompt
        lengths less one: finished, failed or freed ones leave the index, and the queue's head
        loses the ones that stopped waiting. While no registration changed since the last
        call (and no admission or pause changed the index), only their states are read."""
        rm = self._rm
        queue = self._queue
        run = self._running
        cache = self._index_cache
        if cache is None or cache[0] != rm._epoch:
            # The index is the registrations, in order (compared by identity): the usual case.
            same = run == list(rm._running.values())
            cache = (rm._epoch, list(rm._running), list(rm._base_of.values())) if same else None
        if cache is not None:
            states = list(map(_state, run))
            gen, ctx = RequestState.GENERATION, RequestState.CONTEXT
            num_gen = states.count(gen)
            if num_gen == len(run) or num_gen + states.count(ctx) == len(run):
                while queue and queue[0].state not in _WAITING:  # failed, or run by a caller
                    queue.popleft()
                self._index_cache = cache
                return list(run), cache[1], cache[2]
        registered = rm._running
        kept = [r for r in self._running if r.state in _RUNNING and r.request_id in registered]
        if len(kept) != len(self._running):
            # Admitted but not registered after all (a prepare_resources that failed and rolled
            # back), or freed without finishing: back into the queue if still waiting.
            for r in self._running:
                if r.state in _WAITING and r.request_id not in registered:
                    self._insert(queue, r)
        self._running = kept
        if self._families and len(kept) < len(registered):
            self._adopt_forks(registered)
        while queue and queue[0].state not in _WAITING:  # failed, or run by a caller
            queue.popleft()
        ids = list(map(_request_id, kept))
        bases = list(map(rm._base_of.__getitem__, ids))
        self._index_cache = (rm._epoch, ids, bases)
        return list(kept), ids, bases

    def _adopt_forks(self, registered: dict[int, Request]) -> None:
        """Children that ``fork_resources`` registered join the index at their family's rank
        (the family's first request was added with :meth:`add_request`)."""
        rank = self._rank
        known = {r.request_id for r in self._running}
        for rid, r in registered.items():
            family = r.family_id
            if rid not in known and rid not in rank and family is not None and family in rank:
                rank[rid] = rank[family]
                self._insert(self._running, r)  # after its family, in the order forked

    def _reindex(self, out: SchedulerOutput, scanned: int) -> None:
        """Moves admitted requests from the queue's first ``scanned`` entries to the running
        list (requests that stopped waiting leave the index) and paused ones back into the
        queue, each by arrival rank."""
        taken = out._taken
        queue = self._queue
        kept: list[Request] = []
        changed = bool(out.paused)
        for _ in range(scanned):
            r = queue.popleft()
            if r.request_id in taken:
                if r.state is not RequestState.FAILED:
                    self._insert(self._running, r)
                    changed = True
            elif r.state in _WAITING:
                kept.append(r)
        queue.extendleft(reversed(kept))
        for r in out.paused:
            self._running.remove(r)
        for r in reversed(out.paused):  # paused newest first: a family goes back in its order
            self._insert(queue, r)
        if changed:  # the running list changed: _indexed reads it again
            self._index_cache = None

    def _insert(self, lst: list[Request] | deque[Request], r: Request) -> None:
        """Inserts by arrival rank, after the requests of the same rank (a family's)."""
        rank = self._rank
        key = rank.get(r.request_id, len(rank))
        lo, hi = 0, len(lst)
        while lo < hi:
            mid = (lo + hi) // 2
            if rank.get(lst[mid].request_id, len(rank)) <= key:
                lo = mid + 1
            else:
                hi = mid
        lst.insert(lo, r)
