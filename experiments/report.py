"""Turn MNLI run dirs (and the step benchmark) into ``reports/mnli.md`` and PNG plots.

    python -m experiments.report runs/mnli-smoke runs/mnli-smoke-dense

Each run dir holds ``config.json``, ``metrics.jsonl`` and, for CoMERA runs, ``ranks.json``
(written by :class:`comera.training.Trainer`). ``reports/mnli_bench.json`` (from
``python -m experiments.mnli --bench``) is added when present. Everything in the report
is read from those files; the paper's figures are quoted next to them for comparison.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from comera.train import load_checkpoint, read_metrics
from comera.train.checkpoint import complete_checkpoints
from experiments.malloc import lean_without_hugepages

REPORTS = Path(__file__).resolve().parent.parent / "reports"

PAPER = {
    "model_mb": "256 -> 3.2 MB",
    "compression": "~80x whole model (43x early stage; up to 361x for some layers)",
    "epoch_speed": "2-3x faster per epoch than dense",
    "memory_b1": "9x less memory than GaLore at batch 1 (RTX 3090)",
}


def ensure_smoke_run(exp_main: Any, run_dir: Path, *, dense: bool, label: str) -> None:
    """Train the ``smoke`` preset into ``run_dir`` (``--dense`` for the baseline), or
    finish the run already there (a no-op when it is done); exit on failure."""
    if (run_dir / "config.json").is_file():
        code = exp_main(["--resume", str(run_dir), "--no-progress"])
    else:
        argv = ["--preset", "smoke", "--run-dir", str(run_dir), "--no-progress"]
        code = exp_main([*argv, "--dense"] if dense else argv)
    if code:
        raise SystemExit(f"{label}: the run in {run_dir} failed (exit {code})")


def smoke_report_main(
    name: str, exp_main: Any, write: Any, argv: list[str] | None, description: str
) -> int:
    """The ``python -m experiments.<name>.report`` command: the smoke preset's CoMERA and
    dense runs (``RUNS/<name>-smoke``, ``-smoke-dense``), then ``write(runs, out, bench)``."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--runs", default="runs")
    ap.add_argument("--out", default="reports")
    ap.add_argument("--bench-json", dest="bench_json")
    args = ap.parse_args(argv)
    runs = Path(args.runs)
    for dense in (False, True):
        run_dir = runs / f"{name}-smoke{'-dense' if dense else ''}"
        ensure_smoke_run(exp_main, run_dir, dense=dense, label=f"{name} report")
    bench = json.loads(Path(args.bench_json).read_text()) if args.bench_json else None
    print(write(runs, Path(args.out), bench))
    return 0


def load_run(run_dir: str | Path) -> dict:
    """Config, metric rows and rank snapshots of one run, with a clear error if missing."""
    d = Path(run_dir)
    for name in ("config.json", "metrics.jsonl"):
        if not (d / name).is_file():
            raise FileNotFoundError(f"{d / name} not found: is {d} a run dir written by training?")
    rows = read_metrics(d / "metrics.jsonl")
    ranks = json.loads((d / "ranks.json").read_text()) if (d / "ranks.json").is_file() else {}
    return {
        "dir": d,
        "config": json.loads((d / "config.json").read_text()),
        "rows": rows,
        "ranks": ranks,
    }


def _summary(run: dict) -> dict:
    cfg, rows = run["config"], run["rows"]
    train = [r for r in rows if "loss" in r]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    last_eval = evals[-1] if evals else {}
    last = train[-1]
    steps_per_epoch = cfg.get("train_examples", 0) // max(cfg.get("batch_size", 1), 1)
    return {
        "name": run["dir"].name,
        "kind": "dense" if cfg.get("dense") else "CoMERA",
        "accuracy": {k[5:]: v for k, v in last_eval.items() if k.endswith("accuracy")},
        "live_params": last["live_params"],
        "model_mb": last["live_params"] * 4 / 2**20,
        "compression": cfg.get("dense_params", last["live_params"]) / last["live_params"],
        "epoch_s": steps_per_epoch / last["steps_per_s"] if last["steps_per_s"] else float("nan"),
        "peak_mb": last["peak_memory_mb"],
        "steps": last["step"],
        "final_loss": last["loss"],
    }


