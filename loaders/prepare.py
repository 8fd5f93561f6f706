"""Text sources -> pre-tokenized Arrow token shards + ``doc_counts.json`` (the loader's input).

    python -m loaders.prepare SRC --out DIR --tokenizer tokenizer.json
    python -m loaders.prepare ./cpython/Lib --glob '**/*.py' --out data/py --train-tokenizer 8000
    python -m loaders.prepare data.parquet --text-column func_code_string --out data/x --tokenizer T
    python -m loaders.prepare hub:code_search_net --hub-config python --text-column \\
        func_code_string --out data/python --tokenizer microsoft/codebert-base

Sources: a folder of source files (``--glob``, one document per file, sorted paths), single
source files (one document each), local parquet / jsonl / json / Arrow files
(``--text-column``), or ``hub:NAME`` (a Hugging Face
dataset, ``--hub-config``, ``--hub-split``; needs the network or a warm cache).

The plan (which documents go to which shard) is fixed first and written to
``prepare_plan.json``; shards are then tokenized in parallel (``--workers``), each written
to a temporary name and renamed when complete, so a crash leaves no half-written shard
visible and a rerun with the same arguments does only the shards that are missing.
``doc_counts.json`` is written last. ``--max-doc-tokens N`` cuts a longer document into
consecutive pieces of at most ``N`` tokens, each a document of its own: the loader's mixer
switches sub-datasets only between documents, so its realized shares are exact to within
one document's tokens, and a 50k-token file would otherwise swamp a mix. With
``--heldout F`` a fixed fraction of documents (chosen by a hash of each file path or row
number, so it never changes between runs) goes to ``DIR/heldout`` and the rest to
``DIR/train``; a source so small that the fraction selects none (or all) holds out exactly
one document, and a source of one document is refused (it cannot be split).

Tokenizer: a local ``tokenizer.json`` (or folder), a hub name, or ``--train-tokenizer V``:
a byte-level BPE of vocabulary ``V`` trained on the (training) documents with the
RoBERTa specials ``<s> <pad> </s> <unk> <mask>``, saved as ``DIR/tokenizer.json``.
"""

from __future__ import annotations

import argparse
import codecs
import fnmatch
import hashlib
import json
import os
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from loaders.errors import LoaderInputError
from loaders.metadata import (
    CONTENT_SCHEME,
    FORMAT,
    METADATA_NAME,
    PLAN_NAME,
    atomic_write_text,
    is_content_id,
    read_doc_counts,
)
from loaders.sources import tokens_digest
from loaders.text import TEXT_SUFFIXES, load_tokenizer, read_text_table

__all__ = [
    "COMPRESSED_SUFFIXES",
    "SPECIAL_TOKENS",
    "Doc",
    "PrepareError",
    "drop_link_twins",
    "file_identity",
    "heldout_docs",
    "hidden_path",
    "is_binary",
    "prepare",
    "tokenizer_digest",
    "train_tokenizer",
]

SPECIAL_TOKENS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")  # ids 0..4, as RoBERTa
MIN_TRAIN_VOCAB = 256 + len(SPECIAL_TOKENS)  # every byte and every special
MAX_TRAIN_VOCAB = 1 << 24  # far above any code vocabulary; a trainer's memory stays sane
# binary table files: matched by a folder source's --glob, each would be read as one text
TABLE_SUFFIXES = tuple(s for s in TEXT_SUFFIXES if s not in (".json", ".jsonl"))


class PrepareError(LoaderInputError):
    """Bad input to ``loaders.prepare``: the message names the source and the fix."""


@dataclass(frozen=True)
class Doc:
    """Where one document's text is: a file (``row`` None) or a row of a table file."""

    path: str
    row: int | None = None


# --------------------------------------------------------------------------- sources


def _hash01(key: str) -> float:
    """The hash of ``key`` as a number in [0, 1): the same in every run (a file name that
    is not UTF-8 hashes its own bytes)."""
    raw = key.encode("utf-8", "surrogateescape")
    return int.from_bytes(hashlib.blake2b(raw, digest_size=8).digest(), "big") / 2**64


