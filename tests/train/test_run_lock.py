"""One process per run dir: a second one is refused before it writes anything there."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

import pytest

from comera.errors import CheckpointError
from comera.train import Trainer
from comera.train.run_lock import LOCK_FILE, RunDirInUseError, hold_run_dir
from tests.train_helpers import ToyTask, _cfg, _toy_model, lock_holder, spawn_ranks, try_lock


def _files(run_dir: Path) -> dict[str, bytes]:
    """Every file of the run (the holder's lock file aside), by path."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file() and p.name != LOCK_FILE}  # fmt: skip


def test_a_second_process_is_refused_before_it_writes(tmp_path):
    """A resume while another process trains into the run (a requeued job beside the old
    one) interleaved metrics.jsonl and could delete the other's half-written checkpoint;
    it is refused, naming the holder, with the run's files as they were."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    params, state = _toy_model()
    Trainer(cfg, ToyTask(), params, state).fit(until=15)  # a pause: checkpoint at 15
    run_dir = Path(cfg.run_dir)
    with open(run_dir / "metrics.jsonl", "a") as f:  # the holder's rows past it
        f.write(json.dumps({"step": 17, "loss": 0.5}) + "\n")
    before = _files(run_dir)
    proc = lock_holder(run_dir)
    try:
        with pytest.raises(RunDirInUseError, match=rf"in use by another run \(pid {proc.pid} on "):
            Trainer(cfg, ToyTask(), params, state, resume=True)
        assert _files(run_dir) == before  # metrics.jsonl not cut back to step 15
    finally:
        proc.communicate("")
    tr = Trainer(cfg, ToyTask(), params, state, resume=True)  # its holder has gone
    assert tr.step == 15 and '"step": 17' not in (run_dir / "metrics.jsonl").read_text()


def test_one_process_shares_its_lock_and_releases_it_with_its_last_holder(tmp_path):
    """``fit(until=k)`` then ``fit()``, and a second trainer of the run in the same process,
    are one process: not refused. The lock ends with the last trainer holding it."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    params, state = _toy_model()
    first = Trainer(cfg, ToyTask(), params, state)
    first.fit(until=10)
    first.fit(until=15)
    second = Trainer(cfg, ToyTask(), params, state, resume=True)
    assert second.step == 15
    assert "in use by another run" in try_lock(Path(cfg.run_dir))
    del first
    assert "in use by another run" in try_lock(Path(cfg.run_dir))  # second holds it
    del second
    assert try_lock(Path(cfg.run_dir)) == "held"


def test_a_forked_child_does_not_keep_the_lock(tmp_path):
    """DataLoader workers are forked: a child's copy of the descriptor kept the lock after
    its parent ended (a requeue after SIGKILL waited for the workers). Children close it."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = hold_run_dir(run_dir)
    pid = os.fork()
    if pid == 0:  # the child: holds nothing, sleeps past the parent's release
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        assert try_lock(run_dir) == "held"  # another process takes it while the child lives
        assert os.waitpid(pid, os.WNOHANG) == (0, 0)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def test_the_lock_file_names_its_holder(tmp_path):
    lock = hold_run_dir(tmp_path, flag="--run-dir")
    info = json.loads((tmp_path / LOCK_FILE).read_text())
    assert info["pid"] == os.getpid() and info["host"] and info["since"]
    assert lock.held
    lock.release()
    lock.release()  # twice: nothing more
    assert not lock.held


RANKS = """
import sys
from pathlib import Path
from comera.train import Trainer
from comera.train.distributed import init_distributed
from comera.train.run_lock import RunDirInUseError
from tests.train_helpers import ToyTask, _cfg, _toy_model, lock_holder, try_lock
rank, world = init_distributed("cpu")
try:
    tr = Trainer(_cfg(Path(sys.argv[1]), steps=2), ToyTask(rank, world), *_toy_model())
except RunDirInUseError as e:
    print(f"rank {rank}: {e}", file=sys.stderr)
    sys.exit(2)
tr.fit()
"""


def test_every_rank_of_a_distributed_run_gets_rank_0s_outcome(tmp_path, capfd):
    """Rank 0 takes the lock for the run; when another process holds it, every rank is
    refused with its message (not rank 0 alone, leaving the others waiting)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANKS)
    (tmp_path / "run").mkdir()
    holder = lock_holder(tmp_path / "run")
    try:
        assert spawn_ranks(script, 2, str(tmp_path)) == [2, 2]
    finally:
        holder.communicate("")
    err = capfd.readouterr().err
    assert all(f"rank {r}: {tmp_path / 'run'} is in use by another run" in err for r in (0, 1))
    assert spawn_ranks(script, 2, str(tmp_path)) == [0, 0]  # then it trains, both ranks