def rank_table(run: dict) -> list[str]:
    snaps = run["ranks"]
    labels = [k for k in ("init", "end_of_early", "end") if k in snaps]
    if not labels:
        return []
    lines = [
        "| layer | " + " | ".join(f"ranks at {k} (step {snaps[k]['step']})" for k in labels) + " |",
        "|---|" + "---|" * len(labels),
    ]
    for layer in snaps[labels[0]]["ranks"]:
        cells = [",".join(map(str, snaps[k]["ranks"].get(layer, []))) for k in labels]
        lines.append(f"| {layer} | " + " | ".join(cells) + " |")
    lines.append(
        "| **live params** | " + " | ".join(f"{snaps[k]['live_params']:,}" for k in labels) + " |"
    )
    return lines


def layer_table(run: dict) -> list[str]:
    """Per-layer compression of the final model, read from the run's checkpoint."""
    if run["config"].get("dense") or not complete_checkpoints(run["dir"]):
        return []
    import comera as C

    ckpt = load_checkpoint(run["dir"])
    return C.summary_table(ckpt["params"], ckpt["state"]).splitlines()


def _plots(runs: list[dict], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        s = _summary(run)
        train = [r for r in run["rows"] if "loss" in r]
        axes[0].plot(
            [r["step"] for r in train],
            [r["loss"] for r in train],
            label=f"{s['kind']} ({s['name']})",
        )
        evals = [
            r
            for r in run["rows"]
            if any(k.endswith("accuracy") and k.startswith("eval/") for k in r)
        ]
        for key in sorted(
            {k for r in evals for k in r if k.startswith("eval/") and k.endswith("accuracy")}
        ):
            pts = [(r["step"], r[key]) for r in evals if key in r]
            axes[1].plot(*zip(*pts, strict=True), marker="o", label=f"{s['kind']} {key[5:]}")
    axes[1].axhline(1 / 3, color="grey", ls=":", lw=1, label="chance")
    axes[0].set(xlabel="step", ylabel="training loss", title="Loss")
    axes[1].set(xlabel="step", ylabel="accuracy", title="Evaluation accuracy", ylim=(0, 1))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "mnli_curves.png", dpi=110)
    plt.close(fig)
    names.append("mnli_curves.png")

    comera = [r for r in runs if not r["config"].get("dense")]
    if comera:
        fig, axes = plt.subplots(1, 2, figsize=(11, 4))
        for run in comera:
            train = [r for r in run["rows"] if "loss" in r]
            steps = [r["step"] for r in train]
            axes[0].plot(steps, [r["compression"] for r in train], label=run["dir"].name)
            rank_keys = sorted({k for r in train for k in r if k.startswith("ranks/")})
            for key in rank_keys:
                axes[1].plot(steps, [r.get(key, 0) for r in train], lw=1, label=key[6:])
            early_end = run["ranks"].get("end_of_early", {}).get("step")
            for ax in axes:
                if early_end:
                    ax.axvline(early_end, color="grey", ls="--", lw=1)
        axes[0].set(xlabel="step", ylabel="dense params / live params", title="Compression")
        axes[1].set(xlabel="step", ylabel="sum of live ranks", title="Live ranks per layer")
        axes[0].legend(fontsize=8)
        axes[1].legend(fontsize=6, ncol=2)
        for ax in axes:
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(out_dir / "mnli_ranks.png", dpi=110)
        plt.close(fig)
        names.append("mnli_ranks.png")
    return names


