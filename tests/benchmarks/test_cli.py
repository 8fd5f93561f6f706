"""The benchmarks' command-line rules: bad input is one line on stderr, ``PROG: error:
...`` naming the flag to change, exit status 2, no traceback, refused before anything is
measured, and nothing under reports/ is touched."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
BENCHMARKS = ["core", "loader", "tensorize", "mnli_step", "codebert_step", "dlrm_step",
              "dlrm_prep", "plans", "efficiency", "step_modes"]  # fmt: skip


def _refused(module: str, argv: list[str], capsys) -> str:  # noqa: ANN001
    """Run ``benchmarks.<module>``'s main on ``argv``: exit status 2 and one stderr line,
    which is returned."""
    bench = importlib.import_module(f"benchmarks.{module}")
    assert bench.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m benchmarks.{module}: error: "), err
    return err[0]


@pytest.mark.parametrize("module", BENCHMARKS)
@pytest.mark.parametrize(
    ("argv", "text"),
    [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
     (["--render"], "argument --render: expected one argument")],
)  # fmt: skip
def test_a_bad_flag_is_one_line_not_a_usage_block(module, argv, text, capsys) -> None:  # noqa: ANN001
    assert text in _refused(module, argv, capsys)


def test_the_old_loader_command_s_error_is_one_line() -> None:
    """``python -m loaders.bench`` forwards to ``benchmarks.loader``: its moved note comes
    after a run, never beside an error line (which names the new command already)."""
    proc = subprocess.run(
        [sys.executable, "-m", "loaders.bench", "--tokens", "x"],
        capture_output=True, text=True, check=False, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "python -m benchmarks.loader: error: argument --tokens: invalid int value: 'x'"
    ]


def _no_measuring(monkeypatch, module: str) -> None:  # noqa: ANN001
    """Make whatever ``benchmarks.<module>`` measures with fail the test: a refusal must
    come before it."""

    def measured(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        pytest.fail(f"benchmarks.{module} measured before refusing")

    bench = importlib.import_module(f"benchmarks.{module}")
    for name in ("run_json_worker", "run_worker", "run_point", "smoke_rounds", "_run_processes"):
        if hasattr(bench, name):
            monkeypatch.setattr(bench, name, measured)
    if module in ("core", "loader"):  # measured in this process
        monkeypatch.setattr(bench, "run", measured)


# {dir}: an existing folder; {file}: an existing file
OUTPUTS = [
    ("tensorize", ["--tiny", "--out", "{dir}"], "{dir}: {dir} is a folder"),
    ("tensorize", ["--tiny", "--out", "{file}/t.json"], "{file} is a file, so nothing"),
    ("tensorize", ["--tiny", "--out", "{tmp}/t.md"], "give a path ending in .json"),
    ("plans", ["--out", "{dir}"], "{dir}: {dir} is a folder"),
    ("plans", ["--out", "{tmp}/p.md"], "give a path ending in .json"),
    ("core", ["--quick", "--report", "{dir}"], "{dir}: {dir} is a folder"),
    ("core", ["--quick", "--report", "{tmp}/c.json"], "give a path ending in .md"),
    ("core", ["--render", "{reports}/bench_core.json", "--report", "{dir}"], "is a folder"),
    ("loader", ["--tokens", "3", "--measure-tokens", "1", "--report", "{tmp}/l.json"],
     "give a path ending in .md"),
    ("loader", ["--render", "{reports}/bench_loader.json", "--report", "{dir}"], "is a folder"),
    ("mnli_step", ["--tiny", "--out", "{dir}"], "{dir}: {dir} is a folder"),
    ("codebert_step", ["--tiny", "--out", "{dir}"], "{dir}: {dir} is a folder"),
    ("efficiency", ["--tiny", "--out", "{file}"], "--out {file} is a file; give a folder"),
    ("efficiency", ["--render", "{reports}/efficiency.json", "--out", "{file}"],
     "--out {file} is a file; give a folder"),
    ("step_modes", ["--tiny", "--out", "{file}"], "--out {file} is a file; give a folder"),
    # a folder named eff.md was made, the report written into it
    ("efficiency", ["--render", "{reports}/efficiency.json", "--out", "{tmp}/eff.md"],
     "--out {tmp}/eff.md: give the folder the report goes in, not a file name"),
    ("step_modes", ["--render", "{reports}/step_modes.json", "--out", "{file}"],
     "--out {file} is a file; give a folder"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "argv", "text"), OUTPUTS)
def test_an_output_path_that_cannot_be_written_is_refused_before_measuring(
    module: str,
    argv: list[str],
    text: str,
    tmp_path: Path,
    monkeypatch,
    capsys,  # noqa: ANN001
) -> None:
    """A folder given for a file (or a file for a folder, or a path under a file) ended in a
    traceback after all the measuring, leaving a stray ``.tmp``; a path ending in the
    suffix of the file written beside it had its JSON replaced by the markdown."""
    names = {"dir": tmp_path / "adir", "file": tmp_path / "afile", "tmp": tmp_path,
             "reports": REPORTS}  # fmt: skip
    names["dir"].mkdir()
    names["file"].write_text("kept\n")
    _no_measuring(monkeypatch, module)
    err = _refused(module, [a.format(**names) for a in argv], capsys)
    assert text.format(**names) in err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["adir", "afile"]
    assert names["file"].read_text() == "kept\n"


def test_plans_run_refuses_a_markdown_out_before_measuring(tmp_path: Path, monkeypatch) -> None:
    """``plans.run(out=x.md)`` wrote the JSON there, then the report over it."""
    from benchmarks import plans
    from experiments.cli import CLIError

    _no_measuring(monkeypatch, "plans")
    with pytest.raises(CLIError, match=r"--out .*p\.md: give a path ending in \.json"):
        plans.run(out=tmp_path / "p.md", paper_steps_timed=0)
    assert not list(tmp_path.iterdir())


def test_core_renders_a_quick_result_only_where_told(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """``--render`` of a ``--quick`` result replaced reports/bench_core.md with toy
    figures, which measuring with ``--quick`` never does; with ``--report`` it renders."""
    import json

    from benchmarks import core

    monkeypatch.setattr(core, "REPORT", tmp_path / "reports" / "bench_core.md")
    result = json.loads((REPORTS / "bench_core.json").read_text())
    result["config"]["quick"] = True
    saved = tmp_path / "q.json"
    saved.write_text(json.dumps(result))
    err = _refused("core", ["--render", str(saved)], capsys)
    assert "a --quick result's figures (tiny shapes); give --report PATH" in err
    assert not (tmp_path / "reports").exists()
    assert core.main(["--render", str(saved), "--no-report"]) == 0  # printed, not written
    assert core.main(["--render", str(saved), "--report", str(tmp_path / "q.md")]) == 0
    assert (tmp_path / "q.md").read_text() == core.render(result)


@pytest.mark.parametrize(
    ("module", "other"),
    [(m, o) for m in ("mnli_step", "codebert_step")
     for o in ("mnli_bench.json", "codebert_bench.json", "dlrm_bench.json", "tensorize.json",
               "gpu/mnli_bench_cuda.json")
     if m.split("_")[0] not in o],
)  # fmt: skip
def test_a_step_bench_renders_no_other_benchmark_s_result(module, other, capsys) -> None:  # noqa: ANN001
    """Every step benchmark's result has ``step_time_ratio_vs_dense``: MNLI's and
    CodeBERT's ``--render`` printed DLRM's result under their own title, exit 0."""
    err = _refused(module, ["--render", str(REPORTS / other)], capsys)
    assert f"{Path(other).name} is not a result of python -m benchmarks.{module}" in err


PARTIAL_RUNS = {
    "step_modes": [{"model": "smoke", "mode": "eager", "batch": 128, "seq": 16,
                    "first_step_s": 1.0, "step_s": 0.5, "peak_mb": 10.0},
                   {"model": "smoke", "mode": "compile", "error": "cut short"}],
    "efficiency": [{"variant": "comera", "batch": 1, "step_s": 1.0, "peak_mb": 1.0},
                   {"variant": "dense", "batch": 1, "error": "MemoryError"}],
    "mnli_step": [{"variant": "comera", "batch": 32, "error": "cut short"}],
}  # fmt: skip


@pytest.mark.parametrize("module", sorted(PARTIAL_RUNS))
def test_a_partial_result_is_kept_for_inspection_not_rendered(
    module: str,
    tmp_path: Path,
    capsys,  # noqa: ANN001
) -> None:
    """The refusal promised that ``--render PARTIAL --out DIR`` would render a partial
    file, which then failed on a key a failed point lacks ('step_s', or efficiency's
    'threads'); it now says plainly that partial files cannot be rendered."""
    import json

    saved = tmp_path / f"{module}.partial.json"
    head = {"device": "cpu", "torch": "2", "date": "d"} if module != "efficiency" else {}
    saved.write_text(json.dumps({"partial": True, **head, "runs": PARTIAL_RUNS[module]}))
    out = tmp_path / "out"
    argv = ["--render", str(saved), *(["--out", str(out)] if module != "mnli_step" else [])]
    err = _refused(module, argv, capsys)
    assert f"{saved} is a partial result" in err and "cannot be rendered" in err
    assert not out.exists()


@pytest.mark.parametrize(
    "argv",
    [["--tokens", "1"], ["--tokens", "0"], ["--tokens", "2", "--measure-tokens", "0"]],
)
def test_loader_refuses_a_corpus_too_small_to_write(argv: list[str], monkeypatch, capsys) -> None:  # noqa: ANN001
    """``--tokens 1`` passed the >= 1 check, then each sub-dataset's budget (``1 // 2``)
    wrote no file and the loader failed with a traceback; 2 is the smallest corpus."""
    _no_measuring(monkeypatch, "loader")
    err = _refused("loader", [*argv, "--no-report"], capsys)
    assert "--tokens must be >= 2 (a token for each of the corpus's 2 sub-datasets) and " in err


@pytest.mark.parametrize(
    ("module", "argv"),
    [("core", ["--quick"]), ("mnli_step", ["--tiny", "--out", "{tmp}/m.json"]),
     ("step_modes", ["--tiny", "--out", "{tmp}"]), ("dlrm_step", ["--embedding"]),
     ("dlrm_step", []), ("codebert_step", ["--tiny", "--out", "{tmp}/c.json"])],
)  # fmt: skip
def test_a_device_type_no_benchmark_runs_on_is_refused(
    module: str,
    argv: list[str],
    tmp_path: Path,
    monkeypatch,
    capsys,  # noqa: ANN001
) -> None:
    """``--device xla`` (torch takes the string) failed at every point, or with a
    traceback, where core refused it: one shared check now refuses it everywhere."""
    _no_measuring(monkeypatch, module)
    if module == "dlrm_step":
        from benchmarks import dlrm_step

        monkeypatch.setattr(dlrm_step, "embedding_times", lambda **k: pytest.fail("measured"))
        monkeypatch.setattr(dlrm_step, "run", lambda **k: pytest.fail("measured"))
    argv = [a.format(tmp=tmp_path) for a in argv]
    err = _refused(module, [*argv, "--device", "xla"], capsys)
    assert err.endswith("error: --device xla: choose cpu or cuda")


def _header_command(text: str) -> str:
    """The command a rendered report's header names."""
    line = next(x for x in text.splitlines() if x.startswith("Command: `"))
    return line.removeprefix("Command: `").removesuffix("`")


