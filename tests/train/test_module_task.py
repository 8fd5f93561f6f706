"""``ModuleTask``: a tensorized ``nn.Module`` trained by the shared trainer, with rank
adaptation; the module follows the trainer through compaction and resume."""

from __future__ import annotations

import json

import torch
from torch import nn

import comera as C
from comera.tensor_train import bond_ranks
from comera.train.module_task import ModuleTask
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
