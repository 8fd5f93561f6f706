"""How the step benchmarks time a training step: one untimed warm-up, then timed steps;
and how they fold the same measurement taken in several fresh processes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable

__all__ = ["medians_over", "timed_steps"]


def timed_steps(step: Callable[[], object], steps: int) -> list[float]:
    """Seconds of each of ``steps`` calls of ``step``, after one untimed call (the first
    step allocates, and an ``auto`` model decides its plans in it)."""
    step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def medians_over(outs: list[dict], keys: Iterable[str], *, runs: bool = True) -> dict:
    """Each of ``keys``' median over ``outs`` (one result per process), and with ``runs``
    every process's value under ``<key>_runs``."""
    folded: dict = {}
    for key in keys:
        folded[key] = statistics.median(o[key] for o in outs)
        if runs:
            folded[f"{key}_runs"] = [o[key] for o in outs]
    return folded
