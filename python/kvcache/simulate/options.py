"""What one simulated engine is built from: one options object for :func:`~kvcache.simulate.
simulate`, :func:`~kvcache.simulate.fleet.simulate_fleet` and
:func:`~kvcache.simulate.simulation_blocks`, which take it whole (``options=``) or field by
field as keywords (``simulate(trace, memory_bytes=2**30)``), or both (the keywords change
the given options)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.models import ModelPreset
from kvcache.serving.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS

__all__ = [
    "DEFAULT_MAX_BATCH_SIZE",
    "DEFAULT_MEMORY",
    "DEFAULT_MODEL",
    "EngineOptions",
    "engine_options",
]

#: The preset simulated when none is given (a VSWA model: 5 sliding layers per full one).
DEFAULT_MODEL = "gemma-3-12b"
#: The primary memory budget simulated when none is given (per engine in a fleet).
DEFAULT_MEMORY = "16GiB"
#: Most requests running at once when not given.
DEFAULT_MAX_BATCH_SIZE = 128


@dataclass(frozen=True)
class EngineOptions:
    """One simulated engine: its model, memory and pools, cache policy, scheduler and step.

    Attributes:
        model: A preset name or preset.
        memory_bytes: Primary KV memory budget (``None``: :data:`DEFAULT_MEMORY`).
        shares: Window share policy or list (``None``: environment, else ``"equal"``).
        scheduler: ``"max_utilization"`` or ``"guaranteed_no_evict"``.
        max_batch_size: Most requests running at once.
        max_seq_len: Longest sequence (``None``: the longest request, within the model's
            context).
        tokens_per_block: Block size.
        max_num_batched_tokens: Tokens per engine step, generation tokens and prefill chunks
            together (``None``: unlimited; see :class:`~kvcache.scheduler.CapacityScheduler`).
        chunked_prefill: Prefill prompts in chunks that fill the token budget; ``False``
            prefills every prompt whole in one step.
        max_chunk_size: Most tokens of one prefill chunk (``None``: the budget).
        enable_block_reuse: Reuse cached prompt prefixes (the config's field).
        enable_partial_reuse: Reuse a partly matching block by copy (the config's field).
        swa_reuse_policy: ``"invalidate"`` or ``"placeholder"`` (the config's field): what
            reuse does with sliding-window blocks that another request reclaimed.
        protect_reused_blocks: Segmented LRU (the config's field); ``False`` evicts in plain
            LRU order per priority.
        lend_free_memory: The windows lend each other free memory at run time (the config's
            field): the shares set the initial split only.
        host_cache_bytes: Secondary (host) memory for offloaded reusable blocks (the config's
            ``host_cache_size``; 0: none).
        disk_cache_bytes: Disk tier below the host cache (the config's ``disk_cache_size``;
            needs ``host_cache_bytes``; 0: none; used only with reuse).
        expected_seq_len: Typical sequence length for the ``"auto"`` share policy (``None``:
            the workload's mean prompt + output length).
        draft_tokens: Draft tokens proposed per generation step (speculative decoding).
        draft_acceptance: Probability that each successive draft token is accepted.
        seed: Seeds the draft acceptance.
        check_invariants: Call ``check_invariants()`` after every step (slow).
    """

    model: str | ModelPreset = DEFAULT_MODEL
    memory_bytes: int | None = None
    shares: str | Sequence[float] | None = None
    scheduler: str = "max_utilization"
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    max_seq_len: int | None = None
    tokens_per_block: int = 32
    max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS
    chunked_prefill: bool = True
    max_chunk_size: int | None = None
    enable_block_reuse: bool = True
    enable_partial_reuse: bool = True
    swa_reuse_policy: str = "placeholder"
    protect_reused_blocks: bool = True
    lend_free_memory: bool = False
    host_cache_bytes: int = 0
    disk_cache_bytes: int = 0
    expected_seq_len: int | None = None
    draft_tokens: int = 0
    draft_acceptance: float = 0.6
    seed: int = 0
    check_invariants: bool = False

    @property
    def disk_bytes_used(self) -> int:
        """The disk tier a run builds: none without reuse (nothing is stored)."""
        return self.disk_cache_bytes if self.enable_block_reuse else 0


_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineOptions))


def engine_options(
    options: EngineOptions | None, changes: Mapping[str, Any], *, caller: str
) -> EngineOptions:
    """``options`` (``None``: the defaults) with the keyword ``changes`` applied.

    Raises:
        TypeError: ``options`` is not an :class:`EngineOptions`, or a keyword is no field
            (named, as Python names an unexpected keyword argument).
    """
    if options is None:
        options = EngineOptions()
    elif not isinstance(options, EngineOptions):
        raise TypeError(
            f"{caller}() options must be a kvcache.simulate.EngineOptions, got "
            f"{type(options).__name__}"
        )
    unknown = sorted(set(changes) - _FIELDS)
    if unknown:
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}")
    return dataclasses.replace(options, **changes) if changes else options
