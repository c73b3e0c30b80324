"""When a run needs a rollback: the live doctor's loss-spike and divergence rules, step by step, and more
consecutive non-finite steps than the skip policy absorbs.

Each rule also names the *onset*: the first step whose loss shows the anomaly. The loss of step k is
computed with the weights after update k-1, so the weights after update ``onset - 1`` are already suspect
and the newest safe state is the one after update ``onset - 2`` (docs/training.md, "Recovery").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from statistics import median
from typing import Any

from lmforge.tools.doctor.rules import LOSS_RISE, SPIKE_FACTOR

SPIKE_WINDOW = 10  # the doctor's spike rule: the median of the 10 steps before
SPIKE_MIN_HISTORY = 3  # the doctor judges a spike from the 4th finite loss on
# A divergence is sustained: the median of this many recent losses (the current one included) is above
# LOSS_RISE x the first loss, so one hard batch of a low-loss fine-tuning run does not roll it back.
DIVERGENCE_STEPS = 3


@dataclass(frozen=True)
class Anomaly:
    reason: str  # one line naming the rule and its numbers
    onset: int  # the first step whose loss shows it


class AnomalyDetector:
    """Judges each step's loss against the accepted (finite, applied) losses before it."""

    def __init__(self) -> None:
        self.history: list[tuple[int, float]] = []  # (step, loss) of the steps judged normal
        self.first_loss: float | None = None
        # The lowest of them, kept as they come: every step saves the detector's record, and a min over
        # the whole history each step would grow with the run.
        self.best: tuple[int, float] | None = None

    def observe(
        self, step: int, loss: float, skipped: bool, consecutive_skips: int, skip_limit: int
    ) -> Anomaly | None:
        if skipped:
            if skip_limit > 0 and consecutive_skips >= skip_limit:
                onset = step - consecutive_skips + 1
                return Anomaly(
                    f"{consecutive_skips} consecutive skipped steps (last at step {step}), the skip policy's "
                    f"limit (monitor.health_checkpoint.global_norm_skip_time or 10 non-finite steps)",
                    onset,
                )
            return None  # the skip policy absorbs it: nothing was applied
        if not math.isfinite(loss):
            return None  # (a non-finite loss is always skipped; kept for safety)
        spike = self._spike(step, loss)
        if spike is not None:
            return spike
        recent = [v for _, v in self.history[-(DIVERGENCE_STEPS - 1) :]] + [loss]
        if (
            self.first_loss is not None
            and len(recent) == DIVERGENCE_STEPS
            and median(recent) > LOSS_RISE * self.first_loss
        ):
            best_step, best = self.best if self.best is not None else (step, loss)
            return Anomaly(
                f"divergence: the median loss of steps {step - DIVERGENCE_STEPS + 1}..{step} ({median(recent):.4g}) > "
                f"{LOSS_RISE:g} x the run's first loss {self.first_loss:.4g} (lowest loss {best:.4g} at step {best_step})",
                best_step + 1,
            )
        if self.first_loss is None:
            self.first_loss = loss
        self.history.append((step, loss))
        if self.best is None or loss < self.best[1]:
            self.best = (step, loss)
        return None

    def _spike(self, step: int, loss: float) -> Anomaly | None:
        if len(self.history) < SPIKE_MIN_HISTORY:
            return None
        before = median(v for _, v in self.history[-SPIKE_WINDOW:])
        if loss <= SPIKE_FACTOR * before:
            return None
        return Anomaly(
            f"loss spike: loss {loss:.4g} at step {step} > {SPIKE_FACTOR:g} x the median {before:.4g} of the "
            f"{min(SPIKE_WINDOW, len(self.history))} steps before",
            step,
        )

    def newest_verified_step(self) -> int | None:
        """The newest step whose weights produced a normal loss (the weights after update ``s``)."""
        return self.history[-1][0] - 1 if self.history else None

    def best_step(self) -> int | None:
        """The step of the lowest normal loss: a divergence rolls back to before it."""
        return self.best[0] if self.best is not None else None

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs to judge its first steps as this run would: the first loss, the newest
        normal losses (the spike window) and the lowest one (the divergence rule's onset). Bounded, so a
        long run's checkpoint does not carry every loss."""
        recent = self.history[-SPIKE_WINDOW:]
        return {
            "first_loss": self.first_loss,
            "recent": [[s, v] for s, v in recent],
            "best": None if self.best is None else [self.best[0], self.best[1]],
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s record (a resumed run; an empty record: no history)."""
        first = saved.get("first_loss")
        self.first_loss = None if first is None else float(first)
        pairs = [(int(s), float(v)) for s, v in saved.get("recent") or []]
        best = saved.get("best")
        if best is not None and all(s != int(best[0]) for s, _ in pairs):
            pairs.append((int(best[0]), float(best[1])))
        self.history = sorted(pairs)
        self.best = min(self.history, key=lambda sv: sv[1]) if self.history else None

    def forget_after(self, step: int) -> None:
        """After a rollback to ``step``: the losses of the steps undone are no longer the run's history."""
        self.history = [(s, v) for s, v in self.history if s <= step]
        self.best = min(self.history, key=lambda sv: sv[1]) if self.history else None
