"""``benchmarks.efficiency`` (Figure 1) and ``benchmarks.step_modes``: plumbing on toy sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.mark.slow
def test_figure_one_sweep_plumbing_on_a_toy_model(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    from benchmarks import efficiency

    argv = ["--batches", "1", "--repeats", "1", "--threads", "1", "--tiny", "--out",
            str(tmp_path)]  # fmt: skip
    assert efficiency.main(argv) == 0
    result = json.loads((tmp_path / "efficiency.json").read_text())
    assert {(r["variant"], r["batch"]) for r in result["runs"]} == {
        (v, 1) for v in ("comera", "dense", "galore")
    }
    assert {"cpu", "torch", "date"} <= set(result)  # what the report's header names
    # the report is rendered from the JSON alone, and rendered again from it the same
    assert (tmp_path / "efficiency.md").read_text() == efficiency.render(result)
    assert (tmp_path / "efficiency.png").is_file()
    # it described the paper-size model it did not measure
    text = (tmp_path / "efficiency.md").read_text()
    assert "A toy model (`--tiny`" in text and "The paper-size model" not in text
    again = tmp_path / "again"
    assert (
        efficiency.main(["--render", str(tmp_path / "efficiency.json"), "--out", str(again)]) == 0
    )
    assert (again / "efficiency.md").read_text() == efficiency.render(result)
    assert (again / "efficiency.png").is_file()
    assert efficiency.command(result) == (
        "python -m benchmarks.efficiency --tiny --batches 1 --repeats 1 --threads 1"
        f" --out {tmp_path}"
    )
    assert efficiency.main(["--batches", "x"]) == 2


@pytest.mark.slow
def test_step_modes_bench_writes_its_table(tmp_path) -> None:
    """The step-mode bench runs the trainer's step per mode in fresh processes and
    writes the ratios against eager (tiny sizes: this checks the plumbing, not speed)."""
    from benchmarks import step_modes

    argv = ["--models", "smoke", "--modes", "sync_free", "--repeats", "1", "--tiny"]
    assert step_modes.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_modes.json").read_text())
    assert [r["mode"] for r in result["runs"]] == ["eager", "sync_free"]  # eager added
    assert all(r["step_s"] > 0 and r["peak_mb"] > 0 for r in result["runs"])
    assert {"cpu", "torch", "date"} <= set(result)  # what the report's header names
    assert (tmp_path / "step_modes.md").read_text() == step_modes.render(result)
    assert step_modes.command(result) == (
        "python -m benchmarks.step_modes --tiny --models smoke --modes eager,sync_free --repeats 1"
        f" --threads {result['threads']} --out {tmp_path}"
    )
    assert step_modes.main(["--modes", "turbo"]) == 2


def test_step_modes_paper_point_trains_as_the_paper_preset(tmp_path) -> None:
    """The paper row's step is the paper preset's (model, objective from step 0,
    schedule, clipping) with only the step mode, device and logging changed."""
    import dataclasses

    from benchmarks import step_modes
    from experiments.mnli import experiment as mnli

    paper = mnli.preset("paper", run_dir=str(tmp_path))
    p = step_modes.point_preset("paper", "sync_free", str(tmp_path))
    assert p.model == paper.model and p.batch_size == paper.batch_size == 32
    want = dataclasses.replace(paper.train, step_mode="sync_free", wandb="disabled",
                               progress=False, device="cpu")  # fmt: skip
    assert p.train == want
    assert p.train.comera.reg_start_step == 0 and p.data.max_length == 128
    smoke = step_modes.point_preset("smoke", "eager", str(tmp_path))
    assert smoke.train.comera == mnli.preset("smoke").train.comera and smoke.batch_size == 128


def test_step_modes_refuses_a_cuda_device_this_machine_lacks(tmp_path, monkeypatch, capsys):
    """Refused before any worker runs (it ran every point to failure and left a partial
    JSON), with the flag named; CUDA is hidden so the test runs on GPU machines too."""
    from benchmarks import step_modes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_modes.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_step_modes_keeps_the_points_of_a_run_cut_short(tmp_path, monkeypatch) -> None:
    """The points go to ``step_modes.partial.json`` as they come, so a run stopped by a
    time limit (the GPU script's stages) keeps what it measured; a failing mode is
    recorded there with its error and the other modes still run (exit 1); the last
    complete report stays as it was; eager runs first whatever the order given."""
    from benchmarks import step_modes
    from experiments.workers import WorkerFailed

    seen = []

    def point(model, mode, *args):
        seen.append((model, mode))
        if model == "paper" and mode != "eager":
            raise WorkerFailed("step-mode worker paper/" + mode, "cut short")
        return {"model": model, "mode": mode, "batch": 8, "seq": 16, "first_step_s": 1.0,
                "step_s": 0.5, "peak_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(step_modes, "run_point", point)
    (tmp_path / "step_modes.json").write_text('{"last": "complete"}')
    argv = ["--models", "smoke,paper", "--modes", "sync_free,eager", "--out", str(tmp_path)]
    assert step_modes.main(argv) == 1  # a failing mode: recorded, the others still run
    assert seen == [("smoke", "eager"), ("smoke", "sync_free"), ("paper", "eager"),
                    ("paper", "sync_free")]  # fmt: skip
    assert json.loads((tmp_path / "step_modes.json").read_text()) == {"last": "complete"}
    partial = json.loads((tmp_path / "step_modes.partial.json").read_text())
    assert partial["partial"] and len(partial["runs"]) == 4
    assert partial["runs"][-1] == {"model": "paper", "mode": "sync_free", "error": "cut short"}
    monkeypatch.setattr(step_modes, "run_point", lambda m, mode, *a: point("smoke", mode))
    assert step_modes.main([*argv[:1], "smoke", *argv[2:]]) == 0  # complete: report, no partial
    assert len(json.loads((tmp_path / "step_modes.json").read_text())["runs"]) == 2
    assert not (tmp_path / "step_modes.partial.json").exists()
    # a run failing at its first point leaves no older run's partial file behind
    (tmp_path / "step_modes.partial.json").write_text('{"older": "run"}')
    monkeypatch.setattr(step_modes, "run_point", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        step_modes.main(argv)
    assert not (tmp_path / "step_modes.partial.json").exists()


def test_step_modes_point_past_its_timeout_is_a_failed_point() -> None:
    """``--point-timeout``: a worker that runs past it (a long compile) is killed and
    reported like any failing worker, so the stage goes on to the next mode."""
    from benchmarks import step_modes

    with pytest.raises(
        RuntimeError, match=r"smoke/compile failed:\nstopped after --point-timeout 0.01 s"
    ):
        step_modes.run_point("smoke", "compile", 1, 1, True, "cpu", timeout=0.01)


def test_a_failing_point_keeps_the_others_and_the_last_sweep(tmp_path, monkeypatch, capsys):
    """One failing worker was a traceback that dropped every point measured before it (a
    sweep of the paper-size model takes a long time); now the others still run, each is
    kept in ``efficiency.partial.json``, the last complete ``efficiency.json`` stays and
    the exit status is 1. Without galore-torch the comparison is refused at once."""
    from benchmarks import efficiency
    from experiments.workers import WorkerFailed

    def worker(variant, batch, *args):
        if (variant, batch) == ("dense", 1):
            raise WorkerFailed("dense/1", "MemoryError: out of memory", -9)
        return {"variant": variant, "batch": batch, "step_s": 1.0, "peak_mb": 1.0}

    monkeypatch.setattr(efficiency, "run_worker", worker)
    monkeypatch.setattr(efficiency, "galore_available", lambda: True)
    (tmp_path / "efficiency.json").write_text('{"last": "complete"}')
    argv = ["--batches", "1,8", "--repeats", "1", "--tiny", "--out", str(tmp_path)]
    assert efficiency.main(argv) == 1
    assert (tmp_path / "efficiency.json").read_text() == '{"last": "complete"}'
    runs = json.loads((tmp_path / "efficiency.partial.json").read_text())["runs"]
    assert len(runs) == 6 and runs[1] == {"variant": "dense", "batch": 1,
                                          "error": "MemoryError: out of memory"}  # fmt: skip
    assert "dense/1" in capsys.readouterr().err
    monkeypatch.setattr(efficiency, "galore_available", lambda: False)
    assert efficiency.main(argv) == 2
    assert "pip install 'comera-framework[galore]'" in capsys.readouterr().err
