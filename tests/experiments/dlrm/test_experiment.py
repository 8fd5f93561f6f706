"""DLRM model, sparse SGD in the trainer, and the experiment's command line."""

import dataclasses
import json
import math
import shutil
from pathlib import Path

import pytest
import torch

import comera as C
from comera.train import ComeraConfig, TrainConfig, Trainer
from comera.train.optim import SGDConfig
from experiments import cli
from experiments.dlrm.data import CriteoDataConfig, load_criteo
from experiments.dlrm.experiment import main
from experiments.dlrm.model import (
    DLRMConfig,
    _mlp,
    dense_param_count,
    dlrm_logits,
    embed,
    init_dlrm,
)
from tests.criteo_helpers import SAMPLE

CARDS = (3, 50, 4096, 700, 9000, 12, 2000)


def _model(**kw) -> DLRMConfig:
    base = dict(
        cardinalities=CARDS,
        bottom=(32,),
        top=(16,),
        tt_min_rows=500,
        emb_rank=4,
        tt_layers=("bottom.1",),
        tt_layer_rank=4,
    )
    return DLRMConfig(**{**base, **kw})  # type: ignore[arg-type]


def _batch(n: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    cat = torch.stack([torch.randint(0, c, (n,), generator=g) for c in CARDS], 1)
    return {
        "dense": torch.rand(n, 13, generator=g),
        "cat": cat,
        "label": (torch.rand(n, generator=g) < 0.3).float(),
    }


def test_architecture_and_lookups_agree() -> None:
    cfg = _model()
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    assert [n for n, t in params["tables"].items() if "cores" in t] == ["C3", "C4", "C5", "C7"]
    assert "cores" in params["bottom"][1] and "weight" in params["top"][0]
    assert params["top"][0]["weight"].shape == (16, 16 + 8 * 7 // 2)  # 16 + 28 dot products
    batch = _batch()
    a = dlrm_logits(cfg, params, state, batch)
    b = dlrm_logits(dataclasses.replace(cfg, batched_lookup=False), params, state, batch)
    assert a.shape == (64,)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    paper = DLRMConfig()  # the Kaggle architecture
    bottom, top = paper.mlp_sizes()
    assert bottom == [13, 512, 256, 64, 16] and top == [367, 512, 256, 1]
    assert dense_param_count(paper) == 33_762_577 * 16 + 475_985  # tables + MLPs
    with pytest.raises(ValueError, match="tt_layers names"):
        _model(tt_layers=("top.7",))
    # names of another length were a bare zip() error when the tables were made
    with pytest.raises(ValueError, match="DLRMConfig: 1 names for 2 cardinalities"):
        DLRMConfig(cardinalities=(5, 6), names=("C1",), bottom=(4,), top=(4,), tt_layers=())


def test_interaction_is_the_references_pairwise_dot_products() -> None:
    """The top MLP reads the bottom output, then every dot product of two distinct vectors
    in the reference's order ((1,0), (2,0), (2,1), ...): logits and gradients agree with
    that written out by hand."""
    cfg = _model()
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    batch, plans = _batch(8), C.LayerPlans()
    # gradients through the interaction's backward: the top layer, the bottom MLP's
    # first layer and a TTM table's cores (below the dot products)
    leaves = [params["top"][0]["weight"], params["bottom"][0]["weight"]]
    leaves += params["tables"]["C3"]["cores"]
    for t in leaves:
        t.requires_grad_()
    x = _mlp(params["bottom"], state["bottom"], batch["dense"], plans, "bottom", True)
    vecs = torch.cat([x.unsqueeze(1), embed(cfg, params, state, batch["cat"])], 1)
    n = vecs.shape[1]
    assert n == 1 + len(CARDS)
    dots = [(vecs[:, i] * vecs[:, j]).sum(1, keepdim=True) for i in range(n) for j in range(i)]
    want = _mlp(params["top"], state["top"], torch.cat([x, *dots], 1), plans, "top", False)
    got = dlrm_logits(cfg, params, state, batch)
    torch.testing.assert_close(got, want.squeeze(1), rtol=1e-5, atol=1e-5)
    for g_got, g_want in zip(
        torch.autograd.grad(got.sum(), leaves),
        torch.autograd.grad(want.sum(), leaves),
        strict=True,
    ):
        assert g_want.abs().sum() > 0
        torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-5)


def test_hot_rows_add_a_dense_row_to_the_frequent_ids_only() -> None:
    """``hot_rows``: ids below it in each TTM table read the TTM row plus a dense one (both
    lookup paths), only those dense rows get gradients, and they count in the model size."""
    from comera.train.measures import model_size

    cfg = _model(hot_rows=100)
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    assert sorted(params["hot"]) == ["C3", "C4", "C5", "C7"]
    assert all(h["weight"].shape == (100, 16) for h in params["hot"].values())
    batch = _batch(256)
    plain = {k: v for k, v in params.items() if k != "hot"}
    base = embed(cfg, plain, state, batch["cat"])
    torch.testing.assert_close(embed(cfg, params, state, batch["cat"]), base)  # zero at init
    g = torch.Generator().manual_seed(1)
    for h in params["hot"].values():
        h["weight"] = torch.randn(h["weight"].shape, generator=g).requires_grad_()
    for batched in (True, False):
        c = dataclasses.replace(cfg, batched_lookup=batched)
        diff = embed(c, params, state, batch["cat"]) - base
        for j, name in ((2, "C3"), (4, "C5"), (1, "C2")):
            ids = batch["cat"][:, j]
            want = torch.zeros(len(ids), 16)
            if name in params["hot"]:
                hot = ids < 100
                assert 0 < int(hot.sum()) < len(ids)  # both kinds of id in the batch
                want[hot] = params["hot"][name]["weight"].detach()[ids[hot]]
            torch.testing.assert_close(diff[:, j].detach(), want, rtol=1e-5, atol=1e-5)
    embed(cfg, params, state, batch["cat"]).sum().backward()
    grad = params["hot"]["C5"]["weight"].grad
    read = torch.zeros(100, dtype=torch.bool)
    read[batch["cat"][:, 4][batch["cat"][:, 4] < 100]] = True
    assert bool((grad[read] != 0).all()) and bool((grad[~read] == 0).all())
    assert model_size(params, state) == model_size(plain, state) + 4 * 100 * 16
    assert "hot" not in init_dlrm(_model(), generator=torch.Generator().manual_seed(0))[0]
    with pytest.raises(ValueError, match="hot_rows"):
        _model(hot_rows=-1)


def test_hash_rows_shrink_the_dense_models_large_tables() -> None:
    """``hash_rows=K``: the dense model's tables of ``tt_min_rows`` rows and up hold K rows
    and id ``i`` reads row ``i % K`` (sparse gradients too); smaller tables and the CoMERA
    model are untouched; the CLI refuses it without --dense."""
    from comera.train.measures import model_size

    cfg = _model(tt=False, hash_rows=300)
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    rows = {n: t["weight"].shape[0] for n, t in params["tables"].items()}
    assert rows == {
        n: (min(c, 300) if c >= 500 else c) for n, c in zip(cfg.names, CARDS, strict=True)
    }
    assert any(c > 300 for c in CARDS if c >= 500) and any(c < 500 for c in CARDS)
    full = init_dlrm(_model(tt=False), generator=torch.Generator().manual_seed(0))[0]
    assert model_size(params, state) < model_size(full, state)
    batch = _batch(256)
    for sparse in (False, True):
        out = embed(cfg, params, state, batch["cat"], sparse=sparse)
        for j, name in enumerate(cfg.names):
            w = params["tables"][name]["weight"]
            torch.testing.assert_close(out[:, j], w[batch["cat"][:, j] % w.shape[0]])
    weights = [t["weight"].requires_grad_() for t in params["tables"].values()]
    grads = torch.autograd.grad(embed(cfg, params, state, batch["cat"], sparse=True).sum(), weights)
    for j, (w, g) in enumerate(zip(weights, grads, strict=True)):  # sparse, at the hashed rows
        assert g.is_sparse and g.shape == w.shape
        want = torch.zeros(w.shape[0]).index_add_(0, batch["cat"][:, j] % w.shape[0],
                                                  torch.ones(len(batch["cat"])))  # fmt: skip
        torch.testing.assert_close(g.to_dense()[:, 0], want)  # d(sum)/d(row) = times read
    wide = init_dlrm(_model(tt=False, hash_rows=1000), generator=torch.Generator().manual_seed(0))
    assert wide[0]["tables"]["C4"]["weight"].shape[0] == 700  # no more rows than it has
    assert wide[0]["tables"]["C3"]["weight"].shape[0] == 1000
    comera = init_dlrm(_model(hash_rows=300), generator=torch.Generator().manual_seed(0))[0]
    assert [n for n, t in comera["tables"].items() if "cores" in t] == ["C3", "C4", "C5", "C7"]
    with pytest.raises(ValueError, match="hash_rows"):
        _model(hash_rows=-1)


def test_hash_rows_need_the_dense_model(tmp_path: Path, capsys) -> None:
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--set", "model.hash_rows=8")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "--dense" in err[0] and "hash_rows" in err[0]
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--dense", "--set",
                "model.hash_rows=100000")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()  # the sample's tables are far smaller
    assert code == 2 and len(err) == 1 and "hashes no table" in err[0]
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_hashed_dense_trains_and_resumes_on_the_sample(tmp_path: Path) -> None:
    """``--dense --set model.hash_rows=K`` trains end to end on the real Criteo rows,
    counts its size against the full dense model and resumes from its checkpoint."""
    args = ["--run-dir", str(tmp_path / "r"), "--dense", "--set", "model.hash_rows=16",
            "--set", "model.tt_min_rows=40", "--set", "train.steps=4",
            "--set", "train.checkpoint_every=2", "--set", "batch_size=32"]  # fmt: skip
    assert _cli(tmp_path, *args) == 0
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in rows if "compression" in r][-1]
    assert last["step"] == 4 and last["compression"] > 1.5
    config = json.loads((tmp_path / "r" / "config.json").read_text())
    assert config["model"]["hash_rows"] == 16 and config["dense"]
    shutil.rmtree(tmp_path / "r" / "checkpoints" / "step_00000004")  # died after step 2
    assert main(["--resume", str(tmp_path / "r"), "--no-progress"]) == 0  # hashed shapes load
    rows = [json.loads(x) for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert (tmp_path / "r" / "checkpoints" / "step_00000004").is_dir()
    assert [r["step"] for r in rows if "loss" in r][-1] == 4


class _Task:
    def __init__(self, cfg: DLRMConfig, sparse: bool) -> None:
        self.cfg, self.sparse, self.train_iter = cfg, sparse, iter(())

    def loss(self, params, state, batch, *, train=True):
        logits = dlrm_logits(self.cfg, params, state, batch, sparse=self.sparse)
        loss = torch.nn.functional.binary_cross_entropy_with_logits(
            logits, batch["label"], reduction="sum"
        )
        return loss, len(logits), {}

    def evaluate(self, params, state):
        return {}


def test_sparse_sgd_step_equals_dense_sgd_step(tmp_path: Path) -> None:
    cfg = _model(tt=False)
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    batch = _batch()
    out = []
    for sparse in (True, False):
        train = TrainConfig(
            steps=5,
            run_dir=str(tmp_path / str(sparse)),
            optimizer="sgd",
            comera=ComeraConfig(enabled=False),
            sgd=SGDConfig(lr=0.5),
            grad_clip=1.0,
            wandb="disabled",
        )
        tr = Trainer(train, _Task(cfg, sparse), params, state)
        m = tr.train_step(batch)
        out.append((tr.params, m["grad_norm"]))
    (sp, g_sparse), (dp, g_dense) = out
    assert g_sparse == pytest.approx(g_dense, rel=1e-5)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(sp), torch.utils._pytree.tree_leaves(dp), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    w0, w1 = params["tables"]["C5"]["weight"], sp["tables"]["C5"]["weight"]
    untouched = torch.ones(CARDS[4], dtype=torch.bool)
    untouched[batch["cat"][:, 4]] = False
    assert torch.equal(w1.detach()[untouched], w0[untouched])  # rows not read never move
    assert not torch.equal(w1.detach()[~untouched], w0[~untouched])


def _cli(tmp_path: Path, *extra: str) -> int:
    return main(
        [
            "--preset",
            "smoke",
            "--data",
            str(SAMPLE),
            "--cache-dir",
            str(tmp_path / "c"),
            "--no-progress",
            "--wandb",
            "disabled",
            "--set",
            "batch_size=32",
            "--set",
            "train.steps=12",
            "--set",
            "train.eval_every=6",
            "--set",
            "train.checkpoint_every=6",
            "--set",
            "train.comera.reg_start_step=2",
            "--set",
            "train.comera.early_steps=8",
            "--set",
            "train.comera.prune_every=2",
            "--set",
            "model.tt_min_rows=100",
            *extra,
        ]
    )


@pytest.mark.slow
def test_cli_trains_on_the_real_sample_and_resumes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    assert _cli(tmp_path, "--run-dir", str(run)) == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in rows if "eval/val/auc" in r]
    assert [r["step"] for r in evals] == [6, 12]
    assert {"eval/val/nce", "eval/val/logloss", "eval/val/accuracy"} <= set(evals[-1])
    per_table = {k: v for k, v in evals[-1].items() if k.startswith("eval/compression/")}
    assert per_table and all(v > 1 for v in per_table.values())
    assert any(r.get("stage") == "late" for r in rows)
    config = json.loads((run / "config.json").read_text())
    assert config["ttm_tables"] > 0 and config["train"]["optimizer"] == "adamw"
    dense = tmp_path / "dense"
    assert _cli(tmp_path, "--run-dir", str(dense), "--dense") == 0
    config = json.loads((dense / "config.json").read_text())
    assert config["ttm_tables"] == 0 and config["train"]["optimizer"] == "adamw"  # smoke's
    sgd = tmp_path / "sgd"
    assert _cli(tmp_path, "--run-dir", str(sgd), "--dense", "--set", "train.optimizer=sgd") == 0
    assert main(["--resume", str(sgd), "--no-progress"]) == 0  # finished: nothing to redo
    hot = tmp_path / "hot"  # hot rows under sparse SGD: pruned and compacted beside them
    hot_sgd = ("--set", "model.hot_rows=8", "--set", "train.optimizer=sgd")
    assert _cli(tmp_path, "--run-dir", str(hot), *hot_sgd) == 0
    rows = [json.loads(x) for x in (hot / "metrics.jsonl").read_text().splitlines()]
    assert any(r.get("stage") == "late" for r in rows)
    plain = tmp_path / "plain_sgd"
    assert _cli(tmp_path, "--run-dir", str(plain), "--set", "train.optimizer=sgd") == 0
    # step 6 is before any pruning: the same TT ranks, so each table's compression differs
    # by exactly its hot rows (dense rows x 16 / live params)
    evals = [
        next(json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()
             if json.loads(x).get("step") == 6 and "eval/val/auc" in json.loads(x))
        for d in (hot, plain)
    ]  # fmt: skip
    cards = json.loads((hot / "config.json").read_text())["cardinalities"]
    for key in (k for k in evals[0] if k.startswith("eval/compression/")):
        n = cards[int(key.rsplit("C", 1)[1]) - 1]
        extra = n * 16 / evals[0][key] - n * 16 / evals[1][key]
        assert extra == pytest.approx(min(8, n) * 16, rel=1e-6)


