"""The disk tier below host memory, through the Python API: bytes, sizing, events, simulate."""

from __future__ import annotations

import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from kvcache import KvCacheConfig, KVCacheError, KVCacheManager, ModelConfig
from kvcache.cli import main

MODEL = ModelConfig(num_layers=2, num_kv_heads=2, head_dim=8)
HEADER = 32  # bytes of a disk slot's header: magic, key hash, byte count, checksum
BLOCK = 2 * 2 * 2 * 4 * 8 * 2  # one block: layers x K/V x heads x tokens x head_dim x fp16


def make(tmp_path: Path, blocks: tuple[int, int, int] = (3, 1, 4)) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=4,
        backend="host",
        event_buffer_max_size=1000,
        disk_cache_dir=str(tmp_path / "tier"),
        host_cache_size=1,  # only validated here: from_blocks takes exact counts
        disk_cache_size=1,
    )
    return KVCacheManager.from_blocks(MODEL, config, {64: blocks}, max_seq_len=64, max_batch_size=4)


def _fill(m: KVCacheManager, block: int, rng: np.random.Generator) -> list[np.ndarray]:
    out = []
    for layer in range(MODEL.num_layers):
        buf = m.get_buffers(layer)
        buf[block] = rng.standard_normal(buf[block].shape).astype(buf.dtype)
        out.append(buf[block].copy())
    return out


def test_store_evict_to_host_then_disk_then_onboard_keeps_every_byte(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    m = make(tmp_path)
    a = list(range(9))
    m.add_sequence(1, a)  # blocks 0, 1, 2
    want = [_fill(m, b, rng) for b in m.get_cache_block_ids(1, 64)[:2]]
    m.remove_sequence(1)
    m.get_latest_events()
    # Another prompt takes all three primary blocks: A's second block goes to host memory,
    # then on to disk when the first one takes its place in host memory.
    m.add_sequence(2, list(range(100, 109)))
    moves = [e.data["cache_level"] for e in m.get_latest_events() if e.kind == "updated"]
    assert moves == [(0, 1), (1, 2), (0, 1)]
    for b in m.get_cache_block_ids(2, 64):
        _fill(m, b, rng)  # the other prompt writes every primary block
    m.remove_sequence(2, store_for_reuse=False)
    # A lock file and one window file, named by the manager's random instance id; one slot
    # of a 32-byte header and the block's 512 bytes.
    data, lock = sorted((tmp_path / "tier").iterdir(), key=lambda f: f.suffix)
    assert re.fullmatch(r"kvcache-[0-9a-f]{16}\.lock", lock.name), lock.name
    assert data.name == lock.name.replace(".lock", "-window-64.kvblocks")
    assert data.stat().st_size == HEADER + 2 * 2 * 2 * 4 * 8 * 2
    # A again: one block onboarded from host memory, one from disk, both byte for byte.
    assert m.add_sequence(3, a) == 8
    moves = [e.data["cache_level"] for e in m.get_latest_events() if e.kind == "updated"]
    assert moves == [(1, 0), (2, 0)]
    for j, block in enumerate(m.get_cache_block_ids(3, 64)[:2]):
        for layer in range(MODEL.num_layers):
            np.testing.assert_array_equal(m.get_buffers(layer)[block], want[j][layer])
    stats = m.get_kv_cache_stats()
    assert (stats.offloaded_blocks, stats.onboarded_blocks) == (2, 2)
    m.check_invariants()
    assert m.disk_blocks_per_window == {64: 4}
    del m
    gc.collect()
    assert list((tmp_path / "tier").iterdir()) == []  # the manager's files are gone


def test_the_publisher_reports_disk_as_its_own_medium(tmp_path: Path) -> None:
    pytest.importorskip("zmq")
    pytest.importorskip("msgspec")
    from kvcache.events import ZmqEventPublisher

    m = make(tmp_path)
    pub = ZmqEventPublisher(m, "inproc://disk-medium")
    try:
        m.add_sequence(1, list(range(9)))
        m.remove_sequence(1)
        m.add_sequence(2, list(range(100, 109)))
        events = pub.convert(m.get_latest_events())
        media = [(type(e).__name__, e.medium) for e in events]
        assert media == [
            ("BlockStored", "GPU"),
            ("BlockRemoved", "GPU"),
            ("BlockStored", "CPU"),
            ("BlockRemoved", "CPU"),
            ("BlockStored", "DISK"),
            ("BlockRemoved", "GPU"),
            ("BlockStored", "CPU"),
        ]
        a0, a1 = events[0].block_hashes
        assert events[4].block_hashes == [a1] and events[4].parent_block_hash == a0
    finally:
        pub.close()


def test_disk_budget_is_split_like_the_host_budget() -> None:
    config = KvCacheConfig(
        tokens_per_block=16,
        max_attention_window=[64, None],
        backend="virtual",
        host_cache_size=2**20,
        disk_cache_size=4 * 2**20,
    )
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64)  # 4 KiB per block and layer
    m = KVCacheManager(model, config, max_seq_len=1024, max_batch_size=4, primary_bytes=2**20)
    assert m.blocks_per_window == {64: (128, 128), 1024: (128, 128)}
    assert m.disk_blocks_per_window == {64: 512, 1024: 512}
    plain = KVCacheManager(
        model,
        KvCacheConfig(tokens_per_block=16, backend="virtual"),
        max_seq_len=1024,
        max_batch_size=4,
        primary_bytes=2**20,
    )
    assert plain.disk_blocks_per_window == {1024: 0}


