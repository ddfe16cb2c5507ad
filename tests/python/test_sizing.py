"""Tests for kvcache.sizing: windows, bytes per token, shares, blocks and size strings."""

from __future__ import annotations

import logging
import math

import pytest

from kvcache.config import KvCacheConfig, ModelConfig
from kvcache.sizing import (
    SHARES_ENV_VAR,
    TRTLLM_SHARES_ENV_VAR,
    auto_demand_tokens,
    blocks_per_window,
    bytes_per_token,
    format_size,
    max_blocks_per_sequence,
    parse_size,
    peak_blocks_per_sequence,
    resolve_share_policy,
    window_size_shares,
    window_sizes,
)

GEMMA3_27B = ModelConfig(num_layers=62, num_kv_heads=16, head_dim=128, dtype="bfloat16")
GEMMA3_PATTERN = [1024] * 5 + [None]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(SHARES_ENV_VAR, raising=False)
    monkeypatch.delenv(TRTLLM_SHARES_ENV_VAR, raising=False)


def three_window_model() -> tuple[ModelConfig, int]:
    """One layer per window, 1 head of 64, float16: 256 B per token in each window."""
    return ModelConfig(num_layers=3, num_kv_heads=1, head_dim=64), 256


# ----------------------------------------------------------------------------- windows


def test_window_sizes_pattern_repeats_and_clamps() -> None:
    m = ModelConfig(num_layers=7, num_kv_heads=8, head_dim=128)
    c = KvCacheConfig(max_attention_window=[512, 4096, None])
    assert window_sizes(m, c, 2048) == [512, 2048]
    assert window_sizes(m, c, 8192) == [512, 4096, 8192]
    assert window_sizes(m, KvCacheConfig(), 100) == [100]


def test_window_equal_to_max_seq_len_is_full_attention() -> None:
    m = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=256)
    c = KvCacheConfig(max_attention_window=[512, None])
    assert window_sizes(m, c, 512) == [512]
    assert window_sizes(m, c, 511) == [511]
    assert bytes_per_token(m, c, 512) == {512: 2 * 2 * 256 * 2}


def test_bytes_per_token_gemma3_27b() -> None:
    c = KvCacheConfig(max_attention_window=GEMMA3_PATTERN)
    # 62 layers: 10 full-attention (every 6th), 52 sliding; 16 * 2 * 128 * 2 = 8192 B a layer.
    assert bytes_per_token(GEMMA3_27B, c, 32768) == {1024: 52 * 8192, 32768: 10 * 8192}


def test_bytes_per_token_per_layer_heads() -> None:
    m = ModelConfig(num_layers=4, num_kv_heads=[8, 2, 8, 2], head_dim=64, dtype="fp8", kv_factor=1)
    c = KvCacheConfig(max_attention_window=[128, None])
    assert bytes_per_token(m, c, 1024) == {128: 16 * 64, 1024: 4 * 64}


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "8"])
def test_window_sizes_rejects_bad_max_seq_len(bad: object) -> None:
    m, _ = three_window_model()
    with pytest.raises(ValueError, match="max_seq_len"):
        window_sizes(m, KvCacheConfig(), bad)  # type: ignore[arg-type]


def test_pattern_longer_than_layers_rejected() -> None:
    m = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="max_attention_window has 3 entries"):
        window_sizes(m, KvCacheConfig(max_attention_window=[1, 2, 3]), 16)


# ----------------------------------------------------------------------------- shares


def test_proportional_shares_pinned() -> None:
    shares = window_size_shares({1024: 7, 4096: 7, 8192: 7}, "proportional")
    assert list(shares) == [1024, 4096, 8192]
    assert shares[1024] == pytest.approx(1 / 13, abs=1e-15)
    assert shares[4096] == pytest.approx(4 / 13, abs=1e-15)
    assert shares[8192] == pytest.approx(8 / 13, abs=1e-15)
    assert math.fsum(shares.values()) == pytest.approx(1.0, abs=1e-15)


def test_proportional_weights_bytes_per_token() -> None:
    # 1024 * 2048 : 4096 * 6144 = 1 : 12
    shares = window_size_shares({1024: 2048, 4096: 6144}, "proportional")
    assert shares == {1024: 1 / 13, 4096: 12 / 13}


def test_equal_shares_thirds() -> None:
    assert window_size_shares({1: 5, 2: 70, 3: 900}, "equal") == {1: 1 / 3, 2: 1 / 3, 3: 1 / 3}


