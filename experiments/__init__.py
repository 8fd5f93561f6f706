"""Paper reproductions (MNLI six-encoder transformer, DLRM on Criteo, CodeBERT pretraining).

Experiments wire configs, models, data and the shared training loop; framework logic
lives in ``comera`` and ``loaders`` (imports run one way: experiments -> core).
"""
