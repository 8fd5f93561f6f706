"""``experiments.report``: what the experiments' reports share (run dirs, the report's
JSON, the host a report names, the smoke-report command)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

from comera.errors import DataError
from experiments import report
from experiments.host import host_meta


def test_report_json_keeps_curves_on_one_line_and_reads_back(tmp_path: Path) -> None:
    data = {"meta": {"cpu": "x"}, "curve": [[1, 0.5], [2, math.nan]], "rows": [{"a": [1, 2]}]}
    back = report.write_report_json(tmp_path / "r.json", data)
    text = (tmp_path / "r.json").read_text()
    assert '"curve": [[1, 0.5], [2, null]]' in text  # a non-finite number is null
    assert back == json.loads(text) == {**data, "curve": [[1, 0.5], [2, None]]}
    assert report.read_report_json(tmp_path / "r.json", "--from-json") == back
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="--from-json .*bad.json: not a report's JSON"):
        report.read_report_json(tmp_path / "bad.json", "--from-json")
    (tmp_path / "cut.json").write_text('{"meta": ')
    with pytest.raises(DataError, match="not JSON"):
        report.read_report_json(tmp_path / "cut.json", "--from-json")
    with pytest.raises(FileNotFoundError, match="--from-json .*none.json: no such file"):
        report.read_report_json(tmp_path / "none.json", "--from-json")


def test_smoke_runs_record_the_host_that_trained_them(tmp_path: Path) -> None:
    """``ensure_smoke_run`` writes ``host.json`` when it trains; a finished run it leaves
    alone keeps the host it recorded; ``runs_host`` reads it back, else names this host."""
    calls: list[list[str]] = []

    steps = [1]  # the run's last step: a resume trains to it
    saved: list[int] = []  # the checkpoints the next call writes

    def exp_main(argv: list[str]) -> int:  # stands in for an experiment's main
        calls.append(argv)
        run = Path(argv[argv.index("--run-dir" if "--run-dir" in argv else "--resume") + 1])
        run.mkdir(parents=True, exist_ok=True)
        (run / "config.json").write_text("{}")
        # a resume rewrites the file even when it trains nothing (its rows to the checkpoint)
        rows = [{"step": s, "loss": 1.0} for s in range(1, steps[0] + 1)]
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        for s in saved:
            (run / "checkpoints" / f"step_{s:08d}").mkdir(parents=True, exist_ok=True)
            (run / "checkpoints" / f"step_{s:08d}" / "model.pt").write_bytes(b"")
        return 0

    run = tmp_path / "x-smoke"
    report.ensure_smoke_run(exp_main, run, dense=False, label="x")
    host = json.loads((run / report.HOST_FILE).read_text())
    assert host["torch"] == torch.__version__ and set(host) == {"cpu", "torch", "date"}
    assert report.runs_host([tmp_path / "nothing", run]) == host
    (run / report.HOST_FILE).write_text(json.dumps({**host, "cpu": "the training machine"}))
    report.ensure_smoke_run(exp_main, run, dense=False, label="x")  # finished: no-op
    assert calls[-1][:2] == ["--resume", str(run)]
    assert report.runs_host([run])["cpu"] == "the training machine"
    steps[0] = 3  # a resume that trains records this host
    report.ensure_smoke_run(exp_main, run, dense=False, label="x")
    assert report.runs_host([run]) == host_meta()
    # killed after its last row, before its last checkpoint: the resume retrains to the
    # same last step and saves it, which is training here too
    (run / report.HOST_FILE).write_text(json.dumps({**host, "cpu": "the training machine"}))
    saved.append(3)
    report.ensure_smoke_run(exp_main, run, dense=False, label="x")
    assert report.runs_host([run]) == host_meta()
    assert report.runs_host([tmp_path / "nothing"]) == host_meta()
    with pytest.raises(SystemExit) as stop:  # its status; the line: see below
        report.ensure_smoke_run(lambda argv: 1, tmp_path / "y", dense=True, label="x")
    assert stop.value.code == 1


def test_from_json_renders_without_training(tmp_path: Path, capsys) -> None:
    """``--from-json FILE`` renders the report from its JSON and trains nothing; a file
    that is not a report's JSON is one error line and exit 2."""

    def no_training(argv: list[str]) -> int:
        raise AssertionError("--from-json must not train")

    def render(data: dict, out: Path) -> str:
        (out / "x.md").write_text(data["meta"]["command"])
        return "rendered"

    report.write_report_json(tmp_path / "x.json", {"meta": {"command": "cmd"}})
    argv = ["--from-json", str(tmp_path / "x.json"), "--out", str(tmp_path / "out")]
    assert report.smoke_report_main("x", no_training, None, argv, "x", render=render) == 0
    assert (tmp_path / "out" / "x.md").read_text() == "cmd"
    assert capsys.readouterr().out.strip() == "rendered"
    argv[1] = str(tmp_path / "out" / "x.md")
    assert report.smoke_report_main("x", no_training, None, argv, "x", render=render) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("python -m experiments.x.report: error: ")
    # --out names a folder here (MNLI's report takes a file): a folder x.md was made
    argv = ["--from-json", str(tmp_path / "x.json"), "--out", str(tmp_path / "new.md")]
    assert report.smoke_report_main("x", no_training, None, argv, "x", render=render) == 2
    assert "give the folder the report goes in, not a file name" in capsys.readouterr().err
    assert not (tmp_path / "new.md").exists()
    # --runs beside it was ignored without a word (--bench-json was refused)
    argv = ["--from-json", str(tmp_path / "x.json"), "--out", str(tmp_path / "out"), "--runs", "r"]
    assert report.smoke_report_main("x", no_training, None, argv, "x", render=render) == 2
    assert "--runs: --from-json re-renders the report" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["mnli", "dlrm", "codebert", "finetune"])
