"""Training-path efficiency settings: the CPU allocator policy and block recomputation."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comera as C
from comera.layers import tt_linear_shared_input
from comera.train import TrainConfig
from experiments import cli, malloc
from experiments.mnli import experiment as mnli
from experiments.transformer import EncoderConfig, encoder_hidden, init_encoder

ROOT = Path(__file__).resolve().parents[2]
FAST = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
FAST += ["--set", "train.steps=3", "--set", "train.eval_every=None"]
FAST += ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


def test_cpu_malloc_policies_and_errors() -> None:
    assert malloc.CPU_MALLOC_POLICIES == ("default", "keep", "release", "lean")
    assert malloc.set_cpu_malloc("default")  # changes nothing
    with pytest.raises(ValueError, match="cpu_malloc='fast'.*default"):
        malloc.set_cpu_malloc("fast")
    with pytest.raises(ValueError, match="TrainConfig.cpu_malloc='fast'"):
        TrainConfig(steps=1, run_dir="x", cpu_malloc="fast")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_release_policy_returns_freed_memory_in_a_fresh_process() -> None:
    """An 8 MB block freed below a live one: glibc as found keeps it (its mmap threshold
    rose past 8 MB when an earlier block was freed), ``release`` unmaps it. Each policy
    runs in a child process because a policy cannot be undone."""
    code = """
import sys, torch
from experiments.malloc import set_cpu_malloc
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
assert set_cpu_malloc(sys.argv[1])
x = torch.ones(2 * 2**20); del x
before = rss()
a = torch.ones(2 * 2**20); b = torch.ones(2 * 2**20); del a
print(rss() - before)
"""
    out = {}
    for policy in ("default", "release"):
        proc = subprocess.run([sys.executable, "-c", code, policy], capture_output=True,
                              text=True, check=True, cwd=ROOT)  # fmt: skip
        out[policy] = float(proc.stdout.split()[-1])
    assert out["default"] > 12 and out["release"] < 12, out  # 16 MB kept vs 8 MB


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_lean_policy_restarts_a_command_once_with_huge_pages() -> None:
    """``restart_for("lean")`` re-executes the command (same interpreter and arguments)
    with glibc's huge-page tunable where glibc and the kernel offer it, exactly once; the
    restarted process sees the tunable and does not restart again. Other policies and an
    already-restarted process return without restarting."""
    code = """
