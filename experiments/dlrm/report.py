"""``reports/dlrm.md``: the smoke runs (CoMERA vs dense), per-table ranks, the bench.

    python -m experiments.dlrm.report [--runs runs] [--bench-json FILE]

Trains the ``smoke`` preset twice (CoMERA, dense) unless the run dirs already hold
finished runs, then writes the markdown and ``reports/dlrm_curves.png``.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.dlrm_step import GLIBC_TAG
from comera.train.logging import read_metrics
from experiments.cli import config_from_dict
from experiments.dlrm.data import CriteoDataConfig, load_criteo
from experiments.dlrm.generate import planted_logits
from experiments.dlrm.task import roc_auc
from experiments.malloc import lean_without_hugepages, restart_for
from experiments.report import smoke_report_main

__all__ = ["main", "write_report"]

PAPER = (
    "| | paper (CoMERA, Criteo Kaggle, GPU) | TT-Rec (MLSys 2021) |\n"
    "|---|---|---|\n"
    "| model compression | 99x | 4-221x on Kaggle (fixed-rank TT tables; 117x in its "
    "arXiv version) |\n"
    "| peak training memory | 7x lower than dense | - |\n"
    "| accuracy | comparable to dense | 0.03-0.3% lower accuracy across that range |\n"
)


def _evals(rows: list[dict]) -> list[dict]:
    return [r for r in rows if "eval/val/auc" in r]


def _plot(runs: dict[str, list[dict]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, rows in runs.items():
        ev = _evals(rows)
        axes[0].plot([r["step"] for r in ev], [r["eval/val/auc"] for r in ev], "o-", label=name)
        axes[1].plot([r["step"] for r in ev], [r["eval/val/nce"] for r in ev], "o-", label=name)
        tr = [r for r in rows if "live_params" in r]
        axes[2].plot([r["step"] for r in tr], [r["live_params"] for r in tr], label=name)
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


def write_report(runs_dir: Path, out_dir: Path, bench: dict | None) -> str:
    """Write ``dlrm.md`` and ``dlrm_curves.png`` from the two smoke runs and the bench."""
    runs = {
        "CoMERA": read_metrics(runs_dir / "dlrm-smoke" / "metrics.jsonl"),
        "dense": read_metrics(runs_dir / "dlrm-smoke-dense" / "metrics.jsonl"),
    }
    _plot(runs, out_dir / "dlrm_curves.png")
    config = json.loads((runs_dir / "dlrm-smoke" / "config.json").read_text())
    dense_cfg = json.loads((runs_dir / "dlrm-smoke-dense" / "config.json").read_text())
    data = load_criteo(config_from_dict(CriteoDataConfig, config["data"]), progress=False)
    lo, hi = data.splits["val"]
    eval_hi = hi if config["data"]["eval_rows"] is None else lo + config["data"]["eval_rows"]
    bayes = ""
    if config["data"]["path"] == "generated":
        logits = planted_logits(config["data"]["generated_rows"])[lo:eval_hi]
        limit = roc_auc(logits, data.label[lo:eval_hi])
        bayes = f"; the planted logit (Bayes limit) scores val AUC {limit:.3f}"
    m = config["model"]
    lines = ["# DLRM on Criteo with TTM tables", "", "## The paper and its peers", "", PAPER]
    lines += [
        "Our `kaggle` preset (the reference's setting on the real `train.txt`) has not been "
        "run: this machine has neither the Criteo file nor a GPU. The figures below are the "
        "CPU smoke runs and a one-step benchmark at the Kaggle table sizes.",
        "",
        "## Ours: smoke preset (CPU, generated Criteo-format data with planted signal)",
        "",
        f"{config['rows']:,} rows ({config['train_rows']:,} train, {hi - lo:,} val){bayes}. "
        f"DLRM with bottom {m['bottom']}, top {m['top']}, dim {m['emb_dim']}; CoMERA: "
        f"{config['ttm_tables']} tables with >= {m['tt_min_rows']:,} rows as "
        f"{len(m['emb_dim_modes'])}-core TTMs at rank {m['emb_rank']}, "
        f"{config['train']['optimizer']}, early stage {config['train']['comera']['early_steps']}"
        f" steps; dense: same architecture, {dense_cfg['train']['optimizer']}. "
        "Command: `python -m experiments.dlrm.report` (`make dlrm`).",
        "",
        "| run | val AUC at end | best val AUC (step) | val NCE | val log loss | "
        "val accuracy | params at end | model MB | compression |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    finals, bests = {}, {}
    for name, rows in runs.items():
        ev, tr = _evals(rows)[-1], [r for r in rows if "live_params" in r][-1]
        best = max(_evals(rows), key=lambda r: r["eval/val/auc"])
        finals[name], bests[name] = ev["eval/val/auc"], best["eval/val/auc"]
        lines.append(
            f"| {name} | {ev['eval/val/auc']:.4f} | {best['eval/val/auc']:.4f} "
            f"({best['step']}) | {ev['eval/val/nce']:.4f} | "
            f"{ev['eval/val/logloss']:.4f} | {ev['eval/val/accuracy']:.4f} | "
            f"{int(tr['live_params']):,} | {tr['live_params'] * 4 / 2**20:.2f} | "
            f"{tr['compression']:.1f}x |"
        )
    gap_end = abs(finals["CoMERA"] - finals["dense"])
    gap_best = abs(bests["CoMERA"] - bests["dense"])
    both = min(finals.values()) > 0.7
    lines += [
        "",
        "| smoke target (issue) | measured | met |",
        "|---|---|---|",
        f"| both val AUC > 0.7 | {min(finals.values()):.4f} (lower of the two) | "
        f"{'yes' if both else 'no'} |",
        f"| within 0.01 of each other, at the end | {gap_end:.4f} | "
        f"{'yes' if gap_end <= 0.01 else 'no'} |",
        f"| within 0.01 of each other, best evals | {gap_best:.4f} | "
        f"{'yes' if gap_best <= 0.01 else 'no'} |",
        "",
        "Read the curves, not only the last row: a model whose best eval comes before its "
        "last has overfit (val NCE above 1 is worse than predicting the base rate). The "
        "planted effects are independent per value, the hardest case for a low-rank table; "
        "the ranks below show where CoMERA keeps its capacity. TT-Rec reports 0.03-0.3% "
        "lower accuracy at 4-221x on real Kaggle; on this signal, with about 190x fewer "
        "training rows, fixed rank-64 tables lose 1.3 points of accuracy at 4.1x (the "
        "capacity ablation below). The signal is a much harder case for TT tables, so this "
        "smoke does not test the paper's accuracy claim; that needs the real file.",
    ]
    lines += ["", "![curves](dlrm_curves.png)", ""]
    ttm_rows = [n for n in config["cardinalities"] if n >= m["tt_min_rows"]]
    for knob in ("rank", "gamma", "steps", "capacity", "hot_rows"):
        path = out_dir / f"ablation_dlrm_{knob}.json"
        lines += _ablation_note(path, runs["dense"], knob, ttm_rows)
    ranks = json.loads((runs_dir / "dlrm-smoke" / "ranks.json").read_text())
    lines += _rank_table(ranks, config, _evals(runs["CoMERA"])[-1])
    if bench:
        lines += _bench_section(bench)
    text = "\n".join(lines) + "\n"
    (out_dir / "dlrm.md").write_text(text)
    return text


def _rank_table(ranks: dict, config: dict, last_eval: dict) -> list[str]:
    """Ranks from ``ranks.json``; each table's compression as the last eval logged it."""
    if "init" not in ranks or "end" not in ranks:
        return []
    init, end = ranks["init"]["ranks"], ranks["end"]["ranks"]
    cards = dict(
        zip([f"tables.C{i + 1}" for i in range(26)], config["cardinalities"], strict=False)
    )
    width = config["model"]["emb_dim"]
    out = [
        "## Live ranks per compressed table (smoke, CoMERA)",
        "",
        "Compression is against the dense table (rows x 16); the planted-signal tables are "
        "C3, C4, C12, C16, C21 (C1 also carries signal but is small and stays dense).",
        "",
        "| table | rows | ranks at init | ranks at end | params at end | compression |",
        "|---|---|---|---|---|---|",
    ]
    for layer in init:
        if layer not in cards:
            continue
        n, comp = cards[layer], last_eval[f"eval/compression/{layer.removeprefix('tables.')}"]
        out.append(
            f"| {layer} | {n:,} | {init[layer]} | {end[layer]} | {round(n * width / comp):,} "
            f"| {comp:.0f}x |"
        )
    return [*out, ""]


