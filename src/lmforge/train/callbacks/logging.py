"""The per-step log line and the end-of-run summary."""

from __future__ import annotations

import math
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.registry import register_callback
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train")


def format_step_line(m: dict[str, Any], max_steps: int) -> str:
    """``step: [  k/  n] | consumed_samples: ... | loss: ... | ...``: fixed widths so columns align."""
    width = len(str(max_steps))
    parts = [
        f"step: [{m['step']:>{width}}/{max_steps:>{width}}]",
        f"consumed_samples: {m['consumed_samples']:>{len(str(max_steps)) + 4}}",
        f"global_batch_size: {m['global_batch_size']:>4}",
        f"loss: {_num(m['loss'], '10.6f')}",
    ]
    for name, value in m.get("aux_losses", {}).items():
        parts.append(f"{name}: {_num(value, '10.6f')}")
    parts += [
        f"lr: {m['lr']:.6e}",
        f"grad_norm: {_num(m['grad_norm'], '10.6f')}",
        *([f"loss_scale: {m['loss_scale']:g}"] if m.get("loss_scale") is not None else []),
        f"per_step_time: {m['step_time'] * 1000:>7.0f}ms",
        f"throughput: {m['tflops_per_device']:6.2f}T",
        f"tokens/s: {m['tokens_per_s']:>9.0f}",
        f"mfu: {_pct(m.get('mfu'))}",
        f"mem: {m['memory_gib']:6.2f}GiB",
    ]
    line = " | ".join(parts)
    if m.get("skipped"):
        line += f" | SKIPPED: {m['skip_reason']}"
    return line


def _num(x: float | None, fmt: str) -> str:
    if x is None or not math.isfinite(x):
        return f"{x!s:>10}"
    return format(x, fmt)


def _pct(x: float | None) -> str:
    return "   n/a" if x is None else f"{100 * x:5.2f}%"


@register_callback("LossCallback")
class LoggingCallback(TrainerCallback):
    """Logs one aligned line per step (every ``log_interval`` steps; skipped steps always)."""

    order = 20

    def __init__(self, log_interval: int = 1) -> None:
        self.log_interval = max(int(log_interval), 1)

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        m = kwargs["metrics"]
        if m.get("skipped"):
            logger.warning(
                "Step %d: update skipped (%s); %d consecutive skip(s).",
                m["step"],
                m["skip_reason"],
                state.consecutive_skips,
            )
        if (
            state.global_step % self.log_interval == 0
            or state.global_step == state.max_steps
            or m.get("skipped")
        ):
            logger.info(format_step_line(m, state.max_steps))


def format_summary(summary: dict) -> str:
    width = max(len(k) for k in summary)
    return "\n".join(["Training summary:"] + [f"  {k:<{width}} : {v}" for k, v in summary.items()])
