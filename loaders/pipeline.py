"""One reader's pipeline: shard cursors -> mixing -> packing -> batches, with its state.

A reader is one (rank, dataloader worker). It owns a contiguous range of logical shards of
every sub-dataset. For each document it asks the mixer which sub-dataset is behind its
target, takes the next owned shard of it round-robin, reads the document under that
shard's cursor and packs its stream into the batch. The reader's whole position is the
shard cursors plus a few integers (mixing counters, round-robin pointers, which shard is
mid-document); ``state()`` returns them as a JSON-able dict.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from loaders.config import DatasetSpec, LoaderConfig
from loaders.errors import LoaderInputError
from loaders.mixing import Mixer
from loaders.packing import BatchBuffer, stream_len
from loaders.shards import ShardCursors, owned_shards
from loaders.sources import TokenFolder
from loaders.text import TextSource


def open_source(spec: DatasetSpec, cache_dir: Any = None) -> Any:
    """The source object of a sub-dataset spec (token folder, or text + tokenizer)."""
    if spec.tokenizer is not None:
        return TextSource(spec.path, text_column=spec.text_column, tokenizer=spec.tokenizer)
    if not isinstance(spec.path, (str, type(None))) and hasattr(spec.path, "doc"):
        return spec.path  # an already built source object
    return TokenFolder(spec.path, token_column=spec.token_column, cache_dir=cache_dir)


def holds_long(src: Any, min_len: int) -> bool:
    """Whether source ``src`` holds a document of ``min_len`` tokens, scanning its
    documents in order up to the first such one."""
    return any(len(src.doc(i)) >= min_len for i in range(int(src.num_docs)))


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a reader sits: rank in world, worker among the rank's dataloader workers."""

    rank: int
    world_size: int
    worker: int = 0
    num_workers: int = 1


def _index(values: list[int], value: int, start: int) -> int | None:
    """First index ``i`` of ``value`` in ``values`` at or cyclically after ``start``."""
    try:
        return values.index(value, start)
    except ValueError:
        pass
    try:
        return values.index(value, 0, start)
    except ValueError:
        return None