def _ablation_note(
    path: Path, dense_rows: list[dict], knob: str, ttm_rows: list[int] | None = None
) -> list[str]:
    """One paragraph on a DLRM ablation (``python -m experiments.ablate KNOB --experiment
    dlrm``) when its JSON is there: does any variant come within 0.01 of dense's val AUC at
    the same step, and at what compression? ``knob``: ``rank``, ``capacity`` (its own
    dense variants), ``steps`` (variants of
    different lengths: each one's best eval against dense's last) or ``hot_rows``;
    ``ttm_rows``: the compressed tables' sizes (hot rows: the share of rows held dense)."""
    if not path.is_file():
        return []
    rows = json.loads(path.read_text())
    if knob == "steps":
        return _steps_note(rows, dense_rows)
    if knob == "capacity":
        return _capacity_note(rows)
    steps = {r["steps"] for r in rows}
    dense = [r for r in _evals(dense_rows) if r["step"] in steps]
    if len(steps) != 1 or not dense:
        return []
    step = steps.pop()
    name = {"rank": "rank", "gamma": "gamma", "hot_rows": "hot rows"}[knob]
    auc = ", ".join(
        f"{name} {r['label']} {r['eval_auc']:.4f} ({r['compression']:.1f}x)" for r in rows
    )
    d_auc = dense[0]["eval/val/auc"]
    close = [r for r in rows if r["eval_auc"] >= d_auc - 0.01]
    # gamma: (value, row) of each variant with a numeric label; gamma 0 against the largest
    valued = sorted(
        ((v, r) for r in rows if knob == "gamma" and (v := _label_value(r["label"])) is not None),
        key=lambda vr: vr[0],
    )
    off = valued[0][1] if valued and valued[0][0] == 0 else None
    top_gamma, top = valued[-1] if valued else (None, None)
    trade = off is not None and top is not off  # how much of the gap is the regularizer's?
    if trade:
        within = [r["eval_auc"] >= d_auc - 0.01 for r in (off, top)]
        share = off["eval_auc"] - top["eval_auc"]
        lead = (
            "Every gamma comes within 0.01 of dense"
            if all(within)
            else "The early-stage gate regularizer keeps the gap open"
            if within[0]
            else f"The early-stage gate regularizer explains {share:.4f} of the gap"
            if share > 0
            else "The early-stage gate regularizer does not explain the gap"
        )
    else:
        lead = {
            "rank": f"{'Enough rank closes' if close else 'Rank does not close'} the gap",
            "gamma": f"{'A' if close else 'No'} gamma comes within 0.01 of dense",
            "hot_rows": f"Hot rows {'close' if close else 'do not close'} the gap",
        }[knob]
    text = (
        f"{lead}: at step {step} the {knob} ablation (`reports/ablation_dlrm_{knob}.md`) "
        f"gives val AUC {auc}, against the dense smoke run's {d_auc:.4f} at that step."
    )
    if trade:
        change = off["eval_auc"] - top["eval_auc"]
        text += (
            " `train.comera.gamma` weighs the early stage's gate regularizer only; the late "
            "stage's size objective runs at every gamma, so ranks shrink at gamma 0 too. "
            f"Gamma {top_gamma:g} against 0 {'costs' if change >= 0 else 'gains'} "
            f"{abs(change):.4f} val AUC and takes compression from {off['compression']:.1f}x "
            f"to {top['compression']:.1f}x; without the regularizer the gap to dense is "
            f"{d_auc - off['eval_auc']:.4f} (one seed)."
        )
    if knob == "hot_rows":
        text += (
            " Hot rows (`--set model.hot_rows=K`, TT-Rec's cache of frequent rows, static "
            "here) add a dense row for the K most frequent ids of each TTM table."
        )
        none = next((r for r in rows if r["label"] == "0"), None)
        if none is not None:
            worse = [r for r in rows if r["eval_auc"] < none["eval_auc"]]
            if worse:
                text += (
                    " A few do not help by themselves: "
                    + ", ".join(f"{r['label']} scored {r['eval_auc']:.4f}" for r in worse)
                    + f" against {none['eval_auc']:.4f} with none."
                )
        if close:
            best = max(close, key=lambda r: r["compression"])
            share = ""
            if ttm_rows:
                k = int(best["label"])
                frac = sum(min(k, n) for n in ttm_rows) / sum(ttm_rows)
                share = f", with {frac:.0%} of the compressed tables' rows held dense"
            text += (
                f" The gap closes only as dense rows take the signal over: the most compressed "
                f"variant within 0.01 ({best['label']}) keeps {best['compression']:.1f}x{share}."
            )
        text += " The paper's model has none (the presets' default)."
    return [text, ""]


