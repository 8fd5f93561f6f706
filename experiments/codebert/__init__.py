"""CodeBERT-style masked-LM pretraining fed by ``loaders.TokenLoader`` (issue 9, in progress).

Modules so far: ``model`` (RoBERTa MLM head over the shared encoder, attention confined to
each packed document) and ``masking`` (dynamic 80/10/10 masking)."""
