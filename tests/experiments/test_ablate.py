"""``python -m experiments.ablate``: variants, runs, the report and its plot."""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import re
from pathlib import Path

import pytest
import torch

from experiments import ablate, cli
from experiments.mnli import experiment as mnli

SMALL = ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]
SMALL += ["--set", "train.eval_every=3", "--set", "train.log_every=1", "--wandb", "disabled"]
SMALL += ["--set", "train.progress=false"]


def test_contraction_ablation_writes_report_and_plot(tmp_path):
    argv = ["contraction", "--experiment", "mnli", "--preset", "smoke", "--set", "train.steps=6"]
    argv += [*SMALL, "--values", "dp,comera,dense"]  # comera, the reference, not first
    argv += ["--runs-dir", str(tmp_path / "runs"), "--reports", str(tmp_path / "rep")]
    assert ablate.main(argv) == 0
    assert (tmp_path / "rep" / "ablation_contraction.png").stat().st_size > 5000
    data = json.loads((tmp_path / "rep" / "ablation_contraction.json").read_text())
    assert data["meta"]["command"] == "python -m experiments.ablate " + " ".join(argv)
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["cpu"]
    assert data["ablation"] == "contraction"
    rows = data["variants"]
    assert [(r["label"], r["steps"]) for r in rows] == [("dp", 6), ("comera", 6), ("dense", 6)]
    assert all(r["first_diff"] < 1e-5 for r in rows)  # every strategy computes the same model
    assert rows[1]["max_diff"] == 0.0  # measured against the paper's path
    assert all(r["early_diff"] < 1e-3 for r in rows)
    for label in ("comera", "dp", "dense"):
        saved = json.loads(
            (tmp_path / "runs" / "ablate-contraction-smoke" / label / "config.json").read_text()
        )
        assert saved["plans"]["default"] == label
        assert saved["train"]["wandb_group"] == "ablate-contraction-mnli-smoke"
        host = json.loads(
            (tmp_path / "runs" / "ablate-contraction-smoke" / label / "host.json").read_text()
        )
        assert host == {k: data["meta"][k] for k in ("cpu", "torch", "date")}
    # the markdown is a function of the JSON alone
    md = tmp_path / "rep" / "ablation_contraction.md"
    assert "loss diff vs comera" in md.read_text()
    (tmp_path / "again").mkdir()
    assert ablate.render_report(data, tmp_path / "again" / md.name) == md.read_text()


def test_objective_variants_cross_both_choices():
    cfg = mnli.preset("smoke")
    out = ablate.variants("objective", cfg, mnli.EXPERIMENT, None)
    assert [v.label for v in out] == [
        "mean+gate",
        "mean+contribution",
        "l1+gate",
        "l1+contribution",
    ]
    gammas = [dict(v.overrides).get("train.comera.gamma", cfg.train.comera.gamma) for v in out]
    n_gates = cfg.train.comera.gamma / gammas[2]
    assert gammas[:2] == [cfg.train.comera.gamma] * 2 and n_gates > 50  # l1 scaled by the count
    assert [v.label for v in ablate.variants("gamma", cfg, mnli.EXPERIMENT, None)][0] == "gamma=0.0"
    with pytest.raises(cli.CLIError, match="fixed variants"):
        ablate.variants("objective", cfg, mnli.EXPERIMENT, "a,b")


