"""The trainer with ``auto`` plans: the decisions are recorded, a compaction re-decides,
deciding draws nothing from the RNG, and a compiled step reads decisions made before it
was traced (no graph break)."""

import json

import pytest
import torch
from torch.utils._pytree import tree_flatten

import comera as C
from comera import autotune as A
from comera.train import Trainer, read_metrics, sync_free
from tests.train_helpers import ToyTask, _cfg, _toy_model

from .test_sync_free import STAGES, _PureToy


class StubTimer:
    """Runs every candidate (forward and backward, as the real timer does), then reports
    fixed times, so a test can pick the winner and still see what timing itself does."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times, self.calls = times, 0

    def __call__(self, runs: dict) -> dict[str, float]:
        self.calls += 1
        for run in runs.values():
            run()
        return {c: self.times[c] for c in runs}


def _fit(tmp_path, name, plan, timer=None, task=None, **kw):
    cfg = _cfg(tmp_path / name, steps=60, comera=STAGES, **kw)
    tuner = A.PlanTuner(timer=timer or StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    with A.use_tuner(tuner), C.default_plan(plan):
        tr = Trainer(cfg, task or ToyTask(noise=0.1), *_toy_model(), auto_plans=plan == "auto")
        out = tr.fit()
    return tr, out, tuner


def test_auto_choosing_comera_trains_exactly_like_comera(tmp_path, capsys) -> None:
    """Deciding (timing) happens inside the first step and after each compaction, and
    changes nothing the step computes or draws: the same run as ``plan="comera"``."""
    ref, out_ref, _ = _fit(tmp_path, "comera", "comera", log_every=1)
    auto, out_auto, tuner = _fit(tmp_path, "auto", "auto", log_every=1)
    for a, b in zip(tree_flatten(ref.params)[0], tree_flatten(auto.params)[0], strict=True):
        assert torch.equal(a, b)
    assert out_ref["loss"] == out_auto["loss"]
    assert tuner.timer.calls >= 2  # the first shapes, then the compacted ones
    history = json.loads((tmp_path / "auto" / "run" / "plans.json").read_text())
    assert list(history)[0] == "1" and len(history) >= 2  # decided at step 1, then again
    first, *later = history.values()
    assert {d["choice"] for d in first.values()} == {"comera"}
    assert {d["what"] for d in first.values()}.isdisjoint(
        {d["what"] for h in later for d in h.values()}
    )
    config = json.loads((tmp_path / "auto" / "run" / "config.json").read_text())
    assert set(config["auto_plans"].values()) == {"comera"}
    assert len(config["auto_plans"]) == sum(len(h) for h in history.values())
    assert "comera: auto plans at step 1: tt_linear: comera" in capsys.readouterr().err
    assert not (tmp_path / "comera" / "run" / "plans.json").exists()
    # the steps that timed candidates are marked: their times are not training steps'
    rows = read_metrics(tmp_path / "auto" / "run" / "metrics.jsonl")
    marked = {r["step"] for r in rows if r.get("plans_timed")}
    assert marked == {int(k) for k in history} and 1 in marked


def test_a_resume_keeps_the_runs_record_and_a_fresh_run_its_own_history(tmp_path) -> None:
    """Recording new decisions on resume sets ``auto_plans`` in ``config.json`` as written
    (the CLI's ``argv`` and ``resumes`` stay); a fresh run in a dir that holds a stopped
    attempt's ``plans.json`` starts its own history."""
    tuner = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    cfg = _cfg(tmp_path / "a", steps=60, comera=STAGES, checkpoint_every=10)
    run = tmp_path / "a" / "run"
    with A.use_tuner(tuner), C.default_plan("auto"):
        tr = Trainer(cfg, ToyTask(noise=0.1), *_toy_model(), auto_plans=True,
                     extra_config={"argv": ["first"]})  # fmt: skip
        tr.fit(until=20)  # before the transition's compaction: new shapes after it
        record = json.loads((run / "config.json").read_text())
        record["resumes"] = [{"step": 20, "argv": ["again"]}]  # what the CLI adds
        (run / "config.json").write_text(json.dumps(record))
        again = Trainer(cfg, ToyTask(noise=0.1), *_toy_model(), auto_plans=True, resume=True,
                        extra_config={"argv": ["again"]})  # fmt: skip
        # what the resumed run's wandb config starts with: the plans it keeps deciding by
        assert again.config_dict["auto_plans"] == record["auto_plans"]
        again.fit()
    after = json.loads((run / "config.json").read_text())
    assert after["argv"] == ["first"] and after["resumes"] == record["resumes"]
    assert len(after["auto_plans"]) > len(record["auto_plans"])  # the compacted shapes too
    stale = tmp_path / "b" / "run"
    stale.mkdir(parents=True)
    (stale / "plans.json").write_text(json.dumps({"999": {"gone": {"what": "x"}}}))
    _fit(tmp_path, "b", "auto")
    assert "999" not in json.loads((stale / "plans.json").read_text())


def test_a_resume_on_another_thread_count_keeps_the_recorded_plans(tmp_path) -> None:
    """The decision keys hold the CPU's model and torch's thread count: a resume on
    another count (or machine) found none of the decisions it recorded, timed afresh and
    could run other plans than its first steps did."""
    cfg = _cfg(tmp_path, steps=12, checkpoint_every=4)
    threads = torch.get_num_threads()
    first = A.PlanTuner(timer=StubTimer({"comera": 3.0, "dense": 2.0, "dp": 1.0}))
    try:
        torch.set_num_threads(1)
        with A.use_tuner(first), C.default_plan("auto"):
            Trainer(cfg, ToyTask(), *_toy_model(), auto_plans=True).fit(until=4)
        recorded = json.loads((tmp_path / "run" / "config.json").read_text())["auto_plans"]
        assert set(recorded.values()) == {"dp"}
        torch.set_num_threads(2)
        again = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 3.0, "dp": 2.0}))
        with A.use_tuner(again), C.default_plan("auto"):
            Trainer(cfg, ToyTask(), *_toy_model(), auto_plans=True, resume=True).fit()
    finally:
        torch.set_num_threads(threads)
    assert again.timings == 0  # nothing timed afresh: the recorded choices went on
    after = json.loads((tmp_path / "run" / "config.json").read_text())["auto_plans"]
    assert after == recorded


