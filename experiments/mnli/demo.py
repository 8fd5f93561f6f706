"""The main job: CoMERA and its dense twin on the smoke preset, against the cue baseline.

    python -m experiments.mnli.demo [--set KEY=VALUE ...] [--runs-dir runs]

Trains the smoke preset twice (CoMERA, then dense; same seed, same data) and prints one
table: final eval accuracy of both, the best accuracy any single surface cue of the
generated task reaches, chance, and CoMERA's compression. Extra ``--set`` items go to both
runs (see ``python -m experiments.mnli --help``).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from experiments import cli
from experiments.mnli import experiment as mnli
from experiments.mnli.generated import best_single_cue_accuracy, generate_examples

__all__ = ["main", "run_demo"]


def run_demo(sets: list[str], runs_dir: Path) -> dict:
    """Both runs; returns ``{"comera": metrics, "dense": metrics, "cue": acc, ...}``."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    cli.refuse_derived_sets(mnli.EXPERIMENT, sets)
    base = cli.apply_overrides(mnli.preset("smoke"), [], sets)
    if not base.train.eval_every:  # refused now, not after both runs trained
        raise cli.CLIError(
            f"train.eval_every={base.train.eval_every}: the demo compares the runs' final eval "
            "accuracy, so it needs evaluations; drop that --set"
        )
    out: dict = {}
    for kind in ("comera", "dense"):
        cfg = base
        if kind == "dense":
            cfg = cli.apply_overrides(cfg, [("dense", True), ("train.comera.enabled", False)], [])
        cfg = cli.set_field(cfg, "train.run_dir", str(runs_dir / f"mnli-smoke-{kind}-{stamp}"))
        out[kind] = mnli.run(cfg)
    d = base.data
    held_out = generate_examples(d.generated_eval, d.seed, "validation", d.generated_vocab)
    out["cue"] = best_single_cue_accuracy(held_out)
    return out


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
    ap = argparse.ArgumentParser(prog="python -m experiments.mnli.demo", description=__doc__)
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--runs-dir", default="runs", type=Path)
    args = ap.parse_args(argv)
    try:
        out = run_demo(args.sets, args.runs_dir)
    except cli.USER_ERRORS as e:  # bad input: one line; anything else keeps its traceback
        return cli.user_error(ap.prog, e)
    print(summary(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
