"""MNLI data for the six-encoder classifier: load, encode BERT-style pairs, batch.

Stages, in order: source (HF hub, local parquet/jsonl/json/csv/tsv files, or the generated
synthetic task of `experiments.mnli.generated`) -> tokenizer (`tokenizers`, Rust)
-> `encode_pairs` -> `EncodedSplit` (tensors)
-> `BatchIterator` (deterministic, resumable, DDP-aware) / `eval_batches` (in order).
"""

from __future__ import annotations

import contextlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
from tokenizers import Tokenizer, processors

from comera.errors import ConfigError, DataError, MissingFileError, UserError, first_line
from experiments.hub import hub_unreachable, offline_tip, quiet_hub
from experiments.mnli.batches import EncodedSplit
from experiments.mnli.generated import (
    GENERATED_WORDS,
    build_generated_tokenizer,
    generate_examples,
)
from experiments.notes import note
from loaders.text import looks_like_path

log = logging.getLogger(__name__)

GENERATED = "generated"
DEFAULT_TOKENIZER = "bert-base-uncased"
NUM_LABELS = 3
LABEL_NAMES = ("entailment", "neutral", "contradiction")  # label ids 0, 1, 2
_FORMATS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv",
            ".tsv": "tsv"}  # fmt: skip
_OFFLINE_HELP = (
    "Use local data with --train-file PATH --eval-file NAME=PATH (parquet/jsonl/json/csv/tsv) "
    "or the synthetic task with --dataset generated, and a local tokenizer with --tokenizer PATH "
    "(a tokenizer.json file or a directory holding one); where a command has no such flags "
    "(experiments.ablate): --set data.dataset=local --set data.train_file=PATH --set "
    '\'data.eval_files={"NAME": "PATH"}\' --set data.tokenizer=PATH, or --set '
    "data.dataset=generated."
)


def _offline_help() -> str:
    tip = offline_tip()
    return _OFFLINE_HELP + (f" {tip}." if tip else "")


class HubUnreachableError(UserError, RuntimeError):
    """The Hugging Face Hub could not be reached (offline, no network, or offline mode set):
    a condition of this machine, not a bug, so the message names the local options."""


