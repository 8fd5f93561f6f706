"""The CPU allocator policy a process trains under (glibc ``mallopt``).

PyTorch allocates CPU tensors with ``malloc``. glibc serves large blocks with ``mmap`` and
raises that threshold as memory is freed, so what a step costs in time (page faults on
fresh pages) and in resident memory (freed blocks kept in the heap) depends on the policy:

- ``"default"``: glibc as found (dynamic threshold). What a plain ``python`` process gets.
- ``"keep"``: keep freed memory (thresholds at 1 GiB): no page faults on reuse, so steps
  are faster, and the resident set stays at its high-water mark.
- ``"release"``: blocks of 1 MiB and more are mapped and unmapped every time: the lowest
  resident memory, paid for in page faults on every step.
- ``"lean"``: ``release``'s 1 MiB mmap threshold with a 32 MiB trim threshold (small
  blocks are reused from the heap top), and blocks of 2 MiB and up on transparent huge
  pages: a fresh block faults once per 2 MiB instead of once per 4 KiB page, so most of
  ``release``'s page-fault time goes while its low resident memory stays. Where the
  kernel's THP mode is ``madvise``, huge pages need glibc's ``glibc.malloc.hugetlb=1``
  tunable (glibc >= 2.35), which glibc reads only when a process starts: :func:`restart_for`
  re-executes the command once with it (the experiment commands call it before building
  anything; ``COMERA_MALLOC_RESTARTED=1`` in the environment turns that off). In mode
  ``always`` the kernel gives huge pages without it; in mode ``never``, or in a process
  started without it, ``lean`` runs without huge pages.

The experiment and benchmark commands apply ``TrainConfig.cpu_malloc`` (default
``"default"``) to their whole process with :func:`apply_cpu_malloc`, dense and CoMERA alike;
the library never does (a ``Trainer`` leaves the process as it found it). Benchmarks run
each variant under the policy its training command runs under and name it.
"""

from __future__ import annotations

import ctypes
import os
import sys
import warnings
from collections.abc import Iterable, Mapping

from comera.errors import ConfigError
from comera.train.config import CPU_MALLOC_POLICIES

__all__ = [
    "CPU_MALLOC_POLICIES",
    "apply_cpu_malloc",
    "clean_malloc_env",
    "hugepages_active",
    "lean_without_hugepages",
    "needs_restart",
    "restart_for",
    "set_cpu_malloc",
]

HUGEPAGE_TUNABLE = "glibc.malloc.hugetlb=1"
_RESTARTED = "COMERA_MALLOC_RESTARTED"  # set in the re-executed process: never loop
_THP = "/sys/kernel/mm/transparent_hugepage/enabled"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def _check_policy(policy: str) -> None:
    if policy not in CPU_MALLOC_POLICIES:
        raise ConfigError(f"cpu_malloc={policy!r}; choose one of {CPU_MALLOC_POLICIES}")


def set_cpu_malloc(policy: str) -> bool:
    """Apply ``policy`` to this process's glibc malloc; True when it took effect.

    ``"default"`` changes nothing (and returns True). Elsewhere than glibc the call does
    nothing and returns False. A policy cannot be undone within the process."""
    _check_policy(policy)
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


def _thp_mode() -> str | None:
    """The kernel's transparent-huge-page mode (``always``, ``madvise``, ``never``), or
    None where it cannot be read."""
    try:
        with open(_THP) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def _glibc_tunable_exists() -> bool:
    """glibc >= 2.35, whose malloc knows ``glibc.malloc.hugetlb``."""
    try:
        name, version = os.confstr("CS_GNU_LIBC_VERSION").split()  # type: ignore[union-attr]
        major, minor = (int(x) for x in version.split(".")[:2])
    except (ValueError, OSError, AttributeError):
        return False
    return name == "glibc" and (major, minor) >= (2, 35)


