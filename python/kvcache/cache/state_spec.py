"""The recurrent state of a model's layers: ``StateTensor`` and the checkpoint kinds
(re-exported by ``kvcache.config``)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvcache.cache.fields import (
    DTYPE_BYTES,
    as_int,
    choice,
    field_names,
    positive_int32,
    sequence,
    unknown_keys,
)

__all__ = ["CHECKPOINT_KINDS", "StateTensor"]

#: Where recurrent-state checkpoints may be taken (``KvCacheConfig.recurrent_checkpoints``).
CHECKPOINT_KINDS: tuple[str, ...] = ("prompt_end", "finish", "junction", "chunk_end")


# Most dimensions of one recurrent state tensor (``StateTensor.shape``).
_MAX_STATE_DIMS = 4


@dataclass(frozen=True)
class StateTensor:
    """One state tensor of a recurrent layer (Mamba, Gated DeltaNet, short convolution).

    A recurrent layer keeps a fixed-size state per sequence instead of per-token KV: a
    convolution window and an SSM / delta-rule state. Each is one C-contiguous tensor.

    Args:
        name: What the tensor is, e.g. ``"conv"`` or ``"ssm"`` (non-empty).
        shape: Its shape for one sequence: 1 to 4 positive ints (stored as a tuple).
        dtype: Element type, one of ``float32``, ``float16``, ``bfloat16``, ``fp8``, ``int8``.

    Raises:
        ValueError: A field has the wrong type or is out of range; the message names it.

    Example:
        Qwen3.5-9B's Gated DeltaNet: a convolution over ``2 * 16 * 128 + 32 * 128 = 8192``
        channels keeping ``4 - 1`` inputs, and a ``32 x 128 x 128`` float32 delta-rule state.

        >>> conv = StateTensor("conv", (8192, 3), "bfloat16")
        >>> rec = StateTensor("recurrent", [32, 128, 128], "float32")
        >>> conv.nbytes, rec.nbytes, rec.shape
        (49152, 2097152, (32, 128, 128))
    """

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"StateTensor.name must be a non-empty str, got {self.name!r}")
        items = sequence(f"StateTensor {self.name!r} shape", self.shape)
        if not 1 <= len(items) <= _MAX_STATE_DIMS:
            raise ValueError(
                f"StateTensor {self.name!r} shape must have 1 to {_MAX_STATE_DIMS} dimensions, "
                f"got {len(items)}"
            )
        shape = tuple(
            positive_int32(f"StateTensor {self.name!r} shape[{i}]", as_int(d))
            for i, d in enumerate(items)
        )
        object.__setattr__(self, "shape", shape)
        choice(f"StateTensor {self.name!r} dtype", self.dtype, tuple(DTYPE_BYTES))

    @property
    def nbytes(self) -> int:
        """Bytes of the tensor for one sequence: the product of ``shape`` times the dtype's."""
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> StateTensor:
        """Builds a tensor from ``{"name", "shape", "dtype"}``; other keys raise ``ValueError``.

        Example:
            >>> StateTensor.from_dict({"name": "conv", "shape": [6144, 3], "dtype": "bfloat16"})
            StateTensor(name='conv', shape=(6144, 3), dtype='bfloat16')
        """
        known = field_names(cls)
        unknown_keys(cls.__name__, d, known)
        missing = [k for k in known if k not in d]
        if missing:
            raise ValueError(f"StateTensor needs {', '.join(missing)}; got {dict(d)!r}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form (the shape as a list); ``from_dict(to_dict())`` round-trips."""
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}


def check_recurrent_state(value: object) -> tuple[StateTensor, ...]:
    """``StateTensor`` items or ``{"name", "shape", "dtype"}`` mappings, as a tuple."""
    name = "recurrent_state"
    items = sequence(name, value)
    out: list[StateTensor] = []
    for i, item in enumerate(items):
        if isinstance(item, StateTensor):
            out.append(item)
        elif isinstance(item, Mapping):
            try:
                out.append(StateTensor.from_dict(item))
            except ValueError as e:
                raise ValueError(f"{name}[{i}]: {e}") from None
        else:
            raise ValueError(
                f"{name}[{i}] must be a StateTensor or a mapping with name, shape and dtype, "
                f"got {item!r}"
            )
    names = [t.name for t in out]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"{name} names {', '.join(map(repr, twice))} more than once")
    return tuple(out)


def check_checkpoints(value: object) -> tuple[str, ...]:
    """Checkpoint kinds from a sequence or comma-separated text, in CHECKPOINT_KINDS order."""
    name = "recurrent_checkpoints"
    if isinstance(value, str):
        items: Sequence[object] = [p.strip() for p in value.split(",") if p.strip()]
    else:
        items = sequence(name, value)
    seen: set[str] = set()
    for i, item in enumerate(items):
        kind = choice(f"{name}[{i}]", item, CHECKPOINT_KINDS)
        if kind in seen:
            raise ValueError(f"{name} names {kind!r} twice")
        seen.add(kind)
    return tuple(k for k in CHECKPOINT_KINDS if k in seen)
