"""Request-level KV cache management for an inference engine's step loop.

An engine step looks like this::

    batch = scheduler.schedule(active_requests).batch      # kvcache.scheduler
    resource_manager.prepare_resources(batch)              # blocks for this step
    ... run the model: each context request computes its chunk, and a request whose
        chunk ends its prompt (batch.is_last_chunk) gets its first generated token;
        generation requests append their tokens and set request.rewind_len ...
    resource_manager.update_resources(batch)               # progress, rewinds, storing
    for r in finished: resource_manager.free_resources(r)

Chunked prefill: a context request's prompt (:meth:`Request.context_tokens`) may be processed
in several steps. Its first chunk registers the whole prompt with ``add_sequence(...,
prefill=chunk)`` (keys and reuse lookup for all of it, blocks for the reused prefix plus
``chunk`` tokens); the step's later chunks take one ``prefill(request_ids, chunks)`` call. A
chunk counts the tokens computed in the step, after the reused prefix. ``add_context(request)``
without a chunk size runs the whole rest of the prompt in one step (whole-prompt prefill).

Token accounting: after a request's context the cache holds its prompt (plus, for a resumed
request, the tokens it had generated before it was paused) and the last chunk's step produces
one new token. Each generation step appends the newest generated token (its KV is computed in
that step) plus any draft tokens, so between steps the cache holds ``num_tokens - 1`` tokens:
the newest generated token is not cached yet. A request that generates ``max_new_tokens``
tokens therefore peaks at ``prompt_len + max_new_tokens - 1`` cached tokens (plus nothing for
drafts, which are capped at what is left to generate).

Block estimates follow the native manager's rules exactly (``keep`` = window +
``max_draft_tokens``; a full-attention window never releases):

* registering a prompt with a reused prefix of ``R`` tokens gives every window the positions
  up to ``R + chunk`` (the whole prompt without chunking), except that a sliding window ``w``
  gets no block for the first ``max(0, R - w) // tokens_per_block`` positions;
* a later chunk that starts at ``n`` tokens first releases the front blocks wholly below
  ``n + 1 - keep`` (no query of the chunk attends them), then takes the blocks its tokens
  start, so a sliding window holds at most ``ceil((keep + chunk - 1) / tokens_per_block) + 1``
  blocks per sequence during prefill, whatever the prompt length;
* every generated or draft token that starts a block takes one more block in every window,
  and after each appended token a sliding window releases the front blocks whose positions
  are all below ``num_tokens - keep`` (released before anything is allocated).

With block reuse on, a registration takes exactly what ``KVCacheManager.
get_num_blocks_to_allocate`` says (blocks that other running requests hold cost nothing). A
block of a sliding window that several running requests share is freed only when its last
holder releases it; the estimates credit releases per request, so
:meth:`KVCacheResourceManager.get_num_shared_blocks` counts the extra holdings that the
scheduler must keep in reserve (see
:meth:`~KVCacheResourceManager.get_remaining_blocks_to_completion`).

Example:
    >>> from kvcache import KvCacheConfig, ModelConfig
    >>> model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    >>> config = KvCacheConfig(tokens_per_block=4, max_attention_window=[8, None],
    ...                        backend="virtual")
    >>> rm = KVCacheResourceManager.from_blocks(model, config, {8: 16, 64: 16},
    ...                                         max_seq_len=64, max_batch_size=4)
    >>> r = Request(1, prompt=list(range(10)), max_new_tokens=20)
    >>> rm.get_remaining_blocks_to_completion(r, 8), rm.get_remaining_blocks_to_completion(r, 64)
    (3, 8)
    >>> batch = ScheduledBatch()
    >>> batch.add_context(r)
    >>> rm.prepare_resources(batch)
    >>> batch.is_last_chunk(r)
    True
    >>> r.append_tokens([100])        # the engine's output for the context step
    >>> rm.update_resources(batch)
    >>> rm.get_num_allocated_blocks(r, 8), rm.get_num_free_blocks()
    (3, 13)

    The same prompt in chunks of 4 tokens: the 8-token window never holds more than 3 blocks.

    >>> c = Request(2, prompt=list(range(50, 60)), max_new_tokens=20)
    >>> rm.get_remaining_blocks_to_completion(c, 8, chunk_size=4)
    3
    >>> while c.state is not RequestState.GENERATION:
    ...     batch = ScheduledBatch()
    ...     batch.add_context(c, min(4, c.context_len - c.context_position))
    ...     rm.prepare_resources(batch)
    ...     if batch.is_last_chunk(c):
    ...         c.append_tokens([100])
    ...     rm.update_resources(batch)
    ...     print(c.context_position, rm.get_num_allocated_blocks(c, 8))
    4 1
    8 2
    10 3
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvcache._core import OutOfBlocksError, PreparedPrompt
from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.manager import KVCacheManager

__all__ = [
    "KVCacheResourceManager",
    "Request",
    "RequestState",
    "ScheduledBatch",
    "peak_live_blocks",
]


_PREPARED_CACHE_LIMIT = 4096  # prepared contexts kept for requests not yet registered


class EventPublisher(Protocol):
    """What ``KVCacheResourceManager(..., event_publisher=...)`` calls once per step."""

    def publish(self) -> object:
        """Publishes the events of the step that just ended."""


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


@dataclass(eq=False)
class Request:
    """One inference request as the KV cache layer sees it.

    Args:
        request_id: Unique id (also the manager's sequence id).
        prompt: Prompt token ids (non-empty, non-negative).
        max_new_tokens: Tokens to generate (> 0).
        generated: Tokens generated so far (kept when the request is paused).
        lora_task_id: LoRA adapter id (part of the reuse key).
        cache_salt: Cache salt (part of the reuse key).
        multimodal: ``(content_hash, start, length)`` items (part of the reuse key).
        priority: Retention priority 0..100 for this request's blocks.
        arrival: Engine step at which the request arrives (for simulations).

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
    state: RequestState = RequestState.WAITING
    context_position: int = 0
    draft_tokens: list[int] = field(default_factory=list)
    rewind_len: int = 0
    reused_tokens: int = 0
    num_pauses: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.request_id, bool) or not isinstance(self.request_id, int):
            raise ValueError(f"request_id must be an int, got {self.request_id!r}")
        if len(self.prompt) == 0:
            raise ValueError(f"request {self.request_id}: the prompt is empty")
        if (
            isinstance(self.max_new_tokens, bool)
            or not isinstance(self.max_new_tokens, int)
            or self.max_new_tokens <= 0
        ):
            raise ValueError(
                f"request {self.request_id}: max_new_tokens must be a positive int, "
                f"got {self.max_new_tokens!r}"
            )

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
        if self.state is RequestState.CONTEXT:
            self.context_position = self.context_len
        self.generated.extend(int(t) for t in tokens)
        self.state = RequestState.FINISHED if self.is_finished else RequestState.GENERATION


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
        remaining = request.context_len - request.context_position
        size = remaining if chunk_size is None else chunk_size
        if not 0 < size <= remaining:
            raise ValueError(
                f"request {request.request_id}: chunk_size must be in 1..{remaining}, got {size}"
            )
        self.context.append((request, size))

    def add_generation(self, request: Request, num_draft_tokens: int = 0) -> None:
        """Adds a generation request that verifies ``num_draft_tokens`` drafts this step."""
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


