"""KV cache events for fleet routers, in vLLM's ZeroMQ wire format (optional extra).

Routers that place requests by cache contents (vLLM's router, llm-d, NVIDIA Dynamo) subscribe
to an engine's KV event stream. :class:`ZmqEventPublisher` turns a
:class:`kvcache.KVCacheManager`'s events into that stream, so kvcache can run behind any of
them unchanged. Needs ``pip install 'kvcache[events]'`` (``pyzmq`` and ``msgspec``); importing
:mod:`kvcache` itself never imports this module.

Wire format (vLLM 0.32's ``vllm/distributed/kv_events.py``, ``event_format="map"``, the
default):

* every message is three frames ``[topic, seq, payload]``: ``topic`` the UTF-8 topic, ``seq``
  an 8-byte big-endian batch number counting from 0, ``payload`` one msgpack
  :class:`KVEventBatch`;
* a batch is the array ``[ts, events, data_parallel_rank]`` (``ts`` seconds since the epoch);
* an event is a tagged map, ``{"type": "BlockStored", ...}``, with vLLM's field names in
  vLLM's order, and every field equal to its default (``None``) omitted:
  ``BlockStored``: ``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
  lora_name`` (no default: always present), ``extra_keys, group_idx, kv_cache_spec_kind,
  kv_cache_spec_sliding_window, locality, ownership, session_id`` (default ``None``);
  ``BlockRemoved``: ``block_hashes, medium`` (always present), ``group_idx, locality,
  ownership`` (default ``None``); ``AllBlocksCleared``: no field;
* replay: a ROUTER socket takes ``[identity, b"", start_seq]`` (a DEALER client sends
  ``[b"", start_seq]``) and answers ``[identity, b"", topic, seq, payload]`` for every buffered
  batch from ``start_seq`` on, then the end marker ``[identity, b"", b"", END_SEQ, b""]``
  (``END_SEQ`` = -1 as 8 signed big-endian bytes): a DEALER receives ``[b"", topic, seq,
  payload]`` and ``[b"", b"", END_SEQ, b""]``.

``event_format="array"`` keeps the older wire for older consumers: each event a tagged array
with every field present (``["BlockStored", block_hashes, parent_block_hash, token_ids,
block_size, lora_id, medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind,
kv_cache_spec_sliding_window]``, ``["BlockRemoved", block_hashes, medium, group_idx]``,
``["AllBlocksCleared"]``), and replay answers without the topic frame (``[b"", seq,
payload]``, end ``[b"", END_SEQ, b""]``).

Replay never reports completion after dropping a batch: the ROUTER socket is
``ROUTER_MANDATORY`` and sends without blocking; a full pipe (the client reads slower than
the replay is sent) is waited on, and a client that takes nothing for ``replay_timeout_s``
gets no more of that answer, in particular no end marker (its request times out; it asks
again). ``num_replays_abandoned`` counts those.

Field values: ``block_hashes`` are kvcache's chained 64-bit block keys (unsigned ints,
:func:`kvcache.block_hashes` computes them from tokens); ``parent_block_hash`` the key of the
block before the first one (``None`` at the start of a prompt); ``token_ids`` the blocks'
tokens, ``block_size`` tokens each (only full blocks are published: a partly filled last block
of a sequence cannot be matched by a router); ``lora_id`` the LoRA task id, ``lora_name`` its
name from the publisher's ``lora_names`` (else ``None``); ``medium`` ``"GPU"`` (primary pool),
``"CPU"`` (host offload pool) or ``"DISK"`` (the disk tier); ``group_idx`` the window's index in
``manager.window_sizes``, then one per recurrent state group; ``kv_cache_spec_kind``
``"full_attention"``, ``"sliding_window"`` (with ``kv_cache_spec_sliding_window`` the window
in tokens) or, for a state group's checkpoints, ``"mamba"`` (a stored "block" is then a
checkpoint of the recurrent state after the chain ending at its hash). ``extra_keys``, ``locality``,
``ownership`` and ``session_id`` are never set (so never sent in the map form).

A block moving between media (offload to host, onboard back to the primary pool) is a
``BlockRemoved`` on the old medium followed by a ``BlockStored`` on the new one. When the
manager's event buffer overflowed between two :meth:`ZmqEventPublisher.publish` calls
(events lost), the next batch starts with ``AllBlocksCleared``: a router then forgets this
engine's blocks rather than route to blocks that may be gone.
"""

