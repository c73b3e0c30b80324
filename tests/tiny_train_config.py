"""The train.yaml of a tiny real training run, in one place: the CLI tests (tests/train/test_train_cli.py,
whose ``write_config`` many end-to-end tests import) and the doctor's induced-pathology runs
(tests/tools/doctor/runs.py) both write theirs with :func:`tiny_run_config`.

The model is tests/tiny_fp32.py's :func:`tiny_run_model`; the data are learnable arithmetic token
sequences (so a healthy run's loss falls within a few steps) in Megatron .bin/.idx files, with a
word-level tokenizer whose ids are the data's token ids when a test needs one (generate, export).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lmforge.data import IndexedDatasetWriter
from tiny_fp32 import TINY_RUN_MODEL, tiny_run_model

VOCAB = TINY_RUN_MODEL["vocab_size"]


def write_arithmetic_documents(prefix: Path, count: int) -> None:
    """``count`` documents ``start, start+step, ...`` (mod the vocabulary) ending with the eod token 0."""
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(count):
            start, step, n = int(rng.integers(1, VOCAB)), int(rng.integers(1, 4)), int(rng.integers(10, 40))
            writer.add_document([1 + (start + step * i) % (VOCAB - 1) for i in range(n)] + [0])


def write_word_tokenizer(path: Path) -> None:
    """A word-level tokenizer whose ids are the data's token ids ("t1" .. "t63"; 0 is the eod)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"t{i}": i for i in range(1, VOCAB)}
    vocab["<|endoftext|>"] = 0
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t1"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))


def megatron_train_dataset(
    prefix: Path,
    *,
    seq_length: int,
    split: str,
    cache: Path,
    workers: int,
    shuffle: bool | None = None,
    attention_mask: bool | None = False,
) -> dict[str, Any]:
    """The ``train_dataset`` section of the tests' tiny runs: GPTDataset windows of ``prefix``'s
    .bin/.idx, eod 0. ``shuffle`` / ``attention_mask`` None leave the key out (its default)."""
    loader: dict[str, Any] = {
        "type": "BlendedMegatronDatasetDataLoader",
        "datasets_type": "GPTDataset",
        "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
    }
    if shuffle is not None:
        loader["shuffle"] = shuffle
    config: dict[str, Any] = {"seq_length": seq_length, "eod": 0, "data_path": [str(prefix)], "split": split}
    if attention_mask is not None:
        config["create_attention_mask"] = attention_mask
    config["path_to_cache"] = str(cache)
    loader["config"] = config
    return {"dataloader": loader, "num_parallel_workers": workers}


def tiny_run_config(
    tmp: Path,
    *,
    output_dir: Path,
    training: dict[str, Any],
    optimizer: dict[str, Any],
    lr_scheduler: dict[str, Any],
    checkpoint: dict[str, Any],
    seq_length: int,
    split: str,
    documents: int,
    model: dict[str, Any] | None = None,
    tokenizer: bool = False,
) -> dict[str, Any]:
    """The mapping of a tiny run's train.yaml. Its data (``documents`` documents, and tokenizer.json when
    ``tokenizer``) are written once under ``tmp/data``; ``model`` overrides keys of the tiny run model."""
    prefix = tmp / "data" / "docs"
    prefix.parent.mkdir(parents=True, exist_ok=True)
    if not (prefix.parent / "docs.bin").exists():
        write_arithmetic_documents(prefix, documents)
    if tokenizer and not (prefix.parent / "tokenizer.json").exists():
        write_word_tokenizer(prefix.parent / "tokenizer.json")
    return {
        "output_dir": str(output_dir),
        "training": dict(training),
        "optimizer": dict(optimizer),
        "lr_scheduler": dict(lr_scheduler),
        "checkpoint": dict(checkpoint),
        "model": tiny_run_model(seq_length=seq_length, **(model or {})),
        "train_dataset": megatron_train_dataset(
            prefix, seq_length=seq_length, split=split, cache=tmp / "cache", shuffle=True, workers=0
        ),
    }