# --------------------------------------------------------------------------------------
# Block arithmetic (pure)
# --------------------------------------------------------------------------------------


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _released(num_tokens: int, keep: int, tpb: int) -> int:
    """Front blocks a sliding window has released at ``num_tokens`` tokens.

    ``keep`` is the window plus the manager's ``max_draft_tokens``.
    """
    below = num_tokens - keep
    return below // tpb if below > 0 else 0


def peak_live_blocks(lo: int, hi: int, *, keep: int, tokens_per_block: int, front: int = 0) -> int:
    """Most blocks one sequence holds in a window while it grows from ``lo`` to ``hi`` tokens.

    After appending token ``m`` the sequence holds ``ceil(m / tpb) - max(front, R(m))``
    blocks, where ``R(m) = max(0, m - keep) // tpb`` front blocks have left the window
    (``keep`` = window + max_draft_tokens; a full-attention window never releases) and
    ``front`` is what was already released. Computed in O(1).

    Args:
        lo: First length reached (>= 1).
        hi: Last length reached (>= lo).
        keep: Tokens the window keeps (window plus draft allowance).
        tokens_per_block: Block size.
        front: Front blocks already released.

    Returns:
        The maximum, over ``m`` in ``[lo, hi]``, of the blocks held after token ``m``.

    Example:
        Window 6, 4-token blocks: at 13 tokens blocks 1..3 hold positions 4..12 (block 0 left
        the window at 10 tokens); at most 3 blocks are ever held.

        >>> peak_live_blocks(1, 13, keep=6, tokens_per_block=4)
        3
        >>> peak_live_blocks(1, 100, keep=5, tokens_per_block=4)   # 5 = 4 + 1: never 3
        2
    """
    tpb = tokens_per_block
    if hi < lo:
        raise ValueError(f"hi ({hi}) must be >= lo ({lo})")
    # Below m_star the front released before is what counts; from m_star on, R(m) > front.
    m_star = keep + (front + 1) * tpb
    best = 0
    if lo < m_star:
        best = _ceil_div(min(hi, m_star - 1), tpb) - front
    if hi >= m_star:
        # For m = keep + j (j >= 1): ceil(m/tpb) - j // tpb = a + ceil((b + j % tpb) / tpb)
        # with keep = a * tpb + b; non-decreasing in j % tpb, so take the largest residue.
        j0, j1 = max(lo, m_star) - keep, hi - keep
        if j1 - j0 + 1 >= tpb or j0 % tpb > j1 % tpb:
            s = tpb - 1
        else:
            s = j1 % tpb
        a, b = divmod(keep, tpb)
        best = max(best, a + _ceil_div(b + s, tpb))
    return best


def _prefill_peak(start: int, end: int, chunk: int, *, keep: int, tpb: int, front: int) -> int:
    """Most blocks one sequence holds in a window after any prefill chunk of at most ``chunk``
    tokens that starts at ``start`` tokens or later and ends by ``end`` tokens.

    A chunk from ``a`` to ``b`` tokens first releases the front blocks below
    ``a + 1 - keep`` (as ``KVCacheManager.prefill`` does), then holds
    ``ceil(b / tpb) - max(front, released)`` blocks. The worst chunk ending at ``b`` starts as
    early as it can: at ``start`` while ``b <= start + chunk``, else at ``b - chunk``, which
    is :func:`peak_live_blocks` with ``keep + chunk - 1`` kept tokens. So this is the exact
    worst case over every way of cutting the rest of the prompt into chunks of at most
    ``chunk`` tokens, and exact when the rest is one chunk.
    """
    first_end = min(end, start + chunk)
    best = _ceil_div(first_end, tpb) - max(front, _released(start + 1, keep, tpb))
    if first_end < end:
        best = max(
            best,
            peak_live_blocks(
                first_end + 1, end, keep=keep + chunk - 1, tokens_per_block=tpb, front=front
            ),
        )
    return best


@dataclass
class _SeqState:
    """What the resource manager knows about a request registered with the manager."""

    kv_len: int  # tokens with blocks (fewer than context_len while chunks remain)
    hwm: int  # most tokens the cache ever held for it (sliding windows release by this)
    context_len: int  # tokens of the registered context (prompt plus resumed tokens)
    front: list[int]  # released (or never allocated) front blocks per window (ascending)
    # With reuse: the block ids of the context positions that have blocks, per window that
    # can release blocks (None elsewhere). Only these can be shared with other requests
    # (prefilled chunks are stored for reuse); blocks of generated tokens are private while
    # the request runs.
    ids: list[list[int] | None] = field(default_factory=list)


@dataclass(frozen=True)
class _Registration:
    """What registering a request's context with a first chunk does now."""

    reused: int  # prompt tokens found in the cache
    first_end: int  # tokens with blocks afterwards
    front: list[int]  # per window: leading positions that get no block
    cost: list[int]  # per window: free blocks taken


