"""Engine beam search and n > 1 sampling on forked sequences, token for token against HF.

The reference is ``model.generate(num_beams=k, do_sample=False, ...)`` of each prompt alone
(eager attention, HF's own cache, an explicit attention mask). The engine's beams are forks
of the prompt's sequence that share its blocks; the pools are small enough that the sliding
windows release blocks and the scheduler pauses beam families.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvcache import KvCacheConfig  # noqa: E402
from kvcache.engine import Engine, model_windows, tiny_model  # noqa: E402
from kvcache.torch import pool_views  # noqa: E402

FAMILIES = ("gemma3", "gemma2", "mistral", "gpt-oss")
WINDOW = 8
TPB = 4
NEW = 8
PAD = 0


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_MODELS: dict[str, Any] = {}


def _model(family: str) -> Any:
    if family not in _MODELS:
        _MODELS[family] = tiny_model(family, seed=0, sliding_window=WINDOW)
    return _MODELS[family]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(1, 128, (n,), generator=g).tolist() for n in (9, 6, 11)]


def _hf_beams(family: str, prompt: list[int], k: int, lp: float, es: bool | str) -> Any:
    model = _model(family)
    return model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=NEW,
        num_beams=k,
        num_return_sequences=k,
        do_sample=False,
        length_penalty=lp,
        early_stopping=es,
        pad_token_id=PAD,
        return_dict_in_generate=True,
        output_scores=True,
    )


def _engine(family: str, blocks: int, **kwargs: Any) -> Engine:
    windows = {WINDOW if w is not None else 64 for w in model_windows(_model(family).config)}
    config = KvCacheConfig(tokens_per_block=TPB, backend="host")
    engine = Engine(
        _model(family),
        config,
        max_seq_len=64,
        max_batch_size=16,
        blocks_per_window={w: (blocks, 16) for w in windows},
        max_chunk_size=8,
        **kwargs,
    )
    for pool in pool_views(engine.manager):  # a read of a slot nobody wrote poisons the output
        pool.fill_(float("nan"))
    return engine


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    ("k", "lp", "es"), [(2, 1.0, False), (4, 0.5, True), (4, 2.0, "never")], ids=str
)
def test_beam_search_matches_hf_generate(family: str, k: int, lp: float, es: bool | str) -> None:
    """Every finished beam and its score as HF's, with an EOS that ends beams early, small
    pools (sliding-window releases, families paused and resumed) and NaN-poisoned pools."""
    model = _model(family)
    prompts = _prompts()
    model.generation_config.eos_token_id = None
    # The EOS: a token HF's best beam of the first prompt emits mid-way, so beams end early.
    eos = _hf_beams(family, prompts[0], k, lp, es).sequences[0, len(prompts[0]) + 2].item()
    model.generation_config.eos_token_id = eos
    try:
        engine = _engine(family, blocks=16)
        result = engine.generate_detailed(prompts, NEW, num_beams=k, length_penalty=lp,
                                          early_stopping=es)  # fmt: skip
        assert engine.generate(prompts[1:2], NEW, num_beams=k, length_penalty=lp,
                               early_stopping=es) == [result.tokens[1]]  # fmt: skip
        for prompt, best, seqs, scores in zip(
            prompts, result.tokens, result.sequences, result.scores, strict=True
        ):
            ref = _hf_beams(family, prompt, k, lp, es)
            assert len(seqs) == len(scores) == k and best == seqs[0]
            for j, seq in enumerate(seqs):
                want = ref.sequences[j, len(prompt) :].tolist()
                assert seq == want[: len(seq)]
                assert set(want[len(seq) :]) <= {PAD, eos}  # HF pads shorter beams
                assert len(seq) == NEW or seq[-1] == eos
            torch.testing.assert_close(
                torch.tensor(scores), ref.sequences_scores, atol=1e-4, rtol=0
            )
    finally:
        model.generation_config.eos_token_id = None
    if es is True:  # with these weights, beams ended by the EOS are among the finished
        assert any(len(s) < NEW for seqs in result.sequences for s in seqs)
    stats = engine.stats()
    assert stats.cache.forked_blocks > 0 and stats.cache.copied_on_write_blocks > 0
    assert stats.peak_used_blocks[WINDOW] <= 16
    # Each beam writes more sliding-window blocks than the window holds: the window released.
    assert math.ceil((len(prompts[2]) + NEW - 1) / TPB) > WINDOW // TPB + 1
    if k == 4:
        assert stats.preemptions > 0  # families were paused and resumed
    engine.manager.check_invariants()
    assert engine.manager.num_sequences == 0


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict"])
@pytest.mark.parametrize("family", FAMILIES)
def test_beam_families_on_a_14_block_pool_run_to_completion(family: str, policy: str) -> None:
    """Three 4-beam families on 14 blocks per window: each fits the empty pools, not all at
    once. max_utilization pauses and resumes whole families (gemma2 used to end with "the
    beams of a request do not fit" RuntimeError, its beams paused for good);
    guaranteed_no_evict admits a family only with its beams' blocks and never pauses. Every
    beam is still HF's."""
    model = _model(family)
    model.generation_config.eos_token_id = None
    prompts = _prompts()
    engine = _engine(family, blocks=14, policy=policy)
    result = engine.generate_detailed(prompts, NEW, num_beams=4)
    for prompt, seqs, scores in zip(prompts, result.sequences, result.scores, strict=True):
        ref = _hf_beams(family, prompt, 4, 1.0, False)
        assert seqs == [ref.sequences[j, len(prompt) :].tolist() for j in range(4)]
        torch.testing.assert_close(torch.tensor(scores), ref.sequences_scores, atol=1e-4, rtol=0)
    stats = engine.stats()
    assert (stats.preemptions > 0) == (policy == "max_utilization")
    assert stats.peak_used_blocks[WINDOW] <= 14
    engine.manager.check_invariants()
    assert engine.manager.num_sequences == 0


def test_a_beam_family_that_can_never_fit_is_refused_up_front() -> None:
    engine = _engine("gemma2", blocks=6)
    # One sequence of 11 + 8 tokens fits 6 blocks per window; 4 beams of it never do.
    assert len(engine.generate([_prompts()[2]], NEW)[0]) == NEW
    with pytest.raises(ValueError, match="with 4 beams can never fit the KV pools"):
        engine.generate([_prompts()[2]], NEW, num_beams=4)
    assert engine.manager.num_sequences == 0


def test_beams_step_in_one_add_tokens_call_and_reorder_by_fork_and_free() -> None:
    """One prompt, 4 beams: each step adds every beam's token in one call; beams are
    reordered by fork_resources / free_resources, never by copying a whole cache."""
    engine = _engine("gemma3", blocks=64)
    calls: list[list[int]] = []
    forks: list[tuple[int, list[int]]] = []
    freed: list[int] = []
    manager, rm = engine.manager, engine.resource_manager
    add, fork, free = manager.add_tokens, rm.fork_resources, rm.free_resources
    add_generated = manager._add_generated  # the list form's decode step: check and add at once

    def spy_add(ids: Any, tokens: Any) -> Any:
        calls.append(sorted(int(i) for i in ids))
        return add(ids, tokens)

    def spy_add_generated(ids: Any, generated: Any, bases: Any) -> Any:
        k = add_generated(ids, generated, bases)
        if k < 0:  # added (else nothing was, and add_tokens follows)
            calls.append(sorted(int(i) for i in ids))
        return k

    def spy_fork(parent: Any, children: Any) -> None:
        forks.append((parent.request_id, [c.request_id for c in children]))
        fork(parent, children)

    def spy_free(request: Any, **kwargs: Any) -> None:
        freed.append(request.request_id)
        free(request, **kwargs)

    manager.add_tokens, rm.fork_resources, rm.free_resources = spy_add, spy_fork, spy_free
    manager._add_generated = spy_add_generated
    [best] = engine.generate([[5, 9, 2, 7, 7, 1, 3]], NEW, num_beams=4)
    assert len(best) == NEW
    # The first step after the prompt forks 3 children from the prompt's sequence.
    assert forks[0] == (0, [1, 2, 3])
    # Decode steps NEW - 1 (the last token is never written): one call each, all 4 beams.
    assert len(calls) == NEW - 1 and all(len(c) == 4 for c in calls)
    # Every beam forked was freed; the live count never exceeds 4.
    children = [c for _, cs in forks for c in cs]
    assert sorted(freed) == sorted([0, *children])
    stats = engine.stats().cache
    # Copy-on-write: at most one block per beam per window per step.
    assert 0 < stats.copied_on_write_blocks <= 4 * 2 * NEW
    assert manager.num_sequences == 0


def _prompt_blocks_shared(engine: Engine, prompt_len: int) -> list[dict[int, list[int]]]:
    """Spies fork_resources: each fork's parent and children block ids right after it."""
    seen: list[dict[int, list[int]]] = []
    rm, fork = engine.resource_manager, engine.resource_manager.fork_resources

    def spy(parent: Any, children: Any) -> None:
        fork(parent, children)
        m = engine.manager
        ids = [parent.request_id, *(c.request_id for c in children)]
        seen.append({w: [m.get_cache_block_ids(i, w) for i in ids] for w in m.window_sizes})

    rm.fork_resources = spy
    return seen


def test_n_samples_share_the_prompt_blocks_and_are_seeded() -> None:
    family = "gemma2"
    prompt = [4, 8, 15, 16, 23, 42, 7, 1, 99, 3, 12, 5]  # 3 full blocks
    engine = _engine(family, blocks=64)
    seen = _prompt_blocks_shared(engine, len(prompt))

    def run(seed: int) -> Any:
        g = torch.Generator().manual_seed(seed)
        return engine.generate_detailed([prompt], NEW, n=3, generator=g, temperature=1.5)

    a = run(7)
    assert len(seen) == 1  # one fork per prompt, right after its first token
    for w, tables in seen[0].items():
        assert len(tables) == 3 and tables[1] == tables[0] and tables[2] == tables[0], w
        assert len(tables[0]) == 3  # the prompt's blocks (a window's released one: NULL)
    b, c = run(7), run(8)
    assert a.sequences == b.sequences  # the second run reuses the cached prompt blocks
    assert a.scores[0] == pytest.approx(b.scores[0], abs=1e-4)
    assert a.sequences != c.sequences
    [samples] = a.sequences
    assert len(samples) == 3 and all(len(s) == NEW for s in samples)
    assert len({tuple(s) for s in samples}) > 1 and a.tokens == [samples[0]]
    # Each score is the sample's log-probability under HF's own forward pass.
    model = _model(family)
    for sample, score in zip(samples, a.scores[0], strict=True):
        ids = torch.tensor([prompt + sample])
        with torch.no_grad():
            logits = model(ids, attention_mask=torch.ones_like(ids)).logits[0].float()
        logp = torch.log_softmax(logits[len(prompt) - 1 : -1] / 1.5, dim=-1)
        want = logp.gather(1, torch.tensor(sample)[:, None]).sum().item()
        assert score == pytest.approx(want, abs=1e-3)
    assert engine.manager.num_sequences == 0
    engine.manager.check_invariants()


def test_bad_fork_arguments_are_refused_and_the_engine_stays_usable() -> None:
    engine = _engine("mistral", blocks=64)
    with pytest.raises(ValueError, match="num_beams must be an int >= 1"):
        engine.generate([[1, 2]], 2, num_beams=0)
    with pytest.raises(ValueError, match="cannot both exceed 1"):
        engine.generate_detailed([[1, 2]], 2, num_beams=2, n=2)
    with pytest.raises(ValueError, match="early_stopping must be True, False or 'never'"):
        engine.generate([[1, 2]], 2, num_beams=2, early_stopping="soon")
    with pytest.raises(ValueError, match="temperature must be > 0"):
        engine.generate_detailed([[1, 2]], 2, n=2, temperature=0.0)
    with pytest.raises(ValueError, match="17 beams or samples exceed max_batch_size=16"):
        engine.generate([[1, 2]], 2, num_beams=17)
    with pytest.raises(ValueError, match="length_penalty must be a float"):
        engine.generate([[1, 2]], 2, num_beams=2, length_penalty="long")  # type: ignore[arg-type]
    assert engine.manager.num_sequences == 0
    assert len(engine.generate([[1, 2]], 2, num_beams=2)[0]) == 2
