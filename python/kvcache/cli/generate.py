"""``kvcache generate``: greedy generation with a Hugging Face model on kvcache blocks.

The model is a tiny random-weight model of a named family (nothing is downloaded) or a local
model directory; the prompts are a built-in set (a shared system prompt plus a random user
part each, seeded) or a JSON Lines file of token-id lists. Prints tokens/s, the reuse it got
and the peak occupancy of every window. Needs the ``torch`` extra; this module imports torch
only when the command runs, so ``--help`` works without it.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path
from typing import Any

_FAMILIES = ("gemma3", "gemma2", "mistral", "gpt-oss")


#: kvcache.scheduler.POLICIES (not imported: --help stays light).
SCHEDULER_POLICIES = ("guaranteed_no_evict", "max_utilization")


def add_scheduler_option(p: argparse.ArgumentParser) -> None:
    """``--scheduler POLICY`` (``simulate`` and ``generate``), with ``--policy`` as a hidden
    alias: ``generate`` called it that before, and such command lines keep working."""
    p.add_argument(
        "--scheduler",
        choices=SCHEDULER_POLICIES,
        default="max_utilization",
        help="the scheduler's policy, CapacityScheduler(policy=...): guaranteed_no_evict "
        "admits a request only if it can run to its end; max_utilization admits what can "
        "prefill and pauses the newest requests when a step does not fit "
        "(default: max_utilization)",
    )
    p.add_argument(
        "--policy",
        choices=SCHEDULER_POLICIES,
        dest="scheduler",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )


def add_arguments(p: argparse.ArgumentParser, size: Any, positive: Any) -> None:
    """The command's options (``size`` and ``positive`` are the CLI's argparse types)."""
    p.add_argument(
        "--model",
        default="gemma3",
        metavar="NAME|DIR",
        help=f"tiny random-weight model of a family ({', '.join(_FAMILIES)}) or a local "
        "Hugging Face model directory (default: gemma3)",
    )
    p.add_argument(
        "--prompts",
        default=None,
        metavar="FILE",
        help="JSON Lines file, one list of token ids per line (default: the built-in set)",
    )
    p.add_argument(
        "--num-prompts", type=positive, default=32, help="built-in prompts (default: 32)"
    )
    p.add_argument(
        "--system-prompt-len",
        type=int,
        default=64,
        help="tokens of the system prompt every built-in prompt starts with (default: 64)",
    )
    p.add_argument(
        "--prompt-len",
        type=positive,
        default=32,
        help="most tokens of a built-in prompt's own part, at least 1 (default: 32)",
    )
    p.add_argument(
        "--max-new-tokens", type=positive, default=32, help="tokens per prompt (default: 32)"
    )
    p.add_argument(
        "--memory", type=size, default="16MiB", help="primary KV budget (default: 16MiB)"
    )
    p.add_argument(
        "--host-cache", type=size, default=None, metavar="SIZE", help="host offload memory"
    )
    p.add_argument("--tokens-per-block", type=positive, default=16, help="(default: 16)")
    p.add_argument("--max-batch-size", type=positive, default=8, help="(default: 8)")
    p.add_argument("--max-chunk-size", type=positive, default=None, help="largest prefill chunk")
    p.add_argument(
        "--sliding-window",
        type=positive,
        default=32,
        help="sliding window of a tiny model, in tokens (default: 32)",
    )
    add_scheduler_option(p)
    p.add_argument(
        "--swa-reuse-policy",
        choices=["invalidate", "placeholder"],
        default="placeholder",
        help="(default: placeholder)",
    )
    p.add_argument("--no-reuse", action="store_true", help="disable block reuse")
    p.add_argument("--device", default="cpu", help="torch device of the model (default: cpu)")
    p.add_argument(
        "--threads",
        type=positive,
        default=1,
        help="torch CPU threads (default: 1: a tiny model's steps are too small to split)",
    )
    p.add_argument("--seed", type=int, default=0, help="weights and prompts seed (default: 0)")
    p.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")


def _load_prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    if args.prompts is not None:
        prompts = []
        text = Path(args.prompts).read_text(encoding="utf-8")
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                tokens = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{args.prompts}:{n}: not JSON: {e.msg}") from None
            if (
                not isinstance(tokens, list)
                or not tokens
                or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)
            ):
                raise ValueError(f"{args.prompts}:{n}: expected a non-empty list of token ids")
            prompts.append(tokens)
        if not prompts:
            raise ValueError(f"{args.prompts}: no prompts")
        return prompts
    rng = random.Random(args.seed)
    system = [rng.randrange(vocab) for _ in range(args.system_prompt_len)]
    return [
        system + [rng.randrange(vocab) for _ in range(rng.randint(1, args.prompt_len))]
        for _ in range(args.num_prompts)
    ]


def _check_device(torch: Any, device: str) -> None:
    """ValueError unless ``device`` names a device this torch can use: a CPU, or a CUDA device
    with a CUDA build and a visible GPU."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        raise ValueError(f"--device {device!r} is not a torch device; use cpu or cuda") from None
    if dev.type == "cpu":
        return
    if dev.type != "cuda":
        raise ValueError(
            f"--device {device!r}: the engine serves CPU or CUDA models; use cpu or cuda"
        )
    if torch.version.cuda is None:
        raise ValueError(
            f"--device {device}: this torch ({torch.__version__}) is built without CUDA; use "
            "--device cpu, or install a CUDA build of torch"
        )
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: no CUDA device is visible; use --device cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ValueError(
            f"--device {device}: only {count} CUDA device(s) are visible (cuda:0..cuda:{count - 1})"
        )


