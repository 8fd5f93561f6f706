"""The main job: CoMERA and its dense twin on the smoke preset, against the cue baseline.

    python -m experiments.mnli.demo [--set KEY=VALUE ...] [--runs-dir runs]

Trains the smoke preset twice (CoMERA, then dense; same seed, same data) and prints one
table: final eval accuracy of both, the best accuracy any single surface cue of the
generated task reaches, chance, and CoMERA's compression. Extra ``--set`` items go to both
runs (see ``python -m experiments.mnli --help``), except the keys the demo sets for each run
(:data:`OWN_KEYS`: which one is dense, where it goes) and data other than the generated task,
whose cue baseline the table shows. Each run is the same as ``python -m experiments.mnli
--preset smoke --set ... --run-dir DIR`` (``--dense`` for the twin), and resumes as one.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import shutil
import sys
import time
from pathlib import Path

import torch

from comera.train import NonFiniteLoss
from comera.train.checkpoint import complete_checkpoints
from comera.train.distributed import (
    broadcast_object,
    init_distributed,
    own_process_group,
    rank_world,
)
from experiments import cli
from experiments.malloc import restart_for
from experiments.mnli import experiment as mnli
from experiments.mnli.generated import best_single_cue_accuracy, generate_examples

__all__ = ["main", "run_demo"]


# what the demo sets for each of its two runs: a --set of these would make a row of its
# table something other than its label says (both runs dense, a run elsewhere)
OWN_KEYS = ("dense", "model.tt", "train.comera.enabled", "train.run_dir", "train.run_name")


def run_demo(sets: list[str], runs_dir: Path, *, restart: bool = False) -> dict:
    """Both runs; returns ``{"comera": metrics, "dense": metrics, "cue": acc, ...}``.
    ``restart``: re-execute the command first for ``train.cpu_malloc`` (as the experiment
    commands do; only a command may)."""
    cli.refuse_derived_sets(mnli.EXPERIMENT, sets)
    for key in (s.partition("=")[0].strip() for s in sets):
        if key in OWN_KEYS:
            raise cli.CLIError(
                f"--set {key}: the demo sets {key} itself (its CoMERA run and its dense twin, "
                "in --runs-dir); drop it, or train one run with python -m experiments.mnli"
            )
    base = cli.apply_overrides(mnli.preset("smoke"), [], sets)
    if not base.train.eval_every:  # refused now, not after both runs trained
        raise cli.CLIError(
            f"train.eval_every={base.train.eval_every}: the demo compares the runs' final eval "
            "accuracy, so it needs evaluations; drop that --set"
        )
    d = base.data
    if d.dataset != "generated":  # the cue baseline is the generated task's
        raise cli.CLIError(
            f"data.dataset={d.dataset!r}: the demo measures both runs against the generated "
            "task's single-cue baseline; train on other data with python -m experiments.mnli"
        )
    if restart and torch.device(base.train.device).type == "cpu":
        restart_for(base.train.cpu_malloc)  # lean: re-executed with huge pages enabled
    cli.check_folder(runs_dir, "--runs-dir")
    # under torchrun every rank took folders of its own (a stamp per process, the next
    # free suffix): each run's checkpoint was split over two pairs and resumed in neither.
    # Rank 0 picks them, the others take its pick
    rank, _ = init_distributed(base.train.device)
    dirs = _fresh_dirs(runs_dir, time.strftime("%Y%m%d-%H%M%S")) if rank == 0 else {}
    dirs = broadcast_object(dirs)
    out: dict = {}
    for kind, run_dir in dirs.items():
        over = [("train.run_dir", str(run_dir))]
        if kind == "dense":
            over += [("dense", True), ("train.comera.enabled", False),
                     ("train.run_name", f"{base.train.run_name}-dense")]  # fmt: skip
        # recorded as the experiment command that trains the same run
        argv = ["--preset", "smoke", *(f"--set={s}" for s in sets), "--run-dir", str(run_dir)]
        argv += ["--dense"] if kind == "dense" else []
        try:
            out[kind] = mnli.run(cli.apply_overrides(base, over, []), argv=argv)
        except BaseException as e:
            # the folder reserved for the CoMERA run, left empty by a refusal: gone again
            with contextlib.suppress(OSError):
                dirs["comera"].rmdir()
            if isinstance(e, cli.USER_ERRORS):  # said for one run: said for the demo
                if run_dir.is_dir() and not complete_checkpoints(run_dir):
                    # records a refused start wrote (wandb that could not start): the demo
                    # starts anew, so they would only be left behind
                    shutil.rmtree(run_dir, ignore_errors=True)
                # how the run's message says to go on with it: the demo trains both anew
                resume = re.compile(r"[,;]? *(?:and |then )?(?:go on with )?--resume "
                                    + re.escape(str(run_dir)))  # fmt: skip
                why = resume.sub("", str(e))
                raise cli.CLIError(
                    f"its {kind} run: {why}; the demo takes each setting as --set KEY=VALUE "
                    "(--wandb offline is --set train.wandb=offline; python -m experiments.mnli "
                    "--help names each flag's key): run the demo again"
                ) from None
            if isinstance(e, KeyboardInterrupt) and not isinstance(e, cli.Interrupted):
                # Ctrl-C or SIGTERM while the run read its data: a traceback, or (SIGTERM)
                # a silent exit, where the experiment's command says it in one line
                status, signame = cli.stop_signal(e)
                how = f"stopped by {signame} before it trained"
                e = cli.Interrupted(how, status, rank, how)
            if not isinstance(e, cli.Interrupted):
                raise
            # the table needs both runs: the demo starts anew
            raise cli.Interrupted(
                f"its {kind} run ({run_dir}) {e.how}; run the demo again (it trains both "
                "runs anew)",
                e.status,
                e.rank,
                e.how,
            ) from None
    held_out = generate_examples(d.generated_eval, d.seed, "validation", d.generated_vocab)
    limit = d.max_eval_examples  # the runs score the first ones (all generated are labelled)
    out["cue"] = best_single_cue_accuracy({k: v[:limit] for k, v in held_out.items()})
    return out


def _fresh_dirs(runs_dir: Path, stamp: str) -> dict[str, Path]:
    """The two runs' folders, stamped; a demo started in the same second (another
    process) takes the next free suffix, reserved by creating the CoMERA folder."""
    for n in itertools.count(1):
        tag = stamp if n == 1 else f"{stamp}-{n}"
        dirs = {kind: runs_dir / f"mnli-smoke-{kind}-{tag}" for kind in ("comera", "dense")}
        if dirs["dense"].exists():
            continue
        try:
            dirs["comera"].mkdir(parents=True)
        except FileExistsError:
            continue
        return dirs
    raise AssertionError("unreachable")


def summary(out: dict) -> str:
    """The demo's table: accuracy of both models next to the cue baseline."""
    acc = {k: out[k]["eval/validation/accuracy"] for k in ("comera", "dense")}
    rows = [
        ("CoMERA eval accuracy", f"{acc['comera']:.4f}"),
        ("dense eval accuracy", f"{acc['dense']:.4f}"),
        ("best single-cue accuracy", f"{out['cue']:.4f}"),
        ("chance", f"{1 / 3:.4f}"),
        ("CoMERA - best cue", f"{acc['comera'] - out['cue']:+.4f}"),
        ("CoMERA - dense", f"{acc['comera'] - acc['dense']:+.4f}"),
        ("CoMERA compression (vs dense)", f"{out['comera']['compression']:.1f}x"),
        ("CoMERA live params", f"{int(out['comera']['live_params']):,}"),
        (
            "time (CoMERA, dense)",
            f"{out['comera']['wall_s']:.0f} s, {out['dense']['wall_s']:.0f} s",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'MNLI smoke demo'.ljust(width)} | |", f"|{'-' * (width + 2)}|---|"]
    return "\n".join(lines + [f"| {k.ljust(width)} | {v} |" for k, v in rows])


def main(argv: list[str] | None = None) -> int:
    """Parse, run both, print the table. Bad input is one line and status 2; a loss that
    stops being finite, one line and status 1; anything else keeps its traceback. Leaves
    the process group it joined under torchrun on the way out."""
    with own_process_group():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    ap = cli.Parser(
        prog="python -m experiments.mnli.demo",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config field of both runs (python -m experiments.mnli "
                         "--help lists them; repeatable)")  # fmt: skip
    ap.add_argument("--runs-dir", default="runs", metavar="DIR",
                    help="where the two runs' folders go (default: runs)")  # fmt: skip
    try:
        args = ap.parse_args(argv)
        if not args.runs_dir.strip():
            raise cli.CLIError("--runs-dir is empty; give a folder (default: runs)")
        with cli.sigterm_as_interrupt():  # as the experiment's command, data reading too
            out = run_demo(args.sets, Path(args.runs_dir), restart=argv is None)
    except cli.USER_ERRORS as e:  # bad input: one line; anything else keeps its traceback
        return cli.user_error(ap.prog, e)
    except NonFiniteLoss as e:  # a training outcome, as the experiment's command says it
        print(f"{ap.prog}: stopped: {e}", file=sys.stderr)
        return 1
    except cli.Interrupted as e:
        return cli.interrupted(ap.prog, e)
    if rank_world()[0] == 0:  # once, under torchrun too
        print(summary(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
