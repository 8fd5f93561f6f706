"""The GaLore optimizer of the dense baseline: training, resume, refusals."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from comera.train import TrainConfig


class _DenseToy:
    """Fit a linear map with a dense 32 x 32 weight (GaLore projects it) and a bias."""

    def __init__(self) -> None:
        from tests.train_helpers import _Iter

        g = torch.Generator().manual_seed(5)
        self.w = torch.randn(32, 32, generator=g) / 6
        self.train_iter = _Iter(self.w)

    def loss(self, params, state, batch, *, train):
        x, y = batch
        pred = torch.nn.functional.linear(x, params["w"], params["b"])
        return (pred - y).pow(2).sum(), y.numel(), {}

    def evaluate(self, params, state):
        return {}


def _galore_trainer(tmp_path: Path, steps: int, resume: bool = False):
    from comera.train import ComeraConfig, Trainer
    from comera.train.galore import GaLoreConfig
    from comera.train.optim import AdamWConfig

    cfg = TrainConfig(
        steps=steps, run_dir=str(tmp_path), optimizer="galore", checkpoint_every=5,
        galore=GaLoreConfig(rank=8, update_proj_gap=4, scale=1.0, targets=("w",)),
        optim=AdamWConfig(lr_rest=3e-2, weight_decay=0.0), comera=ComeraConfig(enabled=False),
        wandb="disabled", progress=False, schedule="constant",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(32, 32, generator=g) * 0.01, "b": torch.zeros(32)}
    return Trainer(cfg, _DenseToy(), params, {}, resume=resume)


def test_galore_trains_the_dense_baseline_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    whole = _galore_trainer(tmp_path / "whole", 40)
    assert whole.galore.projected == 1  # the 32 x 32 weight; the bias is plain AdamW
    first = whole.train_step(next(iter(whole.task.train_iter)))["loss"]
    whole.fit()
    last = whole.train_step(next(iter(whole.task.train_iter)))["loss"]
    assert last < 0.5 * first
    part = _galore_trainer(tmp_path / "part", 12)
    part.fit()  # writes checkpoints at 5 and 10 (and 12)
    import shutil

    from comera.train.checkpoint import complete_checkpoints

    shutil.rmtree(complete_checkpoints(tmp_path / "part")[-1])  # back to step 10
    again = _galore_trainer(tmp_path / "part", 12, resume=True)
    assert again.step == 10 and again.galore.torch.state  # projector and moments restored
    again.fit()
    for a, b in zip((part.params["w"], part.params["b"]), (again.params["w"], again.params["b"]),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_galore_is_refused_for_a_comera_run_and_on_resume_from_adamw(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    from comera.train import CheckpointError
    from comera.train.optim import adamw_init

    with pytest.raises(ValueError, match="optimizer='galore' trains the dense baseline"):
        TrainConfig(steps=1, run_dir="x", optimizer="galore")
    adamw = _galore_trainer(tmp_path, 5)
    adamw.cfg = dataclasses.replace(adamw.cfg, optimizer="adamw")
    adamw.opt, adamw.galore = adamw_init(adamw.params), None
    adamw.fit()  # an AdamW run with a checkpoint at step 5
    with pytest.raises(CheckpointError, match="holds adamw optimizer state.*'galore'"):
        _galore_trainer(tmp_path, 5, resume=True)


def test_galore_is_refused_for_a_model_with_tt_layers(tmp_path: Path) -> None:
    """With the rank adaptation off a TT model still reached GaLore, which holds the leaves
    it was built over: after a compaction its new cores went untrained, silently."""
    pytest.importorskip("galore_torch")
    import comera as C
    from comera.errors import ConfigError
    from comera.train import ComeraConfig, Trainer
    from comera.train.galore import GaLoreConfig

    tt, st = C.init(C.TTLinearSpec(out_modes=(4, 8), in_modes=(8, 4), ranks=4),
                    generator=torch.Generator().manual_seed(0))  # fmt: skip
    galore = GaLoreConfig(rank=4, targets=("w",))  # the dense weight: GaLore has work
    cfg = TrainConfig(steps=2, run_dir=str(tmp_path / "run"), optimizer="galore", galore=galore,
                      comera=ComeraConfig(enabled=False), wandb="disabled",
                      progress=False)  # fmt: skip
    params = {"w": torch.eye(32), "tt": tt}
    with pytest.raises(ConfigError, match="holds TT/TTM layers.*optimizer='adamw'"):
        Trainer(cfg, _DenseToy(), params, {"tt": st})
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_galore_decays_matrices_only_and_reads_states_of_the_old_grouping() -> None:
    """Weight decay as the trainer's AdamW applies it (matrices, not biases or gains);
    a state saved when all unprojected leaves shared one group loads leaf by leaf."""
    pytest.importorskip("galore_torch")
    from galore_torch import GaLoreAdamW

    from comera.train.galore import GaLore, GaLoreConfig

    g = torch.Generator().manual_seed(0)
    base = {"w": torch.randn(32, 32, generator=g), "e": torch.randn(4, 32, generator=g),
            "b": torch.ones(32)}  # fmt: skip
    cfg = GaLoreConfig(rank=8, update_proj_gap=4, scale=1.0, targets=("w",))
    tree = {k: v.clone() for k, v in base.items()}
    opt = GaLore(tree, cfg, 1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
    grads = [torch.randn(32, 32, generator=g), torch.zeros(4, 32), torch.zeros(32)]
    for _ in range(5):
        opt.step(grads)
    assert torch.equal(tree["b"], base["b"])  # no gradient, no decay
    assert float(tree["e"].norm()) < float(base["e"].norm())  # decayed
    old = {k: v.clone() for k, v in base.items()}
    before = GaLoreAdamW([{"params": [old["e"], old["b"]]},
                          {"params": [old["w"]], "rank": 8, "scale": 1.0,
                           "update_proj_gap": 4, "proj_type": "std"}],
                         lr=1e-2, weight_decay=0.5, no_deprecation_warning=True)  # fmt: skip
    for _ in range(3):
        for p, grad in zip((old["w"], old["e"], old["b"]), grads, strict=True):
            p.grad = grad.clone()
        before.step()
    fresh = {k: v.clone() for k, v in old.items()}
    now = GaLore(fresh, cfg, 1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.5)
    now.load_state_dict(before.state_dict())
    for name in ("w", "e", "b"):
        saved, loaded = before.state[old[name]], now.torch.state[fresh[name]]
        torch.testing.assert_close(loaded["exp_avg"], saved["exp_avg"], rtol=0, atol=0)
        assert loaded["step"] == saved["step"]


def test_galore_groups_take_this_configs_settings_on_load() -> None:
    """A saved GaLore state brings each leaf's moments; the groups' settings (weight decay
    of the vectors here, saved from the old single group) are the current config's."""
    pytest.importorskip("galore_torch")
    from galore_torch import GaLoreAdamW

    from comera.train.galore import GaLore, GaLoreConfig

    old = {"b": torch.ones(8), "g": torch.ones(8)}  # vectors only: one group either way
    before = GaLoreAdamW([{"params": [old["b"], old["g"]]}], lr=1e-2, weight_decay=0.5,
                         no_deprecation_warning=True)  # fmt: skip
    for p in old.values():
        p.grad = torch.ones(8)
    before.step()
    fresh = {k: v.clone() for k, v in old.items()}
    now = GaLore(fresh, GaLoreConfig(targets=()), 1e-2, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.5)  # fmt: skip
    now.load_state_dict(before.state_dict())
    assert [g["weight_decay"] for g in now.torch.param_groups] == [0.0]
    torch.testing.assert_close(
        now.torch.state[fresh["b"]]["exp_avg"], before.state[old["b"]]["exp_avg"]
    )


