"""metrics.jsonl: one JSON object per step, appended by rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.registry import register_callback
from lmforge.utils.atomic import write_text_atomic


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    path = Path(path)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _jsonable(value: Any) -> Any:
    # JSON has no NaN/Inf: write them as strings so every line stays valid JSON.
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    return value


@register_callback("MetricsCallback")
class MetricsCallback(TrainerCallback):
    order = 90  # last: other callbacks may add fields to the step's metrics first

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path else None
        self._file = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs["trainer"]
        if trainer.ctx.rank != 0:
            return
        self.path = self.path or Path(trainer.output_dir) / "metrics.jsonl"
        # After a resume, records past the resumed step belong to the interrupted run and will be
        # produced again; drop them so the file holds each step once.
        kept = [r for r in read_metrics(self.path) if int(r.get("step", 0)) <= state.global_step]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Rewritten aside and renamed: a crash here keeps the previous file.
        write_text_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")  # noqa: SIM115 - kept open for the run, closed at train end

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self._file is None:
            return
        self._file.write(json.dumps(_jsonable(kwargs["metrics"])) + "\n")
        self._file.flush()

    def on_rollback(self, args: Any, state: Any, **kwargs: Any) -> None:
        # The records of the undone steps stay (they show the anomaly); the event line marks where the
        # run went back to, and the steps after to_step are written again.
        if self._file is None:
            return
        self._file.write(json.dumps(_jsonable(kwargs["rollback"])) + "\n")
        self._file.flush()

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
