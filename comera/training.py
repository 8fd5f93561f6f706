"""Compatibility module: the trainer now lives in :mod:`comera.train` (one file per concern).

Every name this module exported before is re-exported here unchanged.
"""

from comera.train import (
    CheckpointError,
    ComeraConfig,
    NonFiniteLoss,
    Task,
    TrainConfig,
    Trainer,
    load_checkpoint,
    model_size,
    read_metrics,
)
from comera.train.loop import lr_scale as _lr_scale  # noqa: F401 - kept for old imports

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
