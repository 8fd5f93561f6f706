"""Exact data-parallel arithmetic: unequal per-rank counts, accumulation, per-rank data
state, and a killed torchrun job resumed at another world size reading every token once."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten

from comera.train import CheckpointError, ComeraConfig, Trainer
from comera.train.checkpoint import complete_checkpoints, read_rank_files
from loaders import TokenLoader
from tests.loaders_helpers import body_tokens, config, expected_tokens, make_corpus
from tests.train_helpers import SumCountTask, ToyTask, _cfg, _toy_model, free_port, spawn_ranks

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}


def _leaves(tree):
    return tree_flatten(tree)[0]


UNEQUAL = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from tests.train_helpers import SumCountTask, _cfg, _toy_model
from comera.train import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out = Path(sys.argv[1])
for legacy in (False, True):
    # each rank starts from its own init: the trainer broadcasts rank 0's
    tr = Trainer(_cfg(out / str(legacy), steps=25), SumCountTask(rank, world, legacy=legacy),
                 *_toy_model(seed=rank))
    tr.fit()
    ev = tr.evaluate()  # a collective: every rank evaluates its share
    if rank == 0:
        torch.save(tr.params, out / f"params_{legacy}.pt")
        torch.save(ev, out / f"eval_{legacy}.pt")
dist.destroy_process_group()
"""


