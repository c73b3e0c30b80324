"""``TextDataLoader``: local text / Hugging Face datasets, tokenized on the fly, packed, blended, resumable.

Each data-parallel rank reads the documents ``d`` with ``d % dp_size == dp_rank`` of every source,
tokenizes them in background worker processes (``train_dataset.num_parallel_workers``; chunks are
sent ahead and come back in order, so the stream is deterministic), packs them into rows
(:mod:`lmforge.data.text_pack`) and blends the sources by weight: the next row comes from the
source furthest behind its share (``weight * rows - taken``), a deterministic rule.

State (in the checkpoint, per rank): the rows produced and, per source, the packing position (epoch,
document, token offset). Resuming re-reads each source from its recorded document; only the
documents after it (and that one) are tokenized. See docs/data.md.
"""

from __future__ import annotations

import collections
import contextlib
import multiprocessing
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lmforge.errors import DataError
from lmforge.utils.logging import get_logger

from .loader import collate
from .text_format import RowFormatter, encode_in_worker, init_worker
from .text_pack import Packer, PackPosition, row_columns
from .text_schema import KEY, TEXT_TYPE
from .text_settings import TextLoaderSettings
from .text_sources import TextSource

log = get_logger("lmforge.data")

CHUNK_DOCUMENTS = 256  # documents per encode_batch call / task sent to a tokenization worker
# Multiplicative (Fibonacci) hashing of the document index: the held-out documents are spread evenly
# through each source, the same on every rank and run, without knowing how long the source is.
_GOLDEN = 2654435761


def held_out(index: int, fraction: float) -> bool:
    """Whether document ``index`` of a source belongs to the validation share ``fraction`` of it."""
    return ((index * _GOLDEN) % 2**32) < fraction * 2**32


def blend_choice(weights: list[float], taken: list[int], rows: int) -> int:
    """The source the next row comes from, after ``rows`` rows of which ``taken[i]`` came from source i:
    the one furthest behind its share (``weight * (rows + 1) - taken``)."""
    deficits = [w * (rows + 1) - t for w, t in zip(weights, taken)]
    return int(np.argmax(deficits))


