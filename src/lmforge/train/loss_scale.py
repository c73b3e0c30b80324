"""Dynamic loss scaling for float16 compute (the article's "NaN with fp16" row).

fp16 has 5 exponent bits: gradients below ~6e-8 flush to zero. The step multiplies the loss by
``scale`` before backward, so small gradients stay representable, and divides the gradients by it
before clipping and the update. A gradient that overflows (inf/NaN) skips the update and halves the
scale; after ``growth_interval`` updates in a row without overflow the scale doubles. The defaults are
torch.amp.GradScaler's, except the growth interval (1000 instead of 2000, as Megatron's). bf16 and
fp32 have fp32's exponent range and need none of this.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class LossScaler:
    scale: float = 2.0**16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 1000
    good_steps: int = 0  # updates since the last overflow or growth

    def update(self, overflow: bool) -> None:
        """After a step: back off on overflow, grow after ``growth_interval`` clean updates."""
        if overflow:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The scale and its progress come from the checkpoint; the policy is this run's.
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
