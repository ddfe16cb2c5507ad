"""kvcache.engine: tiny Hugging Face models on kvcache blocks, token for token against HF.

Every model is a random-weight fp32 config built here (nothing is downloaded); the reference
is ``model.generate`` (greedy, eager attention, HF's own cache) of each prompt alone.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcache import KvCacheConfig, cuda_available  # noqa: E402
from kvcache.engine import (  # noqa: E402
    Engine,
    model_windows,
    tiny_config,
    tiny_model,
)
from kvcache.torch import pool_views  # noqa: E402

FAMILIES = ("gemma3", "gemma2", "mistral", "gpt-oss")
WINDOW = 8  # two blocks of 4 tokens
TPB = 4
NEW = 12


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # fast and deterministic on a shared machine
    yield
    torch.set_num_threads(threads)


_MODELS: dict[str, Any] = {}
_REFS: dict[tuple[str, tuple[int, ...], int], tuple[list[int], Any]] = {}


def _model(family: str) -> Any:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=0, sliding_window=WINDOW)
    return _MODELS[family]


def _hf(family: str, prompt: list[int], new: int = NEW) -> tuple[list[int], Any]:
    """HF's greedy tokens and the logits that chose the last one (cached per prompt)."""
    key = (family, tuple(prompt), new)
    if key not in _REFS:
        model = _model(family)
        config = model.generation_config
        config.eos_token_id = None  # generate exactly `new` tokens, as the engine does
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=config,
            max_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        _REFS[key] = (out.sequences[0, len(prompt) :].tolist(), out.logits[-1][0])
    return _REFS[key]


def _prompts(seed: int, count: int, lo: int, hi: int, prefix: list[int] | None = None) -> list:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi, (count,), generator=g).tolist()
    return [(prefix or []) + torch.randint(0, 128, (n,), generator=g).tolist() for n in lengths]


def _check(family: str, engine: Engine, prompts: list[list[int]], new: int = NEW) -> None:
    result = engine.generate_detailed(prompts, new)
    for prompt, tokens, logits in zip(prompts, result.tokens, result.last_logits, strict=True):
        want_tokens, want_logits = _hf(family, prompt, new)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=0)
    engine.manager.check_invariants()
    assert engine.manager.num_sequences == 0


def _engine(family: str, **kwargs: Any) -> Engine:
    reuse = kwargs.pop("reuse", True)
    policy = kwargs.pop("swa_reuse_policy", "placeholder")
    lend = kwargs.pop("lend_free_memory", False)
    config = KvCacheConfig(
        tokens_per_block=TPB,
        backend="host",
        enable_block_reuse=reuse,
        swa_reuse_policy=policy,
        lend_free_memory=lend,
    )
    kwargs.setdefault("max_seq_len", 64)
    kwargs.setdefault("max_batch_size", 8)
    if "blocks_per_window" not in kwargs:
        kwargs.setdefault("memory", "1MiB")
    return Engine(_model(family), config, **kwargs)


def test_windows_come_from_the_model_config() -> None:
    assert model_windows(tiny_config("gemma3", sliding_window=8)) == [8] * 5 + [None]
    assert model_windows(tiny_config("gemma2", sliding_window=8)) == [8, None] * 2
    assert model_windows(tiny_config("mistral", sliding_window=8)) == [8] * 3
    assert model_windows(tiny_config("gpt-oss", sliding_window=8)) == [8, None] * 2
    from transformers import Qwen2Config

    qwen = Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=16, max_window_layers=2
    )
    assert model_windows(qwen) == [None, None, 16, 16]
    qwen_off = Qwen2Config(num_hidden_layers=2, use_sliding_window=False, sliding_window=16)
    assert model_windows(qwen_off) == [None, None]
    engine = _engine("gemma3", max_seq_len=64)
    assert engine.manager.window_sizes == [WINDOW, 64]
    assert [p for p, _ in engine.manager.layer_to_pool] == [0] * 5 + [1]


@pytest.mark.parametrize("family", FAMILIES)
def test_one_request_matches_hf_generate(family: str) -> None:
    _check(family, _engine(family, reuse=False), _prompts(1, 1, 20, 21))


