import json
import math
from pathlib import Path

from lmforge.train.callbacks import read_metrics

from .conftest import tiny_trainer


def test_tiny_run_trains_and_writes_outputs(make_config):
    cfg = make_config(training={"steps": 30}, checkpoint={"save_interleaved_steps": 10})
    trainer = tiny_trainer(cfg)
    summary = trainer.fit()
    out = trainer.output_dir
    records = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 31))
    for key in (
        "step",
        "consumed_samples",
        "loss",
        "lr",
        "grad_norm",
        "step_time",
        "tokens_per_s",
        "mfu",
        "memory_gib",
    ):
        assert key in records[0]
    assert records[-1]["consumed_samples"] == 30 * 4
    first = sum(r["loss"] for r in records[:3]) / 3
    last = sum(r["loss"] for r in records[-3:]) / 3
    assert last < 0.7 * first, (first, last)
    assert (out / "curves.png").stat().st_size > 1000
    assert (out / "train.log").read_text().count("step: [") >= 30
    assert summary["status"] == "completed"
    assert math.isclose(float(summary["final loss"]), records[-1]["loss"], rel_tol=1e-5)
    ckpt = Path(cfg.checkpoint.save_path)
    saved = sorted(p.name for p in ckpt.iterdir() if p.name.startswith("iteration"))
    assert saved == ["iteration_00000010", "iteration_00000020", "iteration_00000030"]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
    common = json.loads((ckpt / "iteration_00000030" / "common.json").read_text())
    assert (
        common["global_step"] == 30 and common["consumed_samples"] == 120 and common["global_batch_size"] == 4
    )