def test_another_reports_json_or_run_is_one_line(name: str, tmp_path: Path, capsys) -> None:
    """Each report refuses the committed JSON of another report (its meta.command names
    that report), and a JSON of its own name whose fields are another's; the MNLI report
    also refuses the run dir of another experiment."""
    import importlib

    main = importlib.import_module(f"experiments.{name}.report").main
    other = report.REPORTS / ("dlrm.json" if name == "mnli" else "mnli.json")
    out = ["--out", str(tmp_path / ("out/x.md" if name == "mnli" else "out"))]
    assert main(["--from-json", str(other), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"that is the JSON of python -m experiments.{other.stem}" in err[0]
    forged = json.loads(other.read_text())
    forged["meta"]["command"] = f"python -m experiments.{name}.report"
    (tmp_path / "forged.json").write_text(json.dumps(forged))
    assert main(["--from-json", str(tmp_path / "forged.json"), *out]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a JSON of" in err[0] and "Traceback" not in err[0], err
    if name == "mnli":
        run = tmp_path / "dlrm-run"
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"experiment": "dlrm"}))
        (run / "metrics.jsonl").write_text("")
        assert main([str(run), *out]) == 2
        assert "is a run of experiments.dlrm, not of experiments.mnli" in capsys.readouterr().err


def test_a_bad_bench_json_fails_before_any_training(tmp_path: Path, capsys) -> None:
    def no_training(argv: list[str]) -> int:
        raise AssertionError("a bad --bench-json must fail before training")

    (tmp_path / "bad.json").write_text("{")
    (tmp_path / "bytes.json").write_bytes(b"\xc5\xff{")  # not UTF-8: a traceback before
    (tmp_path / "other.json").write_text(json.dumps({"date": "d"}))  # another bench's
    (tmp_path / "toy.json").write_text(json.dumps({"tiny": True}))
    for path, why in [
        (tmp_path / "toy.json", "a --tiny run's figures (a toy model)"),
        (tmp_path / "none.json", "no such file"),
        (tmp_path / "bad.json", "not JSON"),
        (tmp_path / "bytes.json", "not JSON"),
        (tmp_path / "other.json", "not python -m benchmarks.x_step's JSON (it lacks 'variants')"),
    ]:
        argv = ["--bench-json", str(path), "--runs", str(tmp_path / "runs")]
        assert (
            report.smoke_report_main(
                "x", no_training, None, argv, "x", bench_section=lambda b: [b["variants"]]
            )
            == 2
        )
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--bench-json {path}: {why}" in err[0]
    assert not (tmp_path / "runs").exists()
    argv = ["--bench-json", str(tmp_path / "other.json"), "--runs", str(tmp_path / "runs")]
    assert report.smoke_report_main("x", no_training, None, argv, "x") == 2  # no bench shown
    assert "--bench-json: this report shows no benchmark" in capsys.readouterr().err
    # a re-render shows its JSON's own benchmark figures: another file's were ignored
    (tmp_path / "r.json").write_text('{"meta": {}}')
    argv = ["--bench-json", str(tmp_path / "b.json"), "--from-json", str(tmp_path / "r.json"),
            "--out", str(tmp_path / "out")]  # fmt: skip
    rendered = []
    assert report.smoke_report_main("x", no_training, None, argv, "x",
                                    render=lambda d, out: rendered.append(d) or "",
                                    bench_section=lambda b: []) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--from-json re-renders the report with the benchmark" in err[0]
    assert not rendered and not (tmp_path / "out").exists()