@pytest.mark.parametrize("kind", ["missing", "csv"])
def test_cli_bad_data_is_one_line_exit_2(tmp_path: Path, kind: str, capsys) -> None:
    path = tmp_path / "data.csv"
    if kind == "csv":
        path.write_text("label,a,b\n1,2,3\n")
    code = main(
        [
            "--preset",
            "smoke",
            "--data",
            str(path),
            "--cache-dir",
            str(tmp_path),
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert ("does not exist" in err[0]) if kind == "missing" else ("line 1" in err[0])
    assert "--data" in err[0] or "Criteo" in err[0]


def test_hot_rows_need_frequency_ordered_ids(tmp_path: Path, capsys) -> None:
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--set", "model.hot_rows=8",
                "--set", "data.id_order=hash")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.id_order=frequency" in err[0]


@pytest.mark.parametrize(
    "flags, needle",
    [
        (("--set", "model.dense_features=12"), "model.dense_features"),
        (("--set", "model.cardinalities=(5,5)"), "model.cardinalities"),
        (("--set", "model.names=('a','b')"), "model.names"),
        (("--dense", "--set", "model.hot_rows=8"), "model.hot_rows=0 with --dense"),
        (("--set", "dense_optimizer=sgdd"), "--set dense_optimizer"),
        (("--dense", "--set", "dense_optimizer=foo"), "--set dense_optimizer"),
    ],
)
def test_settings_the_model_cannot_honour_are_refused(
    tmp_path: Path, capsys, flags: tuple[str, ...], needle: str
) -> None:
    """Values the data decides (or a dense model cannot use) are refused in one line
    before anything is written, instead of being dropped or failing mid-training."""
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), *flags)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and needle in err[0], err
    assert not (tmp_path / "r").exists()


