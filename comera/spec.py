"""Static descriptions of tensor-train layers: mode shapes, ranks, dtype.

A spec holds only hyperparameters (never tensors), is validated at construction and
is hashable, so it can key caches and be passed to pure functions as static data.
Current ranks after pruning/compaction are read from the core shapes, not from here:
``spec.ranks`` are the ranks a layer is *created* with.
"""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch

from comera.errors import ConfigError

__all__ = [
    "TTLinearSpec",
    "TTMEmbeddingSpec",
    "as_number",
    "cap_ranks",
    "factorize",
    "propose_modes",
    "propose_tt_linear",
    "propose_ttm_embedding",
]


def _as_tuple(name: str, what: str, value: object) -> tuple[int, ...]:
    """Normalize a sequence of positive ints, raising an error that names the layer."""
    try:  # ints only: int() would take 2.5 as 2 and "12" as 12 (and True is not 1 here)
        out = tuple(_index(v) for v in value)  # type: ignore[union-attr]
    except TypeError:
        raise ConfigError(f"{name}: {what} must be a sequence of ints, got {value!r}") from None
    if any(v < 1 for v in out):
        raise ConfigError(f"{name}: every entry of {what} must be >= 1, got {list(out)}")
    return out


def _index(v: object) -> int:
    """``v`` as an int: an int (numpy's too), never a bool, float or string (TypeError)."""
    if isinstance(v, bool):
        raise TypeError("a bool is not a size")
    return operator.index(v)  # type: ignore[arg-type]


def _optional_size(name: str, what: str, value: object) -> int | None:
    """``value`` as an int, or None; anything else a :class:`ConfigError` naming ``what``
    (``int()`` would take 12.7 as 12, and "4" then compared unequal to 4)."""
    try:
        return None if value is None else _index(value)
    except TypeError:
        raise ConfigError(f"{name}: {what} must be an int or None, got {value!r}") from None


def _sizes(name: str, **sizes: object) -> None:
    """Refuse any of ``sizes`` that is not an int (numpy's too) naming ``name``'s argument."""
    for what, value in sizes.items():
        try:
            ok = _index(value) >= 1
        except TypeError:
            ok = False
        if not ok:
            raise ConfigError(f"{name}: {what} must be an int >= 1, got {value!r}")


def as_number(value: object) -> float:
    """``value`` as a float (a number, numpy's, a one-element tensor), or NaN for anything
    else, a bool and a string included (True is not 1.0 here, nor "0.1" a number), numpy's
    and torch's bools too, and an int past float's range."""
    if isinstance(value, bool | np.bool_ | str | bytes):
        return math.nan
    if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        return math.nan
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError, RuntimeError, OverflowError):
        return math.nan


def _check_dtype_std(name: str, dtype: object, std: float | None) -> None:
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ConfigError(f"{name}: dtype must be a floating torch.dtype, got {dtype!r}")
    if std is None:
        return
    if not 0 < as_number(std) < math.inf:  # inf made infinite cores
        raise ConfigError(f"{name}: std must be a finite number > 0 (or None), got {std!r}")


def cap_ranks(
    modes: tuple[int, ...], ranks: int | tuple[int, ...], name: str = "layer"
) -> tuple[int, ...]:
    """Internal bond ranks of a TT over ``modes``, each capped by what the bond can carry.

    Bond ``k`` (between core ``k`` and ``k+1``) can carry at most
    ``min(prod(modes[:k+1]), prod(modes[k+1:]))`` ranks: anything larger adds
    parameters without adding expressiveness. ``ranks`` is one int for every bond or
    one int per bond (``len(modes) - 1`` of them).
    """
    n_bonds = len(modes) - 1
    try:
        requested = (
            (_index(ranks),) * n_bonds
            if not isinstance(ranks, Iterable)
            else tuple(_index(r) for r in ranks)
        )
    except TypeError:
        raise ConfigError(
            f"{name}: ranks must be an int or one int per bond ({n_bonds}), got {ranks!r}"
        ) from None
    if len(requested) != n_bonds:
        raise ConfigError(
            f"{name}: expected {n_bonds} internal ranks for {len(modes)} cores "
            f"(one per bond), got {len(requested)}: {list(requested)}"
        )
    if any(r < 1 for r in requested):
        raise ConfigError(f"{name}: ranks must be >= 1, got {list(requested)}")
    out = []
    for k, r in enumerate(requested):
        left = math.prod(modes[: k + 1])
        right = math.prod(modes[k + 1 :])
        out.append(min(r, left, right))
    return tuple(out)


