"""The sync-free train step (``train.step_mode``): the eager loop's update, decided on the
device; compiled and CUDA-graph versions of it."""

import dataclasses

import pytest
import torch
from torch.utils._pytree import tree_flatten

import comera as C
from comera.errors import ConfigError
from comera.train import ComeraConfig, NonFiniteLoss, SGDConfig, Trainer, sync_free
from tests.train_helpers import SumCountTask, ToyTask, _cfg, _toy_model

STAGES = ComeraConfig(
    gamma=0.5, tau=0.05, early_steps=30, prune_every=10, reg_start_step=5, size_ratio=0.5
)


def _run(tmp_path, mode, task=None, steps=60, **kw):
    cfg = _cfg(tmp_path / mode, steps=steps, step_mode=mode, comera=kw.pop("comera", STAGES), **kw)
    tr = Trainer(cfg, task or ToyTask(noise=0.1), *_toy_model())
    rows = []
    it = iter(tr.task.train_iter)
    while tr.step < steps:
        rows.append(tr.train_step(*(next(it) for _ in range(cfg.accum_steps))))
        tr._after_step()
    return tr, rows


def _assert_same(a, b, rows_a, rows_b, tol):
    assert a.stage == b.stage == "late"
    assert a.ranks() == b.ranks()
    for x, y in zip(tree_flatten(a.params)[0], tree_flatten(b.params)[0], strict=True):
        torch.testing.assert_close(x, y, rtol=tol, atol=tol)
    assert rows_a[-1].keys() == rows_b[-1].keys()
    for ra, rb in zip(rows_a, rows_b, strict=True):
        for k in ra:
            assert ra[k] == pytest.approx(rb[k], rel=tol, abs=tol), (k, ra, rb)


@pytest.mark.parametrize("accum", [1, 2])
def test_sync_free_step_equals_eager_through_all_stages(tmp_path, accum):
    """Early stage with the regularizer switched on at step 5, prunes, the transition's
    compaction, late-stage weights chosen on the device: same ranks, parameters and logged
    metrics as the eager loop."""
    eager, rows_e = _run(tmp_path, "eager", accum_steps=accum)
    free, rows_f = _run(tmp_path, "sync_free", accum_steps=accum)
    _assert_same(eager, free, rows_e, rows_f, 1e-5)
    assert {r.get("focus_size") for r in rows_f[31:]} == {0.0, 1.0}  # both late branches ran
    assert eager.opt["step"] == free.opt["step"] == 60


class _NegativeLoss(ToyTask):
    """A loss that sits below 0 (a bound, a log-likelihood): the late stage's L0 too."""

    def loss(self, params, state, batch, *, train):
        out = super().loss(params, state, batch, train=train)
        return (out[0] - 10.0, *out[1:])


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_negative_loss_target_is_refused_only_where_it_is_used(tmp_path, mode):
    """A late stage that holds its size needs no L0, in either mode; one with a size term
    refuses a non-positive L0 in one ConfigError naming the setting that gives one."""
    held = dataclasses.replace(STAGES, size_ratio=1.0)
    tr, _ = _run(tmp_path / "held", mode, _NegativeLoss(), steps=40, comera=held)
    assert tr.stage == "late" and tr.targets["loss"] < 0
    with pytest.raises(ConfigError, match="train.comera.loss_target"):
        _run(tmp_path / "size", mode, _NegativeLoss(), steps=40)


def test_sync_free_sgd_and_sum_count_task(tmp_path):
    kw = dict(optimizer="sgd", sgd=SGDConfig(lr=0.05, lr_gates=0.2))
    eager, rows_e = _run(tmp_path, "eager", task=SumCountTask(), **kw)
    free, rows_f = _run(tmp_path, "sync_free", task=SumCountTask(), **kw)
    _assert_same(eager, free, rows_e, rows_f, 1e-5)


