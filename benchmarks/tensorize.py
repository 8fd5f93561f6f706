"""GPT-2 small tensorized by ``comera.tensorize_``: one training step, CoMERA vs dense, CPU.

    python -m benchmarks.tensorize [--json]                  # writes reports/tensorize.json, .md
    python -m benchmarks.tensorize --render reports/tensorize.json   # the tables, no run

The model is ``transformers``' ``GPT2LMHeadModel`` at GPT-2 small's shapes (12 x 768,
vocabulary 50,257, 124M parameters), built from a config with random weights (no
download). CoMERA: every attention and MLP projection (``c_attn``, ``c_proj``, ``c_fc``)
and the token embedding tensorized (:data:`TARGET`, ranks :data:`RANK` and
:data:`EMBEDDING_RANK`, drawn at random), the LM head tied to the TTM table. A step is
what training runs: the shared trainer's ``train_step`` on a
:class:`comera.train.ModuleTask` (next-token loss, the CoMERA early-stage objective,
clipping, AdamW); dense is the same model untouched under the same trainer. Each
(variant, batch) runs in a fresh process (``--variant V --batch B``), so its peak memory
is its own: the peak RSS while training above the RSS before the model was built (the
record of the peak is reset once the model is built, so GPT-2's dense construction before
it is tensorized, a one-time cost, is not in it; it is kept as ``build_peak_mb``).
Sequence 256; step time at batch 4 (median of the timed steps after one warm-up step),
peak memory at batch 1.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.reporting import (
    TINY_NEEDS_OUT,
    add_json_and_render,
    arg_parser,
    check_output,
    one_line_errors,
    print_rendered,
    recorded_out,
    reduced_run,
    render_only,
    variant_batch,
    write_json,
    write_text,
)
from benchmarks.timing import timed_steps
from comera.train.measures import baseline_rss_mb, peak_memory_mb
from experiments.host import host_meta, report_header
from experiments.workers import WorkerFailed, run_json_worker

__all__ = ["main", "render", "run", "run_variant"]

REPORTS = Path(__file__).resolve().parents[1] / "reports"
PROG = "python -m benchmarks.tensorize"
SEQ = 256
TARGET = ("c_attn", "c_proj", "c_fc", "wte")
RANK, EMBEDDING_RANK = 32, 32
STEPS = 3
RUNS = (("comera", 4), ("dense", 4), ("comera", 1), ("dense", 1))
TARGETS = {"step_time_ratio_vs_dense": 0.6, "peak_memory_ratio_vs_dense": 0.35}


def _model(tiny: bool) -> torch.nn.Module:
    import transformers

    cfg = (transformers.GPT2Config(vocab_size=96, n_positions=64, n_embd=32, n_layer=1, n_head=4)
           if tiny else transformers.GPT2Config())  # fmt: skip
    return transformers.GPT2LMHeadModel(cfg)


def _seq(tiny: bool) -> int:
    """The sequence length a run uses (the toy model's is shorter)."""
    return 32 if tiny else SEQ


def _ranks(tiny: bool) -> tuple[int, int]:
    """The linear and embedding ranks a run uses (the toy model's are smaller)."""
    return (4, 4) if tiny else (RANK, EMBEDDING_RANK)


def _reset_peak() -> bool:
    """Reset the kernel's record of this process's peak RSS to its current RSS (Linux
    ``clear_refs``); False where it cannot."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def run_variant(variant: str, batch: int, steps: int = STEPS, tiny: bool = False) -> dict:
    """Build ``variant`` in this process and time ``steps`` trainer steps after one."""
    import transformers  # noqa: F401 - imported before the baseline: its code is not the model's

    import comera as C
    from comera.train import ComeraConfig, TrainConfig
    from comera.train.module_task import ModuleTask

    torch.manual_seed(0)
    base = baseline_rss_mb()
    model = _model(tiny)
    dense_params = sum(p.numel() for p in model.parameters())
    if variant == "comera":
        rank, emb = _ranks(tiny)
        C.tensorize_(model, C.TensorizeConfig(target_modules=TARGET, rank=rank, init="random",
                                              rank_for=(("wte", emb),)))  # fmt: skip
    seq = _seq(tiny)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)

    def loss(call, batch_ids):
        return call(input_ids=batch_ids, labels=batch_ids).loss

    task = ModuleTask(model, loss, iter(()))
    # GPT-2 is built dense and then tensorized: the build's peak is a one-time cost, kept
    # as build_peak_mb; peak_mb is training's (the peak is reset once the model is built)
    build_peak = peak_memory_mb(torch.device("cpu")) - base
    reset = _reset_peak()
    with tempfile.TemporaryDirectory() as tmp:
        comera = ComeraConfig(enabled=variant == "comera", early_steps=500)
        cfg = TrainConfig(steps=1000, run_dir=tmp, wandb="disabled", progress=False,
                          comera=comera)  # fmt: skip
        trainer = task.trainer(cfg)
        times = timed_steps(lambda: trainer.train_step(ids), steps)
        params = C.param_count(trainer.params)
    return {
        "variant": variant,
        "batch": batch,
        "params": params,
        "dense_params": dense_params,
        "step_s": statistics.median(times),
        "step_s_all": times,
        "peak_mb": peak_memory_mb(torch.device("cpu")) - base,  # since the reset, if any
        "peak_reset_after_build": reset,
        "build_peak_mb": build_peak,
    }


def run(*, json_out: bool = False, steps: int = STEPS, tiny: bool = False,
        out: Path = REPORTS / "tensorize.json") -> int:  # fmt: skip
    """Every (variant, batch) in a fresh process; writes ``out`` and its markdown."""
    check_output(out, "--out", "file", ".md")  # before measuring, not after
    runs = {}
    for variant, batch in RUNS:
        cmd = [sys.executable, "-m", "benchmarks.tensorize", "--variant", variant,
               "--batch", str(batch), "--steps", str(steps)]  # fmt: skip
        cmd += ["--tiny"] if tiny else []
        print(f"tensorize bench: {variant}, batch {batch} x {_seq(tiny)} ...",
              file=sys.stderr,
              flush=True)  # fmt: skip
        try:
            runs[f"{variant}_b{batch}"] = run_json_worker(cmd, f"tensorize bench: {variant}")
        except WorkerFailed as e:
            raise SystemExit(str(e)) from None
    r = runs
    rank, embedding_rank = _ranks(tiny)
    given = out if out != REPORTS / "tensorize.json" else None  # a toy run names its own
    command = ["python -m benchmarks.tensorize", *(["--tiny"] if tiny else []),
               *(["--steps", str(steps)] if steps != STEPS else []),
               *(["--json"] if json_out else []), *recorded_out({"out": given})]  # fmt: skip
    result = {
        "meta": {**host_meta(), "command": " ".join(command), "threads": torch.get_num_threads()},
        "compression_ratio": r["dense_b4"]["params"] / r["comera_b4"]["params"],
        "step_time_ratio_vs_dense": r["comera_b4"]["step_s"] / r["dense_b4"]["step_s"],
        "peak_memory_ratio_vs_dense": r["comera_b1"]["peak_mb"] / r["dense_b1"]["peak_mb"],
        "targets": TARGETS,
        "seq": _seq(tiny),
        **({"tiny": True} if tiny else {}),
        "rank": rank,
        "embedding_rank": embedding_rank,
        "steps_timed": steps,
        "runs": runs,
    }  # fmt: skip
    write_json(out, result)
    write_text(out.with_suffix(".md"), render(result))
    print(json.dumps(result) if json_out else render(result))
    return 0


def render(result: dict) -> str:
    """The report (markdown) from the JSON alone."""
    meta = result["meta"]
    lines = report_header("GPT-2 small tensorized: one training step, CoMERA vs dense",
                          meta["command"], meta)  # fmt: skip
    r = result["runs"]
    lines += [
        f"{meta.get('threads', '?')} torch threads, sequence {result['seq']}. "
        + ("A toy GPT-2 (`--tiny`: one 32-wide layer)" if result.get("tiny") else "GPT-2 small")
        + " built from a config (random weights); CoMERA: `c_attn`, `c_proj`, `c_fc` and `wte` "
        f"tensorized at rank {result['rank']} (embedding {result['embedding_rank']}), the LM "
        "head tied to the TTM table. One `Trainer.train_step` of a `ModuleTask` per step; "
        "each variant and batch in a fresh process.",
        "",
        "| figure | measured | target |",
        "|---|---|---|",
        f"| parameters: dense / CoMERA | {result['compression_ratio']:.1f}x "
        f"({r['dense_b4']['params']:,} / {r['comera_b4']['params']:,}) | |",
    ]
    for key, what in (("step_time_ratio_vs_dense", "step time vs dense, batch 4"),
                      ("peak_memory_ratio_vs_dense", "peak memory vs dense, batch 1")):  # fmt: skip
        lines.append(f"| {what} | {result[key]:.3f} | <= {result['targets'][key]} |")
    lines += ["", "Peak MB: while training, above the RSS before the model was built; the "
              "build's own peak (GPT-2 is built dense, then tensorized) beside it.", "",
              "| variant | batch | step (s) | peak MB | build peak MB |",
              "|---|---|---|---|---|"]  # fmt: skip
    for run in r.values():
        build = run.get("build_peak_mb", float("nan"))
        lines.append(f"| {run['variant']} | {run['batch']} | {run['step_s']:.3f} | "
                     f"{run['peak_mb']:.0f} | {build:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n"


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    add_json_and_render(ap, "measure nothing: print the tables of a saved result")
    ap.add_argument("--steps", type=int, default=STEPS, help="timed steps per variant")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON written (default reports/tensorize.json)")  # fmt: skip
    ap.add_argument("--tiny", action="store_true", help="toy model (tests of the plumbing)")
    ap.add_argument("--variant", choices=("comera", "dense"), help="one variant in this process")
    ap.add_argument("--batch", type=int, default=None, help="with --variant: its batch (default 4)")
    a = ap.parse_args(argv)
    if a.render is not None:  # measuring flags beside it would do nothing
        render_only(ap, argv)
    a.batch = variant_batch(ap, a.batch, a.variant, 4, "4 and 1")  # RUNS's batches
    if a.render is not None:
        return print_rendered(a.render, render, ap.prog)
    if a.steps < 1:
        print(f"{ap.prog}: error: --steps must be >= 1, got {a.steps}", file=sys.stderr)
        return 2
    if a.variant:
        print(json.dumps(run_variant(a.variant, a.batch, a.steps, a.tiny)))
        return 0
    if a.tiny and a.out is None:  # toy figures must not pass for the report's
        print(f"{ap.prog}: error: {TINY_NEEDS_OUT}", file=sys.stderr)
        return 2
    why = reduced_run({"--steps": (a.steps, STEPS)}, "--out")
    if why is not None and a.out is None:
        print(f"{ap.prog}: error: {why}", file=sys.stderr)
        return 2
    return run(json_out=a.json, steps=a.steps, tiny=a.tiny, out=a.out or REPORTS / "tensorize.json")


if __name__ == "__main__":
    raise SystemExit(main())