@dataclass(frozen=True, slots=True, kw_only=True)
class TTLinearSpec:
    """A linear map ``x -> x W^T (+ b)`` with ``W`` (out x in) stored as a tensor train.

    ``W`` is reshaped to ``(m_1..m_d, n_1..n_d)`` (output modes first) and factored into
    ``2d`` cores ``G_k`` of shape ``(r_{k-1}, mode_k, r_k)`` with ``r_0 = r_2d = 1``.
    ``ranks`` is the requested internal rank (one int or one per bond); edge bonds are
    capped by the mode sizes (see :func:`cap_ranks`). ``std`` overrides the
    reconstructed weight's standard deviation (default: that of ``torch.nn.Linear``).
    """

    out_modes: tuple[int, ...]
    in_modes: tuple[int, ...]
    ranks: int | tuple[int, ...]
    bias: bool = True
    dtype: torch.dtype = torch.float32
    name: str = "tt_linear"
    std: float | None = None
    out_features: int | None = None
    in_features: int | None = None

    def __post_init__(self) -> None:
        name = f"tt_linear {self.name!r}"
        out_modes = _as_tuple(name, "out_modes", self.out_modes)
        in_modes = _as_tuple(name, "in_modes", self.in_modes)
        if len(out_modes) != len(in_modes) or len(out_modes) < 1:
            raise ConfigError(
                f"{name}: out_modes and in_modes must have the same length d >= 1 "
                f"(the TT has 2d cores), got {list(out_modes)} and {list(in_modes)}"
            )
        for what, modes, dim in (
            ("out_modes", out_modes, self.out_features),
            ("in_modes", in_modes, self.in_features),
        ):
            # "4" was "the product ... is 4, but the layer has 4 ... features"
            dim = _optional_size(name, f"{what.split('_')[0]}_features", dim)
            if dim is not None and math.prod(modes) != dim:
                raise ConfigError(
                    f"{name}: the product of {what} {list(modes)} is {math.prod(modes)}, "
                    f"but the layer has {dim} {what.split('_')[0]}put features; choose modes "
                    f"whose product is {dim} (see comera.spec.propose_modes)"
                )
        _check_dtype_std(name, self.dtype, self.std)
        if not isinstance(self.bias, (bool, np.bool_)):  # None meant no bias, "no" one
            raise ConfigError(f"{name}: bias must be True or False, got {self.bias!r}")
        object.__setattr__(self, "bias", bool(self.bias))
        object.__setattr__(self, "out_modes", out_modes)
        object.__setattr__(self, "in_modes", in_modes)
        object.__setattr__(self, "ranks", cap_ranks(out_modes + in_modes, self.ranks, name))
        object.__setattr__(self, "out_features", math.prod(out_modes))
        object.__setattr__(self, "in_features", math.prod(in_modes))

    @property
    def label(self) -> str:
        """How errors name this layer."""
        return f"tt_linear {self.name!r}"

    @property
    def modes(self) -> tuple[int, ...]:
        """All core mode sizes in core order: output modes, then input modes."""
        return self.out_modes + self.in_modes  # type: ignore[operator]

    @property
    def dense_shape(self) -> tuple[int, int]:
        return (self.out_features, self.in_features)  # type: ignore[return-value]


