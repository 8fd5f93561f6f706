"""``plan="auto"`` / ``impl="auto"``: the tuner picks the measured fastest candidate,
caches it in memory and on disk under a key that re-decides on new shapes, dtype or
device, keeps the memory rule, and every choice computes what ``comera`` computes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import comera as C
from comera import autotune as A


class StubTimer:
    """A timer that never runs anything: fixed times per candidate; counts its calls."""

    def __init__(self, times: dict[str, float]) -> None:
        self.times, self.calls, self.seen = times, 0, []

    def __call__(self, runs: dict) -> dict[str, float]:
        self.calls += 1
        self.seen.append(sorted(runs))
        return {c: self.times[c] for c in runs}


def _linear(ranks: int = 4, seed: int = 0, dtype: torch.dtype = torch.float32):
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=ranks)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(seed))
    p = {k: [t.to(dtype).requires_grad_() for t in v] if isinstance(v, list)
         else v.to(dtype).requires_grad_() for k, v in p.items()}  # fmt: skip
    return p, s


def _x(tokens: int = 512, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(tokens, 16, generator=torch.Generator().manual_seed(1), dtype=dtype)


@pytest.mark.parametrize("fastest", ["comera", "dense", "dp"])
def test_auto_takes_the_measured_fastest_and_only_a_candidate(fastest: str) -> None:
    times = {"comera": 3.0, "dense": 2.0, "dp": 4.0}
    times[fastest] = 1.0
    timer = StubTimer(times)
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear()
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
    (decision,) = tuner.decisions.values()
    assert decision.choice == fastest and timer.seen == [["comera", "dense", "dp"]]
    assert set(decision.times_ms) <= set(A.LINEAR_CANDIDATES)
    assert decision.times_ms[fastest] == pytest.approx(1e3)


def test_candidates_can_be_restricted() -> None:
    timer = StubTimer({"comera": 2.0, "dp": 1.0, "dense": 0.5})
    tuner = A.PlanTuner(timer=timer, linear_candidates=("comera", "dp"))
    p, s = _linear()
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
    assert next(iter(tuner.decisions.values())).choice == "dp"


def test_decisions_of_other_keys_are_told_apart_where_they_are_shown() -> None:
    """``what`` (describe(), config.json's ``plans``) names what makes a decision another:
    a bias, a restricted candidate set, a sync-free lookup; so no two decisions of one
    run share it."""
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0, "optimized": 1.0, "table": 2.0})
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear()
    no_bias = {k: v for k, v in p.items() if k != "bias"}
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(4, 4), ranks=6, num_embeddings=18)
    e, es = C.init(spec, generator=torch.Generator().manual_seed(0))
    e = {k: [t.requires_grad_() for t in v] for k, v in e.items()}
    ids = torch.randint(0, 18, (4, 16), generator=torch.Generator().manual_seed(2))
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
        C.tt_linear(no_bias, s, _x(), plan="auto")
        with tuner.restrict(("comera", "dense")):
            C.tt_linear(p, s, _x(), plan="auto")
        C.ttm_embedding(e, es, ids, impl="auto", spec=spec)
        with C.layers.SyncFreeLookups():
            C.ttm_embedding(e, es, ids, impl="auto", spec=spec)
    whats = [d.what for d in tuner.decisions.values()]
    assert len(whats) == 5 and len(set(whats)) == 5, whats
    assert sum(" bias" in w for w in whats) == 2
    assert sum(w.endswith(" of comera/dense") for w in whats) == 1
    assert sum(" sync-free" in w for w in whats) == 1


@pytest.mark.parametrize("forced", ["comera", "dense", "dp"])
def test_every_choice_gives_comeras_values_and_gradients(forced: str) -> None:
    others = {c: 5.0 for c in A.LINEAR_CANDIDATES}
    tuner = A.PlanTuner(timer=StubTimer({**others, forced: 1.0}))
    p, s = _linear(dtype=torch.float64)
    x = _x(dtype=torch.float64).requires_grad_()
    with A.use_tuner(tuner):
        y = C.tt_linear(p, s, x, plan="auto")
    assert next(iter(tuner.decisions.values())).choice == forced
    ref = C.tt_linear(p, s, x, plan="comera")
    torch.testing.assert_close(y, ref)
    leaves = [x, *p["cores"], *p["gates"], p["bias"]]
    g = torch.autograd.grad(y.square().sum(), leaves)
    g_ref = torch.autograd.grad(ref.square().sum(), leaves)
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_a_rebuilt_weight_must_be_small_against_the_activations() -> None:
    """``dense`` keeps ``W`` for backward: a training call may choose it only when
    ``M N <= 5% of T (M + N)`` for every token count ``T`` its key covers (its power-of-two
    bucket: from half the bucket up); with no gradient it is always a candidate."""
    timer = StubTimer({"comera": 2.0, "dense": 1.0, "dp": 3.0})
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear()
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(tokens=32), plan="auto")  # 256 > 0.05 * 17 * 32: not a candidate
        C.tt_linear(p, s, _x(tokens=256), plan="auto")  # bucket 256: 256 > 0.05 * 129 * 32
        C.tt_linear(p, s, _x(tokens=512), plan="auto")  # 256 <= 0.05 * 257 * 32 = 411.2
        with torch.no_grad():
            C.tt_linear(p, s, _x(tokens=32), plan="auto")
    small, edge, large, no_grad = tuner.decisions.values()
    assert small.choice == "comera" and "dense" in small.skipped
    assert edge.choice == "comera" and "T = 129" in edge.skipped["dense"]
    assert large.choice == "dense" and not large.skipped
    assert no_grad.choice == "dense"


def test_a_contraction_path_that_builds_a_weight_obeys_the_memory_rule_too() -> None:
    """opt_einsum's ``dp`` path can contract cores into tensors larger than ``W`` before
    ``x`` joins (ranks above the modes): what it builds beyond the ``comera`` plan's halves
    is bound by the rule ``dense``'s ``W`` is; with no gradient nothing is kept."""
    from comera.plans import tt_linear_plan

    shapes = [(1, 2, 32), (32, 2, 8), (8, 8, 64), (64, 16, 1)]  # 4 x 128, tokens 16
    own = tt_linear_plan("comera", shapes, 16).weight_elements()
    assert tt_linear_plan("dense", shapes, 16).weight_elements() - own == 4 * 128  # W
    assert tt_linear_plan("dp", shapes, 16).weight_elements() - own == 1536
    cores = [torch.randn(s, generator=torch.Generator().manual_seed(i)).requires_grad_()
             for i, s in enumerate(shapes)]  # fmt: skip
    p = {"cores": cores, "gates": [torch.ones(s[2]).requires_grad_() for s in shapes[:-1]]}
    s = {"masks": [torch.ones(s[2], dtype=torch.bool) for s in shapes[:-1]]}
    tuner = A.PlanTuner(timer=StubTimer({"comera": 3.0, "dense": 2.0, "dp": 1.0}))
    with A.use_tuner(tuner):
        C.tt_linear(p, s, torch.randn(16, 128), plan="auto")  # 0.05 * 9 * 132 = 59.4
        with torch.no_grad():
            C.tt_linear(p, s, torch.randn(16, 128), plan="auto")
    train, no_grad = tuner.decisions.values()
    assert train.choice == "comera" and "1536 more weight elements" in train.skipped["dp"]
    assert "W 4x128" in train.skipped["dense"]
    assert no_grad.choice == "dp" and not no_grad.skipped


def test_with_prebuilt_halves_every_core_only_tensor_of_a_path_is_extra() -> None:
    """Halves built beforehand (:class:`GroupedHalves`) exist whatever the plan, so a
    ``dp`` path's core-only tensors are all extra (here 128 > 0.05 * 5 * 32), while on
    its own ``dp`` builds less than the halves it saves and stays a candidate."""
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=8)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    p = {k: [t.requires_grad_() for t in v] if isinstance(v, list) else v.requires_grad_()
         for k, v in p.items()}  # fmt: skip
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1))
    tuner = A.PlanTuner(timer=StubTimer({"comera": 3.0, "dense": 2.0, "dp": 1.0}))
    with A.use_tuner(tuner):
        C.tt_linear(p, s, x, plan="auto", halves=C.plans.GroupedHalves([(p, s)]))
        C.tt_linear(p, s, x, plan="auto")
    grouped, alone = tuner.decisions.values()
    assert grouped.choice == "comera" and "128 more weight elements" in grouped.skipped["dp"]
    assert "W 16x16" in grouped.skipped["dense"]
    assert alone.choice == "dp"


