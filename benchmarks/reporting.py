"""What every benchmark's report step shares: its JSON read back, files written whole.

A benchmark keeps its measurements as JSON and renders its report from that JSON alone
(``render(result) -> str`` in each module), both right after measuring and later, from the
committed JSON, with ``--render JSON``: a report can be regenerated without measuring
again, and its header (command, CPU, torch version, date) says what the JSON recorded.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from comera.errors import DataError, UserError
from experiments import cli
from experiments.cli import CLIError, Parser, check_folder, user_error
from experiments.report import md_cell
from experiments.workers import WorkerFailed

__all__ = [
    "TINY_NEEDS_OUT",
    "add_json_and_render",
    "add_threads_flag",
    "arg_parser",
    "check_bench_device",
    "check_output",
    "md_cell",
    "measure_points",
    "one_line_errors",
    "print_rendered",
    "read_result",
    "recorded_out",
    "reduced_run",
    "render_only",
    "render_refusal",
    "render_saved",
    "variant_batch",
    "write_json",
    "write_text",
]

# a toy run's figures must not pass for the report's: they go where they are told (--out
# is the JSON of some benchmarks, the report folder of others: the line fits both)
TINY_NEEDS_OUT = (
    "--tiny measures a toy model: give --out PATH (by default its figures would replace the "
    "report's)"
)


Main = Callable[[list[str] | None], int]


def arg_parser(prog: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A benchmark's argument parser: the training commands' :class:`experiments.cli.Parser`,
    whose errors raise :class:`CLIError` (one line through :func:`one_line_errors`), not
    argparse's usage block and exit."""
    # the description is the module's docstring: its usage lines and paragraphs as written
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return Parser(prog=prog, description=description, **kwargs)


def recorded_out(result: dict, flag: str = "--out") -> list[str]:
    """``[flag, PATH]`` for the output path a run was given (``result["out"]``, recorded
    only when one was given), else ``[]``: a reduced or toy run is refused without one,
    so a report header's command names it and runs as written."""
    out = result.get("out")
    return [flag, shlex.quote(str(out))] if out else []


def reduced_run(settings: dict[str, tuple[object, object]], out_flag: str) -> str | None:
    """Why a run must name ``out_flag``, or None: measuring flags set away from their
    defaults, the settings the committed report was measured with (``settings``: flag ->
    (what this run measures, what the defaults measure), each as the benchmark reads it:
    ``--modes sync_free,compile`` measures the default points). A smaller or partial run
    (the loader at 20,000 tokens, the plans of one experiment, one step mode) replaced
    the whole report's figures by its own."""
    changed = [flag for flag, (given, default) in settings.items() if given != default]
    if not changed:
        return None
    return (f"{', '.join(changed)} measure{'s' if len(changed) == 1 else ''} other than the "
            f"report's settings: give {out_flag} PATH (by default these figures would replace "
            "the report's)")  # fmt: skip


def one_line_errors(prog: str) -> Callable[[Main], Main]:
    """Decorate a benchmark's ``main(argv) -> int``: a :class:`CLIError` it raises (a bad
    flag from :func:`arg_parser`, or a check of its own) is printed as the one line ``PROG:
    error: MESSAGE`` on stderr and gives exit status 2, as the training commands do. A
    Ctrl-C or SIGTERM is one line too (a traceback per process before), with the status
    the signal gives: results are written whole at the end, so none was half-written."""

    def wrap(main: Main) -> Main:
        @functools.wraps(main)
        def run(argv: list[str] | None = None) -> int:
            try:
                with cli.sigterm_as_interrupt():
                    return main(argv)
            except CLIError as e:
                return user_error(prog, e)
            except KeyboardInterrupt as e:
                status, name = cli.stop_signal(e)
                print(f"{prog}: stopped by {name} before all its results were written (each "
                      "file is written whole: a report not yet rewritten keeps its last figures)",
                      file=sys.stderr)  # fmt: skip
                return status

        return run

    return wrap


def add_json_and_render(ap: argparse.ArgumentParser, render_help: str) -> None:
    """A benchmark's ``--json`` (print the result as one JSON object) and ``--render JSON``
    (measure nothing; ``render_help`` says what it prints or writes), one or the other:
    a render prints the report's markdown, so ``--json`` beside it would do nothing."""
    out_format = ap.add_mutually_exclusive_group()
    out_format.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    out_format.add_argument("--render", type=Path, metavar="JSON", help=render_help)


