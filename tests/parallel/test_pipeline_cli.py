"""``lmforge train`` under torchrun with pipeline parallel, then the checkpoint evaluated on one process.

The pipeline run's validation loss (forward-only through the stages) must equal what a single
process computes from the checkpoint that run saved (pipeline stages save their layers under global
names): bf16 compute with the same weights, so 1e-4 relative.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(200)]


def test_pipeline_training_and_single_process_evaluation_agree(tmp_path, capsys):
    from lmforge.cli import main
    from lmforge.train.callbacks import read_metrics
    from train.test_train_cli import ADAMW, write_config

    cfg = write_config(tmp_path, ADAMW, steps=4)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-port=29657"]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    for item in ("parallelism.pipeline_parallel=2", "eval_interval=4", "eval_steps=2"):
        cmd += ["--set", item]
    run = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:]
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    pipeline_val = records[-1]["val_loss"]
    capsys.readouterr()
    assert (
        main(["eval", "--checkpoint", str(tmp_path / "ckpt"), "--config", cfg, "--eval-steps", "2", "--json"])
        == 0
    )
    single = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"]
    assert single == pytest.approx(pipeline_val, rel=1e-4)