def test_layers_of_one_size_and_rank_with_other_modes_are_told_apart() -> None:
    """Two 16x16 layers, modes 2,8 | 8,2 and 8,2 | 2,8: other calls, so other decisions
    and other names (a run's ``auto_plans`` is keyed by the name)."""
    tuner = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    x = _x()
    with A.use_tuner(tuner):
        for out, inp in (((2, 8), (8, 2)), ((8, 2), (2, 8))):
            spec = C.TTLinearSpec(out_modes=out, in_modes=inp, ranks=2)
            C.tt_linear(*C.init(spec, generator=torch.Generator().manual_seed(0)), x,
                        plan="auto")  # fmt: skip
    whats = [d.what for d in tuner.decisions.values()]
    assert len(whats) == 2 and len(set(whats)) == 2, whats


def test_a_trained_bias_alone_is_not_a_weight_gradient_call() -> None:
    """A layer whose cores are frozen and bias trained runs no core gradient: its decision
    is not the one a fully trained layer of those shapes reads."""
    tuner = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4, bias=True)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    p = {k: [t.requires_grad_() for t in v] if isinstance(v, list) else v.requires_grad_()
         for k, v in p.items()}  # fmt: skip
    frozen = {**p, "cores": [c.detach() for c in p["cores"]],
              "gates": [g.detach() for g in p["gates"]]}  # fmt: skip
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
        C.tt_linear(frozen, s, _x(), plan="auto")
    assert tuner.timings == 2
    assert sorted(" no dW" in d.what for d in tuner.decisions.values()) == [False, True]


