"""One full training step of the paper-size MNLI model, CoMERA vs dense.

    python -m benchmarks.mnli_step [--json] [--device cuda]   # writes reports/mnli_bench.json
    python -m benchmarks.mnli_step --render reports/mnli_bench.json   # its tables, no run

A step is what training runs: the shared trainer's ``train_step`` on the experiment's
``MNLITask`` (cross-entropy, the early stage's objective with its gate regularizer for
CoMERA, gradient clipping, AdamW) on a synthetic batch of the paper's shape. Each
(variant, batch) runs in a fresh subprocess so its peak memory is its own: on CPU the
peak RSS above the process's RSS just before the model is built (``VmHWM`` delta); on
CUDA the allocator's peak above what was allocated before the model. Times are medians.
``galore`` is the dense model under GaLore-AdamW (galore-torch; rank 128, projection
refreshed every 200 steps, scale 0.25: the GaLore paper's settings, the paper's Figure 1
baseline). ``comera_recompute`` and ``dense_recompute`` (batch 32) recompute every block in
backward (``--recompute``). Each variant runs under the CPU allocator policy its training
command runs under: glibc as found (the default) for the plain variants, ``lean`` for the
recompute ones (``--recompute`` selects it; the worker restarts itself for it as the
command does); the recompute variants are also measured as found (``@glibc_default``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.reporting import (
    TINY_NEEDS_OUT,
    add_json_and_render,
    add_threads_flag,
    arg_parser,
    check_bench_device,
    check_output,
    measure_points,
    one_line_errors,
    print_rendered,
    recorded_out,
    reduced_run,
    render_only,
)
from benchmarks.timing import timed_steps
from comera.train.galore import import_galore
from comera.train.logging import write_json_atomic
from comera.train.measures import baseline_rss_mb, peak_memory_mb
from experiments.host import cpu_model, report_header
from experiments.malloc import (
    CPU_MALLOC_POLICIES,
    apply_cpu_malloc,
    clean_malloc_env,
    hugepages_active,
    restart_for,
)
from experiments.workers import run_json_worker

REPORT_JSON = Path(__file__).resolve().parent.parent / "reports" / "mnli_bench.json"
# a GPU run never replaces the CPU figures
GPU_REPORT_JSON = REPORT_JSON.parent / "gpu" / "mnli_bench_cuda.json"
BATCHES = (32, 1)
VARIANTS = ("comera", "dense", "comera_half", "galore", "comera_recompute", "dense_recompute")
# run on request only (``--worker auto``; ``benchmarks.plans`` does): CoMERA with every
# plan and lookup ``auto``, decided in the untimed warm-up step
AUTO = "auto"
RECOMPUTE_BATCH = 32  # the recompute variants run at this batch only
GLIBC_TAG = "@glibc_default"
SEQ = 128
PROG = "python -m benchmarks.mnli_step"
# keys of this benchmark's result alone (DLRM's, CodeBERT's and tensorize's results have
# step_time_ratio_vs_dense too): --render of another's is refused, not shown under this title
REQUIRED = ("step_time_ratio_vs_dense", "half_ranks")


def _tiny_config(tt: bool) -> object:
    """A few-thousand-parameter model for tests of the plumbing."""
    from experiments.transformer import EncoderConfig

    return EncoderConfig(
        tt=tt, vocab_size=64, max_len=SEQ, d_model=16, heads=2, ffn=32, layers=1, rank=4,
        attn_modes=((4, 4), (4, 4)), ffn_in_modes=((8, 4), (4, 4)), ffn_out_modes=((4, 4), (4, 8)),
        emb_vocab_modes=(8, 8), emb_dim_modes=(4, 4), emb_rank=4,
    )  # fmt: skip


def training_malloc(variant: str) -> str:
    """The CPU allocator policy the training command of ``variant`` runs under."""
    from experiments.cli import RECOMPUTE_CPU_MALLOC

    return RECOMPUTE_CPU_MALLOC if variant.endswith("_recompute") else "default"


def worker(
    variant: str,
    batch: int,
    repeats: int,
    device: str,
    threads: int,
    tiny: bool = False,
    malloc: str = "default",
) -> dict:
    """Build the model in this process and time ``repeats`` steps after one warm-up,
    under the CPU allocator policy ``malloc``. A step is the shared trainer's
    ``train_step`` on the experiment's ``MNLITask``: cross-entropy, the early stage's
    objective (CoMERA), clipping and AdamW, or GaLore-AdamW for ``galore``."""
    import tempfile

    import comera as C
    from comera.train import ComeraConfig, TrainConfig, Trainer
    from comera.train.galore import GaLoreConfig
    from comera.train.optim import AdamWConfig
    from experiments.mnli.experiment import MNLITask
    from experiments.transformer import EncoderConfig, init_encoder

    if variant == "galore":  # imports (transformers, bitsandbytes: ~130 MB) before the baseline
        import_galore()
    torch.set_num_threads(threads)
    dev = torch.device(device)
    if dev.type == "cpu":
        apply_cpu_malloc(malloc)  # as the training command does before it builds the model
    if dev.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = baseline_rss_mb()
    tt = not variant.startswith(("dense", "galore"))
    cfg = _tiny_config(tt) if tiny else EncoderConfig(tt=tt)
    if variant.endswith("_recompute"):  # every encoder block recomputed in backward
        cfg = dataclasses.replace(cfg, recompute=True)
    if variant == "comera_half":  # stand-in for a pruned model: every rank halved
        cfg = dataclasses.replace(cfg, rank=cfg.rank // 2, emb_rank=cfg.emb_rank // 2)
    plans = C.LayerPlans(default=AUTO, embedding_impl=AUTO) if variant == AUTO else None
    params, state = init_encoder(cfg, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    data = {
        "input_ids": torch.randint(0, cfg.vocab_size, (batch, SEQ), generator=g),
        "token_type_ids": (torch.arange(SEQ) >= SEQ // 2).long().expand(batch, SEQ).clone(),
        "attention_mask": torch.ones(batch, SEQ, dtype=torch.bool),
        "labels": torch.randint(0, 3, (batch,), generator=g),
    }
    data = {k: v.to(dev) for k, v in data.items()}
    with tempfile.TemporaryDirectory() as tmp:
        tcfg = TrainConfig(
            steps=1000,
            run_dir=tmp,
            device=device,
            optim=AdamWConfig(),
            # GaLore's paper settings on the encoder blocks' linears; its one SVD refresh
            # per 200 steps falls in the warm-up step, so timed steps do not include it
            optimizer="galore" if variant == "galore" else "adamw",
            galore=GaLoreConfig(rank=min(128, cfg.d_model // 2)),
            comera=ComeraConfig(enabled=tt, early_steps=500, reg_start_step=0),
            cpu_malloc=malloc,
            wandb="disabled",
            progress=False,
        )
        task = MNLITask(cfg, None, [], eval_batch_size=batch, plans=plans)  # type: ignore[arg-type]
        task.device = dev
        trainer = Trainer(tcfg, task, params, state, copy=False, auto_plans=plans is not None)
        del params, state

        def step() -> None:
            trainer.train_step(data)
            if dev.type == "cuda":
                torch.cuda.synchronize()

        times = timed_steps(step, repeats)
        size = C.param_count(trainer.params)
    if dev.type == "cuda":
        peak_mb = (torch.cuda.max_memory_allocated() - base) / 2**20
        how = "CUDA allocator peak above the pre-model baseline"
    else:
        peak_mb = peak_memory_mb(dev) - base
        how = "peak RSS (VmHWM) above the RSS before the model was built"
    return {
        "variant": variant,
        "batch": batch,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_mb": peak_mb,
        "peak_memory": how,
        "params": size,
        "device": device,
        "malloc": malloc if dev.type == "cpu" else None,
        "hugepages": hugepages_active(),
    }


def run_worker(
    variant: str,
    batch: int,
    repeats: int,
    device: str,
    threads: int,
    tiny: bool = False,
    malloc: str = "default",
) -> dict:
    """:func:`worker` in a fresh process (so its peak memory is its own)."""
    cmd = [
        sys.executable, "-m", "benchmarks.mnli_step", "--worker", variant,
        "--batch", str(batch), "--repeats", str(repeats), "--device", device,
        "--threads", str(threads), "--malloc", malloc, *(["--tiny"] if tiny else []),
    ]  # fmt: skip
    print(
        f"mnli bench: {variant}, batch {batch} x {SEQ}, cpu_malloc={malloc} ...",
        file=sys.stderr,
        flush=True,
    )
    env = clean_malloc_env()  # the worker's policy alone decides (restart included)
    return run_json_worker(cmd, f"bench worker {variant}/{batch}", env=env)


def galore_available() -> bool:
    """Whether the GaLore baseline can run here: ``galore_torch`` imports (it imports
    bitsandbytes too), which the ``galore`` extra installs."""
    try:
        import_galore()
    except Exception:  # ImportError, or bitsandbytes failing its own setup
        return False
    return True


def run(
    *,
    json_out: bool = False,
    device: str | None = None,
    repeats: int = 5,
    threads: int = 2,
    tiny: bool = False,
    out: Path | None = None,
) -> int:
    """Run every (variant, batch) in its own subprocess and write ``out`` (JSON; default
    ``reports/mnli_bench.json`` on the CPU, ``reports/gpu/mnli_bench_cuda.json`` on a GPU);
    print it (``json_out``) or its tables. Returns the exit status.

    ``tiny`` swaps in a toy model: it checks the plumbing, it measures nothing useful."""
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    given_out = out  # the header's command names it, as the run needed it
    out = out or (REPORT_JSON if torch.device(device).type == "cpu" else GPU_REPORT_JSON)
    check_output(out, "--out", "file")  # before measuring, not after
    # the workers' results so far, beside (never over) ``out``: a run stopped by a time
    # limit keeps what it measured, and the last complete figures stay where they were
    partial = out.with_name(out.stem + ".partial.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    partial.unlink(missing_ok=True)  # an older run's: never mistaken for this one's
    variants = VARIANTS
    if not galore_available():
        variants = tuple(v for v in VARIANTS if v != "galore")
        print(
            "mnli bench: galore-torch (or its bitsandbytes) cannot be imported, so the GaLore "
            "variant and its ratios are left out (pip install 'comera-framework[galore]')",
            file=sys.stderr,
        )
    head = {"partial": True, "device": device, "torch": torch.__version__,
            "date": time.strftime("%Y-%m-%d")}  # fmt: skip
    points = [(v, b) for b in BATCHES for v in variants
              if not v.endswith("_recompute") or b == RECOMPUTE_BATCH]  # fmt: skip
    results, failed = measure_points(
        points,
        lambda v, b: run_worker(v, b, repeats, device, threads, tiny,
                                training_malloc(v) if device == "cpu" else "default"),
        partial,
        head,
    )  # fmt: skip
    galore_error = None
    if failed and all(f.startswith("galore/") for f in failed):
        # GaLore is an optional baseline (an extra package): its failing alone (say,
        # bitsandbytes on this CUDA) leaves the other figures whole; say why it is missing
        galore_error = next(r["error"] for r in results if "error" in r)
        results = [r for r in results if r["variant"] != "galore"]
        variants = tuple(v for v in variants if v != "galore")
        print(f"mnli bench: GaLore failed ({galore_error}); its ratios are left out",
              file=sys.stderr)  # fmt: skip
    elif failed:  # no summary from an incomplete run: the last complete figures stay
        print(f"mnli bench: {', '.join(failed)} failed; the other points are in {partial}; "
              f"{out} was not replaced", file=sys.stderr)  # fmt: skip
        return 1
    extra = []  # the recompute variants as found, and plain dense under their policy
    for variant in ("comera_recompute", "dense_recompute"):
        if device == "cpu" and training_malloc(variant) != "default":
            r = run_worker(variant, RECOMPUTE_BATCH, repeats, device, threads, tiny, "default")
            extra.append({**r, "variant": f"{variant}{GLIBC_TAG}"})
    lean = training_malloc("comera_recompute")
    if device == "cpu" and lean != "default":
        r = run_worker("dense", RECOMPUTE_BATCH, repeats, device, threads, tiny, lean)
        extra.append({**r, "variant": f"dense@{lean}"})
    by = {(r["variant"], r["batch"]): r for r in results + extra}
    summary = {
        "step_time_ratio_vs_dense": by["comera", 32]["step_s"] / by["dense", 32]["step_s"],
        "step_time_ratio_vs_dense_b1": by["comera", 1]["step_s"] / by["dense", 1]["step_s"],
        "peak_memory_ratio_vs_dense": by["comera", 1]["peak_mb"] / by["dense", 1]["peak_mb"],
        "peak_memory_ratio_vs_dense_b32": by["comera", 32]["peak_mb"] / by["dense", 32]["peak_mb"],
        "compression_ratio": by["dense", 32]["params"] / by["comera", 32]["params"],
        # --recompute at batch 32: both recomputing, and CoMERA recomputing vs dense not
        "peak_memory_ratio_vs_dense_b32_recompute": by["comera_recompute", 32]["peak_mb"]
        / by["dense_recompute", 32]["peak_mb"],
        # CoMERA recomputing vs dense not, both under the recompute runs' policy
        "peak_memory_ratio_recompute_vs_dense_b32": by["comera_recompute", 32]["peak_mb"]
        / by[(f"dense@{lean}" if extra else "dense"), 32]["peak_mb"],
        # the same, each under its own command's policy (dense: glibc as found)
        "peak_memory_ratio_recompute_vs_dense_b32_each_own_policy": by["comera_recompute", 32][
            "peak_mb"
        ]
        / by["dense", 32]["peak_mb"],
        "step_time_ratio_vs_dense_b32_recompute": by["comera_recompute", 32]["step_s"]
        / by["dense_recompute", 32]["step_s"],
        # GaLore (the dense model, GaLore-AdamW rank 128, gap 200, scale 0.25) at batch 1
        **(
            {
                "step_time_ratio_vs_galore": by["comera", 1]["step_s"] / by["galore", 1]["step_s"],
                "peak_memory_ratio_vs_galore": by["comera", 1]["peak_mb"]
                / by["galore", 1]["peak_mb"],
                "step_time_ratio_vs_galore_b32": by["comera", 32]["step_s"]
                / by["galore", 32]["step_s"],
                "peak_memory_ratio_vs_galore_b32": by["comera", 32]["peak_mb"]
                / by["galore", 32]["peak_mb"],
            }
            if "galore" in variants
            else {}
        ),
        **(
            {
                "peak_memory_ratio_vs_dense_b32_recompute_glibc_default": by[
                    f"comera_recompute{GLIBC_TAG}", 32
                ]["peak_mb"]
                / by[f"dense_recompute{GLIBC_TAG}", 32]["peak_mb"],
                "peak_memory_ratio_recompute_vs_dense_b32_glibc_default": by[
                    f"comera_recompute{GLIBC_TAG}", 32
                ]["peak_mb"]
                / by["dense", 32]["peak_mb"],
            }
            if extra
            else {}
        ),
        "half_ranks": {
            "step_time_ratio_vs_dense": by["comera_half", 32]["step_s"] / by["dense", 32]["step_s"],
            "peak_memory_ratio_vs_dense": by["comera_half", 1]["peak_mb"]
            / by["dense", 1]["peak_mb"],
            "compression_ratio": by["dense", 32]["params"] / by["comera_half", 32]["params"],
        },
        **({"galore_error": galore_error} if galore_error else {}),
        **({"tiny": True} if tiny else {}),
        **({"out": str(given_out)} if given_out is not None else {}),
        "device": device,
        "threads": threads,
        "cpu": cpu_model(),
        "repeats": repeats,
        "peak_memory": results[0]["peak_memory"],
        "date": time.strftime("%Y-%m-%d"),
        "torch": torch.__version__,
        "runs": results + extra,
    }
    write_json_atomic(out, summary)
    partial.unlink(missing_ok=True)
    print(json.dumps(summary) if json_out else render(summary))
    return 1 if galore_error else 0  # written, but a point failed: the run says so


def command(result: dict) -> str:
    """The command line that measured ``result``: the flags that differ from the defaults
    (the device and the thread count are always named: their defaults are the machine's)."""
    parts = ["python -m benchmarks.mnli_step", "--device", str(result.get("device", "cpu"))]
    parts += ["--repeats", str(result["repeats"])] if result.get("repeats", 5) != 5 else []
    parts += ["--threads", str(result["threads"])] if "threads" in result else []
    parts += ["--tiny"] if result.get("tiny") else []
    return " ".join(parts + recorded_out(result))


def _ratio_rows(result: dict, prefix: str = "") -> list[str]:
    """``| key | value |`` for every ratio in ``result`` (nested dicts under ``prefix.``)."""
    rows = []
    for k, v in result.items():
        if isinstance(v, dict) and k != "runs":
            rows += _ratio_rows(v, f"{prefix}{k}.")
        elif "ratio" in k and isinstance(v, int | float):
            rows.append(f"| `{prefix}{k}` | {v:.3f} |")
    return rows


def render(result: dict) -> str:
    """The tables of a result (the ``--json`` object: every point and every ratio), from
    the result alone; ``--render JSON`` prints them for a saved result."""
    meta = {"cpu": result.get("cpu"), "torch": result.get("torch"), "date": result.get("date")}
    lines = report_header("MNLI training step: CoMERA vs dense", command(result), meta)
    lines += [
        f"Device {result.get('device', 'not recorded')}, {result.get('threads', '?')} threads; "
        f"step time the median of {result.get('repeats', '?')} steps after a warm-up; peak "
        f"memory: {result.get('peak_memory', 'not recorded')}.",
        "",
        "| variant | batch | step (ms) | peak (MB) | params | cpu_malloc |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for r in result.get("runs", []):
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['batch']} | failed: {r['error']} | | | |")
            continue
        lines.append(
            f"| {r['variant']} | {r['batch']} | {r['step_s'] * 1e3:.1f} | {r['peak_mb']:.1f} | "
            f"{r['params']:,} | {r.get('malloc') or ''} |"
        )
    lines += ["", "| ratio | value |", "|---|---:|", *_ratio_rows(result), ""]
    if "galore_error" in result:
        lines += [f"GaLore failed: {result['galore_error']}", ""]
    return "\n".join(lines)


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.mnli_step``: the whole bench, one worker (``--worker``, what
    the bench runs in each fresh process) or the tables of a saved result (``--render``)."""
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    add_json_and_render(ap, "measure nothing: print the tables of a saved result")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda where present)")
    ap.add_argument("--repeats", type=int, default=5)
    add_threads_flag(ap)
    ap.add_argument(
        "--out",
        type=Path,
        default=None,
        help="the JSON written (default reports/mnli_bench.json; on cuda "
        "reports/gpu/mnli_bench_cuda.json)",
    )
    ap.add_argument("--tiny", action="store_true", help="toy model (tests)")
    ap.add_argument("--worker", choices=(*VARIANTS, AUTO), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--batch", type=int, default=None, help=argparse.SUPPRESS)  # default 32
    ap.add_argument("--malloc", choices=CPU_MALLOC_POLICIES, default=None,
                    help=argparse.SUPPRESS)  # fmt: skip
    a = ap.parse_args(argv)
    if a.render is not None:  # measuring flags beside it would do nothing
        render_only(ap, argv)
    for flag, value in (("--batch", a.batch), ("--malloc", a.malloc)):
        if value is not None and not a.worker:  # the bench sets each worker's own
            ap.error(f"{flag} applies to one worker (--worker V); the bench sets each point's")
    a.batch = 32 if a.batch is None else a.batch
    if a.batch < 1:  # an empty batch: a traceback in the worker's first step
        ap.error(f"--batch must be >= 1, got {a.batch}")
    a.malloc = a.malloc or "default"
    if a.render is not None:
        return print_rendered(a.render, render, ap.prog, REQUIRED)
    if a.repeats < 1 or a.threads < 1:
        print(f"{ap.prog}: error: --repeats and --threads must be >= 1, got {a.repeats}, "
              f"{a.threads}", file=sys.stderr)  # fmt: skip
        return 2
    if a.tiny and a.out is None and not a.worker:  # toy figures must not pass for the report
        print(f"{ap.prog}: error: {TINY_NEEDS_OUT}", file=sys.stderr)
        return 2
    why = reduced_run({"--repeats": (a.repeats, ap.get_default("repeats"))}, "--out")
    if why is not None and a.out is None and not a.worker:
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return 2
    if a.device is not None and not a.worker:  # the bench checked its workers' device
        check_bench_device(a.device)
    if a.worker:
        dev = a.device or "cpu"
        if dev == "cpu" and argv is None:  # a command: re-executed as the training one is
            restart_for(a.malloc)  # (lean: huge pages)
        print(json.dumps(worker(a.worker, a.batch, a.repeats, dev, a.threads, a.tiny, a.malloc)))
        return 0
    return run(json_out=a.json, device=a.device, repeats=a.repeats, threads=a.threads,
               tiny=a.tiny, out=a.out)  # fmt: skip


if __name__ == "__main__":
    raise SystemExit(main())
