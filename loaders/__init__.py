"""Stateful, rescalable, shuffled, mixed streaming token loader (see loaders/README.md).

The stages, in the order a token passes them:

- ``sources``: memory-mapped Arrow IPC token files and folders of them.
- ``text``: text columns tokenized on the fly; tokenizers from a file, object or the hub.
- ``metadata``: per-file document counts (``doc_counts.json``), atomic writes.
- ``permute``: ``IndexCipher``, the keyed bijection that shuffles without storing an order.
- ``shards``: logical shards, which reader owns which, and their cursors.
- ``mixing``: the deterministic rule picking the next sub-dataset by weight.
- ``packing``: documents laid end to end into fixed-size rows with segment ids.
- ``pipeline``: one (rank, worker) reader from sources through packing, and its state.
- ``loader``: ``TokenLoader``, a rank's iterator, in process or over DataLoader workers.
- ``checkpoint``: one state file per rank, merged back at any world size.
- ``config``: ``LoaderConfig`` and ``DatasetSpec``, checked when built.
- ``prepare``: ``python -m loaders.prepare``, text corpora to Arrow token shards.
- ``errors``: ``LoaderInputError`` and its kinds (``LoaderPathError``, ``EmptyStream``,
  ``MixingShortfall``, ``ReadersWithoutDocuments``), what bad input raises.

The loader never imports ``comera``: it serves any trainer.
"""

from loaders.checkpoint import load_states, save_state, state_path
from loaders.config import DatasetSpec, LoaderConfig, datasets_from_root
from loaders.errors import (
    EmptyStream,
    LoaderInputError,
    LoaderPathError,
    MixingShortfall,
    ReadersWithoutDocuments,
)
from loaders.loader import TokenLoader
from loaders.sources import ArrowTokenFile, TokenFolder
from loaders.text import TextSource, load_tokenizer

__all__ = [
    "ArrowTokenFile",
    "DatasetSpec",
    "EmptyStream",
    "LoaderConfig",
    "LoaderInputError",
    "LoaderPathError",
    "MixingShortfall",
    "ReadersWithoutDocuments",
    "TextSource",
    "TokenFolder",
    "TokenLoader",
    "datasets_from_root",
    "load_states",
    "load_tokenizer",
    "save_state",
    "state_path",
]