def test_the_ablations_dense_baseline_drops_hot_rows() -> None:
    """``--set model.hot_rows=K`` on an ablation applies to CoMERA's variants; its dense
    baseline (``dense_overrides``) has every row dense and sets 0, so it is not refused
    after the other variants have trained."""
    from experiments.dlrm.experiment import dense_overrides, preset

    cfg = cli.set_field(preset("smoke"), "model.hot_rows", 256)
    dense = cli.apply_overrides(cfg, dense_overrides(cfg), [])
    assert dense.dense and dense.model.hot_rows == 0
    for key, value in dense_overrides(cfg):  # one at a time, as run(dense=True) sets them
        cfg = cli.set_field(cfg, key, value)
    assert cfg.model.hot_rows == 0


def test_data_path_expands_home(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "sample.txt").write_bytes(SAMPLE.read_bytes())
    cfg = CriteoDataConfig(path="~/sample.txt", cache_dir=str(tmp_path / "c"))
    assert len(load_criteo(cfg, progress=False)) == 200


@pytest.mark.slow
def test_smoke_preset_learns_and_keeps_the_tables_that_matter(tmp_path: Path) -> None:
    """The smoke preset as shipped (generated data, 800 steps): both models learn the
    planted signal, CoMERA compresses and its rank adaptation keeps more rank in each of
    the large tables that carry signal (C3, C4, C12, C16, C21) than in any other."""
    from experiments.dlrm.experiment import preset, run

    out = {}
    for dense in (False, True):
        p = preset("smoke")
        for key, value in (
            ("data.cache_dir", str(tmp_path / "cache")),
            ("train.run_dir", str(tmp_path / f"run-{dense}")),
            ("train.progress", False),
            ("train.wandb", "disabled"),
        ):
            p = cli.set_field(p, key, value)
        out[dense] = run(p, dense=dense)
    comera, dense = out[False], out[True]
    assert comera["eval/val/auc"] > 0.74 and dense["eval/val/auc"] > 0.7
    assert comera["compression"] > 15
    ranks = json.loads((tmp_path / "run-False" / "ranks.json").read_text())["end"]["ranks"]
    planted = {f"tables.C{i}" for i in (3, 4, 12, 16, 21)}
    kept = [sum(r) for k, r in ranks.items() if k in planted]
    shrunk = [sum(r) for k, r in ranks.items() if k not in planted]
    assert len(kept) == 5 and min(kept) > max(shrunk)