def hugepages_active() -> bool:
    """True when this process's large blocks get transparent huge pages: the kernel's
    mode is ``always``, or it is ``madvise`` and the process was started with glibc's
    huge-page tunable (what ``lean`` restarts for)."""
    mode = _thp_mode()
    tunable = HUGEPAGE_TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")
    return mode == "always" or (mode == "madvise" and tunable and _glibc_tunable_exists())


def lean_without_hugepages(rows: Iterable[Mapping[str, object]]) -> str:
    """A report sentence naming the benchmark rows (``variant``, ``malloc``,
    ``hugepages``) that ran under ``lean`` without huge pages, or "" when there are none:
    their times include a page fault per 4 KiB of every fresh large block, which ``lean``
    counts on huge pages to avoid, so they overstate what a restarted command runs at."""
    names = [
        str(r.get("variant"))
        for r in rows
        if r.get("malloc") == "lean" and r.get("hugepages") is False
    ]
    if not names:
        return ""
    return (
        f"Warning: {', '.join(names)} ran under `cpu_malloc=lean` without huge pages (the "
        "kernel's THP mode is `never`, or glibc lacks `glibc.malloc.hugetlb`), so their "
        "step times include 4 KiB page faults the training command avoids where huge pages "
        "exist."
    )


def needs_restart(policy: str) -> bool:
    """Whether ``policy`` needs this process restarted to take full effect: ``lean``,
    where the kernel gives huge pages only on request (THP mode ``madvise``), glibc can
    request them, this process was started without the tunable, no restart has been
    tried already, and the command can be run again (not a script read from stdin)."""
    _check_policy(policy)
    return (
        policy == "lean"
        and not os.environ.get(_RESTARTED)
        and not hugepages_active()
        and _thp_mode() == "madvise"
        and _glibc_tunable_exists()
        and sys.argv[:1] not in ([""], ["-"])  # stdin (python -, python < file) is spent
        and len(getattr(sys, "orig_argv", ())) > 0
    )


def restart_for(policy: str) -> None:
    """Re-execute this command (same interpreter, same arguments) with the environment
    ``policy`` needs, when :func:`needs_restart`; return otherwise, and also when the
    re-execution fails (with a warning: the run goes on without huge pages). Call it
    first thing in a command's entry point: the process is replaced, so nothing done
    before is kept."""
    if not needs_restart(policy):
        return
    env = dict(os.environ)
    tunables = env.get("GLIBC_TUNABLES")
    env["GLIBC_TUNABLES"] = f"{tunables}:{HUGEPAGE_TUNABLE}" if tunables else HUGEPAGE_TUNABLE
    env[_RESTARTED] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
    except OSError as e:
        warnings.warn(
            f"cpu_malloc={policy!r}: could not restart with huge pages ({e}); going on "
            "without them",
            stacklevel=2,
        )


def apply_cpu_malloc(policy: str) -> None:
    """What a command that trains on the CPU does with ``train.cpu_malloc``: apply
    ``policy`` to this process, and warn where it cannot take (full) effect."""
    if not set_cpu_malloc(policy):
        warnings.warn(
            f"train.cpu_malloc={policy!r} has no effect here (not glibc malloc)", stacklevel=2
        )
    elif policy == "lean" and not hugepages_active():
        warnings.warn(
            "train.cpu_malloc='lean' runs without huge pages here: with the kernel's THP mode "
            "'madvise' they need GLIBC_TUNABLES=glibc.malloc.hugetlb=1 at process start (the "
            "experiment commands restart themselves with it)",
            stacklevel=2,
        )


def clean_malloc_env() -> dict[str, str]:
    """This process's environment without the huge-page tunable and the restart marker:
    for a benchmark's child process, whose own policy (and restart) must alone decide."""
    env = {k: v for k, v in os.environ.items() if k != _RESTARTED}
    kept = [t for t in env.pop("GLIBC_TUNABLES", "").split(":") if t and t != HUGEPAGE_TUNABLE]
    if kept:
        env["GLIBC_TUNABLES"] = ":".join(kept)
    return env
