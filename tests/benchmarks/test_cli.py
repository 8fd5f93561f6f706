"""The benchmarks' command-line rules: bad input is one line on stderr, ``PROG: error:
...`` naming the flag to change, exit status 2, no traceback, refused before anything is
measured, and nothing under reports/ is touched."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REPORTS = ROOT / "reports"
BENCHMARKS = ["core", "loader", "tensorize", "mnli_step", "codebert_step", "dlrm_step",
              "dlrm_prep", "plans", "efficiency", "step_modes"]  # fmt: skip


def _refused(module: str, argv: list[str], capsys) -> str:  # noqa: ANN001
    """Run ``benchmarks.<module>``'s main on ``argv``: exit status 2 and one stderr line,
    which is returned."""
    bench = importlib.import_module(f"benchmarks.{module}")
    assert bench.main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"python -m benchmarks.{module}: error: "), err
    return err[0]


@pytest.mark.parametrize("module", BENCHMARKS)
@pytest.mark.parametrize(
    ("argv", "text"),
    [(["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
     (["--render"], "argument --render: expected one argument")],
)  # fmt: skip
def test_a_bad_flag_is_one_line_not_a_usage_block(module, argv, text, capsys) -> None:  # noqa: ANN001
    assert text in _refused(module, argv, capsys)


def test_the_old_loader_command_s_error_is_one_line() -> None:
    """``python -m loaders.bench`` forwards to ``benchmarks.loader``: its moved note comes
    after a run, never beside an error line (which names the new command already)."""
    proc = subprocess.run(
        [sys.executable, "-m", "loaders.bench", "--tokens", "x"],
        capture_output=True, text=True, check=False, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "python -m benchmarks.loader: error: argument --tokens: invalid int value: 'x'"
    ]
