"""CodeBERT-style masked-LM pretraining fed by ``loaders.TokenLoader``.

Modules: ``data`` (corpora prepared by ``loaders.prepare``: the stdlib, local folders,
CodeSearchNet from the hub), ``masking`` (dynamic 80/10/10 masking), ``model`` (RoBERTa MLM
head over the shared encoder, attention confined to each packed document), ``task`` (the
loss as (sum, count) over masked tokens), ``experiment`` (presets and CLI), ``bench`` and
``report``."""

from experiments.codebert.experiment import EXPERIMENT

__all__ = ["EXPERIMENT"]