def test_dlrm_prep_render_names_the_command_that_measured(monkeypatch, capsys) -> None:  # noqa: ANN001
    """``--render`` of a saved ``--rows 200 --json`` result named ``--json`` alone, where
    the measuring run's own table named ``--rows 200``: the result records its command."""
    import json

    from benchmarks import dlrm_prep

    fake = {"rows": 200, "file_mb": 0.1, "seconds": 0.5, "rows_per_s": 400.0,
            "peak_anon_mb": 20, "peak_anon_above_baseline_mb": 4, "peak_file_mb": 1,
            "kaggle_minutes_at_this_rate": 9.0, "cpu": "c", "torch": "t", "date": "d"}  # fmt: skip
    monkeypatch.setattr(dlrm_prep, "write_kaggle_like", lambda path, rows: None)
    monkeypatch.setattr(dlrm_prep, "measure", lambda path: dict(fake))
    assert dlrm_prep.main(["--rows", "200"]) == 0
    shown = _header_command(capsys.readouterr().out)
    assert shown == "python -m benchmarks.dlrm_prep --rows 200"
    assert dlrm_prep.main(["--rows", "200", "--json"]) == 0
    saved = json.loads(capsys.readouterr().out)
    assert _header_command(dlrm_prep.render(saved)) == f"{shown} --json"
    # 200 rows time start-up: their Kaggle estimate (718 min where 4M rows say ~10) is not shown
    assert "| n/a: under 100,000 rows, start-up dominates the rate |" in dlrm_prep.render(saved)
    assert "| 9.0 |" in dlrm_prep.render({**saved, "rows": 4_000_000})


