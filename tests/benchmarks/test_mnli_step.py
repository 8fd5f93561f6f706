"""``python -m benchmarks.mnli_step``: where it writes, what a run cut short keeps, and
its plumbing on a toy model (workers in fresh processes)."""

import json
from pathlib import Path

import pytest
import torch

from experiments.host import cpu_model

REPORTS = Path(__file__).resolve().parents[2] / "reports"


def test_gpu_step_bench_never_replaces_the_cpu_figures(tmp_path, monkeypatch):
    """Without ``out``, a CUDA run writes ``reports/gpu/mnli_bench_cuda.json`` and leaves
    the CPU JSON alone (workers stubbed: no GPU is needed to check where it writes)."""
    from benchmarks import mnli_step as mnli_bench

    cpu, gpu = tmp_path / "mnli_bench.json", tmp_path / "gpu" / "mnli_bench_cuda.json"
    monkeypatch.setattr(mnli_bench, "REPORT_JSON", cpu)
    monkeypatch.setattr(mnli_bench, "GPU_REPORT_JSON", gpu)

    def fake_worker(variant, batch, *args):
        return {"variant": variant, "batch": batch, "step_s": 1.0, "peak_mb": 1.0,
                "params": 1, "peak_memory": "fake"}  # fmt: skip

    monkeypatch.setattr(mnli_bench, "run_worker", fake_worker)
    assert mnli_bench.run(device="cuda", repeats=1) == 0
    assert json.loads(gpu.read_text())["device"] == "cuda" and not cpu.exists()
    assert not (gpu.parent / "mnli_bench_cuda.partial.json").exists()  # removed when done
    assert mnli_bench.run(device="cpu", repeats=1) == 0
    assert json.loads(cpu.read_text())["device"] == "cpu"
    # without galore-torch the GaLore variant and its ratios are left out, the rest stays
    monkeypatch.setattr(mnli_bench, "galore_available", lambda: False)
    assert mnli_bench.run(device="cuda", repeats=1) == 0
    result = json.loads(gpu.read_text())
    assert not any("galore" in k for k in result)
    assert {r["variant"] for r in result["runs"]} == set(mnli_bench.VARIANTS) - {"galore"}
    assert "step_time_ratio_vs_dense" in result


def test_step_bench_cut_short_keeps_its_workers_and_the_last_figures(tmp_path, monkeypatch):
    """Each worker's result goes to a ``.partial.json`` beside the output as it comes; a
    run that stops early leaves that file and the last complete JSON untouched; a failing
    worker is recorded there and the others still run (exit 1, no summary)."""
    from benchmarks import mnli_step as mnli_bench
    from experiments.workers import WorkerFailed

    out = tmp_path / "mnli_bench.json"
    out.write_text('{"last": "complete"}')
    (tmp_path / "mnli_bench.partial.json").write_text('{"older": "run"}')
    monkeypatch.setattr(mnli_bench, "galore_available", lambda: True)
    calls = []

    def worker(variant, batch, *args):
        calls.append(variant)
        if len(calls) == 3:
            raise OSError("time limit")  # the process stopped from outside
        return {"variant": variant, "batch": batch, "step_s": 1.0, "peak_mb": 1.0,
                "params": 1, "peak_memory": "fake"}  # fmt: skip

    monkeypatch.setattr(mnli_bench, "run_worker", worker)
    with pytest.raises(OSError, match="time limit"):
        mnli_bench.run(device="cpu", repeats=1, out=out)
    assert json.loads(out.read_text()) == {"last": "complete"}
    partial = json.loads((tmp_path / "mnli_bench.partial.json").read_text())
    assert partial["partial"] and [r["variant"] for r in partial["runs"]] == calls[:2]
    assert "older" not in partial and partial["torch"] == torch.__version__

    def failing(variant, batch, *args):  # one worker fails: the rest still run
        if variant == "galore":
            raise WorkerFailed("bench worker galore/1", "Traceback\nValueError: boom")
        return {"variant": variant, "batch": batch, "step_s": 1.0, "peak_mb": 1.0,
                "params": 1, "peak_memory": "fake"}  # fmt: skip

    monkeypatch.setattr(mnli_bench, "run_worker", failing)
    assert mnli_bench.run(device="cpu", repeats=1, out=out, json_out=True) == 1
    # GaLore (optional) failing alone: the summary is written without it, saying why
    summary = json.loads(out.read_text())
    assert (
        summary["galore_error"] == "ValueError: boom" and "step_time_ratio_vs_galore" not in summary
    )
    assert "step_time_ratio_vs_dense" in summary and all("error" not in r for r in summary["runs"])
    out.write_text('{"last": "complete"}')

    def failing_dense(variant, batch, *args):  # a core point fails: no summary at all
        if variant == "dense" and batch == 1:
            raise WorkerFailed("bench worker dense/1", "Traceback\nValueError: boom")
        return failing("comera", batch) | {"variant": variant}

    monkeypatch.setattr(mnli_bench, "run_worker", failing_dense)
    assert mnli_bench.run(device="cpu", repeats=1, out=out) == 1
    assert json.loads(out.read_text()) == {"last": "complete"}
    runs = json.loads((tmp_path / "mnli_bench.partial.json").read_text())["runs"]
    errors = [r for r in runs if "error" in r]
    assert errors == [{"variant": "dense", "batch": 1, "error": "ValueError: boom"}]
    assert len(runs) > len(errors) and {r["batch"] for r in runs} == set(mnli_bench.BATCHES)