def test_dense_kaggle_trains_like_the_reference() -> None:
    from experiments.dlrm.experiment import EXPERIMENT

    ap = cli.build_parser(EXPERIMENT)
    args = ap.parse_args(["--preset", "kaggle", "--dense", "--data", "train.txt"])
    cfg = cli.resolve_config(EXPERIMENT, args, ap)
    t = cfg.train
    assert (t.optimizer, t.sgd.lr, t.schedule, t.warmup_steps, t.grad_clip) == (
        "sgd", 0.1, "constant", 0, None
    )  # fmt: skip
    assert cfg.dense and not t.comera.enabled and t.steps == 39_291_958 // 128
    args = ap.parse_args(["--preset", "kaggle", "--dense", "--set", "train.optimizer=adamw"])
    assert cli.resolve_config(EXPERIMENT, args, ap).train.optimizer == "adamw"
    # dense_overrides (the ablations' dense baseline) is what --dense trains
    from experiments.dlrm.experiment import dense_overrides, preset

    want = cli.set_field(preset("kaggle"), "data.path", "train.txt")
    for key, value in dense_overrides(want):
        want = cli.set_field(want, key, value)
    want = cli.set_field(want, "train.run_name", t.run_name)  # --dense names the run too
    assert want == cfg


def _sample_trainer(tmp_path: Path, run: str, *, accum: int = 1, batch: int = 32, **kw):
    from experiments.dlrm.batches import RowBatches
    from experiments.dlrm.data import CriteoDataConfig, preprocess
    from experiments.dlrm.task import DLRMTask

    data = preprocess(
        SAMPLE, CriteoDataConfig(path="x", cache_dir=str(tmp_path / "c")), progress=False
    )
    model = DLRMConfig(cardinalities=tuple(data.cardinalities), bottom=(16,), top=(16,), tt=False)
    lo, hi = data.splits["train"]
    it = RowBatches(data, lo, hi, batch, seed=1)
    task = DLRMTask(model, data, it, sparse=True)
    cfg = TrainConfig(
        steps=6,
        run_dir=str(tmp_path / run),
        optimizer="sgd",
        sgd=SGDConfig(lr=0.5),
        comera=ComeraConfig(enabled=False),
        grad_clip=None,
        schedule="constant",
        accum_steps=accum,
        checkpoint_every=3,
        wandb="disabled",
        progress=False,
        **kw,
    )
    params, state = init_dlrm(model, generator=torch.Generator().manual_seed(0))
    return cfg, task, params, state


