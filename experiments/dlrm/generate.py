"""A Criteo-format file with planted signal, for smoke runs and tests.

Rows look like Criteo's: 13 integer fields (some empty, a few negative), 26 hex hashes
(some empty) drawn from per-column vocabularies of Kaggle-like relative sizes with a
heavy head. The click probability is ``sigmoid(b + sum of per-value effects in C1, C3,
C4, C12, C16, C21 + effects of log(1 + I2) and log(1 + I5))``, so a model must learn
embeddings of large tables (C3, C4, C12, C16, C21 are the big ones) to score well: the
planted logit itself (``planted_logits``) is the Bayes limit, reported beside the runs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["GENERATED_VOCAB", "planted_logits", "write_generated"]

# vocabulary sizes per column: Kaggle's shape, scaled to a file of ~1e5 rows
GENERATED_VOCAB = (
    1460, 583, 60000, 30000, 305, 24, 12517, 633, 3, 9314, 5683, 50000, 3194,
    27, 14992, 40000, 10, 5652, 2173, 4, 45000, 18, 15, 28618, 105, 14257,
)  # fmt: skip
_EFFECT_COLUMNS = (0, 2, 3, 11, 15, 20)  # C1, C3, C4, C12, C16, C21


def _draw(rows: int, seed: int) -> dict[str, np.ndarray]:
    """Every random draw of the file, in one fixed order (so the logits can be redrawn)."""
    rng = np.random.default_rng(seed)
    logit = np.full(rows, -1.3)
    cats = np.empty((rows, 26), dtype=np.int64)
    for j, vocab in enumerate(GENERATED_VOCAB):
        # heavy head: value k drawn with probability ~ 1 / (k + 10)
        u = rng.random(rows)
        cats[:, j] = np.minimum((np.exp(u * np.log(vocab / 10 + 1)) - 1) * 10, vocab - 1)
        if j in _EFFECT_COLUMNS:
            effect = rng.normal(0.0, 0.9, size=vocab)
            logit += effect[cats[:, j]]
    dense = np.floor(rng.lognormal(1.0, 1.5, size=(rows, 13))).astype(np.int64)
    dense[rng.random((rows, 13)) < 0.05] -= 3  # a few negatives, as in Criteo
    logit += 0.5 * (np.log1p(np.maximum(dense[:, 1], 0)) - 1.5)
    logit -= 0.4 * (np.log1p(np.maximum(dense[:, 4], 0)) - 1.5)
    label = rng.random(rows) < 1 / (1 + np.exp(-logit))
    missing_dense = rng.random((rows, 13)) < 0.1
    missing_cat = rng.random((rows, 26)) < 0.03
    salts = rng.integers(0, 2**32, size=26, dtype=np.uint64)
    hashed = (cats.astype(np.uint64) * np.uint64(2654435761) + salts) % np.uint64(2**32)
    return {
        "logit": logit,
        "label": label,
        "dense": dense,
        "hashed": hashed,
        "missing_dense": missing_dense,
        "missing_cat": missing_cat,
    }


def planted_logits(rows: int, seed: int = 0) -> np.ndarray:
    """The click logit each row was drawn from: the best any model can score (its AUC on
    a split is that split's Bayes limit, up to the dense values later blanked)."""
    return _draw(rows, seed)["logit"]


def write_generated(path: Path, rows: int, seed: int = 0) -> None:
    """Write ``rows`` Criteo-format lines with planted signal to ``path``."""
    d = _draw(rows, seed)
    label, dense, hashed = d["label"], d["dense"], d["hashed"]
    missing_dense, missing_cat = d["missing_dense"], d["missing_cat"]
    with open(path, "w") as f:
        for i in range(rows):
            fields = ["1" if label[i] else "0"]
            fields += ["" if missing_dense[i, j] else str(dense[i, j]) for j in range(13)]
            fields += ["" if missing_cat[i, j] else f"{int(hashed[i, j]):08x}" for j in range(26)]
            f.write("\t".join(fields) + "\n")
