"""Every configuration shipped in configs/ validates with ``lmforge check``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from lmforge.cli import main
from lmforge.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[2] / "configs").glob("**/*.yaml"))


def test_demo_config_is_shipped() -> None:
    assert any(p.name == "demo.yaml" for p in CONFIGS)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.name for p in CONFIGS])
def test_shipped_config_validates(path: Path, capsys: Any) -> None:
    cfg = load_config(path)
    par = cfg.parallelism
    world = par.tensor_parallel * par.pipeline_parallel * par.context_parallel
    assert main(["check", "--config", str(path), "--world-size", str(world)]) == 0, capsys.readouterr().err


def test_demo_config_is_the_small_qwen3() -> None:
    cfg = load_config(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    assert cfg.model.model_type == "qwen3" and cfg.model.num_hidden_layers == 4
    assert cfg.train_dataset.dataloader.config.seq_length == cfg.model.seq_length == 256
    assert cfg.output_dir == "output/demo"
