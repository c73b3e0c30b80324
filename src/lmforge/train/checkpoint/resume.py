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

``checkpoint.load_path`` is explicit: a path that holds nothing is an error (found by ``check`` and
before ``train`` builds anything, :func:`check_load_path`). "Resume if a checkpoint is there, else
start from scratch" is ``auto_resume: true``; with it, a ``load_path`` equal to ``save_path`` only
repeats that and is not required to hold anything yet (the first launch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lmforge.errors import CheckpointError
from lmforge.train.checkpoint import read_tracker
from lmforge.train.checkpoint.resolve import (
    CheckpointHeader,
    empty_load_path_message,
    holds_nothing,
    resolve_checkpoint,
)
from lmforge.utils.elastic import is_elastic_restart, restart_count
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train.checkpoint.resume")


def _own_checkpoint(checkpoint: Any) -> tuple[str, int] | None:
    """(save_path, its latest iteration) when this run resumes from its own checkpoints, else None."""
    mode, save_path = checkpoint.auto_resume, checkpoint.save_path
    if mode is False or not checkpoint.enable_save or not save_path:
        return None
    if mode == "auto" and not is_elastic_restart():
        return None
    step = read_tracker(save_path)
    return None if step is None else (str(save_path), step)


def _load_path_is_save_path(checkpoint: Any) -> bool:
    """``auto_resume: true`` with ``load_path`` = ``save_path``: the load path says the same as auto_resume."""
    load_path, save_path = checkpoint.load_path, checkpoint.save_path
    return (
        checkpoint.auto_resume is True
        and checkpoint.enable_save
        and bool(load_path)
        and bool(save_path)
        and Path(load_path).resolve() == Path(save_path).resolve()
    )


def load_path_problem(checkpoint: Any) -> str | None:
    """Why ``checkpoint.load_path`` cannot be loaded because it holds nothing, else None. ``train`` refuses
    with it before anything is built (and before its run lock is created in save_path); ``check`` warns,
    as for data files that do not exist yet."""
    load_path = checkpoint.load_path
    if not load_path or _own_checkpoint(checkpoint) is not None or _load_path_is_save_path(checkpoint):
        return None
    return empty_load_path_message(load_path) if holds_nothing(Path(load_path)) else None


def load_path_to_use(checkpoint: Any) -> tuple[str, bool]:
    """(the path this run loads, "" for none; whether the load is a full resume forced by auto-resume)."""
    own = auto_resume_path(checkpoint)
    if own is not None:  # this job's own checkpoint: continue it completely (optimizer included)
        return own, True
    if _load_path_is_save_path(checkpoint):
        return "", False  # auto_resume: true on the first launch: nothing saved yet, start from scratch
    return checkpoint.load_path, False


def checkpoint_to_load(checkpoint: Any) -> tuple[CheckpointHeader | None, bool]:
    """(the checkpoint this run loads, None for none; whether it is this job's own, resumed whole)."""
    load_path, own = load_path_to_use(checkpoint)
    header = resolve_checkpoint(load_path) if load_path else None
    if load_path and header is None:  # emptied since the builder checked it (load_path_problem)
        raise CheckpointError(empty_load_path_message(load_path))
    return header, own


def auto_resume_path(checkpoint: Any) -> str | None:
    """``save_path`` when this run should resume from it (ahead of ``load_path``), else None."""
    own = _own_checkpoint(checkpoint)
    if own is None:
        return None
    save_path, step = own
    reason = f"elastic restart {restart_count()}" if is_elastic_restart() else "checkpoint.auto_resume: true"
    load_path = checkpoint.load_path
    instead = (
        f" instead of checkpoint.load_path {load_path!r}"
        if load_path and not _load_path_is_save_path(checkpoint) and load_path != save_path
        else ""
    )
    logger.warning(
        "%s: resuming from the latest complete checkpoint in %s (iteration %d)%s.",
        reason,
        save_path,
        step,
        instead,
    )
    return str(save_path)
