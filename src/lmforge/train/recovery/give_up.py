"""A give-up is final: ``save_path/recovery_gave_up.json`` keeps a restarted job from trying again.

When recovery gives up (``recovery.max_rollbacks`` used, or no safe checkpoint), the process exits with
status 5. ``torchrun --max-restarts`` restarts every failed worker whatever its exit status
(torch.distributed.elastic's agent), and a restarted job would resume from the newest safe checkpoint and
give up again at the same anomaly, once per restart. So rank 0 writes this marker next to the checkpoints,
atomically, and ``lmforge train`` refuses a run that saves into that ``save_path`` before anything is built
(:func:`give_up_problem`). Continuing is a decision the user makes by deleting the file, after changing what
made the run give up (docs/training.md, "Recovery").
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from lmforge.utils.atomic import write_text_atomic

MARKER_FILE = "recovery_gave_up.json"  # under checkpoint.save_path


def marker_path(save_path: str | Path) -> Path:
    return Path(save_path) / MARKER_FILE


def write_give_up_marker(save_path: str | Path, record: dict[str, Any]) -> Path:
    """Rank 0: record the give-up in ``save_path`` (replaced atomically: never half written)."""
    path = marker_path(save_path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {
        "event": "give_up",
        **record,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "to_continue": f"change what made the run give up, then delete this file ({path})",
    }
    write_text_atomic(path, json.dumps(body, indent=2) + "\n")
    return path


def read_give_up_marker(save_path: str | Path) -> dict[str, Any] | None:
    """The marker's record; ``{}`` when the file exists but cannot be read; None when there is none."""
    path = marker_path(save_path)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def give_up_problem(checkpoint: Any) -> str | None:
    """Why this run must not start: recovery gave up in its ``checkpoint.save_path`` before (else None).

    Only a run that saves checkpoints there is concerned (it would resume from them, or write next to them)."""
    if not checkpoint.enable_save or not checkpoint.save_path:
        return None
    record = read_give_up_marker(checkpoint.save_path)
    if record is None:
        return None
    path = marker_path(checkpoint.save_path)
    if record:
        what = (
            f"recovery gave up on the run in checkpoint.save_path at step {record.get('step')}: "
            f"{record.get('anomaly')}; {record.get('reason')}"
        )
    else:
        what = "recovery gave up on the run in checkpoint.save_path (the file cannot be read)"
    safe = record.get("safe_checkpoint")
    resume = f" (an automatic resume then continues from {safe})" if safe else ""
    return (
        f"{path} says that {what}. This run saves into that directory, so it is not started: a restart would "
        "only give up again at the same anomaly. To continue deliberately, change what made it give up (a lower "
        "lr_scheduler.learning_rate, recovery.lr_scale < 1, recovery.data: skip, or a higher "
        "recovery.max_rollbacks: a resume keeps the count of rollbacks used), then delete "
        f"{path}{resume}; or start a new run with another checkpoint.save_path."
    )


def give_up_note(directory: str | Path) -> str | None:
    """``checkpoint inspect``'s line about a give-up marker in ``directory`` (a save_path) or its parent (an
    iteration directory's save_path); None when there is none."""
    for save_path in (Path(directory), Path(directory).parent):
        record = read_give_up_marker(save_path)
        if record is not None:
            what = (
                f" at step {record.get('step')} ({record.get('anomaly')}; {record.get('reason')})"
                if record
                else ""
            )
            return (
                f"recovery gave up{what}: lmforge train refuses a run that saves into {save_path} while "
                f"{marker_path(save_path)} exists (delete it to continue deliberately)"
            )
    return None
