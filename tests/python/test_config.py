"""Tests for kvcache.config: validation, dict round trips and config files."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvcache.config import KvCacheConfig, ModelConfig

# ----------------------------------------------------------------------------- ModelConfig


def test_model_defaults_and_helpers() -> None:
    m = ModelConfig(num_layers=3, num_kv_heads=8, head_dim=128)
    assert m.dtype == "float16"
    assert m.kv_factor == 2
    assert m.dtype_bytes == 2
    assert m.kv_heads_per_layer() == [8, 8, 8]
    assert m.bytes_per_token_per_layer() == [4096, 4096, 4096]


@pytest.mark.parametrize(
    ("dtype", "nbytes"),
    [("float32", 4), ("float16", 2), ("bfloat16", 2), ("fp8", 1), ("int8", 1)],
)
def test_model_dtype_bytes(dtype: str, nbytes: int) -> None:
    assert ModelConfig(num_layers=1, num_kv_heads=1, head_dim=1, dtype=dtype).dtype_bytes == nbytes


def test_model_heads_sequence_stored_as_tuple() -> None:
    m = ModelConfig(num_layers=3, num_kv_heads=[8, 4, 2], head_dim=64, kv_factor=1)
    assert m.num_kv_heads == (8, 4, 2)
    assert m.kv_heads_per_layer() == [8, 4, 2]
    assert m.bytes_per_token_per_layer() == [1024, 512, 256]
    assert hash(m) == hash(ModelConfig(3, (8, 4, 2), 64, kv_factor=1))
    a = ModelConfig(num_layers=2, num_kv_heads=np.array([4, 4]), head_dim=64)
    assert a.num_kv_heads == (4, 4)
    assert all(type(h) is int for h in a.num_kv_heads)  # type: ignore[union-attr]


def test_model_is_frozen() -> None:
    m = ModelConfig(num_layers=1, num_kv_heads=1, head_dim=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.num_layers = 2  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_layers": 0}, "num_layers"),
        ({"num_layers": 2.0}, "num_layers"),
        ({"num_layers": True}, "num_layers"),
        ({"head_dim": -128}, "head_dim"),
        ({"head_dim": "128"}, "head_dim"),
        ({"num_kv_heads": 0}, "num_kv_heads"),
        ({"num_kv_heads": [8, 8]}, "num_kv_heads must be an int or a sequence of num_layers=3"),
        ({"num_kv_heads": [8, 0, 8]}, r"num_kv_heads\[1\]"),
        ({"num_kv_heads": [8, 8.0, 8]}, r"num_kv_heads\[1\]"),
        ({"num_kv_heads": "888"}, "num_kv_heads"),
        ({"dtype": "fp16"}, "dtype"),
        ({"dtype": "float64"}, "dtype"),
        ({"kv_factor": 3}, "kv_factor"),
        ({"kv_factor": 0}, "kv_factor"),
    ],
)
def test_model_validation(kwargs: dict[str, Any], field: str) -> None:
    base: dict[str, Any] = {"num_layers": 3, "num_kv_heads": 8, "head_dim": 128}
    with pytest.raises(ValueError, match=field):
        ModelConfig(**{**base, **kwargs})


def test_model_dict_round_trip() -> None:
    m = ModelConfig(num_layers=2, num_kv_heads=[1, 2], head_dim=64, dtype="bfloat16")
    d = m.to_dict()
    assert d == {
        "num_layers": 2,
        "num_kv_heads": [1, 2],
        "head_dim": 64,
        "dtype": "bfloat16",
        "kv_factor": 2,
    }
    assert json.loads(json.dumps(d)) == d
    assert ModelConfig.from_dict(d) == m


def test_model_from_dict_unknown_key() -> None:
    with pytest.raises(ValueError, match=r"unknown ModelConfig field.*: hidden_size"):
        ModelConfig.from_dict({"num_layers": 1, "num_kv_heads": 1, "head_dim": 1, "hidden_size": 2})


def test_model_from_dict_missing_key() -> None:
    with pytest.raises(TypeError, match="head_dim"):
        ModelConfig.from_dict({"num_layers": 1, "num_kv_heads": 1})


# ----------------------------------------------------------------------------- KvCacheConfig


def test_kv_defaults_match_api() -> None:
    c = KvCacheConfig()
    assert c.to_dict() == {
        "tokens_per_block": 32,
        "max_attention_window": None,
        "max_tokens": None,
        "free_gpu_memory_fraction": 0.9,
        "max_gpu_total_bytes": None,
        "host_cache_size": 0,
        "enable_block_reuse": True,
        "enable_partial_reuse": True,
        "copy_on_partial_reuse": True,
        "onboard_blocks": True,
        "secondary_offload_min_priority": 30,
        "window_size_shares": None,
        "event_buffer_max_size": 0,
        "swa_reuse_policy": "placeholder",
        "protect_reused_blocks": True,
        "lend_free_memory": False,
        "backend": "auto",
        "expected_seq_len": None,
        "max_num_batched_tokens": 8192,
        "kv_cache_dtype": None,
        "disk_cache_size": 0,
        "disk_cache_dir": None,
        "shared_cache_url": None,
        "shared_cache_namespace": None,
        "shared_cache_timeout_ms": 5,
        "shared_cache_queue_bytes": 64 << 20,
    }


def test_kv_normalisation() -> None:
    c = KvCacheConfig(
        max_attention_window=[512, None, "full", np.int64(64)],  # type: ignore[list-item]
        window_size_shares=[1, 2.5],
        free_gpu_memory_fraction=1,
        max_gpu_total_bytes=0,
    )
    assert c.max_attention_window == (512, None, None, 64)
    assert c.window_size_shares == (1.0, 2.5)
    assert c.free_gpu_memory_fraction == 1.0
    assert isinstance(c.free_gpu_memory_fraction, float)
    assert c.max_gpu_total_bytes is None
    assert KvCacheConfig(window_size_shares=" auto ").window_size_shares == "auto"
    assert KvCacheConfig(window_size_shares="1, 3").window_size_shares == (1.0, 3.0)
    assert hash(c) == hash(KvCacheConfig.from_dict(c.to_dict()))


def test_kv_dict_round_trip_json() -> None:
    c = KvCacheConfig(
        tokens_per_block=64,
        max_attention_window=[1024, 1024, None],
        max_tokens=10_000,
        free_gpu_memory_fraction=0.5,
        max_gpu_total_bytes=2**30,
        host_cache_size=2**20,
        enable_block_reuse=False,
        secondary_offload_min_priority=0,
        window_size_shares=[0.25, 0.75],
        event_buffer_max_size=16,
        swa_reuse_policy="placeholder",
        backend="virtual",
        max_num_batched_tokens=2048,
    )
    d = json.loads(json.dumps(c.to_dict()))
    assert d["max_attention_window"] == [1024, 1024, None]
    assert d["window_size_shares"] == [0.25, 0.75]
    assert KvCacheConfig.from_dict(d) == c


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"tokens_per_block": 0}, "tokens_per_block must be a positive int"),
        ({"tokens_per_block": 16.0}, "tokens_per_block"),
        ({"tokens_per_block": True}, "tokens_per_block"),
        ({"max_attention_window": []}, "max_attention_window"),
        ({"max_attention_window": [0]}, r"max_attention_window\[0\]"),
        ({"max_attention_window": [128, -1]}, r"max_attention_window\[1\]"),
        ({"max_attention_window": [128.0]}, r"max_attention_window\[0\]"),
        ({"max_attention_window": 1024}, "max_attention_window must be a sequence"),
        ({"max_attention_window": "1024"}, "max_attention_window must be a sequence"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.0}, "max_tokens"),
        ({"free_gpu_memory_fraction": 0}, "free_gpu_memory_fraction"),
        ({"free_gpu_memory_fraction": 1.01}, "free_gpu_memory_fraction"),
        ({"free_gpu_memory_fraction": float("nan")}, "free_gpu_memory_fraction"),
        ({"free_gpu_memory_fraction": "0.5"}, "free_gpu_memory_fraction"),
        ({"free_gpu_memory_fraction": True}, "free_gpu_memory_fraction"),
        ({"max_gpu_total_bytes": -1}, "max_gpu_total_bytes"),
        ({"max_gpu_total_bytes": 1e9}, "max_gpu_total_bytes"),
        ({"host_cache_size": -1}, "host_cache_size"),
        ({"host_cache_size": None}, "host_cache_size"),
        ({"enable_block_reuse": 1}, "enable_block_reuse must be a bool"),
        ({"enable_partial_reuse": "yes"}, "enable_partial_reuse"),
        ({"copy_on_partial_reuse": None}, "copy_on_partial_reuse"),
        ({"onboard_blocks": 0}, "onboard_blocks"),
        ({"secondary_offload_min_priority": -1}, "secondary_offload_min_priority"),
        ({"secondary_offload_min_priority": 101}, "secondary_offload_min_priority"),
        ({"window_size_shares": "fast"}, "window_size_shares"),
        ({"window_size_shares": [1, -1]}, "window_size_shares: entry 1 is negative"),
        ({"window_size_shares": [0, 0]}, "window_size_shares: shares are all zero"),
        ({"window_size_shares": [float("nan")]}, "window_size_shares: entry 0 is nan"),
        ({"window_size_shares": ["1"]}, "window_size_shares: entry 0 must be a number"),
        ({"window_size_shares": []}, "window_size_shares: no shares"),
        ({"window_size_shares": 0.5}, "window_size_shares must be a sequence"),
        ({"event_buffer_max_size": -1}, "event_buffer_max_size"),
        ({"swa_reuse_policy": "keep"}, "swa_reuse_policy"),
        ({"backend": "gpu"}, "backend must be one of 'auto', 'cuda', 'host', 'virtual'"),
        ({"max_num_batched_tokens": 0}, "max_num_batched_tokens must be a positive int"),
        ({"max_num_batched_tokens": 8192.0}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": None}, "max_num_batched_tokens"),
        ({"max_num_batched_tokens": True}, "max_num_batched_tokens"),
    ],
)
def test_kv_validation(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        KvCacheConfig(**kwargs)
    with pytest.raises(ValueError, match=field):
        KvCacheConfig.from_dict(kwargs)


def test_kv_priorities_edges() -> None:
    assert KvCacheConfig(secondary_offload_min_priority=0).secondary_offload_min_priority == 0
    assert KvCacheConfig(secondary_offload_min_priority=100).secondary_offload_min_priority == 100


def test_kv_unknown_keys_named() -> None:
    with pytest.raises(ValueError, match=r"unknown KvCacheConfig field.*: blocks, zeta"):
        KvCacheConfig.from_dict({"zeta": 1, "blocks": 2, "tokens_per_block": 16})
    with pytest.raises(ValueError, match="expects a mapping"):
        KvCacheConfig.from_dict([("tokens_per_block", 16)])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("pattern", "num_layers", "max_seq_len", "expected"),
    [
        (None, 3, 100, [100, 100, 100]),
        ([None], 2, 100, [100, 100]),
        ([64], 2, 100, [64, 64]),
        ([64, 100, 200], 3, 100, [64, 100, 100]),
        ([64, None], 5, 100, [64, 100, 64, 100, 64]),
        ([1024] * 5 + [None], 8, 32768, [1024] * 5 + [32768, 1024, 1024]),
    ],
)
def test_attention_window_per_layer(
    pattern: list[int | None] | None, num_layers: int, max_seq_len: int, expected: list[int]
) -> None:
    c = KvCacheConfig(max_attention_window=pattern)
    assert c.attention_window_per_layer(num_layers, max_seq_len) == expected


def test_attention_window_per_layer_errors() -> None:
    c = KvCacheConfig(max_attention_window=[1, 2, 3])
    with pytest.raises(ValueError, match="3 entries, more than the model's 2 layers"):
        c.attention_window_per_layer(2, 10)
    with pytest.raises(ValueError, match="max_seq_len"):
        c.attention_window_per_layer(3, 0)
    with pytest.raises(ValueError, match="num_layers"):
        c.attention_window_per_layer(0, 10)


# ----------------------------------------------------------------------------- files

EXPECTED = KvCacheConfig(
    tokens_per_block=64,
    max_attention_window=[1024, 1024, None],
    host_cache_size=1024,
    window_size_shares="auto",
    backend="virtual",
)


def test_from_file_json(tmp_path: Path) -> None:
    p = tmp_path / "kv.json"
    p.write_text(json.dumps(EXPECTED.to_dict()))
    assert KvCacheConfig.from_file(p) == EXPECTED
    assert KvCacheConfig.from_file(str(p)) == EXPECTED


def test_from_file_toml(tmp_path: Path) -> None:
    p = tmp_path / "kv.toml"
    p.write_text(
        "tokens_per_block = 64\n"
        'max_attention_window = [1024, 1024, "full"]\n'
        "host_cache_size = 1024\n"
        'window_size_shares = "auto"\n'
        'backend = "virtual"\n'
    )
    assert KvCacheConfig.from_file(p) == EXPECTED


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".YAML"])
def test_from_file_yaml(tmp_path: Path, suffix: str) -> None:
    pytest.importorskip("yaml")
    p = tmp_path / f"kv{suffix}"
    p.write_text(
        "tokens_per_block: 64\n"
        "max_attention_window: [1024, 1024, null]\n"
        "host_cache_size: 1024\n"
        "window_size_shares: auto\n"
        "backend: virtual\n"
    )
    assert KvCacheConfig.from_file(p) == EXPECTED


def test_from_file_yaml_without_pyyaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "yaml", None)
    p = tmp_path / "kv.yaml"
    p.write_text("tokens_per_block: 64\n")
    with pytest.raises(ValueError, match="pyyaml"):
        KvCacheConfig.from_file(p)


@pytest.mark.parametrize(
    ("name", "text", "message"),
    [
        ("kv.json", "{", "invalid|Expecting"),
        ("kv.json", "[1, 2]", "expected a table"),
        ("kv.json", '{"tokens_per_block": 0}', "tokens_per_block must be a positive int"),
        ("kv.json", '{"color": "red"}', "unknown KvCacheConfig field"),
        ("kv.toml", "tokens_per_block = ", "invalid TOML"),
        ("kv.yaml", "a: [1, 2", "invalid YAML"),
        ("kv.yaml", "", "expected a table"),
        ("kv.ini", "[x]", "unsupported config file type '.ini'"),
        ("kv", "{}", "unsupported config file type '\\(none\\)'"),
    ],
)
def test_from_file_errors(tmp_path: Path, name: str, text: str, message: str) -> None:
    p = tmp_path / name
    p.write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        KvCacheConfig.from_file(p)
    assert str(p) in str(info.value)


def test_from_file_missing(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read KV cache config file"):
        KvCacheConfig.from_file(tmp_path / "nope.json")
