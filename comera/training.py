"""The shared training loop: CoMERA rank adaptation around any functional task.

An experiment supplies a :class:`Task` (loss and evaluation as pure functions of
``(params, state, batch)``, and a stateful batch iterator); this module owns the rest:
per-group AdamW, warmup + decay, gradient clipping, the two CoMERA stages with pruning
and physical compaction, data parallelism, logging (progress bar, ``metrics.jsonl``,
wandb) and exact checkpoints.

Stages. ``early`` (``cfg.comera.early_steps`` steps): ``L + gamma * R(gates)``. At the
boundary the model is pruned and compacted, and the late-stage targets are fixed:
``S0 = c * S(end of early)`` and ``L0`` (configured, or the smoothed loss at the boundary).
``late``: weights from :func:`comera.objectives.late_weights`. Pruning every
``prune_every`` steps in both stages; compaction at the boundary, at the end, and every
``compact_every`` steps if set. With ``comera.enabled=False`` (dense baselines) the loss
is trained alone.

Data parallelism: under ``torchrun`` every rank computes its share of the global batch
and the gradients are averaged with one flat all-reduce (gloo on CPU, nccl on GPU). We
do not wrap the model in ``DistributedDataParallel``: compaction changes parameter
shapes, which DDP's reducer cannot follow without being rebuilt; averaging gradients
of identical replicas is the same arithmetic.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import resource
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_map

from comera.accounting import live_param_count, param_count
from comera.objectives import gate_regularizer, late_weights, size_surrogate
from comera.optim import AdamWConfig, adamw_init, adamw_step
from comera.tree import compact_tree, iter_tt, prune_tree

__all__ = [
    "CheckpointError",
    "ComeraConfig",
    "NonFiniteLoss",
    "Task",
    "TrainConfig",
    "Trainer",
    "load_checkpoint",
    "model_size",
    "read_metrics",
]

CHECKPOINT = "checkpoint.pt"
RANKS = "ranks.json"


class NonFiniteLoss(RuntimeError):
    """The loss became NaN or inf; the last good checkpoint is left in place."""


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or from an incompatible run."""


