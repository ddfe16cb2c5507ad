"""A small continuous-batching engine: a Hugging Face causal LM on kvcache blocks.

Optional: needs the ``torch`` extra (``pip install 'kvcache[torch]'``: torch and
transformers). The model code is untouched: the engine registers an attention function
(``"kvcache"``) in transformers' attention-function registry and switches the model to it
while it runs. That function writes each token's K/V into the token's block (position ->
block table -> pool memory) and computes attention with :func:`kvcache.torch.paged_attention`,
which reads K/V only through the block table; the model keeps no cache of its own.

Each step: :class:`kvcache.scheduler.CapacityScheduler` picks the batch (decodes, prefill
chunks, admissions; ``max_utilization`` pauses the newest requests when a step does not fit
and resumes them later with their prompt and generated tokens recomputed, minus whatever
prefix is still cached), :class:`kvcache.resource_manager.KVCacheResourceManager` gives it
blocks (registration with reuse lookup, onboarding of offloaded blocks, chunk and token
blocks, sliding-window releases), the model runs every token of the step as one packed
sequence, greedy sampling appends one token per request that finished its context or
decoded, and finished requests are removed (their blocks stored for reuse). A reused prefix
is never recomputed: a request's first chunk starts after it.

Example:
    >>> import torch
    >>> from kvcache import KvCacheConfig
    >>> from kvcache.engine import Engine, tiny_model
    >>> model = tiny_model("gemma3", seed=0)
    >>> engine = Engine(model, KvCacheConfig(tokens_per_block=4, backend="host"),
    ...                 max_seq_len=64, max_batch_size=2, memory="1MiB")
    >>> out = engine.generate([[1, 2, 3, 4, 5], [1, 2, 3, 9]], max_new_tokens=3)
    >>> [len(o) for o in out]
    [3, 3]
"""

from __future__ import annotations

import contextvars
import dataclasses
import importlib.util
import operator
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvcache._extras import missing_extra

try:
    import torch

    if importlib.util.find_spec("transformers") is None:  # imported where it is used
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
except ImportError as e:
    raise missing_extra("kvcache.engine", "torch", e) from None

from kvcache._core import OutOfBlocksError
from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.fields import is_int
from kvcache.cache.manager import KVCacheManager, KvCacheStats
from kvcache.cache.sizing import parse_size
from kvcache.reference.forks import ForkBooks, Forks
from kvcache.reference.torch import block_tables, layer_kv, paged_attention, write_kv
from kvcache.serving.resource_manager import (
    KVCacheResourceManager,
    Request,
    RequestState,
)
from kvcache.serving.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, CapacityScheduler

__all__ = [
    "ATTENTION_NAME",
    "TINY_FAMILIES",
    "Engine",
    "EngineStats",
    "GenerationResult",
    "model_windows",
    "tiny_config",
    "tiny_model",
]

#: Name under which the engine registers its attention function with transformers.
ATTENTION_NAME = "kvcache"
#: Model families :func:`tiny_model` builds.
TINY_FAMILIES: tuple[str, ...] = ("gemma3", "gemma2", "mistral", "gpt-oss")

_TORCH_DTYPE_NAMES = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}


# --------------------------------------------------------------------------------------
# Model configuration
# --------------------------------------------------------------------------------------


def _text_config(hf_config: Any) -> Any:
    get = getattr(hf_config, "get_text_config", None)
    return get() if callable(get) else hf_config


def model_windows(hf_config: Any) -> list[int | None]:
    """Attention window of every layer of a Hugging Face decoder config (``None``: full).

    Reads ``layer_types`` (``"sliding_attention"`` / ``"full_attention"``) with
    ``sliding_window`` when the config has them; else ``use_sliding_window`` and
    ``max_window_layers`` (Qwen-2 style: layers from ``max_window_layers`` on slide); else
    ``sliding_window`` alone (Mistral style: every layer slides); else full attention.

    Example:
        >>> from transformers import MistralConfig
        >>> model_windows(MistralConfig(num_hidden_layers=2, sliding_window=16))
        [16, 16]

    Raises:
        ValueError: A layer type the engine cannot serve (chunked attention, ...).
    """
    cfg = _text_config(hf_config)
    n = int(cfg.num_hidden_layers)
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        out: list[int | None] = []
        for kind in layer_types:
            if kind == "full_attention":
                out.append(None)
            elif kind == "sliding_attention":
                if not window:
                    raise ValueError("layer_types has sliding layers but sliding_window is unset")
                out.append(int(window))
            else:
                raise ValueError(f"unsupported layer type {kind!r} (full or sliding attention)")
        return out
    if not window or getattr(cfg, "use_sliding_window", True) is False:
        return [None] * n
    first = getattr(cfg, "max_window_layers", None)
    if first is not None and getattr(cfg, "use_sliding_window", None) is not None:
        return [int(window) if i >= int(first) else None for i in range(n)]
    return [int(window)] * n