def _bench_section(path: Path) -> list[str]:
    if not path.is_file():
        return ["", "No step benchmark yet: run `python -m experiments.mnli --bench`."]
    b = json.loads(path.read_text())
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
        "| ratio (CoMERA / dense) | measured | target |",
        "|---|---:|---:|",
        f"| step time, batch 32 | {b['step_time_ratio_vs_dense']:.3f} | <= 0.5 |",
        f"| step time, batch 1 | {b['step_time_ratio_vs_dense_b1']:.3f} | |",
        f"| peak memory, batch 1 | {b['peak_memory_ratio_vs_dense']:.3f} | <= 0.15 |",
        f"| peak memory, batch 32 | {b['peak_memory_ratio_vs_dense_b32']:.3f} | |",
        f"| compression (params) | {b['compression_ratio']:.1f}x | paper ~80x after training |",
    ]
    if "peak_memory_ratio_vs_dense_b32_recompute" in b:  # --recompute (every encoder block)
        lines += [
            f"| peak memory, batch 32, both `--recompute` | "
            f"{b['peak_memory_ratio_vs_dense_b32_recompute']:.3f} | <= 0.35 |",
            f"| peak memory, batch 32, CoMERA `--recompute` vs dense without | "
            f"{b['peak_memory_ratio_recompute_vs_dense_b32']:.3f} | <= 0.25 |",
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
            f"| step time vs GaLore, batch 1 | {b['step_time_ratio_vs_galore']:.3f} | <= 0.5 |",
            f"| peak memory vs GaLore, batch 1 | {b['peak_memory_ratio_vs_galore']:.3f} | "
            "<= 0.15 |",
        ]
    lines += [
        "",
        "These are at the initial ranks (30 / 32). As a stand-in for a pruned model, the same "
        "step with every rank halved (15 / 16):",
        "",
        "| ratio (half ranks / dense) | measured |",
        "|---|---:|",
        f"| step time, batch 32 | {b['half_ranks']['step_time_ratio_vs_dense']:.3f} |",
        f"| peak memory, batch 1 | {b['half_ranks']['peak_memory_ratio_vs_dense']:.3f} |",
        f"| compression (params) | {b['half_ranks']['compression_ratio']:.1f}x |",
    ]
    return lines


def write_report(run_dirs: list[str], out: Path = REPORTS / "mnli.md") -> Path:
    """Write the markdown report and plots; returns the report path."""
    runs = [load_run(d) for d in run_dirs]
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [
        "# MNLI: six-encoder transformer, CoMERA vs dense",
        "",
        "Generated by `python -m experiments.report " + " ".join(map(str, run_dirs)) + "`.",
        "",
    ]
    if runs:
        presets = sorted({str(r["config"].get("preset")) for r in runs})
        lines += [
            f"Runs: {', '.join(presets)}. Smoke runs use a tiny model on the generated task; "
            "their numbers show the mechanisms, not the paper's accuracy.",
            "",
            "| run | kind | steps | final loss | eval accuracy | live params | model MB (fp32) | "
            "compression vs dense | s / epoch | peak MB |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|",
        ]
        for run in runs:
            s = _summary(run)
            acc = ", ".join(f"{k} {v:.3f}" for k, v in s["accuracy"].items()) or "-"
            lines.append(
                f"| {s['name']} | {s['kind']} | {s['steps']} | {s['final_loss']:.3f} | {acc} | "
                f"{s['live_params']:,} | {s['model_mb']:.2f} | {s['compression']:.1f}x | "
                f"{s['epoch_s']:.1f} | {s['peak_mb']:.0f} |"
            )
        lines += ["", "Paper (full MNLI, GPU): " + "; ".join(f"{v}" for v in PAPER.values()) + "."]
        for run in runs:
            table = rank_table(run)
            if table:
                lines += ["", f"## Per-layer ranks: {run['dir'].name}", "", *table]
            layers = layer_table(run)
            if layers:
                lines += [
                    "",
                    f"## Per-layer compression at the end: {run['dir'].name}",
                    "",
                    "TT/TTM layers (an embedding counted at its padded vocabulary); the total "
                    "includes the dense tensors (norms, positions, "
                    "classifier). A layer pruned to rank 0 is the zero map (its residual path "
                    "carries the signal).",
                    "",
                    *layers,
                ]
        plots = _plots(runs, out.parent)
        lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += _bench_section(out.parent / "mnli_bench.json")
    tmp = out.with_suffix(".tmp")
    tmp.write_text("\n".join(lines) + "\n")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m experiments.report", description=__doc__.split("\n")[0]
    )
    ap.add_argument("runs", nargs="*", help="run dirs (CoMERA and/or dense)")
    ap.add_argument("--out", type=Path, default=REPORTS / "mnli.md")
    args = ap.parse_args(argv)
    try:
        path = write_report(args.runs, args.out)
    except FileNotFoundError as e:  # a path that is not a run dir: one line, status 2
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
