"""``scripts/gpu_check.sh``, the bounded GPU run, checked where there is no GPU: its
stages name modules that exist, each group fits one remote call, stage and group
selection work, and without CUDA it refuses."""

import importlib.util
import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
STAGES = ["tests", "dlrm_lookup", "core_bench", "step_modes_paper", "step_modes_smoke",
          "mnli_bench"]  # fmt: skip
bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False
    )


def _plan(*args: str) -> list[tuple[str, int, str, list[str]]]:
    out = _run("--dry-run", *args)
    assert out.returncode == 0, out.stderr
    plan = []
    for line in out.stdout.strip().splitlines():
        head, cmd = line.split(": ", 1)
        name, limit, _, group = head.split()
        plan.append((name, int(limit.rstrip("s")), group, cmd.split()))
    return plan


@bash
def test_every_stage_names_a_real_target_and_each_group_fits_one_call():
    plan = _plan()
    assert [name for name, *_ in plan] == STAGES
    per_group = defaultdict(int)
    for name, limit, group, cmd in plan:
        per_group[group] += limit
        assert cmd[0] == sys.executable
        target = cmd[cmd.index("-m") + 1]
        if target == "pytest":
            assert (SCRIPT.parent.parent / cmd[-1]).is_file()
        else:
            assert importlib.util.find_spec(target) is not None, target
            assert cmd[cmd.index("--device") + 1] == "cuda", name
            # the benchmarks' own commands, not the old names that forward to them
            assert target.startswith("benchmarks.") and "--bench" not in cmd, name
    # a remote call allows 600 s: leave room for start-up, kill grace and packing
    assert set(per_group) == {"1", "2"} and max(per_group.values()) <= 520


@bash
def test_stage_and_group_selection_and_errors():
    assert [p[0] for p in _plan("core_bench", "tests")] == ["core_bench", "tests"]
    assert [p[0] for p in _plan("--group", "2")] == ["step_modes_smoke", "mnli_bench"]
    out = _run("--dry-run", "nope")
    assert out.returncode == 2 and "unknown stage 'nope'" in out.stderr
    out = _run("--dry-run", "--group", "3")
    assert out.returncode == 2 and "--group takes 1 or 2" in out.stderr
    # options in any order: a dry run never turns into a real one
    assert [p[0] for p in _plan("--group", "2")] == [p[0] for p in _plan_after("--group", "2")]
    for args in (("--group", "1", "tests"), ("tests", "--group", "1"), ("--bogus",)):
        out = _run("--dry-run", *args)
        assert out.returncode == 2 and out.stdout == "", args


def _plan_after(*args: str) -> list[tuple[str, ...]]:
    """``--dry-run`` given last."""
    out = _run(*args, "--dry-run")
    assert out.returncode == 0, out.stderr
    return [tuple(line.split()[:1]) for line in out.stdout.strip().splitlines()]


@bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda():
    out = _run("core_bench")
    assert out.returncode == 2 and "sees no CUDA device" in out.stderr


@bash
def test_a_run_records_every_stage_packs_after_each_and_fails_if_one_failed(tmp_path):
    """The real (non-dry) path with a stand-in python that 'has CUDA': one stage fails,
    the next still runs, the summary and $OUT hold both, and the exit status is 1."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu_check.sh")
    fake = tmp_path / "fakepy"
    fake.write_text(
        "#!/bin/bash\n"
        'if [[ "$1" == "-c" ]]; then echo torch-fake; exit 0; fi\n'
        'if [[ "$2" == "benchmarks.core" ]]; then echo broken >&2; exit 3; fi\n'
        'echo "ran $2"; tar -tzf "$OUT/gpu_reports.tar.gz"\n'  # what is packed so far
    )
    fake.chmod(0o755)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake), "OUT": str(out_dir)}
    proc = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gpu_check.sh"), "core_bench", "dlrm_lookup"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    summary = (tmp_path / "reports" / "gpu" / "logs" / "summary.txt").read_text()
    assert "core_bench rc=3" in summary and "dlrm_lookup rc=0" in summary
    assert "broken" in proc.stdout  # a failing stage's stderr tail is shown
    listing = subprocess.run(
        ["tar", "-tzf", str(out_dir / "gpu_reports.tar.gz")], capture_output=True, text=True
    ).stdout
    assert "reports/gpu/logs/dlrm_lookup.out" in listing
    # packed after every stage: while the second ran, the first's log was already packed
    second = (tmp_path / "reports" / "gpu" / "logs" / "dlrm_lookup.out").read_text()
    assert "reports/gpu/logs/core_bench.out" in second
    proc = subprocess.run(
        ["bash", str(tmp_path / "scripts" / "gpu_check.sh"), "dlrm_lookup"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "packed reports/gpu" in proc.stdout  # all passed


@bash
def test_wheels_are_installed_expanded_and_only_for_the_mnli_bench(tmp_path):
    """``.whl/*.whl`` reaches pip as the files themselves (the script runs with globbing
    off), and only when the MNLI bench (GaLore) is among the stages."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPT, tmp_path / "scripts" / "gpu_check.sh")
    (tmp_path / ".whl").mkdir()
    (tmp_path / ".whl" / "pkg-1.0-py3-none-any.whl").write_text("")
    log = tmp_path / "calls.txt"
    fake = tmp_path / "fakepy"
    fake.write_text(f'#!/bin/bash\nif [[ "$1" == "-c" ]]; then exit 0; fi\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {"PATH": "/usr/bin:/bin", "PY": str(fake)}
    script = str(tmp_path / "scripts" / "gpu_check.sh")
    for stage in ("core_bench", "mnli_bench"):
        proc = subprocess.run(["bash", script, stage], capture_output=True, text=True, env=env,
                              check=False, cwd=tmp_path)  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
    calls = log.read_text().splitlines()
    pips = [c for c in calls if c.startswith("-m pip install")]
    assert len(pips) == 1 and pips[0].endswith(".whl/pkg-1.0-py3-none-any.whl")
    assert calls.index(pips[0]) > next(i for i, c in enumerate(calls) if "benchmarks.core" in c)
