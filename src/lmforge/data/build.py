"""``build_dataloader``: the ``train_dataset`` section in, a resumable micro-batch loader out."""

from __future__ import annotations

import os
from typing import Any

from lmforge.config import TrainDatasetConfig
from lmforge.errors import ConfigError, DataError
from lmforge.utils.logging import get_logger

from .blended import BlendedDataset, build_split_dataset
from .config import CONFIG_PATH
from .gpt_dataset import SPLIT_NAMES, GPTDataset
from .loader import COLUMN_DTYPES, MegatronDataLoader
from .schema import (
    KNOWN_UNSUPPORTED_TYPES,
    SUPPORTED_TYPES,
    TEXT_TYPES,
    MegatronLoader,
    TextLoader,
    TypedDataloader,
)

log = get_logger("lmforge.data")

PHASES = {"train": 0, "valid": 1, "test": 2}
# Scanning .bin files up to this size for out-of-vocabulary ids takes well under a second; larger
# data are checked batch by batch instead.
FULL_VOCAB_SCAN_BYTES = 1 << 30


def _check_vocab_upfront(dataset: GPTDataset | BlendedDataset, vocab_size: int) -> None:
    members = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    for member in members:
        indexed = member.indexed
        if os.path.getsize(f"{indexed.prefix}.bin") > FULL_VOCAB_SCAN_BYTES:
            continue
        low = indexed.min_token()
        if low < 0:
            raise DataError(
                f"{indexed.prefix}.bin holds the negative token id {low} ({indexed.dtype.name} tokens); token ids "
                f"run from 0 to model.vocab_size - 1 = {vocab_size - 1}. The file is corrupt or was not written by "
                "a tokenizer: rebuild it with 'lmforge data preprocess'."
            )
        top = indexed.max_token()
        if top >= vocab_size:
            raise DataError(
                f"{indexed.prefix}.bin holds token id {top}, but model.vocab_size is {vocab_size} "
                f"(valid ids 0 .. {vocab_size - 1}): the data was tokenized with a different tokenizer "
                "than the model expects."
            )


def typed_loader(dataset_section: Any, builder: str) -> TypedDataloader:
    """The dataloader ``load_config`` typed in ``dataset_section``; a TypeError for anything else (a
    mapping is validated by the config, once, not by a builder)."""
    loader = getattr(dataset_section, "dataloader", None)
    typed = getattr(loader, "typed", None)
    if not isinstance(dataset_section, TrainDatasetConfig) or not isinstance(
        typed, (MegatronLoader, TextLoader)
    ):
        raise TypeError(
            f"{builder} takes the typed train_dataset section (load_config's cfg.train_dataset or "
            "cfg.eval_dataset, or lmforge.config.validate_section('train_dataset', mapping)), got "
            f"{type(dataset_section).__name__}"
        )
    return typed


