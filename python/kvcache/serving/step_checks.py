"""The checks of :class:`kvcache.resource_manager.KVCacheResourceManager`'s step hooks (a
mixin of it): requests in the state a step expects, cached lengths that agree with the
requests' tokens, draft counts, a step that fits the free blocks, forks. They read the native
manager's state (``num_tokens``, ``prompt_length``, ``_first_length_mismatch``,
``get_step_needs``); they change nothing, so a failing hook leaves every state as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache._core import OutOfBlocksError
from kvcache.cache.manager import KVCacheManager
from kvcache.serving.request import Request, RequestState

__all__ = ["StepChecks"]


class StepChecks:
    """Validation helpers of the resource manager's step hooks.

    Attributes used (set by :class:`kvcache.resource_manager.KVCacheResourceManager`):
    ``_manager``, ``_windows``, ``_max_draft``, ``_running``; methods used:
    ``num_draft_tokens_for`` and ``_step_needs`` (of :class:`kvcache.estimates.ResourceEstimates`).
    """

    _manager: KVCacheManager
    _windows: list[int]
    _max_draft: int
    _running: dict[int, Request]

    num_draft_tokens_for: Callable[[Request], int]
    _step_needs: Callable[[Sequence[tuple[Request, int]], Sequence[tuple[Request, int]]], list[int]]

    def _check_prefill(self, request: Request) -> None:
        rid = request.request_id
        kv = int(self._manager.num_tokens(rid))
        context = int(self._manager.prompt_length(rid))
        if request.state is not RequestState.CONTEXT or kv >= context:
            raise ValueError(
                f"request {rid}: no prompt tokens left to prefill (state "
                f"{request.state.value}, {kv} of {context} context tokens cached)"
            )
        if request.context_position != kv:
            raise ValueError(
                f"request {rid}: context_position is {request.context_position} but the cache "
                f"holds {kv} of its {context} context tokens (call update_resources after every "
                "step)"
            )

    def _check_step_fits(
        self, gen: list[tuple[Request, int]], chunks: list[tuple[Request, int]]
    ) -> None:
        """Raises ``OutOfBlocksError`` unless every window holds the step's generation
        tokens and then its prefill chunks (see :meth:`get_needed_blocks_for_step`)."""
        needs = dict(zip(self._windows, self._step_needs(gen, chunks), strict=True))
        if self._manager.can_allocate(needs):
            return
        free = {w: int(self._manager.get_num_free_blocks(w)) for w in self._windows}
        what = f"this step's generation tokens and {len(chunks)} prefill chunk(s)"
        for w in self._windows:
            if needs[w] > free[w]:
                raise OutOfBlocksError(
                    f"prepare_resources: window {w} needs {needs[w]} free blocks for {what} "
                    f"but has {free[w]}"
                )
        raise OutOfBlocksError(
            f"prepare_resources: the windows need {needs} free blocks for {what}; each could "
            f"borrow its share alone ({free} free), but not all at once"
        )

    def _check_context_step(self, request: Request) -> None:
        rid = request.request_id
        kv = int(self._manager.num_tokens(rid))
        context = int(self._manager.prompt_length(rid))
        done = kv >= context
        if request.state is RequestState.CONTEXT and done:
            raise ValueError(
                f"request {rid}: this step's chunk ended its prompt; append "
                "its first generated token before update_resources"
            )
        if request.state is not RequestState.CONTEXT and not done:
            raise ValueError(
                f"request {rid}: a token was appended after a chunk that did "
                f"not end its prompt ({kv} of {context} context tokens cached; "
                "see ScheduledBatch.is_last_chunk)"
            )

    def _check_generation(self, gen: Sequence[tuple[Request, int]], ids: list[int]) -> None:
        """Checks a batch's generation requests: state, registration and cached length (one
        native call for the lengths)."""
        generation = RequestState.GENERATION
        # One pass: the lengths of the requests in generation (all of them, normally).
        lengths = [len(r.prompt) + len(r.generated) - 1 for r, _ in gen if r.state is generation]
        if len(lengths) == len(gen):
            k = int(self._manager._first_length_mismatch(ids, lengths))
        else:  # some request is not in generation: the first length mismatch, else that one
            lengths = [len(r.prompt) + len(r.generated) - 1 for r, _ in gen]
            k = int(self._manager._first_length_mismatch(ids, lengths))
            if k < 0:
                k = next(i for i, (r, _) in enumerate(gen) if r.state is not generation)
        if k >= 0:
            request = gen[k][0]
            if request.state is not generation or request.request_id not in self._running:
                raise ValueError(
                    f"request {request.request_id}: not in generation (state {request.state.value})"
                )
            raise ValueError(
                f"request {request.request_id}: the cache holds "
                f"{int(self._manager.num_tokens(request.request_id))} tokens but the request "
                f"has {request.num_tokens} (expected one more: the newest token)"
            )

    def _check_drafts(self, gen: Sequence[tuple[Request, int]]) -> int:
        """Checks the draft counts of a batch's generation requests; returns the most."""
        most = max([d for _, d in gen])
        for request, num_draft in gen if most else ():
            limit = self.num_draft_tokens_for(request)
            if num_draft > limit:
                raise ValueError(
                    f"request {request.request_id}: {num_draft} draft tokens, at most {limit} "
                    f"allowed (max_draft_tokens {self._max_draft}, "
                    f"{request.remaining_new_tokens} tokens left to generate)"
                )
        return most
