"""Blending several GPTDatasets by weight, and building the dataset of one split as Megatron does."""

from __future__ import annotations

import math
import os

import numpy as np

from lmforge.errors import DataError

from .config import CONFIG_PATH, GPTDatasetConfig
from .gpt_dataset import SPLIT_NAMES, GPTDataset, IndexCache
from .indexed import IndexedDataset, strip_suffix
from .indices import build_blending_indices, build_exhaustive_blending_indices, split_sequence_range


class BlendedDataset:
    """Sample k comes from dataset ``dataset_index[k]`` at its own position ``dataset_sample_index[k]``.

    The order inside each dataset is that dataset's shuffle; blending adds no shuffle of its own.
    """

    def __init__(
        self,
        datasets: list[GPTDataset],
        weights: list[float],
        size: int | None,
        config: GPTDatasetConfig,
        split: int,
    ) -> None:
        if size is not None:
            total = sum(float(w) for w in weights)
            weights = [float(w) / total for w in weights]
        self.datasets = datasets
        self.weights = weights
        self.config = config
        description = {
            "class": "BlendedDataset",
            "datasets": [d.indexed.prefix for d in datasets],
            "dataset_lengths": [len(d) for d in datasets],
            "weights": [float(w) for w in weights],
            "size": size,
            "split": SPLIT_NAMES[split],
            "random_seed": config.seed,
            "sequence_length": config.seq_length,
        }
        cache = IndexCache(
            config, datasets[0].indexed.prefix, "BlendedDataset", SPLIT_NAMES[split], description
        )
        names = ("dataset_index", "dataset_sample_index")
        arrays = cache.load(names)
        if arrays is None:
            if size is None:
                index, sample_index = build_exhaustive_blending_indices([int(w) for w in weights])
            else:
                index, sample_index = build_blending_indices(weights, size)
            arrays = {"dataset_index": index, "dataset_sample_index": sample_index}
            cache.save(arrays)
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        for d, dataset in enumerate(datasets):
            drawn = self.dataset_sample_index[self.dataset_index == d]
            if len(drawn) and int(drawn.max()) >= len(dataset):
                raise DataError(
                    f"the blend asks {dataset.indexed.prefix} for sample {int(drawn.max())} but it has "
                    f"{len(dataset)}; raise {CONFIG_PATH}.mid_level_dataset_surplus."
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, k: int | None) -> dict[str, np.ndarray]:
        if k is None:
            return self.datasets[0][None]
        return self.datasets[int(self.dataset_index[k])][int(self.dataset_sample_index[k])]

    def fill_row(self, k: int | None, batch: dict[str, np.ndarray], row: int) -> None:
        if k is None:
            self.datasets[0].fill_row(None, batch, row)
        else:
            self.datasets[int(self.dataset_index[k])].fill_row(int(self.dataset_sample_index[k]), batch, row)


def _open(prefix: str, path_key: str) -> IndexedDataset:
    prefix = strip_suffix(prefix)
    if not os.path.exists(f"{prefix}.idx") and not os.path.exists(f"{prefix}.bin"):
        raise DataError(
            f"{path_key}: no Megatron dataset at '{prefix}' (neither {prefix}.bin nor {prefix}.idx exists). "
            "Each entry is a prefix shared by a .bin/.idx pair; build one with 'lmforge data preprocess' "
            "or 'lmforge data demo'."
        )
    return IndexedDataset(prefix)


def _mid_level(
    prefix: str, bounds: tuple[float, float], num_samples: int | None, split: int, cfg, key
) -> GPTDataset:
    indexed = _open(prefix, key)
    return GPTDataset(indexed, split_sequence_range(bounds, len(indexed)), num_samples, split, cfg)


def build_split_dataset(
    config: GPTDatasetConfig, sizes: list[int | None], split: int
) -> GPTDataset | BlendedDataset | None:
    """The dataset of split 0/1/2 (train/valid/test), or None when the split is empty.

    Mirrors Megatron's ``BlendedMegatronDatasetBuilder``: a single unweighted prefix is a plain
    GPTDataset; weights need sizes and build each dataset with a small surplus; no weights blend
    in proportion to each dataset's own length (one epoch each).
    """
    blend, bounds = config.blend_for(split)
    if blend is None or bounds is None:
        return None
    key = (
        f"{CONFIG_PATH}.data_path"
        if config.data_path is not None
        else f"{CONFIG_PATH}.{SPLIT_NAMES[split]}_data_path"
    )
    size = sizes[split]
    prefixes, weights = blend.prefixes, blend.weights
    if len(prefixes) == 1 and (weights is None or config.data_path is None):
        return _mid_level(prefixes[0], bounds, size, split, config, key)
    if weights is not None:
        if size is None:
            raise DataError(
                f"{key} gives blend weights, which need a sample count: set train_dataset.dataloader.sizes "
                "[train, valid, test] (Megatron: 'Using client-specified weights requires client-specified size')."
            )
        targets = [math.ceil(size * w) for w in weights]
        buffers = [math.ceil(t * (1 + config.mid_level_dataset_surplus)) for t in targets]
        datasets = [_mid_level(p, bounds, n, split, config, key) for p, n in zip(prefixes, buffers)]
        return BlendedDataset(datasets, weights, sum(targets), config, split)
    datasets = [_mid_level(p, bounds, None, split, config, key) for p in prefixes]
    lengths = [len(d) for d in datasets]
    blended_size = None if size is None else min(size, sum(lengths))
    return BlendedDataset(datasets, [float(n) for n in lengths], blended_size, config, split)
