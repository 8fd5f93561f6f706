"""The trainer's parts: stage controller, checkpoints kept and refused, compaction twins,
late-stage resume, the objective's choices."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch.utils._pytree import tree_flatten

import comera as C
from comera.tensor_train import bond_ranks
from comera.train import CheckpointError, ComeraConfig, Trainer, load_checkpoint
from comera.train.checkpoint import complete_checkpoints
from comera.train.objectives import gate_regularizer
from comera.train.stages import StageController
from comera.tree import compact_tree, prune_tree
from tests.train_helpers import SumCountTask, ToyTask, _cfg, _toy_model


def _leaves(tree):
    return tree_flatten(tree)[0]


def test_stage_controller_events_and_objectives():
    c = ComeraConfig(
        gamma=0.1,
        reg_start_step=2,
        early_steps=6,
        prune_every=3,
        compact_every=4,
        size_objective="paper",
        late_prune="threshold",
    )
    sc = StageController(c, total_steps=8)
    params, state = _toy_model()
    assert sc.stage == "early"
    assert sc.objective(2, 1.0, params, state).param_term is None  # regularizer not yet on
    obj = sc.objective(3, 1.0, params, state)
    assert obj.loss_weight == 1.0 and float(obj.param_term) == pytest.approx(0.1)
    events = {s: sc.events(s) for s in range(1, 9)}
    assert events[3] == ["prune"] and events[4] == ["compact"]
    assert events[6] == ["prune", "transition"] and events[5] == []
    sc.observe(2.0)
    sc.fix_targets(params, state, live=1000, reference=4000, step=6)
    sc.stage = "late"
    assert sc.targets["loss"] == 2.0
    assert sc.targets["size"] == pytest.approx(0.5 * C.param_count(params["lin"]["cores"]))
    late = sc.objective(7, 5.0, params, state)  # loss gap 1.5 > size gap 1.0: loss leads
    assert late.metrics["focus_size"] == 0.0 and late.loss_weight == pytest.approx(1.05 / 2.0)
    assert sc.events(8) == ["final"]
    copy = StageController(c, 8)
    copy.load_state_dict(json.loads(json.dumps(sc.state_dict())))
    assert copy.state_dict() == sc.state_dict()
    assert StageController(ComeraConfig(enabled=False), 5).events(5) == []


def test_an_early_stage_as_long_as_the_run_ends_without_a_late_stage(tmp_path) -> None:
    """``early_steps == steps``: no transition on the last step (its ``final`` would cut
    the model to a late-stage target it never trained for); the run ends in the early
    stage, pruned by threshold only, the same model as with ``early_steps > steps``."""
    c = ComeraConfig(early_steps=8, prune_every=100)
    assert StageController(c, total_steps=8).events(8) == ["final"]
    assert StageController(c, total_steps=9).events(8) == ["transition"]
    ends = {}
    for early in (8, 9):
        cfg = _cfg(tmp_path / str(early), steps=8, comera=ComeraConfig(early_steps=early))
        tr = Trainer(cfg, ToyTask(), *_toy_model())
        tr.fit()
        ends[early] = (tr.stage, C.param_count(tr.params))
    assert ends[8] == ends[9] and ends[8][0] == "early"


def test_l1_regularizer_is_the_sum_of_live_gates():
    params, state = _toy_model()
    n = sum(g.numel() for g in params["lin"]["gates"])
    assert float(gate_regularizer(params, state, "l1")) == pytest.approx(n)
    assert float(gate_regularizer(params, state, "mean")) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="choose 'mean' or 'l1'"):
        gate_regularizer(params, state, "l2")
    with pytest.raises(ValueError, match="regularizer='l2'"):
        ComeraConfig(regularizer="l2")
    with pytest.raises(ValueError, match="prune_rule='norm'"):
        ComeraConfig(prune_rule="norm")


def test_keeps_the_newest_checkpoints_and_names_the_previous_one(tmp_path):
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    kept = complete_checkpoints(cfg.run_dir)
    assert [p.name for p in kept] == ["step_00000015", "step_00000020"]
    (kept[-1] / "model.pt").write_bytes(b"torn")
    with pytest.raises(CheckpointError, match=r"cannot read .*step_00000020.*previous checkpoint "
                       r"is .*step_00000015"):  # fmt: skip
        load_checkpoint(cfg.run_dir)
    assert (kept[-1] / "model.pt").read_bytes() == b"torn"  # nothing deleted
    (kept[-1] / "model.pt").unlink()  # the user moves it away: resume from step 15
    tr = Trainer(cfg, ToyTask(), *_toy_model(), resume=True)
    assert tr.step == 15
    with pytest.raises(CheckpointError, match="steps=20.*steps=21"):
        Trainer(dataclasses.replace(cfg, steps=21), ToyTask(), *_toy_model(), resume=True)
    dense = dataclasses.replace(cfg, comera=dataclasses.replace(cfg.comera, enabled=False))
    with pytest.raises(CheckpointError, match="comera.enabled=True.*comera.enabled=False"):
        Trainer(dense, ToyTask(), *_toy_model(), resume=True)


def test_a_resume_checks_the_eval_data_a_task_names(tmp_path):
    """A task's ``eval_data_id`` rides in the checkpoint: a split of a saved name with
    other examples is refused; a split added, dropped or unnamed (a task without the
    attribute) resumes."""

    def task(ids):
        t = ToyTask()
        if ids is not None:
            t.eval_data_id = ids
        return t

    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, task({"dev": "aaa", "test": "bbb"}), *_toy_model()).fit()
    assert load_checkpoint(cfg.run_dir)["eval_data"] == {"dev": "aaa", "test": "bbb"}
    with pytest.raises(CheckpointError, match="eval split 'test' .*bbb saved, ccc now"):
        Trainer(cfg, task({"dev": "aaa", "test": "ccc"}), *_toy_model(), resume=True)
    for ids in ({"dev": "aaa"}, {"dev": "aaa", "test": "bbb", "new": "x"}, None):
        assert Trainer(cfg, task(ids), *_toy_model(), resume=True).step == 10


def test_a_fresh_run_refuses_a_run_dir_with_checkpoints(tmp_path):
    """A new run in a used run dir would lose its own work: the old run's newer
    checkpoints win the keep-newest rule, so each new one would be deleted at once and a
    resume would load the old model. It is refused, and the old run resumes as before."""
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    with pytest.raises(CheckpointError, match="already holds checkpoints .*step_00000010.*"
                       "resume=True"):  # fmt: skip
        Trainer(cfg, ToyTask(), *_toy_model())
    assert [p.name for p in complete_checkpoints(cfg.run_dir)] == ["step_00000005",
                                                                   "step_00000010"]  # fmt: skip
    assert Trainer(cfg, ToyTask(), *_toy_model(), resume=True).step == 10
    # the keep-newest rule never deletes the checkpoint it has just written
    from comera.train.checkpoint import write_model

    older = Path(cfg.run_dir) / "checkpoints" / "step_00000003"
    older.mkdir()
    write_model(older, {"step": 3}, keep=1)
    assert (older / "model.pt").is_file()


def test_debris_of_a_save_that_died_is_ignored_and_cleaned(tmp_path):
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    it = iter(tr.task.train_iter)
    for _ in range(5):
        tr.train_step(next(it))
        tr._after_step()
    tr.checkpoint()
    torn = Path(cfg.run_dir) / "checkpoints" / "step_00000007"
    torn.mkdir()
    (torn / "data_rank00000.json").write_text("{}")  # rank files but no model file
    assert load_checkpoint(cfg.run_dir)["step"] == 5
    for _ in range(5):
        tr.train_step(next(it))
        tr._after_step()
    tr.checkpoint()
    assert not torn.exists()


def test_compacted_model_steps_like_its_uncompacted_twin(tmp_path):
    """Removing dead ranks changes shapes, not training: one step on the compacted model
    equals one step on the masked twin, compacted afterwards (moments sliced along)."""
    cfg = _cfg(tmp_path, steps=50)
    a = Trainer(cfg, SumCountTask(), *_toy_model())
    it = iter(a.task.train_iter)
    for _ in range(15):
        a.train_step(next(it))
    with torch.no_grad():
        a.params["lin"]["gates"][1][[0, 3]] = 0.0
    a.prune()
    b = Trainer(
        dataclasses.replace(cfg, run_dir=str(tmp_path / "b")), SumCountTask(), *_toy_model()
    )
    b.params = {k: v for k, v in a.params.items()}
    b.params = torch.utils._pytree.tree_map(
        lambda t: t.detach().clone().requires_grad_(True), a.params
    )
    b.state = torch.utils._pytree.tree_map(torch.clone, a.state)
    b.opt = {**a.opt, "m": torch.utils._pytree.tree_map(torch.clone, a.opt["m"]),
             "v": torch.utils._pytree.tree_map(torch.clone, a.opt["v"])}  # fmt: skip
    b.step = a.step
    a.compact()
    assert bond_ranks(a.params["lin"])[1] == 4 and bond_ranks(b.params["lin"])[1] == 6
    batch = next(it)
    a.train_step(batch)
    b.train_step(batch)
    params, _, m, v = compact_tree(b.params, b.state, b.opt["m"], b.opt["v"])
    for x, y in zip(
        _leaves([a.params, a.opt["m"], a.opt["v"]]), _leaves([params, m, v]), strict=True
    ):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-7)


def test_resume_from_a_compacted_late_stage_checkpoint_is_bit_identical(tmp_path):
    comera = ComeraConfig(gamma=0.5, tau=0.05, early_steps=25, prune_every=5, compact_every=5)

    def make(d, **kw):
        return _cfg(tmp_path / d, steps=45, comera=comera, checkpoint_every=30, **kw)

    full = Trainer(make("full"), ToyTask(noise=0.1), *_toy_model())
    full.fit()
    part = Trainer(make("part"), ToyTask(noise=0.1), *_toy_model())
    it = iter(part.task.train_iter)
    while part.step < 30:
        part.train_step(next(it))
        part._after_step()
    part.checkpoint()
    ckpt = load_checkpoint(tmp_path / "part" / "run")
    assert ckpt["stages"]["stage"] == "late" and ckpt["stages"]["targets"]["size"] > 0
    assert bond_ranks(ckpt["params"]["lin"]) != [4, 6, 4]  # compacted before the save
    assert ckpt["opt"]["m"]["lin"]["cores"][1].shape == ckpt["params"]["lin"]["cores"][1].shape
    resumed = Trainer(make("part"), ToyTask(noise=0.1), *_toy_model(), resume=True)
    assert resumed.stage == "late" and resumed.targets == part.targets
    resumed.fit()
    for x, y in zip(
        _leaves([full.params, full.opt["m"]]),
        _leaves([resumed.params, resumed.opt["m"]]),
        strict=True,
    ):
        assert torch.equal(x, y)
    assert resumed.targets == full.targets


def test_prune_rule_reaches_the_trainer(tmp_path):
    """With weight on a rank hidden behind a tiny gate, the contribution rule keeps it; the
    trainer's prune is ``prune_tree`` with the configured rule, and neither touches the
    state it was given."""
    params, state = _toy_model()
    with torch.no_grad():
        params["lin"]["gates"][1][0] *= 1e-3
        params["lin"]["cores"][2][0] /= 1e-3
    for rule, alive in (("gate", 5), ("contribution", 6)):
        comera = ComeraConfig(tau=0.01, prune_rule=rule, early_steps=10)
        tr = Trainer(_cfg(tmp_path / rule, comera=comera), ToyTask(), params, state)
        tr.prune()
        assert int(tr.state["lin"]["masks"][1].sum()) == alive
        pruned = prune_tree(params, state, 0.01, rule=rule)
        assert [m.tolist() for m in pruned["lin"]["masks"]] == [
            m.tolist() for m in tr.state["lin"]["masks"]
        ]
        assert pruned["lin"]["masks"][1].tolist() == [rule == "contribution"] + [True] * 5
    assert all(bool(m.all()) for m in state["lin"]["masks"])  # the input state is unchanged
    with pytest.raises(ValueError, match="norm"):
        prune_tree(params, state, 0.01, rule="norm")


def test_compaction_raises_an_event_for_the_task(tmp_path):
    """A task can rebuild shape-dependent things (compiled functions, CUDA graphs)."""
    seen = []

    class Rebuilding(ToyTask):
        def on_compaction(self, params, state):
            seen.append(bond_ranks(params["lin"]))

    tr = Trainer(_cfg(tmp_path, steps=45), Rebuilding(), *_toy_model())
    extra = []
    tr.on_compact.append(lambda t: extra.append(t.step))
    tr.fit()
    assert len(seen) == len(extra) >= 2  # the stage boundary and the end
    assert seen[-1] == bond_ranks(tr.params["lin"]) and extra[-1] == 45


def test_stale_rank_files_of_a_larger_world_are_ignored(tmp_path):
    """A save that died at world 2 left rank-1 files in a folder a world-1 run reuses."""
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    newest = complete_checkpoints(cfg.run_dir)[-1]
    stale = (newest / "data_rank00000.json").read_text().replace('"rank": 0', '"rank": 1')
    (newest / "data_rank00001.json").write_text(stale.replace('"step": 10', '"step": 3'))
    assert Trainer(cfg, ToyTask(), *_toy_model(), resume=True).step == 10


class _AliasTask:
    """Autograd returns a broadcast view for ``c`` and one tensor for both ``a`` and ``b``."""

    train_iter = iter(())

    def loss(self, params, state, batch, *, train=True):
        return params["c"].sum() + (params["a"] + params["b"]).pow(2).sum(), 1, {}

    def evaluate(self, params, state):
        return {}


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_aliased_gradients_are_copied_before_in_place_updates(tmp_path, optimizer):
    from comera.train import ComeraConfig, TrainConfig, Trainer
    from comera.train.optim import SGDConfig

    params = {"a": torch.ones(3), "b": torch.full((3,), 2.0), "c": torch.zeros(4)}
    cfg = TrainConfig(
        steps=3,
        run_dir=str(tmp_path),
        optimizer=optimizer,
        sgd=SGDConfig(lr=0.1),
        comera=ComeraConfig(enabled=False),
        grad_clip=100.0,  # active: scales in place
        wandb="disabled",
        progress=False,
    )
    trainer = Trainer(cfg, _AliasTask(), params, {})
    metrics = trainer.train_step(None, None)  # two micro-batches: accumulation in place too
    assert metrics["grad_norm"] == pytest.approx(220**0.5)  # (6, 6, 6), (6, 6, 6), (1,)*4
    if optimizer == "sgd":
        assert trainer.params["a"].tolist() == pytest.approx([0.4] * 3)
        assert trainer.params["b"].tolist() == pytest.approx([1.4] * 3)


def test_benchmark_baseline_holds_the_modules_a_step_imports():
    """A recomputing step's first ``checkpoint`` call imports ``torch._dynamo`` (~70 MB
    resident). Above ``baseline_rss_mb`` that import is not charged to the step; above a
    plain ``rss_mb`` it is, which is what the benches' peaks would have counted once
    ``import comera`` stopped loading dynamo. (What else a first step loads, 9-32 MB in a
    fresh environment, is charged either way, as before.)"""
    import subprocess
    import sys

    code = (
        "import torch, torch.utils.checkpoint as ckpt\n"
        "from comera.train.measures import {fn} as base_fn, rss_mb\n"
        "base = base_fn()\n"
        "x = torch.ones(4, requires_grad=True)\n"
        "ckpt.checkpoint(torch.sin, x, use_reentrant=False).sum().backward()\n"
        "print(rss_mb() - base)\n"
    )
    added = {}
    for fn in ("baseline_rss_mb", "rss_mb"):
        out = subprocess.run([sys.executable, "-c", code.format(fn=fn)], capture_output=True,
                             text=True, check=True)  # fmt: skip
        added[fn] = float(out.stdout.strip())
    assert added["rss_mb"] - added["baseline_rss_mb"] > 40, added  # dynamo: ~70 MB


class _StrictIter:
    """A resumable stream that refuses a damaged position, as ``EpochCursor`` does."""

    def __init__(self, inner):
        self.inner = inner

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.inner)

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, s):
        if not isinstance(s, dict) or not isinstance(s.get("i"), int):
            raise CheckpointError("the saved position lacks i; it is damaged")
        self.inner.load_state_dict(s)


class _CheckingIter(_StrictIter):
    """The same, refusing a damaged position already in ``check_data`` (as
    ``EpochCursor``), which the trainer asks before the model's shapes are compared."""

    def check_data(self, s):
        if not isinstance(s, dict) or not isinstance(s.get("i"), int):
            raise CheckpointError("the saved position lacks i; it is damaged")


