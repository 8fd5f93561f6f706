"""Core benchmark: TT-linear strategies vs ``nn.Linear``, TTM lookups vs each other.

    python -m benchmarks.core            # writes reports/bench_core.json and .md (rendered)
    python -m benchmarks.core --json     # one JSON object on stdout (progress on stderr)
    python -m benchmarks.core --quick    # tiny shapes, one repeat: checks the plumbing only
    python -m benchmarks.core --device cuda   # on a GPU: reports/gpu/bench_core_cuda.{json,md}
    python -m benchmarks.core --render reports/bench_core.json   # the report again, no run

Every ratio is measured side by side in one run: each repeat times every variant once
(round robin, so machine noise hits all of them alike) and the ratio is taken between
medians. Time is forward + backward with a fixed upstream gradient; ``x`` requires grad
for both the TT and the dense layer, as inside a network.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.memory import peak_memory_bytes
from benchmarks.reporting import (
    add_json_and_render,
    add_threads_flag,
    arg_parser,
    check_bench_device,
    check_output,
    md_cell,
    one_line_errors,
    recorded_out,
    reduced_run,
    render_only,
    render_refusal,
    render_saved,
    write_json,
    write_text,
)
from comera.accounting import tt_linear_flops, ttm_embedding_flops
from comera.layers import tt_linear, tt_linear_shared_input, ttm_embedding
from comera.plans import FIXED_STRATEGIES as STRATEGIES
from comera.plans import RANK_ALIGN
from comera.spec import TTLinearSpec, TTMEmbeddingSpec
from comera.tensor_train import init
from experiments.host import cpu_model, report_header
from experiments.malloc import (
    CPU_MALLOC_POLICIES,
    clean_malloc_env,
    hugepages_active,
    restart_for,
    set_cpu_malloc,
)

# The paper's MNLI trains, written in the paper as [input modes | output modes]:
# Q/K/V/out [12,8,8 | 8,8,12], FFN-in [12,8,8 | 12,16,16], FFN-out [16,16,12 | 8,8,12].
# Our cores run output modes first, so each train is read backwards (same cores, same
# ranks, same parameter count): (out_modes, in_modes) below.
PAPER_LINEAR = [
    ((12, 8, 8), (8, 8, 12)),  # 768 -> 768
    ((16, 16, 12), (8, 8, 12)),  # 768 -> 3072
    ((12, 8, 8), (12, 16, 16)),  # 3072 -> 768
]
REPEATS = 9  # rounds of the paper shapes (the committed report's)
QUICK_LINEAR = [((4, 3), (2, 5)), ((3, 2, 2), (2, 2, 3))]
REPORT = Path(__file__).resolve().parent.parent / "reports" / "bench_core.md"
GPU_REPORT = REPORT.parent / "gpu" / "bench_core_cuda.md"  # a GPU run never replaces the CPU one
CPU = torch.device("cpu")
PROG = "python -m benchmarks.core"


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _sync(device: torch.device) -> Callable[[], None]:
    """Wait for the device's queued work (CUDA), so a timing covers kernels, not launches."""
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)


def _to(tree: object, device: torch.device) -> object:
    """A params or state pytree (tensors only, as the trainer moves them) on ``device``."""
    return torch.utils._pytree.tree_map(lambda t: t.to(device), tree)


def _round_robin(
    fns: dict[str, Callable[[], object]], repeats: int, device: torch.device = CPU
) -> dict[str, float]:
    """Median seconds per variant, timing every variant once per round."""
    sync = _sync(device)
    for fn in fns.values():  # warm-up: plans, allocator, BLAS threads, CUDA kernels
        fn()
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def _leaves_requiring_grad(params: dict) -> list[torch.Tensor]:
    out = [*params["cores"], *params["gates"]]
    if "bias" in params:
        out.append(params["bias"])
    for t in out:
        t.requires_grad_(True)
    return out


def keep_freed_memory() -> bool:
    """Tell glibc malloc to keep freed memory (``set_cpu_malloc("keep")``).

    Without this every large activation is a fresh ``mmap`` whose pages fault in on first
    touch; for skinny GEMMs that write a (T, M) output the page faults cost more than the
    arithmetic. Returns False where it does not apply (not glibc).
    """
    return set_cpu_malloc("keep")


