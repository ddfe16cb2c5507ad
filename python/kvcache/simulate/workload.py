"""Workloads for the simulator: JSON Lines traces and the built-in multi-turn chat generator.

A trace holds one request per line, in one of two formats, recognized by its keys.
kvcache's own::

    {"request_id": 1, "arrival": 0, "prompt": [1, 2, 3], "output": [4, 5]}

``request_id`` is an int in ``0 .. 2**63 - 1``, unique in the file; ``arrival`` the engine
step at which the request arrives (an int >= 0); ``prompt`` and ``output`` non-empty lists of
token ids in ``0 .. 2**31 - 1``. Optional: ``"lora_task_id"`` (a 64-bit signed int),
``"cache_salt"`` (a string or an int) and ``"priority"`` (an int in 0..100).

Mooncake's (a line with any of its keys ``timestamp``, ``input_length``, ``output_length``,
``hash_ids``)::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

with tokens synthesized per hash id, outputs per request and arrival steps from the
timestamps (:mod:`kvcache.simulate.mooncake`); its requests get ids 0, 1, 2, ... in file
order. Blank lines are skipped; anything else, or a file mixing the formats, is an error
naming the file and the line. :class:`TraceFile` streams a file; :func:`read_trace` reads
it whole.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache.simulate.mooncake import (
    DEFAULT_STEP_MS,
    MooncakeLine,
    arrival_step,
    mooncake_output_tokens,
    mooncake_prompt_tokens,
    parse_mooncake_line,
)

__all__ = [
    "ARRIVAL_MODES",
    "DEFAULT_CONVERSATIONS",
    "MAX_REQUEST_ID",
    "MAX_TOKEN_ID",
    "VOCAB",
    "TokenArrays",
    "TraceFile",
    "TraceRequest",
    "TraceSummary",
    "default_workload",
    "iter_trace",
    "read_trace",
    "write_trace",
]

#: Largest request id: the manager's sequence ids are signed 64-bit.
MAX_REQUEST_ID = 2**63 - 1
#: Largest token id: the manager stores tokens as signed 32-bit ints.
MAX_TOKEN_ID = 2**31 - 1
#: How a trace's requests arrive: as the file says, or all at step 0 ("as soon as possible").
ARRIVAL_MODES = ("timestamps", "asap")
#: Conversations in the built-in workload when none is given (about 1,000 requests).
DEFAULT_CONVERSATIONS = 400
#: Longest sequence (prompt plus output) the built-in workload generates by default.
DEFAULT_MAX_SEQ_LEN = 8192

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
#: Token ids of the built-in workload and of drafts lie in ``0 .. VOCAB - 1``.
VOCAB = 32000
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


#: What a line with an unknown key is told: both formats' keys and where they are described.
_EXPECTED_KEYS = (
    "a line of kvcache's format has request_id, arrival, prompt, output (optional: "
    "lora_task_id, cache_salt, priority); one of Mooncake's has timestamp, input_length, "
    'output_length, hash_ids; see "Trace format" in docs/api.md'
)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_trace_line(obj: object) -> TraceRequest:
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(obj) - _TRACE_KEYS)
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(map(repr, unknown))}; {_EXPECTED_KEYS}")
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


_FORMAT_NAMES = {"kvcache": "kvcache", "mooncake": "Mooncake"}
_MOONCAKE_HINT = frozenset({"hash_ids", "input_length", "output_length", "timestamp"})


def _line_format(obj: object) -> str:
    """``"mooncake"`` for a line with any of Mooncake's keys, else ``"kvcache"``."""
    return "mooncake" if isinstance(obj, dict) and _MOONCAKE_HINT & obj.keys() else "kvcache"


def _records(
    path: str | os.PathLike[str], first: int | None
) -> Iterator[tuple[int, int, str, TraceRequest | MooncakeLine]]:
    """``(line number, request index, format, parsed line)`` for each request of the file, in
    file order, checked (a file holds one format; kvcache ids are unique)."""
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    seen: dict[int, int] = {}
    fmt: tuple[str, int] | None = None  # the file's format and the line that set it
    index = 0
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if first is not None and index >= first:
                    break
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{lineno}: not valid JSON ({e.msg})") from None
                kind = _line_format(obj)
                if fmt is None:
                    fmt = (kind, lineno)
                elif kind != fmt[0]:
                    raise ValueError(
                        f"{p}:{lineno}: a {_FORMAT_NAMES[kind]} line in a "
                        f"{_FORMAT_NAMES[fmt[0]]} trace (line {fmt[1]} is in "
                        f"{_FORMAT_NAMES[fmt[0]]}'s format); a trace holds one format"
                    )
                parsed: TraceRequest | MooncakeLine
                try:
                    if kind == "mooncake":
                        parsed = parse_mooncake_line(obj)
                    else:
                        parsed = _parse_trace_line(obj)
                except ValueError as e:  # also int() limits on huge numbers
                    raise ValueError(f"{p}:{lineno}: {e}") from None
                if isinstance(parsed, TraceRequest):
                    if parsed.request_id in seen:
                        raise ValueError(
                            f"{p}:{lineno}: request_id {parsed.request_id} already used on "
                            f"line {seen[parsed.request_id]}"
                        )
                    seen[parsed.request_id] = lineno
                yield lineno, index, kind, parsed
                index += 1
        except UnicodeDecodeError as e:
            raise ValueError(f"{p}: not a UTF-8 text file ({e.reason})") from None
        except OSError as e:
            raise ValueError(f"cannot read trace {str(p)!r}: {e.strerror or e}") from None
    if index == 0:
        raise ValueError(f"{p}: the trace holds no requests")


