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

Block estimates are the native manager's own (``KVCacheManager.get_step_needs``,
``get_remaining_blocks``, ``get_prompt_remaining_blocks``, ...): the manager computes them under
its lock from its real state (block lists, released fronts, reference counts) with the rules of
``block_math.h``, the same rules its calls follow (``keep`` = window + ``max_draft_tokens``; a
full-attention window never releases):

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

A released block that another holder (a running request, a pin) keeps frees nothing, so it is
not credited; :meth:`KVCacheResourceManager.get_num_shared_blocks` counts such extra holdings
from the real reference counts, which the scheduler keeps in reserve. Nothing of the block
state is mirrored here: the resource manager keeps only which requests it registered.

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

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from kvcache import _core as _block_math
from kvcache._core import OutOfBlocksError, PreparedPrompt
from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.manager import KVCacheManager
from kvcache.request import Request, RequestState, ScheduledBatch

__all__ = [
    "KVCacheResourceManager",
    "Request",
    "RequestState",
    "ScheduledBatch",
    "peak_live_blocks",
]


_PREPARED_CACHE_LIMIT = 4096  # prepared contexts kept for requests not yet registered
_DONE = (RequestState.FINISHED, RequestState.FAILED)


class EventPublisher(Protocol):
    """What ``KVCacheResourceManager(..., event_publisher=...)`` calls once per step."""

    def publish(self) -> object:
        """Publishes the events of the step that just ended."""


def peak_live_blocks(lo: int, hi: int, *, keep: int, tokens_per_block: int, front: int = 0) -> int:
    """Most blocks one sequence holds in a window while it grows from ``lo`` to ``hi`` tokens.

    After appending token ``m`` the sequence holds ``ceil(m / tpb) - max(front, R(m))``
    blocks, where ``R(m) = max(0, m - keep) // tpb`` front blocks have left the window
    (``keep`` = window + max_draft_tokens; a full-attention window never releases) and
    ``front`` is what was already released. Computed in O(1) by the native core
    (``kvcache._core.peak_live_blocks``), the rule the manager itself follows.

    Args:
        lo: First length reached (>= 1).
        hi: Last length reached (>= lo).
        keep: Tokens the window keeps (window plus draft allowance).
        tokens_per_block: Block size.
        front: Front blocks already released.

    Returns:
        The maximum, over ``m`` in ``[lo, hi]``, of the blocks held after token ``m``.

    Raises:
        ValueError: ``hi < lo`` or an argument out of range.

    Example:
        Window 6, 4-token blocks: at 13 tokens blocks 1..3 hold positions 4..12 (block 0 left
        the window at 10 tokens); at most 3 blocks are ever held.

        >>> peak_live_blocks(1, 13, keep=6, tokens_per_block=4)
        3
        >>> peak_live_blocks(1, 100, keep=5, tokens_per_block=4)   # 5 = 4 + 1: never 3
        2
    """
    return int(_block_math.peak_live_blocks(lo, hi, keep, tokens_per_block, front))


