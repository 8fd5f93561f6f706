"""Criteo Kaggle display-ads data: raw TSV -> a cached, memory-mapped, preprocessed table.

Input: ``train.txt`` as Criteo ships it: tab-separated, no header, 40 fields per line:
``label`` (0/1), ``I1..I13`` (integers, may be empty or negative), ``C1..C26`` (hex hashes
of up to 8 digits, may be empty).

Preprocessing, as the facebookresearch/dlrm reference does it:

- dense: ``max(x, 0)``, then ``log(1 + x)``; missing -> 0;
- categorical: an empty field is hash 0 (as the reference parses it); each column's hashes
  map to contiguous ids, by default in order of descending frequency (ties by hash):
  deterministic, independent of row order, and, like the reference's numbering by first
  occurrence, giving frequent values small ids, which lets a TTM's leading cores
  specialize on the head of the distribution (``id_order="hash"``: ascending hash order).
  With ``min_count > 1`` values seen fewer times share id 0; with ``max_ind_range > 0``
  hashes are first taken modulo it (the reference's ``--max-ind-range``), so no table
  has more rows than that, and none more than its distinct values;
- split by line count into ``days`` (7) equal days: the first 6 train, the 7th is halved,
  first half test, second half validation (the reference's split).

Two passes, bounded memory: pass 1 streams the text once through pyarrow's CSV reader
(C++, multi-threaded) into raw binary columns; pass 2 builds each column's vocabulary
from its binary column (one column in memory at a time). The result is cached under a
fingerprint of the file (size and sampled content) and the settings: built in a
temporary folder, renamed into place when complete, so a crash never leaves a cache
that is half used. Bad input is reported with file, line number and field.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
import shlex
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from comera.errors import ConfigError, DataError, MissingFileError, UserError
from experiments.cache import cache_root
from experiments.cursor import full_digest, sample_digest
from experiments.notes import note

__all__ = [
    "CAT_COLUMNS",
    "DENSE_COLUMNS",
    "CriteoData",
    "CriteoDataConfig",
    "CriteoFormatError",
    "load_criteo",
]

DENSE_COLUMNS = tuple(f"I{i}" for i in range(1, 14))
CAT_COLUMNS = tuple(f"C{i}" for i in range(1, 27))
COLUMNS = ("label", *DENSE_COLUMNS, *CAT_COLUMNS)
CACHE_VERSION = 1
# the generator draws the whole file in memory (about 800 bytes a row at its peak) and
# writes about 10,000 rows a second: 10M rows is 8 GB and a quarter of an hour
GENERATED_MAX_ROWS = 10_000_000
_HEX = np.full(256, 255, dtype=np.uint8)
for _i, _c in enumerate(b"0123456789abcdef"):
    _HEX[_c] = _i
for _i, _c in enumerate(b"ABCDEF"):
    _HEX[_c] = 10 + _i


class CriteoFormatError(DataError):
    """The file is not in Criteo's format; the message names file, line and field."""


