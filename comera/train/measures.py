"""Numbers the loop computes from a model and a config: live size, learning-rate scale,
peak memory."""

from __future__ import annotations

import math
import resource
import sys

import torch

from comera.accounting import live_param_count, param_count
from comera.train.config import TrainConfig
from comera.tree import iter_tt

__all__ = ["baseline_rss_mb", "lr_scale", "model_size", "peak_memory_mb", "rss_mb"]


def model_size(params: object, state: object) -> int:
    """Live parameters of a whole model: TT/TTM layers after compaction, plus dense leaves."""
    tt_live = tt_stored = 0
    for _, p, s in iter_tt(params, state):
        tt_live += live_param_count(p, s)
        tt_stored += param_count(p)
    return param_count(params) - tt_stored + tt_live


def lr_scale(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to 1, then linear/cosine decay toward 0 (or constant); 1-based step."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = min(max((step - 1 - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps), 0.0), 1.0)
    return 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))


def rss_mb() -> float:
    """This process's resident memory now (MB): the baseline benchmarks subtract from
    :func:`peak_memory_mb` so a figure counts what a model and its step added."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def baseline_rss_mb() -> float:
    """:func:`rss_mb` after importing what a training step loads on its first call, so a
    peak measured above it counts what the model and its step allocate, not code.

    ``torch._dynamo`` is imported by the first ``torch.utils.checkpoint`` call (block and
    attention recomputation) and by ``torch.compile``: about 70 MB resident. It was in
    every benchmark's baseline while ``import comera`` loaded it; since it no longer does,
    this keeps it there, so recomputing variants are not charged for it."""
    import torch._dynamo  # noqa: F401

    return rss_mb()


def peak_memory_mb(device: torch.device) -> float:
    """Peak memory so far (MB): the CUDA allocator's peak, or on CPU the peak RSS.

    On Linux the CPU peak is ``VmHWM``, this process's own high-water mark (which
    ``/proc/self/clear_refs`` can reset), not ``ru_maxrss``: a process started by another
    inherits the parent's resident size at the fork in ``ru_maxrss``, so a benchmark's
    worker never reported less than its parent's memory (64 MB floors on small models
    once the parent had imported galore-torch)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:  # no /proc: another system
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024  # bytes there, KiB here
