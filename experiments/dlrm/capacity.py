"""How much of the planted signal a TTM table of a given rank can hold at all.

The smoke data's click logit is a sum of independent per-value effects (``generate``). A
model learns those effects from noisy labels; here we skip the learning and ask the
representational question alone: replace each compressed table's *true* effects by their
best TTM approximation of the model's shape at rank ``r`` and score the planted logit on
the validation rows. The gap between that oracle and the uncompressed oracle is what rank
``r`` costs any trainer, however good.

The approximation is the TT-SVD (``comera.from_dense``) of the table whose first column
holds each id's effect times ``sqrt(train count)`` (zero elsewhere), so its Frobenius error
is the count-weighted squared error of the effects: TT-SVD is within ``sqrt(d - 1)`` of the
best TT of those ranks in that norm. Ids never seen in training get effect 0 in both
oracles (no trainer could know them). Hot rows (``model.hot_rows``) are not modelled: the
oracle is for plain TTM tables, the paper's model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

import comera as C
from experiments.dlrm.data import CriteoData
from experiments.dlrm.generate import planted_parts
from experiments.dlrm.model import DLRMConfig, table_specs
from experiments.dlrm.task import roc_auc

__all__ = ["capacity_oracle"]


def _id_effects(ids: np.ndarray, effects: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean planted effect and row count of each of ``n`` ids over the given rows (an id
    holds one value, or the rows whose value is missing, whose mean effect it gets)."""
    counts = np.bincount(ids, minlength=n).astype(np.float64)
    sums = np.bincount(ids, weights=effects, minlength=n)
    return np.divide(sums, counts, out=np.zeros(n), where=counts > 0), counts


def _compress(effect: np.ndarray, counts: np.ndarray, spec: C.TTMEmbeddingSpec) -> np.ndarray:
    """The count-weighted rank-``spec.ranks`` TTM approximation of one table's effects."""
    w = np.sqrt(counts)
    table = torch.zeros(spec.num_embeddings, spec.embedding_dim, dtype=torch.float64)
    table[:, 0] = torch.from_numpy(effect * w)
    spec64 = dataclasses.replace(spec, dtype=torch.float64)
    params, state = C.from_dense(table, spec64)
    approx = C.to_dense(params, state, spec64)[: spec.num_embeddings, 0].numpy()
    return np.divide(approx, w, out=np.zeros_like(approx), where=w > 0)


def capacity_oracle(
    data: CriteoData,
    model: DLRMConfig,
    ranks: Sequence[int],
    *,
    seed: int = 0,
    eval_rows: int | None = None,
) -> dict[str, float]:
    """Validation AUC of the planted logit with the compressed tables' effects replaced by
    their best TTM approximation at each rank in ``ranks`` (keys ``"rank_<r>"``), beside
    the uncompressed oracle (``"uncompressed"``: each id's effect as seen in training) and
    the planted logit itself (``"bayes"``). ``data`` must be the generated file of
    ``data.meta``'s row count and ``seed``; ``model`` gives the TTM tables' shapes."""
    parts = planted_parts(len(data), seed)
    train_lo, train_hi = data.splits["train"]
    lo, hi = data.splits["val"]
    hi = hi if eval_rows is None else lo + eval_rows
    labels = np.asarray(data.label[lo:hi])
    specs = table_specs(model)
    names = list(model.names)
    per_id = {}
    for j, row_effect in parts["effects"].items():
        ids = np.asarray(data.cat[:, j], dtype=np.int64)
        n = data.cardinalities[j]
        mean, counts = _id_effects(ids[train_lo:train_hi], row_effect[train_lo:train_hi], n)
        per_id[j] = (ids[lo:hi], mean, counts)

    def score(rank: int | None) -> float:
        logit = parts["rest"][lo:hi].copy()
        for j, (val_ids, mean, counts) in per_id.items():
            spec = specs.get(names[j])
            effect = mean
            if rank is not None and spec is not None:
                effect = _compress(mean, counts, dataclasses.replace(spec, ranks=rank))
            logit += effect[val_ids]
        return roc_auc(logit, labels)

    out = {"bayes": roc_auc(parts["logit"][lo:hi], labels), "uncompressed": score(None)}
    out.update({f"rank_{r}": score(r) for r in ranks})
    return out