@dataclass(kw_only=True, slots=True)
class CriteoDataConfig:
    """Where the data is and how to preprocess it.

    ``path``: a Criteo-format file, or ``"generated"`` for the planted-signal file
    (:mod:`experiments.dlrm.generate`, ``generated_rows`` rows, written into the cache).
    ``cache_dir``: where preprocessed tables live (default ``$COMERA_CACHE/criteo``, or
    ``~/.cache/comera/criteo``). ``eval_rows``: cap on the rows scored per evaluation
    (None: the whole split)."""

    path: str = "generated"
    cache_dir: str | None = None
    max_ind_range: int = 0
    min_count: int = 1
    days: int = 7
    id_order: str = "frequency"
    generated_rows: int = 120_000
    eval_rows: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.max_ind_range < 2**32 or self.min_count < 1 or self.days < 2:
            raise ConfigError(
                f"CriteoDataConfig: need 0 <= max_ind_range < 2**32 (ids are uint32), "
                f"min_count >= 1, days >= 2; got {self.max_ind_range}, {self.min_count}, "
                f"{self.days} (--max-ind-range, --set data.*)"
            )
        if self.cache_dir == "":  # --set data.cache_dir= with nothing after it
            raise ConfigError(
                "data.cache_dir is empty; give a folder for the preprocessed data, or leave it "
                "unset for the default ($COMERA_CACHE/criteo or ~/.cache/comera/criteo)"
            )
        if self.id_order not in ("frequency", "hash"):
            raise ConfigError(f"data.id_order={self.id_order!r}; choose 'frequency' or 'hash'")
        if self.path == "generated" and not 100 <= self.generated_rows <= GENERATED_MAX_ROWS:
            raise ConfigError(
                f"data.generated_rows={self.generated_rows} must be between 100 and "
                f"{GENERATED_MAX_ROWS:,} (the generator draws the file in memory, about 800 "
                "bytes a row); for more rows pass a real Criteo file with --data PATH"
            )
        if self.path == "generated" and self.generated_rows < 2 * self.days:
            # found by the preprocessing otherwise, and blamed on the generated file
            raise ConfigError(
                f"data.generated_rows={self.generated_rows} cannot be split into data.days="
                f"{self.days} days; need at least {2 * self.days}: raise data.generated_rows "
                "or lower data.days"
            )
        if self.eval_rows is not None and self.eval_rows < 1:
            raise ConfigError(f"data.eval_rows={self.eval_rows} must be None or >= 1")


# --------------------------------------------------------------------------- validation


# what the fast reader (pyarrow) takes as an integer: ASCII decimal, or hex as a 64-bit
# pattern (0x... at most 2**64 - 1, read two's complement), spaces around it skipped
_INTEGER = re.compile(r" *(?:(-?[0-9]+)|0[xX]([0-9a-fA-F]+)) *")


def _integer(text: str) -> int | None:
    """``text`` as the fast reader reads an int64 field, or None where it fails."""
    m = _INTEGER.fullmatch(text)
    if m is None:
        return None
    if m.group(1) is not None:
        value = int(m.group(1))
        return value if -(2**63) <= value < 2**63 else None
    value = int(m.group(2), 16)
    return None if value >= 2**64 else value - 2**64 if value >= 2**63 else value


def _shown(value: str) -> str:
    """A field as an error quotes it: at most 40 characters (a binary file's "line" can
    be kilobytes of one field)."""
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value):,} characters)"


def check_line(line: str, path: str | Path, lineno: int) -> None:
    """Raise :class:`CriteoFormatError` naming the first bad field of one line."""
    fields = line.rstrip("\n").rstrip("\r").split("\t")
    where = f"{path}, line {lineno}"
    if fields == [""]:  # "got 1 field; is this a Criteo train.txt?" hid a blank line
        raise CriteoFormatError(
            f"{where} is blank; a Criteo file has one row per line (remove the blank line)"
        )
    if len(fields) != 40:
        raise CriteoFormatError(
            f"{where}: expected 40 tab-separated fields (label, I1..I13, C1..C26), got "
            f"{len(fields)}; is this a Criteo Kaggle train.txt?"
        )
    # as the fast reader reads it: spaces around it, "01", "-0", "0x1"
    if _integer(fields[0]) not in (0, 1):
        raise CriteoFormatError(f"{where}, field label: expected 0 or 1, got {_shown(fields[0])}")
    for name, value in zip(DENSE_COLUMNS, fields[1:14], strict=True):
        if value:
            # as the fast reader reads it (:func:`_integer`): Python's int() also takes
            # "+5", "1_000" and other scripts' digits, which the fast reader refuses, so a
            # bad line it meets deep in the file would not be found again here to be named
            if _integer(value) is None:
                raise CriteoFormatError(
                    f"{where}, field {name}: expected a 64-bit integer or nothing, got "
                    f"{_shown(value)}"
                )
    for name, value in zip(CAT_COLUMNS, fields[14:], strict=True):
        if len(value) > 8 or any(c not in "0123456789abcdefABCDEF" for c in value):
            raise CriteoFormatError(
                f"{where}, field {name}: expected a hex hash of up to 8 digits, got {_shown(value)}"
            )


