"""``build_scheduler``: from the ``lr_scheduler`` section to a validated schedule.

The registry below lists, per YAML ``type``, the keys that scheduler takes (the parameters of the
original's ``__init__``) and how they resolve to a schedule. All validation happens here, before
any training starts: unknown keys, wrong types, and settings that would give NaN, a negative lr or
a division by zero are refused with a :class:`~lmforge.errors.ConfigError` naming the dotted key.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lmforge.errors import ConfigError
from lmforge.lr import schedules as s
from lmforge.lr.fields import SchedulerKeys, floor_ratio_of
from lmforge.utils.logging import get_logger

log = get_logger("lr")

# LrSchedulerConfig.learning_rate's default in the original.
DEFAULT_LEARNING_RATE = 1e-5

_LR = "a learning rate"
_WARMUP_KEYS = ("learning_rate", "warmup_steps", "warmup_ratio", "warmup_lr_init")


@dataclass(frozen=True)
class _SchedulerType:
    accepted: tuple[str, ...]  # besides ``type`` and ``total_steps``
    build: Callable[[SchedulerKeys, int, list[str]], s.Schedule]


# -- shared pieces ---------------------------------------------------------------------------------


def _base_lr(keys: SchedulerKeys) -> float:
    return keys.number("learning_rate", DEFAULT_LEARNING_RATE, what=_LR)


def _warmup(keys: SchedulerKeys, total: int, notes: list[str]) -> dict[str, Any]:
    """warmup_steps / warmup_ratio / warmup_lr_init; the ratio wins, as in the original's _get_lr_steps."""
    ratio = keys.ratio("warmup_ratio", "warmup")
    steps = keys.steps("warmup_steps", 0, "warmup")
    if ratio is not None:
        if keys.given("warmup_steps"):
            notes.append(
                f"{keys.dotted('warmup_steps')} ({steps}) is ignored: {keys.dotted('warmup_ratio')} is also set "
                f"and wins, giving {floor_ratio_of(ratio, total)} warm-up steps."
            )
        steps = floor_ratio_of(ratio, total)
    if steps > total:
        notes.append(
            f"the warm-up ({steps} steps) is longer than training.steps ({total}): the lr never reaches "
            f"{keys.dotted('learning_rate')}."
        )
    return {
        "warmup_steps": steps,
        "warmup_lr_init": keys.number("warmup_lr_init", 0.0, what=_LR),
    }


def _decay_steps(keys: SchedulerKeys, total: int, default: int, notes: list[str], with_ratio: bool) -> int:
    """decay_steps (at least 1) or, where the scheduler takes it, decay_ratio (which wins)."""
    steps = keys.steps("decay_steps", None, "decay")
    resolved = max(1, steps) if steps is not None else default
    if with_ratio:
        ratio = keys.ratio("decay_ratio", "decay")
        if ratio is not None:
            if steps is not None:
                notes.append(
                    f"{keys.dotted('decay_steps')} ({steps}) is ignored: {keys.dotted('decay_ratio')} is also "
                    f"set and wins."
                )
            resolved = floor_ratio_of(ratio, total)
    return resolved


def _require_above_lr_end(keys: SchedulerKeys, base: float, lr_end: float) -> None:
    if not base > lr_end:
        raise keys.error(
            "lr_end",
            f"lr_end ({lr_end}) must be smaller than initial lr ({base}), i.e. {keys.dotted('learning_rate')}: "
            f"{keys.type_name} decays from the initial lr down to lr_end.",
        )


def _note_unused_learning_rate(keys: SchedulerKeys, used_instead: str, value: float | None, notes: list[str]):
    """These schedulers take their base lr elsewhere; an explicit, different learning_rate has no effect."""
    lr = keys.values.get("learning_rate")
    if lr is None or lr in (DEFAULT_LEARNING_RATE, value):
        return
    notes.append(
        f"{keys.dotted('learning_rate')} ({lr}) has no effect on {keys.type_name}: its base lr is "
        f"{keys.dotted(used_instead)}."
    )


# -- one builder per registered type --------------------------------------------------------------


def _constant_warmup(keys, total, notes):
    return s.ConstantWarmUpLR(base_lr=_base_lr(keys), total_steps=total, **_warmup(keys, total, notes))


def _linear_warmup(keys, total, notes):
    return s.LinearWithWarmUpLR(base_lr=_base_lr(keys), total_steps=total, **_warmup(keys, total, notes))