@dataclass(kw_only=True, slots=True)
class MNLIDataConfig:
    """Where MNLI comes from and how it is encoded. Local files take precedence over the hub."""

    dataset: str = "nyu-mll/glue"  # HF hub name, or "generated" for the synthetic task
    dataset_config: str = "mnli"
    train_file: str | None = None
    eval_files: dict[str, str] | None = None  # split name -> path
    tokenizer: str = DEFAULT_TOKENIZER  # hub name, tokenizer.json, or a directory holding one
    premise_column: str = "premise"
    hypothesis_column: str = "hypothesis"
    label_column: str = "label"
    max_length: int = 128
    max_train_examples: int | None = None
    max_eval_examples: int | None = None
    generated_train: int = 4000
    generated_eval: int = 1000
    generated_vocab: int = 24  # words used in generated sentences (of the tokenizer's 150)
    seed: int = 0

    def __post_init__(self) -> None:
        def bad(name: str, fix: str) -> ConfigError:
            return ConfigError(f"MNLIDataConfig.{name}={getattr(self, name)!r} is invalid: {fix}")

        if self.max_length < 8:
            raise bad("max_length", "use at least 8 (3 special tokens plus both sentences)")
        for name in ("max_train_examples", "max_eval_examples"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise bad(name, "use None (all examples) or a positive count")
        for name in ("generated_train", "generated_eval"):
            if getattr(self, name) < 3:
                raise bad(name, "use at least 3 so every label appears")
        if not 20 <= self.generated_vocab <= len(GENERATED_WORDS):
            raise bad("generated_vocab", f"use 20..{len(GENERATED_WORDS)} (8 premise + 4 absent)")
        for name in ("dataset", "tokenizer", "premise_column", "hypothesis_column", "label_column"):
            if not getattr(self, name):
                raise bad(name, "give a non-empty string")
        columns = ("premise_column", "hypothesis_column", "label_column")
        for i, a in enumerate(columns):  # the labels as a sentence, or one sentence twice
            for b in columns[i + 1 :]:
                if getattr(self, a) == getattr(self, b):
                    flags = "--premise-column, --hypothesis-column, --label-column"
                    raise bad(a, f"{b} names that column too; give each its own ({flags})")
        if self.eval_files is not None and self.train_file is None:
            raise bad("eval_files", "set train_file too (local files replace the hub as a whole)")
        if "train" in (self.eval_files or {}):
            raise bad("eval_files", "name eval splits anything but 'train' (that is train_file)")
        if any(not isinstance(k, str) or not k.strip() for k in (self.eval_files or {})):
            # logged as eval//accuracy, shown as /accuracy
            raise bad("eval_files", "give every eval split a name (NAME=PATH)")
        if self.train_file is not None and self.dataset == GENERATED:
            raise bad(
                "train_file", "drop it, or set dataset to a hub name: 'generated' has no file"
            )
        paths = [("train_file", self.train_file)] if self.train_file else []
        paths += [("eval_files", p) for p in (self.eval_files or {}).values()]
        for name, path in paths:
            if Path(path).suffix.lower() not in _FORMATS:
                flag = "--train-file" if name == "train_file" else "--eval-file"
                raise bad(name, f"{path!r} must end in one of {sorted(_FORMATS)} ({flag})")


@dataclass(kw_only=True, slots=True)
class MNLIData:
    """Encoded train and eval splits plus what the model needs to know about the tokenizer."""

    train: EncodedSplit
    eval: dict[str, EncodedSplit]
    vocab_size: int
    pad_id: int
    tokenizer_path_or_name: str
    num_labels: int = NUM_LABELS

    def splits(self) -> list[EncodedSplit]:
        """The train split and every eval split that holds rows."""
        return [s for s in (self.train, *self.eval.values()) if len(s)]

    def eval_identity(self) -> dict[str, str]:
        """Each eval split's name and a digest of its examples: a trainer's
        ``eval_data_id``, so a resume over an eval file changed in place is refused."""
        return {name: split.identity(every_row=True) for name, split in self.eval.items()}

    def max_label(self) -> int:
        """The largest label id the splits hold (-1 for none)."""
        return max((int(s.labels.max()) for s in self.splits() if len(s.labels)), default=-1)

    def unevaluated_note(self) -> str | None:
        """What to say when there is no eval split (local files replace the hub's splits
        as a whole, so ``--train-file`` alone gives none): the run reports no held-out
        score, and trained without a word of it. The commands print it once the run has
        passed every check, so an error stays one line."""
        if self.eval:
            return None
        return ("no eval split is given (--eval-file NAME=PATH, data.eval_files), so the run "
                "reports no held-out accuracy")  # fmt: skip

    def check_label_count(self, num_labels: int) -> None:
        """Refuse a classifier of ``num_labels`` outputs smaller than the labels the splits
        hold (the first step's loss would fail on them, naming no setting)."""
        top = self.max_label()
        if top >= num_labels:
            named = {"train": self.train, **{f"eval split {k!r}": v for k, v in self.eval.items()}}
            where = [n for n, sp in named.items() if len(sp.labels) and int(sp.labels.max()) == top]
            raise ConfigError(
                f"the data has label ids up to {top} ({', '.join(where)}) but "
                f"model.num_labels={num_labels}; --set model.num_labels={top + 1}, or "
                "check that split's labels"
            )


# ---------------------------------------------------------------- tokenizer


def _bert_pair_template(cls_id: int, sep_id: int) -> processors.TemplateProcessing:
    return processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )


# what rows are padded with: a pad token, else (GPT-2's and Llama's tokenizers have none)
# the end-of-text token, as Hugging Face pads those models; the attention mask, not the
# id, tells pads from text
PAD_TOKENS = ("[PAD]", "<pad>")
END_TOKENS = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>")