@dataclass(frozen=True)
class TraceSummary:
    """What one pass over a trace file found, without synthesizing a token.

    Attributes:
        format: ``"kvcache"`` or ``"mooncake"``.
        requests: Requests replayed (at most ``first``).
        lengths: Prompt plus output minus one, per request in file order (the most tokens
            each holds in the cache).
        arrivals: Arrival step per request, in file order.
        prompt_tokens: Prompt tokens of all requests.
        in_order: The arrivals never decrease in file order (a replay can stream the file).
    """

    format: str
    requests: int
    lengths: tuple[int, ...]
    arrivals: tuple[int, ...]
    prompt_tokens: int
    in_order: bool


class TraceFile:
    """A trace on disk in either format, read line by line each time it is iterated.

    Iterating it yields :class:`TraceRequest` objects in file order, each made only when it
    is reached (a Mooncake line's tokens are synthesized then), so a replay holds only the
    requests it has read and not finished. :func:`~kvcache.simulate.simulate` takes one
    directly; :meth:`scan` checks the whole file first without making tokens.

    Args:
        path: The JSON Lines file: kvcache's format or Mooncake's (see the module
            docstring), recognized by its keys.
        first: Replay only the first ``first`` requests of the file (``None``: all).
        arrival: ``"timestamps"``: each request arrives when the file says (kvcache's
            ``arrival`` step; a Mooncake ``timestamp`` divided by ``step_ms``);
            ``"asap"``: every request arrives at step 0, in file order.
        step_ms: Milliseconds per engine step for a Mooncake trace's timestamps (``None``:
            :data:`~kvcache.simulate.mooncake.DEFAULT_STEP_MS`).

    Raises:
        ValueError: ``first`` < 1, an unknown ``arrival``, ``step_ms`` not a positive
            number, or ``step_ms`` with ``arrival="asap"``; reading raises what
            :func:`read_trace` raises, and ``step_ms`` on a kvcache-format trace.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        first: int | None = None,
        arrival: str = "timestamps",
        step_ms: float | None = None,
    ) -> None:
        if first is not None and (not _is_int(first) or first < 1):
            raise ValueError(f"first must be an int >= 1, got {first!r}")
        if arrival not in ARRIVAL_MODES:
            raise ValueError(f"arrival must be one of {', '.join(ARRIVAL_MODES)}, got {arrival!r}")
        if step_ms is not None:
            if isinstance(step_ms, bool) or not isinstance(step_ms, (int, float)):
                raise ValueError(f"step_ms must be a positive number, got {step_ms!r}")
            if not math.isfinite(step_ms) or step_ms <= 0:
                raise ValueError(f"step_ms must be a positive number, got {step_ms!r}")
            if arrival == "asap":
                raise ValueError("step_ms times a trace's timestamps; arrival='asap' ignores them")
        self.path = Path(path)
        self.first = first
        self.arrival = arrival
        self.step_ms = step_ms
        self._summary: TraceSummary | None = None

    def __repr__(self) -> str:
        return (
            f"TraceFile({str(self.path)!r}, first={self.first!r}, arrival={self.arrival!r}, "
            f"step_ms={self.step_ms!r})"
        )

    def _arrival(self, kind: str, parsed: TraceRequest | MooncakeLine, lineno: int) -> int:
        if self.arrival == "asap":
            return 0
        if isinstance(parsed, TraceRequest):
            if self.step_ms is not None:
                raise ValueError(
                    f"{self.path}:{lineno}: step_ms times Mooncake timestamps (milliseconds); "
                    "this kvcache-format trace gives arrivals in engine steps"
                )
            return parsed.arrival
        return arrival_step(parsed.timestamp, self.step_ms or DEFAULT_STEP_MS)

    def __iter__(self) -> Iterator[TraceRequest]:
        for lineno, index, kind, parsed in _records(self.path, self.first):
            arrival = self._arrival(kind, parsed, lineno)
            if isinstance(parsed, TraceRequest):
                yield parsed if arrival == parsed.arrival else replace(parsed, arrival=arrival)
            else:
                prompt = mooncake_prompt_tokens(parsed.hash_ids, parsed.input_length)
                output = mooncake_output_tokens(index, parsed.output_length)
                yield TraceRequest(index, arrival, tuple(prompt.tolist()), tuple(output.tolist()))

    def token_arrays(self) -> Iterator[TokenArrays]:
        """Each request as arrays, in file order, without making Python tuples (for
        :mod:`kvcache.simulate.bounds`)."""
        for lineno, index, kind, parsed in _records(self.path, self.first):
            arrival = self._arrival(kind, parsed, lineno)
            if isinstance(parsed, TraceRequest):
                yield TokenArrays(
                    parsed.request_id,
                    arrival,
                    np.asarray(parsed.prompt, dtype=np.int32),
                    np.asarray(parsed.output, dtype=np.int32),
                    parsed.lora_task_id,
                    parsed.cache_salt,
                )
            else:
                yield TokenArrays(
                    index,
                    arrival,
                    mooncake_prompt_tokens(parsed.hash_ids, parsed.input_length),
                    mooncake_output_tokens(index, parsed.output_length),
                )

    def scan(self) -> TraceSummary:
        """Checks every line and sums the file up (once; later calls return the same).

        Raises:
            ValueError: What :func:`read_trace` raises.
        """
        if self._summary is None:
            lengths: list[int] = []
            arrivals: list[int] = []
            prompt_tokens = 0
            kind = "kvcache"
            for lineno, _, kind, parsed in _records(self.path, self.first):
                arrivals.append(self._arrival(kind, parsed, lineno))
                if isinstance(parsed, TraceRequest):
                    n_in, n_out = len(parsed.prompt), len(parsed.output)
                else:
                    n_in, n_out = parsed.input_length, max(parsed.output_length, 1)
                lengths.append(n_in + n_out - 1)
                prompt_tokens += n_in
            in_order = all(a <= b for a, b in itertools.pairwise(arrivals))
            self._summary = TraceSummary(
                kind, len(lengths), tuple(lengths), tuple(arrivals), prompt_tokens, in_order
            )
        return self._summary

    def __len__(self) -> int:
        return self.scan().requests


@dataclass(frozen=True)
class TokenArrays:
    """One request of a trace as arrays (see :meth:`TraceFile.token_arrays`)."""

    request_id: int
    arrival: int
    prompt: npt.NDArray[np.int32]
    output: npt.NDArray[np.int32]
    lora_task_id: int | None = None
    cache_salt: str | int | None = None


def iter_trace(
    path: str | os.PathLike[str],
    *,
    first: int | None = None,
    arrival: str = "timestamps",
    step_ms: float | None = None,
) -> Iterator[TraceRequest]:
    """Streams a trace's requests in file order, each made only when reached (see
    :class:`TraceFile` for the arguments).

    Raises:
        ValueError: As :func:`read_trace`, when the bad line is reached.
    """
    return iter(TraceFile(path, first=first, arrival=arrival, step_ms=step_ms))


def read_trace(
    path: str | os.PathLike[str],
    *,
    first: int | None = None,
    arrival: str = "timestamps",
    step_ms: float | None = None,
) -> list[TraceRequest]:
    """Reads a JSON Lines trace in kvcache's or Mooncake's format (see the module docstring);
    blank lines are skipped. The arguments are :class:`TraceFile`'s.

    Raises:
        ValueError: The file cannot be read, a line is malformed (``FILE:LINE: why``), a
            request id repeats, the file mixes the two formats (naming the first line of
            the other one), or it holds no request.

    Example:
        A line ``{"request_id": 3, "arrival": 2, "prompt": [1, 2], "output": [3]}`` becomes
        ``TraceRequest(request_id=3, arrival=2, prompt=(1, 2), output=(3,))``; the ``i``-th
        line (0-based) ``{"timestamp": 120, "input_length": 700, "output_length": 4,
        "hash_ids": [5, 6]}`` becomes request ``i`` arriving at step 2 (50 ms per step) with
        700 synthesized prompt tokens and 4 output tokens.
    """
    return list(iter_trace(path, first=first, arrival=arrival, step_ms=step_ms))


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
        rng.integers(0, VOCAB, int(rng.integers(200, 2001))).tolist()
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
            prompt = history + rng.integers(0, VOCAB, user_len).tolist()
            if len(prompt) + out_len - 1 > max_seq_len:
                break
            output = rng.integers(0, VOCAB, out_len).tolist()
            raw.append((arrival, prompt, output))
            history = prompt + output
            arrival += out_len + int(rng.integers(20, 201))
    raw.sort(key=lambda t: t[0])
    return [
        TraceRequest(i, arrival, tuple(prompt), tuple(output))
        for i, (arrival, prompt, output) in enumerate(raw)
    ]