def test_unequal_per_rank_counts_match_single_process(tmp_path, one_thread):
    """Rank 0 holds 5 examples, rank 1 holds 11: weighting by counts gives the
    single-process model; averaging the per-rank means (the old arithmetic) does not.
    The ranks start from different inits (rank 0's is broadcast) and evaluate their own
    shares of the held-out data (reduced exactly)."""
    single = Trainer(_cfg(tmp_path / "single", steps=25), SumCountTask(), *_toy_model())
    single.fit()
    script = tmp_path / "worker.py"
    script.write_text(UNEQUAL)
    assert spawn_ranks(script, 2, str(tmp_path)) == [0, 0]
    exact = torch.load(tmp_path / "params_False.pt", weights_only=False)
    legacy = torch.load(tmp_path / "params_True.pt", weights_only=False)
    worst = 0.0
    for a, b, c in zip(_leaves(single.params), _leaves(exact), _leaves(legacy), strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
        if a.shape == c.shape:
            worst = max(worst, float((a - c).detach().abs().max()))
    assert worst > 1e-3  # the test can tell the exact weighting from the old one
    ev = torch.load(tmp_path / "eval_False.pt", weights_only=False)
    assert ev["mse"] == pytest.approx(single.evaluate()["mse"], rel=1e-5)
    assert ev["rank_mean"] == 0.5  # plain floats are averaged over ranks


NAMED = """
import json, sys, torch, torch.distributed as dist
from pathlib import Path
from tests.train_helpers import SumCountTask, _cfg, _toy_model
from comera.train import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

class Named(SumCountTask):
    # each rank names its own metric beside a shared one; every third step rank 1's
    # share is empty (a plain zero, no metrics), and each rank evaluates its own class
    calls = 0

    def loss(self, params, state, batch, *, train):
        Named.calls += 1
        if rank == 1 and Named.calls % 3 == 0:
            return torch.zeros(()), 0, {}
        s, n, _ = super().loss(params, state, batch, train=train)
        return s, n, {"shared": float(rank + 1), f"only{rank}": 10.0 * (rank + 1)}

    def evaluate(self, params, state, *, rank=0, world=1):
        return {"shared": (float(rank + 1), 1.0), f"class{rank}": (5.0 * (rank + 1), 2.0)}

tr = Trainer(_cfg(Path(sys.argv[1]), steps=4, log_every=1), Named(rank, world),
             *_toy_model())
tr.fit()
ev = tr.evaluate()
if rank == 0:
    Path(sys.argv[1], "eval.json").write_text(json.dumps(ev))
dist.destroy_process_group()
"""


def test_ranks_returning_other_metric_names_are_reduced_by_name(tmp_path, one_thread):
    """Metrics were reduced by position: a name one rank lacked took the other rank's
    value of another name (silently), and rank 1's documented empty share (a zero and no
    metrics) shifted the slots until a false "does not depend on the parameters" error."""
    script = tmp_path / "worker.py"
    script.write_text(NAMED)
    run = tmp_path / "run"
    assert spawn_ranks(script, 2, str(run)) == [0, 0]
    rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:  # rank 0 holds 5 examples, rank 1 11 (or none on its empty steps)
        n0, n1 = 5, 0 if r["loss_terms"] == 5 else 11
        assert r["loss_terms"] == n0 + n1
        assert r["shared"] == pytest.approx((1 * n0 + 2 * n1) / (n0 + n1))
        assert r["only0"] == pytest.approx(10 * n0 / (n0 + n1))
        assert ("only1" in r) == bool(n1)  # no rank held it: left out, as one process does
        if n1:
            assert r["only1"] == pytest.approx(20 * n1 / (n0 + n1))
    assert any(r["loss_terms"] == 5 for r in steps)  # an empty share was taken
    ev = json.loads((run / "eval.json").read_text())
    assert ev == {"shared": 1.5, "class0": 2.5, "class1": 5.0}


FIRST_FAILS = """
import atexit, sys, torch.distributed as dist
from pathlib import Path
from comera.errors import DataError
from comera.train.distributed import init_distributed, rank_first
def held():  # registered first, so it runs after every exit handler registered later
    Path(sys.argv[1], f"held{rank}").write_text(str(dist.is_initialized()))
atexit.register(held)
rank, _ = init_distributed("cpu")  # as the Trainer joins: the script never leaves the group
def build():
    if rank == 0:
        raise DataError("no such file: data.txt")
    return "built"
try:
    rank_first(build, rank, dist.get_world_size())
except DataError as e:
    print(f"rank {rank}: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_a_failure_on_rank_0_of_a_rank_first_build_stops_every_rank(tmp_path, capfd):
    """Rank 0 failed (a missing data file) while the others waited at a barrier: they
    died with a transport traceback when its exit closed the group. They now raise its
    error: one line each, the same status. A rank that exited holding the group could
    then abort in its teardown (status -6, now and then): the group is left at exit."""
    script = tmp_path / "worker.py"
    script.write_text(FIRST_FAILS)
    assert spawn_ranks(script, 2, str(tmp_path)) == [2, 2]
    err = capfd.readouterr().err
    assert "rank 0: no such file: data.txt" in err and "rank 1: no such file: data.txt" in err
    assert [(tmp_path / f"held{r}").read_text() for r in range(2)] == ["False", "False"]


OTHER_SHAPES = """
import sys, torch
from pathlib import Path
from torch import nn
import comera as C
from comera.errors import ConfigError
from comera.train.distributed import init_distributed
from comera.train.module_task import ModuleTask
from tests.train_helpers import _cfg, _Iter
rank, world = init_distributed("cpu")
torch.manual_seed(0)
rows = 110 if rank == 1 and sys.argv[2] == "frozen" else 100  # a per-rank vocabulary
width = 16 if rank == 0 or sys.argv[2] != "params" else 24
m = nn.Sequential(nn.Embedding(rows, 16), nn.Linear(16, width))
m[0].requires_grad_(False)
task = ModuleTask(m, lambda call, b: call(b[0]).pow(2).mean(), _Iter(torch.zeros(1, 16)))
off = C.train.ComeraConfig(enabled=False)
try:
    task.trainer(_cfg(Path(sys.argv[1]), steps=2, comera=off))
except ConfigError as e:
    print(f"rank {rank}: {e}", file=sys.stderr)
    sys.exit(2)
"""


def test_ranks_that_built_tensors_of_other_shapes_are_refused_alike(tmp_path, capfd):
    """Broadcasts pack each dtype's tensors into one buffer: a rank that built a frozen
    embedding of another vocabulary took rank 0's values at other offsets into every
    tensor after it (exit 0, ranks training different models), or aborted in gloo. Every
    rank now refuses, in one line naming the tensor."""
    script = tmp_path / "worker.py"
    script.write_text(OTHER_SHAPES)
    assert spawn_ranks(script, 2, str(tmp_path / "a"), "frozen") == [2, 2]
    err = capfd.readouterr().err
    said = ("rank(s) 1 built frozen tensors other than rank 0's (rank 1: 0.weight: "
            "float32[110, 16] here, float32[100, 16] on rank 0); build the model")  # fmt: skip
    assert f"rank 0: {said}" in err and f"rank 1: {said}" in err
    assert spawn_ranks(script, 2, str(tmp_path / "b"), "params") == [2, 2]
    err = capfd.readouterr().err
    assert err.count("rank(s) 1 built parameters or buffers other than rank 0's") == 2
    assert spawn_ranks(script, 2, str(tmp_path / "c"), "frozen-alike") == [0, 0]


LOG_REFUSED = """
import sys, types, torch, torch.distributed as dist
from pathlib import Path
from tests.train_helpers import SumCountTask, _cfg, _toy_model
from comera.errors import UserError
from comera.train import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
def refuse(**kw):  # as a wandb that cannot log in
    raise ValueError("no API key")
sys.modules["wandb"] = types.SimpleNamespace(init=refuse, errors=types.SimpleNamespace(
    Error=RuntimeError))
import importlib.util
importlib.util.find_spec = lambda name: object()
tr = Trainer(_cfg(Path(sys.argv[1]), steps=5, wandb="online"), SumCountTask(rank, world),
             *_toy_model())
try:
    tr.fit()
except UserError as e:
    print(f"rank {rank}: {e}", file=sys.stderr)
    dist.destroy_process_group()  # as a script should: no connection left to close under load
    sys.exit(2)
"""


def test_a_run_log_rank_0_cannot_start_stops_every_rank(tmp_path, capfd):
    """Only rank 0 starts wandb. When it cannot, rank 0 left with one line while rank 1
    had gone into its first step and died on a closed connection (a 74-line torchrun
    trace). Every rank now learns of it and stops with one line."""
    script = tmp_path / "worker.py"
    script.write_text(LOG_REFUSED)
    assert spawn_ranks(script, 2, str(tmp_path / "run")) == [2, 2]
    err = capfd.readouterr().err
    assert "rank 0: wandb='online': wandb could not start (no API key)" in err
    assert "rank 1: rank 0 could not start its run log: wandb='online'" in err
    assert "Traceback" not in err


def test_accumulated_micro_batches_equal_the_full_batch(tmp_path):
    """Two uneven micro-batches (5 + 11 examples) per step equal one batch of 16."""
    comera = ComeraConfig(gamma=0.5, tau=0.05, early_steps=10, prune_every=5)
    full = Trainer(_cfg(tmp_path / "a", steps=20, comera=comera), SumCountTask(), *_toy_model())
    full.fit()

    class Micro(SumCountTask):
        def __init__(self):
            super().__init__()
            self.train_iter = _MicroIter(self.train_iter)

    cfg = _cfg(tmp_path / "b", steps=20, comera=comera, accum_steps=2)
    acc = Trainer(cfg, Micro(), *_toy_model())
    acc.fit()
    for a, b in zip(_leaves(full.params), _leaves(acc.params), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


class _MicroIter:
    """Cuts each batch of 16 into micro-batches of 5 and 11."""

    def __init__(self, inner):
        self.inner, self.pending = inner, []

    def __iter__(self):
        return self

    def __next__(self):
        if not self.pending:
            x, y = next(self.inner)
            self.pending = [(x[5:], y[5:]), (x[:5], y[:5])]
        return self.pending.pop()

    def state_dict(self):
        return self.inner.state_dict()

    def load_state_dict(self, s):
        self.inner.load_state_dict(s)


def test_data_state_from_another_step_is_refused(tmp_path):
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    newest = complete_checkpoints(cfg.run_dir)[-1]
    data = newest / "data_rank00000.json"
    data.write_text(data.read_text().replace('"step": 10', '"step": 7'))
    with pytest.raises(CheckpointError, match="data state of rank 0 .* from step 7 but the model"):
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)


def test_iterator_that_cannot_rescale_is_refused_at_another_world_size(tmp_path):
    cfg = _cfg(tmp_path, steps=10)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    newest = complete_checkpoints(cfg.run_dir)[-1]
    text = (
        (newest / "data_rank00000.json").read_text().replace('"world_size": 1', '"world_size": 2')
    )
    (newest / "data_rank00000.json").write_text(text)
    (newest / "data_rank00001.json").write_text(text.replace('"rank": 0', '"rank": 1'))
    torch.save(torch.load(newest / "rank00000.pt", weights_only=False), newest / "rank00001.pt")
    model = torch.load(newest / "model.pt", weights_only=False)
    torch.save({**model, "world_size": 2}, newest / "model.pt")
    with pytest.raises(CheckpointError, match="saved by 2 ranks .* _Iter cannot resume"):
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)
    assert len(read_rank_files(newest, 10)[1]) == 2


# ----------------------------------------------------------------------- TokenLoader end to end

TOKEN_JOB = """
import os, signal, sys, torch
from pathlib import Path
import comera as C
from comera.train.optim import AdamWConfig
from comera.train import ComeraConfig, TrainConfig, Trainer, init_distributed
from loaders import TokenLoader
from tests.loaders_helpers import config

root, run_dir, total, die_at = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
resume = sys.argv[5] == "1"
torch.set_num_threads(1)
rank, world = init_distributed("cpu")


class TokenTask:
    '''Predict nothing useful: a TT layer over one-hot(token % 16); loss terms = real tokens.'''

    def __init__(self):
        self.train_iter = TokenLoader(config([("a", root / "a", 0.6), ("b", root / "b", 0.4)],
                                             seq_len=16, batch_size=2))
        self.trainer = None
        self.log = open(Path(run_dir) / f"tokens_{os.getpid()}.txt", "a")

    def loss(self, params, state, batch, *, train):
        step = self.trainer.step + 1
        ids = batch["input_ids"]
        self.log.write(f"{step} " + " ".join(map(str, ids.reshape(-1).tolist())) + "\\n")
        self.log.flush()
        if rank == 0 and step == die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        x = torch.nn.functional.one_hot(ids % 16, 16).float()  # (B, T, 16)
        y = C.tt_linear(params["lin"], state["lin"], x)
        real = (ids != 0).float()
        return (y.pow(2).mean(-1) * real).sum(), real.sum(), {}

    def evaluate(self, params, state):
        return {}


spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4)
p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
cfg = TrainConfig(steps=total, run_dir=run_dir, checkpoint_every=5, wandb="disabled",
                  progress=False, optim=AdamWConfig(lr_cores=1e-2),
                  comera=ComeraConfig(early_steps=10, prune_every=5))
