"""Sources: memory-mapped Arrow IPC token files, folders of them, and document counts.

A source is anything with ``num_docs`` and ``doc(i) -> np.ndarray`` (a 1-D integer array,
ideally a zero-copy view). ``ArrowTokenFile`` reads the offsets and values buffers of a
list-of-integer column once and slices documents out of the memory map without copying.
``TokenFolder`` concatenates the files of one sub-dataset (sorted, nested folders allowed);
its per-file document counts come from ``doc_counts.json`` (see ``metadata.py``).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from loaders.errors import LoaderInputError, LoaderPathError
from loaders.metadata import check_prepared, content_digest, file_doc_counts

ARROW_SUFFIXES = (".arrow", ".ipc", ".feather")


def open_arrow_table(path: Path) -> pa.Table:
    """Memory-map an Arrow IPC file (file or stream format) as a zero-copy table (a
    compressed file's buffers are decompressed into memory: :func:`open_arrow_mapped`).

    Shared by token files and text files stored as Arrow (:mod:`loaders.text`)."""
    return open_arrow_mapped(path)[0]


def open_arrow_mapped(path: Path) -> tuple[pa.Table, tuple[int, int]]:
    """:func:`open_arrow_table`, and the address range of its memory map: a buffer inside
    it is a view of the file, one outside was decompressed into memory (a compressed file,
    ``pyarrow.feather``'s default lz4)."""
    try:
        source = pa.memory_map(str(path), "r")
    except (OSError, pa.ArrowException) as exc:
        raise LoaderPathError(f"cannot open Arrow file {path}: {exc}") from exc
    size = source.size()
    base = source.read_buffer(1).address if size else 0
    source.seek(0)
    try:
        try:
            table = pa.ipc.open_file(source).read_all()
        except pa.ArrowInvalid:
            source.seek(0)
            table = pa.ipc.open_stream(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise LoaderInputError(
            f"Arrow file {path} is truncated or corrupt ({exc}); re-write or remove the file"
        ) from exc
    return table, (base, base + size)


def check_links(files: list[Path]) -> None:
    """Refuse a listed file that is a link to nothing (a corpus copied without its link
    targets): counting its documents failed with a bare traceback."""
    for f in files:
        if not f.exists():
            raise LoaderPathError(
                f"{f} is a link to {os.readlink(f)}, which does not exist; restore its target "
                "or remove the link"
            )


def count_arrow_docs(path: Path, column: str = "tokens") -> int:
    """Rows of an Arrow IPC token file (checked: column present, integer lists)."""
    return ArrowTokenFile(path, column).num_docs


class ArrowTokenFile:
    """One Arrow IPC file, one document per row in a list-of-integer column."""

    __slots__ = ("path", "num_docs", "mapped", "_starts", "_chunks")

    def __init__(self, path: str | Path, column: str = "tokens") -> None:
        self.path = Path(path)
        table, (lo, hi) = open_arrow_mapped(self.path)
        if column not in table.column_names:
            raise LoaderInputError(
                f"Arrow file {self.path} has no token column {column!r} "
                f"(columns: {table.column_names}); pass token_column=<one of them>"
            )
        col = table.column(column)
        typ = col.type
        if not (pa.types.is_list(typ) or pa.types.is_large_list(typ)) or not pa.types.is_integer(
            typ.value_type
        ):
            raise LoaderInputError(
                f"column {column!r} of {self.path} has type {typ}; expected a list of integers "
                "(pre-tokenize it, or use a text source with a tokenizer)"
            )
        self.num_docs = table.num_rows
        # False for a compressed file: its tokens were decompressed into memory, not mapped
        self.mapped = all(
            buf is None or buf.size == 0 or lo <= buf.address < hi
            for chunk in col.chunks
            for buf in chunk.values.buffers()[1:2]
        )
        self._starts: list[int] = []  # first row of each chunk
        # (offsets, values, null rows or None): a null row may sit over a non-empty
        # stretch of the values (Arrow allows it), so its offsets alone do not say empty
        self._chunks: list[tuple[np.ndarray, np.ndarray, np.ndarray | None]] = []
        row = 0
        for chunk in col.chunks:
            if len(chunk) == 0:
                continue
            values = chunk.values
            if values.null_count:
                raise LoaderInputError(
                    f"column {column!r} of {self.path} has null tokens; drop or fix those rows"
                )
            offsets = chunk.offsets.to_numpy(zero_copy_only=False)
            self._starts.append(row)
            nulls = chunk.is_null().to_numpy(zero_copy_only=False) if chunk.null_count else None
            self._chunks.append((offsets, values.to_numpy(zero_copy_only=False), nulls))
            row += len(chunk)

    def doc(self, i: int) -> np.ndarray:
        """Tokens of row ``i`` as a view into the memory map (null rows are empty)."""
        c = 0 if len(self._starts) == 1 else bisect.bisect_right(self._starts, i) - 1
        offsets, values, nulls = self._chunks[c]
        j = i - self._starts[c]
        if nulls is not None and nulls[j]:
            return values[:0]
        return values[offsets[j] : offsets[j + 1]]


def tokens_digest(files: Sequence[str | Path], column: str = "tokens") -> str:
    """A digest of the documents of ``files`` in order (32 hex digits): their lengths and
    their tokens as int64, each hashed as one stream, so the same documents split into
    other files (another ``--docs-per-shard``), written by another Arrow version or with
    another integer type digest alike, and any other token or boundary does not."""
    lengths, tokens = hashlib.blake2b(digest_size=16), hashlib.blake2b(digest_size=16)
    for path in files:
        for offsets, values, nulls in ArrowTokenFile(path, column)._chunks:
            sizes = np.diff(offsets).astype(np.int64)
            span = values[offsets[0] : offsets[-1]]
            if nulls is not None:  # a null row is empty, whatever stretch it sits over
                span = span[np.repeat(~nulls, sizes)]
                sizes[nulls] = 0
            lengths.update(sizes.tobytes())
            tokens.update(np.ascontiguousarray(span, dtype=np.int64).tobytes())
    return hashlib.blake2b(lengths.digest() + tokens.digest(), digest_size=16).hexdigest()


# token files a TokenFolder keeps open. Each holds a memory map (not a file descriptor),
# and the kernel allows a process about 65,000 (vm.max_map_count), shared by every folder
# (each DataLoader worker has its own) and torch's own: 2048 per folder leaves room for
# about 30 large sub-datasets. Under a global shuffle every file is read in turn, so a
# folder of more files than are kept open re-opens one for nearly every document (600
# files read 6x slower at 128 open than with all open)
MAX_OPEN_FILES = 2048
# compressed files (pyarrow.feather's lz4 default) are decompressed into memory on open,
# not mapped: at most this many of them are kept, as before the cap above was raised
MAX_OPEN_UNMAPPED = 128


class TokenFolder:
    """All Arrow IPC token files under a folder (recursively, sorted), as one source.

    At most ``max_open_files`` files are open at once (default :data:`MAX_OPEN_FILES`), of
    them at most :data:`MAX_OPEN_UNMAPPED` compressed ones, the least recently read closed
    first."""

    def __init__(
        self,
        path: str | Path,
        *,
        token_column: str = "tokens",
        cache_dir: str | Path | None = None,
        max_open_files: int | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.is_file():
            if self.path.suffix in (".parquet", ".jsonl", ".json"):  # "corrupt Arrow" misleads
                raise LoaderInputError(
                    f"{self.path} is a {self.path.suffix} file, not an Arrow IPC token file "
                    f"({', '.join(ARROW_SUFFIXES)}), which a dataset without a tokenizer "
                    "reads: for text give its DatasetSpec a tokenizer (or tokenize it with "
                    "python -m loaders.prepare); write token ids as Arrow IPC"
                )
            files = [self.path]
            root = self.path.parent
        elif self.path.is_dir():
            files = sorted(p for p in self.path.rglob("*") if p.suffix in ARROW_SUFFIXES)
            check_links(files)
            root = self.path
        else:
            raise LoaderPathError(f"data path {self.path} does not exist; check the dataset path")
        if not files:
            raise LoaderPathError(
                f"folder {self.path} holds no Arrow files ({', '.join(ARROW_SUFFIXES)}); "
                "point the dataset at a folder of pre-tokenized Arrow IPC files"
            )
        if self.path.is_dir():
            check_prepared(self.path, files)
        self.column = token_column
        self.files = files
        counts = file_doc_counts(
            root, files, lambda p: count_arrow_docs(p, token_column), cache_dir=cache_dir
        )
        # the folder's content as loaders.prepare recorded it (None: not recorded)
        self.content = content_digest(root, files)
        self._cum = [0]
        for n in counts:
            self._cum.append(self._cum[-1] + n)
        self.num_docs = self._cum[-1]
        self._open: OrderedDict[int, ArrowTokenFile] = OrderedDict()
        self._max_open = max(1, MAX_OPEN_FILES if max_open_files is None else max_open_files)
        self._unmapped: OrderedDict[int, None] = OrderedDict()  # the compressed ones open
        self._said_unmapped = False
        self._file(0)  # fail now, not mid-run, on a wrong column or type

    def _file(self, k: int) -> ArrowTokenFile:
        f = self._open.get(k)
        if f is None:
            f = ArrowTokenFile(self.files[k], self.column)
            expected = self._cum[k + 1] - self._cum[k]
            if f.num_docs != expected:
                raise LoaderInputError(
                    f"{f.path} has {f.num_docs} rows but the doc-count metadata says {expected}; "
                    "delete the stale doc_counts.json (or cache entry) and restart"
                )
            self._open[k] = f
            if not f.mapped:  # its tokens in memory: fewer of them kept
                self._unmapped[k] = None
                if len(self._unmapped) > min(self._max_open, MAX_OPEN_UNMAPPED):
                    self._open.pop(self._unmapped.popitem(last=False)[0])
            if len(self._open) > self._max_open:
                self._unmapped.pop(self._open.popitem(last=False)[0], None)
            if not f.mapped and not self._said_unmapped:
                self._said_unmapped = True
                warnings.warn(
                    f"{f.path} is compressed (pyarrow.feather writes lz4 by default): each "
                    "open decompresses the whole file into memory instead of mapping it, "
                    f"for every compressed file of {self.path}; rewrite them uncompressed "
                    "(write_feather(..., compression='uncompressed')) or prepare the corpus "
                    "with python -m loaders.prepare",
                    stacklevel=2,
                )
        else:
            self._open.move_to_end(k)
            if k in self._unmapped:
                self._unmapped.move_to_end(k)
        return f

    def doc(self, i: int) -> np.ndarray:
        """Tokens of document ``i`` of the folder (files concatenated in sorted order)."""
        k = bisect.bisect_right(self._cum, i) - 1
        return self._file(k).doc(i - self._cum[k])