def test_decisions_are_cached_on_disk_and_reused(tmp_path) -> None:
    p, s = _linear()
    first = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=first)):
        C.tt_linear(p, s, _x(), plan="auto")
        C.tt_linear(p, s, _x(), plan="auto")  # the same key: decided once
    assert first.calls == 1
    table = json.loads((tmp_path / A.CACHE_FILE).read_text())
    (key,) = table
    assert table[key]["choice"] == "comera" and "torch " + torch.__version__ in key
    again = StubTimer({"comera": 9.0, "dense": 1.0, "dp": 9.0})  # would choose dense
    tuner = A.PlanTuner(tmp_path, timer=again)
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
    assert again.calls == 0 and tuner.timings == 0  # the second run times nothing
    assert tuner.decisions[key].choice == "comera"


@pytest.mark.parametrize("text", ["{not json", "[]", "null", '{"k": {"choice": 1}}'])
def test_a_damaged_cache_is_re_decided(tmp_path, text: str) -> None:
    (tmp_path / A.CACHE_FILE).write_text(text)
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(*_linear(), _x(), plan="auto")
    assert timer.calls == 1
    table = json.loads((tmp_path / A.CACHE_FILE).read_text())
    # an entry of the wrong shape is kept as stored (another version may read it), never
    # trusted; a file that is no JSON object is replaced
    assert len(table) == (2 if text.startswith('{"k"') else 1)


@pytest.mark.parametrize(
    "damage",
    [{"what": ["x"]}, {"times_ms": None}, {"skipped": {"dp": 3}}, {"kind": 7},
     {"times_ms": {"comera": 10**400}}],  # the last: describe()'s OverflowError
)  # fmt: skip
def test_an_entry_with_fields_of_the_wrong_type_is_decided_again(tmp_path, damage) -> None:
    """An entry whose fields parse but hold the wrong types is never trusted: it would
    fail later, where a run records or describes its decisions."""
    p, s = _linear()
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(p, s, _x(), plan="auto")
    path = tmp_path / A.CACHE_FILE
    table = json.loads(path.read_text())
    (key,) = table
    path.write_text(json.dumps({key: {**table[key], **damage}}))
    tuner = A.PlanTuner(tmp_path, timer=timer)
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
    assert tuner.timings == 1 and tuner.describe()


SAVER = """
import sys
from comera import autotune as A
# back-to-back saves hold the lock but for microseconds between them, so the other process
# waits out all 200: on a loaded machine past the 10 s a save waits before giving up
A.LOCK_WAIT_S = 100.0
tuner = A.PlanTuner(sys.argv[1])
for i in range(200):
    key = f"{sys.argv[2]}{i}|from=comera,dense"
    tuner.decisions[key] = A.Decision("tt_linear", key, "comera")
    tuner._save()
assert not tuner._lock_stuck
"""


