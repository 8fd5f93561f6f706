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
    """The CPU's model name, with its family and model numbers: ``/proc/cpuinfo`` first,
    then ``platform.processor()``.

    Under a hypervisor the name is often generic ("AMD EPYC", "Intel(R) Xeon(R)
    Processor"), the same for processor generations that time our kernels very
    differently; ``cpu family`` and ``model`` tell them apart, so they are appended when
    present (``"AMD EPYC (family 26, model 2)"``)."""
    fields: dict[str, str] = {}
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, sep, value = line.partition(":")
            key = key.strip()
            if not sep:
                continue
            if key in fields:  # the first processor's block is enough
                break
            fields[key] = " ".join(value.split())
    except OSError:
        pass
    name = fields.get("model name")
    if not name:
        return platform.processor() or platform.machine() or "unknown CPU"
    family, model = fields.get("cpu family"), fields.get("model")
    if family and model:
        return f"{name} (family {family}, model {model})"
    return name