@pytest.mark.parametrize(
    ("galore", "text"),
    [
        ({"rank": 64}, "largest short side among them is 32"),  # no side exceeds the rank
        ({"rank": 32}, "largest short side among them is 32"),  # equal: nothing to save
        ({"rank": 8, "targets": ("layers.*",)}, "they name no 2-D weight"),
    ],
)
def test_galore_that_would_project_nothing_is_refused(tmp_path: Path, galore, text) -> None:
    """A run under GaLore's name that projects no weight would be plain AdamW: refused
    naming train.galore.rank and train.galore.targets."""
    pytest.importorskip("galore_torch")
    from comera.errors import ConfigError
    from comera.train import ComeraConfig, Trainer
    from comera.train.galore import GaLoreConfig

    cfg = TrainConfig(
        steps=2, run_dir=str(tmp_path / "run"), optimizer="galore",
        galore=GaLoreConfig(**{"targets": ("w",), **galore}),
        comera=ComeraConfig(enabled=False), wandb="disabled", progress=False,
    )  # fmt: skip
    with pytest.raises(ConfigError, match=text) as e:
        Trainer(cfg, _DenseToy(), {"w": torch.zeros(32, 32), "b": torch.zeros(32)}, {})
    assert "train.galore.rank" in str(e.value) and "train.galore.targets" in str(e.value)
    assert not (tmp_path / "run").exists()  # refused before the run dir was made