def _cosine_warmup(keys, total, notes):
    warmup = _warmup(keys, total, notes)
    decay_steps = _decay_steps(keys, total, max(1, total), notes, with_ratio=True)
    if warmup["warmup_steps"] > decay_steps:
        notes.append(
            f"the warm-up ({warmup['warmup_steps']} steps) is longer than the decay ({decay_steps} steps, "
            f"{keys.dotted('decay_steps')} / {keys.dotted('decay_ratio')}): from step {decay_steps} on the lr is "
            f"lr_end, so it never reaches {keys.dotted('learning_rate')} (the loss may not decrease)."
        )
    return s.CosineWithWarmUpLR(
        base_lr=_base_lr(keys),
        total_steps=total,
        **warmup,
        num_cycles=keys.number("num_cycles", 0.5, what="a number of cycles"),
        lr_end=keys.number("lr_end", 0.0, what=_LR),
        decay_steps=decay_steps,
    )


def _cosine_restarts(keys, total, notes):
    return s.CosineWithRestartsAndWarmUpLR(
        base_lr=_base_lr(keys),
        total_steps=total,
        **_warmup(keys, total, notes),
        # The spec: at least one whole cycle (below 1 the "restarts" schedule never restarts).
        num_cycles=keys.number("num_cycles", 1.0, minimum=1.0, what="a number of cycles"),
        lr_end=keys.number("lr_end", 0.0, what=_LR),
        decay_steps=_decay_steps(keys, total, max(1, total), notes, with_ratio=False),
    )


def _polynomial(keys, total, notes):
    base = _base_lr(keys)
    lr_end = keys.number("lr_end", 1e-7, what=_LR)
    _require_above_lr_end(keys, base, lr_end)
    warmup = _warmup(keys, total, notes)
    return s.PolynomialWithWarmUpLR(
        base_lr=base,
        total_steps=total,
        **warmup,
        lr_end=lr_end,
        # A negative power would divide by zero where the decay ends.
        power=keys.number("power", 1.0, what="a power"),
        decay_steps=_decay_steps(
            keys, total, max(1, total - warmup["warmup_steps"]), notes, with_ratio=False
        ),
    )


def _wsd(keys, total, notes):
    base = _base_lr(keys)
    lr_end = keys.number("lr_end", 1e-7, what=_LR)
    _require_above_lr_end(keys, base, lr_end)
    ratio = keys.ratio("decay_start_ratio", "decay_start")
    steps = keys.steps("decay_start_steps", None, "decay_start")
    if ratio is not None:
        if steps is not None:
            notes.append(
                f"{keys.dotted('decay_start_steps')} ({steps}) is ignored: {keys.dotted('decay_start_ratio')} "
                f"is also set and wins."
            )
        decay_start = floor_ratio_of(ratio, total)
        origin = f"{keys.dotted('decay_start_ratio')} ({ratio}) x training.steps ({total})"
    elif steps is not None:
        decay_start, origin = steps, f"{keys.dotted('decay_start_steps')} ({steps})"
    else:
        raise keys.error(
            "decay_start_steps",
            "The type of decay_start_step must be int, but got <class 'NoneType'>. WarmUpStableDecayLR needs "
            f"the step where its decay begins: set {keys.dotted('decay_start_steps')} (a step) or "
            f"{keys.dotted('decay_start_ratio')} (a fraction of training.steps).",
        )
    if decay_start >= total:
        raise keys.error(
            "decay_start_ratio" if ratio is not None else "decay_start_steps",
            f"the decay would start at step {decay_start} = {origin}, not before training.steps ({total}); "
            f"the decay runs from there to training.steps, so its length would be {total - decay_start} steps "
            f"(the original divides by it). Start the decay before step {total}.",
        )
    return s.WarmUpStableDecayLR(
        base_lr=base, total_steps=total, **_warmup(keys, total, notes), lr_end=lr_end, decay_start=decay_start
    )


def _constant_cooldown(keys, total, notes):
    lr_end1 = keys.number("lr_end1", 0.0, what=_LR)
    return s.ConstantWithCoolDownLR(
        base_lr=_base_lr(keys),
        total_steps=total,
        **_warmup(keys, total, notes),
        keep_steps=keys.steps("keep_steps", 0, "keep"),
        decay_steps=_decay_steps(keys, total, max(1, total), notes, with_ratio=True),
        num_cycles=keys.number("num_cycles", 0.5, what="a number of cycles"),
        lr_end1=lr_end1,
        final_steps=keys.steps("final_steps", 0, "final"),
        # Unset means lr_end1. The original's ``lr_end2 or lr_end1`` also turned an explicit 0 into
        # lr_end1; here 0 means 0.
        lr_end2=keys.number("lr_end2", lr_end1, what=_LR),
    )