def prepare_tokenizer(tok: Tokenizer, max_length: int) -> int:
    """Set longest-first truncation and padding to exactly `max_length`; return the pad id
    (a pad token's, else an end-of-text token's: :data:`END_TOKENS`).

    A tokenizer without a post-processor gets BERT's `[CLS] A [SEP] B [SEP]` template.
    """
    pad = next((t for t in (*PAD_TOKENS, *END_TOKENS) if tok.token_to_id(t) is not None), None)
    if pad is None:
        raise DataError(
            f"tokenizer has no pad token ({' or '.join(PAD_TOKENS)}) nor an end-of-text token "
            f"to pad with ({', '.join(END_TOKENS)}); use a tokenizer that has one"
        )
    if tok.post_processor is None:
        cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
        if cls_id is None or sep_id is None:
            raise DataError(
                "the tokenizer has no post-processor and no [CLS]/[SEP] tokens to add one "
                "(a BERT-style pair template); give one that has them"
            )
        tok.post_processor = _bert_pair_template(cls_id, sep_id)
    pad_id = tok.token_to_id(pad)
    tok.enable_truncation(max_length, strategy="longest_first")
    tok.enable_padding(pad_id=pad_id, pad_token=pad, length=max_length)
    return pad_id


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A tokenizer from a local tokenizer.json (or a directory holding one) or the HF hub."""
    if looks_like_path(name_or_path):
        path = Path(name_or_path).expanduser()
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise MissingFileError(
                f"tokenizer file {str(path)!r} does not exist; pass --tokenizer a tokenizer.json "
                "or a directory holding one (a Hugging Face model folder has one)"
            )
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise DataError(
                f"tokenizer file {str(path)!r} is not a tokenizer.json ({first_line(exc)}); pass "
                "--tokenizer a tokenizer.json or a directory holding one"
            ) from None
    try:
        with quiet_hub():
            return Tokenizer.from_pretrained(name_or_path)
    except Exception as exc:
        raise _hub_error(exc, f"tokenizer {name_or_path!r}") from exc


def _hub_error(exc: Exception, what: str) -> Exception:
    """The error to raise for a failed hub load: unreachable hub, a name the hub does not
    have (``datasets`` raises a ``FileNotFoundError`` kind), or ``exc`` itself."""
    first = first_line(exc)  # a hub client's message can run to several lines
    if not hub_unreachable(exc):
        if isinstance(exc, FileNotFoundError):
            return DataError(f"cannot load {what} from the hub ({first}); check the name. "
                             f"{_offline_help()}")  # fmt: skip
        if type(exc).__name__ == "HFValidationError":  # a name no hub id can be ("a b")
            return DataError(f"cannot load {what}: it is neither a local path nor a hub "
                             f"name ({first})")  # fmt: skip
        return exc
    return HubUnreachableError(
        f"Could not reach the Hugging Face Hub to load {what} "
        f"({type(exc).__name__}: {first}). {_offline_help()}"
    )


# ---------------------------------------------------------------- raw sources

Raw = tuple[list[str], list[str], np.ndarray]  # premises, hypotheses, labels


# the CSV reader's block: a field must fit in one (Arrow's default, 1 MiB, refused a
# valid file with one long sentence)
CSV_BLOCK_BYTES = 64 << 20


def _read_table(path: str, text_columns: tuple[str, ...] = ()) -> pa.Table:
    fmt = _FORMATS[Path(path).suffix.lower()]
    if Path(path).is_dir():  # "does not exist" of a parquet dataset's folder
        raise DataError(
            f"data file {path!r} is a folder; give one file with --train-file / --eval-file "
            "(--dataset FOLDER reads a folder of files with datasets)"
        )
    if not Path(path).is_file():
        raise MissingFileError(
            f"data file {path!r} does not exist; check --train-file / --eval-file"
        )
    with open(path, "rb") as f:
        head = f.read(2)
    if fmt != "parquet" and head in (b"\xff\xfe", b"\xfe\xff"):  # Excel's "Unicode text"
        raise DataError(f"data file {path!r} is UTF-16 text; save it as UTF-8")
    try:
        return _parse_table(path, fmt, text_columns)
    except (pa.ArrowException, ValueError, TypeError, OSError) as exc:  # JSON/CSV/Parquet
        # GLUE's TSVs hold no quoting: a tool's quoted field (a tab inside) splits there
        hint = (" (.tsv is read as GLUE's files are: one row a line, no quoting; save a "
                "file whose fields hold tabs as .csv)" if fmt == "tsv" else "")  # fmt: skip
        raise DataError(
            f"data file {path!r} cannot be read as {fmt} ({type(exc).__name__}: "
            f"{first_line(exc)}){hint}; "
            "fix the file or check --train-file / --eval-file"
        ) from exc


def _parse_table(path: str, fmt: str, text_columns: tuple[str, ...] = ()) -> pa.Table:
    """The file's table; a CSV's ``text_columns`` (the sentences) are read as written, as
    text: Arrow's type guessing turned ``007`` into 7, ``1.50`` into 1.5 and dates into
    dates."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path)
    if fmt in ("csv", "tsv"):
        import pyarrow.csv as pcsv

        # blocks far larger than Arrow's 1 MiB: a field longer than a block was refused
        read = pcsv.ReadOptions(block_size=CSV_BLOCK_BYTES)
        as_text = pcsv.ConvertOptions(column_types=dict.fromkeys(text_columns, pa.string()))
        parse = (pcsv.ParseOptions(newlines_in_values=True) if fmt == "csv"
                 # GLUE's own files: one row a line, quotes are text (no quoting)
                 else pcsv.ParseOptions(delimiter="\t", quote_char=False))  # fmt: skip
        return pcsv.read_csv(path, read_options=read, parse_options=parse,
                             convert_options=as_text)  # fmt: skip
    with open(path, encoding="utf-8-sig") as f:  # a BOM (Windows tools write one) is no text
        text = f.read()
    if text.lstrip().startswith("["):  # a JSON array of records
        return _records_table(json.loads(text))
    rows = []
    # lines end at "\n" alone: splitlines() also cut a string holding U+2028 (valid JSON)
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            try:
                rows.append(json.loads(line))
            except ValueError as e:  # its position within the line: name the file's line
                raise ValueError(f"line {number}: {first_line(e)}") from None
    return _records_table(rows)