def test_processes_saving_one_cache_keep_each_others_entries(tmp_path) -> None:
    """Saves read, merge and rename under a lock: two processes saving at once lose no
    entry, and the file is readable by others sharing the cache."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    procs = [subprocess.Popen([sys.executable, "-c", SAVER, str(tmp_path), tag], env=env)
             for tag in ("a", "b")]  # fmt: skip
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    table = json.loads((tmp_path / A.CACHE_FILE).read_text())
    assert len(table) == 400
    assert (tmp_path / A.CACHE_FILE).stat().st_mode & 0o777 == 0o666 & ~A._umask()


def test_a_cache_without_locks_still_saves(tmp_path, monkeypatch) -> None:
    """A filesystem without locks (flock: ENOLCK), or a lock file another user owns, costs
    the lock, never the save."""
    import errno
    import fcntl

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    tuner = A.PlanTuner(tmp_path, timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    with A.use_tuner(tuner):
        C.tt_linear(*_linear(), _x(), plan="auto")
    assert len(json.loads((tmp_path / A.CACHE_FILE).read_text())) == 1


def test_one_bad_entry_costs_only_itself(tmp_path) -> None:
    """An entry this version cannot read (a newer version's field, or damage) is decided
    again; the cache's other decisions stand, and a save keeps every entry."""
    p, s = _linear()
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(p, s, _x(64), plan="auto")
    path = tmp_path / A.CACHE_FILE
    table = json.loads(path.read_text())
    (key,) = table
    other = key.replace("T64", "T128")  # a valid decision the next run does not revisit
    newer = key.replace("T64", "T2048")
    table[other] = dict(table[key])
    table[newer] = dict(table[key], note="a field of a newer version")
    path.write_text(json.dumps(table))
    tuner = A.PlanTuner(tmp_path, timer=timer)
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(64), plan="auto")  # read from the cache
        C.tt_linear(p, s, _x(16), plan="auto")  # a new key: timed and saved
    assert tuner.timings == 1 and set(tuner.decisions) >= {key, other}
    after = json.loads(path.read_text())
    assert {key, other, newer} < set(after) and after[newer]["note"]


def test_threads_sharing_a_tuner_read_the_cache_before_timing(tmp_path, monkeypatch) -> None:
    """A thread that asks while another is still reading the cache file waits for it: a
    decision on disk is never timed again (nor chosen anew)."""
    import threading
    import time

    p, s = _linear()
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)), torch.no_grad():
        C.tt_linear(p, s, _x(), plan="auto")
    read = A.PlanTuner._read_raw
    monkeypatch.setattr(A.PlanTuner, "_read_raw",
                        staticmethod(lambda path: (time.sleep(0.3), read(path))[1]))  # fmt: skip
    tuner = A.PlanTuner(tmp_path, timer=timer)

    def call() -> None:
        with A.use_tuner(tuner), torch.no_grad():
            C.tt_linear(p, s, _x(), plan="auto")

    threads = [threading.Thread(target=call) for _ in range(2)]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for t in threads:
        t.join()
    assert tuner.timings == 0


def test_a_cached_choice_outside_its_candidates_is_not_trusted(tmp_path) -> None:
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(*_linear(), _x(), plan="auto")
    table = json.loads((tmp_path / A.CACHE_FILE).read_text())
    (key,) = table
    table[key]["choice"] = "optimal"  # not among from=comera,dense,dp
    (tmp_path / A.CACHE_FILE).write_text(json.dumps(table))
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(*_linear(), _x(), plan="auto")
    assert timer.calls == 2


def test_an_unwritable_cache_warns_and_the_call_goes_on(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the cache directory should be
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(blocker / "plans", timer=timer)):
        with pytest.warns(UserWarning, match="cannot write the plan cache"):
            y = C.tt_linear(*_linear(), _x(), plan="auto")
    assert y.shape == (512, 16)


def test_an_unwritable_cache_warns_once_per_run(tmp_path) -> None:
    """Each decision warned again, naming a random temp file, so Python's filter never
    folded them: a two-step smoke run printed 12 warnings."""
    (tmp_path / A.CACHE_FILE).mkdir()  # the rename fails after the temp file is written
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        with pytest.warns(UserWarning) as seen:
            for ranks in (2, 3, 4):  # three decisions, three failed saves
                C.tt_linear(*_linear(ranks), _x(), plan="auto")
    said = [str(w.message) for w in seen]
    assert timer.calls == 3 and len(said) == 1, said
    assert "cannot write the plan cache" in said[0] and ".tmp" not in said[0]