def _time_linear(
    spec: TTLinearSpec,
    tokens: int,
    repeats: int,
    gen: torch.Generator,
    strategies: tuple[str, ...] = STRATEGIES,
    device: torch.device = CPU,
    floor: bool = False,
) -> tuple:
    """Median fwd+bwd seconds of ``nn.Linear`` and of each strategy, side by side (and of
    the ``comera`` path's GEMMs alone, :data:`FLOOR`, with ``floor``)."""
    params, state = _to(init(spec, generator=gen), device)  # type: ignore[misc]
    leaves = _leaves_requiring_grad(params)
    dense = torch.nn.Linear(spec.in_features, spec.out_features).to(device)
    x = torch.randn(tokens, spec.in_features, generator=gen).to(device).requires_grad_()
    g = torch.randn(tokens, spec.out_features, generator=gen).to(device)

    def dense_step() -> None:
        x.grad = dense.weight.grad = dense.bias.grad = None
        dense(x).backward(g)

    def tt_step(strategy: str) -> Callable[[], None]:
        def step() -> None:
            x.grad = None
            for t in leaves:
                t.grad = None
            tt_linear(params, state, x, plan=strategy).backward(g)

        return step

    fns = {"dense": dense_step, **{s: tt_step(s) for s in strategies}}
    if floor:
        fns[FLOOR] = _gemms_only([spec], x, g, device)
    return params, _round_robin(fns, repeats, device)


FLOOR = "gemms"  # the comera path's GEMMs alone: what BLAS gives before any TT code runs


