"""Logical shards: who owns what, and where each shard is in its epoch.

The documents of each sub-dataset are cut into ``L`` logical shards, fixed for the life of
a run. A shard's cursor is three integers ``(epoch, counter, offset)``: ``counter`` documents
of its epoch order are fully emitted and ``offset`` tokens of the next one are. Which
document sits at ``counter`` is a pure function of (seed, sub-dataset, epoch, shard, counter):

* ``global``: one cipher permutes the whole sub-dataset each epoch; shard ``s`` takes the
  contiguous positions ``[s*N//L, (s+1)*N//L)`` of that order (fully global shuffle).
* ``local``: shard ``s`` reads the contiguous document block ``b = pi_e(s)`` (blocks are
  permuted per epoch) in a per-(epoch, shard) cipher order: reads stay inside ~N/L
  neighbouring documents, i.e. a few files (locality-friendly).
* ``none``: shard ``s`` reads block ``s`` in file order (debugging).

Ownership is a pure function of (rank, world, worker, num_workers), so rescaling is only a
reassignment of cursors.
"""

from __future__ import annotations

import numpy as np

from loaders.errors import LoaderInputError
from loaders.permute import IndexCipher, derive_key

_BLOCK = 64  # document ids computed per cipher call (a cache, never state)


def owned_shards(num_shards: int, rank: int, world: int, worker: int, num_workers: int) -> range:
    """Contiguous range of logical shards owned by (rank, worker); disjoint, covering."""
    total = world * num_workers
    if total > num_shards:
        raise LoaderInputError(
            f"{world} ranks x {num_workers} workers = {total} readers but only num_shards="
            f"{num_shards} logical shards; raise num_shards (fixed at first run) or use fewer"
        )
    g = rank * num_workers + worker
    return range(g * num_shards // total, (g + 1) * num_shards // total)


def logical_shard_of(position: int, num_docs: int, num_shards: int) -> int:
    """Logical shard holding ``position`` of an epoch order of ``num_docs`` documents."""
    return ((position + 1) * num_shards - 1) // num_docs


def shard_bounds(num_docs: int, num_shards: int, shard: int) -> tuple[int, int]:
    """Half-open position range of ``shard`` when ``num_docs`` are cut into ``num_shards``."""
    return shard * num_docs // num_shards, (shard + 1) * num_docs // num_shards


class ShardCursors:
    """Cursors of one reader's logical shards of one sub-dataset."""

    __slots__ = (
        "name", "num_docs", "num_shards", "seed", "mode", "ids",
        "epoch", "counter", "offset", "_ciphers", "_cache", "_sizes",
    )  # fmt: skip

    def __init__(
        self,
        *,
        name: str,
        num_docs: int,
        num_shards: int,
        seed: int,
        mode: str,
        ids: list[int],
        cursors: dict[int, tuple[int, int, int]] | None = None,
    ) -> None:
        self.name, self.num_docs, self.num_shards = name, num_docs, num_shards
        self.seed, self.mode, self.ids = seed, mode, list(ids)
        cursors = cursors or {}
        zero = (0, 0, 0)
        self.epoch = [int(cursors.get(s, zero)[0]) for s in self.ids]
        self.counter = [int(cursors.get(s, zero)[1]) for s in self.ids]
        self.offset = [int(cursors.get(s, zero)[2]) for s in self.ids]
        self._ciphers: dict[tuple, IndexCipher] = {}
        self._cache: list[tuple[int, int, np.ndarray] | None] = [None] * len(self.ids)
        self._sizes: list[tuple[int, int]] = [(-1, 0)] * len(self.ids)  # (epoch, size)

    def _cipher(self, n: int, *key: object) -> IndexCipher:
        c = self._ciphers.get(key)
        if c is None:
            if len(self._ciphers) > 4 * len(self.ids) + 8:
                self._ciphers.clear()
            c = self._ciphers[key] = IndexCipher(n, derive_key(self.seed, self.name, *key))
        return c

    def _block(self, shard: int, epoch: int) -> int:
        if self.mode != "local":
            return shard
        return int(self._cipher(self.num_shards, epoch, "blocks")(shard)[0])

    def size(self, slot: int, epoch: int | None = None) -> int:
        """Documents in shard ``slot`` during ``epoch`` (default: its current epoch)."""
        e = self.epoch[slot] if epoch is None else epoch
        cached = self._sizes[slot]
        if cached[0] == e:
            return cached[1]
        lo, hi = shard_bounds(self.num_docs, self.num_shards, self._block(self.ids[slot], e))
        self._sizes[slot] = (e, hi - lo)
        return hi - lo

    def docs(self, shard: int, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Document ids at ``positions`` of ``shard``'s order in ``epoch`` (vectorized)."""
        n, L = self.num_docs, self.num_shards
        if self.mode == "global":
            lo, _ = shard_bounds(n, L, shard)
            return self._cipher(n, epoch)(positions + lo)
        lo, hi = shard_bounds(n, L, self._block(shard, epoch))
        if self.mode == "none":
            return positions + lo
        return self._cipher(hi - lo, epoch, shard)(positions) + lo

    def current_doc(self, slot: int) -> int:
        """Document id under shard ``slot``'s cursor (must be inside its epoch)."""
        e, c = self.epoch[slot], self.counter[slot]
        hit = self._cache[slot]
        if hit is None or hit[0] != e or not (hit[1] <= c < hit[1] + len(hit[2])):
            end = min(c + _BLOCK, self.size(slot, e))
            hit = (e, c, self.docs(self.ids[slot], e, np.arange(c, end, dtype=np.int64)))
            self._cache[slot] = hit
        return int(hit[2][c - hit[1]])

    def state(self) -> dict[str, list[int]]:
        return {"ids": list(self.ids), "epoch": list(self.epoch), "counter": list(self.counter),
                "offset": list(self.offset)}  # fmt: skip
