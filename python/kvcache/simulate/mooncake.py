"""Mooncake's trace format: one line's checks, the tokens synthesized for it, its arrival step.

Mooncake's FAST'25 trace release (and the tools that read it: Dynamo's data generator,
aiperf) describes each request without its text::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

``timestamp`` is the arrival in milliseconds from the start of the trace, ``input_length``
and ``output_length`` the prompt and output lengths in tokens, and ``hash_ids`` holds one id
per 512-token block of the prompt (the last block may be partial). Equal ids mean equal
blocks, and an id names the whole prefix up to and including its block, so the content of
each id's block is all a replay needs:

* **Prompt tokens** are synthesized per hash id: block ``id`` is 512 tokens, token ``j`` being
  ``splitmix64(splitmix64(id ^ PROMPT_SEED) + j) mod SYNTH_VOCAB``; a prompt is its ids'
  blocks one after the other, cut to ``input_length``. Equal ids give equal tokens whatever
  the simulator's ``tokens_per_block``, different ids different ones (with probability
  ``1 - 32000**-tokens_per_block`` per block).
* **Output tokens** are synthesized per request from its index in the file (``splitmix64`` of
  a second seed, mixed twice), distinct between requests; ``output_length`` 0 is replayed as
  one token (an engine samples at least one token after a prefill).
* **Arrivals** follow a fixed step time: timestamp ``t`` ms arrives at engine step
  ``floor(t / step_ms)`` (:func:`arrival_step`; :data:`DEFAULT_STEP_MS` by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

__all__ = [
    "DEFAULT_STEP_MS",
    "MOONCAKE_BLOCK_TOKENS",
    "MOONCAKE_KEYS",
    "SYNTH_VOCAB",
    "MooncakeLine",
    "arrival_step",
    "mooncake_output_tokens",
    "mooncake_prompt_tokens",
    "parse_mooncake_line",
]

#: Tokens per hash id in Mooncake's traces.
MOONCAKE_BLOCK_TOKENS = 512
#: Milliseconds per engine step when a Mooncake trace's timestamps become arrival steps.
DEFAULT_STEP_MS = 50.0
#: The keys of a Mooncake line (all required, no others).
MOONCAKE_KEYS = frozenset({"timestamp", "input_length", "output_length", "hash_ids"})
#: Synthesized token ids lie in ``0 .. SYNTH_VOCAB - 1``.
SYNTH_VOCAB = 32000
#: Seeds of the prompt and output streams (fixed: a trace replays the same tokens everywhere).
PROMPT_SEED = 0x243F6A8885A308D3
OUTPUT_SEED = 0x13198A2E03707344

_MAX_ID = 2**63 - 1
_U64 = np.uint64
_POSITIONS = np.arange(MOONCAKE_BLOCK_TOKENS, dtype=np.uint64)


@dataclass(frozen=True)
class MooncakeLine:
    """One checked line of a Mooncake trace (the fields as the file gives them)."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _splitmix64(x: npt.NDArray[np.uint64]) -> npt.NDArray[np.uint64]:
    """splitmix64's output function, element-wise (uint64 arithmetic wraps)."""
    z = x + _U64(0x9E3779B97F4A7C15)
    z ^= z >> _U64(30)
    z *= _U64(0xBF58476D1CE4E5B9)
    z ^= z >> _U64(27)
    z *= _U64(0x94D049BB133111EB)
    z ^= z >> _U64(31)
    return z


def _stream(bases: npt.NDArray[np.uint64], length: int) -> npt.NDArray[np.int32]:
    """``length`` tokens: block ``i`` holds ``splitmix64(bases[i] + j)`` for j < 512."""
    x = (bases[:, None] + _POSITIONS).ravel()
    return (_splitmix64(x)[:length] % _U64(SYNTH_VOCAB)).astype(np.int32)