def _sources_digest(docs: list[Doc]) -> str:
    """A digest of every local source file's path, size and modification time: a rerun
    into a prepared folder after the files changed would otherwise keep its old shards
    (and tokenizer). Hub sources are not covered (their version is the hub's)."""
    h = hashlib.blake2b(digest_size=16)
    for path in sorted({d.path for d in docs if not d.path.startswith("hub:")}):
        st = os.stat(path)
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def tokenizer_digest(tokenizer: str | None) -> str | None:
    """A digest of a local tokenizer file's content (a folder's ``tokenizer.json``), or
    None for a hub name or none: a rerun with another file at the same path would tokenize
    the missing shards differently from the ones already written."""
    if tokenizer is None:
        return None
    p = Path(tokenizer).expanduser()
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        return None
    return hashlib.blake2b(p.read_bytes(), digest_size=16).hexdigest()


def heldout_docs(docs: list[Doc], fraction: float, roots: dict[Doc, str] | None = None) -> set[Doc]:
    """The documents :func:`prepare` holds out: those whose key hashes below ``fraction``
    (fixed across runs); when that picks none or all of several documents, exactly the one
    of smallest hash. The key is a document's path (plus its row) relative to its folder
    source in ``roots``, or for the others to the deepest folder holding them all, so the
    split does not depend on where the corpus lives (the same files held out on every
    machine and after a move), nor, for a folder source, on files added beside or above
    the others (relative to the deepest folder of all, one file added at the top moved
    most of the held-out files into train)."""
    if fraction <= 0:
        return set()
    roots = roots or {}
    files = sorted({d.path for d in docs if not d.path.startswith("hub:") and d not in roots})
    root = os.path.dirname(files[0]) if len(files) == 1 else os.path.commonpath(files or ["."])

    def name(d: Doc) -> str:
        if d.path.startswith("hub:"):
            return d.path
        return os.path.relpath(d.path, roots.get(d, root))

    key = {d: _hash01(f"{name(d)}#{d.row}") for d in docs}
    held = {d for d in docs if key[d] < fraction}
    if len(docs) > 1 and len(held) in (0, len(docs)):
        held = {min(docs, key=key.__getitem__)}
    return held


