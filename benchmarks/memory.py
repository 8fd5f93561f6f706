"""Peak tensor memory of a piece of work, on CPU as on GPU.

On CUDA this is the allocator's peak above the bytes allocated before the call. On
CPU there is no allocator counter, so a dispatch mode watches every tensor storage the
work creates (forward and backward ops alike) and frees it when the storage dies:
the same "peak allocated tensor bytes above baseline" that CUDA reports, free of the
noise of RSS and of malloc caching.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["TensorMemoryTracker", "peak_memory_bytes"]


class TensorMemoryTracker(TorchDispatchMode):
    """Tracks live bytes of storages created inside the context; ``peak`` is the max."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current = 0
        self.peak = 0

    def _collect(self) -> None:
        dead = [k for k, (ref, _) in self._live.items() if ref.expired()]
        for k in dead:
            self.current -= self._live.pop(k)[1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self._collect()
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = st._cdata
                if key not in self._live and st.nbytes():
                    self._live[key] = (StorageWeakRef(st), st.nbytes())
                    self.current += st.nbytes()
        self.peak = max(self.peak, self.current)
        return out


def peak_memory_bytes(fn: Callable[[], object], device: torch.device | str = "cpu") -> int:
    """Peak bytes of tensor memory allocated while ``fn()`` runs, above the baseline."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    tracker = TensorMemoryTracker()
    with tracker:
        fn()
    return tracker.peak
