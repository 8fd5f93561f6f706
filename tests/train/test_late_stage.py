"""The late stage: a size objective the gate/core scale symmetry cannot lower, pruning to a
live-size budget, the target-compression knob and the record of how the target was met."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

import comera as C
from comera.errors import ConfigError
from comera.train import ComeraConfig, Trainer
from comera.train.measures import model_size
from comera.train.objectives import gate_regularizer, share_size, size_surrogate
from comera.train.stages import StageController
from comera.tree import prune_to_size
from tests.train_helpers import ToyTask, _cfg, _toy_model


def _layer(kind: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    if kind == "tt":
        spec = C.TTLinearSpec(out_modes=(4, 3, 2), in_modes=(2, 3, 4), ranks=5)
    else:
        spec = C.TTMEmbeddingSpec(vocab_modes=(4, 3, 2), dim_modes=(2, 2, 2), ranks=5)
    p, s = C.init(spec, generator=g)
    with torch.no_grad():  # gates away from one, so the symmetry has something to move
        for gate in p["gates"]:
            gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
    return {"a": p}, {"a": s}


@pytest.mark.parametrize("kind", ["tt", "ttm"])
@pytest.mark.parametrize("side", ["left", "right"])
def test_scaling_gates_down_and_cores_up_leaves_the_size_objective_unchanged(kind, side):
    params, state = _layer(kind)
    before_new = float(share_size(params, state))
    before_old = float(size_surrogate(params, state))
    p = params["a"]
    moved = {
        **p,
        "cores": [c.clone() for c in p["cores"]],
        "gates": [g.clone() for g in p["gates"]],
    }
    factor = 0.1
    for k, gate in enumerate(moved["gates"]):  # every bond, every rank
        gate.mul_(factor)
        if side == "right":  # the next core's leading slices carry the scale
            moved["cores"][k + 1].div_(factor)
        else:  # the previous core's trailing slices do
            moved["cores"][k].div_(factor)
    # the weight itself is unchanged: nothing a user can measure moved
    dense = C.to_dense(p, state["a"])
    torch.testing.assert_close(C.to_dense(moved, state["a"]), dense, rtol=1e-4, atol=1e-5)
    after_new = float(share_size({"a": moved}, state))
    after_old = float(size_surrogate({"a": moved}, state))
    assert after_new == pytest.approx(before_new, rel=1e-4)
    assert after_old < 0.05 * before_old  # the paper's S falls with the gates


def test_share_size_is_the_stored_count_at_equal_shares_and_falls_as_ranks_fade():
    params, state = _layer("tt")
    p = params["a"]
    stored = sum(c.numel() for c in p["cores"]) + sum(g.numel() for g in p["gates"])
    size = float(share_size(params, state))
    assert 0 < size <= stored  # soft ranks never exceed the ranks
    with torch.no_grad():
        p["gates"][1][:3] *= 1e-3  # three ranks of bond 1 carry almost nothing now
    assert float(share_size(params, state)) < size
    # the gradient reaches the gates only (the cores are the loss's), and a dead rank's
    # gate gets 0, not NaN
    state["a"]["masks"][0][0] = False
    for t in [*p["cores"], *p["gates"]]:
        t.requires_grad_(True)
    size = share_size(params, state)
    assert torch.autograd.grad(size, p["cores"], allow_unused=True) == (None,) * len(p["cores"])
    grads = torch.autograd.grad(share_size(params, state), p["gates"])
    assert all(torch.isfinite(g).all() for g in grads) and float(grads[0].abs().sum()) > 0
    assert float(grads[0][0]) == 0.0


def _share_size_per_layer(params, state) -> torch.Tensor:
    """share_size's definition, one layer at a time through ``rank_shares``."""
    from comera.pruning import rank_shares
    from comera.tree import iter_tt

    total = torch.zeros(())
    for _, p, s in iter_tt(params, state):
        shares = rank_shares({**p, "cores": [c.detach() for c in p["cores"]]}, s)
        if any(x.numel() == 0 for x in shares):
            continue  # a bond with no rank: the zero map
        soft = [x.sum() / x.max().clamp_min(torch.finfo(x.dtype).tiny) for x in shares]
        full = [1.0, *soft, 1.0]
        cores = p["cores"]
        total = total + sum(math.prod(c.shape[1:-1]) * full[k] * full[k + 1]
                            for k, c in enumerate(cores)) + sum(soft, torch.zeros(()))  # fmt: skip
    return total