def run_cli(args: argparse.Namespace) -> int:
    """Runs ``kvcache generate`` and prints its report; returns the exit status."""
    try:
        import torch

        from kvcache.reference.engine import Engine, tiny_config, tiny_model
    except ImportError as e:
        raise ValueError(
            "kvcache generate needs torch and transformers: pip install 'kvcache[torch]' "
            f"(in a source checkout: pip install '.[torch]'); {e}"
        ) from None
    from kvcache.cache.config import KvCacheConfig

    _check_device(torch, args.device)
    if args.system_prompt_len < 0:
        raise ValueError(f"--system-prompt-len must be >= 0, got {args.system_prompt_len}")

    # Everything is checked against the model's config before any weights are built.
    if args.model in _FAMILIES:
        hf_config = tiny_config(args.model, sliding_window=args.sliding_window)
        name = f"{args.model} (tiny, random weights)"
    else:
        path = Path(args.model)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--model {args.model!r} is neither a family ({', '.join(_FAMILIES)}) nor a "
                "local model directory with a config.json"
            )
        from transformers import AutoConfig

        auto_config: Any = AutoConfig
        hf_config = auto_config.from_pretrained(path, local_files_only=True)
        name = str(path)
    text_config = hf_config.get_text_config()
    vocab = int(text_config.vocab_size)
    prompts = _load_prompts(args, vocab)
    longest = max(len(p) for p in prompts)
    max_seq_len = longest + args.max_new_tokens
    context = getattr(text_config, "max_position_embeddings", None)
    if isinstance(context, int) and max_seq_len - 1 > context:
        raise ValueError(
            f"--max-new-tokens {args.max_new_tokens:,} after prompts of up to {longest:,} "
            f"tokens exceeds the model's context of {context:,} positions; give "
            f"--max-new-tokens {max(1, context - longest + 1):,} or less"
        )
    if args.model in _FAMILIES:
        model = tiny_model(args.model, seed=args.seed, sliding_window=args.sliding_window)
    else:
        from transformers import AutoModelForCausalLM

        auto: Any = AutoModelForCausalLM
        model = auto.from_pretrained(
            path, local_files_only=True, attn_implementation="eager"
        ).eval()
    torch.set_num_threads(args.threads)
    model = model.to(args.device)
    config = KvCacheConfig(
        tokens_per_block=args.tokens_per_block,
        enable_block_reuse=not args.no_reuse,
        swa_reuse_policy=args.swa_reuse_policy,
        host_cache_size=args.host_cache or 0,
    )
    engine = Engine(
        model,
        config,
        max_seq_len=max_seq_len,
        max_batch_size=args.max_batch_size,
        memory=args.memory,
        policy=args.scheduler,
        max_chunk_size=args.max_chunk_size,
    )
    torch.manual_seed(args.seed)
    engine.generate(prompts, args.max_new_tokens)
    s = engine.stats()
    c = s.cache
    secs = max(s.seconds, 1e-9)
    windows = engine.manager.window_sizes
    pattern = [w or "full" for w in engine.manager.config.max_attention_window or []]
    print(f"model {name}: {len(pattern)} layers, windows {pattern}, max_seq_len {max_seq_len}")
    print(
        f"{s.requests} requests, {s.prompt_tokens:,} prompt tokens, {s.generated_tokens:,} "
        f"generated in {secs:.2f} s ({s.steps} steps): {s.generated_tokens / secs:,.1f} "
        f"generated tok/s, {(s.computed_tokens + s.reused_tokens) / secs:,.1f} tok/s "
        "(prompt + generated)"
    )
    per_window = ", ".join(
        f"window {w}: {c.cache_hit_rate_per_window_size.get(w, 0.0):.1%}" for w in windows
    )
    print(
        f"reuse: {s.reused_tokens:,} of {s.prompt_tokens:,} prompt tokens "
        f"({s.token_hit_rate:.1%}) not computed; block hit rate "
        f"{c.cache_hit_rate:.1%} ({per_window})"
    )
    occupancy = ", ".join(
        f"window {w}: {s.peak_used_blocks[w]}/{s.num_blocks[w]} "
        f"({s.peak_used_blocks[w] / max(1, s.num_blocks[w]):.0%})"
        for w in windows
    )
    print(f"peak occupancy (used / primary blocks): {occupancy}")
    print(
        f"preemptions {s.preemptions}, offloaded {c.offloaded_blocks} blocks, onboarded "
        f"{c.onboarded_blocks} blocks"
    )
    if args.json:
        report = {
            "model": name,
            "requests": s.requests,
            "prompt_tokens": s.prompt_tokens,
            "reused_tokens": s.reused_tokens,
            "computed_tokens": s.computed_tokens,
            "generated_tokens": s.generated_tokens,
            "steps": s.steps,
            "seconds": s.seconds,
            "generated_tokens_per_s": s.generated_tokens / secs,
            "token_hit_rate": s.token_hit_rate,
            "block_hit_rate": c.cache_hit_rate,
            "block_hit_rate_per_window": {str(w): v for w, v in
                                          c.cache_hit_rate_per_window_size.items()},
            "peak_used_blocks": {str(w): v for w, v in s.peak_used_blocks.items()},
            "num_blocks": {str(w): v for w, v in s.num_blocks.items()},
            "preemptions": s.preemptions,
            "offloaded_blocks": c.offloaded_blocks,
            "onboarded_blocks": c.onboarded_blocks,
        }  # fmt: skip
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
