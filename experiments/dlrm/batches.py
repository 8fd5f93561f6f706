"""Shuffled, resumable, rank-aware batches over rows of a preprocessed Criteo table."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from comera.errors import ConfigError, DataError
from experiments.cursor import EpochCursor, check_global_batch
from experiments.dlrm.data import CriteoData
from loaders.permute import IndexCipher

__all__ = ["RowBatches", "rows_to_batch"]


def rows_to_batch(data: CriteoData, rows: np.ndarray) -> dict[str, torch.Tensor]:
    """Rows (absolute indices) -> ``dense (B, 13)``, ``cat (B, 26)`` int64, ``label (B,)``
    and ``row (B,)``, the row indices themselves (for audits of what was read)."""
    rows = np.asarray(rows, dtype=np.int64)
    raw = data.cat[rows]  # (B, 26) int32 in a cache
    # a cache whose ids were damaged in place (its files keep their sizes, so opening it
    # found nothing) ended in F.embedding's IndexError traceback: every batch is checked,
    # one unsigned comparison an id (a negative id reads as one above every table)
    cards = np.asarray(data.cardinalities)
    wide = raw.dtype != np.int32  # a table given from Python: both bounds
    if (
        ((raw < 0) | (raw >= cards)).any()
        if wide
        else (raw.view(np.uint32) >= cards.astype(np.uint32)).any()
    ):
        cat = raw.astype(np.int64)
        bad = (cat < 0) | (cat >= np.asarray(data.cardinalities))
        i, j = (int(x) for x in np.argwhere(bad)[0])
        raise DataError(
            f"the Criteo cache {data.root} is damaged: row {int(rows[i])} holds id "
            f"{int(cat[i, j])} in C{j + 1}, outside its {data.cardinalities[j]} ids; delete that "
            "folder to rebuild it, or point --cache-dir (data.cache_dir) elsewhere"
        )
    label = data.label[rows]
    bad_label = (label != 0) & (label != 1)  # damaged in place: trained as a target of 7
    if bad_label.any():
        i = int(np.argmax(bad_label))
        raise DataError(
            f"the Criteo cache {data.root} is damaged: row {int(rows[i])} holds label "
            f"{label[i]}, not 0 or 1; delete that folder to rebuild it, or point --cache-dir "
            "(data.cache_dir) elsewhere"
        )
    return {
        "dense": torch.from_numpy(np.ascontiguousarray(data.dense[rows])),
        "cat": torch.from_numpy(raw.astype(np.int64)),
        "label": torch.from_numpy(label.astype(np.float32)),
        "row": torch.from_numpy(rows),
    }


class RowBatches(EpochCursor):
    """Endless batches over rows ``[lo, hi)`` of ``data``, epoch after epoch, for one rank.

    Epoch ``e`` visits the rows in the order of a keyed bijection (``IndexCipher``, key from
    seed and epoch): no permutation is stored, whatever the split size. Global batch ``i``
    is positions ``[i*B, (i+1)*B)``; rank ``r`` of ``world`` takes the ``r``-th contiguous
    slice, so the ranks together read the single-process batch. The position is
    ``state_dict()``, a few integers valid at any world size."""

    def __init__(
        self,
        data: CriteoData,
        lo: int,
        hi: int,
        batch_size: int,
        *,
        seed: int = 0,
        rank: int = 0,
        world: int = 1,
    ) -> None:
        check_global_batch(batch_size, world)
        self.n = hi - lo
        if self.n < batch_size:
            raise ConfigError(
                f"the training split has {self.n} rows, fewer than batch_size={batch_size}; "
                "lower it (--set batch_size=N) or use more data (a resumed run keeps its "
                "batch_size: give --data the file it trained on)"
            )
        self.data, self.lo, self.batch_size, self.seed = data, lo, batch_size, seed
        self.rank, self.world = rank, world
        self.steps_per_epoch = self.n // batch_size
        self.epoch = self.batch_in_epoch = 0
        self.data_id = data.identity()  # a resume on changed data is refused
        self._cipher: tuple[int, IndexCipher] | None = None

    @property
    def legacy_data_ids(self) -> tuple[str, ...]:  # type: ignore[override]
        """The sampled digest a checkpoint saved before the full one holds (read only
        on resume: 4,096 rows)."""
        legacy = self.data.sampled_identity()
        return (legacy,) if legacy != self.data_id else ()

    @property
    def data_hint(self) -> str:  # type: ignore[override]
        """Names the flag and the file this run reads, where the refusal of changed data
        named neither."""
        source = str(self.data.meta.get("source", self.data.root))
        # --data generated writes its file into the cache folder, beside the tables
        named = re.fullmatch(r"generated-\d+-[0-9a-f]+\.txt", Path(source).name)
        if named and Path(source).parent == Path(self.data.root).resolve().parent:
            return (
                "this run reads the generated file of another data.generated_rows or "
                "generator: resume with the run's own data.generated_rows, or start a new run"
            )
        return (
            f"this run reads {source}: give --data the file the run trained on (data.path "
            "in its config.json), or start a new run"
        )

    def _order(self) -> IndexCipher:
        if self._cipher is None or self._cipher[0] != self.epoch:
            self._cipher = (self.epoch, IndexCipher(self.n, self.seed * 1_000_003 + self.epoch))
        return self._cipher[1]

    def __iter__(self) -> RowBatches:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        per_rank = self.batch_size // self.world
        start = self.batch_in_epoch * self.batch_size + self.rank * per_rank
        rows = self._order()(np.arange(start, start + per_rank)).astype(np.int64) + self.lo
        self._advance()
        return rows_to_batch(self.data, np.sort(rows))  # sorted: sequential memmap reads
