"""``kvcache.vllm.Scheduler``: vLLM 0.32's scheduler with kvcache as its KV cache manager.

vLLM builds its scheduler from ``scheduler_cls`` (``LLM(..., scheduler_cls=...)``,
``--scheduler-cls``); this subclass lets vLLM construct everything as usual, then replaces
``self.kv_cache_manager`` with a :class:`kvcache.vllm.adapter.VllmKVCacheManager` sized from the
same ``num_blocks``. What this version cannot run correctly is refused here, at start-up.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import vllm  # type: ignore[import-not-found]
from vllm.v1.core.sched.scheduler import (  # type: ignore[import-not-found]
    Scheduler as _VllmScheduler,
)
from vllm.v1.kv_cache_interface import (  # type: ignore[import-not-found]
    FullAttentionSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvcache.vllm.adapter import VllmKVCacheManager
from kvcache.vllm.layout import build_manager, kvcache_config_for, plan_layout

#: The vLLM release the adapter is written and tested against (the scheduler interface is not
#: public in vLLM and changes between releases).
SUPPORTED_VLLM_VERSION = "0.32.0"


#: The KV cache specs kvcache serves: full attention and sliding windows (MLA included).
_SPECS = (FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, SlidingWindowMLASpec)


class UnsupportedConfigurationError(ValueError):
    """A vLLM configuration the kvcache scheduler refuses at start-up (it would run wrong)."""


def _refusals(scheduler: Any) -> list[str]:
    """What in this engine's configuration kvcache.vllm does not support, in words."""
    cfg = scheduler.vllm_config
    out: list[str] = []
    if vllm.__version__.split("+")[0] != SUPPORTED_VLLM_VERSION and not os.environ.get(
        "KVCACHE_VLLM_ANY_VERSION"
    ):
        out.append(
            f"vLLM {vllm.__version__} (kvcache.vllm is tested with {SUPPORTED_VLLM_VERSION}; "
            "set KVCACHE_VLLM_ANY_VERSION=1 to try anyway)"
        )
    if cfg.kv_transfer_config is not None:
        out.append("KV connectors (kv_transfer_config)")
    if cfg.ec_transfer_config is not None:
        out.append("encoder-cache connectors (ec_transfer_config)")
    if cfg.speculative_config is not None or scheduler.num_lookahead_tokens:
        out.append("speculative decoding (speculative_config)")
    if scheduler.is_encoder_decoder:
        out.append("encoder-decoder models")
    if cfg.model_config.is_multimodal_model:
        out.append("multimodal models (their inputs' hashes are not passed to kvcache yet)")
    if cfg.scheduler_config.async_scheduling:
        out.append("async scheduling (releases would need delaying by one step)")
    if scheduler.dcp_world_size > 1 or scheduler.pcp_world_size > 1:
        out.append("decode / prefill context parallelism")
    if scheduler.num_prefill_lookahead or scheduler.prefix_replay_tokens:
        out.append("prefill lookahead or prefix replay")
    kv_config = scheduler.kv_cache_config
    if getattr(kv_config, "needs_kv_cache_zeroing", False):
        out.append("KV cache groups that need zeroing")
    if scheduler.hash_block_size != scheduler.block_size:
        out.append(f"a hash block size ({scheduler.hash_block_size}) unlike the block size")
    for i, group in enumerate(kv_config.kv_cache_groups):
        spec = group.kv_cache_spec
        kind = type(spec).__name__
        if type(spec) not in _SPECS:
            out.append(f"KV cache group {i} of kind {kind} (full or sliding-window attention only)")
        elif isinstance(spec, FullAttentionSpec) and (
            spec.sliding_window is not None or spec.attention_chunk_size is not None
        ):
            out.append(f"KV cache group {i}: {kind} with a sliding window or attention chunks")
        elif getattr(spec, "extra_retained_tokens", 0):
            out.append(f"KV cache group {i}: extra retained sliding-window tokens")
        elif spec.block_size != scheduler.block_size:
            out.append(f"KV cache group {i}: block size {spec.block_size}")
    return out


