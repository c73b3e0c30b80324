"""Callbacks with state of their own: the checkpoint saves it with the run and a resume restores it."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from lmforge.errors import CheckpointError
from lmforge.train.callbacks import CallbackHandler, TrainerCallback
from lmforge.train.checkpoint.resolve import _read_metadata

from .conftest import tiny_trainer


class StepTally(TrainerCallback):
    """Counts the steps it saw and keeps the sum of their losses in a tensor (state of both kinds)."""

    def __init__(self) -> None:
        self.steps = 0
        self.loss_sum = torch.zeros((), dtype=torch.float64)
        self.at_train_begin: tuple[int, float] | None = None

    def on_train_begin(self, args, state, **kwargs) -> None:
        self.at_train_begin = (self.steps, float(self.loss_sum))

    def on_step_end(self, args, state, **kwargs) -> None:
        self.steps += 1
        self.loss_sum += kwargs["loss"]

    def state_dict(self) -> dict:
        return {"steps": self.steps, "loss_sum": self.loss_sum.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.steps = int(state["steps"])
        self.loss_sum = state["loss_sum"].clone()


class Stateless(TrainerCallback):
    pass


def test_the_handler_keys_states_by_class_and_numbers_repeats():
    a, b = StepTally(), StepTally()
    a.steps, b.steps = 3, 5
    handler = CallbackHandler([a, Stateless(), b])
    saved = handler.state_dict()
    assert sorted(saved) == ["StepTally", "StepTally#2"]
    c, d = StepTally(), StepTally()
    CallbackHandler([c, d]).load_state_dict(saved)
    assert (c.steps, d.steps) == (3, 5)
    assert CallbackHandler([Stateless()]).state_dict() == {}


def test_added_and_removed_callbacks_are_named_and_a_bad_state_is_a_checkpoint_error(caplog):
    fresh = StepTally()
    with caplog.at_level(logging.INFO, logger="lmforge.train.callbacks"):
        CallbackHandler([fresh]).load_state_dict({"Gone": {"x": 1}}, where="ckpt/iteration_00000004")
    assert fresh.steps == 0
    assert "StepTally has no state in ckpt/iteration_00000004: it starts fresh" in caplog.text
    assert "callback(s) this run does not have (Gone): not restored" in caplog.text
    with pytest.raises(CheckpointError, match="Callback StepTally could not restore its state from ckpt"):
        CallbackHandler([StepTally()]).load_state_dict({"StepTally": {"steps": 1}}, where="ckpt")


@pytest.mark.slow
def test_a_callbacks_state_is_saved_with_the_run_and_restored_on_resume(make_config):
    cfg = make_config(training={"steps": 6}, checkpoint={"save_interleaved_steps": 3})
    first_tally = StepTally()
    tiny_trainer(cfg, callbacks=[first_tally]).fit()
    ckpt = Path(cfg.checkpoint.save_path) / "iteration_00000003"
    assert any(k.startswith("callbacks.rank_0.") for k in _read_metadata(ckpt).state_dict_metadata)

    resumed_cfg = make_config(
        training={"steps": 6},
        checkpoint={"save_interleaved_steps": 3, "load_path": str(ckpt), "auto_resume": False},
    )
    tally = StepTally()
    trainer = tiny_trainer(resumed_cfg, callbacks=[tally])
    trainer.fit()
    assert trainer.state.global_step == 6
    # Restored before on_train_begin: the 3 steps of the first run (with their losses), then 3 more.
    steps, loss_sum = tally.at_train_begin
    assert steps == 3 and loss_sum > 0
    assert tally.steps == 6
    # Resuming replays steps 4..6 exactly (tests/train/test_resume.py), so the sums agree bit for bit.
    assert torch.equal(tally.loss_sum, first_tally.loss_sum)