from __future__ import annotations

import collections
import errno
import logging
import queue
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvcache._extras import missing_extra
from kvcache.cache.fields import is_int

try:
    import msgspec
    import zmq
except ImportError as e:
    raise missing_extra("kvcache.events", "events", e) from None

if TYPE_CHECKING:
    from kvcache.cache.manager import KVCacheEvent, KVCacheManager

__all__ = [
    "ARRAY_SCHEMA",
    "END_SEQ",
    "MAP_SCHEMA",
    "MAX_BUFFER_STEPS",
    "MAX_HWM",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_GPU",
    "MEDIUM_SHARED_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventBatch",
    "EventBatcher",
    "KVEventBatch",
    "WireSchema",
    "ZmqEventPublisher",
    "wire_schema",
]

_log = logging.getLogger(__name__)

#: ``medium`` of a block in the primary (device) pool.
MEDIUM_GPU = "GPU"
#: ``medium`` of a block in the host (secondary) pool.
MEDIUM_CPU = "CPU"
#: ``medium`` of a block in the disk tier (the name Dynamo's router maps to its disk tier).
MEDIUM_DISK = "DISK"
#: ``medium`` of a block queued for the shared tier (vLLM's name for shared storage). Nothing
#: removes it: the store evicts on its own, so a router's view of it is approximate after a
#: flush or a store eviction.
MEDIUM_SHARED_STORAGE = "SHARED_STORAGE"
_MEDIA = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_SHARED_STORAGE)

#: Replay end marker: -1 as an 8-byte signed big-endian integer.
END_SEQ = (-1).to_bytes(8, "big", signed=True)
#: Largest ``buffer_steps``: the replay ring holds at most this many batches.
MAX_BUFFER_STEPS = 10_000_000
#: Largest ``hwm``: ZeroMQ's high-water marks are C ints.
MAX_HWM = 2**31 - 1
_SCHEMES = ("tcp", "ipc", "inproc", "pgm", "epgm", "tipc", "vmci", "ws", "wss")
_ENDPOINT = re.compile("^(" + "|".join(_SCHEMES) + r")://\S+$")


@dataclass(frozen=True)
class WireSchema:
    """The msgspec structs of one encoding of the wire format (see :func:`wire_schema`)."""

    BlockStored: Any
    BlockRemoved: Any
    AllBlocksCleared: Any
    KVEventBatch: Any
    array_like: bool


def wire_schema(array_like: bool = False) -> WireSchema:
    """The wire structs: events as tagged maps (vLLM 0.32, the default) or positional arrays.

    The map form's events carry vLLM 0.32's fields (``locality``, ``ownership`` and, on
    ``BlockStored``, ``session_id`` included); the array form keeps the older field lists.
    The batch is always the array ``[ts, events, data_parallel_rank]``. Build a subscriber's
    decoder with ``msgspec.msgpack.Decoder(wire_schema().KVEventBatch)``.
    """

    class _Event(msgspec.Struct, array_like=array_like, omit_defaults=True, gc=False, tag=True):
        pass

    # The map form is vLLM 0.32's; the array form keeps the older field lists.
    newer: list[tuple[str, Any, Any]] = [] if array_like else [("locality", str | None, None)]
    newer += [] if array_like else [("ownership", str | None, None)]
    stored = msgspec.defstruct(
        "BlockStored",
        [
            ("block_hashes", list[int]),
            ("parent_block_hash", int | None),
            ("token_ids", list[int]),
            ("block_size", int),
            ("lora_id", int | None),
            ("medium", str | None),
            ("lora_name", str | None),
            ("extra_keys", list[tuple[Any, ...] | None] | None, None),
            ("group_idx", int | None, None),
            ("kv_cache_spec_kind", str | None, None),
            ("kv_cache_spec_sliding_window", int | None, None),
            *newer,
            *([] if array_like else [("session_id", str | None, None)]),
        ],
        bases=(_Event,),
        module=__name__,
    )
    removed = msgspec.defstruct(
        "BlockRemoved",
        [
            ("block_hashes", list[int]),
            ("medium", str | None),
            ("group_idx", int | None, None),
            *newer,
        ],
        bases=(_Event,),
        module=__name__,
    )
    cleared = msgspec.defstruct("AllBlocksCleared", [], bases=(_Event,), module=__name__)

    # Built with real types: string annotations would resolve the event names in the
    # module's namespace rather than these local classes.
    kv_event_batch = msgspec.defstruct(
        "KVEventBatch",
        [
            ("ts", float),
            ("events", list[stored | removed | cleared]),  # type: ignore[valid-type]
            ("data_parallel_rank", int | None, None),
        ],
        array_like=True,
        omit_defaults=True,
        gc=False,
        module=__name__,
    )

    return WireSchema(stored, removed, cleared, kv_event_batch, array_like)


