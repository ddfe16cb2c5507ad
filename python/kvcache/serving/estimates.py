"""The estimates a scheduler asks for, per request and per step, of
:class:`kvcache.resource_manager.KVCacheResourceManager` (a mixin of it).

Every count is the native manager's own (``KVCacheManager.get_step_needs``,
``get_remaining_blocks``, ``get_prompt_remaining_blocks``, ...), computed from its real state;
this module only maps requests to those calls. See :mod:`kvcache.resource_manager`.

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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvcache import _core as _block_math
from kvcache._core import PreparedPrompt
from kvcache.cache.fields import check_type, is_int
from kvcache.cache.manager import KVCacheManager
from kvcache.serving.families import unforked_beams
from kvcache.serving.request import Request, RequestState, ScheduledBatch

__all__ = ["ResourceEstimates", "peak_live_blocks"]

_PREPARED_CACHE_LIMIT = 4096  # prepared contexts kept for requests not yet registered
_DONE = (RequestState.FINISHED, RequestState.FAILED)


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


def _as_dict(blocks: Mapping[int, int]) -> Any:
    """A mapping as a dict for the core; anything else as is, for the core's ValueError."""
    return dict(blocks) if isinstance(blocks, Mapping) else blocks


class ResourceEstimates:
    """Per-window block estimates for requests: the estimate half of the resource manager.

    Attributes used (set by :class:`kvcache.resource_manager.KVCacheResourceManager`):
    ``_manager``, ``_windows``, ``_tpb``, ``_max_draft``, ``_reuse``, ``_running``,
    ``_prepared``, ``_forked``, ``_primary``.
    """

    _manager: KVCacheManager
    _windows: list[int]
    _tpb: int
    _max_draft: int
    _reuse: bool
    _running: dict[int, Request]
    _prepared: dict[int, PreparedPrompt]
    _forked: set[int]
    _primary: dict[int, int]

    def num_draft_tokens_for(self, request: Request) -> int:
        """Drafts usable in the request's next step: at most its drafts, the manager's
        allowance and one less than the tokens it still has to generate."""
        check_type("request", request, Request)
        return max(
            0, min(len(request.draft_tokens), self._max_draft, request.remaining_new_tokens - 1)
        )

    # ------------------------------------------------------------------ pool queries

    def num_primary_blocks(self, window_size: int) -> int:
        """Primary blocks of a window's pool (its initial blocks under ``lend_free_memory``;
        ``manager.blocks_per_window`` has what it owns now)."""
        if window_size not in self._primary:
            raise ValueError(
                f"window_size {window_size!r} is not one of this manager's windows {self._windows}"
            )
        return self._primary[window_size]

    def get_num_used_blocks(self, window_size: int) -> int:
        """Primary blocks of a window that requests (or pins) hold now."""
        return int(self._manager.get_num_used_blocks(window_size))

    def can_allocate(self, blocks: Mapping[int, int]) -> bool:
        """Whether every window can hand out ``blocks[window]`` blocks at once now (a
        negative count is a credit: the window frees that many first). Per window this is
        ``blocks[w] <= get_num_free_blocks(w)``; under ``lend_free_memory`` the windows also
        compete for the memory they can borrow, which only this joint check sees."""
        return bool(self._manager.can_allocate(_as_dict(blocks)))

    def fits_when_empty(self, blocks: Mapping[int, int]) -> bool:
        """Whether the pools could hold ``blocks[window]`` blocks of every window at once if
        nothing else held any (under ``lend_free_memory``: in the whole shared memory)."""
        return bool(self._manager.fits_when_empty(_as_dict(blocks)))

    # ------------------------------------------------------------------ estimates

    def get_num_allocated_blocks(self, request: Request, window_size: int) -> int:
        """Blocks the request holds now in a window (released front blocks not counted)."""
        check_type("request", request, Request)
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
        check_type("request", request, Request)
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
        check_type("request", request, Request)
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
        check_type("request", request, Request)
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
        check_type("batch", batch, ScheduledBatch)
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

        A request with ``num_beams`` or ``n`` = ``k > 1`` is charged, besides its own sequence,
        ``k - 1`` beams forked from its prompt (from its current length once registered), each
        ``KVCacheManager.get_forked_beam_blocks``: its copy of the shared partial block and the
        blocks its own tokens start. The prompt's shared blocks are counted once.

        Example:
            Window 8, 4-token blocks, a 10-token prompt generating 20 tokens (29 cached at
            most): 3 blocks at registration and never more than 3 in the window (8 tokens
            span at most 3 blocks), so 3 before it starts; the 64-token window needs
            ``ceil(29 / 4) = 8``.
        """
        check_type("request", request, Request)
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
        check_type("request", request, Request)
        remaining = self._remaining(request, chunk_size, use_reuse, prefill_only)
        return dict(zip(self._windows, remaining, strict=True))

    def get_blocks_to_run_alone(
        self, request: Request, *, chunk_size: int | None = None
    ) -> dict[int, int]:
        """Per window, the most blocks the request holds from registration to completion
        without reuse, its prompt prefilled in chunks of at most ``chunk_size`` tokens
        (``None``: whole): what it needs from an otherwise empty pool (the scheduler rejects
        a request for which this exceeds a window's pool)."""
        check_type("request", request, Request)
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
        for r in requests:
            check_type("request", r, Request)
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
        if chunk_size is not None and (not is_int(chunk_size) or chunk_size < 1):
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
            own = self.get_remaining_blocks_for(
                [request], chunk_size=chunk, prefill_only=prefill_only
            )
            fork_at = int(self._manager.num_tokens(request.request_id))
        elif request.state in _DONE:
            return [0] * len(self._windows)
        else:
            remaining = self._manager.get_prompt_remaining_blocks(
                self._prompt(request),
                request.max_kv_tokens,
                chunk_size=chunk,
                use_reuse=use_reuse,
                prefill_only=prefill_only,
            )
            own = [int(n) for n in remaining]
            fork_at = request.context_len
        extra = unforked_beams(request)  # 0 once forked (in a family), also after a pause
        if extra == 0 or prefill_only or request.request_id in self._forked:
            return own
        # The other beams fork from the prompt: each takes its own blocks, never the shared ones.
        beams = self._manager.get_forked_beam_blocks(fork_at, request.max_kv_tokens)
        return [a + extra * int(b) for a, b in zip(own, beams, strict=True)]
