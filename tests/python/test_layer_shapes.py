"""Layers of different shapes: per-layer head size and KV dtype, pools grouped by
(window, KV heads, head size, dtype), and sizing that counts the straddled block.

Hand computations are in the comments; every expected number is written out.
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from kvcache import KvCacheConfig, KVCacheManager, ModelConfig
from kvcache.cli import main
from kvcache.sizing import (
    auto_demand_tokens,
    blocks_per_window,
    bytes_per_token,
    max_blocks_per_sequence,
    window_sizes,
)

# Six layers, windows 8 and full (32) interleaved; layer shapes (heads, head size, dtype):
#   0: 1, 4, bf16   1: 2, 8, fp8   2: 1, 8, bf16   3: 2, 8, fp8   4: 1, 4, bf16   5: 2, 8, f16
MIXED = ModelConfig(
    num_layers=6,
    num_kv_heads=[1, 2, 1, 2, 1, 2],
    head_dim=[4, 8, 8, 8, 4, 8],
    dtype=["bfloat16", "fp8", "bfloat16", "fp8", "bfloat16", "float16"],
)


def mixed(backend: str = "host", **kwargs: object) -> KVCacheManager:
    config = KvCacheConfig(
        tokens_per_block=4, max_attention_window=[8, None], backend=backend, **kwargs
    )  # type: ignore[arg-type]
    return KVCacheManager.from_blocks(
        MIXED, config, {8: 3, 32: 5}, max_seq_len=32, max_batch_size=4
    )


# ----------------------------------------------------------------------------- ModelConfig


def test_model_accepts_one_value_or_one_per_layer() -> None:
    m = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=(256, np.int64(512)), dtype="fp8")
    assert m.head_dim == (256, 512)
    assert m.head_dim_per_layer() == [256, 512]
    assert m.dtype_per_layer() == ["fp8", "fp8"]
    assert m.dtype_bytes == 1
    # 1 head x 2 (K, V) x head size x bytes
    assert m.bytes_per_token_per_layer() == [512, 1024]
    assert m.bytes_per_token_per_layer(["bfloat16", "fp8"]) == [1024, 1024]
    assert MIXED.bytes_per_token_per_layer() == [16, 32, 32, 32, 16, 64]
    assert ModelConfig.from_dict(MIXED.to_dict()) == MIXED
    assert MIXED.to_dict()["dtype"] == ["bfloat16", "fp8", "bfloat16", "fp8", "bfloat16", "float16"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"head_dim": [8]}, r"head_dim must be an int or a sequence of num_layers=2 ints"),
        ({"head_dim": [8, 0]}, r"head_dim\[1\] must be a positive int"),
        ({"head_dim": "8"}, r"head_dim must be a sequence"),
        ({"dtype": ["fp8"]}, r"dtype must be a name or a sequence of num_layers=2 names"),
        ({"dtype": ["fp8", "fp4"]}, r"dtype\[1\] must be one of"),
        ({"dtype": 2}, r"dtype must be a sequence"),
    ],
)
def test_model_rejects_bad_per_layer_values(kwargs: dict[str, object], message: str) -> None:
    fields: dict[str, object] = {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8}
    fields.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ModelConfig(**fields)  # type: ignore[arg-type]


def test_dtype_bytes_of_mixed_dtypes_is_an_error() -> None:
    with pytest.raises(ValueError, match=r"differ in dtype \(bfloat16, float16, fp8\)"):
        _ = MIXED.dtype_bytes
    with pytest.raises(ValueError, match=r"dtypes\[0\] must be one of"):
        MIXED.bytes_per_token_per_layer(["fp4"] * 6)


# ----------------------------------------------------------------------------- kv_cache_dtype


def test_kv_cache_dtype_by_kind_and_by_window() -> None:
    model = ModelConfig(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16")
    pattern = [512, 1024, None]

    def dtypes(choice: object, max_seq_len: int = 4096) -> list[str]:
        c = KvCacheConfig(max_attention_window=pattern, kv_cache_dtype=choice)  # type: ignore[arg-type]
        return c.kv_dtype_per_layer(model, max_seq_len)

    assert dtypes(None) == ["bfloat16"] * 3
    assert dtypes("fp8") == ["fp8"] * 3
    assert dtypes("auto") == ["bfloat16"] * 3
    assert dtypes({"full": "fp8"}) == ["bfloat16", "bfloat16", "fp8"]
    assert dtypes({None: "fp8", "sliding": "float16"}) == ["float16", "float16", "fp8"]
    # a window size wins over the kind
    assert dtypes({1024: "bfloat16", "sliding": "fp8", None: "fp8"}) == ["fp8", "bfloat16", "fp8"]
    assert dtypes({"1024": "int8"}) == ["bfloat16", "int8", "bfloat16"]
    assert dtypes({4096: "fp8"}) == ["bfloat16", "bfloat16", "fp8"]  # full = max_seq_len
    # at max_seq_len 1024 the 1024 window is full attention
    assert dtypes({"full": "fp8"}, 1024) == ["bfloat16", "fp8", "fp8"]
    with pytest.raises(ValueError, match=r"names window\(s\) \[2048\] but the model's windows"):
        dtypes({2048: "fp8"})


def test_kv_cache_dtype_round_trips_and_hashes(tmp_path: Path) -> None:
    c = KvCacheConfig(kv_cache_dtype={1024: "bfloat16", None: "fp8"})
    assert dict(c.kv_cache_dtype) == {1024: "bfloat16", "full": "fp8"}  # type: ignore[arg-type]
    assert c.to_dict()["kv_cache_dtype"] == {"1024": "bfloat16", "full": "fp8"}
    assert KvCacheConfig.from_dict(c.to_dict()) == c
    assert hash(KvCacheConfig.from_dict(c.to_dict())) == hash(c)
    with pytest.raises(TypeError):
        c.kv_cache_dtype[1024] = "fp8"  # type: ignore[index]
    f = tmp_path / "kv.toml"
    f.write_text('[kv_cache_dtype]\nfull = "fp8"\n1024 = "bfloat16"\n')
    assert KvCacheConfig.from_file(f).kv_cache_dtype == c.kv_cache_dtype
    j = tmp_path / "kv.json"
    j.write_text(json.dumps({"kv_cache_dtype": "fp8"}))
    assert KvCacheConfig.from_file(j).kv_cache_dtype == "fp8"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("fp4", r"kv_cache_dtype must be one of"),
        (3, r"kv_cache_dtype must be a dtype name or a mapping"),
        ({}, r"must not be an empty mapping"),
        ({"global": "fp8"}, r"keys must be 'full' \(or None\), 'sliding' or a window size"),
        ({0: "fp8"}, r"window sizes must be positive"),
        ({None: "fp8", "full": "bfloat16"}, r"names 'full' twice"),
        ({"full": "fp4"}, r"kv_cache_dtype\['full'\] must be one of"),
        ({True: "fp8"}, r"keys must be"),
    ],
)
def test_kv_cache_dtype_rejects_bad_values(value: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        KvCacheConfig(kv_cache_dtype=value)  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- sizing


def test_bytes_per_token_follows_head_size_and_dtype() -> None:
    c = KvCacheConfig(max_attention_window=[8, None])
    # window 8: layers 0, 2, 4 = 16 + 32 + 16; full: layers 1, 3, 5 = 32 + 32 + 64
    assert bytes_per_token(MIXED, c, 32) == {8: 64, 32: 128}
    fp8 = KvCacheConfig(max_attention_window=[8, None], kv_cache_dtype={"sliding": "fp8"})
    assert bytes_per_token(MIXED, fp8, 32) == {8: 32, 32: 128}


def test_auto_shares_with_fp8_full_layers_hand_computed() -> None:
    # Gemma-4-31B shape, 32k, tpb 32, 80 GiB, full layers in FP8, "auto" without a batch
    # size: one sequence keeps ceil(1023 / 32) + 1 = 33 blocks of the 1024 window (819,200
    # B per token) and 1,024 blocks of full attention (10 x 4 x 2 x 512 x 1 = 40,960 B).
    kinds = [i % 6 == 5 for i in range(60)]
    g4 = ModelConfig(
        num_layers=60,
        num_kv_heads=[4 if f else 16 for f in kinds],
        head_dim=[512 if f else 256 for f in kinds],
        dtype="bfloat16",
    )
    c = KvCacheConfig(
        max_attention_window=[1024] * 5 + [None],
        window_size_shares="auto",
        kv_cache_dtype={"full": "fp8"},
    )
    assert bytes_per_token(g4, c, 32768) == {1024: 819200, 32768: 40960}
    budget = 80 * 2**30
    # n sequences need peak + (n - 1) x live blocks of a window: the sliding window holds 289
    # blocks (ceil((1024 + 8191) / 32) + 1) while one 32k prompt prefills in 8,192-token
    # chunks and 33 while a sequence decodes; full attention 1,024 either way.
    sliding = 33 * 32 * 819200  # 865,075,200 B per decoding sequence
    full = 1024 * 32 * 40960  # 1,342,177,280 B per sequence
    peak = 289 * 32 * 819200 + full
    extra = Fraction(budget - peak, sliding + full)  # sequences beyond the first
    expected = {1024: (int(289 + extra * 33), 0), 32768: (int(1024 + extra * 1024), 0)}
    assert expected == {1024: (1439, 0), 32768: (36737, 0)}
    assert blocks_per_window(g4, c, 32768, budget) == expected
    # all bfloat16: the full window costs 81,920 B per token, twice as much
    bf16 = KvCacheConfig(max_attention_window=[1024] * 5 + [None], window_size_shares="auto")
    full16 = 1024 * 32 * 81920
    extra16 = Fraction(budget - 289 * 32 * 819200 - full16, sliding + full16)
    assert blocks_per_window(g4, bf16, 32768, budget) == {
        1024: (int(289 + extra16 * 33), 0),
        32768: (int(1024 + extra16 * 1024), 0),
    }


def test_drafts_widen_the_sliding_demand() -> None:
    # n = 4, t = 16, B = 64, L = 1024, window 64: floor((4 x (64 + D + 30) + 64) / 16)
    # D = 0: 27 blocks; D = 5: 28 blocks (4 x 99 + 64 = 460 -> 28)
    args = {"tokens_per_block": 16, "max_batch_size": 4, "max_num_batched_tokens": 64}
    assert auto_demand_tokens([64], 1024, **args) == {64: 27 * 16}
    assert auto_demand_tokens([64], 1024, max_draft_tokens=5, **args) == {64: 28 * 16}
    with pytest.raises(ValueError, match="max_draft_tokens"):
        auto_demand_tokens([64], 1024, max_draft_tokens=-1, **args)


def test_manager_sizes_with_its_max_draft_tokens() -> None:
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    c = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[6, None],
        window_size_shares="auto",
        backend="virtual",
    )
    budget = 64 * 1000
    for draft in (0, 3):
        m = KVCacheManager(
            model, c, max_seq_len=64, max_batch_size=4, primary_bytes=budget, max_draft_tokens=draft
        )
        expected = blocks_per_window(model, c, 64, budget, max_batch_size=4, max_draft_tokens=draft)
        assert m.blocks_per_window == expected
    # With B = 4: demand floor((4 x (6 + D + 6) + 4) / 4) blocks of window 6: 13 for D = 0,
    # 16 for D = 3; full attention 4 x 16 = 64 blocks
    small = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[6, None],
        window_size_shares="auto",
        max_num_batched_tokens=4,
    )
    demand = {"tokens_per_block": 4, "max_batch_size": 4, "max_num_batched_tokens": 4}
    assert auto_demand_tokens([6, 64], 64, **demand) == {6: 13 * 4, 64: 64 * 4}
    assert auto_demand_tokens([6, 64], 64, max_draft_tokens=3, **demand) == {6: 16 * 4, 64: 256}
    # a budget below the demand splits it 13 : 64 and 16 : 64 (2 layers x 16 B per token x 4)
    small_budget = 50 * 64
    assert blocks_per_window(model, small, 64, small_budget, max_batch_size=4) == {
        6: (50 * 13 // 77, 0),
        64: (50 * 64 // 77, 0),
    }
    assert blocks_per_window(
        model, small, 64, small_budget, max_batch_size=4, max_draft_tokens=3
    ) == {6: (50 * 16 // 80, 0), 64: (50 * 64 // 80, 0)}


@pytest.mark.parametrize(
    ("window", "draft", "tpb"),
    [(8, 0, 4), (9, 0, 4), (10, 0, 4), (11, 0, 4), (7, 2, 4), (6, 3, 4), (5, 0, 1), (16, 1, 8)],
)
def test_straddle_bound_is_what_the_manager_holds(window: int, draft: int, tpb: int) -> None:
    """A decoding sequence's live blocks in a sliding window reach exactly
    max_blocks_per_sequence, never more, and never more than ceil((W + D) / t) + 1."""
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    c = KvCacheConfig(tokens_per_block=tpb, max_attention_window=[window, None], backend="virtual")
    m = KVCacheManager.from_blocks(
        model, c, {window: 64, 64: 64}, max_seq_len=64, max_batch_size=1, max_draft_tokens=draft
    )
    m.add_sequence(1, [0])
    held = []
    for n in range(2, 61):
        m.add_token(1, n)
        held.append(sum(b >= 0 for b in m.get_cache_block_ids(1, window)))
    bound = max_blocks_per_sequence(60, window, tpb, draft)
    assert max(held) == bound
    assert bound <= -(-(window + draft) // tpb) + 1
    m.check_invariants()


def test_demand_bounds_chunked_prefill_and_decodes_together() -> None:
    """Seeded engine-like steps: n sequences share a token budget B per step (decodes take one
    token, prefills chunks of at most C); the sliding window's live blocks never exceed
    auto_demand_tokens // tpb."""
    rng = np.random.default_rng(11)
    window, draft, tpb, n, budget, chunk = 10, 2, 4, 3, 12, 8
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=4)
    c = KvCacheConfig(tokens_per_block=tpb, max_attention_window=[window, None], backend="virtual")
    m = KVCacheManager.from_blocks(
        model, c, {window: 200, 128: 400}, max_seq_len=128, max_batch_size=n, max_draft_tokens=draft
    )
    demand = auto_demand_tokens(
        [window],
        128,
        tokens_per_block=tpb,
        max_batch_size=n,
        max_num_batched_tokens=budget,
        max_draft_tokens=draft,
    )[window]
    # floor((3 x (10 + 2 + 6) + 12) / 4) = 16 blocks
    assert demand == 16 * tpb
    prompts = {rid: int(rng.integers(20, 60)) for rid in range(n)}
    done = {rid: 0 for rid in range(n)}  # prompt tokens with blocks
    peak = 0
    for _step in range(120):
        left = budget
        for rid in range(n):
            if done[rid] == prompts[rid]:
                if m.num_tokens(rid) < 120 and left > 0:
                    m.add_token(rid, 1)
                    left -= 1
        for rid in range(n):
            size = min(chunk, prompts[rid] - done[rid], left)
            if size <= 0:
                continue
            if done[rid] == 0:
                m.add_sequence(rid, list(range(prompts[rid])), prefill=size)
            else:
                m.prefill(rid, size)
            done[rid] += size
            left -= size
        live = sum(
            sum(b >= 0 for b in m.get_cache_block_ids(rid, window)) for rid in done if done[rid]
        )
        peak = max(peak, live)
        m.check_invariants()
    assert 0 < peak <= demand // tpb