def _assert_share_size_is_per_layer(params, state) -> None:
    """share_size and its gate gradients equal the per-layer definition's."""
    gates = [g.requires_grad_() for p in params.values() for g in p["gates"]]
    size = share_size(params, state)
    ref = _share_size_per_layer(params, state)
    torch.testing.assert_close(size, ref)
    for a, b in zip(torch.autograd.grad(size, gates, allow_unused=True),
                    torch.autograd.grad(ref, gates, allow_unused=True), strict=True):  # fmt: skip
        if b is None:
            assert a is None or float(a.abs().sum()) == 0
        else:
            torch.testing.assert_close(a, b)


def test_share_size_of_many_layers_equals_the_per_layer_sum():
    """Layers measured together (one structure, zero-padded to the largest ranks) give
    each layer's own size and gradients: layers compacted to other ranks, a TTM, a dead
    rank, a layer with no rank on a bond."""
    params, state = {}, {}
    for i, kind in enumerate(["tt", "tt", "tt", "ttm", "tt"]):
        p, s = _layer(kind, seed=i)
        params[f"l{i}"], state[f"l{i}"] = p["a"], s["a"]
    masks = [m.clone() for m in state["l1"]["masks"]]
    masks[0][:2], masks[1][:1] = False, False
    params["l1"], state["l1"] = C.compact(params["l1"], {"masks": masks})  # ranks 3, 4
    state["l2"]["masks"][1][3] = False  # dead, not compacted
    masks = [m.clone() for m in state["l4"]["masks"]]
    masks[1][:] = False
    params["l4"], state["l4"] = C.compact(params["l4"], {"masks": masks})  # bond 1: rank 0
    _assert_share_size_is_per_layer(params, state)


@pytest.mark.parametrize("batching", ["all", "default", "none"])
def test_share_size_batches_layers_of_other_modes_and_core_counts(monkeypatch, batching):
    """Small layers of other modes and numbers of cores are measured in padded batches
    (a shorter train extended by cores holding one); each still counts as on its own,
    value and gradients. Above the size limit every structure is its own batch."""
    from comera.train import objectives

    specs = [
        C.TTLinearSpec(out_modes=(4, 3, 2), in_modes=(2, 3, 4), ranks=5),  # 6 cores
        C.TTLinearSpec(out_modes=(4, 3), in_modes=(3, 2), ranks=4),  # 4 cores
        C.TTMEmbeddingSpec(vocab_modes=(4, 3, 2, 2), dim_modes=(2, 2, 1, 2), ranks=3),
        C.TTLinearSpec(out_modes=(4, 3, 2), in_modes=(2, 3, 4), ranks=5),
        C.TTLinearSpec(out_modes=(8, 3, 2), in_modes=(2, 3, 4), ranks=6),  # other modes
        C.TTLinearSpec(out_modes=(4, 3), in_modes=(3, 2), ranks=4),
    ]
    g = torch.Generator().manual_seed(3)
    params, state = {}, {}
    for i, spec in enumerate(specs):
        p, s = C.init(spec, generator=g)
        with torch.no_grad():
            for gate in p["gates"]:
                gate.copy_(0.5 + torch.rand(gate.shape, generator=g))
        params[f"l{i}"], state[f"l{i}"] = p, s
    masks = [m.clone() for m in state["l3"]["masks"]]
    masks[0][:2] = False
    params["l3"], state["l3"] = C.compact(params["l3"], {"masks": masks})  # fewer ranks
    state["l2"]["masks"][1][0] = False  # dead, not compacted
    masks = [m.clone() for m in state["l5"]["masks"]]
    masks[1][:] = False
    params["l5"], state["l5"] = C.compact(params["l5"], {"masks": masks})  # rank 0: skipped
    # one core and a zero weight: its added bonds carry no share, yet its mode counts once
    params["l6"] = {"cores": [torch.zeros(1, 6, 4, 1)], "gates": []}
    state["l6"] = {"masks": []}
    if batching == "all":
        monkeypatch.setattr(objectives, "PAD_RATIO", math.inf)
    elif batching == "none":
        monkeypatch.setattr(objectives, "SHARE_BATCH_ELEMENTS", 0)
    calls = []
    inner = objectives._group_size
    monkeypatch.setattr(objectives, "_group_size", lambda m: calls.append(len(m)) or inner(m))
    _assert_share_size_is_per_layer(params, state)
    # structures: the two alike linears (one compacted), and four others (l5 is skipped)
    want = {"all": [6], "default": [1, 1, 4], "none": [1, 1, 1, 1, 2]}[batching]
    assert sorted(calls) == want