def mooncake_prompt_tokens(hash_ids: Any, input_length: int) -> npt.NDArray[np.int32]:
    """The prompt of a Mooncake request: each id's 512 tokens in order, cut to
    ``input_length`` (see the module docstring).

    Example:
        >>> a = mooncake_prompt_tokens([7, 8], 600)
        >>> b = mooncake_prompt_tokens([7, 9], 1000)
        >>> len(a), bool((a[:512] == b[:512]).all()), bool((a[512:] == b[512:600]).any())
        (600, True, False)
    """
    ids = np.asarray(hash_ids, dtype=np.uint64)
    return _stream(_splitmix64(ids ^ _U64(PROMPT_SEED)), input_length)


def mooncake_output_tokens(index: int, output_length: int) -> npt.NDArray[np.int32]:
    """The output of the request at ``index`` (0-based, file order): ``max(output_length, 1)``
    tokens, distinct from every other request's."""
    n = max(output_length, 1)
    # Mixed twice: no request index maps to the base of a hash id's block.
    base = _splitmix64(_splitmix64(np.array([index], dtype=np.uint64) ^ _U64(OUTPUT_SEED)))
    steps = np.arange(math.ceil(n / MOONCAKE_BLOCK_TOKENS), dtype=np.uint64)
    return _stream(base + _U64(MOONCAKE_BLOCK_TOKENS) * steps, n)


def arrival_step(timestamp_ms: float, step_ms: float) -> int:
    """The engine step at which a request stamped ``timestamp_ms`` arrives:
    ``floor(timestamp_ms / step_ms)``.

    Example:
        >>> [arrival_step(t, 50) for t in (0, 49.9, 50, 1022025)]
        [0, 0, 1, 20440]
    """
    return int(timestamp_ms // step_ms)


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_mooncake_line(obj: object) -> MooncakeLine:
    """Checks one parsed JSON line of a Mooncake trace.

    Rules: exactly the keys of :data:`MOONCAKE_KEYS`; ``timestamp`` a finite number >= 0
    (milliseconds; ints in Mooncake's files); ``input_length`` an int >= 1; ``output_length``
    an int >= 0; ``hash_ids`` a non-empty list of ints in ``0 .. 2**63 - 1`` with exactly
    ``ceil(input_length / 512)`` ids, one per 512-token block (the last may be partial).

    Raises:
        ValueError: What is wrong, in one line (the reader adds ``FILE:LINE:``).
    """
    if not isinstance(obj, dict):
        raise ValueError("expected a JSON object")
    unknown = sorted(set(obj) - MOONCAKE_KEYS)
    if unknown:
        raise ValueError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in a Mooncake line, which has "
            'exactly timestamp, input_length, output_length, hash_ids; see "Trace format" in '
            "docs/api.md"
        )
    for key in ("timestamp", "input_length", "output_length", "hash_ids"):
        if key not in obj:
            raise ValueError(
                f"missing {key!r} (a Mooncake line has {', '.join(sorted(MOONCAKE_KEYS))})"
            )
    ts = obj["timestamp"]
    if isinstance(ts, bool) or not isinstance(ts, (int, float)) or not math.isfinite(ts) or ts < 0:
        raise ValueError(f"'timestamp' must be a number >= 0 (milliseconds), got {ts!r}")
    n_in, n_out = obj["input_length"], obj["output_length"]
    if not _is_int(n_in) or n_in < 1:
        raise ValueError(f"'input_length' must be an int >= 1, got {n_in!r}")
    if not _is_int(n_out) or n_out < 0:
        raise ValueError(f"'output_length' must be an int >= 0, got {n_out!r}")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not ids:
        raise ValueError("'hash_ids' must be a non-empty list of ints")
    for i, h in enumerate(ids):
        if not (_is_int(h) and 0 <= h <= _MAX_ID):
            raise ValueError(f"'hash_ids' holds {h!r} at index {i}; ids are ints in 0..2**63-1")
    need = -(-n_in // MOONCAKE_BLOCK_TOKENS)
    if len(ids) != need:
        raise ValueError(
            f"'hash_ids' holds {len(ids)} ids, but input_length {n_in} needs {need} "
            f"(one per {MOONCAKE_BLOCK_TOKENS}-token block, the last may be partial)"
        )
    return MooncakeLine(ts, n_in, n_out, tuple(ids))
