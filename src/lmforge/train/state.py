"""The trainer's progress counters: everything besides tensors that a checkpoint must restore."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

# TrainState.extra[RECOVERY_KEY]: recovery's rollbacks so far, the end of its lowered-lr window and its
# detector's recent losses (train/recovery/), restored with the rest of the state on a resume.
RECOVERY_KEY = "recovery"


@dataclass
class TrainState:
    global_step: int = 0  # optimizer updates done (skipped non-finite steps count too: data was consumed)
    consumed_samples: int = 0  # samples of the training set consumed so far (drives the data position)
    epoch: int = 0
    max_steps: int = 0
    global_batch_size: int = 0  # of the step in progress (changes during batch ramp-up)
    num_accumulation_steps: int = 1
    skipped_steps: int = 0  # updates skipped because of a non-finite or spiking loss / gradient norm
    consecutive_skips: int = 0
    tokens_seen: int = 0  # valid (loss-bearing) tokens over the whole run
    best_loss: float = math.inf
    last_loss: float = math.nan
    loss_scaler: dict[str, Any] = field(default_factory=dict)  # fp16 dynamic loss scale (empty: none)
    extra: dict[str, Any] = field(default_factory=dict)  # room for callbacks (e.g. last saved step)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_dict(self, data: dict[str, Any]) -> None:
        for key, value in data.items():
            if hasattr(self, key):
                setattr(self, key, value)
