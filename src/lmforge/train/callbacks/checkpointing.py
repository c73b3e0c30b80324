"""Saving checkpoints: every ``save_interleaved_steps``, at the end, and on SIGTERM/SIGINT."""

from __future__ import annotations

import logging
import time
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.checkpoint import CheckpointManager

logger = logging.getLogger(__name__)


class CheckpointCallback(TrainerCallback):
    order = 80  # after logging; before metrics so the save time can be reported

    def __init__(self, manager: CheckpointManager, save_interleaved_steps: int) -> None:
        self.manager = manager
        self.interval = int(save_interleaved_steps)
        self.last_saved_step: int | None = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        # A resumed run does not re-save the step it resumed from.
        self.last_saved_step = state.global_step if state.global_step > 0 else None

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs["trainer"]
        self.manager.poll()
        # Not on a stop request: a save is collective, and a signal may reach one rank during this
        # step and another only after it. The stop is agreed before the next step, and the run's
        # end (on_train_end) saves the step at which every rank stopped.
        if state.global_step % self.interval == 0:
            self._save(trainer, state)
            kwargs["metrics"]["checkpoint_save_s"] = round(self.manager.last_save_seconds, 4)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs["trainer"]
        t0 = time.perf_counter()
        # (Not again when this step is saved already: at a resume, or by recovery's rollback just before.)
        done = state.global_step in (self.last_saved_step, self.manager.last_step)
        saved = not done and self._save(trainer, state)
        self.manager.close()  # waits for an asynchronous save still in flight
        if saved:
            # After the loop, so no metrics.jsonl line carries it (a stop's save, or a last step that is
            # no multiple of save_interleaved_steps): the log and summary.json report it instead.
            seconds = time.perf_counter() - t0
            trainer.final_save = (state.global_step, seconds)
            logger.info(
                "Checkpoint of step %d saved at the end of the run in %.2f s.", state.global_step, seconds
            )
        trainer.artifacts["checkpoints"] = str(self.manager.save_path)

    def _save(self, trainer: Any, state: Any) -> bool:
        if self.manager.save(trainer.checkpointable(), state.global_step):
            self.last_saved_step = state.global_step
            return True
        return False
