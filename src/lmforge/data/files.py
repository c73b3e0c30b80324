"""Whether the data a ``train_dataset`` section names exists, checked without opening anything.

``lmforge check`` lists missing files as warnings (they are the machine's state, not the file's);
``lmforge train`` refuses missing training data before it builds a model or a process group.
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