def test_a_cache_this_user_cannot_read_is_not_replaced(tmp_path, monkeypatch) -> None:
    """Another user's cache, unreadable here, was taken as empty and replaced by this
    run's one entry (50 entries lost) without a word."""
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    (tmp_path / A.CACHE_FILE).write_text(json.dumps({f"k{i}": {} for i in range(50)}))
    real = Path.read_text

    def denied(self: Path, *a, **kw) -> str:
        if self.name == A.CACHE_FILE:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self, *a, **kw)

    monkeypatch.setattr(Path, "read_text", denied)
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        with pytest.warns(UserWarning, match="cannot read the plan cache .*not saving over it"):
            C.tt_linear(*_linear(), _x(), plan="auto")
    monkeypatch.undo()
    assert timer.calls == 1 and len(json.loads((tmp_path / A.CACHE_FILE).read_text())) == 50


def test_a_lock_held_elsewhere_delays_a_save_only_so_long(tmp_path, monkeypatch) -> None:
    """A process stopped while holding the cache's lock stopped every other run at its
    first decision, for good."""
    import fcntl
    import os

    monkeypatch.setattr(A, "LOCK_WAIT_S", 0.2)
    lock = tmp_path / (A.CACHE_FILE + ".lock")
    fd = os.open(lock, os.O_RDONLY | os.O_CREAT, 0o666)  # another open file: held
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
        with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
            with pytest.warns(UserWarning, match="stayed held by another process for 0.2 s"):
                y = C.tt_linear(*_linear(), _x(), plan="auto")
            waits = []  # waited once: the next decisions do not take the lock again
            monkeypatch.setattr(A, "_file_lock", lambda *a, **k: waits.append(a))
            for ranks in (2, 3):
                C.tt_linear(*_linear(ranks), _x(), plan="auto")
            assert waits == [] and timer.calls == 3
        assert y.shape == (512, 16) and not (tmp_path / A.CACHE_FILE).exists()
    finally:
        os.close(fd)


def test_an_entry_choosing_what_it_says_was_not_timed_is_not_trusted(tmp_path) -> None:
    """An entry whose choice its own ``skipped`` rules out (edited, or damaged) was used
    with no timing and no word."""
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    with A.use_tuner(A.PlanTuner(tmp_path, timer=timer)):
        C.tt_linear(*_linear(), _x(), plan="auto")
    table = json.loads((tmp_path / A.CACHE_FILE).read_text())
    (key,) = table
    table[key]["skipped"] = {"dense": "W 16x16 > 0.05 of T x (N + M)"}
    table[key]["choice"] = "dense"
    (tmp_path / A.CACHE_FILE).write_text(json.dumps(table))
    tuner = A.PlanTuner(tmp_path, timer=timer)
    with A.use_tuner(tuner):
        C.tt_linear(*_linear(), _x(), plan="auto")
    assert timer.calls == 2 and tuner.decisions[key].choice == "comera"


def test_describe_keeps_the_shapes_in_one_cell() -> None:
    tuner = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    with A.use_tuner(tuner):
        C.tt_linear(*_linear(), _x(), plan="auto")
    header, _, row = tuner.describe().splitlines()
    assert "[4,4 \\| 4,4]" in row
    assert row.replace("\\|", "").count("|") == header.count("|")


def test_timing_inside_a_checkpointed_block_leaves_recomputation_alone() -> None:
    """A timing run saves its own tensors; inside ``checkpoint`` (activation
    recomputation) they must not be counted as the block's."""
    from torch.utils.checkpoint import checkpoint

    tuner = A.PlanTuner(timer=A.median_timer(repeats=1, warmup=0))
    p, s = _linear(dtype=torch.float64)
    x = _x(dtype=torch.float64).requires_grad_()
    with A.use_tuner(tuner):
        y = checkpoint(lambda t: C.tt_linear(p, s, t, plan="auto"), x, use_reentrant=False)
        g = torch.autograd.grad(y.square().sum(), [x, *p["cores"]])
    ref = C.tt_linear(p, s, x, plan="comera")
    g_ref = torch.autograd.grad(ref.square().sum(), [x, *p["cores"]])
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_new_shapes_dtype_or_device_re_decide(tmp_path, monkeypatch) -> None:
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    tuner = A.PlanTuner(tmp_path, timer=timer)
    with A.use_tuner(tuner):
        C.tt_linear(*_linear(ranks=4), _x(), plan="auto")
        C.tt_linear(*_linear(ranks=3), _x(), plan="auto")  # compaction's smaller ranks
        C.tt_linear(*_linear(dtype=torch.float64), _x(dtype=torch.float64), plan="auto")
        C.tt_linear(*_linear(), _x(tokens=1024), plan="auto")  # another token bucket
        C.tt_linear(*_linear(), _x(tokens=300), plan="auto")  # the same bucket as 512
        assert timer.calls == 4
        monkeypatch.setattr(A, "_device_name", lambda device: "another machine")
        fresh = A.PlanTuner(tmp_path, timer=timer)
        with A.use_tuner(fresh):
            C.tt_linear(*_linear(), _x(), plan="auto")
    assert timer.calls == 5 and len(json.loads((tmp_path / A.CACHE_FILE).read_text())) == 5


