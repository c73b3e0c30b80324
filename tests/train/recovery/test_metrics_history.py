"""Which metrics.jsonl records a resume keeps when the run rolled back: the rollback events the resumed state
counts, and what came before them."""

from __future__ import annotations

from lmforge.train.callbacks.metrics import history_of
from lmforge.train.state import RECOVERY_KEY, TrainState


def steps(*numbers):
    return [{"step": n, "loss": float(n)} for n in numbers]


# A run that trained 1..5, rolled back from 5 to 2 (rollback 1), trained 3 again and was killed.
FILE = [*steps(1, 2, 3, 4, 5), {"event": "rollback", "step": 5, "to_step": 2, "rollback": 1}, *steps(3)]


def resumed(step, rollbacks):
    state = TrainState(global_step=step)
    if rollbacks is not None:
        state.extra[RECOVERY_KEY] = {"rollbacks": rollbacks}
    return state


def test_a_resume_from_the_rollbacks_save_keeps_the_event_and_what_showed_the_anomaly():
    # The rollback's save (step 2, the rollback counted): the undone steps and the event are its history.
    assert history_of(FILE, resumed(2, 1)) == FILE[:6]


def test_a_resume_from_before_the_rollback_drops_it():
    # A checkpoint that does not count the rollback: the run will get there (and roll back) again.
    assert history_of(FILE, resumed(2, 0)) == FILE[:2]
    assert history_of(FILE, resumed(2, None)) == FILE[:2]  # a run without recovery


def test_steps_after_the_event_are_kept_up_to_the_resumed_step():
    later = [*FILE, *steps(4, 5)]
    assert history_of(later, resumed(4, 1)) == [*FILE, *steps(4)]