def _model_config(hf_model: Any) -> ModelConfig:
    cfg = _text_config(hf_model.config)
    heads = int(cfg.num_attention_heads)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or int(cfg.hidden_size) // heads
    dtype = next(hf_model.parameters()).dtype
    if dtype not in _TORCH_DTYPE_NAMES:
        raise ValueError(f"model dtype {dtype} is not a KV cache dtype (float32/16, bfloat16)")
    return ModelConfig(
        num_layers=int(cfg.num_hidden_layers),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        dtype=_TORCH_DTYPE_NAMES[dtype],
    )


# --------------------------------------------------------------------------------------
# Tiny random-weight models (tests, `kvcache generate`; nothing is downloaded)
# --------------------------------------------------------------------------------------


def _alternating(n: int) -> list[str]:
    """Layer types of ``n`` layers: sliding, full, sliding, ... (Gemma-2, gpt-oss)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]


def tiny_config(
    family: str,
    *,
    num_layers: int | None = None,
    sliding_window: int = 16,
    vocab_size: int = 128,
    hidden_size: int = 64,
) -> Any:
    """A tiny Hugging Face config of a model family with sliding and full layers.

    ``gemma3``: 6 layers, 5 sliding : 1 full; ``gemma2``: 4 layers alternating, attention
    and final-logit soft-capping; ``mistral``: 3 layers, all sliding; ``gpt-oss``: 4 layers
    alternating, attention sinks, 4 experts. Eager attention, 4 query heads over 2 KV heads
    of dim 16 (GQA), fp32 when built by :func:`tiny_model`.

    Raises:
        ValueError: Unknown family (see :data:`TINY_FAMILIES`).
    """
    import transformers

    common: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "sliding_window": sliding_window,
        "attn_implementation": "eager",
        "tie_word_embeddings": True,
    }
    if family == "gemma3":
        n = num_layers or 6
        return transformers.Gemma3TextConfig(
            num_hidden_layers=n,
            layer_types=[
                "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)
            ],
            query_pre_attn_scalar=16,
            **common,
        )
    if family == "gemma2":
        n = num_layers or 4
        return transformers.Gemma2Config(
            num_hidden_layers=n,
            layer_types=_alternating(n),
            attn_logit_softcapping=5.0,
            final_logit_softcapping=30.0,
            query_pre_attn_scalar=16,
            **common,
        )
    if family == "mistral":
        return transformers.MistralConfig(num_hidden_layers=num_layers or 3, **common)
    if family == "gpt-oss":
        n = num_layers or 4
        return transformers.GptOssConfig(
            num_hidden_layers=n,
            layer_types=_alternating(n),
            num_local_experts=4,
            num_experts_per_tok=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            **common,
        )
    raise ValueError(f"unknown model family {family!r}; one of {', '.join(TINY_FAMILIES)}")


def tiny_model(family: str, *, seed: int = 0, **overrides: Any) -> Any:
    """A random-weight fp32 causal LM of :func:`tiny_config` (``torch.manual_seed(seed)``).

    gpt-oss's attention sinks are drawn too (its initializer leaves them at zero).
    """
    import transformers

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    auto: Any = transformers.AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.copy_(torch.randn_like(param))
    return model.eval()


# --------------------------------------------------------------------------------------
# The attention function
# --------------------------------------------------------------------------------------


@dataclass
class _Step:
    """What the attention function needs for the step that is running."""

    engine: Engine
    rows: torch.Tensor  # [T] row of each token in the block tables
    positions: torch.Tensor  # [T] position of each token in its sequence
    tables: list[torch.Tensor]  # per pool: [rows, width] block ids


_CURRENT: contextvars.ContextVar[_Step | None] = contextvars.ContextVar(
    "kvcache_step", default=None
)


def _kvcache_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [1, heads, T, dim] in, [1, T, heads, dim] out."""
    step = _CURRENT.get()
    if step is None:
        raise RuntimeError("the kvcache attention runs only inside kvcache.engine.Engine")
    if query.shape[0] != 1:
        raise RuntimeError("the kvcache attention expects one packed sequence per step")
    layer = int(module.layer_idx)
    engine = step.engine
    table = step.tables[engine._layer_pool[layer]]
    k_cache, v_cache = engine._kv[layer]
    write_kv(k_cache, v_cache, table, step.rows, step.positions, key[0].transpose(0, 1),
             value[0].transpose(0, 1))  # fmt: skip
    if scaling is None:
        scaling = float(getattr(module, "scaling", query.shape[-1] ** -0.5))
    out = paged_attention(
        query[0].transpose(0, 1),
        k_cache,
        v_cache,
        table,
        step.rows,
        step.positions,
        scale=scaling,
        window=sliding_window,
        sinks=s_aux,
        softcap=softcap,
    )
    return out[None], None


