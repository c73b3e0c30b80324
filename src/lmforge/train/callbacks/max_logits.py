"""``MaxLogitsMonitor``: per-layer maximum attention logits in the log.

Every ``step_interval`` steps it logs, for each attention layer, the maximum pre-softmax logit of
every head seen during the step (all micro-batches), then the mean and the maximum over all heads:

    step:[    4/  100] max_attention_logit/decoder.layers.0.self_attention: [12.31, 9.874, ...]
    step:[    4/  100] max_attention_logit/mean: 10.52
    step:[    4/  100] max_attention_logit/max: 12.31

(4 significant digits, as the original.) ``max_attention_logit`` (the maximum) also goes into the
step's metrics. The model must provide ``qk_clip_layers()``, ``track_max_logits`` and
``reset_max_logits()``. The values are read after every training forward, because an optimizer with
QK-Clip (Muon) consumes and resets them inside its step; the running maximum is reset at the end of
every step.
"""

from __future__ import annotations

from typing import Any

import torch

from lmforge.errors import ConfigError
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.registry import register_callback
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.train.callbacks.max_logits")


def _sig4(x: float) -> str:
    return f"{x:.4g}"


@register_callback("MaxLogitsMonitor")
class MaxLogitsMonitor(TrainerCallback):
    order = 30

    def __init__(self, step_interval: int = 1) -> None:
        if isinstance(step_interval, bool) or not isinstance(step_interval, int) or step_interval <= 0:
            raise ConfigError(f"step_interval must be a positive int, got {step_interval!r}.")
        self.step_interval = step_interval
        self.model: Any = None
        self._layers: list[Any] = []
        self._step_max: dict[str, torch.Tensor] = {}
        self._handle: Any = None
        self.last: dict[str, list[float]] = {}

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        model = model[0] if isinstance(model, (list, tuple)) else model
        if not callable(getattr(model, "qk_clip_layers", None)):
            raise ConfigError(
                "callbacks: MaxLogitsMonitor needs a model that tracks attention logits (qk_clip_layers(), "
                f"track_max_logits); {type(model).__name__} does not"
            )
        self.model = model
        model.track_max_logits = True
        self._layers = list(model.qk_clip_layers())
        self._handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        for layer in self._layers:
            current = layer.max_logits.detach().float().cpu().clone()
            previous = self._step_max.get(layer.name)
            self._step_max[layer.name] = current if previous is None else torch.maximum(previous, current)

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self._step_max = {}

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if self._step_max and step % self.step_interval == 0:
            total = int(getattr(state, "max_steps", 0) or 0)
            prefix = f"step:[{step:5d}/{total:5d}]"
            every = []
            self.last = {}
            for name, values in self._step_max.items():
                vals = [float(v) for v in values.reshape(-1)]
                self.last[name] = vals
                every.extend(vals)
                log.info("%s max_attention_logit/%s: [%s]", prefix, name, ", ".join(_sig4(v) for v in vals))
            if every:
                mean, peak = sum(every) / len(every), max(every)
                log.info("%s max_attention_logit/mean: %s", prefix, _sig4(mean))
                log.info("%s max_attention_logit/max: %s", prefix, _sig4(peak))
                metrics = kwargs.get("metrics")
                if isinstance(metrics, dict):
                    metrics["max_attention_logit"] = peak
        if self.model is not None:
            self.model.reset_max_logits()
        self._step_max = {}

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


@register_callback("MaxLogitsReset")
class MaxLogitsReset(TrainerCallback):
    """Deprecated in the original (MaxLogitsMonitor resets every step); kept so old YAMLs load."""

    order = 31

    def __init__(self, **kwargs: Any) -> None:
        log.warning(
            "callbacks: MaxLogitsReset is deprecated; MaxLogitsMonitor resets the running maximum itself"
        )
        self.model: Any = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        model = kwargs.get("model")
        self.model = model[0] if isinstance(model, (list, tuple)) else model

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        reset = getattr(self.model, "reset_max_logits", None)
        if callable(reset):
            reset()
