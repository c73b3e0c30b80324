"""Trainer callbacks: the base class, the handler, the registry and the built-in callbacks."""

from lmforge.train.callbacks.base import HOOKS, CallbackHandler, TrainerCallback
from lmforge.train.callbacks.checkpointing import CheckpointCallback
from lmforge.train.callbacks.logging import LoggingCallback, format_step_line
from lmforge.train.callbacks.metrics import MetricsCallback, read_metrics
from lmforge.train.callbacks.plots import PlotCallback, plot_curves
from lmforge.train.callbacks.registry import build_callback, register_callback, registered_callbacks

__all__ = [
    "HOOKS",
    "CallbackHandler",
    "CheckpointCallback",
    "LoggingCallback",
    "MetricsCallback",
    "PlotCallback",
    "TrainerCallback",
    "build_callback",
    "format_step_line",
    "plot_curves",
    "read_metrics",
    "register_callback",
    "registered_callbacks",
]