def _register_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _kvcache_attention)


# --------------------------------------------------------------------------------------
# Engine
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineStats:
    """Counters of an :class:`Engine` since it was built.

    Attributes:
        steps: Model forward passes.
        requests: Requests finished.
        prompt_tokens: Context tokens registered (prompt, plus generated tokens of resumed
            requests), each registration counted.
        reused_tokens: Of those, tokens found in the cache (never computed).
        computed_tokens: Tokens run through the model (prefill chunks and decode tokens).
        generated_tokens: Tokens sampled.
        preemptions: Times a running request was paused (freed, recomputed later).
        peak_used_blocks: Most primary blocks in use at once, per window.
        num_blocks: Primary blocks per window.
        seconds: Wall time spent in :meth:`Engine.generate`.
        cache: The manager's counters (:class:`kvcache.KvCacheStats`).
    """

    steps: int
    requests: int
    prompt_tokens: int
    reused_tokens: int
    computed_tokens: int
    generated_tokens: int
    preemptions: int
    peak_used_blocks: dict[int, int]
    num_blocks: dict[int, int]
    seconds: float
    cache: KvCacheStats

    @property
    def token_hit_rate(self) -> float:
        """reused / prompt tokens (0.0 before any request)."""
        return self.reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True)
class GenerationResult:
    """Output of :meth:`Engine.generate_detailed`, in prompt order.

    Attributes:
        tokens: Generated token ids per prompt (beam search: the best beam; ``n > 1``: the
            first sample).
        last_logits: Per prompt, the logits (``[vocab]``, fp32, CPU) that chose its last token
            (greedy only; empty for beam search and ``n > 1``).
        sequences: Per prompt, every output: the ``num_beams`` finished beams best first, the
            ``n`` samples in order, or the greedy output alone.
        scores: Per prompt, the score of each of ``sequences``: a beam's
            ``sum of log-probabilities / length ** length_penalty`` (Hugging Face's
            ``sequences_scores``), a sample's summed log-probability (of the temperature-scaled
            distribution it was drawn from); empty for greedy.
    """

    tokens: list[list[int]]
    last_logits: list[torch.Tensor] = field(default_factory=list)
    sequences: list[list[list[int]]] = field(default_factory=list)
    scores: list[list[float]] = field(default_factory=list)


