"""Each rollback is visible: a metrics.jsonl line, a log line, a TensorBoard marker, a tracker event and a
finding of `lmforge doctor` (from a real rollback of the tiny run)."""

from __future__ import annotations

import pytest

from lmforge.cli import main
from lmforge.tools.doctor import diagnose, read_run_dir
from lmforge.train.callbacks.trackers import TrackerCallback

from .test_exactness import DAMAGE_AT, DamageWeights, run

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


class RecordingTracker(TrackerCallback):
    """A tracker whose backend is a list (W&B and MLflow share this callback's hooks)."""

    name = "wandb"  # its (default) section; the backend below is a list
    module = "json"

    def __init__(self, output_dir):
        from lmforge.config.sections_trackers import WandbConfig

        super().__init__(WandbConfig(), output_dir)
        self.logged = []

    def start(self, resume_id, config, step):
        return "run-1"

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def finish(self, summary):
        self.summary = summary


def test_a_rollback_is_a_metrics_line_a_log_line_a_tensorboard_marker_a_tracker_event_and_a_doctor_finding(
    tmp_path, capsys
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracker = RecordingTracker(tmp_path / "run")
    trainer = run(tmp_path, recovery={"data": "skip"}, callbacks=[DamageWeights(DAMAGE_AT), tracker])
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    (line,) = [ln for ln in lines if '"event": "rollback"' in ln]
    assert line.startswith('{"event": "rollback", "step": 5, "to_step": 2, "reason": "loss spike')
    assert '"skipped_samples": [8, 19]' in line
    log = (tmp_path / "run" / "train.log").read_text()
    assert (
        "recovery: loss spike" in log
        and "Rolled back every rank from step 5 to the checkpoint of step 2" in log
    )

    acc = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    acc.Reload()
    (marker,) = acc.Scalars("recovery/rollback-to-step")
    assert (marker.step, marker.value) == (5, 2.0)

    events = [(s, v) for s, v in tracker.logged if "recovery/rollback_to_step" in v]
    assert events == [(5, {"recovery/rollback_to_step": 2.0, "recovery/rollbacks": 1.0})]
    assert trainer.summary()["rollbacks"] == 1

    findings = diagnose(read_run_dir(tmp_path / "run")).findings
    # (the tiny test trainer decays its biases too: that finding is true and beside the point)
    (f,) = [f for f in findings if f.symptom.startswith("training rolled back")]
    assert f.symptom == "training rolled back 1 time(s)" and "step 5 -> 2 (loss spike" in f.evidence
    assert main(["doctor", str(tmp_path / "run")]) == 0
    assert "training rolled back 1 time(s)" in capsys.readouterr().out
