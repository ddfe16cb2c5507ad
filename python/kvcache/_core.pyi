"""
kvcache native core: VSWA block pools, sliding windows and memory backends
"""

from __future__ import annotations
import collections.abc
import numpy
import numpy.typing
import typing
import typing_extensions

__all__: list[str] = [
    "CapacityScheduler",
    "CudaError",
    "DEFAULT_PRIORITY",
    "DeviceOOMError",
    "InternalError",
    "KEEP_ALL",
    "KVCacheError",
    "KVCacheManager",
    "LayerBuffer",
    "NULL_BLOCK",
    "OFFSET_SENTINEL",
    "OutOfBlocksError",
    "PreparedPrompt",
    "RouterIndex",
    "SHARED_CACHE_PASSWORD_ENV",
    "StateBuffer",
    "blocks_to_run_alone",
    "cuda_available",
    "cuda_compiled",
    "cuda_mem_get_info",
    "demand_blocks",
    "peak_live_blocks",
    "prefill_peak",
    "released_blocks",
    "window_keep",
]

class KVCacheError(RuntimeError):
    pass

class InternalError(KVCacheError):
    pass

class OutOfBlocksError(KVCacheError):
    pass

class CudaError(KVCacheError):
    pass

class DeviceOOMError(CudaError):
    pass

class LayerBuffer:
    """
    Strided view of one layer's K/V memory (DLPack and __cuda_array_interface__ producer).
    """
    def __dlpack__(
        self,
        stream: typing.Any = None,
        *,
        max_version: typing.Any = None,
        dl_device: typing.Any = None,
        copy: typing.Any = None,
    ) -> typing_extensions.CapsuleType: ...
    def __dlpack_device__(self) -> tuple: ...
    @property
    def __cuda_array_interface__(self) -> dict: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple: ...
    @property
    def strides(self) -> tuple:
        """
        Strides in bytes.
        """

class PreparedPrompt:
    """
    A prompt converted and keyed once (KVCacheManager.prepare): accepted wherever a prompt is, so retried admissions, lookups and block counts convert and hash nothing again. Immutable.
    """
    def __len__(self) -> int: ...
    def __repr__(self) -> str: ...
    @property
    def lora_task_id(self) -> int | None: ...
    @property
    def num_keyed_blocks(self) -> int:
        """
        Full blocks keyed (chained hash computed) at preparation.
        """
    @property
    def tokens(self) -> numpy.typing.NDArray[numpy.int32]:
        """
        A copy of the token ids (int32 ndarray).
        """
    @property
    def tokens_per_block(self) -> int: ...