task = TokenTask()
tr = Trainer(cfg, task, {"lin": p}, {"lin": s}, resume=resume)
task.trainer = tr
tr.fit()
"""


def _torchrun(script: Path, nproc: int, *args: str) -> int:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
           "--master_port", str(free_port()), str(script), *args]  # fmt: skip
    return subprocess.run(cmd, env=ENV, capture_output=True, timeout=300).returncode


def test_torchrun_killed_then_resumed_on_one_process_reads_every_token_once(tmp_path):
    """2 ranks, SIGKILL at step 13 (last checkpoint: step 10), resume with 1 process to step
    30, then drain the rest of the epoch from the final checkpoint: the tokens the training
    consumed (up to the checkpoint before the kill, then after the resume) plus the rest of
    the epoch are the corpus, every token exactly once."""
    root = tmp_path / "corpus"
    docs = make_corpus(root / "a", 40, first_id=0, seed=1, max_len=60)
    docs |= make_corpus(root / "b", 30, first_id=5000, seed=2, max_len=60)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    script = tmp_path / "job.py"
    script.write_text(TOKEN_JOB)
    assert _torchrun(script, 2, str(root), str(run_dir), "30", "13", "0") != 0  # killed
    first = sorted(run_dir.glob("tokens_*.txt"))
    assert len(first) == 2
    assert complete_checkpoints(run_dir)[-1].name == "step_00000010"
    for f in first:
        f.rename(f.with_name("first_" + f.name))
    assert _torchrun(script, 1, str(root), str(run_dir), "30", "0", "1") == 0
    consumed = []
    for f in run_dir.glob("*tokens_*.txt"):
        for line in f.read_text().splitlines():
            step, *ids = map(int, line.split())
            if not f.name.startswith("first_") or step <= 10:  # lost steps 11-13 were redone
                consumed.append(np.array(ids))
    assert len(consumed) == 10 * 2 + 20  # 10 steps on 2 ranks, then 20 on one
    # the rest of the epoch, from the final checkpoint's per-rank data state
    _, datas = read_rank_files(complete_checkpoints(run_dir)[-1], 30)
    rest = TokenLoader(config([("a", root / "a", 0.6), ("b", root / "b", 0.4)], seq_len=16,
                              batch_size=2, num_epochs=1))  # fmt: skip
    rest.load_state_dict([d["state"] for d in datas])
    tail = [b["input_ids"].numpy().reshape(-1) for b in rest]
    got = np.sort(np.concatenate([body_tokens([{"input_ids": torch.from_numpy(np.concatenate(
        consumed + tail))}])]))  # fmt: skip
    assert np.array_equal(got, expected_tokens(docs))


def test_a_cuda_index_other_than_the_ranks_gpu_is_refused(monkeypatch):
    """Under torchrun each rank runs on its LOCAL_RANK GPU; ``cuda:0`` on rank 1 would put
    two ranks on one GPU, so it is refused naming the flag, and ``cuda`` is taken."""
    from comera.errors import ConfigError
    from comera.train import distributed

    monkeypatch.setattr(distributed, "rank_world", lambda: (1, 2))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    with pytest.raises(ConfigError, match="--device cuda"):
        distributed.check_rank_device("cuda:0")
    for ok in ("cuda", "cuda:1", "cpu"):
        distributed.check_rank_device(ok)
    monkeypatch.setattr(distributed, "rank_world", lambda: (0, 1))
    distributed.check_rank_device("cuda:0")  # one process: any GPU it names


LIBRARY_JOB = """
import sys, torch
import comera as C
from comera.train import ComeraConfig, TrainConfig, Trainer
from comera.train.distributed import rank_world

