"""The learning-rate schedules: pure functions of the step, in float64.

One class per registered type of the original (``mindformers/core/lr/lr_schedule.py``), named as
the YAML ``type``. The fields are already resolved and validated (``lmforge.lr.build`` does that
from the YAML keys); ``lr_at(t)`` is the lr for step ``t`` (the update ``t + 1``) and depends on
nothing else, so a resumed run gets exactly the same value.

The per-step formulas follow the original, except where it is wrong (see docs/lr.md,
"Compatibility notes"): WSD gives the base lr before its decay (no 0/0 at step 0), polynomial
and WSD stay at lr_end past their end, restarts past the end give lr_end instead of 0, the
warm-restart cycle is found with integer arithmetic instead of a floating-point logarithm, and
CosineWithWarmUpLR's cosine ends at ``decay_steps`` instead of being cut there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


def _check_step(step: int) -> int:
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"a learning-rate step is a whole number >= 0, got {step!r}")
    return int(step)


def _half_cosine(x: float) -> float:
    """0.5·(1 + cos(π·x)), clipped at 0 as in the original (it only matters for periodic forms)."""
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * x)))


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """Base of all schedules: ``lr_at(step) -> float``; ``base_lr`` is the peak (post-warm-up) lr."""

    base_lr: float
    total_steps: int
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def type_name(self) -> str:
        return type(self).__name__

    def lr_at(self, step: int) -> float:
        return float(self._lr(_check_step(step)))

    def __call__(self, step: int) -> float:
        return self.lr_at(step)

    def _lr(self, t: int) -> float:
        raise NotImplementedError

    def boundaries(self) -> dict[str, int]:
        """Named steps where the shape changes (warm-up end, decay start/end), for plots and checks."""
        return {}

    @property
    def description(self) -> str:
        return f"{self.type_name}: {self._shape()}"

    def _shape(self) -> str:
        raise NotImplementedError


@dataclass(frozen=True, kw_only=True)
class _WithWarmUp(Schedule):
    """Linear warm-up from ``warmup_lr_init`` to ``base_lr`` over ``warmup_steps``, as in the original."""

    warmup_steps: int = 0
    warmup_lr_init: float = 0.0

    def _in_warmup(self, t: int) -> bool:
        return self.warmup_steps != 0 and t < self.warmup_steps

    def _warmup_lr(self, t: int) -> float:
        init = self.warmup_lr_init
        return init + (self.base_lr - init) * t / self.warmup_steps

    def boundaries(self) -> dict[str, int]:
        return {"warm-up end": self.warmup_steps} if self.warmup_steps else {}

    def _warmup_text(self) -> str:
        if not self.warmup_steps:
            return "no warm-up, "
        return f"warm-up {self.warmup_lr_init:g} -> {self.base_lr:g} over steps 0..{self.warmup_steps}, "


@dataclass(frozen=True, kw_only=True)
class ConstantWarmUpLR(_WithWarmUp):
    def _lr(self, t: int) -> float:
        return self._warmup_lr(t) if self._in_warmup(t) else self.base_lr

    def _shape(self) -> str:
        return f"{self._warmup_text()}then constant {self.base_lr:g}"


@dataclass(frozen=True, kw_only=True)
class LinearWithWarmUpLR(_WithWarmUp):
    """Linear decay to 0 at ``total_steps`` (the original has no lr_end here)."""

    def _lr(self, t: int) -> float:
        if self._in_warmup(t):
            return self._warmup_lr(t)
        linear_steps = max(1, self.total_steps - self.warmup_steps)
        return self.base_lr * max(0.0, (self.total_steps - t) / linear_steps)

    def boundaries(self) -> dict[str, int]:
        return {**super().boundaries(), "decay end": self.total_steps}

    def _shape(self) -> str:
        return f"{self._warmup_text()}linear {self.base_lr:g} -> 0 at step {self.total_steps}"


@dataclass(frozen=True, kw_only=True)
class CosineWithWarmUpLR(_WithWarmUp):
    """Cosine from base_lr at the end of warm-up to lr_end at ``decay_steps``; lr_end from there on.

    The original measures the cosine over ``total_steps - warmup_steps`` whatever ``decay_steps``
    says, so ``decay_steps < total_steps`` cut the lr from mid-curve to lr_end in one step. Here the
    cosine spans warm-up end .. ``decay_steps`` (identical when ``decay_steps`` is the default,
    ``total_steps``).
    """

    num_cycles: float = 0.5
    lr_end: float = 0.0
    decay_steps: int

    @property
    def cosine_steps(self) -> int:
        return max(1, self.decay_steps - self.warmup_steps)

    def _lr(self, t: int) -> float:
        if t >= self.decay_steps:
            return self.lr_end
        if self._in_warmup(t):
            return self._warmup_lr(t)
        progress = (t - self.warmup_steps) / self.cosine_steps
        return self.lr_end + (self.base_lr - self.lr_end) * _half_cosine(2.0 * self.num_cycles * progress)

    def boundaries(self) -> dict[str, int]:
        return {**super().boundaries(), "lr_end from": self.decay_steps}

    def _shape(self) -> str:
        return (
            f"{self._warmup_text()}cosine {self.base_lr:g} -> {self.lr_end:g} (num_cycles {self.num_cycles:g} "
            f"over {self.cosine_steps} steps), lr_end from step {self.decay_steps}"
        )


@dataclass(frozen=True, kw_only=True)
class CosineWithRestartsAndWarmUpLR(_WithWarmUp):
    """``num_cycles`` cosine cycles, each restarting at base_lr (hard restarts)."""

    num_cycles: float = 1.0
    lr_end: float = 0.0
    decay_steps: int

    def _lr(self, t: int) -> float:
        if t >= self.decay_steps:
            return self.lr_end
        if self._in_warmup(t):
            return self._warmup_lr(t)
        progress = (t - self.warmup_steps) / max(1, self.total_steps - self.warmup_steps)
        if progress >= 1.0:
            # The original returns 0 here (past total_steps when decay_steps > total_steps);
            # lr_end is what every other branch ends at.
            return self.lr_end
        phase = (self.num_cycles * progress) % 1.0
        return self.lr_end + (self.base_lr - self.lr_end) * _half_cosine(phase)

    def boundaries(self) -> dict[str, int]:
        return {**super().boundaries(), "lr_end from": self.decay_steps}

    def _shape(self) -> str:
        return (
            f"{self._warmup_text()}{self.num_cycles:g} cosine cycle(s) {self.base_lr:g} -> {self.lr_end:g} "
            f"with hard restarts, lr_end from step {self.decay_steps}"
        )


@dataclass(frozen=True, kw_only=True)
class PolynomialWithWarmUpLR(_WithWarmUp):
    """``(base - lr_end)·(1 - p)^power + lr_end`` with p = (t - W)/decay_steps, held at lr_end after."""

    lr_end: float = 1e-7
    power: float = 1.0
    decay_steps: int

    def _lr(self, t: int) -> float:
        if self._in_warmup(t):
            return self._warmup_lr(t)
        if t > self.total_steps:
            return self.lr_end
        # The original does not clamp p, so decay_steps < total - warm-up took the lr below lr_end
        # (or to NaN for a fractional power).
        progress = min(1.0, (t - self.warmup_steps) / self.decay_steps)
        return (self.base_lr - self.lr_end) * (1.0 - progress) ** self.power + self.lr_end

    def boundaries(self) -> dict[str, int]:
        return {**super().boundaries(), "decay end": self.warmup_steps + self.decay_steps}

    def _shape(self) -> str:
        return (
            f"{self._warmup_text()}polynomial (power {self.power:g}) {self.base_lr:g} -> {self.lr_end:g} "
            f"over {self.decay_steps} steps, then lr_end"
        )


@dataclass(frozen=True, kw_only=True)
class WarmUpStableDecayLR(_WithWarmUp):
    """Warm-up, constant base_lr, then linear decay to lr_end at total_steps (held after)."""

    lr_end: float = 1e-7
    decay_start: int

    def _lr(self, t: int) -> float:
        if self._in_warmup(t):
            return self._warmup_lr(t)
        if t < self.decay_start:
            # The original computes base·t/t here: 0/0 at step 0 without warm-up.
            return self.base_lr
        progress = min(1.0, (t - self.decay_start) / (self.total_steps - self.decay_start))
        return self.base_lr - (self.base_lr - self.lr_end) * progress

    def boundaries(self) -> dict[str, int]:
        return {**super().boundaries(), "decay start": self.decay_start, "decay end": self.total_steps}

    def _shape(self) -> str:
        return (
            f"{self._warmup_text()}stable {self.base_lr:g} until step {self.decay_start}, linear -> "
            f"{self.lr_end:g} at step {self.total_steps}, then lr_end"
        )


@dataclass(frozen=True, kw_only=True)
class ConstantWithCoolDownLR(_WithWarmUp):
    """DeepSeek-V3 style: warm-up, keep, cosine cool-down to lr_end1, hold lr_end1, then lr_end2."""

    keep_steps: int = 0
    decay_steps: int
    num_cycles: float = 0.5
    lr_end1: float = 0.0
    final_steps: int = 0
    lr_end2: float = 0.0

    def _lr(self, t: int) -> float:
        if self._in_warmup(t):
            return self._warmup_lr(t)
        keep_end = self.warmup_steps + self.keep_steps
        if t < keep_end:
            return self.base_lr
        if t < keep_end + self.decay_steps:
            progress = (t - keep_end) / self.decay_steps
            return self.lr_end1 + (self.base_lr - self.lr_end1) * _half_cosine(
                2.0 * self.num_cycles * progress
            )
        if t < keep_end + self.decay_steps + self.final_steps:
            return self.lr_end1
        return self.lr_end2

    def boundaries(self) -> dict[str, int]:
        keep_end = self.warmup_steps + self.keep_steps
        marks = {
            **super().boundaries(),
            "cool-down start": keep_end,
            "cool-down end": keep_end + self.decay_steps,
        }
        if self.final_steps:
            marks["lr_end2 from"] = keep_end + self.decay_steps + self.final_steps
        return marks

    def _shape(self) -> str:
        keep_end = self.warmup_steps + self.keep_steps
        return (
            f"{self._warmup_text()}constant {self.base_lr:g} until step {keep_end}, cosine -> "
            f"{self.lr_end1:g} over {self.decay_steps} steps, {self.lr_end1:g} for {self.final_steps} steps, "
            f"then {self.lr_end2:g}"
        )


@dataclass(frozen=True, kw_only=True)
class CosineAnnealingLR(Schedule):
    """``eta_min + (base - eta_min)·(1 + cos(π·t/t_max))/2``; periodic past t_max, like torch's."""

    t_max: int
    eta_min: float = 0.0

    def _lr(self, t: int) -> float:
        return self.eta_min + (self.base_lr - self.eta_min) * _half_cosine(t / self.t_max)

    def boundaries(self) -> dict[str, int]:
        return {"t_max": self.t_max}

    def _shape(self) -> str:
        return f"cosine {self.base_lr:g} -> {self.eta_min:g} over {self.t_max} steps (periodic after), no warm-up"


