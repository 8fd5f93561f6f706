"""CoMERA training: objectives, pruning/compaction during training, checkpoints, DDP."""

import dataclasses
import enum
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import comera as C
from comera.tensor_train import bond_ranks
from comera.train import (
    CheckpointError,
    ComeraConfig,
    NonFiniteLoss,
    TrainConfig,
    Trainer,
    load_checkpoint,
)
from comera.train.measures import lr_scale, model_size
from comera.train.objectives import gate_regularizer, late_weights, size_surrogate
from comera.train.optim import AdamWConfig, adamw_init, adamw_step
from comera.tree import compact_tree, prune_tree
from tests.train_helpers import ToyTask, _cfg, _Iter, _toy_model, free_port

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- objectives


def test_regularizer_and_size_surrogate_match_formulas():
    params, state = _toy_model()
    assert float(gate_regularizer(params, state)) == pytest.approx(1.0)
    # all gates one: the surrogate is the stored core parameter count
    assert float(size_surrogate(params, state)) == C.param_count(params["lin"]["cores"])
    state = prune_tree(params, {"lin": {"masks": [m.clone() for m in state["lin"]["masks"]]}}, 0.5)
    state["lin"]["masks"][1][:3] = False
    live = [int(m.sum()) for m in state["lin"]["masks"]]
    full = [1, *live, 1]
    expected = sum(full[k] * 4 * full[k + 1] for k in range(4))
    assert float(size_surrogate(params, state)) == expected
    # dead gates do not count in the mean
    params["lin"]["gates"][1][:3] = 100.0
    assert float(gate_regularizer(params, state)) == pytest.approx(1.0)


def test_late_weights_follow_the_objective_further_from_target():
    w = late_weights(loss=2.0, size=100.0, loss_target=1.0, size_target=90.0, rho=0.1)
    assert w.focus == "loss" and w.loss == pytest.approx(1.1) and w.size == pytest.approx(0.1 / 90)
    w = late_weights(loss=1.05, size=200.0, loss_target=1.0, size_target=100.0, rho=0.1)
    assert w.focus == "size" and w.size == pytest.approx(1.1 / 100)
    with pytest.raises(ValueError, match="targets must be > 0"):
        late_weights(1.0, 1.0, 0.0, 1.0, 0.1)


def test_optimizer_state_follows_compaction_rank_for_rank():
    params, state = _toy_model()
    opt = adamw_init(params)
    for leaf, m in zip(params["lin"]["cores"], opt["m"]["lin"]["cores"], strict=True):
        m.copy_(torch.arange(leaf.numel(), dtype=leaf.dtype).view_as(leaf))
    params["lin"]["gates"][1][[0, 2]] = 0.0
    state = prune_tree(params, state, 0.01)
    new_p, new_s, new_m, new_v = compact_tree(params, state, opt["m"], opt["v"])
    keep = torch.tensor([1, 3, 4, 5])
    torch.testing.assert_close(new_m["lin"]["cores"][1], opt["m"]["lin"]["cores"][1][..., keep])
    torch.testing.assert_close(new_m["lin"]["cores"][2], opt["m"]["lin"]["cores"][2][keep])
    assert new_v["lin"]["gates"][1].shape == (4,)
    grads = [torch.ones_like(t) for t in torch.utils._pytree.tree_flatten(new_p)[0]]
    adamw_step(new_p, grads, {**opt, "m": new_m, "v": new_v}, AdamWConfig())  # shapes agree


def test_adamw_matches_torch():
    torch.manual_seed(0)
    p = {"w": torch.randn(4, 3), "b": torch.randn(3)}
    ref = [torch.nn.Parameter(p["w"].clone()), torch.nn.Parameter(p["b"].clone())]
    torch_opt = torch.optim.AdamW(
        [{"params": [ref[0]], "weight_decay": 0.01}, {"params": [ref[1]], "weight_decay": 0.0}],
        lr=5e-5,
    )
    opt = adamw_init(p)
    for _ in range(5):
        gw, gb = torch.randn(4, 3), torch.randn(3)
        ref[0].grad, ref[1].grad = gw.clone(), gb.clone()
        torch_opt.step()
        opt = adamw_step(p, [gw, gb], opt, AdamWConfig())
    torch.testing.assert_close(p["w"], ref[0].detach())
    torch.testing.assert_close(p["b"], ref[1].detach())