def test_default_is_equal() -> None:
    assert window_size_shares({10: 1, 20: 3}) == {10: 0.5, 20: 0.5}


def test_single_window_is_one() -> None:
    for policy in ("equal", "proportional", "auto", [3.0]):
        assert window_size_shares({4096: 99}, policy, max_seq_len=4096) == {4096: 1.0}


def test_auto_shares_gemma3_27b_at_32k() -> None:
    c = KvCacheConfig(max_attention_window=GEMMA3_PATTERN)
    bpt = bytes_per_token(GEMMA3_27B, c, 32768)
    shares = window_size_shares(bpt, "auto", max_seq_len=32768, tokens_per_block=32)
    # full: 32768 * 10 ; sliding: (1024 + 32) * 52  (times 8192 B each)
    assert shares[32768] == pytest.approx(327680 / (327680 + 54912), rel=1e-12)
    assert round(shares[32768] * 100, 1) == 85.6


def test_auto_expected_seq_len_and_tokens_per_block() -> None:
    bpt = {1024: 100, 32768: 100}
    shares = window_size_shares(
        bpt, "auto", max_seq_len=32768, expected_seq_len=2048, tokens_per_block=64
    )
    assert shares == {1024: 1088 / (1088 + 2048), 32768: 2048 / (1088 + 2048)}
    # a sequence shorter than the window: both windows hold the whole sequence
    short = window_size_shares(bpt, "auto", expected_seq_len=512)
    assert short == {1024: 0.5, 32768: 0.5}


def test_auto_without_length_rejected() -> None:
    with pytest.raises(ValueError, match=r'"auto" share policy.*needs max_seq_len'):
        window_size_shares({1: 1, 2: 1}, "auto")


# "auto" from demand (max_batch_size given). Hand computations, n = max_batch_size,
# B = max_num_batched_tokens, L = expected_seq_len, t = tokens_per_block, D = drafts: a
# window holds min(floor((n * (w + D + 2t - 2) + B) / t), n * ceil(L / t)) blocks (the
# straddled block counted); a budget above the demand goes to the windows that hold less
# than whole sequences, the same tokens to each.


def test_auto_demand_tokens() -> None:
    # (128 x (512 + 62) + 8192) / 32 = 2,552 blocks = 81,664 tokens; full: 128 x
    # ceil(2818 / 32) = 128 x 89 = 11,392 blocks = 364,544 tokens
    assert auto_demand_tokens([512, 4496], 2818, tokens_per_block=32, max_batch_size=128) == {
        512: 81664,
        4496: 364544,
    }
    # 64: floor((4 x 94 + 100) / 16) = 29 blocks = 464 tokens; 1000: floor((4 x 1030 + 100)
    # / 16) = 263 > 4 x 64 blocks: the window holds whole sequences, like full attention
    assert auto_demand_tokens(
        [64, 1000, 4096], 1024, tokens_per_block=16, max_batch_size=4, max_num_batched_tokens=100
    ) == {64: 464, 1000: 4096, 4096: 4096}
    # drafts widen what a sliding window keeps: 2 sequences, window 64 + 3 drafts, t = 16,
    # B = 16: floor((2 x (67 + 30) + 16) / 16) = 13 blocks
    assert auto_demand_tokens(
        [64],
        4096,
        tokens_per_block=16,
        max_batch_size=2,
        max_num_batched_tokens=16,
        max_draft_tokens=3,
    ) == {64: 13 * 16}


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"max_batch_size": True}, "max_batch_size"),
        ({"max_batch_size": 2, "max_num_batched_tokens": 0}, "max_num_batched_tokens"),
        ({"max_batch_size": 2, "primary_bytes": 0}, "primary_bytes"),
        ({"max_batch_size": 2, "expected_seq_len": -1}, "expected_seq_len"),
    ],
)
def test_auto_demand_argument_errors(kwargs: dict[str, int], name: str) -> None:
    with pytest.raises(ValueError, match=name):
        window_size_shares({512: 1, 4096: 1}, "auto", max_seq_len=4096, **kwargs)


