"""What triggers a rollback besides a spike in the middle of a run: more non-finite steps than the skip policy
absorbs, a spike at the very last step; and the lowered lr after a rollback."""

from __future__ import annotations

import pytest

from lmforge.train.callbacks import TrainerCallback, read_metrics
from lmforge.train.step import TrainingStopped

from .test_exactness import STEPS, DamageWeights, assert_bitwise, run, timeline, weights

pytestmark = pytest.mark.slow  # each trains the tiny model several times (docs/architecture.md, Testing)


class PoisonSteps(TrainerCallback):
    """The model's loss is NaN at steps ``first .. first + count - 1``, the first time they run."""

    def __init__(self, first: int, count: int) -> None:
        self.steps = set(range(first, first + count))
        self.seen: set[int] = set()

    def on_step_begin(self, args, state, **kwargs):
        step = state.global_step + 1
        kwargs["model"].poison = step in self.steps and step not in self.seen
        self.seen.add(step)


@pytest.fixture(scope="module")
def undamaged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("undamaged")
    return weights(run(tmp)), timeline(tmp), read_metrics(tmp / "run" / "metrics.jsonl")


def test_non_finite_steps_beyond_the_skip_policy_roll_back_instead_of_stopping(tmp_path, undamaged):
    skip3 = {"monitor": {"health_checkpoint": {"global_norm_skip_time": 3}}}
    with pytest.raises(TrainingStopped, match="3 consecutive steps were skipped"):
        run(tmp_path / "off", callbacks=[PoisonSteps(5, 3)], extra=skip3)
    trainer = run(tmp_path / "on", recovery={"data": "replay"}, callbacks=[PoisonSteps(5, 3)], extra=skip3)
    (event,) = [
        r for r in read_metrics(tmp_path / "on" / "run" / "metrics.jsonl") if r.get("event") == "rollback"
    ]
    assert (event["step"], event["onset"], event["to_step"]) == (7, 5, 2)
    assert "3 consecutive skipped steps" in event["reason"]
    assert_bitwise(weights(trainer), undamaged[0])


def test_a_spike_at_the_last_step_is_rolled_back_before_the_run_ends(tmp_path, undamaged):
    trainer = run(tmp_path, recovery={"data": "replay"}, callbacks=[DamageWeights(STEPS - 1)])
    (event,) = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "rollback"]
    assert (event["step"], event["to_step"]) == (STEPS, STEPS - 2)
    assert_bitwise(weights(trainer), undamaged[0])
    assert timeline(tmp_path) == undamaged[1]


def test_lr_scale_lowers_the_lr_for_lr_scale_steps_after_a_rollback(tmp_path, undamaged):
    run(
        tmp_path,
        recovery={"data": "replay", "lr_scale": 0.5, "lr_scale_steps": 2},
        callbacks=[DamageWeights(4)],
    )
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    after = records[[i for i, r in enumerate(records) if r.get("event") == "rollback"][0] + 1 :]
    reference = {r["step"]: r["lr"] for r in undamaged[2]}
    lrs = {r["step"]: r["lr"] for r in after}
    assert lrs[3] == pytest.approx(0.5 * reference[3], rel=1e-12)
    assert lrs[4] == pytest.approx(0.5 * reference[4], rel=1e-12)
    assert all(lrs[s] == reference[s] for s in range(5, STEPS + 1))  # the schedule itself is unchanged
