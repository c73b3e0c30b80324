"""The resumable micro-batch loader: data-parallel sharding, batching, worker processes, state.

Global sample order is fixed by the dataset (and, with ``shuffle``, a per-epoch permutation seeded
by the training seed). Every ``next()`` is one step of all data-parallel ranks together: the next
``dp_size * local_batch_size`` samples, of which rank r takes rows ``[r*lbs, (r+1)*lbs)`` (as
Megatron's pretraining sampler), so the samples of a global batch do not depend on the dp size.
The position is the number of samples consumed by all ranks; resuming computes the next indices
directly, so the skipped samples are never read.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from lmforge.errors import DataError
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.data")

# Columns a GPTDataset sample can have, and the torch dtype of each in a batch.
COLUMN_DTYPES = {
    "input_ids": torch.long,
    "labels": torch.long,
    "loss_mask": torch.float32,
    "position_ids": torch.long,
    "attention_mask": torch.bool,
    "actual_seq_len": torch.long,
}


class _Columns(torch.utils.data.Dataset):
    """A dataset view that builds whole micro-batches of the requested columns (in worker processes).

    Datasets with ``fill_row`` (GPTDataset, BlendedDataset) write each row straight into the batch
    arrays; others fall back to stacking per-sample dicts.
    """

    def __init__(self, dataset: Any, columns: list[str]) -> None:
        self.dataset = dataset
        self.columns = columns
        self.seq_length = dataset.config.seq_length if hasattr(dataset, "config") else None

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, k: int | None) -> dict[str, np.ndarray]:
        sample = self.dataset[k]
        return {c: sample[c] for c in self.columns}

    def __getitems__(self, indices: list[int | None]) -> dict[str, np.ndarray]:
        if not hasattr(self.dataset, "fill_row"):
            samples = [self[k] for k in indices]
            return {c: np.stack([s[c] for s in samples]) for c in self.columns}
        cfg = self.dataset.config
        rows, seq = len(indices), cfg.seq_length
        batch = {
            "_text": np.empty((rows, seq + cfg.extra_token), dtype=np.int64),
            "input_ids": np.empty((rows, seq), dtype=np.int64),
            "labels": np.empty((rows, seq), dtype=np.int64),
            "loss_mask": np.ones((rows, seq), dtype=np.float32),
            "position_ids": np.broadcast_to(np.arange(seq, dtype=np.int64), (rows, seq)).copy(),
        }
        if "attention_mask" in self.columns:
            batch["attention_mask"] = np.empty((rows, 1, seq, seq), dtype=bool)
        if "actual_seq_len" in self.columns:
            batch["actual_seq_len"] = np.empty((rows, cfg.eod_pad_length), dtype=np.int64)
        for row, k in enumerate(indices):
            self.dataset.fill_row(k, batch, row)
        return {c: batch[c] for c in self.columns}


def collate(batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Batch arrays to tensors; ``actual_seq_len`` becomes cumulative over the batch's rows."""
    out = {}
    for name, array in batch.items():
        if name == "actual_seq_len":
            # The rows of a micro-batch are flattened into one varlen sequence: offset row i by
            # i * seq_length. (MindSpore Transformers offsets by the previous row's last entry,
            # which is wrong when a row's EOD list fills the whole vector.)
            seq_length = batch["input_ids"].shape[-1] if "input_ids" in batch else int(array[0].max())
            array = array + (np.arange(len(array)) * seq_length)[:, None]
        out[name] = torch.from_numpy(np.ascontiguousarray(array)).to(COLUMN_DTYPES.get(name, torch.long))
    return out


class SampleOrder:
    """Which dataset rows a rank reads at each global step (epochs, shuffle, padding rows).

    Kept apart from the loader so the batch sampler holds no reference back to it: such a cycle
    leaves worker shutdown to the garbage collector, which then waits out the join timeouts.
    """

    def __init__(
        self,
        num_samples: int,
        local_batch_size: int,
        dp_rank: int,
        dp_size: int,
        drop_remainder: bool,
        shuffle: bool,
        seed: int,
    ) -> None:
        self.num_samples = num_samples
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.samples_per_step = local_batch_size * dp_size
        if drop_remainder:
            self.steps_per_epoch = num_samples // self.samples_per_step
        else:
            self.steps_per_epoch = math.ceil(num_samples / self.samples_per_step)
        self.shuffle = shuffle
        self.seed = seed
        self._permutation_epoch = -1
        self._permutation: np.ndarray | None = None

    def _permutation_of(self, epoch: int) -> np.ndarray | None:
        if not self.shuffle:
            return None
        if self._permutation_epoch != epoch:
            rng = np.random.RandomState((self.seed + epoch) % 2**32)
            self._permutation = rng.permutation(self.num_samples)
            self._permutation_epoch = epoch
        return self._permutation

    def indices_of_step(self, step: int) -> list[int | None]:
        """Dataset indices of this rank's rows at a global step (None = padding row, loss masked)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        order = self._permutation_of(epoch)
        first = within * self.samples_per_step + self.dp_rank * self.local_batch_size
        out: list[int | None] = []
        for p in range(first, first + self.local_batch_size):
            if p >= self.num_samples:
                # drop_remainder: false - the last step is filled with padding rows so every rank
                # keeps a full micro-batch (Megatron's batch-padding sample: zero loss mask).
                out.append(None)
            else:
                out.append(int(order[p]) if order is not None else p)
        return out


class _StepSampler:
    """Yields, from a start step, the dataset indices of this rank's micro-batch per step."""

    def __init__(self, order: SampleOrder, start_step: int, infinite: bool) -> None:
        self.order = order
        self.start_step = start_step
        self.infinite = infinite

    def __iter__(self) -> Iterator[list[int | None]]:
        step = self.start_step
        while self.infinite or step < self.order.steps_per_epoch:
            yield self.order.indices_of_step(step)
            step += 1