class _SourceStream:
    """Tokenized documents of one source for one rank, from a packing position, epoch after epoch.

    A position's ``doc`` is a place in the epoch's order of the source's documents: the file order,
    or with ``shuffle`` a permutation of each window of ``shuffle_buffer`` consecutive documents,
    seeded by (seed, epoch, window) — so a resume rebuilds the same order from the position alone.
    Which rank reads a document, and whether it is held out for validation, go by its row index in
    the file, the same in every epoch."""

    def __init__(
        self,
        source: TextSource,
        dp_rank: int,
        dp_size: int,
        pool: Any,
        local: RowFormatter | None,
        ahead: int,
        held_out_share: float = 0.0,
        shuffle: tuple[int, int] | None = None,
    ):
        self.source, self.dp_rank, self.dp_size = source, dp_rank, dp_size
        self.pool, self.local, self.ahead = pool, local, ahead
        self.held_out_share = held_out_share  # validation_split: these documents are never trained on
        self.shuffle = shuffle  # (seed, window) or None

    def _ordered(self, epoch: int, start: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
        """``(place in the epoch's order, row index, row)`` from place ``start`` on."""
        if self.shuffle is None:
            first = start + (self.dp_rank - start) % self.dp_size  # the first row this rank reads
            for index, row in self.source.rows(first):
                yield index, index, row
            return
        seed, window = self.shuffle
        base = start - start % window
        buffer: list[tuple[int, dict[str, Any]]] = []

        def emit() -> Iterator[tuple[int, int, dict[str, Any]]]:
            order = np.random.default_rng([seed, epoch, base // window]).permutation(len(buffer))
            for j, i in enumerate(order):
                if base + j >= start:
                    yield base + j, *buffer[i]

        for index, row in self.source.rows(base):
            buffer.append((index, row))
            if len(buffer) == window:
                yield from emit()
                base, buffer = base + window, []
        if buffer:
            yield from emit()

    def _chunks(self, epoch: int, start: int) -> Iterator[tuple[list[int], list[tuple[int, dict[str, Any]]]]]:
        places: list[int] = []
        chunk: list[tuple[int, dict[str, Any]]] = []
        for place, index, row in self._ordered(epoch, start):
            if index % self.dp_size != self.dp_rank:
                continue
            if self.held_out_share and held_out(index, self.held_out_share):
                continue
            places.append(place)
            chunk.append((index, row))
            if len(chunk) == CHUNK_DOCUMENTS:
                yield places, chunk
                places, chunk = [], []
        if chunk:
            yield places, chunk

    def _locations(self, chunk: list[tuple[int, dict[str, Any]]]) -> list[str]:
        return [self.source.where(index) for index, _ in chunk]  # file:line, for refusals of bad values

    def _encoded(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        name = self.source.path
        if self.pool is None:
            for places, chunk in self._chunks(epoch, start):
                encoded = self.local.encode_rows(chunk, name, self._locations(chunk))
                for place, (_, ids, mask) in zip(places, encoded):
                    yield place, ids, mask
            return
        pending: collections.deque = collections.deque()
        for places, chunk in self._chunks(epoch, start):
            task = (chunk, name, self._locations(chunk))
            pending.append((places, self.pool.apply_async(encode_in_worker, (task,))))
            if len(pending) >= self.ahead:
                places_done, result = pending.popleft()
                yield from ((p, ids, mask) for p, (_, ids, mask) in zip(places_done, result.get()))
        while pending:
            places_done, result = pending.popleft()
            yield from ((p, ids, mask) for p, (_, ids, mask) in zip(places_done, result.get()))

    def __call__(self, position: PackPosition) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        epoch, start = position.epoch, position.doc
        while True:
            found = False
            for place, ids, mask in self._encoded(epoch, start):
                found = True
                yield epoch, place, ids, mask
            if not found and start == 0:
                raise DataError(
                    f"{self.source.path} has no document for data-parallel rank {self.dp_rank} of {self.dp_size}."
                )
            epoch, start = epoch + 1, 0


class TextDataLoader:
    """The training loader of a ``TextDataLoader`` section (an endless stream of micro-batches)."""

    def __init__(
        self,
        settings: TextLoaderSettings,
        *,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        num_workers: int = 0,
        consumed_samples: int = 0,
        seed: int = 0,
    ) -> None:
        self.s = settings
        self.seed = seed  # training.seed: the shuffle's permutations
        self.local_batch_size = local_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers = num_workers
        self.consumed_samples = consumed_samples
        self.rows = 0  # rows this rank has produced
        self.taken = [0] * len(settings.paths)
        self.positions = [PackPosition() for _ in settings.paths]
        self._restored = consumed_samples == 0
        self._packers: list[Packer] | None = None
        self._pool: Any = None
        self.sources = [TextSource(p, f"{KEY}.data_path") for p in settings.paths]

    # -- the pipeline -------------------------------------------------------------------------
    def _start(self) -> None:
        if not self._restored:
            raise DataError(
                f"{TEXT_TYPE} cannot resume at sample {self.consumed_samples} without its recorded position "
                "(the checkpoint was written with a different data-parallel layout, or has no data state); "
                "resume with the same number of data-parallel ranks, or start without checkpoint.load_path."
            )
        local = None
        if self.num_workers > 1:
            # Not fork: the training process has threads (checkpoint writers, loggers) whose locks a
            # forked child would inherit held. The fork server starts clean, imports the tokenization
            # module once and forks the workers from there.
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
            if "forkserver" in methods:
                ctx.set_forkserver_preload(["lmforge.data.text_format"])
            self._pool = ctx.Pool(self.num_workers, init_worker, (self.s.tokenizer, self.s.format))
        else:
            from lmforge.utils.tokenizer import load_tokenizer

            local = RowFormatter(load_tokenizer(self.s.tokenizer), self.s.format)
        ahead = max(2 * self.num_workers, 2)
        self._packers = [
            Packer(
                _SourceStream(
                    src,
                    self.dp_rank,
                    self.dp_size,
                    self._pool,
                    local,
                    ahead,
                    self.s.validation_split,
                    shuffle=None if self.s.shuffle_buffer is None else (self.seed, self.s.shuffle_buffer),
                ),
                self.s.seq_length,
                strategy=self.s.pack,
                pad=self.s.pad,
                position=PackPosition(**pos.to_dict()),
            )
            for src, pos in zip(self.sources, self.positions)
        ]

    def _next_source(self) -> int:
        return blend_choice(self.s.weights, self.taken, self.rows)

    def __iter__(self) -> TextDataLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._packers is None:
            self._start()
        rows = []
        for _ in range(self.local_batch_size):
            i = self._next_source()
            packer = self._packers[i]
            row = packer.next_row()
            self.positions[i] = PackPosition(**packer.position.to_dict())
            self.taken[i] += 1
            self.rows += 1
            rows.append(
                row_columns(
                    row,
                    self.s.columns,
                    eod=self.s.format.eod,
                    eod_mask_loss=self.s.eod_mask_loss,
                    eod_pad_length=self.s.eod_pad_length,
                )
            )
        self.consumed_samples += self.local_batch_size * self.dp_size
        return collate({c: np.stack([r[c] for r in rows]) for c in self.s.columns})

    @property
    def epoch(self) -> int:
        """The pass over the data of the rows this rank served last, 1-based (with several sources:
        the one furthest behind; every source has been read completely ``epoch - 1`` times)."""
        if self._packers is None:
            return min(p.epoch for p in self.positions) + 1
        placed = [p.placed_epoch if p.placed_epoch is not None else p.position.epoch for p in self._packers]
        return min(placed) + 1

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "consumed_samples": self.consumed_samples,
            "text": {
                "dp_size": self.dp_size,
                "rows": self.rows,
                "taken": list(self.taken),
                "positions": [p.to_dict() for p in self.positions],
                "paths": list(self.s.paths),
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        text = state.get("text")
        if not text or text.get("dp_size") != self.dp_size or text.get("paths") != list(self.s.paths):
            return  # _start raises the clear error if a position was needed
        self.close()
        self.consumed_samples = int(state["consumed_samples"])
        self.rows = int(text["rows"])
        self.taken = [int(t) for t in text["taken"]]
        self.positions = [PackPosition(**p) for p in text["positions"]]
        self._restored = True
        self._packers = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool = None
        self._packers = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn the pool down
            self.close()
