"""Benchmark points in fresh processes, so each one's time and peak memory are its own.

A worker prints its result as JSON on its last stdout line. One that fails raises
:class:`WorkerFailed`, whose ``reason`` (the last line of its stderr: the exception) is
what a bench records for that point before going on to the next."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Mapping, Sequence

__all__ = ["WorkerFailed", "run_json_worker"]


class WorkerFailed(RuntimeError):
    """A worker process failed; the message holds its stderr tail, ``reason`` its last
    line."""

    def __init__(self, what: str, stderr: str, returncode: int | None = None) -> None:
        lines = [line for line in stderr.splitlines() if line.strip()]
        self.reason = (lines[-1] if lines else "no output")[-500:]
        self.returncode = returncode
        # a negative code is the signal that ended it (-9: killed, often out of memory)
        code = f" (exit {returncode})" if returncode is not None else ""
        super().__init__(f"{what} failed{code}:\n{stderr[-3000:]}")


def run_json_worker(
    cmd: Sequence[str],
    what: str,
    *,
    env: Mapping[str, str] | None = None,
    timeout: float | None = None,
) -> dict:
    """Run ``cmd`` and return its last stdout line as JSON; :class:`WorkerFailed` (named
    ``what``) if it exits non-zero. ``subprocess.TimeoutExpired`` past ``timeout``."""
    proc = subprocess.run(
        list(cmd), capture_output=True, text=True, check=False, env=env, timeout=timeout
    )
    if proc.returncode:
        raise WorkerFailed(what, proc.stderr, proc.returncode)
    return json.loads(proc.stdout.strip().splitlines()[-1])
