"""PyTorch views of the KV cache pools and a reference paged-attention function.

Optional: needs the ``torch`` extra (``pip install 'kvcache[torch]'``); ``import kvcache``
never imports torch. Every view is zero-copy: it aliases the manager's pool memory (host
memory on the ``host`` backend, device memory on ``cuda``) and keeps the manager alive.

Layout (docs/design.md): a pool is ``[blocks, layers_in_pool, kv_factor, num_kv_heads,
tokens_per_block, head_dim]``; one layer's view is ``[blocks, kv_factor, num_kv_heads,
tokens_per_block, head_dim]``. Token ``t`` of a sequence lives in block
``block_table[t // tokens_per_block]`` at offset ``t % tokens_per_block``.

Example:
    >>> import torch
    >>> from kvcache import KVCacheManager, KvCacheConfig, ModelConfig
    >>> from kvcache.torch import block_tables, layer_kv, paged_attention, write_kv
    >>> model = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=2, dtype="float32")
    >>> config = KvCacheConfig(tokens_per_block=2, max_attention_window=[None], backend="host")
    >>> kv = KVCacheManager.from_blocks(model, config, {8: 4}, max_seq_len=8, max_batch_size=1)
    >>> kv.add_sequence(0, [5, 6, 7])
    0
    >>> k_cache, v_cache = layer_kv(kv, 0)
    >>> table = block_tables(kv, [0])[0]                 # block ids per position: [[0, 1]]
    >>> rows, pos = torch.zeros(3, dtype=torch.long), torch.arange(3)
    >>> k = torch.ones(3, 1, 2); v = torch.arange(6.0).reshape(3, 1, 2)
    >>> write_kv(k_cache, v_cache, table, rows, pos, k, v)
    >>> out = paged_attention(torch.ones(3, 1, 2), k_cache, v_cache, table, rows, pos, scale=1.0)
    >>> out[:, 0].tolist()            # equal scores: the mean of the values attended so far
    [[0.0, 1.0], [1.0, 2.0], [2.0, 3.0]]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcache._extras import missing_extra

try:
    import torch
    from torch.utils.dlpack import from_dlpack
except ImportError as e:
    raise missing_extra("kvcache.torch", "torch", e) from None

from kvcache.cache.fields import is_int
from kvcache.cache.manager import KVCacheManager

__all__ = [
    "TORCH_DTYPES",
    "block_offsets",
    "block_tables",
    "layer_kv",
    "layer_view",
    "paged_attention",
    "pool_view",
    "pool_views",
    "write_kv",
]

#: torch dtype of each KV cache dtype name.
TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}
# Same-size integer types the array interfaces carry (they have no bfloat16 or fp8).
_RAW_TYPESTR = {4: "<u4", 2: "<u2", 1: "|u1"}
_RAW_TORCH = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


def _check_memory(manager: KVCacheManager) -> None:
    if not isinstance(manager, KVCacheManager):
        raise TypeError(f"manager must be a kvcache.KVCacheManager, got {type(manager).__name__}")
    if manager.backend == "virtual":
        raise ValueError("the virtual backend has no memory to view; use host or cuda")


def layer_view(manager: KVCacheManager, layer: int) -> torch.Tensor:
    """Zero-copy view of one layer's K/V memory (DLPack).

    Returns:
        ``[primary_blocks, kv_factor, num_kv_heads, tokens_per_block, head_dim]`` in the
        cache dtype, on the CPU (``host`` backend) or the CUDA device (``cuda``).

    Raises:
        TypeError: ``manager`` is not a ``KVCacheManager``.
        ValueError: The ``virtual`` backend, or ``layer`` out of range.
    """
    _check_memory(manager)
    num_layers = len(manager.layer_to_pool)
    if not is_int(layer) or not 0 <= layer < num_layers:
        raise ValueError(f"layer must be in 0..{num_layers - 1}, got {layer!r}")
    return from_dlpack(manager._layer_buffer(layer))


def layer_kv(manager: KVCacheManager, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-copy K and V views of one layer, each ``[blocks, heads, tokens_per_block, dim]``.

    Raises:
        ValueError: As :func:`layer_view`, or a K-only cache (``kv_factor`` 1).
    """
    view = layer_view(manager, layer)
    if view.shape[1] != 2:
        raise ValueError("layer_kv needs kv_factor 2 (K and V); use layer_view for K-only caches")
    return view[:, 0], view[:, 1]


class _ArrayHolder:
    """Exposes a pool's memory through the array interfaces; keeps the manager alive."""

    def __init__(self, manager: KVCacheManager, key: str, interface: dict[str, Any]) -> None:
        self.manager = manager
        setattr(self, key, interface)


