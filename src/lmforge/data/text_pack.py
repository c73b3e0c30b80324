"""Packing tokenized documents into ``seq_length`` samples with document boundaries.

A row holds ``seq_length + 1`` tokens (inputs and shifted labels). Two strategies:

* ``concat`` (pre-training): documents follow each other and a document that does not fit is split:
  its rest opens the next row. No token is padding.
* ``whole`` (SFT): a document that does not fit in the rest of a row opens the next row instead (the
  rest of the row is padding, never trained); a document longer than a row is truncated.

Every document (and the padding) is a segment: position ids restart at each segment, the attention
mask is block-diagonal causal, and ``actual_seq_len`` lists the segment ends, so no token attends
across documents.

The position of a packer is ``(epoch, doc, offset)``: the row index of the document being packed and
how many of its tokens are already in earlier rows. It is all a resume needs: the reader restarts at
``doc`` and only that one document is tokenized again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from lmforge.errors import DataError


@dataclass
class PackPosition:
    epoch: int = 0
    doc: int = 0  # row index (in the source) of the next document to place
    offset: int = 0  # its tokens already placed in earlier rows

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "doc": self.doc, "offset": self.offset}


@dataclass
class PackedRow:
    tokens: np.ndarray  # int64 [S + 1]
    mask: np.ndarray  # uint8 [S + 1]: 1 where the token is trained on as a label
    starts: list[int]  # segment starts in [0, S], the first is 0


class Packer:
    """Fills rows from ``docs(position)``: an iterator of ``(epoch, row index, ids, mask)`` that
    starts at that position's document (and goes on into the next epochs)."""

    def __init__(
        self,
        docs: Callable[[PackPosition], Iterator[tuple[int, int, np.ndarray, np.ndarray]]],
        seq_length: int,
        *,
        strategy: str,
        pad: int,
        position: PackPosition | None = None,
    ) -> None:
        self._open = docs
        self.length = seq_length + 1
        self.strategy = strategy
        self.pad = pad
        self.position = position or PackPosition()
        self.truncated = 0
        # The pass the last placed token came from (None before the first row): the position already
        # points at the next document, which may open the next pass.
        self.placed_epoch: int | None = None
        self._iter: Iterator | None = None
        self._current: tuple[int, int, np.ndarray, np.ndarray] | None = None

    def _doc(self) -> tuple[int, int, np.ndarray, np.ndarray]:
        if self._current is None:
            if self._iter is None:
                self._iter = self._open(self.position)
            for _ in range(1_000_000):
                epoch, index, ids, mask = next(self._iter)
                if ids.size:
                    break
            else:
                raise DataError("a data source yields only empty documents")
            self._current = (epoch, index, ids, mask)
            if (epoch, index) != (self.position.epoch, self.position.doc):
                self.position = PackPosition(epoch, index, 0)
        return self._current

    def _advance(self) -> None:
        self._current = None
        self.position = PackPosition(self.position.epoch, self.position.doc + 1, 0)

    def next_row(self) -> PackedRow:
        n = self.length
        tokens = np.full(n, self.pad, dtype=np.int64)
        mask = np.zeros(n, dtype=np.uint8)
        starts: list[int] = []
        pos = 0
        while pos < n:
            try:
                _, _, ids, dmask = self._doc()
            except StopIteration:  # a finite stream (a validation set) ended: its last row is padded
                if pos == 0:
                    raise
                break
            off = self.position.offset
            remaining, space = ids.size - off, n - pos
            if self.strategy == "whole" and remaining > space and pos > 0:
                break  # the document opens the next row
            take = min(remaining, space)
            self.placed_epoch = self.position.epoch
            tokens[pos : pos + take] = ids[off : off + take]
            mask[pos : pos + take] = dmask[off : off + take]
            starts.append(pos)
            pos += take
            if take == remaining:
                self._advance()
            elif self.strategy == "whole":
                self.truncated += 1
                self._advance()
            else:
                self.position.offset = off + take
        if pos < n:
            starts.append(pos)  # the padding is a segment of its own
        return PackedRow(tokens, mask, starts)


def row_columns(
    row: PackedRow,
    columns: list[str],
    *,
    eod: int,
    eod_mask_loss: bool,
    eod_pad_length: int,
) -> dict[str, np.ndarray]:
    """The sample columns of one packed row (the same layout as the Megatron loader's samples)."""
    seq = row.tokens.size - 1
    tokens, labels = row.tokens[:-1], row.tokens[1:]
    loss_mask = row.mask[1:].astype(np.float32)
    if eod_mask_loss:
        loss_mask[tokens == eod] = 0.0
    starts = [s for s in row.starts if s < seq]
    segment = np.zeros(seq, dtype=np.int64)
    for s in starts[1:]:
        segment[s:] += 1
    begin = np.asarray(starts, dtype=np.int64)[segment]
    out: dict[str, np.ndarray] = {
        "input_ids": tokens.copy(),
        "labels": labels.copy(),
        "loss_mask": loss_mask,
        "position_ids": np.arange(seq, dtype=np.int64) - begin,
    }
    if "attention_mask" in columns:
        allowed = np.tril(np.ones((seq, seq), dtype=bool)) & (segment[:, None] == segment[None, :])
        out["attention_mask"] = ~allowed[None]  # True = masked
    if "actual_seq_len" in columns:
        ends = starts[1:]
        if len(ends) > eod_pad_length:
            raise DataError(
                f"a packed sample holds {len(ends) + 1} documents, more than eod_pad_length "
                f"({eod_pad_length}) allows; raise train_dataset.dataloader.eod_pad_length."
            )
        act = np.full(eod_pad_length, seq, dtype=np.int64)
        act[: len(ends)] = ends
        out["actual_seq_len"] = act
    return {c: out[c] for c in columns}