def _label_value(label: str) -> float | None:
    """An ablation label's number: ``0.05`` and ``gamma=0.05`` alike; None if not one."""
    try:
        return float(str(label).rsplit("=", 1)[-1])
    except ValueError:
        return None


def _capacity_note(rows: list[dict]) -> list[str]:
    """The capacity ablation: CoMERA's gap to dense split three ways (rank adaptation: the
    preset against its TTM tables at fixed ranks; what 4x the rank buys back; what stays
    at 4x the rank), the hashing trick at the same size, and the gaps on a fresh draw of
    3x the rows. Each variant's last eval against the dense variant on the same data."""
    rows = [r for r in rows if r.get("eval_auc") is not None and r.get("compression")]
    by = {r["label"]: r for r in rows}

    def rank_of(r: dict) -> str:  # "16" of "fixed_rank_16"; "16_3x_data" for another draw
        return r["label"].removeprefix("fixed_rank_")

    fixed = sorted(
        (r for r in rows if r["label"].startswith("fixed_rank_") and rank_of(r).isdigit()),
        key=lambda r: int(rank_of(r)),
    )
    if "comera" not in by or "dense" not in by or len(fixed) < 2:
        return []
    comera, dense, low, high = by["comera"], by["dense"], fixed[0], fixed[-1]
    d, c = dense["eval_auc"], comera["eval_auc"]
    adapt = low["eval_auc"] - c  # rank adaptation's share
    more = high["eval_auc"] - low["eval_auc"]  # bought back by more rank
    rest = d - high["eval_auc"]  # left at the highest rank
    fmt = d - low["eval_auc"]  # the format's share at the preset's rank

    def at(r: dict) -> str:
        return f"{r['eval_auc']:.4f} at {r['compression']:.1f}x"

    rank_lo, rank_hi = rank_of(low), rank_of(high)
    if rest <= 0.01:
        lead = f"Capacity sets the gap: at rank {rank_hi} the fixed TTM tables come within 0.01"
    elif fmt > adapt:
        lead = "The TTM format, more than rank adaptation, holds the gap"
    else:
        lead = "Rank adaptation, more than the TTM format, holds the gap"
    text = (
        f"{lead}: in the capacity ablation (`reports/ablation_dlrm_capacity.md`, one seed) "
        f"the gap of {d - c:.4f} between CoMERA ({at(comera)}) and dense ({d:.4f}) splits "
        f"into {adapt:.4f} for rank adaptation (the TTM tables at fixed rank {rank_lo}, "
        f"nothing pruned: {at(low)}), {more:.4f} that rank {rank_hi} buys back ({at(high)}) "
        f"and {rest:.4f} that stays even there."
    )
    text += _hashing_sentence(rows, [comera, *fixed])
    pairs = [(k, f"{k}_3x_data") for k in ("comera", low["label"])]
    if "dense_3x_data" in by and all(p3 in by for _, p3 in pairs):
        d3 = by["dense_3x_data"]["eval_auc"]
        gaps = [(d - by[k]["eval_auc"], d3 - by[k3]["eval_auc"]) for k, k3 in pairs]

        def moved(g1: float, g3: float) -> str:
            if abs(g3 - g1) <= 0.002:  # one seed: no change to speak of
                return f"stays at about {g1:.4f} ({g3:.4f})"
            return f"{'widens' if g3 > g1 else 'narrows'} from {g1:.4f} to {g3:.4f}"

        text += (
            " On a fresh draw of 3x the rows (one epoch, the schedule scaled; other data, "
            f"so compare within it) dense scores {d3:.4f}; CoMERA's gap to it "
            f"{moved(*gaps[0])} (at {by['comera_3x_data']['compression']:.1f}x against "
            f"{comera['compression']:.1f}x) and fixed rank {rank_lo}'s {moved(*gaps[1])}."
        )
        if all(g3 > g1 + 0.002 for g1, g3 in gaps) and rest > 0.01:
            text += (
                " That fits the planted signal: its effects are independent per value, "
                "which a dense table holds in a free vector each while a TTM's cores are "
                "shared by all values, so more data lets dense learn values the TTM tables "
                "cannot hold."
            )
    return [text, ""]


