"""Callbacks: everything beside the step (logging, metrics, checkpoints, plots, monitors).

Hooks and their call signature are the original's: ``hook(args, state, **kwargs)`` with ``args`` the
run's ``TrainConfig`` and ``state`` the :class:`~lmforge.train.state.TrainState`. Keyword arguments
always include ``trainer``, ``model``, ``optimizer``, ``lr_scheduler`` and ``train_dataset``; at
``on_step_end`` also ``loss``, ``grad_norm``, ``result`` (the :class:`StepResult`) and ``metrics``
(the dict written to metrics.jsonl, which callbacks may extend in ``on_step_end`` before the
metrics callback, which runs last).
"""

from __future__ import annotations

from typing import Any

from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.callbacks")

HOOKS = (
    "on_begin",
    "on_end",
    "on_train_begin",
    "on_train_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_step_begin",
    "on_step_end",
    "on_rollback",  # lmforge's: recovery restored a checkpoint (kwargs: rollback, the metrics.jsonl record)
)


class TrainerCallback:
    """Base class: override any hook. ``order`` sorts callbacks (lower runs first, stable)."""

    order: int = 50

    def on_begin(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_end(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_epoch_begin(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_epoch_end(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None: ...
    def on_rollback(self, args: Any, state: Any, **kwargs: Any) -> None: ...


class CallbackHandler:
    """Runs callbacks in order. A duplicate class is allowed (logged), as in the original."""

    def __init__(self, callbacks: list[TrainerCallback] | None = None) -> None:
        self.callbacks: list[TrainerCallback] = []
        for cb in callbacks or []:
            self.add(cb)

    def add(self, callback: TrainerCallback) -> None:
        if any(type(c) is type(callback) for c in self.callbacks):
            logger.warning("Callback %s is added more than once.", type(callback).__name__)
        self.callbacks.append(callback)
        self.callbacks.sort(key=lambda c: getattr(c, "order", 50))

    def get(self, cls: type) -> TrainerCallback | None:
        return next((c for c in self.callbacks if isinstance(c, cls)), None)

    def call(self, event: str, args: Any, state: Any, **kwargs: Any) -> None:
        if event not in HOOKS:
            raise ValueError(f"unknown callback event {event!r}")
        for cb in self.callbacks:
            hook = getattr(cb, event, None)
            if hook is not None:
                hook(args, state, **kwargs)
