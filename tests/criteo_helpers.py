"""The Criteo sample the DLRM tests read: the 200 real Kaggle rows in ``../shared/data``
when this checkout sits next to them, else 200 generated rows in the same format (empty
fields, negative integers, 8-digit hashes), so the tests run wherever the repo is cloned."""

from __future__ import annotations

import tempfile
from pathlib import Path

from experiments.dlrm.generate import write_generated

SHARED_SAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "criteo_kaggle_sample.txt"


def _sample() -> Path:
    if SHARED_SAMPLE.is_file():
        return SHARED_SAMPLE
    path = Path(tempfile.mkdtemp(prefix="criteo-sample-")) / "criteo_generated_sample.txt"
    write_generated(path, 200, seed=7)
    return path


SAMPLE = _sample()
