"""Recurrent layers in the configuration (issue 33): state tensors, the state pool's share of
the budget, its slots, the hybrid presets and ``kvcache models``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import kvcache
from kvcache.cli import main
from kvcache.config import KvCacheConfig, ModelConfig, StateTensor
from kvcache.models import load_model
from kvcache.sizing import (
    SHARES_ENV_VAR,
    TRTLLM_SHARES_ENV_VAR,
    blocks_per_window,
    pool_shares,
    state_slots,
)

GIB = 2**30
CONV = {"name": "conv", "shape": [8192, 3], "dtype": "bfloat16"}
REC = {"name": "recurrent", "shape": [32, 128, 128], "dtype": "float32"}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


def qwen(**config: Any) -> tuple[ModelConfig, KvCacheConfig]:
    p = load_model("qwen3.5-9b")
    return p.model, p.kv_cache_config(**config)


# ----------------------------------------------------------------------------- StateTensor


def test_state_tensor_bytes() -> None:
    assert StateTensor("conv", (8192, 3), "bfloat16").nbytes == 49_152
    assert StateTensor("recurrent", [32, 128, 128], "float32").nbytes == 2_097_152
    assert StateTensor("x", (7,), "fp8").nbytes == 7
    assert StateTensor("x", (1, 2, 3, 4), "float16").nbytes == 48
    assert kvcache.StateTensor is StateTensor


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", (1,), "float32"), "StateTensor.name"),
        (("ssm", (), "float32"), "'ssm' shape must have 1 to 4 dimensions, got 0"),
        (("ssm", (1, 1, 1, 1, 1), "float32"), "1 to 4 dimensions, got 5"),
        (("ssm", (4, 0), "float32"), r"'ssm' shape\[1\]"),
        (("ssm", (4, True), "float32"), r"'ssm' shape\[1\]"),
        (("ssm", "44", "float32"), "'ssm' shape must be a sequence"),
        (("ssm", (4,), "float64"), "'ssm' dtype must be one of"),
    ],
)
def test_state_tensor_validation(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StateTensor(*args)


def test_state_tensor_dict_round_trip() -> None:
    t = StateTensor.from_dict(CONV)
    assert t == StateTensor("conv", (8192, 3), "bfloat16")
    assert t.to_dict() == CONV
    with pytest.raises(ValueError, match="unknown StateTensor field"):
        StateTensor.from_dict({**CONV, "bytes": 1})
    with pytest.raises(ValueError, match="StateTensor needs dtype"):
        StateTensor.from_dict({"name": "conv", "shape": [1]})


# ----------------------------------------------------------------------------- ModelConfig


def test_model_state_bytes() -> None:
    m = ModelConfig(
        num_layers=8,
        num_kv_heads=4,
        head_dim=256,
        dtype="bfloat16",
        recurrent_layers=24,
        recurrent_state=[CONV, StateTensor.from_dict(REC)],
    )
    assert m.recurrent_state == (StateTensor.from_dict(CONV), StateTensor.from_dict(REC))
    assert m.state_bytes_per_layer() == 2_146_304
    assert m.state_bytes_per_sequence() == 24 * 2_146_304 == 51_511_296
    assert m.is_hybrid
    # Attention layers are unchanged by the recurrent ones.
    assert m.bytes_per_token_per_layer() == [4096] * 8


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"recurrent_layers": 24}, "recurrent_layers = 24 needs recurrent_state"),
        ({"recurrent_state": [CONV]}, "recurrent_state has 1 tensor.* recurrent_layers is 0"),
        ({"recurrent_layers": -1, "recurrent_state": [CONV]}, "recurrent_layers must be an int"),
        ({"recurrent_layers": True, "recurrent_state": [CONV]}, "recurrent_layers must be an int"),
        ({"recurrent_layers": 2**31, "recurrent_state": [CONV]}, "recurrent_layers must be an int"),
        ({"recurrent_layers": 1, "recurrent_state": CONV}, "recurrent_state must be a sequence"),
        ({"recurrent_layers": 1, "recurrent_state": [3]}, r"recurrent_state\[0\] must be"),
        (
            {"recurrent_layers": 1, "recurrent_state": [{**CONV, "dtype": "f32"}]},
            r"recurrent_state\[0\]: StateTensor 'conv' dtype",
        ),
        (
            {"recurrent_layers": 1, "recurrent_state": [CONV, CONV]},
            "recurrent_state names 'conv' more than once",
        ),
    ],
)
def test_model_recurrent_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ModelConfig(num_layers=1, num_kv_heads=1, head_dim=8, **kwargs)


def test_model_dict_round_trip_and_repr() -> None:
    d = {
        "num_layers": 8,
        "num_kv_heads": 4,
        "head_dim": 256,
        "dtype": "bfloat16",
        "kv_factor": 2,
        "recurrent_layers": 24,
        "recurrent_state": [CONV, REC],
    }
    m = ModelConfig.from_dict(d)
    assert m.to_dict() == d
    assert json.loads(json.dumps(m.to_dict())) == d
    assert ModelConfig.from_dict(m.to_dict()) == m
    assert hash(ModelConfig.from_dict(d)) == hash(m)
    assert "recurrent_layers=24" in repr(m)
    # Attention-only models read as before: no recurrent fields in the repr or the dict.
    plain = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64)
    assert repr(plain) == (
        "ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64, dtype='float16', kv_factor=2)"
    )
    assert "recurrent_layers" not in plain.to_dict()
    assert plain.state_bytes_per_sequence() == 0
    assert not plain.is_hybrid


# ----------------------------------------------------------------------------- KvCacheConfig


def test_kv_config_checkpoint_fields() -> None:
    c = KvCacheConfig()
    assert c.state_slots is None
    assert c.recurrent_checkpoints == ("prompt_end", "finish", "junction")
    assert c.recurrent_checkpoint_interval == 0
    assert c.max_checkpoints_per_path == 0
    assert c.checkpoint_policy() == {
        "prompt_end": True,
        "finish": True,
        "junction": True,
        "chunk_end": False,
        "interval_blocks": 0,
        "max_per_path": 0,
    }
    # Stored in the canonical order, from a list or comma-separated text.
    c = KvCacheConfig(recurrent_checkpoints=["chunk_end", "prompt_end"])
    assert c.recurrent_checkpoints == ("prompt_end", "chunk_end")
    assert KvCacheConfig(recurrent_checkpoints="chunk_end, prompt_end") == c
    assert KvCacheConfig(recurrent_checkpoints=[]).checkpoint_policy()["finish"] is False


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"state_slots": 0}, "state_slots must be a positive int"),
        ({"state_slots": 2**31}, "state_slots = 2147483648 is out of range"),
        ({"state_slots": 1.5}, "state_slots must be a positive int"),
        ({"recurrent_checkpoints": ["prompt"]}, r"recurrent_checkpoints\[0\] must be one of"),
        ({"recurrent_checkpoints": ["finish", "finish"]}, "names 'finish' twice"),
        ({"recurrent_checkpoints": 3}, "recurrent_checkpoints must be a sequence"),
        ({"recurrent_checkpoint_interval": -1}, "recurrent_checkpoint_interval must be a non"),
        ({"max_checkpoints_per_path": True}, "max_checkpoints_per_path must be a non-negative"),
        ({"max_checkpoints_per_path": 2**31}, "max_checkpoints_per_path = 2147483648 is out"),
    ],
)
def test_kv_config_checkpoint_validation(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(**kwargs)


def test_kv_config_round_trips(tmp_path: Path) -> None:
    c = KvCacheConfig(
        state_slots=96,
        recurrent_checkpoints=("finish", "chunk_end"),
        recurrent_checkpoint_interval=8,
        max_checkpoints_per_path=4,
    )
    d = c.to_dict()
    assert d["state_slots"] == 96
    assert d["recurrent_checkpoints"] == ["finish", "chunk_end"]
    assert KvCacheConfig.from_dict(json.loads(json.dumps(d))) == c
    assert hash(KvCacheConfig.from_dict(d)) == hash(c)
    # Defaults are left out, so configs that do not use them read as before.
    assert "state_slots" not in KvCacheConfig().to_dict()
    toml = tmp_path / "kv.toml"
    toml.write_text(
        'state_slots = 96\nrecurrent_checkpoints = ["finish", "chunk_end"]\n'
        "recurrent_checkpoint_interval = 8\nmax_checkpoints_per_path = 4\n"
    )
    assert KvCacheConfig.from_file(toml) == c
    yaml = pytest.importorskip("yaml")
    y = tmp_path / "kv.yaml"
    y.write_text(yaml.safe_dump(d))
    assert KvCacheConfig.from_file(y) == c


# ----------------------------------------------------------------------------- shares and slots


def test_equal_shares_give_the_state_pool_one_share() -> None:
    model, config = qwen(window_size_shares="equal")
    assert pool_shares(model, config, 32768) == ({32768: 0.5}, 0.5)
    # 8 GiB of 51,511,296-byte slots; 8 GiB of 32 x 32,768-byte blocks for the window.
    assert state_slots(model, config, 32768, 16 * GIB, max_batch_size=32) == 166
    # The host budget splits the same way: half for offloaded blocks, half for checkpoints.
    assert blocks_per_window(model, config, 32768, 16 * GIB, GIB) == {32768: (8192, 512)}


def test_the_state_pool_gets_its_share_of_the_host_cache() -> None:
    from kvcache import KVCacheManager

    model, config = qwen(window_size_shares="equal", host_cache_size=GIB, backend="virtual")
    m = KVCacheManager(model, config, max_seq_len=32768, max_batch_size=32, primary_bytes=16 * GIB)
    (group,) = m.state_groups()
    assert (
        (group["num_slots"], group["num_secondary"]) == (166, GIB // 2 // 51_511_296) == (166, 10)
    )
    assert m.blocks_per_window == {32768: (8192, 512)}


def test_auto_shares_reserve_two_slots_per_sequence() -> None:
    model, config = qwen(window_size_shares="auto")
    windows, state = pool_shares(model, config, 32768, primary_bytes=16 * GIB, max_batch_size=32)
    assert state * 16 * GIB == 64 * 51_511_296  # 2 x max_batch_size slots, exactly
    assert windows == {32768: 1 - state}
    assert state_slots(model, config, 32768, 16 * GIB, max_batch_size=32) == 64
    assert blocks_per_window(model, config, 32768, 16 * GIB, max_batch_size=32) == {
        32768: (13240, 0)
    }
    # Without a batch size every pool holds as many sequences: the state 2 slots of each.
    windows, state = pool_shares(model, config, 32768)
    assert state == pytest.approx(2 * 51_511_296 / (2 * 51_511_296 + 32768 * 32768))


def test_proportional_shares_count_two_slots_per_full_sequence() -> None:
    model, config = qwen(window_size_shares="proportional")
    _, state = pool_shares(model, config, 32768)
    assert state == pytest.approx(2 * 51_511_296 / (2 * 51_511_296 + 32768 * 32768))


def test_explicit_shares_need_one_more_entry() -> None:
    model, config = qwen(window_size_shares=[3, 1])
    assert pool_shares(model, config, 32768) == ({32768: 0.75}, 0.25)
    with pytest.raises(ValueError, match=r"gives 1 share.*a recurrent state pool: give 2 shares"):
        pool_shares(*qwen(window_size_shares=[1]), 32768)
    with pytest.raises(ValueError, match="gives 3 share"):
        blocks_per_window(*qwen(window_size_shares="1,1,1"), 32768, GIB)


@pytest.mark.parametrize("var", [SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR])
def test_environment_shares_cover_the_state_pool(monkeypatch: pytest.MonkeyPatch, var: str) -> None:
    model, config = qwen()
    monkeypatch.setenv(var, "1,3")
    assert pool_shares(model, config, 32768) == ({32768: 0.25}, 0.75)
    monkeypatch.setenv(var, "1")
    with pytest.raises(ValueError, match=f"environment variable {var} gives 1 share"):
        state_slots(model, config, 32768, GIB, max_batch_size=1)


def test_fixed_state_slots_come_first() -> None:
    model, config = qwen(window_size_shares="equal", state_slots=100)
    windows, state = pool_shares(model, config, 32768, primary_bytes=16 * GIB)
    assert state * 16 * GIB == pytest.approx(100 * 51_511_296)
    assert windows[32768] == pytest.approx(1 - state)
    assert state_slots(model, config, 32768, 16 * GIB, max_batch_size=32) == 100
    with pytest.raises(ValueError, match="state_slots = 100 is too few for max_batch_size = 100"):
        state_slots(model, config, 32768, 16 * GIB, max_batch_size=100)
    with pytest.raises(ValueError, match=r"state_slots = 100 needs 4\.80 GiB"):
        blocks_per_window(model, config, 32768, 4 * GIB)


def test_too_few_slots_names_the_numbers() -> None:
    model, config = qwen(window_size_shares=[0.99, 0.01])
    with pytest.raises(ValueError) as e:
        state_slots(model, config, 32768, 16 * GIB, max_batch_size=32)
    assert str(e.value) == (
        "memory budget too small for the recurrent state: its pool gets 164 MiB (share 0.0100 "
        "of 16.0 GiB), 3 slot(s) of 49.1 MiB (51,511,296 bytes: 24 recurrent layers x "
        "2,146,304 bytes), but max_batch_size = 32 needs at least 33 (one working slot per "
        "running sequence and one to checkpoint into): 1.58 GiB (1,699,872,768 bytes), a share "
        "of 0.0989; give the state pool a larger share or set state_slots"
    )


def test_attention_only_models_size_as_before() -> None:
    g = load_model("gemma-3-27b")
    config = g.kv_cache_config(window_size_shares="equal")
    assert pool_shares(g.model, config, 32768) == ({1024: 0.5, 32768: 0.5}, 0.0)
    assert state_slots(g.model, config, 32768, GIB, max_batch_size=8) == 0
    assert blocks_per_window(g.model, config, 32768, 80 * GIB) == {
        1024: (3150, 0),
        32768: (16384, 0),
    }


# ----------------------------------------------------------------------------- presets

# name: (attention layers, KV heads, head size, recurrent layers, state bytes per layer)
HYBRIDS = {
    "qwen3.5-9b": (8, 4, 256, 24, 2_146_304),
    "qwen3.5-27b": (16, 4, 256, 48, 3_207_168),
    "qwen3.5-397b-a17b": (15, 2, 256, 45, 4_268_032),
    "qwen3-next-80b-a3b": (12, 2, 256, 36, 2_146_304),
    "nemotron-3-nano-30b-a3b": (6, 2, 128, 23, 2_134_016),
    "granite-4.0-h-small": (4, 8, 128, 36, 4_244_992),
    "falcon-h1-34b": (72, 4, 128, 72, 4_225_024),
    "jamba-1.5-mini": (4, 8, 128, 28, 573_440),
}


@pytest.mark.parametrize("name", sorted(HYBRIDS))
def test_hybrid_presets(name: str) -> None:
    p = load_model(name)
    layers, heads, head_dim, recurrent, per_layer = HYBRIDS[name]
    m = p.model
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (
        layers,
        heads,
        head_dim,
        "bfloat16",
    )
    assert (m.recurrent_layers, m.state_bytes_per_layer()) == (recurrent, per_layer)
    assert m.recurrent_state[0].name == "conv"
    assert p.source.startswith("https://huggingface.co/")
    kinds = p.layer_kinds()
    if kinds is not None:
        assert (kinds.count("attention"), kinds.count("recurrent")) == (layers, recurrent)


def test_qwen35_9b_state_tensors() -> None:
    m = load_model("qwen3.5-9b").model
    assert m.recurrent_state == (
        StateTensor("conv", (8192, 3), "bfloat16"),
        StateTensor("recurrent", (32, 128, 128), "float32"),
    )
    assert m.state_bytes_per_layer() == 2_146_304
    assert load_model("qwen3.5-9b").layer_kinds() == (["recurrent"] * 3 + ["attention"]) * 8


def test_preset_layer_types_must_match_the_counts(tmp_path: Path) -> None:
    d = json.loads((Path(kvcache.models.__file__).parent / "qwen3.5-9b.json").read_text())
    d["layer_types"] = ["recurrent", "attention"]
    f = tmp_path / "bad.json"
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match="gives 16 attention and 16 recurrent layers"):
        load_model(str(f))
    d["layer_types"] = ["mamba"]
    f.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=r"layer_types\[0\] must be one of"):
        load_model(str(f))


# ----------------------------------------------------------------------------- kvcache models


def test_models_lists_recurrent_layers(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    qwen_line = next(line for line in lines if line.startswith("qwen3.5-9b "))
    assert qwen_line.split()[1:7] == ["8", "4", "256", "bfloat16", "262,144", "32,768"]
    assert qwen_line.endswith("full; 24 recurrent layers, 51,511,296 state B/seq")
    llama = next(line for line in lines if line.startswith("llama-3.1-8b "))
    assert llama.split()[1:] == ["32", "8", "128", "bfloat16", "131,072", "131,072", "full"]


def test_models_json_has_the_state(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["models", "--json"]) == 0
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    q = rows["qwen3.5-9b"]
    assert q["state_bytes_per_sequence"] == 51_511_296
    assert q["layer_types"] == ["recurrent", "recurrent", "recurrent", "attention"]
    assert q["model"]["recurrent_state"] == [CONV, REC]
    assert "state_bytes_per_sequence" not in rows["llama-3.1-8b"]


# ----------------------------------------------------------------------------- the core


def _core_has_state() -> bool:
    return hasattr(kvcache._core.KVCacheManager, "state_groups")


@pytest.mark.skipif(not _core_has_state(), reason="the native core has no recurrent state yet")
def test_manager_from_blocks_with_recurrent_layers() -> None:
    model = ModelConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        recurrent_layers=3,
        recurrent_state=[{"name": "conv", "shape": [4, 3], "dtype": "float32"}],
    )
    config = KvCacheConfig(tokens_per_block=4, backend="virtual")
    m = kvcache.KVCacheManager.from_blocks(model, config, {64: 8}, max_seq_len=64, max_batch_size=2)
    assert m.window_sizes == [64]
    assert m.num_state_groups == 1


@pytest.mark.skipif(not _core_has_state(), reason="the native core has no recurrent state yet")
def test_manager_sizes_state_slots_from_the_budget() -> None:
    model = ModelConfig(
        num_layers=1,
        num_kv_heads=1,
        head_dim=8,
        recurrent_layers=2,
        recurrent_state=[{"name": "ssm", "shape": [256], "dtype": "float32"}],
    )
    config = KvCacheConfig(tokens_per_block=4, backend="virtual", window_size_shares="equal")
    # 2 layers x 1 KiB = 2 KiB slots: half of 64 KiB is 16 slots; 128 B blocks: 256.
    assert state_slots(model, config, 64, 64 * 1024, max_batch_size=4) == 16
    m = kvcache.KVCacheManager(
        model, config, max_seq_len=64, max_batch_size=4, primary_bytes=64 * 1024
    )
    assert m.get_num_free_blocks() == 256
