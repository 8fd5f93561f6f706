"""What a run's ``config.json`` holds, shared by the command line that writes it and the
reports that read it: how a config value is written, and which keys a resume may change."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

__all__ = ["RESUME_MUTABLE", "config_jsonable"]

# keys a resumed run may change: where it runs and how it reports, never what it computes
RESUME_MUTABLE = frozenset(
    {
        "train.device",
        "train.wandb",
        "train.wandb_project",
        "train.wandb_entity",
        "train.wandb_group",
        "train.wandb_tags",
        "train.run_name",
        "train.progress",
        "train.cpu_malloc",
        "train.step_mode",
        "model.recompute",
        "model.grouped_halves",
    }
)


def config_jsonable(o: Any) -> Any:
    """A config value as ``config.json`` holds it: dataclasses as dicts, devices and
    paths as text, anything else by its ``repr``."""
    if dataclasses.is_dataclass(o) and not isinstance(o, type):  # (a class: its repr)
        return dataclasses.asdict(o)
    if isinstance(o, torch.device | Path):
        return str(o)
    return repr(o)
