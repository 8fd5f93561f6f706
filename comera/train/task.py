"""What an experiment gives the trainer: the :class:`Task` protocol."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["Task", "sum_and_count"]


class Task(Protocol):
    """What an experiment provides.

    ``loss`` returns ``(sum, count, metrics)``: the sum of the batch's loss terms, how many
    there are (examples, masked tokens...) and per-batch means to log; the trainer divides
    by the global count, so data-parallel averaging is exact. (A legacy ``(mean, metrics)``
    pair counts as one term.) ``evaluate(params, state, rank=, world=)`` returns metrics as
    ``(sum, count)`` pairs over this rank's share of the held-out data (reduced exactly) or
    plain floats (averaged over ranks). ``train_iter`` has ``state_dict``/``load_state_dict``
    and ``rescalable = True`` when it can load the states of another world size.
    An optional ``on_compaction(params, state)`` rebuilds anything shape-dependent.
    Optional ``batch_tokens(batch) -> int`` counts a batch's input tokens: the trainer then
    logs ``tokens`` per step and ``tokens_per_s`` (all ranks together). Optional
    ``derive_eval(metrics) -> dict`` adds metrics computed from the reduced held-out ones
    (e.g. perplexity from the mean loss, which no ``(sum, count)`` pair can express)."""

    train_iter: Any

    def loss(self, params: Any, state: Any, batch: Any, *, train: bool) -> tuple: ...

    def evaluate(self, params: Any, state: Any) -> dict: ...


def sum_and_count(out: tuple) -> tuple[torch.Tensor, float, dict]:
    """Normalize a task's loss output to ``(sum, count, metrics)``."""
    if len(out) == 3:
        s, n, metrics = out
        return s, float(n), metrics
    mean, metrics = out  # legacy: a mean over the batch counts as one term
    return mean, 1.0, metrics
