"""Callbacks around :mod:`lmforge.train.callbacks.monitor_hooks`: train_state, moe_monitor and per-step peak memory."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from lmforge.config.sections_run import MoeMonitorConfig, TrainStateConfig
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.monitor_hooks import MoeTokenMonitor, PeakMemory, TrainStateMonitor, format_bytes
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.train")


def _rank() -> int:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


def _model(kwargs: dict[str, Any]) -> Any:
    model = kwargs.get("model")
    # The original passes a list of model chunks (pipeline stages); lmforge passes the module.
    return model[0] if isinstance(model, (list, tuple)) else model


class TrainStateMonitorCallback(TrainerCallback):
    """``monitor.train_state`` as JSON lines in ``<output_dir>/monitor/train_state_rank<N>.jsonl``."""

    order = 15

    def __init__(self, section: TrainStateConfig, output_dir: str | os.PathLike) -> None:
        self.section = section
        self.path = Path(output_dir) / "monitor" / f"train_state_rank{_rank()}.jsonl"
        self.monitor: TrainStateMonitor | None = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.monitor = TrainStateMonitor(
            _model(kwargs),
            self.path,
            local_norm=self.section.local_norm,
            device_norm=self.section.device_norm,
            local_loss=self.section.local_loss,
            device_loss=self.section.device_loss,
        )
        self.monitor.attach()

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.begin_step(state.global_step + 1)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.end_step(kwargs.get("loss"))

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class MoeMonitorCallback(TrainerCallback):
    """``monitor.moe_monitor`` as JSON lines in ``<output_dir>/monitor/tokens_per_expert_rank<N>.jsonl``."""

    order = 15

    def __init__(
        self, section: MoeMonitorConfig, output_dir: str | os.PathLike, num_layers: int | None = None
    ) -> None:
        self.section = section
        self.path = Path(output_dir) / "monitor" / f"tokens_per_expert_rank{_rank()}.jsonl"
        self.num_layers = num_layers
        self.monitor: MoeTokenMonitor | None = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.monitor = MoeTokenMonitor(
            _model(kwargs),
            self.path,
            interval=self.section.save_tokens_per_expert_interval,
            target_layers=self.section.target_layers,
            num_layers=self.num_layers,
        )
        self.monitor.attach()

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.begin_step(state.global_step + 1)

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.monitor is not None:
            self.monitor.close()
            self.monitor = None


class ActivationPlanCallback(TrainerCallback):
    """What recompute / swap do (``parallel/activation.py``'s plan, handed over by the builder that applied
    it): stated at the start of the run's log, and after the first step a warning for every part whose
    forward never ran (the model calls its pieces directly, so wrapping it had no effect)."""

    order = 10

    def __init__(self, plan: Any) -> None:
        self.plan = plan

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        # The model is built, and the plan applied, before the run's log file exists.
        log.info("Activation memory: %s", self.plan.summary())

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.plan is None:
            return
        idle = self.plan.never_ran()
        if idle:
            log.warning(
                "recompute / swap has no effect on %s: their forward never ran during the step (the "
                "model calls their parts directly); choose other module paths",
                ", ".join(idle),
            )
        self.plan = None  # checked once, after the first step


class MemoryCallback(TrainerCallback):
    """Peak memory of each step into the step's metrics (and so the log line, metrics.jsonl, TensorBoard)."""

    order = 10

    def __init__(self, device: Any = None) -> None:
        self.meter = PeakMemory(device)

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs.get("trainer")
        device = getattr(getattr(trainer, "ctx", None), "device", None)
        if device is not None:
            self.meter = PeakMemory(device)

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.meter.begin_step()

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        peaks = self.meter.end_step()
        metrics = kwargs.get("metrics")
        if isinstance(metrics, dict):
            metrics.update(peaks)
            # The log line's "mem" column: this step's peak (allocator on GPU, RSS on CPU).
            metrics["memory_gib"] = (
                peaks.get("peak_allocated_bytes", peaks.get("peak_rss_bytes", 0.0)) / 2**30
            )
        self.last = peaks

    @staticmethod
    def describe(peaks: dict[str, float]) -> str:
        if "peak_allocated_bytes" in peaks:
            return f"peak_mem: {format_bytes(peaks['peak_allocated_bytes'])}"
        return f"peak_rss: {format_bytes(peaks.get('peak_rss_bytes', float('nan')))}"