class MegatronDataLoader:
    """Iterable of micro-batches (dicts of tensors keyed by column name) with a resumable position.

    ``infinite=True`` (training) wraps around epochs forever; otherwise (validation) each
    ``iter()`` runs one epoch from its start. ``state_dict()`` / ``load_state_dict()`` hold
    ``consumed_samples`` (all data-parallel ranks together).
    """

    def __init__(
        self,
        dataset: Any,
        *,
        columns: list[str],
        local_batch_size: int,
        dp_rank: int = 0,
        dp_size: int = 1,
        drop_remainder: bool = True,
        num_workers: int = 0,
        prefetch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        consumed_samples: int = 0,
        infinite: bool = True,
        vocab_size: int | None = None,
        name: str = "dataset",
    ) -> None:
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_size {dp_size}")
        self.dataset = dataset
        self.columns = list(columns)
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.drop_remainder = drop_remainder
        self.num_workers = num_workers
        self.prefetch_size = max(1, prefetch_size)
        self.shuffle = shuffle
        self.seed = seed
        self.infinite = infinite
        self.vocab_size = vocab_size
        self.name = name
        self.order = SampleOrder(
            len(dataset), local_batch_size, dp_rank, dp_size, drop_remainder, shuffle, seed
        )
        self.samples_per_step = self.order.samples_per_step
        self.steps_per_epoch = self.order.steps_per_epoch
        self.num_samples = n = len(dataset)
        if self.steps_per_epoch == 0:
            raise DataError(
                f"{name} has {n} samples, fewer than one step of data_parallel ({dp_size}) x "
                f"local_batch_size ({local_batch_size}) = {self.samples_per_step}; with "
                "train_dataset.drop_remainder: true nothing would be left. Use more data, a larger "
                "train_dataset.dataloader.sizes, or a smaller batch."
            )
        self._iterator: Iterator | None = None
        self.consumed_samples = 0
        self.load_state_dict({"consumed_samples": consumed_samples})

    # -- order ------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Micro-batches per epoch on each rank."""
        return self.steps_per_epoch

    def indices_of_step(self, step: int) -> list[int | None]:
        """Dataset indices of this rank's rows at a global step (None = padding row, loss masked)."""
        return self.order.indices_of_step(step)

    # -- iteration --------------------------------------------------------------------------
    def _make_iterator(self) -> Iterator:
        start_step = self.consumed_samples // self.samples_per_step
        if not self.infinite:
            start_step = 0
        kwargs: dict[str, Any] = {}
        if self.num_workers > 0:
            kwargs = {"prefetch_factor": self.prefetch_size, "persistent_workers": False}
        loader = torch.utils.data.DataLoader(
            _Columns(self.dataset, self.columns),
            batch_sampler=_StepSampler(self.order, start_step, self.infinite),
            num_workers=self.num_workers,
            collate_fn=collate,
            **kwargs,
        )
        return iter(loader)

    def __iter__(self) -> MegatronDataLoader:
        if not self.infinite:
            self.consumed_samples = 0
            self._iterator = None
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        if self._iterator is None:
            self._iterator = self._make_iterator()
        batch = next(self._iterator)
        self.consumed_samples += self.samples_per_step
        self._check_vocab(batch)
        return batch

    def _check_vocab(self, batch: dict[str, torch.Tensor]) -> None:
        if self.vocab_size is None:
            return
        for column in ("input_ids", "labels"):
            if column in batch and batch[column].numel() and int(batch[column].max()) >= self.vocab_size:
                raise DataError(
                    f"{self.name} holds token id {int(batch[column].max())}, but model.vocab_size is "
                    f"{self.vocab_size} (valid ids 0 .. {self.vocab_size - 1}): the data was tokenized with "
                    "a different tokenizer than the model expects."
                )

    # -- position ---------------------------------------------------------------------------
    @property
    def epoch(self) -> int | None:
        """The pass over the data of the last batch, 1-based (the step log line shows it), when the
        dataset is one pass of its documents (a GPTDataset built without a sample count); None for a
        blend or a dataset sized to ``sizes``, whose passes are not the data's epochs."""
        if getattr(self.dataset, "num_samples", 0) is not None:
            return None
        step = max(self.consumed_samples // self.samples_per_step - 1, 0)
        return step // self.steps_per_epoch + 1

    def state_dict(self) -> dict[str, int]:
        return {"consumed_samples": int(self.consumed_samples)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        consumed = int(state.get("consumed_samples", 0))
        if consumed % self.samples_per_step:
            log.warning(
                "consumed_samples %d is not a multiple of data_parallel x local_batch_size (%d); "
                "resuming at the step that contains it",
                consumed,
                self.samples_per_step,
            )
        self.consumed_samples = consumed - consumed % self.samples_per_step
        self._iterator = None  # workers restart at the new position; nothing skipped is read

    def close(self) -> None:
        self._iterator = None
