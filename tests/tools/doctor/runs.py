"""Tiny real runs for the doctor's tests: a 2-layer Qwen3 (or Qwen3-MoE) trained by the real builders.

``train_run(tmp, name, **changes)`` writes a train.yaml with ``changes`` (dotted key -> value, the
induced pathology) applied, trains it in-process with :func:`build_trainer` and returns the run dir.
The data are learnable arithmetic token sequences, so a healthy run's loss falls within a few steps.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import yaml

from lmforge.config import load_config
from lmforge.data import IndexedDatasetWriter
from lmforge.train.builder import build_trainer

VOCAB = 64

BASE: dict[str, Any] = {
    "training": {"steps": 30, "local_batch_size": 4, "global_batch_size": 4, "seed": 3, "max_norm": 1.0},
    "optimizer": {
        "type": "AdamW",
        "betas": [0.9, 0.95],
        "eps": 1.0e-8,
        "weight_decay": 0.01,
        "weight_decay_exclude": ["*norm*", "*bias*"],
    },
    "lr_scheduler": {
        "type": "CosineWithWarmUpLR",
        "learning_rate": 1.0e-2,
        "warmup_steps": 2,
        "lr_end": 1.0e-3,
    },
    "checkpoint": {"enable_save": True, "save_interleaved_steps": 1000},
    "model": {
        "model_type": "qwen3",
        "architectures": "Qwen3ForCausalLM",
        "num_hidden_layers": 2,
        "hidden_size": 32,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "intermediate_size": 64,
        "vocab_size": VOCAB,
        "seq_length": 32,
        "compute_dtype": "float32",
    },
}

MOE_MODEL: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "architectures": "Qwen3MoeForCausalLM",
    "num_hidden_layers": 2,
    "hidden_size": 32,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 1,
    "vocab_size": VOCAB,
    "seq_length": 32,
    "compute_dtype": "float32",
}


def write_data(prefix: Path) -> None:
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(200):
            start, step, n = int(rng.integers(1, VOCAB)), int(rng.integers(1, 4)), int(rng.integers(10, 40))
            writer.add_document([1 + (start + step * i) % (VOCAB - 1) for i in range(n)] + [0])


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def run_config(tmp: Path, name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    prefix = tmp / "data" / "docs"
    if not (tmp / "data" / "docs.bin").exists():
        prefix.parent.mkdir(parents=True, exist_ok=True)
        write_data(prefix)
    raw = copy.deepcopy(BASE)
    raw["output_dir"] = str(tmp / name)
    raw["checkpoint"]["save_path"] = str(tmp / name / "checkpoints")
    raw["train_dataset"] = {
        "dataloader": {
            "type": "BlendedMegatronDatasetDataLoader",
            "datasets_type": "GPTDataset",
            "column_names": ["input_ids", "labels", "loss_mask", "position_ids"],
            "shuffle": True,
            "config": {
                "seq_length": 32,
                "eod": 0,
                "data_path": [str(prefix)],
                "split": "100,0,0",
                "create_attention_mask": False,
                "path_to_cache": str(tmp / "cache"),
            },
        },
        "num_parallel_workers": 0,
    }
    for key, value in (changes or {}).items():
        set_dotted(raw, key, value)
    return raw


def train_run(
    tmp: Path,
    name: str,
    changes: dict[str, Any] | None = None,
    *,
    prepare: Callable[[Any], None] | None = None,
) -> Path:
    """Train one run; ``prepare(trainer)`` may alter the built model/optimizer before training."""
    raw = run_config(tmp, name, changes)
    (tmp / f"{name}.yaml").write_text(yaml.safe_dump(raw))
    cfg = load_config(raw)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        trainer = build_trainer(cfg, device="cpu")
        if prepare is not None:
            prepare(trainer)
        trainer.fit()
    except Exception as exc:  # a diverged run still leaves its run dir for the doctor
        if type(exc).__name__ != "TrainingStopped":
            raise
    finally:
        torch.set_num_threads(threads)
    return Path(raw["output_dir"])