def test_bad_disk_settings() -> None:
    with pytest.raises(ValueError, match="needs host_cache_size"):
        KvCacheConfig(disk_cache_size=2**20)
    with pytest.raises(ValueError, match="disk_cache_dir"):
        KvCacheConfig(host_cache_size=1, disk_cache_size=1, disk_cache_dir="")
    with pytest.raises(ValueError, match="disk_cache_size"):
        KvCacheConfig(disk_cache_size=-1)
    config = KvCacheConfig(tokens_per_block=4, backend="virtual")
    with pytest.raises(ValueError, match="disk blocks but no secondary"):
        KVCacheManager.from_blocks(MODEL, config, {64: (4, 0, 2)}, max_seq_len=64, max_batch_size=1)
    with pytest.raises(ValueError, match="triple"):
        KVCacheManager.from_blocks(
            MODEL, config, {64: (4, 0, 2, 1)}, max_seq_len=64, max_batch_size=1
        )


def test_simulate_shows_the_extra_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["simulate", "--num-conversations", "40", "--memory", "2GiB", "--no-progress"]
    assert main([*args, "--host-cache", "512MiB", "--disk-cache", "4GiB"]) == 0
    out = capsys.readouterr().out
    assert "disk cache 4.00 GiB" in out
    line = next(x for x in out.splitlines() if "disk tier" in x)
    with_disk, without = (float(x.split("%")[0]) for x in line.split("hit rate ")[1].split(", "))
    assert with_disk > without
    assert main([*args, "--disk-cache", "4GiB"]) == 2
    assert "--disk-cache needs --host-cache" in capsys.readouterr().err


# Faults injected under a running manager. The scenario: prompt A's block 0 waits in host
# memory and its block 1 on disk, both holding known bytes, and every primary block has been
# overwritten since. After each fault, adding A again must give the engine the right bytes for
# every position it reports reused, hand out primary blocks only, pass check_invariants, and
# leave nothing behind once the request is removed.

A = list(range(9))


def spill(directory: str, seed: int = 0) -> tuple[KVCacheManager, list[list[np.ndarray]]]:
    """The scenario's manager (its tier in `directory`) and A's two blocks' bytes per layer."""
    config = KvCacheConfig(
        tokens_per_block=4,
        backend="host",
        event_buffer_max_size=1000,
        disk_cache_dir=directory,
        host_cache_size=1,
        disk_cache_size=1,
    )
    m = KVCacheManager.from_blocks(MODEL, config, {64: (3, 1, 4)}, max_seq_len=64, max_batch_size=4)
    rng = np.random.default_rng(seed)
    m.add_sequence(1, A)
    want = [_fill(m, b, rng) for b in m.get_cache_block_ids(1, 64)[:2]]
    m.remove_sequence(1)
    m.add_sequence(2, list(range(100, 109)))
    for b in m.get_cache_block_ids(2, 64):
        _fill(m, b, rng)
    m.remove_sequence(2, store_for_reuse=False)
    return m, want


