"""TensorBoard scalars: loss, lr, grad norm, throughput, MoE / MTP losses, memory, validation.

On by default, in ``<output_dir>/tensorboard`` unless ``monitor.tensorboard.output_dir`` says
otherwise. Every ``log_interval`` steps each scalar is written twice, as in the original: against
the step (``loss``) and against the consumed samples (``loss vs samples``). Only the last rank
writes (with pipeline parallelism it is the one that holds the loss). ``queue_size`` is the
writer's event queue length.

Tags keep the original's names: ``loss``, ``learning-rate``, ``grad-norm``, ``iteration-time``
(seconds), ``throughput`` (model TFLOPS per device, as in the log line),
``tokens-per-second``, ``batch-size``, ``load-balancing-loss``, ``mtp-{k}-loss``, ``mfu``; lmforge adds
``memory/peak-allocated-bytes`` or ``memory/peak-rss-bytes`` and ``val-loss`` / ``val-ppl``.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lmforge.config.load import as_section
from lmforge.train.callbacks.base import TrainerCallback

# metrics keys the trainer computes, and their tags (the original's names where it has one)
_TRAINER_TAGS = {
    "step_time": "iteration-time",
    "tokens_per_s": "tokens-per-second",
    "tflops_per_device": "throughput",
    "mfu": "mfu",
    "global_batch_size": "batch-size",
    "loss_scale": "loss-scale",  # the original's tag; only fp16 runs have a loss scale
}

# metrics keys other callbacks add to the step's metrics, and their tags
_EXTRA_TAGS = {
    "peak_allocated_bytes": "memory/peak-allocated-bytes",
    "peak_reserved_bytes": "memory/peak-reserved-bytes",
    "peak_rss_bytes": "memory/peak-rss-bytes",
    "val_loss": "val-loss",
    "val_ppl": "val-ppl",
    "max_attention_logit": "max-attention-logit",
}


def _is_last_rank() -> bool:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == dist.get_world_size() - 1
    return True


class TensorBoardCallback(TrainerCallback):
    order = 40  # after memory, evaluation and max-logit callbacks have added their metrics

    def __init__(self, section: Any = None, output_dir: str | os.PathLike = ".") -> None:
        cfg = as_section("monitor.tensorboard", section)
        self.log_dir = Path(cfg.output_dir or Path(output_dir) / "tensorboard")
        self.log_interval = int(cfg.log_interval or 1)
        self.queue_size = int(cfg.queue_size or 1000)
        self.writer: Any = None
        self._step_start = 0.0
        self._flops_per_token: float | None = None
        self._world = 1

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        if not _is_last_rank():
            return
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=self.queue_size)
        model = kwargs.get("model")
        model = model[0] if isinstance(model, (list, tuple)) else model
        flops = getattr(model, "flops_per_token", None)
        seq = _seq_length(args)
        if callable(flops):
            try:
                self._flops_per_token = float(flops(seq)) if seq else float(flops())
            except TypeError:
                self._flops_per_token = None
        self._world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1

    def on_step_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self._step_start = time.perf_counter()

    def scalars(self, state: Any, kwargs: dict[str, Any]) -> dict[str, float]:
        step_time = time.perf_counter() - self._step_start
        result = kwargs.get("result")
        out: dict[str, float] = {}
        loss = kwargs.get("loss", getattr(result, "loss", None))
        if loss is not None:
            out["loss"] = float(loss)
        lr = getattr(result, "lr", None)
        if lr is None:
            lr = _lr_of(kwargs.get("optimizer"))
        if lr is not None:
            out["learning-rate"] = float(lr)
        grad_norm = kwargs.get("grad_norm", getattr(result, "grad_norm", None))
        if grad_norm is not None:
            out["grad-norm"] = float(grad_norm)
        out["iteration-time"] = step_time
        out["batch-size"] = float(getattr(state, "global_batch_size", 0) or getattr(result, "samples", 0))
        input_tokens = getattr(result, "input_tokens", None)
        if input_tokens and step_time > 0:
            out["tokens-per-second"] = input_tokens / step_time
            if self._flops_per_token:
                out["throughput"] = self._flops_per_token * input_tokens / (step_time * 1e12 * self._world)
        for name, value in (getattr(result, "aux_losses", None) or {}).items():
            out[name.replace("_", "-")] = float(value)
        metrics = kwargs.get("metrics") or {}
        # The trainer's own measurements, when present, so TensorBoard agrees with the log line.
        for key, tag in _TRAINER_TAGS.items():
            value = metrics.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                out[tag] = float(value)
        for key, value in metrics.items():
            if key in _EXTRA_TAGS and isinstance(value, (int, float)):
                out[_EXTRA_TAGS[key]] = float(value)
        return {k: v for k, v in out.items() if not math.isnan(v)}

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.writer is None:
            return
        step = int(state.global_step)
        metrics = kwargs.get("metrics") or {}
        has_eval = "val_loss" in metrics
        if step % self.log_interval != 0 and not has_eval:
            return
        samples = int(getattr(state, "consumed_samples", 0))
        scalars = self.scalars(state, kwargs)
        if step % self.log_interval != 0:  # an evaluation between logged steps: only its results
            scalars = {k: v for k, v in scalars.items() if k.startswith("val-")}
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, step)
            self.writer.add_scalar(f"{tag} vs samples", value, samples)

    def on_rollback(self, args: Any, state: Any, **kwargs: Any) -> None:
        # A marker at the step where recovery detected the anomaly (train/recovery/): the step it went
        # back to as a scalar, and the whole event as text.
        if self.writer is None:
            return
        event = kwargs["rollback"]
        self.writer.add_scalar("recovery/rollback-to-step", event["to_step"], event["step"])
        self.writer.add_text("recovery/rollback", json.dumps(event), event["step"])
        self.writer.flush()

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None


def _lr_of(optimizer: Any) -> float | None:
    groups = getattr(optimizer, "param_groups", None)
    if not groups:
        return None
    group = groups[0]
    return float(group["lr"]) / float(group.get("lr_scale", 1.0) or 1.0)


def _seq_length(args: Any) -> int | None:
    model = getattr(args, "model", None)
    value = getattr(model, "seq_length", None) if model is not None else None
    return value if isinstance(value, int) else None
