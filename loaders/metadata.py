"""Document counts per file: read from ``doc_counts.json`` or counted once and cached.

Format of ``doc_counts.json`` (in the sub-dataset folder; paths relative to it)::

    {"format": "loaders.doc_counts", "version": 1,
     "files": {"part-000.arrow": {"docs": 1234, "bytes": 5678901, "digest": "9f2c..."}, ...}}

``bytes`` is optional in a hand-written file; when present and different from the file's
size, the entry is stale and the file is recounted. ``digest`` (of the file's bytes) is
written by ``loaders.prepare``: the loader's fingerprint then holds the folder's content
(:func:`content_digest`), so a resume on shards prepared again from changed sources is
refused. Missing entries are counted and the
result is written back next to the data, or to ``cache_dir`` when the folder is read-only.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from loaders.errors import LoaderInputError

METADATA_NAME = "doc_counts.json"
FORMAT = "loaders.doc_counts"
PLAN_NAME = "prepare_plan.json"  # a loaders.prepare output's root holds it


def check_prepared(folder: Path, files: Sequence[Path]) -> None:
    """Refuse to read a ``loaders.prepare`` output other than whole: its root (which holds
    every split, the held-out one too), a split whose run did not finish (no
    ``doc_counts.json``: counting its shards here would write that file and mark the
    split finished), or a split whose Arrow files are not the ones prepare wrote (a file
    copied in, or one deleted). Folders that prepare did not write are not checked."""
    folder = Path(folder)
    if (folder / PLAN_NAME).is_file():
        splits = sorted(p.name for p in folder.iterdir() if p.is_dir())
        raise LoaderInputError(
            f"{folder} is a loaders.prepare output holding its splits ({', '.join(splits)}); "
            f"point the dataset at one of them, e.g. {folder / 'train'}"
        )
    if not (folder.parent / PLAN_NAME).is_file():
        return
    meta = folder / METADATA_NAME
    if not meta.is_file():
        raise LoaderInputError(
            f"{folder}: its loaders.prepare run did not finish (no {METADATA_NAME}); run the "
            "same prepare command again to finish it"
        )
    listed = set(_read(meta))
    held = {f.relative_to(folder).as_posix() for f in files}
    if held != listed:
        odd = sorted(held - listed) or sorted(listed - held)
        what = "not written by prepare" if held - listed else "missing"
        raise LoaderInputError(
            f"{folder}: Arrow files {what} ({', '.join(odd[:3])}); run the prepare command "
            "again, or remove what was added"
        )


def _read(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise LoaderInputError(
            f"doc-count metadata {path} is unreadable ({exc}); fix it or delete it to recount"
        ) from exc
    if not isinstance(data, dict) or not isinstance(data.get("files"), dict):
        raise LoaderInputError(
            f"doc-count metadata {path} lacks a 'files' mapping; expected "
            '{"format": "loaders.doc_counts", "version": 1, "files": {"rel/path": {"docs": N}}}'
        )
    return data["files"]


def atomic_write_text(path: Path, text: str, *, fsync: bool = True) -> None:
    """Write ``text`` to ``path`` via a temp file in the same folder and a rename."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def file_digest(path: Path, chunk: int = 1 << 22) -> str:
    """A digest of a file's bytes (32 hex digits), read ``chunk`` bytes at a time."""
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def content_digest(root: Path, files: Sequence[Path]) -> str | None:
    """A digest of a folder's token files by content, from the per-file ``digest`` that
    ``loaders.prepare`` records in ``doc_counts.json``: equal for a copy or a move of the
    folder, other for shards prepared again from changed sources. None when any file has
    no digest there (a folder prepare did not write, or one written before digests) or
    a size other than the one recorded beside it (the entry is stale); nothing is read but
    the metadata."""
    meta = Path(root) / METADATA_NAME
    if not meta.is_file():
        return None
    try:
        known = _read(meta)
    except LoaderInputError:
        return None  # file_doc_counts reports it
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        rel = f.relative_to(root).as_posix()
        entry = known.get(rel)
        digest = entry.get("digest") if isinstance(entry, dict) else None
        if not isinstance(digest, str) or entry.get("bytes") != f.stat().st_size:
            return None
        h.update(f"{rel}:{digest}|".encode())
    return h.hexdigest()


def _cache_path(root: Path, cache_dir: str | Path) -> Path:
    digest = hashlib.blake2b(
        str(root.resolve()).encode("utf-8", "surrogateescape"), digest_size=8
    ).hexdigest()
    return Path(cache_dir) / f"{root.name}-{digest}.{METADATA_NAME}"


def file_doc_counts(
    root: Path,
    files: Sequence[Path],
    count: Callable[[Path], int],
    *,
    cache_dir: str | Path | None = None,
) -> list[int]:
    """Documents per file, from metadata where valid, else counted and cached."""
    root = Path(root)
    candidates = [root / METADATA_NAME]
    if cache_dir is not None:
        candidates.append(_cache_path(root, cache_dir))
    known: dict[str, dict] = {}
    for c in candidates:
        if c.is_file():
            known.update(_read(c))
    counts, changed = [], False
    for f in files:
        rel = f.relative_to(root).as_posix()
        size = f.stat().st_size
        entry = known.get(rel)
        ok = isinstance(entry, dict) and isinstance(entry.get("docs"), int)
        if ok and entry.get("bytes", size) == size:
            counts.append(entry["docs"])
            continue
        n = count(f)
        known[rel] = {"docs": n, "bytes": size}
        counts.append(n)
        changed = True
    if changed:
        text = json.dumps({"format": FORMAT, "version": 1, "files": known}, indent=1)
        targets = [root / METADATA_NAME]
        if cache_dir is not None:
            Path(cache_dir).mkdir(parents=True, exist_ok=True)
            targets.append(_cache_path(root, cache_dir))
        for t in targets:
            try:
                atomic_write_text(t, text, fsync=False)
                break
            except OSError:
                continue  # read-only data folder: fall back to the cache dir
    return counts
