"""A live progress bar on a terminal (tqdm): steps done, rate, time left and the last loss.

Only on rank 0 and only when standard error is a terminal: a log file, a pipe or a batch job's output
gets the log lines alone (which carry the elapsed time, the ETA and the epoch themselves). While the
bar is shown, lmforge's console log lines are written above it (tqdm's logging redirect), so they do
not tear it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback


class ProgressBarCallback(TrainerCallback):
    order = 19  # just before the step's log line (20)

    def __init__(self, stream: Any = None) -> None:
        self.stream = stream
        self.bar: Any = None
        self._redirect: contextlib.ExitStack | None = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        stream = self.stream or sys.stderr
        trainer = kwargs.get("trainer")
        if getattr(getattr(trainer, "ctx", None), "rank", 0) != 0 or not _is_terminal(stream):
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        self.bar = tqdm(
            total=int(state.max_steps),
            initial=int(state.global_step),
            file=stream,
            unit="step",
            dynamic_ncols=True,
            desc="training",
        )
        self._redirect = contextlib.ExitStack()
        self._redirect.enter_context(logging_redirect_tqdm(loggers=[logging.getLogger("lmforge")]))

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.bar is None:
            return
        loss = (kwargs.get("metrics") or {}).get("loss")
        if isinstance(loss, float) and math.isfinite(loss):
            self.bar.set_postfix_str(f"loss {loss:.4f}", refresh=False)
        self.bar.update(int(state.global_step) - self.bar.n)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self._redirect is not None:
            self._redirect.close()
            self._redirect = None


def _is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False
