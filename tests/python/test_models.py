"""Tests for kvcache.models: the built-in presets and their data files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.models import ModelPreset, list_models, load_model
from kvcache.sizing import bytes_per_token, window_sizes

ALL = [
    "command-a",
    "falcon-h1-34b",
    "gemma-2-27b",
    "gemma-2-9b",
    "gemma-3-12b",
    "gemma-3-1b",
    "gemma-3-27b",
    "gemma-3-4b",
    "gemma-4-26b-a4b",
    "gemma-4-31b",
    "gemma-4-e2b",
    "gemma-4-e4b",
    "gpt-oss-120b",
    "gpt-oss-20b",
    "granite-4.0-h-small",
    "jamba-1.5-mini",
    "llama-3.1-8b",
    "mistral-7b-v0.1",
    "nemotron-3-nano-30b-a3b",
    "qwen3-next-80b-a3b",
    "qwen3.5-27b",
    "qwen3.5-397b-a17b",
    "qwen3.5-9b",
]

G3 = (1024, 1024, 1024, 1024, 1024, None)

# name: (layers, kv heads, head_dim, pattern, max context)
SHAPES: dict[str, tuple[int, int, int, tuple[int | None, ...] | None, int]] = {
    "gemma-2-9b": (42, 8, 256, (4096, None), 8192),
    "gemma-2-27b": (46, 16, 128, (4096, None), 8192),
    "gemma-3-1b": (26, 1, 256, (512, 512, 512, 512, 512, None), 32768),
    "gemma-3-4b": (34, 4, 256, G3, 131072),
    "gemma-3-12b": (48, 8, 256, G3, 131072),
    "gemma-3-27b": (62, 16, 128, G3, 131072),
    "gpt-oss-20b": (24, 8, 64, (128, None), 131072),
    "gpt-oss-120b": (36, 8, 64, (128, None), 131072),
    "command-a": (64, 8, 128, (4096, 4096, 4096, None), 262144),
    "mistral-7b-v0.1": (32, 8, 128, (4096,), 32768),
    "llama-3.1-8b": (32, 8, 128, None, 131072),
}


def test_list_models() -> None:
    assert list_models() == ALL


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_preset_shape(name: str) -> None:
    p = load_model(name)
    layers, heads, head_dim, pattern, context = SHAPES[name]
    assert isinstance(p, ModelPreset)
    assert p.name == name
    assert p.model == ModelConfig(
        num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype="bfloat16"
    )
    assert p.max_attention_window == pattern
    assert p.max_context == context
    assert p.description
    assert p.source
    # the pattern is valid for the model and the config helper carries it
    config = p.kv_cache_config(tokens_per_block=64)
    assert config.max_attention_window == pattern
    assert config.tokens_per_block == 64
    expected = sorted({context if w is None else w for w in (pattern or (None,))})
    assert window_sizes(p.model, config, p.max_context) == expected


# Gemma 4: name -> (layers, pattern, (sliding heads, head size), (full heads, head size),
# max context, bytes per token of the sliding window, of the full window).
G4_31B = (1024,) * 5 + (None,)
GEMMA4: dict[str, tuple[int, tuple[int | None, ...], tuple[int, int], tuple[int, int], int]] = {
    "gemma-4-31b": (60, G4_31B, (16, 256), (4, 512), 262144),
    "gemma-4-26b-a4b": (30, G4_31B, (8, 256), (2, 512), 262144),
    "gemma-4-e4b": (24, (512,) * 5 + (None,), (2, 256), (2, 512), 131072),
    "gemma-4-e2b": (15, (512,) * 4 + (None,), (1, 256), (1, 512), 131072),
}


@pytest.mark.parametrize("name", sorted(GEMMA4))
def test_gemma4_presets_have_per_layer_shapes(name: str) -> None:
    p = load_model(name)
    layers, pattern, sliding, full, context = GEMMA4[name]
    assert p.max_attention_window == pattern
    assert p.max_context == context
    assert p.model.num_layers == layers
    assert p.model.dtype == "bfloat16"
    assert "transformers" in p.source and "config" in p.source
    kinds = [pattern[i % len(pattern)] is None for i in range(layers)]
    assert p.model.kv_heads_per_layer() == [full[0] if f else sliding[0] for f in kinds]
    assert p.model.head_dim_per_layer() == [full[1] if f else sliding[1] for f in kinds]


def test_gemma4_bytes_per_token() -> None:
    # heads x 2 (K, V) x head size x 2 B, summed over each window's layers
    expected = {
        "gemma-4-31b": {1024: 50 * 16 * 2 * 256 * 2, 262144: 10 * 4 * 2 * 512 * 2},
        "gemma-4-26b-a4b": {1024: 25 * 8 * 2 * 256 * 2, 262144: 5 * 2 * 2 * 512 * 2},
        "gemma-4-e4b": {512: 20 * 2 * 2 * 256 * 2, 131072: 4 * 2 * 2 * 512 * 2},
        "gemma-4-e2b": {512: 12 * 1 * 2 * 256 * 2, 131072: 3 * 1 * 2 * 512 * 2},
    }
    for name, bpt in expected.items():
        p = load_model(name)
        assert bytes_per_token(p.model, p.kv_cache_config(), p.max_context) == bpt
    assert expected["gemma-4-31b"] == {1024: 819200, 262144: 81920}
    # FP8 full layers halve the full window only
    p = load_model("gemma-4-31b")
    fp8 = p.kv_cache_config(kv_cache_dtype={"full": "fp8"})
    assert bytes_per_token(p.model, fp8, 32768) == {1024: 819200, 32768: 40960}


def test_gemma3_27b_layer_split() -> None:
    p = load_model("gemma-3-27b")
    bpt = bytes_per_token(p.model, p.kv_cache_config(), 32768)
    assert bpt == {1024: 52 * 8192, 32768: 10 * 8192}


def test_mistral_is_single_sliding_window() -> None:
    p = load_model("mistral-7b-v0.1")
    assert window_sizes(p.model, p.kv_cache_config(), 32768) == [4096]
    assert window_sizes(p.model, p.kv_cache_config(), 4096) == [4096]


def test_gpt_oss_alternates_starting_with_sliding() -> None:
    p = load_model("gpt-oss-20b")
    layers = p.kv_cache_config().attention_window_per_layer(p.model.num_layers, 131072)
    assert layers[:4] == [128, 131072, 128, 131072]
    assert layers.count(128) == 12


def test_case_insensitive_and_whitespace() -> None:
    assert load_model(" Gemma-3-27B ").name == "gemma-3-27b"


def test_unknown_model_lists_known_names() -> None:
    with pytest.raises(ValueError, match="unknown model 'gemma-4'") as info:
        load_model("gemma-4")
    for name in ALL:
        assert name in str(info.value)
    with pytest.raises(ValueError, match="non-empty string"):
        load_model("")


def test_window_pattern_text() -> None:
    assert load_model("gemma-3-27b").window_pattern_text() == "5 x 1024, full (repeating)"
    assert load_model("mistral-7b-v0.1").window_pattern_text() == "4096 on every layer"
    assert load_model("llama-3.1-8b").window_pattern_text() == "full"


def test_load_from_json_file(tmp_path: Path) -> None:
    data = {
        "name": "tiny",
        "description": "a tiny test model",
        "model": {"num_layers": 2, "num_kv_heads": [1, 2], "head_dim": 8, "dtype": "fp8"},
        "max_attention_window": [16, None],
        "max_context": 64,
    }
    f = tmp_path / "tiny.json"
    f.write_text(json.dumps(data))
    p = load_model(str(f))
    assert p.model.num_kv_heads == (1, 2)
    assert p.max_attention_window == (16, None)
    assert p.source == ""


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("{", "invalid JSON"),
        ("[]", "expected a JSON object"),
        ('{"name": "x", "model": {}, "max_context": 1, "extra": 1}', "unknown keys"),
        ('{"name": "x", "model": {"num_layers": 1}}', "missing keys"),
        ('{"name": "x", "model": 3, "max_context": 1}', "'model' must be an object"),
        (
            '{"name": "x", "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 0},'
            ' "max_context": 1}',
            "head_dim",
        ),
        (
            '{"name": "x", "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1},'
            ' "max_context": 0}',
            "max_context",
        ),
        (
            '{"name": "x", "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1},'
            ' "max_context": 8, "max_attention_window": [0]}',
            "max_attention_window",
        ),
    ],
)
def test_bad_preset_files(tmp_path: Path, data: str, message: str) -> None:
    f = tmp_path / "bad.json"
    f.write_text(data)
    with pytest.raises(ValueError, match=message):
        load_model(str(f))


def test_presets_ship_as_package_data() -> None:
    # The presets live inside the package directory, so scikit-build-core packs them.
    import kvcache.models as models_pkg

    pkg_dir = Path(models_pkg.__file__).parent
    assert sorted(p.stem for p in pkg_dir.glob("*.json")) == ALL
    for f in pkg_dir.glob("*.json"):
        assert json.loads(f.read_text())["name"] == f.stem


def test_config_from_preset_is_a_kv_cache_config() -> None:
    assert isinstance(load_model("gemma-2-9b").kv_cache_config(), KvCacheConfig)
