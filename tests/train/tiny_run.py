"""Run the tiny trainer in a subprocess (for kill / signal / resume tests).

PYTHONPATH=tests python -m train.tiny_run DIR STEPS [--load] [--async] [--kill-after K] [--sigterm-after K]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import torch

from lmforge.train.callbacks import TrainerCallback

from .conftest import tiny_config, tiny_trainer


class SignalAt(TrainerCallback):
    order = 85  # after the checkpoint callback of the same step

    def __init__(self, step: int, sig: int) -> None:
        self.step, self.sig = step, sig

    def on_step_end(self, args, state, **kwargs):
        if state.global_step == self.step:
            os.kill(os.getpid(), self.sig)


def train_tiny(
    root: Path,
    steps: int,
    *,
    load: bool = False,
    async_save: bool = False,
    interval: int = 2,
    callbacks: list | None = None,
):
    cfg = tiny_config(
        root,
        training={"steps": steps},
        checkpoint={
            "save_interleaved_steps": interval,
            "async_save": async_save,
            "load_path": str(root / "ckpt") if load else "",
            "save_max": 10,
        },
    )
    trainer = tiny_trainer(cfg, callbacks=callbacks)
    trainer.fit()
    torch.save(trainer.model.state_dict(), root / "final_weights.pt")
    return trainer


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("dir")
    p.add_argument("steps", type=int)
    p.add_argument("--load", action="store_true")
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--kill-after", type=int)
    p.add_argument("--sigterm-after", type=int)
    p.add_argument("--interval", type=int, default=2)
    a = p.parse_args()
    callbacks = []
    if a.kill_after:
        callbacks.append(SignalAt(a.kill_after, signal.SIGKILL))
    if a.sigterm_after:
        callbacks.append(SignalAt(a.sigterm_after, signal.SIGTERM))
    train_tiny(
        Path(a.dir), a.steps, load=a.load, async_save=a.async_save, interval=a.interval, callbacks=callbacks
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
