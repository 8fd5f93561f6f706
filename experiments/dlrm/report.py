"""``reports/dlrm.md``: the smoke runs (CoMERA vs dense), per-table ranks, the bench.

    python -m experiments.dlrm.report [--runs runs] [--bench-json FILE]
    python -m experiments.dlrm.report --from-json reports/dlrm.json   # re-render only

Trains the ``smoke`` preset twice (CoMERA, dense) unless the run dirs already hold
finished runs, gathers what the report shows into ``reports/dlrm.json``, then renders
the markdown and ``reports/dlrm_curves.png`` from that JSON.
"""

from __future__ import annotations

from pathlib import Path

from comera.errors import DataError
from experiments import cli
from experiments.dlrm.data import load_criteo
from experiments.dlrm.experiment import EXPERIMENT
from experiments.dlrm.generate import planted_logits
from experiments.dlrm.task import roc_auc
from experiments.host import report_header
from experiments.malloc import lean_without_hugepages, restart_for
from experiments.report import (
    check_evaluated,
    check_smoke_pair,
    load_run,
    number,
    runs_host,
    series,
    smoke_dirs,
    smoke_gaps,
    smoke_report_main,
    staged,
    write_report_json,
)

__all__ = ["PAPER", "gather", "main", "render", "write_report"]

TITLE = "DLRM on Criteo with TTM tables"
PAPER = {
    "source": "CoMERA: Yang et al., NeurIPS 2024 (arXiv 2405.14377); TT-Rec: Yin et al., "
    "MLSys 2021",
    "columns": ["", "paper (CoMERA, Criteo Kaggle, GPU)", "TT-Rec (MLSys 2021)"],
    "rows": [
        [
            "model compression",
            "99x",
            "4-221x on Kaggle (fixed-rank TT tables; 117x in its arXiv version)",
        ],
        ["peak training memory", "7x lower than dense", "-"],
        ["accuracy", "comparable to dense", "0.03-0.3% lower accuracy across that range"],
    ],
}


def _evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/val/auc" in r]


def _plot(runs: dict[str, dict], out: Path) -> None:
    """Val AUC, val NCE and live parameters per step of each run (the JSON's curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, run in runs.items():
        panels = zip(axes, ("auc", "nce", "live_params"), ("o-", "o-", "-"), strict=True)
        for ax, key, style in panels:
            if run["curves"][key]:
                ax.plot(*zip(*run["curves"][key], strict=True), style, label=name)
    for ax, title in zip(
        axes, ("val AUC", "val NCE (lower is better)", "live params"), strict=True
    ):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend()
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _run(rows: list[dict]) -> dict:
    """One run's last and best evals, its size at the end and its curves."""
    evals, train = _evals(rows), [r for r in rows if "live_params" in r]
    last, best = evals[-1], max(evals, key=lambda r: r["eval/val/auc"])
    return {
        "final": {
            "step": last["step"],
            **{k: last[f"eval/val/{k}"] for k in ("auc", "nce", "logloss", "accuracy")},
        },
        "best": {"step": best["step"], "auc": best["eval/val/auc"]},
        "live_params": int(train[-1]["live_params"]),
        "compression": train[-1]["compression"],
        "curves": {
            "auc": series(evals, "eval/val/auc"),
            "nce": series(evals, "eval/val/nce"),
            "live_params": series(train, "live_params"),
        },
    }


