"""``--output-dir`` moves every output of a run; ``check`` prints where each output goes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from lmforge.cli import main
from lmforge.config import load_config
from lmforge.config.outputs import with_output_dir


def test_paths_under_the_files_output_dir_follow(base_config: dict[str, Any]) -> None:
    base_config.update(
        output_dir="output/demo",
        checkpoint={"save_path": "output/demo/checkpoints", "load_path": "output/demo/checkpoints"},
        monitor={"tensorboard": {"output_dir": "./output/demo/tb"}},
        profiler={"output_path": "/elsewhere/prof"},
    )
    cfg = with_output_dir(load_config(base_config), "runs/a")
    assert cfg.output_dir == "runs/a"
    assert cfg.checkpoint.save_path == "runs/a/checkpoints"
    # load_path is what the run starts from: kept as written, never moved with the outputs
    assert cfg.checkpoint.load_path == "output/demo/checkpoints"
    assert cfg.monitor.tensorboard.output_dir == "runs/a/tb"
    assert cfg.profiler.output_path == "/elsewhere/prof"  # the user's explicit place elsewhere stays
    # Everything else is unchanged and still frozen and typed.
    assert cfg.training == load_config(base_config).training


def test_default_output_dir_counts_as_the_root(base_config: dict[str, Any]) -> None:
    base_config["checkpoint"] = {"save_path": "output/ck"}
    cfg = with_output_dir(load_config(base_config), "/tmp/x")
    assert cfg.checkpoint.save_path == "/tmp/x/ck"


def test_check_prints_every_output(tmp_path: Path, base_config: dict[str, Any], capsys: Any) -> None:
    base_config.update(output_dir="output/demo", checkpoint={"save_path": "output/demo/ck"})
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    assert main(["check", "--config", str(path), "--output-dir", "runs/b"]) == 0
    out = capsys.readouterr().out
    assert "TensorBoard events: runs/b/tensorboard" in out and "checkpoints: runs/b/ck" in out
    assert "log, metrics.jsonl, curves.png, summary.json: runs/b" in out


def test_output_dir_keeps_an_explicit_load_path(
    tmp_path: Path, base_config: dict[str, Any], capsys: Any
) -> None:
    """The issue's reproduction: resuming a recipe's checkpoint into a new --output-dir."""
    base_config.update(output_dir="output/pre", checkpoint={"save_path": "output/pre/checkpoints"})
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(base_config), encoding="utf-8")
    load = "checkpoint.load_path=output/pre/checkpoints/iteration_00000015"
    assert main(["check", "--config", str(path), "--set", load, "--output-dir", "output/resume"]) == 0
    out = capsys.readouterr().out
    assert (
        "weights loaded from (checkpoint.load_path, never moved): output/pre/checkpoints/iteration_00000015"
        in out
    )
    assert "checkpoints: output/resume/checkpoints" in out


def _tiny_run(tmp_path: Path) -> Path:
    from lmforge.data import IndexedDatasetWriter

    prefix = tmp_path / "data" / "docs"
    prefix.parent.mkdir()
    rng = np.random.default_rng(0)
    with IndexedDatasetWriter(prefix, np.uint16) as writer:
        for _ in range(40):
            writer.add_document([int(t) for t in rng.integers(1, 32, size=20)] + [0])
    raw = {
        "output_dir": str(tmp_path / "output" / "demo"),
        "training": {"steps": 2, "local_batch_size": 2, "global_batch_size": 2},
        "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 1.0e-3},
        "checkpoint": {"save_path": str(tmp_path / "output" / "demo" / "ck"), "save_interleaved_steps": 2},
        "monitor": {"tensorboard": {"output_dir": str(tmp_path / "output" / "demo" / "tb")}},
        "model": {
            "model_type": "qwen3",
            "architectures": "Qwen3ForCausalLM",
            "num_hidden_layers": 1,
            "hidden_size": 16,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "intermediate_size": 32,
            "vocab_size": 32,
            "seq_length": 8,
        },
        "train_dataset": {
            "dataloader": {
                "type": "BlendedMegatronDatasetDataLoader",
                "config": {"seq_length": 8, "data_path": [str(prefix)], "split": "100,0,0", "eod": 0},
            },
            "num_parallel_workers": 0,
        },
    }
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(raw), encoding="utf-8")
    return path


@pytest.mark.slow
def test_train_with_output_dir_writes_nothing_into_the_files_output_dir(tmp_path: Path) -> None:
    pytest.importorskip("torch.utils.tensorboard")
    path = _tiny_run(tmp_path)
    run = tmp_path / "runs" / "a"
    assert main(["train", "--config", str(path), "--output-dir", str(run), "--device", "cpu"]) == 0
    assert not (tmp_path / "output").exists()
    assert (run / "metrics.jsonl").is_file() and (run / "ck" / "latest_checkpointed_iteration.txt").is_file()
    assert any((run / "tb").iterdir())
