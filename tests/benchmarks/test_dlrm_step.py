"""``python -m benchmarks.dlrm_step``: the headline pair's rounds, a failing point, and the
devices it refuses."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPORTS = Path(__file__).resolve().parents[2] / "reports"


def test_bench_alternates_the_headline_pair_and_keeps_medians(monkeypatch, capsys) -> None:
    """``python -m benchmarks.dlrm_step``: comera and dense_sgd run ROUNDS times each,
    alternating, and the ratios use the medians of their runs (stand-in workers)."""
    from benchmarks import dlrm_step as bench

    calls: list[tuple[str, str]] = []
    steps = {"comera": iter([0.30, 0.50, 0.31]), "dense_sgd": iter([0.20, 0.40, 0.21])}
    lookups = iter([0.9, 0.5, 0.7, 0.95, 0.6, 1.1])  # LOOKUP_ROUNDS, then glibc's one
    policies: list[str] = []

    def child(args: list[str], what: str) -> dict:
        if "--embedding" in args:  # what embedding_times returns
            policies.append(args[-1])
            r = next(lookups)
            return {"embedding_batched_s": r, "embedding_separate_s": 1.0,
                    "embedding_time_ratio_batched_vs_separate": r, "device": "cpu"}  # fmt: skip
        v, malloc = args[1], args[3]
        calls.append((v, malloc))
        step = next(steps[v]) if len(calls) <= 2 * bench.ROUNDS else 1.0  # then the rest
        return {"params": 10, "compression": 1.0, "step_time_s": step,
                "peak_rss_mb": 100.0 if v == "comera" else 1000.0 + len(calls)}  # fmt: skip

    monkeypatch.setattr(bench, "_in_child", child)
    assert bench.run(json_out=True) == 0
    out = json.loads(capsys.readouterr().out)
    policy = bench.training_policy()
    head = [(v, policy) for v in ("comera", "dense_sgd")] * bench.ROUNDS
    assert calls[: 2 * bench.ROUNDS] == head and calls[2 * bench.ROUNDS] == ("dense_adam", policy)
    assert out["rounds"] == bench.ROUNDS == 3
    assert out["variants"]["comera"]["step_time_s_runs"] == [0.30, 0.50, 0.31]
    assert out["step_time_ratio_vs_dense"] == pytest.approx(0.31 / 0.21)
    assert out["peak_memory_ratio_vs_dense"] == pytest.approx(100.0 / 1004.0)  # median of 1002/4/6
    # the lookup comparison: the median of LOOKUP_ROUNDS processes under the policy
    assert bench.LOOKUP_ROUNDS == 5 and policies[:5] == [policy] * 5
    assert out["embedding_time_ratio_batched_vs_separate"] == 0.7
    assert out["embedding_time_ratio_batched_vs_separate_runs"] == [0.9, 0.5, 0.7, 0.95, 0.6]
    if policy != "default":
        assert policies[5:] == ["default"]
        assert out["embedding_time_ratio_batched_vs_separate_glibc_default"] == 1.1
    # every key of the committed figures (measured by the old command) is still printed
    assert set(json.loads((REPORTS / "dlrm_bench.json").read_text())) <= set(out)
    assert {"cpu", "torch", "date"} <= set(out)  # what a header of these figures names


def test_lookup_bench_times_the_gradients_comera_trains_with(monkeypatch) -> None:
    """The lookup comparison runs the embedding stage as CoMERA's training does (AdamW:
    dense gradients for the dense tables, no ``sparse=True``), batched and separate."""
    import experiments.dlrm.model as dlrm_model
    from benchmarks import dlrm_step as bench

    seen: list[tuple[bool, bool]] = []
    real = dlrm_model.embed

    def embed(cfg, *args, **kwargs):
        seen.append((cfg.batched_lookup, kwargs["sparse"]))
        return real(cfg, *args, **kwargs)

    monkeypatch.setattr(dlrm_model, "embed", embed)
    monkeypatch.setattr(bench, "BATCH", 64)
    out = bench.embedding_times(repeats=1)
    assert sorted(set(seen)) == [(False, False), (True, False)] and len(seen) == 4
    assert out["embedding_time_ratio_batched_vs_separate"] > 0


def test_bench_child_failure_names_the_point_and_its_error():
    """A failed fresh-process point ends the bench with one message: which point, and the
    child's own error (here argparse's, for a variant that does not exist)."""
    from benchmarks import dlrm_step as bench

    with pytest.raises(SystemExit) as e:
        bench._in_child(["--variant", "no_such_variant"], "variant no_such_variant")
    msg = str(e.value.code)
    assert msg.startswith("dlrm bench: variant no_such_variant failed (exit 2):")
    assert "invalid choice: 'no_such_variant'" in msg


def test_lookup_bench_refuses_a_device_it_cannot_use():
    """``python -m benchmarks.dlrm_step --embedding --device D`` checks D as the training
    CLI does (``experiments.cli.check_device``): a name torch cannot parse is one error
    line and exit 2, not a traceback."""
    cmd = [sys.executable, "-m", "benchmarks.dlrm_step", "--embedding", "--device", "gpu"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "error: --device 'gpu' is not a torch device" in proc.stderr


def test_out_writes_the_result_whole_and_keeps_the_old_one_on_failure(
    tmp_path, monkeypatch, capsys
) -> None:
    """The documented ``--json > reports/dlrm_bench.json`` emptied the committed figures
    before measuring, and left the file empty when a point failed or the run was stopped.
    ``--out FILE`` writes the result whole once it is complete; its header names it."""
    from benchmarks import dlrm_step as bench
    from experiments.cli import CLIError

    def child(args: list[str], what: str) -> dict:
        if "--embedding" in args:
            return {"embedding_batched_s": 0.5, "embedding_separate_s": 1.0,
                    "embedding_time_ratio_batched_vs_separate": 0.5, "device": "cpu"}  # fmt: skip
        return {"params": 10, "compression": 1.0, "step_time_s": 0.2, "peak_rss_mb": 100.0}

    out = tmp_path / "dlrm_bench.json"
    out.write_text('{"old": 1}\n')
    monkeypatch.setattr(bench, "_in_child", lambda args, what: (_ for _ in ()).throw(
        CLIError(f"{what} failed")))  # fmt: skip
    with pytest.raises(CLIError):
        bench.run(out=out)
    assert out.read_text() == '{"old": 1}\n'
    monkeypatch.setattr(bench, "_in_child", child)
    assert bench.run(out=out) == 0
    saved = json.loads(out.read_text())
    assert saved["command"] == f"python -m benchmarks.dlrm_step --out {out}"
    assert f"python -m benchmarks.dlrm_step --out {out}" in bench.render(saved)
    capsys.readouterr()
    assert bench.main(["--variant", "comera", "--out", str(out)]) == 2
    assert "--out is the whole bench's result" in capsys.readouterr().err