def test_an_input_that_needs_a_gradient_is_another_decision() -> None:
    """A layer whose input needs a gradient pays the ``dx`` GEMM that one fed by a
    frozen input does not: the same shapes are timed again (the timing runs compute
    ``dx`` only where the call needs it) and cached apart."""
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear()
    with A.use_tuner(tuner):
        C.tt_linear(p, s, _x(), plan="auto")
        C.tt_linear(p, s, _x().requires_grad_(), plan="auto")
        C.tt_linear(p, s, _x().requires_grad_(), plan="auto")  # cached
        with torch.no_grad():
            C.tt_linear(p, s, _x().requires_grad_(), plan="auto")  # no gradient at all
    assert timer.calls == 3
    whats = sorted(d.what for d in tuner.decisions.values())
    assert [" no dx" in w for w in whats].count(True) == 1


def _flops_timer(seen: dict[str, int]):
    """A timer that runs each candidate once and records its matmul FLOPs (what a timing
    run computes, deterministically); every candidate takes 1 ms."""
    from torch.utils.flop_counter import FlopCounterMode

    def timer(runs: dict) -> dict[str, float]:
        for c, run in runs.items():
            with FlopCounterMode(display=False) as fc:
                run()
            seen[c] = fc.get_total_flops()
        return dict.fromkeys(runs, 1e-3)

    return timer


def _call_flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as fc:
        fn()
    return fc.get_total_flops()


@pytest.mark.parametrize("plan", ["comera", "dense"])
def test_a_frozen_layer_is_timed_without_weight_gradients(plan: str) -> None:
    """A frozen TT layer fed by an input that needs a gradient computes dx only: its
    timing runs do the same, and the decision is apart from a trained layer's."""
    seen: dict[str, int] = {}
    tuner = A.PlanTuner(timer=_flops_timer(seen), linear_candidates=(plan,))
    p, s = _linear()
    frozen = {k: [t.detach() for t in v] if isinstance(v, list) else v.detach()
              for k, v in p.items()}  # fmt: skip
    x = _x().requires_grad_()
    with A.use_tuner(tuner):
        C.tt_linear(frozen, s, x, plan="auto")
        C.tt_linear(p, s, x, plan="auto")
    assert tuner.timings == 2
    assert [" no dW" in d.what for d in tuner.decisions.values()] == [True, False]
    real = _call_flops(lambda: C.tt_linear(frozen, s, x, plan=plan).sum().backward())
    tuner2 = A.PlanTuner(timer=_flops_timer(seen), linear_candidates=(plan,))
    with A.use_tuner(tuner2):
        C.tt_linear(frozen, s, x, plan="auto")
    assert seen[plan] == real


@pytest.mark.parametrize("plan", ["comera", "dense"])
def test_grouped_halves_are_timed_as_the_call_reads_them(plan: str) -> None:
    """With halves built beforehand (GroupedHalves) comera and dense read them: the
    timing run does the call's work, not a rebuild of the halves."""
    seen: dict[str, int] = {}
    p, s = _linear()
    x = _x().requires_grad_()
    with A.use_tuner(A.PlanTuner(timer=_flops_timer(seen), linear_candidates=(plan,))) as t:
        grouped = C.plans.GroupedHalves([(p, s)])
        C.tt_linear(p, s, x, plan="auto", halves=grouped)
    assert "halves" in next(iter(t.decisions.values())).what
    grouped = C.plans.GroupedHalves([(p, s)])
    halves = list(grouped.get(p))  # the call's own work ends at the halves' gradients
    real = _call_flops(
        lambda: C.tt_linear(p, s, x, plan=plan, halves=grouped).sum().backward(inputs=[x, *halves])
    )
    assert seen[plan] > 0 and seen[plan] == real