import os, sys
from experiments import malloc
print("start", sys.argv[1], flush=True)
malloc.restart_for("lean")
print("hugepages", malloc.hugepages_active(), malloc.needs_restart("lean"))
"""
    env = {k: v for k, v in __import__("os").environ.items() if k != "GLIBC_TUNABLES"}
    env.pop("COMERA_MALLOC_RESTARTED", None)
    proc = subprocess.run([sys.executable, "-c", code, "arg"], capture_output=True, text=True,
                          check=True, cwd=ROOT, env=env)  # fmt: skip
    lines = proc.stdout.split("\n")
    mode = malloc._thp_mode()
    possible = mode == "madvise" and malloc._glibc_tunable_exists()
    assert lines.count("start arg") == (2 if possible else 1)  # arguments carried over
    assert f"hugepages {possible or mode == 'always'} False" in lines
    # a script read from stdin cannot be run again: no restart, the run goes on
    proc = subprocess.run([sys.executable, "-", "arg"], input=code, capture_output=True,
                          text=True, check=True, cwd=ROOT, env=env)  # fmt: skip
    assert proc.stdout.split("\n").count("start arg") == 1
    assert not malloc.needs_restart("lean")  # the test process: COMERA_MALLOC_RESTARTED
    for policy in ("default", "keep", "release"):
        assert not malloc.needs_restart(policy)
    with pytest.raises(ValueError, match="cpu_malloc='fast'"):
        malloc.needs_restart("fast")


def test_lean_without_huge_pages_warns_and_runs_as_release(tmp_path, monkeypatch) -> None:
    from experiments.dlrm.experiment import CPU_MALLOC
    from experiments.dlrm.experiment import main as dlrm_main

    assert CPU_MALLOC == "lean"  # what DLRM trains (and benchmarks) under on CPU
    applied = []
    monkeypatch.setattr(cli, "apply_cpu_malloc", malloc.apply_cpu_malloc)  # the real one
    monkeypatch.setattr(malloc, "set_cpu_malloc", lambda p: applied.append(p) or True)
    monkeypatch.setattr(malloc, "hugepages_active", lambda: False)
    run = tmp_path / "d"
    argv = ["--preset", "smoke", "--wandb", "disabled", "--no-progress", "--run-dir", str(run)]
    argv += ["--set", "train.steps=2", "--set", "train.eval_every=None"]
    argv += ["--set", "data.generated_rows=3000", "--set", "model.tt_min_rows=500"]
    with pytest.warns(UserWarning, match="'lean' runs without huge pages.*GLIBC_TUNABLES"):
        assert dlrm_main(argv) == 0  # in-process (argv given): never re-executed
    assert applied == ["lean"]


def test_reports_flag_lean_rows_measured_without_huge_pages() -> None:
    from experiments.malloc import lean_without_hugepages

    rows = [
        {"variant": "comera", "malloc": "lean", "hugepages": True},
        {"variant": "dense", "malloc": "default", "hugepages": False},
    ]
    assert lean_without_hugepages(rows) == ""  # as found, or lean on huge pages: fine
    rows.append({"variant": "dense_sgd", "malloc": "lean", "hugepages": False})
    text = lean_without_hugepages(rows)
    assert text.startswith("Warning: dense_sgd ran under `cpu_malloc=lean` without huge")


def test_a_command_restarts_for_its_policy_on_cpu_only(tmp_path, monkeypatch) -> None:
    """``main()`` run as a command (no argv) calls ``restart_for`` with the resolved
    policy before building anything, on CPU; with argv given, or on CUDA, it never does."""
    from experiments.dlrm import experiment as dlrm

    calls = []
    monkeypatch.setattr(cli, "restart_for", lambda p: calls.append(p))
    monkeypatch.setattr(cli, "prepare", lambda *a, **k: (_ for _ in ()).throw(SystemExit(7)))
    base = ["prog", "--preset", "smoke", "--run-dir", str(tmp_path / "r")]
    monkeypatch.setattr(sys, "argv", base)
    with pytest.raises(SystemExit):
        dlrm.main()
    assert calls == ["lean"]
    monkeypatch.setattr(sys, "argv", [*base, "--device", "cuda"])
    monkeypatch.setattr(cli, "check_device", lambda *a: None)  # as if this machine had one
    with pytest.raises(SystemExit):
        dlrm.main()
    with pytest.raises(SystemExit):
        dlrm.main(base[1:])  # argv given: an in-process call
    assert calls == ["lean"]


@pytest.mark.slow
def test_cli_flags_reach_the_config_and_may_change_on_resume(tmp_path, capsys, monkeypatch):
    applied = []  # a policy cannot be undone: record it instead of changing this process
    monkeypatch.setattr(cli, "apply_cpu_malloc", applied.append)
    run = tmp_path / "run"
    argv = [*FAST, "--run-dir", str(run), "--cpu-malloc", "keep", "--recompute"]
    assert mnli.main(argv) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["cpu_malloc"] == "keep" and saved["model"]["recompute"] is True
    # --recompute alone also selects the lean allocator (what it frees is then returned)
    args = cli.build_parser(mnli.EXPERIMENT).parse_args([*FAST, "--recompute"])
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, cli.build_parser(mnli.EXPERIMENT))
    assert cfg.train.cpu_malloc == "lean" and cfg.model.recompute is True
    ap = cli.build_parser(mnli.EXPERIMENT)  # resuming with --recompute keeps the saved policy
    args = ap.parse_args(["--resume", str(run), "--recompute"])
    assert cli.resolve_config(mnli.EXPERIMENT, args, ap).train.cpu_malloc == "keep"
    assert applied and set(applied) == {"keep"}
    ap = cli.build_parser(mnli.EXPERIMENT)
    args = ap.parse_args(["--resume", str(run), "--cpu-malloc", "default"])
    cfg = cli.resolve_config(mnli.EXPERIMENT, args, ap)
    assert cfg.train.cpu_malloc == "default" and cfg.model.recompute is True
    from experiments.dlrm.experiment import main as dlrm_main

    assert dlrm_main(["--preset", "smoke", "--recompute", "--run-dir", str(tmp_path / "d")]) == 2
    assert "--recompute" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("tt", [False, True])
def test_recomputed_blocks_give_the_same_values_and_gradients(tt: bool) -> None:
    """``recompute=True`` reruns each block in backward with the same dropout masks: the
    hidden states and every gradient equal the stored-activation run's."""
    cfg = EncoderConfig(
        vocab_size=100, max_len=16, d_model=32, heads=4, ffn=64, layers=2, dropout=0.2,
        tt=tt, rank=4, attn_modes=((8, 4), (4, 8)), ffn_in_modes=((8, 8), (4, 8)),
        ffn_out_modes=((4, 8), (8, 8)), emb_vocab_modes=(10, 10), emb_dim_modes=(4, 8),
        emb_rank=4,
    )  # fmt: skip
    params, state = init_encoder(cfg, generator=torch.Generator().manual_seed(0))
    leaves = [t.requires_grad_() for t in torch.utils._pytree.tree_leaves(params)]
    batch = {"input_ids": torch.randint(5, 100, (3, 16), generator=torch.Generator()),
             "attention_mask": torch.ones(3, 16)}  # fmt: skip

    def run(c: EncoderConfig) -> list[torch.Tensor]:
        torch.manual_seed(3)
        out = encoder_hidden(params, state, batch, c, train=True)
        grads = torch.autograd.grad(out.pow(2).sum(), leaves, allow_unused=True)
        return [out, *(g for g in grads if g is not None)]

    plain, again = run(cfg), run(dataclasses.replace(cfg, recompute=True))
    assert len(plain) == len(again) > 10
    for a, b in zip(plain, again, strict=True):
        torch.testing.assert_close(a, b)
    fused = run(dataclasses.replace(cfg, fused_qkv=True))  # Q, K, V in one GEMM (TT only)
    for a, b in zip(plain, fused, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)  # summation order only