def _cosine_annealing(keys, total, notes):
    if not keys.given("base_lr"):
        raise keys.error(
            "base_lr",
            "CosineAnnealingLR requires base_lr, its base learning rate (this scheduler names it base_lr, "
            "not learning_rate, which it does not use).",
        )
    base = keys.number("base_lr", 0.0, what=_LR)
    _note_unused_learning_rate(keys, "base_lr", base, notes)
    return s.CosineAnnealingLR(
        base_lr=base,
        total_steps=total,
        t_max=keys.positive_int("t_max", "Expected positive integer T_max, but got {value}"),
        eta_min=keys.number("eta_min", 0.0, what=_LR),
    )


def _cosine_warm_restarts(keys, total, notes):
    if not keys.given("base_lr"):
        raise keys.error(
            "base_lr",
            "CosineAnnealingWarmRestarts requires base_lr, its base learning rate (this scheduler names it "
            "base_lr, not learning_rate, which it does not use).",
        )
    base = keys.number("base_lr", 0.0, what=_LR)
    _note_unused_learning_rate(keys, "base_lr", base, notes)
    t_mult = 1
    if keys.given("t_mult"):
        t_mult = keys.positive_int("t_mult", "Expected positive integer t_mult, but got {value}")
    return s.CosineAnnealingWarmRestarts(
        base_lr=base,
        total_steps=total,
        t_0=keys.positive_int("t_0", "Expected positive integer t_0, but got {value}"),
        t_mult=t_mult,
        eta_min=keys.number("eta_min", 0.0, what=_LR),
    )


def _layer_wise(keys, total, notes):
    inner_values = keys.values.get("base_lr")
    if not isinstance(inner_values, dict):
        raise keys.error(
            "base_lr",
            "LearningRateWiseLayer needs base_lr: the schedule it scales, written as a nested lr_scheduler "
            "mapping (e.g. {type: CosineWithWarmUpLR, learning_rate: 3.e-4, warmup_ratio: 0.01}); got "
            f"{inner_values!r}.",
        )
    if not keys.given("lr_scale"):
        raise keys.error(
            "lr_scale", "LearningRateWiseLayer requires lr_scale, the multiplier (a number >= 0)."
        )
    scale = keys.number("lr_scale", 1.0, what="a multiplier")
    inner = _build(inner_values, keys.dotted("base_lr"), total)
    _note_unused_learning_rate(keys, "base_lr.learning_rate", None, notes)
    return s.LearningRateWiseLayer(
        base_lr=scale * inner.base_lr, total_steps=total, inner=inner, lr_scale=scale, warnings=inner.warnings
    )


SCHEDULER_TYPES: dict[str, _SchedulerType] = {
    "ConstantWarmUpLR": _SchedulerType(_WARMUP_KEYS, _constant_warmup),
    "LinearWithWarmUpLR": _SchedulerType(_WARMUP_KEYS, _linear_warmup),
    "CosineWithWarmUpLR": _SchedulerType(
        (*_WARMUP_KEYS, "num_cycles", "lr_end", "decay_steps", "decay_ratio"), _cosine_warmup
    ),
    "CosineWithRestartsAndWarmUpLR": _SchedulerType(
        (*_WARMUP_KEYS, "num_cycles", "lr_end", "decay_steps"), _cosine_restarts
    ),
    "PolynomialWithWarmUpLR": _SchedulerType((*_WARMUP_KEYS, "lr_end", "power", "decay_steps"), _polynomial),
    "WarmUpStableDecayLR": _SchedulerType(
        (*_WARMUP_KEYS, "lr_end", "decay_start_steps", "decay_start_ratio"), _wsd
    ),
    "ConstantWithCoolDownLR": _SchedulerType(
        (
            *_WARMUP_KEYS,
            "keep_steps",
            "decay_steps",
            "decay_ratio",
            "num_cycles",
            "lr_end1",
            "final_steps",
            "lr_end2",
        ),
        _constant_cooldown,
    ),
    # learning_rate is accepted (the section always carries it) but these take base_lr.
    "CosineAnnealingLR": _SchedulerType(("base_lr", "t_max", "eta_min", "learning_rate"), _cosine_annealing),
    "CosineAnnealingWarmRestarts": _SchedulerType(
        ("base_lr", "t_0", "t_mult", "eta_min", "learning_rate"), _cosine_warm_restarts
    ),
    "LearningRateWiseLayer": _SchedulerType(("base_lr", "lr_scale", "learning_rate"), _layer_wise),
}


