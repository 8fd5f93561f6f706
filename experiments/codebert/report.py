"""``reports/codebert.md``: the smoke runs (CoMERA vs dense), the mix audit, the bench.

    python -m experiments.codebert.report [--runs runs] [--bench-json reports/codebert_bench.json]
    python -m experiments.codebert.report --from-json reports/codebert.json   # re-render only

Trains the ``smoke`` preset twice (CoMERA, dense) unless the run dirs already hold
finished runs (an unfinished one is resumed), gathers what the report shows into
``reports/codebert.json`` (from the runs, the loader and the bench JSON), then renders the
markdown and ``reports/codebert_curves.png`` from that JSON; the paper's figures are
quoted beside the measurements.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import torch

from comera.train.checkpoint import complete_checkpoints, read_rank_files
from comera.train.logging import read_metrics
from experiments import cli
from experiments.codebert.data import group_settings
from experiments.codebert.experiment import EXPERIMENT, build
from experiments.host import report_header
from experiments.report import (
    check_evaluated,
    check_smoke_pair,
    layer_summary,
    layer_table,
    load_run,
    number,
    rank_table,
    runs_host,
    series,
    smoke_dirs,
    smoke_report_main,
    staged,
    write_report_json,
)
from loaders import LoaderConfig, TokenLoader
from loaders.sources import ArrowTokenFile

__all__ = [
    "AUDIT_MIX",
    "audit_weights",
    "AUDIT_TOKENS",
    "PAPER",
    "gather",
    "main",
    "mix_audit",
    "render",
    "unigram_baseline",
    "write_report",
]

TITLE = "CodeBERT pre-training with CoMERA"
PAPER = {
    "source": "Yang et al., CoMERA, NeurIPS 2024 (arXiv 2405.14377), abstract",
    "rows": [
        ["overall compression", "4.23x"],
        ["training speed", "about 2x faster than standard pre-training in parts of training"],
        ["loss", "close to the dense model's"],
    ],
}
AUDIT_MIX = (0.6, 0.3, 0.1)  # the weights the mix audit switches to, in sub-dataset order
AUDIT_TOKENS = 1_000_000  # how many tokens the mix audit reads after the switch


def unigram_baseline(train_folders: list[Path], eval_batches: list[dict], vocab: int) -> float:
    """Cross-entropy (nats) on the held-out masked tokens of a model that predicts every
    token from the training tokens' unigram frequencies (add-one smoothed): the loss a
    model that ignored its context would reach."""
    counts = np.ones(vocab, dtype=np.float64)
    for folder in train_folders:
        for path in sorted(Path(folder).glob("*.arrow")):
            f = ArrowTokenFile(path)
            for i in range(f.num_docs):
                counts += np.bincount(f.doc(i), minlength=vocab)[:vocab]
    logp = np.log(counts / counts.sum())
    labels = torch.cat([b["labels"][b["labels"] != -100] for b in eval_batches]).numpy()
    return float(-logp[labels].mean())


def audit_weights(names: list[str]) -> dict[str, float]:
    """The weights the mix audit switches to: :data:`AUDIT_MIX` in sub-dataset order, 0 for
    any sub-dataset past it. Every one is weighed: one left out of ``set_weights`` keeps its
    old weight, and the audit's targets (0 for it) missed the mix by its whole share."""
    return {n: AUDIT_MIX[i] if i < len(AUDIT_MIX) else 0.0 for i, n in enumerate(names)}


def mix_audit(
    run_dir: Path, config: LoaderConfig, weights: dict[str, float], tokens: int = 1_000_000
) -> dict:
    """From the run's newest checkpoint, switch the mix to ``weights`` (as ``--mix`` on
    resume does) and read ``tokens`` tokens of the run's training stream (``config``, its
    loader's config): each sub-dataset's realized share, traced by the loader's
    provenance."""
    config = dataclasses.replace(config, provenance=True, batch_size=64)
    newest = complete_checkpoints(run_dir)[-1]
    _, datas = read_rank_files(newest, int(newest.name.split("_")[-1]))
    loader = TokenLoader(config)
    loader.load_state_dict([d["state"] for d in datas])
    loader.set_weights(weights)
    names = [d.name for d in config.datasets]
    per = np.zeros(len(names))
    seen = 0
    while seen < tokens:
        doc = next(loader)["doc_ids"]
        src = (doc[doc >= 0] >> 32).numpy()
        per += np.bincount(src, minlength=len(names))
        seen += len(src)
    total = sum(weights.get(n, 0.0) for n in names)
    return {
        "tokens": seen,
        "shares": dict(zip(names, (per / seen).tolist(), strict=True)),
        "targets": {n: weights.get(n, 0.0) / total for n in names},
    }


