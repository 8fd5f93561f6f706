"""Mixing: pick the sub-dataset whose realized token share lags its target most.

Deterministic deficit scheduling: after ``T`` emitted tokens sub-dataset ``d`` has emitted
``t_d``; the next document comes from the active ``d`` minimising ``t_d / w_d``. The realized
share differs from ``w_d / sum(w)`` by at most one document's tokens over ``T``, so shares
converge like 1/T and no random state is needed. Changing weights restarts the counters
(shares converge to the new targets from that point); sub-dataset positions live in the
shard cursors and are untouched.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from loaders.config import check_weight
from loaders.errors import LoaderInputError


class Mixer:
    """Token counters per sub-dataset and the deficit rule over them."""

    __slots__ = ("names", "weights", "tokens")

    def __init__(
        self,
        weights: dict[str, float],
        tokens: dict[str, int] | None = None,
    ) -> None:
        self.names = list(weights)
        self.weights = {k: float(v) for k, v in weights.items()}
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
        self.tokens = dict.fromkeys(self.names, 0)

    def choose(self, active: Iterable[str]) -> str | None:
        """The active sub-dataset with positive weight furthest below its target share."""
        best, best_key = None, None
        for name in active:
            w = self.weights[name]
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
