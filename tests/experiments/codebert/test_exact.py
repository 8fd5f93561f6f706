"""The loader's promise end to end: the CodeBERT smoke run under torchrun, SIGKILLed mid-run
and resumed on another number of processes, trains on every (document, offset) of the
corpus exactly once; resumed on the same number it ends bit-identical to a run never
stopped."""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

from comera.train.checkpoint import complete_checkpoints, read_rank_files
from experiments import cli
from experiments.codebert.experiment import EXPERIMENT, build
from loaders import TokenLoader
from tests.train_helpers import free_port

ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
STEPS, EVERY = 10, 5

# The experiment's own CLI path (parse, resolve, prepare, train) with one change: the task's
# loss first writes the (document, offset) pairs of its batch, and rank 0 SIGKILLs itself
# when it reaches step ``die_at`` (0: never).
JOB = """
import os, signal, sys
from pathlib import Path
from experiments import cli
from experiments.codebert.experiment import EXPERIMENT

log_dir, die_at, argv = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
ap = cli.build_parser(EXPERIMENT)
args = ap.parse_args(argv)
run = cli.prepare(EXPERIMENT, cli.resolve_config(EXPERIMENT, args, ap),
                  resume=args.resume is not None)
trainer, inner = run.trainer, run.trainer.task.loss
log = open(log_dir / f"consumed_rank{run.rank}.txt", "a")

def loss(params, state, batch, *, train=True):
    step = trainer.step + 1
    if run.rank == 0 and step == die_at:
        os.kill(os.getpid(), signal.SIGKILL)
    real = batch["doc_ids"] >= 0
    pairs = zip(batch["doc_ids"][real].tolist(), batch["doc_offsets"][real].tolist())
    log.write(f"{step} " + " ".join(f"{d}:{o}" for d, o in pairs) + "\\n")
    log.flush()
    return inner(params, state, batch, train=train)

run.trainer.task.loss = loss
cli.train(run)
"""


def _sets(cache: Path) -> list[str]:
    sets = [f"train.steps={STEPS}", f"train.checkpoint_every={EVERY}", "train.eval_every=100",
            "data.max_files=6", "data.vocab=400", "data.eval_batches=1", "data.seq_len=64",
            "data.provenance=true", "batch_size=6", "train.warmup_steps=0",
            "train.comera.reg_start_step=2", "train.comera.early_steps=6",
            "train.comera.prune_every=2", f"data.cache_dir={cache}"]  # fmt: skip
    return [x for kv in sets for x in ("--set", kv)]


def _launch(tmp: Path, nproc: int, log: str, die_at: int, *argv: str) -> int:
    (tmp / log).mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(tmp / "job.py"), str(tmp / log),
           str(die_at), "--no-progress", "--wandb", "disabled", *argv]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=300).returncode


def _consumed(folder: Path, up_to: int | None = None) -> Counter:
    """(document, offset) pairs the logged steps trained on, steps <= ``up_to``."""
    out: Counter = Counter()
    for f in folder.glob("consumed_rank*.txt"):
        for line in f.read_text().splitlines():
            step, *pairs = line.split()
            if up_to is None or int(step) <= up_to:
                out.update(tuple(map(int, p.split(":"))) for p in pairs)
    return out


def _epoch_pairs(config, states: list[dict] | None = None) -> Counter:
    """Every (document, offset) one epoch holds; from ``states``: what is left of it."""
    loader = TokenLoader(dataclasses.replace(config, num_epochs=1, provenance=True))
    if states is not None:
        loader.load_state_dict(states)
    out: Counter = Counter()
    for b in loader:
        real = b["doc_ids"] >= 0
        out.update(zip(b["doc_ids"][real].tolist(), b["doc_offsets"][real].tolist(), strict=True))
    return out


def _rest(run: Path, config) -> Counter:
    _, datas = read_rank_files(complete_checkpoints(run)[-1], STEPS)
    return _epoch_pairs(config, [d["state"] for d in datas])


def _model(run: Path) -> dict:
    return torch.load(complete_checkpoints(run)[-1] / "model.pt", weights_only=False)


@pytest.mark.slow
@pytest.mark.parametrize("before,after", [(2, 1), (1, 3)])
def test_killed_torchrun_resumed_at_another_world_size_trains_each_token_once(
    tmp_path: Path, before: int, after: int
) -> None:
    (tmp_path / "job.py").write_text(JOB)
    sets, run = _sets(tmp_path / "cache"), tmp_path / "run"
    rc = _launch(tmp_path, before, "first", 8, "--preset", "smoke", "--run-dir", str(run), *sets)
    assert rc != 0  # SIGKILL at step 8: the newest checkpoint is step 5
    assert complete_checkpoints(run)[-1].name == f"step_{EVERY:08d}"
    if before == 2:  # the same world size again: bit-identical to a run never stopped
        same = tmp_path / "same"
        shutil.copytree(run, same)
        assert _launch(tmp_path, 2, "same_log", 0, "--resume", str(same)) == 0
        whole = tmp_path / "whole"
        argv = ("--preset", "smoke", "--run-dir", str(whole), *sets)
        assert _launch(tmp_path, 2, "whole_log", 0, *argv) == 0
        a, b = _model(same), _model(whole)
        assert a["step"] == b["step"] == STEPS
        for x, y in zip(torch.utils._pytree.tree_leaves(a["params"]),
                        torch.utils._pytree.tree_leaves(b["params"]), strict=True):  # fmt: skip
            assert torch.equal(x, y)
    assert _launch(tmp_path, after, "second", 0, "--resume", str(run)) == 0
    ap = cli.build_parser(EXPERIMENT)
    cfg = cli.resolve_config(EXPERIMENT, ap.parse_args(["--resume", str(run)]), ap)
    config = build(cfg)[0].train_iter.config
    trained = _consumed(tmp_path / "first", up_to=EVERY) + _consumed(tmp_path / "second")
    assert sum(trained.values()) > 0 and max(trained.values()) == 1
    assert trained + _rest(run, config) == _epoch_pairs(config)  # each exactly once