@pytest.mark.parametrize("family", FAMILIES)
def test_a_batch_of_8_matches_hf_generate(family: str) -> None:
    engine = _engine(family, reuse=False)
    prompts = _prompts(2, 8, 3, 30)
    _check(family, engine, prompts)
    stats = engine.stats()
    assert stats.requests == 8 and stats.generated_tokens == 8 * NEW
    assert stats.reused_tokens == 0 and stats.computed_tokens == sum(map(len, prompts)) + 8 * (
        NEW - 1
    )
    # Continuous batching: far fewer steps than requests x tokens.
    assert stats.steps < 2 * NEW


@pytest.mark.parametrize("policy", ["placeholder", "invalidate"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_second_wave_reuses_the_system_prompt_in_every_window(family: str, policy: str) -> None:
    # 4 full blocks (twice the sliding window) and 2 tokens of a fifth: partial reuse
    # copies (or takes over) that block, whose first tokens must be the right KV.
    system = _prompts(3, 1, 18, 19)[0]
    engine = _engine(family, swa_reuse_policy=policy)
    for pool in pool_views(engine.manager):
        pool.fill_(float("nan"))
    first = _prompts(4, 4, 3, 12, prefix=system)
    _check(family, engine, first)
    before = engine.stats()
    second = _prompts(5, 4, 3, 12, prefix=system)
    _check(family, engine, second)
    after = engine.stats()
    reused = after.cache.reused_blocks_per_window_size
    for window in engine.manager.window_sizes:
        gained = reused[window] - before.cache.reused_blocks_per_window_size.get(window, 0)
        assert gained >= 4 * len(system) // TPB, window  # every request reused the prefix
    # Reused positions (the partial block's too) were never computed again.
    assert after.reused_tokens - before.reused_tokens >= 4 * len(system)
    computed = after.computed_tokens - before.computed_tokens
    total = sum(map(len, second)) + 4 * (NEW - 1)
    assert computed == total - (after.reused_tokens - before.reused_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_small_pools_release_reclaim_offload_onboard_and_preempt(family: str) -> None:
    """Pools far below the demand: still token for token."""
    new = 24
    prompts = _prompts(6, 4, 3, 8)
    full = max(engine_windows(family) or [WINDOW])
    blocks: dict[int, int | tuple[int, int]] = {WINDOW: (6, 8)}
    if full != WINDOW:
        blocks[full] = (12, 16)
    engine = _engine(family, blocks_per_window=blocks, max_chunk_size=8)
    for pool in pool_views(engine.manager):  # a read of a slot nobody wrote poisons the output
        pool.fill_(float("nan"))
    _check(family, engine, prompts, new)
    stats = engine.stats()
    # Each request writes more sliding-window blocks than the pool has: the window released
    # blocks and other requests (or later positions) took them.
    written = sum(math.ceil((len(p) + new - 1) / TPB) for p in prompts)
    assert written > 4 * 6 and stats.peak_used_blocks[WINDOW] <= 6
    assert stats.preemptions > 0
    assert stats.cache.offloaded_blocks > 0 and stats.cache.onboarded_blocks > 0
    assert stats.reused_tokens > 0  # the resumed requests found part of their context cached


@pytest.mark.parametrize("family", FAMILIES)
def test_windows_that_lend_memory_match_hf_generate(family: str) -> None:
    """lend_free_memory: every window's blocks in one arena (views with the arena's block
    stride, offsets in its slabs); full attention starts with too few blocks for the batch and
    borrows the sliding window's free memory. NaN-filled pools: token for token."""
    new = 24
    prompts = _prompts(8, 4, 3, 8)
    full = max(engine_windows(family) or [WINDOW])
    blocks: dict[int, int | tuple[int, int]] = {WINDOW: 24}
    if full != WINDOW:
        blocks[full] = 8
    engine = _engine(family, blocks_per_window=blocks, max_chunk_size=8, lend_free_memory=True)
    for pool in pool_views(engine.manager):
        pool.fill_(float("nan"))
    _check(family, engine, prompts, new)
    stats = engine.stats()
    if full != WINDOW:
        assert engine.manager.lends_free_memory
        assert stats.cache.lent_slabs > 0
        assert stats.peak_used_blocks[full] > 8  # beyond its initial share
    else:
        assert not engine.manager.lends_free_memory  # one window: nothing to lend


def engine_windows(family: str) -> list[int]:
    return [64 if w is None else w for w in model_windows(_model(family).config)]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_chunked_prompt_equals_an_unchunked_one(family: str) -> None:
    prompts = _prompts(7, 3, 20, 30)
    chunked = _engine(family, reuse=False, max_chunk_size=5)
    whole = _engine(family, reuse=False, chunked_prefill=False)
    a = chunked.generate_detailed(prompts, NEW)
    b = whole.generate_detailed(prompts, NEW)
    assert a.tokens == b.tokens
    for x, y in zip(a.last_logits, b.last_logits, strict=True):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=0)
    assert chunked.stats().steps > whole.stats().steps  # it really ran in chunks
    _check(family, chunked, prompts)


def test_guaranteed_no_evict_never_preempts() -> None:
    blocks: dict[int, int | tuple[int, int]] = {WINDOW: 6, 64: 12}
    engine = _engine("gemma3", blocks_per_window=blocks, policy="guaranteed_no_evict")
    _check("gemma3", engine, _prompts(6, 4, 3, 8), 24)
    assert engine.stats().preemptions == 0


def test_bad_input_is_refused_and_leaves_the_engine_usable() -> None:
    engine = _engine("mistral", reuse=False)
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([[1, 2], []], 2)
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.generate([[1, 128]], 2)
    with pytest.raises(ValueError, match="exceed max_seq_len=64"):
        engine.generate([[1] * 60], 6)
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        engine.generate([[1]], 0)
    assert engine.manager.num_sequences == 0 and engine.stats().steps == 0
    prompt = _prompts(8, 1, 10, 11)
    _check("mistral", engine, prompt)
    with pytest.raises(ValueError, match="max_attention_window"):
        Engine(
            _model("gemma3"),
            KvCacheConfig(tokens_per_block=TPB, backend="host", max_attention_window=[8]),
            max_seq_len=64,
            max_batch_size=2,
            memory="1MiB",
        )
    with pytest.raises(ValueError, match="needs 'host'"):
        Engine(
            _model("gemma3"),
            KvCacheConfig(tokens_per_block=TPB, backend="virtual"),
            max_seq_len=64,
            max_batch_size=2,
            memory="1MiB",
        )
    # A request that can never fit is refused before anything runs (issue 24), not mid-run.
    small = _engine("mistral", blocks_per_window={WINDOW: 2}, chunked_prefill=False)
    with pytest.raises(ValueError, match="20 tokens \\+ 2 new can never fit the KV pools"):
        small.generate([list(range(20))], 2)
    assert small.manager.num_sequences == 0 and small.stats().steps == 0


def test_an_explicit_matching_window_pattern_is_accepted() -> None:
    config = KvCacheConfig(
        tokens_per_block=TPB, backend="auto", max_attention_window=[WINDOW, None]
    )
    engine = Engine(_model("gemma2"), config, max_seq_len=64, max_batch_size=2, memory="1MiB")
    _check("gemma2", engine, _prompts(9, 2, 10, 20))


@pytest.mark.cuda
@pytest.mark.skipif(
    not (torch.cuda.is_available() and cuda_available()), reason="needs a CUDA device"
)
@pytest.mark.parametrize("family", FAMILIES)
def test_cuda_matches_hf_generate(family: str) -> None:
    model = tiny_model(family, seed=0, sliding_window=WINDOW).cuda()
    config = KvCacheConfig(tokens_per_block=TPB, enable_block_reuse=True)
    engine = Engine(model, config, max_seq_len=64, max_batch_size=8, memory="1MiB")
    assert engine.manager.backend == "cuda"
    prompts = _prompts(2, 8, 3, 30)
    result = engine.generate_detailed(prompts, NEW)
    for prompt, tokens, logits in zip(prompts, result.tokens, result.last_logits, strict=True):
        want_tokens, want_logits = _hf(family, prompt)
        assert tokens == want_tokens
        torch.testing.assert_close(logits, want_logits, atol=1e-3, rtol=0)
