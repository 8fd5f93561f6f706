"""What an experiment gives the trainer: the :class:`Task` protocol."""

from __future__ import annotations

import math
from collections.abc import Mapping
from numbers import Real
from typing import Any, Protocol

import numpy as np
import torch

from comera.errors import ConfigError

__all__ = [
    "BUFFERS",
    "TRAINER_METRICS",
    "Task",
    "check_count",
    "detached_error",
    "eval_terms",
    "loss_terms",
    "replicated_by_name",
    "unreached_error",
]

# the state tree's key for tensors the model updates as it runs (a ModuleTask's persistent
# buffers: batch norm's running statistics, say): under data parallelism the trainer hands
# every rank rank 0's after each step, as DDP's broadcast_buffers does. Not a name a
# submodule can take, so no TT layer's path collides
BUFFERS = "[buffers]"

# what the trainer logs itself in a training row (and the stages' metrics): a task's
# metric of one of these names would overwrite it (a "step" of 3 in every row, which no
# resume could then read), so it is refused; "ranks/" and "eval/" name the trainer's too,
# and "@" and "#" start the names of the sync-free step's own sums
TRAINER_METRICS = frozenset({
    "step", "stage", "loss", "objective", "grad_norm", "lr_scale", "loss_terms", "tokens",
    "live_params", "model_mb", "compression", "step_time_s", "steps_per_s", "tokens_per_s",
    "peak_memory_mb", "gate_reg", "size", "size_budget", "focus_size", "plans_timed",
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
    refused (its curve would join two eval sets under one name).
    Optional ``replicated_tensors() -> list`` names tensors the model uses that are
    neither params nor state (a ModuleTask's frozen parameters): under data parallelism
    the trainer gives every rank rank 0's when it starts, as it does the params. They
    must not change as the run goes: checkpoints hold only their fingerprints (rms and
    magnitudes by block and at fixed positions; an optional ``replicated_named()`` gives
    them by name, as the checkpoint should compare them), and a resume onto other ones is
    refused. The
    state's :data:`BUFFERS` entry holds tensors the model updates as it runs: every rank
    gets rank 0's after each step."""

    train_iter: Any

    def loss(self, params: Any, state: Any, batch: Any, *, train: bool) -> tuple: ...

    def evaluate(self, params: Any, state: Any) -> dict: ...


def replicated_by_name(task: object) -> dict[str, torch.Tensor]:
    """The task's ``replicated_tensors()`` by name: the parameter's name where the task's
    ``model`` names it, else ``replicated tensor I`` (what errors and fingerprints call
    them); empty for a task without any."""
    fn = getattr(task, "replicated_tensors", None)
    tensors = list(fn()) if fn is not None else []
    model = getattr(task, "model", None)
    names = {id(p): n for n, p in model.named_parameters()} if hasattr(
        model, "named_parameters") else {}  # fmt: skip
    return {names.get(id(t), f"replicated tensor {i}"): t for i, t in enumerate(tensors)}


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
    _string_names("Task.loss", metrics, "metrics.jsonl and wandb keys")
    clash = sorted(k for k in metrics if k in TRAINER_METRICS
                   or k.startswith(("ranks/", "eval/", "@", "#")))  # fmt: skip
    if clash:
        raise ValueError(
            f"Task.loss returned metrics named {clash}: the trainer logs these names itself "
            "(step, loss, tokens, ...; see comera.train.task.TRAINER_METRICS), so rename "
            "them (e.g. with a prefix: train/...)"
        )
    # one number each: a per-example loss (reduction='none') failed in torch's broadcasting
    # or in autograd ("grad can be implicitly created only for scalar outputs")
    for what, value in (("sum", s), ("count", n), *((f"metric {k!r}", v) for k, v in
                                                     metrics.items())):  # fmt: skip
        if isinstance(value, torch.Tensor) and value.numel() != 1:
            raise TypeError(
                f"Task.loss returned a {what} of shape {tuple(value.shape)}; each of (sum, "
                "count, metrics) holds one number per batch: sum the batch's loss terms "
                "(loss.sum(), with their count), and average a metric over the batch"
            )
        # a string metric was float()'s error naming no metric; a complex sum autograd's,
        # a bool count was taken as 1
        # Python numbers before numpy's: under torch.compile a count's isinstance against
        # numpy's types specialized it, one graph per count
        if isinstance(value, torch.Tensor):
            ok = not value.dtype.is_complex and (value.dtype != torch.bool or what != "count")
        elif isinstance(value, bool | int | float):
            ok = not (isinstance(value, bool) and what == "count")
        elif isinstance(value, np.ndarray | np.generic):  # numpy's: one real number
            kind = np.asarray(value).dtype.kind
            ok = np.size(value) == 1 and kind in "iuf" + ("" if what == "count" else "b")
        else:  # a Python number (a str, bytes or complex is none)
            ok = (
                hasattr(type(value), "__float__")
                and not isinstance(value, str | bytes | complex)
                and not (isinstance(value, bool) and what == "count")
            )
        if not ok:
            raise TypeError(
                f"Task.loss returned a {what} of {_kind(value)}; each of (sum, count, "
                "metrics) is one real number"
            )
    # numpy's one-element values as Python numbers: float() of a (1,) array is refused
    n, s = _plain(n), _plain(s)
    metrics = {k: _plain(v) for k, v in metrics.items()}
    if not isinstance(s, torch.Tensor):
        if float(s) != 0:  # a number carries no gradient: it trains nothing
            raise TypeError(
                f"Task.loss returned the sum as a {type(s).__name__} ({s!r}); return the "
                "tensor the parameters' gradients flow through (a plain 0 only for a share "
                "with no loss terms)"
            )
        s = torch.zeros((), dtype=torch.float32)  # a share with no terms: its plain zero
    elif s.dim():  # one number of shape (1,): torch's broadcasting refused it later
        s = s.reshape(())
    return s, n, metrics


def _plain(value: object) -> object:
    """A numpy value of one element as the Python number it holds; others as they are."""
    if isinstance(value, torch.Tensor | bool | int | float):  # the common case, first
        return value
    if isinstance(value, np.ndarray | np.generic):
        return np.asarray(value).reshape(()).item()
    return value


def _kind(value: object) -> str:
    """How an error names a value's kind: a tensor's dtype, else its type."""
    return (
        f"dtype {value.dtype}"
        if isinstance(value, torch.Tensor)
        else f"type {type(value).__name__}"
    )


def check_count(n: float) -> None:
    """Refuse a batch's count of loss terms that is not a finite number >= 0 (the eager
    step reads each; a sync-free step sees only the total): NaN was blamed on the learning
    rate, and a negative count offset the other batches' silently."""
    if not math.isfinite(n) or n < 0:
        raise ValueError(
            f"Task.loss returned a count of {n}; the count is how many loss terms the sum "
            "holds: a finite number >= 0"
        )


def _string_names(where: str, metrics: Mapping, logged_as: str) -> None:
    """Refuse metric names that are not strings (``where`` returned them): they are logged
    as ``logged_as``."""
    odd = [k for k in metrics if not isinstance(k, str)]
    if odd:
        raise TypeError(
            f"{where} returned metrics named {odd!r}; metric names are strings (they are "
            f"logged as {logged_as})"
        )


def _eval_number(name: str, value: object) -> float:
    """One number of an ``evaluate`` metric: a Python or numpy number, or a tensor of one
    element; anything else a TypeError naming the metric."""
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
        return float(value)
    if isinstance(value, Real) or (  # numpy's numbers and one-element arrays too
        type(value).__module__ == "numpy"
        and getattr(value, "size", None) == 1
        and getattr(getattr(value, "dtype", None), "kind", "") in "biuf"
    ):
        return float(value.item() if hasattr(value, "item") else value)  # type: ignore[arg-type]
    what = (f"a tensor of shape {tuple(value.shape)}" if isinstance(value, torch.Tensor)
            else type(value).__name__)  # fmt: skip
    raise TypeError(
        f"Task.evaluate returned {what} in metric {name!r}; each metric is a number (averaged "
        "over ranks) or a (sum, count) tuple of numbers (reduced exactly)"
    )


def eval_terms(raw: object) -> list[tuple[str, float, float]]:
    """``(name, sum, count)`` per metric, sorted by name, from what a task's ``evaluate``
    returned: a plain number counts as ``(value, 1)``. Anything else is a TypeError
    naming the form expected (a bug in the task): a tuple of another length would shift
    every later metric's numbers in the reduction, silently."""
    if not isinstance(raw, Mapping):
        raise TypeError(
            f"Task.evaluate returned {type(raw).__name__}; it must return a dict of metric "
            "name to a number or a (sum, count) tuple ({} for none)"
        )
    _string_names("Task.evaluate", raw, "eval/NAME")
    out = []
    for k in sorted(raw):
        v = raw[k]
        if isinstance(v, tuple):
            if len(v) != 2:
                raise TypeError(
                    f"Task.evaluate returned a tuple of {len(v)} values in metric {k!r}; a "
                    "tuple is (sum, count): the sum over this rank's held-out share and how "
                    "many terms it holds"
                )
            out.append((k, _eval_number(k, v[0]), _eval_number(k, v[1])))
        else:
            out.append((k, _eval_number(k, v), 1.0))
    return out


def detached_error() -> ConfigError:
    """The error for a share whose loss terms count but whose sum has no gradient: autograd's
    own error names neither the task nor why."""
    return ConfigError(
        "Task.loss returned a sum that does not depend on the parameters the "
        "trainer passed (it has no grad: detached, computed under no_grad, or a "
        "constant); compute it from those params (a ModuleTask's loss_fn runs "
        "the model through its call argument)"
    )


def unreached_error() -> ConfigError:
    """The error for a first step whose loss reached none of the trainer's leaves (say a
    ModuleTask loss_fn calling the module itself, not ``call``): every gradient came back
    missing, was filled with zeros, and the run would train nothing."""
    return ConfigError(
        "Task.loss's sum reaches none of the parameters the trainer passed: no gradient "
        "flows to them, so the run would train nothing; compute the loss from those "
        "params (a ModuleTask's loss_fn runs the model through its call argument, not "
        "the module itself)"
    )
