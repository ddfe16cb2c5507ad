"""The fake model runner of the vLLM-side bench children (bench_step_vllm_child.py,
bench_hybrid_vllm.py), run under vLLM's interpreter: the step's sampled tokens by the benches'
token rule, built outside the timed calls."""

from __future__ import annotations

from typing import Any


def fake_model_output(
    out: Any, requests: dict[str, Any], mro_cls: Any, vocab: int
) -> tuple[list[str], Any]:
    """The scheduled request ids and a ``ModelRunnerOutput`` (``mro_cls``) in which every
    request whose step ends its prompt or decodes samples
    ``(request_id * 7919 + num_tokens * 104_729) % vocab``; the others sample nothing."""
    ids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in ids:
        r = requests[rid]
        done = r.num_computed_tokens + out.num_scheduled_tokens[rid] >= r.num_tokens
        sampled.append([(int(rid) * 7919 + r.num_tokens * 104_729) % vocab] if done else [])
    mro = mro_cls(
        req_ids=ids,
        req_id_to_index={r: k for k, r in enumerate(ids)},
        sampled_token_ids=sampled,
    )
    return ids, mro


def scheduler_with_requests(
    vllm_config: Any,
    kv_cache_config: Any,
    block_size: int,
    hash_block_size: int,
    prompts: list[list[int]],
    max_new: Any,
) -> tuple[Any, dict[str, Any]]:
    """vLLM's ``Scheduler`` (stats on) with one greedy request per prompt queued, ids
    ``"0"``, ``"1"``, ...: ``max_new[i]`` tokens each, EOS ignored, block hashes vLLM's."""
    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.request import Request
    from vllm.v1.structured_output import StructuredOutputManager

    sched = Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=True,
    )
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_block_size, hash_fn)
    requests = {}
    for i, p in enumerate(prompts):
        sp = SamplingParams(
            max_tokens=int(max_new[i]), ignore_eos=True, temperature=0.0, detokenize=False
        )
        r = Request(str(i), p, sp, None, block_hasher=hasher)
        requests[r.request_id] = r
        sched.add_request(r)
    return sched, requests