def build_dataset(
    dataset_section: TrainDatasetConfig,
    *,
    phase: str = "train",
    vocab_size: int | None = None,
    seq_length: int | None = None,
) -> tuple[GPTDataset | BlendedDataset | None, MegatronLoader]:
    """The GPTDataset/BlendedDataset of one phase (None if that split is empty) and the typed loader.

    ``dataset_section`` is the typed ``train_dataset`` section, as for :func:`build_dataloader`."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase!r}")
    typed = typed_loader(dataset_section, "build_dataset")
    typed.check_against_model(seq_length, vocab_size)
    if not isinstance(typed, MegatronLoader):
        raise ConfigError(
            f"train_dataset.dataloader.type is a text loader; build_dataset reads Megatron data "
            f"({SUPPORTED_TYPES[0]}): use build_dataloader."
        )
    return _megatron_dataset(typed, phase, vocab_size), typed


def _megatron_dataset(
    typed: MegatronLoader, phase: str, vocab_size: int | None
) -> GPTDataset | BlendedDataset | None:
    cfg = typed.config
    if 0 <= cfg.pad == cfg.eod:
        # Megatron: a pad id equal to EOD would mask every EOD label; it is dropped with a warning.
        log.warning("%s.pad equals eod (%d); treating pad as unset (-1)", CONFIG_PATH, cfg.pad)
        cfg = cfg.model_copy(update={"pad": -1})
    dataset = build_split_dataset(cfg, typed.sizes, PHASES[phase])
    if dataset is not None and vocab_size is not None:
        _check_vocab_upfront(dataset, vocab_size)
    return dataset


def build_dataloader(
    dataset_section: TrainDatasetConfig,
    *,
    local_batch_size: int,
    dp_rank: int = 0,
    dp_size: int = 1,
    seed: int = 0,
    vocab_size: int | None = None,
    seq_length: int | None = None,
    phase: str = "train",
    consumed_samples: int = 0,
) -> MegatronDataLoader | None:
    """The micro-batch loader of ``phase`` for this data-parallel rank, or None if the split is empty.

    ``dataset_section`` is ``train_dataset`` (or ``eval_dataset``) as ``load_config`` typed it; tools
    and tests type a mapping with ``lmforge.config.validate_section("train_dataset", mapping)``. The
    model's ``seq_length`` / ``vocab_size``, when given, are checked against it. The batch arithmetic
    (global batch against ``dp_size * local_batch_size``) is the run plan's. Tensor/context-parallel
    peers pass the same ``dp_rank`` and so read the same shard. ``seed`` (training.seed) seeds only
    the optional ``dataloader.shuffle``; the sample order itself comes from ``config.seed`` as in
    Megatron. Training loaders run forever across epochs; valid/test loaders run one epoch per
    ``iter()``.
    """
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1; got {local_batch_size}.")
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase!r}")
    typed = typed_loader(dataset_section, "build_dataloader")
    typed.check_against_model(seq_length, vocab_size)
    workers = dataset_section.num_parallel_workers
    if isinstance(typed, TextLoader):
        return _build_text_dataloader(
            typed,
            phase,
            local_batch_size,
            dp_rank,
            dp_size,
            vocab_size,
            seq_length,
            consumed_samples,
            workers,
            seed,
        )
    dataset = _megatron_dataset(typed, phase, vocab_size)
    if dataset is None:
        return None
    cpus = os.cpu_count() or 1
    if workers > cpus:
        log.warning(
            "train_dataset.num_parallel_workers = %d exceeds the %d CPUs here; using %d worker processes",
            workers,
            cpus,
            cpus,
        )
        workers = cpus
    # One worker process would only add a hop: read in the training process instead.
    num_workers = workers if workers > 1 else 0
    for flag in ("numa_enable", "use_distribute_dataset"):
        if getattr(dataset_section, flag):
            log.warning("train_dataset.%s has no effect in lmforge (see docs/data.md)", flag)
    if typed.python_multiprocessing:
        log.warning(
            "train_dataset.dataloader.python_multiprocessing has no effect in lmforge: "
            "num_parallel_workers > 1 always uses worker processes (see docs/data.md)"
        )
    name = f"the {SPLIT_NAMES[PHASES[phase]]} dataset ({', '.join(_prefixes(dataset))})"
    return MegatronDataLoader(
        dataset,
        columns=typed.columns,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        drop_remainder=dataset_section.drop_remainder,
        num_workers=num_workers,
        prefetch_size=dataset_section.prefetch_size,
        shuffle=typed.shuffle,
        seed=seed,
        consumed_samples=consumed_samples if phase == "train" else 0,
        infinite=phase == "train",
        vocab_size=vocab_size,
        name=name,
    )


def _build_text_dataloader(
    typed: TextLoader,
    phase: str,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int | None,
    seq_length: int | None,
    consumed_samples: int,
    workers: int,
    seed: int = 0,
) -> Any:
    from .text_loader import TextDataLoader
    from .text_settings import text_loader_settings

    # The keys were checked at load; this reads the tokenizer and checks that every source exists.
    settings = text_loader_settings(typed, seq_length=seq_length, vocab_size=vocab_size)
    if phase == "valid" and (settings.valid_paths or settings.validation_split):
        from .text_validation import TextValidationLoader

        return TextValidationLoader(
            settings, local_batch_size=local_batch_size, dp_rank=dp_rank, dp_size=dp_size
        )
    if phase != "train":
        return None  # no validation set named (valid_data_path / validation_split), no test split
    if typed.python_multiprocessing:
        log.warning(
            "train_dataset.dataloader.python_multiprocessing has no effect in lmforge: the tokenization "
            "workers (num_parallel_workers > 1) are always processes (see docs/data.md)"
        )
    workers = min(workers, os.cpu_count() or 1)
    return TextDataLoader(
        settings,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=workers if workers > 1 else 0,
        consumed_samples=consumed_samples,
        seed=seed,
    )


def _prefixes(dataset: GPTDataset | BlendedDataset) -> list[str]:
    members = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    return [m.indexed.prefix for m in members]


__all__ = [
    "COLUMN_DTYPES",
    "KNOWN_UNSUPPORTED_TYPES",
    "SUPPORTED_TYPES",
    "TEXT_TYPES",
    "build_dataloader",
    "build_dataset",
]