def pool_view(manager: KVCacheManager, pool: int) -> torch.Tensor:
    """Zero-copy view of a whole pool's primary memory.

    Returns:
        ``[primary_blocks, layers_in_pool, kv_factor, num_kv_heads, tokens_per_block,
        head_dim]`` in the cache dtype; ``[:, i]`` equals :func:`layer_view` of the pool's
        ``i``-th layer. Blocks are ``pools[pool]["block_stride"]`` bytes apart (under
        ``lend_free_memory`` every window's pools start at the shared arena and overlap as
        views; the blocks a window owns never do).

    Raises:
        ValueError: The ``virtual`` backend or ``pool`` out of range.
    """
    _check_memory(manager)
    pools = manager.pools
    if not is_int(pool) or not 0 <= pool < len(pools):
        raise ValueError(f"pool must be in 0..{len(pools) - 1}, got {pool!r}")
    info = pools[pool]
    first = layer_view(manager, int(info["layers"][0]))
    blocks, kv_factor, heads, tpb, dim = first.shape
    layers = len(info["layers"])
    item = first.element_size()
    shape = (blocks, layers, kv_factor, heads, tpb, dim)
    if int(info["block_bytes"]) != layers * kv_factor * heads * tpb * dim * item:
        raise ValueError(f"pool {pool} does not have the documented dense layout")
    strides = [item]
    for n in reversed(shape[2:]):
        strides.insert(0, strides[0] * n)
    # Blocks sit block_stride bytes apart: block_bytes, or more when the windows share memory
    # (lend_free_memory interleaves a window's pools in one arena).
    strides.insert(0, int(info["block_stride"]))
    iface: dict[str, Any] = {
        "shape": shape,
        "typestr": _RAW_TYPESTR[item],
        "data": (int(info["primary_ptr"]), False),
        "strides": tuple(strides),
        "version": 3,
    }
    if first.is_cuda:
        raw = torch.as_tensor(
            _ArrayHolder(manager, "__cuda_array_interface__", iface), device=first.device
        )
    else:
        raw = torch.from_numpy(np.asarray(_ArrayHolder(manager, "__array_interface__", iface)))
    return raw.view(_RAW_TORCH[item]).view(first.dtype)


def pool_views(manager: KVCacheManager) -> list[torch.Tensor]:
    """:func:`pool_view` of every pool, in the manager's global pool order."""
    return [pool_view(manager, p) for p in range(manager.num_pools)]


def block_offsets(
    manager: KVCacheManager, request_ids: Sequence[int], *, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """The batch's block-offset table (``copy_block_offsets``) as an int32 tensor.

    Returns:
        ``[num_pools, len(request_ids), kv_factor, width]``, ``width`` the longest row's block
        positions; entries as ``copy_block_offsets`` (``OFFSET_SENTINEL`` = -1 where none).
    """
    ids = [int(r) for r in request_ids]
    shape = (manager.num_pools, len(ids), manager.kv_factor, manager.max_blocks_per_seq)
    table = np.empty(shape, dtype=np.int32)
    width = manager.copy_block_offsets(table, ids)
    return torch.from_numpy(np.ascontiguousarray(table[..., :width])).to(device)


def block_tables(
    manager: KVCacheManager, request_ids: Sequence[int], *, device: torch.device | str = "cpu"
) -> list[torch.Tensor]:
    """Block ids per pool from :func:`block_offsets`: one int64 ``[rows, width]`` tensor per
    pool, ``-1`` where a position has no block (released by a sliding window, or past the
    row's end). Index a layer's :func:`layer_kv` views with them."""
    offsets = block_offsets(manager, request_ids, device=device).to(torch.int64)
    out = []
    for p, info in enumerate(manager.pools):
        # K/V slabs from one block to the next (layers x kv_factor unless lending).
        slabs = len(info["layers"]) * manager.kv_factor
        per_block = int(info["block_stride"]) * slabs // int(info["block_bytes"])
        k = offsets[p, :, 0]
        out.append(torch.where(k >= 0, torch.div(k, per_block, rounding_mode="floor"), -1))
    return out


def _check_tokens(
    block_table: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, tpb: int
) -> tuple[torch.Tensor, torch.Tensor]:
    if block_table.dim() != 2:
        raise ValueError(f"block_table must be [rows, width], got shape {tuple(block_table.shape)}")
    if rows.shape != positions.shape or rows.dim() != 1:
        raise ValueError("rows and positions must be 1-D tensors of the same length")
    if rows.numel() == 0:
        return rows, positions
    if int(rows.min()) < 0 or int(rows.max()) >= block_table.shape[0]:
        raise ValueError(f"rows must be in 0..{block_table.shape[0] - 1}")
    if int(positions.min()) < 0 or int(positions.max()) >= block_table.shape[1] * tpb:
        raise ValueError(f"positions must be in 0..{block_table.shape[1] * tpb - 1}")
    return rows.long(), positions.long()


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
) -> None:
    """Writes the K/V of ``T`` tokens into their blocks.

    Args:
        k_cache, v_cache: One layer's views, ``[blocks, kv_heads, tokens_per_block, dim]``.
        block_table: ``[rows, width]`` block ids (``-1``: no block).
        rows, positions: ``[T]``: each token's row in ``block_table`` and its position.
        key, value: ``[T, kv_heads, dim]``.

    Raises:
        ValueError: Bad shapes, or a token whose position has no block.
    """
    tpb = k_cache.shape[2]
    rows, positions = _check_tokens(block_table, rows, positions, tpb)
    blocks = block_table[rows, torch.div(positions, tpb, rounding_mode="floor")]
    if bool((blocks < 0).any()):
        raise ValueError("a token's position has no block (NULL_BLOCK): cannot write its KV")
    offsets = positions % tpb
    k_cache[blocks, :, offsets] = key.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = value.to(v_cache.dtype)


