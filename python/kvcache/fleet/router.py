"""A router's index of what each engine caches, fed only by the engines' KV event streams.

:class:`KvIndexer` applies vLLM ``KVEventBatch``es (either wire form, raw or decoded) per
engine and answers, for any prompt, how many of its tokens an engine would reuse: exactly
what that engine's own ``KVCacheManager.get_reusable_prefix_length`` returns (with
``enable_partial_reuse=False``), sliding windows included. :class:`ZmqEventSubscriber`
follows several engines' ZeroMQ streams into an indexer and replays what it missed. Needs
``pip install 'kvcache[events]'`` (``msgspec`` for raw payloads, ``pyzmq`` for the
subscriber).

The rule, replicated from the core's (``cpp/src/kv_cache_manager_reuse.cpp``), from the events'
data only: a prompt of ``n`` tokens is keyed on its first ``n - 1`` (the last token is always
computed), cut into full blocks of ``block_size`` tokens, each with its chained key
(:func:`kvcache.block_hashes`). A prefix of ``p`` blocks is reusable when every
full-attention group (``kv_cache_spec_kind`` ``"full_attention"``) holds blocks ``0 .. p-1``
and every sliding-window group of window ``W`` holds the blocks that cover the last ``W``
tokens before the hit point: blocks ``max(0, p - ceil(W / block_size)) .. p-1``, and every
recurrent state group (``"mamba"``: kvcache's checkpoints) holds a checkpoint at ``p`` (its
"block" ``p-1``; an engine with recurrent layers reuses no partial block). The answer is
the largest such ``p`` times ``block_size`` (0 if none). A block counts in any medium (device,
host, disk). A block's key covers its whole prefix, so holding block ``p-1`` implies the
engine's reuse tree reaches it.

The shared tier (``shared_cache_url``): ``SHARED_STORAGE`` blocks, from any engine, form one
fleet-wide set per ``(block_size, window)``. For an engine that reads the store, the local
hit ``p`` is extended as its lookup (``SharedServed`` in
``cpp/src/kv_cache_manager_shared.cpp``) extends it: the longest ``h`` such that every
full-attention group's blocks ``p .. h-1`` and every window's blocks from
``max(p, (h * block_size - W) // block_size)`` to ``h-1`` are in the store. Events cannot
see the store evict or be flushed: ``match`` may then over-predict (by the blocks the store
lost; :meth:`KvIndexer.clear_shared_tier` after a flush).

The index knows an engine's groups from its events (``group_idx``, ``kv_cache_spec_kind``,
``kv_cache_spec_sliding_window``, ``block_size`` of ``BlockStored``); a group it never heard
of cannot constrain the answer. With ``enable_partial_reuse=True`` an engine may also reuse
part of the next block: its answer is then at most ``block_size`` tokens above ``match``
(and never below it), because the core then also takes part of a block (or, where the
window rule stopped the hit, that whole next block) after the prefix.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any

from kvcache import _core
from kvcache.cache.block_keys import key_kwargs
from kvcache.cache.fields import is_int

__all__ = ["KvIndexer", "ZmqEventSubscriber"]

_log = logging.getLogger(__name__)

# Batches per engine whose bytes the subscriber remembers to tell a duplicate from a restart.
_RECENT_BATCHES = 4096

# Field order of the older array form's events (after the tag).
_ARRAY_FIELDS = {
    "BlockStored": (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
    ),
    "BlockRemoved": ("block_hashes", "medium", "group_idx", "locality", "ownership"),
    "AllBlocksCleared": (),
}


def _event_dict(event: Any) -> dict[str, Any]:
    """One event as a dict with its tag under ``"type"``: from a map, an array or a struct."""
    if isinstance(event, dict):
        return event
    if isinstance(event, (list, tuple)):
        if not event or not isinstance(event[0], str) or event[0] not in _ARRAY_FIELDS:
            raise ValueError(f"unknown KV event {event!r:.80}")
        return {"type": event[0], **dict(zip(_ARRAY_FIELDS[event[0]], event[1:], strict=False))}
    config = getattr(type(event), "__struct_config__", None)
    if config is None or not isinstance(config.tag, str):
        raise ValueError(f"unknown KV event {event!r:.80}")
    return {"type": config.tag, **{f: getattr(event, f) for f in event.__struct_fields__}}


_TYPE_CODES = {"BlockStored": 0, "BlockRemoved": 1, "AllBlocksCleared": 2}
_CLEARED = (2, (), None, None, None, None, None, None, None)


def _checked(event: Any, index: int = 0) -> tuple[Any, ...]:
    """One decoded event, every field the index reads checked (types and ranges), as the
    tuple the native index takes (``RouterIndex.apply_events``), so a batch is applied whole
    or not at all; a bad field is a ``ValueError`` naming the event (its index in the batch)
    and the field. Raw msgpack batches are checked the same way natively
    (``cpp/src/router_index.cpp``)."""
    try:
        e = _event_dict(event)
    except ValueError as err:
        raise ValueError(f"event {index}: {err}") from None
    kind = e.get("type")
    if not isinstance(kind, str) or kind not in _ARRAY_FIELDS:
        raise ValueError(f"event {index}: unknown KV event type {kind!r:.80}")
    if kind == "AllBlocksCleared":
        return _CLEARED

    def bad(name: str, want: str) -> ValueError:
        return ValueError(f"event {index} ({kind}): {name} must be {want}, got {e.get(name)!r:.80}")

    hashes = e.get("block_hashes")
    if not isinstance(hashes, list | tuple) or not all(
        is_int(h) or isinstance(h, bytes) for h in hashes
    ):
        raise bad("block_hashes", "a list of ints or bytes")
    group = e.get("group_idx")
    if group is not None and (not is_int(group) or group < 0):
        raise bad("group_idx", "an int >= 0 or None")
    medium = e.get("medium")
    if not (medium is None or isinstance(medium, str)):
        raise bad("medium", "a str or None")
    if kind == "BlockRemoved":
        return (1, hashes, group, medium, None, None, None, None, None)
    size = e.get("block_size")
    if not is_int(size) or size < 1:
        raise bad("block_size", "an int >= 1")
    spec = e.get("kv_cache_spec_kind")
    if not (spec is None or isinstance(spec, str)):
        raise bad("kv_cache_spec_kind", "a str or None")
    window = e.get("kv_cache_spec_sliding_window")
    if spec == "sliding_window" and (not is_int(window) or window < 1):
        raise bad("kv_cache_spec_sliding_window", "an int >= 1 for a sliding window")
    lora_id = e.get("lora_id")
    if not (lora_id is None or (is_int(lora_id) and -(2**63) <= lora_id < 2**64)):
        raise bad("lora_id", "an int or None")
    lora_name = e.get("lora_name")
    if not (lora_name is None or isinstance(lora_name, str)):
        raise bad("lora_name", "a str or None")
    window = window if spec == "sliding_window" else None
    return (0, hashes, group, medium, size, spec, window, lora_id, lora_name)


def _batch_events(payload: Any) -> list[Any]:
    """The events of a decoded ``[ts, events, rank]`` or a batch struct."""
    events = getattr(payload, "events", None)
    if events is None and isinstance(payload, list | tuple) and len(payload) >= 2:
        events = payload[1]
    if not isinstance(events, list | tuple):
        raise ValueError(f"not a KVEventBatch [ts, events, rank]: {payload!r:.80}")
    return list(events)


_NO_ITEMS: list[tuple[int, int, int]] = []


class KvIndexer:
    """Which blocks each engine caches, from its KV events; predicts each engine's reuse.

    The index lives in the core (``kvcache._core.RouterIndex``, ``cpp/src/router_index.cpp``):
    one table for every engine, keyed by (group, block hash), each entry the set of engines
    holding the block; raw msgpack batches are decoded, checked and applied there in one
    call, and :meth:`scores` hashes the prompt and looks up every engine in one call, with
    the GIL released.

    Thread-safe: one lock guards every call (a :class:`ZmqEventSubscriber` applies from its
    own thread while the router calls :meth:`match`).

    Example:
        >>> import kvcache
        >>> from kvcache.events import ZmqEventPublisher
        >>> from kvcache.router import KvIndexer
        >>> config = kvcache.KvCacheConfig(tokens_per_block=4, backend="virtual",
        ...                                event_buffer_max_size=1000,
        ...                                enable_partial_reuse=False)
        >>> model = kvcache.ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8)
        >>> kv = kvcache.KVCacheManager.from_blocks(model, config, {64: 8}, max_seq_len=64,
        ...                                         max_batch_size=2)
        >>> pub = ZmqEventPublisher(kv, "inproc://doc-router")
        >>> kv.add_sequence(1, list(range(13))); kv.remove_sequence(1)
        0
        >>> index = KvIndexer()
        >>> index.apply("e0", pub.convert(kv.get_latest_events(0)))
        >>> prompt = list(range(10)) + [99]
        >>> index.match("e0", prompt), kv.get_reusable_prefix_length(prompt)
        (8, 8)
        >>> pub.close()
    """

    def __init__(self, *, shared_tier: bool = False) -> None:
        """An empty index.

        Args:
            shared_tier: Whether engines read the fleet's shared store (``shared_cache_url``)
                unless :meth:`add_engine` says otherwise. An engine that announces a block in
                the store (``SHARED_STORAGE``) reads it from then on anyway, unless declared
                not to. One index follows one store namespace (one model's fleet).

        Raises:
            ValueError: ``shared_tier`` is not a bool.
        """
        if not isinstance(shared_tier, bool):
            raise ValueError(f"shared_tier must be a bool, got {shared_tier!r}")
        self._index = _core.RouterIndex(shared_tier)
        # engine id -> native slot, in the order the index heard of them (the native order).
        self._slots: dict[Hashable, int] = {}
        self._names: list[Hashable] = []  # list(self._slots), replaced (never changed) on change
        self._lock = threading.Lock()

    @property
    def engines(self) -> list[Hashable]:
        """The engines the index has heard of, in the order it first did."""
        return list(self._names)

    def apply(self, engine_id: Hashable, payload: Any) -> None:
        """Applies one ``KVEventBatch`` of ``engine_id`` (registering the engine).

        Args:
            engine_id: Any hashable name of the engine.
            payload: The raw msgpack bytes off the wire (map or array form; decoded natively,
                no ``msgspec`` needed), a decoded batch (``[ts, events, rank]`` or a struct
                with ``events``), or a list of events (maps, tagged arrays or msgspec
                structs, e.g. ``ZmqEventPublisher.convert``).

        Raises:
            ValueError: ``payload`` is not a batch, or holds an unknown event or a field of
                the wrong type or range (the message names the event's index and the field);
                nothing of the batch is applied then.
        """
        if isinstance(payload, bytes | bytearray | memoryview):
            with self._lock:
                slot = self._slots.get(engine_id, -1)
                got = self._index.apply_msgpack(slot, payload)  # checks it all, then applies
                if slot < 0:
                    self._slots[engine_id] = got
                    self._names = list(self._slots)
            return
        is_batch = (
            isinstance(payload, list | tuple)
            and len(payload) in (2, 3)
            and isinstance(payload[0], int | float)
            and not isinstance(payload[0], bool)
        )
        events = payload if isinstance(payload, list) and not is_batch else _batch_events(payload)
        parsed = [_checked(e, i) for i, e in enumerate(events)]  # all before any is applied
        with self._lock:
            slot = self._slots.get(engine_id, -1)
            got = self._index.apply_events(slot, parsed)
            if slot < 0:
                self._slots[engine_id] = got
                self._names = list(self._slots)

    def add_engine(self, engine_id: Hashable, *, shared_tier: bool | None = None) -> None:
        """Registers an engine with no blocks yet (idempotent; :meth:`apply` also does).

        Args:
            engine_id: Any hashable name of the engine.
            shared_tier: Whether the engine reads the fleet's shared store (``True`` for a
                manager with ``shared_cache_url``); ``None`` leaves what is known (the
                index's default for a new engine).
        """
        if shared_tier is not None and not isinstance(shared_tier, bool):
            raise ValueError(f"shared_tier must be a bool or None, got {shared_tier!r}")
        with self._lock:
            slot = self._slots.get(engine_id)
            if slot is None:
                slot = self._slots[engine_id] = self._index.add_engine()
                self._names = list(self._slots)
            self._index.set_shared_tier(slot, shared_tier)

    def reads_shared_tier(self, engine_id: Hashable) -> bool:
        """Whether :meth:`match` counts the shared store for ``engine_id`` (``KeyError`` if
        unknown)."""
        with self._lock:
            return bool(self._index.reads_shared_tier(self._slots[engine_id]))

    def num_shared_blocks(self) -> dict[tuple[int, int | None], int]:
        """Blocks the index believes the shared store holds, per ``(block_size, window)``
        (``None``: full attention)."""
        with self._lock:
            return {(size, window): n for size, window, n in self._index.num_shared_blocks()}

    def remove_shared_blocks(self, hashes: Iterable[Hashable], *, window: int | None) -> int:
        """Forgets blocks the shared store no longer holds (what the store's own deletions
        say: :class:`kvcache.shared_cache.SharedStoreWatcher` calls this).

        Args:
            hashes: The blocks' chained hashes (as events carry them).
            window: Their window: the sliding window in tokens, ``None`` for full attention
                (the store's key label 0).

        Returns:
            How many of them the index held.
        """
        gone = set(hashes)
        if window is not None and not (is_int(window) and 0 <= window < 2**64):
            return 0  # no set of the store has such a window
        with self._lock:
            return int(self._index.remove_shared_blocks(gone, window))

    def clear_shared_tier(self) -> None:
        """Forgets every block of the shared store (after a flush, a restart or
        ``clear_shared_cache``: events cannot see those)."""
        with self._lock:
            self._index.clear_shared_tier()

    def remove_engine(self, engine_id: Hashable) -> None:
        """Forgets an engine (``KeyError`` if unknown)."""
        with self._lock:
            slot = self._slots.pop(engine_id)
            self._names = list(self._slots)
            self._index.remove_engine(slot)

    def num_blocks(self, engine_id: Hashable) -> dict[int, int]:
        """Blocks the index holds per group of ``engine_id`` (``KeyError`` if unknown)."""
        with self._lock:
            return dict(self._index.num_blocks(self._slots[engine_id]))

    def match(
        self,
        engine_id: Hashable,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
    ) -> int:
        """Tokens of ``token_ids`` that ``engine_id`` would reuse, as the engine computes it.

        Equals the engine's ``get_reusable_prefix_length(token_ids, lora_task_id=...,
        cache_salt=..., multimodal=...)`` (without partial reuse) once every batch it
        published has been applied, and, for an engine that reads the shared store, every
        batch that announced the store's blocks, while the store holds what they announced.
        ``lora_name`` is resolved to the LoRA id the engine's events paired it with
        (``ZmqEventPublisher(lora_names=...)``; for a reader of the store, also the store's
        events); a name never published matches nothing (0). ``lora_id`` names the id
        directly.

        Raises:
            KeyError: An unknown engine.
            ValueError: Both ``lora_name`` and ``lora_id``; a bad token or key.
        """
        _, got = self._lookup(token_ids, lora_name, lora_id, cache_salt, multimodal, [engine_id])
        return got[0]

    def _lookup(
        self,
        token_ids: Sequence[int],
        lora_name: str | None,
        lora_id: int | None,
        cache_salt: str | bytes | int | None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None,
        names: list[Hashable] | None,
    ) -> tuple[list[Hashable], list[int]]:
        """The native lookup of every engine of ``names`` (``None``: all, in order): the
        engines and their answers."""
        if lora_id is None and cache_salt is None and multimodal is None:
            lora, salt, items = None, None, _NO_ITEMS  # the common case, without key_kwargs
        else:
            key = key_kwargs(lora_id, cache_salt, multimodal)
            lora, salt, items = key["lora_task_id"], key["cache_salt"], key["multimodal"]
        if lora_name is not None and lora_id is not None:
            raise ValueError("pass lora_name or lora_id, not both")
        if not isinstance(token_ids, list | tuple) and not hasattr(
            token_ids, "__array_interface__"
        ):
            token_ids = list(token_ids)  # the native call reads lists, tuples and arrays
        # A name that is not a str was never published: it matches nothing.
        unnamed = lora_name is not None and not isinstance(lora_name, str)
        with self._lock:
            if names is None:
                names = self._names
                slots = None
            else:
                slots = [self._slots[e] for e in names]
            got: list[int] = self._index.scores(
                token_ids, None if unnamed else lora_name, lora, salt, items, slots
            )
        return names, [0] * len(got) if unnamed else got

    def scores(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
        engines: Iterable[Hashable] | None = None,
    ) -> dict[Hashable, int]:
        """Every engine's :meth:`match` for one prompt at once (hashed once per block size and
        LoRA id, in one native call that stops at full attention's first miss), in the order
        the index heard of them; ``engines`` restricts it.

        Raises:
            KeyError: An unknown engine in ``engines``.
            ValueError: The arguments of :meth:`match`.
        """
        wanted = None if engines is None else list(dict.fromkeys(engines))
        names, got = self._lookup(token_ids, lora_name, lora_id, cache_salt, multimodal, wanted)
        return dict(zip(names, got, strict=True))

    def best_engine(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        lora_id: int | None = None,
        cache_salt: str | bytes | int | None = None,
        multimodal: Sequence[tuple[bytes | int, int, int]] | None = None,
        load: Mapping[Hashable, float] | Callable[[Hashable], float] | None = None,
        engines: Iterable[Hashable] | None = None,
    ) -> tuple[Hashable, int]:
        """The engine that would reuse the most of ``token_ids``, and how many tokens.

        Ties (equal reuse, 0 included) go to the lowest ``load`` (a mapping or a function of
        the engine id, e.g. running requests; engines missing from a mapping count as 0),
        then to the engine heard of first. ``engines`` restricts the choice (default: every
        engine of the index).

        Raises:
            ValueError: No engine to choose from; the arguments of :meth:`match`.
        """
        wanted = None if engines is None else list(dict.fromkeys(engines))
        names, got = self._lookup(token_ids, lora_name, lora_id, cache_salt, multimodal, wanted)
        if not names:
            raise ValueError("best_engine: no engine to choose from")
        if load is None:  # the first engine with the longest hit (no dict: one list walk)
            best = max(range(len(got)), key=got.__getitem__)
            return names[best], got[best]
        if callable(load):
            load_of: Callable[[Hashable], float] = load
        else:
            load_of = lambda e: float(load.get(e, 0.0))  # noqa: E731
        best = max(range(len(got)), key=lambda i: (got[i], -load_of(names[i]), -i))
        return names[best], got[best]


class ZmqEventSubscriber:
    """Follows several engines' ZeroMQ KV event streams into a :class:`KvIndexer`.

    One SUB socket per engine (connected to its PUB endpoint, ``topic`` prefix) and one
    DEALER per replay endpoint. Batches are applied in sequence order; a gap (a batch the
    SUB socket lost, the first batches before the subscription took effect) is filled from the
    engine's replay socket first. When the replay cannot fill it (the engine's ring no longer
    holds those batches, no replay endpoint, no complete answer within ``replay_timeout_s``),
    the engine's blocks are cleared and the stream continues from there: the index may then
    under-estimate that engine, never over-estimate it. Both replay answers are read: vLLM
    0.32's ``[b"", topic, seq, payload]`` and the older ``[b"", seq, payload]``.

    An engine that restarts numbers its batches from 0 again. A batch whose sequence number is
    at or below the last one applied is therefore a restart (counted in :attr:`num_restarts`):
    the engine's blocks are cleared and its stream is followed from scratch, the batches
    before the first one received filled from its (new) replay socket. The one exception is a
    batch already applied (:meth:`catch_up`'s replay can run ahead of the SUB socket, a
    sender may repeat itself): the same sequence number with the same bytes as one of the
    last 4,096 batches applied is a duplicate and is dropped. A restart
    that is not seen (the subscriber was disconnected while the new engine published more
    batches than the old one had) looks like a gap: the replay then fills it from the new
    engine, and the old engine's blocks stay until they are removed: after restarting an
    engine the subscriber did not follow, :meth:`KvIndexer.remove_engine` it (or restart
    the subscriber).

    Drive it with :meth:`poll` (and :meth:`catch_up`) from one thread, the router's loop, or
    :meth:`start` a background thread that does it; not both. The indexer may be queried from
    any thread meanwhile.

    Args:
        indexer: The index to feed.
        engines: ``{engine_id: (endpoint, replay_endpoint or None)}``.
        topic: Topic prefix to subscribe to.
        replay_timeout_s: How long one replay may take before it counts as failed.
        catch_up_s: The background thread (:meth:`start`) calls :meth:`catch_up` on every
            engine after this many seconds without a batch.
    """

    def __init__(
        self,
        indexer: KvIndexer,
        engines: Mapping[Hashable, tuple[str, str | None]],
        topic: str = "",
        replay_timeout_s: float = 5.0,
        catch_up_s: float = 1.0,
    ) -> None:
        import zmq

        from kvcache.fleet.events import check_endpoint

        if not isinstance(indexer, KvIndexer):
            raise ValueError(f"indexer must be a KvIndexer, got {indexer!r:.60}")
        if not engines:
            raise ValueError("engines must name at least one engine")
        for engine_id, ends in engines.items():
            if not isinstance(ends, tuple | list) or len(ends) != 2:
                raise ValueError(
                    f"engine {engine_id!r}: expected (endpoint, replay_endpoint), got {ends!r}"
                )
            check_endpoint("endpoint", ends[0])
            if ends[1] is not None:
                check_endpoint("replay_endpoint", ends[1])
        if not isinstance(replay_timeout_s, int | float) or replay_timeout_s <= 0:
            raise ValueError(f"replay_timeout_s must be > 0, got {replay_timeout_s!r}")
        if not isinstance(catch_up_s, int | float) or catch_up_s <= 0:
            raise ValueError(f"catch_up_s must be > 0, got {catch_up_s!r}")
        self._catch_up_s = float(catch_up_s)
        self._zmq = zmq
        self._indexer = indexer
        self._timeout_ms = int(replay_timeout_s * 1000)
        self._ctx: Any = zmq.Context.instance()
        self._poller = zmq.Poller()
        self._subs: dict[Any, Hashable] = {}
        self._replay: dict[Hashable, str | None] = {}
        self._last: dict[Hashable, int | None] = {}
        # The last batches applied per engine: seq -> hash of the payload (duplicates).
        self._recent: dict[Hashable, collections.OrderedDict[int, int]] = {}
        self._gaps_lost = 0
        self._rejected = 0
        self._replays = 0
        self._restarts = 0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        for engine_id, (endpoint, replay_endpoint) in engines.items():
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.RCVHWM, 0)
            sock.setsockopt_string(zmq.SUBSCRIBE, topic)
            sock.connect(endpoint)
            self._subs[sock] = engine_id
            self._poller.register(sock, zmq.POLLIN)
            self._replay[engine_id] = replay_endpoint
            self._last[engine_id] = None
            self._recent[engine_id] = collections.OrderedDict()
            indexer.add_engine(engine_id)

    @property
    def num_replays(self) -> int:
        """Replay requests made (gaps and :meth:`catch_up`)."""
        return self._replays

    @property
    def num_unrecoverable_gaps(self) -> int:
        """Gaps replay could not fill and batches the index rejected (each cleared that
        engine's blocks)."""
        return self._gaps_lost

    @property
    def num_rejected_batches(self) -> int:
        """Batches the index refused (malformed: see :meth:`KvIndexer.apply`); each also
        counts in :attr:`num_unrecoverable_gaps`."""
        return self._rejected

    @property
    def num_restarts(self) -> int:
        """Engines seen restarting (a sequence number that went back); each cleared that
        engine's blocks and followed its new stream from the start."""
        return self._restarts

    def last_seq(self, engine_id: Hashable) -> int | None:
        """The sequence number of the last batch applied for ``engine_id`` (``None``: none)."""
        return self._last[engine_id]

    def poll(self, timeout_ms: int = 0) -> int:
        """Applies every batch that arrives within ``timeout_ms``; returns how many."""
        applied = 0
        for sock, _ in self._poller.poll(timeout_ms):
            while sock.poll(0):
                frames = sock.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    _log.warning(
                        "ignoring a message of %d frames (not [topic, seq, payload])", len(frames)
                    )
                    continue
                applied += self._on_batch(
                    self._subs[sock], int.from_bytes(frames[1], "big"), frames[2]
                )
        return applied

    def catch_up(self, engine_id: Hashable) -> int:
        """Asks ``engine_id``'s replay socket for every batch after the last one applied (a
        stream that went quiet may have lost its last batches); returns how many it applied."""
        last = self._last[engine_id]
        return self._fill(engine_id, 0 if last is None else last + 1, None)

    def start(self) -> None:
        """Polls in a background thread until :meth:`close`."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="kvcache-router", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Stops the thread and closes the sockets (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        for sock in list(self._subs):
            sock.close(linger=0)
        self._subs.clear()

    def _loop(self) -> None:
        quiet_since = time.monotonic()
        while not self._stop.is_set():
            try:
                if self.poll(10):
                    quiet_since = time.monotonic()
                elif time.monotonic() - quiet_since >= self._catch_up_s:
                    # A quiet stream may have lost its last batches: ask every replay socket.
                    for engine_id in self._replay:
                        if self._replay[engine_id] is not None:
                            self.catch_up(engine_id)
                    quiet_since = time.monotonic()
            except Exception:  # pragma: no cover - logged; the loop goes on
                _log.exception("kvcache router subscriber: a batch could not be applied")

    def _on_batch(self, engine_id: Hashable, seq: int, payload: bytes) -> int:
        last = self._last[engine_id]
        if last is not None and seq <= last:
            if self._recent[engine_id].get(seq) == hash(payload):
                return 0  # applied already (a replay ran ahead of the SUB socket)
            # The sequence went back: the engine restarted (its old blocks are gone).
            self._restarts += 1
            _log.warning(
                "engine %r restarted (batch %d after %d); its blocks are cleared",
                engine_id,
                seq,
                last,
            )
            self._indexer.apply(engine_id, [{"type": "AllBlocksCleared"}])
            self._recent[engine_id].clear()
            self._last[engine_id] = last = None
        applied = 0
        expected = 0 if last is None else last + 1
        if seq > expected:
            applied += self._fill(engine_id, expected, seq)
        self._apply(engine_id, seq, payload)
        return applied + 1

    def _apply(self, engine_id: Hashable, seq: int, payload: bytes) -> None:
        """Applies one batch; one the index rejects leaves the engine's state unknown, so its
        blocks are cleared (counted as a lost gap) and the stream goes on after it."""
        try:
            self._indexer.apply(engine_id, payload)
        except ValueError as e:
            self._gaps_lost += 1
            self._rejected += 1
            _log.warning(
                "engine %r: batch %d rejected (%s); its blocks are cleared", engine_id, seq, e
            )
            self._indexer.apply(engine_id, [{"type": "AllBlocksCleared"}])
        self._last[engine_id] = seq
        recent = self._recent[engine_id]
        recent[seq] = hash(payload)
        if len(recent) > _RECENT_BATCHES:
            recent.popitem(last=False)

    def _fill(self, engine_id: Hashable, start: int, stop: int | None) -> int:
        """Applies batches ``start`` .. ``stop - 1`` (``None``: all there are) from replay;
        clears the engine when they cannot all be had. Returns how many it applied."""
        batches = self._request_replay(engine_id, start)
        got = [(s, p) for s, p in batches or [] if s >= start and (stop is None or s < stop)]
        seqs = [s for s, _ in got]
        wanted = seqs if stop is None else list(range(start, stop))
        if batches is None or seqs != list(range(start, start + len(got))) or seqs != wanted:
            # The ring no longer holds them (or no answer): forget what may be stale.
            self._gaps_lost += 1
            _log.warning(
                "engine %r: batches from %d are lost; its blocks are cleared", engine_id, start
            )
            self._indexer.apply(engine_id, [{"type": "AllBlocksCleared"}])
        for s, payload in got:  # after a clear, later batches can only add what is true
            self._apply(engine_id, s, payload)
        return len(got)

    def _request_replay(self, engine_id: Hashable, start: int) -> list[tuple[int, bytes]] | None:
        """Every (seq, payload) the engine's replay socket answers from ``start``, or
        ``None`` without a replay endpoint or a complete answer (end marker) in time."""
        endpoint = self._replay[engine_id]
        if endpoint is None:
            return None
        zmq = self._zmq
        self._replays += 1
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(endpoint)
            sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            deadline = time.monotonic() + self._timeout_ms / 1000
            while True:
                left = int((deadline - time.monotonic()) * 1000)
                if left <= 0 or not sock.poll(left):
                    return None
                frames = sock.recv_multipart()
                seq, payload = frames[-2], frames[-1]  # with or without the topic frame
                if seq == (-1).to_bytes(8, "big", signed=True):
                    return out
                out.append((int.from_bytes(seq, "big"), payload))
        finally:
            sock.close(linger=0)