def _plot(runs: dict[str, dict], early_end: int | None, out: Path) -> None:
    """Training loss (mean of 20 logs) and held-out loss against tokens seen; CoMERA's live
    ranks per layer against steps (the JSON's curves)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(14, 3.8))
    for name, run in runs.items():
        per_step = run["tokens_per_step"] / 1e6  # every step reads full rows
        steps, losses = zip(*run["curves"]["loss"], strict=True)
        window = min(20, len(losses))
        mean = np.convolve(losses, np.ones(window) / window, mode="valid")
        axes[0].plot([s * per_step for s in steps[window - 1 :]], mean, lw=1, label=name)
        held = run["curves"]["heldout_loss"]
        axes[1].plot([s * per_step for s, _ in held], [v for _, v in held], "o-", label=name)
    titles = ("training MLM loss (mean of 20 logs)", "held-out MLM loss")
    for ax, title in zip(axes[:2], titles, strict=True):
        ax.set(xlabel="tokens seen (millions)", ylabel="nats per masked token", title=title)
        ax.grid(alpha=0.3)
        ax.legend()
    ranks = runs["CoMERA"]["curves"]
    for key in sorted(k for k in ranks if k.startswith("ranks/")):
        if ranks[key]:
            axes[2].plot(*zip(*ranks[key], strict=True), lw=0.8, label=key[6:])
    if early_end:
        axes[2].axvline(early_end, color="grey", ls="--", lw=1)
    axes[2].set(xlabel="step", ylabel="sum of live ranks", title="CoMERA live ranks per layer")
    axes[2].grid(alpha=0.3)
    axes[2].legend(fontsize=5, ncol=2)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _bench_section(b: dict) -> list[str]:
    """The step benchmark's ratios and variants, beside the paper's figure where it has one."""
    paper = {  # the paper's figure for a key, where it states one
        "step_time_ratio_vs_dense": "about 2x faster in parts of training",
        "compression_ratio": "4.23x overall, after training",
    }

    def row(key: str, what: str) -> str:
        return f"| `{key}` ({what}) | {b[key]:.3f} | {paper.get(key, '')} |"

    lines = [
        "",
        "## Benchmark: one training step at sequence 512 (CPU)",
        "",
        f"`python -m benchmarks.codebert_step --json` ({b['date']}, {b['threads']} threads "
        f"of {b.get('cpu', 'CPU not recorded')}, median of {b['steps_timed']} timed steps "
        "after a warm-up, a fresh process per variant, peak RSS above the pre-model "
        "baseline). The step is the trainer's `train_step` on the MLM task: masking, "
        "document-confined attention, the tied decoder, the CoMERA early-stage objective "
        "and AdamW.",
        "",
        f"| key | measured | paper ({PAPER['source']}) |",
        "|---|---|---|",
        row("step_time_ratio_vs_dense", "base, batch 8"),
        row("step_time_ratio_vs_dense_half_ranks", "base, batch 8, every rank halved"),
        row(
            "peak_memory_ratio_vs_dense",
            "base, batch 1"
            + (
                f", median peaks of {len(b['peak_memory_b1_mb_runs']['comera'])} processes each"
                if "peak_memory_b1_mb_runs" in b
                else ""
            ),
        ),
        row(
            "peak_memory_ratio_vs_dense_mmap_threshold_1m",
            "batch 1, glibc's mmap threshold fixed at 1 MiB",
        ),
        row("step_time_ratio_vs_dense_b1_mmap_threshold_1m", "batch 1, same allocator"),
        f"| `compression_ratio` (paper preset at initial ranks: "
        f"{b['paper_params_dense']:,} / {b['paper_params_comera']:,} params) | "
        f"{b['compression_ratio']:.1f}x | {paper['compression_ratio']} |",
        "",
        "| variant | batch | params | step (s) | tokens/s | peak RSS above baseline (MB) |",
        "|---|---|---|---|---|---|",
    ]
    for x in b["runs"].values():
        lines.append(
            f"| {x['variant']} | {x['batch']} | {x['params']:,} | {x['step_s']:.2f} | "
            f"{x['tokens_per_s']:,.0f} | {x['peak_mb']:.0f} |"
        )
    return lines


def _run(rows: list[dict]) -> dict:
    """One run's last held-out eval, its speed and size at the end, and its curves."""
    ev = [r for r in rows if "eval/heldout/loss" in r]
    tr = [r for r in rows if "loss" in r]
    rank_keys = sorted({k for r in tr for k in r if k.startswith("ranks/")})
    return {
        "final": {
            "step": ev[-1]["step"],
            **{k: ev[-1][f"eval/heldout/{k}"] for k in ("loss", "perplexity", "accuracy")},
        },
        "tokens_per_s": tr[-1]["tokens_per_s"],
        "tokens_per_step": tr[0]["tokens"],
        "live_params": int(tr[-1]["live_params"]),
        "compression": tr[-1]["compression"],
        "curves": {
            "loss": series(tr, "loss"),
            "heldout_loss": series(ev, "eval/heldout/loss"),
            **{k: series(tr, k) for k in rank_keys},
        },
    }