def _schedulers_taking(key: str, except_type: str) -> list[str]:
    return [name for name, t in SCHEDULER_TYPES.items() if key in t.accepted and name != except_type]


def _check_yaml_total_steps(keys: SchedulerKeys, total: int) -> None:
    if not keys.given("total_steps"):
        return
    value = keys.values["total_steps"]
    if value != total or isinstance(value, bool):
        raise keys.error(
            "total_steps",
            f"is {value!r} but training.steps is {total}. The scheduler's total always comes from "
            f"training.steps (the original silently overrides this key); remove "
            f"{keys.dotted('total_steps')} or make it equal to training.steps.",
        )


def _build(values: dict[str, Any], path: str, total: int) -> s.Schedule:
    type_name = values.get("type")
    if type_name is None:
        raise ConfigError(
            f"{path}.type is required: the scheduler to use, one of {', '.join(SCHEDULER_TYPES)}."
        )
    if not isinstance(type_name, str) or type_name not in SCHEDULER_TYPES:
        close = difflib.get_close_matches(str(type_name), list(SCHEDULER_TYPES), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise ConfigError(
            f"{path}.type: unknown scheduler {type_name!r}{hint}. Valid types: {', '.join(SCHEDULER_TYPES)}."
        )
    kind = SCHEDULER_TYPES[type_name]
    keys = SchedulerKeys(values, path, type_name)
    accepted = ("type", *kind.accepted, "total_steps")
    keys.refuse_unknown(
        accepted, {k: _schedulers_taking(k, type_name) for k in values if _schedulers_taking(k, type_name)}
    )
    _check_yaml_total_steps(keys, total)
    notes: list[str] = []
    schedule = kind.build(keys, total, notes)
    if (
        schedule.base_lr == 0
        and max((schedule.lr_at(k) for k in range(min(total, 10_000) + 1)), default=0) == 0
    ):
        notes.append(
            f"{path}: the learning rate is 0 at every step, so no parameter will change (the loss stays "
            f"flat); set {path}.learning_rate (or base_lr) to the peak lr you want."
        )
    if notes:
        schedule = _with_warnings(schedule, notes)
    return schedule


def _with_warnings(schedule: s.Schedule, notes: list[str]) -> s.Schedule:
    import dataclasses

    return dataclasses.replace(schedule, warnings=(*schedule.warnings, *notes))


def schedule_of_values(values: dict[str, Any], path: str, total_steps: int) -> s.Schedule:
    """The schedule of a plain ``lr_scheduler`` mapping (warnings kept in ``schedule.warnings``, not
    logged): the typed form that ``load_config`` keeps on the section (lmforge.lr.schema)."""
    return _build(values, path, total_steps)


def build_scheduler(section: Any, total_steps: int, *, path: str = "lr_scheduler") -> s.Schedule:
    """The schedule of an ``lr_scheduler`` section (pydantic section or plain mapping).

    ``total_steps`` is ``training.steps``; it is the scheduler's total whatever the YAML says.
    Settings that have no effect (e.g. warmup_steps when warmup_ratio is also set) are logged as
    warnings and listed in ``schedule.warnings``.
    """
    if isinstance(total_steps, bool) or not isinstance(total_steps, int) or total_steps < 0:
        raise ConfigError(f"training.steps must be a whole number of steps >= 0, got {total_steps!r}.")
    typed = getattr(section, "typed", None)
    if isinstance(typed, s.Schedule) and typed.total_steps == total_steps:
        schedule = typed  # validated by load_config (lmforge.lr.schema)
    else:
        # Not typed by load_config (a mapping, or another total): the same schema, run now.
        values = section.to_dict() if hasattr(section, "to_dict") else dict(section or {})
        schedule = _build(copy.deepcopy(values), path, total_steps)
    for note in schedule.warnings:
        log.warning("%s", note)
    return schedule