def _strict_task(kind: type = _StrictIter) -> ToyTask:
    task = ToyTask()
    task.train_iter = kind(task.train_iter)
    return task


def _damage_rng(ckpt: Path) -> None:
    rank = torch.load(ckpt / "rank00000.pt", weights_only=False)
    torch.save(rank | {"rng": {}}, ckpt / "rank00000.pt")


def _damage_position(ckpt: Path) -> None:
    data = json.loads((ckpt / "data_rank00000.json").read_text())
    (ckpt / "data_rank00000.json").write_text(json.dumps(data | {"state": {}}))


@pytest.mark.parametrize(
    "damage,message,kind",
    [(_damage_rng, "rank00000.pt lacks its step or RNG state", _StrictIter),
     (_damage_position, "the saved position lacks i", _StrictIter),
     # refused by check_data, asked first: it named no previous checkpoint (review)
     (_damage_position, "the saved position lacks i", _CheckingIter)],
)  # fmt: skip
def test_a_damaged_rank_file_names_the_previous_checkpoint(tmp_path, damage, message, kind):
    # both loaded, then failed in the resume with a traceback (KeyError: 'torch', or the
    # iterator's own), the RNG one after the model was restored
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, _strict_task(kind), *_toy_model()).fit()
    newest = complete_checkpoints(cfg.run_dir)[-1]
    damage(newest)
    with pytest.raises(
        CheckpointError, match=rf"{message}.*previous checkpoint is .*step_00000005"
    ):
        Trainer(cfg, _strict_task(kind), *_toy_model(), resume=True)