def test_compaction_re_decides_for_the_new_ranks() -> None:
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear(ranks=6)
    with torch.no_grad():
        p["gates"][0][:3] = 0.0
    s = C.prune(p, s, tau=1e-3)
    q, t = C.compact(p, s)
    with A.use_tuner(tuner):
        y = C.tt_linear(p, s, _x(), plan="auto")
        z = C.tt_linear(q, t, _x(), plan="auto")
    assert timer.calls == 2
    seen = [d.what.split(" ranks ")[1].split(" ")[0] for d in tuner.decisions.values()]
    assert seen == [",".join(str(c.shape[2]) for c in m["cores"][:-1]) for m in (p, q)]
    assert seen[0] != seen[1]
    torch.testing.assert_close(y, z)


def test_a_hopeless_candidate_is_not_timed() -> None:
    """The cost model skips a candidate over ``FLOP_PRUNE`` times the cheapest FLOPs."""
    spec = C.TTLinearSpec(out_modes=(16, 16, 16), in_modes=(16, 16, 16), ranks=2)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    timer = StubTimer({"comera": 1.0, "dense": 0.5, "dp": 2.0})
    tuner = A.PlanTuner(timer=timer)
    with A.use_tuner(tuner), torch.no_grad():  # no gradient: only FLOPs rule out dense
        C.tt_linear(p, s, torch.randn(8, 4096), plan="auto")
    (d,) = tuner.decisions.values()
    assert "cheapest forward FLOPs" in d.skipped["dense"] and d.choice == "comera"


def test_where_nothing_can_be_timed_the_cache_or_the_papers_path() -> None:
    """Inside ``vmap`` a call cannot time: it reads the cache, else runs ``comera``."""
    timer = StubTimer({"comera": 2.0, "dense": 1.0, "dp": 3.0})
    tuner = A.PlanTuner(timer=timer)
    p, s = _linear()
    xs = torch.randn(3, 8, 16)
    with A.use_tuner(tuner):
        out = torch.vmap(lambda x: C.tt_linear(p, s, x, plan="auto"))(xs)
    assert timer.calls == 0 and not tuner.decisions
    torch.testing.assert_close(out, C.tt_linear(p, s, xs, plan="comera"))


def test_install_adopts_another_ranks_decisions() -> None:
    p, s = _linear()
    mine = A.PlanTuner(timer=StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0}))
    rank0 = A.PlanTuner(timer=StubTimer({"comera": 3.0, "dense": 2.0, "dp": 1.0}))
    for tuner in (mine, rank0):
        with A.use_tuner(tuner):
            C.tt_linear(p, s, _x(), plan="auto")
    mine.install(rank0.export())
    assert [d.choice for d in mine.decisions.values()] == ["dp"]
    with A.use_tuner(mine):  # calls already seen follow the installed choice
        key, choice = mine._fast_lookup(next(iter(mine._last)))
    assert choice == "dp"


def test_ttm_lookup_auto_table_or_optimized() -> None:
    spec = C.TTMEmbeddingSpec(vocab_modes=(4, 5), dim_modes=(4, 4), ranks=6, num_embeddings=18)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
    p = {k: [t.double().requires_grad_() for t in v] for k, v in p.items()}
    ids = torch.randint(0, 18, (4, 16), generator=torch.Generator().manual_seed(2))
    timer = StubTimer({"optimized": 2.0, "table": 1.0})
    tuner = A.PlanTuner(timer=timer)
    with A.use_tuner(tuner):
        y = C.ttm_embedding(p, s, ids, impl="auto", spec=spec)  # 20 rows <= 64 ids
        C.ttm_embedding(p, s, ids[:1, :8], impl="auto", spec=spec)  # 20 rows > 8 ids
    big, small = tuner.decisions.values()
    assert big.choice == "table" and small.choice == "optimized" and "table" in small.skipped
    ref = C.ttm_embedding(p, s, ids, impl="optimized", spec=spec)
    torch.testing.assert_close(y, ref)
    g = torch.autograd.grad(y.square().sum(), p["cores"])
    g_ref = torch.autograd.grad(ref.square().sum(), p["cores"])
    for a, b in zip(g, g_ref, strict=True):
        torch.testing.assert_close(a, b)


