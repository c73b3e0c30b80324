"""The typed ``lr_scheduler`` section: one pydantic schema per scheduler ``type``.

Each schema lists the keys its scheduler takes (the parameters of the original's ``__init__``),
typed and range-checked by :mod:`lmforge.lr.keys`; an unknown key is refused (the original silently
ignores it, so a typo would change nothing). What depends on the number of steps (ratios, the WSD
decay start, the YAML's own ``total_steps``) is resolved by :meth:`SchedulerSpec.schedule`, which
turns the validated keys into a :class:`~lmforge.lr.schedules.Schedule` for a given total — the
typed section carries its fields, so a schedule for another total is another call, not a re-parse.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, PrivateAttr, ValidationInfo, model_validator

from lmforge.errors import ConfigError
from lmforge.lr import schedules as s
from lmforge.lr.keys import (
    KeyProblem,
    LearningRate,
    Number,
    PositiveInt,
    Ratio,
    Steps,
    TotalSteps,
    floor_ratio_of,
)
from lmforge.utils.logging import get_logger

log = get_logger("lr")

# LrSchedulerConfig.learning_rate's default in the original.
DEFAULT_LEARNING_RATE = 1e-5
# The "lr is 0 everywhere" warning looks at this many steps at most (a longer run is the same curve).
_ZERO_LR_PROBE_STEPS = 10_000


class SchedulerSpec(BaseModel):
    """What every scheduler schema shares: its ``type``, the YAML's optional ``total_steps`` (which must
    equal training.steps), the dotted path it was validated under, and :meth:`schedule`."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: str
    total_steps: TotalSteps | None = None

    # The message for a required key that is not set, per key ("{type}" is the scheduler's name).
    missing: ClassVar[dict[str, str]] = {}

    # The dotted path of this section (``lr_scheduler``, or ``lr_scheduler.base_lr`` when nested),
    # for messages about its keys; the schema passes it as the validation context.
    _path: str = PrivateAttr(default="lr_scheduler")

    @model_validator(mode="after")
    def _remember_path(self, info: ValidationInfo) -> SchedulerSpec:
        self._path = (info.context or {}).get("path", "lr_scheduler")
        return self

    @classmethod
    def accepted_keys(cls) -> tuple[str, ...]:
        """The keys this scheduler takes besides ``type`` and ``total_steps``, in the original's order."""
        return tuple(k for k in cls.model_fields if k not in ("type", "total_steps"))

    def dotted(self, key: str) -> str:
        return f"{self._path}.{key}"

    def error(self, key: str, reason: str) -> ConfigError:
        return ConfigError(f"{self.dotted(key)}: {reason}")

    def schedule(self, total_steps: int) -> s.Schedule:
        """The schedule over ``total_steps`` (training.steps); settings that have no effect there are
        listed in ``schedule.warnings`` (not logged). A ConfigError names the key when the settings
        cannot work for this total."""
        if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
            raise ConfigError(f"training.steps must be a whole number of steps >= 0, got {total_steps!r}.")
        if self.total_steps is not None and self.total_steps != total_steps:
            raise self.error(
                "total_steps",
                f"is {self.total_steps!r} but training.steps is {total_steps}. The scheduler's total always comes "
                f"from training.steps (the original silently overrides this key); remove "
                f"{self.dotted('total_steps')} or make it equal to training.steps.",
            )
        notes: list[str] = []
        schedule = self._resolve(total_steps, notes)
        probe = range(min(total_steps, _ZERO_LR_PROBE_STEPS) + 1)
        if schedule.base_lr == 0 and max((schedule.lr_at(k) for k in probe), default=0) == 0:
            notes.append(
                f"{self._path}: the learning rate is 0 at every step, so no parameter will change (the loss "
                f"stays flat); set {self._path}.learning_rate (or base_lr) to the peak lr you want."
            )
        if notes:
            schedule = dataclasses.replace(schedule, warnings=(*schedule.warnings, *notes))
        return schedule

    def check_against_training(self, total_steps: int) -> None:
        """What ``load_config`` checks once training.steps is known: the schedule can be made over it.
        Its warnings are logged (load_config collects them into ``cfg.warnings``)."""
        for note in self.schedule(total_steps).warnings:
            log.warning("%s", note)

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        raise NotImplementedError

    def _note_unused_learning_rate(self, used_instead: str, value: float | None, notes: list[str]) -> None:
        """These schedulers take their base lr elsewhere; an explicit, different learning_rate has no effect."""
        lr = getattr(self, "learning_rate", None)
        if lr is None or lr in (DEFAULT_LEARNING_RATE, value):
            return
        notes.append(
            f"{self.dotted('learning_rate')} ({lr}) has no effect on {self.type}: its base lr is "
            f"{self.dotted(used_instead)}."
        )