def test_a_copy_of_a_rank_file_beside_it_is_ignored(tmp_path):
    # a file manager's copy matched data_rank*.json and its name failed int()
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    newest = complete_checkpoints(cfg.run_dir)[-1]
    text = (newest / "data_rank00000.json").read_text()
    (newest / "data_rank00000 (copy).json").write_text(text)
    assert Trainer(cfg, ToyTask(), *_toy_model(), resume=True).step == 10


def test_a_checkpoint_that_cannot_be_written_is_one_error_and_leaves_no_debris(
    tmp_path, monkeypatch
):
    # a full disk was torch's "unexpected pos" RuntimeError with model.pt.tmp left behind
    import errno

    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("step") == 10 and "params" in obj:
            f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError, match=r"cannot write checkpoint .*step_00000010 \(No "
                       r"space left on device\); the last complete checkpoint is "
                       r".*step_00000005: free space"):  # fmt: skip
        Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert not list(Path(cfg.run_dir).rglob("*.tmp"))
    monkeypatch.setattr(torch, "save", real_save)
    assert Trainer(cfg, ToyTask(), *_toy_model(), resume=True).step == 5


def test_an_old_checkpoint_stops_counting_before_its_files_go(tmp_path, monkeypatch):
    # deleted in directory order, a folder killed half-way could keep model.pt (complete,
    # to every later resume) without its rank files
    import comera.train.checkpoint as ckpt_module

    seen = []
    real = ckpt_module.shutil.rmtree

    def rmtree(path, *args, **kwargs):
        seen.append((Path(path).name, (Path(path) / "model.pt").exists()))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(ckpt_module.shutil, "rmtree", rmtree)
    cfg = _cfg(tmp_path, steps=15, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert seen == [("step_00000005", False)]


def test_an_old_checkpoint_that_cannot_be_deleted_is_kept(tmp_path, monkeypatch):
    # a folder the user made read-only to keep it stopped the run, blamed on the new
    # checkpoint (complete on disk); it stays whole, not stripped of its rank files
    import errno

    real = Path.unlink

    def unlink(self, *args, **kwargs):
        if self.parent.name == "step_00000005":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Path, "unlink", unlink)
    cfg = _cfg(tmp_path, steps=15, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert [p.name for p in complete_checkpoints(cfg.run_dir)] == [
        "step_00000005", "step_00000010", "step_00000015"
    ]  # fmt: skip
    kept = Path(cfg.run_dir) / "checkpoints" / "step_00000005"
    assert (kept / "data_rank00000.json").is_file() and (kept / "rank00000.pt").is_file()
