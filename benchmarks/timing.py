"""How the step benchmarks time a training step: one untimed warm-up, then timed steps."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["timed_steps"]


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
