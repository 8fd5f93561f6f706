"""User errors vs bugs: bad input is one line and exit status 2, anything else a traceback.

The commands turn exactly :data:`experiments.cli.USER_ERRORS` (``comera.errors.UserError``
kinds and ``loaders.errors.LoaderInputError``) into one line; a ``ValueError`` from inside
the library is a bug and must keep its traceback, wherever it is raised."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from comera.errors import CheckpointError, ConfigError, DataError, MissingFileError, UserError
from comera.train import NonFiniteLoss
from experiments import cli
from experiments.mnli import experiment as mnli
from loaders.errors import LoaderInputError, LoaderPathError

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
FAST += ["--set", "train.steps=2", "--set", "train.eval_every=None"]
FAST += ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


def _record_user_errors(monkeypatch) -> list[BaseException]:
    """The exceptions the CLI printed as one line, in order."""
    seen: list[BaseException] = []
    original = cli.user_error

    def record(prog: str, error: BaseException) -> int:
        seen.append(error)
        return original(prog, error)

    monkeypatch.setattr(cli, "user_error", record)
    return seen


def _one_line(capsys, prog: str = "experiments.mnli") -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert err[0].startswith(f"python -m {prog}: error: "), err
    return err[0]


def test_the_kinds_keep_the_builtin_bases_callers_catch():
    """ValueError / FileNotFoundError / RuntimeError callers keep catching what they did;
    the experiments' own kinds are UserError kinds."""
    from comera.train import CheckpointError as TrainCheckpointError
    from comera.train.galore import MissingExtraError
    from experiments.dlrm.data import CriteoFormatError
    from experiments.mnli.data import HubUnreachableError
    from loaders.prepare import PrepareError

    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)
    assert issubclass(DataError, UserError) and issubclass(DataError, ValueError)
    assert issubclass(MissingFileError, DataError)
    assert issubclass(MissingFileError, FileNotFoundError)
    assert TrainCheckpointError is CheckpointError and issubclass(CheckpointError, RuntimeError)
    for kind in (cli.CLIError, MissingExtraError, CriteoFormatError, HubUnreachableError):
        assert issubclass(kind, UserError), kind
    assert issubclass(LoaderPathError, LoaderInputError) and issubclass(LoaderPathError, OSError)
    assert issubclass(PrepareError, LoaderInputError) and issubclass(LoaderInputError, ValueError)
    assert not issubclass(LoaderInputError, UserError)  # loaders never import comera
    assert set(cli.USER_ERRORS) == {UserError, LoaderInputError}


@pytest.mark.parametrize(
    "planted, user",
    [
        (ValueError("planted"), False),  # what every experiment used to turn into one line
        (FileNotFoundError("planted"), False),  # ditto: a bug's missing file is a bug
        (KeyError("planted"), False),
        (ConfigError("planted"), True),
        (MissingFileError("planted"), True),
        (CheckpointError("planted"), True),
        (LoaderInputError("planted"), True),
    ],
    ids=lambda x: type(x).__name__ if isinstance(x, BaseException) else str(x),
)
def test_only_user_errors_raised_while_building_are_one_line(
    tmp_path, monkeypatch, capsys, planted, user
):
    """An exception raised where the data and model are built (where bad input shows up):
    a user error is one line and status 2, any other kind propagates with its traceback."""

    def build(*args, **kwargs):
        raise planted

    exp = dataclasses.replace(mnli.EXPERIMENT, build=build)
    argv = [*FAST, "--run-dir", str(tmp_path / "run")]
    if user:
        assert cli.main(exp, argv) == 2
        assert _one_line(capsys).endswith(": error: " + str(planted))
    else:
        with pytest.raises(type(planted), match="planted"):
            cli.main(exp, argv)


