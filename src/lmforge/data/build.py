"""``build_dataloader``: the ``train_dataset`` section in, a resumable micro-batch loader out."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from lmforge.errors import ConfigError, DataError
from lmforge.utils.logging import get_logger
from lmforge.utils.sections import section_to_dict

from .blended import BlendedDataset, build_split_dataset
from .config import CONFIG_PATH, GPTDatasetConfig, no_effect_keys, parse_gpt_config
from .gpt_dataset import SPLIT_NAMES, GPTDataset
from .loader import COLUMN_DTYPES, MegatronDataLoader

log = get_logger("lmforge.data")

SUPPORTED_TYPES = ("BlendedMegatronDatasetDataLoader", "TextDataLoader", "HFDataLoader")
# Text / Hugging Face data tokenized on the fly (text_loader.py; HFDataLoader is mapped onto it).
TEXT_TYPES = ("TextDataLoader", "HFDataLoader")
# Loader types of MindSpore Transformers that lmforge does not implement (named in the error).
KNOWN_UNSUPPORTED_TYPES = ("MindDataset", "OrderedIndexDataLoader")
PHASES = {"train": 0, "valid": 1, "test": 2}
# Scanning .bin files up to this size for out-of-vocabulary ids takes well under a second; larger
# data are checked batch by batch instead.
FULL_VOCAB_SCAN_BYTES = 1 << 30

_DATALOADER_KEYS = {
    "type",
    "datasets_type",
    "sizes",
    "config",
    "column_names",
    "shuffle",
    "python_multiprocessing",
    "tokenizer",
}


def _check_type(loader: dict[str, Any]) -> None:
    kind = loader.get("type")
    if kind in SUPPORTED_TYPES:
        return
    what = "is missing" if kind is None else f"is '{kind}'"
    extra = (
        f" lmforge does not implement MindSpore Transformers' {kind}; read Megatron .bin/.idx data (convert "
        "with 'lmforge data preprocess') or text / Hugging Face datasets with TextDataLoader."
        if kind in KNOWN_UNSUPPORTED_TYPES
        else ""
    )
    raise ConfigError(
        f"train_dataset.dataloader.type {what}.{extra} Supported: {', '.join(SUPPORTED_TYPES)} "
        f"(Unsupported dataloader type: {kind})."
    )


def _parse_sizes(value: Any) -> list[int | None]:
    key = "train_dataset.dataloader.sizes"
    if value is None:
        return [None, None, None]
    if not isinstance(value, (list, tuple)) or len(value) > 3:
        raise ConfigError(
            f"{key} must be a list [train, valid, test] of sample counts (or null); got {value!r}."
        )
    out: list[int | None] = []
    for i, v in enumerate(list(value) + [None] * (3 - len(value))):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ConfigError(f"{key}[{i}] must be a sample count >= 0 or null; got {v!r}.")
        out.append(v)
    return out


def _check_columns(columns: Any, cfg: GPTDatasetConfig) -> list[str]:
    key = "train_dataset.dataloader.column_names"
    if columns is None:
        columns = ["input_ids", "labels"]
    if not isinstance(columns, (list, tuple)) or not all(isinstance(c, str) for c in columns) or not columns:
        raise ConfigError(f"{key} must be a list of column names; got {columns!r}.")
    available = ["input_ids", "labels", "loss_mask", "position_ids"]
    if cfg.create_compressed_eod_mask:
        available.append("actual_seq_len")
    elif cfg.create_attention_mask:
        available.append("attention_mask")
    for c in columns:
        if c in available:
            continue
        if c == "attention_mask":
            why = (
                f"{CONFIG_PATH}.create_compressed_eod_mask is true (it replaces the mask by actual_seq_len)"
                if cfg.create_compressed_eod_mask
                else f"{CONFIG_PATH}.create_attention_mask is false"
            )
            raise ConfigError(f"{key} asks for attention_mask but {why}.")
        if c == "actual_seq_len":
            raise ConfigError(
                f"{key} asks for actual_seq_len, which needs {CONFIG_PATH}.create_compressed_eod_mask: true."
            )
        raise ConfigError(f"{key} contains '{c}'; this dataset provides: {', '.join(available)}.")
    if len(set(columns)) != len(columns):
        raise ConfigError(f"{key} names a column twice: {list(columns)}.")
    return list(columns)


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


def _parse_section(
    dataset_section: Any, *, vocab_size: int | None, seq_length: int | None
) -> tuple[dict[str, Any], dict[str, Any], GPTDatasetConfig, list[int | None]]:
    """Validate the section without touching any file: (section, dataloader, config, sizes)."""
    section = section_to_dict(dataset_section)
    loader = section.get("dataloader")
    if not isinstance(loader, dict):
        raise ConfigError(
            "train_dataset.dataloader is required: a mapping with type: BlendedMegatronDatasetDataLoader, "
            "datasets_type, sizes, column_names and config."
        )
    loader = section_to_dict(loader)
    _check_type(loader)
    kind = loader.get("datasets_type", "GPTDataset")
    if kind != "GPTDataset":
        raise ConfigError(
            f"train_dataset.dataloader.datasets_type is '{kind}'; the only supported value is GPTDataset."
        )
    raw_config = loader.get("config")
    if raw_config is None:
        raise ConfigError(
            f"{CONFIG_PATH} is required for BlendedMegatronDatasetDataLoader: at least seq_length, "
            "data_path and split (or train_data_path / valid_data_path)."
        )
    raw_config = section_to_dict(raw_config)
    cfg = parse_gpt_config(raw_config, vocab_size=vocab_size)
    if seq_length is not None and cfg.seq_length != seq_length:
        raise ConfigError(
            f"{CONFIG_PATH}.seq_length ({cfg.seq_length}) must equal model.seq_length ({seq_length})."
        )
    sizes = _parse_sizes(loader.get("sizes"))
    _check_columns(loader.get("column_names"), cfg)
    for key in ("num_parallel_workers", "prefetch_size"):
        value = section.get(key, 8 if key == "num_parallel_workers" else 1)
        low = 0 if key == "num_parallel_workers" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"train_dataset.{key} must be an integer >= {low}; got {value!r}.")
    return section, loader, cfg, sizes


def _text_loader_section(dataset_section: Any) -> dict[str, Any] | None:
    """The dataloader mapping of a text loader (HFDataLoader translated), or None for Megatron data."""
    loader = section_to_dict(section_to_dict(dataset_section).get("dataloader"))
    if loader.get("type") not in TEXT_TYPES:
        return None
    if loader["type"] == "HFDataLoader":
        from .hf_loader import translate_hf_loader

        return translate_hf_loader(loader)
    return loader


def validate_dataset_section(
    dataset_section: Any, *, vocab_size: int | None = None, seq_length: int | None = None
) -> None:
    """Every check of ``build_dataloader`` that needs no data file, and the warnings about settings that
    change nothing (every unknown dataloader key at once). The run plan calls it before anything is
    built, so ``build_dataset`` does not repeat the warnings."""
    text = _text_loader_section(dataset_section)
    if text is not None:
        from .text_loader import parse_text_loader

        parse_text_loader(text, seq_length=seq_length, vocab_size=vocab_size, read_files=False)
        return
    _, loader, _, _ = _parse_section(dataset_section, vocab_size=vocab_size, seq_length=seq_length)
    unknown = sorted(set(loader) - _DATALOADER_KEYS)
    if unknown:
        log.warning(
            "%s not used by BlendedMegatronDatasetDataLoader; ignored (valid keys: %s)",
            ", ".join(f"train_dataset.dataloader.{k}" for k in unknown)
            + (" is" if len(unknown) == 1 else " are"),
            ", ".join(sorted(_DATALOADER_KEYS)),
        )
    for key in no_effect_keys(section_to_dict(loader["config"])):
        log.warning("%s.%s has no effect in lmforge (see docs/data.md)", CONFIG_PATH, key)


def build_dataset(
    dataset_section: Any,
    *,
    phase: str = "train",
    vocab_size: int | None = None,
    seq_length: int | None = None,
) -> tuple[GPTDataset | BlendedDataset | None, dict[str, Any]]:
    """The GPTDataset/BlendedDataset of one phase (None if that split is empty) and the section dict."""
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {sorted(PHASES)}, got {phase!r}")
    section, loader, cfg, sizes = _parse_section(
        dataset_section, vocab_size=vocab_size, seq_length=seq_length
    )
    if 0 <= cfg.pad == cfg.eod:
        # Megatron: a pad id equal to EOD would mask every EOD label; it is dropped with a warning.
        log.warning("%s.pad equals eod (%d); treating pad as unset (-1)", CONFIG_PATH, cfg.pad)
        cfg = replace(cfg, pad=-1)
    dataset = build_split_dataset(cfg, sizes, PHASES[phase])
    if dataset is not None and vocab_size is not None:
        _check_vocab_upfront(dataset, vocab_size)
    section["_parsed"] = {"config": cfg, "loader": loader}
    return dataset, section


def build_dataloader(
    dataset_section: Any,
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

    ``dataset_section`` is ``train_dataset`` (pydantic section or dict). The batch arithmetic
    (global batch against ``dp_size * local_batch_size``) is the run plan's. Tensor/context-parallel
    peers pass the same ``dp_rank`` and so read the same shard. ``seed`` (training.seed) seeds only
    the optional ``dataloader.shuffle``; the sample order itself comes from ``config.seed`` as in
    Megatron. Training loaders run forever across epochs; valid/test loaders run one epoch per
    ``iter()``.
    """
    if local_batch_size < 1:
        raise ConfigError(f"training.local_batch_size must be >= 1; got {local_batch_size}.")
    text = _text_loader_section(dataset_section)
    if text is not None:
        return _build_text_dataloader(
            text,
            dataset_section,
            phase,
            local_batch_size,
            dp_rank,
            dp_size,
            vocab_size,
            seq_length,
            consumed_samples,
        )
    dataset, section = build_dataset(
        dataset_section, phase=phase, vocab_size=vocab_size, seq_length=seq_length
    )
    if dataset is None:
        return None
    parsed = section.pop("_parsed")
    loader = parsed["loader"]
    columns = _check_columns(loader.get("column_names"), parsed["config"])
    workers = section.get("num_parallel_workers", 8)
    prefetch = section.get("prefetch_size", 1)
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
        if section.get(flag):
            log.warning("train_dataset.%s has no effect in lmforge (see docs/data.md)", flag)
    if loader.get("python_multiprocessing"):
        log.warning(
            "train_dataset.dataloader.python_multiprocessing has no effect in lmforge: "
            "num_parallel_workers > 1 always uses worker processes (see docs/data.md)"
        )
    drop_remainder = section.get("drop_remainder", True)
    name = f"the {SPLIT_NAMES[PHASES[phase]]} dataset ({', '.join(_prefixes(dataset))})"
    return MegatronDataLoader(
        dataset,
        columns=columns,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        drop_remainder=bool(drop_remainder),
        num_workers=num_workers,
        prefetch_size=prefetch,
        shuffle=bool(loader.get("shuffle", False)),
        seed=seed,
        consumed_samples=consumed_samples if phase == "train" else 0,
        infinite=phase == "train",
        vocab_size=vocab_size,
        name=name,
    )


