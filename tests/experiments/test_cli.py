"""The shared experiment CLI: typed --set overrides, plans that really run, resume, wandb."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
import types

import pytest

import comera as C
from comera.errors import ConfigError
from comera.train import TrainConfig
from comera.train.logging import resolve_wandb_mode
from experiments import cli
from experiments.mnli import experiment as mnli

FAST = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
FAST += ["--set", "train.steps=3", "--set", "train.eval_every=None"]
FAST += ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


def test_set_parses_by_annotation_and_revalidates():
    cfg = mnli.preset("smoke")
    cfg = cli.apply_overrides(
        cfg,
        [],
        [
            "train.comera.gamma=0.02",
            "train.eval_every=None",
            "train.bf16=false",
            "model.attn_modes=((4, 4, 4), (4, 4, 4))",
            "train.wandb_tags=a,b",
            "plans.per_layer=[('layers.*', 'dp')]",
        ],
    )
    assert cfg.train.comera.gamma == 0.02 and cfg.train.eval_every is None
    assert cfg.model.attn_modes == ((4, 4, 4), (4, 4, 4)) and cfg.train.wandb_tags == ("a", "b")
    assert cfg.plans.for_layer("layers.1.q") == "dp"
    with pytest.raises(cli.CLIError, match=r"unknown config key 'train\.comera\.gama'.*gamma"):
        cli.apply_overrides(cfg, [], ["train.comera.gama=1"])
    with pytest.raises(cli.CLIError, match="expected a value of type int"):
        cli.apply_overrides(cfg, [], ["train.steps=1.5"])
    with pytest.raises(cli.CLIError, match="train.steps cannot be None"):
        cli.apply_overrides(cfg, [], ["train.steps=None"])
    for item, reason in [  # a value holding ": " is quoted whole, then the reason once
        ("train.steps=a: b", "expected a value of type int"),
        ("model.attn_modes=[[8, 8]: [8, 8]]", "not a Python literal"),
    ]:
        with pytest.raises(cli.CLIError) as err:
            cli.apply_overrides(cfg, [], [item])
        assert str(err.value).startswith(f"--set {item}: {reason}")
    with pytest.raises(cli.CLIError, match="size_ratio"):  # the dataclass check runs again
        cli.apply_overrides(cfg, [], ["train.comera.size_ratio=2"])
    with pytest.raises(cli.CLIError, match="expected KEY=VALUE"):
        cli.apply_overrides(cfg, [], ["train.steps"])


SIZE = ["model.d_model=256", "model.heads=4", "model.ffn=1024", "model.layers=4"]
MODES = ["model.attn_modes=((16, 16), (16, 16))", "model.ffn_in_modes=((32, 32), (16, 16))",
         "model.ffn_out_modes=((16, 16), (32, 32))", "model.emb_dim_modes=(16, 16)"]  # fmt: skip


def test_set_items_are_validated_together_and_modes_derive():
    """A width and the modes that must multiply to it can be set in any order; modes not
    given follow the new widths (as many cores as before); ``KEY=auto`` derives too."""
    smoke = mnli.preset("smoke")
    derived = cli.apply_overrides(smoke, [], SIZE).model
    assert (derived.d_model, derived.heads, derived.ffn, derived.layers) == (256, 4, 1024, 4)
    assert derived.attn_modes == ((16, 16), (16, 16))
    assert derived.ffn_in_modes == ((32, 32), (16, 16)) and derived.emb_dim_modes == (16, 16)
    for order in (MODES + SIZE, SIZE + MODES, MODES[:2] + SIZE + MODES[2:]):
        assert cli.apply_overrides(smoke, [], order).model == derived
    auto = cli.apply_overrides(smoke, [], ["model.attn_modes=auto"]).model
    assert auto.attn_modes == ((8, 8), (8, 8))  # re-proposed for 64 x 64: the same split
    bad = ["model.d_model=256", "model.attn_modes=((8, 8), (8, 8))",
           "model.ffn_in_modes=((4, 4), (4, 4))"]  # fmt: skip
    with pytest.raises(cli.CLIError) as err:
        cli.apply_overrides(smoke, [], bad)
    msg = str(err.value)
    assert "attn_modes" in msg and "ffn_in_modes" in msg and "ffn_out_modes" not in msg
    assert msg.startswith("--set model.d_model=256, --set model.attn_modes")


def test_a_config_file_gives_the_config_the_same_sets_give(tmp_path, capsys):
    """``--config FILE`` (TOML, YAML or JSON; sections or dotted keys) holds the same
    overrides as ``--set``; the run's config.json is the same but for the command line."""
    sets = [*SIZE, "train.steps=2", "train.eval_every=None", "data.generated_train=200",
            "data.generated_eval=30"]  # fmt: skip
    argv = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
    by_set = [*argv, "--run-dir", str(tmp_path / "set")]
    for item in sets:
        by_set += ["--set", item]
    assert mnli.main(by_set) == 0
    toml = tmp_path / "size.toml"
    toml.write_text(
        "[model]\nd_model = 256\nheads = 4\nffn = 1024\nlayers = 4\n"
        '[train]\nsteps = 2\n"eval_every" = 0\n'  # replaced below by --set
        '[data]\ngenerated_train = 200\n"generated_eval" = 30\n'
    )
    assert mnli.main([*argv, "--run-dir", str(tmp_path / "file"), "--config", str(toml),
                      "--set", "train.eval_every=None"]) == 0  # fmt: skip
    a, b = (json.loads((tmp_path / r / "config.json").read_text()) for r in ("set", "file"))
    for c in (a, b):
        c.pop("argv")
        c["train"].pop("run_dir")
    assert a == b
    flat = {f"model.{k}": v for k, v in (("d_model", 256), ("heads", 4))}
    (tmp_path / "c.json").write_text(json.dumps(flat))
    (tmp_path / "c.yaml").write_text("model:\n  d_model: 256\n  heads: 4\n")
    cfg = mnli.preset("smoke")
    want = cli.apply_overrides(cfg, [], ["model.d_model=256", "model.heads=4"])
    for name in ("c.json", "c.yaml"):
        items = cli.config_file_items(str(tmp_path / name), cfg)
        assert cli.apply_overrides(cfg, [], [], file_items=items) == want
    (tmp_path / "typed.yaml").write_text("train:\n  optim:\n    lr_cores: 1e-3\n")
    items = cli.config_file_items(str(tmp_path / "typed.yaml"), cfg)
    assert cli.apply_overrides(cfg, [], [], file_items=items).train.optim.lr_cores == 1e-3
    (tmp_path / "typed.json").write_text('{"train": {"steps": "many"}}')
    with pytest.raises(cli.CLIError, match="typed.json: train.steps.*type int"):
        cli.apply_overrides(cfg, [], [], file_items=cli.config_file_items(
            str(tmp_path / "typed.json"), cfg))  # fmt: skip
    (tmp_path / "bad.toml").write_text("[model]\nwidth = 3\n")
    capsys.readouterr()
    assert mnli.main([*argv, "--config", str(tmp_path / "bad.toml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.toml: model.width" in err[0] and "d_model" in err[0]
    assert mnli.main([*argv, "--config", str(tmp_path / "c.ini")]) == 2
    assert "no such file" in capsys.readouterr().err


def test_config_round_trips_through_config_json():
    cfg = cli.apply_overrides(mnli.preset("paper"), [("plans.per_layer", (("pooler", "dp"),))], [])
    text = json.dumps(dataclasses.asdict(cfg))
    assert cli.config_from_dict(mnli.Preset, json.loads(text)) == cfg


@pytest.mark.parametrize(
    ("edit", "named"),
    [
        (lambda d: d.update(train=None), "train: expected a section"),
        (lambda d: d["train"].update(comera="x"), "train.comera: expected a section"),
        (lambda d: d.update(dense="yes"), "dense: expected a value of type bool"),
        (lambda d: d["train"].update(wandb_tags="abc"), "train.wandb_tags: expected a list"),
        (lambda d: d["data"].update(eval_files=[1]), "data.eval_files: expected a map of strs"),
    ],
)
def test_a_hand_edited_config_is_refused_naming_the_key(edit, named):
    """A section that is not a mapping failed as an AttributeError deep in the run; a
    string for a bool or a tuple was taken as it came ("abc" became the tags a, b, c)."""
    data = json.loads(json.dumps(dataclasses.asdict(mnli.preset("smoke"))))
    edit(data)
    with pytest.raises(C.errors.ConfigError, match=named):
        cli.config_from_dict(mnli.Preset, data)


def test_a_map_field_takes_only_a_map_of_its_kinds():
    from experiments.codebert import experiment as codebert

    base = codebert.preset("smoke")
    for text in ("()", "1", "None", "{'a': 5}"):
        with pytest.raises(cli.CLIError, match=r"expected a map of strs to strs"):
            cli.set_field(base, "data.paths", text, text=True)
    with pytest.raises(cli.CLIError, match=r"expected a map of strs to floats"):
        cli.set_field(base, "data.mix", "()", text=True)
    assert cli.set_field(base, "data.mix", "{'modules': 2}", text=True).data.mix == {"modules": 2}


def _record_plans(monkeypatch) -> list[tuple[str, tuple]]:
    import comera.layers

    seen = []
    original = comera.layers.tt_linear_plan

    def recording(plan, core_shapes, tokens, name="tt_linear"):
        out = original(plan, core_shapes, tokens, name)
        seen.append((out.strategy, tuple(s[1] for s in out.core_shapes)))
        return out

    monkeypatch.setattr(comera.layers, "tt_linear_plan", recording)
    return seen


def test_plan_chosen_on_the_cli_is_the_plan_that_runs(tmp_path, monkeypatch):
    seen = _record_plans(monkeypatch)
    run_dir = tmp_path / "run"
    argv = [*FAST, "--run-dir", str(run_dir), "--plan", "greedy"]
    argv += ["--plan-for", "layers.*.ffn_*=dp", "--embedding-impl", "naive"]
    assert mnli.main(argv) == 0
    ffn_modes = {(16, 8, 8, 8), (8, 8, 16, 8)}  # smoke ffn_in, ffn_out (out | in modes)
    assert seen and {s for s, modes in seen if modes in ffn_modes} == {"dp"}
    assert {s for s, modes in seen if modes not in ffn_modes} == {"greedy"}
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["plans"] == {
        "default": "greedy",
        "per_layer": [["layers.*.ffn_*", "dp"]],
        "embedding_impl": "naive",
    }
    # resume replays the saved config: the same plans run again
    seen.clear()
    assert mnli.main(["--resume", str(run_dir), "--no-progress"]) == 0


def test_a_plan_rule_must_reach_a_tt_linear(tmp_path, capsys):
    """A ``--plan-for`` rule that matches nothing, or only TTM lookups (which take
    ``--embedding-impl``), would do nothing: one line, before the run dir is claimed."""
    rules = [("embed.*=dp", "matches only TTM embeddings (embed.word)"),
             ("layer.*.q=dp", "(--plan-for, plans.per_layer) matches no TT layer"),
             ("layers.*=bogus", "--plan-for 'layers.*=bogus': unknown strategy")]  # fmt: skip
    for rule, text in rules:
        run_dir = tmp_path / rule.partition("=")[0]
        assert mnli.main([*FAST, "--run-dir", str(run_dir), "--plan-for", rule]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and text in err[0], err
        assert not (run_dir / "checkpoints").exists()


def test_plan_for_adds_to_a_config_files_rules(tmp_path):
    """``--plan-for`` appended its rules to the preset's, so a ``--config`` file's
    ``plans.per_layer`` was dropped without a word."""
    (tmp_path / "plans.json").write_text('{"plans": {"per_layer": [["layers.0.q", "dp"]]}}')
    ap = cli.build_parser(mnli.EXPERIMENT)
    args = ap.parse_args(["--preset", "smoke", "--config", str(tmp_path / "plans.json"),
                          "--plan-for", "layers.1.q=dense"])  # fmt: skip
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, ap)
    assert cfg.plans.per_layer == (("layers.0.q", "dp"), ("layers.1.q", "dense"))
    # a file valid only with a flag beside it (bf16 with --device cuda) is not refused
    # for want of the flag
    (tmp_path / "bf16.json").write_text('{"train": {"bf16": true}}')
    args = ap.parse_args(["--preset", "smoke", "--config", str(tmp_path / "bf16.json"),
                          "--device", "cuda", "--plan-for", "layers.1.q=dense"])  # fmt: skip
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, ap)
    assert cfg.train.bf16 and cfg.plans.per_layer == (("layers.1.q", "dense"),)
    # a bad rule of the file is the file's (merged with the flag's, it was named by none)
    (tmp_path / "bad.json").write_text('{"plans": {"per_layer": [["layers.0.q", "nope"]]}}')
    args = ap.parse_args(["--preset", "smoke", "--config", str(tmp_path / "bad.json"),
                          "--plan-for", "layers.1.q=dense"])  # fmt: skip
    with pytest.raises(cli.CLIError, match=r"^--config .*bad.json: plans.per_layer: \('layers"):
        cli.resolve_config(mnli.EXPERIMENT, args, ap)


def test_plan_errors_name_what_the_cli_takes():
    """A config's plan takes a name only (the tip offered index pairs the CLI refuses), a
    rule for a model without TT linears said "layers are: " and nothing, and one for an
    embedding named no flag."""
    with pytest.raises(ConfigError) as err:
        C.LayerPlans(default="bogus")
    assert "contraction pairs" not in str(err.value) and "auto, comera" in str(err.value)
    with pytest.raises(ConfigError, match="layers are: none .this model has no TT linear"):
        C.LayerPlans(per_layer=(("x", "dp"),)).check_layers([])
    with pytest.raises(ConfigError, match=r"'e\*' \(--plan-for, plans.per_layer\) matches only"):
        C.LayerPlans(per_layer=(("e*", "dp"),)).check_layers(["q"], ["emb"])


def test_resume_replays_config_and_allows_only_reporting_changes(tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir), "--set", "train.comera.gamma=0.07"]) == 0
    capsys.readouterr()
    args = cli.build_parser(mnli.EXPERIMENT).parse_args(
        ["--resume", str(run_dir), "--device", "cpu", "--wandb-group", "g"]
    )
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, cli.build_parser(mnli.EXPERIMENT))
    assert cfg.train.comera.gamma == 0.07 and cfg.train.steps == 3
    assert cfg.train.wandb_group == "g" and cfg.train.run_dir == str(run_dir)
    assert mnli.main(["--resume", str(run_dir), "--set", "train.comera.gamma=0.1"]) == 2
    assert "drop --set train.comera.gamma" in capsys.readouterr().err
    # a resume's command line is recorded beside the config the run started with
    assert mnli.main(["--resume", str(run_dir), "--wandb-group", "g2"]) == 0
    saved = json.loads((run_dir / "config.json").read_text())
    # (with the experiment's own settings that may change on resume, as it ran them)
    kept = {"data.tokenizer": saved["data"]["tokenizer"]}
    assert saved["resumes"] == [{"step": 3, "argv": ["--resume", str(run_dir), "--wandb-group",
                                                      "g2"], "settings": kept}]  # fmt: skip
    assert saved["train"]["comera"]["gamma"] == 0.07
    # a moved tokenizer's new place may be given (it was refused: a dead end)
    tokenizer = ["--tokenizer", saved["data"]["tokenizer"]]
    assert mnli.main(["--resume", str(run_dir), *tokenizer]) == 0


