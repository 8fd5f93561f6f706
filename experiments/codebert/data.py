"""Corpora for CodeBERT pretraining, prepared by :mod:`loaders.prepare` and cached.

``stdlib_corpus`` turns the running interpreter's standard library (Python source found on
every machine, no network) into three sub-datasets by file kind: ``modules`` (top-level
``*.py``), ``packages`` (``*.py`` inside packages) and ``tests`` (files under a ``test`` or
``tests`` folder), with one byte-level BPE trained on them all. ``corpus_from_paths``
prepares any ``NAME=PATH`` folders the same way. Each sub-dataset gets ``train/`` and
``heldout/`` (a fixed fraction of files, by a hash of the path). Files longer than
``max_doc_tokens`` are cut into pieces (documents of their own), so sub-dataset mixing is
exact to within one piece rather than one whole file.
"""

from __future__ import annotations

import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from loaders.prepare import Doc, heldout_docs, prepare, train_tokenizer

__all__ = ["Corpus", "corpus_from_paths", "stdlib_corpus", "stdlib_groups"]


@dataclass
class Corpus:
    """Prepared sub-datasets: ``train[name]`` and ``heldout[name]`` folders, a tokenizer."""

    root: Path
    tokenizer: Path
    train: dict[str, Path]
    heldout: dict[str, Path]
    vocab_size: int


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


def _prepare_groups(
    groups: dict[str, list[Path]], root: Path, vocab: int, heldout: float,
    max_doc_tokens: int | None, progress: bool,
) -> Corpus:  # fmt: skip
    key = json.dumps({k: [str(p) for p in v] for k, v in groups.items()}, sort_keys=True)
    key = f"{key}|{vocab}|{heldout}|{max_doc_tokens}|2"  # 2: no held-out file in the BPE
    digest = hashlib.blake2b(key.encode(), digest_size=8).hexdigest()
    root = root / digest
    tok = root / "tokenizer.json"
    if not tok.is_file():
        docs = []  # what prepare will train on: each group minus its held-out files
        for files in groups.values():
            group = [Doc(str(p)) for p in files]
            held = heldout_docs(group, heldout)
            docs += [d for d in group if d not in held]
        texts = (Path(d.path).read_text(encoding="utf-8", errors="replace") for d in docs)
        train_tokenizer(texts, vocab, tok)
    for name, files in groups.items():
        if not files:
            raise ValueError(f"corpus group {name!r} has no file")
        prepare([str(p) for p in files], root / name, tokenizer=str(tok), heldout=heldout,
                docs_per_shard=200, workers=1, max_doc_tokens=max_doc_tokens,
                progress=progress)  # fmt: skip
    from tokenizers import Tokenizer

    size = Tokenizer.from_file(str(tok)).get_vocab_size()
    return Corpus(
        root=root,
        tokenizer=tok,
        train={n: root / n / "train" for n in groups},
        heldout={n: root / n / "heldout" for n in groups},
        vocab_size=size,
    )


def stdlib_corpus(
    root: Path, *, vocab: int, heldout: float = 0.05, max_files: int | None = None,
    max_doc_tokens: int | None = None, progress: bool = True,
) -> Corpus:  # fmt: skip
    """The standard library as a pretraining corpus (see the module docstring)."""
    groups = stdlib_groups(max_files)
    return _prepare_groups(groups, root, vocab, heldout, max_doc_tokens, progress)


def corpus_from_paths(
    paths: dict[str, str], root: Path, *, vocab: int, heldout: float = 0.05,
    glob: str = "**/*.py", max_doc_tokens: int | None = None, progress: bool = True,
) -> Corpus:  # fmt: skip
    """``{name: folder}`` of source files (``glob``) prepared as sub-datasets."""
    groups = {}
    for name, folder in paths.items():
        path = Path(folder)
        if not path.is_dir():
            raise ValueError(f"--corpus {name}={folder}: not a folder; pass NAME=FOLDER")
        groups[name] = sorted(p for p in path.glob(glob) if p.is_file())
    return _prepare_groups(groups, root, vocab, heldout, max_doc_tokens, progress)