class KVCacheManager:
    """
    Native KV cache manager (see kvcache.KVCacheManager).
    """
    def __init__(
        self,
        *,
        num_layers: typing.SupportsIndex,
        num_kv_heads: collections.abc.Sequence[typing.SupportsIndex],
        head_dim: typing.SupportsIndex,
        dtype: str,
        kv_factor: typing.SupportsIndex,
        tokens_per_block: typing.SupportsIndex,
        max_attention_window: collections.abc.Sequence[typing.SupportsIndex],
        max_seq_len: typing.SupportsIndex,
        max_batch_size: typing.SupportsIndex,
        blocks_per_window: collections.abc.Mapping[
            typing.SupportsIndex, tuple[typing.SupportsIndex, typing.SupportsIndex]
        ],
        backend: str,
        max_draft_tokens: typing.SupportsIndex = 0,
        enable_block_reuse: bool = False,
        enable_partial_reuse: bool = True,
        copy_on_partial_reuse: bool = True,
        onboard_blocks: bool = True,
        secondary_offload_min_priority: typing.SupportsIndex = 30,
        event_buffer_max_size: typing.SupportsIndex = 0,
        swa_reuse_policy: str = "placeholder",
        head_dims: collections.abc.Sequence[typing.SupportsIndex] = [],
        dtypes: collections.abc.Sequence[str] = [],
        protect_reused_blocks: bool = True,
        disk_blocks_per_window: collections.abc.Mapping[
            typing.SupportsIndex, typing.SupportsIndex
        ] = {},
        disk_cache_dir: str = "",
        lend_free_memory: bool = False,
        shared_cache_url: str = "",
        shared_cache_namespace: str = "",
        shared_cache_timeout_ms: typing.SupportsIndex = 5,
        shared_cache_queue_bytes: typing.SupportsIndex = 67108864,
        recurrent_layers: typing.Any = [],
        state_slots: typing.SupportsInt | typing.SupportsIndex = 0,
        state_secondary_slots: typing.SupportsInt | typing.SupportsIndex = 0,
        checkpoint_policy: typing.Any = None,
    ) -> None: ...
    def _add_generated(self, request_ids: typing.Any, generated: list, bases: list) -> int:
        """
        A decode step's newest tokens from the requests' generated lists: checks each cached length (bases[i] + len(generated[i])), then appends each generated[i][-1]; -1 once added, else the first index that failed a check (nothing added).
        """
    def _add_sequence(
        self,
        request_id: typing.SupportsIndex,
        tokens: typing.Any,
        priority: typing.SupportsIndex | None = None,
        lora_task_id: typing.SupportsIndex | None = None,
        cache_salt: typing.SupportsIndex | None = None,
        multimodal: collections.abc.Sequence[
            tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
        ] = [],
        priority_ranges: collections.abc.Sequence[
            tuple[
                typing.SupportsIndex,
                typing.SupportsIndex,
                typing.SupportsIndex,
                typing.SupportsIndex,
            ]
        ] = [],
        decode_priority: typing.SupportsIndex | None = None,
        decode_duration_ms: typing.SupportsIndex = 0,
        prefill: typing.SupportsIndex | None = None,
    ) -> int: ...
    def _add_sequence_plain(
        self,
        request_id: typing.SupportsIndex,
        tokens: typing.Any,
        prefill: typing.SupportsIndex | None = None,
    ) -> int: ...
    def _blocks_to_allocate_plain(
        self, tokens: typing.Any, prefill: typing.SupportsIndex | None = None
    ) -> dict: ...
    def _first_length_mismatch(self, request_ids: typing.Any, lengths: typing.Any) -> int:
        """
        The first index whose sequence is not registered or holds another number of tokens, or -1.
        """
    def _get_num_blocks_to_allocate(
        self,
        tokens: typing.Any,
        lora_task_id: typing.SupportsIndex | None = None,
        cache_salt: typing.SupportsIndex | None = None,
        multimodal: collections.abc.Sequence[
            tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
        ] = [],
        prefill: typing.SupportsIndex | None = None,
    ) -> dict[int, int]: ...
    def _get_reusable_prefix_length(
        self,
        tokens: typing.Any,
        lora_task_id: typing.SupportsIndex | None = None,
        cache_salt: typing.SupportsIndex | None = None,
        multimodal: collections.abc.Sequence[
            tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
        ] = [],
    ) -> int: ...
    def _latest_events(self, timeout_ms: typing.SupportsIndex = 0) -> list: ...
    def _layer_buffer(self, layer_idx: typing.SupportsIndex) -> LayerBuffer:
        """
        LayerBuffer view on any backend with memory (tests).
        """
    def _prepare(
        self,
        tokens: typing.Any,
        lora_task_id: typing.SupportsIndex | None = None,
        cache_salt: typing.SupportsIndex | None = None,
        multimodal: collections.abc.Sequence[
            tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
        ] = [],
    ) -> PreparedPrompt: ...
    def _reached_final_tokens(self, request_ids: typing.Any) -> list[int]:
        """
        The indices, ascending, whose sequence holds at least its final tokens (_set_final_tokens): the requests whose token sampled this step is their last. KeyError for an unregistered id.
        """
    def _set_fake_time_ms(self, now_ms: typing.SupportsIndex) -> None:
        """
        Test hook: a fixed clock for timed priorities (negative: the real clock).
        """
    def _set_final_tokens(
        self, request_id: typing.SupportsIndex, final_tokens: typing.SupportsIndex
    ) -> None:
        """
        Records the most tokens the sequence will hold (prompt + max_new_tokens - 1), for the estimates.
        """
    def _stats_dict(self) -> dict: ...
    def add_token(self, request_id: typing.SupportsIndex, token: typing.SupportsIndex) -> None:
        """
        Appends one generated token.
        """
    def add_tokens(self, request_ids: typing.Any, tokens: typing.Any) -> None:
        """
        Appends tokens[i] to request_ids[i] for a whole batch; all or nothing.
        """
    def can_allocate(self, blocks: dict) -> bool:
        """
        Whether every window can hand out blocks[window] blocks at once now (windows not named need none; a negative count is a credit: the window frees that many first); under lend_free_memory the windows compete for the same lendable memory.
        """
    def check_invariants(self) -> None:
        """
        Verifies every internal invariant; raises KVCacheError describing the first violation.
        """
    def copy_block_offsets(
        self, out: typing.Any, request_ids: typing.Any, slot_offset: typing.SupportsIndex = 0
    ) -> int: ...
    def fits_when_empty(self, blocks: typing.Any) -> bool:
        """
        Whether an empty manager could hold blocks[window] blocks of every window at once.
        """
    def flush_shared_cache(self, timeout_ms: typing.SupportsIndex = 1000) -> bool:
        """
        Waits up to timeout_ms until every block queued for the shared tier was written (or failed); True if the queue drained (always True without a shared tier).
        """
    def fork_sequence(self, parent_id: typing.SupportsIndex, child_ids: typing.Any) -> None:
        """
        Registers each child id (one id or a list) as a copy of request parent_id that shares every block the parent holds, in every window (no block is taken, nothing is copied). The first write into a shared block (add_tokens, prefill, rewind into it) copies that block first. Unknown parent: KeyError; a child id that is registered, repeated or the parent: ValueError. All or nothing.
        """
    def get_blocks_to_run_alone(
        self,
        prompt_len: typing.SupportsIndex,
        final_tokens: typing.SupportsIndex,
        *,
        chunk_size: typing.SupportsIndex | None = None,
    ) -> list[int]:
        """
        Per window: the most blocks a sequence holds from registration to final_tokens tokens, nothing reused.
        """
    def get_buffers(self, layer_idx: typing.SupportsIndex) -> typing.Any:
        """
        K/V memory of one layer, [primary_blocks, kv_factor, num_kv_heads, tokens_per_block, head_dim]: a numpy array on the host backend, a LayerBuffer on CUDA.
        """
    def get_cache_block_ids(
        self, request_id: typing.SupportsIndex, window_size: typing.SupportsIndex | None = None
    ) -> list[int]:
        """
        Block ids per position (NULL_BLOCK where a sliding window released the block).
        """
    def get_chunk_limit(
        self,
        request_id: typing.SupportsIndex,
        num_tokens: typing.SupportsInt | typing.SupportsIndex,
    ) -> int:
        """
        The largest next prefill chunk (<= num_tokens) that does not straddle a checkpoint to take.
        """
    def get_family_remaining_blocks(
        self, request_ids: typing.Any, final_tokens: typing.SupportsIndex
    ) -> tuple | None:
        """
        A beam family's free blocks to completion, its shared blocks counted once: (per window the most free blocks the registered beams request_ids take together while growing in lockstep to final_tokens tokens, per window the family's own extra holdings of shared blocks in windows that release blocks); None if the beams are not in lockstep (one in prefill, different lengths or released fronts).
        """
    def get_forked_beam_blocks(
        self, fork_tokens: typing.SupportsIndex, final_tokens: typing.SupportsIndex
    ) -> list[int]:
        """
        Per window: the most free blocks one more beam forked from a sequence of fork_tokens tokens takes before it holds final_tokens tokens (its copy of the shared partial block and its own new blocks).
        """
    def get_num_free_blocks(self, window_size: typing.SupportsIndex | None = None) -> int:
        """
        Primary blocks that can be handed out now; without window_size the minimum over windows.
        """
    def get_num_held_blocks(
        self, request_id: typing.SupportsIndex, window_size: typing.SupportsIndex
    ) -> int:
        """
        Blocks the sequence holds in the window now.
        """
    def get_num_shared_blocks(self, window_size: typing.SupportsIndex) -> int:
        """
        Extra references of blocks held more than once in a window that releases blocks (0 elsewhere).
        """
    def get_num_used_blocks(self, window_size: typing.SupportsIndex) -> int:
        """
        Primary blocks of the window referenced by sequences or pins.
        """
    def get_prompt_chunk_limit(
        self, prompt: PreparedPrompt, num_tokens: typing.SupportsInt | typing.SupportsIndex
    ) -> int:
        """
        get_chunk_limit for the first chunk of a prepared prompt.
        """
    def get_prompt_remaining_blocks(
        self,
        prompt: PreparedPrompt,
        final_tokens: typing.SupportsIndex,
        *,
        chunk_size: typing.SupportsIndex | None = None,
        use_reuse: bool = True,
        prefill_only: bool = False,
    ) -> list[int]:
        """
        Per window: the free blocks a prompt not registered yet may take until it holds final_tokens tokens.
        """
    def get_prompt_step_needs(
        self,
        prompt: PreparedPrompt,
        *,
        chunk_size: typing.SupportsIndex | None = None,
        credit_releases: bool = False,
        use_reuse: bool = True,
    ) -> list[int]:
        """
        Per window: the free blocks registering the prompt with a first chunk of chunk_size tokens takes now.
        """
    def get_remaining_blocks(
        self,
        request_ids: typing.Any,
        final_tokens: typing.Any,
        *,
        chunk_size: typing.SupportsIndex | None = None,
        prefill_only: bool = False,
    ) -> list[int]:
        """
        Per window, summed over registered sequences: the free blocks each may still take until it holds final_tokens[i] tokens (prefill_only: until its prompt is prefilled).
        """
    def get_request_stats(self, request_id: typing.SupportsIndex) -> dict:
        """
        Per-request reuse counters, summed over windows.
        """
    def get_reusable_by_kind(self, prompt: PreparedPrompt) -> dict:
        """
        How far each kind of group could resume a prepared prompt now: matched, full_attention, sliding_window, recurrent_state, reused (tokens).
        """
    def get_sequence_step_needs(
        self,
        request_id: typing.SupportsIndex,
        num_tokens: typing.SupportsIndex,
        *,
        credit_releases: bool = False,
    ) -> list[int]:
        """
        Free blocks per window the next step of a registered sequence takes: num_tokens more tokens (a chunk in prefill, 0: the rest of the prompt; else the newest token plus drafts).
        """
    def get_state_slot(
        self, request_id: typing.SupportsIndex, group: typing.SupportsInt | typing.SupportsIndex = 0
    ) -> int:
        """
        The working state slot of a registered sequence.
        """
    def get_state_view(
        self,
        layer: typing.SupportsInt | typing.SupportsIndex,
        tensor: typing.SupportsInt | typing.SupportsIndex,
    ) -> typing.Any:
        """
        State tensor `tensor` of recurrent layer `layer` over every slot, [num_slots, *shape]: a numpy array on the host backend (bfloat16 as uint16 bits), a StateBuffer on CUDA.
        """
    def get_step_needs(
        self,
        generation_ids: typing.Any,
        generation_tokens: typing.Any,
        context_ids: typing.Any,
        chunk_sizes: typing.Any,
    ) -> list[int]:
        """
        Free blocks each window (window_sizes order) must have for one engine step: the generation tokens (1 + drafts each, one add_tokens call per token position), then the prefill chunks; the step's worst point, releases credited unless another holder keeps the block.
        """
    def has_sequence(self, request_id: typing.SupportsIndex) -> bool: ...
    def is_sequence_valid_for_reuse(self, request_id: typing.SupportsIndex) -> bool: ...
    def num_tokens(self, request_id: typing.SupportsIndex) -> int: ...
    def pin_blocks(self, request_id: typing.SupportsIndex) -> dict[int, list[int]]:
        """
        Stores the sequence's full blocks and pins, in every window, the cached block of each stored position; returns the pinned block ids per window, which unpin_blocks_by_id takes back.
        """
    def prefill(self, request_id: typing.Any, num_tokens: typing.Any) -> None:
        """
        Chunked prefill: gives blocks for the next num_tokens prompt tokens, first releasing the sliding-window blocks no query of the chunk can attend; all or nothing. With equal-length lists, a step's chunks in one call.
        """
    def prompt_length(self, request_id: typing.SupportsIndex) -> int:
        """
        Prompt tokens of the sequence (num_tokens counts those with blocks).
        """
    def refresh_blocks(self) -> None:
        """
        Once per engine step: expired timed priorities return to the default; pending copies complete.
        """
    def remove_sequence(
        self, request_id: typing.SupportsIndex, *, store_for_reuse: bool = True, pin: bool = False
    ) -> typing.Any:
        """
        Ends a sequence and releases its blocks (stored for reuse first). With pin=True returns the pinned block ids per window, which unpin_blocks_by_id takes back; else None.
        """
    def reset_prefix_cache(self) -> bool:
        """
        Drops every cached prefix (removed events as for an eviction; host and disk tiers too, the shared tier is not touched) and returns True; False, changing nothing, while any sequence is registered or any block is pinned.
        """
    def rewind(self, request_id: typing.SupportsIndex, num_tokens: typing.SupportsIndex) -> None:
        """
        Drops the last num_tokens tokens, releasing blocks that become empty.
        """
    def save_checkpoints(self) -> int:
        """
        Makes the checkpoint copies itself (after the forward pass); returns how many.
        """
    def state_groups(self) -> list:
        """
        One dict per state group (recurrent layers with identical state tensors): layers, tensors [(shape, dtype)], slot_bytes, num_slots, ptr.
        """
    def store_context_blocks(self, request_id: typing.Any) -> int:
        """
        Stores the sequence's full prompt blocks for reuse now (a list: each sequence's); returns block positions newly stored.
        """
    def take_state_copies(self) -> list:
        """
        The checkpoint copies (group, src_slot, dst_slot) the engine makes after this step's forward pass (working state into checkpoint slot); forgets them.
        """
    def unpin_blocks_by_id(
        self, block_ids: typing.Any, window_size: typing.SupportsIndex | None = None
    ) -> None:
        """
        With the dict that pin_blocks / remove_sequence(pin=True) returned: drops exactly those pins (all or nothing). With a list: unpins the stored chains ending at these blocks (of window_size; default: the full-attention window, unpinning every window).
        """
    @property
    def backend(self) -> str: ...
    @property
    def blocks_per_window(self) -> dict[int, tuple[int, int]]: ...
    @property
    def group_kinds(self) -> list:
        """
        (kind, sliding window or None) of every group: the windows in window_sizes order ('full_attention', 'sliding_window'), then the state groups ('recurrent_state').
        """
    @property
    def kv_factor(self) -> int: ...
    @property
    def layer_to_pool(self) -> list[tuple[int, int]]:
        """
        (global pool index, index inside the pool) for every layer.
        """
    @property
    def lends_free_memory(self) -> bool: ...
    @property
    def max_batch_size(self) -> int: ...
    @property
    def max_blocks_per_seq(self) -> int: ...
    @property
    def max_draft_tokens(self) -> int: ...
    @property
    def max_seq_len(self) -> int: ...
    @property
    def num_pools(self) -> int: ...
    @property
    def num_sequences(self) -> int: ...
    @property
    def num_state_groups(self) -> int: ...
    @property
    def pools(self) -> list:
        """
        One dict per pool in global order (ascending window, then KV-head count, head size, dtype).
        """
    @property
    def reuse_enabled(self) -> bool: ...
    @property
    def shared_cache_namespace(self) -> str:
        """
        The shared tier's key prefix ('' without a shared tier).
        """
    @property
    def tokens_per_block(self) -> int: ...
    @property
    def window_sizes(self) -> list[int]: ...

