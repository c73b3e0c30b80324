"""The detector alone: the doctor's spike and divergence rules step by step, and their onsets."""

from __future__ import annotations

import copy
import math

from lmforge.train.recovery import AnomalyDetector
from lmforge.train.recovery.safe_checkpoint import newest_safe


def feed(losses, detector=None):
    d = detector or AnomalyDetector()
    for step, loss in enumerate(losses, 1):
        found = d.observe(step, loss, not math.isfinite(loss), 0, 10)
        if found is not None:
            return step, found
    return None, None


def test_a_loss_above_1_5x_the_median_of_the_10_before_is_a_spike_at_its_own_step():
    step, found = feed([4.0, 3.8, 3.6, 3.5, 3.4, 5.5])
    assert step == 6 and found.onset == 6 and found.reason.startswith("loss spike: loss 5.5 at step 6 > 1.5")
    assert feed([4.0, 3.8, 3.6, 3.5, 3.4, 5.3])[0] is None  # 5.3 < 1.5 x 3.6, the median


def test_no_spike_is_judged_before_the_fourth_normal_loss():
    assert feed([4.0, 3.0, 9.0])[0] is None


def test_divergence_is_sustained_and_rolls_back_to_before_the_lowest_loss():
    # One hard batch above 1.25 x the first loss is no divergence (a fine-tuning run's low first loss).
    assert feed([1.0, 0.9, 0.8, 0.85, 1.3, 0.9, 0.85])[0] is None
    step, found = feed([2.0, 1.8, 1.7, 1.9, 2.2, 2.4, 2.6, 2.7])
    # Step 7's median of (2.2, 2.4, 2.6) is 2.4 <= 1.25 x 2.0; step 8's (2.4, 2.6, 2.7) is 2.6.
    assert found.reason.startswith("divergence") and step == 8
    assert (
        found.onset == 4
    )  # the lowest loss was at step 3: its weights (after update 2) are the last good ones


def test_skipped_steps_beyond_the_limit_name_the_first_skipped_step():
    d = AnomalyDetector()
    for step in range(1, 6):
        assert d.observe(step, 3.0, False, 0, 3) is None
    assert d.observe(6, math.nan, True, 1, 3) is None
    assert d.observe(7, math.nan, True, 2, 3) is None
    found = d.observe(8, math.nan, True, 3, 3)
    assert found.onset == 6 and "3 consecutive skipped steps" in found.reason


def test_the_safe_checkpoint_is_two_steps_before_the_onset():
    assert newest_safe([2, 4, 6], onset=7) == 4  # 6's weights made the loss of step 7
    assert newest_safe([2, 4, 6], onset=8) == 6
    assert newest_safe([4], onset=5) is None


def test_a_resumed_detector_judges_its_first_step_as_the_run_before_would():
    # A resumed run used to start with no history: no spike could be judged for its first three steps, so a
    # damaged step there passed as normal (and its checkpoint later counted as safe).
    before = AnomalyDetector()
    assert feed([4.0, 3.8, 3.6, 3.5, 3.4], before) == (None, None)
    resumed = AnomalyDetector()
    resumed.load_state_dict(before.state_dict())
    found = resumed.observe(6, 5.5, False, 0, 10)
    assert (
        found is not None and found.onset == 6 and found.reason.startswith("loss spike: loss 5.5 at step 6")
    )
    assert AnomalyDetector().observe(6, 5.5, False, 0, 10) is None  # what an empty history judged


def test_the_saved_history_is_bounded_and_keeps_the_first_and_the_lowest_loss():
    d = AnomalyDetector()
    losses = [3.0, 1.0] + [2.0 + 0.001 * i for i in range(100)]  # lowest at step 2, long before the window
    assert feed(losses, d) == (None, None)
    saved = d.state_dict()
    assert len(saved["recent"]) == 10 and saved["best"] == [2, 1.0] and saved["first_loss"] == 3.0
    resumed = AnomalyDetector()
    resumed.load_state_dict(saved)
    assert resumed.best_step() == 2 and resumed.newest_verified_step() == d.newest_verified_step()
    # The divergence rule compares with the run's first loss and rolls back to before the lowest one.
    assert resumed.first_loss == 3.0
    assert resumed.state_dict() == saved  # loading and saving again changes nothing


def test_an_empty_record_is_an_empty_history():
    d = AnomalyDetector()
    d.load_state_dict({})
    assert (
        d.history == []
        and d.first_loss is None
        and d.state_dict() == {"first_loss": None, "recent": [], "best": None}
    )


def test_the_trainer_state_carries_the_detector_into_a_resumed_run(tmp_path):
    from types import SimpleNamespace

    from lmforge.config.sections_recovery import RecoveryConfig
    from lmforge.train.recovery.controller import Recovery

    section = RecoveryConfig(enable=True)
    state = SimpleNamespace(global_step=0, consecutive_skips=0, extra={})
    first = Recovery(section, tmp_path)
    first.start(state)
    for loss in (4.0, 3.8, 3.6, 3.5, 3.4):
        state.global_step += 1
        assert first.observe(state, SimpleNamespace(loss=loss, skipped=False), 10) is None
    # What the checkpoint of step 5 holds (TrainState.extra), read back by a restarted run.
    resumed = Recovery(section, tmp_path)
    resumed.start(SimpleNamespace(extra=copy.deepcopy(state.extra)))
    state.global_step += 1
    found = resumed.observe(state, SimpleNamespace(loss=5.5, skipped=False), 10)
    assert found is not None and found.onset == 6
