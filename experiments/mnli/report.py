"""Turn MNLI run dirs (and the step benchmark) into ``reports/mnli.md``, its JSON and plots.

    python -m experiments.mnli.report runs/mnli-smoke runs/mnli-smoke-dense
    python -m experiments.mnli.report --from-json reports/mnli.json   # re-render only

Each run dir holds ``config.json``, ``metrics.jsonl`` and, for CoMERA runs, ``ranks.json``
(written by :class:`comera.train.Trainer`). ``reports/mnli_bench.json`` (from
``python -m benchmarks.mnli_step --json``) is added when it sits beside the report.
Everything shown is gathered first into ``reports/mnli.json`` and rendered from it; the
paper's figures are quoted next to the measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from comera.errors import ConfigError, DataError, UserError
from experiments.host import report_header
from experiments.malloc import lean_without_hugepages
from experiments.report import (
    REPORTS,
    check_step_bench,
    differing_keys,
    layer_summary,
    layer_table,
    load_run,
    md_cell,
    number,
    rank_table,
    read_bench_json,
    read_report_json,
    render_report_json,
    run_setup,
    runs_host,
    series,
    staged,
    train_and_eval_rows,
    write_report_json,
)

__all__ = ["PAPER", "gather", "main", "render", "write_report"]

PROG = "python -m experiments.mnli.report"
TITLE = "MNLI: six-encoder transformer, CoMERA vs dense"
PAPER = {
    "source": "Yang et al., CoMERA, NeurIPS 2024 (arXiv 2405.14377)",
    "model_mb": "256 -> 3.2 MB",
    "compression": "~80x whole model (43x early stage; up to 361x for some layers)",
    "epoch_speed": "2-3x faster per epoch than dense",
    "memory_b1": "9x less memory than GaLore at batch 1 (RTX 3090)",
}


def epoch_seconds(cfg: dict, steps_per_s: float) -> float | None:
    """Seconds per epoch of the training examples at ``steps_per_s`` optimizer steps, each
    of ``accum_steps`` micro-batches of ``batch_size`` examples (None: no speed logged)."""
    per_step = max(cfg.get("batch_size", 1), 1) * max(cfg.get("train", {}).get("accum_steps", 1), 1)
    return (cfg.get("train_examples", 0) // per_step) / steps_per_s if steps_per_s else None


def _adapts(cfg: dict) -> bool:
    """Whether a TT run adapted its ranks (``train.comera.enabled``, true unless set off)."""
    train = cfg.get("train")
    comera = train.get("comera") if isinstance(train, dict) else None
    return not isinstance(comera, dict) or comera.get("enabled", True) is not False


def _kind(cfg: dict) -> str:
    """What a run trained: the dense model (under GaLore-AdamW, the paper's baseline, when
    ``train.optimizer`` says so), CoMERA, or, with ``train.comera.enabled=false`` alone, the
    TT model at its initial ranks (cli.md)."""
    if cfg.get("dense"):
        train = cfg.get("train")
        galore = isinstance(train, dict) and train.get("optimizer") == "galore"
        return "dense, GaLore" if galore else "dense"
    return "CoMERA" if _adapts(cfg) else "TT, fixed ranks"


def _summary(run: dict) -> dict:
    """One run's figures and curves, as the report's JSON holds them."""
    cfg, rows = run["config"], run["rows"]
    train, evals = train_and_eval_rows(rows)
    last_eval = evals[-1] if evals else {}
    if not train:  # killed before its first log row, or restarted and killed again
        raise DataError(f"{run['dir']}: metrics.jsonl holds no training row yet")
    last = train[-1]
    acc_keys = sorted({k for r in evals for k in r if k.endswith("accuracy")})
    rank_keys = sorted({k for r in train for k in r if k.startswith("ranks/")})
    dense = bool(cfg.get("dense"))
    setup = run_setup(cfg)
    return {
        "name": run["dir"].name,
        "kind": _kind(cfg),
        "preset": str(cfg.get("preset")),
        # the data the run last resumed with (a moved file): the setup's data keys
        "data_source": _data_source(setup),
        "setup": setup,  # what rows set side by side are assumed to share
        "steps": last["step"],
        "planned_steps": cfg.get("train", {}).get("steps"),
        "final_loss": last["loss"],
        "eval_step": last_eval.get("step"),
        "accuracy": {k[5:]: v for k, v in last_eval.items() if k.endswith("accuracy")},
        "live_params": last["live_params"],
        "model_mb": last["live_params"] * 4 / 2**20,
        "compression": cfg.get("dense_params", last["live_params"]) / last["live_params"],
        "epoch_s": epoch_seconds(cfg, last["steps_per_s"]),
        "peak_mb": last["peak_memory_mb"],
        "early_end": run["ranks"].get("end_of_early", {}).get("step"),
        "ranks": run["ranks"],
        "layers": layer_summary(run),
        "curves": {
            "loss": series(train, "loss"),
            **{k: series(evals, k) for k in acc_keys},
            **({} if dense else {"compression": series(train, "compression")}),
            **({} if dense else {k: series(train, k) for k in rank_keys}),
        },
    }


def _data_source(setup: dict) -> str:
    """Where a run's examples came from, in words (from its :func:`run_setup`)."""
    if setup.get("data.train_file"):
        return f"local files ({Path(str(setup['data.train_file'])).name}, ...)"
    if setup.get("data.dataset") == "generated":
        return "the generated task"
    return f"{setup.get('data.dataset')} ({setup.get('data.dataset_config')})"