@dataclass(frozen=True, kw_only=True)
class CosineAnnealingWarmRestarts(Schedule):
    """SGDR: cosine cycles of length t_0, t_0·t_mult, t_0·t_mult², ..., each restarting at base_lr."""

    t_0: int
    t_mult: int = 1
    eta_min: float = 0.0

    def cycle(self, t: int) -> tuple[int, int]:
        """(first step of the cycle containing t, its length), exact in integers."""
        if self.t_mult == 1:
            return t - t % self.t_0, self.t_0
        start, length = 0, self.t_0
        while start + length <= t:
            start += length
            length *= self.t_mult
        return start, length

    def _lr(self, t: int) -> float:
        start, length = self.cycle(t)
        return self.eta_min + (self.base_lr - self.eta_min) * _half_cosine((t - start) / length)

    def boundaries(self) -> dict[str, int]:
        """The restarts up to total_steps; none when there are more than 20 (a plot would be a comb)."""
        marks: dict[str, int] = {}
        start, length = 0, self.t_0
        while start + length <= self.total_steps:
            start += length
            length *= self.t_mult
            marks[f"restart {len(marks) + 1}"] = start
            if len(marks) > 20:
                return {}
        return marks

    def _shape(self) -> str:
        return (
            f"cosine {self.base_lr:g} -> {self.eta_min:g} in cycles of {self.t_0} steps "
            f"(each {self.t_mult}x the last), restarting at {self.base_lr:g}, no warm-up"
        )


@dataclass(frozen=True, kw_only=True)
class LearningRateWiseLayer(Schedule):
    """``lr_scale · inner(t)``: a constant multiplier over another schedule."""

    inner: Schedule
    lr_scale: float

    def _lr(self, t: int) -> float:
        return self.lr_scale * self.inner.lr_at(t)

    def boundaries(self) -> dict[str, int]:
        return self.inner.boundaries()

    def _shape(self) -> str:
        return f"{self.lr_scale:g} x ({self.inner.description})"