def test_rank_table_shows_the_late_stage_target_and_how_it_was_met():
    from experiments.report import rank_table

    snaps = {
        "init": {"step": 0, "ranks": {"a": [4, 4]}, "live_params": 100},
        "end": {"step": 9, "ranks": {"a": [2, 3]}, "live_params": 60, "size_target": 50,
                "early_params": 100, "live_over_target": 1.2,
                "above_target_because": "every bond is down to one live rank"},
    }  # fmt: skip
    text = "\n".join(rank_table(snaps))
    assert "| a | 4,4 | 2,3 |" in text
    assert "target: 50 live parameters (from 100" in text and "1.200x the target" in text
    assert "every bond is down to one live rank" in text
    del snaps["end"]["above_target_because"]
    assert "Above it" not in "\n".join(rank_table(snaps))
    # a target compression the early stage already met: held there, and said so
    snaps["end"]["target_held_because"] = "asks for 120 parameters, more than the 100 live"
    text = "\n".join(rank_table(snaps))
    assert "Not the size asked for: asks for 120 parameters, more than the 100 live." in text


def test_the_dlrm_header_names_changed_comera_settings_of_its_comera_run() -> None:
    """A changed target compression (any ``train.comera.*``) was hidden: the header said
    "smoke preset with `train.steps` changed". The lone-run check, whose partner is the
    dense run, still compares the setup the two share only."""
    import dataclasses

    from experiments import cli
    from experiments.dlrm import EXPERIMENT

    ap = cli.build_parser(EXPERIMENT)
    argv = ["--preset", "smoke", "--set", "train.comera.target_compression=20", "--steps", "60"]
    cfg = cli.resolve_config(EXPERIMENT, ap.parse_args(argv), ap)
    rec = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    rec = json.loads(json.dumps(rec, default=cli.config_jsonable))
    assert report.smoke_gaps(rec, EXPERIMENT) == ["train.steps"]
    changed = ["train.steps", "train.comera.target_compression"]
    assert report.smoke_gaps(rec, EXPERIMENT, comera=True) == changed
    rec["train"]["comera"]["enabled"] = False  # how a run trains is not a setting it changed
    del rec["train"]["comera"]["target_compression"]  # a run saved before the key existed
    assert report.smoke_gaps(rec, EXPERIMENT, comera=True) == ["train.steps"]
    # one whose default is not None: filled in as the run trained (it counted as a change)
    del rec["train"]["comera"]["late_prune"]
    assert report.smoke_gaps({**rec, "experiment": "dlrm"}, EXPERIMENT, comera=True) == [
        "train.steps"
    ]
    assert report.smoke_gaps(rec, EXPERIMENT, comera=True) == ["train.steps"]  # no experiment