def test_auto_from_demand_spare_goes_to_the_sliding_window() -> None:
    # The bench_reuse replay: 4096 B per token in each window, 20,000 blocks of 32 tokens.
    # full: 11,392 blocks; the 512 window: 2,552 blocks of demand plus all of the
    # 20,000 - 2,552 - 11,392 = 6,056 spare blocks = 8,608 blocks.
    bpt = {512: 4096, 4496: 4096}
    budget = 20000 * 32 * 4096
    shares = window_size_shares(
        bpt, "auto", expected_seq_len=2818, max_batch_size=128, primary_bytes=budget
    )
    assert shares == {512: 8608 / 20000, 4496: 11392 / 20000}
    # without a budget, or with one below the demand: in proportion to the demand
    no_budget = window_size_shares(bpt, "auto", expected_seq_len=2818, max_batch_size=128)
    assert no_budget == {512: 81664 / 446208, 4496: 364544 / 446208}
    short = window_size_shares(
        bpt, "auto", expected_seq_len=2818, max_batch_size=128, primary_bytes=446208 * 4096 - 1
    )
    assert short == no_budget


def test_auto_from_demand_three_windows() -> None:
    # n = 10, L = 4096, tpb 16, B = 1000. Demand in blocks: 128 -> floor((10 x 158 + 1000)
    # / 16) = 161 (2,576 tokens); 1024 -> floor((10 x 1054 + 1000) / 16) = 721 (11,536
    # tokens); 8192 -> 10 x 256 = 2,560 (40,960 tokens). In bytes (x 100, 300, 200):
    # 257,600 + 3,460,800 + 8,192,000 = 11,910,400. Budget 20,000,000: spare 8,089,600 B
    # over the two sliding windows' 400 B per token = 20,224 tokens each: 128 -> 257,600 +
    # 2,022,400; 1024 -> 3,460,800 + 6,067,200; 8192 -> 8,192,000.
    bpt = {128: 100, 1024: 300, 8192: 200}
    kwargs = {"max_seq_len": 8192, "expected_seq_len": 4096, "tokens_per_block": 16}
    shares = window_size_shares(
        bpt,
        "auto",
        max_batch_size=10,
        max_num_batched_tokens=1000,
        primary_bytes=20_000_000,
        **kwargs,
    )
    assert shares == {128: 0.114, 1024: 0.4764, 8192: 0.4096}
    # half the demand: every window scaled alike (same concurrency), 2,576 : 34,608 : 81,920
    half = window_size_shares(
        bpt,
        "auto",
        max_batch_size=10,
        max_num_batched_tokens=1000,
        primary_bytes=5_955_200,
        **kwargs,
    )
    assert half == {128: 2576 / 119104, 1024: 34608 / 119104, 8192: 81920 / 119104}


def test_auto_from_demand_only_sliding_windows() -> None:
    # Windows 512 and 1024 (both below L = 4096), 2 sequences, B = 64, tpb 32, 1 B per token:
    # demand floor((2 x 574 + 64) / 32) = 37 blocks (1,184 tokens) and floor((2 x 1086 + 64)
    # / 32) = 69 blocks (2,208 tokens); a budget of 10,000 leaves 6,608 tokens, 3,304 to
    # each: 4,488 and 5,512.
    shares = window_size_shares(
        {512: 1, 1024: 1},
        "auto",
        expected_seq_len=4096,
        max_batch_size=2,
        max_num_batched_tokens=64,
        primary_bytes=10_000,
    )
    assert shares == {512: 0.4488, 1024: 0.5512}


def test_auto_from_demand_no_sliding_window_keeps_the_demand_ratio() -> None:
    # floor((4 x 1030 + 100) / 16) > 4 x 64 blocks: both windows hold whole sequences, so nothing is
    # sliding and a generous budget keeps the 1 : 1 demand ratio (in bytes 1 : 3).
    shares = window_size_shares(
        {1000: 1, 4096: 3},
        "auto",
        expected_seq_len=1024,
        tokens_per_block=16,
        max_batch_size=4,
        max_num_batched_tokens=100,
        primary_bytes=10**9,
    )
    assert shares == {1000: 0.25, 4096: 0.75}


