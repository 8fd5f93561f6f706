"""Fine-tune any Hugging Face sequence classifier with CoMERA: tensorized by target globs,
rank-adapted by the shared trainer (:mod:`experiments.finetune.experiment`)."""

from experiments.finetune.experiment import EXPERIMENT, Preset, build, main, preset

__all__ = ["EXPERIMENT", "Preset", "build", "main", "preset"]