def file_identity(path: Path) -> tuple[int, int] | Path:
    """What makes two names one file: its device and inode (a symbolic or a hard link and
    its target alike), or its resolved path where it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return Path(path).resolve()
    if not st.st_ino:  # a file system with no inode numbers: its paths, as before
        return Path(path).resolve()
    return st.st_dev, st.st_ino


def drop_link_twins(files: list[Path]) -> tuple[list[Path], int]:
    """``files`` with those that are a file already listed (links, symbolic or hard) left
    out, and how many were: a twin could be held out while its target trains."""
    seen: set[tuple[int, int] | Path] = set()
    kept = []
    for p in files:
        real = file_identity(p)  # a resolved path missed hard links
        if real not in seen:
            seen.add(real)
            kept.append(p)
    return kept, len(files) - len(kept)


def _refuse_repeats(docs: list[Doc]) -> None:
    """Refuse a document reached twice across sources (a source given twice, a folder and
    a folder inside it): it would be trained on twice, or land in both splits. (Links
    within one folder source are read once: :func:`drop_link_twins`.)"""
    seen: dict[tuple[str, int | None], str] = {}
    real: dict[str, str] = {}  # per path, not per row: a table has many rows
    for d in docs:
        if d.path not in real:
            real[d.path] = d.path if d.path.startswith("hub:") else os.path.realpath(d.path)
        key = (real[d.path], d.row)
        if key in seen:
            row = "" if d.row is None else f" (row {d.row})"
            raise PrepareError(
                f"{d.path}{row} is a document twice among the sources (also as {seen[key]}); "
                "give each source once, and no folder inside another"
            )
        seen[key] = d.path


def hidden_path(path: Path, folder: Path, glob: str | None) -> bool:
    """Whether ``path`` is, or lies in, a hidden file or folder (``.git``, ``.venv``,
    ``.eslintrc.js``) under ``folder`` that no part of ``glob`` starting with a dot names
    (``.github/**`` and ``.*/*.yml`` do)."""
    named = [part for part in Path(glob).parts if part.startswith(".")] if glob else []
    return any(p.startswith(".") and not any(fnmatch.fnmatchcase(p, g) for g in named)
               for p in path.relative_to(folder).parts)  # fmt: skip


def is_binary(path: Path) -> bool:
    """Whether a file is not UTF-8 text: a NUL byte, or bytes that are not UTF-8, in its
    first 8 KiB (as ``git`` and ``grep`` decide binary files). Its text would train as
    replacement marks."""
    with open(path, "rb") as f:
        head = f.read(8193)  # one byte more tells a file of exactly 8 KiB from a longer one
    more, head = len(head) > 8192, head[:8192]
    if b"\0" in head:
        return True
    try:  # a character cut at the 8 KiB boundary is text, a bad byte before it is not
        codecs.getincrementaldecoder("utf-8")().decode(head, final=not more)
    except UnicodeDecodeError:
        return True
    return False


# what a compressed file's name ends with: a folder source would read its bytes as text
COMPRESSED_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".zip", ".tgz")


def _folder_files(source: str, path: Path, glob: str, files: list[Path]) -> list[Path]:
    """A folder source's documents among the (not hidden) files its glob matched: JSON
    Lines files (their rows are documents, not their text), compressed files and files
    that are not UTF-8 text are left out and said on stderr (a repository's test
    fixtures); a glob that matches nothing else is refused, naming what to do instead."""
    rows = [p for p in files if p.suffix == ".jsonl"]
    packed = [p for p in files if p.name.endswith(COMPRESSED_SUFFIXES)]
    rest = [p for p in files if p.suffix != ".jsonl" and not p.name.endswith(COMPRESSED_SUFFIXES)]
    kinds = [is_binary(p) for p in rest]
    binary = [p for p, b in zip(rest, kinds, strict=True) if b]
    text = [p for p, b in zip(rest, kinds, strict=True) if not b]
    if not text:
        if rows:
            raise PrepareError(
                f"--glob {glob!r} matches JSON Lines files ({rows[0]}, ...), which a folder "
                "source would read as one text each; give them as sources themselves (each "
                "row a document, --text-column NAME)"
            )
        if packed:
            raise PrepareError(
                f"--glob {glob!r} matches compressed files ({packed[0]}, ...), which a folder "
                "source would read as one text each, compressed bytes and all; decompress "
                "them first"
            )
        raise PrepareError(
            f"{source}: none of the {len(files)} files --glob {glob!r} matches is UTF-8 text "
            "(binary or another encoding); name the text files with --glob, or convert them"
        )
    for what, left in (("JSON Lines files (give them as sources: rows are documents)", rows),
                       ("compressed files", packed),
                       ("files that are not UTF-8 text (binary or another encoding)",
                        binary)):  # fmt: skip
        if left:  # their text would train as JSON, compressed bytes or replacement marks
            print(f"loaders.prepare: {source}: left out {len(left)} {what}, e.g. {left[0]}",
                  file=sys.stderr)  # fmt: skip
    return text


def list_docs(
    source: str, *, glob: str | None, text_column: str, exclude: Path | None = None
) -> list[Doc]:
    """Every document of a local source, in a fixed order; for a folder, none of the files
    under ``exclude`` (prepare's own output)."""
    path = Path(source)
    if path.is_dir():
        if not glob:
            raise PrepareError(f"{source} is a folder: pass --glob PATTERN (e.g. '**/*.py')")
        if Path(glob).is_absolute() or ".." in Path(glob).parts:
            raise PrepareError(
                f"--glob {glob!r} reaches outside {source}; give a pattern inside it (e.g. "
                "'**/*.py')"
            )
        try:
            files = sorted(p for p in path.glob(glob) if p.is_file())
        except ValueError as e:  # '**' inside a part ("a**b"): pathlib's own refusal
            raise PrepareError(f"--glob {glob!r} is not a pattern pathlib takes ({e})") from None
        mine = Path(exclude).resolve() if exclude is not None else None
        if mine is not None and mine.is_relative_to(path.resolve()):  # else none is under it
            files = [p for p in files if not p.resolve().is_relative_to(mine)]
        if not files:
            raise PrepareError(f"{source}: no file matches --glob {glob!r}")
        # hidden files and folders (.git, .venv) left out, as the experiments' raw folders
        # leave them: a project's --glob '**/*.py' took in its .venv
        files = [p for p in files if not hidden_path(p, path, glob)]
        if not files:
            raise PrepareError(
                f"{source}: --glob {glob!r} matches only hidden files or folders; name them "
                "in the glob (e.g. '.github/**') to take them"
            )
        tables = [p for p in files if p.suffix in TABLE_SUFFIXES]
        if tables:  # one document per file: its bytes, read as text
            raise PrepareError(
                f"--glob {glob!r} matches table files ({tables[0]}, ...), which a folder "
                "source would read as one text each; give the table files as sources "
                "themselves, or a --glob that leaves them out"
            )
        return [Doc(str(p)) for p in _folder_files(source, path, glob, files)]
    if path.is_file():
        if path.name.endswith(COMPRESSED_SUFFIXES):  # its bytes would be one document
            raise PrepareError(
                f"{source} is compressed; decompress it first (a .jsonl or .parquet file's "
                "rows are documents, any other file is one)"
            )
        if path.suffix not in TEXT_SUFFIXES:  # a source file: one document
            return [Doc(str(path))]
        table = read_text_table(path)
        if text_column not in table.column_names:
            raise PrepareError(
                f"{source} has no column {text_column!r} (columns: {table.column_names}); "
                "pass --text-column NAME"
            )
        kind = table.column(text_column).type
        if pa.types.is_dictionary(kind):  # dictionary-encoded text reads as its values
            kind = kind.value_type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                or pa.types.is_binary(kind) or pa.types.is_large_binary(kind)):  # fmt: skip
            # str() of a number, a list or a struct was tokenized as if it were text
            raise PrepareError(
                f"column {text_column!r} of {source} has type {kind}, not text; pass "
                "--text-column NAME of a text column"
            )
        nulls = table.column(text_column).null_count
        if nulls:  # a row without the field (JSON Lines) or a null: an empty document
            print(f"loaders.prepare: {source}: {nulls} of {table.num_rows} rows have no "
                  f"{text_column!r} (missing or null); they are empty documents, which the "
                  "loader skips", file=sys.stderr)  # fmt: skip
        return [Doc(str(path), i) for i in range(table.num_rows)]
    raise PrepareError(f"source {source} does not exist; pass a folder, a file or hub:NAME")