def paged_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    *,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Reference attention of ``T`` query tokens over K/V read through a block table.

    Query token ``t`` (row ``rows[t]``, position ``positions[t]``) attends the key positions
    ``j`` of its row with ``j <= positions[t]`` and, with a ``window``,
    ``j > positions[t] - window`` (the last ``window`` tokens, itself included). Any mix of
    prefill chunks (cached prefix plus the chunk, whose K/V :func:`write_kv` wrote first) and
    decode tokens works in one call. Only blocks of present table entries are read: a
    position whose entry is negative (``NULL_BLOCK``) is never touched, and a query that
    would need one raises.

    Args:
        query: ``[T, num_heads, dim]``; ``num_heads`` a multiple of the cache's KV heads (GQA).
        k_cache, v_cache: ``[blocks, kv_heads, tokens_per_block, dim]``.
        block_table: ``[rows, width]`` block ids (``-1``: no block).
        rows, positions: ``[T]`` integer tensors.
        scale: Score scale (``dim ** -0.5`` usually).
        window: Sliding window in tokens (``None``: full causal attention).
        sinks: ``[num_heads]`` attention-sink logits (gpt-oss): one extra logit per head in
            the softmax's denominator, attending nothing.
        softcap: Logit soft-capping (Gemma-2): ``softcap * tanh(scores / softcap)``.

    Returns:
        ``[T, num_heads, dim]`` in the query's dtype.

    Raises:
        ValueError: Bad shapes, or a query that must attend a position without a block.
    """
    if query.dim() != 3:
        raise ValueError(f"query must be [T, heads, dim], got shape {tuple(query.shape)}")
    _, kv_heads, tpb, dim = k_cache.shape
    heads = query.shape[1]
    if heads % kv_heads or query.shape[2] != dim:
        raise ValueError(
            f"query [T, {heads}, {query.shape[2]}] does not match the cache's {kv_heads} KV "
            f"heads of dim {dim}"
        )
    if window is not None and window <= 0:
        raise ValueError(f"window must be positive or None, got {window}")
    rows, positions = _check_tokens(block_table, rows, positions, tpb)
    num_rows, width = block_table.shape
    table = block_table.long()
    present = table >= 0
    # Gather only the present blocks: entries without a block stay zero and are never read.
    dtype = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    keys = torch.zeros(num_rows, width, kv_heads, tpb, dim, dtype=dtype, device=query.device)
    values = torch.zeros_like(keys)
    keys[present] = k_cache[table[present]].to(dtype)
    values[present] = v_cache[table[present]].to(dtype)
    span = width * tpb
    keys = keys.permute(0, 2, 1, 3, 4).reshape(num_rows, kv_heads, span, dim)
    values = values.permute(0, 2, 1, 3, 4).reshape(num_rows, kv_heads, span, dim)

    j = torch.arange(span, device=query.device)
    pos = positions[:, None]
    wanted = j[None, :] <= pos
    if window is not None:
        wanted &= j[None, :] > pos - window
    have = present.repeat_interleave(tpb, dim=1)[rows]  # [T, span]
    if bool((wanted & ~have).any()):
        raise ValueError("a query must attend a position without a block (released or missing)")

    group = heads // kv_heads
    q = query.to(dtype).reshape(-1, kv_heads, group, dim)  # [T, kvh, g, d]
    k_t = keys[rows]  # [T, kvh, span, d]
    # Slots not attended (past a row's end, outside the window) may hold stale bytes, even
    # NaN: their probability is 0, and 0 * NaN would still poison the sum.
    v_t = values[rows].masked_fill(~wanted[:, None, :, None], 0.0)
    scores = torch.einsum("thgd,thsd->thgs", q, k_t) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~wanted[:, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.to(dtype).reshape(1, kv_heads, group, 1).expand(scores.shape[0], -1, -1, 1)
        logits = torch.cat([scores, sink], dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = torch.softmax(logits, dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("thgs,thsd->thgd", probs, v_t)
    return out.reshape(-1, heads, dim).to(query.dtype)