class KVCacheResourceManager:
    """Drives one :class:`kvcache.KVCacheManager` request by request, step by step.

    Args:
        manager: The KV cache manager (it decides windows, block size and draft allowance).
        event_publisher: Called (``publish()``) once per step at the end of
            :meth:`update_resources`, e.g. a :class:`kvcache.events.ZmqEventPublisher`.

    Raises:
        TypeError: ``manager`` is not a :class:`kvcache.KVCacheManager`.

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
        self._primary = {w: int(_primary(v)) for w, v in manager.blocks_per_window.items()}
        self._running: dict[int, Request] = {}  # registered requests (they hold blocks)
        self._prepared: dict[int, PreparedPrompt] = {}  # waiting requests' contexts
        reuse = getattr(manager, "reuse_enabled", None)
        if reuse is None:
            reuse = getattr(getattr(manager, "config", None), "enable_block_reuse", False)
        self._reuse = bool(reuse)

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
        return request.request_id in self._running

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
        rounds = 0  # add_tokens calls done for the generation requests
        original = list(batch.context)
        prefills: list[tuple[Request, int]] = []
        gen = batch.generation
        try:
            for k, (request, chunk) in enumerate(original):
                if request.request_id in self._running:
                    self._check_prefill(request)
                    prefills.append((request, chunk))
                    continue
                self._add_sequence(request, chunk)
                added.append(request)
                rest = request.context_len - request.context_position
                if chunk > rest:
                    batch.context[k] = (request, rest)
            gen_ids = [r.request_id for r, _ in gen]
            drafts = self._check_generation(gen, gen_ids) if gen else 0
            if prefills:
                self._check_step_fits(gen, prefills)
            if gen:
                add = self._manager.add_tokens
                add(gen_ids, [r.generated[-1] for r, _ in gen])
                rounds = 1
                for j in range(drafts):
                    step = [r for r, d in gen if d > j]
                    add([r.request_id for r in step], [r.draft_tokens[j] for r in step])
                    rounds += 1
        except BaseException:
            self._roll_back(added, gen, rounds)
            batch.context[:] = original
            raise
        if prefills:  # checked above: cannot run out of blocks (one call for the step)
            self._manager.prefill([r.request_id for r, _ in prefills], [k for _, k in prefills])

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
            if request.request_id in self._running:
                self._check_context_step(request)
        for request, d in batch.generation:
            rewind = request.rewind_len
            if rewind:
                if not 0 < rewind <= d:
                    raise ValueError(
                        f"request {request.request_id}: rewind_len {rewind} is not in 0..{d} "
                        "(the drafts verified this step)"
                    )
                self._manager.rewind(request.request_id, rewind)
                request.rewind_len = 0
            if request.draft_tokens:
                request.draft_tokens = []
        ran: list[int] = []
        for request, _ in batch.context:
            rid = request.request_id
            if rid not in self._running:
                continue
            if request.state is RequestState.CONTEXT:
                request.context_position = int(self._manager.num_tokens(rid))
            ran.append(rid)
        if self._reuse and ran:
            self._manager.store_context_blocks(ran)  # every chunk that ran, in one call
        if self._event_publisher is not None:
            self._event_publisher.publish()

    def free_resources(self, request: Request, *, store_for_reuse: bool = True) -> None:
        """Ends the request's sequence and returns its blocks (stored for reuse if enabled)."""
        if request.request_id not in self._running:
            raise KeyError(f"request {request.request_id} holds no KV cache blocks")
        self._manager.remove_sequence(request.request_id, store_for_reuse=store_for_reuse)
        del self._running[request.request_id]

    # ------------------------------------------------------------------ estimates

    def get_num_allocated_blocks(self, request: Request, window_size: int) -> int:
        """Blocks the request holds now in a window (released front blocks not counted)."""
        self._index(window_size)
        if request.request_id not in self._running:
            return 0
        return int(self._manager.get_num_held_blocks(request.request_id, window_size))

    def get_reusable_prefix_length(self, request: Request) -> int:
        """Context tokens that registering the request now would find in the cache (0
        without reuse); for a registered request, what its registration reused.

        A scheduler sizes a first chunk with it: the chunk counts the tokens after this
        prefix.
        """
        if request.request_id in self._running:
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
        running = self._running
        gen = [(r, d) for r, d in batch.generation if r.request_id in running]
        chunks = [
            (r, k)
            for r, k in batch.context
            if r.request_id in running and r.state is RequestState.CONTEXT and self._in_prefill(r)
        ]
        return dict(zip(self._windows, self._step_needs(gen, chunks), strict=True))

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
        alone = self._manager.get_blocks_to_run_alone(
            request.context_len, request.max_kv_tokens, chunk_size=chunk_size
        )
        return dict(zip(self._windows, alone, strict=True))

    def get_num_shared_blocks(self, window_size: int) -> int:
        """Extra holdings of blocks that several registered requests share in a window that
        releases blocks: the sum over such blocks of (holders - 1), holders being requests and
        pins, read from the manager's reference counts; 0 in windows that never release (full
        attention) or without reuse.

        Each holder's estimates credit the release of a shared block, but only the last
        release frees it, so the scheduler keeps this many blocks in reserve.
        """
        self._index(window_size)
        return int(self._manager.get_num_shared_blocks(window_size))

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

    # ------------------------------------------------------------------ batch estimates

    def get_remaining_blocks_for(
        self,
        requests: Sequence[Request],
        *,
        chunk_size: int | None = None,
        prefill_only: bool = False,
    ) -> list[int]:
        """:meth:`get_remaining_blocks_per_window` summed over registered requests, one count
        per window (:attr:`window_sizes` order), in one native call: what
        ``guaranteed_no_evict`` scheduling commits to the running requests.

        Raises:
            KeyError: A request that holds no blocks.
            ValueError: A bad ``chunk_size``.
        """
        self._check_chunk_size(chunk_size)
        for r in requests:
            if r.request_id not in self._running:
                raise KeyError(f"request {r.request_id} holds no KV cache blocks")
        return [
            int(n)
            for n in self._manager.get_remaining_blocks(
                [r.request_id for r in requests],
                [r.max_kv_tokens for r in requests],
                chunk_size=chunk_size,
                prefill_only=prefill_only,
            )
        ]

    def get_needed_blocks_for_plan(
        self, generation: Sequence[tuple[Request, int]], chunks: Sequence[tuple[Request, int]]
    ) -> list[int]:
        """:meth:`get_needed_blocks_for_step` for a step given as ``(request, draft tokens)``
        generation pairs and ``(request, chunk size)`` pairs of registered requests in prefill,
        one count per window (:attr:`window_sizes` order), without building a batch."""
        return self._step_needs(generation, chunks)

    # ------------------------------------------------------------------ internals

    def _forget(self, request: Request) -> None:
        """Drops a request whose sequence the native scheduler removed (a pause)."""
        del self._running[request.request_id]

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

    def _in_prefill(self, request: Request) -> bool:
        rid = request.request_id
        return int(self._manager.num_tokens(rid)) < int(self._manager.prompt_length(rid))

    def _step_needs(
        self, gen: Sequence[tuple[Request, int]], chunks: Sequence[tuple[Request, int]]
    ) -> list[int]:
        return [
            int(n)
            for n in self._manager.get_step_needs(
                [r.request_id for r, _ in gen],
                [1 + d for _, d in gen],
                [r.request_id for r, _ in chunks],
                [k for _, k in chunks],
            )
        ]

    def _needs(
        self, request: Request, chunk: int | None, credit: bool, use_reuse: bool
    ) -> list[int]:
        self._check_chunk_size(chunk)
        rid = request.request_id
        if rid not in self._running:
            if request.state in _DONE:
                return [0] * len(self._windows)
            needs = self._manager.get_prompt_step_needs(
                self._prompt(request),
                chunk_size=chunk,
                credit_releases=credit,
                use_reuse=use_reuse,
            )
            return [int(n) for n in needs]
        if request.state is RequestState.CONTEXT and self._in_prefill(request):
            rest = int(self._manager.prompt_length(rid)) - int(self._manager.num_tokens(rid))
            if chunk is not None and chunk > rest:
                raise ValueError(
                    f"request {rid}: chunk_size {chunk} exceeds the {rest} prompt tokens left"
                )
            needs = self._manager.get_sequence_step_needs(
                rid, rest if chunk is None else chunk, credit_releases=credit
            )
            return [int(n) for n in needs]
        if request.state is RequestState.GENERATION:
            tokens = 1 + self.num_draft_tokens_for(request)
            needs = self._manager.get_sequence_step_needs(rid, tokens, credit_releases=credit)
            return [int(n) for n in needs]
        return [0] * len(self._windows)

    def _remaining(
        self, request: Request, chunk: int | None, use_reuse: bool, prefill_only: bool
    ) -> list[int]:
        self._check_chunk_size(chunk)
        if request.request_id in self._running:
            return self.get_remaining_blocks_for(
                [request], chunk_size=chunk, prefill_only=prefill_only
            )
        if request.state in _DONE:
            return [0] * len(self._windows)
        remaining = self._manager.get_prompt_remaining_blocks(
            self._prompt(request),
            request.max_kv_tokens,
            chunk_size=chunk,
            use_reuse=use_reuse,
            prefill_only=prefill_only,
        )
        return [int(n) for n in remaining]

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
        prefill = None if chunk >= len(tokens) else chunk
        reused = int(
            self._manager.add_sequence(
                request.request_id, tokens, priority=request.priority, prefill=prefill
            )
        )
        self._prepared.pop(request.request_id, None)
        self._manager._set_final_tokens(request.request_id, request.max_kv_tokens)
        self._running[request.request_id] = request
        request.reused_tokens = reused
        request.context_position = reused
        request.state = RequestState.CONTEXT

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

    def _check_generation(self, gen: Sequence[tuple[Request, int]], ids: list[int]) -> int:
        """Checks a batch's generation requests (state, registration and cached length in one
        native call, drafts); returns the most drafts of any."""
        generation = RequestState.GENERATION
        lengths = [len(r.prompt) + len(r.generated) - 1 for r, _ in gen]
        k = int(self._manager._first_length_mismatch(ids, lengths))
        if k < 0 and [r for r, _ in gen if r.state is not generation]:
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
        most = max(d for _, d in gen)
        if most:
            for request, num_draft in gen:
                limit = self.num_draft_tokens_for(request)
                if num_draft > limit:
                    raise ValueError(
                        f"request {request.request_id}: {num_draft} draft tokens, at most "
                        f"{limit} allowed (max_draft_tokens {self._max_draft}, "
                        f"{request.remaining_new_tokens} tokens left to generate)"
                    )
        return most

    def _roll_back(
        self, added: list[Request], gen: Sequence[tuple[Request, int]], rounds: int
    ) -> None:
        """Undoes a failed prepare_resources: the tokens of the ``rounds`` add_tokens calls
        that ran (the newest tokens, then one draft position each), then the registrations."""
        if rounds:
            for request, d in gen:
                self._manager.rewind(request.request_id, 1 + min(d, rounds - 1))
        for request in reversed(added):
            self._manager.remove_sequence(request.request_id, store_for_reuse=False)
            del self._running[request.request_id]
            request.state = RequestState.WAITING if request.num_pauses == 0 else RequestState.PAUSED
            request.reused_tokens = 0
            request.context_position = 0


def _primary(value: Any) -> int:
    return int(value[0]) if isinstance(value, tuple) else int(value)