class _Texts:
    """Reads document texts; table files are opened once per process."""

    def __init__(self, text_column: str, hub: object = None) -> None:
        self.text_column, self.hub = text_column, hub
        self._tables: dict[str, pa.ChunkedArray] = {}

    def __call__(self, doc: Doc) -> str:
        if doc.path.startswith("hub:"):
            return str(self.hub[doc.row][self.text_column])  # type: ignore[index]
        if doc.row is None:
            return Path(doc.path).read_text(encoding="utf-8", errors="replace")
        if doc.path not in self._tables:
            self._tables[doc.path] = read_text_table(Path(doc.path)).column(self.text_column)
        scalar = self._tables[doc.path][doc.row]
        try:  # binary (a parquet bytes column) as UTF-8, as a string column's bytes are
            value = scalar.as_py()
            if isinstance(value, bytes):
                value = value.decode("utf-8")
        except UnicodeDecodeError:
            raise PrepareError(
                f"{doc.path}: column {self.text_column!r} (row {doc.row}) is not UTF-8 text; "
                "save the file as UTF-8"
            ) from None
        return "" if value is None else str(value)


def _load_hub(name: str, config: str | None, split: str, text_column: str) -> object:
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - an extra
        raise PrepareError("hub sources need `pip install datasets`") from exc
    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:
        raise PrepareError(
            f"cannot load hub dataset {name!r} (config {config!r}, split {split!r}): {exc}; "
            "without network, save it locally (parquet/jsonl) and pass the file instead"
        ) from None
    if text_column not in ds.column_names:
        raise PrepareError(
            f"hub dataset {name!r} has no column {text_column!r} (columns: {ds.column_names})"
        )
    return ds


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: Iterator[str], vocab_size: int, out: Path) -> Path:
    """Train a byte-level BPE on ``texts``; save ``out`` (tokenizer.json); return its path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return out


# --------------------------------------------------------------------------- shards


_WORKER: dict = {}


def _init_worker(tokenizer: str, text_column: str, hub: tuple | None) -> None:
    _WORKER["encode"] = load_tokenizer(tokenizer)
    ds = _load_hub(*hub, text_column) if hub else None
    _WORKER["texts"] = _Texts(text_column, ds)


def _pieces(tokens: np.ndarray, max_tokens: int | None) -> list[np.ndarray]:
    """``tokens`` cut into consecutive pieces of at most ``max_tokens`` (None: whole)."""
    if max_tokens is None or len(tokens) <= max_tokens:
        return [tokens]
    return [tokens[i : i + max_tokens] for i in range(0, len(tokens), max_tokens)]


def _write_shard(
    job: tuple[str, list[tuple[str, int | None]], int | None],
) -> tuple[str, int, int]:
    """Tokenize one shard's documents and write it atomically; returns (path, docs, tokens)."""
    out, docs, max_tokens = job
    encode, texts = _WORKER["encode"], _WORKER["texts"]
    rows = [piece for p, r in docs
            for piece in _pieces(np.asarray(encode(texts(Doc(p, r))), dtype=np.int32),
                                 max_tokens)]  # fmt: skip
    lengths = [len(r) for r in rows]
    total = sum(lengths)
    if total >= 2**31:  # the offsets are int32: they would wrap, and Arrow refuse them
        raise PrepareError(
            f"{out}: a shard of {total:,} tokens passes the 2**31 an Arrow list holds; lower "
            "--docs-per-shard (or cut documents with --max-doc-tokens)"
        )
    offsets = np.zeros(len(rows) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(rows) if rows else np.zeros(0, dtype=np.int32)
    arr = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    table = pa.table({"tokens": arr})
    path = Path(out)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table, max_chunksize=1024)
    os.replace(tmp, path)
    return out, len(rows), int(offsets[-1])


