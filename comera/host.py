"""Which machine measured a figure: benchmark reports record it next to their numbers.

CPU timings move with the processor (a 2-core AMD EPYC and a 2-core Xeon with AMX give the
same code different ratios), so every benchmark that writes a report names the CPU model,
not only its thread count.
"""

from __future__ import annotations

import platform
from pathlib import Path

__all__ = ["cpu_model"]


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model name: Linux's ``/proc/cpuinfo`` first, then ``platform.processor()``."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            if sep and key.strip() == "model name" and value.strip():
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"
