"""The training loop: wires the stage controller, exact reduction, checkpoints and logs.

An experiment supplies a :class:`Task`; :class:`Trainer` runs it for ``cfg.steps`` optimizer
steps of ``cfg.accum_steps`` micro-batches each, with CoMERA rank adaptation
(:mod:`comera.train.stages`), exact data parallelism (:mod:`comera.train.distributed`),
checkpoints (:mod:`comera.train.checkpoint`) and records (:mod:`comera.train.logging`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import math
import numbers
import random
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from numbers import Integral
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from comera.autotune import LINEAR_CANDIDATES, current_tuner, rekey, summarize_decisions
from comera.errors import CheckpointError, ConfigError, DataError, UserError
from comera.layers import SyncFreeLookups
from comera.plans import DIRECT_STRATEGIES
from comera.train import checkpoint as ck
from comera.train.config import TrainConfig, usable_device
from comera.train.distributed import (
    broadcast_object,
    broadcast_tensors,
    check_alike,
    check_rank_device,
    init_distributed,
    rank_world,
    sum_across_ranks,
    union_names,
)
from comera.train.galore import GaLore
from comera.train.logging import (
    RunLog,
    last_logged,
    read_metrics,
    write_json_atomic,
    write_rank_snapshot,
)
from comera.train.measures import lr_scale, model_size, peak_memory_mb
from comera.train.optim import adamw_init, adamw_step, leaf_groups, sgd_step
from comera.train.run_lock import RunDirLock, hold_run_dir
from comera.train.stages import StageController
from comera.train.sync_free import SyncFreeStep
from comera.train.task import (
    BUFFERS,
    Task,
    check_count,
    detached_error,
    eval_terms,
    loss_terms,
    replicated_by_name,
    unreached_error,
)
from comera.tree import compact_tree, iter_tt, prune_to_size, prune_tree
from comera.tree import leaves as tree_leaves

__all__ = ["NonFiniteLoss", "Trainer"]


class NonFiniteLoss(RuntimeError):
    """The loss or gradient became NaN or inf; the last good checkpoint is left in place.

    ``what``: what happened, without the advice that follows it (a caller that knows
    more, such as an ablation that swept the setting, gives its own)."""

    def __init__(self, message: str, what: str | None = None) -> None:
        super().__init__(message)
        self.what = message if what is None else what


def _accumulate(into: list[torch.Tensor | None], grads: tuple[torch.Tensor | None, ...]) -> None:
    """Add ``grads`` into ``into``; a sparse gradient stays sparse until a dense one joins.

    The buffers kept must be the trainer's own, since the loop later scales and clips in
    place: a dense gradient autograd hands back may be a broadcast view (``x.sum()`` gives
    an expanded scalar) or share memory with another leaf's (``a + b`` gives both the same
    tensor), and those are copied on first store. A contiguous gradient whose memory no
    other one in this call overlaps is kept as it is, a slice of a larger buffer included
    (the gradients of trains stacked by :class:`comera.plans.GroupedHalves` are disjoint
    slices of one): a TT model has many small leaves, and the copies cost more than the
    step's arithmetic on them. Sparse gradients are never modified in place."""
    spans: dict[int, list[tuple[float, float]]] = {}  # storage -> byte ranges stored
    for i, g in enumerate(grads):
        if g is None:
            continue
        acc = into[i]
        if acc is None:
            if g.is_sparse:
                into[i] = g
                continue
            taken = spans.setdefault(g.untyped_storage().data_ptr(), [])
            if g.is_contiguous():  # the bytes it spans in its storage
                size = g.element_size()
                lo = g.storage_offset() * size
                hi = lo + g.numel() * size
                kept = not taken or not any(a < hi and lo < b for a, b in taken)
            else:  # a strided view may reach anywhere in its storage
                lo, hi, kept = -math.inf, math.inf, False
            into[i] = g if kept else g.clone(memory_format=torch.contiguous_format)
            taken.append((lo, hi))
        elif acc.is_sparse:
            into[i] = g + acc  # sparse + sparse stays sparse; a dense g makes it dense
        else:
            acc.add_(g)


# an evaluation's out-of-memory errors (torch.OutOfMemoryError is newer than some torches
# the project takes; torch.cuda's is its older name)
_OUT_OF_MEMORY = (MemoryError, getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError))


def _grad_norm(grads: list[torch.Tensor | None]) -> torch.Tensor:
    """Global L2 norm of dense and (coalesced) sparse gradients."""
    dense = [g for g in grads if g is not None and not g.is_sparse]
    sparse = [g._values().float().norm() for g in grads if g is not None and g.is_sparse]
    # the per-leaf norms of one kind stacked, then one cast: a model of a hundred small
    # leaves paid a hundred casts per step for it
    parts: list[torch.Tensor] = [torch.stack(sparse)] if sparse else []
    if dense:  # the norms in fp32 by the call itself, not a cast per leaf
        wide = any(g.dtype == torch.float64 for g in dense)
        norms = torch._foreach_norm(dense, 2, dtype=torch.float64 if wide else torch.float32)
        parts.insert(0, torch.stack(norms))
    if not parts:
        return torch.zeros(())
    # combined and returned in fp64, as the sync-free step does: finite per-leaf norms
    # whose squares sum past fp32's range (20 leaves of 5e18) made the norm inf and
    # stopped the run
    return torch.cat([p.double() for p in parts]).norm()


def _scale(grads: list[torch.Tensor | None], factor: float | torch.Tensor) -> None:
    """Multiply every gradient by ``factor``: dense ones in place, sparse ones replaced."""
    dense = [g for g in grads if g is not None and not g.is_sparse]
    given = factor
    dtypes = {g.dtype for g in dense}
    if (
        isinstance(factor, float)
        and len(dtypes) == 1
        and dense[0].dtype in (torch.float32, torch.float64)
        and dense[0].device.type == "cpu"
    ):
        # on CPU foreach runs one op per tensor, and a Python number is converted to each
        # tensor's dtype on every one of them; a 0-dim tensor of that dtype is not. The
        # product is the same: a float32 kernel computes with the number in float32 too
        # (other dtypes, or a mix, keep the number)
        factor = torch.tensor(factor, dtype=dense[0].dtype)
    if dense:
        torch._foreach_mul_(dense, factor)
    for i, g in enumerate(grads):
        if g is not None and g.is_sparse:
            grads[i] = g * given