def _cell(value: object) -> str:
    """A setting as a table cell: its JSON, a ``|`` in it escaped."""
    return "`" + json.dumps(value).replace("|", "\\|") + "`"


def _setup_gaps(runs: list[dict]) -> list[str]:
    """The setup keys (data, batch, steps, seed) on which the runs differ; none for runs
    gathered before setups were recorded."""
    setups = [r.get("setup") for r in runs]
    if len(runs) < 2 or any(not isinstance(s, dict) for s in setups):
        return []
    return differing_keys(setups)


def gather(run_dirs: list[str], bench: dict | None, command: str) -> dict:
    """The report's data: the host that made the runs, each run's summary and curves, the
    paper's figures and the step benchmark's JSON (``None`` when absent)."""
    seen = [Path(d).resolve() for d in run_dirs]
    twice = next((d for i, d in enumerate(seen) if d in seen[:i]), None)
    if twice is not None:  # its rows and rank sections twice
        raise ConfigError(f"run dir {twice} is given twice; give each run once")
    runs = [load_run(d, "mnli") for d in run_dirs]
    summaries = []
    for r in runs:
        try:
            summaries.append(_summary(r))
        except (KeyError, TypeError, AttributeError, ValueError, ArithmeticError) as e:
            if isinstance(e, UserError):
                raise
            raise DataError(
                f"{r['dir']}: its metrics.jsonl or config.json lack what the report reads "
                f"({type(e).__name__}: {e}); is it a run of experiments.mnli?"
            ) from None
    names = [s["name"] for s in summaries]
    for s, r in zip(summaries, runs, strict=True):
        if names.count(s["name"]) > 1:  # runs/A and runs2/A: two rows of one name
            where = Path(r["dir"]).resolve()
            s["name"] = f"{where.parent.name}/{where.name}"
    named = [s["name"] for s in summaries]
    for s, r in zip(summaries, runs, strict=True):
        if named.count(s["name"]) > 1:  # x/y/A and z/y/A: the whole path
            s["name"] = str(Path(r["dir"]).resolve())
    return {
        "meta": {"command": command, **runs_host(r["dir"] for r in runs)},
        "paper": PAPER,
        "runs": summaries,
        "bench": bench,
    }