def _hashing_sentence(rows: list[dict], ttm: list[dict]) -> str:
    """Each hashed dense variant (``dense_hash_rows_K``) against the TTM variant closest
    to its size that is at least as compressed: does the TTM format beat the hashing
    trick at the same size?"""
    pairs = []
    for h in sorted(
        (r for r in rows if r["label"].startswith("dense_hash_rows_")),
        key=lambda r: -r["compression"],
    ):
        smaller = [t for t in ttm if t["compression"] >= h["compression"]]
        if smaller:
            pairs.append((h, min(smaller, key=lambda t: t["compression"])))
    if not pairs:
        return ""
    wins = [t["eval_auc"] > h["eval_auc"] for h, t in pairs]
    lead = (
        "At the same size or smaller, the TTM tables beat the hashing trick"
        if all(wins)
        else "The hashing trick matches or beats the TTM tables at some size"
    )

    def name(t: dict) -> str:
        return "CoMERA" if t["label"] == "comera" else f"rank {t['label'].rsplit('_', 1)[-1]}"

    listed = ", ".join(
        f"to {int(h['label'].rsplit('_', 1)[-1]):,} rows {h['eval_auc']:.4f} "
        f"({h['compression']:.1f}x) against {name(t)}'s {t['eval_auc']:.4f} "
        f"({t['compression']:.1f}x)"
        for h, t in pairs
    )
    return f" {lead}: the dense model's large tables hashed {listed}."