def _records_table(rows: list) -> pa.Table:
    """JSON records as a table: a column for every key any row holds (a row without it
    holds null there; Arrow took the first row's keys), and a column whose rows mix
    scalar kinds (``1`` and ``"1"``) as text, which :func:`_columns` reads as it reads a
    CSV's; a list or mapping among them is refused naming the row (as text it would pass
    for a sentence)."""
    bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
    if bad is not None:
        raise ValueError(f"row {bad} is not a JSON object")
    columns = {}
    for key in dict.fromkeys(k for r in rows for k in r):
        values = [r.get(key) for r in rows]
        try:
            columns[key] = pa.array(values)
        except (pa.ArrowTypeError, pa.ArrowInvalid):  # mixed kinds: scalars as text
            nested = next((i for i, v in enumerate(values) if isinstance(v, (list, dict))), None)
            if nested is not None:
                raise ValueError(
                    f"column {key!r} (row {nested}) holds a {type(values[nested]).__name__} "
                    "among scalars"
                ) from None
            columns[key] = pa.array([v if v is None or isinstance(v, str) else str(v)
                                     for v in values])  # fmt: skip
    return pa.table(columns)


def _columns(table: pa.Table, source: str, cfg: MNLIDataConfig) -> Raw:
    fields = ("premise_column", "hypothesis_column", "label_column")
    if not table.num_columns:  # an empty file: "missing column, columns present: []"
        raise DataError(f"{source} is empty: no rows, no columns; check the path")
    try:  # Arrow decodes a CSV's header only here: a Latin-1 one was a traceback
        names = table.column_names
    except UnicodeDecodeError:
        raise DataError(f"{source}: its header is not UTF-8 text; save the file as UTF-8") from None
    for name in fields:
        col = getattr(cfg, name)
        if names.count(col) > 1:  # Arrow's error names no file
            raise DataError(
                f"{source}: column {col!r} appears {names.count(col)} times; rename all but one"
            )
        if col not in names:
            raise DataError(
                f"{source}: missing column {col!r}; columns present: {names}. "
                f"Pass --{name.replace('_', '-')} NAME (MNLIDataConfig.{name}) to name the "
                "column that holds it."
            )
    text = [_sentences(table, getattr(cfg, n), source) for n in fields[:2]]
    raw_labels = table.column(cfg.label_column).to_pylist()
    names = _class_names(table, cfg.label_column)
    labels = np.empty(len(raw_labels), dtype=np.int64)
    for i, v in enumerate(raw_labels):
        if names is not None and isinstance(v, int) and 0 <= v < len(names):
            v = names[v]  # the file's own class id, by its name
        v = LABEL_NAMES.index(v) if v in LABEL_NAMES else v
        if v == "-":  # MultiNLI's own files: no annotator consensus, unlabelled
            v = -1
        if isinstance(v, str):  # "1", "-1"; a text int() refuses ("--1", "²") stays text
            with contextlib.suppress(ValueError):
                v = int(v)
        if isinstance(v, float) and v.is_integer():  # a CSV column Arrow read as float
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < 2**62:
            shown = "an empty label" if v is None or v == "" else f"label {v!r}"  # not None
            raise DataError(
                f"{source}: {shown} in column {cfg.label_column!r} (row {i}) is not a "
                f"class id (0, 1, ...; {'/'.join(LABEL_NAMES)} are 0/1/2) or -1 / '-' "
                "(unlabelled, dropped); fix the file or point --label-column at the right column"
            )
        labels[i] = v
    return text[0], text[1], labels


