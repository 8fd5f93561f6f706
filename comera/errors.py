"""What bad input raises: :class:`UserError` and its kinds, apart from the library's bugs.

A :class:`UserError` means the input is wrong, not the code: its message names the problem,
the value and the field or flag to change. Commands (``python -m experiments.<name>`` ...)
print it as one line and exit with status 2; any other exception, a plain ``ValueError``
from inside the library included, is a bug and keeps its traceback.

* :class:`ConfigError`: a config field, preset, plan or flag value that cannot work;
* :class:`DataError`: a data file, column, label, tokenizer or corpus folder that cannot be
  used (:class:`IdOutOfRangeError` for an id outside its table, also an ``IndexError``);
  :class:`MissingFileError` when a given path does not exist;
* :class:`CheckpointError`: a checkpoint that is missing, corrupt, incomplete or from an
  incompatible run;
* :class:`RunDirInUseError`: a run dir another process trains into
  (:mod:`comera.train.run_lock`).

``ConfigError`` and ``DataError`` are also ``ValueError`` (``MissingFileError`` also
``FileNotFoundError``; ``CheckpointError`` also ``RuntimeError``, as before; so is
``RunDirInUseError``), so callers' existing ``except`` clauses keep working.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

__all__ = [
    "CheckpointError",
    "ConfigError",
    "DataError",
    "IdOutOfRangeError",
    "MissingFileError",
    "RunDirInUseError",
    "UserError",
    "first_line",
    "quiet_logger",
]


@contextlib.contextmanager
def quiet_logger(name: str) -> Iterator[None]:
    """Logger ``name`` (and its children) at ERROR for the block, at its level after, so a
    command's output and its one-line errors are not preceded by a library's warnings: a
    hub client's retries (the failure is said once by the caller), bitsandbytes' optional
    kernels (which nothing here uses)."""
    log = logging.getLogger(name)
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def first_line(exc: BaseException) -> str:
    """An exception's first line, to quote in a one-line error (a library's message, a
    hub client's above all, can run to several)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class UserError(Exception):
    """Bad input: the message names the problem and the field or flag to change."""


class ConfigError(UserError, ValueError):
    """A config field, preset, plan or flag value that cannot work."""


class DataError(UserError, ValueError):
    """A data file, column, label, tokenizer or corpus that cannot be used as given."""


class IdOutOfRangeError(DataError, IndexError):
    """A token or category id outside its table's vocabulary (an ``IndexError`` too, as
    indexing a dense table raises)."""


class MissingFileError(DataError, FileNotFoundError):
    """A user-given path (data file, tokenizer, run dir) that does not exist."""


class CheckpointError(UserError, RuntimeError):
    """A checkpoint is missing, corrupt, incomplete or from an incompatible run."""


class RunDirInUseError(UserError, RuntimeError):
    """Another process holds the run dir's lock: it is training into that folder."""
