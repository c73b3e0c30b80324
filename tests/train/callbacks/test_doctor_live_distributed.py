"""The live doctor under torchrun (FSDP over 2 gloo processes, an MoE model): it samples sharded
parameters, only rank 0 writes and warns, and the offline doctor reads the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from lmforge.tools.doctor import diagnose, read_run_dir
from tools.doctor.runs import MOE_MODEL, run_config

pytestmark = [pytest.mark.distributed, pytest.mark.slow, pytest.mark.timeout(200)]


def test_live_doctor_under_fsdp(tmp_path):
    changes = {"training.global_batch_size": 8, "training.steps": 8, "model": MOE_MODEL}
    changes |= {"lr_scheduler.learning_rate": 1.0, "lr_scheduler.lr_end": 0.1}  # lr x100: a finding
    raw = run_config(tmp_path, "run", changes)
    cfg = tmp_path / "train.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone"]
    cmd += ["-m", "lmforge", "train", "--config", str(cfg), "--device", "cpu"]
    run = subprocess.run(
        cmd, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=180
    )
    assert run.returncode == 0, run.stderr[-3000:]
    run_dir = tmp_path / "run"
    facts = json.loads((run_dir / "doctor_facts.json").read_text())
    assert facts["world_size"] == 2 and facts["not_updated"] == [] and facts["moe_num_experts"] == 4
    warned = [ln for ln in (run_dir / "train.log").read_text().splitlines() if "doctor at step" in ln]
    assert warned and all("learning rate too high" in ln for ln in warned)
    found = diagnose(read_run_dir(run_dir)).findings
    assert found and all("learning rate too high" in f.cause for f in found)
