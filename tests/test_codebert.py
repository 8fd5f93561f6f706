"""``python -m experiments.codebert`` end to end on a small slice of the stdlib corpus."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch

from experiments.codebert.experiment import main
from loaders import TokenLoader


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
    for r in evals:
        assert r["eval/heldout/perplexity"] == pytest.approx(math.exp(r["eval/heldout/loss"]))
    steps = [r for r in rows if "loss" in r]
    assert all(r["tokens"] == 4 * 128 and r["tokens_per_s"] > 0 for r in steps)
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["data"]["mix"] == {"modules": 0.5, "packages": 0.3, "tests": 0.2}
    assert any(r.get("stage") == "late" for r in rows)


def test_unknown_mix_name_is_one_line(tmp_path: Path, capsys) -> None:
    assert main(_argv(tmp_path, "bad", "--mix", "nope=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--mix names ['nope']" in err[0]


def strip_weights(state: dict) -> dict:
    """A loader state without its weights and the mixer's token tally (restarted under
    new weights): the positions, which must survive a --mix change."""
    drop = ("weights", "config_weights", "mix_tokens")
    out = {k: v for k, v in state.items() if k not in drop}
    if "readers" in out:
        out["readers"] = [strip_weights(r) for r in out["readers"]]
    return out


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
    loader = prepared.trainer.task.train_iter
    state = loader.state_dict()
    assert state["weights"] == {"modules": 0.7, "packages": 1.0, "tests": 0.3}  # missing: same
    saved = json.loads((run / "checkpoints" / "step_00000006" / "data_rank00000.json").read_text())
    assert strip_weights(state) == strip_weights(saved["state"])  # every position kept
    # the new weights hold over the next million tokens (traced to their sub-dataset)
    audit = TokenLoader(dataclasses.replace(loader.config, provenance=True, batch_size=64))
    audit.load_state_dict(state)
    per_source, total = torch.zeros(3, dtype=torch.long), 0
    while total < 1_000_000:
        doc = next(audit)["doc_ids"]
        source = doc[doc >= 0] >> 32
        per_source += torch.bincount(source, minlength=3)
        total += len(source)
    names = [d.name for d in loader.config.datasets]
    shares = dict(zip(names, (per_source / total).tolist(), strict=True))
    for name, want in {"modules": 0.35, "packages": 0.5, "tests": 0.15}.items():
        assert abs(shares[name] - want) < 0.01, (shares, name)
    cli.train(prepared)
    code = main(["--resume", str(run), "--corpus", f"x={tmp_path}", "--no-progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "drop --corpus" in err[-1]
