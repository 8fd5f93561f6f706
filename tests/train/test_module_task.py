"""``ModuleTask``: a tensorized ``nn.Module`` trained by the shared trainer, with rank
adaptation; the module follows the trainer through compaction and resume."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import comera as C
from comera.errors import CheckpointError, ConfigError
from comera.tensor_train import bond_ranks
from comera.train.module_task import BUFFERS, ModuleTask
from tests.train_helpers import _cfg, _Iter


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16), nn.LayerNorm(16))  # fmt: skip
    C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "2", "4"), rank=8, cores=2,
                                          min_compression=0))  # fmt: skip
    return model


def _task(model: nn.Module) -> ModuleTask:
    g = torch.Generator().manual_seed(123)
    w = (torch.randn(16, 2, generator=g) @ torch.randn(2, 16, generator=g)) / 4

    def loss(call, batch):
        x, y = batch
        return (call(x) - y).pow(2).mean()

    def evaluate(call):
        x, y = next(_Iter(w, batch=64, seed=99))
        return {"mse": float((call(x) - y).pow(2).mean())}

    return ModuleTask(model, loss, _Iter(w), evaluate=evaluate)


def test_a_tensorized_module_trains_prunes_compacts_and_resumes(tmp_path) -> None:
    model = _model()
    task = _task(model)
    assert set(task.state()) == {"0", "2", "4"}
    trainer = task.trainer(_cfg(tmp_path, steps=60, checkpoint_every=20))
    out = trainer.fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert losses[-1] < 0.5 * losses[0] and out["step"] == 60
    assert trainer.evaluate()["mse"] < losses[0]
    ranks = {p: bond_ranks(trainer.params[p]) for p in ("0", "2", "4")}
    assert any(r < 8 for rs in ranks.values() for r in rs)  # compaction removed ranks
    for path in ("0", "2", "4"):  # the module holds exactly the trainer's tensors
        layer = model.get_submodule(path)
        assert bond_ranks(layer.params()) == ranks[path]
        for a, b in zip(layer.params()["cores"], trainer.params[path]["cores"], strict=True):
            assert a.data_ptr() == b.data_ptr()
    x = torch.randn(5, 16)
    with torch.no_grad():
        plain = model(x)
        through = task._call(trainer.params, trainer.state)(x)  # noqa: SLF001 - the path a step runs
    torch.testing.assert_close(plain, through)

    # a new process rebuilds the model at its initial ranks; resuming restores the
    # compacted tensors into it
    fresh = _model()
    again = _task(fresh).trainer(_cfg(tmp_path, steps=60, checkpoint_every=20), resume=True)
    assert again.step == 60
    assert {p: bond_ranks(fresh.get_submodule(p).params()) for p in ranks} == ranks
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), plain)


def _bn_model() -> nn.Module:
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.ReLU(), nn.Linear(64, 16))
    C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "3"), rank=8, cores=2,
                                          min_compression=0))  # fmt: skip
    return model


def test_batch_norm_statistics_are_checkpointed_and_restored(tmp_path) -> None:
    """The module's persistent buffers ride in the state: updated in place as it trains,
    saved with the checkpoint and put back on resume (a fresh module's statistics would
    be the initial zeros and ones)."""
    model = _bn_model()
    task = _task(model)
    assert set(task.state()[BUFFERS]) == {"1.running_mean", "1.running_var",
                                          "1.num_batches_tracked"}  # fmt: skip
    trainer = task.trainer(_cfg(tmp_path, steps=30, checkpoint_every=30))
    trainer.fit()
    bn = model.get_submodule("1")
    assert int(bn.num_batches_tracked) == 30 and float(bn.running_mean.abs().sum()) > 0
    assert trainer.state[BUFFERS]["1.running_mean"] is bn.running_mean  # the module's own
    count = trainer.state[BUFFERS]["1.num_batches_tracked"]  # 0-dim: held as one element
    assert count.shape == (1,) and count.data_ptr() == bn.num_batches_tracked.data_ptr()
    fresh = _bn_model()
    again = _task(fresh).trainer(_cfg(tmp_path, steps=30, checkpoint_every=30), resume=True)
    fresh_bn = fresh.get_submodule("1")
    torch.testing.assert_close(fresh_bn.running_mean, bn.running_mean)
    torch.testing.assert_close(fresh_bn.running_var, bn.running_var)
    assert int(fresh_bn.num_batches_tracked) == 30
    x = torch.randn(5, 16)
    model.eval()
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(x), model(x))
        through = again.task._call(again.params, again.state)(x)  # noqa: SLF001
        torch.testing.assert_close(through, model(x))


def test_a_frozen_tt_layer_is_neither_trained_nor_pruned(tmp_path) -> None:
    model = _model()
    frozen = model.get_submodule("2")
    frozen.requires_grad_(False)
    before = [c.detach().clone() for c in frozen.params()["cores"]]
    task = _task(model)
    assert set(task.params()) == {"0", "4", "5.weight", "5.bias"}
    trainer = task.trainer(_cfg(tmp_path, steps=60))
    trainer.fit()
    after = frozen.params()["cores"]
    assert bond_ranks(frozen.params()) == [8, 8, 8]  # not compacted
    for a, b in zip(before, after, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert any(r < 8 for p in ("0", "4") for r in bond_ranks(trainer.params[p]))

    # every TT layer frozen: said so (the trainer said the model holds no TT layer)
    still = _model()
    for path in ("0", "2", "4"):
        still.get_submodule(path).requires_grad_(False)
    with pytest.raises(ConfigError, match=r"every TT layer is frozen \(0, 2, 4\)"):
        _task(still).trainer(_cfg(tmp_path / "still", steps=2))
    off = C.train.ComeraConfig(enabled=False)  # dense training of the rest is fine
    assert _task(still).trainer(_cfg(tmp_path / "off", steps=2, comera=off)).fit()["step"] == 2

    mixed = _model()
    mixed.get_submodule("2").cores[0].requires_grad_(False)
    with pytest.raises(ValueError, match="TT layer '2' has frozen tensors"):
        _task(mixed)


def test_a_resume_onto_other_frozen_weights_is_refused(tmp_path) -> None:
    """A checkpoint holds only what trains: a resume onto a model rebuilt with other
    frozen weights (another seed, another backbone file) trained on from another model
    without a word. The frozen tensors' fingerprints are checked, up to the rounding and
    signs in which a TT-SVD at another thread count differs."""

    def model(seed: int) -> nn.Module:
        m = _model()
        m.get_submodule("2").requires_grad_(False)
        with torch.no_grad():
            m.get_submodule("5").weight.normal_(generator=torch.Generator().manual_seed(seed))
        m.get_submodule("5").requires_grad_(False)
        return m

    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    _task(model(0)).trainer(cfg).fit(until=10)
    other = model(1)
    start = [c.clone() for c in other.get_submodule("0").cores]
    refused = r"than this run built .*these differ: 5.weight \(values\)\); rebuild the model"
    with pytest.raises(CheckpointError, match=refused):
        _task(other).trainer(cfg, resume=True)
    # refused before the checkpoint's tensors went into the caller's module
    held = other.get_submodule("0").cores
    assert all(torch.equal(a, b) for a, b in zip(start, held, strict=True))
    resumed = model(0)
    with torch.no_grad():  # a frozen TT layer's cores are named too
        resumed.get_submodule("2").cores[1].mul_(2)
    with pytest.raises(CheckpointError, match=r"these differ: 2\(probe\) \(values\)\)"):
        _task(resumed).trainer(cfg, resume=True)
    rebuilt = model(0)
    with torch.no_grad():  # the same weights built again: other last bits, other signs
        rebuilt.get_submodule("2").cores[1].mul_(-(1 + 1e-6))
        rebuilt.get_submodule("2").cores[2].mul_(-1)
        rebuilt.get_submodule("5").weight.add_(1e-7)
    again = _task(rebuilt).trainer(cfg, resume=True)
    assert again.fit()["step"] == 20
    # the resumed run's checkpoint records them too
    assert _task(model(0)).trainer(cfg, resume=True).step == 20
    with pytest.raises(CheckpointError, match="these differ: 5.weight"):
        _task(model(2)).trainer(cfg, resume=True)


def test_fingerprints_match_a_rebuild_and_tell_other_values() -> None:
    """A frozen tensor holding NaN (or inf) must match itself, or no resume of it could
    go on; zeros, integers, bools and tensors of fewer elements than samples match
    themselves and not other values."""
    from comera.train.checkpoint import _alike, _fingerprint

    g = torch.Generator().manual_seed(0)
    nan = torch.randn(100, generator=g)
    nan[3] = float("nan")
    inf = torch.randn(100, generator=g)
    inf[5] = float("inf")
    for t in (nan, inf, torch.zeros(10), torch.arange(7), torch.ones(3, dtype=torch.bool),
              torch.randn(2, generator=g), torch.tensor(1.5)):  # fmt: skip
        assert _alike(_fingerprint(t), _fingerprint(t.clone())) is None, t
        assert _alike(_fingerprint(t), _fingerprint(t + 1)), t
    assert _alike(_fingerprint(torch.zeros(3)), _fingerprint(torch.zeros(3).double())) == (
        "dtype float32 saved, float64 now"
    )
    big = torch.full((4,), 1e300, dtype=torch.float64)  # past float32: its sums stay finite
    assert _alike(_fingerprint(big), _fingerprint(big.clone())) is None
    # sparse +-1 tensors of other seeds: one rms, and most samples land on zeros
    a, b = (torch.zeros(100_000) for _ in range(2))
    for t, seed in ((a, 1), (b, 2)):
        idx = torch.randperm(100_000, generator=torch.Generator().manual_seed(seed))[:1000]
        t[idx] = 1.0
    assert _alike(_fingerprint(a), _fingerprint(b)) == "values"
    # one row of a frozen embedding redrawn, or zeroed: its block moves
    emb = torch.randn(30522, 128, generator=torch.Generator().manual_seed(4))
    for change in (lambda e: e[5].normal_(), lambda e: e[5].zero_()):
        other = emb.clone()
        change(other)
        assert _alike(_fingerprint(emb), _fingerprint(other)) == "values"


def test_a_frozen_tt_layer_is_fingerprinted_by_what_it_computes() -> None:
    """A TT-SVD at another thread count gives other cores (entries up to twice the
    tolerance apart at rank 64, a near-degenerate split rotated), yet the same layer: a
    frozen TT layer is fingerprinted by its output on fixed probes."""
    from comera.train.checkpoint import _alike, _fingerprint

    threads = torch.get_num_threads()
    prints = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            torch.manual_seed(0)
            model = nn.Sequential(nn.Embedding(5000, 256), nn.Linear(1024, 1024))
            C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "1"), rank=64, cores=2,
                                                  min_compression=0, init="svd"))  # fmt: skip
            model.requires_grad_(False)
            named = ModuleTask(model, lambda call, b: call(b), _Iter(None)).replicated_named()
            assert set(named) == {"0(probe)", "1(probe)"}  # no core among them
            prints.append({k: _fingerprint(v) for k, v in named.items()})
    finally:
        torch.set_num_threads(threads)
    assert all(_alike(prints[0][k], prints[1][k]) is None for k in prints[0])


def test_a_resume_reads_the_saved_positions_and_skips_old_digests(tmp_path) -> None:
    """The sampled positions are saved, so a change in how torch draws them refuses
    nothing; an entry written by an earlier build (a byte digest) is not checked."""
    import types

    from comera.train.checkpoint import _fingerprint, check_replicated

    t = torch.randn(50, generator=torch.Generator().manual_seed(3))
    tr = types.SimpleNamespace(task=types.SimpleNamespace(replicated_tensors=lambda: [t]),
                               run_dir=tmp_path)  # fmt: skip
    saved = _fingerprint(t, picks=[0, 49, 7])
    assert saved["picks"] == [0, 49, 7] and len(saved["abs"]) == 3
    check_replicated(tr, {"replicated tensor 0": saved})  # read at those positions
    check_replicated(tr, {"replicated tensor 0": "float32[50]:3f9a"})  # an old digest
    check_replicated(tr, None)  # a checkpoint from before fingerprints
    other = _fingerprint(t + 1, picks=[0, 49, 7])
    with pytest.raises(CheckpointError, match=r"these differ: replicated tensor 0 \(values\)\)"):
        check_replicated(tr, {"replicated tensor 0": other})
    with pytest.raises(CheckpointError, match=r"these differ: extra \(saved only\)\)"):
        check_replicated(tr, {"replicated tensor 0": saved, "extra": saved})


class _Counting(nn.Module):
    """A module that counts the rows it saw by assigning its buffer anew each call."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            self.seen = self.seen + x.shape[0]
        return x


