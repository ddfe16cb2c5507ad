"""Tools for the shared tier's Redis store (the ``kvcache[redis]`` extra).

The manager talks to the store itself (its core speaks Redis's protocol); these helpers use
the ``redis`` client to look at and clear what managers wrote: every key of a namespace is
``<namespace>:w<window>:<hash>``, with ``window`` the sliding window (0 for full attention) and
``hash`` the block's chained key as 16 hex digits (the ``block_hashes`` that stored events
carry). See API.md "The shared tier".
"""

from __future__ import annotations

from typing import Any

__all__ = ["clear_shared_cache", "shared_cache_keys"]


def _client(url: str) -> Any:
    try:
        import redis
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "kvcache.shared_cache needs the redis client: pip install 'kvcache[redis]'"
        ) from e
    return redis.Redis.from_url(url)


def _check(url: str, namespace: str) -> None:
    if not isinstance(url, str) or not url.startswith("redis://"):
        raise ValueError(f"url must look like redis://host:port/db, got {url!r}")
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
