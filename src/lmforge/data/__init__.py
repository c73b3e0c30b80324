"""Megatron-format data: indexed .bin/.idx files, GPTDataset, blending, the resumable loader.

The trainer's entry point is :func:`build_dataloader`; see docs/data.md.
"""

from .blended import BlendedDataset, build_split_dataset
from .build import SUPPORTED_TYPES, build_dataloader, build_dataset
from .config import GPTDatasetConfig
from .gpt_dataset import GPTDataset
from .indexed import IndexedDataset, IndexedDatasetWriter, optimal_token_dtype
from .loader import MegatronDataLoader

__all__ = [
    "SUPPORTED_TYPES",
    "BlendedDataset",
    "GPTDataset",
    "GPTDatasetConfig",
    "IndexedDataset",
    "IndexedDatasetWriter",
    "MegatronDataLoader",
    "build_dataloader",
    "build_dataset",
    "build_split_dataset",
    "optimal_token_dtype",
]