# -- the warm-up family ----------------------------------------------------------------------------


class _WarmUpSpec(SchedulerSpec):
    """learning_rate plus warmup_steps / warmup_ratio / warmup_lr_init (the ratio wins, as in the
    original's _get_lr_steps)."""

    learning_rate: LearningRate = DEFAULT_LEARNING_RATE
    warmup_steps: Steps("warmup") | None = None
    warmup_ratio: Ratio("warmup") | None = None
    warmup_lr_init: LearningRate = 0.0

    def _warmup(self, total: int, notes: list[str]) -> dict[str, Any]:
        steps = self.warmup_steps or 0
        if self.warmup_ratio is not None:
            if self.warmup_steps is not None:
                notes.append(
                    f"{self.dotted('warmup_steps')} ({steps}) is ignored: {self.dotted('warmup_ratio')} is also "
                    f"set and wins, giving {floor_ratio_of(self.warmup_ratio, total)} warm-up steps."
                )
            steps = floor_ratio_of(self.warmup_ratio, total)
        if steps > total:
            notes.append(
                f"the warm-up ({steps} steps) is longer than training.steps ({total}): the lr never reaches "
                f"{self.dotted('learning_rate')}."
            )
        return {"base_lr": self.learning_rate, "total_steps": total, "warmup_steps": steps,
                "warmup_lr_init": self.warmup_lr_init}  # fmt: skip

    def _decay_steps(self, total: int, default: int, notes: list[str]) -> int:
        """decay_steps (at least 1) or, where the scheduler takes it, decay_ratio (which wins)."""
        steps: int | None = getattr(self, "decay_steps", None)
        resolved = max(1, steps) if steps is not None else default
        ratio: float | None = getattr(self, "decay_ratio", None)
        if ratio is not None:
            if steps is not None:
                notes.append(
                    f"{self.dotted('decay_steps')} ({steps}) is ignored: {self.dotted('decay_ratio')} is also "
                    f"set and wins."
                )
            resolved = floor_ratio_of(ratio, total)
        return resolved

    def _require_above_lr_end(self, lr_end: float) -> None:
        if not self.learning_rate > lr_end:
            raise KeyProblem(
                "lr_end",
                f"lr_end ({lr_end}) must be smaller than initial lr ({self.learning_rate}), i.e. "
                f"{self.dotted('learning_rate')}: {self.type} decays from the initial lr down to lr_end.",
            )


class ConstantWarmUpLRSpec(_WarmUpSpec):
    type: Literal["ConstantWarmUpLR"]

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        return s.ConstantWarmUpLR(**self._warmup(total, notes))


class LinearWithWarmUpLRSpec(_WarmUpSpec):
    type: Literal["LinearWithWarmUpLR"]

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        return s.LinearWithWarmUpLR(**self._warmup(total, notes))


class CosineWithWarmUpLRSpec(_WarmUpSpec):
    type: Literal["CosineWithWarmUpLR"]
    num_cycles: Number("a number of cycles") = 0.5
    lr_end: LearningRate = 0.0
    decay_steps: Steps("decay") | None = None
    decay_ratio: Ratio("decay") | None = None

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        warmup = self._warmup(total, notes)
        decay_steps = self._decay_steps(total, max(1, total), notes)
        if warmup["warmup_steps"] > decay_steps:
            notes.append(
                f"the warm-up ({warmup['warmup_steps']} steps) is longer than the decay ({decay_steps} steps, "
                f"{self.dotted('decay_steps')} / {self.dotted('decay_ratio')}): from step {decay_steps} on the lr "
                f"is lr_end, so it never reaches {self.dotted('learning_rate')} (the loss may not decrease)."
            )
        return s.CosineWithWarmUpLR(
            **warmup, num_cycles=self.num_cycles, lr_end=self.lr_end, decay_steps=decay_steps
        )


