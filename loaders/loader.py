"""The rank's loader: an iterator of batches with ``state_dict``/``load_state_dict``.

With ``num_workers=0`` the single reader runs in-process. With ``num_workers > 0`` a
``torch.utils.data.DataLoader`` runs one reader per worker; every batch carries its
reader's state, and this wrapper keeps the latest state per worker as batches are handed
to the caller, so the rank's state is exact whatever the workers have prefetched. Batches
are re-ordered to continue the workers' round-robin where the saved run stopped.
"""

from __future__ import annotations

import copy
import multiprocessing as mp
import os
import weakref
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from loaders import errors as loader_errors
from loaders.checkpoint import (
    STATE_FORMAT,
    STATE_VERSION,
    Resume,
    check_state,
    fingerprint_conflict,
    load_states,
    merge_states,
    save_state,
    state_conflict,
    state_path,
)
from loaders.config import LoaderConfig, is_int
from loaders.errors import EmptyStream, LoaderInputError, MixingShortfall, ReadersWithoutDocuments
from loaders.mixing import Mixer, owners, reader_targets
from loaders.pipeline import Layout, ReaderPipeline, holds_long, open_source
from loaders.shards import owned_shards

_STATE_KEY = "_reader_state"
_ERROR_KEY = "_reader_error"  # a worker's LoaderInputError: (class name, message)
# which loader of this process last loaded from or saved to each checkpoint folder: a
# state file there that another one cannot have written (a validation loader's, saved
# into the training loader's folder) is kept and the save refused; a folder no live
# loader holds (an earlier run's) is saved over
_HOLDERS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """Rank and world size: explicit arguments, else the process group, else env vars."""
    for name, value in (("rank", rank), ("world_size", world_size)):
        if value is not None and not is_int(value):
            raise LoaderInputError(f"{name} must be an integer, got {value!r}")
    if rank is None or world_size is None:
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            r, w = dist.get_rank(), dist.get_world_size()
        else:
            r, w = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
        rank = r if rank is None else rank
        world_size = w if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise LoaderInputError(f"rank {rank} is outside world_size {world_size}")
    return int(rank), int(world_size)


def _env_int(name: str, default: int) -> int:
    """The integer in environment variable ``name`` (``default`` when unset)."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError:
        raise LoaderInputError(
            f"environment variable {name}={text!r} is not an integer; fix it (torchrun sets "
            "it) or pass rank= and world_size= to TokenLoader"
        ) from None


def _identity(batch: Any) -> Any:
    return batch


class _ReaderDataset(IterableDataset):
    """What each DataLoader worker runs: its reader, with the state attached per batch."""

    def __init__(self, config: LoaderConfig, layout: Layout, resume: dict) -> None:
        self.config, self.layout, self.resume = config, layout, resume

    def __iter__(self) -> Iterator[dict]:
        try:
            yield from self._batches()
        except LoaderInputError as exc:
            # sent as a batch: torch would wrap it in a worker traceback of many lines,
            # where bad input is one line (re-raised by _parallel_batches)
            yield {_ERROR_KEY: (type(exc).__name__, str(exc))}

    def _batches(self) -> Iterator[dict]:
        info = get_worker_info()
        w = info.id if info is not None else 0
        lay = Layout(self.layout.rank, self.layout.world_size, w, self.layout.num_workers)
        sources = {d.name: open_source(d, self.config.cache_dir) for d in self.config.datasets}
        pipe = ReaderPipeline(
            self.config,
            sources,
            lay,
            cursors=self.resume["cursors"],
            weights=self.resume["weights"],
            worker_state=self.resume["readers"][w],
            targets=self.resume["targets"][w],
        )
        while True:
            try:
                batch = pipe.next_batch()
            except StopIteration:
                yield {_STATE_KEY: pipe.state(), "_end": True}
                return
            batch[_STATE_KEY] = pipe.state()
            yield batch


def _recount_offsets(state: dict, bos: bool) -> None:
    """Shift the offsets of partly emitted documents in ``state`` (in place) from the BOS
    setting it was saved with to ``bos``: an offset counts tokens of ``[BOS] tokens [EOS]``,
    so without the shift a resume that turns BOS on would repeat a token of every such
    document, and one that turns it off would drop one. States saved before this was
    recorded are taken to share the config's setting."""
    stream = state.get("stream") if isinstance(state, dict) else None
    if not isinstance(stream, dict) or (stream.get("bos_id") is not None) == bos:
        return
    shift = 1 if bos else -1
    for reader in state.get("readers") or []:
        for shard in (reader or {}).get("shards", {}).values():
            shard["offset"] = [max(o + shift, 0) if o > 0 else 0 for o in shard["offset"]]