def test_a_buffer_assigned_anew_is_kept_and_checkpointed(tmp_path) -> None:
    def model() -> nn.Module:
        m = _model()
        m.append(_Counting())
        return m

    trained = model()
    trainer = _task(trained).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20))
    held = trainer.state[BUFFERS]["6.seen"].data_ptr()
    trainer.fit()
    assert int(trained.get_submodule("6").seen) == 20 * 16  # 20 batches of 16 rows
    # copied into the state's own tensor: the state keeps its leaves (a captured step
    # holds their addresses)
    assert trained.get_submodule("6").seen.data_ptr() == held
    fresh = model()
    again = _task(fresh).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20), resume=True)
    assert int(fresh.get_submodule("6").seen) == 320
    assert again.state[BUFFERS]["6.seen"].shape == (1,)


def test_resuming_with_another_set_of_trained_tt_layers_is_refused(tmp_path) -> None:
    _task(_model()).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20)).fit()
    model = _model()
    model.get_submodule("2").requires_grad_(False)  # frozen since the run was saved
    # refused by the checkpoint's check of the model, before the module's own
    refused = r"holds other parameters than this run builds \(saved only: \['2'\]\);"
    with pytest.raises(CheckpointError, match=refused):
        _task(model).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20), resume=True)
    model = _model()
    model.get_submodule("5").requires_grad_(False)  # a dense layer frozen since
    with pytest.raises(CheckpointError, match=r"saved only: \['5.weight', '5.bias'\]"):
        _task(model).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20), resume=True)
    # every layer tensorized into three cores a side, not two: said "saved only" of
    # layers this run builds too
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                          nn.Linear(64, 16), nn.LayerNorm(16))  # fmt: skip
    C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "2", "4"), rank=8, cores=3,
                                          min_compression=0))  # fmt: skip
    other = r"held as other tensors \(another number of cores, .*\?\): \['0', '2', '4'\]\)"
    with pytest.raises(CheckpointError, match=other):
        _task(model).trainer(_cfg(tmp_path, steps=20, checkpoint_every=20), resume=True)