def test_resume_of_a_run_another_process_trains_is_refused_untouched(tmp_path, capsys):
    """A second ``--resume`` (a requeued job beside the old one) rewrote config.json's
    resumes, cleared a stopped attempt's rows and truncated metrics.jsonl under the run
    still training there; it is refused first, as one line naming the holder."""
    import shutil

    from tests.train_helpers import lock_holder

    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 0
    shutil.rmtree(run_dir / "checkpoints")  # as if stopped before its first checkpoint
    before = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
    holder = lock_holder(run_dir)
    try:
        capsys.readouterr()
        assert mnli.main(["--resume", str(run_dir)]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"in use by another run (pid {holder.pid} " in err
        after = {p.name: p.read_bytes() for p in run_dir.iterdir() if p.is_file()}
        assert {k: v for k, v in after.items() if k != ".lock"} == {
            k: v for k, v in before.items() if k != ".lock"
        }
    finally:
        holder.communicate("")
    assert mnli.main(["--resume", str(run_dir)]) == 0  # its holder gone: it starts over


def test_a_new_run_into_a_run_dir_in_use_is_told_so(tmp_path, capsys):
    """A new run given the folder of a run another process trains was told to continue
    it with --resume, which that process's lock then refused."""
    from tests.train_helpers import lock_holder

    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 0
    holder = lock_holder(run_dir)
    try:
        capsys.readouterr()
        assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 2
    finally:
        holder.communicate("")
    err = capsys.readouterr().err.strip()
    assert "in use by another run" in err and err.endswith("or give another --run-dir")
    assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 2  # free again: the old refusal
    assert "already holds a run; continue it with --resume" in capsys.readouterr().err


def test_a_model_setting_edited_in_config_json_is_refused_on_resume(tmp_path, capsys):
    """config.json's model settings rebuild the model on resume: one edited by hand that
    keeps every parameter shape (attention heads) resumed the saved weights into another
    model without a word. What a resume may change (recompute) still goes."""
    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 0
    saved = run_dir / "config.json"
    original = saved.read_text()
    edited = json.loads(original)
    edited["model"]["heads"] = 8  # 64 wide: every shape the same
    saved.write_text(json.dumps(edited))
    capsys.readouterr()
    assert mnli.main(["--resume", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.heads: 16 saved, 8 now" in err, err
    assert "put them back in config.json" in err
    edited = json.loads(original)
    edited["model"]["recompute"] = True
    saved.write_text(json.dumps(edited))
    assert mnli.main(["--resume", str(run_dir)]) == 0


def test_resume_of_a_run_without_a_checkpoint_starts_it_over(tmp_path, capsys):
    """A run stopped before its first checkpoint (a crash, Ctrl-C) could be neither rerun
    (the dir is in use) nor resumed (nothing saved): ``--resume`` now starts it over from
    step 0 with its saved config; its rows are not doubled."""
    import shutil

    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir), "--set", "train.comera.gamma=0.07"]) == 0
    shutil.rmtree(run_dir / "checkpoints")
    capsys.readouterr()
    assert mnli.main(["--resume", str(run_dir)]) == 0
    assert "no checkpoint was written; starting it over" in capsys.readouterr().err
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [3]  # not doubled
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["train"]["comera"]["gamma"] == 0.07
    # the command that made the run stays, and the restart is recorded
    assert saved["argv"][-2:] == ["--set", "train.comera.gamma=0.07"]
    assert saved["resumes"] == [{"step": 0, "argv": ["--resume", str(run_dir)],
                                 "restarted": True}]  # fmt: skip