def gather(runs_dir: Path, bench: dict | None, command: str) -> dict:
    """The report's data from the two smoke runs (``RUNS/codebert-smoke``,
    ``-smoke-dense``): the host that made them, the setup, each run's held-out figures and
    curves, the unigram baseline on the same held-out tokens, a mix audit from the CoMERA
    run's last checkpoint, its ranks and per-layer sizes, and the bench JSON."""
    dirs = smoke_dirs(runs_dir, "codebert")
    check_smoke_pair(dirs, "codebert")
    rows = {k: read_metrics(d / "metrics.jsonl") for k, d in dirs.items()}
    check_evaluated({dirs[k]: r for k, r in rows.items()}, "eval/heldout/loss",
                    "train.eval_every and data.eval_batches > 0")  # fmt: skip
    cfg = cli.resumed_config(EXPERIMENT, dirs["CoMERA"])
    task = build(cfg)[0]
    vocab = task.model.vocab_size
    train_folders = [d.path for d in task.train_iter.config.datasets]
    names = list(task.train_iter.config.weights)
    weights = audit_weights(names)
    audit = mix_audit(dirs["CoMERA"], task.train_iter.config, weights, AUDIT_TOKENS)
    audit["largest_gap"] = max(abs(audit["shares"][n] - audit["targets"][n]) for n in names)
    run = load_run(dirs["CoMERA"])
    m, d, t = cfg.model, cfg.data, cfg.train
    # what each group was prepared with: a prepared --corpus folder keeps its own held-out
    # fraction and piece length, whatever data.heldout and data.max_doc_tokens say
    groups = {n: group_settings(Path(f).parent) for n, f in zip(names, train_folders, strict=True)}
    return {
        "meta": {"command": command, **runs_host(dirs.values())},
        "paper": PAPER,
        "setup": {
            "sub_datasets": names,
            "paths": dict(d.paths) if d.source == "paths" else None,
            "hub_dataset": d.hub_dataset if d.source == "hub" else None,
            "max_files": d.max_files,
            "heldout": d.heldout,
            "vocab": vocab,
            "max_doc_tokens": d.max_doc_tokens,
            "seq_len": d.seq_len,
            "layers": m.layers,
            "d_model": m.d_model,
            "heads": m.heads,
            "ffn": m.ffn,
            "rank": m.rank,
            "emb_rank": m.emb_rank,
            "early_steps": t.comera.early_steps,
            "reg_start_step": t.comera.reg_start_step,
            "steps": t.steps,
            "batch_size": cfg.batch_size,
            "lr_cores": t.optim.lr_cores,
            "lr_rest": t.optim.lr_rest,
            "warmup_steps": t.warmup_steps,
        },
        "unigram_baseline": unigram_baseline(train_folders, task.eval_batches, vocab),
        "runs": {k: _run(r) for k, r in rows.items()},
        "early_end": run["ranks"].get("end_of_early", {}).get("step"),
        "groups": groups,
        "mix": dict(d.mix),  # as the run last trained with (a resume may change it)
        "mix_audit": {"weights": weights, **audit},
        "ranks": run["ranks"],
        "layers": layer_summary(run),
        "bench": bench,
    }


