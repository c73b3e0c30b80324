"""The validation set of a ``TextDataLoader``: its own files (``valid_data_path``) or the share of
``data_path``'s documents held out of training (``validation_split``), packed like the training rows.

Every rank reads, tokenizes and packs the whole validation set once (validation sets are small) and
keeps the rows; rank r evaluates rows ``r, r + dp, ...``. Each rank then runs the same number of
micro-batches — the forward passes of a sharded model are collective — so the last ones are filled
with rows that carry no loss (``loss_mask`` 0), which the token-weighted validation loss ignores.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lmforge.errors import DataError

from .loader import collate
from .text_format import RowFormatter
from .text_loader import held_out
from .text_pack import Packer, PackPosition, row_columns
from .text_schema import KEY
from .text_settings import TextLoaderSettings
from .text_sources import TextSource


class TextValidationLoader:
    """One pass over the validation set per ``iter()``, in fixed order, as this rank's micro-batches."""

    def __init__(
        self, settings: TextLoaderSettings, *, local_batch_size: int, dp_rank: int = 0, dp_size: int = 1
    ) -> None:
        if not settings.valid_paths and not settings.validation_split:
            raise ValueError("the settings name no validation set")
        self.s = settings
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self._rows: list[dict[str, np.ndarray]] | None = None

    def _documents(self, source: TextSource, keep: Any) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        from lmforge.utils.tokenizer import load_tokenizer

        formatter = RowFormatter(load_tokenizer(self.s.tokenizer), self.s.format)
        chunk: list[tuple[int, dict[str, Any]]] = []
        for index, row in source.rows(0):
            if keep(index):
                chunk.append((index, row))
            if len(chunk) == 256:
                for i, ids, mask in formatter.encode_rows(chunk, source.path):
                    yield 0, i, ids, mask
                chunk = []
        for i, ids, mask in formatter.encode_rows(chunk, source.path):
            yield 0, i, ids, mask

    def _sources(self) -> list[tuple[TextSource, Any]]:
        if self.s.valid_paths:
            return [(TextSource(p, f"{KEY}.valid_data_path"), lambda i: True) for p in self.s.valid_paths]
        share = self.s.validation_split
        return [(TextSource(p, f"{KEY}.data_path"), lambda i: held_out(i, share)) for p in self.s.paths]

    def rows(self) -> list[dict[str, np.ndarray]]:
        """Every packed row of the validation set (all ranks), computed once."""
        if self._rows is None:
            rows = []
            for source, keep in self._sources():
                docs = self._documents(source, keep)
                packer = Packer(
                    lambda _pos, d=docs: d, self.s.seq_length, strategy=self.s.pack, pad=self.s.pad
                )
                packer.position = PackPosition()
                while True:
                    try:
                        row = packer.next_row()
                    except StopIteration:
                        break
                    rows.append(self._columns(row))
            if not rows:
                what = "valid_data_path" if self.s.valid_paths else "validation_split"
                raise DataError(
                    f"{KEY}.{what}: the validation set has no document (check the files, or raise "
                    "validation_split so that it holds at least one of data_path's documents)."
                )
            self._rows = rows
        return self._rows

    def _columns(self, row: Any) -> dict[str, np.ndarray]:
        return row_columns(
            row,
            self.s.columns,
            eod=self.s.format.eod,
            eod_mask_loss=self.s.eod_mask_loss,
            eod_pad_length=self.s.eod_pad_length,
        )

    def _empty_row(self) -> dict[str, np.ndarray]:
        from .text_pack import PackedRow

        n = self.s.seq_length + 1
        row = PackedRow(np.full(n, self.s.pad, dtype=np.int64), np.zeros(n, dtype=np.uint8), [0])
        return self._columns(row)

    def __len__(self) -> int:
        per_rank = -(-len(self.rows()) // self.dp_size)
        return -(-per_rank // self.local_batch_size)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        mine = self.rows()[self.dp_rank :: self.dp_size]
        wanted = len(self) * self.local_batch_size
        mine = mine + [self._empty_row()] * (wanted - len(mine))
        for start in range(0, wanted, self.local_batch_size):
            batch = mine[start : start + self.local_batch_size]
            yield collate({c: np.stack([r[c] for r in batch]) for c in self.s.columns})