class CapacityScheduler:
    """
    Native capacity scheduler (see kvcache.scheduler.CapacityScheduler).
    """
    def __init__(
        self,
        manager: KVCacheManager,
        policy: str,
        max_batch_size: typing.SupportsInt | typing.SupportsIndex,
        max_num_batched_tokens: typing.SupportsInt | typing.SupportsIndex | None,
        chunked_prefill: bool,
        chunk: typing.SupportsInt | typing.SupportsIndex | None,
    ) -> None: ...
    def blocks_to_run_alone(
        self,
        context_len: typing.SupportsInt | typing.SupportsIndex,
        final_tokens: typing.SupportsInt | typing.SupportsIndex,
        beams: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> list[int]:
        """
        Per window: the most blocks such a request holds from an otherwise empty pool, its beams included.
        """
    def never_fits(
        self,
        context_len: typing.SupportsInt | typing.SupportsIndex,
        final_tokens: typing.SupportsInt | typing.SupportsIndex,
        beams: typing.SupportsInt | typing.SupportsIndex = 0,
    ) -> bool:
        """
        Whether a request can never run: longer than max_seq_len or beyond some window's pool (with beams more beams forked from it after its prompt).
        """
    def schedule(
        self,
        running: typing.Any,
        final_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None,
        drafts: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None,
        candidate_ids: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        contexts: collections.abc.Sequence[PreparedPrompt],
        candidate_final_tokens: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex],
        *,
        families: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None,
        beams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None,
        candidate_families: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        | None = None,
        candidate_beams: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        | None = None,
        waiting_families: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex]
        | None = None,
    ) -> tuple[
        typing.Any, typing.Any, list[int], list[int], list[int], list[int], list[int], list[int]
    ]:
        """
        Plans one step: (generation, drafts, chunks, chunk sizes, admitted candidates, their first chunks, paused, rejected candidates), requests as indices into running or the candidates; generation and drafts are both None when every running request decodes, in order, without drafts. Paused requests are removed from the manager. families / candidate_families: beam family ids (< 0: none), a family decodes whole and is paused whole; beams / candidate_beams: beams still to fork from each request (guaranteed_no_evict charges their own blocks); waiting_families: families with a member waiting, which do not decode.
        """