def test_sparse_sgd_resumes_bit_identically(tmp_path: Path) -> None:
    cfg, task, params, state = _sample_trainer(tmp_path, "straight")
    straight = Trainer(cfg, task, params, state)
    straight.fit()
    cfg, task, params, state = _sample_trainer(tmp_path, "cut")
    first = Trainer(cfg, task, params, state)
    for _ in range(3):  # then the process dies
        first.train_step(next(task.train_iter))
    first.checkpoint()
    cfg, task, params, state = _sample_trainer(tmp_path, "cut")
    resumed = Trainer(cfg, task, params, state, resume=True)
    assert resumed.step == 3
    resumed.fit()
    for a, b in zip(
        torch.utils._pytree.tree_leaves(straight.params),
        torch.utils._pytree.tree_leaves(resumed.params),
        strict=True,
    ):
        assert torch.equal(a, b)


def test_sparse_gradient_accumulation_equals_the_full_batch(tmp_path: Path) -> None:
    cfg, task, params, state = _sample_trainer(tmp_path, "full", batch=32)
    full = Trainer(cfg, task, params, state)
    full.train_step(next(task.train_iter))
    cfg2, task2, _, _ = _sample_trainer(tmp_path, "halves", batch=16, accum=2)
    halves = Trainer(cfg2, task2, params, state)
    # the two halves of the same 32 rows, one micro-batch each
    batch = next(_sample_trainer(tmp_path, "x", batch=32)[1].train_iter)
    half = [{k: v[i::2] for k, v in batch.items()} for i in range(2)]
    halves.train_step(*half)
    for a, b in zip(
        torch.utils._pytree.tree_leaves(full.params),
        torch.utils._pytree.tree_leaves(halves.params),
        strict=True,
    ):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path: Path) -> None:
    """torchrun with 2 gloo ranks: rank 0 preprocesses while rank 1 waits, each rank
    trains on its half of every global batch and scores its half of the split, AUC
    gathers every prediction: the run logs what one process logs."""
    import os
    import subprocess
    import sys

    from tests.train_helpers import free_port

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    common = [
        "--data",
        str(SAMPLE),
        "--no-progress",
        "--set",
        "batch_size=32",
        "--set",
        "train.steps=6",
        "--set",
        "train.eval_every=3",
        "--set",
        "model.tt_min_rows=100",
        "--set",
        "train.comera.reg_start_step=1",
        "--set",
        "train.comera.early_steps=4",
        "--set",
        "train.comera.prune_every=2",
    ]
    rows = {}
    for world in (1, 2):
        port = free_port()
        run = tmp_path / f"w{world}"
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(world),
            "--master_port",
            str(port),
            "-m",
            "experiments.dlrm",
            *common,
            "--cache-dir",
            str(tmp_path / f"cache{world}"),
            "--run-dir",
            str(run),
        ]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows[world] = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    evals = {w: [r for r in rows[w] if "eval/val/auc" in r] for w in rows}
    assert [r["step"] for r in evals[2]] == [3, 6]
    for a, b in zip(evals[1], evals[2], strict=True):
        for key in ("eval/val/auc", "eval/val/logloss", "eval/val/accuracy", "eval/val/nce"):
            assert a[key] == pytest.approx(b[key], abs=2e-3), key
    losses = {w: [r["loss"] for r in rows[w] if "loss" in r] for w in rows}
    assert losses[1] == pytest.approx(losses[2], rel=1e-4)


def test_embedding_impl_reaches_the_per_table_lookups(monkeypatch) -> None:
    """``plans.embedding_impl`` (``--embedding-impl``) is the impl of every per-table TTM
    lookup (``model.batched_lookup=false``); the table-batched lookup runs only the
    default (``optimized``) or ``auto`` and refuses any other, naming both settings."""
    from comera.errors import ConfigError

    seen: list[str] = []
    original = C.ttm_embedding

    def spy(*args, impl: str = "optimized", **kw):
        seen.append(impl)
        return original(*args, impl=impl, **kw)

    monkeypatch.setattr(C, "ttm_embedding", spy)
    cfg = _model(batched_lookup=False)
    params, state = init_dlrm(cfg, generator=torch.Generator().manual_seed(0))
    batch = _batch(16)
    ref = dlrm_logits(cfg, params, state, batch)
    naive = dlrm_logits(cfg, params, state, batch, plans=C.LayerPlans(embedding_impl="naive"))
    assert seen == ["optimized"] * 4 + ["naive"] * 4  # the four TTM tables, one call each
    torch.testing.assert_close(naive, ref, rtol=1e-5, atol=1e-5)
    batched = _model()
    for impl in ("optimized", "auto"):  # what the table-batched lookup runs
        dlrm_logits(batched, params, state, batch, plans=C.LayerPlans(embedding_impl=impl))
    for impl in ("naive", "static", "table"):
        with pytest.raises(ConfigError, match="--embedding-impl.*model.batched_lookup"):
            dlrm_logits(batched, params, state, batch, plans=C.LayerPlans(embedding_impl=impl))