def test_a_failed_render_leaves_the_report_as_it_was(tmp_path: Path, capsys) -> None:
    """A render that fails halfway moves none of its files: the old JSON, plots and
    markdown stay together (a new JSON and new plots went beside the stale markdown); a
    namesake folder is refused before any file moves."""
    out = tmp_path / "out"
    out.mkdir()
    for name in ("x.json", "x.md", "x.png"):
        (out / name).write_text("old")

    def half(stage: Path) -> None:
        (stage / "x.json").write_text("new")
        (stage / "x.png").write_text("new")
        raise KeyError("bench")

    with pytest.raises(KeyError), report.staged(out) as stage:
        half(stage)
    assert {p.name: p.read_text() for p in out.iterdir()} == dict.fromkeys(
        ("x.json", "x.md", "x.png"), "old"
    )
    with report.staged(out) as stage:
        for name in ("x.json", "x.md"):
            (stage / name).write_text("new")
    assert {p.name: p.read_text() for p in out.iterdir()} == {
        "x.json": "new", "x.md": "new", "x.png": "old"}  # fmt: skip
    (out / "x.png").unlink()
    (out / "x.png").mkdir()
    with pytest.raises(DataError, match="x.png is a folder"), report.staged(out) as stage:
        for name in ("x.json", "x.png"):
            (stage / name).write_text("newer")
    with (
        pytest.raises(DataError, match="cannot make the folder .*x.md/sub"),
        report.staged(out / "x.md" / "sub"),
    ):
        pass
    assert (out / "x.json").read_text() == "new" and sorted(p.name for p in out.iterdir()) == [
        "x.json", "x.md", "x.png"]  # fmt: skip
    # through a command: a JSON whose bench lacks a key fails with the old report in place
    from experiments.dlrm.report import main as dlrm_report

    data = json.loads((report.REPORTS / "dlrm.json").read_text())
    data["bench"] = {"variants": {}}
    (tmp_path / "bad.json").write_text(json.dumps(data))
    assert dlrm_report(["--from-json", str(tmp_path / "bad.json"), "--out", str(out)]) == 2
    assert "not a JSON of python -m experiments.dlrm.report" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["x.json", "x.md", "x.png"]


def test_a_metric_that_was_nan_renders_as_not_available(tmp_path: Path) -> None:
    """An eval AUC over one class is NaN, saved as null: the report shows ``n/a`` (it
    failed on its own JSON, which --from-json then refused as another report's)."""
    from experiments.dlrm.report import render

    data = json.loads((report.REPORTS / "dlrm.json").read_text())
    for run in data["runs"].values():
        run["final"]["auc"] = run["best"]["auc"] = None
    text = render(data, tmp_path)
    assert "| CoMERA | n/a | n/a (" in text and "| dense | n/a | n/a (" in text


