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


def compute_dtype_for_device(model_config: Any, device_type: str) -> Any:
    """``model_config`` with ``compute_dtype: auto`` resolved for ``device_type`` (load_config resolved it
    for the device this process would default to; ``--device`` may name another)."""
    from lmforge.utils.native_dtype import AUTO, choose_compute_dtype

    if not getattr(model_config, "compute_dtype", None) or not model_config.compute_dtype_auto:
        return model_config
    dtype = choose_compute_dtype(AUTO, device_type).dtype
    if dtype == model_config.compute_dtype:
        return model_config
    return dataclasses.replace(model_config, compute_dtype=dtype)


def compute_dtype_report(model_config: Any, device_type: str) -> tuple[str, str | None]:
    """The line ``check`` prints and ``train`` logs about the compute dtype (which one and why), and a
    warning when an explicitly configured 16-bit dtype is emulated on this device (measured slowdown and
    the key to change), else None."""
    from lmforge.utils.native_dtype import AUTO, choose_compute_dtype, emulation_warning

    dtype = model_config.compute_dtype
    if model_config.compute_dtype_auto:
        choice = choose_compute_dtype(AUTO, device_type)
        return f"compute dtype on {device_type}: {choice.describe()}", None
    line = f"compute dtype on {device_type}: {choose_compute_dtype(dtype, device_type).describe()}"
    return line, emulation_warning(dtype, device_type)


def preflight(cfg: Any, world_size: int, device: str | None = None) -> RunPlan:
    """The run plan of ``cfg`` for ``world_size`` processes on ``device`` (``--device``; None: CUDA when
    available); one ConfigError naming every problem."""
    from lmforge.train.recovery.checks import check_recovery
    from lmforge.utils.device import run_device_type

    plan = RunPlan.from_config(
        cfg, world_size, extra_checks=(check_callbacks, check_recovery, check_trackers)
    )
    device_type = run_device_type(device)
    notes = []
    if not plan.dims.is_parallel:
        notes.append(check_cpu_offload_on_one_process(cfg.parallelism, device_type))
    if plan.model_config is not None:
        plan = dataclasses.replace(
            plan, model_config=compute_dtype_for_device(plan.model_config, device_type)
        )
        notes.append(compute_dtype_report(plan.model_config, device_type)[1])
    notes = [note for note in notes if note is not None]
    if notes:
        plan = dataclasses.replace(plan, warnings=(*plan.warnings, *notes))
    return plan
