"""kvcache: a KV cache manager for LLM inference engines with variable sliding windows.

The native core (``kvcache._core``) keeps one block pool per attention window size, writes
every window linearly and releases blocks that left a sliding window. This package adds
configuration, memory sizing per window and the ``KVCacheManager`` facade.
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
from kvcache.config import KvCacheConfig, ModelConfig, StateTensor
from kvcache.hashing import block_hashes
from kvcache.manager import (
    NULL_BLOCK,
    OFFSET_SENTINEL,
    KVCacheEvent,
    KVCacheManager,
    KvCacheStats,
    available_memory_bytes,
    cuda_available,
)
from kvcache.models import list_models, load_model
from kvcache.resource_manager import KVCacheResourceManager, Request, ScheduledBatch
from kvcache.scheduler import CapacityScheduler
from kvcache.sizing import (
    blocks_per_window,
    bytes_per_token,
    format_size,
    parse_size,
    window_size_shares,
    window_sizes,
)

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
        "distributed",
        "engine",
        "events",
        "models",
        "router",
        "scheduler",
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
