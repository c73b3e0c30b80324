"""Compiled blocks under FSDP2 (torchrun, 2 gloo ranks) train like one eager process."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lmforge.cli import main
from lmforge.train.callbacks import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.distributed]


def _write_config(tmp_path: Path) -> str:
    path = Path(__file__).parents[2] / "train" / "test_train_cli.py"
    spec = importlib.util.spec_from_file_location("lmforge_train_cli_helpers", path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    return helpers.write_config(tmp_path, helpers.ADAMW, steps=3)


def test_compiled_fsdp_matches_eager_single_process(tmp_path):
    fp32 = ["model.compute_dtype=float32", "checkpoint.save_interleaved_steps=100"]
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"
    eager_dir.mkdir()
    compiled_dir.mkdir()
    cfg = _write_config(eager_dir)
    assert main(["train", "--config", cfg, *sum((["--set", o] for o in fp32), [])]) == 0
    cfg = _write_config(compiled_dir)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    for o in [*fp32, "compile.enable=true"]:
        cmd += ["--set", o]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = str(Path(__file__).parents[3] / "src") + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    eager = read_metrics(eager_dir / "run" / "metrics.jsonl")
    compiled = read_metrics(compiled_dir / "run" / "metrics.jsonl")
    assert len(eager) == len(compiled) == 3
    for a, b in zip(compiled, eager, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert compiled[0]["compile_s"] > 0 and compiled[2]["compile_s"] == 0
    assert "compile: " in (compiled_dir / "run" / "train.log").read_text()
