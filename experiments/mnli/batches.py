"""Batching MNLI splits: a deterministic, resumable, rank-aware training iterator and
in-order evaluation batches (re-exported by :mod:`experiments.mnli.data`)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from experiments.cursor import EpochCursor

if TYPE_CHECKING:
    from experiments.mnli.data import EncodedSplit

__all__ = ["BatchIterator", "eval_batches"]


class BatchIterator(EpochCursor):
    """Endless, deterministic batches over `split`, epoch after epoch, for one rank.

    Epoch e visits `randperm(N, seed + e)` in global batches of `batch_size`; rank r of
    `world_size` takes the r-th contiguous slice, so the ranks' union is the single-process
    batch in order. The position is `state_dict()`: a few integers, valid at any world size.
    """

    def __init__(
        self,
        split: EncodedSplit,
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank}, world_size={world_size}: need 0 <= rank < world_size")
        if batch_size < 1 or batch_size % world_size:
            raise ValueError(
                f"batch_size={batch_size} (global) must be a positive multiple of "
                f"world_size={world_size}; round it to a multiple"
            )
        if not drop_last and world_size > 1:
            raise ValueError(
                "drop_last=False with world_size>1 gives ranks unequal last batches; "
                "use drop_last=True for training (eval_batches for evaluation)"
            )
        self.split, self.batch_size, self.seed, self.shuffle = split, batch_size, seed, shuffle
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.n = len(split)
        self.steps_per_epoch = self.n // batch_size if drop_last else math.ceil(self.n / batch_size)
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"split of {self.n} examples is smaller than batch_size={batch_size}"
                " with drop_last=True; lower batch_size"
            )
        self.epoch = self.batch_in_epoch = 0
        self._order: tuple[int, torch.Tensor] | None = None  # cache of (epoch, permutation)

    def _epoch_order(self) -> torch.Tensor:
        if self._order is None or self._order[0] != self.epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed + self.epoch)
                order = torch.randperm(self.n, generator=g)
            else:
                order = torch.arange(self.n)
            self._order = (self.epoch, order)
        return self._order[1]

    def __iter__(self) -> BatchIterator:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        start = self.batch_in_epoch * self.batch_size
        glob = self._epoch_order()[start : start + self.batch_size]  # (B,)
        per_rank = len(glob) // self.world_size
        local = glob[self.rank * per_rank : (self.rank + 1) * per_rank]  # (B / world_size,)
        self._advance()
        return self.split.batch(local)

    def epoch_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """The batches left in the current epoch (all of it when at its start)."""
        for _ in range(self.steps_per_epoch - self.batch_in_epoch):
            yield next(self)


def eval_batches(split: EncodedSplit, batch_size: int) -> Iterator[dict[str, torch.Tensor]]:
    """All of `split` in order, in batches of `batch_size` (the last may be smaller)."""
    if batch_size < 1:
        raise ValueError(f"eval batch_size={batch_size} must be positive")
    for start in range(0, len(split), batch_size):
        yield split.batch(torch.arange(start, min(start + batch_size, len(split))))