# ----------------------------------------------------------------------------- pools and views


def test_pools_group_by_window_heads_head_size_and_dtype() -> None:
    m = mixed()
    pools = [{k: v for k, v in p.items() if not k.endswith("_ptr")} for p in m.pools]
    common = {"kv_factor": 2, "num_primary_blocks": 3, "num_secondary_blocks": 0}
    full = {"kv_factor": 2, "num_primary_blocks": 5, "num_secondary_blocks": 0}
    for d in (common, full):
        d["block_stride"] = 128 if d is common else 256
    assert pools == [
        # [blocks, layers, K/V, heads, 4 tokens, head size] x bytes
        {"window_size": 8, "num_kv_heads": 1, "layers": [0, 4], "head_dim": 4,
         "dtype": "bfloat16", "block_bytes": 2 * 2 * 1 * 4 * 4 * 2, **common},
        {"window_size": 8, "num_kv_heads": 1, "layers": [2], "head_dim": 8,
         "dtype": "bfloat16", "block_bytes": 1 * 2 * 1 * 4 * 8 * 2, **common},
        {"window_size": 32, "num_kv_heads": 2, "layers": [5], "head_dim": 8,
         "dtype": "float16", "block_bytes": 1 * 2 * 2 * 4 * 8 * 2, **full},
        {"window_size": 32, "num_kv_heads": 2, "layers": [1, 3], "head_dim": 8,
         "dtype": "fp8", "block_bytes": 2 * 2 * 2 * 4 * 8 * 1, **full},
    ]  # fmt: skip
    assert m.layer_to_pool == [(0, 0), (3, 0), (1, 0), (3, 1), (0, 1), (2, 0)]
    assert m.num_pools == 4
    assert m.get_kv_cache_stats().allocated_bytes == 3 * (128 + 128) + 5 * (256 + 256)
    m.check_invariants()