def test_an_error_planted_in_the_training_loop_keeps_its_traceback(tmp_path, monkeypatch):
    """A plain ValueError from the task's loss, inside the trainer's step, propagates out of
    ``main``; a UserError met while training (e.g. a corrupt shard mid-epoch) is one line."""

    def broken_loss(self, *args, **kwargs):
        raise ValueError("planted in the loss")

    monkeypatch.setattr(mnli.MNLITask, "loss", broken_loss)
    with pytest.raises(ValueError, match="planted in the loss") as err:
        mnli.main([*FAST, "--run-dir", str(tmp_path / "bug")])
    assert any(f.name == "broken_loss" for f in err.traceback)  # the frame that raised

    def bad_shard(self, *args, **kwargs):
        raise LoaderInputError("Arrow file x.arrow is truncated; re-write or remove it")

    monkeypatch.setattr(mnli.MNLITask, "loss", bad_shard)
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "user")]) == 2


def test_the_command_prints_the_traceback_and_exits_1(tmp_path):
    """End to end, as a user runs it: the planted bug's traceback on stderr, status 1."""
    code = (
        "import sys\n"
        "from experiments.mnli import experiment as mnli\n"
        "def loss(self, *a, **k):\n"
        "    raise ValueError('planted in the loss')\n"
        "mnli.MNLITask.loss = loss\n"
        "raise SystemExit(mnli.main())\n"
    )
    argv = [*FAST, "--run-dir", str(tmp_path / "run"), "--cpu-malloc", "default"]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=ROOT, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ValueError: planted in the loss" in proc.stderr.strip().splitlines()[-1]
    assert ": error: " not in proc.stderr


def test_bad_inputs_are_one_line_raised_as_user_errors(tmp_path, monkeypatch, capsys):
    """A few representative bad inputs through the CLI's ``main``: each is one line naming
    what to change, exit status 2, and raised as a UserError kind (not caught as a
    ValueError)."""
    from experiments.mnli.generated import write_generated_files

    seen = _record_user_errors(monkeypatch)

    def refused(argv: list[str], kind: type[BaseException], text: str) -> None:
        assert mnli.main(argv) == 2, argv
        line = _one_line(capsys)
        assert text in line, line
        assert isinstance(seen[-1], kind), (argv, type(seen[-1]))

    refused(["--set", "train.stepz=3"], cli.CLIError, "unknown config key 'train.stepz'")
    refused(["--set", "train.comera.size_ratio=2"], cli.CLIError, "size_ratio (c) must be")
    refused(["--device", "gpu"], cli.CLIError, "--device gpu: TrainConfig.device='gpu' is not")
    refused(["--set", "train.device=gpu"], cli.CLIError, "'gpu' is not a torch device")
    refused(["--resume", str(tmp_path / "none")], cli.CLIError, "none: no such folder")
    (tmp_path / "other").mkdir()
    refused(["--resume", str(tmp_path / "other")], cli.CLIError, "no config.json there")
    # killed while it prepared (host.json written, config.json not yet): a requeue that
    # always resumes is told to start it again, not asked whether it is a run dir
    (tmp_path / "early").mkdir()
    (tmp_path / "early" / "host.json").write_text("{}")
    refused(["--resume", str(tmp_path / "early")], cli.CLIError,
            "stopped before it started training (no config.json yet); start it again")  # fmt: skip
    refused(["--set", "eval_batch_size=0"], UserError, "batch_size and eval_batch_size must be")
    refused(["--set", "model.heads=0"], UserError, "heads must be >= 1, got 0")
    refused(["--set", "model.heads=-4"], UserError, "heads must be >= 1, got -4")
    # a mode below 1: refused, not re-proposed (vocab) or multiplied away (two negatives)
    refused(["--set", "model.emb_vocab_modes=0,4"], UserError,
            "emb_vocab_modes=(0, 4): every mode must be >= 1")  # fmt: skip
    refused(["--set", "model.attn_modes=[[-4,-4],[4,4]]"], UserError,
            "attn_modes=((-4, -4), (4, 4)): every mode must be >= 1")  # fmt: skip
    # a key the build sets from the tokenizer: refused, not silently replaced
    refused(["--set", "model.vocab_size=500"], cli.CLIError, "sets model.vocab_size itself")
    (tmp_path / "vocab.toml").write_text("[model]\nvocab_size = 500\n")
    refused(["--config", str(tmp_path / "vocab.toml")], cli.CLIError,
            "vocab.toml: model.vocab_size: mnli sets model.vocab_size itself")  # fmt: skip
    refused(["--set", "model.attn_modes=[4,4]"], cli.CLIError,
            "expected a list of 2 lists of ints, got (4, 4)")  # fmt: skip
    # longer rows than the model has positions: refused before the run dir is claimed
    longer = [*FAST, "--run-dir", str(tmp_path / "long"), "--set", "data.max_length=32"]
    refused(longer, UserError, "raise model.max_len too (--set model.max_len=32)")
    assert not (tmp_path / "long").exists()
    # a config check that runs while the data is built, not in the dataclass
    run = [*FAST, "--run-dir", str(tmp_path / "r")]
    refused([*run, "--set", "batch_size=1000"], ConfigError, "lower it (--set batch_size=N)")
    _, _, tok = write_generated_files(tmp_path / "gen", 30, 9)
    missing = str(tmp_path / "missing.jsonl")
    refused(
        [*run, "--tokenizer", str(tok), "--train-file", missing],
        MissingFileError,
        "does not exist; check --train-file",
    )
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"premise": "a", "hypothesis": "b"\n')  # not JSON
    refused([*run, "--tokenizer", str(tok), "--train-file", str(bad)], DataError, "bad.jsonl")
    # a run dir in use, and a checkpoint that cannot be read
    done = tmp_path / "done"
    assert mnli.main([*FAST, "--run-dir", str(done)]) == 0
    capsys.readouterr()
    refused([*FAST, "--run-dir", str(done)], cli.CLIError, "already holds a run")
    for d in (done / "checkpoints").iterdir():
        (d / "model.pt").write_bytes(b"torn")
    refused(["--resume", str(done)], CheckpointError, "cannot read checkpoint")
    (done / "config.json").write_text("{not json")
    refused(["--resume", str(done)], cli.CLIError, "config.json is not JSON")


