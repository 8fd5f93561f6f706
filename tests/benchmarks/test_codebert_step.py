"""``python -m benchmarks.codebert_step``: its plumbing on a toy model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPORTS = Path(__file__).resolve().parents[2] / "reports"


@pytest.mark.slow
def test_bench_plumbing_on_a_toy_model(tmp_path: Path) -> None:
    from benchmarks import codebert_step as bench

    assert bench.run(steps=1, tiny=True, out=tmp_path / "b.json") == 0
    figures = json.loads((tmp_path / "b.json").read_text())
    for key in ("step_time_ratio_vs_dense", "peak_memory_ratio_vs_dense",
                "step_time_ratio_vs_dense_half_ranks",
                "peak_memory_ratio_vs_dense_mmap_threshold_1m"):  # fmt: skip
        assert figures[key] > 0, key
    assert len(figures["runs"]) == 7 + 2 * (bench.MEMORY_REPEATS - 1)
    peaks = figures["peak_memory_b1_mb_runs"]
    assert len(peaks["comera"]) == len(peaks["dense"]) == bench.MEMORY_REPEATS
    median = sorted(peaks["comera"])[1] / sorted(peaks["dense"])[1]  # three runs each
    assert figures["peak_memory_ratio_vs_dense"] == pytest.approx(median)
    batch = bench.packed_batch(3, 100, seq=512)
    assert batch["input_ids"].shape == (3, 512) and (batch["segment_ids"] > 0).all()
    assert batch["input_ids"].min() >= 5  # no special token among the inputs
    # every key of the committed figures (measured by the old command) is still written
    # (but the paper preset's sizes, which a toy run does not build)
    committed = set(json.loads((REPORTS / "codebert_bench.json").read_text()))
    assert committed - {"paper_params_dense", "paper_params_comera"} <= set(figures)
