"""The shared tier's edges, attacked from outside: a value is bound to its whole key, every
refused value is counted, and a store that wants credentials gets them (from the URL or the
environment) or counts the refusal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from redis_helpers import (
    FULL,
    PROMPT,
    SWA,
    Server,
    compute_and_store,
    held_bytes,
    make,
)

from kvcache import KvCacheConfig, KVCacheManager

PASSWORD = "s3cr:t@pw"  # ':' and '@' must be percent-encoded in a URL
ENCODED = "s3cr%3At%40pw"


def _stored_hashes(m: KVCacheManager) -> dict[int, list[int]]:
    """The chained hashes of the blocks ``m`` announced per window, in position order
    (announcements of the store's copies left out)."""
    out: dict[int, list[int]] = {}
    for e in m.get_latest_events():
        if e.kind == "stored":
            out.setdefault(e.window_size, []).extend(
                b["block_hash"] % 2**64 for b in e.data["blocks"] if b["cache_level"] != 3
            )
    return out


def test_a_value_copied_to_another_windows_key_is_refused_and_counted(server: Server) -> None:
    a = make(server.url)
    want = compute_and_store(a)
    ns = a.shared_cache_namespace
    stored = _stored_hashes(a)
    hashes = stored[FULL]
    assert stored[SWA][:7] == hashes[:7], (len(stored[SWA]), len(hashes))  # the same chain
    client = server.client()
    # Both windows' blocks have the same size (two layers each): before values were bound to
    # their key, the full-attention bytes passed verification under the sliding window's key.
    client.set(f"{ns}:w{SWA}:{hashes[6]:016x}", client.get(f"{ns}:w0:{hashes[6]:016x}"))
    b = make(server.url)
    # The window cannot serve 7 blocks (its position 6 is refused): 6 blocks, whose window needs
    # positions 4 and 5.
    assert b.add_sequence(1, PROMPT) == 24
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors) == (6 + 2, 1)
    for w, positions in ((FULL, range(6)), (SWA, range(4, 6))):
        for d in positions:
            for got, exp in zip(held_bytes(b, 1, w, d), want[w, d], strict=True):
                np.testing.assert_array_equal(got, exp)
    b.check_invariants()


def test_a_value_copied_from_another_namespace_is_refused(server: Server) -> None:
    a = make(server.url, shared_cache_namespace="fleet-a")
    compute_and_store(a)
    client = server.client()
    keys = sorted(k.decode() for k in client.keys("fleet-a:*"))
    assert len(keys) == 14  # 7 positions in each of 2 windows
    for k in keys:
        client.set("fleet-b" + k[len("fleet-a") :], client.get(k))
    b = make(server.url, shared_cache_namespace="fleet-b")
    assert b.add_sequence(1, PROMPT) == 0
    s = b.get_kv_cache_stats()
    # The first round fetches what 7 blocks need: full attention's 7 and the window's 2; every
    # one is refused, and what a shorter prefix needs is never asked for once position 0 fails.
    assert (s.shared_hits, s.shared_errors) == (0, 9)
    b.check_invariants()


@pytest.mark.parametrize("how", ["empty", "list"])
def test_an_empty_value_or_a_key_of_another_type_is_a_counted_miss(
    server: Server, how: str
) -> None:
    a = make(server.url)
    compute_and_store(a)
    key = f"{a.shared_cache_namespace}:w0:{_stored_hashes(a)[FULL][3]:016x}"
    client = server.client()
    client.delete(key)
    if how == "empty":
        client.set(key, b"")
    else:
        client.rpush(key, b"x")  # EXISTS says 1; GET answers WRONGTYPE
    b = make(server.url)
    assert b.add_sequence(1, PROMPT) == 12  # 3 blocks; the window then needs positions 1..2
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors) == (3 + 2, 1)
    b.check_invariants()


def _start(tmp: Path, password: str | None) -> Iterator[Server]:
    pytest.importorskip("redis")
    s = Server(tmp, password=password)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    yield from _start(tmp_path, None)


@pytest.fixture
def locked(tmp_path: Path) -> Iterator[Server]:
    yield from _start(tmp_path, PASSWORD)


def _url(s: Server, userinfo: str = "") -> str:
    return f"redis://{userinfo}127.0.0.1:{s.port}/0"


def test_a_password_in_the_url_is_sent(locked: Server) -> None:
    a = make(_url(locked, f":{ENCODED}@"))
    compute_and_store(a)
    assert a.get_kv_cache_stats().shared_writes == 14
    b = make(_url(locked, f"default:{ENCODED}@"))  # user and password (Redis 6 ACL)
    assert b.add_sequence(1, PROMPT) == 28
    s = b.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_errors, s.shared_auth_failures) == (7 + 2, 0, 0)


def test_a_password_from_the_environment_keeps_it_out_of_config_files(
    locked: Server, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVCACHE_SHARED_CACHE_PASSWORD", PASSWORD)
    a = make(_url(locked))
    compute_and_store(a)
    b = make(_url(locked))
    assert b.add_sequence(1, PROMPT) == 28
    assert "s3cr" not in repr(b.config.shared_cache_url)
    from kvcache.shared_cache import shared_cache_keys

    assert len(shared_cache_keys(_url(locked), a.shared_cache_namespace)) == 14


@pytest.mark.parametrize("userinfo", ["", ":wrong@"], ids=["none", "wrong"])
def test_missing_or_wrong_credentials_are_a_miss_and_a_counted_refusal(
    locked: Server, userinfo: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCACHE_SHARED_CACHE_PASSWORD", raising=False)
    writer = make(_url(locked, f":{ENCODED}@"))
    compute_and_store(writer)
    m = make(_url(locked, userinfo))
    assert m.add_sequence(1, PROMPT) == 0
    s = m.get_kv_cache_stats()
    assert (s.shared_hits, s.shared_auth_failures, s.shared_errors) == (0, 1, 1)
    m.remove_sequence(1)  # its writes are refused too
    m.flush_shared_cache(timeout_ms=10_000)
    s = m.get_kv_cache_stats()
    # The writer's connection is refused as well (how many batches it tried depends on when
    # it woke: each is an error, each connection attempt after the backoff a refusal).
    assert s.shared_writes == 0 and s.shared_auth_failures >= 2
    assert s.shared_errors >= s.shared_auth_failures
    m.check_invariants()


def test_urls_the_client_cannot_speak_are_refused_when_configured() -> None:
    with pytest.raises(ValueError, match="control characters"):
        KvCacheConfig(shared_cache_url="redis://h\x00evil:1")
    with pytest.raises(ValueError, match=r"TLS \(rediss://\) is not spoken"):
        KvCacheConfig(shared_cache_url="rediss://h:6380")
    with pytest.raises(ValueError, match="credentials without a password"):
        KvCacheConfig(shared_cache_url="redis://u:@h")
    with pytest.raises(ValueError, match="the port must be") as e:
        KvCacheConfig(shared_cache_url="redis://u:hunter2@h:0")
    assert "hunter2" not in str(e.value)
    c = KvCacheConfig(shared_cache_url=f"redis://u:{ENCODED}@h:1/2")
    assert KvCacheConfig.from_dict(c.to_dict()) == c
