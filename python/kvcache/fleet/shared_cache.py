"""Tools for the shared tier's Redis store (the ``kvcache[redis]`` extra).

The manager talks to the store itself (its core speaks Redis's protocol); these helpers use
the ``redis`` client to look at and clear what managers wrote: every key of a namespace is
``<namespace>:w<window>:<hash>``, with ``window`` the sliding window (0 for full attention) and
``hash`` the block's chained key as 16 hex digits (the ``block_hashes`` that stored events
carry). :class:`SharedStoreWatcher` follows the store's own deletions and evictions into a
router's :class:`~kvcache.router.KvIndexer`. See API.md "The shared tier".
"""

from __future__ import annotations

import os
import re
import threading
import time
from typing import TYPE_CHECKING, Any

from kvcache import _core

if TYPE_CHECKING:
    from kvcache.fleet.router import KvIndexer

__all__ = ["SharedStoreWatcher", "clear_shared_cache", "shared_cache_keys"]

# Keyspace notification classes the watcher needs: K (keyspace channels), g (generic
# commands: del, unlink), x (expired), e (evicted).
_NOTIFY = "Kgxe"
_REMOVALS = frozenset({"del", "evicted", "expired"})
_SYNC = "kvcache-watcher-sync"  # never a block key: those are w<label>:<16 hex digits>
_BLOCK_KEY = re.compile(r"w(\d+):([0-9a-f]{16})")


def _client(url: str) -> Any:
    """A client for ``url``, with the password the manager would use (the URL's, else
    ``KVCACHE_SHARED_CACHE_PASSWORD``'s)."""
    try:
        import redis
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvcache.shared_cache needs the redis client: pip install 'kvcache[redis]'"
        ) from e
    # URL components override keyword arguments: the environment's password fills a gap only.
    password = os.environ.get(_core.SHARED_CACHE_PASSWORD_ENV) or None
    return redis.Redis.from_url(url, password=password)


def _check(url: str, namespace: str) -> None:
    if not isinstance(url, str):
        raise ValueError(f"url must be a redis:// URL, got {url!r}")
    _core._check_shared_cache_url(url)  # the manager's own rule
    if not isinstance(namespace, str) or not namespace:
        raise ValueError(f"namespace must be a non-empty str, got {namespace!r}")


def shared_cache_keys(url: str, namespace: str) -> list[str]:
    """The keys of `namespace` in the store at `url`, sorted.

    Args:
        url: ``redis://host:port/db``, as in ``KvCacheConfig.shared_cache_url``.
        namespace: A manager's ``shared_cache_namespace``.

    Raises:
        ValueError: A malformed url or an empty namespace.
        redis.RedisError: The store cannot be reached.
    """
    _check(url, namespace)
    client = _client(url)
    try:
        keys = client.scan_iter(match=f"{namespace}:*", count=1000)
        return sorted(k.decode() if isinstance(k, bytes) else str(k) for k in keys)
    finally:
        client.close()


def clear_shared_cache(url: str, namespace: str) -> int:
    """Deletes every key of `namespace` in the store at `url`; returns how many were deleted.

    Managers that hold blocks keep them; later lookups of the deleted ones are misses.

    Raises:
        ValueError: A malformed url or an empty namespace.
        redis.RedisError: The store cannot be reached.
    """
    keys = shared_cache_keys(url, namespace)
    if not keys:
        return 0
    client = _client(url)
    try:
        return int(client.delete(*keys))
    finally:
        client.close()


