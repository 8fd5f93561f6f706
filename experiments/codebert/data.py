"""Corpora for CodeBERT pretraining, prepared by :mod:`loaders.prepare` and cached.

``stdlib_corpus`` turns the running interpreter's standard library (Python source found on
every machine, no network) into three sub-datasets by file kind: ``modules`` (top-level
``*.py``), ``packages`` (``*.py`` inside packages) and ``tests`` (files under a ``test`` or
``tests`` folder), with one byte-level BPE trained on them all. ``corpus_from_paths``
prepares any ``NAME=PATH`` folders the same way: their source files by suffix
(:data:`SOURCE_SUFFIXES`, any language) or by a glob of the caller's (a folder already
prepared by ``python -m loaders.prepare --heldout F`` is used as it is), and
``corpus_from_hub`` a hub
dataset's configs (CodeSearchNet's six languages). Each sub-dataset gets ``train/`` and
``heldout/`` (a fixed fraction of files, by a hash of the path). Files longer than
``max_doc_tokens`` are cut into pieces (documents of their own), so sub-dataset mixing is
exact to within one piece rather than one whole file.
"""

from __future__ import annotations

import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from comera.errors import DataError, MissingFileError, first_line
from experiments.hub import hub_unreachable, offline_tip, quiet_hub
from experiments.notes import note
from loaders.metadata import METADATA_NAME
from loaders.prepare import (
    COMPRESSED_SUFFIXES,
    PLAN_NAME,
    Doc,
    PrepareError,
    drop_link_twins,
    file_identity,
    heldout_docs,
    hidden_path,
    is_binary,
    prepare,
    tokenizer_digest,
    train_tokenizer,
)
from loaders.text import TEXT_SUFFIXES

__all__ = [
    "CODESEARCHNET_LANGUAGES",
    "SOURCE_SUFFIXES",
    "Corpus",
    "corpus_from_hub",
    "corpus_from_paths",
    "stdlib_corpus",
    "stdlib_groups",
    "tokenizer_info",
]

CODESEARCHNET_LANGUAGES = ("python", "java", "javascript", "php", "ruby", "go")
# what a ``--corpus NAME=FOLDER`` contributes when no glob is given: the source files of
# CodeSearchNet's six languages and their common neighbours, outside hidden folders
SOURCE_SUFFIXES = (
    ".py", ".pyi", ".js", ".jsx", ".mjs", ".cjs", ".ts", ".tsx", ".java", ".kt", ".kts",
    ".scala", ".groovy", ".go", ".rb", ".php", ".c", ".h", ".cc", ".cpp", ".cxx", ".hpp",
    ".hh", ".cs", ".fs", ".rs", ".swift", ".m", ".mm", ".dart", ".lua", ".pl", ".pm", ".r",
    ".jl", ".hs", ".ml", ".ex", ".exs", ".erl", ".clj", ".sh", ".bash", ".zsh", ".ps1",
    ".sql", ".vue", ".svelte",
)  # fmt: skip
SPECIALS = ("<s>", "<pad>", "</s>", "<unk>", "<mask>")


@dataclass
class Corpus:
    """Prepared sub-datasets: ``train[name]`` and ``heldout[name]`` folders and the
    tokenizer (a ``tokenizer.json`` path or a hub name)."""

    root: Path
    tokenizer: str
    train: dict[str, Path]
    heldout: dict[str, Path]


