"""The paper's Figure 1 on CPU: step time and peak memory vs batch size, CoMERA vs dense
vs GaLore, on the paper-size six-encoder MNLI model.

    python -m benchmarks.efficiency [--batches 1,8,32,64] [--repeats 3] [--threads 2]
    python -m benchmarks.efficiency --render reports/efficiency.json   # report again, no run

Every (variant, batch) point runs in a fresh process (``benchmarks.mnli_step``'s worker:
forward, backward and the optimizer update on a batch of 128-token pairs; CoMERA with its
early-stage objective and AdamW, dense with AdamW, GaLore with GaLore-AdamW at rank 128,
gap 200, scale 0.25). Writes ``reports/efficiency.json``, then ``reports/efficiency.md`` and
``reports/efficiency.png`` rendered from it alone; the allocator is glibc as found, as
training runs by default.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from benchmarks.mnli_step import SEQ, galore_available, run_worker
from benchmarks.reporting import (
    TINY_NEEDS_OUT,
    add_threads_flag,
    arg_parser,
    check_output,
    measure_points,
    one_line_errors,
    recorded_out,
    reduced_run,
    render_only,
    render_refusal,
    render_saved,
    write_json,
    write_text,
)
from experiments.host import cpu_model, report_header
from experiments.workers import WorkerFailed

__all__ = ["main", "render", "sweep", "write_report"]

REPORTS = Path(__file__).resolve().parent.parent / "reports"
PROG = "python -m benchmarks.efficiency"
VARIANTS = ("comera", "dense", "galore")
DEFAULTS = {"batches": [1, 8, 32, 64], "repeats": 3}
PAPER = (
    "| | paper (Figure 1, RTX 3090, six-encoder transformer) |\n"
    "|---|---|\n"
    "| CoMERA vs GaLore, batch 1 | about 9x less memory, 2-3x faster per step |\n"
    "| CoMERA vs dense | 2-3x faster per epoch |\n"
)
# at batch 1, CoMERA / GaLore: (the paper's figure as a ratio, this benchmark's threshold)
BATCH1 = {
    "step time": ("0.33-0.5 (2-3x faster)", 0.5),
    "peak memory": ("about 0.11 (about 9x less)", 0.15),
}


def sweep(
    batches: list[int], repeats: int, threads: int, tiny: bool = False,
    partial: Path | None = None,
) -> dict:  # fmt: skip
    """Every (variant, batch) point, each in its own process. Each result goes to
    ``partial`` as it comes (a sweep stopped by a time limit keeps what it measured); a
    failing point stops no other and is recorded there, and the sweep then raises
    :class:`WorkerFailed` naming every failed point."""
    runs, failed = measure_points(
        [(v, b) for b in batches for v in VARIANTS],
        lambda v, b: run_worker(v, b, repeats, "cpu", threads, tiny),
        partial,
    )
    if failed:
        first = next(r["error"] for r in runs if "error" in r)
        raise WorkerFailed(f"efficiency points {', '.join(failed)}", first)
    return {
        "batches": batches,
        "repeats": repeats,
        "threads": threads,
        "cpu": cpu_model(),
        "seq": SEQ,
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "runs": runs,
        **({"tiny": True} if tiny else {}),  # a toy model: the report's command says so
    }


def _plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for v in VARIANTS:
        pts = sorted((r["batch"], r) for r in result["runs"] if r["variant"] == v)
        xs = [b for b, _ in pts]
        axes[0].plot(xs, [r["step_s"] * 1e3 for _, r in pts], "o-", label=v)
        axes[1].plot(xs, [r["peak_mb"] for _, r in pts], "o-", label=v)
    for ax, what in zip(axes, ("step time (ms)", "peak memory above baseline (MB)"), strict=True):
        ax.set(xscale="log", yscale="log", xlabel="batch size (pairs of 128 tokens)", ylabel=what)
        ax.set_xticks(result["batches"], [str(b) for b in result["batches"]])
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.suptitle("Training step of the six-encoder MNLI model on CPU (cf. the paper's Figure 1)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def command(result: dict) -> str:
    """The command line that measured ``result``: the flags that differ from the defaults."""
    parts = ["python -m benchmarks.efficiency"]
    parts += ["--tiny"] if result.get("tiny") else []
    if result.get("batches", DEFAULTS["batches"]) != DEFAULTS["batches"]:
        parts += ["--batches", ",".join(map(str, result["batches"]))]
    if result.get("repeats", DEFAULTS["repeats"]) != DEFAULTS["repeats"]:
        parts += ["--repeats", str(result["repeats"])]
    if "threads" in result:  # always: the default is the machine's own count
        parts += ["--threads", str(result["threads"])]
    return " ".join(parts + recorded_out(result))


# what a sweep measured: the paper-size model, or --tiny's toy one (benchmarks.mnli_step)
_MODELS = {
    "paper": "The paper-size model: 6 encoders, width 768, TT linears at rank 30, TTM "
    "embedding at rank 32 (CoMERA); the same model dense under AdamW; the dense model "
    "under GaLore-AdamW (galore-torch, rank 128, projection refreshed every 200 steps, "
    "scale 0.25: the GaLore paper's settings, on the encoder blocks' linears; embeddings "
    "and the pooler get plain AdamW).",
    "tiny": "A toy model (`--tiny`: one encoder, width 16, TT linears and the TTM embedding "
    "at rank 4), not the paper's: CoMERA; the same model dense under AdamW; the dense "
    "model under GaLore-AdamW (rank 8, projection refreshed every 200 steps, scale 0.25).",
}


def render(result: dict) -> str:
    """The markdown report of a sweep result (``efficiency.json``), from the result alone:
    after a sweep, and with ``--render JSON`` for a saved one."""
    by = {(r["variant"], r["batch"]): r for r in result["runs"]}
    batches = result["batches"]
    if not isinstance(batches, list) or not all(isinstance(b, int) for b in batches):
        raise TypeError(f"batches is {batches!r}, not a list of batch sizes")  # the plot's
    lines = [
        *report_header(
            "Efficiency: CoMERA vs dense vs GaLore (the paper's Figure 1 on CPU)",
            command(result),
            result,
        ),
        "## The paper",
        "",
        PAPER,
        "## Ours",
        "",
        f"{result.get('threads', 'an unrecorded number of')} threads, median of "
        f"{result.get('repeats', DEFAULTS['repeats'])} timed steps after a "
        "warm-up, a fresh process per point, peak RSS above the pre-model baseline, glibc "
        f"as found. {_MODELS['tiny' if result.get('tiny') else 'paper']} The timed steps "
        "exclude GaLore's SVD refresh, which runs once per 200 steps (in the warm-up step "
        "here).",
        "",
        "| batch | CoMERA ms | dense ms | GaLore ms | CoMERA MB | dense MB | GaLore MB | "
        "CoMERA / GaLore time | CoMERA / GaLore memory |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in result["batches"]:
        c, d, g = by["comera", b], by["dense", b], by["galore", b]
        lines.append(
            f"| {b} | {c['step_s'] * 1e3:.0f} | {d['step_s'] * 1e3:.0f} | "
            f"{g['step_s'] * 1e3:.0f} | {c['peak_mb']:.0f} | {d['peak_mb']:.0f} | "
            f"{g['peak_mb']:.0f} | {c['step_s'] / g['step_s']:.3f} | "
            f"{c['peak_mb'] / g['peak_mb']:.3f} |"
        )
    if 1 in result["batches"]:
        c, g = by["comera", 1], by["galore", 1]
        measured = {
            "step time": c["step_s"] / g["step_s"],
            "peak memory": c["peak_mb"] / g["peak_mb"],
        }
        lines += [
            "",
            "| CoMERA / GaLore at batch 1 | measured | paper | threshold | within |",
            "|---|---:|---:|---:|---|",
            *[
                f"| {what} | {measured[what]:.3f} | {paper} | {limit} | "
                f"{'yes' if measured[what] <= limit else 'no'} |"
                for what, (paper, limit) in BATCH1.items()
            ],
            "",
            "*threshold*: this benchmark's own.",
        ]
    lines += [
        "",
        "![Figure 1 on CPU](efficiency.png)",
        "",
        "GaLore keeps the dense weights, their gradients and the activations; it saves only "
        "optimizer state (Adam moments of rank-128 projections instead of full matrices). "
        "CoMERA's weights, gradients and moments are all tensor-train sized.",
        "",
        "How a step runs (eager, sync-free, compiled, CUDA graphs) is measured separately: "
        "[step_modes.md](step_modes.md) (`python -m benchmarks.step_modes`).",
    ]
    return "\n".join(lines) + "\n"


def write_report(result: dict, out_dir: Path = REPORTS) -> str:
    """``efficiency.md`` and ``efficiency.png`` rendered from a sweep result; returns the
    markdown."""
    out_dir.mkdir(parents=True, exist_ok=True)
    _plot(result, out_dir / "efficiency.png")
    text = render(result)
    write_text(out_dir / "efficiency.md", text)
    return text


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    ap.add_argument("--batches", default=",".join(map(str, DEFAULTS["batches"])))
    ap.add_argument("--repeats", type=int, default=DEFAULTS["repeats"])
    add_threads_flag(ap)
    ap.add_argument("--tiny", action="store_true", help="toy model (tests of the plumbing)")
    ap.add_argument("--out", type=Path, help="report dir (default: reports/)")
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="measure nothing: render efficiency.md and .png into --out from a "
                    "saved sweep (efficiency.json)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.render is not None:  # measuring flags beside it would do nothing
        render_only(ap, argv, ("out",))
    out = args.out or REPORTS
    check_output(out, "--out", "folder")  # before anything is measured or rendered
    if args.render is not None:
        done = render_saved(args.render, render, ap.prog, ("runs", "batches"))
        if done is None:
            return 2
        why = render_refusal(done[0], args.out)
        if why is not None:
            print(f"{ap.prog}: error: {args.render}: {why}", file=sys.stderr)
            return 2
        print(write_report(done[0], out))
        return 0
    if args.tiny and args.out is None:
        print(f"{ap.prog}: error: {TINY_NEEDS_OUT}", file=sys.stderr)
        return 2
    try:
        # a size given twice is measured once (the order kept)
        batches = list(dict.fromkeys(int(b) for b in args.batches.split(",") if b))
    except ValueError:
        print(f"{ap.prog}: error: --batches {args.batches!r}: give integers like 1,8,32",
              file=sys.stderr)  # fmt: skip
        return 2
    if not batches or min(batches) < 1:
        print(f"{ap.prog}: error: --batches needs positive sizes", file=sys.stderr)
        return 2
    if args.repeats < 1 or args.threads < 1:
        print(f"{ap.prog}: error: --repeats and --threads must be >= 1, got {args.repeats}, "
              f"{args.threads}", file=sys.stderr)  # fmt: skip
        return 2
    why = reduced_run({"--batches": (set(batches), set(DEFAULTS["batches"])),
                       "--repeats": (args.repeats, DEFAULTS["repeats"])}, "--out")  # fmt: skip
    if why is not None and args.out is None:
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return 2
    if not galore_available():  # the comparison's third side: nothing to compare without it
        print(f"{ap.prog}: error: galore-torch (or its bitsandbytes) cannot be imported; "
              "pip install 'comera-framework[galore]'", file=sys.stderr)  # fmt: skip
        return 2
    # the points so far, beside (never over) efficiency.json: the last complete sweep stays
    partial = out / "efficiency.partial.json"
    partial.unlink(missing_ok=True)  # an older sweep's: never mistaken for this one's
    try:
        result = sweep(batches, args.repeats, args.threads, args.tiny, partial)
    except WorkerFailed as e:
        print(f"{ap.prog}: {str(e).splitlines()[0]}; the other points are in {partial}; "
              f"{out / 'efficiency.json'} was not replaced", file=sys.stderr)  # fmt: skip
        return 1
    if args.out is not None:  # the header's command names it, as the run needed it
        result["out"] = str(args.out)
    write_json(out / "efficiency.json", result)
    partial.unlink(missing_ok=True)
    print(write_report(result, out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