def test_cli_embedding_impl_on_the_table_batched_lookup(tmp_path: Path, capsys) -> None:
    """``--embedding-impl naive`` with the table-batched lookup is one line, exit 2,
    before the run dir is made; with ``model.batched_lookup=false`` it trains and is
    recorded; ``--dense`` (no TTM lookup) and ``auto`` are accepted."""
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--embedding-impl", "naive")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--embedding-impl naive" in err[0] and "model.batched_lookup" in err[0]
    assert not (tmp_path / "r").exists()
    short = ("--set", "train.steps=2", "--set", "train.eval_every=2")
    for name, extra in (
        ("per_table", ("--embedding-impl", "naive", "--set", "model.batched_lookup=false")),
        ("auto", ("--embedding-impl", "auto")),
        ("dense", ("--embedding-impl", "naive", "--dense")),
    ):
        assert _cli(tmp_path, "--run-dir", str(tmp_path / name), *extra, *short) == 0, name
    config = json.loads((tmp_path / "per_table" / "config.json").read_text())
    assert config["plans"]["embedding_impl"] == "naive"


def test_dense_reference_training_gives_way_to_config_and_set(tmp_path: Path) -> None:
    """``--dense``'s reference training (SGD, constant lr, no warmup, no clipping) are
    defaults: a ``--config`` file's keys win over them, as ``--set`` does (and ``--set``
    over the file); only the keys that make the model dense cannot be undone there. The
    file's or a ``--set``'s ``dense_optimizer`` picks the reference training."""
    from experiments.dlrm.experiment import EXPERIMENT

    def resolve(*argv: str):
        ap = cli.build_parser(EXPERIMENT)
        args = ap.parse_args(["--preset", "kaggle", "--dense", "--data", "t.txt", *argv])
        return cli.resolve_config(EXPERIMENT, args, ap)

    def training(cfg) -> tuple:
        t = cfg.train
        return t.optimizer, t.schedule, t.warmup_steps, t.grad_clip

    base = resolve()
    assert training(base) == ("sgd", "constant", 0, None)
    from experiments.dlrm.experiment import preset

    kaggle = preset("kaggle").train
    file = tmp_path / "adamw.toml"
    file.write_text('[train]\noptimizer = "adamw"\nschedule = "cosine"\nwarmup_steps = 7\n'
                    "grad_clip = 2.0\n")  # fmt: skip
    cfg = resolve("--config", str(file))
    assert training(cfg) == ("adamw", "cosine", 7, 2.0)
    assert cfg.dense and not cfg.train.comera.enabled  # still the dense model
    partial = tmp_path / "partial.toml"
    partial.write_text('"train.optimizer" = "adamw"\n')
    assert training(resolve("--config", str(partial))) == ("adamw", "constant", 0, None)
    sets = resolve("--config", str(file), "--set", "train.schedule=constant")
    assert training(sets) == ("adamw", "constant", 7, 2.0)  # --set wins over the file
    pick = tmp_path / "pick.toml"
    pick.write_text('dense_optimizer = "adamw"\n')
    for argv in (("--config", str(pick)), ("--set", "dense_optimizer=adamw")):
        cfg = resolve(*argv)  # AdamW's reference training: the preset's own schedule
        assert training(cfg) == ("adamw", kaggle.schedule, kaggle.warmup_steps, None), argv
    comera = tmp_path / "comera.toml"
    comera.write_text('dense = false\n"train.comera.enabled" = true\n')
    cfg = resolve("--config", str(comera))  # --dense's own keys win over the file
    assert cfg.dense and not cfg.train.comera.enabled


def test_step_modes_on_dlrm(tmp_path: Path, capsys) -> None:
    """The reference's SGD under ``sync_free`` trains with dense embedding gradients (the
    sync-free step refuses sparse ones); CUDA graphs are refused in one line."""
    run = tmp_path / "sgd"
    argv = ["--run-dir", str(run), "--dense", "--set", "train.optimizer=sgd"]
    assert _cli(tmp_path, *argv, "--step-mode", "sync_free") == 0
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(r["loss"]) for r in rows if "loss" in r)
    assert _cli(tmp_path, "--run-dir", str(tmp_path / "g"), "--step-mode", "cuda_graph") == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "cannot run DLRM: the table-batched TTM lookup sizes its work" in line
    # without that lookup the reason was still its (wrong) one
    for extra in (["--dense"], ["--set", "model.batched_lookup=false"]):
        assert _cli(tmp_path, "--run-dir", str(tmp_path / "g"), "--step-mode", "cuda_graph",
                    *extra) == 2  # fmt: skip
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert "cannot run DLRM: its capture has never been checked" in line, extra