def _plan(docs: list[Doc], docs_per_shard: int) -> list[dict]:
    """Consecutive runs of ``docs_per_shard`` documents, one Arrow file each."""
    shards = []
    for k, start in enumerate(range(0, len(docs), docs_per_shard)):
        part = docs[start : start + docs_per_shard]
        shards.append({"file": f"part-{k:05d}.arrow", "docs": [[d.path, d.row] for d in part]})
    return shards


def _rows(path: Path) -> int:
    """Documents in a written shard (pieces count: a cut document is several); a shard
    that cannot be read (truncated on disk) is an error naming it."""
    try:
        with pa.memory_map(str(path)) as src:
            return pa.ipc.open_file(src).read_all().num_rows
    except (pa.ArrowInvalid, OSError) as e:
        if getattr(e, "errno", None) is not None:  # EMFILE, EACCES: the shard may be fine
            raise
        why = (str(e).splitlines() or [type(e).__name__])[0]
        raise PrepareError(
            f"{path} is damaged ({why}); delete it and run again to write it anew"
        ) from None


def prepare(
    sources: list[str],
    out: str | Path,
    *,
    tokenizer: str | None = None,
    train_vocab: int | None = None,
    glob: str | None = None,
    text_column: str = "text",
    heldout: float = 0.0,
    docs_per_shard: int = 2000,
    workers: int = 1,
    hub_config: str | None = None,
    hub_split: str = "train",
    max_doc_tokens: int | None = None,
    progress: bool = True,
) -> dict:
    """Prepare ``sources`` into ``out`` (``out/train`` and ``out/heldout`` with ``heldout``);
    returns a summary. Reruns with the same arguments finish what a crash left undone."""
    from tqdm.auto import tqdm

    # a str was taken character by character ("/ is a folder: pass --glob")
    if not isinstance(sources, (str, os.PathLike)):
        sources = list(sources)
    if isinstance(sources, (str, os.PathLike)) or not all(isinstance(x, str) for x in sources):
        raise PrepareError(f"sources must be a list of str (paths, or hub:NAME), got {sources!r}")
    if (tokenizer is None) == (train_vocab is None):
        raise PrepareError("pass exactly one of --tokenizer and --train-tokenizer VOCAB")
    if not 0 <= heldout < 1:
        raise PrepareError(f"--heldout must be in [0, 1), got {heldout}")
    for flag, value in (("--docs-per-shard", docs_per_shard), ("--workers", workers)):
        if value < 1:
            raise PrepareError(f"{flag} must be >= 1, got {value}")
    if max_doc_tokens is not None and max_doc_tokens < 1:
        raise PrepareError(f"--max-doc-tokens must be >= 1, got {max_doc_tokens}")
    if train_vocab is not None and train_vocab < MIN_TRAIN_VOCAB:
        raise PrepareError(
            f"--train-tokenizer {train_vocab}: a byte-level BPE needs a vocabulary of at least "
            f"{MIN_TRAIN_VOCAB} (256 bytes and the specials)"
        )
    if train_vocab is not None and train_vocab > MAX_TRAIN_VOCAB:  # the trainer aborts
        raise PrepareError(  # allocating for it (2**31: 283 GB), or overflows
            f"--train-tokenizer {train_vocab}: give a vocabulary of at most {MAX_TRAIN_VOCAB:,}"
        )
    if not str(out):  # Path("") is the current folder: the plan and splits went there
        raise PrepareError("--out is empty; give the folder to write the splits to")
    out = Path(out)
    hub, docs = None, []
    roots: dict[Doc, str] = {}  # a folder source's documents: the folder
    for src in sources:
        if src.startswith("hub:"):
            if len(sources) > 1:
                raise PrepareError("a hub source is prepared on its own; run prepare per source")
            hub = (src[4:], hub_config, hub_split)
            ds = _load_hub(*hub, text_column)
            docs = [Doc(src, i) for i in range(len(ds))]  # type: ignore[arg-type]
        else:
            # prepare's own output inside a folder source: a rerun's glob would reach it
            found = list_docs(src, glob=glob, text_column=text_column, exclude=out)
            if Path(src).is_dir():
                kept, twins = drop_link_twins([Path(d.path) for d in found])
                if twins:  # a link read as its target: a twin could be held out as it trains
                    print(f"loaders.prepare: {src}: {twins} files are links to files already "
                          "in it; each is read once", file=sys.stderr)  # fmt: skip
                    found = [Doc(str(p)) for p in kept]
                roots.update(dict.fromkeys(found, src))
            docs += found
    if not docs:
        raise PrepareError(f"sources {sources} hold no document")
    _refuse_repeats(docs)
    held = heldout_docs(docs, heldout, roots)
    splits = {"train": [d for d in docs if d not in held]}
    if heldout > 0 and len(docs) == 1:  # held out, no train split; kept, no held-out one
        raise PrepareError(
            f"--heldout {heldout}: the sources hold one document, which cannot be split into "
            "a train and a held-out part; add documents, or pass --heldout 0"
        )
    if heldout:
        splits["heldout"] = [d for d in docs if d in held]
    if out.exists() and not out.is_dir():
        raise PrepareError(f"--out {out} is a file; give a folder (new or prepared before)")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file on the way, no permission
        raise PrepareError(f"--out {out}: cannot make that folder ({e.strerror}); give "
                           "another") from None  # fmt: skip
    settings = {
        "sources": sources, "glob": glob, "text_column": text_column, "heldout": heldout,
        "docs_per_shard": docs_per_shard, "tokenizer": tokenizer, "train_vocab": train_vocab,
        "hub_config": hub_config, "hub_split": hub_split, "docs": len(docs),
        # 3: a folder source's keys relative to it; 2: keys relative to the corpus root
        # (1: absolute paths); file sources alone keep 2's keys, and without a held-out
        # split the rule decides nothing (an older output reruns as it is)
        "heldout_rule": 3 if roots and heldout > 0 else 2,
    }  # fmt: skip
    if max_doc_tokens is not None:  # (absent when unset: older plans stay valid)
        settings["max_doc_tokens"] = max_doc_tokens
    plan_path = out / PLAN_NAME
    sources = _sources_digest(docs)
    tok_digest = tokenizer_digest(tokenizer) if train_vocab is None else None
    saved: object = None
    if not plan_path.is_file():  # shards are skipped where their files exist: another run's
        # (with --tokenizer, out/tokenizer.json is neither read nor written: it may be that one)
        names = ("train", "heldout", *(("tokenizer.json",) if train_vocab is not None else ()))
        stale = [n for n in names if (out / n).exists()]
        if stale:
            raise PrepareError(
                f"{out} holds {', '.join(stale)} but no {PLAN_NAME}, so nothing says they are "
                "this run's (existing shards would be kept as they are); pass another --out or "
                "delete them"
            )
    else:
        try:
            saved = json.loads(plan_path.read_text())
        except ValueError as e:
            raise PrepareError(
                f"{plan_path} is unreadable ({e}); delete {out} or pass another --out"
            ) from None
        old = saved.get("settings") if isinstance(saved, dict) else None
        if (isinstance(old, dict) and old.get("tokenizer") != tokenizer and tok_digest
                and saved.get("tokenizer_digest") == tok_digest):  # fmt: skip
            # one file spelled two ways (a folder or its tokenizer.json, relative or not):
            # the same tokens, refused as "other settings"
            settings["tokenizer"] = old["tokenizer"]
        if isinstance(old, dict) and {**old, "heldout_rule": 0} == {**settings, "heldout_rule": 0}:
            if old.get("heldout_rule") != settings["heldout_rule"]:
                raise PrepareError(
                    f"{out} was prepared by an older loaders.prepare, whose held-out split "
                    "keyed a folder's files differently (this run's split would differ); pass "
                    "another --out or delete that folder"
                )
        if not isinstance(saved, dict) or saved.get("settings") != settings:
            before = old if isinstance(old, dict) else {}
            keys = [k for k in dict.fromkeys([*before, *settings])
                    if before.get(k) != settings.get(k)]  # fmt: skip
            what = f": {', '.join(keys[:4])} differ" if keys else ""
            raise PrepareError(
                f"{out} was prepared with other settings ({plan_path}{what}); pass another "
                "--out or delete that folder"
            )
        # (a plan written before sources were fingerprinted has none: taken as it is)
        # (a plan written before tokenizers were fingerprinted has none: taken as it is;
        # a trained one is checked once it is found, below)
        if train_vocab is None and saved.get("tokenizer_digest", tok_digest) != tok_digest:
            raise PrepareError(
                f"{out} was prepared with another version of the tokenizer {tokenizer} (its "
                f"file changed since, {plan_path}): new shards would mix two tokenizations; "
                "pass another --out or delete that folder"
            )
        if saved.get("sources", sources) != sources:
            raise PrepareError(
                f"{out} was prepared from other versions of these files (sizes or times "
                f"changed since, {plan_path}): its shards would be stale; pass another --out "
                "or delete that folder"
            )
    if train_vocab is not None:
        tok_path = out / "tokenizer.json"
        if not tok_path.is_file():
            texts = _Texts(text_column, _load_hub(*hub, text_column) if hub else None)
            train_tokenizer((texts(d) for d in splits["train"]), train_vocab, tok_path)
        tokenizer = str(tok_path)
        tok_digest = tokenizer_digest(tokenizer)  # recorded: the shards are its
        was = saved.get("tokenizer_digest") if isinstance(saved, dict) else None
        if was is not None and was != tok_digest:
            raise PrepareError(
                f"{tok_path} is not the tokenizer {out} was prepared with (it changed since "
                f"it was trained, {plan_path}): new shards would mix two tokenizations; pass "
                "another --out or delete that folder"
            )
    load_tokenizer(tokenizer)  # fail here, not in a worker
    layout = {name: _plan(ds, docs_per_shard) for name, ds in splits.items()}
    atomic_write_text(
        plan_path,
        json.dumps(
            {
                "settings": settings,
                # a local file by its absolute path: a reader in another folder took a
                # relative one for a hub name
                "tokenizer": os.path.abspath(tokenizer) if Path(tokenizer).exists() else tokenizer,
                "sources": sources,
                # where the sources are, whatever folder prepare ran in (the settings keep
                # them as given): what a reader checks its own files against
                "source_paths": [
                    src if src.startswith("hub:") else os.path.abspath(src)
                    for src in settings["sources"]
                ],
                **({"tokenizer_digest": tok_digest} if tok_digest else {}),
            },
            indent=1,
        ),  # fmt: skip
    )
    summary: dict = {"out": str(out), "tokenizer": tokenizer, "splits": {}}
    for name, shards in layout.items():
        folder = out / name
        folder.mkdir(parents=True, exist_ok=True)
        todo = [
            (str(folder / s["file"]), [tuple(d) for d in s["docs"]], max_doc_tokens)
            for s in shards
            if not (folder / s["file"]).is_file()
        ]
        bar = tqdm(
            total=len(shards),
            initial=len(shards) - len(todo),
            unit="shard",
            desc=f"prepare {name}",
            disable=not progress,
            mininterval=1.0,
        )
        init = (tokenizer, text_column, hub)
        if workers == 1 or len(todo) <= 1:
            _init_worker(*init)
            for job in todo:
                _write_shard(job)
                bar.update(1)
        else:
            # no more processes than shards to write (--workers 48 over 2 forked 48)
            pool = min(workers, len(todo))
            with ProcessPoolExecutor(pool, initializer=_init_worker, initargs=init) as ex:
                for _ in ex.map(_write_shard, todo):
                    bar.update(1)
        bar.close()
        counts = {sh["file"]: {"docs": _rows(folder / sh["file"]),
                               "bytes": (folder / sh["file"]).stat().st_size}
                  for sh in shards}  # fmt: skip
        # the documents' digest: a resume on shards prepared again from changed sources
        # (same document count, other tokens) is refused by the loader's fingerprint. A
        # finished folder prepared again keeps the one recorded (its shards not re-read).
        before = read_doc_counts(folder / METADATA_NAME)  # {}: digested anew
        content = before.get("content")
        if not is_content_id(content) or before.get("files") != counts:
            content = CONTENT_SCHEME + tokens_digest([folder / sh["file"] for sh in shards])
        atomic_write_text(
            folder / METADATA_NAME,
            json.dumps(
                {"format": FORMAT, "version": 1, "files": counts, "content": content}, indent=1
            ),
        )
        summary["splits"][name] = {
            "shards": len(shards),
            "docs": sum(c["docs"] for c in counts.values()),
        }
    return summary