class TokenLoader:
    """Stateful, rescalable, mixed, packed token loader for one rank.

    ``for batch in loader`` yields ``{"input_ids": (B, T), "segment_ids": (B, T)}``.
    ``state_dict()`` is a small JSON-able dict; ``save(dir)``/``load(dir)`` write/read one
    file per rank and load at any world size or worker count.
    """

    rescalable = True  # load_state_dict takes every old rank's state, at any world size

    def __init__(
        self,
        config: LoaderConfig,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        multiprocessing_context: Any = None,
    ) -> None:
        if not isinstance(config, LoaderConfig):
            raise LoaderInputError(f"TokenLoader takes a LoaderConfig, got {type(config).__name__}")
        config.check()  # fields set since it was built are checked too
        self.config = config
        self.rank, self.world_size = resolve_rank_world(rank, world_size)
        if not is_int(num_workers) or num_workers < 0:
            raise LoaderInputError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.num_workers = int(num_workers)
        _check_worker_args(self.num_workers, prefetch_factor, pin_memory, multiprocessing_context)
        self._readers = max(1, num_workers)
        self._dl_kwargs = {
            "prefetch_factor": prefetch_factor,
            "pin_memory": bool(pin_memory),
            "multiprocessing_context": multiprocessing_context,
        }
        self.sources = {d.name: open_source(d, config.cache_dir) for d in config.datasets}
        for d in config.datasets:
            if int(self.sources[d.name].num_docs) == 0:
                raise LoaderInputError(
                    f"sub-dataset {d.name!r} ({d.path}) holds no documents; give it a folder "
                    "of non-empty token files or drop it from LoaderConfig.datasets"
                )
        self.fingerprint = {
            "num_shards": config.num_shards,
            "seed": config.seed,
            "shuffle": config.shuffle,
            "docs": {name: int(src.num_docs) for name, src in self.sources.items()},
            # what each folder holds, where loaders.prepare recorded it (see content_digest)
            "content": {name: getattr(src, "content", None) for name, src in self.sources.items()},
        }
        self._config_weights = config.weights
        self._has_long: dict[str, bool] = {}  # see _holds_long
        self._weights = dict(self._config_weights)
        self._cursors: dict[str, dict[int, tuple[int, int, int]]] = {}
        # where each reader is, shared with the worker stream (:func:`_parallel_batches`),
        # which must not hold the loader itself (see there)
        self._pos = _Position([None] * self._readers)
        self._pipes: list[ReaderPipeline] = []
        self._iter: Iterator[dict] | None = None
        self._targets: list[dict[str, float] | None] = []  # per reader; see _check_readers
        self._saves = 0  # save() calls, resumed ones included: see check_one_save
        self._queued: Future[Path] | None = None  # the last background save
        self._start_pipes()  # validates ownership now and gives state_dict() a value

    # -- iteration ---------------------------------------------------------------------
    def _check_readers(
        self, weights: dict[str, float] | None = None
    ) -> list[dict[str, float] | None]:
        """Refuse weights and a layout the stream cannot serve, and return the mixing
        targets of this rank's readers (``None``: the weights themselves; see
        :func:`loaders.mixing.reader_targets`).

        Some weighted sub-dataset must hold a document of ``min_doc_len`` tokens, or no
        batch would come. An endless stream must give every reader of the layout a
        document: a reader with none would end at once, and its rank with it while the
        others go on (a data parallel job then hangs). And the readers owning a small
        sub-dataset's documents must be able to serve its share for those that own none.
        Checked for every rank's readers, so every rank raises. Outside ``local`` mode a
        reader's shards hold the same positions every epoch; in it, blocks move and every
        reader meets every sub-dataset in time."""
        cfg = self.config
        weights = self._weights if weights is None else weights
        # a sub-dataset with no document of min_doc_len tokens is dropped by every reader
        docs = {n: int(src.num_docs) for n, src in self.sources.items()
                if weights.get(n, 0) > 0 and self._holds_long(n)}  # fmt: skip
        if not docs:  # in every mode: a finite stream would yield no batch either
            raise EmptyStream(
                f"no sub-dataset with a positive weight holds a document of min_doc_len="
                f"{cfg.min_doc_len} tokens, so the stream would yield no batch; lower "
                "LoaderConfig.min_doc_len or give weight to a sub-dataset with longer documents"
            )
        none: list[dict[str, float] | None] = [None] * self._readers
        if cfg.num_epochs is not None or cfg.shuffle == "local":
            return none
        total, L = self.world_size * self._readers, cfg.num_shards
        owned_shards(L, 0, self.world_size, 0, self._readers)  # more readers than shards
        empty = np.flatnonzero(~owners(docs, L, total).any(axis=1))
        if empty.size:
            g = int(empty[0])
            fact = (
                f"reader {g} of {total} ({self.world_size} ranks x {self._readers} "
                f"workers) would get no document of {docs} (documents of the sub-datasets "
                f"with a positive weight and a document of min_doc_len={cfg.min_doc_len} "
                f"tokens, cut into num_shards={L}), and an endless stream "
                "(num_epochs=None) would end at once there"
            )
            raise ReadersWithoutDocuments(
                f"{fact}; use fewer ranks or workers, more documents, or shuffle='local'"
                + ("" if self.world_size > 1 else ", or set num_epochs"),
                # finite streams end at different steps on different ranks: with several,
                # one rank would end at once, the hang this check is there to prevent
                fact=fact,
            )
        first = self.rank * self._readers
        try:
            targets = reader_targets(weights, docs, L, total, range(first, first + self._readers))
        except MixingShortfall as e:
            where = f"{self.world_size} ranks x {self._readers} workers"
            raise MixingShortfall(f"{where}: {e}", fact=f"{where}: {e.fact}") from None
        if targets is None:
            return none
        # sub-datasets dropped for want of long documents are left out of the solve above
        return [{n: t.get(n, 0.0) for n in self.sources} for t in targets]

    def _holds_long(self, name: str) -> bool:
        """Whether sub-dataset ``name`` holds a document of ``min_doc_len`` tokens (scanned
        once, up to the first such document; cached)."""
        if name not in self._has_long:
            self._has_long[name] = holds_long(self.sources[name], self.config.min_doc_len)
        return self._has_long[name]

    def _start_pipes(self, targets: list[dict[str, float] | None] | None = None) -> None:
        """Build every reader on this process (cheap: no data is read) for state/iteration;
        ``targets``: what :meth:`_check_readers` returned for the weights now in force, if
        a caller already checked them."""
        self._targets = self._check_readers() if targets is None else targets
        self._pipes = [
            ReaderPipeline(
                self.config,
                self.sources,
                Layout(self.rank, self.world_size, w, self._readers),
                cursors=self._cursors,
                weights=self._weights,
                worker_state=self._pos.readers[w],
                targets=self._targets[w],
            )
            for w in range(self._readers)
        ]
        self._pos.readers = [p.state() for p in self._pipes]

    def __iter__(self) -> TokenLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iter is None:
            if self.num_workers == 0:
                self._iter = _serial_batches(self._pipes[0])
            else:
                resume = {"cursors": self._cursors, "weights": self._weights,
                          "readers": self._pos.readers, "targets": self._targets}  # fmt: skip
                layout = Layout(self.rank, self.world_size, 0, self._readers)
                ds = _ReaderDataset(self.config, layout, resume)
                self._iter = _parallel_batches(ds, self._readers, self._dl_kwargs, self._pos)
        return next(self._iter)

    def close(self) -> None:
        """Stop the worker processes (``num_workers > 0``) now; a later ``next`` starts
        new ones from the position reached. Dropping the loader does the same."""
        self._close()

    def __enter__(self) -> TokenLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._close()

    @property
    def readers(self) -> list[ReaderPipeline]:
        """In-process readers (with ``num_workers > 0`` they only mirror the state)."""
        return self._pipes

    # -- state -------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """This rank's position: one small JSON-able dict covering all its readers (a copy:
        editing it never moves the loader)."""
        if self.num_workers == 0:
            self._pos.readers[0] = self._pipes[0].state()
        return copy.deepcopy(
            {
                "format": STATE_FORMAT,
                "version": STATE_VERSION,
                "fingerprint": self.fingerprint,
                "rank": self.rank,
                "world_size": self.world_size,
                "num_workers": self._readers,
                "next_worker": self._pos.next_worker,
                "config_weights": self._config_weights,
                "weights": self._weights,
                # what a shard's offset counts: a resume with BOS turned on or off shifts it
                "stream": {"bos_id": self.config.bos_id, "eos_id": self.config.eos_id},
                "readers": self._pos.readers,
            }
        )

    def load_state_dict(self, state: dict | list[dict]) -> None:
        """Restore from this rank's state, or from all ranks' states of any old layout.
        The states given are not modified."""
        if not isinstance(state, (dict, list, tuple)):
            raise LoaderInputError(
                f"a loader state is a dict (or a list of every rank's), got "
                f"{type(state).__name__}; pass TokenLoader.state_dict()'s result"
            )
        states = copy.deepcopy([state] if isinstance(state, dict) else list(state))
        for st in states:  # before any of it is read
            check_state(st)
        for st in states:
            _recount_offsets(st, self.config.bos_id is not None)
        own = (
            len(states) == 1
            and states[0].get("rank") == self.rank
            and states[0].get("world_size") == self.world_size
            and states[0].get("num_workers") == self._readers
        )  # a rank's own state at an unchanged layout needs no other rank's file
        resume: Resume = merge_states(states, self.fingerprint, complete=not own)
        if resume.config_weights == self._config_weights and resume.weights:
            weights = {**self._config_weights, **resume.weights}
        else:
            weights = dict(self._config_weights)  # the config changed: its weights win
        same = resume.world_size == self.world_size and resume.num_workers == self._readers
        try:
            targets = self._check_readers(weights)  # refused before anything changes
        except MixingShortfall as e:
            if weights == self._config_weights:
                raise
            # the weights in force are the saved state's (a set_weights before the save),
            # which the config does not show
            saved = f" (the weights {weights} are the saved state's, set by set_weights "
            raise MixingShortfall(
                f"{e}{saved}before the save; change LoaderConfig.weights to override them on "
                "resume)",
                fact=f"{e.fact}{saved}before the save)",
            ) from None
        self._close()
        self._cursors = resume.cursors
        self._weights = weights
        if same:
            self._pos.readers = [resume.readers[(self.rank, w)] for w in range(self._readers)]
            self._pos.next_worker = resume.next_worker.get(self.rank, 0)
            if weights != resume.weights:
                for s in self._pos.readers:
                    s["mix_tokens"] = {}
        else:
            self._pos.readers = [None] * self._readers
            self._pos.next_worker = 0
        for s in self._pos.readers:
            if s is not None:
                s["weights"] = dict(weights)
        self._start_pipes(targets)
        # every rank of the resumed run counts on from the save it loaded
        self._saves = max((int(st.get("save", 0)) for st in states), default=0)

    def set_weights(self, weights: dict[str, float]) -> None:
        """Change target token shares now; no sub-dataset loses its position. Weights
        that cannot work are refused before anything changes."""
        probe = Mixer(dict(self._weights))
        probe.set_weights(weights)  # validates names and values
        new = dict(probe.weights)
        targets = self._check_readers(new)
        if self.num_workers == 0:
            self._pipes[0].set_weights(weights, targets[0])
            self._targets = targets
            self._weights = new
            self._close()  # a stream that had ended goes on with what the weights revive
            return
        states = [dict(s, weights=new, mix_tokens={}) for s in self.state_dict()["readers"]]
        self._close()
        self._weights = new
        self._pos.readers = states
        self._start_pipes(targets)

    def _close(self) -> None:
        it, self._iter = self._iter, None
        if it is not None and hasattr(it, "close"):
            it.close()

    # -- files -------------------------------------------------------------------------
    def save(
        self, directory: str | Path, *, background: bool = False, step: int | None = None
    ) -> Path | Future[Path]:
        """Write this rank's state file (atomic; no communication with other ranks).

        ``step`` marks the save (loading refuses rank files of different steps); without
        it the file records this rank's count of saves instead, which every rank of one
        save round shares."""
        if step is not None and (not is_int(step) or step < 0):
            # loading would refuse the file as damaged: refuse it before anything is written
            raise LoaderInputError(
                f"TokenLoader.save: step must be an integer >= 0 (the training step), got {step!r}"
            )
        state = self.state_dict()
        self._saves = mark = self._saves + 1
        if step is not None:
            state["step"] = int(step)
        else:
            state["save"] = mark
        folder = os.path.realpath(directory)
        holder = _HOLDERS.get(folder)
        if (
            holder is not None
            and not os.path.isdir(folder)
            and (holder._queued is None or holder._queued.done())
        ):  # the folder was deleted, and no save of the holder's is waiting to remake it
            holder = None
        why = None
        if holder is not None and holder is not self:
            # the holder's own fingerprint, not its file: a background save of it may still
            # be queued, and the file then absent or older
            why = fingerprint_conflict(holder.fingerprint, state["fingerprint"]) or (
                state_conflict(state_path(directory, self.rank), state["fingerprint"])
            )
        if why:
            self._uncount(mark)
            raise LoaderInputError(
                f"{directory} holds another loader's state ({why}), which this process loaded "
                f"or saved there; it is kept: save each loader into a folder of its own (e.g. "
                f"{Path(directory) / 'NAME'}), or delete that loader and its files first"
            )
        try:
            out = save_state(state, directory, background=background,
                             on_failure=lambda: self._uncount(mark))  # fmt: skip
        except BaseException:  # before the write: the folder could not be made
            self._uncount(mark)
            raise
        _HOLDERS[folder] = self
        if background:
            self._queued = out  # type: ignore[assignment]
        return out

    def _uncount(self, mark: int) -> None:
        """A save that failed is not counted (unless a later one was made since): retried,
        it keeps this rank's count the other ranks'."""
        if self._saves == mark:
            self._saves = mark - 1

    def load(self, directory: str | Path) -> None:
        """Restore from every rank file in ``directory`` (any old world size)."""
        self.load_state_dict(load_states(directory))
        _HOLDERS[os.path.realpath(directory)] = self  # its folder: see save


def _check_worker_args(
    num_workers: int, prefetch_factor: object, pin_memory: object, context: object
) -> None:
    """Refuse the DataLoader arguments that torch would only reject at the first batch
    (or never: a ``prefetch_factor`` without workers has nothing to prefetch)."""
    if prefetch_factor is not None:
        if not num_workers:
            raise LoaderInputError(
                f"prefetch_factor={prefetch_factor!r} applies to worker processes only; "
                "give num_workers >= 1 or leave prefetch_factor unset"
            )
        if not is_int(prefetch_factor) or prefetch_factor < 1:
            raise LoaderInputError(
                f"prefetch_factor must be an integer >= 1 (batches loaded ahead per worker), "
                f"got {prefetch_factor!r}"
            )
    if not (
        isinstance(pin_memory, bool | np.bool_) or (is_int(pin_memory) and pin_memory in (0, 1))
    ):
        raise LoaderInputError(f"pin_memory must be True or False, got {pin_memory!r}")
    methods = mp.get_all_start_methods()
    if not (
        context is None
        or isinstance(context, mp.context.BaseContext)
        or (isinstance(context, str) and context in methods)
    ):
        raise LoaderInputError(
            f"multiprocessing_context={context!r} is not a start method here; use one of "
            f"{methods} (or a multiprocessing context object)"
        )


@dataclass(slots=True)
class _Position:
    """A loader's reader states and the worker whose batch comes next."""

    readers: list[dict | None]
    next_worker: int = 0