@pytest.mark.slow
def test_report_is_rendered_from_its_json(tmp_path: Path) -> None:
    """The report gathers the two smoke runs, the bench and the ablation reports beside it
    into ``dlrm.json`` and renders the markdown and plot from that JSON alone."""
    from experiments.dlrm import report
    from experiments.report import REPORTS

    runs = tmp_path / "runs"
    assert _cli(tmp_path, "--run-dir", str(runs / "dlrm-smoke")) == 0
    assert _cli(tmp_path, "--run-dir", str(runs / "dlrm-smoke-dense"), "--dense") == 0
    out = tmp_path / "rep"
    out.mkdir()
    (out / "ablation_dlrm_rank.md").write_text("")
    bench = json.loads((REPORTS / "dlrm_bench.json").read_text())
    text = report.write_report(runs, out, bench, command="python -m experiments.dlrm.report")
    data = json.loads((out / "dlrm.json").read_text())
    assert data["meta"]["command"] == "python -m experiments.dlrm.report"
    assert data["meta"]["torch"] == torch.__version__ and data["meta"]["cpu"]
    assert data["bench"] == bench and data["ablations"] == ["ablation_dlrm_rank.md"]
    assert data["setup"]["data"] == str(SAMPLE) and data["planted_auc"] is None
    # not the smoke preset: the settings _cli changes are named in the section's title
    changed = data["setup"]["changed"]
    assert {"data.path", "batch_size", "train.steps", "model.tt_min_rows"} <= set(changed)
    assert "train.seed" not in changed and "model.hot_rows" not in changed
    assert "## Ours: smoke preset with `" in text and "`train.steps`" in text
    assert data["setup"]["steps"] == 12 and "early stage 8 steps;" in text
    for name, d in (("CoMERA", "dlrm-smoke"), ("dense", "dlrm-smoke-dense")):
        rows = [json.loads(x) for x in (runs / d / "metrics.jsonl").read_text().splitlines()]
        evals = [r for r in rows if "eval/val/auc" in r]
        run = data["runs"][name]
        assert run["final"] == {"step": 12, "auc": evals[-1]["eval/val/auc"],
                                "nce": evals[-1]["eval/val/nce"],
                                "logloss": evals[-1]["eval/val/logloss"],
                                "accuracy": evals[-1]["eval/val/accuracy"]}  # fmt: skip
        best = max(evals, key=lambda r: r["eval/val/auc"])
        assert run["best"] == {"step": best["step"], "auc": best["eval/val/auc"]}
        assert run["curves"]["auc"] == [[r["step"], r["eval/val/auc"]] for r in evals]
    assert data["runs"]["dense"]["compression"] == 1.0 < data["runs"]["CoMERA"]["compression"]
    last = [r for r in map(json.loads, (runs / "dlrm-smoke" / "metrics.jsonl").open())
            if "eval/val/auc" in r][-1]  # fmt: skip
    assert data["ranks"] and all(
        r["compression"] == last[f"eval/compression/{r['table'].removeprefix('tables.')}"]
        for r in data["ranks"]
    )
    assert (out / "dlrm_curves.png").stat().st_size > 1000
    # the benchmark section names the command its JSON records (it said an older one)
    assert f"`{bench['command']}`: 26 tables" in text
    # a finished run missing its rank record or metrics: one line each, not a traceback
    from comera.errors import DataError, MissingFileError

    for gone, error in (("dlrm-smoke/ranks.json", DataError),
                        ("dlrm-smoke-dense/metrics.jsonl", MissingFileError)):  # fmt: skip
        moved = (runs / gone).rename(tmp_path / "kept")
        with pytest.raises(error, match=f"{runs / gone} not found"):
            report.write_report(runs, tmp_path / "rep2", bench, command="x")
        moved.rename(runs / gone)
    shutil.rmtree(runs)  # re-rendered from the JSON alone: the same report
    again = tmp_path / "again"
    assert report.main(["--from-json", str(out / "dlrm.json"), "--out", str(again)]) == 0
    assert (again / "dlrm.md").read_text() == text


@pytest.mark.parametrize("flag", ["--data", "--cache-dir"])
def test_an_empty_data_or_cache_flag_is_refused(tmp_path: Path, flag: str, capsys) -> None:
    """``--data "$DATA"`` with DATA unset is refused in one line naming the flag, not
    taken as absent (which trained on the generated file, exit 0)."""
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), flag, "",
                "--set", "data.generated_rows=1000", "--set", "train.steps=2")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and f'{flag} "": empty' in err[0], err
    assert not (tmp_path / "r").exists()


def test_settings_that_leave_no_compressed_layer_are_named_before_the_data(
    tmp_path: Path, capsys
) -> None:
    """--max-ind-range under tt_min_rows built the whole cache (minutes and gigabytes on
    the Kaggle file) before refusing; a min_count that folded every value into id 0 was
    blamed on tt_min_rows alone; --set data.cache_dir= took the default cache."""
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--max-ind-range", "50")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--max-ind-range 50 caps every table at 50 rows, under model.tt_min_rows=100" in err[0]
    assert not (tmp_path / "c").exists() and not (tmp_path / "r").exists()
    # min_count > 1 adds id 0 beside the max_ind_range values: 99 + 1 rows reach 100
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--max-ind-range", "99",
                "--set", "data.min_count=2")  # fmt: skip
    assert "caps every table" not in capsys.readouterr().err
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--max-ind-range", "98",
                "--set", "data.min_count=2")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and "--max-ind-range 98 caps every table at 99 rows" in err[-1], err
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--set", "data.min_count=1000")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "(data.min_count=1000 folds values seen fewer times into id 0)" in err[0]
    assert "lower --set model.tt_min_rows=N or data.min_count, or train --dense" in err[0]
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--set", "data.cache_dir=")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.cache_dir is empty; give a folder" in err[0]


