"""The CPU allocator policies an entry point applies (``experiments.malloc``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from comera.train import TrainConfig
from experiments import cli, malloc

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_malloc_policies_and_errors() -> None:
    assert malloc.CPU_MALLOC_POLICIES == ("default", "keep", "release", "lean")
    assert malloc.set_cpu_malloc("default")  # changes nothing
    with pytest.raises(ValueError, match="cpu_malloc='fast'.*default"):
        malloc.set_cpu_malloc("fast")
    with pytest.raises(ValueError, match="TrainConfig.cpu_malloc='fast'"):
        TrainConfig(steps=1, run_dir="x", cpu_malloc="fast")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_release_policy_returns_freed_memory_in_a_fresh_process() -> None:
    """An 8 MB block freed below a live one: glibc as found keeps it (its mmap threshold
    rose past 8 MB when an earlier block was freed), ``release`` unmaps it. Each policy
    runs in a child process because a policy cannot be undone."""
    code = """
import sys, torch
from experiments.malloc import set_cpu_malloc
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
assert set_cpu_malloc(sys.argv[1])
x = torch.ones(2 * 2**20); del x
before = rss()
a = torch.ones(2 * 2**20); b = torch.ones(2 * 2**20); del a
print(rss() - before)
"""
    out = {}
    for policy in ("default", "release"):
        proc = subprocess.run([sys.executable, "-c", code, policy], capture_output=True,
                              text=True, check=True, cwd=ROOT)  # fmt: skip
        out[policy] = float(proc.stdout.split()[-1])
    assert out["default"] > 12 and out["release"] < 12, out  # 16 MB kept vs 8 MB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_lean_policy_restarts_a_command_once_with_huge_pages() -> None:
    """``restart_for("lean")`` re-executes the command (same interpreter and arguments)
    with glibc's huge-page tunable where glibc and the kernel offer it, exactly once; the
    restarted process sees the tunable and does not restart again. Other policies and an
    already-restarted process return without restarting."""
    code = """
import os, sys
from experiments import malloc
print("start", sys.argv[1], flush=True)
malloc.restart_for("lean")
print("hugepages", malloc.hugepages_active(), malloc.needs_restart("lean"))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "GLIBC_TUNABLES"}
    env.pop("COMERA_MALLOC_RESTARTED", None)
    proc = subprocess.run([sys.executable, "-c", code, "arg"], capture_output=True, text=True,
                          check=True, cwd=ROOT, env=env)  # fmt: skip
    lines = proc.stdout.split("\n")
    mode = malloc._thp_mode()
    possible = mode == "madvise" and malloc._glibc_tunable_exists()
    assert lines.count("start arg") == (2 if possible else 1)  # arguments carried over
    assert f"hugepages {possible or mode == 'always'} False" in lines
    # a script read from stdin cannot be run again: no restart, the run goes on
    proc = subprocess.run([sys.executable, "-", "arg"], input=code, capture_output=True,
                          text=True, check=True, cwd=ROOT, env=env)  # fmt: skip
    assert proc.stdout.split("\n").count("start arg") == 1
    assert not malloc.needs_restart("lean")  # the test process: COMERA_MALLOC_RESTARTED
    for policy in ("default", "keep", "release"):
        assert not malloc.needs_restart(policy)
    with pytest.raises(ValueError, match="cpu_malloc='fast'"):
        malloc.needs_restart("fast")


def test_lean_without_huge_pages_warns_and_runs_as_release(tmp_path, monkeypatch) -> None:
    from experiments.dlrm.experiment import CPU_MALLOC
    from experiments.dlrm.experiment import main as dlrm_main

    assert CPU_MALLOC == "lean"  # what DLRM trains (and benchmarks) under on CPU
    applied = []
    monkeypatch.setattr(cli, "apply_cpu_malloc", malloc.apply_cpu_malloc)  # the real one
    monkeypatch.setattr(malloc, "set_cpu_malloc", lambda p: applied.append(p) or True)
    monkeypatch.setattr(malloc, "hugepages_active", lambda: False)
    run = tmp_path / "d"
    argv = ["--preset", "smoke", "--wandb", "disabled", "--no-progress", "--run-dir", str(run)]
    argv += ["--set", "train.steps=2", "--set", "train.eval_every=None"]
    argv += ["--set", "data.generated_rows=3000", "--set", "model.tt_min_rows=500"]
    with pytest.warns(UserWarning, match="'lean' runs without huge pages.*GLIBC_TUNABLES"):
        assert dlrm_main(argv) == 0  # in-process (argv given): never re-executed
    assert applied == ["lean"]


def test_reports_flag_lean_rows_measured_without_huge_pages() -> None:
    from experiments.malloc import lean_without_hugepages

    rows = [
        {"variant": "comera", "malloc": "lean", "hugepages": True},
        {"variant": "dense", "malloc": "default", "hugepages": False},
    ]
    assert lean_without_hugepages(rows) == ""  # as found, or lean on huge pages: fine
    rows.append({"variant": "dense_sgd", "malloc": "lean", "hugepages": False})
    text = lean_without_hugepages(rows)
    assert text.startswith("Warning: dense_sgd ran under `cpu_malloc=lean` without huge")


def test_a_command_restarts_for_its_policy_on_cpu_only(tmp_path, monkeypatch) -> None:
    """``main()`` run as a command (no argv) calls ``restart_for`` with the resolved
    policy before building anything, on CPU; with argv given, or on CUDA, it never does."""
    from experiments.dlrm import experiment as dlrm

    calls = []
    monkeypatch.setattr(cli, "restart_for", lambda p: calls.append(p))
    monkeypatch.setattr(cli, "prepare", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    base = ["prog", "--preset", "smoke", "--run-dir", str(tmp_path / "r")]
    monkeypatch.setattr(sys, "argv", base)
    with pytest.raises(SystemExit):
        dlrm.main()
    assert calls == ["lean"]
    monkeypatch.setattr(sys, "argv", [*base, "--device", "cuda"])
    monkeypatch.setattr(cli, "check_device", lambda *a: None)  # as if this machine had one
    with pytest.raises(SystemExit):
        dlrm.main()
    with pytest.raises(SystemExit):
        dlrm.main(base[1:])  # argv given: an in-process call
    assert calls == ["lean"]
