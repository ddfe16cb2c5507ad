"""Ranks that agree: one pool size for every rank of a ``torch.distributed`` group.

Tensor-parallel ranks run the same schedule, so their block tables must be identical, and so
must their pools, although each rank sizes from its own free memory. ``KVCacheManager(...,
process_group=group)`` and :func:`kvcache.sizing.blocks_per_window` (``process_group=``)
min-reduce the blocks per window over the group (TensorRT-LLM does the same over MPI), so
every rank gets the smallest rank's pools.

``torch`` is imported only when a group is passed: this module itself imports nothing
optional.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

__all__ = ["min_reduce_blocks"]


def _windows_digest(windows: list[int]) -> int:
    """A stable 62-bit digest of the window list (equal on every rank for equal lists)."""
    raw = ",".join(str(w) for w in windows).encode()
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "little") >> 2


def min_reduce_blocks(
    blocks: Mapping[int, tuple[int, int]] | None, process_group: Any
) -> dict[int, tuple[int, int]] | None:
    """The per-window minimum of ``(primary, secondary)`` blocks over every rank of the group.

    A collective: every rank of ``process_group`` must call it. A rank whose own sizing
    failed passes ``None``; it gets ``None`` back (and raises its own error), every other
    rank raises ``ValueError``, so no rank waits forever for a rank that gave up.

    Args:
        blocks: This rank's window -> (primary, secondary) blocks, or ``None`` (failed).
        process_group: A ``torch.distributed`` process group (``torch.distributed.group.WORLD``
            for all ranks). Tensors live on the CPU, or on the current CUDA device for NCCL.

    Returns:
        Window -> (min primary, min secondary), ascending window order; ``None`` for ``None``.

    Raises:
        ValueError: The ranks have different window sets, or another rank failed to size.
        RuntimeError: ``torch.distributed`` is not available or not initialized.
    """
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "process_group was given but torch.distributed is not initialized "
            "(call torch.distributed.init_process_group first)"
        )
    backend = str(dist.get_backend(process_group)).lower()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if "nccl" in backend
        else torch.device("cpu")
    )
    windows = sorted(int(w) for w in blocks) if blocks is not None else []
    ok = 1 if blocks is not None else 0
    digest = _windows_digest(windows)
    # One MIN reduction gives min(ok), min and max of the window count and digest.
    header = torch.tensor(
        [ok, len(windows), digest, -len(windows), -digest], dtype=torch.int64, device=device
    )
    dist.all_reduce(header, op=dist.ReduceOp.MIN, group=process_group)
    all_ok, n_min, d_min, n_max, d_max = (int(v) for v in header.tolist())
    if not all_ok:
        if blocks is None:
            return None
        raise ValueError(
            "another rank of the process group could not size its KV cache pools "
            "(see that rank's error)"
        )
    if n_min != -n_max or d_min != -d_max:
        raise ValueError(
            "the ranks of the process group have different attention windows: every rank "
            f"must use the same model and config (this rank has windows {windows})"
        )
    assert blocks is not None
    counts = torch.tensor(
        [blocks[w][0] for w in windows] + [blocks[w][1] for w in windows],
        dtype=torch.int64,
        device=device,
    )
    dist.all_reduce(counts, op=dist.ReduceOp.MIN, group=process_group)
    values = [int(v) for v in counts.tolist()]
    n = len(windows)
    return {w: (values[i], values[n + i]) for i, w in enumerate(windows)}