def test_a_renamed_run_dir_is_still_this_processs(tmp_path):
    """The lock was shared by path: a run dir moved while its trainer lived refused its
    own process at the new path. It is shared by folder (device, inode)."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    first = Trainer(cfg, ToyTask(), *_toy_model())
    first.fit(until=10)
    moved = tmp_path / "moved"
    os.rename(cfg.run_dir, moved)
    second = Trainer(dataclasses.replace(cfg, run_dir=str(moved)), ToyTask(), *_toy_model(),
                     resume=True)  # fmt: skip
    assert second.step == 10
    assert "in use by another run" in try_lock(moved)
    del first, second


def test_close_gives_the_run_dir_back_and_fit_takes_it_again(tmp_path):
    """A trainer kept alive (a notebook; a sync_free trainer, whose step holds a method of
    it, lives until the garbage collector runs) held the run dir; ``close`` gives it back,
    and a later ``fit`` takes it again, refused while another process holds it."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    tr = Trainer(cfg, ToyTask(), *_toy_model())
    tr.fit(until=10)
    tr.close()
    holder = lock_holder(Path(cfg.run_dir))
    try:
        with pytest.raises(RunDirInUseError, match="in use by another run"):
            tr.fit()
    finally:
        holder.communicate("")
    tr.fit()
    assert tr.step == 20 and "in use by another run" in try_lock(Path(cfg.run_dir))
    tr.close()  # every call that writes there takes it again, or is refused
    holder = lock_holder(Path(cfg.run_dir))
    try:
        batch = next(iter(tr.task.train_iter))
        for call in (tr.checkpoint, tr.compact, tr.prune, lambda: tr.train_step(batch)):
            with pytest.raises(RunDirInUseError):
                call()
    finally:
        holder.communicate("")
    tr.checkpoint()
    tr.close()  # the folder moved away meanwhile: a write makes it again, locked
    shutil.move(cfg.run_dir, tmp_path / "aside")
    tr.checkpoint()
    assert "in use by another run" in try_lock(Path(cfg.run_dir))


def test_a_refused_trainer_gives_the_run_dir_back_at_once(tmp_path):
    """The lock a refused trainer took lived in its exception's frames: kept by a
    notebook's last error or a retry loop, it refused every other process."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=10)
    with pytest.raises(CheckpointError, match="already holds checkpoints") as refused:
        Trainer(cfg, ToyTask(), *_toy_model())  # a new run into it: refused after the lock
    assert refused.value is not None and try_lock(Path(cfg.run_dir)) == "held"
    other = dataclasses.replace(cfg, seed=cfg.seed + 1)  # refused once the run's lock is held
    with pytest.raises(CheckpointError, match="seed") as refused:
        Trainer(other, ToyTask(), *_toy_model(), resume=True)
    assert refused.value is not None and try_lock(Path(cfg.run_dir)) == "held"


def test_a_file_system_that_cannot_lock_warns_once_and_trains(tmp_path, monkeypatch):
    import errno
    import warnings

    import comera.train.run_lock as run_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(run_lock.fcntl, "flock", no_locks)
    cfg = _cfg(tmp_path, steps=4, checkpoint_every=2)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        tr = Trainer(cfg, ToyTask(), *_toy_model())
        tr.fit()
        Trainer(cfg, ToyTask(), *_toy_model(), resume=True)
    lines = [str(w.message) for w in said if "cannot lock" in str(w.message)]
    assert tr.step == 4 and len(lines) == 1 and "No locks available" in lines[0]


def test_a_new_trainer_in_a_run_dir_in_use_is_told_so_first(tmp_path):
    """A new trainer given the folder of a run another process trains (before its first
    checkpoint) was told to delete that run's metrics.jsonl to start over there."""
    cfg = _cfg(tmp_path, steps=20, checkpoint_every=10)
    Trainer(cfg, ToyTask(), *_toy_model()).fit(until=0)  # config.json, the lock file
    (Path(cfg.run_dir) / "metrics.jsonl").write_text(json.dumps({"step": 1}) + "\n")
    holder = lock_holder(Path(cfg.run_dir))
    try:
        with pytest.raises(RunDirInUseError, match=r"or give another run_dir \(--run-dir\)"):
            Trainer(cfg, ToyTask(), *_toy_model())
    finally:
        holder.communicate("")
    with pytest.raises(CheckpointError, match="holds metrics.jsonl of a run"):
        Trainer(cfg, ToyTask(), *_toy_model())