def _steps_note(rows: list[dict], dense_rows: list[dict]) -> list[str]:
    """The steps ablation: trained longer, does CoMERA's best val AUC come within 0.01 of
    the dense smoke run's last eval, or does it level off? Each variant's compression is
    listed beside it: a longer run may also end larger."""
    dense = _evals(dense_rows)
    if not dense or not rows or any(r.get("best_eval") is None for r in rows):
        return []
    d_auc, d_step = dense[-1]["eval/val/auc"], dense[-1]["step"]
    bests = [(r["best_eval"][0], r["best_eval"][1], r["steps"]) for r in rows]
    listed = ", ".join(
        f"{auc:.4f} (step {s:,} of {n:,}"
        + (f", {r['compression']:.1f}x)" if r.get("compression") else ")")
        for (auc, s, n), r in zip(bests, rows, strict=True)
    )
    within = [b[0] >= d_auc - 0.01 for b in bests]
    if within[0]:
        lead = "The preset's own length is already within 0.01 of dense"
    else:
        lead = f"Longer training {'closes' if any(within) else 'does not close'} the gap"
    lengths = ", ".join(f"{r['steps']:,}" for r in rows)
    text = (
        f"{lead}: trained for {lengths} steps, the CoMERA "
        "schedule scaled along (the steps ablation, `reports/ablation_dlrm_steps.md`), "
        f"CoMERA's best val AUC is {listed}, against the dense smoke run's {d_auc:.4f} at "
        f"step {d_step:,}."
    )
    if not any(within):
        gain = bests[-1][0] - bests[0][0]
        factor = bests[-1][2] / bests[0][2]
        text += f" With {factor:g}x the steps its best moves by {gain:+.4f}: " + (
            "the TTM tables level off below dense rows on these independent per-value effects."
            if gain < 0.005
            else "the TTM tables learn these independent per-value effects more slowly than "
            "dense rows and do not reach dense's level in these runs."
        )
    last = rows[-1].get("eval_auc")
    if last is not None and bests[-1][0] - last > 0.002:
        text += (
            f" The longest run peaked at step {bests[-1][1]:,} of {bests[-1][2]:,} and ended "
            f"at {last:.4f}."
        )
    return [text, ""]


