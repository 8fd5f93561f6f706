"""``python -m benchmarks.codebert_step``: its plumbing on a toy model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

REPORTS = Path(__file__).resolve().parents[2] / "reports"


@pytest.mark.slow
def test_bench_plumbing_on_a_toy_model(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """One variant in a fresh process (its command line, its JSON, a real peak), then the
    whole bench with each variant run in this process: what is tested here is that every
    run happens and every figure is computed and written, not the measurements."""
    import sys

    import experiments.malloc
    from benchmarks import codebert_step as bench

    cmd = [sys.executable, "-m", "benchmarks.codebert_step", "--variant", "comera",
           "--batch", "1", "--steps", "1", "--tiny"]  # fmt: skip
    real = bench.run_json_worker(cmd, "codebert bench: comera/1")
    assert real["variant"] == "comera" and real["peak_mb"] > 0 and real["step_s"] > 0

    def in_process(cmd: list[str], what: str, env: dict | None = None) -> dict:
        arg = dict(zip(cmd[3::2], cmd[4::2], strict=False))  # --variant V --batch B ...
        return bench.run_variant(arg["--variant"], int(arg["--batch"]), int(arg["--steps"]),
                                 tiny="--tiny" in cmd)  # fmt: skip

    peaks = iter(range(1, 10_000))  # in one process a peak above the baseline means nothing
    monkeypatch.setattr(bench, "run_json_worker", in_process)
    monkeypatch.setattr(bench, "peak_memory_mb", lambda device: float(next(peaks)))
    monkeypatch.setattr(bench, "baseline_rss_mb", lambda: 0.0)
    monkeypatch.setattr(experiments.malloc, "apply_cpu_malloc", lambda policy: None)
    threads = torch.get_num_threads()
    try:
        assert bench.run(steps=1, tiny=True, out=tmp_path / "b.json") == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads((tmp_path / "b.json").read_text(), parse_constant=pytest.fail)
    # the header's command runs as written: a toy run is refused without its --out
    assert f"codebert_step --steps 1 --tiny --out {tmp_path / 'b.json'}" in bench.render(figures)
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