@dataclass(frozen=True, slots=True, kw_only=True)
class TTMEmbeddingSpec:
    """An embedding table ``V x D`` stored as a tensor-train matrix.

    Cores ``F_k`` have shape ``(r_{k-1}, v_k, d_k, r_k)``. ``prod(vocab_modes)`` may exceed
    ``num_embeddings`` (the vocabulary is padded so it factors well); ids must still be
    in ``[0, num_embeddings)``. ``std`` defaults to 1.0, like ``torch.nn.Embedding``.
    """

    vocab_modes: tuple[int, ...]
    dim_modes: tuple[int, ...]
    ranks: int | tuple[int, ...]
    num_embeddings: int | None = None
    embedding_dim: int | None = None
    dtype: torch.dtype = torch.float32
    name: str = "ttm_embedding"
    std: float | None = None
    _padded: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        name = f"ttm_embedding {self.name!r}"
        vocab_modes = _as_tuple(name, "vocab_modes", self.vocab_modes)
        dim_modes = _as_tuple(name, "dim_modes", self.dim_modes)
        if len(vocab_modes) != len(dim_modes) or len(vocab_modes) < 2:
            raise ConfigError(
                f"{name}: vocab_modes and dim_modes must have the same length d >= 2, "
                f"got {list(vocab_modes)} and {list(dim_modes)}"
            )
        padded = math.prod(vocab_modes)
        num = _optional_size(name, "num_embeddings", self.num_embeddings)
        num = padded if num is None else num
        if not 1 <= num <= padded:
            raise ConfigError(
                f"{name}: num_embeddings={num} must be in [1, prod(vocab_modes)={padded}]; "
                f"vocab_modes {list(vocab_modes)} cannot hold the vocabulary "
                "(see comera.spec.propose_modes(..., pad=True))"
            )
        dim = math.prod(dim_modes)
        want = _optional_size(name, "embedding_dim", self.embedding_dim)
        if want is not None and want != dim:
            raise ConfigError(
                f"{name}: the product of dim_modes {list(dim_modes)} is {dim}, but "
                f"embedding_dim is {self.embedding_dim}; choose dim_modes whose product is "
                f"{self.embedding_dim}"
            )
        _check_dtype_std(name, self.dtype, self.std)
        # Bond capacity: a TTM core merges (v_k, d_k) into one TT mode.
        merged = tuple(v * d for v, d in zip(vocab_modes, dim_modes, strict=True))
        object.__setattr__(self, "vocab_modes", vocab_modes)
        object.__setattr__(self, "dim_modes", dim_modes)
        object.__setattr__(self, "ranks", cap_ranks(merged, self.ranks, name))
        object.__setattr__(self, "num_embeddings", num)
        object.__setattr__(self, "embedding_dim", dim)
        object.__setattr__(self, "_padded", padded)

    @property
    def label(self) -> str:
        """How errors name this layer."""
        return f"ttm_embedding {self.name!r}"

    @property
    def padded_vocab(self) -> int:
        return self._padded

    @property
    def dense_shape(self) -> tuple[int, int]:
        return (self.num_embeddings, self.embedding_dim)  # type: ignore[return-value]


# --------------------------------------------------------------------------- factorization


