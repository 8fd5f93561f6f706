"""Document counts per file: read from ``doc_counts.json`` or counted once and cached.

Format of ``doc_counts.json`` (in the sub-dataset folder; paths relative to it)::

    {"format": "loaders.doc_counts", "version": 1,
     "files": {"part-000.arrow": {"docs": 1234, "bytes": 5678901}, ...},
     "content": "tokens1:9f2c..."}

``bytes`` is optional in a hand-written file; when present and different from the file's
size, the entry is stale and the file is recounted, or refused where ``content`` is
present (not the file prepare wrote). ``content`` (a digest of the folder's
documents, in order: their lengths and tokens, whatever the files' layout) is written by
``loaders.prepare``: the loader's fingerprint then holds it (:func:`content_digest`), so
a resume on shards prepared again from changed sources is refused. Missing entries are
counted and the result is written back next to the data, or to ``cache_dir`` when the
folder is read-only (without ``content``: the files are no longer the ones it digested).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from loaders.config import PLAN_NAME, is_int
from loaders.errors import LoaderInputError

METADATA_NAME = "doc_counts.json"
FORMAT = "loaders.doc_counts"


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
    # a split reached through a link (a root of links to prepared splits) is checked as
    # the split it is
    if not any((p / PLAN_NAME).is_file() for p in (folder.parent, folder.resolve().parent)):
        return
    meta = folder / METADATA_NAME
    if not meta.is_file():
        raise LoaderInputError(
            f"{folder}: its loaders.prepare run did not finish (no {METADATA_NAME}); run the "
            "same prepare command again to finish it"
        )
    entries = _read(meta)
    listed = set(entries)
    held = {f.relative_to(folder).as_posix(): f for f in files}
    if held.keys() != listed:
        odd = sorted(held.keys() - listed) or sorted(listed - held.keys())
        what = "not written by prepare" if held.keys() - listed else "missing"
        raise LoaderInputError(
            f"{folder}: Arrow files {what} ({', '.join(odd[:3])}); run the prepare command "
            "again, or remove what was added"
        )
    for rel, f in held.items():
        # a shard replaced by another of the same name: counting it anew rewrote the
        # split's doc_counts.json without its content digest, and a resume trained on
        # other tokens where the document count matched
        want = entries[rel].get("bytes") if isinstance(entries[rel], dict) else None
        if is_int(want) and f.stat().st_size != want:
            raise LoaderInputError(
                f"{folder}: Arrow file {rel} is not the one prepare wrote ({f.stat().st_size:,} "
                f"bytes, it wrote {want:,}); run the prepare command again, or restore the file"
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
        # as an open() would make it: mkstemp's 0600 hid the metadata of a shared folder
        # from its other readers (the shards beside it are 0644)
        if hasattr(os, "fchmod"):  # POSIX
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(fd, 0o666 & ~mask)
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


# the scheme of a content id: ``tokens1:<hex>`` is tokens_digest's; a state or folder of
# another scheme (the byte digests a build before this one wrote) is not compared
CONTENT_SCHEME = "tokens1:"


def is_content_id(value: object) -> bool:
    """Whether ``value`` is a content id of this build's scheme (:data:`CONTENT_SCHEME`)."""
    return isinstance(value, str) and value.startswith(CONTENT_SCHEME)


def read_doc_counts(path: Path) -> dict:
    """A ``doc_counts.json`` as it is, or {} when it is absent, unreadable or no JSON
    object (for readers that then do without it: its digest unknown)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def content_digest(root: Path, files: Sequence[Path]) -> str | None:
    """The folder's token-stream digest that ``loaders.prepare`` records in
    ``doc_counts.json`` (``content``, :func:`loaders.sources.tokens_digest`), while the
    files are the ones it lists at the sizes it lists; else None (a folder prepare did not
    write, one written before digests, or one whose files changed since). Nothing is read
    but the metadata."""
    data = read_doc_counts(Path(root) / METADATA_NAME)  # file_doc_counts reports a damaged one
    content, listed = data.get("content"), data.get("files")
    if not is_content_id(content) or not isinstance(listed, dict):
        return None
    held = {f.relative_to(root).as_posix(): f for f in files}
    if held.keys() != listed.keys():
        return None
    for rel, f in held.items():
        entry = listed[rel]
        if not isinstance(entry, dict) or entry.get("bytes") != f.stat().st_size:
            return None
    return content


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
    # the files loaders.prepare listed beside its content digest: one of another size is
    # not its file, and counting it anew would write the metadata without that digest
    prepared = is_content_id(read_doc_counts(candidates[0]).get("content"))
    counts, changed = [], False
    for f in files:
        rel = f.relative_to(root).as_posix()
        size = f.stat().st_size
        entry = known.get(rel)
        docs = entry.get("docs") if isinstance(entry, dict) else None
        # a file listed with no documents is never opened, so a count of 0 (or a damaged
        # one) taken on trust would drop its documents silently: those are counted
        ok = is_int(docs) and docs > 0
        if ok and entry.get("bytes", size) == size:
            counts.append(docs)
            continue
        wrote = entry.get("bytes") if isinstance(entry, dict) else None
        if prepared and is_int(wrote) and wrote != size:
            raise LoaderInputError(
                f"{root}: Arrow file {rel} is not the one loaders.prepare wrote ({size:,} "
                f"bytes, it wrote {wrote:,}); run the prepare command again, restore the "
                f"file, or delete {candidates[0].name} to count the folder anew"
            )
        n = count(f)
        new = {"docs": n, "bytes": size}
        changed = changed or entry != new
        known[rel] = new
        counts.append(n)
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
