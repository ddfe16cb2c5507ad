"""Runs vLLM (CPU build, in process) on a tiny model with its own or kvcache's KV manager.

Shared by the token-identity tests (``tests/vllm``) and the benchmark
(``bench/bench_vllm.py``): the same prompts, memory and sampling through vanilla vLLM and
through vLLM with ``kvcache.vllm.Scheduler``, counting what vLLM's own stats report.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core in this process
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

from tiny_models import VOCAB, save_tiny_model

BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32


@dataclass
class Probe:
    """What one engine did: vLLM's prefix-cache stats summed, steps and their times."""

    queries: int = 0
    hits: int = 0
    requests: int = 0
    preempted_requests: int = 0
    preempted_hits: int = 0
    resets: int = 0
    lookups: list[tuple[str, int, int]] = field(default_factory=list)
    trace: list[list[tuple[str, int]]] = field(default_factory=list)
    schedule_s: list[float] = field(default_factory=list)
    update_s: list[float] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        """vLLM's prefix cache hit rate over new requests (``hits / queries``)."""
        return self.hits / self.queries if self.queries else 0.0


def probing(base: type) -> type:
    """A subclass of scheduler class ``base`` that records a :class:`Probe`."""

    class Probed(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.probe = Probe()
            manager = self.kv_cache_manager
            record = manager.record_prefix_cache_stats

            def recorded(request: Any, num_hits: int) -> None:
                self.probe.lookups.append((request.request_id, request.num_tokens, num_hits))
                record(request, num_hits)

            manager.record_prefix_cache_stats = recorded

        def schedule(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = super().schedule(*args, **kwargs)
            self.probe.schedule_s.append(time.perf_counter() - t)
            if os.environ.get("KVCACHE_TEST_TRACE"):
                self.probe.trace.append(
                    sorted((r.split("-")[0], n) for r, n in out.num_scheduled_tokens.items())
                )
            return out

        def update_from_output(self, *args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            out = super().update_from_output(*args, **kwargs)
            self.probe.update_s.append(time.perf_counter() - t)
            return out

        def make_stats(self, *args: Any, **kwargs: Any) -> Any:
            stats = super().make_stats(*args, **kwargs)
            p = stats.prefix_cache_stats if stats is not None else None
            if p is not None:
                self.probe.queries += p.queries
                self.probe.hits += p.hits
                self.probe.requests += p.requests
                self.probe.preempted_requests += p.preempted_requests
                self.probe.preempted_hits += p.preempted_hits
                self.probe.resets += int(p.reset)
            return stats

    Probed.__name__ = f"Probed{base.__name__}"
    return Probed


def scheduler_for(which: str) -> type:
    """The probed scheduler class: ``"vllm"`` (vanilla) or ``"kvcache"``."""
    if which == "vllm":
        from vllm.v1.core.sched.scheduler import Scheduler
    elif which == "kvcache":
        from kvcache.vllm import Scheduler
    else:
        raise ValueError(which)
    return probing(Scheduler)


def shared_prefix_prompts(
    seed: int,
    n: int,
    *,
    prefixes: int = 2,
    prefix_len: int = 150,
    suffix: tuple[int, int] = (5, 90),
) -> list[list[int]]:
    """``n`` token prompts, each one of ``prefixes`` shared prefixes plus its own suffix."""
    rng = random.Random(seed)
    heads = [[rng.randrange(3, VOCAB) for _ in range(prefix_len)] for _ in range(prefixes)]
    return [
        heads[i % prefixes] + [rng.randrange(3, VOCAB) for _ in range(rng.randrange(*suffix))]
        for i in range(n)
    ]


def engine(kind: str, which: str, root: Path, **llm_kwargs: Any) -> Any:
    """A vLLM ``LLM`` on the tiny model ``kind`` with the ``which`` scheduler."""
    from vllm import LLM

    model = save_tiny_model(kind, root / f"tiny-{kind}")
    kwargs: dict[str, Any] = {
        "skip_tokenizer_init": True,
        "enforce_eager": True,
        "dtype": "float32",
        "block_size": BLOCK_SIZE,
        "max_model_len": 1024,
        "seed": 0,
        "disable_log_stats": False,
        "enable_prefix_caching": True,
        "scheduler_cls": scheduler_for(which),
    }
    kwargs.update(llm_kwargs)
    return LLM(model=str(model), **kwargs)


def scheduler_of(llm: Any) -> Any:
    """The engine core's scheduler (in-process engine)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def generate(llm: Any, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    """Greedy tokens for every prompt, in prompt order."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, detokenize=False, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def run_in_process(
    kind: str,
    which: str,
    root: Path | str,
    waves: list[list[list[int]]],
    *,
    max_tokens: int = 24,
    reset_between: bool = False,
    **llm_kwargs: Any,
) -> Any:
    """Runs ``run_engine.py`` (one engine, its own process) and returns what it reported.

    Raises:
        RuntimeError: The engine reported nothing (the message holds its stderr's end).
    """
    here = Path(__file__).parent
    spec = {
        "kind": kind,
        "which": which,
        "root": str(root),
        "waves": waves,
        "max_tokens": max_tokens,
        "reset_between": reset_between,
        "llm": llm_kwargs,
    }
    p = subprocess.run(
        [sys.executable, str(here / "run_engine.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        cwd=here,
        timeout=900,
        check=False,
    )
    lines = [line for line in p.stdout.splitlines() if line.startswith("RESULT ")]
    if not lines:
        raise RuntimeError(p.stderr[-4000:])
    return json.loads(lines[-1][len("RESULT ") :])