def tokenizer_info(tokenizer: str) -> tuple[int, dict[str, int | None]]:
    """Vocabulary size and the ids of RoBERTa's specials (``None`` when absent) of a local
    ``tokenizer.json`` (or a folder holding one) or a hub tokenizer (needs the network or
    a warm cache, and ``transformers`` for repos without a ``tokenizer.json``)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if path.is_dir():
        path = path / "tokenizer.json"
    if path.is_file():
        try:
            tok = Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise DataError(f"data.tokenizer={tokenizer!r}: {path} is not a tokenizer.json "
                            f"({first_line(exc)})") from None  # fmt: skip
        return tok.get_vocab_size(), {t: tok.token_to_id(t) for t in SPECIALS}
    try:
        import transformers

        with quiet_hub():
            hf = transformers.AutoTokenizer.from_pretrained(tokenizer)
        ids = {t: hf.convert_tokens_to_ids(t) for t in SPECIALS}
        return len(hf), {t: (i if i != hf.unk_token_id or t == "<unk>" else None)
                         for t, i in ids.items()}  # fmt: skip
    except ImportError:
        pass
    except Exception as exc:
        raise _tokenizer_error(tokenizer, exc) from exc
    try:
        with quiet_hub():
            tok = Tokenizer.from_pretrained(tokenizer)
    except Exception as exc:
        raise _tokenizer_error(tokenizer, exc) from exc
    return tok.get_vocab_size(), {t: tok.token_to_id(t) for t in SPECIALS}


def _tokenizer_error(tokenizer: str, exc: Exception) -> DataError:
    """One line for a tokenizer that would not load; an unreachable hub says how to work
    offline."""
    tip = offline_tip() if hub_unreachable(exc) else ""
    return DataError(f"data.tokenizer={tokenizer!r}: cannot load it ({first_line(exc)}); "
                     "pass a local tokenizer.json" + (f" ({tip})" if tip else ""))  # fmt: skip


def stdlib_groups(max_files: int | None = None) -> dict[str, list[Path]]:
    """The standard library's ``*.py`` files by kind (sorted; ``max_files`` per group,
    spread evenly over the sorted list)."""
    lib = Path(sysconfig.get_paths()["stdlib"])
    groups: dict[str, list[Path]] = {"modules": [], "packages": [], "tests": []}
    for path in sorted(lib.rglob("*.py")):
        rel = path.relative_to(lib).parts
        if rel[0] in ("site-packages", "dist-packages") or "__pycache__" in rel:
            continue
        if any(p in ("test", "tests") for p in rel[:-1]):
            groups["tests"].append(path)
        elif len(rel) == 1:
            groups["modules"].append(path)
        else:
            groups["packages"].append(path)
    if max_files:
        for name, files in groups.items():
            step = max(1, len(files) // max_files)
            groups[name] = files[::step][:max_files]
    return groups


def _file_key(path: str) -> str:
    """A tokenizer's identity for cache keys: path, size and mtime of a local file (so a
    retrained file at the same path is a new key), the name of a hub one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if p.is_file():
        st = p.stat()
        return f"{p.resolve()}:{st.st_size}:{st.st_mtime_ns}"
    return path


def _stamp(path: Path) -> str:
    """A corpus file's identity for cache keys: its path, size and mtime."""
    st = Path(path).stat()
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _digest(*parts: object) -> str:
    return hashlib.blake2b("|".join(map(str, parts)).encode(), digest_size=8).hexdigest()


def _prepare_groups(
    groups: dict[str, list[Path]], root: Path, vocab: int, heldout: float,
    max_doc_tokens: int | None, progress: bool, tokenizer: str | None = None,
) -> Corpus:  # fmt: skip
    """Files by group -> prepared sub-datasets; a BPE of ``vocab`` is trained on the
    training files of all groups unless ``tokenizer`` is given."""
    # each file with its size and mtime: an edited file (or a Python upgrade's stdlib) is a
    # new corpus, not the tokens and BPE of the old one served again
    key = json.dumps({k: [_stamp(p) for p in v] for k, v in groups.items()}, sort_keys=True)
    # 3: no held-out file in the BPE; held-out keys relative to the corpus root
    root = root / _digest(key, vocab if tokenizer is None else _file_key(tokenizer), heldout,
                          max_doc_tokens, 3)  # fmt: skip
    if tokenizer is not None:
        # loaded here first: prepare's own load of a hub name offline retried for a minute
        # aloud, then named neither data.tokenizer nor how to work offline
        tokenizer_info(tokenizer)
    tok = tokenizer
    if tok is None:
        tok = str(root / "tokenizer.json")
        if not Path(tok).is_file():
            docs = []  # what prepare will train on: each group minus its held-out files
            for files in groups.values():
                group = [Doc(str(p)) for p in files]
                held = heldout_docs(group, heldout)
                docs += [d for d in group if d not in held]
            texts = (Path(d.path).read_text(encoding="utf-8", errors="replace") for d in docs)
            train_tokenizer(texts, vocab, Path(tok))
    for name, files in groups.items():
        if not files:
            raise DataError(f"corpus group {name!r} has no file")
        prepare([str(p) for p in files], root / name, tokenizer=tok, heldout=heldout,
                docs_per_shard=200, workers=1, max_doc_tokens=max_doc_tokens,
                progress=progress)  # fmt: skip
    return Corpus(
        root=root,
        tokenizer=tok,
        train={n: root / n / "train" for n in groups},
        heldout={n: root / n / "heldout" for n in groups},
    )


