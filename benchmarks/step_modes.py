"""Step modes measured where users run them: the trainer's ``train_step`` on MNLI, CoMERA,
under ``train.step_mode`` eager, sync_free and compile (``cuda_graph`` needs a GPU).

    python -m benchmarks.step_modes [--models smoke,paper] [--repeats 10] [--threads 2]
    python -m benchmarks.step_modes --render reports/step_modes.json   # the report, no run

Two models: the ``smoke`` preset as it trains (batch 128 x 16 tokens) and the ``paper``
preset's six-encoder model and training settings (gate regularizer from step 0, its
schedule and clipping) at batch 32 x 128 tokens, both on the generated MNLI task. Each
(model, mode) point runs in a fresh process: build the task and trainer, one step (which
compiles, for ``compile``; for ``cuda_graph``, the capture, after its eager warm-up
steps), two more untimed steps, then ``repeats`` timed steps; the
median is reported. Writes ``reports/step_modes.json`` and
``reports/step_modes.md``, rendered from it alone. Each worker applies the preset's
``train.cpu_malloc`` as the training command does (glibc as found, the default).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.reporting import (
    TINY_NEEDS_OUT,
    add_threads_flag,
    arg_parser,
    check_bench_device,
    check_output,
    one_line_errors,
    recorded_out,
    reduced_run,
    render_only,
    render_refusal,
    render_saved,
    write_text,
)
from comera.train.measures import baseline_rss_mb, peak_memory_mb
from comera.train.sync_free import WARMUP_STEPS
from experiments.host import cpu_model, report_header
from experiments.workers import WorkerFailed, run_json_worker

__all__ = ["MODES", "main", "render", "worker", "write_report"]

REPORTS = Path(__file__).resolve().parent.parent / "reports"
PROG = "python -m benchmarks.step_modes"
MODES = ("eager", "sync_free", "compile", "cuda_graph")
DEFAULT_MODELS = ("smoke", "paper")
# each model's dense baseline too (``--dense``'s model, CoMERA off), for side-by-side ratios
MODELS = (*DEFAULT_MODELS, *(f"{m}_dense" for m in DEFAULT_MODELS))


def point_preset(model: str, mode: str, run_dir: str, tiny: bool = False,
                 device: str = "cpu") -> Any:  # fmt: skip
    """The MNLI preset one point trains: ``smoke`` as it is, or the ``paper`` preset's
    model and training (its objective from step 0, its schedule and clipping) on the
    generated task at 128 tokens; ``mode`` as the step mode, no wandb or progress bar.
    ``<model>_dense``: that model's dense baseline, as ``--dense`` trains it."""
    from experiments.mnli import experiment as mnli

    model, _, dense = model.partition("_")
    p = mnli.preset("smoke", run_dir=run_dir)
    if model == "paper":
        paper = mnli.preset("paper", run_dir=run_dir)
        p.model, p.train = paper.model, paper.train
        p.data = dataclasses.replace(p.data, max_length=128)
        p.batch_size = paper.batch_size
    if tiny:  # the test's size: a few steps of a small slice
        p.batch_size = min(p.batch_size, 8)
    p.data = dataclasses.replace(p.data, generated_train=max(4 * p.batch_size, 256),
                                 generated_eval=32)  # fmt: skip
    p.train = dataclasses.replace(
        p.train, step_mode=mode, wandb="disabled", progress=False, device=device
    )
    if dense:  # the CLI's --dense switch
        p.dense = True
        p.train = dataclasses.replace(
            p.train, comera=dataclasses.replace(p.train.comera, enabled=False)
        )
    return p