def test_kv_cache_dtype_mapping_reaches_the_pools() -> None:
    model = ModelConfig(num_layers=4, num_kv_heads=1, head_dim=[4, 8, 4, 8], dtype="bfloat16")
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="virtual",
        kv_cache_dtype={"full": "fp8"},
    )
    m = KVCacheManager.from_blocks(model, config, {8: 2, 32: 2}, max_seq_len=32, max_batch_size=1)
    assert [
        (p["window_size"], p["layers"], p["head_dim"], p["dtype"], p["block_bytes"])
        for p in m.pools
    ] == [
        (8, [0, 2], 4, "bfloat16", 2 * 2 * 4 * 4 * 2),
        (32, [1, 3], 8, "fp8", 2 * 2 * 4 * 8 * 1),
    ]


def test_layer_views_strides_dtypes_and_addresses() -> None:
    m = mixed()
    ptr = [p["primary_ptr"] for p in m.pools]
    expect = {
        # layer: (numpy dtype, shape, strides, address)
        0: (np.uint16, (3, 2, 1, 4, 4), (128, 32, 32, 8, 2), ptr[0]),
        1: (np.uint8, (5, 2, 2, 4, 8), (256, 64, 32, 8, 1), ptr[3]),
        2: (np.uint16, (3, 2, 1, 4, 8), (128, 64, 64, 16, 2), ptr[1]),
        3: (np.uint8, (5, 2, 2, 4, 8), (256, 64, 32, 8, 1), ptr[3] + 128),
        4: (np.uint16, (3, 2, 1, 4, 4), (128, 32, 32, 8, 2), ptr[0] + 64),
        5: (np.float16, (5, 2, 2, 4, 8), (256, 128, 64, 16, 2), ptr[2]),
    }
    for layer, (dtype, shape, strides, address) in expect.items():
        buf = m.get_buffers(layer)
        assert (buf.dtype, buf.shape, buf.strides, buf.ctypes.data) == (
            np.dtype(dtype),
            shape,
            strides,
            address,
        ), layer
        lb = m._layer_buffer(layer)
        assert (lb.shape, lb.strides, lb.data_ptr) == (shape, strides, address)
        if dtype is not np.uint16:  # numpy has no bfloat16 to import a DLPack tensor as
            assert np.from_dlpack(lb).ctypes.data == address
    assert m._layer_buffer(1).dtype == "fp8"
    assert m._layer_buffer(0).dtype == "bfloat16"


