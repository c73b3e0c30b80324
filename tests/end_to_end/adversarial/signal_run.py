"""Tiny training runs that send themselves SIGTERM at one phase (for test_data_loss.py).

PYTHONPATH=src:tests python -m end_to_end.adversarial.signal_run PHASE[,PHASE...] DIR STEPS

PHASE: begin (start of the run), step (inside step 3, before its save), final-save (at the start of
the last checkpoint save): each runs in DIR/PHASE, one after the other in this process; build
(before the trainer is built: through ``lmforge train``, with DIR the train.yaml).
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

from lmforge.train import checkpoint as ckpt_mod
from lmforge.train.callbacks import TrainerCallback


def _term() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


class TermAt(TrainerCallback):
    order = 10

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_train_begin(self, args, state, **kwargs):
        if self.phase == "begin":
            _term()

    def on_step_begin(self, args, state, **kwargs):
        if self.phase == "step" and state.global_step == 2:  # the step that becomes step 3
            _term()


def _build_phase(config: Path, steps: int) -> int:
    from lmforge.cli import main as cli_main
    from lmforge.train import builder

    real_build = builder.build_trainer

    def build(*args, **kwargs):
        _term()
        return real_build(*args, **kwargs)

    builder.build_trainer = build
    return cli_main(["train", "--config", str(config), "--set", f"training.steps={steps}"])


def main() -> int:
    phases, root, steps = sys.argv[1].split(","), Path(sys.argv[2]), int(sys.argv[3])
    if phases == ["build"]:
        return _build_phase(root, steps)
    from train.conftest import tiny_config, tiny_trainer

    real_save = ckpt_mod.CheckpointManager.save
    for phase in phases:

        def save(self, target, step, phase=phase):
            if phase == "final-save" and step == steps:
                _term()
            return real_save(self, target, step)

        ckpt_mod.CheckpointManager.save = save
        checkpoint = {"save_interleaved_steps": 2, "save_max": 10}
        cfg = tiny_config(root / phase, training={"steps": steps}, checkpoint=checkpoint)
        trainer = tiny_trainer(cfg, callbacks=[TermAt(phase)])
        trainer.fit()
        print(f"{phase}: {trainer.stop_agreement.reason}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