def _bench_section(b: dict) -> list[str]:
    v = b["variants"]
    out = [
        "## Benchmark: one training step at the Kaggle table sizes",
        "",
        f"`python -m experiments.dlrm --bench --json`: 26 tables (33.76M rows), batch "
        f"{b['batch']:,}, {b.get('cpu', 'an unrecorded CPU')}, {b['threads']} threads, "
        "every variant in a fresh process"
        + (
            f" (`comera` and `dense_sgd` under `{b.get('malloc', 'default')}` {b['rounds']} "
            "times each, alternating: their "
            "median step time and peak)"
            if b.get("rounds", 1) > 1
            else ""
        )
        + "; peak RSS above the pre-model baseline. CoMERA: the 10 tables of >= 10,000 rows as "
        "4-core TTMs (dim modes 2x2x2x2) at rank 32, `bottom.1` and `top.1` as TT (rank 16), "
        "AdamW, early-stage objective. "
        f"Allocator: `cpu_malloc={b.get('malloc', 'default')}`, the policy DLRM trains under on "
        "CPU (its presets' default; dense and CoMERA alike): glibc returns blocks of 1 MiB "
        "and up when freed and puts those of 2 MiB and up on transparent huge pages. The "
        f"`{GLIBC_TAG}` rows run the same step under glibc as found (one run each).",
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
    targets = {
        "compression_ratio": (">= 99", lambda x: x >= 99),
        "peak_memory_ratio_vs_dense": ("<= 0.143 (1/7)", lambda x: x <= 1 / 7),
        "peak_memory_ratio_vs_dense_adam": ("-", lambda x: True),
        "step_time_ratio_vs_dense": ("<= 1.25", lambda x: x <= 1.25),
        "embedding_time_ratio_batched_vs_separate": ("<= 0.5", lambda x: x <= 0.5),
    }
    out += ["", "| key | measured | target | met |", "|---|---|---|---|"]
    for k, (t, ok) in targets.items():
        out.append(f"| `{k}` | {b[k]:.3f} | {t} | {'yes' if ok(b[k]) else 'no'} |")
    mem_glibc = b.get("peak_memory_ratio_vs_dense_glibc_default")
    time_glibc = b.get("step_time_ratio_vs_dense_glibc_default")
    out += ["", "Reading the figures:", ""]
    if mem_glibc is not None:
        out.append(
            f"- Under glibc as found, CoMERA's peak is {mem_glibc:.3f} of dense's (step time "
            f"{time_glibc:.2f}x): glibc raises its mmap threshold as blocks are freed, so "
            "freed activations stay resident as heap holes (in one measured step the peak "
            "resident set was about 1.7x the live tensors' peak). `lean` returns them; on huge "
            "pages a fresh block faults once per 2 MiB, not once per 4 KiB page, which keeps "
            "the time cost small (on 4 KiB pages, with glibc's mmap threshold fixed at 1 MiB, "
            "an earlier run of this bench measured CoMERA's step at 1.45x dense's)."
        )
    emb_glibc = b.get("embedding_time_ratio_batched_vs_separate_glibc_default")
    out.append(
        "- The table-batched lookup does the same per-row work as separate calls (one "
        "gather per merged core pair and a 4x32x4 product per unique row). Batching itself "
        "saves only per-call overhead, a few ms on a CPU step where that row work dominates, "
        "and pays some back in rank padding, concatenating the cores on every call and one "
        "large dedup. What makes it faster here is its backward: blocks of unique rows are "
        "regathered and their core gradients added into one buffer per core, and each "
        "block's temporaries stay under 1 MiB, so under `lean` they are reused from the heap "
        "while separate calls map and fault in their batch-sized ones"
        + (f" (as found the ratio is {emb_glibc:.3f})" if emb_glibc is not None else "")
        + ". `ttm_embedding` could adopt the same blocked backward, which would bring the "
        "ratio near 1. The 0.5 target assumed a GPU, where the saved overhead is kernel "
        "launches; not measured (no GPU was lent)."
    )
    out.append("")
    return out


def main(argv: list[str] | None = None) -> int:
    from experiments.dlrm.experiment import CPU_MALLOC
    from experiments.dlrm.experiment import main as exp_main

    if argv is None:  # a command: its smoke runs train in this process, as DLRM does
        restart_for(CPU_MALLOC)

    return smoke_report_main("dlrm", exp_main, write_report, argv, __doc__.split("\n")[0])


if __name__ == "__main__":
    raise SystemExit(main())
