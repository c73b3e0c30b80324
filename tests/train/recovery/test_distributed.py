"""Recovery under torchrun (gloo, CPU): every rank detects, votes and rolls back together, and the run ends
bitwise where the undamaged run of the same layout ends (data: replay, lr_scale 1.0)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lmforge.train.callbacks import read_metrics
from torchrun import torchrun

from ..test_train_cli import ADAMW, write_config

HERE = Path(__file__).resolve().parent
STEPS = 8


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


def assert_replayed_bitwise(run_dir: Path, steps: int = STEPS) -> None:
    """One rollback from step 5 to step 2, and the replayed steps 3-4 bitwise the steps as first trained
    (loss and gradient norm over all ranks): every rank restored its weights, optimizer state, data position
    and RNG exactly. The run then trains to the end with no other event, and the replayed step 5 is not the
    spike."""
    records = read_metrics(run_dir / "metrics.jsonl")
    at = next(i for i, r in enumerate(records) if r.get("event") == "rollback")
    assert (records[at]["step"], records[at]["to_step"]) == (5, 2)
    first = {r["step"]: (r["loss"], r["grad_norm"]) for r in records[:at]}
    again = {r["step"]: (r["loss"], r["grad_norm"]) for r in records[at + 1 :]}
    assert [again[s] for s in (3, 4)] == [first[s] for s in (3, 4)]
    assert sorted(again) == list(range(3, steps + 1)) and not any("event" in r for r in records[at + 1 :])
    assert again[5][0] < first[5][0]


FAULT = "callbacks=[{type: faults.DamageNorm, step: 4}]"
REPLAY = ["recovery.enable=true", "recovery.data=replay"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_ranks_roll_back_together_and_end_where_the_undamaged_run_ends(tmp_path):
    """FSDP2 on 2 ranks: the damaged run that rolled back ends bitwise where the undamaged run ends."""
    straight_dir, damaged_dir = tmp_path / "straight", tmp_path / "damaged"
    straight_dir.mkdir()
    damaged_dir.mkdir()
    torchrun(2, layout_config(straight_dir, {}))
    r = torchrun(2, layout_config(damaged_dir, {}), FAULT, *REPLAY, import_dirs=(HERE,))
    events = [e for e in read_metrics(damaged_dir / "run" / "metrics.jsonl") if e.get("event") == "rollback"]
    assert [(e["step"], e["to_step"]) for e in events] == [(5, 2)]
    assert timeline(damaged_dir / "run") == timeline(straight_dir / "run")
    # Both ranks rolled back (each logs its own restore; rank 0's log line is in train.log).
    assert (
        r.stderr.count("Resumed from") >= 2
        or "Rolled back every rank" in (damaged_dir / "run" / "train.log").read_text()
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "parallelism,model",
    [
        ({"tensor_parallel": 2}, {}),
        ({"pipeline_parallel": 2}, {}),
        ({"expert_parallel": 2}, MOE),
        ({"context_parallel": 2}, {}),
    ],
    ids=["tp2", "pp2", "ep2", "cp2"],
)
def test_every_layout_rolls_back_together_and_replays_bitwise(tmp_path, parallelism, model):
    """TP+SP, PP, EP and CP on 2 ranks: the rollback restores every rank's shards exactly (the replayed steps
    are bitwise the steps as first trained). The end-to-end comparison with an undamaged run is FSDP2's test
    above: after an exact restore the replayed steps run the same code as the first time, so one more job per
    layout (about 8 s each) would repeat it."""
    torchrun(2, layout_config(tmp_path, parallelism, **model), FAULT, *REPLAY, import_dirs=(HERE,))
    assert_replayed_bitwise(tmp_path / "run")


def rollback_events(run_dir: Path) -> list[dict]:
    return [e for e in read_metrics(run_dir / "metrics.jsonl") if e.get("event") == "rollback"]


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_killed_after_a_rollback_restarts_into_the_recovered_run(tmp_path):
    """torchrun --max-restarts=1: rank 1 dies as the first step after a rollback begins (data: skip, from
    each rank's in-memory snapshot of step 3); the restarted job resumes from the rollback's save with the
    rollback counted and the skipped batches still skipped, and ends bitwise where the run without the kill
    ends."""
    reference, faulty = tmp_path / "reference", tmp_path / "faulty"
    reference.mkdir()
    faulty.mkdir()
    damage = "{type: faults.DamageNorm, step: 4, attempt: 0}"  # the restarted attempt is not damaged again
    kill = "{type: faults.KillAfterRollback, rank: 1, after: 1}"
    recovery = ["recovery.enable=true", "recovery.data=skip", "recovery.snapshot_interval=1"]
    torchrun(2, layout_config(reference, {}), f"callbacks=[{damage}]", *recovery, import_dirs=(HERE,))
    cfg = layout_config(faulty, {})
    r = torchrun(2, cfg, f"callbacks=[{damage}, {kill}]", *recovery, max_restarts=1, import_dirs=(HERE,))
    log = r.stdout + r.stderr
    assert "elastic restart 1: resuming" in log and "(iteration 3)" in log, log[-3000:]
    (event,) = rollback_events(faulty / "run")  # kept in metrics.jsonl across the restart, not repeated
    assert (event["step"], event["to_step"], event["skipped_samples"]) == (5, 3, [12, 19])
    assert event["source"] == "memory"  # the snapshot of step 3 is newer than the checkpoint of step 2
    assert json.loads((faulty / "run" / "summary.json").read_text())["rollbacks"] == 1
    assert timeline(faulty / "run") == timeline(reference / "run")
    assert timeline(faulty / "run")[-1][0] == STEPS


@pytest.mark.slow
@pytest.mark.distributed
def test_hsdp_on_four_ranks_rolls_back_and_replays_bitwise(tmp_path):
    """HSDP (2 replicas x 2 shards) on 4 gloo ranks: every rank restores its shard of the safe checkpoint,
    and the replayed steps are bitwise the steps as first trained (loss and gradient norm over 4 ranks)."""
    cfg = layout_config(tmp_path, {"data_parallel_shard": 2})
    torchrun(4, cfg, "training.local_batch_size=1", FAULT, *REPLAY, import_dirs=(HERE,))
    assert_replayed_bitwise(tmp_path / "run")
    assert "dp_replicate=2" in (tmp_path / "run" / "train.log").read_text()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_give_up_under_max_restarts_is_not_tried_again(tmp_path):
    """torchrun --max-restarts=1 restarts a job whatever its exit status; the give-up's marker makes the restarted
    attempt stop before it builds anything, instead of resuming and giving up again at the same anomaly."""
    cfg = layout_config(tmp_path, {})
    damage = "callbacks=[{type: faults.DamageNorm, step: 4, times: 2}]"  # seen again after the one rollback
    r = torchrun(
        2, cfg, damage, *REPLAY, "recovery.max_rollbacks=1", max_restarts=1, import_dirs=(HERE,), check=False
    )
    log = r.stdout + r.stderr
    marker = tmp_path / "ckpt" / "recovery_gave_up.json"
    assert r.returncode != 0 and json.loads(marker.read_text())["step"] == 5, log[-3000:]
    train_log = (tmp_path / "run" / "train.log").read_text()
    assert train_log.count("recovery.max_rollbacks (1) is reached") == 1  # given up once: the first attempt
    assert f"{marker} says that recovery gave up" in log  # the restarted attempt, refused
    assert "elastic restart 1: resuming" not in log  # it did not resume, build or train
    assert [e["rollback"] for e in rollback_events(tmp_path / "run")] == [1]