def gather(runs_dir: Path, out_dir: Path, bench: dict | None, command: str) -> dict:
    """The report's data from the two smoke runs (``RUNS/dlrm-smoke``, ``-smoke-dense``):
    the host that made them, the setup, each run's evals and curves, the planted logit's
    val AUC (generated data), per-table ranks, the ablation reports in ``out_dir`` and
    the bench JSON."""
    dirs = smoke_dirs(runs_dir, "dlrm")
    check_smoke_pair(dirs, "dlrm", EXPERIMENT.pair_differs)
    runs = {k: load_run(d, "dlrm") for k, d in dirs.items()}  # one line if a file is gone
    rows = {k: r["rows"] for k, r in runs.items()}
    check_evaluated({dirs[k]: r for k, r in rows.items()}, "eval/val/auc", "train.eval_every")
    config, dense_cfg = runs["CoMERA"]["config"], runs["dense"]["config"]
    if not (dirs["CoMERA"] / "ranks.json").is_file():  # a finished run writes it: damaged
        raise DataError(
            f"{dirs['CoMERA'] / 'ranks.json'} not found: the run's rank record is gone; "
            f"train it again (or restore the file)"
        )
    # where the data is now: a resume with --data of a moved file keeps it for the next
    data_cfg = cli.resumed_config(EXPERIMENT, dirs["CoMERA"]).data
    data = load_criteo(data_cfg, progress=False)
    lo, hi = data.splits["val"]
    eval_hi = hi if data_cfg.eval_rows is None else min(hi, lo + data_cfg.eval_rows)
    generated = data_cfg.path == "generated"
    planted = None
    if generated:
        logits = planted_logits(data_cfg.generated_rows)[lo:eval_hi]
        planted = roc_auc(logits, data.label[lo:eval_hi])
    m = config["model"]
    ranks = runs["CoMERA"]["ranks"]
    return {
        "meta": {"command": command, **runs_host(dirs.values())},
        "paper": PAPER,
        "setup": {
            "data": data_cfg.path,
            "rows": config["rows"],
            "train_rows": config["train_rows"],
            "val_rows": hi - lo,
            "eval_rows": eval_hi - lo,  # what the evals (and the planted AUC) read
            "bottom": m["bottom"],
            "top": m["top"],
            "emb_dim": m["emb_dim"],
            "ttm_tables": config["ttm_tables"],
            "tt_min_rows": m["tt_min_rows"],
            "emb_cores": len(m["emb_dim_modes"]),
            "emb_rank": m["emb_rank"],
            "optimizer": config["train"]["optimizer"],
            "early_steps": config["train"]["comera"]["early_steps"],
            "steps": config["train"]["steps"],
            # what is not the smoke preset's, CoMERA settings included
            "changed": smoke_gaps(config, EXPERIMENT, comera=True),
            "dense_optimizer": dense_cfg["train"]["optimizer"],
            "hot_rows": m.get("hot_rows", 0),  # each run's own: said beside its run
            "hash_rows": dense_cfg["model"].get("hash_rows", 0),
        },
        "planted_auc": planted,
        "runs": {k: _run(r) for k, r in rows.items()},
        "ranks": _rank_rows(ranks, config, _evals(rows["CoMERA"])[-1]),
        "ablations": sorted(p.name for p in Path(out_dir).glob("ablation_dlrm_*.md")),
        "bench": bench,
    }


def _changed(s: dict) -> str:
    """The settings in which the runs are not the smoke preset's (a JSON from before they
    were kept: none said)."""
    changed = s.get("changed") or []
    return f" with {', '.join(f'`{k}`' for k in changed)} changed" if changed else ""


def _early(s: dict) -> str:
    """The early stage's length, or that it took the whole run (no late stage)."""
    steps = s.get("steps")  # (a JSON from before it was kept: as configured)
    if steps is not None and s["early_steps"] >= steps:
        return f"early stage all {steps:,} steps (no late stage)"
    return f"early stage {s['early_steps']} steps"


def _hot(s: dict) -> str:
    """CoMERA's hot rows, where it had some (a JSON from before they were kept: none)."""
    k = s.get("hot_rows", 0)
    return f", plus a dense row for each table's {k:,} most frequent ids" if k else ""


def _hashed(s: dict) -> str:
    """The dense run's hashed tables, where it had them."""
    k = s.get("hash_rows", 0)
    return f", its large tables hashed into {k:,} rows each (model.hash_rows)" if k else ""


