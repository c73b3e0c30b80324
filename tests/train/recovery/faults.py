"""Test-only faults for recovery runs launched from a YAML (``callbacks: [{type: faults.DamageNorm, ...}]``,
with ``LMFORGE_ALLOW_IMPORTS=1`` and this directory on PYTHONPATH)."""

from __future__ import annotations

import torch

from lmforge.train.callbacks import TrainerCallback


class DamageNorm(TrainerCallback):
    """Multiplies the final norm's weights (every rank its own shard) by ``factor`` after update ``step``,
    the first ``times`` times that step is reached: the next loss spikes."""

    order = 70  # before the checkpoint callback (80): the damaged weights are saved, as a real fault's would

    def __init__(self, step: int, factor: float = 50.0, times: int = 1) -> None:
        self.step, self.factor, self.left = int(step), float(factor), int(times)

    def on_step_end(self, args, state, **kwargs):
        if state.global_step != self.step or self.left <= 0:
            return
        self.left -= 1
        model = kwargs["model"]
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "final_layernorm" in name:
                    p.mul_(self.factor)
