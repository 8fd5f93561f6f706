"""``scripts/gpu_check.sh``, the bounded GPU run, checked where there is no GPU: its
stages name modules that exist, stage selection works, and without CUDA it refuses."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "gpu_check.sh"
STAGES = ["tests", "dlrm_lookup", "core_bench", "step_modes", "mnli_bench"]
bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PY": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, check=False
    )


@bash
def test_dry_run_lists_every_stage_within_one_remote_call():
    out = _run("--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == STAGES
    assert sum(int(line.split()[1].rstrip("s:")) for line in lines) <= 600
    for line in lines:
        words = line.split()
        target = words[words.index("-m") + 1]
        if target == "pytest":
            assert (SCRIPT.parent.parent / words[-1]).is_file()
        else:
            assert importlib.util.find_spec(target) is not None, target
        assert "cuda" in line or target == "pytest"


@bash
def test_stage_selection_and_errors():
    out = _run("--dry-run", "core_bench", "tests")
    assert [line.split()[0] for line in out.stdout.splitlines()] == ["core_bench", "tests"]
    out = _run("--dry-run", "nope")
    assert out.returncode == 2 and "unknown stage 'nope'" in out.stderr


@bash
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_refuses_without_cuda():
    out = _run("core_bench")
    assert out.returncode == 2 and "sees no CUDA device" in out.stderr
