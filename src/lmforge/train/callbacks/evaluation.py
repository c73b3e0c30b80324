"""Validation every ``eval_interval`` steps: val loss and perplexity in the log, metrics and TensorBoard."""

from __future__ import annotations

import time
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.validation import EvalResult, build_eval_loader, eval_settings, evaluate
from lmforge.utils.logging import get_logger

log = get_logger("lmforge.train.callbacks.evaluation")


class EvaluationCallback(TrainerCallback):
    """Runs :func:`lmforge.train.callbacks.validation.evaluate` on the validation split.

    ``loader_factory`` (tests, custom data) returns an iterable of batches; by default the
    validation loader of ``eval_dataset`` / ``train_dataset`` is built at train begin.
    """

    order = 25  # after the step's log line; before TensorBoard (40) and metrics.jsonl (90)

    def __init__(self, interval: int, steps: int | None = None, loader_factory: Any = None) -> None:
        self.interval = interval
        self.steps = steps
        self.loader_factory = loader_factory
        self.loader: Any = None
        self.history: list[tuple[int, EvalResult]] = []

    @classmethod
    def from_config(cls, config: Any) -> EvaluationCallback | None:
        settings = eval_settings(config)
        return cls(settings.interval, settings.steps) if settings.interval > 0 else None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.loader_factory is not None:
            self.loader = self.loader_factory()
            return
        ctx = getattr(kwargs.get("trainer"), "ctx", None)
        self.loader = build_eval_loader(
            args, dp_rank=getattr(ctx, "dp_rank", 0), dp_size=getattr(ctx, "dp_size", 1)
        )

    def run(self, model: Any, kwargs: dict[str, Any]) -> EvalResult:
        ctx = getattr(kwargs.get("trainer"), "ctx", None)
        return evaluate(
            model,
            self.loader,
            max_batches=self.steps,
            device=getattr(ctx, "device", None),
            group=getattr(ctx, "dp_group", None),
            pipeline=getattr(ctx, "pipeline", None),
        )

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        step = int(state.global_step)
        if self.loader is None or self.interval <= 0 or step % self.interval != 0:
            return
        model = kwargs.get("model")
        model = model[0] if isinstance(model, (list, tuple)) else model
        start = time.perf_counter()
        result = self.run(model, kwargs)
        self.history.append((step, result))
        log.info(
            "validation: step %d, val_loss: %.6f, val_ppl: %.4f, tokens: %d, batches: %d, time: %.1fs",
            step,
            result.loss,
            result.perplexity,
            result.tokens,
            result.batches,
            time.perf_counter() - start,
        )
        metrics = kwargs.get("metrics")
        if isinstance(metrics, dict):
            metrics.update(result.as_metrics())