def test_blocks_per_window_auto_from_demand_replay() -> None:
    """The split ``bench/bench_reuse.py`` replays: 2 layers of 8 heads x 128, bfloat16."""
    model = ModelConfig(num_layers=2, num_kv_heads=8, head_dim=128, dtype="bfloat16")
    c = KvCacheConfig(max_attention_window=[512, None], window_size_shares="auto")
    budget = 20000 * 32 * 4096
    out = blocks_per_window(
        model, c, 4496, budget, budget // 2, expected_seq_len=2818, max_batch_size=128
    )
    assert out == {512: (8608, 4304), 4496: (11392, 5696)}
    # Without max_batch_size: n sequences need peak + (n - 1) x live blocks of each window.
    # A 2,818-token prompt fits one 8,192-token chunk, so the sliding window holds all its
    # ceil(2818 / 32) = 89 blocks at registration (peak), 17 (ceil(511 / 32) + 1) while
    # decoding; full attention 89 and 89. n - 1 = (20000 - 178) // 106 = 187 in both windows.
    # (Before the peak was counted: 20000 x 17 // 106 = 3,207 blocks, 184 sequences.)
    out = blocks_per_window(model, c, 4496, budget, expected_seq_len=2818)
    assert out == {512: (3268, 0), 4496: (16732, 0)}
    assert 1 + (out[512][0] - 89) // 17 == 1 + (out[4496][0] - 89) // 89 == 188


def test_blocks_per_window_auto_from_demand_gemma3_27b() -> None:
    # 80 GiB, 64 sequences of 8,192 tokens, 32k context. Full attention: 64 x 8192 tokens x
    # 81,920 B = 40 GiB = 16,384 blocks. Sliding: demand 64 x 1056 + 8192 = 75,776 tokens
    # x 425,984 B = 32,279,363,584 B, plus the spare 80 GiB - 40 GiB - that; so 40 GiB in
    # all: floor(42,949,672,960 / (425,984 x 32)) = 3,150 blocks. (The sliding demand is
    # floor((64 x (1024 + 62) + 8192) / 32) = 2,428 blocks, below that.)
    c = KvCacheConfig(
        max_attention_window=GEMMA3_PATTERN, window_size_shares="auto", expected_seq_len=8192
    )
    out = blocks_per_window(GEMMA3_27B, c, 32768, 80 * 2**30, max_batch_size=64)
    assert out == {1024: (3150, 0), 32768: (16384, 0)}