def test_dlrm_step_render_names_the_command_that_measured(monkeypatch, capsys) -> None:  # noqa: ANN001
    """The DLRM step report always named ``--json``, even for the run that printed it."""
    import json

    from benchmarks import dlrm_step

    def child(args: list[str], what: str) -> dict:
        if "--embedding" in args:
            return {"embedding_batched_s": 0.5, "embedding_separate_s": 1.0,
                    "embedding_time_ratio_batched_vs_separate": 0.5, "device": "cpu"}  # fmt: skip
        return {"variant": args[1], "params": 10, "compression": 1.0, "step_time_s": 1.0,
                "peak_rss_mb": 100.0}  # fmt: skip

    monkeypatch.setattr(dlrm_step, "_in_child", child)
    assert dlrm_step.run(json_out=False) == 0
    assert _header_command(capsys.readouterr().out) == "python -m benchmarks.dlrm_step"
    assert dlrm_step.run(json_out=True) == 0
    saved = json.loads(capsys.readouterr().out)
    assert _header_command(dlrm_step.render(saved)) == "python -m benchmarks.dlrm_step --json"
    # the committed figures name the command reports/README.md gives for them (figures
    # that record none came from --json)
    committed = json.loads((REPORTS / "dlrm_bench.json").read_text())
    given = "python -m benchmarks.dlrm_step --out reports/dlrm_bench.json"
    assert given in (REPORTS / "README.md").read_text()
    assert _header_command(dlrm_step.render(committed)) == given
    older = {k: v for k, v in committed.items() if k != "command"}
    assert _header_command(dlrm_step.render(older)) == "python -m benchmarks.dlrm_step --json"