def test_a_resume_that_trains_nothing_keeps_the_host_record(tmp_path, capsys):
    """Reports name the machine in ``host.json``; resuming a finished run (as the report
    commands do) must not rename it after the machine that only read it."""
    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir)]) == 0
    (run_dir / "host.json").write_text('{"cpu": "elsewhere"}')
    capsys.readouterr()
    assert mnli.main(["--resume", str(run_dir)]) == 0
    assert json.loads((run_dir / "host.json").read_text()) == {"cpu": "elsewhere"}
    # its summary shows what the run logged last, not an empty table; the model line stays
    summary = capsys.readouterr().err
    assert "| loss " in summary and "| compression " in summary, summary
    assert "mnli: CoMERA model," in summary


def test_dense_flag_and_legacy_flags_still_work(tmp_path):
    run_dir = tmp_path / "dense"
    argv = ["--preset", "smoke", "--wandb", "disabled", "--set", "data.generated_train=200"]
    argv += ["--dense", "--run-dir", str(run_dir), "--steps", "2", "--eval-every", "2"]
    assert mnli.main(argv) == 0
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["dense"] is True and saved["train"]["comera"]["enabled"] is False
    assert saved["train"]["steps"] == 2 and saved["train"]["run_name"] == "mnli-smoke-dense"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert any("eval/validation/accuracy" in r for r in rows)