def test_blocks_per_window_auto_reads_max_num_batched_tokens() -> None:
    # Budget below the demand, so B moves the split: 1 B per token per layer, tpb 1,
    # windows 8 and 64, n = 2, L = 64: demand 2 x 8 + B (1-token blocks straddle nothing)
    # and 128 tokens; budget 100 bytes.
    model = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=1, dtype="int8", kv_factor=1)

    def split(batched: int) -> dict[int, tuple[int, int]]:
        c = KvCacheConfig(
            tokens_per_block=1,
            max_attention_window=[8, None],
            window_size_shares="auto",
            max_num_batched_tokens=batched,
        )
        return blocks_per_window(model, c, 64, 100, max_batch_size=2)

    assert split(2) == {8: (100 * 18 // 146, 0), 64: (100 * 128 // 146, 0)}
    assert split(110) == {8: (100 * 126 // 254, 0), 64: (100 * 128 // 254, 0)}
    assert split(120) == {8: (100 * 128 // 256, 0), 64: (100 * 128 // 256, 0)}


def test_explicit_list_normalised() -> None:
    assert window_size_shares({1: 1, 2: 1, 3: 1}, [1, 1, 2]) == {1: 0.25, 2: 0.25, 3: 0.5}
    assert window_size_shares({1: 1, 2: 1}, "3, 1") == {1: 0.75, 2: 0.25}
    assert window_size_shares({1: 1, 2: 1}, [0, 5]) == {1: 0.0, 2: 1.0}


def test_env_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    bpt = {1: 1, 2: 1}
    monkeypatch.setenv(TRTLLM_SHARES_ENV_VAR, "1,3")
    assert window_size_shares(bpt) == {1: 0.25, 2: 0.75}
    monkeypatch.setenv(SHARES_ENV_VAR, "3,1")
    assert window_size_shares(bpt) == {1: 0.75, 2: 0.25}
    # an explicit policy beats both variables
    assert window_size_shares(bpt, "equal") == {1: 0.5, 2: 0.5}
    # an empty variable counts as unset
    monkeypatch.setenv(SHARES_ENV_VAR, "  ")
    assert window_size_shares(bpt) == {1: 0.25, 2: 0.75}
    monkeypatch.setenv(SHARES_ENV_VAR, "proportional")
    assert window_size_shares(bpt) == {1: 1 / 3, 2: 2 / 3}


def test_resolve_share_policy_sources() -> None:
    env = {SHARES_ENV_VAR: "1,2", TRTLLM_SHARES_ENV_VAR: "2,1"}
    assert resolve_share_policy([5, 5], environ=env) == (
        (5.0, 5.0),
        "KvCacheConfig.window_size_shares",
    )
    assert resolve_share_policy(None, environ=env) == (
        (1.0, 2.0),
        f"environment variable {SHARES_ENV_VAR}",
    )
    assert resolve_share_policy(None, environ={TRTLLM_SHARES_ENV_VAR: "auto"}) == (
        "auto",
        f"environment variable {TRTLLM_SHARES_ENV_VAR}",
    )
    assert resolve_share_policy(None, environ={}) == ("equal", "default")


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("1,2,3", "gives 3 share"),
        ("1", "gives 1 share"),
        ("1,-1", "entry 1 is negative"),
        ("nan,1", "entry 0 is nan"),
        ("1,inf", "entry 1 is inf"),
        ("0,0", "all zero"),
        ("1,abc", "entry 1 is 'abc'"),
        ("1,,2", "entry 1 is ''"),
        ("fair", "entry 0 is 'fair'"),
    ],
)
@pytest.mark.parametrize("var", [SHARES_ENV_VAR, TRTLLM_SHARES_ENV_VAR])
def test_env_errors_name_the_variable(
    monkeypatch: pytest.MonkeyPatch, var: str, value: str, message: str
) -> None:
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError, match=f"environment variable {var}") as info:
        window_size_shares({1: 1, 2: 1})
    assert message in str(info.value)


def test_env_error_in_first_variable_is_not_masked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARES_ENV_VAR, "oops")
    monkeypatch.setenv(TRTLLM_SHARES_ENV_VAR, "1,1")
    with pytest.raises(ValueError, match=SHARES_ENV_VAR):
        window_size_shares({1: 1, 2: 1})


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        ([1.0], "policy argument gives 1 share"),
        ([1.0, -0.5], "entry 1 is negative"),
        ([float("nan"), 1.0], "entry 0 is nan"),
        ([0, 0.0], "all zero"),
        (["a", 1], "entry 0 must be a number"),
        ([None, 1], "entry 0 must be a number"),
        ([True, 1], "entry 0 must be a number"),
        ("uniform", "entry 0 is 'uniform'"),
    ],
)
def test_argument_errors(policy: object, message: str) -> None:
    with pytest.raises(ValueError, match="policy argument") as info:
        window_size_shares({1: 1, 2: 1}, policy)  # type: ignore[arg-type]
    assert message in str(info.value)


def test_config_share_count_error_names_field() -> None:
    m, _ = three_window_model()
    c = KvCacheConfig(max_attention_window=[1, 2, 3], window_size_shares=[1, 1])
    with pytest.raises(ValueError, match=r"KvCacheConfig.window_size_shares gives 2 share\(s\)"):
        blocks_per_window(m, c, 8, primary_bytes=10**9)


def test_config_field_beats_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(SHARES_ENV_VAR, "not numbers")
    m, bpt = three_window_model()
    c = KvCacheConfig(
        tokens_per_block=1, max_attention_window=[1, 2, 3], window_size_shares="equal"
    )
    assert blocks_per_window(m, c, 8, primary_bytes=3 * bpt * 10) == {
        1: (10, 0),
        2: (10, 0),
        3: (10, 0),
    }


# ----------------------------------------------------------------------------- blocks


def test_blocks_per_window_proportional_pinned() -> None:
    m, bpt = three_window_model()
    c = KvCacheConfig(
        tokens_per_block=16,
        max_attention_window=[1024, 4096, 8192],
        window_size_shares="proportional",
    )
    out = blocks_per_window(m, c, 8192, primary_bytes=16384 * bpt * 16)
    assert out == {1024: (1260, 0), 4096: (5041, 0), 8192: (10082, 0)}


def test_blocks_per_window_equal_and_secondary() -> None:
    m, bpt = three_window_model()
    c = KvCacheConfig(tokens_per_block=16, max_attention_window=[1024, 4096, None])
    block = bpt * 16
    out = blocks_per_window(m, c, 8192, primary_bytes=300 * block, secondary_bytes=31 * block)
    assert out == {1024: (100, 10), 4096: (100, 10), 8192: (100, 10)}