class StateBuffer:
    """
    Strided view of one recurrent state tensor on device memory (__cuda_array_interface__ producer).
    """
    @property
    def __cuda_array_interface__(self) -> dict: ...
    @property
    def data_ptr(self) -> int: ...
    @property
    def dtype(self) -> str: ...
    @property
    def shape(self) -> tuple: ...
    @property
    def strides(self) -> tuple:
        """
        Strides in bytes.
        """

class RouterIndex:
    """
    A router's index of every engine's cached blocks, fed by KV events (see kvcache.router.KvIndexer).
    """
    def __init__(self, shared_tier: bool = False) -> None: ...
    def add_engine(self) -> int:
        """
        Registers an engine; returns its slot.
        """
    def apply_events(self, slot: typing.SupportsInt | typing.SupportsIndex, events: list) -> int:
        """
        Applies checked events (type, hashes, group_idx, medium, block_size, kv_cache_spec_kind, window, lora_id, lora_name); slot -1 registers a new engine. Returns the engine's slot.
        """
    def apply_msgpack(
        self, slot: typing.SupportsInt | typing.SupportsIndex, payload: typing.Any
    ) -> int:
        """
        Applies one raw msgpack KVEventBatch whole (ValueError, nothing applied, if any of it is bad); slot -1 registers a new engine. Returns the engine's slot.
        """
    def clear_shared_tier(self) -> None: ...
    def engines(self) -> list[int]:
        """
        Live slots in registration order.
        """
    def num_blocks(self, slot: typing.SupportsInt | typing.SupportsIndex) -> list[tuple[int, int]]:
        """
        [(group_idx, blocks)] in the order the groups appeared.
        """
    def num_shared_blocks(self) -> list[tuple[int, int | None, int]]:
        """
        [(block_size, window, blocks)] of the store's non-empty sets.
        """
    def reads_shared_tier(self, slot: typing.SupportsInt | typing.SupportsIndex) -> bool: ...
    def remove_engine(self, slot: typing.SupportsInt | typing.SupportsIndex) -> None: ...
    def remove_shared_blocks(
        self,
        hashes: collections.abc.Iterable,
        window: typing.SupportsInt | typing.SupportsIndex | None,
    ) -> int: ...
    def scores(
        self,
        tokens: typing.Any,
        lora_name: str | None = None,
        lora_id: typing.SupportsIndex | None = None,
        cache_salt: typing.SupportsIndex | None = None,
        multimodal: collections.abc.Sequence[
            tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
        ] = [],
        slots: collections.abc.Sequence[typing.SupportsInt | typing.SupportsIndex] | None = None,
    ) -> list[int]:
        """
        Every listed engine's reusable prefix of `tokens` (all engines, in registration order, without slots).
        """
    def set_shared_tier(
        self, slot: typing.SupportsInt | typing.SupportsIndex, shared_tier: bool | None
    ) -> None: ...
    @property
    def num_entries(self) -> int: ...
    @property
    def num_interned(self) -> int: ...

