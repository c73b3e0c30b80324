"""The detector alone: the doctor's spike and divergence rules step by step, and their onsets."""

from __future__ import annotations

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
