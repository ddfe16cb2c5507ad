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

Block estimates are the native manager's own, computed from its real state with the rules its
calls follow (see :mod:`kvcache.estimates`). Nothing of the block state is mirrored here: the
resource manager keeps only which requests it registered.

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

from collections import deque
from collections.abc import Mapping, Sequence
from operator import attrgetter, itemgetter
from typing import Any, Protocol

import numpy as np

from kvcache._core import PreparedPrompt
from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.fields import MAX_TOKEN, check_type
from kvcache.cache.manager import KVCacheManager
from kvcache.serving.estimates import ResourceEstimates, peak_live_blocks
from kvcache.serving.forks import ForkResources
from kvcache.serving.request import Request, RequestState, ScheduledBatch
from kvcache.serving.step_checks import StepChecks

__all__ = [
    "KVCacheResourceManager",
    "Request",
    "RequestState",
    "ScheduledBatch",
    "peak_live_blocks",
]


class EventPublisher(Protocol):
    """What ``KVCacheResourceManager(..., event_publisher=...)`` calls once per step."""

    def publish(self) -> object:
        """Publishes the events of the step that just ended."""


class KVCacheResourceManager(ResourceEstimates, StepChecks, ForkResources):
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
        if not isinstance(manager, KVCacheManager):
            raise TypeError(
                f"manager must be a kvcache.KVCacheManager, got {type(manager).__name__}"
            )
        self._manager = manager
        self._event_publisher = event_publisher
        self._windows: list[int] = list(manager.window_sizes)
        self._tpb: int = int(manager.tokens_per_block)
        self._max_seq_len: int = int(manager.max_seq_len)
        self._max_draft: int = int(getattr(manager, "max_draft_tokens", 0))
        self._primary = {w: int(_primary(v)) for w, v in manager.blocks_per_window.items()}
        self._running: dict[int, Request] = {}  # registered requests (they hold blocks)
        # Bumped whenever _running changes: the scheduler's caches of it are valid while equal.
        self._epoch = 0
        # Registered request id -> its prompt length less one (a decode step's cached length
        # is that plus its generated tokens), read once at registration. Changed with
        # _running, so both keep the same order.
        self._base_of: dict[int, int] = {}
        self._forked: set[int] = set()  # requests whose beams were forked (fork_resources)
        self._prepared: dict[int, PreparedPrompt] = {}  # waiting requests' contexts
        # What the scheduler knows of the generation entries of the batch it just built (see
        # _note_generation); prepare_resources uses it only if the entries are unchanged.
        self._gen_note: _GenerationNote | None = None
        self._gen_ran: _GenerationNote | None = None  # the note of the last prepared batch
        # The batch prepare_resources prepared last, until its step is updated: complete_step
        # takes only that batch, whose requests prepare_resources checked.
        self._prepared_batch: ScheduledBatch | None = None
        reuse = getattr(manager, "reuse_enabled", None)
        if reuse is None:
            reuse = getattr(getattr(manager, "config", None), "enable_block_reuse", False)
        self._reuse = bool(reuse)
        # Recurrent state groups: the checkpoints a step ends at are copied after it ran.
        self._states = int(getattr(manager, "num_state_groups", 0)) > 0

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

    def has_request(self, request: Request) -> bool:
        """True while the request holds blocks."""
        check_type("request", request, Request)
        return request.request_id in self._running

    # ------------------------------------------------------------------ step hooks

    def prepare_resources(
        self, batch: ScheduledBatch, *, next_tokens: Sequence[int] | None = None
    ) -> None:
        """Gives every request of the batch the blocks its step needs; all or nothing.

        ``next_tokens`` (the batch form): the newest generated token of each generation
        request, in ``batch.generation`` order, as a sequence or 1-D integer array (the
        model's sampled tokens). The manager appends those instead of each request's
        ``generated[-1]`` and checks the requests natively (registered, decoding), so nothing
        is read from the request objects per request; without it every request's state and
        cached length are checked against its ``generated`` tokens.

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
                generated tokens, or whose ``context_position`` disagrees with the cache;
                ``next_tokens`` not one per generation request.
            KeyError: (with ``next_tokens``) a generation request that holds no blocks.
            OutOfBlocksError: Some window lacks blocks; nothing was changed.
            TypeError: ``batch`` is not a :class:`ScheduledBatch`.
        """
        check_type("batch", batch, ScheduledBatch)
        if next_tokens is not None and len(next_tokens) != len(batch.generation):
            raise ValueError(
                f"next_tokens has {len(next_tokens)} tokens for {len(batch.generation)} "
                "generation requests: give one per request, in batch.generation order"
            )
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
            note, self._gen_note = self._gen_note, None
            if note is not None and note[0] is gen and gen == note[1]:  # as scheduled
                self._gen_ran = note  # for update_resources: the same entries' requests
                gen_ids = note[2]
                drafts = self._check_drafts(gen) if note[3] else 0
                if next_tokens is None and gen and not prefills and self._add_noted(note):
                    rounds = 1  # checked and added in one native call
            else:
                gen_ids = [r.request_id for r, _ in gen]
                drafts = self._check_drafts(gen) if gen else 0
            if gen and not rounds:
                if next_tokens is None:
                    self._check_generation(gen, gen_ids)
                if prefills:
                    self._check_step_fits(gen, prefills)
                newest = [r.generated[-1] for r, _ in gen] if next_tokens is None else next_tokens
                self._manager.add_tokens(gen_ids, newest)
                rounds = 1
            elif prefills:
                self._check_step_fits(gen, prefills)
            if gen:
                add = self._manager.add_tokens
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
        self._prepared_batch = batch

    def update_resources(self, batch: ScheduledBatch) -> None:
        """After the step: advances the context requests (``context_position``), drops
        rejected draft tokens (``request.rewind_len``) and, with block reuse on, stores the
        full blocks of every prompt chunk that ran for early reuse by other requests (one
        ``store_context_blocks`` call for the batch). With recurrent state groups, first
        copies every working state into the checkpoint its step ended at
        (``save_checkpoints``).

        Raises:
            ValueError: A context request whose chunk ended its prompt got no generated
                token, or one whose chunk did not end its prompt got one; a bad
                ``rewind_len``.
            TypeError: ``batch`` is not a :class:`ScheduledBatch`.
        """
        check_type("batch", batch, ScheduledBatch)
        self._update(batch, None)

    def _update(self, batch: ScheduledBatch, drafts: bool | None) -> None:
        """update_resources' work; ``drafts``: whether some generation entry rewinds or
        holds draft tokens (``None``: read from the requests)."""
        self._prepared_batch = None
        if self._states:
            # The forward pass ended each working state where its step's checkpoints are taken.
            self._manager.save_checkpoints()
        for request, _ in batch.context:
            if request.request_id in self._running:
                self._check_context_step(request)
        gen = batch.generation
        if drafts is None:
            ran_note, self._gen_ran = self._gen_ran, None
            if ran_note is not None and ran_note[0] is gen and gen == ran_note[1]:
                requests = ran_note[4]  # the entries prepare_resources ran, unchanged
            else:
                requests = [r for r, _ in gen]
            drafts = any([r.rewind_len or r.draft_tokens for r in requests])
        else:
            self._gen_ran = None
        for request, d in gen if drafts else ():
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

    def complete_step(
        self,
        batch: ScheduledBatch,
        tokens: Sequence[int] | np.ndarray,
        *,
        accepted: Sequence[int] | np.ndarray | None = None,
        store_for_reuse: bool = True,
    ) -> list[Request]:
        """The output side of a step in one call: applies the sampled tokens, runs
        :meth:`update_resources`, frees the requests that finished and returns them.

        ``batch`` must be the batch :meth:`prepare_resources` prepared last (it checked its
        requests), completed once. ``tokens`` holds one entry per batch entry, context entries
        first, then generation entries, each in batch order (``len(tokens) == len(batch)``),
        as a sequence or 1-D integer array: the token sampled for that entry, or a negative
        value where the entry sampled nothing (a context chunk that did not end its prompt;
        such an entry must be negative, every other one a token id ``0 <= t < 2**31``).
        ``accepted`` (speculative decoding): per generation entry, how many of the draft tokens
        it verified this step were accepted (``0..num_draft_tokens``); they are appended
        before the entry's token and the rest are rewound (:attr:`Request.rewind_len`).
        Without it no draft is accepted.

        The same as ``append_tokens`` on every sampling entry, ``update_resources(batch)`` and
        ``free_resources(r, store_for_reuse=...)`` for every request that reached
        ``max_new_tokens``, with the tokens checked once for the whole batch and the finished
        requests found by the manager (the sequences that reached the final length their
        registration recorded), so that a decode entry costs one list append here. A bad
        ``tokens`` or ``accepted``, or a batch that was not prepared, raises before anything
        changes. Mixing the two forms in one step (``append_tokens`` on a request, then
        ``complete_step``) is not supported.

        Example:
            >>> from kvcache import KvCacheConfig, ModelConfig
            >>> model = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8)
            >>> config = KvCacheConfig(tokens_per_block=4, backend="virtual")
            >>> rm = KVCacheResourceManager.from_blocks(model, config, {64: 16},
            ...                                         max_seq_len=64, max_batch_size=4)
            >>> a, b = Request(1, [1, 2, 3], 2), Request(2, [4, 5, 6, 7, 8], 1)
            >>> batch = ScheduledBatch()
            >>> batch.add_context(a); batch.add_context(b, 3)
            >>> rm.prepare_resources(batch)
            >>> rm.complete_step(batch, [10, -1])   # b's chunk did not end its prompt
            []
            >>> a.generated, a.state.value, b.context_position
            ([10], 'generation', 3)
            >>> batch = ScheduledBatch()
            >>> batch.add_context(b); batch.add_generation(a)
            >>> rm.prepare_resources(batch)
            >>> [r.request_id for r in rm.complete_step(batch, [20, 11])]
            [2, 1]
            >>> a.generated, b.generated, a.state.value, rm.has_request(a)
            ([10, 11], [20], 'finished', False)

        Returns:
            The requests that finished in this step (state ``FINISHED``, blocks freed):
            context entries first, then generation entries, in batch order.

        Raises:
            ValueError: ``batch`` is not the one prepared last, or was completed already;
                ``tokens`` or ``accepted`` of the wrong length, not integers or out of
                range; a token missing for an entry that must sample or given for one that
                must not; a request whose generated tokens disagree with the cache.
            TypeError: ``batch`` is not a :class:`ScheduledBatch`.
        """
        check_type("batch", batch, ScheduledBatch)
        if batch is not self._prepared_batch:
            raise ValueError(
                "complete_step: this batch is not the one prepare_resources prepared last, or "
                "its step was completed already: call prepare_resources(batch) before the "
                "step and complete_step(batch, tokens) once after it"
            )
        ctx, gen = batch.context, batch.generation
        toks = _token_list("tokens", tokens, len(ctx) + len(gen))
        # Context entries: few per step; the sampling ones are the chunks that end a prompt.
        sampled_ctx: list[tuple[Request, int]] = []
        for k, (request, chunk) in enumerate(ctx):
            t = toks[k]
            if (request.context_position + chunk >= request.context_len) != (t >= 0):
                raise ValueError(
                    f"tokens[{k}] = {t}: request {request.request_id}'s chunk "
                    + (
                        "does not end its prompt, so its entry must be negative"
                        if t >= 0
                        else "ends its prompt, so it must sample a token"
                    )
                )
            if t >= 0:
                sampled_ctx.append((request, t))
        gen_toks = toks[len(ctx) :]
        if gen_toks and min(gen_toks) < 0:
            k = next(i for i, t in enumerate(gen_toks) if t < 0)
            raise ValueError(
                f"tokens[{len(ctx) + k}] = {gen_toks[k]}: generation request "
                f"{gen[k][0].request_id} must sample a token"
            )
        counts: list[int] | None = None
        if accepted is not None:
            counts = _token_list("accepted", accepted, len(gen))
            for k, ((request, d), a) in enumerate(zip(gen, counts, strict=True)):
                if not 0 <= a <= d:
                    raise ValueError(
                        f"accepted[{k}] = {a}: request {request.request_id} verified {d} "
                        "draft tokens this step"
                    )
        note = self._gen_ran
        if note is not None and note[0] is gen and gen == note[1]:
            # The entries prepare_resources ran, unchanged, and their most drafts.
            requests, ids, most_drafts = note[4], note[2], note[3]
        else:
            requests = [r for r, _ in gen]
            ids = [r.request_id for r in requests]
            most_drafts = max(map(itemgetter(1), gen), default=0)
        if accepted is None and most_drafts:
            counts = [0] * len(gen)  # drafts verified, none accepted: all rewound
        generated = list(map(_GENERATED, requests))
        done: list[Request] = []
        if counts is None:
            # The manager holds each decode entry's cached length and the final one its
            # registration recorded (prompt + max_new_tokens - 1): it finds the last tokens.
            last = [requests[k] for k in self._manager._reached_final_tokens(ids)]
            for request in last:
                if len(request.generated) + 1 != request.max_new_tokens:
                    raise ValueError(
                        f"request {request.request_id}: its cache reached its final length "
                        f"with {len(request.generated)} of max_new_tokens="
                        f"{request.max_new_tokens} generated: the request and the cache "
                        "disagree (tokens appended outside complete_step?)"
                    )
        else:
            # prepare_resources capped each entry's drafts below its remaining tokens.
            last = [
                r
                for r, a in zip(requests, counts, strict=True)
                if len(r.generated) + a + 1 >= r.max_new_tokens
            ]
        # Checked: from here on nothing raises before update_resources' own checks.
        finished, generation = RequestState.FINISHED, RequestState.GENERATION
        for request, t in sampled_ctx:
            request.context_position = request.context_len
            request.generated.append(t)
            if len(request.generated) >= request.max_new_tokens:
                request.state = finished
                done.append(request)
            else:
                request.state = generation
        if counts is None:
            deque(map(list.append, generated, gen_toks), maxlen=0)  # one append per entry
        else:
            for (request, d), g, t, a in zip(gen, generated, gen_toks, counts, strict=True):
                if a:
                    g.extend(request.draft_tokens[:a])
                if d > a:
                    request.rewind_len = d - a
                g.append(t)
        for request in last:
            request.state = finished
        done += last
        # With drafts verified, every generation entry rewinds or not; without, a request may
        # still hold drafts the batch did not verify: update drops them.
        self._update(batch, True if counts is not None else any(map(_DRAFTS, requests)))
        for request in done:
            self.free_resources(request, store_for_reuse=store_for_reuse)
        return done

    def free_resources(self, request: Request, *, store_for_reuse: bool = True) -> None:
        """Ends the request's sequence and returns its blocks (stored for reuse if enabled).

        A pruned beam frees only the blocks no other beam holds.
        """
        check_type("request", request, Request)
        if request.request_id not in self._running:
            raise KeyError(f"request {request.request_id} holds no KV cache blocks")
        self._manager.remove_sequence(request.request_id, store_for_reuse=store_for_reuse)
        del self._running[request.request_id]
        del self._base_of[request.request_id]
        self._epoch += 1
        self._forked.discard(request.request_id)

    # ------------------------------------------------------------------ internals

    def _note_generation(
        self,
        gen: list[tuple[Request, int]],
        ids: list[int],
        most_drafts: int,
        requests: list[Request],
        bases: list[int] | None,
        snapshot: list[tuple[Request, int]] | None = None,
    ) -> None:
        """The scheduler's note on the batch it built: its generation entries (the list and
        a copy), their request ids, the most draft tokens among them, the requests and their
        prompt lengths less one. The next ``prepare_resources`` takes these from here instead
        of reading every request, if that batch's ``generation`` is the same list with the
        same entries (compared by identity, in C), and checks drafts only if some entry has
        any (``snapshot``: an unchanging list equal to ``gen``, kept as the copy)."""
        copy = list(gen) if snapshot is None else snapshot
        self._gen_note = (gen, copy, ids, most_drafts, requests, bases)

    def _add_noted(self, note: _GenerationNote) -> bool:
        """Appends the noted generation requests' newest tokens, checked as
        :meth:`_check_generation` checks them (in generation, cached length ``len(prompt) +
        len(generated) - 1``), in one native call; False, with nothing added, if the note has
        no prompt lengths or some check fails (the caller then checks request by request,
        which raises)."""
        requests, bases = note[4], note[5]
        if bases is None:
            return False
        if list(map(_STATE, requests)).count(RequestState.GENERATION) != len(requests):
            return False
        gens = list(map(_GENERATED, requests))
        return int(self._manager._add_generated(note[2], gens, bases)) < 0

    def _register(self, request: Request) -> None:
        """Records a request whose sequence was just registered (or forked)."""
        self._running[request.request_id] = request
        self._base_of[request.request_id] = len(request.prompt) - 1
        self._epoch += 1

    def _forget(self, request: Request) -> None:
        """Drops a request whose sequence the native scheduler removed (a pause)."""
        del self._running[request.request_id]
        del self._base_of[request.request_id]
        self._epoch += 1
        self._forked.discard(request.request_id)

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
        self._register(request)
        request.reused_tokens = reused
        request.context_position = reused
        request.state = RequestState.CONTEXT

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
            del self._base_of[request.request_id]
            self._epoch += 1
            request.state = RequestState.WAITING if request.num_pauses == 0 else RequestState.PAUSED
            request.reused_tokens = 0
            request.context_position = 0


