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
