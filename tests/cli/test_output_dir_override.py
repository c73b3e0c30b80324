"""`--set output_dir=X` moves the paths derived from output_dir (TensorBoard, checkpoints, trackers'
dirs) exactly as `--output-dir X` does, unless the same command line sets them explicitly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.config import load_config
from lmforge.config.outputs import with_output_dir

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"  # output_dir: output/demo; save_path and TensorBoard under it


def test_set_output_dir_moves_what_output_dir_flag_moves():
    by_set = load_config(DEMO, ["output_dir=runs/b", "monitor.wandb.dir=output/demo/wb"])
    by_flag = with_output_dir(load_config(DEMO, ["monitor.wandb.dir=output/demo/wb"]), "runs/b")
    assert by_set.checkpoint.save_path == "runs/b/checkpoints" == by_flag.checkpoint.save_path
    assert by_set.monitor.tensorboard.output_dir == "runs/b/tensorboard"
    assert by_set.monitor.tensorboard.output_dir == by_flag.monitor.tensorboard.output_dir
    # Set on the same command line: explicit, kept where it is.
    assert by_set.monitor.wandb.dir == "output/demo/wb"
    assert by_flag.monitor.wandb.dir == "runs/b/wb"


def test_explicit_paths_on_the_command_line_are_kept():
    cfg = load_config(DEMO, ["output_dir=runs/c", "checkpoint.save_path=elsewhere/ckpt"])
    assert cfg.checkpoint.save_path == "elsewhere/ckpt"
    assert cfg.monitor.tensorboard.output_dir == "runs/c/tensorboard"
    unmoved = load_config(DEMO, ["training.steps=3"])
    assert unmoved.checkpoint.save_path == "output/demo/checkpoints"


@pytest.mark.slow
def test_check_lists_the_moved_outputs(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "lmforge", "check", "--config", str(DEMO), "--set", "output_dir=runs/d"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    outputs = proc.stdout.split("\nOutputs:\n", 1)[1].split("\n\n", 1)[0]
    assert "TensorBoard events: runs/d/tensorboard" in outputs
    assert "checkpoints: runs/d/checkpoints" in outputs
    assert "output/demo" not in outputs