def _build_text_dataloader(
    loader: dict[str, Any],
    dataset_section: Any,
    phase: str,
    local_batch_size: int,
    dp_rank: int,
    dp_size: int,
    vocab_size: int | None,
    seq_length: int | None,
    consumed_samples: int,
) -> Any:
    from .text_loader import TextDataLoader, parse_text_loader

    settings = parse_text_loader(loader, seq_length=seq_length, vocab_size=vocab_size)
    if phase != "train":
        return None  # one stream: the text loader has no valid/test split
    section = section_to_dict(dataset_section)
    workers = section.get("num_parallel_workers", 8)
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
        raise ConfigError(f"train_dataset.num_parallel_workers must be an integer >= 0; got {workers!r}.")
    workers = min(workers, os.cpu_count() or 1)
    return TextDataLoader(
        settings,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=workers if workers > 1 else 0,
        consumed_samples=consumed_samples,
    )


def _prefixes(dataset: GPTDataset | BlendedDataset) -> list[str]:
    members = dataset.datasets if isinstance(dataset, BlendedDataset) else [dataset]
    return [m.indexed.prefix for m in members]


__all__ = [
    "COLUMN_DTYPES",
    "KNOWN_UNSUPPORTED_TYPES",
    "SUPPORTED_TYPES",
    "build_dataloader",
    "build_dataset",
    "validate_dataset_section",
]