class CosineWithRestartsAndWarmUpLRSpec(_WarmUpSpec):
    type: Literal["CosineWithRestartsAndWarmUpLR"]
    # The spec: at least one whole cycle (below 1 the "restarts" schedule never restarts).
    num_cycles: Number("a number of cycles", minimum=1.0) = 1.0
    lr_end: LearningRate = 0.0
    decay_steps: Steps("decay") | None = None

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        return s.CosineWithRestartsAndWarmUpLR(
            **self._warmup(total, notes),
            num_cycles=self.num_cycles,
            lr_end=self.lr_end,
            decay_steps=self._decay_steps(total, max(1, total), notes),
        )


class PolynomialWithWarmUpLRSpec(_WarmUpSpec):
    type: Literal["PolynomialWithWarmUpLR"]
    lr_end: LearningRate = 1e-7
    # A negative power would divide by zero where the decay ends.
    power: Number("a power") = 1.0
    decay_steps: Steps("decay") | None = None

    @model_validator(mode="after")
    def _decays(self) -> PolynomialWithWarmUpLRSpec:
        self._require_above_lr_end(self.lr_end)
        return self

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        warmup = self._warmup(total, notes)
        return s.PolynomialWithWarmUpLR(
            **warmup,
            lr_end=self.lr_end,
            power=self.power,
            decay_steps=self._decay_steps(total, max(1, total - warmup["warmup_steps"]), notes),
        )


class WarmUpStableDecayLRSpec(_WarmUpSpec):
    type: Literal["WarmUpStableDecayLR"]
    lr_end: LearningRate = 1e-7
    decay_start_steps: Steps("decay_start") | None = None
    decay_start_ratio: Ratio("decay_start") | None = None

    @model_validator(mode="after")
    def _decays(self) -> WarmUpStableDecayLRSpec:
        self._require_above_lr_end(self.lr_end)
        if self.decay_start_steps is None and self.decay_start_ratio is None:
            raise KeyProblem(
                "decay_start_steps",
                "The type of decay_start_step must be int, but got <class 'NoneType'>. WarmUpStableDecayLR needs "
                f"the step where its decay begins: set {self.dotted('decay_start_steps')} (a step) or "
                f"{self.dotted('decay_start_ratio')} (a fraction of training.steps).",
            )
        return self

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        ratio, steps = self.decay_start_ratio, self.decay_start_steps
        if ratio is not None:
            if steps is not None:
                notes.append(
                    f"{self.dotted('decay_start_steps')} ({steps}) is ignored: "
                    f"{self.dotted('decay_start_ratio')} is also set and wins."
                )
            decay_start = floor_ratio_of(ratio, total)
            key, origin = (
                "decay_start_ratio",
                f"{self.dotted('decay_start_ratio')} ({ratio}) x training.steps ({total})",
            )
        else:
            assert steps is not None  # _decays refused neither being set
            decay_start, key, origin = (
                steps,
                "decay_start_steps",
                f"{self.dotted('decay_start_steps')} ({steps})",
            )
        if decay_start >= total:
            raise self.error(
                key,
                f"the decay would start at step {decay_start} = {origin}, not before training.steps ({total}); "
                f"the decay runs from there to training.steps, so its length would be {total - decay_start} "
                f"steps (the original divides by it). Start the decay before step {total}.",
            )
        return s.WarmUpStableDecayLR(
            **self._warmup(total, notes), lr_end=self.lr_end, decay_start=decay_start
        )


class ConstantWithCoolDownLRSpec(_WarmUpSpec):
    type: Literal["ConstantWithCoolDownLR"]
    keep_steps: Steps("keep") = 0
    decay_steps: Steps("decay") | None = None
    decay_ratio: Ratio("decay") | None = None
    num_cycles: Number("a number of cycles") = 0.5
    lr_end1: LearningRate = 0.0
    final_steps: Steps("final") = 0
    # Unset means lr_end1. The original's ``lr_end2 or lr_end1`` also turned an explicit 0 into
    # lr_end1; here 0 means 0.
    lr_end2: LearningRate | None = None

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        return s.ConstantWithCoolDownLR(
            **self._warmup(total, notes),
            keep_steps=self.keep_steps,
            decay_steps=self._decay_steps(total, max(1, total), notes),
            num_cycles=self.num_cycles,
            lr_end1=self.lr_end1,
            final_steps=self.final_steps,
            lr_end2=self.lr_end1 if self.lr_end2 is None else self.lr_end2,
        )


# -- schedulers that name their base lr base_lr ----------------------------------------------------


_BASE_LR_REQUIRED = (
    "{type} requires base_lr, its base learning rate (this scheduler names it base_lr, not learning_rate, "
    "which it does not use)."
)