def worker(
    model: str, mode: str, repeats: int, threads: int, tiny: bool = False, device: str = "cpu"
) -> dict:
    """Time the trainer's step for one (model, mode) in this process."""
    from comera.train import Trainer
    from experiments.malloc import apply_cpu_malloc
    from experiments.mnli import experiment as mnli

    torch.set_num_threads(threads)
    base = baseline_rss_mb()
    p = point_preset(model, mode, tempfile.mkdtemp(prefix="step_modes_"), tiny, device)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        apply_cpu_malloc(p.train.cpu_malloc)  # as the training command does before building
    task, params, state, _ = mnli.build(p)
    trainer = Trainer(p.train, task, params, state, copy=False)
    it = iter(task.train_iter)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    # the first step pays the one-time cost: compilation, or for cuda_graph the capture,
    # which follows its eager warm-up steps (untimed here)
    warmup = WARMUP_STEPS if mode == "cuda_graph" else 0
    for _ in range(warmup):
        trainer.train_step(next(it))
    sync()
    t0 = time.perf_counter()
    trainer.train_step(next(it))
    sync()
    first = time.perf_counter() - t0
    for _ in range(2):
        trainer.train_step(next(it))
    times, loss = [], float("nan")
    for _ in range(repeats):
        batch = next(it)
        t0 = time.perf_counter()
        loss = trainer.train_step(batch)["loss"]
        if device.startswith("cuda"):  # eager returns with the update still queued
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return {
        "model": model,
        "mode": mode,
        "batch": p.batch_size,
        "seq": p.data.max_length,
        "first_step_s": first,
        "first_step_includes": {"compile": "compilation", "cuda_graph": "capture"}.get(mode),
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_mb": peak_memory_mb(trainer.device) - base,
        "device": device,
        "loss": loss,
        "threads": threads,
    }


