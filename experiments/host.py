"""Which machine measured a figure: reports record it next to their numbers.

CPU timings move with the processor (a 2-core AMD EPYC and a 2-core Xeon with AMX give the
same code different ratios), so every benchmark that writes a report names the CPU model,
not only its thread count. A run records :func:`host_meta` in its JSON when it measures;
its report's header (:func:`report_header`) is rendered from that JSON, so a report
re-rendered later still names the machine, torch version and date of the measurement.
"""

from __future__ import annotations

import datetime
import platform
from collections.abc import Mapping
from pathlib import Path

__all__ = ["NOT_RECORDED", "cpu_model", "host_meta", "report_header"]

NOT_RECORDED = "not recorded"


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


def host_meta() -> dict[str, str]:
    """What a report header needs about this run, to store in the run's JSON when it
    measures: ``cpu`` (:func:`cpu_model`), ``torch`` (version) and ``date`` (UTC,
    ``YYYY-MM-DD``)."""
    import torch  # here, not at import: reading the CPU name needs no torch

    return {
        "cpu": cpu_model(),
        "torch": str(torch.__version__),
        "date": datetime.datetime.now(datetime.UTC).date().isoformat(),
    }


def report_header(title: str, command: str, meta: Mapping[str, object]) -> list[str]:
    """A report's first lines (markdown): ``# title``, then the command that wrote it and
    the CPU, torch version and date read from ``meta`` (a run's JSON, or the part of it
    holding :func:`host_meta`'s keys). A key that ``meta`` lacks or holds empty is shown
    as "not recorded": a re-rendered report never stands in today's machine for the one
    that measured."""

    def field(key: str) -> str:
        value = meta.get(key)
        return NOT_RECORDED if value is None or value == "" else str(value)

    return [
        f"# {title}",
        "",
        f"Command: `{command}`",
        "",
        f"CPU: {field('cpu')}; torch: {field('torch')}; date: {field('date')}.",
        "",
    ]
