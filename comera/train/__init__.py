"""The shared trainer, one module per concern.

- ``config``: ``TrainConfig`` and ``ComeraConfig``, the run's settings, checked on creation.
- ``task``: the ``Task`` protocol an experiment implements (loss, evaluate, data iterator).
- ``module_task``: ``ModuleTask``, a Task over an ``nn.Module`` (a tensorized model).
- ``loop``: the ``Trainer`` that runs a task for ``cfg.steps`` optimizer steps.
- ``stages``: the CoMERA stage controller (objective per step, prune/compact events).
- ``objectives``: the gate regularizer, the size surrogate and the late-stage weights.
- ``optim``: AdamW and SGD over params pytrees, with the paper's three lr groups.
- ``galore``: GaLore-AdamW, the dense baseline's optimizer.
- ``sync_free``: the same step with no host read inside (``train.step_mode``).
- ``distributed``: exact data-parallel sums, broadcasts and process-group setup.
- ``checkpoint``: model single-writer, data and RNG state per rank, atomic and versioned.
- ``logging``: ``metrics.jsonl``, wandb and ``ranks.json``.
- ``measures``: live model size, learning-rate schedule, peak memory.
- ``run_lock``: one process per run dir (``RunDirInUseError`` for a second).
"""

from comera.errors import CheckpointError, RunDirInUseError
from comera.train.checkpoint import load_checkpoint
from comera.train.config import ComeraConfig, TrainConfig
from comera.train.distributed import init_distributed
from comera.train.galore import GaLoreConfig
from comera.train.logging import read_metrics
from comera.train.loop import NonFiniteLoss, Trainer
from comera.train.module_task import ModuleTask
from comera.train.optim import AdamWConfig, SGDConfig
from comera.train.task import Task

__all__ = [
    "AdamWConfig",
    "CheckpointError",
    "ComeraConfig",
    "GaLoreConfig",
    "ModuleTask",
    "NonFiniteLoss",
    "RunDirInUseError",
    "SGDConfig",
    "Task",
    "TrainConfig",
    "Trainer",
    "init_distributed",
    "load_checkpoint",
    "read_metrics",
]
