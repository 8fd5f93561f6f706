"""Loader configuration: sub-datasets, shuffling, packing. Checked when built."""

from __future__ import annotations

import contextlib
import math
import numbers
import os
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loaders.errors import LoaderInputError, LoaderPathError

PLAN_NAME = "prepare_plan.json"  # a loaders.prepare output's root holds it

SHUFFLE_MODES = ("global", "local", "none")
_ID_RANGE = {"int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def is_int(value: object) -> bool:
    """An integer, not a bool, a float or a string (a CLI or YAML may pass any)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_weight(where: str, value: object) -> float:
    """``value`` as a finite weight >= 0, or a :class:`LoaderInputError` naming ``where``."""
    try:  # an int past float's range (10**400) is not finite as a float either
        number = float(value) if isinstance(value, numbers.Real) else math.nan  # type: ignore[arg-type]
    except OverflowError:
        number = math.inf
    if isinstance(value, bool) or not math.isfinite(number) or number < 0:
        raise LoaderInputError(f"{where}: weight must be a finite number >= 0, got {value!r}")
    return number


@dataclass(kw_only=True, slots=True)
class DatasetSpec:
    """One sub-dataset: a folder of pre-tokenized Arrow files, or text with a tokenizer.

    ``path`` may be a folder/file, or (for text) a ``datasets.Dataset``/``pyarrow.Table``.
    ``tokenizer`` set means the data is text in ``text_column``, tokenized on the fly.
    """

    name: str
    path: Any
    weight: float = 1.0
    token_column: str = "tokens"
    text_column: str = "text"
    tokenizer: Any = None

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check the fields (when built, and again when a loader is built from them: a
        dataclass's fields can change after it is made)."""
        # no control characters: the shuffle's keys join the name with other parts by one
        # (\x1f), which inside a name could give two sub-datasets one order; and text the
        # keys can encode (a lone surrogate, from a file name that is not UTF-8, cannot)
        if (not self.name or not isinstance(self.name, str)
                or any(unicodedata.category(c) in ("Cc", "Cs") for c in self.name)):  # fmt: skip
            raise LoaderInputError(
                "DatasetSpec.name must be a non-empty string with no control characters "
                f"(and valid UTF-8 text), got {self.name!r}"
            )
        self.weight = check_weight(f"dataset {self.name!r}", self.weight)
        if self.path is None:
            raise LoaderInputError(
                f"dataset {self.name!r}: path is None; give a folder of token files or, with "
                "a tokenizer, text"
            )
        if isinstance(self.path, str):
            self.path = Path(self.path)
        source = hasattr(self.path, "doc")  # an already built source object
        if self.tokenizer is None and not (isinstance(self.path, os.PathLike) or source):
            raise LoaderInputError(
                f"dataset {self.name!r}: path {self.path!r} ({type(self.path).__name__}) "
                "must be a folder or file of token files (str or Path) when no tokenizer is "
                "given; give DatasetSpec.tokenizer to read text from a Dataset or Table"
            )


# LoaderConfig's integer fields, stored as Python ints whatever integer type was given
INT_FIELDS = ("seq_len", "batch_size", "bos_id", "eos_id", "pad_id", "min_doc_len",
              "num_shards", "seed", "num_epochs")  # fmt: skip


@dataclass(kw_only=True, slots=True)
class LoaderConfig:
    """Everything that decides the token stream.

    ``num_shards`` (L) and ``seed`` and ``shuffle`` fix every document's place and must stay
    the same across resumes; ``seq_len``, ``batch_size``, BOS/EOS and weights may change.
    ``causal=True`` emits rows of ``seq_len + 1`` tokens (inputs and shifted labels).
    ``num_epochs=None`` streams forever; an integer stops after that many passes (the last
    row is padded with ``pad_id`` and segment id 0).
    ``provenance=True`` adds ``doc_ids`` and ``doc_offsets`` (both ``(B, T)`` int64) to every
    batch: ``sub-dataset index * 2**32 + document index`` and the token's offset in its
    document's emitted stream (BOS is offset 0), -1 at padding. They trace every token to
    its source, for audits of exactly-once delivery; they cost two more arrays per batch.
    """

    datasets: list[DatasetSpec]
    seq_len: int = 4096
    batch_size: int = 1
    causal: bool = False
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int = 0
    min_doc_len: int = 1
    num_shards: int = 1024
    seed: int = 0
    shuffle: str = "global"
    num_epochs: int | None = None
    cache_dir: str | Path | None = None
    out_dtype: str = "int64"
    provenance: bool = False

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Check every field, the datasets' included (when built, and again by
        :class:`loaders.TokenLoader`: a field set after building, ``seq_len = 0`` say, was
        taken as it was and streamed empty rows forever)."""
        if not isinstance(self.datasets, (list, tuple, str, bytes, dict)):
            # a generator of specs: checked, then read again below, was read once
            with contextlib.suppress(TypeError):  # not iterable: refused below
                self.datasets = list(self.datasets)
        if not isinstance(self.datasets, (list, tuple)):
            raise LoaderInputError(
                f"LoaderConfig.datasets must be a list of DatasetSpec, got "
                f"{type(self.datasets).__name__}"
            )
        if not self.datasets:
            raise LoaderInputError("LoaderConfig.datasets is empty; give at least one DatasetSpec")
        for i, d in enumerate(self.datasets):
            if not isinstance(d, DatasetSpec):
                raise LoaderInputError(
                    f"LoaderConfig.datasets[{i}] is a {type(d).__name__}, not a DatasetSpec; "
                    "build each as DatasetSpec(name=..., path=...) (a dict d: DatasetSpec(**d))"
                )
            d.check()
        names = [d.name for d in self.datasets]
        if len(set(names)) != len(names):
            raise LoaderInputError(f"LoaderConfig.datasets has duplicate names: {names}")
        if sum(d.weight for d in self.datasets) <= 0:
            raise LoaderInputError(
                "LoaderConfig: all dataset weights are 0; give one a positive weight"
            )
        for key in ("seq_len", "batch_size", "num_shards", "min_doc_len"):
            value = getattr(self, key)
            if not is_int(value) or value < 1:
                raise LoaderInputError(f"LoaderConfig.{key} must be an integer >= 1, got {value!r}")
        if not is_int(self.seed):
            raise LoaderInputError(f"LoaderConfig.seed must be an integer, got {self.seed!r}")
        if self.shuffle not in SHUFFLE_MODES:
            raise LoaderInputError(
                f"LoaderConfig.shuffle={self.shuffle!r}; use one of {SHUFFLE_MODES}"
            )
        if self.num_epochs is not None and (not is_int(self.num_epochs) or self.num_epochs < 1):
            raise LoaderInputError(
                f"LoaderConfig.num_epochs must be an integer >= 1 or None, got {self.num_epochs!r}"
            )
        if self.cache_dir is not None and not isinstance(self.cache_dir, (str, os.PathLike)):
            raise LoaderInputError(
                f"LoaderConfig.cache_dir must be a folder path (str or Path) or None, got "
                f"{self.cache_dir!r}"
            )
        if self.out_dtype not in _ID_RANGE:
            raise LoaderInputError(
                f"LoaderConfig.out_dtype={self.out_dtype!r}; use 'int64' or 'int32'"
            )
        lo, hi = _ID_RANGE[self.out_dtype]
        for key in ("bos_id", "eos_id", "pad_id"):
            value = getattr(self, key)
            if value is None and key != "pad_id":
                continue
            if not is_int(value) or not lo <= value <= hi:
                raise LoaderInputError(
                    f"LoaderConfig.{key} must be an integer that out_dtype={self.out_dtype!r} "
                    f"holds{'' if key == 'pad_id' else ' (or None)'}, got {value!r}"
                )
        for key in ("causal", "provenance"):  # "false" is truthy: rows of seq_len + 1, silently
            if not isinstance(getattr(self, key), bool):
                raise LoaderInputError(
                    f"LoaderConfig.{key} must be True or False, got {getattr(self, key)!r}"
                )
        # plain ints from here on: a numpy integer (accepted above) would reach the
        # loader's state, which is JSON, and fail its first save
        for key in INT_FIELDS:
            value = getattr(self, key)
            if value is not None:
                setattr(self, key, int(value))

    @property
    def row_len(self) -> int:
        """Tokens per emitted row: ``seq_len + 1`` for causal LM, else ``seq_len``."""
        return self.seq_len + 1 if self.causal else self.seq_len

    @property
    def weights(self) -> dict[str, float]:
        return {d.name: float(d.weight) for d in self.datasets}


def datasets_from_root(
    root: str | Path, weights: dict[str, float] | None = None
) -> list[DatasetSpec]:
    """One ``DatasetSpec`` per sub-folder of ``root`` (sorted), weighted by ``weights``.

    A ``loaders.prepare`` output is refused: its sub-folders are its splits, and mixing
    them would train on the held-out one."""
    root = Path(root)
    if not root.is_dir():
        raise LoaderPathError(f"corpus root {root} is not a folder")
    if (root / PLAN_NAME).is_file():
        raise LoaderInputError(
            f"corpus root {root} is a loaders.prepare output: its sub-folders are its splits "
            f"(the held-out one too), not sub-datasets to mix; give {root / 'train'} as one "
            "DatasetSpec, or a root whose sub-folders are prepared train splits"
        )
    names = sorted(p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not names:
        raise LoaderPathError(f"corpus root {root} has no sub-dataset folders")
    weights = dict(weights or {})
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise LoaderInputError(f"weights name unknown sub-datasets {unknown}; folders are {names}")
    return [DatasetSpec(name=n, path=root / n, weight=weights.get(n, 1.0)) for n in names]
