"""Mixing: pick the sub-dataset whose realized token share lags its target most.

Deterministic deficit scheduling: after ``T`` emitted tokens sub-dataset ``d`` has emitted
``t_d``; the next document comes from the active ``d`` minimising ``t_d / w_d``. The realized
share differs from ``w_d / sum(w)`` by at most one document's tokens over ``T``, so shares
converge like 1/T and no random state is needed. Changing weights restarts the counters
(shares converge to the new targets from that point); sub-dataset positions live in the
shard cursors and are untouched.

Each reader mixes on its own, so a sub-dataset with fewer documents than there are readers
reaches only some of them. In an endless stream whose shards keep their documents (shuffle
``global`` or ``none``) the readers that own one of its documents then serve it more often,
by one factor per sub-dataset that :func:`reader_targets` solves from the layout alone, so
the shares over all readers still meet the weights; weights the owners cannot serve are
refused (:class:`MixingShortfall`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import combinations

import numpy as np

from loaders.config import check_weight
from loaders.errors import LoaderInputError, MixingShortfall

# how far the shares over all readers may miss the weights (as a fraction of all tokens)
# before the weights count as out of reach; the mixer's own granularity is one document
SHARE_TOLERANCE = 1e-3
# what the num_epochs advice costs: a data-parallel loop must not wait on an ended rank
FINITE = " (a finite stream: its ranks end after different numbers of batches)"
_ITERATIONS = 2_000  # interior solutions converge in tens to hundreds; see reader_targets


class Mixer:
    """Token counters per sub-dataset and the deficit rule over them."""

    __slots__ = ("names", "weights", "targets", "tokens")

    def __init__(
        self,
        weights: dict[str, float],
        tokens: dict[str, int] | None = None,
    ) -> None:
        self.names = list(weights)
        self.weights = {k: float(v) for k, v in weights.items()}
        # what the deficit rule aims at: the weights, unless this reader must make up for
        # readers that own no document of a sub-dataset (see :func:`reader_targets`)
        self.targets = dict(self.weights)
        self.tokens = {k: int((tokens or {}).get(k, 0)) for k in self.names}

    def set_weights(self, weights: dict[str, float]) -> None:
        """New targets; unknown names are an error, missing names keep their weight."""
        if not isinstance(weights, Mapping):
            raise LoaderInputError(
                f"weights must map sub-dataset names to weights (e.g. {{{self.names[0]!r}: "
                f"0.5}}), got {weights!r}"
            )
        unknown = sorted(set(weights) - set(self.names))
        if unknown:
            raise LoaderInputError(
                f"weights for unknown sub-datasets {unknown}; known sub-datasets: {self.names}"
            )
        new = {**self.weights, **{k: check_weight(f"set_weights {k!r}", v)
                                  for k, v in weights.items()}}  # fmt: skip
        if sum(new.values()) <= 0:
            raise LoaderInputError(
                f"weights {new} are all 0; give one sub-dataset a positive weight"
            )
        self.weights = new
        self.targets = dict(new)
        self.tokens = dict.fromkeys(self.names, 0)

    def choose(self, active: Iterable[str]) -> str | None:
        """The active sub-dataset with positive weight furthest below its target share."""
        best, best_key = None, None
        for name in active:
            w = self.targets[name]
            if w <= 0:
                continue
            key = self.tokens[name] / w
            if best_key is None or key < best_key:
                best, best_key = name, key
        return best

    def add(self, name: str, n: int) -> None:
        self.tokens[name] += n

    def state(self) -> dict:
        return {"weights": dict(self.weights), "tokens": dict(self.tokens)}


def owners(docs: Mapping[str, int], num_shards: int, readers: int) -> np.ndarray:
    """``(readers, len(docs))`` bools: whether reader ``g`` (``rank * workers + worker``)
    owns a document of each sub-dataset (:func:`loaders.shards.owned_shards` cuts the
    ``num_shards`` logical shards among readers, :func:`loaders.shards.shard_bounds` the
    documents among shards)."""
    g = np.arange(readers, dtype=np.int64)
    lo, hi = g * num_shards // readers, (g + 1) * num_shards // readers
    cols = [hi * int(n) // num_shards > lo * int(n) // num_shards for n in docs.values()]
    return np.stack(cols, axis=1) if cols else np.zeros((readers, 0), dtype=bool)


def reader_targets(
    weights: Mapping[str, float],
    docs: Mapping[str, int],
    num_shards: int,
    readers: int,
    which: Sequence[int],
) -> list[dict[str, float]] | None:
    """Mixing targets of the readers ``which`` (each ``rank * workers + worker`` of
    ``readers``) under which the token shares over all readers meet ``weights``; ``None``
    when every reader owns a document of every sub-dataset with a positive weight (each
    then mixes by the weights themselves).

    Every reader emits the same number of tokens, so the overall share of ``d`` is the mean
    of the readers' shares. A reader's targets are ``w_d * c_d`` over the sub-datasets it
    owns a document of, with one boost ``c_d`` per sub-dataset found by alternately scaling
    readers (their shares sum to 1) and sub-datasets (their mean share is the weight's), the
    Sinkhorn iteration: the most even split of the extra load among owners. ``docs`` holds
    each sub-dataset's document count. Raises :class:`MixingShortfall` when no split meets
    the weights to within :data:`SHARE_TOLERANCE`, e.g. a sub-dataset owned by 3 of 4
    readers cannot take more than 3/4 of the tokens. Where a split exists only at the edge
    (that sub-dataset at weight 3/4: its owners serve nothing else) the iteration converges
    like ``1/iterations`` and stops within :data:`SHARE_TOLERANCE` of the weights. Only the
    ratios within a reader's targets matter (the deficit rule divides by them); they are
    rounded to 12 digits, so a platform's last-bit differences cannot flip a tie between
    two sub-datasets and a resume elsewhere draws the same stream."""
    names = [n for n in docs if weights.get(n, 0) > 0]
    own = owners({n: docs[n] for n in names}, num_shards, readers)
    if own.all():
        return None
    w = np.array([float(weights[n]) for n in names])
    p = w / w.sum()
    patterns, pattern, count = np.unique(own, axis=0, return_inverse=True, return_counts=True)
    pattern = pattern.reshape(-1)
    x = patterns * p  # each pattern's shares, rows summing to 1 after the first scaling
    share = np.zeros_like(p)
    for _ in range(_ITERATIONS):
        rows = x.sum(axis=1, keepdims=True)
        x = np.divide(x, rows, out=np.zeros_like(x), where=rows > 0)
        share = (count[:, None] * x).sum(axis=0) / readers  # numpy's own sum, not BLAS's
        if np.abs(share - p).max() <= 1e-9:
            break
        x = x * np.divide(p, share, out=np.zeros_like(p), where=share > 0)
    if np.abs(share - p).max() > SHARE_TOLERANCE:
        fact, advice = _shortfall(names, p, own, docs, num_shards, readers)
        raise MixingShortfall(f"{fact}; {advice}", fact=fact)
    out = []
    for g in which:
        row = x[int(pattern[g])] * w.sum()  # the weights' scale, boosted
        targets = dict.fromkeys(docs, 0.0)
        targets.update((n, float(f"{row[i]:.12g}")) for i, n in enumerate(names))
        out.append(targets)
    return out


def _shortfall(
    names: list[str],
    p: np.ndarray,
    own: np.ndarray,
    docs: Mapping[str, int],
    num_shards: int,
    readers: int,
) -> tuple[str, str]:
    """Why the weights cannot be met (the smallest group of sub-datasets whose owners are
    too few for their shares together; groups of up to 4 are searched), and what to
    change, in ``LoaderConfig``'s terms."""
    for size in range(1, min(len(names), 4) + 1):
        for group in combinations(range(len(names)), size):
            reach = int(own[:, list(group)].any(axis=1).sum())
            need = float(p[list(group)].sum())
            if need > reach / readers + SHARE_TOLERANCE:
                what = ", ".join(f"{names[i]!r} ({docs[names[i]]} documents)" for i in group)
                one = size == 1
                return (
                    f"sub-dataset{'' if one else 's'} {what} reach{'es' if one else ''} only "
                    f"{reach} of {readers} readers (num_shards={num_shards}), so "
                    f"{'it' if one else 'they'} can take at most {reach / readers:.1%} of an "
                    f"endless stream's tokens, short of the weights' {need:.1%}",
                    f"lower {'its weight' if one else 'their weights'}, use fewer ranks or "
                    f"workers, give {'it' if one else 'them'} more documents, or use "
                    f"shuffle='local' or set num_epochs{FINITE}",
                )
    return (
        f"the weights' shares {dict(zip(names, p.round(4).tolist(), strict=True))} cannot be "
        f"met by the readers owning each sub-dataset's documents ({readers} readers, "
        f"num_shards={num_shards})",
        "lower the small sub-datasets' weights, use fewer ranks or workers, or use "
        f"shuffle='local' or set num_epochs{FINITE}",
    )