def readmit(m: KVCacheManager, want: list[list[np.ndarray]]) -> dict[str, object]:
    """Adds A again, checks the manager, removes A, checks again; what the engine saw."""
    reused = m.add_sequence(3, A)
    blocks = m.get_cache_block_ids(3, 64)
    right = [
        all(np.array_equal(m.get_buffers(layer)[b], want[j][layer]) for layer in range(2))
        for j, b in enumerate(blocks[: reused // 4])
    ]
    m.check_invariants()
    m.remove_sequence(3)
    m.check_invariants()
    stats = m.get_kv_cache_stats()
    return {
        "reused": reused,
        "blocks": blocks,
        "right": right,
        "failures": stats.disk_read_failures,
        "used": stats.used_num_blocks,
    }


MISS = {"reused": 4, "right": [True], "used": 0}  # block 0 from host memory, block 1 a miss


def _window_file(directory: Path) -> Path:
    (data,) = directory.glob("kvcache-*-window-64.kvblocks")
    return data


def _xor(path: Path, offset: int, n: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset : offset + n] = bytes(x ^ 0xFF for x in raw[offset : offset + n])
    path.write_bytes(bytes(raw))


def _extend_with_zeros(path: Path) -> None:
    size = path.stat().st_size
    os.truncate(path, 0)
    os.truncate(path, size)


FAULTS: dict[str, Callable[[Path], None]] = {
    "truncated": lambda f: os.truncate(f, 0),
    "short": lambda f: os.truncate(f, HEADER + BLOCK - 1),
    "truncated-then-extended": _extend_with_zeros,
    "content-xored": lambda f: _xor(f, HEADER + 100, 10),
    "key-hash-xored": lambda f: _xor(f, 8, 1),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_block_that_does_not_read_back_intact_is_a_miss(tmp_path: Path, fault: str) -> None:
    m, want = spill(str(tmp_path / "tier"))
    FAULTS[fault](_window_file(tmp_path / "tier"))
    assert m.get_reusable_prefix_length(A) == 8  # the lookup cannot know before reading
    m.get_latest_events()
    got = readmit(m, want)
    blocks = got.pop("blocks")
    assert isinstance(blocks, list) and len(blocks) == 3
    assert all(0 <= b < 3 for b in blocks), blocks  # primary blocks only
    assert got == {**MISS, "failures": 1}
    # The router hears that block 1 left the disk tier; nothing reached a primary block.
    kinds = [(e.kind, e.data.get("cache_level")) for e in m.get_latest_events()]
    assert ("removed", None) in kinds and ("updated", (2, 0)) not in kinds
    # The block is gone for good: A again reuses what is cached in primary memory only.
    assert m.get_reusable_prefix_length(A) == 8  # blocks 0 and 1 (recomputed by A's 3rd add)
    del m
    gc.collect()
    assert list((tmp_path / "tier").iterdir()) == []


def test_an_unlinked_file_still_serves_its_verified_bytes(tmp_path: Path) -> None:
    # The tier keeps its files open: a name removed under it loses nothing, and the bytes
    # still pass their checks. A hit with the right bytes, and the manager still cleans up.
    m, want = spill(str(tmp_path / "tier"))
    _window_file(tmp_path / "tier").unlink()
    got = readmit(m, want)
    assert got["reused"] == 8 and got["right"] == [True, True] and got["failures"] == 0
    del m
    gc.collect()
    assert list((tmp_path / "tier").iterdir()) == []


def test_an_unusable_directory_is_refused_at_construction(tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    plain.write_text("x")
    with pytest.raises(
        KVCacheError, match=r"cannot create directory .*plain/tier: Not a directory"
    ):
        spill(str(plain / "tier"))
    with pytest.raises(KVCacheError, match=r"plain is not a directory"):
        spill(str(plain))


def _child(*args: str) -> dict[str, object]:
    """Runs this file's __main__ with `args` in a child process; returns what it printed."""
    cmd = [sys.executable, __file__, *args]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert isinstance(result, dict)
    return result


def test_writes_past_rlimit_fsize_are_refused_and_a_miss(tmp_path: Path) -> None:
    # In a child: SIGXFSZ ignored, file size limit under one slot, so the tier's writes fail
    # with EFBIG. The block is dropped instead of stored (never an error), and is a miss.
    got = _child("rlimit", str(tmp_path / "tier"))
    assert got["efbig"] is True  # the limit is in force: a plain write past it fails
    assert got["file_size"] <= HEADER + 100  # type: ignore[operator]
    assert {k: got[k] for k in MISS} == MISS and got["failures"] == 0


def test_two_managers_in_two_pid_namespaces_share_a_directory(tmp_path: Path) -> None:
    probe = ["unshare", "--pid", "--fork", "--mount-proc", "true"]
    if shutil.which("unshare") is None or subprocess.run(probe, capture_output=True).returncode:
        pytest.skip("unshare --pid --fork --mount-proc is not permitted in this container")
    tier, sync = tmp_path / "tier", tmp_path / "sync"
    sync.mkdir()
    prefix = ["unshare", "--pid", "--fork", "--mount-proc"]
    cmd = [sys.executable, __file__, "pidns", str(tier), str(sync)]
    procs = [
        subprocess.Popen(
            [*prefix, *cmd, name, other, seed], stdout=subprocess.PIPE, stderr=subprocess.PIPE
        )
        for name, other, seed in (("a", "b", "1"), ("b", "a", "2"))
    ]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == 0, err.decode()
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    for got in results:
        assert got["pid"] == 1  # the same PID in both: the names cannot rest on it
        assert len(got["files"]) == 4  # two lock files and two window files while both lived
        assert got["reused"] == 8 and got["right"] == [True, True] and got["failures"] == 0
    assert results[0]["files"] == results[1]["files"]
    assert list(tier.iterdir()) == []


def test_a_read_only_directory_is_refused_at_construction() -> None:
    # Root ignores directory permissions: the child drops to user and group 65534 (once its
    # modules are loaded: the interpreter's own files may be readable by root only).
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the check as another, unprivileged user")
    top = Path(tempfile.mkdtemp(prefix="kvcache-ro-"))
    try:
        top.chmod(0o755)
        ro = top / "ro"
        ro.mkdir(mode=0o555)
        ro.chmod(0o555)
        got = _child("readonly", str(ro))
        assert got["type"] == "KVCacheError"
        assert re.search(
            r"cannot create a file in .*/ro \(.*\.lock\): Permission denied", str(got["message"])
        )
        assert list(ro.iterdir()) == []
    finally:
        shutil.rmtree(top)


def _child_main(argv: list[str]) -> dict[str, object]:
    """The children of the tests above; returns what they print (as JSON)."""
    import resource
    import signal
    import time

    mode, directory = argv[0], argv[1]
    if mode == "rlimit":
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (HEADER + 100, hard))
        m, want = spill(directory)
        size = _window_file(Path(directory)).stat().st_size
        try:
            (Path(directory) / "probe").write_bytes(b"x" * (HEADER + 101))
            efbig = False
        except OSError as e:
            efbig = e.errno == 27  # EFBIG
        (Path(directory) / "probe").unlink()
        return {**readmit(m, want), "efbig": efbig, "file_size": size}
    if mode == "pidns":
        sync, name, other, seed = Path(argv[2]), argv[3], argv[4], int(argv[5])
        m, want = spill(directory, seed)
        (sync / name).touch()
        deadline = time.monotonic() + 30
        while not (sync / other).exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        files = sorted(os.listdir(directory))
        got = readmit(m, want)
        (sync / f"{name}.done").touch()  # both read before either removes its files
        while not (sync / f"{other}.done").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        return {**got, "pid": os.getpid(), "files": files}
    os.setgroups([])
    os.setgid(65534)
    os.setuid(65534)
    try:
        spill(directory)
    except KVCacheError as e:
        return {"type": type(e).__name__, "message": str(e)}
    return {"type": None, "message": ""}


if __name__ == "__main__":
    print(json.dumps(_child_main(sys.argv[1:])))
