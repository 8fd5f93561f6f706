"""The position of an epoch-based batch iterator: a few integers, valid at any world size."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import numpy as np

from comera.errors import CheckpointError, ConfigError, DataError

__all__ = ["EpochCursor", "check_global_batch", "full_digest", "sample_digest"]


def check_global_batch(batch_size: int, world: int) -> None:
    """Refuse a global ``batch_size`` the ``world`` processes do not divide (or below 1):
    each rank takes ``batch_size / world`` rows, so a resume on another number of
    processes trains the same batch."""
    if batch_size < 1 or batch_size % world:
        raise ConfigError(
            f"batch_size={batch_size} (global) must be a positive multiple of "
            f"world_size={world}; round it to a multiple (--set batch_size=...), or run on "
            "a number of processes that divides it (a resume keeps its batch_size)"
        )


def sample_digest(header: object, columns: Sequence[np.ndarray]) -> str:
    """A digest of a dataset's content for :attr:`EpochCursor.data_id`: ``header`` (sizes,
    vocabularies: anything JSON-able) and 4,096 evenly spaced rows of each column (all
    of them when fewer). It names the examples, not where they lie: a moved or copied
    file resumes, a changed one is refused."""
    n = len(columns[0])
    rows = np.unique(np.linspace(0, n - 1, num=min(n, 4096)).astype(np.int64))
    h = hashlib.blake2b(digest_size=8)
    h.update(json.dumps(header).encode())
    for column in columns:
        h.update(np.ascontiguousarray(column[rows]).tobytes())
    return h.hexdigest()


def full_digest(header: object, columns: Sequence[np.ndarray], chunk: int = 1 << 20) -> str:
    """A digest of every row of each column (``header`` as in :func:`sample_digest`),
    hashed ``chunk`` rows at a time so a memory-mapped table is never copied whole. 32 hex
    digits: never equal to a sampled digest's 16."""
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(header).encode())
    for column in columns:
        for start in range(0, len(column), chunk):
            h.update(np.ascontiguousarray(column[start : start + chunk]))
    return h.hexdigest()


class EpochCursor:
    """Mixin for iterators that walk ``n`` examples in global batches of ``batch_size``,
    epoch after epoch, with an order fixed by ``(seed, epoch)``.

    The subclass sets ``n``, ``seed``, ``batch_size``, ``steps_per_epoch``, ``epoch`` and
    ``batch_in_epoch`` and calls :meth:`_advance` after each batch. Every rank holds the
    same global position, so a checkpoint from any world size resumes at any other."""

    n: int
    seed: int
    batch_size: int
    steps_per_epoch: int
    epoch: int
    batch_in_epoch: int
    rescalable = True  # the position is global: every rank saved the same one
    data_id: str | None = None  # a digest of the examples, checked on resume where set
    # older digests of the same examples (a digest scheme since replaced): a checkpoint
    # that holds one of them resumes as if it held ``data_id``
    legacy_data_ids: tuple[str, ...] = ()
    # the way on after a refusal of changed data: what to give to resume on the right data
    data_hint = "resume with the same data, or start a new run"

    def _advance(self) -> None:
        self.batch_in_epoch += 1
        if self.batch_in_epoch == self.steps_per_epoch:
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, int | str]:
        """Position of the next batch: JSON-able, independent of rank and world size."""
        out: dict[str, int | str] = {
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "seed": self.seed,
            "n": self.n,
            "batch_size": self.batch_size,
        }
        if self.data_id is not None:
            out["data_id"] = self.data_id
        return out

    def check_data(self, state: dict | list[dict]) -> None:
        """Refuse a saved position (this iterator's, or every saved rank's) taken over
        other data than this iterator reads; changes nothing. The trainer asks before it
        compares the model's shapes: DLRM's table sizes come from its data, and a changed
        file was refused as "other model settings", which the user had not changed."""
        name = type(self).__name__
        if isinstance(state, list):
            if not state or any(s != state[0] for s in state):
                raise DataError(f"{name}: the saved ranks disagree on the position")
            state = state[0]
        _check_form(name, state)
        saved_id = state.get("data_id")
        if (
            saved_id is not None
            and self.data_id is not None
            and saved_id not in (self.data_id, *self.legacy_data_ids)
        ):
            changed = (
                f" (it had {state['n']} examples, this has {self.n})"
                if ("n" in state and state["n"] != self.n)
                else ""
            )
            raise DataError(
                f"the checkpoint was trained on other data (digest {saved_id}) than "
                f"this run reads ({self.data_id}){changed}: the file, or the settings that "
                f"split it or number its ids, changed since; {self.data_hint}"
            )

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Resume so the next batch is the one an uninterrupted run would yield next.

        Takes this iterator's state, or every saved rank's (any old world size): they hold
        one global position, which is checked."""
        name = type(self).__name__
        # the data first: lines added or removed also change n, and the data is the cause
        self.check_data(state)
        if isinstance(state, list):
            state = state[0]
        for key, mine in (("n", self.n), ("seed", self.seed), ("batch_size", self.batch_size)):
            if key in state and state[key] != mine:
                raise DataError(
                    f"{name} state has {key}={state[key]} but this iterator has {key}={mine}; "
                    "resume with the same data and settings"
                )
        epoch, step = state["epoch"], state["batch_in_epoch"]
        if epoch < 0 or not 0 <= step < self.steps_per_epoch:
            raise DataError(
                f"{name} state epoch={epoch}, batch_in_epoch={step} is out of range "
                f"(steps_per_epoch={self.steps_per_epoch})"
            )
        self.epoch, self.batch_in_epoch = epoch, step


def _check_form(name: str, state: object) -> None:
    """Refuse a saved position that is not :meth:`EpochCursor.state_dict`'s form (a
    damaged or hand-edited file) as a damaged checkpoint: a dict of integer counters and
    an optional string ``data_id``. Without this, a missing key or a string counter failed
    deep in the resume with a traceback."""
    ints = ("epoch", "batch_in_epoch", "n", "seed", "batch_size")
    if not isinstance(state, dict):
        raise CheckpointError(
            f"{name}: the saved position is a {type(state).__name__}, not a dict; it is damaged"
        )
    missing = [k for k in ("epoch", "batch_in_epoch") if k not in state]
    bad = [
        k
        for k in ints
        if k in state and (not isinstance(state[k], int) or isinstance(state[k], bool))
    ]
    if missing or bad or not isinstance(state.get("data_id", ""), str):
        what = (
            f"lacks {', '.join(missing)}"
            if missing
            else f"has a non-integer {', '.join(bad)}"
            if bad
            else "has a non-string data_id"
        )
        raise CheckpointError(f"{name}: the saved position {what}; it is damaged")
