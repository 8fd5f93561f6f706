"""DLRM on Criteo Kaggle with tensor-compressed tables (the paper's recommendation result).

Modules: ``data`` (raw TSV -> cached memory-mapped table), ``generate`` (planted-signal
file), ``batches`` (resumable shuffled rows), ``model`` (DLRM over a params pytree),
``task`` (loss and click metrics), ``experiment`` (presets, CLI), ``bench``, ``report``.
"""

from experiments.dlrm.experiment import EXPERIMENT, Preset, build, main, preset, run

__all__ = ["EXPERIMENT", "Preset", "build", "main", "preset", "run"]