def test_dense_set_alone_and_a_damaged_experiment_name_say_what_to_change(tmp_path, capsys):
    """``--set dense=true`` without --dense was told to "train --dense"; a record whose
    experiment is not a name was told to resume with ``python -m experiments.5``."""
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "d"), "--set", "dense=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "dense=true builds the dense model" in err[0], err
    assert "train.comera.enabled=false" in err[0] and not (tmp_path / "d").exists()
    run = tmp_path / "r"
    run.mkdir()
    data = json.loads(json.dumps(dataclasses.asdict(mnli.preset("smoke"))))
    (run / "config.json").write_text(json.dumps({**data, "experiment": 5}))
    assert mnli.main(["--resume", str(run)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and '"experiment" is 5, not an experiment\'s name' in err[0], err


# ----------------------------------------------------------------------------- wandb


def test_wandb_mode_follows_flag_then_environment(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", types.ModuleType("wandb"))
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve_wandb_mode(None) == ("offline", None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert resolve_wandb_mode(None) == ("disabled", None)
    assert resolve_wandb_mode("online") == ("online", None)  # the flag wins
    monkeypatch.setenv("WANDB_MODE", "dryrun")
    assert resolve_wandb_mode(None) == ("offline", None)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    mode, note = resolve_wandb_mode(None)
    assert mode == "disabled" and "not installed" in note


class _FakeWandb(types.ModuleType):
    """Records init calls; stands in for wandb so the test needs no service."""

    def __init__(self):
        super().__init__("wandb")
        self.inits, self.logged, self.finished = [], [], []

    def init(self, **kw):
        self.inits.append(kw)
        return types.SimpleNamespace(
            log=lambda row, step: self.logged.append(step),
            finish=lambda exit_code=0: self.finished.append(exit_code),
        )


def test_a_stopped_run_ends_its_wandb_run_as_failed(tmp_path, monkeypatch):
    """A run stopped by Ctrl-C (or SIGTERM: both a KeyboardInterrupt) exits 130 and was
    recorded in wandb as finished, exit code 0; one that fails on an error likewise."""
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())

    class Stops(ToyTask):
        def __init__(self, error: BaseException) -> None:
            super().__init__()
            self.error = error

        def loss(self, params, state, batch, *, train):
            if self.calls == 3:
                raise self.error
            return super().loss(params, state, batch, train=train)

    for run, error, code in [("a", KeyboardInterrupt(), 130), ("b", RuntimeError("x"), 1)]:
        cfg = _cfg(tmp_path / run, steps=10, wandb="offline")
        with pytest.raises(type(error)):
            Trainer(cfg, Stops(error), *_toy_model()).fit()
        assert fake.finished[-1] == code
    Trainer(_cfg(tmp_path / "c", steps=4, wandb="offline"), ToyTask(), *_toy_model()).fit()
    assert fake.finished == [130, 1, 0]


def test_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5, wandb="offline", wandb_group="abl",
               wandb_tags=("x",), wandb_entity="me", run_name="toy")  # fmt: skip
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=5)  # stopped after its checkpoint
    Trainer(dataclasses.replace(cfg), ToyTask(), *_toy_model(), resume=True).fit()
    first, second = fake.inits
    assert first["id"] == second["id"] == (tmp_path / "run" / "wandb_run_id").read_text().strip()
    assert second["resume"] == "allow" and first["group"] == "abl" and first["tags"] == ["x"]
    assert first["entity"] == "me" and first["name"] == "toy" and first["mode"] == "offline"
    assert first["config"]["train"]["comera"]["gamma"] == cfg.comera.gamma


def test_a_run_opens_one_wandb_run_however_its_fits_are_called(tmp_path, monkeypatch):
    """``fit(until=0)`` then ``fit()`` took the second for a fresh start: a second wandb
    run, the id file and config.json written again. A resume of a finished run opened
    its wandb run again, with nothing to log, only to mark it finished once more."""
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path, steps=10, wandb="offline")
    trainer = Trainer(cfg, ToyTask(), *_toy_model())
    trainer.fit(until=0)
    trainer.fit()
    assert [kw["resume"] for kw in fake.inits] == [None, "allow"]
    assert fake.inits[0]["id"] == fake.inits[1]["id"]
    assert fake.logged == [5, 10] and fake.finished == [0, 0]
    Trainer(dataclasses.replace(cfg), ToyTask(), *_toy_model(), resume=True).fit()
    assert len(fake.inits) == 2 and fake.finished == [0, 0]  # a finished run: not reopened