# what a compressed file starts with: its kind and the tool that undoes it
_COMPRESSED = (  # magic bytes, the format, its decompressor and usual suffix
    (b"\x1f\x8b", "gzip", "gunzip", ".gz"),
    (b"BZh", "bzip2", "bunzip2", ".bz2"),
    (b"\xfd7zXZ\x00", "xz", "unxz", ".xz"),
    (b"\x28\xb5\x2f\xfd", "zstd", "unzstd", ".zst"),
)


# a Criteo line is under a kilobyte: a first "line" longer than this is not Criteo, and is
# not read whole to find that out (a file without newlines would be, gigabytes of it)
_MAX_LINE = 1 << 16


def _tar_error(path: Path, kind: str) -> CriteoFormatError:
    """A tar archive (Kaggle's download is ``dac.tar.gz``): extract it, pass what is in it."""
    src, dst = shlex.quote(str(path)), shlex.quote(str(path.parent))
    flag = "-xzf" if kind == "gzip" else "-xf"
    return CriteoFormatError(
        f"{path} is a {kind + '-compressed ' if kind else ''}tar archive; extract it "
        f"(tar {flag} {src} -C {dst}) and pass the Criteo file inside (train.txt, for "
        "Kaggle's dac.tar.gz) with --data PATH"
    )


def _inner_head(path: Path, kind: str) -> bytes:
    """The first 512 decompressed bytes where the standard library reads ``kind``."""
    import bz2
    import gzip
    import lzma

    opener = {"gzip": gzip.open, "bzip2": bz2.open, "xz": lzma.open}.get(kind)
    if opener is None:
        return b""
    try:
        with opener(path, "rb") as f:
            return f.read(512)
    except (OSError, EOFError, lzma.LZMAError):
        return b""


def _is_tar(head: bytes) -> bool:
    return head[257:262] == b"ustar"


def check_head(path: Path, lines: int = 50) -> None:
    """Validate the first lines before any heavy work: a non-Criteo file fails here, a
    compressed one (read as it is, whatever its name) with what decompresses it, a tar
    archive with how to extract it."""
    with open(path, "rb") as f:
        magic = f.read(512)
    if _is_tar(magic):
        raise _tar_error(path, "")
    for prefix, kind, tool, suffix in _COMPRESSED:
        if magic.startswith(prefix):
            if _is_tar(_inner_head(path, kind)) or path.name.endswith((".tgz", ".tar" + suffix)):
                raise _tar_error(path, kind)
            # "gunzip F" refuses a name without the usual suffix: -c writes any name out
            name = path.name
            plain = path.with_name(name[: -len(suffix)] if name.endswith(suffix) and name != suffix
                                   else f"{path.stem}-plain{path.suffix or '.txt'}")  # fmt: skip
            n, first = 1, plain
            while plain.exists():  # the suggested "> FILE" must not overwrite a file there
                n += 1
                base = first.stem[: -len("-plain")] if first.stem.endswith("-plain") else first.stem
                plain = first.with_name(f"{base}-plain{n}{first.suffix or '.txt'}")
            src, dst = shlex.quote(str(path)), shlex.quote(str(plain))
            raise CriteoFormatError(
                f"{path} is {kind}-compressed; decompress it first ({tool} -c {src} > {dst}) "
                f"and pass the plain text file with --data {dst}"
            )
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        n = 0
        while n < lines:
            line = f.readline(_MAX_LINE + 1)
            if not line:
                break
            n += 1
            if len(line) > _MAX_LINE:
                raise CriteoFormatError(
                    f"{path}, line {n} is longer than {_MAX_LINE:,} characters; is this a "
                    "Criteo Kaggle train.txt (one row of 40 tab-separated fields per line)?"
                )
            check_line(line, path, n)
    if n == 0:
        raise CriteoFormatError(f"{path}: the file is empty")