def test_layer_views_partition_the_pools() -> None:
    """Filling every layer's view with its own value leaves each intact: the views do not
    overlap, and together they cover every allocated byte."""
    m = mixed()
    for layer in range(6):
        m.get_buffers(layer)[...] = layer + 1
    for layer in range(6):
        assert (m.get_buffers(layer) == layer + 1).all(), layer
    assert sum(m.get_buffers(layer).nbytes for layer in range(6)) == 3328


def test_partial_reuse_copies_every_pool() -> None:
    """A partially matching block is copied token by token in every pool, whatever its
    head size and dtype."""
    m = mixed(enable_block_reuse=True)
    m.add_sequence(1, list(range(7)))  # blocks 0, 1 in each window
    rng = np.random.default_rng(3)
    for layer in range(6):
        buf = m.get_buffers(layer)
        buf[...] = rng.integers(0, 200, size=buf.shape).astype(buf.dtype)
    before = {layer: m.get_buffers(layer).copy() for layer in range(6)}
    pinned = m.remove_sequence(1, pin=True)  # block 1 stays referenced: reuse must copy
    assert m.add_sequence(2, [*range(6), 99, 98]) == 6  # block 0 and 2 tokens of block 1
    for window in (8, 32):
        assert m.get_cache_block_ids(2, window) == [0, 2]
    for layer in range(6):
        after = m.get_buffers(layer)
        np.testing.assert_array_equal(after[2, :, :, :2], before[layer][1, :, :, :2])
        np.testing.assert_array_equal(after[:2], before[layer][:2])
    m.unpin_blocks_by_id(pinned)
    m.check_invariants()