def test_share_size_refuses_a_train_whose_edge_ranks_are_not_one():
    params, state = _layer("tt")
    cores = params["a"]["cores"]
    cores[0] = torch.cat([cores[0], cores[0]])  # leading rank 2
    # refused by the rank state's check, which every path runs (share_size's own went)
    with pytest.raises(ValueError, match=r"a: the cores' ranks do not chain.*rank 1 outside"):
        share_size(params, state)


def test_prune_to_size_kills_the_smallest_shares_first_and_keeps_a_rank_per_bond():
    params, state = _layer("tt", seed=1)
    shares = C.rank_contributions(params["a"], state["a"])
    smallest = int(shares[0].argmin())
    live = model_size(params, state)
    new, removed = prune_to_size(params, state, 1)  # one parameter: one rank goes
    assert removed >= 1 and model_size(params, new) == live - removed
    killed = [(k, int(i)) for k, m in enumerate(new["a"]["masks"]) for i in (~m).nonzero()]
    assert len(killed) == 1
    k, i = killed[0]
    assert float(shares[k][i]) == pytest.approx(min(float(s.min()) for s in shares))
    assert k != 0 or i == smallest
    assert all(bool(m.all()) for m in state["a"]["masks"])  # pure: the input is untouched
    floor, removed = prune_to_size(params, state, 10**9)  # asks for more than exists
    assert set(C.live_ranks(floor["a"])) == {1}
    assert removed == live - model_size(params, floor)


def test_the_budget_falls_cubically_from_the_early_size_to_the_target():
    c = ComeraConfig(early_steps=10, size_ratio=0.5, prune_ramp=0.5, prune_every=100)
    sc = StageController(c, total_steps=50)
    params, state = _toy_model()
    sc.fix_targets(params, state, live=1000, reference=4000, step=10)
    sc.stage = "late"
    assert sc.ramp_end() == 30
    budgets = [sc.size_budget(s) for s in range(10, 51)]
    assert budgets[0] == 1000 and sc.size_budget(30) == 500 and sc.size_budget(50) == 500
    assert all(a >= b for a, b in zip(budgets, budgets[1:], strict=False))
    assert sc.size_budget(20) == pytest.approx(500 + 500 * 0.5**3)
    assert "prune" in sc.events(30)  # the ramp's end is a prune event
    # target_compression: reference / X, never above the size the stage starts with
    sc2 = StageController(dataclasses.replace(c, target_compression=8.0), 50)
    sc2.fix_targets(params, state, live=1000, reference=4000, step=10)
    assert sc2.targets["params"] == 500
    sc3 = StageController(dataclasses.replace(c, target_compression=2.0), 50)
    sc3.fix_targets(params, state, live=1000, reference=4000, step=10)
    assert sc3.targets["params"] == 1000 and sc3.holds  # already beyond: hold


def test_a_met_size_never_leads_the_late_objective():
    c = ComeraConfig(early_steps=10, size_ratio=0.5, prune_every=100)
    sc = StageController(c, total_steps=50)
    params, state = _toy_model()
    for t in (*params["lin"]["cores"], *params["lin"]["gates"]):
        t.requires_grad_(True)
    sc.fix_targets(params, state, live=1000, reference=4000, step=10)
    sc.stage = "late"
    sc.targets["loss"] = 2.0
    sc.live_params = 900  # over the budget at step 12 (about 990): size leads a good loss
    assert sc.objective(12, 0.5, params, state).metrics["focus_size"] == 1.0
    assert sc.late_inputs(12)[0] > -0.5
    sc.live_params = 400  # under it: the loss leads, however far below L0 it is
    obj = sc.objective(12, 0.5, params, state)
    assert obj.metrics["focus_size"] == 0.0 and obj.loss_weight == pytest.approx(1.05 / 2.0)
    assert sc.late_inputs(12)[0] == -math.inf


