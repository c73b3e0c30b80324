"""The observability callbacks a run gets from its config (see docs/observability.md).

Always: per-step peak memory (into the log line's ``mem`` and the metrics) and TensorBoard.
When configured: ``monitor.train_state``, ``monitor.moe_monitor``, ``profiler``, evaluation
(``eval_interval``), the trackers (``monitor.wandb`` / ``monitor.mlflow``) and — as in the original, automatically when the model tracks its maximum
attention logits (QK-Clip) and the YAML lists no ``MaxLogitsMonitor`` — a ``MaxLogitsMonitor``.
On by default: the live training doctor (``monitor.doctor``, see docs/guide.md).
"""

from __future__ import annotations

import os
from typing import Any

from lmforge.config.schema import TrainConfig
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.doctor_live import doctor_callback
from lmforge.train.callbacks.evaluation import BestValidationCallback, EvaluationCallback
from lmforge.train.callbacks.max_logits import MaxLogitsMonitor
from lmforge.train.callbacks.monitor import MemoryCallback, MoeMonitorCallback, TrainStateMonitorCallback
from lmforge.train.callbacks.monitor_hooks import norm_filters
from lmforge.train.callbacks.profiler import ProfilerCallback
from lmforge.train.callbacks.progress import ProgressBarCallback
from lmforge.train.callbacks.tensorboard import TensorBoardCallback
from lmforge.train.callbacks.trackers import tracker_callbacks


def observability_callbacks(
    config: TrainConfig,
    output_dir: str | os.PathLike,
    *,
    model: Any = None,
    device: Any = None,
    rank: int | None = None,
) -> list[TrainerCallback]:
    monitor = config.monitor
    callbacks: list[TrainerCallback] = [
        ProgressBarCallback(),  # on a terminal only
        MemoryCallback(device),
        TensorBoardCallback(monitor.tensorboard, output_dir),
    ]
    train_state = monitor.train_state
    if (
        norm_filters(train_state.local_norm, "monitor.train_state.local_norm") is not None
        or norm_filters(train_state.device_norm, "monitor.train_state.device_norm") is not None
        or train_state.local_loss
        or train_state.device_loss
    ):
        callbacks.append(TrainStateMonitorCallback(train_state, output_dir))
    moe = monitor.moe_monitor
    if moe.save_tokens_per_expert_interval is not None:
        num_layers = getattr(getattr(model, "config", None), "num_layers", None)
        callbacks.append(MoeMonitorCallback(moe, output_dir, num_layers=num_layers))
    profiler = config.profiler
    if profiler.enable_profiling:
        callbacks.append(ProfilerCallback(profiler, output_dir, rank))
    evaluation = EvaluationCallback.from_config(config)
    if evaluation is not None:
        callbacks += [evaluation, BestValidationCallback(output_dir)]
    callbacks.extend(tracker_callbacks(monitor, output_dir))
    listed = [c.type for c in config.callbacks]
    if getattr(model, "track_max_logits", False) and "MaxLogitsMonitor" not in listed:
        callbacks.append(MaxLogitsMonitor())
    doctor = doctor_callback(config, output_dir)  # on unless monitor.doctor.enable is false
    if doctor is not None:
        callbacks.append(doctor)
    return callbacks