def add_threads_flag(ap: argparse.ArgumentParser) -> None:
    """``--threads N``, by default torch's own count: what a training command runs at."""
    ap.add_argument("--threads", type=int, default=torch.get_num_threads(),
                    help="torch threads (default: torch's own, as training uses)")  # fmt: skip


def check_bench_device(device: str, flag: str = "--device") -> None:
    """Refuse, as a :class:`CLIError` naming ``flag``, a device a benchmark cannot run on:
    one torch cannot parse or this machine cannot use (:func:`experiments.cli.check_device`,
    as the training commands check it), or a type other than cpu and cuda (``xla``, a
    plugin's), which torch accepts as a string and every point would then fail on."""
    cli.check_device(device, flag)  # looked up when called: a test may stand in for CUDA
    if torch.device(device).type not in ("cpu", "cuda"):
        raise CLIError(f"{flag} {device}: choose cpu or cuda")


def check_output(path: Path, flag: str, kind: str, beside: str | None = None) -> None:
    """Refuse, as a :class:`CLIError` naming ``flag``, an output path a benchmark could not
    write whole; called before anything is measured, so a bad path is one line at once, not
    a traceback after minutes of measuring. ``kind`` ``"folder"``: a file, or a path under
    one (:func:`experiments.cli.check_folder`). ``kind`` ``"file"``: an existing folder, or
    a path under a file; with ``beside``, the suffix of the file written next to it
    (``path.with_suffix(beside)``), a path that already ends in it (the second write would
    replace the first) or whose twin is a folder."""
    if kind == "folder":
        if not path.exists() and path.suffix.lower() in (".md", ".json", ".png"):
            raise CLIError(  # a folder named eff.md was made, the report written into it
                f"{flag} {path}: give the folder the report goes in, not a file name (a "
                f"folder named {path.name} would be made)"
            )
        check_folder(path, flag)
        return
    if kind != "file":
        raise ValueError(f"check_output: kind {kind!r}; use 'file' or 'folder'")
    if beside is not None and path.suffix == beside:
        want = {".json": ".md", ".md": ".json"}.get(beside, f"another suffix than {beside}")
        raise CLIError(f"{flag} {path}: give a path ending in {want}; the {beside} file "
                       "written beside it would replace this one")  # fmt: skip
    for p in (path, *([path.with_suffix(beside)] if beside is not None else [])):
        if p.is_dir():
            raise CLIError(f"{flag} {path}: {p} is a folder; give a file path")
    base = next(p for p in (path.parent, *path.parent.resolve().parents) if p.exists())
    if not base.is_dir():
        raise CLIError(f"{flag} {path}: {base} is a file, so nothing can be written under it")
    check_folder(path.parent, flag)  # a folder that can be made and written here


def variant_batch(
    ap: argparse.ArgumentParser, batch: int | None, variant: str | None, default: int, runs: str
) -> int:
    """A one-variant process's ``--batch``: refused without ``--variant`` (the whole bench
    runs the batches ``runs`` names) and below 1 (a traceback in the variant's first
    step); ``default`` when not given."""
    if batch is not None and not variant:
        ap.error(f"--batch applies to one variant (--variant V); the bench runs batches {runs}")
    batch = default if batch is None else batch
    if batch < 1:
        ap.error(f"--batch must be >= 1, got {batch}")
    return batch


