"""``VllmKVCacheManager``: vLLM 0.32's ``KVCacheManager`` interface, backed by kvcache.

The scheduler of vLLM 0.32 talks to its KV cache manager through the calls below; the model
runner never sees the manager, only the block ids the scheduler sends it (the whole table of a
new or resumed request, then the ids a step appends). Each call becomes kvcache calls:

=============================  ================================================================
vLLM call                      kvcache
=============================  ================================================================
``get_computed_blocks``        ``get_reusable_prefix_length`` of the request's prepared tokens
``allocate_slots`` (new)       ``add_sequence(prefill=chunk)`` + ``store_context_blocks``
``allocate_slots`` (running)   ``prefill(chunk)`` + ``store_context_blocks``, or ``add_token``
``free``                       ``remove_sequence(store_for_reuse=True)``
``get_blocks``                 ``get_cache_block_ids`` per window, mapped to vLLM ids
``reset_prefix_cache``         ``reset_prefix_cache``
``take_events``                ``get_latest_events``, translated to vLLM's event types
=============================  ================================================================

A kvcache block id never changes once vLLM has it: kvcache writes prompt and generated blocks
in place (partial reuse, whose copy vLLM would not know of, is off), and a position a sliding
window released becomes vLLM's null block (id 0), which the attention kernel never reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    AllBlocksCleared,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_manager import KVCacheBlocks  # type: ignore[import-not-found]
from vllm.v1.metrics.stats import PrefixCacheStats  # type: ignore[import-not-found]

from kvcache import KVCacheManager, OutOfBlocksError
from kvcache.vllm.events import GroupEvents
from kvcache.vllm.layout import GroupLayout


class _IdBlocks(KVCacheBlocks):  # type: ignore[misc]
    """A ``KVCacheBlocks`` holding vLLM block ids; its ``KVCacheBlock`` objects are made on
    demand (only KV connector paths read them, and those are refused at start-up)."""

    def __init__(self, ids: tuple[list[int], ...], pool: Any) -> None:
        self._ids = ids
        self._pool = pool

    @property
    def blocks(self) -> tuple[list[Any], ...]:
        return tuple([self._pool.blocks[i] for i in ids] for ids in self._ids)

    def get_block_ids(
        self, allow_none: bool = False, *, group_ids: Sequence[int] | None = None
    ) -> tuple[list[int], ...] | None:
        """vLLM's ``get_block_ids``, without reading block objects."""
        ids = self._ids if group_ids is None else tuple(self._ids[g] for g in group_ids)
        if allow_none and not any(ids):
            return None
        return tuple(list(group) for group in ids)