@pytest.mark.slow
def test_step_bench_plumbing(tmp_path, capsys, monkeypatch):
    """One worker in a fresh process (its command line, its JSON, a real peak), then the
    whole bench with every worker run in this process: what is tested here is that each
    variant runs and every figure is computed and printed, not the measurements (the
    thirteen processes' imports alone took 40 of this test's 50-60 s)."""
    from benchmarks import mnli_step as mnli_bench

    real = mnli_bench.run_worker("comera", 1, 1, "cpu", 1, True, "lean")
    assert real["variant"] == "comera" and real["malloc"] == "lean"
    assert real["peak_mb"] > 0 and real["step_s"] > 0
    peaks = iter(range(1, 10_000))  # in one process a peak above the baseline means nothing
    monkeypatch.setattr(mnli_bench, "apply_cpu_malloc", lambda policy: None)
    monkeypatch.setattr(mnli_bench, "baseline_rss_mb", lambda: 0.0)
    monkeypatch.setattr(mnli_bench, "peak_memory_mb", lambda device: float(next(peaks)))
    monkeypatch.setattr(mnli_bench, "run_worker", mnli_bench.worker)
    threads = torch.get_num_threads()
    out = tmp_path / "bench.json"
    try:
        code = mnli_bench.run(json_out=True, device="cpu", repeats=1, threads=1, tiny=True,
                              out=out)  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0
    result = json.loads(capsys.readouterr().out)
    for key in (
        "step_time_ratio_vs_dense",
        "peak_memory_ratio_vs_dense",
        "peak_memory_ratio_vs_dense_b32",
        "compression_ratio",
        "peak_memory_ratio_vs_dense_b32_recompute",
        "peak_memory_ratio_recompute_vs_dense_b32",
        "step_time_ratio_vs_galore",
        "peak_memory_ratio_vs_galore",
    ):
        assert result[key] > 0
    assert {(r["variant"], r["batch"], r["malloc"]) for r in result["runs"]} == {
        (v, b, "default") for v in ("comera", "dense", "comera_half", "galore") for b in (32, 1)
    } | {("comera_recompute", 32, "lean"), ("dense_recompute", 32, "lean"),
         ("comera_recompute@glibc_default", 32, "default"),
         ("dense_recompute@glibc_default", 32, "default"), ("dense@lean", 32, "lean")}  # fmt: skip
    assert result["peak_memory_ratio_vs_dense_b32_recompute_glibc_default"] > 0
    assert result["peak_memory_ratio_recompute_vs_dense_b32_each_own_policy"] > 0
    assert json.loads(out.read_text())["compression_ratio"] == result["compression_ratio"]
    # every key of the committed figures (measured by the old command) is still printed
    assert set(json.loads((REPORTS / "mnli_bench.json").read_text())) <= set(result)
    assert result["torch"] == torch.__version__ and result["cpu"] == cpu_model()
    # a toy run needs --out: the header's command names it (a run of the default, none)
    assert mnli_bench.command(result).endswith(f"--tiny --out {out}")


def test_the_benchmarks_task_without_data_builds_and_names_no_eval_split() -> None:
    """The step benchmark builds ``MNLITask`` with no data; reading its eval splits' digest
    at build failed every worker of ``mnli_step`` and ``efficiency`` (an AttributeError)."""
    from experiments.mnli.experiment import MNLITask
    from experiments.transformer import EncoderConfig

    task = MNLITask(EncoderConfig(), None, [], eval_batch_size=2)  # type: ignore[arg-type]
    assert task.eval_data_id == {}