def check_end(path: Path) -> None:
    """A note on stderr when the file does not end with a newline: a copy cut short inside
    its last field still parses (a hash of fewer digits), so the last row may be wrong.
    Not refused: a complete file written without a final newline reads correctly."""
    with open(path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
    if last not in (b"\n", b"\r"):  # a file of CR line ends reads as lines too
        note(
            f"Criteo file {path} does not end with a newline, so its last line may be cut "
            "short (a truncated copy?); it is read as it stands: check the file's end"
        )


def _read_error(path: Path, e: OSError) -> CriteoFormatError:
    """An error reading the source file (not writing the cache), naming ``--data``."""
    return CriteoFormatError(
        f"cannot read Criteo file {path}: {e.strerror or e}; pass a readable, uncompressed "
        "Criteo-format text file with --data PATH"
    )


def _locate_error(path: Path, start_row: int, detail: str) -> CriteoFormatError:
    """The fast reader failed somewhere at or after ``start_row``: find the line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for n, line in enumerate(f, 1):
                if n > start_row:
                    try:
                        check_line(line, path, n)
                    except CriteoFormatError as e:
                        return e
    except OSError as e:
        return _read_error(path, e)
    return CriteoFormatError(f"{path}: unreadable after row {start_row}: {detail}")


# --------------------------------------------------------------------------- pass 1


def _hex_to_u32(col: object) -> np.ndarray:
    """A pyarrow string column of hex hashes (empty = 0) -> uint32; 255 marks bad digits."""
    import pyarrow.compute as pc

    padded = pc.utf8_lpad(pc.fill_null(col, ""), 8, "0")
    if pc.max(pc.utf8_length(padded)).as_py() not in (8, None):
        raise ValueError("a hash longer than 8 digits")
    arr = padded.combine_chunks() if hasattr(padded, "combine_chunks") else padded
    n = len(arr)
    if n == 0:
        return np.zeros(0, dtype=np.uint32)
    start = arr.offset * 8
    raw = np.frombuffer(arr.buffers()[2], dtype=np.uint8)[start : start + 8 * n].reshape(n, 8)
    nib = _HEX[raw]
    if (nib == 255).any():
        raise ValueError("a non-hex digit")
    out = np.zeros(n, dtype=np.uint32)
    for k in range(8):
        out = (out << np.uint32(4)) | nib[:, k].astype(np.uint32)
    return out


def _read_raw(path: Path, out: Path, progress: bool) -> int:
    """Pass 1: text -> ``label.u8``, ``dense.f32`` (N, 13) and one ``hash.C<j>.u32`` (N,)
    per categorical column, so pass 2 reads each column as one contiguous run."""
    import pyarrow as pa

    types = {"label": pa.int8(), **dict.fromkeys(DENSE_COLUMNS, pa.int64())}
    types |= dict.fromkeys(CAT_COLUMNS, pa.string())
    try:
        # a file object, not the name: given a name pyarrow decompresses by its extension,
        # and a plain text file named *.gz would not read
        source = pa.OSFile(str(path), "r")
    except OSError as e:
        raise _read_error(path, e) from None
    with source:
        return _read_blocks(path, source, out, types, progress)


def _read_blocks(path: Path, source: object, out: Path, types: dict, progress: bool) -> int:
    """:func:`_read_raw`'s loop over ``source``, the open file: an error reading it names
    the file (``--data``), one writing ``out`` stays an ``OSError`` (the cache's)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    from tqdm.auto import tqdm

    try:  # the first block is read (and converted) on opening
        reader = pcsv.open_csv(
            source,
            # 4 MB blocks: the reader keeps a fixed number of blocks ahead, so its pool
            # peaks near 180 MB (16 MB blocks: about 700 MB) and it runs no slower
            read_options=pcsv.ReadOptions(column_names=list(COLUMNS), block_size=4 << 20),
            # a blank line is not Criteo: fail on it (at its line) rather than skip it
            parse_options=pcsv.ParseOptions(
                delimiter="\t", quote_char=False, ignore_empty_lines=False
            ),
            convert_options=pcsv.ConvertOptions(
                column_types=types, null_values=[""], strings_can_be_null=False
            ),
        )
    except pa.ArrowInvalid as e:
        raise _locate_error(path, 0, str(e).splitlines()[0]) from None
    except OSError as e:
        raise _read_error(path, e) from None
    rows = 0
    bar = tqdm(
        desc=f"criteo pass 1/2 {path.name}",
        unit="rows",
        unit_scale=True,
        disable=not progress,
        mininterval=1.0,
    )
    with (
        open(out / "label.u8", "wb") as f_label,
        open(out / "dense.f32", "wb") as f_dense,
        contextlib.ExitStack() as stack,
    ):
        f_hash = [stack.enter_context(open(_hash_file(out, j), "wb")) for j in range(26)]
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as e:
                raise _locate_error(path, rows, str(e).splitlines()[0]) from None
            except OSError as e:
                raise _read_error(path, e) from None
            n = batch.num_rows
            try:
                label = batch.column(0).to_numpy(zero_copy_only=False)
                if ((label != 0) & (label != 1)).any():
                    raise ValueError("a label other than 0/1")
                dense = np.empty((n, 13), dtype=np.float32)
                for j in range(13):
                    col = batch.column(1 + j).fill_null(0).to_numpy().astype(np.float64)
                    dense[:, j] = np.log1p(np.maximum(col, 0.0))
                hashes = [_hex_to_u32(batch.column(14 + j)) for j in range(26)]
            except ValueError as e:
                raise _locate_error(path, rows, str(e)) from None
            f_label.write(label.astype(np.uint8).tobytes())
            f_dense.write(dense.tobytes())
            for f, h in zip(f_hash, hashes, strict=True):
                f.write(h.tobytes())
            rows += n
            bar.update(n)
    bar.close()
    return rows


# --------------------------------------------------------------------------- pass 2


_ID_CHUNK = 1 << 20  # rows per vocabulary lookup in pass 2 (8 MB of positions)


def _build_ids(out: Path, rows: int, cfg: CriteoDataConfig, progress: bool) -> list[int]:
    """Pass 2: per column, hashes -> contiguous ids (``cat.i32``); returns cardinalities."""
    from tqdm.auto import tqdm

    ids = np.memmap(out / "cat.i32", dtype=np.int32, mode="w+", shape=(rows, 26))
    cards = []
    for j in tqdm(range(26), desc="criteo pass 2/2 vocabularies", disable=not progress):
        col = np.fromfile(_hash_file(out, j), dtype=np.uint32)
        if len(col) != rows:
            raise CriteoFormatError(f"{_hash_file(out, j)}: {len(col)} rows, expected {rows}")
        if cfg.max_ind_range:  # the reference: hash modulo the range, then its vocabulary
            col %= np.uint32(cfg.max_ind_range)
        # no return_inverse: its int64 sort order and inverse would cost 16 bytes a row
        # (about 0.7 GB a column at Kaggle's 45.8M rows); a chunked search costs a chunk
        uniq, counts = np.unique(col, return_counts=True)
        if cfg.id_order == "frequency":  # most frequent first; ties by hash (deterministic)
            rank = np.empty(len(uniq), dtype=np.int32)
            rank[np.argsort(-counts, kind="stable")] = np.arange(len(uniq))
        else:
            rank = np.arange(len(uniq), dtype=np.int32)
        if cfg.min_count > 1:  # rare values share id 0; kept ones are 1..K in order
            keep = counts >= cfg.min_count
            kept_rank = np.where(keep, rank, len(uniq))
            order = np.argsort(kept_rank, kind="stable")
            rank = np.zeros(len(uniq), dtype=np.int32)
            rank[order[: int(keep.sum())]] = np.arange(1, int(keep.sum()) + 1)
            cards.append(int(keep.sum()) + 1)
        else:
            cards.append(len(uniq))
        for start in range(0, rows, _ID_CHUNK):
            part = col[start : start + _ID_CHUNK]
            ids[start : start + len(part), j] = rank[np.searchsorted(uniq, part)]
        _hash_file(out, j).unlink()  # the column is read: its file is not needed again
    ids.flush()
    return cards


def _hash_file(out: Path, j: int) -> Path:
    return out / f"hash.C{j + 1}.u32"


def _splits(rows: int, days: int) -> dict[str, tuple[int, int]]:
    """The reference's split by line count: days-1 train days, the last halved."""
    per, extra = divmod(rows, days)
    ends = np.cumsum([per + (1 if d < extra else 0) for d in range(days)])
    train_end = int(ends[-2])
    test_end = train_end + (rows - train_end + 1) // 2  # np.array_split: first half larger
    return {"train": (0, train_end), "test": (train_end, test_end), "val": (test_end, rows)}


# --------------------------------------------------------------------------- cache


def fingerprint(path: Path, cfg: CriteoDataConfig) -> str:
    """Size, modification time, head, tail and 16 evenly spaced samples of the file, plus
    the settings: a changed file or setting gets a new cache without reading 11 GB (a
    copied file with a new modification time is preprocessed again, the safe side)."""
    h = hashlib.blake2b(digest_size=16)
    st = path.stat()
    size = st.st_size
    h.update(f"{st.st_mtime_ns}".encode())  # an edit in unsampled bytes still changes it
    settings = f"{cfg.max_ind_range}|{cfg.min_count}|{cfg.days}|{cfg.id_order}"
    h.update(f"{CACHE_VERSION}|{size}|{settings}".encode())
    with open(path, "rb") as f:
        for pos in [0, max(0, size - (1 << 20))] + [size * k // 17 for k in range(1, 17)]:
            f.seek(pos)
            h.update(f.read(1 << 20 if pos in (0, max(0, size - (1 << 20))) else 1 << 16))
    return h.hexdigest()


def _meta_digest(meta: dict) -> str:
    """A digest of ``meta.json``'s other fields: an edit that leaves it valid JSON (rows,
    vocabulary sizes, splits) no longer matches it."""
    rest = {k: v for k, v in meta.items() if k != "meta_digest"}
    return hashlib.blake2b(json.dumps(rest, sort_keys=True).encode(), digest_size=16).hexdigest()


@dataclass
class CriteoData:
    """A preprocessed Criteo table: memory-mapped columns and the split boundaries."""

    root: Path
    label: np.ndarray  # (N,) uint8
    dense: np.ndarray  # (N, 13) float32, log(1 + max(x, 0))
    cat: np.ndarray  # (N, 26) int32, contiguous ids per column
    cardinalities: list[int]
    splits: dict[str, tuple[int, int]]
    meta: dict

    def __len__(self) -> int:
        return len(self.label)

    def identity(self) -> str:
        """A digest of the table's whole content (its vocabularies, splits and every row,
        taken when the cache was built), not of where it lies: a resume checks it, so a
        checkpoint's tables are never read with ids from a file that changed, while a
        moved or copied file still resumes. A cache built before the full digest has the
        sampled one (:meth:`sampled_identity`)."""
        return self.meta.get("content_digest") or self.sampled_identity()

    def sampled_identity(self) -> str:
        """The digest of the vocabularies and 4,096 evenly spaced rows: the identity of a
        cache built before the full digest, and what checkpoints saved then hold."""
        header = [self.cardinalities, len(self), self.splits]
        return sample_digest(header, [self.label, self.dense, self.cat])


def _check_meta(root: Path, meta: dict) -> None:
    """Raise ``ValueError`` where ``meta.json`` does not describe the files beside it: rows
    against the files' sizes, the splits against the rows, the vocabulary sizes against the
    ids (its digest where it has one, else a scan of the ids)."""
    rows, cards, days = meta["rows"], meta["cardinalities"], meta["settings"]["days"]
    if type(rows) is not int or rows < 1:
        raise ValueError(f"rows={rows!r} is not a positive integer")
    for name, width in (("label.u8", 1), ("dense.f32", 13 * 4), ("cat.i32", 26 * 4)):
        size = (root / name).stat().st_size
        if size != rows * width:
            raise ValueError(f"{name} holds {size} bytes, {rows} rows need {rows * width}")
    if not isinstance(cards, list) or len(cards) != 26:
        raise ValueError(f"cardinalities is not a list of 26 sizes: {cards!r}")
    for j, c in enumerate(cards):
        if type(c) is not int or c < 1:
            raise ValueError(f"cardinality of C{j + 1} is {c!r}, not a positive integer")
    if type(days) is not int or days < 2 or rows < 2 * days:
        raise ValueError(f"settings.days={days!r} cannot split {rows} rows")
    splits = {k: list(v) for k, v in meta["splits"].items()}
    want = {k: list(v) for k, v in _splits(rows, days).items()}
    if splits != want:
        raise ValueError(f"splits={meta['splits']!r}, but {rows} rows in {days} days are {want}")
    if "meta_digest" in meta:
        if meta["meta_digest"] != _meta_digest(meta):
            raise ValueError("its fields do not match its meta_digest (edited?)")
        return
    # built before meta_digest: every id must fall inside its table
    cat = np.memmap(root / "cat.i32", dtype=np.int32, mode="r", shape=(rows, 26))
    top = np.full(26, -1, dtype=np.int64)
    low = np.zeros(26, dtype=np.int64)
    for start in range(0, rows, _ID_CHUNK):
        part = cat[start : start + _ID_CHUNK]
        top = np.maximum(top, part.max(axis=0))
        low = np.minimum(low, part.min(axis=0))
    bad = [j for j in range(26) if top[j] >= cards[j] or low[j] < 0]
    if bad:
        j = bad[0]
        raise ValueError(f"C{j + 1} has ids {low[j]}..{top[j]}, outside its cardinality {cards[j]}")


def _open(root: Path) -> CriteoData:
    """The finished cache in ``root``; a damaged one is a :class:`DataError` that names it
    (nothing is deleted: the user decides)."""
    try:
        meta = json.loads((root / "meta.json").read_text())
        _check_meta(root, meta)
        n = meta["rows"]
        return CriteoData(
            root=root,
            label=np.memmap(root / "label.u8", dtype=np.uint8, mode="r", shape=(n,)),
            dense=np.memmap(root / "dense.f32", dtype=np.float32, mode="r", shape=(n, 13)),
            cat=np.memmap(root / "cat.i32", dtype=np.int32, mode="r", shape=(n, 26)),
            cardinalities=list(meta["cardinalities"]),
            splits={k: tuple(v) for k, v in meta["splits"].items()},
            meta=meta,
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise DataError(
            f"the Criteo cache {root} is damaged ({type(e).__name__}: {e}); delete that "
            "folder to rebuild it, or point --cache-dir (data.cache_dir) elsewhere"
        ) from None


def _remove_stale(parent: Path, pattern: str) -> None:
    """Delete what ``pattern`` (``...tmp-<pid>``) matches in ``parent`` where that process
    is gone: folders of killed builds (gigabytes for the Kaggle file), files of killed
    generations. A live process's are left alone."""
    for tmp in parent.glob(pattern):
        pid = tmp.name.rpartition("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            if tmp.is_dir() and not tmp.is_symlink():
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    tmp.unlink()
        except PermissionError:  # alive, another user's
            pass


def preprocess(path: Path, cfg: CriteoDataConfig, *, progress: bool = True) -> CriteoData:
    """The cached table for ``path`` under ``cfg``'s settings, built if missing."""
    if not path.is_file():
        raise MissingFileError(
            f"Criteo file {path} does not exist or is not a file; pass a Criteo-format "
            "train.txt with --data PATH"
        )
    try:
        check_head(path)
        check_end(path)
        fp = fingerprint(path, cfg)
    except OSError as e:
        raise _read_error(path, e) from None
    root = cache_root("criteo", cfg.cache_dir) / fp
    if (root / "meta.json").is_file():
        return _open(root)
    if root.exists():  # no meta.json: never completed; rebuild
        shutil.rmtree(root)
    _remove_stale(root.parent, f"{fp}.tmp-*")
    tmp = root.with_name(f"{fp}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        t0 = time.perf_counter()
        rows = _read_raw(path, tmp, progress)
        if rows < cfg.days * 2:
            raise CriteoFormatError(
                f"{path}: {rows} rows cannot be split into {cfg.days} days; need at least "
                f"{cfg.days * 2}: lower data.days (--set data.days=N) or pass a larger file "
                "with --data"
            )
        cards = _build_ids(tmp, rows, cfg, progress)
        splits = _splits(rows, cfg.days)
        label = np.memmap(tmp / "label.u8", dtype=np.uint8, mode="r", shape=(rows,))
        dense = np.memmap(tmp / "dense.f32", dtype=np.float32, mode="r", shape=(rows, 13))
        cat = np.memmap(tmp / "cat.i32", dtype=np.int32, mode="r", shape=(rows, 26))
        meta = {
            "format": "comera.criteo",
            "version": CACHE_VERSION,
            "source": str(path.resolve()),
            "fingerprint": fp,
            "rows": rows,
            "cardinalities": cards,
            "splits": splits,
            "base_rate": float(label.mean(dtype=np.float64)),
            "settings": {
                "max_ind_range": cfg.max_ind_range,
                "min_count": cfg.min_count,
                "days": cfg.days,
                "id_order": cfg.id_order,
            },
            # what a resume checks (CriteoData.identity): every row, not where they lie
            # (every byte of the table: 157 a row, seconds for Kaggle's 45.8M rows)
            "content_digest": full_digest([cards, rows, splits], [label, dense, cat]),
            "seconds": round(time.perf_counter() - t0, 2),
        }
        del label, dense, cat
        meta["meta_digest"] = _meta_digest(meta)
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        try:
            tmp.rename(root)
        except OSError:  # another process finished the same cache first
            if not (root / "meta.json").is_file():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return _open(root)


def load_criteo(cfg: CriteoDataConfig, *, progress: bool = True) -> CriteoData:
    """The preprocessed data ``cfg`` names: a Criteo file, or the generated one. A cache
    that cannot be written (not a folder, no room, no permission) is one
    :class:`~comera.errors.DataError` naming ``--cache-dir``; a source file that cannot be
    read is a :class:`CriteoFormatError` naming it (``--data``)."""
    try:
        return _load(cfg, progress)
    except UserError:
        raise
    except OSError as e:
        root = cache_root("criteo", cfg.cache_dir)
        raise DataError(
            f"cannot build the Criteo cache under {root}: {e.strerror or e}"
            f"{f' ({e.filename})' if e.filename else ''}; point --cache-dir (data.cache_dir) at "
            "a writable folder with room for it"
        ) from None


def generated_name(rows: int) -> str:
    """The cached file of ``rows`` generated rows, named by a digest of the generator's
    source too: a file the generator wrote before it changed was served again, and the
    report scored its labels against the new generator's planted logits."""
    from experiments.dlrm import generate

    code = hashlib.blake2b(Path(generate.__file__).read_bytes(), digest_size=4).hexdigest()
    return f"generated-{rows}-{code}.txt"


def _remove_generated(old: Path, root: Path) -> None:
    """Remove an earlier generator's file and the preprocessed tables made from it (each
    ``meta.json`` names its source): neither is read again, and the tables, named by the
    file's fingerprint, could not be found to remove once the file was gone."""
    source = str(old.resolve())
    with contextlib.suppress(OSError):
        old.unlink()
    for meta in root.glob("*/meta.json"):
        try:
            made_from = json.loads(meta.read_text()).get("source")
        except (OSError, ValueError, AttributeError):  # unreadable: not known to be its
            continue
        if made_from == source:
            shutil.rmtree(meta.parent, ignore_errors=True)


def _load(cfg: CriteoDataConfig, progress: bool) -> CriteoData:
    if cfg.path == "generated":
        from experiments.dlrm.generate import write_generated

        root = cache_root("criteo", cfg.cache_dir)
        path = root / generated_name(cfg.generated_rows)
        if root.is_dir():  # files of killed generations
            _remove_stale(root, "generated-*.txt.tmp-*")
        if not path.is_file():
            root.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            try:
                write_generated(tmp, cfg.generated_rows)
                os.replace(tmp, path)
                # the same rows by an earlier generator (up to 8 GB each): never read again
                for old in root.glob(f"generated-{cfg.generated_rows}*.txt"):
                    if old != path and re.fullmatch(
                        rf"generated-{cfg.generated_rows}(-[0-9a-f]{{8}})?\.txt", old.name
                    ):
                        _remove_generated(old, root)
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
        try:
            return preprocess(path, cfg, progress=progress)
        except CriteoFormatError as e:  # this project wrote it: damaged since, not a user's
            raise CriteoFormatError(
                f"{e} (the generated data file {path} is damaged: delete it and run again to "
                "have it generated anew)"
            ) from None
    return preprocess(Path(cfg.path).expanduser(), cfg, progress=progress)


def entropy(p: float) -> float:
    """Binary entropy in nats (the log loss of always predicting the base rate)."""
    if p <= 0 or p >= 1:
        return 0.0
    return -(p * math.log(p) + (1 - p) * math.log(1 - p))