def render_only(ap: argparse.ArgumentParser, argv: list[str] | None,
                keep: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Refuse, as a :class:`CLIError`, a measuring flag given beside ``--render``, which
    measures nothing (the flag would be dropped without a word); ``keep`` names the dests
    of flags that still apply (where the rendered report goes). A flag counts as given
    when it is on the command line, whatever its value (a machine-dependent default, such
    as ``--threads``, decides nothing)."""
    unset = object()
    given = argparse.Namespace(**{a.dest: unset for a in ap._actions})
    ap.parse_args(argv, namespace=given)  # argparse fills only what the command line gives
    for action in ap._actions:
        if not action.option_strings or action.dest in ("help", "render", *keep):
            continue
        if getattr(given, action.dest) is not unset:
            flag = max(action.option_strings, key=len)
            raise CLIError(f"{flag} with --render: --render measures nothing, so {flag} "
                           "would do nothing; drop it")  # fmt: skip


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
    except (OSError, ValueError) as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise DataError(f"{flag} {path}: cannot read it as JSON ({e})") from None
    if not isinstance(result, dict):
        raise DataError(f"{flag} {path}: expected a JSON object, got {type(result).__name__}")
    return result


def render_saved(
    path: Path, render: Callable[[dict], str], prog: str, required: tuple[str, ...] = ()
) -> tuple[dict, str] | None:
    """``--render PATH``: the saved result and ``render`` of it, or None after one error
    line on stderr: an unreadable file, a partial result (the points a run cut short had
    measured, kept beside the report for inspection: it lacks the figures and fields a
    report is rendered from), one with no figures (a ``required`` key empty), or the
    result of another benchmark (a ``required`` key, or one the renderer reads, is missing
    or of another shape). Each committed report is
    rendered by the tests, so such a failure is the file's, not the renderer's."""
    try:
        result = read_result(path)
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    if result.get("partial"):
        print(f"{prog}: error: {path} is a partial result (the points of a run cut short), "
              "kept for inspection; it cannot be rendered: run the benchmark again",
              file=sys.stderr)  # fmt: skip
        return None
    empty = [k for k in required if k in result and result[k] in ([], {}, "")]
    if empty:  # rendered, it was a table of no rows over the report it replaced
        print(f"{prog}: error: {path} holds no figures ({empty[0]} is empty); give the JSON "
              "a run of this benchmark wrote", file=sys.stderr)  # fmt: skip
        return None
    missing = [k for k in required if k not in result]
    try:
        if missing:
            raise KeyError(missing[0])
        return result, render(result)
    except UserError as e:  # already says what is wrong
        print(f"{prog}: error: {e}", file=sys.stderr)
        return None
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, ArithmeticError) as e:
        # a result of another command, or of a version before the field (its key alone
        # read as "not this benchmark's")
        what = (f"it lacks the field {e}: another command's result, or an older version's"
                if isinstance(e, KeyError) else "its fields are not this one's")  # fmt: skip
        print(f"{prog}: error: {path} is not a result of {prog} as it renders now ({what}); "
              "give the JSON a run of this benchmark wrote", file=sys.stderr)  # fmt: skip
        return None


def render_refusal(result: dict, out: Path | None, flag: str = "--out") -> str | None:
    """Why ``--render`` of ``result`` may not write into the default report (``out``, the
    path given with ``flag``, None), or None: a ``--tiny`` result's toy figures, or core's
    ``--quick`` ones (its ``config``), would replace the report that measuring itself never
    lets them replace. (A partial result is never rendered: :func:`render_saved`.)"""
    if out is not None:
        return None
    if result.get("tiny"):
        return f"a --tiny result's figures (a toy model); give {flag} PATH to render them"
    config = result.get("config")
    if isinstance(config, dict) and config.get("quick"):
        return f"a --quick result's figures (tiny shapes); give {flag} PATH to render them"
    return None


def print_rendered(
    path: Path, render: Callable[[dict], str], prog: str, required: tuple[str, ...] = ()
) -> int:
    """``--render PATH``: print ``render`` of the saved result (:func:`render_saved`);
    exit status 2 after its one error line."""
    done = render_saved(path, render, prog, required)
    if done is None:
        return 2
    print(done[1])
    return 0


def measure_points(
    points: list[tuple[str, int]], run: Callable[[str, int], dict], partial: Path | None,
    head: dict | None = None,
) -> tuple[list[dict], list[str]]:  # fmt: skip
    """Each ``(variant, batch)`` point measured by ``run`` (a worker process). A point
    that fails stops no other: it is recorded with its error. Every result goes to
    ``partial`` (``head`` and the runs so far) as it comes, so a run stopped by a time
    limit keeps what it measured. Returns the results and the failed points' names."""
    results, failed = [], []
    for variant, batch in points:
        try:
            results.append(run(variant, batch))
        except WorkerFailed as e:
            print(e, file=sys.stderr, flush=True)
            results.append({"variant": variant, "batch": batch, "error": e.reason})
            failed.append(f"{variant}/{batch}")
        if partial is not None:
            write_json(partial, {**(head or {"partial": True}), "runs": results})
    return results, failed