class SharedStoreWatcher:
    """Follows the store's own deletions of a namespace's blocks into a router's index.

    Events announce a block when a manager queues it for the store, but nothing announces
    the store dropping it (an ``allkeys-lru`` eviction, an expiry, a ``DEL`` such as
    :func:`clear_shared_cache`'s). The watcher subscribes to Redis keyspace notifications for
    ``<namespace>:*`` on a background thread and calls
    :meth:`kvcache.router.KvIndexer.remove_shared_blocks` for every block key deleted,
    evicted or expired, so the index's view of the store stays a subset of what the events
    and the store agree on. Not seen: ``FLUSHDB`` / ``FLUSHALL`` and restarts (Redis sends no
    per-key notification; call ``KvIndexer.clear_shared_tier``), notifications lost while
    the watcher's connection is down (Redis does not queue them; :attr:`num_errors`), and a
    block whose eviction is applied before the event announcing its write (evicted within
    the events' delivery latency of being written): the index re-adds it.

    Args:
        indexer: The index (``KvIndexer(shared_tier=True)``) fed by the engines' events.
        url: ``redis://host:port/db``, as in ``KvCacheConfig.shared_cache_url``.
        namespace: The engines' ``shared_cache_namespace``.
        configure: Add ``Kgxe`` to the server's ``notify-keyspace-events`` (keeping what is
            set); ``False`` if the server is configured already (``CONFIG`` may be disabled).

    Raises:
        ValueError: A malformed url or an empty namespace.
        redis.RedisError: The store cannot be reached (or refuses ``CONFIG SET``).
    """

    def __init__(
        self, indexer: KvIndexer, url: str, namespace: str, *, configure: bool = True
    ) -> None:
        _check(url, namespace)
        self._indexer = indexer
        self._client = _client(url)
        self._namespace = namespace
        try:
            if configure:
                flags = str(
                    self._client.config_get("notify-keyspace-events").get(
                        "notify-keyspace-events", ""
                    )
                )
                have = set(flags) | (set("gxe") if "A" in flags else set())
                missing = "".join(c for c in _NOTIFY if c not in have)
                if missing:
                    self._client.config_set("notify-keyspace-events", flags + missing)
            db = int(self._client.connection_pool.connection_kwargs.get("db", 0))
            self._prefix = f"__keyspace@{db}__:{namespace}:"
            self._cond = threading.Condition()
            self._syncs = 0
            self._removed = 0
            self._errors = 0
            self._pubsub = self._client.pubsub(ignore_subscribe_messages=True)
            pattern = re.sub(r"([*?\[\]\\])", r"\\\1", self._prefix) + "*"
            self._pubsub.psubscribe(**{pattern: self._on_message})
            self._thread = self._pubsub.run_in_thread(
                sleep_time=0.01, daemon=True, exception_handler=self._on_error
            )
        except BaseException:
            self._client.close()
            raise

    @property
    def num_removed(self) -> int:
        """Block keys the store deleted, evicted or expired since the watcher started."""
        with self._cond:
            return self._removed

    @property
    def num_errors(self) -> int:
        """Connection errors since the watcher started: notifications sent while its
        connection was down are lost (Redis does not keep them), so the index may hold
        blocks the store dropped meanwhile. The watcher reconnects on its own."""
        with self._cond:
            return self._errors

    def _on_error(self, error: BaseException, pubsub: Any, thread: Any) -> None:
        with self._cond:
            self._errors += 1
        time.sleep(0.1)  # then the worker's next read reconnects and subscribes again

    def _on_message(self, message: dict[str, Any]) -> None:
        channel, event = message["channel"], message["data"]
        channel = channel.decode() if isinstance(channel, bytes) else str(channel)
        event = event.decode() if isinstance(event, bytes) else str(event)
        key = channel[len(self._prefix) :]
        if key == _SYNC and event == _SYNC:
            with self._cond:
                self._syncs += 1
                self._cond.notify_all()
            return
        m = _BLOCK_KEY.fullmatch(key)
        if m is None or event not in _REMOVALS:
            return
        label = int(m.group(1))
        self._indexer.remove_shared_blocks([int(m.group(2), 16)], window=label or None)
        with self._cond:
            self._removed += 1

    def sync(self, timeout_s: float = 5.0) -> bool:
        """Returns once every deletion the store notified before this call is applied (a
        marker is published on the watcher's own pattern: Redis delivers it after them);
        ``False`` if that took longer than ``timeout_s``."""
        with self._cond:
            target = self._syncs + 1
        self._client.publish(self._prefix + _SYNC, _SYNC)
        with self._cond:
            return self._cond.wait_for(lambda: self._syncs >= target, timeout_s)

    def close(self) -> None:
        """Stops the thread and closes the connections (idempotent)."""
        thread = getattr(self, "_thread", None)
        if thread is not None:
            thread.stop()
            thread.join(5)
            self._thread = None
        self._pubsub.close()
        self._client.close()
