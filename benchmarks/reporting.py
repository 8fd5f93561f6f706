"""What every benchmark's report step shares: its JSON read back, files written whole.

A benchmark keeps its measurements as JSON and renders its report from that JSON alone
(``render(result) -> str`` in each module), both right after measuring and later, from the
committed JSON, with ``--render JSON``: a report can be regenerated without measuring
again, and its header (command, CPU, torch version, date) says what the JSON recorded.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from comera.errors import DataError

__all__ = ["TINY_NEEDS_OUT", "add_threads_flag", "read_result", "write_json", "write_text"]

# a toy run's figures must not pass for the report's: its JSON goes where it is told
TINY_NEEDS_OUT = "--tiny measures a toy model: give --out PATH (the default is the report's JSON)"


def add_threads_flag(ap: argparse.ArgumentParser) -> None:
    """``--threads N``, by default torch's own count: what a training command runs at."""
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads (default: torch's own, as training uses)")  # fmt: skip


def write_text(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file and a rename, so a reader never
    sees half a report (and an interrupted run leaves the last one whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_json(path: Path, result: dict, indent: int | None = 1) -> None:
    """A benchmark's result as ``path`` (JSON), written whole."""
    write_text(path, json.dumps(result, indent=indent) + "\n")


def read_result(path: Path, flag: str = "--render") -> dict:
    """A benchmark's JSON result read back for rendering; a missing or unreadable file, or
    one that is not a JSON object, raises :class:`DataError` naming the file and ``flag``."""
    try:
        result = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise DataError(f"{flag} {path}: no such file") from None
    except (OSError, json.JSONDecodeError) as e:
        raise DataError(f"{flag} {path}: cannot read it as JSON ({e})") from None
    if not isinstance(result, dict):
        raise DataError(f"{flag} {path}: expected a JSON object, got {type(result).__name__}")
    return result


def print_rendered(path: Path, render: Callable[[dict], str], prog: str) -> int:
    """``--render PATH``: print ``render`` of the saved result; an unreadable file, or the
    result of another benchmark (a key this one's has is missing), is one line naming it
    and exit status 2 (each committed report is rendered by the tests, so a missing key is
    the file's, not the renderer's)."""
    try:
        result = read_result(path)
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    try:
        text = render(result)
    except KeyError as e:
        print(f"{prog}: error: {path} is not a result of {prog} (it has no {e} key); give "
              "the JSON this benchmark wrote", file=sys.stderr)  # fmt: skip
        return 2
    print(text)
    return 0
