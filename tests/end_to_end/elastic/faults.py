"""Faults injected into a training run from its YAML (``callbacks: [{type: end_to_end.elastic.faults:Fault, ...}]``).

Each fault fires on one rank, on one attempt of the job (``lmforge.utils.elastic.restart_count``), so
the restarted job runs clean:

- ``kill``: SIGKILL at the end of step ``step`` (after that step's checkpoint, if any);
- ``kill_mid_save``: SIGKILL inside the checkpoint save of step ``step``, after this rank wrote its
  shard files and before the save was published (the tracker still names the previous checkpoint);
- ``hang``: stop making progress at the end of step ``step`` (sleeps, ignoring nothing but SIGKILL);
- ``sigterm``: SIGTERM to this rank alone at the start of step ``step`` (the others get no signal).
"""

from __future__ import annotations

import os
import signal
import time
from typing import Any

from lmforge.train.callbacks import TrainerCallback


class Fault(TrainerCallback):
    order = 85  # after the checkpoint callback (80) of the same step

    def __init__(self, kind: str, step: int, rank: int = 1, attempt: int = 0) -> None:
        assert kind in ("kill", "kill_mid_save", "hang", "sigterm"), kind
        self.kind, self.step, self.rank, self.attempt = kind, step, rank, attempt
        self.active = False
        self._state: Any = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        # The job's attempt as lmforge counts it (the same on every node, unlike torchrun's
        # TORCHELASTIC_RESTART_COUNT), read once the process group is up.
        from lmforge.utils.elastic import restart_count

        self.active = int(os.environ.get("RANK", "0")) == self.rank and restart_count() == self.attempt
        self._state = state
        if self.active and self.kind == "kill_mid_save":
            # torch's DCP file writer (lmforge's writer subclasses it): every shard write goes through it.
            from torch.distributed.checkpoint.filesystem import FileSystemWriter

            original = FileSystemWriter.write_data
            fault = self

            def write_then_die(writer: Any, plan: Any, planner: Any) -> Any:
                future = original(writer, plan, planner)
                if fault._state.global_step == fault.step:
                    future.wait()
                    os.kill(os.getpid(), signal.SIGKILL)
                return future

            FileSystemWriter.write_data = write_then_die

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.active and self.kind == "sigterm" and state.global_step + 1 == self.step:
            os.kill(os.getpid(), signal.SIGTERM)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if not self.active or state.global_step != self.step:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "hang":
            while True:
                time.sleep(0.05)