def _block_hashes(
    tokens: typing.Any,
    tokens_per_block: typing.SupportsIndex,
    lora_task_id: typing.SupportsIndex | None = None,
    cache_salt: typing.SupportsIndex | None = None,
    multimodal: collections.abc.Sequence[
        tuple[typing.SupportsIndex, typing.SupportsIndex, typing.SupportsIndex]
    ] = [],
) -> list[int]:
    """
    Chained block keys of the full blocks of `tokens` (the core's ChainHashes).
    """

def _check_shared_cache_url(url: str) -> None:
    """
    Raises ValueError unless `url` is a shared_cache_url the core connects to (the core's ParseRedisUrl).
    """

def blocks_to_run_alone(
    prompt_len: typing.SupportsIndex,
    final_tokens: typing.SupportsIndex,
    chunk_size: typing.SupportsIndex | None,
    window: typing.SupportsIndex,
    keep: typing.SupportsIndex,
    tokens_per_block: typing.SupportsIndex,
) -> int:
    """
    Most blocks a sequence holds in a window from registration to final_tokens tokens, nothing reused.
    """

def cuda_available() -> bool:
    """
    True if the CUDA backend was compiled in and a CUDA device is usable now.
    """

def cuda_compiled() -> bool:
    """
    True if the CUDA backend was compiled in.
    """

