"""``python -m experiments.codebert`` end to end on a small slice of the stdlib corpus."""

from __future__ import annotations

import json
from pathlib import Path

from experiments.codebert.experiment import main


def _argv(tmp_path: Path, run: str, *extra: str) -> list[str]:
    sets = ["train.steps=12", "train.eval_every=6", "train.checkpoint_every=6",
            "data.max_files=12", "data.vocab=400", "data.eval_batches=2", "batch_size=4",
            "train.comera.reg_start_step=2", "train.comera.early_steps=8",
            "train.comera.prune_every=2", "train.warmup_steps=0",
            f"data.cache_dir={tmp_path / 'cache'}"]  # fmt: skip
    argv = ["--preset", "smoke", "--run-dir", str(tmp_path / run), "--no-progress"]
    argv += ["--wandb", "disabled", *extra]
    for kv in sets:
        argv += ["--set", kv]
    return argv


def test_smoke_cli_runs_on_the_stdlib(tmp_path: Path) -> None:
    assert main(_argv(tmp_path, "run", "--mix", "modules=0.5,packages=0.3,tests=0.2")) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/heldout/loss" in r]
    assert [r["step"] for r in evals] == [6, 12]
    assert all(0 < r["eval/heldout/loss"] < 7 for r in evals)  # below ln(400) ~ 6.0 + slack
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["mix"] == {"modules": 0.5, "packages": 0.3, "tests": 0.2}
    assert any(r.get("stage") == "late" for r in rows)


def test_unknown_mix_name_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(_argv(tmp_path, "bad", "--mix", "nope=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mix names ['nope']" in err[0]


def test_mix_may_change_on_resume_and_nothing_else(tmp_path: Path, capsys) -> None:
    import shutil

    from experiments import cli
    from experiments.codebert.experiment import EXPERIMENT

    run = tmp_path / "run"
    assert main(_argv(tmp_path, "run", "--mix", "modules=1,packages=1,tests=1")) == 0
    shutil.rmtree(run / "checkpoints" / "step_00000012")  # as if killed after step 6
    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(["--resume", str(run), "--mix", "modules=0.7,tests=0.3",
                          "--no-progress"])  # fmt: skip
    cfg = cli.resolve_config(EXPERIMENT, args, ap)
    assert cfg.data.mix == {"modules": 0.7, "tests": 0.3}
    prepared = cli.prepare(EXPERIMENT, cfg, resume=True)
    assert prepared.trainer.step == 6
    weights = prepared.trainer.task.train_iter.state_dict()["weights"]
    assert weights == {"modules": 0.7, "packages": 1.0, "tests": 0.3}  # missing: unchanged
    cli.train(prepared)
    code = main(["--resume", str(run), "--corpus", f"x={tmp_path}", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "drop --corpus" in err[-1]
