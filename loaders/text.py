"""Text sources tokenized on the fly with a Hugging Face tokenizer.

``TextSource`` holds a string column (parquet, jsonl, Arrow IPC, or a ``datasets.Dataset``)
and tokenizes document ``i`` when it is read, so a document's tokens are still a pure
function of its index. Document counts come from the table itself (parquet/Arrow metadata)
or, for jsonl, from the parsed table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from loaders.errors import LoaderInputError, LoaderPathError
from loaders.sources import check_links, open_arrow_table

TEXT_SUFFIXES = (".parquet", ".jsonl", ".json", ".arrow", ".ipc", ".feather")


def looks_like_path(name: str) -> bool:
    """Whether a tokenizer argument names something local rather than a hub id: a
    ``.json`` file, a path starting ``/``, ``.`` or ``~``, anything that exists, or a path
    no hub id can be (more than one ``/``: ``models/x/nothere`` went to the hub, which
    refused it in a traceback). ``org/name`` is a hub id unless it exists here, as Hugging
    Face reads it (a local folder ``org`` beside it does not make it local)."""
    return (
        name.endswith(".json")
        or name.startswith(("/", ".", "~"))
        or Path(name).exists()
        or len(Path(name).parts) > 2
    )


def _first_line(exc: BaseException) -> str:
    """An exception's first line (a hub client's message can run to several)."""
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def load_tokenizer(tokenizer: Any) -> Callable[[str], list[int]]:
    """A ``str -> list[int]`` function from a tokenizer object, a local path or a hub name.

    Local paths (a ``tokenizer.json`` file or a folder holding one) need only the
    ``tokenizers`` package; a hub name uses ``transformers`` when installed, else
    ``tokenizers.Tokenizer.from_pretrained`` (both need network or a warm HF cache).
    """
    if not isinstance(tokenizer, (str, Path)) and callable(getattr(tokenizer, "encode", None)):
        enc = tokenizer.encode

        def encode(text: str) -> list[int]:
            try:  # the loader adds BOS/EOS itself: never the tokenizer's own specials
                out = enc(text, add_special_tokens=False)
            except TypeError:  # an encode without that option
                out = enc(text)
            return out.ids if hasattr(out, "ids") else list(out)

        return encode
    if callable(tokenizer):
        return tokenizer
    if not isinstance(tokenizer, (str, Path)):
        raise LoaderInputError(
            f"tokenizer {tokenizer!r}: pass a name, a path, or an object with encode"
        )
    path = Path(tokenizer).expanduser()
    try:
        import tokenizers
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("text sources need `pip install tokenizers`") from exc
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            tok = tokenizers.Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise LoaderInputError(
                f"tokenizer {str(tokenizer)!r} is not a tokenizer.json ({_first_line(exc)}); "
                "pass a tokenizer.json path"
            ) from None
        return load_tokenizer(tok)
    if looks_like_path(str(tokenizer)) and not path.exists():  # a path: never a hub name
        raise LoaderInputError(
            f"tokenizer {str(tokenizer)!r} does not exist; pass a tokenizer.json path"
        )
    try:
        import transformers

        tok = transformers.AutoTokenizer.from_pretrained(str(tokenizer))
        return lambda text: tok(text, add_special_tokens=False)["input_ids"]
    except ImportError:
        if path.is_dir():
            raise LoaderInputError(
                f"tokenizer folder {str(tokenizer)!r} has no tokenizer.json (other formats "
                "need `pip install transformers`); pass a tokenizer.json path"
            ) from None
    except Exception as exc:
        raise LoaderInputError(
            f"cannot load tokenizer {tokenizer!r}: {_first_line(exc)}; pass a local path"
        ) from exc
    try:
        return load_tokenizer(tokenizers.Tokenizer.from_pretrained(str(tokenizer)))
    except Exception as exc:
        raise LoaderInputError(
            f"cannot load tokenizer {tokenizer!r} ({_first_line(exc)}); pass a local "
            "tokenizer.json path"
        ) from exc


def read_text_table(path: Path) -> pa.Table:
    """The table of one text file: parquet (memory-mapped), jsonl/json, or Arrow IPC."""
    suffix = path.suffix
    try:
        if suffix == ".parquet":
            import pyarrow.parquet as pq

            return pq.read_table(path, memory_map=True)
        if suffix in (".jsonl", ".json"):
            import pyarrow.json as pj

            try:
                return pj.read_json(path)
            except pa.ArrowInvalid as exc:
                if "straddl" not in str(exc):
                    raise
                # a line longer than pyarrow's 1 MiB block (one function of several MB):
                # read again in blocks that hold the whole file
                size = min(max(path.stat().st_size + 1, 1 << 20), (1 << 31) - 1)
                return pj.read_json(path, read_options=pj.ReadOptions(block_size=size))
        return open_arrow_table(path)
    except (pa.ArrowException, OSError) as exc:
        # pyarrow reads JSON Lines only; its error on a JSON array names neither
        lines = suffix in (".jsonl", ".json") and isinstance(exc, pa.ArrowException)
        hint = "; JSON is read as JSON Lines, one object per line" if lines else ""
        raise LoaderInputError(
            f"text file {path} is unreadable ({exc}{hint}); fix or remove it"
        ) from exc


class TextSource:
    """A string column tokenized per document; ``doc(i)`` returns int32 token ids."""

    def __init__(self, data: Any, *, text_column: str = "text", tokenizer: Any) -> None:
        self.encode = load_tokenizer(tokenizer)
        if isinstance(data, (str, Path)):
            path = Path(data)
            if path.is_dir():
                files = sorted(p for p in path.rglob("*") if p.suffix in TEXT_SUFFIXES)
                files = [p for p in files if p.name != "doc_counts.json"]
                check_links(files)
            elif path.is_file():
                files = [path]
            else:
                raise LoaderPathError(f"text data path {path} does not exist")
            if not files:
                raise LoaderPathError(
                    f"folder {path} holds no text files ({', '.join(TEXT_SUFFIXES)})"
                )
            tables = [(p, read_text_table(p)) for p in files]
        elif isinstance(data, pa.Table):
            tables = [("<table>", data)]
        else:  # a datasets.Dataset (duck-typed to avoid importing datasets)
            if not isinstance(getattr(getattr(data, "data", None), "table", None), pa.Table):
                raise LoaderInputError(
                    f"text data of type {type(data).__name__}: give a file or folder path, a "
                    "pyarrow.Table or a datasets.Dataset (of a DatasetDict, pick a split; an "
                    "IterableDataset or a list, write it to a file first)"
                )
            if getattr(data, "_indices", None) is not None:
                data = data.flatten_indices()
            tables = [("<datasets.Dataset>", data.data.table)]
        columns = []
        for where, table in tables:
            if text_column not in table.column_names:
                if any(text_column in t.column_names for _, t in tables):
                    # a stray file beside the data (a save_to_disk folder's dataset_info.json)
                    raise LoaderInputError(
                        f"{where} has no text column {text_column!r} (columns: "
                        f"{table.column_names}) where other files of {data} have it: every "
                        f"{', '.join(TEXT_SUFFIXES)} file under a text folder is read as data; "
                        "move that file out, or point the dataset at the data files"
                    )
                raise LoaderInputError(
                    f"{where} has no text column {text_column!r} (columns: "
                    f"{table.column_names}); pass text_column=<one of them>"
                )
            col = table.column(text_column)
            if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
                raise LoaderInputError(
                    f"column {text_column!r} of {where} has type {col.type}, not text"
                )
            columns.extend(c for c in col.chunks if len(c))
        self._chunks = columns
        self._starts = list(np.cumsum([0] + [len(c) for c in columns])[:-1].tolist())
        self.num_docs = sum(len(c) for c in columns)

    def doc(self, i: int) -> np.ndarray:
        import bisect

        c = bisect.bisect_right(self._starts, i) - 1
        text = self._chunks[c][i - self._starts[c]].as_py()
        if not text:
            return np.zeros(0, dtype=np.int32)
        ids = np.asarray(self.encode(text))
        # cast blindly, 2**31 + 5 became negative and 1.7 became 1
        ints = ids.dtype.kind in "iu"
        if ids.size and (not ints or ids.min() < 0 or ids.max() >= 2**31):
            got = f"{ids.min()} to {ids.max()}" if ints else f"of type {ids.dtype}"
            raise LoaderInputError(
                f"the tokenizer gave document {i} ids that are not token ids in [0, 2**31) "
                f"({got}); check the tokenizer"
            )
        return ids.astype(np.int32, copy=False)