def stdlib_corpus(
    root: Path, *, vocab: int, heldout: float = 0.05, max_files: int | None = None,
    max_doc_tokens: int | None = None, tokenizer: str | None = None, progress: bool = True,
) -> Corpus:  # fmt: skip
    """The standard library as a pretraining corpus (see the module docstring)."""
    groups = stdlib_groups(max_files)
    return _prepare_groups(groups, root, vocab, heldout, max_doc_tokens, progress, tokenizer)


def _prepared_sources(folder: Path, plan: dict) -> list[Path]:
    """The local files a prepared folder was made from, as far as they can still be found
    (its folder sources listed again with its glob, its file sources themselves; a source
    no longer where the plan says is left out): a raw group holding one of them could
    train on a file the folder holds out."""
    settings = plan.get("settings", {})
    glob = settings.get("glob")
    # absolute paths only: a plan's relative sources are relative to wherever prepare ran
    # (a plan from before source_paths keeps only those as typed)
    sources = plan.get("source_paths", settings.get("sources"))
    found: list[Path] = []
    mine = folder.resolve()  # its own output, if it lies inside a source
    for src in sources if isinstance(sources, list) else []:
        path = Path(src) if isinstance(src, str) and os.path.isabs(src) else None
        if path is not None and path.is_file():
            found.append(path)
        elif path is not None and path.is_dir() and isinstance(glob, str):
            try:
                found += [p for p in path.glob(glob) if p.is_file()
                          and not p.resolve().is_relative_to(mine)]  # fmt: skip
            except ValueError:  # a pattern this Python's glob refuses: nothing to compare
                continue
    return found


def _prepared(name: str, folder: Path) -> tuple[str, dict]:
    """The tokenizer and plan of a folder made by ``python -m loaders.prepare`` (checked:
    readable, with a held-out split, complete, its tokenizer unchanged)."""
    try:
        plan = json.loads((folder / PLAN_NAME).read_text())
        if not isinstance(plan, dict) or not isinstance(plan.get("settings", {}), dict):
            raise ValueError("not a JSON object with a settings object")
    except (OSError, ValueError) as e:
        raise DataError(
            f"--corpus {name}={folder}: its {PLAN_NAME} is unreadable ({e}); rerun "
            "python -m loaders.prepare into a fresh folder"
        ) from None
    if not plan.get("settings", {}).get("heldout"):
        raise DataError(f"--corpus {name}={folder}: prepared without --heldout; rerun "
                        "python -m loaders.prepare with --heldout F")  # fmt: skip
    for split in ("train", "heldout"):  # doc_counts.json is written when a split is complete
        if not (folder / split / METADATA_NAME).is_file():
            raise DataError(f"--corpus {name}={folder}: its {split} split is incomplete (no "
                            f"{METADATA_NAME}); rerun python -m loaders.prepare with the same "
                            "arguments to finish it")  # fmt: skip
    tok = plan.get("tokenizer")
    if not isinstance(tok, str):
        raise DataError(f"--corpus {name}={folder}: its {PLAN_NAME} names no tokenizer; "
                        "rerun python -m loaders.prepare into a fresh folder")  # fmt: skip
    if not Path(tok).is_file() and (folder / "tokenizer.json").is_file():
        tok = str(folder / "tokenizer.json")  # a trained tokenizer, folder moved since
    saved = plan.get("tokenizer_digest")  # a plan written before digests has none
    if saved is not None and tokenizer_digest(tok) not in (None, saved):
        raise DataError(f"--corpus {name}={folder}: its tokenizer {tok} changed since the "
                        "folder was prepared (its ids would not match the shards'); restore "
                        "it, or prepare the folder again")  # fmt: skip
    return tok, plan