def test_a_resumed_online_run_sends_wandb_only_the_steps_it_lacks(tmp_path, monkeypatch):
    """A resume trains the steps after its checkpoint again; an online wandb run already
    has those it logged before the stop, and dropped each again with a warning. The steps
    from the server's next one on are sent; metrics.jsonl keeps every row."""
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5, log_every=1, wandb="online")
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=5)
    fake.init = lambda **kw: types.SimpleNamespace(
        step=8, log=lambda row, step: fake.logged.append(step), finish=lambda exit_code=0: None
    )
    fake.logged.clear()
    Trainer(dataclasses.replace(cfg), ToyTask(), *_toy_model(), resume=True).fit()
    assert fake.logged == [8, 9, 10]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == list(range(1, 11))


def test_a_wandb_that_cannot_start_is_one_line_and_the_run_resumes(tmp_path, monkeypatch,
                                                                    capsys):  # fmt: skip
    """``--wandb online`` with no login: wandb raises its own error at init; the command
    says what to do in one line (exit 2), and the run goes on with ``--resume``."""
    import wandb

    def refuse(**kw):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", refuse)
    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir), "--wandb", "online"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    err = [line for line in err.splitlines() if ": error: " in line]  # after the model line
    assert len(err) == 1 and "No API key configured" in err[0] and "--wandb offline" in err[0]
    assert mnli.main(["--resume", str(run_dir), "--no-progress", "--wandb", "disabled"]) == 0


def test_a_wandb_server_that_never_answers_is_not_a_login_problem(tmp_path, monkeypatch):
    """With a key set and no server reachable, wandb gives up after its init timeout; the
    advice was to log in. A wandb that is installed but does not import was a traceback."""
    import wandb

    from comera.errors import ConfigError
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    def timed_out(**kw):
        raise wandb.errors.CommError("Run initialization has timed out after 90.0 sec.")

    monkeypatch.setattr(wandb, "init", timed_out)
    cfg = _cfg(tmp_path, steps=2, wandb="online")
    with pytest.raises(ConfigError, match=r"timed out .*; check the network \(or WANDB_BASE_"):
        Trainer(cfg, ToyTask(), *_toy_model()).fit()

    def bad_key(**kw):  # a CommError too, in wandb's classes
        raise wandb.errors.AuthenticationError("Failed to verify credentials: 401")

    monkeypatch.setattr(wandb, "init", bad_key)
    with pytest.raises(ConfigError, match=r"401\); log in \(wandb login, or WANDB_API_KEY\)"):
        Trainer(_cfg(tmp_path / "key", steps=2, wandb="online"), ToyTask(), *_toy_model()).fit()
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path / "broken", steps=2, wandb="offline")
    with pytest.raises(ConfigError, match=r"installed but does not import \(ModuleNotFoundError: .*"
                       r"--wandb disabled, and go on with --resume"):  # fmt: skip
        Trainer(cfg, ToyTask(), *_toy_model()).fit()


def test_a_bad_wandb_mode_variable_is_not_what_wandb_reads(tmp_path, monkeypatch):
    """``WANDB_MODE=junk`` (or ``Offline``): the note said "using offline", then wandb read
    the variable itself and failed with a pydantic traceback, --wandb offline or not. The
    resolved mode now stands in for it while wandb starts; the variable is put back. A bad
    value with wandb missing is the missing package's note, not an import error."""
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake, seen = _FakeWandb(), []
    init = fake.init
    fake.init = lambda **kw: seen.append(os.environ.get("WANDB_MODE")) or init(**kw)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for env, flag in (("junk", None), ("Offline", None), ("junk", "offline")):
        monkeypatch.setenv("WANDB_MODE", env)
        cfg = _cfg(tmp_path / f"{env}{flag}", steps=2, wandb=flag)
        Trainer(cfg, ToyTask(), *_toy_model()).fit()
        assert seen[-1] == fake.inits[-1]["mode"] == "offline"
        assert os.environ["WANDB_MODE"] == env
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    mode, note = resolve_wandb_mode(None)
    assert mode == "disabled" and "not installed" in note