def test_plans_paper_steps_reach_dlrm_s_step(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """``plans --paper-steps N`` never reached DLRM's paper step, which timed its own 10;
    now N is passed to ``dlrm_step --variant V --steps N``, and without it each experiment
    keeps its own count (3; DLRM 10), so a default run measures what it did."""
    import experiments.workers
    from benchmarks import dlrm_step, plans

    cmds: list[list[str]] = []

    def worker(cmd, what, *, env=None, timeout=None):  # noqa: ANN001, ANN202
        cmds.append(cmd)
        return {"step_time_s": 1.0, "peak_rss_mb": 1.0}

    monkeypatch.setattr(experiments.workers, "run_json_worker", worker)
    plans._paper_step("dlrm", "auto", 4)
    assert cmds[0][cmds[0].index("--steps") + 1] == "4"
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(plans, "smoke_rounds", lambda name, steps: {})
    monkeypatch.setattr(plans, "paper_steps", lambda name, steps: seen.append((name, steps)) or {})
    monkeypatch.setattr(plans, "render", lambda result: "")
    plans.run(experiments=("mnli", "dlrm"), out=tmp_path / "p.json")
    plans.run(experiments=("mnli", "dlrm"), out=tmp_path / "p.json", paper_steps_timed=5)
    assert seen == [("mnli", 3), ("dlrm", 10), ("mnli", 5), ("dlrm", 5)]
    # the step benchmark's one variant takes the count
    monkeypatch.setattr(dlrm_step, "run_variant", lambda v, steps, malloc: {"steps": steps})
    monkeypatch.setattr(dlrm_step, "restart_for", lambda policy: None)
    assert dlrm_step.main(["--variant", "comera", "--steps", "4"]) == 0


CONFLICTS = [
    *[(m, ["--render", "{tmp}/missing.json", "--json"],
       "argument --json: not allowed with argument --render")
      for m in ("core", "loader", "mnli_step", "codebert_step", "dlrm_step", "plans",
                "tensorize", "dlrm_prep")],
    ("core", ["--no-report", "--report", "{tmp}/c.md"],
     "argument --report: not allowed with argument --no-report"),
    ("loader", ["--report", "{tmp}/l.md", "--no-report"],
     "argument --no-report: not allowed with argument --report"),
    ("dlrm_prep", ["--rows", "200", "--file", "{tmp}/f.txt"],
     "argument --file: not allowed with argument --rows"),
    ("dlrm_step", ["--variant", "comera", "--embedding"],
     "argument --embedding: not allowed with argument --variant"),
    ("dlrm_step", ["--malloc", "lean"], "--malloc applies to one process (--variant V or "),
    ("dlrm_step", ["--steps", "3"], "--steps applies to one variant (--variant V)"),
    ("tensorize", ["--batch", "2", "--tiny", "--out", "{tmp}/t.json"],
     "--batch applies to one variant (--variant V)"),
    ("codebert_step", ["--batch", "2", "--tiny", "--out", "{tmp}/c.json"],
     "--batch applies to one variant (--variant V)"),
    ("mnli_step", ["--batch", "2", "--tiny", "--out", "{tmp}/m.json"],
     "--batch applies to one worker"),
]  # fmt: skip


@pytest.mark.parametrize(("module", "argv", "text"), CONFLICTS)
def test_a_flag_another_makes_meaningless_is_refused_naming_both(
    module: str,
    argv: list[str],
    text: str,
    tmp_path: Path,
    monkeypatch,
    capsys,  # noqa: ANN001
) -> None:
    """These were accepted and silently ignored: ``--json`` beside ``--render`` (markdown
    printed), ``--report`` beside ``--no-report``, ``--rows`` beside ``--file``,
    ``--embedding`` beside ``--variant``, a one-process flag (``--malloc``, ``--steps``,
    ``--batch``) on the whole bench."""
    _no_measuring(monkeypatch, module)
    if module == "dlrm_step":
        from benchmarks import dlrm_step

        for name in ("run", "run_variant", "embedding_times"):
            monkeypatch.setattr(dlrm_step, name, lambda *a, **k: pytest.fail("measured"))
    if module == "dlrm_prep":
        from benchmarks import dlrm_prep

        monkeypatch.setattr(dlrm_prep, "measure", lambda path: pytest.fail("measured"))
        (tmp_path / "f.txt").write_text("")
    err = _refused(module, [a.format(tmp=tmp_path) for a in argv], capsys)
    assert text in err


@pytest.mark.parametrize(
    ("module", "argv"),
    [("codebert_step", ["--variant", "comera", "--tiny", "--steps", "1", "--batch", "0"]),
     ("codebert_step", ["--variant", "comera", "--tiny", "--batch", "-2"]),
     ("tensorize", ["--variant", "comera", "--tiny", "--batch", "0"]),
     ("mnli_step", ["--worker", "comera", "--tiny", "--batch", "0"])],
)  # fmt: skip
def test_a_batch_below_one_is_one_line(module: str, argv: list[str], monkeypatch, capsys) -> None:  # noqa: ANN001
    """``--batch 0`` (or negative) ran the variant and ended in a ValueError traceback."""
    bench = importlib.import_module(f"benchmarks.{module}")
    name = "worker" if module == "mnli_step" else "run_variant"
    monkeypatch.setattr(bench, name, lambda *a, **k: pytest.fail("measured"))
    err = _refused(module, argv, capsys)
    assert err.endswith(f"error: --batch must be >= 1, got {argv[-1]}")


@pytest.mark.parametrize(
    ("argv", "text"),
    [(["--repeats", "0"], "--repeats must be >= 1, got 0"),
     (["--modes", "eager,turbo"], "--modes eager,turbo: unknown turbo; choose from eager,"),
     (["--models", "nope"], "--models nope: unknown nope; choose from smoke,paper,")],
)  # fmt: skip
def test_step_modes_says_which_flag_is_wrong(argv: list[str], text: str, tmp_path, capsys) -> None:  # noqa: ANN001
    """``--repeats 0`` said "unknown model or mode [] (...), or --repeats < 1", and every
    refusal began ``step_modes:`` rather than the command's own ``PROG: error:``."""
    err = _refused("step_modes", [*argv, "--out", str(tmp_path)], capsys)
    assert text in err and ("unknown" in err) != ("--repeats" in err)


def test_codebert_step_writes_its_json_whole(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """codebert_step wrote its JSON with a plain ``write_text``: a run stopped mid-write left
    half a file where the last figures were. It now writes through a temporary file and a
    rename, as the other benchmarks do: a write that fails leaves the last figures whole."""
    import os

    from benchmarks import codebert_step

    def worker(cmd, what, env=None):  # noqa: ANN001, ANN202
        batch = int(cmd[cmd.index("--batch") + 1])
        return {"variant": cmd[cmd.index("--variant") + 1], "batch": batch, "params": 10,
                "step_s": 1.0, "peak_mb": 5.0, "tokens_per_s": 64.0}  # fmt: skip

    monkeypatch.setattr(codebert_step, "run_json_worker", worker)
    out = tmp_path / "codebert_bench.json"
    out.write_text('{"last": "figures"}\n')

    def interrupted(src, dst):  # noqa: ANN001, ANN202
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        codebert_step.run(tiny=True, steps=1, out=out)
    assert out.read_text() == '{"last": "figures"}\n'


def test_a_value_given_twice_is_measured_once(tmp_path: Path, monkeypatch, capsys) -> None:  # noqa: ANN001
    """``efficiency --batches 1,1``, ``step_modes --models smoke,smoke`` and ``plans
    --experiments mnli,mnli`` measured each point twice; the values are now taken once, in
    the order given."""
    from benchmarks import efficiency, plans, step_modes

    points: list[tuple] = []

    def worker(variant, batch, *args):  # noqa: ANN001, ANN202
        points.append((variant, batch))
        return {"variant": variant, "batch": batch, "step_s": 1.0, "peak_mb": 1.0}

    monkeypatch.setattr(efficiency, "run_worker", worker)
    monkeypatch.setattr(efficiency, "galore_available", lambda: True)
    monkeypatch.setattr(efficiency, "_plot", lambda result, out: None)
    argv = ["--batches", "8,1,8", "--repeats", "1", "--tiny", "--out", str(tmp_path / "e")]
    assert efficiency.main(argv) == 0
    assert [b for _, b in points] == [8] * 3 + [1] * 3
    points.clear()

    def point(model, mode, *args):  # noqa: ANN001, ANN202
        points.append((model, mode))
        return {"model": model, "mode": mode, "batch": 8, "seq": 16, "first_step_s": 1.0,
                "step_s": 0.5, "peak_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(step_modes, "run_point", point)
    argv = ["--models", "smoke,smoke", "--modes", "eager,sync_free,eager,sync_free", "--out",
            str(tmp_path / "s")]  # fmt: skip
    assert step_modes.main(argv) == 0
    assert points == [("smoke", "eager"), ("smoke", "sync_free")]
    runs: list[tuple] = []
    monkeypatch.setattr(plans, "run", lambda **k: runs.append(k["experiments"]) or 0)
    assert plans.main(["--experiments", "dlrm,mnli,dlrm", "--out", str(tmp_path / "p.json")]) == 0
    assert runs == [("dlrm", "mnli")]
    # one line named both flags with "got 0, None"
    assert plans.main(["--steps", "0", "--out", str(tmp_path / "p.json")]) == 2
    assert "--steps 0: give at least 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("module", "extra", "flag"),
    [("dlrm_step", ["--steps", "3"], "--steps"),
     ("dlrm_step", ["--variant", "comera"], "--variant"),
     ("codebert_step", ["--variant", "comera", "--batch", "2"], "--variant"),
     ("tensorize", ["--tiny"], "--tiny"),
     ("mnli_step", ["--repeats", "3"], "--repeats"),
     ("core", ["--quick"], "--quick"),
     ("plans", ["--experiments", "mnli"], "--experiments"),
     ("dlrm_step", ["--device", "cpu"], "--device"),  # given, though at its default value
     ("core", ["--threads", "2", "--no-report"], "--threads")],  # (a default per machine)
)  # fmt: skip
def test_a_measuring_flag_beside_render_is_refused(module, extra, flag, capsys) -> None:  # noqa: ANN001
    """``--render`` measures nothing: a measuring flag beside it was dropped without a word
    (exit 0); where the rendered report goes still applies."""
    saved = REPORTS / "plans.json"  # refused before it is read: any file will do
    line = _refused(module, ["--render", str(saved), *extra], capsys)
    assert f"{flag} with --render: --render measures nothing" in line


def test_core_render_writes_no_markdown_over_a_json(tmp_path, capsys) -> None:  # noqa: ANN001
    """Rendering writes the markdown alone: a --report ending in .json (the very file being
    rendered, say) would have been replaced by markdown."""
    saved = tmp_path / "core.json"
    saved.write_bytes((REPORTS / "bench_core.json").read_bytes())
    line = _refused("core", ["--render", str(saved), "--report", str(saved)], capsys)
    assert "give a path ending in .md; the report is markdown" in line
    assert saved.read_bytes() == (REPORTS / "bench_core.json").read_bytes()


def test_dlrm_prep_s_file_errors_name_its_own_flag(tmp_path: Path, capsys) -> None:  # noqa: ANN001
    """The data module's advice named training's --data; the benchmark's flag is --file."""
    import gzip

    from benchmarks import dlrm_prep

    packed = tmp_path / "day.txt"
    packed.write_bytes(gzip.compress(b"0\t1\n"))
    assert dlrm_prep.main(["--child", str(packed), str(tmp_path / "cache")]) == 2
    err = capsys.readouterr().err.strip()
    assert "gzip" in err and "--file " in err and "day-plain.txt" in err, err
    assert "--data" not in err, err
    (tmp_path / "afile").write_text("")  # a cache that cannot be made: no --cache-dir here
    plain = tmp_path / "day2.txt"
    plain.write_text("0\t1" + "\t" * 38 + "\n")
    assert dlrm_prep.main(["--child", str(plain), str(tmp_path / "afile" / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert "$TMPDIR" in err and "--cache-dir" not in err, err


def test_a_stopped_benchmark_says_so_in_one_line(capsys) -> None:
    """Ctrl-C ended every benchmark in a traceback (one per process); SIGTERM killed it
    without a word. Each is one line now, with the status the signal gives."""
    import os
    import signal
    import time

    from benchmarks.reporting import one_line_errors

    @one_line_errors("python -m benchmarks.x")
    def ctrl_c(argv):
        raise KeyboardInterrupt

    @one_line_errors("python -m benchmarks.x")
    def terminated(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    before = signal.getsignal(signal.SIGTERM)
    assert ctrl_c([]) == 130
    assert capsys.readouterr().err.strip().splitlines() == [
        "python -m benchmarks.x: stopped by SIGINT before all its results were written (each "
        "file is written whole: a report not yet rewritten keeps its last figures)"
    ]
    assert terminated([]) == 143
    assert "stopped by SIGTERM" in capsys.readouterr().err
    assert signal.getsignal(signal.SIGTERM) == before  # the handler is put back