def _split_settings(plan: dict) -> dict:
    """The held-out fraction and piece length (``max_doc_tokens``, None: whole files) a
    ``loaders.prepare`` plan records."""
    settings = plan.get("settings", {})
    return {"heldout": settings.get("heldout"), "max_doc_tokens": settings.get("max_doc_tokens")}


def group_settings(folder: Path) -> dict:
    """The held-out fraction and piece length a prepared group's folder
    (``loaders.prepare``'s output) was made with."""
    return _split_settings(json.loads((Path(folder) / PLAN_NAME).read_text()))


def _note_prepared(
    name: str, folder: str, plan: dict, heldout: float, max_doc_tokens: int | None
) -> None:
    """Say on stderr which of the run's data settings a prepared folder does not follow
    (its own held-out split and piece length serve): ``config.json`` records the run's."""
    theirs = _split_settings(plan)
    mine = {"heldout": heldout, "max_doc_tokens": max_doc_tokens}
    differ = [k for k in mine if theirs[k] != mine[k]]
    if differ:
        what = "; ".join(f"data.{k}={mine[k]} not applied (the folder's: {theirs[k]})"
                         for k in differ)  # fmt: skip
        note(f"--corpus {name}={folder} was prepared by loaders.prepare and is used as it is: "
             f"{what}")  # fmt: skip


def source_files(folder: Path, glob: str | None = None) -> list[Path]:
    """The files of ``folder`` matching ``glob`` (relative, ``**`` recursive), or with no
    glob every file with a :data:`SOURCE_SUFFIXES` suffix; outside hidden folders the glob
    does not name, binary files (:func:`is_binary`) left out; sorted."""
    return [p for p in _candidates(folder, glob) if not is_binary(p)]


def _candidates(folder: Path, glob: str | None) -> list[Path]:
    """:func:`source_files` before binary files are left out."""
    found = folder.glob(glob) if glob else (
        p for p in folder.rglob("*") if p.suffix.lower() in SOURCE_SUFFIXES)  # fmt: skip
    return sorted(p for p in found if not hidden_path(p, folder, glob) and p.is_file())


def _linked_twins(name: str, folder: str, files: list[Path]) -> list[Path]:
    """``files`` with links to a file already listed dropped (a link is read as its
    target: a twin could be held out while its target trains); said on stderr."""
    out, twins = drop_link_twins(files)
    if twins:
        note(f"--corpus {name}={folder}: {twins} files are links to files already in it; "
             "each is read once")  # fmt: skip
    return out