def render(data: dict, out_dir: Path) -> str:
    """Write ``OUT_DIR/dlrm.md`` and ``dlrm_curves.png`` from the report's JSON; returns
    the markdown."""
    _plot(data["runs"], out_dir / "dlrm_curves.png")
    s, paper = data["setup"], data["paper"]
    lines = report_header(TITLE, data["meta"]["command"], data["meta"])
    lines += ["## The paper and its peers", "", f"Sources: {paper['source']}.", ""]
    lines += [
        "| " + " | ".join(paper["columns"]) + " |",
        "|" + "---|" * len(paper["columns"]),
        *("| " + " | ".join(r) + " |" for r in paper["rows"]),
        "",
        "The `kaggle` preset (the reference's setting) reads the real `train.txt`; the "
        "figures below are the smoke preset on CPU and a one-step benchmark at the Kaggle "
        "table sizes.",
        "",
    ]
    generated = s["data"] == "generated"
    source = "generated Criteo-format data with planted signal" if generated else s["data"]
    planted = data["planted_auc"]
    lines += [
        f"## Ours: smoke preset{_changed(s)} (CPU, {source})",
        "",
        f"{s['rows']:,} rows ({s['train_rows']:,} train, {s['val_rows']:,} val"
        + (
            f", of which the evals read the first {s['eval_rows']:,}, data.eval_rows)"
            if s.get("eval_rows", s["val_rows"]) != s["val_rows"]
            else ")"
        )  # fmt: skip
        + ("" if planted is None else f"; the planted logit scores val AUC {planted:.3f}")
        + f". DLRM with bottom {s['bottom']}, top {s['top']}, dim {s['emb_dim']}; CoMERA: "
        f"{s['ttm_tables']} tables with >= {s['tt_min_rows']:,} rows as {s['emb_cores']}-core "
        f"TTMs at rank {s['emb_rank']}, {s['optimizer']}, {_early(s)}{_hot(s)}; dense: same "
        f"architecture, {s['dense_optimizer']}{_hashed(s)}.",
        "",
        "| run | val AUC at end | best val AUC (step) | val NCE | val log loss | "
        "val accuracy | params at end | model MB | compression |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in data["runs"].items():
        f, b = r["final"], r["best"]
        lines.append(
            f"| {name} | {number(f['auc'], '.4f')} | {number(b['auc'], '.4f')} ({b['step']}) | "
            f"{number(f['nce'], '.4f')} | {number(f['logloss'], '.4f')} | "
            f"{number(f['accuracy'], '.4f')} | {r['live_params']:,} | "
            f"{r['live_params'] * 4 / 2**20:.2f} | {r['compression']:.1f}x |"
        )
    lines += ["", "![curves](dlrm_curves.png)", ""]
    if data["ablations"]:
        links = ", ".join(f"[{a.removesuffix('.md')}]({a})" for a in data["ablations"])
        lines += [f"Ablations of this preset: {links}.", ""]
    lines += _rank_table(data["ranks"], generated)
    if data["bench"]:
        lines += _bench_section(data["bench"])
    text = "\n".join(lines) + "\n"
    (out_dir / "dlrm.md").write_text(text)
    return text


def write_report(
    runs_dir: Path, out_dir: Path, bench: dict | None, command: str | None = None
) -> str:
    """Gather the two smoke runs and the bench into ``dlrm.json``, then render
    ``dlrm.md`` and ``dlrm_curves.png`` from it; returns the markdown."""
    data = gather(runs_dir, out_dir, bench, command or "python -m experiments.dlrm.report")
    with staged(out_dir) as stage:  # all of it, or none if the render fails
        return render(write_report_json(stage / "dlrm.json", data), stage)


def _rank_rows(ranks: dict, config: dict, last_eval: dict) -> list[dict]:
    """Ranks from ``ranks.json``; each table's compression as the last eval logged it."""
    if "init" not in ranks or "end" not in ranks:
        return []
    init, end = ranks["init"]["ranks"], ranks["end"]["ranks"]
    cards = dict(
        zip([f"tables.C{i + 1}" for i in range(26)], config["cardinalities"], strict=False)
    )
    width = config["model"]["emb_dim"]
    out = []
    for layer in init:
        if layer not in cards:
            continue
        n, comp = cards[layer], last_eval[f"eval/compression/{layer.removeprefix('tables.')}"]
        out.append(
            {
                "table": layer,
                "rows": n,
                "init": init[layer],
                "end": end[layer],
                "params_end": round(n * width / comp),
                "compression": comp,
            }
        )
    return out


def _rank_table(rows: list[dict], generated: bool) -> list[str]:
    if not rows:
        return []
    out = ["## Live ranks per compressed table (smoke, CoMERA)", ""]
    out += ["Compression is against the dense table (rows x embedding dim)."]
    if generated:
        out[-1] += (
            " The planted-signal tables are C3, C4, C12, C16, C21 (C1 also carries signal "
            "but is small and stays dense)."
        )
    out += [
        "",
        "| table | rows | ranks at init | ranks at end | params at end | compression |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        out.append(
            f"| {r['table']} | {r['rows']:,} | {r['init']} | {r['end']} | "
            f"{r['params_end']:,} | {r['compression']:.0f}x |"
        )
    return [*out, ""]


def _bench_section(b: dict) -> list[str]:
    """The step benchmark's variants and ratios, beside the paper's figure where it has one."""
    v = b["variants"]
    malloc = b.get("malloc", "default")
    runs = b.get("embedding_time_ratio_batched_vs_separate_runs")
    lookup = (  # figures from before the rounds (one process) say nothing of them
        f"The lookup comparison times the embedding stage alone, forward and backward, "
        f"with the dense gradients CoMERA trains with, in {len(runs)} fresh processes "
        f"under `{malloc}`: its ratio is the median of theirs "
        f"({min(runs):.2f}-{max(runs):.2f}), and the two times are each the median of "
        "their own, so their quotient differs from it; its `_glibc_default` twin is one "
        "process under glibc as found."
        if runs
        else ""
    )
    out = [
        "## Benchmark: one training step at the Kaggle table sizes",
        "",
        f"`{b.get('command', 'python -m benchmarks.dlrm_step --json')}`: 26 tables (33.76M "
        f"rows), batch "
        f"{b['batch']:,}, {b.get('cpu', 'CPU not recorded')}, {b['threads']} threads, "
        "every variant in a fresh process"
        + (
            f" (`comera` and `dense_sgd` under `{malloc}` {b['rounds']} times each, "
            "alternating: their median step time and peak)"
            if b.get("rounds", 1) > 1
            else ""
        )
        + "; peak RSS above the pre-model baseline. CoMERA: the 10 tables of >= 10,000 rows as "
        "4-core TTMs (dim modes 2x2x2x2) at rank 32, `bottom.1` and `top.1` as TT (rank 16), "
        "AdamW, early-stage objective. "
        f"Allocator: `cpu_malloc={malloc}`, the policy DLRM trains under on CPU (its presets' "
        "default; dense and CoMERA alike): glibc returns blocks of 1 MiB and up when freed "
        "and puts those of 2 MiB and up on transparent huge pages. The `@glibc_default` rows "
        "run the same step under glibc as found (one run each). " + lookup,
        "",
        "| variant | params | compression | step time (s) | peak RSS (MB) |",
        "|---|---|---|---|---|",
    ]
    for r in v.values():
        out.append(
            f"| {r['variant']} | {r['params']:,} | {r['compression']:.1f}x | "
            f"{r['step_time_s']:.3f} | {r['peak_rss_mb']:.0f} |"
        )
    warning = lean_without_hugepages(v.values())
    out += ["", warning] if warning else []
    paper = {  # the paper's figure for a key, where it states one
        "compression_ratio": "99x",
        "peak_memory_ratio_vs_dense": "7x lower than dense (0.143)",
    }
    keys = [
        "compression_ratio",
        "peak_memory_ratio_vs_dense",
        "peak_memory_ratio_vs_dense_adam",
        "step_time_ratio_vs_dense",
        "embedding_time_ratio_batched_vs_separate",
        "peak_memory_ratio_vs_dense_glibc_default",
        "step_time_ratio_vs_dense_glibc_default",
        "embedding_time_ratio_batched_vs_separate_glibc_default",
    ]
    out += ["", "| key | measured | paper (CoMERA, GPU) |", "|---|---|---|"]
    out += [f"| `{k}` | {b[k]:.3f} | {paper.get(k, '')} |" for k in keys if k in b]
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    from experiments.dlrm.experiment import CPU_MALLOC
    from experiments.dlrm.experiment import main as exp_main

    if argv is None:  # a command: its smoke runs train in this process, as DLRM does
        restart_for(CPU_MALLOC)

    return smoke_report_main(
        "dlrm",
        exp_main,
        write_report,
        argv,
        __doc__.split("\n")[0],
        render=render,
        experiment=EXPERIMENT,
        bench_section=_bench_section,
    )


if __name__ == "__main__":
    raise SystemExit(main())