class CosineAnnealingLRSpec(SchedulerSpec):
    type: Literal["CosineAnnealingLR"]
    base_lr: LearningRate
    t_max: PositiveInt("Expected positive integer T_max, but got {value}")
    eta_min: LearningRate = 0.0
    # Accepted (the section always carries it) but not used: see _note_unused_learning_rate.
    learning_rate: LearningRate | None = None

    missing: ClassVar[dict[str, str]] = {
        "base_lr": _BASE_LR_REQUIRED,
        "t_max": "{type} requires t_max, a positive integer; it is not set.",
    }

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        self._note_unused_learning_rate("base_lr", self.base_lr, notes)
        return s.CosineAnnealingLR(
            base_lr=self.base_lr, total_steps=total, t_max=self.t_max, eta_min=self.eta_min
        )


class CosineAnnealingWarmRestartsSpec(SchedulerSpec):
    type: Literal["CosineAnnealingWarmRestarts"]
    base_lr: LearningRate
    t_0: PositiveInt("Expected positive integer t_0, but got {value}")
    t_mult: PositiveInt("Expected positive integer t_mult, but got {value}") = 1
    eta_min: LearningRate = 0.0
    learning_rate: LearningRate | None = None

    missing: ClassVar[dict[str, str]] = {
        "base_lr": _BASE_LR_REQUIRED,
        "t_0": "{type} requires t_0, a positive integer; it is not set.",
    }

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        self._note_unused_learning_rate("base_lr", self.base_lr, notes)
        return s.CosineAnnealingWarmRestarts(
            base_lr=self.base_lr, total_steps=total, t_0=self.t_0, t_mult=self.t_mult, eta_min=self.eta_min
        )


_NESTED_SCHEDULER = (
    "LearningRateWiseLayer needs base_lr: the schedule it scales, written as a nested lr_scheduler mapping "
    "(e.g. {{type: CosineWithWarmUpLR, learning_rate: 3.e-4, warmup_ratio: 0.01}}); got {got}."
)


def _nested_scheduler(value: Any, info: ValidationInfo) -> SchedulerSpec:
    """LearningRateWiseLayer's base_lr: a whole lr_scheduler mapping, validated under its own path."""
    from lmforge.lr.schema import validate_scheduler  # the union of all schemas, this one included

    path = f"{(info.context or {}).get('path', 'lr_scheduler')}.base_lr"
    if isinstance(value, SchedulerSpec):
        return value
    if not isinstance(value, dict):
        raise ValueError(_NESTED_SCHEDULER.format(got=repr(value)))
    return validate_scheduler(value, path)


class LearningRateWiseLayerSpec(SchedulerSpec):
    type: Literal["LearningRateWiseLayer"]
    base_lr: Annotated[SchedulerSpec, BeforeValidator(_nested_scheduler)]
    lr_scale: Number("a multiplier")
    learning_rate: LearningRate | None = None

    missing: ClassVar[dict[str, str]] = {
        "base_lr": _NESTED_SCHEDULER.format(got=None),
        "lr_scale": "LearningRateWiseLayer requires lr_scale, the multiplier (a number >= 0).",
    }

    def _resolve(self, total: int, notes: list[str]) -> s.Schedule:
        inner = self.base_lr.schedule(total)
        self._note_unused_learning_rate("base_lr.learning_rate", None, notes)
        return s.LearningRateWiseLayer(
            base_lr=self.lr_scale * inner.base_lr,
            total_steps=total,
            inner=inner,
            lr_scale=self.lr_scale,
            warnings=inner.warnings,
        )


SPEC_CLASSES: tuple[type[SchedulerSpec], ...] = (
    ConstantWarmUpLRSpec,
    LinearWithWarmUpLRSpec,
    CosineWithWarmUpLRSpec,
    CosineWithRestartsAndWarmUpLRSpec,
    PolynomialWithWarmUpLRSpec,
    WarmUpStableDecayLRSpec,
    ConstantWithCoolDownLRSpec,
    CosineAnnealingLRSpec,
    CosineAnnealingWarmRestartsSpec,
    LearningRateWiseLayerSpec,
)
# The registered types, by their YAML name.
SCHEDULER_TYPES: dict[str, type[SchedulerSpec]] = {
    cls.model_fields["type"].annotation.__args__[0]: cls for cls in SPEC_CLASSES
}