class Engine:
    """Greedy continuous-batching generation of a Hugging Face causal LM on kvcache.

    Args:
        hf_model: A ``transformers`` causal LM (decoder layers with ``layer_idx``; any mix
            of full and sliding attention described by its config, see
            :func:`model_windows`). Its device chooses the backend: CPU -> ``host``, CUDA ->
            ``cuda``.
        kv_config: Cache configuration. Its ``max_attention_window`` must be ``None`` (the
            engine reads the windows from the model config) or equal to them; its
            ``backend`` must be ``"auto"`` or the one the model's device needs.
        max_seq_len: Longest sequence (prompt plus generated tokens).
        max_batch_size: Most requests registered at once.
        memory: Primary KV budget in bytes or as a size string (``"64MiB"``); ``None``:
            the manager's default (free memory times ``free_gpu_memory_fraction``).
        blocks_per_window: Exact block counts per window (window -> primary, or (primary,
            secondary)) instead of a budget (tests, small pools).
        policy: Scheduler policy, ``"max_utilization"`` (pauses and recomputes when a step
            does not fit) or ``"guaranteed_no_evict"``.
        max_num_batched_tokens: Tokens per step (``None``: unlimited).
        max_chunk_size: Most tokens of one prefill chunk (``None``: the step budget).
        chunked_prefill: ``False`` prefills every prompt whole in one step.

    Raises:
        ValueError: Bad arguments, a window mismatch, an unsupported model or dtype.
    """

    def __init__(
        self,
        hf_model: Any,
        kv_config: KvCacheConfig,
        *,
        max_seq_len: int,
        max_batch_size: int,
        memory: int | str | None = None,
        blocks_per_window: Mapping[int, int | tuple[int, int]] | None = None,
        policy: str = "max_utilization",
        max_num_batched_tokens: int | None = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        max_chunk_size: int | None = None,
        chunked_prefill: bool = True,
    ) -> None:
        if not isinstance(kv_config, KvCacheConfig):
            raise TypeError(f"kv_config must be a KvCacheConfig, got {type(kv_config).__name__}")
        if memory is not None and blocks_per_window is not None:
            raise ValueError("pass memory or blocks_per_window, not both")
        model_cfg = _model_config(hf_model)
        windows = model_windows(hf_model.config)
        if kv_config.max_attention_window is not None:
            given = [None if w is None or w <= 0 or w >= max_seq_len else w
                     for w in kv_config.max_attention_window]  # fmt: skip
            wanted = [None if w is None or w >= max_seq_len else w for w in windows]
            repeated = [given[i % len(given)] for i in range(len(windows))]
            if repeated != wanted:
                raise ValueError(
                    f"kv_config.max_attention_window {kv_config.max_attention_window} differs "
                    f"from the model's windows {windows}; leave it None"
                )
        device = next(hf_model.parameters()).device
        backend = "cuda" if device.type == "cuda" else "host"
        if device.type not in ("cpu", "cuda"):
            raise ValueError(f"the model is on {device}; the engine serves CPU or CUDA models")
        if kv_config.backend not in ("auto", backend):
            raise ValueError(
                f"kv_config.backend is {kv_config.backend!r} but the model on {device} needs "
                f"{backend!r} (or 'auto')"
            )
        config = dataclasses.replace(kv_config, max_attention_window=windows, backend=backend)
        if blocks_per_window is not None:
            manager = KVCacheManager.from_blocks(
                model_cfg,
                config,
                blocks_per_window,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
            )
        else:
            manager = KVCacheManager(
                model_cfg,
                config,
                max_seq_len=max_seq_len,
                max_batch_size=max_batch_size,
                primary_bytes=None if memory is None else parse_size(memory),
            )
        self._model = hf_model
        self._device = device
        self._manager = manager
        self._rm = KVCacheResourceManager(manager)
        self._scheduler = CapacityScheduler(
            self._rm,
            policy,
            max_num_batched_tokens=max_num_batched_tokens,
            max_chunk_size=max_chunk_size,
            chunked_prefill=chunked_prefill,
        )
        self._vocab = int(_text_config(hf_model.config).vocab_size)
        self._layer_pool = [p for p, _ in manager.layer_to_pool]
        self._kv = [layer_kv(manager, layer) for layer in range(model_cfg.num_layers)]
        self._next_id = 0
        self._windows = list(manager.window_sizes)
        self._primary = {w: int(v[0]) for w, v in manager.blocks_per_window.items()}
        self._counters = dict.fromkeys(
            ("steps", "requests", "prompt_tokens", "reused_tokens", "computed_tokens",
             "generated_tokens", "preemptions"), 0)  # fmt: skip
        self._peak = dict.fromkeys(self._windows, 0)
        self._seconds = 0.0
        _register_attention()

    @property
    def manager(self) -> KVCacheManager:
        """The KV cache manager."""
        return self._manager

    @property
    def resource_manager(self) -> KVCacheResourceManager:
        """The resource manager the step loop drives."""
        return self._rm

    @property
    def scheduler(self) -> CapacityScheduler:
        """The scheduler that picks each step's batch."""
        return self._scheduler

    def generate(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> list[list[int]]:
        """Generation of up to ``max_new_tokens`` tokens per prompt, outputs in prompt order.

        ``num_beams=1``: greedy, exactly ``max_new_tokens`` tokens (no EOS stop). ``num_beams
        = k > 1``: beam search with Hugging Face ``generate``'s rules (``do_sample=False``,
        the model's ``generation_config.eos_token_id`` ends a beam, ``length_penalty``,
        ``early_stopping`` ``True`` / ``False`` / ``"never"``); returns each prompt's best
        beam (which may end early with an EOS). The beams are forks of the prompt's sequence
        (``fork_resources``): they share its blocks, reorder each step by forking and freeing
        sequences, and step together in one ``add_tokens`` call.

        Every prompt is checked before anything runs: tokens must be ints (a float, a
        string or a bool is refused, not converted) in ``[0, vocab)``.

        Raises:
            ValueError: An empty prompt, a token that is not an int or lies outside the
                vocabulary, a sequence longer than ``max_seq_len``, ``max_new_tokens`` below 1
                or above ``max_seq_len``, a request that can never fit the pools, a bad
                ``num_beams`` / ``length_penalty`` / ``early_stopping``.
        """
        return self.generate_detailed(
            prompts,
            max_new_tokens,
            num_beams=num_beams,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
        ).tokens

    def generate_detailed(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        n: int = 1,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
    ) -> GenerationResult:
        """:meth:`generate` with every output and score (:class:`GenerationResult`).

        ``n = k > 1``: parallel sampling instead: ``k`` sequences per prompt drawn from
        ``softmax(logits / temperature)`` with ``torch.multinomial(generator=generator)``
        (seed the generator for repeatable samples), each exactly ``max_new_tokens`` long.
        The prompt is prefilled once; its sequence is forked into the ``k`` samples after
        its first token, so they share the prompt's blocks. Greedy (both 1) also returns the
        logits that chose each request's last token.

        Raises:
            ValueError: As :meth:`generate`; ``n`` below 1, ``n`` and ``num_beams`` both above
                1, ``temperature`` not positive.
        """
        self._check_fork_args(num_beams, n, length_penalty, early_stopping, temperature)
        requests = self._requests(prompts, max_new_tokens, num_beams=num_beams, n=n)
        if num_beams > 1 or n > 1:
            eos = self._model.generation_config.eos_token_id
            eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            books = ForkBooks(self._rm, self._counters, self._new_id)
            forks = Forks(books, requests, num_beams=num_beams, n=n, eos=eos_ids,
                           length_penalty=length_penalty, early_stopping=early_stopping,
                           generator=generator, temperature=temperature)  # fmt: skip
            return self._run_forks(forks)
        logits: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        active = list(requests)
        try:
            with torch.inference_mode():
                while active:
                    self._step(active, logits)  # frees the requests that finished
                    active = [r for r in active if r.state is not RequestState.FINISHED]
        finally:
            for r in active:  # an error left these registered: release them
                if self._rm.has_request(r):
                    self._rm.free_resources(r, store_for_reuse=False)
            self._seconds += time.perf_counter() - start
        return GenerationResult(
            tokens=[list(r.generated) for r in requests],
            last_logits=[logits[r.request_id] for r in requests],
            sequences=[[list(r.generated)] for r in requests],
            scores=[[] for _ in requests],
        )

    def _run_forks(self, forks: Forks) -> GenerationResult:
        start = time.perf_counter()
        try:
            with torch.inference_mode():
                while forks.active:
                    self._step(forks.runnable(), {}, forks)
        finally:
            forks.release()
            self._seconds += time.perf_counter() - start
        seqs, scores = forks.result()
        return GenerationResult(tokens=[s[0] for s in seqs], sequences=seqs, scores=scores)

    def _new_id(self) -> int:
        """A request id no request of this engine had."""
        self._next_id += 1
        return self._next_id - 1

    @staticmethod
    def _check_fork_args(
        num_beams: int, n: int, length_penalty: float, early_stopping: bool | str,
        temperature: float,
    ) -> None:  # fmt: skip
        for name, value in (("num_beams", num_beams), ("n", n)):
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if num_beams > 1 and n > 1:
            raise ValueError(f"num_beams ({num_beams}) and n ({n}) cannot both exceed 1")
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
            raise ValueError(f"length_penalty must be a float, got {length_penalty!r}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise ValueError(
                f"early_stopping must be True, False or 'never', got {early_stopping!r}"
            )
        if not isinstance(temperature, (int, float)) or not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature!r}")

    def stats(self) -> EngineStats:
        """Engine counters and the manager's (reuse, offload, occupancy)."""
        c = self._counters
        return EngineStats(
            steps=c["steps"],
            requests=c["requests"],
            prompt_tokens=c["prompt_tokens"],
            reused_tokens=c["reused_tokens"],
            computed_tokens=c["computed_tokens"],
            generated_tokens=c["generated_tokens"],
            preemptions=c["preemptions"],
            peak_used_blocks=dict(self._peak),
            num_blocks=dict(self._primary),
            seconds=self._seconds,
            cache=self._manager.get_kv_cache_stats(),
        )

    # ------------------------------------------------------------------ internals

    def _requests(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        num_beams: int = 1,
        n: int = 1,
    ) -> list[Request]:
        """The requests of one ``generate`` call, every input checked before any runs."""
        if not is_int(max_new_tokens):
            raise ValueError(f"max_new_tokens must be an int, got {max_new_tokens!r}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        limit = self._manager.max_seq_len
        if max_new_tokens > limit:
            raise ValueError(
                f"max_new_tokens = {max_new_tokens} exceeds max_seq_len={limit}: no prompt "
                "fits; give fewer new tokens or a larger max_seq_len"
            )
        if isinstance(prompts, (str, bytes)):
            raise ValueError("prompts must be a list of token-id lists, got text")
        out = []
        for i, prompt in enumerate(prompts):
            tokens = self._tokens(i, prompt)
            if len(tokens) + max_new_tokens - 1 > limit:
                raise ValueError(
                    f"prompt {i}: {len(tokens)} tokens + {max_new_tokens} new exceed "
                    f"max_seq_len={limit}"
                )
            r = Request(self._next_id + i, tokens, max_new_tokens, num_beams=num_beams, n=n)
            if r.num_sequences > self._manager.max_batch_size:
                raise ValueError(
                    f"{r.num_sequences} beams or samples exceed max_batch_size="
                    f"{self._manager.max_batch_size}: each is a sequence of its own"
                )
            need = self._scheduler.blocks_to_run_alone(r)  # its beams included
            if self._scheduler.never_fits(r):
                pools = ", ".join(f"window {w}: {self._primary[w]}" for w in self._windows)
                wants = ", ".join(f"window {w}: {n}" for w, n in need.items())
                beams = f" with {r.num_sequences} beams" if r.num_sequences > 1 else ""
                raise ValueError(
                    f"prompt {i}: {len(tokens)} tokens + {max_new_tokens} new{beams} can never "
                    f"fit the KV pools (blocks: {pools}; it needs {wants}); give more memory or "
                    f"fewer new tokens{' or beams' if beams else ''}"
                )
            out.append(r)
        self._next_id += len(out)
        return out

    def _tokens(self, i: int, prompt: Sequence[int]) -> list[int]:
        """Prompt ``i`` as ints in ``[0, vocab)``: a float, a string or a bool is refused, not
        converted."""
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__len__"):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(prompt).__name__}")
        tokens: list[int] = []
        for j, t in enumerate(prompt):
            if isinstance(t, bool) or not hasattr(t, "__index__"):
                raise ValueError(
                    f"prompt {i}: token {j} must be an int, got {type(t).__name__} {t!r}"
                )
            tokens.append(operator.index(t))
        if not tokens:
            raise ValueError(f"prompt {i} is empty")
        bad = next((t for t in tokens if not 0 <= t < self._vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt {i}: token {bad} is outside the vocabulary [0, {self._vocab})"
            )
        return tokens

    def _step(
        self,
        active: list[Request],
        logits: dict[int, torch.Tensor],
        forks: Forks | None = None,
    ) -> None:
        out = self._scheduler.schedule(active)
        if out.rejected:
            r = out.rejected[0]
            raise RuntimeError(
                f"request {r.request_id} ({r.context_len} tokens) can never fit the KV pools"
            )
        self._counters["preemptions"] += len(out.paused)
        if forks is not None and out.paused:
            forks.paused(out.paused)
        batch = out.batch
        if len(batch) == 0:
            if out.paused:
                return  # the scheduler paused whole beam families: the next step resumes them
            raise RuntimeError("no request can run: the KV pools are too small for any of them")
        new = [r for r, _ in batch.context if not self._rm.has_request(r)]
        try:
            self._rm.prepare_resources(batch)
        except OutOfBlocksError as e:  # the scheduler's estimates should prevent this
            raise RuntimeError(f"scheduled step did not fit the KV pools: {e}") from e
        for r in new:
            self._counters["prompt_tokens"] += r.context_len
            self._counters["reused_tokens"] += r.context_position
        for w in self._windows:
            used = self._manager.get_num_used_blocks(w)
            self._peak[w] = max(self._peak[w], used)

        ids: list[int] = []
        tokens: list[int] = []
        rows: list[int] = []
        positions: list[int] = []
        sample: list[tuple[Request, int]] = []  # (request, index of its last token)
        for r, chunk in batch.context:
            start = r.context_position
            ctx = r.context_tokens()[start : start + chunk]
            rows += [len(ids)] * chunk
            positions += range(start, start + chunk)
            tokens += ctx
            ids.append(r.request_id)
            if batch.is_last_chunk(r):
                sample.append((r, len(tokens) - 1))
        for r, drafts in batch.generation:
            if drafts:
                raise RuntimeError("the engine does not verify draft tokens")
            rows.append(len(ids))
            positions.append(r.num_tokens - 1)
            tokens.append(r.generated[-1])
            ids.append(r.request_id)
            sample.append((r, len(tokens) - 1))
        ends: dict[int, int] = {}
        for row, pos in zip(rows, positions, strict=True):
            ends[row] = pos + 1
        for row, rid in enumerate(ids):
            if self._manager.num_tokens(rid) != ends[row]:
                raise RuntimeError(
                    f"request {rid}: the cache holds {self._manager.num_tokens(rid)} tokens, "
                    f"the step computes up to {ends[row]}"
                )

        dev = self._device
        step = _Step(
            engine=self,
            rows=torch.tensor(rows, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            tables=block_tables(self._manager, ids, device=dev),
        )
        keep = torch.tensor([i for _, i in sample], dtype=torch.long, device=dev)
        config = self._model.config
        previous = config._attn_implementation
        token = _CURRENT.set(step)
        try:
            config._attn_implementation = ATTENTION_NAME
            output = self._model(
                input_ids=torch.tensor([tokens], dtype=torch.long, device=dev),
                position_ids=step.positions[None],
                use_cache=False,
                logits_to_keep=keep,
            )
        finally:
            config._attn_implementation = previous
            _CURRENT.reset(token)
        step_logits = output.logits[0].float()
        if forks is None:
            # The step's output in one call: one token per batch entry (-1: a chunk that did
            # not end its prompt), the finished requests freed.
            chosen = iter(step_logits.argmax(dim=-1).tolist())
            for (r, _), row_logits in zip(sample, step_logits, strict=True):
                logits[r.request_id] = row_logits.cpu()
            picked = [next(chosen) if batch.is_last_chunk(r) else -1 for r, _ in batch.context]
            picked += [next(chosen) for _ in batch.generation]
            done = self._rm.complete_step(batch, picked)
            self._counters["requests"] += len(done)
        else:
            after = forks.choose([r for r, _ in sample], step_logits.cpu())
            self._rm.update_resources(batch)
            for action in after:  # forks and frees, once the step's tokens are recorded
                action()
        # Once per step: expired priorities, and (lend_free_memory) memory moved between steps.
        self._manager.refresh_blocks()
        self._counters["steps"] += 1
        self._counters["computed_tokens"] += len(tokens)
        if forks is None:
            self._counters["generated_tokens"] += len(sample)
