from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lmforge.config import load_config
from lmforge.config.registry import register_section_schema
from lmforge.lr import ScheduleLR, build_scheduler
from lmforge.train.rng import seed_everything
from lmforge.train.trainer import Trainer

from .tiny import TinyLM, TinyLoader

# The toy model these tests build by hand is a component lmforge does not ship: like a plugin, it
# registers its (trivial) section schema so that load_config, which types the model section per
# model_type, accepts it.
register_section_schema("model", "tiny", lambda section, path, cfg: None)


def tiny_config(tmp_path: Path, **sections: Any):
    raw: dict[str, Any] = {
        "output_dir": str(tmp_path / "run"),
        "model": {"model_type": "tiny", "architectures": "TinyLM"},
        "lr_scheduler": {
            "type": "CosineWithWarmUpLR",
            "learning_rate": 0.05,
            "warmup_steps": 2,
            "lr_end": 0.005,
        },
        # The tests feed batches by hand (dataloader_factory); the section only has to be valid: a text
        # loader is checked at load without reading its files.
        "train_dataset": {
            "dataloader": {"type": "TextDataLoader", "data_path": ["unused.jsonl"], "tokenizer": "unused"}
        },
        "training": {
            "steps": 8,
            "global_batch_size": 4,
            "local_batch_size": 2,
            "seed": 7,
            "deterministic": True,
        },
        "checkpoint": {"enable_save": True, "save_path": str(tmp_path / "ckpt"), "save_interleaved_steps": 4},
    }
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values) if isinstance(values, dict) else raw.__setitem__(name, values)
    return load_config(raw)


def tiny_trainer(cfg, *, optimizer: str = "adamw", callbacks=None, masked: bool = True) -> Trainer:
    seed_everything(cfg.training.seed, cfg.training.deterministic)
    model = TinyLM()
    if optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr_scheduler.learning_rate, weight_decay=0.01)
    else:
        raise ValueError(optimizer)
    sched = ScheduleLR(opt, build_scheduler(cfg.lr_scheduler, cfg.training.steps))
    lbs = cfg.training.local_batch_size
    return Trainer(
        cfg,
        model=model,
        optimizer=opt,
        scheduler=sched,
        dataloader_factory=lambda consumed: TinyLoader(consumed, lbs, seed=cfg.training.seed, masked=masked),
        callbacks=callbacks,
        peak_flops=1e9,
        log_to_file=True,
    )


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster than two fighting over a shared machine (and the
    results are bitwise the same either way, see torch_cpu.md)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_config(tmp_path):
    return lambda **sections: tiny_config(tmp_path, **sections)
