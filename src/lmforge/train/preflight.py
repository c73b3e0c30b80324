"""Every check of a run that needs no process group: ``load_config`` has typed the file; this adds the
run plan (:mod:`lmforge.parallel.plan`) and the trainer's own lists (callbacks). ``lmforge check`` and
``lmforge train`` both call :func:`preflight`, so they accept and refuse exactly the same files, and
``train`` refuses before any model, tokenizer, dataset or process group exists.
"""

from __future__ import annotations

from typing import Any

from lmforge.parallel.plan import RunPlan


def check_callbacks(cfg: Any) -> None:
    """Every ``callbacks[i].type`` names a callback and its other keys are that callback's arguments."""
    from lmforge.train.callbacks.registry import check_callback

    for i, item in enumerate(cfg.callbacks or []):
        check_callback(item, i)


def preflight(cfg: Any, world_size: int) -> RunPlan:
    """The run plan of ``cfg`` for ``world_size`` processes; one ConfigError naming every problem."""
    return RunPlan.from_config(cfg, world_size, extra_checks=(check_callbacks,))
