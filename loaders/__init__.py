"""Stateful, rescalable, shuffled, mixed streaming token loader (see loaders/README.md)."""

from loaders.checkpoint import load_states, merge_states, save_state, state_path
from loaders.config import DatasetSpec, LoaderConfig, datasets_from_root
from loaders.loader import TokenLoader, resolve_rank_world
from loaders.mixing import Mixer
from loaders.packing import write_piece
from loaders.permute import IndexCipher, derive_key
from loaders.pipeline import Layout, ReaderPipeline, open_source
from loaders.shards import ShardCursors, logical_shard_of, owned_shards, shard_bounds
from loaders.sources import ArrowTokenFile, TokenFolder
from loaders.text import TextSource, load_tokenizer

__all__ = [
    "ArrowTokenFile",
    "DatasetSpec",
    "IndexCipher",
    "Layout",
    "LoaderConfig",
    "Mixer",
    "ReaderPipeline",
    "ShardCursors",
    "TextSource",
    "TokenFolder",
    "TokenLoader",
    "datasets_from_root",
    "derive_key",
    "load_states",
    "load_tokenizer",
    "logical_shard_of",
    "merge_states",
    "open_source",
    "owned_shards",
    "resolve_rank_world",
    "save_state",
    "shard_bounds",
    "state_path",
    "write_piece",
]
