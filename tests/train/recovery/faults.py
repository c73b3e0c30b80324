"""Test-only faults for recovery runs launched from a YAML (``callbacks: [{type: faults.DamageNorm, ...}]``,
with ``LMFORGE_ALLOW_IMPORTS=1`` and this directory on PYTHONPATH)."""

from __future__ import annotations

import os
import signal

import torch

from lmforge.train.callbacks import TrainerCallback


def this_attempt() -> int:
    """The job's attempt as lmforge counts it (0 outside torchrun or before any restart)."""
    from lmforge.utils.elastic import restart_count

    return restart_count()


class DamageNorm(TrainerCallback):
    """Multiplies the final norm's weights (every rank its own shard) by ``factor`` after update ``step``,
    the first ``times`` times that step is reached (in attempt ``attempt`` of an elastic job only, when
    given): the next loss spikes."""

    order = 70  # before the checkpoint callback (80): the damaged weights are saved, as a real fault's would

    def __init__(self, step: int, factor: float = 50.0, times: int = 1, attempt: int | None = None) -> None:
        self.step, self.factor, self.left = int(step), float(factor), int(times)
        self.attempt = attempt

    def on_step_end(self, args, state, **kwargs):
        if state.global_step != self.step or self.left <= 0:
            return
        if self.attempt is not None and this_attempt() != self.attempt:
            return
        self.left -= 1
        model = kwargs["model"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "final_layernorm" in name:
                    p.mul_(self.factor)


class KillAfterRollback(TrainerCallback):
    """SIGKILLs rank ``rank`` at the start of the ``after``-th step after the first rollback, in attempt 0 of
    the job: the rollback's own save is the newest checkpoint, and the steps trained since are lost."""

    def __init__(self, rank: int = 1, after: int = 2) -> None:
        self.rank, self.after = int(rank), int(after)
        self.steps_since: int | None = None

    def on_rollback(self, args, state, **kwargs):
        if self.steps_since is None:
            self.steps_since = 0

    def on_step_begin(self, args, state, **kwargs):
        if self.steps_since is None:
            return
        self.steps_since += 1
        if (
            self.steps_since == self.after
            and int(os.environ.get("RANK", "0")) == self.rank
            and this_attempt() == 0
        ):
            os.kill(os.getpid(), signal.SIGKILL)


class NonFiniteWeights(TrainerCallback):
    """Makes the final norm's weights NaN before the first step (what a damaged checkpoint that still loads
    does): every step's loss is NaN and skipped, so no update is ever applied."""

    def on_train_begin(self, args, state, **kwargs):
        with torch.no_grad():
            for name, p in kwargs["model"].named_parameters():
                if "final_layernorm" in name:
                    p.mul_(float("nan"))
