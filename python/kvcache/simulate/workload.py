"""Workloads for the simulator: JSON Lines traces and the built-in multi-turn chat generator.

A trace holds one request per line::

    {"request_id": 1, "arrival": 0, "prompt": [1, 2, 3], "output": [4, 5]}

``request_id`` is an int in ``0 .. 2**63 - 1``, unique in the file; ``arrival`` the engine
step at which the request arrives (an int >= 0); ``prompt`` and ``output`` non-empty lists of
token ids in ``0 .. 2**31 - 1``. Optional: ``"lora_task_id"`` (a 64-bit signed int),
``"cache_salt"`` (a string or an int) and ``"priority"`` (an int in 0..100). Blank lines are
skipped; anything else is an error naming the file and the line.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = [
    "DEFAULT_CONVERSATIONS",
    "MAX_REQUEST_ID",
    "MAX_TOKEN_ID",
    "TraceRequest",
    "default_workload",
    "read_trace",
    "write_trace",
]

#: Largest request id: the manager's sequence ids are signed 64-bit.
MAX_REQUEST_ID = 2**63 - 1
#: Largest token id: the manager stores tokens as signed 32-bit ints.
MAX_TOKEN_ID = 2**31 - 1
#: Conversations in the built-in workload when none is given (about 1,000 requests).
DEFAULT_CONVERSATIONS = 400
#: Longest sequence (prompt plus output) the built-in workload generates by default.
DEFAULT_MAX_SEQ_LEN = 8192

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
_VOCAB = 32000
_TRACE_KEYS = frozenset(
    {"request_id", "arrival", "prompt", "output", "lora_task_id", "cache_salt", "priority"}
)


@dataclass(frozen=True)
class TraceRequest:
    """One request of a workload: its prompt, the tokens it will generate and when it
    arrives (an engine step).

    Attributes:
        request_id: Unique id, ``0 <= request_id <= MAX_REQUEST_ID``.
        arrival: Engine step at which the request arrives (>= 0).
        prompt: Prompt token ids.
        output: The tokens the request generates (replayed as the model's output).
        lora_task_id: LoRA adapter id (part of the reuse key).
        cache_salt: Cache salt (part of the reuse key).
        priority: Retention priority 0..100 of the request's blocks.
    """

    request_id: int
    arrival: int
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    lora_task_id: int | None = None
    cache_salt: str | int | None = None
    priority: int | None = None

    def to_json(self) -> dict[str, Any]:
        """The JSON Lines object of this request (optional keys only when set)."""
        d: dict[str, Any] = {
            "request_id": self.request_id,
            "arrival": self.arrival,
            "prompt": list(self.prompt),
            "output": list(self.output),
        }
        for key in ("lora_task_id", "cache_salt", "priority"):
            value = getattr(self, key)
            if value is not None:
                d[key] = value
        return d


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_trace_line(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(obj) - _TRACE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}")
    for key in ("request_id", "arrival", "prompt", "output"):
        if key not in obj:
            raise ValueError(f"missing {key!r}")
    rid, arrival = obj["request_id"], obj["arrival"]
    if not _is_int(rid):
        raise ValueError(f"'request_id' must be an int, got {rid!r}")
    if not 0 <= rid <= MAX_REQUEST_ID:
        raise ValueError(f"'request_id' must be in 0..2**63-1, got {rid}")
    if not _is_int(arrival) or not 0 <= arrival <= _INT64_MAX:
        raise ValueError(f"'arrival' must be an int in 0..2**63-1, got {arrival!r}")
    tokens: dict[str, tuple[int, ...]] = {}
    for key in ("prompt", "output"):
        value = obj[key]
        if not isinstance(value, list) or not value:
            raise ValueError(f"{key!r} must be a non-empty list of token ids")
        for i, t in enumerate(value):
            if not (_is_int(t) and 0 <= t <= MAX_TOKEN_ID):
                raise ValueError(
                    f"{key!r} holds {t!r} at index {i}; token ids are ints in 0..2**31-1"
                )
        tokens[key] = tuple(value)
    lora = obj.get("lora_task_id")
    if lora is not None and not (_is_int(lora) and _INT64_MIN <= lora <= _INT64_MAX):
        raise ValueError(f"'lora_task_id' must be a 64-bit signed int, got {lora!r}")
    salt = obj.get("cache_salt")
    if salt is not None and not (isinstance(salt, str) or _is_int(salt)):
        raise ValueError(f"'cache_salt' must be a string or an int, got {salt!r}")
    prio = obj.get("priority")
    if prio is not None and not (_is_int(prio) and 0 <= prio <= 100):
        raise ValueError(f"'priority' must be an int in 0..100, got {prio!r}")
    return TraceRequest(rid, arrival, tokens["prompt"], tokens["output"], lora, salt, prio)


def read_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Reads a JSON Lines trace (see the module docstring); blank lines are skipped.

    Raises:
        ValueError: The file cannot be read, or a line is malformed (``FILE:LINE: why``),
            or a request id repeats.

    Example:
        A line ``{"request_id": 3, "arrival": 2, "prompt": [1, 2], "output": [3]}`` becomes
        ``TraceRequest(request_id=3, arrival=2, prompt=(1, 2), output=(3,))``.
    """
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    out: list[TraceRequest] = []
    seen: dict[int, int] = {}
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    req = _parse_trace_line(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
                except ValueError as e:  # also int() limits on huge numbers
                    raise ValueError(f"{p}:{lineno}: {e}") from None
                if req.request_id in seen:
                    raise ValueError(
                        f"{p}:{lineno}: request_id {req.request_id} already used on line "
                        f"{seen[req.request_id]}"
                    )
                seen[req.request_id] = lineno
                out.append(req)
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not a UTF-8 text file ({e.reason})") from None
        except OSError as e:
            raise ValueError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    if not out:
        raise ValueError(f"{p}: the trace holds no requests")
    return out


def write_trace(requests: Iterable[TraceRequest], path: str | os.PathLike[str]) -> None:
    """Writes requests as a JSON Lines trace that :func:`read_trace` reads back."""
    with Path(path).open("w", encoding="utf-8") as f:
        for r in requests:
            f.write(json.dumps(r.to_json(), separators=(",", ":")) + "\n")


def default_workload(
    *,
    seed: int = 0,
    num_conversations: int = DEFAULT_CONVERSATIONS,
    num_system_prompts: int = 6,
    max_seq_len: int = DEFAULT_MAX_SEQ_LEN,
    mean_gap: float = 30.0,
) -> list[TraceRequest]:
    """A seeded multi-turn chat workload with shared system prompts.

    Conversations start at exponential gaps (mean ``mean_gap`` engine steps) and pick one
    of ``num_system_prompts`` system prompts (200-2,000 tokens, popularity falling as
    1/rank). Each has 1-6 turns, and each turn is one request, so there are about 2.5
    requests per conversation; a turn's prompt is the system prompt, the whole history
    (earlier user messages and answers, token for token) and a new user message
    (log-normal, median 150 tokens); answers are log-normal with a median of 250 tokens.
    A follow-up turn arrives after the previous answer would have been generated plus a
    think time of 20-200 steps. Turns that would exceed ``max_seq_len`` end the
    conversation.

    Args:
        seed: Seeds every random choice.
        num_conversations: Conversations to generate (> 0).
        num_system_prompts: Distinct system prompts (> 0).
        max_seq_len: Longest prompt plus output of a request (> 0).
        mean_gap: Mean engine steps between conversation starts (> 0).

    Returns:
        Requests ordered by arrival, with ids 0, 1, 2, ... in that order.

    Raises:
        ValueError: A non-positive count, length or gap, or a negative seed.

    Example:
        >>> w = default_workload(seed=3, num_conversations=2)
        >>> [r.request_id for r in w] == list(range(len(w)))
        True
    """
    for name, value in (
        ("num_conversations", num_conversations),
        ("num_system_prompts", num_system_prompts),
        ("max_seq_len", max_seq_len),
    ):
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if not _is_int(seed) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    if not math.isfinite(mean_gap) or mean_gap <= 0:
        raise ValueError(f"mean_gap must be a positive number, got {mean_gap!r}")
    rng = np.random.default_rng(seed)
    systems = [
        rng.integers(0, _VOCAB, int(rng.integers(200, 2001))).tolist()
        for _ in range(num_system_prompts)
    ]
    popularity = 1.0 / np.arange(1, num_system_prompts + 1)
    popularity /= popularity.sum()
    starts = np.cumsum(rng.exponential(mean_gap, num_conversations))
    raw: list[tuple[int, list[int], list[int]]] = []
    for c in range(num_conversations):
        history = list(systems[int(rng.choice(num_system_prompts, p=popularity))])
        arrival = int(starts[c])
        turns = min(6, int(rng.geometric(0.4)))
        for _ in range(turns):
            user_len = int(np.clip(rng.lognormal(math.log(150), 0.8), 8, 2000))
            out_len = int(np.clip(rng.lognormal(math.log(250), 0.7), 16, 1500))
            prompt = history + rng.integers(0, _VOCAB, user_len).tolist()
            if len(prompt) + out_len - 1 > max_seq_len:
                break
            output = rng.integers(0, _VOCAB, out_len).tolist()
            raw.append((arrival, prompt, output))
            history = prompt + output
            arrival += out_len + int(rng.integers(20, 201))
    raw.sort(key=lambda t: t[0])
    return [
        TraceRequest(i, arrival, tuple(prompt), tuple(output))
        for i, (arrival, prompt, output) in enumerate(raw)
    ]