def corpus_from_paths(
    paths: dict[str, str], root: Path, *, vocab: int, heldout: float = 0.05,
    glob: str | None = None, max_doc_tokens: int | None = None, tokenizer: str | None = None,
    progress: bool = True, globs: dict[str, str] | None = None,
) -> Corpus:  # fmt: skip
    """``{name: folder}`` as sub-datasets: a folder of source files is prepared and cached
    (its files by :func:`source_files`: ``globs[name]``, else ``glob``, else every source
    suffix; binary files left out, said); a folder ``loaders.prepare`` made is used as it
    is (its tokenizer then serves every sub-dataset, so all such folders must share one).
    A folder in which nothing matches is an error naming the pattern, and so are two
    groups that share a file (each draws its held-out files apart, so a file could train
    in one and be held out in the other; a prepared folder's files are its sources',
    :func:`_prepared_sources`)."""
    groups, ready, toks = {}, {}, set()
    owner: dict[tuple[int, int] | Path, str] = {}

    def own(name: str, files: list[Path]) -> None:
        for p in files:
            other = owner.setdefault(file_identity(p), name)  # hard links too
            if other != name:
                raise DataError(
                    f"--corpus {other} and --corpus {name} share files ({p}); a file in two "
                    "groups could train in one and be held out in the other: give folders "
                    "(or globs) that do not overlap"
                )

    for name, folder in paths.items():
        path = Path(folder)
        if not path.is_dir():
            where = (
                ""
                if path.is_absolute()
                # a run saved before folders were absolute
                else (f" under {os.getcwd()} (a relative folder: run from where the run started)")
            )
            if not path.exists():  # a resume adds how to go on (the experiment's moved_hint)
                raise MissingFileError(f"--corpus {name}={folder}: no such folder{where}")
            raise DataError(f"--corpus {name}={folder}: not a folder{where}; pass NAME=FOLDER")
        if (path.parent / PLAN_NAME).is_file() and not (path / PLAN_NAME).is_file():
            # a split of a prepared folder: read as raw files it held no source file
            raise DataError(
                f"--corpus {name}={folder} is the {path.name!r} split of the loaders.prepare "
                f"output {path.parent}; pass that folder (--corpus {name}={path.parent}): the "
                "run takes its train and held-out splits"
            )
        if (path / PLAN_NAME).is_file():
            if (globs or {}).get(name):  # ignored without a word: the folder's files are fixed
                raise DataError(
                    f"--corpus {name}={folder}:{globs[name]}: {folder} was prepared by "  # type: ignore[index]
                    "loaders.prepare, whose files are fixed; drop the :GLOB (or prepare with "
                    "--glob; a run saved with the :GLOB cannot resume: start it again)"
                )
            tok, plan = _prepared(name, path)
            _note_prepared(name, folder, plan, heldout, max_doc_tokens)
            ready[name] = path
            saved = plan.get("tokenizer_digest")  # (name, digest): one name may be two files
            toks.add((tok, saved if isinstance(saved, str) else None))
            own(name, _prepared_sources(path, plan))
            continue
        pattern = (globs or {}).get(name) or glob
        try:
            found = _candidates(path, pattern)
        except ValueError as e:  # Path.glob's "Invalid pattern" ('**.py')
            raise DataError(f"--corpus {name}={folder}:{pattern}: {e}; e.g. **/*.py") from None
        text = [p for p in found if not is_binary(p)]
        if found and not text:
            packed = [p for p in found if p.name.endswith(COMPRESSED_SUFFIXES)]
            fix = (f"decompress them first ({packed[0].name}, ...; a .jsonl file's rows are "
                   "documents once loaders.prepare has made them a prepared folder)" if packed
                   else "name the text files with a glob, or convert them to UTF-8")  # fmt: skip
            raise DataError(f"--corpus {name}={folder}: none of its {len(found)} files is UTF-8 "
                            f"text (binary, compressed or another encoding); {fix}")  # fmt: skip
        if len(text) < len(found):  # their text would train as replacement marks
            skipped = next(p for p, q in zip(found, [*text, None], strict=False) if p != q)
            note(
                f"--corpus {name}={folder}: left out {len(found) - len(text)} files that are "
                f"not UTF-8 text (binary or another encoding), e.g. {skipped}"
            )
        groups[name] = _linked_twins(name, folder, text)
        own(name, groups[name])
        if not groups[name]:
            what = (
                f"no file matches {pattern!r}"
                if pattern
                else f"no source file (suffixes {', '.join(SOURCE_SUFFIXES[:6])}, ... ; "
                "see experiments.codebert.data.SOURCE_SUFFIXES)"
            )
            raise DataError(
                f"--corpus {name}={folder}: {what}; name the files with "
                f"--corpus {name}={folder}:GLOB (e.g. {name}={folder}:**/*.txt)"
            )
        tables = [p for p in groups[name] if p.suffix in TEXT_SUFFIXES]
        if tables:  # prepare would read them as tables of rows, not as one document each
            raise DataError(
                f"--corpus {name}={folder}: {tables[0].name} (and {len(tables) - 1} more) is a "
                f"table file ({', '.join(TEXT_SUFFIXES)}); a folder's files are documents: "
                "prepare a table with python -m loaders.prepare FILE --out DIR --heldout "
                f"{heldout} (and --tokenizer or --train-tokenizer), then pass --corpus {name}=DIR"
            )
        if len(groups[name]) < 2:  # one file is all train or all held out
            raise DataError(
                f"--corpus {name}={folder}: {len(groups[name])} file; a group needs at least "
                "2, one of them held out (data.heldout)"
            )
    # one tokenizer by its content (a folder, its tokenizer.json, a trailing slash: one
    # file; a prepared folder's as its plan saved it), or a hub name by its name
    keys = {
        d or tokenizer_digest(t) or t: t for t, d in sorted(toks, key=lambda x: (x[0], x[1] or ""))
    }
    if len(keys) > 1:
        raise DataError(f"--corpus folders were prepared with different tokenizers "
                        f"{sorted(keys.values())}; prepare them with one --tokenizer")  # fmt: skip
    if tokenizer is not None and keys and (tokenizer_digest(tokenizer) or tokenizer) not in keys:
        theirs = next(iter(keys.values()))
        if Path(theirs).exists():  # a path relative to where prepare ran: not from here
            theirs = str(Path(theirs).resolve())
        raise DataError(f"data.tokenizer={tokenizer} is not the tokenizer the prepared --corpus "
                        f"folders were made with ({theirs}); pass --set data.tokenizer={theirs}, "
                        "or prepare them with --tokenizer "
                        f"{tokenizer}")  # fmt: skip
    # the caller's own spelling where it names the same file: the plan's may be relative
    # to wherever prepare ran
    tok = tokenizer if tokenizer is not None else next(iter(keys.values()), None)
    if tokenizer is None and tok is not None and Path(tok).exists():  # vocab: a new BPE's
        theirs = tokenizer_info(tok)[0]
        if theirs != vocab:
            raws = ", the raw folders' too" if groups else ""
            note(f"data.vocab={vocab} not applied: the prepared --corpus folders' tokenizer "
                 f"({tok}, {theirs:,} tokens) tokenizes every group{raws}")  # fmt: skip
    if groups:
        corpus = _prepare_groups(groups, root, vocab, heldout, max_doc_tokens, progress, tok)
    else:
        corpus = Corpus(root=root, tokenizer=str(tok), train={}, heldout={})
    for name, folder in ready.items():
        corpus.train[name], corpus.heldout[name] = folder / "train", folder / "heldout"
    return corpus


