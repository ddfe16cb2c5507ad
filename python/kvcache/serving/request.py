"""Requests as the KV cache layer sees them, and the batch of one engine step.

:class:`Request` carries a request's tokens and progress, :class:`RequestState` where it is in
its life, and :class:`ScheduledBatch` the requests of one step with their chunk sizes and
draft counts. :mod:`kvcache.resource_manager` gives them blocks; :mod:`kvcache.scheduler`
chooses them.
"""

from __future__ import annotations

import enum
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcache.cache.fields import MAX_TOKEN, is_int

__all__ = ["Request", "RequestState", "ScheduledBatch"]


class RequestState(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    """Not scheduled yet (or paused and waiting to resume); holds no blocks."""
    CONTEXT = "context"
    """Its prompt is being processed (possibly in chunks); holds blocks."""
    GENERATION = "generation"
    """Generating tokens; holds blocks."""
    PAUSED = "paused"
    """Was running, was freed by the scheduler, resumes later with nothing lost."""
    FINISHED = "finished"
    """Generated ``max_new_tokens`` tokens."""
    FAILED = "failed"
    """Can never fit (longer than ``max_seq_len`` or than a window's whole pool)."""


_MAX_ID = 2**63  # request ids: 0 <= id < 2**63, as the manager takes them


def _check_tokens(request_id: int, prompt: Sequence[int]) -> None:
    """ValueError unless every prompt token is an int (not a bool) in ``[0, 2**31)``."""
    if isinstance(prompt, (str, bytes)):
        raise ValueError(f"request {request_id}: the prompt must be token ids, got text")
    tokens = list(prompt)
    if not all(type(t) is int for t in tokens):  # the common case is one fast pass
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(
                    f"request {request_id}: prompt[{i}] must be an int token id, got "
                    f"{type(t).__name__} {t!r}"
                )
        tokens = [operator.index(t) for t in tokens]
    lo, hi = min(tokens), max(tokens)
    if lo < 0 or hi >= MAX_TOKEN:
        i, t = next((i, t) for i, t in enumerate(tokens) if not 0 <= t < MAX_TOKEN)
        raise ValueError(
            f"request {request_id}: prompt[{i}] = {t} is out of range [0, {MAX_TOKEN - 1}]"
        )


@dataclass(eq=False)
class Request:
    """One inference request as the KV cache layer sees it.

    Args:
        request_id: Unique id (also the manager's sequence id), ``0 <= id < 2**63``.
        prompt: Prompt token ids (non-empty; ints, not bools, ``0 <= token < 2**31``).
        max_new_tokens: Tokens to generate (> 0).
        generated: Tokens generated so far (kept when the request is paused).
        lora_task_id: LoRA adapter id (part of the reuse key).
        cache_salt: Cache salt (part of the reuse key).
        multimodal: ``(content_hash, start, length)`` items (part of the reuse key).
        priority: Retention priority 0..100 for this request's blocks.
        arrival: Engine step at which the request arrives (for simulations).
        num_beams: Beams of a beam search (>= 1): after the prompt the request's sequence is
            forked (``KVCacheManager.fork_sequence``) into ``num_beams`` sequences that share
            the prompt's blocks.
        n: Sequences sampled in parallel (>= 1): the same fork, done once after the prompt.
            At most one of ``num_beams`` and ``n`` may exceed 1.

    Attributes:
        state: See :class:`RequestState`.
        context_position: Prompt tokens (of :meth:`context_tokens`) already in the cache: 0
            before the first chunk, then the reused prefix plus the chunks run so far
            (:meth:`KVCacheResourceManager.prepare_resources` sets it to the reused prefix
            when it registers the prompt; ``update_resources`` advances it).
        draft_tokens: Draft tokens proposed for the next step (speculative decoding).
        rewind_len: Draft tokens the engine rejected in the last step; consumed by
            :meth:`KVCacheResourceManager.update_resources`.
        reused_tokens: Prompt tokens found in the cache at the last ``add_sequence``.
        num_pauses: Times the scheduler paused this request.
        family_id: The beam family it belongs to (``None``: none): the request id of the
            request whose beams or samples were forked
            (:meth:`KVCacheResourceManager.fork_resources` sets it on the parent and the
            children). The scheduler decodes, pauses and resumes a family's members together.
    """

    request_id: int
    prompt: Sequence[int]
    max_new_tokens: int
    generated: list[int] = field(default_factory=list)
    lora_task_id: int | None = None
    cache_salt: str | bytes | int | None = None
    multimodal: Sequence[tuple[bytes | int, int, int]] | None = None
    priority: int | None = None
    arrival: int = 0
    num_beams: int = 1
    n: int = 1
    # The per-step fields default through a factory: no class attribute of the same name, so
    # that reading them per request per step takes CPython's fastest path.
    state: RequestState = field(default_factory=lambda: RequestState.WAITING)
    context_position: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    rewind_len: int = field(default_factory=int)
    reused_tokens: int = 0
    num_pauses: int = 0
    family_id: int | None = None

    def __post_init__(self) -> None:
        if not is_int(self.request_id):
            raise ValueError(f"request_id must be an int, got {self.request_id!r}")
        if not 0 <= self.request_id < _MAX_ID:
            raise ValueError(f"request_id = {self.request_id} is out of range [0, {_MAX_ID - 1}]")
        if len(self.prompt) == 0:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        _check_tokens(self.request_id, self.prompt)
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens <= 0
        ):
            raise ValueError(
                f"request {self.request_id}: max_new_tokens must be a positive int, "
                f"got {self.max_new_tokens!r}"
            )
        for name in ("num_beams", "n"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(
                    f"request {self.request_id}: {name} must be an int >= 1, got {value!r}"
                )
        if self.num_beams > 1 and self.n > 1:
            raise ValueError(
                f"request {self.request_id}: num_beams ({self.num_beams}) and n ({self.n}) "
                "cannot both exceed 1"
            )

    @property
    def num_sequences(self) -> int:
        """Sequences the request runs once its prompt is done: ``max(num_beams, n)``; they
        share the prompt's blocks (forked), so the prompt is cached once."""
        return max(self.num_beams, self.n)

    @property
    def prompt_len(self) -> int:
        """Tokens in the original prompt."""
        return len(self.prompt)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far."""
        return len(self.generated)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt) + len(self.generated)

    @property
    def remaining_new_tokens(self) -> int:
        """Tokens still to generate."""
        return self.max_new_tokens - len(self.generated)

    @property
    def is_finished(self) -> bool:
        """True once ``max_new_tokens`` tokens were generated."""
        return len(self.generated) >= self.max_new_tokens

    @property
    def max_kv_tokens(self) -> int:
        """Most tokens this request ever holds in the cache: ``prompt + max_new - 1``."""
        return len(self.prompt) + self.max_new_tokens - 1

    @property
    def context_len(self) -> int:
        """Length of :meth:`context_tokens` (prompt plus generated), without building it."""
        return len(self.prompt) + len(self.generated)

    def context_tokens(self) -> list[int]:
        """Tokens a context step registers: the prompt plus anything generated before a pause."""
        return [*self.prompt, *self.generated]

    def append_tokens(self, tokens: Sequence[int]) -> None:
        """Records tokens produced by the engine's step and advances the state.

        Example:
            >>> r = Request(7, prompt=[1, 2], max_new_tokens=2)
            >>> r.append_tokens([5]); r.state, r.is_finished
            (<RequestState.GENERATION: 'generation'>, False)
            >>> r.append_tokens([6]); r.state
            <RequestState.FINISHED: 'finished'>
        """
        if len(self.generated) + len(tokens) > self.max_new_tokens:
            raise ValueError(
                f"request {self.request_id}: {len(tokens)} more tokens would exceed "
                f"max_new_tokens={self.max_new_tokens}"
            )
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(
                    f"request {self.request_id}: tokens[{i}] must be an int token id, got "
                    f"{type(t).__name__} {t!r}"
                )
        if self.state is RequestState.CONTEXT:
            self.context_position = self.context_len
        self.generated.extend(operator.index(t) for t in tokens)
        self.state = RequestState.FINISHED if self.is_finished else RequestState.GENERATION


def _check_request(request: object) -> None:
    """TypeError unless ``request`` is a :class:`Request` (a batch holds nothing else)."""
    if not isinstance(request, Request):
        raise TypeError(f"request must be a kvcache.Request, got {type(request).__name__}")


@dataclass
class ScheduledBatch:
    """The requests of one engine step.

    Context entries carry the chunk of the prompt computed in this step (tokens after
    :attr:`Request.context_position`; the first chunk registers the whole prompt with the
    cache, and its tokens count after the reused prefix); generation entries carry the number
    of draft tokens verified in this step.

    Example:
        >>> a = Request(1, [1, 2, 3], 4); b = Request(2, [4, 5], 4, draft_tokens=[6, 7])
        >>> batch = ScheduledBatch()
        >>> batch.add_context(a); batch.add_generation(b, num_draft_tokens=2)
        >>> [r.request_id for r in batch.context_requests], batch.chunk_size(a)
        ([1], 3)
        >>> len(batch), batch.num_draft_tokens(b), batch.num_tokens()
        (2, 2, 6)
    """

    context: list[tuple[Request, int]] = field(default_factory=list)
    generation: list[tuple[Request, int]] = field(default_factory=list)

    def add_context(self, request: Request, chunk_size: int | None = None) -> None:
        """Adds a context request; ``chunk_size`` defaults to the rest of its prompt."""
        _check_request(request)
        remaining = request.context_len - request.context_position
        size = remaining if chunk_size is None else chunk_size
        if not 0 < size <= remaining:
            raise ValueError(
                f"request {request.request_id}: chunk_size must be in 1..{remaining}, got {size}"
            )
        self.context.append((request, size))

    def add_generation(self, request: Request, num_draft_tokens: int = 0) -> None:
        """Adds a generation request that verifies ``num_draft_tokens`` drafts this step."""
        _check_request(request)
        if num_draft_tokens < 0 or num_draft_tokens > len(request.draft_tokens):
            raise ValueError(
                f"request {request.request_id}: num_draft_tokens must be in "
                f"0..{len(request.draft_tokens)} (its draft_tokens), got {num_draft_tokens}"
            )
        self.generation.append((request, num_draft_tokens))

    @property
    def context_requests(self) -> list[Request]:
        """Context requests, in order."""
        return [r for r, _ in self.context]

    @property
    def generation_requests(self) -> list[Request]:
        """Generation requests, in order."""
        return [r for r, _ in self.generation]

    def chunk_size(self, request: Request) -> int:
        """Prompt tokens of ``request`` processed in this step."""
        for r, size in self.context:
            if r is request:
                return size
        raise KeyError(request.request_id)

    def is_last_chunk(self, request: Request) -> bool:
        """True if ``request``'s chunk in this step ends its context, so that the step
        produces its first generated token.

        Exact once :meth:`KVCacheResourceManager.prepare_resources` ran: that call counts the
        reused prefix of a new request as processed (and shortens a first chunk that would
        run past the prompt), so a reuse hit can make a chunk the last one.
        """
        return request.context_position + self.chunk_size(request) >= request.context_len

    def num_draft_tokens(self, request: Request) -> int:
        """Draft tokens of ``request`` verified in this step."""
        for r, d in self.generation:
            if r is request:
                return d
        raise KeyError(request.request_id)

    def num_tokens(self) -> int:
        """Tokens the model processes in this step."""
        return sum(s for _, s in self.context) + sum(1 + d for _, d in self.generation)

    def __len__(self) -> int:
        return len(self.context) + len(self.generation)
