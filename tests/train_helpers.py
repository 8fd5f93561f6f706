"""The toy task of the trainer tests: fit a low-rank linear map with one TT layer."""

import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

import comera as C
from comera.train import AdamWConfig, ComeraConfig, TrainConfig


class _Iter:
    """A resumable stream of regression batches (x, y) drawn from a fixed seed."""

    def __init__(
        self, w: torch.Tensor, batch: int = 16, seed: int = 0, rank: int = 0, world: int = 1
    ):
        self.w, self.batch, self.seed, self.i = w, batch, seed, 0
        self.rank, self.world = rank, world

    def __iter__(self):
        return self

    def __next__(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.i)
        self.i += 1
        x = torch.randn(self.batch, self.w.shape[1], generator=g)
        y = x @ self.w.T
        per = self.batch // self.world
        return x[self.rank * per : (self.rank + 1) * per], y[
            self.rank * per : (self.rank + 1) * per
        ]

    def state_dict(self):
        return {"i": self.i}

    def load_state_dict(self, s):
        self.i = s["i"]


class ToyTask:
    """Fit a low-rank linear map with one TT layer (dropout-free, but uses RNG noise).

    Its loss is the batch mean, returned as one loss term: ``(mean, 1, metrics)``."""

    def __init__(
        self, rank: int = 0, world: int = 1, noise: float = 0.0, nan_at: int | None = None
    ):
        g = torch.Generator().manual_seed(123)
        self.w = (torch.randn(16, 2, generator=g) @ torch.randn(2, 16, generator=g)) / 4
        self.train_iter = _Iter(self.w, rank=rank, world=world)
        self.noise, self.nan_at, self.calls = noise, nan_at, 0

    def loss(self, params, state, batch, *, train):
        x, y = batch
        self.calls += 1
        if self.noise:  # consumes the global RNG like dropout would
            x = x + self.noise * torch.randn_like(x)
        pred = C.tt_linear(params["lin"], state["lin"], x)
        loss = (pred - y).pow(2).mean()
        if self.nan_at is not None and self.calls >= self.nan_at:
            loss = loss * float("nan")
        return loss, 1, {"accuracy": torch.tensor(0.0)}

    def evaluate(self, params, state):
        x, y = next(_Iter(self.w, batch=64, seed=99))
        return {"mse": float((C.tt_linear(params["lin"], state["lin"], x) - y).pow(2).mean())}


def _toy_model(seed=0):
    spec = C.TTLinearSpec(out_modes=(4, 4), in_modes=(4, 4), ranks=6)
    p, s = C.init(spec, generator=torch.Generator().manual_seed(seed))
    return {"lin": p}, {"lin": s}


def _cfg(tmp_path, **kw):
    comera = kw.pop("comera", ComeraConfig(gamma=0.5, tau=0.05, early_steps=40, prune_every=10))
    base = dict(
        steps=60,
        run_dir=str(tmp_path / "run"),
        optim=AdamWConfig(lr_cores=1e-2, lr_gates=5e-2, lr_rest=1e-2, weight_decay=0.0),
        comera=comera,
        log_every=5,
        schedule="constant",
        wandb="disabled",
        progress=False,
    )
    base.update(kw)
    return TrainConfig(**base)


class SplitIter(_Iter):
    """Global batches of 16 cut unevenly between two ranks (``split`` examples each)."""

    def __init__(self, w, rank=0, world=1, split=(5, 11)):
        super().__init__(w, batch=16, rank=rank, world=world)
        self.split = split if world > 1 else (16,)

    def __next__(self):
        x, y = self._full()
        lo = sum(self.split[: self.rank])
        return x[lo : lo + self.split[self.rank]], y[lo : lo + self.split[self.rank]]

    def _full(self):
        g = torch.Generator().manual_seed(self.seed * 100_003 + self.i)
        self.i += 1
        x = torch.randn(self.batch, self.w.shape[1], generator=g)
        return x, x @ self.w.T


class SumCountTask(ToyTask):
    """The toy task returning ``(sum, count, metrics)``: each example is one loss term.

    With ``legacy=True`` it returns the per-rank mean as one term instead, which weights
    ranks equally (the arithmetic the trainer used before exact counts): wrong under an
    uneven split."""

    def __init__(self, rank=0, world=1, split=(5, 11), legacy=False):
        super().__init__()
        self.train_iter = SplitIter(self.w, rank=rank, world=world, split=split)
        self.legacy = legacy

    def loss(self, params, state, batch, *, train):
        x, y = batch
        per_example = (C.tt_linear(params["lin"], state["lin"], x) - y).pow(2).mean(-1)  # (b,)
        if self.legacy:
            return per_example.mean(), 1, {}
        return per_example.sum(), per_example.numel(), {"mse": per_example.detach().mean()}

    def evaluate(self, params, state, *, rank=0, world=1):
        """Squared error over this rank's share of 50 held-out examples, as (sum, count)."""
        x, y = next(_Iter(self.w, batch=50, seed=99))
        lo, hi = rank * 50 // world, (rank + 1) * 50 // world
        err = (C.tt_linear(params["lin"], state["lin"], x[lo:hi]) - y[lo:hi]).pow(2).mean(-1)
        return {"mse": (float(err.sum()), float(hi - lo)), "rank_mean": float(rank)}


def free_port() -> int:
    """A free localhost TCP port for a gloo / torchrun rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


REPO = Path(__file__).resolve().parents[1]


def _python(code: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def lock_holder(run_dir: Path) -> subprocess.Popen:
    """Another process, holding ``run_dir``'s run lock until its stdin closes
    (``proc.communicate("")`` ends it)."""
    proc = _python(f"""
        import sys
        from comera.train.run_lock import hold_run_dir
        lock = hold_run_dir({str(run_dir)!r})
        print("held", flush=True)
        sys.stdin.read()
    """)
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def try_lock(run_dir: Path) -> str:
    """What another process gets when it tries ``run_dir``'s run lock: "held" or the
    refusal's message."""
    proc = _python(f"""
        from comera.train.run_lock import RunDirInUseError, hold_run_dir
        try:
            hold_run_dir({str(run_dir)!r})
            print("held")
        except RunDirInUseError as e:
            print(e)
    """)
    return proc.communicate("")[0].strip()


def spawn_ranks(script: Path, world: int, *args: str) -> list[int]:
    """Run ``script`` as ``world`` gloo ranks (env:// rendezvous, one thread each); return
    their exit codes."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env))
    return [p.wait(timeout=180) for p in procs]