def padded_rank(spec: TTLinearSpec) -> int:
    """The ``comera`` path's inner GEMM size: the middle rank rounded up to 8 (the bias
    rides in the first padding slot; see ``comera.plans``)."""
    r = int(spec.ranks[len(spec.ranks) // 2])  # type: ignore[index]
    return r + (-r) % RANK_ALIGN


def _gemms_only(
    specs: list[TTLinearSpec],
    x: torch.Tensor,
    g: torch.Tensor,
    device: torch.device,
) -> Callable[[], None]:
    """fwd+bwd of the ``comera`` path's GEMMs on plain leaf tensors, for layers sharing
    ``x``: ``h = x [B_1; ...]^T`` (rank padded as the path pads it), ``y_i = h_i A_i^T``.
    No cores are contracted, no gates applied, no bias slot filled: the floor the BLAS
    sets for the path on this machine, against which its own overhead shows. Its values
    come from a generator of its own, so adding it changes no other variant's inputs."""
    gen = torch.Generator().manual_seed(0)
    widths = [padded_rank(s) for s in specs]
    bt = torch.randn(x.shape[-1], sum(widths), generator=gen).to(device).requires_grad_()
    sides = [
        torch.randn(s.out_features, w, generator=gen).to(device).requires_grad_()
        for s, w in zip(specs, widths, strict=True)
    ]

    def step() -> None:
        x.grad = bt.grad = None
        for a in sides:
            a.grad = None
        h = x @ bt
        # split as the path splits h for several layers (one cat in backward); one layer
        # reads h whole, as the path does
        hs = torch.split(h, widths, dim=1) if len(widths) > 1 else [h]
        outs = [hi @ a.T for hi, a in zip(hs, sides, strict=True)]
        torch.autograd.backward(outs, [g] * len(outs))

    return step


def bench_fused_qkv(
    out_modes: tuple[int, ...], in_modes: tuple[int, ...], rank: int, tokens: int,
    repeats: int, gen: torch.Generator, device: torch.device = CPU,
) -> dict:  # fmt: skip
    """Q, K, V of one attention block, fwd+bwd: ``tt_linear_shared_input`` (one GEMM with
    the three input halves) vs three ``comera`` calls vs three ``nn.Linear``."""
    spec = TTLinearSpec(out_modes=out_modes, in_modes=in_modes, ranks=rank)
    layers = [_to(init(spec, generator=gen), device) for _ in range(3)]
    leaves = [t for p, _ in layers for t in _leaves_requiring_grad(p)]  # type: ignore[misc]
    dense = [torch.nn.Linear(spec.in_features, spec.out_features).to(device) for _ in range(3)]
    x = torch.randn(tokens, spec.in_features, generator=gen).to(device).requires_grad_()
    g = torch.randn(tokens, spec.out_features, generator=gen).to(device)

    def clear() -> None:
        x.grad = None
        for t in [*leaves, *(q for lin in dense for q in lin.parameters())]:
            t.grad = None

    def backward(outs: list[torch.Tensor]) -> None:
        torch.autograd.backward(outs, [g] * len(outs))

    fns = {
        "dense": lambda: (clear(), backward([lin(x) for lin in dense])),
        "separate": lambda: (clear(), backward([tt_linear(p, s, x, plan="comera")
                                                for p, s in layers])),
        "fused": lambda: (clear(), backward(tt_linear_shared_input(layers, x))),
        FLOOR: _gemms_only([spec] * 3, x, g, device),
    }  # fmt: skip
    med = _round_robin(fns, repeats, device)
    out = {
        "shape": _label(spec),
        "time_ratio_vs_dense": med["fused"] / med["dense"],
        "time_ratio_vs_separate": med["fused"] / med["separate"],
        "separate_ratio_vs_dense": med["separate"] / med["dense"],
        "gemm_floor_ratio_vs_dense": med[FLOOR] / med["dense"],
        **{f"{k}_ms": v * 1e3 for k, v in med.items()},
    }
    _log(f"  fused QKV {out['shape']}: {out['time_ratio_vs_dense']:.3f}x of 3 nn.Linear, "
         f"{out['time_ratio_vs_separate']:.3f}x of 3 comera calls")  # fmt: skip
    return out


def _label(spec: TTLinearSpec) -> str:
    """``in->out [paper modes]``: the train read input-first, as the paper writes it."""
    ins = ",".join(map(str, spec.in_modes[::-1]))
    outs = ",".join(map(str, spec.out_modes[::-1]))
    return f"{spec.in_features}->{spec.out_features} [{ins} | {outs}]"


def comera_ratios(
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    rank: int,
    tokens: int,
    repeats: int,
    gen: torch.Generator,
    label: str = "",
    device: torch.device = CPU,
) -> dict[str, float]:
    """``comera`` vs dense time ratio per shape under the process's current allocator."""
    out = {}
    for out_modes, in_modes in shapes:
        spec = TTLinearSpec(out_modes=out_modes, in_modes=in_modes, ranks=rank)
        _, med = _time_linear(spec, tokens, repeats, gen, ("comera",), device)
        out[_label(spec)] = med["comera"] / med["dense"]
        _log(f"  {_label(spec)}: comera {out[_label(spec)]:.3f}x {label}")
    return out


comera_default_malloc = comera_ratios  # the old name


def bench_tt_linear(
    shapes: list[tuple[tuple[int, ...], tuple[int, ...]]],
    rank: int,
    tokens: int,
    repeats: int,
    gen: torch.Generator,
    device: torch.device = CPU,
) -> list[dict]:
    """Time every strategy against ``nn.Linear`` for each TT shape."""
    rows = []
    for out_modes, in_modes in shapes:
        spec = TTLinearSpec(out_modes=out_modes, in_modes=in_modes, ranks=rank)
        params, med = _time_linear(spec, tokens, repeats, gen, STRATEGIES, device, floor=True)
        shape = _label(spec)
        for s in STRATEGIES:
            fl = tt_linear_flops(params, tokens, s)
            rows.append(
                {
                    "shape": shape,
                    "strategy": s,
                    "rank": rank,
                    "tokens": tokens,
                    "time_ratio_vs_dense": med[s] / med["dense"],
                    "flops_ratio_vs_dense": (fl["forward"] + fl["backward"])
                    / (fl["dense_forward"] + fl["dense_backward"]),
                    "time_ms": med[s] * 1e3,
                    "dense_time_ms": med["dense"] * 1e3,
                    **(
                        {"gemm_floor_ratio_vs_dense": med[FLOOR] / med["dense"]}
                        if s == "comera"
                        else {}
                    ),
                }
            )
        _log(f"  {shape}: " + ", ".join(f"{s} {med[s] / med['dense']:.3f}x" for s in STRATEGIES))
    return rows


def zipf_ids(vocab: int, n: int, gen: torch.Generator, s: float = 1.1) -> torch.Tensor:
    """``n`` ids with Zipf-like frequencies (rank k has weight 1/k^s), ranks shuffled over
    the vocabulary so frequent ids are spread across all TTM digits."""
    weights = 1.0 / torch.arange(1, vocab + 1, dtype=torch.float64) ** s
    ranks = torch.multinomial(weights, n, replacement=True, generator=gen)
    return torch.randperm(vocab, generator=gen)[ranks]


def bench_ttm(
    spec: TTMEmbeddingSpec,
    n_ids: int,
    repeats: int,
    gen: torch.Generator,
    device: torch.device = CPU,
) -> dict[str, float]:
    """Optimized vs naive TTM lookup (time and peak memory), and vs ``nn.Embedding``."""
    params, state = _to(init(spec, generator=gen), device)  # type: ignore[misc]
    leaves = _leaves_requiring_grad(params)
    ids = zipf_ids(spec.num_embeddings, n_ids, gen).to(device)  # type: ignore[arg-type]
    g = torch.randn(n_ids, spec.embedding_dim, generator=gen).to(device)  # type: ignore[arg-type]
    dense = torch.nn.Embedding(spec.num_embeddings, spec.embedding_dim).to(device)  # type: ignore[arg-type]

    def step(impl: str) -> Callable[[], None]:
        def run() -> None:
            for t in leaves:
                t.grad = None
            ttm_embedding(params, state, ids, impl=impl, spec=spec).backward(g)

        return run

    def dense_step() -> None:
        dense.weight.grad = None
        dense(ids).backward(g)

    med = _round_robin(
        {"optimized": step("optimized"), "naive": step("naive"), "dense": dense_step},
        repeats,
        device,
    )
    mem = {k: peak_memory_bytes(step(k), device) for k in ("optimized", "naive")}
    unique = int(torch.unique(ids).numel())
    fl_opt = ttm_embedding_flops(params, n_ids, unique, "optimized")
    fl_naive = ttm_embedding_flops(params, n_ids, impl="naive")
    out = {
        "speedup_vs_naive": med["naive"] / med["optimized"],
        "memory_ratio_vs_naive": mem["optimized"] / mem["naive"],
        "time_ratio_vs_dense_embedding": med["optimized"] / med["dense"],
        "optimized_ms": med["optimized"] * 1e3,
        "naive_ms": med["naive"] * 1e3,
        "dense_ms": med["dense"] * 1e3,
        "optimized_peak_bytes": mem["optimized"],
        "naive_peak_bytes": mem["naive"],
        "ids": n_ids,
        "unique_ids": unique,
        "forward_flops_ratio_vs_naive": fl_opt / fl_naive,
    }
    _log(
        f"  ttm: optimized {out['speedup_vs_naive']:.2f}x faster than naive, "
        f"{1 / out['memory_ratio_vs_naive']:.2f}x less memory"
    )
    return out


TT_LINEAR_THRESHOLD = 0.15  # this benchmark's threshold: `comera` time / dense time, per shape
FUSED_QKV_THRESHOLD = 0.12  # and fused Q/K/V time / three nn.Linear


def _per_process(cfg: dict) -> list[str]:
    """The headline ratios of each process behind the medians (nothing for one process)."""
    runs = cfg.get("per_process") or []
    if len(runs) < 2:
        return []
    keys = list(runs[0])
    shapes = [k for k in keys if k != "fused_qkv"]
    lines = [
        "Each process's headline time ratios (the tables above give their medians):",
        "",
        "| process | " + " | ".join(f"`comera` {k.split()[0]}" if k != "fused_qkv" else "fused QKV"
                                     for k in keys)
        + f" | shapes with `comera` <= {TT_LINEAR_THRESHOLD} |",
        "|---|" + "---:|" * (len(keys) + 1),
    ]  # fmt: skip
    for i, run in enumerate(runs, 1):
        within = sum(run[k] <= TT_LINEAR_THRESHOLD for k in shapes)
        lines.append(
            f"| {i} | " + " | ".join(f"{run[k]:.3f}" for k in keys) + f" | {within}/{len(shapes)} |"
        )
    return [*lines, ""]


def command(cfg: dict) -> str:
    """The command line that measured a result, from its ``config``: the flags that differ
    from their defaults."""
    quick = bool(cfg.get("quick"))
    parts = ["python -m benchmarks.core"]
    parts += ["--quick"] if quick else []
    if cfg.get("device", "cpu") != "cpu":
        parts += ["--device", str(cfg["device"])]
    malloc = str(cfg.get("malloc", "default")).split()[0]
    parts += ["--malloc", malloc] if malloc != "default" else []
    parts += ["--threads", str(cfg["threads"])] if "threads" in cfg else []  # not a default
    if cfg.get("repeats", 1 if quick else 9) != (1 if quick else 9):
        parts += ["--repeats", str(cfg["repeats"])]
    processes = cfg.get("processes", 1)
    default = 1 if quick or cfg.get("device", "cpu") != "cpu" else PROCESSES
    parts += ["--processes", str(processes)] if processes != default else []
    return " ".join(parts + recorded_out(cfg, "--report"))


def render(result: dict) -> str:
    """The markdown report of a result (the ``--json`` object), from the result alone: run
    after measuring and by ``--render JSON`` on a saved result."""
    cfg = result["config"]
    on_cpu = cfg.get("device", "cpu") == "cpu"
    meta = {
        "cpu": cfg.get("cpu") or (cfg.get("machine") if on_cpu else None),
        "torch": cfg.get("torch"),
        "date": cfg.get("date"),
    }
    lines = report_header("Core benchmark: TT-linear and TTM lookups vs dense", command(cfg), meta)
    lines += [
        f"{cfg['threads']} threads, median of {cfg['repeats']} round-robin repeats "
        "(every variant timed once per round)"
        + (
            f", then the median over {cfg['processes']} fresh processes (each figure its own "
            "median: a ratio is the median of the processes' ratios)"
            if cfg.get("processes", 1) > 1
            else ""
        )
        + ". Forward + backward, fp32; `x` requires grad.",
        "",
        "## TT-linear vs `nn.Linear` (paper MNLI shapes, "
        f"rank {cfg['rank']}, {cfg['tokens']} tokens)",
        "",
        f"Allocator policy: `{cfg['malloc']}`"
        + (" (huge pages on)" if cfg.get("hugepages") else "")
        + " (as `train.cpu_malloc`; training's default is "
        "`default`, glibc as found). Under `default` the `comera` rows also show the ratio "
        "under `cpu_malloc=keep` (glibc keeps freed memory: no page faults on reuse, a "
        "resident set at its high-water mark), measured after the headline columns."
        if on_cpu
        else f"Device `{cfg['device']}` ({cfg.get('machine', 'not recorded')}): tensors on "
        "the GPU, each timing ends with a synchronize; memory is the CUDA caching "
        "allocator's peak.",
        "",
        "| shape (in->out, paper modes) | strategy | time ratio vs dense | "
        "(keep malloc) | its GEMMs alone | FLOPs ratio vs dense | TT ms | dense ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]

    def opt(v: float | None) -> str:
        return "" if v is None else f"{v:.3f}"

    for r in result["tt_linear"]:
        lines.append(
            f"| {md_cell(r['shape'])} | {r['strategy']} | {r['time_ratio_vs_dense']:.3f} | "
            f"{opt(r.get('time_ratio_vs_dense_keep_malloc'))} | "
            f"{opt(r.get('gemm_floor_ratio_vs_dense'))} | "
            f"{r['flops_ratio_vs_dense']:.3f} | {r['time_ms']:.1f} | {r['dense_time_ms']:.1f} |"
        )
    lines += [
        "",
        "*Its GEMMs alone*: the `comera` path's two GEMMs (`h = x B^T`, `y = h A^T` at the "
        "padded rank) on plain tensors, fwd+bwd, in the same round robin: no cores "
        "contracted, no gates, no bias slot: the floor the BLAS sets for the path.",
    ]
    e = result["ttm_embedding"]
    comera = [r for r in result["tt_linear"] if r["strategy"] == "comera"]
    fq = result.get("fused_qkv")
    if fq:
        lines += [
            "",
            f"Attention's Q, K, V at {fq['shape']} (`fused_qkv`, opt-in as "
            "`model.fused_qkv`): `tt_linear_shared_input`, one GEMM of `x` with the three "
            "input halves, against three `nn.Linear` and three `comera` calls.",
            "",
            "| variant | ms | ratio vs 3 dense |",
            "|---|---:|---:|",
            f"| fused (`tt_linear_shared_input`) | {fq['fused_ms']:.1f} | "
            f"{fq['time_ratio_vs_dense']:.3f} |",
            f"| three `comera` calls | {fq['separate_ms']:.1f} | "
            f"{fq['separate_ratio_vs_dense']:.3f} |",
            f"| the fused path's GEMMs alone (its floor) | {fq['gemms_ms']:.1f} | "
            f"{fq['gemm_floor_ratio_vs_dense']:.3f} |",
            f"| three `nn.Linear` | {fq['dense_ms']:.1f} | 1.000 |",
        ]
    within = sum(r["time_ratio_vs_dense"] <= TT_LINEAR_THRESHOLD for r in comera)
    floor = sum(r.get("gemm_floor_ratio_vs_dense", math.inf) <= TT_LINEAR_THRESHOLD
                for r in comera)  # fmt: skip
    lines += [
        "",
        "Thresholds of this benchmark (time ratio vs dense; the figures are the tables' "
        + ("medians" if cfg.get("processes", 1) > 1 else "values")
        + "):",
        "",
        "| measure | threshold | measured | its GEMMs alone |",
        "|---|---:|---:|---:|",
        f"| `comera` at every shape: shapes at or below | {TT_LINEAR_THRESHOLD} | "
        f"{within}/{len(comera)} | {floor}/{len(comera)} |",
    ]
    if fq:
        lines.append(
            f"| fused Q/K/V vs three `nn.Linear` | {FUSED_QKV_THRESHOLD} | "
            f"{fq['time_ratio_vs_dense']:.3f} | {fq['gemm_floor_ratio_vs_dense']:.3f} |"
        )
    lines += [
        "",
        *_per_process(cfg),
        f"## TTM embedding lookup ({cfg['ttm']}, {e['ids']} Zipf ids, {e['unique_ids']} unique)",
        "",
        "| metric | value | paper |",
        "|---|---:|---:|",
        f"| optimized speedup vs naive (fwd+bwd) | {e['speedup_vs_naive']:.2f}x | 4-5x |",
        f"| optimized / naive peak tensor memory | {e['memory_ratio_vs_naive']:.3f} | 1/3-1/2 |",
        f"| optimized / dense `nn.Embedding` time | {e['time_ratio_vs_dense_embedding']:.2f} | |",
        f"| optimized / naive forward FLOPs | {e['forward_flops_ratio_vs_naive']:.3f} | |",
        f"| optimized, naive, dense ms | {e['optimized_ms']:.1f}, {e['naive_ms']:.1f}, "
        f"{e['dense_ms']:.1f} | |",
        f"| optimized, naive peak MB | {e['optimized_peak_bytes'] / 2**20:.1f}, "
        f"{e['naive_peak_bytes'] / 2**20:.1f} | |",
        "",
        "Peak memory is the peak of live tensor storage bytes created during forward + backward "
        "(tracked per op by a dispatch mode; on CUDA the allocator peak), above the baseline. "
        "*paper*: the CoMERA paper's figures for its optimized TTM lookup against per-row "
        "chains.",
        "",
    ]
    return "\n".join(lines)


def run(
    *,
    quick: bool = False,
    repeats: int | None = None,
    threads: int = 2,
    seed: int = 0,
    malloc: str = "default",
    device: str = "cpu",
) -> dict:
    """Run the whole benchmark and return the result dict (the ``--json`` object).

    Everything is measured under the allocator policy ``malloc`` (the training path's
    ``TrainConfig.cpu_malloc``, default ``"default"``: glibc as found). Under
    ``"default"`` the ``comera`` vs dense ratios are measured once more at the end under
    ``"keep"`` (which cannot be undone), as a second column. On ``device="cuda"`` the
    tensors live on the GPU, every timing ends with a synchronize, memory is the CUDA
    allocator's peak, and the CPU allocator policy does not apply.
    """
    dev = torch.device(device)
    on_cpu = dev.type == "cpu"
    torch.set_num_threads(threads)
    gen = torch.Generator().manual_seed(seed)
    if quick:
        shapes, rank, tokens, reps = QUICK_LINEAR, 3, 64, repeats or 1
        ttm = TTMEmbeddingSpec(vocab_modes=(4, 5, 3), dim_modes=(2, 2, 3), ranks=4)
        n_ids = 64
    else:
        shapes, rank, tokens, reps = PAPER_LINEAR, 30, 4096, repeats or REPEATS
        ttm = TTMEmbeddingSpec(
            vocab_modes=(16, 20, 10, 10), dim_modes=(4, 4, 8, 6), ranks=32, num_embeddings=30522
        )
        n_ids = 4096
    size = "quick" if quick else "paper"
    _log(f"benchmarks.core: {size} shapes, {reps} repeats, {threads} threads")
    applied = set_cpu_malloc(malloc) if on_cpu else False
    linear = bench_tt_linear(shapes, rank, tokens, reps, gen, dev)
    result = {
        "tt_linear": linear,
        "fused_qkv": bench_fused_qkv(*shapes[0], rank, tokens, reps, gen, dev),
        "ttm_embedding": bench_ttm(ttm, n_ids, reps, gen, dev),
    }
    if on_cpu and malloc == "default" and not quick and set_cpu_malloc("keep"):
        keep = comera_ratios(shapes, rank, tokens, reps, gen, "(keep malloc)")
        for row in linear:
            if row["strategy"] == "comera":
                row["time_ratio_vs_dense_keep_malloc"] = keep[row["shape"]]
    result["config"] = {
        "quick": quick,
        "repeats": reps,
        "threads": threads,
        "rank": rank,
        "tokens": tokens,
        "ttm": f"vocab {list(ttm.vocab_modes)} (V={ttm.num_embeddings}), "
        f"dim {list(ttm.dim_modes)}, rank {max(ttm.ranks)}",  # type: ignore[arg-type]
        "torch": torch.__version__,
        "malloc": malloc
        if applied
        else f"{malloc} (not applied: {'not glibc' if on_cpu else 'CUDA tensors'})",
        "machine": cpu_model() if on_cpu else torch.cuda.get_device_name(dev),
        "cpu": cpu_model(),
        "hugepages": on_cpu and hugepages_active(),
        "device": str(dev),
        "date": time.strftime("%Y-%m-%d"),
    }
    return result


PROCESSES = 3  # fresh processes of the full CPU benchmark, alternating nothing but the process


def merge_runs(runs: list[dict]) -> dict:
    """One result from several processes' results: every number is the median of its
    values across the runs (ratios are medians of the per-process ratios, not ratios of
    medians), everything else is the first run's. ``config["per_process"]`` keeps each
    run's headline ratios, so the spread stays visible."""

    def merge(values: list) -> object:
        first = values[0]
        if isinstance(first, dict):
            return {k: merge([v[k] for v in values]) if all(k in v for v in values)
                    else first[k] for k in first}  # fmt: skip
        if isinstance(first, list) and len(first) and isinstance(first[0], dict):
            labels = [[(r.get("shape"), r.get("strategy")) for r in v] for v in values]
            if any(lab != labels[0] for lab in labels):
                raise ValueError("benchmarks.core: the processes measured different row sets")
            return [merge([v[i] for v in values]) for i in range(len(first))]
        if isinstance(first, bool) or not isinstance(first, (int, float)):
            return first
        if any(v is None for v in values):
            return None
        if all(isinstance(v, int) for v in values):  # counts stay counts
            return statistics.median_low(values)
        return statistics.median(values)

    out = merge(runs)
    assert isinstance(out, dict)
    out["config"] = dict(runs[0]["config"])
    out["config"]["processes"] = len(runs)
    out["config"]["per_process"] = [
        {
            **{
                r["shape"]: round(r["time_ratio_vs_dense"], 4)
                for r in run["tt_linear"]
                if r["strategy"] == "comera"
            },
            "fused_qkv": round(run["fused_qkv"]["time_ratio_vs_dense"], 4),
        }
        for run in runs
    ]
    return out


def _run_processes(n: int, argv: list[str]) -> dict:
    """Run the benchmark in ``n`` fresh processes, one after another, and merge them."""
    runs = []
    for i in range(n):
        _log(f"benchmarks.core: process {i + 1} of {n}")
        cmd = [sys.executable, "-m", "benchmarks.core", *argv, "--processes", "1", "--json",
               "--no-report"]  # fmt: skip
        # a clean allocator environment: each child applies its own --malloc policy
        done = subprocess.run(cmd, stdout=subprocess.PIPE, check=False, env=clean_malloc_env())
        if done.returncode != 0:
            raise SystemExit(f"benchmarks.core: process {i + 1} of {n} failed ({done.returncode})")
        runs.append(json.loads(done.stdout))
    return merge_runs(runs)


@one_line_errors(PROG)
def main(argv: list[str] | None = None) -> int:
    ap = arg_parser(PROG, __doc__.split("\n")[0])
    add_json_and_render(
        ap,
        (
            "measure nothing: render the report from a saved result (the JSON a run writes "
            "beside its report, or its --json output)"
        ),
    )
    ap.add_argument("--quick", action="store_true", help="tiny shapes, for tests")
    ap.add_argument("--repeats", type=int, default=None, help="rounds (default 9, quick 1)")
    add_threads_flag(ap)
    ap.add_argument(
        "--malloc",
        choices=CPU_MALLOC_POLICIES,
        default="default",
        help="allocator policy, as train.cpu_malloc (default: glibc as found, as training)",
    )
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    report = ap.add_mutually_exclusive_group()
    report.add_argument(
        "--report",
        type=Path,
        default=None,
        help=f"markdown path (default {REPORT}; on cuda {GPU_REPORT})",
    )
    report.add_argument(
        "--no-report", action="store_true", help="do not write the report (markdown and JSON)"
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=None,
        help=f"fresh processes to run the benchmark in, the figures their medians (default "
        f"{PROCESSES} on CPU, 1 with --quick or on cuda): a shared CPU drifts between "
        "processes more than within one",
    )
    args = ap.parse_args(argv)
    if args.render is not None:
        render_only(ap, argv, ("report", "no_report"))  # measuring flags beside it would do nothing
        done = render_saved(args.render, render, ap.prog, ("config",))
        if done is None:
            return 2
        result, text = done
        on_cpu = result.get("config", {}).get("device", "cpu") == "cpu"
        if not args.no_report:
            why = render_refusal(result, args.report, "--report")  # as measuring refuses it
            if why is not None:
                ap.error(f"{args.render}: {why}")
            path = args.report or (REPORT if on_cpu else GPU_REPORT)
            if path.suffix == ".json":  # markdown there would pass for (or replace) a result
                ap.error(f"--report {path}: give a path ending in .md; the report is markdown")
            check_output(path, "--report", "file")  # rendering writes no JSON beside it
            write_text(path, text)
            _log(f"wrote {path}")
        print(text)
        return 0
    if args.processes is not None and args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1):
        ap.error(f"--threads and --repeats must be >= 1, got {args.threads}, {args.repeats}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    check_bench_device(args.device)
    dev = torch.device(args.device)
    default_processes = 1 if args.quick or dev.type != "cpu" else PROCESSES
    why = reduced_run({"--repeats": (args.repeats or REPEATS, REPEATS),
                       "--processes": (args.processes or default_processes, default_processes)},
                      "--report")  # fmt: skip
    if why is not None and args.report is None and not args.no_report and not args.quick:
        ap.error(why)
    write = not args.no_report and not (args.quick and args.report is None)
    path = args.report or (REPORT if dev.type == "cpu" else GPU_REPORT)
    if write:  # before measuring: a path it cannot write is refused now, not after the run
        check_output(path, "--report", "file", ".json")
    processes = args.processes or default_processes
    if processes > 1:
        passed = ["--threads", str(args.threads), "--malloc", args.malloc, "--device", args.device]
        passed += ["--quick"] if args.quick else []
        passed += ["--repeats", str(args.repeats)] if args.repeats is not None else []
        result = _run_processes(processes, passed)
    else:
        if dev.type == "cpu" and argv is None:  # a command, not a call from Python
            restart_for(args.malloc)  # as the training commands do (lean: huge pages)
        result = run(
            quick=args.quick,
            repeats=args.repeats,
            threads=args.threads,
            malloc=args.malloc,
            device=args.device,
        )
    if write and args.report is not None:  # the header's command names it, as needed
        result["config"]["out"] = str(args.report)
    if write:
        write_json(path.with_suffix(".json"), result)  # what --render reads back
        write_text(path, render(result))
        _log(f"wrote {path} and {path.with_suffix('.json').name}")
    if args.json:
        print(json.dumps(result))
    else:
        print(render(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