def cuda_mem_get_info() -> tuple[int, int]:
    """
    (free, total) bytes of the current CUDA device; raises CudaError without one.
    """

def demand_blocks(
    n: typing.SupportsIndex,
    seq_len: typing.SupportsIndex,
    keep: typing.SupportsIndex,
    budget: typing.SupportsIndex,
    tokens_per_block: typing.SupportsIndex,
) -> int:
    """
    Blocks of one window that n sequences of seq_len tokens hold at most under chunked prefill with budget tokens per step.
    """

def peak_live_blocks(
    lo: typing.SupportsIndex,
    hi: typing.SupportsIndex,
    keep: typing.SupportsIndex,
    tokens_per_block: typing.SupportsIndex,
    front: typing.SupportsIndex = 0,
) -> int:
    """
    Most blocks one sequence holds while it grows from lo to hi tokens.
    """

def prefill_peak(
    start: typing.SupportsIndex,
    end: typing.SupportsIndex,
    chunk_size: typing.SupportsIndex,
    keep: typing.SupportsIndex,
    tokens_per_block: typing.SupportsIndex,
    front: typing.SupportsIndex = 0,
) -> int:
    """
    Most blocks held after any prefill chunk of at most chunk_size tokens between start and end tokens.
    """

def released_blocks(
    num_tokens: typing.SupportsIndex,
    keep: typing.SupportsIndex,
    tokens_per_block: typing.SupportsIndex,
) -> int:
    """
    Leading block positions released once a sequence reached num_tokens tokens.
    """

def window_keep(
    window: typing.SupportsIndex,
    max_draft_tokens: typing.SupportsIndex,
    max_seq_len: typing.SupportsIndex,
) -> int:
    """
    Tokens a window keeps behind a sequence's end (window + drafts), KEEP_ALL if it never releases.
    """

DEFAULT_PRIORITY: int = 35
KEEP_ALL: int = 2305843009213693951
NULL_BLOCK: int = -1
OFFSET_SENTINEL: int = -1
SHARED_CACHE_PASSWORD_ENV: str = "KVCACHE_SHARED_CACHE_PASSWORD"
