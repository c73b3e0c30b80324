"""``lmforge train`` under torchrun with pipeline parallel, then the checkpoint evaluated on one process.

The pipeline run's validation loss (forward-only through the stages) must equal what a single
process computes from the checkpoint that run saved (pipeline stages save their layers under global
names): bf16 compute with the same weights, so 1e-4 relative. A second pipeline run resumed from the
step-2 checkpoint (optimizer, scheduler, data position) repeats steps 3 and 4 bit for bit.
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
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    cmd += ["--set", "parallelism.pipeline_parallel=2", "--set", "checkpoint.save_interleaved_steps=2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    run = subprocess.run(
        [*cmd, "--set", "eval_interval=4", "--set", "eval_steps=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
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

    resume = [f"output_dir={tmp_path / 'run2'}", f"checkpoint.save_path={tmp_path / 'ckpt2'}"]
    resume.append(f"checkpoint.load_path={tmp_path / 'ckpt' / 'iteration_00000002'}")
    run = subprocess.run(
        [*cmd, *(a for item in resume for a in ("--set", item))],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = {r["step"]: r["loss"] for r in read_metrics(tmp_path / "run2" / "metrics.jsonl")}
    assert resumed == {r["step"]: r["loss"] for r in records if r["step"] > 2}