def _check_one_request_fits(scheduler: Any, kv: Any, layout: Any) -> None:
    """Every window must hold one request of ``max_model_len`` tokens alone (vLLM checks
    the same of its one pool): a window that cannot would leave such a request waiting
    forever."""
    chunked = bool(scheduler.scheduler_config.enable_chunked_prefill)
    chunk = int(scheduler.max_num_scheduled_tokens) if chunked else None
    n = int(scheduler.max_model_len)
    alone = kv.get_blocks_to_run_alone(n, n, chunk_size=chunk)
    need = dict(zip(layout.window_sizes, alone, strict=True))
    if kv.fits_when_empty(need):  # under lending: in the whole arena
        return
    short = ", ".join(f"window {w}: {need[w]} (has {layout.blocks[w]})" for w in need)
    raise UnsupportedConfigurationError(
        f"vLLM's {layout.num_blocks} KV blocks, split by kvcache's window shares, cannot hold "
        f"one {n}-token request, which needs {short} blocks. Give the KV cache more memory, "
        "lower max_model_len or max_num_batched_tokens, or change the shares "
        "(KVCACHE_WINDOW_SIZE_SHARES, or scheduler_class(window_size_shares=...))"
    )


class Scheduler(_VllmScheduler):  # type: ignore[misc]
    """vLLM's scheduler, with kvcache handing out every KV block.

    Use it with ``LLM(model, scheduler_cls="kvcache.vllm.Scheduler", ...)`` or
    ``vllm serve MODEL --scheduler-cls kvcache.vllm.Scheduler``. vLLM's memory split between
    the KV cache groups follows kvcache's window shares (``KVCACHE_WINDOW_SIZE_SHARES``,
    ``TRTLLM_WINDOW_SIZE_SHARES``, else equal); :func:`scheduler_class` sets them and other
    kvcache options in code.

    Raises:
        UnsupportedConfigurationError: The engine uses something this version does not
            support (KV connectors, speculative decoding, encoder-decoder or multimodal
            models, async scheduling, Mamba or other non-attention groups, ...); the message
            lists every such thing.
    """

    kv_cache_manager: Any

    #: kvcache options of this class (see :func:`scheduler_class`).
    kvcache_options: dict[str, Any] = {}  # noqa: RUF012 (replaced, never mutated)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        refused = _refusals(self)
        if refused:
            raise UnsupportedConfigurationError(
                "kvcache.vllm.Scheduler does not support: " + "; ".join(refused)
            )
        vllm_manager = self.kv_cache_manager
        groups = self.kv_cache_config.kv_cache_groups
        windows = [getattr(g.kv_cache_spec, "sliding_window", None) for g in groups]
        caching = bool(self.cache_config.enable_prefix_caching)
        options = dict(self.kvcache_options)
        config = kvcache_config_for(
            windows,
            block_size=self.block_size,
            enable_caching=caching,
            enable_events=self.enable_kv_cache_events,
            max_num_batched_tokens=int(self.max_num_scheduled_tokens),
            window_size_shares=options.pop("window_size_shares", None),
            swa_reuse_policy=options.pop("swa_reuse_policy", "placeholder"),
            lend_free_memory=options.pop("lend_free_memory", True),
        )
        if options:
            raise TypeError(f"unknown kvcache.vllm options: {sorted(options)}")
        # kvcache's sequences hold at most max_model_len tokens; one block more keeps the
        # full-attention window a window of its own whatever the sliding windows are.
        max_seq_len = self.max_model_len + self.block_size
        max_batch = 2 * self.max_num_running_reqs
        layout = plan_layout(
            windows,
            config,
            num_blocks=self.kv_cache_config.num_blocks,
            max_seq_len=max_seq_len,
            max_batch_size=max_batch,
        )
        kv = build_manager(layout, config, max_seq_len=max_seq_len, max_batch_size=max_batch)
        _check_one_request_fits(self, kv, layout)
        self.kv_cache_manager = VllmKVCacheManager(
            kv,
            layout,
            vllm_manager,
            enable_caching=caching,
            log_stats=self.log_stats,
            enable_kv_cache_events=self.enable_kv_cache_events,
            watermark=float(self.scheduler_config.watermark),
            max_chunk_tokens=int(self.max_num_scheduled_tokens),
        )


def scheduler_class(**options: Any) -> type[Scheduler]:
    """A :class:`Scheduler` subclass with kvcache options, for ``scheduler_cls=``.

    Args:
        **options: ``window_size_shares`` (``"equal"``, ``"proportional"``, ``"auto"`` or one
            number per window in ascending window order: how vLLM's KV memory is split between
            the windows; under lending, the initial split), ``swa_reuse_policy``
            (``"placeholder"`` or ``"invalidate"``) and ``lend_free_memory`` (default
            ``True``: a window out of free blocks takes a wholly free slab of another's).

    Raises:
        TypeError: An unknown option.
    """
    known = {"window_size_shares", "swa_reuse_policy", "lend_free_memory"}
    unknown = set(options) - known
    if unknown:
        raise TypeError(f"unknown kvcache.vllm options: {sorted(unknown)}")
    make: Callable[..., type[Scheduler]] = type
    return make("Scheduler", (Scheduler,), {"kvcache_options": dict(options)})
