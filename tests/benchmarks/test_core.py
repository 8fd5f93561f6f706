"""The core benchmark runs end to end in quick mode (output shape only, no timing asserts)."""

import json
import os
import platform
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.core import CPU, _gemms_only, command, main, padded_rank, render
from comera import TTLinearSpec, init, tt_linear
from comera.layers import tt_linear_shared_input
from comera.plans import FIXED_STRATEGIES as STRATEGIES
from comera.plans import RANK_ALIGN
from experiments.host import cpu_model, report_header


def test_bench_quick_json(capsys, tmp_path):
    report = tmp_path / "bench.md"
    assert main(["--quick", "--json", "--report", str(report)]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["tt_linear"]
    assert {r["strategy"] for r in rows} == set(STRATEGIES)
    for r in rows:
        assert set(r) >= {
            "shape",
            "strategy",
            "rank",
            "tokens",
            "time_ratio_vs_dense",
            "flops_ratio_vs_dense",
        }
        assert r["time_ratio_vs_dense"] > 0 and r["flops_ratio_vs_dense"] > 0
    e = out["ttm_embedding"]
    assert set(e) >= {"speedup_vs_naive", "memory_ratio_vs_naive", "time_ratio_vs_dense_embedding"}
    assert 0 < e["memory_ratio_vs_naive"]
    fq = out["fused_qkv"]
    assert fq["time_ratio_vs_dense"] > 0 and fq["time_ratio_vs_separate"] > 0
    # the GEMMs-alone floor is timed beside the comera path, for every shape and for QKV
    assert all(("gemm_floor_ratio_vs_dense" in r) == (r["strategy"] == "comera") for r in rows)
    assert fq["gemm_floor_ratio_vs_dense"] > 0
    # the result records the machine, torch and date its report's header names
    cfg = out["config"]
    assert cfg["machine"] == cfg["cpu"] == cpu_model() and cfg["torch"] == torch.__version__
    # the report is rendered from the JSON written beside it, alone
    saved = json.loads(report.with_suffix(".json").read_text())
    assert saved == out and report.read_text() == render(saved)
    header = report_header(render(saved).splitlines()[0][2:], command(cfg), cfg)
    assert render(saved).splitlines()[: len(header)] == header
    assert command(cfg) == (
        f"python -m benchmarks.core --quick --threads {cfg['threads']} --report {report}"
    )


def test_cpu_model_reads_cpuinfo_and_falls_back(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t:  AMD   EPYC 7B13\nflags\t: avx2\n")
    assert cpu_model(info) == "AMD EPYC 7B13"
    # a generic name under a hypervisor: family and model tell the generations apart
    block = "processor\t: {}\ncpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n\n"
    info.write_text(block.format(0) + block.format(1))
    assert cpu_model(info) == "AMD EPYC (family 26, model 2)"
    info.write_text("processor\t: 0\nflags\t: neon\n")  # no model name (some ARM kernels)
    monkeypatch.setattr(platform, "processor", lambda: "proc-name")
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert cpu_model(info) == cpu_model(tmp_path / "missing") == "proc-name"
    monkeypatch.setattr(platform, "processor", lambda: "")
    assert cpu_model(info) == "aarch64"


@pytest.mark.parametrize("ranks", [30, 8, 5, (2, 3, 9, 3, 2)])
def test_floor_gemms_use_the_paths_padded_rank(ranks):
    """The floor times GEMMs of the inner size the comera path really runs."""
    spec = TTLinearSpec(out_modes=(4, 3, 4), in_modes=(2, 6, 4), ranks=ranks)
    params, _ = init(spec)
    r = params["cores"][3].shape[0]  # the middle bond, between output and input halves
    assert padded_rank(spec) == r + (-r) % RANK_ALIGN


class _TokenGEMMs(TorchDispatchMode):
    """Records the (shape, shape) of every matrix product that involves the tokens axis."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens, self.seen = tokens, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            a, b = args[-2], args[-1]
            if self.tokens in (*a.shape, *b.shape):
                self.seen[(tuple(a.shape), tuple(b.shape))] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [1, 3])
def test_floor_runs_exactly_the_paths_token_sized_gemms(layers):
    """The GEMMs-alone floor makes the same token-sized products as the ``comera`` path
    (forward and backward), so the gap between them is the TT code's own cost."""
    tokens = 40
    spec = TTLinearSpec(out_modes=(4, 3, 4), in_modes=(2, 6, 4), ranks=5)
    trains = [init(spec, generator=torch.Generator().manual_seed(k)) for k in range(layers)]
    for params, _ in trains:
        for t in [*params["cores"], *params["gates"], params["bias"]]:
            t.requires_grad_(True)
    x = torch.randn(tokens, spec.in_features, requires_grad=True)
    g = torch.randn(tokens, spec.out_features)

    with _TokenGEMMs(tokens) as path:
        outs = (
            [tt_linear(*trains[0], x, plan="comera")]
            if layers == 1
            else tt_linear_shared_input(trains, x)
        )
        torch.autograd.backward(outs, [g] * len(outs))
    floor_step = _gemms_only([spec] * layers, x, g, CPU)
    with _TokenGEMMs(tokens) as floor:
        floor_step()
    assert path.seen and path.seen == floor.seen


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_lean_bench_gets_the_huge_pages_training_gets(tmp_path):
    """``python -m benchmarks.core --malloc lean`` restarts itself for huge pages exactly as the
    training commands do, so its lean figures are the ones training under lean gets."""
    from experiments import malloc

    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.pop("COMERA_MALLOC_RESTARTED", None)
    cmd = [sys.executable, "-m", "benchmarks.core", "--quick", "--json", "--malloc", "lean"]
    root = Path(__file__).parents[2]
    proc = subprocess.run([*cmd, "--report", str(tmp_path / "b.md")], capture_output=True,
                          text=True, check=True, env=env, cwd=root)  # fmt: skip
    cfg = json.loads(proc.stdout.strip().splitlines()[-1])["config"]
    mode = malloc._thp_mode()
    want = mode == "always" or (mode == "madvise" and malloc._glibc_tunable_exists())
    assert cfg["malloc"] == "lean" and cfg["hugepages"] is want
    assert command(cfg) == (
        f"python -m benchmarks.core --quick --malloc lean --threads {cfg['threads']}"
        f" --report {tmp_path / 'b.md'}"
    )


def test_merge_runs_takes_medians_and_keeps_each_process():
    """Numbers become the median across processes, ratios included (the median of the
    processes' ratios), labels stay, and each process's headline ratios are kept."""
    from benchmarks.core import merge_runs

    def run(ratio: float, fused: float, ms: float) -> dict:
        row = {"shape": "768->768", "strategy": "comera", "time_ratio_vs_dense": ratio,
               "time_ms": ms, "gemm_floor_ratio_vs_dense": None}  # fmt: skip
        dense = {"shape": "768->768", "strategy": "dense", "time_ratio_vs_dense": 1.0,
                 "time_ms": 80.0}  # fmt: skip
        return {
            "tt_linear": [row, dense],
            "fused_qkv": {"time_ratio_vs_dense": fused, "shape": "768->768"},
            "ttm_embedding": {"ids": 4096, "speedup_vs_naive": ms},
            "config": {"repeats": 9, "quick": False},
        }

    out = merge_runs([run(0.16, 0.14, 13.0), run(0.14, 0.13, 12.0), run(0.15, 0.15, 20.0)])
    row = out["tt_linear"][0]
    assert row["shape"] == "768->768" and row["strategy"] == "comera"
    assert row["time_ratio_vs_dense"] == 0.15 and row["time_ms"] == 13.0
    assert row["gemm_floor_ratio_vs_dense"] is None
    assert out["fused_qkv"]["time_ratio_vs_dense"] == 0.14
    assert out["ttm_embedding"] == {"ids": 4096, "speedup_vs_naive": 13.0}
    assert out["config"]["processes"] == 3 and out["config"]["quick"] is False
    assert [p["768->768"] for p in out["config"]["per_process"]] == [0.16, 0.14, 0.15]
    with pytest.raises(ValueError, match="different row sets"):
        merge_runs([run(0.1, 0.1, 1.0), {**run(0.1, 0.1, 1.0), "tt_linear": []}])
    other = run(0.1, 0.1, 1.0)
    other["tt_linear"][0]["shape"] = "768->3072"
    with pytest.raises(ValueError, match="different row sets"):
        merge_runs([run(0.1, 0.1, 1.0), other])
    # an even number of processes keeps integer counts integers (no "4096.0 ids")
    two = merge_runs([run(0.16, 0.14, 13.0), run(0.14, 0.13, 12.0)])
    assert two["ttm_embedding"]["ids"] == 4096 and isinstance(two["ttm_embedding"]["ids"], int)


@pytest.mark.slow
def test_bench_runs_in_fresh_processes(tmp_path):
    """``--processes 2`` runs the benchmark twice in child processes and reports medians,
    with each process's headline ratios in the JSON and the report."""
    report = tmp_path / "bench.md"
    cmd = [sys.executable, "-m", "benchmarks.core", "--quick", "--processes", "2", "--json",
           "--report", str(report)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=300)
    out = json.loads(done.stdout)
    assert out["config"]["processes"] == 2 and len(out["config"]["per_process"]) == 2
    assert done.stderr.count("benchmarks.core: quick shapes") == 2
    assert json.loads(report.with_suffix(".json").read_text()) == out
    assert report.read_text() == render(out)
    n = out["config"]["threads"]  # named always: the default is the machine's own count
    assert (
        command(out["config"])
        == f"python -m benchmarks.core --quick --threads {n} --processes 2 --report {report}"
    )
