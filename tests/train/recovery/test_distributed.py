"""Recovery under torchrun (gloo, CPU): every rank detects, votes and rolls back together, and the run ends
bitwise where the undamaged run of the same layout ends (data: replay, lr_scale 1.0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lmforge.train.callbacks import read_metrics

from ..test_train_cli import ADAMW, write_config

HERE = Path(__file__).resolve().parent
STEPS = 8


def torchrun(nproc: int, cfg: str, *overrides: str, port: int) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={port}",
    ]
    cmd += ["-m", "lmforge", "train", "--config", cfg]
    for o in overrides:
        cmd += ["--set", o]
    path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, LMFORGE_ALLOW_IMPORTS="1")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)


def timeline(run_dir: Path) -> list[tuple[int, float, float]]:
    kept: dict[int, tuple[float, float]] = {}
    for r in read_metrics(run_dir / "metrics.jsonl"):
        if r.get("event") == "rollback":
            kept = {s: v for s, v in kept.items() if s <= r["to_step"]}
        else:
            kept[r["step"]] = (r["loss"], r["grad_norm"])
    return [(s, *v) for s, v in sorted(kept.items())]


def layout_config(tmp_path: Path, parallelism: dict, **model) -> str:
    cfg = write_config(tmp_path, ADAMW, steps=STEPS)
    raw = yaml.safe_load(Path(cfg).read_text())
    raw["model"]["compute_dtype"] = "float32"
    raw["model"].update(model)
    raw["parallelism"] = parallelism
    raw["checkpoint"].update({"save_interleaved_steps": 2, "save_max": 2})
    Path(cfg).write_text(yaml.safe_dump(raw))
    return cfg


MOE = {
    "model_type": "qwen3_moe",
    "architectures": "Qwen3MoeForCausalLM",
    "moe_intermediate_size": 16,
    "num_experts": 4,
    "num_experts_per_tok": 2,
}


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "parallelism,model,port",
    [
        ({}, {}, 29631),
        ({"tensor_parallel": 2}, {}, 29633),
        ({"pipeline_parallel": 2}, {}, 29635),
        ({"expert_parallel": 2}, MOE, 29637),
        ({"context_parallel": 2}, {}, 29639),
    ],
    ids=["fsdp2", "tp2", "pp2", "ep2", "cp2"],
)
def test_two_ranks_roll_back_together_and_end_where_the_undamaged_run_ends(
    tmp_path, parallelism, model, port
):
    straight_dir, damaged_dir = tmp_path / "straight", tmp_path / "damaged"
    straight_dir.mkdir()
    damaged_dir.mkdir()
    r = torchrun(2, layout_config(straight_dir, parallelism, **model), port=port)
    assert r.returncode == 0, r.stderr[-3000:]
    cfg = layout_config(damaged_dir, parallelism, **model)
    fault = "callbacks=[{type: faults.DamageNorm, step: 4}]"
    recovery = ["recovery.enable=true", "recovery.data=replay"]
    r = torchrun(2, cfg, fault, *recovery, port=port + 1)
    assert r.returncode == 0, r.stderr[-3000:]
    events = [e for e in read_metrics(damaged_dir / "run" / "metrics.jsonl") if e.get("event") == "rollback"]
    assert [(e["step"], e["to_step"]) for e in events] == [(5, 2)]
    assert timeline(damaged_dir / "run") == timeline(straight_dir / "run")
    # Both ranks rolled back (each logs its own restore; rank 0's log line is in train.log).
    assert (
        r.stderr.count("Resumed from") >= 2
        or "Rolled back every rank" in (damaged_dir / "run" / "train.log").read_text()
    )