@pytest.mark.slow
def test_batch_norm_trains_under_the_compiled_step(tmp_path) -> None:
    """``step_mode="compile"`` refuses 0-dim leaves (it would drop their in-place
    updates); batch norm's step count rides as a one-element view and keeps counting."""
    model = _bn_model()
    _task(model).trainer(_cfg(tmp_path, steps=4, step_mode="compile")).fit()
    bn = model.get_submodule("1")
    assert int(bn.num_batches_tracked) == 4 and float(bn.running_mean.abs().sum()) > 0


def test_tuning_plans_leaves_the_running_statistics_alone(tmp_path) -> None:
    """``tune_plans`` runs one extra training forward before a traced step: on a copy of
    the state, so batch norm counts only the steps, as without ``auto`` plans."""
    model = _bn_model()
    trainer = _task(model).trainer(_cfg(tmp_path, steps=2), auto_plans=True)
    bn = model.get_submodule("1")
    before = {n: b.clone() for n, b in bn.named_buffers()}
    trainer.tune_plans(next(iter(trainer.task.train_iter)))
    for n, b in bn.named_buffers():
        assert torch.equal(b, before[n]), n
    assert trainer.state[BUFFERS]["1.running_mean"] is bn.running_mean
    trainer.fit()
    assert int(bn.num_batches_tracked) == 2


