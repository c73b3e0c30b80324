"""A stop that meets an anomaly, a run that gives up, and the checkpoints a rollback undoes: no resume ever
starts from damaged weights (world size 1, the tiny fp32 model)."""

from __future__ import annotations

import json

import pytest
import torch

from lmforge.train.callbacks import TrainerCallback, read_metrics
from lmforge.train.checkpoint import read_tracker
from lmforge.train.recovery.quarantine import DAMAGED_DIR, RECORD_FILE
from lmforge.train.recovery.safe_checkpoint import complete_iterations
from lmforge.train.step import TrainingStopped

from ..conftest import tiny_config, tiny_trainer
from .test_exactness import DAMAGE_AT, STEPS, DamageWeights, assert_bitwise, run, timeline, weights

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


class StopAt(TrainerCallback):
    """Asks the run to stop at the end of step ``step`` (what a SIGTERM's handler does), once."""

    def __init__(self, step: int) -> None:
        self.step, self.done = step, False

    def on_step_end(self, args, state, **kwargs):
        if state.global_step == self.step and not self.done:
            self.done = True
            kwargs["trainer"].request_stop("test stop")


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undamaged")
    return weights(run(tmp)), timeline(tmp)


def resume(tmp, **recovery):
    """The same run started again with auto-resume (what an elastic restart or a requeue does)."""
    cfg = tiny_config(
        tmp,
        training={"steps": STEPS},
        checkpoint={"save_interleaved_steps": 1, "save_max": 10, "auto_resume": True},
        recovery={"enable": True, **recovery},
    )
    trainer = tiny_trainer(cfg)
    trainer.fit()
    return trainer


def moved(tmp) -> dict[str, list[str]]:
    root = tmp / "ckpt" / DAMAGED_DIR
    if not root.is_dir():
        return {}
    return {d.name: sorted(p.name for p in d.glob("iteration_*")) for d in sorted(root.iterdir())}


def test_a_stop_at_the_detection_step_keeps_the_restored_state_and_the_resume_ends_undamaged(
    tmp_path, undamaged
):
    # Saves every step: the checkpoint of step 4 (the damaged update) is written before any loss shows it,
    # and step 5's save, at the detection, is refused.
    trainer = run(
        tmp_path,
        recovery={"data": "replay"},
        callbacks=[DamageWeights(DAMAGE_AT), StopAt(DAMAGE_AT + 1)],
        extra={"checkpoint": {"save_interleaved_steps": 1, "save_max": 10}},
    )
    (event,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert (event["step"], event["to_step"]) == (5, 3)
    assert trainer.state.global_step == 3 and trainer.stop_agreement.reason == "test stop"
    ckpt = tmp_path / "ckpt"
    assert read_tracker(ckpt) == 3 and complete_iterations(ckpt) == [1, 2, 3]
    assert moved(tmp_path) == {"anomaly_1_step_5": ["iteration_00000004"]}
    record = json.loads((ckpt / DAMAGED_DIR / "anomaly_1_step_5" / RECORD_FILE).read_text())
    assert record["moved"] == ["iteration_00000004"] and record["reason"].startswith("loss spike")

    resumed = resume(tmp_path, data="replay")
    assert resumed.resumption.resumed_from == str(ckpt / "iteration_00000003")
    assert resumed._recovery.rollbacks == 1  # saved with the restored state
    assert_bitwise(weights(resumed), undamaged[0])
    assert timeline(tmp_path) == undamaged[1]


def test_giving_up_leaves_the_newest_safe_checkpoint_as_the_latest(tmp_path):
    with pytest.raises(TrainingStopped, match=r"recovery.max_rollbacks \(1\) is reached"):
        run(
            tmp_path,
            recovery={"data": "replay", "max_rollbacks": 1},
            callbacks=[DamageWeights(DAMAGE_AT, times=2)],
        )
    ckpt = tmp_path / "ckpt"
    # Not the weights of step 5 (the stop's save is refused) nor the damaged step 4 (moved aside, twice).
    assert read_tracker(ckpt) == 2 and complete_iterations(ckpt) == [2]
    assert moved(tmp_path) == {
        "anomaly_1_step_5": ["iteration_00000004"],
        "anomaly_2_step_5": ["iteration_00000004"],
    }
    assert json.loads((ckpt / DAMAGED_DIR / "anomaly_2_step_5" / RECORD_FILE).read_text())["event"] == "stop"
    cfg = tiny_config(
        tmp_path, checkpoint={"auto_resume": True}, recovery={"enable": True, "max_rollbacks": 1}
    )
    again = tiny_trainer(cfg)
    again.resumption.resume_or_start()
    assert again.state.global_step == 2 and again._recovery.rollbacks == 1


def test_a_rollback_moves_the_checkpoints_after_the_onset_aside(tmp_path, undamaged):
    trainer = run(tmp_path, recovery={"data": "replay"}, callbacks=[DamageWeights(DAMAGE_AT)])
    assert moved(tmp_path) == {"anomaly_1_step_5": ["iteration_00000004"]}
    # The copy moved aside holds the damage (x100); the run re-saved step 4 from the replayed, good weights.
    damaged = output_layer(
        tmp_path / "ckpt" / DAMAGED_DIR / "anomaly_1_step_5" / "iteration_00000004", tmp_path
    )
    good = output_layer(tmp_path / "ckpt" / "iteration_00000004", tmp_path)
    assert torch.allclose(damaged, good * 100.0, rtol=1e-6)
    assert_bitwise(weights(trainer), undamaged[0])


def output_layer(iteration_dir, scratch):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = scratch / f"{iteration_dir.parent.name}.pt"
    dcp_to_torch_save(iteration_dir, out)
    return torch.load(out, weights_only=False)["model"]["output_layer.weight"]


def test_with_asynchronous_saves_the_rollback_finishes_the_save_in_flight_first(tmp_path, undamaged):
    # The checkpoint of step 4 (damaged) may still be writing when step 5 shows the spike: it is published,
    # then moved aside; the rollback's own save is published before training goes on.
    extra = {"checkpoint": {"save_interleaved_steps": 2, "save_max": 10, "async_save": True}}
    trainer = run(tmp_path, recovery={"data": "replay"}, callbacks=[DamageWeights(DAMAGE_AT)], extra=extra)
    assert moved(tmp_path) == {"anomaly_1_step_5": ["iteration_00000004"]}
    assert complete_iterations(tmp_path / "ckpt") == [2, 4, 6, 8] and read_tracker(tmp_path / "ckpt") == 8
    assert_bitwise(weights(trainer), undamaged[0])
