"""Argument checks, in one place: the field checks and the dtype table of the configuration
classes (``kvcache.config``, ``kvcache.cache.state_spec``) and the argument checks of the manager,
the resource manager, the scheduler and the engine. Each check raises ``ValueError`` naming the
argument (``TypeError`` for an object of the wrong class); bools are never accepted as ints."""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any, TypeGuard

INT32_MAX = 2**31 - 1
#: Token ids are below this: ``0 <= token < 2**31`` (32-bit in the core).
MAX_TOKEN = 2**31


#: Named window share policies (see :func:`kvcache.sizing.window_size_shares`).
SHARE_POLICIES: tuple[str, ...] = ("equal", "proportional", "auto")

#: Bytes per element of each supported KV cache dtype.
DTYPE_BYTES: Mapping[str, int] = {
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "fp8": 1,
    "int8": 1,
}


MIN_PRIORITY = 0


MAX_PRIORITY = 100


def is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def check_type(name: str, value: object, cls: type) -> None:
    """TypeError naming the argument and the expected class, before any attribute is read."""
    if not isinstance(value, cls):
        raise TypeError(f"{name} must be a kvcache.{cls.__name__}, got {type(value).__name__}")


def optional_int(name: str, value: int | None) -> int | None:
    """Any int or None (ids and priorities the core range-checks itself)."""
    if value is not None and not is_int(value):
        raise ValueError(f"{name} must be an int or None, got {value!r}")
    return value


def _size_hint(value: object) -> str:
    """A size string where bytes are expected: the call that converts it."""
    return (
        f"; for a size string pass kvcache.parse_size({value!r})" if isinstance(value, str) else ""
    )


def positive_count(name: str, value: object) -> int:
    """A count or byte size > 0 of any integer type (numpy ints too), not a bool; a size
    string is refused with the call that converts it."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = 0
    if isinstance(value, bool) or n <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}{_size_hint(value)}")
    return n


def non_negative_count(name: str, value: object) -> int:
    """A count or byte size >= 0 of any integer type (numpy ints too), not a bool."""
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        n = -1
    if isinstance(value, bool) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}{_size_hint(value)}")
    return n


def positive_int(name: str, value: object) -> int:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def positive_int32(name: str, value: object) -> int:
    """A positive int that the core's 32-bit field holds (layer counts, heads, head sizes)."""
    n = positive_int(name, value)
    if n > INT32_MAX:
        raise ValueError(
            f"{name} = {n} is out of range [1, {INT32_MAX}]: the core stores it as a 32-bit integer"
        )
    return n


def non_negative_int(name: str, value: object) -> int:
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def optional_positive_int(name: str, value: object) -> int | None:
    if value is None:
        return None
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive int or None, got {value!r}")
    return int(value)


def bool_field(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r}")
    return value


def priority(name: str, value: object) -> int:
    if not is_int(value) or not MIN_PRIORITY <= value <= MAX_PRIORITY:
        raise ValueError(f"{name} must be an int in {MIN_PRIORITY}..{MAX_PRIORITY}, got {value!r}")
    return int(value)


def choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")
    return value


def sequence(name: str, value: object) -> Sequence[object]:
    """Lists, tuples and 1-D numpy arrays; never strings or mappings."""
    if isinstance(value, (str, bytes, Mapping)):
        raise ValueError(f"{name} must be a sequence, got {value!r}")
    if isinstance(value, Sequence):
        return value
    if hasattr(value, "__iter__"):
        return list(value)
    raise ValueError(f"{name} must be a sequence, got {value!r}")


def field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def unknown_keys(cls_name: str, d: Mapping[str, Any], known: Sequence[str]) -> None:
    if not isinstance(d, Mapping):
        raise ValueError(f"{cls_name}.from_dict expects a mapping, got {type(d).__name__}")
    unknown = sorted(str(k) for k in d if k not in known)
    if unknown:
        raise ValueError(
            f"unknown {cls_name} field(s): {', '.join(unknown)} (known fields: {', '.join(known)})"
        )


def to_plain(value: object) -> object:
    """Tuples become lists and mappings dicts with text keys, so that ``to_dict`` output is
    JSON/TOML/YAML friendly."""
    if isinstance(value, tuple):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): to_plain(v) for k, v in value.items()}
    return value


def as_int(value: object) -> object:
    """numpy integers become ints; anything else is returned unchanged for the check."""
    if not isinstance(value, (int, bool)) and hasattr(value, "__index__"):
        return int(value.__index__())
    return value


def per_layer(name: str, value: object, num_layers: int, what: str) -> Sequence[object]:
    items = sequence(name, value)
    if len(items) != num_layers:
        article = "an" if what == "int" else "a"
        raise ValueError(
            f"{name} must be {article} {what} or a sequence of num_layers={num_layers} "
            f"{what}s, got {len(items)} entries"
        )
    return items


def parse_share_text(name: str, text: str) -> str | tuple[float, ...]:
    """A policy name, or comma-separated numbers validated like a sequence.

    ``name`` is the source shown in error messages (a field or an environment variable).
    """
    stripped = text.strip()
    if stripped in SHARE_POLICIES:
        return stripped
    values: list[float] = []
    for i, part in enumerate(stripped.split(",")):
        try:
            values.append(float(part.strip()))
        except ValueError:
            raise ValueError(
                f"{name}: expected one of {', '.join(map(repr, SHARE_POLICIES))} or "
                f"comma-separated numbers, but entry {i} is {part.strip()!r}"
            ) from None
    return check_share_values(name, values)


def check_share_values(name: str, values: Sequence[object]) -> tuple[float, ...]:
    """Shares must be finite numbers >= 0 with a positive sum; ``name`` is the source."""
    out: list[float] = []
    for i, v in enumerate(values):
        if isinstance(v, (bool, str, bytes)) or not hasattr(v, "__float__"):
            raise ValueError(f"{name}: entry {i} must be a number, got {v!r}")
        f = float(v)
        if not math.isfinite(f):
            raise ValueError(f"{name}: entry {i} is {f}; shares must be finite numbers >= 0")
        if f < 0:
            raise ValueError(f"{name}: entry {i} is negative ({f}); shares must be >= 0")
        out.append(f)
    if not out:
        raise ValueError(f"{name}: no shares given")
    if sum(out) <= 0:
        raise ValueError(f"{name}: shares are all zero; their sum must be positive")
    return tuple(out)
