"""What an experiment gives the trainer: the :class:`Task` protocol."""

from __future__ import annotations

from typing import Any, Protocol

import torch

__all__ = ["TRAINER_METRICS", "Task", "loss_terms"]

# what the trainer logs itself in a training row (and the stages' metrics): a task's
# metric of one of these names would overwrite it (a "step" of 3 in every row, which no
# resume could then read), so it is refused; "ranks/" and "eval/" name the trainer's too,
# and "@" and "#" start the names of the sync-free step's own sums
TRAINER_METRICS = frozenset({
    "step", "stage", "loss", "objective", "grad_norm", "lr_scale", "loss_terms", "tokens",
    "live_params", "model_mb", "compression", "step_time_s", "steps_per_s", "tokens_per_s",
    "peak_memory_mb", "gate_reg", "size", "size_budget", "focus_size",
})  # fmt: skip


class Task(Protocol):
    """What an experiment provides.

    ``loss`` returns ``(sum, count, metrics)``: the sum of the batch's loss terms, how many
    there are (examples, masked tokens...) and per-batch means to log; the trainer divides
    by the global count, so data-parallel averaging is exact. A task whose loss is a batch
    mean returns ``(mean, 1, metrics)`` (one term). ``evaluate(params, state, rank=,
    world=)`` returns metrics as ``(sum, count)`` pairs over this rank's share of the
    held-out data (reduced exactly) or plain floats (averaged over ranks). ``train_iter``
    yields ``steps x accum_steps`` batches; it has ``state_dict``/``load_state_dict`` for an
    exact resume (without them a resume restarts it, warned) and ``rescalable = True``
    when it can load the states of another world size.
    An optional ``on_compaction(params, state)`` rebuilds anything shape-dependent.
    Optional ``batch_tokens(batch) -> int`` counts a batch's input tokens: the trainer then
    logs ``tokens`` per step and ``tokens_per_s`` (all ranks together). Optional
    ``derive_eval(metrics) -> dict`` adds metrics computed from the reduced held-out ones
    (e.g. perplexity from the mean loss, which no ``(sum, count)`` pair can express).
    Optional ``eval_data_id``, a dict of eval split name to a digest of its examples (of
    the whole split, the same on every rank: rank 0's is saved, every rank checks it), is
    kept in checkpoints: a resume whose split of a saved name holds other examples is
    refused (its curve would join two eval sets under one name)."""

    train_iter: Any

    def loss(self, params: Any, state: Any, batch: Any, *, train: bool) -> tuple: ...

    def evaluate(self, params: Any, state: Any) -> dict: ...


def loss_terms(out: object) -> tuple[torch.Tensor, Any, dict]:
    """``(sum, count, metrics)`` from what a task's ``loss`` returned, or a TypeError that
    names the form expected (a bug in the task, so a traceback, not a one-line error)."""
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        got = f"{len(out)} values" if isinstance(out, (tuple, list)) else type(out).__name__
        raise TypeError(
            f"Task.loss returned {got}; it must return (sum, count, metrics): the sum of the "
            "batch's loss terms, how many terms there are and a dict of per-batch metrics. "
            "The old (mean, metrics) form is gone: return (mean, 1, metrics) to count a "
            "batch mean as one term"
        )
    s, n, metrics = out
    if not isinstance(metrics, dict):
        raise TypeError(
            f"Task.loss returned metrics of type {type(metrics).__name__}; return a dict of "
            "per-batch metrics as the third value ({} for none)"
        )
    odd = [k for k in metrics if not isinstance(k, str)]
    if odd:
        raise TypeError(
            f"Task.loss returned metrics named {odd!r}; metric names are strings (they are "
            "logged as metrics.jsonl and wandb keys)"
        )
    clash = sorted(k for k in metrics if k in TRAINER_METRICS
                   or k.startswith(("ranks/", "eval/", "@", "#")))  # fmt: skip
    if clash:
        raise ValueError(
            f"Task.loss returned metrics named {clash}: the trainer logs these names itself "
            "(step, loss, tokens, ...; see comera.train.task.TRAINER_METRICS), so rename "
            "them (e.g. with a prefix: train/...)"
        )
    return s, n, metrics
