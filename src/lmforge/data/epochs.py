"""How many samples ``training.epochs`` passes over the training split are (the run plan turns them
into steps, parallel/plan.py).

The count is the loaders' own: it is the ``consumed_samples`` (all data-parallel ranks together) at
which the training loader built for the same layout finishes its last pass.

* Megatron data: one pass is the GPTDataset built without a sample count (``sizes[0]`` null), which
  the loader serves in ``len(loader)`` micro-steps (``drop_remainder`` decides the partial last one).
* Text data (``TextDataLoader`` / ``HFDataLoader``): each data-parallel rank packs its own documents,
  so the passes are counted per rank by running the loader's own packer over the documents' token
  counts (the training split is tokenized once for this, before the model is built), in the epoch
  orders the loader will use (``shuffle`` permutes each pass differently, which changes the packing).
  A pass of a blend ends when every source has been read completely (a source drawn more than its
  share is read again meanwhile: the step line's ``epoch`` counts the source furthest behind). The
  rank with the fewest rows decides, so no rank trains beyond the last pass. The rows are counted once
  for a given data, tokenizer and settings, and kept beside the data (data/epochs_cache.py): the
  processes of a job, ``check`` and every restart read that count instead of tokenizing again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from lmforge.config import TrainDatasetConfig
from lmforge.errors import ConfigError, DataError

from .build import build_dataset, typed_loader
from .epochs_cache import cached_rows
from .loader import SampleOrder
from .text_loader import _SourceStream, blend_choice
from .text_pack import Packer
from .text_schema import KEY, TextLoader
from .text_settings import text_loader_settings

EPOCHS_KEY = "training.epochs"


@dataclass(frozen=True)
class EpochLength:
    samples: int  # consumed samples (all data-parallel ranks) at the end of the last pass
    description: str  # what one pass is, for `lmforge check`


def samples_of_epochs(
    dataset_section: Any,
    epochs: int,
    *,
    local_batch_size: int,
    dp_size: int,
    seed: int,
    seq_length: int | None = None,
    vocab_size: int | None = None,
) -> EpochLength:
    """The samples of ``epochs`` passes over ``train_dataset``'s training split for ``dp_size`` ranks
    of ``local_batch_size`` rows (``seed``: training.seed, which orders ``shuffle``); ``dataset_section``
    is the typed ``train_dataset``, as for :func:`build_dataloader`."""
    typed = typed_loader(dataset_section, "samples_of_epochs")
    if isinstance(typed, TextLoader):
        settings = text_loader_settings(typed, seq_length=seq_length, vocab_size=vocab_size)
        shuffle_seed = None if settings.shuffle_buffer is None else seed  # the seed orders shuffle only
        per_rank = cached_rows(
            settings,
            lambda: [_text_rows(settings, epochs, rank, dp_size, seed) for rank in range(dp_size)],
            epochs=epochs,
            dp_size=dp_size,
            seed=shuffle_seed,
        )
        rows = min(per_rank)
        micro_steps = rows // local_batch_size
        return EpochLength(
            micro_steps * local_batch_size * dp_size,
            f"{rows} packed rows of {settings.seq_length} tokens per data-parallel rank in {epochs} pass(es)"
            + (" (the rank with the fewest)" if dp_size > 1 else ""),
        )
    if typed.sizes and typed.sizes[0] is not None:
        raise ConfigError(
            f"{EPOCHS_KEY} counts passes over the training data, but train_dataset.dataloader.sizes[0] "
            f"({typed.sizes[0]}) sizes the training split to a number of samples instead; set sizes[0] to "
            "null (one pass of the data) or give training.steps."
        )
    return _megatron_samples(dataset_section, epochs, local_batch_size, dp_size, seq_length, vocab_size)


def _megatron_samples(
    section: TrainDatasetConfig,
    epochs: int,
    lbs: int,
    dp: int,
    seq_length: int | None,
    vocab_size: int | None,
) -> EpochLength:
    dataset, typed = build_dataset(section, phase="train", vocab_size=vocab_size, seq_length=seq_length)
    if dataset is None:
        raise DataError("train_dataset: the training split is empty (train_data_path / data_path and split).")
    if getattr(dataset, "num_samples", 0) is not None:
        raise ConfigError(
            f"{EPOCHS_KEY} needs one dataset per split; a weighted blend of several datasets is sized by "
            "train_dataset.dataloader.sizes, so its passes are not the data's epochs. Give training.steps."
        )
    order = SampleOrder(len(dataset), lbs, 0, dp, bool(section.drop_remainder), False, 0)
    if order.steps_per_epoch == 0:
        raise DataError(
            f"the training split has {len(dataset)} samples, fewer than one micro-step of data_parallel "
            f"({dp}) x local_batch_size ({lbs}); {EPOCHS_KEY} has nothing to count."
        )
    per_pass = order.steps_per_epoch * order.samples_per_step
    return EpochLength(
        epochs * per_pass,
        f"{len(dataset)} samples of {typed.config.seq_length} tokens per pass, served as {per_pass}",
    )


class _TokenCountStream(_SourceStream):
    """A source's documents in the training loader's order, each as ``len`` copies of its epoch
    number: the packer places them exactly as it places the tokens, and a row shows which passes it
    holds. Token counts are remembered by row index, so each document is tokenized once."""

    def __init__(self, *args: Any, counts: dict[int, int], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.counts = counts

    def _encoded(self, epoch: int, start: int) -> Iterator[tuple[int, np.ndarray, np.ndarray]]:
        for places, chunk in self._chunks(epoch, start):
            new = [(i, row) for i, row in chunk if i not in self.counts]
            if new:
                encoded = self.local.encode_rows(new, self.source.path, self._locations(new))
                for (i, _), (_, ids, _) in zip(new, encoded):
                    self.counts[i] = int(ids.size)
            for place, (i, _) in zip(places, chunk):
                n = self.counts[i]
                yield place, np.full(n, epoch, dtype=np.int64), np.ones(n, dtype=np.uint8)


def _text_rows(settings: Any, epochs: int, rank: int, dp_size: int, seed: int) -> int:
    """Rows rank ``rank`` draws from the blend until every source has been read ``epochs`` times."""
    from lmforge.utils.tokenizer import load_tokenizer

    from .text_format import RowFormatter
    from .text_sources import TextSource

    formatter = RowFormatter(load_tokenizer(settings.tokenizer), settings.format)
    shuffle = None if settings.shuffle_buffer is None else (seed, settings.shuffle_buffer)
    needed = []
    for path in settings.paths:
        stream = _TokenCountStream(
            TextSource(path, f"{KEY}.data_path"),
            rank,
            dp_size,
            None,
            formatter,
            2,
            settings.validation_split,
            shuffle=shuffle,
            counts={},
        )
        packer = Packer(stream, settings.seq_length, strategy=settings.pack, pad=-1)
        rows = 0
        while packer.next_row().tokens.max() < epochs:  # the row holds tokens of the passes only
            rows += 1
        needed.append(rows)
    taken, drawn = [0] * len(needed), 0
    while any(t < n for t, n in zip(taken, needed)):
        taken[blend_choice(settings.weights, taken, drawn)] += 1
        drawn += 1
    return drawn
