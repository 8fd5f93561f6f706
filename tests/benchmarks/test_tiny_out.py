"""A toy run (``--tiny``) measures nothing useful: it must name where it writes, or it would
overwrite the report's JSON with figures the report then shows as real."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import codebert_step, efficiency, mnli_step, step_modes, tensorize


@pytest.mark.parametrize("bench", [mnli_step, codebert_step, tensorize, efficiency, step_modes])
def test_tiny_without_out_is_refused_in_one_line(bench, capsys) -> None:  # noqa: ANN001
    assert bench.main(["--tiny"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--tiny measures a toy model: give --out PATH" in err[0], err
    # --out is a folder for efficiency and step_modes: the line claims no JSON default
    assert err[0].endswith("(by default its figures would replace the report's)"), err


@pytest.mark.parametrize(
    ("module", "argv", "flags"),
    [
        ("loader", ["--tokens", "20000", "--json"], "--tokens measures"),
        ("loader", ["--tokens", "20000", "--measure-tokens", "5000"], "--tokens, --measure-tokens"),
        ("plans", ["--experiments", "mnli", "--steps", "1", "--paper-steps", "0", "--json"],
         "--steps, --experiments, --paper-steps measure"),
        ("step_modes", ["--models", "smoke", "--modes", "eager", "--repeats", "1"],
         "--models, --modes, --repeats"),
        ("efficiency", ["--batches", "1"], "--batches measures"),
        ("core", ["--repeats", "1", "--processes", "1"], "--repeats, --processes measure"),
        ("mnli_step", ["--repeats", "2"], "--repeats measures"),
        ("codebert_step", ["--steps", "2"], "--steps measures"),
        ("tensorize", ["--steps", "1"], "--steps measures"),
    ],
)  # fmt: skip
def test_a_smaller_or_partial_run_must_name_its_output(
    module: str,
    argv: list[str],
    flags: str,
    monkeypatch,
    capsys,  # noqa: ANN001
) -> None:
    """A run at other sizes or of a subset (the loader at 20,000 tokens, the plans of one
    experiment) replaced the committed report's figures, the README's included: it must
    name where it writes, as --tiny must; nothing is measured before the refusal."""
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")
    for name in ("run", "sweep", "run_point", "_run_processes"):  # measuring would fail it
        if hasattr(bench, name):
            monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("measured"))
    with pytest.raises(SystemExit) as stop:  # a parser error or a returned status
        raise SystemExit(bench.main(argv))
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(err) == 1 and flags in err[0], err
    assert "other than the report's settings: give --" in err[0], err


def test_a_run_of_the_default_points_in_another_spelling_is_no_reduced_run(
    tmp_path: Path, monkeypatch
) -> None:
    """Settings compare as the benchmark reads them: --modes without eager (always added
    first) and --experiments in another order measure the report's points."""
    from benchmarks import plans

    def point(model, mode, *args):  # noqa: ANN001, ANN202
        return {"model": model, "mode": mode, "batch": 8, "seq": 16, "first_step_s": 1.0,
                "step_s": 0.5, "peak_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(step_modes, "run_point", point)
    monkeypatch.setattr(step_modes, "REPORTS", tmp_path)  # where the report would go
    assert step_modes.main(["--modes", "sync_free,compile"]) == 0
    assert (tmp_path / "step_modes.md").is_file()
    assert step_modes.main(["--modes", "sync_free"]) == 2  # one mode fewer: refused
    assert step_modes.main(["--device", "bogus", "--repeats", "2"]) == 2  # not a traceback
    runs: list[tuple] = []
    monkeypatch.setattr(plans, "run", lambda **k: runs.append(k["experiments"]) or 0)
    assert plans.main(["--experiments", "dlrm,mnli,codebert"]) == 0
    assert runs == [("dlrm", "mnli", "codebert")]


def test_mnli_step_refuses_zero_threads(capsys) -> None:
    assert mnli_step.main(["--threads", "0"]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--threads", "0"], "--threads must be >= 1"),  # each worker's traceback
        (["--models", ","], "--models needs at least one of"),  # an empty table over the report
        (["--point-timeout", "-5"], "--point-timeout must be > 0"),  # every point failed
    ],
)
def test_step_modes_refuses_what_would_fail_or_write_nothing(tmp_path, capsys, argv, text) -> None:
    assert step_modes.main([*argv, "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("module", "argv", "text"),
    [
        ("core", ["--threads", "0"], "--threads and --repeats must be >= 1"),
        ("loader", ["--tokens", "0"], "--tokens must be >= 2"),
        ("efficiency", ["--repeats", "0"], "--repeats and --threads must be >= 1"),
    ],
)
def test_counts_below_one_are_one_line(module: str, argv: list[str], text: str, capsys) -> None:  # noqa: ANN001
    import importlib

    bench = importlib.import_module(f"benchmarks.{module}")
    with pytest.raises(SystemExit) as stop:  # argparse's own error: one line and exit 2
        code = bench.main(argv)
        raise SystemExit(code)
    assert stop.value.code == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "error" in line]
    assert len(err) == 1 and text in err[0], err


