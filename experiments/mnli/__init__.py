"""MNLI with the paper's six-encoder transformer, CoMERA vs dense.

Modules: ``generated`` (the synthetic NLI task and its cue baselines), ``data`` (hub, local
files or generated -> tokenizer -> encoded pairs), ``batches`` (resumable, rank-aware
batching), ``experiment`` (presets, task, CLI), ``demo`` (the main job), ``report``.
The encoder itself is :mod:`experiments.transformer`, shared with CodeBERT.
"""

from experiments.mnli.experiment import EXPERIMENT, Preset, build, main, preset, run

__all__ = ["EXPERIMENT", "Preset", "build", "main", "preset", "run"]
