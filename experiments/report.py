"""What every experiment's report shares: reading run dirs, the report's JSON, rank and
layer tables, and the ``python -m experiments.<name>.report`` command of the smoke runs.

Reports are data first. A report writer gathers what it shows from the run dirs into one
JSON (``reports/<name>.json``: summaries, curves, the host that made the runs) and renders
the markdown and plots from that JSON alone, so ``--from-json`` re-renders a report without
the run dirs. The writers state numbers, never conclusions drawn from them.

``python -m experiments.report RUN...`` is the MNLI report's old command: a forward to
``python -m experiments.mnli.report`` that goes in a later release.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import typing
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from comera.errors import DataError, MissingFileError, UserError
from comera.train import load_checkpoint, read_metrics
from comera.train.checkpoint import complete_checkpoints
from comera.train.logging import train_and_eval_rows
from experiments.host import host_meta
from experiments.run_config import RESUME_MUTABLE, config_jsonable

__all__ = [
    "HOST_FILE",
    "REPORTS",
    "check_evaluated",
    "check_smoke_pair",
    "check_smoke_setup",
    "check_step_bench",
    "differing_keys",
    "ensure_smoke_run",
    "kept_settings",
    "layer_summary",
    "layer_table",
    "load_run",
    "md_cell",
    "number",
    "pair_setup",
    "rank_table",
    "run_setup",
    "read_bench_json",
    "read_run_json",
    "read_report_json",
    "render_report_json",
    "resumes",
    "record_host",
    "runs_host",
    "series",
    "smoke_dirs",
    "smoke_gaps",
    "smoke_report_main",
    "staged",
    "step_times",
    "train_and_eval_rows",
    "write_report_json",
]

REPORTS = Path(__file__).resolve().parent.parent / "reports"
HOST_FILE = "host.json"  # cpu, torch, date of the process that trained the run


def md_cell(text: str) -> str:
    """``text`` for a markdown table cell: a layer's shapes, written ``[in modes | out
    modes]``, or a run named ``a|b`` would split its cell in two."""
    return text.replace("|", "\\|")


def record_host(run_dir: Path) -> None:
    """Write :func:`experiments.host.host_meta` into ``RUN_DIR/host.json``: the machine,
    torch version and date a report on this run names in its header."""
    path = Path(run_dir) / HOST_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(host_meta(), indent=1) + "\n")
    tmp.replace(path)


def runs_host(run_dirs: Iterable[Path]) -> dict[str, str]:
    """cpu, torch and date of the runs' making: the first run dir's ``host.json``
    (:func:`record_host`), else this process's (a report is gathered where its runs are,
    most often right after they trained)."""
    for d in run_dirs:
        path = Path(d) / HOST_FILE
        if path.is_file():
            return read_run_json(path, dict)
    return host_meta()


def ensure_smoke_run(exp_main: Any, run_dir: Path, *, dense: bool, label: str) -> None:
    """Train the ``smoke`` preset into ``run_dir`` (``--dense`` for the baseline), or
    finish the run already there (a no-op when it is done); exit on failure. A run that
    trained here, or has no ``host.json`` yet, records this host (:func:`record_host`)."""
    before = _progress(run_dir)
    if (run_dir / "config.json").is_file():
        code = exp_main(["--resume", str(run_dir), "--no-progress"])
    else:
        argv = ["--preset", "smoke", "--run-dir", str(run_dir), "--no-progress"]
        code = exp_main([*argv, "--dense"] if dense else argv)
    if code:  # its own status: 2 (bad input) is not a bug's 1
        if code in (128 + signal.SIGINT, 128 + signal.SIGTERM):  # not a failure
            print(f"{label}: the run in {run_dir} was stopped (exit {code}); run the report "
                  "again to finish it", file=sys.stderr)  # fmt: skip
        else:
            print(f"{label}: the run in {run_dir} failed (exit {code})", file=sys.stderr)
        raise SystemExit(code)
    # by what it logged and saved: a resume that trains nothing still rewrites the metrics
    # file (its rows after the checkpoint), and its report restamped a finished run
    trained = _progress(run_dir) != before
    if trained or not (run_dir / HOST_FILE).is_file():
        record_host(run_dir)


def _progress(run_dir: Path) -> tuple[int | None, str | None]:
    """How far a run is: the last training step its ``metrics.jsonl`` holds and its newest
    complete checkpoint (a run killed after its last row, before its last checkpoint,
    retrains to the same last step and saves that checkpoint)."""
    metrics = run_dir / "metrics.jsonl"
    steps = [r["step"] for r in read_metrics(metrics) if "loss" in r] if metrics.is_file() else []
    saved = complete_checkpoints(run_dir) if run_dir.is_dir() else []
    return (steps[-1] if steps else None), (saved[-1].name if saved else None)


def smoke_report_main(
    name: str,
    exp_main: Any,
    write: Callable[..., str],
    argv: list[str] | None,
    description: str,
    render: Callable[[dict, Path], str] | None = None,
    bench_section: Callable[[dict], list[str]] | None = None,
    experiment: Any = None,
) -> int:
    """The ``python -m experiments.<name>.report`` command: the smoke preset's CoMERA and
    dense runs (``RUNS/<name>-smoke``, ``-smoke-dense``), then ``write(runs, out, bench,
    command=...)``; with ``--from-json FILE``, ``render(json, out)`` alone (no training).
    ``bench_section`` renders the ``--bench-json`` figures: tried on them first, so another
    benchmark's JSON is refused before any run trains or any report file is written.
    ``experiment`` (its ``cli.Experiment``): where one of the two runs is there and the
    other is not, the one there must be of the smoke preset's setup, or the missing one,
    trained from the preset, could not be set beside it (refused before it trains)."""
    prog = f"python -m experiments.{name}.report"
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--runs", default=None, help="the folder of the two smoke runs (default runs)")
    ap.add_argument("--out", default="reports")
    ap.add_argument(
        "--bench-json",
        dest="bench_json",
        # a report without a benchmark section keeps the flag only to refuse it by name
        help=argparse.SUPPRESS if bench_section is None else "the step benchmark's --json result",
    )
    if render is not None:
        ap.add_argument(
            "--from-json",
            dest="from_json",
            metavar="FILE",
            help=f"re-render the report from its JSON (reports/{name}.json), without the runs",
        )
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not out.exists() and out.suffix.lower() in (".md", ".json", ".png"):
        # a folder named x.md was made and the report written into it (MNLI's --out is
        # the file's path)
        print(f"{prog}: error: --out {out}: give the folder the report goes in, not a file "
              f"name (a folder named {out.name} would be made)", file=sys.stderr)  # fmt: skip
        return 2
    if getattr(args, "from_json", None) and args.bench_json:  # one of them was ignored
        print(f"{prog}: error: --bench-json: --from-json re-renders the report with the "
              "benchmark figures its JSON holds; drop --bench-json (or --from-json, to train "
              "and write the report anew)", file=sys.stderr)  # fmt: skip
        return 2
    if getattr(args, "from_json", None) and args.runs is not None:  # it was ignored
        print(f"{prog}: error: --runs: --from-json re-renders the report from its JSON, "
              "without the runs; drop --runs (or --from-json, to report on the runs)",
              file=sys.stderr)  # fmt: skip
        return 2
    args.runs = "runs" if args.runs is None else args.runs
    if getattr(args, "from_json", None):
        path = Path(args.from_json)
        try:
            data = read_report_json(path, "--from-json", prog)
            with staged(out) as stage:
                text = render_report_json(lambda: render(data, stage), path, "--from-json", prog)
        except DataError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
        print(text)
        return 0
    if out.exists() and not out.is_dir():  # before training, not after
        print(f"{prog}: error: --out {out} is a file; give a folder", file=sys.stderr)
        return 2
    bench = None
    if args.bench_json and bench_section is None:  # it was read, then ignored
        print(f"{prog}: error: --bench-json: this report shows no benchmark; drop it",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.bench_json:  # read before training: a bad path fails now, not after the runs
        try:
            bench = check_step_bench(
                read_bench_json(Path(args.bench_json)), f"--bench-json {args.bench_json}",
                name, bench_section, f"give a full python -m benchmarks.{name}_step --json result",
            )  # fmt: skip
        except DataError as e:
            print(f"{prog}: error: {e}", file=sys.stderr)
            return 2
    runs = Path(args.runs)
    try:
        if experiment is not None:
            check_smoke_setup(runs, name, experiment)
    except DataError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    for kind, run_dir in smoke_dirs(runs, name).items():
        ensure_smoke_run(exp_main, run_dir, dense=kind == "dense", label=f"{name} report")
    command = " ".join([prog, *(sys.argv[1:] if argv is None else argv)])
    try:
        print(write(runs, out, bench, command=command))
    except UserError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    return 0


def smoke_dirs(runs: Path, name: str) -> dict[str, Path]:
    """The run dirs of a smoke report's pair: ``RUNS/<name>-smoke`` (CoMERA) and
    ``RUNS/<name>-smoke-dense``."""
    return {"CoMERA": runs / f"{name}-smoke", "dense": runs / f"{name}-smoke-dense"}


def differing_keys(setups: list[dict], skip: Iterable[str] = ()) -> list[str]:
    """The keys (sorted) on which ``setups`` differ, values compared as JSON; but those in
    ``skip``."""
    keys = sorted({k for s in setups for k in s} - set(skip))
    return [k for k in keys if len({json.dumps(s.get(k), sort_keys=True) for s in setups}) > 1]


def check_smoke_setup(runs: Path, name: str, experiment: Any) -> None:
    """Refuse a smoke run dir (``RUNS/<name>-smoke`` or ``-smoke-dense``) trained with
    another setup than the smoke preset's (``--corpus``, ``--set data.*``, steps) where its
    partner is missing: the report would train the partner from the preset for minutes,
    then refuse the pair (:func:`check_smoke_pair`)."""
    dirs = smoke_dirs(runs, name)
    there = [k for k, d in dirs.items() if (d / "config.json").is_file()]
    if len(there) != 1:
        return
    (kind,) = there
    missing = "dense" if kind == "CoMERA" else "CoMERA"
    gaps = smoke_gaps(read_run_json(dirs[kind] / "config.json", dict), experiment)
    if gaps:
        flag = " --dense" if missing == "dense" else " (without --dense)"
        raise DataError(
            f"{dirs[kind]} was not trained with the smoke preset's setup ({', '.join(gaps[:4])}"
            f"{' ...' if len(gaps) > 4 else ''} differ), and the {missing} run it is compared "
            f"with would be; train that one yourself with the same flags{flag} --run-dir "
            f"{dirs[missing]}, then run the report again"
        )


def smoke_gaps(config: dict, experiment: Any, *, comera: bool = False) -> list[str]:
    """The keys of :func:`pair_setup` on which a run's recorded ``config`` differs from what
    a plain ``--preset smoke`` run of ``experiment`` records (its ``pair_differs`` and the
    dense size aside: each run's own): a run where any does is not "the smoke preset".
    ``comera``: the ``train.comera.*`` settings too (but ``enabled``), which a CoMERA run's
    report names and its dense partner does not share."""
    cfg = experiment.presets["smoke"]()
    record = {"data": cfg.data, "model": cfg.model, "batch_size": getattr(cfg, "batch_size", None),
              "train": {"steps": cfg.train.steps, "seed": cfg.train.seed}}  # fmt: skip
    preset = pair_setup(json.loads(json.dumps(record, default=config_jsonable)))
    skip = {"dense_params", *experiment.pair_differs}
    gaps = differing_keys([preset, pair_setup(config)], skip)
    if comera:
        # settings added since the run was saved at their defaults, as it trained
        train = with_defaults(config).get("train")
        ours = train.get("comera") if isinstance(train, dict) else None
        ours = ours if isinstance(ours, dict) else {}
        theirs = json.loads(json.dumps(cfg.train.comera, default=config_jsonable))
        # a key a record of no known experiment lacks is not a change either
        flat = [{f"train.comera.{k}": v for k, v in c.items() if k != "enabled" and k in ours}
                for c in (theirs, ours)]  # fmt: skip
        gaps += differing_keys(flat)
    return gaps


def load_run(run_dir: str | Path, experiment: str | None = None) -> dict:
    """Config, metric rows and rank snapshots of one run, with a clear error if missing;
    with ``experiment``, a run of another experiment (its ``config.json`` says) is refused."""
    d = Path(run_dir)
    for name in ("config.json", "metrics.jsonl"):
        if not (d / name).is_file():
            raise MissingFileError(f"{d / name} not found: is {d} a run dir written by training?")
    try:
        rows = read_metrics(d / "metrics.jsonl")
    except ValueError as e:  # bytes that are not UTF-8 text
        raise DataError(f"{d / 'metrics.jsonl'}: unreadable ({e})") from None
    ranks = read_run_json(d / "ranks.json", dict) if (d / "ranks.json").is_file() else {}
    config = read_run_json(d / "config.json", dict)
    if experiment is not None:
        _check_experiment(d, config, experiment)
    return {"dir": d, "config": config, "rows": rows, "ranks": ranks}


def _check_experiment(d: Path, config: dict, experiment: str) -> None:
    """Refuse a run whose ``config.json`` names another experiment (one saved before the
    field existed names none and is taken)."""
    ran = config.get("experiment")
    if ran is not None and ran != experiment:
        raise DataError(f"{d} is a run of experiments.{ran}, not of experiments.{experiment}")


def read_run_json(path: Path, kind: type) -> Any:
    """A run dir's JSON file (``config.json``, ``ranks.json``, ``host.json``), or a
    :class:`DataError` naming it: a truncated or damaged file is one line, not a
    traceback."""
    try:
        data = json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8 text
        raise DataError(f"{path}: damaged ({e}); is the run dir whole?") from None
    if not isinstance(data, kind):
        raise DataError(f"{path}: holds a {type(data).__name__}, not a {kind.__name__}")
    return data


def check_smoke_pair(
    dirs: dict[str, Path], experiment: str, may_differ: Iterable[str] = ()
) -> None:
    """Refuse smoke run dirs that are not what their names say: ``dirs["CoMERA"]`` and
    ``dirs["dense"]`` must be runs of ``experiment`` with CoMERA on and off (a CoMERA run
    copied into the dense slot was reported as a compressed "dense" baseline), of one
    setup (:func:`pair_setup`; but the keys in ``may_differ``, each run's own)."""
    configs = {}
    for kind, d in dirs.items():
        config = configs[kind] = read_run_json(Path(d) / "config.json", dict)
        _check_experiment(d, config, experiment)
        if bool(config.get("dense")) != (kind == "dense"):
            what = "a dense" if config.get("dense") else "a CoMERA"
            raise DataError(
                f"{d} holds {what} run, but the report reads it as the {kind} run; train the "
                f"{kind} run there (or move the run dirs)"
            )
    a, b = (pair_setup(configs[k]) for k in ("CoMERA", "dense"))
    gaps = [f"{k} ({a.get(k)!r} against {b.get(k)!r})" for k in differing_keys([a, b], may_differ)]
    if gaps:  # a dense run of other data, length or model was set beside CoMERA's unsaid
        raise DataError(
            f"{dirs['CoMERA']} and {dirs['dense']} were trained on other setups: "
            f"{', '.join(gaps[:4])}{' ...' if len(gaps) > 4 else ''}; the report compares runs "
            "of one setup: train both with the same flags (the dense one adds --dense)"
        )


def with_defaults(config: dict) -> dict:
    """A run's ``config.json`` with every setting its experiment's config holds, a setting
    added since the run was saved at its default (what a resume of it takes: CodeBERT's
    ``data.num_shards``), so setups compare as the runs trained; as it is where its
    experiment is unknown or it does not load (the checks then read what is there)."""
    name = config.get("experiment")
    if not isinstance(name, str) or not name.isidentifier():
        return config
    try:  # as experiments.ablate and the benchmarks find an experiment by its name
        config_type = importlib.import_module(f"experiments.{name}").EXPERIMENT.config_type
        filled = _filled(config_type, config)
    except (ImportError, AttributeError, TypeError, NameError):  # not loadable: as it is
        return config
    return json.loads(json.dumps(filled, default=config_jsonable))


def _filled(cls: type, data: dict) -> dict:
    """``data`` with each field of dataclass ``cls`` it lacks at its default, nested
    dataclass sections filled the same way."""
    out = dict(data)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name not in out:
            if f.default is not dataclasses.MISSING:
                out[f.name] = f.default
            elif f.default_factory is not dataclasses.MISSING:
                out[f.name] = f.default_factory()
        elif isinstance(out[f.name], dict) and dataclasses.is_dataclass(hints.get(f.name)):
            out[f.name] = _filled(hints[f.name], out[f.name])
    return out


def run_setup(config: dict) -> dict[str, Any]:
    """What runs a report sets side by side are taken to share: the data section (but
    where its cache lives) as the run last resumed with it, the batch size, the number of
    steps and the seed (MNLI's report names those that differ); settings added since a
    run was saved at their defaults (:func:`with_defaults`)."""
    return _setup_of(with_defaults(config))


def _setup_of(config: dict) -> dict[str, Any]:
    """:func:`run_setup` of a config already filled by :func:`with_defaults`."""
    data = config.get("data") if isinstance(config.get("data"), dict) else {}
    train = config.get("train") if isinstance(config.get("train"), dict) else {}
    out = {f"data.{k}": v for k, v in data.items() if k != "cache_dir"}
    out |= {k: v for k, v in kept_settings(config).items() if k in out}
    return out | {"batch_size": config.get("batch_size"), "train.steps": train.get("steps"),
                  "train.seed": train.get("seed")}  # fmt: skip


def pair_setup(config: dict) -> dict[str, Any]:
    """What a smoke report's CoMERA and dense runs must share: :func:`run_setup`, the model
    section as the run last resumed with it (but how a run executes, which may change on
    resume: recompute, grouped halves) and the size of its dense architecture
    (``dense_params``): a dense run of other widths, or of another saved model, was set
    beside CoMERA's as "the same architecture"."""
    config = with_defaults(config)
    model = config.get("model") if isinstance(config.get("model"), dict) else {}
    out = {f"model.{k}": v for k, v in model.items() if f"model.{k}" not in RESUME_MUTABLE}
    out |= {k: v for k, v in kept_settings(config).items() if k in out}  # (a moved model)
    return _setup_of(config) | out | {"dense_params": config.get("dense_params")}


def resumes(record: dict) -> list:
    """A run record's list of resumes (a hand-edited one that is not a list: none)."""
    found = record.get("resumes", [])
    return found if isinstance(found, list) else []


def kept_settings(record: dict) -> dict[str, Any]:
    """The settings the run's last resume ran with (``--mix``, a moved data path: each
    resume records the experiment's own mutable ones), in force until changed again; none
    past a restart from step 0, whose config ``config.json`` holds itself."""
    for entry in reversed(resumes(record)):
        if not isinstance(entry, dict) or entry.get("restarted"):
            return {}
        kept = entry.get("settings")
        if isinstance(kept, dict):
            return kept
    return {}


def check_evaluated(rows: dict[Path, list[dict]], key: str, how: str) -> None:
    """Refuse a run whose metrics hold no row with ``key`` (it never evaluated, ``how``
    says what makes it): the report compares its runs' evaluations."""
    for d, run_rows in rows.items():
        if not any(key in r for r in run_rows):
            raise DataError(f"{d} holds no evaluation ({key}); the report compares the runs' "
                            f"evaluations: train it with {how}")  # fmt: skip
        # a finished run evaluates at its last step: without that row (a metrics file cut
        # short from outside) an earlier evaluation was shown as the final one
        last = max((r["step"] for r in run_rows if "loss" in r and "step" in r), default=None)
        evaluated = max((r["step"] for r in run_rows if key in r and "step" in r), default=None)
        if last is not None and evaluated is not None and evaluated < last:
            raise DataError(
                f"{d / 'metrics.jsonl'} holds no evaluation of the run's last step {last} "
                f"(its last is at step {evaluated}: the file was cut short, or that "
                f"evaluation failed); delete {d} to have the run trained again, or restore "
                "the file"
            )


def step_times(rows: list[dict]) -> list[float]:
    """The ``step_time_s`` of a run's training rows, but those of steps that timed ``auto``
    plans' candidates (``plans_timed``): their time is not a training step's."""
    return [r["step_time_s"] for r in rows if "step_time_s" in r and not r.get("plans_timed")]


def series(rows: list[dict], key: str) -> list[list[float]]:
    """``[[step, value], ...]`` of the rows that hold ``key``: a curve for the JSON."""
    return [[r["step"], r[key]] for r in rows if key in r and "step" in r]


def rank_table(snapshots: dict) -> list[str]:
    """Markdown: each layer's live ranks at the snapshots of ``ranks.json`` (``init``,
    ``end_of_early``, ``end``, those present), with the live parameter count."""
    labels = [k for k in ("init", "end_of_early", "end") if k in snapshots]
    if not labels:
        return []
    lines = [
        "| layer | "
        + " | ".join(f"ranks at {k} (step {snapshots[k]['step']})" for k in labels)
        + " |",
        "|---|" + "---|" * len(labels),
    ]
    for layer in snapshots[labels[0]]["ranks"]:
        cells = [",".join(map(str, snapshots[k]["ranks"].get(layer, []))) for k in labels]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines.append(
        "| **live params** | "
        + " | ".join(f"{snapshots[k]['live_params']:,}" for k in labels)
        + " |"
    )
    end = snapshots.get("end", {})
    if "size_target" in end:  # the late stage's target, and how it was met
        lines += [
            "",
            f"Late-stage size target: {end['size_target']:,} live parameters (from "
            f"{end['early_params']:,} at the early stage's end); at the end "
            f"{end['live_params']:,}, {end['live_over_target']:.3f}x the target."
            + (
                f" Not the size asked for: {end['target_held_because']}."
                if "target_held_because" in end
                else ""
            )
            + (
                f" Above it because: {end['above_target_because']}."
                if "above_target_because" in end
                else ""
            ),
        ]
    return lines


def layer_summary(run: dict) -> list[dict]:
    """Per-layer sizes of the run's final model, read from its newest checkpoint (one dict
    per TT/TTM layer and dense tensor, :func:`comera.accounting.summarize`'s fields);
    ``[]`` for a dense run or a run without a checkpoint."""
    if run["config"].get("dense") or not complete_checkpoints(run["dir"]):
        return []
    from comera.accounting import summarize

    ckpt = load_checkpoint(run["dir"])
    # a run that recorded its layers' own sizes (finetune's padded layers): counted at them
    shapes = {k: tuple(v) for k, v in (run["config"].get("dense_shapes") or {}).items()}
    return [
        {
            "path": r.path,
            "kind": r.kind,
            "dense_shape": list(r.dense_shape),
            "live_params": r.live_params,
            "dense_params": r.dense_params,
            "ranks": list(r.ranks),
            "live": list(r.live),
        }
        for r in summarize(ckpt["params"], ckpt["state"], dense_shapes=shapes)
    ]


def layer_table(layers: list[dict]) -> list[str]:
    """Markdown of :func:`layer_summary`'s rows: the TT/TTM layers, then a total that
    includes the dense tensors."""
    if not layers:
        return []
    lines = [
        "| layer | kind | dense shape | ranks (live/stored) | params (live) | dense params "
        "| compression |",
        "|---|---|---|---|---|---:|---:|",
    ]

    def ratio(dense: int, live: int) -> str:
        return f"{dense / live:.1f}x" if live else f"{math.inf}x"

    for r in layers:
        if r["kind"] == "dense":
            continue
        ranks = ",".join(f"{a}/{b}" for a, b in zip(r["live"], r["ranks"], strict=True)) or "-"
        lines.append(
            f"| {r['path']} | {r['kind']} | {'x'.join(map(str, r['dense_shape']))} | {ranks} | "
            f"{r['live_params']:,} | {r['dense_params']:,} | "
            f"{ratio(r['dense_params'], r['live_params'])} |"
        )
    live = sum(r["live_params"] for r in layers)
    dense = sum(r["dense_params"] for r in layers)
    lines.append(f"| **total** | | | | {live:,} | {dense:,} | {ratio(dense, live)} |")
    return lines


@contextlib.contextmanager
def staged(out_dir: Path) -> Iterator[Path]:
    """A fresh folder inside ``out_dir`` to write a report's files into; when the block
    ends without an error they replace their namesakes in ``out_dir``, else none is moved.
    A render that fails halfway (a field it cannot show, a plot that fails) so leaves the
    report as it was, not a new JSON or new plots beside the old markdown. A namesake that
    is a folder is refused before any file moves."""
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise DataError(f"{out_dir} is a file; give a folder to write the report into")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file where a parent folder should be, or no permission
        raise DataError(f"cannot make the folder {out_dir} ({e.strerror})") from None
    try:  # root passes every permission check: /proc is a folder nothing is made in
        stage = Path(tempfile.mkdtemp(prefix=".report-", dir=out_dir))
    except OSError as e:
        raise DataError(f"cannot write into the folder {out_dir} ({e.strerror})") from None
    try:
        yield stage
        files = sorted(stage.iterdir())
        taken = [out_dir / f.name for f in files if (out_dir / f.name).is_dir()]
        if taken:
            raise DataError(f"{taken[0]} is a folder; the report writes a file there")
        for f in files:
            os.replace(f, out_dir / f.name)  # each file whole
    finally:
        shutil.rmtree(stage, ignore_errors=True)


def number(value: object, spec: str, missing: str = "n/a") -> str:
    """``value`` formatted by ``spec``, or ``missing`` where the JSON holds null (a metric
    that was NaN: an AUC over one class, an accuracy over no examples)."""
    return missing if value is None else format(value, spec)


def write_report_json(path: Path, data: dict) -> dict:
    """Write a report's data (written first, renamed into place): nested objects one key a
    line, curves and other lists of numbers on one line each; non-finite numbers as null.
    Returns the data as read back, what the report is then rendered from (so that a
    re-render from the file gives the same report)."""
    text = _dumps(data) + "\n"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return json.loads(text)


def _load_json(path: Path, flag: str, what: str) -> object:
    """``path`` parsed, or a :class:`DataError` naming ``flag`` and ``what`` it should be."""
    if not path.is_file():
        raise MissingFileError(f"{flag} {path}: no such file; give {what}")
    try:
        return json.loads(path.read_text())
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8 text
        raise DataError(f"{flag} {path}: not JSON ({e})") from None


def read_bench_json(path: Path, flag: str = "--bench-json") -> dict:
    """A benchmark's ``--json`` figures (``flag`` names where they came from), or a
    :class:`DataError`."""
    data = _load_json(path, flag, "a benchmark's JSON")
    if not isinstance(data, dict):
        raise DataError(f"{flag} {path}: not a benchmark's JSON object")
    return data


def check_step_bench(bench: dict, where: str, name: str, section: Callable[[dict], object],
                     fix: str) -> dict:  # fmt: skip
    """``bench`` (``python -m benchmarks.<name>_step --json``'s figures, from ``where``) if
    a report can show it: not a ``--tiny`` run's (a toy model's figures; ``fix`` says what
    to give instead), and one ``section`` (the report's renderer of it) can render; else a
    :class:`DataError`, raised before any run trains or any report file is written."""
    if bench.get("tiny"):
        raise DataError(f"{where}: a --tiny run's figures (a toy model); {fix}")
    try:
        section(bench)
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise DataError(
            f"{where}: not python -m benchmarks.{name}_step's JSON (it lacks {e})"
        ) from None
    return bench


def read_report_json(path: Path, flag: str, prog: str | None = None) -> dict:
    """A report's JSON (:func:`write_report_json`), or a :class:`DataError` naming ``flag``;
    with ``prog`` (``python -m experiments.mnli.report``), one that another report's
    command wrote is refused too (its ``meta.command`` names that command)."""
    data = _load_json(path, flag, "a report's JSON")
    if not isinstance(data, dict) or "meta" not in data:
        raise DataError(f"{flag} {path}: not a report's JSON (no 'meta' key)")
    command = data["meta"].get("command") if isinstance(data["meta"], dict) else None
    ours = isinstance(command, str) and command.startswith("python -m experiments.")
    if prog and ours and command.split(" ")[:3] != prog.split(" ")[:3]:  # type: ignore[union-attr]
        other = " ".join(command.split(" ")[:3])
        raise DataError(f"{flag} {path}: that is the JSON of {other}, not of {prog}")
    return data


def render_report_json(render: Callable[[], object], path: Path, flag: str, prog: str) -> object:
    """``render()`` of a report's JSON read from ``path``; a field missing or of another
    shape (a JSON this report did not write) is a :class:`DataError`, not a traceback."""
    try:
        return render()
    except (KeyError, TypeError, AttributeError, IndexError, ValueError, ArithmeticError) as e:
        if isinstance(e, UserError):  # already says what is wrong
            raise
        raise DataError(
            f"{flag} {path}: not a JSON of {prog} ({type(e).__name__}: {e}); give the one it wrote"
        ) from None


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, str | int | float | bool)


def _dumps(value: object, depth: int = 0) -> str:
    pad, end = " " * (depth + 1), " " * depth
    if isinstance(value, dict) and value:
        items = [f"{pad}{json.dumps(str(k))}: {_dumps(v, depth + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + end + "}"
    if isinstance(value, list | tuple):
        flat = all(
            _scalar(v) or (isinstance(v, list | tuple) and all(map(_scalar, v))) for v in value
        )
        if not flat:
            return "[\n" + ",\n".join(pad + _dumps(v, depth + 1) for v in value) + "\n" + end + "]"
        return "[" + ", ".join(_dumps(v, depth + 1) for v in value) + "]"
    if isinstance(value, float) and not math.isfinite(value):
        return "null"
    return json.dumps(value)


if __name__ == "__main__":
    import runpy

    from experiments.moved import notice

    notice("experiments.report", "experiments.mnli.report")  # as every other forward says it
    runpy.run_module("experiments.mnli.report", run_name="__main__", alter_sys=True)
