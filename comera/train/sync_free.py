"""A train step with no host sync inside it, runnable eagerly, compiled or as a CUDA graph.

:meth:`comera.train.Trainer.train_step` reads the loss and the gradient norm on the host
in mid-step (the late-stage weights, the non-finite checks, the clip factor), and every such
read makes the host wait for the device. :class:`SyncFreeStep` does the same step with every
decision kept on the device:

- the stage objective's weights are tensors (:meth:`StageController.device_objective`);
- the learning-rate scale and the regularizer's on/off are device scalars the host fills
  before the step, not constants baked into a graph;
- a non-finite loss or gradient norm turns the update into a no-op on the device (AdamW's
  moments, step count and weight decay included) and is raised on the host afterwards, so
  "no parameter or optimizer state was updated" holds as in the eager loop;
- the step's scalars come back in one tensor, read once after the work is queued.

Modes (``train.step_mode``): ``sync_free`` runs it eagerly (the reference the other two
are tested against); ``compile`` wraps it in ``torch.compile``; ``cuda_graph`` captures
it once per set of tensors and batch shapes and replays it. Prunes, compactions and
checkpoint restores replace the model's tensors: a CUDA graph is rebuilt when any tensor
is replaced, compiled code when a shape changes (a compaction, not a prune).

Supported: AdamW and SGD with dense gradients (a sparse gradient is refused with the flag
to change), any number of micro-batches, data parallelism (the reduction stays on the
device). GaLore refreshes its projectors on the host and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from comera.errors import ConfigError
from comera.layers import SyncFreeLookups
from comera.train.config import STEP_MODES, TrainConfig, check_step_mode_device
from comera.train.distributed import sum_across_ranks
from comera.train.measures import lr_scale
from comera.train.optim import GROUPS, leaf_groups
from comera.train.stages import StageController
from comera.train.task import Task, detached_error, loss_terms, unreached_error

__all__ = ["STEP_MODES", "SyncFreeStep", "require_traceable_grad"]

WARMUP_STEPS = 3  # eager steps on a side stream before a CUDA graph is captured
COMPILE_BACKEND = "inductor"  # tests use "aot_eager": the same capture, no C++ build


def _scalar(x: Any, dev: torch.device) -> torch.Tensor:
    """A float64 device scalar. A Python number becomes a fill, not a host-to-device copy
    (allowed while a CUDA graph captures, where its value is then fixed: counts that are
    Python numbers must depend on the batch's shapes only, as ``len(labels)`` does)."""
    if isinstance(x, torch.Tensor):
        if x.device != dev and dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise ValueError(
                f"train.step_mode='cuda_graph': the task returned a loss term, count or "
                f"metric on {x.device}, which a CUDA graph cannot copy; return it on {dev} "
                "(or as a Python number fixed by the batch's shapes), or use "
                "train.step_mode='sync_free'"
            )
        return x.to(device=dev, dtype=torch.float64)
    return torch.full((), float(x), dtype=torch.float64, device=dev)


def require_traceable_grad() -> None:
    """The ``compile`` step mode traces ``autograd.grad`` into its graph, which needs
    ``torch._dynamo.config.trace_autograd_ops`` (first in torch 2.11): a clear error on an
    older torch rather than an AttributeError from inside the first step."""
    import torch._dynamo

    if not hasattr(torch._dynamo.config, "trace_autograd_ops"):
        raise ConfigError(
            f"train.step_mode='compile' traces autograd.grad into the compiled step, which "
            f"needs torch >= 2.11 (this is {torch.__version__}); use --step-mode sync_free "
            "or eager"
        )


class SyncFreeStep:
    """One optimizer step with its decisions on the device (module doc).

    Built from what the step needs, not from a trainer: ``mode`` (``train.step_mode``),
    the run's ``cfg``, the ``task`` whose ``loss`` (and optional ``batch_tokens``) it runs,
    the ``stages`` controller it asks for the objective and tells the loss, and
    ``non_finite(what, value)``, the exception to raise when the loss or gradient norm is
    not finite (the caller's, so both step paths say the same). Each call,
    ``(params, state, opt, step, *batches)``, takes the model's current tensors: a prune,
    a compaction or a restore replaces them between calls."""

    def __init__(
        self,
        mode: str,
        cfg: TrainConfig,
        task: Task,
        stages: StageController,
        *,
        non_finite: Callable[[str, float], Exception],
    ) -> None:
        if mode not in STEP_MODES[1:]:
            raise ConfigError(f"train.step_mode={mode!r}; choose one of {STEP_MODES}")
        dev = torch.device(cfg.device)
        check_step_mode_device(mode, cfg.device)
        if mode == "compile":
            require_traceable_grad()
        self.mode, self.cfg, self.task, self.stages = mode, cfg, task, stages
        self.device, self.non_finite = dev, non_finite
        # host-filled inputs: tensors, so graphs read the value of the step they run in
        self.lr_scale = torch.zeros((), dtype=torch.float64, device=dev)
        self.gamma = torch.zeros((), dtype=torch.float64, device=dev)
        self.adam_step = torch.zeros((), dtype=torch.float64, device=dev)
        self.size_gap = torch.zeros((), dtype=torch.float64, device=dev)
        self.inv_budget = torch.zeros((), dtype=torch.float64, device=dev)
        self._host = (self.lr_scale, self.gamma, self.adam_step, self.size_gap, self.inv_budget)
        self._keys: list[str] | None = None
        self._groups: list[str] = []  # each leaf's learning-rate group, set every call
        self._identity: tuple = ()
        self._graphs: dict[tuple, tuple] = {}
        self._warm: dict[tuple, int] = {}
        self._compiled: Any = None
        self._alive: list = []

    # ------------------------------------------------------------------ the device work

    def _work(
        self, params: Any, state: Any, m: Any, v: Any, batches: tuple, host: tuple
    ) -> tuple[torch.Tensor, list[str]]:
        """The whole step on the device. ``host`` is ``(lr_scale, gamma, adam_step,
        size_gap, inv_budget)``, the scalars the host filled (explicit inputs, so compiled
        code never bakes them in; the last two feed the late stage's size term).
        Returns ``(scalars, keys)``: float64 ``[loss_sum, count, grad_norm, ok, *metric
        values]`` and the metric names."""
        lr_scale_t, gamma_t, adam_step_t, size_gap_t, inv_budget_t = host
        cfg = self.cfg
        leaves, _ = tree_flatten(params)
        grads: list[torch.Tensor | None] = [None] * len(leaves)
        dev = leaves[0].device
        loss_sum = torch.zeros((), dtype=torch.float64, device=dev)
        count = torch.zeros((), dtype=torch.float64, device=dev)
        sums: dict[str, torch.Tensor] = {}
        count_tokens = getattr(self.task, "batch_tokens", None)
        if count_tokens is not None:
            sums["tokens"] = sum([_scalar(count_tokens(b), dev) for b in batches])  # type: ignore[assignment]
        reached = False  # whether the loss reached a leaf on this rank
        detached = count.new_zeros(())  # shares whose terms count but whose sum has no grad
        for batch in batches:
            with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16):
                s, n, metrics = loss_terms(self.task.loss(params, state, batch, train=True))
            n = _scalar(n, dev)
            if not s.requires_grad:  # known while tracing; whether it counts is the device's
                detached = detached + (n > 0).double()
            # a rank's empty share (no terms) may be a plain zero, with no gradient
            parts = torch.autograd.grad(s, leaves, allow_unused=True) if s.requires_grad else ()
            # known while tracing (which gradients exist), so no host read: a constant
            reached = reached or any(g is not None for g in parts)
            for i, g in enumerate(parts):
                if g is not None and g.is_sparse:
                    raise ConfigError(
                        f"train.step_mode={self.mode!r} needs dense gradients and the model "
                        "produced a sparse one (sparse embedding gradients); use "
                        "train.step_mode='eager' or dense embedding gradients"
                    )
                if g is not None:
                    grads[i] = g.clone() if grads[i] is None else grads[i].add_(g)
            loss_sum = loss_sum + s.detach().double()
            count = count + n
            for k, val in metrics.items():
                val = _scalar(val, dev)
                sums[k] = sums[k] + val * n if k in sums else val * n
        grads = [
            torch.zeros_like(t) if g is None else g for g, t in zip(grads, leaves, strict=True)
        ]
        keys = sorted(sums)
        scalars = torch.stack([loss_sum, count, *(sums[k] for k in keys),
                               loss_sum.new_full((), float(reached)), detached])  # fmt: skip
        *grads, scalars = sum_across_ranks([*grads, scalars])
        loss_sum, count = scalars[0], scalars[1]
        loss_mean = loss_sum / count.clamp(min=1e-300)
        weight, term, obj_metrics = self.stages.device_objective(
            loss_mean, params, state, gamma_t, late=(size_gap_t, inv_budget_t)
        )
        torch._foreach_mul_(grads, (weight / count).float())
        if term is not None:
            for g, t in zip(
                grads, torch.autograd.grad(term, leaves, allow_unused=True), strict=True
            ):
                if t is not None:
                    g.add_(t)
        norm = torch.stack([n.double() for n in torch._foreach_norm(grads)]).norm()
        # a loss that reached no leaf on any rank, or a detached share that counts, updates
        # nothing either (the host refuses it)
        ok = (torch.isfinite(loss_mean) & torch.isfinite(norm) & (count > 0)
              & (scalars[-2] > 0) & (scalars[-1] == 0))  # fmt: skip
        if cfg.grad_clip:
            torch._foreach_mul_(grads, (cfg.grad_clip / (norm + 1e-6)).clamp(max=1.0).float())
        for g in grads:  # a no-op step must not pull NaN into the moments
            g.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0)
        # finite but huge entries (g * g overflowing) would still give inf * 0 = NaN there
        torch._foreach_mul_(grads, ok.to(grads[0].dtype) if grads else ok)
        self._update(leaves, grads, m, v, ok, lr_scale_t, adam_step_t)
        obj_keys = sorted(obj_metrics)
        out = torch.stack(
            [
                loss_sum,
                count,
                norm,
                ok.double(),
                weight.double(),
                *(_scalar(obj_metrics[k], dev) for k in obj_keys),
                *(scalars[2 + i] for i in range(len(keys))),
                scalars[-2],
                scalars[-1],
            ]
        )
        return out, ["@weight", *obj_keys, *(f"#{k}" for k in keys), "@reached", "@detached"]

    @torch.no_grad()
    def _update(
        self,
        leaves: list,
        grads: list,
        m: Any,
        v: Any,
        ok: torch.Tensor,
        lr_scale_t: torch.Tensor,
        adam_step_t: torch.Tensor,
    ) -> None:
        """AdamW or SGD with the lr scale and step count as device scalars; ``ok`` False
        leaves every parameter, moment and the step count as they were."""
        cfg = self.cfg
        okf = ok.double()
        groups = self._groups
        if cfg.optimizer == "sgd":
            for p, g, group in zip(leaves, grads, groups, strict=True):
                p.sub_(g * (cfg.sgd.lr_for(group) * lr_scale_t * okf).to(g.dtype))
            return
        o = cfg.optim
        ms, _ = tree_flatten(m)
        vs, _ = tree_flatten(v)
        b1, b2 = o.betas
        # not adam_step_t.add_: torch.compile (2.13, CPU) loses in-place changes to 0-dim
        # inputs, within the graph and after it; the host refills the count every step
        t = (adam_step_t + okf).clamp(min=1.0)
        bc1, bc2 = 1 - b1**t, 1 - b2**t
        for group in GROUPS:
            idx = [i for i, gr in enumerate(groups) if gr == group and leaves[i].numel()]
            if not idx:
                continue
            ps, gs = [leaves[i] for i in idx], [grads[i] for i in idx]
            mg, vg = [ms[i] for i in idx], [vs[i] for i in idx]
            lr = o.lr(group) * lr_scale_t * okf
            dt = ps[0].dtype
            if o.weight_decay and group != "gates":
                decayed = [p for p in ps if p.dim() >= 2]
                if decayed:
                    torch._foreach_mul_(decayed, (1 - lr * o.weight_decay).to(dt))
            # v += (g^2 - v) (1 - b2) and m += (g - m) (1 - b1), both gated by ok
            sq = torch._foreach_mul(gs, gs)
            torch._foreach_sub_(sq, vg)
            torch._foreach_mul_(sq, ((1 - b2) * okf).to(dt))
            torch._foreach_add_(vg, sq)
            torch._foreach_sub_(gs, mg)
            torch._foreach_mul_(gs, ((1 - b1) * okf).to(dt))
            torch._foreach_add_(mg, gs)
            # p -= lr / bc1 * m / (sqrt(v / bc2) + eps), reusing sq for the update
            torch._foreach_copy_(sq, vg)
            torch._foreach_mul_(sq, (1 / bc2).to(dt))
            torch._foreach_sqrt_(sq)
            torch._foreach_add_(sq, o.eps)
            torch._foreach_reciprocal_(sq)
            torch._foreach_mul_(sq, mg)
            torch._foreach_mul_(sq, (lr / bc1).to(dt))
            torch._foreach_sub_(ps, sq)

    # ------------------------------------------------------------------ the host side

    def _run(self, params: Any, state: Any, m: Any, v: Any, batches: tuple) -> torch.Tensor:
        with SyncFreeLookups():  # the model's TTM lookups: no host sync inside the step
            return self._run_mode(params, state, m, v, batches)

    def _run_mode(self, params: Any, state: Any, m: Any, v: Any, batches: tuple) -> torch.Tensor:
        if self.mode == "sync_free":
            out, self._keys = self._work(params, state, m, v, batches, self._host)
            return out
        if self.mode == "compile":
            if self._compiled is None:
                self._compiled = torch.compile(self._work, dynamic=False, backend=COMPILE_BACKEND)
            # autograd.grad traced into the graph: forward, backward and update in one
            with torch._dynamo.config.patch(trace_autograd_ops=True):
                out, self._keys = self._compiled(params, state, m, v, batches, self._host)
            return out
        return self._replay(params, state, m, v, batches)

    def _replay(self, params: Any, state: Any, m: Any, v: Any, batches: tuple) -> torch.Tensor:
        """CUDA graphs: warm up eagerly on a side stream, capture, then replay with the
        batch copied into the graph's static inputs."""
        leaves, _ = tree_flatten(batches)
        batch_leaves = [b for b in leaves if isinstance(b, torch.Tensor)]
        shapes = tuple((tuple(b.shape), b.dtype) for b in batch_leaves)
        # non-tensor leaves are baked into the graph: a new value is a new graph
        key = (
            self.stages.stage,
            shapes,
            tuple(repr(b) for b in leaves if not isinstance(b, torch.Tensor)),
        )
        if key in self._graphs:
            graph, static_leaves, out = self._graphs[key]
            for dst, src in zip(static_leaves, batch_leaves, strict=True):
                dst.copy_(src, non_blocking=True)
            graph.replay()
            return out
        if self._warm.get(key, 0) < WARMUP_STEPS:
            self._warm[key] = self._warm.get(key, 0) + 1
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                out, self._keys = self._work(params, state, m, v, batches, self._host)
            torch.cuda.current_stream().wait_stream(side)
            return out
        static = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, batches)
        static_leaves = [t for t in tree_flatten(static)[0] if isinstance(t, torch.Tensor)]
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            out, self._keys = self._work(params, state, m, v, static, self._host)
        self._graphs[key] = (graph, static_leaves, out)
        graph.replay()  # capture records the step; replay runs it
        return out

    def _check_identity(self, params: Any, state: Any, m: Any, v: Any) -> None:
        """Drop what was built for tensors that are gone.

        A CUDA graph holds the addresses of the tensors it was captured with, so it is
        rebuilt whenever one is replaced (a compaction, a checkpoint restore) or the late
        targets change; a prune writes its masks into the tensors it had (the trainer's
        ``_masks_in_place``), so the graph replays with them. Compiled code takes the
        tensors as inputs and only depends on their shapes: it is rebuilt after a
        compaction (and the stage transition), not after a prune, and old graphs are
        dropped rather than left to fill dynamo's recompile limit."""
        leaves = [*tree_flatten((params, state, m, v))[0]]
        if self.mode == "compile":
            if any(t.dim() == 0 for t in leaves):  # rank masks are never 0-dim
                raise ConfigError(
                    "train.step_mode='compile' cannot update 0-dim parameters in place "
                    "(torch.compile drops in-place changes to 0-dim inputs); give them "
                    "shape (1,) or use train.step_mode='sync_free'"
                )
            ident: tuple = (
                self.stages.stage,
                tuple((tuple(t.shape), t.dtype) for t in leaves),
            )
        else:
            ident = (tuple(id(t) for t in leaves), tuple(sorted(self.stages.targets.items())))
        if ident != self._identity:
            self._graphs.clear()
            self._warm.clear()
            if self._compiled is not None:  # process-wide: other compiled code is dropped too
                torch._dynamo.reset()
                self._compiled = None
            self._identity = ident
            self._alive = leaves  # held, so no id above can be reused by a new tensor

    def __call__(
        self, params: Any, state: Any, opt: dict, step: int, *batches: Any
    ) -> tuple[dict, dict]:
        """Take optimizer step ``step`` (1-based) over ``batches`` (micro-batches), updating
        ``params`` and ``opt``'s moments in place. Returns the step's metrics and the
        optimizer state with its step count advanced; raises ``non_finite(...)`` with
        nothing updated when the loss or gradient norm is not finite."""
        cfg = self.cfg
        m, v = opt.get("m", {}), opt.get("v", {})
        self._check_identity(params, state, m, v)
        groups = opt.get("groups") or leaf_groups(params)
        if groups != self._groups:  # the same list while it holds the same: a stable input
            self._groups = groups
        c = cfg.comera
        self.lr_scale.fill_(lr_scale(cfg, step))
        early = self.stages.stage == "early"
        self.gamma.fill_(c.gamma if early and step > c.reg_start_step else 0.0)
        if "m" in opt:
            self.adam_step.fill_(float(opt["step"]))
        late = self.stages.late_inputs(step)
        if late is not None:
            self.size_gap.fill_(late[0])
            self.inv_budget.fill_(late[1])
        if self.mode == "cuda_graph":  # the graph's inputs live on the device
            dev = self.device
            batches = tree_map(
                lambda t: t.to(dev, non_blocking=True) if isinstance(t, torch.Tensor) else t,
                batches,
            )
        out = self._run(params, state, m, v, batches).cpu().tolist()  # the step's one read
        keys = self._keys or []
        loss_sum, count, gnorm, ok, *rest = out
        named = dict(zip(keys, rest, strict=True))
        if count <= 0:  # its total is all a sync-free step reads: a negative count shows
            raise ValueError(
                f"step {step}: the global batch has no loss terms (count {count:g}); Task.loss "
                "returns how many loss terms its sum holds: a finite number >= 0"
            )
        if named.pop("@detached"):  # on some rank: nothing was updated
            raise detached_error()
        if not named.pop("@reached"):  # on no rank: nothing was updated
            raise unreached_error()
        loss_value = loss_sum / count
        if not ok:
            what, value = (
                ("loss", loss_value)
                if not math.isfinite(loss_value)
                else ("the gradient norm", gnorm)
            )
            raise self.non_finite(what, value)
        self.stages.observe(loss_value)
        weight = named.pop("@weight")
        obj = {k: v for k, v in named.items() if not k.startswith("#")}
        term_value = obj.get("@term", 0.0)
        obj.pop("@term", None)
        sums = {k[1:]: v for k, v in named.items() if k.startswith("#")}
        metrics = {
            "loss": loss_value,
            "objective": weight * loss_value + term_value,
            "grad_norm": gnorm,
            "lr_scale": lr_scale(cfg, step),
            "loss_terms": count,
            **obj,
            **{k: val if k == "tokens" else val / count for k, val in sums.items()},
        }
        return metrics, {**opt, "step": opt["step"] + 1}
