"""The CPU allocator policy a process trains under (glibc ``mallopt``).

PyTorch allocates CPU tensors with ``malloc``. glibc serves large blocks with ``mmap`` and
raises that threshold as memory is freed, so what a step costs in time (page faults on
fresh pages) and in resident memory (freed blocks kept in the heap) depends on the policy:

- ``"default"``: glibc as found (dynamic threshold). What a plain ``python`` process gets.
- ``"keep"``: keep freed memory (thresholds at 1 GiB): no page faults on reuse, so steps
  are faster, and the resident set stays at its high-water mark.
- ``"release"``: blocks of 1 MiB and more are mapped and unmapped every time: the lowest
  resident memory, paid for in page faults on every step.
- ``"lean"``: ``release`` on transparent huge pages (glibc's ``glibc.malloc.hugetlb=1``
  tunable, glibc >= 2.35): a fresh block faults once per 2 MiB instead of once per 4 KiB,
  so most of ``release``'s page-fault time goes while its low resident memory stays. The
  tunable is read when a process starts: :func:`restart_for` re-executes the command with
  it (the experiment CLIs call it before building anything); a process started without it
  runs ``lean`` as ``release``.

Training applies ``TrainConfig.cpu_malloc`` (default ``"default"``) to the whole process;
dense and CoMERA runs get the same policy, and the benchmarks measure under the same one.
"""

from __future__ import annotations

import ctypes
import os
import sys

__all__ = [
    "CPU_MALLOC_POLICIES",
    "hugepages_active",
    "needs_restart",
    "restart_for",
    "set_cpu_malloc",
]

CPU_MALLOC_POLICIES = ("default", "keep", "release", "lean")
HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
_RESTARTED = "COMERA_MALLOC_RESTARTED"  # set in the re-executed process: never loop
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def set_cpu_malloc(policy: str) -> bool:
    """Apply ``policy`` to this process's glibc malloc; True when it took effect.

    ``"default"`` changes nothing (and returns True). Elsewhere than glibc the call does
    nothing and returns False. A policy cannot be undone within the process."""
    if policy not in CPU_MALLOC_POLICIES:
        raise ValueError(f"cpu_malloc={policy!r}; choose one of {CPU_MALLOC_POLICIES}")
    if policy == "default":
        return True
    # release and lean: blocks >= 1 MiB mapped (and unmapped on free), both thresholds
    # fixed, which also stops glibc raising them as memory is freed. release trims the
    # heap top above 1 MiB; lean keeps up to 32 MiB of it (only blocks under 1 MiB live
    # there) so small blocks are reused without faulting their pages in again.
    threshold = 1 << 30 if policy == "keep" else 1 << 20
    trim = {"keep": 1 << 30, "release": 1 << 20, "lean": 32 << 20}[policy]
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, trim)
        )
    except (OSError, AttributeError):
        return False


def hugepages_active() -> bool:
    """True when this process was started with glibc's huge-page tunable (what ``lean``
    adds to ``release``)."""
    return HUGEPAGE_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def _hugepages_possible() -> bool:
    """glibc >= 2.35 (the tunable exists) and a kernel offering transparent huge pages."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # type: ignore[union-attr]
        major, minor = (int(x) for x in version.split(".")[:2])
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp = f.read()
    except (ValueError, OSError, AttributeError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35) and "[never]" not in thp


def needs_restart(policy: str) -> bool:
    """Whether ``policy`` needs this process restarted to take full effect: ``lean``,
    where huge pages are possible but were not requested at start (and no restart has
    been tried already)."""
    if policy not in CPU_MALLOC_POLICIES:
        raise ValueError(f"cpu_malloc={policy!r}; choose one of {CPU_MALLOC_POLICIES}")
    return (
        policy == "lean"
        and not hugepages_active()
        and not os.environ.get(_RESTARTED)
        and _hugepages_possible()
    )


def restart_for(policy: str) -> None:
    """Re-execute this command (same interpreter, same arguments) with the environment
    ``policy`` needs, when :func:`needs_restart`; return otherwise. Call it first thing
    in a command's entry point: the process is replaced, so nothing done before is kept."""
    if not needs_restart(policy):
        return
    env = dict(os.environ)
    tunables = env.get("GLIBC_TUNABLES")
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGE_TUNABLE}" if tunables else HUGEPAGE_TUNABLE
    env[_RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