def test_blocks_per_window_exact_no_float_rounding() -> None:
    # 3 x 1/3 of an exact multiple must not come out one short.
    m, bpt = three_window_model()
    c = KvCacheConfig(tokens_per_block=1, max_attention_window=[1, 2, 3])
    assert blocks_per_window(m, c, 8, primary_bytes=3 * 49 * bpt) == {
        1: (49, 0),
        2: (49, 0),
        3: (49, 0),
    }


def test_blocks_per_window_env_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRTLLM_SHARES_ENV_VAR, "0.1,0.2,0.7")
    m, bpt = three_window_model()
    c = KvCacheConfig(tokens_per_block=1, max_attention_window=[1, 2, 3])
    assert blocks_per_window(m, c, 8, primary_bytes=100 * bpt) == {
        1: (10, 0),
        2: (20, 0),
        3: (70, 0),
    }


def test_blocks_per_window_gemma3_auto_balances_concurrency() -> None:
    c = KvCacheConfig(max_attention_window=GEMMA3_PATTERN, window_size_shares="auto")
    out = blocks_per_window(GEMMA3_27B, c, 32768, primary_bytes=80 * 2**30)
    assert out == {1024: (1123, 0), 32768: (26924, 0)}
    # Both windows fit the same number of 32k-token sequences: one prefilling in chunks of
    # 8,192 tokens (ceil((1024 + 8191) / 32) + 1 = 289 blocks of window 1024), the others
    # decoding (33). Counting decodes alone (904 blocks, 27 sequences) left window 1024
    # short of the prefill's peak with 27 running.
    peak = peak_blocks_per_sequence(32768, 1024, 32, chunk_size=8192)
    assert peak == 289
    assert 1 + (out[1024][0] - peak) // max_blocks_per_sequence(32768, 1024, 32) == 26
    assert out[32768][0] // max_blocks_per_sequence(32768, 32768, 32) == 26


def test_max_tokens_caps_single_window() -> None:
    m = ModelConfig(num_layers=2, num_kv_heads=1, head_dim=64)
    c = KvCacheConfig(tokens_per_block=16, max_tokens=1000)
    assert blocks_per_window(m, c, 4096, primary_bytes=10**9) == {4096: (63, 0)}
    # a budget below the cap wins
    assert blocks_per_window(m, c, 4096, primary_bytes=10 * 16 * 512) == {4096: (10, 0)}


def test_max_tokens_ignored_under_vswa_with_one_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    m, bpt = three_window_model()
    c = KvCacheConfig(tokens_per_block=1, max_attention_window=[1, 2, 3], max_tokens=987_654)
    with caplog.at_level(logging.WARNING, logger="kvcache.sizing"):
        first = blocks_per_window(m, c, 8, primary_bytes=30 * bpt)
        second = blocks_per_window(m, c, 8, primary_bytes=30 * bpt)
    assert first == second == {1: (10, 0), 2: (10, 0), 3: (10, 0)}
    warnings = [r for r in caplog.records if "max_tokens=987654 is ignored" in r.getMessage()]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING


def test_budget_too_small_names_window_and_bytes() -> None:
    m, bpt = three_window_model()
    c = KvCacheConfig(tokens_per_block=16, max_attention_window=[1024, 4096, 8192])
    block = bpt * 16  # 4096 B
    # equal thirds of 3 * 4096 - 3 bytes: every window is 1 byte short; the first is named
    with pytest.raises(ValueError) as info:
        blocks_per_window(m, c, 8192, primary_bytes=3 * block - 3)
    msg = str(info.value)
    assert "window 1024 gets 4.00 KiB" in msg
    assert "one block needs 4.00 KiB (16 tokens x 256 bytes per token)" in msg
    assert "1 B short" in msg
    assert "at least 12.0 KiB (12,288 bytes)" in msg


def test_budget_zero_share_window_rejected() -> None:
    m, _ = three_window_model()
    c = KvCacheConfig(max_attention_window=[1, 2, 3], window_size_shares=[0, 1, 1])
    with pytest.raises(ValueError, match=r"window 1 gets 0 B.*its share is 0"):
        blocks_per_window(m, c, 8, primary_bytes=10**9)


