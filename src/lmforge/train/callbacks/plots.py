"""curves.png: loss and learning rate over the steps of the run (from metrics.jsonl)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from lmforge.train.callbacks.base import TrainerCallback
from lmforge.train.callbacks.metrics import read_metrics
from lmforge.train.callbacks.registry import register_callback
from lmforge.utils.atomic import atomic_file
from lmforge.utils.logging import get_logger

logger = get_logger("lmforge.train")


def plot_curves(metrics_file: str | Path, out_file: str | Path) -> bool:
    records = [r for r in read_metrics(metrics_file) if isinstance(r.get("loss"), (int, float))]
    if not records:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    losses = [r["loss"] if math.isfinite(r["loss"]) else float("nan") for r in records]
    ax_loss.plot(steps, losses, label="loss", color="tab:blue")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_lr.plot(steps, [r["lr"] for r in records], color="tab:orange")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("step")
    ax_lr.grid(alpha=0.3)
    fig.tight_layout()
    with atomic_file(out_file) as tmp:  # a crash keeps the previous plot
        fig.savefig(tmp, dpi=100, format=Path(out_file).suffix.lstrip(".") or "png")
    plt.close(fig)
    return True


@register_callback("PlotCallback")
class PlotCallback(TrainerCallback):
    order = 95  # after the metrics file is closed

    def on_train_end(self, args: Any, state: Any, **kwargs: Any) -> None:
        trainer = kwargs["trainer"]
        if trainer.ctx.rank != 0:
            return
        out = Path(trainer.output_dir) / "curves.png"
        if plot_curves(Path(trainer.output_dir) / "metrics.jsonl", out):
            trainer.artifacts["curves"] = str(out)