def test_bad_late_stage_settings_name_the_field():
    for kw, field in [
        ({"size_objective": "gates"}, "size_objective"),
        ({"late_prune": "never"}, "late_prune"),
        ({"prune_ramp": 0.0}, "prune_ramp"),
        ({"target_compression": 0.5}, "target_compression"),
        ({"target_compression": math.inf}, "target_compression"),
        ({"gamma": math.nan}, "gamma"),
        ({"tau": math.nan}, "tau"),
        ({"rho": -1.0}, "rho"),
        ({"rho": math.nan}, "rho"),
        ({"loss_target": math.nan}, "loss_target"),
        # weights past float32's range trained on NaN, blamed on the learning rates
        ({"gamma": 1e39}, "gamma=1e\\+39 is above 1e\\+37"),
        ({"rho": 1e39}, "rho"),
        ({"loss_target": 1e-40}, "loss_target=1e-40 makes the late stage's weight"),
    ]:
        with pytest.raises(ConfigError, match=field):
            ComeraConfig(**kw)


def test_bad_optimizer_settings_name_the_field():
    """NaN passes a ``< 0`` check and would train NaN into a checkpoint; a betas of the
    wrong length would pass until the first update."""
    from comera.train.optim import AdamWConfig, SGDConfig

    for kw, field in [
        ({"lr_cores": math.nan}, "lr_cores"),
        ({"lr_gates": math.inf}, "lr_gates"),
        ({"eps": math.nan}, "eps"),
        ({"weight_decay": math.nan}, "weight_decay"),
        ({"betas": (0.9,)}, "betas"),
        ({"betas": (0.9, 0.99, 0.5)}, "betas"),
    ]:
        with pytest.raises(ConfigError, match=field):
            AdamWConfig(**kw)
    for kw in ({"lr": math.nan}, {"lr_gates": math.nan}):
        with pytest.raises(ConfigError, match="SGDConfig"):
            SGDConfig(**kw)


def _late_cfg(tmp_path, **comera):
    base = dict(gamma=0.0, tau=1e-3, early_steps=20, prune_every=10, size_ratio=0.5)
    return _cfg(tmp_path, steps=60, comera=ComeraConfig(**{**base, **comera}))


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_the_late_stage_meets_its_size_target_in_live_parameters(tmp_path, mode):
    cfg = dataclasses.replace(_late_cfg(tmp_path), step_mode=mode)
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    tr.fit()
    ranks = json.loads((tmp_path / "run" / "ranks.json").read_text())
    early = ranks["end_of_early"]["live_params"]
    end = ranks["end"]
    assert end["early_params"] == early and end["size_target"] == round(0.5 * early)
    assert end["live_params"] <= end["size_target"]  # met in parameters, not in a number
    assert end["live_over_target"] <= 1.0 and "above_target_because" not in end
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().split("\n")
            if x]  # fmt: skip
    late = [r for r in rows if r.get("stage") == "late" and "size" in r]
    assert late and all("size_budget" in r and "live_params" in r for r in late)


def test_threshold_pruning_records_why_it_missed(tmp_path):
    cfg = _late_cfg(tmp_path, late_prune="threshold")
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    end = json.loads((tmp_path / "run" / "ranks.json").read_text())["end"]
    assert end["live_over_target"] > 1.0
    assert "late_prune=threshold" in end["above_target_because"]


def test_size_ratio_one_holds_the_size_and_trains_the_loss_alone(tmp_path):
    cfg = _late_cfg(tmp_path, size_ratio=1.0)
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    tr.fit()
    end = json.loads((tmp_path / "run" / "ranks.json").read_text())["end"]
    assert end["live_params"] == end["early_params"]
    assert tr.stages.objective(60, 1.0, tr.params, tr.state).param_term is None


def test_target_compression_reaches_the_whole_model_compression(tmp_path):
    params, state = _toy_model()
    dense = 256  # a 16x16 weight, no bias: the reference compression is measured against
    cfg = _late_cfg(tmp_path, target_compression=3.0)
    tr = Trainer(cfg, ToyTask(), params, state, reference_size=dense)
    tr.fit()
    live = model_size(tr.params, tr.state)
    assert dense / live == pytest.approx(3.0, rel=0.1) and dense / live >= 3.0