torch.set_num_threads(1)


class Task:  # each rank its own rows: seeded by the rank the trainer joined as
    def __init__(self):
        self.train_iter = self

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(rank_world()[0])
        return torch.randn(4, 16, generator=g)

    def loss(self, params, state, x, *, train):
        return C.tt_linear(params["lin"], state["lin"], x).pow(2).sum(), x.shape[0], {}

    def evaluate(self, params, state):
        return {}


spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=4)
p, s = C.init(spec, generator=torch.Generator().manual_seed(0))
cfg = TrainConfig(steps=2, run_dir=sys.argv[1], checkpoint_every=2, wandb="disabled",
                  progress=False, comera=ComeraConfig(early_steps=2))
tr = Trainer(cfg, Task(), {"lin": p}, {"lin": s})  # no init_distributed: the trainer joins
assert (tr.rank, tr.world) == rank_world() and tr.world == 2, (tr.rank, tr.world)
tr.fit()
"""


def test_a_library_trainer_under_torchrun_joins_the_process_group(tmp_path):
    """``Trainer(...).fit()`` under torchrun is data-parallel as documented without the
    caller joining the process group: both ranks write their files into one checkpoint
    (each trained alone, as world 1, before)."""
    script = tmp_path / "job.py"
    script.write_text(LIBRARY_JOB)
    assert _torchrun(script, 2, str(tmp_path / "run")) == 0
    names = {p.name.split(".")[0] for p in complete_checkpoints(tmp_path / "run")[-1].iterdir()}
    assert {"rank00000", "rank00001"} <= names, names


@pytest.mark.parametrize(
    ("damage", "said"),
    [
        (lambda d: (d / "data_rank00000.json").write_text("[1, 2]"), "is not a comera.data_state"),
        (
            lambda d: (d / "data_rank00000.json").write_text(
                '{"format": "comera.data_state", "step": 10}'
            ),
            "lacks its rank, world_size or step",
        ),
        (lambda d: torch.save({"rank": 0}, d / "rank00000.pt"), "lacks its step or RNG state"),
        (
            lambda d: torch.save({"format": "comera.checkpoint", "step": 10}, d / "model.pt"),
            "lacks config, params, state, opt, stages, initial_size",
        ),
    ],
)
def test_a_hand_damaged_checkpoint_file_is_named(tmp_path, damage, said):
    """Files of the right format with fields missing were bare KeyErrors and
    AttributeErrors; each is a CheckpointError naming the file."""
    cfg = _cfg(tmp_path, steps=10, checkpoint_every=5)
    Trainer(cfg, ToyTask(), *_toy_model()).fit()
    damage(complete_checkpoints(cfg.run_dir)[-1])
    with pytest.raises(CheckpointError, match=said):
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)


UNREACHED = """
import sys, torch, torch.distributed as dist
from pathlib import Path
from tests.train_helpers import SumCountTask, _cfg, _toy_model
from comera.errors import UserError
from comera.train import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
other = torch.randn(16, 16, requires_grad=True)
class Elsewhere(SumCountTask):  # "one": rank 1's share reaches the model, rank 0's not
    def loss(self, params, state, batch, *, train):
        if sys.argv[2] == "detached":  # rank 0's sum detached, rank 1's not
            s, n, m = super().loss(params, state, batch, train=train)
            return (s.detach() if rank == 0 else s), n, m
        if rank == 1 and sys.argv[2] == "one":
            return super().loss(params, state, batch, train=train)
        x, y = batch
        per_example = (x @ other - y).pow(2).mean(-1)
        return per_example.sum(), len(y), {"mse": per_example.detach().mean()}
