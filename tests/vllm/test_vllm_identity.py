"""vLLM 0.32 (CPU build) with kvcache as its KV cache manager: the same greedy tokens as vanilla
vLLM on tiny random-weight models, with prefix hits, preemption and ``reset_prefix_cache``.

Each engine runs in its own process (``run_engine.py``). Skipped where vLLM is not installed;
CI runs this directory in a virtual environment of its own (``.ci/run``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from harness import run_in_process, shared_prefix_prompts


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm-models")


def both(kind: str, root: Path, waves: list[list[list[int]]], **kw: Any) -> tuple[Any, Any]:
    vanilla = run_in_process(kind, "vllm", root, waves, **kw)
    ours = run_in_process(kind, "kvcache", root, waves, **kw)
    assert vanilla["manager"] == "KVCacheManager"
    assert ours["manager"] == "VllmKVCacheManager"
    assert ours["copied_on_write_blocks"] == 0
    return vanilla, ours


WAVES = [shared_prefix_prompts(1, 12), shared_prefix_prompts(1, 12), shared_prefix_prompts(2, 8)]


@pytest.mark.parametrize("kind", ["llama", "gemma3", "mistral"])
def test_identical_tokens_with_prefix_hits(kind: str, root: Path) -> None:
    vanilla, ours = both(kind, root, WAVES)
    assert ours["outputs"] == vanilla["outputs"]
    # Outputs differ between prompts: a wrong block would change them.
    assert len({tuple(o) for o in ours["outputs"][0]}) == 12
    assert ours["requests"] == vanilla["requests"] == 32
    assert ours["queries"] == vanilla["queries"]
    assert ours["hits"] > 0
    assert ours["hits"] >= vanilla["hits"]
    # Wave 2 repeats wave 1: every repeated request hits at least its shared prefix (128
    # tokens: four 32-token blocks of the 150-token prefix).
    wave2 = [hits for _, _, hits in ours["lookups"][12:24]]
    assert min(wave2) >= 128


@pytest.mark.parametrize(("kind", "blocks"), [("llama", 40), ("gemma3", 96), ("mistral", 40)])
def test_identical_tokens_under_preemption(kind: str, blocks: int, root: Path) -> None:
    vanilla, ours = both(kind, root, WAVES, num_gpu_blocks_override=blocks, max_model_len=320)
    assert ours["outputs"] == vanilla["outputs"]
    assert ours["num_blocks"] == blocks
    assert vanilla["preempted_requests"] > 0  # the pool is small enough to preempt
    if kind != "mistral":  # Mistral: kvcache's sliding window releases enough to need none
        assert ours["preempted_requests"] > 0
    assert ours["hits"] > 0
    if kind != "llama":
        # Llama at 40 blocks: kvcache's eviction keeps 3 fewer of one request's own blocks
        # than vLLM's (4,032 against 4,128 hit tokens); see docs/design.md, "Inside vLLM".
        assert ours["hits"] >= vanilla["hits"]


def test_reset_prefix_cache_between_waves(root: Path) -> None:
    waves = [shared_prefix_prompts(1, 6), shared_prefix_prompts(1, 6)]
    vanilla, ours = both("gemma3", root, waves, reset_between=True)
    assert ours["outputs"] == vanilla["outputs"]
    assert ours["resets"] == vanilla["resets"] == [True]
    assert ours["reset_stats"] >= 1
    # After the reset the repeated wave finds nothing of wave 1: its requests hit exactly
    # what they hit in wave 1, from an empty cache.
    hits = [h for _, _, h in ours["lookups"]]
    assert hits[6:] == hits[:6]
    assert [h for _, _, h in vanilla["lookups"]][6:] == [h for _, _, h in vanilla["lookups"]][:6]