@pytest.mark.parametrize("bad", [-1, 1.5, "1GiB", None])
def test_blocks_per_window_rejects_bad_budget(bad: object) -> None:
    m, _ = three_window_model()
    with pytest.raises(ValueError, match="primary_bytes must be a non-negative int"):
        blocks_per_window(m, KvCacheConfig(), 8, primary_bytes=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="secondary_bytes must be a non-negative int"):
        blocks_per_window(m, KvCacheConfig(), 8, 10**9, secondary_bytes=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("seq_len", "window", "tpb", "expected"),
    [
        (512, 1024, 64, 8),
        (513, 1024, 64, 9),
        (512, 256, 64, 5),
        (512, 257, 64, 5),  # 257 = 4 x 64 + 1: spans at most 5 blocks
        (512, 258, 64, 6),
        (1, 4096, 32, 1),
        (32768, 32768, 32, 1024),
        (32768, 1024, 32, 33),
    ],
)
def test_max_blocks_per_sequence(seq_len: int, window: int, tpb: int, expected: int) -> None:
    assert max_blocks_per_sequence(seq_len, window, tpb) == expected


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("80GiB", 80 * 2**30),
        ("80 GiB", 80 * 2**30),
        ("80gib", 80 * 2**30),
        ("80G", 80 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1e9", 1_000_000_000),
        ("2.5e3KB", 2_500_000),
        ("4096", 4096),
        ("4096B", 4096),
        (" 1 TiB ", 2**40),
        ("0.1KiB", 102),
        ("0", 0),
        (123, 123),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "80 GiBs", "80XB", "-1GiB", "nan", "inf GB", "1e", "1,5GB", "ten", -5]
)
def test_parse_size_errors(text: str | int) -> None:
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


def test_format_size() -> None:
    assert format_size(80 * 2**30) == "80.0 GiB"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(100) == "100 B"
    assert format_size(300 * 2**20) == "300 MiB"
    assert format_size(5 * 2**40) == "5.00 TiB"


def test_auto_uses_the_config_expected_seq_len() -> None:
    """``KvCacheConfig.expected_seq_len`` sizes "auto" like the keyword does; the keyword wins."""
    model = ModelConfig(num_layers=6, num_kv_heads=1, head_dim=16)
    base = KvCacheConfig(
        tokens_per_block=32, max_attention_window=[1024] * 5 + [None], window_size_shares="auto"
    )
    cfg = KvCacheConfig.from_dict({**base.to_dict(), "expected_seq_len": 2048})
    budget = 64 * 1024 * 1024
    from_config = blocks_per_window(model, cfg, 32768, budget)
    from_keyword = blocks_per_window(model, base, 32768, budget, expected_seq_len=2048)
    assert from_config == from_keyword
    assert from_config != blocks_per_window(model, base, 32768, budget)
    # auto at 2048: a prompt fits one chunk, so both windows peak at 64 blocks; decoding, the
    # sliding window keeps 33 (ceil(1023 / 32) + 1), full attention 64: 142 sequences each.
    assert from_config == {1024: (4730, 0), 32768: (9114, 0)}
    assert 1 + (4730 - 64) // 33 == 1 + (9114 - 64) // 64 == 142
    assert blocks_per_window(model, cfg, 32768, budget, expected_seq_len=32768) == (
        blocks_per_window(model, base, 32768, budget)
    )
    with pytest.raises(ValueError, match="expected_seq_len"):
        KvCacheConfig(expected_seq_len=0)


def test_byte_counts_refuse_size_strings_pointing_to_parse_size() -> None:
    """Every count and byte size is checked by kvcache.cache.fields: numpy ints pass, bools
    and strings do not, and a size string names the call that converts it."""
    import numpy as np

    config = KvCacheConfig(max_attention_window=[1024, None], tokens_per_block=32)
    with pytest.raises(ValueError) as info:
        blocks_per_window(GEMMA3_27B, config, 32768, "4GiB")  # type: ignore[arg-type]
    assert str(info.value) == (
        "primary_bytes must be a non-negative int, got '4GiB'; for a size string pass "
        "kvcache.parse_size('4GiB')"
    )
    with pytest.raises(ValueError, match=r"^secondary_bytes must be a non-negative int, got True$"):
        blocks_per_window(GEMMA3_27B, config, 32768, 2**30, True)
    assert blocks_per_window(GEMMA3_27B, config, 32768, np.int64(2**30)) == blocks_per_window(
        GEMMA3_27B, config, 32768, parse_size("1GiB")
    )