def test_the_real_timer_returns_a_median_per_candidate() -> None:
    calls = {"a": 0, "b": 0}

    def run(name):
        def f():
            calls[name] += 1

        return f

    times = A.median_timer(repeats=3, warmup=1)({"a": run("a"), "b": run("b")})
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert calls == {"a": 4, "b": 4}


def test_auto_is_a_strategy_but_has_no_fixed_plan() -> None:
    assert "auto" in C.STRATEGIES and "auto" in C.EMBEDDING_IMPLS
    assert C.LayerPlans(default="auto", embedding_impl="auto").for_layer("x") == "auto"
    with pytest.raises(C.errors.ConfigError, match="decided per call"):
        C.plans.tt_linear_plan("auto", [(1, 4, 2), (2, 4, 1)], 8)


def test_a_cache_dir_under_home_is_expanded(tmp_path, monkeypatch) -> None:
    """``~`` in a cache dir (a config file or a quoted argument keeps it literal) means the
    home folder, as the docs' examples write it; it made a folder named ``~`` in the cwd."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    assert A.PlanTuner("~/plans").cache_dir == tmp_path / "home" / "plans"


def test_no_cache_problem_stops_a_run(tmp_path, monkeypatch) -> None:
    """A cache must never break a run: a file of deeply nested JSON was a RecursionError,
    a folder this user may not open a PermissionError at the first call, a save that
    could not rename left its temporary file behind, and decisions installed from a
    damaged plans.json failed at the next call or in describe()."""
    timer = StubTimer({"comera": 1.0, "dense": 2.0, "dp": 3.0})
    (tmp_path / "deep").mkdir()
    (tmp_path / "deep" / A.CACHE_FILE).write_text("[" * 100_000 + "]" * 100_000)
    with A.use_tuner(A.PlanTuner(tmp_path / "deep", timer=timer)):
        C.tt_linear(*_linear(), _x(), plan="auto")
    assert timer.calls == 1
    (tmp_path / "dir" / A.CACHE_FILE).mkdir(parents=True)  # the file's name, a folder
    with A.use_tuner(A.PlanTuner(tmp_path / "dir", timer=timer)):
        with pytest.warns(UserWarning, match="cannot write the plan cache"):
            C.tt_linear(*_linear(), _x(), plan="auto")
    assert not list((tmp_path / "dir").glob("*.tmp"))
    real_is_file = Path.is_file

    def no_entry(self: Path) -> bool:
        if self.name == A.CACHE_FILE:
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", no_entry)
    with A.use_tuner(A.PlanTuner(tmp_path / "locked", timer=timer)):
        with pytest.warns(UserWarning) as seen:  # it cannot be read, nor then written
            y = C.tt_linear(*_linear(), _x(), plan="auto")
    said = [str(w.message) for w in seen]
    assert any("cannot read the plan cache" in m for m in said), said
    assert all("plan cache" in m for m in said), said
    assert y.shape == (512, 16)
    monkeypatch.undo()
    tuner = A.PlanTuner(None, timer=timer)
    with A.use_tuner(tuner):
        C.tt_linear(*_linear(), _x(), plan="auto")
        (key,) = tuner.export()
        tuner.install({key: {**tuner.export()[key], "choice": "bogus"}, "junk": [1]})
        assert tuner.decisions[key].choice != "bogus" and "junk" not in tuner.decisions
        assert C.tt_linear(*_linear(), _x(), plan="auto").shape == (512, 16)


@pytest.mark.parametrize(
    ("kw", "text"),
    [({"embedding_candidates": ("bogus",)}, r"embedding_candidates=\('bogus',\)"),
     ({"linear_candidates": ()}, r"linear_candidates=\(\)"),
     ({"linear_candidates": ("comera", "fast")}, r"linear_candidates=\('comera', 'fast'\)")],
)  # fmt: skip
def test_candidates_that_are_no_plan_are_refused_when_built(kw, text) -> None:
    """A bad embedding name was recorded as chosen and ran as "optimized"; no linear
    candidate at all was min()'s bare ValueError at the first call; a bad linear name
    failed there, naming tt_linear rather than the argument."""
    from comera.errors import ConfigError

    with pytest.raises(ConfigError, match=rf"PlanTuner\({text}\): give one or more of"):
        A.PlanTuner(**kw)
