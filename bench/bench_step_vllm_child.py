"""Child of ``bench_step_vllm.py``: vLLM 0.32's own v1 ``Scheduler`` on the replay.

Runs under vLLM's interpreter, never imports kvcache, and prints one line ``RESULT {json}``
on stdout. Usage (``bench_step_vllm.py`` calls it)::

    python bench/bench_step_vllm_child.py TRACE.npz FINGERPRINT

The set-up is the parent's: windows {512, full} as two KV cache groups of one layer each
(``SlidingWindowSpec(sliding_window=512)`` and ``FullAttentionSpec``, 8 KV heads x 128,
bf16), 32-token blocks, 20,000 blocks in vLLM's one shared pool, prefix caching on, at most
128 running (``max_num_seqs``), an 8,192-token step budget, chunked prefill, first come first
served. No weights are loaded and no model runs: the "model" is the parent's deterministic
token, ``(request_id * 7919 + num_tokens * 104_729) % 32000`` for every request whose
scheduled tokens complete its prompt (built outside the timed parts into a
``ModelRunnerOutput``). Timed with ``time.thread_time_ns``: ``schedule()`` and
``update_from_output()``, each step. After the run, every request's output tokens are checked
against the trace's tokens and their digest returned.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")

import numpy as np
from vllm_fake_runner import fake_model_output, scheduler_with_requests

VOCAB = 32000
TPB = 32
SWA = 512
TOTAL_BLOCKS = 20_000
MAX_BATCH = 128
MAX_NUM_BATCHED_TOKENS = 8192


def fingerprint(tokens: np.ndarray, offsets: np.ndarray, max_new: np.ndarray) -> str:
    """sha256 of the trace's arrays (int64, little-endian): the parent computes the same."""
    h = hashlib.sha256()
    for a in (tokens, offsets, max_new):
        h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
    return h.hexdigest()


def expected_tokens(rid: int, prompt_len: int, max_new: int) -> list[int]:
    """The trace's output: token k of request ``rid`` follows ``prompt_len + k`` tokens."""
    return [(rid * 7919 + (prompt_len + k) * 104_729) % VOCAB for k in range(max_new)]


def _model_dir(root: Path) -> Path:
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 1024,
        "intermediate_size": 2048,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    d = root / "two-layer"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def main() -> None:
    trace, expected_fp = sys.argv[1], sys.argv[2]
    logging.disable(logging.WARNING)
    z = np.load(trace)
    tokens, offsets, max_new = z["tokens"], z["offsets"], z["max_new"]
    fp = fingerprint(tokens, offsets, max_new)
    if fp != expected_fp:
        raise SystemExit(f"trace fingerprint {fp} is not the parent's {expected_fp}")
    prompts = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(max_new))]
    max_model_len = max(len(p) + int(m) for p, m in zip(prompts, max_new, strict=True))

    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.outputs import ModelRunnerOutput

    with tempfile.TemporaryDirectory() as tmp:
        mc = ModelConfig(
            model=str(_model_dir(Path(tmp))),
            skip_tokenizer_init=True,
            max_model_len=max_model_len,
            dtype="bfloat16",
            enforce_eager=True,
        )
        cc = CacheConfig(block_size=TPB, enable_prefix_caching=True)
        sc = SchedulerConfig(
            max_num_seqs=MAX_BATCH,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_chunked_prefill=True,
            max_model_len=max_model_len,
            is_encoder_decoder=False,
        )
        vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc)
        vc.cache_config.num_gpu_blocks = TOTAL_BLOCKS
        common = {"num_kv_heads": 8, "head_size": 128, "dtype": torch.bfloat16}
        kv = KVCacheConfig(
            num_blocks=TOTAL_BLOCKS,
            kv_cache_tensors=[],
            kv_cache_groups=[
                KVCacheGroupSpec(
                    ["model.layers.0.self_attn"],
                    SlidingWindowSpec(TPB, sliding_window=SWA, **common),
                ),
                KVCacheGroupSpec(["model.layers.1.self_attn"], FullAttentionSpec(TPB, **common)),
            ],
        )
        sched, requests = scheduler_with_requests(vc, kv, TPB, TPB, prompts, max_new)

    steps = 0
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    batch: list[int] = []
    first_hit: dict[str, int] = {}
    outputs: dict[str, list[int]] = {rid: [] for rid in requests}
    clock = time.thread_time_ns
    wall0 = time.perf_counter()
    finished = 0
    while sched.has_unfinished_requests():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        for nr in out.scheduled_new_reqs:
            first_hit.setdefault(nr.req_id, nr.num_computed_tokens)
        ids, mro = fake_model_output(out, requests, ModelRunnerOutput, VOCAB)
        t2 = clock()
        eco = sched.update_from_output(out, mro)
        t3 = clock()
        schedule_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        batch.append(len(ids))
        steps += 1
        for outs in eco.values():
            for o in outs.outputs:
                outputs[o.request_id].extend(o.new_token_ids)
                finished += o.finish_reason is not None
        if steps > 200_000:
            break
    wall = time.perf_counter() - wall0
    digest = hashlib.sha256()
    wrong = 0
    for i, p in enumerate(prompts):
        got = outputs[str(i)]
        wrong += got != expected_tokens(i, len(p), int(max_new[i]))
        digest.update(np.asarray(got, dtype="<i8").tobytes())
    prompt_tokens = int(sum(len(p) for p in prompts))
    res = {
        "steps": steps,
        "finished": finished,
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "reused_first_admission": int(sum(first_hit.values())),
        "hit_rate": sum(first_hit.values()) / prompt_tokens,
        "num_preemptions": int(sum(r.num_preemptions for r in requests.values())),
        "wrong_outputs": wrong,
        "output_digest": digest.hexdigest(),
        "schedule_ns": schedule_ns,
        "update_ns": update_ns,
        "batch": batch,
        "wall_s": wall,
    }
    print("RESULT " + json.dumps(res))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