def test_hot_rows_ablation_is_dlrms(capsys):
    from experiments.dlrm import experiment as dlrm

    cfg = dlrm.preset("smoke")
    out = ablate.variants("hot_rows", cfg, dlrm.EXPERIMENT, None)
    assert [dict(v.overrides)["model.hot_rows"] for v in out] == [0, 256, 1024, 4096]
    assert [v.label for v in ablate.variants("hot_rows", cfg, dlrm.EXPERIMENT, "0,8")] == ["0", "8"]
    assert ablate.main(["hot_rows", "--experiment", "mnli"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experiment dlrm" in err[0]


def test_steps_variants_scale_the_comera_schedule():
    from experiments.dlrm import experiment as dlrm

    cfg = dlrm.preset("smoke")
    t, c = cfg.train, cfg.train.comera
    out = ablate.variants("steps", cfg, dlrm.EXPERIMENT, None)
    assert [v.label for v in out] == [f"steps={t.steps * f}" for f in (1, 2, 3)]
    for f, v in zip((1, 2, 3), out, strict=True):
        assert dict(v.overrides) == {
            "train.steps": t.steps * f,
            "train.comera.early_steps": c.early_steps * f,
            "train.comera.reg_start_step": c.reg_start_step * f,
        }
        scaled = cli.apply_overrides(cfg, list(v.overrides), [])  # a valid config
        assert scaled.train.steps == t.steps * f and scaled.train.warmup_steps == t.warmup_steps
    with pytest.raises(cli.CLIError, match="fixed variants"):
        ablate.variants("steps", cfg, dlrm.EXPERIMENT, "1,2")


def test_capacity_variants_separate_rank_adaptation_format_and_data(capsys):
    """The capacity ablation: the preset, its TTM tables at fixed ranks (1x, 4x), the
    preset's own dense baseline (what --dense trains), and both on 3x the generated rows
    with the schedule scaled along; a real file has no 3x variants; DLRM's only."""
    from experiments.dlrm import experiment as dlrm

    cfg = dlrm.preset("smoke")
    t, c, r = cfg.train, cfg.train.comera, cfg.model.emb_rank
    out = {
        v.label: dict(v.overrides) for v in ablate.variants("capacity", cfg, dlrm.EXPERIMENT, None)
    }
    assert list(out) == ["comera", f"fixed_rank_{r}", f"fixed_rank_{4 * r}", "dense",
                         "dense_hash_rows_256", "dense_hash_rows_1024",
                         "comera_3x_data", f"fixed_rank_{r}_3x_data", "dense_3x_data"]  # fmt: skip
    assert out["dense_hash_rows_256"] == {**out["dense"], "model.hash_rows": 256}
    assert out["comera"] == {} and out[f"fixed_rank_{r}"] == {"train.comera.enabled": False}
    assert out[f"fixed_rank_{4 * r}"]["model.emb_rank"] == 4 * r
    assert out["dense"] == dict(dlrm.dense_overrides(cfg))
    assert out["dense"]["dense"] is True and out["dense"]["train.optimizer"] == "adamw"
    more = {"data.generated_rows": 3 * cfg.data.generated_rows, "train.steps": 3 * t.steps,
            "train.comera.early_steps": 3 * c.early_steps,
            "train.comera.reg_start_step": 3 * c.reg_start_step}  # fmt: skip
    assert out["comera_3x_data"] == more and out["dense_3x_data"] == {**more, **out["dense"]}
    assert out[f"fixed_rank_{r}_3x_data"] == {**more, "train.comera.enabled": False}
    kaggle = dlrm.preset("kaggle")  # its reference baseline trains with SGD: here as CoMERA
    dense = dict(ablate.variants("capacity", kaggle, dlrm.EXPERIMENT, None)[3].overrides)
    assert kaggle.dense_optimizer == "sgd" and dense["train.optimizer"] == "adamw"
    for over in out.values():  # every variant is a valid config
        cli.apply_overrides(cfg, list(over.items()), [])
    real = cli.set_field(cfg, "data.path", "train.txt")
    assert len(ablate.variants("capacity", real, dlrm.EXPERIMENT, None)) == 6
    with pytest.raises(cli.CLIError, match="fixed variants"):
        ablate.variants("capacity", cfg, dlrm.EXPERIMENT, "1,2")
    assert ablate.main(["capacity", "--experiment", "mnli"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experiment dlrm" in err[0]


def test_summary_reports_the_best_eval_and_its_step(tmp_path):
    def train(step: int, loss: float, live: int) -> dict:
        return {"step": step, "loss": loss, "compression": 1e3 / live, "live_params": live,
                "steps_per_s": 10.0, "step_time_s": 0.1}  # fmt: skip

    rows = [
        train(10, 0.7, 100),
        {"step": 10, "eval/val/auc": 0.61, "eval/val/accuracy": 0.7},
        train(20, 0.6, 90),
        {"step": 20, "eval/val/auc": 0.66, "eval/val/accuracy": 0.72},
        train(30, 0.5, 80),
        {"step": 30, "eval/val/auc": 0.64, "eval/val/accuracy": 0.74},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    s = ablate._summary({"label": "x", "dir": tmp_path})
    assert s["eval_auc"] == 0.64 and s["best_eval"] == (0.66, 20)  # AUC first, not accuracy
    rows.insert(3, {"step": 15, "eval/val/loss": 0.5})  # an eval row without the metric
    rows.append({"step": 40, "eval/val/auc": 0.66})  # a tie: the earlier step is kept
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert ablate._summary({"label": "x", "dir": tmp_path})["best_eval"] == (0.66, 20)
    # steps that timed auto's candidates (3 s each) are not steps' times: at 4 steps, auto's
    # median was 6x comera's
    timing = [dict(train(s, 0.7, 100), step_time_s=3.0, plans_timed=True) for s in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in timing + rows))
    assert ablate._summary({"label": "x", "dir": tmp_path})["step_time_ms"] == pytest.approx(100)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ablate.write_report("steps", [{"label": "x", "dir": tmp_path}], tmp_path / "a.md", "cmd")
    (row,) = json.loads((tmp_path / "a.json").read_text())["variants"]
    assert row["eval_auc"] == 0.66 and row["best_eval"] == [0.66, 20]
    assert s["eval_curve"] == [(10, 0.61), (20, 0.66), (30, 0.64)]
    ablate.write_report("capacity", [{"label": "x", "dir": tmp_path}], tmp_path / "c.md", "cmd")
    assert (tmp_path / "c.png").stat().st_size > 0  # its own plot: AUC against size
    data = json.loads((tmp_path / "c.json").read_text())
    assert data["variants"][0]["eval_curve"] == [[10, 0.61], [20, 0.66], [30, 0.64], [40, 0.66]]
    assert data["meta"]["command"] == "cmd" and data["ablation"] == "capacity"
    (tmp_path / "again").mkdir()
    again = ablate.render_report(data, tmp_path / "again" / "c.md")
    assert again == (tmp_path / "c.md").read_text()
    bare = tmp_path / "bare"  # a run that logged no eval: plotted without its point
    bare.mkdir()
    (bare / "metrics.jsonl").write_text(json.dumps(rows[0]) + "\n")
    recs = [{"label": "x", "dir": tmp_path}, {"label": "y_3x_data", "dir": bare}]
    ablate.write_report("capacity", recs, tmp_path / "d.md", "cmd")
    data = json.loads((tmp_path / "d.json").read_text())
    assert [r["label"] for r in data["variants"]] == ["x", "y_3x_data"]
    assert data["variants"][1]["eval_curve"] == [] and (tmp_path / "d.png").is_file()


def test_restart_only_from_the_command_line(tmp_path, monkeypatch, capsys):
    """Only ``python -m experiments.ablate`` re-executes itself for its allocator policy:
    not a call with ``argv`` (tests, scripts), nor ``--report-only``."""
    calls: list[str] = []
    monkeypatch.setattr(ablate, "restart_for", calls.append)

    refusing: list[float] = []  # the gammas whose build is refused

    def prepare(exp, cfg, **kw):  # as a missing data file would be refused
        if cfg.train.comera.gamma in refusing:
            Path(cfg.train.run_dir).mkdir(parents=True)  # what it wrote so far is dropped
            raise ablate.cli.CLIError("refused while building")
        return cfg

    def train(cfg):  # leaves a finished run to report on
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.train.run_dir) / "metrics.jsonl").write_text("trained\n")
        return {}

    monkeypatch.setattr(ablate.cli, "prepare", prepare)
    monkeypatch.setattr(ablate.cli, "train", train)
    cmds: list[str] = []
    monkeypatch.setattr(
        ablate, "write_report", lambda name, recs, out, cmd: cmds.append(cmd) or out.write_text("")
    )
    args = ["gamma", "--experiment", "dlrm", "--runs-dir", str(tmp_path)]
    args += ["--reports", str(tmp_path)]
    assert ablate.main(args) == 0 and calls == []
    monkeypatch.setattr("sys.argv", ["ablate", *args, "--report-only"])
    assert ablate.main() == 0 and calls == []
    assert cmds[-1] == "python -m experiments.ablate " + " ".join(args)  # what trained them
    monkeypatch.setattr("sys.argv", ["ablate", *args, "--report-on"])  # an abbreviation
    assert ablate.main() == 0 and cmds[-1] == "python -m experiments.ablate " + " ".join(args)
    # a rebuild given other --set items still names the command that trained the runs
    monkeypatch.setattr("sys.argv", ["ablate", *args, "--report-only", "--set", "train.steps=9"])
    assert ablate.main() == 0 and cmds[-1] == "python -m experiments.ablate " + " ".join(args)
    # a refused command (a bad --values, or one the build refuses) trains nothing, keeps
    # the record and loses no run
    assert ablate.main([*args, "--values", "0.1,x"]) == 2
    assert ablate.main([*args, "--values", "0.05,0.1"]) == 0
    first = ablate.variant_dir(next(tmp_path.glob("ablate-*")), "0.05")
    assert (first / "metrics.jsonl").read_text() == "trained\n"
    refusing.append(0.05)
    assert ablate.main([*args, "--values", "0.05,0.1"]) == 2
    assert "refused while building" in capsys.readouterr().err
    assert (first / "metrics.jsonl").read_text() == "trained\n"
    # refused at a later variant, once the first retrained: that variant's old run goes,
    # so --report-only refuses rather than mix two commands' runs
    refusing[:] = [0.1]
    assert ablate.main([*args, "--values", "0.05,0.1"]) == 2
    assert not (ablate.variant_dir(first.parent, "0.1") / "metrics.jsonl").exists()
    refusing.clear()
    # a command killed while preparing left the old run aside: it is put back
    first.rename(first.with_name(first.name + ".replaced"))
    first.mkdir()
    (first / "config.json").write_text("{}")  # the killed command's start
    ablate._put_back(first)  # as the next training command does first
    assert (first / "metrics.jsonl").read_text() == "trained\n"
    assert not first.with_name(first.name + ".replaced").exists()
    first.rename(first.with_name(first.name + ".replaced"))  # killed again, then a rebuild
    first.mkdir()
    (first / "config.json").write_text("{}")
    monkeypatch.setattr("sys.argv", ["ablate", *args, "--report-only"])
    assert ablate.main() == 2  # (0.1 unfinished, below) but the run set aside is back
    assert (first / "metrics.jsonl").read_text() == "trained\n"
    capsys.readouterr()
    # the recorded command's 0.1 was refused: its variants are not all its own runs
    assert ablate.main() == 2
    assert "variants ['0.1'] did not finish under the recorded" in capsys.readouterr().err
    assert ablate.main([*args, "--values", "0.05,0.1"]) == 0  # the whole command again
    last = " ".join([*args, "--values", "0.05,0.1"])  # the last command that trained
    # its --values are read back from the record: no --values needed to rebuild it
    assert ablate.main() == 0 and cmds[-1] == "python -m experiments.ablate " + last
    record = next(tmp_path.glob("ablate-*/ablation.json"))
    for damaged in ("not json", "[1]", '{"command": 3}'):  # one line naming the file
        record.write_text(damaged)
        assert ablate.main() == 2
        assert str(record) in capsys.readouterr().err.strip().splitlines()[-1]
    monkeypatch.setattr("sys.argv", ["ablate", *args])
    assert ablate.main() == 0 and calls == ["lean"]  # DLRM's presets train under lean


def test_empty_values_and_interrupted_runs_are_refused(tmp_path, monkeypatch, capsys):
    """An empty --values wrote an empty report over the real one; --report-only after a
    command cut short showed the killed run and an older command's runs under the new
    command's name."""
    for values in ("", ","):
        assert ablate.main(["gamma", "--values", values, "--runs-dir", str(tmp_path)]) == 2
        assert "give at least one value" in capsys.readouterr().err
    trained: list = []
    kill_at = [2]  # the second variant is killed mid-run

    def train(run):
        trained.append(run.train.run_dir)
        Path(run.train.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run.train.run_dir) / "metrics.jsonl").write_text("trained\n")
        if len(trained) == kill_at[0]:
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(ablate.cli, "prepare", lambda exp, cfg, **kw: cfg)
    monkeypatch.setattr(ablate.cli, "train", train)
    args = ["gamma", "--experiment", "dlrm", "--runs-dir", str(tmp_path), "--values", "0.1,0.2"]
    assert ablate.main(args) == 130  # one line, as a variant's own Ctrl-C is said
    assert "stopped by SIGINT; run the ablation command again" in capsys.readouterr().err
    assert ablate.main([*args, "--report-only", "--reports", str(tmp_path)]) == 2
    assert "variants ['0.2'] did not finish" in capsys.readouterr().err
    # the recorded values are read back as the command parsed them: an abbreviated flag,
    # spaces, a repeat (the last wins); the report then shows exactly those variants
    monkeypatch.setattr(ablate, "write_report", lambda name, recs, out, cmd: trained.append(
        [r["label"] for r in recs]) or out.write_text(""))  # fmt: skip
    base = ["gamma", "--experiment", "dlrm", "--runs-dir", str(tmp_path / "b")]
    kill_at[0] = 0  # no kill from here on
    # --reports: a run writes its report (the stub's empty one) where it says, never reports/
    assert ablate.main([*base, "--values", "9", "--val", "0.05, 0.1", "--reports",
                        str(tmp_path)]) == 0  # fmt: skip
    assert ablate.main([*base, "--report-only", "--reports", str(tmp_path)]) == 0
    assert trained[-1] == ["0.05", "0.1"]


def test_render_report_of_no_variants_names_the_way_on(tmp_path):
    data = {"ablation": "gamma", "variants": [], "meta": {"command": "x"}}
    with pytest.raises(ValueError, match="ablation 'gamma' has no variants to render"):
        ablate.render_report(data, tmp_path / "a.md")
    assert not (tmp_path / "a.md").exists()


def test_a_diverging_variant_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    """A variant whose loss turns NaN stops the command with exit 1 and one line that says
    which variant diverged; the report is not rewritten."""

    def train(cfg):
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
        if cfg.train.comera.gamma == 0.1:
            raise ablate.NonFiniteLoss("loss is nan at step 3. Start a new run", "loss is nan "
                                       "at step 3.")  # fmt: skip
        return {}

    monkeypatch.setattr(ablate.cli, "prepare", lambda exp, cfg, **kw: cfg)
    monkeypatch.setattr(ablate.cli, "train", train)
    monkeypatch.setattr(ablate, "restart_for", lambda *a: None)
    argv = ["gamma", "--experiment", "dlrm", "--values", "0.05,0.1", "--runs-dir", str(tmp_path)]
    assert ablate.main([*argv, "--reports", str(tmp_path)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "stopped" in ln]
    assert len(err) == 1 and "gamma variant '0.1'" in err[0] and "step 3" in err[0], err
    # the advice is the ablation's: the swept value may be the cause, and a new run dir
    # (the trainer's own advice) is not how an ablation goes on
    assert "This variant sets train.comera.gamma=0.1; leave its value out of --values" in err[0]
    assert "run the ablation command again" in err[0] and "Start a new run" not in err[0]
    assert not list(tmp_path.glob("*.md"))
    # an ablation of fixed variants takes no --values, and a variant may set nothing
    argv = ["capacity", "--experiment", "dlrm", "--runs-dir", str(tmp_path / "cap")]

    def comera_diverges(cfg):
        Path(cfg.train.run_dir).mkdir(parents=True, exist_ok=True)
        raise ablate.NonFiniteLoss("x", "loss is nan at step 3.")

    monkeypatch.setattr(ablate.cli, "train", comera_diverges)
    assert ablate.main([*argv, "--reports", str(tmp_path)]) == 1
    err = [ln for ln in capsys.readouterr().err.splitlines() if "stopped" in ln]
    assert "This variant trains the preset's own settings; lower the learning" in err[0]
    assert "--values" not in err[0]


def test_an_interrupted_ablation_names_the_variant_and_how_to_go_on(tmp_path, monkeypatch,
                                                                      capsys):  # fmt: skip
    """Ctrl-C or SIGTERM during a variant: one line naming it, and the advice is to run
    the ablation again (its variants start anew), not a --resume of one variant."""

    def train(cfg):
        raise ablate.cli.Interrupted("x", 130, 0, "stopped by SIGINT at step 4")

    monkeypatch.setattr(ablate.cli, "prepare", lambda exp, cfg, **kw: cfg)
    monkeypatch.setattr(ablate.cli, "train", train)
    monkeypatch.setattr(ablate, "restart_for", lambda *a: None)
    argv = ["gamma", "--experiment", "dlrm", "--values", "0.1", "--runs-dir", str(tmp_path)]
    assert ablate.main([*argv, "--reports", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "gamma variant '0.1'" in err and "stopped by SIGINT at step 4" in err
    assert "run the ablation command again" in err and "--resume" not in err

    def preparing(exp, cfg, **kw):  # Ctrl-C while a variant's data is read: a traceback
        raise KeyboardInterrupt

    monkeypatch.setattr(ablate.cli, "prepare", preparing)
    assert ablate.main([*argv, "--reports", str(tmp_path)]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m experiments.ablate: gamma variant '0.1' (") and err[-1]
    assert "stopped by SIGINT before it trained; run the ablation command again" in err[-1]


def test_bad_input_is_one_line(tmp_path, capsys):
    assert ablate.main(["gamma", "--set", "train.gama=1", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown config key 'train.gama'" in err[0]
    # a --set of the swept key that no variant used, quoted in the report's command; and
    # an empty --values item dropped while the header kept it
    runs = ["--runs-dir", str(tmp_path / "runs"), "--reports", str(tmp_path / "rep")]
    for argv, message in [
        (["gamma", "--values", "0.1", "--set", "train.comera.gamma=0.3"],
         "--set train.comera.gamma=0.3: the gamma ablation sweeps train.comera.gamma "
         "(--values sets it for each variant)"),
        (["size_ratio", "--set", "train.comera.size_ratio=0.3"],
         "(its variants set it), so no run would use this value; drop it from --set, or give "
         "the values to compare with --values"),
        (["objective", "--set", "train.comera.prune_rule=gate"],
         "the objective ablation sweeps train.comera.prune_rule (its variants set it)"),
        (["gamma", "--values", "0,,0.1"], "--values '0,,0.1': an empty item"),
    ]:  # fmt: skip
        assert ablate.main([*argv, *runs]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
    assert not (tmp_path / "runs").exists()
    # a scaled sweep takes the --set value as its base
    based = cli.apply_overrides(mnli.preset("smoke"), [], ["train.comera.gamma=0.3"])
    assert ablate.variants("gamma", based, mnli.EXPERIMENT, None)[2].label == "gamma=0.3"
    assert ablate.main(["gamma", "--report-only", "--runs-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--report-only: no run in" in err[0], err
    assert "(and 3 more variants)" in err[0] and "without --report-only first" in err[0]
    # a bad value late in --values fails before any variant trains
    argv = ["gamma", "--values", "0.05,-1", "--runs-dir", str(tmp_path / "runs"), *SMALL]
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--values -1" in err[0], err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").rglob("config.json"))


def test_dlrm_rank_ablation_on_the_criteo_sample(tmp_path):
    from tests.criteo_helpers import SAMPLE as sample

    argv = ["rank", "--experiment", "dlrm", "--preset", "smoke", "--values", "2,4"]
    for kv in (
        f"data.path={sample}",
        f"data.cache_dir={tmp_path / 'cache'}",
        "model.tt_min_rows=100",
        "batch_size=32",
        "train.steps=6",
        "train.eval_every=3",
        "train.log_every=1",
        "train.comera.reg_start_step=1",
        "train.comera.early_steps=4",
        "train.progress=false",
    ):
        argv += ["--set", kv]
    argv += ["--wandb", "disabled", "--runs-dir", str(tmp_path / "runs")]
    argv += ["--reports", str(tmp_path / "rep")]
    assert ablate.main(argv) == 0
    rows = json.loads((tmp_path / "rep" / "ablation_dlrm_rank.json").read_text())["variants"]
    assert [(r["label"], r["steps"]) for r in rows] == [("2", 6), ("4", 6)]
    for r in rows:
        metrics = tmp_path / "runs" / "ablate-dlrm-rank-smoke" / r["label"] / "metrics.jsonl"
        lines = metrics.read_text().splitlines()
        evals = [m for m in map(json.loads, lines) if "eval/val/auc" in m]
        top = max(m["eval/val/auc"] for m in evals)
        first = next(m["step"] for m in evals if m["eval/val/auc"] == top)
        assert r["best_eval"] == [top, first]  # the highest AUC, the earliest step on ties
    for rank in (2, 4):
        saved = json.loads(
            (tmp_path / "runs" / "ablate-dlrm-rank-smoke" / str(rank) / "config.json").read_text()
        )
        assert saved["model"]["emb_rank"] == rank


def test_codebert_gamma_ablation_on_the_stdlib(tmp_path):
    argv = ["gamma", "--experiment", "codebert", "--values", "0,0.1"]
    for kv in (
        f"data.cache_dir={tmp_path / 'cache'}",
        "data.max_files=6",
        "data.vocab=400",
        "data.eval_batches=1",
        "batch_size=2",
        "train.steps=4",
        "train.eval_every=4",
        "train.warmup_steps=0",
        "train.comera.reg_start_step=1",
        "train.comera.early_steps=3",
        "train.progress=false",
    ):
        argv += ["--set", kv]
    argv += ["--wandb", "disabled", "--runs-dir", str(tmp_path / "runs")]
    argv += ["--reports", str(tmp_path / "rep")]
    assert ablate.main(argv) == 0
    rows = json.loads((tmp_path / "rep" / "ablation_codebert_gamma.json").read_text())["variants"]
    assert [(r["label"], r["steps"]) for r in rows] == [("0", 4), ("0.1", 4)]
    assert all(r["eval_acc"] is not None and r["compression"] for r in rows)
    for gamma in ("0", "0.1"):
        saved = json.loads(
            (tmp_path / "runs" / "ablate-codebert-gamma-smoke" / gamma / "config.json").read_text()
        )
        assert saved["train"]["comera"]["gamma"] == float(gamma)


@pytest.mark.slow
def test_compression_ablation_meets_each_target_and_renders_the_path(tmp_path):
    argv = ["compression", "--experiment", "mnli", "--preset", "smoke", "--values", "1,2"]
    argv += ["--set", "train.steps=12", "--set", "train.comera.reg_start_step=0"]
    argv += ["--set", "train.comera.early_steps=6", "--set", "train.comera.prune_every=3"]
    argv += [*SMALL, "--runs-dir", str(tmp_path / "runs"), "--reports", str(tmp_path / "rep")]
    assert ablate.main(argv) == 0
    data = json.loads((tmp_path / "rep" / "ablation_mnli_compression.json").read_text())
    rows = {r["label"]: r for r in data["variants"]}
    assert list(rows) == ["1x", "2x"]
    off, half = rows["1x"]["size"], rows["2x"]["size"]
    assert off["live_params"] == off["early_params"] == off["size_target"]  # held
    assert half["size_target"] == round(half["early_params"] / 2)
    assert half["live_params"] <= half["size_target"]  # met in live parameters
    path = rows["2x"]["eval_path"]  # (compression, metrics) at every eval
    assert len(path) == 4 and path[-1][0] > path[0][0] and "eval/validation/accuracy" in path[-1][1]
    md = (tmp_path / "rep" / "ablation_mnli_compression.md").read_text()
    assert "| live / target |" in md
    assert (tmp_path / "rep" / "ablation_mnli_compression.png").is_file()


def test_a_target_the_early_stage_already_met_is_said_in_the_report(tmp_path):
    """``target_compression --values 1,2`` on a model the early stage left at 3.65x: both
    rows showed live / target 1.000, as if met, and the reason the runs recorded (the late
    stage never grows the model) was left out of the report."""
    why = (
        "train.comera.target_compression=2 asks for 41,282 parameters, more than the "
        "22,603 the late stage starts from; it never grows the model, so it holds that size"
    )
    run = tmp_path / "run"
    run.mkdir()
    end = {"size_target": 22603, "early_params": 22603, "live_params": 22603,
           "live_over_target": 1.0, "target_held_because": why}  # fmt: skip
    (run / "ranks.json").write_text(json.dumps({"end": end}))
    size = ablate._size_record(run)
    assert size["target_held_because"] == why
    row = {"label": "2", "size": size, "live_params": 22603, "compression": 3.65,
           "eval_acc": 0.9}  # fmt: skip
    text = "\n".join(ablate._size_table([row]))
    assert f"2: not the size asked for: {why}." in text


def test_a_masked_lm_ablation_is_read_by_its_held_out_loss(tmp_path):
    """CodeBERT's rank, gamma or steps ablations showed masked-token accuracy alone (0.01 to
    0.06) and picked the best eval by it; its headline metric, the held-out loss, which its
    size ablations use, was not in the table."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 6.0 - s / 10, "compression": 4.0, "live_params": 100,
             "steps_per_s": 10.0, "step_time_s": 0.1} for s in (1, 2, 3, 4)]  # fmt: skip
    rows += [{"step": 2, "eval/heldout/loss": 5.1, "eval/heldout/accuracy": 0.05},
             {"step": 4, "eval/heldout/loss": 5.3, "eval/heldout/accuracy": 0.06}]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = ablate._summary({"label": "8", "dir": str(run)})
    assert row["best_eval"] == (5.1, 2) and row["best_eval_metric"] == "held-out loss"
    data = {"meta": {"command": "python -m experiments.ablate rank --experiment codebert",
                     "cpu": "x", "torch": "y", "date": "z"},
            "ablation": "rank", "variants": [row]}  # fmt: skip
    (tmp_path / "rep").mkdir()
    text = ablate.render_report(data, tmp_path / "rep" / "ablation_codebert_rank.md")
    head = next(line for line in text.splitlines() if line.startswith("| variant | steps"))
    assert "| eval accuracy | held-out loss | best eval held-out loss (step) |" in head
    assert "| 0.0600 | 5.3000 | 5.1000 (2) |" in text


def test_ablate_refuses_torchrun_before_anything_runs(tmp_path, monkeypatch, capsys):
    """Under torchrun every process prepared the data, moved the same run folders aside
    and wrote the record and the report (DLRM's generated file written twice)."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    argv = ["gamma", "--experiment", "dlrm", "--runs-dir", str(tmp_path / "runs"),
            "--reports", str(tmp_path / "rep")]  # fmt: skip
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "runs in one process" in err[0]
        and "torchrun -m experiments.dlrm" in err[0]
    )
    assert not (tmp_path / "runs").exists() and not (tmp_path / "rep").exists()


def test_size_ablations_refuse_bad_values(capsys, tmp_path):
    assert ablate.main(["compression", "--values", "0.5"]) == 2
    assert "numbers >= 1" in capsys.readouterr().err
    # inf would ask for a size of 0: named as typed, not as the size_ratio 0.0 it becomes
    assert ablate.main(["compression", "--values", "2,inf"]) == 2
    assert "--values 'inf': compression factors" in capsys.readouterr().err
    assert ablate.main(["target_compression", "--values", "nan"]) == 2
    assert "--values 'nan': whole-model compressions" in capsys.readouterr().err
    runs = ["--runs-dir", str(tmp_path)]
    assert ablate.main(["gamma", "--values", "a,b", *runs]) == 2  # as typed, not as a --set
    assert "error: --values a: expected a value of type float" in capsys.readouterr().err
    assert ablate.main(["target_compression"]) == 2
    assert "needs --values" in capsys.readouterr().err
    assert ablate.main(["target_compression", "--values", "8,x"]) == 2
    assert "--values 'x': whole-model compressions" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing written for a refused command
    # a key the experiment sets itself is refused here too
    assert ablate.main(["gamma", "--set", "model.vocab_size=9", *runs]) == 2
    err = capsys.readouterr().err
    # the hint names the key this command takes (ablate has no --tokenizer flag)
    assert "sets model.vocab_size itself" in err and "data.tokenizer" in err
    codebert = importlib.import_module("experiments.codebert.experiment")
    cfg = dataclasses.replace(  # a ratio whose inverse is not exact: used as it is
        codebert.preset("smoke"),
        train=dataclasses.replace(
            codebert.preset("smoke").train,
            comera=dataclasses.replace(codebert.preset("smoke").train.comera, size_ratio=0.3),
        ),
    )
    ratios = {v.label: dict(v.overrides)["train.comera.size_ratio"]
              for v in ablate.variants("compression", cfg, codebert.EXPERIMENT, None)}  # fmt: skip
    assert ratios == {"1x": 1.0, "1.5x": 1 / 1.5, "2x": 0.5, "3.3333x": 0.3, "4x": 0.25}
    out = ablate.variants("target_compression", mnli.preset("smoke"), mnli.EXPERIMENT, "8,16")
    assert [v.overrides for v in out] == [
        (("train.comera.target_compression", "8"),),
        (("train.comera.target_compression", "16"),),
    ]


def test_size_ablations_read_each_experiment_by_its_headline_metric():
    """DLRM by AUC, the masked LM by held-out loss (its masked-token accuracy is a side
    figure), a classifier by accuracy."""
    from experiments.ablate import _headline

    dlrm = {"eval_auc": 0.75, "eval_acc": 0.73, "eval_loss": 0.5, "eval_loss_key": "eval/val/loss"}
    mlm = {"eval_auc": None, "eval_acc": 0.14, "eval_loss": 5.2,
           "eval_loss_key": "eval/heldout/loss"}  # fmt: skip
    nli = {"eval_auc": None, "eval_acc": 0.98, "eval_loss": 0.1,
           "eval_loss_key": "eval/validation/loss"}  # fmt: skip
    assert _headline(dlrm) == ("eval AUC", 0.75)
    assert _headline(mlm) == ("held-out loss", 5.2)
    assert _headline(nli) == ("eval accuracy", 0.98)


def test_report_only_reads_its_own_experiments_runs_and_nan_metrics(tmp_path, capsys):
    """``--report-only`` over a variant dir holding another experiment's run is refused
    (its AUC went into an accuracy column); a run whose headline metric was NaN (saved as
    null) renders ``n/a`` with the old report kept until the new one is whole."""
    root = tmp_path / "ablate-gamma-smoke" / "0.01"
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps({"experiment": "dlrm"}))
    (root / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    argv = ["gamma", "--values", "0.01", "--report-only", "--runs-dir", str(tmp_path),
            "--reports", str(tmp_path / "rep")]  # fmt: skip
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "0.01 is a run of experiments.dlrm, not of experiments.mnli" in err[0]
    rows = [{"step": 1, "loss": 1.0, "compression": 2.0, "live_params": 10, "steps_per_s": 1.0},
            {"step": 1, "eval/val/auc": math.nan, "eval/val/accuracy": math.nan}]  # fmt: skip
    (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ablate.write_report("gamma", [{"label": "0.01", "dir": root}], tmp_path / "g.md", "cmd")
    text = (tmp_path / "g.md").read_text()
    assert "| 0.01 | 1 | 1.0000 | n/a | n/a (1) | 2.00x | 10 | n/a | 1.0 |" in text, text


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["gamma", "--values", "0,0.5", "--set", "train.steps=300"],
         "ends before the regularizer starts .*reg_start_step=1000"),
        (["compression", "--values", "1,2", "--set", "train.steps=300"],
         "ends before the late stage .*early_steps=2000"),
        (["compression", "--values", "1,4", "--set", "train.comera.target_compression=6"],
         "target_compression=6.0 overrides the size_ratio"),
        (["rank", "--values", "2,8", "--set", "dense=true"], "a dense run .*drop --set dense"),
        (["gamma", "--values", "0,0.5", "--set", "train.comera.enabled=false"],
         "train.comera.enabled=false reads no rank-adaptation"),
        (["compression", "--values", "2,2.0"], "more than one value names the variant '2x'"),
        (["gamma", "--values", "0.5,0.50"], "'0.5' and '0.50' are the same setting"),
        (["objective", "--set", "dense=true"], "a dense run"),  # was a ZeroDivisionError
        (["gamma", "--values", "0,0." + "0" * 260 + "1"], "too long to name a run folder"),
        # capacity's variants turn CoMERA off and build dense themselves: three names, one run
        (["capacity", "--experiment", "dlrm", "--set", "dense=true"],
         "compares CoMERA with fixed ranks and dense itself"),
        (["capacity", "--experiment", "dlrm", "--set", "train.comera.enabled=false"],
         "compares CoMERA with fixed ranks and dense itself"),
        # gamma 0: no regularizer, so its kinds could not differ; gamma 0 scaled stays 0
        (["regularizer", "--set", "train.comera.gamma=0"], "gamma=0.0 turns the regularizer off"),
        (["gamma", "--set", "train.comera.gamma=0"], "gives the one value 0.0"),
        # DLRM's smoke MLPs are dense and lookups read no plan: six identical rows
        (["contraction", "--experiment", "dlrm"],
         r"model.tt_layers is empty, so no layer reads the contraction plan"),
        # a per-layer rule wins over each variant's default: every row ran "dense"
        (["contraction", "--set", 'plans.per_layer=[["*", "dense"]]'],
         r"plans.per_layer \(\*=dense\) fixes the strategy of the layers it names"),
    ],
)  # fmt: skip
def test_sweeps_whose_rows_could_not_differ_are_refused(tmp_path, capsys, argv, message):
    """Each trained, exit 0, a report of rows that differ only in their labels (a setting
    the run never reads), or one folder trained twice and shown as two rows; the last was
    a traceback after the first variant trained."""
    argv = [*argv, "--runs-dir", str(tmp_path / "runs"), "--reports", str(tmp_path / "rep")]
    assert ablate.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(message, err[0]), err
    assert not (tmp_path / "runs").exists() and not (tmp_path / "rep").exists()


def test_built_in_sweeps_that_meet_the_presets_values(tmp_path):
    """Rank 1 halved was rank 0, refused as a --values the user never gave; a preset's
    size_ratio of 0.667 made its own factor 1.4993x and the built-in 1.5x one setting,
    refused the same way; blank --values items were refused by compression only (now by
    every ablation)."""
    cfg = mnli.preset("smoke")
    one = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, rank=1))
    assert [v.label for v in ablate.variants("rank", one, mnli.EXPERIMENT, None)] == [
        "rank=1", "rank=2"
    ]  # fmt: skip
    c = cfg.train.comera
    near = dataclasses.replace(
        cfg, train=dataclasses.replace(cfg.train, comera=dataclasses.replace(c, size_ratio=0.667))
    )
    out = ablate.variants("compression", near, mnli.EXPERIMENT, None)
    assert [v.label for v in out] == ["1x", "1.4993x", "2x", "4x"]
    assert dict(out[1].overrides)["train.comera.size_ratio"] == 0.667
    # blank items were dropped by every ablation but compression; now all refuse them (an
    # item left out by a typo, "0,,0.1", trained one variant fewer than meant)
    for name in ("compression", "gamma"):
        with pytest.raises(cli.CLIError, match="--values '1, ,2': an empty item"):
            ablate.variants(name, cfg, mnli.EXPERIMENT, "1, ,2")
    # a value of the ablation's own sweep that cannot work is named as the sweep's
    bad = [ablate.Variant("rank=0", (("model.rank", 0),))]
    with pytest.raises(cli.CLIError, match="ablation 'rank''s model.rank=0"):
        ablate.run_ablation("rank", mnli.EXPERIMENT, cfg, bad, tmp_path / "runs")


def test_report_only_rebuilds_the_variants_the_recorded_set_items_named(tmp_path, monkeypatch):
    """A sweep whose labels follow its --set items (steps) was rebuilt from the preset's
    values by --report-only, which then called its own finished runs unfinished."""
    seen: list[list[str]] = []

    def train(run):
        Path(run.train.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(run.train.run_dir) / "metrics.jsonl").write_text("trained\n")
        return {}

    monkeypatch.setattr(ablate.cli, "prepare", lambda exp, cfg, **kw: cfg)
    monkeypatch.setattr(ablate.cli, "train", train)
    monkeypatch.setattr(ablate, "write_report", lambda name, recs, out, cmd: seen.append(
        [r["label"] for r in recs]) or out.write_text(""))  # fmt: skip
    args = ["steps", "--experiment", "dlrm", "--runs-dir", str(tmp_path), "--reports",
            str(tmp_path), "--set", "train.steps=20"]  # fmt: skip
    assert ablate.main(args) == 0
    assert ablate.main([*args[:-2], "--report-only"]) == 0
    assert seen[0] == seen[1] == ["steps=20", "steps=40", "steps=60"]


def test_a_variant_dir_another_process_trains_is_not_moved_or_deleted(tmp_path, capsys):
    """A second ablation command (or one beside a --resume of a variant) renamed the
    variant's folder aside and deleted it under the run training there; it is refused
    first, naming the holder and --runs-dir, with the folder as it was."""
    from tests.train_helpers import lock_holder

    variant = tmp_path / "ablate-gamma-smoke" / "0.05"
    variant.mkdir(parents=True)
    (variant / "metrics.jsonl").write_text('{"step": 1}\n')
    holder = lock_holder(variant)
    try:
        args = ["gamma", "--experiment", "mnli", "--preset", "smoke", "--values", "0.05,0.1"]
        out = ["--runs-dir", str(tmp_path), "--reports", str(tmp_path / "rep")]
        assert ablate.main([*args, *SMALL, *out]) == 2
    finally:
        holder.communicate("")
    err = capsys.readouterr().err
    assert f"is in use by another run (pid {holder.pid} " in err and "--runs-dir" in err
    assert (variant / "metrics.jsonl").read_text() == '{"step": 1}\n'
    assert not (variant.parent / "0.05.replaced").exists()