def test_fused_adamw_equals_the_foreach_path(monkeypatch):
    """The fused kernel (CPU/CUDA) and the foreach fallback make the same update: groups
    with their own rates, decay on matrices only, over several steps."""
    import comera.train.optim as O

    real = torch._fused_adamw_
    torch.manual_seed(0)
    layer = {"cores": [torch.randn(1, 4, 3), torch.randn(3, 5, 1)], "gates": [torch.rand(3)]}
    tree = {"layer": layer, "w": torch.randn(6, 2), "b": torch.randn(2)}
    fused = []
    monkeypatch.setattr(torch, "_fused_adamw_", lambda *a, **k: fused.append(1) or real(*a, **k))
    cfg = AdamWConfig(lr_cores=1e-2, lr_gates=3e-2, lr_rest=2e-2, weight_decay=0.1)
    trees = [tree_map(torch.clone, tree) for _ in range(2)]
    opts = [adamw_init(t) for t in trees]
    for _ in range(4):
        grads = [torch.randn_like(t) for t in tree_flatten(tree)[0]]
        opts[0] = O.adamw_step(trees[0], grads, opts[0], cfg, lr_scale=0.5)
        with monkeypatch.context() as m:
            m.setattr(O, "_fusable", lambda *a: False)
            opts[1] = O.adamw_step(trees[1], grads, opts[1], cfg, lr_scale=0.5)
    for a, b in zip(tree_flatten(trees[0])[0], tree_flatten(trees[1])[0], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert opts[0]["step"] == opts[1]["step"] == 4 and fused  # the fused kernel ran
    # a transposed parameter (a view with other strides) takes the foreach path: the fused
    # kernel walks raw memory and would update it out of place
    base = torch.randn(3, 5)
    t = {"w": base.t()}
    ref = {"w": base.t().contiguous()}
    g = [torch.randn(5, 3)]
    o1, o2 = adamw_init(t), adamw_init(ref)
    O.adamw_step(t, g, o1, cfg)
    O.adamw_step(ref, g, o2, cfg)
    torch.testing.assert_close(t["w"], ref["w"])


def test_accumulate_keeps_shared_gradients_apart():
    """Autograd may hand two leaves one tensor (``(a + b) * c``) or a broadcast view
    (``x.sum()``); the trainer's buffers must still be its own, or scaling one in place
    scales the other twice. Disjoint slices of one buffer are kept without a copy."""
    from comera.train.loop import _accumulate, _scale

    a, b, c, x = (torch.ones(3, requires_grad=True) for _ in range(4))
    grads = torch.autograd.grad(((a + b) * c).sum() + x.sum(), [a, b, c, x])
    assert grads[0] is grads[1]
    into: list = [None] * 4
    _accumulate(into, grads)
    _scale(into, 2.0)
    for g, want in zip(into, (2.0, 2.0, 4.0, 2.0), strict=True):
        torch.testing.assert_close(g, torch.full((3,), want))
    assert all(g.is_contiguous() for g in into)
    # stacked leaves (comera.plans.GroupedHalves) get disjoint slices of one buffer: kept
    # as they are, no copy; slices that overlap are copied
    p, q, r = (torch.ones(2, 3, requires_grad=True) for _ in range(3))
    grads = torch.autograd.grad((torch.stack([p, q, r]) * 3).sum(), [p, q, r])
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 1
    into = [None] * 3
    _accumulate(into, grads)
    assert all(a is b for a, b in zip(into, grads, strict=True))
    _scale(into, 2.0)
    for g in into:
        torch.testing.assert_close(g, torch.full((2, 3), 6.0))
    buf = torch.ones(4)
    into = [None] * 2
    _accumulate(into, (buf[:3], buf[1:]))
    assert into[0] is not None and into[0].data_ptr() == buf.data_ptr()
    assert into[1].untyped_storage().data_ptr() != buf.untyped_storage().data_ptr()


def test_grad_norm_mixes_dtypes_and_sparse_gradients():
    """The global norm (per-leaf norms in fp32, or fp64 beside an fp64 leaf; combined in
    fp64) over fp32, bf16, fp64 and sparse gradients alike, missing ones skipped; no
    gradient at all gives 0."""
    from comera.train.loop import _grad_norm

    torch.manual_seed(0)
    dense = [torch.randn(3, 4), torch.randn(5).bfloat16(), torch.randn(2, 2).double()]
    sparse = torch.sparse_coo_tensor([[0, 2]], torch.randn(2, 3), (4, 3), check_invariants=True)
    sparse = sparse.coalesce()
    want = torch.cat([g.double().reshape(-1) for g in [*dense, sparse.to_dense()]]).norm()
    for grads in (dense, [*dense, None, sparse], dense[:2]):
        total = _grad_norm(grads)
        assert total.dtype == torch.float64
        ref = want if len(grads) > 3 else torch.cat(
            [g.double().reshape(-1) for g in grads]).norm()  # fmt: skip
        torch.testing.assert_close(total.double(), ref, rtol=1e-6, atol=0)
    assert float(_grad_norm([None])) == 0.0


# ----------------------------------------------------------------------------- training


def _metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def test_short_run_reduces_loss_and_dense_stage(tmp_path):
    params, state = _toy_model()
    cfg = _cfg(tmp_path, comera=ComeraConfig(enabled=False))
    Trainer(cfg, ToyTask(), params, state).fit()
    rows = [r for r in _metrics(cfg.run_dir) if "loss" in r]
    assert rows[-1]["loss"] < 0.5 * rows[0]["loss"]
    assert {r["stage"] for r in rows} == {"dense"}


def test_gamma_shrinks_gates(tmp_path):
    def gate_l1(gamma):
        comera = ComeraConfig(gamma=gamma, tau=0.0, early_steps=1000, prune_every=1000)
        cfg = _cfg(tmp_path / str(gamma), steps=40, comera=comera)
        tr = Trainer(cfg, ToyTask(), *_toy_model())
        tr.fit()
        return sum(float(g.detach().abs().sum()) for g in tr.params["lin"]["gates"])

    assert gate_l1(0.5) < 0.5 * gate_l1(0.0)


def test_pruning_removes_ranks_and_compacts(tmp_path):
    params, state = _toy_model()
    cfg = _cfg(tmp_path)
    tr = Trainer(cfg, ToyTask(), params, state)
    before = model_size(tr.params, tr.state)
    tr.fit()
    rows = [r for r in _metrics(cfg.run_dir) if "loss" in r]
    assert rows[-1]["ranks/lin"] < rows[0]["ranks/lin"]
    # the target map has rank 2: pruning removes middle ranks, compaction drops them
    assert bond_ranks(tr.params["lin"])[1] < 6
    assert model_size(tr.params, tr.state) < before
    assert all(bool(m.all()) for m in tr.state["lin"]["masks"])  # compacted at the end
    assert rows[-1]["loss"] < rows[0]["loss"]
    snaps = json.loads((Path(cfg.run_dir) / "ranks.json").read_text())
    assert list(snaps) == ["init", "end_of_early", "end"]
    assert snaps["init"]["ranks"]["lin"] == [4, 6, 4]
    assert snaps["end"]["ranks"]["lin"] == bond_ranks(tr.params["lin"])


def test_paper_late_stage_reaches_its_surrogate_target(tmp_path):
    """The paper's late stage (``S`` and tau pruning) drives ``S`` to ``S0``; the live-size
    late stage is tested in ``test_late_stage.py``."""
    params, state = _toy_model()
    comera = ComeraConfig(
        gamma=0.0, tau=0.02, early_steps=30, prune_every=5, size_ratio=0.5, rho=0.05,
        size_objective="paper", late_prune="threshold",
    )  # fmt: skip
    cfg = _cfg(tmp_path, steps=150, comera=comera)
    tr = Trainer(cfg, ToyTask(), params, state)
    tr.fit()
    target = tr.targets["size"]
    final = float(size_surrogate(tr.params, tr.state).detach())
    assert final <= 1.1 * target, (final, target)
    assert model_size(tr.params, tr.state) < model_size(*_toy_model())


def test_compaction_mid_training_leaves_loss_unchanged(tmp_path):
    params, state = _toy_model()
    tr = Trainer(_cfg(tmp_path), ToyTask(), params, state)
    it = iter(tr.task.train_iter)
    for _ in range(20):
        tr.train_step(next(it))
    with torch.no_grad():
        tr.params["lin"]["gates"][2][:2] = 0.0  # make some ranks dead
    tr.prune()
    batch = next(_Iter(tr.task.w, seed=7))
    with torch.no_grad():
        before, _, _ = tr.task.loss(tr.params, tr.state, batch, train=False)
    stored = C.param_count(tr.params)
    tr.compact()
    with torch.no_grad():
        after, _, _ = tr.task.loss(tr.params, tr.state, batch, train=False)
    assert C.param_count(tr.params) < stored
    torch.testing.assert_close(after, before)
    tr.train_step(next(it))  # optimizer state was sliced along: the step runs


def test_resume_is_bit_identical(tmp_path):
    def run(cfg, resume=False):
        params, state = _toy_model()
        tr = Trainer(cfg, ToyTask(noise=0.1), params, state, resume=resume)
        tr.fit()
        return tr

    full = run(_cfg(tmp_path / "a", steps=60, checkpoint_every=25))
    # an interrupted twin: same config, stopped after its step-25 checkpoint
    part_cfg = _cfg(tmp_path / "b", steps=60, checkpoint_every=25)
    params, state = _toy_model()
    tr = Trainer(part_cfg, ToyTask(noise=0.1), params, state)
    it = iter(tr.task.train_iter)
    while tr.step < 25:
        tr.train_step(next(it))
        tr._after_step()
    tr.checkpoint()
    resumed = run(part_cfg, resume=True)
    for a, b in zip(
        torch.utils._pytree.tree_flatten(full.params)[0],
        torch.utils._pytree.tree_flatten(resumed.params)[0],
        strict=True,
    ):
        assert torch.equal(a, b)
    rows_a = [r["loss"] for r in _metrics(tmp_path / "a" / "run") if "loss" in r and r["step"] > 25]
    rows_b = [r["loss"] for r in _metrics(tmp_path / "b" / "run") if "loss" in r and r["step"] > 25]
    assert rows_a == rows_b


def test_nan_stops_with_step_and_keeps_last_checkpoint(tmp_path):
    params, state = _toy_model()
    cfg = _cfg(tmp_path, checkpoint_every=10)
    with pytest.raises(NonFiniteLoss, match=r"loss is nan at step 15") as err:
        Trainer(cfg, ToyTask(nan_at=15), params, state).fit()
    # the advice is one a user can follow: --resume refuses new learning rates
    assert "step_00000010) was left untouched" in str(err.value)
    assert "Start a new run" in str(err.value) and "then --resume" not in str(err.value)
    ckpt = load_checkpoint(cfg.run_dir)
    assert ckpt["step"] == 10
    early = _cfg(tmp_path / "early", checkpoint_every=10)  # before the first checkpoint
    with pytest.raises(NonFiniteLoss, match="no checkpoint had been written yet"):
        Trainer(early, ToyTask(nan_at=5), *_toy_model()).fit()
    assert all(torch.isfinite(t).all() for t in torch.utils._pytree.tree_flatten(ckpt["params"])[0])


def test_checkpoint_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no checkpoint in"):
        load_checkpoint(tmp_path)
    params, state = _toy_model()
    cfg = _cfg(tmp_path / "x", steps=5)
    Trainer(cfg, ToyTask(), params, state).fit()
    with pytest.raises(CheckpointError, match="steps=5.*steps=6"):
        Trainer(dataclasses.replace(cfg, steps=6), ToyTask(), *_toy_model(), resume=True)


def test_a_resume_refuses_another_training_config_or_model(tmp_path):
    """Only steps, seed, CoMERA on/off and the optimizer were compared: another
    objective, schedule or clip trained on silently, and a model of other modes was
    replaced by the checkpoint's without a word (then failed at the first step)."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    Trainer(dataclasses.replace(cfg), ToyTask(), *_toy_model()).fit(until=10)
    changed = [
        (dataclasses.replace(cfg, comera=dataclasses.replace(cfg.comera, early_steps=50)),
         r"train.comera.early_steps: saved 40, now 50"),
        (dataclasses.replace(cfg, grad_clip=None), r"train.grad_clip: saved 1.0, now None"),
        (dataclasses.replace(cfg, accum_steps=2), r"train.accum_steps: saved 1, now 2"),
    ]  # fmt: skip
    for other, named in changed:
        with pytest.raises(CheckpointError, match=r"other training settings: " + named):
            Trainer(other, ToyTask(), *_toy_model(), resume=True)
    spec = C.TTLinearSpec(out_modes=(2, 8), in_modes=(4, 4), ranks=6)
    other = C.init(spec, generator=torch.Generator().manual_seed(0))
    with pytest.raises(CheckpointError, match=r"another shape .*lin.cores.0: \('modes', \(4,\)\) "
                                              r"saved, \('modes', \(2,\)\) built"):  # fmt: skip
        Trainer(cfg, ToyTask(), {"lin": other[0]}, {"lin": other[1]}, resume=True)
    with pytest.raises(CheckpointError, match=r"other parameters .*built only: \['extra'\]"):
        p, s = _toy_model()
        Trainer(cfg, ToyTask(), {**p, "extra": torch.zeros(3)}, s, resume=True)
    # refused before anything is restored: the caller's iterator keeps its position
    task = ToyTask()
    with pytest.raises(CheckpointError, match="holds adamw optimizer state.*'sgd'"):
        Trainer(dataclasses.replace(cfg, optimizer="sgd"), task, *_toy_model(), resume=True)
    assert task.train_iter.i == 0
    # where it runs, how it reports and how often it saves may change, and so may what the
    # run never reads (another optimizer's settings); it goes on
    moved = dataclasses.replace(cfg, log_every=3, progress=False, checkpoint_every=5,
                                sgd=dataclasses.replace(cfg.sgd, lr=0.5))  # fmt: skip
    assert Trainer(moved, ToyTask(), *_toy_model(), resume=True).step == 10


def test_a_warm_up_the_run_never_finishes_is_said(tmp_path, capsys):
    """A warm-up longer than the run (the smoke presets' 50-200 steps under a short
    --set train.steps) kept the learning rate below its peak without a word."""
    Trainer(_cfg(tmp_path, steps=3, warmup_steps=5), ToyTask(), *_toy_model()).fit()
    assert "train.warmup_steps=5 is not below train.steps=3" in capsys.readouterr().err
    Trainer(_cfg(tmp_path / "b", steps=3, warmup_steps=2), ToyTask(), *_toy_model()).fit()
    assert "warmup_steps" not in capsys.readouterr().err


def test_a_rescalable_iterator_gets_every_saved_rank_at_an_unchanged_world(tmp_path):
    """At an unchanged world size only the rank's own state was handed over, so a
    TokenLoader whose worker count changed (it re-cuts every rank's shards) refused the
    resume at world > 1; a rescalable iterator now always gets the whole list."""

    class Rescalable(_Iter):
        rescalable = True
        given: object = None

        def load_state_dict(self, s):
            Rescalable.given = s
            super().load_state_dict(s[0])

    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    task = ToyTask()
    task.train_iter = Rescalable(task.w)
    Trainer(cfg, task, *_toy_model()).fit(until=10)
    again = ToyTask()
    again.train_iter = Rescalable(again.w)
    assert Trainer(cfg, again, *_toy_model(), resume=True).step == 10
    assert Rescalable.given == [{"i": 10}] and again.train_iter.i == 10


def test_a_damaged_rank_file_names_the_previous_checkpoint(tmp_path):
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=10)
    (Path(cfg.run_dir) / "checkpoints" / "step_00000010" / "data_rank00000.json").write_text("{")
    with pytest.raises(CheckpointError, match=r"data state .*unreadable.*The previous "
                                              r"checkpoint is .*step_00000005: move"):  # fmt: skip
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)


def test_config_errors():
    with pytest.raises(ValueError, match="size_ratio"):
        ComeraConfig(size_ratio=0.0)
    with pytest.raises(ValueError, match="wandb must be online, offline or disabled"):
        TrainConfig(steps=1, run_dir="x", wandb="maybe")
    with pytest.raises(ValueError, match="bf16 autocast is for CUDA"):
        TrainConfig(steps=1, run_dir="x", bf16=True)


# ----------------------------------------------------------------------------- DDP

DDP_WORKER = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {root!r})
from tests.train_helpers import ToyTask, _toy_model, _cfg
from comera.train import Trainer
from pathlib import Path
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
params, state = _toy_model()
tr = Trainer(_cfg(Path({out!r}), steps=30), ToyTask(rank=rank, world=world), params, state)
tr.fit()
if rank == 0:
    torch.save(tr.params, {out!r} + "/params.pt")
dist.destroy_process_group()
"""


def test_two_process_gloo_matches_single_process(tmp_path, one_thread):
    single = Trainer(_cfg(tmp_path / "single", steps=30), ToyTask(), *_toy_model())
    single.fit()
    out = tmp_path / "ddp"
    out.mkdir()
    script = tmp_path / "worker.py"
    script.write_text(DDP_WORKER.format(root=str(ROOT), out=str(out)))
    port = free_port()
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
        }
        procs.append(subprocess.Popen([sys.executable, str(script)], env=env))
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    ddp = torch.load(out / "params.pt", weights_only=False)
    for a, b in zip(
        torch.utils._pytree.tree_flatten(single.params)[0],
        torch.utils._pytree.tree_flatten(ddp)[0],
        strict=True,
    ):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert math.isfinite(float(single.loss_ema))


# ----------------------------------------------------------------------------- review fixes


def test_late_stage_from_the_start_needs_and_uses_a_loss_target(tmp_path):
    with pytest.raises(ValueError, match="early_steps=0 starts in the late stage"):
        ComeraConfig(early_steps=0)
    comera = ComeraConfig(early_steps=0, loss_target=0.1, tau=0.02, prune_every=5)
    tr = Trainer(_cfg(tmp_path, steps=20, comera=comera), ToyTask(), *_toy_model())
    assert tr.stage == "late" and tr.targets["loss"] == 0.1 and tr.targets["size"] > 0
    tr.fit()


class _InfGradTask(ToyTask):
    def loss(self, params, state, batch, *, train):
        loss, n, extra = super().loss(params, state, batch, train=train)
        if self.calls >= 4:  # finite value, infinite gradient
            loss = loss + torch.sqrt(params["lin"]["bias"][0] * 0)
        return loss, n, extra


def test_non_finite_gradient_stops_before_any_update(tmp_path):
    cfg = _cfg(tmp_path, checkpoint_every=1)
    tr = Trainer(cfg, _InfGradTask(), *_toy_model())
    with pytest.raises(NonFiniteLoss, match="gradient norm is (inf|nan) at step 4"):
        tr.fit()
    assert tr.step == 3
    ckpt = load_checkpoint(cfg.run_dir)
    assert ckpt["step"] == 3
    for t in torch.utils._pytree.tree_flatten([ckpt["params"], tr.params])[0]:
        assert torch.isfinite(t).all()


def test_resume_tolerates_a_metrics_line_cut_by_a_kill(tmp_path):
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    path = Path(cfg.run_dir) / "metrics.jsonl"
    path.write_text(path.read_text() + '{"step": 21, "lo')
    tr = Trainer(dataclasses.replace(cfg), ToyTask(), *_toy_model(), resume=True)
    assert all(r["step"] <= 20 for r in _metrics(cfg.run_dir))
    assert tr.step == 20


def test_stale_state_after_compaction_is_named():
    params, state = _toy_model()
    params["lin"]["gates"][1][:3] = 0.0
    pruned = prune_tree(params, state, 0.01)
    new_params, _ = compact_tree(params, pruned)[:2]
    x = torch.randn(2, 16)
    with pytest.raises(
        ValueError, match=r"does not match the params: masks of \[4, 6, 4\].*\[4, 3, 4\]"
    ):
        C.tt_linear(new_params["lin"], state["lin"], x)
    with pytest.raises(ValueError, match=r"lin: the rank state must be a dict"):
        gate_regularizer(params, {})


def test_lr_schedule_ends_above_zero_and_starts_at_one_after_warmup():
    cfg = TrainConfig(steps=10, run_dir="x", warmup_steps=2, schedule="linear")
    scales = [lr_scale(cfg, s) for s in range(1, 11)]
    assert scales[:3] == [0.5, 1.0, 1.0] and scales[-1] == pytest.approx(1 / 8)
    cos = TrainConfig(steps=10, run_dir="x", schedule="cosine")
    assert lr_scale(cos, 1) == 1.0 and lr_scale(cos, 10) > 0


def test_more_config_errors():
    with pytest.raises(ValueError, match="TrainConfig.log_every must be >= 1, got 0"):
        TrainConfig(steps=1, run_dir="x", log_every=0)
    # each field named alone (two checked together were named together, values and all)
    with pytest.raises(ValueError, match=r"^TrainConfig.keep_checkpoints must be >= 1, got 0$"):
        TrainConfig(steps=1, run_dir="x", keep_checkpoints=0)
    with pytest.raises(ValueError, match=r"^ComeraConfig.prune_every must be >= 1, got 0$"):
        ComeraConfig(prune_every=0)
    # a step holds its micro-batches together: 10**22 of them was killed for memory unsaid
    with pytest.raises(ValueError, match=r"accum_steps must be in \[1, 65536\].*got 10{22}"):
        TrainConfig(steps=1, run_dir="x", accum_steps=10**22)
    with pytest.raises(ValueError, match=r"train.device is 'cpu'; set it to cuda \(--device"):
        TrainConfig(steps=1, run_dir="x", bf16=True)
    with pytest.raises(ValueError, match="grad_clip must be None"):
        TrainConfig(steps=1, run_dir="x", grad_clip=-1.0)
    with pytest.raises(ValueError, match="reg_start_step=50 must be"):
        ComeraConfig(early_steps=50, reg_start_step=50)
    # a dense run (CoMERA off) has no regularizer: the preset's reg_start_step above a
    # short --set early_steps refused `--dense` runs
    ComeraConfig(enabled=False, early_steps=50, reg_start_step=50)


def test_trainer_does_not_touch_the_callers_tensors(tmp_path):
    params, state = _toy_model()
    before = [t.clone() for t in torch.utils._pytree.tree_flatten(params)[0]]
    Trainer(_cfg(tmp_path, steps=5), ToyTask(), params, state).fit()
    after = torch.utils._pytree.tree_flatten(params)[0]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class _MeanAndMetricsTask(ToyTask):
    """The removed ``(mean, metrics)`` form of a task's loss."""

    def loss(self, params, state, batch, *, train):
        mean, _, metrics = super().loss(params, state, batch, train=train)
        return mean, metrics


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_a_loss_of_two_values_names_the_form_expected(tmp_path, mode):
    tr = Trainer(_cfg(tmp_path, step_mode=mode), _MeanAndMetricsTask(), *_toy_model())
    before = [t.clone() for t in torch.utils._pytree.tree_flatten(tr.params)[0]]
    with pytest.raises(TypeError, match=r"returned 2 values; it must return \(sum, count, "
                       r"metrics\).*return \(mean, 1, metrics\)"):  # fmt: skip
        tr.train_step(next(iter(tr.task.train_iter)))
    assert tr.step == 0
    after = torch.utils._pytree.tree_flatten(tr.params)[0]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


class _OddLoss(ToyTask):
    """ToyTask whose loss returns ``edit(sum, count, metrics)``."""

    def __init__(self, edit):
        super().__init__()
        self.edit = edit

    def loss(self, params, state, batch, *, train):
        return self.edit(*super().loss(params, state, batch, train=train))


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # AttributeError: 'float' object has no attribute 'requires_grad'
        (lambda s, n, m: (float(s), n, m), r"returned the sum as a float \("),
        (lambda s, n, m: (s, n, {"m": "hi"}), r"returned a metric 'm' of type str; each of"),
        (lambda s, n, m: (s.to(torch.complex64), n, m), "a sum of dtype torch.complex64"),
        (lambda s, n, m: (s, True, m), "a count of type bool"),
        (lambda s, n, m: (s, np.bool_(True), m), "a count of type bool"),
        (lambda s, n, m: (s, n, {"m": np.ones(2)}), r"a metric 'm' of type ndarray"),
    ],
)
def test_a_loss_of_numbers_that_are_not_one_real_tensor_is_named(tmp_path, mode, edit, message):
    tr = Trainer(_cfg(tmp_path, step_mode=mode), _OddLoss(edit), *_toy_model())
    with pytest.raises(TypeError, match=message):
        tr.train_step(next(iter(tr.task.train_iter)))
    assert tr.step == 0


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_a_one_element_sum_and_a_plain_zero_share_train(tmp_path, mode):
    """A sum of shape (1,) failed in torch internals ("output with shape [] doesn't match
    the broadcast shape [1]"); an empty share's plain 0 (documented) in an AttributeError.
    A negative count in a sync-free step was reported as count 0."""
    shaped = Trainer(_cfg(tmp_path / "a", step_mode=mode),
                     _OddLoss(lambda s, n, m: (s.reshape(1), n, m)), *_toy_model())  # fmt: skip
    plain = Trainer(_cfg(tmp_path / "b", step_mode=mode), ToyTask(), *_toy_model())
    batch = next(iter(plain.task.train_iter))
    assert shaped.train_step(batch)["loss"] == plain.train_step(batch)["loss"]
    cfg = _cfg(tmp_path / "c", step_mode=mode, accum_steps=2)
    calls = iter([True, False, True, False])
    zero = _OddLoss(lambda s, n, m: (s, n, m) if next(calls) else (0, 0, {}))
    tr = Trainer(cfg, zero, *_toy_model())
    assert math.isfinite(tr.train_step(batch, batch)["loss"])
    shaped_numpy = _OddLoss(lambda s, n, m: (s, np.array([float(n)]), {"m": np.ones((1, 1))}))
    tr = Trainer(_cfg(tmp_path / "e", step_mode=mode), shaped_numpy, *_toy_model())
    assert tr.train_step(batch)["m"] == 1.0  # numpy's one-element values, as numbers
    negative = Trainer(_cfg(tmp_path / "d", step_mode=mode),
                       _OddLoss(lambda s, n, m: (s, -1, m)), *_toy_model())  # fmt: skip
    with pytest.raises(ValueError, match=r"count of -1|\(count -1\)"):
        negative.train_step(batch)


