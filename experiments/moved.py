"""Old command names that forward to where the commands live now.

``python -m experiments.efficiency``, ``python -m experiments.mnli --bench`` and the other
moved commands keep working for now: each prints one line on stderr naming the new
command, then runs the new module as ``__main__`` with the arguments it was given, so its
output (JSON keys included) is the new command's. The forwards go in a later release.

The new module is run by name at run time (:mod:`runpy`), never imported here:
experiments do not import benchmarks.
"""

from __future__ import annotations

import argparse
import runpy
import sys
import warnings
from collections.abc import Sequence

__all__ = ["bench_forward", "forward", "notice", "run_module"]


def notice(old: str, new: str) -> None:
    """The one stderr line of a forward: ``old`` (a command line) has moved to ``new``."""
    print(
        f"note: `python -m {old}` has moved to `python -m {new}`; the old name goes in a "
        "later release",
        file=sys.stderr,
        flush=True,
    )


def run_module(module: str, argv: Sequence[str]) -> int:
    """Run ``module`` as ``python -m module *argv`` would, in this process; its exit
    status (a ``SystemExit`` it raises becomes the status; a message in it is printed on
    stderr, status 1, as Python does). ``sys.argv`` is restored afterwards."""
    saved = sys.argv
    sys.argv = [module, *argv]
    try:
        with warnings.catch_warnings():  # a fresh copy runs even where it was imported: meant
            warnings.filterwarnings("ignore", "'.*' found in sys.modules", RuntimeWarning)
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    finally:
        sys.argv = saved
    return 0


def forward(old: str, new: str, argv: Sequence[str] | None = None) -> int:
    """The whole of an old command: the notice, then ``new`` with ``argv`` (default: this
    process's arguments)."""
    notice(old, new)
    return run_module(new, list(sys.argv[1:] if argv is None else argv))


def bench_forward(old: str, new: str, args: argparse.Namespace) -> int:
    """An experiment's ``--bench`` flag: ``python -m {old} --bench`` forwards to the
    benchmark ``new`` with the flags it shares mapped (``--json``, ``--device``)."""
    argv = ["--json"] if getattr(args, "json", False) else []
    if getattr(args, "device", None):
        argv += ["--device", args.device]
    notice(f"{old} --bench", new)
    return run_module(new, argv)