def test_sync_free_non_finite_updates_nothing(tmp_path):
    cfg = _cfg(tmp_path, step_mode="sync_free")
    tr = Trainer(cfg, ToyTask(nan_at=4), *_toy_model())
    it = iter(tr.task.train_iter)
    for _ in range(3):
        tr.train_step(next(it))
        tr._after_step()
    before = [t.clone() for t in tree_flatten([tr.params, tr.opt["m"], tr.opt["v"]])[0]]
    with pytest.raises(NonFiniteLoss, match="loss is nan at step 4"):
        tr.train_step(next(it))
    assert tr.step == 3 and tr.opt["step"] == 3
    after = tree_flatten([tr.params, tr.opt["m"], tr.opt["v"]])[0]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_step_mode_errors(tmp_path):
    with pytest.raises(ValueError, match="step_mode='turbo'"):
        _cfg(tmp_path, step_mode="turbo")
    with pytest.raises(ValueError, match="cuda_graph' needs a CUDA device"):
        Trainer(_cfg(tmp_path, step_mode="cuda_graph"), ToyTask(), *_toy_model())
    assert not (tmp_path / "run").exists()  # it was made, empty, before the refusal


class _PureToy(ToyTask):
    """The toy task without Python state changes in ``loss`` (compiled code would
    otherwise be specialized to, and recompiled for, every call count)."""

    def loss(self, params, state, batch, *, train):
        dev = params["lin"]["cores"][0].device  # the batches are made on the CPU
        x, y = (t.to(dev, non_blocking=True) for t in batch)
        pred = C.tt_linear(params["lin"], state["lin"], x)
        return (pred - y).pow(2).sum(), len(y), {"accuracy": pred.new_zeros(())}


def test_compiled_step_is_one_graph_and_equals_sync_free(tmp_path, monkeypatch):
    """``compile`` captures forward, backward and the update without a graph break, and
    trains like the uncompiled step through prunes, compaction and the late stage."""
    monkeypatch.setattr(sync_free, "COMPILE_BACKEND", "aot_eager")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    ref, rows_r = _run(tmp_path, "sync_free", task=_PureToy())
    comp, rows_c = _run(tmp_path, "compile", task=_PureToy())
    assert not torch._dynamo.utils.counters["graph_break"], dict(
        torch._dynamo.utils.counters["graph_break"]
    )
    # early, then one rebuild per compaction (transition, final) and none per prune
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4
    _assert_same(ref, comp, rows_r, rows_c, 1e-4)
    torch._dynamo.reset()


def test_cli_step_mode_flags(tmp_path, capsys):
    from experiments import cli
    from experiments.mnli import experiment as mnli

    fast = ["--preset", "smoke", "--wandb", "disabled", "--no-progress", "--set",
            "train.steps=3", "--set", "train.eval_every=None", "--set",
            "data.generated_train=200", "--set", "data.generated_eval=30"]  # fmt: skip
    run = tmp_path / "run"
    assert mnli.main([*fast, "--run-dir", str(run), "--step-mode", "sync_free"]) == 0
    ap = cli.build_parser(mnli.EXPERIMENT)
    cfg = cli.resolve_config(
        mnli.EXPERIMENT, ap.parse_args(["--resume", str(run), "--compile"]), ap
    )
    assert cfg.train.step_mode == "compile"  # how the step runs may change on resume
    capsys.readouterr()
    for both in (["--compile", "--step-mode", "eager"], ["--step-mode", "sync_free", "--compile"]):
        assert mnli.main([*fast, "--run-dir", str(tmp_path / "b"), *both]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--compile is --step-mode compile" in err[0]
    assert not (tmp_path / "b").exists()
    assert mnli.main([*fast, "--run-dir", str(tmp_path / "t"), "--step-mode", "turbo"]) == 2
    assert "invalid choice: 'turbo'" in capsys.readouterr().err.splitlines()[-1]
    bad = [*fast, "--run-dir", str(tmp_path / "g"), "--dense", "--set", "train.optimizer=galore"]
    assert mnli.main([*bad, "--step-mode", "sync_free"]) == 2
    assert "step_mode='sync_free' cannot run GaLore" in capsys.readouterr().err.splitlines()[-1]
    rc = [*fast, "--run-dir", str(tmp_path / "r"), "--compile", "--recompute"]
    for dropout in ("0.1", "0.0"):  # at 0 too: the recomputed block holds RNG ops
        assert mnli.main([*rc, "--set", f"model.dropout={dropout}"]) == 2
        assert "model.recompute cannot be compiled" in capsys.readouterr().err


class _HugeGradTask(_PureToy):
    """A finite loss whose gradient norm overflows from the fourth call on."""

    calls = 0

    def loss(self, params, state, batch, *, train):
        s, n, metrics = super().loss(params, state, batch, train=train)
        type(self).calls += 1
        return (s * 1e30 if type(self).calls >= 4 else s), n, metrics


def test_sync_free_inf_gradient_norm_without_clipping_updates_nothing(tmp_path):
    """g * g overflows in the second moment: the gated update must still be a no-op."""
    _HugeGradTask.calls = 0
    tr = Trainer(_cfg(tmp_path, step_mode="sync_free", grad_clip=None), _HugeGradTask(),
                 *_toy_model())  # fmt: skip
    it = iter(tr.task.train_iter)
    for _ in range(3):
        tr.train_step(next(it))
    before = [t.clone() for t in tree_flatten([tr.params, tr.opt["m"], tr.opt["v"]])[0]]
    with pytest.raises(NonFiniteLoss, match="gradient norm is inf at step 4"):
        tr.train_step(next(it))
    after = tree_flatten([tr.params, tr.opt["m"], tr.opt["v"]])[0]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))


