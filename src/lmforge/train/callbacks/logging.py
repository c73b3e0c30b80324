"""The per-step log line and the end-of-run summary."""

from __future__ import annotations

import math
import time
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.registry import register_callback
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train")


def format_step_line(m: dict[str, Any], max_steps: int, progress: dict[str, Any] | None = None) -> str:
    """``step: [  k/  n] | consumed_samples: ... | loss: ... | ...``: fixed widths so columns align.
    ``progress`` (from :class:`RunClock`) adds the epoch, the time since the start and the estimate
    of the time left."""
    width = len(str(max_steps))
    progress = progress or {}
    parts = [
        f"step: [{m['step']:>{width}}/{max_steps:>{width}}]",
        *([f"epoch: {progress['epoch']}"] if progress.get("epoch") is not None else []),
        *([f"elapsed: {progress['elapsed']}", f"eta: {progress['eta']}"] if "elapsed" in progress else []),
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
        *([f"throughput: {_flops(m['tflops_per_device'])}"] if m.get("tflops_per_device") else []),
        f"tokens/s: {m['tokens_per_s']:>9.0f}",
        f"mfu: {_pct(m.get('mfu'))}",
        f"mem: {m['memory_gib']:6.2f}GiB",
    ]
    line = " | ".join(parts)
    if m.get("skipped"):
        line += f" | SKIPPED: {m['skip_reason']}"
    return line


def _flops(tflops: float) -> str:
    """FLOP/s per device with a unit that shows its digits (a CPU's 0.01 TFLOP/s is 10.0G, not 0.00T)."""
    for unit, scale in (("P", 1e3), ("T", 1.0), ("G", 1e-3), ("M", 1e-6)):
        if tflops >= scale:
            return f"{tflops / scale:6.2f}{unit}"
    return f"{tflops * 1e9:6.2f}k"


def format_duration(seconds: float) -> str:
    """``1:02:03`` (``2d 1:02:03`` past a day): what the log lines and the summary show."""
    seconds = max(int(round(seconds)), 0)
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    text = f"{hours}:{rest // 60:02d}:{rest % 60:02d}"
    return f"{days}d {text}" if days else text


def readable_number(x: float) -> str:
    """A perplexity or other positive quantity that may be huge: fixed point while short, else
    scientific (``3.2e+11``), ``inf`` / ``nan`` as such."""
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4f}" if abs(x) < 1e5 else f"{x:.4e}"


class RunClock:
    """Elapsed time since this process started training, the estimated time left (from the pace of
    the steps this process ran, the first excluded: it carries compilation and warm-up), and the
    data epoch when the loader knows it (``loader.epoch``, 1-based)."""

    def __init__(self) -> None:
        self.start = self.first_step_end = None
        self.first_step = 0

    def begin(self, step: int) -> None:
        self.start, self.first_step = time.perf_counter(), step

    def progress(self, step: int, max_steps: int, loader: Any = None) -> dict[str, Any]:
        now = time.perf_counter()
        if self.start is None:
            self.begin(step - 1)
        if self.first_step_end is None:
            self.first_step_end = (now, step)
        out: dict[str, Any] = {"elapsed": format_duration(now - self.start)}
        t0, s0 = self.first_step_end
        pace = (now - t0) / (step - s0) if step > s0 else (now - self.start) / max(step - self.first_step, 1)
        out["eta"] = format_duration(pace * max(max_steps - step, 0))
        epoch = getattr(loader, "epoch", None)
        out["epoch"] = epoch if isinstance(epoch, int) else None
        return out


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
        self.clock = RunClock()

    def on_train_begin(self, args: Any, state: Any, **kwargs: Any) -> None:
        self.clock.begin(int(state.global_step))

    def on_step_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        m = kwargs["metrics"]
        progress = self.clock.progress(
            int(state.global_step), int(state.max_steps), kwargs.get("train_dataset")
        )
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
            logger.info(format_step_line(m, state.max_steps, progress))


def format_summary(summary: dict) -> str:
    width = max(len(k) for k in summary)
    return "\n".join(["Training summary:"] + [f"  {k:<{width}} : {v}" for k, v in summary.items()])