def test_a_target_below_the_early_stages_compression_is_held_and_said(tmp_path, capsys):
    """A target compression the early stage already passed is held (the late stage never
    grows the model): the run says so at the transition, and ranks.json's end record."""
    params, state = _toy_model()
    cfg = _late_cfg(tmp_path, target_compression=1.001)
    tr = Trainer(cfg, ToyTask(), params, state, reference_size=256)
    tr.fit()
    end = json.loads((tmp_path / "run" / "ranks.json").read_text())["end"]
    assert end["size_target"] == end["early_params"]
    assert "target_compression=1.001 asks for 256 parameters" in end["target_held_because"]
    assert "holds that size" in capsys.readouterr().err
    plain = Trainer(_late_cfg(tmp_path / "b"), ToyTask(), *_toy_model())  # size_ratio 0.5
    plain.fit()
    assert "target_held_because" not in plain.size_record()


def test_a_target_compression_the_run_never_reaches_is_said(tmp_path, capsys):
    cfg = dataclasses.replace(_late_cfg(tmp_path, target_compression=3.0), steps=20)
    Trainer(cfg, ToyTask(), *_toy_model(), reference_size=256).fit()
    assert "this run never reaches it" in capsys.readouterr().err
    # a run that adapts no ranks (--dense) took the knob without a word
    off = dataclasses.replace(cfg, run_dir=str(tmp_path / "off"),
                              comera=dataclasses.replace(cfg.comera, enabled=False))  # fmt: skip
    Trainer(off, ToyTask(), *_toy_model(), reference_size=256).fit()
    err = capsys.readouterr().err
    assert "target_compression=3 sets CoMERA's late-stage size" in err
    assert "train.comera.enabled=False" in err and "it is not used" in err


def test_an_old_late_stage_checkpoint_resumes_only_as_the_paper_late_stage():
    from comera.errors import CheckpointError

    old = {"stage": "late", "targets": {"size": 100.0, "loss": 1.0}, "loss_ema": 1.0}
    with pytest.raises(CheckpointError, match="size_objective=paper.*late_prune=threshold"):
        StageController(ComeraConfig(), 10).load_state_dict(old)
    paper = ComeraConfig(size_objective="paper", late_prune="threshold")
    sc = StageController(paper, 10)
    sc.load_state_dict(old)
    assert sc.targets == old["targets"]
    with pytest.raises(ConfigError, match="target_compression needs live-size targets"):
        ComeraConfig(size_objective="paper", late_prune="threshold", target_compression=4.0)


@pytest.mark.parametrize(
    ("dtype", "rank"), [(torch.float16, 8), (torch.float16, 48), (torch.bfloat16, 8)]
)
def test_half_precision_layers_measure_their_size_without_overflow(dtype, rank) -> None:
    """fp16's range ends at 65504: a 1000 x 128 table's Gram matrices pass it (rank 8:
    the shares were 0), and so does its size surrogate at rank 48 (82,240: inf). The
    size measures run in at least fp32, so a half-precision layer's equal the fp32
    model's of the same values, finite, with gradients on the gates (bf16, whose range
    is fp32's, is the consistency check)."""
    spec = C.TTMEmbeddingSpec(vocab_modes=(10, 10, 10), dim_modes=(4, 4, 8), ranks=rank)
    p32, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    half = {k: [t.to(dtype).requires_grad_() for t in v] for k, v in p32.items()}
    p32 = {k: [t.to(dtype).float() for t in v] for k, v in p32.items()}  # the same values
    for measure in (share_size, size_surrogate):
        want = measure({"emb": p32}, {"emb": s})
        got = measure({"emb": half}, {"emb": s})
        assert torch.isfinite(got) and float(got.detach()) == pytest.approx(float(want), rel=1e-3)
        (g,) = torch.autograd.grad(got, half["gates"][:1])
        assert torch.isfinite(g).all() and g.abs().sum() > 0
    for a, b in zip(C.pruning.rank_shares(half, s), C.pruning.rank_shares(p32, s), strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a.float(), b, rtol=1e-2, atol=1e-3)


