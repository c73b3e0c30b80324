"""Recovery with LoRA (small checkpoints: the frozen base is rebuilt on the rollback too) and across a
restart (the rollback count is in the checkpoint)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.train.callbacks import read_metrics

from ..conftest import tiny_config, tiny_trainer
from ..test_train_cli import ADAMW, write_config
from .test_exactness import DAMAGE_AT, DamageWeights, run, timeline

HERE = Path(__file__).resolve().parent
LORA = {
    "target_modules": ".*linear_qkv|.*linear_proj|.*linear_fc1|.*linear_fc2",
    "lora_rank": 4,
    "lora_alpha": 8,
}

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


def lora_config(tmp_path: Path) -> str:
    cfg = write_config(tmp_path, ADAMW, steps=8)
    raw = yaml.safe_load(Path(cfg).read_text())
    raw["model"]["compute_dtype"] = "float32"
    raw["lora_config"] = LORA
    raw["checkpoint"].update({"save_interleaved_steps": 2})
    Path(cfg).write_text(yaml.safe_dump(raw))
    return cfg


def test_lora_run_damaged_in_its_frozen_base_rolls_back_and_ends_where_the_undamaged_run_ends(
    tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("LMFORGE_ALLOW_IMPORTS", "1")
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    straight.mkdir()
    damaged.mkdir()
    assert main(["train", "--config", lora_config(straight)]) == 0
    fault = "callbacks=[{type: faults.DamageNorm, step: 4}]"  # the final norm is frozen under LoRA
    args = ["train", "--config", lora_config(damaged), "--set", fault]
    args += ["--set", "recovery.enable=true", "--set", "recovery.data=replay"]
    assert main(args) == 0
    events = [r for r in read_metrics(damaged / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert [(e["step"], e["to_step"]) for e in events] == [(5, 2)]
    assert timeline(damaged) == timeline(straight)


def test_the_rollback_count_survives_a_restart(tmp_path):
    run(tmp_path, recovery={"data": "replay"}, callbacks=[DamageWeights(DAMAGE_AT)])
    cfg = tiny_config(
        tmp_path,
        training={"steps": 10},
        checkpoint={"save_interleaved_steps": 2, "auto_resume": True},
        recovery={"enable": True, "data": "replay", "max_rollbacks": 3},
    )
    resumed = tiny_trainer(cfg)
    resumed.resumption.resume_or_start()
    assert resumed.state.global_step == 8 and resumed._recovery.rollbacks == 1
