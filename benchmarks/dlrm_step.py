"""One DLRM training step at the Kaggle table sizes, CoMERA vs dense, on CPU.

    python -m benchmarks.dlrm_step [--json]              # every variant, then the lookups
    python -m benchmarks.dlrm_step --out reports/dlrm_bench.json   # ... and the JSON, whole
    python -m benchmarks.dlrm_step --render FIGURES.json  # the tables of a saved --json

Every variant runs in a fresh process (``python -m benchmarks.dlrm_step --variant V``)
so its peak RSS is its own: the figure is the peak resident memory above the process's
baseline taken before the model is built. Variants, all through the shared trainer's
``train_step`` with the experiment's task (what training runs):

- ``comera``: TTM tables (d=4, rank 32) above 10,000 rows, TT ``bottom.1``/``top.1``,
  AdamW, table-batched lookup, CoMERA early stage (gate regularizer on);
- ``dense_sgd``: the reference's training: dense tables, SGD with sparse gradients;
- ``dense_adam``: dense tables under the shared AdamW (dense gradients and moments);
- ``comera`` and ``dense_sgd`` again under glibc's allocator as found
  (``cpu_malloc=default``), for comparison.

The headline variants run under the allocator policy DLRM trains with on CPU (the
presets' ``train.cpu_malloc``, ``lean``: see :mod:`experiments.malloc`); a variant's process
restarts itself for it exactly as the experiment's command does.

Batch 10,000; ids drawn per table as ``floor(n * u**3)`` (a heavy head, as Criteo's are);
step time is the median of :data:`STEPS` (10) timed steps after one warm-up step
(``--variant V --steps N``: N, for one variant); ``comera`` and
``dense_sgd`` under the training policy run :data:`ROUNDS` times, alternating, and keep
the median step time and peak of their runs. The lookup
comparison (``embedding_time_ratio_batched_vs_separate``) times the embedding stage
alone, forward and backward, table-batched vs one call per table, in
:data:`LOOKUP_ROUNDS` fresh processes under the training policy (the median of their
ratios; and once under glibc as found). On a GPU machine,
``python -m benchmarks.dlrm_step --embedding --device cuda`` times the same comparison
on the GPU (``make gpu-check`` runs it).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.reporting import (
    add_json_and_render,
    arg_parser,
    check_bench_device,
    check_output,
    one_line_errors,
    print_rendered,
    recorded_out,
    render_only,
    write_json,
)
from benchmarks.timing import medians_over, timed_steps
from comera.train.measures import baseline_rss_mb, peak_memory_mb
from experiments.host import cpu_model, report_header
from experiments.malloc import (
    CPU_MALLOC_POLICIES,
    apply_cpu_malloc,
    clean_malloc_env,
    hugepages_active,
    restart_for,
)
from experiments.workers import WorkerFailed, run_json_worker

__all__ = ["main", "render", "run", "run_variant"]

BATCH = 10_000
PROG = "python -m benchmarks.dlrm_step"
STEPS = 10  # timed steps per variant (median), after one warm-up step
VARIANTS = ("comera", "dense_sgd", "dense_adam")
AUTO = "auto"  # on request only (``--variant auto``): CoMERA's TT MLP layers on ``auto``
GLIBC_TAG = "@glibc_default"
# the headline pair (comera, dense_sgd) runs this many times, alternating, and each keeps
# the median of its runs: on a shared CPU a step's time drifts between processes (three
# single-run benches of the same code gave step ratios 1.10, 1.35 and 1.55)
ROUNDS = 3
# fresh processes of the lookup comparison under the training policy: one process's
# batched/separate ratio ranged 0.69-0.97 between processes on one machine
LOOKUP_ROUNDS = 5


def training_policy() -> str:
    """The CPU allocator policy DLRM training runs under (its presets' default)."""
    from experiments.dlrm.experiment import CPU_MALLOC

    return CPU_MALLOC


def _batch(cards: tuple[int, ...], n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    cat = torch.stack([(torch.rand(n, generator=g) ** 3 * c).long() for c in cards], 1)
    return {
        "dense": torch.rand(n, 13, generator=g) * 5,
        "cat": cat.clamp_max(torch.tensor(cards) - 1),
        "label": (torch.rand(n, generator=g) < 0.25).float(),
    }


def run_variant(variant: str, steps: int = STEPS, malloc: str = "default") -> dict:
    """Build the Kaggle-size model of ``variant``, take ``steps + 1`` training steps under
    the allocator policy ``malloc``."""
    import comera as C
    from comera.train import ComeraConfig, TrainConfig, Trainer
    from comera.train.optim import AdamWConfig
    from experiments.dlrm.model import DLRMConfig, dense_param_count, init_dlrm
    from experiments.dlrm.task import DLRMTask

    torch.manual_seed(0)
    apply_cpu_malloc(malloc)  # as the training command does before it builds the model
    base = baseline_rss_mb()
    dense = variant not in ("comera", AUTO)
    model = DLRMConfig(tt=not dense)
    batch = _batch(model.cardinalities, BATCH)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            steps=1000,
            run_dir=tmp,
            optimizer="sgd" if variant == "dense_sgd" else "adamw",
            optim=AdamWConfig(lr_cores=1e-3, lr_gates=1e-3, lr_rest=1e-3, weight_decay=0.0),
            comera=ComeraConfig(enabled=not dense, early_steps=500),
            grad_clip=None,
            cpu_malloc=malloc,
            wandb="disabled",
            progress=False,
        )
        t0 = time.perf_counter()
        params, state = init_dlrm(model, generator=torch.Generator().manual_seed(0))
        init_s = time.perf_counter() - t0
        plans = C.LayerPlans(default=AUTO) if variant == AUTO else None
        task = DLRMTask(model, None, None, sparse=variant == "dense_sgd", plans=plans)  # type: ignore[arg-type]
        trainer = Trainer(cfg, task, params, state, copy=False, auto_plans=plans is not None)
        del params, state
        times = timed_steps(lambda: trainer.train_step(batch), steps)
        size = C.param_count(trainer.params)
    return {
        "variant": variant,
        "params": size,
        "compression": dense_param_count(model) / size,
        "step_time_s": statistics.median(times),
        "peak_rss_mb": peak_memory_mb(torch.device("cpu")) - base,
        "init_s": init_s,
        "malloc": malloc,
        "hugepages": hugepages_active(),
    }


def embedding_times(repeats: int = 5, device: str = "cpu") -> dict:
    """Forward + backward of the embedding stage: table-batched vs one call per table, on
    ``device`` (on CUDA each timing ends with a synchronize: the kernels, not their
    launch)."""
    import dataclasses

    from experiments.dlrm.model import DLRMConfig, embed, init_dlrm, table_specs

    dev = torch.device(device)
    model = DLRMConfig()
    params, state = init_dlrm(model, generator=torch.Generator().manual_seed(0))
    params = torch.utils._pytree.tree_map(lambda t: t.to(dev), params)
    state = torch.utils._pytree.tree_map(lambda t: t.to(dev), state)
    leaves = [
        t.requires_grad_()
        for tab in params["tables"].values()
        for v in tab.values()
        for t in (v if isinstance(v, list) else [v])
    ]
    cat = _batch(model.cardinalities, BATCH)["cat"].to(dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    specs = table_specs(model)
    out = {}
    variants = {
        "batched": dataclasses.replace(model, batched_lookup=True),
        "separate": dataclasses.replace(model, batched_lookup=False),
    }
    times: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats + 1):
        for name, cfg in variants.items():
            sync()
            t = time.perf_counter()
            # dense gradients for the small dense tables, as CoMERA's training (AdamW)
            # takes them: sparse ones are the reference SGD's alone
            rows = embed(cfg, params, state, cat, sparse=False, specs=specs)
            torch.autograd.grad(rows.sum(), leaves, allow_unused=True)
            sync()
            times[name].append(time.perf_counter() - t)
    for name, ts in times.items():
        out[f"embedding_{name}_s"] = statistics.median(ts[1:])
    out["embedding_time_ratio_batched_vs_separate"] = (
        out["embedding_batched_s"] / out["embedding_separate_s"]
    )
    return {**out, "device": str(dev)}


def _in_child(args: list[str], what: str) -> dict:
    """``python -m benchmarks.dlrm_step ARGS`` in a fresh process whose own ``--malloc``
    policy (and restart) alone decides its allocator; its last stdout line as JSON. A
    failure ends the bench, naming the point and the child's stderr tail."""
    cmd = [sys.executable, "-m", "benchmarks.dlrm_step", *args]
    try:
        return run_json_worker(cmd, f"dlrm bench: {what}", env=clean_malloc_env())
    except WorkerFailed as e:
        raise SystemExit(str(e)) from None


def _embedding_in_process(malloc: str) -> dict:
    """:func:`embedding_times` in a fresh process under the allocator policy ``malloc``."""
    return _in_child(["--embedding", "--malloc", malloc], "lookup timing")


def _embedding_rounds(malloc: str, rounds: int) -> dict:
    """:func:`embedding_times` in ``rounds`` fresh processes under ``malloc``: the median
    of each process's batched/separate ratio (each measured side by side), the medians of
    the two times, and every process's ratio."""
    outs = [_embedding_in_process(malloc) for _ in range(rounds)]
    times = medians_over(outs, ("embedding_batched_s", "embedding_separate_s"), runs=False)
    return {**outs[0], **times,
            **medians_over(outs, ["embedding_time_ratio_batched_vs_separate"])}  # fmt: skip


def run(json_out: bool = False, out: Path | None = None) -> int:
    """Run every variant in a fresh process, then the lookup comparison; print the figures
    (``json_out``: as one JSON object), write them whole to ``out`` (a JSON file) if given,
    and return the exit status. ``--json > FILE`` emptied FILE before measuring, and left
    it empty when the run failed or was stopped."""
    if out is not None:
        check_output(out, "--out", "file")  # before measuring, not after
    results: dict[str, dict] = {}
    policy = training_policy()
    pair = [(v, v, policy) for v in ("comera", "dense_sgd")]
    runs = pair * ROUNDS + [("dense_adam", "dense_adam", policy)]
    if policy != "default":  # the same two under glibc as found, for comparison
        runs += [(f"{v}{GLIBC_TAG}", v, "default") for v in ("comera", "dense_sgd")]
    seen: dict[str, list[dict]] = {}
    for label, v, malloc in runs:
        seen.setdefault(label, []).append(
            _in_child(["--variant", v, "--malloc", malloc], f"variant {label}")
        )
    for label, outs in seen.items():
        results[label] = {**outs[0], "variant": label}
        if len(outs) > 1:
            results[label]["hugepages"] = all(o.get("hugepages", False) for o in outs)
            results[label].update(medians_over(outs, ("step_time_s", "peak_rss_mb")))
    emb = _embedding_rounds(policy, LOOKUP_ROUNDS)
    emb_glibc = _embedding_in_process("default") if policy != "default" else emb
    c, d, a = results["comera"], results["dense_sgd"], results["dense_adam"]
    saved_to = recorded_out({"out": out})
    figures = {
        "batch": BATCH,
        "compression_ratio": c["compression"],
        "peak_memory_ratio_vs_dense": c["peak_rss_mb"] / d["peak_rss_mb"],
        "peak_memory_ratio_vs_dense_adam": c["peak_rss_mb"] / a["peak_rss_mb"],
        "step_time_ratio_vs_dense": c["step_time_s"] / d["step_time_s"],
        "rounds": ROUNDS,
        "malloc": policy,
        **emb,
        "variants": results,
        "threads": torch.get_num_threads(),
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        # what measured it: --render of the saved figures names the same command
        "command": " ".join([PROG, *(["--json"] if json_out else []), *saved_to]),
    }
    figures["embedding_time_ratio_batched_vs_separate_glibc_default"] = emb_glibc[
        "embedding_time_ratio_batched_vs_separate"
    ]
    if f"comera{GLIBC_TAG}" in results:
        cg, dg = results[f"comera{GLIBC_TAG}"], results[f"dense_sgd{GLIBC_TAG}"]
        figures["peak_memory_ratio_vs_dense_glibc_default"] = cg["peak_rss_mb"] / dg["peak_rss_mb"]
        figures["step_time_ratio_vs_dense_glibc_default"] = cg["step_time_s"] / dg["step_time_s"]
    if out is not None:
        write_json(out, figures)
    print(json.dumps(figures, indent=1) if json_out else render(figures))
    return 0


def render(figures: dict) -> str:
    """The tables of a result (the ``--json`` object), from the result alone;
    ``--render JSON`` prints them for a saved result."""
    meta = {"cpu": figures.get("cpu"), "torch": figures.get("torch"), "date": figures.get("date")}
    # older figures record no command: they came from --json (> reports/dlrm_bench.json)
    command = figures.get("command", f"{PROG} --json")
    lines = report_header("DLRM training step at Kaggle table sizes: CoMERA vs dense",
                          command, meta)  # fmt: skip
    lines += [
        f"Batch {figures.get('batch', BATCH)}, {figures.get('threads', '?')} threads, "
        f"cpu_malloc={figures.get('malloc', 'not recorded')}.",
        "",
        "| variant | params | compression | step time (s) | peak RSS above baseline (MB) |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in figures.get("variants", {}).values():
        lines.append(
            f"| {r['variant']} | {r['params']:,} | {r['compression']:.1f}x | "
            f"{r['step_time_s']:.3f} | {r['peak_rss_mb']:.0f} |"
        )
    lines += ["", "| figure | value |", "|---|---:|"]
    lines += [
        f"| `{k}` | {v:.3f} |"
        for k, v in figures.items()
        if ("ratio" in k or k.startswith("embedding_")) and isinstance(v, int | float)
    ]
    return "\n".join([*lines, ""])


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.dlrm_step``: the whole bench, one variant or the lookup
    timing in this process (what the bench runs in each fresh process), or the tables of
    a saved result (``--render``)."""
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    add_json_and_render(ap, "measure nothing: print the tables of a saved --json result")
    ap.add_argument("--device", default="cpu",
                    help="cpu; cuda only for the lookup timing (--embedding)")  # fmt: skip
    one = ap.add_mutually_exclusive_group()  # what one process of the bench times
    one.add_argument("--variant", choices=(*VARIANTS, AUTO), help="one variant in this process")
    ap.add_argument("--steps", type=int, default=None,
                    help=f"with --variant: its timed steps (default {STEPS})")  # fmt: skip
    one.add_argument("--embedding", action="store_true", help="time the lookups only")
    ap.add_argument("--out", type=Path, default=None,
                    help="also write the result, whole, to this JSON file (e.g. "
                         "reports/dlrm_bench.json)")  # fmt: skip
    ap.add_argument("--malloc", choices=CPU_MALLOC_POLICIES, default=None,
                    help="with --variant or --embedding: the allocator policy (default: glibc "
                         "as found)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.render is not None:  # measuring flags beside it would do nothing
        render_only(ap, argv)
    if args.malloc is not None and not (args.variant or args.embedding):  # the bench sets each
        ap.error("--malloc applies to one process (--variant V or --embedding); the bench "
                 "runs each under its own policy")  # fmt: skip
    args.malloc = args.malloc or "default"

    def error(msg: str) -> int:
        print(f"{ap.prog}: error: {msg}", file=sys.stderr)
        return 2

    if args.render is not None:
        return print_rendered(args.render, render, ap.prog, ("variants",))
    if args.out is not None and (args.variant or args.embedding):
        ap.error("--out is the whole bench's result; one process (--variant, --embedding) "
                 "prints its own JSON")  # fmt: skip
    if args.steps is not None and not args.variant:  # the bench times STEPS of each
        ap.error(f"--steps applies to one variant (--variant V); the bench times {STEPS}")
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")
    check_bench_device(args.device)
    if torch.device(args.device).type != "cpu" and not args.embedding:
        return error(
            f"--device {args.device}: the dlrm step bench runs on the CPU; drop --device (the "
            "lookup alone runs on a GPU: python -m benchmarks.dlrm_step --embedding --device "
            "cuda)"
        )
    if (args.variant or args.embedding) and args.device == "cpu" and argv is None:
        restart_for(args.malloc)  # as the experiment's command does (lean: huge pages)
    if args.variant:
        steps = STEPS if args.steps is None else args.steps
        print(json.dumps(run_variant(args.variant, steps, malloc=args.malloc)))
    elif args.embedding:
        if torch.device(args.device).type == "cpu":
            apply_cpu_malloc(args.malloc)
        print(json.dumps({**embedding_times(device=args.device), "malloc": args.malloc}))
    else:
        return run(json_out=args.json, out=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