def test_copy_block_offsets_per_pool() -> None:
    m = mixed()
    m.add_sequence(1, list(range(6)))  # 2 blocks: 0 1
    out = np.full((4, 1, 2, 3), 99, dtype=np.int32)
    assert m.copy_block_offsets(out, [1]) == 2
    # block x layers_in_pool x 2 + k: pools hold 2, 1, 1 and 2 layers
    assert out[:, 0, :, :2].tolist() == [
        [[0, 4], [1, 5]],
        [[0, 2], [1, 3]],
        [[0, 2], [1, 3]],
        [[0, 4], [1, 5]],
    ]
    assert (out[:, :, :, 2] == 99).all()


def test_randomized_mixed_shapes_keep_invariants() -> None:
    rng = np.random.default_rng(2026)
    config = KvCacheConfig(
        tokens_per_block=4,
        max_attention_window=[8, None],
        backend="host",
        enable_block_reuse=True,
        kv_cache_dtype={8: "fp8"},
    )
    m = KVCacheManager.from_blocks(
        MIXED, config, {8: 24, 32: 40}, max_seq_len=32, max_batch_size=6, max_draft_tokens=2
    )
    assert [p["dtype"] for p in m.pools] == ["fp8", "fp8", "float16", "fp8"]
    live: set[int] = set()
    decoding: set[int] = set()  # past their first generated token: the bound applies
    ok = failed = 0
    for step in range(600):
        op = int(rng.integers(0, 5))
        try:
            if op == 0 or not live:
                rid = step
                m.add_sequence(rid, rng.integers(0, 6, size=int(rng.integers(1, 20))).tolist())
                live.add(rid)
            elif op in (1, 2):
                ids = sorted(live)
                m.add_tokens(ids, rng.integers(0, 6, size=len(ids)).tolist())
                decoding |= live
            elif op == 3:
                rid = sorted(live)[int(rng.integers(0, len(live)))]
                m.rewind(rid, min(2, m.num_tokens(rid) - 1))
            else:
                rid = sorted(live)[int(rng.integers(0, len(live)))]
                m.remove_sequence(rid)
                live.discard(rid)
                decoding.discard(rid)
            ok += 1
        except (ValueError, RuntimeError):
            failed += 1
        m.check_invariants()
        for rid in decoding:
            n = m.num_tokens(rid)
            held = sum(b >= 0 for b in m.get_cache_block_ids(rid, 8))
            assert held <= max_blocks_per_sequence(n, 8, 4, 2)
    assert ok > 300 and failed > 0