tr = Trainer(_cfg(Path(sys.argv[1]) / str(rank), steps=3, step_mode=sys.argv[3]),
             Elsewhere(rank, world), *_toy_model())
try:
    tr.fit()
except UserError as e:
    print(f"rank {rank}: {e}", file=sys.stderr)
    dist.destroy_process_group()
    sys.exit(2)
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["eager", "sync_free"])
def test_a_loss_that_reaches_the_model_on_no_rank_stops_every_rank(tmp_path, capfd, mode):
    """The reach check sums over ranks: when no rank's loss reaches the model every rank
    refuses at the first step (one rank alone raising would leave the others waiting);
    when one rank's does, the run trains."""
    script = tmp_path / "worker.py"
    script.write_text(UNREACHED)
    assert spawn_ranks(script, 2, str(tmp_path / "none"), "none", mode) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("reaches none of the parameters") == 2 and "Traceback" not in err
    assert spawn_ranks(script, 2, str(tmp_path / "one"), "one", mode) == [0, 0]
    # one rank's detached share: raised by that rank alone, it left the other to die in
    # the all-reduce with a traceback (or hang, under nccl)
    capfd.readouterr()
    assert spawn_ranks(script, 2, str(tmp_path / "det"), "detached", mode) == [2, 2]
    err = capfd.readouterr().err
    assert err.count("does not depend on the parameters") == 2 and "Traceback" not in err


