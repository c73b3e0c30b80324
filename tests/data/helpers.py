"""Small hand-made Megatron datasets for the data tests."""

from __future__ import annotations

import numpy as np

from lmforge.config import validate_section
from lmforge.data import IndexedDatasetWriter

# The worked example of the data reference: three documents ending in EOD = 0.
TOY_DOCS = [[5, 6, 7, 0], [8, 9, 0], [10, 11, 12, 13, 14, 0]]


def write_docs(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(prefix, dtype) as writer:
        for doc in docs:
            writer.add_document(doc)
    return str(prefix)


def random_docs(seed: int, count: int, vocab: int = 500, eod: int = 0, max_len: int = 60) -> list[list[int]]:
    """Documents of random length with ids in [1, vocab) and a trailing EOD."""
    rng = np.random.default_rng(seed)
    return [list(rng.integers(1, vocab, size=int(rng.integers(1, max_len)))) + [eod] for _ in range(count)]


def loader_section(config: dict, *, sizes=None, columns=None, shuffle=False, workers=1, drop_remainder=True):
    section = {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "datasets_type": "GPTDataset",
            "column_names": columns or ["input_ids", "labels", "loss_mask", "position_ids"],
            "shuffle": shuffle,
            "config": {"create_attention_mask": False, **config},
        },
        "drop_remainder": drop_remainder,
        "num_parallel_workers": workers,
    }
    if sizes is not None:
        section["dataloader"]["sizes"] = sizes
    return section


def typed(section: dict):
    """The typed ``train_dataset`` section the builders take, validated as load_config validates it."""
    return validate_section("train_dataset", section)