def render(data: dict, out_dir: Path, name: str = "mnli.md") -> str:
    """Write ``OUT_DIR/NAME`` and its plots from the report's JSON; returns the markdown."""
    lines = report_header(TITLE, data["meta"].get("command", PROG), data["meta"])
    runs = data["runs"]
    if runs:
        presets = sorted({r["preset"] for r in runs})
        sources = sorted({r["data_source"] for r in runs if "data_source" in r})
        # runs gathered before their data was recorded: the smoke preset's, as said then
        said = f"; data: {'; '.join(sources)}." if sources else " on the generated task."
        lines += [f"Runs: {', '.join(presets)}. Smoke runs use a tiny model{said}", ""]
        gaps = _setup_gaps(runs)
        if gaps:  # rows of other data, steps or seeds: said, with each run's values
            shown = gaps[:6]
            lines += [
                "These runs were trained on different setups, so their rows are not a "
                f"like-for-like comparison; they differ in {', '.join(gaps)}:",
                "",
                "| run | " + " | ".join(shown) + " |",
                "|---|" + "---|" * len(shown),
                *(
                    f"| {md_cell(r['name'])} | "
                    + " | ".join(_cell(r["setup"].get(k)) for k in shown)
                    + " |"
                    for r in runs
                ),  # fmt: skip
                "",
            ]
        lines += [
            "| run | kind | steps | final loss | eval accuracy | live params | model MB (fp32) | "
            "compression vs dense | s / epoch | process peak MB |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for s in runs:
            acc = ", ".join(f"{k} {number(v, '.3f')}" for k, v in s["accuracy"].items()) or "-"
            at = s.get("eval_step")  # an evaluation older than the last step says when
            if s["accuracy"] and at is not None and at != s["steps"]:
                acc += f" (at step {at})"
            epoch = "-" if s["epoch_s"] is None else f"{s['epoch_s']:.1f}"
            of = s.get("planned_steps")  # a run that stopped early says so
            steps = f"{s['steps']} of {of}" if of is not None and s["steps"] < of else s["steps"]
            lines.append(
                f"| {md_cell(s['name'])} | {s['kind']} | {steps} | "
                f"{number(s['final_loss'], '.3f')} | "
                f"{acc} | "
                f"{s['live_params']:,} | {s['model_mb']:.2f} | {s['compression']:.1f}x | "
                f"{epoch} | {s['peak_mb']:.0f} |"
            )
        lines += ["", "Process peak: the run's whole process (CPU: its peak RSS, interpreter and "
                  "torch included; CUDA: the allocator's peak), not above a baseline as the "
                  "step benchmark's are."]  # fmt: skip
        paper = data["paper"]
        figures = "; ".join(v for k, v in paper.items() if k != "source")
        lines += ["", f"Paper ({paper['source']}; full MNLI, GPU): {figures}."]
        for s in runs:
            table = rank_table(s["ranks"])
            if table:
                lines += ["", f"## Per-layer ranks: {s['name']}", "", *table]
            layers = layer_table(s["layers"])
            if layers:
                lines += [
                    "",
                    f"## Per-layer compression at the end: {s['name']}",
                    "",
                    "TT/TTM layers (an embedding counted at its padded vocabulary); the total "
                    "includes the dense tensors (norms, positions, classifier). A layer "
                    "pruned to rank 0 is the zero map (its residual path carries the signal).",
                    "",
                    *layers,
                ]
    bench = _bench_section(data["bench"])  # starts with a blank line; before any plot
    if runs:
        plots = _plots(runs, out_dir, Path(name).stem)
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += bench[1:] if lines[-1] == "" else bench
    text = "\n".join(lines) + "\n"
    (out_dir / name).write_text(text)  # a staged folder's (see write_report)
    return text


def _plots(runs: list[dict], out_dir: Path, stem: str = "mnli") -> list[str]:
    """``<stem>_curves.png`` and (with a CoMERA run) ``<stem>_ranks.png``: named after the
    report, so a second report in one folder does not redraw the first one's plots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for s in runs:
        curves = s["curves"]
        if curves["loss"]:
            axes[0].plot(*zip(*curves["loss"], strict=True), label=f"{s['kind']} ({s['name']})")
        for key in sorted(k for k in curves if k.startswith("eval/") and k.endswith("accuracy")):
            if curves[key]:
                pts = curves[key]
                axes[1].plot(*zip(*pts, strict=True), marker="o", label=f"{s['kind']} {key[5:]}")
    axes[1].axhline(1 / 3, color="grey", ls=":", lw=1, label="chance")
    axes[0].set(xlabel="step", ylabel="training loss", title="Loss")
    axes[1].set(xlabel="step", ylabel="accuracy", title="Evaluation accuracy", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / f"{stem}_curves.png", dpi=110)
    plt.close(fig)
    names.append(f"{stem}_curves.png")

    comera = [s for s in runs if s["kind"] == "CoMERA"]
    if comera:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for s in comera:
            curves = s["curves"]
            if curves.get("compression"):
                axes[0].plot(*zip(*curves["compression"], strict=True), label=s["name"])
            for key in sorted(k for k in curves if k.startswith("ranks/")):
                if curves[key]:
                    axes[1].plot(*zip(*curves[key], strict=True), lw=1, label=key[6:])
            for ax in axes:
                if s["early_end"]:
                    ax.axvline(s["early_end"], color="grey", ls="--", lw=1)
        axes[0].set(xlabel="step", ylabel="dense params / live params", title="Compression")
        axes[1].set(xlabel="step", ylabel="sum of live ranks", title="Live ranks per layer")
        axes[0].legend(fontsize=8)
        axes[1].legend(fontsize=6, ncol=2)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / f"{stem}_ranks.png", dpi=110)
        plt.close(fig)
        names.append(f"{stem}_ranks.png")
    return names


def _bench_section(b: dict | None) -> list[str]:
    """The step benchmark's table and ratios, beside the paper's figures where it has one."""
    if b is None:
        return [
            "",
            "No step benchmark yet: `python -m benchmarks.mnli_step --json` writes "
            "`mnli_bench.json` into reports/, which this report reads from beside it.",
        ]
    lines = [
        "",
        f"## One training step, paper-size model ({b['device']}, {b['threads']} threads"
        f"{' of ' + b['cpu'] if b.get('cpu') and b['device'] == 'cpu' else ''}, "
        f"median of {b['repeats']}, measured {b['date']})",
        "",
        f"Peak memory: {b['peak_memory']}; each variant in a fresh process.",
        "",
        "| variant | batch | step ms | peak MB | params |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in b["runs"]:
        policy = r.get("malloc") or "default"
        name = r["variant"] if policy == "default" else f"{r['variant']} (cpu_malloc={policy})"
        lines.append(
            f"| {name} | {r['batch']} x 128 | {r['step_s'] * 1e3:.1f} | "
            f"{r['peak_mb']:.1f} | {r['params']:,} |"
        )
    warning = lean_without_hugepages(b["runs"])
    lines += ["", warning] if warning else []
    lines += [
        "",
        f"| ratio (CoMERA / dense) | measured | paper ({PAPER['source']}) |",
        "|---|---:|---|",
        f"| step time, batch 32 | {b['step_time_ratio_vs_dense']:.3f} | "
        "2-3x faster per epoch than dense |",
        f"| step time, batch 1 | {b['step_time_ratio_vs_dense_b1']:.3f} | |",
        f"| peak memory, batch 1 | {b['peak_memory_ratio_vs_dense']:.3f} | |",
        f"| peak memory, batch 32 | {b['peak_memory_ratio_vs_dense_b32']:.3f} | |",
        f"| compression (params) | {b['compression_ratio']:.1f}x | ~80x after training |",
    ]
    if "peak_memory_ratio_vs_dense_b32_recompute" in b:  # --recompute (every encoder block)
        lines += [
            f"| peak memory, batch 32, both `--recompute` | "
            f"{b['peak_memory_ratio_vs_dense_b32_recompute']:.3f} | |",
            f"| peak memory, batch 32, CoMERA `--recompute` vs dense without | "
            f"{b['peak_memory_ratio_recompute_vs_dense_b32']:.3f} | |",
            *(
                [
                    "| the same, dense under its own command's policy (glibc as found) | "
                    f"{b['peak_memory_ratio_recompute_vs_dense_b32_each_own_policy']:.3f} | |"
                ]
                if "peak_memory_ratio_recompute_vs_dense_b32_each_own_policy" in b
                else []
            ),
            f"| step time, batch 32, both `--recompute` | "
            f"{b['step_time_ratio_vs_dense_b32_recompute']:.3f} | |",
        ]
    if "peak_memory_ratio_vs_dense_b32_recompute_glibc_default" in b:
        lines += [
            "| the same two memory ratios with the recompute runs under glibc as found | "
            f"{b['peak_memory_ratio_vs_dense_b32_recompute_glibc_default']:.3f}, "
            f"{b['peak_memory_ratio_recompute_vs_dense_b32_glibc_default']:.3f} | |",
        ]
    if "step_time_ratio_vs_galore" in b:  # the dense model under GaLore-AdamW
        lines += [
            f"| step time vs GaLore, batch 1 | {b['step_time_ratio_vs_galore']:.3f} | "
            "2-3x faster than GaLore (RTX 3090) |",
            f"| peak memory vs GaLore, batch 1 | {b['peak_memory_ratio_vs_galore']:.3f} | "
            "9x less than GaLore (RTX 3090) |",
        ]
    lines += [
        "",
        "These are at the initial ranks (30 / 32). The same step with every rank halved (15 / 16):",
        "",
        "| ratio (half ranks / dense) | measured |",
        "|---|---:|",
        f"| step time, batch 32 | {b['half_ranks']['step_time_ratio_vs_dense']:.3f} |",
        f"| peak memory, batch 1 | {b['half_ranks']['peak_memory_ratio_vs_dense']:.3f} |",
        f"| compression (params) | {b['half_ranks']['compression_ratio']:.1f}x |",
    ]
    return lines


def write_report(
    run_dirs: list[str], out: Path = REPORTS / "mnli.md", command: str | None = None
) -> Path:
    """Gather the runs (and ``mnli_bench.json`` beside ``out``) into ``out``'s JSON
    (``mnli.json``), then render the markdown and plots from it; returns the report path."""
    _check_out(out)
    bench = _bench_beside(out)
    command = command or " ".join([PROG, *map(str, run_dirs)])
    data = gather(run_dirs, bench, command)
    with staged(out.parent) as stage:  # all of it, or none if the render fails
        render(write_report_json(stage / out.with_suffix(".json").name, data), stage, out.name)
    return out


def _check_out(out: Path) -> None:
    """``--out`` must name the markdown file: its JSON is written beside it under the same
    stem (``--out X.json`` overwrote the JSON with the markdown) and a folder there would
    take neither."""
    if out.suffix != ".md":
        raise ConfigError(f"--out {out}: give the report's .md path (its JSON goes beside it)")
    if out.is_dir():
        raise ConfigError(f"--out {out} is a folder; give the report's .md path")


def _bench_beside(out: Path) -> dict | None:
    """``mnli_bench.json`` beside ``out`` (``python -m benchmarks.mnli_step --json``'s
    figures), or None; a damaged or foreign file is a :class:`DataError` before anything
    is gathered or written."""
    path = out.parent / "mnli_bench.json"
    if not path.is_file():
        return None
    return check_step_bench(
        read_bench_json(path, "mnli_bench.json"), str(path), "mnli", _bench_section,
        "it lies beside --out: replace it with a full python -m benchmarks.mnli_step --json "
        "result, or write the report elsewhere",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="*", help="run dirs (CoMERA and/or dense)")
    ap.add_argument("--out", type=Path, default=REPORTS / "mnli.md")
    ap.add_argument(
        "--from-json",
        dest="from_json",
        type=Path,
        metavar="FILE",
        help="re-render the report from its JSON (reports/mnli.json), without the run dirs",
    )
    args = ap.parse_args(argv)
    try:
        if args.from_json:
            if args.runs:
                raise ConfigError("give run dirs or --from-json FILE, not both")
            _check_out(args.out)
            data = read_report_json(args.from_json, "--from-json", PROG)
            with staged(args.out.parent) as stage:  # all of it, or none
                render_report_json(lambda: render(data, stage, args.out.name),
                                   args.from_json, "--from-json", PROG)  # fmt: skip
            path = args.out
        else:
            if not args.runs:  # a glob that matched nothing: keep the report as it is
                raise ConfigError(
                    "give at least one run dir (or --from-json FILE); nothing was written"
                )
            argv_used = sys.argv[1:] if argv is None else argv
            path = write_report(args.runs, args.out, " ".join([PROG, *argv_used]))
    except UserError as e:  # e.g. a path that is not a run dir: one line, status 2
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