# --------------------------------------------------------------------------------------
# Resource manager
# --------------------------------------------------------------------------------------


class KVCacheResourceManager:
    """Drives one :class:`kvcache.KVCacheManager` request by request, step by step.

    Args:
        manager: The KV cache manager (it decides windows, block size and draft allowance).
        event_publisher: Called (``publish()``) once per step at the end of
            :meth:`update_resources`, e.g. a :class:`kvcache.events.ZmqEventPublisher`.

    Example:
        See the module docstring.
    """

    def __init__(
        self, manager: KVCacheManager, *, event_publisher: EventPublisher | None = None
    ) -> None:
        self._manager = manager
        self._event_publisher = event_publisher
        self._windows: list[int] = list(manager.window_sizes)
        self._tpb: int = int(manager.tokens_per_block)
        self._max_seq_len: int = int(manager.max_seq_len)
        self._max_draft: int = int(getattr(manager, "max_draft_tokens", 0))
        self._keep = [w + self._max_draft for w in self._windows]
        self._primary = {w: int(_primary(v)) for w, v in manager.blocks_per_window.items()}
        self._seqs: dict[int, _SeqState] = {}
        self._prepared: dict[int, PreparedPrompt] = {}  # waiting requests' contexts
        reuse = getattr(manager, "reuse_enabled", None)
        if reuse is None:
            reuse = getattr(getattr(manager, "config", None), "enable_block_reuse", False)
        self._reuse = bool(reuse)
        # Windows that can release blocks while a sequence runs (keep < max_seq_len).
        self._releasing = [keep < self._max_seq_len for keep in self._keep]
        # With reuse, per releasing window: holders of each shared-able block among the
        # registered requests, and the extra holdings (sum of holders - 1).
        self._holders: list[dict[int, int]] = [{} for _ in self._windows]
        self._shared: list[int] = [0] * len(self._windows)

    @classmethod
    def from_blocks(
        cls,
        model: ModelConfig,
        config: KvCacheConfig,
        blocks_per_window: Mapping[int, int | tuple[int, int]],
        *,
        max_seq_len: int,
        max_batch_size: int,
        max_draft_tokens: int = 0,
    ) -> KVCacheResourceManager:
        """Builds the manager with exact block counts per window, then wraps it."""
        return cls(
            KVCacheManager.from_blocks(
                model,
                config,
                blocks_per_window,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                max_draft_tokens=max_draft_tokens,
            )
        )

    @classmethod
    def from_memory(
        cls,
        model: ModelConfig,
        config: KvCacheConfig,
        *,
        max_seq_len: int,
        max_batch_size: int,
        primary_bytes: int | None = None,
        max_draft_tokens: int = 0,
        process_group: Any = None,
    ) -> KVCacheResourceManager:
        """Sizes the manager from a memory budget (see ``KVCacheManager``), then wraps it."""
        return cls(
            KVCacheManager(
                model,
                config,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                primary_bytes=primary_bytes,
                max_draft_tokens=max_draft_tokens,
                process_group=process_group,
            )
        )

    # ------------------------------------------------------------------ properties

    @property
    def manager(self) -> KVCacheManager:
        """The wrapped manager."""
        return self._manager

    @property
    def window_sizes(self) -> list[int]:
        """Window sizes, ascending."""
        return list(self._windows)

    @property
    def tokens_per_block(self) -> int:
        """Token positions per block."""
        return self._tpb

    @property
    def max_seq_len(self) -> int:
        """Longest sequence the manager accepts."""
        return self._max_seq_len

    @property
    def max_draft_tokens(self) -> int:
        """Draft tokens a step may add (and rewind) per request."""
        return self._max_draft

    @property
    def max_batch_size(self) -> int:
        """Most requests registered at once."""
        return int(self._manager.max_batch_size)

    def num_primary_blocks(self, window_size: int) -> int:
        """Primary blocks of a window's pool (its initial blocks under ``lend_free_memory``;
        ``manager.blocks_per_window`` has what it owns now)."""
        return self._primary[window_size]

    def get_num_used_blocks(self, window_size: int) -> int:
        """Primary blocks of a window that requests (or pins) hold now."""
        return int(self._manager.get_num_used_blocks(window_size))

    def can_allocate(self, blocks: Mapping[int, int]) -> bool:
        """Whether every window can hand out ``blocks[window]`` blocks at once now (a
        negative count is a credit: the window frees that many first). Per window this is
        ``blocks[w] <= get_num_free_blocks(w)``; under ``lend_free_memory`` the windows also
        compete for the memory they can borrow, which only this joint check sees."""
        return bool(self._manager.can_allocate(dict(blocks)))

    def fits_when_empty(self, blocks: Mapping[int, int]) -> bool:
        """Whether the pools could hold ``blocks[window]`` blocks of every window at once if
        nothing else held any (under ``lend_free_memory``: in the whole shared memory)."""
        return bool(self._manager.fits_when_empty(dict(blocks)))

    def has_request(self, request: Request) -> bool:
        """True while the request holds blocks."""
        return request.request_id in self._seqs

    def num_draft_tokens_for(self, request: Request) -> int:
        """Drafts usable in the request's next step: at most its drafts, the manager's
        allowance and one less than the tokens it still has to generate."""
        return max(
            0, min(len(request.draft_tokens), self._max_draft, request.remaining_new_tokens - 1)
        )

    # ------------------------------------------------------------------ step hooks

    def prepare_resources(self, batch: ScheduledBatch) -> None:
        """Gives every request of the batch the blocks its step needs; all or nothing.

        A context request's first chunk registers its :meth:`Request.context_tokens` with
        ``add_sequence(..., prefill=chunk)`` (the whole prompt when the chunk covers it) and
        sets :attr:`Request.context_position` to the reused prefix; a chunk that would run
        past the prompt after a reuse hit is shortened in the batch, so that
        ``batch.chunk_size(request)`` is what the step computes. The later chunks of the
        batch take one ``prefill(request_ids, chunks)`` call. Generation requests append
        their newest generated token in one ``add_tokens`` call for the whole batch, then
        their draft tokens (one ``add_tokens`` call per draft position).

        Order: registrations, generation tokens, then later chunks. A prefill cannot be
        undone, so when the batch has later chunks, the generation tokens and chunks are
        checked against the free blocks first (:meth:`get_needed_blocks_for_step`) and
        nothing runs unless all of them fit.

        Raises:
            ValueError: A request in the wrong state, whose cached length disagrees with its
                generated tokens, or whose ``context_position`` disagrees with the cache.
            OutOfBlocksError: Some window lacks blocks; nothing was changed.
        """
        added: list[Request] = []
        grown: list[tuple[Request, int]] = []  # (request, tokens appended so far)
        original = list(batch.context)
        prefills: list[tuple[Request, int]] = []
        try:
            for k, (request, chunk) in enumerate(original):
                if request.request_id in self._seqs:
                    self._check_prefill(request)
                    prefills.append((request, chunk))
                    continue
                self._add_sequence(request, chunk)
                added.append(request)
                rest = request.context_len - request.context_position
                if chunk > rest:
                    batch.context[k] = (request, rest)
            gen = batch.generation
            for request, d in gen:
                self._check_generation(request, d)
            if prefills:
                self._check_step_fits(gen, prefills)
            if gen:
                self._add_tokens(
                    [r for r, _ in gen], [r.generated[-1] for r, _ in gen], grown, first=True
                )
                for j in range(max(d for _, d in gen)):
                    step = [r for r, d in gen if d > j]
                    self._add_tokens(step, [r.draft_tokens[j] for r in step], grown)
        except BaseException:
            self._roll_back(added, grown)
            batch.context[:] = original
            raise
        if prefills:  # checked above: cannot run out of blocks
            self._prefill(prefills)

    def update_resources(self, batch: ScheduledBatch) -> None:
        """After the step: advances the context requests (``context_position``), drops
        rejected draft tokens (``request.rewind_len``) and, with block reuse on, stores the
        full blocks of every prompt chunk that ran for early reuse by other requests (one
        ``store_context_blocks`` call for the batch).

        Raises:
            ValueError: A context request whose chunk ended its prompt got no generated
                token, or one whose chunk did not end its prompt got one; a bad
                ``rewind_len``.
        """
        for request, _ in batch.context:
            seq = self._seqs.get(request.request_id)
            if seq is not None:
                self._check_context_step(request, seq)
        for request, d in batch.generation:
            rewind = request.rewind_len
            if rewind:
                if not 0 < rewind <= d:
                    raise ValueError(
                        f"request {request.request_id}: rewind_len {rewind} is not in 0..{d} "
                        "(the drafts verified this step)"
                    )
                self._manager.rewind(request.request_id, rewind)
                self._seqs[request.request_id].kv_len -= rewind
                request.rewind_len = 0
            request.draft_tokens = []
        ran: list[int] = []
        for request, _ in batch.context:
            seq = self._seqs.get(request.request_id)
            if seq is None:
                continue
            if request.state is RequestState.CONTEXT:
                request.context_position = seq.kv_len
            ran.append(request.request_id)
        if self._reuse and ran:
            self._manager.store_context_blocks(ran)  # every chunk that ran, in one call
        if self._event_publisher is not None:
            self._event_publisher.publish()

    def free_resources(self, request: Request, *, store_for_reuse: bool = True) -> None:
        """Ends the request's sequence and returns its blocks (stored for reuse if enabled)."""
        if request.request_id not in self._seqs:
            raise KeyError(f"request {request.request_id} holds no KV cache blocks")
        self._manager.remove_sequence(request.request_id, store_for_reuse=store_for_reuse)
        self._drop_holdings(self._seqs.pop(request.request_id))

    # ------------------------------------------------------------------ estimates

    def get_num_allocated_blocks(self, request: Request, window_size: int) -> int:
        """Blocks the request holds now in a window (released front blocks not counted)."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            return 0
        i = self._index(window_size)
        return _ceil_div(seq.kv_len, self._tpb) - seq.front[i]

    def get_reusable_prefix_length(self, request: Request) -> int:
        """Context tokens that registering the request now would find in the cache (0
        without reuse); for a registered request, what its registration reused.

        A scheduler sizes a first chunk with it: the chunk counts the tokens after this
        prefix.
        """
        if request.request_id in self._seqs:
            return request.reused_tokens
        if not self._reuse:
            return 0
        return int(self._manager.get_reusable_prefix_length(self._prompt(request)))

    def get_needed_blocks_one_step(
        self,
        request: Request,
        window_size: int,
        *,
        chunk_size: int | None = None,
        credit_releases: bool = False,
        use_reuse: bool = True,
    ) -> int:
        """Free blocks the request's next step takes from a window.

        * a context request not registered yet: what its first chunk of ``chunk_size``
          tokens after the reused prefix (``None``: the whole prompt) takes when
          ``add_sequence`` registers it: ``ceil(tokens / tokens_per_block)`` without reuse;
          with reuse on (and ``use_reuse``) exactly ``get_num_blocks_to_allocate(...,
          prefill=chunk_size)`` of the manager now (reused blocks held by running requests
          cost nothing, a sliding window needs nothing before ``reused - window``);
        * a registered context request: the blocks its next chunk of ``chunk_size`` tokens
          (``None``: the rest of its prompt) starts;
        * a generation request: the new blocks its newest token and its usable drafts
          (:meth:`num_draft_tokens_for`) start;
        * anything else: 0.

        With ``credit_releases`` the blocks its sliding windows release during the step are
        subtracted (at the step's worst point), which is what the step really takes from
        the free pool; the native ``prefill`` and ``add_tokens`` credit them the same way. A
        released block that another running request also holds frees nothing and is not
        credited; for the same reason a registration is then charged, in windows that
        release blocks, the reused blocks that running requests hold (sharing them voids
        their holders' release credits).

        ``use_reuse=False`` gives, for a registration, an upper bound whatever the cache
        holds by the time the request registers (one free block per position the chunk
        covers, for any reused prefix): what a scheduler charges a second admission of the
        same step, whose cached prefix the first one's allocations may evict.

        Raises:
            ValueError: Unknown window, or a chunk size below 1 or beyond the rest of a
                registered request's prompt.

        Example:
            A request holding 10 tokens at a 4-token block size holds 3 blocks; its next token
            is the 11th and needs no block; with 2 drafts it would write the 13th and need one.
        """
        i = self._index(window_size)
        return self._needs(request, chunk_size, credit_releases, use_reuse)[i]

    def get_needed_blocks_per_window(
        self,
        request: Request,
        *,
        chunk_size: int | None = None,
        credit_releases: bool = False,
        use_reuse: bool = True,
    ) -> dict[int, int]:
        """:meth:`get_needed_blocks_one_step` for every window (one reuse lookup)."""
        needs = self._needs(request, chunk_size, credit_releases, use_reuse)
        return dict(zip(self._windows, needs, strict=True))

    def get_needed_blocks_for_step(self, batch: ScheduledBatch) -> dict[int, int]:
        """Free blocks per window that the registered requests of a batch take at the
        step's worst point, as :meth:`prepare_resources` runs them.

        First the generation tokens: one ``add_tokens`` call per token position (the newest
        tokens of all generation requests, then each draft position), where a block that
        one request releases serves any request of the same call, as in the native check;
        then the later prefill chunks, each crediting only its own releases. A released
        block that another request also holds frees nothing and is not credited. Requests
        not registered yet (first chunks) are not included: registrations run first, so
        a scheduler adds their :meth:`get_needed_blocks_per_window` to this.

        Example:
            A request whose whole prompt was just registered releases most of its sliding
            window blocks with its first generated token; in the same call they serve the
            other requests' new blocks, so a full sliding pool can still run the step.
        """
        gen = [(r, d) for r, d in batch.generation if r.request_id in self._seqs]
        chunks = [
            (r, k)
            for r, k in batch.context
            if r.request_id in self._seqs
            and r.state is RequestState.CONTEXT
            and self._seqs[r.request_id].kv_len < self._seqs[r.request_id].context_len
        ]
        return dict(zip(self._windows, self._step_total(gen, chunks), strict=True))

    def get_remaining_blocks_to_completion(
        self,
        request: Request,
        window_size: int,
        *,
        chunk_size: int | None = None,
        use_reuse: bool = True,
        prefill_only: bool = False,
    ) -> int:
        """Free blocks the request may still take from a window before it finishes.

        The peak of the blocks it will hold (the reused prefix and the prompt chunks, then
        the blocks covering the window plus what is being written as it grows to
        :attr:`Request.max_kv_tokens`) minus what it holds now. ``chunk_size`` is the largest
        chunk the rest of the prompt will be prefilled in (``None``: one chunk, the whole
        rest); the peak is then the worst case over every way of cutting the prompt into
        such chunks, exact when the rest is one chunk. A sliding window never needs more
        than ``ceil((keep + chunk_size - 1) / tokens_per_block) + 1`` blocks during prefill
        and ``ceil(keep / tokens_per_block) + 1`` after it, ``keep`` being the window plus
        ``max_draft_tokens``. Releases are credited: the sum of this over running requests
        plus :meth:`get_num_shared_blocks` never exceeds the free blocks, which is what
        ``guaranteed_no_evict`` scheduling keeps true.

        With reuse on (and ``use_reuse``), a request not registered yet is charged what
        registering takes now (``get_num_blocks_to_allocate``) plus its growth; in a window
        that releases blocks, reused blocks that running requests hold are charged too,
        because sharing them adds to :meth:`get_num_shared_blocks` (their holders' release
        credits become void). In isolation this is exactly the peak of the free blocks taken.
        ``use_reuse=False`` gives an upper bound whatever the cache holds when it registers.
        With ``prefill_only``, only until its prompt is prefilled (0 afterwards): what
        ``max_utilization`` scheduling keeps for prompts being prefilled in chunks.

        Example:
            Window 8, 4-token blocks, a 10-token prompt generating 20 tokens (29 cached at
            most): 3 blocks at registration and never more than 3 in the window (8 tokens
            span at most 3 blocks), so 3 before it starts; the 64-token window needs
            ``ceil(29 / 4) = 8``.
        """
        i = self._index(window_size)
        return self._remaining(request, chunk_size, use_reuse, prefill_only)[i]

    def get_remaining_blocks_per_window(
        self,
        request: Request,
        *,
        chunk_size: int | None = None,
        use_reuse: bool = True,
        prefill_only: bool = False,
    ) -> dict[int, int]:
        """:meth:`get_remaining_blocks_to_completion` for every window (one reuse lookup)."""
        remaining = self._remaining(request, chunk_size, use_reuse, prefill_only)
        return dict(zip(self._windows, remaining, strict=True))

    def get_blocks_to_run_alone(
        self, request: Request, *, chunk_size: int | None = None
    ) -> dict[int, int]:
        """Per window, the most blocks the request holds from registration to completion
        without reuse, its prompt prefilled in chunks of at most ``chunk_size`` tokens
        (``None``: whole): what it needs from an otherwise empty pool (the scheduler rejects
        a request for which this exceeds a window's pool)."""
        self._check_chunk_size(chunk_size)
        n = request.context_len
        size = n if chunk_size is None else min(chunk_size, n)
        nb = _ceil_div(size, self._tpb)
        alone = _Registration(0, size, [0] * len(self._windows), [nb] * len(self._windows))
        final = request.max_kv_tokens
        return {
            w: self._peak_new(request, i, size, alone, final) for i, w in enumerate(self._windows)
        }

    def get_num_shared_blocks(self, window_size: int) -> int:
        """Extra holdings of blocks that several registered requests share in a window that
        releases blocks: the sum over such blocks of (holders - 1); 0 in windows that never
        release (full attention) or without reuse.

        Each holder's estimates credit the release of a shared block, but only the last
        release frees it, so the scheduler keeps this many blocks in reserve.
        """
        return self._shared[self._index(window_size)]

    def get_num_free_blocks(self, window_size: int | None = None) -> int:
        """Primary blocks that can be handed out now; without a window the minimum over
        windows."""
        if window_size is None:
            return min(int(self._manager.get_num_free_blocks(w)) for w in self._windows)
        return int(self._manager.get_num_free_blocks(window_size))

    def get_num_available_tokens(self) -> int:
        """Tokens that fit in the free blocks of the tightest window, less the draft
        allowance: ``get_num_free_blocks() * tokens_per_block - max_draft_tokens``."""
        return max(0, self.get_num_free_blocks() * self._tpb - self._max_draft)

    # ------------------------------------------------------------------ internals

    def _index(self, window_size: int) -> int:
        try:
            return self._windows.index(window_size)
        except ValueError:
            raise ValueError(
                f"window_size {window_size!r} is not one of this manager's windows {self._windows}"
            ) from None

    def _prompt(self, request: Request) -> PreparedPrompt:
        """The request's context, prepared once (converted and keyed) for every estimate and
        the registration: a head-of-line request retried every step is not hashed again. A
        re-admission after a pause (longer context) prepares anew."""
        n = request.context_len
        p = self._prepared.get(request.request_id)
        if p is None or len(p) != n:
            if len(self._prepared) >= _PREPARED_CACHE_LIMIT:
                self._prepared.clear()  # requests that never registered: drop them all
            p = self._manager.prepare(
                request.context_tokens(),
                lora_task_id=request.lora_task_id,
                cache_salt=request.cache_salt,
                multimodal=request.multimodal,
            )
            self._prepared[request.request_id] = p
        return p

    @staticmethod
    def _check_chunk_size(chunk_size: int | None) -> None:
        if chunk_size is not None and (
            isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
        ):
            raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")

    # --- estimates: one step

    def _needs(
        self, request: Request, chunk: int | None, credit: bool, use_reuse: bool
    ) -> list[int]:
        self._check_chunk_size(chunk)
        nw = len(self._windows)
        seq = self._seqs.get(request.request_id)
        if seq is None:
            if request.state in (RequestState.FINISHED, RequestState.FAILED):
                return [0] * nw
            return self._first_chunk_need(request, chunk, credit, use_reuse)
        if request.state is RequestState.CONTEXT and seq.kv_len < seq.context_len:
            rest = seq.context_len - seq.kv_len
            if chunk is not None and chunk > rest:
                raise ValueError(
                    f"request {request.request_id}: chunk_size {chunk} exceeds the {rest} "
                    "prompt tokens left"
                )
            size = rest if chunk is None else chunk
            return [self._prefill_need(seq, i, size, credit) for i in range(nw)]
        if request.state is RequestState.GENERATION:
            tokens = 1 + self.num_draft_tokens_for(request)
            return [self._decode_need(seq, i, tokens, credit) for i in range(nw)]
        return [0] * nw

    def _first_chunk_need(
        self, request: Request, chunk: int | None, credit: bool, use_reuse: bool
    ) -> list[int]:
        n = request.context_len
        size = n if chunk is None else chunk
        if self._reuse and not use_reuse:
            return [self._first_chunk_bound(n, size, i) for i in range(len(self._windows))]
        reg = self._registration(request, size)
        if not credit:
            return reg.cost
        held = _ceil_div(reg.first_end, self._tpb)
        return [
            max(cost, held - front) if releasing else cost
            for cost, front, releasing in zip(reg.cost, reg.front, self._releasing, strict=True)
        ]

    def _first_chunk_bound(self, n: int, size: int, i: int) -> int:
        """Most positions a first chunk of ``size`` tokens gives blocks to in window ``i``,
        over every reused prefix ``R``: the positions up to ``R + size``, less the
        ``max(0, R - window) // tpb`` that a sliding window skips."""
        if not self._releasing[i]:
            return _ceil_div(n, self._tpb)
        return peak_live_blocks(
            min(size, n), n, keep=self._windows[i] + size, tokens_per_block=self._tpb
        )

    def _registration(self, request: Request, size: int) -> _Registration:
        """What registering the request's context with a first chunk of ``size`` tokens
        after the reused prefix takes now (the whole context if ``size`` covers it)."""
        n = request.context_len
        nw = len(self._windows)
        reused = 0
        if self._reuse:
            reused = int(self._manager.get_reusable_prefix_length(self._prompt(request)))
        first = min(n, reused + size)
        if reused == 0:
            return _Registration(0, first, [0] * nw, [_ceil_div(first, self._tpb)] * nw)
        cost = self._manager.get_num_blocks_to_allocate(
            self._prompt(request), prefill=None if size >= n else size
        )
        front = [max(0, reused - w) // self._tpb for w in self._windows]
        return _Registration(reused, first, front, [int(cost[w]) for w in self._windows])

    def _shared_releases(self, seq: _SeqState, i: int, target: int) -> int:
        """Blocks of window ``i`` from the released front up to position ``target`` that
        another registered request also holds: releasing them frees nothing."""
        ids = seq.ids[i] if seq.ids else None
        if ids is None:
            return 0
        holders = self._holders[i]
        return sum(1 for j in range(seq.front[i], min(target, len(ids))) if holders[ids[j]] > 1)

    def _prefill_need(self, seq: _SeqState, i: int, size: int, credit: bool) -> int:
        tpb = self._tpb
        n = seq.kv_len
        new = _ceil_div(n + size, tpb) - _ceil_div(n, tpb)
        if not credit:
            return new
        target = _released(n + 1, self._keep[i], tpb)
        freed = max(0, target - seq.front[i]) - self._shared_releases(seq, i, target)
        return max(0, new - freed)

    def _decode_need(self, seq: _SeqState, i: int, tokens: int, credit: bool) -> int:
        tpb = self._tpb
        new = _ceil_div(seq.kv_len + tokens, tpb) - _ceil_div(seq.kv_len, tpb)
        if not credit:
            return new
        live = _ceil_div(seq.kv_len, tpb) - seq.front[i]
        peak = peak_live_blocks(
            seq.kv_len + 1,
            seq.kv_len + tokens,
            keep=self._keep[i],
            tokens_per_block=tpb,
            front=seq.front[i],
        )
        need = max(0, peak - live)
        # Releasing a block that another request holds frees nothing: no credit.
        target = _released(max(seq.hwm, seq.kv_len + tokens), self._keep[i], tpb)
        shared = self._shared_releases(seq, i, target)
        if shared:
            need = min(new, need + shared)
        return need

    def _decode_profile(self, seq: _SeqState, i: int, tokens: int) -> list[int]:
        """Free blocks window ``i`` has lost to ``seq`` after each of its next ``tokens``
        appended tokens (allocations less private releases; negative when it frees)."""
        tpb = self._tpb
        kv = seq.kv_len
        held = _ceil_div(kv, tpb)
        out = []
        for m in range(kv + 1, kv + tokens + 1):
            target = _released(max(seq.hwm, m), self._keep[i], tpb)
            freed = max(0, target - seq.front[i]) - self._shared_releases(seq, i, target)
            out.append(_ceil_div(m, tpb) - held - freed)
        return out

    def _step_total(
        self, gen: Sequence[tuple[Request, int]], chunks: Sequence[tuple[Request, int]]
    ) -> list[int]:
        """Per window: the worst point of a step's generation tokens (summed per
        ``add_tokens`` call) and then its prefill chunks; see
        :meth:`get_needed_blocks_for_step`."""
        out = []
        calls = max((1 + d for _, d in gen), default=0)
        for i in range(len(self._windows)):
            total = [0] * calls
            for r, d in gen:
                profile = self._decode_profile(self._seqs[r.request_id], i, 1 + d)
                for j in range(calls):
                    total[j] += profile[min(j, d)]
            after = total[-1] if total else 0
            prefill = sum(
                self._prefill_need(self._seqs[r.request_id], i, k, True) for r, k in chunks
            )
            out.append(max(0, *total, after + prefill))
        return out

    # --- estimates: to completion

    def _remaining(
        self, request: Request, chunk: int | None, use_reuse: bool, prefill_only: bool
    ) -> list[int]:
        self._check_chunk_size(chunk)
        nw = len(self._windows)
        seq = self._seqs.get(request.request_id)
        if seq is not None:
            final = seq.context_len if prefill_only else request.max_kv_tokens
            return [self._remaining_registered(seq, i, chunk, final) for i in range(nw)]
        if request.state in (RequestState.FINISHED, RequestState.FAILED):
            return [0] * nw
        n = request.context_len
        final = n if prefill_only else request.max_kv_tokens
        size = n if chunk is None else min(chunk, n)
        reg = None if self._reuse and not use_reuse else self._registration(request, size)
        return [self._peak_new(request, i, size, reg, final) for i in range(nw)]

    def _peak_new(
        self, request: Request, i: int, size: int, reg: _Registration | None, final: int
    ) -> int:
        """Free blocks a request not registered yet takes from window ``i`` until it holds
        ``final`` tokens, its prompt prefilled in chunks of at most ``size`` tokens; ``reg``
        is its registration now, ``None`` for the bound over every reused prefix."""
        tpb = self._tpb
        n = request.context_len
        if not self._releasing[i]:
            if reg is None:
                return _ceil_div(final, tpb)
            return reg.cost[i] + max(0, _ceil_div(final, tpb) - _ceil_div(reg.first_end, tpb))
        keep = self._keep[i]
        if reg is None:
            start, front, later = 0, 0, size < n
            peak = self._first_chunk_bound(n, size, i)
        else:
            start, front, later = reg.reused, reg.front[i], reg.first_end < n
            # Holding every position of the first chunk: what it takes plus the reused
            # blocks that running requests hold (their release credits become shared).
            peak = max(reg.cost[i], _ceil_div(reg.first_end, tpb) - front)
        if later:  # later chunks start after the first chunk's first token
            peak = max(peak, _prefill_peak(start + 1, n, size, keep=keep, tpb=tpb, front=front))
        if final > n:
            peak = max(
                peak,
                peak_live_blocks(n + 1, final, keep=keep, tokens_per_block=tpb, front=front),
            )
        return peak

    def _remaining_registered(self, seq: _SeqState, i: int, chunk: int | None, final: int) -> int:
        tpb = self._tpb
        keep = self._keep[i]
        n, front, ctx = seq.kv_len, seq.front[i], seq.context_len
        live = _ceil_div(n, tpb) - front
        if n < ctx:
            size = ctx - n if chunk is None else min(chunk, ctx - n)
            peak = _prefill_peak(n, ctx, size, keep=keep, tpb=tpb, front=front)
            if final > ctx:
                peak = max(
                    peak,
                    peak_live_blocks(ctx + 1, final, keep=keep, tokens_per_block=tpb, front=front),
                )
            return max(0, peak - live)
        if final <= n:
            return 0
        peak = peak_live_blocks(n + 1, final, keep=keep, tokens_per_block=tpb, front=front)
        return max(0, peak - live)

    # --- holdings of shareable blocks

    def _add_holdings(self, seq: _SeqState, start: list[int] | None = None) -> None:
        """Counts ``seq`` as a holder of its context blocks (from ``start`` per window)."""
        for i, ids in enumerate(seq.ids):
            if ids is None:
                continue
            holders = self._holders[i]
            for j in range(seq.front[i] if start is None else start[i], len(ids)):
                b = ids[j]
                c = holders.get(b, 0)
                holders[b] = c + 1
                if c:
                    self._shared[i] += 1

    def _release_holding(self, i: int, block: int) -> None:
        holders = self._holders[i]
        c = holders[block]
        if c == 1:
            del holders[block]
        else:
            holders[block] = c - 1
            self._shared[i] -= 1

    def _drop_holdings(self, seq: _SeqState) -> None:
        for i, ids in enumerate(seq.ids):
            if ids is not None:
                for j in range(seq.front[i], len(ids)):
                    self._release_holding(i, ids[j])

    def _advance_front(self, seq: _SeqState, num_tokens: int) -> None:
        """Records the releases of a sequence that reached ``num_tokens`` tokens."""
        for i, keep in enumerate(self._keep):
            released = _released(num_tokens, keep, self._tpb)
            if released > seq.front[i]:
                ids = seq.ids[i]
                if ids is not None:
                    for j in range(seq.front[i], min(released, len(ids))):
                        self._release_holding(i, ids[j])
                seq.front[i] = released

    # --- mutations

    def _add_sequence(self, request: Request, chunk: int) -> None:
        if request.state not in (RequestState.WAITING, RequestState.PAUSED):
            raise ValueError(
                f"request {request.request_id}: cannot start its context in state "
                f"{request.state.value}"
            )
        tokens = self._prompt(request)
        if request.max_kv_tokens > self._max_seq_len:
            raise ValueError(
                f"request {request.request_id}: prompt {request.prompt_len} + max_new_tokens "
                f"{request.max_new_tokens} - 1 exceeds max_seq_len {self._max_seq_len}"
            )
        n = len(tokens)
        prefill = None if chunk >= n else chunk
        reused = int(
            self._manager.add_sequence(
                request.request_id,
                tokens,
                priority=request.priority,
                prefill=prefill,
            )
        )
        self._prepared.pop(request.request_id, None)
        first = n if prefill is None else min(n, reused + prefill)
        # With reuse, a sliding window gets no block before reused - window.
        front = [max(0, reused - w) // self._tpb for w in self._windows]
        ids: list[list[int] | None] = [None] * len(self._windows)
        if self._reuse:
            for i, w in enumerate(self._windows):
                if self._releasing[i]:
                    ids[i] = list(self._manager.get_cache_block_ids(request.request_id, w))
        seq = _SeqState(kv_len=first, hwm=first, context_len=n, front=front, ids=ids)
        self._add_holdings(seq)
        self._seqs[request.request_id] = seq
        request.reused_tokens = reused
        request.context_position = reused
        request.state = RequestState.CONTEXT

    def _prefill(self, prefills: list[tuple[Request, int]]) -> None:
        """The step's later chunks, in one native call."""
        self._manager.prefill([r.request_id for r, _ in prefills], [chunk for _, chunk in prefills])
        for request, chunk in prefills:
            seq = self._seqs[request.request_id]
            n = seq.kv_len
            self._advance_front(seq, n + 1)  # released before the chunk's blocks came
            seq.kv_len = seq.hwm = n + chunk
            start = [0 if ids is None else len(ids) for ids in seq.ids]
            for i, ids in enumerate(seq.ids):
                if ids is not None:
                    blocks = self._manager.get_cache_block_ids(request.request_id, self._windows[i])
                    ids.extend(int(b) for b in blocks[len(ids) :])
            self._add_holdings(seq, start)

    def _check_prefill(self, request: Request) -> None:
        seq = self._seqs[request.request_id]
        if request.state is not RequestState.CONTEXT or seq.kv_len >= seq.context_len:
            raise ValueError(
                f"request {request.request_id}: no prompt tokens left to prefill (state "
                f"{request.state.value}, {seq.kv_len} of {seq.context_len} context tokens "
                "cached)"
            )
        if request.context_position != seq.kv_len:
            raise ValueError(
                f"request {request.request_id}: context_position is "
                f"{request.context_position} but the cache holds {seq.kv_len} of its "
                f"{seq.context_len} context tokens (call update_resources after every step)"
            )

    def _check_step_fits(
        self, gen: list[tuple[Request, int]], chunks: list[tuple[Request, int]]
    ) -> None:
        """Raises ``OutOfBlocksError`` unless every window holds the step's generation
        tokens and then its prefill chunks (see :meth:`get_needed_blocks_for_step`)."""
        needs = dict(zip(self._windows, self._step_total(gen, chunks), strict=True))
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

    def _check_context_step(self, request: Request, seq: _SeqState) -> None:
        done = seq.kv_len >= seq.context_len
        if request.state is RequestState.CONTEXT and done:
            raise ValueError(
                f"request {request.request_id}: this step's chunk ended its prompt; append "
                "its first generated token before update_resources"
            )
        if request.state is not RequestState.CONTEXT and not done:
            raise ValueError(
                f"request {request.request_id}: a token was appended after a chunk that did "
                f"not end its prompt ({seq.kv_len} of {seq.context_len} context tokens cached; "
                "see ScheduledBatch.is_last_chunk)"
            )

    def _check_generation(self, request: Request, num_draft: int) -> None:
        seq = self._seqs.get(request.request_id)
        if seq is None or request.state is not RequestState.GENERATION:
            raise ValueError(
                f"request {request.request_id}: not in generation (state {request.state.value})"
            )
        if seq.kv_len != request.num_tokens - 1:
            raise ValueError(
                f"request {request.request_id}: the cache holds {seq.kv_len} tokens but the "
                f"request has {request.num_tokens} (expected one more: the newest token)"
            )
        limit = self.num_draft_tokens_for(request)
        if num_draft > limit:
            raise ValueError(
                f"request {request.request_id}: {num_draft} draft tokens, at most {limit} "
                f"allowed (max_draft_tokens {self._max_draft}, "
                f"{request.remaining_new_tokens} tokens left to generate)"
            )

    def _add_tokens(
        self,
        requests: list[Request],
        tokens: list[int],
        grown: list[tuple[Request, int]],
        *,
        first: bool = False,
    ) -> None:
        self._manager.add_tokens([r.request_id for r in requests], tokens)
        if first:
            grown.extend((r, 1) for r in requests)
        else:
            counts = {id(r): i for i, (r, _) in enumerate(grown)}
            for r in requests:
                k = counts[id(r)]
                grown[k] = (r, grown[k][1] + 1)
        for r in requests:
            seq = self._seqs[r.request_id]
            seq.kv_len += 1
            if seq.kv_len > seq.hwm:
                seq.hwm = seq.kv_len
            self._advance_front(seq, seq.hwm)

    def _roll_back(self, added: list[Request], grown: list[tuple[Request, int]]) -> None:
        for request, count in grown:
            self._manager.rewind(request.request_id, count)
            self._seqs[request.request_id].kv_len -= count
        for request in reversed(added):
            self._manager.remove_sequence(request.request_id, store_for_reuse=False)
            self._drop_holdings(self._seqs.pop(request.request_id))
            request.state = RequestState.WAITING if request.num_pauses == 0 else RequestState.PAUSED
            request.reused_tokens = 0
            request.context_position = 0


def _primary(value: Any) -> int:
    return int(value[0]) if isinstance(value, tuple) else int(value)
