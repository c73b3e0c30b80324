"""Validation every ``eval_interval`` steps: val loss and perplexity in the log, metrics and TensorBoard."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from lmforge.config import TrainConfig
from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.logging import readable_number
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
    def from_config(cls, config: TrainConfig) -> EvaluationCallback | None:
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
            "validation: step %d, val_loss: %.6f, val_ppl: %s, tokens: %d, batches: %d, time: %.1fs",
            step,
            result.loss,
            readable_number(result.perplexity),
            result.tokens,
            result.batches,
            time.perf_counter() - start,
        )
        metrics = kwargs.get("metrics")
        if isinstance(metrics, dict):
            metrics.update(result.as_metrics())


BEST_FILE = "best_validation.json"


class BestValidationCallback(TrainerCallback):
    """The best validation loss so far, and its checkpoint, as the Hugging Face Trainer's
    ``best_metric`` / ``best_model_checkpoint``: written to ``<output_dir>/best_validation.json`` at each
    new best, shown in the summary, and that checkpoint is never removed by ``checkpoint.save_max``
    rotation. A best step gets a checkpoint only when one is saved at it (``save_interleaved_steps`` a
    multiple of ``eval_interval``, or the end of the run)."""

    order = 82  # after EvaluationCallback (25) put val_loss in the metrics and CheckpointCallback (80) saved

    def __init__(self, output_dir: Any) -> None:
        self.path = Path(output_dir) / BEST_FILE
        self.best: dict[str, Any] | None = None

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        # A resumed run continues the record of the run it resumes (a fresh start begins a new one).
        step = int(state.global_step)
        if step > 0 and self.path.is_file():
            best = json.loads(self.path.read_text())
            if isinstance(best, dict) and int(best.get("step", step + 1)) <= step:
                self.best = best
                manager = getattr(kwargs.get("trainer"), "checkpoint_manager", None)
                if manager is not None and best.get("checkpoint"):
                    manager.keep = Path(best["checkpoint"])

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        metrics = kwargs.get("metrics") or {}
        loss = metrics.get("val_loss")
        step = int(state.global_step)
        if (
            isinstance(loss, float)
            and math.isfinite(loss)
            and (self.best is None or loss < self.best["val_loss"])
        ):
            self.best = {
                "step": step,
                "val_loss": loss,
                "val_ppl": metrics.get("val_ppl"),
                "checkpoint": None,
            }
            if "checkpoint_save_s" in metrics:  # saved at this very step
                self._keep(kwargs.get("trainer"), step)
            self._write(kwargs.get("trainer"))

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs.get("trainer")
        if self.best is None:
            return
        final = getattr(trainer, "final_save", None)
        if self.best["checkpoint"] is None and final is not None and final[0] == self.best["step"]:
            self._keep(trainer, self.best["step"])
            self._write(trainer)
        where = self.best["checkpoint"] or "no checkpoint was saved at that step"
        if trainer is not None:
            trainer.artifacts["best validation"] = (
                f"val_loss {self.best['val_loss']:.6f} at step {self.best['step']} ({where})"
            )

    def _keep(self, trainer: Any, step: int) -> None:
        manager = getattr(trainer, "checkpoint_manager", None)
        if manager is None:
            return
        from lmforge.train.checkpoint import iteration_dir_name

        manager.keep = manager.save_path / iteration_dir_name(step)
        self.best["checkpoint"] = str(manager.keep)

    def _write(self, trainer: Any) -> None:
        if getattr(getattr(trainer, "ctx", None), "rank", 0) != 0:
            return
        from lmforge.utils.atomic import write_text_atomic

        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.path, json.dumps(self.best, indent=2) + "\n")