#: The map form's structs (vLLM 0.32, the default ``event_format``).
MAP_SCHEMA = wire_schema(False)
#: The array form's structs (``event_format="array"``).
ARRAY_SCHEMA = wire_schema(True)
#: ``BlockStored`` event struct (map form).
BlockStored = MAP_SCHEMA.BlockStored
#: ``BlockRemoved`` event struct (map form).
BlockRemoved = MAP_SCHEMA.BlockRemoved
#: ``AllBlocksCleared`` event struct (map form).
AllBlocksCleared = MAP_SCHEMA.AllBlocksCleared
#: ``KVEventBatch`` struct: ``[ts, events, data_parallel_rank]`` (map-form events).
KVEventBatch = MAP_SCHEMA.KVEventBatch
EventBatch = KVEventBatch


@dataclass
class _Cached:
    """What the publisher knows of one published block (to move it between media)."""

    parent: int | None
    tokens: list[int]
    lora_id: int | None
    medium: str


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int | None) -> str | None:
    """The endpoint of data-parallel rank ``r``: a TCP port plus ``r``, ``inproc`` ``_dp{r}``.

    Rank 0 and ``None`` leave it unchanged (vLLM's convention, so one configuration serves
    every rank). Raises ``ValueError`` for a rank > 0 with another transport.
    """
    if not endpoint or not data_parallel_rank:
        return endpoint
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} needs a numeric port for rank offsets")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"endpoint {endpoint!r}: rank offsets need tcp:// or inproc://")


