"""Generated corpora for the loader tests: every token says which document and position it is.

Token of document ``g`` (global id across sub-datasets) at position ``p`` is
``(g + 1) * 1000 + p`` (documents are shorter than 1000 tokens), so any emitted token can be
traced back and exactly-once is a multiset comparison. BOS=1, EOS=2, PAD=0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa

from loaders import DatasetSpec, LoaderConfig

BOS, EOS, PAD = 1, 2, 0


def write_arrow(
    path: Path, docs: list[np.ndarray], *, column: str = "tokens", rows_per_batch: int = 7
) -> None:
    """Write docs as an Arrow IPC file with several record batches."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = pa.array([d.tolist() for d in docs], type=pa.list_(pa.int32()))
    table = pa.table({column: arr})
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as w:
        for batch in table.to_batches(max_chunksize=rows_per_batch):
            w.write_batch(batch)


def make_corpus(
    folder: Path, num_docs: int, *, first_id: int = 0, files: int = 3, seed: int = 0,
    max_len: int = 300, zero_every: int = 0,
) -> dict[int, np.ndarray]:  # fmt: skip
    """A sub-dataset folder (nested) of ``num_docs`` traceable documents; returns them by id."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, max_len, size=num_docs)
    if zero_every:
        lengths[::zero_every] = 0
    docs = {}
    for i, n in enumerate(lengths):
        g = first_id + i
        docs[g] = ((g + 1) * 1000 + np.arange(n)).astype(np.int32)
    ids = list(docs)
    cuts = np.linspace(0, num_docs, files + 1).astype(int)
    for f in range(files):
        part = [docs[g] for g in ids[cuts[f] : cuts[f + 1]]]
        write_arrow(folder / f"sub{f % 2}" / f"part-{f:03d}.arrow", part)
    return docs


def config(specs: list[tuple[str, Path, float]], **kw) -> LoaderConfig:
    base = dict(seq_len=64, batch_size=3, bos_id=BOS, eos_id=EOS, pad_id=PAD, num_shards=35)
    base.update(kw)
    return LoaderConfig(
        datasets=[DatasetSpec(name=n, path=p, weight=w) for n, p, w in specs], **base
    )


def body_tokens(batches: list[dict]) -> np.ndarray:
    """All document tokens (not BOS/EOS/PAD) emitted in ``batches``, in order."""
    if not batches:
        return np.zeros(0, dtype=np.int64)
    ids = np.concatenate([b["input_ids"].numpy().reshape(-1) for b in batches])
    return ids[ids >= 1000]


def expected_tokens(docs: dict[int, np.ndarray], times: int = 1) -> np.ndarray:
    return np.sort(np.concatenate([d for d in docs.values()] * times).astype(np.int64))


def take(it, n: int) -> list[dict]:
    out = []
    for _ in range(n):
        try:
            out.append(next(it))
        except StopIteration:
            break
    return out