@dataclass(kw_only=True, slots=True)
class ComeraConfig:
    """Rank adaptation settings, with the paper's defaults."""

    enabled: bool = True
    gamma: float = 1e-2
    reg_start_step: int = 0  # ours: train the loss alone before this step (0 = the paper)
    tau: float = 1e-2
    early_steps: int = 1000
    prune_every: int = 100
    compact_every: int | None = None
    size_ratio: float = 0.5  # c in S0 = c * S(end of early stage); the paper uses 0.8/0.5/0.2
    loss_target: float | None = None  # L0; None: smoothed loss at the end of the early stage
    rho: float = 0.05  # weight of the plain weighted sum in the late stage

    def __post_init__(self) -> None:
        if self.gamma < 0 or self.tau < 0:
            raise ValueError(
                f"ComeraConfig: gamma and tau must be >= 0, got {self.gamma}, {self.tau}"
            )
        if self.early_steps < 0 or self.prune_every < 1:
            raise ValueError(
                f"ComeraConfig: early_steps >= 0 and prune_every >= 1 required, got "
                f"{self.early_steps}, {self.prune_every}"
            )
        if not 0 < self.size_ratio <= 1:
            raise ValueError(
                f"ComeraConfig.size_ratio (c) must be in (0, 1], got {self.size_ratio}"
            )
        if self.loss_target is not None and self.loss_target <= 0:
            raise ValueError(f"ComeraConfig.loss_target must be > 0, got {self.loss_target}")
        if self.enabled and self.early_steps == 0 and self.loss_target is None:
            raise ValueError(
                "ComeraConfig: early_steps=0 starts in the late stage, which needs a loss "
                "target; set loss_target (L0) or give the early stage some steps"
            )
        if self.reg_start_step < 0 or (
            self.gamma > 0 and 0 < self.early_steps <= self.reg_start_step
        ):
            raise ValueError(
                f"ComeraConfig.reg_start_step={self.reg_start_step} must be >= 0 and below "
                f"early_steps={self.early_steps}, or the gate regularizer never runs"
            )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the loop needs; experiments build one from their presets."""

    steps: int
    run_dir: str
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    comera: ComeraConfig = field(default_factory=ComeraConfig)
    warmup_steps: int = 0
    schedule: str = "linear"  # linear | cosine | constant decay after warmup
    grad_clip: float | None = 1.0
    log_every: int = 10
    eval_every: int | None = None
    checkpoint_every: int | None = None
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False
    wandb: str = "offline"  # online | offline | disabled
    wandb_project: str = "comera"
    run_name: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"TrainConfig.steps must be >= 1, got {self.steps}")
        if self.schedule not in ("linear", "cosine", "constant"):
            raise ValueError(
                f"TrainConfig.schedule must be linear, cosine or constant, got {self.schedule!r}"
            )
        if self.wandb not in ("online", "offline", "disabled"):
            raise ValueError(
                f"TrainConfig.wandb must be online, offline or disabled, got {self.wandb!r}"
            )
        if self.bf16 and not self.device.startswith("cuda"):
            raise ValueError("TrainConfig.bf16 autocast is for CUDA devices; set device='cuda'")
        if self.log_every < 1 or self.warmup_steps < 0:
            raise ValueError(
                f"TrainConfig: log_every >= 1 and warmup_steps >= 0 required, got "
                f"{self.log_every}, {self.warmup_steps}"
            )
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(
                    f"TrainConfig.{name} must be None or >= 1, got {getattr(self, name)}"
                )
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ValueError(
                f"TrainConfig.grad_clip must be None (off) or > 0, got {self.grad_clip}"
            )


class Task(Protocol):
    """What an experiment provides to the loop."""

    train_iter: Any  # iterator of batches with state_dict() / load_state_dict()

    def loss(
        self, params: Any, state: Any, batch: Any, *, train: bool
    ) -> tuple[torch.Tensor, dict]:
        """Mean loss over the batch and extra metrics (tensors or floats)."""
        ...

    def evaluate(self, params: Any, state: Any) -> dict[str, float]:
        """Metrics on held-out data (called under ``torch.no_grad``)."""
        ...


def model_size(params: object, state: object) -> int:
    """Live parameters of a whole model: TT/TTM layers after compaction, plus dense leaves."""
    tt_total = 0
    tt_stored = 0
    for _, p, s in iter_tt(params, state):
        tt_total += live_param_count(p, s)
        tt_stored += param_count(p)
    return param_count(params) - tt_stored + tt_total


def _lr_scale(cfg: TrainConfig, step: int) -> float:
    """Linear warmup to 1, then linear/cosine decay toward 0 (or constant).

    ``step`` is 1-based: the first step after warmup runs at 1, the last one still above 0."""
    if cfg.warmup_steps and step <= cfg.warmup_steps:
        return step / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    frac = (step - 1 - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)  # 1-based step
    frac = min(max(frac, 0.0), 1.0)
    return 1.0 - frac if cfg.schedule == "linear" else 0.5 * (1 + math.cos(math.pi * frac))


def _atomic_save(obj: object, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(run_dir: str | os.PathLike) -> dict:
    """Read ``RUN_DIR/checkpoint.pt`` with a clear error when it is missing or corrupt."""
    path = Path(run_dir) / CHECKPOINT
    if not path.is_file():
        raise CheckpointError(
            f"no checkpoint at {path}; --resume takes a run dir written by an earlier run"
        )
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a corrupt file
        raise CheckpointError(f"cannot read checkpoint {path}: {e}") from e
    if not isinstance(ckpt, dict) or ckpt.get("format") != "comera.checkpoint":
        raise CheckpointError(f"{path} is not a comera training checkpoint")
    return ckpt


def read_metrics(path: str | os.PathLike) -> list[dict]:
    """Rows of a metrics file; a line cut short by a killed process is skipped."""
    rows = []
    for line in Path(path).read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _peak_memory_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


class _Logger:
    """metrics.jsonl + optional wandb; only rank 0 writes."""

    def __init__(self, cfg: TrainConfig, rank: int, config_dict: dict) -> None:
        self.rank = rank
        self.path = Path(cfg.run_dir) / "metrics.jsonl"
        self.wandb = None
        if rank == 0 and cfg.wandb != "disabled":
            import wandb  # imported lazily: tests and dense-only users never need it

            self.wandb = wandb.init(
                project=cfg.wandb_project,
                name=cfg.run_name,
                dir=cfg.run_dir,
                mode=cfg.wandb,
                config=config_dict,
                resume="allow",
            )

    def log(self, row: dict) -> None:
        if self.rank != 0:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class Trainer:
    """Runs a :class:`Task` for ``cfg.steps`` steps with CoMERA rank adaptation."""

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
    ) -> None:
        """``reference_size`` is what compression is measured against (e.g. the dense
        model's parameter count); by default the model's size at the start."""
        self.cfg = cfg
        self.task = task
        self.device = torch.device(cfg.device)
        self.run_dir = Path(cfg.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        # a copy: the loop updates its parameters in place, never the caller's tensors
        self.params = tree_map(
            lambda t: t.detach().to(self.device, copy=True).requires_grad_(True), params
        )
        self.state = tree_map(lambda t: t.to(self.device), state)
        self.opt = adamw_init(self.params)
        self.step = 0
        self.stage = "early" if cfg.comera.enabled and cfg.comera.early_steps > 0 else "late"
        if not cfg.comera.enabled:
            self.stage = "dense"
        self.targets: dict[str, float] = {}
        self.loss_ema: float | None = None
        self.config_dict = {"train": dataclasses.asdict(cfg), **(extra_config or {})}
        self.initial_size = reference_size or model_size(self.params, self.state)
        if self.stage == "late":  # no early stage: the targets come from the initial model
            self.targets = {
                "size": cfg.comera.size_ratio
                * float(size_surrogate(self.params, self.state).detach()),
                "loss": float(cfg.comera.loss_target),  # type: ignore[arg-type]
            }
        if resume:
            self._restore(load_checkpoint(self.run_dir))
        else:
            # each rank its own stream (dropout masks differ across the global batch)
            random.seed(cfg.seed + self.rank)
            torch.manual_seed(cfg.seed + self.rank)

    # ------------------------------------------------------------------ checkpoints

    def _rng_state(self) -> dict:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return {"torch": torch.get_rng_state(), "cuda": cuda, "python": random.getstate()}

    def checkpoint(self) -> Path:
        """Write everything needed to continue bit-identically.

        Every rank must call it (their RNG states are gathered); rank 0 writes the file."""
        path = self.run_dir / CHECKPOINT
        rngs = [self._rng_state()]
        if self.world > 1:
            rngs = [None] * self.world
            dist.all_gather_object(rngs, self._rng_state())
        if self.rank != 0:
            return path
        ckpt = {
            "format": "comera.checkpoint",
            "version": 1,
            "step": self.step,
            "stage": self.stage,
            "targets": dict(self.targets),
            "loss_ema": self.loss_ema,
            "initial_size": self.initial_size,
            "params": tree_map(lambda t: t.detach().cpu(), self.params),
            "state": tree_map(lambda t: t.cpu(), self.state),
            "opt": {
                "step": self.opt["step"],
                "groups": self.opt["groups"],
                "m": tree_map(lambda t: t.cpu(), self.opt["m"]),
                "v": tree_map(lambda t: t.cpu(), self.opt["v"]),
            },
            "rng": rngs,  # one entry per rank
            "data": self.task.train_iter.state_dict(),
            "config": self.config_dict,
        }
        _atomic_save(ckpt, path)
        return path

    def _restore(self, ckpt: dict) -> None:
        saved = ckpt["config"].get("train", {})
        for key in ("steps", "seed"):
            if saved.get(key) != getattr(self.cfg, key):
                raise CheckpointError(
                    f"checkpoint in {self.run_dir} was written with {key}={saved.get(key)}, "
                    f"this run has {key}={getattr(self.cfg, key)}; resume with the same config"
                )
        dev = self.device
        self.params = tree_map(lambda t: t.to(dev).requires_grad_(True), ckpt["params"])
        self.state = tree_map(lambda t: t.to(dev), ckpt["state"])
        self.opt = {
            "step": ckpt["opt"]["step"],
            "groups": ckpt["opt"]["groups"],
            "m": tree_map(lambda t: t.to(dev), ckpt["opt"]["m"]),
            "v": tree_map(lambda t: t.to(dev), ckpt["opt"]["v"]),
        }
        self.step = ckpt["step"]
        self.stage = ckpt["stage"]
        self.targets = ckpt["targets"]
        self.loss_ema = ckpt["loss_ema"]
        self.initial_size = ckpt["initial_size"]
        self.task.train_iter.load_state_dict(ckpt["data"])
        rngs = ckpt["rng"]
        if len(rngs) == self.world:
            mine = rngs[self.rank]
            torch.set_rng_state(mine["torch"])
            if mine["cuda"] is not None and self.device.type == "cuda":
                torch.cuda.set_rng_state(mine["cuda"], self.device)
            random.setstate(mine["python"])
        else:  # another world size: positions are exact, random streams start afresh
            random.seed(self.cfg.seed + self.rank + self.step)
            torch.manual_seed(self.cfg.seed + self.rank + self.step)
        self._truncate_metrics(self.step)

    def _truncate_metrics(self, step: int) -> None:
        """Drop rows logged after ``step`` by a run that died after its last checkpoint, so
        the resumed run's rows are not doubled."""
        path = self.run_dir / "metrics.jsonl"
        if self.rank != 0 or not path.is_file():
            return
        keep = [r for r in read_metrics(path) if r.get("step", 0) <= step]
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ rank surgery

    def prune(self) -> None:
        self.state = prune_tree(self.params, self.state, self.cfg.comera.tau)

    def compact(self) -> None:
        """Prune, then physically remove dead ranks from params and both moments."""
        self.prune()
        params, state, m, v = compact_tree(self.params, self.state, self.opt["m"], self.opt["v"])
        self.params = tree_map(lambda t: t.detach().requires_grad_(True), params)
        self.state, self.opt = state, {**self.opt, "m": m, "v": v}

    def ranks(self) -> dict[str, list[int]]:
        return {
            path: [int(mk.sum()) for mk in s["masks"]]
            for path, _, s in iter_tt(self.params, self.state)
        }

    # ------------------------------------------------------------------ one step

    def _all_reduce_mean(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Average across ranks: one flat all-reduce per dtype (mixed bf16/fp32 params)."""
        if self.world == 1 or not tensors:
            return tensors
        out: list[torch.Tensor | None] = [None] * len(tensors)
        for dtype in {t.dtype for t in tensors}:
            idx = [i for i, t in enumerate(tensors) if t.dtype == dtype]
            flat = torch.cat([tensors[i].reshape(-1) for i in idx])
            dist.all_reduce(flat)
            flat /= self.world
            offset = 0
            for i in idx:
                n = tensors[i].numel()
                out[i] = flat[offset : offset + n].view_as(tensors[i])
                offset += n
        return out  # type: ignore[return-value]

    def _objective(self, loss: torch.Tensor, loss_value: float) -> tuple[torch.Tensor, dict]:
        """The stage's objective and its extra metrics (as tensors; synced only when logged)."""
        c = self.cfg.comera
        if self.stage == "dense":
            return loss, {}
        if self.stage == "early":
            reg = gate_regularizer(self.params, self.state)
            # Adam turns even a tiny consistent L1 pull into lr-sized gate steps, so an
            # untrained model (near-zero loss gradients on gates) would lose its gates
            # before it learns anything; reg_start_step lets it learn first.
            gamma = c.gamma if self.step >= c.reg_start_step else 0.0
            return loss + gamma * reg, {"gate_reg": reg.detach()}
        size = size_surrogate(self.params, self.state)
        if self.targets["size"] <= 0:  # pruned to nothing in the early stage: only loss is left
            return loss, {"size": size.detach()}
        w = late_weights(
            loss_value, float(size.detach()), self.targets["loss"], self.targets["size"], c.rho
        )
        return w.loss * loss + w.size * size, {
            "size": size.detach(),
            "focus_size": float(w.focus == "size"),
        }

    def _non_finite(self, what: str, value: float) -> NonFiniteLoss:
        return NonFiniteLoss(
            f"{what} is {value} at step {self.step + 1} (stage {self.stage}); nothing was "
            f"updated and the last good checkpoint {self.run_dir / CHECKPOINT} was left "
            "untouched. Lower the learning rates or enable gradient clipping, then --resume."
        )

    def train_step(self, batch: Any) -> dict:
        """Forward, backward, all-reduce, clip, AdamW; returns the step's metrics.

        Two host syncs per step: the loss (NaN check, late-stage weights) and the gradient
        norm (a finite loss can still have inf/NaN gradients, which must not reach AdamW).
        """
        leaves, _ = tree_flatten(self.params)
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.cfg.bf16):
            loss, extra = self.task.loss(self.params, self.state, batch, train=True)
        loss_value = float(self._all_reduce_mean([loss.detach().float().reshape(1)])[0])
        if not math.isfinite(loss_value):
            raise self._non_finite("loss", loss_value)
        objective, obj_metrics = self._objective(loss, loss_value)
        grads = torch.autograd.grad(objective, leaves, allow_unused=True)
        present = [g for g in grads if g is not None]
        reduced = self._all_reduce_mean(present)
        total = torch.stack([n.float() for n in torch._foreach_norm(reduced)]).norm()
        gnorm = float(total)
        if not math.isfinite(gnorm):
            raise self._non_finite("the gradient norm", gnorm)
        if self.cfg.grad_clip:
            torch._foreach_mul_(reduced, (self.cfg.grad_clip / (total + 1e-6)).clamp(max=1.0))
        it = iter(reduced)
        grads = [next(it) if g is not None else None for g in grads]
        self.step += 1
        lr_scale = _lr_scale(self.cfg, self.step)
        self.opt = adamw_step(self.params, grads, self.opt, self.cfg.optim, lr_scale)
        self.loss_ema = (
            loss_value if self.loss_ema is None else 0.95 * self.loss_ema + 0.05 * loss_value
        )
        return {
            "loss": loss_value,
            "objective": objective.detach(),
            "grad_norm": gnorm,
            "lr_scale": lr_scale,
            **obj_metrics,
            **{k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in extra.items()},
        }

    def _after_step(self) -> None:
        c = self.cfg.comera
        if self.stage == "dense":
            return
        if self.step % c.prune_every == 0:
            self.prune()
        if self.stage == "early" and self.step >= c.early_steps:
            self.compact()
            self.stage = "late"
            self.targets = {
                "size": c.size_ratio * float(size_surrogate(self.params, self.state).detach()),
                "loss": c.loss_target if c.loss_target is not None else float(self.loss_ema or 1.0),
            }
            self._snapshot_ranks("end_of_early")
        elif c.compact_every and self.step % c.compact_every == 0:
            self.compact()
        if self.step == self.cfg.steps:
            self.compact()
            self._snapshot_ranks("end")

    def _snapshot_ranks(self, label: str) -> None:
        """Record per-layer, per-bond live ranks in ``RUN_DIR/ranks.json`` (the rank table)."""
        if self.rank != 0:
            return
        path = self.run_dir / RANKS
        data = json.loads(path.read_text()) if path.is_file() else {}
        data[label] = {
            "step": self.step,
            "ranks": self.ranks(),
            "live_params": model_size(self.params, self.state),
        }
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)

    # ------------------------------------------------------------------ the loop

    def fit(self) -> dict:
        """Train to ``cfg.steps``; returns the last logged metrics (plus final eval)."""
        from tqdm.auto import tqdm

        cfg = self.cfg
        logger = _Logger(cfg, self.rank, self.config_dict)
        if self.rank == 0 and self.step == 0:
            (self.run_dir / "config.json").write_text(
                json.dumps(self.config_dict, indent=2, default=str)
            )
            if self.stage != "dense":
                self._snapshot_ranks("init")
        bar = tqdm(
            total=cfg.steps,
            initial=self.step,
            disable=not cfg.progress or self.rank != 0,
            dynamic_ncols=True,
            mininterval=1.0,
        )
        last: dict = {}
        t0, steps0 = time.perf_counter(), self.step
        it: Iterator = iter(self.task.train_iter)
        try:
            while self.step < cfg.steps:
                metrics = self.train_step(next(it))
                self._after_step()
                bar.update(1)
                if self.step % cfg.log_every == 0 or self.step == cfg.steps:
                    live = model_size(self.params, self.state)
                    rate = (self.step - steps0) / max(time.perf_counter() - t0, 1e-9)
                    row = {
                        "step": self.step,
                        "stage": self.stage,
                        **{k: float(v) for k, v in metrics.items()},
                        "live_params": live,
                        "compression": self.initial_size / max(live, 1),
                        "steps_per_s": rate,
                        "peak_memory_mb": _peak_memory_mb(self.device),
                        **{f"ranks/{k}": sum(v) for k, v in self.ranks().items()},
                    }
                    logger.log(row)
                    last = row
                    bar.set_postfix(
                        loss=f"{row['loss']:.3f}",
                        acc=f"{row.get('accuracy', float('nan')):.3f}",
                        live=f"{live:,}",
                        comp=f"{row['compression']:.1f}x",
                        sps=f"{rate:.2f}",
                    )
                evaluate = cfg.eval_every and (
                    self.step % cfg.eval_every == 0 or self.step == cfg.steps
                )
                if evaluate and self.rank == 0:  # only rank 0 logs, so only it evaluates
                    with torch.no_grad():
                        ev = self.task.evaluate(self.params, self.state)
                    logger.log({"step": self.step, **{f"eval/{k}": v for k, v in ev.items()}})
                    last = {**last, **{f"eval/{k}": v for k, v in ev.items()}}
                if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                    self.checkpoint()
            self.checkpoint()
        finally:
            bar.close()
            logger.close()
        return last