class _DenseToy:
    """Fit a linear map with a dense 32 x 32 weight (GaLore projects it) and a bias."""

    def __init__(self) -> None:
        from tests.train_helpers import _Iter

        g = torch.Generator().manual_seed(5)
        self.w = torch.randn(32, 32, generator=g) / 6
        self.train_iter = _Iter(self.w)

    def loss(self, params, state, batch, *, train):
        x, y = batch
        pred = torch.nn.functional.linear(x, params["w"], params["b"])
        return (pred - y).pow(2).sum(), y.numel(), {}

    def evaluate(self, params, state):
        return {}


def _galore_trainer(tmp_path: Path, steps: int, resume: bool = False):
    from comera.train import ComeraConfig, Trainer
    from comera.train.galore import GaLoreConfig
    from comera.train.optim import AdamWConfig

    cfg = TrainConfig(
        steps=steps, run_dir=str(tmp_path), optimizer="galore", checkpoint_every=5,
        galore=GaLoreConfig(rank=8, update_proj_gap=4, scale=1.0, targets=("w",)),
        optim=AdamWConfig(lr_rest=3e-2, weight_decay=0.0), comera=ComeraConfig(enabled=False),
        wandb="disabled", progress=False, schedule="constant",
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(32, 32, generator=g) * 0.01, "b": torch.zeros(32)}
    return Trainer(cfg, _DenseToy(), params, {}, resume=resume)


