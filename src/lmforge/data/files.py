"""Whether the data a ``train_dataset`` section names exists, checked without opening anything.

``lmforge check`` lists missing files as warnings (they are the machine's state, not the file's);
``lmforge train`` refuses missing training data before it builds a model or a process group.
"""

from __future__ import annotations

import glob
import os
import re
from collections.abc import Mapping
from typing import Any

CONFIG_KEYS = ("data_path", "train_data_path", "valid_data_path", "test_data_path")
TRAINING_KEYS = ("data_path", "train_data_path")  # what the training split reads
# Text / Hugging Face loaders name their sources on the dataloader itself (files, globs, directories).
LOADER_KEYS = ("data_path", "dataset_files", "dataset_dir")
TEXT_TYPES = ("TextDataLoader", "HFDataLoader")
_BLEND_WEIGHT = re.compile(r"\s*[-+]?[\d.eE]+\s*")


def missing_data_files(section: Any, keys: tuple[str, ...] = CONFIG_KEYS) -> list[str]:
    """One message per data prefix under ``train_dataset.dataloader.config.<key>`` that does not exist."""
    loader = (
        section.dataloader.to_dict()
        if hasattr(section, "dataloader")
        else dict(section.get("dataloader") or {})
    )
    inner = loader.get("config") if isinstance(loader.get("config"), Mapping) else {}
    candidates = [(f"train_dataset.dataloader.config.{k}", inner[k]) for k in keys if k in inner]
    if loader.get("type") in TEXT_TYPES:  # every source of a text loader is training data
        candidates += [(f"train_dataset.dataloader.{k}", loader[k]) for k in LOADER_KEYS if k in loader]
    messages = []
    for label, value in candidates:
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str) or _BLEND_WEIGHT.fullmatch(item):
                continue  # blend weights ('1', 0.3) sit between the prefixes
            if os.path.exists(item) or (os.path.exists(item + ".bin") and os.path.exists(item + ".idx")):
                continue
            if any(c in item for c in "*?[") and glob.glob(item):  # text loaders accept globs
                continue
            messages.append(f"{label}: {item!r} not found (neither the path nor {item}.bin/.idx exists)")
    return messages
