"""kvcache: a KV cache manager for LLM inference engines with variable sliding windows.

The native core (``kvcache._core``) keeps one block pool per attention window size, writes
every window linearly and releases blocks that left a sliding window. The package is laid out
in rooms by job, each importing only the rooms before it:

* :mod:`kvcache.cache`: the manager API (configuration, sizing, ``KVCacheManager``, block keys);
* :mod:`kvcache.serving`: the serving step (requests, the scheduler, the resource manager);
* :mod:`kvcache.fleet`: events, the router index and the shared tier (``kvcache[events]``);
* :mod:`kvcache.reference`: the reference engine and the torch bridge (``kvcache[torch]``);
* :mod:`kvcache.simulate` and :mod:`kvcache.cli`: the command line and its simulations.

The documented import paths (``kvcache.config``, ``kvcache.events``, ``kvcache.engine``, ...)
are the same module objects as the rooms' modules.
"""

# No ``from __future__ import annotations`` here: it would leave the name ``annotations`` in
# the package's namespace, and this module annotates nothing.
from kvcache._core import (
    CudaError,
    DeviceOOMError,
    InternalError,
    KVCacheError,
    OutOfBlocksError,
    PreparedPrompt,
)
from kvcache.cache.block_keys import block_hashes
from kvcache.cache.config import KvCacheConfig, ModelConfig, StateTensor
from kvcache.cache.manager import (
    NULL_BLOCK,
    OFFSET_SENTINEL,
    KVCacheEvent,
    KVCacheManager,
    KvCacheStats,
    available_memory_bytes,
    cuda_available,
)
from kvcache.cache.sizing import (
    blocks_per_window,
    bytes_per_token,
    format_size,
    parse_size,
    window_size_shares,
    window_sizes,
)
from kvcache.models import list_models, load_model
from kvcache.serving.resource_manager import KVCacheResourceManager, Request, ScheduledBatch
from kvcache.serving.scheduler import CapacityScheduler

__version__ = "0.1.0"

__all__ = [
    "NULL_BLOCK",
    "OFFSET_SENTINEL",
    "CapacityScheduler",
    "CudaError",
    "DeviceOOMError",
    "InternalError",
    "KVCacheError",
    "KVCacheEvent",
    "KVCacheManager",
    "KVCacheResourceManager",
    "KvCacheConfig",
    "KvCacheStats",
    "ModelConfig",
    "OutOfBlocksError",
    "PreparedPrompt",
    "Request",
    "ScheduledBatch",
    "StateTensor",
    "__version__",
    "available_memory_bytes",
    "block_hashes",
    "blocks_per_window",
    "bytes_per_token",
    "cuda_available",
    "format_size",
    "list_models",
    "load_model",
    "parse_size",
    "window_size_shares",
    "window_sizes",
]


#: Submodules documented as import paths; ``dir(kvcache)`` lists those already imported.
_PUBLIC_SUBMODULES = frozenset(
    {
        "cache",
        "cli",
        "distributed",
        "engine",
        "events",
        "fleet",
        "models",
        "reference",
        "router",
        "scheduler",
        "serving",
        "shared_cache",
        "simulate",
        "sizing",
        "torch",
        "vllm",
    }
)


def __dir__() -> list[str]:
    """The public API (``__all__``) and the documented submodules imported so far, not the
    package's internal modules (``config``, ``fields``, ...) nor ``_core``."""
    loaded = [n for n in _PUBLIC_SUBMODULES if n in globals()]
    return sorted([*__all__, *loaded])
