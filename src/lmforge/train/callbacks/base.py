"""Callbacks: everything beside the step (logging, metrics, checkpoints, plots, monitors).

Hooks and their call signature are the original's: ``hook(args, state, **kwargs)`` with ``args`` the
run's ``TrainConfig`` and ``state`` the :class:`~lmforge.train.state.TrainState`. Keyword arguments
always include ``trainer``, ``model``, ``optimizer``, ``lr_scheduler`` and ``train_dataset``; at
``on_step_end`` also ``loss``, ``grad_norm``, ``result`` (the :class:`StepResult`) and ``metrics``
(the dict written to metrics.jsonl, which callbacks may extend in ``on_step_end`` before the
metrics callback, which runs last).

A callback with state of its own (counters, a best value, a window) implements ``state_dict()`` and
``load_state_dict(state)``: the checkpoint saves that state with the run (per rank, under the
callback's class name) and a resume or a rollback restores it before ``on_train_begin``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lmforge.errors import CheckpointError
from lmforge.utils.logging import get_logger

if TYPE_CHECKING:
    from lmforge.config.schema import TrainConfig
    from lmforge.train.state import TrainState

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

    def on_begin(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_end(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_train_begin(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_train_end(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_epoch_begin(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_epoch_end(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_step_begin(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_step_end(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...
    def on_rollback(self, args: TrainConfig, state: TrainState, **kwargs: Any) -> None: ...


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

    def _stateful(self) -> dict[str, Any]:
        """key -> callback, for every callback with ``state_dict`` and ``load_state_dict``: its class name,
        numbered from the second one of the same class on (``Name#2``), in the order callbacks run."""
        out: dict[str, Any] = {}
        seen: dict[str, int] = {}
        for cb in self.callbacks:
            if callable(getattr(cb, "state_dict", None)) and callable(getattr(cb, "load_state_dict", None)):
                name = type(cb).__qualname__
                seen[name] = seen.get(name, 0) + 1
                out[name if seen[name] == 1 else f"{name}#{seen[name]}"] = cb
        return out

    def state_dict(self) -> dict[str, Any]:
        """The stateful callbacks' states by key (empty when none has state)."""
        return {key: cb.state_dict() for key, cb in self._stateful().items()}

    def load_state_dict(self, saved: dict[str, Any], where: str = "the checkpoint") -> None:
        """Restore each stateful callback's saved state. One the checkpoint has no state for (a callback
        added since) starts fresh, and a saved state no callback takes (one removed since) is left out,
        both named in the log."""
        live = self._stateful()
        for key, cb in live.items():
            if key not in saved:
                logger.info("Callback %s has no state in %s: it starts fresh.", key, where)
                continue
            try:
                cb.load_state_dict(saved[key])
            except Exception as exc:
                raise CheckpointError(
                    f"Callback {key} could not restore its state from {where}: {type(exc).__name__}: {exc}. Resume "
                    "with the callback version that saved it, or remove the callback from the run."
                ) from exc
        unused = sorted(set(saved) - set(live))
        if unused:
            logger.warning(
                "%s holds the state of callback(s) this run does not have (%s): not restored.",
                where,
                ", ".join(unused),
            )
