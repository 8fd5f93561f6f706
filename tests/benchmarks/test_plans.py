"""``python -m benchmarks.plans``: the smoke-step plumbing, the per-shape decisions and the
report rendered from the JSON alone."""

from __future__ import annotations

import json
import sys

import pytest

from benchmarks import plans
from comera import autotune as A

TINY = ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


class Stub:
    def __call__(self, runs: dict) -> dict[str, float]:
        return {c: {"comera": 2.0, "dense": 1.0, "dp": 3.0, "optimized": 2.0, "table": 1.0}[c]
                for c in runs}  # fmt: skip


def test_smoke_steps_time_three_variants_and_keep_the_decisions() -> None:
    r = plans.smoke_steps("mnli", steps=2, warmup=1, extra=TINY)
    assert set(r["step_ms"]) == {"auto", "comera", "dense"} and r["steps"] == 2
    assert r["smoke_step_time_ratio_vs_dense"] == pytest.approx(
        r["step_ms"]["auto"] / r["step_ms"]["dense"]
    )
    one, extra = r["one_example_step_ms"], r["fixed_extra_ms"]
    assert set(one) == {"auto", "dense"} and extra == pytest.approx(
        max(0.0, one["auto"] - one["dense"])
    )
    assert r["smoke_step_time_ratio_floor"] == pytest.approx(
        (r["step_ms"]["dense"] + extra) / r["step_ms"]["dense"]
    )
    assert set(r["late_step_ms"]) == {"auto", "dense"} and r[
        "late_step_time_ratio_vs_dense"
    ] == pytest.approx(r["late_step_ms"]["auto"] / r["late_step_ms"]["dense"])
    kinds = {d["kind"] for d in r["decisions"]}
    assert kinds == {"tt_linear", "ttm_embedding"}
    assert all(d["choice"] in d["times_ms"] for d in r["decisions"])
    # what the timed late steps ran on: no rank is pruned by the late trainer's second
    # step, so the early steps' shapes and token counts, and only those
    late = r["late_decisions"]
    assert all(d["choice"] in d["times_ms"] for d in late)
    assert {d["what"] for d in late} == {d["what"] for d in r["decisions"]}


@pytest.mark.parametrize("name", plans.EXPERIMENTS)
def test_paper_shapes_get_one_decision_per_distinct_layer(name: str) -> None:
    rows = plans.shape_decisions(name, A.PlanTuner(timer=Stub()))
    layers = [p for r in rows for p in r["layers"]]
    assert len(layers) == len(set(layers)) and rows
    assert all(r["choice"] in r["times_ms"] for r in rows)
    linears = [r for r in rows if r["kind"] == "tt_linear"]
    if name in ("mnli", "codebert"):  # 768 wide at 4,096 tokens: W is over the memory rule
        assert all(r["skipped"]["dense"].startswith("W ") for r in linears)
    else:  # DLRM's 512 -> 256 at 10,000 rows: W is small against the activations
        assert all("dense" in r["times_ms"] for r in linears)


STEP = json.dumps({"step_ms": {"auto": 10.0, "comera": 15.0, "dense": 11.0}, "steps": 2,
                   "warmup": 1, "smoke_step_time_ratio_vs_dense": 10 / 11,
                   "smoke_step_time_ratio_vs_dense_comera_plan": 15 / 11,
                   "decisions": []})  # fmt: skip


