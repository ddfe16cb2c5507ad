"""Child of ``bench_hybrid.py``: vLLM's own v1 scheduler and KV cache manager on the replay.

Runs under vLLM's interpreter (``$KVCACHE_VLLM_PYTHON``; vLLM 0.32 CPU), never imports
kvcache, and prints one line ``RESULT {json}`` on stdout. Usage (``bench_hybrid.py`` calls
it)::

    python bench/bench_hybrid_vllm.py TRACE.npz MEMORY_BYTES [--mode align] [--backend flash]

The model is the Qwen3.5-9B layout with one layer per group, declared to vLLM as a two-layer
``Qwen3NextForCausalLM`` config written to a temporary directory (Qwen3-Next's Gated DeltaNet
has Qwen3.5-9B's state: 16 key heads x 128, 32 value heads x 128, conv kernel 4, so conv
``(3, 8192)`` bf16 and recurrent ``(32, 128, 128)`` fp32; one full-attention layer with 4 KV
heads x 256, bf16). No weights are loaded and no model runs: the set-up is the one
``EngineCore`` makes (``Platform._align_hybrid_block_size`` for the attention backend a GPU
uses, ``FlashAttentionBackend``; ``get_kv_cache_configs`` with the layer specs the model's
layers declare; ``resolve_kv_cache_block_sizes``; the request block hasher), then
``Scheduler.schedule()`` and ``update_from_output()`` with one sampled token per request
whose prompt is complete, until every request finished.
"""

from __future__ import annotations

import argparse
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
MAX_BATCH = 128
MAX_NUM_BATCHED_TOKENS = 8192


