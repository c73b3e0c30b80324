"""The torch adapter: a ``torch.optim.lr_scheduler.LRScheduler`` driven by a pure schedule.

Its only state is the step, so a checkpoint holds one integer and resuming restores the lr
exactly. After construction the step is 0 and every param group has ``lr_at(0) · lr_scale``: the
lr of update 1. Each ``step()`` (called after ``optimizer.step()``) advances it, so update k
(1-based) runs with ``lr_at(k - 1)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from lmforge.lr.schedules import Schedule


class ScheduleLR(LRScheduler):
    """Sets ``group["lr"] = schedule.lr_at(step) * group.get("lr_scale", 1.0)`` for every group.

    ``optimizer`` is anything with ``param_groups`` (a ``torch.optim.Optimizer`` or a wrapper
    around one); ``LRScheduler.__init__`` is deliberately not called, because it insists on a
    ``torch.optim.Optimizer`` and records per-group ``initial_lr`` state that a pure schedule does
    not need.
    """

    def __init__(self, optimizer: Any, schedule: Schedule, step: int = 0) -> None:
        if not hasattr(optimizer, "param_groups"):
            raise TypeError(
                f"ScheduleLR needs an optimizer with param_groups, got {type(optimizer).__name__}"
            )
        self.optimizer = optimizer
        self.schedule = schedule
        self.last_epoch = int(step)
        self._step_count = 1
        self.base_lrs = [schedule.base_lr * group.get("lr_scale", 1.0) for group in optimizer.param_groups]
        self._apply()

    @property
    def step_index(self) -> int:
        """The schedule step whose lr the param groups hold now (= updates done so far)."""
        return self.last_epoch

    def get_lr(self) -> list[float]:
        lr = self.schedule.lr_at(self.last_epoch)
        return [lr * group.get("lr_scale", 1.0) for group in self.optimizer.param_groups]

    def _get_closed_form_lr(self) -> list[float]:
        return self.get_lr()

    def _apply(self) -> None:
        for group, lr in zip(self.optimizer.param_groups, self.get_lr(), strict=True):
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr)  # a tensor lr (capturable / fused optimizers) is updated in place
            else:
                group["lr"] = lr
        self._last_lr = [float(group["lr"]) for group in self.optimizer.param_groups]

    def step(self, epoch: int | None = None) -> None:
        if epoch is not None:
            raise TypeError("ScheduleLR.step() takes no epoch; use load_state_dict({'step': n}) to jump")
        self._step_count += 1
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return list(self._last_lr)

    def state_dict(self) -> dict[str, int]:
        return {"step": self.last_epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.last_epoch = int(state_dict["step"])
        self._apply()