def test_report_renders_from_the_json_alone(tmp_path, capsys) -> None:
    step = {"step_ms": {"auto": 10.0, "comera": 15.0, "dense": 11.0}, "steps": 2, "warmup": 1,
            "smoke_step_time_ratio_vs_dense": 10 / 11,
            "smoke_step_time_ratio_vs_dense_comera_plan": 15 / 11,
            "one_example_step_ms": {"auto": 3.0, "dense": 2.0}, "fixed_extra_ms": 1.0,
            "smoke_step_time_ratio_floor": 12 / 11,
            "late_step_ms": {"auto": 13.0, "dense": 10.0}, "late_step_time_ratio_vs_dense": 1.3,
            "decisions": [{"kind": "tt_linear", "what": "64x64 ranks 8,8,8 tokens 2048",
                           "choice": "dense", "times_ms": {"comera": 0.3, "dense": 0.2},
                           "skipped": {"dp": "40x the cheapest forward FLOPs"}}],
            "paper_shapes": []}  # fmt: skip
    # the late steps: the early shape again (not repeated) and a compacted one
    step["late_decisions"] = [*step["decisions"], {
        "kind": "tt_linear", "what": "64x64 ranks 8,5,8 tokens 2048", "choice": "comera",
        "times_ms": {"comera": 0.1, "dense": 0.2}, "skipped": {}}]  # fmt: skip
    # DLRM: only its late steps' decisions, all of them early ones; lean without huge pages
    dlrm = {**step, "late_decisions": step["decisions"], "malloc": "lean", "hugepages": False}
    step = {**step, "malloc": "default", "hugepages": False}
    result = {"meta": {"command": "python -m benchmarks.plans", "cpu": "a CPU", "torch": "2",
                       "date": "2026-12-03", "threads": 2}, "mnli": step,
              "dlrm": dlrm}  # fmt: skip
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(result))
    assert plans.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| mnli | 10.00 | 15.00 | 11.00 | 0.909 | 1.364 | 3.00, 2.00 | 1.00 | 1.091 |" in out
    assert "**dense**" in out and "dp: 40x the cheapest forward FLOPs" in out
    assert "| mnli | 13.00 | 10.00 | 1.300 |" in out  # the late stage's step
    # another benchmark's JSON (its meta alone fits): refused, not an empty report
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"meta": result["meta"], "compression_ratio": 2.0}))
    assert plans.main(["--render", str(other)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a result of python -m benchmarks.plans" in err[0], err

    def section(title: str) -> str:  # from its heading to the next one
        rest = out[out.index(title) :]
        return rest[: rest.index("\n## ")]

    late = section("## mnli: late stage, decisions")
    assert "ranks 8,5,8" in late and "ranks 8,8,8" not in late
    assert "The same shapes and plans" in section("## dlrm: late stage, decisions")
    assert "mnli `default`, dlrm `lean`." in out
    assert "| kind |" not in section("## mnli: paper-size shapes")  # none: said, no empty table
    assert "None: no layer of these steps asks for `auto`." in section("## mnli: paper-size")
    assert "dlrm smoke steps ran under `cpu_malloc=lean` without huge pages" in out
    assert "fresh processes" not in out and "Per process" not in out  # one process each
    # several processes per experiment (smoke_rounds): said, and each ratio's range given
    runs = {"smoke_rounds": 3, "smoke_step_time_ratio_vs_dense_runs": [0.95, 0.909, 0.8],
            "smoke_step_time_ratio_floor_runs": [1.0, 1.2, 1.091]}  # fmt: skip
    path.write_text(json.dumps({**result, "mnli": {**step, **runs},
                                "dlrm": {**dlrm, **runs}}))  # fmt: skip
    assert plans.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    assert "in 3 fresh processes per experiment" in out
    assert "mnli auto / dense 0.800-0.950, floor 1.000-1.200, late stage -;" in out
    # DLRM's smoke model asks for no auto at all: the report says why, not an empty table
    none = {"decisions": [], "late_decisions": []}
    path.write_text(json.dumps({**result, "dlrm": {**dlrm, **none}}))
    assert plans.main(["--render", str(path)]) == 0
    out = capsys.readouterr().out
    early = out[out.index("## dlrm: smoke preset, decisions") :].split("\n## ")[0]
    assert "| kind |" not in early and "table-batched lookup, which has no `auto`" in early
    assert "None either." in out[out.index("## dlrm: late stage, decisions") :]


def test_bad_flags_are_one_line(capsys) -> None:
    assert plans.main(["--experiments", "mnli,nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--experiments" in err[0]


def test_paper_steps_give_the_issue_ratios(monkeypatch) -> None:
    """Each variant runs once per round, the order rotating; its figures are the median
    of its rounds (one slow outlier round moves nothing)."""
    fake = {"auto": (2.0, 110.0), "comera": (2.2, 100.0), "dense": (5.0, 300.0)}
    calls: list[str] = []

    def step(name, v, steps, tiny=False):
        calls.append(v)
        slow = 3.0 if len(calls) == 1 else 1.0  # the first process: a noisy outlier
        return {"batch": 32, "step_s": fake[v][0] * slow, "peak_mb": fake[v][1]}

    monkeypatch.setattr(plans, "_paper_step", step)
    monkeypatch.setitem(plans.PAPER_ROUNDS, "mnli", 3)
    r = plans.paper_steps("mnli", 3)
    assert calls == ["auto", "comera", "dense", "comera", "dense", "auto",
                     "dense", "auto", "comera"]  # fmt: skip
    assert r["paper_steps"]["auto"]["rounds"] == 3
    assert r["paper_step_time_ratio_vs_dense"] == pytest.approx(0.4)
    assert r["paper_step_time_ratio_vs_dense_comera_plan"] == pytest.approx(0.44)
    assert r["paper_peak_memory_ratio_auto_vs_comera"] == pytest.approx(1.1)
    result = {"meta": {"command": "c", "cpu": "a CPU", "torch": "2", "date": "d", "threads": 2},
              "mnli": {**json.loads(STEP), **r, "paper_shapes": []}}  # fmt: skip
    assert "| mnli | 32 | 3 | 2.000 | 2.200 | 5.000 | 0.400 | 0.440 | 110, 100, 300 | 1.100 |" in (
        plans.render(result)
    )


@pytest.mark.slow
def test_paper_step_workers_run_auto_in_a_fresh_process() -> None:
    """The step benchmarks' ``auto`` variant end to end (toy models, fresh processes)."""
    for name in ("mnli", "codebert"):
        r = plans._paper_step(name, "auto", 1, tiny=True)
        assert r["step_s"] > 0 and r["peak_mb"] > 0


def test_each_experiment_s_smoke_steps_run_in_a_worker_under_its_policy(
    monkeypatch, capsys, tmp_path
) -> None:
    """run() takes every experiment's figures from its own process; the worker entry starts
    as the experiment's command does (its policy's restart) and prints what it measured,
    the policy included. A lean experiment's policy cannot leak into the next one."""
    import experiments.malloc
    import experiments.workers

    assert plans.smoke_policy("dlrm") == "lean" and plans.smoke_policy("mnli") == "default"
    seen = []
    ratios = iter([1.3, 1.1, 1.2, 1.5, 1.0] * 2)

    def worker(cmd, what, *, env=None, timeout=None):
        seen.append((cmd[cmd.index("--smoke-worker") + 1], "--no-shapes" in cmd))
        # the child decides its own restart, and a hung one cannot hang the bench
        assert env is not None and "COMERA_MALLOC_RESTARTED" not in env and timeout
        r = next(ratios)
        shapes = {} if "--no-shapes" in cmd else {"paper_shapes": ["first"]}
        return {"smoke_step_time_ratio_vs_dense": r, "step_ms": {"auto": 10 * r, "dense": 10},
                "fixed_extra_ms": r, "malloc": "lean", "hugepages": r != 1.5, **shapes}  # fmt: skip

    monkeypatch.setattr(experiments.workers, "run_json_worker", worker)
    monkeypatch.setattr(plans, "render", lambda result: "")
    monkeypatch.setattr(plans, "smoke_steps", lambda name, **k: pytest.fail("ran in-process"))
    monkeypatch.setattr(plans, "shape_decisions", lambda name: pytest.fail("ran in-process"))
    out = tmp_path / "plans.json"
    plans.run(experiments=("mnli", "dlrm"), paper_steps_timed=0, out=out)
    # SMOKE_ROUNDS processes each, the first alone deciding the paper-size shapes; each
    # figure the median over them, every process's ratio kept
    assert plans.SMOKE_ROUNDS == 5
    assert seen == [(n, i > 0) for n in ("mnli", "dlrm") for i in range(5)]
    dlrm = json.loads(out.read_text())["dlrm"]
    assert dlrm["smoke_rounds"] == 5 and dlrm["paper_shapes"] == ["first"]
    assert dlrm["smoke_step_time_ratio_vs_dense"] == 1.2 and dlrm["fixed_extra_ms"] == 1.2
    assert dlrm["smoke_step_time_ratio_vs_dense_runs"] == [1.3, 1.1, 1.2, 1.5, 1.0]
    assert dlrm["step_ms"] == {"auto": 12.0, "dense": 10} and dlrm["hugepages"] is False
    # the worker entry, as its own process runs it (no argv): restarted for its policy
    restarts = []
    monkeypatch.setattr(experiments.malloc, "restart_for", restarts.append)
    monkeypatch.setattr(plans, "smoke_steps", lambda name, **k: {"name": name, **k})
    monkeypatch.setattr(plans, "shape_decisions", lambda name: [name])
    monkeypatch.setattr(sys, "argv", ["plans", "--smoke-worker", "dlrm", "--steps", "4"])
    capsys.readouterr()
    assert plans.main() == 0
    got = json.loads(capsys.readouterr().out)
    assert restarts == ["lean"] and got["name"] == "dlrm" and got["steps"] == 4
    assert got["paper_shapes"] == ["dlrm"] and got["malloc"] == "lean"
    assert got["hugepages"] == experiments.malloc.hugepages_active()
    monkeypatch.setattr(sys, "argv", ["plans", "--smoke-worker", "dlrm", "--no-shapes"])
    assert plans.main() == 0
    assert "paper_shapes" not in json.loads(capsys.readouterr().out)  # the later rounds
