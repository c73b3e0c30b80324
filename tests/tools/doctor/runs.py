"""Tiny real runs for the doctor's tests: a 2-layer Qwen3 (or Qwen3-MoE) trained by the real builders.

``train_run(tmp, name, **changes)`` writes a train.yaml with ``changes`` (dotted key -> value, the
induced pathology) applied, trains it in-process with :func:`build_trainer` and returns the run dir.
The config (model, learnable arithmetic token data) is tests/tiny_train_config.py's, shared with the CLI tests.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from lmforge.config import load_config
from lmforge.train.builder import build_trainer
from tiny_fp32 import tiny_run_model
from tiny_train_config import tiny_run_config

TRAINING = {"steps": 30, "local_batch_size": 4, "global_batch_size": 4, "seed": 3, "max_norm": 1.0}
OPTIMIZER = {
    "type": "AdamW",
    "betas": [0.9, 0.95],
    "eps": 1.0e-8,
    "weight_decay": 0.01,
    "weight_decay_exclude": ["*norm*", "*bias*"],
}
LR_SCHEDULER = {"type": "CosineWithWarmUpLR", "learning_rate": 1.0e-2, "warmup_steps": 2, "lr_end": 1.0e-3}
SEQ_LENGTH = 32

MOE_MODEL: dict[str, Any] = tiny_run_model(
    model_type="qwen3_moe",
    architectures="Qwen3MoeForCausalLM",
    head_dim=8,
    moe_intermediate_size=16,
    num_experts=4,
    num_experts_per_tok=1,
    seq_length=SEQ_LENGTH,
    compute_dtype="float32",
)


def set_dotted(raw: dict[str, Any], key: str, value: Any) -> None:
    node = raw
    *parents, last = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def run_config(tmp: Path, name: str, changes: dict[str, Any] | None = None) -> dict[str, Any]:
    raw = tiny_run_config(
        tmp,
        output_dir=tmp / name,
        training=TRAINING,
        optimizer=OPTIMIZER,
        lr_scheduler=LR_SCHEDULER,
        checkpoint={
            "enable_save": True,
            "save_interleaved_steps": 1000,
            "save_path": str(tmp / name / "checkpoints"),
        },
        model={"head_dim": 8, "compute_dtype": "float32"},
        seq_length=SEQ_LENGTH,
        split="100,0,0",
        documents=200,
    )
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
