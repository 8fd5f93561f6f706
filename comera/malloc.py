"""The CPU allocator policy a process trains under (glibc ``mallopt``).

PyTorch allocates CPU tensors with ``malloc``. glibc serves large blocks with ``mmap`` and
raises that threshold as memory is freed, so what a step costs in time (page faults on
fresh pages) and in resident memory (freed blocks kept in the heap) depends on the policy:

- ``"default"``: glibc as found (dynamic threshold). What a plain ``python`` process gets.
- ``"keep"``: keep freed memory (thresholds at 1 GiB): no page faults on reuse, so steps
  are faster, and the resident set stays at its high-water mark.
- ``"release"``: blocks of 1 MiB and more are mapped and unmapped every time: the lowest
  resident memory, paid for in page faults on every step.

Training applies ``TrainConfig.cpu_malloc`` (default ``"default"``) to the whole process;
dense and CoMERA runs get the same policy, and the benchmarks measure under the same one.
"""

from __future__ import annotations

import ctypes

__all__ = ["CPU_MALLOC_POLICIES", "set_cpu_malloc"]

CPU_MALLOC_POLICIES = ("default", "keep", "release")
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def set_cpu_malloc(policy: str) -> bool:
    """Apply ``policy`` to this process's glibc malloc; True when it took effect.

    ``"default"`` changes nothing (and returns True). Elsewhere than glibc the call does
    nothing and returns False. A policy cannot be undone within the process."""
    if policy not in CPU_MALLOC_POLICIES:
        raise ValueError(f"cpu_malloc={policy!r}; choose one of {CPU_MALLOC_POLICIES}")
    if policy == "default":
        return True
    # release: blocks >= 1 MiB mapped (and unmapped on free), the heap top trimmed above
    # 1 MiB; both fixed, which also stops glibc raising them as memory is freed
    threshold = 1 << 30 if policy == "keep" else 1 << 20
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, threshold)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, threshold)
        )
    except (OSError, AttributeError):
        return False
