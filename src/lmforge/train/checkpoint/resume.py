"""``checkpoint.auto_resume``: where a restarted job picks up its own checkpoints.

A job that torchrun restarts after a worker died (``--max-restarts``), or that a scheduler
requeues, must continue from the newest *complete* checkpoint in ``checkpoint.save_path`` without
anyone editing the YAML. A save interrupted half-way never counts: it lives in a hidden
``.iteration_*.partial`` directory and the tracker file is replaced only after it is complete
(train/checkpoint/__init__.py), so the tracker always names a complete checkpoint.

Modes: ``"auto"`` (default) resumes only on an elastic restart — decided the same way on every
rank, from the job's store generation (utils/elastic.py), because torchrun's own
``TORCHELASTIC_RESTART_COUNT`` stays 0 on the nodes whose workers did not fail — so a fresh launch
keeps the original's meaning of ``load_path``; ``true`` resumes whenever
``save_path`` holds a checkpoint; ``false`` never does.
"""

from __future__ import annotations

from typing import Any

from lmforge.train.checkpoint import read_tracker
from lmforge.utils.elastic import is_elastic_restart, restart_count
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint.resume")


def auto_resume_path(checkpoint: dict[str, Any]) -> str | None:
    """``save_path`` when this run should resume from it (ahead of ``load_path``), else None."""
    mode = checkpoint.get("auto_resume", "auto")
    save_path = checkpoint.get("save_path") or ""
    if mode is False or not checkpoint.get("enable_save", True) or not save_path:
        return None
    if mode == "auto" and not is_elastic_restart():
        return None
    step = read_tracker(save_path)
    if step is None:
        return None
    reason = f"elastic restart {restart_count()}" if is_elastic_restart() else "checkpoint.auto_resume: true"
    load_path = checkpoint.get("load_path") or ""
    instead = (
        f" instead of checkpoint.load_path {load_path!r}" if load_path and load_path != save_path else ""
    )
    logger.warning(
        "%s: resuming from the latest complete checkpoint in %s (iteration %d)%s.",
        reason,
        save_path,
        step,
        instead,
    )
    return str(save_path)