def main(argv: list[str] | None = None) -> int:
    """``python -m loaders.prepare``; bad input is one line and exit status 2."""
    ap = argparse.ArgumentParser(
        prog="python -m loaders.prepare", description=__doc__.split("\n")[0]
    )
    ap.add_argument("sources", nargs="+", help="folder (with --glob), table file, or hub:NAME")
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokenizer", help="tokenizer.json, a folder holding one, or a hub name")
    ap.add_argument("--train-tokenizer", dest="train_vocab", type=int, metavar="VOCAB")
    ap.add_argument("--glob", help="file pattern inside a folder source, e.g. '**/*.py'")
    ap.add_argument("--text-column", default="text")
    ap.add_argument("--heldout", type=float, default=0.0, help="fraction of documents held out")
    ap.add_argument("--docs-per-shard", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    ap.add_argument("--hub-config")
    ap.add_argument("--hub-split", default="train")
    ap.add_argument("--max-doc-tokens", type=int, metavar="N",
                    help="cut longer documents into pieces of at most N tokens")  # fmt: skip
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        summary = prepare(
            args.sources, args.out, tokenizer=args.tokenizer, train_vocab=args.train_vocab,
            glob=args.glob, text_column=args.text_column, heldout=args.heldout,
            docs_per_shard=args.docs_per_shard, workers=args.workers,
            hub_config=args.hub_config, hub_split=args.hub_split,
            max_doc_tokens=args.max_doc_tokens, progress=not args.no_progress,
        )  # fmt: skip
    except LoaderInputError as e:  # PrepareError, a bad tokenizer, table or folder
        print(f"{ap.prog}: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