def _model_dir(root: Path) -> Path:
    cfg = {
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "vocab_size": VOCAB,
        "hidden_size": 4096,
        "intermediate_size": 12288,
        "num_hidden_layers": 2,
        "layer_types": ["linear_attention", "full_attention"],
        "full_attention_interval": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "partial_rotary_factor": 0.25,
        "linear_num_key_heads": 16,
        "linear_key_head_dim": 128,
        "linear_num_value_heads": 32,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "max_position_embeddings": 8192,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    d = root / "qwen35-9b-one-layer-per-group"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def build(max_model_len: int, memory: int, mode: str, backend: str, root: Path):
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_configs,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mc = ModelConfig(
        model=str(_model_dir(root)),
        skip_tokenizer_init=True,
        max_model_len=max_model_len,
        dtype="bfloat16",
        enforce_eager=True,
    )
    cc = CacheConfig(block_size=16, enable_prefix_caching=True, mamba_cache_mode=mode)
    sc = SchedulerConfig(
        max_num_seqs=MAX_BATCH,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        enable_chunked_prefill=True,
        max_model_len=max_model_len,
        is_encoder_decoder=False,
    )
    vc = VllmConfig(model_config=mc, cache_config=cc, scheduler_config=sc)
    if backend == "flash":
        from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend as B
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend as B
    type(current_platform)._align_hybrid_block_size(vc, B)
    cls, _ = ModelRegistry.resolve_model_cls(mc.architecture, model_config=mc)
    shapes = tuple(cls.get_mamba_state_shape_from_config(vc))
    dtypes = tuple(cls.get_mamba_state_dtype_from_config(vc))
    block = vc.cache_config.block_size
    specs = {
        "model.layers.0.linear_attn": MambaSpec(
            shapes=shapes,
            dtypes=dtypes,
            block_size=vc.cache_config.mamba_block_size or block,
            page_size_padded=vc.cache_config.mamba_page_size_padded,
            mamba_type=MambaAttentionBackendEnum.GDN_ATTN,
            mamba_cache_mode=mode,
        ),
        "model.layers.1.self_attn": FullAttentionSpec(
            block_size=block, num_kv_heads=4, head_size=256, dtype=torch.bfloat16
        ),
    }
    from vllm.v1.attention.backends.utils import (
        get_supported_kv_cache_layouts,
        resolve_kv_cache_layout,
    )

    layouts = [x.name for x in get_supported_kv_cache_layouts([B])]
    resolve_kv_cache_layout(vc, [layouts], list(specs.values()))
    kv_cfgs = get_kv_cache_configs(vc, [specs], [memory])
    kv = generate_scheduler_kv_cache_config(kv_cfgs)
    vc.cache_config.num_gpu_blocks = kv.num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kv, vc)
    kv.hash_block_size = hash_bs
    kv.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(kv, vc, sched_bs, hash_bs)
    info = {
        "block_size": block,
        "mamba_block_size": vc.cache_config.mamba_block_size,
        "mamba_page_bytes": specs["model.layers.0.linear_attn"].real_page_size_bytes,
        "page_bytes": specs["model.layers.1.self_attn"].page_size_bytes,
        "mamba_page_padded": vc.cache_config.mamba_page_size_padded,
        "num_blocks": kv.num_blocks,
        "groups": [type(g.kv_cache_spec).__name__ for g in kv.kv_cache_groups],
        "scheduler_block_size": sched_bs,
        "hash_block_size": hash_bs,
        "attention_backend": B.__name__,
        "mamba_cache_mode": mode,
    }
    return vc, kv, sched_bs, hash_bs, info


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("trace")
    ap.add_argument("memory", type=int)
    ap.add_argument("--mode", default="align")
    ap.add_argument("--backend", choices=("flash", "cpu"), default="flash")
    args = ap.parse_args()
    logging.disable(logging.WARNING)

    z = np.load(args.trace)
    tokens, offsets, max_new = z["tokens"], z["offsets"], z["max_new"]
    prompts = [tokens[offsets[i] : offsets[i + 1]].tolist() for i in range(len(max_new))]
    max_model_len = max(len(p) + int(m) for p, m in zip(prompts, max_new, strict=True))

    from vllm.v1.outputs import ModelRunnerOutput

    with tempfile.TemporaryDirectory() as tmp:
        vc, kv, sched_bs, hash_bs, info = build(
            max_model_len, args.memory, args.mode, args.backend, Path(tmp)
        )
        sched, requests = scheduler_with_requests(vc, kv, sched_bs, hash_bs, prompts, max_new)

    steps = preempted = 0
    schedule_ns: list[int] = []
    update_ns: list[int] = []
    queries = hits = 0
    first_hit: dict[str, int] = {}
    clock = time.thread_time_ns
    wall0 = time.perf_counter()
    finished = 0
    while sched.has_unfinished_requests():
        t0 = clock()
        out = sched.schedule()
        t1 = clock()
        for nr in out.scheduled_new_reqs:
            first_hit.setdefault(nr.req_id, nr.num_computed_tokens)
        _, mro = fake_model_output(out, requests, ModelRunnerOutput, VOCAB)
        t2 = clock()
        eco = sched.update_from_output(out, mro)
        t3 = clock()
        schedule_ns.append(t1 - t0)
        update_ns.append(t3 - t2)
        steps += 1
        for outs in eco.values():
            if outs.scheduler_stats is not None:
                st = outs.scheduler_stats
                pcs = st.prefix_cache_stats
                if pcs is not None:
                    queries += pcs.queries
                    hits += pcs.hits
                    preempted += pcs.preempted_requests
            finished += sum(1 for o in outs.outputs if o.finish_reason is not None)
        if steps > 200_000:
            break
    wall = time.perf_counter() - wall0
    prompt_tokens = int(sum(len(p) for p in prompts))
    reused_first = int(sum(first_hit.values()))
    res = {
        "info": info,
        "steps": steps,
        "finished": finished,
        "requests": len(prompts),
        "prompt_tokens": prompt_tokens,
        "reused_first_admission": reused_first,
        "hit_rate": reused_first / prompt_tokens,
        "prefix_cache_queries": queries,
        "prefix_cache_hits": hits,
        "prefix_cache_hit_rate": hits / queries if queries else 0.0,
        "preempted": preempted,
        "num_preemptions": int(sum(r.num_preemptions for r in requests.values())),
        "schedule_ns": schedule_ns,
        "update_ns": update_ns,
        "wall_s": wall,
    }
    print("RESULT " + json.dumps(res))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
