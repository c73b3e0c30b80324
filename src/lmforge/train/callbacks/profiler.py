"""The ``profiler`` section as a callback: torch.profiler over the configured steps."""

from __future__ import annotations

import os
from typing import Any

from lmforge.config.sections_run import ProfilerConfig
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.torch_profiler import StepProfiler


class ProfilerCallback(TrainerCallback):
    # First at step begin and (being sorted once) first at step end too: the trace covers the step
    # itself, not the other callbacks' end-of-step work such as checkpoint saving.
    order = 0

    def __init__(
        self, section: ProfilerConfig, output_dir: str | os.PathLike = ".", rank: int | None = None
    ) -> None:
        self.profiler = StepProfiler(section, output_dir, rank)

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.profiler.step_begin(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.profiler.step_end(state.global_step)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.profiler.stop()  # a run shorter than end_step still gets its trace