def test_galore_scale_must_be_finite() -> None:
    from comera.errors import ConfigError
    from comera.train.galore import GaLoreConfig

    with pytest.raises(ConfigError, match="train.galore.scale"):
        GaLoreConfig(scale=float("inf"))


def test_a_bad_projection_type_names_the_key_and_the_choices():
    from comera.errors import ConfigError
    from comera.train.galore import GaLoreConfig

    with pytest.raises(ConfigError, match=r"proj_type='foo' \(train.galore.proj_type\) .*std, "):
        GaLoreConfig(proj_type="foo")


def test_galores_import_noise_is_kept_off_stderr(tmp_path, monkeypatch, caplog):
    """galore-torch imports bitsandbytes, whose CPU backend logs a warning when an
    optional 4-bit kernel cannot be downloaded: a line before every GaLore run's output
    and before the CLI's one-line errors. Such warnings are silenced for the import only."""
    import logging
    import sys

    real = pytest.importorskip("galore_torch")
    from comera.train.galore import GaLore, GaLoreConfig

    (tmp_path / "galore_torch.py").write_text(
        "import logging\n"
        "logging.getLogger('bitsandbytes.backends.cpu.ops').warning('Failed to load kernel')\n"
        "from galore_real import GaLoreAdamW\n"
    )
    monkeypatch.setitem(sys.modules, "galore_real", real)
    monkeypatch.delitem(sys.modules, "galore_torch")
    monkeypatch.syspath_prepend(str(tmp_path))
    tree = {"w": torch.randn(32, 32)}
    caplog.clear()  # the real package's own import above may have said it
    with caplog.at_level(logging.WARNING):
        GaLore(tree, GaLoreConfig(rank=8, targets=("w",)), 1e-2, betas=(0.9, 0.999),
               eps=1e-8, weight_decay=0.0)  # fmt: skip
        assert "galore_real" in sys.modules and sys.modules["galore_torch"] is not real
        assert not [r for r in caplog.records if "Failed to load kernel" in r.message]
        assert logging.getLogger("bitsandbytes").level == logging.NOTSET  # put back
        from benchmarks.mnli_step import galore_available

        monkeypatch.delitem(sys.modules, "galore_torch")  # the benchmark's check: the same
        assert galore_available()
        assert not [r for r in caplog.records if "Failed to load kernel" in r.message]
        logging.getLogger("bitsandbytes.backends.cpu.ops").warning("later warning")
    assert [r.message for r in caplog.records] == ["later warning"]