def test_commands_leave_only_the_group_they_made():
    """An experiment command leaves the process group it joined (a rank exiting with it
    closed connections under the others, aborting them at exit), but not one its Python
    caller made before calling it."""
    from comera.train.distributed import own_process_group
    from experiments.mnli import experiment as mnli

    def join():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0,
                                world_size=1)  # fmt: skip

    join()
    try:
        assert mnli.main(["--preset", "smoke", "--set", "train.device=gpu"]) == 2
        assert dist.is_initialized()  # the caller's: kept
    finally:
        dist.destroy_process_group()
    with own_process_group():
        join()  # as init_distributed joins under torchrun
    assert not dist.is_initialized()


REPLICAS = """
import sys, torch, torch.distributed as dist, torch.nn.functional as F
from pathlib import Path
from torch import nn
import comera as C
from comera.train import ComeraConfig, TrainConfig
from comera.train.module_task import ModuleTask
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
out, steps, resume = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "resume"
torch.manual_seed(rank)  # each rank its own init: frozen head and buffers differ too
model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
model[1].running_mean.add_(rank)
C.tensorize_(model, C.TensorizeConfig(target_modules=("0",), rank=4, init="random"))
model[3].requires_grad_(False)
w = torch.randn(16, 4, generator=torch.Generator().manual_seed(5))

class Batches:
    def __init__(self):
        self.i = 0
    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(self.i)
            self.i += 1
            x = torch.randn(8, 16, generator=g)
            y = (x @ w).argmax(-1)
            yield x[rank * 4 : rank * 4 + 4], y[rank * 4 : rank * 4 + 4]
    def state_dict(self):
        return {"i": self.i}
    def load_state_dict(self, s):
        self.i = s["i"]

def loss(call, batch):
    x, y = batch
    return F.cross_entropy(call(x), y, reduction="sum"), len(y), {}

task = ModuleTask(model, loss, Batches())
cfg = TrainConfig(steps=steps, run_dir=str(out), checkpoint_every=4, progress=False,
                  wandb="disabled", comera=ComeraConfig(early_steps=4, prune_every=2))
task.trainer(cfg, resume=resume).fit()
torch.save({k: v.clone() for k, v in model.state_dict().items()}, out / f"model_{rank}.pt")
dist.destroy_process_group()
"""