def _binds(endpoint: str) -> bool:
    """vLLM's rule: wildcard addresses, ipc and inproc bind; anything else connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_endpoint(name: str, endpoint: object) -> None:
    """ValueError unless ``endpoint`` looks like a ZeroMQ address (``scheme://address``)."""
    if not isinstance(endpoint, str) or not _ENDPOINT.match(endpoint):
        raise ValueError(
            f"{name} must be a ZeroMQ address such as tcp://*:5557, ipc:///tmp/kv or "
            f"inproc://kv (schemes: {', '.join(_SCHEMES)}), got {endpoint!r}"
        )


def _attach(sock: zmq.Socket[bytes], endpoint: str, bind: bool) -> None:
    """Binds or connects; an address ZeroMQ cannot parse is a ValueError, not a ZMQError."""
    try:
        if bind:
            sock.bind(endpoint)
        else:
            sock.connect(endpoint)
    except zmq.ZMQError as e:
        if e.errno in (errno.EINVAL, errno.EPROTONOSUPPORT, errno.ENODEV):
            raise ValueError(f"invalid ZeroMQ endpoint {endpoint!r}: {e.strerror}") from e
        raise


class EventBatcher:
    """Turns a manager's KV cache events into vLLM ``KVEventBatch`` payloads, without sockets.

    The conversion half of :class:`ZmqEventPublisher` (which is one, plus its sockets): each
    :meth:`batch` drains the manager's events and returns the msgpack payload that
    ``publish`` would send for that step, byte for byte the same wire. For engines that ship
    batches their own way, and for simulations (``kvcache.simulate.fleet`` feeds a router's
    index with these payloads).

    Args:
        manager: The manager; its ``config.event_buffer_max_size`` must be > 0 and large
            enough for the events of one step (events lost to an overflow are reported as
            ``AllBlocksCleared``).
        event_format: ``"map"`` (vLLM 0.32's tagged-map events; the default) or
            ``"array"`` (the older positional-array events).
        data_parallel_rank: Written into every batch (``None``: not written).
        lora_names: LoRA task id -> adapter name, written as ``lora_name``.
        schema: The structs events are built with, in place of ``event_format``'s (an engine
            that publishes its own event classes, as ``kvcache.vllm`` does with vLLM's).

    Raises:
        ValueError: Events disabled on the manager, or a bad argument.

    Example:
        >>> import kvcache, msgspec
        >>> from kvcache.events import EventBatcher
        >>> model = kvcache.ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8)
        >>> config = kvcache.KvCacheConfig(tokens_per_block=4, backend="virtual",
        ...                                event_buffer_max_size=1000)
        >>> kv = kvcache.KVCacheManager.from_blocks(model, config, {64: 8}, max_seq_len=64,
        ...                                         max_batch_size=2)
        >>> batcher = EventBatcher(kv)
        >>> kv.add_sequence(1, list(range(9))); kv.remove_sequence(1)
        0
        >>> ts, events, rank = msgspec.msgpack.decode(batcher.batch())
        >>> events[0]["type"], events[0]["token_ids"], batcher.batch()
        ('BlockStored', [0, 1, 2, 3, 4, 5, 6, 7], None)
    """

    def __init__(
        self,
        manager: KVCacheManager,
        *,
        event_format: str = "map",
        data_parallel_rank: int | None = None,
        lora_names: Mapping[int, str] | None = None,
        schema: WireSchema | None = None,
    ) -> None:
        config = getattr(manager, "config", None)
        if config is None or getattr(config, "event_buffer_max_size", 0) <= 0:
            raise ValueError(
                "the manager records no events: set KvCacheConfig.event_buffer_max_size > 0"
            )
        names = dict(lora_names or {})
        if not all(isinstance(k, int) and isinstance(v, str) for k, v in names.items()):
            raise ValueError("lora_names must map int LoRA task ids to str names")
        if data_parallel_rank is not None and (
            isinstance(data_parallel_rank, bool)
            or not isinstance(data_parallel_rank, int)
            or data_parallel_rank < 0
        ):
            raise ValueError(
                f"data_parallel_rank must be None or an int >= 0, got {data_parallel_rank!r}"
            )
        if event_format not in ("array", "map"):
            raise ValueError(f'event_format must be "array" or "map", got {event_format!r}')
        self._manager = manager
        if schema is None:
            schema = ARRAY_SCHEMA if event_format == "array" else MAP_SCHEMA
        self._schema = schema
        self._lora_names = names
        self._encoder = msgspec.msgpack.Encoder()
        self._dp_rank = data_parallel_rank
        windows = [int(w) for w in manager.window_sizes]
        max_seq_len = int(manager.max_seq_len)
        # Keyed by window size, and by -(g + 1) for state group g (its checkpoints): the group
        # index (windows first, then state groups), the spec kind and the sliding window.
        self._group = {w: i for i, w in enumerate(windows)}
        kinds = getattr(manager, "group_kinds", None)  # the core's kinds (a fake manager: none)
        if kinds is None:
            kinds = [
                ("sliding_window", w) if w < max_seq_len else ("full_attention", None)
                for w in windows
            ]
        self._spec: dict[int, tuple[str, int | None]] = dict(
            zip(windows, kinds[: len(windows)], strict=True)
        )
        for g, _ in enumerate(kinds[len(windows) :]):
            self._group[-(g + 1)] = len(windows) + g
            self._spec[-(g + 1)] = ("mamba", None)  # vLLM's KVCacheSpecKind for recurrent state
        self._block_size = int(manager.tokens_per_block)
        self._cached: dict[tuple[int, int], _Cached] = {}
        self._next_event_id: int | None = None
        self._lost = 0

    @property
    def num_lost_events(self) -> int:
        """Manager events lost to an overflow of its event buffer before they were batched."""
        return self._lost

    def batch(self) -> bytes | None:
        """Drains the manager's events into one msgpack ``KVEventBatch`` payload.

        Returns:
            The payload (``[ts, events, data_parallel_rank]``), or ``None`` when the manager
            had no event to publish.
        """
        wire = self.convert(self._manager.get_latest_events(0))
        if not wire:
            return None
        batch = self._schema.KVEventBatch(
            ts=time.time(), events=wire, data_parallel_rank=self._dp_rank
        )
        return self._encoder.encode(batch)

    def convert(self, events: list[KVCacheEvent]) -> list[Any]:
        """vLLM wire events for a run of the manager's events (updates the batcher's state).

        :meth:`batch` (and ``ZmqEventPublisher.publish``) call this; it is public for engines
        that ship events their own way.
        """
        out: list[Any] = []
        if events and self._next_event_id is not None and events[0].event_id > self._next_event_id:
            self._lost += events[0].event_id - self._next_event_id
            self._cached.clear()
            out.append(self._schema.AllBlocksCleared())
        for e in events:
            self._next_event_id = e.event_id + 1
            key = _group_key(e)
            if e.kind == "stored":
                self._on_stored(e, key, out)
            elif e.kind == "removed":
                for h in e.data["block_hashes"]:
                    cached = self._cached.pop((key, int(h)), None)
                    if cached is not None:
                        self._removed(out, key, int(h), cached.medium)
            elif e.kind == "updated" and e.data.get("cache_level") is not None:
                h = int(e.data["block_hash"])
                cached = self._cached.get((key, h))
                new_medium = _MEDIA[int(e.data["cache_level"][1])]
                if cached is None or cached.medium == new_medium:
                    continue
                self._removed(out, key, h, cached.medium)
                cached.medium = new_medium
                self._stored(out, key, cached.parent, h, cached, new_medium)
        return out

    def _on_stored(self, e: KVCacheEvent, key: int, out: list[Any]) -> None:
        parent = e.data["parent_hash"]
        parent = None if parent is None else int(parent)
        for b in e.data["blocks"]:
            tokens = [int(t) for t in b["tokens"]]
            h = int(b["block_hash"])
            if len(tokens) != self._block_size:
                break  # a partly filled last block: not published
            lora = b["lora_task_id"]
            medium = _MEDIA[int(b["cache_level"])]
            cached = _Cached(parent, tokens, None if lora is None else int(lora), medium)
            if medium != MEDIUM_SHARED_STORAGE:
                # The store's copy is never removed or moved: the manager's removed and
                # updated events of (window, hash) are about its own copy.
                self._cached[(key, h)] = cached
            self._stored(out, key, parent, h, cached, medium)
            parent = h

    def _stored(
        self,
        out: list[Any],
        window: int,
        parent: int | None,
        h: int,
        block: _Cached,
        medium: str,
    ) -> None:
        group = self._group[window]
        last = out[-1] if out else None
        if (
            isinstance(last, self._schema.BlockStored)
            and last.group_idx == group
            and last.medium == medium
            and last.lora_id == block.lora_id
            and last.block_hashes[-1] == parent
        ):
            last.block_hashes.append(h)
            last.token_ids.extend(block.tokens)
            return
        kind, sliding = self._spec[window]
        out.append(
            self._schema.BlockStored(
                block_hashes=[h],
                parent_block_hash=parent,
                token_ids=list(block.tokens),
                block_size=self._block_size,
                lora_id=block.lora_id,
                medium=medium,
                lora_name=None if block.lora_id is None else self._lora_names.get(block.lora_id),
                extra_keys=None,
                group_idx=group,
                kv_cache_spec_kind=kind,
                kv_cache_spec_sliding_window=sliding,
            )
        )

    def _removed(self, out: list[Any], window: int, h: int, medium: str) -> None:
        group = self._group[window]
        last = out[-1] if out else None
        if (
            isinstance(last, self._schema.BlockRemoved)
            and last.group_idx == group
            and last.medium == medium
        ):
            last.block_hashes.append(h)
            return
        out.append(self._schema.BlockRemoved(block_hashes=[h], medium=medium, group_idx=group))


def _group_key(e: KVCacheEvent) -> int:
    """The key of an event's group: its window size, or -(g + 1) for state group g."""
    g = e.data.get("state_group")
    return e.window_size if g is None else -(int(g) + 1)


class ZmqEventPublisher(EventBatcher):
    """Publishes a manager's KV cache events as vLLM ``KVEventBatch`` messages over ZeroMQ.

    One :meth:`publish` per engine step drains the manager's events
    (``get_latest_events``) into one batch (``KVCacheResourceManager(...,
    event_publisher=...)`` calls it in ``update_resources``). A background thread sends the
    batches on a PUB socket and answers replay requests on an optional ROUTER socket from a
    buffer of the last ``buffer_steps`` batches.

    Args:
        manager: The manager; its ``config.event_buffer_max_size`` must be > 0 and large
            enough for the events of one step (events lost to an overflow are reported as
            ``AllBlocksCleared``).
        endpoint: PUB address. A wildcard (``tcp://*:5557``), ``ipc://`` or ``inproc://``
            binds; anything else (``tcp://router:5557``) connects.
        replay_endpoint: ROUTER address for replay (bound), or ``None`` for no replay.
        topic: Topic frame of every message (and of every replay answer in the map form).
        buffer_steps: Batches kept for replay, 1 to :data:`MAX_BUFFER_STEPS`.
        hwm: Send high-water mark of the PUB and ROUTER sockets (messages), 1 to
            :data:`MAX_HWM`. A PUB socket drops messages for a subscriber that is ``hwm``
            behind (it sees a sequence gap and replays); the ROUTER never drops (see
            ``replay_timeout_s``).
        data_parallel_rank: Written into every batch; a rank ``r > 0`` also offsets both
            endpoints' TCP ports by ``r``, as vLLM does.
        event_format: ``"map"`` (vLLM 0.32's wire: tagged-map events, replay answers with
            the topic frame; the default) or ``"array"`` (the older wire: positional-array
            events, replay answers without the topic frame).
        replay_timeout_s: How long a replay answer waits for a client that reads nothing
            (its pipe full) before it is abandoned, end marker included (> 0, at most a day).
        lora_names: LoRA task id -> adapter name, written as ``lora_name`` (a router matches
            by name; ``None`` leaves ``lora_name`` unset).

    Raises:
        ValueError: Events disabled on the manager, a bad argument, an endpoint that is not a
            ZeroMQ address (``"garbage"``).
        zmq.ZMQError: A valid endpoint could not be bound or connected (address in use).

    Example:
        >>> import kvcache, msgspec, zmq
        >>> from kvcache.events import ZmqEventPublisher, wire_schema
        >>> model = kvcache.ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8)
        >>> config = kvcache.KvCacheConfig(tokens_per_block=4, backend="virtual",
        ...                                event_buffer_max_size=1000)
        >>> kv = kvcache.KVCacheManager.from_blocks(model, config, {64: 8}, max_seq_len=64,
        ...                                         max_batch_size=2)
        >>> pub = ZmqEventPublisher(kv, "inproc://doc-events", replay_endpoint="inproc://doc-r")
        >>> kv.add_sequence(1, list(range(9))); kv.remove_sequence(1)
        0
        >>> pub.publish()
        0
        >>> replay = zmq.Context.instance().socket(zmq.DEALER)
        >>> _ = replay.connect("inproc://doc-r")
        >>> replay.send_multipart([b"", (0).to_bytes(8, "big")])
        >>> _, topic, seq, payload = replay.recv_multipart()
        >>> batch = msgspec.msgpack.decode(payload, type=wire_schema().KVEventBatch)
        >>> [type(e).__name__ for e in batch.events], batch.events[0].token_ids
        (['BlockStored'], [0, 1, 2, 3, 4, 5, 6, 7])
        >>> replay.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
        True
        >>> replay.close(); pub.close()
    """

    def __init__(
        self,
        manager: KVCacheManager,
        endpoint: str = "tcp://*:5557",
        replay_endpoint: str | None = None,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int | None = None,
        *,
        event_format: str = "map",
        replay_timeout_s: float = 10.0,
        lora_names: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(
            manager,
            event_format=event_format,
            data_parallel_rank=data_parallel_rank,
            lora_names=lora_names,
        )
        for name, value, most in (
            ("buffer_steps", buffer_steps, MAX_BUFFER_STEPS),
            ("hwm", hwm, MAX_HWM),
        ):
            if not is_int(value) or not 1 <= value <= most:
                raise ValueError(f"{name} must be an int in [1, {most}], got {value!r}")
        if (
            isinstance(replay_timeout_s, bool)
            or not isinstance(replay_timeout_s, (int, float))
            or not 0 < replay_timeout_s <= 86_400
        ):
            raise ValueError(
                f"replay_timeout_s must be a number in (0, 86400], got {replay_timeout_s!r}"
            )
        if not isinstance(topic, str):
            raise ValueError(f"topic must be a str, got {topic!r}")
        check_endpoint("endpoint", endpoint)
        if replay_endpoint is not None:
            check_endpoint("replay_endpoint", replay_endpoint)
        pub_endpoint = str(offset_endpoint_port(endpoint, data_parallel_rank))
        replay_at = offset_endpoint_port(replay_endpoint, data_parallel_rank)

        self._replay_topic = event_format == "map"
        self._replay_timeout_s = float(replay_timeout_s)
        self._topic = topic.encode("utf-8")
        self._buffer_steps = buffer_steps
        self._next_seq = 0
        self._closed = False
        self._failure: BaseException | None = None
        self._stop = False
        self._replays_abandoned = 0

        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            self._pub.set_hwm(hwm)
            _attach(self._pub, pub_endpoint, _binds(pub_endpoint))
            if replay_at is not None:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, hwm)
                # A full pipe raises Again rather than dropping the message silently.
                self._replay.setsockopt(zmq.ROUTER_MANDATORY, 1)
                _attach(self._replay, replay_at, True)
        except BaseException:
            self._pub.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)
            raise
        self._endpoint = str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or pub_endpoint)
        self._replay_endpoint = (
            None
            if self._replay is None
            else str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT) or replay_at)
        )
        self._queue: queue.SimpleQueue[tuple[int, bytes] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="kvcache-zmq-events", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public

    @property
    def endpoint(self) -> str:
        """The PUB socket's address (the bound one, with the port, when it binds)."""
        return self._endpoint

    @property
    def replay_endpoint(self) -> str | None:
        """The ROUTER socket's bound address, or ``None`` without replay."""
        return self._replay_endpoint

    @property
    def num_replays_abandoned(self) -> int:
        """Replay answers given up because the client read nothing for ``replay_timeout_s``."""
        return self._replays_abandoned

    @property
    def next_seq(self) -> int:
        """The sequence number the next batch will carry."""
        return self._next_seq

    def publish(self) -> int | None:
        """Drains the manager's events into one batch and queues it for sending.

        Returns:
            The batch's sequence number, or ``None`` when there was nothing to publish (no
            message is sent for an empty step).

        Raises:
            RuntimeError: The publisher is closed, or its sender thread failed (the cause is
                chained): nothing published since then was sent.
        """
        if self._closed:
            raise RuntimeError("ZmqEventPublisher is closed")
        self._check_sender()
        payload = self.batch()
        if payload is None:
            return None
        seq = self._next_seq
        self._next_seq += 1
        self._queue.put((seq, payload))
        return seq

    def _check_sender(self) -> None:
        failure = self._failure
        if failure is not None or not self._thread.is_alive():
            raise RuntimeError(
                f"the event sender thread failed ({failure!r}); events are no longer sent"
            ) from failure

    def close(self) -> None:
        """Sends what is queued, stops the thread and closes the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ sender thread

    def _run(self) -> None:
        """Owns both sockets: sends queued batches, answers replay requests.

        Every pass first sends everything queued, then answers waiting replay requests, so a
        replay asked for after ``publish`` returned always includes that batch. A failure is
        kept for :meth:`publish` to raise.
        """
        buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=self._buffer_steps)
        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        self._stop = False
        try:
            while not self._stop:
                self._drain(buffer)
                while self._replay is not None and poller.poll(0):
                    # A request that arrived after publish() returned sees that batch.
                    self._drain(buffer)
                    self._serve_replay(buffer)
                if not self._stop:
                    # Wake for a replay request at once, for a queued batch within 2 ms.
                    if self._replay is not None:
                        poller.poll(2)
                    else:
                        time.sleep(0.002)
        except BaseException as e:
            self._failure = e
            _log.exception("kvcache ZMQ event publisher failed")
        finally:
            self._close_sockets()

    def _close_sockets(self) -> None:
        """Closes both sockets, unbinding first: ZeroMQ frees a bound address only when its
        reaper gets to the closed socket, so without the unbind binding it again right after
        :meth:`close` (a restarted publisher) could fail with "Address already in use"."""
        sockets = [(self._pub, self._endpoint, _binds(self._endpoint))]
        if self._replay is not None and self._replay_endpoint is not None:
            sockets.append((self._replay, self._replay_endpoint, True))
        for sock, endpoint, bound in sockets:
            if bound:
                try:
                    sock.unbind(endpoint)
                except Exception:  # pragma: no cover - closing anyway
                    pass
            sock.close(linger=1000)

    def _drain(self, buffer: collections.deque[tuple[int, bytes]]) -> None:
        """Sends every queued batch on the PUB socket; sets ``_stop`` at the sentinel."""
        while not self._stop:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if item is None:
                self._stop = True
                return
            seq, payload = item
            self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload])
            buffer.append(item)

    def _serve_replay(self, buffer: collections.deque[tuple[int, bytes]]) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) == 3 and frames[1] == b"":
            identity, _, start = frames
        elif len(frames) == 2:
            identity, start = frames
        else:
            _log.warning("ignoring a malformed replay request of %d frames", len(frames))
            return
        if len(start) != 8:
            _log.warning("ignoring a replay request whose start is %d bytes", len(start))
            return
        first = int.from_bytes(start, "big")
        head = [identity, b""] + ([self._topic] if self._replay_topic else [])
        # A snapshot: live batches sent while this answer waits must not change the ring
        # under the loop.
        for seq, payload in [item for item in buffer if item[0] >= first]:
            if not self._send_replay([*head, seq.to_bytes(8, "big"), payload], buffer):
                return
        end = [identity, b""] + ([b""] if self._replay_topic else [])
        self._send_replay([*end, END_SEQ, b""], buffer)

    def _send_replay(
        self, frames: list[bytes], buffer: collections.deque[tuple[int, bytes]]
    ) -> bool:
        """Sends one replay message without dropping it: waits while the client's pipe is full
        (sending live batches meanwhile), for at most ``replay_timeout_s`` without progress.
        False (nothing sent) when that passes or the client is gone: the answer is abandoned.
        """
        assert self._replay is not None
        deadline = time.monotonic() + self._replay_timeout_s
        while True:
            try:
                self._replay.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() >= deadline:
                    break
                self._drain(buffer)
                time.sleep(0.0005)
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                break  # the client disconnected
        self._replays_abandoned += 1
        _log.warning(
            "abandoned a replay answer: the client took nothing for %.1f s or left",
            self._replay_timeout_s,
        )
        return False
