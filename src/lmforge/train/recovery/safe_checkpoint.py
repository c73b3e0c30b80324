"""Which checkpoint a rollback may restore, and which one rotation (``checkpoint.save_max``) must keep.

A checkpoint of step ``s`` holds the weights after update ``s``; the loss of step ``s + 1`` is the first
one computed with them. A damaged update can therefore be saved before any loss shows it: a checkpoint
is *safe* for an anomaly whose first anomalous loss is at step ``onset`` only when ``s <= onset - 2``,
i.e. when the loss of step ``s + 1`` was seen and judged normal.
"""

from __future__ import annotations

import re
from pathlib import Path

_ITERATION = re.compile(r"^iteration_(\d{8})$")


def complete_iterations(save_path: str | Path) -> list[int]:
    """The steps of the complete checkpoints in ``save_path`` (a DCP ``.metadata`` file), ascending."""
    root = Path(save_path)
    if not root.is_dir():
        return []
    steps = []
    for child in root.iterdir():
        m = _ITERATION.match(child.name)
        if m and (child / ".metadata").is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


def newest_safe(steps: list[int], onset: int) -> int | None:
    """The newest of ``steps`` that is safe for an anomaly first seen at step ``onset``."""
    safe = [s for s in steps if s <= onset - 2]
    return safe[-1] if safe else None
