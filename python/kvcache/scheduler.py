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

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.config import DEFAULT_MAX_NUM_BATCHED_TOKENS
from kvcache.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
)

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "POLICIES", "CapacityScheduler", "SchedulerOutput"]

#: Scheduling policies.
POLICIES: tuple[str, ...] = ("guaranteed_no_evict", "max_utilization")
_RUNNING = (RequestState.CONTEXT, RequestState.GENERATION)
_WAITING = (RequestState.WAITING, RequestState.PAUSED)


@dataclass
class SchedulerOutput:
    """The decisions of one :meth:`CapacityScheduler.schedule` call.

    Attributes:
        batch: Requests to run in the next step (context requests with their chunk sizes,
            generation requests with their draft-token counts).
        paused: Running requests that were paused and freed (``max_utilization`` only).
        rejected: Requests that can never fit; their state is ``FAILED``.
        waiting: Requests left waiting.
    """

    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    paused: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)


def _positive(name: str, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
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
        self._fits_checked: dict[int, int] = {}  # request id -> context length checked

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

    def schedule(self, requests: Sequence[Request]) -> SchedulerOutput:
        """Schedules the next step.

        Args:
            requests: The active requests in priority (arrival) order: running ones
                (context or generation state, holding blocks) and waiting or paused ones.
                Finished and failed requests are ignored.

        Returns:
            The batch, and the paused, rejected and still-waiting requests.
        """
        rm = self._rm
        out = SchedulerOutput()
        running = [r for r in requests if r.state in _RUNNING and rm.has_request(r)]
        waiting = [r for r in requests if r.state in _WAITING]
        plan, left = self._plan_running(running)
        if self._policy == "guaranteed_no_evict":
            committed = self._reserve(running)
        else:
            committed = self._fit_running(running, plan, out)
        out.batch = self._batch(plan)
        self._admit(waiting, running, committed, left, out)
        return out

    # ------------------------------------------------------------------ running requests

    def _plan_running(self, running: list[Request]) -> tuple[list[tuple[Request, int]], int | None]:
        """Tokens of each running request's step, in budget order: generation requests
        first, then continuing prefills; returns them and the budget left."""
        left = self._max_tokens
        plan: list[tuple[Request, int]] = []
        for r in running:
            if r.state is RequestState.GENERATION:
                tokens = 1 + self._rm.num_draft_tokens_for(r)
                if left is None or tokens <= left:
                    plan.append((r, tokens))
                    left = None if left is None else left - tokens
        for r in running:
            if r.state is RequestState.CONTEXT:
                size = self._chunk_for(r.context_len - r.context_position, left)
                if size > 0:
                    plan.append((r, size))
                    left = None if left is None else left - size
        return plan, left

    def _chunk_for(self, rest: int, left: int | None) -> int:
        """Tokens of a prefill chunk with ``rest`` prompt tokens to go and ``left`` in the
        budget (0: none this step)."""
        if not self._chunked:
            return rest
        size = rest if self._chunk is None else min(rest, self._chunk)
        return size if left is None else min(size, left)

    def _reserve(self, running: list[Request]) -> dict[int, int]:
        """``guaranteed_no_evict``: blocks per window committed to the running requests'
        completion (and to the extra holdings of shared blocks); admissions add theirs and
        must keep the total allocatable (:meth:`KVCacheResourceManager.can_allocate`)."""
        rm = self._rm
        rest = rm.get_remaining_blocks_for(running, chunk_size=self._chunk) if running else None
        return {
            w: rm.get_num_shared_blocks(w) + (rest[i] if rest else 0)
            for i, w in enumerate(rm.window_sizes)
        }

    def _fit_running(
        self, running: list[Request], plan: list[tuple[Request, int]], out: SchedulerOutput
    ) -> dict[int, int]:
        """``max_utilization``: pauses the newest running requests until every window holds
        the planned step; returns the blocks per window committed to it and to what the
        prompts being prefilled still need until their last chunk (admissions add theirs)."""
        rm = self._rm
        windows = rm.window_sizes
        while True:
            total = dict(zip(windows, self._plan_needs(plan), strict=True))
            if not running or rm.can_allocate(total):
                break
            victim = running.pop()  # the newest running request
            plan[:] = [(r, t) for r, t in plan if r is not victim]
            self._pause(victim)
            out.paused.append(victim)
        prefilling = [r for r in running if r.state is RequestState.CONTEXT]
        if prefilling:
            decodes = [(r, t) for r, t in plan if r.state is RequestState.GENERATION]
            reserve = self._plan_needs(decodes)
            rest = rm.get_remaining_blocks_for(
                prefilling, chunk_size=self._chunk, prefill_only=True
            )
            total = {w: max(total[w], reserve[i] + rest[i]) for i, w in enumerate(windows)}
        return total

    def _plan_needs(self, plan: list[tuple[Request, int]]) -> list[int]:
        """Blocks per window the planned step takes (see
        :meth:`KVCacheResourceManager.get_needed_blocks_for_step`)."""
        gen = [(r, t - 1) for r, t in plan if r.state is RequestState.GENERATION]
        chunks = [(r, t) for r, t in plan if r.state is RequestState.CONTEXT]
        return self._rm.get_needed_blocks_for_plan(gen, chunks)

    @staticmethod
    def _batch(plan: list[tuple[Request, int]]) -> ScheduledBatch:
        batch = ScheduledBatch()
        for r, tokens in plan:
            if r.state is RequestState.GENERATION:
                batch.add_generation(r, tokens - 1)
            else:
                batch.add_context(r, tokens)
        return batch

    # ------------------------------------------------------------------ admissions

    def _admit(
        self,
        waiting: list[Request],
        running: list[Request],
        committed: dict[int, int],
        left: int | None,
        out: SchedulerOutput,
    ) -> None:
        """Admits waiting requests in order while the token budget, the batch size and
        the windows allow (``committed`` plus the request's blocks stay allocatable); the
        first that does not fit blocks the rest."""
        rm = self._rm
        windows = rm.window_sizes
        guaranteed = self._policy == "guaranteed_no_evict"
        blocked = bool(out.paused)  # no admissions in a step that had to pause
        admitted = 0
        for r in waiting:
            if self._never_fits(r):
                r.state = RequestState.FAILED
                out.rejected.append(r)
                continue
            if blocked or len(running) + admitted >= self._max_batch:
                blocked = True
                out.waiting.append(r)
                continue
            size = self._first_chunk(r, left, empty=len(out.batch) == 0)
            if size == 0:
                blocked = True
                out.waiting.append(r)
                continue
            # Exact reuse only for the first admission of the step (see the module doc).
            if guaranteed:
                need = rm.get_remaining_blocks_per_window(
                    r, chunk_size=self._chunk, use_reuse=not admitted
                )
            else:
                need = rm.get_remaining_blocks_per_window(
                    r, chunk_size=self._chunk, use_reuse=not admitted, prefill_only=True
                )
            wanted = {w: committed[w] + need[w] for w in windows}
            if rm.can_allocate(wanted):
                committed.update(wanted)
                out.batch.add_context(r, size)
                admitted += 1
                left = None if left is None else max(0, left - size)
                self._fits_checked.pop(r.request_id, None)
            elif not running and len(out.batch) == 0:
                # Nothing runs, so nothing will change the pools or the cache: a request
                # that does not fit now never will.
                r.state = RequestState.FAILED
                out.rejected.append(r)
                self._fits_checked.pop(r.request_id, None)
            else:
                blocked = True
                out.waiting.append(r)

    def _first_chunk(self, r: Request, left: int | None, *, empty: bool) -> int:
        """Tokens of a new request's first chunk (after its cached prefix), 0 if the token
        budget leaves none. A whole prompt must fit the budget unless the step is empty."""
        if not self._chunked:
            size = r.context_len
            return size if left is None or size <= left or empty else 0
        if left == 0:
            return 0
        rest = r.context_len - self._rm.get_reusable_prefix_length(r)
        return self._chunk_for(rest, left)

    def _never_fits(self, r: Request) -> bool:
        """Longer than max_seq_len, or a window's peak beyond its whole pool. A resumed
        request registers its generated tokens too, so it is checked again after a pause."""
        if self._fits_checked.get(r.request_id) == r.context_len:
            return False
        rm = self._rm
        alone = rm.get_blocks_to_run_alone(r, chunk_size=self._chunk)
        if r.max_kv_tokens > rm.max_seq_len or not rm.fits_when_empty(alone):
            return True
        self._fits_checked[r.request_id] = r.context_len
        return False

    def _pause(self, r: Request) -> None:
        self._rm.free_resources(r)
        r.state = RequestState.PAUSED
        r.num_pauses += 1
        r.context_position = 0
        r.draft_tokens = []
        r.rewind_len = 0