def test_a_prune_between_compactions_reaches_the_module(tmp_path) -> None:
    """The trainer's prune events write the new masks into the tensors the module holds:
    ``model(x)`` (an eval callback, ``state_dict``, ``save_pretrained``) computes with the
    trainer's ranks during training and after a pause, not with the ones it started with."""
    from comera.train.config import ComeraConfig

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
    C.tensorize_(model, C.TensorizeConfig(target_modules=("0", "2"), rank=8, cores=2,
                                          min_compression=0))  # fmt: skip
    task = _task(model)
    cfg = _cfg(tmp_path, steps=100, comera=ComeraConfig(gamma=0.5, tau=0.9, early_steps=40,
                                                         prune_every=10))  # fmt: skip
    trainer = task.trainer(cfg)
    trainer.fit(until=12)  # a prune event at step 10, no compaction yet
    live = {p: [int(m.sum()) for m in model.get_submodule(p).state()["masks"]] for p in "02"}
    assert live == trainer.ranks() and live != {"0": [8], "2": [8]}
    x = torch.randn(5, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(x), task._call(trainer.params, trainer.state)(x))


def test_a_model_with_nothing_to_adapt_or_a_loss_that_is_no_scalar_is_named(tmp_path) -> None:
    """CoMERA on a model with no TT layer is refused when the trainer is built, naming
    ``train.comera.enabled`` (the first step's regularizer failed, naming nothing); a
    ``loss_fn`` that returns a batch of losses is refused at its first call (a broadcast
    error deep in the step)."""
    dense = nn.Sequential(nn.Linear(16, 16))
    task = _task(dense)
    with pytest.raises(ConfigError, match="train.comera.enabled is on but the model holds no"):
        task.trainer(_cfg(tmp_path / "refused"))
    assert not (tmp_path / "refused").exists()  # refused before its run dir was made
    off = C.train.ComeraConfig(enabled=False)
    assert task.trainer(_cfg(tmp_path / "dense", steps=2, comera=off)).fit()["step"] == 2
    model = _model()
    per_row = ModuleTask(model, lambda call, b: (call(b[0]) - b[1]).pow(2).mean(-1), _Iter(None))
    x, y = torch.randn(4, 16), torch.randn(4, 16)
    with pytest.raises(ValueError, match=r"loss_fn returned a loss of shape \(4,\); return a"):
        per_row.loss(per_row.params(), per_row.state(), (x, y), train=True)
    as_list = ModuleTask(model, lambda call, b: [(call(b[0]) - b[1]).pow(2).sum(), 4, {}],
                         _Iter(None))  # fmt: skip
    assert as_list.loss(as_list.params(), as_list.state(), (x, y), train=True)[1] == 4


