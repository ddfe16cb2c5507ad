"""Built-in model presets: the KV cache shape of well-known (mostly VSWA) models.

Each preset is a JSON data file next to this module (shipped in the wheel) holding the
model's attention shape, its window pattern and its maximum context, taken from the
model's published Hugging Face ``config.json``. Hybrid models (Qwen3.5, Qwen3-Next,
Nemotron 3, Granite 4.0-H, Falcon-H1, Jamba) also declare their recurrent layers and the
state tensors of one of them (``ModelConfig.recurrent_layers`` / ``recurrent_state``) and,
like Hugging Face's ``layer_types``, where those layers sit (``ModelPreset.layer_types``).

Example:
    >>> from kvcache.models import list_models, load_model
    >>> "gemma-3-27b" in list_models()
    True
    >>> p = load_model("gemma-3-27b")
    >>> p.model.num_layers, p.max_attention_window, p.max_context
    (62, (1024, 1024, 1024, 1024, 1024, None), 131072)
    >>> p.kv_cache_config(tokens_per_block=64).max_attention_window
    (1024, 1024, 1024, 1024, 1024, None)
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from kvcache.cache.config import KvCacheConfig, ModelConfig
from kvcache.cache.fields import is_int

__all__ = ["LAYER_KINDS", "ModelPreset", "list_models", "load_model"]

_SUFFIX = ".json"
_KEYS = (
    "name",
    "description",
    "model",
    "layer_types",
    "max_attention_window",
    "max_context",
    "source",
)

#: Layer kinds of ``ModelPreset.layer_types``.
LAYER_KINDS: tuple[str, ...] = ("attention", "recurrent")


@dataclass(frozen=True)
class ModelPreset:
    """A model's KV cache shape.

    Attributes:
        name: Preset name, e.g. ``"gemma-3-27b"``.
        model: Layers, KV heads, head size and dtype.
        max_attention_window: Window pattern repeating over the layers (``None`` entries are
            full attention); ``None`` when every layer is full attention.
        max_context: The model's maximum context length in tokens.
        description: One line for people.
        source: Where the numbers come from.
        layer_types: For hybrid models, the order of the cache-holding layers as a pattern
            of ``"attention"`` and ``"recurrent"`` that repeats over the
            ``num_layers + recurrent_layers`` layers, as Hugging Face's ``layer_types``
            (Qwen3.5: three recurrent, then one attention); ``None`` for attention-only
            models and for parallel hybrids whose every layer has both (Falcon-H1).
    """

    name: str
    model: ModelConfig
    max_attention_window: tuple[int | None, ...] | None
    max_context: int
    description: str
    source: str = ""
    layer_types: tuple[str, ...] | None = None

    def layer_kinds(self) -> list[str] | None:
        """``layer_types`` expanded to one kind per cache-holding layer (``None`` without).

        Example:
            >>> load_model("qwen3.5-9b").layer_kinds()[:5]
            ['recurrent', 'recurrent', 'recurrent', 'attention', 'recurrent']
        """
        pattern = self.layer_types
        if pattern is None:
            return None
        total = self.model.num_layers + self.model.recurrent_layers
        return [pattern[i % len(pattern)] for i in range(total)]

    def kv_cache_config(self, **overrides: Any) -> KvCacheConfig:
        """A ``KvCacheConfig`` with this preset's window pattern and the given fields.

        Example:
            >>> load_model("mistral-7b-v0.1").kv_cache_config(backend="virtual").backend
            'virtual'
        """
        fields: dict[str, Any] = {"max_attention_window": self.max_attention_window}
        fields.update(overrides)
        return KvCacheConfig(**fields)

    def window_pattern_text(self) -> str:
        """The window pattern in words, e.g. ``"5 x 1024, full (repeating)"``.

        Example:
            >>> load_model("gpt-oss-20b").window_pattern_text()
            '128, full (repeating)'
            >>> load_model("llama-3.1-8b").window_pattern_text()
            'full'
        """
        pattern = self.max_attention_window
        if pattern is None:
            return "full"
        runs: list[tuple[int | None, int]] = []
        for w in pattern:
            if runs and runs[-1][0] == w:
                runs[-1] = (w, runs[-1][1] + 1)
            else:
                runs.append((w, 1))

        def word(w: int | None) -> str:
            return "full" if w is None else str(w)

        if len(runs) == 1:
            return f"{word(runs[0][0])} on every layer"
        parts = [word(w) if n == 1 else f"{n} x {word(w)}" for w, n in runs]
        return ", ".join(parts) + " (repeating)"


def _data_dir() -> Any:
    return resources.files("kvcache.models")


def list_models() -> list[str]:
    """Names of the built-in presets, sorted.

    Example:
        >>> list_models()[:3]
        ['command-a', 'falcon-h1-34b', 'gemma-2-27b']
    """
    names = [
        entry.name[: -len(_SUFFIX)]
        for entry in _data_dir().iterdir()
        if entry.name.endswith(_SUFFIX) and entry.is_file()
    ]
    return sorted(names)


def load_model(name: str) -> ModelPreset:
    """Loads a preset by name (case-insensitive), or from a preset JSON file path.

    A name that ends in ``.json`` or holds a path separator is a file; anything else is a
    built-in preset name.

    Args:
        name: A name from :func:`list_models`, or the path of a ``.json`` file in the same
            format as the built-in presets: an object with ``name``, ``model`` (the
            :class:`~kvcache.config.ModelConfig` fields) and ``max_context``, and optionally
            ``max_attention_window``, ``layer_types``, ``description`` and ``source``.

    Returns:
        The preset.

    Raises:
        ValueError: Unknown name (the message lists the known ones), a file that does not
            exist or cannot be read, or a malformed file (the message names the file and
            the key).

    Example:
        >>> load_model("Gemma-3-1B").model.num_kv_heads
        1
    """
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model name must be a non-empty string, got {name!r}")
    if name.endswith(_SUFFIX) or os.sep in name or "/" in name:
        path = Path(name)
        if not path.exists():
            raise ValueError(f"model file {name!r} does not exist")
        if path.is_dir():
            raise ValueError(f"model file {name!r} is a directory")
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            raise ValueError(f"cannot read model file {name!r}: {reason}") from None
        return _parse(text, origin=name)
    key = name.strip().lower()
    if key not in list_models():
        raise ValueError(
            f"unknown model {name!r}; known models: {', '.join(list_models())} "
            "(or the path of a preset .json file)"
        )
    text = (_data_dir() / f"{key}{_SUFFIX}").read_text(encoding="utf-8")
    return _parse(text, origin=f"preset {key!r}")


_REQUIRED = ("name", "model", "max_context")
_MODEL_REQUIRED = ("num_layers", "num_kv_heads", "head_dim")


def _quoted(keys: list[str] | tuple[str, ...]) -> str:
    return ", ".join(repr(k) for k in keys)


def _parse(text: str, *, origin: str) -> ModelPreset:
    try:
        d = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{origin}: invalid JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"{origin}: expected a JSON object")
    unknown = sorted(set(d) - set(_KEYS))
    if unknown:
        raise ValueError(f"{origin}: unknown keys {_quoted(unknown)}; known keys: {_quoted(_KEYS)}")
    missing = [k for k in _REQUIRED if k not in d]
    if missing:
        raise ValueError(
            f"{origin}: missing keys {_quoted(missing)}; a preset needs {_quoted(_REQUIRED)} "
            "(and may have 'layer_types', 'max_attention_window', 'description', 'source')"
        )
    try:
        if not isinstance(d["model"], dict):
            raise ValueError("'model' must be an object of ModelConfig fields")
        absent = [k for k in _MODEL_REQUIRED if k not in d["model"]]
        if absent:
            raise ValueError(f"'model' is missing {_quoted(absent)}")
        model = ModelConfig.from_dict(d["model"])
        # KvCacheConfig validates and normalises the window pattern.
        pattern = KvCacheConfig(max_attention_window=d.get("max_attention_window"))
        max_context = d["max_context"]
        if not is_int(max_context) or max_context <= 0:
            raise ValueError(f"max_context must be a positive int, got {max_context!r}")
        window = pattern.max_attention_window
        return ModelPreset(
            name=str(d["name"]),
            model=model,
            max_attention_window=None if window is None else tuple(window),
            max_context=max_context,
            description=str(d.get("description", "")),
            source=str(d.get("source", "")),
            layer_types=_layer_types(d.get("layer_types"), model),
        )
    except (ValueError, TypeError) as e:
        raise ValueError(f"{origin}: {e}") from None


def _layer_types(value: object, model: ModelConfig) -> tuple[str, ...] | None:
    """The ``layer_types`` pattern, checked against the model's layer counts."""
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError(f"layer_types must be a non-empty list of {_quoted(LAYER_KINDS)}")
    for i, kind in enumerate(value):
        if kind not in LAYER_KINDS:
            raise ValueError(
                f"layer_types[{i}] must be one of {_quoted(LAYER_KINDS)}, got {kind!r}"
            )
    total = model.num_layers + model.recurrent_layers
    if len(value) > total:
        raise ValueError(f"layer_types has {len(value)} entries, more than the {total} layers")
    kinds = [value[i % len(value)] for i in range(total)]
    counts = (kinds.count("attention"), kinds.count("recurrent"))
    if counts != (model.num_layers, model.recurrent_layers):
        raise ValueError(
            f"layer_types repeated over {total} layers gives {counts[0]} attention and "
            f"{counts[1]} recurrent layers, but the model has num_layers={model.num_layers} "
            f"and recurrent_layers={model.recurrent_layers}"
        )
    return tuple(value)
