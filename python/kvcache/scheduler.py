"""Capacity scheduling: which requests run in the next engine step, window by window.

Two policies, as in TensorRT-LLM's capacity scheduler:

* ``"guaranteed_no_evict"``: a request is admitted only if every window can hold everything
  it will still need until it finishes, on top of what the running requests will still
  need (:meth:`KVCacheResourceManager.get_remaining_blocks_to_completion`, which credits
  sliding-window releases). Running requests never run out of blocks and are never paused.
* ``"max_utilization"``: a request is admitted if every window can hold its next step.
  When the running requests' next step does not fit some window, the newest running
  requests are paused (their blocks freed) until it does; they resume later, in arrival
  order, with their prompt and generated tokens registered again, so nothing is lost.

Both admit in the order given (first come, first served; no overtaking), respect the
manager's ``max_batch_size`` and an optional token budget per step, and reject requests
that could never fit (longer than ``max_seq_len`` or than a window's whole pool).

With block reuse on, admission counts reusable blocks: the first request admitted in a step
is charged exactly what registering its prompt takes now (cached prefix blocks that running
requests hold cost nothing). Later admissions of the same step are charged as without
reuse, because the blocks the earlier ones allocate may evict cached blocks the later ones
hoped to reuse. ``guaranteed_no_evict`` also keeps in reserve the extra holdings of sliding
window blocks that several running requests share
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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
    ScheduledBatch,
)

__all__ = ["POLICIES", "CapacityScheduler", "SchedulerOutput"]

#: Scheduling policies.
POLICIES: tuple[str, ...] = ("guaranteed_no_evict", "max_utilization")

_RUNNING = (RequestState.CONTEXT, RequestState.GENERATION)
_WAITING = (RequestState.WAITING, RequestState.PAUSED)


@dataclass
class SchedulerOutput:
    """The decisions of one :meth:`CapacityScheduler.schedule` call.

    Attributes:
        batch: Requests to run in the next step (context requests, generation requests with
            their draft-token counts).
        paused: Running requests that were paused and freed (``max_utilization`` only).
        rejected: Requests that can never fit; their state is ``FAILED``.
        waiting: Requests left waiting.
    """

    batch: ScheduledBatch = field(default_factory=ScheduledBatch)
    paused: list[Request] = field(default_factory=list)
    rejected: list[Request] = field(default_factory=list)
    waiting: list[Request] = field(default_factory=list)


class CapacityScheduler:
    """Chooses the requests of each engine step so that every window has the blocks.

    Args:
        resource_manager: Supplies the per-window estimates and frees paused requests.
        policy: ``"guaranteed_no_evict"`` or ``"max_utilization"``.
        max_batch_size: Most requests per step (default and upper bound: the manager's).
        max_num_tokens: Most tokens per step counted for admitting context requests
            (the first context request of an otherwise empty step is always allowed).

    Raises:
        ValueError: Unknown policy or bad limits.
    """

    def __init__(
        self,
        resource_manager: KVCacheResourceManager,
        policy: str = "guaranteed_no_evict",
        *,
        max_batch_size: int | None = None,
        max_num_tokens: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        limit = resource_manager.max_batch_size
        if max_batch_size is not None and not 0 < max_batch_size <= limit:
            raise ValueError(f"max_batch_size must be in 1..{limit}, got {max_batch_size!r}")
        if max_num_tokens is not None and max_num_tokens <= 0:
            raise ValueError(f"max_num_tokens must be positive, got {max_num_tokens!r}")
        self._rm = resource_manager
        self._policy = policy
        self._max_batch = max_batch_size if max_batch_size is not None else limit
        self._max_tokens = max_num_tokens
        self._fits_checked: dict[int, int] = {}  # request id -> context length checked

    @property
    def policy(self) -> str:
        """The scheduling policy."""
        return self._policy

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
        windows = rm.window_sizes
        out = SchedulerOutput()
        running = [r for r in requests if r.state in _RUNNING and rm.has_request(r)]
        waiting = [r for r in requests if r.state in _WAITING]

        guaranteed = self._policy == "guaranteed_no_evict"
        if guaranteed:
            budget = {w: rm.get_num_free_blocks(w) - rm.get_num_shared_blocks(w) for w in windows}
            for r in running:
                for w, n in rm.get_remaining_blocks_per_window(r).items():
                    budget[w] -= n
        else:
            step_need = {
                r.request_id: rm.get_needed_blocks_per_window(r, credit_releases=True)
                for r in running
            }
            total = {w: sum(n[w] for n in step_need.values()) for w in windows}
            free = {w: rm.get_num_free_blocks(w) for w in windows}
            while running and any(total[w] > free[w] for w in windows):
                victim = running.pop()  # the newest running request
                for w in windows:
                    total[w] -= step_need[victim.request_id][w]
                self._pause(victim)
                out.paused.append(victim)
                free = {w: rm.get_num_free_blocks(w) for w in windows}
            budget = {w: free[w] - total[w] for w in windows}
        admit_need = (
            rm.get_remaining_blocks_per_window if guaranteed else rm.get_needed_blocks_per_window
        )

        for r in running:
            if r.state is RequestState.GENERATION:
                out.batch.add_generation(r, rm.num_draft_tokens_for(r))
            else:
                out.batch.add_context(r)
        tokens = out.batch.num_tokens()

        blocked = bool(out.paused)  # no admissions in a step that had to pause
        admitted = 0
        for r in waiting:
            if self._never_fits(r):
                r.state = RequestState.FAILED
                out.rejected.append(r)
                continue
            if blocked or len(out.batch) >= self._max_batch:
                blocked = True
                out.waiting.append(r)
                continue
            size = r.context_len - r.context_position
            # Exact reuse only for the first admission of the step (see the module doc).
            need = admit_need(r, use_reuse=not admitted)
            fits_tokens = (
                self._max_tokens is None or len(out.batch) == 0 or tokens + size <= self._max_tokens
            )
            if fits_tokens and all(need[w] <= budget[w] for w in windows):
                for w in windows:
                    budget[w] -= need[w]
                out.batch.add_context(r)
                admitted += 1
                tokens += size
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
        return out

    def _never_fits(self, r: Request) -> bool:
        """Longer than max_seq_len, or a window's peak beyond its whole pool. A resumed
        request registers its generated tokens too, so it is checked again after a pause."""
        if self._fits_checked.get(r.request_id) == r.context_len:
            return False
        rm = self._rm
        if r.max_kv_tokens > rm.max_seq_len or any(
            n > rm.num_primary_blocks(w) for w, n in rm.get_blocks_to_run_alone(r).items()
        ):
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