@lru_cache(maxsize=4096)
def _best_split(n: int, d: int, max_factor: int) -> tuple[int, ...] | None:
    """The most balanced way to write ``n`` as ``d`` factors each <= max_factor (ascending).

    Balanced means: smallest largest factor, then smallest sum (a proxy for TT parameters).
    """
    if d == 1:
        return (n,) if n <= max_factor else None
    best: tuple[int, ...] | None = None
    # The smallest factor is at most the d-th root of n.
    hi = int(round(n ** (1.0 / d))) + 1
    for f in range(2 if n > 1 else 1, min(hi, max_factor) + 1):
        if n % f:
            continue
        rest = _best_split(n // f, d - 1, max_factor)
        if rest is None or rest[0] < f:
            continue
        cand = (f, *rest)
        if best is None or (max(cand), sum(cand)) < (max(best), sum(best)):
            best = cand
    return best


def factorize(n: int, d: int) -> tuple[int, ...] | None:
    """Split ``n`` into ``d`` factors as evenly as possible (ascending), or None if the
    only splits contain a factor far above ``n ** (1/d)`` (e.g. a large prime factor)."""
    try:  # 12.0 gave (3, 4.0), a float mode every spec then refuses
        n, d = _index(n), _index(d)
    except TypeError:
        raise ConfigError(f"factorize: n and d must be ints, got n={n!r}, d={d!r}") from None
    if n < 1 or d < 1:
        raise ConfigError(f"factorize: need n >= 1 and d >= 1, got n={n}, d={d}")
    if d == 1:
        return (n,)
    # Allow factors up to 2x the ideal size; beyond that a mode dominates the TT cost.
    limit = max(2, math.ceil(2 * n ** (1.0 / d)))
    return _best_split(n, d, limit)


def _prime_factors(n: int) -> list[int]:
    """``n``'s prime factors, ascending, with multiplicity (``[]`` for 1)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            n = n // p
            out.append(p)
        p += 1
    return out + [n] * (n > 1)


def _exact_modes(caller: str, what: str, dim: int, d: int, pad_hint: str) -> tuple[int, ...]:
    """``factorize(dim, d)``, or a :class:`ConfigError` from ``caller`` naming ``what`` and
    why (the primes: too few of them, or one too large) with the way out: a smaller ``d``,
    or ``pad_hint`` where padding would help (a large prime, not a size too small)."""
    modes = factorize(dim, d)
    if modes is None:
        primes = " x ".join(map(str, _prime_factors(dim)))
        way = pad_hint if dim >= 2**d else "pass a smaller d"
        raise ConfigError(
            f"{caller}: {what} = {primes} has no balanced factorization into {d} modes of "
            f"at least 2; {way}"
        )
    return modes


def propose_modes(dim: int, d: int, *, pad: bool = False, max_pad: float = 0.1) -> tuple[int, ...]:
    """Propose ``d`` balanced mode sizes for ``dim`` (ascending).

    Without ``pad`` the product equals ``dim`` exactly and a dim with no balanced
    factorization raises. With ``pad=True`` (vocabularies), the smallest size ``>= dim``
    within ``max_pad`` relative padding whose factorization is most balanced is used:
    30522 becomes e.g. (12, 16, 16, 10)-like splits instead of 2 x 3 x 5087.
    """
    try:  # 100.0 was a TypeError from range(), naming neither argument
        dim, d = _index(dim), _index(d)
    except TypeError:
        raise ConfigError(
            f"propose_modes: dim and d must be ints, got dim={dim!r}, d={d!r}"
        ) from None
    if dim < 1 or d < 1:
        raise ConfigError(f"propose_modes: need dim >= 1 and d >= 1, got dim={dim}, d={d}")
    if not (isinstance(max_pad, numbers.Real) and not isinstance(max_pad, bool)
            and math.isfinite(max_pad) and max_pad >= 0):  # fmt: skip
        raise ConfigError(  # NaN and "0.1" failed inside range() naming neither
            f"propose_modes: max_pad must be a finite number >= 0 (a fraction of dim), "
            f"got {max_pad!r}"
        )
    if not pad:
        # padding helps a large prime, not a size too small to split d ways
        return _exact_modes("propose_modes", str(dim), dim, d, "pass pad=True to pad it to a "
                            "size that factors")  # fmt: skip
    best: tuple[int, ...] | None = None
    best_key: tuple[float, ...] | None = None
    for n in range(dim, int(dim * (1 + max_pad)) + 1):
        modes = factorize(n, d)
        if modes is None:
            continue
        key = (max(modes), sum(modes), n)
        if best_key is None or key < best_key:
            best, best_key = modes, key
    if best is None:  # a size too small to split d ways (7 into 3), or max_pad too tight
        raise ConfigError(
            f"propose_modes: no balanced {d}-factorization within {max_pad:.0%} of {dim}; "
            f"pass a smaller d or a larger max_pad"
        )
    return best


def propose_tt_linear(
    out_features: int, in_features: int, d: int = 3, ranks: int = 30, **kw: object
) -> TTLinearSpec:
    """A :class:`TTLinearSpec` with balanced modes, large modes at the two ends of the train
    (where the bonds are capped by the mode size), as in the paper's [12,8,8 | 8,8,12]."""
    _sizes("propose_tt_linear", out_features=out_features, in_features=in_features, d=d)
    # a linear layer's sizes are its own: padding is for the caller to do (tensorize_ does)
    pad = "pad the layer to a size that factors (comera.tensorize_ does)"
    out_modes = tuple(sorted(_exact_modes("propose_tt_linear", f"out_features={out_features}",
                                          out_features, d, pad), reverse=True))  # fmt: skip
    in_modes = tuple(sorted(_exact_modes("propose_tt_linear", f"in_features={in_features}",
                                         in_features, d, pad)))  # fmt: skip
    return TTLinearSpec(
        out_modes=out_modes,
        in_modes=in_modes,
        ranks=ranks,
        out_features=out_features,
        in_features=in_features,
        **kw,  # type: ignore[arg-type]
    )


def propose_ttm_embedding(
    num_embeddings: int, embedding_dim: int, d: int = 4, ranks: int = 32, **kw: object
) -> TTMEmbeddingSpec:
    """A :class:`TTMEmbeddingSpec` with a padded, balanced vocabulary factorization."""
    _sizes("propose_ttm_embedding", num_embeddings=num_embeddings, embedding_dim=embedding_dim, d=d)
    vocab_modes = tuple(sorted(propose_modes(num_embeddings, d, pad=True), reverse=True))
    dim_modes = tuple(sorted(_exact_modes(
        "propose_ttm_embedding", f"embedding_dim={embedding_dim}", embedding_dim, d,
        "choose a dim that factors (only the vocabulary is padded)")))  # fmt: skip
    return TTMEmbeddingSpec(
        vocab_modes=vocab_modes,
        dim_modes=dim_modes,
        ranks=ranks,
        num_embeddings=num_embeddings,
        embedding_dim=embedding_dim,
        **kw,  # type: ignore[arg-type]
    )