class VllmKVCacheManager:
    """vLLM 0.32's ``KVCacheManager`` interface over one :class:`kvcache.KVCacheManager`.

    Built by :class:`kvcache.vllm.Scheduler` in place of vLLM's own manager; the constructor
    arguments come from the scheduler. ``kv`` is the kvcache manager (virtual backend: vLLM owns
    the KV memory), ``layout`` the id mapping (:class:`kvcache.vllm.layout.GroupLayout`).

    Args:
        kv: The kvcache manager, one window pool per distinct vLLM group window.
        layout: Where each group's ids lie in vLLM's block-id space.
        vllm_manager: vLLM's own manager, kept for what vLLM reads of it outside the
            scheduler's calls (``coordinator.single_type_managers``: each group's block size
            and spec; its ``block_pool`` objects back :attr:`_IdBlocks.blocks`).
        enable_caching: vLLM's ``enable_prefix_caching``.
        log_stats: Whether vLLM collects ``PrefixCacheStats``.
        enable_kv_cache_events: Whether vLLM publishes KV events.
        watermark: vLLM's ``scheduler_config.watermark`` (fraction of blocks kept free when a
            waiting request is admitted beside scheduled ones).
        max_chunk_tokens: vLLM's step token budget, the prefill chunk a ``full sequence must
            fit`` admission check plans with.
    """

    def __init__(
        self,
        kv: KVCacheManager,
        layout: GroupLayout,
        vllm_manager: Any,
        *,
        enable_caching: bool,
        log_stats: bool,
        enable_kv_cache_events: bool,
        watermark: float,
        max_chunk_tokens: int,
    ) -> None:
        self.kv = kv
        self.layout = layout
        self.enable_caching = enable_caching
        self.log_stats = log_stats
        self.enable_kv_cache_events = enable_kv_cache_events
        self.coordinator = vllm_manager.coordinator
        self.block_pool = vllm_manager.block_pool
        self.kv_cache_config = vllm_manager.kv_cache_config
        self.num_kv_cache_groups = len(layout.group_windows)
        self.max_model_len = vllm_manager.max_model_len
        self.empty_kv_cache_blocks = KVCacheBlocks(
            tuple(() for _ in range(self.num_kv_cache_groups))
        )
        self.prefix_cache_stats = PrefixCacheStats() if log_stats else None
        self._tpb = kv.tokens_per_block
        self._windows = list(layout.window_sizes)
        self._watermark = [int(watermark * layout.blocks[w]) for w in self._windows]
        self._max_chunk = max_chunk_tokens
        # vLLM request id -> kvcache sequence id, and the prepared prompt of a request (its
        # tokens keyed once; a resumed request is keyed again with its outputs).
        self._seq: dict[str, int] = {}
        self._prompts: dict[str, Any] = {}
        self._hits: dict[str, int] = {}
        self._next_id = 0
        self._pending_events: list[KVCacheEvent] = []
        self._events = GroupEvents(kv, layout) if enable_kv_cache_events else None

    # -- the request's tokens --------------------------------------------------------------

    def _prompt(self, request: Any) -> Any:
        """The request's tokens, prepared (keyed) once per length."""
        p = self._prompts.get(request.request_id)
        if p is not None and len(p) == request.num_tokens:
            return p
        tokens = request.all_token_ids
        lora = request.lora_request.lora_int_id if request.lora_request is not None else None
        salt: str | None = request.cache_salt
        if request.skip_reading_prefix_cache:
            # kvcache always reuses what matches: a key no other request has reads nothing.
            salt = f"vllm-no-read:{request.request_id}:{salt}"
        if lora is None and salt is None:
            p = self.kv.prepare(list(tokens))
        else:
            p = self.kv.prepare(list(tokens), lora_task_id=lora, cache_salt=salt)
        self._prompts[request.request_id] = p
        return p

    # -- vLLM's interface -------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of vLLM's pages that running requests hold (cached blocks are free)."""
        used = sum(
            self.kv.get_num_used_blocks(w) * len(g)
            for w, g in zip(self._windows, self.layout.window_groups, strict=True)
        )
        return used / (self.layout.num_blocks - 1)

    def make_prefix_cache_stats(self) -> Any:
        """Takes (and resets) the prefix cache stats; ``None`` without ``log_stats``."""
        if not self.log_stats:
            return None
        stats = self.prefix_cache_stats
        self.prefix_cache_stats = PrefixCacheStats()
        return stats

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        """Whether the request may read the prefix cache."""
        return self.enable_caching and not request.skip_reading_prefix_cache

    def record_prefix_cache_stats(self, request: Any, num_hits: int) -> None:
        """Counts one lookup in vLLM's ``PrefixCacheStats``, as vLLM's manager does."""
        if self.prefix_cache_stats is None or not self.prefix_cache_lookup_enabled(request):
            return
        self.prefix_cache_stats.record(
            num_tokens=request.num_tokens,
            num_hits=num_hits,
            preempted=request.num_preemptions > 0,
        )

    def get_computed_blocks(self, request: Any) -> tuple[Any, int, int]:
        """The prefix kvcache would reuse for the request now (block-aligned, below its last
        token); the blocks themselves are taken by :meth:`allocate_slots`."""
        if not self.prefix_cache_lookup_enabled(request):
            return self.empty_kv_cache_blocks, 0, 0
        hit = int(self.kv.get_reusable_prefix_length(self._prompt(request)))
        return self.empty_kv_cache_blocks, hit, 0

    def allocate_slots(
        self,
        request: Any,
        num_new_tokens: int,
        num_new_computed_tokens: int = 0,
        new_computed_blocks: Any = None,
        num_lookahead_tokens: int = 0,
        num_external_computed_tokens: int = 0,
        delay_cache_blocks: bool = False,
        num_encoder_tokens: int = 0,
        full_sequence_must_fit: bool = False,
        reserved_blocks: int = 0,
        has_scheduled_reqs: bool = True,
        skip_zeroing_group_ids: tuple[int, ...] = (),
    ) -> Any:
        """Blocks for ``num_new_tokens`` more tokens of the request; ``None`` (nothing
        changed) when they do not fit, and vLLM preempts or waits.

        A new or resumed request is registered with its known tokens as the prompt and the
        hit :meth:`get_computed_blocks` reported; a running one prefills its next chunk or
        appends the token vLLM sampled last step. Prompt blocks are stored for reuse as soon
        as they are allocated, as vLLM's manager does: a request later in the same step may
        hit them, since one forward pass writes each layer's KV before any request attends.
        """
        if num_lookahead_tokens or num_external_computed_tokens or num_encoder_tokens:
            raise NotImplementedError(
                "kvcache.vllm: lookahead slots, KV connectors and encoder tokens are not "
                "supported (the scheduler refuses them at start-up)"
            )
        req_id = request.request_id
        seq = self._seq.get(req_id)
        if seq is None:
            return self._admit(
                request,
                num_new_tokens,
                num_new_computed_tokens,
                full_sequence_must_fit,
                has_scheduled_reqs,
                reserved_blocks,
            )
        kv = self.kv
        before = kv.num_tokens(seq)
        try:
            if before < kv.prompt_length(seq):
                kv.prefill(seq, num_new_tokens)
                if self.enable_caching and not delay_cache_blocks:
                    kv.store_context_blocks(seq)
            else:
                if num_new_tokens != 1:
                    raise NotImplementedError(
                        f"kvcache.vllm: {num_new_tokens} new tokens for a decoding request "
                        "(speculative decoding is not supported)"
                    )
                kv.add_token(seq, request.all_token_ids[before])
        except OutOfBlocksError:
            return None
        tpb = self._tpb
        first = -(-before // tpb)
        last = -(-(before + num_new_tokens) // tpb)
        if first == last:
            return self.empty_kv_cache_blocks
        return self._table(seq, first, last)

    def _admit(
        self,
        request: Any,
        num_new_tokens: int,
        hit: int,
        full_sequence_must_fit: bool,
        has_scheduled_reqs: bool,
        reserved_blocks: int,
    ) -> Any:
        kv = self.kv
        prompt = self._prompt(request)
        n = len(prompt)
        prefill = num_new_tokens if hit + num_new_tokens < n else None
        extra = self._watermark if has_scheduled_reqs and any(self._watermark) else None
        if full_sequence_must_fit or extra is not None or reserved_blocks:
            if full_sequence_must_fit:
                need = kv.get_prompt_remaining_blocks(
                    prompt, n, chunk_size=self._max_chunk, prefill_only=True
                )
            else:
                counts = kv.get_num_blocks_to_allocate(prompt, prefill=prefill)
                need = [counts[w] for w in self._windows]
            if extra is not None:
                need = [a + b for a, b in zip(need, extra, strict=True)]
            if reserved_blocks:
                need = [a + reserved_blocks for a in need]
            if not kv.can_allocate(dict(zip(self._windows, need, strict=True))):
                return None
        seq = self._next_id
        try:
            reused = kv.add_sequence(seq, prompt, prefill=prefill)
        except OutOfBlocksError:
            return None
        if reused != hit:
            kv.remove_sequence(seq, store_for_reuse=False)
            raise RuntimeError(
                f"kvcache.vllm: request {request.request_id!r} reused {reused} tokens where "
                f"the lookup reported {hit} (the cache changed between the two calls)"
            )
        self._next_id += 1
        self._seq[request.request_id] = seq
        self._hits[request.request_id] = hit
        if self.enable_caching:
            kv.store_context_blocks(seq)
        return self.empty_kv_cache_blocks

    def _table(self, seq: int, first: int = 0, last: int | None = None) -> _IdBlocks:
        """vLLM ids of the sequence's block positions ``[first, last)`` in every group."""
        per_group: list[list[int]] = [[] for _ in range(self.num_kv_cache_groups)]
        layout = self.layout
        for w, groups in zip(self._windows, layout.window_groups, strict=True):
            ids = self.kv.get_cache_block_ids(seq, w)[first:last]
            for g in groups:
                per_group[g] = layout.vllm_ids(g, ids)
        return _IdBlocks(tuple(per_group), self.block_pool)

    def free(self, request: Any) -> None:
        """Ends the request's sequence and stores its blocks for reuse.

        Only tokens whose KV vLLM computed are stored: a request preempted in the step that
        scheduled it (the priority policy) gives back that step's slots first.
        """
        req_id = request.request_id
        self._prompts.pop(req_id, None)
        self._hits.pop(req_id, None)
        seq = self._seq.pop(req_id, None)
        if seq is None:
            return
        kv = self.kv
        extra = kv.num_tokens(seq) - request.num_computed_tokens
        store = self.enable_caching
        if extra > 0:
            # The slots of a step that never ran: a decode token rewinds; a prefill chunk
            # may have released sliding-window blocks, so that sequence stores nothing.
            if kv.num_tokens(seq) > kv.prompt_length(seq):
                kv.rewind(seq, extra)
            else:
                store = False
        kv.remove_sequence(seq, store_for_reuse=store)

    def get_blocks(self, request_id: str) -> Any:
        """The request's whole block table, per group (``empty`` for an unknown request)."""
        seq = self._seq.get(request_id)
        if seq is None:
            return self.empty_kv_cache_blocks
        return self._table(seq)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        """The request's block ids per group."""
        ids: tuple[list[int], ...] = self.get_blocks(request_id).get_block_ids()
        return ids

    def estimate_cached_tokens(self, request: Any) -> int:
        """The prefix the request reused when it was admitted."""
        return self._hits.get(request.request_id, 0)

    def reset_prefix_cache(self) -> bool:
        """Drops every cached prefix; ``False`` (nothing changed) while requests hold blocks."""
        if not self.kv.reset_prefix_cache():
            return False
        if self._events is not None:
            self._pending_events.extend(self._events.take())
            self._pending_events.append(AllBlocksCleared())
        if self.prefix_cache_stats is not None:
            self.prefix_cache_stats.reset = True
        return True

    def take_events(self) -> list[KVCacheEvent]:
        """kvcache's events since the last call, as vLLM's ``BlockStored`` / ``BlockRemoved``
        / ``AllBlocksCleared`` (one per vLLM group of a window)."""
        if self._events is None:
            return []
        events = self._pending_events
        self._pending_events = []
        events.extend(self._events.take())
        return events

    def new_step_starts(self) -> None:
        """Called once per scheduler step: kvcache's timed priorities and copies advance."""
        self.kv.refresh_blocks()

    def get_num_common_prefix_blocks(self, running_request_id: str) -> list[int]:
        """Cascade attention is gone from vLLM 0.32: 0 for every group."""
        return [0] * self.num_kv_cache_groups

    def create_kv_cache_blocks(self, blocks: tuple[list[Any], ...]) -> Any:
        """vLLM's helper: ``KVCacheBlocks`` of block objects (empty shared instance if none)."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def take_new_block_ids(self) -> list[int]:
        """Blocks to zero: none (groups that need zeroing are refused at start-up)."""
        return []

    def take_kv_cache_block_copies(self) -> tuple[list[Any], list[Any]]:
        """Copies for the workers: none (kvcache never copies a block vLLM was sent)."""
        return [], []

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        """Mamba boundary states for a connector: none (no Mamba groups, no connector)."""
        return {}

    def _unsupported(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"kvcache.vllm: {what} is used only with KV connectors or Mamba groups, which "
            "the kvcache scheduler refuses at start-up"
        )

    def get_computed_blocks_for_connector(self, request: Any) -> Any:
        """KV connector path: refused."""
        raise self._unsupported("get_computed_blocks_for_connector")

    def truncate_computed_blocks(self, blocks: Any, num_computed_tokens: int) -> Any:
        """KV connector path: refused."""
        raise self._unsupported("truncate_computed_blocks")

    def pop_blocks_for_free(self, request: Any) -> Any:
        """Deferred frees of KV connectors: refused."""
        raise self._unsupported("pop_blocks_for_free")

    def evict_blocks(self, block_ids: set[int]) -> None:
        """KV load failures of connectors: refused."""
        raise self._unsupported("evict_blocks")

    def cache_blocks(self, request: Any, num_computed_tokens: int) -> None:
        """Delayed caching after a connector's KV load: refused."""
        raise self._unsupported("cache_blocks")

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        """Zeroing after a failed connector load: refused."""
        raise self._unsupported("record_blocks_for_zeroing")

    def remove_skipped_blocks(
        self, request_id: str, processed_computed_tokens: int, num_prompt_tokens: int | None = None
    ) -> None:
        """Out-of-window releases happen inside kvcache's own calls: nothing to do."""

    def get_block_ids_for_computed_tokens(
        self, request_id: str, num_computed_tokens: int
    ) -> tuple[list[int], ...]:
        """Block ids covering the request's computed tokens (connector hand-off)."""
        keep = -(-num_computed_tokens // self._tpb)
        return tuple(ids[:keep] for ids in self.get_block_ids(request_id))

    def finalize_partial_tail_offloads(self, request: Any) -> list[tuple[int, int, int]]:
        """Mamba tails for a connector: none."""
        return []
