"""Packing: documents laid end to end into fixed-length rows, BOS/EOS around each.

A document is emitted as the stream ``[BOS] + tokens + [EOS]`` (either marker optional);
a cursor's ``offset`` counts tokens of that stream already emitted, so a document split
across rows (or across a checkpoint, or moved to another reader by a rescale) continues at
exactly the next token. Rows are filled by slice copies into a preallocated buffer; no
per-token Python. Each row also gets segment ids: 1, 2, ... per document piece in the row,
0 for padding, so attention can be masked to stay inside a document. With provenance on,
each token also gets its document's id and its offset in that document's stream.
"""

from __future__ import annotations

import numpy as np
import torch


def stream_len(num_tokens: int, bos: int | None, eos: int | None) -> int:
    """Length of a document's emitted stream with its BOS/EOS markers."""
    return num_tokens + (bos is not None) + (eos is not None)


def write_piece(
    row: np.ndarray, pos: int, toks: np.ndarray, off: int, bos: int | None, eos: int | None
) -> int:
    """Copy the document stream from ``off`` into ``row[pos:]``; return tokens written."""
    n = len(toks)
    hb = 1 if bos is not None else 0
    total = n + hb + (eos is not None)
    take = min(total - off, len(row) - pos)
    end = off + take
    p = pos
    if hb and off == 0:
        row[p] = bos
        p += 1
    body0, body1 = max(off - hb, 0), min(end - hb, n)
    if body1 > body0:
        row[p : p + body1 - body0] = toks[body0:body1]
        p += body1 - body0
    if eos is not None and end == total:
        row[p] = eos
    return take


class BatchBuffer:
    """A (batch_size, row_len) batch being filled row by row."""

    __slots__ = ("ids", "seg", "doc", "off", "row", "pos", "piece", "pad_id")

    def __init__(
        self, batch_size: int, row_len: int, dtype: np.dtype, pad_id: int,
        provenance: bool = False,
    ) -> None:  # fmt: skip
        self.ids = np.empty((batch_size, row_len), dtype=dtype)  # (B, T)
        self.seg = np.zeros((batch_size, row_len), dtype=np.int32)  # (B, T)
        self.doc = np.full((batch_size, row_len), -1, np.int64) if provenance else None
        self.off = np.full((batch_size, row_len), -1, np.int64) if provenance else None
        self.row = self.pos = self.piece = 0
        self.pad_id = pad_id

    @property
    def full(self) -> bool:
        return self.row == self.ids.shape[0]

    def put(
        self, toks: np.ndarray, off: int, bos: int | None, eos: int | None, doc: int = -1
    ) -> int:
        """Append a piece of document ``doc`` to the current row; return tokens written."""
        take = write_piece(self.ids[self.row], self.pos, toks, off, bos, eos)
        self.piece += 1
        self.seg[self.row, self.pos : self.pos + take] = self.piece
        if self.doc is not None:
            self.doc[self.row, self.pos : self.pos + take] = doc
            self.off[self.row, self.pos : self.pos + take] = np.arange(off, off + take)
        self.pos += take
        if self.pos == self.ids.shape[1]:
            self.row, self.pos, self.piece = self.row + 1, 0, 0
        return take

    def finish(self) -> int:
        """Pad the partial row; return the number of rows holding any token."""
        rows = self.row
        if self.pos:
            self.ids[self.row, self.pos :] = self.pad_id
            self.seg[self.row, self.pos :] = 0
            if self.doc is not None:
                self.doc[self.row, self.pos :] = self.off[self.row, self.pos :] = -1
            rows += 1
        return rows

    def tensors(self, rows: int | None = None) -> dict[str, torch.Tensor]:
        rows = self.ids.shape[0] if rows is None else rows
        out = {
            "input_ids": torch.from_numpy(self.ids[:rows]),  # (B, T)
            "segment_ids": torch.from_numpy(self.seg[:rows]),  # (B, T), 0 = padding
        }
        if self.doc is not None:
            out["doc_ids"] = torch.from_numpy(self.doc[:rows])  # (B, T), -1 = padding
            out["doc_offsets"] = torch.from_numpy(self.off[:rows])  # (B, T)
        return out