# ----------------------------------------------------------------------------- plan


def test_plan_shows_dtype_head_size_and_savings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "gemma-4-31b", "--memory", "80GiB", "--max-seq-len", "32768",
                 "--kv-cache-dtype", "full=fp8", "--json"]) == 0  # fmt: skip
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv_cache_dtype"] == "full=fp8"
    auto = next(p for p in plan["policies"] if p["policy"] == "auto")
    sliding, full = auto["windows"]
    assert (sliding["window"], sliding["dtype"], sliding["head_dim"]) == (1024, "bfloat16", "256")
    assert (full["window"], full["dtype"], full["head_dim"]) == (32768, "fp8", "512")
    assert (sliding["bytes_per_token"], full["bytes_per_token"]) == (819200, 40960)
    assert sliding["saved_per_sequence"] == 0
    # 1,024 blocks x 32 tokens x (81,920 - 40,960) B
    assert full["saved_per_sequence"] == 1024 * 32 * 40960
    # blocks as in test_auto_shares_with_fp8_full_layers_hand_computed; one sequence at its
    # prefill peak (289 blocks), the others decoding (33): 1 + (1439 - 289) // 33 = 35
    assert (sliding["blocks"], full["blocks"]) == (1439, 36737)
    assert (sliding["peak_blocks"], sliding["limited_by"]) == (289, "chunk")
    assert (auto["max_sequences"], auto["model_dtype_max_sequences"]) == (35, 22)


