"""What forks save in beam search: blocks per request with forks against without
(``kvcache simulate --num-beams K``).

Each request of the workload runs alone through a manager with the model's windows (virtual
backend: bookkeeping only, nothing allocated) twice:

* with forks: its prompt is registered once and forked into ``K`` beams
  (``fork_sequence``), which then decode its output length together, one ``add_tokens`` call
  per step, each beam a different token (the beams diverge at once, so every shared partial
  block is copied on write but one);
* without: ``K`` separate sequences of the same prompt (no reuse), decoding the same way.

The report is the peak of the blocks held in each window, averaged over the requests. For
``K`` beams of a ``P``-token prompt in a window ``W`` (``t`` tokens per block) forks hold about
``P/t + K * (W/t + 1)`` blocks, separate sequences ``K * P/t``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvcache.cache.manager import KVCacheManager
from kvcache.cache.sizing import window_sizes
from kvcache.models import ModelPreset
from kvcache.simulate.workload import TraceRequest

__all__ = ["BeamFootprint", "beam_footprint", "format_beam_footprint"]

MAX_BEAMS = 64
"""Most beams ``--num-beams`` accepts."""


@dataclass(frozen=True)
class BeamFootprint:
    """Mean peak blocks per request per window, with forks and with separate sequences.

    Attributes:
        num_beams: Beams per request.
        requests: Requests measured.
        tokens_per_block: Block size.
        forked: Window -> mean peak blocks of a request whose beams are forks.
        separate: Window -> mean peak blocks of ``num_beams`` separate sequences.
        copied_on_write: Blocks copied on write per request (summed over windows).
    """

    num_beams: int
    requests: int
    tokens_per_block: int
    forked: dict[int, float]
    separate: dict[int, float]
    copied_on_write: float


def _peak(manager: KVCacheManager, ids: list[int], steps: int, first: int) -> dict[int, int]:
    """Decodes ``steps`` tokens on every sequence of ``ids`` (one call per step, a different
    token per sequence); returns the most blocks held per window, then removes them."""
    windows = manager.window_sizes
    peak = {w: int(manager.get_num_used_blocks(w)) for w in windows}
    for step in range(steps):
        manager.add_tokens(ids, [first + step * len(ids) + i for i in range(len(ids))])
        for w in windows:
            peak[w] = max(peak[w], int(manager.get_num_used_blocks(w)))
    for rid in ids:
        manager.remove_sequence(rid, store_for_reuse=False)
    return peak


def beam_footprint(
    trace: Sequence[TraceRequest],
    preset: ModelPreset,
    *,
    num_beams: int,
    tokens_per_block: int,
    max_seq_len: int | None = None,
    max_requests: int = 200,
) -> BeamFootprint:
    """Measures the blocks ``num_beams`` beams of each request hold with and without forks.

    Args:
        trace: The workload; its first ``max_requests`` requests (by id) that fit
            ``max_seq_len`` are measured.
        preset: The model (its layers and window pattern).
        num_beams: Beams per request, 1..:data:`MAX_BEAMS`.
        tokens_per_block: Block size.
        max_seq_len: Longest sequence (``None``: the longest measured request).
        max_requests: Most requests measured.

    Returns:
        The means per window.

    Raises:
        ValueError: ``num_beams`` out of range, or no request fits.
    """
    if not 1 <= num_beams <= MAX_BEAMS:
        raise ValueError(f"num_beams must be in 1..{MAX_BEAMS}, got {num_beams}")
    ordered = sorted(trace, key=lambda t: t.request_id)
    lengths = [len(t.prompt) + max(len(t.output), 1) - 1 for t in ordered]
    seq_len = max_seq_len if max_seq_len is not None else max(lengths, default=0)
    chosen = [t for t, n in zip(ordered, lengths, strict=True) if n <= seq_len][:max_requests]
    if not chosen or seq_len < 1:
        raise ValueError("--num-beams: no request of the workload fits max_seq_len")
    config = preset.kv_cache_config(
        tokens_per_block=tokens_per_block, backend="virtual", enable_block_reuse=False
    )
    per_seq = -(-seq_len // tokens_per_block)
    blocks = {w: num_beams * (per_seq + 1) for w in window_sizes(preset.model, config, seq_len)}
    manager = KVCacheManager.from_blocks(
        preset.model, config, blocks, max_seq_len=seq_len, max_batch_size=num_beams
    )
    forked = dict.fromkeys(blocks, 0)
    separate = dict.fromkeys(blocks, 0)
    ids = list(range(num_beams))
    copies_before = manager.get_kv_cache_stats().copied_on_write_blocks
    for t in chosen:
        steps = max(len(t.output), 1) - 1
        manager.add_sequence(0, list(t.prompt))
        manager.fork_sequence(0, ids[1:])
        for w, n in _peak(manager, ids, steps, 0).items():
            forked[w] += n
        for rid in ids:
            manager.add_sequence(rid, list(t.prompt))
        for w, n in _peak(manager, ids, steps, 0).items():
            separate[w] += n
    copies = manager.get_kv_cache_stats().copied_on_write_blocks - copies_before
    count = len(chosen)
    return BeamFootprint(
        num_beams=num_beams,
        requests=count,
        tokens_per_block=tokens_per_block,
        forked={w: n / count for w, n in forked.items()},
        separate={w: n / count for w, n in separate.items()},
        copied_on_write=copies / count,
    )


def format_beam_footprint(f: BeamFootprint) -> str:
    """The footprint as a few lines of text (one per window, then the total)."""
    lines = [
        f"beam search, {f.num_beams} beams ({f.requests:,} request{'' if f.requests == 1 else 's'} "
        "alone, "
        f"{f.tokens_per_block}-token blocks): peak blocks per request",
        f"  {'window':>8}  {'forks':>10}  {'separate':>10}  {'saved':>6}",
    ]
    rows = [(str(w), f.forked[w], f.separate[w]) for w in sorted(f.forked)]
    rows.append(("total", sum(f.forked.values()), sum(f.separate.values())))
    for name, a, b in rows:
        saved = f"{1 - a / b:6.0%}" if b else "     -"
        lines.append(f"  {name:>8}  {a:10.1f}  {b:10.1f}  {saved}")
    lines.append(f"  copy-on-write: {f.copied_on_write:.1f} blocks copied per request")
    return "\n".join(lines)