def test_a_cpu_step_back_propagates_once_unless_its_loss_is_low_precision(tmp_path, monkeypatch):
    """One micro-batch on the CPU: the loss and the stage's parameter term (here the gate
    regularizer, from step 1) share one backward pass. A loss summed in bf16 takes its own
    backward first and is weighted in the gradients' fp32. Both give the same update."""
    comera = ComeraConfig(gamma=0.5, tau=0.05, early_steps=40, prune_every=10, reg_start_step=0)

    class Bf16Loss(ToyTask):
        def loss(self, params, state, batch, *, train):
            loss, n, metrics = super().loss(params, state, batch, train=train)
            return loss.to(torch.bfloat16), n, metrics

    calls = []
    grad = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: calls.append(1) or grad(*a, **k))
    passes, params = {}, {}
    for name, task in (("fp32", ToyTask()), ("bf16", Bf16Loss())):
        tr = Trainer(_cfg(tmp_path / name, steps=3, comera=comera), task, *_toy_model())
        batch = next(iter(task.train_iter))
        calls.clear()
        tr.train_step(batch)
        passes[name], params[name] = len(calls), tr.params
    assert passes == {"fp32": 1, "bf16": 2}
    for a, b in zip(tree_flatten(params["fp32"])[0], tree_flatten(params["bf16"])[0], strict=True):
        torch.testing.assert_close(a, b)


