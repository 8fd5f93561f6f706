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
from comera.train import TrainConfig
from experiments import cli, mnli
from experiments.transformer import EncoderConfig, encoder_hidden, init_encoder

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--preset", "smoke", "--wandb", "disabled", "--no-progress"]
FAST += ["--set", "train.steps=3", "--set", "train.eval_every=None"]
FAST += ["--set", "data.generated_train=200", "--set", "data.generated_eval=30"]


def test_cpu_malloc_policies_and_errors() -> None:
    assert C.CPU_MALLOC_POLICIES == ("default", "keep", "release")
    assert C.set_cpu_malloc("default")  # changes nothing
    with pytest.raises(ValueError, match="cpu_malloc='fast'.*default"):
        C.set_cpu_malloc("fast")
    with pytest.raises(ValueError, match="TrainConfig.cpu_malloc='fast'"):
        TrainConfig(steps=1, run_dir="x", cpu_malloc="fast")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc")
def test_release_policy_returns_freed_memory_in_a_fresh_process() -> None:
    """An 8 MB block freed below a live one: glibc as found keeps it (its mmap threshold
    rose past 8 MB when an earlier block was freed), ``release`` unmaps it. Each policy
    runs in a child process because a policy cannot be undone."""
    code = """
import sys, torch, comera as C
def rss():
    return int(open('/proc/self/statm').read().split()[1]) * 4096 / 2**20
assert C.set_cpu_malloc(sys.argv[1])
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


def test_cli_flags_reach_the_config_and_may_change_on_resume(tmp_path, capsys) -> None:
    run = tmp_path / "run"
    argv = [*FAST, "--run-dir", str(run), "--cpu-malloc", "keep", "--recompute"]
    assert mnli.main(argv) == 0
    saved = json.loads((run / "config.json").read_text())
    assert saved["train"]["cpu_malloc"] == "keep" and saved["model"]["recompute"] is True
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
