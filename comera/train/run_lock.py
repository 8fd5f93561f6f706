"""One process (one run) per run dir, enforced with an advisory lock.

Two processes training into one run dir (a requeued job started while the old one still
runs, a second command given the same ``--resume``) interleave ``metrics.jsonl`` and can
delete each other's half-written checkpoints as debris. The trainer therefore holds an
exclusive ``flock`` on ``<run_dir>/.lock`` for as long as it lives (or until its
``close()``; any later call of it that writes there takes it again), taken before it writes
anything there (before a resume truncates the metrics past its checkpoint); the commands
take it earlier still, before they touch the run's records. A second process is refused
with a :class:`RunDirInUseError` naming the holder (pid, host, start time).

- The lock is the kernel's: it ends with the process, however the process ends (SIGKILL
  included), so a stale lock file is never in the way.
- Forked children (DataLoader workers) close their copy of the lock's descriptor at once
  (:func:`os.register_at_fork`): the lock ends with the process that took it, not with
  its last worker; executed children never get it (close-on-exec).
- In one process the lock is counted, not taken twice (a ``flock`` on a second descriptor
  would refuse its own process): ``fit(until=k)`` then ``fit()``, or a second trainer
  resuming the run in the same process, keep it; it ends with the last holder.
- In a distributed run rank 0 takes it and every rank gets its outcome (another job's
  ranks are refused together).
- Where the lock cannot be taken for another reason (a file system that cannot lock,
  ``ENOLCK`` or ``EOPNOTSUPP`` on some network and FUSE mounts; a folder this process may
  not write), a warning says nothing keeps a second process out, and the run goes on (to
  fail where it writes, as it would have).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import socket
import sys
import time
import warnings
from pathlib import Path

from comera.errors import RunDirInUseError
from comera.train.distributed import rank_first

try:  # POSIX; elsewhere (Windows) runs go unguarded, with a warning
    import fcntl
except ImportError:  # pragma: no cover - no such platform in CI
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_FILE", "RunDirInUseError", "RunDirLock", "hold_run_dir"]

LOCK_FILE = ".lock"

# the locks this process holds: the run dir's (device, inode) -> [descriptor, holders] (a
# folder renamed or reached by another path is the same folder); and every descriptor
# still open, by number (a deleted folder's lock too, whose holders live on)
_HELD: dict[tuple[int, int], list[int]] = {}
_OPEN: dict[int, list[int]] = {}


def _forget_in_child() -> None:
    """In a forked child: close the inherited descriptors (the parent's lock stays the
    parent's; closing a copy does not release a ``flock``) and hold nothing."""
    for fd, entry in _OPEN.items():
        with contextlib.suppress(OSError):
            os.close(fd)
        entry[1] = 0  # the shares this child inherited hold nothing
    _OPEN.clear()
    _HELD.clear()


if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=_forget_in_child)

# run dirs this process warned it could not lock: said once each, not at every call
_WARNED: set[str] = set()


def _holder(path: Path) -> str:
    """Who holds the lock, as its file says (written once it was taken)."""
    try:
        info = json.loads(path.read_text())
        return f"pid {info['pid']} on {info['host']}, since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which"


class RunDirLock:
    """One holder's share of a run dir's lock; :meth:`release` (or garbage collection)
    gives it back, and the lock ends with its last holder in this process."""

    def __init__(self, key: tuple[int, int] | None, entry: list[int] | None) -> None:
        # None: nothing held (another rank's share, or a file system that cannot lock)
        self._key, self._entry = key, entry

    @property
    def held(self) -> bool:
        """Whether this share is still held."""
        return self._entry is not None

    def release(self) -> None:
        """Give this share back (once; later calls do nothing)."""
        entry, self._entry = self._entry, None
        if entry is None or entry[1] == 0:  # released, or a forked child's copy (closed)
            return
        entry[1] -= 1
        if entry[1] == 0:
            if _HELD.get(self._key) is entry:  # type: ignore[arg-type]
                del _HELD[self._key]  # type: ignore[arg-type]
            _OPEN.pop(entry[0], None)
            with contextlib.suppress(OSError):
                os.close(entry[0])  # the only descriptor: the lock ends

    def __del__(self) -> None:
        try:  # at interpreter exit the module's globals may be gone: the kernel ends it
            self.release()
        except Exception:  # noqa: BLE001, S110
            pass


def _same_file(fd: int, path: Path) -> bool:
    """Whether ``fd`` is still ``path`` (a run dir deleted and made again is another)."""
    try:
        a, b = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _take(run_dir: Path, flag: str, existing: bool) -> RunDirLock:
    path = run_dir / LOCK_FILE
    if not run_dir.is_dir() or (existing and not path.is_file()):
        return RunDirLock(None, None)  # decided here, on rank 0: the others follow it
    key: tuple[int, int] | None = None
    fd = -1
    try:
        st = os.stat(run_dir)
        key = (st.st_dev, st.st_ino)
        entry = _HELD.get(key)
        if entry is not None and _same_file(entry[0], path):
            entry[1] += 1
            return RunDirLock(key, entry)
        # a lock of a folder since deleted (its inode reused): its holders keep their share
        _HELD.pop(key, None)
        if fcntl is None:
            raise OSError(errno.ENOSYS, "no flock on this platform")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)  # close-on-exec (PEP 446)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        if fd >= 0 and e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            other = f", or give another {flag}" if flag else ""
            raise RunDirInUseError(
                f"{run_dir} is in use by another run ({_holder(path)}): one process trains "
                f"into a run dir at a time; wait for it to end (or stop it){other}"
            ) from None
        if os.path.realpath(path) not in _WARNED:
            _WARNED.add(os.path.realpath(path))
            warnings.warn(
                f"{run_dir}: cannot lock {path} ({e.strerror}); nothing keeps a second "
                "process from training into this run dir at the same time",
                stacklevel=5,  # hold_run_dir's caller (through rank_first)
            )
        return RunDirLock(None, None)
    since = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    info = {"pid": os.getpid(), "host": socket.gethostname(), "since": since,
            "argv": sys.argv}  # fmt: skip
    with contextlib.suppress(OSError):  # who holds it, for the next process's message
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    entry = _HELD[key] = _OPEN[fd] = [fd, 1]  # type: ignore[index]
    return RunDirLock(key, entry)


def hold_run_dir(
    run_dir: str | Path, rank: int = 0, world: int = 1, *, flag: str = "", existing: bool = False
) -> RunDirLock:
    """Take (or share) the lock of the folder ``run_dir`` for this process, or raise
    :class:`RunDirInUseError` naming its holder (and ``flag``, the field or command flag a
    new run would change to go elsewhere; "" for a resume, which has no other folder). A
    folder that does not exist holds nothing (lock it once made); with ``existing``, nor
    does one without a lock file (no run's folder: nothing is created in it). Rank 0 of a
    distributed run decides and takes it; the others raise its error or hold nothing
    (every rank must call this at the same point: it is a collective)."""
    run_dir = Path(run_dir)
    return rank_first(
        lambda: _take(run_dir, flag, existing) if rank == 0 else RunDirLock(None, None),
        rank,
        world,
    )
