"""How kvcache's window pools lie in vLLM's one block-id space.

vLLM allocates ``num_blocks`` pages of one size and lets every KV cache group use any of them
(block 0 is its null block): a block id names pages in the tensors a group's layers share with
the other groups, so one id may belong to one group at a time. kvcache keeps one pool per
attention window instead. A window served by ``G`` vLLM groups (five sliding-window groups of
a Gemma-3, one full-attention group) gets ``n`` kvcache blocks, and each kvcache block of that
window stands for ``G`` vLLM blocks, one per group, so it costs ``G`` pages. The windows lie
one after the other from id 1 up; inside a window, group ``j``'s ids are ``base + j * n + k``
for kvcache block ``k``. When the windows lend each other memory (kvcache's
``lend_free_memory``, the default here with several windows), kvcache block ``k`` of a window
of ``G`` groups is ``G`` consecutive pages of one arena: group ``j``'s id is ``1 + G * k + j``,
and a slab of pages a window lends moves to the other window with ids nobody holds.
How many blocks each window gets is kvcache's sizing: the memory
budget is the ``num_blocks - 1`` pages and the window shares (``"equal"`` by default,
``KVCACHE_WINDOW_SIZE_SHARES``, ``TRTLLM_WINDOW_SIZE_SHARES`` or the ``window_size_shares``
option, ``"auto"`` included) split it.

Nothing here imports vLLM: the layout is plain arithmetic over the groups' windows.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.manager import KVCacheManager
from kvcache.cache.sizing import blocks_per_window, resolve_share_policy

#: Bytes of one page in the model kvcache sizes vLLM's pages with: one KV head of size one in
#: float32, per token (``kv_factor`` 2). Only the ratio of the budget to a page matters.
_PAGE_HEAD_DIM = 1
_EVENT_BUFFER = 1 << 20  # kvcache events kept between two steps when vLLM publishes events


@dataclass(frozen=True)
class GroupLayout:
    """Where each vLLM KV cache group's blocks lie in vLLM's block-id space.

    Attributes:
        group_windows: kvcache window of every vLLM group, in group order (full attention as
            ``max_seq_len``).
        window_sizes: The distinct windows, ascending (kvcache's order).
        window_groups: Per window (in ``window_sizes`` order), the vLLM groups it serves.
        blocks: kvcache primary blocks per window.
        group_offsets: Per vLLM group, the vLLM id of its window's kvcache block 0.
        group_strides: Per vLLM group, how far apart consecutive kvcache blocks' ids are.
        num_blocks: vLLM's block count (null block included).
        lends: Whether the windows lend each other memory (ids interleaved in one arena).
    """

    group_windows: tuple[int, ...]
    window_sizes: tuple[int, ...]
    window_groups: tuple[tuple[int, ...], ...]
    blocks: Mapping[int, int]
    group_offsets: tuple[int, ...]
    group_strides: tuple[int, ...]
    num_blocks: int
    lends: bool = False

    @property
    def used_pages(self) -> int:
        """vLLM pages the windows' blocks cover (at most ``num_blocks - 1``)."""
        return sum(
            len(groups) * self.blocks[w]
            for w, groups in zip(self.window_sizes, self.window_groups, strict=True)
        )

    def vllm_ids(self, group: int, kvcache_ids: Sequence[int]) -> list[int]:
        """vLLM block ids of ``group`` for a window's kvcache ids (``NULL_BLOCK`` -> 0)."""
        base = self.group_offsets[group]
        stride = self.group_strides[group]
        if stride == 1:
            return [base + b if b >= 0 else 0 for b in kvcache_ids]
        return [base + stride * b if b >= 0 else 0 for b in kvcache_ids]


def page_model(num_groups: int) -> ModelConfig:
    """The model kvcache sizes with: one layer per vLLM group, each block one page."""
    return ModelConfig(
        num_layers=num_groups, num_kv_heads=1, head_dim=_PAGE_HEAD_DIM, dtype="float32"
    )


def page_bytes(tokens_per_block: int) -> int:
    """Bytes of one block of one :func:`page_model` layer."""
    return 2 * _PAGE_HEAD_DIM * 4 * tokens_per_block


def plan_layout(
    group_windows: Sequence[int | None],
    config: KvCacheConfig,
    *,
    num_blocks: int,
    max_seq_len: int,
    max_batch_size: int,
) -> GroupLayout:
    """Sizes kvcache's windows from vLLM's pages and lays their ids out.

    Args:
        group_windows: Sliding window of every vLLM group in group order, ``None`` for full
            attention.
        config: kvcache's configuration; ``max_attention_window`` must already be
            ``group_windows`` (one entry per group).
        num_blocks: vLLM's ``num_blocks`` (block 0 is the null block).
        max_seq_len: kvcache's ``max_seq_len``.
        max_batch_size: Most sequences at once (for the ``"auto"`` share policy).

    Raises:
        ValueError: The pages cannot hold one block per window, or a share leaves a window
            with no block.
    """
    if num_blocks < 2:
        raise ValueError(f"vLLM has {num_blocks} KV blocks; kvcache needs at least 2")
    model = page_model(len(group_windows))
    per_group = config.attention_window_per_layer(len(group_windows), max_seq_len)
    windows = sorted(set(per_group))
    sized = blocks_per_window(
        model,
        config,
        max_seq_len,
        (num_blocks - 1) * page_bytes(config.tokens_per_block),
        max_batch_size=max_batch_size,
    )
    blocks = {w: sized[w][0] for w in windows}
    groups = tuple(tuple(g for g, gw in enumerate(per_group) if gw == w) for w in windows)
    lends = config.lend_free_memory and len(windows) > 1
    offsets = [0] * len(per_group)
    strides = [1] * len(per_group)
    base = 1
    for w, members in zip(windows, groups, strict=True):
        for j, g in enumerate(members):
            if lends:
                offsets[g], strides[g] = 1 + j, len(members)
            else:
                offsets[g] = base + j * blocks[w]
        base += len(members) * blocks[w]
    layout = GroupLayout(
        group_windows=tuple(per_group),
        window_sizes=tuple(windows),
        window_groups=groups,
        blocks=blocks,
        group_offsets=tuple(offsets),
        group_strides=tuple(strides),
        num_blocks=num_blocks,
        lends=lends,
    )
    if layout.used_pages > num_blocks - 1:  # sizing floors every share: never expected
        raise ValueError(
            f"kvcache's windows need {layout.used_pages} pages, vLLM has {num_blocks - 1}"
        )
    return layout


def kvcache_config_for(
    group_windows: Sequence[int | None],
    *,
    block_size: int,
    enable_caching: bool,
    enable_events: bool,
    max_num_batched_tokens: int,
    window_size_shares: Any = None,
    swa_reuse_policy: str = "placeholder",
    lend_free_memory: bool = True,
) -> KvCacheConfig:
    """kvcache's configuration for vLLM's groups (virtual backend: vLLM owns the memory).

    Without ``window_size_shares`` and with neither ``KVCACHE_WINDOW_SIZE_SHARES`` nor
    ``TRTLLM_WINDOW_SIZE_SHARES`` set, the windows share vLLM's pages by kvcache's ``"auto"``
    policy (each window's demand under chunked prefill first): vLLM's own manager lets every
    group draw from one pool, which an equal split of a Gemma-3 (five sliding groups, one
    full) would leave mostly idle.
    """
    if window_size_shares is None and resolve_share_policy(None)[1] == "default":
        window_size_shares = "auto"
    return KvCacheConfig(
        tokens_per_block=block_size,
        max_attention_window=list(group_windows),
        backend="virtual",
        enable_block_reuse=enable_caching,
        enable_partial_reuse=False,
        onboard_blocks=False,
        window_size_shares=window_size_shares,
        swa_reuse_policy=swa_reuse_policy,
        max_num_batched_tokens=max_num_batched_tokens,
        lend_free_memory=lend_free_memory and len(set(group_windows)) > 1,
        event_buffer_max_size=_EVENT_BUFFER if enable_events else 0,
    )


def build_manager(
    layout: GroupLayout, config: KvCacheConfig, *, max_seq_len: int, max_batch_size: int
) -> KVCacheManager:
    """The kvcache manager for a layout, with exactly the layout's blocks per window.

    Raises:
        ValueError: Under lending, kvcache's arena (the split rounded to whole slabs) needs
            more pages than vLLM has.
    """
    kv = KVCacheManager.from_blocks(
        page_model(len(layout.group_windows)),
        config,
        dict(layout.blocks),
        max_seq_len=max_seq_len,
        max_batch_size=max_batch_size,
    )
    if layout.lends:
        pool = kv.pools[0]
        pages = pool["num_primary_blocks"] * len(pool["layers"])
        if pages > layout.num_blocks - 1:
            raise ValueError(
                f"kvcache's arena needs {pages} pages, vLLM has {layout.num_blocks - 1}"
            )
    return kv