def test_plan_text_for_gemma4(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["plan", "--model", "gemma-4-e2b", "--memory", "1GiB", "--max-seq-len", "8192"]) == 0
    )
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "gemma-4-e2b: 15 layers, 1 KV heads x 256 or 1 KV heads x 512, bfloat16; windows: "
        "4 x 512, full (repeating); max context 131,072"
    )
    assert "saves/seq" not in out
    # window 512: 12 layers x 1,024 B; full: 3 layers x 2,048 B
    assert "      512     12       bfloat16     256     12,288" in out
    assert "    8,192      3       bfloat16     512      6,144" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [("full=fp4", "must be one of"), ("full", "must be one of"), ("=fp8", "KEY=DTYPE")],
)
def test_plan_rejects_bad_kv_cache_dtype(
    text: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["plan", "--model", "gemma-4-31b", "--memory", "80GiB", "--kv-cache-dtype", text]) == 2
    )
    assert message in capsys.readouterr().err


def test_window_sizes_unchanged_by_dtypes() -> None:
    c = KvCacheConfig(max_attention_window=[8, None], kv_cache_dtype="fp8")
    assert window_sizes(MIXED, c, 32) == [8, 32]


def test_simulate_gemma4_with_invariants() -> None:
    """The resource manager and scheduler drive a model whose layers differ in head size."""
    from kvcache.simulate import default_workload, simulate

    trace = default_workload(seed=5, num_conversations=6)
    r = simulate(
        trace,
        model="gemma-4-e2b",
        memory_bytes=64 * 2**20,
        shares="auto",
        draft_tokens=2,
        max_seq_len=8192,
        check_invariants=True,
    )
    assert r.completed == len(trace)
    assert [w.window for w in r.windows] == [512, 8192]
    # E2B: 12 sliding layers of 1 x 256 (1,024 B per token), 3 full of 1 x 512 (2,048 B)
    assert [w.layers for w in r.windows] == [12, 3]
