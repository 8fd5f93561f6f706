"""Run settings of the shared trainer: the CoMERA objective and the loop itself.

Nested ``@dataclass(kw_only=True, slots=True)`` configs whose ``__post_init__`` rejects bad
values with a message naming the field; experiments build them from presets and the CLI's
``--set a.b=value`` overrides re-run these checks.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from comera.errors import ConfigError
from comera.train.fields import check_kinds
from comera.train.galore import GaLoreConfig
from comera.train.optim import OPTIMIZERS, AdamWConfig, SGDConfig

STEP_MODES = ("eager", "sync_free", "compile", "cuda_graph")  # comera.train.sync_free

__all__ = [
    "CPU_MALLOC_POLICIES",
    "LATE_PRUNES",
    "PRUNE_RULES",
    "REGULARIZERS",
    "SIZE_OBJECTIVES",
    "STEP_MODES",
    "WANDB_MODES",
    "WEIGHT_LIMIT",
    "ComeraConfig",
    "TrainConfig",
]

REGULARIZERS = ("mean", "l1")
PRUNE_RULES = ("gate", "contribution")
SIZE_OBJECTIVES = ("shares", "paper")
LATE_PRUNES = ("schedule", "threshold")
# the largest weight an objective term may get (gamma, rho, (1 + rho) / L0): a tenth of
# float32's largest value (3.4e38), as the sync-free steps cast the weights to it
WEIGHT_LIMIT = 1e37
# micro-batches one step holds together (train.accum_steps): a bound far above any real
# accumulation, below what a host runs out of memory for without a word
MAX_ACCUM_STEPS = 1 << 16
WANDB_MODES = ("online", "offline", "disabled")
CPU_MALLOC_POLICIES = ("default", "keep", "release", "lean")  # applied by experiments.malloc


@dataclass(kw_only=True, slots=True)
class ComeraConfig:
    """Rank adaptation settings, with the paper's defaults.

    ``regularizer``: ``"mean"`` (default) is ``R = mean |d|`` over live gates, what the
    authors' public code computes; ``"l1"`` is ``R = sum |d|``, the paper's text. The two
    differ by the live-gate count, so ``l1`` needs a gamma about that much smaller.
    ``prune_rule``: ``"gate"`` kills a rank when ``|d| <= tau`` (the paper);
    ``"contribution"`` kills it when the share of the layer's weight it carries is
    ``<= tau``, which a rescaling of gates against cores cannot fool (see
    :func:`comera.rank_contributions`).

    The late stage's size target is in live parameters (whole model, after compaction):
    ``size_ratio`` x the live size at the end of the early stage, or, with
    ``target_compression=X``, the trainer's ``reference_size`` / X (the experiments pass
    the dense model's count; without one it is the model's size at the start).
    ``size_objective``:
    ``"shares"`` (default) is :func:`comera.train.objectives.share_size`, a size measure
    built from every rank's share of its layer's weight, which scaling gates against
    cores cannot lower; ``"paper"`` is the paper's ``S(d)`` on gate magnitudes (which that
    scaling lowers without removing a parameter). ``late_prune``: ``"schedule"`` (default)
    lowers a live-size budget from the early stage's size to the target over the first
    ``prune_ramp`` of the late stage (cubic: fast first, slow last) and, at every prune
    event, kills the ranks with the smallest shares until the model fits it; the rest of
    the stage recovers at the target. ``"threshold"`` prunes by ``tau`` alone (the paper).
    With ``size_ratio=1`` (and no ``target_compression``) and ``"shares"`` the late stage
    holds the size and trains the loss alone: the late stage off (with ``"paper"`` the
    paper's S term still trains). ``"shares"`` resists the gate/core scaling, a diagonal
    change of basis on a bond; a general change of basis can still move shares (as it
    can the ``contribution`` prune rule, which shares the measure).
    """

    enabled: bool = True
    gamma: float = 1e-2
    regularizer: str = "mean"
    reg_start_step: int = 0  # ours: train the loss alone before this step (0 = the paper)
    tau: float = 1e-2
    prune_rule: str = "gate"
    early_steps: int = 1000
    prune_every: int = 100
    compact_every: int | None = None
    size_ratio: float = 0.5  # c in S0 = c * S(end of early stage); the paper uses 0.8/0.5/0.2
    loss_target: float | None = None  # L0; None: smoothed loss at the end of the early stage
    rho: float = 0.05  # weight of the plain weighted sum in the late stage
    size_objective: str = "shares"  # "shares" (symmetry-invariant) | "paper" (S on gates)
    late_prune: str = "schedule"  # "schedule" (budget from live size) | "threshold" (tau)
    prune_ramp: float = 0.25  # share of the late stage over which the budget falls
    target_compression: float | None = None  # whole model vs reference; overrides size_ratio

    def __post_init__(self) -> None:
        check_kinds(self)
        for name in ("gamma", "tau", "rho"):  # NaN passes a ``< 0`` test: ask for finite
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"ComeraConfig.{name} must be a finite number >= 0, got {value}")
        for name in ("gamma", "rho"):  # objective weights: an overflow trained on NaN
            if getattr(self, name) > WEIGHT_LIMIT:
                raise ConfigError(
                    f"ComeraConfig.{name}={getattr(self, name):g} is above {WEIGHT_LIMIT:g}: the "
                    "step's float32 weights would overflow; give a smaller value"
                )
        if self.regularizer not in REGULARIZERS:
            raise ConfigError(
                f"ComeraConfig.regularizer={self.regularizer!r}; choose one of {REGULARIZERS}"
            )
        if self.prune_rule not in PRUNE_RULES:
            raise ConfigError(
                f"ComeraConfig.prune_rule={self.prune_rule!r}; choose one of {PRUNE_RULES}"
            )
        for name, low in (("early_steps", 0), ("prune_every", 1)):  # each named alone
            if getattr(self, name) < low:
                raise ConfigError(
                    f"ComeraConfig.{name} must be >= {low}, got {getattr(self, name)}"
                )
        if self.compact_every is not None and self.compact_every < 1:
            raise ConfigError(
                f"ComeraConfig.compact_every must be None or >= 1, got {self.compact_every}"
            )
        if not 0 < self.size_ratio <= 1:
            raise ConfigError(
                f"ComeraConfig.size_ratio (c) must be in (0, 1], got {self.size_ratio}"
            )
        if self.size_objective not in SIZE_OBJECTIVES:
            raise ConfigError(
                f"ComeraConfig.size_objective={self.size_objective!r}; choose one of "
                f"{SIZE_OBJECTIVES}"
            )
        if self.late_prune not in LATE_PRUNES:
            raise ConfigError(
                f"ComeraConfig.late_prune={self.late_prune!r}; choose one of {LATE_PRUNES}"
            )
        if not 0 < self.prune_ramp <= 1:
            raise ConfigError(f"ComeraConfig.prune_ramp must be in (0, 1], got {self.prune_ramp}")
        if self.target_compression is not None and not (
            math.isfinite(self.target_compression) and self.target_compression >= 1
        ):
            raise ConfigError(
                "ComeraConfig.target_compression (X in reference size / X) must be >= 1, "
                f"got {self.target_compression}"
            )
        if (
            self.target_compression is not None
            and self.size_objective == "paper"
            and self.late_prune == "threshold"
        ):
            raise ConfigError(
                "ComeraConfig.target_compression needs live-size targets: the paper's late "
                "stage (size_objective='paper', late_prune='threshold') aims at size_ratio x "
                "S; set late_prune='schedule' or drop target_compression"
            )
        if self.loss_target is not None and not (
            math.isfinite(self.loss_target) and self.loss_target > 0
        ):
            raise ConfigError(
                f"ComeraConfig.loss_target must be a finite number > 0, got {self.loss_target}"
            )
        if self.loss_target is not None and (1 + self.rho) / self.loss_target > WEIGHT_LIMIT:
            raise ConfigError(
                f"ComeraConfig.loss_target={self.loss_target:g} makes the late stage's weight "
                "(1 + rho) / loss_target overflow float32; give a loss target of at least "
                f"{(1 + self.rho) / WEIGHT_LIMIT:.3g}"
            )
        if self.enabled and self.early_steps == 0 and self.loss_target is None:
            raise ConfigError(
                "ComeraConfig: early_steps=0 starts in the late stage, which needs a loss "
                "target; set loss_target (L0) or give the early stage some steps"
            )
        if self.reg_start_step < 0 or (  # a dense run (enabled off) has no regularizer
            self.enabled and self.gamma > 0 and 0 < self.early_steps <= self.reg_start_step
        ):
            raise ConfigError(
                f"ComeraConfig.reg_start_step={self.reg_start_step} must be >= 0 and below "
                f"early_steps={self.early_steps}, or the gate regularizer never runs"
            )


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """Everything the loop needs; experiments build one from their presets.

    ``wandb``: ``None`` (default) honours ``WANDB_MODE`` from the environment and is
    ``offline`` otherwise; without the wandb package it is ``disabled`` (said once).
    ``accum_steps``: micro-batches per optimizer step, weighted exactly by their counts.
    ``keep_checkpoints``: how many of the newest checkpoints stay on disk.
    ``optimizer``: ``"adamw"`` (``optim``, three learning-rate groups) or ``"sgd"`` (``sgd``;
    keeps no moments, so sparse embedding gradients stay sparse) or ``"galore"`` (``galore``:
    GaLore-AdamW from the galore-torch package, the dense baseline's; lr ``optim.lr_rest``).
    ``cpu_malloc``: the process's CPU allocator policy (``experiments.malloc``): ``"default"``
    (glibc as found), ``"keep"`` (faster steps, resident memory at its high-water mark),
    ``"release"`` (lowest resident memory, slower steps) or ``"lean"`` (``release`` on
    transparent huge pages: nearly its memory at a fraction of its page-fault time);
    applied when training on CPU.
    ``step_mode``: ``"eager"`` (default: the loop's step, reading the loss on the host),
    ``"sync_free"`` (the same step with every decision on the device), ``"compile"``
    (that step under ``torch.compile``) or ``"cuda_graph"`` (captured and replayed; CUDA
    only); see :mod:`comera.train.sync_free`.
    """

    steps: int
    run_dir: str
    optim: AdamWConfig = field(default_factory=AdamWConfig)
    optimizer: str = "adamw"
    sgd: SGDConfig = field(default_factory=SGDConfig)
    galore: GaLoreConfig = field(default_factory=GaLoreConfig)
    comera: ComeraConfig = field(default_factory=ComeraConfig)
    warmup_steps: int = 0
    schedule: str = "linear"  # linear | cosine | constant decay after warmup
    grad_clip: float | None = 1.0
    accum_steps: int = 1
    log_every: int = 10
    eval_every: int | None = None
    checkpoint_every: int | None = None
    keep_checkpoints: int = 2
    seed: int = 0
    device: str = "cpu"
    bf16: bool = False
    cpu_malloc: str = "default"
    step_mode: str = "eager"
    wandb: str | None = None  # online | offline | disabled | None (WANDB_MODE, else offline)
    wandb_project: str = "comera"
    wandb_entity: str | None = None
    wandb_group: str | None = None
    wandb_tags: tuple[str, ...] = ()
    run_name: str | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.wandb_tags, str):  # tuple("ab") would be two tags, "a" and "b"
            self.wandb_tags = (self.wandb_tags,)
        if isinstance(self.run_dir, os.PathLike):  # a Path is what callers have at hand
            self.run_dir = os.fspath(self.run_dir)
        if isinstance(self.device, torch.device):
            self.device = str(self.device)
        check_kinds(self)
        if not self.run_dir.strip():  # "" wrote the run's files into the current folder
            raise ConfigError("TrainConfig.run_dir is empty; give the run's folder")
        if self.steps < 1:
            raise ConfigError(f"TrainConfig.steps must be >= 1, got {self.steps}")
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"TrainConfig.optimizer={self.optimizer!r}; choose one of {OPTIMIZERS}"
            )
        if self.schedule not in ("linear", "cosine", "constant"):
            raise ConfigError(
                f"TrainConfig.schedule must be linear, cosine or constant, got {self.schedule!r}"
            )
        if self.wandb is not None and self.wandb not in WANDB_MODES:
            raise ConfigError(
                f"TrainConfig.wandb must be online, offline or disabled, got {self.wandb!r}"
            )
        if self.step_mode not in STEP_MODES:
            raise ConfigError(
                f"TrainConfig.step_mode={self.step_mode!r}; choose one of {STEP_MODES}"
            )
        if self.optimizer == "galore" and self.step_mode != "eager":
            raise ConfigError(
                f"TrainConfig.step_mode={self.step_mode!r} cannot run GaLore (its projector "
                "refresh runs on the host); use step_mode='eager' with optimizer='galore'"
            )
        if self.optimizer == "galore" and self.comera.enabled:
            raise ConfigError(
                "TrainConfig.optimizer='galore' trains the dense baseline (GaLore projects "
                "dense gradients): a dense model with train.comera.enabled=false (the "
                "experiments' --dense)"
            )
        if self.cpu_malloc not in CPU_MALLOC_POLICIES:
            raise ConfigError(
                f"TrainConfig.cpu_malloc={self.cpu_malloc!r}; choose one of {CPU_MALLOC_POLICIES}"
            )
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(
                f"TrainConfig.device={self.device!r} is not a torch device (cpu, cuda, "
                f"cuda:1, ...): {e}"
            ) from None
        if self.bf16 and not self.device.startswith("cuda"):
            raise ConfigError(
                f"TrainConfig.bf16 autocast is for CUDA devices, and train.device is "
                f"{self.device!r}; set it to cuda (--device cuda) or leave bf16 off"
            )
        for name, low in (("log_every", 1), ("warmup_steps", 0), ("keep_checkpoints", 1)):
            if getattr(self, name) < low:
                raise ConfigError(f"TrainConfig.{name} must be >= {low}, got {getattr(self, name)}")
        if not 1 <= self.accum_steps <= MAX_ACCUM_STEPS:
            # the step holds its micro-batches together: 10**22 of them was an out-of-memory
            # kill with no message
            raise ConfigError(
                f"TrainConfig.accum_steps must be in [1, {MAX_ACCUM_STEPS}] (a step holds its "
                f"micro-batches together; give a larger batch instead), got {self.accum_steps}"
            )
        for name in ("eval_every", "checkpoint_every"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(
                    f"TrainConfig.{name} must be None or >= 1, got {getattr(self, name)}"
                )
        if self.grad_clip is not None and not self.grad_clip > 0:  # inf: clips nothing
            raise ConfigError(
                f"TrainConfig.grad_clip must be None (off) or > 0, got {self.grad_clip}"
            )
        if not -(2**63) <= self.seed < 2**63:  # torch.manual_seed's range
            raise ConfigError(f"TrainConfig.seed must fit in 64 bits (signed), got {self.seed}")


def check_step_mode_device(step_mode: str, device: str) -> None:
    """Refuse ``step_mode='cuda_graph'`` off a CUDA device: a command checks it before it
    builds (and prints) the model, the sync-free step again when it is made."""
    if step_mode == "cuda_graph" and torch.device(device).type != "cuda":
        raise ConfigError(
            "train.step_mode='cuda_graph' needs a CUDA device (train.device); use "
            "'compile' or 'sync_free' on CPU"
        )


def usable_device(device: str, what: str = "TrainConfig.device", cpu: str = "device='cpu'") -> None:
    """Refuse a device this process cannot train on, naming ``what`` to change and
    ``cpu`` as the way out: a CUDA device torch does not see, another type (mps, xpu)
    torch says is unavailable, or ``meta`` (no data). A type torch has no availability
    check for (xla, a plugin's backend) is let through. Without it a run fails with a bare
    traceback at its first ``.to(device)``."""
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ConfigError(
            f"{what} {device!r} is not a torch device (cpu, cuda, cuda:1, ...)"
        ) from None
    if dev.type == "meta":
        raise ConfigError(
            f"{what} {device!r}: a meta tensor holds no data to train; use cpu or cuda"
        )
    if dev.type not in ("cpu", "cuda"):  # mps, xpu, ...: torch's own check, where it has one
        backend = getattr(torch.backends, dev.type, None) or getattr(torch, dev.type, None)
        usable = getattr(backend, "is_available", None)
        if usable is not None and not usable():  # none (xla, a plugin's): left to torch
            raise ConfigError(
                f"{what} {device}: this torch {torch.__version__} has no usable {dev.type} "
                f"device here; use {cpu} (or cuda on a GPU machine)"
            )
        return
    if dev.type != "cuda":
        return
    if not torch.cuda.is_available():
        raise ConfigError(
            f"{what} {device}: no CUDA device here (this torch {torch.__version__} sees "
            f"none); use {cpu}"
        )
    count = torch.cuda.device_count()
    if dev.index is not None and dev.index >= count:
        raise ConfigError(f"{what} {device}: this machine has {count} CUDA device(s); use cuda:0")