def test_a_call_that_got_no_decision_does_not_sync_every_step(tmp_path, monkeypatch) -> None:
    """Ranks sync when one timed or first used a decision; a call the tuner asked about
    but did not decide (no tokens, or where timing cannot run) is nothing to agree on."""
    from comera.train import loop

    tuner = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    with A.use_tuner(tuner), C.default_plan("auto"):
        tr = Trainer(_cfg(tmp_path, steps=2), ToyTask(), *_toy_model(), auto_plans=True)
        tr.fit()
    sent = []
    monkeypatch.setattr(loop, "sum_across_ranks", lambda tensors: tensors)
    monkeypatch.setattr(loop, "broadcast_object", lambda obj: sent.append(obj) or obj)
    monkeypatch.setattr(A, "current_tuner", lambda: tuner)
    monkeypatch.setattr(loop, "current_tuner", lambda: tuner)
    tr.world = 2  # as if distributed: the collectives above stand in for gloo's
    tr._timed, tuner.used = tuner.timings, set()  # all synced and recorded so far
    tuner.used.add("never decided")
    tr._sync_plans()
    assert sent == []
    decided = next(iter(tr.plans))
    tr.plans.pop(decided)
    tuner.used.add(decided)  # a decision this run had not used (one from a rank's cache)
    tr._sync_plans()
    assert len(sent) == 1


def test_sync_free_steps_decide_before_the_step(tmp_path) -> None:
    """The sync-free step runs eagerly, so it decides inside its first step: its plans
    are the timed ones (here ``dp``: ``dense`` is fastest but its 16 x 16 ``W`` is over 5%
    of the 16 tokens' activations), not the fallback, and the run equals ``plan="dp"``."""
    timer = StubTimer({"comera": 3.0, "dense": 1.0, "dp": 2.0})
    auto, out_auto, tuner = _fit(tmp_path, "auto", "auto", timer, step_mode="sync_free")
    ref, out_ref, _ = _fit(tmp_path, "dp", "dp", step_mode="sync_free")
    history = json.loads((tmp_path / "auto" / "run" / "plans.json").read_text())
    assert list(history)[0] == "1"
    decisions = [d for h in history.values() for d in h.values()]
    assert {d["choice"] for d in decisions} == {"dp"} and all(
        "dense" in d["skipped"] for d in decisions
    )
    for a, b in zip(tree_flatten(ref.params)[0], tree_flatten(auto.params)[0], strict=True):
        assert torch.equal(a, b)
    assert out_ref["loss"] == out_auto["loss"]