def test_other_commands_catch_user_errors_not_value_errors(tmp_path, monkeypatch, capsys):
    """The ablation and demo commands: a UserError is one line and status 2, a plain
    ValueError from inside keeps its traceback."""
    from experiments import ablate
    from experiments.mnli import demo

    def planted(kind):
        def fail(*args, **kwargs):
            raise kind("planted")

        return fail

    argv = ["gamma", "--runs-dir", str(tmp_path), "--reports", str(tmp_path)]
    monkeypatch.setattr(ablate, "variants", planted(ValueError))
    with pytest.raises(ValueError, match="planted"):
        ablate.main(argv)
    monkeypatch.setattr(ablate, "variants", planted(ConfigError))
    assert ablate.main(argv) == 2
    assert capsys.readouterr().err.strip() == "python -m experiments.ablate: error: planted"

    monkeypatch.setattr(demo, "run_demo", planted(ValueError))
    with pytest.raises(ValueError, match="planted"):
        demo.main(["--runs-dir", str(tmp_path)])
    monkeypatch.setattr(demo, "run_demo", planted(DataError))
    assert demo.main(["--runs-dir", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "python -m experiments.mnli.demo: error: planted"
    monkeypatch.undo()  # the real demo: a key the build sets itself is refused first
    assert demo.main(["--runs-dir", str(tmp_path), "--set", "model.vocab_size=9"]) == 2
    assert "mnli sets model.vocab_size itself" in capsys.readouterr().err
    assert not list(tmp_path.glob("mnli-smoke-*"))


def test_the_demo_refuses_what_would_mislabel_its_table(tmp_path, capsys):
    """Keys the demo sets for its two runs, data without the generated task's cue
    baseline, and an empty --runs-dir were taken (exit 0, a table of two dense runs or of
    a run elsewhere); each is now one line before anything is made."""
    from experiments.mnli import demo

    runs = tmp_path / "runs"
    for item, said in [
        ("train.run_dir=/tmp/x", "--set train.run_dir: the demo sets train.run_dir itself"),
        ("dense=true", "--set dense: the demo sets dense itself"),
        (" train.comera.enabled=false", "--set train.comera.enabled: the demo sets"),
        ("data.dataset=nyu-mll/glue", "data.dataset='nyu-mll/glue': the demo measures"),
    ]:
        assert demo.main(["--set", item, "--runs-dir", str(runs)]) == 2
        assert said in _one_line(capsys, "experiments.mnli.demo")
    assert demo.main(["--runs-dir", " "]) == 2
    assert "--runs-dir is empty" in _one_line(capsys, "experiments.mnli.demo")
    assert demo.main(["--bogus"]) == 2  # argparse's own errors: one line too
    assert "unrecognized arguments: --bogus" in _one_line(capsys, "experiments.mnli.demo")
    (tmp_path / "file").write_text("x")
    assert demo.main(["--runs-dir", str(tmp_path / "file" / "runs")]) == 2
    assert "--runs-dir " in _one_line(capsys, "experiments.mnli.demo")
    assert not runs.exists()
    # refused by the run itself, once the demo had reserved its folder: it was left empty
    assert demo.main(["--set", "data.generated_train=8", "--runs-dir", str(runs)]) == 2
    assert "lower it (--set batch_size=N)" in _one_line(capsys, "experiments.mnli.demo")
    assert not list(runs.iterdir())


def test_a_run_the_demo_cannot_start_is_said_as_the_demo_takes_it(tmp_path, monkeypatch,
                                                                   capsys):  # fmt: skip
    """A wandb that cannot start was said as the single run says it ("use --wandb
    offline, and go on with --resume RUN"): the demo has no --wandb flag, and resuming
    one run never makes its table. The refused run's records were left behind."""
    import wandb

    from experiments.mnli import demo

    def refuse(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    runs = tmp_path / "my runs"  # a space: the advice's path was cut there, half left
    assert demo.main(["--set", "train.wandb=online", "--runs-dir", str(runs)]) == 2
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if ": error: " in x]  # after the run's model line
    assert "Traceback" not in err
    assert "its comera run: wandb='online': wandb could not start (No API key" in line
    assert "--resume" not in line and "--set train.wandb=offline" in line
    assert "mnli-smoke-comera" not in line
    assert line.endswith("run the demo again")
    assert not list(runs.iterdir())  # nothing left of the refused start


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_the_demo_stopped_while_a_run_reads_its_data_says_so(tmp_path, monkeypatch, capsys,
                                                            signum):  # fmt: skip
    """Ctrl-C while the demo's run read its data was a traceback, and SIGTERM (a
    scheduler's preemption) a silent exit 143 that left the reserved folder behind; the
    experiment's command says both in one line."""
    from experiments.mnli import demo

    def reading(*a, **kw):  # the signal arrives while the run prepares its data
        os.kill(os.getpid(), signum)
        time.sleep(5)  # (SIGINT's KeyboardInterrupt comes at the next bytecode)

    monkeypatch.setattr(demo.mnli, "run", reading)
    runs = tmp_path / "runs"
    assert demo.main(["--runs-dir", str(runs)]) == 128 + signum
    err = capsys.readouterr().err.strip()
    name = signal.Signals(signum).name
    assert err.startswith("python -m experiments.mnli.demo: its comera run (") and (
        err.endswith(
            f"stopped by {name} before it trained; run the demo again (it trains both runs anew)"
        )  # fmt: skip
    ), err
    assert len(err.splitlines()) == 1 and not list(runs.iterdir())


def test_the_demo_scores_the_cue_on_what_the_runs_evaluated(tmp_path, monkeypatch, capsys):
    """The cue baseline counts the eval examples the runs scored (max_eval_examples);
    the dense twin is named and recorded as ``--dense`` names it; a demo started in the
    same second takes other folders; a diverging run is one line and status 1."""
    from experiments.mnli import demo
    from experiments.mnli.generated import best_single_cue_accuracy, generate_examples

    runs: list[tuple] = []

    def run(cfg, argv=None):
        runs.append((cfg, argv))
        return {"eval/validation/accuracy": 0.5, "compression": 1.0, "live_params": 1,
                "wall_s": 1.0}  # fmt: skip

    monkeypatch.setattr(demo.mnli, "run", run)
    monkeypatch.setattr(demo.time, "strftime", lambda fmt: "20260101-000000")
    out = demo.run_demo(["data.max_eval_examples=10"], tmp_path)
    ex = generate_examples(demo.mnli.preset("smoke").data.generated_eval, 0, "validation",
                           demo.mnli.preset("smoke").data.generated_vocab)  # fmt: skip
    assert out["cue"] == best_single_cue_accuracy({k: v[:10] for k, v in ex.items()})
    assert out["cue"] != best_single_cue_accuracy(ex)
    (comera, c_argv), (dense, d_argv) = runs
    assert (comera.dense, dense.dense, dense.train.comera.enabled) == (False, True, False)
    assert dense.train.run_name == comera.train.run_name + "-dense"
    assert d_argv[-1] == "--dense" and "--set=data.max_eval_examples=10" in c_argv
    assert Path(comera.train.run_dir).name == "mnli-smoke-comera-20260101-000000"
    demo.run_demo([], tmp_path)  # the same second: the next free stamp
    assert Path(runs[-1][0].train.run_dir).name == "mnli-smoke-dense-20260101-000000-2"

    def diverge(cfg, argv=None):
        raise NonFiniteLoss("loss is nan at step 2")

    monkeypatch.setattr(demo.mnli, "run", diverge)
    assert demo.main(["--runs-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m experiments.mnli.demo: stopped: loss is nan at step 2"]

    def interrupt(cfg, argv=None):
        raise cli.Interrupted("x", 143, 0, "stopped by SIGTERM at step 5")

    monkeypatch.setattr(demo.mnli, "run", interrupt)
    assert demo.main(["--runs-dir", str(tmp_path)]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "its comera run" in err[0] and "SIGTERM at step 5" in err[0]
    assert "run the demo again" in err[0]


def test_every_preset_refuses_an_empty_batch():
    """MNLI, DLRM and the fine-tune share one check of their two batch sizes."""
    from experiments.dlrm import experiment as dlrm
    from experiments.finetune import experiment as finetune

    for module in (mnli, dlrm, finetune):
        p = module.preset("smoke")
        for field in ("batch_size", "eval_batch_size"):
            with pytest.raises(ConfigError, match=r"batch_size and eval_batch_size must be >= 1"):
                dataclasses.replace(p, **{field: 0})
        assert dataclasses.replace(p, batch_size=1).batch_size == 1


def test_codebert_refuses_a_set_vocab_size(tmp_path, capsys):
    from experiments.codebert import experiment as cb

    assert cb.main(["--set", "model.vocab_size=500", "--run-dir", str(tmp_path / "r")]) == 2
    assert "data.tokenizer, or data.vocab" in _one_line(capsys, "experiments.codebert")
    assert not (tmp_path / "r").exists()


def test_codebert_rows_longer_than_the_positions_are_refused():
    import dataclasses

    from experiments.codebert import experiment as cb

    p = cb.preset("smoke")
    with pytest.raises(ConfigError, match=r"data.seq_len=256 .*model.max_len=128"):
        dataclasses.replace(p, data=dataclasses.replace(p.data, seq_len=256))


def test_a_file_that_is_no_tokenizer_is_one_clear_error(tmp_path) -> None:
    """A --tokenizer that points at another file (or a damaged tokenizer.json) is refused
    with the file's name, as the MNLI and CodeBERT commands refuse it: never a bare
    ``Exception`` from the tokenizers library."""
    from comera.errors import DataError
    from experiments.codebert.data import tokenizer_info
    from experiments.mnli.data import load_tokenizer as mnli_tokenizer
    from loaders.errors import LoaderInputError
    from loaders.text import load_tokenizer

    bad = tmp_path / "train.jsonl"
    bad.write_text('{"premise": "a", "label": 1}\n')
    damaged = tmp_path / "tok"
    damaged.mkdir()
    (damaged / "tokenizer.json").write_text('{"version": "1.0"}')
    for path in (bad, damaged):
        with pytest.raises(LoaderInputError, match="is not a tokenizer.json"):
            load_tokenizer(str(path))
        with pytest.raises(DataError, match="is not a tokenizer.json"):
            mnli_tokenizer(str(path))
        with pytest.raises(DataError, match="is not a tokenizer.json"):
            tokenizer_info(str(path))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--device", "mps"], "--device mps: this torch"),
        (["--set", "train.device=meta"], "train.device 'meta': a meta tensor holds no data"),
        (["--run-dir", "{file}"], "is a file; give a folder"),
        (["--run-dir", "{file}/run"], "is a file, so the folder cannot be created"),
        # no folder can be made there, even for root (whom os.access lets write anywhere)
        (["--run-dir", "/proc/comera-run"], "--run-dir /proc/comera-run: "),
        (["--config", "{yaml}"], "cannot read it as YAML (while parsing"),
    ],
)
def test_bad_places_and_files_are_one_line(tmp_path, capsys, monkeypatch, extra, message):
    """A device torch cannot use here (not only CUDA), a run dir that cannot be one, and a
    config file the parser rejects: each was a traceback (or, for YAML, several lines);
    now one line and status 2, with nothing created."""
    import torch

    if torch.backends.mps.is_available():  # the refusal is for machines without it
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.yaml").write_text("train:\n  steps: 2\n bad: [\n")
    fill = {"file": str(tmp_path / "file"), "yaml": str(tmp_path / "bad.yaml")}
    argv = [*FAST, "--run-dir", str(tmp_path / "run"), *(a.format(**fill) for a in extra)]
    assert mnli.main(argv) == 2
    assert message in _one_line(capsys)
    assert not (tmp_path / "run").exists()


def test_a_run_dir_holding_another_runs_records_is_refused(tmp_path, capsys):
    """Without config.json, metrics.jsonl or checkpoints a folder passed as free: a new run
    merged its rank history into the ranks.json there."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "ranks.json").write_text('{"keep": "me"}')
    (run / "notes.md").write_text("mine")
    assert mnli.main([*FAST, "--run-dir", str(run)]) == 2
    assert "holds ranks.json of another run" in _one_line(capsys)
    assert (run / "ranks.json").read_text() == '{"keep": "me"}'
    (run / "ranks.json").unlink()
    # a run's files without its config.json: "holds a run; --resume it" sent the user to a
    # resume that refuses a folder with no config.json
    for name in ("metrics.jsonl", "checkpoints"):
        (run / name).mkdir() if name == "checkpoints" else (run / name).write_text("{}\n")
        assert mnli.main([*FAST, "--run-dir", str(run)]) == 2
        line = _one_line(capsys)
        assert f"holds {name} of another run (and no config.json to resume it)" in line, line
        assert "--resume" not in line
        (run / name).rmdir() if name == "checkpoints" else (run / name).unlink()
    assert mnli.main([*FAST, "--run-dir", str(run)]) == 0  # a folder of one's own files


def test_ablation_and_demo_refuse_what_fails_after_training(tmp_path, capsys):
    """A --reports that is a file failed with FileExistsError after every variant had
    trained; the demo without evaluations failed with a KeyError after both runs."""
    from experiments import ablate
    from experiments.mnli import demo

    (tmp_path / "file").write_text("x")
    runs = tmp_path / "runs"
    argv = ["gamma", "--values", "0.1", "--runs-dir", str(runs), "--reports",
            str(tmp_path / "file"), "--set", "train.steps=2",
            "--set", "train.comera.reg_start_step=0"]  # fmt: skip
    assert ablate.main(argv) == 2
    assert "--reports " in _one_line(capsys, "experiments.ablate") and not runs.exists()
    assert demo.main(["--set", "train.eval_every=None", "--runs-dir", str(runs)]) == 2
    assert "train.eval_every=None: the demo compares" in _one_line(capsys, "experiments.mnli.demo")
    assert not runs.exists()


def _presets():
    from experiments.codebert import experiment as codebert
    from experiments.dlrm import experiment as dlrm
    from experiments.finetune import experiment as finetune

    return {"mnli": mnli.preset("smoke"), "dlrm": dlrm.preset("smoke"),
            "codebert": codebert.preset("smoke"), "finetune": finetune.preset("smoke")}  # fmt: skip


@pytest.mark.parametrize(
    ("experiment", "key", "value", "named"),
    [
        ("mnli", "train.seed", str(2**70), "seed must fit in 64 bits"),
        ("mnli", "train.optim.eps", "0", "eps must be > 0"),
        ("mnli", "model.init_std", "inf", "init_std must be finite and > 0"),
        ("mnli", "model.rank", "0", r"model.rank=0: EncoderConfig: rank must be >= 1"),
        ("codebert", "model.emb_rank", "0", "emb_rank must be >= 1"),
        ("dlrm", "model.bottom", "(0,)", r"model.bottom=\(0,\): every layer width"),
        ("dlrm", "model.top", "(-1,)", r"model.top=\(-1,\): every layer width"),
        ("dlrm", "model.top", "(4, 0)", r"model.top=\(4, 0\): every layer width"),
        ("finetune", "model.hidden", "0", "model.hidden=0 must be >= 1"),
        ("finetune", "model.heads", "0", "model.heads=0 must be >= 1"),
        ("finetune", "model.ffn", "-1", "model.ffn=-1 must be >= 1"),
        ("finetune", "model.dropout", "1.5", r"model.dropout=1.5 must be in \[0, 1\)"),
        ("finetune", "model.init_std", "-1", "model.init_std=-1.0 must be finite"),
        ("finetune", "model.min_compression", "nan", "min_compression=nan must be finite and >= 0"),
        ("codebert", "data.max_files", "0", "max_files=0 must be None .all. or >= 2"),
        # prepare refused one file per group, naming its own --heldout flag
        ("codebert", "data.max_files", "1", "max_files=1 must be None .all. or >= 2 .each"),
        ("codebert", "data.eval_batches", "-1", "eval_batches=-1 must be >= 0"),
        ("codebert", "data.eval_batches", "0", "eval_batches=0 holds nothing for the evalua"),
    ],
)
def test_values_that_cannot_train_are_refused_at_start(experiment, key, value, named):
    """Each was accepted and then crashed (ZeroDivisionError, negative dimensions), ran
    into a NaN with advice about learning rates, or trained on something else
    (max_files=-1 is all files but one, 0 eval batches logged NaN)."""
    from comera.errors import UserError

    with pytest.raises(UserError, match=named):
        cli.set_field(_presets()[experiment], key, value, text=True)


def test_duplicate_values_and_a_json_without_bench_are_one_line(tmp_path, capsys):
    from experiments import ablate

    argv = ["gamma", "--values", "0.1,0.2,0.1", "--runs-dir", str(tmp_path / "r"),
            "--reports", str(tmp_path / "reports")]  # fmt: skip
    assert ablate.main(argv) == 2
    assert "0.1 given twice" in _one_line(capsys, "experiments.ablate")
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "m"), "--json"]) == 2
    assert "--json goes with --bench" in _one_line(capsys)
    assert not (tmp_path / "m").exists()


def test_dlrm_mlps_without_hidden_layers_stay_allowed():
    """``()`` is one linear layer (a logit straight from the interactions for ``top``)."""
    base = _presets()["dlrm"]
    assert cli.set_field(base, "model.top", "()", text=True).model.top == ()
    assert cli.set_field(base, "model.bottom", "()", text=True).model.bottom == ()


def test_a_check_across_sections_names_the_overrides_it_is_about(tmp_path, capsys) -> None:
    """DLRM's whole-config check (hot rows need CoMERA's tables) sees every override; its
    line names the two it is about, not --run-dir, --wandb-name and the rest."""
    from experiments.dlrm import main as dlrm_main

    argv = ["--preset", "smoke", "--dense", "--set", "model.hot_rows=16",
            "--run-dir", str(tmp_path / "r")]  # fmt: skip
    assert dlrm_main(argv) == 2
    line = _one_line(capsys, "experiments.dlrm")
    named = line.split(": ")[2]  # the overrides, before the check's own message
    assert named == "--dense, --set model.hot_rows=16", line
    assert not (tmp_path / "r").exists()
    # a section's own check names the section's overrides as typed: it named the flags that
    # set them as keys (train.bf16=True) and a run name --dense derives as a --wandb-name
    from experiments.mnli import main as mnli_main

    argv = ["--dense", "--bf16", "--no-progress", "--run-dir", str(tmp_path / "r")]
    assert mnli_main(argv) == 2
    line = _one_line(capsys, "experiments.mnli")
    assert line.split(": ")[2] == f"--run-dir {tmp_path / 'r'}, --bf16, --no-progress, --dense"
    assert not (tmp_path / "r").exists()
    argv = ["--wandb-tags", "a,b", "--set", "train.steps=0", "--run-dir", str(tmp_path / "r")]
    assert mnli_main(argv) == 2
    line = _one_line(capsys, "experiments.mnli")
    assert "--wandb-tags a,b, --set train.steps=0" in line and "wandb_tags=" not in line


DEMO_RANKS = """
import json, sys
from pathlib import Path
from experiments.mnli import demo
import os
rank = int(os.environ["RANK"])
out = Path(sys.argv[1])
seen = []
demo.mnli.run = lambda cfg, argv=None: seen.append(cfg.train.run_dir) or {
    "eval/validation/accuracy": 0.5}
demo.time.strftime = lambda fmt: f"stamp{rank}"  # each process its own second
demo.run_demo([], out / "runs")
(out / f"rank{rank}.json").write_text(json.dumps(seen))
"""


def test_the_demo_under_torchrun_trains_each_run_in_one_folder(tmp_path):
    """Every rank reserved folders of its own (a stamp per process, then the next free
    suffix): each run's checkpoint was split over two folders and resumed in neither.
    Rank 0 picks them; the others take its pick."""
    import json
    import os

    from tests.train_helpers import free_port

    script = tmp_path / "worker.py"
    script.write_text(DEMO_RANKS)
    root = Path(__file__).resolve().parents[2]
    port, procs = free_port(), []
    for rank in range(2):
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "RANK": str(rank),
               "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), str(tmp_path)], env=env))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    seen = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert seen[0] == seen[1] and [Path(d).name for d in seen[0]] == [
        "mnli-smoke-comera-stamp0", "mnli-smoke-dense-stamp0"]  # fmt: skip
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["mnli-smoke-comera-stamp0"]


def test_galore_on_the_tt_model_is_refused(tmp_path, capsys):
    """train.comera.enabled=false without --dense keeps the TT model; GaLore's refusal
    advised exactly that, and the run then trained the TT cores and gates with GaLore's
    plain AdamW at lr_rest, exit 0."""
    argv = ["--preset", "smoke", "--set", "train.optimizer=galore", "--set",
            "train.comera.enabled=false", "--wandb", "disabled", "--no-progress",
            "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert mnli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.optimizer=galore trains the dense baseline" in err[0]
    assert err[0].endswith("add --dense") and not (tmp_path / "run").exists()