def test_galore_trains_the_dense_baseline_and_resumes_exactly(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    whole = _galore_trainer(tmp_path / "whole", 40)
    assert whole.galore.projected == 1  # the 32 x 32 weight; the bias is plain AdamW
    first = whole.train_step(next(iter(whole.task.train_iter)))["loss"]
    whole.fit()
    last = whole.train_step(next(iter(whole.task.train_iter)))["loss"]
    assert last < 0.5 * first
    part = _galore_trainer(tmp_path / "part", 12)
    part.fit()  # writes checkpoints at 5 and 10 (and 12)
    import shutil

    from comera.train.checkpoint import complete_checkpoints

    shutil.rmtree(complete_checkpoints(tmp_path / "part")[-1])  # back to step 10
    again = _galore_trainer(tmp_path / "part", 12, resume=True)
    assert again.step == 10 and again.galore.torch.state  # projector and moments restored
    again.fit()
    for a, b in zip((part.params["w"], part.params["b"]), (again.params["w"], again.params["b"]),
                    strict=True):  # fmt: skip
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_galore_is_refused_for_a_comera_run_and_on_resume_from_adamw(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    from comera.train import CheckpointError
    from comera.train.optim import adamw_init

    with pytest.raises(ValueError, match="optimizer='galore' trains the dense baseline"):
        TrainConfig(steps=1, run_dir="x", optimizer="galore")
    adamw = _galore_trainer(tmp_path, 5)
    adamw.cfg = dataclasses.replace(adamw.cfg, optimizer="adamw")
    adamw.opt, adamw.galore = adamw_init(adamw.params), None
    adamw.fit()  # an AdamW run with a checkpoint at step 5
    with pytest.raises(CheckpointError, match="holds adamw optimizer state.*'galore'"):
        _galore_trainer(tmp_path, 5, resume=True)


@pytest.mark.slow
def test_figure_one_sweep_plumbing_on_a_toy_model(tmp_path: Path) -> None:
    pytest.importorskip("galore_torch")
    from benchmarks import efficiency

    argv = ["--batches", "1", "--repeats", "1", "--threads", "1", "--tiny", "--out",
            str(tmp_path)]  # fmt: skip
    assert efficiency.main(argv) == 0
    result = json.loads((tmp_path / "efficiency.json").read_text())
    assert {(r["variant"], r["batch"]) for r in result["runs"]} == {
        (v, 1) for v in ("comera", "dense", "galore")
    }
    assert {"cpu", "torch", "date"} <= set(result)  # what the report's header names
    # the report is rendered from the JSON alone, and rendered again from it the same
    assert (tmp_path / "efficiency.md").read_text() == efficiency.render(result)
    assert (tmp_path / "efficiency.png").is_file()
    again = tmp_path / "again"
    assert (
        efficiency.main(["--render", str(tmp_path / "efficiency.json"), "--out", str(again)]) == 0
    )
    assert (again / "efficiency.md").read_text() == efficiency.render(result)
    assert (again / "efficiency.png").is_file()
    assert (
        efficiency.command(result)
        == "python -m benchmarks.efficiency --tiny --batches 1 --repeats 1 --threads 1"
    )
    assert efficiency.main(["--batches", "x"]) == 2


@pytest.mark.parametrize(
    ("ranks", "biases"),
    [
        ((30, 30, 30), (True, False, True)),
        ((32, 8, 5), (True, False, True)),
        ((16, 0, 30), (True, True, True)),  # an aligned rank with a bias, an empty train
        ((30, 5), (False, False)),  # no bias anywhere: no slot to fill
        ((8,), (True,)),  # one layer, aligned, with a bias
    ],
)
def test_shared_input_tt_linears_equal_separate_calls(
    ranks: tuple[int, ...], biases: tuple[bool, ...]
) -> None:
    """Q, K, V through one wider GEMM (``tt_linear_shared_input``) give the values and
    gradients of three ``tt_linear`` calls and of the rebuilt dense weights: padded ranks,
    aligned ranks (no free bias slot), an empty train (every rank of its middle bond
    pruned and compacted away), layers of different ranks, with and without biases."""
    gen = torch.Generator().manual_seed(0)
    layers = []
    for r, has_bias in zip(ranks, biases, strict=True):
        spec = C.TTLinearSpec(out_modes=(4, 4, 4), in_modes=(4, 4, 4), ranks=max(r, 1))
        p, s = C.init(spec, generator=gen)
        if r == 0:  # kill the middle bond and compact: the layer is the zero map (+ bias)
            s = {"masks": [m if k != 2 else torch.zeros_like(m) for k, m in enumerate(s["masks"])]}
            p, s = C.compact(p, s)
            assert p["cores"][3].shape[0] == 0
        if has_bias:
            p["bias"] = torch.randn(64, generator=gen)
        else:
            p.pop("bias", None)
        layers.append((p, s))
    leaves = [t.requires_grad_() for p, _ in layers for t in torch.utils._pytree.tree_leaves(p)]
    x = torch.randn(5, 7, 64, generator=gen, requires_grad=True)
    w = [torch.randn(5, 7, 64, generator=gen) for _ in layers]

    def grads(outs: list[torch.Tensor]) -> list[torch.Tensor]:
        loss = sum((o * g).sum() for o, g in zip(outs, w, strict=True))
        return [*outs, *torch.autograd.grad(loss, [x, *leaves], allow_unused=True)]

    def dense(p: dict, s: dict) -> torch.Tensor:
        y = x @ C.to_dense(p, s).T
        return y + p["bias"] if "bias" in p else y

    fused = grads(tt_linear_shared_input(layers, x))
    separate = grads([C.tt_linear(p, s, x, plan="comera") for p, s in layers])
    reference = grads([dense(p, s) for p, s in layers])
    for a, b, c in zip(fused, separate, reference, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        if c is not None:  # None: a leaf the dense rebuild does not reach (an empty train)
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="expects a last dim of 64"):
        tt_linear_shared_input(layers, torch.randn(3, 32))


@pytest.mark.slow
def test_step_modes_bench_writes_its_table(tmp_path) -> None:
    """The step-mode bench runs the trainer's step per mode in fresh processes and
    writes the ratios against eager (tiny sizes: this checks the plumbing, not speed)."""
    from benchmarks import step_modes

    argv = ["--models", "smoke", "--modes", "sync_free", "--repeats", "1", "--tiny"]
    assert step_modes.main([*argv, "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "step_modes.json").read_text())
    assert [r["mode"] for r in result["runs"]] == ["eager", "sync_free"]  # eager added
    assert all(r["step_s"] > 0 and r["peak_mb"] > 0 for r in result["runs"])
    assert {"cpu", "torch", "date"} <= set(result)  # what the report's header names
    assert (tmp_path / "step_modes.md").read_text() == step_modes.render(result)
    assert step_modes.command(result) == (
        "python -m benchmarks.step_modes --tiny --models smoke --modes eager,sync_free --repeats 1"
    )
    assert step_modes.main(["--modes", "turbo"]) == 2


def test_step_modes_refuses_a_cuda_device_this_machine_lacks(tmp_path, monkeypatch, capsys):
    """Refused before any worker runs (it ran every point to failure and left a partial
    JSON), with the flag named; CUDA is hidden so the test runs on GPU machines too."""
    from benchmarks import step_modes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert step_modes.main(["--device", "cuda", "--out", str(tmp_path)]) == 2
    assert "--device cuda: no CUDA device here" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_step_modes_keeps_the_points_of_a_run_cut_short(tmp_path, monkeypatch) -> None:
    """The points go to ``step_modes.partial.json`` as they come, so a run stopped by a
    time limit (the GPU script's stages) keeps what it measured; a failing mode is
    recorded there with its error and the other modes still run (exit 1); the last
    complete report stays as it was; eager runs first whatever the order given."""
    from benchmarks import step_modes
    from experiments.workers import WorkerFailed

    seen = []

    def point(model, mode, *args):
        seen.append((model, mode))
        if model == "paper" and mode != "eager":
            raise WorkerFailed("step-mode worker paper/" + mode, "cut short")
        return {"model": model, "mode": mode, "batch": 8, "seq": 16, "first_step_s": 1.0,
                "step_s": 0.5, "peak_mb": 10.0}  # fmt: skip

    monkeypatch.setattr(step_modes, "run_point", point)
    (tmp_path / "step_modes.json").write_text('{"last": "complete"}')
    argv = ["--models", "smoke,paper", "--modes", "sync_free,eager", "--out", str(tmp_path)]
    assert step_modes.main(argv) == 1  # a failing mode: recorded, the others still run
    assert seen == [("smoke", "eager"), ("smoke", "sync_free"), ("paper", "eager"),
                    ("paper", "sync_free")]  # fmt: skip
    assert json.loads((tmp_path / "step_modes.json").read_text()) == {"last": "complete"}
    partial = json.loads((tmp_path / "step_modes.partial.json").read_text())
    assert partial["partial"] and len(partial["runs"]) == 4
    assert partial["runs"][-1] == {"model": "paper", "mode": "sync_free", "error": "cut short"}
    monkeypatch.setattr(step_modes, "run_point", lambda m, mode, *a: point("smoke", mode))
    assert step_modes.main([*argv[:1], "smoke", *argv[2:]]) == 0  # complete: report, no partial
    assert len(json.loads((tmp_path / "step_modes.json").read_text())["runs"]) == 2
    assert not (tmp_path / "step_modes.partial.json").exists()
    # a run failing at its first point leaves no older run's partial file behind
    (tmp_path / "step_modes.partial.json").write_text('{"older": "run"}')
    monkeypatch.setattr(step_modes, "run_point", lambda *a: (_ for _ in ()).throw(OSError("x")))
    with pytest.raises(OSError):
        step_modes.main(argv)
    assert not (tmp_path / "step_modes.partial.json").exists()


def test_step_modes_point_past_its_timeout_is_a_failed_point() -> None:
    """``--point-timeout``: a worker that runs past it (a long compile) is killed and
    reported like any failing worker, so the stage goes on to the next mode."""
    from benchmarks import step_modes

    with pytest.raises(
        RuntimeError, match=r"smoke/compile failed:\nstopped after --point-timeout 0.01 s"
    ):
        step_modes.run_point("smoke", "compile", 1, 1, True, "cpu", timeout=0.01)