def _class_names(table: pa.Table, column: str) -> list[str] | None:
    """The class names a Hugging Face ``datasets`` table records for its integer label
    ``column`` (a ``ClassLabel``, in the schema's ``huggingface`` metadata), where every
    one is an NLI label of :data:`LABEL_NAMES`: its ids are read by name (a
    ``class_encode_column`` sorts them, contradiction=0). Other names leave the ids as
    the class ids they are; None without such metadata."""
    try:
        meta = json.loads((table.schema.metadata or {}).get(b"huggingface", b"{}"))
        feature = meta["info"]["features"][column]
    except (ValueError, KeyError, TypeError):
        return None
    if not isinstance(feature, dict):
        return None
    names = feature.get("names")
    if feature.get("_type") != "ClassLabel" or not isinstance(names, list) or not names:
        return None
    return names if all(n in LABEL_NAMES for n in names) else None


def _sentences(table: pa.Table, column: str, source: str) -> list[str]:
    """A sentence column as text: a null is an empty sentence (noted), bytes are UTF-8 text (a CSV
    Arrow could not read as UTF-8, a parquet binary column), numbers their digits; a list
    or a mapping, or bytes that are not UTF-8, are refused naming the row (``str()`` of
    them trained on ``"b'...'"`` and ``"['a', ...]"`` without a word)."""
    out = []
    for i, v in enumerate(table.column(column).to_pylist()):
        if isinstance(v, bytes):
            try:
                v = v.decode("utf-8")
            except UnicodeDecodeError:
                raise DataError(
                    f"{source}: column {column!r} (row {i}) is not UTF-8 text; save the file "
                    "as UTF-8"
                ) from None
        elif isinstance(v, (list, dict)):
            raise DataError(
                f"{source}: column {column!r} (row {i}) holds a {type(v).__name__}, not a "
                "sentence; point the column flag at the text"
            )
        out.append("" if v is None else str(v))
    empty = sum(not v for v in out)  # a null, or an empty CSV cell (Arrow reads it as "")
    if empty:  # trained on as "", said as the dropped and truncated rows are
        note(f"{source}: {empty} of {len(out)} rows have no {column!r} (null or empty): "
             "read as empty")  # fmt: skip
    return out


def _clean(raw: Raw, source: str, limit: int | None) -> Raw:
    premises, hypotheses, labels = raw
    keep = np.flatnonzero(labels >= 0)[:limit]
    return [premises[i] for i in keep], [hypotheses[i] for i in keep], labels[keep]


def _load_hub(cfg: MNLIDataConfig) -> dict[str, tuple[str, pa.Table]]:
    import datasets

    try:
        with quiet_hub():
            dsd = datasets.load_dataset(cfg.dataset, cfg.dataset_config)
    except Exception as exc:
        if "BuilderConfig" in str(exc) and "not found" in str(exc):  # no such config there
            raise DataError(
                f"dataset {cfg.dataset!r} has no config {cfg.dataset_config!r} "
                f"({first_line(exc)}); pass --set data.dataset_config=NAME"
            ) from None
        raise _hub_error(exc, f"dataset {cfg.dataset!r} (config {cfg.dataset_config!r})") from exc
    evals = sorted(s for s in dsd if s.startswith("validation"))
    if "train" not in dsd or not evals:
        raise DataError(
            f"hub dataset {cfg.dataset!r} has splits {list(dsd)}; need 'train' and "
            "'validation*'. Use --train-file/--eval-file for other layouts."
        )
    return {
        s: (f"{cfg.dataset}/{cfg.dataset_config}:{s}", dsd[s].with_format("arrow")[:])
        for s in ["train", *evals]
    }


# ---------------------------------------------------------------- encoding


