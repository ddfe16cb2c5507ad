"""kvcache's KV events as vLLM's own event objects, one per vLLM group.

kvcache records events per window; :class:`kvcache.events.EventBatcher` already turns them
into vLLM's event fields (full blocks only, runs of a chain merged into one ``BlockStored``,
media from cache levels). Here it builds vLLM's own classes, and each event of a window is
repeated for every vLLM group the window serves, with that group's ``group_idx``: vLLM's
publisher (``kv_events_config``) and its consumers then see what vLLM's own manager emits.
Block hashes are kvcache's chained 64-bit keys, not vLLM's.
"""

from __future__ import annotations

from typing import Any

import msgspec
from vllm.distributed.kv_events import (  # type: ignore[import-not-found]
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvcache import KVCacheManager
from kvcache.fleet.events import EventBatcher, WireSchema
from kvcache.vllm.layout import GroupLayout

VLLM_SCHEMA = WireSchema(BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch, False)


class GroupEvents:
    """Drains a manager's events as vLLM events of vLLM's groups."""

    def __init__(self, manager: KVCacheManager, layout: GroupLayout) -> None:
        self._batcher = EventBatcher(manager, schema=VLLM_SCHEMA)
        self._manager = manager
        self._groups = layout.window_groups

    def take(self) -> list[Any]:
        """vLLM events for what happened since the last call."""
        out: list[Any] = []
        for e in self._batcher.convert(self._manager.get_latest_events(0)):
            if isinstance(e, AllBlocksCleared):
                out.append(e)
                continue
            members = self._groups[e.group_idx]
            out.append(msgspec.structs.replace(e, group_idx=members[0]))
            out.extend(msgspec.structs.replace(e, group_idx=g) for g in members[1:])
        return out
