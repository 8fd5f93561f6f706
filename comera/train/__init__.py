"""The shared trainer, one module per concern.

``config`` (ComeraConfig, TrainConfig), ``stages`` (the CoMERA stage controller),
``distributed`` (exact reduction), ``checkpoint`` (model single-writer, data state per
rank), ``logging`` (metrics.jsonl, wandb, ranks.json) and ``loop`` (the Trainer that wires
them).
"""

from comera.train.checkpoint import CheckpointError, load_checkpoint
from comera.train.config import PRUNE_RULES, REGULARIZERS, ComeraConfig, TrainConfig
from comera.train.distributed import init_distributed, rank_world
from comera.train.logging import read_metrics, resolve_wandb_mode
from comera.train.loop import NonFiniteLoss, Trainer
from comera.train.measures import lr_scale, model_size
from comera.train.stages import Objective, StageController
from comera.train.task import Task

__all__ = [
    "PRUNE_RULES",
    "REGULARIZERS",
    "CheckpointError",
    "ComeraConfig",
    "NonFiniteLoss",
    "Objective",
    "StageController",
    "Task",
    "TrainConfig",
    "Trainer",
    "init_distributed",
    "load_checkpoint",
    "lr_scale",
    "model_size",
    "rank_world",
    "read_metrics",
    "resolve_wandb_mode",
]