def test_module_task_ranks_hold_one_model_and_resume_exactly(tmp_path):
    """Frozen parameters are neither params nor state, so the start's broadcast missed
    them; BatchNorm statistics each rank updated from its own share stayed its own, so
    the ranks evaluated two models and a resume (from rank 0's) did not continue rank 1.
    Both are rank 0's on every rank now, and a resume at the same world size continues
    bit-identically."""
    script = tmp_path / "worker.py"
    script.write_text(REPLICAS)
    full, cut = tmp_path / "full", tmp_path / "cut"
    assert spawn_ranks(script, 2, str(full), "8", "new") == [0, 0]
    shutil.copytree(full, cut)  # as if stopped after step 4's checkpoint
    shutil.rmtree(cut / "checkpoints" / "step_00000008")
    assert spawn_ranks(script, 2, str(cut), "8", "resume") == [0, 0]
    models = [torch.load(d / f"model_{r}.pt") for d in (full, cut) for r in range(2)]
    assert models[0]["1.running_mean"].abs().max() > 0
    for other in models[1:]:
        assert models[0].keys() == other.keys()
        for k, v in models[0].items():
            assert torch.equal(v, other[k]), k


@pytest.mark.parametrize(
    ("env", "text"),
    [
        ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2 but MASTER_ADDR, MASTER_PORT are not set"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE='two' is not a process count"),
    ],
)
def test_a_partial_launch_environment_is_one_line(env, text, monkeypatch, capsys, tmp_path) -> None:  # noqa: ANN001
    """WORLD_SIZE set by hand without torchrun's other variables was a ValueError
    traceback from torch's rendezvous (or from int())."""
    from comera.errors import ConfigError
    from comera.train.distributed import init_distributed
    from experiments.mnli import experiment as mnli

    for var in ("RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    with pytest.raises(ConfigError, match=text):
        init_distributed("cpu")
    run = tmp_path / "run"
    argv = ["--preset", "smoke", "--no-progress", "--wandb", "disabled", "--run-dir", str(run)]
    assert mnli.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and text in err[0], err
    assert not run.exists()


BAD_COUNT = """
import math, sys, torch, torch.distributed as dist
from pathlib import Path
from tests.train_helpers import ToyTask, _cfg, _toy_model
from comera.train import Trainer
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()

class Bad(ToyTask):  # rank 1's second batch holds no count
    def loss(self, params, state, batch, *, train):
        s, n, m = super().loss(params, state, batch, train=train)
        return s, math.nan if rank == 1 and self.calls >= 2 else n, m

code = 0
try:
    Trainer(_cfg(Path(sys.argv[1]), steps=4), Bad(rank=rank, world=2), *_toy_model()).fit()
except ValueError as e:
    ok = "returned a count that is not a finite number >= 0 for 1 batch(es)" in str(e)
    code = 3 if ok else 4
dist.destroy_process_group()  # a process exiting while it holds the group may abort (-6)
raise SystemExit(code)
"""


def test_a_bad_count_on_one_rank_stops_every_rank_together(tmp_path):
    """A NaN count on one rank raised there alone, before the all-reduce: the other rank
    waited in the collective until the first one's process was gone (NCCL: until its
    timeout). Every rank now raises the same error after the reduction."""
    script = tmp_path / "worker.py"
    script.write_text(BAD_COUNT)
    assert spawn_ranks(script, 2, str(tmp_path)) == [3, 3]