def corpus_from_hub(
    dataset: str, configs: tuple[str, ...], root: Path, *, tokenizer: str, text_column: str,
    heldout: float = 0.05, max_doc_tokens: int | None = None, progress: bool = True,
) -> Corpus:  # fmt: skip
    """One sub-dataset per hub config (CodeSearchNet: one per language), tokenized with a
    given tokenizer (e.g. ``microsoft/codebert-base``); needs the network or a warm cache."""
    root = root / _digest(dataset, configs, tokenizer, text_column, heldout, max_doc_tokens)
    for name in configs:
        try:
            prepare([f"hub:{dataset}"], root / name, tokenizer=tokenizer,
                    text_column=text_column, heldout=heldout, hub_config=name,
                    max_doc_tokens=max_doc_tokens,
                    workers=max(1, (os.cpu_count() or 2) // 2), progress=progress)  # fmt: skip
        except PrepareError as e:  # offline: the route this command takes for local data
            raise DataError(
                f"{e}. Offline, prepare a local copy into token shards (python -m "
                f"loaders.prepare FILE --out DIR --tokenizer TOKENIZER_DIR --text-column "
                f"{text_column} --heldout {heldout}, TOKENIZER_DIR a local copy of "
                f"{tokenizer}) and pass --corpus {name}=DIR --set data.tokenizer=TOKENIZER_DIR"
                f" (where a command has no --corpus, as experiments.ablate: --set data.source="
                f'paths --set \'data.paths={{"{name}": "DIR"}}\')'
            ) from None
    return Corpus(
        root=root,
        tokenizer=tokenizer,
        train={n: root / n / "train" for n in configs},
        heldout={n: root / n / "heldout" for n in configs},
    )