def test_fit_until_pauses_and_a_later_fit_ends_where_one_fit_does(tmp_path):
    """``fit(until=k)`` stops after step ``k`` (the stages and schedule still count to
    ``cfg.steps``: here the pause falls in the late stage, before its final prune); a
    later ``fit()`` finishes the run as one uninterrupted ``fit`` does."""
    once = Trainer(_cfg(tmp_path / "once"), ToyTask(), *_toy_model())
    once.fit()
    paused = Trainer(_cfg(tmp_path / "paused"), ToyTask(), *_toy_model())
    with pytest.raises(ValueError, match=r"until=...\) must be a step \(an int >= 0\)"):
        paused.fit(until=-3)  # it was a silent no-op
    paused.fit(until=45)
    assert paused.step == 45 and paused.stage == "late"
    paused.fit()
    assert paused.step == once.step == 60
    for a, b in zip(tree_flatten(once.params)[0], tree_flatten(paused.params)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_a_paused_fit_goes_on_with_the_batches_of_an_iterable_that_restarts(tmp_path):
    """A train_iter whose ``iter()`` starts over (a list, a DataLoader) was iterated again
    by the later ``fit()``: it trained on the first batches twice, without a word."""

    def listed() -> ToyTask:
        task = ToyTask()
        task.train_iter = [next(task.train_iter) for _ in range(60)]
        return task

    once = Trainer(_cfg(tmp_path / "once"), listed(), *_toy_model())
    once.fit()
    paused = Trainer(_cfg(tmp_path / "paused"), listed(), *_toy_model())
    paused.fit(until=20)
    paused.fit()
    for a, b in zip(tree_flatten(once.params)[0], tree_flatten(paused.params)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_optimizer_groups_follow_the_tt_structure_not_key_names():
    """A dense tensor named ``gates`` (a router) is rest, decayed at the rest's rate; a
    TT layer's own bias is rest wherever the layer sits."""
    from comera.train.optim import leaf_groups

    params, _ = C.init(C.TTLinearSpec(out_modes=(4,), in_modes=(4,), ranks=(3,)))
    tree = {"moe": {"gates": torch.randn(4, 8)}, "gates": params}
    got = leaf_groups(tree)
    assert got == ["rest", "cores", "cores", "gates", "rest"]


class _PlainIter:
    """The toy stream without state_dict / load_state_dict, optionally finite."""

    def __init__(self, task: ToyTask, limit: int | None = None) -> None:
        self.inner, self.limit, self.n = task.train_iter, limit, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.limit is not None and self.n >= self.limit:
            raise StopIteration
        self.n += 1
        return next(self.inner)


def test_an_iterator_without_a_state_dict_trains_checkpoints_and_resumes_warned(tmp_path):
    """A train_iter without state_dict (a cycle over a list) used to fail in the final
    checkpoint after the whole run had trained; now its first checkpoint warns (once), its
    checkpoints hold no data position, and a resume restarts the data, warned again."""
    task = ToyTask()
    task.train_iter = _PlainIter(task)
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    tr = Trainer(cfg, task, *_toy_model())
    with pytest.warns(UserWarning, match="train_iter .*_PlainIter.* has no state_dict") as seen:
        tr.fit()
    assert sum("has no state_dict" in str(w.message) for w in seen) == 1  # two saves, one word
    ckpt = load_checkpoint(cfg.run_dir)
    assert ckpt["step"] == 20
    data = json.loads((Path(ckpt["dir"]) / "data_rank00000.json").read_text())
    assert data["state"] is None
    again = ToyTask()
    again.train_iter = _PlainIter(again)
    with pytest.warns(UserWarning, match="holds no data position"):
        Trainer(dataclasses.replace(cfg, steps=20), again, *_toy_model(), resume=True)
    # a saved position this iterator cannot take is refused, not dropped
    Trainer(_cfg(tmp_path / "b", steps=10), ToyTask(), *_toy_model()).fit()
    with pytest.raises(CheckpointError, match="no load_state_dict"):
        Trainer(_cfg(tmp_path / "b", steps=10), again, *_toy_model(), resume=True)


def test_an_iterator_that_ends_early_is_named(tmp_path):
    task = ToyTask()
    task.train_iter = _PlainIter(task, limit=5)
    tr = Trainer(_cfg(tmp_path, steps=20), task, *_toy_model())
    with pytest.raises(C.errors.DataError, match="train_iter ended during step 6 of 20"):
        tr.fit()


def test_a_fresh_run_refuses_rows_of_a_run_without_checkpoints(tmp_path):
    """A run stopped before its first checkpoint leaves metrics.jsonl: a fresh run there
    appended its rows to the old ones ([5, 10, 5, 10, ...]); now it is refused, and
    starts once the file is deleted."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=100)
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=10)  # a pause: saved at step 10
    ck = Path(cfg.run_dir) / "checkpoints"
    for d in ck.iterdir():  # as if it had died before saving
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    with pytest.raises(CheckpointError, match="metrics.jsonl of a run that wrote no checkpoint"):
        Trainer(cfg, ToyTask(), *_toy_model())
    (Path(cfg.run_dir) / "metrics.jsonl").unlink()
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert [r["step"] for r in _metrics(cfg.run_dir) if "loss" in r] == [5, 10, 15, 20]


def test_a_device_this_process_cannot_use_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for device, message in (("cuda", "no CUDA device here"), ("meta", "holds no data")):
        with pytest.raises(C.errors.ConfigError, match=f"TrainConfig.device .*{message}"):
            Trainer(_cfg(tmp_path, device=device), ToyTask(), *_toy_model())
    assert not (tmp_path / "run").exists()
    # a backend torch has no availability check for (xla, a plugin's) is left to torch
    from comera.train.config import usable_device

    usable_device("xla")


def test_an_empty_held_out_split_is_nan_not_a_perfect_score(tmp_path):
    """A (sum, count) metric over nothing was 0 / 1e-12 = 0: a loss of 0 (perplexity 1)
    for a split that measured nothing. It is NaN now."""

    class Empty(ToyTask):
        def evaluate(self, params, state):
            return {"loss": (0.0, 0.0), "mse": (2.0, 4.0)}

    tr = Trainer(_cfg(tmp_path, steps=1), Empty(), *_toy_model())
    out = tr.evaluate()
    assert math.isnan(out["loss"]) and out["mse"] == 0.5


def test_only_a_resume_continues_the_recorded_wandb_run(tmp_path, monkeypatch):
    """A fresh run in a dir whose stopped attempt left a wandb id (the CLI restarts such a
    run from step 0) reused that id; it starts a wandb run of its own now."""
    import importlib.machinery
    import types

    from comera.train.logging import WANDB_ID, RunLog

    seen: list[tuple] = []
    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
    fake.init = lambda **kw: seen.append((kw["id"], kw["resume"])) or types.SimpleNamespace()
    fake.errors = types.SimpleNamespace(Error=RuntimeError)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _cfg(tmp_path, wandb="offline")
    Path(cfg.run_dir).mkdir(parents=True)
    (Path(cfg.run_dir) / WANDB_ID).write_text("stale123\n")
    RunLog(cfg, 0, {}, resume=False)
    fresh = (Path(cfg.run_dir) / WANDB_ID).read_text().strip()
    RunLog(cfg, 0, {}, resume=True)
    assert seen[0][0] != "stale123" and seen[0][0] == fresh and seen[0][1] is None
    assert seen[1] == (fresh, "allow")  # a resume continues the recorded run


@pytest.mark.parametrize("objective", ["shares", "paper"])
def test_a_task_metric_cannot_take_a_name_the_trainer_logs(tmp_path, objective):
    """A task metric named ``step`` (or ``loss``, ``tokens``...) overwrote the trainer's
    value in every row, and a row whose step was 3.0 could not be read on resume; it is
    refused at the first step. TRAINER_METRICS holds every name a training row of any
    stage carries, so the check cannot fall behind what the trainer logs."""
    from comera.train.task import TRAINER_METRICS

    class Named(ToyTask):
        def __init__(self, name):
            super().__init__()
            self.name = name

        def loss(self, params, state, batch, *, train):
            s, n, m = super().loss(params, state, batch, train=train)
            return s, n, {**m, self.name: 3}

    for name in ("step", "loss", "tokens", "ranks/x", "@weight"):
        with pytest.raises(ValueError, match=rf"metrics named \['{re.escape(name)}'\]"):
            Trainer(_cfg(tmp_path / name, steps=2), Named(name), *_toy_model()).fit()
    with pytest.raises(TypeError, match=r"metrics named \[1\]; metric names are strings"):
        Trainer(_cfg(tmp_path / "int", steps=2), Named(1), *_toy_model()).fit()
    comera = ComeraConfig(gamma=0.5, tau=0.05, early_steps=20, prune_every=10,
                          size_objective=objective)  # fmt: skip
    cfg = _cfg(tmp_path / "ok", steps=40, log_every=1, comera=comera)
    Trainer(cfg, Named("train/mine"), *_toy_model()).fit()
    rows = [json.loads(line) for line in (tmp_path / "ok" / "run" / "metrics.jsonl").open()]
    logged = {k for r in rows if "loss" in r for k in r if not k.startswith("ranks/")}
    assert len({r["stage"] for r in rows if "loss" in r}) >= 2  # early and late rows
    assert logged - TRAINER_METRICS == {"accuracy", "train/mine"}
    assert all(r["train/mine"] == 3 for r in rows if "loss" in r)


def test_evaluate_returns_of_another_form_name_the_metric(tmp_path):
    """A ``(sum, count)`` tuple of three values shifted every later metric's numbers in
    the flat reduction: ``{"a": (1, 2, 3), "b": 5}`` gave b = 0.6, silently. Such returns,
    and a None, a list or a name that is no string, are refused naming the metric; the
    number forms the protocol allows (numpy's, one-element tensors) keep working."""
    import numpy as np

    class Returns(ToyTask):
        def __init__(self, ret):
            super().__init__()
            self.ret = ret

        def evaluate(self, params, state):
            return self.ret

    def evaluate(ret):
        return Trainer(_cfg(tmp_path, steps=1), Returns(ret), *_toy_model()).evaluate()

    for ret, match in [
        ({"a": (1.0, 2.0, 3.0), "b": 5.0}, r"tuple of 3 values in metric 'a'"),
        ({"a": (1.0,)}, r"tuple of 1 values in metric 'a'"),
        (None, r"returned NoneType; it must return a dict"),
        ([("a", 1.0)], r"returned list; it must return a dict"),
        ({1: 2.0}, r"metrics named \[1\]"),
        ({"a": "x"}, r"returned str in metric 'a'"),
        ({"a": torch.ones(3)}, r"a tensor of shape \(3,\) in metric 'a'"),
        ({"a": (1.0, [2.0])}, r"returned list in metric 'a'"),
    ]:
        with pytest.raises(TypeError, match=match):
            evaluate(ret)
    ok = {"a": np.float32(2.0), "b": np.array(3.0), "c": True,
          "d": (np.int64(3), torch.tensor(6)), "e": (torch.tensor(1.0), 0)}  # fmt: skip
    out = evaluate(ok)
    assert {k: v for k, v in out.items() if k != "e"} == {"a": 2.0, "b": 3.0, "c": 1.0, "d": 0.5}
    assert math.isnan(out["e"])  # nothing counted


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_a_loss_of_many_numbers_or_a_bad_count_is_named(tmp_path, mode):
    """A per-example loss (reduction='none') or a vector metric failed in torch's
    broadcasting or autograd, naming neither the task nor the (sum, count, metrics) form;
    a NaN count was blamed on the learning rate and a negative one offset the others
    (the eager step reads each batch's; a sync-free one only the total)."""

    class Returns(ToyTask):
        def __init__(self, change):
            super().__init__()
            self.change = change

        def loss(self, params, state, batch, *, train):
            return self.change(*super().loss(params, state, batch, train=train))

    def fit(change) -> None:
        cfg = _cfg(tmp_path / "run", steps=1, step_mode=mode)
        Trainer(cfg, Returns(change), *_toy_model()).fit()

    for change, match in [
        (lambda s, n, m: (s.repeat(4), 4, m), r"a sum of shape \(4,\); each of \(sum, count"),
        (lambda s, n, m: (s, torch.ones(2), m), r"a count of shape \(2,\)"),
        (lambda s, n, m: (s, n, {"acc": torch.ones(3)}), r"a metric 'acc' of shape \(3,\)"),
    ]:
        with pytest.raises(TypeError, match=match):
            fit(change)
    if mode == "eager":
        for count in (math.nan, -5.0):
            with pytest.raises(ValueError, match=rf"returned a count of {count}; the count is"):
                fit(lambda s, n, m, c=count: (s, c, m))


def test_a_task_without_a_member_the_trainer_calls_is_refused_when_built(tmp_path):
    """A task without ``evaluate`` failed with an AttributeError at its first evaluation,
    after training and before that step's checkpoint: the training was lost."""

    class NoEvaluate:
        def __init__(self):
            self.inner = ToyTask()
            self.train_iter = self.inner.train_iter

        def loss(self, params, state, batch, *, train):
            return self.inner.loss(params, state, batch, train=train)

    with pytest.raises(TypeError, match=r"the task \(NoEvaluate\) has no evaluate; a task"):
        Trainer(_cfg(tmp_path, steps=4, eval_every=2), NoEvaluate(), *_toy_model())
    # a run that never evaluates needs none
    Trainer(_cfg(tmp_path / "plain", steps=2, eval_every=None), NoEvaluate(), *_toy_model()).fit()


def test_a_run_draws_only_from_its_own_random_streams(tmp_path):
    """The trainer seeded the process's streams when built and fit drew from them, so
    building a second trainer, or drawing numbers between building and fitting (or
    between two fits), changed the run: an in-process run then differed from its own
    resume. fit now swaps in the run's streams and puts the caller's back."""

    def params(tr):
        return [t.detach().clone() for t in tree_flatten(tr.params)[0]]

    ref = Trainer(_cfg(tmp_path / "ref", steps=20), ToyTask(noise=0.1), *_toy_model())
    ref.fit()
    mixed = Trainer(_cfg(tmp_path / "mixed", steps=20), ToyTask(noise=0.1), *_toy_model())
    Trainer(_cfg(tmp_path / "other", steps=20, seed=3), ToyTask(), *_toy_model())  # reseeds
    torch.randn(7)
    mixed.fit(until=8)
    torch.manual_seed(11)
    outside = torch.get_rng_state()
    mixed.fit()
    assert torch.equal(torch.get_rng_state(), outside)  # the caller's streams are back
    for a, b in zip(params(ref), params(mixed), strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("make", "said"),
    [
        (
            lambda: TrainConfig(steps=float("nan"), run_dir="x"),
            r"steps must be an integer, got nan",
        ),
        (lambda: TrainConfig(steps=10.5, run_dir="x"), r"steps must be an integer, got 10.5"),
        (lambda: TrainConfig(steps="10", run_dir="x"), r"steps must be an integer, got '10'"),
        (lambda: TrainConfig(steps=5, run_dir="x", warmup_steps=float("nan")), "warmup_steps"),
        (lambda: TrainConfig(steps=5, run_dir="x", accum_steps=2.5), r"accum_steps must be an"),
        (lambda: TrainConfig(steps=5, run_dir="x", log_every=None), r"log_every must be an int"),
        (lambda: TrainConfig(steps=5, run_dir="x", eval_every=2.5), r"an integer or None"),
        (lambda: TrainConfig(steps=5, run_dir="x", optim=None), r"optim must be an AdamWConfig"),
        (lambda: TrainConfig(steps=5, run_dir="x", comera={}), r"comera must be a ComeraConfig"),
        (lambda: TrainConfig(steps=5, run_dir="x", grad_clip="1"), r"a number or None, got '1'"),
        (lambda: TrainConfig(steps=5, run_dir="x", wandb_tags=None), r"a list of strings"),
        (lambda: ComeraConfig(prune_every=float("nan")), r"prune_every must be an integer"),
        (lambda: ComeraConfig(gamma="0.1"), r"ComeraConfig.gamma must be a number, got '0.1'"),
        (lambda: C.train.AdamWConfig(betas=0.9), r"betas must be 2 numbers, got 0.9"),
    ],
)
def test_a_config_value_of_another_kind_is_refused_naming_the_field(make, said):
    """NaN passed every ``< 1`` test (steps=nan trained nothing and returned {}), 2.5 passed
    for a count and failed mid-run, None and strings were bare TypeErrors."""
    with pytest.raises(ValueError, match=said):
        make()


def test_numpy_integers_are_integers_and_fit_until_a_step(tmp_path):
    cfg = _cfg(tmp_path, steps=np.int64(4), seed=np.int32(1))
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    with pytest.raises(ValueError, match=r"fit\(until=...\) must be a step"):
        tr.fit(until=2.5)
    tr.fit(until=np.int64(2))
    assert tr.step == 2


def test_a_data_position_checkpoints_cannot_hold_is_refused_before_training(tmp_path):
    """A train_iter whose state_dict holds a tensor failed with a bare TypeError at the
    first checkpoint, after that much training, leaving a half-written step folder."""

    class TensorState(_Iter):
        def state_dict(self):
            return {**super().state_dict(), "g": torch.zeros(2)}

    task = ToyTask()
    task.train_iter = TensorState(task.w)
    tr = Trainer(_cfg(tmp_path, steps=4, checkpoint_every=2), task, *_toy_model())
    with pytest.raises(ValueError, match=r"train_iter.state_dict\(\) must return JSON data"):
        tr.fit()
    assert tr.step == 0 and not (tmp_path / "run" / "checkpoints").exists()


def test_a_data_position_that_turns_numpy_is_saved_as_plain_numbers(tmp_path):
    """A position counted in numpy once iteration began (``np.int64``) passed the check at
    the start of ``fit`` and failed the first checkpoint, losing the steps before it; it
    is saved as plain numbers, and the run resumes from it."""

    class NumpyState(_Iter):
        def state_dict(self):
            return {**super().state_dict(), "i": np.int64(self.i), "seen": np.arange(2)}

    def trainer(where: str, resume: bool = False) -> Trainer:
        task = ToyTask()
        task.train_iter = NumpyState(task.w)
        cfg = _cfg(tmp_path / where, steps=6, checkpoint_every=2)
        return Trainer(cfg, task, *_toy_model(), resume=resume)

    once = trainer("once")
    once.fit()
    trainer("cut").fit(until=4)
    saved = json.loads((tmp_path / "cut" / "run" / "checkpoints" / "step_00000004" /
                        "data_rank00000.json").read_text())  # fmt: skip
    assert saved["state"]["i"] == 4 and saved["state"]["seen"] == [0, 1]
    again = trainer("cut", resume=True)
    again.fit()
    for a, b in zip(tree_flatten(once.params)[0], tree_flatten(again.params)[0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("accum", [1, 2])  # one backward with the regularizer, or per batch
def test_a_loss_that_reaches_no_parameter_is_refused_at_the_first_step(tmp_path, accum):
    """A loss computed from the user's own tensors (a ModuleTask loss_fn calling the module,
    not ``call``) had every gradient missing, filled with zeros: the run trained nothing,
    silently (only the gate regularizer moved). A detached loss was autograd's bare
    error. Both are one message at the first step."""
    other = torch.randn(16, 16, requires_grad=True)

    class Elsewhere(ToyTask):
        def loss(self, params, state, batch, *, train):
            x, y = batch
            return (x @ other - y).pow(2).mean(), 1, {}

    class Detached(ToyTask):
        def loss(self, params, state, batch, *, train):
            s, n, m = super().loss(params, state, batch, train=train)
            return s.detach(), n, m

    for task, said in ((Elsewhere(), "reaches none of the parameters"),
                       (Detached(), "does not depend on the parameters")):  # fmt: skip
        cfg = _cfg(tmp_path / type(task).__name__, steps=3, accum_steps=accum)
        with pytest.raises(ValueError, match=said):
            Trainer(cfg, task, *_toy_model()).fit()
    Trainer(_cfg(tmp_path / "ok", steps=3, accum_steps=accum), ToyTask(), *_toy_model()).fit()


def test_run_dir_forms(tmp_path):
    """A Path and a torch.device are taken as the strings they stand for; an empty run
    dir (the current folder) is refused, and a resume of a folder that does not exist is
    refused without making it."""
    cfg = TrainConfig(steps=2, run_dir=tmp_path / "p", device=torch.device("cpu"))
    assert (cfg.run_dir, cfg.device) == (str(tmp_path / "p"), "cpu")
    with pytest.raises(ValueError, match="run_dir is empty"):
        TrainConfig(steps=2, run_dir=" ")
    with pytest.raises(CheckpointError, match="no run to resume in .*missing.run: it does not"):
        Trainer(_cfg(tmp_path / "missing"), ToyTask(), *_toy_model(), resume=True)
    assert not (tmp_path / "missing").exists()
    # a file there was a raw FileExistsError (a resume said the run did not exist)
    (tmp_path / "afile").write_text("x")
    for resume, run_dir in ((False, "afile"), (True, "afile"), (False, "afile/run")):
        cfg = _cfg(tmp_path, run_dir=str(tmp_path / run_dir))
        with pytest.raises(C.errors.ConfigError, match=r"run_dir=.*: .*afile is a file, not a"):
            Trainer(cfg, ToyTask(), *_toy_model(), resume=resume)


@pytest.mark.parametrize("size", [-5, 0, 2.5, "abc", True])
def test_a_reference_size_that_is_no_parameter_count_is_refused(tmp_path, size):
    """-5 drove every bond to rank 1 and reported negative compression, 0 was taken as
    none, and "abc" failed at the stage switch, naming no argument."""
    said = f"reference_size={size!r} must be a parameter count"
    with pytest.raises(C.errors.ConfigError, match=re.escape(said)):
        Trainer(_cfg(tmp_path / "r"), ToyTask(), *_toy_model(), reference_size=size)
    assert not (tmp_path / "r").exists()


def test_a_resume_with_another_reference_size_keeps_the_run_s_and_says_so(tmp_path):
    """A resume given another reference_size kept the saved one without a word; the same
    one (the commands pass it on every resume) says nothing."""
    import warnings

    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model(), reference_size=1000).fit(until=5)
    with pytest.warns(UserWarning, match="reference_size=5000 differs from the 1000"):
        tr = Trainer(cfg, ToyTask(), *_toy_model(), resume=True, reference_size=5000)
    assert tr.initial_size == 1000
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True, reference_size=1000)
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)


def test_steps_taken_by_hand_then_fit_equal_their_resume(tmp_path):
    """Steps and a checkpoint called outside fit draw from the process's streams as the
    run's; fit then continues from them, as a resume from that checkpoint does (it
    rewound to the streams the trainer was built with)."""
    cfg = _cfg(tmp_path / "a", steps=12)
    tr = Trainer(cfg, ToyTask(noise=0.1), *_toy_model())
    it = iter(tr.task.train_iter)
    for _ in range(3):
        tr.train_step(next(it))
        tr._after_step()
    tr.checkpoint()
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    tr.fit()
    again = Trainer(_cfg(tmp_path / "b", steps=12), ToyTask(noise=0.1), *_toy_model(),
                    resume=True)  # fmt: skip
    again.fit()
    for a, b in zip(tree_flatten(tr.params)[0], tree_flatten(again.params)[0], strict=True):
        assert torch.equal(a, b)


def test_other_forms_of_a_right_value_are_stored_plain():
    """A set or numpy array for a tuple field, numpy's bool and numbers were taken before
    the kind check; they still are, stored as plain Python values (JSON writes them)."""
    cfg = TrainConfig(steps=np.int64(3), run_dir="x", wandb_tags={"b", "a"}, bf16=np.False_,
                      grad_clip=np.float32(1.5),
                      optim=C.train.AdamWConfig(betas=np.array([0.9, 0.99])))  # fmt: skip
    assert (cfg.steps, cfg.wandb_tags, cfg.bf16, cfg.grad_clip) == (3, ("a", "b"), False, 1.5)
    assert cfg.optim.betas == (0.9, 0.99) and type(cfg.optim.betas[0]) is float
    json.dumps(dataclasses.asdict(cfg))
    # a pair from a set would take the set's arbitrary order; mixed kinds cannot sort
    with pytest.raises(ValueError, match=r"betas must be 2 numbers, got \{"):
        C.train.AdamWConfig(betas={0.5, 0.9})
    with pytest.raises(ValueError, match="wandb_tags must be a list of strings"):
        TrainConfig(steps=2, run_dir="x", wandb_tags={1, "a"})
    assert TrainConfig(steps=2, run_dir="x", grad_clip=10**400).grad_clip == math.inf
    mode = enum.Enum("Mode", {"EAGER": "eager"}, type=str)  # a str-mixin member: its value
    assert TrainConfig(steps=2, run_dir="x", step_mode=mode.EAGER).step_mode == "eager"
    with pytest.raises(ValueError, match="betas must be 2 numbers"):
        C.train.AdamWConfig(betas=np.array(0.9))
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0, got inf"):
        ComeraConfig(gamma=10**400)  # past a float's range: infinity, which it refuses


def test_steps_and_checkpoints_between_fits_draw_the_runs_streams(tmp_path):
    """After fit(until=k) the process holds the caller's streams again: a step or a
    checkpoint taken by hand then must use the run's (a checkpoint written between two
    fits saved the caller's, and the run went on from them)."""

    def params(tr):
        return tree_flatten(tr.params)[0]

    straight = Trainer(_cfg(tmp_path / "s", steps=10), ToyTask(noise=0.1), *_toy_model())
    straight.fit()
    paused = Trainer(_cfg(tmp_path / "p", steps=10), ToyTask(noise=0.1), *_toy_model())
    paused.fit(until=4)
    paused.checkpoint()
    paused.fit()
    assert all(torch.equal(a, b) for a, b in zip(params(straight), params(paused), strict=True))
    hand = Trainer(_cfg(tmp_path / "h", steps=10), ToyTask(noise=0.1), *_toy_model())
    hand.fit(until=4)
    shutil.copytree(tmp_path / "h", tmp_path / "r")
    for tr in (hand, Trainer(_cfg(tmp_path / "r", steps=10), ToyTask(noise=0.1), *_toy_model(),
                             resume=True)):  # fmt: skip
        it = iter(tr.task.train_iter)
        tr.train_step(next(it))
        tr._after_step()
        tr.fit()
    resumed = tr
    assert all(torch.equal(a, b) for a, b in zip(params(hand), params(resumed), strict=True))


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_an_empty_share_may_be_a_plain_zero(tmp_path, mode):
    """A micro-batch with no loss terms (count 0, which the trainer allows) may return a
    plain zero: autograd refused it (no gradient), and the first fix of the no-grad
    check only moved the failure one line down."""

    class SomeEmpty(ToyTask):
        seen = 0

        def loss(self, params, state, batch, *, train):
            self.seen += 1
            if self.seen % 2 == 0:  # every second micro-batch: no terms
                return torch.zeros(()), 0, {"accuracy": torch.tensor(0.0)}
            return super().loss(params, state, batch, train=train)

    cfg = _cfg(tmp_path, steps=4, accum_steps=2, step_mode=mode)
    out = Trainer(cfg, SomeEmpty(), *_toy_model()).fit()
    assert math.isfinite(out["loss"]) and out["loss_terms"] == 1

    class AllEmpty(ToyTask):
        def loss(self, params, state, batch, *, train):
            return torch.zeros(()), 0, {"accuracy": torch.tensor(0.0)}

    with pytest.raises(ValueError, match="the global batch has no loss terms"):  # said first
        Trainer(_cfg(tmp_path / "all", steps=2, accum_steps=2, step_mode=mode), AllEmpty(),
                *_toy_model()).fit()  # fmt: skip


def test_the_gradient_norm_of_finite_gradients_is_finite():
    """Per-leaf norms were combined in fp32: 20 leaves of norm 1e19 (finite, as gamma=1e20
    or rho=1e20 make them) summed squares past fp32's range, so the eager step stopped
    with "the gradient norm is inf" where the sync-free one (fp64) trained."""
    from comera.train.loop import _grad_norm

    norm = _grad_norm([torch.full((4,), 5e18) for _ in range(20)])
    assert math.isclose(float(norm), 4.472136e19, rel_tol=1e-6)
    assert math.isclose(float(_grad_norm([torch.full((1,), 3e38)] * 2)), 4.2426e38, rel_tol=1e-4)


def test_fit_of_a_finished_run_returns_its_last_metrics(tmp_path):
    """A resume of a run that had already finished trained nothing and returned {}, where
    fit is documented to return the last logged metrics plus the final eval."""
    first = Trainer(_cfg(tmp_path, steps=10, eval_every=5), ToyTask(), *_toy_model()).fit()
    again = Trainer(_cfg(tmp_path, steps=10, eval_every=5), ToyTask(), *_toy_model(),
                    resume=True).fit()  # fmt: skip
    assert again["step"] == 10 and "eval/mse" in again
    assert {k: again[k] for k in ("loss", "eval/mse")} == {
        k: first[k] for k in ("loss", "eval/mse")
    }


def test_a_failing_evaluation_keeps_the_checkpoint_due_at_its_step(tmp_path, capsys):
    """An evaluation that raises (out of memory on its batch, a bug in the task) ran
    before the step's checkpoint: the steps since the last one were lost, and with the
    default ``checkpoint_every=None`` a failing final evaluation lost the whole run. The
    checkpoint due at the step is saved first, and said; a resume goes on after it."""

    class FailsSecond(ToyTask):
        evals = 0

        def evaluate(self, params, state):
            FailsSecond.evals += 1
            if FailsSecond.evals == 2:
                raise RuntimeError("eval out of memory")
            return super().evaluate(params, state)

    cfg = _cfg(tmp_path, steps=40, eval_every=20, checkpoint_every=20)
    with pytest.raises(RuntimeError, match="eval out of memory"):
        Trainer(cfg, FailsSecond(), *_toy_model()).fit()
    saved = sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir())
    assert saved == ["step_00000020", "step_00000040"]
    assert "evaluation at step 40 failed; saved" in capsys.readouterr().err
    # the default: only the final checkpoint, which a failing final evaluation kept
    FailsSecond.evals = 1
    cfg = _cfg(tmp_path / "final", steps=30, eval_every=30)
    with pytest.raises(RuntimeError, match="eval out of memory"):
        Trainer(cfg, FailsSecond(), *_toy_model()).fit()
    assert load_checkpoint(cfg.run_dir)["step"] == 30
    # a pause's stop is a checkpoint too (fit(until=k) writes one at k)
    FailsSecond.evals = 1
    cfg = _cfg(tmp_path / "pause", steps=30, eval_every=15)
    with pytest.raises(RuntimeError, match="eval out of memory"):
        Trainer(cfg, FailsSecond(), *_toy_model()).fit(until=15)
    assert load_checkpoint(cfg.run_dir)["step"] == 15
    # an evaluation failing at a step no checkpoint is due at saves nothing
    FailsSecond.evals = 1
    cfg = _cfg(tmp_path / "mid", steps=30, eval_every=10, checkpoint_every=20)
    with pytest.raises(RuntimeError, match="eval out of memory"):
        Trainer(cfg, FailsSecond(), *_toy_model()).fit()
    assert not (tmp_path / "mid" / "run" / "checkpoints").exists() or not any(
        (tmp_path / "mid" / "run" / "checkpoints").iterdir()
    )


def test_the_progress_bar_is_drawn_at_its_own_pace(tmp_path, capsys):
    """``set_postfix`` redrew the bar at every logged step (a line per step in a log
    file, whatever ``mininterval`` said), and a task with no accuracy showed ``acc=nan``."""

    class NoAccuracy(ToyTask):
        def loss(self, params, state, batch, *, train):
            loss, count, _ = super().loss(params, state, batch, train=train)
            return loss, count, {}

    cfg = _cfg(tmp_path, steps=60, log_every=1, progress=True)
    Trainer(cfg, NoAccuracy(), *_toy_model()).fit()
    err = capsys.readouterr().err
    assert "loss=" in err and "acc=" not in err
    assert err.count("\r") < 20  # 60 logged steps drew 60 bars; tqdm draws about 1 a second


def test_rotation_spares_linked_checkpoints_and_names_are_checked(tmp_path):
    """A run whose checkpoints folder linked another run's step folders (a cheap branch)
    deleted that run's model.pt through the link when it rotated; a copy named step_030
    beside step_00000030 was read as the newest (a resume from the copy's step 20), and a
    folder holding another step's model was taken for its name's."""
    from comera.train.checkpoint import complete_checkpoints, write_model

    cfg = _cfg(tmp_path / "a", steps=30, checkpoint_every=10, keep_checkpoints=3)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    a = tmp_path / "a" / "run" / "checkpoints"
    b = tmp_path / "b" / "checkpoints"
    b.mkdir(parents=True)
    for name in ("step_00000010", "step_00000020"):
        (b / name).symlink_to(a / name, target_is_directory=True)
    (b / "step_00000030").mkdir()
    write_model(b / "step_00000030", {"x": 1}, keep=1)
    assert sorted(p.name for p in b.iterdir()) == ["step_00000030"]  # the links went
    assert all((a / n / "model.pt").is_file() for n in ("step_00000010", "step_00000020"))
    run = tmp_path / "a" / "run"
    shutil.copytree(a / "step_00000020", a / "step_030")
    assert [p.name for p in complete_checkpoints(run)][-1] == "step_00000030"
    assert load_checkpoint(run)["step"] == 30
    shutil.rmtree(a / "step_00000030")
    shutil.copytree(a / "step_00000020", a / "step_00000030")  # another step's files
    with pytest.raises(CheckpointError, match="holds step 20, not the step its folder"):
        load_checkpoint(run)


def test_a_checkpoints_path_that_is_a_file_is_refused_before_training(tmp_path):
    """A checkpoints path that is a file was found only at the first save, after training
    every step."""
    other = _cfg(tmp_path / "file", steps=10)
    (tmp_path / "file" / "run").mkdir(parents=True)
    (tmp_path / "file" / "run" / "checkpoints").write_text("x")
    with pytest.raises(CheckpointError, match="checkpoints is a file"):
        Trainer(other, ToyTask(), *_toy_model())


def test_an_evaluation_out_of_memory_frees_its_frames_before_the_save(tmp_path):
    """An out-of-memory evaluation's activations stay alive in its traceback's frames (a
    wrapped error's too, through ``__cause__``) while the due checkpoint is saved: they
    are cleared first. Other errors keep their frames for a debugger."""
    import weakref

    class Oom(ToyTask):
        held: weakref.ref | None = None
        error: type[BaseException] = MemoryError

        def evaluate(self, params, state):
            def activations():
                big = torch.ones(1000)
                Oom.held = weakref.ref(big)
                raise RuntimeError("inner")

            try:
                activations()
            except RuntimeError as e:
                raise Oom.error("evaluation out of memory") from e

    cfg = _cfg(tmp_path, steps=10, eval_every=10)
    with pytest.raises(MemoryError) as caught:
        Trainer(cfg, Oom(), *_toy_model()).fit()
    assert caught.value.__cause__ is not None  # the chain is kept, its frames emptied
    assert Oom.held() is None and load_checkpoint(cfg.run_dir)["step"] == 10
    # an out-of-memory error wrapped by the task (the chain's inner one) likewise
    inner = Oom.evaluate

    def wrapped(self, params, state):
        try:
            inner(self, params, state)
        except MemoryError as e:
            raise RuntimeError("wrapped") from e

    Oom.evaluate = wrapped
    with pytest.raises(RuntimeError, match="wrapped") as caught:
        Trainer(_cfg(tmp_path / "wrapped", steps=10, eval_every=10), Oom(), *_toy_model()).fit()
    assert Oom.held() is None
    Oom.evaluate = inner
    Oom.error = ValueError
    with pytest.raises(ValueError) as caught:
        Trainer(_cfg(tmp_path / "bug", steps=10, eval_every=10), Oom(), *_toy_model()).fit()
    assert Oom.held() is not None  # a bug's frames kept
    del caught


def test_a_flipped_byte_in_a_checkpoint_is_refused(tmp_path):
    """torch.load reads a damaged tensor's bytes as they are: one flipped bit in model.pt
    (bit rot, a bad copy) resumed silently from corrupted weights. The zip's CRCs are
    checked; the previous checkpoint is named."""
    import zipfile

    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    path = tmp_path / "run" / "checkpoints" / "step_00000020" / "model.pt"
    with zipfile.ZipFile(path) as z:
        info = next(i for i in z.infolist() if "/data/" in i.filename and i.file_size > 16)
    with open(path, "r+b") as f:
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        at = info.header_offset + 30 + name_len + extra_len + 4
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0x10]))
    with pytest.raises(CheckpointError, match=r"fails its check .*previous checkpoint is"):
        load_checkpoint(cfg.run_dir)
    # torch set to write no CRCs (its entries hold 0): such files load as before
    from torch.utils.serialization import config as serialization

    saved = serialization.save.compute_crc32
    serialization.save.compute_crc32 = False
    try:
        no_crc = _cfg(tmp_path / "no_crc", steps=10)
        Trainer(no_crc, ToyTask(), *_toy_model()).fit()
    finally:
        serialization.save.compute_crc32 = saved
    assert load_checkpoint(no_crc.run_dir)["step"] == 10