class ReaderPipeline:
    """The iterator of one reader; ``next_batch()`` returns a dict of (B, T) tensors."""

    def __init__(
        self,
        config: LoaderConfig,
        sources: dict[str, Any],
        layout: Layout,
        *,
        cursors: dict[str, dict[int, tuple[int, int, int]]],
        weights: dict[str, float],
        worker_state: dict | None = None,
        targets: dict[str, float] | None = None,
    ) -> None:
        self.config, self.sources, self.layout = config, sources, layout
        L = config.num_shards
        ids = owned_shards(L, layout.rank, layout.world_size, layout.worker, layout.num_workers)
        ws = worker_state or {}
        if ws.get("shards"):  # the reader's own saved cursors win over the merged map
            cursors = {name: dict(cursors.get(name, {})) for name in sources}
            for name, sh in ws["shards"].items():
                lo, hi = sh["range"]
                for i, shard in enumerate(range(lo, hi)):
                    cursors[name][shard] = (sh["epoch"][i], sh["counter"][i], sh["offset"][i])
        self.shards = {
            name: ShardCursors(
                name=name,
                num_docs=src.num_docs,
                num_shards=L,
                seed=config.seed,
                mode=config.shuffle,
                ids=list(ids),
                cursors=cursors.get(name),
            )
            for name, src in sources.items()
        }
        self.mixer = Mixer(weights, ws.get("mix_tokens"))
        if targets is not None:  # this reader makes up for others (reader_targets)
            self.mixer.targets = dict(targets)
        self.rr = {name: int(ws.get("rr", {}).get(name, 0)) for name in sources}
        self._low: dict[str, int] = {}  # lowest shard epoch per sub-dataset (a cache)
        # whether a sub-dataset holds any document of min_doc_len tokens (found by a scan
        # of its documents when an endless stream skips for long: a cache, never state)
        self._has_long: dict[str, bool] = {}
        # not read from the saved state: whether anything is left follows from the
        # cursors and the config (num_epochs may have been raised since it was saved)
        self.done = False
        self._active = [n for n in sources if self._usable(n)]
        self._np_dtype = np.dtype(config.out_dtype)
        # per source dtype: whether out_dtype may not hold its ids (see _fitting)
        self._narrows: dict[np.dtype, bool] = {}
        self._source_index = {d.name: i for i, d in enumerate(config.datasets)}
        self._cur: tuple[str, int, np.ndarray] | None = None
        cur = ws.get("current")
        if cur is not None:
            name, shard = cur
            slot = self.shards[name].ids.index(int(shard))
            if not self._finished(self.shards[name], slot):  # num_epochs may have been lowered
                self._cur = (name, slot, self._fitting(name, slot, self._tokens(name, slot)))

    # -- state -------------------------------------------------------------------------
    def state(self) -> dict:
        """JSON-able position of this reader (no token data, size independent of corpus)."""
        cur = (
            None
            if self._cur is None
            else [self._cur[0], self.shards[self._cur[0]].ids[self._cur[1]]]
        )
        shards = {}
        for name, sc in self.shards.items():
            ids = sc.ids
            shards[name] = {
                "range": [ids[0], ids[-1] + 1] if ids else [0, 0],
                "epoch": list(sc.epoch),
                "counter": list(sc.counter),
                "offset": list(sc.offset),
            }
        return {
            "rank": self.layout.rank,
            "worker": self.layout.worker,
            "weights": dict(self.mixer.weights),
            "mix_tokens": dict(self.mixer.tokens),
            "rr": dict(self.rr),
            "current": cur,
            "done": self.done,
            "shards": shards,
        }

    def set_weights(
        self, weights: dict[str, float], targets: dict[str, float] | None = None
    ) -> None:
        """New weights, and this reader's mixing targets for them (``None``: the weights)."""
        self.mixer.set_weights(weights)
        if targets is not None:
            self.mixer.targets = dict(targets)
        self._active = [n for n in self.sources if self._usable(n)]
        self.done = False  # a sub-dataset given weight again may have documents left

    # -- document selection ------------------------------------------------------------
    def _finished(self, sc: ShardCursors, slot: int) -> bool:
        ne = self.config.num_epochs
        return ne is not None and sc.epoch[slot] >= ne

    def _usable(self, name: str) -> bool:
        """Whether this reader can still emit a document of ``name``: it owns shards that
        are not finished, and (outside ``local`` mode, where a shard's block and so its
        size change every epoch) one of them is not empty; and the sub-dataset is not
        known to hold only documents shorter than ``min_doc_len``."""
        sc = self.shards[name]
        if not sc.ids or sc.num_docs == 0 or self._has_long.get(name) is False:
            return False
        if sc.mode != "local" and all(sc.size(s) == 0 for s in range(len(sc.ids))):
            return False
        return not all(self._finished(sc, s) for s in range(len(sc.ids)))

    def _tokens(self, name: str, slot: int) -> np.ndarray:
        return self.sources[name].doc(self.shards[name].current_doc(slot))

    def _fitting(self, name: str, slot: int, toks: np.ndarray) -> np.ndarray:
        """``toks`` of a document about to be emitted, checked against ``out_dtype`` where
        the source's type is wider (one skipped as too short is never checked)."""
        narrows = self._narrows.get(toks.dtype)
        if narrows is None:
            narrows = self._narrows[toks.dtype] = not np.can_cast(toks.dtype, self._np_dtype)
        if narrows and len(toks):
            # the rows are written by numpy assignment, which wraps an id out_dtype cannot
            # hold (2**40 + 5 becomes 5 in int32) without a word
            info = np.iinfo(self._np_dtype)
            lo, hi = int(toks.min()), int(toks.max())
            if lo < info.min or hi > info.max:
                bad = hi if hi > info.max else lo
                doc = self.shards[name].current_doc(slot)
                # int64 is the widest: past it (a uint64 id) only the data can change
                wide = bad <= np.iinfo(np.int64).max
                raise LoaderInputError(
                    f"sub-dataset {name!r}: document {doc} holds token id {bad}, which "
                    f"LoaderConfig.out_dtype={self.config.out_dtype!r} cannot hold; "
                    + (
                        "set out_dtype='int64' or re-tokenize the data"
                        if wide
                        else "no output dtype holds it (int64 is the widest): re-tokenize the data"
                    )
                )
        return toks

    def _roll(self, sc: ShardCursors, slot: int) -> None:
        """Advance past a finished (or skipped) document; start the next epoch at the end."""
        sc.counter[slot] += 1
        sc.offset[slot] = 0
        if sc.counter[slot] >= sc.size(slot):
            sc.epoch[slot] += 1
            sc.counter[slot] = 0

    def _next_slot(self, name: str) -> int | None:
        """Next owned shard of ``name`` with a document to read: round-robin, epoch-aligned.

        Only shards in the lowest epoch among this reader's shards are eligible: a shard that
        finished its epoch waits until every other owned shard has finished it too. Shards
        reach the end of an epoch at different times (sizes differ by one document, local
        blocks differ in size, and after an N -> M rescale the merged shards come from old
        readers that were at different points of their ranges); without this rule the reader
        would serve next-epoch documents (a new shuffle, so repeats of documents already
        emitted) while documents of the current epoch are still pending: the epoch would not
        be exactly-once.
        """
        sc = self.shards[name]
        n = len(sc.ids)
        if n == 0:
            return None
        epoch, ne = sc.epoch, self.config.num_epochs
        low = self._low.get(name)  # epochs only grow, so a cached minimum stays a lower bound
        if low is None:
            low = self._low[name] = min(epoch)
        start = self.rr[name]
        while ne is None or low < ne:  # finished shards (epoch >= num_epochs) are never lowest
            slot = _index(epoch, low, start)
            if slot is None:  # every shard is past epoch ``low``: the reader moves on
                low = self._low[name] = min(epoch)
                start = self.rr[name]
                continue
            if sc.counter[slot] < sc.size(slot):
                self.rr[name] = (slot + 1) % n
                return slot
            # an empty block in this epoch (N < L): skip it. Some owned shard is not empty
            # (``_usable``), or in ``local`` mode will not be in a later epoch (its block
            # changes every epoch, and N > 0 blocks hold documents), so this ends
            epoch[slot] += 1
            sc.counter[slot] = 0
            start = (slot + 1) % n
        return None

    def _open(self) -> tuple[str, int, np.ndarray] | None:
        """Pick the next document (mixing, then shard), skipping short ones.

        In an endless stream a sub-dataset whose long documents are rare may skip two
        passes of this reader's shards without finding one: it is then passed over for
        this document (its cursors keep what was skipped) so the others are served, and
        chosen again for the next. Alone, or with only such sub-datasets left, it skips on
        until one comes. The skip count lives in this call only, so a resumed reader
        passes over what the uninterrupted one did."""
        min_len = self.config.min_doc_len
        passed: set[str] = set()
        while self._active:
            name = self.mixer.choose([n for n in self._active if n not in passed])
            if name is None and passed:  # only the passed-over ones have weight: wait on one
                name = self.mixer.choose(self._active)
            if name is None:
                return None
            sc = self.shards[name]
            skipped, budget, dropped = 0, None, False
            while True:
                slot = self._next_slot(name)
                if slot is None:
                    dropped = True
                    break
                toks = self._tokens(name, slot)
                if len(toks) >= min_len or sc.offset[slot] > 0:
                    return name, slot, self._fitting(name, slot, toks)
                self._roll(sc, slot)  # too short (or empty): skip, never emit
                skipped += 1
                if self.config.num_epochs is not None:
                    continue  # the shards finish: skipping ends, and no document is lost
                if budget is None:  # two passes (a gap may span an epoch's end)
                    budget = 2 * sum(sc.size(s) for s in range(len(sc.ids))) + len(sc.ids) + 1
                if skipped > budget:
                    if not self._holds_long(name, sc):
                        dropped = True
                        break
                    if name not in passed and any(
                        n not in passed and n != name for n in self._active
                    ):
                        passed.add(name)  # served after the others, this time
                        break
                    skipped = 0  # a long document comes in a later epoch's order
            if dropped:
                self._active.remove(name)  # exhausted (finite) or holds no usable document
        return None

    def _holds_long(self, name: str, sc: ShardCursors) -> bool:
        """Whether an endless stream of ``name`` will reach a document of ``min_doc_len``
        tokens: in ``none`` mode this reader reads the same blocks every epoch, so the
        passes just skipped decide (none); otherwise every document passes through every
        reader's shards in time, so any document of the sub-dataset counts. Scanned once,
        stopping at the first such document."""
        if sc.mode == "none":
            self._has_long[name] = False
        elif name not in self._has_long:
            self._has_long[name] = holds_long(self.sources[name], self.config.min_doc_len)
        return self._has_long[name]

    # -- packing -----------------------------------------------------------------------
    def next_batch(self) -> dict[str, torch.Tensor]:
        """Fill one (batch_size, row_len) batch; raise StopIteration when finished."""
        if self.done:
            raise StopIteration
        cfg = self.config
        bos, eos = cfg.bos_id, cfg.eos_id
        buf = BatchBuffer(cfg.batch_size, cfg.row_len, self._np_dtype, cfg.pad_id,
                          cfg.provenance)  # fmt: skip
        while not buf.full:
            if self._cur is None:
                self._cur = self._open()
                if self._cur is None:
                    self.done = True
                    break
            name, slot, toks = self._cur
            sc = self.shards[name]
            off = sc.offset[slot]
            if off >= stream_len(len(toks), bos, eos):  # all emitted (EOS since turned off)
                if off > stream_len(len(toks), bos, eos) + 1:  # no marker change explains it
                    raise LoaderInputError(
                        f"loader state: sub-dataset {name!r} shard {sc.ids[slot]} resumes "
                        f"at offset {off} of a document of {len(toks)} tokens; the state is "
                        "damaged or not this corpus's (or tokenizer's): use another checkpoint"
                    )
                self._roll(sc, slot)
                self._cur = None
                continue
            doc = -1
            if cfg.provenance:
                doc = (self._source_index[name] << 32) + int(sc.current_doc(slot))
            k = buf.put(toks, off, bos, eos, doc)
            self.mixer.tokens[name] += k
            if off + k >= stream_len(len(toks), bos, eos):
                self._roll(sc, slot)
                self._cur = None
            else:
                sc.offset[slot] = off + k
        if self.done:
            rows = buf.finish()
            if rows == 0:
                raise StopIteration
            return buf.tensors(rows)
        return buf.tensors()