class Trainer:
    """Runs a :class:`Task` for ``cfg.steps`` steps with CoMERA rank adaptation.

    ``reference_size`` is what compression is measured against (e.g. the dense model's
    parameter count); by default the model's size at the start. ``on_compact`` holds
    callbacks run after every compaction (the task's ``on_compaction`` is one).
    ``copy=False`` hands the tensors of ``params`` and ``state`` to the trainer, which then
    updates them in place (parameters by the optimizer, rank masks by each prune) instead
    of copying them first (the CLI does this: it built them for the run; a
    :class:`~comera.train.ModuleTask` does, so its module follows the trainer).
    ``auto_plans=True`` says the model asks for ``plan="auto"`` (:mod:`comera.autotune`):
    the trainer then decides the plans in an eager pass before a compiled or captured
    step, keeps every rank on rank 0's decisions and reinstalls a resumed run's; the
    decisions any run makes are recorded either way.

    What it changes outside itself, on purpose: the run dir, and the global RNGs of Python's
    ``random`` and torch, seeded with ``cfg.seed + rank`` (restored from the checkpoint on
    resume), because tasks draw dropout and noise from them. Nothing else: no environment
    variable, allocator policy (``train.cpu_malloc`` is applied by the entry point, see
    ``experiments.malloc``), thread count or torch setting. (``step_mode='compile'`` resets
    dynamo's compiled code after a compaction, see :mod:`comera.train.sync_free`.)"""

    def __init__(
        self,
        cfg: TrainConfig,
        task: Task,
        params: object,
        state: object,
        *,
        resume: bool = False,
        extra_config: dict | None = None,
        reference_size: int | None = None,
        copy: bool = True,
        auto_plans: bool = False,
    ) -> None:
        # the run dir's lock shares _setup took, released if it fails (read nowhere else)
        self._locks: list[RunDirLock] = []
        try:
            self._setup(
                cfg,
                task,
                params,
                state,
                resume=resume,
                extra_config=extra_config,
                reference_size=reference_size,
                copy=copy,
                auto_plans=auto_plans,
            )
        except BaseException:
            # a refused trainer gives the run dir back at once, not when its exception (kept
            # by a notebook, a retry loop, pytest.raises) is collected
            for lock in self._locks:
                lock.release()
            raise

    def _setup(
        self,
        cfg: TrainConfig,
        task: Task,
        params: object,
        state: object,
        *,
        resume: bool,
        extra_config: dict | None,
        reference_size: int | None,
        copy: bool,
        auto_plans: bool,
    ) -> None:
        self.cfg, self.task = cfg, task
        # a bare AttributeError at the first step, or (evaluate) after training, before
        # that step's checkpoint: the training lost
        needed = ("train_iter", "loss", *(("evaluate",) if cfg.eval_every else ()))
        missing = [m for m in needed if not hasattr(task, m)]
        if missing:
            raise TypeError(
                f"Trainer: the task ({type(task).__name__}) has no {', '.join(missing)}; a task "
                "gives train_iter, loss(params, state, batch, *, train) and, to evaluate "
                "(train.eval_every), evaluate(params, state) (comera.train.Task)"
            )
        usable_device(cfg.device)  # a bare traceback at the first .to() otherwise
        # under torchrun, join the process group (once): without it every rank trained alone
        # into one run dir, its checkpoints claiming a world of 1
        init_distributed(cfg.device)
        check_rank_device(cfg.device)
        self.device = torch.device(cfg.device)
        self.run_dir = Path(cfg.run_dir)
        # a file there (or on the way there) was a raw FileExistsError or NotADirectoryError
        found = next((p for p in (self.run_dir, *self.run_dir.parents) if p.exists()), None)
        if found is not None and not found.is_dir():
            raise ConfigError(f"TrainConfig.run_dir={cfg.run_dir}: {found} is a file, not a "
                              "folder; give a folder (new, or the run's to resume)")  # fmt: skip
        self.rank, self.world = rank_world()
        # a run's folder (it holds a lock file) another process trains into is refused as
        # such, before the checks below read its files (which would advise deleting them)
        lock_flag = "" if resume else "run_dir (--run-dir)"
        self._locks.append(hold_run_dir(self.run_dir, self.rank, self.world, flag=lock_flag,
                                        existing=True))  # fmt: skip
        if reference_size is not None and (
            isinstance(reference_size, bool) or not isinstance(reference_size, numbers.Integral)
            or reference_size < 1
        ):  # -5 made every "compression" negative, "abc" failed at the stage switch  # fmt: skip
            raise ConfigError(
                f"Trainer: reference_size={reference_size!r} must be a parameter count >= 1 "
                "(the dense model's size compression is measured against), or None"
            )
        saves = self.run_dir / ck.CHECKPOINTS
        if saves.exists() and not saves.is_dir():  # trained every step, then failed to save
            raise CheckpointError(
                f"{saves} is a file; the trainer writes its checkpoints into a folder of that "
                "name: move the file away"
            )
        held = [] if resume else ck.complete_checkpoints(self.run_dir)
        if held:  # its newer checkpoints would win over this run's: each new one deleted
            raise CheckpointError(
                f"{self.run_dir} already holds checkpoints of a run (newest: {held[-1].name}); "
                "continue it with resume=True, or give this run another run_dir (nothing "
                "there is overwritten)"
            )
        metrics = self.run_dir / "metrics.jsonl"
        if not resume and metrics.is_file() and metrics.stat().st_size:
            # a run that stopped before its first checkpoint: this run's rows would follow
            # its rows in one file (the CLI's --resume starts such a run over instead)
            raise CheckpointError(
                f"{self.run_dir} holds metrics.jsonl of a run that wrote no checkpoint; give "
                "this run another run_dir, or delete that file to start over there (nothing "
                "is overwritten)"
            )
        if resume and not self.run_dir.is_dir():  # not made empty only to be refused
            raise CheckpointError(f"no run to resume in {self.run_dir}: it does not exist")
        # the loop updates its parameters in place: a copy unless the caller hands them over
        self.params = tree_map(
            lambda t: t.detach().to(self.device, copy=copy).requires_grad_(True), params
        )
        self.state = tree_map(lambda t: t.to(self.device, copy=copy), state)
        if cfg.comera.enabled and next(iter_tt(self.params, self.state), None) is None:
            # the first step's rank regularizer would fail, naming no setting
            raise ConfigError(
                "train.comera.enabled is on but the model holds no TT/TTM layer, so there are "
                "no ranks to adapt; tensorize the model first (comera.tensorize_), or train it "
                "dense with train.comera.enabled=False"
            )
        if cfg.optimizer == "galore" and next(iter_tt(self.params, self.state), None):
            # GaLore holds the leaves it was built over: a compaction's new cores would go
            # untrained (or fail on a shrunk bond), and its AdamW gives cores lr_rest
            raise ConfigError(
                "train.optimizer='galore' trains dense models, but this model holds TT/TTM "
                "layers; train them with train.optimizer='adamw' (or 'sgd')"
            )
        self.opt = adamw_init(self.params) if cfg.optimizer == "adamw" else {"step": 0}
        self.galore = (
            GaLore.with_adamw(self.params, cfg.galore, cfg.optim)
            if cfg.optimizer == "galore"
            else None
        )
        self.step = 0
        self._tokens_seen = 0.0
        self.stages = StageController(cfg.comera, cfg.steps)
        self.sync_free = (
            SyncFreeStep(cfg.step_mode, cfg, task, self.stages, non_finite=self._non_finite)
            if cfg.step_mode != "eager"
            else None
        )
        # made once the model's own checks (no TT layer, GaLore's ranks) and the step
        # mode's (cuda_graph without CUDA) have passed: a refused run leaves no empty
        # folder behind
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # before anything is written there (a resume truncates metrics.jsonl): one process
        # trains into a run dir at a time, held while this trainer lives
        self._run_lock = hold_run_dir(self.run_dir, self.rank, self.world, flag=lock_flag)
        self._locks[0].release()  # (its share, if any, is the one just counted again)
        self._locks = [self._run_lock]
        self._closed = False
        self.config_dict = {"train": dataclasses.asdict(cfg), **(extra_config or {})}
        self.initial_size = int(reference_size) if reference_size is not None else (
            model_size(self.params, self.state))  # fmt: skip
        self.reference_size = None if reference_size is None else int(reference_size)
        self.on_compact: list[Callable[[Trainer], None]] = []
        if hasattr(task, "on_compaction"):
            self.on_compact.append(lambda tr: tr.task.on_compaction(tr.params, tr.state))
        self._size_miss: str | None = None  # why the last budget prune fell short
        self._metric_names: list[str] = []  # metric names all ranks agreed on (train steps)
        self._reach_checked = False  # whether the loss's reach was checked (first step)
        # auto plans are decided by a separate forward before a step (at the start, and after
        # each compaction) only where a step cannot time: compiled or captured; elsewhere
        # the step decides, and after any step in which a rank decided, all adopt rank 0's
        self.auto_plans = auto_plans
        self._tune_first = auto_plans and cfg.step_mode in ("compile", "cuda_graph")
        self._tune_due = self._tune_first
        self._timed = 0  # the tuner's timing count at the last sync
        # the iterator fit() draws from, and the train_iter it came from: a later fit()
        # (after fit(until=k)) goes on with it; iter() again restarted a list or DataLoader
        self._batches_from: tuple[object, Iterator] | None = None
        self.plans: dict[str, dict] = {}  # the auto-plan decisions this run has used
        self._history = resume  # plans.json holds this run's history (a fresh run's: none)
        # the config (train and extra_config) the resumed checkpoint was written with, for
        # callers that check more of it than the trainer does; None for a fresh run
        self.saved_config: dict | None = None
        self._fit_began = False  # whether a fit of this trainer opened the run's log
        # replicas start identical: what the task holds outside params and state (a
        # ModuleTask's frozen parameters) first, so a resume checks rank 0's on every rank
        frozen = replicated_by_name(task)
        check_alike(list(frozen.values()), list(frozen), "frozen tensors")
        broadcast_tensors(list(frozen.values()))
        if resume:
            self._reinstall_plans()
            ck.restore_trainer(self, ck.load_checkpoint(self.run_dir))
            for fn in self.on_compact:  # the restored model may be compacted: rebuild
                fn(self)
            self.stages.live_params = model_size(self.params, self.state)
        else:
            live = model_size(self.params, self.state)
            self.stages.start(self.params, self.state, live, self.initial_size)
            # each rank its own stream (dropout masks differ across the global batch)
            random.seed(cfg.seed + self.rank)
            torch.manual_seed(cfg.seed + self.rank)
        # layers already at rank 0 (a resumed run's) were said when they got there
        self._zero_said = self._zero_layers()
        # then the params and the model's running buffers
        paths, _ = tree_flatten_with_path(self.params)
        buffers = self._buffers()
        shared = [t for _, t in paths] + buffers
        names = [keystr(p) for p, _ in paths] + [f"buffer #{i}" for i in range(len(buffers))]
        check_alike(shared, names, "parameters or buffers")
        broadcast_tensors(shared)
        # the run's own random streams, swapped in by fit, train_step and checkpoint
        # (_own_streams): what the caller draws between calls (or another trainer's
        # seeding) changes nothing the run draws, and an in-process run equals its resume
        self._rng = ck.rng_state(self.device)
        self._streams_in = False

    # stage controller state, under the names the loop has always had
    stage = property(lambda self: self.stages.stage)
    targets = property(lambda self: self.stages.targets)
    loss_ema = property(lambda self: self.stages.loss_ema)

    # ------------------------------------------------------------------ checkpoints

    def checkpoint(self) -> Path:
        """Every rank writes its RNG and data position; rank 0 then writes the model."""
        self._hold()
        with self._own_streams():
            return ck.save_trainer(self)

    @contextlib.contextmanager
    def _own_streams(self) -> Iterator[None]:
        """The run's random streams in place of the caller's for the call, put back after
        (re-entrant: the steps and checkpoints inside fit run in fit's). Costs a copy of
        the stream states per outermost call (about 25 us on a CPU)."""
        if self._streams_in:
            yield
            return
        outside = ck.rng_state(self.device)
        ck.set_rng_state(self._rng, self.device)
        self._streams_in = True
        try:
            yield
        finally:
            self._streams_in = False
            self._rng = ck.rng_state(self.device)
            ck.set_rng_state(outside, self.device)

    # ------------------------------------------------------------------ rank surgery

    def prune(self, budget: float | None = None) -> None:
        """Kill ranks by the prune rule; in the late stage with ``late_prune="schedule"``,
        then the smallest-share ranks until the model fits ``budget`` (default: the
        stage controller's budget for this step)."""
        self._hold()
        c, before = self.cfg.comera, self.state
        self.state = prune_tree(self.params, self.state, c.tau, rule=c.prune_rule)
        if self.stages.prunes_to_budget():
            if budget is None:
                budget = self.stages.size_budget(self.step)
            excess = model_size(self.params, self.state) - math.floor(budget or 0)
            if budget is not None and excess > 0:
                self.state, removed = prune_to_size(self.params, self.state, excess)
                self._size_miss = None if removed >= excess else self._why_short()
        self._masks_in_place(before)
        self.stages.live_params = model_size(self.params, self.state)
        self._say_zero_maps()

    def _zero_layers(self) -> set[str]:
        """The TT/TTM layers with a bond at rank 0 (the zero map)."""
        return {path for path, _, s in iter_tt(self.params, self.state)
                if any(int(m.sum()) == 0 for m in s["masks"])}  # fmt: skip

    def _say_zero_maps(self) -> None:
        """Say, once per layer, that a prune left it a bond at rank 0: the layer now
        computes the zero map (its bias alone), which no later step can undo."""
        dead = sorted(self._zero_layers() - self._zero_said)
        self._zero_said.update(dead)
        if dead and self.rank == 0:
            more = f" (+{len(dead) - 3} more)" if len(dead) > 3 else ""
            print(f"comera: step {self.step}: {', '.join(dead[:3])}{more} pruned to rank 0: "
                  "the zero map from now on (train.comera.tau or the size target asks for "
                  "that much)", file=sys.stderr)  # fmt: skip

    def _masks_in_place(self, before: object) -> None:
        """Write the pruned masks into the mask tensors they replace (the shapes hold until
        a compaction), and keep those: whatever else holds them (a ModuleTask's module, its
        ``state_dict``, a captured step) computes with the trainer's ranks, not stale ones."""
        old = {path: s for path, _, s in iter_tt(self.params, before)}
        for path, _, s in iter_tt(self.params, self.state):
            held = old.get(path)
            if held is None or held is s:
                continue
            masks = list(s["masks"])
            for k, (m_old, m_new) in enumerate(zip(held["masks"], masks, strict=False)):
                if m_old is not m_new and m_old.shape == m_new.shape:
                    m_old.copy_(m_new)
                    masks[k] = m_old
            s["masks"] = masks

    def _why_short(self) -> str:
        """Why a budget prune removed less than it was asked to."""
        bonds = [int(m.sum()) for _, _, s in iter_tt(self.params, self.state) for m in s["masks"]]
        if all(n == 0 for n in bonds):
            live = model_size(self.params, self.state)
            return (
                f"every TT/TTM layer is pruned to rank 0 (the zero map); the {live:,} "
                "parameters left lie outside them (dense layers, biases), which no prune removes"
            )
        if all(n <= 1 for n in bonds):
            return "every bond is down to one live rank"
        return "the ranks left are their bonds' last or have non-finite shares"

    def compact(self, budget: float | None = None, *, prune: bool = True) -> None:
        """Prune (unless ``prune`` is False), then physically remove dead ranks from params
        and both moments. The ``compact_every`` events pass ``prune=False``: they change
        the layout only, never which ranks live (ranks die every ``prune_every`` steps)."""
        self._hold()
        if prune:
            self.prune(budget)
        if "m" in self.opt:  # AdamW: its moments lose the same ranks
            params, state, m, v = compact_tree(
                self.params, self.state, self.opt["m"], self.opt["v"]
            )
            self.opt = {**self.opt, "m": m, "v": v}
        else:
            params, state = compact_tree(self.params, self.state)
        self.params = tree_map(lambda t: t.detach().requires_grad_(True), params)
        self.state = state
        self._tune_due = self._tune_first  # new shapes, new plans (the same on every rank)
        for fn in self.on_compact:
            fn(self)

    def ranks(self) -> dict[str, list[int]]:
        return {
            p: [int(m.sum()) for m in s["masks"]] for p, _, s in iter_tt(self.params, self.state)
        }

    def _snapshot(self, label: str, extra: dict | None = None) -> None:
        if self.rank == 0:
            live = model_size(self.params, self.state)
            write_rank_snapshot(self.run_dir, label, self.step, self.ranks(), live, extra)

    def size_record(self) -> dict:
        """How the late stage's size target was met: the target and the early stage's
        size (live parameters), the live size now, their ratio, and, when the model is
        above the target, why. Empty before the late stage."""
        t, c = self.stages.targets, self.cfg.comera
        if "params" not in t:
            return {}
        live = model_size(self.params, self.state)
        target = t["params"]
        rec = {
            "size_target": round(target),
            "early_params": round(t["params_early"]),
            "live_over_target": live / target if target else (0.0 if not live else math.inf),
        }
        if held := self._held_note():
            rec["target_held_because"] = held
        if live > target:
            if c.late_prune == "threshold":
                why = "late_prune=threshold: ranks die only when their share or gate <= tau"
            else:
                why = self._size_miss or "the budget prune stopped above the target"
            rec["above_target_because"] = why
        return rec

    def _held_note(self) -> str:
        """Why the late stage's target is not the size asked for (a target compression
        below the early stage's: it never grows the model), or ``""``."""
        t, c = self.stages.targets, self.cfg.comera
        asked, early = t.get("params_asked"), t.get("params_early")
        if asked is None or early is None or asked <= early:
            return ""
        return (
            f"train.comera.target_compression={c.target_compression:g} asks for "
            f"{round(asked):,} parameters, more than the {round(early):,} the late stage "
            "starts from; it never grows the model, so it holds that size"
        )

    # ------------------------------------------------------------------ auto plans

    def tune_plans(self, batch: Any) -> None:
        """Decide every ``auto`` plan and lookup (:mod:`comera.autotune`) before a step: one
        eager forward of ``batch`` times what the tuner has not seen, with the RNG streams
        saved and restored around it (the step that follows draws the same dropout and
        masks) and on a copy of the state (a module's running statistics, which a training
        forward updates, see one update per step as without ``auto``); then every rank
        adopts rank 0's decisions. The loop runs it where a step
        cannot time (``compile``, ``cuda_graph``); for ``compile`` TT linears choose
        between ``comera`` and ``dense`` only (opt_einsum's paths do not trace). The
        forward runs in a :class:`comera.layers.SyncFreeLookups` scope, as those steps do:
        their TTM lookups ask for the sync-free decision (``optimized`` runs as ``static``),
        so that is the one to make."""
        self._tune_due = False
        if next(iter_tt(self.params, self.state), None) is None:  # dense: nothing to plan
            return
        tuner = current_tuner()
        traced = DIRECT_STRATEGIES if self.cfg.step_mode == "compile" else LINEAR_CANDIDATES
        rngs = ck.rng_state(self.device)
        try:
            with (
                tuner.restrict(traced),
                SyncFreeLookups(),
                torch.enable_grad(),
                torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16),
            ):
                state = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t,
                                 self.state)  # fmt: skip
                self.task.loss(self.params, state, batch, train=True)
        finally:
            ck.set_rng_state(rngs, self.device)
        if self.world > 1:
            tuner.install(broadcast_object(tuner.export()))

    def _sync_plans(self) -> None:
        """After a step (or an evaluation) in which any rank timed a decision or first used
        one (its own cache's, which may differ from rank 0's), every rank adopts rank 0's:
        an eager step decides as it goes, so ranks agree from the next step on. Whether
        any rank did is one small sum across ranks per step, for ``auto_plans`` runs only."""
        if not self.auto_plans or self.world == 1:
            return
        tuner = current_tuner()
        # decisions first used by this run (a call that got none, with no tokens or where
        # timing cannot run, is no decision to agree on)
        fresh = len({k for k in tuner.used if k in tuner.decisions} - set(self.plans))
        new = torch.tensor([float(tuner.timings - self._timed + fresh)], device=self.device)
        self._timed = tuner.timings
        if float(sum_across_ranks([new])[0]) > 0:
            tuner.install(broadcast_object(tuner.export()))

    def _reinstall_plans(self) -> None:
        """A resumed run goes on with the decisions it recorded (``plans.json``), whatever
        the cache or the machine's timing would say now, on another thread count or
        machine too (:func:`comera.autotune.rekey`)."""
        path = self.run_dir / "plans.json"
        if not self.auto_plans or not path.is_file():
            return
        try:
            history = json.loads(path.read_text()).values()
            recorded = {rekey(k, self.device): d for h in history for k, d in h.items()}
        except (OSError, ValueError, AttributeError, RecursionError) as e:  # damaged by hand
            warnings.warn(f"{path} is unreadable ({e}); this resume decides its plans afresh "
                          "and starts its history anew", stacklevel=2)  # fmt: skip
            self._history = False  # the next record writes a fresh one, not reads this
            return
        tuner = current_tuner()
        tuner.install(recorded)  # (an entry of the wrong shape is dropped: decided again)
        kept = tuner.export()  # the recorded entries it took (not the disk cache's)
        self.plans = {k: kept[k] for k in recorded if kept.get(k) == recorded[k]}
        if self.plans:  # the wandb run a resume continues shows them, as config.json does
            self.config_dict["auto_plans"] = {d["what"]: d["choice"] for d in self.plans.values()}

    def _record_plans(self, log: RunLog | None) -> None:
        """Record the ``auto`` decisions first used since the last call: ``config.json``
        (``auto_plans``: shapes -> choice; beside the run's ``plans`` settings, which a
        resume rebuilds), ``plans.json`` (each decision's timings, by step), wandb's config
        and one line on stderr (rank 0)."""
        new = {
            k: dataclasses.asdict(d)
            for k, d in current_tuner().take_used().items()
            if k not in self.plans
        }
        if not new:
            return
        self.plans.update(new)
        if self.rank != 0:
            return
        chosen = {d["what"]: d["choice"] for d in self.plans.values()}
        self.config_dict["auto_plans"] = chosen
        saved = self.run_dir / "config.json"  # as written (a resume's record kept)
        record = json.loads(saved.read_text()) if saved.is_file() else self.config_dict
        write_json_atomic(saved, {**record, "auto_plans": chosen})
        path = self.run_dir / "plans.json"  # a fresh run's history starts empty
        history = json.loads(path.read_text()) if path.is_file() and self._history else {}
        self._history = True
        history[str(self.step)] = new
        write_json_atomic(path, history)
        if log is not None:
            log.update_config({"auto_plans": chosen})
        line = f"comera: auto plans at step {self.step}: {summarize_decisions(new)}"
        print(line, file=sys.stderr)

    # ------------------------------------------------------------------ one step

    def _non_finite(self, what: str, value: float) -> NonFiniteLoss:
        # a resume continues the saved config, so the advice is a new run: what it
        # computes (learning rates, clipping) is fixed for the run
        saved = ck.complete_checkpoints(self.run_dir)
        kept = (
            f"the last good checkpoint ({saved[-1]}) was left untouched"
            if saved
            else "no checkpoint had been written yet"
        )
        said = (
            f"{what} is {value} at step {self.step + 1} (stage {self.stage}); no parameter "
            f"or optimizer state was updated (buffers the forward updates in place, such as "
            f"BatchNorm statistics, may hold the bad values) and {kept}."
        )
        return NonFiniteLoss(
            f"{said} Start a new run (another run dir) with lower learning rates or gradient "
            "clipping (train.optim.lr_*, train.grad_clip): a resume continues the saved config.",
            what=said,
        )

    def train_step(self, *batches: Any) -> dict:
        """One optimizer step over ``batches`` (micro-batches): exact global mean gradient,
        the stage's objective, clipping, then AdamW or SGD. Returns the step's metrics.

        Sparse gradients (``F.embedding(..., sparse=True)``) stay sparse in one process
        under SGD; with several ranks, or under AdamW (whose moments are dense anyway),
        they are made dense. Missing gradients are zeros, except under single-process SGD
        where a zero update is skipped rather than allocated.

        With ``train.step_mode`` other than ``eager`` the step is
        :class:`comera.train.sync_free.SyncFreeStep`'s: the same update with no host read
        until its end."""
        self._hold()
        with self._own_streams():
            metrics = self._train_step(*batches)
        # each rank's forward updated its running buffers from its own share: every rank
        # takes rank 0's (DDP's broadcast_buffers), so all evaluate and save one model
        if self.world > 1:
            broadcast_tensors(self._buffers())
        return metrics

    def _buffers(self) -> list[torch.Tensor]:
        """The state's running buffers (:data:`comera.train.task.BUFFERS`)."""
        held = self.state.get(BUFFERS) if isinstance(self.state, dict) else None
        return tree_leaves(held) if held else []

    def _train_step(self, *batches: Any) -> dict:
        if self.sync_free is not None:
            metrics, self.opt = self.sync_free(
                self.params, self.state, self.opt, self.step + 1, *batches
            )
            self.step += 1
            return metrics
        leaves = tree_leaves(self.params)
        grads: list[torch.Tensor | None] = [None] * len(leaves)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        count, metric_sums = 0.0, {}
        count_tokens = getattr(self.task, "batch_tokens", None)
        if count_tokens is not None:
            metric_sums["tokens"] = float(sum(count_tokens(b) for b in batches))
        # one micro-batch in one process on the CPU: the objective's weights are known
        # before the backward, so the loss and the parameter term share one backward pass,
        # each weighted at its root (the same sum; no second pass over the parameter
        # term's graph, and no second gradient per leaf to add). On an accelerator the
        # backward is queued before the host reads the loss instead, and a loss summed in
        # a low precision is weighted after its backward, in the gradients' precision.
        one_pass = len(batches) == 1 and self.world == 1 and self.device.type == "cpu"
        root: torch.Tensor | None = None
        detached = 0.0  # shares here whose terms count but whose sum has no gradient
        bad_counts = 0.0  # batches here whose count is not a finite number >= 0
        for batch in batches:
            with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
                out = self.task.loss(self.params, self.state, batch, train=True)
            s, n, metrics = loss_terms(out)
            n = float(n)
            if not math.isfinite(n) or n < 0:  # alone, refused at once; with several ranks
                if self.world == 1:  # on every rank after the reduction (one rank raising
                    check_count(n)  # alone left the others in the all-reduce)
                bad_counts, n = bad_counts + 1.0, 0.0
            # autograd's own error names neither the task nor why; a rank's empty share
            # (no terms) may be a plain zero. Alone, refused at once; with several ranks
            # after the reduction, on every rank (one rank raising alone left the others in
            # the all-reduce)
            if n > 0 and not s.requires_grad:
                if self.world == 1:
                    raise detached_error()
                detached += 1.0
            one_pass = one_pass and s.dtype in (torch.float32, torch.float64)
            if one_pass:
                root = s
            else:
                if s.requires_grad:  # a rank's empty share may be a plain zero: no gradient
                    _accumulate(grads, torch.autograd.grad(s, leaves, allow_unused=True))
            loss_sum += s.detach().double()
            count += n
            for k, v in metrics.items():  # per-batch means, weighted by the batch's count
                metric_sums[k] = metric_sums.get(k, 0.0) + float(v) * n
        keep_sparse = self.world == 1 and self.cfg.optimizer == "sgd"
        reach: list[float] = []  # at the first step: whether the loss reached a leaf here
        if root is None:
            reach = self._reach(grads, only_loss=True)
            self._line_up(grads, leaves, keep_sparse)
        # with several ranks, metrics go by the names every rank has agreed on so far
        # (each with how many ranks hold it now), and a name new on any rank is flagged:
        # ranks may return other names (a class absent from a share, an empty share's {}),
        # which a reduction by position summed into other metrics' slots
        keys = sorted(metric_sums) if self.world == 1 else self._metric_names
        fresh = [float(bool(set(metric_sums) - set(keys)))] if self.world > 1 else []
        held = [float(k in metric_sums) for k in keys] if self.world > 1 else []
        extra = torch.tensor([count, *(metric_sums.get(k, 0.0) for k in keys), *held, *fresh,
                              bad_counts, detached, *reach], dtype=torch.float64)  # fmt: skip
        scalars = torch.cat([loss_sum.reshape(1), extra.to(self.device)])
        # alone this is a no-op; with several ranks every gradient is dense and present
        *grads, scalars = sum_across_ranks([*grads, scalars])  # type: ignore[list-item]
        loss_total, count, *metric_totals = scalars.cpu().tolist()
        reached = metric_totals.pop() if reach else 1.0  # summed over ranks
        if metric_totals.pop():  # a detached share on some rank: every rank raises
            raise detached_error()
        if bad := metric_totals.pop():  # a count that is no count, on some rank: every rank
            raise ValueError(
                f"step {self.step + 1}: Task.loss returned a count that is not a finite number "
                f">= 0 for {bad:g} batch(es) over the ranks; the count is how many loss terms "
                "the sum holds"
            )
        if self.world > 1:
            keys, metric_totals = self._metric_totals(keys, metric_totals, metric_sums)
        if count <= 0:
            raise ValueError(f"step {self.step + 1}: the global batch has no loss terms (count 0)")
        if not reached:  # every rank raises
            raise unreached_error()
        loss_value = loss_total / count
        if not math.isfinite(loss_value):
            raise self._non_finite("loss", loss_value)
        obj = self.stages.objective(self.step + 1, loss_value, self.params, self.state)
        if root is not None:
            roots = [root]
            weights = [torch.full((), obj.loss_weight / count, dtype=root.dtype)]
            if obj.param_term is not None:
                roots.append(obj.param_term)
                weights.append(torch.ones_like(obj.param_term))
            grad = torch.autograd.grad(roots, leaves, grad_outputs=weights, allow_unused=True)
            _accumulate(grads, grad)
            # one process: raised at once; the gates count unless a term of theirs joined
            if self._reach(grads, only_loss=obj.param_term is None) == [0.0]:
                raise unreached_error()
            self._line_up(grads, leaves, keep_sparse)
        else:
            _scale(grads, obj.loss_weight / count)
            if obj.param_term is not None:  # the same on every rank: added after the reduction
                grad = torch.autograd.grad(obj.param_term, leaves, allow_unused=True)
                _accumulate(grads, grad)
        total = _grad_norm(grads)
        gnorm = float(total)
        if not math.isfinite(gnorm):
            raise self._non_finite("the gradient norm", gnorm)
        if self.cfg.grad_clip:
            # a host float (the norm is read anyway): a tensor factor costs a dtype copy per
            # leaf in torch's per-tensor foreach path on CPU, and a step under the clip
            # scales nothing
            factor = min(1.0, self.cfg.grad_clip / (gnorm + 1e-6))
            if factor < 1.0:
                _scale(grads, factor)
        self.step += 1
        scale = lr_scale(self.cfg, self.step)
        if self.cfg.optimizer == "sgd":
            self.opt = sgd_step(self.params, grads, self.opt, self.cfg.sgd, scale)
        elif self.galore is not None:
            self.galore.step(grads, scale)
            self.opt = {**self.opt, "step": self.opt["step"] + 1}
        else:
            self.opt = adamw_step(self.params, grads, self.opt, self.cfg.optim, scale)
        self.stages.observe(loss_value)
        objective = obj.loss_weight * loss_value + (
            float(obj.param_term.detach()) if obj.param_term is not None else 0.0
        )
        return {
            "loss": loss_value,
            "objective": objective,
            "grad_norm": gnorm,
            "lr_scale": scale,
            "loss_terms": count,
            **obj.metrics,
            **{k: v if k == "tokens" else v / count
               for k, v in zip(keys, metric_totals, strict=True)},
        }  # fmt: skip

    def _metric_totals(
        self, keys: list[str], totals: list[float], sums: dict[str, float]
    ) -> tuple[list[str], list[float]]:
        """The names and summed values of this step's metrics across ranks, from the
        reduction's ``totals`` (each agreed name's sum, how many ranks held it, and whether
        any rank held a name not agreed yet); a new name is agreed on by every rank (one
        gather) and its sums reduced on their own. A name no rank held this step is left
        out, as one process leaves it out."""
        k = len(keys)
        values, held, fresh = totals[:k], totals[k : 2 * k], totals[2 * k]
        names = dict(zip(keys, values, strict=True))
        present = {n for n, h in zip(keys, held, strict=True) if h > 0}
        if fresh:  # the same on every rank (summed): all gather, all reduce the new sums
            self._metric_names = union_names([*keys, *sums])
            new = [n for n in self._metric_names if n not in names]
            flat = torch.tensor([*(sums.get(n, 0.0) for n in new),
                                 *(float(n in sums) for n in new)],
                                dtype=torch.float64, device=self.device)  # fmt: skip
            got = sum_across_ranks([flat])[0].cpu().tolist()
            names.update(zip(new, got[: len(new)], strict=True))
            present |= {n for n, h in zip(new, got[len(new) :], strict=True) if h > 0}
        out = sorted(present)
        return out, [names[n] for n in out]

    def _reach(self, grads: list[torch.Tensor | None], *, only_loss: bool) -> list[float]:
        """At a run's first step, ``[1.0]`` if the loss reached one of the trainer's leaves
        on this rank, else ``[0.0]`` (summed over ranks, so all refuse together); ``[]``
        at later steps. With the gate regularizer summed in (``only_loss`` False) the
        gates do not count."""
        if self._reach_checked:
            return []
        self._reach_checked = True
        groups = leaf_groups(self.params)
        reached = [g is not None for g, gr in zip(grads, groups, strict=True)
                   if only_loss or gr != "gates"]  # fmt: skip
        return [1.0 if any(reached) or not reached else 0.0]

    @staticmethod
    def _line_up(
        grads: list[torch.Tensor | None], leaves: list[torch.Tensor], keep_sparse: bool
    ) -> None:
        """Missing gradients as zeros (every rank lines up) unless ``keep_sparse``; sparse
        ones coalesced when kept, made dense otherwise."""
        for i, (g, t) in enumerate(zip(grads, leaves, strict=True)):
            if g is None and not keep_sparse:
                grads[i] = torch.zeros_like(t)
            elif g is not None and g.is_sparse:
                grads[i] = g.coalesce() if keep_sparse else g.to_dense()

    def _after_step(self) -> None:
        """Carry out the stage controller's rank events for the step just taken."""
        for event in self.stages.events(self.step):
            if event == "prune":
                self.prune()
            elif event == "transition":
                self.compact()
                live = model_size(self.params, self.state)
                self.stages.fix_targets(
                    self.params, self.state, live, self.initial_size, step=self.step
                )
                self.stages.stage = "late"
                self._snapshot("end_of_early")
                if self.rank == 0 and (held := self._held_note()):
                    print(f"comera: step {self.step}: {held}", file=sys.stderr)
            elif event == "compact":  # the dead ranks removed; none killed
                self.compact(prune=False)
            elif event == "final":
                # the last prune meets the target itself, whatever the ramp's timing
                self.compact(self.stages.targets.get("params"))
                self._snapshot("end", self.size_record())

    # ------------------------------------------------------------------ evaluation

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics: every rank evaluates its share, results reduced exactly."""
        fn = self.task.evaluate
        kw = (
            {"rank": self.rank, "world": self.world}
            if "rank" in inspect.signature(fn).parameters
            else {}
        )
        with torch.no_grad():
            raw = fn(self.params, self.state, **kw)
        terms = {k: (s, n) for k, s, n in eval_terms(raw)}
        # by name: a rank whose share held no example of a class returned no metric of it,
        # and a reduction by position summed other metrics into its slots
        keys = union_names(list(terms)) if self.world > 1 else list(terms)
        flat = torch.tensor([x for k in keys for x in terms.get(k, (0.0, 0.0))],
                            dtype=torch.float64, device=self.device)  # fmt: skip
        flat = sum_across_ranks([flat])[0].cpu().tolist()
        # nothing counted (an empty held-out split) is NaN, not a perfect 0 loss
        out = {k: flat[2 * i] / flat[2 * i + 1] if flat[2 * i + 1] else math.nan
               for i, k in enumerate(keys)}  # fmt: skip
        derive = getattr(self.task, "derive_eval", None)
        return {**out, **derive(out)} if derive is not None else out

    # ------------------------------------------------------------------ the loop

    def _start_log(self, fresh: bool) -> RunLog:
        """Rank 0's run log (metrics.jsonl, wandb). Every rank learns whether it started:
        a wandb that refuses to start stops each rank with one line, not rank 0 alone
        while the others die at their first collective."""
        error: UserError | None = None
        log = None
        try:
            log = RunLog(self.cfg, self.rank, self.config_dict, resume=not fresh)
        except UserError as e:
            error = e
        if self.world > 1:
            said = broadcast_object(None if error is None else str(error))
            if said is not None:
                dist.barrier()  # every rank has rank 0's word before any leaves (a rank that
                # left mid-broadcast closed its connection under the others: an abort)
                if error is None:
                    error = ConfigError(f"rank 0 could not start its run log: {said}")
        if error is not None:
            raise error
        assert log is not None
        return log

    def fit(self, until: int | None = None) -> dict:
        """Train to ``cfg.steps``, or stop after step ``until`` (a pause: the schedule,
        stages and a later ``fit`` still count to ``cfg.steps``); returns the last logged
        metrics (plus the final eval). It draws from the run's own random streams (seeded
        by ``cfg.seed``, or restored from the checkpoint), swapped in for the call; the
        caller's streams are put back after."""
        if until is not None and (
            isinstance(until, bool) or not isinstance(until, Integral) or until < 0
        ):  # a negative step was a silent no-op
            raise ConfigError(f"fit(until=...) must be a step (an int >= 0) or None, got {until!r}")
        self._hold()
        with self._own_streams():
            return self._fit(until)

    def close(self) -> None:
        """Give the run dir back, so that another process may train into it (a resume in
        a subprocess, say) while this trainer object lives on; otherwise the lock ends
        with the trainer. A later call that writes there (:meth:`fit`,
        :meth:`train_step`, :meth:`checkpoint`, :meth:`prune`, :meth:`compact`) takes it
        again first, refused if another process holds it then. Every rank of a
        distributed run calls it (taking it again is a collective)."""
        self._run_lock.release()
        self._closed = True

    def _hold(self) -> None:
        """Take the run dir again after :meth:`close`, before anything is written there."""
        if self._closed:
            # made again if it was moved or deleted meanwhile: a write would make it unlocked
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._run_lock = hold_run_dir(self.run_dir, self.rank, self.world)
            self._closed = False

    def _fit(self, until: int | None) -> dict:
        from tqdm.auto import tqdm

        # a second fit after fit(until=0) goes on with the first's run, not a new one
        cfg, fresh = self.cfg, self.step == 0 and not self._fit_began
        if self.rank == 0 and fresh:
            write_json_atomic(self.run_dir / "config.json", self.config_dict)
            if self.stage != "dense":
                self._snapshot("init")
        c = cfg.comera
        if self.rank == 0 and fresh and not c.enabled and c.target_compression:
            print(f"comera: train.comera.target_compression={c.target_compression:g} sets "
                  "CoMERA's late-stage size, but this run does not adapt ranks "
                  "(train.comera.enabled=False, as --dense sets): it is not used",
                  file=sys.stderr)  # fmt: skip
        if (
            self.rank == 0
            and fresh
            and c.enabled
            and c.target_compression
            and (c.early_steps >= cfg.steps)
        ):  # the knob acts in the late stage only
            print(f"comera: train.comera.target_compression={c.target_compression:g} acts in "
                  f"the late stage, which starts after train.comera.early_steps="
                  f"{c.early_steps}, at or past train.steps={cfg.steps}: this run never "
                  "reaches it", file=sys.stderr)  # fmt: skip
        if (
            self.rank == 0
            and fresh
            and c.enabled
            and c.gamma > 0
            and min(c.reg_start_step, c.early_steps) >= cfg.steps
        ):  # the early stage's pull never starts: ranks die by tau alone
            print(f"comera: train.comera.reg_start_step={c.reg_start_step} is not below "
                  f"train.steps={cfg.steps}: the gate regularizer never acts in this run "
                  "(lower train.comera.reg_start_step for a short run)",
                  file=sys.stderr)  # fmt: skip
        if self.rank == 0 and fresh and self.stage == "late" and (held := self._held_note()):
            print(f"comera: {held}", file=sys.stderr)  # early_steps=0: no transition says it
        if self.rank == 0 and fresh and cfg.warmup_steps >= cfg.steps:
            print(f"comera: train.warmup_steps={cfg.warmup_steps} is not below train.steps="
                  f"{cfg.steps}: the learning rate never reaches its peak in this run "
                  "(lower train.warmup_steps for a short run)", file=sys.stderr)  # fmt: skip
        stop = cfg.steps if until is None else min(until, cfg.steps)
        # nothing left to train (a finished run resumed): its wandb run is not reopened
        log = self._start_log(fresh) if fresh or self.step < stop else RunLog.silent(cfg)
        self._fit_began = True
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not cfg.progress or self.rank != 0,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        last: dict = {}
        t0, steps0 = time.perf_counter(), self.step
        self._tokens_seen = 0.0  # this fit's input tokens, all ranks (tasks with batch_tokens)
        held = self.task.train_iter  # what checkpoints save the position of (save_trainer)
        if self._batches_from is None or self._batches_from[0] is not held:
            self._batches_from = (held, iter(held))
        it = self._batches_from[1]
        if hasattr(held, "state_dict") and hasattr(held, "load_state_dict"):  # refused now,
            ck.data_position_text({"state": held.state_dict()})  # not after training
        tuner = current_tuner()
        tuner.take_used()  # what an earlier trainer in this process used is not this run's
        self._timed = tuner.timings
        status = 0  # the run's exit code, for wandb
        try:
            while self.step < stop:
                t_step = time.perf_counter()
                batches = self._next_batches(it)
                if self._tune_due:  # its timing runs are not the step's time
                    t_tune = time.perf_counter()
                    self.tune_plans(batches[0])
                    t_step += time.perf_counter() - t_tune
                timings = tuner.timings
                metrics = self.train_step(*batches)
                timed = tuner.timings > timings  # an eager step times what it meets first
                self._sync_plans()
                self._record_plans(log)
                stage = self.stage  # the objective it trained with, before a transition
                self._after_step()
                step_time = time.perf_counter() - t_step
                self._tokens_seen += metrics.get("tokens", 0.0)
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    last = self._log_row(log, metrics, step_time, t0, steps0, stage, timed)
                    shown = {"loss": f"{last['loss']:.3f}"}
                    if "accuracy" in last:  # a task without one showed acc=nan
                        shown["acc"] = f"{last['accuracy']:.3f}"
                    shown.update(live=f"{last['live_params']:,}",
                                 comp=f"{last['compression']:.1f}x",
                                 sps=f"{last['steps_per_s']:.2f}")  # fmt: skip
                    # drawn at the bar's own pace (mininterval): refreshing here redrew it
                    # at every logged step, a line per step in a log file
                    bar.set_postfix(shown, refresh=False)
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    ev = {f"eval/{k}": v for k, v in self._evaluate_saving(stop).items()}
                    self._sync_plans()  # evaluation's shapes: decided by each rank
                    self._record_plans(log)
                    live = model_size(self.params, self.state)  # the size each eval is at
                    log.log(
                        {
                            "step": self.step,
                            **ev,
                            "eval_live_params": live,
                            "eval_compression": self.initial_size / max(live, 1),
                        }
                    )
                    last = {**last, **ev}
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.checkpoint()
            just_saved = bool(cfg.checkpoint_every) and self.step % cfg.checkpoint_every == 0
            if steps0 < self.step and not just_saved:  # a resumed, finished run saves nothing
                self.checkpoint()
        except BaseException as e:
            # wandb marks a run stopped by Ctrl-C (the shell's 130, or the ``status`` a
            # KeyboardInterrupt carries: the commands' SIGTERM, 143) or by an error as
            # failed; it showed such runs as finished
            status = getattr(e, "status", 130) if isinstance(e, KeyboardInterrupt) else 1
            raise
        finally:
            bar.close()
            log.close(status)
        metrics = self.run_dir / "metrics.jsonl"
        if not last and self.step == steps0 and metrics.is_file():  # nothing trained: {}
            last = last_logged(read_metrics(metrics))  # was returned, not the run's metrics
        return last

    def _evaluate_saving(self, stop: int) -> dict[str, float]:
        """:meth:`evaluate` inside the loop: an evaluation that fails (out of memory on its
        batch, a bug in the task's ``evaluate``) first saves the checkpoint due at this step
        (``checkpoint_every``, the run's end, or a pause's ``stop``), so the steps trained
        since the last one are kept (the final checkpoint is a run's only one by default).
        One process only: with more, the others may be waiting in the evaluation's
        reduction, and a checkpoint's collectives would not match."""
        try:
            return self.evaluate()
        except Exception as error:
            every = self.cfg.checkpoint_every
            due = self.step == stop or bool(every) and self.step % every == 0
            if due and self.world > 1:  # said by the rank that failed (the others wait)
                print(f"comera: rank {self.rank}: the evaluation at step {self.step} failed; "
                      f"with {self.world} processes its checkpoint is not saved (a resume "
                      "goes on from the last one)", file=sys.stderr)  # fmt: skip
            elif due:
                chain: list[BaseException] = []
                e: BaseException | None = error
                while e is not None and all(e is not x for x in chain):
                    chain.append(e)
                    e = e.__cause__ or e.__context__
                if any(isinstance(x, _OUT_OF_MEMORY) for x in chain):  # wrapped ones too
                    # the evaluation's activations are held by the frames of the chain's
                    # tracebacks: freed before the save needs memory of its own
                    for x in chain:
                        traceback.clear_frames(x.__traceback__)
                    if self.device.type == "cuda":
                        torch.cuda.empty_cache()
                try:
                    path = self.checkpoint()
                except Exception as e:  # the evaluation's error is the one to raise
                    print(f"comera: the evaluation at step {self.step} failed, and so did "
                          f"saving its checkpoint: {e}", file=sys.stderr)  # fmt: skip
                else:
                    print(f"comera: the evaluation at step {self.step} failed; saved {path} "
                          "first (a resume goes on after it without evaluating it again)",
                          file=sys.stderr)  # fmt: skip
            raise

    def _next_batches(self, it: Iterator) -> list:
        """The next ``accum_steps`` batches; an iterator that ends before ``cfg.steps`` is
        named (a bare ``StopIteration`` left ``fit`` with an empty message)."""
        try:
            return [next(it) for _ in range(self.cfg.accum_steps)]
        except StopIteration:
            raise DataError(
                f"train_iter ended during step {self.step + 1} of {self.cfg.steps} (rank "
                f"{self.rank}); give an endless iterator (itertools.cycle, or a loader "
                "that repeats epochs) or fewer steps"
            ) from None

    def _log_row(
        self, log: RunLog, metrics: dict, step_time: float, t0: float, steps0: int, stage: str,
        timed: bool = False,
    ) -> dict:  # fmt: skip
        """The step's row: ``stage`` is the one it trained in (the step that ends the early
        stage is an early step, though the transition after it made the trainer late);
        sizes are after the step's rank events. ``timed``: the step timed ``auto`` plans'
        candidates (its ``step_time_s`` holds them), marked ``plans_timed``."""
        live = model_size(self.params, self.state)
        itemsize = tree_flatten(self.params)[0][0].element_size()
        row = {
            "step": self.step,
            "stage": stage,
            **{k: float(v) for k, v in metrics.items()},
            "live_params": live,
            "model_mb": live * itemsize / 2**20,
            "compression": self.initial_size / max(live, 1),
            "step_time_s": step_time,
            **({"plans_timed": True} if timed else {}),
            "steps_per_s": (self.step - steps0) / max(time.perf_counter() - t0, 1e-9),
            **(
                {"tokens_per_s": self._tokens_seen / max(time.perf_counter() - t0, 1e-9)}
                if "tokens" in metrics
                else {}
            ),
            "peak_memory_mb": peak_memory_mb(self.device),
            **{f"ranks/{k}": sum(v) for k, v in self.ranks().items()},
        }
        log.log(row)
        return row