def test_an_evaluate_taking_rank_and_world_gets_this_ranks_share(tmp_path) -> None:
    """ModuleTask.evaluate took no rank or world, so under torchrun every rank evaluated
    the whole held-out split (right numbers, world times the work). An ``evaluate`` that
    takes them is passed them; one that does not is called as before."""
    model = _model()
    x = torch.randn(10, 16, generator=torch.Generator().manual_seed(1))

    def share(call, *, rank, world):
        lo, hi = rank * 10 // world, (rank + 1) * 10 // world
        return {"sq": (float(call(x[lo:hi]).pow(2).sum()), float(hi - lo))}

    task = ModuleTask(model, lambda call, b: call(b).sum(), iter([]), evaluate=share)
    params, state = task.params(), task.state()
    parts = [task.evaluate(params, state, rank=r, world=2)["sq"] for r in range(2)]
    whole = task.evaluate(params, state)["sq"]
    assert [n for _, n in parts] == [5.0, 5.0] and whole[1] == 10.0
    assert sum(s for s, _ in parts) == pytest.approx(whole[0], rel=1e-6)
    assert task.trainer(_cfg(tmp_path, steps=1)).evaluate()["sq"] == pytest.approx(whole[0] / 10)
    plain = ModuleTask(
        model, lambda call, b: call(b).sum(), iter([]), evaluate=lambda call: {"a": 1.0}
    )
    assert plain.evaluate(params, state, rank=1, world=2) == {"a": 1.0}


def test_a_tt_layer_trained_alone_is_one_layer(tmp_path) -> None:
    """A bare TTLinear as the model has the path ``""``: its tensors were named
    ``.cores.0``, so they were taken a second time as plain parameters and its masks as
    buffers, and the first step failed inside autograd."""
    layer = C.TTLinear(C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4))
    g = torch.Generator().manual_seed(0)
    task = ModuleTask(layer, lambda call, x: call(x).pow(2).mean(),
                      iter(lambda: torch.randn(8, 16, generator=g), None))  # fmt: skip
    assert list(task.params()) == [""] and list(task.state()) == [""]
    comera = C.train.ComeraConfig(gamma=0.5, tau=0.3, early_steps=4, prune_every=2)
    trainer = task.trainer(_cfg(tmp_path, steps=8, comera=comera))
    trainer.fit()
    assert trainer.step == 8
    for a, b in zip(layer.params()["cores"], trainer.params[""]["cores"], strict=True):
        assert a.data_ptr() == b.data_ptr()  # the module holds what was trained