def test_damaged_run_records_are_refused_before_a_resume_trains(tmp_path, monkeypatch):
    """Found on resume, each in one line naming the file, before a step is trained: a
    metrics file with a row that is not one (a list, a text step) or a folder in its
    place, a ranks.json that is not JSON (it failed at the run's last step, losing the
    final checkpoint), and a wandb_run_id that cannot be an id. A metrics line cut short
    by a kill is still taken."""
    from comera.errors import CheckpointError
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5, wandb="offline")
    Trainer(dataclasses.replace(cfg, steps=10), ToyTask(), *_toy_model()).fit(until=5)
    run = tmp_path / "run"
    metrics, ranks, run_id = (run / n for n in ("metrics.jsonl", "ranks.json", "wandb_run_id"))
    good = {p: p.read_bytes() for p in (metrics, ranks, run_id)}
    for path, text, said in [
        (metrics, b'[1, 2]\n{"step": 5}\n', r"metrics.jsonl line 1 is not a metrics row"),
        (metrics, b'{"step": "x"}\n{"step": 5}\n', r"line 1 is not a metrics row"),
        (metrics, b"\xff\xfe\n", r"metrics.jsonl is unreadable"),
        (ranks, b"garbage", r"ranks.json is damaged"),
        (ranks, b"[1, 2]", r"ranks.json is damaged \(not a JSON object\)"),
        (run_id, b"ab/cd\n", r"wandb_run_id holds 'ab/cd', not a wandb run id"),
        (run_id, b"x" * 300, r"wandb_run_id holds 'x+', not a wandb run id"),
        (run_id, b"\xff\xfe", r"wandb_run_id holds .*not a wandb run id"),
    ]:
        path.write_bytes(text)
        with pytest.raises(CheckpointError, match=said):
            Trainer(cfg, ToyTask(), *_toy_model(), resume=True)
        path.write_bytes(good[path])
    metrics.unlink()
    metrics.mkdir()
    with pytest.raises(CheckpointError, match="metrics.jsonl is not a file"):
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)
    metrics.rmdir()
    run_id.write_bytes(b"ab/cd\n")  # read only to log to wandb: not when it is disabled
    Trainer(dataclasses.replace(cfg, wandb="disabled"), ToyTask(), *_toy_model(), resume=True)
    run_id.write_bytes(good[run_id])
    metrics.write_bytes(good[metrics] + b'{"step": 6, "lo')  # a kill mid-line: taken
    Trainer(cfg, ToyTask(), *_toy_model(), resume=True).fit()
    assert [r["step"] for r in cli.read_metrics(metrics)][-1] == 10


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_stopped_run_closes_its_logs_and_says_how_to_go_on(tmp_path, monkeypatch, capsys,
                                                              signum, request):  # fmt: skip
    """SIGTERM (a scheduler's stop) killed the run before wandb.finish, losing every row
    not yet flushed; SIGINT printed a 20-line traceback. Both now close the logs and end
    in one line naming the resume command, with the shell's status for the signal; the
    old SIGTERM handler is back afterwards. A run stopped before its first checkpoint
    (SIGINT's case here) is not told to continue from one: its resume starts over."""
    from comera.train import Trainer

    # a shell's background job starts with SIGINT ignored, and Python then never raises
    # KeyboardInterrupt for it (the run is not stopped, by the user's choice): Ctrl-C's own
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    request.addfinalizer(lambda: signal.signal(signal.SIGINT, old or signal.SIG_DFL))
    fake, finished = _FakeWandb(), []
    init = fake.init
    fake.init = lambda **kw: types.SimpleNamespace(
        **{**vars(init(**kw)), "finish": lambda exit_code=0: finished.append(exit_code)}
    )
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    step = Trainer.train_step

    def train_step(self, *batches):
        if self.step == 2:
            os.kill(os.getpid(), signum)
        return step(self, *batches)

    monkeypatch.setattr(Trainer, "train_step", train_step)
    run_dir = tmp_path / "run"
    argv = [*FAST, "--set", "train.steps=6", "--set", "train.log_every=1", "--wandb", "offline"]
    argv += ["--run-dir", str(run_dir)]
    saved = signum == signal.SIGTERM
    argv += ["--set", "train.checkpoint_every=1"] if saved else []
    assert mnli.main(argv) == 128 + signum
    err = [ln for ln in capsys.readouterr().err.splitlines() if "stopped" in ln]
    name = signal.Signals(signum).name
    go_on = ("continue from its last checkpoint" if saved
             else "no checkpoint was written yet; start it over from its saved config")  # fmt: skip
    assert err == [
        f"python -m experiments.mnli: stopped by {name} at step 2; {go_on} with "
        f"python -m experiments.mnli --resume {run_dir}"
    ]
    assert finished == [128 + signum] and fake.logged[-1] == 2  # wandb: failed, not done
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    assert issubclass(cli.Interrupted, KeyboardInterrupt)  # Python callers stop as before
    if saved:  # resumed in another step mode and stopped again: the line repeats the mode
        # (a plain --resume goes back to config.json's eager steps)
        # (a run saved before train.step_mode existed: a plain resume takes the default)
        record = json.loads((run_dir / "config.json").read_text())
        del record["train"]["step_mode"]
        (run_dir / "config.json").write_text(json.dumps(record))
        again = ["--resume", str(run_dir), "--step-mode", "sync_free", "--no-progress"]
        assert mnli.main(again) == 128 + signum
        err = [ln for ln in capsys.readouterr().err.splitlines() if "stopped" in ln]
        assert err[-1].endswith(f"--resume {run_dir} --step-mode sync_free"), err


