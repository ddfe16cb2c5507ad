"""Plots of simulation runs (needs matplotlib: ``pip install 'kvcache[plot]'``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvcache.cache.sizing import format_size
from kvcache.simulate.report import SimulationReport

__all__ = ["check_plot_path", "plot_reports"]

_NEEDS = "--plot needs matplotlib: pip install matplotlib (or the kvcache[plot] extra)"


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError(_NEEDS) from None
    return plt


def check_plot_path(path: str | os.PathLike[str]) -> None:
    """Checks, before a long run, that :func:`plot_reports` can write ``path``.

    matplotlib must be importable and know the file type (by suffix; none means PNG).

    Raises:
        ValueError: matplotlib is missing or the file type is unknown to it.
    """
    plt = _pyplot()
    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix:
        fig = plt.figure()
        try:
            known = fig.canvas.get_supported_filetypes()
        finally:
            plt.close(fig)
        if suffix not in known:
            raise ValueError(
                f"cannot plot to {os.fspath(path)!r}: matplotlib does not write "
                f".{suffix} files (use one of {', '.join('.' + k for k in sorted(known))})"
            )


def plot_reports(reports: Sequence[SimulationReport], path: str | os.PathLike[str]) -> None:
    """Plots per-window pool use and running requests over the steps (one column per run).

    Raises:
        ValueError: matplotlib is not installed, or the file cannot be written.
    """
    plt = _pyplot()
    n = len(reports)
    fig, axes = plt.subplots(2, n, figsize=(6 * n, 6), sharex="col", squeeze=False)
    for col, r in enumerate(reports):
        steps = r.series["step"]
        top, bottom = axes[0][col], axes[1][col]
        for w in r.windows:
            used = np.asarray(r.series[f"used_{w.window}"]) / w.blocks * 100
            top.plot(steps, used, label=f"window {w.window:,} ({w.blocks:,} blocks)", lw=0.8)
        top.set_ylabel("pool use (%)")
        top.set_ylim(0, 105)
        top.set_title(f"{r.model}, {format_size(r.memory_bytes)}, {r.shares} shares")
        top.legend(loc="lower right", fontsize="small")
        bottom.plot(steps, r.series["running"], color="tab:green", lw=0.8, label="running")
        bottom.plot(steps, r.series["waiting"], color="tab:gray", lw=0.8, label="waiting")
        bottom.set_xlabel("engine step")
        bottom.set_ylabel("requests")
        bottom.legend(loc="upper right", fontsize="small")
    fig.tight_layout()
    try:
        fig.savefig(os.fspath(path), dpi=110)
    except OSError as e:
        raise ValueError(f"cannot write plot {os.fspath(path)!r}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