def test_a_run_of_many_epochs_of_its_file_is_noted(tmp_path: Path, capsys) -> None:
    """The kaggle preset's one epoch of Kaggle (306,968 steps) on the 200-row sample ran
    for hours without a word."""
    assert _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--set", "train.steps=60") == 0
    err = capsys.readouterr().err
    assert "note: train.steps=60 at batch_size 32 is 11 epochs of this file's 172 " in err
    assert _cli(tmp_path, "--run-dir", str(tmp_path / "r2")) == 0  # 12 steps: 2 epochs
    assert "epochs of this file" not in capsys.readouterr().err


def test_generated_rows_have_an_upper_bound(tmp_path: Path, capsys) -> None:
    """A count the generator cannot hold in memory is one line naming the field, not a
    MemoryError traceback."""
    code = _cli(tmp_path, "--run-dir", str(tmp_path / "r"), "--data", "generated",
                "--set", "data.generated_rows=10000000000000")  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "data.generated_rows=10000000000000" in err[0]
    assert not (tmp_path / "r").exists() and not list((tmp_path / "c").glob("generated-*"))
    from experiments.dlrm.data import GENERATED_MAX_ROWS

    CriteoDataConfig(generated_rows=GENERATED_MAX_ROWS)  # the bound itself is fine


def test_a_moved_file_resumes_with_data_and_another_file_is_refused(tmp_path: Path, capsys) -> None:
    """The file a run trained on moved: the resume says ``--resume RUN --data NEW_PATH``,
    which then continues it; ``--data`` naming a file of other content is refused by the
    data's digest, and the run still resumes after that."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first, run = tmp_path / "a" / "train.txt", tmp_path / "r"
    shutil.copy(SAMPLE, first)
    lines = SAMPLE.read_text().splitlines(keepends=True)
    other = tmp_path / "other.txt"
    other.write_text("".join(reversed(lines)))  # as many rows, other content
    args = ["--run-dir", str(run), "--dense", "--data", str(first), "--set", "train.steps=4",
            "--set", "train.checkpoint_every=2", "--set", "train.eval_every=4"]  # fmt: skip
    assert _cli(tmp_path, *args) == 0
    shutil.rmtree(run / "checkpoints" / "step_00000004")  # died after step 2
    moved = first.rename(tmp_path / "b" / "moved.txt")
    resume = ["--resume", str(run), "--no-progress"]
    capsys.readouterr()
    assert main(resume) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--resume {run} --data NEW_PATH" in err[0], err
    # a --data that is missing too: it was blamed as the file the run trained on, with the
    # advice to do what was just done
    assert main([*resume, "--data", str(tmp_path / "typo.txt")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{tmp_path / 'typo.txt'} (--data) does not exist" in err[0], err
    assert f"it last read {first}" in err[0] and "NEW_PATH" not in err[0], err
    assert main([*resume, "--data", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on other data" in err[0], err
    # named neither the flag nor the file this run reads
    assert f"this run reads {other.resolve()}: give --data the file the run" in err[0], err
    # rows with new ids resize the tables: that was refused as "other parameters than
    # this run builds ... resume with the model settings", none of which had changed
    grown = tmp_path / "grown.txt"
    new = ["\t".join([*f[:14], *(f"{i:08x}" for _ in f[14:])]) + "\n"
           for i, f in enumerate(x.rstrip("\n").split("\t") for x in lines[:40])]  # fmt: skip
    grown.write_text("".join(lines + new))
    assert main([*resume, "--data", str(grown)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "trained on other data" in err[0], err
    # its cache gone (or unwritable) too: another --cache-dir was refused as a change
    assert main([*resume, "--data", str(moved), "--cache-dir", str(tmp_path / "cache2")]) == 0
    assert (tmp_path / "cache2").is_dir()
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 4
    assert (run / "checkpoints" / "step_00000004").is_dir()
    # the new place holds at the next plain --resume (and for the report's resume): it
    # went back to the old path and failed, whatever was passed before
    from experiments import cli
    from experiments.dlrm.experiment import EXPERIMENT

    kept = cli.resumed_config(EXPERIMENT, run).data
    assert (kept.path, kept.cache_dir) == (str(moved), str(tmp_path / "cache2"))
    assert main(resume) == 0


def test_the_report_says_hot_rows_and_hashed_dense_tables() -> None:
    """A hashed dense baseline (and CoMERA's hot rows) were described as "the same
    architecture" with nothing more; a JSON from before they were kept says nothing."""
    from experiments.dlrm.report import _hashed, _hot

    assert _hot({"hot_rows": 64}) == ", plus a dense row for each table's 64 most frequent ids"
    assert _hashed({"hash_rows": 5000}) == (
        ", its large tables hashed into 5,000 rows each (model.hash_rows)"
    )
    assert _hot({}) == _hashed({}) == _hot({"hot_rows": 0}) == ""


def test_the_report_says_what_is_not_the_smoke_preset_and_a_missing_late_stage() -> None:
    """Runs with overridden settings were headed "smoke preset", and an early stage longer
    than the run printed as configured ("early stage 600 steps" for 60); a JSON from
    before steps and changes were kept reads as before."""
    from experiments.dlrm.report import _changed, _early

    assert _changed({"changed": ["train.steps", "data.path"]}) == (
        " with `train.steps`, `data.path` changed"
    )
    assert _changed({"changed": []}) == _changed({}) == ""
    assert _early({"early_steps": 600, "steps": 60}) == "early stage all 60 steps (no late stage)"
    assert _early({"early_steps": 60, "steps": 60}) == "early stage all 60 steps (no late stage)"
    assert (
        _early({"early_steps": 50, "steps": 60})
        == _early({"early_steps": 50})
        == ("early stage 50 steps")
    )