def run_point(
    model: str,
    mode: str,
    repeats: int,
    threads: int,
    tiny: bool = False,
    device: str = "cpu",
    timeout: float | None = None,
) -> dict:
    """:func:`worker` in a fresh process; a worker past ``timeout`` seconds (a compile
    that runs long) is killed and reported as failed, like any failing worker."""
    cmd = [sys.executable, "-m", "benchmarks.step_modes", "--worker", model, mode,
           "--repeats", str(repeats), "--threads", str(threads), "--device", device]  # fmt: skip
    cmd += ["--tiny"] if tiny else []
    print(f"step modes: {model} / {mode} ...", file=sys.stderr, flush=True)
    what = f"step-mode worker {model}/{mode}"
    try:
        return run_json_worker(cmd, what, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise WorkerFailed(what, f"stopped after --point-timeout {timeout:g} s") from None


def command(result: dict) -> str:
    """The command line that measured ``result`` (models and modes read off its rows)."""
    runs = [r for r in result.get("runs", []) if "mode" in r]
    models = list(dict.fromkeys(r["model"] for r in runs))
    modes = list(dict.fromkeys(r["mode"] for r in runs))
    parts = ["python -m benchmarks.step_modes"]
    parts += ["--tiny"] if result.get("tiny") else []
    if models and models != list(DEFAULT_MODELS):
        parts += ["--models", ",".join(models)]
    if modes and modes != ["eager", "sync_free", "compile"]:
        parts += ["--modes", ",".join(modes)]
    if result.get("repeats", 10) != 10:
        parts += ["--repeats", str(result["repeats"])]
    if "threads" in result:  # always: the default is the machine's own count
        parts += ["--threads", str(result["threads"])]
    if result.get("device", "cpu") != "cpu":
        parts += ["--device", str(result["device"])]
    return " ".join(parts + recorded_out(result))


def render(result: dict) -> str:
    """The markdown report of a result (``step_modes.json``), from the result alone: after
    a run, and with ``--render JSON`` for a saved one."""
    device = result.get("device", "cpu")
    on_cpu = device.startswith("cpu")
    threads = result.get("threads", "an unrecorded number of")
    runs = result["runs"]
    dense = any(r["model"].endswith("_dense") for r in runs)
    title = f"Step modes: eager vs sync-free vs torch.compile ({'CPU' if on_cpu else device})"
    lines = [
        *report_header(title, command(result), result),
        f"Device {device}"
        + (f", {threads} threads, glibc malloc as found. " if on_cpu else ". ")
        + "The trainer's `train_step` (CoMERA, early stage, AdamW"
        + (
            "; a `_dense` model: its dense baseline, CoMERA off, and `vs dense` CoMERA's "
            "step time over its dense baseline's in the same mode"
            if dense
            else ""
        )
        + ") on the generated MNLI task, with each preset's "
        "training settings (smoke: its first steps, before its gate regularizer starts at "
        "step 1000; paper: the regularizer from step 0); a fresh process per row; "
        f"median of {result.get('repeats', 10)} steps after the first and two more untimed ones.",
        "",
        "| model | batch x seq | mode | first step (s) | step (s) | vs eager | "
        + ("vs dense | " if dense else "")
        + "peak MB |",
        "|---|---|---|---:|---:|---:|" + ("---:|" if dense else "") + "---:|",
    ]
    for r in runs:
        eager = next((x for x in runs if x["model"] == r["model"] and x["mode"] == "eager"), None)
        ratio = "-" if eager is None else f"{eager['step_s'] / r['step_s']:.2f}x"
        base = next((x for x in runs if x["model"] == f"{r['model']}_dense"
                     and x["mode"] == r["mode"]), None)  # fmt: skip
        vs_dense = "-" if base is None else f"{r['step_s'] / base['step_s']:.2f}"
        lines.append(
            f"| {r['model']} | {r['batch']} x {r['seq']} | {r['mode']} | {r['first_step_s']:.1f} "
            f"| {r['step_s']:.4f} | {ratio} | "
            + (f"{vs_dense} | " if dense else "")
            + f"{r['peak_mb']:.0f} |"
        )
    lines += [
        "",
        "`vs eager` is eager's step time over this mode's (above 1: faster). `first step` "
        "includes compilation for `compile`"
        + (
            " and, after its eager warm-up steps, the capture for `cuda_graph`"
            if any(r.get("first_step_includes") == "capture" for r in runs)
            else ""
        )
        + "; it is paid again after every compaction (the "
        "parameter shapes change), not after a prune. `peak MB` is the process's peak above "
        "its baseline (CPU: peak RSS, compilation included; CUDA: the allocator's peak). "
        "`cuda_graph` runs on a GPU only (`--device cuda`). With dropout (the paper model's "
        "0.1) `compile` draws other dropout masks than eager, so its losses are not "
        "comparable with eager's.",
        "",
    ]
    return "\n".join(lines)


def write_report(result: dict, out_dir: Path = REPORTS) -> str:
    """``step_modes.json`` and ``step_modes.md`` (rendered from it); returns the markdown."""
    write_text(out_dir / "step_modes.json", json.dumps(result, indent=2) + "\n")
    md = render(result)
    write_text(out_dir / "step_modes.md", md)
    return md


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__)
    ap.add_argument(
        "--models",
        default=",".join(DEFAULT_MODELS),
        help=f"comma-separated, of {','.join(MODELS)} (_dense: the dense baseline)",
    )
    ap.add_argument("--modes", default="eager,sync_free,compile", help=f"comma-separated: {MODES}")
    ap.add_argument("--repeats", type=int, default=10)
    add_threads_flag(ap)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (for cuda_graph)")
    ap.add_argument(
        "--out", type=Path, default=None, help="report dir (default reports/; cuda: reports/gpu/)"
    )
    ap.add_argument(
        "--point-timeout",
        type=float,
        default=None,
        help="seconds a point may take (failed past it)",
    )
    ap.add_argument("--render", type=Path, metavar="JSON",
                    help="measure nothing: render step_modes.md into --out (default reports/) "
                    "from a saved step_modes.json")  # fmt: skip
    ap.add_argument("--worker", nargs=2, metavar=("MODEL", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.render is not None:
        render_only(ap, argv, ("out",))  # measuring flags beside it would do nothing
        done = render_saved(args.render, render, ap.prog, ("runs",))
        if done is None:
            return 2
        why = render_refusal(done[0], args.out)
        if why is not None:
            print(f"{ap.prog}: error: {args.render}: {why}", file=sys.stderr)
            return 2
        # a GPU result goes where measuring it would write, never over the CPU report
        on_cpu = str(done[0].get("device", "cpu")).startswith("cpu")
        md = done[1]
        out = args.out or (REPORTS if on_cpu else REPORTS / "gpu")
        check_output(out, "--out", "folder")
        write_text(out / "step_modes.md", md)
        print(md)
        return 0
    if args.worker:
        result = worker(*args.worker, args.repeats, args.threads, args.tiny, args.device)
        print(json.dumps(result))
        return 0
    # a name given twice is measured once (the order kept)
    models = list(dict.fromkeys(m for m in args.models.split(",") if m))
    modes = list(dict.fromkeys(m for m in args.modes.split(",") if m))
    if "cuda_graph" in modes and not args.device.startswith("cuda"):
        ap.error("--modes cuda_graph needs --device cuda")
    for flag, given, known in (("--models", models, MODELS), ("--modes", modes, MODES)):
        unknown = [m for m in given if m not in known]
        if unknown:
            ap.error(f"{flag} {args.models if flag == '--models' else args.modes}: unknown "
                     f"{', '.join(unknown)}; choose from {','.join(known)}")  # fmt: skip
    if not models:  # an empty table would replace the report (no --modes is eager alone)
        ap.error(f"--models needs at least one of {MODELS}")
    if args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if args.threads < 1:  # each worker would fail in torch.set_num_threads
        ap.error(f"--threads must be >= 1, got {args.threads}")
    if args.point_timeout is not None and not args.point_timeout > 0:  # every point would fail
        ap.error(f"--point-timeout must be > 0 s, got {args.point_timeout:g}")
    if args.tiny and args.out is None:  # toy figures must not replace the report's
        ap.error(TINY_NEEDS_OUT)
    # what the points measure: eager always comes first (every ratio is against it); on
    # a GPU the default place is reports/gpu/, where no step_modes report is committed
    default_modes = {"eager", *ap.get_default("modes").split(",")}
    check_bench_device(args.device)  # before torch.device reads it (a traceback)
    why = reduced_run({"--models": (set(models), set(ap.get_default("models").split(","))),
                       "--modes": ({"eager", *modes}, default_modes),
                       "--repeats": (args.repeats, ap.get_default("repeats"))},
                      "--out")  # fmt: skip
    if why is not None and args.out is None and torch.device(args.device).type == "cpu":
        ap.error(why)
    modes = ["eager", *[m for m in modes if m != "eager"]]  # every ratio is against it
    out = args.out or (REPORTS if torch.device(args.device).type == "cpu" else REPORTS / "gpu")
    check_output(out, "--out", "folder")  # before measuring, not after
    out.mkdir(parents=True, exist_ok=True)
    runs: list[dict] = []
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "threads": args.threads, "cpu": cpu_model(), "repeats": args.repeats,
              "device": args.device, "runs": runs}  # fmt: skip
    if args.tiny:  # a toy size: the report's command says so
        result["tiny"] = True
    if args.out is not None:  # the header's command names it, as the run needed it
        result["out"] = str(args.out)
    # the points so far go beside the report, never over it: a run cut short (a time
    # limit, a failing mode) keeps what it measured and the last complete report stays
    partial = out / "step_modes.partial.json"
    partial.unlink(missing_ok=True)  # an older run's: never mistaken for this one's
    failed = []
    for m in models:
        for mode in modes:
            try:
                runs.append(run_point(m, mode, args.repeats, args.threads, args.tiny,
                                      args.device, args.point_timeout))  # fmt: skip
            except WorkerFailed as e:  # one mode failing (a compile error, say) stops no other
                print(e, file=sys.stderr, flush=True)
                runs.append({"model": m, "mode": mode, "error": e.reason})
                failed.append(f"{m}/{mode}")
            write_text(partial, json.dumps({"partial": True, **result}, indent=2) + "\n")
    if failed:  # not a complete run: the last complete report stays, the points are kept
        print(f"step_modes: {', '.join(failed)} failed; the other points are in {partial}; "
              "the report was not replaced", file=sys.stderr)  # fmt: skip
        return 1
    print(write_report(result, out))
    partial.unlink(missing_ok=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