def _corpus_lines(s: dict) -> list[str]:
    """The section title and the corpus sentence's start: the stdlib corpus, the
    ``--corpus`` folders or the hub dataset a run read (a JSON from before they were kept:
    stdlib)."""
    names = s["sub_datasets"]
    held = f"{s['heldout']:.0%} of files held out by a hash of the path"
    if "groups" in s:  # (a JSON from before groups were kept: the run's data.heldout)
        fractions = sorted({g["heldout"] for g in s["groups"].values()})
        held = (f"{', '.join(f'{f:.0%}' for f in fractions)} of each group's files held out "
                "by a hash of the path (one file where that picks none or all)")  # fmt: skip
    if s.get("hub_dataset"):
        return [
            "## Ours: the smoke preset (CPU, a hub dataset)",
            "",
            f"Corpus: `{s['hub_dataset']}` as {len(names)} sub-datasets ({', '.join(names)}; "
            f"{s['heldout']:.0%} of rows held out), a vocabulary of {s['vocab']:,} tokens, ",
        ]
    if not s.get("paths"):
        return [
            "## Ours: the smoke preset (CPU, the Python standard library)",
            "",
            f"Corpus: this interpreter's standard library as {len(names)} sub-datasets by "
            f"file kind ({', '.join(names)}; {s['max_files']} files each, {held}), a "
            f"byte-level BPE of {s['vocab']:,} tokens trained on the training files, ",
        ]
    folders = ", ".join(f"{n}: `{p}`" for n, p in s["paths"].items())
    return [
        "## Ours: the smoke preset (CPU, `--corpus` folders)",
        "",
        f"Corpus: {len(s['paths'])} sub-datasets from `--corpus` ({folders}; {held}), a "
        f"vocabulary of {s['vocab']:,} tokens, ",
    ]


def _stages(s: dict) -> str:
    """The CoMERA schedule as far as the runs' steps reached it (a short run never gets to
    the late stage, nor perhaps to the gate regularizer)."""
    early, reg, steps = s["early_steps"], s["reg_start_step"], s["steps"]
    if steps <= min(early, reg):
        return f"early stage only ({early} steps; the gate regularizer would start at step {reg})"
    if steps <= early:
        return f"early stage only ({early} steps, gate regularizer from step {reg})"
    return f"early stage {early} steps (gate regularizer from step {reg}), then the late stage"


def _pieces(s: dict) -> str:
    """How the files were cut: the groups' piece lengths as prepared, or (a JSON from
    before they were kept) the run's ``data.max_doc_tokens``."""
    sizes = {g["max_doc_tokens"] for g in s["groups"].values()} if "groups" in s else {
        s["max_doc_tokens"]}  # fmt: skip
    cut = sorted(n for n in sizes if n is not None)
    if not cut:
        return "whole files (not cut)"
    said = f"files cut into pieces of at most {' or '.join(map(str, cut))} tokens"
    return said + (" (some groups whole)" if None in sizes else "")


def _mixed(s: dict) -> str:
    """The training mix, where one was given (none: every sub-dataset weighed alike; a
    JSON from before the mix was kept: nothing said)."""
    if not s.get("mix"):
        return ""
    return f", mixed by --mix {','.join(f'{n}={w:g}' for n, w in s['mix'].items())}"