def test_a_process_of_the_run_lost_mid_run_is_one_line(tmp_path, monkeypatch, capsys):
    """Rank 0 killed (the OOM killer) left the others a 37-line gloo traceback from the
    all-reduce, with no word of a resume; a bug's RuntimeError keeps its traceback."""
    from comera.train import Trainer

    gloo = ("[/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error "
            "[127.0.0.1]:11653: Connection reset by peer. This is typically caused by a remote "
            "worker hanging or bugs in the app")  # fmt: skip

    def raising(text):
        def train_step(self, *batches):
            if self.step == 2:
                self.world = 2  # as under torchrun: the collective's failure is a peer's
                raise RuntimeError(text)
            return step(self, *batches)

        return train_step

    step = Trainer.train_step
    run_dir = tmp_path / "run"
    argv = [*FAST, "--set", "train.steps=6", "--set", "train.checkpoint_every=1"]
    monkeypatch.setattr(Trainer, "train_step", raising(gloo))
    assert mnli.main([*argv, "--run-dir", str(run_dir)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (
        "python -m experiments.mnli: stopped at step 2: another process of this run failed "
        "(Read error [127.0.0.1]:11653: Connection reset by peer); continue from its last "
        f"checkpoint with python -m experiments.mnli --resume {run_dir}"
    )
    monkeypatch.setattr(Trainer, "train_step", raising("a bug"))
    with pytest.raises(RuntimeError, match="a bug"):
        mnli.main([*argv, "--run-dir", str(tmp_path / "other")])


def test_a_wandb_folder_it_cannot_write_is_named_as_such(tmp_path, monkeypatch):
    """An OSError from wandb (a full disk, a read-only folder) was told to fix a wandb
    setting; it names the folder."""
    from comera.errors import ConfigError
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    fake = _FakeWandb()

    def refuse(**kw):
        raise OSError(30, "Read-only file system")

    fake.init = refuse
    monkeypatch.setitem(sys.modules, "wandb", fake)
    fake.errors = types.SimpleNamespace(Error=RuntimeError)
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    cfg = _cfg(tmp_path, steps=2, wandb="offline")
    with pytest.raises(ConfigError, match=r"Read-only file system.*make .*wandb writable"):
        Trainer(cfg, ToyTask(), *_toy_model()).fit()


def test_bad_wandb_tags_are_refused_when_wandb_starts(tmp_path, monkeypatch):
    """wandb refused a tag over 64 characters (or empty) with a pydantic traceback after
    the run dir was written; it is one line when the run log starts. With wandb disabled
    the tags are not used, so nothing is refused (nor an old run's resume)."""
    from comera.errors import ConfigError
    from comera.train import Trainer
    from tests.train_helpers import ToyTask, _cfg, _toy_model

    monkeypatch.setitem(sys.modules, "wandb", _FakeWandb())
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object())
    for tags in (("",), ("x" * 65,)):
        cfg = _cfg(tmp_path / str(len(tags[0])), steps=2, wandb="offline", wandb_tags=tags)
        with pytest.raises(ConfigError, match="train.wandb_tags: each tag must be 1 to 64"):
            Trainer(cfg, ToyTask(), *_toy_model()).fit()
    cfg = _cfg(tmp_path / "off", steps=2, wandb="disabled", wandb_tags=("x" * 65,))
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert TrainConfig(steps=1, run_dir="x", wandb_tags="ab").wandb_tags == ("ab",)


def test_trainconfig_accepts_none_wandb():
    assert TrainConfig(steps=1, run_dir="x").wandb is None
    assert C.LayerPlans().for_layer("anything") is None


def test_a_device_torch_cannot_parse_is_one_line(capsys):
    """``--set train.device=gpu`` (or ``--device gpu``) is refused with the field named,
    before anything runs, rather than a traceback from ``torch.device``."""
    assert mnli.main(["--preset", "smoke", "--set", "train.device=gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "TrainConfig.device='gpu' is not a torch device" in err[0]


def test_a_cuda_device_this_machine_lacks_is_one_line(tmp_path, capsys, monkeypatch):
    """``--device cuda`` where torch sees no CUDA device (forced here, so the test runs on
    GPU machines too) is refused before any run dir is made or any bench worker starts,
    instead of a traceback at the first ``.to()`` or one failed worker per point."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    run_dir = tmp_path / "run"
    argv = ["--preset", "smoke", "--device", "cuda", "--run-dir", str(run_dir)]
    assert mnli.main([*argv, "--wandb", "disabled"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device cuda: no CUDA device here" in err[0], err
    assert "use --device cpu" in err[0] and not run_dir.exists()

    def no_bench(args):
        raise AssertionError("the benchmark started")

    exp = dataclasses.replace(mnli.EXPERIMENT, bench=no_bench)
    assert cli.main(exp, ["--bench", "--device", "cuda:0"]) == 2
    assert "--device cuda:0: no CUDA device here" in capsys.readouterr().err
    assert mnli.main(["--preset", "smoke", "--set", "train.device=cuda", "--run-dir",
                      str(run_dir)]) == 2  # fmt: skip
    assert "train.device cuda: no CUDA device here" in capsys.readouterr().err


def test_bench_device_errors_are_one_line(capsys, monkeypatch):
    """``--bench --device gpu`` (not a torch device) is one line, and the DLRM and CodeBERT
    step benches, which run on the CPU, refuse a CUDA device rather than ignore it."""
    from experiments.codebert import experiment as codebert
    from experiments.dlrm import experiment as dlrm

    assert mnli.main(["--bench", "--device", "gpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--device 'gpu' is not a torch device" in err[0], err
    monkeypatch.setattr(cli, "check_device", lambda *a: None)  # as if CUDA were here
    for exp in (dlrm, codebert):  # --bench forwards to the benchmark, after one notice line
        assert exp.main(["--bench", "--device", "cuda"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 2 and "has moved to `python -m benchmarks." in err[0], err
        assert "step bench runs on the CPU; drop --device" in err[1], err


def test_the_record_names_the_preset_not_the_run(tmp_path, capsys):
    """``config.json``'s ``preset`` (the MNLI report's "Runs:") is the preset's name, not
    the run name ``--wandb-name`` sets; a checkpointless run started over keeps it."""
    import shutil

    run_dir = tmp_path / "run"
    assert mnli.main([*FAST, "--run-dir", str(run_dir), "--wandb-name", "my-try"]) == 0
    assert json.loads((run_dir / "config.json").read_text())["preset"] == "smoke"
    shutil.rmtree(run_dir / "checkpoints")
    assert mnli.main(["--resume", str(run_dir)]) == 0
    assert json.loads((run_dir / "config.json").read_text())["preset"] == "smoke"
    # a resume's record (what its checkpoints and wandb keep) named the run instead
    ap = cli.build_parser(mnli.EXPERIMENT)
    cfg = cli.resolve_config(mnli.EXPERIMENT, ap.parse_args(["--resume", str(run_dir)]), ap)
    assert cli.prepare(mnli.EXPERIMENT, cfg, resume=True).trainer.config_dict["preset"] == "smoke"


def test_cache_dirs_expand_home(tmp_path, monkeypatch) -> None:
    """``--cache-dir ~/x`` from a config file, or ``COMERA_CACHE=~/c`` set where no shell
    expands it, means the home folder, not a folder named ``~`` in the cwd."""
    from experiments.cache import cache_root

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root("plans", "~/x") == tmp_path / "home" / "x"
    monkeypatch.setenv("COMERA_CACHE", "~/c")
    assert cache_root("plans") == tmp_path / "home" / "c" / "plans"


def test_a_run_saved_with_an_empty_run_dir_still_resumes(tmp_path):
    """An old run could be saved with run_dir "" (the folder check then took it); the
    saved config is read with the folder --resume names, so the new check of an empty
    run_dir does not refuse it."""
    run = tmp_path / "run"
    assert mnli.main([*FAST, "--set", "train.checkpoint_every=2", "--run-dir", str(run)]) == 0
    saved = json.loads((run / "config.json").read_text())
    saved["train"]["run_dir"] = ""
    (run / "config.json").write_text(json.dumps(saved))
    assert mnli.main(["--resume", str(run), "--no-progress", "--wandb", "disabled"]) == 0


def test_opt_einsum_plans_under_compile_are_noted(monkeypatch, capsys):
    """--plan dp with --step-mode compile trained eager's values, but Dynamo fell back to
    eager for those layers' frames (opt_einsum's caches hit its recompile limit): a slower
    step than the one graph the docs promise, without a word."""

    def stop(*args, **kwargs):
        raise cli.CLIError("stopped before building")

    monkeypatch.setattr(cli, "prepare", stop)
    argv = ["--preset", "smoke", "--step-mode", "compile", "--plan", "dp", "--plan-for",
            "layers.0.q=greedy", "--plan-for", "layers.1.q=dense"]  # fmt: skip
    assert mnli.main(argv) == 2
    err = capsys.readouterr().err
    assert ("note: --step-mode compile: --plan dp, --plan-for layers.0.q=greedy cannot be "
            "traced") in err  # fmt: skip
    assert mnli.main(["--preset", "smoke", "--step-mode", "compile", "--plan", "auto"]) == 2
    assert "cannot be traced" not in capsys.readouterr().err


def test_a_resume_refusal_drops_only_the_flags_that_may_not_change(tmp_path) -> None:
    """DLRM's ``--data`` may give a moved file on resume; beside a flag that may not
    change (``--max-ind-range``) the refusal said to drop both."""
    from experiments.dlrm.experiment import EXPERIMENT as DLRM

    (tmp_path / "config.json").write_text(json.dumps({"experiment": "dlrm"}))
    ap = cli.build_parser(DLRM)
    for extra, drop in [(["--max-ind-range", "50"], "drop --max-ind-range ("),
                        (["--steps", "3"], "drop --steps (")]:  # fmt: skip
        args = ap.parse_args(["--resume", str(tmp_path), "--data", "moved.txt", *extra])
        with pytest.raises(cli.CLIError) as e:
            cli.resolve_config(DLRM, args, ap)
        assert drop in str(e.value) and "(or the flags that set them)" in str(e.value)
        assert "data.path" in str(e.value).partition("only")[2]


def test_ctrl_c_before_training_is_one_line(tmp_path, monkeypatch, capsys) -> None:
    """Ctrl-C while the data was tokenized printed KeyboardInterrupt's traceback; once
    training runs it was already one line."""

    def stopped(*args, **kw):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "prepare", stopped)
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "r")]) == 130
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m experiments.mnli: stopped by SIGINT before training started; "
                   "nothing was trained"]  # fmt: skip
    monkeypatch.setenv("RANK", "1")  # under torchrun: said by rank 0 alone
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "r")]) == 130
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")

    def terminated(*args, **kw):  # SIGTERM (a scheduler's stop) there: exit 143, no word
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends

    monkeypatch.setattr(cli, "prepare", terminated)
    before = signal.getsignal(signal.SIGTERM)
    assert mnli.main([*FAST, "--run-dir", str(tmp_path / "r")]) == 143
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["python -m experiments.mnli: stopped by SIGTERM before training started; "
                   "nothing was trained"]  # fmt: skip
    assert signal.getsignal(signal.SIGTERM) is before  # the handler was put back


def test_a_resume_compares_saved_info_by_the_entries_both_hold(tmp_path) -> None:
    """A transformers version that adds a key, even inside a nested setting (rope_scaling's
    rope_type), must not refuse a resume; a changed value, at any depth, is named."""
    (tmp_path / "config.json").write_text(json.dumps(
        {"m": {"heads": 4, "rope": {"factor": 2.0}, "gone": 1}, "n": 3}))  # fmt: skip
    same = {"m": {"heads": 4, "rope": {"factor": 2.0, "rope_type": "linear"}, "new": 0}, "n": 3}
    cli.check_same_info(tmp_path, same, {"m": "fix m", "n": "fix n"})
    with pytest.raises(cli.CLIError, match=r"m differs from the run's \(rope.factor: 2.0 "
                       r"saved, 4.0 now\); fix m"):  # fmt: skip
        cli.check_same_info(tmp_path, {**same, "m": {"heads": 4, "rope": {"factor": 4.0}}},
                            {"m": "fix m"})  # fmt: skip
    with pytest.raises(cli.CLIError, match=r"n differs from the run's \(3 saved, 5 now\)"):
        cli.check_same_info(tmp_path, {**same, "n": 5}, {"n": "fix n"})
    cli.check_same_info(tmp_path, {"other": 1}, {"other": "x"})  # not saved: an older run