def _serial_batches(pipe: ReaderPipeline) -> Iterator[dict]:
    while True:
        try:
            yield pipe.next_batch()
        except StopIteration:
            return


def _parallel_batches(
    ds: _ReaderDataset, n: int, dl_kwargs: dict, pos: _Position
) -> Iterator[dict]:
    """The workers' batches in the readers' round-robin order, recording each batch's
    reader state in ``pos``. It holds ``pos``, not the loader: a generator that held its
    loader made a reference cycle, so a dropped loader (and its DataLoader) waited for the
    cycle collector, its worker processes ran on until then, and that collection stalled
    about 5 s per worker in DataLoader's shutdown."""
    dl = DataLoader(ds, batch_size=None, num_workers=n, collate_fn=_identity, **dl_kwargs)
    pending: list[deque] = [deque() for _ in range(n)]
    alive = [True] * n
    expected = pos.next_worker

    def advance(e: int) -> int:
        for k in range(1, n + 1):
            c = (e + k) % n
            if alive[c] or pending[c]:
                return c
        return e

    for item in dl:
        if _ERROR_KEY in item:
            name, message = item[_ERROR_KEY]
            raise getattr(loader_errors, name, LoaderInputError)(message)
        state = item.pop(_STATE_KEY)
        w = int(state["worker"])
        if item.pop("_end", False):
            alive[w] = False
            pending[w].append((None, state))
        else:
            pending[w].append((item, state))
        while pending[expected] or not alive[expected]:
            if not pending[expected]:
                if not any(alive) and not any(pending):
                    return
                expected = advance(expected)
                continue
            batch, st = pending[expected].popleft()
            pos.readers[expected] = st
            expected = advance(expected)
            pos.next_worker = expected
            if batch is not None:
                yield batch
