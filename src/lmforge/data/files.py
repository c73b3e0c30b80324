"""Whether the data a ``train_dataset`` section names exists, and the index cache directory it names can
be written, checked without opening anything.

``lmforge check`` lists missing files and an unwritable ``path_to_cache`` as warnings (they are the
machine's state, not the file's); ``lmforge train`` refuses them before it builds a model or a process
group.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any

from lmforge.config import TrainDatasetConfig

from .config import CONFIG_PATH
from .schema import MegatronLoader, TextLoader
from .text_schema import KEY as TEXT_KEY

CONFIG_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
TRAINING_KEYS = ("data_path", "train_data_path")  # what the training split reads
_BLEND_WEIGHT = re.compile(r"\s*[-+]?[\d.eE]+\s*")


def _candidates(section: TrainDatasetConfig, keys: tuple[str, ...]) -> list[tuple[str, list[Any]]]:
    """(dotted key, the paths it names) of the typed ``train_dataset`` section."""
    typed = section.dataloader.typed
    if isinstance(typed, MegatronLoader):
        blends = [(k, getattr(typed.config, k)) for k in keys]
        return [(f"{CONFIG_PATH}.{k}", blend.prefixes) for k, blend in blends if blend is not None]
    if isinstance(typed, TextLoader):  # every source of a text loader is training data
        return [(typed.sources_key, typed.data_path.prefixes)]
    return []


def missing_data_files(section: TrainDatasetConfig, keys: tuple[str, ...] = CONFIG_KEYS) -> list[str]:
    """One message per data path of the typed ``train_dataset`` section (``keys``: which of a Megatron
    loader's blends) that does not exist."""
    messages = []
    for label, items in _candidates(section, keys):
        for item in items:
            if not isinstance(item, str) or _BLEND_WEIGHT.fullmatch(item):
                continue  # blend weights ('1', 0.3) sit between the prefixes
            if os.path.exists(item) or (os.path.exists(item + ".bin") and os.path.exists(item + ".idx")):
                continue
            if any(c in item for c in "*?[") and glob.glob(item):  # text loaders accept globs
                continue
            messages.append(f"{label}: {item!r} not found (neither the path nor {item}.bin/.idx exists)")
    typed = section.dataloader.typed
    if isinstance(typed, TextLoader) and not os.path.exists(typed.tokenizer):
        # The text loader tokenizes on the fly: without its tokenizer it cannot read a row. (`check`
        # passed this, and `train` refused it only after building the model.)
        messages.append(
            f"{TEXT_KEY}.tokenizer: {typed.tokenizer!r} not found (a local tokenizer.json or a directory "
            "holding one)"
        )
    return messages


def cache_dir_problem(section: TrainDatasetConfig, where: str = "train_dataset") -> str | None:
    """Why the index cache directory a Megatron loader's ``path_to_cache`` names cannot be used, or None
    (None too when the key is not set: the default beside the data falls back to memory when it cannot
    be written, since the user did not ask for it). A directory still to be created is judged by the
    nearest one that exists, which must let this process create it."""
    typed = section.dataloader.typed
    path = typed.config.path_to_cache if isinstance(typed, MegatronLoader) else None
    if not path:
        return None
    key = f"{where}.dataloader.config.path_to_cache"
    target = os.path.abspath(path)
    existing = target
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        why = "is a file" if existing == target else f"lies under {existing}, which is a file"
        return f"{key}: {path!r} {why}, not a directory; point it at a directory the index arrays can be written to"
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "cannot be written" if existing == target else f"cannot be created in {existing}"
        return (
            f"{key}: {path!r} {what} by this user; point it at a writable directory, or remove the key to "
            "cache beside the data (<data dir>/cache/GPTDataset_indices)"
        )
    return None


def cache_dir_problems(train: TrainDatasetConfig, eval_section: TrainDatasetConfig | None) -> list[str]:
    """:func:`cache_dir_problem` of the run's training data and of its own validation data, if any."""
    problems = [cache_dir_problem(train)]
    if eval_section is not None:
        problems.append(cache_dir_problem(eval_section, "eval_dataset"))
    return [p for p in problems if p is not None]


def text_loader_problem(section: TrainDatasetConfig, seq_length: int, vocab_size: int) -> str | None:
    """Why a text loader could not start with the model of ``seq_length`` / ``vocab_size``: its tokenizer
    is not a tokenizer.json, has no end-of-document token, or gives ids (eod, pad) beyond the model's
    vocabulary; or a source has no file of a known format. What the loader itself checks when it is built
    (``text_loader_settings``), run before the model is; None when it can start, or when it is not a text
    loader, or when its data or tokenizer is missing (:func:`missing_data_files` says so)."""
    from lmforge.errors import ConfigError, DataError

    from .text_settings import text_loader_settings

    typed = section.dataloader.typed
    if not isinstance(typed, TextLoader) or missing_data_files(section):
        return None
    try:
        text_loader_settings(typed, seq_length=seq_length, vocab_size=vocab_size)
    except (ConfigError, DataError) as exc:
        return str(exc).rstrip(".")
    return None