@pytest.mark.slow
def test_a_compiled_step_reads_decided_plans_without_a_graph_break(tmp_path, monkeypatch):
    """``compile`` decides before tracing, among the plans that trace (``dp`` would be
    fastest here but does not trace), and the compiled step runs the decision: one
    graph, and the run equals ``plan="dense"`` (the memory rule is lifted so the toy's
    16 x 16 ``W`` may be rebuilt)."""
    monkeypatch.setattr(sync_free, "COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(A, "DENSE_SHARE", 1.0)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    timer = StubTimer({"comera": 3.0, "dense": 2.0, "dp": 1.0})
    auto, out_auto, _ = _fit(tmp_path, "auto", "auto", timer, _PureToy(), step_mode="compile")
    assert not torch._dynamo.utils.counters["graph_break"]
    torch._dynamo.reset()
    ref, out_ref, _ = _fit(tmp_path, "dense", "dense", None, _PureToy(), step_mode="compile")
    torch._dynamo.reset()
    assert out_auto["loss"] == pytest.approx(out_ref["loss"], rel=1e-4)
    history = json.loads((tmp_path / "auto" / "run" / "plans.json").read_text())
    # the training calls (evaluation runs eager, where every candidate may be timed)
    decisions = [d for h in history.values() for k, d in h.items() if "grad=1" in k]
    assert decisions and {d["choice"] for d in decisions} == {"dense"}
    assert all(set(d["times_ms"]) == {"comera", "dense"} for d in decisions)


RANK_SYNC = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
import comera as C
from comera import autotune as A
from comera.train import Trainer
from tests.train_helpers import ToyTask, _cfg, _toy_model
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
out = Path(sys.argv[1])
# each rank's clock prefers another plan: rank 0 opt_einsum's dp, rank 1 comera
times = {"comera": 1.0, "dense": 3.0, "dp": 2.0}
if rank == 0:
    times = {"comera": 2.0, "dense": 3.0, "dp": 1.0}
tuner = A.PlanTuner(timer=lambda runs: {c: times[c] for c in runs})
with A.use_tuner(tuner), C.default_plan("auto"):
    tr = Trainer(_cfg(out / "run", steps=4), ToyTask(rank=rank, world=2), *_toy_model(),
                 auto_plans=True)
    tr.fit()
choices = {k: d.choice for k, d in tuner.decisions.items()}
(out / f"choices_{rank}.json").write_text(json.dumps(choices))
# then each rank reads its own cache, which disagrees: rank 1's flipped to other choices;
# nothing is timed, and the ranks still end on rank 0's
if rank == 1:
    other = lambda k, c: next(x for x in k.split("from=")[1].split("|")[0].split(",") if x != c)
    flip = {k: {**vars(d), "choice": other(k, d.choice)} for k, d in tuner.decisions.items()}
    tuner.install(flip)
timed = tuner.timings
with A.use_tuner(tuner), C.default_plan("auto"):
    Trainer(_cfg(out / "again", steps=2), ToyTask(rank=rank, world=2), *_toy_model(),
            auto_plans=True).fit()
assert tuner.timings == timed, "the second run timed"
choices = {k: d.choice for k, d in tuner.decisions.items()}
(out / f"cached_{rank}.json").write_text(json.dumps(choices))
dist.destroy_process_group()
"""


def test_every_rank_adopts_rank_zeros_decisions(tmp_path) -> None:
    """Two gloo ranks whose clocks disagree end the run on rank 0's choices."""
    from tests.train_helpers import spawn_ranks

    script = tmp_path / "sync.py"
    script.write_text(RANK_SYNC)
    assert spawn_ranks(script, 2, str(tmp_path)) == [0, 0]
    zero, one = (json.loads((tmp_path / f"choices_{r}.json").read_text()) for r in (0, 1))
    assert zero == one and zero
    assert "dp" in set(zero.values())  # rank 0's clock won where dp was a candidate
    zero, one = (json.loads((tmp_path / f"cached_{r}.json").read_text()) for r in (0, 1))
    assert zero == one  # decisions read from disagreeing caches: rank 0's, on every rank


class _LookupTask:
    """Sum of squares of a TTM lookup (``impl="auto"``): a task whose only plan is a lookup."""

    def __init__(self) -> None:
        self.spec = C.TTMEmbeddingSpec(vocab_modes=(4, 4), dim_modes=(2, 4), ranks=3)
        self.train_iter = iter(lambda: torch.randint(0, 16, (32,)), None)

    def model(self) -> tuple[dict, dict]:
        p, s = C.init(self.spec, generator=torch.Generator().manual_seed(0))
        return {"emb": p}, {"emb": s}

    def loss(self, params, state, ids, *, train):
        rows = C.ttm_embedding(params["emb"], state["emb"], ids, impl="auto", spec=self.spec)
        return rows.pow(2).sum(), ids.numel(), {}

    def evaluate(self, params, state):
        return {}


def test_the_eager_pass_before_a_traced_step_decides_sync_free_lookups(tmp_path) -> None:
    """A compiled (or captured: the same ``tune_plans``) step runs its TTM lookups
    sync-free and reads the decision for that call; the eager pass that decides before it
    must make that decision (not the one for a lookup that may read the device, which the
    step never asks for)."""
    task = _LookupTask()
    tuner = A.PlanTuner(timer=StubTimer({"optimized": 2.0, "table": 1.0}))
    with A.use_tuner(tuner):
        cfg = _cfg(tmp_path, steps=4, step_mode="compile", comera=STAGES)
        tr = Trainer(cfg, task, *task.model(), auto_plans=True)
        tr.tune_plans(next(task.train_iter))
    keys = [k for k, d in tuner.decisions.items() if d.kind == "ttm_embedding"]
    assert keys and all("sync_free=1" in k for k in keys), keys


@pytest.mark.parametrize("text", ['{"12": [1, 2]}', '{"12": {"k": ', "[1]"])
def test_a_damaged_plans_json_is_decided_afresh_on_resume(tmp_path, text) -> None:
    """A resume read plans.json with no guard: a damaged file was a traceback, there or
    where the next decision is recorded (which now starts a fresh history)."""
    from types import SimpleNamespace

    (tmp_path / "plans.json").write_text(text)
    run = SimpleNamespace(auto_plans=True, run_dir=tmp_path, plans={}, _history=True)
    with pytest.warns(UserWarning, match="plans.json is unreadable"):
        Trainer._reinstall_plans(run)
    assert run.plans == {} and run._history is False
