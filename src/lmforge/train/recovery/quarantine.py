"""Checkpoints that may hold the damage an anomaly revealed: moved out of ``save_path`` to ``damaged/``.

A checkpoint of step ``s`` with ``onset - 2 < s <= detected`` was written after the first suspect update
(safe_checkpoint.py): a rollback undoes it, and a run that gives up must not leave it to be resumed. Left
in ``save_path`` it would be picked by whatever takes the newest ``iteration_*`` there: the tracker of a
save published in the meantime, a crash between the tracker's rewrite and the next save, a later
rollback's listing after a restart, ``lmforge doctor``'s reading of the latest checkpoint. Moved to
``save_path/damaged/anomaly_<n>_step_<detected>/`` (with ``anomaly.json`` saying why), no code path that
lists ``save_path`` sees it, and it stays on disk for inspection (``checkpoint.load_path`` can name it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from lmforge.train.checkpoint import iteration_dir_name, read_tracker, write_tracker
from lmforge.train.checkpoint.files import TRACKER_FILE
from lmforge.train.recovery.safe_checkpoint import complete_iterations, newest_safe
from lmforge.utils.atomic import fsync_dir
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.recovery")

DAMAGED_DIR = "damaged"  # under checkpoint.save_path
RECORD_FILE = "anomaly.json"


def unsafe_iterations(save_path: str | Path, onset: int, detected: int) -> list[int]:
    """The complete checkpoints of ``save_path`` written between the first suspect update and the detection."""
    return [s for s in complete_iterations(save_path) if onset - 2 < s <= detected]


def quarantine(
    save_path: str | Path, onset: int, detected: int, number: int, record: dict[str, Any]
) -> Path | None:
    """Rank 0: move the unsafe checkpoints aside and point the tracker at the newest safe one.

    Returns the directory they were moved to (None when there were none). The tracker never names a moved
    checkpoint afterwards: it names the newest safe one, or is removed when none is left (an automatic
    resume then starts the way the first launch did, never from damaged weights).
    """
    root = Path(save_path)
    steps = unsafe_iterations(root, onset, detected)
    target = None
    if steps:
        target = _fresh_dir(root / DAMAGED_DIR, f"anomaly_{number}_step_{detected}")
        target.mkdir(parents=True)
        for step in steps:
            os.replace(root / iteration_dir_name(step), target / iteration_dir_name(step))
        info = {**record, "moved": [iteration_dir_name(s) for s in steps]}
        (target / RECORD_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")
        fsync_dir(target)
        fsync_dir(root)
        logger.warning(
            "recovery: moved the checkpoints that may hold the damage (%s) to %s: no resume will pick them.",
            ", ".join(iteration_dir_name(s) for s in steps),
            target,
        )
    safe = newest_safe(complete_iterations(root), onset)
    if safe is not None:
        write_tracker(root, safe)
    elif read_tracker(root) in steps:
        (root / TRACKER_FILE).unlink()
        fsync_dir(root)
    return target


def _fresh_dir(parent: Path, name: str) -> Path:
    """``parent/name``, or ``name-2``, ``name-3``... when an earlier attempt of the job used it."""
    candidate, n = parent / name, 1
    while candidate.exists():
        n += 1
        candidate = parent / f"{name}-{n}"
    return candidate