def test_runs_a_report_cannot_read_are_one_line(tmp_path: Path) -> None:
    """A damaged ``config.json`` or ``ranks.json`` names its file; a CoMERA run in the
    dense slot (or the reverse) is refused, not reported as a compressed baseline."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    (run / "config.json").write_text('{"experiment": "mnli", "tra')
    with pytest.raises(DataError, match=r"config.json: damaged"):
        report.load_run(run)
    (run / "config.json").write_text("[1, 2]")
    with pytest.raises(DataError, match=r"config.json: holds a list, not a dict"):
        report.load_run(run)
    (run / "config.json").write_text('{"experiment": "dlrm", "dense": false}')
    (run / "ranks.json").write_bytes(b"\xc5\xff{")
    with pytest.raises(DataError, match=r"ranks.json: damaged"):
        report.load_run(run)
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "config.json").write_text('{"experiment": "dlrm", "dense": false}')
    with pytest.raises(DataError, match=r"dense holds a CoMERA run, but the report reads it as"):
        report.check_smoke_pair({"CoMERA": run, "dense": dense}, "dlrm")
    (dense / "config.json").write_text('{"experiment": "dlrm", "dense": true}')
    report.check_smoke_pair({"CoMERA": run, "dense": dense}, "dlrm")
    with pytest.raises(DataError, match=r"is a run of experiments.dlrm, not of .*codebert"):
        report.check_smoke_pair({"CoMERA": run, "dense": dense}, "codebert")


def test_a_pair_of_runs_of_other_setups_or_without_evals_is_refused(tmp_path: Path) -> None:
    """A dense run of other data, steps, batch or seed beside CoMERA's was reported side
    by side (its loss at another step, on other held-out files); a run that never
    evaluated was a traceback. Where the cache lives may differ."""

    def run(name: str, dense: bool, **changes: object) -> Path:
        d = tmp_path / name
        d.mkdir()
        config = {"experiment": "codebert", "dense": dense, "batch_size": 8,
                  "data": {"max_files": 12, "cache_dir": f"/c/{name}"},
                  "train": {"steps": 20, "seed": 0},
                  "model": {"width": 8, "hash_rows": 0}}  # fmt: skip
        for key, value in changes.items():
            section, _, field = key.rpartition("__")
            (config[section] if section else config)[field] = value
        (d / "config.json").write_text(json.dumps(config))
        return d

    comera = run("a", False)
    report.check_smoke_pair({"CoMERA": comera, "dense": run("b", True)}, "codebert")
    for i, (changes, named) in enumerate([
        ({"data__max_files": 20}, "data.max_files (12 against 20)"),
        ({"train__steps": 10}, "train.steps (20 against 10)"),
        ({"batch_size": 4, "train__seed": 1}, "batch_size (8 against 4), train.seed (0 against 1)"),
        # a dense run of other widths (or another saved model) was "the same architecture"
        ({"dense_params": 99, "model__width": 4},
         "dense_params (None against 99), model.width (8 against 4)"),
    ]):  # fmt: skip
        dense = run(f"d{i}", True, **changes)
        with pytest.raises(DataError, match=re.escape(f"other setups: {named};")):
            report.check_smoke_pair({"CoMERA": comera, "dense": dense}, "codebert")
    # a key the experiment lets the pair hold apart (DLRM's hashed dense tables)
    hashed = run("h", True, model__hash_rows=50)
    with pytest.raises(DataError, match=re.escape("model.hash_rows (0 against 50)")):
        report.check_smoke_pair({"CoMERA": comera, "dense": hashed}, "codebert")
    report.check_smoke_pair({"CoMERA": comera, "dense": hashed}, "codebert", ["model.hash_rows"])
    # a key one run lacks was saved before it existed (CodeBERT's data.num_shards): it ran
    # with the default (as a resume of it takes), so the default is no other setup, and
    # another value is
    report.check_smoke_pair({"CoMERA": comera, "dense": run("n", True, data__num_shards=64)},
                            "codebert")  # fmt: skip
    with pytest.raises(DataError, match=re.escape("data.num_shards (64 against 8)")):
        report.check_smoke_pair({"CoMERA": comera, "dense": run("e", True, data__num_shards=8)},
                                "codebert")  # fmt: skip
    rows = {comera: [{"step": 1, "loss": 2.0}, {"step": 1, "eval/x": 1.0}],
            tmp_path / "b": [{"step": 1, "loss": 2.0}]}  # fmt: skip
    with pytest.raises(DataError, match=r"b holds no evaluation \(eval/x\); .* with flag"):
        report.check_evaluated(rows, "eval/x", "flag")
    report.check_evaluated({comera: rows[comera]}, "eval/x", "flag")
    # the final evaluation's row cut off: an earlier one was reported as the final one
    cut = [{"step": 1, "loss": 2.0}, {"step": 1, "eval/x": 1.0}, {"step": 2, "loss": 1.0}]
    with pytest.raises(DataError, match="holds no evaluation of the run's last step 2"):
        report.check_evaluated({comera: cut}, "eval/x", "flag")


def test_kept_settings_are_the_last_resume_s_until_a_restart() -> None:
    """A --mix or data path given at a resume holds at later resumes; a restart from step 0
    rewrote config.json with its own config, which an older resume's must not override."""
    entry = {"step": 4, "argv": [], "settings": {"data.cache_dir": "c1"}}
    assert report.kept_settings({"resumes": [entry, {"step": 6, "argv": []}]}) == {
        "data.cache_dir": "c1"
    }
    restarted = {"step": 0, "argv": [], "restarted": True}
    assert report.kept_settings({"resumes": [entry, restarted]}) == {}
    assert report.kept_settings({"resumes": "damaged"}) == {}
    # a model folder given at a resume (it moved) is the run's model in its setup too
    moved = {"step": 4, "argv": [], "settings": {"model.path": "/new"}}
    config = {"model": {"path": "/old", "rank": 8}, "resumes": [moved]}
    setup = report.pair_setup(config)
    assert setup["model.path"] == "/new" and setup["model.rank"] == 8
    # how a run executes may change on resume, and MNLI's report sets runs of other models
    # side by side: neither is a setup (the review found both named as gaps)
    config["model"]["recompute"] = True
    assert "model.recompute" not in report.pair_setup(config)
    assert not any(k.startswith("model.") for k in report.run_setup(config))


