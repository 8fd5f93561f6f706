"""The fine-tuning report: the smoke preset's CoMERA and dense runs side by side.

    python -m experiments.finetune.report                        # trains both unless done
    python -m experiments.finetune.report --from-json reports/finetune.json   # re-render

Gathers ``runs/finetune-smoke`` and ``runs/finetune-smoke-dense`` into
``reports/finetune.json`` (final held-out accuracy and loss, best accuracy, parameters and
compression, curves, the tensorized layers) and renders ``reports/finetune.md`` and
``reports/finetune_curves.png`` from that JSON alone.
"""

from __future__ import annotations

from pathlib import Path

from experiments.finetune.experiment import EXPERIMENT
from experiments.finetune.experiment import main as exp_main
from experiments.host import report_header
from experiments.report import (
    check_evaluated,
    check_smoke_pair,
    load_run,
    number,
    rank_table,
    runs_host,
    series,
    smoke_dirs,
    smoke_report_main,
    staged,
    step_times,
    write_report_json,
)

__all__ = ["gather", "main", "render", "write_report"]

ACC = "eval/validation/accuracy"


def _summary(run: dict) -> dict:
    rows = run["rows"]
    evals = [r for r in rows if ACC in r]
    trained = [r for r in rows if "live_params" in r and "step_time_s" in r]
    best = max(evals, key=lambda r: r[ACC]) if evals else {}
    times = sorted(step_times(trained))
    return {
        "final_accuracy": evals[-1][ACC] if evals else None,
        "final_loss": evals[-1].get("eval/validation/loss") if evals else None,
        "best_accuracy": best.get(ACC),
        "best_step": best.get("step"),
        "live_params": trained[-1]["live_params"] if trained else None,
        "compression": trained[-1].get("compression") if trained else None,
        "median_step_s": times[len(times) // 2] if times else None,
        "steps": trained[-1]["step"] if trained else 0,
    }


def gather(runs_dir: Path, command: str) -> dict:
    """The report's data from the two smoke run dirs."""
    dirs = smoke_dirs(runs_dir, "finetune")
    check_smoke_pair(dirs, "finetune")
    runs = {name: load_run(d) for name, d in dirs.items()}
    # local data evaluated under other split names: every cell was "-", exit 0
    check_evaluated({d: runs[k]["rows"] for k, d in dirs.items()}, ACC,
                    "train.eval_every and an evaluation split named validation (the "
                    "generated task's; --eval-file validation=FILE)")  # fmt: skip
    config = runs["CoMERA"]["config"]
    return {
        "meta": {**runs_host(dirs.values()), "command": command},
        "model": config["model"],
        "data": config["data"],
        "dense_params": config["dense_params"],
        "tensorized": config["tensorized"],
        "runs": {name: _summary(r) for name, r in runs.items()},
        "ranks": runs["CoMERA"]["ranks"],
        "curves": {
            name: {
                "accuracy": series(r["rows"], ACC),
                "live_params": series(r["rows"], "live_params"),
            }
            for name, r in runs.items()
        },  # fmt: skip
    }


def _plot(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, c in data["curves"].items():
        if c["accuracy"]:
            a.plot(*zip(*c["accuracy"], strict=True), label=name)
        if c["live_params"]:
            b.plot(*zip(*c["live_params"], strict=True), label=name)
    a.set(xlabel="step", ylabel="held-out accuracy", title="accuracy")
    b.set(xlabel="step", ylabel="parameters", title="live parameters", yscale="log")
    for ax in (a, b):
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "finetune_curves.png", dpi=110)
    plt.close(fig)


def _task(data: dict) -> str:
    """The runs' data in words: the generated task, local files or a hub dataset (a JSON
    from before the data was kept: the generated task, all the report then took)."""
    d = data.get("data") or {"dataset": "generated"}
    if d.get("train_file"):
        return f"local files (train `{d['train_file']}`)"
    if d.get("dataset") != "generated":
        return f"`{d.get('dataset')}` ({d.get('dataset_config')})"
    return "the generated NLI task"


def render(data: dict, out: Path) -> str:
    """``finetune.md`` and the curves from the JSON alone; returns the markdown."""
    m = data["model"]
    meta = data["meta"]
    lines = report_header("Fine-tuning a Hugging Face classifier with CoMERA", meta["command"],
                          meta)  # fmt: skip
    source = m["path"] or (f"a {m['layers']}-layer BERT ({m['hidden']} wide, FFN {m['ffn']}) "
                           "built from a config")  # fmt: skip
    lines += [
        f"`python -m experiments.finetune --preset smoke` on {_task(data)}: {source}, "
        f"its modules matching {', '.join(m['target'])} tensorized (init {m['init']}: "
        "TT-SVD of a loaded model, a random draw for one built from a config) at rank "
        f"{m['rank']} (embeddings {m['embedding_rank']}), then "
        "fine-tuned with rank adaptation; dense: the same model as built. Compression is "
        f"against the dense model's {data['dense_params']:,} parameters.",
        "",
        "| run | accuracy at end | best accuracy (step) | loss at end | parameters | "
        "compression | median step (s) |",
        "|---|---|---|---|---|---|---|",
    ]

    def na(value: object, spec: str) -> str:  # a figure a run did not log: "-"
        return number(value, spec, "-")

    for name, r in data["runs"].items():
        lines.append(
            f"| {name} | {na(r['final_accuracy'], '.4f')} | {na(r['best_accuracy'], '.4f')} "
            f"({r['best_step']}) | {na(r['final_loss'], '.4f')} | "
            f"{na(r['live_params'], ',')} | {na(r['compression'], '.1f')}x | "
            f"{na(r['median_step_s'], '.4f')} |"
        )
    lines += ["", "![curves](finetune_curves.png)", ""]
    if data["ranks"]:
        lines += ["## Live ranks (CoMERA)", "", *rank_table(data["ranks"]), ""]
    lines += ["## Tensorized layers at the start", "",
              "| layer | kind | modes | ranks | params (dense -> TT) | note |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    for t in data["tensorized"]:
        before, after = t["params"]
        lines.append(f"| {t['layer']} | {t['kind']} | {t['modes'] or '-'} | "
                     f"{','.join(map(str, t['ranks'])) or '-'} | {before:,} -> {after:,} | "
                     f"{t['note'] or ''} |")  # fmt: skip
    text = "\n".join(lines) + "\n"
    _plot(data, out)
    (out / "finetune.md").write_text(text)
    return text


def write_report(
    runs_dir: Path, out_dir: Path, bench: dict | None, command: str | None = None
) -> str:
    """Gather the smoke runs into ``finetune.json``, then render from it."""
    data = gather(runs_dir, command or "python -m experiments.finetune.report")
    with staged(out_dir) as stage:  # all of it, or none if the render fails
        return render(write_report_json(stage / "finetune.json", data), stage)


def main(argv: list[str] | None = None) -> int:
    """``python -m experiments.finetune.report``."""
    return smoke_report_main("finetune", exp_main, write_report, argv, __doc__.split("\n")[0],
                             render=render, experiment=EXPERIMENT)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
