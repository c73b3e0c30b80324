"""Every check of a run that needs no process group: ``load_config`` has typed the file; this adds the
run plan (:mod:`lmforge.parallel.plan`) and the trainer's own lists (callbacks). ``lmforge check`` and
``lmforge train`` both call :func:`preflight`, so they accept and refuse exactly the same files, and
``train`` refuses before any model, tokenizer, dataset or process group exists.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from lmforge.parallel.plan import RunPlan


def check_callbacks(cfg: Any) -> None:
    """Every ``callbacks[i].type`` names a callback and its other keys are that callback's arguments."""
    from lmforge.train.callbacks.registry import check_callback

    for i, item in enumerate(cfg.callbacks or []):
        check_callback(item, i)


def check_trackers(cfg: Any) -> None:
    """An enabled tracker that could not start (package, settings, W&B login) is refused now."""
    from lmforge.train.callbacks.tracker_settings import check_trackers as check

    check(cfg.monitor, cfg.output_dir or "./output")


def check_cpu_offload_on_one_process(section: Any, device_type: str) -> str | None:
    """``parallelism.cpu_offload`` is FSDP2's CPUOffloadPolicy, applied on every world size (one process
    is wrapped by FSDP2 too, lmforge.train.builder), so on one accelerator it offloads. On one CPU process
    the parameters, gradients and optimizer states already live in host memory: a no-op, and the warning
    returned says so."""
    if not section.cpu_offload or device_type != "cpu":
        return None
    return (
        "parallelism.cpu_offload: true has no effect on this run: it is one process on a CPU, where "
        "parameters, gradients and optimizer states are already in host memory."
    )


def preflight(cfg: Any, world_size: int, device: str | None = None) -> RunPlan:
    """The run plan of ``cfg`` for ``world_size`` processes on ``device`` (``--device``; None: CUDA when
    available); one ConfigError naming every problem."""
    from lmforge.utils.device import run_device_type

    plan = RunPlan.from_config(cfg, world_size, extra_checks=(check_callbacks, check_trackers))
    if not plan.dims.is_parallel:
        note = check_cpu_offload_on_one_process(cfg.parallelism, run_device_type(device))
        if note is not None:
            plan = dataclasses.replace(plan, warnings=(*plan.warnings, note))
    return plan
