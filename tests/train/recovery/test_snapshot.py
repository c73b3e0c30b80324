"""``recovery.snapshot_interval``: a rollback restores every rank's in-memory copy of its own state, without
reading the disk, when it is newer than the safe checkpoint; and ends exactly where the undamaged run ends."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from lmforge.cli import main
from lmforge.train.callbacks import read_metrics

from ..test_train_cli import ADAMW, write_config
from .test_exactness import DAMAGE_AT, DamageWeights, assert_bitwise, run, timeline, weights

HERE = Path(__file__).resolve().parent

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undamaged")
    return weights(run(tmp)), timeline(tmp)


def no_disk_reads(*args, **kwargs):
    raise AssertionError("the rollback read a checkpoint from disk")


@pytest.mark.parametrize(
    "snapshot_every,save_every,source,to_step",
    [(1, 4, "memory", 3), (4, 2, "disk", 2)],
    ids=["snapshot-newer", "checkpoint-newer"],
)
def test_rollback_uses_the_newest_safe_of_snapshot_and_checkpoint(
    tmp_path, monkeypatch, undamaged, snapshot_every, save_every, source, to_step
):
    # Every 1 step: snapshots of steps 3 and 4 are kept, 4 holds the damage, 3 is safe and no checkpoint of
    # step <= 3 is on disk. Every 4: the only snapshot (step 4) is damaged, the checkpoint of step 2 is used.
    if source == "memory":
        monkeypatch.setattr("lmforge.train.recovery.controller.load_checkpoint", no_disk_reads)
    trainer = run(
        tmp_path,
        recovery={"data": "replay", "snapshot_interval": snapshot_every},
        callbacks=[DamageWeights(DAMAGE_AT)],
        extra={"checkpoint": {"save_interleaved_steps": save_every}},
    )
    (event,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert (event["step"], event["to_step"], event["source"]) == (DAMAGE_AT + 1, to_step, source)
    assert_bitwise(weights(trainer), undamaged[0])
    assert timeline(tmp_path) == undamaged[1]


def cli_config(tmp_path: Path) -> str:
    cfg = write_config(tmp_path, ADAMW, steps=8)
    raw = yaml.safe_load(Path(cfg).read_text())
    raw["model"]["compute_dtype"] = "float32"
    raw["checkpoint"].update({"save_interleaved_steps": 4})
    Path(cfg).write_text(yaml.safe_dump(raw))
    return cfg


def test_snapshot_of_fsdp2_shards_through_the_cli_ends_where_the_undamaged_run_ends(tmp_path, monkeypatch):
    """The one-process build path (FSDP2: every parameter a DTensor shard) restored from the snapshot."""
    monkeypatch.syspath_prepend(str(HERE))
    monkeypatch.setenv("LMFORGE_ALLOW_IMPORTS", "1")
    straight, damaged = tmp_path / "straight", tmp_path / "damaged"
    straight.mkdir()
    damaged.mkdir()
    assert main(["train", "--config", cli_config(straight)]) == 0
    monkeypatch.setattr("lmforge.train.recovery.controller.load_checkpoint", no_disk_reads)
    args = [
        "train",
        "--config",
        cli_config(damaged),
        "--set",
        "callbacks=[{type: faults.DamageNorm, step: 4}]",
    ]
    for o in ("recovery.enable=true", "recovery.data=replay", "recovery.snapshot_interval=1"):
        args += ["--set", o]
    assert main(args) == 0
    (event,) = [r for r in read_metrics(damaged / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert (event["step"], event["to_step"], event["source"]) == (5, 3, "memory")
    assert timeline(damaged) == timeline(straight)