def test_the_gate_regularizer_counts_fp16_gates_past_its_range() -> None:
    """70,000 live fp16 gates: their count passes 65504 (inf, and the mean 0), so the
    regularizer sums and counts in fp32."""
    r = 70_000  # one bond of a 1 x 1 train (init would cap the rank at the modes)
    cores = [torch.zeros(1, 1, r, dtype=torch.float16), torch.zeros(r, 1, 1, dtype=torch.float16)]
    p = {"cores": cores, "gates": [torch.full((r,), 0.5, dtype=torch.float16)]}
    s = {"masks": [torch.ones(r, dtype=torch.bool)]}
    assert float(gate_regularizer({"l": p}, {"l": s}, "mean")) == pytest.approx(0.5)
    assert float(gate_regularizer({"l": p}, {"l": s}, "l1")) == pytest.approx(35_000)


class _Scaled(ToyTask):
    """The toy loss times ``f``: 0 is a converged hinge loss, 1e-45 a tiny one."""

    def __init__(self, f: float) -> None:
        super().__init__()
        self.f = f

    def loss(self, params, state, batch, *, train):
        loss, n, m = super().loss(params, state, batch, train=train)
        return loss * self.f, n, m


@pytest.mark.parametrize(
    ("f", "text"),
    [(0.0, "L0 is 0, the smoothed loss"), (1e-45, "overflow: set train.comera.loss_target")],
)
def test_a_smoothed_loss_at_zero_or_too_small_for_its_weight_is_refused(tmp_path, f, text):
    # 0 became L0 = 1.0 without a word; 1e-45 was a bare float32 overflow RuntimeError
    tr = Trainer(_late_cfg(tmp_path), _Scaled(f), *_toy_model())
    with pytest.raises(ConfigError, match=text):
        tr.fit()


def test_compaction_events_remove_dead_ranks_and_kill_none(tmp_path):
    """compact_every pruned as well, so a setting documented as the tensors' layout changed
    which ranks lived: with no prune event in the early stage, ranks died at step 25."""

    def ranks(d, every):
        c = ComeraConfig(gamma=0.5, tau=0.05, early_steps=40, prune_every=1000,
                         compact_every=every)  # fmt: skip
        Trainer(_cfg(tmp_path / d, comera=c), ToyTask(), *_toy_model()).fit()
        rows = (tmp_path / d / "run" / "metrics.jsonl").read_text().splitlines()
        return [(r["step"], r["ranks/lin"]) for r in map(json.loads, rows) if "ranks/lin" in r]

    kept = ranks("none", None)
    assert ranks("five", 5) == kept
    assert [n for step, n in kept if step < 40] == [14] * len([s for s, _ in kept if s < 40])


def test_the_step_that_ends_the_early_stage_is_logged_early(tmp_path):
    # the transition ran before the row was written, so it said "late"
    Trainer(_late_cfg(tmp_path), ToyTask(), *_toy_model()).fit()
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    stage = {r["step"]: r["stage"] for r in rows if "stage" in r}
    assert stage[20] == "early" and stage[30] == "late"


def test_a_model_pruned_to_the_zero_map_is_said(tmp_path, capsys):
    """A tau that kills every rank made the model the zero map without a word, and the
    end record said every bond was "down to one live rank"."""
    cfg = dataclasses.replace(_late_cfg(tmp_path, tau=1e9), checkpoint_every=30)
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    tr.fit(until=30)
    err = capsys.readouterr().err
    assert err.count("lin pruned to rank 0: the zero map") == 1, err
    Trainer(cfg, ToyTask(), *_toy_model(), resume=True).fit()  # said before: not again
    assert "the zero map" not in capsys.readouterr().err
    end = json.loads((tmp_path / "run" / "ranks.json").read_text())["end"]
    assert "pruned to rank 0 (the zero map)" in end["above_target_because"]


def test_settings_a_short_or_late_started_run_never_uses_are_said(tmp_path, capsys):
    cfg = dataclasses.replace(_late_cfg(tmp_path, gamma=0.1, reg_start_step=30, early_steps=50),
                              steps=30)  # fmt: skip
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    assert "the gate regularizer never acts in this run" in capsys.readouterr().err
    # a run that starts late (no transition to say it) and asks the model to grow
    grow = _late_cfg(tmp_path / "late", early_steps=0, loss_target=1.0, target_compression=1.001)
    Trainer(grow, ToyTask(), *_toy_model(), reference_size=256).fit()
    assert "the late stage starts from; it never grows" in capsys.readouterr().err
