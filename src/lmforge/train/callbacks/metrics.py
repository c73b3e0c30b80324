"""metrics.jsonl: one JSON object per step, appended by rank 0."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.registry import register_callback
from lmforge.train.state import RECOVERY_KEY
from lmforge.utils.atomic import write_text_atomic
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.callbacks.metrics")


def read_metrics_checked(path: str | Path) -> tuple[list[dict[str, Any]], list[int]]:
    """(the step records of ``path``, the 1-based numbers of the lines that are not one).

    A run killed while appending leaves its last line cut; such a line (or any line that is not a JSON
    object with an integer ``step``) is skipped, never fatal: the file is an output of the run, and its
    records are rewritten by the steps that follow a resume.
    """
    path = Path(path)
    if not path.is_file():
        return [], []
    records, damaged = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        if isinstance(record, dict) and type(record.get("step", 0)) is int:
            records.append(record)
        else:
            damaged.append(number)
    return records, damaged


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    return read_metrics_checked(path)[0]


def history_of(records: list[dict[str, Any]], state: Any) -> list[dict[str, Any]]:
    """The records of ``metrics.jsonl`` that belong to the run a resume continues (``state`` restored).

    Step records past the resumed step were written by the interrupted run and will be written again.
    A rollback event (its ``step`` is the detection, past its ``to_step``) belongs to the history when
    the resumed state counts it (recovery saves the restored state with the rollback counted); so do the
    records before it (they show the anomaly). A rollback the state does not count will happen again.
    """
    counted = int((state.extra.get(RECOVERY_KEY) or {}).get("rollbacks", 0))
    last = max(
        (
            i
            for i, r in enumerate(records)
            if r.get("event") == "rollback" and int(r.get("rollback", 0)) <= counted
        ),
        default=-1,
    )
    later = [r for r in records[last + 1 :] if "event" not in r and r.get("step", 0) <= state.global_step]
    return records[: last + 1] + later


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
        records, damaged = read_metrics_checked(self.path)
        if damaged:
            logger.warning(
                "%s: dropped %d line(s) that are not a step record (line %s%s); a run killed while writing "
                "leaves its last line cut. The other records are kept.",
                self.path,
                len(damaged),
                ", ".join(map(str, damaged[:5])),
                ", ..." if len(damaged) > 5 else "",
            )
        kept = history_of(records, state)
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