#: (the batch's generation list, a copy of its entries, their request ids, the most drafts,
#: the requests, their prompt lengths less one).
_GenerationNote = tuple[
    list[tuple[Request, int]],
    list[tuple[Request, int]],
    list[int],
    int,
    list[Request],
    list[int] | None,
]


_GENERATED = attrgetter("generated")
_DRAFTS = attrgetter("draft_tokens")
_STATE = attrgetter("state")


def _token_list(name: str, values: Sequence[int] | np.ndarray, size: int) -> list[int]:
    """``values`` as a list of Python ints, checked once for the whole batch: ``size``
    integers (not bools), each below ``2**31``. A list of ints is checked without numpy."""
    if len(values) != size:
        raise ValueError(f"{name} has {len(values)} entries, the batch {size}: give one per entry")
    if not size:
        return []
    out: list[int]
    if isinstance(values, np.ndarray):
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a 1-D sequence or array of integers, got " + (
                f"{values.ndim}-D" if values.ndim != 1 else f"dtype {values.dtype}"))  # fmt: skip
        out = values.tolist()
    else:
        out = list(values)
        if set(map(type, out)) != {int}:  # numpy scalars, bools, floats, nested lists
            bools = [k for k, v in enumerate(out) if isinstance(v, bool | np.bool_)]
            if bools:
                k = bools[0]
                raise ValueError(f"{name}[{k}] = {out[k]!r} is a bool, not a token id")
            return _token_list(name, np.asarray(out), size)
    hi = max(out)
    if hi >= MAX_TOKEN:
        k = out.index(hi)
        raise ValueError(f"{name}[{k}] = {hi} is out of range (token ids are below 2**31)")
    return out


def _primary(value: Any) -> int:
    return int(value[0]) if isinstance(value, tuple) else int(value)