@pytest.mark.parametrize("code", [2, 1, 130, 143])
def test_a_report_passes_on_its_runs_exit_status(tmp_path: Path, capsys, code: int) -> None:
    """A smoke run refused for bad input (2) made the report command exit 1, which
    cli.md keeps for bugs. A run stopped by Ctrl-C or SIGTERM is not said to have failed."""
    with pytest.raises(SystemExit) as stop:
        report.ensure_smoke_run(lambda argv: code, tmp_path / "r", dense=False, label="x report")
    assert stop.value.code == code
    said = f"x report: the run in {tmp_path / 'r'} "
    said += ("was stopped (exit {}); run the report again to finish it" if code > 128
             else "failed (exit {})").format(code)  # fmt: skip
    assert said in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["CoMERA", "dense"])
def test_a_lone_run_of_another_setup_is_refused_before_its_partner_trains(
    tmp_path: Path, capsys, kind: str
) -> None:
    """A ``--corpus`` CoMERA run in ``RUNS/codebert-smoke`` made the report train the
    dense partner from the smoke preset (the stdlib corpus, minutes), then refuse the
    pair as of other setups; a lone run of the preset's own setup trains its partner."""
    from experiments.codebert.experiment import EXPERIMENT

    def no_training(argv: list[str]) -> int:
        raise AssertionError("a lone run of another setup must be refused before training")

    import dataclasses

    from experiments import cli

    ap = cli.build_parser(EXPERIMENT)  # the config a plain smoke run records
    argv = ["--preset", "smoke", *(["--dense"] if kind == "dense" else [])]
    cfg = cli.resolve_config(EXPERIMENT, ap.parse_args(argv), ap)
    record = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    record = json.loads(json.dumps(record, default=cli.config_jsonable))
    run = tmp_path / "runs" / f"codebert-smoke{'-dense' if kind == 'dense' else ''}"
    run.mkdir(parents=True)
    (run / "config.json").write_text(json.dumps({**record, "data": {**record["data"],
                                     "source": "paths", "paths": {"a": "/src"}}}))  # fmt: skip
    argv = ["--runs", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]
    assert report.smoke_report_main("codebert", no_training, None, argv, "x",
                                    experiment=EXPERIMENT) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was not trained with the smoke preset's setup (data.paths" in err[0]
    other = "codebert-smoke" if kind == "dense" else "codebert-smoke-dense"
    assert f"--run-dir {tmp_path / 'runs' / other}, then" in err[0]
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == [run.name]
    (run / "config.json").write_text(json.dumps(record))  # the preset's own setup
    assert report.smoke_gaps(record, EXPERIMENT) == []  # what a report calls "smoke preset"
    trained = []
    with pytest.raises(SystemExit):  # the partner's training is called (and fails here)
        report.smoke_report_main("codebert", lambda a: trained.append(a) or 3, None, argv,
                                 "x", experiment=EXPERIMENT)  # fmt: skip
    assert trained


def test_an_existing_folder_nothing_can_be_made_in_is_refused_before_the_work(
    tmp_path: Path, monkeypatch
) -> None:
    """Root passes os.access everywhere, /proc included, and an existing output folder was
    never tried: a benchmark measured for minutes, then failed with a traceback writing
    its JSON, and a report's render ended in mkdtemp's. Both now try the folder first
    (here: a folder whose probe fails) and refuse it in one line."""
    import tempfile

    from experiments import cli

    out = tmp_path / "reports"
    out.mkdir()
    cli.check_folder(out, "--out")  # a folder that can be written: nothing left behind
    assert list(out.iterdir()) == []

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    with pytest.raises(cli.CLIError, match="--out .*: cannot create a folder in .*Permission"):
        cli.check_folder(out, "--out")
    with pytest.raises(DataError, match="cannot write into the folder .*Permission denied"):
        with report.staged(out):
            raise AssertionError("not reached")