def render(data: dict, out_dir: Path) -> str:
    """Write ``OUT_DIR/codebert.md`` and ``codebert_curves.png`` from the report's JSON;
    returns the markdown."""
    _plot(data["runs"], data["early_end"], out_dir / "codebert_curves.png")
    s, paper = data["setup"], data["paper"]
    corpus = _corpus_lines(s)
    names = s["sub_datasets"]
    lines = report_header(TITLE, data["meta"]["command"], data["meta"])
    lines += ["## The paper", "", f"Source: {paper['source']}.", ""]
    lines += ["| | paper (CoMERA, CodeBERT pre-training, GPU) |", "|---|---|"]
    lines += [f"| {what} | {figure} |" for what, figure in paper["rows"]]
    lines += [
        "",
        "The paper's abstract gives 4.23x overall compression and about 2x speed-up over "
        "standard pre-training; it does not name CodeBERT's size, its tensor shapes and "
        "ranks, the sequence length or the hardware. Our `paper` preset is CodeBERT as "
        "published (`microsoft/codebert-base`: 12 layers, width 768, 12 heads, FFN 3072, "
        "vocabulary 50,265, 514 positions, one token type, 125M parameters with the tied MLM "
        "head) on CodeSearchNet's six languages with CodeBERT's tokenizer. Every encoder "
        "linear is a TT with the paper's MNLI shapes for a 768-wide encoder (rank 30), the "
        "word embedding a TTM (vocab modes 20x16x16x10, dim modes 4x4x8x6, rank 32), the "
        "MLM decoder tied to it.",
        "",
        "The `paper` preset needs a GPU and the hub; its compression at initial ranks is in "
        "the benchmark below. On a CUDA machine:",
        "",
        "```",
        "python -m experiments.codebert --preset paper --wandb online           # CoMERA",
        "python -m experiments.codebert --preset paper --dense --wandb online   # dense",
        "python -m experiments.codebert --preset paper --set data.tokenizer=PATH "
        "--corpus python=PREPARED ...   # offline",
        "torchrun --nproc_per_node 8 -m experiments.codebert --preset paper     # 8 GPUs",
        "```",
        "",
        *corpus[:-1],
        # one line with the corpus sentence's start (two rendered alike, but not as written)
        corpus[-1] + f"{_pieces(s)}{_mixed(s)}, packed into rows of {s['seq_len']}. "
        f"Model: {s['layers']} layers, width "
        f"{s['d_model']}, {s['heads']} heads, FFN {s['ffn']}; CoMERA: TT linears at rank "
        f"{s['rank']}, TTM embedding at rank {s['emb_rank']}, {_stages(s)}. "
        f"{s['steps']} steps of {s['batch_size']} x {s['seq_len']} tokens, AdamW (CoMERA "
        f"cores {s['lr_cores']}, others {s['lr_rest']}; the dense run uses {s['lr_rest']} "
        f"throughout), {s['warmup_steps']} warm-up steps, linear decay.",
        "",
        "| run | held-out MLM loss | perplexity | masked-token accuracy | tokens/s | "
        "params at end | compression |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in data["runs"].items():
        f = r["final"]
        lines.append(
            f"| {name} | {number(f['loss'], '.4f')} | {number(f['perplexity'], '.1f')} | "
            f"{number(f['accuracy'], '.4f')} | "
            f"{r['tokens_per_s']:,.0f} | {r['live_params']:,} | {r['compression']:.2f}x |"
        )
    base = data["unigram_baseline"]
    lines += [
        f"| unigram baseline (train frequencies) | {base:.4f} | {math.exp(base):.1f} | | | | |",
        "",
        "The unigram baseline predicts every masked token from the training tokens' "
        "frequencies (add-one smoothed), on the same held-out masked tokens.",
        "",
        "![curves](codebert_curves.png)",
        "",
    ]
    audit = data["mix_audit"]
    lines += [
        "## Changing the mix on resume",
        "",
        f"From the CoMERA run's last checkpoint the weights were switched to "
        f"{', '.join(f'{n}={w}' for n, w in audit['weights'].items())} (what "
        f"`--resume RUN --mix ...` does) and the loader read {audit['tokens']:,} tokens, each "
        "traced to its sub-dataset by the loader's provenance:",
        "",
        "| sub-dataset | target share | realized share |",
        "|---|---|---|",
        *(f"| {n} | {audit['targets'][n]:.4f} | {audit['shares'][n]:.4f} |" for n in names),
        "",
        f"Largest gap between a target and a realized share: "
        f"{100 * audit['largest_gap']:.2f} points.",
        "",
        "## Exactness under kill and rescale",
        "",
        "`tests/experiments/codebert/test_exact.py` runs this experiment's CLI under "
        "`torchrun` with token provenance on, SIGKILLs it mid-run and resumes it on another "
        "number of processes (2 -> 1 and 1 -> 3): it checks that the (document, offset) "
        "pairs trained on before the last checkpoint and after the resume, plus what is left "
        "of the epoch, are every pair of the corpus exactly once, and that a run resumed on "
        "the same 2 processes ends bit-identical to an unbroken run.",
    ]
    lines += [
        "",
        "## CoMERA's ranks and per-layer compression (smoke)",
        "",
        *rank_table(data["ranks"]),
        "",
        "The final model, layer by layer (the word embedding counted at its padded "
        "vocabulary, the rows its TTM factors hold):",
        "",
        *layer_table(data["layers"]),
    ]
    if data["bench"]:
        lines += _bench_section(data["bench"])
    text = "\n".join(lines) + "\n"
    (out_dir / "codebert.md").write_text(text)
    return text


def write_report(
    runs_dir: Path, out_dir: Path, bench: dict | None, command: str | None = None
) -> str:
    """Gather the two smoke runs and the bench into ``codebert.json``, then render
    ``codebert.md`` and ``codebert_curves.png`` from it; returns the markdown."""
    data = gather(runs_dir, bench, command or "python -m experiments.codebert.report")
    with staged(out_dir) as stage:  # all of it, or none if the render fails
        return render(write_report_json(stage / "codebert.json", data), stage)


def main(argv: list[str] | None = None) -> int:
    from experiments.codebert.experiment import main as exp_main

    return smoke_report_main(
        "codebert",
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