def test_compile_mode_names_the_torch_it_needs(monkeypatch) -> None:
    """``step_mode='compile'`` traces autograd.grad (torch >= 2.11): on an older torch,
    whose dynamo config lacks ``trace_autograd_ops``, a clear error names the fix."""
    import types

    import torch._dynamo

    from comera.train.sync_free import require_traceable_grad

    require_traceable_grad()  # this torch has it
    monkeypatch.setattr(torch._dynamo, "config", types.SimpleNamespace())
    with pytest.raises(ValueError, match=r"torch >= 2.11 .*--step-mode sync_free"):
        require_traceable_grad()


@pytest.mark.parametrize("accum", [1, 2])
def test_sync_free_refuses_a_loss_that_reaches_no_parameter(tmp_path, accum):
    """The eager step refuses, at the first step, a loss that reaches none of the
    trainer's leaves; the sync-free step filled the missing gradients with zeros and
    trained nothing, silently. Which gradients exist is known without reading the device,
    so the step carries the answer in the read it makes anyway, and updates nothing."""
    other = torch.randn(16, 16, requires_grad=True)

    class Elsewhere(ToyTask):
        def loss(self, params, state, batch, *, train):
            x, y = batch
            return (x @ other - y).pow(2).mean(), 1, {}

    class Detached(ToyTask):  # every micro-batch's sum detached, or only the second's
        def __init__(self, every):
            super().__init__()
            self.every, self.seen = every, 0

        def loss(self, params, state, batch, *, train):
            s, n, m = super().loss(params, state, batch, train=train)
            self.seen += 1
            return (s.detach() if self.every or self.seen % 2 == 0 else s), n, m

    cases = [(Elsewhere(), "reaches none of the parameters"),
             (Detached(True), "does not depend on the parameters")]  # fmt: skip
    if accum > 1:  # the eager step refused this; the sync-free one trained on the rest
        cases.append((Detached(False), "does not depend on the parameters"))
    for i, (task, said) in enumerate(cases):
        cfg = _cfg(tmp_path / str(i), steps=3, accum_steps=accum, step_mode="sync_free")
        tr = Trainer(cfg, task, *_toy_model())
        before = [t.clone() for t in tree_flatten(tr.params)[0]]
        with pytest.raises(ConfigError, match=said):
            tr.fit()
        assert tr.step == 0
        for a, b in zip(before, tree_flatten(tr.params)[0], strict=True):
            assert torch.equal(a, b)
    _run(tmp_path / "ok", "sync_free", steps=3, accum_steps=accum)