RENDERERS = ["tensorize", "core", "loader", "step_modes", "efficiency", "mnli_step",
             "codebert_step", "dlrm_step"]  # fmt: skip


@pytest.mark.parametrize("module", RENDERERS)
@pytest.mark.parametrize("saved", ["plans.json", "{}"])
def test_render_of_another_benchmarks_result_is_one_line(
    module: str,
    saved: str,
    tmp_path: Path,
    capsys,  # noqa: ANN001
) -> None:
    """Another benchmark's JSON (or an empty object): one line and exit 2, never a
    traceback, an empty table, or a report written from it."""
    import importlib

    path = Path(__file__).resolve().parents[2] / "reports" / saved
    if saved == "{}":
        path = tmp_path / "empty.json"
        path.write_text("{}")
    bench = importlib.import_module(f"benchmarks.{module}")
    out = ["--out", str(tmp_path)]
    extra = {"core": ["--no-report"], "loader": ["--no-report"], "step_modes": out,
             "efficiency": out}  # fmt: skip
    assert bench.main(["--render", str(path), *extra.get(module, [])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{path.name} is not a result of" in err[0], err
    assert not list(tmp_path.glob("*.md"))


class _Measured(Exception):
    """Raised by a stubbed measuring function: the command got past every refusal."""


def _measure(*args: object, **kwargs: object) -> None:
    raise _Measured


@pytest.mark.parametrize(
    ("module", "result", "flag"),
    [
        ("step_modes", {"tiny": True, "runs": [{"model": "smoke", "mode": "eager"}],
                        "threads": 1}, "--out"),
        ("mnli_step", {"device": "cpu", "repeats": 2, "threads": 1}, "--out"),
        ("efficiency", {"tiny": True, "batches": [1], "repeats": 1, "threads": 1}, "--out"),
        ("loader", {"requested_tokens": 20000}, "--report"),
        ("core", {"threads": 1, "repeats": 1, "processes": 1}, "--report"),
    ],
)  # fmt: skip
def test_a_reduced_run_s_header_names_its_output_and_runs_as_written(
    module: str, result: dict, flag: str, tmp_path: Path, monkeypatch
) -> None:
    """A reduced or toy run is refused without an output path, so its report's header
    names the one it was given: the command, run as written, reaches the measuring."""
    import importlib
    import shlex

    bench = importlib.import_module(f"benchmarks.{module}")
    out = tmp_path / ("a report.md" if flag == "--report" else "a folder")
    command = bench.command({**result, "out": str(out)})
    words = shlex.split(command)
    assert words[:3] == ["python", "-m", f"benchmarks.{module}"] and words[-2:] == [flag, str(out)]
    assert flag not in bench.command(result)  # none given, none named
    for name in ("run", "sweep", "run_point", "_run_processes"):
        if hasattr(bench, name):
            monkeypatch.setattr(bench, name, _measure)
    if module == "efficiency":  # the comparison's third side, when it is not installed
        monkeypatch.setattr(bench, "galore_available", lambda: True)
    with pytest.raises(_Measured):
        bench.main(words[3:])