def encode_pairs(
    tok: Tokenizer,
    premises: list[str],
    hypotheses: list[str],
    labels: np.ndarray | list[int],
    chunk: int = 8192,
    source: str = "the data",
) -> EncodedSplit:
    """Encode `[CLS] premise [SEP] hypothesis [SEP]` with a `prepare_tokenizer`-ed tokenizer."""
    if tok.padding is None or tok.padding.get("length") is None:
        raise ValueError("call prepare_tokenizer(tok, max_length) before encode_pairs")
    n, length = len(premises), tok.padding["length"]
    ids = np.empty((n, length), dtype=np.int32)
    types = np.empty((n, length), dtype=np.int8)
    mask = np.empty((n, length), dtype=np.bool_)
    truncated = 0
    for start in range(0, n, chunk):
        pairs = list(
            zip(premises[start : start + chunk], hypotheses[start : start + chunk], strict=True)
        )
        try:
            encoded = tok.encode_batch(pairs)
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise DataError(
                f"{source}: the tokenizer cannot encode it ({first_line(e)}); check --tokenizer"
            ) from None
        for i, enc in enumerate(encoded, start):
            if len(enc.ids) != length:  # its specials alone pass the length: no truncation fits
                raise DataError(
                    f"{source}: the tokenizer made a pair of {len(enc.ids)} tokens where "
                    f"data.max_length={length} (its template adds more special tokens than "
                    "that leaves room for); raise data.max_length or check --tokenizer"
                )
            ids[i], types[i], mask[i] = enc.ids, enc.type_ids, enc.attention_mask
            truncated += bool(enc.overflowing)
    if truncated:
        note(f"{source}: truncated {truncated} of {n} pairs to data.max_length={length} tokens")
    return EncodedSplit(
        torch.from_numpy(ids),
        torch.from_numpy(types),
        torch.from_numpy(mask),
        torch.as_tensor(np.asarray(labels, dtype=np.int64)),
    )


def load_mnli(cfg: MNLIDataConfig) -> MNLIData:
    """Load, validate and encode train and eval splits as `cfg` says (see module docstring).

    Local data files are read and checked before the tokenizer loads, and a local
    tokenizer before the hub's dataset: a wrong path or column is reported at once, not
    after a download or the hub's retries."""
    raws: dict[str, tuple[str, Raw]] = {}
    if cfg.train_file is not None:
        files = {"train": cfg.train_file, **(cfg.eval_files or {})}
        text = (cfg.premise_column, cfg.hypothesis_column)
        raws = {s: (p, _columns(_read_table(p, text), p, cfg)) for s, p in files.items()}
    if cfg.dataset == GENERATED and cfg.tokenizer == DEFAULT_TOKENIZER:
        tok, tok_name = build_generated_tokenizer(), GENERATED
    else:
        tok, tok_name = load_tokenizer(cfg.tokenizer), cfg.tokenizer
    try:
        pad_id = prepare_tokenizer(tok, cfg.max_length)
    except DataError as e:  # its message names no tokenizer and no flag
        raise DataError(f"--tokenizer {tok_name}: {e} (data.tokenizer)") from None
    if cfg.train_file is None and cfg.dataset == GENERATED:
        for split, n in (("train", cfg.generated_train), ("validation", cfg.generated_eval)):
            ex = generate_examples(n, cfg.seed, split, cfg.generated_vocab)
            raws[split] = (
                f"generated:{split}",
                (ex["premise"], ex["hypothesis"], np.asarray(ex["label"], dtype=np.int64)),
            )
    elif cfg.train_file is None:  # the hub's after the tokenizer: a bad local one fails first
        raws = {s: (src, _columns(t, src, cfg)) for s, (src, t) in _load_hub(cfg).items()}
    enc = {}
    for split, (src, raw) in raws.items():
        limit = cfg.max_train_examples if split == "train" else cfg.max_eval_examples
        cleaned = _clean(raw, src, limit)
        if not len(cleaned[2]):  # an empty eval split would score 0 loss and 0 accuracy
            raise DataError(
                f"{src} ({split}) holds no labelled example (0/1/2) of its {len(raw[2])} rows"
                + (
                    f" under data.max_{'train' if split == 'train' else 'eval'}_examples={limit}"
                    if limit is not None
                    else ""
                )  # fmt: skip
                + "; fix the file, or drop the split"
            )
        dropped = int((raw[2] < 0).sum())
        if dropped:
            note(f"{src}: dropped {dropped} of {len(raw[2])} rows labelled -1 or '-' "
                 "(unlabelled)")  # fmt: skip
        enc[split] = encode_pairs(tok, *cleaned, source=src)
        log.info("%s: %d examples encoded to length %d", src, len(enc[split]), cfg.max_length)
    train = enc.pop("train")
    return MNLIData(
        train=train,
        eval=enc,
        vocab_size=tok.get_vocab_size(with_added_tokens=True),
        pad_id=pad_id,
        tokenizer_path_or_name=tok_name,
    )
