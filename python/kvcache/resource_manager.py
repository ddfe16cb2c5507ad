"""Request-level KV cache management for an inference engine's step loop.

An engine step looks like this::

    batch = scheduler.schedule(active_requests).batch      # kvcache.scheduler
    resource_manager.prepare_resources(batch)              # blocks for this step
    ... run the model; append generated tokens; set request.rewind_len ...
    resource_manager.update_resources(batch)               # rewind rejected drafts
    for r in finished: resource_manager.free_resources(r)

Token accounting: after a request's context step the cache holds its prompt (plus, for a
resumed request, the tokens it had generated before it was paused) and the step produces
one new token. Each generation step appends the newest generated token (its KV is
computed in that step) plus any draft tokens, so between steps the cache holds
``num_tokens - 1`` tokens: the newest generated token is not cached yet. A request that
generates ``max_new_tokens`` tokens therefore peaks at ``prompt_len + max_new_tokens - 1``
cached tokens (plus nothing for drafts, which are capped at what is left to generate).

Block estimates follow the native manager's rules exactly: a prompt takes
``ceil(len / tokens_per_block)`` blocks in every window; every appended token that starts
a block takes one more block in every window; and after each appended token a sliding
window ``w`` releases the front blocks whose positions are all below
``num_tokens - w - max_draft_tokens`` (released before anything is allocated).

With block reuse on, a prompt's registration takes exactly what
``KVCacheManager.get_num_blocks_to_allocate`` says (blocks that other running requests hold
cost nothing), and a sliding window ``w`` gets no block for the first
``max(0, R - w) // tokens_per_block`` positions, ``R`` being the reused length. A block of a
sliding window that several running requests share is freed only when its last holder
releases it; the estimates credit releases per request, so
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
    >>> r.append_tokens([100])        # the engine's output for the context step
    >>> rm.update_resources(batch)
    >>> rm.get_num_allocated_blocks(r, 8), rm.get_num_free_blocks()
    (3, 13)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.manager import KVCacheManager

__all__ = [
    "KVCacheResourceManager",
    "Request",
    "RequestState",
    "ScheduledBatch",
    "peak_live_blocks",
]


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
        context_position: Prompt tokens (of :meth:`context_tokens`) already processed.
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

    Context entries carry the chunk of the prompt processed in this step (the first chunk
    registers the whole prompt with the cache); generation entries carry the number of
    draft tokens verified in this step.

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


@dataclass
class _SeqState:
    """What the resource manager knows about a request registered with the manager."""

    kv_len: int  # tokens in the cache
    hwm: int  # most tokens the cache ever held for it (sliding windows release by this)
    front: list[int]  # released (or never allocated) front blocks per window (ascending)
    # With reuse: the block ids of the positions registered by add_sequence, per window
    # that can release blocks (None elsewhere). Only these can be shared with other
    # requests; blocks of generated tokens are private while the request runs.
    ids: list[list[int] | None] = field(default_factory=list)


# --------------------------------------------------------------------------------------
# Resource manager
# --------------------------------------------------------------------------------------


class KVCacheResourceManager:
    """Drives one :class:`kvcache.KVCacheManager` request by request, step by step.

    Args:
        manager: The KV cache manager (it decides windows, block size and draft allowance).

    Example:
        See the module docstring.
    """

    def __init__(self, manager: KVCacheManager) -> None:
        self._manager = manager
        self._windows: list[int] = list(manager.window_sizes)
        self._tpb: int = int(manager.tokens_per_block)
        self._max_seq_len: int = int(manager.max_seq_len)
        self._max_draft: int = int(getattr(manager, "max_draft_tokens", 0))
        self._keep = [w + self._max_draft for w in self._windows]
        self._primary = {w: int(_primary(v)) for w, v in manager.blocks_per_window.items()}
        self._seqs: dict[int, _SeqState] = {}
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
        """Primary blocks of a window's pool."""
        return self._primary[window_size]

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
        ``add_sequence``; later chunks need nothing. Generation requests append their newest
        generated token in one ``add_tokens`` call for the whole batch, then their draft
        tokens (one ``add_tokens`` call per draft position).

        Raises:
            ValueError: A request in the wrong state, or whose cached length disagrees with
                its generated tokens.
            OutOfBlocksError: Some window lacks blocks; nothing was changed.
        """
        added: list[Request] = []
        grown: list[tuple[Request, int]] = []  # (request, tokens appended so far)
        try:
            for request, _ in batch.context:
                if request.context_position > 0:
                    continue  # a later chunk: the whole prompt was registered by the first
                self._add_sequence(request)
                added.append(request)
            gen = batch.generation
            if gen:
                for request, d in gen:
                    self._check_generation(request, d)
                self._add_tokens(
                    [r for r, _ in gen], [r.generated[-1] for r, _ in gen], grown, first=True
                )
                for j in range(max(d for _, d in gen)):
                    step = [r for r, d in gen if d > j]
                    self._add_tokens(step, [r.draft_tokens[j] for r in step], grown)
        except BaseException:
            self._roll_back(added, grown)
            raise

    def update_resources(self, batch: ScheduledBatch) -> None:
        """After the step: drops rejected draft tokens (``request.rewind_len``) and, with
        block reuse on, stores finished prompts' blocks for early reuse by other requests."""
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
        store = getattr(self._manager, "store_context_blocks", None)
        if self._reuse and store is not None:
            for request, _ in batch.context:
                if request.request_id in self._seqs and request.state is not RequestState.CONTEXT:
                    store(request.request_id)

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

    def get_needed_blocks_one_step(
        self,
        request: Request,
        window_size: int,
        *,
        credit_releases: bool = False,
        use_reuse: bool = True,
    ) -> int:
        """Free blocks the request's next step takes from a window.

        * a context request's first chunk: the blocks registering its whole
          :meth:`Request.context_tokens` take, ``ceil(len / tokens_per_block)`` without reuse;
          with reuse on (and ``use_reuse``) exactly ``get_num_blocks_to_allocate`` of the
          manager now (reused blocks held by running requests cost nothing, a sliding
          window needs nothing before ``reused - window``);
        * a generation request: the new blocks its newest token and its usable drafts
          (:meth:`num_draft_tokens_for`) start;
        * anything else: 0.

        With ``credit_releases`` the blocks its sliding windows release during the step are
        subtracted (at the step's worst point), which is what the step really takes from
        the free pool; the native ``add_tokens`` credits them the same way. A released block
        that another running request also holds frees nothing and is not credited.
        ``use_reuse=False`` gives the estimate without reuse, an upper bound whatever the
        cache holds by the time the request registers.

        Example:
            A request holding 10 tokens at a 4-token block size holds 3 blocks; its next token
            is the 11th and needs no block; with 2 drafts it would write the 13th and need one.
        """
        i = self._index(window_size)
        seq = self._seqs.get(request.request_id)
        if seq is None:
            if request.state in (RequestState.FINISHED, RequestState.FAILED):
                return 0
            return self._registration(request, use_reuse)[1][i]
        return self._step_need(request, seq, i, credit_releases)

    def get_needed_blocks_per_window(
        self, request: Request, *, credit_releases: bool = False, use_reuse: bool = True
    ) -> dict[int, int]:
        """:meth:`get_needed_blocks_one_step` for every window (one reuse lookup)."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            if request.state in (RequestState.FINISHED, RequestState.FAILED):
                return dict.fromkeys(self._windows, 0)
            cost = self._registration(request, use_reuse)[1]
            return dict(zip(self._windows, cost, strict=True))
        return {
            w: self._step_need(request, seq, i, credit_releases)
            for i, w in enumerate(self._windows)
        }

    def get_remaining_blocks_to_completion(
        self, request: Request, window_size: int, *, use_reuse: bool = True
    ) -> int:
        """Free blocks the request may still take from a window before it finishes.

        The peak of the blocks it will hold (its whole context at registration, then the
        blocks covering the window plus what is being written as it grows to
        :attr:`Request.max_kv_tokens`) minus what it holds now. A sliding window never needs
        more than ``ceil(keep / tokens_per_block) + 1`` blocks once the sequence is longer
        than ``keep`` = window + ``max_draft_tokens``. Releases are credited: the sum of this
        over running requests plus :meth:`get_num_shared_blocks` never exceeds the free
        blocks, which is what ``guaranteed_no_evict`` scheduling keeps true.

        With reuse on (and ``use_reuse``), a request not registered yet is charged what
        registering takes now (``get_num_blocks_to_allocate``) plus its growth; in a window
        that releases blocks, reused blocks that running requests hold are charged too,
        because sharing them adds to :meth:`get_num_shared_blocks` (their holders' release
        credits become void). In isolation this is exactly the peak of the free blocks taken.

        Example:
            Window 8, 4-token blocks, a 10-token prompt generating 20 tokens (29 cached at
            most): 3 blocks at registration and never more than 3 in the window (8 tokens
            span at most 3 blocks), so 3 before it starts; the 64-token window needs
            ``ceil(29 / 4) = 8``.
        """
        i = self._index(window_size)
        seq = self._seqs.get(request.request_id)
        if seq is None:
            if request.state in (RequestState.FINISHED, RequestState.FAILED):
                return 0
            front, cost = self._registration(request, use_reuse)
            return self._remaining_new(request, i, front[i], cost[i])
        return self._remaining_registered(request, seq, i)

    def get_remaining_blocks_per_window(
        self, request: Request, *, use_reuse: bool = True
    ) -> dict[int, int]:
        """:meth:`get_remaining_blocks_to_completion` for every window (one reuse lookup)."""
        seq = self._seqs.get(request.request_id)
        if seq is None:
            if request.state in (RequestState.FINISHED, RequestState.FAILED):
                return dict.fromkeys(self._windows, 0)
            front, cost = self._registration(request, use_reuse)
            return {
                w: self._remaining_new(request, i, front[i], cost[i])
                for i, w in enumerate(self._windows)
            }
        return {w: self._remaining_registered(request, seq, i) for i, w in enumerate(self._windows)}

    def get_blocks_to_run_alone(self, request: Request) -> dict[int, int]:
        """Per window, the most blocks the request holds from registration to completion
        without reuse: what it needs from an otherwise empty pool (the scheduler rejects a
        request for which this exceeds a window's pool)."""
        nb = _ceil_div(request.context_len, self._tpb)
        return {w: self._remaining_new(request, i, 0, nb) for i, w in enumerate(self._windows)}

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

    def _reuse_kwargs(self, request: Request) -> dict[str, Any]:
        return {
            "lora_task_id": request.lora_task_id,
            "cache_salt": request.cache_salt,
            "multimodal": request.multimodal,
        }

    def _registration(self, request: Request, use_reuse: bool) -> tuple[list[int], list[int]]:
        """(front, cost) per window of registering the request's context now: the leading
        positions that get no block, and the free blocks taken."""
        nb = _ceil_div(request.context_len, self._tpb)
        k = len(self._windows)
        if not self._reuse:
            return [0] * k, [nb] * k
        if not use_reuse:
            # Whatever the cache holds then: at most one free block per position.
            return [0] * k, [nb] * k
        tokens = request.context_tokens()
        kwargs = self._reuse_kwargs(request)
        reused = int(self._manager.get_reusable_prefix_length(tokens, **kwargs))
        if reused == 0:
            return [0] * k, [nb] * k
        cost = self._manager.get_num_blocks_to_allocate(tokens, **kwargs)
        front = [max(0, reused - w) // self._tpb for w in self._windows]
        return front, [int(cost[w]) for w in self._windows]

    def _remaining_new(self, request: Request, i: int, front: int, cost: int) -> int:
        tpb = self._tpb
        n = request.context_len
        nb = _ceil_div(n, tpb)
        final = request.max_kv_tokens
        if not self._releasing[i]:
            return cost + max(0, _ceil_div(final, tpb) - nb)
        # Holding nb - front blocks after registration: what it takes plus the reused blocks
        # that running requests hold (their release credits become shared holdings).
        peak = nb - front
        if final > n:
            peak = max(
                peak,
                peak_live_blocks(
                    n + 1, final, keep=self._keep[i], tokens_per_block=tpb, front=front
                ),
            )
        return max(peak, cost)

    def _remaining_registered(self, request: Request, seq: _SeqState, i: int) -> int:
        tpb = self._tpb
        final = request.max_kv_tokens
        if final <= seq.kv_len:
            return 0
        live = _ceil_div(seq.kv_len, tpb) - seq.front[i]
        peak = peak_live_blocks(
            seq.kv_len + 1, final, keep=self._keep[i], tokens_per_block=tpb, front=seq.front[i]
        )
        return max(0, peak - live)

    def _step_need(self, request: Request, seq: _SeqState, i: int, credit_releases: bool) -> int:
        if request.state is not RequestState.GENERATION:
            return 0
        tpb = self._tpb
        k = 1 + self.num_draft_tokens_for(request)
        new = _ceil_div(seq.kv_len + k, tpb) - _ceil_div(seq.kv_len, tpb)
        if not credit_releases:
            return new
        live = _ceil_div(seq.kv_len, tpb) - seq.front[i]
        peak = peak_live_blocks(
            seq.kv_len + 1,
            seq.kv_len + k,
            keep=self._keep[i],
            tokens_per_block=tpb,
            front=seq.front[i],
        )
        need = max(0, peak - live)
        ids = seq.ids[i] if seq.ids else None
        if ids is not None:
            # Releasing a block that another request holds frees nothing: no credit.
            target = min(_released(max(seq.hwm, seq.kv_len + k), self._keep[i], tpb), len(ids))
            holders = self._holders[i]
            shared = sum(1 for j in range(seq.front[i], target) if holders[ids[j]] > 1)
            if shared:
                need = min(new, need + shared)
        return need

    def _add_holdings(self, seq: _SeqState) -> None:
        for i, ids in enumerate(seq.ids):
            if ids is None:
                continue
            holders = self._holders[i]
            for j in range(seq.front[i], len(ids)):
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

    def _add_sequence(self, request: Request) -> None:
        if request.state not in (RequestState.WAITING, RequestState.PAUSED):
            raise ValueError(
                f"request {request.request_id}: cannot start its context in state "
                f"{request.state.value}"
            )
        tokens = request.context_tokens()
        if request.max_kv_tokens > self._max_seq_len:
            raise ValueError(
                f"request {request.request_id}: prompt {request.prompt_len} + max_new_tokens "
                f"{request.max_new_tokens} - 1 exceeds max_seq_len {self._max_seq_len}"
            )
        reused = int(
            self._manager.add_sequence(
                request.request_id,
                tokens,
                priority=request.priority,
                **self._reuse_kwargs(request),
            )
        )
        # With reuse, a sliding window gets no block before reused - window.
        front = [max(0, reused - w) // self._tpb for w in self._windows]
        ids: list[list[int] | None] = [None] * len(self._windows)
        if self._reuse:
            for i, w in enumerate(self._windows):
                if self._releasing[i]:
                    ids[i] = list(self._manager.get_cache_block_ids(request.request_id, w))
        seq = _SeqState(len(tokens), len(tokens), front, ids)
        self._add_holdings(seq)
        self._seqs[request.request_id] = seq
        request.reused_tokens = reused
        request.state = RequestState.CONTEXT

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
            for i, keep in enumerate(self._keep):
                released = _released(seq.hwm, keep, self._tpb)
                if released > seq.front[i]:
                    ids = seq.ids[i]
                    if ids is not None:
                        for j in range(seq.front[i], min(released, len(ids))):
                            self._release_holding(i, ids[j])
                    seq.front[i] = released

    def _roll_back(self, added: list[Request], grown: list[tuple[Request, int]]) -> None:
        for request, count in grown:
            self._manager.rewind(request.request_id, count)
            self._seqs[request.request_id].kv_len -= count
        for request in reversed(added):
            self._manager.remove_sequence(request.request_id, store_for_reuse=False)
            self._drop_holdings(self._seqs.pop(request.request_id))
            request.state = RequestState.WAITING if request.num_pauses == 0 else RequestState.PAUSED
            request.reused_tokens = 0


def _primary(value: Any) -> int:
    return int(value[0]) if isinstance(value, tuple) else int(value)
